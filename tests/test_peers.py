"""The peers benchmark (btlib against OpenVINO, CTranslate2, fastembed and ONNX Runtime): every engine checked against
btlib fp32 before it is timed or skipped with the pip command; conversions made once; one padding and pooling for all."""

import sys

import pytest
import torch
import torch.nn.functional as F

from btlib import bench
from btlib.bench import peers, rt_ctranslate2, rt_fastembed, rt_openvino, runtimes

from model_folder import FOLDER, needs_model

PACKAGES = {"nncf": rt_openvino.nncf_available, "openvino": rt_openvino.openvino_available,
            "ctranslate2": rt_ctranslate2.ct2_available, "fastembed": rt_fastembed.fastembed_available}
HARDWARE_SKIPS = {"btlib_bf16", "btlib_int8"}  # skipped where this CPU has no native bf16 / fast int8, with the rates


def _run(cells, providers=None, **params):
    b = bench.load_all()["peers"]
    return bench.run(b, quick=True, providers=providers, x_vals=cells, save=False, threads=1,
                     params={"draws": 12, **params}, warmup=0, min_runs=1, max_runs=1)


@needs_model
def test_quick_run_checks_every_engine_before_it_is_timed():
    b = bench.load_all()["peers"]
    tol = {p.name: b.tol if p.tol is None else p.tol for p in b.providers()}
    rows = _run(("draws/8", "query/1"))
    assert sorted(r["provider"] for r in rows) == sorted(list(tol) * 2)
    for r in rows:
        name = r["provider"]
        if r["status"] == "skipped":  # a package missing (the pip command is named) or a CPU that does not pay
            assert ("pip install" in r["reason"]) or (name in HARDWARE_SKIPS and "measured" in r["reason"]), (name, r["reason"])
            continue
        assert r["status"] == "ok", (name, r.get("reason"))
        assert r["error"] == pytest.approx(1 - r["min_cos"], abs=1e-12) and r["error"] <= tol[name], name
        assert r["sentences"] == (1 if r["x"] == "query/1" else 12) and r["median_ms"] > 0
        if tol[name] == peers.FP32_TOL:  # every fp32 engine: the same embeddings to fp32 rounding
            assert r["min_cos"] >= 1 - 1e-6 and r["max_diff"] < 1e-4, name
    installed = [pkg for pkg, why in PACKAGES.items() if why() is None]
    for r in rows:
        if any(r["provider"].startswith(p) for p in ("ov_", "ct2_", "fastembed")) and len(installed) == len(PACKAGES):
            assert r["status"] == "ok", (r["provider"], r.get("reason"))
    header, _, *lines = peers.summary(rows).splitlines()
    assert [c.strip() for c in header.split("|")[1:-1]] == ["engine", "draws 8", "query ms", "min cos", "GEMM (btlib rows)"]
    labels = {p.name: p.label for p in b.providers()}
    timed = {r["provider"] for r in rows if r["status"] == "ok"}
    assert sum(line.startswith("| ") for line in lines) == len(timed)
    assert all(any(line.startswith(f"| {labels[n]}") for line in lines) for n in timed)


@needs_model
def test_missing_packages_skip_with_the_pip_command(monkeypatch):
    for name, why in PACKAGES.items():
        monkeypatch.setitem(sys.modules, name, None)  # import NAME now raises ImportError
        assert f"{name} is not installed" in why() and "pip install" in why()  # (nncf's check names openvino first)
    rows = _run(("query/1",), providers=["btlib_fp32", "ov_fp32", "ov_int8_nncf", "ct2_int8", "fastembed"])
    status = {r["provider"]: r for r in rows}
    assert status["btlib_fp32"]["status"] == "ok"
    for name in ("ov_fp32", "ov_int8_nncf", "ct2_int8", "fastembed"):
        assert status[name]["status"] == "skipped" and "pip install -e '.[compare]'" in status[name]["reason"], name
    assert "- ov_fp32: skipped: openvino is not installed" in peers.summary(rows)


@needs_model
@pytest.mark.skipif(rt_fastembed.fastembed_available() is not None, reason="fastembed / onnxruntime are not installed")
def test_fastembed_truncates_where_btlib_does():
    """The folder's tokenizer_config says 512; fastembed must cut at btlib's (and sentence-transformers') 256."""
    from btlib.pretrained import load_pretrained

    m = load_pretrained(FOLDER)
    folder = rt_fastembed.fastembed_folder(FOLDER, m.max_length)
    assert '"model_max_length": 256' in (folder / "tokenizer_config.json").read_text()
    long = " ".join(["the cat sat on the mat while the dog slept"] * 60)  # ~600 tokens: truncated
    texts = [long, "Hello world", "a"]
    assert len(m.tokenize([long])[0]) == m.max_length == 256
    got = rt_fastembed.fastembed_encode(rt_fastembed.fastembed_model(FOLDER, m.max_length), texts, batch_size=2)
    assert (got - m.encode(texts)).abs().max() < 1e-5


