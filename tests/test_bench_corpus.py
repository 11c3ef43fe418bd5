"""corpus_embed: python -m btlib.embed and Ray Data checked against model.encode in quick mode, start-up timed apart."""

import pytest

from btlib import bench
from btlib.serve.extras import missing
from model_folder import needs_model

pytestmark = [needs_model, pytest.mark.skipif(missing("pyarrow", "scale") is not None, reason=str(missing("pyarrow", "scale")))]

ONCE = dict(warmup=0, min_runs=1, max_runs=1, min_time_s=0)


def _check(row):
    assert row["status"] == "ok", row.get("reason")
    assert row["error"] <= 1e-5 and row["min_cos"] > 1 - 1e-6 and row["startup_s"] > 0 and row["x"] == 96


def test_embed_file_side_is_checked_and_its_files_are_gone():
    import tempfile
    from pathlib import Path

    before = set(Path(tempfile.gettempdir()).glob("btlib-corpus-*"))
    (row,) = bench.run(bench.load_all()["corpus_embed"], quick=True, providers=["embed_file"], save=False, **ONCE)
    _check(row)
    assert "ray_init_s" not in row and set(Path(tempfile.gettempdir()).glob("btlib-corpus-*")) == before


@pytest.mark.slow
@pytest.mark.skipif(missing("ray", "scale") is not None, reason=str(missing("ray", "scale")))
def test_ray_side_is_checked_and_its_cluster_shut_down():
    import ray

    from btlib.bench.corpus_embed import corpus_table

    (row,) = bench.run(bench.load_all()["corpus_embed"], quick=True, providers=["ray_data"], save=False, **ONCE)
    _check(row)
    assert row["ray_init_s"] > 0 and not ray.is_initialized()
    assert "| 96 |" in corpus_table([row]) and "ray.init(num_cpus=3)" in corpus_table([row])


def test_corpus_table_states_whole_job_start_up_and_steady_rates():
    from btlib.bench.corpus_embed import corpus_table

    rows = [{"x": 1008, "provider": "embed_file", "status": "ok", "median_ms": 5000.0, "startup_s": 1.0},
            {"x": 1008, "provider": "ray_data", "status": "skipped", "reason": "ray is not installed"}]
    assert corpus_table(rows).splitlines()[2] == "| 1008 | 202 (1.0 s, 250) | - (ray is not installed) |"
