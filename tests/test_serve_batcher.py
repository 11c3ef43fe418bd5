"""btlib.serve.BatchEncoder: answers equal model.encode, the batching policy, backpressure, drain on close, stats."""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from btlib.serve import BatchEncoder, InputTooLong, Overloaded, percentile, prometheus_text
from model_folder import needs_model

# BatchEncoder, percentile and prometheus_text, imported through btlib.serve.
TESTED_HERE = ["btlib.serve.batcher", "btlib.serve.stats"]

pytestmark = needs_model

QUERIES = ["what is packing?", "a", "how do padded batchers waste work when lengths mix in one batch", "", "cu_seqlens",
           "the quick brown fox jumps over the lazy dog " * 3, "x y z"]
PASSAGE = "Packed tokens and cu_seqlens let a batch of ragged sentences cost only its real tokens. " * 4


class Recorder:
    """The real model, recording the texts of every forward pass; ``gate`` (if set) holds each pass until released."""

    def __init__(self, model, gate: threading.Event | None = None, fail: bool = False, poison: str | None = None):
        self.model, self.tokenizer, self.max_length = model, model.tokenizer, model.max_length
        self.gate, self.fail, self.calls, self.started = gate, fail, [], threading.Event()
        self.poison = poison  # a text whose batch raises (an input error no check at submit caught)

    def __getattr__(self, name):  # the rest is the model's (pooling, PairScorer's scores_pairs): the app sees the model
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def tokenize(self, texts):
        return self.model.tokenize(texts)

    def encode(self, texts, *, batch_size, precision):
        self.calls.append(list(texts))
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(30), "test gate never released"
        if self.fail:
            raise RuntimeError("model failed")
        if self.poison in texts:
            raise RuntimeError(f"model failed on {self.poison!r}")
        return self.model.encode(texts, batch_size=batch_size, precision=precision)


def test_requests_of_one_batch_equal_encode_of_all_their_texts(model):
    """max_wait 500 ms: requests submitted within microseconds form one batch = model.encode(concatenation), bit for bit."""
    rec = Recorder(model)
    requests = [QUERIES[:2], QUERIES[2:3], QUERIES[3:7]]
    with BatchEncoder(rec, max_batch_tokens=10_000, max_wait_ms=500) as b:
        futures = [b.submit(r) for r in requests]
        out = [f.result(30) for f in futures]
    assert len(rec.calls) == 1 and rec.calls[0] == QUERIES
    ref = model.encode(QUERIES)
    assert torch.equal(torch.cat(out), ref)
    assert [o.shape for o in out] == [(2, 384), (1, 384), (4, 384)]
    assert b.snapshot()["batches"] == 1 and b.snapshot()["texts"] == 7


def test_one_request_per_batch_equals_encode_of_it(model):
    """max_batch_requests=1: each answer is model.encode of that request's texts, bit for bit, from many threads."""
    requests = [[q] for q in QUERIES] + [[PASSAGE, "short"], ["only"] * 3]
    with BatchEncoder(model, max_batch_requests=1, max_wait_ms=0) as b, ThreadPoolExecutor(4) as pool:
        out = list(pool.map(b.encode, requests))
    for r, o in zip(requests, out):
        assert torch.equal(o, model.encode(r))


def test_concurrent_callers_get_their_own_rows(model):
    """Mixed batches from 4 threads: every row matches encode of its text alone to fp32 rounding (the GEMM's row count may change the last bits)."""
    texts = (QUERIES + [PASSAGE]) * 3
    alone = {t: model.encode([t])[0] for t in set(texts)}
    with BatchEncoder(model, max_batch_tokens=256, max_wait_ms=5) as b, ThreadPoolExecutor(4) as pool:
        out = list(pool.map(lambda t: b.encode([t]), texts))
    for t, o in zip(texts, out):
        torch.testing.assert_close(o[0], alone[t], atol=1e-6, rtol=0)
    snap = b.snapshot()
    assert snap["requests"] == len(texts) and snap["batches"] < len(texts) and snap["batch_tokens_max"] <= 256


