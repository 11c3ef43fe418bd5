"""btlib.openmp.release_caller_pool: the calling thread's OpenMP pool threads exit, and a later region makes a new pool.

The thread counting runs in a fresh process: in a test session other tests' threads (servers, clients, Ray) start and
stop at any time, and an earlier test's torch.set_num_threads decides how many threads a new thread's regions use."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from btlib import openmp

pytestmark = pytest.mark.skipif(openmp.runtime_path() is None or not os.path.isdir("/proc/self/task"),
                                reason="needs Linux and torch on GNU OpenMP (libgomp)")

SCRIPT = textwrap.dedent("""\
    import json, os, threading, time
    import torch
    from btlib import openmp

    torch.set_num_threads(2)

    def tids():
        return {int(t) for t in os.listdir("/proc/self/task")}

    def until(cond, timeout_s=10.0):  # released pool threads exit asynchronously
        end = time.monotonic() + timeout_s
        while not cond() and time.monotonic() < end:
            time.sleep(0.01)
        return cond()

    a, out = torch.randn(512, 512), {}

    def run():  # a thread of its own, as a batcher's caller: its pool is the one released
        before = tids()
        (torch.ones(1 << 22) * 2).sum()  # a parallel region in this thread: its pool's threads start
        pool = tids() - before
        out["pool"] = len(pool)
        out["released"] = openmp.release_caller_pool()
        out["gone"] = until(lambda: not (pool & tids()))
        out["equal"] = torch.equal(a @ a, a @ a)  # computes as before, on a new pool
        out["again"] = len(tids() - before - pool)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    print(json.dumps(out))
""")


def test_release_caller_pool_ends_the_pool_threads_and_a_new_region_makes_them_again():
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["pool"] >= 1, out  # 2 threads: the region started one pool thread beside the caller
    assert out["released"] is True and out["gone"], out
    assert out["equal"] and out["again"] >= 1, out


def test_release_without_a_pool_succeeds():
    # twice in a row: the second call finds no pool to release, and the runtime still answers 0
    assert openmp.release_caller_pool() is True
    assert openmp.release_caller_pool() is True
