"""serve_load: the highest Poisson arrival rate each way of serving MiniLM answers with bounded p99 (p95 on shorter trials; issue 25's table).

    python -m btlib.bench run serve_load [--quick]

Every method is one worker thread behind the same ``submit`` (a :class:`btlib.serve.BatchEncoder`
with a batching policy and a backend), driven by :func:`btlib.serve.load.max_rate` on the same texts:

    encode_per_request   btlib encode, one request per forward (no batching)
    packed_fp32          btlib's packed batcher: token budget 512, 2 ms wait
    http_packed_fp32     the same batcher behind HTTP: ``python -m btlib.serve`` on 127.0.0.1, POST /v1/embeddings
    packed_bf16          the same in bf16 (only where this CPU has native bf16: it is ~10x slower elsewhere)
    padded_transformers  transformers BertModel, padded batches of <= 32 with a 5 ms wait (infinity's policy)
    tei_ort_padded       ONNX Runtime (optimised graph), padded batches of <= 8, FIFO by a 16384-token budget, no wait (TEI's)
    ort_per_request      ONNX Runtime, one request per forward

Each row: ``max_rate_rps`` (req/s served with the ``slo_q``-th percentile of latency <= SLO and nothing refused or
lost) and ``first_failed_rps`` (the lowest rate the search tried and found too high: the true maximum lies between
the two), ``trials`` (every trial of the search: rate, throughput, p50 and the SLO's percentile with its ~95%
interval, served or not: what notebook 09 plots), p50 and the SLO's percentile at half that rate, and, on the
packed_fp32 row, the 2x-overload run: shares answered / refused (429) / lost, the accepted requests' latency at the
percentile their number supports (``overload_q``) and the RSS growth. ``median ms`` is one 8-text request through
the method (the correctness check's call). Numbers from a shared machine are noisy; ratios within one run are what
count.

The percentile the SLO holds is the one every trial measures (btlib.serve.stats.supported_percentile): each trial
lasts ``trial_s`` and offers at least ``trial_requests`` requests (500 by default: p99; notebook 09's 100: p95).

The HTTP row (issue 25's target: HTTP costs <= 15% of the in-process max rate). The server runs in a process
of its own (:class:`btlib.serve.remote.ServerProcess`), as it is deployed: its own interpreter and GIL, so
its event loop, JSON and the batcher's tokenizing never wait on the load generator's thread (in one process
they would, and the cost measured would be a GIL's, not HTTP's). It is started once per workload with
packed_fp32's settings and this run's thread count, warmed by the check request and a discarded trial (as every
method is), and stopped (SIGTERM, then
reaped: the port is free) when the row is done or anything raises. The client is the same Poisson generator
driving :class:`btlib.serve.client.HttpEncoder` (an asyncio HTTP/1.1 client, base64 bodies), on the same CPU: on a
2-core machine every client cycle is a cycle the server's 2 torch threads lose, and it is counted against
the HTTP path, as it would be for a client on the server's machine (a remote client would cost the server
less). The row records that client's own cost: ``http_client_cpu_ms``, this process's CPU per GET /health
(1000 of them one at a time, no model work), next to the round trip (``http_wall_ms``) and the server's CPU
per request (``http_server_cpu_ms``). Between the search's trials the client waits for every answer (a drained
server is what a fresh in-process batcher is). ``python -m btlib.serve`` also keeps freed memory
(btlib.memory), which the in-process rows' process does not unless its caller asked. The summary line
"HTTP costs X% of the in-process max rate" compares the two rows of one run, measured one after the other.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from ..padding import lengths_to_padding_mask
from ..serve.batcher import BatchEncoder
from ..serve.load import bounded, max_rate, rss_mb, run_load, workload
from ..serve.stats import supported_percentile
from .core import Benchmark, Provider, declare

__all__ = ["METHODS", "LABELS", "slo_percentile", "compare_rates", "make_batcher", "why_not_available", "issue_table", "PaddedTransformers", "OrtPadded"]

SLO_MS = 250.0
MAX_QUEUE = 64  # texts waiting at most in every method's queue (refused beyond: 429 over HTTP)
METHODS = ("encode_per_request", "packed_fp32", "http_packed_fp32", "packed_bf16", "padded_transformers", "tei_ort_padded", "ort_per_request")
LABELS = {"encode_per_request": "encode per request", "packed_fp32": "packed batcher fp32",
          "http_packed_fp32": "packed batcher fp32 over HTTP", "packed_bf16": "packed batcher bf16",
          "padded_transformers": "padded transformers batcher", "tei_ort_padded": "TEI-style ORT padded batcher (<= 8)",
          "ort_per_request": "ORT one request per forward"}


class PaddedTransformers:
    """transformers' BertModel on padded batches (mean pooling, L2 normalisation): what a plain PyTorch server runs."""

    def __init__(self, model, folder):
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModel

        self.tokenizer, self.max_length, self.pad = model.tokenizer, model.max_length, model.spec.pad_token_id
        self.hf = AutoModel.from_pretrained(str(folder)).eval()

    def encode(self, texts: Sequence[str], *, batch_size: int, precision: str | None) -> torch.Tensor:
        ids = [e.ids for e in self.tokenizer.encode_batch(list(texts))]
        T = max(len(s) for s in ids)
        tokens = torch.tensor([s + [self.pad] * (T - len(s)) for s in ids])  # (B, T): every row pays for the longest
        mask = (~lengths_to_padding_mask(torch.tensor([len(s) for s in ids]), T)).long()  # (B, T), 1 at real tokens
        with torch.inference_mode():
            h = self.hf(input_ids=tokens, attention_mask=mask).last_hidden_state  # (B, T, d)
        keep = mask.unsqueeze(-1).to(h.dtype)
        return F.normalize((h * keep).sum(1) / keep.sum(1), dim=-1)


