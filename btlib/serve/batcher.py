"""A packed dynamic batcher: many callers' texts, one padding-free forward pass per batch.

    batcher = BatchEncoder(btlib.load_pretrained(), max_batch_tokens=512)
    emb = batcher.encode(["what is packing?"])        # (1, 384) float32, blocking
    fut = batcher.submit(["a", "b"])                   # concurrent.futures.Future of a (2, 384) tensor
    emb = await batcher.aencode(["from asyncio"])      # inside a coroutine
    batcher.close()                                    # answers everything accepted, then stops

Why packing matters here: a padded batcher pays ``batch x longest`` tokens, so one 256-token passage among 31
ten-token queries costs 8,192 tokens instead of 566; btlib packs the texts (``cu_seqlens``) and pays only the real
tokens, so the batcher forms batches by a token budget, as text-embeddings-inference does.

Scheduling (one worker thread; TEI's queue):

- Batches fill by a token budget, ``max_batch_tokens`` (and at most ``max_batch_requests`` requests). The default,
  512, is a CPU budget: a forward costs a fixed part plus a part per token (notebook 09 fits both), and at 512 tokens
  the per-token part dominates while a batch stays a few tens of milliseconds on 2 CPU threads; TEI's 16384 is a GPU
  budget.
- A batch waits at most ``max_wait_ms`` after its oldest request arrived for more requests; 0, the default, waits
  nowhere (TEI): under load batches fill while the worker computes, and waiting for company only adds latency (2 ms
  of waiting raised the p50 at 192 short queries/s by ~2 ms: ``python tests/probe_half_load.py``).
- FIFO with an age bound: every batch starts with the oldest waiting request, then takes the later
  requests that still fit the budget in arrival order. So short queries may fill the room a long
  passage leaves, but a request waits at most for the requests older than it: none starves.
- No forward holds more than ``max_batch_tokens`` tokens: a request bigger than the budget (many texts, or a long
  text's chunks) runs in slices over consecutive batches, cut between sequences (btlib.serve.slices), and is answered
  once its last slice ran. ``max_request_tokens`` caps a request's tokens after chunking (RequestTooLarge: 413).
- A bounded queue, ``max_queue`` texts: a request that does not fit is refused at once with
  :class:`Overloaded` (an HTTP server answers 429), never dropped silently or queued without bound; with
  ``max_wait_s``, also a request whose expected wait (tokens queued ahead and its own, at the measured rate) is
  longer (btlib.serve.admission), from the first request on: the worker times a full batch at start. An accepted
  request is always answered.

One OpenMP pool (btlib.openmp): the worker runs every forward, so the thread that builds the batcher releases its own
pool; two pools on 2 CPUs put libgomp in its throttled mode (a one-query forward took 7.4 ms instead of 3.3).

Warm threads at light load (btlib.openmp.KeepWarm): for ``keep_warm_ms`` (50) after each batch, the idle worker runs a
tiny parallel region every 2 ms, so its OpenMP threads still spin when the next request comes (asleep, they took ~8 ms
to wake on a 2-core VM: tests/probe_lone_request.py), at the price of a core spinning for that window.

Tokenized once (btlib.serve.queue): a request is tokenized at submit, prompt included; the queue holds those ids
and the model runs them (``model.encode_tokens``), so the budget counts exactly the tokens a forward sees. A model
without ``tokens`` / ``encode_tokens`` is counted by its tokenizer and runs ``encode(texts)``. Items are texts, or
(query, text) pairs for a cross-encoder (btlib.serve.rerank.PairScorer): the same queue serves /rerank.

Answers are what ``model.encode`` gives for the texts of the batch they ran in: a batch's output is
``model.encode(all its texts)`` (as ``encode_tokens`` of their ids, bit for bit) split by request, so a request
run alone within the budget equals ``model.encode`` of it bit for bit. Batched with others, or cut into slices, a row
agrees to fp32 rounding: with fp32 MKL on an AVX2 Zen 3 a row's last bits depend on the number of rows in the GEMM
(differences ~2e-7, measured).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Sequence

from torch import Tensor

from ..openmp import KeepWarm, lower_priority, release_caller_pool
from ..precision import ENCODE_PRECISIONS, check_precision
from ..pretrained.encoding import Tokens
from .admission import Overloaded, check_settings, refusal, start_rate
from .queue import Encoder, InputTooLong, Item, Request, RequestTooLarge, check_items, runs_tokens, tokenize
from .slices import Slice, deliver, encode_slices, take
from .stats import BatcherStats

__all__ = ["BatchEncoder", "Overloaded", "InputTooLong", "RequestTooLarge", "Encoder"]


class BatchEncoder:
    """Thread-safe dynamic batcher around ``model.encode`` (see the module docstring for the policy).

    model: a loaded encoder (``btlib.load_pretrained(...)``: BERT family or ModernBERT), or anything with
    its ``tokenizer``, ``max_length`` and ``encode``. max_batch_tokens: token budget of one forward pass (a request
    bigger than it runs in slices; one sequence longer than it runs alone). max_request_tokens: a request's tokens at
    most, after chunking (None: no cap; more is refused with :class:`RequestTooLarge`). max_wait_ms: how long a batch
    may wait to fill, >= 0. max_queue: texts waiting at most; more is refused with :class:`Overloaded`.
    max_batch_requests: requests (slices) per batch at most (None: only the token budget counts). max_wait_s: refuse a
    request whose expected wait, (tokens queued ahead + its tokens) / tokens per second, exceeds it (None: the count cap
    only); the rate is a full batch timed by the worker at start, then the batches that ran. Not ``max_wait_ms``,
    which is how long a batch waits to fill. precision: passed to ``encode`` (checked here, once, against the model's
    own ``PRECISIONS``: a server started with int8 on a family without an int8 twin is refused at start).
    worker_nice: the worker thread's nice value, 0-19 (None: as the caller's; Linux sets it per thread, and the
    worker's OpenMP threads inherit it): a server's event loop and its clients then run first when they wake.
    keep_warm_ms: for how long after each batch the idle worker keeps its OpenMP threads spinning
    (btlib.openmp.KeepWarm; 0: off). A model whose forward runs off torch's threads (ONNX Runtime, a GPU) passes 0.
    """

    def __init__(self, model: Encoder, *, max_batch_tokens: int = 512, max_wait_ms: float = 0.0, max_queue: int = 1024,
                 max_batch_requests: int | None = None, precision: str | None = None,
                 max_wait_s: float | None = None, worker_nice: int | None = None, keep_warm_ms: float = 50.0,
                 max_request_tokens: int | None = None):
        check_settings(max_batch_tokens=max_batch_tokens, max_wait_ms=max_wait_ms, max_queue=max_queue,
                       max_batch_requests=max_batch_requests, max_wait_s=max_wait_s, worker_nice=worker_nice,
                       keep_warm_ms=keep_warm_ms, max_request_tokens=max_request_tokens)
        self.keep_warm_s, self.worker_nice, self.max_request_tokens = keep_warm_ms / 1e3, worker_nice, max_request_tokens
        if getattr(model, "tokenizer", None) is None or not hasattr(model, "encode"):
            raise TypeError("model needs a tokenizer and encode(): pass btlib.load_pretrained(...) (a model made by "
                            "from_config without a tokenizer cannot count tokens)")
        self.model = model
        self.precision = check_precision(precision, getattr(model, "PRECISIONS", ENCODE_PRECISIONS),
                                         who=getattr(model, "WHO", None) or type(model).__name__)
        self.max_batch_tokens, self.fill_wait_s, self.max_queue = max_batch_tokens, max_wait_ms / 1e3, max_queue
        self.max_wait_s = max_wait_s
        self.max_batch_requests = max_batch_requests
        self.stats = BatcherStats()
        self._queue: deque[Request] = deque()
        self._runs_tokens = runs_tokens(model)
        self._queued_texts = 0
        self._queued_tokens = 0
        self._closed = False
        self._cond = threading.Condition()
        # The worker's forwards get their own OpenMP pool; the constructing thread's (it loaded the model) would make
        # the process's OpenMP threads outnumber the CPUs, and libgomp then all but stops spinning (btlib.openmp).
        release_caller_pool()
        self._started, self._start_error = threading.Event(), None
        self._worker = threading.Thread(target=self._run, name="btlib-batch-encoder", daemon=True)
        self._worker.start()
        self._started.wait()  # with max_wait_s, the worker has timed a full batch: the bound holds from the first request
        if self._start_error is not None:
            raise RuntimeError(f"the model failed a full batch at start: {self._start_error}") from self._start_error

    # -- callers -----------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[Item], *, truncate: bool | str = True, prompt_name: str | None = None,
                 chunk_overlap: int | None = None) -> Tokens:
        """``texts`` tokenized once, as the model runs them, prompt included: what :meth:`submit` queues. truncate=False
        ("refuse"): InputTooLong past ``max_length``; "chunk": chunks of max_length sharing ``chunk_overlap`` tokens
        (btlib.pretrained.chunking). ValueError for an unknown prompt_name (btlib.serve.queue.tokenize)."""
        return tokenize(self.model, list(texts), truncate=truncate, prompt_name=prompt_name, chunk_overlap=chunk_overlap,
                        max_tokens=self.max_request_tokens)

    def count_tokens(self, texts: Sequence[Item], *, truncate: bool = True, prompt_name: str | None = None) -> list[int]:
        """Tokens per text (pair) as the model will see them, its prompt included: :meth:`tokenize`'s lengths."""
        return self.tokenize(texts, truncate=truncate, prompt_name=prompt_name).lengths()

    def submit(self, texts: Sequence[Item], *, truncate: bool | str = True, prompt_name: str | None = None,
               output: str | None = None, chunk_overlap: int | None = None) -> Future:
        """Queue ``texts`` (a list of str, or of (str, str) pairs); returns a Future of their (len(texts), d) float32 rows.

        prompt_name: one of the model's prompts (sentence-transformers' config_sentence_transformers.json), put
        before each text; None: the folder's default prompt, if any. The prompt's tokens count wherever tokens
        count: the length limit, the token budget, and the future's ``tokens`` attribute (the request's token
        count, what OpenAI's API reports as usage). output: passed to ``model.encode_tokens`` (None: the model's
        rows; "unnormalized"; "token_embeddings": the future holds (sum(future.lengths), d) token states).
        truncate: True cuts a text at max_length; False ("refuse") raises InputTooLong; "chunk" runs its chunks (in
        the same batches as everything else) and answers their pooled row (:meth:`tokenize`): the future's ``tokens``
        and ``lengths`` are then the chunks' (what ran), ``chunks`` the chunks per text.
        Once done, the future says where its time went (seconds; TEI's x-*-time headers): ``tokenize_s``,
        ``queue_s`` (submit to its first batch's start), ``inference_s`` (the forwards its slices ran in).

        Raises at once, queueing nothing: :class:`Overloaded` when the queue has no room, InputTooLong
        (truncate=False and a text too long with its prompt), RequestTooLarge (past ``max_request_tokens``),
        TypeError for texts that are not a list of str or pairs, ValueError for a text with a lone surrogate, an
        unknown prompt_name, an output the model cannot give or more texts than ``max_queue``, RuntimeError after
        :meth:`close`.
        """
        texts = check_items(texts)
        self._check_output(output, len(texts))
        start = time.perf_counter()
        self.admit(len(texts))  # refused by what is queued ahead alone: no tokenizing
        if not texts:
            future: Future = Future()
            future.tokens, future.lengths, future.tokenize_s, future.queue_s, future.inference_s = 0, [], 0.0, 0.0, 0.0
            future.chunks = []
            future.set_result(self.model.encode([], batch_size=1, precision=self.precision))
            return future
        ids = self.tokenize(texts, truncate=truncate, prompt_name=prompt_name, chunk_overlap=chunk_overlap)  # it runs
        return self._queue_request(texts, ids, prompt_name, output, start)

    def submit_tokens(self, tokens: Tokens, *, output: str | None = None) -> Future:
        """Queue token ids as they are (a client's token-id input: no special tokens added, no prompt); as
        :meth:`submit` otherwise. ``tokens``: :class:`btlib.pretrained.encoding.Tokens`, checked by the caller
        (ids within the vocabulary, lengths within max_length). ValueError for a model that does not run token ids
        (one without ``encode_tokens``)."""
        if not self._runs_tokens:
            raise ValueError("this model is run from texts only (it has no encode_tokens): send text inputs")
        self._check_output(output, len(tokens))
        if not len(tokens) or not all(tokens.lengths()):
            raise ValueError("every token-id input needs one token at least")
        return self._queue_request(list(tokens.ids), tokens, None, output, time.perf_counter())

    def _check_output(self, output: str | None, n: int) -> None:
        if output is not None and (not self._runs_tokens or output not in getattr(self.model, "OUTPUTS", ())):
            raise ValueError(f"output={output!r}: this model gives its rows only")
        if n > self.max_queue:
            raise ValueError(f"{n} texts in one request exceed max_queue={self.max_queue}; split the request")

    def _queue_request(self, texts: list, ids: Tokens, prompt_name: str | None, output: str | None, start: float) -> Future:
        future: Future = Future()
        future.lengths = ids.lengths()
        future.chunks = ids.chunks if ids.chunks is not None else [1] * len(texts)
        tokens = future.tokens = sum(future.lengths)
        if self.max_request_tokens is not None and tokens > self.max_request_tokens:
            chunks = f" in {len(ids)} chunks" if ids.chunks is not None and len(ids) > len(texts) else ""
            raise RequestTooLarge(f"this request is {tokens:,} tokens{chunks}, more than this server's max_request_tokens="
                                  f"{self.max_request_tokens:,}; split it, or truncate its long inputs")
        arrival = time.perf_counter()
        future.tokenize_s = arrival - start
        with self._cond:
            if self._closed:
                raise RuntimeError("this BatchEncoder is closed")
            if (refused := self._refusal(len(texts), tokens)) is not None:
                self.stats.refuse()
                raise refused
            self._queue.append(Request(texts, tokens, arrival, future, prompt_name, ids, output, lengths=future.lengths))
            self._queued_texts += len(texts)
            self._queued_tokens += tokens
            self.stats.accepted(len(texts))
            self._cond.notify()
        return future

    def encode(self, texts: Sequence[Item], *, timeout: float | None = None, truncate: bool = True,
               prompt_name: str | None = None) -> Tensor:
        """Blocking :meth:`submit`: the (len(texts), d) float32 embeddings."""
        return self.submit(texts, truncate=truncate, prompt_name=prompt_name).result(timeout)

    async def aencode(self, texts: Sequence[Item], *, truncate: bool = True, prompt_name: str | None = None) -> Tensor:
        """:meth:`submit` awaited from asyncio (the event loop keeps running while the batch computes)."""
        return await asyncio.wrap_future(self.submit(texts, truncate=truncate, prompt_name=prompt_name))

    def queue_depth(self) -> tuple[int, int]:
        """(requests, texts) waiting now."""
        with self._cond:
            return len(self._queue), self._queued_texts

    def snapshot(self) -> dict:
        """:attr:`stats` counters and percentiles plus the queue gauges (queue_requests, queue_texts)."""
        requests, texts = self.queue_depth()
        return {**self.stats.snapshot(), "queue_requests": requests, "queue_texts": texts}

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests, answer every accepted one, stop the worker (waits up to ``timeout`` s)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join(timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "BatchEncoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def admit(self, n_texts: int) -> None:
        """Raise :class:`Overloaded` (counted as a refusal) if ``n_texts`` more texts would be refused whatever their
        tokens: the queue's count cap, or the expected wait of the tokens already queued past ``max_wait_s``. Cheap
        (no tokenizing): :meth:`submit` and the HTTP server call it first; the check on the request's own tokens
        follows when it is queued. More texts than max_queue pass here: :meth:`submit` refuses them by name."""
        if n_texts > self.max_queue:
            return
        with self._cond:
            refused = self._refusal(n_texts, 0)
        if refused is not None:
            self.stats.refuse()
            raise refused

    def _refusal(self, n_texts: int, tokens: int) -> Overloaded | None:
        """btlib.serve.admission.refusal on the queue as it is now (lock held)."""
        return refusal(queued_texts=self._queued_texts, queued_tokens=self._queued_tokens, texts=n_texts, tokens=tokens,
                       max_queue=self.max_queue, max_wait_s=self.max_wait_s, tokens_per_s=self.stats.tokens_per_s())

    # -- the worker --------------------------------------------------------------------------
    def _full(self) -> bool:
        return self._queued_tokens >= self.max_batch_tokens or len(self._queue) >= (self.max_batch_requests or 1 << 62)

    def _take(self) -> list[Slice]:
        """The next batch of slices (btlib.serve.slices.take; lock held)."""
        batch = take(self._queue, self.max_batch_tokens, self.max_batch_requests)
        self._queued_texts -= sum(len(s.request.texts) for s in batch if s.last)
        self._queued_tokens -= sum(s.tokens for s in batch)
        return batch

    def _run(self) -> None:
        lower_priority(self.worker_nice)  # before the first forward starts the OpenMP pool
        try:
            if self.max_wait_s is not None:  # on this thread: its OpenMP pool is the one the forwards run on
                self.stats.prime(*start_rate(self.model, self.max_batch_tokens, self.precision, self._runs_tokens))
        except Exception as e:  # noqa: BLE001 - the constructor raises it
            self._start_error = e
            return
        finally:
            self._started.set()
        warm = KeepWarm(self.keep_warm_s)
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    wait = warm.next_wait()
                    if not self._cond.wait(wait) and not self._queue and not self._closed:
                        break  # a keep-warm tick is due (timed out with nothing queued): run it without the lock
                if not self._queue and not self._closed:
                    batch = None
                elif not self._queue:
                    return  # closed and drained
                else:
                    deadline = self._queue[0].arrival + self.fill_wait_s
                    while not self._closed and not self._full() and (left := deadline - time.perf_counter()) > 0:
                        self._cond.wait(left)
                    batch = self._take()
            if batch is None:
                try:
                    warm.tick()
                except Exception:  # noqa: BLE001 - a tick is an optimisation: never a reason for the worker to stop
                    warm = KeepWarm(0)  # and never tried again; the accepted requests are still answered
                continue
            self._run_batch([s for s in batch if s.start or s.request.future.set_running_or_notify_cancel()])
            warm.touch()

    def _run_batch(self, batch: list[Slice]) -> None:
        """One forward for the batch; if it raises, each slice again on its own, so that an input the checks at submit
        did not catch fails only the request that sent it (its slices not run yet leave the queue), not every request
        that shared its batch."""
        for s in batch:
            if not s.request.future.running():  # cancelled, or failed in an earlier slice
                self._drop(s.request)
        batch = [s for s in batch if s.request.future.running()]
        if not batch:
            return
        t0 = time.perf_counter()
        try:
            parts, error = encode_slices(self.model, batch, self._runs_tokens, self.precision), None
        except Exception as e:  # noqa: BLE001 - the error belongs to the callers of this batch, not to the worker
            parts, error = None, e
        done = time.perf_counter()
        sequences = sum(s.sequences for s in batch)
        if error is not None and len(batch) > 1:
            self.stats.batch(sequences, 0, done - t0, [], failed=True)  # its tokens count when their retry runs
            for s in batch:
                self._run_batch([s])
            return
        if error is not None:
            self._drop(batch[0].request)
        finished_ms = deliver(self.model, batch, parts, error, t0, done)
        self.stats.batch(sequences, sum(s.tokens for s in batch), done - t0, finished_ms, failed=error is not None)

    def _drop(self, r: Request) -> None:
        """A failed request's slices not taken yet leave the queue (it is answered with the error now)."""
        with self._cond:
            if r.taken < len(r.lengths) and r in self._queue:
                self._queue.remove(r)
                self._queued_texts -= len(r.texts)
                self._queued_tokens -= sum(r.lengths[r.taken:])
