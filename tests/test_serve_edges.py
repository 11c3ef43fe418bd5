"""The server's edges, where round 3's probe campaign found silent wrong answers: every one of these failed before.

Prompts and every request field honoured or refused by name; the prompt counted wherever tokens are counted; heads
that are not plain (truncate_dim, Dense, include_prompt false) answered, not a 500; a precision the model lacks refused
at start; a body limit enforced before the body is read, and tokenizing off the event loop; an empty API key refused;
the Host header checked (DNS rebinding). Reference: sentence-transformers on tiny random folders (tests/st_folders.py:
cased word-level tokenizer, so "w1" is one token and a text's tokens are its words plus [CLS] and [SEP]).
"""

import json
import socket
import threading

import pytest
import torch

from btlib import load_pretrained
from btlib.serve import BatchEncoder
from btlib.serve.remote import http_missing

pytestmark = pytest.mark.skipif(http_missing() is not None, reason=str(http_missing()))
httpx = pytest.importorskip("httpx")
pytest.importorskip("sentence_transformers")

from serve_helpers import client_of, running_app  # noqa: E402
from st_folders import st_model, write_hf, write_st  # noqa: E402

PROMPTS = {"query": "w1 w2 ", "passage": "W3 "}  # 2 and 1 tokens
MAX = 12  # max_seq_length: [CLS] + 10 words + [SEP]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_hf(tmp_path_factory.mktemp("edges") / "hf", "bert")


@pytest.fixture(scope="module")
def prompted(base, tmp_path_factory):
    """Mean pooled, normalised, a default prompt ("query"): what e5 / bge style folders look like."""
    return write_st(tmp_path_factory.mktemp("edges") / "st", base, normalize=True, max_seq_length=MAX,
                    prompts=PROMPTS, default_prompt_name="query")


@pytest.fixture(scope="module")
def server(prompted):
    with running_app(load_pretrained(prompted), max_inputs=16) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with client_of(server) as c:
        yield c


def _close(got, ref, tol=1e-5):
    got, ref = torch.as_tensor(got, dtype=torch.float32), torch.as_tensor(ref, dtype=torch.float32)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert float((got - ref).abs().max()) <= tol * float(ref.abs().max()), float((got - ref).abs().max())


@pytest.mark.parametrize("prompt_name", [None, "query", "passage"])
def test_prompt_name_is_honoured_on_both_routes(client, prompted, prompt_name):
    """Was: 200 with the default prompt's vector whatever prompt_name said (relative error 0.37 for "passage")."""
    texts = ["w4 w5 w6", "W7", ""]
    ref = st_model(prompted).encode(texts, prompt_name=prompt_name, convert_to_tensor=True)
    field = {} if prompt_name is None else {"prompt_name": prompt_name}
    r = client.post("/embed", json={"inputs": texts, **field})
    assert r.status_code == 200, r.text
    _close(r.json(), ref)
    r = client.post("/v1/embeddings", json={"input": texts, **field})
    assert r.status_code == 200, r.text
    _close([d["embedding"] for d in r.json()["data"]], ref)
    prompt_tokens = {None: 2, "query": 2, "passage": 1}[prompt_name]
    assert r.json()["usage"]["prompt_tokens"] == sum(len(t.split()) + 2 + prompt_tokens for t in texts)


def test_an_unknown_prompt_name_or_field_is_refused_by_name(client):
    r = client.post("/embed", json={"inputs": "w1", "prompt_name": "search"})
    assert r.status_code == 422, r.text
    assert "prompt_name 'search' is not one of this model's prompts ['document', 'passage', 'query']" in r.json()["error"]
    r = client.post("/v1/embeddings", json={"input": "w1", "prompt_name": "search"})
    assert r.status_code == 422 and "prompt_name" in r.json()["error"]["message"]
    r = client.post("/embed", json={"inputs": "w1", "prompt": "w1 "})
    assert r.status_code == 422 and "unknown field 'prompt'" in r.json()["error"], r.text
    r = client.post("/embed", json={"inputs": "w1", "normalize": "false"})  # a string is not a bool
    assert r.status_code == 422 and "normalize: Input should be a valid boolean" in r.json()["error"], r.text
    r = client.post("/rerank", json={"query": "q", "texts": ["a"], "top_n": 1})
    assert r.status_code == 422 and "unknown field 'top_n'" in r.json()["error"], r.text


