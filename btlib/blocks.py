"""Tile maps: which (query block, key block) tiles a mask leaves alive, and what they cost.

A fused kernel walks the score matrix in tiles of Br x Bc (64 x 64 in btlib's C++ kernels,
btlib/kernels/cpu/core.h). For a mask made of padding (``lengths``), ``causal`` and a local
``window=(left, right)`` (query i attends keys i - left <= j <= i + right, btlib.reference's
convention), every tile is one of three kinds:

- FULL: every (query, key) pair in it may attend: compute it, no masking;
- PARTIAL: some pairs may attend: compute it and mask inside;
- DEAD: no pair may attend: a kernel that knows the mask never touches it.

Padding, causal and window masks are all *bands* per query row (keys lo_i .. hi_i), so the
allowed pairs of a tile are counted per row in O(T * T / Bc), never with a T x T mask.

    m = tile_map(torch.tensor([300, 130]), T=320, window=(64, 64))   # (2, 5, 5) int8
    s = tile_stats(torch.tensor([8192]), window=(64, 64))            # alive tiles, pairs
    draw_tile_map(m[0])                                              # three colours
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .checks import MAX_REACH, check_window
from .padding import INT32_MAX, check_int, check_lengths

__all__ = ["DEAD", "PARTIAL", "FULL", "Br", "Bc", "row_bands", "pair_counts", "tile_map", "TileStats", "tile_stats",
           "draw_tile_map"]

DEAD, PARTIAL, FULL = 0, 1, 2
Br = Bc = 64  # the C++ kernels' tile (core.h)
COLORS = ("#f2f2f2", "#f5a623", "#1f5fa8")  # dead, partial, full
NAMES = ("dead (skipped)", "partial (masked inside)", "full")


def _scalar(lengths) -> bool:
    """One length (an int, numpy integer or 0-d tensor), not a batch of them."""
    return not isinstance(lengths, (list, tuple)) and getattr(lengths, "ndim", 0) == 0


def _as_lengths(lengths: Tensor | int | list[int]) -> Tensor:
    """(B,) int64 from one int, a list of ints or an integer tensor / array, each in [0, 2^31 - 1], checked
    before any arithmetic (a float or bool is refused, not truncated)."""
    if _scalar(lengths):
        return torch.tensor([check_int(lengths, "lengths", high=INT32_MAX)])
    if isinstance(lengths, (list, tuple)):
        L = torch.tensor([check_int(n, f"lengths[{i}]", high=INT32_MAX) for i, n in enumerate(lengths)], dtype=torch.int64)
    else:
        L = torch.as_tensor(lengths).reshape(-1)
        check_lengths(L)
    if L.numel() == 0:
        raise ValueError(f"lengths must be one or more ints >= 0; got {lengths!r}")
    return L.to(torch.int64)


def _check_T(T, L: Tensor) -> int:
    """The padded length: max(lengths) by default; else an int in [max(lengths), 2^31 - 1]."""
    longest = int(L.max())
    if T is None:
        return longest
    T = check_int(T, "T", high=INT32_MAX, hint="the padded length, >= max(lengths)")
    if T < longest:
        raise ValueError(f"T={T} is shorter than the longest sequence ({longest}); pass T >= max(lengths)")
    return T


def row_bands(L: int, T: int, *, causal: bool = False, window: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """(lo, hi) int64 (T,): query row i of a length-L sequence padded to T attends keys lo_i .. hi_i inclusive.

    Rows i >= L (padding) and rows with no key get hi_i < lo_i.
    """
    L, T, window = check_int(L, "L", high=INT32_MAX), check_int(T, "T", high=MAX_REACH), check_window(window)
    i = torch.arange(T, dtype=torch.int64)
    lo = torch.zeros(T, dtype=torch.int64)
    hi = torch.full((T,), L - 1, dtype=torch.int64)
    if causal:
        hi = torch.minimum(hi, i)
    if window is not None:
        lo = torch.clamp(i - window[0], min=0)
        hi = torch.minimum(hi, i + window[1])
    hi = torch.where(i < L, hi, lo - 1)
    return lo, hi


def pair_counts(lengths: Tensor | int | list[int], T: int | None = None, *, causal: bool = False,
                window: tuple[int, int] | None = None, Br: int = Br, Bc: int = Bc) -> Tensor:
    """Allowed (query, key) pairs per tile: int64 (B, ceil(T / Br), ceil(T / Bc)).

    lengths: (B,) ints (or one int); T: the padded length (default: the longest).
    """
    L, window = _as_lengths(lengths), check_window(window)  # a reach past 2^62 is 2^62: i + reach stays in int64
    T = _check_T(T, L)
    Br, Bc = check_int(Br, "Br", low=1, high=INT32_MAX), check_int(Bc, "Bc", low=1, high=INT32_MAX)
    nq, nk = -(-T // Br), -(-T // Bc)
    k0 = torch.arange(nk, dtype=torch.int64) * Bc  # first key of each key block
    out = torch.zeros(len(L), nq, nk, dtype=torch.int64)
    for b, Lb in enumerate(L.tolist()):
        lo, hi = row_bands(Lb, nq * Br, causal=causal, window=window)
        per_row = (torch.minimum(hi[:, None], k0 + Bc - 1) - torch.maximum(lo[:, None], k0) + 1).clamp(min=0)  # (rows, nk)
        out[b] = per_row.view(nq, Br, nk).sum(1)
    return out


def tile_map(lengths: Tensor | int | list[int], T: int | None = None, *, causal: bool = False,
             window: tuple[int, int] | None = None, Br: int = Br, Bc: int = Bc) -> Tensor:
    """Kind of every tile (DEAD 0, PARTIAL 1, FULL 2), int8 (B, ceil(T / Br), ceil(T / Bc)); (nq, nk) for an int length.

    A tile is FULL only if all Br x Bc pairs may attend: the edge tiles of a sequence whose
    length is not a multiple of the tile hold padding and are PARTIAL.
    """
    counts = pair_counts(lengths, T, causal=causal, window=window, Br=Br, Bc=Bc)
    kinds = torch.full_like(counts, PARTIAL, dtype=torch.int8)
    kinds[counts == 0] = DEAD
    kinds[counts == Br * Bc] = FULL
    return kinds[0] if _scalar(lengths) else kinds


@dataclass(frozen=True)
class TileStats:
    """Tile counts and pair counts of one batch under one mask (tiles of Br x Bc)."""

    tiles: int           # tiles of the padded batch: B ceil(T/Br) ceil(T/Bc), what a dense kernel visits
    full: int
    partial: int
    dead: int
    allowed_pairs: int   # (query, key) pairs that may attend: the useful work, 4 D flops each per head
    computed_pairs: int  # pairs inside alive tiles, real rows x real keys: what a tile-skipping varlen kernel computes
    padded_pairs: int    # B T^2: what a padded dense kernel computes

    @property
    def alive(self) -> int:
        return self.full + self.partial

    @property
    def tile_efficiency(self) -> float:
        """allowed / computed pairs: the share of a tile-skipping kernel's products that are not masked away."""
        return self.allowed_pairs / self.computed_pairs if self.computed_pairs else 1.0


