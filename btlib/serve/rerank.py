"""Reranking through the same batcher: a cross-encoder's (query, text) pairs are the items of a :class:`BatchEncoder`.

    scorer = PairScorer(btlib.load_reranker("path/to/ms-marco-MiniLM-L-6-v2"))
    batcher = BatchEncoder(scorer, max_batch_tokens=512)              # queue, token budget, 429, drain: unchanged
    logits = batcher.encode([("what is packing?", "Packing drops the padding.")])   # (1, 1) float32
    rank_scores(logits, raw_scores=False)                              # [(0, 0.73...)]: POST /rerank's answer

Why no batcher of its own: what the batcher owns (a bounded queue counted in items, a token budget per
forward, FIFO with an age bound, Overloaded -> 429, answer-everything-then-stop on close) does not
depend on what an item is. A pair costs its tokens as a text does ([CLS] q [SEP] d [SEP] is one packed
sequence), the tokenizer counts (and truncates, longest-first) pairs as ``Reranker.predict`` feeds
them, and ``model.encode(items, batch_size=, precision=)`` is the one call a batch makes. So a
reranker only needs an Encoder face, this class; the server holds one model, hence one batcher, and
/rerank requests are its only traffic.

Scores as text-embeddings-inference's /rerank gives them: ``raw_scores`` false applies the sigmoid to the
logit (TEI does so for every single-label model, whatever the folder's CrossEncoder activation), true
gives the logit. So the answer equals ``reranker.rank(query, texts, activation="sigmoid")`` (or
``"identity"``), which for a folder without an activation_fn in its config.json is plain ``rank``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from ..pretrained.encoding import Tokens

__all__ = ["PairScorer", "rank_scores", "is_reranker_folder"]


class PairScorer:
    """A :class:`btlib.pretrained.reranker.Reranker` with num_labels 1 as a BatchEncoder's model.

    tokenizer, max_length: the reranker encoder's (pairs truncated longest-first to max_length).
    encode(pairs, batch_size=, precision=) -> (len(pairs), 1) float32 logits: ``predict(activation="identity")``;
    tokens(pairs) and encode_tokens(tokens, ...): the same, tokenized once (what the batcher runs).
    scores_pairs: how create_app tells a reranker's batcher from an embedding model's (a wrapper may forward it).
    """

    scores_pairs = True

    def __init__(self, reranker):
        if getattr(reranker, "num_labels", None) != 1:
            raise ValueError(f"/rerank needs one score per pair; this model has num_labels "
                             f"{getattr(reranker, 'num_labels', None)}: serve a single-label cross-encoder "
                             "(btlib.load_reranker's folders with one label, e.g. ms-marco-MiniLM-L-6-v2)")
        self.reranker = reranker
        self.tokenizer, self.max_length = reranker.encoder.tokenizer, reranker.encoder.max_length
        # the precisions predict takes (the batcher checks --precision against them at start) and whose they are
        self.PRECISIONS, self.WHO = reranker.encoder.PRECISIONS, reranker.encoder.WHO or "this reranker"

    def encode(self, pairs: Sequence[tuple[str, str]], *, batch_size: int, precision: str | None) -> Tensor:
        if not pairs:
            return torch.empty(0, 1)
        logits = self.reranker.predict(pairs, batch_size=batch_size, activation="identity", precision=precision)
        return logits.unsqueeze(-1)  # (N,) -> (N, 1)

    def tokens(self, pairs: Sequence[tuple[str, str]], *, prompt_name: str | None = None) -> Tokens:
        """The pairs tokenized once, as predict runs them (the batcher's queue holds them); a cross-encoder takes
        no prompt."""
        if prompt_name is not None:
            raise ValueError(f"prompt_name={prompt_name!r}: this model takes no prompts; leave prompt_name out")
        return self.reranker.tokens(pairs)

    def encode_tokens(self, tokens: Tokens, *, batch_size: int, precision: str | None) -> Tensor:
        """:meth:`encode` of pairs :meth:`tokens` tokenized: (len(tokens), 1) float32 logits, the same bits."""
        logits = self.reranker.predict_tokens(tokens, batch_size=batch_size, activation="identity", precision=precision)
        return logits.unsqueeze(-1)  # (N,) -> (N, 1)


def rank_scores(logits: Tensor, raw_scores: bool) -> list[tuple[int, float]]:
    """(index, score) of one request's (N, 1) logits, highest first (ties: lower index first, as Reranker.rank).

    raw_scores false: sigmoid(logit), computed on this request's rows alone, as ``predict`` computes it on its
    own batch (so a request answered alone equals predict bit for bit).
    """
    scores = (logits if raw_scores else torch.sigmoid(logits)).squeeze(-1).tolist()
    return sorted(enumerate(scores), key=lambda p: (-p[1], p[0]))


def is_reranker_folder(folder: str | Path) -> bool:
    """Whether ``folder``'s config.json names a *ForSequenceClassification architecture (TEI's test for a reranker)."""
    path = Path(folder) / "config.json"
    try:
        architectures = json.loads(path.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False  # no readable config: load_pretrained says what is wrong with the folder
    return bool(architectures) and str(architectures[0]).endswith("ForSequenceClassification")
