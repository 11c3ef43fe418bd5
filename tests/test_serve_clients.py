"""The client libraries people point at a TEI or OpenAI server, unchanged, against btlib.serve on loopback.

huggingface_hub.InferenceClient(model=URL) posts to the server's root (TEI's POST /, which this server dispatches by
model kind and body): feature_extraction, sentence_similarity, text_classification (a reranker's /predict, given a
[query, text] pair); AsyncInferenceClient the same. LangChain's HuggingFaceEndpointEmbeddings is
InferenceClient(model=URL).feature_extraction(text=[...]) (langchain_huggingface 1.2.3, huggingface_endpoint.py:
embed_documents; embed_query is embed_documents([text])[0]), and langchain-core is not installed here, so its exact
call is what runs below. The openai client: embeddings.create with dimensions and token-id input, models.list.
Every vector equals btlib's in-process ``encode`` (one request at a time is its own batch: bit for bit, checked
within 1e-6).
"""

import asyncio

import numpy as np
import pytest
import torch

from btlib.serve.extras import missing
from model_folder import needs_model
from serve_helpers import running_app

pytestmark = [needs_model, pytest.mark.skipif(missing("fastapi", "serve") is not None, reason=str(missing("fastapi", "serve")))]

TESTED_HERE = ["btlib.serve.tei", "btlib.serve.openai_routes", "btlib.serve.rerank_routes", "btlib.serve.service"]
TEXTS = ["what is packing?", "padding-free batches", "a third, longer text about packed sequences"]
TOL = 1e-6


@pytest.fixture(scope="module")
def server(model):
    with running_app(model, max_inputs=8) as running:
        yield running


def _close(got, ref) -> None:
    got = torch.as_tensor(np.asarray(got, dtype=np.float32))
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert float((got - ref).abs().max()) <= TOL, float((got - ref).abs().max())


def test_huggingface_hub_feature_extraction_and_langchains_call(server, model):
    hub = pytest.importorskip("huggingface_hub")
    client = hub.InferenceClient(model=server.url)
    _close(client.feature_extraction("what is packing?"), model.encode(["what is packing?"]))
    # LangChain's HuggingFaceEndpointEmbeddings.embed_documents: feature_extraction(text=texts).tolist()
    _close(client.feature_extraction(text=[t.replace("\n", " ") for t in TEXTS]).tolist(), model.encode(TEXTS))
    head = model.head
    try:
        model.head = head.without_normalize()
        raw = model.encode(TEXTS[:1])
    finally:
        model.head = head
    _close(client.feature_extraction(TEXTS[0], normalize=False), raw)  # TEI's normalize=false: before Normalize
    with pytest.raises(hub.errors.HfHubHTTPError) as e:  # refused by name, never ignored
        client.feature_extraction(TEXTS[0], truncation_direction="left")
    assert e.value.response.status_code == 422 and "truncation_direction" in e.value.response.json()["error"]

    async def aembed():  # LangChain's aembed_documents: AsyncInferenceClient(model=URL).feature_extraction(text=texts)
        return await hub.AsyncInferenceClient(model=server.url).feature_extraction(text=TEXTS)

    _close(asyncio.run(aembed()), model.encode(TEXTS))


def test_huggingface_hub_sentence_similarity(server, model):
    hub = pytest.importorskip("huggingface_hub")
    got = hub.InferenceClient(model=server.url).sentence_similarity(TEXTS[0], other_sentences=TEXTS[1:])
    emb = model.encode(TEXTS).double()
    ref = torch.nn.functional.cosine_similarity(emb[:1], emb[1:], dim=-1).float()
    _close(got, ref)


def test_openai_client_dimensions_token_ids_and_models(server, model):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    res = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS, dimensions=128)  # base64 by default
    ref = torch.nn.functional.normalize(model.encode(TEXTS)[:, :128], dim=-1)  # Matryoshka: truncate, renormalise
    _close([d.embedding for d in res.data], ref)
    ids = model.tokenize(TEXTS)
    res = client.embeddings.create(model="m", input=ids)  # a list of lists of ints: run as given
    _close([d.embedding for d in res.data], model.encode(TEXTS))
    assert res.usage.prompt_tokens == sum(len(r) for r in ids)
    res = client.embeddings.create(model="m", input=ids[0], encoding_format="float")  # one list of ints: one input
    _close([d.embedding for d in res.data], model.encode(TEXTS[:1]))
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.embeddings.create(model="m", input="x", dimensions=385)
    assert e.value.body["param"] == "dimensions" and "ask for 1 to 384" in e.value.body["message"]
    assert [m.id for m in client.models.list()] == ["all-MiniLM-L6-v2"]
    assert client.models.retrieve("all-MiniLM-L6-v2").owned_by == "btlib"
    # TEI's own path for OpenAI's body: the client with base_url at the root
    root = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    _close([d.embedding for d in root.embeddings.create(model="m", input=TEXTS).data], model.encode(TEXTS))


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    pytest.importorskip("transformers")
    from btlib import load_reranker
    from test_serve_rerank import _reranker_folder

    return load_reranker(_reranker_folder(tmp_path_factory.mktemp("ce") / "ce"))


def test_huggingface_hub_text_classification_on_a_reranker(reranker):
    """text_classification posts {"inputs": text, "parameters": {}} to the root: a reranker's /predict. Typed for one
    str, it takes a [query, text] pair as TEI's /predict does; a lone text is refused (a cross-encoder scores pairs)."""
    hub = pytest.importorskip("huggingface_hub")
    from btlib.serve.rerank import PairScorer

    with running_app(PairScorer(reranker), max_inputs=8) as server:
        client = hub.InferenceClient(model=server.url)
        got = client.text_classification(["w1 w2", "w1 w3 w4"])  # one pair: its one label, the sigmoid of its logit
        ref = reranker.predict([("w1 w2", "w1 w3 w4")], activation="sigmoid")
        assert got.label == "LABEL_0" and abs(got.score - float(ref[0])) <= TOL
        raw = client.text_classification(["w1 w2", "w1 w3 w4"], function_to_apply="none")
        assert abs(raw.score - float(reranker.predict([("w1 w2", "w1 w3 w4")], activation="identity")[0])) <= TOL
        with pytest.raises(hub.errors.HfHubHTTPError) as e:
            client.text_classification("w1 w2")
        assert e.value.response.status_code == 422 and "pairs" in e.value.response.json()["error"]
