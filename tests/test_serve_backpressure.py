"""Backpressure by expected wait (btlib.serve.admission, BatchEncoder(max_wait_s=), --max-wait-s): refused at once,
before tokenizing, by a rate stubbed to a known value; never by a clock."""

import threading

import pytest

from btlib.serve import BatchEncoder, Overloaded
from btlib.serve.admission import refusal
from btlib.serve.extras import missing
from model_folder import needs_model

TESTED_HERE = ["btlib.serve.admission", "btlib.serve.service"]

RATE = 100.0  # tokens per second, stubbed: max_wait_s=1 admits 100 queued tokens


class Held:
    """The real model; every forward waits for ``gate``, so what is submitted meanwhile stays queued."""

    def __init__(self, model):
        self.model, self.tokenizer, self.max_length = model, model.tokenizer, model.max_length
        self.gate, self.started = threading.Event(), threading.Event()

    def __getattr__(self, name):
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def encode(self, texts, *, batch_size, precision):
        self.started.set()
        assert self.gate.wait(30), "test gate never released"
        return self.model.encode(texts, batch_size=batch_size, precision=precision)


def held_batcher(model, rate: float | None, **kw):
    """A BatchEncoder of a Held model, one request running (held), its measured rate stubbed to ``rate`` (the full
    batch the worker times at start too: a Held forward would wait for the gate)."""
    held = Held(model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("btlib.serve.batcher.start_rate", lambda *a: (100, 1.0))
        b = BatchEncoder(held, max_wait_ms=0, **kw)
    b.stats.tokens_per_s = lambda: rate
    running = b.submit(["held by the worker"])
    assert held.started.wait(30)
    return b, held, running


def test_refusal_rule():
    kw = dict(queued_texts=3, max_queue=10, max_wait_s=1.0, tokens_per_s=RATE)
    assert refusal(queued_tokens=90, texts=1, tokens=10, **kw) is None  # (90 + 10) / 100 = 1.0 s: not past it
    e = refusal(queued_tokens=90, texts=1, tokens=11, **kw)
    assert isinstance(e, Overloaded) and "expected wait 1.01 s" in str(e) and e.retry_after_s == 1
    assert refusal(queued_tokens=250, texts=1, tokens=1, **kw).retry_after_s == 3  # 250 tokens drain in 2.5 s
    assert "queue full" in str(refusal(queued_tokens=0, texts=8, tokens=8, **kw))  # the count cap, whatever the wait
    assert refusal(queued_tokens=10**6, texts=1, tokens=1, **{**kw, "tokens_per_s": None}) is None  # no rate yet
    assert refusal(queued_tokens=10**6, texts=1, tokens=1, **{**kw, "max_wait_s": None}) is None  # no wait limit
    assert refusal(queued_tokens=0, texts=1, tokens=10**6, **kw) is None  # nothing ahead: taken, else refused forever


@needs_model
def test_refused_by_expected_wait_accepted_under_it_and_every_accepted_answered(model):
    b, held, running = held_batcher(model, RATE, max_wait_s=1.0)
    text = "a short query about packing"
    n = b.count_tokens([text])[0]
    fit = int(RATE * 1.0) // n  # requests whose tokens all drain within 1 s at RATE
    accepted = [b.submit([text]) for _ in range(fit)]
    with pytest.raises(Overloaded, match=r"expected wait .* exceeds max_wait_s=1") as e:
        b.submit([text])
    assert e.value.retry_after_s == 1 and b.queue_depth() == (fit, fit)  # nothing of the refused request queued
    held.gate.set()
    b.close()  # no timeout: a first forward may measure GEMM paths for a while (btlib.hardware)
    assert all(f.done() and f.exception() is None and f.result().shape == (1, 384) for f in [running, *accepted])
    snap = b.snapshot()
    assert (snap["requests"], snap["refused"]) == (fit + 1, 1)


@needs_model
def test_before_a_rate_is_measured_only_the_count_cap_refuses(model):
    b, held, running = held_batcher(model, None, max_wait_s=1e-3, max_queue=4)
    accepted = [b.submit(["a long text " * 20]) for _ in range(4)]  # 4 x ~60 tokens: any measured rate would refuse
    with pytest.raises(Overloaded, match="queue full"):
        b.submit(["x"])
    held.gate.set()
    b.close()  # no timeout: a first forward may measure GEMM paths for a while (btlib.hardware)
    assert all(f.exception() is None for f in [running, *accepted])


@needs_model
def test_refused_before_any_tokenizing_when_the_queue_ahead_already_waits_too_long(model):
    b, held, running = held_batcher(model, RATE, max_wait_s=1.0)
    ahead = b.submit(["word " * 120])  # 122 tokens, taken by the empty queue: 1.22 s ahead of anything that comes next
    tokenized = []
    real = b.tokenize
    b.tokenize = lambda texts, **kw: tokenized.append(texts) or real(texts, **kw)
    with pytest.raises(Overloaded, match="expected wait"):
        b.submit(["tiny"])
    assert tokenized == [] and b.queue_depth() == (1, 1)
    held.gate.set()
    b.close()  # no timeout: a first forward may measure GEMM paths for a while (btlib.hardware)
    assert ahead.exception() is None and running.exception() is None


@pytest.mark.parametrize("bad", [0, -1.0, True, "1", float("nan")])
@needs_model
def test_bad_max_wait_s_is_refused_by_name(model, bad):
    with pytest.raises(ValueError, match="max_wait_s"):
        BatchEncoder(model, max_wait_s=bad)


@needs_model
@pytest.mark.skipif(missing("fastapi", "serve") is not None, reason=str(missing("fastapi", "serve")))
def test_http_429_with_retry_after_before_tokenizing(model):
    httpx = pytest.importorskip("httpx")
    from btlib.serve.app import create_app, start_server

    b, held, running = held_batcher(model, RATE, max_wait_s=1.0)
    ahead = b.submit(["word " * 120])
    tokenized = []
    real = b.tokenize
    b.tokenize = lambda texts, **kw: tokenized.append(texts) or real(texts, **kw)
    server = start_server(create_app(b))
    try:
        for path, body in (("/v1/embeddings", {"input": ["tiny"]}), ("/embed", {"inputs": "tiny"})):
            r = httpx.post(server.url + path, json=body, timeout=30)
            assert r.status_code == 429 and r.headers["retry-after"] == "2" and "expected wait" in r.text, r.text
        assert tokenized == []
    finally:
        held.gate.set()
        server.stop()
    assert ahead.exception() is None and running.exception() is None


@needs_model
@pytest.mark.skipif(missing("fastapi", "serve") is not None, reason=str(missing("fastapi", "serve")))
def test_cli_refuses_a_bad_max_wait_s_by_name(capsys):
    from btlib.serve.__main__ import main

    assert main(["--max-wait-s", "0", "--port", "0"]) == 2
    assert "max_wait_s must be a finite number > 0" in capsys.readouterr().err


@pytest.mark.skipif(missing("fastapi", "serve") is not None, reason=str(missing("fastapi", "serve")))
def test_big_requests_are_tokenized_one_at_a_time_on_one_thread():
    """Campaign 3 (issue 49): big bodies were tokenized on the default executor's threads at once, each holding ~160x
    its bytes (tokenizers' encoding) and glibc keeping every thread's freed memory: four 1.7 MB bodies took MiniLM's
    server from 573 to 1,566 MiB and left it at 1,413. Four bodies past the off-loop size, sent at once: never two
    tokenizing at a time, all on one thread."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    httpx = pytest.importorskip("httpx")
    from btlib.serve.app import create_app, start_server
    from serve_helpers import tiny_modernbert

    b = BatchEncoder(tiny_modernbert(16), max_wait_ms=1)
    lock, running, seen = threading.Lock(), [0], []
    real = b.tokenize

    def tokenize(texts, **kw):
        with lock:
            running[0] += 1
            seen.append((running[0], threading.current_thread().name))
        time.sleep(0.1)  # long enough that requests sent at once would overlap on several threads
        with lock:
            running[0] -= 1
        return real(texts, **kw)

    b.tokenize = tokenize
    server = start_server(create_app(b, auto_truncate=True))
    text = " ".join(f"w{i % 20}" for i in range(2000))  # 7.8 KB: past OFF_LOOP_BYTES // 4 characters
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: httpx.post(server.url + "/embed", json={"inputs": text}, timeout=60),
                                    range(4)))
        assert [r.status_code for r in answers] == [200] * 4
        assert len(seen) == 4 and max(n for n, _ in seen) == 1, seen
        assert {name for _, name in seen} == {"btlib-tokenize_0"}, seen
    finally:
        server.stop()
