"""Every registered kernel, on every device and dtype it supports, through the one check.

A kernel that registers itself gets its rows here with no test code: btlib.kernels.check runs
its cases (T = 1, 97, a sequence of length 0, batch 1, causal on and off) against the kernel's
own reference and tolerance. GPU kernels get two more rows per dtype without a GPU, on CPU
tensors: Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is imported, and
must not leak into other tests, so those rows run in one subprocess) and the CUDA kernel's
source on CPU threads (emulate.py). Rows for a device this machine lacks skip and say why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from btlib.kernels import check, kernels

# torch_ops registers the reference and torch_sdpa* kernels that kernels() yields here.
TESTED_HERE = ["btlib.kernels.torch_ops"]

DTYPE = {str(d).replace("torch.", ""): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def _rows():
    rows = []
    for k in kernels():
        for dtype in k.dtypes:
            dt = str(dtype).replace("torch.", "")
            for device in k.devices:
                marks = [pytest.mark.gpu] if device == "cuda" else []
                rows.append(pytest.param(k, device, dtype, "native", id=f"{k.name}-{device}-{dt}", marks=marks))
            if k.cpu_run is not None:
                rows.append(pytest.param(k, "cpu", dtype, k.cpu_run.how, id=f"{k.name}-{k.cpu_run.how}-{dt}"))
    return rows


def _interpret_worker() -> None:
    """With TRITON_INTERPRET=1: every interpretable kernel's check on CPU tensors, as one JSON line.

    The interpreter is slow (~1 s a case): fp32 runs every window of the check, fp16/bf16 one
    (the window's loop bounds and masks are the same code for every dtype).
    """
    results = {}
    for k in kernels():
        if k.cpu_run is not None and k.cpu_run.how == "interpreter":
            for dtype in k.dtypes:
                r = check(k, "cpu", dtype, windows=None if dtype == torch.float32 or not k.window else [(3, 5)])
                results[f"{k.name}-{dtype}"] = dict(ok=r.ok, text=str(r), shapes=len(r.shapes))
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, __file__, "--interpret"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


@pytest.mark.parametrize("kernel, device, dtype, how", _rows())
def test_kernel_matches_its_reference(kernel, device, dtype, how, request):
    if how == "native":
        if device == "cuda" and not torch.cuda.is_available():
            pytest.skip("no CUDA GPU here")
        if why := kernel.available():
            pytest.skip(why)
        r = check(kernel, device, dtype)
    else:
        if why := kernel.cpu_run.available():
            pytest.skip(why)
        if how == "interpreter":
            r = request.getfixturevalue("interpreted")[f"{kernel.name}-{dtype}"]
            assert r["ok"] and r["shapes"] > 0, r["text"]
            return
        r = check(kernel, device, dtype, fn=kernel.cpu_run.fn)
    assert r.ok and r.shapes, str(r)


if __name__ == "__main__" and "--interpret" in sys.argv:
    _interpret_worker()
