"""Padding <-> packed tokens: btlib's one sparsity format.

A padded batch stores B sequences in a (B, T, ...) tensor, real tokens first in each row
(left aligned) and padding after. The packed form keeps only the real tokens:

    tokens      (total, ...)   total = sum(lengths), sequence after sequence
    cu_seqlens  (B + 1,) int32 cumulative lengths: sequence b is tokens[cu_seqlens[b]:cu_seqlens[b+1]]
    max_seqlen  int            max(lengths), what a kernel sizes its tiles by

    lengths [2, 4, 3] -> cu_seqlens [0, 2, 6, 9], max_seqlen 4, total 9

This is the layout of FlashAttention's varlen API and of padding-free training. The padded
form with a key-padding mask, and torch.nested jagged tensors (btlib.nested), are adapters.

Mask convention: ``padding_mask`` is True at padding, as nn.TransformerEncoder's
``src_key_padding_mask``. Its opposite, True at real tokens, is called ``valid``.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "Packed",
    "lengths_to_padding_mask",
    "padding_mask_to_lengths",
    "lengths_to_cu_seqlens",
    "cu_seqlens_to_lengths",
    "pack",
    "unpack",
    "check_lengths",
    "check_cu_seqlens",
    "zero_padded_rows",
    "segment_ids",
    "packed_positions",
    "segment_sum",
    "segment_mean",
    "check_int",
    "INT32_MAX",
]

INT32_MAX = 2**31 - 1  # cu_seqlens are int32: no sequence (and no packed batch) holds more tokens


class Packed(NamedTuple):
    """Packed tokens of a batch. tokens: (total, ...); cu_seqlens: (B + 1,) int32; max_seqlen: int."""

    tokens: Tensor
    cu_seqlens: Tensor
    max_seqlen: int

    @property
    def lengths(self) -> Tensor:
        return cu_seqlens_to_lengths(self.cu_seqlens)


def check_int(value, name: str, *, low: int = 0, high: int | None = None, hint: str = "") -> int:
    """``value`` as a Python int: an int, a numpy integer or a 0-d integer tensor; bool refused.

    Raises TypeError (not an integer) or ValueError (outside [low, high]) naming ``name``, before any
    arithmetic could overflow or truncate. ``hint`` ends the message (what to pass).
    Example: check_int(np.int64(8), "batch_size", low=1) -> 8; check_int(2.5, "T") raises TypeError.
    """
    hint = f"; {hint}" if hint else ""
    is_bool = isinstance(value, bool) or (isinstance(value, Tensor) and value.dtype == torch.bool)
    if is_bool or (isinstance(value, Tensor) and value.dim() != 0):
        raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}{hint}")
    try:
        v = operator.index(value)  # int, numpy integers, 0-d integer tensors; not floats, strings or numpy bools
    except TypeError:
        raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}{hint}") from None
    if v < low:
        raise ValueError(f"{name} must be >= {low}; got {v}{hint}")
    if high is not None and v > high:
        raise ValueError(f"{name} must be <= {high}; got {v}{hint}")
    return v


def check_lengths(lengths: Tensor, T: int | None = None, B: int | None = None) -> None:
    """Raise a ValueError/TypeError that says what to fix if ``lengths`` is not a valid (B,) int tensor."""
    if not isinstance(lengths, Tensor):
        raise TypeError(f"lengths must be a torch.Tensor of integers; got {type(lengths).__name__}")
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D (B,); got shape {tuple(lengths.shape)}")
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError(f"lengths must be an integer tensor (int32/int64); got {lengths.dtype}")
    T = None if T is None else check_int(T, "T", hint="the padded length, an int >= every length")
    if B is not None and lengths.numel() != B:
        raise ValueError(f"lengths has {lengths.numel()} entries but the batch has B={B}")
    if lengths.numel() == 0:
        return
    lo, hi = int(lengths.min()), int(lengths.max())
    if lo < 0:
        raise ValueError(f"lengths must be >= 0; got {lo}")
    if hi > INT32_MAX:
        raise ValueError(f"lengths must be <= {INT32_MAX} (int32 cu_seqlens address no longer sequence); got {hi}")
    if T is not None and hi > T:
        raise ValueError(
            f"lengths must be <= the padded length T={T}; got {hi}. "
            "Pad the batch to at least the longest sequence."
        )


def check_cu_seqlens_layout(cu_seqlens: Tensor) -> None:
    """The part of :func:`check_cu_seqlens` that reads no value, (B + 1,) int32 with B + 1 >= 1: what
    torch.compile traces (a value read has no place in a graph)."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a 1-D tensor of B + 1 offsets, e.g. [0, 2, 6, 9] for lengths [2, 4, 3]")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(
            f"cu_seqlens must be int32 (what every varlen kernel reads); got {cu_seqlens.dtype}. "
            "Use btlib.lengths_to_cu_seqlens(lengths) or cu_seqlens.to(torch.int32)."
        )


