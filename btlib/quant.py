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

Why torch._int_mm: measured on torch 2.13 CPU (AMD EPYC with AVX-512 VNNI, 2 threads, best of 20), in
GFLOP/s (GOP/s for int8) of a whole (4096, 384) x (384, 1152) linear: fp32 F.linear 198; fbgemm's
quantized.linear_dynamic 1280 and oneDNN's 1506 (one activation scale per *tensor*, so an embedding
depends on its batch-mates; built on the deprecated quantized-tensor API); torch._int_mm alone 1869,
and this module's Int8Linear around it (per-token scales, fused passes of kernels/cpu/int8.cpp) 1076,
or 938 with plain torch ops; torchao 0.18's Int8DynamicActivationInt8Weight in eager mode 236 (it
wants torch.compile). :func:`int8_gemm_gflops` measures this machine; :func:`int8_slow_reason` says
where int8 does not pay.

The GEMM itself takes the faster of two paths measured on this machine (btlib.gemm.choose_int8): torch._int_mm
(int32 out) or oneDNN's int8 linear with pre-packed weights (uint8 activations with zero point 128, unit scales: the
same sums as floats). Both feed the same dequantize pass, so they give the same bits. Measured on an Intel Xeon with
AMX (2 threads), 1024 rows: K=384 -> N=1536 oneDNN ~2400 GOP/s vs _int_mm ~1400; K=1536 -> N=384 ~3000 vs ~2800;
at 100-500 rows the two are within ~20% either way.

torch.compile: not traceable in one graph (fullgraph=True raises). quantize_rows and dequantize
(kernels/cpu/int8.cpp) are pybind functions, not torch ops, so dynamo cannot see into them, and the int8
build's loader reads /proc/cpuinfo on the call path (the first graph break, on torch 2.13). The fp32 and bf16
PackedEncoder trace (btlib/kernels/cpu/fake.py).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _torch_private as tp, gemm
from .attention import varlen_attention
from .hardware import int8_gemm_gflops  # measured there, with the other rates; named here as before
from .kernels import registry
from .kernels.registry import Kernel
from .packed_encoder import PackedEncoder
from .padding import check_int
from .position_bias import PositionBias
from .precision import int8_slow_reason, warn_if_slow_int8  # the precision policy's; named here as before

__all__ = ["Int8Linear", "Int8PackedEncoder", "quantize", "quantize_rows", "kernels", "int8_gemm_gflops", "int8_slow_reason",
           "warn_if_slow_int8", "LINEARS"]

LINEARS = ("qkv", "out_proj", "linear1", "linear2")  # the four GEMMs of a layer, in order
ROWS = 1024  # tokens per _int_mm call: its rate fell from ~1800 to ~540 GOP/s past 6144 rows (K=384, N=1536, 2 threads)
_warned: set[str] = set()


