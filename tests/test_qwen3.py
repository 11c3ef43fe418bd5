"""Qwen3 folders (btlib.pretrained.architectures.qwen3): parity with transformers' Qwen3Model on packed tokens, causal
GQA, last-token pooling of a sentence-transformers folder with Qwen3-Embedding's prompts, bf16, the file back, bad
folders.

The reference is transformers 5.23's Qwen3Model, run on random-weight folders written here, each sequence alone (a
decoder's real tokens never see padding on the right either, and alone nothing depends on how transformers masks).
Three folder forms: what Qwen3Model.save_pretrained writes (tensors at the root, as Qwen3-Embedding's folders hold
them), Qwen3ForCausalLM's ("model." prefix, an lm_head kept aside), and Qwen3-Embedding-0.6B's config.json fields
(rope_theta and rope_scaling null at the top level, no rope_parameters, no layer_types; written from memory of the
model card's file, and checked here only against what transformers itself reads from them). Shapes: hidden 64, 4
heads, 2 key / value heads (GQA), head_dim 16 and 32 (H Dh = 128 != hidden), one case without GQA and with
attention biases. Lengths 1, 7 and 97, packed together.
"""

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from btlib import load_pretrained, to_hf_state_dict
from btlib.pretrained import CheckpointError, Qwen3Encoder, instruct
from btlib.pretrained.coverage import family
from btlib.pretrained.encoding import pack_ids
from btlib.pretrained.reference import transformers_available

TESTED_HERE = ["btlib.pretrained.architectures.qwen3", "btlib.pretrained.folders.qwen3_config"]

pytestmark = pytest.mark.skipif(transformers_available() is not None, reason="transformers is not installed")

TOL = family("qwen3").fp32_tol
EOS = "<|endoftext|>"
WORDS = [EOS, "[UNK]", "Instruct", ":", "Query"] + [f"w{i}" for i in range(55)]
LENGTHS = [1, 7, 97]


def _tokenizer():
    """A word-level stand-in for Qwen3-Embedding's tokenizer.json: no BOS, <|endoftext|> appended to every text (its
    post-processor's template), so the last token, the pooled one, is EOS as there."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", pair=f"$A {EOS} $B:1 {EOS}:1",
                                                       special_tokens=[(EOS, 0)])
    return tok


def _randomise(model: torch.nn.Module) -> None:
    """Weights at a scale where attention is far from uniform and every norm's weight matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name and name.endswith("weight")
            p.copy_(1 + 0.2 * torch.randn_like(p) if norm else 0.1 * torch.randn_like(p))


def write_folder(folder, *, nkv=2, head_dim=16, layers=2, bias=False, theta=10_000.0, form="model", seed=0):
    """A random-weight Qwen3 folder; returns transformers' Qwen3Model of the same weights (the reference).

    form: "model" (Qwen3Model.save_pretrained), "causal_lm" (Qwen3ForCausalLM's: "model." prefix, lm_head), or
    "published" (Qwen3Model's tensors, Qwen3-Embedding's config.json fields)."""
    import transformers as tf
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = tf.Qwen3Config(vocab_size=len(WORDS), hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=nkv, head_dim=head_dim, intermediate_size=80, attention_bias=bias,
                         rope_parameters={"rope_type": "default", "rope_theta": theta}, max_position_embeddings=512)
    torch.manual_seed(seed)
    full = (tf.Qwen3ForCausalLM if form == "causal_lm" else tf.Qwen3Model)(cfg).eval()
    _randomise(full)
    folder.mkdir(parents=True, exist_ok=True)
    full.save_pretrained(folder)
    if form == "published":
        c = json.loads((folder / "config.json").read_text())
        for key in ("rope_parameters", "layer_types"):
            c.pop(key)
        c.update(rope_theta=theta, rope_scaling=None, sliding_window=None, use_sliding_window=False,
                 max_window_layers=28, architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True)
        (folder / "config.json").write_text(json.dumps(c))
    _tokenizer().save(str(folder / "tokenizer.json"))
    return full.model if form == "causal_lm" else full


def _reference(hf, seqs):
    """transformers' last_hidden_state of each sequence run alone, packed: (total, d)."""
    with torch.inference_mode():
        return torch.cat([hf(input_ids=torch.tensor([s])).last_hidden_state[0] for s in seqs])


def _seqs(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, len(WORDS), (n,), generator=g).tolist() for n in lengths]


def _rel(a, b):
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())  # relative to the reference scale


def _forward(model, seqs, precision=None):
    t = pack_ids(seqs)
    return model(t.ids, t.cu_seqlens, t.max_seqlen, precision=precision)


