"""CamemBERT and ELECTRA on the BERT family's packed path, and every BERT-family model type at bf16 and int8.

Random-weight folders written by transformers itself (tests/st_folders.py: 2 layers, hidden 32, a cased word-level
tokenizer). fp32: btlib's hidden states against CamembertModel / ElectraModel's last_hidden_state, and
``encode`` (every path, pairs included) against transformers mean-pooled and SentenceTransformer.encode, within
btlib.pretrained.coverage's fp32 bound for the family. ELECTRA in both layouts: embedding_size == hidden_size (no
embeddings_project) and != (a projection, wider and narrower). bf16 and int8 for every model type the BERT
family loads: bf16 within cosine 0.999 of fp32 and at most 2x transformers' own bf16 error; int8 within
cosine 0.99 of fp32 (these folders' weights are random: the real-model figure, 0.995, is tests/test_int8.py's).
"""

import json
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from btlib import device, load_pretrained, to_hf_state_dict  # noqa: E402
from btlib.pretrained import CheckpointError  # noqa: E402
from btlib.pretrained.coverage import family  # noqa: E402
from btlib.pretrained.encoding import pack_ids  # noqa: E402

from st_folders import rel, st_model, write_hf, write_st  # noqa: E402

TESTED_HERE = ["btlib.pretrained.folders.checkpoint", "btlib.pretrained.architectures.bert"]

TEXTS = ["w1 w2 w3", "W4", "w5 W6 " * 20, "", "W1 w2 W3 w4 W5 w6"]
PAIRS = [("w1 W2", "w3 w4 w5"), ("W1 " * 30, "w2 w3"), ("", "w4"), "w8 single text"]
PATHS = ("packed", "fastpath_nested", "fastpath", "slow")
# (model type, config fields over st_folders' defaults, tokenizer_class): ELECTRA's tokenizer is BertTokenizer,
# which hands token types to the model
VARIANTS = {
    "camembert": ("camembert", {}, None),
    "electra-same-width": ("electra", {"embedding_size": 32}, "BertTokenizer"),
    "electra-narrow-embeddings": ("electra", {"embedding_size": 16}, "BertTokenizer"),
    "electra-wide-embeddings": ("electra", {"embedding_size": 48}, None),
}


def _reference(folder, texts, max_length):
    """transformers' (AutoTokenizer + AutoModel) last_hidden_state on the real tokens (total, d), mean-pooled (N, d),
    and the tokenizer's encoding."""
    import transformers as tf

    tok, hf = tf.AutoTokenizer.from_pretrained(str(folder)), tf.AutoModel.from_pretrained(str(folder)).eval()
    enc = tok([t if isinstance(t, str) else tuple(t) for t in texts], padding=True, truncation=True,
              max_length=max_length, return_tensors="pt")
    with torch.inference_mode():
        h = hf(**enc).last_hidden_state
    keep = enc["attention_mask"].bool()
    mean = (h * keep.unsqueeze(-1)).sum(1) / keep.sum(1, keepdim=True)
    return h[keep], mean, enc


