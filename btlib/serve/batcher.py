"""A packed dynamic batcher: many callers' texts, one padding-free forward pass per batch.

    batcher = BatchEncoder(btlib.load_pretrained(), max_batch_tokens=512)
    emb = batcher.encode(["what is packing?"])        # (1, 384) float32, blocking
    fut = batcher.submit(["a", "b"])                   # concurrent.futures.Future of a (2, 384) tensor
    emb = await batcher.aencode(["from asyncio"])      # inside a coroutine
    batcher.close()                                    # answers everything accepted, then stops

Why packing matters here: a server's requests arrive with mixed lengths. A padded batcher pays
``batch x longest`` tokens, so one 256-token passage among 31 ten-token queries makes the batch cost
8,192 tokens instead of 566; btlib's ``encode`` packs the texts (``cu_seqlens``) and pays only the
real tokens, so the batcher can form batches by a token budget, as text-embeddings-inference does.

Scheduling (one worker thread; TEI's queue):

- Batches fill by a token budget, ``max_batch_tokens`` (and at most ``max_batch_requests`` requests).
  The default, 512, is a CPU budget: a forward costs a fixed part plus a part per token (notebook 09 fits
  both on the machine at hand), and at 512 tokens the per-token part dominates while a full batch stays a
  few tens of milliseconds on 2 CPU threads, so p99 stays within a few batch times; TEI's 16384 is a GPU
  budget (on a CPU, a batch of a second or more).
- A batch waits at most ``max_wait_ms`` after its oldest request arrived for more requests; 0, the default, waits
  nowhere (TEI). The worker is busy during a forward, so under load batches fill without waiting, and a batch that
  waits for company it does not need only adds to its latency: with 2 ms of waiting, the batcher's p50 at 192 short
  queries/s was 6.9-7.4 ms against 5.0-6.0 ms without, and at 512 queries/s, near the knee, p99 92-194 ms against
  56-82 (MiniLM, 2 threads, AMD EPYC Zen 4, two rounds each: ``python tests/probe_half_load.py``).
- FIFO with an age bound: every batch starts with the oldest waiting request, then takes the later
  requests that still fit the budget in arrival order. So short queries may fill the room a long
  passage leaves, but a request waits at most for the requests older than it: none starves.
- A bounded queue, ``max_queue`` texts: a request that does not fit is refused at once with
  :class:`Overloaded` (an HTTP server answers 429), never dropped silently or queued without bound; with
  ``max_wait_s``, also a request whose expected wait (tokens queued ahead and its own, at the measured rate) is
  longer (btlib.serve.admission). An accepted request is always answered.

One OpenMP pool (btlib.openmp): the worker thread runs every forward, so the thread that builds the batcher (the one
that loaded and warmed the model) releases its own OpenMP pool at start. Two pools on 2 CPUs put libgomp's waits in
its throttled mode (a sleep and a wake per parallel region), which made a one-query forward take 7.4 ms in the worker
against 3.3 ms in the main thread (MiniLM, AMD EPYC Zen 4, 2 cores). A caller that runs torch in that thread later
starts a new pool, and with it the slow mode, until the next batcher starts.

Warm threads at light load (btlib.openmp.KeepWarm): for ``keep_warm_ms`` (50) after each batch, the idle worker runs a
tiny parallel region every 2 ms, so its OpenMP threads are still spinning when the next request comes. Left to sleep,
they took ~8 ms to wake on a 2-core VM, and one request at a time 60 ms apart took a p50 of 13.3-14.0 ms against 3.4
kept warm (MiniLM, AMD EPYC Zen 5: ``python tests/probe_lone_request.py --gap-ms 60 [--keep-warm-ms 0]``). The price
is a core spinning for that window after each batch; under load the worker is never idle and never ticks.

Tokenized once (btlib.serve.queue): a request is tokenized at submit, prompt included, and the queue holds those
ids; a batch is packed from them and the model runs them (``model.encode_tokens``), so the budget counts exactly the
tokens each forward sees and no text is tokenized twice. A model without ``tokens`` / ``encode_tokens`` is counted by
its tokenizer at submit and runs ``encode(texts)``.

The items are texts, or (query, text) pairs for a cross-encoder (:class:`btlib.serve.rerank.PairScorer`
is a reranker's Encoder face): a pair costs its tokens like a text, so the same queue, budget and
refusals serve /rerank without a second batcher.

Answers are what ``model.encode`` gives for the texts of the batch they ran in: a batch's output is
``model.encode(all its texts)`` (as ``encode_tokens`` of their ids, bit for bit) split by request, so a request
run alone equals ``model.encode`` of it bit for bit. Whether a row also equals its own ``encode`` when batched with others is the BLAS's
business: with fp32 MKL on an AVX2 Zen 3 a row's last bits depend on the number of rows in the GEMM
(differences ~2e-7, measured), so those answers agree to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Sequence

from torch import Tensor

from ..openmp import KeepWarm, release_caller_pool
from ..precision import ENCODE_PRECISIONS, check_precision
from ..pretrained.encoding import Tokens
from .admission import Overloaded, refusal
from .queue import Encoder, InputTooLong, Item, Request, check_items, encode_batch, runs_tokens, take, tokenize
from .stats import BatcherStats

__all__ = ["BatchEncoder", "Overloaded", "InputTooLong", "Encoder"]


def _positive(name: str, value, kind=int, allow_zero: bool = False) -> None:
    ok = isinstance(value, kind) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ValueError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} {kind.__name__}; got {value!r}")


class BatchEncoder:
    """Thread-safe dynamic batcher around ``model.encode`` (see the module docstring for the policy).

    model: a loaded encoder (``btlib.load_pretrained(...)``: BERT family or ModernBERT), or anything with
    its ``tokenizer``, ``max_length`` and ``encode``. max_batch_tokens: token budget of one forward pass
    (a request bigger than it runs alone). max_wait_ms: how long a batch may wait to fill, >= 0.
    max_queue: texts waiting at most; more is refused with :class:`Overloaded`. max_batch_requests:
    requests per batch at most (None: only the token budget counts). max_wait_s: refuse a request whose expected wait, (tokens queued ahead + its tokens) / the measured tokens per
    second, exceeds it (None: the count cap only; before the first batch measures a rate, the count cap only).
    Not ``max_wait_ms``, which is how long a batch waits to fill. precision: passed to ``encode``
    (checked here, once, against the model's own ``PRECISIONS``: a server started with int8 on a family
    without an int8 twin is refused at start, not with an error at every request). worker_nice: the worker
    thread's nice value, 0-19 (None: as the caller's; Linux sets it per thread, and the worker's OpenMP pool threads,
    started by the worker, inherit it): a server's event loop and its clients then run first when they wake, and the
    forwards take the CPU they leave. ``python -m btlib.serve`` sets 10; see its --worker-nice. keep_warm_ms: for how
    long after each batch the idle worker keeps its OpenMP threads spinning (btlib.openmp.KeepWarm), so that a request
    arriving then does not wait for a sleeping thread to wake (0: off; the price is a core spinning that long). It
    keeps torch's threads warm, so a model whose forward runs elsewhere (ONNX Runtime's own threads, a GPU) passes 0.
    """

    def __init__(self, model: Encoder, *, max_batch_tokens: int = 512, max_wait_ms: float = 0.0, max_queue: int = 1024,
                 max_batch_requests: int | None = None, precision: str | None = None,
                 max_wait_s: float | None = None, worker_nice: int | None = None, keep_warm_ms: float = 50.0):
        _positive("max_batch_tokens", max_batch_tokens)
        if isinstance(keep_warm_ms, bool) or not isinstance(keep_warm_ms, (int, float)) or not 0 <= keep_warm_ms < float("inf"):
            raise ValueError(f"keep_warm_ms must be a finite number >= 0 (milliseconds; 0: off); got {keep_warm_ms!r}")
        self.keep_warm_s = keep_warm_ms / 1e3
        if max_wait_s is not None and (isinstance(max_wait_s, bool) or not isinstance(max_wait_s, (int, float))
                                       or not max_wait_s > 0):
            raise ValueError(f"max_wait_s must be a number > 0 (seconds) or None; got {max_wait_s!r}")
        _positive("max_queue", max_queue)
        if worker_nice is not None and (isinstance(worker_nice, bool) or not isinstance(worker_nice, int)
                                        or not 0 <= worker_nice <= 19):
            raise ValueError(f"worker_nice must be an int in 0..19 (a lower priority than the caller's) or None; "
                             f"got {worker_nice!r}")
        self.worker_nice = worker_nice
        if max_batch_requests is not None:
            _positive("max_batch_requests", max_batch_requests)
        if isinstance(max_wait_ms, bool) or not isinstance(max_wait_ms, (int, float)) or not max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms must be a number >= 0; got {max_wait_ms!r}")
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
        self._worker = threading.Thread(target=self._run, name="btlib-batch-encoder", daemon=True)
        self._worker.start()

    # -- callers -----------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[Item], *, truncate: bool | str = True, prompt_name: str | None = None,
                 chunk_overlap: int | None = None) -> Tokens:
        """``texts`` tokenized once, as the model will run them, its prompt included (``prompt_name``, else the folder's
        default prompt): what :meth:`submit` queues. truncate=False (or "refuse") raises InputTooLong for one past
        ``max_length`` with its prompt; "chunk" cuts it into chunks of max_length, ``chunk_overlap`` tokens shared
        (btlib.pretrained.chunking). ValueError for a prompt_name the model does not have (btlib.serve.queue.tokenize)."""
        return tokenize(self.model, list(texts), truncate=truncate, prompt_name=prompt_name, chunk_overlap=chunk_overlap)

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

        The future also says where its time went once done (seconds, what TEI's x-*-time headers report):
        ``tokenize_s`` (at submit), ``queue_s`` (submit to its batch's start), ``inference_s`` (its batch's forward).

        Raises at once, queueing nothing: :class:`Overloaded` when the queue has no room, InputTooLong
        (truncate=False and a text too long with its prompt), TypeError for texts that are not a list of str or
        pairs, ValueError for a text with a lone surrogate, an unknown prompt_name, an output the model cannot give
        or more texts than ``max_queue``, RuntimeError after :meth:`close`.
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
        arrival = time.perf_counter()
        future.tokenize_s = arrival - start
        with self._cond:
            if self._closed:
                raise RuntimeError("this BatchEncoder is closed")
            if (refused := self._refusal(len(texts), tokens)) is not None:
                self.stats.refuse()
                raise refused
            self._queue.append(Request(texts, tokens, arrival, future, prompt_name, ids, output))
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
        return self._queued_tokens >= self.max_batch_tokens or (
            self.max_batch_requests is not None and len(self._queue) >= self.max_batch_requests)

    def _take(self) -> list[Request]:
        """The oldest request, then later ones that fit the remaining budget, in arrival order (lock held)."""
        batch, self._queue = take(self._queue, self.max_batch_tokens, self.max_batch_requests)
        self._queued_texts -= sum(len(r.texts) for r in batch)
        self._queued_tokens -= sum(r.tokens for r in batch)
        return batch

    def _run(self) -> None:
        if self.worker_nice and hasattr(os, "setpriority"):  # before the first forward starts the OpenMP pool
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.worker_nice)
            except OSError:  # never a reason not to serve; the stats say what the worker runs at
                pass
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
            self._run_batch([r for r in batch if r.future.set_running_or_notify_cancel()])
            warm.touch()

    def _run_batch(self, batch: list[Request]) -> None:
        """One forward for the batch; if it raises, each request again on its own, so that an input the checks at
        submit did not catch fails only the request that sent it, not every request that shared its batch."""
        if not batch:
            return
        texts = [t for r in batch for t in r.texts]
        t0 = time.perf_counter()
        try:
            parts, error = encode_batch(self.model, batch, self._runs_tokens, self.precision), None
        except Exception as e:  # noqa: BLE001 - the error belongs to the callers of this batch, not to the worker
            parts, error = None, e
        done = time.perf_counter()
        if error is not None and len(batch) > 1:
            self.stats.batch(len(texts), 0, done - t0, [], failed=True)  # its tokens count when their retry runs
            for r in batch:
                self._run_batch([r])
            return
        for i, r in enumerate(batch):
            r.future.queue_s, r.future.inference_s = t0 - r.arrival, done - t0  # read by the caller once it is done
            if error is None:
                r.future.set_result(parts[i])
            else:
                r.future.set_exception(error)
        self.stats.batch(len(texts), sum(r.tokens for r in batch), done - t0,
                         [(done - r.arrival) * 1e3 for r in batch], failed=error is not None)