CASES = {  # name: write_folder's arguments
    "gqa-dh16": dict(),
    "gqa-dh32-causal-lm": dict(head_dim=32, layers=3, form="causal_lm", theta=1000.0),
    "mha-bias-published": dict(nkv=4, bias=True, form="published", theta=1_000_000.0),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, write_folder(path, **CASES[request.param])


def test_the_one_encode_loop():
    from btlib.pretrained.encoding import SentenceEncoder

    assert issubclass(Qwen3Encoder, SentenceEncoder) and "encode" not in vars(Qwen3Encoder)
    assert Qwen3Encoder.PATHS == ("packed", "packed_bf16") and "int8" not in Qwen3Encoder.PRECISIONS


@pytest.mark.parametrize("lengths", [LENGTHS, [97], [1]], ids=["1-7-97", "97", "1"])
def test_hidden_states_match_transformers(case, lengths):
    name, path, hf = case
    model = load_pretrained(path)
    assert isinstance(model, Qwen3Encoder)
    assert (model.spec.nkv, model.spec.head_dim) == (hf.config.num_key_value_heads, hf.config.head_dim)
    assert model.spec.rope_theta == hf.config.rope_parameters["rope_theta"]  # the published fields read as transformers
    seqs = _seqs(lengths)
    ref = _reference(hf, seqs)
    h = _forward(model, seqs)
    assert h.shape == ref.shape and h.dtype == torch.float32
    assert _rel(h, ref) <= TOL


def test_every_folder_form_is_read_as_transformers_reads_it(case):
    """transformers' own from_pretrained of the folder on disk (the published config fields, the "model." prefix and
    lm_head) gives the hidden states btlib gives: the fields are read as transformers reads them, not as written."""
    import transformers as tf

    name, path, _ = case
    cls = tf.Qwen3ForCausalLM if "causal-lm" in name else tf.Qwen3Model
    hf = cls.from_pretrained(path).eval()
    hf = hf.model if "causal-lm" in name else hf
    seqs = _seqs([7, 40])
    assert _rel(_forward(load_pretrained(path), seqs), _reference(hf, seqs)) <= TOL


def test_attention_is_causal_and_per_sequence(case):
    """A token's state depends on the tokens before it in its own sequence only: changing the last token of one
    sequence moves that token's state and nothing else, in that sequence or its neighbours."""
    model = load_pretrained(case[1])
    seqs = _seqs([7, 97, 5])
    h = _forward(model, seqs)
    changed = [s[:] for s in seqs]
    changed[1][-1] = 2 if changed[1][-1] != 2 else 3
    h2 = _forward(model, changed)
    last = 7 + 97 - 1
    assert torch.equal(h[:last], h2[:last]) and torch.equal(h[last + 1:], h2[last + 1:])
    assert _rel(h[last], h2[last]) > 1e-3


def test_every_sequence_alone_equals_the_batch(case):
    model = load_pretrained(case[1])
    seqs = _seqs(LENGTHS + [40, 2])
    alone = torch.cat([_forward(model, [s]) for s in seqs])
    assert _rel(alone, _forward(model, seqs)) <= 1e-6


def test_bf16_error_is_within_twice_transformers_own(case):
    """bf16 against the fp32 reference: at most 2x the error of transformers' own model run in bf16."""
    _, path, hf = case
    model = load_pretrained(path)
    seqs = _seqs(LENGTHS)
    ref = _reference(hf, seqs)
    ours = _forward(model, seqs, precision="bf16")
    theirs = _reference(copy.deepcopy(hf).to(torch.bfloat16), seqs).float()
    assert _rel(ours, ref) <= 2 * _rel(theirs, ref) and F.cosine_similarity(ours, ref).min() > 0.999


def test_the_file_comes_back_bit_for_bit(case):
    from safetensors.torch import load_file

    path = case[1]
    original = load_file(str(path / "model.safetensors"))
    back = to_hf_state_dict(load_pretrained(path))
    assert list(back) == list(original) and all(torch.equal(back[k], v) for k, v in original.items())
    if case[0] == "gqa-dh32-causal-lm":
        assert "lm_head.weight" in back  # kept aside, untouched


def _st_folder(path, hf_kwargs=None):
    """Qwen3-Embedding's sentence-transformers layout: Transformer at the root, Pooling lasttoken, Normalize; the query
    prompt in config_sentence_transformers.json, the document prompt empty."""
    hf = write_folder(path, **(hf_kwargs or {}))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True}))
    (path / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{kind}"}
        for i, (kind, p) in enumerate((("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")))]))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32768, "do_lower_case": False}))
    (path / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": instruct("w1 w2 w3"), "document": ""}, "default_prompt_name": None,
        "similarity_fn_name": "cosine"}))
    return hf


