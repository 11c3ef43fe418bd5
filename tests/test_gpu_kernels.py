"""btlib's GPU kernels, proven as far as a machine without a GPU allows, and checked for real on one.

Without a GPU (every test here but the @pytest.mark.gpu ones):
- the Triton kernel runs in Triton's interpreter (TRITON_INTERPRET=1, in one subprocess: the
  variable must be set before triton is imported and must not leak into other tests) against
  the reference: odd lengths, fully padded rows, batch 1, causal on and off, fp32/fp16/bf16;
- the Triton kernel compiles for sm_75 (T4), sm_80 (A100), sm_90 (H100) and fits their shared memory;
- the CUDA kernel (flash_attn.cu) compiles with nvcc for the same targets, its source runs on CPU
  threads against the reference (emulate.py), and binding.cpp type-checks against torch's headers;
- the registry lists all four kernels and never picks them for CPU tensors.
With a GPU: btlib.attention / btlib.varlen_attention on CUDA tensors, every GPU kernel, against the reference.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import btlib
from btlib.kernels import get, kernels, relative_error
from btlib.kernels.gpu import build, emulate
from btlib.kernels.registry import FP32_TOL, LOW_PRECISION_FACTOR

GPU_KERNELS = ("triton_flash", "triton_flash_varlen", "cuda_flash", "cuda_flash_varlen")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16}  # several query and key tiles even at T = 33

# (B, H, T, D, lengths, dtype, blocks): tiny, since the interpreter runs one program at a time in numpy.
PADDED_CASES = [
    (1, 1, 1, 16, None, "fp32", None),  # batch 1, one token
    (1, 2, 61, 32, None, "fp32", SMALL),  # batch 1, odd length, 4 query x 4 key tiles
    (2, 2, 33, 32, [33, 0], "fp32", SMALL),  # a sequence of length 0: every row fully padded
    (2, 1, 61, 16, [5, 61], "fp32", None),  # padded rows inside the one default-size tile
    (2, 1, 33, 24, [17, 33], "fp32", SMALL),  # head_dim 24: BLOCK_D 32 with masked columns
    (2, 2, 33, 32, [33, 0], "fp16", SMALL),
    (2, 1, 61, 16, [5, 61], "fp16", None),
    (2, 2, 33, 32, [1, 33], "bf16", SMALL),
]
VARLEN_CASES = [  # (lengths, H, D, dtype, blocks)
    ([1], 1, 16, "fp32", None),
    ([5, 0, 33, 1], 2, 32, "fp32", SMALL),
    ([61, 17], 1, 16, "fp32", None),
    ([5, 0, 33, 1], 2, 32, "fp16", SMALL),
    ([33, 6], 2, 16, "bf16", SMALL),
]


def _case_id(case) -> str:
    return "-".join(str(x).replace(" ", "") for x in case[:-1]) + ("-small" if case[-1] else "")


def _low_precision_tol(out_sdpa: torch.Tensor, ref: torch.Tensor) -> float:
    """STYLE.md: at most LOW_PRECISION_FACTOR x PyTorch's own SDPA error in the same dtype (floor: one fp32 ulp)."""
    return max(LOW_PRECISION_FACTOR * relative_error(out_sdpa.float(), ref), 1.2e-7)


