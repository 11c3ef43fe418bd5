"""The HTTP path as a submit() server: HttpEncoder answers what the batcher answers, a 429 is Overloaded, no server outlives its run."""

import os
import socket
import threading
import time

import pytest
import torch

from btlib.serve import BatchEncoder, Overloaded
from btlib.serve.load import run_load, workload
from btlib.serve.remote import http_missing
from model_folder import needs_model

pytestmark = [needs_model, pytest.mark.skipif(http_missing() is not None, reason=str(http_missing()))]


def _gone(pid: int, port: int) -> bool:
    """The process is reaped (no such pid) and nothing listens on its port."""
    try:
        os.kill(pid, 0)
        return False
    except ProcessLookupError:
        pass
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.slow
def test_server_process_answers_as_the_batcher_and_is_gone_after_a_failed_run(model):
    """python -m btlib.serve in its own process: 8 texts in one request and 3 alone equal the in-process answers (another
    process may take another GEMM path, whose last bits differ: 1e-6); the client's cost is measured; an exception
    inside the ``with`` still stops and reaps the server, and the port is free."""
    from btlib.serve.client import HttpEncoder
    from btlib.serve.remote import ServerProcess, client_cost

    texts = workload("mixed", 8, seed=1)
    with BatchEncoder(model) as b:
        ref = b.encode(texts, timeout=60)
    with pytest.raises(KeyboardInterrupt):
        with ServerProcess(max_queue=16, env={"BTLIB_GEMM": "torch"}) as server:  # no GEMM measurement in it
            pid, port = server.pid, server.port
            with HttpEncoder(server.url) as client:
                got = client.encode(texts, timeout=60)
                singles = [client.encode([t], timeout=60) for t in texts[:3]]
                cost = client_cost(client, server, n=50, warmup=5)
                r = run_load(client.submit, texts, rate=50, duration_s=0.4)
            raise KeyboardInterrupt  # a run stopped by Ctrl-C halfway
    assert got.shape == (8, 384) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    for t, s in zip(texts, singles):
        torch.testing.assert_close(s, model.encode([t]), atol=1e-6, rtol=0)
    assert 0 < cost["client_cpu_ms"] < 5 * cost["wall_ms"]
    assert cost["wall_ms"] < 20  # ~1.5 ms; 44 ms when Nagle met delayed ACKs (app.bind's socket without IPPROTO_TCP)
    assert r["answered"] == r["offered"] > 0 and r["refused"] == r["errors"] == r["lost"] == 0
    assert server.proc.returncode is not None and _gone(pid, port)


def test_a_full_queue_comes_back_as_overloaded_through_http(model):
    """A gated model holds the worker, 4 requests fill the queue (max_queue=4): the 5th's future raises Overloaded with
    the server's Retry-After, and run_load counts such a refusal as the in-process one."""
    from btlib.serve.app import create_app, start_server
    from btlib.serve.client import HttpEncoder
    from test_serve_batcher import Recorder

    gate = threading.Event()
    rec = Recorder(model, gate)
    batcher = BatchEncoder(rec, max_queue=4, max_wait_ms=0)
    running = start_server(create_app(batcher, max_inputs=4))
    try:
        with HttpEncoder(running.url) as client:
            held = client.submit(["held"])
            assert rec.started.wait(30)
            queued = [client.submit([t]) for t in "abcd"]
            deadline = time.monotonic() + 30
            while batcher.queue_depth()[1] < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            refused = client.submit(["one too many"])
            with pytest.raises(Overloaded, match="queue full") as e:
                refused.result(30)
            assert e.value.retry_after_s >= 1
            r = run_load(client.submit, ["more"], rate=200, duration_s=0.1, stop_on_refusal=True)
            assert r["refused"] >= 1 and r["answered"] == r["errors"] == 0
            gate.set()
            for f in [held, *queued]:
                assert f.result(30).shape == (1, 384)
    finally:
        gate.set()
        running.stop()


def _closing_server(close_after: int):
    """A raw HTTP/1.1 server on loopback that answers 200 with "ok" and closes each connection after ``close_after``
    answers without saying so (no Connection: close), as a keep-alive server does to an idle connection; 0: closes
    every connection unanswered. Returns (port, the number of connections accepted, stop)."""
    srv = socket.create_server(("127.0.0.1", 0))
    accepted = [0]
    stop = threading.Event()

    def serve(conn):
        with conn:
            for _ in range(close_after):
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    def loop():
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            accepted[0] += 1
            threading.Thread(target=serve, args=(conn,), daemon=True).start()
        srv.close()

    threading.Thread(target=loop, daemon=True).start()
    return srv.getsockname()[1], accepted, stop.set


def test_the_client_replaces_connections_the_server_closed_and_reports_a_dead_server():
    """Connections closed by the server while idle are not a failed request: the client takes another or opens one
    (before, one retry was allowed, and a second stale connection failed the request). A new connection closed
    unanswered is the server's answer: it raises."""
    from btlib.serve.client import HttpEncoder

    port, accepted, stop = _closing_server(close_after=1)
    try:
        with HttpEncoder(f"http://127.0.0.1:{port}", max_connections=8) as client:
            futures = [client._track(client._get("/health")) for _ in range(8)]  # up to 8 connections open at once
            assert [f.result(10) for f in futures] == [200] * 8
            time.sleep(0.2)  # every idle connection is now closed by the server
            assert [client.get("/health", timeout=10) for _ in range(5)] == [200] * 5
        assert accepted[0] >= 8 + 5  # a fresh connection for every request after the first ones
    finally:
        stop()
    port, accepted, stop = _closing_server(close_after=0)
    try:
        with HttpEncoder(f"http://127.0.0.1:{port}") as client:
            with pytest.raises(Exception, match="0 bytes read|Connection"):
                client.get("/health", timeout=10)
        assert accepted[0] == 1  # a new connection's failure is not retried
    finally:
        stop()


def test_float_and_base64_answers_are_the_batchers_tensor_bit_for_bit(model):
    """HttpEncoder(encoding_format="float") parses JSON numbers back to the float32 the server had, as base64 does."""
    from btlib.serve.app import create_app, start_server
    from btlib.serve.client import HttpEncoder

    texts = workload("mixed", 5, seed=2)
    batcher = BatchEncoder(model, max_queue=16)
    running = start_server(create_app(batcher, max_inputs=16))
    try:
        ref = batcher.encode(texts, timeout=60)
        got = {}
        for fmt in ("float", "base64"):
            with HttpEncoder(running.url, encoding_format=fmt) as client:
                got[fmt] = client.encode(texts, timeout=60)
    finally:
        running.stop()
    for fmt, emb in got.items():
        assert emb.dtype == torch.float32 and emb.shape == ref.shape, fmt
        assert torch.equal(emb, ref), fmt
    with pytest.raises(ValueError, match="encoding_format"):
        HttpEncoder(running.url, encoding_format="binary")
