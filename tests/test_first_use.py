"""Issue 49 (3): first use from many threads at once loads, registers and builds each extension exactly once.

Each run is a fresh process (a test process has loaded the extensions already, so a race there proves nothing):
tests/probe_first_use.py's script, whose threads meet at a barrier and then use the C++ attention kernels, gemm.cpp
and int8.cpp, each thread starting at another. The probe itself runs 20 processes per thread count; here a few.
"""

import shutil

import pytest

from probe_first_use import prebuild, run_once

TESTED_HERE = ["btlib.kernels._build", "btlib.kernels.cpu.schema"]

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: nothing is built on first use")


@pytest.fixture(scope="module")
def built():
    prebuild()  # once, in a process of its own: the runs below then load from the cache (~2 s each, no compile)


@pytest.mark.parametrize("threads, runs", [(4, 3), (8, 2)])
def test_first_use_from_threads_in_fresh_processes(built, threads, runs):
    """Was: "Tried to register an operator (btlib_cpu_<isa>::attention_v1 ...) with the same name and overload name
    multiple times" from schema.define, in every run of 5 at 4 threads on an AMD EPYC Zen 3 (avx2 build)."""
    for _ in range(runs):
        assert run_once(threads) == []
