"""Round 5's findings on the server (issue 49), each a test that failed on e398218.

(2) /tokenize ran on the event loop (a 1.9 MB text: every connection, /health too, waited 2.4 s) and an answer had no
bound (65 MB); (5) SPLADE's /embed skipped the long-input checks; (6) a second Host header was not checked; (7) JSON
nested past ~1,000 levels or an integer past 4,300 digits was a 500; (8) bad CLI values were tracebacks; (11) an
out-of-range chunk_overlap passed when no text needed chunking, --max-inputs 0 was accepted, ``bearer`` in lower case
was a 401, and /v1/ errors carried TEI's type names and ``param: null``. The tiny folders are tests/st_folders.py's
(cased word-level tokenizer: "w1" is one token, a text's tokens are its words plus [CLS] and [SEP]).
"""

import json
import socket
import subprocess
import sys
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

TESTED_HERE = ["btlib.serve.tei", "btlib.serve.openai_routes", "btlib.serve.rerank_routes", "btlib.serve.__main__",
               "btlib.serve.guards", "btlib.serve.bodies", "btlib.serve.app"]
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


@pytest.mark.parametrize("header, status", [("Bearer s3cret", 200), ("bearer s3cret", 200), ("BEARER s3cret", 200),
                                            ("bEaReR s3cret", 200), ("Bearer S3CRET", 401), ("Basic s3cret", 401),
                                            ("Bearers3cret", 401), ("s3cret", 401), ("Bearer s3cret2", 401)])
def test_the_auth_scheme_is_case_insensitive(tiny, header, status):
    """Was: 401 for ``bearer KEY`` (RFC 9110 11.1: the scheme is case-insensitive); the key itself is not."""
    with running_app(tiny, api_key="s3cret") as server, client_of(server) as c:
        assert c.post("/embed", json={"inputs": "w1"}, headers={"Authorization": header}).status_code == status
