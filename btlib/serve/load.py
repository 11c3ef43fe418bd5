"""An open-loop Poisson load generator for anything with ``submit(texts) -> Future`` (a :class:`BatchEncoder` or a baseline).

    texts = workload("mixed", 512)                      # 80% short queries, 20% ~200-token passages
    r = run_load(batcher.submit, texts, rate=100, duration_s=5)   # {"p50_ms", "p99_ms", "answered", "refused", "lost", ...}
    best, trials = max_rate(lambda: BatchEncoder(model), texts, slo_ms=250)

Open loop: requests arrive at Poisson times whatever the server does (as users do), one text each;
latency runs from the scheduled arrival to the answer, so a generator that falls behind counts
against the server, never for it. Little's law ties the numbers together: requests in the system =
arrival rate x mean latency; when the rate passes what the server drains, the queue (and p99) grows
without bound, which is the saturation knee :func:`max_rate` looks for.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future, wait
from typing import Callable, Sequence

from .batcher import Overloaded
from .stats import percentile

__all__ = ["poisson_arrivals", "workload", "run_load", "bounded", "max_rate", "rss_mb"]

_WORDS = ("the of and to in is for on that with as by it at from this be are or an was which model text token batch "
          "query search vector server queue latency packing padding attention layer encoder sentence embedding corpus "
          "request answer memory length budget worker thread arrival rate throughput cache index passage document").split()


def poisson_arrivals(rate: float, duration_s: float, seed: int = 0) -> list[float]:
    """Arrival times in s within [0, duration_s): exponential gaps of mean 1 / rate (a Poisson process)."""
    if not rate > 0 or not duration_s > 0:
        raise ValueError(f"rate and duration_s must be > 0; got {rate!r}, {duration_s!r}")
    rng, t, out = random.Random(seed), 0.0, []
    while (t := t + rng.expovariate(rate)) < duration_s:
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
             drain_timeout_s: float = 60.0, stop_on_refusal: bool = False) -> dict:
    """Offer ``rate`` requests/s (one text each, cycling through ``texts``) for ``duration_s``; wait for the answers.

    Returns rate, offered, answered, refused (Overloaded at submit, or as the future's exception: a remote
    server's 429 through :class:`btlib.serve.remote.HttpEncoder`), errors (the future raised anything else), lost
    (accepted but not answered within ``drain_timeout_s`` after the last arrival: must be 0), mean_ms, p50_ms
    and p99_ms of the answered, throughput (answered per second of the whole run). stop_on_refusal: end the
    run at the first refusal (a search only needs to know the rate is too high).
    """
    arrivals = poisson_arrivals(rate, duration_s, seed)
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
    return {"rate": rate, "offered": len(arrivals), "answered": len(done) - errors - late, "refused": refused + late, "errors": errors,
            "lost": len(futures) - len(done), "mean_ms": sum(lat) / len(lat) if lat else None, "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
            "throughput": (len(done) - errors - late) / elapsed}


def bounded(r: dict, slo_ms: float) -> bool:
    """Served: every request answered (none refused, failed or lost) and p99 within ``slo_ms``."""
    return r["refused"] == r["errors"] == r["lost"] == 0 and r["p99_ms"] is not None and r["p99_ms"] <= slo_ms


def max_rate(make: Callable[[], object], texts: Sequence[str], *, slo_ms: float = 250.0, start: float = 16.0,
             duration_s: float = 3.0, refine: int = 3, ceiling: float = 8192.0, seed: int = 0) -> tuple[float, list[dict]]:
    """The highest Poisson rate (req/s) ``make()``'s batcher serves with bounded p99: double from ``start`` (halve while
    it fails, down to start / 16), then bisect ``refine`` times between the last served and the first failed rate.

    make() returns a fresh server with ``submit`` and ``close`` per trial (a full queue from a failed
    trial must not leak into the next). Returns (rate, every trial's :func:`run_load` result); rate 0
    if even start / 16 is too high.
    """
    trials: list[dict] = []

    def ok(rate: float) -> bool:
        server = make()
        try:
            r = run_load(server.submit, texts, rate, duration_s, seed=seed, stop_on_refusal=True)
        finally:
            server.close()
        trials.append(r)
        return bounded(r, slo_ms)

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
