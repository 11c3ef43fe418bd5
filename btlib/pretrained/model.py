"""A pretrained BERT-family encoder built on nn.TransformerEncoder, with a padding-free encode().

    model = btlib.load_pretrained()                      # all-MiniLM-L6-v2, offline, sha256-checked
    emb = model.encode(["a sentence", "another"])        # (2, 384), mean-pooled, L2-normalised
    emb = model.encode(texts, path="fastpath_nested")    # PyTorch's BetterTransformer path instead
    emb = model.encode([("a question", "a passage")])     # pairs: [CLS] a [SEP] b [SEP], token types as transformers
    emb = model.encode(texts, prompt_name="query")       # a prompt from config_sentence_transformers.json

The encoder is a plain ``nn.TransformerEncoder`` (batch_first, post-LN), so PyTorch's fastpath
and nested tensors apply to it as they did with Optimum's BetterTransformer; ``path="packed"``
(the default) never pads at all: token ids are packed straight from the tokenizer, embedded,
run through btlib.PackedEncoder and pooled per sequence with segment sums by ``model.head``, the
folder's sentence-transformers modules (btlib.pretrained.st_modules: Pooling, Dense, Normalize).

torch.compile: ``model.packed_encoder(dtype).forward_packed``, the encoder part of the packed path,
traces whole (fullgraph=True) with btlib's C++ attention kernel inside (tests/test_compile.py);
``encode`` itself does not (tokenizer, Python lists of ids, one forward per batch of texts).
"""

from __future__ import annotations

import numbers
import warnings
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..observe import run_slow
from ..models.encoder import dense_twin
from ..packed_encoder import PackedEncoder
from ..padding import lengths_to_cu_seqlens
from ..precision import (ENCODE_PRECISIONS, SlowPrecisionWarning, check_precision, resolve_dtype, warn_if_slow_bf16,
                         warn_if_slow_int8)
from .checkpoint import CheckpointSpec
from .st_modules import HasHead, Pooling, SentenceHead

__all__ = ["PretrainedEncoder", "PATHS", "Pooling", "check_texts"]

PATHS = ("packed", "packed_bf16", "fastpath_nested", "fastpath", "slow")


def _activation(name: str):
    # Exact GELU and ReLU are what PyTorch's fastpath fuses; tanh-approximated GELU must not be
    # passed as nn.GELU, which the fastpath would run as the exact one.
    if name in ("gelu", "relu"):
        return name
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"activation {name!r} is not supported (gelu, relu, gelu_new, gelu_pytorch_tanh)")


class Embeddings(nn.Module):
    """word + position + token type embeddings, then LayerNorm."""

    def __init__(self, spec: CheckpointSpec):
        super().__init__()
        self.word = nn.Embedding(spec.vocab_size, spec.d_model)
        self.position = nn.Embedding(spec.max_positions, spec.d_model)
        self.token_type = nn.Embedding(spec.type_vocab_size, spec.d_model) if spec.type_vocab_size else None
        self.norm = nn.LayerNorm(spec.d_model, eps=spec.layer_norm_eps)

    def forward(self, ids: Tensor, positions: Tensor, types: Tensor | None = None) -> Tensor:
        """ids, positions (rows of the position table), types (None: 0 everywhere): same shape, int64 -> (..., d)."""
        x = self.word(ids) + self.position(positions)
        if self.token_type is not None:
            x = x + (self.token_type.weight[0] if types is None else self.token_type(types))
        return self.norm(x)


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

    def prompt_length(self, prompt: str | None) -> int | None:
        """Tokens of ``prompt`` alone, less a trailing special token: what sentence-transformers leaves out of the
        pooling when include_prompt is false. None for no prompt."""
        if not prompt:
            return None
        ids = self.tokenizer.encode(prompt).ids
        return len(ids) - (1 if ids and ids[-1] in self.special_ids else 0)

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


