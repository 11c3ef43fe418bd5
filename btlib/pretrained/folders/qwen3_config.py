"""Qwen3 checkpoints (Qwen3-Embedding's architecture): config.json -> :class:`Qwen3Spec`, and the file's tensor names.

Qwen3 (Qwen team 2025, arXiv:2505.09388; the embedders: Zhang et al. 2025, arXiv:2506.05176) is a decoder: pre-RMSNorm
layers with causal grouped-query attention, RMSNorm on each head's q and k, rotary positions and a SwiGLU MLP. The
reference for every field is transformers 5.23's Qwen3Config / Qwen3Model (models/qwen3), which reads them so:

    hidden_size, num_hidden_layers,            honoured, required
      num_attention_heads, intermediate_size,
      vocab_size
    num_key_value_heads                        honoured (absent: 32, Qwen3Config's default; null: num_attention_heads);
                                               must divide the heads
    head_dim                                   honoured (absent: 128, Qwen3Config's default, not hidden_size / heads);
                                               may differ from hidden / heads (Qwen3-Embedding-0.6B: 1024 / 16 heads,
                                               head_dim 128); even
    hidden_act                                 the SwiGLU gate's activation (default "silu"); others of
                                               modernbert_config.ACTIVATIONS too; any other refused
    rms_norm_eps                               honoured (default 1e-6)
    attention_bias                             honoured (default false): biases on q, k, v and o
    rope_parameters / rope_theta / rope_scaling rope_type "default" only (rotary_bert_config.rope_native, shared with
                                               GTE's transformers form), theta default 10000 (PreTrainedConfig's);
                                               yarn, dynamic, linear, llama3, ... and per-layer-type dicts refused
    use_sliding_window, sliding_window,        a layer is sliding when use_sliding_window and i >= max_window_layers
      max_window_layers, layer_types           (or layer_types says "sliding_attention"), as Qwen3Config computes it;
                                               any sliding layer is refused (btlib runs full causal attention)
    max_position_embeddings                    caps the truncation length (RoPE has no table)
    attention_dropout, initializer_range,      cannot matter for inference
      use_cache, tie_word_embeddings, bos/eos/pad_token_id, dtype / torch_dtype

Tensors: Qwen3Model's names (``embed_tokens``, ``layers.{i}.self_attn.{q,k,v,o}_proj``, ``q_norm``, ``k_norm``,
``input_layernorm``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``, ``norm``), at the root (a folder saved
from Qwen3Model, as Qwen3-Embedding's is) or under ``model.`` (Qwen3ForCausalLM). ``lm_head.weight`` is kept aside.
One model.safetensors only: sharded checkpoints (model-0000x-of-0000n) are not read.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .checkpoint import CheckpointError, need_positive_int
from .modernbert_config import ACTIVATIONS, _is_int, _is_positive_number
from .rotary_bert_config import Piece, rope_native

__all__ = ["Qwen3Spec", "spec_from_config", "tensor_plan", "MODEL_TYPE"]

MODEL_TYPE = "qwen3"
_DEFAULT_THETA = 10_000.0  # PreTrainedConfig.default_theta: Qwen3Config does not override it
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Qwen3Spec:
    """What btlib needs from a Qwen3 config.json."""

    num_layers: int
    d_model: int
    nhead: int                    # query heads H
    nkv: int                      # key / value heads Hkv: each serves H / Hkv query heads (GQA)
    head_dim: int                 # Dh; H * Dh need not be d_model
    dim_feedforward: int          # the SwiGLU's width f: gate and up are (f, d) each
    activation: str
    norm_eps: float
    vocab_size: int
    max_positions: int
    rope_theta: float
    attention_bias: bool

    @property
    def groups(self) -> int:
        """Query heads per key / value head."""
        return self.nhead // self.nkv

    @property
    def rope(self) -> tuple[float, float]:
        """(base, divisor of the inverse frequencies): plain RoPE, as btlib.pretrained.architectures.modernbert_layers
        .rope_tables takes it."""
        return self.rope_theta, 1.0


def _sliding_layers(c: dict, n_layers: int, refused: list[str]) -> None:
    types = c.get("layer_types")
    if types is None:  # Qwen3Config.__post_init__: sliding_window only when use_sliding_window, from max_window_layers
        window = c.get("sliding_window", 4096) if c.get("use_sliding_window", False) else None
        first = c.get("max_window_layers", 28)
        if window is not None and _is_int(first, 0) and first < n_layers:
            refused.append(f"use_sliding_window=true with max_window_layers={first} < num_hidden_layers={n_layers} "
                           f"(layers {first}..{n_layers - 1} would attend within a window of {window}; btlib runs full "
                           "causal attention only)")
        elif window is not None and not _is_int(first, 0):
            refused.append(f"max_window_layers={first!r} (must be an integer >= 0)")
        return
    if not isinstance(types, list) or len(types) != n_layers or any(t not in _LAYER_TYPES for t in types):
        refused.append(f"layer_types={types!r} (one of {_LAYER_TYPES} for each of the {n_layers} layers)")
    elif "sliding_attention" in types:
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
        refused.append(f"layer_types has 'sliding_attention' at layers {sliding} "
                       "(btlib runs full causal attention only)")


def spec_from_config(c: dict, where: str = "config.json") -> Qwen3Spec:
    """A Qwen3Spec from config.json's parsed dict; CheckpointError naming ``where`` and every field btlib refuses."""
    if c.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{where}: model_type {c.get('model_type')!r} is not {MODEL_TYPE!r}")

    def need(key: str) -> int:
        return need_positive_int(c, key, where, "Qwen3")

    n_layers, d, H = need("num_hidden_layers"), need("hidden_size"), need("num_attention_heads")
    f, vocab = need("intermediate_size"), need("vocab_size")
    refused: list[str] = []
    nkv = c.get("num_key_value_heads", 32)  # Qwen3Config's defaults: absent 32, null num_attention_heads
    nkv = H if nkv is None else nkv
    if not _is_int(nkv, 1) or H % nkv:
        refused.append(f"num_key_value_heads={nkv!r}{' (absent: 32)' if 'num_key_value_heads' not in c else ''} (a "
                       f"positive integer dividing num_attention_heads={H})")
        nkv = H
    head_dim = c.get("head_dim", 128)  # Qwen3Config's default when absent, whatever hidden_size / heads is
    if not _is_int(head_dim, 2) or head_dim % 2:
        refused.append(f"head_dim={head_dim!r} (an even integer >= 2: RoPE rotates pairs of dimensions)")
        head_dim = 2
    act = c.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        refused.append(f"hidden_act={act!r} (btlib supports {', '.join(ACTIVATIONS)})")
    eps = c.get("rms_norm_eps", 1e-6)
    if not _is_positive_number(eps):
        refused.append(f"rms_norm_eps={eps!r} (must be a positive number)")
    bias = c.get("attention_bias", False)
    if not isinstance(bias, bool):
        refused.append(f"attention_bias={bias!r} (true or false)")
    params = c.get("rope_parameters")
    if isinstance(params, dict) and set(params) & set(_LAYER_TYPES):
        refused.append(f"rope_parameters={params!r} (one RoPE per layer type: btlib reads one global dict)")
    theta = rope_native(c, _DEFAULT_THETA, refused)
    _sliding_layers(c, n_layers, refused)
    positions = c.get("max_position_embeddings", 32768)
    if not _is_int(positions, 1):
        refused.append(f"max_position_embeddings={positions!r} (a positive integer)")
    if refused:
        raise CheckpointError(f"{where} describes a model btlib cannot reproduce exactly:\n  " + "\n  ".join(refused)
                              + "\nFix the field if it is wrong, or run the model with transformers instead")
    return Qwen3Spec(num_layers=n_layers, d_model=d, nhead=H, nkv=nkv, head_dim=head_dim, dim_feedforward=f,
                     activation=act, norm_eps=float(eps), vocab_size=vocab, max_positions=positions,
                     rope_theta=float(theta), attention_bias=bias)


