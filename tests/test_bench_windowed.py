"""Notebook 08's benchmarks in quick mode: every provider checked (or skipped with its reason), ideal rows from the FLOPs."""

import torch

from btlib import bench
from btlib.bench.modernbert_e2e import MODERNBERT_SHAPES, modernbert_flops
from btlib.bench.windowed import LOCAL_WINDOW, add_ideal, document_lengths
from btlib.lengths import attention_flops


def test_document_lengths():
    L = document_lengths(6, 4096, seed=1)
    assert L[0] == 4096 and bool(((L >= 1024) & (L <= 4096)).all())
    assert torch.equal(L, document_lengths(6, 4096, seed=1))


def test_modernbert_flops_count_gemms_and_window():
    L = torch.tensor([1000, 10])
    s = MODERNBERT_SHAPES["base"]
    gemm = 22 * 1010 * (8 * 768**2 + 6 * 768 * 1152)
    attn = 8 * attention_flops(L, 12, 64) + 14 * attention_flops(L, 12, 64, window=LOCAL_WINDOW)
    assert modernbert_flops(L, s) == gemm + attn


def _run(name):
    b = bench.load_all()[name]
    rows = add_ideal(bench.run(b, quick=True, threads=2, save=False), b)
    assert rows and all(r["status"] in ("ok", "skipped") for r in rows), [(r["provider"], r.get("reason")) for r in rows]
    assert all(r.get("reason") for r in rows if r["status"] == "skipped")
    ideal = [r for r in rows if r["provider"] == "ideal"]
    assert len(ideal) == len(b.quick.get("x_vals", b.x_vals)) and all(r["median_ms"] > 0 for r in ideal)
    return {r["provider"]: r for r in rows}


def test_windowed_attention_quick():
    for name in ("windowed_attention_local", "windowed_attention_global"):
        by = _run(name)
        assert by["sdpa_padded_mask"]["status"] == "ok" and by["sdpa_padded_mask"]["error"] <= 1e-5
        assert by["btlib"]["status"] == "ok" or "window" in by["btlib"]["reason"]


def test_modernbert_e2e_quick():
    by = _run("modernbert_e2e")
    assert by["transformers_sdpa"]["status"] == "ok" and by["btlib_packed"]["status"] == "ok"
    assert by["btlib_packed"]["error"] <= 1e-4
