""".ci/run_cells.py: notebook 05's cells as a plain program on a GPU machine without Jupyter (.ci/gpu_check)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_spec = importlib.util.spec_from_file_location("run_cells", Path(__file__).resolve().parents[1] / ".ci" / "run_cells.py")
run_cells = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_cells)


def _notebook(tmp_path, *sources):
    cells = [{"cell_type": "markdown", "source": ["# title"]}]
    cells += [{"cell_type": "code", "source": [s]} for s in sources]
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps({"cells": cells}))
    return path


def test_cells_share_a_namespace_show_last_values_and_save_figures(tmp_path, capsys):
    path = _notebook(tmp_path, "x = 6\nprint('hello')", "x * 7", "x;",
                     "import matplotlib.pyplot as plt\nplt.plot([1, 2])")
    assert run_cells.main(str(path), str(tmp_path / "figs")) == 0
    out = capsys.readouterr().out
    assert "=== cell 1 ===\nhello\n=== cell 2 ===\n42\n=== cell 3 ===\n=== cell 4 ===" in out
    assert (tmp_path / "figs" / "cell_4_0.png").stat().st_size > 0
    assert out.rstrip().endswith("=== 4 cells, 0 raised ===")


def test_a_cell_that_raises_is_reported_and_the_run_goes_on(tmp_path, capsys):
    path = _notebook(tmp_path, "1 / 0", "print('after')", "undefined_name")
    assert run_cells.main(str(path)) == 2
    out = capsys.readouterr().out
    assert "ZeroDivisionError" in out and "after" in out and "NameError" in out
    assert "=== 3 cells, 2 raised ===" in out
