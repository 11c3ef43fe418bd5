"""A pretrained BERT-family encoder built on nn.TransformerEncoder, with a padding-free encode().

    model = btlib.load_pretrained()                      # all-MiniLM-L6-v2, offline, sha256-checked
    emb = model.encode(["a sentence", "another"])        # (2, 384), mean-pooled, L2-normalised
    emb = model.encode(texts, path="fastpath_nested")    # PyTorch's BetterTransformer path instead

The encoder is a plain ``nn.TransformerEncoder`` (batch_first, post-LN), so PyTorch's fastpath
and nested tensors apply to it as they did with Optimum's BetterTransformer; ``path="packed"``
(the default) never pads at all: token ids are packed straight from the tokenizer, embedded,
run through btlib.PackedEncoder and mean-pooled per sequence with a segment sum.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..device import PRECISIONS, SlowPrecisionWarning, choose_precision, warn_if_slow_bf16
from ..observe import run_slow
from ..models.encoder import dense_twin
from ..packed_encoder import PackedEncoder
from ..padding import lengths_to_cu_seqlens
from .checkpoint import CheckpointSpec

__all__ = ["PretrainedEncoder", "PATHS", "Pooling"]

PATHS = ("packed", "packed_bf16", "fastpath_nested", "fastpath", "slow")


def _activation(name: str):
    # Exact GELU and ReLU are what PyTorch's fastpath fuses; tanh-approximated GELU must not be
    # passed as nn.GELU, which the fastpath would run as the exact one.
    if name in ("gelu", "relu"):
        return name
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"activation {name!r} is not supported (gelu, relu, gelu_new, gelu_pytorch_tanh)")


@dataclass(frozen=True)
class Pooling:
    """How token states become one sentence vector (sentence-transformers' 1_Pooling and Normalize)."""

    mode: str = "mean"          # "mean" over real tokens, or "cls" (the first token)
    normalize: bool = True      # L2-normalise the pooled vector


class Embeddings(nn.Module):
    """word + position (+ token type 0) embeddings, then LayerNorm."""

    def __init__(self, spec: CheckpointSpec):
        super().__init__()
        self.word = nn.Embedding(spec.vocab_size, spec.d_model)
        self.position = nn.Embedding(spec.max_positions, spec.d_model)
        self.token_type = nn.Embedding(spec.type_vocab_size, spec.d_model) if spec.type_vocab_size else None
        self.norm = nn.LayerNorm(spec.d_model, eps=spec.layer_norm_eps)
        self.position_offset = spec.position_offset

    def forward(self, ids: Tensor, positions: Tensor) -> Tensor:
        """ids, positions: same shape, int64 -> (..., d). Positions count from 0 in each sequence."""
        x = self.word(ids) + self.position(positions + self.position_offset)
        if self.token_type is not None:
            x = x + self.token_type.weight[0]  # single-segment input: token type 0 everywhere
        return self.norm(x)


class PretrainedEncoder(nn.Module):
    """Embeddings + nn.TransformerEncoder + pooling, loaded from a Hugging Face-format folder."""

    def __init__(self, spec: CheckpointSpec, tokenizer, max_length: int, pooling: Pooling):
        super().__init__()
        self.spec, self.tokenizer, self.max_length, self.pooling = spec, tokenizer, max_length, pooling
        self.embeddings = Embeddings(spec)
        layer = nn.TransformerEncoderLayer(spec.d_model, spec.nhead, spec.dim_feedforward, 0.0, _activation(spec.activation),
                                           layer_norm_eps=spec.layer_norm_eps, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, spec.num_layers, enable_nested_tensor=spec.nhead % 2 == 0)
        self._packed: dict[torch.dtype, PackedEncoder] = {}
        self._int8: PackedEncoder | None = None
        self.eval()

    # -- tokens ------------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids per text, with the special tokens, truncated to ``max_length``; no padding."""
        return [e.ids for e in self.tokenizer.encode_batch(list(texts))]

    def _pad(self, ids: list[list[int]]) -> tuple[Tensor, Tensor]:
        T = max(len(s) for s in ids)
        pad = self.spec.pad_token_id
        tokens = torch.tensor([s + [pad] * (T - len(s)) for s in ids])
        lengths = torch.tensor([len(s) for s in ids])
        return tokens, torch.arange(T).view(1, T) >= lengths.view(-1, 1)  # (B, T), True at padding

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

    def _packed_inputs(self, ids: list[list[int]]) -> tuple[Tensor, Tensor, int]:
        """Token ids (N lists) -> embedded packed tokens (total, d) float32, cu_seqlens (N + 1,) int32, max_seqlen."""
        lengths = torch.tensor([len(s) for s in ids])
        cu_seqlens, max_seqlen = lengths_to_cu_seqlens(lengths)
        flat = torch.tensor([t for s in ids for t in s])
        positions = packed_positions(cu_seqlens, flat.numel())
        return self.embeddings(flat, positions), cu_seqlens, max_seqlen

    def _encode_packed(self, ids: list[list[int]], dtype: torch.dtype, encoder: PackedEncoder | None = None) -> Tensor:
        lengths = torch.tensor([len(s) for s in ids])
        cu_seqlens, max_seqlen = lengths_to_cu_seqlens(lengths)
        flat = torch.tensor([t for s in ids for t in s])  # (total,) packed straight from the tokenizer
        seq = torch.repeat_interleave(torch.arange(len(ids)), lengths)  # (total,) which sequence each token is in
        positions = packed_positions(cu_seqlens, flat.numel())
        h = (encoder or self.packed_encoder(dtype)).forward_packed(self.embeddings(flat, positions).to(dtype), cu_seqlens, max_seqlen)
        h = h.float()  # (total, d)
        if self.pooling.mode == "cls":
            return h[cu_seqlens[:-1].long()]
        sums = torch.zeros(len(ids), h.shape[1]).index_add_(0, seq, h)  # segment sum per sequence
        return sums / lengths.view(-1, 1)

    def _encode_padded(self, ids: list[list[int]], path: str) -> Tensor:
        tokens, pad = self._pad(ids)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        x = self.embeddings(tokens, positions)
        enc = self.encoder if path == "fastpath_nested" else dense_twin(self.encoder)
        h = run_slow(enc, x, src_key_padding_mask=pad) if path == "slow" else enc(x, src_key_padding_mask=pad)  # (B, T, d)
        if self.pooling.mode == "cls":
            return h[:, 0]
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return (h * keep).sum(1) / keep.sum(1)

    def encode(self, texts: Sequence[str], *, batch_size: int = 64, path: str = "packed",
               precision: str | None = None) -> Tensor:
        """Sentence embeddings (N, d) float32, as sentence-transformers computes them (pool, then normalise).

        path: "packed" (default, no padding anywhere), or PyTorch's "fastpath_nested", "fastpath"
        (dense) and "slow" (fastpath disabled); "packed_bf16" is "packed" with precision="bf16".
        precision (packed paths only): None or "fp32" (default), "bf16" (explicit: warns once where
        bf16 is not native, with the measured slowdown), or "auto" (bf16 only where it is native and
        measured faster: btlib.choose_precision() says what it picks here and why), or "int8" (explicit
        only, never picked by "auto": int8 linear layers, attention and LayerNorm in fp32, embeddings within
        cosine 0.995 of fp32 on the workbook's corpora; see btlib.quant; warns once where this CPU's int8
        matmuls are not faster than fp32).
        batch_size: texts per forward, >= 1.
        """
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}; got {path!r}")
        if precision is not None and precision not in (*PRECISIONS, "int8"):
            raise ValueError(f"precision must be None or one of {(*PRECISIONS, 'int8')}; got {precision!r}")
        precision = check_encode_args(texts, batch_size, path, precision)
        path = "packed" if path == "packed_bf16" else path
        if not path.startswith("packed") and precision not in (None, "fp32"):
            raise ValueError(f"precision={precision!r} applies to path='packed' only; path={path!r} runs PyTorch's fp32 modules")
        encoder = None
        if precision == "int8":
            from ..quant import warn_if_slow_int8

            warn_if_slow_int8("PretrainedEncoder.encode in int8")
            encoder, precision = self.int8_encoder(), "fp32"  # int8 inside the linear layers; fp32 in and out
        dtype = choose_precision(precision).dtype if precision else torch.float32
        if precision == "bf16":
            warn_if_slow_bf16("PretrainedEncoder.encode in bf16")
        out = []
        with torch.inference_mode():
            for i in range(0, len(texts), batch_size):
                ids = self.tokenize(texts[i:i + batch_size])
                out.append(self._encode_packed(ids, dtype, encoder) if path == "packed" else self._encode_padded(ids, path))
        emb = torch.cat(out) if out else torch.empty(0, self.spec.d_model)
        return F.normalize(emb, dim=-1) if self.pooling.normalize else emb


def packed_positions(cu_seqlens: Tensor, total: int) -> Tensor:
    """(total,) int64 position of each packed token inside its own sequence: 0, 1, ... restarting per sequence."""
    starts = cu_seqlens[:-1].long()
    return torch.arange(total, device=cu_seqlens.device) - torch.repeat_interleave(starts, cu_seqlens.diff().long())


def check_encode_args(texts, batch_size: int, path: str, precision: str | None) -> str | None:
    """The argument checks every encoder's ``encode`` shares; returns the precision ("bf16" for path='packed_bf16')."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
    if isinstance(texts, str):
        raise TypeError("encode takes a list of texts; wrap a single text in a list")
    if path == "packed_bf16":
        if precision not in (None, "bf16"):
            raise ValueError(f"path='packed_bf16' is bf16; got precision={precision!r} (use path='packed' with it)")
        return "bf16"
    return precision
