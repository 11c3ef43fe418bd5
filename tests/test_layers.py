"""btlib's layers hold: no import cycle, no import pointing up against docs/architecture.md's layer lines.

The graph is read with ``ast`` by .ci/import_graph.py (``python .ci/import_graph.py`` prints its numbers):
every import of a btlib module, at module level or inside a function, relative imports resolved. The layer
order is docs/architecture.md's: each line under ``btlib/`` in its block is one layer, top to bottom, so the
page and this test cannot drift apart.
"""

import importlib.util
import textwrap
from pathlib import Path

import pytest

TESTED_HERE = ["btlib.pretrained.folders", "btlib.pretrained.architectures"]

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / ".ci" / "import_graph.py")
ig = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ig)


@pytest.fixture(scope="module")
def graph():
    return ig.import_graph()


@pytest.fixture(scope="module")
def layers():
    return ig.architecture_layers()


def test_no_import_cycle(graph):
    assert ig.cycles(graph) == [], "modules that import each other (at module level or in a function): " \
                                   "move the shared code down to a layer both can import"


def test_no_import_points_up(graph, layers):
    upward = ig.upward_imports(graph, ig.layer_of(layers))
    assert upward == [], ("imports of a module on a higher line of docs/architecture.md's block (a lazy import "
                          "inside a function counts too): move the code down, or pass it in:\n" + "\n".join(upward))


def test_every_module_is_on_one_layer_line_and_every_name_exists(layers):
    placed = ig.layer_of(layers)
    unplaced = sorted(set(ig.module_files()) - set(placed))
    assert unplaced == [], f"modules no line under btlib/ in docs/architecture.md names: {unplaced}"
    paths = [ig.module_path(m) for m in ig.module_files()]
    stale = [e for names in layers for e in names
             if not any(p == e or (e.endswith("/") and p.startswith(e)) for p in paths)]
    assert stale == [], f"names in docs/architecture.md's block that are no module or package of btlib: {stale}"
    names = [e for names in layers for e in names]
    assert len(names) == len(set(names)), "a name is on two layer lines"
    assert layers[0] == ["__init__.py"], "the package's public names import from every layer: its line is the top"


def test_pretrained_folder_readers_never_import_an_architecture(graph):
    """btlib.pretrained is laid out by owner: folders/ reads a folder, architectures/ builds the networks on
    top of it. A folder reader that imported an architecture would make the two one layer again."""
    folders = {m for m in graph if m.startswith("btlib.pretrained.folders")}
    archs = {m for m in graph if m.startswith("btlib.pretrained.architectures")}
    assert len(folders) >= 5 and len(archs) >= 7, "the layout the test guards: folders/ and architectures/"
    up = sorted(f"{m} -> {t}" for m in folders for t in graph[m] if t in archs)
    assert up == [], f"folder readers importing an architecture: {up}"
    # every architecture reads its folder through folders/ (none re-implements config reading)
    readers = {m for m in archs if any(t in folders for t in graph[m])}
    assert readers, "no architecture imports btlib.pretrained.folders"


def test_the_graph_reader_resolves_lazy_and_relative_imports(tmp_path):
    """The reader on a tiny package: a function-level import counts, ``from . import x`` and ``from ..a import b``
    resolve, a cycle and an upward import are found."""
    pkg = tmp_path / "btlib"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .top import f\n",
        "top.py": "from .sub import low\n",
        "sub/__init__.py": "",
        "sub/low.py": "import os\n\ndef g():\n    from ..top import f  # lazy, upward\n    return f\n",
        "base.py": "import btlib.sub.low\nfrom btlib.top import f as _f\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text(textwrap.dedent("""\
        # Architecture

        ```python
        import btlib  # a block without the layer lines comes first: it is skipped
        ```

        ```
        btlib/       layers
          __init__.py
          top.py     the top
          sub/       below it
          base.py    the bottom
        data/
        ```
        """))
    graph = ig.import_graph(tmp_path)
    assert graph["btlib.sub.low"] == {"btlib.top": 4} and graph["btlib.top"] == {"btlib.sub.low": 1}
    assert set(graph["btlib.base"]) == {"btlib.sub.low", "btlib.top"} and set(graph["btlib"]) == {"btlib.top"}
    assert ig.cycles(graph) == [["btlib.sub.low", "btlib.top"]]
    layers = ig.architecture_layers(tmp_path)
    assert layers == [["__init__.py"], ["top.py"], ["sub/"], ["base.py"]]
    assert ig.upward_imports(graph, ig.layer_of(layers, tmp_path)) == [
        "btlib.base (line 1) -> btlib.sub.low", "btlib.base (line 2) -> btlib.top", "btlib.sub.low (line 4) -> btlib.top"]


def test_report_prints_the_numbers():
    text = ig.report()
    assert "modules," in text and "0 cycles" in text and "0 upward imports" in text and "largest modules" in text
