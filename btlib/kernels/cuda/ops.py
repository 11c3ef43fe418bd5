"""Typed wrappers of btlib's CUDA C++ kernel (flash_attn.cu + binding.cpp), and its registry entries.

    cuda_attention(q, k, v, *, lengths=None, causal=False, scale=None, window=None, bias=None)                   (B, H, T, D)
    cuda_varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, causal=False, scale=None, window=None, bias=None)  (total, H, D)

bias: a btlib.PositionBias (ALiBi or a relative-position table) on q's device, computed in the kernel.

Both take CUDA tensors in fp16, bf16 or fp32 with head_dim <= 128 contiguous; sums in fp32; output
in the input dtype. The extension builds on the first call (build.py); ``cuda_available()`` only
looks (a CUDA torch, a GPU, nvcc), never compiles.

Ranked below PyTorch's kernels (registry.PRIORITY < 0), so ``backend="auto"`` keeps SDPA on CUDA tensors: on the
one GPU this has run on (an H200, docs/caveats.md; notebook 05's benchmark) SDPA's flash kernel was as fast or faster
on dense inputs. Name a kernel (``backend="cuda_flash"``) to use it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...checks import INT32_MAX, check_int, window_reach
from ...position_bias import PositionBias, check_position_bias, kernel_args
from ..gpu_limits import DTYPES, MAX_HEAD_DIM
from ..registry import CpuRun, Kernel, register
from . import build, emulate

__all__ = ["cuda_attention", "cuda_varlen_attention", "cuda_available"]


def cuda_available() -> str | None:
    """None if the CUDA C++ kernel can be built (or is built) here, else why not. Never compiles."""
    return build.available()


def _scale(q: Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def cuda_attention(q: Tensor, k: Tensor, v: Tensor, *, lengths: Tensor | None = None, causal: bool = False,
                   scale: float | None = None, window: tuple[int, int] | None = None,
                   bias: PositionBias | None = None) -> Tensor:
    """CUDA C++ kernel on a padded batch (builds on first call). q: (B, H, T, D); k, v: (B, H, S, D); lengths (B,) int.

    window=(left, right): local attention; key tiles outside a query tile's band are not visited.
    bias: a btlib.PositionBias of H heads on q's device.
    """
    build.load()
    bias = check_position_bias(bias, q.shape[1], q.device)
    return torch.ops.btlib_cuda.attention_fwd(q, k, v, lengths, causal, _scale(q, scale), *window_reach(window),
                                              *kernel_args(bias))


def cuda_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, causal: bool = False,
                          scale: float | None = None, window: tuple[int, int] | None = None,
                          bias: PositionBias | None = None) -> Tensor:
    """CUDA C++ kernel on packed tokens (builds on first call). q, k, v: (total, H, D); cu_seqlens (B + 1,) int32;
    bias: a btlib.PositionBias, positions counted from each sequence's first token."""
    build.load()
    max_seqlen = check_int(max_seqlen, "max_seqlen", high=INT32_MAX)  # the grid is sized by it
    bias = check_position_bias(bias, q.shape[1], q.device)
    return torch.ops.btlib_cuda.varlen_fwd(q, k, v, cu_seqlens, max_seqlen, causal, _scale(q, scale), *window_reach(window),
                                           *kernel_args(bias))


# Without a GPU the check still runs the kernel's own source, on CPU threads (emulate.py).
_cuda = dict(backend="cuda", devices=("cuda",), dtypes=DTYPES, max_head_dim=MAX_HEAD_DIM,
             available=cuda_available, window=True, bias=True)

register(Kernel("cuda_flash", "padded", cuda_attention,
                description="CUDA C++ FlashAttention forward: one thread per query row, K/V tiles in shared memory (FMA, no tensor cores)",
                cpu_run=CpuRun("emulator", emulate.available, emulate.emulated_attention), **_cuda))
register(Kernel("cuda_flash_varlen", "varlen", cuda_varlen_attention,
                description="CUDA C++ FlashAttention forward on packed tokens + cu_seqlens",
                cpu_run=CpuRun("emulator", emulate.available, emulate.emulated_varlen_attention), **_cuda))
