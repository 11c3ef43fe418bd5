"""No forward holds more than the token budget (btlib.serve.slices): a request bigger than max_batch_tokens, many texts
or one long text's chunks, runs in slices over consecutive batches and is answered as encode answers it (to fp32
rounding); max_request_tokens refuses a request by its tokens after chunking, queueing nothing; max_wait_s holds from
the first request (a full batch timed at start). Each test fails on e398218, where a request ran in one forward whatever
its size, nothing capped its tokens and the rate was unknown until the first batch had run."""

import threading

import pytest
import torch

from btlib.serve import BatchEncoder, Overloaded
from btlib.serve.batcher import RequestTooLarge
from model_folder import needs_model

TESTED_HERE = ["btlib.serve.slices", "btlib.serve.batcher", "btlib.serve.admission", "btlib.serve.queue"]

pytestmark = needs_model

LONG = " ".join(f"token{i % 37} window" for i in range(600))  # ~3,000 tokens of MiniLM: 13 chunks of <= 256
BUDGET = 512


class Forwards:
    """Wraps the model's encode_tokens at class level (runs_tokens still sees a bound method) and records each
    forward's tokens; ``gate`` holds the first forward until set."""

    def __init__(self, monkeypatch, model, gate: threading.Event | None = None):
        self.tokens, self.gate, self.started = [], gate, threading.Event()
        real = type(model).encode_tokens

        def encode_tokens(this, tokens, **kw):
            self.tokens.append(sum(tokens.lengths()))
            self.started.set()
            if self.gate is not None:
                assert self.gate.wait(60), "test gate never released"
            return real(this, tokens, **kw)

        monkeypatch.setattr(type(model), "encode_tokens", encode_tokens)


