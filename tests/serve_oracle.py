"""The oracle of tests/fuzz_serve.py: what btlib.serve must answer to a request, from sentence-transformers and the
rules of btlib/serve/app.py's docstring alone (no btlib code), and :func:`judge`, which says whether an answer is one.

:func:`expect` computes it: the numbers from
``SentenceTransformer(folder).encode(texts, prompt_name=, truncate_dim=, normalize_embeddings=)`` and
``CrossEncoder(folder).predict`` (logits; sigmoid unless raw_scores), token counts from sentence-transformers'
tokenizer on prompt + text against max_seq_length (a pair batched, as CrossEncoder tokenizes it), the refusals from
the rules:

    400 naming Host for a Host that is not this machine's; 422 naming the body for one that is not a JSON object in
    UTF-8 sent as application/json; 422 naming the field for an unknown field, a wrong JSON type (strict: "8" is
    not an int, "false" not a bool, null only where the field is optional), a missing required field; then 424 for
    the other model kind's route, 422 for dimensions outside 1..width, an
    unknown prompt_name, an empty input list, truncation_direction left, a lone surrogate (naming its field);
    413 for more inputs than max_inputs, or an input past max_seq_length with its prompt unless truncate (null:
    the server's --auto-truncate) is true. normalize=false on a Normalize folder: the folder's vector with its
    Normalize modules skipped (what TEI computes; TEI pools and normalises in its router).

The embedding routes' rules (the long-input mode, chunks, max_request_tokens, /embed_all's token states, a SPLADE
model's /embed_sparse) are tests/serve_oracle_embed.py's; tests/st_rows.py builds a chunked text's row by hand.

A request breaking several rules may be refused by any rule of its first layer (Host; body; fields; the rest),
since the rules give no order within a layer. An error body must be in its route's shape (/v1: OpenAI's
{"error": {"message", "type", "param", "code"}}, else TEI's {"error", "error_type"}). A finding is a 5xx, no answer, a 200
whose numbers differ from the oracle by more than 1e-5 of the rows' scale (a row cut to ``dimensions`` and not
renormalised: its full row's), a 200 where the rules refuse, a refusal where they answer, a status no broken rule
gives, or a message not naming what it refuses.

Where the rules are silent, what sentence-transformers / TEI do (decided here):

- "" is a text (200: ST encodes [CLS] [SEP] with its prompt; TEI too), "inputs": [] is refused (422, TEI's
  "`inputs` cannot be empty").
- Token-id inputs ([1, 2] or [[1, 2]]), which TEI and OpenAI accept, run as given: sentence-transformers' modules
  on those input_ids (no special tokens added, no prompt; cut at max_seq_length where truncation is allowed, else
  413 naming tokens); prompt_name with them is a 422 naming it, an empty id list or an id outside the model's
  vocabulary (config.json's vocab_size) a 422 naming the input field.
- prompt_name "query" / "document" on a folder that sets no such prompt is no prompt (ST's default prompts are "").
- A wrong Content-Type (or none) is 415 (axum's) or 422 (FastAPI's); a body in UTF-16 / UTF-32 is refused as
  serde_json refuses it (RFC 8259: JSON between systems is UTF-8); a UTF-8 BOM may be skipped or refused.
- usage.prompt_tokens counts what the model saw: with truncation, at most max_seq_length per input (as TEI).
- /rerank answers every text, highest score first, ties by index (TEI's top_n absent: all of them).
- An unknown path is 404, a GET on a POST route 405; neither is about a field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

ROUTES = {"embed": "/embed", "openai": "/v1/embeddings", "rerank": "/rerank", "embed_all": "/embed_all",
          "embed_sparse": "/embed_sparse"}
SERVES = {"embed": ("embedding", "sparse"), "openai": ("embedding",), "embed_all": ("embedding",),
          "embed_sparse": ("sparse",), "rerank": ("reranker",)}  # route -> the model kinds that answer it (else 424)
TOL = 1e-5  # fp32 against fp32: btlib's packed forward against transformers' padded one (tiny models: ~1e-7)


@dataclass
class Target:
    """One folder: its server, its oracle model (SentenceTransformer or CrossEncoder) and what the rules need."""

    name: str
    kind: str  # "embedding", "sparse" (SPLADE: a SparseEncoder as ref) or "reranker"
    ref: object
    url: str
    max_inputs: int
    auto_truncate: bool
    max_len: int
    width: int = 0  # embedding: the width ST reports (truncate_dim included)
    normalizes: bool = False
    prompts: dict = field(default_factory=dict)  # ST's, "query" / "document" defaults included
    default_prompt: str | None = None
    long_inputs: str = ""  # the server's mode: "refuse", "truncate" or "chunk" ("": from auto_truncate)
    budget: int = 512  # the batcher's max_batch_tokens
    max_request_tokens: int | None = None  # the batcher's cap on a request's tokens (after chunking)

    def __post_init__(self):
        self.long_inputs = self.long_inputs or ("truncate" if self.auto_truncate else "refuse")

    def prompt(self, name: str | None) -> str:
        """ST's rule: prompts[name], else the default prompt's text, else none."""
        if name is None:
            return self.prompts.get(self.default_prompt, "") if self.default_prompt else ""
        return self.prompts[name] or ""

    def tokens(self, text: str, name: str | None = None, pair: str | None = None) -> int:
        """Tokens of prompt + text (or the (query, text) pair), untruncated, by sentence-transformers' tokenizer."""
        tok = self.ref.tokenizer
        if pair is not None:  # batched, as CrossEncoder tokenizes: tok(q, "") alone drops the empty second text
            return len(tok([text], [pair], truncation=False)["input_ids"][0])
        return len(tok(self.prompt(name) + text, truncation=False)["input_ids"])


