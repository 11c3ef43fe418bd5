"""The benchmark harness: it checks before it times, skips with reasons, and writes rows."""

import json

import pytest
import torch

from btlib import bench
from btlib.bench.__main__ import main as bench_main

# peak_memory, table / plot / load_rows and quick_mode, reached through btlib.bench.
TESTED_HERE = ["btlib.bench.memory", "btlib.bench.report", "btlib.quick"]


def toy(providers):
    return bench.Benchmark(
        name="toy", description="x * 2", x_name="n", x_vals=(4, 8),
        providers=lambda: providers,
        make_inputs=lambda p: {"x": torch.arange(p["n"], dtype=torch.float32)},
        reference=lambda x: x["x"] * 2, error=lambda out, ref, x: float((out - ref).abs().max()), tol=1e-6,
        flops=lambda p: p["n"], baseline="good",
    )


def test_run_checks_times_skips_and_writes(tmp_path):
    provs = [
        bench.Provider("good", lambda x: x["x"] + x["x"]),
        bench.Provider("wrong", lambda x: x["x"] * 3),
        bench.Provider("absent", lambda x: x["x"] * 2, available=lambda: "needs a GPU"),
        bench.Provider("raises", lambda x: 1 / 0),
        bench.Provider("yardstick", lambda x: x["x"], checked=False),
    ]
    path = tmp_path / "toy.jsonl"
    rows = bench.run(toy(provs), json_path=path, warmup=1, min_runs=3, max_runs=3, min_time_s=0)
    status = {(r["provider"], r["x"]): r["status"] for r in rows}
    assert status[("good", 4)] == "ok" and status[("yardstick", 8)] == "ok"
    assert status[("wrong", 4)] == "wrong" and "median_ms" not in next(r for r in rows if r["provider"] == "wrong")
    assert status[("absent", 8)] == "skipped"
    assert "ZeroDivisionError" in next(r["reason"] for r in rows if r["provider"] == "raises")
    good = next(r for r in rows if r["provider"] == "good")
    assert good["runs"] == 3 and good["min_ms"] <= good["median_ms"] <= good["max_ms"]
    assert {"torch", "cpu", "threads", "gpu"} <= set(good["env"])
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
    text = bench.table(rows, "good")
    assert "1.00x" in text and "needs a GPU" in text


def test_a_provider_context_spans_check_and_timing_and_is_left_when_it_raises():
    """context(inputs) is entered once per x around the check and every timed call (its value in inputs["context"]),
    and left after the row, also when the provider raises or is interrupted (a server process must not outlive it)."""
    import contextlib

    log = []

    @contextlib.contextmanager
    def held(inputs):
        log.append(("enter", len(inputs["x"])))
        try:
            yield 2.0
        finally:
            log.append(("exit", len(inputs["x"])))

    def fn(x):
        log.append("call")
        return x["x"] * x["context"]

    rows = bench.run(toy([bench.Provider("held", fn, context=held), bench.Provider("raises", lambda x: 1 / 0, context=held)]),
                     warmup=1, min_runs=2, max_runs=2, min_time_s=0)
    assert [r["status"] for r in rows] == ["ok", "skipped", "ok", "skipped"]
    # the check call, which is the one warm-up call, then two timed calls
    assert log == [("enter", 4), "call", "call", "call", ("exit", 4), ("enter", 4), ("exit", 4),
                   ("enter", 8), "call", "call", "call", ("exit", 8), ("enter", 8), ("exit", 8)]
    log.clear()

    def interrupted(x):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bench.run(toy([bench.Provider("interrupted", interrupted, context=held)]))
    assert log == [("enter", 4), ("exit", 4)]


def test_threads_restored_and_quick_params():
    before = torch.get_num_threads()
    b = toy([bench.Provider("good", lambda x: x["x"] * 2)])
    b = bench.Benchmark(**{**b.__dict__, "quick": {"x_vals": (2,)}})
    rows = bench.run(b, quick=True, threads=1)
    assert [r["x"] for r in rows] == [2] and rows[0]["env"]["threads"] == 1
    assert torch.get_num_threads() == before


