"""The oracle itself, checked against PyTorch's SDPA math backend and against first principles."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from btlib import reference_attention, reference_varlen_attention
from btlib.padding import lengths_to_padding_mask, pack


def sdpa_math(q, k, v, **kw):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kw)


@pytest.mark.parametrize("T", [1, 2, 97])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa_math(T, causal):
    q, k, v = torch.randn(3, 2, 2, T, 16, dtype=torch.float64)
    ref = reference_attention(q, k, v, causal=causal)
    assert torch.allclose(ref, sdpa_math(q, k, v, is_causal=causal), atol=1e-12)


def test_single_key_returns_its_value():
    q = torch.randn(1, 1, 1, 8)
    v = torch.randn(1, 1, 1, 8)
    assert torch.equal(reference_attention(q, q, v), v)


def test_key_padding_mask_matches_sdpa_bool_mask():
    q, k, v = torch.randn(3, 3, 2, 5, 8, dtype=torch.float64)
    pad = lengths_to_padding_mask(torch.tensor([5, 2, 3]), 5)
    ref = reference_attention(q, k, v, key_padding_mask=pad)
    want = sdpa_math(q, k, v, attn_mask=~pad.view(3, 1, 1, 5))
    assert torch.allclose(ref, want, atol=1e-12)


def test_lengths_zero_padded_queries_and_fully_padded_rows():
    q, k, v = torch.randn(3, 3, 2, 6, 4)
    lengths = torch.tensor([6, 0, 2])
    out, w = reference_attention(q, k, v, lengths=lengths, return_weights=True)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # a sequence of length 0: all rows fully padded
    assert torch.equal(out[2, :, 2:], torch.zeros_like(out[2, :, 2:]))  # padded query rows
    assert not out.isnan().any()
    assert torch.allclose(w[2, :, :2].sum(-1), torch.ones(2, 2))  # real rows are distributions
    assert torch.equal(w[2, :, :, 2:], torch.zeros_like(w[2, :, :, 2:]))  # over real keys only
    # Real rows of sequence 2 equal attention on the 2-token sequence alone.
    alone = reference_attention(q[2:3, :, :2], k[2:3, :, :2], v[2:3, :, :2])
    assert torch.allclose(out[2:3, :, :2], alone, atol=1e-6)


def test_attn_mask_bool_float_and_fully_masked_row():
    q, k, v = torch.randn(3, 1, 2, 4, 8, dtype=torch.float64)
    allow = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    additive = torch.zeros(4, 4, dtype=torch.float64).masked_fill(~allow, float("-inf"))
    a = reference_attention(q, k, v, attn_mask=allow)
    b = reference_attention(q, k, v, attn_mask=additive)
    assert torch.allclose(a, b)
    assert torch.equal(a[:, :, 2], torch.zeros_like(a[:, :, 2]))  # no key allowed -> 0, as SDPA >= 2.5
    assert torch.allclose(a, sdpa_math(q, k, v, attn_mask=allow), atol=1e-12)


def test_low_precision_computed_in_fp32():
    q, k, v = torch.randn(3, 1, 2, 9, 16).to(torch.bfloat16)
    out = reference_attention(q, k, v)
    assert out.dtype == torch.float32
    assert torch.allclose(out, reference_attention(q.float(), k.float(), v.float()))


def test_scale_argument():
    q, k, v = torch.randn(3, 1, 1, 5, 4, dtype=torch.float64)
    assert torch.allclose(reference_attention(q, k, v, scale=0.3), sdpa_math(q, k, v, scale=0.3))
    assert torch.allclose(reference_attention(q, k, v), reference_attention(q, k, v, scale=1 / math.sqrt(4)))


def test_varlen_reference_equals_per_sequence():
    lengths = torch.tensor([3, 1, 5])
    q, k, v = torch.randn(3, 3, 5, 2, 8)  # (B, T, H, D)
    p = [pack(x, lengths).tokens for x in (q, k, v)]
    cu, max_seqlen = pack(q, lengths)[1:]
    out = reference_varlen_attention(*p, cu, max_seqlen, causal=True)
    for b, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        L = e - s
        alone = reference_attention(*(x[b, :L].transpose(0, 1)[None] for x in (q, k, v)), causal=True)
        assert torch.allclose(out[s:e], alone[0].transpose(0, 1), atol=1e-6)


@pytest.mark.parametrize("bad, match", [
    (dict(lengths=torch.tensor([5, 9])), r"lengths must lie in \[0, 5\]"),
    (dict(lengths=torch.tensor([1.0, 2.0])), "integer"),
    (dict(lengths=torch.tensor([1, 2, 3])), r"shape \(B,\)"),
])
def test_bad_lengths(bad, match):
    q = torch.randn(2, 1, 5, 4)
    with pytest.raises((ValueError, TypeError), match=match):
        reference_attention(q, q, q, **bad)


def test_bad_key_padding_mask_shape():
    q = torch.randn(2, 1, 5, 4)
    with pytest.raises(ValueError, match=r"key_padding_mask must be \(B, S\) = \(2, 5\)"):
        reference_attention(q, q, q, key_padding_mask=torch.zeros(3, 5, dtype=torch.bool))


def test_bad_rank():
    with pytest.raises(ValueError, match="varlen_attention"):
        reference_attention(torch.randn(5, 2, 4), torch.randn(5, 2, 4), torch.randn(5, 2, 4))
