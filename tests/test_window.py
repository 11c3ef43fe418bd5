"""Local (sliding-window) attention: the reference against a brute-force loop, the entry points'
checks, the registry's choice, and the exact window-aware FLOP count.

Every registered kernel with ``window=True`` is also checked on windows by test_kernel_check.py
(btlib.kernels.check runs WINDOWS for it); the C++ core's tile skipping is checked in core_check.cpp.
"""

import math

import pytest
import torch

import btlib
from btlib.kernels import kernels, registry, relative_error
from btlib.lengths import attention_flops, attention_pairs
from btlib.reference import allowed_mask

WINDOWS = [(0, 0), (1, 2), (3, 0), (64, 64), (200, 200)]


def _brute(q, k, v, L, causal, window):
    """(B, H, T, D) attention by explicit loops over (b, h, i): the definition, nothing shared with the reference."""
    B, H, T, D = q.shape
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(int(L[b])):
                keys = [j for j in range(int(L[b])) if (not causal or j <= i)
                        and (window is None or i - window[0] <= j <= i + window[1])]
                s = torch.tensor([float(q[b, h, i].double() @ k[b, h, j].double()) / math.sqrt(D) for j in keys], dtype=torch.float64)
                p = torch.softmax(s, 0)
                out[b, h, i] = sum(p[n] * v[b, h, j].double() for n, j in enumerate(keys))
    return out


@pytest.mark.parametrize("window", [None] + WINDOWS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_reference_matches_brute_force(window, causal):
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 3, 2, 11, 8, generator=g, dtype=torch.float64)
    L = torch.tensor([11, 0, 6])
    ref = btlib.reference_attention(q, k, v, lengths=L, causal=causal, window=window)
    assert relative_error(ref, _brute(q, k, v, L, causal, window)) <= 1e-12
    packed = [btlib.pack(x.transpose(1, 2), L).tokens for x in (q, k, v)]  # (total, H, D)
    cu, max_seqlen = btlib.lengths_to_cu_seqlens(L)
    out = btlib.reference_varlen_attention(*packed, cu, max_seqlen, causal=causal, window=window)
    assert relative_error(out, btlib.pack(ref.transpose(1, 2), L).tokens) <= 1e-12


def test_allowed_mask_band_and_wide_window_is_global():
    band = allowed_mask(1, 4, 4, window=(1, 0))[0, 0].int()
    assert band.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    both = allowed_mask(1, 4, 4, window=(0, 2), causal=True)[0, 0]
    assert torch.equal(both, torch.eye(4, dtype=torch.bool))  # right reach cut by causal: only the diagonal
    q = torch.randn(2, 2, 9, 8)
    L = torch.tensor([9, 4])
    wide = btlib.reference_attention(q, q, q, lengths=L, window=(8, 8))
    assert torch.equal(wide, btlib.reference_attention(q, q, q, lengths=L))


@pytest.mark.parametrize("layout", ["padded", "varlen"])
@pytest.mark.parametrize("window", [(0, 0), (2, 5), (64, 64)])
def test_every_window_kernel_through_the_entry_points(layout, window):
    """btlib.attention / varlen_attention with each kernel that takes a window, and "auto"."""
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(3, 3, 2, 97, 16, generator=g)
    L = torch.tensor([97, 40, 0])
    names = ["auto"] + [kk.name for kk in kernels(layout) if kk.window and kk.supports(q, window=window) is None]
    for causal in (False, True):
        ref = btlib.reference_attention(q, k, v, lengths=L, causal=causal, window=window)
        for name in names:
            with torch.inference_mode():
                if layout == "padded":
                    out = btlib.attention(q, k, v, lengths=L, causal=causal, window=window, backend=name)
                else:
                    packed = [btlib.pack(x.transpose(1, 2), L).tokens for x in (q, k, v)]
                    cu, max_seqlen = btlib.lengths_to_cu_seqlens(L)
                    out = btlib.varlen_attention(*packed, cu, max_seqlen, causal=causal, window=window, backend=name)
                    out = btlib.unpack(out, cu, 97).transpose(1, 2)  # (B, H, T, D), padded rows 0
            assert relative_error(out, ref) <= 1e-5, (name, causal)
            assert (out[1, :, 40:] == 0).all() and (out[2] == 0).all()


