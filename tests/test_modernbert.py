"""ModernBERT folders: parity with transformers' ModernBertModel on packed tokens, config forms, bad folders."""

import json
import warnings

import pytest
import torch
import torch.nn.functional as F

from btlib import device, hardware, load_pretrained, to_hf_state_dict
from btlib.pretrained import CheckpointError, ModernBertEncoder, Pooling
from btlib.pretrained.folders.modernbert_config import spec_from_config
from btlib.pretrained.reference import transformers_available

# load_pretrained on a ModernBERT folder goes through load_modernbert.
TESTED_HERE = ["btlib.pretrained.architectures.modernbert"]

pytestmark = pytest.mark.skipif(transformers_available() is not None, reason="transformers is not installed")

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(56)]
LOCAL = 16  # local_attention: local layers see |i - j| <= 8, so most test sequences are longer than the window
SMALL = dict(vocab_size=len(WORDS), hidden_size=96, num_hidden_layers=5, num_attention_heads=4, intermediate_size=75,
             global_attn_every_n_layers=3, local_attention=LOCAL, global_rope_theta=1000.0, local_rope_theta=50.0,
             pad_token_id=0, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3, max_position_embeddings=512)
LENGTHS = [1, 97, 2, 40, 17, 23]  # 1 and 97 as everywhere in btlib; 17 = the full window 2 * 8 + 1


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return tok


def _randomise(model: torch.nn.Module) -> None:
    """Weights at a scale where attention is far from uniform and every norm's weight and bias matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name and name.endswith("weight") else 0.1 * torch.randn_like(p))


def write_modernbert(folder, masked_lm=True, **overrides):
    """A random-weight ModernBERT folder written by transformers (ModernBertForMaskedLM: the published form)."""
    import transformers as tf
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = tf.ModernBertConfig(**{**SMALL, **overrides})
    torch.manual_seed(0)
    hf = (tf.ModernBertForMaskedLM if masked_lm else tf.ModernBertModel)(cfg).eval()
    _randomise(hf)
    hf.save_pretrained(folder)
    _tokenizer().save(str(folder / "tokenizer.json"))
    return hf.model if masked_lm else hf


def _reference(hf, seqs, impl="sdpa"):
    """transformers' last_hidden_state on the real tokens of a padded batch, packed: (total, d)."""
    hf.config._attn_implementation = impl
    T = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (T - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in seqs])
    with torch.inference_mode():
        h = hf(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, d)
    return h[mask.bool()]


def _seqs(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, len(WORDS), (n,), generator=g).tolist() for n in lengths]


def _rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())  # relative to the reference scale


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("modernbert")
    return path, write_modernbert(path)