# ------------------------------------------------------------------------------------------------
# The interpreter worker: `python tests/test_gpu_kernels.py --interpret` with TRITON_INTERPRET=1.
# ------------------------------------------------------------------------------------------------
def _interpret_worker() -> None:
    from btlib.kernels.gpu.flash_attn import flash_attention, flash_varlen_attention, interpreted

    assert interpreted(), "TRITON_INTERPRET=1 was not in effect"
    torch.manual_seed(0)
    results = {}
    for case in PADDED_CASES:
        B, H, T, D, lengths, dt, blocks = case
        L = None if lengths is None else torch.tensor(lengths)
        q, k, v = torch.randn(3, B, H, T, D).to(DTYPES[dt])
        for causal in (False, True):
            out = flash_attention(q, k, v, lengths=L, causal=causal, blocks=blocks)
            ref = btlib.reference_attention(q, k, v, lengths=L, causal=causal)
            tol = FP32_TOL if dt == "fp32" else _low_precision_tol(get("torch_sdpa").fn(q, k, v, lengths=L, causal=causal), ref)
            zero_rows = [] if L is None else [out[b, :, int(L[b]):].abs().max().item() if int(L[b]) < T else 0.0 for b in range(B)]
            results[f"padded-{_case_id(case)}-{causal}"] = dict(
                err=relative_error(out.float(), ref), tol=tol, nan=bool(out.isnan().any()), dtype=str(out.dtype),
                shape=list(out.shape), zero_rows=zero_rows)
    for case in VARLEN_CASES:
        lengths, H, D, dt, blocks = case
        cu, max_seqlen = btlib.lengths_to_cu_seqlens(torch.tensor(lengths))
        q, k, v = torch.randn(3, sum(lengths), H, D).to(DTYPES[dt])
        for causal in (False, True):
            out = flash_varlen_attention(q, k, v, cu, max_seqlen, causal=causal, blocks=blocks)
            ref = btlib.reference_varlen_attention(q, k, v, cu, max_seqlen, causal=causal)
            tol = FP32_TOL if dt == "fp32" else _low_precision_tol(get("torch_sdpa_loop").fn(q, k, v, cu, max_seqlen, causal=causal), ref)
            results[f"varlen-{_case_id(case)}-{causal}"] = dict(
                err=relative_error(out.float(), ref), tol=tol, nan=bool(out.isnan().any()), dtype=str(out.dtype),
                shape=list(out.shape), zero_rows=[])
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def interpreted_results():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, __file__, "--interpret"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


def _check(r: dict, dtype: str) -> None:
    assert not r["nan"], "NaN in the output"
    assert r["dtype"] == str(DTYPES[dtype])
    assert r["err"] <= r["tol"], f"error {r['err']:.2e} > tol {r['tol']:.2e}"
    assert all(z == 0.0 for z in r["zero_rows"]), f"padded query rows are not 0: {r['zero_rows']}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", PADDED_CASES, ids=_case_id)
def test_triton_padded_interpreted(interpreted_results, case, causal):
    r = interpreted_results[f"padded-{_case_id(case)}-{causal}"]
    assert r["shape"] == list(case[:4])
    _check(r, case[5])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", VARLEN_CASES, ids=_case_id)
def test_triton_varlen_interpreted(interpreted_results, case, causal):
    r = interpreted_results[f"varlen-{_case_id(case)}-{causal}"]
    assert r["shape"] == [sum(case[0]), case[1], case[2]]
    _check(r, case[3])


def test_triton_on_cpu_tensors_without_interpreter_says_how():
    pytest.importorskip("triton")
    from btlib.kernels.gpu.flash_attn import flash_attention, interpreted

    if interpreted():
        pytest.skip("TRITON_INTERPRET=1 is set for this whole test process")
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        flash_attention(q, q, q)


