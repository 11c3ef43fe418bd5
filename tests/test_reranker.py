"""btlib.load_reranker: cross-encoder folders score pairs as transformers' *ForSequenceClassification and CrossEncoder.

Random-weight folders written by transformers (tests/st_folders.py: 2 layers, hidden 32, a cased word-level tokenizer
with model_max_length 24, so that a long pair is truncated longest-first), one per head (BERT's pooler + classifier;
RoBERTa, XLM-R and CamemBERT's classifier.dense + out_proj; ELECTRA's, with GELU; DistilBERT's pre_classifier), with
num_labels 1 and 3. Logits within btlib.pretrained.coverage's fp32 bound of transformers' (padded batch, the
tokenizer's own token types), at batch 1 and batched; predict's default activation and rank as sentence-transformers
6.2's CrossEncoder; bf16 at most 2x transformers' own bf16 error, int8 within cosine 0.99 of the fp32 logits;
bad calls raise ValueError saying what to pass.
"""

import json
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from btlib import device, hardware, load_reranker  # noqa: E402
from btlib.pretrained import CheckpointError  # noqa: E402
from btlib.pretrained.coverage import family  # noqa: E402

from st_folders import rel, write_hf  # noqa: E402

TESTED_HERE = ["btlib.pretrained.architectures.reranker"]

TOL = family("cross-encoder heads").fp32_tol
MAX_LENGTH = 24
PAIRS = [("w1 W2 w3", "w4 w5"), ("w1 " * 30, "w2 w3 w4"), ("W5 w6", "W1 w2 " * 15), ("", "w7"), ["w8 w9 W10", "w11"]]
# head -> (model type, transformers class name, tokenizer_class: BERT's and ELECTRA's hand token types to the model)
HEADS = {"bert": ("bert", "BertForSequenceClassification", "BertTokenizer"),
         "roberta": ("roberta", "RobertaForSequenceClassification", None),
         "xlm-roberta": ("xlm-roberta", "XLMRobertaForSequenceClassification", None),
         "camembert": ("camembert", "CamembertForSequenceClassification", None),
         "electra": ("electra", "ElectraForSequenceClassification", "BertTokenizer"),
         "distilbert": ("distilbert", "DistilBertForSequenceClassification", None)}


def _folder(path, head, num_labels, **config):
    import transformers as tf

    arch, cls, tokenizer_class = HEADS[head]
    folder = write_hf(path, arch, tokenizer_class=tokenizer_class, model_cls=getattr(tf, cls), num_labels=num_labels,
                      **config)
    cfg_path = folder / "tokenizer_config.json"
    # do_lower_case false: transformers 5.23's BertTokenizer rebuilds its normalizer from it (default: true), and
    # this tokenizer.json is cased, as the Hub's cased folders say in both files
    cased = {"do_lower_case": False} if tokenizer_class == "BertTokenizer" else {}
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "model_max_length": MAX_LENGTH, **cased}))
    return folder


