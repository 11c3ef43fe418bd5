"""End-to-end sentence embedding with a real pretrained encoder (all-MiniLM-L6-v2), every path, and what people run today.

Providers, each encoding the whole corpus in batches of ``batch_size``, tokenization included (what a
user's encode() costs):

    transformers          Hugging Face BertModel, padded per batch in corpus order, SDPA (the reference)
    sentence_transformers its own encode: sorts by length, pads per batch
    ort_fp32[_sorted]     ONNX Runtime on torch.onnx.export's graph, corpus order [longest first]
    ort_opt[_sorted]      the same after ORT's bert optimizer (fused Attention, SkipLayerNorm)
    ort_int8_sorted       ORT's dynamic int8 (quantize_dynamic, per-channel weights) of ort_opt, longest first
    slow, fastpath, fastpath_nested   PyTorch's nn.TransformerEncoder paths on btlib's modules, padded
    packed, packed_bf16, packed_int8  btlib's padding-free encode(), fp32 / bf16 / int8 (btlib.quant)
    ov_fp32, ov_default, ov_int8_weights, ov_int8_nncf, ct2_fp32, ct2_int8, fastembed
                          OpenVINO, CTranslate2 and fastembed (:func:`peer_providers`), longest first
                          (fastembed: its own embed(), corpus order)

Every provider is checked against the reference before it is timed: ``error`` is the max |difference|
of the normalised embeddings, ``min_cos`` the lowest cosine similarity of one embedding with its
reference. fp32 paths must agree to 1e-5; bf16 and int8 paths are timed when within 1e-1 (the check
catches wiring bugs; min_cos states their accuracy). A provider whose package is missing is skipped
with the reason. Rows carry useful GFLOP/s (the real tokens' FLOPs only: ~21 MFLOP per token for
MiniLM-L6 plus 4 L^2 d per sequence and layer for attention) and ``of_bound``, that rate over this
machine's measured matmul rate in the provider's precision.

Corpora (``--set corpus=...``): "file", the workbook's sentences in file order (``repeat`` times);
"draws", ``draws`` seeded draws from them; "passages", ``passages`` texts of 100-250 words made of
seeded draws (most truncate at the model's 256 tokens).
"""

from __future__ import annotations

import functools
import random

import torch
import torch.nn.functional as F

from ..hardware import bf16_native
from ..lengths import encoder_flops
from ..paths import data_file
from ..precision import bf16_slow_reason, int8_slow_reason
from . import rt_ctranslate2, rt_fastembed, rt_openvino, runtimes
from .core import Benchmark, Provider, declare

__all__ = ["corpus", "texts", "CORPORA", "PADDING", "padding_fraction", "LOW_PRECISION_TOL", "peer_providers"]

CORPORA = ("file", "draws", "passages")
LOW_PRECISION_TOL = 1e-1  # max |diff| of unit vectors a bf16 / int8 path may show and still be timed


@functools.lru_cache(maxsize=1)
def _model():
    from ..pretrained import load_pretrained

    return load_pretrained()


def _folder():
    from ..pretrained import default_model_folder

    return default_model_folder()


@functools.lru_cache(maxsize=1)
def _hf():
    from ..pretrained.reference import HFReference

    return HFReference(_folder(), _model().max_length)


def corpus() -> list[str]:
    """The workbook's sentences (data/sentences.txt), comments dropped."""
    lines = data_file("sentences.txt").read_text().splitlines()
    return [s for s in lines if s.strip() and not s.startswith("#")]


@functools.lru_cache(maxsize=8)
def _texts(name: str, repeat: int, draws: int, passages: int, seed: int) -> tuple[str, ...]:
    sentences = corpus()
    rng = random.Random(seed)
    if name == "file":
        return tuple(sentences * repeat)
    if name == "draws":
        return tuple(rng.choice(sentences) for _ in range(draws))
    if name == "passages":
        out = []
        for _ in range(passages):
            n, words = rng.randint(100, 250), []
            while len(words) < n:
                words += rng.choice(sentences).split()
            out.append(" ".join(words[:n]))
        return tuple(out)
    raise ValueError(f"corpus must be one of {CORPORA}; got {name!r}")


def texts(p: dict) -> list[str]:
    """The texts of one benchmark point: p["corpus"] built from p["repeat"], p["draws"], p["passages"], p["seed"]."""
    return list(_texts(p.get("corpus", "file"), p.get("repeat", 1), p.get("draws", 512), p.get("passages", 64), p.get("seed", 0)))


@functools.lru_cache(maxsize=8)
def _lengths(key: tuple) -> torch.Tensor:
    return torch.tensor([len(s) for s in _model().tokenize(list(_texts(*key)))])


def _lengths_of(p: dict) -> torch.Tensor:
    return _lengths((p.get("corpus", "file"), p.get("repeat", 1), p.get("draws", 512), p.get("passages", 64), p.get("seed", 0)))