def check_cu_seqlens(cu_seqlens: Tensor, total: int | None = None, max_seqlen: int | None = None) -> None:
    """Raise an error that says what to fix if ``cu_seqlens`` is not (B + 1,) int32, 0-based, non-decreasing,
    ending at ``total`` tokens, with no sequence longer than ``max_seqlen``. Scalar reads: on CUDA each syncs."""
    check_cu_seqlens_layout(cu_seqlens)
    if int(cu_seqlens[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0; got {int(cu_seqlens[0])}")
    if cu_seqlens.numel() > 1 and bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing (lengths >= 0); got {cu_seqlens.tolist()}")
    if total is not None and int(cu_seqlens[-1]) != total:
        raise ValueError(f"cu_seqlens[-1] = {int(cu_seqlens[-1])} must equal the number of packed tokens ({total})")
    if max_seqlen is not None:
        max_seqlen = check_int(max_seqlen, "max_seqlen", high=INT32_MAX, hint="pass max(lengths), a Python int")
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
        if max_seqlen < longest:
            raise ValueError(f"max_seqlen={max_seqlen} is less than the longest sequence ({longest}); pass max(lengths)")


def lengths_to_padding_mask(lengths: Tensor, T: int | None = None) -> Tensor:
    """(B,) lengths -> (B, T) bool mask, True at padding. T defaults to max(lengths).

    Example: lengths [2, 4, 3], T=4 -> [[F, F, T, T], [F, F, F, F], [F, F, F, T]]
    """
    T = (int(lengths.max()) if lengths.numel() else 0) if T is None else check_int(T, "T")
    check_lengths(lengths, T)
    return ~_valid(lengths, T)


def _valid(lengths: Tensor, T: int) -> Tensor:
    """(B,) lengths -> (B, T) bool, True at real tokens, on lengths' device. Trusts its arguments."""
    return torch.arange(T, device=lengths.device).view(1, T) < lengths.view(-1, 1)


def padding_mask_to_lengths(padding_mask: Tensor) -> Tensor:
    """(B, T) bool mask, True at padding -> (B,) int64 lengths.

    The mask must be left aligned (real tokens first); a mask with a real token after padding
    raises, since no length describes it.
    """
    if padding_mask.dtype != torch.bool or padding_mask.dim() != 2:
        raise TypeError(f"padding_mask must be a (B, T) bool tensor, True at padding; got {padding_mask.dtype} {tuple(padding_mask.shape)}")
    lengths = (~padding_mask).sum(dim=1)
    if not torch.equal(~_valid(lengths, padding_mask.shape[1]), padding_mask):
        raise ValueError(
            "padding_mask is not left aligned (a real token follows padding in some row). "
            "btlib expects real tokens first, then padding, as tokenizers produce with right padding."
        )
    return lengths


def lengths_to_cu_seqlens(lengths: Tensor) -> tuple[Tensor, int]:
    """(B,) lengths -> (cu_seqlens (B + 1,) int32, max_seqlen int).

    Example: lengths [2, 4, 3] -> (tensor([0, 2, 6, 9], dtype=int32), 4)
    """
    check_lengths(lengths)
    return _cu_seqlens(lengths)


def _cu_seqlens(lengths: Tensor) -> tuple[Tensor, int]:
    """lengths_to_cu_seqlens for lengths already checked (btlib's entry points check once, then call this)."""
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    cu[1:] = torch.cumsum(lengths.long(), dim=0)  # in int64: an int32 cumsum wraps past 2^31 - 1 silently
    total = int(cu[-1])
    if total > torch.iinfo(torch.int32).max:
        raise ValueError(
            f"the batch has {total} tokens in all, more than int32 cu_seqlens can address (2^31 - 1 = "
            f"{torch.iinfo(torch.int32).max}); split it into smaller batches"
        )
    return cu.to(torch.int32), int(lengths.max()) if lengths.numel() else 0


def cu_seqlens_to_lengths(cu_seqlens: Tensor) -> Tensor:
    """(B + 1,) cu_seqlens -> (B,) lengths (int64). Example: [0, 2, 6, 9] -> [2, 4, 3]."""
    return (cu_seqlens[1:] - cu_seqlens[:-1]).long()


def pack(x: Tensor, lengths: Tensor) -> Packed:
    """Unpad: (B, T, ...) padded batch + (B,) lengths -> Packed((total, ...), cu_seqlens, max_seqlen).

    Costs one gather of the real tokens (total * row bytes read and written).

    Example: x (3, 4, d) with lengths [2, 4, 3] -> tokens (9, d) = x[0, :2], x[1, :4], x[2, :3].
    """
    if x.dim() < 2:
        raise ValueError(f"pack expects a batch (B, T, ...); got shape {tuple(x.shape)}")
    check_lengths(lengths, T=x.shape[1], B=x.shape[0])
    return _pack(x, lengths.to(x.device))


def _pack(x: Tensor, lengths: Tensor) -> Packed:
    """pack for lengths already checked and on x's device."""
    cu_seqlens, max_seqlen = _cu_seqlens(lengths)
    return Packed(x[_valid(lengths, x.shape[1])], cu_seqlens, max_seqlen)  # boolean indexing keeps row-major order


def unpack(tokens: Tensor, cu_seqlens: Tensor, T: int | None = None, fill: float = 0.0) -> Tensor:
    """Repad: (total, ...) packed tokens + (B + 1,) cu_seqlens -> (B, T, ...), padding = ``fill``.

    T defaults to the longest sequence. Inverse of :func:`pack`: ``unpack(*pack(x, L)[:2], T)``
    equals ``x`` at real tokens and ``fill`` elsewhere.
    """
    check_cu_seqlens(cu_seqlens, total=tokens.shape[0])
    lengths = cu_seqlens_to_lengths(cu_seqlens)
    T = (int(lengths.max()) if lengths.numel() else 0) if T is None else check_int(T, "T")
    check_lengths(lengths, T=T)
    return _unpack(tokens, lengths.to(tokens.device), T, fill)


def _unpack(tokens: Tensor, lengths: Tensor, T: int, fill: float = 0.0) -> Tensor:
    """unpack for (B,) lengths already checked (each <= T), on tokens' device."""
    out = tokens.new_full((lengths.numel(), T, *tokens.shape[1:]), fill)
    out[_valid(lengths, T)] = tokens
    return out


def segment_ids(lengths: Tensor) -> Tensor:
    """(B,) lengths -> (total,) int64: the sequence each packed token belongs to, on lengths' device.

    Example: lengths [2, 4, 3] -> [0, 0, 1, 1, 1, 1, 2, 2, 2]. Trusts its argument (checked lengths >= 0).
    """
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths.long())


def packed_positions(cu_seqlens: Tensor, total: int) -> Tensor:
    """(B + 1,) cu_seqlens, total tokens -> (total,) int64 offset of each packed token inside its own sequence.

    Example: cu_seqlens [0, 2, 6, 9], total 9 -> [0, 1, 0, 1, 2, 3, 0, 1, 2]. ``total`` is cu_seqlens[-1],
    passed so that no value is read back from the device.
    """
    starts = cu_seqlens[:-1].long()
    return torch.arange(total, device=cu_seqlens.device) - starts[segment_ids(cu_seqlens.diff())]


def segment_sum(x: Tensor, seq: Tensor, B: int) -> Tensor:
    """x (N, ...) rows, seq (N,) int64 the segment of each row, in [0, B) -> (B, ...) sums per segment, x's dtype.

    One scatter-add (index_add_: N rows read, B rows written); a segment with no rows sums to 0.
    Example: x [1, 2, 3, 4], seq [0, 0, 2, 2], B 3 -> [3, 0, 7].
    """
    return x.new_zeros((B, *x.shape[1:])).index_add_(0, seq, x)


def segment_mean(x: Tensor, seq: Tensor, counts: Tensor) -> Tensor:
    """x (N, d) rows, seq (N,) int64 segments, counts (B,) rows per segment -> (B, d) means, x's dtype.

    counts are clamped to 1e-9 as sentence-transformers clamps its mask sums: a segment with no rows gives 0,
    not 0 / 0. Example: x [1, 2, 3, 4], seq [0, 0, 2, 2], counts [2, 0, 2] -> [1.5, 0, 3.5].
    """
    return segment_sum(x, seq, counts.numel()) / counts.to(x.dtype).clamp(min=1e-9).view(-1, 1)


def zero_padded_rows(out: Tensor, lengths: Tensor) -> Tensor:
    """(B, H, T, D) attention output with query rows t >= lengths[b] set to 0 (a kernel that computes them anyway)."""
    return out * _valid(lengths, out.shape[2]).view(-1, 1, out.shape[2], 1).to(out.dtype)
