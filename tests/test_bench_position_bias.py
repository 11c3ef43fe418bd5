"""btlib.bench.position_bias: attention_bias checks out at its quick sizes, and its memory column shows no (T, T) tensor.

- quick sizes (T = 97, 130: not tile multiples, and 130 > max_distance 128, so the table's clamp is reached): every
  provider passes its check against the reference with the same bias, every row carries peak_mib, the summary
  pairs each biased row with its kernel without bias;
- at T = 1024, H = 12 (one (H, T, T) fp32 bias: 48 MiB) the fused kernels with a bias allocate less than 1/16 of
  that, and no more than without a bias; SDPA with the bias as a float mask allocates at least that much (the
  measurement sees a (H, T, T) tensor where one exists). Memory only: nothing here asserts on time.
"""

import re

import pytest

from btlib.bench import load_all, run
from btlib.bench.position_bias import PAIRS, bias_inputs, bias_summary

PROVIDERS = {"v3", "v3_alibi", "v3_table", "varlen", "varlen_table", "sdpa_table"}


@pytest.fixture(scope="module")
def bench():
    return load_all()["attention_bias"]


def test_attention_bias_checks_out_quick(bench):
    assert {p.name for p in bench.providers()} == PROVIDERS and set(PAIRS) < PROVIDERS
    rows = run(bench, quick=True, threads=2, warmup=0, min_runs=1, max_runs=1, save=False)
    assert {r["x"] for r in rows} == set(bench.quick["x_vals"])
    bad = [(r["provider"], r["x"], r["status"], r.get("reason", r.get("error"))) for r in rows if r["status"] != "ok"]
    assert not bad, bad
    assert all(r["error"] <= 1e-5 and r["peak_mib"] >= 0 for r in rows)
    text = bias_summary(rows)
    for T in bench.quick["x_vals"]:
        assert f"T={T}:" in text
    for name in PAIRS:  # a time ratio to its kernel without bias on every biased row, at every T
        ratios = re.findall(rf"^  {name} +[0-9.]+ +[0-9.]+ +([0-9.]+)x ", text, flags=re.M)
        assert len(ratios) == len(bench.quick["x_vals"]) and all(float(r) > 0 for r in ratios), (name, text)


def test_bias_inputs_mix_lengths_and_reach_the_clamp():
    x = bias_inputs({"T": 130, "tokens": 194, "H": 2, "D": 32})
    assert x["q"].shape == (1, 2, 130, 32)
    L = x["lengths"]
    assert len(L) == 2 and int(L.max()) == 130 and int(L.min()) < 130
    assert x["bias"]["table"].max_distance == 128 < 130 and x["bias"]["alibi"].H == 2


def test_fused_bias_allocates_no_TT_tensor(bench):
    T, H = 1024, 12
    tt = 4 * H * T * T  # one (H, T, T) fp32 bias: 48 MiB
    rows = run(bench, x_vals=[T], params={"tokens": T, "H": H, "D": 32}, threads=2, warmup=0, min_runs=1, max_runs=1,
               save=False)
    by = {r["provider"]: r for r in rows}
    assert all(r["status"] == "ok" for r in rows), [(r["provider"], r.get("reason")) for r in rows]
    peak = {name: r["peak_mib"] * 2**20 for name, r in by.items()}
    out = 4 * H * T * 32  # the (1, H, T, D) output, 1.5 MiB: what v3 must allocate
    for name in ("v3_alibi", "v3_table", "varlen_table"):
        assert peak[name] < tt / 16, (name, peak[name], tt)
        assert peak[name] <= peak[PAIRS[name]] + 64 * 1024, (name, peak[name], peak[PAIRS[name]])  # the bias adds nothing
    assert peak["v3"] >= out
    assert peak["sdpa_table"] >= tt, (peak["sdpa_table"], tt)