# ------------------------------------------------------------------------------------------------
# Compile checks: Triton for sm_75 / sm_80 / sm_90; nvcc for the CUDA kernel; the binding's syntax.
# ------------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")
@pytest.mark.parametrize("capability", [75, 80, 90])
def test_triton_compiles_for(capability):
    pytest.importorskip("triton")
    from btlib.kernels.gpu.flash_attn import interpreted
    from btlib.kernels.gpu.targets import compile_for

    if interpreted():
        pytest.skip("TRITON_INTERPRET=1 is set for this test process: the interpreter replaces the compiler")
    padded = compile_for(capability, torch.float16, 64, varlen=False, causal=True)
    varlen = compile_for(capability, torch.bfloat16, 128, varlen=True, causal=False)
    for c in (padded, varlen):
        assert c.cubin_bytes > 0 and c.fits, str(c)
        # Triton 3.9 emits tensor-core instructions (mma) for sm_80 and sm_90, none for sm_75 (FMA only).
        assert c.tensor_cores == (capability >= 80), str(c)


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")
def test_triton_largest_tile_fits_a_t4():
    pytest.importorskip("triton")
    from btlib.kernels.gpu.flash_attn import interpreted
    from btlib.kernels.gpu.targets import compile_for

    if interpreted():
        pytest.skip("TRITON_INTERPRET=1 is set for this test process")
    c = compile_for(75, torch.float32, 128, varlen=False, causal=False)  # 4-byte elements, the widest head
    assert c.fits, str(c)


@pytest.mark.skipif(build.nvcc() is None, reason="nvcc not found: the CUDA compile check needs the CUDA toolkit")
def test_cuda_kernel_compiles_with_nvcc(tmp_path):
    report, seconds = build.nvcc_compile((75, 80, 90), tmp_path / "flash_attn.o", verbose=True)
    assert (tmp_path / "flash_attn.o").stat().st_size > 0
    smem = [int(s) for s in re.findall(r"(\d+) bytes smem", report)]
    assert len(smem) >= 27, report  # 3 archs x 3 dtypes x 3 head-dim buckets
    assert max(smem) <= 48 * 1024, "static shared memory above the 48 KiB a block may declare"
    for arch in (75, 80, 90):
        assert f"sm_{arch}" in report


@pytest.mark.skipif(emulate.cuda_include_dir() is None, reason="no CUDA headers: binding.cpp needs cuda_runtime_api.h")
def test_binding_type_checks_against_torch_headers():
    build.binding_syntax_check()


# ------------------------------------------------------------------------------------------------
# The CUDA kernel's source on CPU threads (emulate.cpp) against the reference.
# ------------------------------------------------------------------------------------------------
needs_emulator = pytest.mark.skipif(emulate.available() is not None, reason=f"emulator: {emulate.available()}")


@needs_emulator
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,H,T,D,lengths", [
    (1, 1, 1, 16, None),
    (2, 2, 33, 32, [33, 0]),  # fully padded sequence
    (2, 1, 97, 80, [5, 97]),  # odd length, head_dim 80 -> kD 128, two query tiles
    (1, 2, 130, 64, None),  # three query tiles, causal tile skipping
])
def test_cuda_kernel_emulated_padded(B, H, T, D, lengths, causal, dtype):
    L = None if lengths is None else torch.tensor(lengths)
    q, k, v = torch.randn(3, B, H, T, D).to(DTYPES[dtype])
    out = emulate.emulated_attention(q, k, v, lengths=L, causal=causal)
    ref = btlib.reference_attention(q, k, v, lengths=L, causal=causal)
    tol = FP32_TOL if dtype == "fp32" else _low_precision_tol(get("torch_sdpa").fn(q, k, v, lengths=L, causal=causal), ref)
    assert out.dtype == q.dtype and not out.isnan().any()
    assert relative_error(out.float(), ref) <= tol
    if L is not None:
        for b in range(B):
            assert out[b, :, int(L[b]):].abs().sum() == 0


@needs_emulator
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_kernel_emulated_varlen(causal, dtype):
    lengths = [5, 0, 70, 1, 33]
    cu, max_seqlen = btlib.lengths_to_cu_seqlens(torch.tensor(lengths))
    q, k, v = torch.randn(3, sum(lengths), 2, 32).to(DTYPES[dtype])
    out = emulate.emulated_varlen_attention(q, k, v, cu, max_seqlen, causal=causal)
    ref = btlib.reference_varlen_attention(q, k, v, cu, max_seqlen, causal=causal)
    sdpa = get("torch_sdpa_loop").fn(q, k, v, cu, max_seqlen, causal=causal)
    tol = FP32_TOL if dtype == "fp32" else _low_precision_tol(sdpa, ref)
    assert relative_error(out.float(), ref) <= tol


