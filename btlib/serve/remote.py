"""``python -m btlib.serve`` in a process of its own, for benchmarks and tests, and what one request costs its client.

    with ServerProcess(max_queue=64, threads=2) as server:            # a free port of 127.0.0.1, ready on return
        with HttpEncoder(server.url) as client:                       # btlib.serve.client
            r = run_load(client.submit, texts, rate=200, duration_s=5)
            cost = client_cost(client, server)                        # CPU per request, client and server (GET /health)

A process of its own is how the server is deployed: its own interpreter and GIL, so its event loop and
tokenizing never wait on the load generator's threads. Leaving the ``with`` (also on an exception) stops
it with SIGTERM, kills it if it hangs, and reaps it, which frees the port.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

from .client import HttpEncoder
from .extras import missing

__all__ = ["ServerProcess", "client_cost", "http_missing", "HttpEncoder"]


def http_missing() -> str | None:
    """None if the HTTP server can run here (fastapi and uvicorn: the ``serve`` extra), else why not."""
    return missing("fastapi", "serve") or missing("uvicorn", "serve")


class ServerProcess:
    """``python -m btlib.serve`` on a free port of 127.0.0.1: started and ready (GET /health is 200) when this returns.

    The settings are the batcher's (see ``python -m btlib.serve --help``; ``args``: more of its flags); overlong
    inputs are truncated (``long_inputs``), as :meth:`BatchEncoder.submit` does by default. env: variables added to this process's for the server (e.g.
    BTLIB_GEMM). The server reads the same hardware cache (btlib.hardware), so it takes this process's GEMM
    paths once this machine's rates are cached; until then its first request measures them (~45 s on a busy
    2-core Xeon, whose time-boxed measurement is not cached). ``url``, ``port``, ``pid``; :meth:`stop` (or leaving the
    ``with``) sends SIGTERM (every accepted request is answered), kills after ``stop_timeout_s``, and reaps
    the process, which releases the port. A server that fails to start raises with its stderr's end.
    """

    def __init__(self, *, model: str | Path | None = None, max_batch_tokens: int = 512, max_wait_ms: float = 0.0,
                 max_queue: int = 64, threads: int | None = None, precision: str | None = None,
                 max_wait_s: float | None = None, worker_nice: int | None = None, env: dict[str, str] | None = None,
                 start_timeout_s: float = 180.0, stop_timeout_s: float = 30.0, long_inputs: str = "truncate",
                 args: Sequence[str] = ()):
        why = http_missing()
        if why:
            raise ImportError(why)
        cmd = [sys.executable, "-m", "btlib.serve", "--port", "0", "--max-batch-tokens", str(max_batch_tokens),
               "--max-wait-ms", str(max_wait_ms), "--max-queue", str(max_queue), "--max-inputs", str(min(max_queue, 256)),
               "--long-inputs", long_inputs, *args]
        cmd += ["--model", str(model)] if model else []
        cmd += ["--threads", str(threads)] if threads else []
        cmd += ["--precision", precision] if precision else []
        cmd += ["--max-wait-s", str(max_wait_s)] if max_wait_s is not None else []
        cmd += ["--worker-nice", str(worker_nice)] if worker_nice is not None else []
        here = str(Path(__file__).resolve().parents[2])  # the folder holding this btlib: the server runs the same code
        env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
        self.stop_timeout_s = stop_timeout_s
        self._log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.DEVNULL, text=True, env=env)
        self.pid = self.proc.pid
        try:
            self.url = self._address(start_timeout_s)
            self.port = int(self.url.rsplit(":", 1)[1])
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _address(self, timeout_s: float) -> str:
        """The URL from the server's first line ("btlib.serve: NAME on http://127.0.0.1:PORT"), printed once it listens."""
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.proc.stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"python -m btlib.serve printed no address within {timeout_s:.0f} s{self._stderr_tail()}") from None
        if "http://" not in line:
            raise RuntimeError(f"python -m btlib.serve did not start (exit code {self.proc.poll()}){self._stderr_tail()}")
        return line.split()[-1]

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"python -m btlib.serve exited with {self.proc.returncode}{self._stderr_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):  # not listening yet, or 503 while it starts
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{self.url}/health was not 200 within {timeout_s:.0f} s{self._stderr_tail()}")

    def _stderr_tail(self) -> str:
        self._log.seek(0)
        tail = self._log.read()[-2000:].strip()
        return f"; its stderr ends:\n{tail}" if tail else ""

    def cpu_s(self) -> float | None:
        """The server process's CPU time so far in s (user + system, Linux /proc), or None elsewhere."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)
        except (OSError, ValueError, IndexError):
            return None

    def rss_mb(self) -> tuple[float, float] | None:
        """(resident, peak resident) MiB of the server process (Linux /proc VmRSS, VmHWM), or None elsewhere."""
        try:
            with open(f"/proc/{self.pid}/status") as f:
                kb = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
            return int(kb["VmRSS"].split()[0]) / 1024, int(kb["VmHWM"].split()[0]) / 1024
        except (OSError, ValueError, KeyError):
            return None

    def stop(self) -> None:
        """SIGTERM, wait (every accepted request is answered), SIGKILL after ``stop_timeout_s``; reaped on return."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def client_cost(client: HttpEncoder, server: ServerProcess | None = None, n: int = 1000, warmup: int = 100) -> dict:
    """One GET /health at a time, ``n`` times: what a request costs without any model work.

    Returns wall_ms (per round trip: client, loopback and server), client_cpu_ms (this process's CPU time
    per request: the event loop, HTTP framing, the hand-over from the caller's thread) and, for a :class:`ServerProcess`
    on Linux, server_cpu_ms (uvicorn and FastAPI's share; /proc counts in 10 ms ticks, so n >= 1000).
    """
    for _ in range(warmup):
        client.get("/health")
    server_cpu = server.cpu_s() if server else None
    cpu, t0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        status = client.get("/health")
        if status != 200:
            raise RuntimeError(f"GET /health answered {status}")
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu
    out = {"wall_ms": wall / n * 1e3, "client_cpu_ms": cpu / n * 1e3}
    if server_cpu is not None and (after := server.cpu_s()) is not None:
        out["server_cpu_ms"] = (after - server_cpu) / n * 1e3
    return out
