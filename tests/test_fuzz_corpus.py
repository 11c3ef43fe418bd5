"""The corpus fuzzer (tests/fuzz_corpus.py) at a small budget: random corpora, edits, kills, damaged shards and edited
meta.json files (tests/corpus_damage.py), every case reading back as model.encode of the rows parsed by the rules
alone, or failing with an error naming the line (or the shard or meta.json, and that the same command mends it).

BTLIB_FUZZ_CORPUS_CASES cases (default 64, a few seconds; seeded, so `make test` runs the same cases every time). A longer run:
    python tests/fuzz_corpus.py --cases 500
"""

import os

import fuzz_corpus
from model_folder import needs_model

TESTED_HERE = ["btlib.embed", "btlib.serve.corpus"]


def test_the_rules_parser_itself():
    """The fuzzer's oracle, on the cases the rules spell out."""
    assert fuzz_corpus.parse("text", b"") == ([], None)
    assert fuzz_corpus.parse("text", b"\xef\xbb\xbf") == ([], None)
    assert fuzz_corpus.parse("text", b"\xef\xbb\xbfa\r\nb\rc\n\n") == (["a", "b\rc", ""], None)
    assert fuzz_corpus.parse("text", b"a\nb") == (["a", "b"], None)
    assert fuzz_corpus.parse("text", b"ok\n\xff\n") == (None, 2)
    assert fuzz_corpus.parse("jsonl", b'{"text": "a"}\n\n') == (None, 2)
    assert fuzz_corpus.parse("jsonl", b'{"text": "\\ud800"}\n') == (None, 1)


@needs_model
def test_random_corpora_read_back_as_encode_or_name_their_line(model):
    cases, findings = fuzz_corpus.run(int(os.environ.get("BTLIB_FUZZ_CORPUS_CASES", "64")), seed=0, model=model)
    assert findings == [], f"{len(findings)} of {cases} cases:\n" + "\n".join(findings)
