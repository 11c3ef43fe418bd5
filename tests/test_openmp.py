"""btlib.openmp.release_caller_pool: the calling thread's OpenMP pool threads exit, and a later region makes a new pool."""

import os
import threading
import time

import pytest
import torch

from btlib import openmp

pytestmark = pytest.mark.skipif(openmp.runtime_path() is None or not os.path.isdir("/proc/self/task"),
                                reason="needs Linux and torch on GNU OpenMP (libgomp)")


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def _settle(want: int, timeout_s: float = 5.0) -> int:
    """The process's thread count once it equals ``want`` (released pool threads exit asynchronously), or as it is
    after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while (n := _tasks()) != want and time.monotonic() < end:
        time.sleep(0.01)
    return n


def test_release_caller_pool_ends_the_pool_threads_and_a_new_region_makes_them_again():
    if torch.get_num_threads() < 2:
        pytest.skip("one torch thread: no OpenMP pool to release")
    a = torch.randn(512, 512)
    out: dict = {}

    def run():  # a thread of its own, so that its pool is the only one this test makes or releases
        x = torch.ones(1 << 22)
        (x * 2).sum()  # a parallel region in this thread: its pool starts (get_num_threads() - 1 pool threads)
        out["with_pool"] = _settle(_tasks())
        out["released"] = openmp.release_caller_pool()
        out["after_release"] = _settle(out["with_pool"] - (torch.get_num_threads() - 1))
        out["product"] = a @ a  # computes as before; a new pool
        out["after_again"] = _settle(out["with_pool"])

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert out["released"] is True
    assert out["after_release"] == out["with_pool"] - (torch.get_num_threads() - 1)
    assert out["after_again"] == out["with_pool"]
    torch.testing.assert_close(out["product"], a @ a, rtol=0, atol=0)


def test_release_without_a_pool_succeeds():
    # twice in a row: the second call finds no pool to release, and the runtime still answers 0
    assert openmp.release_caller_pool() is True
    assert openmp.release_caller_pool() is True
