"""An open-loop Poisson load generator for anything with ``submit(texts) -> Future`` (a :class:`BatchEncoder` or a baseline).

    texts = workload("mixed", 512)                      # 80% short queries, 20% ~200-token passages
    r = run_load(batcher.submit, texts, rate=100, duration_s=5)   # {"p50_ms", "p95_ms", "p99_ms", "answered", "refused", ...}
    best, trials = max_rate(lambda: BatchEncoder(model), texts, slo_ms=250, q=95, min_requests=100)

Open loop: requests arrive at Poisson times whatever the server does (as users do), one text each;
latency runs from the scheduled arrival to the answer, so a generator that falls behind counts
against the server, never for it. Little's law ties the numbers together: requests in the system =
arrival rate x mean latency; when the rate passes what the server drains, the queue (and p99) grows
without bound, which is the saturation knee :func:`max_rate` looks for.

A percentile needs requests beyond it: a trial of n requests measures p99 only when n >= 500 (five slower
than it, btlib.serve.stats.MIN_TAIL), p95 from 100, p90 from 50. ``min_requests`` makes a trial last until
that many have arrived, however low its rate, so the percentile a search names is one every trial measured.
"""

from __future__ import annotations

import gc
import random
import threading
import time
from concurrent.futures import Future, wait
from typing import Callable, Sequence

from .batcher import Overloaded
from .stats import percentile, percentile_interval

__all__ = ["PERCENTILES", "poisson_arrivals", "workload", "run_load", "bounded", "max_rate", "rss_mb"]

_WORDS = ("the of and to in is for on that with as by it at from this be are or an was which model text token batch "
          "query search vector server queue latency packing padding attention layer encoder sentence embedding corpus "
          "request answer memory length budget worker thread arrival rate throughput cache index passage document").split()


PERCENTILES = (50, 90, 95, 99)  # what run_load reports, each as p{q}_ms with its interval p{q}_interval_ms


def poisson_arrivals(rate: float, duration_s: float, seed: int = 0, min_requests: int = 0) -> list[float]:
    """Arrival times in s: exponential gaps of mean 1 / rate (a Poisson process), within [0, duration_s), and
    on past it until there are ``min_requests`` (a low rate's trial lasts long enough for its percentile)."""
    if not rate > 0 or not duration_s > 0:
        raise ValueError(f"rate and duration_s must be > 0; got {rate!r}, {duration_s!r}")
    rng, t, out = random.Random(seed), 0.0, []
    while (t := t + rng.expovariate(rate)) < duration_s or len(out) < min_requests:
        out.append(t)
    return out


