"""Every registered kernel that can run here, against the one reference; the public API's errors.

A kernel module that registers itself is tested here without writing a test: odd lengths,
batch 1, a single head, fully padded rows, causal on and off.
"""

import pytest
import torch

import btlib
from btlib.kernels import kernels, relative_error

CASES = [  # (B, H, T, D, lengths)
    (1, 1, 1, 32, None),
    (2, 3, 97, 64, [97, 40]),
    (3, 2, 33, 80, [0, 33, 5]),  # a sequence of length 0: every row fully padded
]


def _runnable(layout):
    return [k for k in kernels(layout) if k.supports(torch.empty(1, 1, 1, 8), False) is None]


@pytest.mark.parametrize("kernel", _runnable("padded"), ids=lambda k: k.name)
@pytest.mark.parametrize("B,H,T,D,lengths", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_padded_kernel(kernel, B, H, T, D, lengths, causal):
    if causal and not kernel.causal:
        pytest.skip(f"{kernel.name} has no causal mask")
    q, k, v = torch.randn(3, B, H, T, D)
    L = None if lengths is None else torch.tensor(lengths)
    out = btlib.attention(q, k, v, lengths=L, causal=causal, backend=kernel.name)
    ref = btlib.reference_attention(q, k, v, lengths=L, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert relative_error(out, ref) <= kernel.tol
    if L is not None:
        assert not out[0 if lengths[0] == 0 else -1].isnan().any()


@pytest.mark.parametrize("kernel", _runnable("varlen"), ids=lambda k: k.name)
@pytest.mark.parametrize("lengths", [[1], [97, 3, 0, 40], [5, 5]])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_kernel(kernel, lengths, causal):
    if causal and not kernel.causal:
        pytest.skip(f"{kernel.name} has no causal mask")
    L = torch.tensor(lengths)
    cu, max_seqlen = btlib.lengths_to_cu_seqlens(L)
    q, k, v = torch.randn(3, int(L.sum()), 2, 64)
    out = btlib.varlen_attention(q, k, v, cu, max_seqlen, causal=causal, backend=kernel.name)
    ref = btlib.reference_varlen_attention(q, k, v, cu, max_seqlen, causal=causal)
    assert out.shape == q.shape
    assert relative_error(out, ref) <= kernel.tol


def test_auto_picks_a_kernel_and_registry_lists():
    names = [k.name for k in kernels()]
    assert {"reference", "torch_sdpa", "reference_varlen", "torch_sdpa_loop"} <= set(names)
    q = torch.randn(1, 2, 5, 16)
    assert btlib.attention(q, q, q).shape == q.shape
    with pytest.raises(KeyError, match="registered:"):
        btlib.attention(q, q, q, backend="no_such_kernel")
    with pytest.raises(ValueError, match="varlen kernel"):
        btlib.attention(q, q, q, backend="torch_sdpa_loop")


def test_explicit_backend_that_cannot_run_says_why():
    cu = torch.tensor([0, 3], dtype=torch.int32)
    x = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="no causal mask"):
        btlib.varlen_attention(x, x, x, cu, 3, causal=True, backend="torch_sdpa_nested")


q4 = torch.randn(2, 2, 5, 8)


@pytest.mark.parametrize("call, err, match", [
    (lambda: btlib.attention(q4.int(), q4.int(), q4.int()), TypeError, "float16, bfloat16, float32 or float64"),
    (lambda: btlib.attention(q4, q4.double(), q4), TypeError, "share one dtype"),
    (lambda: btlib.attention(q4[0], q4[0], q4[0]), ValueError, r"\(B, H, T, D\)"),
    (lambda: btlib.attention(q4.transpose(2, 3), q4.transpose(2, 3), q4.transpose(2, 3)), ValueError, "contiguous"),
    (lambda: btlib.attention(q4, q4, q4, lengths=torch.tensor([5, 6])), ValueError, "padded length T=5"),
    (lambda: btlib.attention(q4, q4, q4, lengths=torch.tensor([5])), ValueError, "B=2"),
    (lambda: btlib.attention(q4, q4, q4, lengths=torch.tensor([5.0, 1.0])), TypeError, "integer"),
    (lambda: btlib.varlen_attention(q4[0], q4[0], q4[0], torch.tensor([0, 2, 3], dtype=torch.int32), 2), ValueError, "number of packed tokens"),
    (lambda: btlib.varlen_attention(q4[0], q4[0], q4[0], torch.tensor([0, 1, 2]), 2), TypeError, "int32"),
    (lambda: btlib.varlen_attention(q4[0], q4[0], q4[0], torch.tensor([0, 1, 0, 2], dtype=torch.int32), 2), ValueError, "non-decreasing"),
    (lambda: btlib.varlen_attention(q4[0], q4[0], q4[0], torch.tensor([0, 2], dtype=torch.int32), 1), ValueError, "max_seqlen=1"),
    (lambda: btlib.varlen_attention(*[btlib.padded_to_nested(q4[0], torch.tensor([1, 2]))] * 3, None, 2), TypeError, "nested_to_packed"),
])
def test_bad_inputs(call, err, match):
    with pytest.raises(err, match=match):
        call()
