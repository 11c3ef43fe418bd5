"""sentence-transformers folders read whole: every Pooling mode, Dense, Normalize, prompts, do_lower_case, max length.

Each case writes a tiny random folder with sentence-transformers itself and compares
``btlib.load_pretrained(folder).encode`` with ``SentenceTransformer(folder).encode`` at fp32 tolerance.
"""

import json

import pytest
import torch
from torch import nn

pytest.importorskip("sentence_transformers")

from btlib.pretrained import CheckpointError, Pooling, SentenceHead, load_pretrained  # noqa: E402

from st_folders import TEXTS, rel, st_model, write_hf, write_st  # noqa: E402

# Pooling / SentenceHead (st_modules.py) and the folders they are read from (st_folder.py).
TESTED_HERE = ["btlib.pretrained.st_modules", "btlib.pretrained.folders.st_folder"]

PATHS = ("packed", "fastpath_nested", "fastpath", "slow")


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    return {"bert": write_hf(root / "bert", "bert"), "roberta": write_hf(root / "roberta", "roberta"),
            "bert_types": write_hf(root / "bert_types", "bert", tokenizer_class="BertTokenizer")}


def _parity(folder, paths=("packed",), **kw):
    ref = st_model(folder).encode(TEXTS, convert_to_tensor=True, **kw)
    model = load_pretrained(folder)
    for path in paths:
        assert rel(model.encode(TEXTS, path=path, **kw), ref) <= 1e-5, path
    return model


@pytest.mark.parametrize("mode", ["cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken",
                                  ("max", "cls"), ("lasttoken", "mean", "weightedmean", "max")])
def test_every_pooling_mode_matches_sentence_transformers(tmp_path, bases, mode):
    # was: every mode but cls pooled as mean (cosine 0.35 for max against sentence-transformers)
    model = _parity(write_st(tmp_path / "st", bases["bert"], pooling=mode, normalize=True, max_seq_length=12), PATHS)
    assert model.head.modules[0].modes == ((mode,) if isinstance(mode, str) else mode)


def test_legacy_pooling_keys_concatenate_in_sentence_transformers_order(tmp_path, bases):
    folder = write_st(tmp_path / "st", bases["bert"], pooling="mean")
    legacy = {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True,
              "pooling_mode_cls_token": True, "pooling_mode_lasttoken": True, "pooling_mode_weightedmean_tokens": False}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(legacy))
    model = _parity(folder)
    assert model.head.modules[0].modes == ("cls", "max", "mean", "lasttoken")


@pytest.mark.parametrize("dense, normalize", [([(8, True, nn.Tanh())], False), ([(8, False, nn.Identity())], True),
                                              ([(16, False, nn.Tanh()), (8, True, nn.Identity())], True)])
def test_dense_and_normalize(tmp_path, bases, dense, normalize):
    # was: Dense ignored (the output kept the hidden size) and mean-pooled
    model = _parity(write_st(tmp_path / "st", bases["bert"], pooling=("mean", "max"), dense=dense, normalize=normalize))
    assert model.encode(["w1"]).shape == (1, 8)
    assert model.pooling is model.head and isinstance(model.head, SentenceHead)


def test_dense_weights_from_pytorch_model_bin_and_mismatches(tmp_path, bases):
    from safetensors.torch import load_file

    folder = write_st(tmp_path / "st", bases["bert"], dense=[(8, True, nn.Tanh())])
    weights = folder / "2_Dense" / "model.safetensors"
    sd = load_file(str(weights))
    torch.save(sd, folder / "2_Dense" / "pytorch_model.bin")  # older folders: read with torch's restricted unpickler
    weights.unlink()
    _parity(folder)
    torch.save({**sd, "linear.weight": sd["linear.weight"][:4]}, folder / "2_Dense" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"2_Dense: the Dense weights do not match .*linear.weight: shape \(4, 32\)"):
        load_pretrained(folder)
    (folder / "2_Dense" / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="cannot be read safely .*convert them to model.safetensors"):
        load_pretrained(folder)


