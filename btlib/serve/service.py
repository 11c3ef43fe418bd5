"""What every route of btlib.serve shares: the model served, the request checks, one run through the batcher.

    svc = Service(batcher, model_name="all-MiniLM-L6-v2", max_inputs=256, long_inputs="refuse")
    mode = svc.long_mode(body.truncation_direction, body.truncate, body.long_inputs)   # "refuse" | "truncate" | "chunk"
    ran = await svc.embed(body.inputs, mode, "inputs", prompt_name, output=None)   # texts or token ids
    ran.rows                 # (N, d) float32 (output "token_embeddings": (sum(ran.future.lengths), d))
    svc.timing(ran, start)   # TEI's x-*-time headers: what the batcher measured for this request

The routes (btlib.serve.tei, btlib.serve.openai_routes) only parse, call these and write their API's JSON, as
text-embeddings-inference's router validates and answers while its queue batches and its backend runs.

Token-id inputs (TEI's and OpenAI's ``[1, 2]`` / ``[[1, 2], [3]]``) run as given: no special tokens added, no prompt
(the ids are what the forward sees; TEI re-tokenizes its decode, which can differ), each id in the model's
vocabulary, at most ``max_length`` of them (cut there where truncation is allowed, else 413; never chunked).

Long inputs (btlib.pretrained.chunking): the server's mode (``long_inputs``: "refuse", TEI's default; "truncate",
TEI's --auto-truncate; "chunk") unless a request's ``truncate`` (true: "truncate", false: "refuse") or btlib's
``long_inputs`` field says otherwise: a body may ask for less than the server allows (refuse or truncate), never more
("chunk" only where the server chunks: 422 elsewhere). Chunks run in the same batches as every other input, sliced to
the token budget (btlib.serve.slices), count against the queue, ``max_wait_s`` and ``max_request_tokens`` (413) before
the request is queued, and in usage (what ran); a text's answer is its chunks' pooled row. Routes whose answer cannot pool chunks
(/embed_all's token states, the rerank routes' pairs) refuse a long input under "chunk" unless truncate is true.
"""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from ..pretrained.encoding import Tokens
from ..pretrained.outputs import check_truncate_dim, truncate_rows
from ..pretrained.st_modules import NormalizeModule
from .batcher import BatchEncoder, InputTooLong, Overloaded, RequestTooLarge
from .queue import long_mode
from .bodies import OFF_LOOP_BYTES
from .guards import HTTPError
from .metrics import RequestMetrics

__all__ = ["Service", "Ran"]


@dataclass
class Ran:
    """One request's answer from the batcher: rows (N, d) float32 and its future (tokens, lengths, timings)."""

    rows: Tensor
    future: Future
    chars: int  # characters of its inputs (TEI's x-compute-characters; token ids count one each, as TEI's)


