"""The HTTP layer: validates, answers, and leaves batching to a :class:`BatchEncoder` (text-embeddings-inference's split).

Routes (JSON unless said otherwise):

    POST /v1/embeddings   OpenAI: {"input": str | [str], "model": ..., "encoding_format": "float" | "base64"}
    POST /embed           TEI: {"inputs": str | [str], "normalize": true, "truncate": false} -> [[float, ...], ...]
    POST /rerank          TEI: {"query": str, "texts": [str], "raw_scores": false, "return_text": false, "truncate": false}
                          -> [{"index": i, "score": float, "text"?: str}, ...], highest score first
    GET  /health          200 {"status": "ok"}, never behind the API key (for load balancers)
    GET  /metrics         Prometheus text: requests, refusals, queue depth, batch tokens, latency quantiles

A server holds one model: an embedding model answers the embedding routes, a cross-encoder
(a :class:`btlib.serve.rerank.PairScorer` as the batcher's model) answers /rerank; the other routes
answer 424 saying which server to start (TEI's status for "model is not a re-ranker model").
/rerank's pairs go through the same batcher as texts do (btlib.serve.rerank says why).

Errors: 401 without the API key (``Authorization: Bearer KEY``); 413 for more than ``max_inputs``
inputs or an input past the model's length without truncation; 422 with a message naming the field
for a malformed body or a text that is not Unicode (a lone surrogate, such as a JSON "\\ud800" escape);
429 with ``Retry-After`` when the queue is full. /v1 errors have OpenAI's shape
``{"error": {"message", "type", "code"}}``, /embed errors TEI's ``{"error", "error_type"}``.
base64 is what the official ``openai`` client asks for by default: the float32 little-endian bytes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import socket
import threading
from contextlib import asynccontextmanager
from typing import Literal

import numpy as np

from ..pretrained.encoding import check_text
from .batcher import BatchEncoder, InputTooLong, Overloaded
from .rerank import rank_scores
from .extras import require
from .stats import prometheus_text

require("fastapi", "serve")
require("uvicorn", "serve")

import uvicorn  # noqa: E402 - after the checks that name the extra
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.openapi.utils import get_openapi  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse, Response  # noqa: E402
from pydantic import BaseModel, ConfigDict, ValidationError  # noqa: E402

__all__ = ["create_app", "start_server", "server_config", "RunningServer"]


class OpenAIEmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # "user" and future fields are accepted and ignored
    input: str | list[str]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


class TEIEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    inputs: str | list[str]
    normalize: bool = True
    truncate: bool | None = None
    truncation_direction: Literal["right", "Right", "left", "Left"] = "right"


class TEIRerankRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = None
    truncation_direction: Literal["right", "Right", "left", "Left"] = "right"


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str, headers: dict | None = None):
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


def _error_response(path: str, status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    """The error in the shape of the route's API: OpenAI's under /v1/, TEI's elsewhere."""
    if path.startswith("/v1/"):
        body = {"error": {"message": message, "type": kind, "code": status}}
    else:
        body = {"error": message, "error_type": kind}
    return JSONResponse(body, status_code=status, headers=headers)