def _last_token(hf, ids):
    """transformers' state of each text's last token (run alone), L2-normalised: (N, d)."""
    return F.normalize(torch.stack([_reference(hf, [s])[-1] for s in ids]), dim=-1)


def test_instruct_is_qwen3_embeddings_query_format():
    assert instruct("Given a web search query, retrieve relevant passages that answer the query") == \
        "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
    with pytest.raises(ValueError, match="non-empty str"):
        instruct("  ")


def test_a_sentence_transformers_folder_pools_the_last_token(tmp_path):
    """The query prompt goes before each query, documents take none; the pooled vector is the last token's (EOS)
    state, normalised: transformers' on each text alone, and with a batch left-padded as Qwen3-Embedding's tokenizer
    pads it (positions shifted by the padding: RoPE's relative form keeps them equal to rounding)."""
    hf = _st_folder(tmp_path)
    model = load_pretrained(tmp_path)
    assert model.max_length == 512  # max_position_embeddings caps max_seq_length
    assert [type(m).__name__ for m in model.head.modules] == ["PoolingModule", "NormalizeModule"]
    assert model.head.modules[0].modes == ("lasttoken",)
    queries, docs = ["w5 w6 w7", "w8"], ["w9 " * 60, "w10 w11", "w12"]
    q_ids = model.tokenize([instruct("w1 w2 w3") + q for q in queries])
    assert q_ids[0][:4] == [2, 3, WORDS.index("w1"), WORDS.index("w2")] and q_ids[0][-1] == 0  # Instruct : w1 w2 .. EOS
    d_ids = model.tokenize(docs)
    assert _rel(model.encode(queries, prompt_name="query"), _last_token(hf, q_ids)) <= TOL
    got = model.encode(docs, prompt_name="document", batch_size=1)
    assert _rel(got, _last_token(hf, d_ids)) <= TOL and _rel(model.encode(docs), got) <= 1e-6
    T = max(map(len, d_ids))  # left padding, attention mask: what SentenceTransformer(folder).encode(docs) runs
    ids = torch.tensor([[0] * (T - len(s)) + s for s in d_ids])
    mask = torch.tensor([[0] * (T - len(s)) + [1] * len(s) for s in d_ids])
    with torch.inference_mode():
        left = F.normalize(hf(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1], dim=-1)
    assert _rel(got, left) <= TOL


@pytest.mark.parametrize("kw, match", [
    ({"precision": "int8"}, "not available for Qwen3"),
    ({"path": "fastpath"}, "path must be one of"),
])
def test_encode_refuses_what_it_cannot_run(tmp_path, kw, match):
    write_folder(tmp_path)
    with pytest.raises(ValueError, match=match):
        load_pretrained(tmp_path).encode(["w1"], **kw)


def _edit(tmp_path, changes, **kw):
    path = tmp_path / "bad"
    write_folder(path, **kw)
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        cfg.pop(k) if v is None else cfg.__setitem__(k, v)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("changes, match", [
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "layer_types": None},
     r"max_window_layers=1 < num_hidden_layers=2"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, r"'sliding_attention' at layers \[1\]"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, "rope_parameters="),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling="),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1.0}}}, "one RoPE per layer type"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"num_key_value_heads": None}, r"num_key_value_heads=32 \(absent: 32\)"),
    ({"head_dim": 15}, "head_dim=15"),
    ({"hidden_act": "quick_gelu"}, "hidden_act='quick_gelu'"),
    ({"rms_norm_eps": 0}, "rms_norm_eps=0"),
    ({"num_hidden_layers": 3}, r"layer_types=.* for each of the 3 layers"),
    ({"num_hidden_layers": 3, "layer_types": None}, r"missing layers.2.self_attn.q_proj.weight"),
    ({"attention_bias": True}, r"missing layers.0.self_attn.q_proj.bias"),
    ({"head_dim": None}, r"q_proj.weight: shape \(64, 64\), config implies \(512, 64\)"),  # absent: 128
    ({"intermediate_size": None}, "has no 'intermediate_size'"),
])
def test_bad_configs_say_what_is_wrong(tmp_path, changes, match):
    with pytest.raises(CheckpointError, match=match):
        load_pretrained(_edit(tmp_path, changes))


def test_a_bias_the_config_rules_out_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"layers.0.self_attn.q_proj.bias is not accounted for"):
        load_pretrained(_edit(tmp_path, {"attention_bias": False}, nkv=4, bias=True))
