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

A pool that has slept costs a wake. After its spin, a pool thread sleeps on a futex, and the next region cannot end
until that thread runs again; on a virtual machine that means its vCPU being scheduled again. A 2-thread
``torch.exp`` of 65,536 floats took 23 us back to back and 7.8 ms after 60 ms of idle (AMD EPYC Zen 5, 2-core
Firecracker VM: ``python tests/probe_omp_wake.py``), and a server at light load meets exactly that: most requests
find it idle. :class:`KeepWarm` is the in-process cure: while a thread waits for work it calls :meth:`KeepWarm.tick`
every 2 ms for a bounded time after its last forward, and each tick runs one tiny region on every pool thread, so none
reaches its sleep (the same op after 60 ms of ticking: 63 us; the process spent 2.44 s of CPU over 2.4 s of such
gaps: one core, spinning). That is the price, as with ``GOMP_SPINCOUNT``, but bounded in time and per thread, and
ONNX Runtime's intra-op threads spin by default too. :class:`btlib.serve.BatchEncoder` ticks for ``keep_warm_ms``
(50) after each batch.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time

import torch

__all__ = ["runtime_path", "release_caller_pool", "lower_priority", "KeepWarm"]

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


def lower_priority(nice: int | None) -> None:
    """Give the calling thread the nice value ``nice`` (0-19; None or 0: leave it) before it starts its OpenMP pool,
    whose threads inherit it (Linux sets nice per thread). Never a reason to fail: where the OS refuses, the thread
    runs as it was."""
    if nice and hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError:
            pass


def release_caller_pool() -> bool:
    """Release the calling thread's OpenMP pool (libgomp only; see the module docstring). True if released, False
    where the runtime is not libgomp or has no ``omp_pause_resource_all``, or when called inside a parallel region."""
    fn = _pause()
    return fn is not None and fn(OMP_PAUSE_HARD) == 0



class KeepWarm:
    """Keeps the calling thread's OpenMP pool spinning for ``window_s`` after each :meth:`touch`.

        warm = KeepWarm(0.05)               # in the thread that runs the forwards
        ... forward ...; warm.touch()       # after each one
        while idle: wait(warm.next_wait(timeout)); warm.tick()   # tick() runs a region only while the window is open

    Each :meth:`tick` inside the window runs ``torch.neg`` in place on ``threads x 32,768`` floats: at::parallel_for
    splits work into chunks of 32,768 elements, so every pool thread gets one chunk (~10-80 us on 2 threads). It must be
    called from the thread that runs the forwards: libgomp's pools belong to the thread that starts the regions.
    ``TICK_S`` (2 ms) is well inside libgomp's default spin (300,000 spins: ~5 ms on an AMD EPYC Zen 4, where 3,000,000
    spun ~50 ms); where the process has more OpenMP threads than CPUs libgomp spins only 100 times and the ticks cannot
    help (:func:`release_caller_pool`). window_s 0 (or one torch thread: no pool) turns it off."""

    TICK_S = 0.002

    def __init__(self, window_s: float):
        if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not window_s >= 0:
            raise ValueError(f"keep-warm window must be a number of seconds >= 0; got {window_s!r}")
        self.window_s = float(window_s)
        self._until = 0.0
        self._x = None

    def touch(self) -> None:
        """A forward just ended: keep the pool warm for the next ``window_s``."""
        self._until = time.perf_counter() + self.window_s

    def next_wait(self) -> float | None:
        """How long to wait for work before the next :meth:`tick` (seconds), or None: the window is closed, wait for
        work without a timeout."""
        left = self._until - time.perf_counter()
        return min(left, self.TICK_S) if left > 0 else None  # window 0: touch() leaves _until in the past

    def tick(self) -> None:
        """One tiny parallel region on every thread of this thread's pool, if the window is still open."""
        if self._until <= time.perf_counter():
            return
        threads = torch.get_num_threads()
        if threads < 2:
            return
        if self._x is None or self._x.numel() != threads * 32768:
            self._x = torch.zeros(threads * 32768)
        torch.neg(self._x, out=self._x)
