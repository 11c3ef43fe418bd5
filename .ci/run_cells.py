"""Run a notebook's code cells in order, in one namespace, as a plain Python program: for machines without Jupyter.

    python .ci/run_cells.py NOTEBOOK [FIGURE_DIR]

Each cell's output is printed under a "=== cell N ===" line; the value of a cell's last expression is printed
as Jupyter would show it (unless the line ends with ';'); matplotlib figures are saved as FIGURE_DIR/cell_N_K.png.
A cell that raises is reported with its traceback and the run goes on; the exit status is the number of such cells.
.ci/gpu_check runs notebook 05 with it on a GPU machine whose Python has no Jupyter.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import traceback
from pathlib import Path


def main(path: str, figures: str | None = None) -> int:
    os.environ.setdefault("MPLBACKEND", "Agg")
    cells = [c for c in json.loads(Path(path).read_text())["cells"] if c["cell_type"] == "code"]
    namespace: dict = {"__name__": "__main__"}
    failed = 0
    for n, cell in enumerate(cells, 1):
        source = "".join(cell["source"])
        print(f"=== cell {n} ===", flush=True)
        try:
            tree = ast.parse(source)
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            exec(compile(tree, f"<cell {n}>", "exec"), namespace)
            if last is not None:
                value = eval(compile(ast.Expression(last.value), f"<cell {n}>", "eval"), namespace)
                if value is not None and not source.rstrip().endswith(";"):
                    print(repr(value))
        except Exception:
            failed += 1
            traceback.print_exc(file=sys.stdout)
        if figures and "matplotlib.pyplot" in sys.modules:
            import matplotlib.pyplot as plt

            for k, number in enumerate(plt.get_fignums()):
                Path(figures).mkdir(parents=True, exist_ok=True)
                plt.figure(number).savefig(Path(figures) / f"cell_{n}_{k}.png", dpi=80, bbox_inches="tight")
            plt.close("all")
        sys.stdout.flush()
    print(f"=== {len(cells)} cells, {failed} raised ===")
    return failed


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
