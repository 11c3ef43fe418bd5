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

Every answer is written within the server's answer limit (btlib.serve.answer: a 413 naming it beyond; 16 payload
limits, 32 MB, by default): /tokenize's ~60 bytes per token and /embed_all's ~20 per float are what reach it first.
/tokenize and /decode run on a worker thread, and so does writing any big answer: the event loop answers every
connection (/health included). The fields every route shares are checked by btlib.serve.fields' one table.

/rerank and /predict are btlib.serve.rerank_routes'. Every answer that ran the model carries TEI's timing headers
(btlib.serve.service.Service.timing). /embed_all's vectors are the packed forward's last hidden states, the same
forward /embed pools (``encode_tokens(output="token_embeddings")``): every token, special and prompt tokens included,
as sentence-transformers' ``output_value="token_embeddings"``.
"""

from __future__ import annotations

import functools
import time

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from torch import Tensor

from .._version import __version__
from ..pretrained.encoding import check_text
from .answer import FLOAT_CHARS, Answers, Array, Run
from .bodies import (TEIDecodeRequest, TEIEmbedAllRequest, TEIEmbedRequest, TEIPredictRequest, TEISimilarityRequest,
                     TEITokenizeRequest, parse)
from .fields import fields
from .guards import HTTPError
from .rerank_routes import predict_body, rerank_body, rerank_model
from .service import Service, cosine

__all__ = ["tei_routes"]


def rows_array(rows: Tensor) -> Array:
    """(N, d) float32 -> the JSON array of its rows, written ~4,096 floats at a time (btlib.serve.answer)."""
    x = rows.numpy()
    k = max(1, 4096 // max(1, x.shape[1]))  # rows per piece
    return Array(Run(x[i:i + k].tolist()) for i in range(0, len(x), k))


def rows_bound(floats: int, rows: int) -> int:
    """The most bytes a JSON array of ``rows`` rows of ``floats`` floats in all can take."""
    return FLOAT_CHARS * floats + 2 * rows + 2


def tei_routes(svc: Service, out: Answers) -> dict:
    """path -> (endpoint, the body model openapi() describes, or None for GET) for TEI's routes; ``out`` writes their
    answers within the server's answer limit."""

    async def embed(body: TEIEmbedRequest, start: float) -> Response:
        if svc.sparse and body.normalize:  # TEI's embed_pooled on a SPLADE model (core/src/infer.rs)
            raise HTTPError(424, "`normalize` is not available for SPLADE models (as TEI): send normalize=false for the "
                                 "dense (vocab,) rows, or POST /embed_sparse for the nonzero entries", "backend")
        c = fields(svc, "embed", body)
        if svc.sparse:
            output = svc.output("splade", "/embed")
        else:
            output = svc.output("unnormalized", "normalize=false") if not body.normalize and svc.normalizes else None
        ran = await svc.embed(body.inputs, c.mode, "inputs", c.prompt_name, output, c.chunk_overlap)
        # normalize=true: unit rows; rows the head left unit (no truncation after its Normalize) are kept as they are
        emb = ran.rows if svc.sparse else \
            svc.shape(ran.rows, c.dimensions, body.normalize and not (svc.unit and c.dimensions is None))
        return await out.respond(lambda: rows_array(emb), emb.numel() > 4096, svc.timing(ran, start, c.mode),
                                 least=3 * emb.numel(), most=rows_bound(emb.numel(), len(emb)))  # "0.0": 3 at least

    async def embed_all(request: Request) -> Response:
        start = time.perf_counter()
        body = await parse(request, TEIEmbedAllRequest)
        c = fields(svc, "embed_all", body)
        ran = await svc.embed(body.inputs, c.mode, "inputs", c.prompt_name, svc.output("token_embeddings", "/embed_all"))
        states = ran.rows.split(ran.future.lengths)  # (L_i, d) per input
        return await out.respond(lambda: Array(rows_array(s) for s in states), ran.rows.numel() > 4096,
                                 svc.timing(ran, start), least=3 * ran.rows.numel(),
                                 most=rows_bound(ran.rows.numel(), len(ran.rows) + len(states)))

    async def embed_sparse(request: Request) -> Response:
        start = time.perf_counter()
        body = await parse(request, TEIEmbedAllRequest)  # its fields are checked as TEI's, then the model is
        c = fields(svc, "embed_sparse", body)
        ran = await svc.embed(body.inputs, c.mode, "inputs", c.prompt_name, svc.output("splade", "/embed_sparse"))
        return await out.respond(lambda: Array(sparse_values(ran.rows)), ran.rows.shape[0] > 8, svc.timing(ran, start))

    async def similarity(body: TEISimilarityRequest, start: float) -> Response:
        c = fields(svc, "similarity", body.parameters)
        if not body.inputs.sentences:
            raise HTTPError(422, "inputs.sentences must not be empty", "Validation", param="inputs")
        texts = [body.inputs.source_sentence, *body.inputs.sentences]
        ran = await svc.run(texts, c.mode, "inputs", "inputs (source_sentence and sentences)", c.prompt_name)
        return await out.respond(lambda: cosine(ran.rows), False, svc.timing(ran, start, c.mode))

    @functools.cache
    def untruncated():
        """A copy of the model's tokenizer that does not truncate (/tokenize shows every token, as TEI's does)."""
        from tokenizers import Tokenizer

        copy = Tokenizer.from_str(svc.model.tokenizer.to_str())
        copy.no_truncation()
        copy.no_padding()
        return copy

    def count(items: list, what: str) -> None:
        if len(items) > svc.max_inputs:
            raise HTTPError(413, f"{len(items)} {what} exceed this server's limit of {svc.max_inputs} per request; "
                                 "split the request", "Validation")

    async def off_loop(work):
        """/tokenize's and /decode's work on the tokenizing thread, small or big: tokenizers' encode and decode hold
        the GIL (a 1.9 MB text: 4 s of encode, every connection waiting), their _batch forms release it; one at a time
        (Service.tokenizing: a 1.9 MB text's encoding holds ~300 MiB while it runs)."""
        return await svc.off_loop(work)

    async def tokenize(request: Request) -> Response:
        """TEI's /tokenize. Its answer (~60 bytes per token) is bounded by the answer limit: a 413 beyond."""
        body = await parse(request, TEITokenizeRequest)
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        c = fields(svc, "tokenize", body)
        if not texts:
            raise HTTPError(422, "inputs must not be empty", "Validation")
        count(texts, "inputs")
        resolve = getattr(svc.model, "resolve_prompt", None)
        prompt = (resolve(None, c.prompt_name) if resolve else None) or ""

        def work() -> bytes:
            for i, text in enumerate(texts):
                try:
                    check_text(text, f"inputs[{i}]")
                except ValueError as e:
                    raise HTTPError(422, str(e), "Validation", param="inputs") from None
            full = [prompt + t for t in texts]
            encs = untruncated().encode_batch(full, add_special_tokens=body.add_special_tokens)
            least = 40 * sum(len(e.ids) for e in encs)  # a token's object is ~50 bytes at least
            if least > out.limit:
                raise out.too_large(least)
            return out.write(Array(Array(_simple_tokens(e, t)) for e, t in zip(encs, full)))

        return Response(await off_loop(work), media_type="application/json")

    async def decode(request: Request) -> Response:
        """TEI's /decode. Its answer is bounded by the answer limit: a 413 beyond."""
        body = await parse(request, TEIDecodeRequest)
        rows = [body.ids] if not body.ids or isinstance(body.ids[0], int) else body.ids
        if not rows or not all(rows):
            raise HTTPError(422, "ids must not be empty", "Validation", param="ids")
        count(rows, "id lists")
        tokenizer = untruncated()
        size = tokenizer.get_vocab_size(with_added_tokens=True)

        def work() -> bytes:
            for i, row in enumerate(rows):
                if min(row) < 0 or max(row) >= size:
                    bad = next(t for t in row if not 0 <= t < size)
                    raise HTTPError(422, f"ids[{i}] holds {bad}, not a token id of this tokenizer (0 to {size - 1})",
                                    "Validation", param="ids")
            return out.write(Array(tokenizer.decode_batch(rows, skip_special_tokens=body.skip_special_tokens)))

        return Response(await off_loop(work), media_type="application/json")

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
            return await rerank_body(svc, out, body, start)
        return await predict_body(svc, out, body, start)

    return {"/": (root, None, "POST"), "/embed": (embed_route, TEIEmbedRequest, "POST"),
            "/embed_all": (embed_all, TEIEmbedAllRequest, "POST"), "/embed_sparse": (embed_sparse, TEIEmbedAllRequest, "POST"),
            "/similarity": (similarity_route, TEISimilarityRequest, "POST"), "/tokenize": (tokenize, TEITokenizeRequest, "POST"),
            "/decode": (decode, TEIDecodeRequest, "POST"), "/info": (info, None, "GET")}


