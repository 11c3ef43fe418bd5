"""Test helpers for btlib.serve's HTTP app: one running server per module, and a client for it."""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def running_app(model, **app_options) -> Iterator[object]:
    """btlib.serve's app on a BatchEncoder of ``model`` (1 ms wait), on a free loopback port; on exit the server
    stops and the batcher must be closed (a graceful shutdown drains and closes it)."""
    from btlib.serve import BatchEncoder
    from btlib.serve.app import create_app, start_server

    batcher = BatchEncoder(model, max_wait_ms=1)
    running = start_server(create_app(batcher, **app_options))
    yield running
    running.stop()
    assert batcher.closed


@contextlib.contextmanager
def client_of(server) -> Iterator[object]:
    """An httpx client of a running server (60 s timeout)."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
