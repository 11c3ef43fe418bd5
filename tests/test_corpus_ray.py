"""CorpusEmbedder: the batch formats Ray Data passes, its errors, and one run on a local Ray cluster over Parquet."""

import numpy as np
import pytest
import torch

from btlib.serve import CorpusEmbedder
from btlib.serve.extras import missing
from model_folder import needs_model

# CorpusEmbedder and ray_embed_parquet, imported through btlib.serve.
TESTED_HERE = ["btlib.serve.corpus"]

pytestmark = needs_model

TEXTS = ["ray data streams batches", "a", "", "each actor loads the model once and embeds many batches of rows",
         "mixed lengths"] * 4


@pytest.fixture(scope="module")
def embedder():
    return CorpusEmbedder(max_batch_tokens=32)  # no folder: the default model


def test_numpy_and_pandas_batches(embedder, model):
    out = embedder({"text": np.array(TEXTS[:5], dtype=object), "id": np.arange(5)})
    assert out["embedding"].shape == (5, 384) and out["embedding"].dtype == np.float32 and list(out["id"]) == list(range(5))
    torch.testing.assert_close(torch.from_numpy(out["embedding"]), model.encode(TEXTS[:5]), atol=1e-6, rtol=0)
    pd = pytest.importorskip("pandas")
    df = embedder(pd.DataFrame({"text": TEXTS[:3]}))
    assert np.array_equal(np.stack(df["embedding"]), embedder({"text": np.array(TEXTS[:3], dtype=object)})["embedding"])


def test_columns_are_keywords_and_bad_batches_say_what_to_pass(model):
    e = CorpusEmbedder(text_column="body", embedding_column="vec")
    assert e({"body": ["x"]})["vec"].shape == (1, 384)
    with pytest.raises(ValueError, match="no column 'body'.*text_column="):
        e({"text": ["x"]})
    with pytest.raises(TypeError, match="row 1 is NoneType"):
        e({"body": ["x", None]})


@pytest.mark.slow
@pytest.mark.skipif(missing("ray", "scale") is not None, reason=str(missing("ray", "scale")))
def test_ray_data_map_batches_on_a_local_cluster(tmp_path, model):
    """ray.init(num_cpus=2); read_parquet -> map_batches(CorpusEmbedder, concurrency=1) -> write_parquet: every row, its embedding."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

    from btlib.serve import ray_embed_parquet

    pq.write_table(pa.table({"text": TEXTS, "id": list(range(len(TEXTS)))}), tmp_path / "corpus.parquet")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert ray_embed_parquet(tmp_path / "corpus.parquet", tmp_path / "out", concurrency=1, batch_size=8) == len(TEXTS)
    finally:
        ray.shutdown()
    # one input file is split into several blocks (one block goes to one actor: unsplit, a one-file corpus left
    # every actor but one idle); Ray writes a file per block
    assert len(list((tmp_path / "out").glob("*.parquet"))) >= 2
    table = pq.read_table(tmp_path / "out").sort_by("id")
    assert table.column("id").to_pylist() == list(range(len(TEXTS))) and table.column("text").to_pylist() == TEXTS
    got = torch.from_numpy(np.stack(table.column("embedding").to_numpy(zero_copy_only=False)).astype(np.float32))
    torch.testing.assert_close(got, model.encode(TEXTS), atol=1e-6, rtol=0)
