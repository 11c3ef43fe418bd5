"""The padding explorer behind notebook 06's widgets, driven headless."""

import matplotlib
import matplotlib.container
import pytest

from btlib.explore import BASELINE, PaddingExplorer
from btlib.models import TINY

matplotlib.use("Agg")


def test_run_point_records_checked_speedups():
    ex = PaddingExplorer(TINY)
    rows = ex.run_point(0.5, 4, 32, providers=("btlib_packed", "ideal"))
    assert [r["provider"] for r in rows] == [BASELINE, "btlib_packed", "ideal"]
    assert all(r["status"] == "ok" for r in rows)
    point = ex.history[(4, 32, "uniform")][0.5]
    assert point[BASELINE] == 1.0 and point["btlib_packed"] > 0
    assert "50% padding" in ex.last
    ex.run_point(0.0, 4, 32, distribution="zipf", providers=("btlib_packed",))
    (p_real,) = ex.history[(4, 32, "zipf")]
    assert 0.0 < p_real < 1.0  # Zipf lengths bring their own padding, the slider's value is ignored
    ax = ex.plot(4, 32)
    labels = [line.get_label() for line in ax.lines]
    assert "btlib_packed" in labels and "FLOP ratio 1/(1-p)" in labels
    bars = [c for c in ax.containers if isinstance(c, matplotlib.container.ErrorbarContainer)]
    assert len(bars) == 2  # btlib_packed and ideal carry their spread
    low, high = ex.bands[(4, 32, "uniform")][0.5]["btlib_packed"]
    assert low <= 1.0 <= high  # the speedup lies inside its own band


def test_widget_reruns_on_change():
    pytest.importorskip("ipywidgets")
    ex = PaddingExplorer(TINY)
    ui = ex.widget(padding=0.5, B=4, T=32)
    controls = ui.children[0].children[0].children  # padding, batch size, max length
    progress, status = ui.children[1].children
    first = status.value
    assert progress.value == progress.max and "B=4" in first
    controls[0].value = 0.25  # move the padding slider
    assert 0.25 in ex.history[(4, 32, "uniform")] and status.value != first
    controls[1].value = 6  # move the batch-size slider
    assert (6, 32, "uniform") in ex.history and "B=6" in status.value