_PREFIXES = ("", "model.")
_KEPT_ASIDE = ("lm_head.weight",)  # Qwen3ForCausalLM's head: not part of the embedder


def tensor_plan(sd: dict[str, Tensor], spec: Qwen3Spec) -> dict[str, list[Piece]]:
    """Our parameter name -> the file's (key, rows) pieces it concatenates along dim 0 (rows None: the whole tensor),
    checked: every piece present with the shape the spec implies, and no tensor of the file left unexplained but
    ``lm_head.weight``. Wqkv is q | k | v ((H + 2 Hkv) Dh rows), Wi is gate | up (2 f rows). CheckpointError listing
    the problems."""
    prefix = next((p for p in _PREFIXES if f"{p}embed_tokens.weight" in sd), None)
    if prefix is None:
        raise CheckpointError("no embed_tokens.weight (nor model.embed_tokens.weight) in model.safetensors: is this a "
                              "Qwen3 checkpoint?")
    d, f, Dh = spec.d_model, spec.dim_feedforward, spec.head_dim
    q_rows, kv_rows = spec.nhead * Dh, spec.nkv * Dh
    plan: dict[str, list[Piece]] = {}
    want: dict[str, tuple[int, ...]] = {}

    def put(ours: str, pieces: tuple[tuple[str, tuple[int, ...]], ...]) -> None:
        plan[ours] = [(prefix + key, None) for key, _ in pieces]
        want.update((prefix + key, shape) for key, shape in pieces)

    put("embed_tokens.weight", (("embed_tokens.weight", (spec.vocab_size, d)),))
    for i in range(spec.num_layers):
        p = o = f"layers.{i}."  # the file's layer prefix, and ours
        a = p + "self_attn."
        put(o + "Wqkv.weight", ((a + "q_proj.weight", (q_rows, d)), (a + "k_proj.weight", (kv_rows, d)),
                                (a + "v_proj.weight", (kv_rows, d))))
        put(o + "Wo.weight", ((a + "o_proj.weight", (d, q_rows)),))
        if spec.attention_bias:
            put(o + "Wqkv.bias", ((a + "q_proj.bias", (q_rows,)), (a + "k_proj.bias", (kv_rows,)),
                                  (a + "v_proj.bias", (kv_rows,))))
            put(o + "Wo.bias", ((a + "o_proj.bias", (d,)),))
        put(o + "q_norm.weight", ((a + "q_norm.weight", (Dh,)),))
        put(o + "k_norm.weight", ((a + "k_norm.weight", (Dh,)),))
        put(o + "attn_norm.weight", ((p + "input_layernorm.weight", (d,)),))
        put(o + "mlp_norm.weight", ((p + "post_attention_layernorm.weight", (d,)),))
        put(o + "Wi.weight", ((p + "mlp.gate_proj.weight", (f, d)), (p + "mlp.up_proj.weight", (f, d))))
        put(o + "Wdown.weight", ((p + "mlp.down_proj.weight", (d, f)),))
    put("norm.weight", (("norm.weight", (d,)),))
    problems = [f"missing {k}" for k in want if k not in sd]
    problems += [f"{k}: shape {tuple(sd[k].shape)}, config implies {s}" for k, s in want.items()
                 if k in sd and tuple(sd[k].shape) != s]
    problems += [f"{k} is not accounted for by config.json (a layer beyond the layer count, or a bias the config rules "
                 "out: attention_bias)" for k in sd
                 if k not in want and k not in _KEPT_ASIDE and not k.endswith("rotary_emb.inv_freq")]
    if problems:
        raise CheckpointError("model.safetensors does not match config.json:\n  " + "\n  ".join(problems[:20])
                              + ("\n  ..." if len(problems) > 20 else ""))
    return plan
