"""What one encode call hands from step to step: token ids as tokenized (:class:`Tokens`), packed for a forward
(:class:`PackedTokens`, :func:`pack_ids`), the precision resolved once (:class:`Runner`), and encode's input checks.

btlib.pretrained.encoding runs the loop over them; a server's queue (btlib.serve.queue) keeps :class:`Tokens`
between tokenizing a request and packing its batch, so each text is tokenized once.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from ..padding import lengths_to_cu_seqlens
from ..precision import ENCODE_PRECISIONS, check_precision

__all__ = ["Tokens", "PackedTokens", "pack_ids", "Runner", "check_encode_args", "check_texts", "check_text"]


class PackedTokens(NamedTuple):
    """One batch of token id lists, packed. ids, types: (total,) int64 (types None: 0 everywhere);
    cu_seqlens: (B + 1,) int32; max_seqlen: int."""

    ids: Tensor
    types: Tensor | None
    cu_seqlens: Tensor
    max_seqlen: int


def pack_ids(ids: list[list[int]], types: list[list[int]] | None = None) -> PackedTokens:
    """Token id lists (B of them) -> PackedTokens, straight from the tokenizer: no padding is ever made.

    Example: [[101, 7, 102], [101, 102]] -> ids [101, 7, 102, 101, 102], cu_seqlens [0, 3, 5], max_seqlen 3.
    """
    cu_seqlens, max_seqlen = lengths_to_cu_seqlens(torch.tensor([len(s) for s in ids], dtype=torch.int64))
    flat = torch.tensor([t for s in ids for t in s], dtype=torch.int64)  # (total,)
    tt = None if types is None else torch.tensor([t for s in types for t in s], dtype=torch.int64)
    return PackedTokens(flat, tt, cu_seqlens, max_seqlen)


@dataclass(frozen=True)
class Tokens:
    """Texts tokenized as ``encode`` runs them: what :meth:`SentenceEncoder.tokens` gives and ``encode_tokens`` takes.

    ids: token ids per text, special tokens and the prompt in, truncated to max_length (no padding); types: token
    types per text, or None (0 everywhere, or a family without them); prompt_length: the prompt's tokens at the start
    of every text, which a Pooling with include_prompt false leaves out (None: no prompt; one prompt for all the
    texts, as encode puts one before all its texts); truncated: per text, whether max_length cut it.
    chunks: None, or per text the number of consecutive ``ids`` rows that are its chunks (long_inputs="chunk",
    btlib.pretrained.chunking): ids, types, truncated and lengths() are then per chunk, the forward's sequences.
    """

    ids: list[list[int]]
    types: list[list[int]] | None = None
    prompt_length: int | None = None
    truncated: list[bool] | None = None
    chunks: list[int] | None = None

    def __len__(self) -> int:  # sequences: texts, or chunks where ``chunks`` is set
        return len(self.ids)

    def texts(self) -> int:  # texts: the rows encode_tokens gives
        return len(self.chunks) if self.chunks is not None else len(self.ids)

    def lengths(self) -> list[int]:  # tokens per sequence: what each costs in a forward pass
        return [len(s) for s in self.ids]

    def __getitem__(self, i: slice) -> "Tokens":
        """The sequences i (a slice) of these, with the same prompt length; a forward's batch: no chunk counts."""
        pick = (lambda x: None if x is None else x[i])
        return Tokens(self.ids[i], pick(self.types), self.prompt_length, pick(self.truncated))

    @staticmethod
    def join(parts: Sequence["Tokens"]) -> "Tokens":
        """Several requests' Tokens as one, in order; they must share their prompt length (one prompt per forward)."""
        if len({p.prompt_length for p in parts}) > 1:
            raise ValueError("Tokens of different prompts cannot share a forward: join each prompt's apart")
        types = None if all(p.types is None for p in parts) else [  # 0 where a part has none, as pack_ids reads None
            t for p in parts for t in (p.types if p.types is not None else ([0] * len(s) for s in p.ids))]
        truncated = None if any(p.truncated is None for p in parts) else [t for p in parts for t in p.truncated]
        chunks = None if all(p.chunks is None for p in parts) else [  # 1 per text where a part is not chunked
            c for p in parts for c in (p.chunks if p.chunks is not None else [1] * len(p.ids))]
        return Tokens([s for p in parts for s in p.ids], types, parts[0].prompt_length if parts else None, truncated,
                      chunks)


@dataclass(frozen=True)
class Runner:
    """A precision resolved once: the dtype activations enter the layers in, and the layers that run them
    (``_layers_in``: the family's own stack in that dtype, or BERT's int8 twin, whose linears run in int8 between
    fp32 activations). Every family's ``_forward_packed(tokens, runner)`` takes one."""

    precision: str      # "fp32", "bf16" or "int8"
    dtype: torch.dtype  # the activations' dtype (int8: float32; int8 lives inside the linear layers)
    layers: object      # what the family's _forward_packed runs


def check_encode_args(texts, batch_size: int, path: str, precision: str | None,
                      precisions: tuple[str, ...] = ENCODE_PRECISIONS, who: str | None = None) -> str | None:
    """The argument checks every encoder's ``encode`` shares; returns the precision ("bf16" for path='packed_bf16').

    precision: None or one of ``precisions`` (btlib.precision.check_precision; ``who`` names the model in the
    error for a precision it does not offer). batch_size: a positive Python or numpy integer (numbers.Integral;
    bool is refused).
    """
    check_precision(precision, precisions, who=who)
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
    if isinstance(texts, (str, bytes)):
        raise TypeError("encode takes a list of texts; wrap a single text in a list")
    if not hasattr(texts, "__len__") or not hasattr(texts, "__getitem__"):
        raise TypeError(f"encode takes a list of texts; got {type(texts).__name__} (make it a list first)")
    if path == "packed_bf16":
        if precision not in (None, "bf16"):
            raise ValueError(f"path='packed_bf16' is bf16; got precision={precision!r} (use path='packed' with it)")
        return "bf16"
    return precision


def check_texts(texts: Sequence) -> None:
    """Every item is a str or a (str, str) pair of Unicode text; TypeError naming the first that is not a str or pair,
    ValueError for a lone surrogate (:func:`check_text`)."""
    for i, t in enumerate(texts):
        if isinstance(t, str):
            check_text(t, f"texts[{i}]")
            continue
        if isinstance(t, (tuple, list)) and len(t) == 2 and all(isinstance(x, str) for x in t):
            check_text(t[0], f"texts[{i}][0]")
            check_text(t[1], f"texts[{i}][1]")
            continue
        raise TypeError(f"texts[{i}] is {type(t).__name__} {t!r:.40}; encode takes str texts or (str, str) pairs "
                        "(decode bytes, convert numbers with str(), drop None)")


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, name: str) -> None:
    """ValueError when ``text`` holds a surrogate code point (U+D800-U+DFFF): a str can hold one, but it is not Unicode
    text (a pair is one code point once decoded), so no tokenizer takes it; the Rust tokenizers raised a TypeError
    about their input type. It comes from bytes decoded with errors="surrogateescape" or a JSON "\\ud800" escape."""
    if text.isascii():
        return
    if (m := _SURROGATE.search(text)) is not None:
        raise ValueError(f"{name} holds a lone surrogate (U+{ord(m.group()):04X} at character {m.start()}), which is not "
                         "Unicode text and no tokenizer takes: decode its bytes with errors='replace' (or drop it)")