def workload(name: str, n: int, seed: int = 0, passage_share: float = 0.2) -> list[str]:
    """``n`` texts: "queries" (4-14 words, ~8-20 tokens) or "mixed" (``passage_share`` of ~200-token passages among them)."""
    if name not in ("queries", "mixed"):
        raise ValueError(f"workload must be 'queries' or 'mixed'; got {name!r}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.randint(150, 190) if name == "mixed" and rng.random() < passage_share else rng.randint(4, 14)
        out.append(" ".join(rng.choice(_WORDS) for _ in range(words)))
    return out


def rss_mb() -> float | None:
    """This process's resident memory in MiB (Linux /proc), or None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            import os

            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


def run_load(submit: Callable[[list[str]], Future], texts: Sequence[str], rate: float, duration_s: float, *, seed: int = 0,
             drain_timeout_s: float = 60.0, stop_on_refusal: bool = False, min_requests: int = 0) -> dict:
    """Offer ``rate`` requests/s (one text each, cycling through ``texts``) for ``duration_s``; wait for the answers.

    Returns rate, offered, answered, refused (Overloaded at submit, or as the future's exception: a remote
    server's 429 through :class:`btlib.serve.remote.HttpEncoder`), errors (the future raised anything else), lost
    (accepted but not answered within ``drain_timeout_s`` after the last arrival: must be 0), mean_ms, and of the
    answered p50_ms, p90_ms, p95_ms, p99_ms, each with its ~95% interval (``p99_interval_ms``:
    btlib.serve.stats.percentile_interval), throughput (answered per second of the whole run). stop_on_refusal:
    end the run at the first refusal (a search only needs to know the rate is too high). min_requests: offer at
    least that many (:func:`poisson_arrivals`).
    """
    # The caller's objects (a notebook's, torch's: hundreds of thousands) are frozen out of the cyclic collector for the
    # run: a full collection walks them all, holding the GIL ~0.1 s, which stalled this generator and the server under
    # test alike, whichever method's trial it fell in (btlib.serve's server freezes its start-up objects for the same
    # reason). Thawed after the run; a caller that froze objects itself keeps them frozen.
    thaw = gc.get_freeze_count() == 0
    gc.freeze()
    try:
        return _run_load(submit, texts, rate, duration_s, seed, drain_timeout_s, stop_on_refusal, min_requests)
    finally:
        if thaw:
            gc.unfreeze()


def _run_load(submit, texts, rate, duration_s, seed, drain_timeout_s, stop_on_refusal, min_requests) -> dict:
    arrivals = poisson_arrivals(rate, duration_s, seed, min_requests)
    latency: dict[int, float] = {}
    futures: list[Future] = []
    refused = 0
    refused_late = threading.Event()
    start = time.perf_counter()

    def answered(f: Future, i: int, a: float) -> None:
        if f.exception() is None:
            latency[i] = (time.perf_counter() - start - a) * 1e3
        elif isinstance(f.exception(), Overloaded):
            refused_late.set()

    for i, a in enumerate(arrivals):
        if stop_on_refusal and refused_late.is_set():
            break
        if (ahead := a - (time.perf_counter() - start)) > 0:
            time.sleep(ahead)
        try:
            f = submit([texts[i % len(texts)]])
        except Overloaded:
            refused += 1
            if stop_on_refusal:
                break
            continue
        f.add_done_callback(lambda f, i=i, a=a: answered(f, i, a))
        futures.append(f)
    wait(futures, timeout=drain_timeout_s)
    elapsed = time.perf_counter() - start
    done = [f for f in futures if f.done()]
    late = sum(1 for f in done if isinstance(f.exception(), Overloaded))
    errors = sum(1 for f in done if f.exception() is not None) - late
    lat = list(latency.values())
    out = {"rate": rate, "offered": len(arrivals), "answered": len(done) - errors - late, "refused": refused + late, "errors": errors,
           "lost": len(futures) - len(done), "mean_ms": sum(lat) / len(lat) if lat else None,
           "throughput": (len(done) - errors - late) / elapsed}
    for q in PERCENTILES:
        out[f"p{q}_ms"], out[f"p{q}_interval_ms"] = percentile(lat, q), percentile_interval(lat, q)
    return out


def bounded(r: dict, slo_ms: float, q: int = 99) -> bool:
    """Served: every request answered (none refused, failed or lost) and the ``q``-th percentile within ``slo_ms``."""
    return r["refused"] == r["errors"] == r["lost"] == 0 and r[f"p{q}_ms"] is not None and r[f"p{q}_ms"] <= slo_ms


def max_rate(make: Callable[[], object], texts: Sequence[str], *, slo_ms: float = 250.0, start: float = 16.0,
             duration_s: float = 3.0, refine: int = 3, ceiling: float = 8192.0, seed: int = 0, q: int = 99,
             min_requests: int = 0) -> tuple[float, list[dict]]:
    """The highest Poisson rate (req/s) ``make()``'s batcher serves with the ``q``-th percentile of latency within
    ``slo_ms``: double from ``start`` (halve while it fails, down to start / 16), then bisect ``refine`` times between
    the last served and the first failed rate. Each trial lasts ``duration_s`` and offers at least ``min_requests``.

    make() returns a fresh server with ``submit`` and ``close`` per trial (a full queue from a failed
    trial must not leak into the next). Returns (rate, every trial's :func:`run_load` result, each with
    ``bounded``); rate 0 if even start / 16 is too high.
    """
    trials: list[dict] = []

    def ok(rate: float) -> bool:
        server = make()
        try:
            r = run_load(server.submit, texts, rate, duration_s, seed=seed, stop_on_refusal=True, min_requests=min_requests)
        finally:
            server.close()
        r["bounded"] = bounded(r, slo_ms, q)
        trials.append(r)
        return r["bounded"]

    good, bad = 0.0, start
    while bad <= ceiling and ok(bad):
        good, bad = bad, bad * 2
    while good == 0.0 and bad > start / 16:
        good, bad = (bad / 2, bad) if ok(bad / 2) else (0.0, bad / 2)
    if good == 0.0:
        return 0.0, trials
    for _ in range(refine):
        mid = (good + bad) / 2
        good, bad = (mid, bad) if ok(mid) else (good, mid)
    return good, trials
