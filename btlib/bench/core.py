"""The benchmark harness: benchmarks declared as data, one runner that checks before it times.

A :class:`Benchmark` names an x axis, the providers to compare, how to build inputs for one
point, the reference output and the FLOP/byte counts. :func:`run` then, for each x value:

1. builds the inputs and the reference output once;
2. for each provider: skips it with the reason if it cannot run here; runs it once and
   compares with the reference (a provider that disagrees is reported and *not* timed);
3. warms up, times repeated calls (CUDA events on a GPU, perf_counter on a CPU) and records
   median / min / max in ms, GFLOP/s and GB/s from the declared counts;
4. returns rows (and writes them as JSON lines) with the machine described in each row.

:func:`run_rounds` repeats a run and keeps each point's best median with every round's median: on a
shared machine that drops the rounds a burst of someone else's work landed on, and measures the noise.

Ratios between providers are only meaningful within one run: same process, same threads,
same inputs, interleaved in time.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pkgutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

import torch

from ..device import describe_machine  # one source for the machine: btlib.device / btlib.hardware
from ..quick import quick_mode
from .memory import peak_memory
from . import bounds
from .timing import NOISE_LIMIT, protocol, time_fn
from .verdict import noise

__all__ = ["Provider", "Benchmark", "run", "run_rounds", "describe_machine", "quick_mode", "results_dir", "time_fn", "BENCHMARKS", "declare",
           "load_all"]


def results_dir() -> Path | None:
    """Where benchmark rows are saved (BTLIB_RESULTS_DIR), or None to save nothing."""
    d = os.environ.get("BTLIB_RESULTS_DIR")
    return Path(d) if d else None


@dataclass(frozen=True)
class Provider:
    """One contender. fn(inputs) -> output; available() -> None, or why it cannot run here.

    checked=False marks a yardstick that computes something else on purpose (e.g. the "ideal"
    run on a batch without padding); it is timed but not compared with the reference.
    tol overrides the benchmark's tolerance for this provider (e.g. a bf16 provider).
    isolated=True checks and times it in a worker process of its own (spawned once per run, same thread
    count), for an engine that changes torch's behaviour in the process it runs in: after CTranslate2's
    first call, torch's small parallel ops in that process ran up to ~15x slower for the rest of it
    (a 13 x 384 layer_norm 4.8 -> 70 us; one query's encode 5.0 -> 9.5 ms, on a 2-core Xeon).
    precision: whose measured matmul rate bounds it ("fp32", "bf16" or "int8"): a row's ``of_bound``
    is its useful GFLOP/s over that rate (btlib.hardware.machine(); int8: btlib.hardware.int8_gemm_gflops()).
    context(inputs) -> a context manager entered around this provider's check, metrics and timing at each x,
    left even when they raise: something that must outlive one call and be shut down after (a server process
    the provider talks to, a Ray cluster). Its value reaches fn and the benchmark's metrics as ``inputs["context"]``.
    """

    name: str
    fn: Callable[[Any], Any]
    available: Callable[[], str | None] = lambda: None
    label: str | None = None
    checked: bool = True
    tol: float | None = None
    precision: str = "fp32"
    isolated: bool = False
    context: Callable[[Any], ContextManager[Any]] | None = None


@dataclass(frozen=True)
class Benchmark:
    """A benchmark as data.

    make_inputs(params) -> dict of named inputs, where params = {**params, **quick params if
    quick, x_name: x} (the first tensor in it tells the device, hence CPU or CUDA timing).
    reference(inputs) -> the output every provider must match; error(out, ref, inputs) -> float
    must be <= tol. flops(params) and bytes(params) give the work per call (None: not reported).
    baseline: the provider that speedups are stated against.
    metrics(out, ref, inputs) -> {name: float}: more accuracy figures stored in each checked row
    (e.g. min_cos, the lowest cosine similarity of an embedding with its reference).
    summary(rows) -> str: another view of the rows that ``python -m btlib.bench run`` prints after the table
    (e.g. a pivot of engines x cells).
    memory: each checked provider's row also gets ``peak_mib``, the peak tensor memory of one more call
    (:func:`btlib.bench.peak_memory`: the profiler's replay on a CPU, the allocator's peak on CUDA), measured
    after its check and before its timing.
    """

    name: str
    description: str
    x_name: str
    x_vals: Sequence[Any]
    providers: Callable[[], Sequence[Provider]]
    make_inputs: Callable[[dict], dict]
    reference: Callable[[Any], Any]
    error: Callable[[Any, Any, Any], float]
    tol: float
    params: dict = field(default_factory=dict)
    quick: dict = field(default_factory=dict)
    flops: Callable[[dict], float] | None = None
    bytes: Callable[[dict], float] | None = None
    baseline: str | None = None
    metrics: Callable[[Any, Any, Any], dict] | None = None
    summary: Callable[[list[dict]], str] | None = None
    memory: bool = False


BENCHMARKS: dict[str, Benchmark] = {}


def declare(bench: Benchmark) -> Benchmark:
    """Register a benchmark under its name (for ``python -m btlib.bench``)."""
    BENCHMARKS[bench.name] = bench
    return bench


_HARNESS = {"core", "timing", "bounds", "report", "memory", "verdict", "describe", "__main__"}  # the modules of btlib.bench that declare nothing


def load_all() -> dict[str, Benchmark]:
    """Import every benchmark declaration module in btlib.bench; returns name -> Benchmark."""
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name not in _HARNESS:
            importlib.import_module(f"{__package__}.{info.name}")
    return BENCHMARKS


def _device_of(inputs: dict) -> str:
    return next((v.device.type for v in inputs.values() if isinstance(v, torch.Tensor)), "cpu")


def run(bench: Benchmark, *, quick: bool | None = None, threads: int | None = None, json_path: str | Path | None = None,
        providers: Sequence[str] | None = None, x_vals: Sequence[Any] | None = None, params: dict | None = None,
        progress: Callable[[str], None] | None = None, save: bool = True, first: int = 0, **timing: Any) -> list[dict]:
    """Check, then time every provider of ``bench`` at every x; return the rows.

    quick: small sizes (defaults to BTLIB_QUICK). threads: torch.set_num_threads for the run.
    json_path: write the rows there as JSON lines; by default (``save=True``) they go to
    ``$BTLIB_RESULTS_DIR/<name>.jsonl`` when that variable is set. providers / x_vals / params
    narrow or override the declaration. first: at each x the providers run in declared order
    rotated to start at this index (``run_rounds`` moves it on each round). timing: passed to :func:`time_fn`.
    """
    quick = quick_mode() if quick is None else quick
    p = {**bench.params, **(bench.quick if quick else {}), **(params or {})}
    xs = list(x_vals if x_vals is not None else p.pop("x_vals", bench.x_vals))
    p.pop("x_vals", None)
    timing = protocol(quick).timing(**timing)  # the one protocol (btlib.bench.timing); a warm-up call always
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    rows: list[dict] = []
    workers: dict[str, Any] = {}  # isolated provider -> its worker process
    try:
        env = describe_machine()
        for prec, rate in bounds.REMEASURED.items():  # a bound measured again in this process (see bounds.raise_bounds)
            env[f"{prec}_gflops"] = max(env.get(f"{prec}_gflops") or 0.0, rate)
        provs = [pr for pr in bench.providers() if providers is None or pr.name in providers]
        provs = provs[first % len(provs):] + provs[:first % len(provs)] if provs else provs
        for x in xs:
            point = {**p, bench.x_name: x}
            inputs = bench.make_inputs(point)
            ref = bench.reference(inputs)
            device = _device_of(inputs)
            flops = bench.flops(point) if bench.flops else None
            nbytes = bench.bytes(point) if bench.bytes else None
            for pr in provs:
                if pr.isolated and pr.available() is None:  # a missing package is reported here, with no worker spawned
                    rows.append(_isolated_row(bench, pr, x, p, quick, workers, timing))
                    if progress:
                        progress(_progress_line(rows[-1]))
                    continue
                row: dict[str, Any] = {"benchmark": bench.name, "provider": pr.name, "x_name": bench.x_name, "x": x,
                                       "params": {k: v for k, v in point.items() if _jsonable(v)}}
                why = pr.available()
                with contextlib.ExitStack() as held:  # the provider's context: left after its timing, or when anything raises
                    pin = inputs
                    if why is None:
                        try:
                            if pr.context is not None:
                                pin = {**inputs, "context": held.enter_context(pr.context(inputs))}
                            out = pr.fn(pin)
                            err = bench.error(out, ref, pin) if pr.checked else 0.0
                            if pr.checked and bench.metrics:
                                row.update(bench.metrics(out, ref, pin))
                        except Exception as e:  # noqa: BLE001 - a provider that raises is reported, not fatal
                            why = f"raised {type(e).__name__}: {e}"
                            err = None
                    if why is not None:
                        row.update(status="skipped", reason=why)
                    elif not err <= (tol := bench.tol if pr.tol is None else pr.tol):
                        row.update(status="wrong", error=err, reason=f"error {err:.2e} > tol {tol:.0e}; not timed")
                    else:
                        if bench.memory:
                            row["peak_mib"] = peak_memory(lambda: pr.fn(pin), device) / 2**20
                        # the check call just ran (and the memory replay, if any): the first of the warm-up calls
                        times = time_fn(lambda: pr.fn(pin), device=device, warmed=1 + bench.memory, **timing)
                        med = statistics.median(times)
                        row.update(status="ok", error=err if pr.checked else None, median_ms=med, min_ms=min(times), max_ms=max(times),
                                   runs=len(times), gflops=None if flops is None else flops / med / 1e6,
                                   gbps=None if nbytes is None else nbytes / med / 1e6)
                        if row["gflops"] and device == "cpu":
                            row["bound_gflops"], row["bound_precision"] = bounds.bound(pr.precision, env), pr.precision
                            row["of_bound"] = row["gflops"] / row["bound_gflops"] if row["bound_gflops"] else None
                row["env"] = env
                rows.append(row)
                if progress:
                    progress(_progress_line(row))
    finally:
        for worker in workers.values():
            worker.shutdown()
        torch.set_num_threads(old_threads)
    bounds.raise_bounds(rows, env if rows else {})
    path = Path(json_path) if json_path else (results_dir() / f"{bench.name}.jsonl" if save and results_dir() else None)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _isolated_row(bench: Benchmark, pr: Provider, x: Any, params: dict, quick: bool, workers: dict, timing: dict) -> dict:
    """One (provider, x) row of ``bench`` checked and timed by :func:`run` in ``pr``'s own worker process (spawned
    on first use, kept for the rest of this run; the parent waits idle meanwhile)."""
    import concurrent.futures
    import multiprocessing

    if pr.name not in workers:
        workers[pr.name] = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    module = getattr(pr.fn, "__module__", None)  # where the benchmark is declared, if not in btlib.bench
    try:
        return workers[pr.name].submit(_run_one, bench.name, pr.name, x, params, quick, torch.get_num_threads(), timing,
                                       module).result()
    except Exception as e:  # noqa: BLE001 - the worker died or could not run it: reported as a row, like a raising provider
        workers.pop(pr.name).shutdown(wait=False, cancel_futures=True)  # a dead pool: the next x spawns a fresh worker
        return {"benchmark": bench.name, "provider": pr.name, "x_name": bench.x_name, "x": x,
                "params": {k: v for k, v in {**params, bench.x_name: x}.items() if _jsonable(v)}, "status": "skipped",
                "reason": f"its worker process failed: {type(e).__name__}: {e}", "env": describe_machine()}


def _run_one(name: str, provider: str, x: Any, params: dict, quick: bool, threads: int, timing: dict,
             module: str | None = None) -> dict:
    """In a worker process: the row of one declared benchmark's ``provider`` at ``x``, by :func:`run`."""
    declared = load_all().get(name)
    if declared is None and module:
        importlib.import_module(module)  # declares it
        declared = BENCHMARKS.get(name)
    if declared is None:
        raise LookupError(f"isolated providers run declared benchmarks only (btlib.bench.declare at a module's top "
                          f"level); {name!r} is not one")
    here = Benchmark(**{**declared.__dict__,
                        "providers": lambda: [_local(pr) for pr in declared.providers() if pr.name == provider]})
    return run(here, quick=quick, threads=threads, providers=[provider], x_vals=[x], params=params, save=False, **timing)[0]


