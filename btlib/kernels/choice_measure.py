"""What btlib.kernels.choice measures, and how: the cells, their inputs, the check, the interleaved rounds, the ranking.

Each (layout, dtype, T) cell: every candidate kernel (priority >= 0, runs on CPU tensors of the dtype) checked
first with btlib.kernels.check (one that fails is listed with the reason and never timed), one warm-up round (a
candidate :data:`SKIP_FACTOR` times slower than the fastest there is not timed, nor at larger T), then
:data:`ROUNDS` interleaved rounds (round r times each candidate once, each repeating its call for at least
:data:`MIN_ROUND_S`); a cell whose noise (a candidate's (max - min) / median over its rounds) is above
:data:`NOISE_LIMIT` is timed again with twice the rounds. The ranking: fastest median first, unless a kernel of
higher priority is within :data:`TIE` of it. ``timer`` is injectable so the rules can be tested on a script.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from .. import hardware
from ..padding import lengths_to_cu_seqlens
from ..precision import SlowPrecisionWarning
from . import registry
from .check import check

__all__ = ["CELLS", "DTYPES", "Cell", "Table", "cell_for", "measure", "ROUNDS", "TIE", "NOISE_LIMIT", "BUDGET_S",
           "SKIP_FACTOR", "candidates", "calls_range", "time_rounds"]

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
        return [{"layout": c.layout, "dtype": c.dtype, "calls": calls_range(c.layout, c.T), "measured at": c.shape, "pick": c.pick,
                 **{f"{k} ms": round(v, 3) for k, v in c.ms.items()}} for c in self.cells.values()]

    def __str__(self) -> str:
        lines = [f"attention kernels measured on {self.machine} ({self.source})"]
        for c in self.cells.values():
            lines.append(f"  {c.layout:6} {c.dtype} {calls_range(c.layout, c.T):<15} ({c.shape}): {c.why()}")
        return "\n".join(lines)


def calls_range(layout: str, T: int) -> str:
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



def candidates(layout: str, dtype: torch.dtype) -> list[registry.Kernel]:
    x = torch.empty(0, dtype=dtype)
    return [k for k in registry.kernels(layout) if k.priority >= 0 and k.supports(x.view(0, 0, 0, 0)) is None]



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

def time_rounds(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
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
                  timer=time_rounds) -> Cell:
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


def measure(timer=time_rounds) -> "Table":
    """Check, then time, every candidate at every cell (see the module docstring); nothing is read or written."""
    cells, busy = {}, []
    spent = 0.0
    with torch.inference_mode():
        for layout, Ts in CELLS.items():
            for dname, dtype in DTYPES.items():
                kernels = candidates(layout, dtype)
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