def _flops(p: dict) -> float:
    """Useful FLOPs of encoding the corpus: the real tokens' work only (no padding, no embedding lookup)."""
    s = _model().spec
    return encoder_flops(_lengths_of(p), s.d_model, s.dim_feedforward, s.num_layers)


# How each provider batches, for the padding it pays: "file" (padded per batch, corpus order),
# "sorted" (padded per batch, longest first), "none" (packed: no padding anywhere).
PADDING = {"transformers": "file", "sentence_transformers": "sorted", "ort_fp32": "file", "ort_fp32_sorted": "sorted",
           "ort_opt": "file", "ort_opt_sorted": "sorted", "ort_int8_sorted": "sorted", "slow": "file", "fastpath": "file",
           "fastpath_nested": "file", "packed": "none", "packed_bf16": "none", "packed_int8": "none", "packed_padded": "file",
           **dict.fromkeys(("ov_fp32", "ov_default", "ov_int8_weights", "ov_int8_nncf", "ct2_fp32", "ct2_int8"), "sorted"),
           "fastembed": "file"}


def padding_fraction(lengths: torch.Tensor, batch_size: int, order: str) -> float:
    """Padded tokens / computed tokens when ``lengths`` (N,) are batched by ``batch_size`` in ``order`` (see PADDING).

    fastpath_nested counts as "file": its linear layers skip padding, but its attention re-pads each batch.
    """
    if order == "none":
        return 0.0
    L = lengths[runtimes.batch_order(lengths.tolist(), order == "sorted")]
    computed = sum(int(c.max()) * len(c) for c in L.split(batch_size))
    return 1.0 - int(L.sum()) / computed


def _available() -> str | None:
    try:
        _folder()
    except ValueError as e:
        return str(e)
    return None


def _hf_available() -> str | None:
    from ..pretrained.reference import transformers_available

    return _available() or transformers_available()


def _onnx_available() -> str | None:
    return _available() or runtimes.onnx_available() or _hf_available()  # the export reads the folder with transformers


def _int8_available() -> str | None:
    return _available() or int8_slow_reason()


def _inputs(p: dict) -> dict:
    return {"texts": texts(p), "batch_size": p["batch_size"]}


def _path(name: str):
    return lambda x: _model().encode(x["texts"], batch_size=x["batch_size"], path=name)


def _packed_padded(x: dict):
    """btlib's packed encoder on the padded batches: each text's ids extended with the pad id to its batch's longest
    and every position run as a token (its rows differ: a timing yardstick, unchecked). Against ``fastpath`` it is the
    engine alone (the same padded tokens); ``packed`` against it, the padding alone (one engine)."""
    from ..pretrained.tokens import Tokens

    m, bs = _model(), x["batch_size"]
    tok, rows = m.tokens(x["texts"]), []
    for i in range(0, len(tok), bs):
        part = tok[i:i + bs]
        n = max(part.lengths())
        ids = [s + [m.spec.pad_token_id] * (n - len(s)) for s in part.ids]  # (B, n): the padded batch's tokens
        types = None if part.types is None else [t + [0] * (n - len(t)) for t in part.types]
        rows.append(m.encode_tokens(Tokens(ids, types, part.prompt_length), batch_size=bs))
    return torch.cat(rows)


def _ort(variant: str, sort: bool):
    def fn(x):
        m = _model()
        session = runtimes.ort_session(runtimes.onnx_model(_folder(), variant))
        return runtimes.ort_encode(session, m.tokenize(x["texts"]), x["batch_size"], sort=sort, pad_id=m.spec.pad_token_id)
    return fn


def _reference(x: dict) -> torch.Tensor:
    if _hf_available() is None:
        return _hf().encode(x["texts"], x["batch_size"])
    return _model().encode(x["texts"], batch_size=x["batch_size"], path="slow")  # without transformers: PyTorch's own path


def _metrics(out: torch.Tensor, ref: torch.Tensor, x: dict) -> dict:
    return {"min_cos": float(F.cosine_similarity(out.float(), ref, dim=-1).min())}


def _ids(x: dict) -> tuple[list[list[int]], int]:
    m = _model()
    return m.tokenize(x["texts"]), m.spec.pad_token_id


def _ov(variant: str, hint: str | None):
    def fn(x):
        ids, pad = _ids(x)
        compiled = rt_openvino.ov_compiled(rt_openvino.ov_model(_folder(), variant), hint)
        return rt_openvino.ov_encode(compiled, ids, x["batch_size"], sort=True, pad_id=pad)
    return fn


def _ct2(compute_type: str):
    def fn(x):
        ids, pad = _ids(x)
        encoder = rt_ctranslate2.ct2_encoder(rt_ctranslate2.ct2_model(_folder()), compute_type)
        return rt_ctranslate2.ct2_encode(encoder, ids, x["batch_size"], sort=True, pad_id=pad)
    return fn


def _fastembed(x):
    model = rt_fastembed.fastembed_model(_folder(), _model().max_length)
    return rt_fastembed.fastembed_encode(model, x["texts"], x["batch_size"])


