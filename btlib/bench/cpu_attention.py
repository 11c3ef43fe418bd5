"""Benchmarks of btlib's C++ CPU kernels (notebook 04), beside the shared ones in attention.py.

- ``cpu_attention_versions``: v1, v2, v3 side by side with the naive reference and SDPA, time
  against T on a small batch (v1 and v2 are plain scalar loops, tens of times slower than v3).
- ``attention_dense_bf16``: v3 on bfloat16 inputs against SDPA in bfloat16. The check is
  btlib's low-precision rule (Kernel.tolerance): the error against the fp32 reference, divided by twice SDPA's
  own bf16 error, must be <= 1.
- :func:`matmul_peak`: this machine's matmul GFLOP/s through torch.mm (PyTorch's BLAS: oneMKL in the x86
  wheels), the yardstick each row's ``of_bound`` is held against.
- :func:`onednn_matmul`: the same product through oneDNN, in a fresh process, with the instruction set
  oneDNN chose (or was capped to) named: a BLAS rate is one library's code path, not the CPU's ceiling.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import torch

from .. import _torch_private as tp
from ..kernels import get, kernels, relative_error
from ..reference import reference_attention
from .attention import attn_bytes, attn_flops, dense_qkv
from .core import Benchmark, Provider, declare, time_fn

__all__ = ["matmul_peak", "onednn_matmul"]


def matmul_peak(n: int = 1024, threads: int | None = None, dtype: torch.dtype = torch.float32, rounds: int = 3) -> float:
    """GFLOP/s of an (n x n) @ (n x n) matmul (PyTorch's BLAS): the best of ``rounds`` medians."""
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        ms = min(statistics.median(time_fn(lambda: a @ b, warmup=3, min_runs=10, min_time_s=0.5)) for _ in range(rounds))
    finally:
        torch.set_num_threads(old)
    return 2.0 * n**3 / (ms * 1e-3) / 1e9


_ONEDNN = """
import json, statistics, sys, torch
from btlib._torch_private import mkldnn_linear
from btlib.bench.core import time_fn
n, rounds = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(int(sys.argv[3]))
a, b = torch.randn(n, n).to_mkldnn(), torch.randn(n, n).to_mkldnn()
run = lambda: mkldnn_linear(a, b)  # a @ b^T in oneDNN's blocked layout, no conversion per call
with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
    run()  # prints oneDNN's info lines, among them "cpu,isa:<the code path it dispatched to>"
ms = min(statistics.median(time_fn(run, warmup=3, min_runs=10, min_time_s=0.5)) for _ in range(rounds))
print(json.dumps({"gflops": 2 * n**3 / (ms * 1e-3) / 1e9}))
"""


def onednn_matmul(threads: int = 1, max_isa: str | None = None, n: int = 1024, rounds: int = 3) -> tuple[float, str]:
    """(GFLOP/s, ISA) of an (n x n) @ (n x n) fp32 matmul through oneDNN (torch's mkldnn ops): best of ``rounds`` medians.

    Runs in a fresh Python process (~3 s), since oneDNN picks its code path once per process from the CPU's
    features, capped by ONEDNN_MAX_CPU_ISA (``max_isa``, e.g. "AVX2"); the ISA returned is the name
    oneDNN prints for it (e.g. "Intel AVX-512 with ..."). Raises RuntimeError where PyTorch has no oneDNN.
    """
    if not torch.backends.mkldnn.is_available():
        raise RuntimeError("this PyTorch has no oneDNN (torch.backends.mkldnn.is_available() is False)")
    if (why := tp.missing("mkldnn_linear")) is not None:
        raise RuntimeError(why)
    env = {**os.environ, **({"ONEDNN_MAX_CPU_ISA": max_isa} if max_isa else {})}
    r = subprocess.run([sys.executable, "-c", _ONEDNN, str(n), str(rounds), str(threads)], capture_output=True, text=True,
                       env=env, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"oneDNN matmul failed: {r.stderr.strip().splitlines()[-1:] or r.returncode}")
    isa = next((line.split("isa:", 1)[1].strip() for line in r.stdout.splitlines() if ",isa:" in line), "unknown")
    return json.loads(r.stdout.strip().splitlines()[-1])["gflops"], isa


_VERSIONS = ("reference", "cpu_naive_v1", "cpu_tiled_v2", "cpu_flash_v3", "torch_sdpa")


def _padded_provider(name: str) -> Provider:
    k = get(name)
    return Provider(name, lambda x: k.fn(x["q"], x["k"], x["v"], lengths=None, causal=False, scale=None),
                    available=k.available, label=k.description)


def _version_providers() -> list[Provider]:
    names = {k.name for k in kernels("padded")}
    return [_padded_provider(n) for n in _VERSIONS if n in names]


declare(Benchmark(
    name="cpu_attention_versions",
    description="C++ v1 (materialise), v2 (tiled, two passes), v3 (online softmax, SIMD) vs reference and SDPA, fp32",
    x_name="T", x_vals=(128, 256, 512, 1024),
    providers=_version_providers,
    make_inputs=dense_qkv,
    reference=lambda x: reference_attention(x["q"], x["k"], x["v"]),
    error=lambda out, ref, x: relative_error(out, ref),
    tol=1e-5,
    params={"B": 2, "H": 4, "D": 64},
    quick={"B": 1, "H": 2, "D": 32, "x_vals": (64, 97)},
    flops=attn_flops, bytes=attn_bytes, baseline="torch_sdpa",
))


def _bf16_inputs(p: dict) -> dict:
    x = dense_qkv(p)
    return {**x, "bf16": [x[n].bfloat16() for n in ("q", "k", "v")]}


def _bf16_reference(x: dict) -> dict:
    ref = reference_attention(x["q"], x["k"], x["v"])
    sdpa_err = relative_error(get("torch_sdpa").fn(*x["bf16"]).float(), ref)
    return {"ref": ref, "sdpa_err": sdpa_err}


def _bf16_providers() -> list[Provider]:
    names = [k.name for k in kernels("padded") if torch.bfloat16 in k.dtypes and k.name in ("cpu_flash_v3", "torch_sdpa")]
    return [Provider(n, lambda x, k=get(n): k.fn(*x["bf16"], lengths=None, causal=False, scale=None),
                     available=get(n).available, label=get(n).description, precision="bf16") for n in names]


declare(Benchmark(
    name="attention_dense_bf16",
    description="bfloat16 attention on (B, H, T, D): C++ v3 (fp32 sums) vs SDPA; error in units of 2x SDPA's bf16 error",
    x_name="T", x_vals=(128, 256, 512, 1024),
    providers=_bf16_providers,
    make_inputs=_bf16_inputs,
    reference=_bf16_reference,
    error=lambda out, ref, x: relative_error(out.float(), ref["ref"]) / get("cpu_flash_v3").tolerance(torch.bfloat16, ref["sdpa_err"]),
    tol=1.0,
    params={"B": 8, "H": 12, "D": 64},
    quick={"B": 2, "H": 2, "D": 32, "x_vals": (32, 97)},
    flops=attn_flops, bytes=lambda p: attn_bytes({**p, "dtype": torch.bfloat16}), baseline="torch_sdpa",
))
