"""Execute the workbook's notebooks headless: ``python -m btlib.workbook run | refresh``.

- ``run``: every notebook into build/notebooks/ (the committed ones are never rewritten),
  an HTML copy of each into build/html/, benchmark rows into build/bench/, and a summary.
- ``refresh NB ...``: re-execute notebooks in place to update their committed outputs.

Outputs are cleaned of this machine's paths (checkout, home, temp dir) before they are written.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def _scrubber():
    roots = {str(ROOT), str(ROOT.parent), str(Path.home()), tempfile.gettempdir(), sys.prefix}
    pattern = re.compile("|".join(re.escape(r.rstrip("/")) for r in sorted(roots, key=len, reverse=True) if len(r) > 1))

    def scrub(text: str) -> str:
        return pattern.sub(".", text)

    return scrub


def clean_outputs(nb) -> None:
    """Replace machine paths in every text output with '.'; drop per-cell timing metadata."""
    scrub = _scrubber()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = scrub(out["text"])
            for key in ("text/plain", "text/html", "text/markdown"):
                if key in out.get("data", {}):
                    val = out["data"][key]
                    out["data"][key] = scrub(val) if isinstance(val, str) else [scrub(v) for v in val]


def execute(path: Path, out: Path, *, timeout: int = 3600) -> float:
    """Run one notebook top to bottom (cwd = notebooks/) and write it, cleaned, to ``out``. Returns seconds."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    t0 = time.time()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    clean_outputs(nb)
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    return time.time() - t0


def to_html(path: Path, out: Path) -> None:
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_filename(str(path))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m btlib.workbook")
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="execute every notebook into build/, with HTML copies and a benchmark summary")
    r.add_argument("notebooks", nargs="*", type=Path)
    r.add_argument("--build", type=Path, default=ROOT / "build")
    f = sub.add_parser("refresh", help="re-execute notebooks in place (updates committed outputs)")
    f.add_argument("notebooks", nargs="+", type=Path)
    args = parser.parse_args(argv)

    nbs = [p.resolve() for p in args.notebooks] or sorted(NOTEBOOKS.glob("[0-9]*.ipynb"))
    mode = "quick" if os.environ.get("BTLIB_QUICK") else "default"
    if args.cmd == "run":
        os.environ.setdefault("BTLIB_RESULTS_DIR", str(args.build / "bench"))
    for nb in nbs:
        target = nb if args.cmd == "refresh" else args.build / "notebooks" / nb.name
        print(f"executing {nb.name} ({mode} sizes) ...", flush=True)
        secs = execute(nb, target)
        print(f"  {secs:.0f} s -> {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}", flush=True)
        if args.cmd == "run":
            to_html(target, args.build / "html" / nb.with_suffix(".html").name)
    if args.cmd == "run":
        from .bench.__main__ import main as bench_main

        bench_main(["summary", os.environ["BTLIB_RESULTS_DIR"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
