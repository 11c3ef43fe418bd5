"""btlib.pretrained.sparse: SPLADE folders that sentence-transformers' SparseEncoder saves, encoded on the packed path.

Checks: SparseModel.encode equals SparseEncoder.encode within 1e-5 (relative to the rows' scale) for max and sum
pooling, relu and log1p_relu, tied and untied decoders, odd lengths, batch 1 and a text of one word token, and
with max_active_dims;
SpladeHead on packed states equals the padded, masked reference for lengths [1, 97, 3]; what btlib does not run is
refused by name. Tiny random folders, written offline by transformers and sentence-transformers themselves.
"""

import json

import pytest
import torch

from btlib.pretrained import load_pretrained
from btlib.pretrained.folders.checkpoint import CheckpointError
from btlib.pretrained.sparse import SpladeHead, load_sparse
from st_folders import write_hf

TEXTS = ["w1 w2 w3", "W4", "w5 W6 " * 20, "", "W1 w2 W3 w4 W5 w6 w7", "w9 w10 W10 w11 w12"]


def write_splade(folder, pooling="max", activation="relu", seed=0, **config):
    """A random tiny BertForMaskedLM wrapped as SparseEncoder(MLMTransformer, SpladePooling) and saved; returns folder."""
    import transformers as tf
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    base = write_hf(folder.parent / f"{folder.name}_hf", "bert", seed=seed, model_cls=tf.BertForMaskedLM, **config)
    SparseEncoder(modules=[MLMTransformer(str(base)), SpladePooling(pooling, activation)], device="cpu").save(str(folder))
    return folder


def reference(folder, texts, batch_size):
    from sentence_transformers import SparseEncoder

    return SparseEncoder(str(folder), device="cpu").encode(texts, batch_size=batch_size, convert_to_tensor=True).to_dense()


@pytest.mark.parametrize("pooling,activation,tied", [("max", "relu", True), ("sum", "relu", True),
                                                     ("max", "log1p_relu", False)])
def test_encode_matches_sparse_encoder(tmp_path, pooling, activation, tied):
    folder = write_splade(tmp_path / "splade", pooling, activation, tie_word_embeddings=tied)
    model = load_sparse(folder)
    assert model.splade.pooling == pooling and model.splade.activation == activation
    ref = reference(folder, TEXTS, 4)
    for batch_size in (1, 4):
        got = model.encode(TEXTS, batch_size=batch_size)
        assert got.is_sparse and got.shape == ref.shape == (len(TEXTS), model.vocab_size)
        err = (got.to_dense() - ref).abs().max().item()
        assert err <= 1e-5 * max(1.0, ref.abs().max().item()), err
    one = model.encode(["W4"], convert_to_sparse_tensor=False)  # one word token ([CLS] W4 [SEP])
    assert not one.is_sparse and torch.allclose(one, reference(folder, ["W4"], 1), atol=1e-5, rtol=0)


def test_max_active_dims_as_sparse_encoder(tmp_path):
    from sentence_transformers import SparseEncoder

    folder = write_splade(tmp_path / "splade")
    ref = SparseEncoder(str(folder), device="cpu").encode(TEXTS, max_active_dims=5, convert_to_tensor=True).to_dense()
    got = load_sparse(folder).encode(TEXTS, max_active_dims=5)
    assert got.to_dense().ne(0).sum(-1).tolist() == ref.ne(0).sum(-1).tolist() == [5] * len(TEXTS)
    assert torch.allclose(got.to_dense(), ref, atol=1e-5, rtol=0)


def test_untied_decoder_is_read(tmp_path):
    folder = write_splade(tmp_path / "splade", tie_word_embeddings=False)
    model = load_sparse(folder)
    assert not torch.equal(model.splade.decoder_weight, model.embeddings.word.weight)


def test_head_on_packed_states_equals_padded_reference():
    torch.manual_seed(0)
    d, V, lengths = 16, 50, [1, 97, 3]
    head = SpladeHead(torch.nn.Linear(d, d), "gelu", torch.nn.LayerNorm(d), torch.randn(V, d), torch.randn(V), "max")
    h = torch.randn(sum(lengths), d)
    cu_seqlens = torch.tensor([0, 1, 98, 101], dtype=torch.int32)
    T = max(lengths)
    padded = torch.zeros(len(lengths), T, d)  # sentence-transformers' layout: (B, T, d) + mask
    mask = torch.zeros(len(lengths), T)
    for b, (a, n) in enumerate(zip(cu_seqlens[:-1].tolist(), lengths)):
        padded[b, :n], mask[b, :n] = h[a:a + n], 1
    logits = torch.nn.functional.linear(head.norm(torch.nn.functional.gelu(head.dense(padded))), head.decoder_weight,
                                        head.decoder_bias)
    want = torch.log1p(torch.relu(logits * mask.unsqueeze(-1))).amax(dim=1)  # (B, V)
    with torch.no_grad():
        assert torch.allclose(head(h, cu_seqlens), want, atol=1e-5, rtol=0)


def test_refusals_name_what_is_not_run(tmp_path):
    folder = write_splade(tmp_path / "splade")
    model = load_sparse(folder)
    with pytest.raises(ValueError, match="chunk_size"):
        model.encode(TEXTS, chunk_size=8)
    with pytest.raises(ValueError, match="max_active_dims"):
        model.encode(TEXTS, max_active_dims=0)
    with pytest.raises(ValueError, match="long_inputs"):
        model.encode(TEXTS, long_inputs="chunk")
    cfg = folder / "1_SpladePooling" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "pooling_strategy": "mean"}))
    with pytest.raises(CheckpointError, match="pooling_strategy"):
        load_sparse(folder)
    with pytest.raises(CheckpointError, match="load_sparse"):  # the dense loader points to this one
        load_pretrained(folder)
    with pytest.raises(CheckpointError, match="modules.json"):
        load_sparse(write_hf(tmp_path / "dense", "bert"))