@pytest.mark.parametrize("lengths", [LENGTHS, [97], [1], [40, 3]], ids=["mixed", "batch1-97", "batch1-1", "two"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_hidden_states_match_transformers(folder, lengths, impl):
    path, hf = folder
    model = load_pretrained(path)
    assert isinstance(model, ModernBertEncoder) and model.spec.global_layers == (True, False, False, True, False)
    seqs = _seqs(lengths)
    ref = _reference(hf, seqs, impl)
    h = model(*model.pack(seqs))
    assert h.shape == ref.shape and h.dtype == torch.float32
    assert _rel(h, ref) <= 1e-5


def test_every_sequence_alone_equals_the_batch(folder):
    model = load_pretrained(folder[0])
    seqs = _seqs(LENGTHS)
    batched = model(*model.pack(seqs))
    alone = torch.cat([model(*model.pack([s])) for s in seqs])
    assert _rel(alone, batched) <= 1e-6


def test_window_and_global_layers_matter(folder):
    """The reference distinguishes the layer kinds: reading them wrongly moves the output far beyond 1e-5."""
    path, hf = folder
    seqs = _seqs([97, 40])
    ref = _reference(hf, seqs)
    model = load_pretrained(path)
    for layer in model.layers:
        layer.window = None  # every layer global
    assert _rel(model(*model.pack(seqs)), ref) > 1e-2


def test_a_forward_checks_its_inputs_once_and_selects_one_kernel(folder, monkeypatch):
    """Prepared once per forward, not per layer: one cu_seqlens check, one kernel selection on the first forward
    (none after), and no layer goes through the public varlen_attention's checks."""
    import btlib.pretrained.architectures.modernbert_layers as layers
    import btlib.pretrained.architectures.modernbert_model as mm
    from btlib.kernels import registry

    model = load_pretrained(folder[0])
    seqs = _seqs([97, 1, 40])
    ref = model(*model.pack(seqs))  # the public path once more below, counted
    model.__dict__.pop("_kernels", None)
    calls = {"check": 0, "select": 0}
    check, select = mm.check_cu_seqlens, registry.select
    monkeypatch.setattr(mm, "check_cu_seqlens", lambda *a, **k: (calls.__setitem__("check", calls["check"] + 1), check(*a, **k))[1])
    monkeypatch.setattr(registry, "select", lambda *a, **k: (calls.__setitem__("select", calls["select"] + 1), select(*a, **k))[1])
    monkeypatch.setattr(layers, "varlen_attention", lambda *a, **k: pytest.fail("a layer re-checked and re-selected"))
    for forward in range(2):
        out = model(*model.pack(seqs))
        assert calls == {"check": forward + 1, "select": 1} and torch.equal(out, ref)
    assert len(model.layers) == 5  # five layers, mixed global and local, on one kernel


@pytest.mark.parametrize("overrides", [dict(norm_bias=True, attention_bias=True, mlp_bias=True,
                                            hidden_activation="gelu_pytorch_tanh"),
                                       dict(hidden_activation="silu", global_attn_every_n_layers=2, local_attention=9)],
                         ids=["biases-tanh", "silu-every2-odd-window"])
def test_options_match_transformers(tmp_path, overrides):
    hf = write_modernbert(tmp_path, masked_lm=False, **overrides)
    model = load_pretrained(tmp_path)
    seqs = _seqs(LENGTHS)
    assert _rel(model(*model.pack(seqs)), _reference(hf, seqs)) <= 1e-5


def test_published_field_form_loads_the_same(tmp_path, folder):
    """The answerdotai checkpoints' config form (global_attn_every_n_layers, *_rope_theta, no layer_types /
    rope_parameters) gives the same model as the form transformers 5 writes; transformers reads it the same."""
    import shutil

    import transformers as tf

    path, hf = folder
    shutil.copytree(path, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        del cfg[key]
    cfg.update(global_rope_theta=1000.0, local_rope_theta=50.0, position_embedding_type="absolute", layer_norm_eps=1e-5)
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    old = tf.ModernBertConfig.from_pretrained(tmp_path / "m")
    assert old.layer_types == hf.config.layer_types and old.rope_parameters == hf.config.rope_parameters
    seqs = _seqs([97, 5])
    assert torch.equal(load_pretrained(tmp_path / "m")(*load_pretrained(path).pack(seqs)),
                       load_pretrained(path)(*load_pretrained(path).pack(seqs)))


@pytest.mark.parametrize("fields", [
    dict(global_attn_every_n_layers=2, global_rope_theta=5e5, local_rope_theta=1e4, local_attention=128),
    dict(layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"],
         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 7.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 3.0}}),
    dict(global_rope_theta=5.0, local_rope_theta=9.0,
         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 7.0}}),
    dict(local_attention=33),
    dict(rope_scaling={"rope_type": "default", "rope_theta": 500.0}, global_rope_theta=5.0),
    dict(rope_scaling={"rope_theta": 70.0}, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 7.0},
                                                             "sliding_attention": {"rope_type": "default"}}),
    dict(rope_scaling={"type": "default"}, local_rope_theta=9.0),
    dict(sliding_window=5, local_attention=128),
    dict(sliding_window=0),
], ids=["legacy", "v5", "mixed-newer-wins", "defaults", "rope_scaling-theta", "rope_scaling-over-parameters",
        "rope_scaling-no-theta", "sliding_window-overrides", "sliding_window-0"])
def test_config_forms_resolve_as_transformers_does(fields):
    import transformers as tf

    c = {"model_type": "modernbert", **SMALL, **fields}
    for key in ("global_attn_every_n_layers", "global_rope_theta", "local_rope_theta"):
        if key not in fields:
            c.pop(key)
    spec, ref = spec_from_config(c), tf.ModernBertConfig.from_dict(c)
    assert spec.global_layers == tuple(t == "full_attention" for t in ref.layer_types)
    assert spec.rope_theta_global == ref.rope_parameters["full_attention"]["rope_theta"]
    assert spec.rope_theta_local == ref.rope_parameters["sliding_attention"]["rope_theta"]
    assert spec.half_window == ref.sliding_window and spec.norm_eps == ref.norm_eps