# ------------------------------------------------------------------------------------------------
# Registry: listed, CUDA-only, say why not here, cheap to import.
# ------------------------------------------------------------------------------------------------
def test_gpu_kernels_registered_cuda_only():
    names = {k.name: k for k in kernels()}
    assert set(GPU_KERNELS) <= set(names)
    for name in GPU_KERNELS:
        k = names[name]
        assert k.devices == ("cuda",) and k.reference in ("reference_attention",)
        assert set(k.dtypes) == {torch.float16, torch.bfloat16, torch.float32}
        assert k.supports(torch.empty(1, 1, 1, 8)) is not None  # CPU tensors: never these kernels
    q = torch.randn(1, 2, 5, 16)
    assert btlib.attention(q, q, q).shape == q.shape  # auto picks a CPU kernel
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cannot run these inputs: needs a CUDA"):
            btlib.attention(q, q, q, backend="triton_flash")
        with pytest.raises(ValueError, match="cannot run these inputs: needs a CUDA"):
            btlib.varlen_attention(q[0].transpose(0, 1).contiguous(), q[0].transpose(0, 1).contiguous(),
                                   q[0].transpose(0, 1).contiguous(), torch.tensor([0, 5], dtype=torch.int32), 5,
                                   backend="cuda_flash_varlen")


def test_registry_import_stays_light():
    code = ("import sys, torch, btlib; btlib.kernels.kernels(); "
            "[k.available() for k in btlib.kernels.kernels()]; "
            "assert 'triton' not in sys.modules, 'triton imported'; "
            "assert 'torch.utils.cpp_extension' not in sys.modules; assert not torch.cuda.is_initialized()")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", ["gpu_attention", "gpu_attention_varlen"])
def test_gpu_benchmarks_declared_and_skip_without_gpu(name, tmp_path):
    from btlib import bench

    b = bench.load_all()[name]
    names = {p.name for p in b.providers()}
    assert {"triton_flash", "naive" if name == "gpu_attention" else "naive_masked"} <= names
    if name == "gpu_attention":
        assert {"sdpa_flash", "sdpa_efficient", "sdpa_math", "cuda_flash"} <= names
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the notebook runs the benchmark")
    rows = bench.run(b, quick=True, json_path=tmp_path / "rows.jsonl")
    assert rows and all(r["status"] == "skipped" and r["reason"].startswith("needs a CUDA GPU") for r in rows)


# ------------------------------------------------------------------------------------------------
# On a GPU: the real thing, through the public API.
# ------------------------------------------------------------------------------------------------
GPU_SHAPES = [(1, 1, 1, 16, None), (2, 3, 97, 64, [97, 40]), (3, 2, 33, 80, [0, 33, 5]), (2, 4, 300, 128, [300, 1])]