def tile_stats(lengths: Tensor | int | list[int], T: int | None = None, *, causal: bool = False,
               window: tuple[int, int] | None = None, Br: int = Br, Bc: int = Bc) -> TileStats:
    """Counts of :func:`tile_map`'s tiles and of the pairs each kind of kernel computes (see :class:`TileStats`)."""
    L = _as_lengths(lengths)
    T = _check_T(T, L)
    counts = pair_counts(L, T, causal=causal, window=window, Br=Br, Bc=Bc)
    nq, nk = counts.shape[1:]
    rows = (L[:, None] - torch.arange(nq) * Br).clamp(0, Br)  # real query rows per block (B, nq)
    keys = (L[:, None] - torch.arange(nk) * Bc).clamp(0, Bc)  # real keys per block (B, nk)
    real = rows[:, :, None] * keys[:, None, :]
    full = int((counts == Br * Bc).sum())
    dead = int((counts == 0).sum())
    return TileStats(tiles=counts.numel(), full=full, partial=counts.numel() - full - dead, dead=dead,
                     allowed_pairs=int(counts.sum()), computed_pairs=int(real[counts > 0].sum()),
                     padded_pairs=len(L) * T * T)


def draw_tile_map(kinds: Tensor, ax=None, title: str | None = None, legend: bool = True):
    """Draw a (nq, nk) tile map (rows: query blocks, columns: key blocks) in three colours; returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    if kinds.dim() != 2:
        raise ValueError(f"draw one map of shape (query blocks, key blocks); got shape {tuple(kinds.shape)} (index the batch)")
    if ax is None:
        _, ax = plt.subplots(figsize=(3.2, 3.2))
    ax.imshow(kinds.numpy(), cmap=ListedColormap(COLORS), vmin=0, vmax=2, interpolation="nearest")
    nq, nk = kinds.shape
    ax.set_xticks([x - 0.5 for x in range(nk + 1)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(nq + 1)], minor=True)
    if max(nq, nk) <= 32:
        ax.grid(which="minor", color="white", lw=0.5)
    ax.tick_params(which="both", length=0, labelsize=7)
    ax.set_xlabel("key block", fontsize=8)
    ax.set_ylabel("query block", fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    if legend:
        ax.legend(handles=[Patch(color=c, label=n) for c, n in zip(COLORS, NAMES)], fontsize=7, loc="upper right",
                  bbox_to_anchor=(1.0, -0.15), ncol=1, frameon=False)
    return ax
