"""Position biases (btlib/position_bias.py): ALiBi and relative-position tables, in every kernel that takes one.

- the table helper against T5's / MPNet's own bucket function (copied below from Hugging Face) on every
  offset in [-3R, 3R]; ALiBi's slopes against the paper's;
- the reference's bias against a brute-force loop (padded and packed: positions restart per sequence);
- every kernel registered with bias=True that runs on this machine (C++ v3 and varlen on every ISA build,
  PyTorch's SDPA paths, the CUDA kernel's source in the emulator, the Triton kernel in its interpreter)
  against the reference on odd sizes: T = 1 and 97, packed lengths with 1 and 0, H = 3, both kinds,
  causal and windows, fp32 and bf16;
- the kernels without one refuse it, bad biases raise saying what to pass, autograd falls back to SDPA.
(btlib.kernels.check also runs both kinds for every bias kernel: tests/test_kernel_check.py.)
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import btlib
from btlib import PositionBias, alibi_slopes, relative_bucket_table
from btlib.kernels import get, kernels, registry, relative_error
from btlib.kernels.cpu import build
from btlib.position_bias import relative_position_bucket

# --- The bucket function, as Hugging Face's MPNet and T5 write it --------------------------------------------


def mpnet_bucket(relative_position, num_buckets=32, max_distance=128):
    """transformers' MPNetAttention.relative_position_bucket, verbatim but for names; relative_position = j - i."""
    ret = 0
    n = -relative_position
    num_buckets //= 2
    ret += (n < 0).to(torch.long) * num_buckets
    n = torch.abs(n)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    val_if_large = max_exact + (
        torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.long)
    val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))
    ret += torch.where(is_small, n, val_if_large)
    return ret


def t5_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    """transformers' T5Attention._relative_position_bucket; relative_position = j - i."""
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = max_exact + (
        torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    relative_buckets += torch.where(is_small, relative_position, large)
    return relative_buckets


@pytest.mark.parametrize("num_buckets, max_distance, bidirectional, bucket", [
    (32, 128, True, mpnet_bucket),  # MPNet (all-mpnet-base-v2)
    (32, 128, True, lambda d, nb, md: t5_bucket(d, True, nb, md)),  # T5's encoder
    (32, 128, False, lambda d, nb, md: t5_bucket(d, False, nb, md)),  # T5's decoder
    (10, 9, True, mpnet_bucket),  # small: max_exact 2, max_distance just above it
])
def test_bucket_table_gives_every_offset_its_bucket(num_buckets, max_distance, bidirectional, bucket):
    H, R = 3, max_distance
    values = torch.randn(H, num_buckets)
    bias = relative_bucket_table(values, num_buckets, max_distance, bidirectional)
    assert bias.kind == "table" and bias.values.shape == (H, 2 * R + 1)
    d = torch.arange(-3 * R, 3 * R + 1)
    want = values[:, bucket(d, num_buckets, max_distance)]  # (H, 6R + 1)
    assert torch.equal(bias.at(d), want)
    assert torch.equal(relative_position_bucket(d, num_buckets, max_distance, bidirectional),
                       bucket(d, num_buckets, max_distance))


def test_alibi_slopes_are_the_papers():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    s12 = alibi_slopes(12)  # 8 of 2^(-i), then every other of the 16-head slopes 2^(-(i + 1) / 2)
    assert torch.allclose(s12, torch.tensor([2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -((2 * i + 1) / 2) for i in range(4)]))
    assert alibi_slopes(1).tolist() == [2.0 ** -8]


# --- The reference against a brute-force loop -----------------------------------------------------------------

def _brute(q, k, v, L, causal, window, bias):
    """(B, H, T, D) float64 by explicit loops over (b, h, i): softmax over the allowed keys of s + bias(h, j - i)."""
    B, H, T, D = q.shape
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(int(L[b])):
                keys = [j for j in range(int(L[b])) if (not causal or j <= i)
                        and (window is None or i - window[0] <= j <= i + window[1])]
                if bias.kind == "alibi":
                    bj = [-float(bias.values[h]) * abs(j - i) for j in keys]
                else:
                    R = bias.max_distance
                    bj = [float(bias.values[h, min(max(j - i, -R), R) + R]) for j in keys]
                s = torch.tensor([float(q[b, h, i] @ k[b, h, j]) / math.sqrt(D) + bj[n] for n, j in enumerate(keys)],
                                 dtype=torch.float64)
                p = torch.softmax(s, 0)
                out[b, h, i] = sum(p[n] * v[b, h, j] for n, j in enumerate(keys))
    return out


def _bias(kind: str, H: int, g=None) -> PositionBias:
    if kind == "alibi":
        return PositionBias.alibi(0.05 + 0.95 * torch.rand(H, generator=g))
    return PositionBias.table(torch.randn(H, 2 * 4 + 1, generator=g), 4)


@pytest.mark.parametrize("kind", ["alibi", "table"])
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, (2, 3))])
def test_reference_matches_brute_force(kind, causal, window):
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(3, 3, 3, 11, 8, generator=g, dtype=torch.float64)
    L = torch.tensor([11, 1, 7])
    bias = _bias(kind, 3, g)
    ref = btlib.reference_attention(q, k, v, lengths=L, causal=causal, window=window, bias=bias)
    assert relative_error(ref, _brute(q, k, v, L, causal, window, bias)) <= 1e-12
    packed = [btlib.pack(x.transpose(1, 2), L).tokens for x in (q, k, v)]  # (total, H, D): positions restart per sequence
    cu, max_seqlen = btlib.lengths_to_cu_seqlens(L)
    out = btlib.reference_varlen_attention(*packed, cu, max_seqlen, causal=causal, window=window, bias=bias)
    assert relative_error(out, btlib.pack(ref.transpose(1, 2), L).tokens) <= 1e-12
    # and the bias matters: without it the answer is another
    assert relative_error(btlib.reference_attention(q, k, v, lengths=L, causal=causal, window=window), ref) > 1e-3


