"""Benchmarks as data and one runner: ``python -m btlib.bench list | run NAME | summary``.

Declarations live in btlib.bench.attention and btlib.bench.encoder (and in the modules of
later kernels); :func:`load_all` imports them.
"""

import importlib

from .core import BENCHMARKS, Benchmark, Provider, declare, describe_machine, quick_mode, results_dir, run, time_fn
from .report import load_rows, plot, speedups, table

SUITES = ("btlib.bench.attention", "btlib.bench.encoder")


def load_all() -> dict[str, Benchmark]:
    """Import every benchmark declaration; returns name -> Benchmark."""
    for mod in SUITES:
        importlib.import_module(mod)
    return BENCHMARKS


__all__ = ["BENCHMARKS", "Benchmark", "Provider", "declare", "describe_machine", "quick_mode", "results_dir", "run",
           "time_fn", "load_rows", "plot", "speedups", "table", "load_all", "SUITES"]
