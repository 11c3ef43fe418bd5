"""The one encode loop every pretrained encoder runs: tokenize -> pack -> forward -> pool -> normalise.

    texts (N)    str, or (a, b) pairs where the family has token types
    tokenize     ids per text, special tokens added, truncated to max_length, no padding; a prompt goes first
    batch        batch_size texts per forward
    pack         ids (total,) int64, cu_seqlens (B + 1,) int32, max_seqlen: lengths [2, 4, 3] -> [0, 2, 6, 9], 4
    forward      h (total, d): the architecture's own layers, in the dtype the precision resolved to
    head         (B, out) float32: the folder's Pooling, Dense, Normalize (``model.head``, btlib.pretrained.st_modules,
                 whose segment sums and masks are btlib.padding's)

:class:`SentenceEncoder` owns every step but the forward. An architecture supplies what differs:
``_forward_packed`` (its embeddings and layers on packed tokens), ``_token_types`` (token types or not),
and where it has them, PyTorch's padded paths (``_forward_padded``), an int8 twin (``int8_encoder``)
and token id lists as texts (``_check_texts``, ``_prepare``, ``_tokens``); its ``PATHS`` and ``PRECISIONS`` say which.
The two architectures: btlib.pretrained.architectures.bert (BERT, RoBERTa, XLM-R, DistilBERT on nn.TransformerEncoder)
and btlib.pretrained.architectures.modernbert_model (ModernBERT). Precision is checked and resolved once per call, here,
through btlib.precision; the slow-precision warnings name the class (``PretrainedEncoder.encode in bf16``).
Tokenize once, run later (a server's queue): ``tokens(texts)`` -> :class:`Tokens` (ids, types, the prompt's length),
``encode_tokens(tokens)`` runs them; ``encode(texts)`` is the two, one batch of texts tokenized at a time.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

import torch
from torch import Tensor, nn

from ..padding import lengths_to_cu_seqlens
from ..precision import ENCODE_PRECISIONS, check_precision, resolve_dtype, warn_if_slow_bf16, warn_if_slow_int8
from .st_modules import HasHead

__all__ = ["SentenceEncoder", "Prompts", "Tokens", "PackedTokens", "pack_ids", "check_encode_args", "check_texts",
           "check_text"]


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
    """

    ids: list[list[int]]
    types: list[list[int]] | None = None
    prompt_length: int | None = None
    truncated: list[bool] | None = None

    def __len__(self) -> int:  # texts
        return len(self.ids)

    def lengths(self) -> list[int]:  # tokens per text: what each costs in a forward pass
        return [len(s) for s in self.ids]

    def __getitem__(self, i: slice) -> "Tokens":  # the texts i (a slice) of these, with the same prompt length
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
        return Tokens([s for p in parts for s in p.ids], types, parts[0].prompt_length if parts else None, truncated)


class Prompts:
    """sentence-transformers' prompts, shared by every encoder: ``prompts``, ``default_prompt_name``, ``special_ids``."""

    tokenizer: object
    prompts: dict[str, str | None]
    default_prompt_name: str | None
    special_ids: frozenset[int]

    def set_prompts(self, prompts: dict[str, str | None] | None, default_prompt_name: str | None,
                    special_ids: frozenset[int] | set[int] = frozenset()) -> None:
        # SentenceTransformer's own defaults: prompt_name="query" / "document" is no prompt unless the folder sets one
        self.prompts = {"query": None, "document": None, **(prompts or {})}
        self.default_prompt_name, self.special_ids = default_prompt_name, frozenset(special_ids)
        self._prompt_lengths: dict[str, tuple[object, int]] = {}

    def prompt_length(self, prompt: str | None) -> int | None:
        """Tokens of ``prompt`` alone, less a trailing special token: what sentence-transformers leaves out of the
        pooling when include_prompt is false. None for no prompt. Kept per prompt and tokenizer (a server asks at
        every request), so the prompt is tokenized alone once."""
        if not prompt:
            return None
        cache = self.__dict__.setdefault("_prompt_lengths", {})
        tokenizer, n = cache.get(prompt, (None, 0))
        if tokenizer is not self.tokenizer:
            ids = self.tokenizer.encode(prompt).ids
            n = len(ids) - (1 if ids and ids[-1] in self.special_ids else 0)
            cache[prompt] = (self.tokenizer, n)
        return n

    def resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str | None:
        """sentence-transformers' rule: prompt wins; else prompts[prompt_name]; else the default prompt, if any."""
        if prompt is not None:
            if not isinstance(prompt, str):
                raise TypeError(f"prompt must be a str; got {type(prompt).__name__}")
            return prompt
        if prompt_name is not None:
            if prompt_name not in self.prompts:
                raise ValueError(f"prompt_name {prompt_name!r} is not one of this model's prompts {sorted(self.prompts)}")
            return self.prompts[prompt_name]
        return self.prompts.get(self.default_prompt_name) if self.default_prompt_name else None


