"""The torch-free kernel core (btlib/kernels/cpu/core_check.cpp) built and run outside torch.

core_check.cpp runs v1, v2, v3 and varlen (fp32, bf16) against a double-precision reference on
odd sizes, fully padded rows, causal on and off and NaN/inf inputs, and exits non-zero on any
mismatch. Here it is compiled for every ISA this CPU runs (the flags build.py uses) and, as the
only proof of the NEON build without an ARM machine, cross-compiled for aarch64 and run under
qemu-aarch64 (skipped, saying why, where the cross compiler or qemu is missing).

The builds are compiled and run side by side, two at a time (the fixture ``core_checks``, started by the first
test of this file): the qemu run, most of this file's time, first, the native builds beside it on the other core.
Each test waits for its own build's result and makes its own assertions.
"""

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from btlib.kernels.cpu import build

CHECK = build.HERE / "core_check.cpp"
FLAGS = ["-O2", "-std=c++17", "-pthread", *(f"-I{d}" for d in build.include_dirs())]  # the families include core.h by name
HAS_CXX = shutil.which(build._compiler()) is not None
HAS_CROSS = shutil.which("aarch64-linux-gnu-g++") is not None
HAS_QEMU = shutil.which("qemu-aarch64") is not None
# -O3, as build.py compiles the kernels: the run under qemu is most of this file's time, and -O3's code runs it in
# 57 s instead of -O2's 75 s on a 2-core AMD EPYC (the cross compile takes 0.7 s longer)
NEON = ("aarch64-linux-gnu-g++", ["-O3", "-static"], ["qemu-aarch64"])


def _compile_and_run(cxx: str, flags: list[str], out, runner: list[str] | None = None) -> str:
    exe = out / "core_check"
    r = subprocess.run([cxx, *FLAGS, *flags, str(CHECK), "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([*(runner or []), str(exe)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-1000:]
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def core_checks(request, tmp_path_factory):
    """{"neon" or an ISA: the future of its _compile_and_run}, for every build a selected test of this file needs
    and this machine can make; a future's result() is the summary line, or raises _compile_and_run's
    AssertionError (the compiler's or the run's output)."""
    wanted = {item.callspec.params["isa"] if hasattr(item, "callspec") else "neon"
              for item in request.session.items if getattr(item, "module", None) is request.module}
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = {}
        if "neon" in wanted and HAS_CROSS and HAS_QEMU:
            cxx, flags, runner = NEON
            jobs["neon"] = pool.submit(_compile_and_run, cxx, flags, tmp_path_factory.mktemp("neon"), runner)
        if HAS_CXX:
            for isa in build.runnable():
                if isa in wanted:
                    jobs[isa] = pool.submit(_compile_and_run, build._compiler(), build.isa_flags(isa),
                                            tmp_path_factory.mktemp(isa))
        yield jobs


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler on PATH")
@pytest.mark.parametrize("isa", build.runnable())
def test_core_on_this_cpu(isa, core_checks):
    summary = core_checks[isa].result()
    assert summary.startswith(f"core_check {'avx512' if isa.startswith('avx512') else isa} ")
    assert summary.endswith(" 0 failures")


@pytest.mark.skipif(not HAS_CROSS,
                    reason="no aarch64-linux-gnu-g++ (apt-get install g++-aarch64-linux-gnu): the NEON build is not checked")
@pytest.mark.skipif(not HAS_QEMU,
                    reason="no qemu-aarch64 (apt-get install qemu-user): the NEON build is not checked")
def test_core_neon_under_qemu(core_checks):
    summary = core_checks["neon"].result()
    assert summary.startswith("core_check neon W=4 ")
    assert summary.endswith(" 0 failures")