class _APIKey:
    """ASGI middleware: every HTTP route but /health answers 401 unless ``Authorization: Bearer <api_key>`` is sent.

    A plain ASGI class, added only when a key is set: Starlette's BaseHTTPMiddleware (``@app.middleware("http")``)
    runs each request through a task group and memory streams: with no key to check it cost 0.33 ms of server CPU
    per POST /v1/embeddings (1.10 -> 0.77 ms without it; GET /health 0.37 -> 0.23 ms; 2-core Intel Xeon).
    The header's bytes are compared in constant time (secrets.compare_digest) with the key's UTF-8 bytes.
    """

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not secrets.compare_digest(given, self.expected):
                response = _error_response(scope["path"], 401, "missing or wrong API key: send Authorization: Bearer <key>",
                                           "authentication_error", {"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def _json_content_type(value: str) -> bool:
    """application/json or application/*+json, parameters (charset) ignored: the bodies FastAPI parses as JSON."""
    kind = value.partition(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


async def _parse(request: Request, model: type[BaseModel]) -> BaseModel:
    """The request's JSON body validated by ``model``, or a 422 naming each bad field ("input.str: Input should be ...").

    What FastAPI did for a body parameter, in the same steps (json.loads, then pydantic on the dict, so the messages
    are pydantic's Python-mode ones, as before) without its dependency solving. Bodies FastAPI would not read as
    JSON (no Content-Type, or not application/json or */*+json) are refused as FastAPI refused them.
    """
    if not _json_content_type(request.headers.get("content-type", "")):
        raise _HTTPError(422, "malformed request body: send JSON with Content-Type: application/json", "invalid_request_error")
    try:
        data = json.loads(await request.body())
    except json.JSONDecodeError as e:
        raise _HTTPError(422, f"malformed request body: {e.pos}: JSON decode error ({e.msg})", "invalid_request_error") from None
    if not isinstance(data, dict):
        raise _HTTPError(422, "malformed request body: body: send a JSON object", "invalid_request_error")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        parts = [f"{'.'.join(str(x) for x in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors(include_url=False)]
        raise _HTTPError(422, "malformed request body: " + "; ".join(parts), "invalid_request_error") from None


def create_app(batcher: BatchEncoder, *, model_name: str = "all-MiniLM-L6-v2", api_key: str | None = None,
               max_inputs: int = 256, auto_truncate: bool = False) -> FastAPI:
    """The FastAPI app serving ``batcher``; closing the app (server shutdown) closes the batcher after answering.

    batcher.model: an embedding model (/v1/embeddings, /embed) or a :class:`btlib.serve.rerank.PairScorer`
    around a reranker (/rerank).

    model_name: reported in OpenAI responses (requests may name any model: one is served). api_key: if
    set, every route but /health needs ``Authorization: Bearer <api_key>``. max_inputs: inputs per
    request at most (413 beyond; <= the batcher's max_queue). auto_truncate: truncate overlong inputs
    instead of answering 413 (TEI's --auto-truncate; /embed's ``truncate`` field overrides it).
    """
    if max_inputs > batcher.max_queue:
        raise ValueError(f"max_inputs={max_inputs} exceeds the batcher's max_queue={batcher.max_queue}: such a request could never be queued")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # uvicorn has answered every request in flight by now; what is still queued is answered too
        await asyncio.get_running_loop().run_in_executor(None, batcher.close)

    app = FastAPI(title="btlib.serve", lifespan=lifespan)

    @app.exception_handler(_HTTPError)
    async def _http_error(request: Request, exc: _HTTPError):
        return _error_response(request.url.path, exc.status, exc.message, exc.kind, exc.headers)

    if api_key is not None:
        app.add_middleware(_APIKey, api_key=api_key)

    reranker = getattr(batcher.model, "scores_pairs", False)  # a PairScorer (or a wrapper forwarding its attributes)

    def holds(kind: str) -> None:
        """424 (TEI's status for a route the model does not serve) unless this server holds a ``kind`` model."""
        if kind == "reranker" and not reranker:
            raise _HTTPError(424, "this server holds an embedding model, not a reranker: for /rerank start "
                                  "python -m btlib.serve --model FOLDER with a *ForSequenceClassification folder", "backend")
        if kind == "embedding" and reranker:
            raise _HTTPError(424, "this server holds a reranker (cross-encoder): POST /rerank scores (query, text) pairs; "
                                  "for embeddings start python -m btlib.serve with an embedding model folder", "backend")

    def truncation(direction: str, truncate: bool | None) -> bool:
        if direction.lower() != "right":
            raise _HTTPError(422, "truncation_direction=left: this server truncates the end of a text only; "
                                  "leave truncation_direction out (or shorten the text)", "Validation")
        return auto_truncate if truncate is None else truncate

    async def run(items: list, truncate: bool, field: str = "input", noun: str = "inputs"):
        """Queue ``items`` (texts or pairs) on the batcher; (rows (len(items), d), tokens) once their batch ran."""
        if not items:
            raise _HTTPError(422, f"{field} must not be empty", "invalid_request_error")
        if len(items) > max_inputs:
            raise _HTTPError(413, f"{len(items)} {noun} exceed this server's limit of {max_inputs} per request; "
                                  "split the request", "invalid_request_error")
        try:
            future = batcher.submit(items, truncate=truncate)
        except Overloaded as e:
            raise _HTTPError(429, str(e), "overloaded", {"Retry-After": str(e.retry_after_s)}) from None
        except InputTooLong as e:
            raise _HTTPError(413, str(e), "invalid_request_error") from None
        except ValueError as e:  # a text that is not Unicode (a lone surrogate): named by its index
            raise _HTTPError(422, f"{field}: {e}", "invalid_request_error") from None
        except RuntimeError as e:  # closed: the server is shutting down
            raise _HTTPError(503, str(e), "unavailable") from None
        return await asyncio.wrap_future(future), future.tokens

    async def openai_embeddings(request: Request):
        body = await _parse(request, OpenAIEmbeddingRequest)
        holds("embedding")
        texts = [body.input] if isinstance(body.input, str) else body.input
        emb, tokens = await run(texts, auto_truncate)
        if body.dimensions is not None and body.dimensions != emb.shape[1]:
            raise _HTTPError(422, f"dimensions={body.dimensions}: this model has {emb.shape[1]} (leave dimensions out)",
                             "invalid_request_error")
        rows = emb.numpy().astype("<f4")
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(r.tobytes()).decode() if body.encoding_format == "base64" else r.tolist()}
                for i, r in enumerate(rows)]
        out = {"object": "list", "data": data, "model": model_name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        return Response(json.dumps(out), media_type="application/json")

    async def tei_embed(request: Request):
        body = await _parse(request, TEIEmbedRequest)
        holds("embedding")
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        normalized = batcher.model.pooling.normalize if hasattr(batcher.model, "pooling") else False
        if not body.normalize and normalized:
            raise _HTTPError(422, "normalize=false: this model's folder normalises its embeddings (modules.json); "
                                  "leave normalize out", "Validation")
        emb, _ = await run(texts, truncation(body.truncation_direction, body.truncate), "inputs")
        if body.normalize and not normalized:
            emb = emb / emb.norm(dim=-1, keepdim=True).clamp(min=1e-12)
        return Response(json.dumps(emb.numpy().tolist()), media_type="application/json")

    async def tei_rerank(request: Request):
        body = await _parse(request, TEIRerankRequest)
        holds("reranker")
        truncate = truncation(body.truncation_direction, body.truncate)
        for name, text in [("query", body.query), *((f"texts[{i}]", t) for i, t in enumerate(body.texts))]:
            try:  # named by the request's own fields, not by the (query, text) pairs the batcher would see
                check_text(text, name)
            except ValueError as e:
                raise _HTTPError(422, str(e), "Validation") from None
        logits, _ = await run([(body.query, t) for t in body.texts], truncate, "texts", "texts")  # (N, 1)
        ranks = [{"index": i, "score": score, **({"text": body.texts[i]} if body.return_text else {})}
                 for i, score in rank_scores(logits, body.raw_scores)]
        return Response(json.dumps(ranks), media_type="application/json")

    # The POST routes are plain Starlette routes that parse their own body (_parse): FastAPI's endpoint wrapper
    # (body handling, dependency solving, telemetry hooks) cost 0.05 ms of server CPU per request more (POST
    # /v1/embeddings through the app alone: 0.204 -> 0.157 ms, 2-core Intel Xeon). openapi() keeps /docs complete.
    posts = {"/v1/embeddings": (openai_embeddings, OpenAIEmbeddingRequest), "/embed": (tei_embed, TEIEmbedRequest),
             "/rerank": (tei_rerank, TEIRerankRequest)}
    for path, (endpoint, _) in posts.items():
        app.router.add_route(path, endpoint, methods=["POST"])

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path, (endpoint, body) in posts.items():
                schema["paths"][path] = {"post": {"operationId": endpoint.__name__, "responses": {"200": {"description": "OK"}},
                                                  "requestBody": {"required": True, "content": {"application/json": {
                                                      "schema": body.model_json_schema()}}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.get("/health")
    async def health():
        if batcher.closed:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(batcher.snapshot()), media_type="text/plain; version=0.0.4")

    return app


def bind(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one, no race with other processes)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto is IPPROTO_TCP, and accepted
    # sockets inherit this one's. With proto 0, uvicorn's two writes per answer (head, then body) met the client's
    # delayed ACK: 44 ms per keep-alive request, 0.1 ms of work (measured on loopback, 2-core Xeon).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def server_config(app: FastAPI) -> uvicorn.Config:
    """uvicorn's settings for btlib.serve (``python -m btlib.serve`` and :class:`RunningServer` alike).

    http and loop "auto": httptools (C HTTP parser) and uvloop when they import, which the ``serve`` extra installs
    (uvloop not on Windows); without them uvicorn falls back to h11 and asyncio, quietly, with the same answers.
    Server CPU per POST /v1/embeddings on a 2-core Intel Xeon (the model's forward left out): h11 + asyncio
    0.59 ms, httptools + asyncio 0.47 ms, h11 + uvloop 0.53 ms, httptools + uvloop 0.43 ms. access_log off:
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
