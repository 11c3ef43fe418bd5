"""Integer arguments (issue 22): windows, lengths, max_seqlen, T, batch sizes, layer indices.

Each is range-checked before any arithmetic, with an error naming it; numpy integers (and 0-d integer
tensors) are accepted wherever Python ints are; floats and bools are refused, never truncated.
"""

import sys

import numpy as np
import pytest
import torch
from torch import nn

import btlib
from btlib import blocks, lengths, quant, smoothquant
from btlib.checks import MAX_REACH, check_window
from btlib.kernels import kernels, relative_error

HUGE = [sys.maxsize, 2**63, 2**100]


@pytest.mark.parametrize("huge", HUGE)
def test_huge_windows_are_the_unbounded_band(huge):
    """pair_counts / tile_map overflowed int64 for (0, sys.maxsize); a reach >= 2^63 was an op-schema error."""
    L = [130, 7, 0]
    assert check_window((huge, 3)) == (MAX_REACH, 3)
    for w, same in (((0, huge), (0, 200)), ((huge, 0), (200, 0)), ((huge, huge), None)):
        assert torch.equal(blocks.pair_counts(L, window=w), blocks.pair_counts(L, window=same))
        assert torch.equal(blocks.tile_map(L, window=w), blocks.tile_map(L, window=same))
        assert blocks.tile_stats(L, window=w) == blocks.tile_stats(L, window=same)
        assert lengths.attention_pairs(torch.tensor(L), window=w) == lengths.attention_pairs(torch.tensor(L), window=same)


@pytest.mark.parametrize("layout", ["padded", "varlen"])
def test_huge_windows_through_every_window_kernel(layout):
    q, k, v = torch.randn(3, 9, 2, 8)  # (total, H, D)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    for kernel in kernels(layout):
        if not kernel.window or kernel.supports(q) is not None:
            continue
        for w in ((0, 2**63), (2**63, 2**100), (sys.maxsize, 0)):
            same = tuple(min(r, 20) for r in w)
            if layout == "padded":
                args, kw = [x.unsqueeze(0).transpose(1, 2) for x in (q, k, v)], {}
                got = btlib.attention(*args, window=w, backend=kernel.name)
                want = btlib.reference_attention(*args, window=same)
            else:
                got = btlib.varlen_attention(q, k, v, cu, 5, window=w, backend=kernel.name)
                want = btlib.reference_varlen_attention(q, k, v, cu, 5, window=same)
            assert relative_error(got, want) < 1e-5, (kernel.name, w)


def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 2, 64, 0.0, "gelu", batch_first=True)
    return btlib.PackedEncoder.from_module(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval())


def test_numpy_integers_are_accepted_wherever_ints_are():
    i64, i32 = np.int64, np.int32
    assert blocks.tile_map(i64(130)).shape == (3, 3)  # one length gives one map, as an int does (was (1, 3, 3))
    assert torch.equal(blocks.tile_map(torch.tensor(130)), blocks.tile_map(130))
    assert torch.equal(blocks.pair_counts(np.array([5, 70]), T=i64(80), Br=i32(16), Bc=i64(32)),
                       blocks.pair_counts([5, 70], T=80, Br=16, Bc=32))
    assert blocks.tile_stats([i64(5), i32(70)], T=i64(80)) == blocks.tile_stats([5, 70], T=80)
    assert [t.tolist() for t in blocks.row_bands(i64(3), i32(5), window=(i64(1), 0))] == \
        [t.tolist() for t in blocks.row_bands(3, 5, window=(1, 0))]
    assert torch.equal(lengths.uniform_lengths(i64(4), i32(8), 0.5, seed=i64(3)), lengths.uniform_lengths(4, 8, 0.5, seed=3))
    assert torch.equal(lengths.zipf_lengths(i64(3), i64(20), seed=i32(1)), lengths.zipf_lengths(3, 20, seed=1))
    L = torch.tensor([2, 4, 3])
    assert lengths.attention_flops(L, i64(2), i64(8)) == lengths.attention_flops(L, 2, 8)
    assert lengths.padding_stats(L, i64(6), d_model=i64(8), d_ff=i64(16), num_layers=i64(2)) == \
        lengths.padding_stats(L, 6, d_model=8, d_ff=16, num_layers=2)
    assert torch.equal(btlib.lengths_to_padding_mask(L, i64(5)), btlib.lengths_to_padding_mask(L, 5))
    x = torch.randn(9, 2, 4)
    cu, _ = btlib.lengths_to_cu_seqlens(L)
    assert torch.equal(btlib.unpack(x, cu, i64(6)), btlib.unpack(x, cu, 6))
    assert torch.equal(btlib.nested_to_padded(btlib.packed_to_nested(x, cu), i64(6)), btlib.unpack(x, cu, 6))
    for m in (i64(4), i32(4), torch.tensor(4)):
        assert torch.equal(btlib.varlen_attention(x, x, x, cu, m, window=(i64(1), i32(1))),
                           btlib.varlen_attention(x, x, x, cu, 4, window=(1, 1)))
        assert torch.equal(btlib.reference_varlen_attention(x, x, x, cu, m), btlib.reference_varlen_attention(x, x, x, cu, 4))
    packed = _encoder()
    with torch.inference_mode():
        xs = torch.randn(9, 32)
        a = quant.quantize(packed, keep_fp32={i64(1): ("qkv",)}).forward_packed(xs, cu, 4)
        b = quant.quantize(packed, keep_fp32={1: ("qkv",)}).forward_packed(xs, cu, 4)
    assert torch.equal(a, b)


