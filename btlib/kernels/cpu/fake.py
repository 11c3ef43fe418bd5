"""Fake (meta) kernels of the C++ CPU ops, so torch.compile and torch.library.opcheck see through them.

    register(namespace)   called by build.py each time a build's library loads (every ISA, every load_copy tag)

A fake kernel computes only what the real one returns: shape, dtype, device and strides, from the
inputs' metadata. Each mirrors attention.cpp's binding:

    attention_v1/v2/v3(q, k, v, lengths, causal, scale[, window_left, window_right, bias, bias_kind, bias_max_distance])
        q (B, H, T, D), k, v (B, H, S, D) -> (B, H, T, D), q's dtype, contiguous (at::empty(q.sizes()))
    varlen_v3(q, k, v, cu_seqlens, max_seqlen, causal, scale, window_left, window_right, bias, bias_kind, bias_max_distance)
        q, k, v (total, H, D), cu_seqlens (B + 1,) int32 -> (total, H, D), q's dtype, contiguous
    varlen_amx(...)   varlen_v3's signature (AMX tiles; float32 in and out runs bf16 products)

They repeat the binding's checks that need no data (rank, dtype, shapes, head_dim, strides, the window's
reaches, the position bias's kind and shape), with its messages. The checks that read values (lengths in [0, min(T, S)], cu_seqlens
0-based, non-decreasing, ending at total, no sequence above max_seqlen) cannot run on fake tensors:
the C++ kernel makes them when the compiled graph runs. build_info() -> str takes and returns no
tensor, so it needs no fake kernel and is never part of a graph.

What traces: these ops, with torch.compile(fullgraph=True) (btlib.PackedEncoder.forward_packed with
the C++ varlen kernel inside: tests/test_compile.py). What does not: btlib.quant's int8 helpers in
int8.cpp, which are pybind functions, not torch ops (dynamo cannot trace into them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ... import _torch_private as tp

__all__ = ["register", "OPS"]

OPS = ("attention_v1", "attention_v2", "attention_v3", "varlen_v3", "varlen_amx")
MAX_HEAD_DIM = 256  # kMaxD in core.h
_registered: set[str] = set()


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, rank: int, allow_bf16: bool) -> None:
    """attention.cpp's check_qkv, on metadata only (the device is the dispatcher's: only CPU and fake tensors get here)."""
    for x in (q, k, v):
        tp.check(x.dim() == rank, lambda: f"btlib CPU attention: expected {'(B, H, T, D)' if rank == 4 else '(total, H, D)'} "
                                           f"inputs; got {list(x.shape)}")
        tp.check(x.dtype == torch.float32 or (allow_bf16 and x.dtype == torch.bfloat16),
                  lambda: f"btlib CPU attention: dtype must be float32{' or bfloat16' if allow_bf16 else ''}; got {x.dtype}")
        tp.check(x.numel() == 0 or x.stride(-1) == 1,
                  lambda: "btlib CPU attention: head_dim must be contiguous (stride 1); call .contiguous()")
    tp.check(q.dtype == k.dtype == v.dtype, lambda: "btlib CPU attention: q, k, v must share one dtype")
    tp.check(k.shape == v.shape,
              lambda: f"btlib CPU attention: k and v must have one shape; got {list(k.shape)} and {list(v.shape)}")
    D = q.shape[-1]
    tp.check(1 <= D <= MAX_HEAD_DIM, lambda: f"btlib CPU attention: head_dim must be in [1, {MAX_HEAD_DIM}]; got {D}")
    tp.check(k.shape[-1] == D, lambda: f"btlib CPU attention: q and k must have one head_dim; got {D} and {k.shape[-1]}")


def _check_window(left: int, right: int) -> None:
    tp.check(left >= -1 and right >= -1, lambda: "btlib CPU attention: window_left and window_right must be >= 0, or -1 "
                                                  f"for no limit on that side; got {left} and {right}")


def _check_bias(bias: Tensor | None, kind: int, R: int, H: int) -> None:
    tp.check(0 <= kind <= 2, lambda: f"btlib CPU attention: bias_kind must be 0 (none), 1 (ALiBi) or 2 (table); got {kind}")
    tp.check((kind == 0) == (bias is None), lambda: "btlib CPU attention: pass a bias tensor exactly when bias_kind is 1 or 2 "
                                                    "(btlib.PositionBias.kernel_args() gives the three arguments)")
    if bias is None:
        return
    tp.check(bias.dtype == torch.float32, lambda: f"btlib CPU attention: the position bias must be a float32 CPU tensor; got {bias.dtype}")
    want = (H,) if kind == 1 else (H, 2 * R + 1)
    tp.check(tuple(bias.shape) == want, lambda: f"btlib CPU attention: the position bias must be {want}; got {list(bias.shape)}")


def _padded(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor | None, allow_bf16: bool) -> Tensor:
    _check_qkv(q, k, v, 4, allow_bf16)
    tp.check(k.shape[0] == q.shape[0] and k.shape[1] == q.shape[1],
              lambda: f"btlib CPU attention: k must be (B, H, S, D) with q's B and H; got {list(k.shape)}")
    if lengths is not None:
        tp.check(lengths.dim() == 1 and lengths.shape[0] == q.shape[0],
                  lambda: f"btlib CPU attention: lengths must be (B,) = ({q.shape[0]},); got {list(lengths.shape)}")
    return q.new_empty(q.shape)  # (B, H, T, D) contiguous, whatever q's strides


def _v1(q, k, v, lengths, causal, scale):
    return _padded(q, k, v, lengths, allow_bf16=False)


def _v3(q, k, v, lengths, causal, scale, window_left=-1, window_right=-1, bias=None, bias_kind=0, bias_max_distance=0):
    _check_window(window_left, window_right)
    _check_bias(bias, bias_kind, bias_max_distance, q.shape[1])
    return _padded(q, k, v, lengths, allow_bf16=True)


def _varlen(q, k, v, cu_seqlens, max_seqlen, causal, scale, window_left=-1, window_right=-1, bias=None, bias_kind=0,
            bias_max_distance=0):
    _check_qkv(q, k, v, 3, True)
    tp.check(k.shape == q.shape, lambda: "btlib CPU varlen attention: q, k, v must have one shape (total, H, D); "
                                          f"got {list(q.shape)} and {list(k.shape)}")
    tp.check(cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 1,
              lambda: "btlib CPU varlen attention: cu_seqlens must be a 1-D int32 tensor of B + 1 offsets; "
                      f"got {cu_seqlens.dtype} {list(cu_seqlens.shape)}")
    _check_window(window_left, window_right)
    _check_bias(bias, bias_kind, bias_max_distance, q.shape[1])
    return q.new_empty(q.shape)  # (total, H, D) contiguous


_FAKES = {"attention_v1": _v1, "attention_v2": _v1, "attention_v3": _v3, "varlen_v3": _varlen, "varlen_amx": _varlen}


def register(namespace: str) -> None:
    """Register the fake kernel of every tensor op in ``torch.ops.<namespace>`` (once per namespace and process)."""
    if namespace in _registered:
        return
    for name, fake in _FAKES.items():
        torch.library.register_fake(f"{namespace}::{name}", fake)
    _registered.add(namespace)
