"""First use of every lazily built extension from many threads at once, each run in a fresh process.

    python tests/probe_first_use.py [--runs 20] [--threads 4 8]
    -> "4 threads: 20 runs, 0 errors" per thread count, then the first error seen (if any)

A fresh process has loaded nothing: its threads meet at a barrier, then each calls the C++ attention kernels (padded
v1 / v2 / v3 and varlen, one library and one op namespace), btlib.gemm's "btlib" path (gemm.cpp) and Int8Linear
(int8.cpp), each thread starting at another of them, so one extension is asked for by several threads and different
extensions load at the same moment. A run is an error when a call raises, a result is off its reference, or a
library was made or an op namespace defined more than once. The extensions are built first (in a process of their
own), so a run costs its imports and loads, ~2 s, not a compile. tests/test_first_use.py runs a few of these.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

RACE = r"""
import json, sys, threading
import torch
import btlib
from btlib import gemm
from btlib.kernels.cpu import build, schema
from btlib.quant_linear import Int8Linear

N = int(sys.argv[1])
torch.manual_seed(0)
q = torch.randn(9, 2, 16)                                    # (total, H, D), lengths [2, 4, 3]
cu = torch.tensor([0, 2, 6, 9], dtype=torch.int32)
qp = torch.randn(2, 2, 5, 16)                                # (B, H, T, D)
x, W = torch.randn(3, 16), torch.randn(8, 16)
int8 = Int8Linear(W, None)

def off(out, ref):
    return float((out - ref).abs().max() / ref.abs().max())

def varlen():
    return off(btlib.varlen_attention(q, q, q, cu, 4, backend="cpu_flash_varlen"),
               btlib.varlen_attention(q, q, q, cu, 4, backend="reference_varlen"))

def padded(name):
    def call():
        return off(btlib.attention(qp, qp, qp, backend=name), btlib.attention(qp, qp, qp, backend="reference"))
    call.__name__ = name
    return call

def gemm_cpp():
    return off(gemm.linear(x, W, path="btlib"), torch.nn.functional.linear(x, W))

def int8_cpp():
    with torch.inference_mode():
        return off(int8(x, path="int_mm"), int8._forward_torch(x, None)) if build.int8_available() is None else 0.0

CALLS = [varlen, padded("cpu_flash_v3"), gemm_cpp, padded("cpu_naive_v1"), int8_cpp, padded("cpu_tiled_v2")]
barrier, errors = threading.Barrier(N), []

def first_use(i):
    barrier.wait()
    for call in CALLS[i % len(CALLS):] + CALLS[:i % len(CALLS)]:
        try:
            worst = call()
            if not worst <= 1e-4:
                errors.append(f"{call.__name__}: off its reference by {worst:.2e}")
        except Exception as e:
            errors.append(f"{call.__name__}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")

threads = [threading.Thread(target=first_use, args=(i,)) for i in range(N)]
for t in threads: t.start()
for t in threads: t.join()
made = {name: n for ext in (build._ext, build._gemm, build._int8) for name, n in ext.attempts.items()}
errors += [f"{name} made {n} times" for name, n in made.items() if n != 1]
errors += [f"{len(schema._libraries)} op namespaces defined: {sorted(schema._libraries)}"] * (len(schema._libraries) != 1)
print(json.dumps({"errors": errors, "made": made}))
"""


def prebuild() -> None:
    """Build (or load from the cache) every extension the race uses, in a process of its own."""
    subprocess.run([sys.executable, "-c", RACE, "1"], check=True, capture_output=True, timeout=1200, env=_env())


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                        "build", "torch_extensions"))
    env["BTLIB_ATTENTION_CHOICE"] = "priority"  # the race is about loading; "auto" is never asked here anyway
    return env


def run_once(threads: int) -> list[str]:
    """The errors of one fresh process whose ``threads`` threads use every extension first at once ([]: none)."""
    r = subprocess.run([sys.executable, "-c", RACE, str(threads)], capture_output=True, text=True, timeout=300, env=_env())
    if r.returncode != 0:
        return [f"exit {r.returncode}: " + (r.stderr.strip().splitlines() or ["(no stderr)"])[-1][:300]]
    return json.loads(r.stdout.strip().splitlines()[-1])["errors"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--threads", type=int, nargs="+", default=[4, 8])
    args = p.parse_args()
    prebuild()
    first = None
    for n in args.threads:
        failed = 0
        for _ in range(args.runs):
            errors = run_once(n)
            failed += bool(errors)
            first = first or (errors and errors[0])
        print(f"{n} threads: {args.runs} runs, {failed} errors", flush=True)
    if first:
        print(f"first error: {first}")


if __name__ == "__main__":
    main()
