"""text-embeddings-inference's HTTP API (router/src/http/server.rs and types.rs): its routes, bodies and answers.

    POST /embed        {"inputs": str | [str] | [int] | [[int]], "normalize", "truncate", "truncation_direction",
                        "prompt_name", "dimensions", btlib's "long_inputs", "chunk_overlap"} -> [[float, ...], ...]
    POST /embed_all    {"inputs", "truncate", "truncation_direction", "prompt_name"} -> [[[float] per token] per input]
    POST /similarity   {"inputs": {"source_sentence", "sentences"}, "parameters": {"truncate", "truncation_direction",
                        "prompt_name"}} -> [cosine of source_sentence with each sentence]
    POST /tokenize     {"inputs": str | [str], "add_special_tokens", "prompt_name"}
                        -> [[{"id", "text", "special", "start", "stop"}, ...], ...] (byte offsets into prompt + text)
    POST /decode       {"ids": [int] | [[int]], "skip_special_tokens"} -> [str, ...]
    POST /embed_sparse {"inputs", "truncate", "truncation_direction", "prompt_name"} -> [[{"index", "value"}, ...] per
                        input]: a SPLADE model's nonzero weights (btlib.pretrained.sparse); 424 for a dense model. On a
                        SPLADE model /embed answers its dense (vocab,) rows with normalize=false and 424 otherwise, and
                        the dense routes (/embed_all, /similarity, /v1/embeddings) 424, as TEI does
    GET  /info         model_id, model_type, max_input_length, max_batch_tokens, ... (what can be stated truly)
    POST /             what TEI's root does for the model held: /embed (or /similarity for an {"inputs": {...}} body)
                        for an embedding model; /rerank (or /predict for an "inputs" body) for a reranker

/rerank and /predict are btlib.serve.rerank_routes'. Every answer that ran the model carries TEI's timing headers
(btlib.serve.service.Service.timing). /embed_all's vectors are the packed forward's last hidden states, the same
forward /embed pools (``encode_tokens(output="token_embeddings")``): every token, special and prompt tokens included,
as sentence-transformers' ``output_value="token_embeddings"``.
"""

from __future__ import annotations

import functools
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from torch import Tensor

from .._version import __version__
from ..pretrained.encoding import check_text
from .bodies import (TEIDecodeRequest, TEIEmbedAllRequest, TEIEmbedRequest, TEIPredictRequest, TEISimilarityRequest,
                     TEITokenizeRequest, dumps, parse)
from .guards import HTTPError
from .rerank_routes import predict_body, rerank_body, rerank_model
from .service import Service, cosine

__all__ = ["tei_routes"]


