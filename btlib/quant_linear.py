"""btlib.quant's int8 linear layer: int8 weights per output channel, activations quantised per token.

Int8Linear is one nn.Linear in int8 (the arithmetic, the NaN / inf rule and the autograd refusal are
btlib.quant's module docstring's); :func:`kernels` loads the fused quantize / dequantize passes of
kernels/cpu/int8.cpp it runs on; :func:`quantize_rows` is the same per-token quantisation in torch ops.
The GEMM takes the int8 path btlib.gemm.choose_int8 measured faster here (torch._int_mm or oneDNN's int8 linear).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _torch_private as tp, gemm

__all__ = ["Int8Linear", "quantize_rows", "kernels", "ROWS"]

ROWS = 1024  # tokens per _int_mm call: its rate fell to about a third past 6144 rows at MiniLM's shapes (re-measure: gemm_measure)
_warned: set[str] = set()
_NO_GRAD = ("int8 has no backward (rounding to int8 has no useful gradient, and the int8 weights are buffers): "
            "call it under torch.inference_mode() or torch.no_grad(), or compute gradients with the fp32 model")
_EMPTY = torch.empty(0)
_ACT = {None: 0, "gelu": 1, "relu": 2}  # int8.cpp's dequantize act codes


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


class _OneDnnOff(Exception):
    """oneDNN's int8 linear failed in this process (btlib.gemm.int8_broke has recorded it): redo the call on int_mm."""