def test_short_queries_fill_the_room_a_passage_leaves_and_the_oldest_always_goes_first(model):
    """Budget 64: [q0 (17 tokens), passage (52), q1, q2, passage, q3] -> [q0, q1, q2, q3], then each passage at the head of its batch."""
    gate = threading.Event()
    rec = Recorder(model, gate)
    q0, passage = " ".join(["word"] * 15), " ".join(["word"] * 50)
    with BatchEncoder(rec, max_batch_tokens=64, max_wait_ms=0) as b:
        assert b.count_tokens([q0, passage, "q1"]) == [17, 52, 4]
        first = b.submit(["blocker"])
        assert rec.started.wait(30)  # the worker holds the first batch: the rest queue up
        fs = [b.submit([t]) for t in (q0, passage, "q1", "q2", passage, "q3")]
        gate.set()
        for f in [first, *fs]:
            f.result(30)
    assert rec.calls == [["blocker"], [q0, "q1", "q2", "q3"], [passage], [passage]]


def test_full_queue_refuses_at_once_and_close_answers_every_accepted(model):
    gate = threading.Event()
    rec = Recorder(model, gate)
    b = BatchEncoder(rec, max_queue=4, max_wait_ms=0)
    running = b.submit(["held by the worker"])
    assert rec.started.wait(30)
    accepted = [b.submit(["a", "b"]), b.submit(["c"]), b.submit(["d"])]  # 4 texts: the queue is full
    with pytest.raises(Overloaded, match="queue full") as e:
        b.submit(["e"])
    assert e.value.retry_after_s >= 1
    with pytest.raises(ValueError, match="exceed max_queue"):
        b.submit(["x"] * 5)
    closer = threading.Thread(target=b.close)
    closer.start()
    gate.set()
    closer.join(30)
    assert not closer.is_alive()
    assert all(f.done() and f.exception() is None for f in [running, *accepted])
    assert rec.calls == [["held by the worker"], ["a", "b", "c", "d"]]
    assert torch.equal(torch.cat([f.result() for f in accepted]), model.encode(["a", "b", "c", "d"]))
    with pytest.raises(RuntimeError, match="closed"):
        b.submit(["late"])
    snap = b.snapshot()
    assert (snap["requests"], snap["refused"], snap["queue_texts"]) == (4, 1, 0)


def test_a_failing_batch_fails_its_requests_and_the_worker_goes_on(model):
    rec = Recorder(model, fail=True)
    with BatchEncoder(rec, max_wait_ms=0) as b:
        with pytest.raises(RuntimeError, match="model failed"):
            b.encode(["x"], timeout=30)
        rec.fail = False
        assert torch.equal(b.encode(["x"], timeout=30), model.encode(["x"]))
    assert b.snapshot()["failed"] == 1


def test_an_input_that_fails_its_batch_fails_only_its_own_request(model):
    """The batch is retried one request at a time: the others in it get their rows, the culprit its error."""
    gate = threading.Event()
    rec = Recorder(model, gate=gate, poison="poison")
    with BatchEncoder(rec, max_wait_ms=0) as b:
        first = b.submit(["warm"])  # holds the worker at the gate while the next three queue into one batch
        assert rec.started.wait(30)
        ok1, bad, ok2 = b.submit(["a", "b"]), b.submit(["poison"]), b.submit(["c"])
        gate.set()
        assert torch.equal(first.result(30), model.encode(["warm"]))
        with pytest.raises(RuntimeError, match="model failed on 'poison'"):
            bad.result(30)
        assert torch.equal(ok1.result(30), model.encode(["a", "b"])) and torch.equal(ok2.result(30), model.encode(["c"]))
    assert rec.calls == [["warm"], ["a", "b", "poison", "c"], ["a", "b"], ["poison"], ["c"]]
    snap = b.snapshot()
    assert (snap["requests"], snap["failed"], snap["batches"]) == (4, 1, 5)


