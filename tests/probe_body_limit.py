"""/health's latency and the server's memory while 49 MB bodies are sent to it: ``python tests/probe_body_limit.py``.

Starts ``python -m btlib.serve`` (the default model, an API key, its default 2 MB payload limit) on a free loopback port,
then for ``--seconds``: one client sends 49 MB bodies to POST /embed with the key, one after another (Content-Length
declared, as any HTTP client sends them; ``--chunked`` sends them chunked instead), while another asks GET /health
every 20 ms and times each answer. Prints /health's latency (median, p99, max), how the big requests were answered,
and the server's resident memory before and after (VmRSS, VmHWM from /proc). Before btlib.serve.guards, a 49 MB body
was read whole and tokenized on the event loop: /health waited 40 s and the process grew by 2.5 GB.

``--pythonpath DIR`` runs another checkout's btlib (a worktree of an older commit) for a before / after.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

KEY = "probe-key"


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of ``pid`` in MiB (Linux)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                out[line.split(":")[0]] = int(line.split()[1]) // 1024
    return out


def _body(size: int) -> bytes:
    """A JSON body of about ``size`` bytes (made once: building 49 MB in the loop held the probe's GIL for tens of ms,
    which its /health timer then counted as the server's latency)."""
    return b'{"inputs": "' + b"w " * ((size - 20) // 2) + b'"}'


def _big_request(host: str, port: int, body: bytes, chunked: bool) -> str:
    """Send one JSON body; the status line answered, or what stopped it."""
    head = (b"POST /embed HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nAuthorization: Bearer "
            + KEY.encode() + b"\r\n")
    head += b"Transfer-Encoding: chunked\r\n\r\n" if chunked else b"Content-Length: %d\r\n\r\n" % len(body)
    try:
        with socket.create_connection((host, port), timeout=120) as s:
            s.sendall(head)
            if not chunked:  # a declared length past the limit is answered at once: read it before sending the body
                s.settimeout(0.5)
                try:
                    if answer := s.recv(4096):
                        return answer.split(b"\r\n", 1)[0].decode() + " before the body was sent"
                except TimeoutError:
                    pass
                s.settimeout(120)
            step, view = 1 << 20, memoryview(body)
            for i in range(0, len(body), step):
                part = view[i:i + step]
                if chunked:
                    s.sendall(b"%x\r\n" % len(part))
                s.sendall(part)
                if chunked:
                    s.sendall(b"\r\n")
            if chunked:
                s.sendall(b"0\r\n\r\n")
            return s.recv(4096).split(b"\r\n", 1)[0].decode() or "closed without an answer"
    except (BrokenPipeError, ConnectionResetError) as e:  # the server answered early and closed: read what it said
        return f"{type(e).__name__} while sending (the server closed the connection)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--size-mb", type=float, default=49)
    p.add_argument("--chunked", action="store_true")
    p.add_argument("--pythonpath", default=None, help="a checkout whose btlib to run (default: this one)")
    args = p.parse_args(argv)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath
    proc = subprocess.Popen([sys.executable, "-m", "btlib.serve", "--port", "0", "--api-key", KEY, "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=args.pythonpath)  # python -m puts the working folder first on sys.path
    try:
        line = proc.stdout.readline()
        if "http://" not in line:
            print(line + proc.stdout.read(), file=sys.stderr)
            return 1
        host, port = line.split("http://")[1].split()[0].rsplit(":", 1)
        port = int(port)
        import httpx

        with httpx.Client(base_url=f"http://{host}:{port}", timeout=120) as c:
            assert c.get("/health").status_code == 200
            before = _status(proc.pid)
            stop, answers, health = threading.Event(), [], []

            body = _body(int(args.size_mb * 1e6))

            def sender():
                while not stop.is_set():
                    answers.append(_big_request(host, port, body, args.chunked))

            t = threading.Thread(target=sender, daemon=True)
            t.start()
            end = time.monotonic() + args.seconds
            while time.monotonic() < end:
                t0 = time.perf_counter()
                c.get("/health")
                health.append((time.perf_counter() - t0) * 1e3)
                time.sleep(0.02)
            stop.set()
            t.join(180)
            after = _status(proc.pid)
        p99 = sorted(health)[max(0, math.ceil(0.99 * len(health)) - 1)]  # nearest rank: a latency that happened
        kinds = {a: answers.count(a) for a in dict.fromkeys(answers)}
        print(f"btlib from {args.pythonpath or 'this checkout'}, {args.size_mb:g} MB bodies "
              f"({'chunked' if args.chunked else 'Content-Length'}), {args.seconds:g} s")
        print(f"big requests: {len(answers)}: " + ", ".join(f"{n} x {a!r}" for a, n in kinds.items()))
        print(f"/health: {len(health)} answers, median {statistics.median(health):.1f} ms, p99 {p99:.1f} ms, "
              f"max {max(health):.1f} ms")
        print(f"server memory: VmRSS {before['VmRSS']} -> {after['VmRSS']} MiB, peak (VmHWM) {after['VmHWM']} MiB")
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
