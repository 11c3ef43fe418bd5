"""btlib.hardware's cache file of measured rates: what a trustworthy entry looks like, and atomic writes.

    {key: {"fp32_gflops", "bf16_gflops": best GEMM rate of that precision, "fp32_n", "bf16_n": largest M timed,
           "gemm": {precision: {path: {str(M): GFLOP/s}}}, "gemm_pick": {"fp32" | "bf16" | "int8" | "int8 KxN": [[M_max, path], ...]}}}

An entry is used only if :func:`problem` finds nothing wrong with it: a file edited by hand, torn by a
crash or written by an older btlib must not steer the GEMM choice with rates that are not rates.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path

__all__ = ["FIELDS", "PATHS", "problem", "read_cache", "write_cache"]

FIELDS = ("fp32_gflops", "bf16_gflops", "fp32_n", "bf16_n", "gemm", "gemm_pick")
PATHS = ("torch", "onednn", "btlib")  # btlib.gemm.PATHS, spelled here so that reading the cache imports nothing above
INT8_PATHS = ("int_mm", "onednn_int8")  # btlib.gemm.INT8_PATHS, likewise


def _bad_rate(value) -> bool:
    return isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0


def problem(entry) -> str | None:
    """Why a cached entry cannot be trusted (None: it can): wrong shape, missing keys, rates not finite and >= 0."""
    if not isinstance(entry, dict):
        return f"an entry is a {type(entry).__name__}, not an object"
    missing = sorted(set(FIELDS) - set(entry))
    if missing:
        return f"an entry lacks {', '.join(missing)}"
    for name in ("fp32_gflops", "bf16_gflops"):
        if _bad_rate(entry[name]) or (name == "fp32_gflops" and entry[name] == 0):
            return f"{name} is {entry[name]!r}, not a positive finite rate"
    for name in ("fp32_n", "bf16_n"):
        if isinstance(entry[name], bool) or not isinstance(entry[name], int) or entry[name] < 0:
            return f"{name} is {entry[name]!r}, not a size"
    gemm, pick = entry["gemm"], entry["gemm_pick"]
    if not isinstance(gemm, dict) or not all(isinstance(by_path, dict) and all(
            isinstance(by_M, dict) and all(isinstance(M, str) and M.isdigit() and not _bad_rate(r) for M, r in by_M.items())
            for by_M in by_path.values()) for by_path in gemm.values()):
        return "gemm is not {precision: {path: {M: rate >= 0}}}"
    if not isinstance(pick, dict) or not all(isinstance(ranges, list) and ranges and all(
            isinstance(r, list) and len(r) == 2 and (r[0] is None or (type(r[0]) is int and r[0] > 0))
            and r[1] in (INT8_PATHS if precision.startswith("int8") else PATHS)
            for r in ranges) and ranges[-1][0] is None for precision, ranges in pick.items()):
        return f"gemm_pick is not {{precision: [[M_max, path in {PATHS} (int8: {INT8_PATHS})], ..., [None, path]]}}"
    return None


def read_cache(path: Path | None, key: str) -> tuple[dict | None, str | None]:
    """(the entry for key or None, why the file or that entry cannot be used or None)."""
    if path is None or not path.is_file():
        return None, None
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"it is not readable JSON ({type(e).__name__})"
    if not isinstance(entries, dict):
        return None, f"it holds a JSON {type(entries).__name__}, not an object"
    if key not in entries:
        return None, None
    why = problem(entries[key])
    return (None, why) if why else (entries[key], None)


def write_cache(path: Path | None, key: str, rates: dict) -> None:
    """Add key -> rates to the cache file atomically (a temp file beside it, then os.replace).

    Entries the file already holds for other keys are kept; a file that is not a JSON object is
    replaced. Nothing is left behind when writing fails (read-only checkout, the path a directory):
    the rates then stay cached in this process only.
    """
    if path is None:
        return
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    entries = entries if isinstance(entries, dict) else {}
    entries[key] = rates
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
