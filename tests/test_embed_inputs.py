"""python -m btlib.embed's input rules: one way to split lines, and every input error names its file and line.

A row of a text or JSON lines file ends at b"\\n"; one trailing "\\r" (a CRLF file) is dropped; a lone "\\r",
U+2028, U+0085, \\x0b or \\x0c inside a line is part of its text; a UTF-8 BOM at the start of the file is
dropped. Counting rows and reading them follow that one rule (they used to split two ways, and rows shifted).
"""

import json

import numpy as np
import pytest
import torch

from btlib.embed import count_rows, embed_file, iter_texts, main, read_embeddings
from btlib.serve import encode_by_tokens
from model_folder import needs_model

KW = dict(shard_size=4, max_batch_tokens=64, progress=False)
# a lone "\r", U+2028, NEL, \x0b, \x0c inside lines: text, not line ends
ODD = ["one\rtwo", "plain", "para\u2028graph", "next\x85line", "vertical\x0btab", "form\x0cfeed", "", "tab\tin",
       "emoji \U0001f600", "last"]


@pytest.fixture
def jobs(tmp_path, monkeypatch):
    """This test's own record of GEMM paths per job (btlib.embed.jobs_file), not the checkout's."""
    monkeypatch.setattr("btlib.embed.jobs_file", lambda: tmp_path / "jobs.json", raising=False)


def test_a_lone_cr_and_unicode_line_breaks_stay_inside_their_row(tmp_path):
    """Was: count_rows counted b"\\n" while reading split on "\\r" too, so 11 rows came back for meta.rows 10."""
    (tmp_path / "odd.txt").write_bytes("\n".join(ODD).encode() + b"\n")
    assert count_rows(tmp_path / "odd.txt") == 10
    assert [t for chunk in iter_texts(tmp_path / "odd.txt", chunk=4) for t in chunk] == ODD


def test_crlf_no_final_newline_and_a_trailing_blank_line(tmp_path):
    (tmp_path / "crlf.txt").write_bytes(b"a\r\nb\r\r\nc\r\n")
    assert [t for c in iter_texts(tmp_path / "crlf.txt") for t in c] == ["a", "b\r", "c"]  # one "\r" dropped per line
    (tmp_path / "open.txt").write_bytes(b"a\nb")
    (tmp_path / "blank.txt").write_bytes(b"a\n\n")
    (tmp_path / "empty.txt").write_bytes(b"")
    for name, rows in [("open.txt", ["a", "b"]), ("blank.txt", ["a", ""]), ("empty.txt", [])]:
        assert count_rows(tmp_path / name) == len(rows)
        assert [t for c in iter_texts(tmp_path / name) for t in c] == rows


def test_a_bom_at_the_start_is_dropped_as_utf_8_sig_does(tmp_path):
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfa\n\xef\xbb\xbfb\n")  # only the file's first three bytes are a BOM
    assert [t for c in iter_texts(tmp_path / "bom.txt") for t in c] == ["a", "\ufeffb"]
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "a"}\n')
    assert [t for c in iter_texts(tmp_path / "bom.jsonl") for t in c] == ["a"]


