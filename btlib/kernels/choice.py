"""Which kernel ``backend="auto"`` takes on this machine: timed here, not assumed from a fixed order.

The fastest attention kernel depends on the CPU. On an AVX-512 + BF16 CPU btlib's v3 bf16 path (vdpbf16ps)
beats PyTorch's SDPA; on an Intel Xeon with AMX, PyTorch's SDPA runs bf16 through oneDNN on the AMX tiles
and is several times faster than v3; on an AVX2-only CPU neither has bf16 instructions. A priority fixed in
the source is right on one of them at most. So "auto" on the CPU follows a measurement:

    >>> from btlib.kernels import choice
    >>> print(choice.explain("padded", torch.bfloat16, seqlen=512))            # doctest: +SKIP
    auto takes torch_sdpa for padded bf16 attention at T <= 724 (measured at T 512, B 4, H 12, D 64): ...

What is measured: every kernel of the layout with ``priority >= 0`` (PyTorch's own included; the teaching
versions and the oracle are never candidates) that runs here on CPU tensors of the dtype, each first checked
against the reference (:func:`btlib.kernels.check`: a kernel that disagrees is not timed), then timed in
interleaved rounds after a warm-up (btlib.kernels.choice_measure: the cells, the timing and the ranking rules), at ``CELLS``: per layout and dtype (fp32, bf16) three sizes, H 12,
D 64, no mask beyond the padding, no window, no bias, grad off. Padded: B x T = 2,048 tokens without padding;
varlen: a seeded mix of lengths up to T. A call's ``seqlen`` (padded: T; varlen: max_seqlen) picks the cell
by range: up to the geometric midpoint between two measured T's, the lower one's ranking.

How a cell ranks: each candidate's median over ``ROUNDS`` rounds; the fastest wins unless a kernel of
higher priority is within ``TIE`` (3%) of it (priority is the tie-break only). ``select`` then walks the
ranking and takes the first kernel that accepts the call (a window, a bias, causal, needs_grad, head_dim),
then the unmeasured kernels in priority order: for a windowed or biased call the cell's order is the proxy.

Trust: the measurement is ~2-10 s (plus the C++ build if it is cold) and runs once per machine, at the
first "auto" call on CPU fp32 or bf16 tensors, under a lock. It is kept on disk beside the GEMM rates
(btlib.hardware's cache directory, ``btlib_attention.json``), keyed like them (CPU model and flags, torch,
threads, the variables that restrict torch's ISA) plus btlib's C++ build, a digest of its sources and the
candidates' names, so a new or changed kernel, another build (``BTLIB_CPU_ISA``) or ``BTLIB_ASSUME_NO_BF16``
measures again. As for the GEMM
rates, a measurement taken on a busy machine is not written: one that overran ``BUDGET_S``, or a cell
whose noise (spread of a candidate's rounds over its median) stayed above ``NOISE_LIMIT`` (50%) after a
second try, is used in this process only. ``BTLIB_ATTENTION_CHOICE=priority`` turns measuring off
(the fixed priority order, e.g. for tests that assert a pick); ``choice.table(refresh=True)`` measures again.
GPU tensors and other dtypes keep the priority order (nothing is measured on a GPU here).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import threading
import time
from pathlib import Path

import torch

from .. import hardware
from ..hardware_cache import write_cache
from . import choice_measure as cm
from . import registry
from .choice_measure import CELLS, DTYPES, Cell, Table, calls_range, cell_for

__all__ = ["CELLS", "Cell", "Table", "table", "ranking", "explain", "cache_file", "MODE_VAR", "cell_for", "forget"]

MODE_VAR = "BTLIB_ATTENTION_CHOICE"  # "measure" (default) or "priority"
_VERSION = 1           # bump when what is measured changes, so old tables are measured again

_lock = threading.RLock()
_memo: dict[str, Table] = {}
_ranked: dict[tuple, tuple[str, ...] | None] = {}  # ranking()'s answers, keyed by all they depend on
_DNAMES = {d: n for n, d in DTYPES.items()}
# the variables a table's key reads besides the thread count (btlib.hardware's ISA limits, the build, bf16, the mode)
_KEY_VARS = ("BTLIB_CPU_ISA", "BTLIB_ASSUME_NO_BF16", MODE_VAR, *hardware.ISA_VARS)


def enabled() -> bool:
    mode = os.environ.get(MODE_VAR, "measure").lower()
    if mode not in ("measure", "priority"):
        raise ValueError(f"{MODE_VAR} must be 'measure' (auto times the kernels here) or 'priority' (the fixed "
                         f"order); got {mode!r}")
    return mode == "measure"


def cache_file() -> Path | None:
    """btlib_attention.json beside btlib.hardware's GEMM rates (None: nowhere to keep it)."""
    f = hardware.cache_file()
    return None if f is None else f.with_name("btlib_attention.json")


