"""btlib.bench.describe: the code a benchmark times, printed from its declaration (issue 37's experiment in view)."""

from __future__ import annotations

import re

import pytest

from btlib import bench
from btlib.bench.describe import describe


# btlib's own declarations (tests declare throwaway benchmarks into the same registry, e.g. tests/test_bench.py)
BTLIB_BENCHMARKS = sorted(n for n, b in bench.load_all().items() if b.make_inputs.__module__.startswith("btlib."))


def test_btlib_declares_its_benchmarks():
    assert {"attention_dense", "cpu_attention_versions", "windowed_attention_local", "gpu_attention"} <= set(BTLIB_BENCHMARKS)


@pytest.mark.parametrize("name", BTLIB_BENCHMARKS)
def test_every_benchmark_describes_its_providers_by_file_and_line(name):
    b = bench.load_all()[name]
    text = describe(b, quick=True)
    assert text.startswith(f"{name}: {b.description}")
    assert str(bench.protocol(quick=True)) in text
    for p in b.providers():
        line = re.search(rf"^    {re.escape(p.name)} +(\S+):(\d+)$", text, re.M)
        assert line, f"{p.name} has no file:line in\n{text}"
        assert line[1].startswith("btlib/") and int(line[2]) > 0


def test_a_provider_that_calls_a_registered_kernel_names_it_and_its_op():
    text = describe("cpu_attention_versions", quick=False)
    for kernel, op in (("cpu_flash_v3", "attention_v3"), ("cpu_naive_v1", "attention_v1"), ("torch_sdpa", "torch_sdpa")):
        assert re.search(rf"-> kernel {kernel}: {op} \(btlib/kernels/\S+\.py:\d+\)", text), text
    # a C++ op: the line of its family folder's binding (two hops from the cell: the binding, then the folder's headers)
    from btlib.kernels.cpu import build, source

    for op, folder in (("attention_v3", "flash"), ("attention_v1", "teaching")):
        path, line = source.binding(op)
        assert path == f"{folder}/{folder}.cpp" and f'm.impl("{op}"' in (build.HERE / path).read_text().splitlines()[line - 1]
        assert f"C++: btlib/kernels/cpu/{path}:{line} binds it" in text
    assert text.count("C++: ") == 3  # v1, v2, v3; the reference and SDPA are Python
    with pytest.raises(LookupError, match="no btlib C\\+\\+ source binds the op 'nope'"):
        source.binding("nope")
    # the timed call itself, not the rest of its source line
    assert 'lambda x: k.fn(x["q"], x["k"], x["v"], lengths=None, causal=False, scale=None)\n' in text
    assert "sizes: T in (128, 256, 512, 1024)" in text and "(quick mode)" not in text


def test_quick_mode_prints_the_quick_sizes():
    b = bench.load_all()["cpu_attention_versions"]
    assert f"sizes (quick mode): T in {tuple(b.quick['x_vals'])}" in describe(b, quick=True)


def test_a_cells_overrides_are_what_it_prints():
    b = bench.load_all()["attention_varlen"]
    text = describe(b, quick=False, params={"T": 64}, x_vals=[0.5], providers=["cpu_flash_varlen"])
    assert "sizes: padding in (0.5,); B 8, H 12, D 64, T 64" in text
    assert re.findall(r"^    (\w+) +btlib/", text, re.M) == ["cpu_flash_varlen"]


def test_the_protocol_printed_is_the_one_the_cell_runs():
    text = describe("attention_varlen", quick=False, rounds=3, warmup=2, min_runs=4, max_runs=4)
    assert "timed: 3 interleaved rounds per point; each round: 2 warm-up calls" in text
    assert "then exactly 4 timed calls;" in text  # min_runs == max_runs


def test_a_lambda_inside_another_on_one_line_prints_the_inner_one():
    """sdpa.py declares gpt_train's providers as `lambda: [Provider("sdpa", lambda x: _gpt_step(...), ...)`: the timed
    call is the inner lambda, found by the column its code starts at, not the first "lambda" on the line."""
    text = describe("gpt_train", quick=False)
    assert 'lambda x: _gpt_step(x["sdpa"], x)\n' in text
    assert "lambda: [Provider(" not in text


def test_one_round_promises_no_retry():
    """run_rounds retries a noisy point only when it runs more than one round; the printed protocol says the same."""
    one, two = describe("attention_dense", rounds=1, quick=False), describe("attention_dense", rounds=2, quick=False)
    assert "more rounds with trials twice as long" not in one and "too noisy to compare here" in one
    assert "more rounds with trials twice as long" in two


def test_a_fixed_number_of_calls_is_printed_as_such():
    """min_runs == max_runs: the trial time cannot add a call, so the protocol says "exactly N" (not "at least N and
    0.3 s (at most N)")."""
    text = describe("attention_dense", quick=False, min_runs=3, max_runs=3)
    assert "exactly 3 timed calls;" in text and "at least 3" not in text and "at most 3" not in text
    assert "at least 5 timed calls and 0.3 s (at most 50 calls)" in describe("attention_dense", quick=False)


def test_a_helper_the_timed_call_goes_through_is_printed_with_its_body():
    """``lambda x: _mha_call(x, nw, fp)`` says little: the body of the benchmark module's private helper (what the
    timed call really does) is printed once, below the providers, without its docstring."""
    text = describe("mha_need_weights")
    assert text.count("_mha_call, which the calls above go through (btlib/bench/sdpa.py:") == 1
    body = text.split("_mha_call, which the calls above go through")[1]
    assert "set_fastpath_enabled(fastpath)" in body and "need_weights=need_weights)[0]" in body
    assert '"""' not in body
    assert "_btlib, which the calls above" in describe("windowed_attention_local", providers=["btlib"])
    assert "which the calls above go through" not in describe("attention_dense")  # registry kernels: no helper
