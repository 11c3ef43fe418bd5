"""Tile maps (btlib.blocks): small cases by hand, and every map against btlib's reference mask."""

import matplotlib
import pytest
import torch

from btlib.blocks import DEAD, FULL, PARTIAL, draw_tile_map, pair_counts, row_bands, tile_map, tile_stats
from btlib.lengths import attention_pairs
from btlib.reference import allowed_mask

matplotlib.use("Agg")
F, P, D = FULL, PARTIAL, DEAD


def test_padding_only_by_hand():
    # length 5 padded to 8, tiles of 2: blocks 0-1 real, block 2 holds token 4 and padding, block 3 padding
    m = tile_map(5, 8, Br=2, Bc=2)
    assert m.tolist() == [[F, F, P, D], [F, F, P, D], [P, P, P, D], [D, D, D, D]]


def test_causal_by_hand():
    m = tile_map(8, causal=True, Br=4, Bc=4)
    assert m.tolist() == [[P, D], [F, P]]  # diagonal tiles masked inside, the upper one dead


def test_window_by_hand():
    # window (1, 1) on 8 tokens, tiles of 2: a band three keys wide touches the neighbouring tiles' corners
    m = tile_map(8, window=(1, 1), Br=2, Bc=2)
    assert m.tolist() == [[F, P, D, D], [P, F, P, D], [D, P, F, P], [D, D, P, F]]
    # window 0: each query sees itself, every diagonal tile partial, the rest dead
    assert tile_map(8, window=(0, 0), Br=2, Bc=2).tolist() == [[P, D, D, D], [D, P, D, D], [D, D, P, D], [D, D, D, P]]


def test_window_wider_than_sequence_is_global():
    assert torch.equal(tile_map(100, window=(500, 500)), tile_map(100))
    assert torch.equal(tile_map(100, window=(500, 0)), tile_map(100, causal=True))


def test_row_bands_padding_and_empty_rows():
    lo, hi = row_bands(3, 5, causal=True, window=(1, 0))
    assert lo.tolist()[:3] == [0, 0, 1] and hi.tolist()[:3] == [0, 1, 2]
    assert (hi[3:] < lo[3:]).all()  # padded rows attend nothing


def test_stats_counts():
    s = tile_stats([8192], window=(64, 64))
    # every row attends min(i + 64, L - 1) - max(i - 64, 0) + 1 keys
    i = torch.arange(8192)
    assert s.allowed_pairs == int(((i + 64).clamp(max=8191) - (i - 64).clamp(min=0) + 1).sum())
    assert s.alive == 3 * 128 - 2 and s.full == 128 and s.dead == 128 * 128 - s.alive
    assert s.computed_pairs == s.alive * 64 * 64 and s.padded_pairs == 8192**2
    # two sequences padded to 128: alive tiles and computed pairs leave the padding out
    s2 = tile_stats([128, 65], 128)
    assert (s2.tiles, s2.full, s2.partial, s2.dead) == (8, 5, 3, 0)
    assert s2.allowed_pairs == 128**2 + 65**2 and s2.computed_pairs == s2.allowed_pairs
    assert tile_stats([0, 0], 64).alive == 0


@pytest.mark.parametrize("lengths, T", [([1], 1), ([97], 97), ([130, 5, 0, 64], 130), ([200, 129], 256)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (0, 0), (64, 64), (3, 70), (0, 200), (300, 300)])
def test_matches_reference_mask(lengths, T, causal, window):
    L = torch.tensor(lengths)
    mask = allowed_mask(len(lengths), T, T, lengths=L, causal=causal, window=window)
    mask = mask.expand(len(lengths), 1, T, T)[:, 0]
    # real query rows only: the reference masks keys by lengths, and padded query rows are output 0
    mask = mask & (torch.arange(T) < L[:, None])[:, :, None]
    Br = Bc = 64
    n = -(-T // 64)
    padded = torch.zeros(len(lengths), n * Br, n * Bc, dtype=torch.int64)
    padded[:, :T, :T] = mask
    expected = padded.view(len(lengths), n, Br, n, Bc).sum((2, 4))
    assert torch.equal(pair_counts(L, T, causal=causal, window=window), expected)
    assert tile_stats(L, T, causal=causal, window=window).allowed_pairs == attention_pairs(L, causal=causal, window=window)
    kinds = tile_map(L, T, causal=causal, window=window)
    assert torch.equal(kinds == DEAD, expected == 0) and torch.equal(kinds == FULL, expected == Br * Bc)


def test_bad_inputs_say_what_to_do():
    with pytest.raises(ValueError, match="T >= max"):
        tile_map([10], 5)
    with pytest.raises(ValueError, match="must be >= 0"):
        tile_map(10, window=(-1, 3))
    with pytest.raises(ValueError, match=">= 0"):
        tile_map([-2])
    with pytest.raises(ValueError, match="index the batch"):
        draw_tile_map(tile_map([4, 5]))


def test_draw():
    ax = draw_tile_map(tile_map(300, window=(64, 64)), title="window")
    assert ax.get_title() == "window" and len(ax.get_legend().get_texts()) == 3