@dataclass
class Case:
    target: Target
    method: str
    path: str
    body: bytes
    headers: dict
    data: object = None  # what the body holds, as the oracle reads it (None with a malformed body)
    malformed: str | None = None  # why the body is not a JSON object in UTF-8 (the oracle's 422), or "bom"
    bad_host: bool = False


# -- the rules -------------------------------------------------------------------------------------------------------
def _str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ids(v) -> bool:  # one input's token ids, or a list of them
    return isinstance(v, list) and bool(v) and (all(_int(x) for x in v) or
                                                all(isinstance(r, list) and all(_int(x) for x in r) for r in v))


def _id_rows(v) -> list[list[int]] | None:
    """Token-id inputs as one id list per input; None for text inputs."""
    if not _ids(v):
        return None
    return [v] if _int(v[0]) else v


_TEXT = (lambda v: isinstance(v, str) or _str_list(v) or _ids(v), ...)  # ...: required
_BOOL = (lambda v: isinstance(v, bool), True)
_OPT_BOOL = (lambda v: v is None or isinstance(v, bool), None)
_OPT_STR = (lambda v: v is None or isinstance(v, str), None)
_OPT_INT = (lambda v: v is None or _int(v), None)
_DIRECTION = (lambda v: v in ("right", "Right", "left", "Left"), "right")
_LONG = {"long_inputs": (lambda v: v is None or v in ("refuse", "truncate", "chunk"), None), "chunk_overlap": _OPT_INT}
_TOKEN_STATES = {"inputs": _TEXT, "truncate": _OPT_BOOL, "truncation_direction": _DIRECTION, "prompt_name": _OPT_STR}
FIELDS = {  # route -> field -> (accepts the JSON value, default); app.py's docstring, strict JSON types
    "embed": {"inputs": _TEXT, "normalize": _BOOL, "truncate": _OPT_BOOL, "truncation_direction": _DIRECTION,
              "prompt_name": _OPT_STR, "dimensions": _OPT_INT, **_LONG},
    "openai": {"input": _TEXT, "model": _OPT_STR, "encoding_format": (lambda v: v in ("float", "base64"), "float"),
               "dimensions": _OPT_INT, "user": _OPT_STR, "prompt_name": _OPT_STR, **_LONG},
    "embed_all": _TOKEN_STATES,
    "embed_sparse": _TOKEN_STATES,  # TEI's EmbedAllRequest and EmbedSparseRequest take the same fields
    "rerank": {"query": (lambda v: isinstance(v, str), ...), "texts": (_str_list, ...), "raw_scores": (_BOOL[0], False),
               "return_text": (_BOOL[0], False), "truncate": _OPT_BOOL, "truncation_direction": _DIRECTION},
}


