"""NomicBERT and GTE folders (btlib.pretrained.architectures.rotary_bert): parity with transformers on packed tokens, config forms,
NTK-scaled RoPE, bf16, the file's tensors back, bad folders.

What the parity is against, and its limits. Both architectures are in transformers 5.23 itself (NomicBertModel,
GteModel; models/nomic_bert and models/gte), so the reference is transformers, run on random-weight folders written
here, not the Hub's remote code (trust_remote_code: it cannot be fetched here). Three things come from elsewhere:

  * the published folders' names. Tensors: transformers' own conversion_mapping.py ("nomic_bert": Wqkv, out_proj,
    fc11 = up, fc12 = gate, fc2, norm1, norm2, emb_ln; "gte": the prefix "new.", encoder.layer, qkv_proj,
    up_gate_proj = up | gate, attn_ln, mlp_ln), and test_published_names_are_the_ones_transformers_converts checks
    that transformers' from_pretrained maps the files written here onto the same weights. Config fields: the remote
    configs' GPT-2 names for NomicBERT (n_embd, n_inner, rotary_emb_base, ..., as the nomic-ai model cards' config.json
    and vLLM's bert_with_rope.py read them) and the "new" names for GTE v1.5 (rope_theta, rope_scaling, ...);
  * the NTK scaling of GTE v1.5 (rope_scaling {"type": "ntk", "factor": f}), which transformers' GteModel does not
    read: _ntk_inv_freq below writes the remote code's NTKScalingRotaryEmbedding (Alibaba-NLP/new-impl, as vLLM's
    ntk_scaling_rope.py reproduces it) and sets it into transformers' model as the reference;
  * RoPE bases: 1000 (the default of NomicBertConfig, in transformers and in the remote code) and 10000 (RoFormer's)
    are both checked, each read from rotary_emb_base; which base each published nomic-embed-text version carries was
    not verified here (no Hub access): btlib reads the field, it assumes none. GTE's rope_theta as each config gives
    it. nomic-embed-text-v1's model card says the original uses dynamic NTK RoPE scaling past its trained length
    (rotary_scaling_factor): btlib refuses that field by name rather than guess the formula.

Papers: Nussbaum et al. 2024, "Nomic Embed" (arXiv:2402.01613); Zhang et al. 2024, "mGTE" (arXiv:2407.19669).
"""

import copy
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from btlib import load_pretrained, to_hf_state_dict
from btlib.pretrained import CheckpointError, Pooling, RotaryBertEncoder
from btlib.pretrained.reference import transformers_available

# load_pretrained on a NomicBERT / GTE folder goes through load_rotary_bert.
TESTED_HERE = ["btlib.pretrained.architectures.rotary_bert", "btlib.pretrained.folders.rotary_bert_config"]

pytestmark = pytest.mark.skipif(transformers_available() is not None, reason="transformers is not installed")

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(56)]
SMALL = dict(vocab_size=len(WORDS), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=80,
             max_position_embeddings=512, pad_token_id=0)
LENGTHS = [1, 97, 2, 40, 17]  # 1 and 97 as everywhere in btlib, mixed in one batch


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return tok


