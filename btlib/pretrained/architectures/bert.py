"""The BERT family (BERT, RoBERTa, XLM-R, DistilBERT, CamemBERT, ELECTRA) on nn.TransformerEncoder, with a padding-free encode(); its loader.

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
``encode`` is btlib.pretrained.encoding's loop, the one ModernBERT runs too; this module supplies the
embeddings, the packed forward and PyTorch's padded paths (``_forward_packed``, ``_forward_padded``).

torch.compile: ``model.packed_encoder(dtype).forward_packed``, the encoder part of the packed path,
traces whole (fullgraph=True) with btlib's C++ attention kernel inside (tests/test_compile.py);
``encode`` itself does not (tokenizer, Python lists of ids, one forward per batch of texts).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...observe import run_slow
from ...models.encoder import dense_twin
from ...packed_encoder import PackedEncoder
from ...padding import lengths_to_padding_mask, pack, packed_positions, segment_ids
from ...position_bias import PositionBias
from ...precision import SlowPrecisionWarning, resolve_dtype
from ..folders.checkpoint import (CheckpointError, CheckpointSpec, check_against_spec, read_spec, read_state_dict,
                                 verify_sha256)
from ..encoding import PackedTokens, Runner, SentenceEncoder, pack_ids
from ..folders.st_folder import FolderPlan, passes_token_types, special_ids
from ..folders.st_folder import tokenizer as st_tokenizer
from ..st_modules import Pooling, SentenceHead

__all__ = ["PretrainedEncoder", "PATHS", "Embeddings", "load_bert"]

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
    """word + position + token type embeddings, then LayerNorm; ELECTRA's then a linear projection to d_model.

    MPNet's relative-position table (buckets, H) is kept here as ``relative``, beside the absolute one: forward does
    not use it; every layer's attention adds it (btlib.pretrained.architectures.mpnet)."""

    def __init__(self, spec: CheckpointSpec):
        super().__init__()
        e = spec.embedding_dim  # d_model, but for an ELECTRA whose embedding_size differs
        self.word = nn.Embedding(spec.vocab_size, e)
        self.position = nn.Embedding(spec.max_positions, e)
        self.token_type = nn.Embedding(spec.type_vocab_size, e) if spec.type_vocab_size else None
        self.norm = nn.LayerNorm(e, eps=spec.layer_norm_eps)
        self.project = nn.Linear(e, spec.d_model) if e != spec.d_model else None  # ELECTRA's embeddings_project
        self.relative = nn.Embedding(spec.relative_buckets, spec.nhead) if spec.relative_buckets else None

    def forward(self, ids: Tensor, positions: Tensor, types: Tensor | None = None) -> Tensor:
        """ids, positions (rows of the position table), types (None: 0 everywhere): same shape, int64 -> (..., d)."""
        x = self.word(ids) + self.position(positions)  # (..., e)
        if self.token_type is not None:
            x = x + (self.token_type.weight[0] if types is None else self.token_type(types))
        x = self.norm(x)
        return x if self.project is None else self.project(x)  # (..., e) -> (..., d)