@pytest.mark.parametrize("include_prompt", [True, False])
def test_prompts_and_include_prompt(tmp_path, bases, include_prompt):
    modes = ("cls", "mean", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")  # every mode in one folder
    folder = write_st(tmp_path / "st", bases["bert"], pooling=modes, include_prompt=include_prompt, max_seq_length=9,
                      prompts={"query": "w1 W2 ", "doc": "w3 "}, default_prompt_name="doc")
    st, model = st_model(folder), load_pretrained(folder)
    for kw in ({}, {"prompt_name": "query"}, {"prompt": "w4 w5 w6 w7 w8 w9 "}, {"prompt": ""}):
        assert rel(model.encode(TEXTS, **kw), st.encode(TEXTS, convert_to_tensor=True, **kw)) <= 1e-5, kw
    assert model.prompt_length("w1 W2 ") == 3  # [CLS] w1 W2, not the trailing [SEP]
    with pytest.raises(ValueError, match="prompt_name 'nope' is not one of this model's prompts"):
        model.encode(["w1"], prompt_name="nope")
    bare = load_pretrained(bases["bert"])  # sentence-transformers' defaults: "query" and "document" are no prompt
    assert torch.equal(bare.encode(TEXTS, prompt_name="query"), bare.encode(TEXTS))


def test_do_lower_case_and_max_seq_length_from_sentence_bert_config(tmp_path, bases):
    # the tokenizer is cased (W1 and w1 are different ids); most Hub folders carry both keys in sentence_bert_config.json
    folder = write_st(tmp_path / "st", bases["bert"], sbert_config={"max_seq_length": 7, "do_lower_case": True})
    model = _parity(folder, PATHS)  # was: do_lower_case ignored (cosine 0.84 on cased text)
    assert model.tokenize(["W1 w1"]) == model.tokenize(["w1 w1"]) and model.max_length == 7
    assert max(map(len, model.tokenize(TEXTS))) == 7
    folder = write_st(tmp_path / "st2", bases["bert"], max_seq_length=5)  # 6.2 saves it as tokenizer_config's
    assert _parity(folder).max_length == 5


def test_truncate_dim_and_roberta(tmp_path, bases):
    folder = write_st(tmp_path / "st", bases["roberta"], pooling="weightedmean", normalize=True, max_seq_length=20)
    cfg = json.loads((folder / "config_sentence_transformers.json").read_text())
    (folder / "config_sentence_transformers.json").write_text(json.dumps({**cfg, "truncate_dim": 5}))
    assert _parity(folder, PATHS).encode(["w1"]).shape == (1, 5)


def test_folder_without_modules_json_is_mean_pooled_unnormalised(tmp_path, bases):
    ref = st_model(bases["bert"]).encode(TEXTS, convert_to_tensor=True)  # sentence-transformers' Transformer + mean
    model = load_pretrained(bases["bert"])
    assert model.pooling == Pooling("mean", False) and rel(model.encode(TEXTS), ref) <= 1e-5


def _edit(path, **fields):
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


@pytest.mark.parametrize("where, fields, match", [
    ("modules.json", None, r"module type 'sentence_transformers.models.LSTM' \(folder '2_LSTM'\) is not supported"),
    ("1_Pooling/config.json", {"pooling_mode": "median"}, "pooling_mode 'median' is not one of"),
    ("1_Pooling/config.json", {"pooling_mode_weird": True}, r"Pooling option\(s\) \['pooling_mode_weird'\]"),
    ("1_Pooling/config.json", {"embedding_dimension": 64}, "embedding_dimension 64 is not the Transformer's hidden size 32"),
    ("1_Pooling/config.json", {"include_prompt": "no"}, "include_prompt must be true or false"),
    ("2_Dense/config.json", {"activation_function": "mypackage.Act"}, "activation_function 'mypackage.Act' is not a torch.nn"),
    ("2_Dense/config.json", {"in_features": 16}, "in_features 16 is not the 32 features"),
    ("2_Dense/config.json", {"module_input_name": "token_embeddings"}, "module_input_name='token_embeddings'"),
    ("sentence_bert_config.json", {"transformer_task": "text-generation"}, "transformer_task='text-generation'"),
    ("sentence_bert_config.json", {"do_lower_case": "yes"}, "do_lower_case must be true or false"),
    ("sentence_bert_config.json", {"max_seq_length": 0}, "max_seq_length must be a positive integer"),
    ("sentence_bert_config.json", {"config_kwargs": {"hidden_act": "relu"}}, "config_kwargs="),
    ("config_sentence_transformers.json", {"default_prompt_name": "x"}, "default_prompt_name 'x' is not one of"),
    ("config_sentence_transformers.json", {"model_type": "SparseEncoder"}, "model_type 'SparseEncoder'"),
])
def test_what_btlib_cannot_run_is_refused_by_name(tmp_path, bases, where, fields, match):
    folder = write_st(tmp_path / "st", bases["bert"], dense=[(32, True, nn.Tanh())])
    if fields is None:
        mods = json.loads((folder / "modules.json").read_text())
        mods.insert(2, {"idx": 2, "name": "2", "path": "2_LSTM", "type": "sentence_transformers.models.LSTM"})
        (folder / "modules.json").write_text(json.dumps(mods))
    else:
        _edit(folder / where, **fields)
    with pytest.raises(CheckpointError, match=match):
        load_pretrained(folder)


def test_modules_json_order_is_checked(tmp_path, bases):
    folder = write_st(tmp_path / "st", bases["bert"], normalize=True)
    mods = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps([mods[0], mods[2], mods[1]]))
    with pytest.raises(CheckpointError, match="one Pooling right after the Transformer"):
        load_pretrained(folder)
    (folder / "modules.json").write_text(json.dumps([mods[1], mods[0]]))
    with pytest.raises(CheckpointError, match="exactly one Transformer, first"):
        load_pretrained(folder)
    (folder / "modules.json").write_text(json.dumps([mods[0], {**mods[1], "path": "../elsewhere"}]))
    with pytest.raises(CheckpointError, match="must stay inside the model folder"):
        load_pretrained(folder)


