"""btlib's import graph, read with ``ast`` (no btlib import, no torch): modules, edges, cycles, layers, sizes.

Counts every import of a btlib module: module-level and function-level (a lazy import still makes the
importer depend on the imported module), relative imports resolved against the importing module's package.
``from .pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg`` itself. The
package a module sits in is not counted as imported (Python runs its __init__ first, but that is the
package's own layer question, checked where the package imports).

The layers are the lines under ``btlib/`` in docs/architecture.md's code block, top to bottom: a
line indented two spaces names the modules (``x.py``) and packages (``pkg/``) of one layer, paths
relative to btlib/; the most specific name covers a module. tests/test_layers.py checks the graph
against them.

    python .ci/import_graph.py [ROOT]     modules, edges, levels, cycles, upward imports, largest modules
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of btlib, by dotted name (a package by its own name, for its __init__.py)."""
    out = {}
    for path in sorted((root / "btlib").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name that ``from <level dots><target> import ...`` in ``module`` refers to."""
    if level == 0:
        return target or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(name: str, path: Path, modules: set[str]) -> set[tuple[str, int]]:
    """The btlib modules ``name`` imports, each with the line of its first import."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in modules else base)
        for target in targets:
            while target and target not in modules:  # `import btlib.a.b` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.setdefault(target, node.lineno)
    return set(found.items())


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """{module: {imported module: line}} over btlib."""
    files = module_files(root)
    return {name: dict(imports_of(name, path, set(files))) for name, path in files.items()}


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def depth(graph: dict[str, dict[str, int]]) -> int:
    """The number of levels: the longest import chain, in modules, over the graph with each cycle merged."""
    comp = {m: m for m in graph}
    for c in cycles(graph):
        for m in c:
            comp[m] = c[0]
    edges: dict[str, set[str]] = {}
    for m, targets in graph.items():
        edges.setdefault(comp[m], set()).update(comp[t] for t in targets if comp[t] != comp[m])
    memo: dict[str, int] = {}

    def level(v: str) -> int:
        if v not in memo:
            memo[v] = 1 + max((level(w) for w in edges.get(v, ())), default=0)
        return memo[v]

    return max(level(v) for v in edges)


def largest(root: Path = ROOT, n: int = 10) -> list[tuple[int, str]]:
    sizes = [(len(p.read_text().splitlines()), name) for name, p in module_files(root).items()]
    return sorted(sizes, reverse=True)[:n]


ARCHITECTURE = "docs/architecture.md"


def architecture_layers(root: Path = ROOT) -> list[list[str]]:
    """The layers docs/architecture.md draws, top first: each a list of names (``x.py``, ``pkg/``), from its first
    code block with a line starting ``btlib/``."""
    text = (root / ARCHITECTURE).read_text()
    blocks = text.split("```")[1::2]  # the insides of the fenced blocks
    block = next((b for b in blocks if re.search(r"^btlib/", b, re.MULTILINE)), None)
    if block is None:
        raise ValueError(f"{ARCHITECTURE} has no code block with a line starting 'btlib/'")
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("btlib/"))
    layers = []
    for line in lines[start + 1:]:
        if line[:1].strip():  # the next top-level entry (data/, tests/, ...): btlib's lines are over
            break
        if re.match(r"^  \S", line):
            names = []
            for token in line.split():
                if not re.fullmatch(r"[\w/]+(\.py|/)", token):
                    break
                names.append(token)
            layers.append(names)
    return layers


def module_path(name: str, root: Path = ROOT) -> str:
    """btlib.kernels.cpu.build -> 'kernels/cpu/build.py'; a package -> its '.../__init__.py'."""
    return module_files(root)[name].relative_to(root / "btlib").as_posix()


def layer_of(layers: list[list[str]], root: Path = ROOT) -> dict[str, int]:
    """{module: index of its layer line (0: top)} by the most specific name covering it; a module no line covers
    is left out (test_layers names it)."""
    out = {}
    for name in module_files(root):
        path = module_path(name, root)
        best = None
        for i, names in enumerate(layers):
            for entry in names:
                if path == entry or (entry.endswith("/") and path.startswith(entry)):
                    if best is None or len(entry) > best[0]:
                        best = (len(entry), i)
        if best is not None:
            out[name] = best[1]
    return out


def upward_imports(graph: dict[str, dict[str, int]], layer: dict[str, int]) -> list[str]:
    """Every import of a module on a line above the importer's: 'btlib.a (line 12) -> btlib.b'."""
    return [f"{m} (line {line}) -> {t}" for m, targets in sorted(graph.items()) for t, line in sorted(targets.items())
            if m in layer and t in layer and layer[t] < layer[m]]


def report(root: Path = ROOT) -> str:
    graph = import_graph(root)
    found = cycles(graph)
    try:
        layers = architecture_layers(root)
        upward = upward_imports(graph, layer_of(layers, root))
        layer_text = f"{len(layers)} layers in {ARCHITECTURE}, {len(upward)} upward imports"
    except (OSError, ValueError):  # no layer lines (older checkouts)
        upward, layer_text = [], f"no layer lines in {ARCHITECTURE}"
    lines = [f"{len(graph)} modules, {sum(map(len, graph.values()))} import edges, {depth(graph)} levels (longest "
             f"import chain), {len(found)} cycles; {layer_text}"]
    lines += [f"  cycle: {{{', '.join(c)}}}" for c in found]
    lines += [f"  upward: {u}" for u in upward]
    lines.append("largest modules (lines): " + ", ".join(f"{name} {n}" for n, name in largest(root)))
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT))
