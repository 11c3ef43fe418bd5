"""The long_inputs benchmark: its reference (each window alone through PyTorch's modules, pooled by hand) equals
encode(long_inputs="chunk"), and a run checks, times and reports the tokens each mode ran."""

import pytest
import torch

from btlib import bench
from btlib.bench.long_inputs import chunked_reference, documents
from model_folder import needs_model

pytestmark = needs_model


@pytest.mark.parametrize("words", [1, 97, 230, 700])  # one token of content; one window; just past it; three windows
def test_reference_equals_chunked_encode(model, words):
    docs = documents(2, words, seed=words)
    got = model.encode(docs, long_inputs="chunk")
    ref = chunked_reference(model, docs)
    assert got.shape == ref.shape == (2, 384)
    assert float((got - ref).abs().max()) <= 1e-5


def test_run_checks_times_and_counts_tokens():
    rows = bench.run(bench.load_all()["long_inputs"], x_vals=[600], params={"docs": 2}, save=False, warmup=0,
                     min_runs=1, max_runs=1)
    chunk = bench.find_row(rows, "chunk", 600)
    truncate = bench.find_row(rows, "truncate", 600)
    assert chunk["status"] == truncate["status"] == "ok" and chunk["error"] <= 1e-5
    assert chunk["chunks_per_doc"] == 3 and chunk["tokens_chunk"] > 2.5 * chunk["tokens_truncate"]
    assert chunk["tokens_truncate"] == 2 * 256  # each document cut at MiniLM's max_length
    assert 0.5 < chunk["min_cos_truncate"] < 1.0  # the truncated vector leaves part of the document out
