"""SPLADE sparse vectors on the packed path: sentence-transformers' SparseEncoder (MLMTransformer + SpladePooling).

    model = load_sparse("path/to/splade-folder")   # a folder SparseEncoder.save wrote (a BertForMaskedLM inside)
    v = model.encode(texts)                        # (N, vocab) float32 torch.sparse_coo, as SparseEncoder.encode
    v = model.encode(texts, convert_to_sparse_tensor=False)  # (N, vocab) float32 dense
    rows = model.encode_tokens(model.tokens(texts))         # the same, dense: what btlib.serve's batcher runs

The maths, as sentence-transformers 6.2 (modules/splade_pooling.py) and transformers' BertLMPredictionHead:

    h (total, d)        the packed forward's last hidden states (``encode_tokens(output="token_embeddings")``)
    t = LN(act(h W_t^T + b_t))                       cls.predictions.transform: dense, hidden_act, LayerNorm
    logits = t E^T + b  (total, V)                   decoder: E tied to the word embeddings, or its own weight
    w = log1p(relu(logits))                          ("log1p_relu": log1p once more)
    v[b] = max (or sum) of w over sequence b's tokens   (B, V)

Per real token only: packing has no padding, so the attention mask SparseEncoder multiplies in has nothing to
remove. The MLM head runs on at most ``TOKEN_BLOCK`` tokens at a time: a (total, V) logits tensor for a batch of 64
texts of 256 tokens at BERT's V = 30522 would be 2 GB; a block of 1024 is 125 MB, pooled into (B, V) as it goes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..padding import segment_ids, segment_sum
from .architectures.bert import PretrainedEncoder, load_bert
from .folders.checkpoint import CheckpointError, read_config
from .folders.st_folder import FolderPlan
from .st_modules import read_json
from .tokens import Tokens

__all__ = ["SpladeHead", "SparseModel", "load_sparse", "is_sparse_folder", "TOKEN_BLOCK", "SPLADE_POOLING", "SPLADE_ACTIVATIONS"]

TOKEN_BLOCK = 1024  # tokens per MLM-head block: (1024, V) fp32 logits, 125 MB at V = 30522
SPLADE_POOLING = ("max", "sum")
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")
_ACTS = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
# SparseEncoder.encode's options btlib does not run: refused by name, never ignored
_UNSUPPORTED = ("chunk_size", "pool", "device", "task", "show_progress_bar", "save_to_cpu",
                "convert_to_numpy", "convert_to_tensor", "output_value", "normalize_embeddings", "truncate_dim")


class SpladeHead(nn.Module):
    """BERT's MLM head (cls.predictions) then SpladePooling, on packed token states: (total, d) -> (B, V) float32."""

    def __init__(self, dense: nn.Linear, act: str, norm: nn.LayerNorm, decoder_weight: Tensor, decoder_bias: Tensor,
                 pooling: str = "max", activation: str = "relu"):
        super().__init__()
        if pooling not in SPLADE_POOLING or activation not in SPLADE_ACTIVATIONS or act not in _ACTS:
            raise ValueError(f"pooling in {SPLADE_POOLING}, activation in {SPLADE_ACTIVATIONS}, act in {tuple(_ACTS)}; "
                             f"got {pooling!r}, {activation!r}, {act!r}")
        self.dense, self.act, self.norm, self.pooling, self.activation = dense, act, norm, pooling, activation
        self.register_buffer("decoder_weight", decoder_weight)  # (V, d): the word embeddings when tied
        self.register_buffer("decoder_bias", decoder_bias)  # (V,)

    @property
    def vocab_size(self) -> int:
        return self.decoder_weight.shape[0]

    def extra_repr(self) -> str:
        return f"act={self.act}, pooling={self.pooling}, activation={self.activation}, vocab={self.vocab_size}"

    def token_weights(self, h: Tensor) -> Tensor:
        """h (n, d) float32 token states -> (n, V) float32 log1p(relu(MLM logits)) (twice log1p for log1p_relu)."""
        t = self.norm(_ACTS[self.act](self.dense(h)))  # (n, d)
        w = torch.log1p(torch.relu(F.linear(t, self.decoder_weight, self.decoder_bias)))  # (n, V)
        return torch.log1p(w) if self.activation == "log1p_relu" else w

    def forward(self, h: Tensor, cu_seqlens: Tensor) -> Tensor:
        """h (total, d) float32 packed states, cu_seqlens (B + 1,) int32 -> (B, V) float32 pooled per sequence."""
        B, total = cu_seqlens.numel() - 1, h.shape[0]
        seq = segment_ids(cu_seqlens.diff())  # (total,) the sequence of each token
        # max: relu makes every weight >= 0, so 0 is the identity (an empty sequence gives 0, as s-t's masked rows)
        out = h.new_zeros(B, self.vocab_size)
        for a in range(0, total, TOKEN_BLOCK):
            w, s = self.token_weights(h[a:a + TOKEN_BLOCK]), seq[a:a + TOKEN_BLOCK]  # (n, V), (n,)
            if self.pooling == "max":
                out.scatter_reduce_(0, s.view(-1, 1).expand_as(w), w, reduce="amax")
            else:
                out += segment_sum(w, s, B)
        return out


