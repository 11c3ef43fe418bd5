"""btlib.bench.verdict: the word is chosen by the ratio against the measured noise; a factor inside the noise is never printed."""

import doctest

import pytest

import btlib.bench.verdict as verdict
from btlib.bench import compare, find_row, noise
from btlib.bench.verdict import faster_first, share_of_ideal


def _row(provider, median, lo=None, rounds=None, status="ok"):
    return {"provider": provider, "x": 1, "status": status, "median_ms": median, "min_ms": lo or median,
            "round_medians_ms": rounds or [], "params": {}}


def test_docstring_example():
    assert doctest.testmod(verdict).failed == 0


@pytest.mark.parametrize("a, b, word", [(50, 100, "faster"), (100, 50, "slower"), (100, 101, "no clear difference")])
def test_verdict_word(a, b, word):
    assert compare(_row("a", a), _row("b", b)).verdict == word


def test_noise_from_rounds_beats_within_run_spread():
    r = _row("a", 100, lo=99, rounds=[100, 130])
    assert noise(r) == pytest.approx(0.30)
    # 20% apart is inside a 30% spread: no verdict either way
    assert compare(r, _row("b", 120)).verdict == "no clear difference"
    assert noise(_row("a", 110, lo=100)) == pytest.approx(0.10)


def test_one_bad_round_sets_neither_time_nor_noise():
    # run_rounds keeps the best round; a burst of other work in a third round must not hide a 1.5x difference
    r = _row("a", 100, rounds=[100, 103, 900])
    assert noise(r) == pytest.approx(0.03)
    assert compare(r, _row("b", 150, rounds=[150, 151, 152])).verdict == "faster"


def test_slower_is_as_far_from_equal_as_faster():
    # 50x slower with 40% noise is slower, not "no clear difference" (|0.02 - 1| < 0.4 + 1 would say so)
    a, b = _row("a", 100, rounds=[100, 140]), _row("b", 2, rounds=[2, 2.01])
    assert compare(a, b).verdict == "slower" and compare(b, a).verdict == "faster"
    assert str(compare(a, b)) == "50.00x slower (noise ±40%)" and compare(a, b).ratio == pytest.approx(0.02)
    assert compare(_row("a", 100, rounds=[100, 140]), _row("b", 75)).verdict == "no clear difference"


@pytest.mark.parametrize("a, b", [((100, [100, 103]), (102, [102, 104])), ((100, [100, 130]), (120, [120, 121])),
                                  ((100, [100, 145]), (70, [70, 71]))])
def test_overlapping_intervals_print_no_factor(a, b):
    """Intervals [t, t (1 + s)] at the larger spread s overlap: the sentence names no factor, whichever row is faster."""
    c = compare(_row("a", a[0], rounds=a[1]), _row("b", b[0], rounds=b[1]))
    assert not c.clear and c.verdict == "no clear difference"
    assert str(c) == f"no clear difference (noise ±{c.noise:.0%})" and "x" not in str(c)


def test_the_verdict_turns_clear_just_past_the_larger_spread():
    fast = _row("a", 100, rounds=[100, 105])  # spread 5%
    assert not compare(fast, _row("b", 105, rounds=[105, 105.5])).clear  # 5% apart: the intervals touch
    assert str(compare(fast, _row("b", 106, rounds=[106, 106.5]))) == "1.06x faster (noise ±5%)"


@pytest.mark.parametrize("slower", [102.5, 104.9])
def test_a_difference_clear_of_the_noise_but_under_5_percent_names_no_factor(slower):
    """Noise 2% (the floor), 2.5-4.9% apart: beyond the noise, yet "about the same (within 5%)" with no factor, and the
    verdict word is no clear difference; at 5.1% the factor is named."""
    a, b = _row("a", 100, rounds=[100, 100.5]), _row("b", slower, rounds=[slower, slower + 0.1])
    c = compare(a, b)
    assert c.beyond_noise and not c.clear and c.verdict == "no clear difference"
    assert str(c) == "about the same (within 5%; noise ±2%)"
    assert faster_first(a, b, "a", "b") == "a against b: about the same (within 5%; noise ±2%)"
    assert share_of_ideal(a, b) == "as fast as the ideal within 5% (noise ±2%)"
    assert str(compare(a, _row("b", 105.1, rounds=[105.1, 105.2]))) == "1.05x faster (noise ±2%)"


def test_compare_refuses_untimed_rows():
    with pytest.raises(ValueError, match="not timed"):
        compare(_row("a", 1), {"provider": "b", "status": "skipped", "reason": "no GPU"})


def test_find_row():
    rows = [_row("a", 1), _row("b", 2)]
    assert find_row(rows, "b")["median_ms"] == 2
    with pytest.raises(LookupError, match="0 rows"):
        find_row(rows, "c")


