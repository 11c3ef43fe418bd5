"""The torch-free kernel core (btlib/kernels/cpu/core_check.cpp) built and run outside torch.

core_check.cpp runs v1, v2, v3 and varlen (fp32, bf16) against a double-precision reference on
odd sizes, fully padded rows, causal on and off and NaN/inf inputs, and exits non-zero on any
mismatch. Here it is compiled for every ISA this CPU runs (the flags build.py uses) and, as the
only proof of the NEON build without an ARM machine, cross-compiled for aarch64 and run under
qemu-aarch64 (skipped, saying why, where the cross compiler or qemu is missing).
"""

import shutil
import subprocess

import pytest

from btlib.kernels.cpu import build

CHECK = build.HERE / "core_check.cpp"
FLAGS = ["-O2", "-std=c++17", "-pthread", *(f"-I{d}" for d in build.include_dirs())]  # the families include core.h by name


def _compile_and_run(cxx: str, flags: list[str], out, runner: list[str] | None = None) -> str:
    exe = out / "core_check"
    r = subprocess.run([cxx, *FLAGS, *flags, str(CHECK), "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([*(runner or []), str(exe)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-1000:]
    return r.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(shutil.which(build._compiler()) is None, reason="no C++ compiler on PATH")
@pytest.mark.parametrize("isa", build.runnable())
def test_core_on_this_cpu(isa, tmp_path):
    summary = _compile_and_run(build._compiler(), build.isa_flags(isa), tmp_path)
    assert summary.startswith(f"core_check {'avx512' if isa.startswith('avx512') else isa} ")
    assert summary.endswith(" 0 failures")


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None,
                    reason="no aarch64-linux-gnu-g++ (apt-get install g++-aarch64-linux-gnu): the NEON build is not checked")
@pytest.mark.skipif(shutil.which("qemu-aarch64") is None,
                    reason="no qemu-aarch64 (apt-get install qemu-user): the NEON build is not checked")
def test_core_neon_under_qemu(tmp_path):
    # -O3, as build.py compiles the kernels: the run under qemu is most of this test, and -O3's code runs it in
    # 57 s instead of -O2's 75 s on a 2-core AMD EPYC (the cross compile takes 0.7 s longer)
    summary = _compile_and_run("aarch64-linux-gnu-g++", ["-O3", "-static"], tmp_path, runner=["qemu-aarch64"])
    assert summary.startswith("core_check neon W=4 ")
    assert summary.endswith(" 0 failures")