class SparseModel(PretrainedEncoder):
    """A SPLADE model: BERT's packed forward (a :class:`PretrainedEncoder`) and its :class:`SpladeHead` (``splade``).

    Its rows are SPLADE rows: ``encode`` as SparseEncoder.encode; ``encode_tokens(tokens)`` (N, V) float32 dense
    (output "splade", the default: what a server's batcher runs) or output "token_embeddings" (total, d), the states
    the SPLADE head reads. ``head`` (the pooled-row head the base class keeps: mean pooling) is not what this model
    gives: its sentence embedding is the SPLADE row.
    """

    PATHS = ("packed", "packed_bf16")
    OUTPUTS = ("splade", "token_embeddings")
    splade: SpladeHead

    @property
    def vocab_size(self) -> int:
        return self.splade.vocab_size

    def encode_tokens(self, tokens: Tokens, *, batch_size: int = 32, path: str = "packed", precision: str | None = None,
                      output: str = "splade", full_width: bool = False) -> Tensor:
        """Tokens (``self.tokens(texts)``) -> (N, V) float32 dense SPLADE rows (output "splade"), batch_size texts per
        forward; output "token_embeddings": (sum(tokens.lengths()), d) float32, the encoder's :meth:`encode_tokens`."""
        if output == "token_embeddings":
            return super().encode_tokens(tokens, batch_size=batch_size, path=path, precision=precision, output=output)
        if output != "splade":
            raise ValueError(f"output must be one of {self.OUTPUTS} for a SPLADE model; got {output!r}")
        if not isinstance(tokens, Tokens) or tokens.chunks is not None:
            raise ValueError("SPLADE rows take the unchunked Tokens that tokens(texts) gives (long_inputs 'truncate' or "
                             "'refuse')")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer; got {batch_size!r}")
        rows = []
        with torch.inference_mode():
            for i in range(0, len(tokens), batch_size):
                part = tokens[i:i + batch_size]
                h = super().encode_tokens(part, batch_size=batch_size, path=path, precision=precision,
                                          output="token_embeddings")  # (total, d) float32
                lengths = torch.tensor(part.lengths(), dtype=torch.int32)
                cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))  # (B + 1,)
                rows.append(self.splade(h.float(), cu_seqlens))  # (B, V)
        return torch.cat(rows) if rows else torch.zeros(0, self.vocab_size)

    def encode(self, texts: Sequence[str | tuple[str, str]], *, batch_size: int = 32, prompt_name: str | None = None,
               prompt: str | None = None, convert_to_sparse_tensor: bool = True, precision: str | None = None,
               long_inputs: str = "truncate", max_active_dims: int | None = None, **unsupported) -> Tensor:
        """SparseEncoder.encode(texts): (N, V) float32, torch.sparse_coo (default) or dense.

        prompt / prompt_name: the folder's prompts, as SentenceEncoder.encode (every token is pooled, the prompt's
        too, as SpladePooling does). precision: the forward's (None / "fp32", "bf16", "auto", "int8"); the head runs in
        fp32. long_inputs: "truncate" (default, as SparseEncoder) or "refuse". max_active_dims: keep each row's k
        largest weights and zero the rest (sentence-transformers' select_max_active_dims: torch.topk, so ties at the
        k-th weight break as topk breaks them). Any other SparseEncoder.encode option (chunk_size, pool, device, ...)
        is refused by name.
        """
        if unsupported:
            known = [k for k in unsupported if k in _UNSUPPORTED]
            raise ValueError(f"SparseModel.encode does not support {sorted(unsupported)}"
                             + (" (SparseEncoder.encode options btlib does not run; use sentence-transformers)" if known
                                else ""))
        if max_active_dims is not None and (isinstance(max_active_dims, bool) or not isinstance(max_active_dims, int)
                                            or max_active_dims < 1):
            raise ValueError(f"max_active_dims must be a positive integer or None; got {max_active_dims!r}")
        if not isinstance(convert_to_sparse_tensor, bool):
            raise ValueError(f"convert_to_sparse_tensor must be true or false; got {convert_to_sparse_tensor!r}")
        if long_inputs not in ("truncate", "refuse"):
            raise ValueError(f"long_inputs must be 'truncate' or 'refuse' for a sparse model; got {long_inputs!r}")
        rows = self.encode_tokens(self.tokens(texts, prompt_name=prompt_name, prompt=prompt, long_inputs=long_inputs),
                                  batch_size=batch_size, precision=precision)
        if max_active_dims is not None:  # rows are >= 0: the largest weights are the largest |weights|
            top = rows.topk(min(max_active_dims, rows.shape[1]), dim=-1).indices  # (N, k)
            rows = torch.zeros_like(rows).scatter_(-1, top, rows.gather(-1, top))
        return rows.to_sparse() if convert_to_sparse_tensor else rows


