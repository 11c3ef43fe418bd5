"""429 latency and goodput at 2x overload with backpressure by expected wait: ``python tests/probe_overload.py``.

Starts ``python -m btlib.serve`` (the default model, ``--threads 2``, ``--max-wait-s``) on a free loopback port and
offers Poisson arrivals of one text each (btlib.serve.load.workload "mixed") through btlib.serve.client.HttpEncoder:
probes at 100, 200 and 300 requests/s for 4 s find the peak goodput (answers per second), then 10 s at twice the peak.
Prints, per run, what was offered, answered, refused (429) and lost (must be 0), the goodput, the refusal latency
from the scheduled arrival (the generator's lag counts against the server) and from the send (``sent_refusal_*``),
the generator's own lag (``client_lag_p99_ms``), and the answers' latency, p50 and p99.

Measured (AMD EPYC Zen 4, 2 cores shared by the server's 2 torch threads, its event loop and this client;
--max-wait-s 0.25), two runs each, in turn: with the server's defaults (--worker-nice 10, gc.freeze at start) peak
212 / 179 req/s; at 2x, 0 lost, goodput 0.98 / 1.11 of peak, refusal p50 0.9 ms, p99 5.3 / 5.1 ms (4.9 / 4.9 from
the send). With --worker-nice 0: refusal p99 14.1 / 10.0 ms (11.6 / 9.3 from the send). Before gc.freeze, full
collections of the objects made at start stopped the server's event loop for 87-114 ms each: the refusal p99 was
88-105 ms (the probe now freezes its own objects too, for the same reason).
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from concurrent.futures import wait

from btlib.serve import Overloaded
from btlib.serve.client import HttpEncoder
from btlib.serve.load import poisson_arrivals, workload
from btlib.serve.remote import ServerProcess
from btlib.serve.stats import percentile


def offer(client: HttpEncoder, texts: list[str], rate: float, duration_s: float) -> dict:
    """Offer ``rate`` requests/s for ``duration_s``; counts, goodput and the latencies of answers and refusals (ms)."""
    arrivals = poisson_arrivals(rate, duration_s, seed=1)
    refusal_ms, answer_ms, futures = [], [], []
    start = time.perf_counter()

    sent_ms, lag_ms = [], []

    def done(f, a, sent):
        now = time.perf_counter()
        if isinstance(f.exception(), Overloaded):
            refusal_ms.append((now - start - a) * 1e3)
            sent_ms.append((now - sent) * 1e3)
        elif f.exception() is None:
            answer_ms.append((now - start - a) * 1e3)

    for i, a in enumerate(arrivals):
        if (ahead := a - (time.perf_counter() - start)) > 0:
            time.sleep(ahead)
        sent = time.perf_counter()
        lag_ms.append((sent - start - a) * 1e3)
        f = client.submit([texts[i % len(texts)]])
        f.add_done_callback(lambda f, a=a, sent=sent: done(f, a, sent))
        futures.append(f)
    wait(futures, timeout=120)
    elapsed = time.perf_counter() - start
    ms = lambda v: None if v is None else round(v, 1)  # noqa: E731
    return dict(rate=round(rate, 1), offered=len(futures), answered=len(answer_ms), refused=len(refusal_ms),
                lost=sum(1 for f in futures if not f.done()), goodput=round(len(answer_ms) / elapsed, 1),
                refusal_p50_ms=ms(percentile(refusal_ms, 50)), refusal_p99_ms=ms(percentile(refusal_ms, 99)),
                sent_refusal_p50_ms=ms(percentile(sent_ms, 50)), sent_refusal_p99_ms=ms(percentile(sent_ms, 99)),
                client_lag_p99_ms=ms(percentile(lag_ms, 99)),
                answer_p50_ms=ms(percentile(answer_ms, 50)), answer_p99_ms=ms(percentile(answer_ms, 99)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-wait-s", type=float, default=0.25)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--worker-nice", type=int, default=None, help="the server's --worker-nice (default: the server's, 10)")
    args = p.parse_args()
    texts = workload("mixed", 512)
    with ServerProcess(threads=args.threads, max_queue=1024, max_wait_s=args.max_wait_s, worker_nice=args.worker_nice) as server:
        client = HttpEncoder(server.url)
        offer(client, texts, 50, 2)  # warm up: the batcher measures its first rate
        gc.collect()
        gc.freeze()  # as the server does: a full collection here would stall the generator (its lag counts against the server)
        probes = [offer(client, texts, rate, 4) for rate in (100, 200, 300)]  # past capacity the server is busy throughout
        for r in probes:
            print("probe", r)
        peak = max(r["goodput"] for r in probes)
        r = offer(client, texts, 2 * peak, 10)
        print(f"peak {peak:.0f} req/s; 2x overload, --max-wait-s {args.max_wait_s}:", r, f"goodput / peak {r['goodput'] / peak:.2f}")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
