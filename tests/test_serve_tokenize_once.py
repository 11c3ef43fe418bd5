"""A served request is tokenized once (issue 36, item 3): the batcher's queue holds each request's token ids, the
batch is packed from them, and the model runs them.

Checked on tiny random folders (tests/st_folders.py: a cased word-level tokenizer, "w1" is one token) with a default
prompt, include_prompt true and false, and a cross-encoder: the tokenizer sees every served text exactly once (a
counting tokenizer: every string handed to encode_batch / encode), every forward's real tokens are within
max_batch_tokens (the model's packed forward, instrumented) and are the tokens counted at submit, a request larger
than the budget runs alone, and the answers equal ``model.encode`` (bit for bit where a request runs alone).
``encode(texts)`` equals ``encode_tokens(tokens(texts))`` bit for bit for every kind of input.
"""

import collections
import json
import threading

import pytest
import torch

from btlib import load_pretrained, load_reranker
from btlib.pretrained.encoding import Tokens
from btlib.serve import BatchEncoder, InputTooLong
from btlib.serve.queue import runs_tokens
from btlib.serve.rerank import PairScorer

pytest.importorskip("sentence_transformers")
from st_folders import write_hf, write_st  # noqa: E402

PROMPTS = {"query": "w1 w2 ", "passage": "W3 "}  # 2 and 1 tokens, as tests/test_serve_edges.py's
MAX = 12  # max_seq_length: [CLS] + 10 words + [SEP]
BUDGET = 24


class CountingTokenizer:
    """The model's tokenizer, recording every string it is asked to tokenize (pairs as tuples)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.seen = tokenizer, []

    def encode_batch(self, items, *a, **kw):
        self.seen.extend(items)
        return self.tokenizer.encode_batch(items, *a, **kw)

    def encode(self, item, *a, **kw):
        self.seen.append(item)
        return self.tokenizer.encode(item, *a, **kw)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


class HeldForwards:
    """Wraps ``encoder._forward_packed``: records each forward's real tokens and holds the first until ``gate`` opens,
    so that every later request queues up and batches form by the budget."""

    def __init__(self, encoder):
        self.encoder, self.real, self.seen = encoder, encoder._forward_packed, []
        self.gate, self.started = threading.Event(), threading.Event()
        encoder._forward_packed = self

    def __call__(self, tokens, runner):
        self.started.set()
        assert self.gate.wait(30), "gate never opened"
        self.seen.append((tokens.ids.numel(), tokens.cu_seqlens.numel() - 1))
        return self.real(tokens, runner)

    def restore(self):
        del self.encoder._forward_packed


def _words(i: int, n: int) -> str:
    return " ".join(f"w{(i * 3 + j) % 9 + 1}" if j % 4 else f"W{(i + j) % 9 + 1}" for j in range(n))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_hf(tmp_path_factory.mktemp("once") / "hf", "bert")


@pytest.fixture(scope="module", params=["include_prompt", "include_prompt_false"])
def folder(base, tmp_path_factory, request):
    """A default prompt ("query"), mean pooled; include_prompt false leaves the prompt's tokens out of the pooling."""
    return write_st(tmp_path_factory.mktemp("once") / request.param, base, normalize=True, max_seq_length=MAX,
                    prompts=PROMPTS, default_prompt_name="query", include_prompt=request.param == "include_prompt")