def _randomise(model: torch.nn.Module) -> None:
    """Weights at a scale where attention is far from uniform and every norm's weight and bias matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name.lower() and name.endswith("weight")
            p.copy_(1 + 0.2 * torch.randn_like(p) if norm else 0.1 * torch.randn_like(p))


def _ntk_inv_freq(dim: int, theta: float, factor: float) -> torch.Tensor:
    """The remote code's fixed NTK scaling (NTKScalingRotaryEmbedding, mixed_b None): it builds its table for
    max_position_embeddings * factor positions, which exceeds max_position_embeddings, so it always takes the branch
    base = theta * factor, inv_freq = 1 / base^(2j / dim) / factor^(2 / dim)."""
    base = theta * factor
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    return inv_freq / factor ** (2 / dim)


def _published_nomic(sd: dict, n_layers: int) -> dict:
    """transformers' NomicBertModel names -> the published folders' (conversion_mapping.py's "nomic_bert", reversed)."""
    out = {"embeddings.word_embeddings.weight": sd["embeddings.word_embeddings.weight"],
           "embeddings.token_type_embeddings.weight": sd["embeddings.token_type_embeddings.weight"],
           "emb_ln.weight": sd["embeddings.LayerNorm.weight"], "emb_ln.bias": sd["embeddings.LayerNorm.bias"]}
    for i in range(n_layers):
        a, b = f"layers.{i}.", f"encoder.layers.{i}."
        out[b + "attn.Wqkv.weight"] = torch.cat([sd[a + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        out[b + "attn.out_proj.weight"] = sd[a + "self_attn.o_proj.weight"]
        for ours, theirs in (("fc11", "up_proj"), ("fc12", "gate_proj"), ("fc2", "down_proj")):
            out[b + f"mlp.{ours}.weight"] = sd[a + f"mlp.{theirs}.weight"]
        for ours, theirs in (("norm1", "post_attention_layernorm"), ("norm2", "post_mlp_layernorm")):
            for wb in ("weight", "bias"):
                out[b + f"{ours}.{wb}"] = sd[a + f"{theirs}.{wb}"]
    return out


def _published_gte(sd: dict, n_layers: int) -> dict:
    """transformers' GteModel names -> the published "new" folders' (conversion_mapping.py's "gte", reversed), under
    NewForMaskedLM's prefix "new."."""
    out = {f"new.{k}": v for k, v in sd.items() if k.startswith("embeddings.")}
    for i in range(n_layers):
        a, b = f"layers.{i}.", f"new.encoder.layer.{i}."
        for wb in ("weight", "bias"):
            out[b + f"attention.qkv_proj.{wb}"] = torch.cat([sd[a + f"self_attn.{x}_proj.{wb}"] for x in "qkv"])
            out[b + f"attention.o_proj.{wb}"] = sd[a + f"self_attn.o_proj.{wb}"]
            out[b + f"mlp.down_proj.{wb}"] = sd[a + f"mlp.down_proj.{wb}"]
            out[b + f"attn_ln.{wb}"] = sd[a + f"post_attention_layernorm.{wb}"]
            out[b + f"mlp_ln.{wb}"] = sd[a + f"post_mlp_layernorm.{wb}"]
        out[b + "mlp.up_gate_proj.weight"] = torch.cat([sd[a + "mlp.up_proj.weight"], sd[a + "mlp.gate_proj.weight"]])
    out["new.pooler.dense.weight"] = torch.randn(SMALL["hidden_size"], SMALL["hidden_size"])  # kept aside
    return out


def _nomic_config(theta: float, type_vocab_size: int = 2) -> dict:
    """config.json in the published folders' GPT-2 names (nomic-embed-text-v1.5's fields, shrunk)."""
    return {"model_type": "nomic_bert", "architectures": ["NomicBertModel"], "activation_function": "swiglu",
            "n_embd": SMALL["hidden_size"], "n_layer": SMALL["num_hidden_layers"], "n_head": SMALL["num_attention_heads"],
            "n_inner": SMALL["intermediate_size"], "n_positions": 512, "max_trained_positions": 512,
            "vocab_size": SMALL["vocab_size"], "pad_vocab_size_multiple": 1, "type_vocab_size": type_vocab_size,
            "layer_norm_epsilon": 1e-12, "rotary_emb_base": theta, "rotary_emb_fraction": 1.0,
            "rotary_emb_interleaved": False, "rotary_emb_scale_base": None, "rotary_scaling_factor": None,
            "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False, "prenorm": False, "causal": False,
            "use_rms_norm": False, "parallel_block": False, "use_flash_attn": True, "fused_bias_fc": True,
            "embd_pdrop": 0.0, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "summary_first_dropout": 0.0}


def _gte_config(theta: float, type_vocab_size: int, rope_scaling=None, model_type="new") -> dict:
    """config.json in the published "new" fields (gte-base-en-v1.5's, shrunk); model_type "gte" with the same fields
    is how snowflake-arctic-embed-m-v2.0's remote-code config names itself."""
    return {"model_type": model_type, "architectures": ["NewModel"], **SMALL, "hidden_act": "gelu", "layer_norm_eps": 1e-12,
            "layer_norm_type": "layer_norm", "position_embedding_type": "rope", "rope_theta": theta,
            "rope_scaling": rope_scaling, "type_vocab_size": type_vocab_size, "pack_qkv": True,
            "logn_attention_scale": False, "logn_attention_clip1": False, "unpad_inputs": False,
            "use_memory_efficient_attention": False, "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.0}


def write_folder(folder, family="nomic", published=True, theta=1000.0, type_vocab_size=2, ntk=None, seed=0,
                 model_type="new"):
    """A random-weight NomicBERT / GTE folder and transformers' model of the same weights (the reference).

    published: True, the Hub's config fields and tensor names; False, what transformers 5.23's save_pretrained
    writes (its own config fields: model_type "nomic_bert" with BERT names, or "gte"; the published tensor names);
    None, its config with the in-memory names of state_dict(). ntk: GTE's rope_scaling factor (published form
    only); the reference gets the remote code's scaled inverse frequencies."""
    import transformers as tf
    from safetensors.torch import save_file
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    rope = {"rope_type": "default", "rope_theta": theta}
    if family == "nomic":
        cfg = tf.NomicBertConfig(**SMALL, type_vocab_size=type_vocab_size, rope_parameters=rope)
        cls = tf.NomicBertModel
    else:
        cfg = tf.GteConfig(**SMALL, type_vocab_size=type_vocab_size, rope_parameters=rope, hidden_act="gelu")
        cls = tf.GteModel
    torch.manual_seed(seed)
    hf = cls(cfg).eval()
    _randomise(hf)
    if ntk:
        hf.rotary_emb.inv_freq.copy_(_ntk_inv_freq(SMALL["hidden_size"] // SMALL["num_attention_heads"], theta, ntk))
    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if published:
        n = SMALL["num_hidden_layers"]
        sd = _published_nomic(sd, n) if family == "nomic" else _published_gte(sd, n)
        scaling = {"type": "ntk", "factor": ntk} if ntk else None
        config = _nomic_config(theta, type_vocab_size) if family == "nomic" else _gte_config(theta, type_vocab_size, scaling, model_type)
        (folder / "config.json").write_text(json.dumps(config))
        save_file(sd, str(folder / "model.safetensors"))
    elif published is None:  # transformers' in-memory names, as a state_dict() saved by hand
        cfg.save_pretrained(folder)
        save_file(sd, str(folder / "model.safetensors"))
    else:
        hf.save_pretrained(folder)  # transformers 5.23 writes its config fields and the published tensor names
    _tokenizer().save(str(folder / "tokenizer.json"))
    return hf


def _reference(hf, seqs, types=None):
    """transformers' last_hidden_state on the real tokens of a padded batch, packed: (total, d)."""
    T = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (T - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in seqs])
    tt = None if types is None else torch.tensor([t + [0] * (T - len(t)) for t in types])
    with torch.inference_mode():
        h = hf(input_ids=ids, attention_mask=mask, token_type_ids=tt).last_hidden_state  # (B, T, d)
    return h[mask.bool()]


def _seqs(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[2] + torch.randint(5, len(WORDS), (n - 1,), generator=g).tolist() for n in lengths]


def _rel(a, b):
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())  # relative to the reference scale


def _forward(model, seqs):
    from btlib.pretrained.encoding import pack_ids

    t = pack_ids(seqs)
    return model(t.ids, t.cu_seqlens, t.max_seqlen)


CASES = {  # name: write_folder's arguments
    "nomic-published-1000": dict(family="nomic", theta=1000.0),
    "nomic-published-10000": dict(family="nomic", theta=10000.0),
    "nomic-saved-by-transformers": dict(family="nomic", published=False, theta=1000.0),
    "gte-new-no-types": dict(family="gte", theta=500.0, type_vocab_size=0),
    "gte-new-ntk": dict(family="gte", theta=500.0, type_vocab_size=2, ntk=2.0),
    "gte-remote-fields-as-gte": dict(family="gte", theta=160_000.0, type_vocab_size=1, model_type="gte"),
    "gte-saved-by-transformers": dict(family="gte", published=False, theta=160_000.0, type_vocab_size=1),
    "gte-state-dict-names": dict(family="gte", published=None, theta=2000.0, type_vocab_size=0),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, write_folder(path, **CASES[request.param])


def test_the_one_encode_loop():
    from btlib.pretrained.encoding import SentenceEncoder

    assert issubclass(RotaryBertEncoder, SentenceEncoder) and "encode" not in vars(RotaryBertEncoder)
    assert RotaryBertEncoder.PATHS == ("packed", "packed_bf16") and "int8" not in RotaryBertEncoder.PRECISIONS


@pytest.mark.parametrize("lengths", [LENGTHS, [97], [1]], ids=["mixed", "97", "1"])
def test_hidden_states_match_transformers(case, lengths):
    name, path, hf = case
    model = load_pretrained(path)
    assert isinstance(model, RotaryBertEncoder) and model.spec.family == ("nomic_bert" if "nomic" in name else "gte")
    seqs = _seqs(lengths)
    ref = _reference(hf, seqs)
    h = _forward(model, seqs)
    assert h.shape == ref.shape and h.dtype == torch.float32
    assert _rel(h, ref) <= 1e-5


def test_the_rope_base_and_the_ntk_scaling_matter(tmp_path):
    """Reading rotary_emb_base or the NTK factor wrongly moves the output far beyond 1e-5."""
    hf = write_folder(tmp_path / "ntk", family="gte", theta=500.0, ntk=2.0)
    seqs = _seqs([97, 40])
    ref = _reference(hf, seqs)
    model = load_pretrained(tmp_path / "ntk")
    assert model.spec.rope == (1000.0, 2.0 ** (2 / 16))
    model.spec = dataclasses.replace(model.spec, ntk_factor=1.0)
    assert _rel(_forward(model, seqs), ref) > 1e-3
    hf = write_folder(tmp_path / "nomic", theta=10000.0)
    cfg = json.loads((tmp_path / "nomic" / "config.json").read_text())
    (tmp_path / "nomic" / "config.json").write_text(json.dumps({**cfg, "rotary_emb_base": 1000.0}))
    assert _rel(_forward(load_pretrained(tmp_path / "nomic"), seqs), _reference(hf, seqs)) > 1e-3


def test_published_names_are_the_ones_transformers_converts(tmp_path):
    """transformers' from_pretrained, given the published tensor names written here (and its own config fields),
    builds the very weights they came from: the names are the published ones, not a guess of this test's."""
    import transformers as tf

    for family, cls in (("nomic", tf.NomicBertModel), ("gte", tf.GteModel)):
        hf = write_folder(tmp_path / family, family=family, theta=700.0)
        hf.config.save_pretrained(tmp_path / family)  # transformers' config fields beside the published tensors
        back = cls.from_pretrained(tmp_path / family).state_dict()
        want = hf.state_dict()
        assert set(back) == set(want) and all(torch.equal(back[k], want[k]) for k in want), family


def test_every_sequence_alone_equals_the_batch(case):
    model = load_pretrained(case[1])
    seqs = _seqs(LENGTHS)
    alone = torch.cat([_forward(model, [s]) for s in seqs])
    assert _rel(alone, _forward(model, seqs)) <= 1e-6


def test_bf16_error_is_within_twice_transformers_own(case):
    """bf16 against the fp32 reference: at most 2x the error of transformers' own model run in bf16."""
    from btlib.pretrained.encoding import pack_ids

    _, path, hf = case
    model = load_pretrained(path)
    seqs = _seqs(LENGTHS)
    ref = _reference(hf, seqs)
    t = pack_ids(seqs)
    ours = model(t.ids, t.cu_seqlens, t.max_seqlen, precision="bf16")
    theirs = _reference(copy.deepcopy(hf).to(torch.bfloat16), seqs).float()
    assert _rel(ours, ref) <= 2 * _rel(theirs, ref) and F.cosine_similarity(ours, ref).min() > 0.999


def test_encode_pools_pairs_with_token_types(tmp_path):
    """encode: pairs get token type 1 on the second text (a BERT tokenizer), mean pooling, as transformers computes."""
    hf = write_folder(tmp_path, family="nomic")
    model = load_pretrained(tmp_path)
    texts = [("w1 w2 w3", "w4 w5"), ("w6", " ".join(f"w{i % 50}" for i in range(90)))]
    enc = model.tokenizer.encode_batch(texts)
    ids, types = [e.ids for e in enc], [e.type_ids for e in enc]
    assert types[0] == [0, 0, 0, 0, 0, 1, 1, 1]
    ref = _reference(hf, ids, types)
    cu = torch.tensor([0] + [len(s) for s in ids]).cumsum(0)
    mean = torch.stack([ref[a:b].mean(0) for a, b in zip(cu[:-1], cu[1:])])
    assert _rel(model.encode(texts, batch_size=1), mean) <= 1e-5
    model.pooling = Pooling("cls", True)
    assert _rel(model.encode(texts), F.normalize(ref[cu[:-1]], dim=-1)) <= 1e-5


def test_a_sentence_transformers_folder_with_prompts(tmp_path):
    """nomic-embed-text's folder shape: modules.json (Transformer at the root, mean Pooling, Normalize), prompts, and a
    GPT-2 config.json without hidden_size: the head is built on n_embd and the query prompt goes before each text."""
    hf = write_folder(tmp_path, family="nomic")
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                    "pooling_mode_mean_tokens": True}))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (kind, path) in enumerate((("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")))]))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8192, "do_lower_case": False,
                                                                    "model_args": {"trust_remote_code": True}}))
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "w1 w2 ", "document": "w3 "}, "default_prompt_name": None}))
    model = load_pretrained(tmp_path)
    assert model.max_length == 512 and model.pooling == Pooling("mean", True)  # n_positions caps max_seq_length
    texts = ["w5 w6 w7", "w8"]
    ids = model.tokenize(["w1 w2 " + t for t in texts])
    ref = _reference(hf, ids)
    cu = torch.tensor([0] + [len(s) for s in ids]).cumsum(0)
    want = F.normalize(torch.stack([ref[a:b].mean(0) for a, b in zip(cu[:-1], cu[1:])]), dim=-1)
    assert _rel(model.encode(texts, prompt_name="query"), want) <= 1e-5


