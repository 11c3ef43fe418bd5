"""Hugging Face-format checkpoints (BERT, RoBERTa, XLM-R, DistilBERT, CamemBERT, ELECTRA, MPNet) <-> nn.TransformerEncoder weights.

A folder with ``config.json`` and ``model.safetensors`` is read with the ``safetensors`` package
only (no transformers). Each Hugging Face layer maps onto one nn.TransformerEncoderLayer:

    attention.self.{query,key,value}  -> self_attn.in_proj_{weight,bias}  (concatenated, q|k|v)
    attention.output.dense            -> self_attn.out_proj
    attention.output.LayerNorm        -> norm1          (post-LN: norm1(x + attn(x)))
    intermediate.dense                -> linear1
    output.dense                      -> linear2
    output.LayerNorm                  -> norm2

DistilBERT names the same tensors q_lin/k_lin/v_lin, out_lin, sa_layer_norm, ffn.lin1/lin2 and
output_layer_norm. CamemBERT is RoBERTa's layout under its own model_type. ELECTRA (the discriminator,
ElectraModel) is BERT's layers behind embeddings of width ``embedding_size``, with a linear
``embeddings_project`` (embedding_size -> hidden_size) after their LayerNorm where the two differ.
MPNet (MPNetModel) is RoBERTa's embeddings without token types and BERT's layers under the names
attention.attn.{q,k,v,o}, attention.LayerNorm, intermediate.dense, output.dense, output.LayerNorm, plus one
encoder.relative_attention_bias (buckets, H) that every layer's attention adds (btlib.pretrained.architectures.mpnet;
kept beside the position table as ``embeddings.relative``).
Every tensor of the file is accounted for: mapped, or kept aside untouched (pooler, heads, buffers)
so that :func:`to_hf_state_dict` gives the file back key for key, bit for bit. The whole file is
checked against the config *before* anything is built.

config.json fields that change a model's outputs (transformers 5.23: BertConfig, RobertaConfig,
XLMRobertaConfig, DistilBertConfig, CamembertConfig, ElectraConfig and their PreTrainedConfig base;
older files may also carry ``position_embedding_type``). btlib honours a field, refuses it by name
(CheckpointError), or it cannot matter for inference. A field btlib does not know is ignored: the table is the list.

    field                                          btlib
    hidden_size/dim, num_hidden_layers/n_layers,   honoured; every tensor's shape is checked against them
      num_attention_heads/n_heads, intermediate_size/hidden_dim, vocab_size,
      max_position_embeddings
    hidden_act / activation                        honoured: gelu, relu, gelu_new, gelu_pytorch_tanh,
                                                   gelu_fast (tanh GELU); any other value is refused
    layer_norm_eps                                 honoured: a finite number >= 0, else refused (DistilBERT: fixed
                                                   1e-12, as in transformers)
    embedding_size (ELECTRA)                       honoured: the embedding tables' width (default 128, as
                                                   transformers); embeddings_project maps it to hidden_size
    type_vocab_size                                honoured: >= 1 (0 is refused: transformers cannot run it)
    pad_token_id                                   honoured: an id < vocab_size; padding id, and RoBERTa's positions
                                                   (transformers': cumsum of id != pad, + pad; a literal <pad> in a
                                                   text keeps position pad, as there)
    position_embedding_type                        "absolute" honoured; relative_key(_query) refused
    architectures JinaBert*, auto_map naming       refused, saying why: JinaBERT (jina-embeddings-v2; "alibi"
      jinaai/jina-bert-implementation, or          positions, GLU feed-forward) is remote code with no class in
      model_type "jina_bert"                       transformers 5.23, so nothing here can check a version of it
    is_decoder                                     refused when true (causal self-attention)
    add_cross_attention, is_encoder_decoder        refused when true (a decoder / seq2seq model)
    pruned_heads                                   refused when non-empty (heads of unequal count per layer)
    chunk_size_feed_forward                        cannot matter: the FFN is per token, chunks compute the same
    summary_* (ELECTRA)                            cannot matter: ElectraForMultipleChoice's head, not the encoder's
    sinusoidal_pos_embds (DistilBERT)              cannot matter: sinusoids only initialise the table; the
                                                   file holds the values used
    *dropout* (hidden, attention, classifier, qa,  cannot matter: inference runs without dropout
      seq_classif), initializer_range
    relative_attention_num_buckets (MPNet)         32 honoured (default); any other value refused: transformers 5.23's
                                                   MPNetEncoder buckets offsets into 32 (max_distance 128) whatever the
                                                   table's size, so another size has no reference to check against
    pad_token_id (MPNet)                           cannot matter: transformers 5.23's MPNetEmbeddings counts positions
                                                   from padding_idx 1 + 1 whatever the config says, and btlib does too
    dtype / torch_dtype                            weights read as stored, computed in fp32 (exact upcast)
    use_cache, bos/eos_token_id, tie_word_embeddings, num_labels, id2label, problem_type,
      output_*, return_dict, _attn_implementation  cannot matter for the encoder's hidden states
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

__all__ = ["MODEL_TYPES", "CheckpointSpec", "read_spec", "read_state_dict", "verify_sha256", "layer_keys", "CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded as it is; the message says what to fix."""