class OrtPadded:
    """ONNX Runtime on padded batches (btlib.bench.runtimes' optimised export): TEI's CPU backend in kind."""

    def __init__(self, model, folder):
        from .runtimes import onnx_model, ort_session

        self.tokenizer, self.max_length, self.pad = model.tokenizer, model.max_length, model.spec.pad_token_id
        self.session = ort_session(onnx_model(folder, "opt"))

    def encode(self, texts: Sequence[str], *, batch_size: int, precision: str | None) -> torch.Tensor:
        from .runtimes import ort_encode

        ids = [e.ids for e in self.tokenizer.encode_batch(list(texts))]
        return ort_encode(self.session, ids, len(ids), sort=False, pad_id=self.pad)


def why_not_available(method: str) -> str | None:
    """None if ``method`` can run here, else why not (bf16 not native, a package missing)."""
    if method == "packed_bf16":
        from ..precision import bf16_slow_reason

        return bf16_slow_reason()
    if method == "padded_transformers":
        try:
            import transformers  # noqa: F401
        except ImportError:
            return "transformers is not installed (pip install -e '.[lab]', what make setup installs)"
        return None
    if method in ("tei_ort_padded", "ort_per_request"):
        from .runtimes import onnx_available

        return onnx_available()
    if method == "http_packed_fp32":
        from ..serve.remote import http_missing

        return http_missing()
    return None


@functools.lru_cache(maxsize=1)
def _model():
    from ..pretrained import default_model_folder, load_pretrained

    return load_pretrained(), default_model_folder()


@functools.lru_cache(maxsize=4)
def _backend(kind: str):
    model, folder = _model()
    return PaddedTransformers(model, folder) if kind == "transformers" else OrtPadded(model, folder)