def _logits(folder, pairs, dtype=torch.float32):
    """transformers' AutoTokenizer (padding, truncation=True) + AutoModelForSequenceClassification: (N, num_labels)."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(folder))
    hf = tf.AutoModelForSequenceClassification.from_pretrained(str(folder)).eval().to(dtype)
    enc = tok([tuple(p) for p in pairs], padding=True, truncation=True, return_tensors="pt")
    with torch.inference_mode():
        return hf(**enc).logits.float(), enc


@pytest.mark.parametrize("num_labels", [1, 3])
@pytest.mark.parametrize("head", HEADS)
def test_logits_match_transformers(tmp_path, head, num_labels):
    folder = _folder(tmp_path / "m", head, num_labels)
    reranker = load_reranker(folder)
    ref, enc = _logits(folder, PAIRS)
    assert enc["attention_mask"].sum(1).max() == MAX_LENGTH  # the long pairs were truncated
    assert [len(s) for s in reranker.encoder.tokenize(PAIRS)] == enc["attention_mask"].sum(1).tolist()
    assert reranker.encoder.token_types == ("token_type_ids" in enc) == (HEADS[head][2] is not None)
    logits = reranker.predict(PAIRS, activation="identity", batch_size=2)
    assert logits.shape == ((len(PAIRS),) if num_labels == 1 else (len(PAIRS), num_labels))
    assert rel(logits.reshape(ref.shape), ref) <= TOL
    one = torch.stack([reranker.predict([p], activation="identity", batch_size=1) for p in PAIRS]).reshape(ref.shape)
    assert rel(one, ref) <= TOL  # batch 1: each pair alone

    default = reranker.predict(PAIRS)  # CrossEncoder's default: sigmoid for one label, the logits for more
    assert torch.allclose(default, logits.sigmoid() if num_labels == 1 else logits)
    if num_labels > 1:
        assert torch.allclose(reranker.predict(PAIRS, activation="softmax"), logits.softmax(-1))
    else:
        with pytest.raises(ValueError, match="'softmax' over one label"):
            reranker.predict(PAIRS, activation="softmax")


@pytest.mark.parametrize("head", ["bert", "xlm-roberta"])
def test_predict_and_rank_match_sentence_transformers_cross_encoder(tmp_path, head):
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import CrossEncoder

    folder = _folder(tmp_path / "m", head, 1)
    reranker, ce = load_reranker(folder), CrossEncoder(str(folder), device="cpu")
    assert rel(reranker.predict(PAIRS), ce.predict([tuple(p) for p in PAIRS], convert_to_tensor=True)) <= TOL
    docs = ["w4 w5", "w2 w3 w4 " * 10, "W1", "w7 w8", "w9"]
    ours = reranker.rank("w1 W2", docs, top_k=3)
    theirs = ce.rank("w1 W2", docs, top_k=3)
    assert [i for i, _ in ours] == [r["corpus_id"] for r in theirs]
    assert all(abs(s - r["score"]) <= TOL for (_, s), r in zip(ours, theirs))
    scores = reranker.predict([("w1 W2", d) for d in docs])
    assert [i for i, _ in reranker.rank("w1 W2", docs)] == sorted(range(5), key=lambda i: -scores[i])

    # config.json naming the activation, as CrossEncoder.save writes it: its default follows
    cfg = json.loads((folder / "config.json").read_text())
    cfg["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (folder / "config.json").write_text(json.dumps(cfg))
    ce = CrossEncoder(str(folder), device="cpu")
    assert rel(load_reranker(folder).predict(PAIRS), ce.predict([tuple(p) for p in PAIRS], convert_to_tensor=True)) <= TOL
    cfg["sentence_transformers"] = {"activation_fn": "my_package.Scale"}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="activation_fn 'my_package.Scale' is not one btlib reproduces"):
        load_reranker(folder)


@pytest.mark.parametrize("head", ["bert", "roberta"])
def test_bf16_and_int8_track_fp32(tmp_path, head):
    folder = _folder(tmp_path / "m", head, 3)
    reranker = load_reranker(folder)
    fp32 = reranker.predict(PAIRS, activation="identity")
    theirs = rel(_logits(folder, PAIRS, torch.bfloat16)[0], fp32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", device.SlowPrecisionWarning)  # accuracy is checked on every CPU
        bf16 = reranker.predict(PAIRS, activation="identity", precision="bf16")
        q8 = reranker.predict(PAIRS, activation="identity", precision="int8")
    assert rel(bf16, fp32) <= 2 * theirs, f"bf16 {rel(bf16, fp32):.2e}, transformers' own bf16 {theirs:.2e}"
    assert F.cosine_similarity(q8.flatten(), fp32.flatten(), dim=0) >= 0.99


def test_bf16_warning_names_predict_and_its_caller(tmp_path, monkeypatch, fresh_warnings):
    reranker = load_reranker(_folder(tmp_path / "m", "bert", 1))
    monkeypatch.setenv("BTLIB_ASSUME_NO_BF16", "1")
    monkeypatch.setattr(hardware, "_memo", {})
    with pytest.warns(device.SlowPrecisionWarning, match="Reranker.predict in bf16: bf16 is not native") as got:
        reranker.predict(PAIRS, precision="bf16")
    assert len(got) == 1 and got[0].filename == __file__


def test_bad_calls_say_what_to_pass(tmp_path):
    reranker = load_reranker(_folder(tmp_path / "m", "bert", 1))
    for bad, match in [("a query", "got str"), ([], "got an empty list"), (["query", "document"], r"wrap it in a list"),
                       ([("q", 1)], r"pairs\[0\] is tuple"), ([("a", "b", "c")], r"pairs\[0\] is tuple"),
                       ([("a", "b"), "c"], r"pairs\[1\] is str"), (None, "got NoneType")]:
        with pytest.raises(ValueError, match=f"list of \\(query, document\\) pairs.*{match}"):
            reranker.predict(bad)
    with pytest.raises(ValueError, match=r"pairs\[1\]\[1\] holds a lone surrogate \(U\+DC00 at character 0\)"):
        reranker.predict([("a", "b"), ("q", "\udc00 doc")])
    with pytest.raises(ValueError, match=r"pairs\[0\]\[0\] holds a lone surrogate"):
        reranker.rank("q\ud800", ["d"])
    for kw, match in [({"activation": "relu"}, "activation must be None"), ({"batch_size": 0}, "batch_size"),
                      ({"precision": "fp16"}, "precision must be")]:
        with pytest.raises(ValueError, match=match):
            reranker.predict([("a", "b")], **kw)
    for args, kw, match in [((1, ["d"]), {}, "query as a str"), (("q", []), {}, "non-empty list of str"),
                            (("q", "doc"), {}, "non-empty list of str"), (("q", ["d", 2]), {}, "non-empty list of str"),
                            (("q", ["d"]), {"top_k": 0}, "top_k must be None or a positive int")]:
        with pytest.raises(ValueError, match=match):
            reranker.rank(*args, **kw)
    with pytest.raises(ValueError, match="num_labels 3"):
        load_reranker(_folder(tmp_path / "m3", "bert", 3)).rank("q", ["d"])


def test_folders_that_are_not_cross_encoders_are_refused(tmp_path):
    base = write_hf(tmp_path / "base", "bert")
    with pytest.raises(CheckpointError, match=r"is not a cross-encoder btlib loads .*use btlib.load_pretrained"):
        load_reranker(base)
    folder = _folder(tmp_path / "m", "bert", 3)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "id2label": {"0": "a", "1": "b"}}))
    with pytest.raises(CheckpointError, match=r"classifier.weight: shape \(3, 32\), config implies \(2, 32\)"):
        load_reranker(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "roberta"}))
    with pytest.raises(CheckpointError, match="BertForSequenceClassification with model_type 'roberta'"):
        load_reranker(folder)
    with pytest.raises(CheckpointError, match="not a folder"):
        load_reranker(tmp_path / "nope")