def test_aencode_and_empty_requests(model):
    async def main(b):
        return await asyncio.gather(b.aencode(["one"]), b.aencode(["two", "three"]), b.aencode([]))

    with BatchEncoder(model, max_wait_ms=20) as b:
        one, two, empty = asyncio.run(main(b))
    torch.testing.assert_close(torch.cat([one, two]), model.encode(["one", "two", "three"]), atol=1e-6, rtol=0)
    assert empty.shape == (0, 384)


def test_too_long_is_refused_only_without_truncation(model):
    long = "word " * 600
    with BatchEncoder(model) as b:
        with pytest.raises(InputTooLong, match="more than 256 tokens"):
            b.submit(["ok", long], truncate=False)
        assert torch.equal(b.encode([long]), model.encode([long]))
        assert b.snapshot()["requests"] == 1


@pytest.mark.parametrize("kw, error, match", [
    (dict(max_batch_tokens=0), ValueError, "max_batch_tokens"), (dict(max_wait_ms=-1), ValueError, "max_wait_ms"),
    (dict(max_queue=True), ValueError, "max_queue"), (dict(max_batch_requests=0), ValueError, "max_batch_requests"),
    (dict(worker_nice=20), ValueError, "worker_nice"), (dict(worker_nice=-1), ValueError, "worker_nice"),
    (dict(worker_nice=2.0), ValueError, "worker_nice"), (dict(keep_warm_ms=-1), ValueError, "keep_warm_ms"),
    (dict(keep_warm_ms=float("inf")), ValueError, "keep_warm_ms"), (dict(keep_warm_ms=True), ValueError, "keep_warm_ms"),
    (dict(keep_warm_ms="50"), ValueError, "keep_warm_ms"),
])
def test_bad_settings_say_which(model, kw, error, match):
    with pytest.raises(error, match=match):
        BatchEncoder(model, **kw)


@pytest.mark.skipif(not hasattr(__import__("os"), "getpriority"), reason="per-thread nice values are Linux's")
def test_worker_nice_lowers_only_the_workers_priority_and_answers_the_same(model):
    import os

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    want = min(19, mine + 3)
    with BatchEncoder(model, worker_nice=want) as b:
        got = b.encode(QUERIES[:3])
        assert os.getpriority(os.PRIO_PROCESS, b._worker.native_id) == want
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller's thread is left alone
    assert torch.equal(got, model.encode(QUERIES[:3]))


@pytest.mark.parametrize("keep_warm_ms", [0, 40])
def test_the_idle_worker_ticks_only_inside_its_keep_warm_window(model, monkeypatch, keep_warm_ms):
    """After a batch the worker runs btlib.openmp.KeepWarm.tick every ~2 ms (a tiny region on each of its OpenMP
    threads) for keep_warm_ms, then waits for work without ticking; 0 never ticks. A request arriving inside the window
    is answered as any other. Only the ticks' count is checked: what they save is timed by tests/probe_lone_request.py."""
    from btlib import openmp

    ticks = []
    real = openmp.KeepWarm.tick

    def counted(self):
        ticks.append(threading.get_native_id())
        real(self)

    monkeypatch.setattr(openmp.KeepWarm, "tick", counted)
    with BatchEncoder(model, keep_warm_ms=keep_warm_ms) as b:
        first = b.encode(QUERIES[:2])
        threading.Event().wait(keep_warm_ms / 1e3 / 2)
        inside = b.encode(QUERIES[2:3])  # arrives inside the window (or, at 0, after the worker went to sleep)
        threading.Event().wait(keep_warm_ms / 1e3 + 0.15)
        settled = len(ticks)
        threading.Event().wait(0.1)
        assert len(ticks) == settled  # the window closed: no tick while the worker waits for work
        worker = b._worker.native_id
    assert torch.equal(first, model.encode(QUERIES[:2])) and torch.equal(inside, model.encode(QUERIES[2:3]))
    if keep_warm_ms == 0:
        assert ticks == []
    else:  # ~20 ticks per 40 ms window, two windows; a loaded machine runs fewer, never more than the windows allow
        assert 1 <= len(ticks) <= 2 * keep_warm_ms / 2 + 4 and set(ticks) == {worker}


