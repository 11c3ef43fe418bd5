"""The window explorer behind notebook 08's widget, driven headless."""

import matplotlib
import pytest

from btlib.kernels import get
from btlib.window_explore import WindowExplorer

matplotlib.use("Agg")
pytestmark = pytest.mark.skipif(not get("cpu_flash_varlen").window, reason="cpu_flash_varlen takes no window in this checkout")
FAST = {"warmup": 0, "min_runs": 1, "max_runs": 1, "min_time_s": 0.0}


def test_run_point_predicts_and_measures():
    ex = WindowExplorer(H=2, D=32, timing=FAST)
    p = ex.run_point(16, 512)
    assert p.pairs_speedup == pytest.approx(512**2 / (512 * 33 - 16 * 17), rel=1e-9)
    assert p.tiles_speedup == 64 / 22  # 8 x 8 tiles; a 33-key band keeps the diagonal and its neighbours
    assert p.measured_speedup > 0 and ex.history[(16, 512)] is p
    assert "512 tokens" in str(p)
    assert ex.run_point(512, 128).tiles_speedup == 1.0  # a window wider than the document skips nothing


def test_widget_reruns_on_change():
    pytest.importorskip("ipywidgets")
    ex = WindowExplorer(H=2, D=32, timing=FAST)
    ui = ex.widget(w=64, L=256)
    half, length, status, _ = ui.children
    assert "256 tokens" in status.value and (64, 256) in ex.history
    length.value = 512
    assert (64, 512) in ex.history and "512 tokens" in status.value
    half.value = 16
    assert (16, 512) in ex.history
