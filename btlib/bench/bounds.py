"""The bound a benchmark row is held against: this machine's best measured GEMM rate in the row's precision.

A row faster than its bound means the bound is wrong (a cached rate measured while the machine was slower):
:func:`raise_bounds` measures the GEMMs again once per process and holds every row against the higher rate.
"""

from __future__ import annotations

from ..hardware import int8_gemm_gflops

__all__ = ["REMEASURED", "bound", "raise_bounds"]

REMEASURED: dict[str, float] = {}  # {"fp32" | "bf16": GFLOP/s} measured again in this process by raise_bounds


def raise_bounds(rows: list[dict], env: dict) -> None:
    """Where a row ran faster than its bound, the bound is what is wrong: the cached GEMM rate was measured while
    the machine was slower (a VM's neighbours, a busy moment; measured on this Xeon: the same GEMMs 20-30% apart
    between two days). Measure this machine's GEMMs again now (once per process, ~3 s, not written to the cache, so
    a busy moment cannot lower the GEMM choice), keep the higher of the two rates in ``env`` (shared by every row
    of the run) and hold every row against it again. A row still above 100% after that is left as it is: then
    the FLOP count or the bound's shapes are wrong, and the table shows it."""
    over = {r["bound_precision"] for r in rows if (r.get("of_bound") or 0) > 1.0 and r.get("bound_precision") in ("fp32", "bf16")}
    if not over or not env:
        return
    if not over <= set(REMEASURED):
        from ..hardware import measure_rates

        fresh = measure_rates()
        for prec in ("fp32", "bf16"):
            REMEASURED[prec] = max(REMEASURED.get(prec, 0.0), fresh.get(f"{prec}_gflops") or 0.0)
    for prec in over:
        env[f"{prec}_gflops"] = max(env.get(f"{prec}_gflops") or 0.0, REMEASURED[prec])
    for r in rows:
        if r.get("bound_gflops") and r.get("gflops"):
            r["bound_gflops"] = bound(r["bound_precision"], env)
            r["of_bound"] = r["gflops"] / r["bound_gflops"] if r["bound_gflops"] else None


def bound(precision: str, env: dict) -> float | None:
    """This machine's best measured GEMM GFLOP/s (GOP/s for int8) in ``precision``: the rate a provider can at best reach."""
    if precision == "int8":  # the fastest int8 GEMM measured here: torch._int_mm (btlib.quant's), or a path of btlib.gemm_measure
        paths = [r for by_M in (env.get("gemm") or {}).get("int8", {}).values() for r in by_M.values()]
        return max([int8_gemm_gflops(), *paths])
    return env.get(f"{precision}_gflops")  # the best GEMM rate of that precision over every path (btlib.hardware)
