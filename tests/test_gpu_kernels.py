"""btlib's GPU kernels, proven as far as a machine without a GPU allows, and checked for real on one.

Correctness against the reference, with or without a GPU (Triton's interpreter, the CUDA
emulator), is the registry's check: tests/test_kernel_check.py. Here, what is GPU-specific:
- the Triton kernel compiles for sm_75 (T4), sm_80 (A100), sm_90 (H100) and fits their shared memory;
- the CUDA kernel (flash_attn.cu) compiles with nvcc for the same targets, and binding.cpp
  type-checks against torch's headers;
- the registry lists all four kernels and never picks them for CPU tensors;
- with a GPU: strided inputs, the binding's errors, agreement with SDPA's flash kernel at scale.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import btlib
from btlib.kernels import get, kernels, relative_error
from btlib.kernels.cuda import build, emulate
from btlib.kernels.registry import EXACT, LOW_PRECISION_FACTOR

# The ops modules register triton_flash* and cuda_flash*, which these tests reach through the registry and bench.
TESTED_HERE = ["btlib.kernels.triton", "btlib.kernels.triton.ops", "btlib.kernels.cuda.ops", "btlib.bench.gpu_attention"]

GPU_KERNELS = ("triton_flash", "triton_flash_varlen", "cuda_flash", "cuda_flash_varlen")


def test_triton_on_cpu_tensors_without_interpreter_says_how():
    pytest.importorskip("triton")
    from btlib.kernels.triton.flash_attn import flash_attention, interpreted

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
    from btlib.kernels.triton.flash_attn import interpreted
    from btlib.kernels.triton.targets import compile_for

    if interpreted():
        pytest.skip("TRITON_INTERPRET=1 is set for this test process: the interpreter replaces the compiler")
    padded = compile_for(capability, torch.float16, 64, varlen=False, causal=True)
    varlen = compile_for(capability, torch.bfloat16, 128, varlen=True, causal=False)
    windowed = compile_for(capability, torch.bfloat16, 64, varlen=True, causal=False, window=True)  # ModernBERT's local layers
    alibi = compile_for(capability, torch.float16, 64, varlen=True, causal=False, bias=1)  # JinaBERT
    table = compile_for(capability, torch.bfloat16, 64, varlen=True, causal=False, window=True, bias=2)  # MPNet, + a window
    for c in (padded, varlen, windowed, alibi, table):
        assert c.cubin_bytes > 0 and c.fits, str(c)
        # Triton 3.9 emits tensor-core instructions (mma) for sm_80 and sm_90, none for sm_75 (FMA only).
        assert c.tensor_cores == (capability >= 80), str(c)


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")
def test_triton_largest_tile_fits_a_t4():
    pytest.importorskip("triton")
    from btlib.kernels.triton.flash_attn import interpreted
    from btlib.kernels.triton.targets import compile_for

    if interpreted():
        pytest.skip("TRITON_INTERPRET=1 is set for this test process")
    c = compile_for(75, torch.float32, 128, varlen=False, causal=False)  # 4-byte elements, the widest head
    assert c.fits, str(c)


@pytest.fixture(scope="module")
def cuda_compiles(request, tmp_path_factory):
    """The two single-threaded compiles below, started together (one per core) by the first of their tests to run:
    {"nvcc": (report, seconds, object file), "binding": seconds}, as futures (result() raises what the call raised).
    Only a compile whose test is selected starts."""
    from concurrent.futures import ThreadPoolExecutor

    wanted = {item.originalname for item in request.session.items if getattr(item, "module", None) is request.module}
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = {}
        if "test_cuda_kernel_compiles_with_nvcc" in wanted and build.nvcc() is not None:
            obj = tmp_path_factory.mktemp("nvcc") / "flash_attn.o"
            jobs["nvcc"] = pool.submit(lambda: (*build.nvcc_compile((75, 80, 90), obj, verbose=True), obj))
        if "test_binding_type_checks_against_torch_headers" in wanted and emulate.cuda_include_dir() is not None:
            jobs["binding"] = pool.submit(build.binding_syntax_check)
        yield jobs


@pytest.mark.skipif(build.nvcc() is None, reason="nvcc not found: the CUDA compile check needs the CUDA toolkit")
def test_cuda_kernel_compiles_with_nvcc(cuda_compiles):
    report, seconds, obj = cuda_compiles["nvcc"].result()
    assert obj.stat().st_size > 0
    smem = [int(s) for s in re.findall(r"(\d+) bytes smem", report)]
    assert len(smem) >= 27, report  # 3 archs x 3 dtypes x 3 head-dim buckets
    assert max(smem) <= 48 * 1024, "static shared memory above the 48 KiB a block may declare"
    for arch in (75, 80, 90):
        assert f"sm_{arch}" in report


@pytest.mark.skipif(emulate.cuda_include_dir() is None, reason="no CUDA headers: binding.cpp needs cuda_runtime_api.h")
def test_binding_type_checks_against_torch_headers(cuda_compiles):
    cuda_compiles["binding"].result()


# ------------------------------------------------------------------------------------------------
# Registry: listed, CUDA-only, say why not here, cheap to import.
# ------------------------------------------------------------------------------------------------
def test_gpu_kernels_registered_cuda_only():
    names = {k.name: k for k in kernels()}
    assert set(GPU_KERNELS) <= set(names)
    for name in GPU_KERNELS:
        k = names[name]
        ref = btlib.reference_attention if k.layout == "padded" else btlib.reference_varlen_attention
        assert k.devices == ("cuda",) and k.reference is ref and k.cpu_run is not None
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
def _gpu_tol(dtype, q, k, v, L, causal, ref):
    sdpa_error = None if dtype in EXACT else relative_error(get("torch_sdpa").fn(q, k, v, lengths=L, causal=causal).float(), ref)
    return get("triton_flash").tolerance(dtype, sdpa_error)


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
        op.varlen_fwd(x, x, x, torch.tensor([0, 4], device="cuda", dtype=torch.int32), -1, False, 0.25)


@pytest.mark.gpu
def test_gpu_triton_matches_sdpa_flash_at_scale():
    q, k, v = torch.randn(3, 4, 8, 1024, 64, device="cuda", dtype=torch.float16)
    out = btlib.attention(q, k, v, causal=True, backend="triton_flash")
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = btlib.reference_attention(q, k, v, causal=True)
    assert relative_error(out.float(), ref) <= LOW_PRECISION_FACTOR * max(relative_error(sdpa.float(), ref), 1e-4)




@pytest.mark.gpu
@pytest.mark.parametrize("name", ["triton_flash_varlen", "cuda_flash_varlen"])
def test_gpu_window_on_packed_documents(name):
    """ModernBERT's local layers: window (64, 64) on packed documents longer than a tile, against the reference."""
    lengths = torch.tensor([700, 64, 1, 300], device="cuda")
    cu, max_seqlen = btlib.lengths_to_cu_seqlens(lengths)
    q, k, v = torch.randn(3, int(lengths.sum()), 4, 64, device="cuda", dtype=torch.float16)
    for causal in (False, True):
        out = btlib.varlen_attention(q, k, v, cu, max_seqlen, causal=causal, window=(64, 64), backend=name)
        ref = btlib.reference_varlen_attention(q, k, v, cu, max_seqlen, causal=causal, window=(64, 64))
        sdpa = get("torch_sdpa_loop").fn(q, k, v, cu, max_seqlen, causal=causal, scale=None, window=(64, 64))
        assert relative_error(out.float(), ref) <= LOW_PRECISION_FACTOR * max(relative_error(sdpa.float(), ref), 1e-4)
