"""POST /rerank (TEI's API) on a reranker server: answers equal Reranker.rank, the batcher's limits, 424 across model kinds.

A random-weight BertForSequenceClassification folder written by transformers (tests/st_folders.py: 2 layers, hidden 32,
a cased word-level tokenizer, model_max_length 24 so a long pair overflows). One request at a time is its own batch,
so its scores equal ``rank(query, texts, activation="sigmoid")`` (TEI's raw_scores false) or ``"identity"`` (true)
bit for bit; pairs of several requests share one forward, as texts do; the queue, 429, 413, 422 and the API key
are the embedding routes'; ``python -m btlib.serve --model FOLDER`` detects the cross-encoder and serves it.
"""

import json
import re
import signal
import threading
import time

import pytest
import torch

from btlib import load_reranker
from btlib.serve import BatchEncoder, Overloaded
from btlib.serve.rerank import PairScorer, is_reranker_folder, rank_scores
from btlib.serve.remote import http_missing

pytestmark = pytest.mark.skipif(http_missing() is not None, reason=str(http_missing()))
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from st_folders import write_hf  # noqa: E402
from serve_helpers import client_of, running_app  # noqa: E402

QUERY = "w1 W2 w3"
TEXTS = ["w4 w5", "w1 w2 w3 " * 2, "W1", "", "w7 w8 W9", "w1 " * 30]  # the last one overflows 24 tokens with the query


def _reranker_folder(path, num_labels=1):
    import transformers as tf

    folder = write_hf(path, "bert", tokenizer_class="BertTokenizer", model_cls=tf.BertForSequenceClassification,
                      num_labels=num_labels)
    cfg_path = folder / "tokenizer_config.json"  # cased, 24 tokens at most: as tests/test_reranker.py's folders
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "model_max_length": 24, "do_lower_case": False}))
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return _reranker_folder(tmp_path_factory.mktemp("rerank") / "ce")


@pytest.fixture(scope="module")
def reranker(folder):
    return load_reranker(folder)


@pytest.fixture(scope="module")
def server(reranker):
    with running_app(PairScorer(reranker), max_inputs=8, auto_truncate=True) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with client_of(server) as c:
        yield c


def test_rerank_equals_rank_raw_and_sigmoid(client, server, reranker):
    r = client.post("/rerank", json={"query": QUERY, "texts": TEXTS})
    assert r.status_code == 200, r.text
    sigmoid = r.json()
    assert [(d["index"], d["score"]) for d in sigmoid] == reranker.rank(QUERY, TEXTS, activation="sigmoid")
    assert all("text" not in d for d in sigmoid) and sorted(d["index"] for d in sigmoid) == list(range(len(TEXTS)))
    r = client.post("/rerank", json={"query": QUERY, "texts": TEXTS, "raw_scores": True, "return_text": True})
    raw = r.json()
    assert [(d["index"], d["score"]) for d in raw] == reranker.rank(QUERY, TEXTS, activation="identity")
    assert [d["text"] for d in raw] == [TEXTS[d["index"]] for d in raw]
    assert torch.allclose(torch.tensor([d["score"] for d in raw]).sigmoid(), torch.tensor([d["score"] for d in sigmoid]))

    from btlib.serve.client import HttpEncoder

    with HttpEncoder(server.url) as http:
        assert http.rerank(QUERY, TEXTS) == reranker.rank(QUERY, TEXTS, activation="sigmoid")
        assert http.rerank("W5", ["w6"], raw_scores=True) == reranker.rank("W5", ["w6"], activation="identity")
        with pytest.raises(RuntimeError, match=r"/rerank answered 413"):
            http.rerank(QUERY, ["w1"] * 9)
        with pytest.raises(TypeError, match="list of str texts"):
            http.rerank(QUERY, "w1")


@pytest.mark.parametrize("body, status, match", [
    ({"query": QUERY, "texts": ["w1"] * 9}, 413, "9 texts exceed this server's limit of 8"),
    ({"query": QUERY, "texts": ["w1 " * 30], "truncate": False}, 413, r"\(query, text\) pair 0 has more than 24 tokens"),
    ({"query": QUERY, "texts": []}, 422, "texts must not be empty"),
    ({"texts": ["w1"]}, 422, "query: Field required"),
    ({"query": QUERY, "texts": "w1"}, 422, "texts: Input should be a valid list"),
    ({"query": QUERY, "texts": [1, 2]}, 422, "texts.0"),
    ({"query": QUERY, "texts": ["w1"], "truncation_direction": "left"}, 422, "truncates the end of a text only"),
])
def test_rerank_errors_say_what_is_wrong(client, body, status, match):
    r = client.post("/rerank", json=body)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error", "error_type"}
    assert re.search(match, r.json()["error"]), r.json()


