"""A small causal Transformer block in the style of nanoGPT, to show SDPA in training.

One pre-LN block (causal self-attention + MLP) between a token/position embedding and an LM
head. Its attention runs either way nanoGPT does:

- ``"sdpa"``: F.scaled_dot_product_attention(is_causal=True): on CPU the flash kernel, which never
  stores the (B, H, T, T) scores and recomputes them in backward from the saved logsumexp.
- ``"naive"``: q @ k^T, masked_fill with a (T, T) causal mask, softmax, @ v. Autograd keeps the
  scores and the probabilities for backward: 2 * 4 * B * H * T^2 bytes in fp32.

(nanoGPT: github.com/karpathy/nanoGPT, model.py.) Weights are seeded, so two models built with the
same seed and different ``attention`` are the same function: their losses and gradients must match.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..reference import naive_attention

__all__ = ["GPTConfig", "GPT_SMALL", "GPT", "build_gpt", "with_attention", "gpt_batch", "train_step"]

Attention = Literal["sdpa", "naive"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model: one block by default (d_model 128, 4 heads of 32, context 64)."""

    d_model: int = 128
    n_head: int = 4
    block_size: int = 64
    vocab_size: int = 256
    n_layer: int = 1
    dropout: float = 0.0


GPT_SMALL = GPTConfig()


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, attention: Attention = "sdpa") -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model ({cfg.d_model}) must be a multiple of n_head ({cfg.n_head})")
        self.n_head, self.dropout, self.attention = cfg.n_head, cfg.dropout, attention
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)
        T = cfg.block_size
        self.register_buffer("causal", torch.ones(T, T, dtype=torch.bool).tril(), persistent=False)  # (T, T)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        p = self.dropout if self.training else 0.0
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            y = naive_attention(q, k, v, self.causal[:T, :T], dropout_p=p)  # (B, H, T, D), scores (B, H, T, T) in memory
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, attention: Attention = "sdpa") -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, attention)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embedding, ``n_layer`` blocks, final LayerNorm, LM head tied to the embedding."""

    def __init__(self, cfg: GPTConfig, attention: Attention = "sdpa") -> None:
        super().__init__()
        self.cfg = cfg
        self.wte, self.wpe = nn.Embedding(cfg.vocab_size, cfg.d_model), nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, attention) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for m in self.modules():  # nanoGPT's init: N(0, 0.02) weights, zero biases, so the first loss is ~ln(vocab)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        """idx: (B, T) int64 token ids, T <= block_size -> logits (B, T, vocab), or the mean loss if targets (B, T)."""
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))


def build_gpt(cfg: GPTConfig = GPT_SMALL, attention: Attention = "sdpa", *, seed: int = 0) -> GPT:
    """A GPT with seeded weights (the global RNG is left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg, attention)


def with_attention(model: GPT, attention: Attention) -> GPT:
    """A deep copy of ``model`` (same weights) whose blocks use ``attention``."""
    twin = copy.deepcopy(model)
    for block in twin.blocks:
        block.attn.attention = attention
    return twin


def gpt_batch(cfg: GPTConfig, B: int, T: int | None = None, *, seed: int = 0, device: str = "cpu") -> tuple[Tensor, Tensor]:
    """Random token ids (B, T) and next-token targets (B, T), int64. T defaults to block_size."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(cfg.vocab_size, (B, (T or cfg.block_size) + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(model: GPT, idx: Tensor, targets: Tensor, optimizer: torch.optim.Optimizer | None = None) -> tuple[Tensor, Tensor]:
    """Forward + backward (+ optimizer step if given). Returns (loss, all gradients flattened into one vector)."""
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(idx, targets)
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    if optimizer is not None:
        optimizer.step()
    return loss.detach(), grads