class PretrainedEncoder(Prompts, HasHead, nn.Module):
    """Embeddings + nn.TransformerEncoder + the folder's sentence-transformers head, from a Hugging Face-format folder.

    pooling: a :class:`Pooling` shorthand or a :class:`SentenceHead` (kept as ``model.head``).
    prompts / default_prompt_name: config_sentence_transformers.json's. token_types: whether transformers'
    tokenizer for this folder hands token_type_ids to the model (None: unknown, pairs are refused).
    special_ids: the ids transformers counts as special (a prompt's trailing [SEP] is not part of it).
    """

    def __init__(self, spec: CheckpointSpec, tokenizer, max_length: int, pooling: Pooling | SentenceHead, *,
                 prompts: dict[str, str | None] | None = None, default_prompt_name: str | None = None,
                 token_types: bool | None = None, special_ids: frozenset[int] = frozenset()):
        super().__init__()
        self.spec, self.tokenizer, self.max_length, self.pooling = spec, tokenizer, max_length, pooling
        self.set_prompts(prompts, default_prompt_name, special_ids)
        self.token_types = token_types
        self.embeddings = Embeddings(spec)
        layer = nn.TransformerEncoderLayer(spec.d_model, spec.nhead, spec.dim_feedforward, 0.0, _activation(spec.activation),
                                           layer_norm_eps=spec.layer_norm_eps, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, spec.num_layers, enable_nested_tensor=spec.nhead % 2 == 0)
        self._packed: dict[torch.dtype, PackedEncoder] = {}
        self._int8: PackedEncoder | None = None
        self.eval()

    # -- tokens ------------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str | tuple[str, str]]) -> list[list[int]]:
        """Token ids per text (or pair), with the special tokens, truncated to ``max_length``; no padding."""
        return [e.ids for e in self.tokenizer.encode_batch([t if isinstance(t, str) else tuple(t) for t in texts])]

    def _token_ids(self, texts: Sequence, prompt: str | None) -> tuple[list[list[int]], list[list[int]] | None]:
        """(ids, token types or None for all-0) per text; the prompt goes before each text (a pair's first text)."""
        pairs = [not isinstance(t, str) for t in texts]
        if any(pairs) and self.token_types is None and self.spec.type_vocab_size > 1:
            raise ValueError("pairs need to know whether this folder's tokenizer hands token_type_ids to the model, and "
                             "its tokenizer_config.json's tokenizer_class is not one btlib knows; pass single texts")
        if prompt:
            texts = [prompt + t if isinstance(t, str) else (prompt + t[0], t[1]) for t in texts]
        enc = self.tokenizer.encode_batch([t if isinstance(t, str) else tuple(t) for t in texts])
        if not self.token_types or self.embeddings.token_type is None:
            return [e.ids for e in enc], None
        types = [e.type_ids for e in enc]
        if max((max(t, default=0) for t in types), default=0) >= self.spec.type_vocab_size:
            raise ValueError(f"the tokenizer gives token type ids up to {max(max(t, default=0) for t in types)} but the "
                             f"model has type_vocab_size {self.spec.type_vocab_size}; transformers cannot run this either")
        return [e.ids for e in enc], types

    def positions(self, ids: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
        """Row of the position table for each token, as transformers computes it.

        ids: (total,) packed with cu_seqlens (B + 1,), or (B, T) right-padded. BERT / DistilBERT: the offset
        inside the sequence. RoBERTa / XLM-R: pad_token_id + the count of non-pad tokens up to and including
        this one, and pad_token_id for a pad token (a literal <pad> in a text too), as transformers'
        create_position_ids_from_input_ids does.
        """
        pad = self.spec.pad_token_id
        if self.spec.position_offset == 0:
            if cu_seqlens is None:
                return torch.arange(ids.shape[-1]).expand_as(ids)
            return packed_positions(cu_seqlens, ids.numel())
        real = (ids != pad).long()
        if cu_seqlens is None:
            return real.cumsum(-1) * real + pad
        c = torch.cat([real.new_zeros(1), real.cumsum(0)])  # (total + 1,) real tokens before each index
        before = torch.repeat_interleave(c[cu_seqlens[:-1].long()], cu_seqlens.diff().long())  # per sequence start
        return (c[1:] - before) * real + pad

    # -- forward paths -----------------------------------------------------------------------
    def packed_encoder(self, dtype: torch.dtype = torch.float32) -> PackedEncoder:
        """The PackedEncoder on this model's weights in ``dtype`` (fp32 shares them; bf16 is a converted copy, cached)."""
        if dtype not in self._packed:
            with warnings.catch_warnings():  # encode() has said it already, naming itself
                warnings.simplefilter("ignore", SlowPrecisionWarning)
                self._packed[dtype] = PackedEncoder.from_module(self.encoder, dtype=None if dtype == torch.float32 else dtype)
        return self._packed[dtype]

    def int8_encoder(self) -> PackedEncoder:
        """The int8 twin of :meth:`packed_encoder` (btlib.smoothquant.quantize_auto on its CALIBRATION_TEXTS); cached."""
        if self._int8 is None:
            from ..smoothquant import CALIBRATION_TEXTS, quantize_auto

            with torch.inference_mode():
                batch = self._packed_inputs(self.tokenize(CALIBRATION_TEXTS))
                self._int8 = quantize_auto(self.packed_encoder(), [batch])
        return self._int8

    def _packed_inputs(self, ids: list[list[int]], types: list[list[int]] | None = None) -> tuple[Tensor, Tensor, int]:
        """Token ids (N lists) -> embedded packed tokens (total, d) float32, cu_seqlens (N + 1,) int32, max_seqlen."""
        cu_seqlens, max_seqlen = lengths_to_cu_seqlens(torch.tensor([len(s) for s in ids]))
        flat = torch.tensor([t for s in ids for t in s], dtype=torch.int64)  # (total,) packed straight from the tokenizer
        tt = None if types is None else torch.tensor([t for s in types for t in s], dtype=torch.int64)
        return self.embeddings(flat, self.positions(flat, cu_seqlens), tt), cu_seqlens, max_seqlen

    def _encode_packed(self, ids: list[list[int]], types: list[list[int]] | None, dtype: torch.dtype,
                       encoder: PackedEncoder | None, prompt_length: int | None) -> Tensor:
        x, cu_seqlens, max_seqlen = self._packed_inputs(ids, types)
        h = (encoder or self.packed_encoder(dtype)).forward_packed(x.to(dtype), cu_seqlens, max_seqlen)
        return self.head(h.float(), cu_seqlens, prompt_length)  # (total, d) -> (B, out)

    def _encode_padded(self, ids: list[list[int]], types: list[list[int]] | None, path: str,
                       prompt_length: int | None) -> Tensor:
        T, pad_id = max(len(s) for s in ids), self.spec.pad_token_id
        tokens = torch.tensor([s + [pad_id] * (T - len(s)) for s in ids], dtype=torch.int64)  # (B, T)
        lengths = torch.tensor([len(s) for s in ids])
        pad = torch.arange(T).view(1, T) >= lengths.view(-1, 1)  # (B, T), True at padding
        tt = None if types is None else torch.tensor([s + [0] * (T - len(s)) for s in types], dtype=torch.int64)
        x = self.embeddings(tokens, self.positions(tokens), tt)
        enc = self.encoder if path == "fastpath_nested" else dense_twin(self.encoder)
        h = run_slow(enc, x, src_key_padding_mask=pad) if path == "slow" else enc(x, src_key_padding_mask=pad)  # (B, T, d)
        cu_seqlens, _ = lengths_to_cu_seqlens(lengths)
        return self.head(h[~pad], cu_seqlens, prompt_length)  # the real tokens, packed: one pooling for every path

    def encode(self, texts: Sequence[str | tuple[str, str]], *, batch_size: int = 64, path: str = "packed",
               precision: str | None = None, prompt_name: str | None = None, prompt: str | None = None) -> Tensor:
        """Sentence embeddings (N, out) float32, as sentence-transformers computes them (its modules, in order).

        texts: str, or (a, b) pairs, encoded as transformers encodes pairs ([CLS] a [SEP] b [SEP], token type 1
        on b where the tokenizer hands token types to the model, truncation longest-first).
        prompt / prompt_name: sentence-transformers' prompts (prepended to each text; a pair's first text);
        without either, the folder's default_prompt_name applies. A Pooling with include_prompt false leaves
        the prompt's tokens out.
        path: "packed" (default, no padding anywhere), or PyTorch's "fastpath_nested", "fastpath"
        (dense) and "slow" (fastpath disabled); "packed_bf16" is "packed" with precision="bf16".
        precision (packed paths only): None or "fp32" (default), "bf16" (explicit: warns once where
        bf16 is not native, with the measured slowdown), or "auto" (bf16 only where it is native and
        measured faster: btlib.choose_precision() says what it picks here and why), or "int8" (explicit
        only, never picked by "auto": int8 linear layers, attention and LayerNorm in fp32, embeddings within
        cosine 0.995 of fp32 on the workbook's corpora; see btlib.quant; warns once where this CPU's int8
        matmuls are not faster than fp32).
        batch_size: texts per forward, >= 1 (a Python or numpy integer).
        """
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}; got {path!r}")
        precision = check_encode_args(texts, batch_size, path, precision)
        check_texts(texts)
        batch_size = int(batch_size)
        path = "packed" if path == "packed_bf16" else path
        if not path.startswith("packed") and precision not in (None, "fp32"):
            raise ValueError(f"precision={precision!r} applies to path='packed' only; path={path!r} runs PyTorch's fp32 modules")
        prompt = self.resolve_prompt(prompt, prompt_name)
        prompt_length = self.prompt_length(prompt)
        encoder = None
        if precision == "int8":
            warn_if_slow_int8("PretrainedEncoder.encode in int8")
            encoder, precision = self.int8_encoder(), "fp32"  # int8 inside the linear layers; fp32 in and out
        dtype = resolve_dtype(precision)
        if precision == "bf16":
            warn_if_slow_bf16("PretrainedEncoder.encode in bf16")
        out = []
        with torch.inference_mode():
            for i in range(0, len(texts), batch_size):
                ids, types = self._token_ids(texts[i:i + batch_size], prompt)
                out.append(self._encode_packed(ids, types, dtype, encoder, prompt_length) if path == "packed"
                           else self._encode_padded(ids, types, path, prompt_length))
        return torch.cat(out) if out else torch.empty(0, self.head.output_dim(self.spec.d_model))


def packed_positions(cu_seqlens: Tensor, total: int) -> Tensor:
    """(total,) int64 position of each packed token inside its own sequence: 0, 1, ... restarting per sequence."""
    starts = cu_seqlens[:-1].long()
    return torch.arange(total, device=cu_seqlens.device) - torch.repeat_interleave(starts, cu_seqlens.diff().long())


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
    """Every item is a str or a (str, str) pair; TypeError naming the first that is not, and what to pass."""
    for i, t in enumerate(texts):
        if isinstance(t, str):
            continue
        if isinstance(t, (tuple, list)) and len(t) == 2 and all(isinstance(x, str) for x in t):
            continue
        raise TypeError(f"texts[{i}] is {type(t).__name__} {t!r:.40}; encode takes str texts or (str, str) pairs "
                        "(decode bytes, convert numbers with str(), drop None)")
