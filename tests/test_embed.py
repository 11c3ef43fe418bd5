"""python -m btlib.embed: shards equal encode, inputs in three formats, and a killed run resumes to the same bits."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from btlib.embed import embed_file, main, read_embeddings
from btlib.gemm import forcing
from btlib.serve import encode_by_tokens
from model_folder import needs_model

pytestmark = needs_model

WORDS = "packed tokens cost only their real tokens while padding pays for the longest text in every batch".split()
TEXTS = [" ".join(WORDS[(i * 5) % len(WORDS):][: 1 + (i * 7) % 17]) for i in range(58)]
TEXTS[3] = ""  # an empty line is a row too


@pytest.fixture(scope="module", autouse=True)
def jobs(tmp_path_factory):
    """This module's own record of GEMM paths per job (btlib.embed.jobs_file), not the checkout's."""
    path = tmp_path_factory.mktemp("jobs") / "jobs.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("btlib.embed.jobs_file", lambda: path)
        yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    (d / "texts.txt").write_text("\n".join(TEXTS) + "\n")
    return d


@pytest.fixture(scope="module")
def uninterrupted(corpus):
    r = embed_file(corpus / "texts.txt", corpus / "full", shard_size=16, max_batch_tokens=96, progress=False)
    assert (r["rows"], r["shards"], r["written"], r["skipped"]) == (58, 4, 4, 0)
    return read_embeddings(corpus / "full")


def test_shards_are_encode_by_tokens_of_their_rows(corpus, uninterrupted, model):
    gemm = json.loads((corpus / "full" / "meta.json").read_text())["gemm"]  # the run's one GEMM path
    with forcing(gemm):
        ref = torch.cat([encode_by_tokens(model, TEXTS[i:i + 16], max_batch_tokens=96) for i in range(0, 58, 16)])
    assert uninterrupted.shape == (58, 384) and torch.equal(torch.from_numpy(uninterrupted), ref)
    torch.testing.assert_close(torch.from_numpy(uninterrupted), model.encode(TEXTS), atol=1e-6, rtol=0)


def test_encode_by_tokens_keeps_input_order_and_budget(model):
    texts = ["a b c d e f g h", "x", "", "one two three"]
    torch.testing.assert_close(encode_by_tokens(model, texts, max_batch_tokens=4), model.encode(texts), atol=1e-6, rtol=0)
    assert encode_by_tokens(model, []).shape == (0, 384)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        encode_by_tokens(model, texts, max_batch_tokens=0)


def test_interrupted_run_resumes_to_the_same_bits(corpus, uninterrupted):
    out = corpus / "interrupted"

    def stop_after_first(k):
        if k == 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        embed_file(corpus / "texts.txt", out, shard_size=16, max_batch_tokens=96, progress=False, on_shard=stop_after_first)
    assert [p.name[:11] for p in out.glob("shard-*")] == ["shard-00000"]
    with pytest.raises(FileNotFoundError, match="lacks 3 of 4 shards"):
        read_embeddings(out)
    r = embed_file(corpus / "texts.txt", out, shard_size=16, max_batch_tokens=96, progress=False)
    assert (r["written"], r["skipped"]) == (3, 1)
    assert np.array_equal(read_embeddings(out), uninterrupted)


def test_killed_process_resumes_to_the_same_bits(tmp_path, model):
    """SIGKILL once the first shard is on disk (a half-written temporary file may stay), then run the command again."""
    texts = [f"{TEXTS[i % 58]} {i}" for i in range(120)]
    (tmp_path / "c.txt").write_text("\n".join(texts) + "\n")
    cmd = [sys.executable, "-m", "btlib.embed", str(tmp_path / "c.txt"), str(tmp_path / "out"), "--shard-size", "8", "--quiet"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not list((tmp_path / "out").glob("shard-00000-*.npy")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list((tmp_path / "out").glob("shard-*.npy")))
    assert 1 <= done < 15, f"{done} of 15 shards at the kill: the test needs the run stopped mid-way"
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["threads"] == 1  # the killed run's
    assert main([str(tmp_path / "c.txt"), str(tmp_path / "out"), "--shard-size", "8", "--quiet"]) == 0  # resumed here
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference: the same command uninterrupted, at the first run's thread count
    # and on the first run's GEMM path: this process's measured choice may differ from the killed one's where two
    # paths run within noise of each other (they round the last bits differently)
    first = json.loads((tmp_path / "out" / "meta.json").read_text())["gemm"]
    try:
        with forcing(first):
            assert main([str(tmp_path / "c.txt"), str(tmp_path / "ref"), "--shard-size", "8", "--quiet"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "ref" / "meta.json").read_text())["gemm"] == first
    assert not list((tmp_path / "out").glob(".shard-*"))
    assert np.array_equal(read_embeddings(tmp_path / "out"), read_embeddings(tmp_path / "ref"))


def test_jsonl_and_parquet_give_the_text_file_result(corpus, uninterrupted):
    (corpus / "rows.jsonl").write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(TEXTS)))
    embed_file(corpus / "rows.jsonl", corpus / "from_jsonl", column="body", shard_size=16, max_batch_tokens=96, progress=False)
    assert np.array_equal(read_embeddings(corpus / "from_jsonl"), uninterrupted)
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"text": TEXTS}), corpus / "rows.parquet", row_group_size=10)
    embed_file(corpus / "rows.parquet", corpus / "from_parquet", shard_size=16, max_batch_tokens=96, progress=False)
    assert np.array_equal(read_embeddings(corpus / "from_parquet"), uninterrupted)


def test_changed_settings_and_bad_inputs_are_errors(corpus, uninterrupted, capsys):
    with pytest.raises(ValueError, match="other settings.*shard_size"):
        embed_file(corpus / "texts.txt", corpus / "full", shard_size=8, max_batch_tokens=96, progress=False)
    (corpus / "bad.jsonl").write_text('{"text": "a"}\n{"other": 1}\n')
    assert main([str(corpus / "bad.jsonl"), str(corpus / "bad_out"), "--quiet"]) == 2
    assert "line 2: expected an object with 'text'" in capsys.readouterr().err
    (corpus / "null.jsonl").write_text('{"text": "a"}\n{"text": null}\n')
    assert main([str(corpus / "null.jsonl"), str(corpus / "null_out"), "--quiet"]) == 2
    assert "null.jsonl line 2: 'text' is NoneType, not str" in capsys.readouterr().err
    with pytest.raises(ValueError, match="shard_size"):
        embed_file(corpus / "texts.txt", corpus / "x", shard_size=0)


@pytest.mark.parametrize("first, then", [("onednn", "torch"), ("torch", "onednn")])
def test_a_resumed_run_keeps_the_first_runs_gemm_path(tmp_path, corpus, monkeypatch, first, then):
    """The measured GEMM choice can differ between processes (thread count, load): a resumed run takes the path its
    first run recorded in meta.json, so it equals an uninterrupted run on that path bit for bit (was: mixed paths)."""
    def stop_after_first(k):
        if k == 0:
            raise KeyboardInterrupt

    kw = dict(shard_size=16, max_batch_tokens=96, progress=False)
    monkeypatch.setattr("btlib.embed.jobs_file", lambda: tmp_path / "jobs.json")  # a job no test has run yet
    monkeypatch.setenv("BTLIB_GEMM", first)
    embed_file(corpus / "texts.txt", tmp_path / "ref", **kw)
    with pytest.raises(KeyboardInterrupt):
        embed_file(corpus / "texts.txt", tmp_path / "out", **kw, on_shard=stop_after_first)
    monkeypatch.setenv("BTLIB_GEMM", then)  # the process that resumes would pick another path
    assert embed_file(corpus / "texts.txt", tmp_path / "out", **kw)["written"] == 3
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["gemm"] == first
    assert np.array_equal(read_embeddings(tmp_path / "out"), read_embeddings(tmp_path / "ref"))