def make_batcher(method: str, *, max_queue: int = MAX_QUEUE, max_batch_tokens: int = 512, max_wait_ms: float = 0.0,
                 keep_warm_ms: float = 50.0) -> BatchEncoder:
    """A fresh one-worker server for ``method`` (one of :data:`METHODS`); max_batch_tokens / max_wait_ms set the packed
    batchers, keep_warm_ms every batcher whose forward runs on torch's threads (BatchEncoder's; ONNX Runtime's take 0)."""
    model, _ = _model()
    packed = dict(max_batch_tokens=max_batch_tokens, max_wait_ms=max_wait_ms, max_queue=max_queue, keep_warm_ms=keep_warm_ms)
    return {
        "encode_per_request": lambda: BatchEncoder(model, max_batch_requests=1, max_wait_ms=0, max_queue=max_queue,
                                                   keep_warm_ms=keep_warm_ms),
        "packed_fp32": lambda: BatchEncoder(model, **packed),
        "packed_bf16": lambda: BatchEncoder(model, precision="bf16", **packed),
        "padded_transformers": lambda: BatchEncoder(_backend("transformers"), max_batch_tokens=1 << 20, max_batch_requests=32,
                                                    max_wait_ms=5, max_queue=max_queue, keep_warm_ms=keep_warm_ms),
        # ONNX Runtime's forwards run on its own threads (which spin by themselves): no torch pool to keep warm
        "tei_ort_padded": lambda: BatchEncoder(_backend("ort"), max_batch_tokens=16384, max_batch_requests=8, max_wait_ms=0,
                                               max_queue=max_queue, keep_warm_ms=0),
        "ort_per_request": lambda: BatchEncoder(_backend("ort"), max_batch_requests=1, max_wait_ms=0, max_queue=max_queue,
                                                keep_warm_ms=0),
    }[method]()


class _Answer:
    """A provider's output: the check request's embeddings, and which method made them (for the load run in ``metrics``)."""

    def __init__(self, emb: torch.Tensor, method: str):
        self.emb, self.method = emb, method


@contextlib.contextmanager
def _http_server(inputs) -> Iterator[tuple]:
    """``python -m btlib.serve`` with packed_fp32's settings and one client, for one workload's check, load test and timing."""
    from ..serve.client import HttpEncoder
    from ..serve.remote import ServerProcess

    with ServerProcess(model=_model()[1], max_batch_tokens=512, max_wait_ms=0.0, max_queue=MAX_QUEUE,
                       threads=torch.get_num_threads()) as server:
        with HttpEncoder(server.url, max_connections=2 * MAX_QUEUE + 16) as client:
            yield server, client


class _Trial:
    """One :func:`max_rate` trial on the shared client: ``close`` waits for its answers, as closing a BatchEncoder does."""

    def __init__(self, client):
        self.submit, self.client = client.submit, client

    def close(self) -> None:
        self.client.drain(120)


def _provider(method: str) -> Provider:
    def fn(inputs):
        if method == "http_packed_fp32":
            return _Answer(inputs["context"][1].encode(inputs["check"], timeout=120), method)
        with make_batcher(method) as b:
            return _Answer(b.encode(inputs["check"], timeout=120), method)

    return Provider(method, fn, available=lambda: why_not_available(method), label=LABELS[method],
                    tol=1e-2 if method == "packed_bf16" else None, context=_http_server if method == "http_packed_fp32" else None)


def _inputs(p: dict) -> dict:
    texts = workload(p["workload"], 512, seed=1)
    return {"texts": texts, "check": texts[:8], "params": p}


def slo_percentile(p: dict) -> int:
    """The percentile the SLO holds in a run with params ``p``: the highest that ``trial_requests`` requests measure."""
    q = supported_percentile(int(p["trial_requests"]))
    if q is None:
        raise ValueError(f"trial_requests={p['trial_requests']} measures no percentile: take at least 10")
    return q


def _trial(r: dict, q: int) -> dict:
    """What a row keeps of one trial (btlib.serve.load.run_load's result)."""
    keep = ("rate", "offered", "answered", "refused", "throughput", "p50_ms", "p50_interval_ms", f"p{q}_ms", f"p{q}_interval_ms",
            "bounded")
    return {k: r[k] for k in keep if k in r}


