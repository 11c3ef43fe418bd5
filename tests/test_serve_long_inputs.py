"""Long inputs and Matryoshka over HTTP: the server's --long-inputs (refuse, truncate, chunk; --auto-truncate is
truncate), TEI's ``truncate`` and btlib's ``long_inputs`` / ``chunk_overlap`` fields on /embed and /v1/embeddings,
usage and x-compute-tokens counting every token that ran (chunks, overlaps and special tokens), and ``dimensions``
as encode's truncate_dim + normalize_embeddings. Answers are checked against in-process encode, bit for bit (one
request at a time is its own batch); refusals by status and message. The openai client sends btlib's fields in
extra_body.
"""

import pytest
import torch

from btlib.serve.extras import missing
from model_folder import needs_model
from serve_helpers import client_of, running_app

pytestmark = [needs_model, pytest.mark.skipif(missing("fastapi", "serve") is not None, reason=str(missing("fastapi", "serve")))]
httpx = pytest.importorskip("httpx")

TESTED_HERE = ["btlib.serve.service", "btlib.serve.queue", "btlib.serve.app", "btlib.serve.__main__"]
LONG = " ".join(f"token{i % 37} window" for i in range(300))  # ~1,500 tokens of MiniLM: 7 chunks


@pytest.fixture(scope="module")
def refusing(model):
    with running_app(model) as server, client_of(server) as c:
        yield c


@pytest.fixture(scope="module")
def chunking(model):
    with running_app(model, long_inputs="chunk", chunk_overlap=16) as server, client_of(server) as c:
        yield c


def test_default_refuses_and_fields_choose(refusing, model):
    r = refusing.post("/embed", json={"inputs": [LONG]})
    assert r.status_code == 413 and "more than 256 tokens" in r.json()["error"]
    assert refusing.post("/v1/embeddings", json={"input": LONG}).status_code == 413
    r = refusing.post("/embed", json={"inputs": [LONG], "truncate": True})  # TEI's field: as before
    assert torch.equal(torch.tensor(r.json()), model.encode([LONG]))
    # a body asks for less than the server allows, never more: a refusing server does not chunk because a body says so
    for path, body in (("/embed", {"inputs": [LONG, "short"], "long_inputs": "chunk"}),
                       ("/v1/embeddings", {"input": LONG, "long_inputs": "chunk"})):
        r = refusing.post(path, json=body)
        assert r.status_code == 422 and "does not chunk" in r.text and "--long-inputs chunk" in r.text, r.text
    r = refusing.post("/embed", json={"inputs": [LONG], "long_inputs": "truncate"})
    assert r.status_code == 200 and torch.equal(torch.tensor(r.json()), model.encode([LONG]))


def test_chunking_server_chunks_when_a_body_asks(chunking, model):
    r = chunking.post("/embed", json={"inputs": [LONG, "short"], "long_inputs": "chunk"})
    ref = model.encode([LONG, "short"], long_inputs="chunk", chunk_overlap=16)
    assert r.status_code == 200 and torch.allclose(torch.tensor(r.json()), ref, atol=1e-6, rtol=0)  # sliced: fp32 rounding
    tokens = model.tokens([LONG, "short"], long_inputs="chunk", chunk_overlap=16)
    assert r.headers["x-compute-tokens"] == str(sum(tokens.lengths())) and r.headers["x-compute-chunks"] == str(len(tokens))


def test_chunking_server_usage_counts_what_ran(chunking, model):
    r = chunking.post("/v1/embeddings", json={"input": [LONG, "a short one"], "model": "m"})
    assert r.status_code == 200, r.text
    tokens = model.tokens([LONG, "a short one"], long_inputs="chunk", chunk_overlap=16)
    assert tokens.chunks[0] > 1
    assert r.json()["usage"] == {"prompt_tokens": sum(tokens.lengths()), "total_tokens": sum(tokens.lengths()),
                                 "chunks": len(tokens)}
    got = torch.tensor([d["embedding"] for d in r.json()["data"]])
    assert torch.equal(got, model.encode([LONG, "a short one"], long_inputs="chunk", chunk_overlap=16))
    r = chunking.post("/v1/embeddings", json={"input": [LONG], "dimensions": 97})
    ref = model.encode([LONG], long_inputs="chunk", chunk_overlap=16, truncate_dim=97, normalize_embeddings=True)
    assert torch.equal(torch.tensor(r.json()["data"][0]["embedding"]), ref[0])
    r = chunking.post("/embed", json={"inputs": LONG, "truncate": True})  # a request's truncate still wins
    assert torch.equal(torch.tensor(r.json()), model.encode([LONG]))
    r = chunking.post("/similarity", json={"inputs": {"source_sentence": LONG, "sentences": ["token window"]}})
    emb = model.encode([LONG, "token window"], long_inputs="chunk", chunk_overlap=16).double()
    assert abs(r.json()[0] - float(torch.nn.functional.cosine_similarity(emb[:1], emb[1:]))) <= 1e-6


