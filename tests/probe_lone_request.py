"""One request at a time, back to back or after an idle gap: ``python tests/probe_lone_request.py [--gap-ms 60]``.

At light load a request mostly finds the server idle and runs alone. This sends notebook 09's mixed texts one at a
time (waiting for each answer, then ``--gap-ms`` of idle) to btlib's packed batcher and to ONNX Runtime one request per
forward (btlib.bench.serve_load.make_batcher: one worker behind ``submit``), two rounds in ABBA order, and prints
each round's median latency and its forward's (the batcher's ``inference_s``). Back to back it compares the forwards; after a gap it adds what waking up costs (on a
VM, libgomp's sleeping threads: docs/serving.md, ``tests/probe_omp_wake.py``), which the packed batcher's
keep-warm window (``--keep-warm-ms``, BatchEncoder's keep_warm_ms: 50 by default, 0 off) spares a request arriving
within it. ORT runs only where onnxruntime is installed (the compare extra).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from btlib.bench.serve_load import _backend, _model, make_batcher, why_not_available
from btlib.serve.load import workload
from serve_helpers import run_line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gap-ms", type=float, default=0.0, help="idle time before each request (default 0: back to back)")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep-warm-ms", type=float, default=50.0, help="the packed batcher's keep_warm_ms (0: off)")
    p.add_argument("--evict-mb", type=float, default=0.0,
                   help="before each request, after the gap, write a buffer of this many MB (numpy, this thread): the "
                        "caches then hold none of the model, as after other work (default 0: not done)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    methods = ["packed_fp32"]
    if why_not_available("ort_per_request") is None:
        methods.append("ort_per_request")
        _backend("ort")
    _model()
    texts = workload("mixed", max(args.requests, 10), seed=1)[: args.requests]
    junk = np.zeros(int(args.evict_mb * 2**20), np.uint8) if args.evict_mb > 0 else None  # numpy: no OpenMP pool here
    evicted = f" and {args.evict_mb:g} MB written" if junk is not None else ""
    for rnd in range(2):
        for m in methods if rnd == 0 else methods[::-1]:
            b = make_batcher(m, keep_warm_ms=args.keep_warm_ms)
            for t in texts[:10]:  # warm-up
                b.submit([t]).result()
            ts, forward = [], []
            for t in texts:
                time.sleep(args.gap_ms / 1e3)
                if junk is not None:
                    junk += 1
                t0 = time.perf_counter()
                f = b.submit([t])
                f.result()
                ts.append((time.perf_counter() - t0) * 1e3)
                forward.append(f.inference_s * 1e3)
            b.close()
            print(f"round {rnd + 1}  {m:16s} after {args.gap_ms:3.0f} ms idle{evicted}: p50 {statistics.median(ts):6.2f} ms"
                  f" (its forward {statistics.median(forward):5.2f} ms; {len(ts)} requests)", flush=True)
    print(run_line(args.threads, args.keep_warm_ms))


if __name__ == "__main__":
    main()