class SentenceEncoder(Prompts, HasHead):
    """tokenize and encode for a pretrained encoder; the architecture fills in the hooks below (module docstring).

    Needs ``tokenizer`` (a tokenizers.Tokenizer, truncating to ``max_length``), ``spec`` (``d_model``) and ``head``.
    """

    PATHS: tuple[str, ...] = ("packed", "packed_bf16")  # "packed_bf16" is "packed" with precision="bf16"
    PRECISIONS: tuple[str, ...] = ENCODE_PRECISIONS
    WHO: str | None = None  # how check_precision names the model when it refuses a precision btlib knows

    tokenizer: object
    max_length: int

    # -- tokens ------------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str | tuple[str, str]]) -> list[list[int]]:
        """Token ids per text (or pair), with the special tokens, truncated to ``max_length``; no padding."""
        return [e.ids for e in self._encodings(texts, None)]

    def encodings(self, texts: Sequence[str | tuple[str, str]], *, prompt_name: str | None = None,
                  prompt: str | None = None) -> list:
        """The tokenizer's encodings of ``texts`` as :meth:`encode` runs them: the prompt that ``prompt`` /
        ``prompt_name`` (or the folder's default) resolves to goes first, so ``len(e.ids)`` is the tokens a text
        costs and ``e.overflowing`` says it was cut at ``max_length``. What a server counts against its token budget
        and its length limit, and reports as usage: counting without the prompt undercounted every text by the
        prompt's tokens (and let a text within max_length alone but past it with the prompt be truncated unseen)."""
        check_texts(texts)
        return self._encodings(texts, self.resolve_prompt(prompt, prompt_name))

    def tokens(self, texts: Sequence[str | tuple[str, str]] | Sequence[Sequence[int]], *, prompt_name: str | None = None,
               prompt: str | None = None) -> Tokens:
        """``texts`` tokenized once, exactly as :meth:`encode` with the same prompt / prompt_name runs them (checks,
        prompt, truncation, special tokens, token types of pairs, the prompt's length for the head): pass the result
        to :meth:`encode_tokens`. ``lengths()``: what each text costs; ``truncated``: which max_length cut."""
        if isinstance(texts, (str, bytes)):
            raise TypeError("tokens takes a list of texts; wrap a single text in a list")
        self._check_texts(texts)
        prompt = self.resolve_prompt(prompt, prompt_name)
        return self._tokens(self._prepare(texts, prompt), prompt)

    def _encodings(self, texts: Sequence[str | tuple[str, str]], prompt: str | None) -> list:
        """The tokenizer's encodings of ``texts``, the prompt before each text (a pair's first text)."""
        if prompt:
            texts = [prompt + t if isinstance(t, str) else (prompt + t[0], t[1]) for t in texts]
        return self.tokenizer.encode_batch([t if isinstance(t, str) else tuple(t) for t in texts])

    # -- what an architecture supplies -------------------------------------------------------
    def _check_path(self, path: str) -> None:
        if path not in self.PATHS:
            raise ValueError(f"path must be one of {self.PATHS}; got {path!r}")

    def _check_texts(self, texts: Sequence) -> None:
        """Before the prompt is known: str texts or (str, str) pairs (a family that takes token ids overrides it)."""
        check_texts(texts)

    def _prepare(self, texts: Sequence, prompt: str | None) -> Sequence:
        """The texts, ready to batch; a family that checks every text up front (token id lists) does it here."""
        return texts

    def _tokens(self, items: Sequence, prompt: str | None) -> Tokens:
        """``_prepare``'s items tokenized once, the prompt before each (a family taking id lists overrides it)."""
        enc = self._encodings(items, prompt)
        return Tokens([e.ids for e in enc], self._token_types(items, enc), self.prompt_length(prompt),
                      [bool(e.overflowing) for e in enc])

    def _token_types(self, items: Sequence, encodings: list) -> list[list[int]] | None:
        """Token types per text from the tokenizer's ``encodings`` of ``items``, or None for all-0 (the default)."""
        return None

    def _forward_packed(self, tokens: PackedTokens, dtype: torch.dtype, quantized: nn.Module | None) -> Tensor:
        """Last hidden states (total, d) of packed tokens, computed in ``dtype`` (or by ``quantized``, the int8
        twin from :meth:`int8_encoder`, where precision is "int8")."""
        raise NotImplementedError

    def _forward_padded(self, ids: list[list[int]], types: list[list[int]] | None, path: str) -> tuple[Tensor, Tensor]:
        """A padded path of ``PATHS`` (PyTorch's own modules): the real tokens' states (total, d) float32, packed
        as the head takes them, and cu_seqlens (B + 1,) int32."""
        raise NotImplementedError(f"{type(self).__name__} has no padded path {path!r}")

    def int8_encoder(self) -> nn.Module:
        """The int8 twin that ``precision="int8"`` runs (where "int8" is in ``PRECISIONS``)."""
        raise NotImplementedError(f"{type(self).__name__} has no int8 twin")

    def resolve_precision(self, precision: str | None, what: str) -> tuple[torch.dtype, nn.Module | None]:
        """A checked precision -> (the dtype ``_forward_packed`` runs in, the int8 twin or None); the slow-precision
        warnings once per ``what`` ("PretrainedEncoder.encode"), pointing at the caller of the method that called this
        one (encode's caller, Reranker.predict's caller)."""
        quantized = None
        if precision == "int8":
            warn_if_slow_int8(f"{what} in int8", stacklevel=4)
            quantized, precision = self.int8_encoder(), "fp32"  # int8 inside the linear layers; fp32 in and out
        if precision == "bf16":
            warn_if_slow_bf16(f"{what} in bf16", stacklevel=4)
        return resolve_dtype(precision), quantized

    # -- the loop ----------------------------------------------------------------------------
    def encode(self, texts: Sequence[str | tuple[str, str]] | Sequence[Sequence[int]], *, batch_size: int = 64,
               path: str = "packed", precision: str | None = None, prompt_name: str | None = None,
               prompt: str | None = None) -> Tensor:
        """Sentence embeddings (N, out) float32, as sentence-transformers computes them (the folder's modules, in order).

        texts: str; (a, b) pairs where the model has token types ([CLS] a [SEP] b [SEP], token type 1 on b where
        the tokenizer hands token types to the model, truncation longest-first); ModernBERT also takes token id
        lists as :meth:`tokenize` gives them (checked; an empty list is refused: it has no embedding).
        prompt / prompt_name: sentence-transformers' prompts (prepended to each text; a pair's first text);
        without either, the folder's default_prompt_name applies. A Pooling with include_prompt false leaves the
        prompt's tokens out. Token id lists take no prompt: pass prompt="" with them.
        path: one of ``PATHS``: "packed" (default, no padding anywhere); "packed_bf16" is "packed" with
        precision="bf16"; the BERT family also has PyTorch's "fastpath_nested", "fastpath" (dense) and "slow"
        (fastpath disabled), which run its fp32 nn.TransformerEncoder.
        precision (packed paths only): None or "fp32" (default), "bf16" (explicit: warns once where bf16 is not
        native, with the measured rates), "auto" (bf16 only where native and measured faster:
        btlib.choose_precision() says what it picks here and why), or, for the BERT family, "int8" (explicit
        only, never picked by "auto": int8 linear layers, attention and LayerNorm in fp32, embeddings within
        cosine 0.995 of fp32 on the workbook's corpora; see btlib.quant; warns once where this CPU's int8
        matmuls are not faster than fp32).
        batch_size: texts per forward, >= 1 (a Python or numpy integer).
        """
        self._check_path(path)
        precision = check_encode_args(texts, batch_size, path, precision, self.PRECISIONS, who=self.WHO)
        self._check_texts(texts)
        batch_size, path = int(batch_size), self._check_packed(path, precision)
        prompt = self.resolve_prompt(prompt, prompt_name)
        items = self._prepare(texts, prompt)
        dtype, quantized = self.resolve_precision(precision, f"{type(self).__name__}.encode")
        batches = (self._tokens(items[i:i + batch_size], prompt) for i in range(0, len(items), batch_size))
        return self._run(batches, path, dtype, quantized)

    def encode_tokens(self, tokens: Tokens, *, batch_size: int = 64, path: str = "packed",
                      precision: str | None = None) -> Tensor:
        """:meth:`encode` of texts :meth:`tokens` tokenized (prompt length and token types travel in ``tokens``):
        ``encode(texts, **kw)`` is ``encode_tokens(tokens(texts, prompt_name=...), **kw)`` bit for bit."""
        if not isinstance(tokens, Tokens):
            raise TypeError(f"encode_tokens takes the Tokens that tokens(texts) gives; got {type(tokens).__name__}")
        self._check_path(path)
        precision = check_encode_args(tokens.ids, batch_size, path, precision, self.PRECISIONS, who=self.WHO)
        batch_size, path = int(batch_size), self._check_packed(path, precision)
        dtype, quantized = self.resolve_precision(precision, f"{type(self).__name__}.encode_tokens")
        return self._run((tokens[i:i + batch_size] for i in range(0, len(tokens), batch_size)), path, dtype, quantized)

    @staticmethod
    def _check_packed(path: str, precision: str | None) -> str:
        """"packed" for "packed_bf16" (precision already says bf16); a padded path takes fp32 only."""
        path = "packed" if path == "packed_bf16" else path
        if path != "packed" and precision not in (None, "fp32"):
            raise ValueError(f"precision={precision!r} applies to path='packed' only; path={path!r} runs PyTorch's fp32 modules")
        return path

    def _run(self, batches: Iterable[Tokens], path: str, dtype: torch.dtype, quantized: nn.Module | None) -> Tensor:
        """The loop: each batch of Tokens packed (or padded, on a padded path), forward, head -> (N, out) float32."""
        out = []
        with torch.inference_mode():
            for t in batches:
                if path == "packed":
                    packed = pack_ids(t.ids, t.types)
                    h, cu_seqlens = self._forward_packed(packed, dtype, quantized), packed.cu_seqlens
                else:
                    h, cu_seqlens = self._forward_padded(t.ids, t.types, path)
                out.append(self.head(h.float(), cu_seqlens, t.prompt_length))  # (total, d) -> (B, out)
        return torch.cat(out) if out else torch.empty(0, self.head.output_dim(self.spec.d_model))


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
