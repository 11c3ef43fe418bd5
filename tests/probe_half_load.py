"""Latency at light load, side by side: ``python tests/probe_half_load.py [--rates-queries 192,256 --rates-mixed 16,48]``.

Each server of notebook 09's comparison (btlib.bench.serve_load.make_batcher: one worker behind ``submit``), in this one
process, on the same Poisson arrivals of one text each (btlib.serve.load.run_load): btlib's packed batcher with a
2 ms fill wait and without one (the default), the TEI-style ONNX Runtime padded batcher (<= 8 per batch) and ONNX
Runtime one request per forward. Each rate runs every server twice, the second round in reverse order (ABBA), after a
0.5 s warm-up of the same server; every trial offers at least ``--requests`` (500: p99 is measured). Prints p50 / p99
in ms, refusals and the process's CPU time over the trial in cores (what keeping threads warm costs). The default
rates are half of notebook 09's measured maximum for the packed batcher (256 short queries/s, 48 mixed) and for the
TEI-style batcher (192, 16), so every server runs at each one's half load.
The packed batchers keep their OpenMP threads spinning ``--keep-warm-ms`` after each batch (BatchEncoder's
keep_warm_ms, default 50; 0 lets them sleep: the cost of waking them shows). That spin ends with the batcher, so
the ONNX Runtime trials that follow do not share the cores with it. A ``GOMP_SPINCOUNT`` set for the process would:
compare ONNX Runtime's rows from a run without it.
"""

from __future__ import annotations

import argparse
import time

import torch

from btlib.bench.serve_load import LABELS, _backend, _model, make_batcher, why_not_available
from btlib.serve.load import run_load, workload
from serve_helpers import run_line


def make(method: str, keep_warm_ms: float):
    if method.startswith("packed_wait_"):
        return make_batcher("packed_fp32", max_wait_ms=float(method.removeprefix("packed_wait_")), keep_warm_ms=keep_warm_ms)
    return make_batcher(method)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates-queries", default="192,256")
    p.add_argument("--rates-mixed", default="16,48")
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep-warm-ms", type=float, default=50.0,
                   help="the packed batchers' keep_warm_ms (default 50, BatchEncoder's; 0: their threads sleep when idle)")
    p.add_argument("--methods", default="", help="a comma-separated subset of: packed_wait_2, packed_wait_0, "
                   "tei_ort_padded, ort_per_request (default: all that run here)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    methods = ["packed_wait_2", "packed_wait_0"]
    if why_not_available("tei_ort_padded") is None:
        methods += ["tei_ort_padded", "ort_per_request"]
        _backend("ort")
    if args.methods:
        unknown = set(args.methods.split(",")) - set(methods)
        if unknown:
            p.error(f"--methods: {sorted(unknown)} not among those that run here: {methods}")
        methods = args.methods.split(",")
    _model()
    texts = {"queries": workload("queries", 512, seed=1), "mixed": workload("mixed", 512, seed=1)}
    rates = {"queries": args.rates_queries, "mixed": args.rates_mixed}
    for wl, rs in rates.items():
        for rate in (float(r) for r in rs.split(",")):
            for rnd in range(2):
                for m in methods if rnd == 0 else methods[::-1]:
                    b = make(m, args.keep_warm_ms)
                    run_load(b.submit, texts[wl], rate, 0.5, seed=9)  # warm-up: first batches of each size
                    cpu0, wall0 = time.process_time(), time.perf_counter()
                    r = run_load(b.submit, texts[wl], rate, 1.0, seed=2 + rnd, min_requests=args.requests)
                    cores = (time.process_time() - cpu0) / (time.perf_counter() - wall0)  # the process's CPU over the trial
                    b.close()
                    label = LABELS.get(m, f"packed batcher fp32, max_wait_ms={m.removeprefix('packed_wait_')}")
                    print(f"{wl:8s} {rate:5.0f} req/s  {label:45s} p50 {r['p50_ms']:7.1f}  p99 {r['p99_ms']:7.1f} ms"
                          f"  refused {r['refused']}  lost {r['lost']}  CPU {cores:4.2f} cores", flush=True)
    print(run_line(args.threads, args.keep_warm_ms))


if __name__ == "__main__":
    main()
