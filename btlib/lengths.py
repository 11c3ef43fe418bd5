"""Sequence-length generators and padding statistics.

Benchmarks need batches with a chosen amount of padding, reproducibly. Two generators:
- :func:`uniform_lengths`: an exact padding fraction p, one sequence at full length T (so the
  padded length really is T, as a tokenizer padding to the longest sequence would make it).
- :func:`zipf_lengths`: natural-language-like lengths, after PyTorch's nested-tensor tutorial:
  words are drawn from a Zipf(alpha) unigram distribution and a sentence ends at a word whose
  rank is that of ".", "!" or "?" in WikiText-2 (3, 386, 858).

Every generator takes a ``seed`` and draws from its own generator: global RNG state is untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .checks import check_window
from .padding import INT32_MAX, check_int, check_lengths

__all__ = ["uniform_lengths", "zipf_lengths", "batch_lengths", "PaddingStats", "padding_stats",
           "attention_pairs", "attention_flops"]

_SENTENCE_END_RANKS = (3, 386, 858)


def uniform_lengths(B: int, T: int, padding: float, *, seed: int = 0, full_row: bool = True) -> Tensor:
    """(B,) int64 lengths in [1, T] whose padding fraction 1 - sum(L) / (B T) is ``padding`` (to 1 token).

    With ``full_row`` one sequence has length T (needs B >= 2 unless padding is 0).

    Example: uniform_lengths(4, 8, 0.5) -> 16 real tokens out of 32, e.g. [8, 3, 2, 3].
    """
    B, T, seed = check_int(B, "B", low=1), check_int(T, "T", low=1, high=INT32_MAX), check_int(seed, "seed")
    if not 0.0 <= padding < 1.0:
        raise ValueError(f"padding must be in [0, 1); got {padding}")
    target = max(B, round((1.0 - padding) * B * T))
    if full_row and B == 1 and target != T:
        raise ValueError("with B=1 and full_row=True the only padding fraction is 0; pass full_row=False")
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.uniform(0.05, 1.0, B) * T), 1, T).astype(np.int64)
    fixed = np.zeros(B, dtype=bool)
    if full_row:
        lengths[0], fixed[0] = T, True
    if target < lengths[fixed].sum() + (~fixed).sum():
        raise ValueError(f"padding={padding} is too high for B={B}, T={T} with one full row; lower it or raise B")
    free = ~fixed
    # Scale the free lengths toward the target, then settle the rounding remainder one token at a time.
    want_free = target - lengths[fixed].sum()
    if free.any():
        scaled = lengths[free] * want_free / lengths[free].sum()
        lengths[free] = np.clip(np.round(scaled), 1, T)
    order = rng.permutation(np.flatnonzero(free))
    while (diff := target - lengths.sum()) != 0 and order.size:
        step = 1 if diff > 0 else -1
        movable = order[(lengths[order] + step >= 1) & (lengths[order] + step <= T)]
        if movable.size == 0:
            break
        n = min(abs(diff), movable.size)
        lengths[movable[:n]] += step
    perm = rng.permutation(B)  # the full row is not always first
    return torch.from_numpy(lengths[perm].copy())


def zipf_lengths(B: int, T: int, *, alpha: float = 1.2, seed: int = 0) -> Tensor:
    """(B,) int64 sentence lengths in [1, T] from a Zipf unigram model (PyTorch's nested-tensor tutorial).

    Lengths longer than T are truncated to T, as a tokenizer with max_length=T would.
    """
    B, T, seed = check_int(B, "B", low=1), check_int(T, "T", low=1, high=INT32_MAX), check_int(seed, "seed")
    if alpha <= 1.0:
        raise ValueError(f"alpha must be > 1 for a Zipf distribution; got {alpha}")
    rng = np.random.default_rng(seed)
    lengths = np.empty(B, dtype=np.int64)
    for b in range(B):
        n = 1
        while n < T and rng.zipf(alpha) not in _SENTENCE_END_RANKS:
            n += 1
        lengths[b] = n
    return torch.from_numpy(lengths)


@dataclass(frozen=True)
class PaddingStats:
    """What padding costs a batch of B sequences padded to T."""

    B: int
    T: int
    real_tokens: int
    padding_fraction: float         # 1 - sum(L) / (B T): linear layers' wasted share
    attention_waste: float          # 1 - sum(L^2) / (B T^2): attention's wasted share
    dense_gflops: float | None      # whole padded batch through the encoder described
    packed_gflops: float | None     # the same on real tokens only

    @property
    def ideal_speedup(self) -> float:
        """Speedup of a padding-free run if cost were all FLOPs (1 / (1 - p) for linear-bound models)."""
        if self.real_tokens == 0:
            return float("inf")  # all padding: a padding-free run does no work
        if self.dense_gflops and self.packed_gflops:
            return self.dense_gflops / self.packed_gflops
        return 1.0 / (1.0 - self.padding_fraction)


def encoder_flops(lengths: Tensor, d_model: int, d_ff: int, num_layers: int = 1, *, glu: bool = False,
                  window: tuple[int, int] | None = None, local_layers: int = 0, causal: bool = False,
                  attn_width: int | None = None, kv_width: int | None = None) -> float:
    """Forward FLOPs of a Transformer encoder on sequences of the given lengths (multiply-add = 2).

    Per token and layer: QKV 6 d^2, output projection 2 d^2, feed-forward 4 d d_ff (a GLU feed-forward, ``glu``:
    three d x d_ff matrices, 6 d d_ff). Where the heads' width A = H Dh is not d (``attn_width``) or keys and values
    have fewer heads (``kv_width`` = Hkv Dh, grouped-query attention): QKV 2 d (A + 2 Akv), output 2 d A. Per layer,
    QK^T and PV: 4 A per (query, key) pair: L^2 pairs in a sequence of length L, L (L + 1) / 2 if ``causal``, and on
    ``local_layers`` of the ``num_layers`` only the pairs inside ``window`` (:func:`attention_pairs`: what a kernel
    that skips the rest computes).
    """
    d_model, d_ff, num_layers = (check_int(v, n) for v, n in ((d_model, "d_model"), (d_ff, "d_ff"),
                                                                (num_layers, "num_layers")))
    local_layers = check_int(local_layers, "local_layers", high=num_layers) if window is not None else 0
    A = d_model if attn_width is None else check_int(attn_width, "attn_width")
    Akv = A if kv_width is None else check_int(kv_width, "kv_width")
    L = lengths.double()
    per_token = 2 * d_model * (A + 2 * Akv) + 2 * d_model * A + (6 if glu else 4) * d_model * d_ff
    pairs = attention_pairs(lengths, causal=causal) * (num_layers - local_layers)  # L^2, or L (L + 1) / 2 causal
    if local_layers:
        pairs += attention_pairs(lengths, window=window, causal=causal) * local_layers
    return float(num_layers * per_token * L.sum() + 4 * A * pairs)


def attention_pairs(lengths: Tensor, *, causal: bool = False, window: tuple[int, int] | None = None) -> int:
    """Exact number of (query, key) pairs that may attend, summed over sequences of the given lengths.

    Within a sequence of length L, query i attends keys max(0, i - left) .. min(L - 1, i + right)
    (right = 0 with causal; None = unbounded), so the count is
    L + L(L-1)/2 + L r - r(r+1)/2 - (L-l)(L-l-1)/2 with l, r clamped to [0, L - 1]: about
    L (left + right + 1) for L >> the window, L^2 without one.

    Example: lengths [4], window (1, 0) -> 1 + 2 + 2 + 2 = 7; no window, causal -> 10; neither -> 16.
    """
    window = check_window(window)
    check_lengths(lengths)
    L = lengths.to(torch.int64).cpu()
    unbounded = L.clamp_min(1) - 1  # the widest reach that matters in a sequence of length L
    left = unbounded if window is None else unbounded.clamp_max(window[0])
    right = torch.zeros_like(L) if causal else (unbounded if window is None else unbounded.clamp_max(window[1]))
    n = L + L * (L - 1) // 2 + L * right - right * (right + 1) // 2 - (L - left) * (L - left - 1) // 2
    return int(torch.where(L > 0, n, torch.zeros_like(n)).sum())


def attention_flops(lengths: Tensor, H: int, D: int, *, causal: bool = False, window: tuple[int, int] | None = None) -> float:
    """FLOPs of attention's two products on the real tokens only: 4 H D x :func:`attention_pairs`.

    QK^T and PV each take one multiply-add (2 flops) per allowed (query, key) pair and head_dim
    element. Without a window and causal this is 4 H D sum(L_i^2); with a window (left, right) it
    is about 4 H D sum_i L_i min(L_i, left + right + 1): what a kernel that skips masked tiles needs.
    """
    H, D = check_int(H, "H"), check_int(D, "D")
    return 4.0 * H * D * attention_pairs(lengths, causal=causal, window=window)


def padding_stats(
    lengths: Tensor, T: int | None = None, *, d_model: int | None = None, d_ff: int | None = None, num_layers: int = 1
) -> PaddingStats:
    """Padding fraction and wasted work of a batch. Give d_model and d_ff to get encoder GFLOPs too.

    Example: lengths [2, 4, 3], T=4 -> real 9 of 12 tokens, padding_fraction 0.25,
    attention_waste 1 - (4 + 16 + 9) / 48 = 0.396.
    """
    check_lengths(lengths)
    if lengths.numel() == 0:
        raise ValueError("lengths is empty: a batch of 0 sequences has no padding statistics")
    T = int(lengths.max()) if T is None else check_int(T, "T", hint="the padded length, >= max(lengths)")
    check_lengths(lengths, T=T)
    if T == 0:
        raise ValueError("every length is 0 and T is 0: a batch with no token slots has no padding fraction; "
                         "pass T, the padded length (then padding_fraction is 1.0)")
    B = lengths.numel()
    real = int(lengths.sum())
    sq = float((lengths.double() ** 2).sum())
    dense = packed = None
    if d_model is not None and d_ff is not None:
        dense = encoder_flops(torch.full((B,), T), d_model, d_ff, num_layers) / 1e9
        packed = encoder_flops(lengths, d_model, d_ff, num_layers) / 1e9
    return PaddingStats(B, T, real, 1.0 - real / (B * T), 1.0 - sq / (B * T * T), dense, packed)


def batch_lengths(p: dict) -> torch.Tensor:
    """The (B,) lengths of one benchmark point: uniform at p["padding"], or Zipf (padding is then what it is)."""
    if p.get("distribution", "uniform") == "zipf":
        return zipf_lengths(p["B"], p["T"], seed=p.get("seed", 0))
    return uniform_lengths(p["B"], p["T"], p["padding"], seed=p.get("seed", 0), full_row=p["B"] > 1)