@functools.cache
def _sources(root: Path = Path(__file__).parent / "cpu") -> str:
    """A digest of the C++ kernels' sources, the family folders' included (flash/, teaching/): a changed kernel is
    measured again (its old times are not its times)."""
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        if f.suffix in (".cpp", ".h"):  # not __pycache__/*.pyc, which come and go
            h.update(f.relative_to(root).as_posix().encode() + f.read_bytes())
    return h.hexdigest()[:16]


def _key() -> str:
    threads = torch.get_num_threads()
    names = ",".join(k.name for layout in cm.CELLS for d in cm.DTYPES.values() for k in cm.candidates(layout, d))
    facts = (f"{_VERSION}|{hardware.cache_key(threads)}|{hardware.isa()}|{hardware.bf16_native()[0]}|{hardware.amx()[0]}"
             f"|{names}|{_sources()}")
    return hashlib.sha256(facts.encode()).hexdigest()[:16]



# ---------------------------------------------------------------- the cache

def _to_json(t: Table) -> dict:
    return {"version": _VERSION, "machine": t.machine, "measured": time.strftime("%Y-%m-%d %H:%M"),
            "cells": [{"layout": c.layout, "dtype": c.dtype, "T": c.T, "shape": c.shape, "ms": c.ms, "noise": c.noise,
                       "skipped": c.skipped, "order": list(c.order)} for c in t.cells.values()]}


def _from_json(entry, names: set[str], path: Path) -> Table | None:
    """The cached table, or None when the entry is not one this btlib wrote for these kernels (then it is measured again)."""
    try:
        cells = {}
        for c in entry["cells"]:
            ms = {str(k): float(v) for k, v in c["ms"].items()}
            order = tuple(c["order"])
            if (c["layout"] not in cm.CELLS or c["dtype"] not in cm.DTYPES or c["T"] not in cm.CELLS[c["layout"]] or not ms
                    or set(order) != set(ms) or not set(ms) <= names or not all(math.isfinite(v) and v > 0 for v in ms.values())):
                return None
            cells[(c["layout"], c["dtype"], c["T"])] = Cell(c["layout"], c["dtype"], c["T"], str(c["shape"]), ms,
                                                             {str(k): float(v) for k, v in c["noise"].items()},
                                                             dict(c["skipped"]), order[0], order)
        return Table(cells, f"cached in {path.name}, measured {entry['measured']}", str(entry["machine"]), True)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def table(*, refresh: bool = False, timer=cm.time_rounds) -> Table:
    """This machine's measured table (cached in this process and on disk); refresh=True measures again."""
    key = _key()
    with _lock:
        if refresh:
            _ranked.clear()
        if not refresh and key in _memo:
            return _memo[key]
        path = cache_file()
        t = None
        if not refresh and path is not None and path.is_file():
            try:
                entries = json.loads(path.read_text())
            except (OSError, ValueError):
                entries = {}
            entry = entries.get(key) if isinstance(entries, dict) else None
            if entry is not None:
                names = {k.name for k in registry.kernels()}
                t = _from_json(entry, names, path)
        if t is None:
            t = cm.measure(timer)
            if t.kept:
                write_cache(path, key, _to_json(t))
        _memo[key] = t
        return t