def _root_body(svc: Service, data: dict):
    """The body class POST / reads ``data`` as: the model's kind, then the fields it holds."""
    if svc.reranker:
        return rerank_model(data) if "query" in data else TEIPredictRequest
    return TEISimilarityRequest if isinstance(data.get("inputs"), dict) else TEIEmbedRequest


def sparse_values(rows: Tensor):
    """(N, V) float32 SPLADE rows -> TEI's /embed_sparse answer, a row at a time: per row its nonzero entries, by
    index, [{"index": int, "value": float}, ...] (router/src/http/server.rs, sparsify)."""
    for row in rows:
        idx = row.nonzero().view(-1)  # (nnz,) int64, ascending
        yield [{"index": i, "value": v} for i, v in zip(idx.tolist(), row[idx].tolist())]


def _byte_starts(text: str) -> list[int] | None:
    """The UTF-8 byte offset of each character of ``text`` and of its end (len(text) + 1 of them); None for ASCII,
    whose characters are its bytes. numpy: a Python loop over a 1.9 MB text took ~0.5 s."""
    if text.isascii():
        return None
    cp = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)  # (n,) code points
    width = 1 + (cp >= 0x80).astype(np.int64) + (cp >= 0x800) + (cp >= 0x10000)  # UTF-8 bytes per character
    return [0, *np.cumsum(width).tolist()]


def _simple_tokens(enc, text: str, run: int = 1024):
    """TEI's SimpleToken list (core/src/tokenization.rs, into_tokens), ``run`` tokens at a time: a special token's
    text is the token and its offsets null; another's text is the bytes of ``text`` it spans, its start and stop byte
    offsets (the tokenizers binding gives character offsets: converted, so a non-ASCII text reads as TEI's does)."""
    starts, raw = _byte_starts(text), text.encode("utf-8")
    out = Run()
    for tid, tok, (a, b), special in zip(enc.ids, enc.tokens, enc.offsets, enc.special_tokens_mask):
        if special:
            out.append({"id": tid, "text": tok, "special": True, "start": None, "stop": None})
        else:
            start, stop = (a, b) if starts is None else (starts[a], starts[b])
            out.append({"id": tid, "text": raw[start:stop].decode("utf-8", "replace"), "special": False,
                        "start": start, "stop": stop})
        if len(out) == run:
            yield out
            out = Run()
    yield out


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
            "max_request_tokens": svc.batcher.max_request_tokens,  # btlib's: a request's tokens after chunking
            "auto_truncate": svc.auto_truncate, "version": __version__}
