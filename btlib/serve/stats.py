"""What a batcher counts, and the Prometheus text format it is served in (GET /metrics).

Counters only grow; the distributions (latency, batch size) keep the last ``window`` values in a
ring, so memory stays flat however long the server runs, and the percentiles describe recent load.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field

from .metrics import BATCH_SIZE_BUCKETS, LENGTH_BUCKETS, Histogram

__all__ = ["BatcherStats", "percentile", "percentile_interval", "supported_percentile", "MIN_TAIL", "prometheus_text",
           "tei_batch_text"]

MIN_TAIL = 5  # requests that must lie beyond a percentile for a trial to measure it (p99: 500 requests, p95: 100)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values`` by nearest rank, or None for no values.

    [10, 20, 30, 40] -> p50 20, p99 40 (nearest rank: the smallest value with at least q% at or below it).
    """
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def percentile_interval(values: list[float], q: float, z: float = 1.96) -> tuple[float, float] | None:
    """A distribution-free ~95% confidence interval of the ``q``-th percentile of the population ``values`` are drawn
    from: the order statistics at ranks n p -+ z sqrt(n p (1 - p)) (the binomial count of values below the true
    percentile), clipped to the sample; None for no values.

    100 values 1..100, q 95 -> (90, 100): a p95 from 100 requests is known to about 10 ranks, and its upper end
    is the slowest request.
    """
    if not values:
        return None
    s, n, p = sorted(values), len(values), q / 100
    half = z * math.sqrt(n * p * (1 - p))
    lo, hi = max(1, math.floor(n * p - half)), min(n, math.ceil(n * p + half) + 1)
    return s[lo - 1], s[hi - 1]


def supported_percentile(n: int, min_tail: int = MIN_TAIL) -> int | None:
    """The highest of p99, p95, p90, p50 that ``n`` requests measure: at least ``min_tail`` of them lie beyond it
    (n (1 - q / 100) >= min_tail); None below 2 min_tail. 500 -> 99, 100 -> 95, 50 -> 90, 10 -> 50."""
    return next((q for q in (99, 95, 90, 50) if n * (100 - q) >= 100 * min_tail), None)


@dataclass
class BatcherStats:
    """Thread-safe counters and recent distributions of one batcher. ``snapshot()`` reads them all at once."""

    window: int = 4096
    requests: int = 0       # accepted requests (each a list of texts)
    texts: int = 0          # texts in accepted requests
    refused: int = 0        # requests refused with Overloaded
    failed: int = 0         # requests whose batch raised (the error went to their future)
    batches: int = 0
    tokens: int = 0         # tokens encoded (what the forward passes cost)
    busy_s: float = 0.0     # time spent inside the model
    _prior_tokens: int = 0  # a full batch timed at start (prime)
    _prior_s: float = 0.0
    _latency_ms: deque = field(default_factory=deque)
    _batch_tokens: deque = field(default_factory=deque)
    _batch_texts: deque = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    batch_size_hist: Histogram = field(default_factory=lambda: Histogram(BATCH_SIZE_BUCKETS))  # TEI's te_batch_next_size
    batch_tokens_hist: Histogram = field(default_factory=lambda: Histogram(LENGTH_BUCKETS))  # te_batch_next_tokens

    def __post_init__(self):
        self._latency_ms = deque(maxlen=self.window)
        self._batch_tokens = deque(maxlen=self.window)
        self._batch_texts = deque(maxlen=self.window)

    def accepted(self, n_texts: int) -> None:
        with self._lock:
            self.requests += 1
            self.texts += n_texts

    def refuse(self) -> None:
        with self._lock:
            self.refused += 1

    def batch(self, n_texts: int, n_tokens: int, seconds: float, latencies_ms: list[float], failed: bool) -> None:
        """One forward pass over ``n_tokens`` tokens of ``n_texts`` texts, and the latency of each request it finished."""
        with self._lock:
            self.batches += 1
            self.tokens += n_tokens
            self.busy_s += seconds
            self.failed += len(latencies_ms) if failed else 0
            self._batch_tokens.append(n_tokens)
            self._batch_texts.append(n_texts)
            self._latency_ms.extend(latencies_ms)
        if n_tokens:  # a failed batch's retry counts its tokens when it runs
            self.batch_size_hist.observe(n_texts)
            self.batch_tokens_hist.observe(n_tokens)

    def prime(self, tokens: int, seconds: float) -> None:
        """Count a forward timed at start (btlib.serve.admission.start_rate) in :meth:`tokens_per_s`, not in the
        counters: the rate then exists before the first request, and the batches that run refine it."""
        with self._lock:
            self._prior_tokens, self._prior_s = tokens, seconds

    def tokens_per_s(self) -> float | None:
        """Tokens per second of model time so far, the start's timed batch included (None before any): how fast the
        queue drains."""
        with self._lock:
            seconds = self.busy_s + self._prior_s
            return (self.tokens + self._prior_tokens) / seconds if seconds > 0 else None

    def snapshot(self) -> dict:
        """Counters, then recent percentiles: latency_p50/p90/p99_ms, batch_tokens_p50/max, batch_texts_p50."""
        with self._lock:
            lat, bt, bx = list(self._latency_ms), list(self._batch_tokens), list(self._batch_texts)
            out = {k: getattr(self, k) for k in ("requests", "texts", "refused", "failed", "batches", "tokens", "busy_s")}
        out.update({f"latency_p{q}_ms": percentile(lat, q) for q in (50, 90, 99)})
        out.update(batch_tokens_p50=percentile(bt, 50), batch_tokens_max=max(bt, default=None),
                   batch_texts_p50=percentile(bx, 50))
        return out


