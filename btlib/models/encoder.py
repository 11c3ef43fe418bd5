"""Encoder shapes used across the workbook, built from plain nn.TransformerEncoder.

Building on PyTorch's own module (rather than a copy) is the point: PyTorch's fastpath and
nested-tensor path apply to exactly these modules, and btlib's packed encoder runs their
weights unchanged.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, replace

import torch
from torch import nn

__all__ = ["EncoderConfig", "BERT_BASE", "XLMR_BASE", "XLMR_LARGE", "MINILM_L6", "TINY", "build_encoder", "dense_twin", "cached_encoder"]


@dataclass(frozen=True)
class EncoderConfig:
    """Shape of a Transformer encoder stack (post-LN unless norm_first)."""

    num_layers: int
    d_model: int
    nhead: int
    dim_feedforward: int
    activation: str = "gelu"
    norm_first: bool = False
    layer_norm_eps: float = 1e-5
    dropout: float = 0.1

    def scaled(self, **changes) -> "EncoderConfig":
        return replace(self, **changes)

    @property
    def params(self) -> int:
        """Parameters of the stack: per layer 4 d^2 + 2 d ff weights, plus biases and norms."""
        d, f = self.d_model, self.dim_feedforward
        return self.num_layers * (4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d)


BERT_BASE = EncoderConfig(12, 768, 12, 3072, "gelu", layer_norm_eps=1e-12)
XLMR_BASE = EncoderConfig(12, 768, 12, 3072, "gelu")
XLMR_LARGE = EncoderConfig(24, 1024, 16, 4096, "gelu")
MINILM_L6 = EncoderConfig(6, 384, 12, 1536, "gelu", layer_norm_eps=1e-12)  # all-MiniLM-L6-v2's shape
TINY = EncoderConfig(2, 64, 4, 128, "gelu")


def build_encoder(cfg: EncoderConfig, *, enable_nested_tensor: bool = True, seed: int | None = None) -> nn.TransformerEncoder:
    """nn.TransformerEncoder(batch_first=True) of this shape, randomly initialised (seeded if asked)."""
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        layer = nn.TransformerEncoderLayer(
            cfg.d_model, cfg.nhead, cfg.dim_feedforward, cfg.dropout, cfg.activation,
            layer_norm_eps=cfg.layer_norm_eps, batch_first=True, norm_first=cfg.norm_first,
        )
        with warnings.catch_warnings():
            # PyTorch warns when norm_first rules out nested tensors; explain_fastpath says it better.
            warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
            enc = nn.TransformerEncoder(layer, cfg.num_layers, enable_nested_tensor=enable_nested_tensor)
    return enc


def dense_twin(enc: nn.TransformerEncoder) -> nn.TransformerEncoder:
    """The same layers (shared parameters, no copy) in an encoder that never takes the nested path.

    This is how to switch nested tensors off for an existing encoder: ``use_nested_tensor`` is
    decided at construction, and setting ``enable_nested_tensor`` afterwards changes nothing.
    """
    twin = nn.TransformerEncoder(enc.layers[0], 1, norm=enc.norm, enable_nested_tensor=False)
    twin.layers = enc.layers
    twin.num_layers = enc.num_layers
    return twin


@functools.lru_cache(maxsize=2)
def cached_encoder(cfg: EncoderConfig, seed: int = 0) -> tuple[nn.TransformerEncoder, nn.TransformerEncoder]:
    """(nested-capable encoder, its dense twin), eval mode, weights shared. Cached per shape."""
    enc = build_encoder(cfg, seed=seed).eval()
    return enc, dense_twin(enc).eval()
