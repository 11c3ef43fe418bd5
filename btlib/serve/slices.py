"""A batch is slices of requests: each request's sequences cut where the token budget ends, its rows put back together.

    batch = take(queue, budget=512, max_requests=None)   # [Slice(request, start, stop), ...]: the oldest request first
    rows = encode_slices(model, batch, runs=True, precision=None)     # one (rows, d) tensor per slice
    deliver(model, batch, rows, None, t0, done)          # kept on their requests; a request answered after its last

Why slices: a request is whatever a client sent, up to ``max_inputs`` texts of ``max_length`` tokens, or, with
long_inputs="chunk", one text of a whole book. Run in one forward, it set that forward's memory and time by itself: a
2 MB body chunked into ~1M tokens is ~25 GB of activations on MiniLM (~23 KB per token), so one request could take the
server down. Cut at sequence boundaries (a text, or one chunk of a text), no forward holds more than
``max_batch_tokens`` tokens, unless one sequence alone is longer (a budget below the model's ``max_length``: the server
refuses that at start, as text-embeddings-inference does).

FIFO with an age bound, and sharing: every batch starts with the oldest request's next sequences; later requests that
fit whole fill the room left, in arrival order. A request that needs more batches than this one takes only half the
budget while others wait, so a short query behind a book waits a batch or two, not the whole book (at the cap, ~61k
tokens: 20 s of MiniLM on 2 threads), and the book still advances every batch. A request's rows wait on it until
its last slice has run; a chunked request then pools its chunks' rows (btlib.pretrained.chunking.finish_chunks), so a
text's answer does not depend on how its chunks were cut into batches beyond fp32 rounding of the GEMMs.

A slice of a chunked request runs "before the Normalize" (``encode_tokens(output="unnormalized", full_width=True)``),
the rows that pooling needs; a plain request sharing that forward gets the head's trailing Normalize and truncate_dim
applied to its rows afterwards, the same operations in the same order as the head applies them in one call.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

from ..pretrained.chunking import finish_chunks
from ..pretrained.encoding import Tokens
from .queue import Encoder, Request

__all__ = ["Slice", "take", "encode_slices", "deliver", "chunked"]


@dataclass(eq=False)
class Slice:
    """Sequences ``start:stop`` of ``request`` (texts, or chunks of its texts): what one batch runs of it."""

    request: Request
    start: int
    stop: int

    @property
    def tokens(self) -> int:
        return sum(self.request.lengths[self.start:self.stop])

    @property
    def sequences(self) -> int:
        return self.stop - self.start

    @property
    def last(self) -> bool:
        """Whether this slice takes the request's last sequence (the request then leaves the queue)."""
        return self.stop == len(self.request.lengths)


def chunked(r: Request) -> bool:
    """Whether ``r`` was tokenized with long_inputs="chunk" (its rows are pooled per text once all have run)."""
    return r.ids is not None and r.ids.chunks is not None


def take(queue: deque[Request], budget: int, max_requests: int | None) -> list[Slice]:
    """The next batch (lock held by the caller): the oldest request's next sequences (one at least, whatever its
    length), then later requests that fit the room left whole, in arrival order (at most ``max_requests`` slices).
    The oldest takes the whole ``budget`` unless it will need more batches than this one and others wait: then it takes
    half, and the others share the rest. Requests whose last sequence is taken leave ``queue``, which keeps its order."""
    head = queue.popleft()
    remaining = sum(head.lengths[head.taken:])
    share = budget // 2 if queue and remaining > budget else budget  # a 60k-token request made a query wait 19 s
    stop, used = head.taken, 0
    while stop < len(head.lengths) and (stop == head.taken or used + head.lengths[stop] <= share):
        used += head.lengths[stop]
        stop += 1
    batch, left = [Slice(head, head.taken, stop)], budget - used
    head.taken = stop
    rest: deque[Request] = deque([head] if stop < len(head.lengths) else [])  # its next slice leads the next batch
    while queue:
        r = queue.popleft()
        if (max_requests is None or len(batch) < max_requests) and r.tokens <= left:
            batch.append(Slice(r, 0, len(r.lengths)))
            r.taken = len(r.lengths)
            left -= r.tokens
        else:
            rest.append(r)
    queue.extend(rest)
    return batch


