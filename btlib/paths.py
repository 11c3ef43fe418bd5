"""Where the workbook's data files are: $BTLIB_DATA_DIR, else the checkout's data/ folder."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["data_file"]


def data_file(name: str) -> Path:
    """Path of data/<name>. Raises FileNotFoundError saying where it looked and what to do."""
    candidates = []
    if os.environ.get("BTLIB_DATA_DIR"):
        candidates.append(Path(os.environ["BTLIB_DATA_DIR"]) / name)
    candidates.append(Path(__file__).resolve().parents[1] / "data" / name)  # editable install / checkout
    for c in candidates:
        if c.is_file():
            return c
    raise FileNotFoundError(
        f"data file {name!r} not found (looked in {', '.join(str(c.parent) for c in candidates)}). "
        "Run from a clone of the workbook, or set BTLIB_DATA_DIR to its data/ folder."
    )
