"""Differential fuzzer of ``python -m btlib.serve``'s request bodies against sentence-transformers and the stated rules.

Five tiny folders (random weights, hidden 32, the cased word-level tokenizer of tests/st_folders.py, so "w3" is one
token and a text costs its words plus [CLS] and [SEP]), one server each, started once and reused by every case:

    prompted          mean, Normalize, max_seq_length 12, prompts query "w1 w2 " (default) and passage "W3 "
    no_prompt_pool    include_prompt false, no Normalize, max_seq_length 12, the same prompts; --auto-truncate
    dense             Dense 32 -> 8 (tanh), no Normalize, max_seq_length 10, a named prompt and no default
    truncate_dim      CLS pooling, Normalize, truncate_dim 16 in config_sentence_transformers.json, max_seq_length 16
    reranker          BertForSequenceClassification, one label, 24 tokens per (query, text) pair; --auto-truncate

Each case draws a request: a route (mostly the one the folder's kind serves), a body of valid and invalid field
values (strings, lists, [], numbers where strings belong, nested lists, token-id lists (valid, empty, past the
length limit, outside the vocabulary), null, booleans as strings,
unknown fields, prompt_name real and unknown, dimensions in and out of range, normalize, truncate, truncation_direction,
encoding_format, raw_scores, return_text, lone-surrogate escapes, unicode, "", texts one below / at / one above the
token limit with their prompt, more inputs than max_inputs), sometimes a malformed body (not JSON, an array, no or
another Content-Type, non-UTF-8 bytes, UTF-16, a BOM) or a bad Host. One case in ten is a burst of 2-6 requests to
one server sent at once, so that requests with different prompts, dimensions and truncation share a batch.
tests/serve_oracle.py says what the answer must
be, from sentence-transformers and the rules alone, and what counts as a finding.

    python tests/fuzz_serve.py --cases 1000 [--seed S] [--case N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from serve_oracle import ROUTES, Case, Target, expect, judge, surrogate

PROMPTS = {"query": "w1 w2 ", "passage": "W3 "}  # 2 and 1 tokens
WORDS = [f"w{i}" for i in range(30)] + [f"W{i}" for i in range(30)]
ODD = ["Zürich", "東京", "😀", "e\u0301", "a\u00a0b", "\x00", "\t", "[SEP]", "[PAD]", "<pad>", "w1\u2028w2", '"', "\\",
       "\ufeff", "\U0001f469\u200d\U0001f4bb"]



# -- the folders and their servers -----------------------------------------------------------------------------------
def _write_folders(work: Path) -> dict[str, tuple[Path, dict]]:
    """name -> (folder, create_app options)."""
    import transformers as tf
    from st_folders import write_hf, write_st

    base = write_hf(work / "hf", "bert")
    out = {
        "prompted": (write_st(work / "prompted", base, normalize=True, max_seq_length=12, prompts=PROMPTS,
                              default_prompt_name="query"), {}),
        "no_prompt_pool": (write_st(work / "no_prompt_pool", base, include_prompt=False, max_seq_length=12,
                                    prompts=PROMPTS, default_prompt_name="query"), {"auto_truncate": True}),
        "dense": (write_st(work / "dense", base, dense=[(8, True, torch.nn.Tanh())], max_seq_length=10,
                           prompts={"passage": "W5 W6 W7 "}), {}),
        "truncate_dim": (write_st(work / "truncate_dim", base, pooling="cls", normalize=True, max_seq_length=16), {}),
    }
    cfg = out["truncate_dim"][0] / "config_sentence_transformers.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "truncate_dim": 16}))
    # tokenizer.json is the tokenizer: a tokenizer_class (BertTokenizer) would have transformers 5 rebuild BERT's
    # pre-tokenizer, which splits "<pad>" or "東京" where tokenizer.json's WhitespaceSplit does not (btlib and TEI
    # read tokenizer.json); model_input_names hands the pair's token types to the model
    ce = write_hf(work / "reranker", "bert", model_cls=tf.BertForSequenceClassification, num_labels=1)
    tc = ce / "tokenizer_config.json"
    tc.write_text(json.dumps({**json.loads(tc.read_text()), "model_max_length": 24,
                              "model_input_names": ["input_ids", "token_type_ids", "attention_mask"]}))
    out["reranker"] = (ce, {"auto_truncate": True})
    return out


@contextlib.contextmanager
def campaign(work: Path, max_inputs: int = 6):
    """Write the folders under ``work``, start one server per folder; yields the :class:`Target` list."""
    from sentence_transformers import CrossEncoder, SentenceTransformer

    from btlib import load_pretrained, load_reranker
    from btlib.serve import BatchEncoder
    from btlib.serve.app import create_app, start_server
    from btlib.serve.rerank import PairScorer

    logging.getLogger("sentence_transformers").setLevel(logging.ERROR)
    targets, servers = [], []
    try:
        for name, (folder, options) in _write_folders(work).items():
            if name == "reranker":
                ref = CrossEncoder(str(folder), device="cpu")
                model = PairScorer(load_reranker(folder))
                t = Target(name, "reranker", ref, "", max_inputs, options.get("auto_truncate", False),
                           ref.tokenizer.model_max_length)
            else:
                ref = SentenceTransformer(str(folder), device="cpu")
                model = load_pretrained(folder)
                t = Target(name, "embedding", ref, "", max_inputs, options.get("auto_truncate", False), ref.max_seq_length,
                           ref.get_embedding_dimension(), any(type(m).__name__ == "Normalize" for m in ref),
                           dict(ref.prompts), ref.default_prompt_name)
            running = start_server(create_app(BatchEncoder(model, max_wait_ms=1), max_inputs=max_inputs, **options))
            servers.append(running)
            t.url = running.url
            targets.append(t)
        yield targets
    finally:
        for running in servers:
            running.stop()

# -- drawing a request -----------------------------------------------------------------------------------------------
class Draw:
    """Random field values for one case: valid ones, and with probability ``p`` (0 in a clean case) invalid ones."""

    def __init__(self, rng: random.Random, t: Target, p: float):
        self.rng, self.t, self.p = rng, t, p

    def pick(self, good: list, bad: list = ()):
        return self.rng.choice(bad) if bad and self.rng.random() < self.p else self.rng.choice(good)

    def maybe(self, p: float) -> bool:
        return self.rng.random() < p

    def text(self, prompt_name=None, pair_query: str | None = None) -> str:
        """Words, odd characters, "", a lone surrogate, or one at / one below / one above the length limit."""
        rng, t = self.rng, self.t
        r = rng.random()
        if r < 0.08:
            return ""
        if r < 0.08 + self.p / 4:
            return rng.choice(["w1 \ud800 w2", "\udfff", "W3 \udc00", "\ud83d"])  # lone surrogates
        if r < 0.4:  # around the limit, with the prompt (or the pair's query) counted
            if pair_query is not None:
                used = 3 + len(pair_query.split()) if surrogate(pair_query) else t.tokens(pair_query, pair="")
            else:
                used = t.tokens("", prompt_name) if prompt_name in (None, *t.prompts) else 2
            n = max(0, t.max_len - used + rng.choice([-1, 0, 0, 1, 5]))
            return " ".join(rng.choice(WORDS) for _ in range(n))
        return " ".join(rng.choice(WORDS * 3 + ODD) for _ in range(rng.randint(1, 7)))

    def texts(self, prompt_name=None, pair_query=None) -> list[str]:
        """Usually 1-4 texts; sometimes none or more than max_inputs."""
        n = self.pick([1, 1, 2, 3, 4], [0, self.t.max_inputs + self.rng.randint(1, 3)])
        return [self.text(prompt_name, pair_query) for _ in range(n)]

    def wrong(self):
        """A value of a JSON type no text field takes."""
        return self.rng.choice([5, 1.5, None, True, "false", [1, 2, 3], [[1, 2]], [["w1"]], {"text": "w1"}, ["w1", 7], [None],
                                [[2, 7, 3], [2, 3]], [2] + [9] * 20 + [3], [[]], [[2, 10**6, 3]], [-1, 3]])  # token ids too

    def body(self, route: str) -> dict:
        t, pick, maybe = self.t, self.pick, self.maybe
        if route == "rerank":
            query = self.text() if not maybe(self.p / 5) else self.wrong()
            texts = self.texts(pair_query=query if isinstance(query, str) else "")
            body = {"query": query, "texts": texts if not maybe(self.p / 5) else pick([self.text(), self.wrong()])}
            for name in ["raw_scores", "return_text"]:
                if maybe(0.4):
                    body[name] = pick([True, False], ["true", None, 1])
        else:
            name = pick([*t.prompts, None], ["search", "", 5]) if maybe(0.4) else None
            key = "inputs" if route == "embed" else "input"
            body = {key: self.texts(name) if maybe(0.6) else self.text(name) if not maybe(self.p / 5) else self.wrong()}
            if name is not None or maybe(0.05):
                body["prompt_name"] = name
            if maybe(0.3):
                w = t.width or 32
                body["dimensions"] = pick([1, self.rng.randint(1, w), w, None],
                                          [0, -1, w + 1, 10**20, str(min(8, w)), float(min(8, w)), True])
            if route == "embed" and maybe(0.35):
                body["normalize"] = pick([True, False], ["false", None, 0])
            if route == "openai":
                if maybe(0.4):
                    body["encoding_format"] = pick(["float", "base64"], ["int8", "FLOAT", None])
                if maybe(0.2):
                    body["model"] = pick(["any", "text-embedding-3-small", None], [5])
                if maybe(0.1):
                    body["user"] = pick(["u1", None], [5])
        if route != "openai":
            if maybe(0.3):
                body["truncate"] = pick([True, False, None], ["true", 0])
            if maybe(0.15):
                body["truncation_direction"] = pick(["right", "Right"], ["left", "Left", "LEFT", "up", None])
        if maybe(self.p / 5):  # a field of another route, or of no route
            body[self.rng.choice(["foo", "inputs" if route == "openai" else "input", "top_n", "prompt", "normalize"])] = 1
        if maybe(self.p / 10):
            body.pop(self.rng.choice(list(body)))
        return body


def _at_a_quote(rng: random.Random, body: bytes, insert: bytes) -> bytes:
    """``body`` with ``insert`` after one of its double quotes (inside a key or a string, or after one)."""
    quotes = [i for i, c in enumerate(body) if c == ord('"')]
    i = rng.choice(quotes) + 1
    return body[:i] + insert + body[i:]


def draw(rng: random.Random, targets: list[Target]) -> Case:
    t = rng.choice(targets)
    own = ["rerank"] if t.kind == "reranker" else ["embed", "openai"]
    route = rng.choice(own) if rng.random() < 0.9 else rng.choice([r for r in ROUTES if r not in own])
    data = Draw(rng, t, 0.0 if rng.random() < 0.4 else 0.3).body(route)
    surrogates = "\\ud" in json.dumps(data).lower()
    body = json.dumps(data, ensure_ascii=surrogates or rng.random() < 0.5).encode()
    headers = {"content-type": rng.choice(["application/json"] * 6 + ["application/json; charset=utf-8",
                                                                       "application/problem+json"])}
    case = Case(t, "POST", ROUTES[route], body, headers, data)
    r = rng.random()
    if r < 0.1:  # a body that is not a JSON object in UTF-8, or a content type that is not JSON
        how = rng.choice(["not json", "array", "scalar", "empty", "content-type", "no content-type", "latin-1",
                          "utf-16", "cesu surrogate", "bom"])
        case.malformed, case.data = how, None
        if how == "not json":
            case.body = rng.choice([body[:-1], b"inputs=w1", b"{'inputs': 'w1'}", body + b"}", b"{\"inputs\": NaN"])
        elif how == "array":
            case.body = b"[" + body + b"]"
        elif how == "scalar":
            case.body = rng.choice([b'"w1"', b"null", b"5", b"true"])
        elif how == "empty":
            case.body = b""
        elif how == "content-type":
            case.headers = {"content-type": rng.choice(["text/plain", "application/x-www-form-urlencoded", "json"])}
        elif how == "no content-type":
            case.headers = {}
        elif how == "latin-1":  # a raw non-UTF-8 byte inside a string
            case.body = _at_a_quote(rng, body, b"caf\xe9 ")
        elif how == "utf-16":
            case.body = json.dumps(data).encode(rng.choice(["utf-16-le", "utf-16-be", "utf-16", "utf-32"]))
        elif how == "cesu surrogate":  # U+D800 as 3 bytes: not UTF-8, though Python's surrogatepass decodes it
            case.body = _at_a_quote(rng, body, b"\xed\xa0\x80")
        else:
            case.body, case.data = b"\xef\xbb\xbf" + body, data
    elif r < 0.15:
        host = rng.choice(["evil.example", "evil.example:8080", "127.0.0.1.evil.example", "localhost.evil.example",
                           "localhost:1", "[::1]:9", "127.0.0.5", "LOCALHOST"])
        case.headers["host"], case.bad_host = host, "evil" in host
    elif r < 0.17:
        case.method, case.path = rng.choice([("GET", ROUTES[route]), ("POST", "/v2/embeddings"), ("POST", "/v1/embed")])
    return case

# -- running the cases -----------------------------------------------------------------------------------------------
def draw_cases(rng: random.Random, targets: list[Target]) -> list[Case]:
    """One request, or (one case in ten) a burst of 2-6 to one server, sent at once so that they share batches."""
    if rng.random() < 0.1:
        t = rng.choice(targets)
        return [draw(random.Random(rng.random()), [t]) for _ in range(rng.randint(2, 6))]
    return [draw(rng, targets)]


def run(targets: list[Target], cases: int, seed: int = 0, only: int | None = None,
        seen: Counter | None = None) -> tuple[int, list[str]]:
    """(cases run, findings); ``seen`` counts the requests by route and status."""
    import httpx
    from concurrent.futures import ThreadPoolExecutor

    findings, seen = [], seen if seen is not None else Counter()
    ids = [only] if only is not None else range(cases)
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(timeout=60, limits=httpx.Limits(max_connections=8)))
        pool = stack.enter_context(ThreadPoolExecutor(6))

        def send(case: Case):
            try:
                r = client.request(case.method, case.target.url + case.path, headers=case.headers,
                                   content=case.body if case.method == "POST" else None)
                return r.status_code, r.content
            except httpx.HTTPError as e:
                return None, f"no answer: {type(e).__name__}: {e}"

        for i in ids:
            burst = draw_cases(random.Random(f"{seed}-{i}"), targets)
            answers = list(pool.map(send, burst)) if len(burst) > 1 else [send(burst[0])]
            for case, (status, content) in zip(burst, answers):  # judged here: the oracle's tokenizers on one thread
                seen[case.path, "no answer" if status is None else str(status)] += 1
                try:
                    why = content if status is None else judge(case, expect(case), status, content)
                except Exception as e:  # the oracle's own crash: a finding to look at, with its case to rerun
                    why = f"oracle raised {type(e).__name__}: {e}"
                if why:
                    findings.append(f"case {i} (--seed {seed} --case {i}){' burst' if len(burst) > 1 else ''} "
                                    f"[{case.target.name}] {case.method} {case.path} {case.malformed or ''}"
                                    f"{' host ' + case.headers['host'] if 'host' in case.headers else ''}: {why}\n"
                                    f"    body {case.body[:300]!r}")
    return len(ids), findings


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--case", type=int, default=None, help="run only this case (as a finding names it)")
    args = p.parse_args()
    t0 = time.perf_counter()
    seen: Counter = Counter()
    with tempfile.TemporaryDirectory(prefix="fuzz_serve-") as tmp, campaign(Path(tmp)) as targets:
        t1 = time.perf_counter()
        n, findings = run(targets, args.cases, args.seed, args.case, seen)
    print(f"{n} cases, {sum(seen.values())} requests (seed {args.seed}) in {time.perf_counter() - t1:.0f} s "
          f"(+{t1 - t0:.0f} s to write the folders and start 5 servers): {len(findings)} findings")
    for route in dict.fromkeys(path for path, _ in sorted(seen)):
        outcomes = [f"{outcome} {count}" for (path, outcome), count in sorted(seen.items()) if path == route]
        print(f"  {route}: " + ", ".join(outcomes))
    for f in findings:
        print(" ", f)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
