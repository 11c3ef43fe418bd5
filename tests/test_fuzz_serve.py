"""The server fuzzer (tests/fuzz_serve.py) at a small budget: random requests to nine servers of seven tiny folders
(three chunking ones with a cap on a request's tokens, and a SPLADE one, among them), every answer checked against
sentence-transformers (SentenceTransformer.encode, its token_embeddings, SparseEncoder.encode, CrossEncoder.predict;
chunked texts' rows built by hand) and the rules of btlib/serve's docstrings, never against btlib's own code; and
each case's time, peak memory and largest forward against tests/serve_budget.py's bounds.

BTLIB_FUZZ_SERVE_CASES cases (default 200, ~30 s after ~10 s of writing folders, starting servers and measuring
their rates, then 60 of one request per server, the leak check; seeded, so `make test` runs the same cases every time). A longer run:
    python tests/fuzz_serve.py --cases 1000 [--seed S]
"""

import json
import os
from collections import Counter

import pytest

from btlib.serve.remote import http_missing

pytestmark = pytest.mark.skipif(http_missing() is not None, reason=str(http_missing()))
pytest.importorskip("httpx")
pytest.importorskip("sentence_transformers")

import fuzz_serve  # noqa: E402
import serve_oracle  # noqa: E402
import st_rows  # noqa: E402

TESTED_HERE = ["btlib.serve.app", "btlib.serve.bodies", "btlib.serve.guards", "btlib.serve.batcher", "btlib.serve.rerank",
               "btlib.serve.slices", "btlib.serve.fields"]


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


def test_the_oracle_of_long_inputs_and_the_newer_routes(targets):
    """The rules of btlib/serve/service.py's and btlib/pretrained/chunking.py's docstrings as the fuzzer reads them."""
    p, ch, sp = targets["prompted"], targets["chunking"], targets["splade"]
    long = " ".join(f"w{i}" for i in range(20))  # 20 content tokens: 3 chunks of the default prompt's window 8
    assert st_rows.chunk_ids(ch, long, None, None) == [
        [2, 6, 7, *range(5, 13), 3], [2, 6, 7, *range(12, 20), 3], [2, 6, 7, *range(19, 25), 3]]  # overlap 8 // 8
    assert _allowed(p, "/embed", {"inputs": long, "long_inputs": "chunk"}) == [(422, "long_inputs")]
    assert _allowed(p, "/embed", {"inputs": "w1", "chunk_overlap": 1}) == [(422, "chunk_overlap")]
    assert _allowed(ch, "/embed", {"inputs": long}) == [(200, "")]
    assert _allowed(ch, "/embed", {"inputs": long, "truncate": False}) == [(413, "tokens")]
    assert _allowed(ch, "/embed", {"inputs": long, "truncate": True, "long_inputs": "chunk"}) == [(422, "long_inputs")]
    assert _allowed(ch, "/v1/embeddings", {"input": "w1", "chunk_overlap": 8}) == [(422, "chunk_overlap")]
    assert _allowed(ch, "/v1/embeddings", {"input": "w1", "chunk_overlap": 8, "prompt_name": "document"}) == [(200, "")]
    assert _allowed(ch, "/embed", {"inputs": [long] * 5}) == [(413, "max_request_tokens")]  # 5 x 34 tokens > 160
    assert _allowed(ch, "/embed_all", {"inputs": long}) == [(413, "tokens")]  # token states: never chunked
    assert _allowed(ch, "/embed_all", {"inputs": long, "long_inputs": "chunk"}) == [(422, "long_inputs")]
    assert _allowed(sp, "/embed", {"inputs": "w1"}) == [(424, "normalize")]
    assert _allowed(sp, "/embed", {"inputs": "w1", "normalize": False}) == [(200, "")]
    assert _allowed(sp, "/embed_sparse", {"inputs": "w1", "dimensions": 4}) == [(422, "dimensions")]
    assert _allowed(sp, "/embed_all", {"inputs": "w1"}) == [(424, "sparse")]
    assert _allowed(p, "/embed_sparse", {"inputs": "w1"}) == [(424, "sparse")]


def test_random_requests_answer_as_sentence_transformers_or_are_refused_by_name(targets):
    seen, watch = Counter(), []
    cases, findings = fuzz_serve.run(list(targets.values()), int(os.environ.get("BTLIB_FUZZ_SERVE_CASES", "200")), seed=0,
                                     seen=seen, watch=watch, repeats=60)
    assert findings == [], f"{len(findings)} findings in {cases} cases:\n" + "\n".join(findings)
    served = {key for (group, key, outcome) in seen if group == "server" and outcome == "200"}
    assert served == set(targets), f"servers that answered no case: {set(targets) - served}"
    assert sum(v for (group, key, _), v in seen.items() if group == "kind" and key.startswith("200 with texts")) > 0
