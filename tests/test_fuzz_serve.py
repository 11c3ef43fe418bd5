"""The server fuzzer (tests/fuzz_serve.py) at a small budget: random requests to five tiny folders' servers, every
answer checked against sentence-transformers (SentenceTransformer.encode, CrossEncoder.predict) and the rules of
btlib/serve/app.py's docstring, never against btlib's own code.

BTLIB_FUZZ_SERVE_CASES cases (default 1000, ~6 s after ~5 s of writing folders and starting servers; seeded, so
`make test` runs the same cases every time). A longer run:
    python tests/fuzz_serve.py --cases 1000 [--seed S]
"""

import json
import os

import pytest

from btlib.serve.remote import http_missing

pytestmark = pytest.mark.skipif(http_missing() is not None, reason=str(http_missing()))
pytest.importorskip("httpx")
pytest.importorskip("sentence_transformers")

import fuzz_serve  # noqa: E402
import serve_oracle  # noqa: E402

TESTED_HERE = ["btlib.serve.app", "btlib.serve.bodies", "btlib.serve.guards", "btlib.serve.batcher", "btlib.serve.rerank"]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    with fuzz_serve.campaign(tmp_path_factory.mktemp("fuzz_serve")) as running:
        yield {t.name: t for t in running}


def _allowed(t, path: str, data, **case) -> list[tuple[int, str]]:
    exp = serve_oracle.expect(serve_oracle.Case(t, "POST", path, json.dumps(data).encode(), {}, data, **case))
    return [(r.statuses[-1], r.names[0]) for r in exp.allowed()] if exp.ok is None else [(200, "")]


def test_the_oracle_itself(targets):
    """The rules as the fuzzer reads them, on cases app.py's docstring spells out."""
    p, ce = targets["prompted"], targets["reranker"]
    ten = " ".join(f"w{i}" for i in range(10))  # 12 tokens, 14 with the default prompt: past max_seq_length 12
    assert _allowed(p, "/embed", {"inputs": ten}) == [(413, "tokens")]
    assert _allowed(p, "/embed", {"inputs": ten, "truncate": True}) == [(200, "")]
    assert _allowed(p, "/embed", {"inputs": ten, "prompt_name": "document", "truncate": False}) == [(200, "")]
    assert _allowed(p, "/embed", {"inputs": "w1", "prompt_name": "search"}) == [(422, "prompt_name")]
    assert _allowed(p, "/embed", {"inputs": "w1", "normalize": "false"}) == [(422, "normalize")]
    assert _allowed(p, "/embed", {"inputs": "w1", "normalize": False}) == [(200, "")]  # before the Normalize module
    assert _allowed(targets["dense"], "/embed", {"inputs": "w1", "normalize": False}) == [(200, "")]
    assert _allowed(p, "/v1/embeddings", {"input": ["w1"] * 7}) == [(413, "input")]
    assert _allowed(p, "/v1/embeddings", {"input": "w1", "dimensions": 33}) == [(422, "dimensions")]
    assert _allowed(targets["truncate_dim"], "/v1/embeddings", {"input": "w1", "dimensions": 17}) == [(422, "dimensions")]
    assert _allowed(p, "/v1/embeddings", {"input": "w1 \ud800"}) == [(422, "input")]
    assert _allowed(p, "/v1/embeddings", {"input": [[1, 2]], "foo": 1}) == [(422, "foo")]
    assert _allowed(p, "/v1/embeddings", {"input": [[2, 7, 3]]}) == [(200, "")]  # token ids run as given
    assert _allowed(p, "/v1/embeddings", {"input": [2, 7, 3], "prompt_name": "query"}) == [(422, "prompt_name")]
    assert _allowed(p, "/embed", {"inputs": [[2] * 13]}) == [(413, "tokens")]
    assert _allowed(p, "/embed", {"inputs": [[2] * 13], "truncate": True}) == [(200, "")]
    assert _allowed(p, "/embed", {"inputs": [[2, 10**6]]}) == [(422, "inputs")]
    assert _allowed(p, "/embed", {"inputs": [["w1"]]}) == [(422, "inputs")]
    assert _allowed(p, "/rerank", {"query": "w1", "texts": ["w2"]}) == [(424, "reranker")]
    assert _allowed(ce, "/rerank", {"query": "w1 " * 22, "texts": [""], "truncate": False}) == [(413, "tokens")]
    assert _allowed(ce, "/rerank", {"query": "w1", "texts": ["w2"]}, bad_host=True) == [(400, "Host")]
    assert _allowed(ce, "/rerank", None, malformed="utf-16") == [(422, "body")]


def test_random_requests_answer_as_sentence_transformers_or_are_refused_by_name(targets):
    cases, findings = fuzz_serve.run(list(targets.values()), int(os.environ.get("BTLIB_FUZZ_SERVE_CASES", "1000")), seed=0)
    assert findings == [], f"{len(findings)} findings in {cases} cases:\n" + "\n".join(findings)
