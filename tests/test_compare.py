"""pretrained_encode's outside contenders: sentence-transformers and ONNX Runtime, checked before timed or skipped
with the reason; the ONNX export made once and reused; the corpora; the padding each batching pays."""

import sys

import pytest
import torch

from btlib import bench
from btlib.bench import pretrained, runtimes

from model_folder import FOLDER, needs_model
OUTSIDE = ["sentence_transformers", "ort_fp32", "ort_opt_sorted", "ort_int8_sorted", "packed_int8"]


def _run(providers, **params):
    b = bench.load_all()["pretrained_encode"]
    return bench.run(b, quick=True, providers=providers, x_vals=(16,), save=False, threads=1,
                     params={"corpus": "draws", "draws": 24, **params}, warmup=0, min_runs=1, max_runs=1)


@needs_model
def test_every_provider_is_checked_before_it_is_timed_or_skipped_with_the_reason():
    rows = {r["provider"]: r for r in _run(OUTSIDE)}
    assert set(rows) == set(OUTSIDE)
    for name, r in rows.items():
        if r["status"] == "skipped":
            assert r["reason"], name
            continue
        assert r["status"] == "ok", (name, r.get("reason"))
        assert 0 <= r["error"] <= (1e-5 if name in ("sentence_transformers", "ort_fp32", "ort_opt_sorted") else 0.1), name
        assert 0.9 < r["min_cos"] <= 1.0 + 1e-6 and r["gflops"] > 0 and r["of_bound"] > 0, name
    if rows["packed_int8"]["status"] == "ok":
        assert rows["packed_int8"]["min_cos"] >= 0.995
    table = bench.table(list(rows.values()), "transformers")
    assert "min cos" in table and "of bound" in table


@needs_model
def test_missing_packages_skip_with_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime now raises ImportError
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)
    assert "onnxruntime is not installed" in runtimes.onnx_available()
    assert "sentence-transformers is not installed" in runtimes.st_available()
    rows = _run(["sentence_transformers", "ort_opt"])
    assert [r["status"] for r in rows] == ["skipped", "skipped"]
    assert "pip install -e '.[compare]'" in rows[0]["reason"] and "onnxruntime" in rows[1]["reason"]


@needs_model
@pytest.mark.skipif(runtimes.onnx_available() is not None, reason="onnx / onnxruntime are not installed")
def test_onnx_export_is_cached_and_keyed_on_the_settings(monkeypatch):
    path = runtimes.onnx_model(FOLDER, "fp32")  # made once (or by an earlier run), under build/onnx/<key>/
    stamp = path.stat().st_mtime_ns

    def no_export(*args):
        raise AssertionError("exported again")

    monkeypatch.setattr(runtimes, "_export", no_export)
    assert runtimes.onnx_model(FOLDER, "fp32") == path and path.stat().st_mtime_ns == stamp
    monkeypatch.setitem(runtimes.ONNX_SETTINGS, "opset", 18)  # other settings: another key, so a new export
    with pytest.raises(AssertionError, match="exported again"):
        runtimes.onnx_model(FOLDER, "fp32")
    with pytest.raises(ValueError, match="variant must be"):
        runtimes.onnx_model(FOLDER, "fp16")


@needs_model
def test_corpora_are_seeded_and_shaped():
    p = {"draws": 40, "passages": 5, "seed": 0}
    draws, passages = pretrained.texts({**p, "corpus": "draws"}), pretrained.texts({**p, "corpus": "passages"})
    assert len(draws) == 40 and set(draws) <= set(pretrained.corpus())
    assert len(passages) == 5 and all(100 <= len(t.split()) <= 250 for t in passages)
    assert pretrained.texts({**p, "corpus": "passages"}) == passages
    assert pretrained.texts({"corpus": "file", "repeat": 2}) == pretrained.corpus() * 2
    with pytest.raises(ValueError, match="corpus must be one of"):
        pretrained.texts({"corpus": "tweets"})


def test_padding_each_batching_pays():
    lengths = torch.tensor([1, 97, 3, 96])
    # corpus order, batches of 2: [1, 97] and [3, 96] pad to 2*97 + 2*96 = 386 computed tokens for 197 real
    assert pretrained.padding_fraction(lengths, 2, "file") == pytest.approx(1 - 197 / 386)
    # longest first: [97, 96] and [3, 1] -> 2*97 + 2*3 = 200
    assert pretrained.padding_fraction(lengths, 2, "sorted") == pytest.approx(1 - 197 / 200)
    assert pretrained.padding_fraction(lengths, 2, "none") == 0.0
    assert set(pretrained.PADDING) >= {p.name for p in bench.load_all()["pretrained_encode"].providers()}
