"""The reranker's HTTP routes: TEI's /rerank and /predict, Cohere's and Jina's rerank body (/rerank, /v1/rerank).

    POST /rerank     TEI: {"query", "texts", "raw_scores", "return_text", "truncate", "truncation_direction"}
                     -> [{"index", "score", "text"?}, ...], highest score first
                     Cohere / Jina (a body with "documents"): {"query", "documents": [str], "top_n", "return_documents",
                     "model"} -> {"id", "model", "results": [{"index", "relevance_score", "document"?: {"text"}}],
                     "usage": {"total_tokens"}}, the best top_n first
    POST /v1/rerank  the Cohere / Jina body only, errors in OpenAI's shape (the /v1 family's)
    POST /predict    TEI: {"inputs": [query, text] | [[query, text], ...], "raw_scores", "truncate",
                     "truncation_direction", "parameters": {"function_to_apply", "top_k"}}
                     -> [{"score", "label"}] for a pair, [[{"score", "label"}], ...] for a batch

Scores as TEI's: sigmoid of the logit (the folder's one label) unless raw_scores (or function_to_apply "none").
A cross-encoder scores pairs: /predict refuses a lone text (TEI would run it as one sequence, a score the model was
never trained to give). Pairs run through the same batcher as texts do (btlib.serve.rerank says why).
"""

from __future__ import annotations

import time
import uuid

import torch
from fastapi import Request
from fastapi.responses import Response

from ..pretrained.encoding import check_text
from .answer import Answers, Array
from .bodies import RerankDocumentsRequest, TEIPredictRequest, TEIRerankRequest, parse
from .fields import fields
from .guards import HTTPError
from .rerank import rank_scores
from .service import Service

__all__ = ["rerank_routes", "rerank_body", "predict_body", "rerank_model"]


def rerank_model(data: dict):
    """The rerank body ``data`` is: Cohere's / Jina's when it has ``documents``, else TEI's."""
    return RerankDocumentsRequest if "documents" in data else TEIRerankRequest


async def rerank_body(svc: Service, out: Answers, body, start: float) -> Response:
    """/rerank's answer to a parsed TEI or Cohere / Jina body (written by ``out``: texts echoed count against the
    answer limit)."""
    c = fields(svc, "rerank", body)
    cohere = isinstance(body, RerankDocumentsRequest)
    texts, field = (body.documents, "documents") if cohere else (body.texts, "texts")
    if cohere and body.top_n is not None and body.top_n < 1:
        raise HTTPError(422, f"top_n={body.top_n}: ask for 1 or more results (or leave top_n out: all of them)",
                        "Validation", param="top_n")
    for name, text in [("query", body.query), *((f"{field}[{i}]", t) for i, t in enumerate(texts))]:
        try:  # named by the request's own fields, not by the (query, text) pairs the batcher would see
            check_text(text, name)
        except ValueError as e:
            raise HTTPError(422, str(e), "Validation", param=field) from None
    ran = await svc.run([(body.query, t) for t in texts], c.mode, field, field)  # (N, 1) logits
    ranks = rank_scores(ran.rows, False if cohere else body.raw_scores)
    if cohere:
        results = [{"index": i, "relevance_score": score, **({"document": {"text": texts[i]}} if body.return_documents else {})}
                   for i, score in ranks[:body.top_n]]
        tokens = ran.future.tokens
        answer = {"id": uuid.uuid4().hex, "model": svc.model_name, "results": Array(results),
                  "usage": {"total_tokens": tokens, "prompt_tokens": tokens}}
    else:
        answer = Array({"index": i, "score": score, **({"text": texts[i]} if body.return_text else {})} for i, score in ranks)
    return await out.respond(lambda: answer, len(ranks) > 64, svc.timing(ran, start))


async def predict_body(svc: Service, out: Answers, body: TEIPredictRequest, start: float) -> Response:
    """/predict's answer: one prediction list per (query, text) pair, its one label scored."""
    c = fields(svc, "predict", body)
    single = isinstance(body.inputs, list) and len(body.inputs) == 2 and all(isinstance(x, str) for x in body.inputs)
    pairs = [body.inputs] if single else body.inputs
    why = "a cross-encoder scores (query, text) pairs: send inputs [query, text] or a batch [[query, text], ...]"
    if isinstance(pairs, str) or not pairs:
        raise HTTPError(422, f"inputs: {why}" + ("" if pairs else " (got an empty list)"), "Validation", param="inputs")
    for i, pair in enumerate(pairs):
        if not isinstance(pair, list) or len(pair) != 2:
            raise HTTPError(422, f"inputs[{i}] has {len(pair) if isinstance(pair, list) else 'no'} texts: {why}",
                            "Validation", param="inputs")
        for j, text in enumerate(pair):
            try:
                check_text(text, f"inputs[{i}][{j}]")
            except ValueError as e:
                raise HTTPError(422, str(e), "Validation", param="inputs") from None
    raw, top_k = _predict_parameters(body)
    ran = await svc.run([tuple(p) for p in pairs], c.mode, "inputs", "pairs")  # (N, 1) logits
    scores = (ran.rows if raw else torch.sigmoid(ran.rows)).tolist()  # (N, num_labels = 1)
    label = svc.labels()
    predictions = [sorted(({"score": s, "label": label[k]} for k, s in enumerate(row)), key=lambda p: -p["score"])[:top_k]
                   for row in scores]
    return await out.respond(lambda: predictions[0] if single else Array(predictions), len(predictions) > 64,
                             svc.timing(ran, start))


def _predict_parameters(body: TEIPredictRequest) -> tuple[bool, int | None]:
    """(raw scores?, top_k) from raw_scores and huggingface_hub's parameters, or a 422 naming the one refused."""
    raw, p = body.raw_scores, body.parameters
    if p is None:
        return raw, None
    if p.function_to_apply == "softmax":
        raise HTTPError(422, "parameters.function_to_apply='softmax': over this model's one label it is 1 for every "
                             "pair; use 'sigmoid' (the default) or 'none' (the logit)", "Validation", param="parameters")
    if p.function_to_apply is not None:
        if "raw_scores" in body.model_fields_set and raw != (p.function_to_apply == "none"):
            raise HTTPError(422, f"raw_scores={str(raw).lower()} and parameters.function_to_apply="
                                 f"{p.function_to_apply!r} disagree; send one of them", "Validation", param="parameters")
        raw = p.function_to_apply == "none"
    if p.top_k is not None and p.top_k < 1:
        raise HTTPError(422, f"parameters.top_k={p.top_k}: ask for 1 label or more", "Validation", param="parameters")
    return raw, p.top_k


def rerank_routes(svc: Service, out: Answers) -> dict:
    """path -> (endpoint, the body model openapi() describes, method) for the reranker's routes."""

    async def rerank(request: Request) -> Response:
        start = time.perf_counter()
        return await rerank_body(svc, out, await parse(request, rerank_model), start)

    async def rerank_v1(request: Request) -> Response:
        start = time.perf_counter()
        return await rerank_body(svc, out, await parse(request, RerankDocumentsRequest), start)

    async def predict(request: Request) -> Response:
        start = time.perf_counter()
        return await predict_body(svc, out, await parse(request, TEIPredictRequest), start)

    return {"/rerank": (rerank, TEIRerankRequest, "POST"), "/v1/rerank": (rerank_v1, RerankDocumentsRequest, "POST"),
            "/predict": (predict, TEIPredictRequest, "POST")}
