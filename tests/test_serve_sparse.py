"""A SPLADE model served (btlib.pretrained.sparse through btlib.serve): /embed_sparse in TEI's shape, /embed with
normalize=false (the dense rows) and the refusals TEI gives a SPLADE model, over httpx on loopback.

The model is a tiny random SparseEncoder folder (tests/test_sparse.py's); /embed_sparse's entries are checked
against sentence-transformers' SparseEncoder.encode (1e-5) and against btlib's in-process encode (the same floats:
one request at a time is its own batch); `python -m btlib.serve`'s choice of loader is checked by is_sparse_folder.
"""

import pytest
import torch

from btlib.pretrained.sparse import is_sparse_folder, load_sparse
from btlib.serve.extras import missing
from serve_helpers import client_of, running_app
from test_sparse import TEXTS, reference, write_splade

pytestmark = pytest.mark.skipif(missing("fastapi", "serve") is not None, reason=str(missing("fastapi", "serve")))
httpx = pytest.importorskip("httpx")

TESTED_HERE = ["btlib.serve.tei", "btlib.serve.service", "btlib.serve.__main__"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_splade(tmp_path_factory.mktemp("serve_sparse") / "splade")


@pytest.fixture(scope="module")
def served(folder):
    model = load_sparse(folder)
    with running_app(model, max_inputs=8, auto_truncate=True) as server, client_of(server) as c:
        yield model, c


def test_embed_sparse_answers_tei_shape_equal_to_sparse_encoder(served, folder):
    model, client = served
    r = client.post("/embed_sparse", json={"inputs": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body) == len(TEXTS) and int(r.headers["x-compute-tokens"]) > 0
    got = torch.zeros(len(TEXTS), model.vocab_size)
    for i, entries in enumerate(body):
        assert entries and all(set(e) == {"index", "value"} and e["value"] != 0 for e in entries)
        assert [e["index"] for e in entries] == sorted(e["index"] for e in entries)
        for e in entries:
            got[i, e["index"]] = e["value"]
    ref = reference(folder, TEXTS, 4)
    assert (got - ref).abs().max().item() <= 1e-5
    one = client.post("/embed_sparse", json={"inputs": "W4"}).json()  # a str input: one row
    assert len(one) == 1 and torch.equal(torch.tensor([e["value"] for e in one[0]]),
                                         model.encode(["W4"]).coalesce().values())


def test_embed_as_tei_on_a_splade_model(served):
    model, client = served
    r = client.post("/embed", json={"inputs": ["w1 w2", "W4"]})  # normalize defaults to true: TEI refuses it
    assert r.status_code == 424 and "normalize" in r.json()["error"]
    r = client.post("/embed", json={"inputs": ["w1 w2", "W4"], "normalize": False})
    assert r.status_code == 200, r.text
    assert torch.equal(torch.tensor(r.json()), model.encode(["w1 w2", "W4"], convert_to_sparse_tensor=False))
    r = client.post("/embed", json={"inputs": "w1", "normalize": False, "dimensions": 8})
    assert r.status_code == 422 and "dimensions" in r.json()["error"]


@pytest.mark.parametrize("route,body", [("/embed_all", {"inputs": "w1"}), ("/v1/embeddings", {"input": "w1", "model": "m"}),
                                        ("/similarity", {"inputs": {"source_sentence": "w1", "sentences": ["w2"]}})])
def test_dense_routes_refuse_a_splade_model(served, route, body):
    r = served[1].post(route, json=body)
    assert r.status_code == 424 and "sparse (SPLADE)" in r.text


def test_info_and_the_cli_loader(served, folder, tmp_path):
    assert served[1].get("/info").json()["model_type"] == {"embedding": {"pooling": "splade"}}
    assert is_sparse_folder(folder) and not is_sparse_folder(tmp_path)
