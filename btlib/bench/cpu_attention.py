"""The matmul yardsticks notebook 04 holds btlib's C++ kernels against (their benchmarks sit in the kernels'
folders: cpu_attention_versions in btlib/kernels/cpu/teaching/bench.py, attention_dense_bf16 in
btlib/kernels/cpu/flash/bench.py; the shared ones in attention.py).

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
from .core import time_fn

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
