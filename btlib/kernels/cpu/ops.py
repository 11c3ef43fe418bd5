"""Typed wrappers of the C++ CPU kernels (attention.cpp), and their registry entries.

Each wrapper builds the library on its first call (build.ops), fills in the default scale and
calls ``torch.ops.btlib_cpu_<isa>.<op>`` of the build :func:`build.isa` picks. Shapes:

    attention_v1/v2(q, k, v, *, lengths=None, causal=False, scale=None)
    attention_v3(q, k, v, *, lengths=None, causal=False, scale=None, window=None, bias=None)
        q: (B, H, T, D); k, v: (B, H, S, D); lengths: (B,) int, <= min(T, S) -> (B, H, T, D)
        Any strides with head_dim contiguous: q.transpose(1, 2) of a (B, T, H, D) projection works.
    varlen_attention_v3(q, k, v, cu_seqlens, max_seqlen, *, causal=False, scale=None, window=None, bias=None)
        q, k, v: (total, H, D); cu_seqlens: (B + 1,) int32 -> (total, H, D)

window=(left, right): local attention, query i attends keys i - left .. i + right; v3 and varlen
visit only the key tiles that meet each query block's band (v1/v2, the teaching versions, take none).
bias=btlib.PositionBias (ALiBi or a relative-position table): v3 and varlen add it per score inside the
tile loop (flash.h), from the positions within each sequence; v1/v2 take none (the registry says so).

Only float32 for v1/v2; float32 and bfloat16 for v3 and varlen. bf16 sums in fp32: on a CPU with
AVX512_BF16 both products run on vdpbf16ps (P is rounded to bf16 for P V, as PyTorch does);
elsewhere bf16 is converted to fp32 while packing. The output is rounded to bf16 once.

torch.compile: every op has a fake kernel (fake.py), so these wrappers trace with fullgraph=True and the
op lands in the graph; the build's load and the bf16 warning run once while dynamo traces, not in the graph.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from ... import precision
from ..._compile import constant_result
from ...checks import INT32_MAX, check_int, window_reach
from ...hardware import bf16_native
from ...position_bias import PositionBias, kernel_args
from ..registry import Kernel, register
from . import build

__all__ = ["attention_v1", "attention_v2", "attention_v3", "varlen_attention_v3", "varlen_attention_amx", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256  # kMaxD in core.h


def _scale(q: Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


_bf16_fine: tuple | None = None  # (build, BTLIB_ASSUME_NO_BF16) for which a bf16 call found nothing to warn about


# Under torch.compile both helpers run once while dynamo traces (they read os.environ and /proc/cpuinfo, which
# dynamo cannot trace) and their results are constants of the graph: the warning comes at compile time.
@constant_result  # torch.compiler.assume_constant_result, without importing dynamo here
def _bf16_state() -> tuple:
    return build.isa(), os.environ.get("BTLIB_ASSUME_NO_BF16", "")


def _check_bf16(q: Tensor) -> None:
    """Warn once when bf16 inputs reach a build without bf16 dot products: they then run at the fp32 rate.

    Silent if btlib already warned about bf16 in this process (PackedEncoder and encode() warn about
    the slower matmuls, which matter more than this).
    """
    if q.dtype != torch.bfloat16 or _bf16_fine == _bf16_state():  # the hot paths pay one comparison
        return
    _bf16_verdict()


@constant_result  # torch.compiler.assume_constant_result, without importing dynamo here
def _bf16_verdict() -> None:
    global _bf16_fine
    if precision.warned("bf16"):
        return
    isa = build.isa()
    native, why = bf16_native()
    if isa == "avx512bf16" and native:
        _bf16_fine = _bf16_state()
        return
    reason = why if not native else f"the {isa} build was chosen (BTLIB_CPU_ISA)"
    precision.warn_once("C++ attention", (
        f"btlib's C++ attention in bf16 on the {isa} build: {reason}, so bf16 inputs are converted to fp32 "
        "while packing and run at the fp32 rate plus the conversion, no faster than fp32. It runs as asked; "
        "pass fp32 tensors (or precision='auto', which picks fp32 here) for the same speed without the rounding."), stacklevel=4)


def attention_v1(q: Tensor, k: Tensor, v: Tensor, *, lengths: Tensor | None = None, causal: bool = False,
                 scale: float | None = None) -> Tensor:
    """v1: materialise S = Q K^T (T x S per (b, h)), softmax, P V. (B, H, T, D) float32."""
    return build.ops().attention_v1(q, k, v, lengths, causal, _scale(q, scale))


def attention_v2(q: Tensor, k: Tensor, v: Tensor, *, lengths: Tensor | None = None, causal: bool = False,
                 scale: float | None = None) -> Tensor:
    """v2: Br x Bc tiles, two passes over K (max, then exp-sum and P V). (B, H, T, D) float32."""
    return build.ops().attention_v2(q, k, v, lengths, causal, _scale(q, scale))


def attention_v3(q: Tensor, k: Tensor, v: Tensor, *, lengths: Tensor | None = None, causal: bool = False,
                 scale: float | None = None, window: tuple[int, int] | None = None,
                 bias: PositionBias | None = None) -> Tensor:
    """v3: one pass, online softmax, SIMD micro-kernels, threads over (b, h, query block). (B, H, T, D) fp32/bf16.

    window=(left, right): local attention; only the key tiles meeting a query block's band are computed.
    bias: a btlib.PositionBias of H heads on the CPU, added per score in the tile loop.
    """
    _check_bf16(q)
    return build.ops().attention_v3(q, k, v, lengths, causal, _scale(q, scale), *window_reach(window), *kernel_args(bias))


def varlen_attention_v3(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, causal: bool = False,
                        scale: float | None = None, window: tuple[int, int] | None = None,
                        bias: PositionBias | None = None) -> Tensor:
    """v3 on packed tokens: (total, H, D) fp32/bf16, cu_seqlens (B + 1,) int32; work 4 H D sum(L_i^2), with
    window=(left, right) about 4 H D sum_i L_i (64 + left + right) (whole 64-key tiles around each block's band).

    max_seqlen only bounds the lengths here: on a CPU the kernel reads cu_seqlens itself (host memory,
    B integers, no sync) and makes one task per real query block, so nothing is sized by it. The GPU
    kernels size their grid by it instead of reading the lengths back from the device.
    bias: a btlib.PositionBias, positions counted from each sequence's first token.
    """
    _check_bf16(q)
    max_seqlen = check_int(max_seqlen, "max_seqlen", high=INT32_MAX)
    return build.ops().varlen_v3(q, k, v, cu_seqlens, max_seqlen, causal, _scale(q, scale), *window_reach(window),
                                 *kernel_args(bias))


def varlen_attention_amx(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, causal: bool = False,
                         scale: float | None = None, window: tuple[int, int] | None = None,
                         bias: PositionBias | None = None) -> Tensor:
    """:func:`varlen_attention_v3` with both products on AMX tiles (flash_amx.h): (total, H, D) bfloat16 only,
    cu_seqlens (B + 1,) int32. The online softmax, masks, window and bias are v3's own code (AVX-512, fp32);
    P is rounded to bf16 for P V, as on the vdpbf16ps path. Runs where :func:`build.amx_available` is None.
    """
    max_seqlen = check_int(max_seqlen, "max_seqlen", high=INT32_MAX)
    return build.ops().varlen_amx(q, k, v, cu_seqlens, max_seqlen, causal, _scale(q, scale), *window_reach(window),
                                  *kernel_args(bias))


_F32 = (torch.float32,)
_F32_BF16 = (torch.float32, torch.bfloat16)
_common = dict(backend="cpp", devices=("cpu",), max_head_dim=MAX_HEAD_DIM, available=build.available)

register(Kernel("cpu_naive_v1", "padded", attention_v1, dtypes=_F32, priority=-50,
                description="C++ v1: materialise S = QK^T, softmax, PV (plain loops)", **_common))
register(Kernel("cpu_tiled_v2", "padded", attention_v2, dtypes=_F32, priority=-40,
                description="C++ v2: key/value tiles, two passes over K (plain loops)", **_common))
register(Kernel("cpu_flash_v3", "padded", attention_v3, dtypes=_F32_BF16, priority=10, window=True, bias=True,
                description="C++ v3: one-pass online softmax, SIMD micro-kernels, threads over (b, h, block); "
                            "a window skips the key tiles outside it", **_common))
register(Kernel("cpu_flash_varlen", "varlen", varlen_attention_v3, dtypes=_F32_BF16, priority=10, window=True, bias=True,
                description="C++ v3 on packed tokens + cu_seqlens: no work on padding (nor outside a window)", **_common))
# Where AMX runs, "auto" times it against cpu_flash_varlen and PyTorch's SDPA loop (btlib.kernels.choice); the
# priority above cpu_flash_varlen only breaks a tie within 3% (and orders the calls that are not measured).
register(Kernel("cpu_amx_varlen", "varlen", varlen_attention_amx, dtypes=(torch.bfloat16,), priority=20, window=True, bias=True,
                description="C++ v3 on packed tokens with Q K^T and P V on AMX tiles (bf16; Intel Xeon since Sapphire Rapids)",
                **{**_common, "available": build.amx_available}))