def tei_routes(svc: Service) -> dict:
    """path -> (endpoint, the body model openapi() describes, or None for GET) for TEI's routes."""

    async def embed(body: TEIEmbedRequest, start: float) -> Response:
        if svc.sparse:
            return await embed_splade_dense(body, start)
        svc.holds("embedding")
        svc.check_dimensions(body.dimensions)
        svc.check_prompt(body.prompt_name)
        mode = svc.long_mode(body.truncation_direction, body.truncate, body.long_inputs, body.chunk_overlap)
        output = svc.output("unnormalized", "normalize=false") if not body.normalize and svc.normalizes else None
        ran = await svc.embed(body.inputs, mode, "inputs", body.prompt_name, output, body.chunk_overlap)
        # normalize=true: unit rows; rows the head left unit (no truncation after its Normalize) are kept as they are
        emb = svc.shape(ran.rows, body.dimensions, body.normalize and not (svc.unit and body.dimensions is None))
        text = await dumps(emb.numpy().tolist(), emb.numel() > 4096)
        return Response(text, media_type="application/json", headers=svc.timing(ran, start, mode))

    async def embed_all(request: Request) -> Response:
        start = time.perf_counter()
        body = await parse(request, TEIEmbedAllRequest)
        svc.holds("embedding")
        svc.check_prompt(body.prompt_name)
        truncate = svc.truncation(body.truncation_direction, body.truncate)
        ran = await svc.embed(body.inputs, truncate, "inputs", body.prompt_name, svc.output("token_embeddings", "/embed_all"))
        states = [s.numpy().tolist() for s in ran.rows.split(ran.future.lengths)]  # (L_i, d) per input
        text = await dumps(states, ran.rows.numel() > 4096)
        return Response(text, media_type="application/json", headers=svc.timing(ran, start))

    async def embed_sparse(request: Request) -> Response:
        start = time.perf_counter()
        body = await parse(request, TEIEmbedAllRequest)  # its fields are checked as TEI's, then the model is
        if not svc.sparse:
            svc.holds("embedding")  # a reranker says so
        svc.holds("sparse")
        svc.check_prompt(body.prompt_name)
        truncate = svc.truncation(body.truncation_direction, body.truncate)
        ran = await svc.embed(body.inputs, truncate, "inputs", body.prompt_name, svc.output("splade", "/embed_sparse"))
        text = await dumps(sparse_values(ran.rows), ran.rows.shape[0] > 8)
        return Response(text, media_type="application/json", headers=svc.timing(ran, start))

    async def embed_splade_dense(body: TEIEmbedRequest, start: float) -> Response:
        """TEI's /embed on a SPLADE model (core/src/infer.rs, embed_pooled): normalize must be false, and the rows
        are the dense (vocab,) weights; btlib's dimensions and long_inputs="chunk" are not defined for them."""
        if body.normalize:
            raise HTTPError(424, "`normalize` is not available for SPLADE models (as TEI): send normalize=false for the "
                                 "dense (vocab,) rows, or POST /embed_sparse for the nonzero entries", "backend")
        if body.dimensions is not None or body.long_inputs not in (None, "truncate", "refuse"):
            raise HTTPError(422, "dimensions and long_inputs='chunk' are not defined for SPLADE rows; leave them out",
                            "Validation")
        svc.check_prompt(body.prompt_name)
        truncate = svc.truncation(body.truncation_direction, body.truncate)
        if body.long_inputs is not None:
            truncate = body.long_inputs == "truncate"
        ran = await svc.embed(body.inputs, truncate, "inputs", body.prompt_name, svc.output("splade", "/embed"))
        text = await dumps(ran.rows.numpy().tolist(), ran.rows.numel() > 4096)
        return Response(text, media_type="application/json", headers=svc.timing(ran, start))

    async def similarity(body: TEISimilarityRequest, start: float) -> Response:
        svc.holds("embedding")
        p = body.parameters
        prompt_name = p.prompt_name if p else None
        svc.check_prompt(prompt_name)
        mode = svc.long_mode(p.truncation_direction, p.truncate, None) if p else svc.long_inputs
        if not body.inputs.sentences:
            raise HTTPError(422, "inputs.sentences must not be empty", "Validation")
        texts = [body.inputs.source_sentence, *body.inputs.sentences]
        ran = await svc.run(texts, mode, "inputs", "inputs (source_sentence and sentences)", prompt_name)
        return Response(await dumps(cosine(ran.rows), False), media_type="application/json",
                        headers=svc.timing(ran, start, mode))

    @functools.cache
    def untruncated():
        """A copy of the model's tokenizer that does not truncate (/tokenize shows every token, as TEI's does)."""
        from tokenizers import Tokenizer

        copy = Tokenizer.from_str(svc.model.tokenizer.to_str())
        copy.no_truncation()
        copy.no_padding()
        return copy

    async def tokenize(request: Request) -> Response:
        body = await parse(request, TEITokenizeRequest)
        tokenizer = untruncated()
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        svc.check_prompt(body.prompt_name)
        if not texts:
            raise HTTPError(422, "inputs must not be empty", "Validation")
        if len(texts) > svc.max_inputs:
            raise HTTPError(413, f"{len(texts)} inputs exceed this server's limit of {svc.max_inputs} per request; "
                                 "split the request", "Validation")
        resolve = getattr(svc.model, "resolve_prompt", None)
        prompt = (resolve(None, body.prompt_name) if resolve else None) or ""
        out = []
        for i, text in enumerate(texts):
            try:
                check_text(text, f"inputs[{i}]")
            except ValueError as e:
                raise HTTPError(422, str(e), "Validation") from None
            full = prompt + text
            enc = tokenizer.encode(full, add_special_tokens=body.add_special_tokens)
            out.append(_simple_tokens(enc, full))
        return Response(await dumps(out, len(out) > 64), media_type="application/json")

    async def decode(request: Request) -> Response:
        body = await parse(request, TEIDecodeRequest)
        tokenizer = untruncated()
        rows = [body.ids] if not body.ids or isinstance(body.ids[0], int) else body.ids
        if not rows or not all(rows):
            raise HTTPError(422, "ids must not be empty", "Validation")
        if len(rows) > svc.max_inputs:
            raise HTTPError(413, f"{len(rows)} id lists exceed this server's limit of {svc.max_inputs} per request; "
                                 "split the request", "Validation")
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        for i, row in enumerate(rows):
            if (bad := next((t for t in row if not 0 <= t < size), None)) is not None:
                raise HTTPError(422, f"ids[{i}] holds {bad}, not a token id of this tokenizer (0 to {size - 1})", "Validation")
        texts = [tokenizer.decode(row, skip_special_tokens=body.skip_special_tokens) for row in rows]
        return JSONResponse(texts)

    async def info(request: Request) -> JSONResponse:
        return JSONResponse(_info(svc))

    async def embed_route(request: Request) -> Response:
        start = time.perf_counter()
        return await embed(await parse(request, TEIEmbedRequest), start)

    async def similarity_route(request: Request) -> Response:
        start = time.perf_counter()
        return await similarity(await parse(request, TEISimilarityRequest), start)

    async def root(request: Request) -> Response:
        """TEI's POST /: the model kind's route, and within it the body's (module docstring)."""
        start = time.perf_counter()
        body = await parse(request, lambda data: _root_body(svc, data))
        if isinstance(body, TEIEmbedRequest):
            return await embed(body, start)
        if isinstance(body, TEISimilarityRequest):
            return await similarity(body, start)
        if hasattr(body, "query"):
            return await rerank_body(svc, body, start)
        return await predict_body(svc, body, start)

    return {"/": (root, None, "POST"), "/embed": (embed_route, TEIEmbedRequest, "POST"),
            "/embed_all": (embed_all, TEIEmbedAllRequest, "POST"), "/embed_sparse": (embed_sparse, TEIEmbedAllRequest, "POST"),
            "/similarity": (similarity_route, TEISimilarityRequest, "POST"), "/tokenize": (tokenize, TEITokenizeRequest, "POST"),
            "/decode": (decode, TEIDecodeRequest, "POST"), "/info": (info, None, "GET")}