def _modules(folder: Path):
    """modules.json of ``folder``, parsed (any JSON value); CheckpointError when it is missing or not JSON."""
    path = folder / "modules.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no modules.json: a SPLADE folder is one SparseEncoder.save writes")
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None


def is_sparse_folder(folder: str | Path) -> bool:
    """Whether ``folder``'s modules.json lists a SpladePooling (a SparseEncoder folder: :func:`load_sparse` reads it)."""
    try:
        entries = _modules(Path(folder))
    except (CheckpointError, OSError):
        return False  # the dense reader names what is wrong with it
    return isinstance(entries, list) and any(isinstance(e, dict) and str(e.get("type", "")).endswith(".SpladePooling")
                                             for e in entries)


def _parse_modules(folder: Path) -> tuple[Path, Path]:
    """modules.json of a SPLADE folder -> (the MLM Transformer's folder, SpladePooling's); anything else refused."""
    path, entries = folder / "modules.json", _modules(folder)
    names = [e.get("type", "").rpartition(".")[2] if isinstance(e, dict) else None for e in entries] \
        if isinstance(entries, list) else None
    if names not in (["MLMTransformer", "SpladePooling"], ["Transformer", "SpladePooling"]) or any(
            not str(e.get("type")).startswith("sentence_transformers.") or e.get("kwargs")
            or not isinstance(e.get("path"), str) or ".." in Path(e["path"]).parts or Path(e["path"]).is_absolute()
            for e in entries):
        raise CheckpointError(f"{path}: btlib's sparse models are MLMTransformer (or a fill-mask Transformer) then "
                              f"SpladePooling, nothing else; got {entries!r}: use sentence-transformers for this model")
    return folder / entries[0]["path"], folder / entries[1]["path"]


def _plan(folder: Path, tdir: Path) -> FolderPlan:
    """The Transformer's settings (sentence_bert_config.json) and the prompts, checked as btlib's dense reader does."""
    path = tdir / "sentence_bert_config.json"
    c = read_json(path, "Transformer config")
    extra = sorted(set(c) - {"max_seq_length", "do_lower_case", "transformer_task", "modality_config",
                             "module_output_name", "model_args", "tokenizer_args", "config_args"})
    if extra or c.get("transformer_task", "fill-mask") != "fill-mask" or c.get("module_output_name", "token_embeddings") \
            != "token_embeddings" or c.get("modality_config", {"text": {"method": "forward", "method_output_name": "logits"}}) \
            != {"text": {"method": "forward", "method_output_name": "logits"}} or any(c.get(k) for k in ("model_args",
                                                                                                      "tokenizer_args", "config_args")):
        raise CheckpointError(f"{path}: btlib runs the MLM logits of a fill-mask Transformer with the folder's own "
                              f"config and tokenizer; this config asks for more ({c}): use sentence-transformers")
    max_len, lower = c.get("max_seq_length"), c.get("do_lower_case", False)
    if max_len is not None and (not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1) \
            or not isinstance(lower, bool):
        raise CheckpointError(f"{path}: max_seq_length must be a positive integer or null and do_lower_case a bool")
    mpath = folder / "config_sentence_transformers.json"
    m = read_json(mpath, "sentence-transformers model config")
    if m.get("model_type", "SparseEncoder") != "SparseEncoder" or m.get("max_active_dims") is not None:
        raise CheckpointError(f"{mpath}: btlib's sparse models are SparseEncoders without max_active_dims; got "
                              f"model_type={m.get('model_type')!r}, max_active_dims={m.get('max_active_dims')!r}")
    prompts, name = m.get("prompts") or {}, m.get("default_prompt_name")
    if not isinstance(prompts, dict) or not all(isinstance(v, (str, type(None))) for v in prompts.values()) \
            or name is not None and name not in {"query": None, "document": None, **prompts}:
        raise CheckpointError(f"{mpath}: prompts must map names to strings and default_prompt_name name one of them")
    return FolderPlan(folder, tdir, [], max_len, lower, prompts, name, None, sentence_transformers=False)