def test_run_rounds_records_every_round():
    from btlib.bench import run_rounds
    from btlib.bench.core import Benchmark, Provider

    bench = Benchmark(name="t", description="", x_name="n", x_vals=(4,), providers=lambda: [Provider("sum", lambda x: x["t"].sum())],
                      make_inputs=lambda p: {"t": __import__("torch").ones(p["n"])}, reference=lambda x: x["t"].sum(),
                      error=lambda out, ref, x: float((out - ref).abs()), tol=0.0)
    (row,) = run_rounds(bench, rounds=3, save=False, warmup=0, min_runs=1, max_runs=1, min_time_s=0.0)
    assert len(row["round_medians_ms"]) == 3 and row["median_ms"] == min(row["round_medians_ms"])


def test_rounds_interleave_the_providers_and_rotate_which_goes_first():
    """Round k starts at the k-th provider (A B C, B C A, C A B): none is always timed first, or last."""
    import torch

    from btlib.bench import run_rounds
    from btlib.bench.core import Benchmark, Provider

    calls = []

    def provider(name):
        return Provider(name, lambda x: calls.append(name) or x["t"].sum())

    bench = Benchmark(name="t", description="", x_name="n", x_vals=(4,),
                      providers=lambda: [provider(n) for n in "ABC"],
                      make_inputs=lambda p: {"t": torch.ones(p["n"])}, reference=lambda x: x["t"].sum(),
                      error=lambda out, ref, x: float((out - ref).abs()), tol=0.0)
    rows = run_rounds(bench, rounds=3, save=False, warmup=0, min_runs=1, max_runs=1, min_time_s=0.0)
    # each provider is called twice per round: checked against the reference (which is the protocol's warm-up
    # call: warmup=0 cannot remove it), then timed
    assert "".join(calls) == "AABBCC" + "BBCCAA" + "CCAABB"
    assert [r["provider"] for r in rows] == ["A", "B", "C"], "rows keep the declared order"
    assert all(len(r["round_medians_ms"]) == 3 for r in rows)


def test_faster_first_names_the_faster_row_first():
    slow, fast = _row("slow", 100), _row("fast", 25)
    assert faster_first(slow, fast, "v1", "v3") == "v3 against v1: 4.00x faster (noise ±2%)"
    assert faster_first(fast, slow, "v3", "v1") == "v3 against v1: 4.00x faster (noise ±2%)"


def test_faster_first_keeps_the_given_order_when_there_is_no_clear_difference():
    a, b = _row("a", 101, rounds=[101, 104]), _row("b", 100, rounds=[100, 103])
    assert faster_first(a, b, "v3", "SDPA") == "v3 against SDPA: no clear difference (noise ±3%)"
    assert faster_first(b, a, "SDPA", "v3") == "SDPA against v3: no clear difference (noise ±3%)"


def test_share_of_ideal_is_never_a_fraction_above_one():
    ideal = {"provider": "ideal", "median_ms": 10.0, "min_ms": 10.0}
    row = lambda ms, rounds: {"provider": "p", "median_ms": ms, "min_ms": ms, "round_medians_ms": rounds}  # noqa: E731
    assert share_of_ideal(row(12.5, [12.5, 12.6]), ideal) == "80% of the ideal (noise ±2%)"
    assert share_of_ideal(row(9.8, [9.8, 10.2]), ideal, "its ideal") == "as fast as its ideal within noise (±4%)"
    beyond = share_of_ideal(row(8.0, [8.0, 8.1]), ideal)
    assert beyond.startswith("1.25x faster than the ideal, beyond noise") and "too low to be a bound" in beyond
    assert "%" not in beyond.split("(")[0]  # no "125% of the ideal"
    # below the ideal but inside the noise: no share is quoted either
    assert share_of_ideal(row(10.3, [10.3, 10.8]), ideal) == "as fast as the ideal within noise (±5%)"


def test_each_padding_free_path_is_a_share_of_its_own_engines_ideal():
    from btlib.bench.encoder import encoder_providers, ideal_row

    names = [p.name for p in encoder_providers()]
    assert {"ideal", "ideal_packed"} <= set(names)
    rows = [{"provider": n, "x": 0.5} for n in ("ideal", "ideal_packed")]
    assert ideal_row(rows, "btlib_packed", 0.5)["provider"] == "ideal_packed"
    assert ideal_row(rows, "fastpath_nested", 0.5)["provider"] == "ideal"


def test_noise_above_the_limit_is_a_failed_measurement_not_a_verdict():
    """A spread above 50% (btlib.bench.timing.NOISE_LIMIT) gives no factor, no share, and says to measure again."""
    noisy = _row("a", 10, rounds=[10, 16])  # next-best round 60% above the best
    c = compare(noisy, _row("b", 100, rounds=[100, 101]))
    assert c.too_noisy and not c.clear and c.verdict == "too noisy to compare here"
    assert str(c) == "too noisy to compare here (noise ±60%: measure on a quiet machine)"
    assert faster_first(noisy, _row("b", 100), "a", "b") == "a against b: too noisy to compare here (noise ±60%: measure on a quiet machine)"
    assert share_of_ideal(noisy, _row("ideal", 5)).startswith("too noisy to compare here against the ideal (noise ±60%")
    assert compare(_row("a", 10, rounds=[10, 15]), _row("b", 100)).verdict == "faster"  # 50% itself is still a verdict
