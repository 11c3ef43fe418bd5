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

__all__ = ["Overloaded", "refusal", "retry_after_s"]


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
