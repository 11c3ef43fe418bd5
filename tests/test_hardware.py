"""btlib.hardware / btlib.device: one machine description, measured rates, bf16 only where it pays."""

import json
import subprocess
import sys
import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn

import btlib
from btlib import device, hardware

EMULATED = {"bf16_native": False, "bf16_why": "no avx512_bf16 or amx_bf16 on this x86 CPU", "fp32_gflops": 161.0,
            "bf16_gflops": 0.9}  # the AVX2 CPU of the brief: torch's bf16 matmul emulated


@pytest.fixture
def fresh(monkeypatch, tmp_path, fresh_warnings):
    """No in-process or on-disk rates from before; warnings not yet given; the disk cache in tmp_path."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(hardware, "_memo", {})
    return tmp_path


def rates(fp32=200.0, bf16=800.0, fp32_n=1024):
    """A measurement as btlib.gemm_measure.measure_paths returns it (fp32: onednn wins at 12 tokens, torch above)."""
    return {"fp32_gflops": fp32, "bf16_gflops": bf16, "fp32_n": fp32_n, "bf16_n": 1024,
            "gemm": {"fp32": {"torch": {"12": fp32 / 4, "1024": fp32}, "onednn": {"12": fp32 / 2, "1024": fp32 / 2}},
                     "bf16": {"torch": {"12": bf16 / 4, "1024": bf16}}, "int8": {"int_mm": {"12": 30.0, "1024": 500.0}}},
            "gemm_pick": {"fp32": [[111, "onednn"], [None, "torch"]], "bf16": [[None, "torch"]]}}


def test_machine_measures_once_and_caches_on_disk(fresh, monkeypatch):
    monkeypatch.setattr(hardware, "measure_rates", lambda: rates())
    hw = hardware.machine()
    assert hw.fp32_gflops == 200.0 and hw.bf16_gflops == 800.0 and hw.threads == torch.get_num_threads()
    assert hw.gemm_pick["fp32"] == [[111, "onednn"], [None, "torch"]] and hw.best("int8") == ("int_mm", 1024, 500.0)
    assert hw.isa in ("avx512bf16", "avx512", "avx2", "portable")
    assert hardware.machine() is hw  # in-process
    cached = json.loads((fresh / "btlib_hardware.json").read_text())
    assert list(cached.values()) == [rates()]
    hardware._memo.clear()
    monkeypatch.setattr(hardware, "measure_rates", lambda: pytest.fail("measured again"))
    again = hardware.machine()  # from disk: the same rates, not re-measured
    assert again == hw and again.gemm == hw.gemm and again.gemm_pick == hw.gemm_pick
    assert list(fresh.iterdir()) == [fresh / "btlib_hardware.json"]  # the write left no temp file


def test_a_measurement_cut_short_is_not_cached_on_disk(fresh, monkeypatch):
    # fp32 stopping at 12 tokens inside its time box: the CPU was busy; keep the rates for this process only
    monkeypatch.setattr(hardware, "measure_rates", lambda: rates(1.0, 0.5, fp32_n=12))
    hw = hardware.machine()
    assert hw.fp32_gflops == 1.0 and hardware.machine() is hw
    assert not (fresh / "btlib_hardware.json").exists()
    monkeypatch.setattr(hardware, "measure_rates", lambda: rates())
    assert hardware.machine(refresh=True).fp32_gflops == 200.0 and (fresh / "btlib_hardware.json").exists()


def _key():
    return hardware._key(torch.get_num_threads())


BAD_CACHES = {
    "a JSON list": lambda: [1, 2],
    "not JSON": lambda: "{ torn write",
    "an entry that is a list": lambda: {_key(): [200.0]},
    "an entry missing keys": lambda: {_key(): {"fp32_gflops": 200.0}},
    "a NaN rate": lambda: {_key(): {**rates(), "fp32_gflops": float("nan")}},
    "a negative rate": lambda: {_key(): {**rates(), "bf16_gflops": -5.0}},
    "an infinite rate": lambda: {_key(): {**rates(), "fp32_gflops": float("inf")}},
    "an infinite path rate": lambda: {_key(): {**rates(), "gemm": {"fp32": {"torch": {"12": float("inf")}}}}},
    "an unknown picked path": lambda: {_key(): {**rates(), "gemm_pick": {"fp32": [[None, "magic"]]}}},
}


@pytest.mark.parametrize("bad", BAD_CACHES)
def test_a_poisoned_cache_is_measured_again_and_rewritten_warning_once(fresh, monkeypatch, bad):
    """Regression (issue 22.5): a JSON list gave a TypeError on every later call; NaN, negative or infinite rates
    were trusted; an entry missing keys raised TypeError in Hardware(**entry)."""
    content = BAD_CACHES[bad]()
    path = fresh / "btlib_hardware.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    measured = []
    monkeypatch.setattr(hardware, "measure_rates", lambda: measured.append(1) or rates())
    monkeypatch.setattr(hardware, "_warned", set())
    with pytest.warns(UserWarning, match="hardware cache .*measuring this machine's GEMM rates again"):
        hw = hardware.machine()
    assert measured == [1] and hw.fp32_gflops == 200.0
    assert json.loads(path.read_text()) == {_key(): rates()}  # rewritten, whole
    hardware._memo.clear()
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per file
        assert hardware.machine().fp32_gflops == 200.0 and measured == [1, 1]


def test_a_cache_path_that_is_a_directory_leaves_nothing_behind(fresh, monkeypatch):
    """Regression (issue 22.5): the failed os.replace left btlib_hardware.<pid>.tmp beside the directory."""
    (fresh / "btlib_hardware.json").mkdir()
    monkeypatch.setattr(hardware, "measure_rates", lambda: rates())
    assert hardware.machine().fp32_gflops == 200.0  # kept in this process
    assert [p.name for p in fresh.iterdir()] == ["btlib_hardware.json"] and (fresh / "btlib_hardware.json").is_dir()


def test_a_write_keeps_other_machines_entries(fresh, monkeypatch):
    path = fresh / "btlib_hardware.json"
    path.write_text(json.dumps({"other-machine": rates(100.0)}))
    monkeypatch.setattr(hardware, "measure_rates", lambda: rates())
    hardware.machine()
    assert json.loads(path.read_text()) == {"other-machine": rates(100.0), _key(): rates()}


def test_measurement_is_time_boxed_and_picks_the_fastest_measured_path():
    import time

    from btlib import gemm, gemm_measure, hardware_cache

    t0 = time.perf_counter()
    out = gemm_measure.measure_paths(gemm, {"fp32": 0.3, "bf16": 0.2, "int8": 0.1})
    assert time.perf_counter() - t0 < 8  # budgets 0.6 s + one round past a box on a busy CPU
    fp32 = out["gemm"]["fp32"]
    assert "torch" in fp32 and all(r > 0 for by_M in fp32.values() for r in by_M.values())
    # the bound is the fastest single shape: at least every path's six-shape rate (their harmonic mean at one M)
    assert out["fp32_gflops"] >= max(r for by_M in fp32.values() for r in by_M.values()) * (1 - 1e-9)
    assert out["gemm_pick"]["fp32"][-1][0] is None and hardware_cache.problem(out) is None
    if out["gemm"].get("int8"):  # btlib.quant follows the int8 picks (btlib.gemm.choose_int8): overall and per shape
        assert out["gemm_pick"]["int8"] == gemm_measure.picks(
            {p: {int(M): r for M, r in by_M.items()} for p, by_M in out["gemm"]["int8"].items()})
        assert {f"int8 {K}x{N}" for K, N in gemm_measure.SHAPES} <= set(out["gemm_pick"])
    assert gemm_measure.picks({"torch": {12: 50.0, 128: 150.0, 1024: 180.0}, "onednn": {12: 100.0, 128: 140.0}}) == \
        [[39, "onednn"], [None, "torch"]]
    assert gemm_measure.picks({"torch": {12: 5.0, 1024: 9.0}, "onednn": {12: 6.0, 1024: 10.0}}) == [[None, "onednn"]]
    # an incumbent keeps an M unless the other path measured margin x its rate
    int8 = {"int_mm": {12: 300.0, 128: 1400.0, 1024: 1500.0}, "onednn_int8": {12: 340.0, 128: 1500.0, 1024: 2400.0}}
    assert gemm_measure.picks(int8) == [[None, "onednn_int8"]]
    assert gemm_measure.picks(int8, incumbent="int_mm", margin=1.25) == [[362, "int_mm"], [None, "onednn_int8"]]


def test_describe_machine_is_the_one_source():
    from btlib.bench.core import describe_machine

    assert describe_machine is device.describe_machine
    env = device.describe_machine()
    assert {"cpu", "threads", "torch", "gpu", "isa", "bf16_native", "fp32_gflops", "bf16_gflops"} <= set(env)
    line = device.machine_line(env)
    assert f"btlib kernels {env['isa']}" in line and "GFLOP/s fp32" in line and {"gemm", "gemm_pick"} <= set(env)
    assert device.machine_line({"cpu": "old row", "threads": 2, "cpu_count": 2, "torch": "2.5"}).startswith("CPU old row")


def test_assume_no_bf16_override(monkeypatch):
    monkeypatch.setenv("BTLIB_ASSUME_NO_BF16", "1")
    assert hardware.bf16_native() == (False, "BTLIB_ASSUME_NO_BF16=1")


def test_slow_bf16_warns_once_naming_the_slowdown(fresh):
    hw = replace(hardware.machine(), **EMULATED)
    with pytest.warns(device.SlowPrecisionWarning, match=r"0\.9 GFLOP/s vs 161 GFLOP/s in fp32 \(179x slower.*precision='fp32'"):
        assert device.warn_if_slow_bf16("thing in bf16", hw=hw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert device.warn_if_slow_bf16("thing in bf16", hw=hw)  # slow, but said already
    assert issubclass(btlib.SlowPrecisionWarning, UserWarning)


def test_auto_picks_fp32_where_bf16_is_not_native(fresh):
    hw = replace(hardware.machine(), **EMULATED)
    choice = device.choose_precision("auto", hw=hw)
    assert choice.precision == "fp32" and choice.dtype == torch.float32 and "not native" in str(choice)
    native_but_slow = replace(hw, bf16_native=True, bf16_why="test", bf16_gflops=180.0)
    assert device.choose_precision("auto", hw=native_but_slow).precision == "fp32"  # 1.1x <= 1.3x margin


def test_auto_follows_the_measured_rates_here(fresh):
    hw = hardware.machine()
    want = "bf16" if hw.bf16_native and hw.bf16_speedup > device.AUTO_MARGIN else "fp32"
    assert device.choose_precision().precision == want
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, 0.0, batch_first=True), 1, enable_nested_tensor=False).eval()
    packed = btlib.PackedEncoder.from_module(enc, precision="auto")
    assert packed.precision.precision == want and packed.layers[0].linear1.weight.dtype == packed.precision.dtype


def test_packed_encoder_bf16_on_a_non_native_cpu_warns_once_and_auto_is_fp32(fresh, monkeypatch):
    """With BTLIB_ASSUME_NO_BF16=1 (a laptop/Colab CPU simulated here): explicit bf16 runs and warns, auto is fp32."""
    monkeypatch.setenv("BTLIB_ASSUME_NO_BF16", "1")
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, 0.0, batch_first=True), 1, enable_nested_tensor=False).eval()
    with pytest.warns(device.SlowPrecisionWarning, match=r"not native on this CPU \(BTLIB_ASSUME_NO_BF16=1\).*GFLOP/s"):
        bf16 = btlib.PackedEncoder.from_module(enc, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        btlib.PackedEncoder.from_module(enc, precision="bf16")  # once per process
        auto = btlib.PackedEncoder.from_module(enc, precision="auto")
    assert bf16.layers[0].linear1.weight.dtype == torch.bfloat16
    assert auto.precision.precision == "fp32" and auto.layers[0].linear1.weight is enc.layers[0].linear1.weight
    with torch.inference_mode():
        assert bf16(torch.randn(2, 5, 32)).dtype == torch.float32


def test_describe_device_prints_four_lines_and_the_rest_on_request(capsys, monkeypatch):
    """A notebook's setup cell: four lines in view (the CPU with its generation); the GEMM table and precision="auto"
    folded under one line in a notebook, printed with full=True."""
    from btlib.cpu_generation import cpu_generation
    from btlib.fold import Folded

    shown = []
    monkeypatch.setattr(device, "_in_notebook", lambda: True)
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(obj))
    text = device.describe_device()
    assert len(text.splitlines()) == 4 and "btlib kernels" in text and cpu_generation() in text.splitlines()[1]
    assert len(shown) == 1 and isinstance(shown[0], Folded) and 'precision="auto":' in shown[0]
    assert "<details>" in shown[0]._repr_html_() and "GFLOP/s fp32" in shown[0]
    full = device.describe_device(full=True)
    assert full.startswith(text) and "GFLOP/s fp32" in full and 'precision="auto":' in full
    assert "GEMM at the encoder's shapes" in full and "* the path btlib takes" in full and "*" in full.split("tokens (")[1]


def test_import_measures_nothing():
    code = "import btlib, btlib.hardware as h; assert not h._memo; import btlib.device"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bf16_benchmark_providers_skip_where_bf16_is_slow(fresh, monkeypatch):
    from btlib.bench import load_all

    monkeypatch.setenv("BTLIB_ASSUME_NO_BF16", "1")
    benches = load_all()
    enc = next(p for p in benches["encoder_padding"].providers() if p.name == "btlib_packed_bf16")
    assert "not native" in enc.available() and "GFLOP/s" in enc.available()
    monkeypatch.delenv("BTLIB_ASSUME_NO_BF16")
    assert (enc.available() is None) == (device.bf16_slow_reason() is None)


def test_cpu_kernel_warns_once_for_bf16_without_bf16_dot(monkeypatch, fresh_warnings):
    """bf16 into the C++ kernels on a build without vdpbf16ps: runs (converted to fp32), warns once, says so."""
    if btlib.kernels.get("cpu_flash_v3").available():
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("BTLIB_ASSUME_NO_BF16", "1")
    q = torch.randn(1, 2, 9, 16).bfloat16()
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = btlib.attention(q, q, q, backend="cpu_flash_v3")
        btlib.varlen_attention(q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1),
                               torch.tensor([0, 9], dtype=torch.int32), 9, backend="cpu_flash_varlen")
    slow = [w for w in caught if issubclass(w.category, btlib.SlowPrecisionWarning)]
    assert len(slow) == 1 and "converted to fp32" in str(slow[0].message) and "BTLIB_ASSUME_NO_BF16" in str(slow[0].message)
    ref = btlib.reference_attention(q.float(), q.float(), q.float())
    assert btlib.kernels.relative_error(first.float(), ref) < 2e-2


def test_rates_measured_with_torch_restricted_are_kept_apart(monkeypatch):
    """ONEDNN_MAX_CPU_ISA=AVX2 (the README's AVX2-laptop recipe) measures another machine: another cache key."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    plain = hardware._key(2)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert hardware._key(2) != plain


def test_every_isa_hardware_detects_has_build_flags():
    """btlib.hardware names the builds (ISA detection with the other CPU facts); btlib.kernels.cpu.build compiles them."""
    from btlib.kernels.cpu import build

    assert set(build._FLAGS) == set(hardware.ISAS) and build.isa is hardware.isa
    assert hardware.runnable()[0] == "portable" and set(hardware.runnable()) <= set(hardware.ISAS)


def test_gemm_measures_through_hardware_and_follows_a_new_measurement(fresh, monkeypatch):
    """btlib.gemm hands hardware its measurement (hardware imports nothing above it); plan() reads the picks, and
    a new measurement drops the plan derived from the old one."""
    from btlib import gemm

    monkeypatch.delenv("BTLIB_GEMM", raising=False)
    monkeypatch.setattr(gemm, "_plans", {})
    monkeypatch.setattr(hardware, "measure_rates", lambda: rates())
    assert gemm.plan(torch.float32) == ((111, "onednn"), (None, "torch"))
    monkeypatch.setattr(hardware, "measure_rates", lambda: {**rates(), "gemm_pick": {"fp32": [[None, "onednn"]]}})
    hardware.machine(refresh=True)
    assert gemm.plan(torch.float32) == ((None, "onednn"),)
