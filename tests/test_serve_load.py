"""The Poisson load generator, the saturation search and the serve_load benchmark's declaration."""

import statistics
from concurrent.futures import Future

import pytest

from btlib.serve import Overloaded
from btlib.serve import load as L


def test_poisson_arrivals_have_the_rate_and_exponential_gaps():
    a = L.poisson_arrivals(200.0, 50.0, seed=3)
    assert abs(len(a) - 10_000) < 4 * 100  # Poisson count: mean 10,000, sd 100
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert abs(statistics.mean(gaps) - 1 / 200) < 2e-4 and abs(statistics.pstdev(gaps) - 1 / 200) < 3e-4  # exponential: sd = mean
    assert a == L.poisson_arrivals(200.0, 50.0, seed=3) and all(0 <= t < 50 for t in a)
    with pytest.raises(ValueError, match="rate"):
        L.poisson_arrivals(0, 1)


def test_workloads_mix_passages_in_the_asked_share():
    q, m = L.workload("queries", 1000), L.workload("mixed", 1000)
    assert max(len(t.split()) for t in q) <= 14
    share = sum(len(t.split()) >= 150 for t in m) / len(m)
    assert 0.15 < share < 0.25
    with pytest.raises(ValueError, match="workload"):
        L.workload("long", 3)


class FakeServer:
    """Answers at once; refuses every ``refuse_every``-th request; leaves every ``lose_every``-th unanswered."""

    def __init__(self, refuse_every=0, lose_every=0):
        self.n, self.refuse_every, self.lose_every = 0, refuse_every, lose_every

    def submit(self, texts):
        self.n += 1
        if self.refuse_every and self.n % self.refuse_every == 0:
            raise Overloaded("full")
        f = Future()
        if not (self.lose_every and self.n % self.lose_every == 0):
            f.set_result(texts)
        return f

    def close(self):
        pass


def test_run_load_counts_answered_refused_and_lost():
    r = L.run_load(FakeServer(refuse_every=4, lose_every=5).submit, ["t"], rate=400, duration_s=0.5, drain_timeout_s=0.05)
    assert r["answered"] + r["refused"] + r["lost"] == r["offered"] > 100
    assert r["refused"] == r["offered"] // 4 and r["lost"] > 0
    assert r["p99_ms"] is not None and not L.bounded(r, slo_ms=1e9)
    clean = L.run_load(FakeServer().submit, ["t"], rate=400, duration_s=0.2)
    assert clean["answered"] == clean["offered"] and L.bounded(clean, slo_ms=1e9)


class RemoteFakeServer(FakeServer):
    """Refuses as a server behind HTTP does: the future of every ``refuse_every``-th request fails with Overloaded (a 429)."""

    def submit(self, texts):
        self.n += 1
        f = Future()
        if self.refuse_every and self.n % self.refuse_every == 0:
            f.set_exception(Overloaded("full"))
        else:
            f.set_result(texts)
        return f


def test_run_load_counts_a_refusal_in_the_future_as_refused():
    r = L.run_load(RemoteFakeServer(refuse_every=4).submit, ["t"], rate=400, duration_s=0.5)
    assert r["refused"] == r["offered"] // 4 and r["errors"] == r["lost"] == 0 and r["answered"] + r["refused"] == r["offered"]
    assert not L.bounded(r, slo_ms=1e9)
    stopped = L.run_load(RemoteFakeServer(refuse_every=4).submit, ["t"], rate=400, duration_s=0.5, stop_on_refusal=True)
    assert stopped["refused"] == 1 and stopped["answered"] == 3  # the 5th arrival sees the 4th's refusal and stops


def test_max_rate_finds_the_knee(monkeypatch):
    """A server that is bounded up to 100 req/s: doubling from 16 fails at 128, bisection lands in (96, 100]."""
    monkeypatch.setattr(L, "run_load", lambda submit, texts, rate, duration_s, **kw: {
        "rate": rate, "refused": 0, "errors": 0, "lost": 0, "p99_ms": 10.0 if rate <= 100 else 1e4})
    best, trials = L.max_rate(FakeServer, ["t"], start=16, refine=3)
    assert 96 <= best <= 100 and [t["rate"] for t in trials[:4]] == [16, 32, 64, 128]
    best, _ = L.max_rate(FakeServer, ["t"], start=800, refine=0)  # start too high: halves down to 100
    assert best == 100


