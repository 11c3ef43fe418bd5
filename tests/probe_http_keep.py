"""What the HTTP server keeps of the in-process rate, float JSON and base64: ``python tests/probe_http_keep.py``.

The same closed-loop load three ways, in rounds ABCCBA (in process, float, base64, base64, float, in process):
``--clients`` callers (16) each keep one request of ``--texts`` short queries (8) in flight for ``--seconds`` (6) a
trial, after a discarded 2 s warm-up trial. In process: one :class:`btlib.serve.BatchEncoder` (the server's settings)
and 16 threads calling ``encode``. Over HTTP: ``python -m btlib.serve`` (``--threads`` 2) on loopback, and
:class:`btlib.serve.client.HttpEncoder` posting /v1/embeddings with ``encoding_format`` "float" (JSON numbers) or
"base64" (the float32 bytes: the ``openai`` client's default). Prints requests per second per trial, each HTTP
format's median rate over the in-process median ("keeps"), and the CPU one request costs the client process and the
server process (Linux /proc). The client runs on the same cores as the server, as a benchmark on one machine does:
its CPU is taken from the server's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

import btlib
from btlib.serve import BatchEncoder
from btlib.serve.client import HttpEncoder
from btlib.serve.load import workload
from btlib.serve.remote import ServerProcess


def closed_loop(submit, batches: list[list[str]], clients: int, seconds: float) -> int:
    """Requests answered in ``seconds`` with ``clients`` requests in flight (each answer sends the next)."""
    end, done, lock, idle = time.perf_counter() + seconds, [0], threading.Lock(), threading.Semaphore(0)

    def send(i: int) -> None:
        f = submit(batches[i % len(batches)])
        f.add_done_callback(lambda f, i=i: after(f, i))

    def after(f, i: int) -> None:
        f.result()  # a failed request ends the probe: nothing here may be refused
        with lock:
            done[0] += 1
        if time.perf_counter() < end:
            send(i + clients)
        else:
            idle.release()

    for c in range(clients):
        send(c)
    for _ in range(clients):
        idle.acquire()
    return done[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--texts", type=int, default=8)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    queries = workload("queries", 512, seed=1)
    batches = [queries[i:i + args.texts] for i in range(0, len(queries) - args.texts + 1, args.texts)]
    local = BatchEncoder(btlib.load_pretrained(), max_queue=1024)
    rates: dict[str, list[float]] = {"in process": [], "float": [], "base64": []}
    cpu: dict[str, list[tuple[float, float]]] = {"float": [], "base64": []}
    with ServerProcess(threads=args.threads, max_queue=1024) as server:
        clients = {fmt: HttpEncoder(server.url, encoding_format=fmt) for fmt in ("float", "base64")}
        for name in rates:  # warm-up: the server's first batches of each size, the client's connections
            closed_loop(local.submit if name == "in process" else clients[name].submit, batches, args.clients, 2.0)
        for name in ("in process", "float", "base64", "base64", "float", "in process"):
            submit = local.submit if name == "in process" else clients[name].submit
            c0, s0, t0 = time.process_time(), server.cpu_s(), time.perf_counter()
            n = closed_loop(submit, batches, args.clients, args.seconds)
            wall, c1, s1 = time.perf_counter() - t0, time.process_time(), server.cpu_s()
            rates[name].append(n / wall)
            line = f"{name:10s} {n / wall:7.1f} requests/s ({n} requests of {args.texts} texts in {wall:.1f} s)"
            if name != "in process" and s0 is not None and s1 is not None:
                cpu[name].append(((c1 - c0) / n * 1e3, (s1 - s0) / n * 1e3))
                line += f"; CPU per request: client {cpu[name][-1][0]:.2f} ms, server {cpu[name][-1][1]:.2f} ms"
            print(line, flush=True)
        for c in clients.values():
            c.close()
    local.close()
    base = statistics.median(rates["in process"])
    for fmt in ("float", "base64"):
        print(f"{fmt:7s} keeps {statistics.median(rates[fmt]) / base:.2f} of the in-process rate "
              f"({statistics.median(rates[fmt]):.1f} vs {base:.1f} requests/s; medians of 2 trials)")
    cpu_name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"CPU: {cpu_name}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} threads, "
          f"{args.clients} clients x {args.texts} texts")


if __name__ == "__main__":
    main()
