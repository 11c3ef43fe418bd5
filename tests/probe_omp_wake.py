"""How long a tiny 2-thread op takes after the process was idle: ``python tests/probe_omp_wake.py``.

libgomp's threads spin for a while after a parallel region (GOMP_SPINCOUNT, OMP_WAIT_POLICY), then sleep; the next
region wakes them, and on a virtual machine waking a sleeping thread can mean waiting for its vCPU to be scheduled
again. This times ``torch.exp`` of 65,536 floats on 2 threads after sleeping 0, 5, 20 and 60 ms (40 times each) and
prints p50 / p90 and the process's CPU time, so runs under different settings compare (libgomp reads its variables
when torch loads, so set them on the command line: ``GOMP_SPINCOUNT=3000000 python tests/probe_omp_wake.py``).
Then the 60 ms gaps again with btlib.openmp.KeepWarm ticking through them, as BatchEncoder's idle worker does.
docs/serving.md cites what it printed on a 2-core AMD EPYC VM.
"""

import os
import time

import torch

from btlib.openmp import KeepWarm


def main() -> None:
    torch.set_num_threads(2)
    x = torch.randn(65536)
    for _ in range(50):
        torch.exp(x)
    out = []
    for gap in (0.0, 0.005, 0.02, 0.06):
        ts = []
        for _ in range(40):
            time.sleep(gap)
            t = time.perf_counter()
            torch.exp(x)
            ts.append((time.perf_counter() - t) * 1e6)
        ts.sort()
        out.append(f"after {gap * 1e3:2.0f} ms idle: p50 {ts[20]:6.0f} us, p90 {ts[36]:6.0f} us")
    cpu_sleeping = time.process_time()
    # The same 60 ms gaps with btlib.openmp.KeepWarm ticking through them (BatchEncoder's idle worker does this)
    warm, ts = KeepWarm(0.1), []
    for _ in range(40):
        warm.touch()
        end = time.perf_counter() + 0.06
        while (left := end - time.perf_counter()) > 0:
            time.sleep(min(left, warm.next_wait()))
            warm.tick()
        t = time.perf_counter()
        torch.exp(x)
        ts.append((time.perf_counter() - t) * 1e6)
    ts.sort()
    out.append(f"after 60 ms idle, KeepWarm ticking every {KeepWarm.TICK_S * 1e3:g} ms: p50 {ts[20]:6.0f} us, "
               f"p90 {ts[36]:6.0f} us (CPU {time.process_time() - cpu_sleeping:.2f} s over 2.4 s)")
    print(f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '(unset)')} "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, torch {torch.__version__}, 2 threads")
    print("\n".join(out))
    print(f"process CPU time over the sleeping gaps: {cpu_sleeping:.2f} s")


if __name__ == "__main__":
    main()
