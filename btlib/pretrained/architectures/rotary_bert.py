"""NomicBERT and GTE on packed tokens: post-LN BERT layers with rotary positions and a GLU feed-forward.

    model = btlib.load_pretrained("path/to/nomic-embed-text-v1.5")  # config.json model_type "nomic_bert", "new" or "gte"
    ids, cu_seqlens, max_seqlen = model.pack(["search_query: a text"])  # (total,) int64, (B + 1,) int32, int
    h = model(ids, cu_seqlens, max_seqlen)                          # (total, d) float32 last hidden states
    emb = model.encode(texts, precision="auto")                    # (N, out) pooled as the folder says

One layer, on x (total, d) packed tokens (transformers 5.23's NomicBertLayer / GteLayer):

    q, k, v = (x Wqkv^T).chunk(3)          (total, H, Dh) each; GTE: with biases, NomicBERT: none   6 d^2 FLOPs/token
    q, k = rope(q, p), rope(k, p)          p = position inside its own sequence; base rope_theta (NTK-scaled for
                                           GTE v1.5: btlib.pretrained.folders.rotary_bert_config)
    o = varlen_attention(q, k, v, cu_seqlens, max_seqlen)
    x = attn_norm(x + o Wo^T)              post-LN, as BERT                                           2 d^2
    g, u = (x Wi^T).chunk(2)               Wi = gate | up, no bias (SwiGLU for NomicBERT, GeGLU for GTE) 4 d f
    x = mlp_norm(x + (act(g) * u) Wdown^T)                                                             2 d f

The embeddings are the word table, plus the token type table where the config has one, then LayerNorm: no position
table (positions enter through RoPE, ModernBERT's helpers btlib.pretrained.architectures.modernbert_layers.rope_tables /
apply_rope, which this module imports rather than repeats). Parity is against transformers' NomicBertModel / GteModel
on random-weight folders (tests/test_rotary_bert.py), not against the Hub's remote code, which cannot be run here.
Precisions: fp32 and bf16 (a cached bf16 copy of the layers); int8 is refused (btlib.quant's int8 twin is built for
nn.TransformerEncoder layers, which these are not).
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
from ..folders.checkpoint import CheckpointError, read_config, read_state_dict, verify_sha256
from ..encoding import PackedTokens, Runner, SentenceEncoder, check_texts, pack_ids
from .modernbert_layers import _residual, activation, apply_rope, rope_tables
from ..folders.rotary_bert_config import Piece, RotaryBertSpec, spec_from_config, tensor_plan
from ..folders.st_folder import FolderPlan, passes_token_types, special_ids
from ..folders.st_folder import tokenizer as st_tokenizer

__all__ = ["RotaryBertEncoder", "load_rotary_bert", "load_pieces", "file_state_dict"]


class _Embeddings(nn.Module):
    def __init__(self, spec: RotaryBertSpec):
        super().__init__()
        self.word_embeddings = nn.Embedding(spec.vocab_rows, spec.d_model)
        self.token_type_embeddings = nn.Embedding(spec.type_vocab_size, spec.d_model) if spec.type_vocab_size else None
        self.norm = nn.LayerNorm(spec.d_model, eps=spec.norm_eps)

    def forward(self, ids: Tensor, types: Tensor | None) -> Tensor:
        """ids, types (total,) int64 (types None: 0 everywhere) -> (total, d)."""
        x = self.word_embeddings(ids)
        if self.token_type_embeddings is not None:
            x = x + (self.token_type_embeddings(types) if types is not None else self.token_type_embeddings.weight[0])
        return self.norm(x)


class RotaryBertLayer(nn.Module):
    """One post-LN layer (the module docstring's lines). Wqkv is q | k | v and Wi gate | up, fused at load."""

    def __init__(self, spec: RotaryBertSpec):
        super().__init__()
        d, f = spec.d_model, spec.dim_feedforward
        self.nhead = spec.nhead
        self.Wqkv = nn.Linear(d, 3 * d, bias=spec.biases)
        self.Wo = nn.Linear(d, d, bias=spec.biases)
        self.attn_norm = nn.LayerNorm(d, eps=spec.norm_eps)
        self.Wi = nn.Linear(d, 2 * f, bias=False)
        self.Wdown = nn.Linear(f, d, bias=spec.biases)
        self.mlp_norm = nn.LayerNorm(d, eps=spec.norm_eps)
        self.act = activation(spec.activation)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cu_seqlens: Tensor, max_seqlen: int, kernel: Kernel) -> Tensor:
        """x (total, d); rope: cos, sin (total, Dh / 2) float32; cu_seqlens (B + 1,) int32 -> (total, d)."""
        total, d = x.shape
        qkv = gemm.module_linear(self.Wqkv, x).view(total, 3, self.nhead, d // self.nhead)  # (total, 3, H, Dh)
        q, k = apply_rope(qkv[:, :2], *rope).unbind(1)  # (total, H, Dh) each
        o = kernel.fn(q, k, qkv[:, 2], cu_seqlens, max_seqlen, causal=False, scale=None)  # (total, H, Dh)
        x = self.attn_norm(_residual(x, o.reshape(total, d), self.Wo))
        g, u = gemm.module_linear(self.Wi, x).chunk(2, dim=-1)  # (total, f) each
        return self.mlp_norm(_residual(x, self.act(g) * u, self.Wdown))


class RotaryBertEncoder(SentenceEncoder, nn.Module):
    """NomicBERT or GTE (``spec.family``) on packed tokens, plus encode(); see the module docstring.

    Parameter names are btlib's (``embeddings.word_embeddings.weight``, ``layers.3.Wqkv.weight``, ...); the loader
    maps the file's names onto them and :func:`btlib.to_hf_state_dict` maps them back, bit for bit.
    """

    PATHS = ("packed", "packed_bf16")
    PRECISIONS = PRECISIONS  # no "int8": check_precision says so by name

    def __init__(self, spec: RotaryBertSpec, tokenizer, max_length: int, head, token_types: bool | None = False):
        super().__init__()
        self.spec, self.tokenizer, self.max_length, self.head = spec, tokenizer, max_length, head
        self.WHO = "NomicBERT" if spec.family == "nomic_bert" else "GTE"
        self.token_types = token_types  # whether the folder's tokenizer hands token_type_ids to the model (None: unknown)
        self.set_prompts(None, None)
        self.embeddings = _Embeddings(spec)
        self.layers = nn.ModuleList(RotaryBertLayer(spec) for _ in range(spec.num_layers))
        self._copies: dict[torch.dtype, nn.ModuleList] = {}  # bf16 copies, made on first use: clear after changing weights
        self._kernels: dict[tuple, Kernel] = {}
        self.eval()

    # -- tokens ------------------------------------------------------------------------------
    def pack(self, texts: Sequence[str | tuple[str, str]]) -> tuple[Tensor, Tensor, int]:
        """Texts -> ids (total,) int64, cu_seqlens (B + 1,) int32, max_seqlen int (token types: use encode)."""
        check_texts(texts)
        tokens = pack_ids(self.tokenize(texts))
        return tokens.ids, tokens.cu_seqlens, tokens.max_seqlen

    def _token_types(self, texts: Sequence, enc: list) -> list[list[int]] | None:
        """Token types per text (None for all-0) from the tokenizer's encodings ``enc`` of ``texts``."""
        if any(not isinstance(t, str) for t in texts) and self.token_types is None and self.spec.type_vocab_size > 1:
            raise ValueError("pairs need to know whether this folder's tokenizer hands token_type_ids to the model, and "
                             "its tokenizer_config.json's tokenizer_class is not one btlib knows; pass single texts")
        if not self.token_types or not self.spec.type_vocab_size:
            return None
        types = [e.type_ids for e in enc]
        top = max((max(t, default=0) for t in types), default=0)
        if top >= self.spec.type_vocab_size:
            raise ValueError(f"the tokenizer gives token type ids up to {top} but the model has type_vocab_size "
                             f"{self.spec.type_vocab_size}; pass single texts")
        return types

    # -- forward -----------------------------------------------------------------------------
    def _check_path(self, path: str) -> None:
        if path not in self.PATHS:
            raise ValueError(f"path must be one of {self.PATHS} for {self.WHO} (rotary and GLU layers have no "
                             f"nn.TransformerEncoder twin for PyTorch's fastpath); got {path!r}")

    def forward(self, ids: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, types: Tensor | None = None,
                precision: str | None = None) -> Tensor:
        """Last hidden states (total, d) float32 of packed tokens, as transformers' model gives them for the real tokens.

        ids: (total,) int64; cu_seqlens: (B + 1,) int32; max_seqlen >= the longest sequence; types: (total,) int64
        token type ids or None (0 everywhere). precision: None / "fp32", "bf16" or "auto" (btlib.choose_precision).
        """
        if ids.dim() != 1 or ids.dtype.is_floating_point:
            raise ValueError(f"ids must be (total,) integer token ids; got {tuple(ids.shape)} {ids.dtype}")
        check_cu_seqlens(cu_seqlens, total=ids.numel(), max_seqlen=max_seqlen)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_rows):
            raise ValueError(f"ids must be token ids in [0, {self.spec.vocab_rows}); got {int(ids.min())} .. {int(ids.max())}")
        n_types = max(self.spec.type_vocab_size, 1)
        if types is not None and (types.shape != ids.shape or types.numel() and not (
                0 <= int(types.min()) and int(types.max()) < n_types)):
            raise ValueError(f"types must be (total,) token type ids in [0, {self.spec.type_vocab_size}) like ids")
        precision = check_precision(precision, PRECISIONS, who=self.WHO)
        return self._forward_packed(PackedTokens(ids, types, cu_seqlens, int(max_seqlen)), self.runner(precision))

    def _layers(self, dtype: torch.dtype) -> nn.ModuleList:
        """The layers in ``dtype``: fp32 shares this module's weights; another dtype is a converted copy, cached."""
        if dtype == self.embeddings.norm.weight.dtype:
            return self.layers
        if dtype not in self._copies:
            self._copies[dtype] = copy.deepcopy(self.layers).to(dtype)
        return self._copies[dtype]

    def _layers_in(self, precision: str):
        """The layers in ``precision``'s dtype (fp32: this module's own; bf16: a converted copy, cached)."""
        return self._layers(resolve_dtype(precision))

    def _forward_packed(self, tokens: PackedTokens, runner: Runner) -> Tensor:
        """(total, d) float32 last hidden states, by runner.layers in runner.dtype."""
        ids, cu_seqlens, max_seqlen = tokens.ids, tokens.cu_seqlens, tokens.max_seqlen
        positions = packed_positions(cu_seqlens, ids.numel())  # (total,): 0, 1, ... restarting per sequence
        base, divisor = self.spec.rope
        rope = rope_tables(positions, self.spec.head_dim, base, divisor)
        layers, dtype = runner.layers, runner.dtype
        x = self.embeddings(ids, tokens.types).to(dtype)  # (total, d)
        kernel = self._kernel(layers, x)
        with gemm.planned(dtype, x.shape[0]):  # every linear has M = total tokens: one GEMM path for all
            for layer in layers:
                x = layer(x, rope, cu_seqlens, max_seqlen, kernel)
        return x.float()

    def _kernel(self, layers: nn.ModuleList, x: Tensor) -> Kernel:
        """The varlen kernel for (total, H, Dh) q, k, v in x's dtype and device, selected once per (dtype, device, grad)."""
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in layers.parameters()))
        key = (x.dtype, x.device, needs_grad)
        if key not in self._kernels:
            self._kernels[key] = registry.get(_select_varlen(x.dtype, x.device, self.spec.nhead, self.spec.head_dim,
                                                             needs_grad, "auto"))
        return self._kernels[key]

    # -- the file's tensors back -------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, Tensor]:
        """The checkpoint's state dict from the current weights, in the file's key order and dtypes (the fused
        Wqkv and Wi split back into the file's pieces)."""
        return file_state_dict(self)