def test_the_prompt_counts_against_the_length_limit(client, prompted):
    """10 words are 12 tokens, the limit; with the 2-token default prompt they are 14. Was: counted as 12, accepted
    and truncated without a word. Now 413 saying the prompt, and truncate=true gives sentence-transformers' answer."""
    text = " ".join(f"w{i}" for i in range(10))
    r = client.post("/embed", json={"inputs": text, "truncate": False})
    assert r.status_code == 413, r.text
    assert "more than 12 tokens with its prompt 'w1 w2 ' (2 tokens)" in r.json()["error"]
    r = client.post("/embed", json={"inputs": text, "prompt_name": "passage", "truncate": False})
    assert r.status_code == 413 and "(1 tokens)" in r.json()["error"]
    r = client.post("/embed", json={"inputs": text, "truncate": True})
    assert r.status_code == 200
    _close(r.json(), st_model(prompted).encode([text], convert_to_tensor=True))
    nine = " ".join(f"w{i}" for i in range(8))  # 8 words + 2 special + 2 prompt = 12: fits
    assert client.post("/embed", json={"inputs": nine, "truncate": False}).status_code == 200


def test_the_batch_budget_counts_the_prompt(prompted):
    """max_batch_tokens bounds what runs: the tokens a batch's forward sees, its prompt included (was: 112 real
    tokens under a budget of 64). A Recorder-like model holds the first forward so the rest queue up together."""
    model = load_pretrained(prompted)
    seen, gate = [], threading.Event()

    class Holding:
        def __init__(self):
            self.tokenizer, self.max_length, self.PRECISIONS = model.tokenizer, model.max_length, model.PRECISIONS

        def encodings(self, texts, prompt_name=None):
            return model.encodings(texts, prompt_name=prompt_name)

        def encode(self, texts, batch_size, precision, prompt_name=None):
            gate.wait(30)
            seen.append(sum(len(e.ids) for e in model.encodings(texts, prompt_name=prompt_name)))
            return model.encode(texts, batch_size=batch_size, precision=precision, prompt_name=prompt_name)

    text = "w1 w2 w3 w4 w5 w6"  # 8 tokens, 10 with the prompt
    with BatchEncoder(Holding(), max_batch_tokens=30, max_wait_ms=0) as batcher:
        futures = [batcher.submit([text]) for _ in range(9)]
        assert futures[0].tokens == 10
        gate.set()
        rows = torch.cat([f.result(30) for f in futures])
    assert max(seen) <= 30 and sum(seen) == 90, seen
    _close(rows, model.encode([text] * 9))


def test_requests_with_different_prompts_share_a_batch_and_each_gets_its_own(prompted):
    model = load_pretrained(prompted)
    gate, started = threading.Event(), threading.Event()
    calls = []

    class Gated:
        tokenizer, max_length = model.tokenizer, model.max_length

        def encodings(self, texts, prompt_name=None):
            return model.encodings(texts, prompt_name=prompt_name)

        def encode(self, texts, batch_size, precision, prompt_name=None):
            started.set()
            gate.wait(30)
            calls.append((list(texts), prompt_name))
            return model.encode(texts, batch_size=batch_size, precision=precision, prompt_name=prompt_name)

    with BatchEncoder(Gated(), max_wait_ms=0) as batcher:
        first = batcher.submit(["w9"])  # runs alone while the others queue behind the gate
        assert started.wait(30)
        queued = [batcher.submit(["w1 w2"], prompt_name="passage"), batcher.submit(["w3"]),
                  batcher.submit(["w4"], prompt_name="passage")]
        gate.set()
        got = [f.result(30) for f in [first, *queued]]
    assert calls[1:] == [(["w1 w2", "w4"], "passage"), (["w3"], None)]
    st = st_model(prompted)
    for rows, (text, name) in zip(got, [("w9", None), ("w1 w2", "passage"), ("w3", None), ("w4", "passage")]):
        _close(rows, st.encode([text], prompt_name=name, convert_to_tensor=True))


def _unnormalized(st, texts: list[str]) -> torch.Tensor:
    """sentence-transformers' rows with its Normalize modules skipped (then its truncate_dim): TEI's normalize=false.
    (A folder without one: its encode; the module loop below adds no prompt, and only prompt-free folders normalise here.)"""
    if not any(type(m).__name__ == "Normalize" for m in st):
        return st.encode(texts, convert_to_tensor=True)
    features = st.tokenize(texts)
    with torch.no_grad():
        for module in st:
            if type(module).__name__ != "Normalize":
                features = module(features)
    return features["sentence_embedding"][:, :st.truncate_dim]