def _pooling(pdir: Path) -> tuple[str, str]:
    path = pdir / "config.json"
    c = read_json(path, "SpladePooling config")
    extra = sorted(set(c) - {"pooling_strategy", "activation_function", "embedding_dimension", "word_embedding_dimension",
                             "chunk_size"})
    pooling, activation = c.get("pooling_strategy", "max"), c.get("activation_function", "relu")
    if extra or pooling not in SPLADE_POOLING or activation not in SPLADE_ACTIVATIONS:
        raise CheckpointError(f"{path}: btlib's SpladePooling takes pooling_strategy {SPLADE_POOLING} and "
                              f"activation_function {SPLADE_ACTIVATIONS}; got {c}")
    return pooling, activation


def load_sparse(folder: str | Path) -> SparseModel:
    """A SparseEncoder folder (MLMTransformer over a BertForMaskedLM + SpladePooling) as a :class:`SparseModel`.

    Only BERT's MLM head (cls.predictions.transform + decoder, tied to the word embeddings or not, as config.json's
    tie_word_embeddings says) is read; another model_type's head, another module or option is refused by name.
    """
    folder = Path(folder)
    tdir, pdir = _parse_modules(folder)
    pooling, activation = _pooling(pdir)
    config = read_config(tdir)
    c, cpath = config
    if c.get("model_type") != "bert":
        raise CheckpointError(f"{cpath}: model_type {c.get('model_type')!r}: btlib's sparse models read BERT's MLM head "
                              "(BertForMaskedLM) only; use sentence-transformers for this model")
    encoder = load_bert(_plan(folder, tdir), config=config, cls=SparseModel)
    sd, d = encoder._hf["unused"], encoder.spec.d_model
    tied = c.get("tie_word_embeddings", True)
    need = ["cls.predictions.transform.dense.weight", "cls.predictions.transform.dense.bias",
            "cls.predictions.transform.LayerNorm.weight", "cls.predictions.transform.LayerNorm.bias"]
    # transformers' _tied_weights_keys: tied, decoder.weight is the word embeddings and decoder.bias cls.predictions.bias;
    # untied, the decoder's own two tensors run (a cls.predictions.bias beside them is not read)
    need += ["cls.predictions.bias"] if tied else ["cls.predictions.decoder.weight", "cls.predictions.decoder.bias"]
    missing = [k for k in need if k not in sd]
    if missing:
        raise CheckpointError(f"{tdir}: the MLM head's tensors {missing} are missing (a BertForMaskedLM checkpoint holds them)")
    act = c.get("hidden_act", "gelu")
    if act not in _ACTS:
        raise CheckpointError(f"{cpath}: hidden_act {act!r} in the MLM head is not one of {tuple(_ACTS)}")
    dense, norm = nn.Linear(d, d), nn.LayerNorm(d, eps=float(c.get("layer_norm_eps", 1e-12)))
    with torch.no_grad():
        for mod, key in ((dense, "dense"), (norm, "LayerNorm")):
            mod.weight.copy_(sd[f"cls.predictions.transform.{key}.weight"])
            mod.bias.copy_(sd[f"cls.predictions.transform.{key}.bias"])
    E = encoder.embeddings.word.weight.detach() if tied else sd["cls.predictions.decoder.weight"]
    bias = sd["cls.predictions.bias" if tied else "cls.predictions.decoder.bias"]
    if E.shape != (c["vocab_size"], d) or bias.shape != (c["vocab_size"],):
        raise CheckpointError(f"{tdir}: decoder {tuple(E.shape)} and bias {tuple(bias.shape)} do not match vocab_size "
                              f"{c['vocab_size']} x hidden_size {d}")
    head = SpladeHead(dense, act, norm, E.float().clone(), bias.float().clone(), pooling, activation)
    encoder.splade = head.eval().requires_grad_(False)
    return encoder