# --- Every kernel with a bias, on odd sizes -----------------------------------------------------------------

LENGTHS = [97, 1, 0, 40]  # packed: one longer than a tile, a single token, an empty sequence, one between
CASES = [(k, w, c) for k in ("alibi", "table") for w, c in [(None, False), (None, True), ((3, 5), False), ((64, 64), True)]]


def _varlen_inputs(dtype, H=3, D=24, lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu, max_seqlen = btlib.lengths_to_cu_seqlens(torch.tensor(lengths))
    q, k, v = torch.randn(3, sum(lengths), H, D, generator=g).to(dtype)
    return q, k, v, cu, max_seqlen


def _tolerance(kernel, dtype, sdpa_out, ref):
    return kernel.tolerance(dtype, None if dtype == torch.float32 else relative_error(sdpa_out.float(), ref))


def _cpu_runs():
    """(name, fn) of every bias kernel that runs on CPU tensors here: native CPU ones, and GPU sources on the CPU."""
    runs = []
    for k in kernels():
        if not k.bias:
            continue
        if "cpu" in k.devices and k.available() is None:
            runs.append(pytest.param(k.name, k.fn, id=k.name))
        elif k.cpu_run is not None and k.cpu_run.how == "emulator" and k.cpu_run.available() is None:
            runs.append(pytest.param(k.name, k.cpu_run.fn, id=f"{k.name}-emulator"))
    return runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name, fn", _cpu_runs())
def test_bias_kernels_match_the_reference(name, fn, dtype):
    kernel = get(name)
    if dtype not in kernel.dtypes:
        pytest.skip(f"{name} takes no {dtype}")
    g = torch.Generator().manual_seed(7)
    if kernel.layout == "varlen":
        q, k, v, cu, max_seqlen = _varlen_inputs(dtype)
        args, kw, sdpa = (q, k, v, cu, max_seqlen), {}, get("torch_sdpa_loop").fn
    else:
        q, k, v = torch.randn(3, 3, 3, 97, 24, generator=g).to(dtype)
        args, kw, sdpa = (q, k, v), {"lengths": torch.tensor([97, 1, 0])}, get("torch_sdpa").fn
    if kernel.layout == "padded" and name.startswith("cpu"):  # T = 1, batch 1: the single-token case
        one = torch.randn(3, 1, 3, 1, 24, generator=g).to(dtype)
        b = _bias("table", 3, g)
        ref = btlib.reference_attention(*one, bias=b)
        assert relative_error(fn(*one, causal=False, scale=None, bias=b), ref) <= 1e-2
    for kind, window, causal in CASES:
        bias = _bias(kind, 3, g)
        w = {} if window is None else {"window": window}
        out = fn(*args, **kw, causal=causal, scale=None, bias=bias, **w)
        ref = kernel.reference(*args, **kw, causal=causal, bias=bias, **w)
        tol = _tolerance(kernel, dtype, sdpa(*args, **kw, causal=causal, scale=None, bias=bias, **w), ref)
        assert out.dtype == dtype and out.shape == q.shape and not out.isnan().any()
        assert relative_error(out, ref) <= tol, (kind, window, causal)


@pytest.mark.skipif(build.available() is not None, reason=f"C++ kernels cannot build here: {build.available()}")
@pytest.mark.parametrize("isa", build.runnable())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_cpu_build_adds_the_bias(isa, dtype):
    """Each ISA build's ops straight (the registered kernels use one build): both layouts, both kinds."""
    from btlib.position_bias import kernel_args

    q, k, v, cu, max_seqlen = _varlen_inputs(dtype, seed=1)
    L = torch.tensor(LENGTHS)
    padded = [btlib.unpack(x, cu, max_seqlen).transpose(1, 2).contiguous() for x in (q, k, v)]  # (B, H, T, D)
    ops = build.ops(isa)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: inputs and P rounded to 8 bits (core_check.cpp's 1.5e-2)
    for kind, window, causal in CASES:
        bias = _bias(kind, 3)
        w = window or (-1, -1)
        out = ops.varlen_v3(q, k, v, cu, max_seqlen, causal, 24 ** -0.5, *w, *kernel_args(bias))
        ref = btlib.reference_varlen_attention(q, k, v, cu, max_seqlen, causal=causal, window=window, bias=bias)
        assert relative_error(out, ref) <= tol, (isa, kind, window, causal)
        out = ops.attention_v3(*padded, L, causal, 24 ** -0.5, *w, *kernel_args(bias))
        ref = btlib.reference_attention(*padded, lengths=L, causal=causal, window=window, bias=bias)
        assert relative_error(out, ref) <= tol, (isa, kind, window, causal)


@pytest.mark.skipif(build.available() is not None, reason=f"C++ kernels cannot build here: {build.available()}")
def test_packing_does_not_change_the_bias():
    """A sequence alone and the same sequence packed after others: the same output, bit for bit (positions restart)."""
    q, k, v, cu, max_seqlen = _varlen_inputs(torch.float32, seed=2)
    bias = _bias("alibi", 3)
    packed = btlib.varlen_attention(q, k, v, cu, max_seqlen, bias=bias, window=(3, 5))
    s, e = int(cu[3]), int(cu[4])  # the last sequence (40 tokens), after 98 others
    alone = btlib.varlen_attention(q[s:e], k[s:e], v[s:e], torch.tensor([0, e - s], dtype=torch.int32), e - s, bias=bias,
                                   window=(3, 5))
    assert torch.equal(packed[s:e], alone)


def _interpret_worker() -> None:
    """With TRITON_INTERPRET=1: the Triton kernels with each bias kind on small odd inputs, as one JSON line."""
    results = {}
    g = torch.Generator().manual_seed(5)
    lengths = [37, 1, 0, 20]
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, cu, max_seqlen = _varlen_inputs(dtype, D=16, lengths=lengths)
        L = torch.tensor(lengths)
        padded = [btlib.unpack(x, cu, max_seqlen).transpose(1, 2).contiguous() for x in (q, k, v)]
        for kind, window, causal in [("alibi", None, False), ("table", (3, 5), True), ("table", None, False)]:
            bias = _bias(kind, 3, g)
            w = {} if window is None else {"window": window}
            for name, args, kw, sdpa in [("triton_flash_varlen", (q, k, v, cu, max_seqlen), {}, "torch_sdpa_loop"),
                                         ("triton_flash", padded, {"lengths": L}, "torch_sdpa")]:
                kernel = get(name)
                out = kernel.fn(*args, **kw, causal=causal, scale=None, bias=bias, **w)
                ref = kernel.reference(*args, **kw, causal=causal, bias=bias, **w)
                tol = _tolerance(kernel, dtype, get(sdpa).fn(*args, **kw, causal=causal, scale=None, bias=bias, **w), ref)
                results[f"{name} {dtype} {kind} {window} {causal}"] = [relative_error(out, ref), tol]
    print("RESULTS " + json.dumps(results))


def test_triton_interpreter_adds_the_bias():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, __file__, "--interpret"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULTS "))[len("RESULTS "):])
    assert len(results) == 12
    for case, (err, tol) in results.items():
        assert err <= tol, f"{case}: error {err:.2e} > {tol:.2e}"


# --- Refusals, bad input, gradients ---------------------------------------------------------------------------

def test_kernels_without_a_bias_refuse_it():
    x = torch.randn(6, 3, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    bias = _bias("alibi", 3)
    with pytest.raises(ValueError, match="has no position bias"):
        btlib.varlen_attention(x, x, x, cu, 4, bias=bias, backend="torch_sdpa_nested")
    q = torch.randn(1, 3, 5, 8)
    for name in ("cpu_naive_v1", "cpu_tiled_v2"):
        if get(name).available() is None:
            with pytest.raises(ValueError, match="has no position bias"):
                btlib.attention(q, q, q, bias=bias, backend=name)
    refusing = {k.name for k in kernels() if not k.bias}
    assert refusing == {"torch_sdpa_nested", "cpu_naive_v1", "cpu_tiled_v2"}
    with pytest.raises(ValueError, match="has no position bias"):
        registry.bias_kwargs(get("torch_sdpa_nested"), bias)
    if build.available() is None:
        assert registry.select("varlen", x, False, bias=bias).name == "cpu_flash_varlen"


@pytest.mark.parametrize("make, match", [
    (lambda: PositionBias.table(torch.randn(3, 8), 4), r"\(H, 9\)"),
    (lambda: PositionBias.table(torch.randn(3, 9, dtype=torch.float64), 4), r"float32.*\.float\(\)"),
    (lambda: PositionBias.table(torch.randn(9), 4), r"\(H, 2 \* max_distance \+ 1\)"),
    (lambda: PositionBias.table(torch.randn(3, 9), -1), "max_distance must be >= 0"),
    (lambda: PositionBias.table(torch.full((3, 9), float("nan")), 4), "NaN or inf"),
    (lambda: PositionBias.alibi(torch.tensor([0.5, float("inf")])), "NaN or inf"),
    (lambda: PositionBias.alibi(torch.ones(2, 2)), r"1-D \(H,\)"),
    (lambda: PositionBias.alibi(torch.ones(3, dtype=torch.float16)), "float32"),
    (lambda: PositionBias("rope", torch.ones(3)), "kind must be 'alibi' or 'table'"),
    (lambda: relative_bucket_table(torch.randn(3, 16), 32, 128), r"\(H, num_buckets\) = \(H, 32\)"),
    (lambda: relative_bucket_table(torch.randn(3, 32), 32, 8), "max_distance must be >= 9"),
])
def test_bad_biases_say_what_to_pass(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bias_that_does_not_fit_the_call():
    q = torch.randn(1, 3, 5, 8)
    with pytest.raises(ValueError, match="2 heads, the inputs have H=3"):
        btlib.attention(q, q, q, bias=PositionBias.alibi(torch.ones(2)))
    with pytest.raises(ValueError, match="is on meta.*bias.to"):
        btlib.attention(q, q, q, bias=PositionBias.alibi(torch.ones(3)).to("meta"))
    with pytest.raises(TypeError, match="PositionBias or None"):
        btlib.attention(q, q, q, bias=torch.ones(3, 5, 5))
    if build.available() is None:  # straight into the C++ op: the binding's own checks
        with pytest.raises(RuntimeError, match=r"bias table must be \(H, 2 \* bias_max_distance \+ 1\)"):
            build.ops().attention_v3(q, q, q, None, False, 1.0, -1, -1, torch.zeros(3, 5), 2, 4)
        with pytest.raises(RuntimeError, match="NaN or inf"):
            build.ops().attention_v3(q, q, q, None, False, 1.0, -1, -1, torch.full((3,), float("nan")), 1, 0)
        with pytest.raises(RuntimeError, match="exactly when bias_kind"):
            build.ops().attention_v3(q, q, q, None, False, 1.0, -1, -1, None, 1, 0)


def test_autograd_with_a_bias_uses_sdpa_and_reaches_the_table():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, 9, 8, generator=g).requires_grad_() for _ in range(3))
    table = torch.randn(3, 2 * 4 + 1, generator=g).requires_grad_()
    bias = PositionBias.table(table, 4)
    L = torch.tensor([9, 4])
    out = btlib.attention(q, k, v, lengths=L, bias=bias)  # auto: a differentiable kernel
    ref = btlib.reference_attention(q, k, v, lengths=L, bias=bias)
    grads = torch.autograd.grad(out.square().sum(), (q, table))
    want = torch.autograd.grad(ref.square().sum(), (q, table))
    for got, exp in zip(grads, want):
        assert relative_error(got, exp) <= 1e-5
    assert want[1].abs().sum() > 0
    if build.available() is None:
        with pytest.raises(ValueError, match="has no backward"):
            btlib.attention(q, k, v, lengths=L, bias=bias, backend="cpu_flash_v3")
        fixed = PositionBias.table(table.detach(), 4)  # the table alone requiring grad also needs a backward
        with pytest.raises(ValueError, match="has no backward"):
            btlib.attention(q.detach(), k.detach(), v.detach(), bias=bias, backend="cpu_flash_v3")
        assert btlib.attention(q.detach(), k.detach(), v.detach(), bias=fixed).requires_grad is False


if __name__ == "__main__" and sys.argv[1:] == ["--interpret"]:
    _interpret_worker()
