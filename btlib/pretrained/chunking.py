"""Long inputs: refuse them, truncate them, or chunk them and pool the chunks (encode's ``long_inputs=``).

    long_inputs="truncate"  cut at max_length (the tokenizer's truncation): what encode always did, its default
    long_inputs="refuse"    ValueError naming the first text past max_length (a server's 413)
    long_inputs="chunk"     a text past max_length becomes windows of max_length tokens, each with the model's
                            special tokens (and the prompt) around it, consecutive windows sharing ``overlap`` tokens;
                            every chunk of every text runs in the same packed batches, and a text's row is the
                            token-weighted mean of its chunks' rows, then the model's trailing Normalize

A text within max_length is one chunk whose ids are the ids ``tokens`` gives without chunking, and its row is the one
``encode`` gives, bit for bit. Chunks are pooled *before* the head's trailing Normalize (the weighted mean of
mean-pooled chunks is the mean over all their tokens: for a mean-pooling head the chunks' overlap is the only
difference from one forward over the whole text), then normalised once, as the model normalises a text's row.

Windows over a text's content tokens (no special tokens), ``window`` = max_length less the special tokens and the
prompt's tokens, step = window - overlap; the last window ends at the text's end (it may be shorter):

    windows(10, 4, 1) -> [(0, 4), (3, 7), (6, 10)]
"""

from __future__ import annotations

import numbers
from typing import Sequence

import torch
from torch import Tensor

from ..padding import segment_ids, segment_sum
from .st_modules import NormalizeModule, SentenceHead
from .tokens import Tokens

__all__ = ["LONG_INPUTS", "check_long_inputs", "windows", "default_overlap", "chunk_tokens", "split_head", "pool_chunks",
           "finish_chunks"]

LONG_INPUTS = ("refuse", "truncate", "chunk")


def check_long_inputs(long_inputs: str, chunk_overlap: int | None) -> None:
    """ValueError unless ``long_inputs`` is one of LONG_INPUTS; chunk_overlap (None, or an int >= 0) only with "chunk"."""
    if long_inputs not in LONG_INPUTS:
        raise ValueError(f"long_inputs must be one of {LONG_INPUTS}; got {long_inputs!r}")
    if chunk_overlap is not None:
        if long_inputs != "chunk":
            raise ValueError(f"chunk_overlap={chunk_overlap!r} applies to long_inputs='chunk' only; got "
                             f"long_inputs={long_inputs!r}")
        if isinstance(chunk_overlap, bool) or not isinstance(chunk_overlap, numbers.Integral) or chunk_overlap < 0:
            raise ValueError(f"chunk_overlap must be an int >= 0 (tokens two consecutive chunks share); got {chunk_overlap!r}")


def default_overlap(window: int) -> int:
    """One eighth of the window (31 tokens of MiniLM's 254-token window): context across each cut for ~14% more tokens."""
    return window // 8


def windows(n: int, window: int, overlap: int) -> list[tuple[int, int]]:
    """[start, stop) spans covering tokens 0..n, ``window`` long, each starting ``window - overlap`` after the previous;
    the last one stops at n. n <= window: one span. Example: windows(10, 4, 1) -> [(0, 4), (3, 7), (6, 10)]."""
    if not 0 <= overlap < window:
        raise ValueError(f"chunk_overlap={overlap} must be below the chunk window of {window} content tokens "
                         "(max_length less the special tokens and the prompt)")
    spans, start = [], 0
    while True:
        stop = min(start + window, n)
        spans.append((start, stop))
        if stop >= n:
            return spans
        start += window - overlap


def _untruncated(model):
    """A copy of ``model.tokenizer`` without truncation or padding, made once per tokenizer."""
    cache = model.__dict__.get("_untruncated_tokenizer")
    if cache is None or cache[0] is not model.tokenizer:
        from tokenizers import Tokenizer

        copy = Tokenizer.from_str(model.tokenizer.to_str())
        copy.no_truncation()
        copy.no_padding()
        cache = model.__dict__["_untruncated_tokenizer"] = (model.tokenizer, copy)
    return cache[1]


