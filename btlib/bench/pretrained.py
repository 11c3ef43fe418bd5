"""End-to-end sentence embedding with a real pretrained encoder (all-MiniLM-L6-v2), every path.

Providers: transformers' BertModel (padded, SDPA attention) where installed, PyTorch's
nn.TransformerEncoder slow path / fastpath / fastpath + nested tensors, and btlib's packed
path in fp32 and bf16 (bf16 skipped, with the measured rates, where it is not native or slower
than fp32 here). Each call encodes the whole corpus (data/sentences.txt, repeated) in
batches of ``batch_size`` in corpus order, tokenization included: what a user's encode() costs.
Checked against the slow path: max |difference| of the normalised embeddings.
"""

from __future__ import annotations

import functools

from ..device import bf16_slow_reason
from ..paths import data_file
from .core import Benchmark, Provider, declare


@functools.lru_cache(maxsize=1)
def _model():
    from ..pretrained import load_pretrained

    return load_pretrained()


@functools.lru_cache(maxsize=1)
def _hf():
    from ..pretrained import default_model_folder
    from ..pretrained.reference import HFReference

    return HFReference(default_model_folder(), _model().max_length)


def corpus() -> list[str]:
    """The workbook's sentences (data/sentences.txt), comments dropped."""
    lines = data_file("sentences.txt").read_text().splitlines()
    return [s for s in lines if s.strip() and not s.startswith("#")]


def _available() -> str | None:
    from ..pretrained import default_model_folder

    try:
        default_model_folder()
    except ValueError as e:
        return str(e)
    return None


def _hf_available() -> str | None:
    from ..pretrained.reference import transformers_available

    return _available() or transformers_available()


def _inputs(p: dict) -> dict:
    return {"texts": corpus() * p["repeat"], "batch_size": p["batch_size"]}


def _path(name: str):
    return lambda x: _model().encode(x["texts"], batch_size=x["batch_size"], path=name)


declare(Benchmark(
    name="pretrained_encode",
    description="all-MiniLM-L6-v2 sentence embeddings end to end (tokenize, encode, pool), fp32 unless bf16",
    x_name="batch_size", x_vals=(8, 32, 128),
    providers=lambda: [
        Provider("transformers", lambda x: _hf().encode(x["texts"], x["batch_size"]), available=_hf_available,
                 label="Hugging Face BertModel, padded, SDPA"),
        *[Provider(n, _path(n), available=_available) for n in ("slow", "fastpath", "fastpath_nested", "packed")],
        Provider("packed_bf16", _path("packed_bf16"), available=lambda: _available() or bf16_slow_reason(), tol=1e-2),
    ],
    make_inputs=_inputs,
    reference=lambda x: _model().encode(x["texts"], batch_size=x["batch_size"], path="slow"),
    error=lambda out, ref, x: float((out - ref).abs().max()),
    tol=1e-5,
    params={"repeat": 4},
    quick={"repeat": 1, "x_vals": (16,)},
    baseline="slow",
))
