"""btlib.bench.encoder.speedup_parts: a padding-free speedup said as engine x padding, the two multiplying to the
total; btlib_padded runs btlib's encoder on every position of the padded batch (its output on real tokens is the
packed one's, the padding computed)."""

import torch

from btlib.bench.encoder import encoder_inputs, encoder_providers, speedup_parts
from btlib.models.encoder import EncoderConfig


def _row(provider, ms, noise=0.02):
    return {"provider": provider, "x": 0.5, "status": "ok", "median_ms": ms, "min_ms": ms,
            "round_medians_ms": [ms, ms * (1 + noise)], "params": {}}


def test_engine_times_padding_is_the_total():
    rows = [_row("fastpath", 968.0), _row("btlib_packed", 211.0), _row("btlib_padded", 420.0), _row("ideal", 472.0),
            _row("ideal_packed", 205.0)]
    lines = speedup_parts(rows, 0.5, flop_ratio=2.02)
    assert lines[0] == "btlib_packed against the fastpath: 4.59x faster (noise ±2%), made of"
    assert "same padded batch 2.30x faster" in lines[1] and "real tokens alone 2.30x faster" in lines[1]
    assert "btlib on the padded batch 1.99x faster (noise ±2%) (FLOP ratio 2.02x)" in lines[2]
    assert lines[3] == "  check: 2.30 x 1.99 = 4.59 (the total's 4.59)"


def test_btlib_padded_computes_every_position():
    cfg = EncoderConfig(num_layers=1, d_model=32, nhead=4, dim_feedforward=64)
    x = encoder_inputs({"config": cfg, "B": 3, "T": 9, "padding": 0.5})
    assert torch.equal(x["full"], torch.full((3,), 9, dtype=x["lengths"].dtype))
    run = {p.name: p.fn for p in encoder_providers()}
    padded, packed = run["btlib_padded"](x), run["btlib_packed"](x)
    # every position computed: attention over the padding changes the real tokens too, so only the full rows agree
    assert padded.shape == packed.shape == (3, 9, 32) and torch.isfinite(padded).all()
    full = [b for b, n in enumerate(x["lengths"].tolist()) if n == 9]
    torch.testing.assert_close(padded[full], packed[full], atol=1e-5, rtol=0)
    assert x["lengths"].min() < 9  # some padding, so the two runs differ in cost
