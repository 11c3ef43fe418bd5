"""OpenAI's embeddings API: POST /v1/embeddings (and TEI's /embeddings, the same body), GET /v1/models.

    POST /v1/embeddings  {"input": str | [str] | [int] | [[int]], "model", "encoding_format": "float" | "base64",
                          "dimensions", "user", "prompt_name" (TEI's, not OpenAI's), "long_inputs", "chunk_overlap"
                          (btlib's: the openai client sends them in extra_body)}
                          -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
                              "usage": {"prompt_tokens", "total_tokens", "chunks" (long_inputs "chunk" only)}}
    GET  /v1/models      {"object": "list", "data": [{"id", "object": "model", "created", "owned_by"}]}
    GET  /v1/models/{id} the served model, or 404 for another name

``dimensions`` keeps the first features and renormalises where the model's rows are normalised (Matryoshka: OpenAI's
text-embedding-3 models, TEI); past the model's width it is a 422. Token-id inputs run as given (btlib.serve.service).
base64 is what the official ``openai`` client asks for by default: the float32 little-endian bytes. ``created`` is
when this server started (the model has no creation date of its own here); ``owned_by`` "btlib".
Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (btlib.serve.guards.error_response): its
type names (invalid_request_error, authentication_error, rate_limit_error, server_error, ...) and the field at fault
as ``param``. An answer past the server's answer limit is a 413 (btlib.serve.answer).
"""

from __future__ import annotations

import base64
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .answer import FLOAT_CHARS, Answers, Array
from .bodies import OpenAIEmbeddingRequest, parse
from .fields import fields
from .guards import HTTPError
from .service import Service

__all__ = ["openai_routes"]


def openai_routes(svc: Service, out: Answers) -> dict:
    """path -> (endpoint, the body model openapi() describes, method) for OpenAI's routes."""

    async def embeddings(request: Request) -> Response:
        start = time.perf_counter()
        body = await parse(request, OpenAIEmbeddingRequest)
        c = fields(svc, "embeddings", body)
        try:
            ran = await svc.embed(body.input, c.mode, "input", c.prompt_name, None, c.chunk_overlap)
        except HTTPError as e:  # OpenAI's param: a refused input (too long, an id outside the vocabulary) is input's
            if e.param is None and e.status in (413, 422):
                e.param = "input"
            raise
        rows = svc.shape(ran.rows, c.dimensions, svc.normalizes and c.dimensions is not None).numpy().astype("<f4")
        b64 = body.encoding_format == "base64"
        data = Array({"object": "embedding", "index": i,
                      "embedding": base64.b64encode(r.tobytes()).decode() if b64 else r.tolist()} for i, r in enumerate(rows))
        tokens = ran.future.tokens  # every token that ran: a chunked text's chunks, overlaps and special tokens included
        chunks = {"chunks": sum(ran.future.chunks)} if c.mode == "chunk" else {}
        usage = {"prompt_tokens": tokens, "total_tokens": tokens, **chunks}
        answer = {"object": "list", "data": data, "model": svc.model_name, "usage": usage}
        # base64: 4 characters per 3 bytes, 5.3 per float; each entry's {"object", "index", ...}: < 64 bytes
        per_float = 6 if b64 else FLOAT_CHARS
        return await out.respond(lambda: answer, rows.size > 4096, svc.timing(ran, start, c.mode),
                                 least=(5 if b64 else 3) * rows.size, most=per_float * rows.size + 64 * len(rows) + 512)

    def entry() -> dict:
        return {"id": svc.model_name, "object": "model", "created": svc.started, "owned_by": "btlib"}

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [entry()]})

    async def model(request: Request) -> JSONResponse:
        name = request.path_params["model"]
        if name != svc.model_name:
            raise HTTPError(404, f"model {name!r} is not served here: this server holds {svc.model_name!r} "
                                 "(GET /v1/models)", "invalid_request_error", param="model")
        return JSONResponse(entry())

    return {"/v1/embeddings": (embeddings, OpenAIEmbeddingRequest, "POST"), "/embeddings": (embeddings, OpenAIEmbeddingRequest, "POST"),
            "/v1/models": (models, None, "GET"), "/v1/models/{model:path}": (model, None, "GET")}