@pytest.mark.parametrize("path, body, status, match", [
    ("/embed", {"inputs": "x", "truncate": True, "long_inputs": "chunk"}, 422, "truncate=true and long_inputs='chunk' disagree"),
    ("/embed", {"inputs": "x", "long_inputs": "split"}, 422, "long_inputs"),
    ("/embed", {"inputs": "x", "chunk_overlap": 8, "truncate": True}, 422, "chunk_overlap applies to long_inputs='chunk' only"),
    ("/embed", {"inputs": LONG, "chunk_overlap": 254}, 422, "chunk_overlap=254 must be below the chunk window of 254"),
    ("/embed", {"inputs": [[101] + [7592] * 300 + [102]]}, 413, "they are not chunked"),
    ("/embed_all", {"inputs": LONG}, 413, "more than 256 tokens"),
    ("/embed", {"inputs": "x", "dimensions": 0}, 422, "dimensions=0: this model gives 384 features; ask for 1 to 384"),
    ("/embed", {"inputs": "x", "dimensions": 385}, 422, "dimensions=385"),
    ("/embed", {"inputs": "x", "dimensions": 12.5}, 422, "dimensions"),
    ("/v1/embeddings", {"input": "x", "dimensions": 0}, 422, "dimensions=0"),
    ("/v1/embeddings", {"input": "x", "long_inputs": "chunk", "chunk_overlap": -1}, 422, "chunk_overlap must be an int >= 0"),
])
def test_refusals(chunking, path, body, status, match):
    r = chunking.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert match in (error["message"] if isinstance(error, dict) else error)


def test_auto_truncate_is_long_inputs_truncate(model):
    from btlib.serve import BatchEncoder
    from btlib.serve.app import create_app

    with running_app(model, auto_truncate=True) as server, client_of(server) as c:
        assert c.get("/info").json()["auto_truncate"] is True
        r = c.post("/v1/embeddings", json={"input": [LONG]})
        assert r.json()["usage"]["prompt_tokens"] == 256 and "chunks" not in r.json()["usage"]
    with BatchEncoder(model) as batcher:
        with pytest.raises(ValueError, match="auto_truncate=True is long_inputs='truncate'"):
            create_app(batcher, auto_truncate=True, long_inputs="chunk")
        with pytest.raises(ValueError, match="chunk_overlap=8 applies to long_inputs='chunk' only"):
            create_app(batcher, chunk_overlap=8)


def test_openai_client_extra_body(chunking, model):
    openai = pytest.importorskip("openai")
    server_url = str(chunking.base_url).rstrip("/")
    client = openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)
    out = client.embeddings.create(input=[LONG], model="m", encoding_format="float", extra_body={"chunk_overlap": 0})
    ref = model.encode([LONG], long_inputs="chunk", chunk_overlap=0)
    assert torch.equal(torch.tensor(out.data[0].embedding), ref[0])
    tokens = model.tokens([LONG], long_inputs="chunk", chunk_overlap=0)
    assert out.usage.prompt_tokens == sum(tokens.lengths())


def test_main_refuses_conflicting_options(capsys):
    from btlib.serve.__main__ import main

    assert main(["--auto-truncate", "--long-inputs", "chunk", "--port", "0"]) == 2
    assert "auto_truncate=True is long_inputs='truncate'" in capsys.readouterr().err


def test_chunks_share_a_batch_with_other_requests(model):
    from btlib.serve import BatchEncoder

    with BatchEncoder(model, max_wait_ms=200, max_batch_tokens=8192) as batcher:  # the three wait for one batch
        futures = [batcher.submit([LONG, "q"], truncate="chunk"), batcher.submit(["short"]),
                   batcher.submit(["x y"], truncate="refuse")]
        rows = [f.result(60) for f in futures]
    assert batcher.stats.snapshot()["batches"] == 1
    refs = [model.encode([LONG, "q"], long_inputs="chunk"), model.encode(["short"]), model.encode(["x y"])]
    for got, ref in zip(rows, refs):
        assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-6, rtol=0)  # fp32 rounding of a bigger GEMM
    assert futures[0].chunks[1] == 1 and futures[0].tokens == sum(model.tokens([LONG, "q"], long_inputs="chunk").lengths())