@pytest.mark.parametrize("head", ["truncate_dim", "dense", "include_prompt_false", "plain"])
def test_every_head_answers_embed_as_sentence_transformers(base, tmp_path, head):
    """Was: 500 ('SentenceHead' object has no attribute 'normalize') for any head but pooling (+ Normalize)."""
    kw = {"truncate_dim": dict(normalize=True), "dense": dict(dense=[(8, True, torch.nn.Tanh())]),
          "include_prompt_false": dict(include_prompt=False, prompts=PROMPTS, default_prompt_name="query"),
          "plain": {}}[head]
    folder = write_st(tmp_path / "st", base, **kw)
    if head == "truncate_dim":
        cfg = folder / "config_sentence_transformers.json"
        cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "truncate_dim": 16}))
    st, texts = st_model(folder), ["w1 w2 w3", "W4 w5", ""]
    with running_app(load_pretrained(folder)) as server, client_of(server) as c:
        r = c.post("/embed", json={"inputs": texts})  # TEI's normalize=true: unit rows
        assert r.status_code == 200, r.text
        _close(r.json(), st.encode(texts, normalize_embeddings=True, convert_to_tensor=True))
        r = c.post("/v1/embeddings", json={"input": texts})  # the folder's own output
        _close([d["embedding"] for d in r.json()["data"]], st.encode(texts, convert_to_tensor=True))
        r = c.post("/embed", json={"inputs": texts, "normalize": False})  # the folder's vector before any Normalize
        assert r.status_code == 200, r.text
        _close(r.json(), _unnormalized(st, texts))
        width = st.get_embedding_dimension()
        r = c.post("/embed", json={"inputs": texts, "dimensions": 4})
        _close(r.json(), st.encode(texts, truncate_dim=4, normalize_embeddings=True, convert_to_tensor=True))
        r = c.post("/embed", json={"inputs": texts, "dimensions": width + 1})
        assert r.status_code == 422 and f"this model gives {width} features" in r.json()["error"]


def test_openai_dimensions_truncate_and_renormalise(client, prompted):
    texts = ["w4 w5 w6", "W7"]
    ref = st_model(prompted).encode(texts, truncate_dim=8, normalize_embeddings=True, convert_to_tensor=True)
    r = client.post("/v1/embeddings", json={"input": texts, "dimensions": 8})
    assert r.status_code == 200, r.text
    _close([d["embedding"] for d in r.json()["data"]], ref)


def test_a_precision_the_model_lacks_is_refused_at_start(tmp_path, capsys):
    """Was: the server started, answered /health, then a bare 500 for every request (int8 on ModernBERT, Qwen3)."""
    from btlib.serve.__main__ import main
    from test_modernbert import write_modernbert

    folder = tmp_path / "mb"
    write_modernbert(folder, masked_lm=False)
    with pytest.raises(ValueError, match="precision='int8' is not available for ModernBERT"):
        BatchEncoder(load_pretrained(folder), precision="int8")
    assert main(["--model", str(folder), "--precision", "int8", "--port", "0"]) == 2
    assert "precision='int8' is not available for ModernBERT" in capsys.readouterr().err


def test_an_error_inside_a_batch_is_a_500_in_the_routes_shape_on_a_live_connection(prompted):
    """Was: the exception escaped the route and uvicorn reset the connection with no Connection: close."""
    model = load_pretrained(prompted)

    class Broken:
        tokenizer, max_length = model.tokenizer, model.max_length

        def encode(self, texts, batch_size, precision):
            raise RuntimeError("the model broke")

    with running_app(Broken()) as server, client_of(server) as c:
        r = c.post("/embed", json={"inputs": "w1"})
        assert r.status_code == 500 and r.json() == {"error": "internal error: RuntimeError: the model broke",
                                                     "error_type": "server_error"}
        assert r.headers.get("connection") != "close"
        r = c.post("/v1/embeddings", json={"input": "w1"})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert c.get("/health").status_code == 200


