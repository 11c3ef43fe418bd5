"""SmoothQuant calibration and per-linear sensitivity: how btlib.quant's int8 encoder is configured for a model.

    stats = calibrate(packed, batches)              # per layer, per linear: max |x_k| of its input, (K,)
    q8 = quantize(packed, stats=stats, alpha=0.5)   # btlib.quant: smoothed int8 linears
    q8 = quantize_auto(packed, batches)             # the same, with the most sensitive linear kept fp32

SmoothQuant (Xiao et al. 2023, arXiv:2211.10438) divides each input channel k of a linear by
a_k = max|x_k|^alpha / max|W_k|^(1 - alpha) and multiplies the weight's column by it: the product is
unchanged, but the activation's outlier channels shrink, so one int8 scale per token loses less.
Sensitivity: each linear alone in int8, the rest fp32, scored by the lowest cosine of the mean-pooled
outputs against fp32. batches are (x (total, d) float32, cu_seqlens (B + 1,) int32, max_seqlen) as
PackedEncoder.forward_packed takes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .kernels import registry
from .packed_encoder import PackedEncoder
from .padding import check_int, segment_ids, segment_mean
from .quant import LINEARS, Int8PackedEncoder, quantize

__all__ = ["calibrate", "sensitivity", "quantize_auto", "CALIBRATION_TEXTS"]


class _Recorder(PackedEncoder):
    """The same layers, recording max |x_k| of every linear's input (FFN unfused so its activation is seen).

    Records in this object only: no hook on the shared layers, whose every caller would fire it (a forward
    hook on out_proj let another thread's concurrent forward, e.g. its sensitivity pass, into these maxima).
    """

    def __init__(self, packed: PackedEncoder):
        super().__init__(packed.layers, packed.norm, packed.attention_backend, packed.batch_first, packed.bias)
        self.stats: dict[int, dict[str, Tensor]] = {id(layer): {} for layer in packed.layers}

    def keep(self, layer: nn.Module, name: str, x: Tensor) -> None:
        m, seen = x.detach().abs().amax(0).float(), self.stats[id(layer)]
        seen[name] = torch.maximum(seen[name], m) if name in seen else m

    def _attention(self, layer, x, cu_seqlens, max_seqlen, kernel, residual=None, bias=None):
        # PackedEncoder._attention, with out_proj's input recorded between the attention and out_proj
        self.keep(layer, "qkv", x)
        a = layer.self_attn
        total, d = x.shape
        q, k, v = F.linear(x, a.in_proj_weight, a.in_proj_bias).view(total, 3, a.num_heads, d // a.num_heads).unbind(1)
        o = kernel.fn(q, k, v, cu_seqlens, max_seqlen, causal=False, scale=None,
                      **registry.bias_kwargs(kernel, bias)).reshape(total, d)  # (total, d)
        self.keep(layer, "out_proj", o)
        y = F.linear(o, a.out_proj.weight, a.out_proj.bias)
        return y if residual is None else y + residual

    def _feed_forward(self, layer, x, residual=None):
        self.keep(layer, "linear1", x)
        h = layer.activation(layer.linear1(x))
        self.keep(layer, "linear2", h)
        y = layer.linear2(h)
        return y if residual is None else y + residual


@torch.inference_mode()
def calibrate(packed: PackedEncoder, batches: list[tuple[Tensor, Tensor, int]]) -> list[dict[str, Tensor]]:
    """Per layer, per linear (:data:`LINEARS`): max |x_k| of that linear's input over the calibration tokens, (K,) float32.

    batches: (x (total, d) float32, cu_seqlens (B + 1,) int32, max_seqlen) as forward_packed takes them.
    """
    rec = _Recorder(packed)
    for x, cu_seqlens, max_seqlen in batches:
        rec.forward_packed(x, cu_seqlens, max_seqlen)
    return [rec.stats[id(layer)] for layer in packed.layers]


# Calibration texts written for this module (not the workbook's corpora, which the benchmarks evaluate on):
# short queries and a paragraph, so the activation maxima cover both ends of the length range.
CALIBRATION_TEXTS = (
    "Hello world", "How are you!", "Cancel my order", "What time does the museum open on Sundays?",
    "The package arrived two days late and the box was damaged.",
    "Please send the invoice for March to the finance team before Friday.",
    "Best hiking trails near the lake", "Error 502 when uploading photos from the mobile app",
    "She planted tomatoes along the south wall, where the afternoon sun stayed longest, and every evening "
    "she carried water from the well in two tin buckets. By August the vines had climbed past the window, "
    "heavy with fruit, and the neighbours came by with baskets, asking how a garden so small could give so much.",
)


def _pooled(out: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Mean over each sequence of packed (total, d) -> (B, d)."""
    lengths = cu_seqlens.diff().long()
    return segment_mean(out, segment_ids(lengths), lengths)


@torch.inference_mode()
def sensitivity(packed: PackedEncoder, batches: list[tuple[Tensor, Tensor, int]],
                stats: list[dict[str, Tensor]] | None = None, alpha: float = 0.5) -> dict[tuple[int, str], float]:
    """(layer, linear) -> 1 - min cosine of mean-pooled outputs when only that linear runs in int8, over ``batches``."""
    ref = [_pooled(packed.forward_packed(x, cu, T), cu) for x, cu, T in batches]
    everything = {i: LINEARS for i in range(len(packed.layers))}
    out = {}
    for i in range(len(packed.layers)):
        for name in LINEARS:
            one = quantize(packed, keep_fp32={**everything, i: tuple(n for n in LINEARS if n != name)}, stats=stats, alpha=alpha)
            cos = min(F.cosine_similarity(_pooled(one.forward_packed(x, cu, T), cu), r).min().item()
                      for (x, cu, T), r in zip(batches, ref))
            out[(i, name)] = 1.0 - cos
    return out


def quantize_auto(packed: PackedEncoder, batches: list[tuple[Tensor, Tensor, int]], *, alpha: float = 0.5,
                  keep: int = 1) -> Int8PackedEncoder:
    """SmoothQuant (alpha) calibrated on ``batches``, with the ``keep`` linears most sensitive on them kept fp32.

    What encode(precision="int8") uses. On all-MiniLM-L6-v2, min cosine against fp32 over the three corpora of
    btlib.bench.pretrained (~820 texts): per-token int8 0.980; SmoothQuant alpha 0.5 0.9955 (0.4: 0.991,
    0.6: 0.995); plus layer 3's FFN output linear (the most sensitive of the 24) kept fp32: 0.9967.
    """
    keep = check_int(keep, "keep", high=len(LINEARS) * len(packed.layers), hint="how many linears stay fp32")
    stats = calibrate(packed, batches)
    sens = sensitivity(packed, batches, stats, alpha)
    kept: dict[int, tuple[str, ...]] = {}
    for i, name in sorted(sens, key=sens.get, reverse=True)[:keep]:
        kept[i] = kept.get(i, ()) + (name,)
    return quantize(packed, keep_fp32=kept, stats=stats, alpha=alpha)
