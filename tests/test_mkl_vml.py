"""torch.exp is right from the first call in a process that imported btlib (btlib/_mkl_vml.py).

The race it guards against is in MKL's lazy VML initialisation: without btlib's serial first call, the first
parallel ``torch.exp`` of a fresh process computed one thread's half at ~5e-5 relative error in 13 of 200 runs
(torch 2.13.0+cpu, Intel Xeon, 2 threads). A fresh process per check: only a process's first call can race,
so a check inside pytest's process (which has long since called exp) would prove nothing. Four fresh processes
would catch a regression about a quarter of the time; the in-process check below runs every time.
"""

from __future__ import annotations

import subprocess
import sys

import torch

import btlib._mkl_vml
from btlib.kernels import relative_error

TESTED_HERE = ["btlib._mkl_vml"]

# The sequence that raced: a GEMM (MKL's threads are up), then the reference's scores - row max, then exp.
FIRST_EXP = """
import math, sys, torch
import btlib
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
q, k = (torch.randn(2, 4, 97, 32, generator=g) for _ in range(2))
s = torch.matmul(q, k.transpose(-2, -1)) * (1 / math.sqrt(32))
x = s - s.amax(-1, keepdim=True)
y = torch.exp(x)
exact = torch.exp(x.double())
print(((y.double() - exact).abs() / exact).max().item())
"""


def test_the_first_parallel_exp_after_import_is_accurate():
    for _ in range(4):
        run = subprocess.run([sys.executable, "-c", FIRST_EXP], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert float(run.stdout.strip()) < 2e-6  # the race's half-wrong tensor was ~5e-5; fp32 exp is ~6e-8


def test_initialise_is_a_serial_call_that_changes_no_setting():
    threads = torch.get_num_threads()
    btlib._mkl_vml.initialise()
    assert torch.get_num_threads() == threads
    x = torch.linspace(-20, 0, 5000)
    assert relative_error(torch.exp(x).double(), torch.exp(x.double())) < 1e-6
