"""The HTTP layer: validates, answers, and leaves batching to a :class:`BatchEncoder` (text-embeddings-inference's split).

Routes (JSON unless said otherwise):

    POST /v1/embeddings   OpenAI: {"input": str | [str], "model": ..., "encoding_format": "float" | "base64",
                          "dimensions": int, "user": str, "prompt_name": str (btlib's, as TEI's)}
    POST /embed           TEI: {"inputs": str | [str], "normalize": true, "truncate": false, "truncation_direction",
                          "prompt_name": str, "dimensions": int} -> [[float, ...], ...]
    POST /rerank          TEI: {"query": str, "texts": [str], "raw_scores": false, "return_text": false, "truncate": false}
                          -> [{"index": i, "score": float, "text"?: str}, ...], highest score first
    GET  /health          200 {"status": "ok"}, never behind the API key (for load balancers)
    GET  /metrics         Prometheus text: requests, refusals, queue depth, batch tokens, latency quantiles

A server holds one model: an embedding model answers the embedding routes, a cross-encoder
(a :class:`btlib.serve.rerank.PairScorer` as the batcher's model) answers /rerank; the other routes
answer 424 saying which server to start (TEI's status for "model is not a re-ranker model").
/rerank's pairs go through the same batcher as texts do (btlib.serve.rerank says why).

Every field of a request is honoured or refused by name: an unknown field is a 422 naming it (it was ignored, so a
``prompt_name`` the server did not know gave the default prompt's vector without a word). ``prompt_name`` puts the
folder's prompt (config_sentence_transformers.json) before each text and its tokens count everywhere tokens count:
the length limit, the batcher's budget and ``usage``. ``dimensions`` keeps the first features (Matryoshka) and
renormalises where the model's output is normalised, as OpenAI and TEI do.

Errors: 401 without the API key (``Authorization: Bearer KEY``); 400 for a Host header that names neither this
machine nor ``allowed_hosts`` (DNS rebinding: a web page whose name resolves to 127.0.0.1 reached a keyless
loopback server); 413 for a body past ``payload_limit`` bytes (refused from its Content-Length before a byte of
it is read, or as soon as a chunked body passes it), for more than ``max_inputs`` inputs, or for an input past the
model's length with its prompt and without truncation; 422 with a message naming the field for a malformed body
(one not in UTF-8 included: UTF-16, a UTF-8 BOM) or a text that is not Unicode (a lone surrogate, such as a JSON "\\ud800" escape); 429 with ``Retry-After`` when
the queue is full; 500 in the route's error shape, the connection kept, for anything else. /v1 errors have OpenAI's shape
``{"error": {"message", "type", "code"}}``, /embed errors TEI's ``{"error", "error_type"}``.
base64 is what the official ``openai`` client asks for by default: the float32 little-endian bytes.

The event loop answers every connection, /health included, so nothing slow runs on it: a body of more than
``OFF_LOOP_BYTES`` is parsed, tokenized (the batcher counts tokens at submit) and its answer serialised on a worker
thread. Before, a 49 MB body kept /health waiting 40 s and grew the process by 2.5 GB before its 413.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import socket
import threading
from contextlib import asynccontextmanager
from typing import Sequence

from ..pretrained.encoding import check_text
from ..pretrained.st_modules import NormalizeModule
from .batcher import BatchEncoder, InputTooLong, Overloaded
from .bodies import OFF_LOOP_BYTES, OpenAIEmbeddingRequest, TEIEmbedRequest, TEIRerankRequest, answers, dumps, parse
from .guards import (LOOPBACK_HOSTS, PAYLOAD_LIMIT, APIKey, BodyLimit, HostCheck, HTTPError, allowed_host_names,
                     check_api_key, error_response)
from .rerank import rank_scores
from .extras import require
from .stats import prometheus_text

require("fastapi", "serve")
require("uvicorn", "serve")

import uvicorn  # noqa: E402 - after the checks that name the extra
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.openapi.utils import get_openapi  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse, Response  # noqa: E402

__all__ = ["create_app", "start_server", "server_config", "RunningServer", "allowed_host_names", "LOOPBACK_HOSTS", "PAYLOAD_LIMIT"]

def _normalizes(model) -> bool:
    """Whether the model's own head L2-normalises (a Normalize module anywhere in it): normalize=false cannot be
    undone then. A model without a head (a bare encode) does not."""
    head = getattr(model, "head", None)
    return any(isinstance(m, NormalizeModule) for m in getattr(head, "modules", ()))


def _output_dim(model) -> int | None:
    """The width of the model's rows, known before a forward where the model has a head and a spec; else None."""
    head, spec = getattr(model, "head", None), getattr(model, "spec", None)
    if head is None or spec is None or not hasattr(head, "output_dim"):
        return None
    return head.output_dim(spec.d_model)