def test_transformer_in_a_subfolder(tmp_path, bases):
    import shutil

    folder = write_st(tmp_path / "st", bases["bert"], pooling="max")
    ref = st_model(folder).encode(TEXTS, convert_to_tensor=True)
    sub = folder / "0_Transformer"
    sub.mkdir()
    for f in folder.iterdir():
        if f.is_file() and f.name not in ("modules.json", "config_sentence_transformers.json", "README.md"):
            shutil.move(str(f), sub / f.name)
    mods = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps([{**mods[0], "path": "0_Transformer"}] + mods[1:]))
    assert rel(load_pretrained(folder).encode(TEXTS), ref) <= 1e-5


def test_modernbert_uses_the_same_modules(tmp_path):
    """ModernBERT's encode pools through the same SentenceHead: max + lasttoken, Dense, Normalize as s-t does."""
    import transformers as tf
    from test_modernbert import WORDS, _tokenizer, write_modernbert

    base = tmp_path / "hf"
    write_modernbert(base, masked_lm=False)
    tf.PreTrainedTokenizerFast(tokenizer_object=_tokenizer(), unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                               sep_token="[SEP]", mask_token="[MASK]").save_pretrained(base)
    folder = write_st(tmp_path / "st", base, pooling=("max", "lasttoken"), dense=[(8, True, nn.Tanh())], normalize=True)
    texts = ["w1 w2 w3", "w4", " ".join(WORDS[5 + i % 50] for i in range(40)), ""]
    ref = st_model(folder).encode(texts, convert_to_tensor=True)
    model = load_pretrained(folder)
    assert type(model).__name__ == "ModernBertEncoder" and rel(model.encode(texts, batch_size=3), ref) <= 1e-5


@pytest.mark.parametrize("include_prompt", [True, False])
def test_modernbert_takes_the_folders_prompts(tmp_path, include_prompt):
    """ModernBERT's encode applies prompts as sentence-transformers does (was: a folder with a default prompt refused)."""
    import transformers as tf
    from test_modernbert import _tokenizer, write_modernbert

    base = tmp_path / "hf"
    write_modernbert(base, masked_lm=False)
    tf.PreTrainedTokenizerFast(tokenizer_object=_tokenizer(), unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                               sep_token="[SEP]", mask_token="[MASK]").save_pretrained(base)
    folder = write_st(tmp_path / "st", base, pooling=("mean", "cls"), include_prompt=include_prompt,
                      prompts={"query": "w1 w2 ", "doc": "w3 "}, default_prompt_name="doc")
    st, model = st_model(folder), load_pretrained(folder)
    texts = ["w4 w5", "w6", ""]
    for kw in ({}, {"prompt_name": "query"}, {"prompt": "w7 w8 w9 "}, {"prompt": ""}):
        assert rel(model.encode(texts, **kw), st.encode(texts, convert_to_tensor=True, **kw)) <= 1e-5, kw
    with pytest.raises(ValueError, match="tokenize prompt \\+ text yourself"):
        model.encode([[1, 5, 2]])  # token ids cannot take the default prompt
    assert model.encode([[1, 5, 2]], prompt="").shape[0] == 1
