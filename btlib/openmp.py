"""One OpenMP team per process: why a worker thread that runs torch can be half as fast as the main thread, and the fix.

    import btlib.openmp
    btlib.openmp.release_caller_pool()   # in the thread that ran torch before; a worker thread runs it from now on

torch's CPU build runs its parallel loops (at::parallel_for, oneDNN, MKL, btlib's kernels) on GNU OpenMP (libgomp).
libgomp keeps one pool of threads per thread that has started a parallel region, and a thread waiting at a region's
end spins before it sleeps: about 300,000 spins (a few ms) while the process has no more OpenMP threads than CPUs,
but only 100 once it has more (libgomp's "throttled" spin, its GOMP_SPINCOUNT / OMP_WAIT_POLICY documentation).
A forward pass of a small batch is a hundred short parallel regions, so the difference is a futex sleep and wake per
region. A server has exactly that shape: the model is loaded and warmed in the main thread (its pool: one thread at
2 torch threads), then a worker thread runs every forward (a second pool). On 2 CPUs that is three OpenMP threads
for two CPUs, throttled for good: MiniLM on one 12-token query took 7.35 ms per call from a worker thread against
3.28 ms from the main thread, and 3.31 ms from the worker once the main thread's pool was released (AMD EPYC Zen 4,
2 cores, torch 2.13.0+cpu; medians of 300 calls).

:func:`release_caller_pool` releases the calling thread's pool with OpenMP 5.0's ``omp_pause_resource_all(
omp_pause_hard)``, which libgomp implements for the calling thread alone: its pool threads exit and the process's count
of OpenMP threads drops. Nothing else changes: a later parallel region in that thread starts a new pool (a thread
start, tens of microseconds), and the counts rise again. :class:`btlib.serve.BatchEncoder` calls it when it starts its
worker. Other OpenMP runtimes (LLVM's libomp, Intel's libiomp5) do not throttle by count, and their hard pause shuts
the whole runtime down: there this does nothing and says so (False).
"""

from __future__ import annotations

import ctypes
import functools
import os

__all__ = ["runtime_path", "release_caller_pool"]

OMP_PAUSE_HARD = 2  # omp_pause_resource_t's omp_pause_hard (OpenMP 5.0)


@functools.lru_cache(maxsize=1)
def runtime_path() -> str | None:
    """Path of the GNU OpenMP runtime (libgomp) this process has loaded, or None (another runtime, none, not Linux)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libgomp" in line}
    except OSError:
        return None
    return min(paths) if paths else None


@functools.lru_cache(maxsize=1)
def _pause():
    path = runtime_path()
    if path is None:
        return None
    try:  # RTLD_NOLOAD: the library already in the process, never a second copy
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | getattr(os, "RTLD_GLOBAL", 0))
        fn = lib.omp_pause_resource_all
    except (OSError, AttributeError):  # a libgomp older than GCC 9 has no omp_pause_resource_all
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def release_caller_pool() -> bool:
    """Release the calling thread's OpenMP pool (libgomp only; see the module docstring). True if released, False
    where the runtime is not libgomp or has no ``omp_pause_resource_all``, or when called inside a parallel region."""
    fn = _pause()
    return fn is not None and fn(OMP_PAUSE_HARD) == 0

