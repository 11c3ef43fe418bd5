"""What the batcher's queue holds: each request tokenized once, at submit, as the model will run it.

    tokens = tokenize(model, ["what is packing?"], truncate=True, prompt_name=None)  # btlib.pretrained.encoding.Tokens
    sum(tokens.lengths())                 # the request's cost against max_batch_tokens, and its usage
    model.encode_tokens(Tokens.join([r.tokens for r in batch]), ...)   # the batch, packed from those ids

text-embeddings-inference's router tokenizes a request once and its queue packs input_ids and cu_seq_lengths
straight from those encodings. So does this one where the model can (:func:`runs_tokens`: btlib's encoders and
:class:`btlib.serve.rerank.PairScorer` have ``tokens`` and ``encode_tokens``): the ids at submit are the ids that
run (the prompt in them, its length beside them for a head that leaves it out of the pooling, token types for
pairs), so the budget counts exactly the tokens a forward sees. Another model (anything with a tokenizer and
``encode(texts)``) is counted by its tokenizer at submit and tokenizes its texts again in ``encode``.
"""

from __future__ import annotations

import inspect
import re
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from torch import Tensor

from ..pretrained.chunking import LONG_INPUTS
from ..pretrained.encoding import Tokens, check_texts

__all__ = ["Item", "Encoder", "InputTooLong", "RequestTooLarge", "Request", "check_items", "runs_tokens", "long_mode",
           "tokenize"]

Item = str | tuple[str, str]  # a text, or a (query, text) pair


class Encoder(Protocol):
    """What BatchEncoder needs: btlib's PretrainedEncoder and ModernBertEncoder are ones.

    tokenizer: a ``tokenizers.Tokenizer`` with truncation at ``max_length`` (counts tokens, finds overlong texts).
    encode(texts, batch_size=, precision=) -> (len(texts), d) float32; texts are str, or (str, str) pairs
    for a model that takes pairs (a PairScorer: d = 1, the logit).

    Optional: ``tokens(texts, prompt_name=)`` and ``encode_tokens(tokens, batch_size=, precision=)`` (texts tokenized
    once, at submit, and run from those ids: btlib's encoders and PairScorer have them); else ``encodings(texts,
    prompt_name=)`` (the tokenizer's encodings as encode runs them, the prompt first; without it the tokenizer counts
    the texts alone and prompt_name is refused),
    ``PRECISIONS`` (the precisions encode takes; default btlib.precision.ENCODE_PRECISIONS) and ``WHO`` (the
    model's name in the error for one it lacks).
    """

    tokenizer: object
    max_length: int

    def encode(self, texts: Sequence[Item], *, batch_size: int, precision: str | None) -> Tensor: ...


class InputTooLong(ValueError):
    """A text has more tokens than the model takes and truncation was not allowed (HTTP 413)."""


class RequestTooLarge(ValueError):
    """A request's tokens, after chunking, pass the batcher's ``max_request_tokens`` (HTTP 413): nothing was queued."""


def check_items(texts: object) -> list[Item]:
    """``texts`` as a list of str / (str, str) pairs (a 2-list becomes a tuple, as the tokenizer takes pairs); TypeError else,
    ValueError for a text that is not Unicode (a lone surrogate, btlib.pretrained.encoding.check_text)."""
    if isinstance(texts, str) or not isinstance(texts, (list, tuple)):
        raise TypeError("texts must be a list of str (or of (str, str) pairs); wrap a single text in a list")
    out = []
    for i, t in enumerate(texts):
        if isinstance(t, (tuple, list)) and len(t) == 2 and all(isinstance(x, str) for x in t):
            t = tuple(t)
        elif not isinstance(t, str):
            raise TypeError(f"texts must be a list of str (or of (str, str) pairs); texts[{i}] is {type(t).__name__} {t!r:.40}")
        out.append(t)
    check_texts(out)  # a lone surrogate: ValueError here, at submit, not an error for the whole batch it would join
    return out


@dataclass(eq=False)  # found in the queue by identity (its parts are tensors)
class Request:
    texts: list[Item]
    tokens: int  # what it costs against the budget: sum(ids.lengths())
    arrival: float  # time.perf_counter() at submit
    future: Future
    prompt_name: str | None = None  # None: the folder's default prompt, as encode without one
    ids: Tokens | None = None  # the texts tokenized at submit: what runs, where the model runs tokens
    output: str | None = None  # encode_tokens' output= (None: the model's rows, "sentence_embedding")
    lengths: list[int] = field(default_factory=list)  # tokens per sequence (a text, or a chunk): where slices may cut
    taken: int = 0  # sequences handed to batches so far (btlib.serve.slices.take)
    parts: list[Tensor] = field(default_factory=list)  # the rows of the slices that ran, in order
    rows: Tensor | None = None  # the answer, once the last slice ran (chunks pooled)
    inference_s: float = 0.0  # seconds of the forwards its slices ran in


def runs_tokens(model) -> bool:
    """Whether ``model`` runs from the ids tokenized at submit: it has ``tokens`` and ``encode_tokens``, bound to the
    object whose ``encode`` it is. A wrapper that overrides ``encode`` (to record, hold or fail a batch) and forwards
    the rest to a model by ``__getattr__`` would have its own encode skipped: it is run through encode, as before."""
    encode, run, tokens = (getattr(model, name, None) for name in ("encode", "encode_tokens", "tokens"))
    owner = getattr(encode, "__self__", None)
    return callable(run) and callable(tokens) and owner is not None and getattr(run, "__self__", None) is owner \
        and getattr(tokens, "__self__", None) is owner


