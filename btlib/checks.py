"""Input checks at the boundary of every attention entry point, with messages that say what to do."""

from __future__ import annotations

import torch
from torch import Tensor

from .padding import INT32_MAX, check_cu_seqlens, check_int, check_lengths

__all__ = ["check_padded_inputs", "check_varlen_inputs", "check_window", "window_reach", "check_int", "INT32_MAX",
           "MAX_REACH"]

# A window reach past any possible sequence is no limit: stored as 2^62, so that i +- reach stays in int64
# for every position i a tensor can have (what sys.maxsize would overflow, and 2^63 does not fit at all).
MAX_REACH = 2**62

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_common(q: Tensor, k: Tensor, v: Tensor, rank: int, layout: str) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
        if x.is_nested:
            raise TypeError(
                f"{name} is a nested tensor; pass its packed form instead: "
                "tokens, cu_seqlens, max_seqlen = btlib.nested_to_packed(nt), then btlib.varlen_attention"
            )
        if x.dim() != rank:
            shape = "(B, H, T, D)" if rank == 4 else "(total, H, D)"
            raise ValueError(f"{layout} attention expects {name} of shape {shape}; got {tuple(x.shape)}")
        if x.dtype not in _FLOAT:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64; got {x.dtype}")
        if x.stride(-1) != 1 and x.shape[-1] > 1 and x.numel() > 0:  # a stride over one element (or none) is never used
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension; call {name}.contiguous()")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-1] == 0:
        raise ValueError(f"head_dim is 0 (q has shape {tuple(q.shape)}): attention needs D >= 1, and its default "
                         "scale 1/sqrt(D) is undefined; check how the heads were split (d_model // nhead)")


def check_window(window) -> tuple[int, int] | None:
    """A local attention window as (left, right) ints >= 0, or None (global attention).

    Query i may attend key j iff i - left <= j <= i + right; ModernBERT's local layers use
    (64, 64), a 129-key band. Each reach is an int, numpy integer or 0-d integer tensor (not a
    bool); one above :data:`MAX_REACH` (2^62, e.g. sys.maxsize) is the same band and is returned as
    MAX_REACH. Raises TypeError / ValueError saying what to pass.
    """
    if window is None:
        return None
    hint = "pass window=(left, right) with ints >= 0 (query i attends keys i - left .. i + right), or None for global attention"
    if not isinstance(window, (tuple, list)):
        raise TypeError(f"window must be a (left, right) tuple or None; got {type(window).__name__} {window!r}: {hint}")
    if len(window) != 2:
        raise ValueError(f"window must have 2 entries (left, right); got {len(window)}: {window!r}: {hint}")
    left, right = (min(check_int(w, f"window {name}", hint=hint), MAX_REACH) for name, w in zip(("left", "right"), window))
    return left, right


def window_reach(window) -> tuple[int, int]:
    """:func:`check_window`'s (left, right) as the compiled kernels take it: -1 = no limit on that side."""
    w = check_window(window)
    return (-1, -1) if w is None else w


def check_padded_inputs(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor | None) -> None:
    """q: (B, H, T, D); k, v: (B, H, S, D); lengths: (B,) int in [0, min(T, S)], one per row for queries and keys."""
    _check_common(q, k, v, 4, "padded")
    B, H, T, D = q.shape
    if k.shape[:2] != (B, H) or k.shape[3] != D:
        raise ValueError(f"k, v must be (B, H, S, D) with q's B, H, D; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if lengths is not None:
        check_lengths(lengths, T=min(T, k.shape[2]), B=B)
        if lengths.device != q.device:
            raise ValueError(f"lengths must be on q's device ({q.device}); got {lengths.device}")


def check_varlen_inputs(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> None:
    """q, k, v: (total, H, D); cu_seqlens: (B + 1,) int32 on q's device; max_seqlen >= every length."""
    _check_common(q, k, v, 3, "varlen")
    if k.shape != q.shape:
        raise ValueError(f"varlen self-attention needs q, k, v of one shape (total, H, D); got {tuple(q.shape)}, {tuple(k.shape)}")
    if isinstance(cu_seqlens, Tensor) and cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be on q's device ({q.device}); got {cu_seqlens.device}")
    check_cu_seqlens(cu_seqlens, total=q.shape[0], max_seqlen=max_seqlen)
