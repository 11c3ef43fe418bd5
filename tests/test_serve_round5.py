"""Round 5's findings on the server (issue 49), each a test that failed on e398218.

(2) /tokenize ran on the event loop (a 1.9 MB text: every connection, /health too, waited 2.4 s) and an answer had no
bound (65 MB); (5) SPLADE's /embed skipped the long-input checks; (6) a second Host header was not checked; (7) JSON
nested past ~1,000 levels or an integer past 4,300 digits was a 500; (11) an out-of-range chunk_overlap passed when no
text needed chunking, max_inputs 0 was accepted, ``bearer`` in lower case was a 401, and /v1/ errors carried TEI's
type names and ``param: null``. (8), bad CLI values, is tests/test_serve_cli.py's. The tiny folders are tests/st_folders.py's
(cased word-level tokenizer: "w1" is one token, a text's tokens are its words plus [CLS] and [SEP]).
"""

import json
import socket
import threading
import time

import pytest
import torch

from btlib import load_pretrained
from btlib.serve.extras import missing
from model_folder import needs_model
from serve_helpers import client_of, running_app

pytestmark = pytest.mark.skipif(missing("fastapi", "serve") is not None, reason=str(missing("fastapi", "serve")))
httpx = pytest.importorskip("httpx")
pytest.importorskip("sentence_transformers")

from st_folders import write_hf, write_st  # noqa: E402

TESTED_HERE = ["btlib.serve.tei", "btlib.serve.openai_routes", "btlib.serve.rerank_routes", "btlib.serve.guards",
               "btlib.serve.bodies", "btlib.serve.app"]
PROMPTS = {"query": "w1 w2 ", "passage": "W3 "}  # 2 and 1 tokens
MAX = 12  # max_seq_length: [CLS] + 10 words + [SEP]; the chunk window is 10 less the prompt's tokens


@pytest.fixture(scope="module")
def prompted(tmp_path_factory):
    base = write_hf(tmp_path_factory.mktemp("round5") / "hf", "bert")
    return write_st(tmp_path_factory.mktemp("round5") / "st", base, normalize=True, max_seq_length=MAX,
                    prompts=PROMPTS, default_prompt_name="query")


@pytest.fixture(scope="module")
def tiny(prompted):
    return load_pretrained(prompted)


@pytest.fixture(scope="module")
def client(tiny):
    with running_app(tiny, max_inputs=4) as server, client_of(server) as c:
        yield c


def _raw(url: str, request: bytes, timeout: float = 30) -> bytes:
    """``request`` sent on a fresh socket (it asks Connection: close); everything the server answers."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    out = b""
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(request)
        while chunk := s.recv(65536):
            out += chunk
    return out


# -- (2) nothing heavy on the event loop; an answer bounded like a body --------------------------------------------
@needs_model
def test_health_answers_while_a_big_tokenize_runs(model):
    """Was: tokenizers' encode (which holds the GIL) ran on the event loop, and /health waited for all of it."""
    text = "Packed tokens cost only the real tokens of a batch. " * 12000  # 624 KB, ~132,000 tokens, a ~8 MB answer
    with running_app(model) as server, client_of(server) as c, client_of(server) as probe:
        assert probe.get("/health").status_code == 200
        answer = {}

        def post():
            t = time.perf_counter()
            answer["r"] = c.post("/tokenize", json={"inputs": text})
            answer["s"] = time.perf_counter() - t

        worker = threading.Thread(target=post)
        worker.start()
        waits = []
        while worker.is_alive():
            t = time.perf_counter()
            assert probe.get("/health").status_code == 200
            waits.append(time.perf_counter() - t)
            time.sleep(0.02)
        worker.join()
    r = answer["r"]
    assert r.status_code == 200, r.text[:300]
    tokens = r.json()[0]
    from tokenizers import Tokenizer

    whole = Tokenizer.from_str(model.tokenizer.to_str())
    whole.no_truncation()
    assert [t["id"] for t in tokens] == whole.encode(text).ids and len(tokens) > 100_000  # not truncated, as TEI's
    assert tokens[1] == {"id": tokens[1]["id"], "text": "Packed", "special": False, "start": 0, "stop": 6}
    assert len(waits) >= 3 and max(waits) < 0.3 * answer["s"], (max(waits), answer["s"], len(waits))


