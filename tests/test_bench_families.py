"""family_speed (btlib.bench.families) in quick mode, and its FLOP prediction.

Quick mode: every family's folder (tiny, random weights, written by transformers), both providers checked and timed,
btlib's packed hidden states within 1e-5 of transformers' on every real token of the workbook's corpus, and every row
carrying the prediction, equal for the two rows of a family. predict: its worked example, equal to
btlib.lengths.encoder_flops where the two formulas are the same (no GLU, no window: padded = every text at its batch's
longest), the GLU FFN's third matrix and the window's pairs counted by hand. The registry: every family of
btlib.pretrained.coverage has a row here, at the bound coverage states for it.
"""

import pytest
import torch

from btlib import bench
from btlib.bench.families import FAMILY_NAMES, TOL, Shape, predict, summary
from btlib.lengths import encoder_flops
from btlib.pretrained.coverage import FAMILIES

from model_folder import needs_model


def test_predict_worked_example_is_encoder_flops_padded_over_packed():
    L = torch.tensor([2, 4, 3])
    pr = predict(L, 2, Shape(layers=2, d=8, d_ff=32))
    assert pr["token_ratio"] == 11 / 9  # [2, 4] padded to 4, then [3]: 11 slots for 9 tokens
    assert pr["packed"] == encoder_flops(L, 8, 32, 2)
    assert pr["padded"] == encoder_flops(torch.tensor([4, 4, 3]), 8, 32, 2)
    assert pr["speedup"] == pr["padded"] / pr["packed"] > 1
    assert predict(L, 1, Shape(layers=2, d=8, d_ff=32))["speedup"] == 1.0  # batches of one: nothing padded


def test_predict_counts_the_glu_matrix_and_the_window():
    L = torch.tensor([4])
    glu = predict(L, 1, Shape(layers=1, d=8, d_ff=32, glu=True))
    assert glu["packed"] == (8 * 64 + 6 * 8 * 32) * 4 + 4 * 8 * 16
    # 3 layers, 2 of them local with window (1, 1): 4 + 3 + 3 pairs each packed, all 16 padded
    win = predict(L, 1, Shape(layers=3, d=8, d_ff=32, window=(1, 1), local_layers=2))
    assert win["packed"] == (8 * 64 + 4 * 8 * 32) * 4 * 3 + 4 * 8 * (16 + 2 * 10)
    assert win["padded"] == ((8 * 64 + 4 * 8 * 32) * 4 + 4 * 8 * 16) * 3


def test_predict_counts_a_decoders_attention_width_and_causal_pairs():
    L = torch.tensor([4])
    # q 16 wide, k and v 8 wide (GQA), SwiGLU: 2 8 (16 + 16) + 2 8 16 + 6 8 32 = 2304 per token; causal 10 pairs of 16
    dec = predict(L, 1, Shape(layers=1, d=8, d_ff=32, glu=True, attn=16, kv=8, causal=True))
    assert dec["packed"] == 2304 * 4 + 4 * 16 * 10 and dec["padded"] == 2304 * 4 + 4 * 16 * 16
    assert str(Shape(layers=1, d=8, d_ff=32, glu=True, attn=16, kv=8, causal=True)) == \
        "1 x 8, attention 16 (k, v 8), causal, GLU FFN 32"


def test_every_family_of_the_registry_has_a_row_at_its_bound():
    loaded = {f.name: f for f in FAMILIES if f.name != "cross-encoder heads"}
    missing = set(loaded) - set(FAMILY_NAMES)
    assert not missing, (f"btlib.pretrained.coverage has families {sorted(missing)} that family_speed does not time: add "
                         "each to btlib.bench.families.FAMILY_NAMES and its transformers config class to _config")
    assert {loaded[n].fp32_tol for n in FAMILY_NAMES if n in loaded} == {TOL}


@needs_model
def test_family_speed_quick():
    pytest.importorskip("transformers")
    rows = bench.run(bench.load_all()["family_speed"], quick=True, threads=2, save=False)
    assert [(r["x"], r["provider"]) for r in rows] == [(f, p) for f in FAMILY_NAMES for p in ("transformers", "packed")]
    for r in rows:
        assert r["status"] == "ok" and r["error"] <= TOL, (r["x"], r["provider"], r.get("reason"), r.get("error"))
        assert r["predicted"] > 1 and r["token_ratio"] > 1 and r["shape"] and r["attn"] == ("eager" if r["x"] == "mpnet" else "sdpa"), r  # transformers has no SDPA MPNet
    for f in FAMILY_NAMES:  # the two rows of a family: one prediction
        assert len({r["predicted"] for r in rows if r["x"] == f}) == 1
    assert len({r["token_ratio"] for r in rows}) == 1  # one corpus, one tokenizer, one batching for every family
    text = summary(rows)
    assert all(f"\n{f} " in text for f in FAMILY_NAMES) and "predicted" in text


@needs_model
def test_the_check_alone_runs_untimed_and_says_each_familys_error():
    pytest.importorskip("transformers")
    from btlib.bench.families import check

    lines = check(("bert", "modernbert")).splitlines()
    assert [line.split()[0] for line in lines] == ["bert", "modernbert"]
    assert all(f"<= {TOL:.0e}: True" in line for line in lines), lines