@dataclass(frozen=True)
class CheckpointSpec:
    """What btlib needs from config.json, normalised across the supported model types."""

    model_type: str            # one of MODEL_TYPES
    num_layers: int
    d_model: int
    nhead: int
    dim_feedforward: int
    activation: str            # Hugging Face's name: "gelu", "relu", "gelu_new", ...
    layer_norm_eps: float
    vocab_size: int
    max_positions: int
    type_vocab_size: int       # 0 when the model has no token-type embeddings
    pad_token_id: int
    position_offset: int       # RoBERTa counts positions from pad_token_id + 1; BERT from 0
    embedding_size: int = 0    # ELECTRA's embedding width when it differs from d_model (then projected); 0: d_model
    relative_buckets: int = 0  # MPNet: rows of the relative-position table every layer adds; 0: no such table

    @property
    def embedding_dim(self) -> int:
        """Width of the embedding tables and their LayerNorm."""
        return self.embedding_size or self.d_model


MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "distilbert", "camembert", "electra", "mpnet")
ROBERTA_LAYOUT = ("roberta", "xlm-roberta", "camembert")  # positions from pad_token_id + 1, prefix "roberta."
ACTIVATIONS = ("gelu", "relu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # what PretrainedEncoder builds


def _refusals(c: dict, act_key: str) -> list[str]:
    """The config fields (module docstring's table) whose values btlib cannot reproduce exactly."""
    refused = []
    if c.get("position_embedding_type", "absolute") != "absolute":
        refused.append(f"position_embedding_type={c['position_embedding_type']!r} (btlib has absolute position embeddings only)")
    for key, what in (("is_decoder", "causal self-attention"), ("add_cross_attention", "cross-attention to an encoder"),
                      ("is_encoder_decoder", "an encoder-decoder model")):
        if c.get(key):
            refused.append(f"{key}={c[key]!r} ({what}; btlib runs bidirectional encoders)")
    if c.get("pruned_heads"):
        refused.append(f"pruned_heads={c['pruned_heads']!r} (btlib needs the same heads in every layer)")
    act = c.get(act_key, "gelu")
    if act not in ACTIVATIONS:
        refused.append(f"{act_key}={act!r} (btlib supports {', '.join(ACTIVATIONS)})")
    return refused


def read_config(folder: Path) -> tuple[dict, Path]:
    """config.json of ``folder`` as a dict, and its path; CheckpointError when it is missing or not a JSON object."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{folder} has no config.json; point at a Hugging Face model folder")
    try:
        c = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON ({e}); restore the file from the model's source") from None
    if not isinstance(c, dict):
        raise CheckpointError(f"{cfg_path} holds a JSON {type(c).__name__}, not an object of config fields")
    return c, cfg_path


def need_positive_int(c: dict, key: str, where: object, kind: str) -> int:
    """config field ``key``, which a ``kind`` config must give as a positive integer; CheckpointError naming ``where``."""
    if key not in c:
        raise CheckpointError(f"{where} has no {key!r}, which a {kind} config must give; "
                              "restore the file from the model's source")
    if not isinstance(c[key], int) or isinstance(c[key], bool) or c[key] < 1:
        raise CheckpointError(f"{where}: {key} must be a positive integer; got {c[key]!r}")
    return c[key]


def _jina_bert(c: dict) -> str | None:
    """What marks config ``c`` as JinaBERT (jina-embeddings-v2, jina-reranker-v1), or None. Its folders say model_type
    "bert" (or "jina_bert") with position_embedding_type "alibi", architectures JinaBert*, and an auto_map naming
    jinaai/jina-bert-implementation's code."""
    arch = [a for a in c.get("architectures") or [] if isinstance(a, str) and a.startswith("JinaBert")]
    code = [v for v in (c.get("auto_map") or {}).values() if isinstance(v, str) and "jina-bert" in v.lower()]
    if c.get("model_type") == "jina_bert" or arch or code:
        return ", ".join([f"model_type {c.get('model_type')!r}"] + [f"architectures {arch}"] * bool(arch)
                         + [f"auto_map {code}"] * bool(code))
    return None


def read_spec(folder: Path, config: tuple[dict, Path] | None = None) -> CheckpointSpec:
    """Read config.json; raise CheckpointError naming the file and what to fix for an unreadable, incomplete or
    unsupported one (a field whose value btlib cannot reproduce is refused by name: see the module docstring).
    config: :func:`read_config`'s (dict, path), when the caller has read the file already (load_pretrained)."""
    c, cfg_path = read_config(folder) if config is None else config
    kind = c.get("model_type")
    if (jina := _jina_bert(c)) is not None:
        raise CheckpointError(
            f"{cfg_path} is a JinaBERT model ({jina}): its network (ALiBi attention, a GLU feed-forward) is remote "
            "code, not part of transformers 5.23, so btlib has no reference to check a version of its own against and "
            "loads none. Run it with transformers (AutoModel.from_pretrained(folder, trust_remote_code=True)) or "
            "sentence-transformers")
    if kind not in MODEL_TYPES:
        raise CheckpointError(f"model_type {kind!r} is not supported; btlib loads {', '.join(MODEL_TYPES)}, "
                              "modernbert, nomic_bert, new and gte encoders and qwen3 (Qwen3-Embedding) decoders")

    def need(key: str) -> int:
        return need_positive_int(c, key, cfg_path, kind)

    refused = _refusals(c, "activation" if kind == "distilbert" else "hidden_act")
    if refused:
        raise CheckpointError(f"{cfg_path} describes a model btlib cannot reproduce exactly:\n  " + "\n  ".join(refused)
                              + "\nRun it with transformers instead")
    roberta = kind in ROBERTA_LAYOUT
    vocab, max_positions = need("vocab_size"), need("max_position_embeddings")
    pad = c.get("pad_token_id", 1 if roberta else 0)  # transformers' defaults
    if kind == "mpnet":
        pad, roberta = 1, True  # MPNetEmbeddings' padding_idx is 1 whatever pad_token_id says; positions from 2
    if pad is None and not roberta:
        pad = 0  # BERT and DistilBERT use pad_token_id only to fill padding, which attention never sees
    if not isinstance(pad, int) or isinstance(pad, bool) or not 0 <= pad < vocab:
        raise CheckpointError(f"{cfg_path}: pad_token_id must be a token id (an integer in [0, vocab_size={vocab})); "
                              f"got {pad!r}")
    offset = pad + 1 if roberta else 0
    if max_positions <= offset:
        raise CheckpointError(f"{cfg_path}: max_position_embeddings {max_positions} leaves no position for a token: "
                              f"{kind} counts positions from pad_token_id + 1 = {offset}")
    if kind == "distilbert":
        return CheckpointSpec(kind, need("n_layers"), need("dim"), need("n_heads"), need("hidden_dim"), c.get("activation", "gelu"),
                              1e-12, vocab, max_positions, 0, pad, 0)
    eps = c.get("layer_norm_eps", 1e-12)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not math.isfinite(eps) or eps < 0:
        raise CheckpointError(f"{cfg_path}: layer_norm_eps must be a finite number >= 0 (e.g. 1e-12); got {eps!r}")
    if kind == "mpnet":
        buckets = c.get("relative_attention_num_buckets", 32)
        if buckets != 32:
            raise CheckpointError(f"{cfg_path} describes a model btlib cannot reproduce exactly:\n  "
                                  f"relative_attention_num_buckets={buckets!r} (transformers 5.23's MPNetEncoder buckets "
                                  "offsets into 32 whatever the table's size, so only 32 has a reference)\n"
                                  "Run it with transformers instead")
        return CheckpointSpec(kind, need("num_hidden_layers"), need("hidden_size"), need("num_attention_heads"),
                              need("intermediate_size"), c.get("hidden_act", "gelu"), float(eps), vocab, max_positions,
                              0, pad, offset, relative_buckets=buckets)
    # type_vocab_size 0 builds an empty token-type table that transformers 5.23 then indexes (index_select error)
    type_vocab = need_positive_int({"type_vocab_size": 2, **c}, "type_vocab_size", cfg_path, kind)
    d = need("hidden_size")
    e = need_positive_int({"embedding_size": 128, **c}, "embedding_size", cfg_path, kind) if kind == "electra" else d
    return CheckpointSpec(kind, need("num_hidden_layers"), d, need("num_attention_heads"),
                          need("intermediate_size"), c.get("hidden_act", "gelu"), float(eps), vocab, max_positions,
                          type_vocab, pad, offset, 0 if e == d else e)


def verify_sha256(path: Path, expected: str) -> None:
    """Raise CheckpointError if the file's sha256 is not ``expected`` (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != expected.lower():
        raise CheckpointError(f"{path.name}: sha256 {h.hexdigest()} does not match the expected {expected}; "
                              "the file is corrupt or not the checkpoint you meant: download it again")


def read_state_dict(folder: Path) -> dict[str, Tensor]:
    """All tensors of model.safetensors (read with the safetensors package, no transformers)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / "model.safetensors"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no model.safetensors (pytorch_model.bin is not read: it can run code on load)")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}): the file is damaged or incomplete; "
                              "download it again") from None