def _root_body(svc: Service, data: dict):
    """The body class POST / reads ``data`` as: the model's kind, then the fields it holds."""
    if svc.reranker:
        return rerank_model(data) if "query" in data else TEIPredictRequest
    return TEISimilarityRequest if isinstance(data.get("inputs"), dict) else TEIEmbedRequest


def sparse_values(rows: Tensor) -> list[list[dict]]:
    """(N, V) float32 SPLADE rows -> TEI's /embed_sparse answer: per row its nonzero entries, by index,
    [{"index": int, "value": float}, ...] (router/src/http/server.rs, sparsify)."""
    out = []
    for row in rows:
        idx = row.nonzero().view(-1)  # (nnz,) int64, ascending
        out.append([{"index": i, "value": v} for i, v in zip(idx.tolist(), row[idx].tolist())])
    return out


def _simple_tokens(enc, text: str) -> list[dict]:
    """TEI's SimpleToken list (core/src/tokenization.rs, into_tokens): a special token's text is the token and its
    offsets null; another's text is the bytes of ``text`` it spans, its start and stop byte offsets (the tokenizers
    binding gives character offsets: converted, so a non-ASCII text reads as TEI's does)."""
    starts = [0]
    for ch in text:
        starts.append(starts[-1] + len(ch.encode("utf-8")))
    raw = text.encode("utf-8")
    out = []
    for tid, tok, (a, b), special in zip(enc.ids, enc.tokens, enc.offsets, enc.special_tokens_mask):
        if special:
            out.append({"id": tid, "text": tok, "special": True, "start": None, "stop": None})
        else:
            start, stop = starts[a], starts[b]
            out.append({"id": tid, "text": raw[start:stop].decode("utf-8", "replace"), "special": False,
                        "start": start, "stop": stop})
    return out


def _info(svc: Service) -> dict:
    """TEI's Info (router/src/lib.rs), the fields btlib can state: no model_sha, sha, docker_label,
    max_concurrent_requests (this queue counts texts, max_queue, not requests) or tokenization_workers (requests are
    tokenized where they are parsed). version: btlib's."""
    from ..precision import resolve_dtype

    precision = svc.batcher.precision
    dtype = "int8" if precision == "int8" else {"torch.bfloat16": "bfloat16"}.get(str(resolve_dtype(precision)), "float32")
    if svc.reranker:
        labels = svc.labels()
        kind = {"reranker": {"id2label": {str(i): l for i, l in labels.items()}, "label2id": {l: i for i, l in labels.items()}}}
    else:
        head = getattr(svc.model, "head", None)
        modes = getattr(head.modules[0], "modes", None) if head is not None else None
        kind = {"embedding": {"pooling": "splade" if svc.sparse else "+".join(modes)} if modes else {}}
    return {"model_id": svc.model_name, "model_dtype": dtype, "served_model_name": svc.model_name, "model_type": kind,
            "max_input_length": svc.model.max_length, "max_batch_tokens": svc.batcher.max_batch_tokens,
            "max_batch_requests": svc.batcher.max_batch_requests, "max_client_batch_size": svc.max_inputs,
            "auto_truncate": svc.auto_truncate, "version": __version__}
