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
interleaved rounds after a warm-up, at :data:`CELLS`: per layout and dtype (fp32, bf16) three sizes, H 12,
D 64, no mask beyond the padding, no window, no bias, grad off. Padded: B x T = 2,048 tokens without padding;
varlen: a seeded mix of lengths up to T. A call's ``seqlen`` (padded: T; varlen: max_seqlen) picks the cell
by range: up to the geometric midpoint between two measured T's, the lower one's ranking.

How a cell ranks: each candidate's median over :data:`ROUNDS` rounds; the fastest wins unless a kernel of
higher priority is within :data:`TIE` of it (priority is the tie-break only). ``select`` then walks the
ranking and takes the first kernel that accepts the call (a window, a bias, causal, needs_grad, head_dim),
then the unmeasured kernels in priority order: for a windowed or biased call the cell's order is the proxy.

Trust: the measurement is ~2-10 s (plus the C++ build if it is cold) and runs once per machine, at the
first "auto" call on CPU fp32 or bf16 tensors, under a lock. It is kept on disk beside the GEMM rates
(btlib.hardware's cache directory, ``btlib_attention.json``), keyed like them (CPU model and flags, torch,
threads, the variables that restrict torch's ISA) plus btlib's C++ build, a digest of its sources and the
candidates' names, so a new or changed kernel, another build (``BTLIB_CPU_ISA``) or ``BTLIB_ASSUME_NO_BF16``
measures again. As for the GEMM
rates, a measurement taken on a busy machine is not written: one that overran :data:`BUDGET_S`, or a cell
whose noise (spread of a candidate's rounds over its median) stayed above :data:`NOISE_LIMIT` after a
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
import statistics
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .. import hardware
from ..hardware_cache import write_cache
from ..padding import lengths_to_cu_seqlens
from ..precision import SlowPrecisionWarning
from . import registry
from .check import check

__all__ = ["CELLS", "Cell", "table", "ranking", "explain", "cache_file", "MODE_VAR", "TIE", "ROUNDS", "BUDGET_S",
           "NOISE_LIMIT", "cell_for"]

MODE_VAR = "BTLIB_ATTENTION_CHOICE"  # "measure" (default) or "priority"
H, D = 12, 64
TOKENS = 2048          # padded cells: B = TOKENS // T sequences of T tokens
CELLS = {"padded": (128, 512, 1024), "varlen": (128, 512, 1024)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROUNDS = 5             # interleaved rounds per cell (the median of each candidate's rounds is its time)
WARMUP = 1             # rounds per candidate before the timed ones (they only decide who is far too slow to time)
MIN_ROUND_S = 0.004    # a round of one candidate repeats its call until it lasts at least this long
TIE = 0.03             # a higher-priority kernel within 3% of the fastest wins the cell
SKIP_FACTOR = 8.0      # a candidate whose warm-up is this much slower than the fastest is not timed (nor at larger T)
NOISE_LIMIT = 0.5      # (max - min) / median of a candidate's rounds above this: the cell is measured again
BUDGET_S = 30.0        # a whole measurement (without the C++ build) taking longer: the machine was busy
_VERSION = 1           # bump when what is measured changes, so old tables are measured again

_lock = threading.RLock()
_memo: dict[str, "Table"] = {}
_ranked: dict[tuple, tuple[str, ...] | None] = {}  # ranking()'s answers, keyed by all they depend on
_DNAMES = {d: n for n, d in DTYPES.items()}
# the variables a table's key reads besides the thread count (btlib.hardware's ISA limits, the build, bf16, the mode)
_KEY_VARS = ("BTLIB_CPU_ISA", "BTLIB_ASSUME_NO_BF16", MODE_VAR, *hardware.ISA_VARS)


@dataclass(frozen=True)
class Cell:
    """One measured point: layout, dtype name, T; times in ms (median of the rounds) and noise per candidate."""

    layout: str
    dtype: str
    T: int
    shape: str                  # what was timed, e.g. "B 4, H 12, T 512, D 64"
    ms: dict                    # {kernel: median ms}, fastest first
    noise: dict                 # {kernel: (max - min) / median over the rounds}
    skipped: dict               # {kernel: why it was not timed}
    pick: str                   # the ranking's first
    order: tuple                # every timed kernel, the pick first (ties broken by priority)

    def why(self) -> str:
        """One line: the pick, its time, and every other candidate's time as a multiple of it."""
        best = self.ms[self.pick]
        others = [f"{k} {self.ms[k]:.3g} ms ({self.ms[k] / best:.2f}x)" for k in self.order[1:]]
        tie = ""
        fastest = min(self.ms, key=self.ms.get)
        if fastest != self.pick:
            tie = f"; {fastest} measured {best / self.ms[fastest]:.2f}x faster, within the {TIE:.0%} tie, and {self.pick} has the higher priority"
        skipped = "".join(f"; {k} not timed: {why}" for k, why in self.skipped.items())
        return f"{self.pick} {best:.3g} ms (noise ±{self.noise[self.pick]:.0%})" + (", then " + ", ".join(others) if others else "") + tie + skipped


@dataclass(frozen=True)
class Table:
    """Every cell of one machine's measurement, and where it came from."""

    cells: dict                 # {(layout, dtype name, T): Cell}
    source: str                 # "measured now", "cached in <file>", or why it is this process's only
    machine: str                # CPU, build, threads: what the times belong to
    kept: bool                  # written to disk (a quiet, complete measurement)

    def rows(self) -> list[dict]:
        """One dict per cell, for a notebook table."""
        return [{"layout": c.layout, "dtype": c.dtype, "calls": _range(c.layout, c.T), "measured at": c.shape, "pick": c.pick,
                 **{f"{k} ms": round(v, 3) for k, v in c.ms.items()}} for c in self.cells.values()]

    def __str__(self) -> str:
        lines = [f"attention kernels measured on {self.machine} ({self.source})"]
        for c in self.cells.values():
            lines.append(f"  {c.layout:6} {c.dtype} {_range(c.layout, c.T):<15} ({c.shape}): {c.why()}")
        return "\n".join(lines)


def _range(layout: str, T: int) -> str:
    """The seqlens whose calls follow the cell at T, e.g. "256 < T <= 724"."""
    i = CELLS[layout].index(T)
    lo = None if i == 0 else _upper(layout, CELLS[layout][i - 1])
    up = _upper(layout, T)
    return (f"{lo} < " if lo else "") + "T" + (f" <= {up}" if up else "")


def _upper(layout: str, T: int) -> int | None:
    """The largest seqlen whose calls follow the cell at T (None: no limit)."""
    Ts = CELLS[layout]
    i = Ts.index(T)
    return None if i == len(Ts) - 1 else int(math.sqrt(Ts[i] * Ts[i + 1]))


def cell_for(layout: str, seqlen: int | None) -> int | None:
    """The measured T whose ranking a call of this seqlen follows; None for "no seqlen" (every cell counts)."""
    if seqlen is None:
        return None
    for T in CELLS[layout]:
        up = _upper(layout, T)
        if up is None or seqlen <= up:
            return T
    return CELLS[layout][-1]


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


def _candidates(layout: str, dtype: torch.dtype) -> list[registry.Kernel]:
    x = torch.empty(0, dtype=dtype)
    return [k for k in registry.kernels(layout) if k.priority >= 0 and k.supports(x.view(0, 0, 0, 0)) is None]


@functools.cache
def _sources() -> str:
    """A digest of the C++ kernels' sources: a changed kernel is measured again (its old times are not its times)."""
    h = hashlib.sha256()
    for f in sorted((Path(__file__).parent / "cpu").glob("*.[ch]*")):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def _key() -> str:
    threads = torch.get_num_threads()
    names = ",".join(k.name for layout in CELLS for d in DTYPES.values() for k in _candidates(layout, d))
    facts = (f"{_VERSION}|{hardware.cache_key(threads)}|{hardware.isa()}|{hardware.bf16_native()[0]}|{hardware.amx()[0]}"
             f"|{names}|{_sources()}")
    return hashlib.sha256(facts.encode()).hexdigest()[:16]


def _machine() -> str:
    return (f"{hardware.cpu_name()}, btlib build {hardware.isa()}, torch {torch.__version__} "
            f"({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads")


# ---------------------------------------------------------------- the inputs of a cell

def _lengths(T: int) -> list[int]:
    """A seeded mix of lengths, the longest T: 16 sequences at T 128 (queries, sentences), 8 above (passages)."""
    g = torch.Generator().manual_seed(T)
    n = 16 if T <= 128 else 8
    L = torch.randint(max(1, T // 50), T + 1, (n,), generator=g).tolist()
    L[0] = T
    return L


def _inputs(layout: str, dtype: torch.dtype, T: int) -> tuple[tuple, dict, str]:
    g = torch.Generator().manual_seed(0)
    if layout == "padded":
        B = max(1, TOKENS // T)
        q, k, v = torch.randn(3, B, H, T, D, generator=g).to(dtype).unbind(0)
        return (q, k, v), {"lengths": None}, f"B {B}, H {H}, T {T}, D {D}"
    L = _lengths(T)
    cu, max_seqlen = lengths_to_cu_seqlens(torch.tensor(L))
    q, k, v = torch.randn(3, sum(L), H, D, generator=g).to(dtype).unbind(0)
    return (q, k, v, cu, max_seqlen), {}, f"{len(L)} sequences of {min(L)}-{max(L)} tokens ({sum(L)} in all), H {H}, D {D}"


# ---------------------------------------------------------------- timing

def _time_rounds(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Each candidate's seconds per call in each round, interleaved: round r times every candidate once."""
    reps = {}
    for name, f in calls.items():  # how many calls make a round last MIN_ROUND_S
        t0 = time.perf_counter()
        f()
        reps[name] = max(1, math.ceil(MIN_ROUND_S / max(time.perf_counter() - t0, 1e-6)))
    out = {name: [] for name in calls}
    for _ in range(rounds):
        for name, f in calls.items():
            t0 = time.perf_counter()
            for _ in range(reps[name]):
                f()
            out[name].append((time.perf_counter() - t0) / reps[name])
    return out


def _noise(ts: list[float]) -> float:
    return (max(ts) - min(ts)) / statistics.median(ts)


def _rank(ms: dict[str, float], priority: dict[str, int]) -> tuple[str, ...]:
    """Fastest first; a kernel within TIE of a faster one of lower priority goes ahead of it."""
    order = sorted(ms, key=ms.get)
    best = ms[order[0]]
    tied = [k for k in order if ms[k] <= best * (1 + TIE)]
    first = max(tied, key=lambda k: (priority[k], -ms[k]))
    return (first, *[k for k in order if k != first])


def _measure_cell(layout: str, dname: str, T: int, kernels: list[registry.Kernel], skip: dict[str, str],
                  timer=_time_rounds) -> Cell:
    dtype = DTYPES[dname]
    args, kw, shape = _inputs(layout, dtype, T)
    calls = {k.name: (lambda k=k: k.fn(*args, **kw, causal=False, scale=None)) for k in kernels if k.name not in skip}
    skipped = {k.name: skip[k.name] for k in kernels if k.name in skip}
    warm = {n: min(ts) for n, ts in timer(calls, WARMUP).items()}  # untimed for the ranking: the first calls warm up
    fastest = min(warm.values())
    for name in [n for n, t in warm.items() if t > SKIP_FACTOR * fastest and len(calls) > 1]:
        skipped[name] = skip[name] = f"its warm-up call took {warm[name] / fastest:.0f}x the fastest's at T {T}"
        del calls[name]
    for attempt in (1, 2):
        times = timer(calls, ROUNDS * attempt)
        noise = {n: _noise(ts) for n, ts in times.items()}
        if max(noise.values()) <= NOISE_LIMIT:
            break
    ms = {n: statistics.median(ts) * 1e3 for n, ts in times.items()}
    prio = {k.name: k.priority for k in kernels}
    order = _rank(ms, prio)
    return Cell(layout, dname, T, shape, dict(sorted(ms.items(), key=lambda kv: kv[1])), noise, skipped, order[0], order)


def _checked(kernels: list[registry.Kernel], dtype: torch.dtype) -> tuple[list[registry.Kernel], dict[str, str]]:
    """The kernels that pass their check in dtype (the one correctness check: btlib.kernels.check), and why not for the rest.
    Run first: it also builds a compiled kernel, so the build never lands inside the timed budget."""
    ok, bad = [], {}
    for k in kernels:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SlowPrecisionWarning)
            r = check(k, "cpu", dtype, causal=(False,), windows=[], biases=())
        if r.ok:
            ok.append(k)
        else:
            bad[k.name] = "failed its check: " + "; ".join(r.failures[:2])
    return ok, bad


def measure(timer=_time_rounds) -> "Table":
    """Check, then time, every candidate at every cell (see the module docstring); nothing is read or written."""
    cells, busy = {}, []
    spent = 0.0
    with torch.inference_mode():
        for layout, Ts in CELLS.items():
            for dname, dtype in DTYPES.items():
                kernels = _candidates(layout, dtype)
                skip = dict(_checked(kernels, dtype)[1])  # a kernel that fails its check is listed, never timed
                t0 = time.perf_counter()
                for T in Ts:
                    if not [k for k in kernels if k.name not in skip]:
                        break
                    cell = _measure_cell(layout, dname, T, kernels, skip, timer)
                    cells[(layout, dname, T)] = cell
                    if max(cell.noise.values()) > NOISE_LIMIT:
                        busy.append(f"{layout} {dname} T {T}: noise ±{max(cell.noise.values()):.0%}")
                spent += time.perf_counter() - t0
    if spent > BUDGET_S:
        busy.append(f"the measurement took {spent:.0f} s, more than {BUDGET_S:.0f} s")
    kept = not busy
    source = "measured now" if kept else "measured now on a busy machine, used in this process only: " + "; ".join(busy)
    return Table(cells, source, _machine(), kept)


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
            if (c["layout"] not in CELLS or c["dtype"] not in DTYPES or c["T"] not in CELLS[c["layout"]] or not ms
                    or set(order) != set(ms) or not set(ms) <= names or not all(math.isfinite(v) and v > 0 for v in ms.values())):
                return None
            cells[(c["layout"], c["dtype"], c["T"])] = Cell(c["layout"], c["dtype"], c["T"], str(c["shape"]), ms,
                                                             {str(k): float(v) for k, v in c["noise"].items()},
                                                             dict(c["skipped"]), order[0], order)
        return Table(cells, f"cached in {path.name}, measured {entry['measured']}", str(entry["machine"]), True)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def table(*, refresh: bool = False, timer=_time_rounds) -> Table:
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
            t = measure(timer)
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
    fast = (layout, dname, cell_for(layout, seqlen), torch.get_num_threads(), len(registry._REGISTRY),
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
            device: str = "cpu", needs_grad: bool = False, window=None, bias=None, head_dim: int = D) -> str:
    """Why ``backend="auto"`` takes the kernel it takes for such a call: the measured cell, or the priority."""
    x = torch.empty(0, H, 1, head_dim, dtype=dtype, device=device) if layout == "padded" else \
        torch.empty(0, H, head_dim, dtype=dtype, device=device)
    k = registry.select(layout, x, causal, needs_grad=needs_grad, window=window, bias=bias, seqlen=seqlen)
    dname = next((n for n, d in DTYPES.items() if d == dtype), str(dtype).replace("torch.", ""))
    what = f"{layout} {dname} attention" + (f" at T {seqlen}" if seqlen is not None else "")
    order = ranking(layout, dtype, seqlen, device)
    if order is None:
        why = ("measuring is off (" + MODE_VAR + "=priority)" if not enabled() else
               f"only CPU fp32 / bf16 calls are measured ({torch.device(device).type}, {dname})")
        return f"auto takes {k.name} for {what}: the highest priority that accepts the call, because {why}"
    t = table()
    T = cell_for(layout, seqlen)
    if T is None:
        cells = [c for c in t.cells.values() if c.layout == layout and c.dtype == dname]
        basis = "the least time over every measured T:\n" + "\n".join(f"  T {c.T}: {c.why()}" for c in cells)
    else:
        c = t.cells[(layout, dname, T)]
        basis = f"measured at {c.shape} (the cell for {_range(layout, T)}): {c.why()}"
    ahead = [n for n in order[: order.index(k.name)]] if k.name in order else list(order)
    passed = ""
    if ahead:
        reasons = [f"{n}: {registry.get(n).supports(x, causal, needs_grad, window, bias)}" for n in ahead]
        passed = "\n  passed over, as it cannot take this call: " + "; ".join(reasons)
    return f"auto takes {k.name} for {what} on {t.machine} ({t.source}), {basis}{passed}"