def load_pieces(model: nn.Module, sd: dict[str, Tensor], pieces: dict[str, list[Piece]]) -> None:
    """Copy the file's tensors into ``model``'s parameters by a tensor plan (our name -> the file's (key, rows)
    pieces, concatenated along dim 0), and keep in ``model._hf`` what :func:`file_state_dict` needs to give the file
    back: key order, dtypes, the plan, and the tensors the model does not use, untouched. Shared with Qwen3."""
    own = dict(model.named_parameters())
    if set(own) != set(pieces):
        raise CheckpointError(f"btlib's parameters and the file's plan differ: {sorted(set(own) ^ set(pieces))}")
    with torch.no_grad():
        for ours, parts in pieces.items():
            own[ours].copy_(torch.cat([sd[k] if rows is None else sd[k][rows] for k, rows in parts]))
    used = {k for parts in pieces.values() for k, _ in parts}
    model._hf = {"order": list(sd), "dtypes": {k: v.dtype for k, v in sd.items()}, "plan": pieces,
                 "shapes": {k: tuple(sd[k].shape) for k in used}, "unused": {k: v for k, v in sd.items() if k not in used}}


def file_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The checkpoint's state dict from ``model``'s current weights (loaded by :func:`load_pieces`), in the file's key
    order and dtypes: each fused parameter split back into the file's pieces."""
    info, params = model._hf, dict(model.named_parameters())
    out: dict[str, Tensor] = dict(info["unused"])
    parts: dict[str, list[tuple[int, Tensor]]] = {}
    for ours, pieces in info["plan"].items():
        offset = 0
        for key, rows in pieces:
            n = info["shapes"][key][0] if rows is None else rows.stop - rows.start
            parts.setdefault(key, []).append((0 if rows is None else rows.start, params[ours].detach()[offset:offset + n]))
            offset += n
    for key, got in parts.items():
        out[key] = torch.cat([t for _, t in sorted(got, key=lambda p: p[0])])
    return {k: out[k].to(info["dtypes"][k]).contiguous() for k in info["order"]}


