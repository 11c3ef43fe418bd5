"""One long body against the server's limits: ``python tests/probe_chunk_body.py``.

Starts ``python -m btlib.serve`` (the default model, --threads 2) three ways and sends one text with
``"long_inputs": "chunk"`` to /embed while a second client sends one short query after another and a third polls
GET /health every 20 ms:

    default      a body at the payload limit (~2 MB, ~1M tokens) to a server started with the default (refuse)
    chunk        the same body to a server started with --long-inputs chunk (default --max-request-tokens)
    chunk, cap   a text of just under --max-request-tokens tokens to that server: the largest request it admits

Prints, per run: the status and how long the answer took, the largest forward in tokens (the batcher's
batch_tokens_max, GET /metrics), the server's resident and peak memory before and after (/proc VmRSS / VmHWM),
/health's p50 and worst latency during the request, and the other client's p50 and worst latency (its query
alone before is the baseline line). A server that lets the body in whole holds every chunk in one forward: ~23 KB of
activations per token on MiniLM.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx

from btlib.serve.guards import PAYLOAD_LIMIT
from btlib.serve.remote import ServerProcess
from btlib.serve.stats import percentile
from serve_helpers import run_line


WORDS = ("the", "of", "and", "to", "in", "is", "was", "for", "on", "are", "with", "as", "at", "by", "from")  # a token each


def text_of(words: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(words))


def body_text(limit: int) -> str:
    """Words of one token each, as many as fit a JSON body of ``limit`` bytes."""
    return text_of(limit // 3)[:limit - 100].rsplit(" ", 1)[0]


def largest_forward(url: str) -> float | None:
    """Tokens of the largest forward the server ran (its batch_tokens summary's quantile 1, GET /metrics)."""
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith('btlib_serve_batch_tokens{quantile="1"}'):
            return float(line.rsplit(" ", 1)[1])
    return None


def poll(url: str, path_body: tuple[str, dict | None], stop: threading.Event, out: list[float], every_s: float) -> None:
    """GET (body None) or POST ``path_body`` back to back (every ``every_s``) until ``stop``: latencies in ms."""
    path, body = path_body
    with httpx.Client(base_url=url, timeout=120) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = c.get(path) if body is None else c.post(path, json=body)
            r.raise_for_status()
            out.append((time.perf_counter() - t0) * 1e3)
            stop.wait(every_s)


def trial(server: ServerProcess, text: str) -> dict:
    query = ("/embed", {"inputs": "how fast is one short query?"})
    for _ in range(20):  # the server's first requests pay for its first use (kernels loaded, GEMM paths measured)
        httpx.post(server.url + query[0], json=query[1], timeout=300).raise_for_status()
    alone: list[float] = []
    stop = threading.Event()
    t = threading.Thread(target=poll, args=(server.url, query, stop, alone, 0.0))
    t.start()
    time.sleep(2.0)
    stop.set()
    t.join()
    before = server.rss_mb()
    health, other, stop = [], [], threading.Event()
    pollers = [threading.Thread(target=poll, args=(server.url, ("/health", None), stop, health, 0.02)),
               threading.Thread(target=poll, args=(server.url, query, stop, other, 0.0))]
    for p in pollers:
        p.start()
    time.sleep(0.5)
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/embed", content=json.dumps({"inputs": [text], "long_inputs": "chunk"}),
                   headers={"content-type": "application/json"}, timeout=1800)
    took = time.perf_counter() - t0
    time.sleep(0.5)
    stop.set()
    for p in pollers:
        p.join()
    after = server.rss_mb()
    return {"status": r.status_code, "answer_s": round(took, 2), "message": r.text[:160] if r.status_code != 200 else "",
            "largest_forward_tokens": largest_forward(server.url),
            "rss_mb_before": before, "rss_mb_after": after,
            "health_p50_ms": percentile(health, 50), "health_max_ms": max(health, default=None),
            "other_alone_p50_ms": percentile(alone, 50),
            "other_p50_ms": percentile(other, 50), "other_max_ms": max(other, default=None), "other_answers": len(other)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-request-tokens", type=int, default=None, help="the chunk server's cap (default: its own)")
    args = p.parse_args()
    big = body_text(PAYLOAD_LIMIT)
    cap = ["--max-request-tokens", str(args.max_request_tokens)] if args.max_request_tokens else []
    runs = [("default", "refuse", big), ("chunk", "chunk", big)]
    for name, mode, text in runs:
        with ServerProcess(threads=args.threads, max_queue=1024, long_inputs=mode, args=cap) as server:
            print(name, json.dumps(trial(server, text)), flush=True)
    with ServerProcess(threads=args.threads, max_queue=1024, long_inputs="chunk", args=cap) as server:
        limit = args.max_request_tokens or httpx.get(server.url + "/info", timeout=30).json()["max_request_tokens"]
        words = int(limit / 1.2)  # chunks repeat the special tokens and 1/8 of a window: ~1.15 tokens a word
        print("chunk, cap", json.dumps(trial(server, text_of(words))), flush=True)
    print(run_line(args.threads, 50.0))


if __name__ == "__main__":
    main()