@dataclass
class Refusal:
    layer: int  # 0 Host, 1 the body, 2 a field's type, 3 the rest: a request is refused by a rule of its first layer
    statuses: tuple[int, ...]
    names: tuple[str, ...]  # the message names one of them (case-insensitive); () for a 404 / 405
    why: str


@dataclass
class Expect:
    refusals: list[Refusal]
    ok: Callable[[object], str | None] | None = None  # a 200's checker (None: a 200 is wrong)
    also: list[Refusal] = field(default_factory=list)  # refusals allowed whatever the rest says (a UTF-8 BOM's)
    tokens: int = 0  # what a 200 runs (chunks included): the time bound's measure (tests/serve_budget.py)
    chunked: int = 0  # texts a 200 runs as several chunks

    def allowed(self) -> list[Refusal]:
        first = min((r.layer for r in self.refusals), default=None)
        return [r for r in self.refusals if r.layer == first] + self.also


def surrogate(text: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def expect(case: Case) -> Expect:
    """What the answer to ``case`` must be, from sentence-transformers and the rules (module docstring) alone."""
    route = next((k for k, v in ROUTES.items() if v == case.path), None)
    if case.bad_host:
        return Expect([Refusal(0, (400,), ("Host",), "a Host that is not this machine")])
    if route is None or case.method != "POST":
        return Expect([Refusal(0, (404, 405), (), "no such route")])
    if case.malformed and case.malformed != "bom":
        statuses = (415, 422) if "content-type" in case.malformed else (422,)
        return Expect([Refusal(1, statuses, ("body", "JSON", "Content-Type", "UTF-8"), case.malformed)])
    exp = _expect_fields(case.target, route, case.data)
    if case.malformed == "bom":  # may be skipped or refused as not JSON (serde_json)
        exp.also.append(Refusal(1, (422,), ("body", "JSON", "UTF-8", "BOM"), "a UTF-8 BOM"))
    return exp


def _expect_fields(t: Target, route: str, data: dict) -> Expect:
    refusals = []
    fields = FIELDS[route]
    for name in data:
        if name not in fields:
            refusals.append(Refusal(2, (422,), (name,), f"unknown field {name!r}"))
    for name, (accepts, default) in fields.items():
        if name not in data and default is ...:
            refusals.append(Refusal(2, (422,), (name,), f"{name} missing"))
        elif name in data and not accepts(data[name]):
            refusals.append(Refusal(2, (422,), (name,), f"{name}={data[name]!r:.40}"))
    if refusals:
        return Expect(refusals)
    get = lambda name: data.get(name, fields[name][1])  # noqa: E731
    if route == "rerank":
        semantic, check, several = _rerank_rules(t, get), _rerank_answer(t, get), 0
        tokens = 0 if semantic else sum(min(t.tokens(get("query"), pair=x), t.max_len) for x in get("texts"))
    else:
        from serve_oracle_embed import embedding_expect  # it imports this module's types

        semantic, check, tokens, several = embedding_expect(t, route, get)
    if semantic:
        return Expect([Refusal(3, *s) for s in semantic])
    return Expect([], check, tokens=tokens, chunked=several)


def _rerank_rules(t: Target, get) -> list[tuple]:
    query, texts = get("query"), get("texts")
    out = [] if t.kind == "reranker" else [((424,), ("reranker",), f"a {t.kind} model's server")]
    if get("truncation_direction").lower() != "right":
        out.append(((422,), ("truncation_direction",), "truncation_direction left"))
    if not texts:
        out.append(((422,), ("texts",), "no texts"))
    if len(texts) > t.max_inputs:
        out.append(((413,), ("texts",), f"{len(texts)} texts > max_inputs {t.max_inputs}"))
    if surrogate(query):
        out.append(((422,), ("query",), "query lone surrogate"))
    out += [((422,), (f"texts[{i}]",), f"texts[{i}] lone surrogate") for i, x in enumerate(texts) if surrogate(x)]
    truncate = get("truncate") if get("truncate") is not None else t.auto_truncate
    if t.kind == "reranker" and not truncate and not surrogate(query):
        out += [((413,), ("tokens",), f"pair {i} past {t.max_len} tokens") for i, x in enumerate(texts)
                if not surrogate(x) and t.tokens(query, pair=x) > t.max_len]
    return out


def close(got, ref: torch.Tensor, scale: float | None = None) -> str | None:
    """None when ``got`` equals ``ref`` (N, d) within TOL of ``scale`` (default: the reference's); else what differs."""
    try:
        got = torch.as_tensor(np.asarray(got, dtype=np.float32))
    except (TypeError, ValueError) as e:
        return f"answer is not a float matrix ({e})"
    ref = ref.float()
    if got.shape != ref.shape:
        return f"shape {tuple(got.shape)}, sentence-transformers gives {tuple(ref.shape)}"
    scale = scale if scale is not None else float(ref.abs().max()) if ref.numel() else 0.0
    err = float((got - ref).abs().max()) if ref.numel() else 0.0
    if not err <= TOL * max(scale, 1e-6):
        return f"max |diff| {err:.3g} ({err / max(scale, 1e-30):.3g} of the scale {scale:.3g}) from sentence-transformers"
    return None


def _rerank_answer(t: Target, get):
    query, texts, raw = get("query"), get("texts"), get("raw_scores")

    def check(answer) -> str | None:
        logits = t.ref.predict([(query, x) for x in texts], activation_fn=torch.nn.Identity(), convert_to_tensor=True)
        ref = logits.float().reshape(-1) if raw else torch.sigmoid(logits.float()).reshape(-1)
        try:
            index = [d["index"] for d in answer]
            scores = [d["score"] for d in answer]
            extra = [set(d) - {"index", "score"} for d in answer]
        except (KeyError, TypeError) as e:
            return f"not TEI's rank list ({type(e).__name__}: {e}): {str(answer)[:200]}"
        if sorted(index) != list(range(len(texts))):
            return f"indices {index} for {len(texts)} texts"
        if any(a < b or (a == b and i > j) for a, b, i, j in zip(scores, scores[1:], index, index[1:])):
            return f"not sorted by score, ties by index: {list(zip(index, scores))}"
        if get("return_text") != all(e == {"text"} for e in extra) or any(e - {"text"} for e in extra):
            return f"fields {extra} with return_text={get('return_text')}"
        if get("return_text") and any(d["text"] != texts[d["index"]] for d in answer):
            return "a text that is not texts[index]"
        return close([scores], ref[index].unsqueeze(0))
    return check


# -- an answer against the expectation -------------------------------------------------------------------------------
def judge(case: Case, exp: Expect, status: int, raw: bytes) -> str | None:
    """None when the answer is one the rules allow; else the finding."""
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    if status >= 500:
        return f"{status}: {raw[:300]!r}"
    if status == 200:
        if exp.ok is None:
            return f"200 where the rules say {' / '.join(r.why for r in exp.allowed())}: {raw[:120]!r}"
        return exp.ok(answer) if answer is not None else f"200 that is not JSON: {raw[:120]!r}"
    allowed = exp.allowed()
    reasons = " / ".join(r.why for r in allowed)
    if not allowed:
        return f"{status} where the rules say 200: {raw[:300]!r}"
    matching = [r for r in allowed if status in r.statuses]
    if not matching:
        statuses = "/".join(str(s) for r in allowed for s in r.statuses)
        return f"{status} where the rules say {reasons} ({statuses}): {raw[:300]!r}"
    if status in (404, 405):
        return None
    try:
        message = answer["error"]["message"] if case.path.startswith("/v1/") else answer["error"]
        shape = (set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["code"] == status
                 if case.path.startswith("/v1/") else set(answer) == {"error", "error_type"})
    except (KeyError, TypeError):
        message, shape = None, False
    if not shape or not isinstance(message, str):
        return f"{status} not in {case.path}'s error shape: {raw[:300]!r}"
    names = sorted({n for r in matching for n in r.names})
    if not any(n.lower() in message.lower() for n in names):
        return f"{status} for {reasons}, but the message names none of {names}: {message!r:.300}"
    return None