def forget() -> None:
    """Drop this process's tables (the disk cache stays): the next "auto" reads or measures again."""
    with _lock:
        _memo.clear()
        _ranked.clear()


def ranking(layout: str, dtype: torch.dtype, seqlen: int | None, device: torch.device | str) -> tuple[str, ...] | None:
    """The kernel names "auto" tries first for this call, fastest first; None: the priority order applies
    (measuring off, not a CPU tensor, or a dtype that is not measured). Asked on every "auto" call: after the
    first, one dict lookup keyed by what the answer depends on (~2 us)."""
    if (device.type if isinstance(device, torch.device) else torch.device(device).type) != "cpu" or not enabled():
        return None
    dname = _DNAMES.get(dtype)
    if dname is None:
        return None
    fast = (layout, dname, cm.cell_for(layout, seqlen), torch.get_num_threads(), len(registry._REGISTRY),
            *(os.environ.get(v) for v in _KEY_VARS))
    if fast in _ranked:
        return _ranked[fast]
    with _lock:
        _ranked[fast] = found = _ranking(layout, dname, fast[2])
    return found


def _ranking(layout: str, dname: str, T: int | None) -> tuple[str, ...] | None:
    t = table()
    if T is not None:
        cell = t.cells.get((layout, dname, T))
        return None if cell is None else cell.order
    cells = [c for c in t.cells.values() if c.layout == layout and c.dtype == dname]  # no seqlen: the best over all
    if not cells:
        return None
    common = set.intersection(*(set(c.ms) for c in cells))
    score = {k: sum(math.log(c.ms[k] / c.ms[c.pick]) for c in cells) for k in common}
    prio = {k.name: k.priority for k in registry.kernels(layout)}
    return tuple(sorted(common, key=lambda k: (round(score[k] / len(cells), 2), -prio.get(k, 0))))


def explain(layout: str, dtype: torch.dtype = torch.float32, seqlen: int | None = None, *, causal: bool = False,
            device: str = "cpu", needs_grad: bool = False, window=None, bias=None, head_dim: int = cm.D) -> str:
    """Why ``backend="auto"`` takes the kernel it takes for such a call: the measured cell, or the priority."""
    x = torch.empty(0, cm.H, 1, head_dim, dtype=dtype, device=device) if layout == "padded" else \
        torch.empty(0, cm.H, head_dim, dtype=dtype, device=device)
    k = registry.select(layout, x, causal, needs_grad=needs_grad, window=window, bias=bias, seqlen=seqlen)
    dname = next((n for n, d in DTYPES.items() if d == dtype), str(dtype).replace("torch.", ""))
    what = f"{layout} {dname} attention" + (f" at T {seqlen}" if seqlen is not None else "")
    order = ranking(layout, dtype, seqlen, device)
    if order is None:
        why = ("measuring is off (" + MODE_VAR + "=priority)" if not enabled() else
               f"only CPU fp32 / bf16 calls are measured ({torch.device(device).type}, {dname})")
        return f"auto takes {k.name} for {what}: the highest priority that accepts the call, because {why}"
    t = table()
    T = cm.cell_for(layout, seqlen)
    if T is None:
        cells = [c for c in t.cells.values() if c.layout == layout and c.dtype == dname]
        basis = "the least time over every measured T:\n" + "\n".join(f"  T {c.T}: {c.why()}" for c in cells)
    else:
        c = t.cells[(layout, dname, T)]
        basis = f"measured at {c.shape} (the cell for {calls_range(layout, T)}): {c.why()}"
    ahead = [n for n in order[: order.index(k.name)]] if k.name in order else list(order)
    passed = ""
    if ahead:
        reasons = [f"{n}: {registry.get(n).supports(x, causal, needs_grad, window, bias)}" for n in ahead]
        passed = "\n  passed over, as it cannot take this call: " + "; ".join(reasons)
    return f"auto takes {k.name} for {what} on {t.machine} ({t.source}), {basis}{passed}"
