"""An interactive window explorer (notebook 08): pick a window and a document length, see the tile
map, the predicted speedup of skipping the tiles outside the window, and the measured one.

    ex = WindowExplorer()
    ex.run_point(window=64, L=2048)     # one document: btlib's varlen kernel with and without the window
    ex.widget()                         # sliders + tile map + readout (Jupyter)

Predicted: the FLOP model, pairs without / with the window (about L / min(L, 2w + 1)), and the tile
model, alive 64 x 64 tiles without / with it (what a tile-skipping kernel computes: a partial tile
costs as much as a full one). Measured: median times, side by side in one process, after a check
against btlib.reference_attention.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from .blocks import draw_tile_map, tile_map, tile_stats
from .kernels import relative_error

__all__ = ["WindowExplorer", "WindowPoint"]


@dataclass(frozen=True)
class WindowPoint:
    """One (window, L) measurement: window (w, w), predicted speedups from pairs and tiles, measured speedup."""

    w: int
    L: int
    pairs_speedup: float
    tiles_speedup: float
    measured_speedup: float
    window_ms: float
    global_ms: float

    def __str__(self) -> str:
        return (f"window ({self.w}, {self.w}), one document of {self.L} tokens: predicted {self.pairs_speedup:.2f}x (FLOPs), "
                f"{self.tiles_speedup:.2f}x (64x64 tiles); measured {self.measured_speedup:.2f}x "
                f"({self.global_ms:.2f} ms -> {self.window_ms:.2f} ms)")


@dataclass
class WindowExplorer:
    """Measures btlib's varlen kernel with and without a (w, w) window on one document of L tokens."""

    H: int = 12
    D: int = 64
    backend: str = "cpu_flash_varlen"
    timing: dict = field(default_factory=lambda: {"warmup": 1, "min_runs": 3, "max_runs": 20, "min_time_s": 0.2})
    history: dict = field(default_factory=dict)  # (w, L) -> WindowPoint

    def run_point(self, w: int, L: int) -> WindowPoint:
        """Check, then time, window (w, w) against no window on one (L, H, D) fp32 document."""
        from .attention import varlen_attention
        from .padding import INT32_MAX, check_int

        w, L = check_int(w, "w"), check_int(L, "L", low=1, high=INT32_MAX)
        from .bench.core import time_fn
        from .reference import reference_varlen_attention

        g = torch.Generator().manual_seed(L)
        q, k, v = (torch.randn(L, self.H, self.D, generator=g) for _ in range(3))
        cu = torch.tensor([0, L], dtype=torch.int32)

        def call(window):
            return varlen_attention(q, k, v, cu, L, window=window, backend=self.backend)

        if L <= 1024:  # the reference holds H L^2 scores: checked where that stays small
            err = relative_error(call((w, w)), reference_varlen_attention(q, k, v, cu, L, window=(w, w)))
            if err > 1e-5:
                raise AssertionError(f"window ({w}, {w}), L={L}: error {err:.1e} against the reference; not timed")
        ms = {win: statistics.median(time_fn(lambda win=win: call(win), **self.timing)) for win in ((w, w), None)}
        full, local = tile_stats([L]), tile_stats([L], window=(w, w))
        point = WindowPoint(w, L, full.allowed_pairs / local.allowed_pairs, full.alive / local.alive,
                            ms[None] / ms[(w, w)], ms[(w, w)], ms[None])
        self.history[(w, L)] = point
        return point

    def widget(self, w: int = 64, L: int = 1024, lengths=(128, 256, 512, 1024, 2048, 4096),
               windows=(0, 16, 32, 64, 128, 256, 512)):
        """ipywidgets UI: window half-width and document length sliders; redraws the map and re-measures on change."""
        import ipywidgets as widgets
        import matplotlib.pyplot as plt
        from IPython.display import display

        style, wide = {"description_width": "140px"}, widgets.Layout(width="420px")
        half = widgets.SelectionSlider(options=list(windows), value=w, description="window half-width w",
                                       continuous_update=False, style=style, layout=wide)
        length = widgets.SelectionSlider(options=list(lengths), value=L, description="document length L",
                                         continuous_update=False, style=style, layout=wide)
        status = widgets.Label()
        out = widgets.Output()

        def rerun(_=None):
            point = self.run_point(half.value, length.value)
            status.value = str(point)
            with out:
                out.clear_output(wait=True)
                fig, ax = plt.subplots(figsize=(4, 4))
                draw_tile_map(tile_map(length.value, window=(half.value, half.value)), ax=ax,
                              title=f"L={length.value}, window ({half.value}, {half.value})")
                plt.show()

        for control in (half, length):
            control.observe(rerun, names="value")
        ui = widgets.VBox([half, length, status, out])
        display(ui)
        rerun()
        return ui
