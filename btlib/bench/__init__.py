"""Benchmarks as data and one runner: ``python -m btlib.bench list | run NAME | summary``.

Every module of this package other than the harness (core, report, memory, verdict, __main__) declares
benchmarks; :func:`load_all` imports them all, so a new module is picked up by the CLI.
"""

import importlib
import pkgutil

from .core import BENCHMARKS, Benchmark, Provider, declare, describe_machine, quick_mode, results_dir, run, run_rounds, time_fn
from .memory import peak_memory
from .report import load_rows, plot, speedups, table
from .verdict import Comparison, compare, find_row, noise, share_of_ideal

_HARNESS = {"core", "report", "memory", "verdict", "__main__"}


def load_all() -> dict[str, Benchmark]:
    """Import every benchmark declaration module in btlib.bench; returns name -> Benchmark."""
    for info in pkgutil.iter_modules(__path__):
        if info.name not in _HARNESS:
            importlib.import_module(f"{__name__}.{info.name}")
    return BENCHMARKS


__all__ = ["BENCHMARKS", "Benchmark", "Provider", "declare", "describe_machine", "quick_mode", "results_dir", "run", "run_rounds",
           "time_fn", "Comparison", "compare", "find_row", "noise", "share_of_ideal", "peak_memory", "load_rows", "plot", "speedups", "table", "load_all"]
