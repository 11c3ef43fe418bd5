"""ModernBERT's blocks on packed tokens: rotary embeddings, windowed attention, GeGLU, pre-LN layers.

One layer, on x (total, d) packed tokens with cu_seqlens (B + 1,) int32 (transformers' ModernBertEncoderLayer):

    h = attn_norm(x)                       LayerNorm (layer 0: identity, the embeddings' norm comes first)
    q, k, v = (h Wqkv^T).chunk(3)          (total, H, Dh) each                    6 d^2 FLOPs per token
                                           (every GEMM through btlib.gemm.linear: the path measured fastest here)
    q, k = rope(q, p), rope(k, p)          p = position inside its own sequence (restarts at 0)
    o = varlen_attention(q, k, v, cu_seqlens, max_seqlen, window=(w, w) | None)
    x = x + o Wo^T                                                                2 d^2
    u, g = (mlp_norm(x) Wi^T).chunk(2)     GeGLU: (total, f) input and gate      4 d f
    x = x + (act(u) * g) Wo^T                                                     2 d f

Global layers (every ``global_attn_every_n_layers``-th, from layer 0) attend to the whole
sequence with RoPE base ``global_rope_theta``; local layers see only keys with |i - j| <= w =
local_attention // 2 and use ``local_rope_theta``. On packed tokens a local layer costs
4 d min(L, 2w + 1) per token instead of 4 d L: for L = 1024 and w = 64, 8x less attention work.

RoPE (Su et al., RoFormer), in transformers' "rotate half" layout: for head dims j < Dh / 2,
(x_j, x_{j + Dh/2}) rotates by angle p * theta^(-2j / Dh). The rotation is computed in fp32
and cast back, as transformers does, so bf16 runs lose nothing extra there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import gemm
from ...attention import varlen_attention
from ...kernels.registry import Kernel, window_kwargs
from ..folders.modernbert_config import ModernBertSpec

__all__ = ["ModernBertLayer", "ModernBertEmbeddings", "rope_tables", "apply_rope", "activation"]


def activation(name: str):
    """The elementwise function transformers' ACT2FN[name] computes (GELU-tanh variants agree to fp32 rounding)."""
    if name == "gelu":
        return F.gelu
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    if name in ("silu", "swish"):
        return F.silu
    raise ValueError(f"activation {name!r} is not supported")


def rope_tables(positions: Tensor, head_dim: int, theta: float, divisor: float = 1.0) -> tuple[Tensor, Tensor]:
    """cos, sin (total, Dh / 2) float32 for positions (total,) int64, transformers' default RoPE with base theta.

    inv_freq and the angles are computed exactly as ModernBertRotaryEmbedding does (fp32), so fp32
    results agree to the last bits. transformers repeats the table to (total, Dh); both halves of a
    head use the same angles, so half the table is all the rotation needs. divisor: inv_freq / divisor
    afterwards, as GTE's fixed NTK scaling does it (btlib.pretrained.folders.rotary_bert_config); 1.0 leaves it.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # (Dh/2,)
    if divisor != 1.0:
        inv_freq = inv_freq / divisor
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]  # (total, Dh/2)
    return freqs.cos(), freqs.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (total, ..., Dh) any float dtype; cos, sin (total, Dh / 2) float32 -> x's shape and dtype, rotated.

    transformers computes x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1), i.e.
    (x1 c - x2 s, x2 c + x1 s) on the two halves: a multiply and a fused multiply-add per half, then
    one concatenation, instead of building rotate_half(x) and a full-width cos and sin. RoPE is pure
    memory traffic, so each pass over q and k saved counts as much as the arithmetic.
    """
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)  # broadcast over the head axes
    c, s = cos.view(shape), sin.view(shape)
    o1 = torch.addcmul(x1 * c, x2, s, value=-1.0)  # x1 c - x2 s
    o2 = torch.addcmul(x2 * c, x1, s)  # x2 c + x1 s
    return torch.cat((o1, o2), dim=-1).to(x.dtype)


