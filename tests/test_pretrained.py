"""Pretrained encoders: loading, the reverse, parity with Hugging Face, and bad folders."""

import json
import shutil

import pytest
import torch

from btlib.pretrained import CheckpointError, load_pretrained, to_hf_state_dict
from btlib.pretrained.reference import stored_reference, transformers_available

from model_folder import FOLDER, needs_model

# load_pretrained reads the checkpoint (checkpoint.py) into a PretrainedEncoder (model.py).
TESTED_HERE = ["btlib.pretrained.folders.checkpoint", "btlib.pretrained.model", "btlib.pretrained.architectures.bert"]  # bert.py: the BERT family behind model.py's names

needs_hf = pytest.mark.skipif(transformers_available() is not None, reason="transformers is not installed")
PATHS = ("packed", "fastpath_nested", "fastpath", "slow")


@needs_model
def test_reverse_is_the_file_bit_for_bit(model):
    from safetensors.torch import load_file

    original = load_file(str(FOLDER / "model.safetensors"))
    back = to_hf_state_dict(model)
    assert list(back) == list(original)
    for k, t in original.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k


@needs_model
@pytest.mark.parametrize("path", PATHS)
def test_every_path_matches_stored_transformers_embeddings(model, path):
    sentences, ref, meta = stored_reference()
    assert "" in sentences and max(len(s) for s in sentences) > 2000  # empty text and text beyond 256 tokens
    out = model.encode(sentences, path=path, batch_size=4)
    assert out.shape == ref.shape
    assert (out - ref).abs().max() < 1e-5


@needs_model
def test_batch_1_equals_batched_and_bf16_is_close(model):
    sentences, ref, _ = stored_reference()
    one = torch.cat([model.encode([s]) for s in sentences])
    assert (one - ref).abs().max() < 1e-5
    bf16 = model.encode(sentences, path="packed_bf16")
    assert torch.nn.functional.cosine_similarity(bf16, ref).min() > 0.999


@needs_model
def test_truncation_follows_sentence_transformers(model):
    assert model.max_length == 256  # sentence_bert_config.json, not tokenizer.json's 128 nor tokenizer_config's 512
    assert max(len(ids) for ids in model.tokenize(["word " * 1000, "short"])) == 256
    assert model.tokenize([""]) == [[101, 102]]  # [CLS] [SEP]


@needs_model
@needs_hf
def test_live_transformers_parity(model):
    from btlib.bench.pretrained import corpus
    from btlib.pretrained.reference import HFReference

    texts = corpus()[:20] + [""]
    live = HFReference(FOLDER, model.max_length).encode(texts, batch_size=8)
    for path in PATHS:
        assert (model.encode(texts, path=path, batch_size=8) - live).abs().max() < 1e-5, path
    sentences, stored, _ = stored_reference()
    assert (HFReference(FOLDER, model.max_length).encode(sentences, batch_size=4) - stored).abs().max() < 1e-6


def _write_tiny(tmp_path, arch, prefixed=False):
    """A random tiny Hugging Face checkpoint (config, safetensors, word-level tokenizer.json)."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + [f"w{i}" for i in range(40)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    common = dict(vocab_size=len(words), pad_token_id=0)
    if arch == "distilbert":
        cfg, cls = tf.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64, **common), \
            tf.DistilBertModel
    else:
        cfg = {"bert": tf.BertConfig, "roberta": tf.RobertaConfig, "xlm-roberta": tf.XLMRobertaConfig}[arch](
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
            type_vocab_size=1 if arch != "bert" else 2, **common)
        cls = {"bert": tf.BertForMaskedLM if prefixed else tf.BertModel, "roberta": tf.RobertaModel,
               "xlm-roberta": tf.XLMRobertaModel}[arch]
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    tok.save(str(tmp_path / "tokenizer.json"))
    return hf, tok


@needs_hf
@pytest.mark.parametrize("arch, prefixed", [("bert", False), ("bert", True), ("roberta", False), ("xlm-roberta", False),
                                            ("distilbert", False)])
def test_tiny_checkpoints_every_architecture(tmp_path, arch, prefixed):
    from safetensors.torch import load_file

    hf, tok = _write_tiny(tmp_path, arch, prefixed)
    model = load_pretrained(tmp_path)
    texts = ["w1 w2 w3", "w4", "w5 " * 30, ""]
    ids = model.tokenize(texts)
    T = max(map(len, ids))
    input_ids = torch.tensor([s + [0] * (T - len(s)) for s in ids])
    mask = (input_ids != 0).long()
    mask[:, 0] = 1
    with torch.inference_mode():
        base = hf.bert if prefixed else hf
        h = base(input_ids=input_ids, attention_mask=mask).last_hidden_state
    keep = mask.unsqueeze(-1).float()
    ref = (h * keep).sum(1) / keep.sum(1)
    for path in PATHS:
        assert (model.encode(texts, path=path) - ref).abs().max() < 1e-5, path
    original = load_file(str(tmp_path / "model.safetensors"))
    back = to_hf_state_dict(model)
    assert list(back) == list(original) and all(torch.equal(back[k], v) for k, v in original.items())


@needs_model
def test_bad_folders_say_what_is_wrong(tmp_path):
    bad = tmp_path / "m"
    shutil.copytree(FOLDER, bad)
    cfg = json.loads((bad / "config.json").read_text())
    with pytest.raises(CheckpointError, match="sha256"):
        load_pretrained(bad, expected_sha256="0" * 64)
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 7}))
    with pytest.raises(CheckpointError, match="missing encoder.layer.6"):
        load_pretrained(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 5}))
    with pytest.raises(CheckpointError, match="more than the 5 layers"):
        load_pretrained(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 1024}))
    with pytest.raises(CheckpointError, match=r"intermediate.dense.weight: shape \(1536, 384\), config implies \(1024, 384\)"):
        load_pretrained(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="not supported"):
        load_pretrained(bad)
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        load_pretrained(bad)
    with pytest.raises(CheckpointError, match="not a folder"):
        load_pretrained(tmp_path / "nope")


@needs_model
def test_encode_rejects_bad_calls(model):
    with pytest.raises(TypeError, match="list of texts"):
        model.encode("one string")
    with pytest.raises(ValueError, match="path must be one of"):
        model.encode(["x"], path="fast")
    # a str may hold a lone surrogate (a JSON "\\ud800" escape, bytes decoded with surrogateescape); the Rust
    # tokenizer raised a TypeError about its input type for it
    with pytest.raises(ValueError, match=r"texts\[1\] holds a lone surrogate \(U\+DC80 at character 2\).*errors='replace'"):
        model.encode(["fine", "ab\udc80 c"])
    with pytest.raises(ValueError, match=r"texts\[0\]\[0\] holds a lone surrogate"):
        model.encode([("\ud83d", "a pair")])
    assert model.encode([]).shape == (0, 384)