@pytest.mark.parametrize("variant", VARIANTS)
def test_camembert_and_electra_match_transformers_and_sentence_transformers(tmp_path, variant):
    arch, config, tokenizer_class = VARIANTS[variant]
    tol = family(arch).fp32_tol
    base = write_hf(tmp_path / "hf", arch, tokenizer_class=tokenizer_class, **config)
    hf_keys = set(json.loads((base / "config.json").read_text()))
    assert arch != "electra" or "embedding_size" in hf_keys
    folder = write_st(tmp_path / "st", base, max_seq_length=16)
    model = load_pretrained(folder)
    assert model.spec.model_type == arch and (model.embeddings.project is not None) == (config.get("embedding_size", 32) != 32)
    states, mean, enc = _reference(folder, TEXTS, 16)
    ids = model.tokenize(TEXTS)
    assert [len(s) for s in ids] == enc["attention_mask"].sum(1).tolist()
    with torch.inference_mode():
        ours = model.packed_encoder().forward_packed(*model._packed_inputs(ids))
    assert rel(ours, states) <= tol, "hidden states"
    for path in PATHS:
        assert rel(model.encode(TEXTS, path=path, batch_size=2), mean) <= tol, path
    assert rel(model.encode(TEXTS), st_model(folder).encode(TEXTS, convert_to_tensor=True)) <= tol

    _, pair_mean, pair_enc = _reference(folder, PAIRS, 16)
    assert model.token_types == ("token_type_ids" in pair_enc)  # ELECTRA's BertTokenizer yes, CamemBERT's no
    if model.token_types:
        assert pair_enc["token_type_ids"].max() == 1
    for path in PATHS:
        assert rel(model.encode(PAIRS, path=path), pair_mean) <= tol, f"pairs, {path}"
    assert rel(model.encode(PAIRS), st_model(folder).encode(PAIRS, convert_to_tensor=True)) <= tol

    from safetensors.torch import load_file

    original = load_file(str(base / "model.safetensors"))
    back = to_hf_state_dict(model)
    assert list(back) == list(original) and all(torch.equal(back[k], v) for k, v in original.items())


def test_electra_projection_must_match_the_config(tmp_path):
    folder = write_hf(tmp_path / "hf", "electra", embedding_size=16)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "embedding_size": 32}))  # no projection then, tables of 16
    with pytest.raises(CheckpointError, match=r"word_embeddings.weight: shape \(\d+, 16\), config implies \(\d+, 32\)"):
        load_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "embedding_size": 0}))
    with pytest.raises(CheckpointError, match="embedding_size must be a positive integer"):
        load_pretrained(folder)
    cfg.pop("embedding_size")  # transformers' default, 128, then applies: the file's tables are 16 wide
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config implies \(\d+, 128\)"):
        load_pretrained(folder)


# every model type the BERT family loads, at the precisions btlib offers it
LOW = {"bert": ("bert", {}, "BertTokenizer"), "roberta": ("roberta", {}, None), "xlm-roberta": ("xlm-roberta", {}, None),
       "distilbert": ("distilbert", {}, None), **VARIANTS}


def _hf_bf16_error(folder, ids, ref):
    """transformers' own model run in bf16 on the same ids: its hidden states' error against fp32 ``ref``."""
    import transformers as tf

    hf = tf.AutoModel.from_pretrained(str(folder)).eval().to(torch.bfloat16)
    T = max(map(len, ids))
    pad = hf.config.pad_token_id or 0
    input_ids = torch.tensor([s + [pad] * (T - len(s)) for s in ids])
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in ids])
    with torch.inference_mode():
        h = hf(input_ids=input_ids, attention_mask=mask).last_hidden_state[mask.bool()].float()
    return rel(h, ref)


@pytest.mark.parametrize("variant", LOW)
def test_bf16_and_int8_track_fp32(tmp_path, variant):
    arch, config, tokenizer_class = LOW[variant]
    folder = write_hf(tmp_path / "hf", arch, tokenizer_class=tokenizer_class, **config)
    model = load_pretrained(folder)
    ids = model.tokenize(TEXTS)
    packed = pack_ids(ids)
    with torch.inference_mode():
        ref = model._forward_packed(packed, model.runner("fp32"))  # (total, d)
        bf16 = model._forward_packed(packed, model.runner("bf16")).float()
    theirs = _hf_bf16_error(folder, ids, ref)
    cos = F.cosine_similarity(bf16, ref).min()
    assert rel(bf16, ref) <= 2 * theirs and cos > 0.999, f"bf16 {rel(bf16, ref):.2e} (transformers {theirs:.2e}), cos {cos:.5f}"
    fp32 = model.encode(TEXTS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", device.SlowPrecisionWarning)  # accuracy is checked on every CPU
        assert F.cosine_similarity(model.encode(TEXTS, precision="bf16"), fp32).min() > 0.999
        q8 = model.encode(TEXTS, precision="int8")
    assert F.cosine_similarity(q8, fp32).min() >= 0.99
