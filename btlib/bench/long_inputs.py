"""Long inputs: what chunking a long document costs against truncating it (all-MiniLM-L6-v2, fp32, 2 threads).

A document past the model's length (MiniLM: 256 tokens with [CLS] and [SEP]) is cut at it (``long_inputs="truncate"``:
the rest is never read) or split into windows of the model's length, consecutive ones sharing ``chunk_overlap`` tokens
(default: an eighth of the window), every window run in the same packed batches and the windows pooled by their
token counts (``long_inputs="chunk"``, btlib.pretrained.chunking). ``x`` = words per document (about 1.3 tokens a
word); each call encodes ``docs`` documents. Providers:

    chunk       encode(docs, long_inputs="chunk"): checked against the reference
    truncate    encode(docs, long_inputs="truncate"): the first window only; a yardstick (it computes another vector)

Chunking's work grows with the document: windows of 256 tokens, each attention 256 x 256 however long the document
(one forward over the whole text would pay the square of its length), plus the overlap's share. Truncation's work is
one window whatever the length. The metric ``min_cos_truncate`` is the lowest cosine between a document's truncated
vector and its chunked one: how much of the document truncation leaves out of its vector.

The reference: each window alone through PyTorch's modules (``path="slow"``), the model's row before its Normalize,
the token-weighted mean per document, normalised: what chunking promises, without packing. Run:
``python -m btlib.bench run long_inputs``.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from ..serve.load import _WORDS
from .core import Benchmark, Provider, declare
from .one_query import _available, _model  # the default pretrained model, loaded once for every benchmark using it

__all__ = ["documents", "chunked_reference"]


def documents(n: int, words: int, seed: int = 0) -> list[str]:
    """``n`` documents of ``words`` plain words each (btlib.serve.load's vocabulary)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(words)) for _ in range(n)]


def chunked_reference(model, texts: list[str]) -> torch.Tensor:
    """(N, d): each text's windows (btlib.pretrained.chunking's cut) run one at a time through PyTorch's modules
    (``path="slow"``), their rows before the head's Normalize averaged with the windows' token counts as weights,
    then L2-normalised (the default model, all-MiniLM-L6-v2, ends in Normalize)."""
    from ..pretrained.chunking import chunk_tokens

    toks = chunk_tokens(model, texts, None, None)
    out, i = [], 0
    for count in toks.chunks:
        rows, weights = [], []
        for j in range(i, i + count):
            rows.append(model.encode_tokens(toks[j:j + 1], path="slow", output="unnormalized")[0])
            weights.append(len(toks.ids[j]))
        w = torch.tensor(weights, dtype=torch.float32)[:, None]
        out.append((torch.stack(rows) * w).sum(0) / w.sum())
        i += count
    return F.normalize(torch.stack(out), dim=-1)


def _encode(inputs: dict, mode: str) -> torch.Tensor:
    return _model().encode(inputs["docs"], long_inputs=mode)


def _metrics(out, ref, inputs) -> dict:
    truncated = _encode(inputs, "truncate")
    from ..pretrained.chunking import chunk_tokens

    tokens = [len(ids) for ids in _model().tokens(inputs["docs"]).ids]  # cut at max_length: what truncate runs
    ran = chunk_tokens(_model(), inputs["docs"], None, None)  # every window: what chunk runs
    return {"min_cos_truncate": float(F.cosine_similarity(truncated, out, dim=-1).min()),
            "tokens_chunk": float(sum(len(ids) for ids in ran.ids)), "tokens_truncate": float(sum(tokens)),
            "chunks_per_doc": sum(ran.chunks) / len(ran.chunks)}


declare(Benchmark(
    name="long_inputs",
    description="long documents through encode(): chunked and pooled against truncated (all-MiniLM-L6-v2, fp32)",
    x_name="words", x_vals=(150, 600, 1500),
    params={"docs": 8},
    quick={"docs": 2},
    providers=lambda: [
        Provider("chunk", lambda x: _encode(x, "chunk"), available=_available, label='encode(long_inputs="chunk")'),
        Provider("truncate", lambda x: _encode(x, "truncate"), available=_available, checked=False,
                 label='encode(long_inputs="truncate"): the first window only'),
    ],
    make_inputs=lambda p: {"docs": documents(p["docs"], p["words"], seed=1)},
    reference=lambda x: chunked_reference(_model(), x["docs"]),
    error=lambda out, ref, x: float((out - ref).abs().max()),
    tol=1e-5,
    metrics=_metrics,
    baseline="truncate",
))