def _local(pr: Provider) -> Provider:
    return Provider(**{**pr.__dict__, "isolated": False})


def run_rounds(bench: Benchmark, rounds: int | None = None, **kwargs) -> list[dict]:
    """:func:`btlib.bench.run` ``rounds`` times (default: the protocol's, btlib.bench.timing); per (provider, x) the
    row with the lowest median.

    Rounds interleave the providers in time (A B, then B A, ...: round k starts with the k-th
    provider, so none is always timed first after the inputs are built, or always last), and a
    burst of other work lands on one round of each provider rather than on all of one provider's
    repeats; the kept rows are still measured side by side. Each row records how many rounds it is
    the best of (``rounds``) and every round's median (``round_medians_ms``), whose spread
    :mod:`btlib.bench.verdict` calls noise. A point (x) where a row's noise is above NOISE_LIMIT is run again,
    every provider, ``retry_rounds`` more rounds with trials twice as long (more calls, more time); a row still
    above it is compared as "too noisy to compare here" (btlib.bench.verdict).
    """
    proto = protocol(kwargs.get("quick"))
    rounds = proto.rounds if rounds is None else rounds
    best: dict[tuple, dict] = {}
    medians: dict[tuple, list[float]] = {}

    def keep(rows: list[dict]) -> None:
        for row in rows:
            key, kept = (row["provider"], row["x"]), best.get((row["provider"], row["x"]))
            if row["status"] == "ok":
                medians.setdefault(key, []).append(row["median_ms"])
            faster = row["status"] == "ok" and (kept["status"] != "ok" or row["median_ms"] < kept["median_ms"]) if kept else True
            if faster:
                best[key] = row

    def noisy() -> list:
        xs = []
        for key, row in best.items():
            if row["status"] == "ok" and noise({**row, "round_medians_ms": medians.get(key, [])}) > NOISE_LIMIT and key[1] not in xs:
                xs.append(key[1])
        return xs

    for k in range(rounds):
        keep(run(bench, first=k, **kwargs))
    total = rounds
    if (again := noisy()) and proto.retry_rounds and rounds > 1:
        t = proto.timing(**{k: kwargs[k] for k in ("warmup", "min_runs", "max_runs", "min_time_s") if k in kwargs})
        longer = {**kwargs, "min_runs": 2 * t["min_runs"], "max_runs": 2 * t["max_runs"], "min_time_s": 2 * t["min_time_s"],
                  "x_vals": again}
        for k in range(proto.retry_rounds):
            keep(run(bench, first=rounds + k, **longer))
        total += proto.retry_rounds
    return [{**row, "rounds": total if row["x"] in (again or []) else rounds, "round_medians_ms": medians.get(key, [])}
            for key, row in best.items()]


def _jsonable(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool, type(None))) or (isinstance(v, (list, tuple)) and all(_jsonable(i) for i in v))


def _progress_line(row: dict) -> str:
    head = f"{row['benchmark']} {row['x_name']}={row['x']} {row['provider']}"
    if row["status"] == "ok":
        return f"{head}: {row['median_ms']:.3f} ms"
    return f"{head}: {row['status']} ({row['reason']})"
