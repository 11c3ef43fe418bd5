"""Packed format: lengths <-> masks <-> cu_seqlens, pack/unpack, nested adapters, generators, stats."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import btlib
from btlib.lengths import encoder_flops


def test_docstring_example():
    cu, max_seqlen = btlib.lengths_to_cu_seqlens(torch.tensor([2, 4, 3]))
    assert cu.tolist() == [0, 2, 6, 9] and cu.dtype == torch.int32 and max_seqlen == 4
    assert btlib.cu_seqlens_to_lengths(cu).tolist() == [2, 4, 3]
    mask = btlib.lengths_to_padding_mask(torch.tensor([2, 4, 3]), 4)
    assert mask.tolist() == [[False, False, True, True], [False] * 4, [False, False, False, True]]
    assert btlib.padding_mask_to_lengths(mask).tolist() == [2, 4, 3]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=6), st.integers(0, 3))
def test_pack_unpack_roundtrip(lengths, extra):
    lengths = torch.tensor(lengths)
    T = int(lengths.max()) + extra
    x = torch.randn(len(lengths), T, 3, 2)
    tokens, cu, max_seqlen = btlib.pack(x, lengths)
    assert tokens.shape == (int(lengths.sum()), 3, 2)
    assert max_seqlen == int(lengths.max())
    back = btlib.unpack(tokens, cu, T)
    valid = ~btlib.lengths_to_padding_mask(lengths, T)
    assert torch.equal(back[valid], x[valid])
    assert not back[~valid].any()
    for b in range(len(lengths)):  # sequence b is tokens[cu[b]:cu[b+1]]
        assert torch.equal(tokens[cu[b]:cu[b + 1]], x[b, : lengths[b]])


def test_nested_roundtrip_shares_values():
    lengths = torch.tensor([2, 4, 3])
    x = torch.randn(3, 5, 8)
    nt = btlib.padded_to_nested(x, lengths)
    assert nt.layout == torch.jagged and nt.size(0) == 3
    tokens, cu, max_seqlen = btlib.nested_to_packed(nt)
    assert cu.tolist() == [0, 2, 6, 9] and cu.dtype == torch.int32 and max_seqlen == 4
    assert tokens.data_ptr() == nt.values().data_ptr()
    padded = btlib.nested_to_padded(nt, T=5)
    assert torch.equal(padded, btlib.unpack(tokens, cu, 5))
    assert btlib.nested_to_padded(nt).shape == (3, 4, 8)


def test_nested_rejects_strided_and_dense():
    with pytest.raises(TypeError, match="layout=torch.jagged"):
        btlib.nested_to_packed(torch.randn(2, 3))


@pytest.mark.parametrize("call, match", [
    (lambda: btlib.pack(torch.randn(2, 4, 3), torch.tensor([1, 5])), "padded length T=4"),
    (lambda: btlib.pack(torch.randn(2, 4, 3), torch.tensor([1, -1])), ">= 0"),
    (lambda: btlib.pack(torch.randn(2, 4, 3), torch.tensor([1, 2, 3])), "B=2"),
    (lambda: btlib.pack(torch.randn(2, 4, 3), torch.tensor([1.0, 2.0])), "integer"),
    (lambda: btlib.unpack(torch.randn(9, 3), torch.tensor([0, 2, 6, 9])), "int32"),
    (lambda: btlib.unpack(torch.randn(9, 3), torch.tensor([0, 6, 2, 9], dtype=torch.int32)), "non-decreasing"),
    (lambda: btlib.unpack(torch.randn(8, 3), torch.tensor([0, 2, 6, 9], dtype=torch.int32)), "number of packed tokens"),
    (lambda: btlib.padding_mask_to_lengths(torch.tensor([[False, True, False]])), "left aligned"),
])
def test_bad_inputs_say_what_to_do(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@pytest.mark.parametrize("B, T, p", [(8, 128, 0.0), (8, 128, 0.25), (8, 128, 0.5), (32, 256, 0.75), (3, 97, 0.5)])
def test_uniform_lengths_exact_padding(B, T, p):
    lengths = btlib.uniform_lengths(B, T, p, seed=1)
    assert lengths.shape == (B,) and int(lengths.min()) >= 1 and int(lengths.max()) == T
    assert abs(int(lengths.sum()) - round((1 - p) * B * T)) == 0
    assert torch.equal(lengths, btlib.uniform_lengths(B, T, p, seed=1))  # seeded: reproducible
    state = torch.random.get_rng_state()
    btlib.uniform_lengths(B, T, p, seed=2)
    assert torch.equal(state, torch.random.get_rng_state())  # global RNG untouched


def test_uniform_lengths_rejects_impossible():
    with pytest.raises(ValueError, match="too high"):
        btlib.uniform_lengths(2, 10, 0.9)
    with pytest.raises(ValueError, match="full_row=False"):
        btlib.uniform_lengths(1, 10, 0.5)
    assert btlib.uniform_lengths(1, 10, 0.5, full_row=False).tolist() == [5]


def test_zipf_lengths():
    lengths = btlib.zipf_lengths(200, 64, seed=0)
    assert int(lengths.min()) >= 1 and int(lengths.max()) <= 64
    assert torch.equal(lengths, btlib.zipf_lengths(200, 64, seed=0))
    assert lengths.float().std() > 1  # a spread of lengths, not a constant


def test_padding_stats():
    s = btlib.padding_stats(torch.tensor([2, 4, 3]), 4)
    assert (s.B, s.T, s.real_tokens) == (3, 4, 9)
    assert s.padding_fraction == pytest.approx(0.25)
    assert s.attention_waste == pytest.approx(1 - 29 / 48)
    assert s.ideal_speedup == pytest.approx(4 / 3)
    s = btlib.padding_stats(torch.tensor([2, 4, 3]), 4, d_model=8, d_ff=32, num_layers=2)
    # per token and layer 8 d^2 + 4 d ff = 512 + 1024; per sequence 4 L^2 d
    assert s.packed_gflops * 1e9 == pytest.approx(2 * (1536 * 9 + 32 * 29))
    assert s.dense_gflops * 1e9 == pytest.approx(encoder_flops(torch.tensor([4, 4, 4]), 8, 32, 2))
