"""The registry's API and the public entry points' errors (every kernel's correctness: test_kernel_check.py)."""

import pytest
import torch

import btlib
from btlib.kernels import kernels

# btlib.attention and btlib.varlen_attention, called through btlib (rule: test_every_module_tested.py).
TESTED_HERE = ["btlib.attention"]


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


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (3, 2)}])
def test_the_sdpa_loop_runs_sdpas_flash_kernel_per_sequence(options):
    """torch_sdpa_loop is the baseline varlen kernels are measured against: SDPA once per sequence, as a user would call
    it. Given (H, L, D) views it ran SDPA's math path (scores materialised, 2.6x slower); a (1, H, L, D) batch of one
    takes the flash kernel. Same answers as the reference either way."""
    from btlib.kernels import get

    lengths = [1, 97, 40]
    cu = torch.tensor([0, 1, 98, 138], dtype=torch.int32)
    q, k, v = (torch.randn(sum(lengths), 4, 32) for _ in range(3))
    loop = get("torch_sdpa_loop")
    with torch.profiler.profile() as prof:
        out = loop.fn(q, k, v, cu, max(lengths), scale=None, **{"causal": False, **options})
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops and "aten::_scaled_dot_product_attention_math" not in ops
    ref = get("reference_varlen").fn(q, k, v, cu, max(lengths), scale=None, **{"causal": False, **options})
    assert btlib.kernels.relative_error(out, ref) < loop.tolerance(torch.float32)