def _raw(url: str, head: bytes, body: bytes = b"", timeout: float = 10) -> bytes:
    """Send ``head`` (and ``body``) on a fresh socket; what the server answers before closing or the timeout."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(head + body)
        out = b""
        try:
            while b"\r\n\r\n" not in out or (chunk := s.recv(65536)):
                out += s.recv(65536) if b"\r\n\r\n" not in out else chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return out


def test_a_body_past_the_limit_is_refused_before_it_is_read(prompted):
    """Content-Length past the limit: 413 with nothing of the body sent (was: the whole body read, tokenized on the
    event loop, and only then a 413); a chunked body: 413 once it passes the limit."""
    with running_app(load_pretrained(prompted), payload_limit=1000) as server:
        answer = _raw(server.url, b"POST /embed HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: 49000000\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b"a body of 49,000,000 bytes exceeds this server's limit of 1,000 bytes" in answer
        assert b"connection: close" in answer.lower()
        chunk = json.dumps({"input": ["w1 " * 400]}).encode()
        answer = _raw(server.url, b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                  b"Transfer-Encoding: chunked\r\n\r\n",
                      b"%x\r\n%s\r\n0\r\n\r\n" % (len(chunk), chunk))
        assert answer.startswith(b"HTTP/1.1 413") and b'"type": "invalid_request_error"' in answer.replace(b'":"', b'": "'), answer
        with client_of(server) as c:
            assert c.post("/embed", json={"inputs": "w1"}).status_code == 200  # within the limit
            r = c.post("/embed", json={"inputs": ["w1 " * 400]})
            assert r.status_code == 413 and r.json()["error_type"] == "payload_too_large"


def test_a_big_body_is_parsed_and_tokenized_off_the_event_loop(prompted, monkeypatch):
    """Which thread counts the tokens: the event loop's for a small request, a worker's for a big one (a 49 MB body
    kept /health waiting 40 s)."""
    from btlib.serve import bodies

    threads = []
    model = load_pretrained(prompted)
    with running_app(model, max_inputs=256) as server, client_of(server) as c:
        real = BatchEncoder.tokenize  # submit's one tokenization

        def spy(self, *a, **kw):
            threads.append(threading.current_thread().name)
            return real(self, *a, **kw)

        monkeypatch.setattr(BatchEncoder, "tokenize", spy)
        assert c.post("/embed", json={"inputs": "w1"}).status_code == 200
        big = ["w1 w2 w3 w4 w5 w6 w7"] * 256  # 5 KB of text: over the threshold's text part
        assert bodies.OFF_LOOP_BYTES // 4 < sum(map(len, big))
        assert c.post("/embed", json={"inputs": big}).status_code == 200
    loop_thread = threads[0]
    assert threads[1] != loop_thread, threads


def test_an_empty_api_key_is_refused_at_start(prompted, monkeypatch, capsys):
    """Was: --api-key "" (or BTLIB_API_KEY="") served without a key, and a bare "Authorization: Bearer " passed."""
    from btlib.serve.__main__ import main
    from btlib.serve.app import create_app

    with BatchEncoder(load_pretrained(prompted)) as batcher:
        for key in ["", " ", "two words", "tab\tkey"]:
            with pytest.raises(ValueError, match="API key"):
                create_app(batcher, api_key=key)
    assert main(["--model", str(prompted), "--api-key", "", "--port", "0"]) == 2
    assert "the API key is empty" in capsys.readouterr().err
    monkeypatch.setenv("BTLIB_API_KEY", "")
    assert main(["--model", str(prompted), "--port", "0"]) == 2
    assert "the API key is empty" in capsys.readouterr().err


def test_a_bad_keep_warm_window_is_refused_at_start(prompted, capsys):
    """--keep-warm-ms reaches the batcher: a negative window stops the server at start with the setting named."""
    from btlib.serve.__main__ import main

    assert main(["--model", str(prompted), "--keep-warm-ms", "-1", "--port", "0"]) == 2
    assert "keep_warm_ms must be a finite number >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("host, status", [(b"127.0.0.1:8080", 200), (b"localhost", 200), (b"[::1]:80", 200),
                                          (b"127.0.0.2", 200), (b"evil.example:8080", 400), (b"127.0.0.1.evil.example", 400),
                                          (b"localhost.evil.example", 400)])
def test_the_host_header_must_name_this_machine(server, host, status):
    """DNS rebinding: a page whose name resolves to 127.0.0.1 has the browser post with its own Host: refused."""
    answer = _raw(server.url, b"GET /health HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % host)
    assert answer.startswith(b"HTTP/1.1 %d" % status), answer[:300]
    if status == 400:
        assert b"is not this server's" in answer and b"--allowed-host" in answer


def test_allowed_host_names_follow_the_bind_address():
    from btlib.serve.app import allowed_host_names

    assert allowed_host_names("127.0.0.1") == ("127.0.0.1", "localhost", "::1")
    assert allowed_host_names("0.0.0.0") == ("*",)
    assert allowed_host_names("::") == ("*",)
    assert allowed_host_names("10.1.2.3") == ("127.0.0.1", "localhost", "::1", "10.1.2.3")
    assert allowed_host_names("0.0.0.0", ["embed.internal"]) == ("127.0.0.1", "localhost", "::1", "embed.internal")


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "cesu-surrogate", "bom"])
def test_a_body_not_in_utf8_is_refused_as_the_body(client, encoding):
    """Was (found by tests/fuzz_serve.py): json.loads(bytes) guessed UTF-16 / UTF-32 and answered 200 (TEI's serde_json
    and RFC 8259 take UTF-8 only), and decoded a surrogate's 3 bytes (not UTF-8) into a field name: a 422 about an
    unknown field '\\ud800inputs'. Now the body is refused as the body."""
    body = json.dumps({"inputs": "w1"})
    raw = {"cesu-surrogate": b'{"\xed\xa0\x80inputs": "w1"}', "bom": b"\xef\xbb\xbf" + body.encode()}.get(encoding)
    r = client.post("/embed", content=raw or body.encode(encoding), headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    message = r.json()["error"]
    assert message.startswith("malformed request body: ") and ("not UTF-8" in message or "JSON decode error" in message), r.text
