"""The HTTP endpoint on a loopback port: OpenAI and TEI routes against model.encode, the official openai client, errors, shutdown."""

import base64
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from btlib.serve import BatchEncoder
from btlib.serve.extras import missing
from model_folder import needs_model
from serve_helpers import client_of, running_app

pytestmark = [needs_model, pytest.mark.skipif(missing("fastapi", "serve") is not None, reason=str(missing("fastapi", "serve")))]

httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def server(model):
    with running_app(model, max_inputs=8) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with client_of(server) as c:
        yield c


def test_openai_route_float_and_base64_equal_encode(client, model):
    """One request at a time: each is its own batch, so the answer is model.encode of it, bit for bit."""
    texts = ["what is packing?", "padding-free batches", ""]
    r = client.post("/v1/embeddings", json={"input": texts, "model": "any"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2]
    assert body["usage"]["prompt_tokens"] == sum(len(ids) for ids in model.tokenize(texts))
    ref = model.encode(texts)
    assert torch.equal(torch.tensor([d["embedding"] for d in body["data"]]), ref)
    r = client.post("/v1/embeddings", json={"input": "what is packing?", "encoding_format": "base64"})
    row = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    assert torch.equal(torch.from_numpy(row.copy()), model.encode(["what is packing?"])[0])


def test_official_openai_client_works_unchanged(server, model):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    res = client.embeddings.create(model="all-MiniLM-L6-v2", input=["hello world", "a second text"])  # asks for base64
    got = torch.tensor([d.embedding for d in res.data], dtype=torch.float32)
    assert torch.equal(got, model.encode(["hello world", "a second text"]))
    assert res.model == "all-MiniLM-L6-v2" and res.usage.prompt_tokens > 0


def test_tei_route_health_and_metrics(client, model):
    r = client.post("/embed", json={"inputs": "hello"})
    assert r.status_code == 200 and torch.equal(torch.tensor(r.json()), model.encode(["hello"]))
    r = client.post("/embed", json={"inputs": ["a", "b"], "normalize": False})  # the vector before the Normalize module
    assert r.status_code == 200, r.text
    head = model.head
    try:
        model.head = head.without_normalize()
        ref = model.encode(["a", "b"])
    finally:
        model.head = head
    assert torch.equal(torch.tensor(r.json()), ref) and not torch.allclose(ref.norm(dim=-1), torch.ones(2))
    assert client.get("/health").json() == {"status": "ok"}
    text = client.get("/metrics").text
    assert "# TYPE btlib_serve_requests_total counter" in text and "btlib_serve_queue_texts 0" in text
    assert 'btlib_serve_latency_seconds{quantile="0.99"}' in text


@pytest.mark.parametrize("body, status, match", [
    ({"input": ["x"] * 9}, 413, "9 inputs exceed this server's limit of 8"),
    ({"input": ["word " * 600]}, 413, "more than 256 tokens"),
    ({"input": []}, 422, "must not be empty"),
    ({"model": "m"}, 422, "input: Field required"),
    ({"input": [1.5, 2]}, 422, "input"),
    ({"input": [[101, 30522]]}, 422, "token id 30522, outside this model's vocabulary (0 to 30521)"),
    ({"input": [[]]}, 422, "input[0] is an empty list of token ids"),
    ({"input": [101] * 300}, 413, "input[0] has 300 tokens (ids), more than 256"),
    ({"input": [101, 102], "prompt_name": "query"}, 422, "prompt_name='query' with token-id inputs"),
    ({"input": "x", "encoding_format": "int8"}, 422, "encoding_format"),
    ({"input": "x", "dimensions": 385}, 422, "this model gives 384 features; ask for 1 to 384"),
    ({"input": "x", "dimensions": 0}, 422, "dimensions=0"),
    ({"input": "x", "dimensions": "128"}, 422, "dimensions: Input should be a valid integer"),
    ({"input": "x", "prompt": "query: "}, 422, "unknown field 'prompt': this route takes input, model, encoding_format"),
])
def test_openai_route_errors_say_what_is_wrong(client, body, status, match):
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    assert match in r.json()["error"]["message"]


def test_a_lone_surrogate_is_a_422_and_the_connection_serves_the_next_request(client, model):
    """JSON may escape a lone surrogate ("\\ud800"); json.loads gives a str the tokenizer refuses. Raw bodies: httpx's
    json= cannot even encode such a str. It was a 500 that closed the connection."""
    json_body = {"content-type": "application/json"}
    r = client.post("/embed", content=b'{"inputs": "a\\udfffb"}', headers=json_body)
    assert r.status_code == 422 and "inputs: texts[0] holds a lone surrogate (U+DFFF" in r.json()["error"], r.text
    r = client.post("/v1/embeddings", content=b'{"input": ["ok", "a\\ud800"]}', headers=json_body)
    assert r.status_code == 422, r.text
    assert "input: texts[1] holds a lone surrogate (U+D800 at character 1)" in r.json()["error"]["message"]
    r = client.post("/embed", json={"inputs": "hello"})
    assert r.status_code == 200 and torch.equal(torch.tensor(r.json()), model.encode(["hello"]))


def test_malformed_json_and_tei_truncation(client, model):
    r = client.post("/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "malformed request body" in r.json()["error"]["message"]
    long = "word " * 600
    assert client.post("/embed", json={"inputs": long}).status_code == 413
    r = client.post("/embed", json={"inputs": long, "truncate": True})
    assert r.status_code == 200 and torch.equal(torch.tensor(r.json()), model.encode([long]))


def test_bodies_must_be_json_and_openapi_still_describes_them(client, model):
    """The POST routes parse their own bodies (btlib.serve.app._parse): FastAPI's content types, a 422 for the rest."""
    r = client.post("/v1/embeddings", content=b'{"input": "x"}', headers={"content-type": "text/plain"})
    assert r.status_code == 422 and "Content-Type: application/json" in r.json()["error"]["message"]
    r = client.post("/embed", content=b'{"inputs": "hello"}', headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and torch.equal(torch.tensor(r.json()), model.encode(["hello"]))
    r = client.post("/v1/embeddings", content=b'[1, 2]', headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["message"] == "malformed request body: body: send a JSON object"
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/embeddings", "/embed", "/rerank", "/health", "/metrics"} <= set(paths)
    body = paths["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["input"] and body["properties"]["encoding_format"]["enum"] == ["float", "base64"]


def test_api_key_and_overload_answer_401_and_429(model):
    """A gated model holds the worker; the queue (4 texts) fills; the next request gets 429 with Retry-After."""
    from btlib.serve.app import create_app, start_server
    from test_serve_batcher import Recorder

    gate = threading.Event()
    rec = Recorder(model, gate)
    running = start_server(create_app(BatchEncoder(rec, max_queue=4, max_wait_ms=0), api_key="s3cret", max_inputs=4))
    auth = {"Authorization": "Bearer s3cret"}
    try:
        with httpx.Client(base_url=running.url, timeout=60) as c:
            assert c.post("/v1/embeddings", json={"input": "x"}).status_code == 401
            assert c.post("/embed", json={"inputs": "x"}, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert c.get("/health").status_code == 200  # open for load balancers
            results = []
            threads = [threading.Thread(target=lambda t=t: results.append(c.post("/embed", json={"inputs": t}, headers=auth)))
                       for t in ["held", "a", "b", "c", "d"]]
            threads[0].start()
            assert rec.started.wait(30)
            for t in threads[1:]:
                t.start()
            deadline = time.monotonic() + 30
            while c.get("/metrics", headers=auth).text.count("btlib_serve_queue_texts 4") == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            r = c.post("/v1/embeddings", json={"input": "one too many"}, headers=auth)
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "rate_limit_error"
            gate.set()
            for t in threads:
                t.join(60)
            assert sorted(r.status_code for r in results) == [200] * 5
    finally:
        gate.set()
        running.stop()


def test_api_key_middleware_exists_only_with_a_key_and_answers_each_api_its_401(model):
    """No key: no middleware at all (nothing runs per request). A key: 401 in the route's API shape without it or with
    a wrong one, on every route but /health; 200 with it."""
    from btlib.serve.app import create_app

    from btlib.serve.guards import APIKey

    with BatchEncoder(model) as batcher:
        assert APIKey not in [m.cls for m in create_app(batcher).user_middleware]
    message = "missing or wrong API key: send Authorization: Bearer <key>"
    with running_app(model, api_key="s3cret") as server, client_of(server) as c:
        r = c.post("/v1/embeddings", json={"input": "x"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {"error": {"message": message, "type": "authentication_error", "param": None, "code": 401}}
        r = c.post("/embed", json={"inputs": "x"}, headers={"Authorization": "Bearer s3cret2"})
        assert r.status_code == 401 and r.json() == {"error": message, "error_type": "authentication_error"}
        assert c.get("/metrics", headers={"Authorization": "s3cret"}).status_code == 401
        assert c.get("/health").json() == {"status": "ok"}
        assert c.get("/").json() == {"status": "ok"}  # TEI's health check at GET /; POST / is an API route
        assert c.post("/", json={"inputs": "x"}).status_code == 401
        r = c.post("/embed", json={"inputs": "hello"}, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and torch.equal(torch.tensor(r.json()), model.encode(["hello"]))


def test_sigterm_answers_every_accepted_request(tmp_path):
    """python -m btlib.serve on a free port: 12 passage requests accepted, SIGTERM, and all 12 still get 200."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "btlib.serve", "--port", "0", "--max-wait-ms", "0", "--max-batch-tokens", "512",
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line, line
        url = line.split()[-1]
        passage = "Packed tokens cost only the real tokens of a batch. " * 15  # ~170 tokens
        results = []
        with httpx.Client(base_url=url, timeout=120) as c:
            threads = [threading.Thread(target=lambda: results.append(c.post("/embed", json={"inputs": [passage] * 4})))
                       for _ in range(12)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            while "btlib_serve_requests_total 12" not in (metrics := c.get("/metrics").text) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert "btlib_serve_requests_total 12" in metrics, metrics
            proc.send_signal(signal.SIGTERM)
            for t in threads:
                t.join(120)
        assert [r.status_code for r in results] == [200] * 12
        assert proc.wait(60) == 0  # a graceful stop (uvicorn re-raised the signal: -15 before)
        assert "Traceback" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
