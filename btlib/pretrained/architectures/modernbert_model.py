"""A pretrained ModernBERT on packed tokens: no padding anywhere, local layers windowed.

    model = btlib.load_pretrained("path/to/ModernBERT-base")       # config.json model_type "modernbert"
    ids, cu_seqlens, max_seqlen = model.pack(["a text", "another"])  # (total,) int64, (B + 1,) int32, int
    h = model(ids, cu_seqlens, max_seqlen)                         # (total, d) float32 last hidden states
    emb = model.encode(texts)                                      # (N, d): pooled as the folder says
    emb = model.encode(texts, precision="auto")                    # bf16 only where native and measured faster

Token ids go straight from the tokenizer into one (total,) tensor; each token's position is its
offset inside its own sequence (from cu_seqlens), which is all RoPE needs; global layers call
``btlib.varlen_attention(..., window=None)`` and local ones ``window=(w, w)``, w = local_attention // 2.
The result equals transformers' ModernBertModel.last_hidden_state on the real tokens.

Pooling (``model.head``; ``model.pooling`` as a :class:`Pooling` shorthand): the folder's sentence-transformers
modules after the Transformer (Pooling, Dense, Normalize: btlib.pretrained.st_modules); a bare checkpoint
(answerdotai/ModernBERT-base, a masked-LM model, not an embedding model) gets sentence-transformers' default,
mean without normalisation.
The sentence-transformers folders of ModernBERT embedding models name their own: e.g.
nomic-ai/modernbert-embed-base mean-pools and normalises (and expects "search_query: " /
"search_document: " prefixes in the texts), Alibaba-NLP/gte-modernbert-base takes the CLS token.
Assign a :class:`Pooling` to ``model.pooling`` (or a SentenceHead to ``model.head``) to choose another.
(config.json's ``classifier_pooling`` belongs to transformers' classification head, not to sentence
embeddings, and is not read.)

Without a folder: ``ModernBertEncoder.from_config({"hidden_size": 768, ...})`` builds a random model of
any shape; a transformers ModernBertModel's ``state_dict()`` loads into it as it is (same names).
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import Tensor, nn

from ... import gemm
from ...kernels import registry
from ...packed_encoder import _select_varlen
from ...kernels.registry import Kernel
from ...padding import check_cu_seqlens, packed_positions
from ...precision import PRECISIONS, check_precision, resolve_dtype
from ..encoding import PackedTokens, Runner, SentenceEncoder, Tokens, check_text, check_texts, pack_ids
from ..st_modules import Pooling
from ..folders.modernbert_config import ModernBertSpec, spec_from_config
from .modernbert_layers import ModernBertEmbeddings, ModernBertLayer, _norm, rope_tables

__all__ = ["ModernBertEncoder", "MODERNBERT_PATHS"]

MODERNBERT_PATHS = ("packed", "packed_bf16")


class _Stack(nn.Module):
    """The layers and the final norm: what runs in the compute dtype (fp32, or a bf16 copy)."""

    def __init__(self, layers: nn.ModuleList, final_norm: nn.LayerNorm):
        super().__init__()
        self.layers, self.final_norm = layers, final_norm


class ModernBertEncoder(SentenceEncoder, nn.Module):
    """ModernBERT (embeddings, pre-LN layers with RoPE and GeGLU, final norm) on packed tokens, plus encode().

    Parameter names are transformers' ModernBertModel's (``embeddings.tok_embeddings.weight``,
    ``layers.3.attn.Wqkv.weight``, ``final_norm.weight``, ...). Inference only: no dropout, and
    forward runs under whatever grad mode the caller set (encode runs in inference mode).
    encode / tokenize: btlib.pretrained.encoding.SentenceEncoder's; texts may also be token id lists (``_prepare``).
    """

    PATHS = MODERNBERT_PATHS
    PRECISIONS = PRECISIONS
    WHO = "ModernBERT"

    def __init__(self, spec: ModernBertSpec, tokenizer, max_length: int, pooling: Pooling):
        super().__init__()
        self.spec, self.tokenizer, self.max_length, self.pooling = spec, tokenizer, max_length, pooling
        self.set_prompts(None, None)  # load_pretrained sets the folder's sentence-transformers prompts
        self.embeddings = ModernBertEmbeddings(spec)
        self.layers = nn.ModuleList(ModernBertLayer(spec, i) for i in range(spec.num_layers))
        self.final_norm = _norm(spec)
        self._copies: dict[torch.dtype, _Stack] = {}  # bf16 copies, made on first use: clear after changing weights
        self.eval()

    @classmethod
    def from_config(cls, config: dict, tokenizer=None, *, max_length: int | None = None,
                    pooling: Pooling = Pooling("mean", False)) -> "ModernBertEncoder":
        """A randomly initialised model from config.json's fields (a dict), e.g. to benchmark a shape without weights.

        Fields are checked as for a folder (CheckpointError naming what btlib cannot reproduce).
        transformers' ModernBertModel(config).state_dict() loads into it directly: the names are the same.
        tokenizer (a tokenizers.Tokenizer) is needed only by tokenize / encode.
        """
        spec = spec_from_config({"model_type": "modernbert", **config}, "config")
        return cls(spec, tokenizer, max_length or spec.max_positions, pooling)

    # -- tokens (SentenceEncoder.tokenize; token id lists taken as they are) ----------------
    def pack(self, texts: Sequence[str] | Sequence[Sequence[int]]) -> tuple[Tensor, Tensor, int]:
        """Texts (or token id lists) -> ids (total,) int64, cu_seqlens (B + 1,) int32, max_seqlen int.

        lengths [2, 4, 3] -> cu_seqlens [0, 2, 6, 9], max_seqlen 4, total 9. An empty text still has its
        special tokens; an empty id list is a sequence of length 0 (no hidden states; encode refuses it).
        Id lists are taken as they are (no special tokens added, no truncation) and checked: every id
        an int in [0, vocab_size) (TypeError for bytes, str or floats, ValueError out of range).
        """
        tokens = pack_ids(self._sequences(texts, empty_ok=True))
        return tokens.ids, tokens.cu_seqlens, tokens.max_seqlen

    def _sequences(self, texts: Sequence[str] | Sequence[Sequence[int]], *, empty_ok: bool) -> list[list[int]]:
        """All strings -> tokenize(); otherwise every item must be a sequence of token ids (checked, see pack)."""
        if isinstance(texts, (str, bytes)):
            raise TypeError("pass a list of texts (or of token id lists); wrap a single text in a list")
        texts = list(texts)
        if all(isinstance(t, str) for t in texts):
            for i, t in enumerate(texts):
                check_text(t, f"texts[{i}]")
            return self.tokenize(texts)
        vocab, out = self.spec.vocab_size, []
        for i, seq in enumerate(texts):
            if isinstance(seq, Tensor) or type(seq).__module__ == "numpy":
                seq = seq.tolist() if getattr(seq, "ndim", 1) == 1 else seq  # a 1-D integer tensor or array
            if not isinstance(seq, (list, tuple, range)):
                raise TypeError(f"texts[{i}] is a {type(seq).__name__}: pass all texts as str, or all as lists of "
                                "int token ids (bytes are not token ids: decode them to str)")
            ids = []
            for t in seq:
                if isinstance(t, bool) or not hasattr(t, "__index__"):
                    raise TypeError(f"texts[{i}] holds {t!r} ({type(t).__name__}); token ids are ints")
                ids.append(t.__index__())
            if not ids and not empty_ok:
                raise ValueError(f"texts[{i}] is an empty list of token ids: a sequence of no tokens has no embedding "
                                 "(transformers would pool only padding); pass at least the special tokens, as "
                                 "model.tokenize(['']) gives them")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"texts[{i}] holds token id {bad[0]}, outside [0, vocab_size={vocab})")
            out.append(ids)
        return out

    def _check_path(self, path: str) -> None:
        if path not in MODERNBERT_PATHS:
            raise ValueError(f"path must be one of {MODERNBERT_PATHS} for ModernBERT (rotary, GeGLU, windowed layers have "
                             f"no nn.TransformerEncoder twin for PyTorch's fastpath); got {path!r}")

    def _check_texts(self, texts: Sequence) -> None:
        """Strings or token id lists: checked in :meth:`_prepare`, once the prompt is known."""

    def _prepare(self, texts: Sequence, prompt: str | None) -> list[str] | list[list[int]]:
        """Every text checked (then tokenized a batch at a time, prompt first) or every token id list checked, before
        the first forward."""
        if not isinstance(texts, (str, bytes)) and all(isinstance(t, str) for t in texts):
            check_texts(texts)
            return list(texts)
        if prompt:
            raise ValueError(f"texts are token ids, so the prompt {prompt!r} cannot be put before them: tokenize "
                             "prompt + text yourself and pass prompt=''")
        return self._sequences(texts, empty_ok=False)

    def _tokens(self, items: list[str] | list[list[int]], prompt: str | None) -> Tokens:
        """Texts tokenized as every family's; token id lists (checked by :meth:`_prepare`) as they are, no types."""
        if all(isinstance(t, str) for t in items):
            return super()._tokens(items, prompt)
        return Tokens(items, None, None, [False] * len(items))

    # -- forward -----------------------------------------------------------------------------
    def _stack(self, dtype: torch.dtype) -> _Stack:
        """The layers in ``dtype``: fp32 shares this module's weights; another dtype is a converted copy, cached."""
        if dtype == self.final_norm.weight.dtype:
            return _Stack(self.layers, self.final_norm)
        if dtype not in self._copies:
            self._copies[dtype] = copy.deepcopy(_Stack(self.layers, self.final_norm)).to(dtype)
        return self._copies[dtype]

    def forward(self, ids: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, precision: str | None = None) -> Tensor:
        """Last hidden states of packed tokens, as transformers' ModernBertModel gives them for the real tokens.

        ids: (total,) int64 token ids, sequence after sequence; cu_seqlens: (B + 1,) int32 on ids' device;
        max_seqlen: >= the longest sequence. precision: None / "fp32" (default), "bf16" or "auto"
        (btlib.choose_precision: bf16 only where native and measured faster; bf16 runs a cached bf16
        copy of the layers). Returns (total, d) float32.
        """
        if ids.dim() != 1 or ids.dtype.is_floating_point:
            raise ValueError(f"ids must be (total,) integer token ids; got {tuple(ids.shape)} {ids.dtype}")
        check_cu_seqlens(cu_seqlens, total=ids.numel(), max_seqlen=max_seqlen)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size):
            raise ValueError(f"ids must be token ids in [0, vocab_size={self.spec.vocab_size}); "
                             f"got {int(ids.min())} .. {int(ids.max())}")
        precision = check_precision(precision, PRECISIONS, who="ModernBERT")
        return self._forward_packed(PackedTokens(ids, None, cu_seqlens, int(max_seqlen)), self.runner(precision))

    def _layers_in(self, precision: str):
        """The layers in ``precision``'s dtype (fp32: this module's own; bf16: a converted copy, cached)."""
        return self._stack(resolve_dtype(precision))

    def _forward_packed(self, tokens: PackedTokens, runner: Runner) -> Tensor:
        """(total, d) float32 last hidden states, computed in ``dtype``. ModernBERT has no token types and no
        int8 twin ("int8" is not in its PRECISIONS): tokens.types is None; runner.layers is the stack in runner.dtype."""
        ids, cu_seqlens, max_seqlen = tokens.ids, tokens.cu_seqlens, tokens.max_seqlen
        positions = packed_positions(cu_seqlens, ids.numel())  # (total,): 0, 1, ... restarting per sequence
        tables = {theta: rope_tables(positions, self.spec.head_dim, theta)
                  for theta in {self.spec.rope_theta(i) for i in range(self.spec.num_layers)}}
        stack, dtype = runner.layers, runner.dtype
        x = self.embeddings(ids).to(dtype)  # (total, d)
        kernel = self._kernel(stack, x)  # one attention kernel for every layer (inputs checked once, in forward)
        with gemm.planned(dtype, x.shape[0]):  # every linear of the stack has M = total tokens: one GEMM path for all
            for i, layer in enumerate(stack.layers):
                x = layer(x, tables[self.spec.rope_theta(i)], cu_seqlens, max_seqlen, kernel)
        return stack.final_norm(x).float()

    def _kernel(self, stack: nn.Module, x: Tensor) -> Kernel:
        """The varlen kernel for every layer's (total, H, Dh) q, k, v in x's dtype and device: one that takes the
        local layers' window where there are any (it runs the global layers with no window). Selected once per
        (dtype, device, grad) and kept, as PackedEncoder does, not once per layer per forward."""
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in stack.parameters()))
        key = (x.dtype, x.device, needs_grad)
        cache = self.__dict__.setdefault("_kernels", {})
        if key not in cache:
            window = next((layer.window for layer in stack.layers if layer.window is not None), None)
            cache[key] = registry.get(_select_varlen(x.dtype, x.device, self.spec.nhead, self.spec.head_dim, needs_grad,
                                                     "auto", window))
        return cache[key]