def test_each_text_is_tokenized_once_and_every_batch_is_within_the_budget(folder):
    model = load_pretrained(folder)
    requests = [([_words(i, i % 9)], None if i % 3 else "passage") for i in range(30)]
    requests += [([_words(40 + i, 6) for i in range(5)], None)]  # 5 x (6 + 2 + 2) = 50 tokens: over the budget
    requests += [([_words(50 + i, 2), _words(60 + i, 3)], "query") for i in range(4)]
    model.tokenizer = counter = CountingTokenizer(model.tokenizer)
    held = HeldForwards(model)
    try:
        with BatchEncoder(model, max_batch_tokens=BUDGET, max_wait_ms=0) as batcher:
            assert batcher._runs_tokens
            first = batcher.submit(["w9"])  # runs alone, held, while the rest queue up
            assert held.started.wait(30)
            futures = [batcher.submit(texts, prompt_name=name) for texts, name in requests]
            held.gate.set()
            got = [f.result(30) for f in futures]
            first.result(30)
            batches = batcher.snapshot()["batches"]
    finally:
        held.restore()
        model.tokenizer = counter.tokenizer
    # the tokenizer: each served text once, its prompt before it; the prompt alone at most once per prompt
    prompt_of = {None: PROMPTS["query"], "query": PROMPTS["query"], "passage": PROMPTS["passage"]}
    seen = collections.Counter(counter.seen)
    want = collections.Counter(prompt_of[name] + t for texts, name in [(["w9"], None), *requests] for t in texts)
    assert want - seen == collections.Counter(), "a served text never tokenized"
    extra = seen - want  # besides the served texts: each prompt alone at most once (prompt_length, kept per prompt)
    assert set(extra) <= set(PROMPTS.values()) and max(extra.values(), default=0) <= 1, extra
    # the budget: every forward's real tokens within it; the one request over it ran in slices (btlib.serve.slices)
    big = futures[30].tokens
    assert big == 50 > BUDGET
    assert max(n for n, _ in held.seen) <= BUDGET, held.seen
    assert sum(n for n, _ in held.seen) == first.tokens + sum(f.tokens for f in futures), "counted = run"
    # requests shared batches (one forward per prompt in a batch); the one over the budget took 3 (slices of 20, 20, 10)
    assert batches < len(requests) // 2 + 2, "requests shared batches"
    for (texts, name), rows in zip(requests, got):  # batched with others: fp32 rounding (batcher.py's docstring)
        torch.testing.assert_close(rows, model.encode(texts, prompt_name=name), atol=1e-6, rtol=0)


def test_a_request_run_alone_equals_encode_bit_for_bit(folder):
    model = load_pretrained(folder)
    requests = [([_words(i, i % 11), _words(i + 1, 3)], [None, "query", "passage"][i % 3]) for i in range(9)]
    requests.append(([" ".join(["w1"] * 20)], "passage"))  # truncated to MAX with its prompt
    with BatchEncoder(model, max_batch_requests=1, max_wait_ms=0) as batcher:
        futures = [batcher.submit(texts, prompt_name=name) for texts, name in requests]
        for (texts, name), f in zip(requests, futures):
            assert torch.equal(f.result(30), model.encode(texts, prompt_name=name))
        with pytest.raises(InputTooLong, match="with its prompt 'W3 ' \\(1 tokens\\)"):
            batcher.submit(requests[-1][0], prompt_name="passage", truncate=False)


def test_encode_is_tokens_then_encode_tokens(folder):
    """encode(texts) == encode_tokens(tokens(texts)) bit for bit, whatever the batch size, prompt, path or pairs;
    the prompt's length travels in the Tokens (include_prompt false pools without it)."""
    model = load_pretrained(folder)
    texts = [_words(i, i % 13) for i in range(11)]
    for kw in [{}, {"prompt_name": "passage"}, {"prompt": ""}, {"prompt": "w5 w6 w7 "}]:
        tokens = model.tokens(texts, **kw)
        assert tokens.prompt_length == model.prompt_length(model.resolve_prompt(kw.get("prompt"), kw.get("prompt_name")))
        for batch_size in (1, 4, 64):
            assert torch.equal(model.encode_tokens(tokens, batch_size=batch_size),
                               model.encode(texts, batch_size=batch_size, **kw))
    assert torch.equal(model.encode_tokens(model.tokens(texts), path="slow"), model.encode(texts, path="slow"))
    pairs = [("w1 w2", "W3 w4 w5"), ("", "w6")]
    assert torch.equal(model.encode_tokens(model.tokens(pairs)), model.encode(pairs))
    joined = Tokens.join([model.tokens(texts[:3]), model.tokens(texts[3:])])
    assert joined == model.tokens(texts)
    with pytest.raises(ValueError, match="different prompts"):
        Tokens.join([model.tokens(texts[:1]), model.tokens(texts[:1], prompt_name="passage")])
    with pytest.raises(TypeError, match="Tokens"):
        model.encode_tokens(model.tokenize(texts))