def test_the_file_comes_back_bit_for_bit(case):
    from safetensors.torch import load_file

    path = case[1]
    original = load_file(str(path / "model.safetensors"))
    back = to_hf_state_dict(load_pretrained(path))
    assert list(back) == list(original) and all(torch.equal(back[k], v) for k, v in original.items())


@pytest.mark.parametrize("kw, match", [
    ({"precision": "int8"}, "not available for NomicBERT"),
    ({"path": "fastpath"}, "path must be one of"),
])
def test_encode_refuses_what_it_cannot_run(tmp_path, kw, match):
    write_folder(tmp_path)
    with pytest.raises(ValueError, match=match):
        load_pretrained(tmp_path).encode(["w1"], **kw)


def _edit(tmp_path, family="nomic", **changes):
    path = tmp_path / "bad"
    write_folder(path, family=family)
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        cfg.pop(k) if v is None else cfg.__setitem__(k, v)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("family, changes, match", [
    ("nomic", {"rotary_scaling_factor": 2.0}, "rotary_scaling_factor=2.0"),
    ("nomic", {"rotary_emb_interleaved": True}, "rotary_emb_interleaved=True"),
    ("nomic", {"rotary_emb_fraction": 0.5}, "rotary_emb_fraction=0.5"),
    ("nomic", {"qkv_proj_bias": None}, r"qkv_proj_bias=True \(absent\)"),
    ("nomic", {"activation_function": "gelu"}, "activation_function='gelu'"),
    ("nomic", {"prenorm": True}, "prenorm=True"),
    ("nomic", {"rotary_emb_base": None}, "rotary_emb_base=None"),
    ("nomic", {"n_inner": None}, "has no 'n_inner'"),
    ("nomic", {"n_layer": 3}, r"missing encoder.layers.2.attn.Wqkv.weight"),
    ("nomic", {"type_vocab_size": 0}, r"embeddings.token_type_embeddings.weight is not accounted for"),
    ("gte", {"rope_scaling": {"type": "ntk", "factor": 2.0, "mixed_b": 0.5}}, "without mixed_b"),
    ("gte", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling="),
    ("gte", {"logn_attention_scale": True}, "logn_attention_scale=True"),
    ("gte", {"layer_norm_type": "rms_norm"}, "layer_norm_type='rms_norm'"),
    ("gte", {"hidden_act": "quick_gelu"}, "hidden_act='quick_gelu'"),
    ("gte", {"intermediate_size": 70}, r"mlp.up_gate_proj.weight: shape \(160, 64\), config implies \(140, 64\)"),
])
def test_bad_configs_say_what_is_wrong(tmp_path, family, changes, match):
    with pytest.raises(CheckpointError, match=match):
        load_pretrained(_edit(tmp_path, family, **changes))


def test_transformers_form_refuses_a_scaled_rope(tmp_path):
    path = tmp_path / "t"
    write_folder(path, family="gte", published=False)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10.0}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="rope_parameters="):
        load_pretrained(path)