def test_serve_load_is_declared_with_every_method_and_the_issue_table():
    from btlib.bench import load_all
    from btlib.bench.serve_load import METHODS, issue_table

    b = load_all()["serve_load"]
    assert [p.name for p in b.providers()] == list(METHODS) and b.x_vals == ["queries", "mixed"]
    rows = [{"x": "queries", "provider": "packed_fp32", "max_rate_rps": 514.0},
            {"x": "mixed", "provider": "packed_fp32", "max_rate_rps": 156.0},
            {"x": "queries", "provider": "encode_per_request", "max_rate_rps": 135.0}]
    assert issue_table(rows).splitlines() == [
        "| workload | encode per request | packed batcher fp32 |", "|---|---|---|",
        "| short queries (req/s) | 135 | 514 |", "| 20% passages mixed in (req/s) | - | 156 |"]
    http = rows + [{"x": "queries", "provider": "http_packed_fp32", "max_rate_rps": 460.0, "http_client_cpu_ms": 0.41}]
    lines = issue_table(http).splitlines()
    assert lines[0] == "| workload | encode per request | packed batcher fp32 | packed batcher fp32 over HTTP |"
    assert lines[2] == "| short queries (req/s) | 135 | 514 | 460 |" and lines[3] == "| 20% passages mixed in (req/s) | - | 156 | - |"
    assert lines[4:] == ["HTTP costs 11% of the in-process max rate (short queries: 514 req/s in process, 460 over HTTP; "
                         "target <= 15%); the client's own CPU: 0.41 ms per request"]
    # with each search's first failed rate, the cost to the search's resolution (192 served, 256 not: +-33%)
    coarse = [{"x": "mixed", "provider": "packed_fp32", "max_rate_rps": 192.0, "first_failed_rps": 256.0},
              {"x": "mixed", "provider": "http_packed_fp32", "max_rate_rps": 128.0, "first_failed_rps": 192.0}]
    assert issue_table(coarse).splitlines()[3:] == [
        "HTTP costs 33% of the in-process max rate (20% passages mixed in: 192 req/s in process, 128 over HTTP; target <= 15%)",
        "  to this search's resolution (in process 192-256, HTTP 128-192 req/s) the cost lies between 0% and 50%: "
        "more bisections (refine) narrow it"]
    assert b.summary is issue_table


def test_a_trial_measures_the_percentile_its_requests_support():
    from btlib.serve.stats import percentile_interval, supported_percentile

    assert [supported_percentile(n) for n in (500, 499, 100, 99, 50, 10, 9)] == [99, 95, 95, 90, 90, 50, None]
    values = list(range(1, 101))
    assert percentile_interval(values, 95) == (90, 100) and percentile_interval([], 95) is None
    lo, hi = percentile_interval(values, 50)
    assert lo < 50 < hi and hi - lo <= 22  # a median from 100 values: about +-10 ranks
    # a low rate's trial lasts until min_requests have arrived; a high rate's keeps its duration
    assert len(L.poisson_arrivals(10.0, 1.0, seed=1, min_requests=100)) == 100
    assert len(L.poisson_arrivals(1000.0, 1.0, seed=1, min_requests=100)) > 900


def test_max_rate_holds_the_asked_percentile_and_marks_each_trial(monkeypatch):
    seen = []

    def fake(submit, texts, rate, duration_s, **kw):
        seen.append(kw["min_requests"])
        return {"rate": rate, "refused": 0, "errors": 0, "lost": 0, "p95_ms": 10.0 if rate <= 100 else 1e4, "p99_ms": 1e4}

    monkeypatch.setattr(L, "run_load", fake)
    best, trials = L.max_rate(FakeServer, ["t"], start=16, refine=0, q=95, min_requests=100)
    assert best == 64 and [t["bounded"] for t in trials] == [True, True, True, False] and set(seen) == {100}
    assert L.max_rate(FakeServer, ["t"], start=16, refine=0)[0] == 0  # its p99 is never within the SLO


def test_the_issue_table_names_the_percentile_and_the_trial_length():
    from btlib.bench.serve_load import issue_table, slo_percentile

    assert slo_percentile({"trial_requests": 100}) == 95 and slo_percentile({"trial_requests": 500}) == 99
    with pytest.raises(ValueError, match="at least 10"):
        slo_percentile({"trial_requests": 5})
    rows = [{"x": "mixed", "provider": "packed_fp32", "max_rate_rps": 96.0, "slo_q": 95.0, "trial_requests": 100.0,
             "params": {"slo_ms": 250.0}}]
    assert issue_table(rows).splitlines()[-1] == ("req/s: the highest Poisson rate served with p95 <= 250 ms and none refused; "
                                                  "every trial offered at least 100 requests")


def test_rates_are_compared_to_the_search_resolution():
    import doctest

    from btlib.bench import serve_load
    from btlib.bench.serve_load import compare_rates

    assert doctest.testmod(serve_load).failed == 0
    assert compare_rates({"max_rate_rps": 48.0, "first_failed_rps": 64.0}, {"max_rate_rps": 96.0, "first_failed_rps": 128.0}) == \
        "lower, 1.5x to 2.7x below it (48-64 against 96-128 req/s)"
    assert compare_rates({"max_rate_rps": 96.0, "first_failed_rps": 128.0}, {"max_rate_rps": 112.0, "first_failed_rps": 128.0}) \
        .startswith("the same")


def test_run_load_freezes_the_callers_objects_only_while_it_runs():
    import gc

    seen = []

    def submit(texts):
        seen.append(gc.get_freeze_count())
        f = Future()
        f.set_result(None)
        return f

    if gc.get_freeze_count():
        pytest.skip("something in this session froze objects already")
    r = L.run_load(submit, ["a"], rate=200, duration_s=0.05, min_requests=3)
    assert r["answered"] == r["offered"] == len(seen) >= 3
    assert all(n > 0 for n in seen) and gc.get_freeze_count() == 0  # frozen during the run, thawed after
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        L.run_load(submit, ["a"], rate=200, duration_s=0.05, min_requests=3)
        # a caller's own freeze is left as it was: unfreeze would empty the permanent generation, while a frozen
        # object may still die by its reference count during the run (the count then falls by a few: 2 of 1.2 M in
        # one full-session run)
        assert gc.get_freeze_count() > frozen // 2
    finally:
        gc.unfreeze()