def test_an_answer_past_the_limit_is_a_413_naming_it(tiny):
    """Was: any answer, however big (65 MB for a 1.9 MB /tokenize body); now a 413 naming the limit, for every route
    that answers in proportion to its tokens, and answers within the limit unchanged."""
    with running_app(tiny, max_inputs=32, answer_limit=20_000) as server, client_of(server) as c:
        for path, body in [("/tokenize", {"inputs": "w1 " * 2000}),  # ~50 bytes per token
                           ("/embed_all", {"inputs": ["w1 w2 w3 w4 w5 w6 w7 w8"] * 16}),  # 16 x 10 x 32 floats
                           ("/decode", {"ids": [5] * 8000}),  # "w0 " per id
                           ("/v1/embeddings", {"input": ["w1"] * 32, "model": "m"})]:
            r = c.post(path, json=body)
            assert r.status_code == 413, (path, r.status_code, r.text[:200])
            error = r.json()["error"]
            message = error["message"] if isinstance(error, dict) else error
            assert "limit of 20,000 bytes" in message and "--answer-limit" in message, message
        r = c.post("/tokenize", json={"inputs": ["w1 W3", "w2"]})  # the default prompt ("w1 w2 ") first, as TEI
        assert r.status_code == 200 and [[t["text"] for t in row] for row in r.json()] == [
            ["[CLS]", "w1", "w2", "w1", "W3", "[SEP]"], ["[CLS]", "w1", "w2", "w2", "[SEP]"]]
        assert c.post("/decode", json={"ids": [[5, 6], [7]]}).json() == ["w0 w1", "w2"]
    with running_app(tiny, payload_limit=1000) as server, client_of(server) as c:  # the default: 16 payload limits
        r = c.post("/tokenize", json={"inputs": "w1 " * 300})
        assert r.status_code == 413 and "limit of 16,000 bytes" in r.json()["error"], r.text[:300]


def test_answers_are_written_piece_by_piece_as_to_json_writes_them_whole():
    from btlib.serve.answer import Answers, Array, Run
    from btlib.serve.bodies import to_json
    from btlib.serve.guards import HTTPError

    rows = torch.randn(5, 7)
    whole = {"object": "list", "data": [{"index": i, "embedding": r.tolist()} for i, r in enumerate(rows)], "n": [1, 2, 3]}
    tree = lambda: {"object": "list", "data": Array({"index": i, "embedding": r.tolist()} for i, r in enumerate(rows)),  # noqa: E731
                    "n": Array([Run([1, 2]), Run([]), 3])}
    text = to_json(whole)
    assert Answers(len(text)).write(tree()) == text or json.loads(Answers(len(text)).write(tree())) == whole
    with pytest.raises(HTTPError) as e:
        Answers(len(text) - 1).write(tree())
    assert e.value.status == 413 and f"limit of {len(text) - 1:,} bytes" in e.value.message
    assert Answers(11).write(Array(Array(Run([i] * 2) for i in range(2)) for _ in range(1))) == b"[[0,0,1,1]]"
    from btlib.serve.tei import rows_array, rows_bound
    from test_serve_json import float32_rows

    edges = torch.from_numpy(float32_rows())  # subnormals, the extremes, -0: the longest texts a float32 writes
    edges[1] = -torch.finfo(torch.float32).tiny / 3
    text = to_json(edges.numpy().tolist())
    assert len(text) <= rows_bound(edges.numel(), len(edges)) and len(to_json(edges.tolist(), fast=False)) <= \
        rows_bound(edges.numel(), len(edges))  # json.dumps' ", " too
    for most in (None, rows_bound(edges.numel(), len(edges))):  # in pieces, or whole within the bound: the same text
        assert Answers(len(text)).write(rows_array(edges), most) == text


# -- (5) one table of field checks for every route and model kind -------------------------------------------------------
@pytest.fixture(scope="module")
def splade(tmp_path_factory):
    from btlib.pretrained.sparse import load_sparse
    from test_sparse import write_splade

    model = load_sparse(write_splade(tmp_path_factory.mktemp("round5_splade") / "splade"))
    with running_app(model, max_inputs=4) as server, client_of(server) as c:
        yield c