@pytest.mark.parametrize("fields", [
    dict(rope_scaling={"rope_type": "default", "rope_theta": 37.0}),
    dict(rope_scaling={"rope_theta": 900.0}, global_rope_theta=5.0),
    dict(sliding_window=3),
], ids=["rope_scaling-theta", "rope_scaling-untyped", "sliding_window"])
def test_older_and_newer_field_forms_match_transformers(folder, tmp_path, fields):
    """rope_theta inside rope_scaling and the sliding_window field, in a folder: the hidden states transformers
    computes from the same config.json (both used to be ignored, silently: cosine far from 1 on long sequences)."""
    import transformers as tf

    bad = _edit(folder[0], tmp_path, **fields)
    hf = tf.ModernBertModel.from_pretrained(bad).eval()
    model = load_pretrained(bad)
    seqs = _seqs([97, 40, 1])
    assert _rel(model(*model.pack(seqs)), _reference(hf, seqs)) <= 1e-5


def test_published_base_config():
    """answerdotai/ModernBERT-base's config.json as published (transformers 4.47 fields)."""
    c = {"architectures": ["ModernBertForMaskedLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 50281,
         "classifier_activation": "gelu", "classifier_bias": False, "classifier_dropout": 0.0, "classifier_pooling": "mean",
         "cls_token_id": 50281, "decoder_bias": True, "deterministic_flash_attn": False, "embedding_dropout": 0.0,
         "eos_token_id": 50282, "global_attn_every_n_layers": 3, "global_rope_theta": 160000.0, "gradient_checkpointing": False,
         "hidden_activation": "gelu", "hidden_size": 768, "initializer_cutoff_factor": 2.0, "initializer_range": 0.02,
         "intermediate_size": 1152, "layer_norm_eps": 1e-05, "local_attention": 128, "local_rope_theta": 10000.0,
         "max_position_embeddings": 8192, "mlp_bias": False, "mlp_dropout": 0.0, "model_type": "modernbert", "norm_bias": False,
         "norm_eps": 1e-05, "num_attention_heads": 12, "num_hidden_layers": 22, "pad_token_id": 50283,
         "position_embedding_type": "absolute", "sep_token_id": 50282, "tie_word_embeddings": True, "torch_dtype": "float32",
         "transformers_version": "4.47.0.dev0", "vocab_size": 50368}
    spec = spec_from_config(c)
    assert [i for i, g in enumerate(spec.global_layers) if g] == list(range(0, 22, 3))
    assert (spec.window(0), spec.window(1), spec.rope_theta(0), spec.rope_theta(1)) == (None, (64, 64), 160000.0, 10000.0)


def test_from_config_takes_a_transformers_state_dict(folder):
    path, hf = folder
    model = ModernBertEncoder.from_config(SMALL)
    model.load_state_dict(hf.state_dict(), strict=True)
    loaded = load_pretrained(path)
    args = loaded.pack(_seqs(LENGTHS))
    assert torch.equal(model(*args), loaded(*args))
    with pytest.raises(CheckpointError, match="hidden_activation='relu6'"):
        ModernBertEncoder.from_config({**SMALL, "hidden_activation": "relu6"})


def test_masked_lm_head_is_kept_aside_and_the_file_comes_back(folder):
    from safetensors.torch import load_file

    path, _ = folder
    model = load_pretrained(path)
    original = load_file(str(path / "model.safetensors"))
    unused = model._hf["unused"]
    assert any(k.startswith("head.") for k in unused) and not any(k.startswith("model.") for k in unused)
    back = to_hf_state_dict(model)
    assert list(back) == list(original) and all(torch.equal(back[k], v) for k, v in original.items())


def test_encode_pools_as_sentence_transformers(tmp_path, folder):
    path, hf = folder
    texts = ["w1 w2 w3", "w4", " ".join(f"w{5 + i % 50}" for i in range(60)), ""]
    model = load_pretrained(path)
    seqs = model.tokenize(texts)
    assert seqs[3] == [2, 3] and len(seqs[2]) == 62  # [CLS] ... [SEP], no padding
    ref = _reference(hf, seqs)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    mean = torch.stack([ref[a:b].mean(0) for a, b in zip(cu[:-1], cu[1:])])
    assert model.pooling == Pooling("mean", False)  # a bare checkpoint: sentence-transformers' default
    assert _rel(model.encode(texts, batch_size=3), mean) <= 1e-5
    model.pooling = Pooling("cls", True)
    assert _rel(model.encode(texts), F.normalize(ref[cu[:-1]], dim=-1)) <= 1e-5
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    (path / "modules.json").write_text(json.dumps([{"type": f"sentence_transformers.models.{t}", "path": p} for t, p in
                                                   (("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2"))]))
    try:
        assert load_pretrained(path).pooling == Pooling("cls", True)
    finally:
        (path / "modules.json").unlink()
        (path / "1_Pooling" / "config.json").unlink()


def test_bf16_error_is_within_twice_transformers_own(folder):
    """bf16 against the fp32 reference: at most 2x the error of transformers' own model run in bf16."""
    import copy

    path, hf = folder
    model = load_pretrained(path)
    seqs = _seqs(LENGTHS)
    ref = _reference(hf, seqs)
    ours = model(*model.pack(seqs), precision="bf16")
    theirs = _reference(copy.deepcopy(hf).to(torch.bfloat16), seqs).float()
    cos = F.cosine_similarity(ours, ref).min()
    print(f"bf16 vs fp32: btlib {_rel(ours, ref):.2e} (min cosine {cos:.5f}), transformers in bf16 {_rel(theirs, ref):.2e}")
    assert _rel(ours, ref) <= 2 * _rel(theirs, ref) and cos > 0.999
    texts = ["w1 w2 w3", "w4 " * 50]
    assert F.cosine_similarity(model.encode(texts, precision="bf16"), model.encode(texts)).min() > 0.999
    auto = model.encode(texts, precision="auto")
    assert torch.equal(auto, model.encode(texts, precision=device.choose_precision().precision))


def test_bf16_on_a_non_native_cpu_warns_once(folder, monkeypatch, fresh_warnings):
    monkeypatch.setenv("BTLIB_ASSUME_NO_BF16", "1")
    monkeypatch.setattr(hardware, "_memo", {})
    model = load_pretrained(folder[0])
    with pytest.warns(device.SlowPrecisionWarning, match=r"ModernBertEncoder.encode in bf16: bf16 is not native") as got:
        model.encode(["w1", "w2"], path="packed_bf16")
    assert len(got) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.encode(["w1"], precision="bf16")
        assert torch.equal(model.encode(["w1 w2"], precision="auto"), model.encode(["w1 w2"]))  # auto = fp32 here


def test_encode_of_token_ids_is_exact(folder):
    """Pre-tokenized input: the tokenizer's ids encode exactly as the texts do (lists, tuples, numpy, tensors)."""
    import numpy as np

    path, hf = folder
    model = load_pretrained(path)
    model.pooling = Pooling("cls", False)
    texts = ["w1 w2 w3", "", "w4 " * 30]
    seqs = model.tokenize(texts)
    ref = _reference(hf, seqs)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    want = model.encode(texts, batch_size=2)
    assert _rel(want, ref[cu[:-1]]) <= 1e-5
    for ids in (seqs, [tuple(s) for s in seqs], [np.array(s) for s in seqs], [torch.tensor(s) for s in seqs]):
        assert torch.equal(model.encode(ids, batch_size=2), want)


@pytest.mark.parametrize("texts, error, match", [
    ([b"w1 w2"], TypeError, r"texts\[0\] is a bytes.*decode them"),
    (["w1", [2, 3]], TypeError, r"texts\[0\] is a str: pass all texts as str, or all as lists"),
    ([[2, 3], None], TypeError, r"texts\[1\] is a NoneType"),
    ([[2, 5.0, 3]], TypeError, r"texts\[0\] holds 5.0"),
    ([[2, True, 3]], TypeError, r"texts\[0\] holds True"),
    ([[2, 5, 3], []], ValueError, r"texts\[1\] is an empty list of token ids"),
    ([[], [2, 5, 3]], ValueError, r"texts\[0\] is an empty list of token ids"),
    ([[2, -1, 3]], ValueError, r"token id -1, outside \[0, vocab_size=61\)"),
    ([[2, 61, 3]], ValueError, r"token id 61, outside \[0, vocab_size=61\)"),
    (b"w1", TypeError, "wrap a single text in a list"),
    (["w1", "w2 \ud800"], ValueError, r"texts\[1\] holds a lone surrogate \(U\+D800 at character 3\)"),
], ids=["bytes", "mixed", "none", "float-id", "bool-id", "empty-last", "empty-first", "negative", "vocab-size", "bytes-alone",
        "lone-surrogate"])
def test_encode_refuses_bad_token_ids(folder, texts, error, match):
    """Bytes were read as ids, an empty id list pooled the next sequence's CLS (or raised IndexError when
    last), ids outside the vocabulary raised the embedding's IndexError: now each says what to pass."""
    model = load_pretrained(folder[0])
    model.pooling = Pooling("cls", False)
    with pytest.raises(error, match=match):
        model.encode(texts)


def test_forward_refuses_ids_outside_the_vocabulary(folder):
    model = load_pretrained(folder[0])
    ids, cu_seqlens, max_seqlen = model.pack([[2, 5, 3]])
    with pytest.raises(ValueError, match=r"vocab_size=61\); got -4 .. 5"):
        model(ids - 6 + torch.tensor([0, 6, 0]), cu_seqlens, max_seqlen)
    assert model.pack([[2, 3], []])[1].tolist() == [0, 2, 2]  # pack keeps an empty sequence (no hidden states)


@pytest.mark.parametrize("kw, error, match", [
    ({"path": "fastpath"}, ValueError, "path must be one of"),
    ({"precision": "int8"}, ValueError, "not available for ModernBERT"),
    ({"precision": "fp16"}, ValueError, "precision must be None or one of"),
    ({"batch_size": 0}, ValueError, "batch_size must be a positive int"),
    ({"path": "packed_bf16", "precision": "fp32"}, ValueError, "path='packed_bf16' is bf16"),
])
def test_encode_rejects_bad_calls(folder, kw, error, match):
    with pytest.raises(error, match=match):
        load_pretrained(folder[0]).encode(["w1"], **kw)


NULL = object()  # _edit: write the field as JSON null (None drops it)


def _edit(folder, tmp_path, **changes):
    import shutil

    bad = tmp_path / "bad"
    if not bad.exists():
        shutil.copytree(folder, bad)
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = None if v is NULL else v
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


@pytest.mark.parametrize("changes, match", [
    ({"hidden_size": None}, "has no 'hidden_size'"),
    ({"hidden_activation": "quick_gelu"}, "hidden_activation='quick_gelu'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e3},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}}, "rope_parameters.full_attention"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling"),
    ({"head_dim": 16}, "head_dim=16"),
    ({"layer_types": ["full_attention"] * 4}, "layer_types="),
    ({"norm_eps": "small"}, "norm_eps='small'"),
    ({"norm_eps": float("nan")}, "norm_eps=nan"),
    ({"norm_eps": 0}, "norm_eps=0"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling="),
    ({"rope_scaling": {"rope_theta": float("inf")}}, "rope_scaling.rope_theta=inf"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": float("nan")}}},
     "rope_parameters.full_attention.rope_theta=nan"),
    ({"rope_parameters": {"full_attention": "default"}}, "rope_parameters.full_attention='default'"),
    ({"rope_parameters": None, "global_rope_theta": "1e4"}, "global_rope_theta='1e4'"),
    ({"sliding_window": NULL}, "sliding_window=None"),
    ({"norm_eps": NULL}, "norm_eps=None"),
    ({"sliding_window": 2.5}, "sliding_window=2.5"),
    ({"layer_types": [{"type": "full_attention"}] * 5}, "layer_types="),
    ({"head_dim": "24"}, "head_dim='24'"),
    ({"max_position_embeddings": 512.0}, "max_position_embeddings=512.0"),
    ({"pad_token_id": "0"}, "pad_token_id='0'"),
    ({"hidden_activation": ["gelu"]}, "hidden_activation="),
    ({"attention_bias": True}, r"missing model.layers.0.attn.Wqkv.bias"),
    ({"num_hidden_layers": 4, "layer_types": None}, r"model.layers.4.attn.Wqkv.weight is not accounted for"),
    ({"intermediate_size": 80}, r"model.layers.0.mlp.Wi.weight: shape \(150, 96\), config implies \(160, 96\)"),
    ({"model_type": "modernbert-decoder"}, "not supported"),
])
def test_bad_configs_say_what_is_wrong(folder, tmp_path, changes, match):
    with pytest.raises(CheckpointError, match=match):
        load_pretrained(_edit(folder[0], tmp_path, **changes))


def test_bad_files_say_what_is_wrong(folder, tmp_path):
    bad = _edit(folder[0], tmp_path)
    with pytest.raises(CheckpointError, match="sha256"):
        load_pretrained(bad, expected_sha256="0" * 64)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="damaged or incomplete"):
        load_pretrained(bad)
    (bad / "model.safetensors").write_bytes(data)
    (bad / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        load_pretrained(bad)


def test_bias_the_config_rules_out_is_refused(tmp_path):
    write_modernbert(tmp_path, masked_lm=False, attention_bias=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "attention_bias": False}))
    with pytest.raises(CheckpointError, match=r"layers.0.attn.Wqkv.bias is not accounted for"):
        load_pretrained(tmp_path)