@needs_model
def test_odd_line_breaks_embed_as_their_rows(tmp_path, model, jobs):
    (tmp_path / "odd.txt").write_bytes("\n".join(ODD).encode())
    r = embed_file(tmp_path / "odd.txt", tmp_path / "out", **KW)
    assert (r["rows"], r["shards"]) == (10, 3)
    got = read_embeddings(tmp_path / "out")
    assert got.shape == (10, 384)
    torch.testing.assert_close(torch.from_numpy(got), model.encode(ODD), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name, data, expect", [
    ("blank.jsonl", b'{"text": "a"}\n\n{"text": "b"}\n', "blank.jsonl line 2 is blank"),
    ("spaces.jsonl", b'{"text": "a"}\n  \n', "spaces.jsonl line 2 is blank"),
    ("bad.jsonl", b'{"text": "a"}\n{"text": "b"}\n{"text": \n', "bad.jsonl line 3 is not JSON"),
    ("latin1.txt", b"ok\ncaf\xe9 au lait\n", "latin1.txt line 2 is not UTF-8 (byte 0xe9 at byte 3 of the line"),
    ("latin1.jsonl", b'{"text": "caf\xe9"}\n', "latin1.jsonl line 1 is not UTF-8"),
    ("surrogate.jsonl", b'{"text": "a"}\n{"text": "x \\ud800 y"}\n', "surrogate.jsonl line 2 holds a lone surrogate"),
    ("null.jsonl", b'{"text": "a"}\n{"text": null}\n', "null.jsonl line 2: 'text' is NoneType, not str"),
    ("list.jsonl", b'[1, 2]\n', "list.jsonl line 1: expected an object with 'text'"),
])
def test_input_errors_name_the_file_and_line_and_what_to_do(tmp_path, capsys, jobs, name, data, expect):
    """Was: json's own "line 1 column 1" for a blank line, no line for bytes that are not UTF-8, and the Rust
    tokenizer's TypeError about its input type for a lone surrogate."""
    (tmp_path / name).write_bytes(data)
    assert main([str(tmp_path / name), str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert expect in err, err
    assert not list((tmp_path / "out").glob("shard-*")), "an input error is found before any shard is written"
    if "UTF-8" in expect:
        assert "re-encode" in err and "errors='replace'" in err
    if "blank" in expect or "not JSON" in expect:
        assert "line 1 column" not in err


def test_parquet_rows_are_checked_by_row(tmp_path, capsys, jobs):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "null.parquet")
    assert main([str(tmp_path / "null.parquet"), str(tmp_path / "out"), "--quiet"]) == 2
    assert "null.parquet row 1 (0-based): 'text' is NoneType, not str" in capsys.readouterr().err


@needs_model
def test_encode_by_tokens_checks_its_texts_before_tokenizing(model):
    with pytest.raises(ValueError, match=r"texts\[1\] holds a lone surrogate"):
        encode_by_tokens(model, ["ok", "x \ud800"])
    with pytest.raises(TypeError, match=r"texts\[0\] is NoneType"):
        encode_by_tokens(model, [None])


@needs_model
def test_nul_tabs_and_long_lines_are_text(tmp_path, model, jobs):
    rows = ["nul\x00inside", "\t\t", "long " * 2000, json.dumps({"nested": "json as text"})]
    (tmp_path / "c.txt").write_bytes("\n".join(rows).encode() + b"\n")
    embed_file(tmp_path / "c.txt", tmp_path / "out", **KW)
    np.testing.assert_allclose(read_embeddings(tmp_path / "out"), model.encode(rows).numpy(), atol=1e-6, rtol=0)


def test_encode_by_tokens_counts_the_default_prompt_in_its_budget(tmp_path):
    """A folder with a default prompt: each text costs its prompt's tokens too, and no forward runs past the budget
    (was: counted with model.tokenize, which leaves the prompt out)."""
    pytest.importorskip("sentence_transformers")
    from btlib import load_pretrained
    from st_folders import write_hf, write_st

    folder = write_st(tmp_path / "st", write_hf(tmp_path / "hf", "bert"), prompts={"query": "w1 w2 w3 w4 "},
                      default_prompt_name="query")
    model, runs = load_pretrained(folder), []
    real = model.encode

    def spy(texts, **kw):
        runs.append(sum(len(e.ids) for e in model.encodings(texts)))
        return real(texts, **kw)

    texts = ["w5 w6", "W7", "w8 w9 w10"] * 4  # 4 + 3 + 5 tokens, 8 + 7 + 9 with the prompt
    model.encode = spy
    rows = encode_by_tokens(model, texts, max_batch_tokens=24)
    model.encode = real
    assert runs and max(runs) <= 24 and sum(runs) == 4 * (8 + 7 + 9), runs
    torch.testing.assert_close(rows, model.encode(texts), atol=1e-6, rtol=0)
