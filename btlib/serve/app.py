"""The HTTP layer: validates, answers, and leaves batching to a :class:`BatchEncoder` (text-embeddings-inference's split).

Routes, by API (each module's docstring gives the bodies and answers):

    btlib.serve.tei            TEI: POST / /embed /embed_all /embed_sparse /similarity /tokenize /decode, GET /info
    btlib.serve.rerank_routes  TEI: POST /rerank /predict; Cohere / Jina: POST /rerank (a "documents" body), /v1/rerank
    btlib.serve.openai_routes  OpenAI: POST /v1/embeddings (and TEI's /embeddings), GET /v1/models
    here                       GET /health and GET / (200 {"status": "ok"}, never behind the API key, for load
                               balancers), GET /metrics (Prometheus text: btlib's requests, refusals, queue depth,
                               batch tokens, latency quantiles; TEI's te_* counters by route and status and
                               its duration / length / batch histograms, btlib.serve.metrics)

A server holds one model: an embedding model answers the embedding routes, a cross-encoder (a
:class:`btlib.serve.rerank.PairScorer` as the batcher's model) answers /rerank and /predict; the other routes
answer 424 saying which server to start (TEI's status for "model is not a re-ranker model"). A SPLADE folder
answers /embed_sparse (424 elsewhere). The routes share btlib.serve.service (the checks, the run
through the batcher, TEI's x-compute-time / x-queue-time / x-inference-time / x-tokenization-time headers on every
answer that ran the model).

Every field of a request is honoured or refused by name: an unknown field is a 422 naming it (it was ignored, so a
``prompt_name`` the server did not know gave the default prompt's vector without a word). ``prompt_name`` puts the
folder's prompt (config_sentence_transformers.json) before each text and its tokens count everywhere tokens count:
the length limit, the batcher's budget and ``usage``. ``dimensions`` keeps the first features (Matryoshka) and
renormalises where the model's output is normalised, as OpenAI and TEI do. ``normalize=false`` gives the model's
vector before its Normalize module.

Errors: 401 without the API key (``Authorization: Bearer KEY``, the scheme in any case); 400 for a Host header that
names neither this machine nor ``allowed_hosts`` (DNS rebinding: a web page whose name resolves to 127.0.0.1 reached
a keyless loopback server), and for more than one Host header; 404 for an unknown route, 405 for a known route's
wrong method; 413 for a body past ``payload_limit`` bytes (refused from its Content-Length before a byte of
it is read, or as soon as a chunked body passes it), for more than ``max_inputs`` inputs, or for an input past the
model's length with its prompt and without truncation, and for an answer past ``answer_limit`` bytes
(btlib.serve.answer); 422 with a message naming the field for a malformed body
(one not in UTF-8 included: UTF-16, a UTF-8 BOM) or a text that is not Unicode (a lone surrogate, such as a JSON "\\ud800" escape); 424 for
a route the model does not serve; 429 with ``Retry-After`` when
the queue is full; 500 in the route's error shape, the connection kept, for anything else. Every error, 404 and 405
included, is in its route family's shape: OpenAI's ``{"error": {"message", "type", "param", "code"}}`` under /v1/ and
at /embeddings (OpenAI's type names, the field at fault as param), TEI's ``{"error", "error_type"}`` elsewhere
(btlib.serve.guards.error_response). A malformed body of any depth or size is a 422 saying why (btlib.serve.bodies).

The event loop answers every connection, /health included, so nothing slow runs on it: a body of more than
``OFF_LOOP_BYTES`` is parsed, tokenized (the batcher counts tokens at submit) and its answer serialised on a worker
thread; /tokenize and /decode always run on one (tokenizers' encode holds the GIL: a 1.9 MB text froze every
connection for 2.4 s). Before, a 49 MB body kept /health waiting 40 s and grew the process by 2.5 GB before its 413.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from contextlib import asynccontextmanager
from typing import Sequence

from .batcher import BatchEncoder
from .bodies import answers
from .guards import (LOOPBACK_HOSTS, PAYLOAD_LIMIT, APIKey, BodyLimit, HostCheck, HTTPError, allowed_host_names,
                     check_api_key, error_response)
from .extras import require
from .metrics import CountAnswers
from .stats import prometheus_text, tei_batch_text

require("fastapi", "serve")
require("uvicorn", "serve")

import uvicorn  # noqa: E402 - after the checks that name the extra
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.openapi.utils import get_openapi  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse  # noqa: E402
from starlette.exceptions import HTTPException as StarletteHTTPException  # noqa: E402

from ..pretrained.chunking import check_long_inputs  # noqa: E402
from .answer import ANSWER_FACTOR, Answers  # noqa: E402
from .fields import check_overlap  # noqa: E402
from .openai_routes import openai_routes  # noqa: E402
from .rerank_routes import rerank_routes  # noqa: E402
from .service import Service  # noqa: E402
from .tei import tei_routes  # noqa: E402

__all__ = ["create_app", "start_server", "server_config", "RunningServer", "allowed_host_names", "LOOPBACK_HOSTS", "PAYLOAD_LIMIT"]


def create_app(batcher: BatchEncoder, *, model_name: str = "all-MiniLM-L6-v2", api_key: str | None = None,
               max_inputs: int = 256, auto_truncate: bool = False, payload_limit: int = PAYLOAD_LIMIT,
               allowed_hosts: Sequence[str] | None = LOOPBACK_HOSTS, long_inputs: str | None = None,
               chunk_overlap: int | None = None, answer_limit: int | None = None) -> FastAPI:
    """The FastAPI app serving ``batcher``; closing the app (server shutdown) closes the batcher after answering.

    batcher.model: an embedding model (/v1/embeddings, /embed, ...) or a :class:`btlib.serve.rerank.PairScorer`
    around a reranker (/rerank, /predict).

    model_name: reported in OpenAI responses and /info (requests may name any model: one is served). api_key: if
    set, every route but /health and GET / needs ``Authorization: Bearer <api_key>`` (an empty key is a ValueError).
    max_inputs: inputs per request at most (413 beyond; <= the batcher's max_queue; TEI's max_client_batch_size).
    auto_truncate: truncate overlong inputs instead of answering 413 (TEI's --auto-truncate; a request's
    ``truncate`` field overrides it where the route has one): long_inputs="truncate". long_inputs: what a request
    that does not say does with an input past the model's length: "refuse" (413; the default), "truncate" or "chunk"
    (btlib.serve.service; chunk_overlap: tokens consecutive chunks share, default 1/8 of the window). payload_limit: bytes
    of a request body at most (413 beyond, TEI's 2 MB by default). answer_limit: bytes of an answer at most (413
    beyond, btlib.serve.answer; default ANSWER_FACTOR (16) payload limits). allowed_hosts: the Host header names
    answered (any port; :func:`allowed_host_names` derives them from a bind address); None or ("*",): any name, but
    one Host header still (RFC 9112).
    """
    if isinstance(max_inputs, bool) or not isinstance(max_inputs, int) or max_inputs < 1:
        raise ValueError(f"max_inputs must be an int >= 1 (inputs per request); got {max_inputs!r}: with 0 every "
                         "request would be a 413")
    if max_inputs > batcher.max_queue:
        raise ValueError(f"max_inputs={max_inputs} exceeds the batcher's max_queue={batcher.max_queue}: such a request could never be queued")
    if isinstance(payload_limit, bool) or not isinstance(payload_limit, int) or payload_limit <= 0:
        raise ValueError(f"payload_limit must be a positive int (bytes); got {payload_limit!r}")
    if api_key is not None:
        check_api_key(api_key)
    if long_inputs is None:
        long_inputs = "truncate" if auto_truncate else "refuse"
    elif auto_truncate and long_inputs != "truncate":
        raise ValueError(f"auto_truncate=True is long_inputs='truncate'; got long_inputs={long_inputs!r} too: pass one")
    check_long_inputs(long_inputs, chunk_overlap)
    if chunk_overlap is not None and hasattr(batcher.model, "tokenizer"):
        check_overlap(batcher.model, chunk_overlap, None)  # below the default prompt's chunk window
    out = Answers(ANSWER_FACTOR * payload_limit if answer_limit is None else answer_limit)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # uvicorn has answered every request in flight by now; what is still queued is answered too
        await asyncio.get_running_loop().run_in_executor(None, batcher.close)
        svc.tokenizing.shutdown(wait=False)  # idle by now: every request was answered

    app = FastAPI(title="btlib.serve", lifespan=lifespan)

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError):
        return error_response(request.url.path, exc.status, exc.message, exc.kind, exc.headers, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _routing_error(request: Request, exc: StarletteHTTPException):
        """The router's 404 and 405 in the route family's error shape (FastAPI's own is {"detail": ...})."""
        path, method = request.url.path, request.method
        headers = exc.headers
        if exc.status_code == 405:  # every method the path takes (Starlette names the first route's: / has two)
            methods = sorted({m for r in app.router.routes if getattr(r, "path", None) == path for m in r.methods or ()} - {"HEAD"})
            allowed = ", ".join(methods) or (exc.headers or {}).get("Allow", "")
            headers = {**(exc.headers or {}), "Allow": allowed} if allowed else exc.headers
            message = f"{method} {path} is not allowed: this route takes {allowed or 'another method'}"
        elif exc.status_code == 404:
            message = f"no route {method} {path}: see GET /openapi.json (or /docs) for this server's routes"
        else:
            message = str(exc.detail)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
        return error_response(path, exc.status_code, message, kind, headers)

    # add_middleware puts each in front of the last: a request meets the Host check, then the key, then the body limit
    app.add_middleware(BodyLimit, limit=payload_limit)
    if api_key is not None:
        app.add_middleware(APIKey, api_key=api_key)
    app.add_middleware(HostCheck, allowed=None if allowed_hosts is None or "*" in allowed_hosts else tuple(allowed_hosts))

    svc = Service(batcher, model_name=model_name, max_inputs=max_inputs, long_inputs=long_inputs, chunk_overlap=chunk_overlap)
    # Plain Starlette routes that parse their own body (btlib.serve.bodies.parse): FastAPI's endpoint wrapper (body
    # handling, dependency solving, telemetry hooks) cost 0.05 ms of server CPU per request more (POST
    # /v1/embeddings through the app alone: 0.204 -> 0.157 ms, 2-core Intel Xeon). openapi() keeps /docs complete.
    routes = {**tei_routes(svc, out), **rerank_routes(svc, out), **openai_routes(svc, out)}
    # outermost: every answer is counted by route and status, the Host check's, the key's and the body limit's too
    app.add_middleware(CountAnswers, counts=svc.metrics.counts, names={p: p.strip("/").replace("/", "_") or "root" for p in routes})
    for path, (endpoint, _, method) in routes.items():
        app.router.add_route(path, answers(endpoint), methods=[method], name=endpoint.__name__)

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path, (endpoint, body, method) in routes.items():
                op = {"operationId": f"{endpoint.__name__}_{path.strip('/').replace('/', '_') or 'root'}",
                      "responses": {"200": {"description": "OK"}}}
                if body is not None:
                    op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body.model_json_schema()}}}
                schema["paths"].setdefault(path, {})[method.lower()] = op
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.get("/health")
    @app.get("/")  # TEI's health check at GET / (POST / is tei.py's)
    async def health():
        if batcher.closed:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        snap = batcher.snapshot()
        text = prometheus_text(snap) + tei_batch_text(batcher.stats, snap["queue_requests"]) + "\n".join(svc.metrics.lines()) + "\n"
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