def test_window_gradients_follow_the_reference():
    q, k, v = (torch.randn(2, 2, 13, 8).requires_grad_(True) for _ in range(3))
    L = torch.tensor([13, 7])
    w = torch.randn(2, 2, 13, 8)
    (btlib.attention(q, k, v, lengths=L, window=(2, 1)) * w).sum().backward()  # auto: a differentiable kernel
    rq, rk, rv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    (btlib.reference_attention(rq, rk, rv, lengths=L, window=(2, 1)) * w).sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), (rq.grad, rk.grad, rv.grad)):
        assert relative_error(got, want) <= 1e-5


def test_registry_window_support():
    x = torch.randn(5, 2, 8)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    nested = registry.get("torch_sdpa_nested")
    assert not nested.window
    assert "has no local window" in nested.supports(x, window=(1, 1))
    assert nested.supports(x) is None
    with pytest.raises(ValueError, match="has no local window"):
        btlib.varlen_attention(x, x, x, cu, 5, window=(1, 1), backend="torch_sdpa_nested")
    assert registry.select("varlen", x, False, window=(1, 1)).window
    with pytest.raises(ValueError, match="has no local window"):
        registry.window_kwargs(nested, (1, 1))
    assert registry.window_kwargs(nested, None) == {}  # kernels without a window are called as before
    assert registry.window_kwargs(registry.get("torch_sdpa_loop"), None) == {"window": None}


q4 = torch.randn(2, 2, 5, 8)
x3 = torch.randn(5, 2, 8)
cu3 = torch.tensor([0, 5], dtype=torch.int32)


@pytest.mark.parametrize("window, err, match", [
    ((-1, 2), ValueError, "left must be >= 0"),
    ((2, -3), ValueError, "right must be >= 0"),
    ((1.5, 2), TypeError, "left must be an int"),
    ((True, 2), TypeError, "left must be an int"),
    ((1, 2, 3), ValueError, "2 entries"),
    ((4,), ValueError, "2 entries"),
    (64, TypeError, r"\(left, right\) tuple"),
    ("64", TypeError, r"\(left, right\) tuple"),
])
@pytest.mark.parametrize("entry", ["attention", "varlen_attention", "reference_attention", "attention_pairs"])
def test_bad_windows_say_what_to_pass(window, err, match, entry):
    call = {
        "attention": lambda: btlib.attention(q4, q4, q4, window=window),
        "varlen_attention": lambda: btlib.varlen_attention(x3, x3, x3, cu3, 5, window=window),
        "reference_attention": lambda: btlib.reference_attention(q4, q4, q4, window=window),
        "attention_pairs": lambda: attention_pairs(torch.tensor([3]), window=window),
    }[entry]
    with pytest.raises(err, match=match) as e:
        call()
    assert "window=(left, right)" in str(e.value)


def test_window_as_list_and_numpy_ints_are_accepted():
    import numpy as np

    a = btlib.attention(q4, q4, q4, window=[1, 2])
    b = btlib.attention(q4, q4, q4, window=(np.int64(1), np.int32(2)))
    assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", [None, (0, 0), (1, 0), (0, 1), (2, 5), (5, 2), (64, 64), (1000, 3)])
def test_attention_pairs_counts_the_allowed_mask(window, causal):
    lengths = torch.tensor([0, 1, 2, 7, 64, 65, 130])
    masks = [allowed_mask(1, n, n, causal=causal, window=window) for n in lengths.tolist()]
    want = sum(n * n if m is None else int(m.sum()) for n, m in zip(lengths.tolist(), masks))  # None: nothing masked
    assert attention_pairs(lengths, causal=causal, window=window) == want
    assert attention_flops(lengths, 12, 64, causal=causal, window=window) == 4.0 * 12 * 64 * want


def test_flops_with_and_without_window():
    L = torch.tensor([512, 8192])
    assert attention_flops(L, 12, 64) == 4.0 * 12 * 64 * (512**2 + 8192**2)
    # 129-key band: every row but the 64 nearest each end sees 129 keys
    assert attention_pairs(torch.tensor([8192]), window=(64, 64)) == 8192 * 129 - 2 * (64 * 65 // 2)
    assert attention_pairs(torch.tensor([8192]), window=(64, 64), causal=True) == 8192 * 65 - 64 * 65 // 2
    from btlib.bench.attention import varlen_flops

    p = {"B": 4, "T": 256, "padding": 0.5, "H": 2, "D": 16}
    assert varlen_flops({**p, "window": (8, 8)}) < varlen_flops(p)
    assert varlen_flops({**p, "window": (300, 300)}) == varlen_flops(p)
