"""NomicBERT and GTE checkpoints: config.json -> :class:`RotaryBertSpec`, and model.safetensors' names for its tensors.

Both are post-LN BERTs with rotary positions and a gated (GLU) feed-forward, no position table:

    NomicBERT   nomic-ai/nomic-embed-text-v1 / v1.5 (Nussbaum et al. 2024, arXiv:2402.01613): no biases, SwiGLU
    GTE         Alibaba-NLP/gte-*-en-v1.5, gte-multilingual-base, snowflake-arctic-embed-m-v2.0 (Zhang et al. 2024,
                arXiv:2407.19669): biases on q, k, v, o and the feed-forward's output, GeGLU, NTK-scaled RoPE

Each is read in two forms: the published one (the Hub folders' remote code; model_type "nomic_bert" with GPT-2
field names, or "new") and the one transformers 5.23 writes (NomicBertConfig, GteConfig: model_type "nomic_bert"
with BERT field names, or "gte" with ``rope_parameters``). A "gte" config without ``rope_parameters`` carries the
remote code's fields (rope_theta, rope_scaling, ...: snowflake-arctic-embed-m-v2.0 names its remote-code config
"gte") and is read as "new". The reference for every field below is transformers 5.23's NomicBertModel /
GteModel (their conversion_mapping.py names the published tensors) and, for what transformers does not read (the
GPT-2 names, NTK scaling), the remote code as vLLM's bert_with_rope.py and NTKScalingRotaryEmbedding reproduce it.
A field btlib does not know is ignored: the tables are the list.

NomicBERT, published form (the GPT-2 names; present when config.json has ``n_embd``)

    n_embd, n_layer, n_head, n_inner, vocab_size   honoured, all required (the GPT-2 defaults are not Nomic's)
    activation_function                        "swiglu" (silu(gate) * up) honoured; others refused
    rotary_emb_base                            the RoPE base (required: v1 and v1.5 folders both give it)
    rotary_emb_fraction, _interleaved,         must be 1.0, false, null, null (partial, interleaved, xPos and
      _scale_base, rotary_scaling_factor         dynamic-NTK rotary are refused by name)
    prenorm, use_rms_norm, parallel_block,     must be false (absent: false); causal true is a decoder
      causal
    qkv_proj_bias, mlp_fc1_bias, mlp_fc2_bias  must be false (the published models have none; absent: the
                                               remote config's default, true, so refused)
    layer_norm_epsilon                         honoured (required)
    type_vocab_size                            honoured (default 2)
    pad_vocab_size_multiple                    honoured: the word table has vocab_size rounded up to it
    n_positions                                caps the truncation length (rotary has no table)

NomicBERT, transformers form / GTE (both forms)

    hidden_size, num_hidden_layers,            honoured, required
      num_attention_heads, intermediate_size
    vocab_size                                 honoured (required)
    hidden_act                                 the GLU's activation: gelu (exact), gelu_new / gelu_pytorch_tanh /
                                               gelu_fast (tanh), relu, silu, swish; others refused
    layer_norm_eps                             honoured (default 1e-12, both classes)
    type_vocab_size                            honoured; 0 = no token type table (gte-base-en-v1.5)
    max_position_embeddings                    caps the truncation length
    head_dim                                   refused unless hidden_size / num_attention_heads
    rope_parameters / rope_theta               transformers form: rope_type "default" only, its rope_theta
                                               (defaults: NomicBERT 1000, GTE 160000)
    rope_theta, rope_scaling (the remote form) rope_theta required; rope_scaling null, or {"type": "ntk", "factor": f}:
                                               fixed NTK scaling as the remote code's NTKScalingRotaryEmbedding
                                               (base theta * f, inverse frequencies / f^(2 / Dh), whenever f > 1);
                                               mixed_b (mixed NTK) and other types refused
    layer_norm_type, position_embedding_type   remote form: must be "layer_norm" and "rope" (required)
    logn_attention_scale, pack_qkv             remote form: must be false / true (absent: the same)
    unpad_inputs, use_memory_efficient_...,    cannot matter: how the remote code runs, not what it computes
      *dropout*, initializer_range, pad/bos/eos
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .checkpoint import CheckpointError, need_positive_int
from .modernbert_config import ACTIVATIONS, _is_int, _is_positive_number

__all__ = ["RotaryBertSpec", "spec_from_config", "tensor_plan", "MODEL_TYPES"]

MODEL_TYPES = ("nomic_bert", "new", "gte")
_ROPE_DEFAULTS = {"nomic_bert": 1000.0, "gte": 160_000.0}  # NomicBertConfig.default_theta, GteConfig.default_theta


@dataclass(frozen=True)
class RotaryBertSpec:
    """What btlib needs from a NomicBERT or GTE config.json."""

    family: str                   # "nomic_bert" or "gte" (model_type "new" and "gte")
    num_layers: int
    d_model: int
    nhead: int
    dim_feedforward: int          # the GLU's width f: gate and up are (f, d) each
    activation: str               # Hugging Face's name of the gate's activation
    norm_eps: float
    vocab_rows: int               # rows of the word table (vocab_size, rounded up to pad_vocab_size_multiple)
    type_vocab_size: int          # 0: no token type table
    max_positions: int
    rope_theta: float
    ntk_factor: float             # 1.0: plain RoPE; f > 1: base theta * f and inverse frequencies / f^(2 / Dh)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.nhead

    @property
    def biases(self) -> bool:
        """GTE has biases on q, k, v, o and the feed-forward's output (never on gate and up); NomicBERT none."""
        return self.family == "gte"

    @property
    def vocab_size(self) -> int:
        return self.vocab_rows

    @property
    def rope(self) -> tuple[float, float]:
        """(base, divisor of the inverse frequencies) as the remote code's NTKScalingRotaryEmbedding sets them."""
        if self.ntk_factor > 1:
            return self.rope_theta * self.ntk_factor, self.ntk_factor ** (2 / self.head_dim)
        return self.rope_theta, 1.0


