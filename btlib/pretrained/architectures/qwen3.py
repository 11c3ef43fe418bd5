"""Qwen3 (Qwen3-Embedding's architecture) on packed tokens: a decoder used as an embedder, causal attention, no padding.

    model = btlib.load_pretrained("path/to/Qwen3-Embedding-0.6B")   # config.json model_type "qwen3"
    q = model.encode(queries, prompt=instruct("Given a web search query, retrieve relevant passages"))
    d = model.encode(documents)                                       # documents take no prompt
    scores = q @ d.T                                                  # last-token pooled, L2-normalised: cosines

One layer, on x (total, d) packed tokens (transformers 5.23's Qwen3DecoderLayer):

    h = rms(x) * w_attn                    RMSNorm: x / sqrt(mean(x^2) + eps), in fp32, then scaled
    q, k, v = h Wqkv^T                     (total, H, Dh), (total, Hkv, Dh) x 2; H Dh need not be d
                                                                                   2 d (H + 2 Hkv) Dh FLOPs/token
    q, k = rms(q) * w_q, rms(k) * w_k      per head, over Dh (q_norm, k_norm)
    q, k = rope(q, p), rope(k, p)          p = position inside its own sequence (restarts at 0), base rope_theta
    o = varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal=True)   query i sees keys j <= i of its own sequence
    x = x + o Wo^T                                                                                      2 d H Dh
    g, u = (rms(x) * w_mlp) Wi^T           Wi = gate | up: SwiGLU                                       4 d f
    x = x + (silu(g) * u) Wdown^T                                                                       2 d f

then a final RMSNorm. Qwen3-Embedding pools the last token (sentence-transformers' Pooling lasttoken, then Normalize),
which in a causal model is the only token that has seen the whole text; btlib's head (btlib.pretrained.st_modules) does
exactly that on packed tokens: the row cu_seqlens[b + 1] - 1. A folder without modules.json is mean-pooled, as
sentence-transformers would do it.

Grouped-query attention: btlib's varlen kernels take one head count for q, k and v (the C++ kernel checks it), so k and
v are copied out to H heads (each key head G = H / Hkv times in a row, an expand + reshape) before the call: 2 H Dh
elements written per token and layer, of which 2 (H - Hkv) Dh are repeats (Qwen3-Embedding-0.6B, H 16, Hkv 8, Dh 128: 4096 floats, 16 KiB in fp32, beside the
~31 M FLOPs per token of the layer's linear maps). A GQA-aware kernel would read each key head once for its G = H / Hkv
query heads instead and write nothing.

Positions: transformers gives each sequence positions 0.. when run alone or right-padded; left-padded (Qwen3-Embedding's
tokenizer pads on the left) it shifts them all by the padding, which RoPE's relative form leaves unchanged up to
rounding. RoPE and the layer skeleton are ModernBERT's and NomicBERT's (rope_tables / apply_rope, _residual,
activation; rotary_bert's load_folder / file_state_dict), imported, not repeated. Parity is against transformers'
Qwen3Model on random-weight folders (tests/test_qwen3.py). Precisions: fp32 and bf16 (a cached bf16 copy of the
layers); int8 is refused (btlib.quant's int8 twin is built for nn.TransformerEncoder layers, which these are not).
Caveats: no sliding-window layers, no scaled RoPE (yarn, dynamic, ...), one model.safetensors (no shards): refused
at load, by name.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor, nn

from ... import gemm
from ...kernels import registry
from ...kernels.registry import Kernel
from ...packed_encoder import _select_varlen
from ...padding import check_cu_seqlens, packed_positions
from ...precision import PRECISIONS, check_precision, resolve_dtype
from ..encoding import PackedTokens, Runner, SentenceEncoder, check_texts, pack_ids
from ..folders.qwen3_config import Qwen3Spec, spec_from_config, tensor_plan
from ..folders.st_folder import FolderPlan
from .modernbert_layers import _residual, activation, apply_rope, rope_tables
from .rotary_bert import file_state_dict, load_folder

__all__ = ["Qwen3Encoder", "load_qwen3", "instruct", "RMSNorm"]


def instruct(task: str) -> str:
    """Qwen3-Embedding's query prompt for a one-sentence task description: ``f"Instruct: {task}\\nQuery:"``, to pass as
    ``encode(queries, prompt=instruct(task))`` (the model card's get_detailed_instruct; documents take no prompt)."""
    if not isinstance(task, str) or not task.strip():
        raise ValueError(f"task must be a non-empty str describing the retrieval task; got {task!r}")
    return f"Instruct: {task}\nQuery:"


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: x / sqrt(mean(x^2) + eps) over the last axis in fp32, cast back to x's dtype, then times weight
    (transformers' order, so bf16 rounds where transformers rounds)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """x (..., dim) any float dtype -> x's shape and dtype."""
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Qwen3Layer(nn.Module):
    """One pre-RMSNorm decoder layer (the module docstring's lines). Wqkv is q | k | v and Wi gate | up, fused at load."""

    def __init__(self, spec: Qwen3Spec):
        super().__init__()
        d, f, Dh = spec.d_model, spec.dim_feedforward, spec.head_dim
        self.H, self.Hkv, self.Dh = spec.nhead, spec.nkv, Dh
        self.attn_norm = RMSNorm(d, spec.norm_eps)
        self.Wqkv = nn.Linear(d, (spec.nhead + 2 * spec.nkv) * Dh, bias=spec.attention_bias)
        self.q_norm = RMSNorm(Dh, spec.norm_eps)
        self.k_norm = RMSNorm(Dh, spec.norm_eps)
        self.Wo = nn.Linear(spec.nhead * Dh, d, bias=spec.attention_bias)
        self.mlp_norm = RMSNorm(d, spec.norm_eps)
        self.Wi = nn.Linear(d, 2 * f, bias=False)
        self.Wdown = nn.Linear(f, d, bias=False)
        self.act = activation(spec.activation)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cu_seqlens: Tensor, max_seqlen: int, kernel: Kernel) -> Tensor:
        """x (total, d); rope: cos, sin (total, Dh / 2) float32; cu_seqlens (B + 1,) int32 -> (total, d)."""
        total = x.shape[0]
        H, Hkv, Dh = self.H, self.Hkv, self.Dh
        qkv = gemm.module_linear(self.Wqkv, self.attn_norm(x))  # (total, (H + 2 Hkv) Dh)
        q, k, v = qkv.split((H * Dh, Hkv * Dh, Hkv * Dh), dim=-1)
        q = apply_rope(self.q_norm(q.view(total, H, Dh)), *rope)  # (total, H, Dh)
        k = apply_rope(self.k_norm(k.view(total, Hkv, Dh)), *rope)  # (total, Hkv, Dh)
        v = v.view(total, Hkv, Dh)  # a strided view: the kernels take any strides with Dh contiguous
        if Hkv != H:  # GQA (module docstring: the copy's cost): key head j serves query heads j G .. j G + G - 1
            k, v = (t.unsqueeze(2).expand(total, Hkv, H // Hkv, Dh).reshape(total, H, Dh) for t in (k, v))  # (total, H, Dh)
        o = kernel.fn(q, k, v, cu_seqlens, max_seqlen, causal=True, scale=None)  # (total, H, Dh), scale 1 / sqrt(Dh)
        x = _residual(x, o.reshape(total, H * Dh), self.Wo)
        g, u = gemm.module_linear(self.Wi, self.mlp_norm(x)).chunk(2, dim=-1)  # (total, f) each
        return _residual(x, self.act(g) * u, self.Wdown)


class _Stack(nn.Module):
    """The layers and the final norm: what the bf16 copy converts together."""

    def __init__(self, layers: nn.ModuleList, norm: RMSNorm):
        super().__init__()
        self.layers, self.norm = layers, norm


class Qwen3Encoder(SentenceEncoder, nn.Module):
    """Qwen3 on packed tokens, plus encode() (sentence-transformers' modules as the folder gives them); module docstring.

    Parameter names: ``embed_tokens.weight``, ``layers.3.Wqkv.weight`` (q | k | v), ``layers.3.Wi.weight``
    (gate | up), ``layers.3.attn_norm.weight`` (input_layernorm), ``norm.weight``, ...; the loader maps the file's
    names onto them and :func:`btlib.to_hf_state_dict` maps them back, bit for bit.
    """

    PATHS = ("packed", "packed_bf16")
    PRECISIONS = PRECISIONS  # no "int8": check_precision says so by name
    WHO = "Qwen3"

    def __init__(self, spec: Qwen3Spec, tokenizer, max_length: int, head):
        super().__init__()
        self.spec, self.tokenizer, self.max_length, self.head = spec, tokenizer, max_length, head
        self.set_prompts(None, None)
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.d_model)
        self.layers = nn.ModuleList(Qwen3Layer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.d_model, spec.norm_eps)
        self._copies: dict[torch.dtype, _Stack] = {}  # bf16 copies, made on first use: clear after changing weights
        self._kernels: dict[tuple, Kernel] = {}
        self.eval()

    # -- tokens ------------------------------------------------------------------------------
    def pack(self, texts: Sequence[str]) -> tuple[Tensor, Tensor, int]:
        """Texts -> ids (total,) int64, cu_seqlens (B + 1,) int32, max_seqlen int, as encode tokenizes them (no prompt)."""
        check_texts(texts)
        tokens = pack_ids(self.tokenize(texts))
        return tokens.ids, tokens.cu_seqlens, tokens.max_seqlen

    # -- forward -----------------------------------------------------------------------------
    def _check_path(self, path: str) -> None:
        if path not in self.PATHS:
            raise ValueError(f"path must be one of {self.PATHS} for Qwen3 (causal GQA layers have no "
                             f"nn.TransformerEncoder twin for PyTorch's fastpath); got {path!r}")

    def forward(self, ids: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, precision: str | None = None) -> Tensor:
        """Last hidden states (total, d) float32 of packed tokens, as transformers' Qwen3Model gives each sequence's.

        ids: (total,) int64; cu_seqlens: (B + 1,) int32; max_seqlen >= the longest sequence.
        precision: None / "fp32", "bf16" or "auto" (btlib.choose_precision).
        """
        if ids.dim() != 1 or ids.dtype.is_floating_point:
            raise ValueError(f"ids must be (total,) integer token ids; got {tuple(ids.shape)} {ids.dtype}")
        check_cu_seqlens(cu_seqlens, total=ids.numel(), max_seqlen=max_seqlen)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size):
            raise ValueError(f"ids must be token ids in [0, {self.spec.vocab_size}); got {int(ids.min())} .. {int(ids.max())}")
        precision = check_precision(precision, PRECISIONS, who=self.WHO)
        return self._forward_packed(PackedTokens(ids, None, cu_seqlens, int(max_seqlen)), self.runner(precision))

    def _stack(self, dtype: torch.dtype) -> _Stack:
        """The layers and final norm in ``dtype``: fp32 shares this module's weights; another dtype is a converted
        copy, cached (the embedding table stays as loaded: only the looked-up rows are cast)."""
        if dtype == self.norm.weight.dtype:
            return _Stack(self.layers, self.norm)
        if dtype not in self._copies:
            self._copies[dtype] = copy.deepcopy(_Stack(self.layers, self.norm)).to(dtype)
        return self._copies[dtype]

    def _layers_in(self, precision: str):
        """The layers in ``precision``'s dtype (fp32: this module's own; bf16: a converted copy, cached)."""
        return self._stack(resolve_dtype(precision))

    def _forward_packed(self, tokens: PackedTokens, runner: Runner) -> Tensor:
        """(total, d) float32 last hidden states, by runner.layers in runner.dtype."""
        ids, cu_seqlens, max_seqlen = tokens.ids, tokens.cu_seqlens, tokens.max_seqlen
        positions = packed_positions(cu_seqlens, ids.numel())  # (total,): 0, 1, ... restarting per sequence
        rope = rope_tables(positions, self.spec.head_dim, *self.spec.rope)  # cos, sin (total, Dh / 2) float32
        stack, dtype = runner.layers, runner.dtype
        x = self.embed_tokens(ids).to(dtype)  # (total, d)
        kernel = self._kernel(stack, x)
        with gemm.planned(dtype, x.shape[0]):  # every linear has M = total tokens: one GEMM path for all
            for layer in stack.layers:
                x = layer(x, rope, cu_seqlens, max_seqlen, kernel)
        return stack.norm(x).float()

    def _kernel(self, stack: _Stack, x: Tensor) -> Kernel:
        """The causal varlen kernel for (total, H, Dh) q, k, v in x's dtype and device, selected once per (dtype,
        device, grad)."""
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in stack.parameters()))
        key = (x.dtype, x.device, needs_grad)
        if key not in self._kernels:
            self._kernels[key] = registry.get(_select_varlen(x.dtype, x.device, self.spec.nhead, self.spec.head_dim,
                                                             needs_grad, "auto", causal=True))
        return self._kernels[key]

    # -- the file's tensors back -------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, Tensor]:
        """The checkpoint's state dict from the current weights, in the file's key order and dtypes (the fused
        Wqkv and Wi split back into q, k, v and gate, up; lm_head, if the file has one, untouched)."""
        return file_state_dict(self)


def load_qwen3(plan: FolderPlan, *, expected_sha256: str | None = None, config: tuple[dict, Path] | None = None) -> Qwen3Encoder:
    """The Qwen3 Transformer of a read folder (plan.transformer_dir) as a :class:`Qwen3Encoder`.

    Config (btlib.pretrained.folders.qwen3_config's table), every tensor's presence and shape, and the tokenizer are
    checked before a module is built: CheckpointError saying what to fix, never a half-loaded model.
    """
    return load_folder(plan, expected_sha256, spec_from_config, tensor_plan,
                       lambda spec, tokenizer, max_length, src: Qwen3Encoder(spec, tokenizer, max_length,
                                                                             plan.head(spec.d_model)), config)