def _gpu_tol(dtype, q, k, v, L, causal, ref):
    if dtype == torch.float32:
        return FP32_TOL
    return _low_precision_tol(get("torch_sdpa").fn(q, k, v, lengths=L, causal=causal), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,H,T,D,lengths", GPU_SHAPES)
@pytest.mark.parametrize("name", ["triton_flash", "cuda_flash"])
def test_gpu_padded(name, B, H, T, D, lengths, causal, dtype):
    q, k, v = torch.randn(3, B, H, T, D, device="cuda").to(dtype)
    L = None if lengths is None else torch.tensor(lengths, device="cuda")
    out = btlib.attention(q, k, v, lengths=L, causal=causal, backend=name)
    ref = btlib.reference_attention(q, k, v, lengths=L, causal=causal)
    assert out.shape == q.shape and out.dtype == dtype and not out.isnan().any()
    assert relative_error(out.float(), ref) <= _gpu_tol(dtype, q, k, v, L, causal, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [[1], [97, 3, 0, 40], [513, 64]])
@pytest.mark.parametrize("name", ["triton_flash_varlen", "cuda_flash_varlen"])
def test_gpu_varlen(name, lengths, causal, dtype):
    cu, max_seqlen = btlib.lengths_to_cu_seqlens(torch.tensor(lengths, device="cuda"))
    q, k, v = torch.randn(3, sum(lengths), 2, 64, device="cuda").to(dtype)
    out = btlib.varlen_attention(q, k, v, cu, max_seqlen, causal=causal, backend=name)
    ref = btlib.reference_varlen_attention(q, k, v, cu, max_seqlen, causal=causal)
    sdpa = get("torch_sdpa_loop").fn(q, k, v, cu, max_seqlen, causal=causal)
    tol = FP32_TOL if dtype == torch.float32 else _low_precision_tol(sdpa, ref)
    assert relative_error(out.float(), ref) <= tol


@pytest.mark.gpu
def test_gpu_strided_inputs_from_a_projection():
    """q.transpose(1, 2) of a (B, T, H, D) projection: head_dim contiguous, other strides arbitrary."""
    x = torch.randn(2, 50, 4, 3, 32, device="cuda", dtype=torch.float16)  # (B, T, H, qkv, D)
    q, k, v = (x[..., i, :].transpose(1, 2) for i in range(3))  # (B, H, T, D), not contiguous
    ref = btlib.reference_attention(q, k, v)
    for name in ("triton_flash", "cuda_flash"):
        out = btlib.attention(q, k, v, backend=name)
        assert relative_error(out.float(), ref) <= _gpu_tol(torch.float16, q, k, v, None, False, ref)


@pytest.mark.gpu
def test_gpu_cuda_binding_errors_say_what_to_do():
    build.load()
    q = torch.randn(1, 1, 4, 16, device="cuda")
    op = torch.ops.btlib_cuda
    with pytest.raises(RuntimeError, match="must be CUDA tensors"):
        op.attention_fwd(q.cpu(), q.cpu(), q.cpu(), None, False, 0.25)
    with pytest.raises(RuntimeError, match=r"head_dim must be in \[1, 128\]"):
        big = torch.randn(1, 1, 4, 256, device="cuda")
        op.attention_fwd(big, big, big, None, False, 0.25)
    with pytest.raises(RuntimeError, match="integer tensor"):
        op.attention_fwd(q, q, q, torch.tensor([4.0], device="cuda"), False, 0.25)
    with pytest.raises(RuntimeError, match="lengths must lie in"):
        op.attention_fwd(q, q, q, torch.tensor([5], device="cuda"), False, 0.25)
    with pytest.raises(RuntimeError, match="share one dtype"):
        op.attention_fwd(q, q.half(), q, None, False, 0.25)
    x = q[0].transpose(0, 1).contiguous()  # (4, 1, 16)
    with pytest.raises(RuntimeError, match="int32"):
        op.varlen_fwd(x, x, x, torch.tensor([0, 4], device="cuda"), 4, False, 0.25)
    with pytest.raises(RuntimeError, match="max_seqlen"):
        op.varlen_fwd(x, x, x, torch.tensor([0, 4], device="cuda", dtype=torch.int32), 2, False, 0.25)


@pytest.mark.gpu
def test_gpu_triton_matches_sdpa_flash_at_scale():
    q, k, v = torch.randn(3, 4, 8, 1024, 64, device="cuda", dtype=torch.float16)
    out = btlib.attention(q, k, v, causal=True, backend="triton_flash")
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = btlib.reference_attention(q, k, v, causal=True)
    assert relative_error(out.float(), ref) <= LOW_PRECISION_FACTOR * max(relative_error(sdpa.float(), ref), 1e-4)


if __name__ == "__main__" and "--interpret" in sys.argv:
    _interpret_worker()