BACKLOG = 2048  # connections the kernel holds for accept()


def bind(host: str = "127.0.0.1", port: int = 0, listen: bool = True) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one, no race with other processes); ``listen`` False:
    bound only (the port is taken, connections are refused until ``sock.listen(BACKLOG)``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto is IPPROTO_TCP, and accepted
    # sockets inherit this one's. With proto 0, uvicorn's two writes per answer (head, then body) met the client's
    # delayed ACK: 44 ms per keep-alive request, 0.1 ms of work (measured on loopback, 2-core Xeon).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    if listen:
        sock.listen(BACKLOG)
    return sock


def server_config(app: FastAPI) -> uvicorn.Config:
    """uvicorn's settings for btlib.serve (``python -m btlib.serve`` and :class:`RunningServer` alike).

    http and loop "auto": httptools (C HTTP parser) and uvloop when they import, which the ``serve`` extra installs
    (uvloop not on Windows); without them uvicorn falls back to h11 and asyncio, quietly, with the same answers.
    Each of httptools and uvloop cuts the server's CPU per request (btlib.serve.remote's server_cpu_ms measures it,
    the model's forward left out). access_log off:
    log_level "warning" hid the lines already, but uvicorn still built each line's arguments.
    """
    return uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False, http="auto", loop="auto")


class RunningServer:
    """A uvicorn server on its own thread (tests, notebooks, benchmarks). ``url``; ``stop()`` shuts it down gracefully."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        self.sock = bind(host, port)
        h, p = self.sock.getsockname()[:2]
        self.url = f"http://{'[' + h + ']' if ':' in h else h}:{p}"
        self.server = uvicorn.Server(server_config(app))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 60) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()


def start_server(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Serve ``app`` on a background thread; returns once the socket listens (requests wait in its backlog until uvicorn runs)."""
    return RunningServer(app, host, port)