def chunk_tokens(model, items: Sequence, prompt: str | None, overlap: int | None) -> Tokens:
    """``items`` (str texts) tokenized as ``model._tokens`` does, each text past max_length replaced by its chunks.

    Returns Tokens whose ``ids`` are the chunks in order (a text's chunks one after another) and ``chunks`` the count
    per text. A chunk is prefix + prompt + content[a:b] + suffix, where prefix / suffix are the special tokens the
    tokenizer puts around a text; the split is checked against the tokenizer's own truncated encoding of the text
    (its first chunk must equal it), so a tokenizer whose special tokens are not a fixed prefix and suffix is refused.
    ValueError for pairs, token id lists, a prompt whose tokens change when a text follows it, or an overlap
    >= the window.
    """
    for i, t in enumerate(items):
        if not isinstance(t, str):
            raise ValueError(f"long_inputs='chunk' takes str texts; texts[{i}] is {type(t).__name__} ((a, b) pairs "
                             "are cut longest-first: use long_inputs='truncate' or 'refuse'; token id lists run as given)")
    base = model._tokens(items, prompt)
    long = [i for i, cut in enumerate(base.truncated) if cut]
    if not long:
        return Tokens(base.ids, base.types, base.prompt_length, base.truncated, [1] * len(base.ids))
    tok = _untruncated(model)
    first = tok.encode("a")  # the special tokens around any text: a fixed prefix and suffix (checked below, per text)
    mask = first.special_tokens_mask
    nprefix = next((k for k, s in enumerate(mask) if not s), len(mask))
    nsuffix = next((k for k, s in enumerate(reversed(mask)) if not s), len(mask))
    prefix, suffix = first.ids[:nprefix], first.ids[len(mask) - nsuffix:]
    p_ids = tok.encode(prompt, add_special_tokens=False).ids if prompt else []
    window = model.max_length - len(prefix) - len(suffix) - len(p_ids)
    if window < 1:
        raise ValueError(f"no room to chunk: max_length {model.max_length} leaves {window} tokens beside the special "
                         f"tokens and the prompt's {len(p_ids)}")
    overlap = default_overlap(window) if overlap is None else int(overlap)
    long_set, content = set(long), {}
    for i, enc in zip(long, tok.encode_batch([(prompt or "") + items[i] for i in long], add_special_tokens=False)):
        ids = enc.ids
        if ids[:len(p_ids)] != p_ids:
            raise ValueError(f"texts[{i}]: the prompt {prompt!r:.60} tokenizes differently with the text after it, so "
                             "it cannot be repeated in each chunk; use long_inputs='truncate' or no prompt")
        body = ids[len(p_ids):]
        if prefix + p_ids + body[:window] + suffix != base.ids[i]:
            raise ValueError(f"texts[{i}]: this tokenizer's special tokens are not a fixed prefix and suffix of a text "
                             "(its truncated encoding differs from the first chunk btlib builds), so it cannot be "
                             "chunked; use long_inputs='truncate' or 'refuse'")
        content[i] = body
    ids, counts = [], []
    for i, row in enumerate(base.ids):
        if i not in long_set:
            ids.append(row)
            counts.append(1)
            continue
        spans = windows(len(content[i]), window, overlap)
        ids.extend(prefix + p_ids + content[i][a:b] + suffix for a, b in spans)  # (L_chunk,) each
        counts.append(len(spans))
    types = None if base.types is None else [[0] * len(s) for s in ids]  # single texts: token type 0 throughout
    return Tokens(ids, types, base.prompt_length, [False] * len(ids), counts)


def split_head(head):
    """(body, tail): ``head`` without its trailing Normalize modules and without truncate_dim, and those Normalize
    modules; a head whose Normalize is followed by another module cannot pool chunks before it (ValueError)."""
    modules = list(head.modules)
    tail = []
    while isinstance(modules[-1], NormalizeModule):
        tail.insert(0, modules.pop())
    if any(isinstance(m, NormalizeModule) for m in modules):
        raise ValueError(f"long_inputs='chunk': this head normalises before its last module "
                         f"({[type(m).__name__ for m in head.modules]}), so chunk rows cannot be pooled before the "
                         "normalisation; use long_inputs='truncate' or 'refuse'")
    return SentenceHead(modules, None), tail


def pool_chunks(rows: Tensor, counts: list[int], weights: list[int]) -> Tensor:
    """rows (sum(counts), out) float32, a text's chunks consecutive -> (len(counts), out) float32: each text's
    ``weights``-weighted mean (weights: tokens per chunk). A text of one chunk keeps its row bit for bit."""
    if all(c == 1 for c in counts):
        return rows
    n = torch.tensor(counts)  # (N,) chunks per text
    text = segment_ids(n)  # (C,) the text of each chunk
    w = torch.tensor(weights, dtype=rows.dtype)  # (C,)
    pooled = segment_sum(rows * w[:, None], text, len(counts)) / segment_sum(w, text, len(counts))[:, None]
    single = n == 1
    pooled[single] = rows[n.cumsum(0)[single] - 1]
    return pooled


def finish_chunks(head, rows: Tensor, chunks: list[int], weights: list[int], output: str = "sentence_embedding",
                  full_width: bool = False) -> Tensor:
    """rows (sum(chunks), out) float32, every chunk's row before ``head``'s trailing Normalize (the body of
    :func:`split_head`: ``encode_tokens(output="unnormalized", full_width=True)`` of the chunks as single sequences)
    -> (len(chunks), out') float32: pooled per text (:func:`pool_chunks`, ``weights`` the tokens per chunk), then the
    trailing Normalize (output "sentence_embedding"; "unnormalized" leaves it out), then the head's truncate_dim
    (unless ``full_width``). The rows may come from several forwards (a server's batches), in order."""
    _, tail = split_head(head)
    x = pool_chunks(rows, chunks, weights)  # (texts, out)
    for m in tail if output == "sentence_embedding" else ():
        x = m(x)
    return x if full_width or not head.truncate_dim else x[:, :head.truncate_dim]
