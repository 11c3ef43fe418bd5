"""Differential fuzzer of ``python -m btlib.serve``'s request bodies against sentence-transformers and the stated rules.

Nine in-process servers of seven tiny folders (tests/fuzz_serve_targets.py: prompted, no_prompt_pool, dense,
truncate_dim, reranker, a SPLADE model, and three chunking servers with a cap on a request's tokens, under a Dense +
Normalize head, CLS pooling with truncate_dim, and a mean that leaves the prompt out), started once and reused by
every case. Each case draws a request: a route (mostly those the folder's kind serves: /embed, /v1/embeddings and
/embed_all; /embed_sparse and /embed; /rerank), a body of valid and invalid field
values (strings, lists, [], numbers where strings belong, nested lists, token-id lists (valid, empty, past the
length limit, outside the vocabulary), null, booleans as strings,
unknown fields, prompt_name real and unknown, dimensions in and out of range, normalize, truncate, truncation_direction,
long_inputs and chunk_overlap (in and out of the window, on servers that chunk and servers that do not),
encoding_format, raw_scores, return_text, lone-surrogate escapes, unicode, "", texts one below / at / one above the
token limit with their prompt, texts of several chunks, more inputs than max_inputs), sometimes a malformed body (not
JSON, an array, no or another Content-Type, non-UTF-8 bytes, UTF-16, a BOM) or a bad Host; one case in a hundred
bodies of ~1.9 MB (one text of 520,000 words; sometimes two or three at once). One case in ten is a burst of 2-6 requests to one server sent at once
(half of them to the chunking server), so that requests with different prompts, dimensions, truncation and chunks
share a batch. tests/serve_oracle.py says what the answer must be, from sentence-transformers and the rules alone,
and what counts as a finding; tests/serve_budget.py what it may cost in time and memory, and how big a forward may be.

    python tests/fuzz_serve.py --cases 1000 [--seed S] [--case N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from fuzz_serve_targets import campaign
from serve_budget import BIG_BYTES, Watch
import st_rows
from serve_oracle import ROUTES, Case, Target, expect, judge, surrogate

__all__ = ["campaign", "run", "draw_cases"]

WORDS = [f"w{i}" for i in range(30)] + [f"W{i}" for i in range(30)]
ODD = ["Zürich", "東京", "😀", "e\u0301", "a\u00a0b", "\x00", "\t", "[SEP]", "[PAD]", "<pad>", "w1\u2028w2", '"', "\\",
       "\ufeff", "\U0001f469\u200d\U0001f4bb", "w1\x1cw2", "\x1f"]  # U+001C, U+001F: whitespace to Python only
OWN = {"embedding": ["embed", "openai", "embed_all"], "sparse": ["embed_sparse", "embed"], "reranker": ["rerank"]}


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
        if pair_query is None and rng.random() < (0.3 if t.long_inputs == "chunk" else 0.03):  # several chunks' worth
            most = rng.choice([3, 3, 3, 8]) * t.max_len
            if t.max_request_tokens and rng.random() < 0.3:  # around the cap once chunked (~1.2 tokens a word)
                most = t.max_request_tokens
            return " ".join(rng.choice(WORDS * 4 + ODD) for _ in range(rng.randint(t.max_len, most)))
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
            key = "input" if route == "openai" else "inputs"
            body = {key: self.texts(name) if maybe(0.6) else self.text(name) if not maybe(self.p / 5) else self.wrong()}
            if name is not None or maybe(0.05):
                body["prompt_name"] = name
            if route in ("embed", "openai") and maybe(0.3):
                w = t.width or 32
                body["dimensions"] = pick([1, self.rng.randint(1, w), w, None],
                                          [0, -1, w + 1, 10**20, str(min(8, w)), float(min(8, w)), True])
            if route == "embed" and maybe(0.85 if t.kind == "sparse" else 0.35):  # SPLADE's /embed: normalize=false
                body["normalize"] = pick([False, False, True] if t.kind == "sparse" else [True, False], ["false", None, 0])
            if route in ("embed", "openai"):
                self.long_fields(body, name)
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
            body[self.rng.choice(["foo", "inputs" if route == "openai" else "input", "top_n", "prompt", "normalize",
                                  "dimensions", "long_inputs", "chunk_overlap"])] = 1
        if maybe(self.p / 10):
            body.pop(self.rng.choice(list(body)))
        return body


    def long_fields(self, body: dict, name) -> None:
        """long_inputs and chunk_overlap, in and out of range (the window of the request's prompt)."""
        pick, t = self.pick, self.t
        if self.maybe(0.4 if t.long_inputs == "chunk" else 0.1):
            body["long_inputs"] = pick(["refuse", "truncate", "chunk", "chunk", None], ["Chunk", "split", 1, True])
        if self.maybe(0.3 if t.long_inputs == "chunk" else 0.05):
            w = st_rows.window(t, name if name in t.prompts else None)
            body["chunk_overlap"] = pick([0, 1, w // 8, w - 1, None], [-1, w, w + 3, 10**6, "1", 1.5, True])


def _at_a_quote(rng: random.Random, body: bytes, insert: bytes) -> bytes:
    """``body`` with ``insert`` after one of its double quotes (inside a key or a string, or after one)."""
    quotes = [i for i, c in enumerate(body) if c == ord('"')] or [0]  # b"{}": after its brace
    i = rng.choice(quotes) + 1
    return body[:i] + insert + body[i:]


def draw_big(rng: random.Random, targets: list[Target]) -> Case:
    """A body of ~1.9 MB: one text of 520,000 words (a 413 by its tokens, or cut, or past max_request_tokens)."""
    t = rng.choice([t for t in targets if t.kind != "reranker"])
    route = rng.choice(OWN[t.kind])
    data = {"input" if route == "openai" else "inputs": " ".join(rng.choice(WORDS) for _ in range(520_000))}
    if route != "openai" and rng.random() < 0.6:
        data["truncate"] = rng.random() < 0.7
    if route in ("embed", "openai") and t.kind == "embedding" and rng.random() < 0.5:
        data["long_inputs"] = rng.choice(["chunk", "truncate"])
    if route == "embed" and t.kind == "sparse":
        data["normalize"] = False
    return Case(t, "POST", ROUTES[route], json.dumps(data).encode(), {"content-type": "application/json"}, data)


def draw(rng: random.Random, targets: list[Target]) -> Case:
    t = rng.choices(targets, [2 if t.long_inputs == "chunk" else 1 for t in targets])[0]  # the chunk path: ~half
    own = OWN[t.kind]
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
    """One request; one case in a hundred ~1.9 MB bodies (one, or two or three at once); one in ten a burst of 2-6 to
    one server (half of them to the chunking server) sent at once, so that they share batches."""
    r = rng.random()
    if r < 0.01:  # one in three of them two or three at once, to one server
        t = draw_big(rng, targets).target
        return [draw_big(rng, [t]) for _ in range(rng.choice([1, 1, 2, 3]))]
    if r < 0.11:
        chunking = [t for t in targets if t.long_inputs == "chunk"]
        t = rng.choice(chunking if chunking and rng.random() < 0.5 else targets)  # half of them to a chunking one
        return [draw(random.Random(rng.random()), [t]) for _ in range(rng.randint(2, 6))]
    return [draw(rng, targets)]


def _send(client, case: Case) -> tuple[int | None, bytes | str, float]:
    """(status or None, the body or why there is none, seconds)."""
    import httpx

    t0 = time.perf_counter()
    try:
        r = client.request(case.method, case.target.url + case.path, headers=case.headers,
                           content=case.body if case.method == "POST" else None)
        return r.status_code, r.content, time.perf_counter() - t0
    except httpx.HTTPError as e:
        return None, f"no answer: {type(e).__name__}: {e}", time.perf_counter() - t0


def _kind(case: Case, burst: int) -> str:
    if len(case.body) > BIG_BYTES:
        return "big body"
    if burst > 1:
        return "burst"
    return "malformed body" if case.malformed else "another Host" if "host" in case.headers else "single"


def run(targets: list[Target], cases: int, seed: int = 0, only: int | None = None,
        seen: Counter | None = None, watch: list | None = None, repeats: int = 100) -> tuple[int, list[str]]:
    """(cases run, findings); ``seen`` counts the requests by route, server and kind, and status; ``watch`` (a list)
    receives the :class:`serve_budget.Watch` that checked time and memory (its summary holds the largest values seen);
    repeats: the same request to each server at the end, for the leak check."""
    import httpx
    from concurrent.futures import ThreadPoolExecutor

    findings, seen = [], seen if seen is not None else Counter()
    ids = [only] if only is not None else range(cases)
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(timeout=60, limits=httpx.Limits(max_connections=12)))
        pool = stack.enter_context(ThreadPoolExecutor(6))
        w = Watch(client, targets)
        if watch is not None:
            watch.append(w)
        for i in ids:
            burst = draw_cases(random.Random(f"{seed}-{i}"), targets)
            name = f"case {i} (--seed {seed} --case {i}){' burst' if len(burst) > 1 else ''}"
            exps = []
            for case in burst:  # before sending: the oracle's tokenizers stay off the servers' time
                try:
                    exps.append(expect(case))
                except Exception as e:  # the oracle's own crash: a finding to look at, with its case to rerun
                    exps.append(e)
            tokens = sum(e.tokens for e in exps if not isinstance(e, Exception))
            nbytes = sum(len(c.body) for c in burst)
            w.begin()
            sends = [pool.submit(_send, client, c) for c in burst]
            if nbytes > BIG_BYTES or tokens > 4 * burst[0].target.budget:  # /health answers while it runs
                for _ in range(40):
                    if all(f.done() for f in sends):
                        break
                    _, why = w.health(burst[0].target)
                    if why:
                        findings.append(f"{name} [{burst[0].target.name}]: {why}")
                    time.sleep(0.02)
            answers = [f.result() for f in sends]
            findings += [f"{name}: {why}" for why in w.after([c.target for c in burst])]
            for case, exp, (status, content, elapsed) in zip(burst, exps, answers):
                outcome = "no answer" if status is None else str(status)
                seen["route", case.path, outcome] += 1
                seen["server", case.target.name, outcome] += 1
                seen["kind", _kind(case, len(burst)), outcome] += 1
                if status == 200 and not isinstance(exp, Exception) and exp.chunked:
                    seen["kind", "200 with texts of several chunks (texts)", case.path] += exp.chunked
                try:
                    if isinstance(exp, Exception):
                        raise exp
                    why = content if status is None else judge(case, exp, status, content)
                except Exception as e:
                    why = f"oracle raised {type(e).__name__}: {e}"
                why = why or w.timed(case.target, tokens, nbytes, elapsed, f"{name} {case.path}")
                if why:
                    findings.append(f"{name} [{case.target.name}] {case.method} {case.path} {case.malformed or ''}"
                                    f"{' host ' + case.headers['host'] if 'host' in case.headers else ''}: {why}\n"
                                    f"    body {case.body[:300]!r}")
        if only is None:
            findings += w.leaks(repeats)
    return len(ids), findings


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--case", type=int, default=None, help="run only this case (as a finding names it)")
    args = p.parse_args()
    t0 = time.perf_counter()
    seen: Counter = Counter()
    watch: list = []
    with tempfile.TemporaryDirectory(prefix="fuzz_serve-") as tmp, campaign(Path(tmp)) as targets:
        t1 = time.perf_counter()
        n, findings = run(targets, args.cases, args.seed, args.case, seen, watch, repeats=400)
    requests = sum(v for (g, *_), v in seen.items() if g == "route")
    print(f"{n} cases, {requests} requests (seed {args.seed}) in {time.perf_counter() - t1:.0f} s "
          f"(+{t1 - t0:.0f} s to write the folders and start {len(targets)} servers): {len(findings)} findings")
    for group in ("route", "server", "kind"):
        print(f"by {group}:")
        for key in dict.fromkeys(k for g, k, _ in sorted(seen) if g == group):
            outcomes = [f"{outcome} {count}" for (g, k, outcome), count in sorted(seen.items()) if (g, k) == (group, key)]
            print(f"  {key}: " + ", ".join(outcomes))
    for line in watch[0].summary() if watch else ():
        print(line)
    for f in findings:
        print(" ", f)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