@functools.lru_cache(maxsize=1)
def kernels():
    """The fused quantize / dequantize passes of int8.cpp (compiled once, into $TORCH_EXTENSIONS_DIR), or None.

    None where no C++ compiler is found, or where the build failed (one warning with the compiler's first
    errors, then never compiled again in this process): Int8Linear then runs the same arithmetic as torch
    ops (slower). The build is btlib.kernels.cpu.build.int8_module: the attention kernels' cache, ISA flags
    and announcement. Cached here because Int8Linear.forward asks on every call.
    """
    from .kernels.cpu import build

    why = build.int8_available()
    if why is None:
        try:
            return build.int8_module()
        except RuntimeError:
            why = build.int8_available()  # the remembered failure: the compiler's first errors
    if not why.startswith("no C++ compiler") and "int8 build" not in _warned:  # no compiler: the documented fallback
        _warned.add("int8 build")
        warnings.warn(f"btlib: {why}\nbtlib.quant.Int8Linear runs the same arithmetic as torch ops from now on in this "
                      "process (slower); fix the compiler (or CXX) and restart to use int8.cpp.", RuntimeWarning, stacklevel=2)
    return None


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: x (M, K) float -> (q (M, K) int8, s (M, 1) float32) with x ~ q * s.

    A row holding NaN or inf gets a non-finite s (NaN or inf) and q = 0 there (casting NaN to int8 is undefined).
    """
    s = x.abs().amax(1, keepdim=True).clamp_min_(1e-12).div_(127.0)  # (M, 1); amax and clamp keep NaN
    return torch.div(x, s).round_().nan_to_num_(0.0, 0.0, 0.0).to(torch.int8), s


_NO_GRAD = ("int8 has no backward (rounding to int8 has no useful gradient, and the int8 weights are buffers): "
            "call it under torch.inference_mode() or torch.no_grad(), or compute gradients with the fp32 model")


class Int8Linear(nn.Module):
    """y = act(x W^T + b) with int8 W (per output channel) and x quantised per token on every call.

    weight: (N, K) float, bias: (N,) or None; smooth: (K,) SmoothQuant scales a (None: no smoothing);
    activation: None, "gelu" or "relu", applied in fp32 after the rescale. ``weight`` stays referenced (a
    non-persistent buffer, shared with the caller's fp32 weight): tokens holding NaN or inf run on it.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, smooth: Tensor | None = None, activation: str | None = None):
        super().__init__()
        if not bool(torch.isfinite(weight).all()):
            raise ValueError("Int8Linear: weight holds NaN or inf, which no per-channel int8 scale can represent; "
                             "fix the checkpoint (fp32 would give NaN/inf in those output channels for every token)")
        w = weight.detach().float()
        if smooth is not None:
            w = w * smooth  # x W^T = (x / a)(W a)^T
        q, w_scale = quantize_rows(w)  # per output channel: (N, K) int8, (N, 1)
        self.register_buffer("qweight_t", q.t().contiguous())  # (K, N): _int_mm's fast layout (row-major B)
        self.register_buffer("w_scale", w_scale.view(-1))  # (N,)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.register_buffer("inv_smooth", None if smooth is None else (1.0 / smooth).float())
        self.register_buffer("weight_fp32", weight.detach().float(), persistent=False)  # (N, K), fp32: no copy
        self.activation = activation
        self._ones: Tensor | None = None  # oneDNN's unit weight scales (N,), made at its first use

    def forward(self, x: Tensor, residual: Tensor | None = None, *, path: str | None = None) -> Tensor:
        """x: (M, K) float32 -> act(x W^T + b) (+ residual (M, N)): (M, N) float32. Raises ValueError where autograd
        would record the call. path: "int_mm" or "onednn_int8" (default: btlib.gemm.choose_int8's for M, K, N)."""
        if torch.is_grad_enabled() and x.requires_grad:
            raise ValueError(f"Int8Linear: x requires grad, but {_NO_GRAD}")
        if path is not None and path not in gemm.INT8_PATHS:
            raise ValueError(f"path must be one of {gemm.INT8_PATHS} or None; got {path!r}")
        k = kernels()
        if k is None:
            return self._forward_torch(x, residual)
        path = path or gemm.choose_int8(x.shape[0], *self.qweight_t.shape)
        packed = self._onednn_pack(path) if path == "onednn_int8" else None
        xq, s = k.quantize_rows(x.contiguous(), self._smooth(), packed is not None)  # (M, K) int8 (uint8 + 128: oneDNN), (M, 1)
        try:
            y = self.forward_quantized(xq, s, packed, residual)
        except _OneDnnOff:  # off for this process (choose_int8 says int_mm from now on); this call too
            return self.forward(x, residual, path="int_mm")
        return self._nonfinite_rows(x, s, y, residual)

    def forward_quantized(self, xq: Tensor, s: Tensor, packed: Tensor | None, residual: Tensor | None = None) -> Tensor:
        """act(x W^T + b) (+ residual) from x already quantised: quantize_rows' (M, K) q and (M, 1) s, uint8 + 128
        where ``packed`` (this weight's oneDNN copy, :meth:`onednn_packed`) is given, int8 for torch._int_mm where it
        is None. Rows whose s is not finite come out as garbage: the caller recomputes them."""
        k = kernels()
        M, N = xq.shape[0], self.qweight_t.shape[1]
        y = torch.empty(M, N)
        b = self.bias if self.bias is not None else _EMPTY
        r = residual.contiguous() if residual is not None else None
        act = _ACT[self.activation]
        for i in range(0, M, ROWS):  # row blocks: the GEMMs' fast sizes, and acc stays in cache for dequantize
            k.dequantize(self._sums(xq[i:i + ROWS], packed), s[i:i + ROWS], self.w_scale, b, act,
                         _EMPTY if r is None else r[i:i + ROWS], y[i:i + ROWS])  # act and residual in the same pass
        return y

    def requantized(self, xq: Tensor, s: Tensor, packed: Tensor | None, nxt: Int8Linear,
                    nxt_packed: Tensor | None) -> tuple[Tensor, Tensor]:
        """act(x W^T + b) quantised for ``nxt`` (its smoothing, its GEMM path: uint8 + 128 where ``nxt_packed``),
        from x quantised as in :meth:`forward_quantized`: (M, N) q and (M, 1) s, the floats never written (int8.cpp's
        requantize). A row whose output holds NaN or inf gets s = NaN."""
        k = kernels()
        M, N = xq.shape[0], self.qweight_t.shape[1]
        q = torch.empty(M, N, dtype=torch.uint8 if nxt_packed is not None else torch.int8)
        s_out = torch.empty(M, 1)
        b = self.bias if self.bias is not None else _EMPTY
        for i in range(0, M, ROWS):
            k.requantize(self._sums(xq[i:i + ROWS], packed), s[i:i + ROWS], self.w_scale, b, _ACT[self.activation],
                         nxt._smooth(), nxt_packed is not None, q[i:i + ROWS], s_out[i:i + ROWS])
        return q, s_out

    def onednn_packed(self, M: int) -> Tensor | None:
        """oneDNN's packed weight where btlib.gemm.choose_int8 takes oneDNN for M rows of this weight, else None
        (torch._int_mm)."""
        path = gemm.choose_int8(M, *self.qweight_t.shape)
        return self._onednn_pack(path) if path == "onednn_int8" else None

    def _smooth(self) -> Tensor:
        return self.inv_smooth if self.inv_smooth is not None else _EMPTY

    def _sums(self, xq: Tensor, packed: Tensor | None) -> Tensor:
        """The integer sums xq W^T of one row block: int32 from torch._int_mm, or float32 from oneDNN (unit scales,
        no bias: the same integers as floats). Raises _OneDnnOff where oneDNN fails (recorded: int_mm from now on)."""
        if packed is None:
            return tp.int_mm(xq, self.qweight_t)
        try:
            return gemm.onednn_int8_linear(xq, 1.0, 128, packed, self._ones, None)
        except RuntimeError as e:
            gemm.int8_broke("onednn_int8", e)
            raise _OneDnnOff from e

    def _onednn_pack(self, path: str) -> Tensor | None:
        """oneDNN's packed copy of the int8 weight (btlib.gemm.pack: made once, remade after an in-place change);
        None (and int_mm from now on) where oneDNN refuses it."""
        try:
            packed = gemm.pack(self.qweight_t, path)
        except RuntimeError as e:
            gemm.int8_broke(path, e)
            return None
        if self._ones is None:
            self._ones = torch.ones(self.qweight_t.shape[1])
        return packed

    def _forward_torch(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        xs = x * self.inv_smooth if self.inv_smooth is not None else x
        xq, s = quantize_rows(xs)  # (M, K) int8, (M, 1)
        y = torch.mul(tp.int_mm(xq, self.qweight_t), self.w_scale)  # int32 (M, N) -> float32, times w_n
        y = torch.addcmul(self.bias, y, s, out=y) if self.bias is not None else y.mul_(s)  # * s_m + b
        y = self._activation(y)
        return self._nonfinite_rows(x, s, y if residual is None else y + residual, residual)

    def _activation(self, y: Tensor) -> Tensor:
        if self.activation == "gelu":
            return F.gelu(y)
        return F.relu(y) if self.activation == "relu" else y

    def _nonfinite_rows(self, x: Tensor, s: Tensor, y: Tensor, residual: Tensor | None = None) -> Tensor:
        """y with the rows whose scale s is not finite (their x holds NaN or inf) recomputed in fp32, so NaN
        and inf propagate exactly as in fp32. Costs one check of the (M,) scales on clean inputs."""
        bad = ~torch.isfinite(s.view(-1))
        if bool(bad.any()):
            fixed = self._activation(F.linear(x[bad], self.weight_fp32, self.bias))
            y[bad] = fixed if residual is None else fixed + residual[bad]
        return y


_EMPTY = torch.empty(0)
_ACT = {None: 0, "gelu": 1, "relu": 2}  # int8.cpp's dequantize act codes


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
        (min cosine against fp32 on 64 passages: 0.9983 with fp32 attention, 0.9979 with AMX), and attention,
        which int8 leaves in fp32, is the largest part of int8's time on long texts (12 varlen calls 164 of 368 ms
        profiled, passages at batch 32). Measured on an Intel Xeon (AMX, 2 threads), all-MiniLM-L6-v2 on 64 passages
        at batch 32: 536.6 -> 486.6 ms end to end. Only under backend "auto": a named backend runs as named; and
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
        if "linear1" in q8 and "linear2" in q8 and kernels() is not None:
            return _feed_forward_int8(q8["linear1"], q8["linear2"], x, residual)
        h = q8["linear1"](x) if "linear1" in q8 else layer.activation(layer.linear1(x))
        if "linear2" in q8:
            return q8["linear2"](h, residual)
        y = layer.linear2(h)
        return y if residual is None else y + residual


class _OneDnnOff(Exception):
    """oneDNN's int8 linear failed in this process (btlib.gemm.int8_broke has recorded it): redo the call on int_mm."""


def _feed_forward_int8(l1: Int8Linear, l2: Int8Linear, x: Tensor, residual: Tensor | None) -> Tensor:
    """l2(l1(x)) (+ residual) with l1's output quantised for l2 as it is computed (Int8Linear.requantized): the
    (M, 4 d) hidden state, the layer's widest, is never written as floats, nor read back: 2 x 4 bytes less per hidden
    value. The same bits as l2(l1(x)) (int8.cpp computes the row with the same code, built without FMA contraction).
    Measured on an Intel Xeon (AMX, 2 threads), all-MiniLM-L6-v2 encoding 64 passages at batch 32, median of 5
    interleaved rounds: 536.6 -> 528.5 ms with fp32 attention, 486.6 -> 464.4 ms with AMX attention.

    Rows whose input or hidden state holds NaN or inf are recomputed in fp32 through both linears, so they come out
    as the fp32 layer's."""
    k = kernels()
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
