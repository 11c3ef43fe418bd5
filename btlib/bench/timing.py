"""The one measurement protocol of every benchmark in the workbook, defined here and printed from here.

    >>> from btlib.bench.timing import protocol
    >>> print(protocol(quick=False))          # doctest: +NORMALIZE_WHITESPACE
    2 interleaved rounds per point; each round: 1 warm-up call (the call checked against the reference is the
    first), then at least 5 timed calls and 0.3 s (at most 50 calls); a row keeps its best round's median; noise
    is the next-best round over the best; a point whose noise is above 50% gets 2 more rounds with trials twice
    as long, and if it stays above, its comparisons read "too noisy to compare here"

Why each part: rounds interleave the providers in time (round k starts with the k-th provider), so a burst of
someone else's work lands on one round of each rather than on all of one provider's calls; the warm-up call
pays first-call costs (a build, a cache miss, a lazy allocation) outside the timing; a trial lasts long enough
for the clock and many calls, and no longer; the best round is the one least disturbed, and the gap to the
next best is how far the time is to be trusted. Noise above :data:`NOISE_LIMIT` means the rounds disagree by
more than half: no verdict built on them means anything, so the harness measures again, then says so.

Notebook cells print :func:`protocol` rather than typing a number of rounds or calls, so the words cannot
drift from what ran. ``BTLIB_QUICK=1`` (CI) takes :data:`QUICK`: one round of a few calls, enough to check
that every cell runs, never enough for a verdict (its noise is that of one run's calls).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..quick import quick_mode
from ..fold import Folded

__all__ = ["Protocol", "DEFAULT", "QUICK", "NOISE_LIMIT", "protocol", "protocol_note", "time_fn"]

NOISE_LIMIT = 0.5  # noise above this is a failed measurement, not a verdict


@dataclass(frozen=True)
class Protocol:
    """How a benchmark point is timed: rounds, warm-up, calls and time per trial, retries of a noisy point."""

    rounds: int          # interleaved rounds per point (run_rounds)
    warmup: int          # untimed calls before each round's timed calls (at least 1)
    min_calls: int       # timed calls per round, at least
    max_calls: int       # ... at most
    min_trial_s: float   # a round's timed calls last at least this long (unless max_calls comes first)
    retry_rounds: int    # more rounds for a point whose noise is above NOISE_LIMIT, with trials twice as long

    def timing(self, **override: Any) -> dict:
        """The keyword arguments of :func:`time_fn` for one round, with ``override`` applied (warmup at least 1)."""
        t = {"warmup": self.warmup, "min_runs": self.min_calls, "max_runs": self.max_calls, "min_time_s": self.min_trial_s,
             **override}
        t["warmup"] = max(1, int(t["warmup"]))
        return t

    def __str__(self) -> str:
        rounds = f"{self.rounds} interleaved round{'s' * (self.rounds != 1)} per point"
        fixed = self.min_calls >= self.max_calls  # as many calls as the cap: the trial time cannot add any
        trial = (f"exactly {self.max_calls} timed calls" if fixed else
                 f"at least {self.min_calls} timed calls" + (f" and {self.min_trial_s:g} s" if self.min_trial_s else ""))
        keep = ("a row keeps its best round's median; noise is the next-best round over the best" if self.rounds > 1 else
                "a row keeps its median; noise is its median over its fastest call")
        retry = (f"a point whose noise is above {NOISE_LIMIT:.0%} gets {self.retry_rounds} more rounds with trials twice "
                 "as long, and if it stays above, its comparisons read \"too noisy to compare here\"" if self.retry_rounds and self.rounds > 1 else
                 f"noise above {NOISE_LIMIT:.0%} reads \"too noisy to compare here\"")
        warm = f"{self.warmup} warm-up call{'s' * (self.warmup != 1)} (the call checked against the reference is the first)"
        return f"{rounds}; each round: {warm}, then {trial}{'' if fixed else f' (at most {self.max_calls} calls)'}; {keep}; {retry}"


DEFAULT = Protocol(rounds=2, warmup=1, min_calls=5, max_calls=50, min_trial_s=0.3, retry_rounds=2)
QUICK = Protocol(rounds=1, warmup=1, min_calls=3, max_calls=5, min_trial_s=0.0, retry_rounds=0)


def protocol(quick: bool | None = None) -> Protocol:
    """The protocol in force: :data:`QUICK` under BTLIB_QUICK=1 (or quick=True), else :data:`DEFAULT`."""
    return QUICK if (quick_mode() if quick is None else quick) else DEFAULT


def protocol_note(quick: bool | None = None) -> Folded:
    """The protocol in force as one folded line for a notebook's setup: "every benchmark below: 2 interleaved rounds
    per point, after warm-up (the whole protocol folded)"; printed, the whole sentence."""
    p = protocol(quick)
    return Folded(f"every benchmark below: {p.rounds} interleaved round{'s' * (p.rounds != 1)} per point, after warm-up, "
                  "checked against its reference first (the whole protocol folded)", f"every benchmark below: {p}")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], Any], *, device: str = "cpu", warmup: int = DEFAULT.warmup, min_runs: int = DEFAULT.min_calls,
            max_runs: int = DEFAULT.max_calls, min_time_s: float = DEFAULT.min_trial_s, warmed: int = 0) -> list[float]:
    """Times of repeated ``fn()`` calls in ms, after ``warmup`` calls (at least one).

    warmed: calls of ``fn`` made just before (btlib.bench.run's check call), which count towards the warm-up.
    Runs at least ``min_runs`` times and keeps going until ``min_time_s`` has passed or
    ``max_runs`` is reached. On CUDA each call is bracketed by events (GPU time, no host gaps).
    """
    for _ in range(max(1, warmup) - max(0, warmed)):
        fn()
    _sync(device)
    times: list[float] = []
    start_all = time.perf_counter()
    while len(times) < min_runs or (time.perf_counter() - start_all < min_time_s and len(times) < max_runs):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times