def _norm(spec: ModernBertSpec) -> nn.LayerNorm:
    return nn.LayerNorm(spec.d_model, eps=spec.norm_eps, bias=spec.norm_bias)


class ModernBertEmbeddings(nn.Module):
    """Token embeddings then LayerNorm: no position embeddings (positions enter through RoPE)."""

    def __init__(self, spec: ModernBertSpec):
        super().__init__()
        self.tok_embeddings = nn.Embedding(spec.vocab_size, spec.d_model)
        self.norm = _norm(spec)

    def forward(self, ids: Tensor) -> Tensor:
        """ids (total,) int64 -> (total, d) in the weights' dtype."""
        return self.norm(self.tok_embeddings(ids))


class _Attention(nn.Module):
    def __init__(self, spec: ModernBertSpec):
        super().__init__()
        self.Wqkv = nn.Linear(spec.d_model, 3 * spec.d_model, bias=spec.attention_bias)
        self.Wo = nn.Linear(spec.d_model, spec.d_model, bias=spec.attention_bias)


class _GeGLU(nn.Module):
    def __init__(self, spec: ModernBertSpec):
        super().__init__()
        self.Wi = nn.Linear(spec.d_model, 2 * spec.dim_feedforward, bias=spec.mlp_bias)
        self.Wo = nn.Linear(spec.dim_feedforward, spec.d_model, bias=spec.mlp_bias)


class ModernBertLayer(nn.Module):
    """One pre-LN ModernBERT layer. Parameter names are transformers' (attn_norm, attn.Wqkv, attn.Wo,
    mlp_norm, mlp.Wi, mlp.Wo), so a checkpoint maps onto it key for key."""

    def __init__(self, spec: ModernBertSpec, index: int):
        super().__init__()
        self.attn_norm = _norm(spec) if index > 0 else nn.Identity()
        self.attn = _Attention(spec)
        self.mlp_norm = _norm(spec)
        self.mlp = _GeGLU(spec)
        self.nhead = spec.nhead
        self.window = spec.window(index)
        self.act = activation(spec.activation)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cu_seqlens: Tensor, max_seqlen: int,
                kernel: Kernel | None = None) -> Tensor:
        """x (total, d); rope: cos, sin (total, Dh / 2) float32 from rope_tables, for this layer's base;
        cu_seqlens (B + 1,) int32 -> (total, d).

        kernel: the varlen kernel the model selected once for the whole forward, its inputs checked there (None:
        this layer alone, through btlib.varlen_attention's checks and selection)."""
        total, d = x.shape
        qkv = gemm.module_linear(self.attn.Wqkv, self.attn_norm(x)).view(total, 3, self.nhead, d // self.nhead)  # (total, 3, H, Dh)
        # q and k rotate in one pass; v stays a strided view (the kernels take any head_dim-contiguous strides)
        q, k = apply_rope(qkv[:, :2], *rope).unbind(1)  # (total, H, Dh) each
        v = qkv[:, 2]
        if kernel is None:
            o = varlen_attention(q, k, v, cu_seqlens, max_seqlen, window=self.window)  # (total, H, Dh)
        else:
            o = kernel.fn(q, k, v, cu_seqlens, max_seqlen, causal=False, scale=None, **window_kwargs(kernel, self.window))
        x = _residual(x, o.reshape(total, d), self.attn.Wo)
        u, g = gemm.module_linear(self.mlp.Wi, self.mlp_norm(x)).chunk(2, dim=-1)  # (total, f) each
        return _residual(x, self.act(u) * g, self.mlp.Wo)


def _residual(x: Tensor, h: Tensor, linear: nn.Linear) -> Tensor:
    """x + linear(h) with the residual added inside the GEMM (oneDNN's binary-add epilogue, or addmm's
    beta = 1: C = x + h W^T; btlib.gemm picks), so the (total, d) sum is not a separate read-read-write
    pass. Autograd takes addmm, which it differentiates as linear + add."""
    return gemm.module_linear(linear, h, residual=x)
