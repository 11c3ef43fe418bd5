"""An HTTP client with a BatchEncoder's face: ``submit(texts) -> Future`` over POST /v1/embeddings (btlib.serve's server).

    with HttpEncoder("http://127.0.0.1:8080") as client:
        emb = client.encode(["hello"])                            # (1, d) float32
        r = run_load(client.submit, texts, rate=200, duration_s=5)   # btlib.serve.load, as for a BatchEncoder
    HttpEncoder("http://127.0.0.1:8081").rerank("query", ["doc a", "doc b"])   # a reranker server: [(index, score)]

``submit`` posts one request and returns a ``concurrent.futures.Future`` of its embeddings; a 429 (the
server's queue is full) fails the future with the same :class:`Overloaded` the in-process batcher raises,
so the load generator counts it as a refusal. The bodies are ``encoding_format: "base64"`` (what the
official ``openai`` client sends): the float32 bytes, so the answer equals the server's tensor bit for bit
and neither side formats or parses 384 decimal floats.

The client is an event loop on a thread of its own: an open-loop load keeps rate x latency requests in
flight (1000 req/s x 50 ms = 50), which a small pool of blocking clients would cap, queueing requests in
the client. One loop holds any number of them, with one keep-alive connection each, up to
``max_connections`` (at most ``max_queue`` texts wait in the server and one batch of at most as many runs, so
2 x max_queue + 16 connections never hold back a request the server could take). It speaks HTTP/1.1 over
asyncio streams itself rather than through httpx: the client shares the server's CPU in a benchmark, and
httpx's AsyncClient took about three times this client's CPU per request, which at hundreds of requests a
second is more than a core taken from the server on a 2-core machine.
:func:`btlib.serve.remote.client_cost` measures it where the benchmark runs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import urllib.parse
from concurrent.futures import Future, wait
from typing import Sequence

import numpy as np
import torch

try:
    from orjson import loads as _loads  # the serve extra installs it: the float answers parse in a tenth of json's time
except ImportError:
    _loads = json.loads
from torch import Tensor

from .batcher import Overloaded

__all__ = ["HttpEncoder"]


class _Connections:
    """Keep-alive HTTP/1.1 connections to one host on the running event loop: an idle one first, at most ``limit`` open."""

    def __init__(self, host: str, port: int, limit: int):
        self.host, self.port = host, port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.slots = asyncio.Semaphore(limit)

    async def request(self, head: bytes, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
        """Send ``head`` (request line and headers) and ``body``; (status, lower-cased headers, body) of the answer."""
        async with self.slots:
            while True:
                idle = self._idle()
                reused = idle is not None
                reader, writer = idle if reused else await asyncio.open_connection(self.host, self.port)
                try:
                    writer.write(head + body)
                    line = await reader.readuntil(b"\r\n\r\n")
                    status_line, *fields = line.decode("latin-1").split("\r\n")
                    headers = {k.strip().lower(): v.strip() for k, v in (f.split(":", 1) for f in fields if f)}
                    if "content-length" not in headers:
                        raise RuntimeError(f"{self.host}:{self.port} answered without Content-Length ({headers}); this client reads "
                                           f"only sized bodies (btlib.serve's): use httpx for other servers")
                    data = await reader.readexactly(int(headers["content-length"]))
                except (ConnectionError, asyncio.IncompleteReadError):
                    writer.close()
                    if reused:
                        # The server closed this idle connection as the request went out (uvicorn closes one idle for
                        # 5 s): the next idle one, or a new one. Only a new connection's failure is the server's answer.
                        # An embedding request is idempotent, so one that did reach the server is safe to repeat.
                        continue
                    raise
                except BaseException:  # cancelled (timeout) or a bad answer: the connection's state is unknown
                    writer.close()
                    raise
                if headers.get("connection", "").lower() == "close":
                    writer.close()
                else:
                    self.idle.append((reader, writer))
                return int(status_line.split()[1]), headers, data

    def _idle(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The most recently used idle connection the server has not closed, or None (open a new one). A connection the
        server closed while idle has its end of stream already read by the loop: dropped here, not tried. Before,
        a trial after a pause found most of its idle connections closed, and the one retry allowed hit another:
        ~1 request in 200 failed with IncompleteReadError at 32-64 req/s (mixed workload), which made the load
        test's HTTP row stop at 30 req/s."""
        while self.idle:
            reader, writer = self.idle.pop()
            if reader.at_eof() or writer.is_closing():
                writer.close()
                continue
            return reader, writer
        return None

    async def close(self) -> None:
        idle, self.idle = self.idle, []
        for _, writer in idle:
            writer.close()
        await asyncio.gather(*(writer.wait_closed() for _, writer in idle), return_exceptions=True)


