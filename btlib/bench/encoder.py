"""Encoder benchmarks: PyTorch's slow path, fastpath and nested-tensor path, side by side.

Providers (one encoder, shared weights, eval mode under torch.inference_mode):
- ``slow``: the fastpath switched off (torch.backends.mha.set_fastpath_enabled(False)):
  plain nn.Module code, attention by SDPA, padding computed and masked.
- ``fastpath``: PyTorch's fused ``_transformer_encoder_layer_fwd`` on the padded batch.
- ``fastpath_nested``: the same plus nested tensors: linear layers skip padding.
- ``btlib_packed``: btlib.PackedEncoder on the same weights: pack once, every layer on the
  real tokens with btlib's varlen attention, unpack once. ``btlib_packed_bf16``: the same in
  bf16 (weights copied), checked to 5e-2 relative (bf16 keeps 8 bits of mantissa; the
  notebook checks cosine similarity >= 0.999 per token as well); skipped, with the measured
  rates, where this CPU's bf16 is not native or slower than fp32 (btlib.precision.bf16_slow_reason).
- ``ideal`` (unchecked yardstick): the fastpath on a batch with the same number of real tokens
  and no padding, B sequences of length round((1 - p) T). What skipping padding could reach.
  ``ideal_packed``: the same batch through btlib.PackedEncoder: btlib's own ideal. A path's share of
  the ideal is taken against its own engine's (:func:`ideal_row`): btlib's kernels and GEMM path can
  beat PyTorch's fastpath on the same tokens, so the fastpath's ideal is no bound for btlib.
- ``btlib_padded`` (unchecked): btlib.PackedEncoder on the padded batch with every position taken as a token, the
  padding computed as a padded engine computes it: btlib_packed against it is the padding factor alone, and it
  against ``fastpath`` the engine factor alone (:func:`speedup_parts`).

Checked at real tokens only, against ``slow``: padded rows differ by design (the nested path
writes 0 there). Tolerance 1e-4 relative: 12 post-LN layers of fp32 GEMMs that sum in a
different order (fused QKV vs separate) drift by ~1e-6 per layer and LayerNorm renormalises.
"""

from __future__ import annotations

import copy
import functools
import json

import torch

from ..kernels import relative_error
from ..lengths import batch_lengths, encoder_flops
from ..models import BERT_BASE, TINY, EncoderConfig, WordTokenizer, XLMRClassifier, XLMRConfig, cached_encoder, dense_twin
from ..models.xlmr import XLMR_BASE_CONFIG, XLMR_LARGE_CONFIG
from ..padding import lengths_to_padding_mask, pack
from ..precision import bf16_slow_reason
from ..observe import run_slow
from ..packed_encoder import PackedEncoder
from ..paths import data_file
from .core import Benchmark, Provider, declare

ENCODER_TOL = 1e-4


@functools.lru_cache(maxsize=2)
def cached_packed(cfg: EncoderConfig, dtype: torch.dtype = torch.float32, seed: int = 0) -> PackedEncoder:
    """btlib.PackedEncoder on :func:`cached_encoder`'s weights (shared in fp32, converted copy otherwise)."""
    enc, _ = cached_encoder(cfg, seed)
    return PackedEncoder.from_module(enc, dtype=None if dtype == torch.float32 else dtype)


def _fast(fn, *args, **kwargs):
    with torch.inference_mode():
        return fn(*args, **kwargs)


def encoder_providers() -> list[Provider]:
    """PyTorch's paths, btlib's packed encoder and the ideal, for :func:`encoder_inputs`' dict."""
    return [
        Provider("slow", lambda x: run_slow(x["dense"], x["src"], src_key_padding_mask=x["mask"]), label="fastpath off"),
        Provider("fastpath", lambda x: _fast(x["dense"], x["src"], src_key_padding_mask=x["mask"]), label="fused layers, padded"),
        Provider("fastpath_nested", lambda x: _fast(x["encoder"], x["src"], src_key_padding_mask=x["mask"]),
                 label="fused layers + nested tensors"),
        Provider("btlib_packed", lambda x: _fast(cached_packed(x["config"]), x["src"], x["lengths"]),
                 label="btlib.PackedEncoder, fp32"),
        Provider("btlib_packed_bf16", lambda x: _fast(cached_packed(x["config"], torch.bfloat16), x["src"], x["lengths"]),
                 label="btlib.PackedEncoder, bf16", tol=5e-2, available=bf16_slow_reason, precision="bf16"),
        Provider("ideal", lambda x: _fast(x["dense"], x["ideal_src"]), label="fastpath on real tokens only", checked=False),
        Provider("ideal_packed", lambda x: _fast(cached_packed(x["config"]), x["ideal_src"]),
                 label="btlib.PackedEncoder on real tokens only", checked=False),
        Provider("btlib_padded", lambda x: _fast(cached_packed(x["config"]), x["src"], x["full"]),
                 label="btlib.PackedEncoder on the padded batch, padding computed", checked=False),
    ]


