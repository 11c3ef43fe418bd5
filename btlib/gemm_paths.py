"""The GEMM paths btlib.gemm chooses between, each one function of the same shape, and the weight-pack cache.

    _torch(x, W, b, act, residual, grad)   F.linear / addmm / _addmm_activation (bias, GELU / ReLU in the epilogue)
    _onednn(x, W, b, act, residual)        oneDNN with W pre-packed (pack(W)), bias, activation or residual fused
    _btlib(x, W, b, act, residual)         btlib's own fp32 GEMM (kernels/cpu/gemm.cpp) on W packed into panels
    int8_matmul, onednn_int8_pack / _linear: the int8 products btlib.quant's Int8Linear runs

No choice is made here (btlib.gemm decides which path runs, and falls back to F.linear when one raises); every
private torch op is called through btlib._torch_private. pack(W, path) makes each path's copy of W once and
reuses it while W is alive and unchanged (keyed by the tensor object and its version counter).
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _torch_private as tp

_packs: dict[tuple[str, int], tuple[weakref.ref, int, Tensor]] = {}  # (path, id(W)) -> (W alive?, W's version, packed W)
_lock = threading.Lock()


def _version(w: Tensor) -> int:
    # an inference tensor (e.g. a bf16 copy made under inference_mode) has no version counter and cannot change
    # in place outside inference mode; asking it raises, and the raise cost ~17 us on every call
    return -1 if w.is_inference() else w._version


def pack(weight: Tensor, path: str = "onednn") -> Tensor:
    """W (N, K) -> the copy ``path`` multiplies by, made once and reused while W is alive and unchanged:
    oneDNN's blocked layout (fp32 or bf16) for "onednn", gemm.cpp's column panels (fp32) for "btlib",
    oneDNN's int8 layout for "onednn_int8" (W given as int8 (K, N), as btlib.quant keeps it for _int_mm).

    Keyed by the path, the tensor object and its version counter: an in-place update (load_state_dict,
    copy_) makes a new pack. Memory: one extra copy of every weight per path that runs it.
    """
    key = (path, id(weight))
    hit = _packs.get(key)
    if hit is not None and hit[0]() is weight and hit[1] == _version(weight):
        return hit[2]
    with torch.no_grad():
        if path == "btlib":
            packed = _gemm_cpp().pack(weight.detach().contiguous())
        elif path == "onednn_int8":  # weight: int8 (K, N), _int_mm's layout; packed for 1024-row blocks
            packed = onednn_int8_pack(weight.detach().t().contiguous(), (1024, weight.shape[0]))
        else:
            packed = tp.reorder_linear_weight(weight.detach())
    with _lock:
        if hit is None or hit[0]() is not weight:
            weakref.finalize(weight, _packs.pop, key, None)  # drop the pack with the weight
        _packs[key] = (weakref.ref(weight), _version(weight), packed)
    return packed


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str, residual: Tensor | None) -> Tensor:
    w = pack(weight)
    if residual is not None and activation == "none":
        return tp.linear_pointwise_binary(x, residual.to(x.dtype), w, bias, "add")
    y = tp.linear_pointwise(x, w, bias, activation, [], "none" if activation == "gelu" else "")
    return y if residual is None else y + residual


def _gemm_cpp():
    if not _gemm_mod:
        from .kernels.cpu import build

        _gemm_mod.append(build.gemm_module())
    return _gemm_mod[0]


_gemm_mod: list = []  # gemm.cpp's module once loaded (asked at every "btlib"-path linear)


def _btlib(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str, residual: Tensor | None) -> Tensor:
    N, K = weight.shape
    if x.shape[-1] != K or (bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype)):
        return _torch(x, weight, bias, activation, residual, False)  # F.linear's own error, or its type promotion
    flat = x.dim() == 2  # the encoders' (tokens, d): no reshapes (each costs ~0.5 us; one query makes 24 calls)
    x2 = x if flat and x.is_contiguous() else x.reshape(-1, K).contiguous()
    fused = residual is not None and residual.dtype == x.dtype and residual.shape == (*x.shape[:-1], N)
    r = (residual if flat and residual.is_contiguous() else residual.reshape(-1, N).contiguous()) if fused else _EMPTY
    y = _gemm_cpp().linear(x2, pack(weight, "btlib"), N, _EMPTY if bias is None else bias.contiguous(), _ACT[activation], r)
    if not flat:
        y = y.view(*x.shape[:-1], N)
    return y + residual if residual is not None and not fused else y


_ACT = {"none": 0, "gelu": 1, "relu": 2}  # gemm.cpp's act codes


_EMPTY = torch.empty(0)


def _torch(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str, residual: Tensor | None, grad: bool) -> Tensor:
    if residual is not None and activation == "none" and x.dim() == 2:
        y = torch.addmm(residual, x, weight.t())  # the residual as addmm's C (beta = 1): one pass fewer
        return y if bias is None else y + bias
    if activation != "none" and bias is not None and x.dim() == 2 and not grad and (
            activation == "relu" or x.device.type == "cpu"):
        # bias + activation in the GEMM's epilogue: one pass over the (M, N) activations, not three. CPU only
        # for GELU (on CUDA the epilogue's GELU is the tanh approximation); no derivative, so not under autograd
        y = tp.addmm_activation(bias, x, weight.t(), use_gelu=activation == "gelu")
    else:
        y = F.linear(x, weight, bias)
        y = F.gelu(y) if activation == "gelu" else F.relu(y) if activation == "relu" else y
    return y if residual is None else y + residual


def int8_matmul(x: Tensor, w_t: Tensor) -> Tensor:
    """torch._int_mm: x (M, K) int8 @ w_t (K, N) int8 -> (M, N) int32 (exact integer sums)."""
    return tp.int_mm(x, w_t)


def onednn_int8_pack(w: Tensor, x_shape: tuple[int, int]) -> Tensor:
    """w (N, K) int8 per-channel-quantized -> oneDNN's packed int8 weight for inputs of shape x_shape."""
    return tp.qlinear_prepack(w, list(x_shape))


def onednn_int8_linear(qx: Tensor, x_scale: float, x_zero_point: int, packed_w: Tensor, w_scale: Tensor,
                       bias: Tensor | None) -> Tensor:
    """oneDNN int8 linear: qx (M, K) uint8 (x = (qx - zp) * scale), packed_w from :func:`onednn_int8_pack`,
    w_scale (N,) float32 -> (M, N) float32, bias (N,) float32 added."""
    zeros = torch.zeros(w_scale.shape, dtype=torch.int64)
    return tp.qlinear_pointwise(qx, x_scale, x_zero_point, packed_w, w_scale, zeros, bias, 1.0, 0,
                                              torch.float32, "none", [], "")
