"""Typed wrappers of btlib's Triton kernel (flash_attn.py), and its registry entries.

    triton_attention(q, k, v, *, lengths=None, causal=False, scale=None, window=None, bias=None)                   (B, H, T, D)
    triton_varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, causal=False, scale=None, window=None, bias=None)  (total, H, D)

bias: a btlib.PositionBias (ALiBi or a relative-position table) on q's device, computed in the kernel.

Both take CUDA tensors in fp16, bf16 or fp32 with head_dim <= 128 contiguous; sums in fp32; output
in the input dtype. Nothing here imports triton or touches the GPU until a kernel is called:
``triton_available()`` only looks (is triton installed? is this a CUDA torch with a GPU?).

Ranked below PyTorch's kernels (registry.PRIORITY < 0), so ``backend="auto"`` keeps SDPA on CUDA tensors: on the
one GPU this has run on (an H200, docs/caveats.md; notebook 05's benchmark) SDPA's flash kernel was as fast or faster
on dense inputs. Name a kernel (``backend="triton_flash"``) to use it.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import Tensor

from ..gpu_limits import DTYPES, MAX_HEAD_DIM
from ..registry import CpuRun, Kernel, register

__all__ = ["triton_attention", "triton_varlen_attention", "triton_available"]


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_available() -> str | None:
    """None if the Triton kernels can run here, else why not. Cheap: imports nothing."""
    if not _triton_installed():
        return "needs triton, which has wheels for Linux x86_64 only: pip install 'btlib[gpu]' there"
    if torch.version.cuda is None:
        return f"needs a CUDA GPU and a CUDA build of torch (this is {torch.__version__})"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    return None


def triton_attention(q: Tensor, k: Tensor, v: Tensor, *, lengths: Tensor | None = None, causal: bool = False,
                     scale: float | None = None, window: tuple[int, int] | None = None, bias=None) -> Tensor:
    """Triton FlashAttention forward on a padded batch. q: (B, H, T, D); k, v: (B, H, S, D); lengths (B,) int;
    window=(left, right): local attention, key tiles outside each program's band skipped; bias: a btlib.PositionBias."""
    from .flash_attn import flash_attention

    return flash_attention(q, k, v, lengths=lengths, causal=causal, scale=scale, window=window, bias=bias)


def triton_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, causal: bool = False,
                            scale: float | None = None, window: tuple[int, int] | None = None, bias=None) -> Tensor:
    """Triton FlashAttention forward on packed tokens. q, k, v: (total, H, D); cu_seqlens (B + 1,) int32."""
    from .flash_attn import flash_varlen_attention

    return flash_varlen_attention(q, k, v, cu_seqlens, int(max_seqlen), causal=causal, scale=scale, window=window,
                                  bias=bias)


def _interpreter_available() -> str | None:
    return None if _triton_installed() else "needs triton, which has wheels for Linux x86_64 only"


# Without a GPU the check still runs the kernel's own source, in Triton's interpreter.
_triton = dict(backend="triton", devices=("cuda",), dtypes=DTYPES, max_head_dim=MAX_HEAD_DIM,
               available=triton_available, cpu_run=CpuRun("interpreter", _interpreter_available), window=True, bias=True)

register(Kernel("triton_flash", "padded", triton_attention,
                description="Triton FlashAttention forward: online softmax, key padding by lengths, causal, local window; tensor cores on sm_80+",
                **_triton))
register(Kernel("triton_flash_varlen", "varlen", triton_varlen_attention,
                description="Triton FlashAttention forward on packed tokens + cu_seqlens: no work on padding", **_triton))