def test_results_dir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("BTLIB_RESULTS_DIR", str(tmp_path))
    bench.run(toy([bench.Provider("good", lambda x: x["x"] * 2)]), quick=True)
    assert (tmp_path / "toy.jsonl").exists()


def test_declared_benchmarks_run_quick(tmp_path, capsys):
    names = bench.load_all()
    assert {"attention_dense", "attention_varlen", "encoder_padding", "bettertransformer_tutorial"} <= set(names)
    assert bench_main(["list"]) == 0
    for name in ("attention_varlen", "encoder_padding"):
        assert bench_main(["run", name, "--quick", "--json", str(tmp_path / f"{name}.jsonl")]) == 0
    rows = bench.load_rows([tmp_path])
    assert rows and all(r["status"] in ("ok", "skipped") for r in rows)
    assert bench_main(["summary", str(tmp_path)]) == 0
    assert "encoder_padding" in capsys.readouterr().out


def test_plot(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    rows = bench.run(toy([bench.Provider("good", lambda x: x["x"] * 2), bench.Provider("also", lambda x: 2 * x["x"])]),
                     quick=True)
    ax = bench.plot(rows, baseline="good", ideal={4: 1.0, 8: 1.0})
    assert len([ln for ln in ax.lines if not ln.get_label().startswith("_")]) == 3 and "speedup" in ax.get_ylabel()
    # every provider's points carry error bars: the spread of the rows, widened by the baseline's for a speedup
    from matplotlib.container import ErrorbarContainer

    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 2
    noisy = [{**r, "median_ms": 10.0, "min_ms": 10.0, "round_medians_ms": [10.0, 12.0]} for r in rows]
    ax = bench.plot(noisy)  # times: the bar spans [t, t (1 + noise)] = [10, 12]
    seg = [c for c in ax.containers if isinstance(c, ErrorbarContainer)][0].lines[2][0].get_segments()[0]
    assert tuple(seg[:, 1]) == pytest.approx((10.0, 12.0))
    # each provider against its own baseline: "also" over "good", with the band both rows' noise allows
    own = [{**r, "median_ms": 10.0 if r["provider"] == "good" else 20.0, "min_ms": 1.0, "round_medians_ms": []} for r in rows]
    own = [{**r, "round_medians_ms": [r["median_ms"], r["median_ms"] * 1.1]} for r in own]
    ax = bench.plot(own, baseline={"also": "good"}, legend={"fontsize": 7})
    assert [ln.get_label() for ln in ax.lines if not ln.get_label().startswith("_")] == ["also / good"]
    assert [ln.get_ydata()[0] for ln in ax.lines if ln.get_label() == "also / good"] == [pytest.approx(0.5)]
    seg = [c for c in ax.containers if isinstance(c, ErrorbarContainer)][0].lines[2][0].get_segments()[0]
    assert tuple(seg[:, 1]) == pytest.approx((0.5 / 1.1, 0.5 * 1.1)) and ax.get_ylabel() == "time of the baseline / time"


@pytest.mark.parametrize("value, expected", [("1", True), ("", False), ("no", False)])
def test_quick_mode(monkeypatch, value, expected):
    monkeypatch.setenv("BTLIB_QUICK", value)
    assert bench.quick_mode() is expected


def test_peak_memory_sees_the_score_matrix():
    import torch.nn.functional as F

    import btlib

    q = torch.randn(1, 2, 256, 16)
    scores = 2 * 256 * 256 * 4  # bytes of one (B, H, T, T) fp32 tensor
    naive = bench.peak_memory(lambda: btlib.reference_attention(q, q, q))
    fused = bench.peak_memory(lambda: F.scaled_dot_product_attention(q, q, q))
    assert naive >= 2 * scores  # scores and probabilities live at once
    assert fused < scores  # the fused kernel never holds T x T
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # the math backend allocates and frees its scores inside one operator
        assert bench.peak_memory(lambda: F.scaled_dot_product_attention(q, q, q)) >= scores


def _where(out, ref, x):
    import os

    return {"pid": float(os.getpid()), "threads": float(torch.get_num_threads())}


ISOLATION = bench.declare(bench.Benchmark(  # declared at the top level: an isolated provider's worker imports it
    name="test_isolation", description="x * 2, each provider in this process or a worker of its own",
    x_name="n", x_vals=(4, 8),
    providers=lambda: [bench.Provider("here", lambda x: x["x"] * 2),
                       bench.Provider("away", lambda x: x["x"] * 2, isolated=True),
                       bench.Provider("away_wrong", lambda x: x["x"] * 3, isolated=True),
                       bench.Provider("away_absent", lambda x: x["x"] * 2, available=lambda: "needs X", isolated=True)],
    make_inputs=lambda p: {"x": torch.arange(p["n"], dtype=torch.float32)},
    reference=lambda x: x["x"] * 2, error=lambda out, ref, x: float((out - ref).abs().max()), tol=1e-6,
    metrics=_where,
))


def test_isolated_providers_are_checked_and_timed_in_a_worker_of_their_own():
    import os

    rows = bench.run(ISOLATION, threads=1, warmup=1, min_runs=3, max_runs=3, min_time_s=0, save=False)
    by = {(r["provider"], r["x"]): r for r in rows}
    assert [r["provider"] for r in rows] == ["here", "away", "away_wrong", "away_absent"] * 2  # the declared order
    assert by[("here", 4)]["pid"] == os.getpid() and by[("here", 4)]["status"] == "ok"
    away = {by[("away", n)]["pid"] for n in (4, 8)}
    assert len(away) == 1 and os.getpid() not in away  # one worker, kept for the run
    assert by[("away", 8)]["status"] == "ok" and by[("away", 8)]["runs"] == 3 and by[("away", 8)]["threads"] == 1
    assert by[("away_wrong", 4)]["status"] == "wrong" and "not timed" in by[("away_wrong", 4)]["reason"]
    assert by[("away_absent", 4)]["status"] == "skipped" and by[("away_absent", 4)]["reason"] == "needs X"


def test_an_isolated_provider_whose_worker_fails_is_a_row_not_a_crash():
    undeclared = bench.Benchmark(  # not declared: the worker cannot find it, which must not end the run
        name="test_isolation_undeclared", description="x * 2", x_name="n", x_vals=(4,),
        providers=lambda: [bench.Provider("here", lambda x: x["x"] * 2), bench.Provider("away", lambda x: x["x"] * 2, isolated=True)],
        make_inputs=lambda p: {"x": torch.arange(p["n"], dtype=torch.float32)},
        reference=lambda x: x["x"] * 2, error=lambda out, ref, x: float((out - ref).abs().max()), tol=1e-6)
    rows = bench.run(undeclared, warmup=1, min_runs=3, max_runs=3, min_time_s=0, save=False)
    assert [r["status"] for r in rows] == ["ok", "skipped"]
    assert "worker process failed: LookupError" in rows[1]["reason"] and "declare" in rows[1]["reason"]


def test_a_row_above_its_bound_gets_the_bound_measured_again(monkeypatch):
    """A row faster than the cached GEMM rate means the rate was measured while the machine was slower: run()
    measures again (once per process, not into the cache) and holds every row of the run against the higher rate."""
    from btlib.bench import bounds, core

    monkeypatch.setattr(bounds, "REMEASURED", {})
    calls = []

    def fresh():
        calls.append(1)
        return {"fp32_gflops": 1e9, "bf16_gflops": 2e9}

    monkeypatch.setattr("btlib.hardware.measure_rates", fresh)
    monkeypatch.setattr(core, "describe_machine", lambda: {"fp32_gflops": 1e-12, "bf16_gflops": 1e-12, "threads": 1})
    rows = bench.run(toy([bench.Provider("good", lambda x: x["x"] + x["x"])]), save=False, warmup=0, min_runs=1,
                     max_runs=1, min_time_s=0)
    assert calls == [1] and all(r["bound_gflops"] == 1e9 and r["of_bound"] < 1.0 for r in rows)
    assert rows[0]["env"]["fp32_gflops"] == 1e9  # the rows' machine record carries the bound they were held against
    # the next run in this process starts from the re-measured bound: no second measurement
    rows = bench.run(toy([bench.Provider("good", lambda x: x["x"] + x["x"])]), save=False, warmup=0, min_runs=1,
                     max_runs=1, min_time_s=0)
    assert calls == [1] and all(r["bound_gflops"] == 1e9 for r in rows)
    # a row still above its bound after measuring again is left as it is (the table then shows what is wrong)
    monkeypatch.setattr(bounds, "REMEASURED", {})
    monkeypatch.setattr("btlib.hardware.measure_rates", lambda: {"fp32_gflops": 1e-12, "bf16_gflops": 1e-12})
    rows = bench.run(toy([bench.Provider("good", lambda x: x["x"] + x["x"])]), save=False, warmup=0, min_runs=1,
                     max_runs=1, min_time_s=0)
    assert all(r["of_bound"] > 1.0 for r in rows)


def test_the_protocol_is_defined_once_and_printed_from_its_constants():
    from btlib.bench import timing as proto

    import doctest

    assert doctest.testmod(proto).failed == 0  # the docstring shows the default protocol as it prints
    assert bench.protocol(quick=False) is proto.DEFAULT and bench.protocol(quick=True) is proto.QUICK
    text = str(proto.DEFAULT)
    for number in (proto.DEFAULT.rounds, proto.DEFAULT.warmup, proto.DEFAULT.min_calls, proto.DEFAULT.max_calls,
                   proto.DEFAULT.retry_rounds):
        assert f"{number} " in text
    assert f"{proto.NOISE_LIMIT:.0%}" in text and "too noisy to compare here" in text
    # a warm-up call always, whatever a caller passes
    assert proto.DEFAULT.timing(warmup=0)["warmup"] == 1
    calls = []
    bench.time_fn(lambda: calls.append(1), warmup=0, min_runs=2, max_runs=2, min_time_s=0)
    assert len(calls) == 3


def test_a_noisy_point_is_timed_again_with_longer_trials(monkeypatch):
    """A point whose rounds disagree by more than NOISE_LIMIT gets retry_rounds more rounds of every provider at that
    point (trials twice as long); the other points are not run again."""
    from btlib.bench import core
    from btlib.bench import timing as proto

    monkeypatch.setattr(core, "protocol", lambda quick=None: proto.Protocol(2, 1, 1, 1, 0.0, 2))
    seen = []
    real_run = core.run

    def run(b, **kw):
        seen.append((tuple(kw.get("x_vals") or b.x_vals), kw.get("min_runs")))
        rows = real_run(b, **kw)
        for r in rows:  # point 8 of provider "good": 1 ms in the first round, 5 ms after (noise 400%); point 4 steady
            if r["status"] == "ok":
                r["median_ms"] = 1.0 if r["x"] == 4 or len(seen) == 1 else 5.0
        return rows

    monkeypatch.setattr(core, "run", run)
    rows = core.run_rounds(toy([bench.Provider("good", lambda x: x["x"] + x["x"])]), save=False)
    assert seen[0][0] == (4, 8) and seen[1][0] == (4, 8) and seen[2:] == [((8,), 2), ((8,), 2)]
    row8 = bench.find_row(rows, "good", 8)
    assert row8["rounds"] == 4 and len(row8["round_medians_ms"]) == 4 and bench.find_row(rows, "good", 4)["rounds"] == 2
    assert bench.compare(row8, row8).too_noisy  # still noisy: compared as too noisy, never with a factor
