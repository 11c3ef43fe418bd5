"""Every module of btlib has a test file that names it.

The rule, read from the source with ``ast`` (nothing is imported or run):

- the modules are every ``.py`` file under ``btlib/`` (subpackages included); ``pkg/__init__.py`` is ``btlib.pkg``
  and ``pkg/__main__.py`` is ``btlib.pkg.__main__``;
- a test file is ``tests/test_*.py``; it names a module when, anywhere in the file,
  ``import btlib.x.y`` names ``btlib.x.y``,
  ``from btlib.x import a, b`` names ``btlib.x``, and ``btlib.x.a`` where ``a`` is itself a module,
  or a top-level ``TESTED_HERE = ["btlib.x.y", ...]`` lists it (for a module the file tests through a re-export,
  a subprocess or a private helper's public user).

A name re-exported by a package does not count for the module that defines it: ``from btlib import pack`` names
``btlib``, not ``btlib.padding``. So a module is listed here only when a test file says it tests it; whether that
test asserts something real is for the reader of that file (each file's docstring says what it checks).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "btlib"
TESTS = ROOT / "tests"


def btlib_modules() -> set[str]:
    """Dotted names of every module under btlib/ (btlib, btlib.padding, btlib.kernels.cpu.ops, ...)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.add(".".join(parts))
    return names


def declared(tree: ast.Module) -> list[str]:
    """The strings of a top-level ``TESTED_HERE = [...]`` (or tuple); [] where the file has none."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "TESTED_HERE" for t in node.targets):
            if not isinstance(node.value, (ast.List, ast.Tuple)):
                raise TypeError("TESTED_HERE must be a literal list of module names")
            return [ast.literal_eval(e) for e in node.value.elts]
    return []


def named_modules(path: Path, modules: set[str]) -> set[str]:
    """The btlib modules one test file names, by the rule in this file's docstring."""
    tree = ast.parse(path.read_text(), filename=str(path))
    named = set(declared(tree))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names if alias.name.split(".")[0] == "btlib")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "btlib":
            named.add(node.module)
            named.update(f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in modules)
    return named


def coverage() -> dict[str, set[str]]:
    """Test file name -> the btlib modules it names."""
    modules = btlib_modules()
    return {path.name: named_modules(path, modules) for path in sorted(TESTS.glob("test_*.py"))}


def test_the_rule_reads_imports_and_tested_here(tmp_path):
    # The rule itself, on a file written for it: each form in the docstring, and a re-export that does not count.
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        'import btlib.padding as P\nfrom btlib.kernels import registry, get\nfrom btlib import pack\n'
        'TESTED_HERE = ["btlib.quick"]\n'
        'def f():\n    from btlib.sdpa.explain import explain_sdpa\n'
    )
    named = named_modules(probe, btlib_modules())
    assert named == {"btlib.padding", "btlib.kernels", "btlib.kernels.registry", "btlib", "btlib.quick",
                     "btlib.sdpa.explain"}


def test_every_module_has_a_test_file():
    modules = btlib_modules()
    assert {"btlib", "btlib.padding", "btlib.kernels.cpu.ops", "btlib.bench.__main__"} <= modules
    named = set().union(*coverage().values())
    missing = sorted(modules - named)
    assert not missing, (
        f"no tests/test_*.py names these modules: {missing}. Write a test of the module's own behaviour and import it "
        "there (import btlib.x / from btlib.x import ...), or list it in that file's TESTED_HERE when the test reaches "
        "it another way.")


def test_tested_here_names_real_modules():
    # A TESTED_HERE entry that names no module (a rename, a typo) would hide a module without a test.
    modules = btlib_modules()
    stale = {name: sorted(set(declared(ast.parse((TESTS / name).read_text()))) - modules)
             for name in coverage()}
    assert not {k: v for k, v in stale.items() if v}, stale
