"""Initialise MKL's vector math (VML) once, serially, when btlib is imported.

PyTorch's x86 wheels compute ``torch.exp`` (and log, tanh, erf, ... on contiguous float tensors) with MKL's
VML routines, split over the intra-op threads. The first such call in a process initialises VML, and when that
first call runs on two threads at once the initialisation races: measured with torch 2.13.0+cpu on an Intel Xeon
(AVX-512, 2 threads), in 13 of 200 fresh processes (three runs) the first large
``torch.exp`` computed one thread's half of the tensor at ~5e-5 relative error instead of ~6e-8, and every later
call was right. btlib's reference attention (``torch.exp`` of the scores) inherited that error whenever it was
the process's first exp: a notebook cell comparing SDPA with it printed False once in CI.

One call on a tensor too small to be split (it runs on the calling thread alone) initialises VML before any
parallel call can race: in 160 fresh processes after such a call (an exp or a log), and in 100 after ``import btlib``, none was wrong. It changes no
setting and costs microseconds.
"""

from __future__ import annotations

import torch


def initialise() -> None:
    """One serial VML call per dtype btlib computes in (fp32, fp64)."""
    for dtype in (torch.float32, torch.float64):
        torch.exp(torch.zeros(8, dtype=dtype))


initialise()
