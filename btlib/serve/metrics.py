"""Prometheus histograms and labelled counters under text-embeddings-inference's metric names (GET /metrics).

    h = Histogram(LATENCY_BUCKETS_S)
    h.observe(0.004)
    h.lines("te_request_duration", "request latency")   # te_request_duration_bucket{le="0.005"} 1 ... _sum, _count

TEI's router exports ``te_request_count``, ``te_request_success``, ``te_request_failure`` (counters),
``te_queue_size`` and histograms ``te_request_duration``, ``te_request_tokenization_duration``,
``te_request_queue_duration``, ``te_request_inference_duration``, ``te_request_input_length``,
``te_batch_next_size``, ``te_batch_next_tokens``; a dashboard built for TEI reads them unchanged here. Histograms
(cumulative ``_bucket{le=...}``, ``_sum``, ``_count``) aggregate across servers and over any window, which
btlib's own summaries (quantiles of the last 4,096 requests) cannot; both are served. Labels: ``method`` is the
route's name (TEI's is "single" / "batch"), ``status`` the HTTP status, and failures carry TEI's ``err`` kinds
(validation 413 / 422, overloaded 429, ...), so 4xx are counted by status.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter

__all__ = ["Histogram", "RequestCounts", "RequestMetrics", "CountAnswers", "LATENCY_BUCKETS_S", "LENGTH_BUCKETS", "BATCH_SIZE_BUCKETS", "ERR"]

LATENCY_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
LENGTH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # tokens
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # texts per forward
ERR = {400: "validation", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed", 413: "validation",
       422: "validation", 424: "backend", 429: "overloaded", 503: "unhealthy"}  # TEI's err kinds; other 5xx: "backend"


class Histogram:
    """A thread-safe Prometheus histogram: counts per upper bound ``le`` (cumulative when written), sum and count."""

    def __init__(self, buckets):
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)  # the last: above every bound (+Inf only)
        self._sum, self._lock = 0.0, threading.Lock()

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)  # the first bound >= value: Prometheus' le is "less or equal"
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    def lines(self, name: str, help_: str) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        out, running = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"], 0
        for le, c in zip([*(f"{b:g}" for b in self.buckets), "+Inf"], counts):
            running += c
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        return out + [f"{name}_sum {total:.9g}", f"{name}_count {running}"]


class RequestCounts:
    """Answers by route and status, as TEI's te_request_count / te_request_success / te_request_failure counters."""

    def __init__(self):
        self._by, self._lock = Counter(), threading.Lock()

    def add(self, method: str, status: int) -> None:
        with self._lock:
            self._by[(method, status)] += 1

    def lines(self) -> list[str]:
        with self._lock:
            by = sorted(self._by.items())
        out = ["# HELP te_request_count requests answered, by route (method) and HTTP status",
               "# TYPE te_request_count counter"]
        out += [f'te_request_count{{method="{m}",status="{s}"}} {n}' for (m, s), n in by]
        out += ["# HELP te_request_success requests answered 2xx, by route", "# TYPE te_request_success counter"]
        ok = Counter()
        for (m, s), n in by:
            ok[m] += n if s < 400 else 0
        out += [f'te_request_success{{method="{m}"}} {n}' for m, n in sorted(ok.items())]
        out += ["# HELP te_request_failure requests refused or failed, by TEI's err kind, route and HTTP status",
                "# TYPE te_request_failure counter"]
        out += [f'te_request_failure{{err="{ERR.get(s, "backend" if s >= 500 else "validation")}",method="{m}",status="{s}"}} {n}'
                for (m, s), n in by if s >= 400]
        return out


class RequestMetrics:
    """What one HTTP server records per request: TEI's request histograms and answer counters. :meth:`observe` takes a
    request that ran the model (btlib.serve.service.Service.timing); ``counts`` every answer (:class:`CountAnswers`)."""

    NAMES = (("te_request_duration", "seconds from the route's start to its answer, requests that ran the model", LATENCY_BUCKETS_S),
             ("te_request_tokenization_duration", "seconds tokenizing a request at submit", LATENCY_BUCKETS_S),
             ("te_request_queue_duration", "seconds a request waited in the queue", LATENCY_BUCKETS_S),
             ("te_request_inference_duration", "seconds of the forward pass a request ran in", LATENCY_BUCKETS_S),
             ("te_request_input_length", "tokens a request ran (prompts, special tokens and chunks included)", LENGTH_BUCKETS))

    def __init__(self):
        self.hist = {name: Histogram(buckets) for name, _, buckets in self.NAMES}
        self.counts = RequestCounts()

    def observe(self, total_s: float, tokenize_s: float, queue_s: float, inference_s: float, tokens: int) -> None:
        for (name, _, _), v in zip(self.NAMES, (total_s, tokenize_s, queue_s, inference_s, tokens)):
            self.hist[name].observe(v)

    def lines(self) -> list[str]:
        return [line for name, help_, _ in self.NAMES for line in self.hist[name].lines(name, help_)] + self.counts.lines()


class CountAnswers:
    """ASGI middleware: each HTTP answer counted by route and status (:class:`RequestCounts`), whichever layer gave it
    (the Host check's 400, the key's 401, the body limit's 413, a route's 422 / 429). ``names``: path -> method label;
    another path is "other"; GET /metrics and /health are not counted."""

    def __init__(self, app, counts: RequestCounts, names: dict[str, str]):
        self.app, self.counts, self.names = app, counts, names

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in ("/metrics", "/health"):
            return await self.app(scope, receive, send)
        status = 500  # an exception before the answer started: the server's 500

        async def watched(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            if not (scope["path"] == "/" and scope["method"] == "GET"):  # GET / is TEI's health check
                self.counts.add(self.names.get(scope["path"], "other"), status)
