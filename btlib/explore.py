"""An interactive padding explorer: move widgets, re-measure, watch speedup against padding.

Every point is one run of the registered ``encoder_padding`` benchmark (checked against
PyTorch's slow path before it is timed) with the chosen batch size, padded length, length
distribution and providers. Speedups are over PyTorch's dense fastpath, the "no sparsity"
baseline, and the plot draws them against the padding fraction p together with padding's FLOP ratio
1 / (1 - p): what skipping every padded token would give one engine if cost were all linear layers (a
faster engine can pass it: btlib's packed encoder against PyTorch's fastpath is two engines, so the
line is a reference, not a bound). Each point carries its spread as an error bar (bench.plot's band: a time lies
in [t, t (1 + noise)], its noise the calls' median over their fastest), so a small difference reads as what it is.

    explorer = PaddingExplorer(MINILM_L6)
    explorer.run_point(padding=0.5, B=8, T=128)     # what the widgets call; returns the rows
    explorer.widget()                               # sliders + progress bar + plot (Jupyter)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from .bench import core, encoder  # noqa: F401 - importing encoder declares encoder_padding
from .bench.report import _band, speedups
from .lengths import batch_lengths, padding_stats
from .models import EncoderConfig

__all__ = ["PaddingExplorer"]

BASELINE = "fastpath"
CHOICES = ("slow", "fastpath_nested", "btlib_packed", "btlib_packed_bf16", "ideal")
LABELS = {"ideal": "ideal (dense, real tokens only)"}  # so the legend tells the measured ideal from 1/(1-p)


@dataclass
class PaddingExplorer:
    """Runs small encoder benchmarks on demand and keeps the points measured per setting."""

    config: EncoderConfig
    timing: dict = field(default_factory=lambda: {"warmup": 1, "min_runs": 3, "max_runs": 5, "min_time_s": 0.0})
    history: dict = field(default_factory=dict)  # (B, T, distribution) -> {padding: {provider: speedup}}
    bands: dict = field(default_factory=dict)  # same keys -> {padding: {provider: (low, high)}}, multiples of the speedup
    last: str = ""

    def run_point(self, padding: float, B: int, T: int, distribution: str = "uniform",
                  providers: Sequence[str] = ("fastpath_nested", "btlib_packed", "ideal"),
                  progress: Callable[[str], None] | None = None) -> list[dict]:
        """Measure one batch; returns the benchmark rows (dense fastpath first, then ``providers``)."""
        bench = core.BENCHMARKS["encoder_padding"]
        params = {"config": self.config, "B": B, "T": T, "distribution": distribution}
        lengths = batch_lengths({**params, "padding": padding})
        p_real = round(padding_stats(lengths, T).padding_fraction, 3)
        rows = core.run(bench, quick=False, params=params, x_vals=[padding], providers=[BASELINE, *providers],
                        progress=progress, save=False, **self.timing)
        sp = speedups(rows, BASELINE)
        point = {r["provider"]: sp[(r["benchmark"], r["provider"], r["x"])] for r in rows
                 if (r["benchmark"], r["provider"], r["x"]) in sp}
        self.history.setdefault((B, T, distribution), {})[p_real] = point
        base = next((r for r in rows if r["provider"] == BASELINE and r["status"] == "ok"), None)
        self.bands.setdefault((B, T, distribution), {})[p_real] = {
            r["provider"]: _band(r, "median_ms", base) for r in rows
            if r["provider"] in point and r["provider"] != BASELINE and base is not None}
        best = max((k for k in point if k != BASELINE), key=point.get, default=BASELINE)
        self.last = (f"B={B}, T={T}, {distribution}: {p_real:.0%} padding; best {best} "
                     f"{point.get(best, 1.0):.2f}x over the dense fastpath (FLOP ratio 1/(1-p) {1 / (1 - p_real):.2f}x)")
        return rows

    def plot(self, B: int, T: int, distribution: str = "uniform", ax=None):
        """Speedup over the dense fastpath against padding, for every point measured at this setting."""
        import matplotlib.pyplot as plt

        from .diagrams import method_style  # one colour per method, as in every plot of the workbook

        if ax is None:
            _, ax = plt.subplots(figsize=(6.4, 4))
        points = sorted(self.history.get((B, T, distribution), {}).items())
        bands = self.bands.get((B, T, distribution), {})
        for prov in dict.fromkeys(k for _, pt in points for k in pt if k != BASELINE):
            xs = [p for p, pt in points if prov in pt]
            ys = [pt[prov] for p, pt in points if prov in pt]
            lo, hi = zip(*(bands.get(p, {}).get(prov, (1.0, 1.0)) for p in xs))  # one run: its calls' spread
            line, = ax.plot(xs, ys, label=LABELS.get(prov, prov), **method_style(prov))
            ax.errorbar(xs, ys, yerr=[[y - y * a for y, a in zip(ys, lo)], [y * b - y for y, b in zip(ys, hi)]], fmt="none",
                        ecolor=line.get_color(), elinewidth=1.2, capsize=3, alpha=0.7)
        grid = [i / 100 for i in range(0, 91)]
        ax.plot(grid, [1 / (1 - p) for p in grid], color="0.55", ls="--", lw=1, label="FLOP ratio 1/(1-p)")  # grey: apart from the measured ideal
        ax.axhline(1, color="0.5", lw=0.8)
        ax.set_xlim(0, 0.92)
        top = [v * bands.get(p, {}).get(k, (1.0, 1.0))[1] for p, pt in points for k, v in pt.items()]
        ax.set_ylim(0, max([4.0] + top) * 1.1)
        ax.set_xlabel("padding fraction p")
        ax.set_ylabel("speedup over PyTorch's dense fastpath")
        c = self.config
        ax.set_title(f"encoder {c.num_layers}x(d {c.d_model}, ff {c.dim_feedforward}), B={B}, T={T}, {distribution}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
        return ax

    def widget(self, padding: float = 0.5, B: int = 8, T: int = 128):
        """ipywidgets UI: sliders for padding, batch size and length, distribution, providers; reruns on change."""
        import ipywidgets as w
        import matplotlib.pyplot as plt
        from IPython.display import display

        style = {"description_width": "110px"}
        wide = w.Layout(width="400px")  # the default 300px leaves the track under 100px beside a 110px description
        pad = w.FloatSlider(value=padding, min=0.0, max=0.85, step=0.05, description="padding", continuous_update=False,
                            style=style, layout=wide)
        batch = w.IntSlider(value=B, min=2, max=64, description="batch size", continuous_update=False, style=style, layout=wide)
        length = w.SelectionSlider(options=[32, 64, 128, 256, 512], value=T, description="max length", continuous_update=False,
                                   style=style, layout=wide)
        dist = w.ToggleButtons(options=["uniform", "zipf"], description="lengths", style={**style, "button_width": "80px"})
        dist.add_class("widget-inline-hbox")  # ipywidgets 8 puts a ToggleButtons' description above the buttons otherwise
        provs = w.SelectMultiple(options=CHOICES, value=("fastpath_nested", "btlib_packed", "ideal"), rows=5,
                                 description="providers", style=style)
        bar = w.IntProgress(min=0, max=1, description="measuring", style=style)
        status = w.Label()
        out = w.Output()

        def rerun(_=None):
            bar.max, bar.value = len(provs.value) + 1, 0
            pad.disabled = dist.value == "zipf"  # Zipf lengths bring their own padding

            def step(line: str) -> None:
                bar.value += 1
                status.value = line

            self.run_point(pad.value, batch.value, length.value, dist.value, provs.value, progress=step)
            status.value = self.last
            with out:
                out.clear_output(wait=True)
                fig, ax = plt.subplots(figsize=(6.4, 4))
                self.plot(batch.value, length.value, dist.value, ax=ax)
                plt.show()

        for control in (pad, batch, length, dist, provs):
            control.observe(rerun, names="value")
        ui = w.VBox([w.HBox([w.VBox([pad, batch, length]), w.VBox([dist, provs])]), w.HBox([bar, status]), out])
        display(ui)
        rerun()
        return ui
