"""A padding-free Transformer encoder: an nn.TransformerEncoder's weights run on packed tokens.

    padded (B, T, d) + lengths --pack once--> (total, d) --N layers--> (total, d) --unpack once--> (B, T, d)

Every layer works on the ``total = sum(lengths)`` real tokens only:

    qkv = x W_qkv^T + b            (total, 3d)      6 d^2 FLOPs per token
    o   = varlen_attention(q, k, v, cu_seqlens)     4 L_i^2 d per sequence, no padding
    x   = LayerNorm(x + o W_o^T)                    2 d^2
    x   = LayerNorm(x + W_2 act(W_1 x + b_1))       4 d d_ff

so linear layers cost sum(L) instead of B*T, and attention sum(L_i^2) instead of B*T^2.
PyTorch's nested path gets the first saving but not the second: it re-pads for attention
(FACTS.md). Post-LN and pre-LN (norm_first) layers, ReLU, GELU or any callable activation,
with or without a final norm.

This module is for inference: dropout is not applied and there is no backward through the
C++ attention kernels.
"""

from __future__ import annotations

import copy
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import varlen_attention
from .padding import pack, padding_mask_to_lengths, unpack

__all__ = ["PackedEncoder"]


def _fused_kind(layer: nn.TransformerEncoderLayer) -> str | None:
    """'relu' or 'gelu' when the activation is one PyTorch can fuse into the GEMM epilogue."""
    return {1: "relu", 2: "gelu"}.get(getattr(layer, "activation_relu_or_gelu", 0))


class PackedEncoder(nn.Module):
    """Runs the layers of an nn.TransformerEncoder on packed tokens. Shares its parameters.

    Example:
        >>> enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, batch_first=True), 2).eval()
        >>> packed = PackedEncoder.from_module(enc)
        >>> out = packed(x, lengths=torch.tensor([5, 2]))   # x (2, 5, 64) -> (2, 5, 64), zeros at padding
    """

    def __init__(self, layers: nn.ModuleList, norm: nn.Module | None, attention_backend: str = "auto"):
        super().__init__()
        self.layers = layers
        self.norm = norm
        self.attention_backend = attention_backend

    @classmethod
    def from_module(cls, encoder: nn.TransformerEncoder | nn.TransformerEncoderLayer, *, attention_backend: str = "auto",
                    dtype: torch.dtype | None = None) -> "PackedEncoder":
        """Wrap an existing encoder (or a single layer) without copying its weights.

        dtype: run in this dtype instead (e.g. torch.bfloat16: this CPU's bf16 GEMMs are ~4x its
        fp32 rate); the weights are then *copied* and converted, the original is untouched.
        Inputs are cast to it and outputs cast back. Raises ValueError for layers it cannot run
        exactly: separate k/v dimensions, add_bias_kv or add_zero_attn.
        """
        if isinstance(encoder, nn.TransformerEncoderLayer):
            layers, norm = nn.ModuleList([encoder]), None
        elif isinstance(encoder, nn.TransformerEncoder):
            layers, norm = encoder.layers, encoder.norm
        else:
            raise TypeError(f"PackedEncoder.from_module takes nn.TransformerEncoder(Layer); got {type(encoder).__name__}")
        for i, layer in enumerate(layers):
            a = layer.self_attn
            if not a._qkv_same_embed_dim or a.bias_k is not None or a.add_zero_attn:
                raise ValueError(f"layer {i}: PackedEncoder needs plain self-attention (no kdim/vdim, add_bias_kv, add_zero_attn)")
        if dtype is not None:
            layers, norm = copy.deepcopy(layers).to(dtype), (copy.deepcopy(norm).to(dtype) if norm is not None else None)
        return cls(layers, norm, attention_backend)

    def forward(self, src: Tensor, lengths: Tensor | None = None, src_key_padding_mask: Tensor | None = None) -> Tensor:
        """src: (B, T, d) batch-first, real tokens first. Give ``lengths`` (B,) or a left-aligned
        ``src_key_padding_mask`` (B, T, True at padding). Returns (B, T, d), zeros at padding
        (as PyTorch's nested path returns)."""
        if src.dim() != 3:
            raise ValueError(f"src must be (B, T, d_model); got {tuple(src.shape)}")
        B, T = src.shape[:2]
        if lengths is None:
            lengths = padding_mask_to_lengths(src_key_padding_mask) if src_key_padding_mask is not None else \
                torch.full((B,), T, dtype=torch.int64)
        tokens, cu_seqlens, max_seqlen = pack(src, lengths)  # pack once: (total, d)
        out = self.forward_packed(tokens.to(self.layers[0].linear1.weight.dtype), cu_seqlens, max_seqlen)
        return unpack(out.to(src.dtype), cu_seqlens, T)  # unpack once, zeros at padding

    def forward_packed(self, x: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        """x: (total, d) packed tokens; cu_seqlens: (B + 1,) int32 -> (total, d)."""
        for layer in self.layers:
            if layer.norm_first:
                x = x + self._attention(layer, layer.norm1(x), cu_seqlens, max_seqlen)
                x = x + self._feed_forward(layer, layer.norm2(x))
            else:
                x = layer.norm1(x + self._attention(layer, x, cu_seqlens, max_seqlen))
                x = layer.norm2(x + self._feed_forward(layer, x))
        return self.norm(x) if self.norm is not None else x

    def _attention(self, layer: nn.TransformerEncoderLayer, x: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        a = layer.self_attn
        total, d = x.shape
        H = a.num_heads
        qkv = F.linear(x, a.in_proj_weight, a.in_proj_bias).view(total, 3, H, d // H)  # (total, 3, H, Dh)
        # Strided views, not copies: every varlen kernel takes any strides with head_dim contiguous,
        # which saves writing 3 * total * d floats per layer into freshly faulted-in pages.
        q, k, v = qkv.unbind(1)  # (total, H, Dh) each
        o = varlen_attention(q, k, v, cu_seqlens, max_seqlen, backend=self.attention_backend)  # (total, H, Dh)
        return a.out_proj(o.view(total, d))

    @staticmethod
    def _feed_forward(layer: nn.TransformerEncoderLayer, x: Tensor) -> Tensor:
        kind = _fused_kind(layer)
        if kind is not None and layer.linear1.bias is not None:
            # bias + activation fused into the GEMM's epilogue: one pass over the (total, d_ff) activations, not three
            h = torch._addmm_activation(layer.linear1.bias, x, layer.linear1.weight.t(), use_gelu=kind == "gelu")
        else:
            h = layer.activation(layer.linear1(x))
        return layer.linear2(h)
