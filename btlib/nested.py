"""torch.nested adapters around the packed format.

A jagged nested tensor (``layout=torch.jagged``) *is* packed tokens plus offsets: its
``values()`` is the (total, ...) token tensor and its ``offsets()`` is cu_seqlens (int64).
So conversion costs nothing but the offsets' dtype. PyTorch stopped developing nested
tensors; btlib keeps them only as a door in and out of its own packed format.

    lengths [2, 4, 3] -> nested (3, j, d) with values (9, d), offsets [0, 2, 6, 9]

The older strided nested tensors that nn.TransformerEncoder builds internally on its sparsity
path (torch._nested_tensor_from_mask) are another layout; btlib does not create those.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
from torch import Tensor

from . import _torch_private as tp
from .padding import Packed, check_cu_seqlens, check_int, pack

__all__ = ["packed_to_nested", "nested_to_packed", "padded_to_nested", "nested_to_padded"]


@contextlib.contextmanager
def quiet_jagged() -> Iterator[None]:
    """Silence the "is_fx_tracing will return true ..." log line that torch 2.13 prints (with a
    timestamp, on stderr) whenever jagged tensors are built or used; it concerns fx tracing, not us."""
    logger = logging.getLogger(tp.FX_TRACE_LOGGER)
    only_errors = logging.Filter()
    only_errors.filter = lambda record: record.levelno >= logging.ERROR  # type: ignore[method-assign]
    logger.addFilter(only_errors)
    try:
        yield
    finally:
        logger.removeFilter(only_errors)


def _check_jagged(nt: Tensor) -> None:
    if not (isinstance(nt, Tensor) and nt.is_nested and nt.layout == torch.jagged):
        raise TypeError(
            "expected a nested tensor with layout=torch.jagged (torch.nested.nested_tensor(..., layout=torch.jagged)); "
            f"got {'a strided nested tensor' if getattr(nt, 'is_nested', False) else type(nt).__name__}"
        )


def packed_to_nested(tokens: Tensor, cu_seqlens: Tensor) -> Tensor:
    """(total, ...) tokens + (B + 1,) int32 cu_seqlens -> jagged nested tensor (B, j, ...). Shares storage."""
    check_cu_seqlens(cu_seqlens, total=tokens.shape[0])
    with quiet_jagged():
        return torch.nested.nested_tensor_from_jagged(tokens, offsets=cu_seqlens.long())


def nested_to_packed(nt: Tensor) -> Packed:
    """Jagged nested tensor (B, j, ...) -> Packed(tokens (total, ...), cu_seqlens int32, max_seqlen)."""
    _check_jagged(nt)
    offsets = nt.offsets()
    lengths = offsets[1:] - offsets[:-1]
    return Packed(nt.values(), offsets.to(torch.int32), int(lengths.max()) if lengths.numel() else 0)


def padded_to_nested(x: Tensor, lengths: Tensor) -> Tensor:
    """(B, T, ...) padded batch + (B,) lengths -> jagged nested tensor (B, j, ...). Copies the real tokens."""
    tokens, cu_seqlens, _ = pack(x, lengths)
    return packed_to_nested(tokens, cu_seqlens)


def nested_to_padded(nt: Tensor, T: int | None = None, fill: float = 0.0) -> Tensor:
    """Jagged nested tensor (B, j, ...) -> (B, T, ...) with ``fill`` at padding.

    T defaults to the longest sequence; a T shorter than that raises (as :func:`btlib.unpack` does).
    """
    tokens, cu_seqlens, max_seqlen = nested_to_packed(nt)
    # Always pass the size: without it, to_padded_tensor may pad to a cached bound, not the longest sequence.
    T = max_seqlen if T is None else check_int(T, "T", hint="the padded length, >= the longest sequence")
    if T < max_seqlen:
        raise ValueError(f"T={T} is shorter than the longest sequence ({max_seqlen}); nested_to_padded does not truncate. "
                         f"Pass T >= {max_seqlen} (or T=None), or cut the sequences before nesting them")
    with quiet_jagged():
        return torch.nested.to_padded_tensor(nt, fill, output_size=(nt.size(0), T, *tokens.shape[1:]))
