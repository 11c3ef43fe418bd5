"""Benchmarks as data and one runner: ``python -m btlib.bench list | run NAME | summary``.

Every module of this package other than the harness (core, timing, bounds, report, memory, verdict, describe, __main__)
declares benchmarks; :func:`load_all` imports them all, so a new module is picked up by the CLI. A C++ kernel family's
own benchmark sits in its folder, beside its op and source (btlib/kernels/cpu/<family>/bench.py), imported below.
"""

from .core import (BENCHMARKS, Benchmark, Provider, declare, describe_machine, load_all, quick_mode, results_dir, run, run_rounds,
                   time_fn)
from .describe import describe
from .memory import peak_memory
from ..fold import Folded, fold
from .timing import NOISE_LIMIT, Protocol, protocol, protocol_note
from .report import load_rows, plot, speedups, table
from .verdict import Comparison, compare, find_row, noise, share_of_ideal
from ..kernels.cpu.flash import bench as _flash_bench  # noqa: F401 - declares attention_dense_bf16
from ..kernels.cpu.teaching import bench as _teaching_bench  # noqa: F401 - declares cpu_attention_versions

__all__ = ["BENCHMARKS", "Benchmark", "Provider", "declare", "describe_machine", "quick_mode", "results_dir", "run", "run_rounds",
           "time_fn", "describe", "protocol", "protocol_note", "Protocol", "Folded", "fold", "NOISE_LIMIT", "Comparison", "compare", "find_row", "noise", "share_of_ideal", "peak_memory", "load_rows", "plot", "speedups", "table", "load_all"]