class HttpEncoder:
    """POST /v1/embeddings from an event loop thread; ``submit`` / ``encode`` / ``close`` as a :class:`BatchEncoder`.

    url: the server, ``http://HOST:PORT`` (plain HTTP: a loopback or trusted network; for https, the openai
    client). api_key: sent as ``Authorization: Bearer``. max_connections: keep-alive connections at most
    (requests beyond wait in the client). timeout_s: per request (the future fails with TimeoutError past it).
    encoding_format: "base64" (the float32 bytes) or "float" (JSON numbers, each the float32's shortest decimal: parsed
    back to the same float32); both give the server's tensor bit for bit.
    """

    def __init__(self, url: str, *, api_key: str | None = None, max_connections: int = 256, timeout_s: float = 120.0,
                 encoding_format: str = "base64"):
        if encoding_format not in ("base64", "float"):
            raise ValueError(f"encoding_format must be 'base64' or 'float'; got {encoding_format!r}")
        self.encoding_format = encoding_format
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"url must be http://HOST:PORT (plain HTTP, port given); got {url!r}")
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self._headers = f"Host: {parts.netloc}\r\n" + (f"Authorization: Bearer {api_key}\r\n" if api_key else "")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="btlib-http-client", daemon=True)
        self._thread.start()

        async def make():  # the semaphore and connections belong to the loop they run on
            return _Connections(parts.hostname, parts.port, max_connections)

        self._conns = asyncio.run_coroutine_threadsafe(make(), self._loop).result()
        self._pending: set[Future] = set()
        self._lock = threading.Lock()
        self._closed = False

    async def _request(self, method: str, path: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
        head = f"{method} {path} HTTP/1.1\r\n{self._headers}"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n" if method == "POST" else "\r\n"
        return await asyncio.wait_for(self._conns.request(head.encode("latin-1"), body), self.timeout_s)

    async def _post_json(self, path: str, body: dict):
        """POST ``body`` to ``path``; the parsed answer, Overloaded on a 429, RuntimeError on another status."""
        status, headers, data = await self._request("POST", path, json.dumps(body).encode())
        if status == 429:
            error = json.loads(data)["error"]  # OpenAI's {"error": {"message"}} on /v1, TEI's {"error": str} elsewhere
            raise Overloaded(error["message"] if isinstance(error, dict) else error, int(headers.get("retry-after", 1)))
        if status != 200:
            raise RuntimeError(f"POST {self.url}{path} answered {status}: {data[:300].decode(errors='replace')}")
        return _loads(data)

    async def _post(self, texts: list[str]) -> Tensor:
        answer = await self._post_json("/v1/embeddings", {"input": texts, "encoding_format": self.encoding_format})
        if self.encoding_format == "float":
            return torch.tensor([d["embedding"] for d in answer["data"]], dtype=torch.float32)
        rows = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in answer["data"]]
        return torch.from_numpy(np.stack(rows))  # (len(texts), d) float32

    async def _rerank(self, query: str, texts: list[str], raw_scores: bool) -> list[tuple[int, float]]:
        ranks = await self._post_json("/rerank", {"query": query, "texts": texts, "raw_scores": raw_scores})
        return [(r["index"], r["score"]) for r in ranks]

    async def _get(self, path: str) -> int:
        return (await self._request("GET", path))[0]

    def _track(self, coro) -> Future:
        with self._lock:
            if self._closed:
                coro.close()
                raise RuntimeError("this HttpEncoder is closed")
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._pending.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)

    def submit(self, texts: Sequence[str]) -> Future:
        """Send ``texts`` (a list of str); returns a Future of their (len(texts), d) float32 embeddings.

        The future fails with :class:`Overloaded` on a 429 (queue full), RuntimeError on another status.
        """
        if isinstance(texts, str) or not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
            raise TypeError("texts must be a list of str; wrap a single text in a list")
        return self._track(self._post(list(texts)))

    def encode(self, texts: Sequence[str], *, timeout: float | None = None) -> Tensor:
        """Blocking :meth:`submit`: the (len(texts), d) float32 embeddings."""
        return self.submit(texts).result(timeout)

    def rerank(self, query: str, texts: Sequence[str], *, raw_scores: bool = False,
               timeout: float | None = None) -> list[tuple[int, float]]:
        """POST /rerank to a reranker server: (index into texts, score) for every text, highest first, as Reranker.rank.

        raw_scores: the logits instead of their sigmoid (TEI's field). Raises Overloaded on a 429, RuntimeError
        on another status (an embedding server answers /rerank with 424).
        """
        if not isinstance(query, str) or isinstance(texts, str) or not isinstance(texts, (list, tuple)) \
                or not all(isinstance(t, str) for t in texts):
            raise TypeError("rerank takes a str query and a list of str texts, e.g. rerank('query', ['doc a', 'doc b'])")
        return self._track(self._rerank(query, list(texts), bool(raw_scores))).result(timeout)

    def get(self, path: str, *, timeout: float | None = None) -> int:
        """GET ``path`` through the same loop and connections; its status code."""
        return self._track(self._get(path)).result(timeout)

    def drain(self, timeout: float | None = None) -> None:
        """Wait for every request in flight (what a fresh server per load trial gives the in-process batcher)."""
        with self._lock:
            pending = list(self._pending)
        wait(pending, timeout=timeout)

    def close(self, timeout: float | None = 120.0) -> None:
        """Wait for the requests in flight, close the connections, stop the loop thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.drain(timeout)
        asyncio.run_coroutine_threadsafe(self._conns.close(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    def __enter__(self) -> "HttpEncoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
