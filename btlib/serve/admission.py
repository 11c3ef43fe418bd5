"""Whether the batcher's queue takes a request: a hard count cap, and backpressure by expected wait.

    refusal(queued_texts=10, queued_tokens=900, texts=1, tokens=20, max_queue=1024, max_wait_s=0.5, tokens_per_s=1000)
    # -> Overloaded("expected wait 0.92 s ..."): (900 + 20) tokens / 1000 tokens/s = 0.92 s > max_wait_s

A queue bounded by a count alone refuses too late: 1,024 texts of MiniLM on 2 CPU threads are 10-14 s of waiting, so
200 users waited that long and never saw a 429. ``max_wait_s`` refuses a request whose wait, the tokens queued ahead
of it plus its own drained at the measured rate (``BatcherStats.tokens_per_s``: tokens over model time), would pass
it; before the first batch has measured a rate only the count cap applies. ``max_queue`` stays the hard cap either way.
The check runs twice: once before a request is tokenized, with its tokens taken as 0 (what is ahead alone decides,
and a refusal costs no tokenizing), then on its real tokens under the queue's lock, where it is queued or refused.
"""

from __future__ import annotations

import math
import time

from .queue import tokenize

__all__ = ["Overloaded", "refusal", "retry_after_s", "check_settings", "start_rate"]


class Overloaded(RuntimeError):
    """The queue is full: the request was refused and nothing of it was queued. Retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def retry_after_s(queued_tokens: int, tokens_per_s: float | None) -> int:
    """Seconds until ``queued_tokens`` drain at ``tokens_per_s`` (at least 1; 1 before a rate is measured): Retry-After."""
    return max(1, math.ceil(queued_tokens / tokens_per_s)) if tokens_per_s else 1


def refusal(*, queued_texts: int, queued_tokens: int, texts: int, tokens: int, max_queue: int, max_wait_s: float | None,
            tokens_per_s: float | None) -> Overloaded | None:
    """The :class:`Overloaded` to raise for a request of ``texts`` texts and ``tokens`` tokens arriving behind
    ``queued_texts`` / ``queued_tokens``, or None to queue it. Refused past ``max_queue`` texts, or when
    (queued_tokens + tokens) / tokens_per_s > max_wait_s (None: no wait limit; tokens_per_s None: not measured yet)
    with tokens queued ahead: a request arriving at an empty queue is taken whatever its size."""
    retry = retry_after_s(queued_tokens, tokens_per_s)
    if queued_texts + texts > max_queue:
        return Overloaded(f"queue full: {queued_texts} texts waiting (max_queue={max_queue}); retry later", retry)
    if max_wait_s is not None and tokens_per_s and queued_tokens:  # an empty queue takes any request: else one
        # bigger than max_wait_s of tokens would be refused however often it retried
        wait = (queued_tokens + tokens) / tokens_per_s
        if wait > max_wait_s:
            return Overloaded(f"expected wait {wait:.2f} s ({queued_tokens} tokens queued ahead + {tokens} at "
                              f"{tokens_per_s:.0f} tokens/s) exceeds max_wait_s={max_wait_s:g}; retry later", retry)
    return None


def _number(name: str, value, low: float, *, integer: bool, strict: bool, none: bool = False) -> None:
    if value is None and none:
        return
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not (value > low if strict else value >= low) \
            or value != value or value == float("inf"):
        what = f"{'an int' if integer else 'a finite number'} {'>' if strict else '>='} {low:g}"
        raise ValueError(f"{name} must be {what}{' or None' if none else ''}; got {value!r}")


def check_settings(*, max_batch_tokens, max_wait_ms, max_queue, max_batch_requests, max_wait_s, worker_nice,
                   keep_warm_ms, max_request_tokens) -> None:
    """ValueError naming the first BatchEncoder setting out of its range (btlib.serve.batcher's docstring)."""
    _number("max_batch_tokens", max_batch_tokens, 0, integer=True, strict=True)
    _number("max_wait_ms", max_wait_ms, 0, integer=False, strict=False)
    _number("max_queue", max_queue, 0, integer=True, strict=True)
    _number("max_batch_requests", max_batch_requests, 0, integer=True, strict=True, none=True)
    _number("max_wait_s", max_wait_s, 0, integer=False, strict=True, none=True)
    _number("keep_warm_ms", keep_warm_ms, 0, integer=False, strict=False)
    _number("max_request_tokens", max_request_tokens, 0, integer=True, strict=True, none=True)
    if worker_nice is not None and (isinstance(worker_nice, bool) or not isinstance(worker_nice, int)
                                    or not 0 <= worker_nice <= 19):
        raise ValueError(f"worker_nice must be an int in 0..19 (a lower priority than the caller's) or None; "
                         f"got {worker_nice!r}")


def start_rate(model, budget: int, precision: str | None, runs: bool) -> tuple[int, float]:
    """(tokens, seconds) of one full batch of ``model``: about ``budget`` tokens of filler text in sequences of up to
    ``max_length``, timed after one untimed run (the first forward pays for the OpenMP pool and the kernels' first
    use). What ``max_wait_s`` divides by before any request has run: without it, a burst at a cold server filled the
    whole queue (``--max-wait-s 0.3``: a p50 wait of 8.6 s)."""
    length = max(1, min(budget, model.max_length))
    text = " ".join(["word"] * length)  # one token a word in every tokenizer here; truncated at max_length
    item = (text, text) if getattr(model, "scores_pairs", False) else text
    one = tokenize(model, [item], truncate=True, prompt_name=None)
    items = [item] * max(1, budget // max(1, one.lengths()[0]))
    ids = tokenize(model, items, truncate=True, prompt_name=None)

    def run():
        if runs:
            model.encode_tokens(ids, batch_size=len(ids), precision=precision)
        else:
            model.encode(items, batch_size=len(items), precision=precision)

    run()
    t0 = time.perf_counter()
    run()
    return sum(ids.lengths()), time.perf_counter() - t0