def test_modernbert_encode_is_tokens_then_encode_tokens():
    """ModernBERT takes texts or token id lists: both through tokens / encode_tokens (tests/test_serve_batcher.py's model)."""
    from serve_helpers import tiny_modernbert

    mb = tiny_modernbert(max_length=16)
    texts = [" ".join(f"w{(i * 7 + j) % 20}" for j in range(n)) for i, n in enumerate([1, 30, 5, 9])]
    tokens = mb.tokens(texts)
    assert tokens.truncated == [False, True, False, False]
    assert torch.equal(mb.encode_tokens(tokens, batch_size=2), mb.encode(texts, batch_size=2))
    ids = mb.tokenize(texts)
    assert mb.tokens(ids).ids == ids and torch.equal(mb.encode_tokens(mb.tokens(ids)), mb.encode(ids))
    with BatchEncoder(mb, max_wait_ms=0) as batcher, pytest.raises(InputTooLong, match="input 1 has more than 16"):
        batcher.submit(texts, truncate=False)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    import transformers as tf

    folder = write_hf(tmp_path_factory.mktemp("once") / "ce", "bert", tokenizer_class="BertTokenizer",
                      model_cls=tf.BertForSequenceClassification, num_labels=1)
    cfg_path = folder / "tokenizer_config.json"  # cased, 24 tokens at most: as tests/test_serve_rerank.py's folder
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "model_max_length": 24, "do_lower_case": False}))
    return load_reranker(folder)


def test_pairs_are_tokenized_once_and_batched_by_their_tokens(reranker):
    scorer = PairScorer(reranker)
    pairs = [[(_words(i, 3), _words(i + 5, i % 7))] for i in range(12)] + [[("w1 " * 8, "w2 " * 30)]]  # truncated
    encoder = reranker.encoder
    encoder.tokenizer = counter = CountingTokenizer(encoder.tokenizer)
    held = HeldForwards(encoder)
    try:
        with BatchEncoder(scorer, max_batch_tokens=BUDGET, max_wait_ms=0) as batcher:
            assert batcher._runs_tokens
            first = batcher.submit([("w1", "w2")])
            assert held.started.wait(30)
            futures = [batcher.submit(p) for p in pairs]
            held.gate.set()
            got = [f.result(30) for f in futures]
            first.result(30)
            with pytest.raises(ValueError, match="takes no prompts"):
                batcher.submit(pairs[0], prompt_name="query")
    finally:
        held.restore()
        encoder.tokenizer = counter.tokenizer
    assert collections.Counter(counter.seen) == collections.Counter([("w1", "w2")] + [p for r in pairs for p in r])
    assert all(n <= BUDGET for n, _ in held.seen), held.seen
    assert sum(n for n, _ in held.seen) == first.tokens + sum(f.tokens for f in futures)
    for p, rows in zip(pairs, got):
        torch.testing.assert_close(rows, reranker.predict(p, activation="identity").unsqueeze(-1), atol=1e-6, rtol=0)
    with BatchEncoder(scorer, max_batch_requests=1, max_wait_ms=0) as batcher:  # alone: bit for bit
        for p in pairs[:4] + [sum(pairs[4:], [])]:
            assert torch.equal(batcher.encode(p), reranker.predict(p, activation="identity").unsqueeze(-1))
    tokens = reranker.tokens(sum(pairs, []))
    assert tokens.types is not None and any(1 in t for t in tokens.types)  # BertTokenizer: types reach the model
    assert torch.equal(reranker.predict_tokens(tokens, batch_size=5), reranker.predict(sum(pairs, []), batch_size=5))


def test_a_wrapper_that_overrides_encode_is_run_through_it(folder):
    """A wrapper forwarding the rest by __getattr__ (tests/test_serve_batcher.py's Recorder) keeps its encode called:
    it is counted at submit and runs encode(texts), as before."""
    model = load_pretrained(folder)

    class Wrapper:
        def __init__(self):
            self.calls = []

        def __getattr__(self, name):
            return getattr(model, name)

        def encode(self, texts, *, batch_size, precision, prompt_name=None):
            self.calls.append(list(texts))
            return model.encode(texts, batch_size=batch_size, precision=precision, prompt_name=prompt_name)

    wrapper = Wrapper()
    assert runs_tokens(model) and runs_tokens(PairScorer.__new__(PairScorer)) and not runs_tokens(wrapper)
    with BatchEncoder(wrapper, max_batch_requests=1) as batcher:
        assert torch.equal(batcher.encode(["w1 w2"], prompt_name="passage"), model.encode(["w1 w2"], prompt_name="passage"))
    assert wrapper.calls == [["w1 w2"]]