def _prefix(sd: dict[str, Tensor], spec: CheckpointSpec) -> str:
    base = "roberta." if spec.model_type in ROBERTA_LAYOUT else f"{spec.model_type}."
    for p in ("", base):
        if f"{p}embeddings.word_embeddings.weight" in sd:
            return p
    raise CheckpointError(f"no embeddings.word_embeddings.weight (with or without the prefix {base!r}) in model.safetensors: "
                          f"is this a {spec.model_type} checkpoint?")


def _ln(sd: dict[str, Tensor], name: str) -> tuple[str, str]:
    """LayerNorm keys; very old BERT checkpoints say gamma/beta."""
    return (f"{name}.weight", f"{name}.bias") if f"{name}.weight" in sd else (f"{name}.gamma", f"{name}.beta")


def layer_keys(sd: dict[str, Tensor], spec: CheckpointSpec) -> tuple[dict[str, str], list[dict[str, str]]]:
    """(embedding keys, one dict per layer) mapping btlib's names to the file's keys."""
    p = _prefix(sd, spec)
    if spec.model_type == "distilbert":
        emb = {"word": f"{p}embeddings.word_embeddings.weight", "position": f"{p}embeddings.position_embeddings.weight"}
        emb["norm.weight"], emb["norm.bias"] = _ln(sd, f"{p}embeddings.LayerNorm")
        names = {"q": "attention.q_lin", "k": "attention.k_lin", "v": "attention.v_lin", "out_proj": "attention.out_lin",
                 "norm1": "sa_layer_norm", "linear1": "ffn.lin1", "linear2": "ffn.lin2", "norm2": "output_layer_norm"}
        stem = f"{p}transformer.layer."
    elif spec.model_type == "mpnet":
        emb = {"word": f"{p}embeddings.word_embeddings.weight", "position": f"{p}embeddings.position_embeddings.weight",
               "relative": f"{p}encoder.relative_attention_bias.weight"}
        emb["norm.weight"], emb["norm.bias"] = _ln(sd, f"{p}embeddings.LayerNorm")
        names = {"q": "attention.attn.q", "k": "attention.attn.k", "v": "attention.attn.v", "out_proj": "attention.attn.o",
                 "norm1": "attention.LayerNorm", "linear1": "intermediate.dense", "linear2": "output.dense",
                 "norm2": "output.LayerNorm"}
        stem = f"{p}encoder.layer."
    else:
        emb = {"word": f"{p}embeddings.word_embeddings.weight", "position": f"{p}embeddings.position_embeddings.weight"}
        if spec.type_vocab_size:
            emb["token_type"] = f"{p}embeddings.token_type_embeddings.weight"
        emb["norm.weight"], emb["norm.bias"] = _ln(sd, f"{p}embeddings.LayerNorm")
        if spec.embedding_size:  # ELECTRA: embedding_size -> hidden_size, after the embeddings' LayerNorm
            emb["project.weight"], emb["project.bias"] = f"{p}embeddings_project.weight", f"{p}embeddings_project.bias"
        names = {"q": "attention.self.query", "k": "attention.self.key", "v": "attention.self.value",
                 "out_proj": "attention.output.dense", "norm1": "attention.output.LayerNorm",
                 "linear1": "intermediate.dense", "linear2": "output.dense", "norm2": "output.LayerNorm"}
        stem = f"{p}encoder.layer."
    layers = []
    for i in range(spec.num_layers):
        keys = {}
        for ours, theirs in names.items():
            full = f"{stem}{i}.{theirs}"
            keys[f"{ours}.weight"], keys[f"{ours}.bias"] = _ln(sd, full) if "norm" in ours else (f"{full}.weight", f"{full}.bias")
        layers.append(keys)
    return emb, layers