_HELP = {
    "requests": ("counter", "requests accepted"), "texts": ("counter", "texts in accepted requests"),
    "refused": ("counter", "requests refused because the queue was full (HTTP 429)"),
    "failed": ("counter", "requests whose batch raised an error"), "batches": ("counter", "forward passes run"),
    "tokens": ("counter", "tokens encoded"), "busy_s": ("counter", "seconds spent in the model"),
    "queue_texts": ("gauge", "texts waiting in the queue"), "queue_requests": ("gauge", "requests waiting in the queue"),
}


def prometheus_text(snap: dict, prefix: str = "btlib_serve") -> str:
    """A :meth:`BatcherStats.snapshot` (plus queue gauges) in Prometheus' text exposition format (version 0.0.4).

    Counters get the ``_total`` suffix; latency and batch-size percentiles become two summaries
    (``{prefix}_latency_seconds{quantile="0.99"}``, ``{prefix}_batch_tokens{quantile="0.5"}``).
    """
    lines = []
    for key, (kind, help_) in _HELP.items():
        if key in snap:
            name = f"{prefix}_{key}" + ("_total" if kind == "counter" else "")
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {float(snap[key]):g}"]
    summaries = (("latency_seconds", "request latency, arrival to answer", [(q, "latency_p%d_ms" % q, 1e-3) for q in (50, 90, 99)]),
                 ("batch_tokens", "tokens per forward pass", [(50, "batch_tokens_p50", 1.0), (100, "batch_tokens_max", 1.0)]))
    for name, help_, points in summaries:
        lines += [f"# HELP {prefix}_{name} {help_}", f"# TYPE {prefix}_{name} summary"]
        for q, key, scale in points:
            if snap.get(key) is not None:
                lines.append(f'{prefix}_{name}{{quantile="{q / 100:g}"}} {snap[key] * scale:g}')
    return "\n".join(lines) + "\n"


def tei_batch_text(stats: BatcherStats, queue_requests: int) -> str:
    """TEI's queue and batch metrics of a batcher: te_queue_size (requests waiting), te_batch_next_size and
    te_batch_next_tokens (histograms of the texts and tokens of each forward pass)."""
    lines = ["# HELP te_queue_size requests waiting in the queue", "# TYPE te_queue_size gauge", f"te_queue_size {queue_requests}"]
    lines += stats.batch_size_hist.lines("te_batch_next_size", "texts per forward pass")
    lines += stats.batch_tokens_hist.lines("te_batch_next_tokens", "tokens per forward pass")
    return "\n".join(lines) + "\n"
