"""ModernBERT checkpoints: config.json -> :class:`ModernBertSpec`, and model.safetensors checked against it.

Read with json and the ``safetensors`` package only (no transformers), and checked against
transformers 5.23's ModernBertConfig / modeling_modernbert.py, which is the reference. Both field
forms are read: the published one (answerdotai/ModernBERT-base and -large, written by transformers
4.4x: ``global_attn_every_n_layers``, ``global_rope_theta``, ``local_rope_theta``) and the one
transformers 5 writes (``layer_types``, ``rope_parameters`` per layer type); where both are
present the newer wins, as in transformers.

config.json fields that change a ModernBERT's hidden states. btlib honours a field, refuses it by
name (CheckpointError), or it cannot matter for inference. A field btlib does not know is ignored:
the table is the list.

    field                                      btlib
    hidden_size, num_hidden_layers,            honoured; every tensor's shape is checked against them
      num_attention_heads, intermediate_size,
      vocab_size
    hidden_activation                          honoured: gelu (exact), gelu_new, gelu_pytorch_tanh,
                                               gelu_fast (tanh GELU), relu, silu, swish; others refused
    norm_eps                                   honoured (default 1e-5; a finite positive number); layer_norm_eps,
                                               which some files also carry, is read by neither transformers nor btlib
    norm_bias, attention_bias, mlp_bias        honoured; a bias tensor the config rules out is refused,
                                               not dropped as transformers would drop it
    layer_types                                honoured: "full_attention" (global) or "sliding_attention"
                                               (local) per layer ("attention" = full, as transformers reads it)
    global_attn_every_n_layers                 when layer_types is absent: layer i is global iff i % n == 0
                                               (default 3)
    local_attention                            honoured: local layers see keys with |i - j| <= local_attention // 2
    sliding_window                             honoured as transformers' setter reads it: local_attention = 2 * sliding_window
                                               (it overrides local_attention); refused unless a non-negative integer
    rope_parameters.{full,sliding}_attention   honoured: rope_type "default" with rope_theta; any other
                                               rope_type (linear, dynamic, yarn, ...) is refused
    global_rope_theta, local_rope_theta        honoured where rope_parameters gives no rope_theta
                                               (defaults 160000 and 10000)
    rope_scaling                               the older form, merged into both layer types' rope_parameters as
                                               transformers merges it: its rope_theta, if given, sets both bases;
                                               refused unless its rope_type / type is absent or "default"
    rope_theta (top level)                     not read by transformers' ModernBERT (the bases above are), nor by btlib
    head_dim                                   refused unless hidden_size / num_attention_heads (transformers
                                               would rotate a different number of dimensions)
    max_position_embeddings                    caps the truncation length (RoPE itself has no table)
    pad_token_id, bos/eos/cls/sep_token_id     cannot matter: packed tokens have no padding; the
                                               tokenizer adds the special tokens
    *dropout* (attention, mlp, embedding,      cannot matter: inference runs without dropout
      classifier), initializer_*
    classifier_*, decoder_bias, sparse_*,      cannot matter for the encoder's hidden states (heads)
      tie_word_embeddings
    position_embedding_type, is_decoder,       not read by transformers' ModernBERT (rotary, bidirectional
      deterministic_flash_attn, reference_compile  always), nor by btlib
    dtype / torch_dtype                        weights read as stored, computed in fp32 (exact upcast)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from .checkpoint import CheckpointError, need_positive_int, read_config

__all__ = ["ModernBertSpec", "read_modernbert_spec", "spec_from_config", "check_modernbert_tensors", "ACTIVATIONS"]

ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "silu", "swish")
_THETA_DEFAULTS = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}  # ModernBertConfig.default_theta
_LAYER_TYPES = {"full_attention": True, "attention": True, "sliding_attention": False}  # name -> global?


@dataclass(frozen=True)
class ModernBertSpec:
    """What btlib needs from a ModernBERT config.json (field names as in transformers where they exist)."""

    num_layers: int
    d_model: int
    nhead: int
    dim_feedforward: int          # intermediate_size: Wi maps d -> 2 * dim_feedforward (GeGLU input | gate)
    activation: str               # hidden_activation, Hugging Face's name
    norm_eps: float
    norm_bias: bool
    attention_bias: bool
    mlp_bias: bool
    vocab_size: int
    max_positions: int
    pad_token_id: int
    global_layers: tuple[bool, ...]   # per layer: True = full attention, False = sliding window
    half_window: int              # local_attention // 2: a local layer's query i sees keys |i - j| <= half_window
    rope_theta_global: float
    rope_theta_local: float

    @property
    def head_dim(self) -> int:
        return self.d_model // self.nhead

    def window(self, layer: int) -> tuple[int, int] | None:
        """The attention window (left, right) of ``layer``, in tokens; None for a global layer."""
        return None if self.global_layers[layer] else (self.half_window, self.half_window)

    def rope_theta(self, layer: int) -> float:
        return self.rope_theta_global if self.global_layers[layer] else self.rope_theta_local


def _is_int(value: object, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_positive_number(value: object) -> bool:
    """A finite number > 0 (JSON's NaN and Infinity, strings, null and booleans are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _layer_kinds(c: dict, n_layers: int, refused: list[str]) -> tuple[bool, ...]:
    types = c.get("layer_types")
    if types is None:
        every = c.get("global_attn_every_n_layers", 3)
        if not _is_int(every, 1):
            refused.append(f"global_attn_every_n_layers={every!r} (must be a positive integer)")
            return ()
        return tuple(i % every == 0 for i in range(n_layers))
    if not isinstance(types, list) or len(types) != n_layers or any(
            not isinstance(t, str) or t not in _LAYER_TYPES for t in types):
        refused.append(f"layer_types={types!r} (btlib needs one of {sorted(_LAYER_TYPES)} for each of the "
                       f"{n_layers} layers)")
        return ()
    return tuple(_LAYER_TYPES[t] for t in types)


def _rope_type(p: dict) -> object:
    return p.get("rope_type", p.get("type", "default"))


def _rope_thetas(c: dict, refused: list[str]) -> dict[str, float]:
    """rope_theta per layer type, resolved as ModernBertConfig.convert_rope_params_to_dict does: per layer type,
    rope_parameters[kind] (absent: default RoPE), updated with the older ``rope_scaling`` dict if given, then
    rope_theta from there, else global_rope_theta / local_rope_theta, else the defaults."""
    scaling = c.get("rope_scaling")
    if scaling is not None and (not isinstance(scaling, dict) or _rope_type(scaling) != "default"
                                or scaling.get("type", "default") != "default"):
        # transformers keeps rope_type "default" when the older form says only type "linear" (it ignores the
        # scaling): refusing is the one answer that cannot be silently wrong
        refused.append(f"rope_scaling={scaling!r} (btlib implements the default RoPE only: rope_type "
                       "'default' or absent)")
        scaling = None
    params = c.get("rope_parameters") or {}
    if not isinstance(params, dict) or set(params) - set(_THETA_DEFAULTS):
        refused.append(f"rope_parameters={params!r} (btlib reads the per-layer-type form: "
                       "{'full_attention': {...}, 'sliding_attention': {...}})")
        return {}
    legacy = {"full_attention": "global_rope_theta", "sliding_attention": "local_rope_theta"}
    thetas = {}
    for kind, default in _THETA_DEFAULTS.items():
        p = params.get(kind) or {}
        if not isinstance(p, dict):
            refused.append(f"rope_parameters.{kind}={p!r} (must be an object such as "
                           "{'rope_type': 'default', 'rope_theta': 10000.0})")
            continue
        p = {**p, **(scaling or {})}
        if _rope_type(p) != "default":
            refused.append(f"rope_parameters.{kind}={p!r} (btlib implements rope_type 'default' only)")
            continue
        theta, field = p.get("rope_theta"), f"rope_parameters.{kind}.rope_theta"
        if "rope_theta" in (scaling or {}):
            field = "rope_scaling.rope_theta"
        elif theta is None:
            theta, field = c.get(legacy[kind], default), legacy[kind]
        if not _is_positive_number(theta):
            refused.append(f"{field}={theta!r} (the RoPE base of the {kind} layers must be a positive number)")
            continue
        thetas[kind] = float(theta)
    return thetas


def _half_window(c: dict, refused: list[str]) -> int:
    """local_attention // 2; a ``sliding_window`` field overrides it (transformers' setter: local_attention = 2 * it)."""
    if "sliding_window" in c:
        half = c["sliding_window"]
        if not _is_int(half, 0):
            refused.append(f"sliding_window={half!r} (the half window: a non-negative integer, or leave it out and "
                           "give local_attention)")
            return 0
        return half
    local = c.get("local_attention", 128)
    if not _is_int(local, 1):
        refused.append(f"local_attention={local!r} (must be a positive integer)")
        return 0
    return local // 2


def spec_from_config(c: dict, where: str = "config.json") -> ModernBertSpec:
    """A ModernBertSpec from config.json's parsed dict; CheckpointError naming ``where`` and the field otherwise.

    Every field btlib reads is checked here, at load, for type and range (the table in the module docstring).
    """
    if c.get("model_type") != "modernbert":
        raise CheckpointError(f"{where}: model_type {c.get('model_type')!r} is not 'modernbert'")

    def need(key: str) -> int:
        return need_positive_int(c, key, where, "modernbert")

    n_layers, d, heads = need("num_hidden_layers"), need("hidden_size"), need("num_attention_heads")
    ff, vocab = need("intermediate_size"), need("vocab_size")
    refused: list[str] = []
    act = c.get("hidden_activation", "gelu")
    if not isinstance(act, str) or act not in ACTIVATIONS:
        refused.append(f"hidden_activation={act!r} (btlib supports {', '.join(ACTIVATIONS)})")
    flags = {}
    for key in ("norm_bias", "attention_bias", "mlp_bias"):
        flags[key] = c.get(key, False)
        if not isinstance(flags[key], bool):
            refused.append(f"{key}={flags[key]!r} (must be true or false)")
    eps = c.get("norm_eps", 1e-5)
    if not _is_positive_number(eps):
        refused.append(f"norm_eps={eps!r} (must be a positive number)")
    if d % heads:
        refused.append(f"hidden_size={d} is not divisible by num_attention_heads={heads}")
    elif c.get("head_dim") is not None and (not _is_int(c["head_dim"], 1) or c["head_dim"] != d // heads):
        refused.append(f"head_dim={c['head_dim']!r} (transformers would rotate that many dimensions of "
                       f"{d // heads}-wide heads; btlib needs head_dim = hidden_size / num_attention_heads)")
    half_window = _half_window(c, refused)
    kinds = _layer_kinds(c, n_layers, refused)
    thetas = _rope_thetas(c, refused)
    max_pos = c.get("max_position_embeddings", 8192)
    if not _is_int(max_pos, 1):
        refused.append(f"max_position_embeddings={max_pos!r} (must be a positive integer)")
    pad = c.get("pad_token_id")
    if pad is not None and not _is_int(pad, 0):
        refused.append(f"pad_token_id={pad!r} (a token id, an integer >= 0, or null)")
    if refused:
        raise CheckpointError(f"{where} describes a model btlib cannot reproduce exactly:\n  " + "\n  ".join(refused)
                              + "\nFix the field if it is wrong, or run the model with transformers instead")
    return ModernBertSpec(n_layers, d, heads, ff, act, float(eps), flags["norm_bias"], flags["attention_bias"],
                          flags["mlp_bias"], vocab, max_pos, -1 if pad is None else pad, kinds, half_window,
                          thetas["full_attention"], thetas["sliding_attention"])


def read_modernbert_spec(folder: Path, config: tuple[dict, Path] | None = None) -> ModernBertSpec:
    """config.json of ``folder`` -> ModernBertSpec (CheckpointError naming the file and field otherwise); config:
    read_config's (dict, path) where the caller read the file already."""
    c, path = read_config(folder) if config is None else config
    return spec_from_config(c, str(path))


def expected_shapes(spec: ModernBertSpec) -> dict[str, tuple[int, ...]]:
    """Every encoder tensor's name (ModernBertModel's, no prefix) -> the shape the spec implies."""
    d, f = spec.d_model, spec.dim_feedforward
    want: dict[str, tuple[int, ...]] = {"embeddings.tok_embeddings.weight": (spec.vocab_size, d)}

    def norm(name: str) -> None:
        want[f"{name}.weight"] = (d,)
        if spec.norm_bias:
            want[f"{name}.bias"] = (d,)

    def linear(name: str, out: int, inp: int, bias: bool) -> None:
        want[f"{name}.weight"] = (out, inp)
        if bias:
            want[f"{name}.bias"] = (out,)

    norm("embeddings.norm")
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        if i > 0:  # layer 0's attn_norm is an Identity: the embeddings' norm precedes it
            norm(p + "attn_norm")
        linear(p + "attn.Wqkv", 3 * d, d, spec.attention_bias)
        linear(p + "attn.Wo", d, d, spec.attention_bias)
        norm(p + "mlp_norm")
        linear(p + "mlp.Wi", 2 * f, d, spec.mlp_bias)
        linear(p + "mlp.Wo", d, f, spec.mlp_bias)
    norm("final_norm")
    return want


def check_modernbert_tensors(sd: dict[str, Tensor], spec: ModernBertSpec) -> str:
    """Check the file's encoder tensors against the spec; return their key prefix ("model." or "").

    ModernBertForMaskedLM (the published checkpoints) stores the encoder under ``model.`` beside
    ``head.*`` and ``decoder.*``; ModernBertModel stores it unprefixed. Raises CheckpointError listing
    every missing tensor, wrong shape, and encoder tensor the config does not account for (e.g. a
    bias with attention_bias=false, a layer beyond num_hidden_layers).
    """
    prefix = next((p for p in ("model.", "") if f"{p}embeddings.tok_embeddings.weight" in sd), None)
    if prefix is None:
        raise CheckpointError("no embeddings.tok_embeddings.weight (with or without the prefix 'model.') in "
                              "model.safetensors: is this a ModernBERT checkpoint?")
    want = {prefix + k: s for k, s in expected_shapes(spec).items()}
    problems = [f"missing {k}" for k in want if k not in sd]
    problems += [f"{k}: shape {tuple(sd[k].shape)}, config implies {s}" for k, s in want.items()
                 if k in sd and tuple(sd[k].shape) != s]
    ours = tuple(prefix + s for s in ("embeddings.", "layers.", "final_norm."))
    problems += [f"{k} is not accounted for by config.json (a layer beyond num_hidden_layers, or a bias "
                 "that norm_bias / attention_bias / mlp_bias rules out)" for k in sd if k.startswith(ours) and k not in want]
    if problems:
        raise CheckpointError("model.safetensors does not match config.json:\n  " + "\n  ".join(problems[:20])
                              + ("\n  ..." if len(problems) > 20 else ""))
    return prefix