class PretrainedEncoder(SentenceEncoder, nn.Module):
    """Embeddings + nn.TransformerEncoder + the folder's sentence-transformers head, from a Hugging Face-format folder.

    pooling: a :class:`Pooling` shorthand or a :class:`SentenceHead` (kept as ``model.head``).
    prompts / default_prompt_name: config_sentence_transformers.json's. token_types: whether transformers'
    tokenizer for this folder hands token_type_ids to the model (None: unknown, pairs are refused).
    special_ids: the ids transformers counts as special (a prompt's trailing [SEP] is not part of it).
    encode / tokenize: btlib.pretrained.encoding.SentenceEncoder's, with this class's forward paths.
    """

    PATHS = PATHS

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

    # -- tokens (SentenceEncoder.tokenize: pairs as transformers encodes them) ----------------
    def _token_types(self, texts: Sequence, enc: list) -> list[list[int]] | None:
        """Token types per text (None for all-0) from the tokenizer's encodings ``enc`` of ``texts``."""
        pairs = [not isinstance(t, str) for t in texts]
        if any(pairs) and self.token_types is None and self.spec.type_vocab_size > 1:
            raise ValueError("pairs need to know whether this folder's tokenizer hands token_type_ids to the model, and "
                             "its tokenizer_config.json's tokenizer_class is not one btlib knows; pass single texts")
        if not self.token_types or self.embeddings.token_type is None:
            return None
        types = [e.type_ids for e in enc]
        if max((max(t, default=0) for t in types), default=0) >= self.spec.type_vocab_size:
            raise ValueError(f"the tokenizer gives token type ids up to {max(max(t, default=0) for t in types)} but the "
                             f"model has type_vocab_size {self.spec.type_vocab_size}; transformers cannot run this either")
        return types

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
        before = c[cu_seqlens[:-1].long()][segment_ids(cu_seqlens.diff())]  # per token: its sequence's start
        return (c[1:] - before) * real + pad

    # -- forward paths -----------------------------------------------------------------------
    def packed_encoder(self, dtype: torch.dtype = torch.float32) -> PackedEncoder:
        """The PackedEncoder on this model's weights in ``dtype`` (fp32 shares them; bf16 is a converted copy, cached)."""
        if dtype not in self._packed:
            with warnings.catch_warnings():  # encode() has said it already, naming itself
                warnings.simplefilter("ignore", SlowPrecisionWarning)
                self._packed[dtype] = PackedEncoder.from_module(self.encoder, dtype=None if dtype == torch.float32 else dtype,
                                                                bias=self.position_bias())
        return self._packed[dtype]

    def position_bias(self) -> PositionBias | None:
        """The bias every layer's attention adds to its scores (MPNet's relative positions); None: BERT has none."""
        return None

    def int8_encoder(self) -> PackedEncoder:
        """The int8 twin of :meth:`packed_encoder` (btlib.smoothquant.quantize_auto on its CALIBRATION_TEXTS); cached."""
        if self._int8 is None:
            from ...smoothquant import CALIBRATION_TEXTS, quantize_auto

            with torch.inference_mode():
                batch = self._packed_inputs(self.tokenize(CALIBRATION_TEXTS))
                self._int8 = quantize_auto(self.packed_encoder(), [batch])
        return self._int8

    def _embed(self, tokens: PackedTokens) -> Tensor:
        """Packed token ids (and types) -> embedded tokens (total, d) float32."""
        return self.embeddings(tokens.ids, self.positions(tokens.ids, tokens.cu_seqlens), tokens.types)

    def _packed_inputs(self, ids: list[list[int]], types: list[list[int]] | None = None) -> tuple[Tensor, Tensor, int]:
        """Token ids (N lists) -> embedded packed tokens (total, d) float32, cu_seqlens (N + 1,) int32, max_seqlen."""
        tokens = pack_ids(ids, types)
        return self._embed(tokens), tokens.cu_seqlens, tokens.max_seqlen

    def _layers_in(self, precision: str) -> PackedEncoder:
        """The PackedEncoder in ``precision``'s dtype, or for "int8" the int8 twin (:meth:`int8_encoder`)."""
        return self.int8_encoder() if precision == "int8" else self.packed_encoder(resolve_dtype(precision))

    def _forward_packed(self, tokens: PackedTokens, runner: Runner) -> Tensor:
        """Embeddings, then the runner's PackedEncoder (in its dtype, or the int8 twin): (total, d) in runner.dtype."""
        x = self._embed(tokens).to(runner.dtype)
        return runner.layers.forward_packed(x, tokens.cu_seqlens, tokens.max_seqlen)

    def _forward_padded(self, ids: list[list[int]], types: list[list[int]] | None, path: str) -> tuple[Tensor, Tensor]:
        """PyTorch's paths on a right-padded (B, T) batch; the real tokens' states come back packed, so that one
        pooling serves every path."""
        T, pad_id = max(len(s) for s in ids), self.spec.pad_token_id
        tokens = torch.tensor([s + [pad_id] * (T - len(s)) for s in ids], dtype=torch.int64)  # (B, T)
        lengths = torch.tensor([len(s) for s in ids])
        pad = lengths_to_padding_mask(lengths, T)  # (B, T), True at padding
        tt = None if types is None else torch.tensor([s + [0] * (T - len(s)) for s in types], dtype=torch.int64)
        x = self.embeddings(tokens, self.positions(tokens), tt)
        enc = self.encoder if path == "fastpath_nested" else dense_twin(self.encoder)
        masks = self._padded_masks(pad)
        h = run_slow(enc, x, **masks) if path == "slow" else enc(x, **masks)  # (B, T, d)
        real = pack(h, lengths)
        return real.tokens, real.cu_seqlens

    def _padded_masks(self, pad: Tensor) -> dict[str, Tensor]:
        """nn.TransformerEncoder's mask arguments for a padded batch, pad (B, T) True at padding: the padding mask
        (an architecture that adds a bias to the scores gives its own ``mask`` instead)."""
        return {"src_key_padding_mask": pad}


