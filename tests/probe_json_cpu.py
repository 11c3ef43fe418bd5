"""Server CPU per /v1/embeddings request of 8 texts (8 x 384 floats), orjson against json.dumps:
``python tests/probe_json_cpu.py``.

One server process (this one: btlib.serve's app on a thread, torch at 2 threads), its model's forward stubbed with fixed
rows so the process's CPU time is the server's own (HTTP, parsing, tokenizing, batching, writing the answer); a client
subprocess sends ``N`` keep-alive requests per round; rounds alternate the two writers (btlib.serve.bodies.orjson set
or None), in ABBA order. Prints the median server CPU per request of each.

Measured (AMD EPYC, 2 cores shared with the client, N=1000, 6 rounds each), two runs: json 2.69 / 2.87 ms, orjson
0.90 / 1.25 ms per request.
"""

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_folder import FOLDER  # noqa: E402

import btlib  # noqa: E402
from btlib.serve import BatchEncoder, bodies  # noqa: E402
from btlib.serve.app import create_app, start_server  # noqa: E402

N, ROUNDS = int(os.environ.get("N", 1000)), int(os.environ.get("ROUNDS", 6))
CLIENT = """
import httpx, sys
body = {"input": ["text number %d about packing" % i for i in range(8)]}
with httpx.Client(base_url=sys.argv[1]) as c:
    for _ in range(int(sys.argv[2])):
        r = c.post("/v1/embeddings", json=body)
        assert r.status_code == 200 and len(r.json()["data"]) == 8
"""


class Stub:
    """The model with its forward replaced by fixed rows: what remains is the server's work."""

    def __init__(self, model):
        self._m, self.rows = model, torch.nn.functional.normalize(torch.randn(64, 384), dim=-1)

    def __getattr__(self, name):
        return getattr(self._m, name)

    def encode(self, texts, **kw):
        return self.rows[:len(texts)].clone()


def main() -> None:
    torch.set_num_threads(2)
    batcher = BatchEncoder(Stub(btlib.load_pretrained(FOLDER)), max_wait_ms=0)
    server = start_server(create_app(batcher))
    fast, cpu_ms = bodies.orjson, {"json": [], "orjson": []}
    for rnd in range(ROUNDS):
        for name in ("json", "orjson") if rnd % 2 == 0 else ("orjson", "json"):
            bodies.orjson = fast if name == "orjson" else None
            c0 = time.process_time()
            subprocess.run([sys.executable, "-c", CLIENT, server.url, str(N)], check=True)
            cpu_ms[name].append((time.process_time() - c0) / N * 1e3)
    server.stop()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} cores; {N} requests per round")
    for name, v in cpu_ms.items():
        print(f"{name:7s} server CPU per request: median {statistics.median(v):.3f} ms, rounds {[round(x, 3) for x in v]}")


if __name__ == "__main__":
    main()