def speedup_parts(rows: list[dict], x, flop_ratio: float) -> list[str]:
    """``btlib_packed`` against PyTorch's padded ``fastpath`` at ``x``, said as what it is made of: the engine (btlib
    against PyTorch on the same padded batch: ``btlib_padded`` vs ``fastpath``; and on the real tokens alone:
    ``ideal_packed`` vs ``ideal``) times the padding skipped (``btlib_packed`` vs ``btlib_padded``, one engine, beside
    the FLOP ratio ``flop_ratio``). The first two factors multiply to the total exactly (times divide)."""
    from .verdict import compare, find_row

    row = {name: find_row(rows, name, x) for name in ("fastpath", "btlib_packed", "btlib_padded", "ideal", "ideal_packed")}
    total = compare(row["btlib_packed"], row["fastpath"])
    engine, padding = compare(row["btlib_padded"], row["fastpath"]), compare(row["btlib_packed"], row["btlib_padded"])
    return [f"btlib_packed against the fastpath: {total}, made of",
            f"  engine: btlib against PyTorch on the same padded batch {engine}; on the real tokens alone "
            f"{compare(row['ideal_packed'], row['ideal'])}",
            f"  padding: btlib packed against btlib on the padded batch {padding} (FLOP ratio {flop_ratio:.2f}x)",
            f"  check: {engine.ratio:.2f} x {padding.ratio:.2f} = {engine.ratio * padding.ratio:.2f} (the total's "
            f"{total.ratio:.2f})"]


def ideal_row(rows: list[dict], provider: str, x) -> dict:
    """The ideal that ``provider``'s row at ``x`` is a share of: its own engine on the real tokens alone
    (``ideal_packed`` for btlib's rows, ``ideal`` for PyTorch's)."""
    from .verdict import find_row

    return find_row(rows, "ideal_packed" if provider.startswith("btlib") else "ideal", x)


def encoder_inputs(p: dict) -> dict:
    cfg = p["config"]
    enc, dense = cached_encoder(cfg)
    B, T = p["B"], p["T"]
    lengths = batch_lengths(p)
    g = torch.Generator().manual_seed(p.get("seed", 0))
    src = torch.randn(B, T, cfg.d_model, generator=g)
    ideal_T = max(1, round(int(lengths.sum()) / B))
    return {"config": cfg, "encoder": enc, "dense": dense, "src": src, "mask": lengths_to_padding_mask(lengths, T),
            "lengths": lengths, "ideal_src": torch.randn(B, ideal_T, cfg.d_model, generator=g),
            "full": torch.full_like(lengths, T)}  # btlib_padded: every position a token, as a padded engine computes


def real_token_error(out: torch.Tensor, ref: torch.Tensor, x: dict) -> float:
    """Relative error over real tokens only: (B, T, d) outputs are packed first."""
    return relative_error(pack(out, x["lengths"]).tokens, pack(ref, x["lengths"]).tokens)


def _encoder_flops(p: dict) -> float:
    """Useful FLOPs: the real tokens' work only, so GFLOP/s says how much of the machine does useful work
    (a dense path's rate falls as padding grows; a padding-free path's does not)."""
    cfg = p["config"]
    return encoder_flops(batch_lengths(p), cfg.d_model, cfg.dim_feedforward, cfg.num_layers)


declare(Benchmark(
    name="encoder_padding",
    description="BERT-base-shaped nn.TransformerEncoder, fp32: PyTorch's paths against the padding fraction",
    x_name="padding", x_vals=(0.0, 0.25, 0.5, 0.75),
    providers=encoder_providers,
    make_inputs=encoder_inputs,
    reference=lambda x: run_slow(x["dense"], x["src"], src_key_padding_mask=x["mask"]),
    error=real_token_error,
    tol=ENCODER_TOL,
    params={"config": BERT_BASE, "B": 8, "T": 128},
    quick={"config": TINY, "B": 4, "T": 32, "x_vals": (0.0, 0.5)},
    flops=_encoder_flops, baseline="slow",
))


# --- The BetterTransformer tutorial's benchmark (notebook 02) ---------------------------------

def tutorial_batches() -> dict[str, list[str]]:
    """The tutorial's small and big input batches (texts written for this workbook, data/)."""
    return json.loads(data_file("tutorial_batches.json").read_text())


@functools.lru_cache(maxsize=2)
def cached_classifier(cfg: XLMRConfig, device: str = "cpu", seed: int = 0) -> tuple[XLMRClassifier, XLMRClassifier]:
    """(classifier with nested tensors enabled, the same weights with nested disabled), eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = XLMRClassifier(cfg).to(device).eval()
    twin = copy.copy(model)  # shallow: every submodule shared ...
    twin._modules = dict(model._modules)
    twin.encoder = dense_twin(model.encoder)  # ... but the encoder, which never nests
    return model, twin


TUTORIAL_MODELS = {
    "base": XLMR_BASE_CONFIG,
    "large": XLMR_LARGE_CONFIG,
    "tiny": XLMRConfig(encoder=TINY, vocab_size=1000),
}


def _tutorial_inputs(p: dict) -> dict:
    cfg = TUTORIAL_MODELS[p["model"]]
    model, dense = cached_classifier(cfg, p["device"])
    tokens = WordTokenizer(cfg.vocab_size, max_length=cfg.max_positions - 2)(tutorial_batches()[p["batch"]]).to(p["device"])
    return {"tokens": tokens, "model": model, "dense": dense}


declare(Benchmark(
    name="bettertransformer_tutorial",
    description="XLM-R-shaped classifier on the tutorial's small and big batches: slow path vs fastpath vs nested",
    x_name="batch", x_vals=("small", "big"),
    providers=lambda: [
        Provider("slow", lambda x: run_slow(x["dense"], x["tokens"]), label="fastpath off"),
        Provider("fastpath", lambda x: _fast(x["dense"], x["tokens"]), label="fused layers, padded"),
        Provider("fastpath_nested", lambda x: _fast(x["model"], x["tokens"]), label="fused layers + nested tensors"),
    ],
    make_inputs=_tutorial_inputs,
    reference=lambda x: run_slow(x["dense"], x["tokens"]),
    error=lambda out, ref, x: relative_error(out, ref),
    tol=ENCODER_TOL,
    params={"model": "base", "device": "cpu"},
    quick={"model": "tiny"},
    baseline="slow",
))