@pytest.mark.parametrize("fields, param, match", [
    ({"truncate": True, "long_inputs": "refuse"}, "long_inputs", "truncate=true and long_inputs='refuse' disagree"),
    ({"truncate": False, "long_inputs": "truncate"}, "long_inputs", "disagree"),
    ({"chunk_overlap": 2}, "chunk_overlap", "chunk_overlap applies to long_inputs='chunk' only"),
    ({"truncate": True, "chunk_overlap": 2}, "chunk_overlap", "chunk_overlap applies to long_inputs='chunk' only"),
])
def test_a_field_is_checked_alike_on_every_route_and_model_kind(client, splade, fields, param, match):
    """Was: SPLADE's /embed answered 200 (long_inputs winning silently; chunk_overlap ignored) where the dense /embed
    and /v1/embeddings refused; every one is now btlib.serve.fields' one check."""
    from btlib.serve.fields import ROUTES

    assert set(ROUTES["embed"]) == {"dense", "sparse"}
    answers = [splade.post("/embed", json={"inputs": "w1", "normalize": False, **fields}),
               client.post("/embed", json={"inputs": "w1", **fields})]
    if "truncate" not in fields:  # OpenAI's body has no truncate
        answers.append(client.post("/v1/embeddings", json={"input": "w1", **fields}))
        assert answers[2].json()["error"]["param"] == param
    for r in answers:
        assert r.status_code == 422 and match in r.text, r.text
    assert answers[0].json() == answers[1].json()  # the same words on both model kinds


def test_what_a_route_cannot_do_is_refused_by_name(client, splade):
    r = splade.post("/embed", json={"inputs": "w1", "normalize": False, "long_inputs": "chunk"})
    assert r.status_code == 422 and "long_inputs" in r.text, r.text
    r = splade.post("/embed", json={"inputs": "w1", "normalize": False, "dimensions": 4})
    assert r.status_code == 422 and "dimensions" in r.text, r.text
    assert splade.post("/embed", json={"inputs": "w1", "normalize": False, "truncate": True, "long_inputs": "truncate"}
                       ).status_code == 200
    assert splade.post("/embed_sparse", json={"inputs": "w1", "truncation_direction": "left"}).status_code == 422
    assert client.post("/embed_sparse", json={"inputs": "w1"}).status_code == 424  # a dense model: TEI's 424


# -- (6) one Host header ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("allowed", [("127.0.0.1", "localhost", "::1"), None])
def test_more_than_one_host_header_is_a_400(tiny, allowed):
    """Was: only the first Host header was checked (127.0.0.1 then evil.example: 200). RFC 9112 3.2: 400 for more than
    one, and for an HTTP/1.1 request without one; also on a server that answers any name."""
    with running_app(tiny, allowed_hosts=allowed) as server:
        for hosts, status in [((b"127.0.0.1", b"evil.example"), 400), ((b"127.0.0.1", b"127.0.0.1"), 400),
                              ((b"evil.example", b"127.0.0.1"), 400), ((b"127.0.0.1",), 200), ((), 400)]:
            head = b"".join(b"Host: %s\r\n" % h for h in hosts)
            answer = _raw(server.url, b"GET /health HTTP/1.1\r\n%sConnection: close\r\n\r\n" % head)
            assert answer.startswith(b"HTTP/1.1 %d" % status), (hosts, answer[:300])
            if status == 400:
                assert b"RFC 9112" in answer
        assert _raw(server.url, b"GET /health HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.1 200")  # no Host in HTTP/1.0


# -- (7) malformed JSON of any depth or size --------------------------------------------------------------------------
@pytest.mark.parametrize("raw, match", [
    (b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"inputs": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}", "nested too deeply"),
    (b'{"inputs": ' + b"[" * 100_000, "nested too deeply"),
    (b'{"inputs": "w1", "dimensions": ' + b"7" * 5000 + b"}", "an integer of more than 4,300 digits"),
    (b'{"inputs": "w1", "dimensions": NaN}', "NaN is not a JSON number"),
    (b'{"inputs": "w1", "dimensions": -Infinity}', "-Infinity is not a JSON number"),
    (json.dumps({f"k{i}": 1 for i in range(1000)}).encode(), "an object of 1,000 fields"),
    (json.dumps({"inputs": [True] * 300_000}).encode(), "list[str].0: Input should be a valid string"),
])
def test_malformed_json_of_any_depth_or_size_is_a_422_naming_it(client, raw, match):
    """Was: 500 "internal error" for RecursionError and Python's int limit; and a list of 300,000 wrong elements took
    ~10 s to answer a 52 MB message (one error per element and union branch)."""
    for path in ("/embed", "/v1/embeddings"):
        body = raw.replace(b'"inputs"', b'"input"') if path == "/v1/embeddings" else raw
        t = time.perf_counter()
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422 and match in r.text and len(r.content) < 4000, (path, r.status_code, r.text[:300])
        assert time.perf_counter() - t < 5
    assert client.post("/embed", json={"inputs": "w1"}).status_code == 200  # the connection serves the next one


