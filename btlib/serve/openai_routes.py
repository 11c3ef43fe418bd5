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
Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (btlib.serve.guards.error_response).
"""

from __future__ import annotations

import base64
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .bodies import OpenAIEmbeddingRequest, dumps, parse
from .guards import HTTPError
from .service import Service

__all__ = ["openai_routes"]


def openai_routes(svc: Service) -> dict:
    """path -> (endpoint, the body model openapi() describes, method) for OpenAI's routes."""

    async def embeddings(request: Request) -> Response:
        start = time.perf_counter()
        body = await parse(request, OpenAIEmbeddingRequest)
        svc.holds("embedding")
        svc.check_dimensions(body.dimensions)
        svc.check_prompt(body.prompt_name)
        mode = svc.long_mode("right", None, body.long_inputs, body.chunk_overlap)
        ran = await svc.embed(body.input, mode, "input", body.prompt_name, None, body.chunk_overlap)
        rows = svc.shape(ran.rows, body.dimensions, svc.normalizes and body.dimensions is not None).numpy().astype("<f4")
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(r.tobytes()).decode() if body.encoding_format == "base64" else r.tolist()}
                for i, r in enumerate(rows)]
        tokens = ran.future.tokens  # every token that ran: a chunked text's chunks, overlaps and special tokens included
        usage = {"prompt_tokens": tokens, "total_tokens": tokens, **({"chunks": sum(ran.future.chunks)} if mode == "chunk" else {})}
        out = {"object": "list", "data": data, "model": svc.model_name, "usage": usage}
        return Response(await dumps(out, rows.size > 4096), media_type="application/json", headers=svc.timing(ran, start, mode))

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
