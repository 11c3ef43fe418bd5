"""int8 linear layers for the packed encoder: int8 weights per output channel, activations quantised per token.

    q8 = btlib.quant.quantize(PackedEncoder.from_module(enc))   # (total, d) -> (total, d), like the fp32 one
    emb = model.encode(texts, precision="int8")                 # the same for a pretrained model

Each nn.Linear y = x W^T + b (x: (M, K) tokens, W: (N, K)) becomes

    w_n   = max_k |W[n, k]| / 127          per output channel, once          (N,)
    s_m   = max_k |x[m, k] / a_k| / 127    per token, every call (dynamic)    (M, 1)
    acc   = int8(x / a / s) @ int8(W a / w)^T                exact integer sums (M, N): torch._int_mm or oneDNN
    y     = acc * w * s + b                                  fp32

``a`` (K,) is SmoothQuant's per-input-channel scale (Xiao et al. 2023, arXiv:2211.10438):
a_k = max|x_k|^alpha / max|W_k|^(1 - alpha), calibrated on a few sentences (btlib.smoothquant), moves activation
outliers into the weights; a = 1 without calibration. Attention, LayerNorm, GELU and residuals
stay fp32. Per-token activation scales, not ORT's one scale per tensor: a token whose hidden
state has a large outlier no longer squeezes every other token's resolution.

NaN and inf: a token whose input holds NaN or inf is recomputed in fp32 from the fp32 weight (kept by
reference, not copied: the int8 encoder shares the fp32 layers anyway), so it comes out exactly as
fp32's (NaN, +-inf, and relu(-inf) = 0 where fp32 has them). Autograd: rounding to int8 has no useful
gradient and the int8 weights are buffers, so a call that autograd would record (grad mode on, an
input or parameter requiring grad) raises; run under torch.inference_mode() / torch.no_grad().

Why torch._int_mm: it multiplies int8 by int8 into exact int32 sums on plain tensors, so the per-token scales
stay this module's; PyTorch's dynamic quantized linears (fbgemm, oneDNN) take one activation scale per *tensor*
(an embedding then depends on its batch-mates) through the deprecated quantized-tensor API, and torchao's
dynamic int8 wants torch.compile. :func:`int8_gemm_gflops` measures this machine's int8 rate beside fp32's
(``python -m btlib.bench run pretrained_encode`` compares the encoders end to end); :func:`int8_slow_reason`
says where int8 does not pay.

The GEMM takes the faster of two paths measured on this machine (btlib.gemm.choose_int8): torch._int_mm
(int32 out) or oneDNN's int8 linear with pre-packed weights (uint8 activations with zero point 128, unit scales: the
same sums as floats). Both feed the same dequantize pass, so they give the same bits; which is faster depends on
the CPU, the rows and the weight's shape (``btlib.hardware.machine().gemm["int8"]``).

torch.compile: not traceable in one graph (fullgraph=True raises). quantize_rows and dequantize
(kernels/cpu/int8.cpp) are pybind functions, not torch ops, so dynamo cannot see into them, and the int8
build's loader reads /proc/cpuinfo on the call path (the first graph break, on torch 2.13). The fp32 and bf16
PackedEncoder trace (btlib/kernels/cpu/schema.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _torch_private as tp
from .attention import varlen_attention
from .hardware import int8_gemm_gflops  # noqa: F401 (measured there, with the other rates; named here as before)
from .kernels import registry
from .kernels.registry import Kernel
from .packed_encoder import PackedEncoder
from . import quant_linear
from .quant_linear import _ACT, _EMPTY, _NO_GRAD, ROWS, Int8Linear, _OneDnnOff, kernels, quantize_rows  # noqa: F401 (btlib.quant's names)
from .padding import check_int
from .position_bias import PositionBias
from .precision import int8_slow_reason, warn_if_slow_int8  # the precision policy's; named here as before

__all__ = ["Int8Linear", "Int8PackedEncoder", "quantize", "quantize_rows", "kernels", "int8_gemm_gflops", "int8_slow_reason",
           "warn_if_slow_int8", "LINEARS"]

LINEARS = ("qkv", "out_proj", "linear1", "linear2")  # the four GEMMs of a layer, in order


def _inputs(layer: nn.TransformerEncoderLayer) -> dict[str, tuple[Tensor, Tensor | None]]:
    a = layer.self_attn
    return {"qkv": (a.in_proj_weight, a.in_proj_bias), "out_proj": (a.out_proj.weight, a.out_proj.bias),
            "linear1": (layer.linear1.weight, layer.linear1.bias), "linear2": (layer.linear2.weight, layer.linear2.bias)}


@functools.lru_cache(maxsize=1)
def _amx_kernel() -> Kernel | None:
    """The AMX varlen kernel where it runs here, else None: asked once (~20 us a check, per forward otherwise)."""
    amx = registry.get("cpu_amx_varlen")
    return amx if amx.available() is None else None


class Int8PackedEncoder(PackedEncoder):
    """A PackedEncoder whose linear layers run in int8 (those not kept fp32). Shares the fp32 layers' LayerNorms.

    ``qlinears[i]`` holds layer i's :class:`Int8Linear` modules by name (qkv, out_proj, linear1, linear2);
    a name missing there runs the fp32 path of :class:`btlib.PackedEncoder`.
    """

    def __init__(self, packed: PackedEncoder, qlinears: nn.ModuleList):
        super().__init__(packed.layers, packed.norm, packed.attention_backend, packed.batch_first, packed.bias)
        self.qlinears = qlinears
        self.precision = "int8"
        # {layer index: linears kept fp32}, e.g. {3: ("linear2",)}
        self.kept_fp32 = {i: tuple(n for n in LINEARS if n not in q) for i, q in enumerate(qlinears) if len(q) < len(LINEARS)}
        self._q = {id(layer): q for layer, q in zip(self.layers, qlinears)}

    def _kernel(self, x: Tensor) -> Kernel:
        """fp32's varlen kernel, except where AMX runs: then the AMX kernel, which takes the fp32 q, k, v as they are
        and rounds them to bf16 while packing its tiles (bf16 products, fp32 softmax and output). The int8 linears
        already round every activation to 8 bits, so attention's bf16 products stay far inside int8's own error
        (their error is bf16's, a few units in 1e-3, against int8's percent), and attention, which int8 leaves in fp32,
        is the largest part of int8's time on long texts (``python -m btlib.bench run pretrained_encode`` shows the
        end-to-end effect on an AMX machine). Only under backend "auto": a named backend runs as named; and
        only where something is quantised (keep_fp32 everything is the fp32 encoder, to the bit)."""
        kernel = super()._kernel(x)
        quantised = any(len(q) for q in self.qlinears)  # keep_fp32 everything: the fp32 encoder, exactly
        if quantised and self.attention_backend == "auto" and x.dtype == torch.float32 and kernel.name == "cpu_flash_varlen":
            amx = _amx_kernel()
            if amx is not None and (self.bias is None or amx.bias):
                return amx
        return kernel

    def _layers(self, x: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())):
            raise ValueError(f"the int8 encoder was called with autograd recording (an input or a shared fp32 "
                             f"parameter requires grad, grad mode on), but {_NO_GRAD}")
        return super()._layers(x, cu_seqlens, max_seqlen)

    def _attention(self, layer: nn.TransformerEncoderLayer, x: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                   *kernel, residual: Tensor | None = None, bias: PositionBias | None = None) -> Tensor:
        # *kernel: the varlen kernel PackedEncoder selected once per forward, where its version passes one
        q8 = self._q[id(layer)]
        if "qkv" not in q8 and "out_proj" not in q8:
            return super()._attention(layer, x, cu_seqlens, max_seqlen, *kernel, residual=residual, bias=bias)
        a = layer.self_attn
        total, d = x.shape
        H = a.num_heads
        qkv = q8["qkv"](x) if "qkv" in q8 else F.linear(x, a.in_proj_weight, a.in_proj_bias)
        q, k, v = qkv.view(total, 3, H, d // H).unbind(1)  # (total, H, Dh) each, strided views
        if kernel:
            o = kernel[0].fn(q, k, v, cu_seqlens, max_seqlen, causal=False, scale=None, **registry.bias_kwargs(kernel[0], bias))
        else:
            o = varlen_attention(q, k, v, cu_seqlens, max_seqlen, bias=bias, backend=self.attention_backend)  # (total, H, Dh)
        o = o.reshape(total, d)
        if "out_proj" in q8:
            return q8["out_proj"](o, residual)  # the residual added in dequantize's pass
        y = a.out_proj(o)
        return y if residual is None else y + residual

    def _feed_forward(self, layer: nn.TransformerEncoderLayer, x: Tensor, residual: Tensor | None = None) -> Tensor:
        q8 = self._q[id(layer)]
        if "linear1" not in q8 and "linear2" not in q8:
            return PackedEncoder._feed_forward(layer, x, residual)
        if "linear1" in q8 and "linear2" in q8 and quant_linear.kernels() is not None:
            return _feed_forward_int8(q8["linear1"], q8["linear2"], x, residual)
        h = q8["linear1"](x) if "linear1" in q8 else layer.activation(layer.linear1(x))
        if "linear2" in q8:
            return q8["linear2"](h, residual)
        y = layer.linear2(h)
        return y if residual is None else y + residual


def _feed_forward_int8(l1: Int8Linear, l2: Int8Linear, x: Tensor, residual: Tensor | None) -> Tensor:
    """l2(l1(x)) (+ residual) with l1's output quantised for l2 as it is computed (Int8Linear.requantized): the
    (M, 4 d) hidden state, the layer's widest, is never written as floats, nor read back: 2 x 4 bytes less per hidden
    value. The same bits as l2(l1(x)) (int8.cpp computes the row with the same code, built without FMA contraction).
    What it saves end to end: ``python -m btlib.bench run pretrained_encode`` with int8, before and after.

    Rows whose input or hidden state holds NaN or inf are recomputed in fp32 through both linears, so they come out
    as the fp32 layer's."""
    k = quant_linear.kernels()
    M = x.shape[0]
    p1, p2 = l1.onednn_packed(M), l2.onednn_packed(M)
    xq, s = k.quantize_rows(x.contiguous(), l1._smooth(), p1 is not None)
    try:
        hq, hs = l1.requantized(xq, s, p1, l2, p2)
        y = l2.forward_quantized(hq, hs, p2, residual)
    except _OneDnnOff:  # int_mm from now on: the unfused pair, which handles its own non-finite rows
        return l2(l1(x), residual)
    bad = ~(torch.isfinite(s.view(-1)) & torch.isfinite(hs.view(-1)))
    if bool(bad.any()):
        h = l1._activation(F.linear(x[bad], l1.weight_fp32, l1.bias))
        fixed = F.linear(h, l2.weight_fp32, l2.bias)
        y[bad] = fixed if residual is None else fixed + residual[bad]
    return y


