"""One short query, one ``encode`` call: btlib's fixed cost per forward (all-MiniLM-L6-v2, fp32).

A search box sends one query at a time: ~10 words, ~12-16 tokens. There the linear layers are
GEMMs of M = 12-16 rows, where a BLAS tuned for big matrices runs far below its peak, and every
per-layer Python step, allocation and dispatch counts. Providers, each ``model.encode([query])``
end to end (tokenize, forward, pool, normalise), ``x`` = words in the query:

    btlib             the GEMM path btlib.gemm measured fastest here for this M (the default)
    btlib_gemm_torch  every linear through F.linear (MKL / OpenBLAS): what btlib ran before paths
    btlib_gemm_onednn every linear through pre-packed oneDNN, bias and GELU fused

The reference is PyTorch's own modules on the same weights (``encode(path="slow")``): fp32
within 1e-5. Run: ``python -m btlib.bench run one_query`` (median of many calls; set the thread
count with ``torch.set_num_threads`` / OMP_NUM_THREADS, and on a shared machine read the spread).
:func:`one_query_latency` gives the same number in a script.
"""

from __future__ import annotations

import functools
import statistics
import time

from .. import gemm
from .core import Benchmark, Provider, declare

__all__ = ["QUERY", "query", "one_query_latency"]

QUERY = ("where can i find a good cheap hotel near the beach for my family this summer with a pool and free "
         "parking for two cars")  # plain words: 10 of them are 12 tokens with CLS and SEP, the short query


def query(words: int) -> str:
    """The first ``words`` words of :data:`QUERY` (10 words: 12 tokens with MiniLM's tokenizer, CLS and SEP included)."""
    return " ".join(QUERY.split()[:words])


@functools.cache
def _model():
    from ..pretrained import load_pretrained

    return load_pretrained()


def _available() -> str | None:
    from ..pretrained import default_model_folder

    try:
        default_model_folder()
    except ValueError as e:
        return str(e)
    return None


def _encode(texts: list[str], path: str | None):
    with gemm.forcing(path):
        return _model().encode(texts)


def one_query_latency(words: int = 10, *, path: str | None = None, runs: int = 200, warmup: int = 20) -> dict:
    """{"median_ms", "min_ms", "tokens", "path"}: ``runs`` timed ``encode([query(words)])`` calls on the default
    pretrained model at torch's current thread count, GEMMs by ``path`` (None: btlib's measured choice)."""
    texts = [query(words)]
    for _ in range(warmup):
        _encode(texts, path)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        _encode(texts, path)
        times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "tokens": len(_model().tokenize(texts)[0]),
            "path": path or "measured choice"}


def _providers() -> list[Provider]:
    return [Provider("btlib", lambda x: _encode(x["texts"], None), available=_available, label="btlib encode, GEMM path measured here"),
            Provider("btlib_gemm_torch", lambda x: _encode(x["texts"], "torch"), available=_available,
                     label="btlib encode, every GEMM by F.linear"),
            Provider("btlib_gemm_onednn", lambda x: _encode(x["texts"], "onednn"),
                     available=lambda: _available() or gemm.path_available("onednn"),
                     label="btlib encode, every GEMM by pre-packed oneDNN")]


declare(Benchmark(
    name="one_query",
    description="one short query through encode() (all-MiniLM-L6-v2, fp32): btlib's fixed cost per forward, per GEMM path",
    x_name="words", x_vals=(10,),
    providers=_providers,
    make_inputs=lambda p: {"texts": [query(p["words"])]},
    reference=lambda x: _model().encode(x["texts"], path="slow"),
    error=lambda out, ref, x: float((out - ref).abs().max()),
    tol=1e-5,
    baseline="btlib_gemm_torch",
))