@needs_model
@pytest.mark.skipif(rt_openvino.nncf_available() or rt_ctranslate2.ct2_available(), reason="openvino / nncf / ctranslate2 missing")
def test_conversions_are_made_once_and_reused(monkeypatch):
    made = {"ov": rt_openvino.ov_model(FOLDER, "fp32"), "ct2": rt_ctranslate2.ct2_model(FOLDER)}
    stamps = {k: p.stat().st_mtime_ns for k, p in made.items()}

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(rt_openvino, "_make", no_conversion)
    monkeypatch.setattr(rt_ctranslate2, "_convert", no_conversion)
    assert rt_openvino.ov_model(FOLDER, "fp32") == made["ov"] and rt_ctranslate2.ct2_model(FOLDER) == made["ct2"]
    assert {k: p.stat().st_mtime_ns for k, p in made.items()} == stamps
    monkeypatch.setitem(rt_openvino.OV_SETTINGS, "attention", "eager")  # other settings: another key, a new conversion
    with pytest.raises(AssertionError, match="converted again"):
        rt_openvino.ov_model(FOLDER, "fp32")
    with pytest.raises(ValueError, match="variant must be one of"):
        rt_openvino.ov_model(FOLDER, "int4")
    with pytest.raises(ValueError, match="compute_type must be one of"):
        rt_ctranslate2.ct2_encoder(made["ct2"], "float16")


def test_cached_dir_is_made_once_and_never_half(tmp_path):
    calls = []

    def make(tmp):
        calls.append(tmp)
        (tmp / "model.bin").write_text("weights")

    d = runtimes.cached_dir(tmp_path / "k" / "fp32", make)
    assert (d / "model.bin").read_text() == "weights" and len(calls) == 1
    assert runtimes.cached_dir(d, make) == d and len(calls) == 1

    def broken(tmp):
        (tmp / "model.xml").write_text("half")
        raise RuntimeError("converter crashed")

    with pytest.raises(RuntimeError, match="converter crashed"):
        runtimes.cached_dir(tmp_path / "k" / "int8", broken)
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == ["fp32"]  # no half folder, no temporary left


@pytest.mark.parametrize("sort", [False, True])
def test_padded_encode_pools_real_tokens_only_in_input_order(sort):
    E = torch.randn(20, 5, generator=torch.Generator().manual_seed(0))  # token id -> a "hidden state"; E[0] is the pad's
    ids = [[3], [4, 5, 6, 7, 8], [9, 10, 11], [1, 2, 3, 4, 5, 6, 7]]  # lengths 1, 5, 3, 7: batches of 3 pad
    seen = []

    def run(tokens, mask):
        seen.append(tuple(tokens.shape))
        return E[tokens].numpy()  # (B, T, d): pads get E[0], which pooling must leave out

    got = runtimes.padded_encode(run, ids, 3, sort=sort, pad_id=0)
    want = torch.stack([F.normalize(E[torch.tensor(s)].mean(0), dim=0) for s in ids])
    torch.testing.assert_close(got, want)
    assert seen == ([(3, 7), (1, 1)] if sort else [(3, 5), (1, 7)])  # longest first pads less


def test_cells_and_the_query():
    texts, bs = peers.cell_texts({"cell": "query/1"})
    assert texts == [peers.QUERY] and bs == 1 and len(peers.QUERY.split()) == 10
    for bad in ("file", "file/0", "file/x"):
        with pytest.raises(ValueError, match="cell must be 'corpus/batch_size'"):
            peers.cell_texts({"cell": bad})


