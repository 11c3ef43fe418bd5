"""btlib.diagrams: each diagram drawn (Agg) on odd sizes, and what it drew checked against btlib's own answers."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

import btlib  # noqa: E402
from btlib import bench, diagrams  # noqa: E402
from btlib.blocks import DEAD, tile_map  # noqa: E402


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


@pytest.mark.parametrize("lengths", [[2, 4, 3], [97, 1], [0, 1, 0], [5]])
def test_packed_draws_every_token_and_the_cu_seqlens_of_btlib(lengths):
    fig, (ax_pad, ax_pk) = diagrams.draw_packed(lengths)
    L = torch.tensor(lengths)
    B, T, total = len(lengths), max(lengths), sum(lengths)
    pad = [p for p in ax_pad.patches if isinstance(p, Rectangle)]
    assert len(pad) == B * T and sum(p.get_label() == "padding" for p in pad) == B * T - total
    assert sum(p.get_label() == "token" for p in ax_pk.patches) == total
    cu, _ = btlib.lengths_to_cu_seqlens(L)
    assert [t.get_text() for t in ax_pk.texts if t.get_gid() == "cu_seqlens"] == [str(c) for c in cu.tolist()]
    # the packed row is in pack's order: sequence by sequence, each token's colour that of its sequence's row
    row_colors = [ax_pad.patches[b * T].get_facecolor() for b in range(B) if lengths[b]]
    packed_colors = [ax_pk.patches[int(c)].get_facecolor() for c in cu[:-1].tolist() if int(c) < total]
    assert sorted(set(packed_colors)) == sorted(set(row_colors))


def test_packed_refuses_what_it_cannot_draw():
    with pytest.raises(ValueError, match="smaller batch"):
        diagrams.draw_packed([0, 0])
    with pytest.raises(ValueError):
        diagrams.draw_packed([3, -1])


@pytest.mark.parametrize("T, i, window, causal", [(200, 2, (64, 64), False), (97, 1, None, False), (1, 0, None, False),
                                                  (300, 4, (128, 0), True)])
def test_tile_walk_visits_the_alive_tiles_and_ends_at_the_reference(T, i, window, causal):
    fig, (ax_map, ax_ml, ax_o) = diagrams.draw_tile_walk(T, i=i, window=window, causal=causal)
    kinds = tile_map(T, causal=causal, window=window)
    alive = int((kinds[i] != DEAD).sum())
    visits = [t for t in ax_map.texts if t.get_gid() == "visit"]
    assert [t.get_text() for t in visits] == [str(n) for n in range(1, alive + 1)]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(T, 16, generator=g, dtype=torch.float64) for _ in range(3))
    row = i * 64
    steps = diagrams.online_softmax_steps(q, k, v, row, causal=causal, window=window)
    assert len(steps) == alive  # the first row of a block reaches every tile its block reaches here
    ref = btlib.reference_attention(q[None, None], k[None, None], v[None, None], causal=causal, window=window)[0, 0, row]
    torch.testing.assert_close(steps[-1].out, ref, rtol=0, atol=1e-12)
    assert all(a.m <= b.m for a, b in zip(steps, steps[1:])) and steps[0].alpha == 0.0
    assert all(0 < s.alpha <= 1 for s in steps[1:])


def test_tile_walk_refuses_a_block_past_the_end():
    with pytest.raises(ValueError, match="query blocks"):
        diagrams.draw_tile_walk(97, i=2)


def test_batcher_replays_the_policy_of_batch_encoder():
    arrivals = [0.0, 3.0, 4.0, 5.0, 30.0, 30.5]
    tokens = [500, 300, 250, 20, 600, 5]
    batches = diagrams.simulate_batcher(arrivals, tokens, max_batch_tokens=512, max_wait_ms=2.0, c0_ms=1.0, c1_ms=0.01)
    assert sorted(n for b in batches for n in b.requests) == list(range(len(arrivals)))
    assert batches[0].requests == (0,) and batches[0].start_ms == 2.0  # under the budget: waits max_wait_ms, then runs
    # queued while the worker ran: the oldest first; 250 does not fit after 300, the later 20 does (FIFO with an age
    # bound, not strict FIFO), and the 250 leads the next batch
    assert batches[1].requests == (1, 3) and batches[1].start_ms == batches[0].end_ms == 8.0
    assert batches[2].requests == (2,)
    assert batches[3].requests == (4,) and batches[3].start_ms == 30.0  # over the budget: runs at once, alone
    assert batches[4].requests == (5,)
    assert all(b.tokens <= 512 or len(b.requests) == 1 for b in batches)
    assert all(a.end_ms <= b.start_ms for a, b in zip(batches, batches[1:]))
    fig, (ax_r, ax_w) = diagrams.draw_batcher(arrivals, tokens, max_batch_tokens=512, max_wait_ms=2.0, c0_ms=1.0, c1_ms=0.01)
    assert sum(p.get_label() == "batch" for p in ax_w.patches) == len(batches)
    assert [t.get_text().split("\n")[0] for t in ax_w.texts] == [f"{len(b.requests)} req" for b in batches]


def test_batcher_edge_cases():
    assert diagrams.simulate_batcher([], []) == []
    one = diagrams.simulate_batcher([5.0], [97], max_wait_ms=0)
    assert one[0].requests == (0,) and one[0].start_ms == 5.0
    with pytest.raises(ValueError, match="one token count per arrival"):
        diagrams.simulate_batcher([1.0], [1, 2])
    with pytest.raises(ValueError, match=">= 0"):
        diagrams.simulate_batcher([1.0], [1], c0_ms=-1.0)
    diagrams.draw_batcher([5.0], [1])


def test_palette_one_colour_per_method():
    c = diagrams.method_color
    assert c("btlib_packed") == c("packed") == c("packed_fp32") == c("btlib")
    assert c("packed_bf16") == c("btlib_packed_bf16") != c("packed")
    assert c("ort_fp32") == c("ort_int8_sorted") == c("tei_ort_padded") != c("ov_fp32")
    assert c("fastpath") != c("fastpath_nested") and c("ideal") == c("ideal_packed")
    assert c("sdpa_padded_mask") == c("torch_sdpa") and c("flex_block_mask") != c("torch_sdpa")
    assert c("some_new_method") == c("some_new_method")  # unknown: a spare colour, stable
    s = diagrams.method_style("ort_int8_sorted")
    assert s["linestyle"] == ":" and s["marker"] == "s" and diagrams.method_style("packed_bf16")["linestyle"] == "--"


def test_bench_plot_takes_each_providers_colour_from_the_palette():
    rows = [{"benchmark": "toy", "provider": prov, "x_name": "x", "x": x, "status": "ok", "median_ms": ms}
            for prov, ms in (("packed_bf16", 1.0), ("fastpath", 2.0), ("ideal", 0.5)) for x in (1, 2)]
    ax = bench.plot(rows)
    lines = [line for line in ax.lines if not line.get_label().startswith("_")]  # not the error bars' caps
    assert [(line.get_label(), line.get_color()) for line in lines] == \
        [(p, diagrams.method_color(p)) for p in ("packed_bf16", "fastpath", "ideal")]
    assert lines[0].get_linestyle() == "--" and lines[1].get_linestyle() == "-"