def _flag(c: dict, key: str, want: bool, default: bool, refused: list[str], why: str) -> None:
    value = c.get(key, default)
    if value is not want:
        refused.append(f"{key}={value!r}{' (absent)' if key not in c else ''} ({why}; btlib needs {str(want).lower()})")


def _nomic_published(c: dict, where: str, refused: list[str]) -> dict:
    def need(key: str) -> int:
        return need_positive_int(c, key, where, "NomicBERT (GPT-2 field names)")

    out = dict(num_layers=need("n_layer"), d_model=need("n_embd"), nhead=need("n_head"), dim_feedforward=need("n_inner"))
    vocab = need("vocab_size")
    multiple = c.get("pad_vocab_size_multiple", 1)
    if not _is_int(multiple, 1):
        refused.append(f"pad_vocab_size_multiple={multiple!r} (must be a positive integer)")
        multiple = 1
    out["vocab_rows"] = -(-vocab // multiple) * multiple
    act = c.get("activation_function")
    if act != "swiglu":
        refused.append(f"activation_function={act!r} (btlib implements the published models' 'swiglu')")
    out["activation"] = "silu"
    for key, want in (("rotary_emb_fraction", 1.0), ("rotary_emb_interleaved", False), ("rotary_emb_scale_base", None),
                      ("rotary_scaling_factor", None)):
        if c.get(key, want) != want or (want is False and c.get(key, False) is not False):
            refused.append(f"{key}={c.get(key)!r} (btlib implements full, non-interleaved rotary without xPos or "
                           f"the remote code's dynamic NTK scaling past max_trained_positions: {want!r})")
    for key in ("prenorm", "use_rms_norm", "parallel_block", "causal"):
        _flag(c, key, False, False, refused, "the published encoders are post-LN, LayerNorm, sequential, bidirectional")
    for key in ("qkv_proj_bias", "mlp_fc1_bias", "mlp_fc2_bias"):
        _flag(c, key, False, True, refused, "NomicBERT's published linears have no bias; the remote config's default is "
                                            "true")
    theta, eps = c.get("rotary_emb_base"), c.get("layer_norm_epsilon")
    if not _is_positive_number(theta):
        refused.append(f"rotary_emb_base={theta!r} (the RoPE base, a positive number, must be given)")
    if not _is_positive_number(eps):
        refused.append(f"layer_norm_epsilon={eps!r} (a positive number, must be given)")
    out.update(rope_theta=theta, norm_eps=eps, type_vocab_size=c.get("type_vocab_size", 2),
               max_positions=c.get("n_positions", 2048), ntk_factor=1.0)
    return out


def _rope_native(c: dict, family: str, refused: list[str]) -> float:
    """rope_theta as transformers 5.23 resolves it: rope_parameters (rope_type "default"), else a top-level
    rope_theta, else the class default; rope_scaling, the older form, must not ask for a scaled RoPE."""
    params = c.get("rope_parameters") or {}
    legacy = c.get("rope_scaling")
    if not isinstance(params, dict):
        refused.append(f"rope_parameters={params!r} (an object such as {{'rope_type': 'default', 'rope_theta': 1000.0}})")
        return 0.0
    for name, p in (("rope_parameters", params), ("rope_scaling", legacy or {})):
        if not isinstance(p, dict) or p.get("rope_type", p.get("type", "default")) != "default":
            refused.append(f"{name}={p!r} (btlib implements rope_type 'default' in transformers' form; the remote "
                           "code's 'ntk' is read from a GTE config without rope_parameters)")
    theta = params.get("rope_theta", c.get("rope_theta", _ROPE_DEFAULTS[family]))
    if not _is_positive_number(theta):
        refused.append(f"rope_theta={theta!r} (the RoPE base must be a positive number)")
    return theta


def _gte_published_rope(c: dict, refused: list[str]) -> tuple[object, float]:
    theta, scaling, factor = c.get("rope_theta"), c.get("rope_scaling"), 1.0
    if not _is_positive_number(theta):
        refused.append(f"rope_theta={theta!r} (the RoPE base, a positive number, must be given)")
    if scaling is not None:
        kind = scaling.get("type", scaling.get("rope_type")) if isinstance(scaling, dict) else None
        factor = scaling.get("factor") if isinstance(scaling, dict) else None
        if kind != "ntk" or not _is_positive_number(factor) or scaling.get("mixed_b") is not None:
            refused.append(f"rope_scaling={scaling!r} (btlib implements the remote code's fixed NTK scaling: "
                           "{'type': 'ntk', 'factor': f > 0}, without mixed_b)")
            factor = 1.0
    for key, want in (("layer_norm_type", "layer_norm"), ("position_embedding_type", "rope")):
        if c.get(key) != want:
            refused.append(f"{key}={c.get(key)!r} (btlib implements {want!r}; it must be given)")
    _flag(c, "logn_attention_scale", False, False, refused, "log-n attention scaling is not implemented")
    _flag(c, "pack_qkv", True, True, refused, "btlib reads the packed qkv_proj")
    return theta, float(factor)


def spec_from_config(c: dict, where: str = "config.json") -> RotaryBertSpec:
    """A RotaryBertSpec from config.json's parsed dict; CheckpointError naming ``where`` and every field btlib refuses."""
    model_type = c.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"{where}: model_type {model_type!r} is not one of {MODEL_TYPES}")
    family = "nomic_bert" if model_type == "nomic_bert" else "gte"
    refused: list[str] = []
    if family == "nomic_bert" and "n_embd" in c:
        f = _nomic_published(c, where, refused)
    else:
        def need(key: str) -> int:
            return need_positive_int(c, key, where, model_type)

        f = dict(num_layers=need("num_hidden_layers"), d_model=need("hidden_size"), nhead=need("num_attention_heads"),
                 dim_feedforward=need("intermediate_size"), vocab_rows=need("vocab_size"),
                 activation=c.get("hidden_act", "silu" if family == "nomic_bert" else "gelu"),
                 norm_eps=c.get("layer_norm_eps", 1e-12),
                 type_vocab_size=c.get("type_vocab_size", 2 if family == "nomic_bert" else 1),
                 max_positions=c.get("max_position_embeddings", 2048 if family == "nomic_bert" else 8192))
        if not isinstance(f["activation"], str) or f["activation"] not in ACTIVATIONS:
            refused.append(f"hidden_act={f['activation']!r} (btlib supports {', '.join(ACTIVATIONS)})")
        if not _is_positive_number(f["norm_eps"]):
            refused.append(f"layer_norm_eps={f['norm_eps']!r} (must be a positive number)")
        if family == "gte" and "rope_parameters" not in c:  # "new", or "gte" with the remote code's fields
            f["rope_theta"], f["ntk_factor"] = _gte_published_rope(c, refused)
        else:
            f["rope_theta"], f["ntk_factor"] = _rope_native(c, family, refused), 1.0
        head_dim = c.get("head_dim")
        if head_dim is not None and (f["d_model"] % f["nhead"] or head_dim != f["d_model"] // f["nhead"]):
            refused.append(f"head_dim={head_dim!r} (btlib needs head_dim = hidden_size / num_attention_heads)")
    if f["d_model"] % f["nhead"] or (f["d_model"] // f["nhead"]) % 2:
        refused.append(f"hidden size {f['d_model']} / {f['nhead']} heads is not an even integer head size (RoPE "
                       "rotates pairs of dimensions)")
    if not _is_int(f["type_vocab_size"], 0):
        refused.append(f"type_vocab_size={f['type_vocab_size']!r} (must be an integer >= 0)")
    if not _is_int(f["max_positions"], 1):
        refused.append(f"max positions {f['max_positions']!r} (n_positions / max_position_embeddings must be a "
                       "positive integer)")
    if refused:
        raise CheckpointError(f"{where} describes a model btlib cannot reproduce exactly:\n  " + "\n  ".join(refused)
                              + "\nFix the field if it is wrong, or run the model with its own code instead")
    return RotaryBertSpec(family=family, num_layers=f["num_layers"], d_model=f["d_model"], nhead=f["nhead"],
                          dim_feedforward=f["dim_feedforward"], activation=f["activation"], norm_eps=float(f["norm_eps"]),
                          vocab_rows=f["vocab_rows"], type_vocab_size=f["type_vocab_size"],
                          max_positions=f["max_positions"], rope_theta=float(f["rope_theta"]),
                          ntk_factor=f["ntk_factor"])


# The file's names per layout. Each of our parameters is the concatenation, along dim 0, of (file key, rows) pieces:
# rows None = the whole tensor. The GLU's Wi is gate | up (btlib activates the first half, as ModernBERT's Wi).
_LAYOUTS = {
    "nomic": dict(norm="emb_ln", layer="encoder.layers.{i}.", qkv=("attn.Wqkv",), o="attn.out_proj",
                  gate_up=(("mlp.fc12", None), ("mlp.fc11", None)), down="mlp.fc2", n1="norm1", n2="norm2"),
    "new": dict(norm="embeddings.LayerNorm", layer="encoder.layer.{i}.", qkv=("attention.qkv_proj",),
                o="attention.o_proj", gate_up=(("mlp.up_gate_proj", "second"), ("mlp.up_gate_proj", "first")),
                down="mlp.down_proj", n1="attn_ln", n2="mlp_ln"),
    "transformers": dict(norm="embeddings.LayerNorm", layer="layers.{i}.",
                         qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), o="self_attn.o_proj",
                         gate_up=(("mlp.gate_proj", None), ("mlp.up_proj", None)), down="mlp.down_proj",
                         n1="post_attention_layernorm", n2="post_mlp_layernorm"),
}
_PREFIXES = ("", "model.", "bert.", "nomic_bert.", "new.", "gte.")
Piece = tuple[str, "slice | None"]
_BUFFERS = ("inv_freq", "position_ids", "cos_cached", "sin_cached")  # remote-code buffers some files carry: kept aside


def _layout(sd: dict[str, Tensor], spec: RotaryBertSpec) -> tuple[str, str]:
    """(prefix, layout name) of the file's encoder tensors; CheckpointError if none fits the family."""
    prefix = next((p for p in _PREFIXES if f"{p}embeddings.word_embeddings.weight" in sd), None)
    if prefix is None:
        raise CheckpointError("no embeddings.word_embeddings.weight (with or without a prefix such as 'model.') in "
                              "model.safetensors: is this a NomicBERT / GTE checkpoint?")
    allowed = ("nomic", "transformers") if spec.family == "nomic_bert" else ("new", "transformers")
    for name in allowed:
        first = _LAYOUTS[name]["layer"].format(i=0) + _LAYOUTS[name]["qkv"][0] + ".weight"
        if prefix + first in sd:
            return prefix, name
    raise CheckpointError(f"model.safetensors has neither layout btlib reads for {spec.family}: no "
                          + " or ".join(prefix + _LAYOUTS[n]["layer"].format(i=0) + _LAYOUTS[n]["qkv"][0] + ".weight"
                                        for n in allowed))


def tensor_plan(sd: dict[str, Tensor], spec: RotaryBertSpec) -> dict[str, list[Piece]]:
    """Our parameter name -> the file's (key, rows) pieces it concatenates, checked: every piece present with the
    shape the spec implies, and no encoder tensor of the file left unexplained. CheckpointError listing problems."""
    prefix, name = _layout(sd, spec)
    L, d, f = _LAYOUTS[name], spec.d_model, spec.dim_feedforward
    plan: dict[str, list[Piece]] = {}
    want: dict[str, tuple[int, ...]] = {}

    def put(ours: str, keys: tuple, shape: tuple[int, ...], rows: int) -> None:
        pieces = []
        for k in keys:
            key, half = k if isinstance(k, tuple) else (k, None)
            want[prefix + key] = shape if half is None else (2 * rows,) + shape[1:]
            pieces.append((prefix + key, None if half is None else slice(0, rows) if half == "first" else slice(rows, 2 * rows)))
        plan[ours] = pieces

    def linear(ours: str, keys: tuple, out: int, inp: int, bias: bool) -> None:
        rows = out // len(keys)
        put(f"{ours}.weight", tuple((k[0] + ".weight", k[1]) if isinstance(k, tuple) else k + ".weight" for k in keys),
            (rows, inp), rows)
        if bias:
            put(f"{ours}.bias", tuple((k[0] + ".bias", k[1]) if isinstance(k, tuple) else k + ".bias" for k in keys),
                (rows,), rows)

    def norm(ours: str, key: str) -> None:
        put(f"{ours}.weight", (key + ".weight",), (d,), d)
        put(f"{ours}.bias", (key + ".bias",), (d,), d)

    put("embeddings.word_embeddings.weight", ("embeddings.word_embeddings.weight",), (spec.vocab_rows, d), 0)
    if spec.type_vocab_size:
        put("embeddings.token_type_embeddings.weight", ("embeddings.token_type_embeddings.weight",),
            (spec.type_vocab_size, d), 0)
    norm("embeddings.norm", L["norm"])
    for i in range(spec.num_layers):
        p = L["layer"].format(i=i)
        linear(f"layers.{i}.Wqkv", tuple(p + k for k in L["qkv"]), 3 * d, d, spec.biases)
        linear(f"layers.{i}.Wo", (p + L["o"],), d, d, spec.biases)
        norm(f"layers.{i}.attn_norm", p + L["n1"])
        gate_up = tuple((p + k, half) for k, half in L["gate_up"])
        put(f"layers.{i}.Wi.weight", tuple((k + ".weight", half) for k, half in gate_up), (f, d), f)
        linear(f"layers.{i}.Wdown", (p + L["down"],), d, f, spec.biases)
        norm(f"layers.{i}.mlp_norm", p + L["n2"])
    problems = [f"missing {k}" for k in want if k not in sd]
    problems += [f"{k}: shape {tuple(sd[k].shape)}, config implies {s}" for k, s in want.items()
                 if k in sd and tuple(sd[k].shape) != s]
    ours = tuple(prefix + s for s in ("embeddings.", L["norm"] + ".", L["layer"].split("{i}")[0]))
    problems += [f"{k} is not accounted for by config.json (a layer beyond the layer count, a bias, or a token type "
                 "table the config rules out)" for k in sd
                 if k.startswith(ours) and k not in want and not k.endswith(_BUFFERS)]
    if problems:
        raise CheckpointError("model.safetensors does not match config.json:\n  " + "\n  ".join(problems[:20])
                              + ("\n  ..." if len(problems) > 20 else ""))
    return plan