# -- (11) the smaller ones ---------------------------------------------------------------------------------------------
def test_max_inputs_below_one_is_refused_by_create_app(tiny):
    from btlib.serve import BatchEncoder
    from btlib.serve.app import create_app

    with BatchEncoder(tiny) as batcher:
        for bad in (0, -1, True):
            with pytest.raises(ValueError, match="max_inputs must be an int >= 1"):
                create_app(batcher, max_inputs=bad)


def test_chunk_overlap_is_checked_against_the_window_when_nothing_needs_chunking(tiny):
    """Was: chunk_overlap 8 (or -1) answered 200 for a short text, and the same request with a long text a 422. The
    window is max_length less [CLS], [SEP] and the prompt's tokens: 8 with the default prompt (2 tokens), 9 with
    "passage" (1), as the library's chunk_tokens counts it."""
    from btlib.serve import BatchEncoder
    from btlib.serve.app import create_app

    long = " ".join(f"w{i % 20}" for i in range(40))
    with pytest.raises(ValueError, match="below the chunk window of 8"):
        tiny.tokens([long], long_inputs="chunk", chunk_overlap=8)
    assert tiny.tokens([long], long_inputs="chunk", chunk_overlap=8, prompt_name="passage").chunks[0] > 1
    with running_app(tiny, long_inputs="chunk") as server, client_of(server) as c:
        for body, status in [({"chunk_overlap": 8}, 422), ({"chunk_overlap": 7}, 200), ({"chunk_overlap": -1}, 422),
                             ({"chunk_overlap": 8, "prompt_name": "passage"}, 200),
                             ({"chunk_overlap": 9, "prompt_name": "passage"}, 422)]:
            for path, field in (("/embed", "inputs"), ("/v1/embeddings", "input")):
                r = c.post(path, json={field: "w1", **body})
                assert r.status_code == status, (path, body, r.text)
                if path == "/v1/embeddings" and status == 422:
                    assert r.json()["error"]["param"] == "chunk_overlap"
    with BatchEncoder(tiny) as batcher:
        with pytest.raises(ValueError, match="below the chunk window of 8"):
            create_app(batcher, long_inputs="chunk", chunk_overlap=8)


@pytest.mark.parametrize("header, status", [("Bearer s3cret", 200), ("bearer s3cret", 200), ("BEARER s3cret", 200),
                                            ("bEaReR s3cret", 200), ("Bearer S3CRET", 401), ("Basic s3cret", 401),
                                            ("Bearers3cret", 401), ("s3cret", 401), ("Bearer s3cret2", 401)])
def test_the_auth_scheme_is_case_insensitive(tiny, header, status):
    """Was: 401 for ``bearer KEY`` (RFC 9110 11.1: the scheme is case-insensitive); the key itself is not."""
    with running_app(tiny, api_key="s3cret") as server, client_of(server) as c:
        assert c.post("/embed", json={"inputs": "w1"}, headers={"Authorization": header}).status_code == status


def test_openai_errors_carry_openais_types_and_the_field_at_fault(tiny):
    """Was: /v1/ errors said "Validation", "payload_too_large", "not_found", ... (TEI's kinds) and param null where a
    field was at fault. TEI's routes keep TEI's names."""
    with running_app(tiny, max_inputs=2, payload_limit=2000) as server, client_of(server) as c:
        cases = [("/v1/embeddings", {"input": "w1", "colour": 1}, 422, "colour"),
                 ("/v1/embeddings", {"input": "w1", "dimensions": "4"}, 422, "dimensions"),
                 ("/v1/embeddings", {"input": "w1 " * 20}, 413, "input"),  # past max_length, no truncation
                 ("/v1/embeddings", {"input": [1, 99999]}, 422, "input"),  # outside the vocabulary
                 ("/v1/embeddings", {"input": ["w1"] * 3}, 413, "input"),
                 ("/v1/embeddings", {"input": "w1", "truncation_direction": "left"}, 422, "truncation_direction"),
                 ("/v1/embeddings", {"input": "w1 " * 1000}, 413, None),  # the body limit: no field at fault
                 ("/v1/nothing", {"input": "w1"}, 404, None)]
        for path, body, status, param in cases:
            r = c.post(path, json=body)
            assert r.status_code == status and r.json()["error"]["type"] == "invalid_request_error", r.text
            assert r.json()["error"]["param"] == param, (body, r.text)
        r = c.get("/v1/embeddings")
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
        assert c.post("/embed", json={"inputs": "w1 " * 1000}).json()["error_type"] == "payload_too_large"
        assert c.post("/nothing", json={}).json()["error_type"] == "not_found"
        assert c.post("/embed", json={"inputs": "w1", "truncate": True, "long_inputs": "refuse"}).json()["error_type"] \
            == "Validation"