def create_app(batcher: BatchEncoder, *, model_name: str = "all-MiniLM-L6-v2", api_key: str | None = None,
               max_inputs: int = 256, auto_truncate: bool = False, payload_limit: int = PAYLOAD_LIMIT,
               allowed_hosts: Sequence[str] | None = LOOPBACK_HOSTS) -> FastAPI:
    """The FastAPI app serving ``batcher``; closing the app (server shutdown) closes the batcher after answering.

    batcher.model: an embedding model (/v1/embeddings, /embed) or a :class:`btlib.serve.rerank.PairScorer`
    around a reranker (/rerank).

    model_name: reported in OpenAI responses (requests may name any model: one is served). api_key: if
    set, every route but /health needs ``Authorization: Bearer <api_key>`` (an empty key is a ValueError). max_inputs:
    inputs per request at most (413 beyond; <= the batcher's max_queue). auto_truncate: truncate overlong inputs
    instead of answering 413 (TEI's --auto-truncate; /embed's ``truncate`` field overrides it). payload_limit: bytes
    of a request body at most (413 beyond, TEI's 2 MB by default). allowed_hosts: the Host header names answered
    (any port; :func:`allowed_host_names` derives them from a bind address); None or ("*",): any.
    """
    if max_inputs > batcher.max_queue:
        raise ValueError(f"max_inputs={max_inputs} exceeds the batcher's max_queue={batcher.max_queue}: such a request could never be queued")
    if isinstance(payload_limit, bool) or not isinstance(payload_limit, int) or payload_limit <= 0:
        raise ValueError(f"payload_limit must be a positive int (bytes); got {payload_limit!r}")
    if api_key is not None:
        check_api_key(api_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # uvicorn has answered every request in flight by now; what is still queued is answered too
        await asyncio.get_running_loop().run_in_executor(None, batcher.close)

    app = FastAPI(title="btlib.serve", lifespan=lifespan)

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError):
        return error_response(request.url.path, exc.status, exc.message, exc.kind, exc.headers)

    # add_middleware puts each in front of the last: a request meets the Host check, then the key, then the body limit
    app.add_middleware(BodyLimit, limit=payload_limit)
    if api_key is not None:
        app.add_middleware(APIKey, api_key=api_key)
    if allowed_hosts is not None and "*" not in allowed_hosts:
        app.add_middleware(HostCheck, allowed=tuple(allowed_hosts))

    model = batcher.model
    reranker = getattr(model, "scores_pairs", False)  # a PairScorer (or a wrapper forwarding its attributes)
    normalizes, width = _normalizes(model), _output_dim(model)
    unit = normalizes and not getattr(getattr(model, "head", None), "truncate_dim", None)  # rows of length 1 as they come

    def holds(kind: str) -> None:
        """424 (TEI's status for a route the model does not serve) unless this server holds a ``kind`` model."""
        if kind == "reranker" and not reranker:
            raise HTTPError(424, "this server holds an embedding model, not a reranker: for /rerank start "
                                 "python -m btlib.serve --model FOLDER with a *ForSequenceClassification folder", "backend")
        if kind == "embedding" and reranker:
            raise HTTPError(424, "this server holds a reranker (cross-encoder): POST /rerank scores (query, text) pairs; "
                                 "for embeddings start python -m btlib.serve with an embedding model folder", "backend")

    def truncation(direction: str, truncate: bool | None) -> bool:
        if direction.lower() != "right":
            raise HTTPError(422, "truncation_direction=left: this server truncates the end of a text only; "
                                 "leave truncation_direction out (or shorten the text)", "Validation")
        return auto_truncate if truncate is None else truncate

    def check_dimensions(dimensions: int | None) -> None:
        if dimensions is not None and not (1 <= dimensions <= (width or dimensions)):
            raise HTTPError(422, f"dimensions={dimensions}: this model gives {width} features; ask for 1 to {width} "
                                 "(or leave dimensions out)", "invalid_request_error")

    def shape(emb, dimensions: int | None, normalize: bool):
        """(N, d) rows -> (N, dimensions) rows, L2-normalised where ``normalize`` (Matryoshka: truncate, then normalise)."""
        if dimensions is not None:
            if dimensions > emb.shape[1]:  # a model without a known width: checked once its rows are in
                raise HTTPError(422, f"dimensions={dimensions}: this model gives {emb.shape[1]} features; ask for 1 to "
                                     f"{emb.shape[1]} (or leave dimensions out)", "invalid_request_error")
            emb = emb[:, :dimensions]
        return emb / emb.norm(dim=-1, keepdim=True).clamp(min=1e-12) if normalize else emb

    def check_prompt(prompt_name: str | None) -> None:
        """422 naming prompt_name unless the model has that prompt (sentence-transformers' config_sentence_transformers.json)."""
        if prompt_name is None:
            return
        if not hasattr(model, "resolve_prompt"):
            raise HTTPError(422, f"prompt_name={prompt_name!r}: this model takes no prompts; leave prompt_name out",
                            "invalid_request_error")
        try:
            model.resolve_prompt(None, prompt_name)
        except ValueError as e:
            raise HTTPError(422, f"prompt_name: {e}", "invalid_request_error") from None

    async def run(items: list, truncate: bool, field: str = "input", noun: str = "inputs", prompt_name: str | None = None):
        """Queue ``items`` (texts or pairs) on the batcher; (rows (len(items), d), tokens) once their batch ran.

        Tokenizing (the batcher counts tokens at submit) runs off the event loop for a big request."""
        if not items:
            raise HTTPError(422, f"{field} must not be empty", "invalid_request_error")
        if len(items) > max_inputs:
            raise HTTPError(413, f"{len(items)} {noun} exceed this server's limit of {max_inputs} per request; "
                                 "split the request", "invalid_request_error")
        submit = functools.partial(batcher.submit, items, truncate=truncate, prompt_name=prompt_name)
        big = sum(len(t) if isinstance(t, str) else len(t[0]) + len(t[1]) for t in items) > OFF_LOOP_BYTES // 4
        try:
            future = await asyncio.get_running_loop().run_in_executor(None, submit) if big else submit()
        except Overloaded as e:
            raise HTTPError(429, str(e), "overloaded", {"Retry-After": str(e.retry_after_s)}) from None
        except InputTooLong as e:
            raise HTTPError(413, str(e), "invalid_request_error") from None
        except ValueError as e:  # a text that is not Unicode (a lone surrogate)
            raise HTTPError(422, f"{field}: {e}", "invalid_request_error") from None
        except RuntimeError as e:  # closed: the server is shutting down
            raise HTTPError(503, str(e), "unavailable") from None
        return await asyncio.wrap_future(future), future.tokens

    async def openai_embeddings(request: Request):
        body = await parse(request, OpenAIEmbeddingRequest)
        holds("embedding")
        check_dimensions(body.dimensions)
        check_prompt(body.prompt_name)
        texts = [body.input] if isinstance(body.input, str) else body.input
        emb, tokens = await run(texts, auto_truncate, prompt_name=body.prompt_name)
        rows = shape(emb, body.dimensions, normalizes and body.dimensions is not None).numpy().astype("<f4")
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(r.tobytes()).decode() if body.encoding_format == "base64" else r.tolist()}
                for i, r in enumerate(rows)]
        out = {"object": "list", "data": data, "model": model_name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        return Response(await dumps(out, rows.size > 4096), media_type="application/json")

    async def tei_embed(request: Request):
        body = await parse(request, TEIEmbedRequest)
        holds("embedding")
        check_dimensions(body.dimensions)
        check_prompt(body.prompt_name)
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        if not body.normalize and normalizes:
            raise HTTPError(422, "normalize=false: this model's folder normalises its embeddings (a Normalize module in "
                                 "modules.json); leave normalize out", "Validation")
        emb, _ = await run(texts, truncation(body.truncation_direction, body.truncate), "inputs", prompt_name=body.prompt_name)
        # normalize=true: unit rows; rows the head left unit (no truncation after its Normalize) are kept as they are
        emb = shape(emb, body.dimensions, body.normalize and not (unit and body.dimensions is None))
        return Response(await dumps(emb.numpy().tolist(), emb.numel() > 4096), media_type="application/json")

    async def tei_rerank(request: Request):
        body = await parse(request, TEIRerankRequest)
        holds("reranker")
        truncate = truncation(body.truncation_direction, body.truncate)
        for name, text in [("query", body.query), *((f"texts[{i}]", t) for i, t in enumerate(body.texts))]:
            try:  # named by the request's own fields, not by the (query, text) pairs the batcher would see
                check_text(text, name)
            except ValueError as e:
                raise HTTPError(422, str(e), "Validation") from None
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
        app.router.add_route(path, answers(endpoint), methods=["POST"])

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
