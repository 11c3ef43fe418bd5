"""Notebook 04's two kernel benchmarks check out at their quick sizes, declared in the kernels' folders
(btlib.kernels.cpu.teaching.bench, btlib.kernels.cpu.flash.bench), and btlib.bench.cpu_attention's matmul_peak measures.

Quick sizes are T = 64, 97 (fp32) and 32, 97 (bf16): one tile multiple and one not. Every provider must pass the
benchmark's check (v1, v2, v3 against the fp32 reference at 1e-5; bf16 v3 within 2x SDPA's own bf16 error).
"""

import pytest
import torch

from btlib.bench import load_all, run
from btlib.bench.cpu_attention import matmul_peak
from btlib.kernels.cpu.flash import bench as flash_bench
from btlib.kernels.cpu.teaching import bench as teaching_bench


@pytest.mark.parametrize("name, providers, folder", [
    ("cpu_attention_versions", {"reference", "cpu_naive_v1", "cpu_tiled_v2", "cpu_flash_v3", "torch_sdpa"}, teaching_bench),
    ("attention_dense_bf16", {"cpu_flash_v3", "torch_sdpa"}, flash_bench),
])
def test_cpu_benchmarks_check_out_quick(name, providers, folder):
    bench = load_all()[name]
    assert bench.make_inputs.__module__ == "btlib.bench.attention" or bench.make_inputs.__module__ == folder.__name__
    assert bench.providers.__module__ == folder.__name__  # declared in the kernel's own folder
    assert {p.name for p in bench.providers()} == providers
    rows = run(bench, quick=True, warmup=0, min_runs=1, max_runs=1, save=False)
    assert {r["x"] for r in rows} == set(bench.quick["x_vals"])
    bad = [(r["provider"], r["x"], r["status"], r.get("reason", r.get("error"))) for r in rows if r["status"] != "ok"]
    assert not bad, bad


def test_matmul_peak_restores_threads_and_is_positive():
    before = torch.get_num_threads()
    assert matmul_peak(n=64, threads=1, rounds=1) > 0
    assert torch.get_num_threads() == before


def test_attention_auto_checks_out_quick_and_its_table_names_the_pick(monkeypatch):
    """Every case's providers pass the check (bf16 within 2x SDPA's own error) or are skipped with a reason that
    is about this machine or the layout, each row names auto's pick, and the summary holds one line per case."""
    from btlib.bench.attention_auto import CASES, auto_table
    from btlib.kernels import registry

    bench = load_all()["attention_auto"]
    rows = run(bench, quick=True, warmup=0, min_runs=1, max_runs=1, save=False)
    assert [r["x"] for r in rows if r["provider"] == "sdpa"] == list(CASES)
    bad = [(r["provider"], r["x"], r.get("reason", r.get("error"))) for r in rows
           if r["status"] == "wrong" or (r["status"] == "skipped" and r["provider"] != "btlib_amx")]
    assert not bad, bad
    for r in rows:
        if r["status"] == "ok":
            layout = r["x"].split()[0]
            assert r["auto_pick"] in {k.name for k in registry.kernels(layout)}
            assert r["auto_pick"] == "cpu_flash_v3" if layout == "padded" else r["auto_pick"] in ("cpu_flash_varlen", "cpu_amx_varlen")
    padded_amx = [r for r in rows if r["provider"] == "btlib_amx" and r["x"].startswith("padded")]
    assert all("no padded AMX kernel" in r["reason"] or "amx" in r["reason"].lower() for r in padded_amx)
    table = auto_table(rows).splitlines()
    assert table[0].startswith("CPU ") and len(table) == 2 + len(CASES) + 1