def encode_slices(model: Encoder, batch: list[Slice], runs: bool, precision: str | None) -> list[Tensor]:
    """Each slice's rows: one forward per prompt and output in the batch (encode puts one prompt before all its texts),
    so a batch of one prompt, the usual case, is one forward: ``encode_tokens`` of the slices' ids tokenized at submit,
    packed together (else ``encode`` of their texts). Rows are per sequence (per token for "token_embeddings"); a
    plain slice that ran before the Normalize (it shared a forward with a chunked one) gets its head's tail here."""
    groups: dict[tuple, list[Slice]] = {}
    for s in batch:  # token-id inputs carry no prompt: they join no prompted request's forward
        r = s.request
        groups.setdefault((r.prompt_name, r.ids.prompt_length if r.ids is not None else None, r.output), []).append(s)
    rows: dict[int, Tensor] = {}
    for (name, _, output), slices in groups.items():
        pre_normalize = any(chunked(s.request) for s in slices)
        if runs:
            ids = Tokens.join([s.request.ids[s.start:s.stop] for s in slices])  # sequences: chunk counts left out
            kw = {"output": "unnormalized", "full_width": True} if pre_normalize else {} if output is None else {"output": output}
            emb = model.encode_tokens(ids, batch_size=len(ids), precision=precision, **kw)  # (len(ids), d)
        else:
            texts = [t for s in slices for t in s.request.texts[s.start:s.stop]]
            prompt = {} if name is None else {"prompt_name": name}
            emb = model.encode(texts, batch_size=len(texts), precision=precision, **prompt)
        sizes = [s.tokens if output == "token_embeddings" else s.sequences for s in slices]  # rows per slice
        for s, part in zip(slices, emb.split(sizes)):
            if pre_normalize and not chunked(s.request):  # pool_chunks keeps single rows as they are: the tail alone
                part = finish_chunks(model.head, part, [1] * s.sequences, s.request.lengths[s.start:s.stop],
                                     output or "sentence_embedding")
            rows[id(s)] = part
    return [rows[id(s)] for s in batch]


def deliver(model: Encoder, batch: list[Slice], parts: list[Tensor] | None, error: Exception | None, t0: float,
            done: float) -> list[float]:
    """After a forward from ``t0`` to ``done`` (perf_counter seconds): each slice's rows kept on its request, and the
    requests it finished answered (their rows, chunks pooled; or ``error``: the batch's one slice failed, and its
    request with it). Returns those requests' latencies in milliseconds."""
    finished_ms = []
    for i, s in enumerate(batch):
        r = s.request
        if s.start == 0:
            r.future.queue_s = t0 - r.arrival  # read by the caller once it is done
        r.inference_s += done - t0
        if error is None:
            _add_rows(model, s, parts[i])
        if error is not None or r.rows is not None:
            r.future.inference_s = r.inference_s
            r.future.set_exception(error) if error is not None else r.future.set_result(r.rows)
            finished_ms.append((done - r.arrival) * 1e3)
    return finished_ms


def _add_rows(model: Encoder, s: Slice, rows: Tensor) -> None:
    """Keep ``rows`` (the slice's) on its request; after its last slice, the request's answer is in ``request.rows``."""
    r = s.request
    r.parts.append(rows)
    if s.last:
        out = r.parts[0] if len(r.parts) == 1 else torch.cat(r.parts)
        if chunked(r):
            out = finish_chunks(model.head, out, r.ids.chunks, r.lengths, r.output or "sentence_embedding")
        r.parts, r.rows = [], out