def test_a_chunked_text_runs_in_slices_within_the_budget(model, monkeypatch):
    ref = model.encode([LONG, "a short one"], long_inputs="chunk")
    n_tokens = sum(model.tokens([LONG, "a short one"], long_inputs="chunk").lengths())
    forwards = Forwards(monkeypatch, model)
    with BatchEncoder(model, max_batch_tokens=BUDGET) as b:
        f = b.submit([LONG, "a short one"], truncate="chunk")
        got = f.result(120)
    assert max(forwards.tokens) <= BUDGET and sum(forwards.tokens) == n_tokens == f.tokens
    assert len(forwards.tokens) >= -(-n_tokens // BUDGET)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    assert torch.allclose(got.norm(dim=1), torch.ones(2), atol=1e-6)  # pooled, then normalised once
    assert b.snapshot()["batch_tokens_max"] <= BUDGET and b.snapshot()["requests"] == 1


def test_many_texts_run_in_slices_and_keep_their_order(model, monkeypatch):
    texts = [f"sentence number {i} " + "word " * (i % 40) for i in range(60)]  # ~1,600 tokens in all
    ref = model.encode(texts)
    ref_states = model.encode_tokens(model.tokens(texts), output="token_embeddings")
    forwards = Forwards(monkeypatch, model)
    with BatchEncoder(model, max_batch_tokens=BUDGET) as b:
        rows = b.submit(texts).result(120)
        states = b.submit(texts, output="token_embeddings").result(120)
    assert max(forwards.tokens) <= BUDGET and len(forwards.tokens) >= 6
    torch.testing.assert_close(rows, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=0)


def test_short_requests_share_the_batches_of_a_sliced_one(model, monkeypatch):
    """The chunked request ahead leads each batch, but takes half the budget while others wait: the short requests
    behind it run in the first batch after the blocker and are answered long before it (e398218 ran the whole book in
    one forward; a strict FIFO of slices would have made them wait for all of it)."""
    gate = threading.Event()
    forwards = Forwards(monkeypatch, model, gate)
    done: list[str] = []
    with BatchEncoder(model, max_batch_tokens=BUDGET) as b:
        blocker = b.submit(["held by the worker"])
        assert forwards.started.wait(60)
        long = b.submit([LONG], truncate="chunk")
        short = [b.submit([f"query {i}"]) for i in range(3)]
        for name, f in [("long", long), *((f"short {i}", f) for i, f in enumerate(short))]:
            f.add_done_callback(lambda _, name=name: done.append(name))
        gate.set()
        out = [f.result(120) for f in (blocker, long, *short)]
    assert max(forwards.tokens) <= BUDGET and forwards.tokens[1] <= BUDGET // 2 + sum(f.tokens for f in short)
    assert done[-1] == "long" and b.snapshot()["batches"] == len(forwards.tokens)
    torch.testing.assert_close(out[1], model.encode([LONG], long_inputs="chunk"), atol=1e-6, rtol=0)
    for i, o in enumerate(out[2:]):
        torch.testing.assert_close(o, model.encode([f"query {i}"]), atol=1e-6, rtol=0)


def test_max_request_tokens_refuses_by_tokens_after_chunking(model):
    with BatchEncoder(model, max_request_tokens=2000) as b:  # LONG: 1,200 words, ~3,000 tokens once chunked
        b.submit([LONG], truncate="truncate").result(60)  # 256 tokens: within the cap
        with pytest.raises(RequestTooLarge, match=r"max_request_tokens=2,000") as e:
            b.submit([LONG], truncate="chunk")
        assert "chunks" in str(e.value) and b.queue_depth() == (0, 0)
        assert b.snapshot()["requests"] == 1
    with pytest.raises(ValueError, match="max_request_tokens"):
        BatchEncoder(model, max_request_tokens=0)


def test_a_chunked_request_with_more_words_than_the_cap_is_refused_before_tokenizing(model, monkeypatch):
    """Each word is a token at least: 2,000 words past a 1,000-token cap are refused without counting their tokens
    (e398218 tokenized a 2 MB body's 1.3M tokens, 7 s and ~0.5 GB, before anything could refuse it)."""
    with BatchEncoder(model, max_request_tokens=1000) as b:
        monkeypatch.setattr(type(model), "tokens", lambda *a, **kw: pytest.fail("tokenized"))
        with pytest.raises(RequestTooLarge, match=r"2,000 words"):
            b.submit([" ".join(["word"] * 2000)], truncate="chunk")


def test_a_chunked_request_under_the_cap_is_not_refused_by_words_of_no_token(model):
    """Campaign 3 (issue 49): str.split()'s words were taken for a lower bound on tokens, and are not one: "\\x00" is
    a word of no token (BERT's normalizer deletes it), "of\\x1cthe" two words of one piece (U+001C is whitespace to
    Python only). 600 words of 400 tokens were refused past a 500-token cap ("600 words, so 600 tokens at least");
    they are 2 chunks, 435 tokens."""
    text = " ".join(["word"] * 300 + ["\x00"] * 200 + ["of\x1cthe"] * 50)
    with BatchEncoder(model, max_request_tokens=500) as b:
        f = b.submit([text], truncate="chunk")
        got = f.result(60)
        assert f.tokens <= 500 and f.chunks == [2]
        assert torch.allclose(got, model.encode([text], long_inputs="chunk"), atol=1e-6)
        with pytest.raises(RequestTooLarge, match=r"501 words"):  # a word with a letter is a token at least
            b.submit([" ".join(["word"] * 501)], truncate="chunk")


def test_max_wait_s_holds_from_the_first_request(model, monkeypatch):
    """A rate exists before any request ran (a full batch timed at start), so a burst at a cold server is refused
    past max_wait_s instead of filling the queue (e398218: 8.6 s p50 wait with --max-wait-s 0.3). The first forward
    is held, so nothing drains during the burst: what was accepted behind it is at most max_wait_s of tokens."""
    gate = threading.Event()
    with BatchEncoder(model, max_wait_s=0.3, max_batch_tokens=BUDGET) as b:
        rate = b.stats.tokens_per_s()
        assert rate is not None and rate > 0 and b.snapshot()["batches"] == 0
        forwards = Forwards(monkeypatch, model, gate)
        first = b.submit(["word " * 200])  # an empty queue takes it
        assert forwards.started.wait(60)
        accepted, refused = [], 0
        for _ in range(200):
            try:
                accepted.append(b.submit(["word " * 200]))
            except Overloaded:
                refused += 1
        gate.set()
        for f in [first, *accepted]:
            f.result(120)
    assert refused > 0 and sum(f.tokens for f in accepted) <= rate * 0.3


def test_the_server_refuses_a_request_past_max_request_tokens_and_says_its_cap(model):
    """Over HTTP: 413 naming max_request_tokens for a chunked request past it, with param; /info states the cap."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from btlib.serve.app import create_app, start_server

    batcher = BatchEncoder(model, max_wait_ms=0, max_request_tokens=1000)
    server = start_server(create_app(batcher, long_inputs="chunk"))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            assert c.get("/info").json()["max_request_tokens"] == 1000
            r = c.post("/embed", json={"inputs": [LONG]})
            assert r.status_code == 413 and "max_request_tokens=1,000" in r.json()["error"], r.text
            r = c.post("/v1/embeddings", json={"input": [LONG], "model": "m"})
            assert r.status_code == 413 and r.json()["error"]["param"] == "input", r.text
            assert c.post("/embed", json={"inputs": [LONG], "truncate": True}).status_code == 200  # 256 tokens
    finally:
        server.stop()


@pytest.mark.parametrize("argv, message", [
    (["--max-request-tokens", "0"], "max_request_tokens must be an int > 0"),
    (["--max-batch-tokens", "100"], "below this model's max_length 256"),
])
def test_the_cli_refuses_a_cap_or_budget_that_cannot_run(argv, message, capsys):
    pytest.importorskip("fastapi")
    from btlib.serve.__main__ import main

    assert main([*argv, "--port", "0"]) == 2
    assert message in capsys.readouterr().err