def quantize(packed: PackedEncoder, *, keep_fp32: dict[int, tuple[str, ...]] | tuple[str, ...] = (),
             stats: list[dict[str, Tensor]] | None = None, alpha: float = 0.5) -> Int8PackedEncoder:
    """An int8 twin of ``packed`` (fp32): the same call signature, its linear layers in int8.

    keep_fp32: linear names (see :data:`LINEARS`) kept fp32 in every layer, or {layer index: names}.
    stats: :func:`btlib.smoothquant.calibrate`'s per-channel activation maxima; given, each int8 linear is smoothed
    with a_k = max|x_k|^alpha / max|W_k|^(1 - alpha) (SmoothQuant); None: no smoothing.
    The fp32 layers are shared, not copied; the int8 weights are new buffers (about 1/4 of fp32's bytes).
    """
    if (why := tp.missing("int_mm")) is not None:  # refused here, not at the first forward
        raise RuntimeError(f"quantize: {why}, so int8 linears cannot run here; use precision='fp32'")
    if packed.layers[0].linear1.weight.dtype != torch.float32:
        raise ValueError(f"quantize takes an fp32 PackedEncoder; got {packed.layers[0].linear1.weight.dtype}")
    if not isinstance(keep_fp32, tuple):  # {layer index: names}: an index out of range would be ignored silently
        n = len(packed.layers)
        keep_fp32 = {check_int(i, "keep_fp32 layer index", high=n - 1, hint=f"the encoder has {n} layers"): v
                     for i, v in keep_fp32.items()}
    bad = set(keep_fp32 if isinstance(keep_fp32, tuple) else [n for v in keep_fp32.values() for n in v]) - set(LINEARS)
    if bad:
        raise ValueError(f"keep_fp32 names linears among {LINEARS}; got {sorted(bad)}")
    qlinears = nn.ModuleList()
    for i, layer in enumerate(packed.layers):
        kind = _fused_activation(layer)
        keep = keep_fp32 if isinstance(keep_fp32, tuple) else keep_fp32.get(i, ())
        mods = nn.ModuleDict()
        for name, (w, b) in _inputs(layer).items():
            if name in keep or (name == "linear1" and kind is None):
                continue
            smooth = None
            if stats is not None:
                smooth = (stats[i][name].clamp_min(1e-5) ** alpha / w.detach().abs().amax(0).float().clamp_min(1e-5) ** (1 - alpha))
            mods[name] = Int8Linear(w, b, smooth, activation=kind if name == "linear1" else None)
        qlinears.append(mods)
    return Int8PackedEncoder(packed, qlinears)


def _fused_activation(layer: nn.TransformerEncoderLayer) -> str | None:
    """'gelu' / 'relu' for the activations Int8Linear applies itself; None keeps linear1 fp32 (any other activation)."""
    from .packed_encoder import _fused_kind

    return _fused_kind(layer)