def load_rotary_bert(plan: FolderPlan, *, expected_sha256: str | None = None,
                     config: tuple[dict, Path] | None = None) -> RotaryBertEncoder:
    """The NomicBERT / GTE Transformer of a read folder (plan.transformer_dir) as a :class:`RotaryBertEncoder`.

    Config (btlib.pretrained.folders.rotary_bert_config's tables), every tensor's presence and shape, and the tokenizer are
    checked before a module is built: CheckpointError saying what to fix, never a half-loaded model. Tensors the
    encoder does not use (a pooler, a masked-LM head) are kept aside, untouched, for btlib.to_hf_state_dict.
    """
    def build(spec, tokenizer, max_length: int, src: Path) -> RotaryBertEncoder:
        return RotaryBertEncoder(spec, tokenizer, max_length, plan.head(spec.d_model),
                                 token_types=passes_token_types(plan, "bert" if spec.family == "nomic_bert" else "gte"))

    return load_folder(plan, expected_sha256, spec_from_config, tensor_plan, build, config)


def load_folder(plan: FolderPlan, expected_sha256: str | None, spec_from_config, tensor_plan, build,
                config: tuple[dict, Path] | None = None):
    """The loading steps every rotary family shares (NomicBERT / GTE here, Qwen3): the file's sha256 where given, the
    config read into a spec, every tensor checked against it (``tensor_plan``), the tokenizer, then the module
    ``build(spec, tokenizer, max_length, src)`` makes, with the folder's prompts and the file's weights set.
    config: config.json's (dict, path) where the caller read it already (btlib.load_pretrained)."""
    src = Path(plan.transformer_dir)
    if expected_sha256:
        verify_sha256(src / "model.safetensors", expected_sha256)
    c, where = read_config(src) if config is None else config
    spec = spec_from_config(c, str(where))
    sd = read_state_dict(src)
    pieces = tensor_plan(sd, spec)
    tokenizer, max_length = st_tokenizer(plan, spec.max_positions, spec.max_positions, c.get("model_type"))
    model = build(spec, tokenizer, max_length, src)
    model.set_prompts(plan.prompts, plan.default_prompt_name, special_ids(plan, tokenizer))
    load_pieces(model, sd, pieces)
    return model