def _needs(*checks):
    """available(): the first reason among pretrained's model check and ``checks`` (each () -> str | None)."""
    return lambda: next((why for why in (_available(), *(c() for c in checks)) if why), None)


def peer_providers(low_tol: float) -> list[Provider]:
    """The engines beyond ONNX Runtime (OpenVINO, CTranslate2, fastembed), in the order of the issue-21 table.

    low_tol: the tolerance of the rows that may leave fp32 (OpenVINO's default picks bf16 where the CPU has
    it; the int8 rows), in the calling benchmark's error measure. ``precision`` names the matmul rate that
    bounds each row: weight-only int8 computes in OpenVINO's default precision, only its weights are int8.
    """
    hf, ov, ov8, ct2 = _hf_available, rt_openvino.openvino_available, rt_openvino.nncf_available, rt_ctranslate2.ct2_available
    ov_default = "bf16" if bf16_native()[0] else "fp32"  # OpenVINO's CPU default is bf16 exactly where btlib calls it native
    return [
        Provider("ov_fp32", _ov("fp32", "f32"), available=_needs(ov, hf), label="OpenVINO fp32 (INFERENCE_PRECISION_HINT=f32)"),
        Provider("ct2_fp32", _ct2("float32"), available=_needs(ct2, hf), label="CTranslate2 fp32", isolated=True),
        Provider("fastembed", _fastembed, available=_needs(rt_fastembed.fastembed_available, hf),
                 label="fastembed (ONNX Runtime inside)"),
        Provider("ov_default", _ov("fp32", None), available=_needs(ov, hf), tol=low_tol, precision=ov_default,
                 label="OpenVINO default precision"),
        Provider("ov_int8_weights", _ov("int8_weights", None), available=_needs(ov8, hf), tol=low_tol, precision=ov_default,
                 label="OpenVINO weight-only int8 (NNCF)"),
        Provider("ov_int8_nncf", _ov("int8_nncf", None), available=_needs(ov8, hf), tol=low_tol, precision="int8",
                 label="OpenVINO NNCF full int8"),
        Provider("ct2_int8", _ct2("int8"), available=_needs(ct2, hf), tol=low_tol, precision="int8", label="CTranslate2 int8",
                 isolated=True),
    ]


def _providers() -> list[Provider]:
    low = LOW_PRECISION_TOL
    return [
        Provider("transformers", lambda x: _hf().encode(x["texts"], x["batch_size"]), available=_hf_available,
                 label="Hugging Face BertModel, padded, SDPA"),
        Provider("sentence_transformers", lambda x: runtimes.st_encode(runtimes.sentence_transformer(_folder()), x["texts"], x["batch_size"]),
                 available=lambda: _available() or runtimes.st_available(), label="sentence-transformers encode (sorts by length)"),
        Provider("ort_fp32", _ort("fp32", False), available=_onnx_available, label="ONNX Runtime, exported graph, corpus order"),
        Provider("ort_fp32_sorted", _ort("fp32", True), available=_onnx_available, label="ONNX Runtime, longest first"),
        Provider("ort_opt", _ort("opt", False), available=_onnx_available, label="ONNX Runtime + bert optimizer, corpus order"),
        Provider("ort_opt_sorted", _ort("opt", True), available=_onnx_available, label="ONNX Runtime + bert optimizer, longest first"),
        Provider("ort_int8_sorted", _ort("int8", True), available=_onnx_available, tol=low, precision="int8",
                 label="ONNX Runtime dynamic int8, longest first"),
        *[Provider(n, _path(n), available=_available) for n in ("slow", "fastpath", "fastpath_nested", "packed")],
        Provider("packed_bf16", _path("packed_bf16"), available=lambda: _available() or bf16_slow_reason(), tol=low, precision="bf16"),
        Provider("packed_padded", _packed_padded, available=_available, checked=False,
                 label="btlib's packed encoder on the padded batches (every position a token): engine vs padding"),
        Provider("packed_int8", lambda x: _model().encode(x["texts"], batch_size=x["batch_size"], precision="int8"),
                 available=_int8_available, tol=low, precision="int8", label="btlib encode(precision='int8')"),
        *peer_providers(low),
    ]


declare(Benchmark(
    name="pretrained_encode",
    description="all-MiniLM-L6-v2 sentence embeddings end to end (tokenize, encode, pool): btlib, PyTorch, "
                "sentence-transformers, ONNX Runtime, OpenVINO, CTranslate2, fastembed",
    x_name="batch_size", x_vals=(8, 32, 128),
    providers=_providers,
    make_inputs=_inputs,
    reference=_reference,
    error=lambda out, ref, x: float((out.float() - ref).abs().max()),
    metrics=_metrics,
    tol=1e-5,
    params={"corpus": "file", "repeat": 4, "draws": 512, "passages": 64, "seed": 0},
    quick={"repeat": 1, "draws": 32, "passages": 4, "x_vals": (16,)},
    flops=_flops,
    baseline="transformers",
))
