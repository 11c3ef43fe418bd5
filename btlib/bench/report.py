"""Tables and plots of benchmark rows (as :func:`btlib.bench.run` returns or writes them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from .verdict import noise

__all__ = ["table", "plot", "load_rows", "speedups"]


def load_rows(paths: Iterable[str | Path]) -> list[dict]:
    """Rows from JSON-lines files, or from every *.jsonl file in a directory."""
    rows: list[dict] = []
    for p in map(Path, paths):
        files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
        for f in files:
            rows += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return rows


def speedups(rows: Sequence[dict], baseline: str) -> dict[tuple[str, str, object], float]:
    """(benchmark, provider, x) -> baseline median / provider median, for rows measured in one run."""
    base = {(r["benchmark"], r["x"]): r["median_ms"] for r in rows if r["provider"] == baseline and r["status"] == "ok"}
    return {(r["benchmark"], r["provider"], r["x"]): base[(r["benchmark"], r["x"])] / r["median_ms"]
            for r in rows if r["status"] == "ok" and (r["benchmark"], r["x"]) in base}


def table(rows: Sequence[dict], baseline: str | None = None) -> str:
    """A fixed-width text table: one line per (benchmark, x, provider), with the speedup over ``baseline``.

    Columns that some rows carry are added when present: "of bound" (useful GFLOP/s over this
    machine's measured matmul rate in the provider's precision) and the benchmark's metrics (e.g. min cos).
    """
    sp = speedups(rows, baseline) if baseline else {}
    bound = any(r.get("of_bound") for r in rows)
    std = {"benchmark", "provider", "x_name", "x", "params", "status", "reason", "error", "median_ms", "min_ms", "max_ms",
           "runs", "gflops", "gbps", "bound_gflops", "of_bound", "env", "rounds"}
    extra = list(dict.fromkeys(k for r in rows for k, v in r.items() if k not in std and isinstance(v, float)))
    head = ["benchmark", "x", "provider", "median ms", "min ms", "GFLOP/s", *(["of bound"] if bound else []),
            *[k.replace("_", " ") for k in extra], f"vs {baseline}" if baseline else "", "status"]
    lines = []
    for r in rows:
        ok = r["status"] == "ok"
        s = sp.get((r["benchmark"], r["provider"], r["x"]))
        lines.append([
            r["benchmark"], f"{r['x_name']}={r['x']}", r["provider"],
            f"{r['median_ms']:.3f}" if ok else "-", f"{r['min_ms']:.3f}" if ok else "-",
            f"{r['gflops']:.1f}" if ok and r.get("gflops") else "-",
            *([f"{r['of_bound']:.0%}" if ok and r.get("of_bound") else "-"] if bound else []),
            *[f"{r[k]:.4f}" if ok and isinstance(r.get(k), float) else "-" for k in extra],
            f"{s:.2f}x" if s else "", "ok" if ok else f"{r['status']}: {r.get('reason', '')}",
        ])
    widths = [max(len(str(c)) for c in col) for col in zip(head, *lines)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*head), fmt.format(*["-" * w for w in widths])]
    out += [fmt.format(*line) for line in lines]
    return "\n".join(line.rstrip() for line in out)


def _band(row: dict, metric: str, base: dict | None) -> tuple[float, float]:
    """(low, high) as multiples of the plotted value: the row's time lies in [t, t (1 + noise)] (other work only adds
    time), a rate in [r / (1 + noise), r], a speedup over ``base`` in [1 / (1 + n_row), 1 + n_base]."""
    n = noise(row)
    if base is not None:
        return 1.0 / (1.0 + n), 1.0 + noise(base)
    if metric in ("median_ms", "min_ms"):
        return 1.0, 1.0 + n
    return 1.0 / (1.0 + n), 1.0


def plot(rows: Sequence[dict], *, metric: str = "median_ms", baseline: str | dict[str, str] | None = None, ax=None,
         title: str | None = None, logy: bool = False, ideal: dict | None = None, ideal_label: str = "ideal",
         ylabel: str | None = None, legend: dict | None = None):
    """Plot one benchmark's rows: x axis against ``metric`` (or speedup over ``baseline``) per provider.

    baseline: a provider every other is divided by, or {provider: its own baseline} to plot only those providers,
    each against its own (e.g. ``{"fastpath_nested": "ideal", "btlib_packed": "ideal_packed"}``: the share of
    its run without padding), labelled "provider / baseline".
    ideal: optional {x: value} drawn as a dashed line labelled ``ideal_label`` (e.g. 1 / (1 - p)).
    ylabel: overrides the y label; legend: keyword arguments of ``ax.legend`` (e.g. fontsize, loc).
    Every point carries an error bar: the row's spread (btlib.bench.verdict.noise): a time lies in [t, t (1 + s)],
    so a rate or a speedup over ``baseline`` spans what the two rows' intervals allow.
    Each provider takes its colour and line style from btlib.diagrams.method_style: the same in every plot.
    Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt

    from ..diagrams import method_style

    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 4))
    ok = [r for r in rows if r["status"] == "ok"]
    own = baseline if isinstance(baseline, dict) else None  # provider -> its own baseline
    providers = list(own) if own else list(dict.fromkeys(r["provider"] for r in ok))
    for prov in providers:
        against = own[prov] if own else baseline
        base = {(r["benchmark"], r["x"]): r for r in ok if r["provider"] == against} if against else {}
        pts = [(r["x"], base[(r["benchmark"], r["x"])]["median_ms"] / r["median_ms"] if against else r[metric],
                _band(r, metric, base.get((r["benchmark"], r["x"]))))
               for r in ok if r["provider"] == prov and (not against or (r["benchmark"], r["x"]) in base)]
        if pts:
            xs, ys, bands = zip(*pts)
            line, = ax.plot(xs, ys, label=f"{prov} / {against}" if own else prov, **method_style(prov))
            lo = [y * b[0] for y, b in zip(ys, bands)]  # the spread as an error bar: where the time may lie
            hi = [y * b[1] for y, b in zip(ys, bands)]
            ax.errorbar(xs, ys, yerr=[[y - a for y, a in zip(ys, lo)], [b - y for y, b in zip(ys, hi)]], fmt="none",
                        ecolor=line.get_color(), elinewidth=1.2, capsize=3, alpha=0.7)
    if ideal:
        ax.plot(list(ideal), list(ideal.values()), color="0.55", ls="--", lw=1, label=ideal_label)  # apart from a measured "ideal" row (black)
    if ok:
        ax.set_xlabel(ok[0]["x_name"])
    ax.set_ylabel(ylabel or ("time of the baseline / time" if own else f"speedup over {baseline}" if baseline else
                             {"median_ms": "median time (ms)", "gflops": "GFLOP/s"}.get(metric, metric)))
    if logy:
        ax.set_yscale("log")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(**(legend or {}))
    return ax