def check_against_spec(sd: dict[str, Tensor], spec: CheckpointSpec) -> tuple[dict[str, str], list[dict[str, str]]]:
    """Every tensor btlib needs is present with the shape config.json implies; raise listing all problems."""
    emb, layers = layer_keys(sd, spec)
    d, f, e = spec.d_model, spec.dim_feedforward, spec.embedding_dim
    want = {emb["word"]: (spec.vocab_size, e), emb["position"]: (spec.max_positions, e),
            emb["norm.weight"]: (e,), emb["norm.bias"]: (e,)}
    if "token_type" in emb:
        want[emb["token_type"]] = (spec.type_vocab_size, e)
    if "relative" in emb:
        want[emb["relative"]] = (spec.relative_buckets, spec.nhead)
    if "project.weight" in emb:
        want[emb["project.weight"]], want[emb["project.bias"]] = (d, e), (d,)
    for keys in layers:
        for name, key in keys.items():
            want[key] = {"linear1.weight": (f, d), "linear1.bias": (f,), "linear2.weight": (d, f)}.get(
                name, (d, d) if name.endswith("weight") and not name.startswith("norm") else (d,))
    problems = [f"missing {k}" for k in want if k not in sd]
    problems += [f"{k}: shape {tuple(sd[k].shape)}, config implies {s}" for k, s in want.items() if k in sd and tuple(sd[k].shape) != s]
    if d % spec.nhead:
        problems.append(f"hidden size {d} is not divisible by {spec.nhead} heads")
    extra_layer = any(k.startswith(("encoder.layer.", "bert.encoder.layer.", "roberta.encoder.layer.", "transformer.layer.",
                                     "distilbert.transformer.layer.", "electra.encoder.layer.", "mpnet.encoder.layer."))
                      and f".{spec.num_layers}." in k for k in sd)
    if extra_layer:
        problems.append(f"the file has more than the {spec.num_layers} layers config.json declares")
    if problems:
        raise CheckpointError("model.safetensors does not match config.json:\n  " + "\n  ".join(problems[:20])
                              + ("\n  ..." if len(problems) > 20 else ""))
    return emb, layers