def long_mode(truncate: bool | str) -> str:
    """A ``truncate`` argument -> its long_inputs mode: True "truncate", False "refuse", or the mode itself
    ("refuse", "truncate" or "chunk"; btlib.pretrained.chunking). ValueError for anything else."""
    if isinstance(truncate, bool):
        return "truncate" if truncate else "refuse"
    if truncate not in LONG_INPUTS:
        raise ValueError(f"truncate must be a bool or one of {LONG_INPUTS}; got {truncate!r}")
    return truncate


_ALNUM = re.compile(r"[A-Za-z0-9]")


def words(text: str) -> int:
    """A lower bound on ``text``'s tokens in every tokenizer here: its pieces between ASCII spaces that hold an ASCII
    letter or digit. Each pre-tokenizer splits at a space (BERT's, WhitespaceSplit, Metaspace, byte-level BPE's regex)
    and each normalizer keeps such a character, so each piece is a token at least. str.split() counted more: U+001C
    to U+001F are whitespace to Python and not to the tokenizers ("w1\\x1cw2" is one token of a word-level tokenizer),
    and a word the normalizer deletes ("\\x00", "\\ufeff", a lone U+0301 under BERT's strip_accents) is no token, so a
    request under the cap was refused (a 413 claiming "200 words, so 200 tokens at least" for 100 tokens)."""
    return sum(map(bool, map(_ALNUM.search, text.split(" "))))  # ~0.17 s for 1.9 MB of text (0.07 for str.split)


def tokenize(model, texts: list[Item], *, truncate: bool | str, prompt_name: str | None,
             chunk_overlap: int | None = None, max_tokens: int | None = None) -> Tokens:
    """``texts`` tokenized once, as ``model`` will run them, the prompt included (``prompt_name``, else the folder's
    default). truncate (:func:`long_mode`): True cuts at max_length; False ("refuse") raises InputTooLong for one past
    it with its prompt; "chunk" cuts such a text into chunks (``model.tokens(long_inputs="chunk")``: the Tokens carry
    ``chunks``, and their lengths are the chunks' tokens, what the forward computes). ValueError for a prompt_name the
    model does not have, or "chunk" on a model whose ``tokens`` cannot chunk. A model that does not run tokens is
    counted by ``encodings`` (btlib's) or its tokenizer (no prompts then). max_tokens: with "chunk", RequestTooLarge
    before any tokenizing where the texts have more words than that (:func:`words`, a token each at least): counting
    a 2 MB body's 1.3M tokens first took 7 s and ~0.5 GB, only to refuse it."""
    mode = long_mode(truncate)
    if mode == "chunk" and max_tokens is not None:
        n = sum(words(t) for t in texts if isinstance(t, str))
        if n > max_tokens:
            raise RequestTooLarge(f"this request has {n:,} words with a letter or digit, so {n:,} tokens at least once "
                                  f"chunked, more than this server's max_request_tokens={max_tokens:,}; split it, or "
                                  "truncate its long inputs")
    if mode == "chunk":
        if not runs_tokens(model) or "long_inputs" not in inspect.signature(model.tokens).parameters:
            raise ValueError("long_inputs='chunk': this model cannot chunk its inputs (it needs btlib's tokens("
                             "long_inputs=)); truncate or refuse long inputs instead")
        if any(isinstance(t, tuple) for t in texts):
            raise ValueError("long_inputs='chunk' chunks single texts, not (query, text) pairs: truncate or refuse them")
        return model.tokens(texts, prompt_name=prompt_name, long_inputs="chunk", chunk_overlap=chunk_overlap)
    if chunk_overlap is not None:
        raise ValueError(f"chunk_overlap={chunk_overlap!r} applies to long_inputs='chunk' only; got {mode!r}")
    if runs_tokens(model):
        tokens = model.tokens(texts, prompt_name=prompt_name)
    else:
        if hasattr(model, "encodings"):
            encodings = model.encodings(texts, prompt_name=prompt_name)
        elif prompt_name is not None:
            raise ValueError(f"prompt_name={prompt_name!r}: this model takes no prompts; leave prompt_name out")
        else:
            encodings = model.tokenizer.encode_batch(texts)
        tokens = Tokens([e.ids for e in encodings], truncated=[bool(e.overflowing) for e in encodings])
    if mode == "refuse":
        long = [i for i, cut in enumerate(tokens.truncated) if cut]
        if long:
            what = "(query, text) pair" if isinstance(texts[long[0]], tuple) else "input"
            raise InputTooLong(f"{what} {long[0]} has more than {model.max_length} tokens{_prompt_note(model, prompt_name)}, "
                               f"the most this model takes ({len(long)} such inputs); shorten it or allow truncation")
    return tokens


def _prompt_note(model, prompt_name: str | None) -> str:
    """" with its prompt 'query: ' (3 tokens)" where a prompt applies, else ""."""
    if not hasattr(model, "resolve_prompt"):
        return ""
    prompt = model.resolve_prompt(None, prompt_name)
    if not prompt:
        return ""
    return f" with its prompt {prompt!r:.60} ({len(model.tokenizer.encode(prompt, add_special_tokens=False).ids)} tokens)"