@pytest.mark.parametrize("raw, match", [
    (b'{"query": "q\\ud800", "texts": ["w1"]}', r"^query holds a lone surrogate \(U\+D800 at character 1\)"),
    (b'{"query": "q", "texts": ["w1", "\\udfff"]}', r"^texts\[1\] holds a lone surrogate \(U\+DFFF at character 0\)"),
])
def test_rerank_names_the_field_that_is_not_unicode(client, raw, match):
    """A JSON "\\ud800" escape decodes to a str no tokenizer takes: a 422 naming the request's own field."""
    r = client.post("/rerank", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422 and re.search(match, r.json()["error"]), r.text


def test_reranker_server_refuses_embeddings_and_embedding_server_refuses_rerank(client, tmp_path):
    r = client.post("/embed", json={"inputs": "w1"})
    assert r.status_code == 424 and "holds a reranker" in r.json()["error"] and "POST /rerank" in r.json()["error"]
    r = client.post("/v1/embeddings", json={"input": "w1"})
    assert r.status_code == 424 and "holds a reranker" in r.json()["error"]["message"]

    from btlib.pretrained import load_pretrained
    from btlib.serve.app import create_app, start_server

    running = start_server(create_app(BatchEncoder(load_pretrained(write_hf(tmp_path / "emb", "bert")))))
    try:
        with httpx.Client(base_url=running.url, timeout=60) as c:
            r = c.post("/rerank", json={"query": "w1", "texts": ["w2"]})
            assert r.status_code == 424 and "not a reranker" in r.json()["error"]
            assert "*ForSequenceClassification folder" in r.json()["error"]
            assert c.post("/embed", json={"inputs": "w1"}).status_code == 200
    finally:
        running.stop()


def test_pairs_of_several_requests_share_one_forward(reranker):
    """The batcher knows no pairs: three requests within max_wait form one batch = predict of all their pairs."""
    from test_serve_batcher import Recorder

    rec = Recorder(PairScorer(reranker))
    requests = [[(QUERY, t) for t in TEXTS[:2]], [("W5", "w6")], [(QUERY, t) for t in TEXTS[2:]]]
    with BatchEncoder(rec, max_batch_tokens=10_000, max_wait_ms=500) as b:
        out = [f.result(30) for f in [b.submit(r) for r in requests]]
    pairs = [p for r in requests for p in r]
    assert rec.calls == [pairs]
    assert torch.equal(torch.cat(out), reranker.predict(pairs, batch_size=len(pairs), activation="identity").unsqueeze(-1))
    assert [o.shape for o in out] == [(2, 1), (1, 1), (4, 1)]
    assert b.snapshot()["texts"] == 7 and b.snapshot()["tokens"] == sum(len(ids) for ids in reranker.encoder.tokenize(pairs))
    # batched with others, a request's scores equal its own rank's to fp32 rounding (the GEMM's rows: batcher docstring)
    ours, alone = rank_scores(out[2], raw_scores=False), reranker.rank(QUERY, TEXTS[2:], activation="sigmoid")
    assert [i for i, _ in ours] == [i for i, _ in alone] and max(abs(a - b) for (_, a), (_, b) in zip(ours, alone)) <= 1e-6


def test_rerank_overload_answers_429_and_the_api_key_holds(reranker):
    """A gated scorer holds the worker; the queue (4 pairs) fills; the next /rerank gets 429 (Overloaded in the client)."""
    from btlib.serve.app import create_app, start_server
    from btlib.serve.client import HttpEncoder
    from test_serve_batcher import Recorder

    gate = threading.Event()
    rec = Recorder(PairScorer(reranker), gate)
    running = start_server(create_app(BatchEncoder(rec, max_queue=4, max_wait_ms=0), api_key="s3cret", max_inputs=4))
    auth = {"Authorization": "Bearer s3cret"}
    try:
        with httpx.Client(base_url=running.url, timeout=60) as c, HttpEncoder(running.url, api_key="s3cret") as http:
            assert c.post("/rerank", json={"query": "q", "texts": ["w1"]}).status_code == 401
            results = []
            threads = [threading.Thread(target=lambda t=t: results.append(
                c.post("/rerank", json={"query": "q", "texts": t}, headers=auth))) for t in (["held"], ["a", "b"], ["c", "d"])]
            threads[0].start()
            assert rec.started.wait(30)
            for t in threads[1:]:
                t.start()
            deadline = time.monotonic() + 30
            while "btlib_serve_queue_texts 4" not in c.get("/metrics", headers=auth).text and time.monotonic() < deadline:
                time.sleep(0.02)
            r = c.post("/rerank", json={"query": "q", "texts": ["one too many"]}, headers=auth)
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1 and r.json()["error_type"] == "overloaded"
            with pytest.raises(Overloaded, match="queue full"):
                http.rerank("q", ["one too many"])
            gate.set()
            for t in threads:
                t.join(60)
            assert sorted(r.status_code for r in results) == [200] * 3
    finally:
        gate.set()
        running.stop()


def test_multi_label_models_and_folder_detection(folder, tmp_path):
    with pytest.raises(ValueError, match="num_labels 3"):
        PairScorer(load_reranker(_reranker_folder(tmp_path / "three", num_labels=3)))
    assert is_reranker_folder(folder) and not is_reranker_folder(write_hf(tmp_path / "base", "bert"))
    assert not is_reranker_folder(tmp_path / "nowhere")


@pytest.mark.slow
def test_python_m_btlib_serve_serves_a_reranker_folder(folder, reranker):
    """The server process detects the cross-encoder; its scores equal rank's (another process: 1e-6); SIGTERM stops it."""
    from btlib.serve.remote import ServerProcess

    with ServerProcess(model=folder, threads=1) as server:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            ranks = c.post("/rerank", json={"query": QUERY, "texts": TEXTS}).json()
            assert c.post("/embed", json={"inputs": "w1"}).status_code == 424
        proc = server.proc
        ref = reranker.rank(QUERY, TEXTS, activation="sigmoid")
        assert [d["index"] for d in ranks] == [i for i, _ in ref]
        assert max(abs(d["score"] - s) for d, (_, s) in zip(ranks, ref)) <= 1e-6
    assert proc.returncode in (0, -signal.SIGTERM)
