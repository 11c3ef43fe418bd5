"""The one encode loop every pretrained encoder runs: tokenize -> pack -> forward -> pool -> normalise.

    texts (N)    str, or (a, b) pairs where the family has token types
    tokenize     ids per text, special tokens added, truncated to max_length, no padding; a prompt goes first
    batch        batch_size texts per forward
    pack         ids (total,) int64, cu_seqlens (B + 1,) int32, max_seqlen: lengths [2, 4, 3] -> [0, 2, 6, 9], 4
    forward      h (total, d): the architecture's own layers, in the dtype the precision resolved to
    head         (B, out) float32: the folder's Pooling, Dense, Normalize (``model.head``, btlib.pretrained.st_modules,
                 whose segment sums and masks are btlib.padding's)
    after        (N, dim): truncate_dim, normalize_embeddings, output_precision (btlib.pretrained.outputs)

long_inputs="chunk" (btlib.pretrained.chunking) tokenizes every text at once into chunks, runs them as sequences of
the same batches, and pools each text's chunk rows before the head's trailing Normalize.

:class:`SentenceEncoder` owns every step but the forward. An architecture supplies what differs:
``_forward_packed`` (its embeddings and layers on packed tokens, run by a :class:`Runner`), ``_layers_in`` (the
layers a precision runs: its own stack in that dtype, or an int8 twin), ``_token_types`` (token types or not),
and where it has them, PyTorch's padded paths (``_forward_padded``)
and token id lists as texts (``_check_texts``, ``_prepare``, ``_tokens``); its ``PATHS`` and ``PRECISIONS`` say which.
Precision is checked and resolved once per call, here, through btlib.precision, into a :class:`Runner` (the dtype
and the layers) that every batch's forward takes; the slow-precision warnings name the class
(``PretrainedEncoder.encode in bf16``).
Tokenize once, run later (a server's queue): ``tokens(texts)`` -> :class:`Tokens` (ids, types, the prompt's length),
``encode_tokens(tokens)`` runs them; ``encode(texts)`` is the two, one batch of texts tokenized at a time.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import Tensor

from ..precision import ENCODE_PRECISIONS, resolve_dtype, warn_if_slow_bf16, warn_if_slow_int8
from .chunking import check_long_inputs, chunk_tokens, finish_chunks, split_head
from .outputs import check_output_precision, check_truncate_dim, finish_rows
from .prompts import Prompts
from .st_modules import HasHead, SentenceHead
from .tokens import (PackedTokens, Runner, Tokens, check_encode_args, check_text, check_texts,  # noqa: F401 (encoding's names)
                     pack_ids)

__all__ = ["SentenceEncoder", "Runner", "Prompts", "Tokens", "PackedTokens", "pack_ids", "check_encode_args", "check_texts",
           "check_text"]


class SentenceEncoder(Prompts, HasHead):
    """tokenize and encode for a pretrained encoder; the architecture fills in the hooks below (module docstring).

    Needs ``tokenizer`` (a tokenizers.Tokenizer, truncating to ``max_length``), ``spec`` (``d_model``) and ``head``.
    """

    PATHS: tuple[str, ...] = ("packed", "packed_bf16")  # "packed_bf16" is "packed" with precision="bf16"
    PRECISIONS: tuple[str, ...] = ENCODE_PRECISIONS
    OUTPUTS: tuple[str, ...] = ("sentence_embedding", "unnormalized", "token_embeddings")  # encode_tokens' output=
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
               prompt: str | None = None, long_inputs: str = "truncate", chunk_overlap: int | None = None) -> Tokens:
        """``texts`` tokenized once, exactly as :meth:`encode` with the same prompt / prompt_name / long_inputs runs
        them (checks, prompt, truncation or chunks, special tokens, token types of pairs, the prompt's length for the
        head): pass the result to :meth:`encode_tokens`. ``lengths()``: what each sequence costs; ``truncated``: which
        max_length cut; ``chunks``: chunks per text (long_inputs="chunk"). long_inputs: see :meth:`encode`."""
        if isinstance(texts, (str, bytes)):
            raise TypeError("tokens takes a list of texts; wrap a single text in a list")
        check_long_inputs(long_inputs, chunk_overlap)
        self._check_texts(texts)
        prompt = self.resolve_prompt(prompt, prompt_name)
        items = self._prepare(texts, prompt)
        if long_inputs == "chunk":
            return chunk_tokens(self, items, prompt, chunk_overlap)
        tokens = self._tokens(items, prompt)
        if long_inputs == "refuse" and any(tokens.truncated or ()):
            i = tokens.truncated.index(True)
            raise ValueError(f"texts[{i}] has more than {self.max_length} tokens (with its prompt), the most this model "
                             "takes (long_inputs='refuse'); shorten it, or pass long_inputs='truncate' or 'chunk'")
        return tokens

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

    def _forward_packed(self, tokens: PackedTokens, runner: Runner) -> Tensor:
        """Last hidden states (total, d) of packed tokens, by ``runner.layers`` in ``runner.dtype``."""
        raise NotImplementedError

    def _layers_in(self, precision: str) -> object:
        """The layers ``precision`` ("fp32", "bf16", or "int8" where it is in ``PRECISIONS``) runs: :class:`Runner`'s."""
        raise NotImplementedError

    def _forward_padded(self, ids: list[list[int]], types: list[list[int]] | None, path: str) -> tuple[Tensor, Tensor]:
        """A padded path of ``PATHS`` (PyTorch's own modules): the real tokens' states (total, d) float32, packed
        as the head takes them, and cu_seqlens (B + 1,) int32."""
        raise NotImplementedError(f"{type(self).__name__} has no padded path {path!r}")

    def resolve_precision(self, precision: str | None, what: str) -> Runner:
        """A checked precision -> the :class:`Runner` every forward of the call takes; the slow-precision warnings once
        per ``what`` ("PretrainedEncoder.encode"), pointing at the caller of the method that called this one (encode's
        caller, Reranker.predict's caller)."""
        if precision == "int8":
            warn_if_slow_int8(f"{what} in int8", stacklevel=4)
        if precision == "bf16":
            warn_if_slow_bf16(f"{what} in bf16", stacklevel=4)
        return self.runner(precision)

    def runner(self, precision: str | None) -> Runner:
        """A checked precision (None, "fp32", "bf16", "auto", or "int8" where the family has it) -> its Runner."""
        if precision == "int8":  # int8 inside the linear layers; fp32 in and out
            return Runner("int8", torch.float32, self._layers_in("int8"))
        dtype = resolve_dtype(precision)
        name = "bf16" if dtype == torch.bfloat16 else "fp32"
        return Runner(name, dtype, self._layers_in(name))

    # -- the loop ----------------------------------------------------------------------------
    def encode(self, texts: Sequence[str | tuple[str, str]] | Sequence[Sequence[int]], *, batch_size: int = 64,
               path: str = "packed", precision: str | None = None, prompt_name: str | None = None,
               prompt: str | None = None, truncate_dim: int | None = None, normalize_embeddings: bool = False,
               output_precision: str = "float32", ranges=None, calibration_embeddings=None,
               long_inputs: str = "truncate", chunk_overlap: int | None = None) -> Tensor:
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
        batch_size: texts per forward, >= 1 (a Python or numpy integer); with long_inputs="chunk", sequences (chunks).

        After the head, as sentence-transformers' encode (btlib.pretrained.outputs): truncate_dim keeps the first
        features (Matryoshka; 1 to the head's width, overriding the folder's truncate_dim) -> (N, truncate_dim);
        normalize_embeddings L2-normalises each row after it (without it a truncated row of a normalising model is
        not unit length, as in sentence-transformers: pass both for unit Matryoshka rows); output_precision
        (sentence-transformers' ``precision=``: that name is the forward's here) "float32" (default), "int8" /
        "uint8" (N, dim) int8 / uint8, per-feature buckets from ``ranges`` (2, dim), ``calibration_embeddings``
        (M, dim) or else this call's rows (ValueError for one text), "binary" / "ubinary" (N, ceil(dim / 8)) int8 /
        uint8 packed sign bits.
        long_inputs: a text past max_length (with its prompt) is "truncate"d there (default, as always), "refuse"d
        (ValueError naming it) or cut into "chunk"s (btlib.pretrained.chunking): windows of max_length tokens with
        the special tokens and the prompt in each, consecutive ones sharing ``chunk_overlap`` tokens (default: 1/8
        of the window, 31 for max_length 256 with [CLS] and [SEP]); all chunks run in the same packed batches and a
        text's row is the token-weighted mean of its chunks' rows before the head's trailing Normalize, then that
        Normalize. Single texts only (pairs and token id lists are refused with "chunk").
        """
        self._check_path(path)
        precision = check_encode_args(texts, batch_size, path, precision, self.PRECISIONS, who=self.WHO)
        check_long_inputs(long_inputs, chunk_overlap)
        check_output_precision(output_precision)
        width = self.head.output_dim(self.spec.d_model) if truncate_dim is None else SentenceHead(
            self.head.modules).output_dim(self.spec.d_model)  # the width truncate_dim cuts: before the folder's own
        truncate_dim = check_truncate_dim(truncate_dim, width)
        if long_inputs != "truncate":
            rows = self.encode_tokens(self.tokens(texts, prompt_name=prompt_name, prompt=prompt, long_inputs=long_inputs,
                                                  chunk_overlap=chunk_overlap), batch_size=batch_size, path=path,
                                      precision=precision, full_width=truncate_dim is not None)
            return finish_rows(rows, truncate_dim, normalize_embeddings, output_precision, ranges, calibration_embeddings)
        self._check_texts(texts)
        batch_size, path = int(batch_size), self._check_packed(path, precision)
        prompt = self.resolve_prompt(prompt, prompt_name)
        items = self._prepare(texts, prompt)
        runner = self.resolve_precision(precision, f"{type(self).__name__}.encode")
        batches = (self._tokens(items[i:i + batch_size], prompt) for i in range(0, len(items), batch_size))
        head = None if truncate_dim is None else SentenceHead(self.head.modules)  # cut at truncate_dim below
        rows = self._run(batches, path, runner, head)
        return finish_rows(rows, truncate_dim, normalize_embeddings, output_precision, ranges, calibration_embeddings)

    def encode_tokens(self, tokens: Tokens, *, batch_size: int = 64, path: str = "packed",
                      precision: str | None = None, output: str = "sentence_embedding", full_width: bool = False) -> Tensor:
        """:meth:`encode` of texts :meth:`tokens` tokenized (prompt length and token types travel in ``tokens``):
        ``encode(texts, **kw)`` is ``encode_tokens(tokens(texts, prompt_name=...), **kw)`` bit for bit.

        output (one of ``OUTPUTS``): "sentence_embedding" (N, out), the head's rows; "unnormalized" (N, out), the
        head less its trailing Normalize modules (TEI's normalize=false; ValueError for a head that normalises
        before another module); "token_embeddings" (sum(tokens.lengths()), d) float32, the last hidden states of
        every token before the head, texts one after another (sentence-transformers' output_value name; split
        by ``tokens.lengths()``). The same forward runs for all three: only what reads its states differs.
        Chunked tokens (``tokens.chunks``): one row per text, its chunks pooled (:meth:`encode`'s long_inputs);
        "token_embeddings" of chunked tokens is refused. full_width: ignore the folder's truncate_dim (encode's
        truncate_dim cuts instead).
        """
        if not isinstance(tokens, Tokens):
            raise TypeError(f"encode_tokens takes the Tokens that tokens(texts) gives; got {type(tokens).__name__}")
        if output not in self.OUTPUTS:
            raise ValueError(f"output must be one of {self.OUTPUTS}; got {output!r}")
        self._check_path(path)
        precision = check_encode_args(tokens.ids, batch_size, path, precision, self.PRECISIONS, who=self.WHO)
        batch_size, path = int(batch_size), self._check_packed(path, precision)
        runner = self.resolve_precision(precision, f"{type(self).__name__}.encode_tokens")
        batches = (tokens[i:i + batch_size] for i in range(0, len(tokens), batch_size))
        if tokens.chunks is not None:
            return self._run_chunks(tokens, batches, path, runner, output, full_width)
        head = {"sentence_embedding": self.head, "token_embeddings": _token_states}.get(output) or self.head.without_normalize()
        if full_width and output != "token_embeddings":
            head = SentenceHead(head.modules)
        return self._run(batches, path, runner, head)

    def _run_chunks(self, tokens: Tokens, batches: Iterable[Tokens], path: str, runner: Runner, output: str,
                    full_width: bool) -> Tensor:
        """Every chunk's row before the trailing Normalize, pooled per text (btlib.pretrained.chunking), then the
        Normalize (output "sentence_embedding") and the folder's truncate_dim (unless full_width): (texts, out)."""
        if output == "token_embeddings" or sum(tokens.chunks) != len(tokens):
            raise ValueError("chunked tokens give pooled rows only (output 'sentence_embedding' or 'unnormalized'), "
                             f"and their chunk counts must add up to their sequences; got output={output!r}")
        body, _ = split_head(self.head)
        return finish_chunks(self.head, self._run(batches, path, runner, body), tokens.chunks, tokens.lengths(), output,
                             full_width)

    @staticmethod
    def _check_packed(path: str, precision: str | None) -> str:
        """"packed" for "packed_bf16" (precision already says bf16); a padded path takes fp32 only."""
        path = "packed" if path == "packed_bf16" else path
        if path != "packed" and precision not in (None, "fp32"):
            raise ValueError(f"precision={precision!r} applies to path='packed' only; path={path!r} runs PyTorch's fp32 modules")
        return path

    def _run(self, batches: Iterable[Tokens], path: str, runner: Runner, head=None) -> Tensor:
        """The loop: each batch of Tokens packed (or padded, on a padded path), forward, head -> (N, out) float32.
        head: what reads each batch's states (h, cu_seqlens, prompt_length); None: ``self.head``."""
        head = self.head if head is None else head
        out = []
        with torch.inference_mode():
            for t in batches:
                if path == "packed":
                    packed = pack_ids(t.ids, t.types)
                    h, cu_seqlens = self._forward_packed(packed, runner), packed.cu_seqlens
                else:
                    h, cu_seqlens = self._forward_padded(t.ids, t.types, path)
                out.append(head(h.float(), cu_seqlens, t.prompt_length))  # (total, d) -> (B, out)
        return torch.cat(out) if out else torch.empty(0, self.head.output_dim(self.spec.d_model))


def _token_states(h: Tensor, cu_seqlens: Tensor, prompt_length: int | None) -> Tensor:
    """The "token_embeddings" output: the states themselves, (total, d), prompt and special tokens included."""
    return h