class Service:
    """The batcher and what create_app was told, with the checks every route makes (module docstring)."""

    def __init__(self, batcher: BatchEncoder, *, model_name: str, max_inputs: int, long_inputs: str = "refuse",
                 chunk_overlap: int | None = None):
        self.batcher, self.model, self.model_name = batcher, batcher.model, model_name
        self.max_inputs, self.long_inputs, self.chunk_overlap = max_inputs, long_mode(long_inputs), chunk_overlap
        self.auto_truncate = self.long_inputs == "truncate"  # what a route that cannot chunk does by default
        self.started = int(time.time())
        self.metrics = RequestMetrics()  # TEI's request histograms and answer counters (GET /metrics)
        model = self.model
        self.reranker = bool(getattr(model, "scores_pairs", False))  # a PairScorer (or a wrapper forwarding it)
        head, spec = getattr(model, "head", None), getattr(model, "spec", None)
        # the model's own head L2-normalises (a Normalize module anywhere): normalize=false then needs its
        # "unnormalized" output; a model without a head (a bare encode) does not normalise
        self.normalizes = any(isinstance(m, NormalizeModule) for m in getattr(head, "modules", ()))
        self.width = head.output_dim(spec.d_model) if head is not None and spec is not None and hasattr(head, "output_dim") else None
        self.unit = self.normalizes and not getattr(head, "truncate_dim", None)  # rows of length 1 as they come
        self.outputs = getattr(model, "OUTPUTS", ()) if getattr(batcher, "_runs_tokens", False) else ()
        self.sparse = "splade" in self.outputs  # a SPLADE model (btlib.pretrained.sparse): its rows are (vocab,) weights
        # Big requests are tokenized on one thread, one at a time. tokenizers' encoding of a text holds ~160x its bytes
        # while it runs (a 1.9 MB body: +300 MiB), and glibc keeps each thread's freed memory in that thread's arena
        # (python -m btlib.serve keeps freed memory: btlib.memory), so four 1.7 MB bodies at once on the default
        # executor's threads took MiniLM's server from 573 to 1,566 MiB and left it at 1,413 for good; on one thread,
        # 833 and 776 (AMD EPYC Zen 3, 2 cores). One thread keeps ahead of the forwards: ~1 MB of text a second.
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="btlib-tokenize")

    @functools.cached_property
    def vocab(self) -> int:
        """Token ids the model's embedding takes (config.json's vocab_size; else its tokenizer's)."""
        spec = getattr(self.model, "spec", None)
        return getattr(spec, "vocab_size", None) or self.model.tokenizer.get_vocab_size(with_added_tokens=True)

    def labels(self) -> dict[int, str]:
        """A reranker's label names by index (config.json's id2label; LABEL_i where it has none)."""
        names = getattr(getattr(self.model, "reranker", None), "id2label", None)
        return names or {0: "LABEL_0"}

    # -- checks ------------------------------------------------------------------------------
    def holds(self, kind: str) -> None:
        """424 (TEI's status for a route the model does not serve) unless this server holds a ``kind`` model."""
        if kind == "reranker" and not self.reranker:
            raise HTTPError(424, "this server holds an embedding model, not a reranker: for /rerank and /predict start "
                                 "python -m btlib.serve --model FOLDER with a *ForSequenceClassification folder", "backend")
        if kind == "sparse" and not self.sparse:
            raise HTTPError(424, "/embed_sparse needs a sparse model (SPLADE: a sentence-transformers SparseEncoder "
                                 "folder, MLMTransformer + SpladePooling); this server holds a dense embedding model: use "
                                 "/embed", "backend")
        if kind == "embedding" and self.sparse:  # TEI's SPLADE model answers /embed_sparse (and /embed, normalize=false)
            raise HTTPError(424, "this server holds a sparse (SPLADE) model: POST /embed_sparse gives its vectors "
                                 "(TEI's /embed with normalize=false their dense (vocab,) rows); dense-embedding routes "
                                 "are not available for it", "backend")
        if kind == "embedding" and self.reranker:
            raise HTTPError(424, "this server holds a reranker (cross-encoder): POST /rerank scores (query, text) pairs, "
                                 "/predict [query, text] pairs; for embeddings start python -m btlib.serve with an "
                                 "embedding model folder", "backend")

    def truncation(self, direction: str, truncate: bool | None) -> bool:
        if direction.lower() != "right":
            raise HTTPError(422, "truncation_direction=left: this server truncates the end of a text only; "
                                 "leave truncation_direction out (or shorten the text)", "Validation")
        return self.auto_truncate if truncate is None else truncate

    def long_mode(self, direction: str, truncate: bool | None, long_inputs: str | None,
                  chunk_overlap: int | None = None) -> str:
        """An embedding route's long-input mode (module docstring): ``truncate`` (TEI's field) or ``long_inputs``
        (btlib's), else the server's; 422 where they disagree, or for chunk_overlap without "chunk"."""
        cut = self.truncation(direction, truncate)  # truncation_direction checked whatever decides
        if long_inputs is None:
            mode = self.long_inputs if truncate is None else long_mode(cut)
        else:
            if truncate is not None and long_mode(truncate) != long_inputs:
                raise HTTPError(422, f"truncate={str(truncate).lower()} and long_inputs={long_inputs!r} disagree: send one "
                                     "of them", "Validation", param="long_inputs")
            mode = long_inputs
        if mode == "chunk" and self.long_inputs != "chunk":  # a body may ask for less than the server allows, never more
            raise HTTPError(422, f"long_inputs='chunk': this server does not chunk long inputs (it was started with "
                                 f"long_inputs={self.long_inputs!r}: python -m btlib.serve --long-inputs chunk allows "
                                 "it); send truncate=true, or shorten the text", "Validation", param="long_inputs")
        if chunk_overlap is not None and mode != "chunk":
            raise HTTPError(422, f"chunk_overlap applies to long_inputs='chunk' only (this request's is {mode!r})",
                            "Validation", param="chunk_overlap")
        return mode

    def check_dimensions(self, dimensions: int | None, width: int | None = None) -> None:
        """422 naming dimensions unless it is 1..width (btlib.pretrained.outputs.check_truncate_dim)."""
        try:
            check_truncate_dim(dimensions, width or self.width, "dimensions")
        except ValueError as e:
            raise HTTPError(422, str(e), "invalid_request_error", param="dimensions") from None

    def shape(self, emb: Tensor, dimensions: int | None, normalize: bool) -> Tensor:
        """(N, d) rows -> (N, dimensions) rows, L2-normalised where ``normalize`` (Matryoshka: truncate, then
        normalise, as OpenAI, TEI and sentence-transformers' normalize_embeddings after truncate_dim do): encode's
        own truncate_dim / normalize_embeddings step (btlib.pretrained.outputs.truncate_rows)."""
        if dimensions is not None:
            self.check_dimensions(dimensions, emb.shape[1])  # a model without a known width: checked once its rows are in
        return truncate_rows(emb, dimensions, normalize)

    def check_prompt(self, prompt_name: str | None) -> None:
        """422 naming prompt_name unless the model has that prompt (sentence-transformers' config_sentence_transformers.json)."""
        if prompt_name is None:
            return
        if not hasattr(self.model, "resolve_prompt"):
            raise HTTPError(422, f"prompt_name={prompt_name!r}: this model takes no prompts; leave prompt_name out",
                            "invalid_request_error", param="prompt_name")
        try:
            self.model.resolve_prompt(None, prompt_name)
        except ValueError as e:
            raise HTTPError(422, f"prompt_name: {e}", "invalid_request_error", param="prompt_name") from None

    def output(self, name: str, field: str) -> str:
        """``name`` (an encode_tokens output) if the model gives it, else a 424 saying why (naming ``field``)."""
        if name not in self.outputs:
            raise HTTPError(424, f"{field}: this model gives its pooled rows only (it has no encode_tokens {name!r} "
                                 "output)", "backend")
        if name == "unnormalized":
            try:
                self.model.head.without_normalize()
            except ValueError as e:
                raise HTTPError(422, f"normalize=false: {e}; leave normalize out", "Validation") from None
        return name

    def token_ids(self, ids: list[list[int]], truncate: bool | str, field: str) -> Tokens:
        """Token-id inputs checked (module docstring) as the Tokens that run: 422 for an empty list or an id outside
        the vocabulary, 413 past max_length unless truncate is true / "truncate" (cut at it then; never chunked)."""
        limit, mode = self.model.max_length, long_mode(truncate)
        chunk = " (token ids run as given: they are not chunked; send the text to chunk it)" if mode == "chunk" else ""
        truncate = mode == "truncate"
        for i, row in enumerate(ids):
            if not row:
                raise HTTPError(422, f"{field}[{i}] is an empty list of token ids: it has no embedding", "Validation")
            bad = next((t for t in row if not 0 <= t < self.vocab), None)
            if bad is not None:
                raise HTTPError(422, f"{field}[{i}] holds token id {bad}, outside this model's vocabulary (0 to "
                                     f"{self.vocab - 1}): send this model's ids (POST /tokenize gives them), or text",
                                "Validation")
            if len(row) > limit and not truncate:
                raise HTTPError(413, f"{field}[{i}] has {len(row)} tokens (ids), more than {limit}, the most this "
                                     f"model takes; shorten it or allow truncation{chunk}", "Validation")
        return Tokens([row[:limit] for row in ids], truncated=[len(row) > limit for row in ids])

    # -- one run through the batcher ---------------------------------------------------------
    async def embed(self, inputs, truncate: bool | str, field: str, prompt_name: str | None, output: str | None,
                    chunk_overlap: int | None = None) -> Ran:
        """An embedding route's inputs (a str, a list of str, a list of ids or a list of id lists) through the batcher.
        truncate: True / False, or a long-input mode (:meth:`long_mode`); chunk_overlap: the request's, else the
        server's."""
        if isinstance(inputs, str):
            inputs = [inputs]
        if inputs and isinstance(inputs[0], int):
            inputs = [inputs]  # one token-id input
        if inputs and isinstance(inputs[0], list):
            if prompt_name is not None:
                raise HTTPError(422, f"prompt_name={prompt_name!r} with token-id inputs: the ids run as they are; put "
                                     "the prompt's ids in them (or send text)", "Validation", param="prompt_name")
            self._count(inputs, field, "inputs")
            n = sum(len(r) for r in inputs)
            check = functools.partial(self.token_ids, inputs, truncate, field)
            big = n > OFF_LOOP_BYTES // 4  # a 2 MB body of ids: tens of ms of checking, off the event loop
            tokens = await self.off_loop(check) if big else check()
            return await self._submit(functools.partial(self.batcher.submit_tokens, tokens, output=output), field,
                                      n, big, len(inputs))
        return await self.run(inputs, truncate, field, prompt_name=prompt_name, output=output, chunk_overlap=chunk_overlap)

    def _count(self, items: list, field: str, noun: str) -> None:
        if not items:
            raise HTTPError(422, f"{field} must not be empty", "invalid_request_error", param=field)
        if len(items) > self.max_inputs:
            raise HTTPError(413, f"{len(items)} {noun} exceed this server's limit of {self.max_inputs} per request; "
                                 "split the request", "invalid_request_error", param=field)

    async def run(self, items: list, truncate: bool | str, field: str = "input", noun: str = "inputs",
                  prompt_name: str | None = None, output: str | None = None, chunk_overlap: int | None = None) -> Ran:
        """Queue ``items`` (texts or pairs) on the batcher; their rows once their batch ran. Tokenizing (the batcher
        counts tokens at submit) runs off the event loop for a big request. truncate: as :meth:`embed`."""
        self._count(items, field, noun)
        chars = sum(len(t) if isinstance(t, str) else len(t[0]) + len(t[1]) for t in items)
        if long_mode(truncate) == "chunk" and chunk_overlap is None:
            chunk_overlap = self.chunk_overlap
        submit = functools.partial(self.batcher.submit, items, truncate=truncate, prompt_name=prompt_name, output=output,
                                   chunk_overlap=chunk_overlap)
        return await self._submit(submit, field, chars, chars > OFF_LOOP_BYTES // 4, len(items))

    async def off_loop(self, work):
        """``work()`` on the tokenizing thread (one request's tokenizing at a time, ``__init__``), awaited."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, work)

    async def _submit(self, submit, field: str, chars: int, big: bool, n: int) -> Ran:
        """``submit()`` (off the event loop when ``big``) of ``n`` inputs, its refusals as HTTP errors. The batcher's
        admit runs first, on the loop: a request the queue ahead already refuses gets its 429 before any tokenizing."""
        try:
            self.batcher.admit(n)
            future = await self.off_loop(submit) if big else submit()
        except Overloaded as e:
            raise HTTPError(429, str(e), "overloaded", {"Retry-After": str(e.retry_after_s)}) from None
        except InputTooLong as e:
            raise HTTPError(413, str(e), "invalid_request_error") from None
        except RequestTooLarge as e:  # its tokens after chunking: --max-request-tokens
            raise HTTPError(413, str(e), "invalid_request_error", param=field) from None
        except ValueError as e:  # a text that is not Unicode (a lone surrogate)
            raise HTTPError(422, f"{field}: {e}", "invalid_request_error", param=field) from None
        except RuntimeError as e:  # closed: the server is shutting down
            raise HTTPError(503, str(e), "unavailable") from None
        return Ran(await asyncio.wrap_future(future), future, chars)

    def timing(self, ran: Ran, start: float, mode: str | None = None) -> dict[str, str]:
        """TEI's headers (router/src/lib.rs, ResponseMetadata): whole milliseconds, as TEI writes them. compute and
        total time run from the route's start (``start``: time.perf_counter()) to now; the others are what the batcher
        measured for this request (btlib.serve.batcher.BatchEncoder.submit). x-compute-tokens: every token that ran
        (chunks included). mode "chunk" adds btlib's x-compute-chunks: the sequences that ran. The same times go to
        TEI's histograms (:attr:`metrics`)."""
        f, total_s = ran.future, time.perf_counter() - start
        self.metrics.observe(total_s, f.tokenize_s, f.queue_s, f.inference_s, f.tokens)
        total = f"{int(total_s * 1e3)}"
        chunks = {"x-compute-chunks": str(sum(getattr(f, "chunks", ())))} if mode == "chunk" else {}
        return {"x-compute-time": total, "x-total-time": total, "x-tokenization-time": f"{int(f.tokenize_s * 1e3)}",
                "x-queue-time": f"{int(f.queue_s * 1e3)}", "x-inference-time": f"{int(f.inference_s * 1e3)}",
                "x-compute-tokens": str(f.tokens), "x-compute-characters": str(ran.chars), **chunks}


def cosine(rows: Tensor) -> list[float]:
    """Cosine similarity of rows[0] with each later row (float64, then float): TEI's /similarity (1 - simsimd's
    cosine distance), sentence-transformers' cos_sim."""
    rows = rows.double()
    return torch.nn.functional.cosine_similarity(rows[:1], rows[1:], dim=-1, eps=1e-12).float().tolist()