def test_a_failing_keep_warm_tick_stops_the_ticks_not_the_worker(model, monkeypatch):
    from btlib import openmp

    calls = []

    def broken(self):
        calls.append(1)
        raise RuntimeError("tick failed")

    monkeypatch.setattr(openmp.KeepWarm, "tick", broken)
    with BatchEncoder(model, keep_warm_ms=40) as b:
        first = b.encode(QUERIES[:1])
        threading.Event().wait(0.1)
        assert torch.equal(b.encode(QUERIES[1:2]), model.encode(QUERIES[1:2]))  # the worker still answers
    assert torch.equal(first, model.encode(QUERIES[:1])) and len(calls) == 1  # one failure, then no more ticks


def test_keep_warm_ticks_nothing_outside_its_window():
    from btlib.openmp import KeepWarm

    warm = KeepWarm(0.01)
    assert warm.next_wait() is None  # no forward yet: wait for work without a timeout
    warm.tick()
    assert warm._x is None  # nothing ran
    warm.touch()
    assert 0 < warm.next_wait() <= KeepWarm.TICK_S
    threading.Event().wait(0.02)
    assert warm.next_wait() is None
    off = KeepWarm(0)
    off.touch()
    assert off.next_wait() is None
    with pytest.raises(ValueError, match="seconds >= 0"):
        KeepWarm(-1)


def test_bad_texts_say_what_to_pass(model):
    with BatchEncoder(model) as b:
        for bad in ("a string", [1, 2], None):
            with pytest.raises(TypeError, match="list of str"):
                b.submit(bad)
        # a lone surrogate (from a JSON "\\ud800" escape) is refused at submit, not by the tokenizer inside a batch
        for bad, where in ((["ok", "a\ud800"], r"texts\[1\] .*U\+D800 at character 1"), ([("q", "\udfff")], r"texts\[0\]\[1\]")):
            with pytest.raises(ValueError, match=where):
                b.submit(bad)
        assert b.snapshot()["requests"] == 0


def test_modernbert_batches_equal_its_encode():
    """The batcher takes any loaded encoder: a random-weight ModernBERT with a word-level tokenizer."""
    from serve_helpers import tiny_modernbert

    mb = tiny_modernbert(max_length=64)
    texts = [" ".join(f"w{(i * 7 + j) % 20}" for j in range(n)) for i, n in enumerate([1, 30, 5, 97])]
    with BatchEncoder(mb, max_wait_ms=500, max_batch_tokens=10_000) as b:
        out = torch.cat([f.result(30) for f in [b.submit(texts[:2]), b.submit(texts[2:])]])
    assert torch.equal(out, mb.encode(texts))


def test_percentile_and_prometheus_text():
    assert percentile([10, 20, 30, 40], 50) == 20 and percentile([10, 20, 30, 40], 99) == 40 and percentile([], 50) is None
    text = prometheus_text({"requests": 3, "refused": 1, "queue_texts": 2, "latency_p99_ms": 12.5, "latency_p50_ms": None,
                            "batch_tokens_p50": 40})
    assert "btlib_serve_requests_total 3\n" in text and "btlib_serve_refused_total 1\n" in text
    assert "# TYPE btlib_serve_queue_texts gauge\nbtlib_serve_queue_texts 2\n" in text
    assert 'btlib_serve_latency_seconds{quantile="0.99"} 0.0125\n' in text and 'quantile="0.5"} 40' in text
    assert 'latency_seconds{quantile="0.5"}' not in text  # no value yet: no sample line


def test_missing_extras_name_what_to_install(monkeypatch, capsys):
    from btlib.serve import extras, require
    from btlib.serve.__main__ import main

    with pytest.raises(ImportError, match=r"pip install -e '\.\[scale\]'"):
        require("no_such_module_btlib_test", "scale")
    monkeypatch.setattr(extras, "missing", lambda module, extra: f"{module} is not installed: pip install -e '.[{extra}]'")
    assert main(["--port", "0"]) == 2
    assert "fastapi is not installed: pip install -e '.[serve]'" in capsys.readouterr().err