def load_bert(plan: FolderPlan, *, expected_sha256: str | None = None,
              cls: type[PretrainedEncoder] = PretrainedEncoder, config: tuple[dict, Path] | None = None) -> PretrainedEncoder:
    """The BERT-family Transformer of a read folder (plan.transformer_dir) as a :class:`PretrainedEncoder`.

    expected_sha256: model.safetensors' hash, checked first. Config, every tensor's shape and the tokenizer are
    checked before the module is built (CheckpointError saying what to fix); the tensors the encoder does not use
    are kept aside, untouched, for btlib.to_hf_state_dict. cls: the class built (MPNet's loader passes
    MPNetEncoder, this module's subclass that adds the relative-position bias). config: config.json's (dict, path)
    where the caller read it already (btlib.load_pretrained reads it once to find the family).
    """
    src = plan.transformer_dir
    if expected_sha256:
        verify_sha256(src / "model.safetensors", expected_sha256)
    spec = read_spec(src, config)
    sd = read_state_dict(src)
    emb_keys, layer_keys = check_against_spec(sd, spec)
    head = plan.head(spec.d_model)
    tokenizer, max_length = st_tokenizer(plan, spec.max_positions - spec.position_offset, spec.max_positions,
                                         spec.model_type)

    if bool(spec.relative_buckets) != bool(getattr(cls, "HAS_RELATIVE_BIAS", False)):
        raise CheckpointError(f"{src}: a {spec.model_type} folder is loaded by btlib.load_pretrained, which picks the "
                              f"encoder class for it; load_bert(cls={cls.__name__}) cannot add its relative positions")
    model = cls(spec, tokenizer, max_length, head, prompts=plan.prompts,
                              default_prompt_name=plan.default_prompt_name,
                              token_types=passes_token_types(plan, spec.model_type), special_ids=special_ids(plan, tokenizer))
    mapped = {f"embeddings.{ours}" + ("" if "." in ours else ".weight"): theirs for ours, theirs in emb_keys.items()}
    for i, keys in enumerate(layer_keys):
        for part in ("out_proj", "norm1", "linear1", "linear2", "norm2"):
            sub = f"self_attn.{part}" if part == "out_proj" else part
            for wb in ("weight", "bias"):
                mapped[f"encoder.layers.{i}.{sub}.{wb}"] = keys[f"{part}.{wb}"]
    own = dict(model.named_parameters())
    with torch.no_grad():
        for ours, theirs in mapped.items():
            own[ours].copy_(sd[theirs])
        for i, keys in enumerate(layer_keys):
            attn = model.encoder.layers[i].self_attn
            attn.in_proj_weight.copy_(torch.cat([sd[keys[f"{x}.weight"]] for x in "qkv"]))  # (3d, d): q | k | v
            attn.in_proj_bias.copy_(torch.cat([sd[keys[f"{x}.bias"]] for x in "qkv"]))
    used = set(mapped.values()) | {keys[f"{x}.{wb}"] for keys in layer_keys for x in "qkv" for wb in ("weight", "bias")}
    # What the encoder does not use (pooler, heads, position_ids) is kept aside, untouched, for the reverse.
    model._hf = {"order": list(sd), "dtypes": {k: v.dtype for k, v in sd.items()}, "mapped": mapped, "layers": layer_keys,
                 "unused": {k: v for k, v in sd.items() if k not in used}}
    return model