def test_gemm_path_names_the_measured_choice_and_the_fallback():
    env = {"fp32_gflops": 188.0, "bf16_gflops": 780.0, "gemm": {"int8": {"int_mm": {"12": 290.0, "1024": 2670.4}}},
           "gemm_pick": {"fp32": [[362, "onednn"], [None, "torch"]]}}
    assert peers.gemm_path(env, "fp32") == "onednn <= 362 tokens, torch above; best 188 GFLOP/s"
    assert peers.gemm_path(env, "bf16") == "F.linear; best 780 GFLOP/s"  # no choice recorded: btlib.gemm's fallback
    assert peers.gemm_path(env, "int8") == "int_mm (btlib.quant); best 2670 GOP/s"  # a row saved before the int8 pick
    env["gemm"]["int8"]["onednn_int8"] = {"12": 350.0, "1024": 3100.0}
    env["gemm_pick"]["int8"] = [[None, "onednn_int8"]]
    assert peers.gemm_path(env, "int8") == "onednn_int8 (btlib.quant); best 3100 GOP/s"
    env["gemm_pick"]["int8"] = [[111, "onednn_int8"], [None, "int_mm"]]
    assert peers.gemm_path(env, "int8") == "onednn_int8 <= 111 tokens, int_mm above (btlib.quant); best 3100 GOP/s"
    env["gemm_pick"]["int8 384x1536"] = [[362, "int_mm"], [None, "onednn_int8"]]
    assert peers.gemm_path(env, "int8") == \
        "onednn_int8 <= 111 tokens, int_mm above (btlib.quant per weight shape, overall); best 3100 GOP/s"
    assert peers.gemm_path({}, "int8") == "int_mm (btlib.quant)" and peers.gemm_path({}, "fp32") == "F.linear"


def test_summary_pivots_rows_into_the_issue_table():
    env = {"fp32_gflops": 100.0}
    ok = {"status": "ok", "env": env, "min_cos": 1.0}
    rows = [{**ok, "provider": "btlib_fp32", "x": "file/32", "median_ms": 100.0, "sentences": 64},
            {**ok, "provider": "btlib_fp32", "x": "query/1", "median_ms": 5.0, "sentences": 1},
            {**ok, "provider": "ct2_int8", "x": "file/32", "median_ms": 50.0, "sentences": 64, "min_cos": 0.98},
            {"provider": "ct2_int8", "x": "query/1", "status": "wrong", "reason": "error 3e-01 > tol 2e-01; not timed", "env": env},
            {"provider": "fastembed", "x": "file/32", "status": "skipped", "reason": "fastembed is not installed", "env": env},
            {"provider": "fastembed", "x": "query/1", "status": "skipped", "reason": "fastembed is not installed", "env": env}]
    lines = peers.summary(rows).splitlines()
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines if line.startswith("| ")]
    assert cells[0] == ["engine", "file 32", "query ms", "min cos", "GEMM (btlib rows)"]
    assert cells[1][:4] == ["btlib encode fp32", "640", "5.00", "1.000000"] and cells[1][4].endswith("100 GFLOP/s")
    assert cells[2] == ["CTranslate2 int8", "1280", "wrong", "0.980000", ""]
    assert "- ct2_int8 query/1: wrong: error 3e-01 > tol 2e-01; not timed" in lines
    assert "- fastembed: skipped: fastembed is not installed" in lines


@needs_model
def test_the_command_prints_the_pivot_after_the_table(capsys):
    from btlib.bench.__main__ import main

    assert main(["run", "peers", "--quick", "--threads", "1", "--runs", "1", "--providers", "btlib_fp32",
                 "--set", "x_vals=['query/1']"]) == 0
    out = capsys.readouterr().out
    assert "peers      cell=query/1  btlib_fp32" in out  # the generic table, then the benchmark's own summary
    assert "| engine            | query ms |" in out and "| btlib encode fp32 |" in out


@needs_model
@pytest.mark.skipif(rt_openvino.openvino_available() is not None, reason="openvino is not installed")
def test_openvino_conversion_runs_with_telemetry_off(monkeypatch, tmp_path):
    """OpenVINO's converter and NNCF send usage telemetry unless opted out: the conversion runs with their CI switches."""
    import os

    seen = {}

    def convert(folder, variant, out):
        seen.update(CI=os.environ.get("CI"), NNCF_CI=os.environ.get("NNCF_CI"))
        (out / "model.xml").write_text("<net/>")

    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(runtimes, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(rt_openvino, "_convert", convert)
    path = rt_openvino.ov_model(FOLDER, "fp32")
    assert path.is_relative_to(tmp_path) and seen == {"CI": "true", "NNCF_CI": "1"}
    assert "CI" not in os.environ  # set only while converting


def test_gemm_column_reads_the_measured_pick():
    """The GEMM column names btlib.hardware's choice per token range (was: 'None', the per-path rates read as a pick)."""
    from btlib.bench.peers import gemm_path

    env = {"gemm_pick": {"fp32": [[39, "onednn"], [None, "torch"]]}, "fp32_gflops": 177.0}
    assert gemm_path(env, "fp32") == "onednn <= 39 tokens, torch above; best 177 GFLOP/s"
    assert gemm_path({"gemm_pick": {"bf16": [[None, "torch"]]}}, "bf16") == "torch"