@pytest.mark.parametrize("call, err, match", [
    (lambda: blocks.pair_counts([2.5]), TypeError, r"lengths\[0\] must be an int; got float"),  # was truncated to 2
    (lambda: blocks.pair_counts(torch.tensor([2.5])), TypeError, "lengths must be an integer tensor"),
    (lambda: blocks.tile_map([True, 3]), TypeError, r"lengths\[0\] must be an int; got bool"),
    (lambda: blocks.tile_map(2**40), ValueError, r"lengths must be <= 2147483647"),  # was an int64 overflow
    (lambda: blocks.pair_counts([5], T=5.9), TypeError, "T must be an int"),  # was int(5.9) = 5
    (lambda: blocks.pair_counts([5], T=3), ValueError, "shorter than the longest sequence"),
    (lambda: blocks.pair_counts([5], Br=0), ValueError, "Br must be >= 1"),  # was ZeroDivisionError
    (lambda: blocks.row_bands(3.0, 5), TypeError, "L must be an int"),
    (lambda: btlib.varlen_attention(*_qkv(), torch.tensor([0, 3], dtype=torch.int32), 3.5), TypeError,
     "max_seqlen must be an int"),  # was int(3.5) = 3
    (lambda: btlib.varlen_attention(*_qkv(), torch.tensor([0, 3], dtype=torch.int32), True), TypeError,
     "max_seqlen must be an int; got bool"),
    (lambda: btlib.varlen_attention(*_qkv(), torch.tensor([0, 3], dtype=torch.int32), 2**63), ValueError,
     "max_seqlen must be <= 2147483647"),  # was an op-schema error
    (lambda: _cpu_varlen(*_qkv(), torch.tensor([0, 3], dtype=torch.int32), 2**63), ValueError,
     "max_seqlen must be <= 2147483647"),  # the kernel called directly: was an op-schema error
    (lambda: btlib.varlen_attention(*_qkv(0), torch.tensor([0], dtype=torch.int32), -1), ValueError,
     "max_seqlen must be >= 0"),  # was accepted
    (lambda: btlib.reference_varlen_attention(*_qkv(), torch.tensor([0, 3], dtype=torch.int32), 3.0), TypeError,
     "max_seqlen must be an int"),
    (lambda: btlib.unpack(torch.randn(3, 2), torch.tensor([0, 3], dtype=torch.int32), 4.0), TypeError, "T must be an int"),
    (lambda: btlib.lengths_to_padding_mask(torch.tensor([2]), True), TypeError, "T must be an int; got bool"),
    (lambda: btlib.nested_to_padded(btlib.packed_to_nested(torch.randn(3, 2), torch.tensor([0, 3], dtype=torch.int32)),
                                    4.5), TypeError, "T must be an int"),
    (lambda: lengths.uniform_lengths(2.0, 8, 0.5), TypeError, "B must be an int"),
    (lambda: lengths.uniform_lengths(2, 0, 0.5), ValueError, "T must be >= 1"),
    (lambda: lengths.zipf_lengths(3, 2**40), ValueError, "T must be <= 2147483647"),
    (lambda: lengths.attention_flops(torch.tensor([3]), 1.5, 8), TypeError, "H must be an int"),
    (lambda: lengths.padding_stats(torch.tensor([3]), 4.0), TypeError, "T must be an int"),
    (lambda: check_window((np.float64(1.0), 2)), TypeError, "window left must be an int"),
    (lambda: check_window((1, np.bool_(True))), TypeError, "window right must be an int"),
    (lambda: quant.quantize(_encoder(), keep_fp32={5: ("qkv",)}), ValueError,
     "keep_fp32 layer index must be <= 1; got 5; the encoder has 2 layers"),  # was ignored silently
    (lambda: quant.quantize(_encoder(), keep_fp32={True: ("qkv",)}), TypeError, "keep_fp32 layer index must be an int"),
    (lambda: smoothquant.quantize_auto(_encoder(), [], keep=-1), ValueError, "keep must be >= 0"),
])
def test_bad_integer_arguments_say_what_to_pass(call, err, match):
    with pytest.raises(err, match=match):
        call()


def _cpu_varlen(*args):
    from btlib.kernels.cpu import build, flash

    if build.available() is not None:
        pytest.skip(f"the C++ kernels cannot build here: {build.available()}")
    return flash.varlen_attention_v3(*args)


def _qkv(total=3):
    return torch.randn(3, total, 1, 4)