def _metrics(out: _Answer, ref, inputs) -> dict:
    """The load test of ``out.method`` (run once per row, after the check): max rate, latency at half of it, overload."""
    p, texts = inputs["params"], inputs["texts"]
    q, n = slo_percentile(p), int(p["trial_requests"])
    if out.method == "http_packed_fp32":
        from ..serve.remote import client_cost

        server, client = inputs["context"]
        cost = client_cost(client, server, n=p["client_cost_n"])  # before the load: the client's CPU per request, no model work
        make = functools.partial(_Trial, client)
    else:
        make = functools.partial(make_batcher, out.method)
    # One discarded trial first, for every method: the HTTP server is a fresh process, whose first batches of each size
    # pay for allocations and oneDNN primitives made on first use, which the in-process rows' model has long paid for.
    warm = make()
    run_load(warm.submit, texts, p["start_rps"], p["trial_s"], seed=4)
    warm.close()
    best, trials = max_rate(make, texts, slo_ms=p["slo_ms"], start=p["start_rps"], duration_s=p["trial_s"], refine=p["refine"],
                            q=q, min_requests=n)
    # the search's resolution: the lowest rate it tried and found too high (the true max lies in [best, that))
    failed = [t["rate"] for t in trials if t["rate"] > best and not bounded(t, p["slo_ms"], q)]
    row = {"slo_q": q, "trial_requests": n, "max_rate_rps": float(best), "first_failed_rps": min(failed, default=None)}
    if best > 0:
        b = make()
        half = run_load(b.submit, texts, best / 2, p["trial_s"], seed=2, min_requests=n)
        b.close()
        row.update({"p50_ms_at_half": half["p50_ms"], f"p{q}_ms_at_half": half[f"p{q}_ms"]})
    if out.method == "http_packed_fp32":
        row.update(http_client_cpu_ms=cost["client_cpu_ms"], http_wall_ms=cost["wall_ms"], http_server_cpu_ms=cost.get("server_cpu_ms"))
    if out.method == "packed_fp32" and best > 0:
        b = make_batcher(out.method, max_queue=p["overload_queue"])
        before = rss_mb()
        r = run_load(b.submit, texts, 2 * best, p["overload_s"], seed=3)
        b.close()
        q_over = supported_percentile(r["answered"])  # the accepted requests' latency at the percentile their number measures
        row.update(overload_answered=r["answered"] / r["offered"], overload_refused=r["refused"] / r["offered"],
                   overload_lost=r["lost"] / r["offered"], overload_q=q_over,
                   overload_latency_ms=r[f"p{q_over}_ms"] if q_over else None,
                   overload_rss_growth_mb=(rss_mb() - before) if before is not None else None)
    return {**{k: float(v) for k, v in row.items() if v is not None}, "trials": [_trial(t, q) for t in trials]}


def _error(out: _Answer, ref, inputs) -> float:
    return (out.emb - ref).abs().max().item()


