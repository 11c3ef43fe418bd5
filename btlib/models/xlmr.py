"""An XLM-R-shaped text classifier, rebuilt without torchtext.

torchtext's XLMR_BASE_ENCODER (the model of PyTorch's BetterTransformer tutorial) is a
RoBERTa encoder: token embedding + learned positions offset by the padding index, an
embedding LayerNorm, nn.TransformerEncoder (batch_first, post-LN, GELU) and a classification
head (dense, ReLU, dense) on the first token. torchtext 0.18 cannot be imported on current
torch (its C++ library is built against torch 2.3; see docs/caveats.md), so this module rebuilds
that architecture from torch.nn with random weights: the same shapes, the same PyTorch
modules, hence the same fastpath behaviour.

XLM-R's tokenizer is a SentencePiece model downloaded at run time; :class:`WordTokenizer`
stands in for it with the same special ids (<s>=0, <pad>=1, </s>=2). With random weights only
the number of tokens matters, and that is what a tokenizer decides.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .encoder import XLMR_BASE, EncoderConfig, build_encoder

__all__ = ["XLMRConfig", "XLMRClassifier", "WordTokenizer", "XLMR_BASE_CONFIG", "XLMR_LARGE_CONFIG"]

BOS, PAD, EOS = 0, 1, 2


@dataclass(frozen=True)
class XLMRConfig:
    encoder: EncoderConfig = XLMR_BASE
    vocab_size: int = 250002
    max_positions: int = 514
    num_classes: int = 2


XLMR_BASE_CONFIG = XLMRConfig()
XLMR_LARGE_CONFIG = XLMRConfig(encoder=EncoderConfig(24, 1024, 16, 4096, "gelu"))


class WordTokenizer:
    """Words and punctuation -> ids by a stable hash (crc32) into the vocabulary, wrapped in <s> ... </s>.

    Example: "How are you!" -> [0, id(How), id(are), id(you), id(!), 2]
    """

    _pattern = re.compile(r"\w+|[^\w\s]")

    def __init__(self, vocab_size: int = 250002, max_length: int = 512):
        if vocab_size <= 3 or max_length < 2:
            raise ValueError(f"WordTokenizer needs vocab_size > 3 (ids 0-2 are special) and max_length >= 2 (<s> and </s>), "
                             f"got vocab_size={vocab_size}, max_length={max_length}")
        self.vocab_size, self.max_length = vocab_size, max_length

    def encode(self, text: str) -> list[int]:
        ids = [3 + zlib.crc32(w.encode()) % (self.vocab_size - 3) for w in self._pattern.findall(text)]
        return [BOS, *ids[: self.max_length - 2], EOS]

    def __call__(self, texts: list[str]) -> Tensor:
        """(B, T) int64 token ids, right-padded with PAD to the longest text."""
        if not texts:
            raise ValueError("WordTokenizer needs at least one text to make a (B, T) batch")
        seqs = [self.encode(t) for t in texts]
        T = max(len(s) for s in seqs)
        return torch.tensor([s + [PAD] * (T - len(s)) for s in seqs])


class XLMRClassifier(nn.Module):
    """tokens (B, T) int64, PAD=1 -> logits (B, num_classes). Random weights unless loaded."""

    def __init__(self, cfg: XLMRConfig = XLMR_BASE_CONFIG, *, enable_nested_tensor: bool = True):
        super().__init__()
        e = cfg.encoder
        self.cfg = cfg
        self.token_embedding = nn.Embedding(cfg.vocab_size, e.d_model, padding_idx=PAD)
        self.position_embedding = nn.Embedding(cfg.max_positions, e.d_model, padding_idx=PAD)
        self.embedding_norm = nn.LayerNorm(e.d_model, eps=e.layer_norm_eps)
        self.dropout = nn.Dropout(e.dropout)
        self.encoder = build_encoder(e, enable_nested_tensor=enable_nested_tensor)
        self.head = nn.Sequential(nn.Dropout(e.dropout), nn.Linear(e.d_model, e.d_model), nn.ReLU(),
                                  nn.Dropout(e.dropout), nn.Linear(e.d_model, cfg.num_classes))

    def embed(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """tokens (B, T) -> (embeddings (B, T, d), padding_mask (B, T) True at PAD)."""
        padding_mask = tokens.eq(PAD)
        # RoBERTa positions start after the padding index: 2, 3, ... for real tokens, PAD for padding.
        positions = torch.cumsum(~padding_mask, dim=1) * ~padding_mask + PAD
        x = self.token_embedding(tokens) + self.position_embedding(positions)  # (B, T, d)
        return self.dropout(self.embedding_norm(x)), padding_mask

    def forward(self, tokens: Tensor) -> Tensor:
        x, padding_mask = self.embed(tokens)
        h = self.encoder(x, src_key_padding_mask=padding_mask)  # (B, T, d)
        return self.head(h[:, 0])  # classify from <s>
