"""btlib.checks: the input checks at every attention entry point accept what the kernels take (odd T,
fully padded rows, batch 1, strided views) and refuse everything else with a message that says what to do."""

import sys

import numpy as np
import pytest
import torch

from btlib.checks import MAX_REACH, check_padded_inputs, check_varlen_inputs, check_window, window_reach


def _qkv(*shape, dtype=torch.float32):
    return tuple(torch.randn(*shape, dtype=dtype) for _ in range(3))


@pytest.mark.parametrize("window, expected", [
    (None, None), ((0, 0), (0, 0)), ((64, 64), (64, 64)), ([3, 0], (3, 0)),
    ((np.int64(5), torch.tensor(7)), (5, 7)), ((sys.maxsize, 1), (MAX_REACH, 1)), ((2**63 * 4, 0), (MAX_REACH, 0)),
])
def test_check_window_normalises(window, expected):
    got = check_window(window)
    assert got == expected and (got is None or all(type(w) is int for w in got))
    assert window_reach(window) == ((-1, -1) if expected is None else expected)  # -1: the kernels' "no limit"


def test_max_reach_keeps_positions_in_int64():
    i = torch.tensor([0, 2**40], dtype=torch.int64)
    assert (i + MAX_REACH).tolist() == [MAX_REACH, MAX_REACH + 2**40] and (i - MAX_REACH).min() > -(2**63)


@pytest.mark.parametrize("window, err, match", [
    (64, TypeError, r"window must be a \(left, right\) tuple or None; got int 64"),
    ((1, 2, 3), ValueError, r"window must have 2 entries \(left, right\); got 3"),
    ((-1, 4), ValueError, r"window left must be >= 0; got -1"),
    ((4, 2.5), TypeError, r"window right must be an int; got float 2.5"),
    ((True, 4), TypeError, r"window left must be an int; got bool"),
])
def test_check_window_refuses(window, err, match):
    with pytest.raises(err, match=match) as e:
        check_window(window)
    assert "pass window=(left, right)" in str(e.value)
    with pytest.raises(err, match=match):
        window_reach(window)


@pytest.mark.parametrize("B, T, lengths", [(1, 1, [1]), (1, 97, [97]), (3, 97, [1, 0, 97]), (2, 5, None)])
def test_padded_inputs_accepted(B, T, lengths):
    q, k, v = _qkv(B, 2, T, 8)
    check_padded_inputs(q, k, v, None if lengths is None else torch.tensor(lengths))
    check_padded_inputs(q, k[:, :, :1], v[:, :, :1], torch.zeros(B, dtype=torch.int32))  # cross: S = 1, all padded
    check_padded_inputs(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, None)  # (B, T, H, D) storage viewed


def test_padded_inputs_refused():
    q, k, v = _qkv(2, 2, 5, 8)
    cases = [
        ((q[0], k, v, None), ValueError, r"padded attention expects q of shape \(B, H, T, D\); got \(2, 5, 8\)"),
        ((q.to(torch.int32), k, v, None), TypeError, "q must be float16, bfloat16, float32 or float64; got torch.int32"),
        ((q, k.double(), v, None), TypeError, "q, k, v must share one dtype"),
        ((q, k, v[..., :4], None), ValueError, r"k and v must have the same shape; got \(2, 2, 5, 8\) and \(2, 2, 5, 4\)"),
        ((q, k[:, :1], v[:, :1], None), ValueError, "k, v must be .B, H, S, D. with q's B, H, D"),
        ((q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v, None), ValueError, r"k must be contiguous in its last"),
        ((q[..., ::2], k[..., ::2], v[..., ::2], None), ValueError,
         r"contiguous in its last .head_dim. dimension; call q.contiguous\(\)"),
        ((q[..., :0], k[..., :0], v[..., :0], None), ValueError, "head_dim is 0"),
        ((q, k, v, torch.tensor([1, 6])), ValueError, "lengths must be <= the padded length T=5"),
        ((q, k, v, torch.tensor([1, -1])), ValueError, "lengths must be >= 0"),
        ((q, k, v, torch.tensor([1])), ValueError, "lengths has 1 entries but the batch has B=2"),
        ((q, k, v, torch.tensor([1.0, 2.0])), TypeError, "lengths must be an integer tensor"),
        ((q, k, v, [1, 2]), TypeError, "lengths must be a torch.Tensor of integers; got list"),
        (("q", k, v, None), TypeError, "q must be a torch.Tensor; got str"),
    ]
    for args, err, match in cases:
        with pytest.raises(err, match=match):
            check_padded_inputs(*args)
    with pytest.raises(ValueError, match=r"lengths must be <= the padded length T=3"):  # cross: min(T, S) bounds lengths
        check_padded_inputs(q, k[:, :, :3], v[:, :, :3], torch.tensor([4, 1]))


@pytest.mark.parametrize("lengths", [[1], [97], [0, 3, 97], [0]], ids=str)
def test_varlen_inputs_accepted(lengths):
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    q, k, v = _qkv(int(cu[-1]), 2, 8, dtype=torch.bfloat16)
    check_varlen_inputs(q, k, v, cu, max(lengths))
    check_varlen_inputs(q, k, v, cu, max(lengths) + 1)  # a looser bound is still a bound


def test_varlen_inputs_refused():
    q, k, v = _qkv(9, 2, 8)
    cu = torch.tensor([0, 2, 9], dtype=torch.int32)
    nested = torch.nested.nested_tensor_from_jagged(q, offsets=cu.long())
    cases = [
        ((nested, k, v, cu, 7), TypeError, r"q is a nested tensor; pass its packed form instead: .*btlib.nested_to_packed"),
        ((q.view(9, 16), k, v, cu, 7), ValueError, r"varlen attention expects q of shape \(total, H, D\)"),
        ((q, k[:8], v[:8], cu, 7), ValueError, r"varlen self-attention needs q, k, v of one shape"),
        ((q, k, v, cu.long(), 7), TypeError, "cu_seqlens must be int32"),
        ((q, k, v, torch.tensor([0, 2, 8], dtype=torch.int32), 7), ValueError, r"cu_seqlens\[-1\] = 8 must equal .* \(9\)"),
        ((q, k, v, torch.tensor([1, 2, 9], dtype=torch.int32), 8), ValueError, "cu_seqlens must start at 0"),
        ((q, k, v, cu, 6), ValueError, r"max_seqlen=6 is less than the longest sequence \(7\); pass max\(lengths\)"),
        ((q, k, v, cu, 7.0), TypeError, "max_seqlen must be an int"),
        ((q, k, v, cu.view(1, 3), 7), ValueError, "cu_seqlens must be a 1-D tensor of B \\+ 1 offsets"),
    ]
    for args, err, match in cases:
        with pytest.raises(err, match=match):
            check_varlen_inputs(*args)