def issue_table(rows: Sequence[dict]) -> str:
    """Issue 25's table from serve_load rows: workloads down, methods across, max req/s with bounded p99 (or the percentile
    the rows' ``slo_q`` names, said under the table); then, where one run has both packed_fp32 rows, a line per workload:
    "HTTP costs X% of the in-process max rate"."""
    got = {(r["x"], r["provider"]): r for r in rows}
    methods = [m for m in METHODS if any(k[1] == m for k in got)]
    lines = ["| workload | " + " | ".join(LABELS[m] for m in methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for w in dict.fromkeys(r["x"] for r in rows):
        cells = []
        for m in methods:
            r = got.get((w, m))
            cells.append(f"{r['max_rate_rps']:.0f}" if r and r.get("max_rate_rps") is not None else "-")
        lines.append(f"| {_WORKLOADS.get(w, w)} (req/s) | " + " | ".join(cells) + " |")
    slo = next((r for r in rows if r.get("slo_q") and "slo_ms" in r.get("params", {})), None)
    if slo:
        lines.append(f"req/s: the highest Poisson rate served with p{slo['slo_q']:.0f} <= {slo['params']['slo_ms']:.0f} ms and none "
                     f"refused; every trial offered at least {slo['trial_requests']:.0f} requests")
    for w in dict.fromkeys(r["x"] for r in rows):
        a, h = (got.get((w, m), {}).get("max_rate_rps") for m in ("packed_fp32", "http_packed_fp32"))
        if a and h is not None:
            client = got[(w, "http_packed_fp32")].get("http_client_cpu_ms")
            lines.append(f"HTTP costs {1 - h / a:.0%} of the in-process max rate ({_WORKLOADS.get(w, w)}: {a:.0f} req/s in process, "
                         f"{h:.0f} over HTTP; target <= 15%)" + (f"; the client's own CPU: {client:.2f} ms per request" if client else ""))
            a_hi, h_hi = (got[(w, m)].get("first_failed_rps") for m in ("packed_fp32", "http_packed_fp32"))
            if a_hi and h_hi:  # each max rate is known to one step of its search: the cost to the same resolution
                lines.append(f"  to this search's resolution (in process {a:.0f}-{a_hi:.0f}, HTTP {h:.0f}-{h_hi:.0f} req/s) the cost "
                             f"lies between {max(0.0, 1 - h_hi / a):.0%} and {1 - h / a_hi:.0%}: more bisections (refine) narrow it")
    return "\n".join(lines)


_WORKLOADS = {"queries": "short queries", "mixed": "20% passages mixed in"}


def compare_rates(a: dict, b: dict) -> str:
    """Row ``a``'s max rate against row ``b``'s, to the search's resolution: each true maximum lies in
    [max_rate_rps, first_failed_rps), so a ratio is quoted only as the range those brackets allow, and brackets
    that overlap are "the same to this search's resolution".

        >>> print(compare_rates({"max_rate_rps": 512.0, "first_failed_rps": 768.0}, {"max_rate_rps": 192.0, "first_failed_rps": 256.0}))
        higher, 2.0x to 4.0x the rate (512-768 against 192-256 req/s)
        >>> print(compare_rates({"max_rate_rps": 96.0, "first_failed_rps": 128.0}, {"max_rate_rps": 96.0, "first_failed_rps": 128.0}))
        the same to this search's resolution (96-128 against 96-128 req/s)
    """
    def bracket(r: dict) -> tuple[float, float]:
        return r["max_rate_rps"], r.get("first_failed_rps") or float("inf")

    (a_lo, a_hi), (b_lo, b_hi) = bracket(a), bracket(b)
    said = f"{a_lo:.0f}-{a_hi:.0f} against {b_lo:.0f}-{b_hi:.0f} req/s".replace("-inf", " or more")
    if a_lo < b_hi and b_lo < a_hi:
        return f"the same to this search's resolution ({said})"
    if a_lo >= b_hi:
        hi = " or more" if a_hi == float("inf") or b_lo == 0 else f" to {a_hi / b_lo:.1f}x"
        return f"higher, {a_lo / b_hi:.1f}x{hi} the rate ({said})"
    hi = " or more" if b_hi == float("inf") or a_lo == 0 else f" to {b_hi / a_lo:.1f}x"
    return f"lower, {b_lo / a_hi:.1f}x{hi} below it ({said})"


declare(Benchmark(
    name="serve_load",
    description="max Poisson req/s with p99 <= SLO (the percentile the trials measure) per serving method, 1 worker",
    x_name="workload", x_vals=["queries", "mixed"],
    providers=lambda: [_provider(m) for m in METHODS],
    make_inputs=_inputs,
    reference=lambda inputs: _model()[0].encode(inputs["check"]),
    error=_error, tol=1e-4,
    params={"slo_ms": SLO_MS, "start_rps": 64.0, "trial_s": 4.0, "trial_requests": 500, "refine": 3, "overload_s": 10.0,
            "overload_queue": 256, "client_cost_n": 1000},
    quick={"trial_s": 1.0, "trial_requests": 50, "refine": 1, "overload_s": 2.0, "overload_queue": 64, "client_cost_n": 200},
    baseline="encode_per_request",
    metrics=_metrics,
    summary=issue_table,
))
