"""Time every GEMM path of :mod:`btlib.gemm` at the encoder's own shapes, and pick the fastest per token count.

    shapes (K -> N): MiniLM's 384 -> 384, 384 -> 1536, 1536 -> 384 and BERT-base's 768 -> 768,
                     768 -> 3072, 3072 -> 768 (the attention projections and the feed-forward)
    token counts M:  12 (one short query), 128 (a few short texts), 1024 (a full batch)

One rate per (precision, path, M): the FLOPs of all six GEMMs (2 M K N each) over the sum of
each GEMM's best time across rounds, the paths interleaved inside a round so that a busy
neighbour slows them alike. Each precision is time-boxed: M grows only while the predicted time
of the next size fits, so an emulated bf16 (below 1 GFLOP/s on AVX2: ~0.2 s a round at M = 12)
stops at the first size instead of taking minutes. The pick for M between two measured sizes
is the winner at the nearer one (geometric midpoint); above the largest, the largest's winner.

int8: int_mm and onednn_int8 in GOP/s of integer multiply-adds, activation quantization not included (it is
the same pass for both); btlib.quant's Int8Linear takes the pick (btlib.gemm.choose_int8).

The paths come in as the ``gemm`` argument: btlib.gemm passes itself (through btlib.hardware.use_gemm),
so this module imports nothing of btlib and sits below both the paths it times and the machine record
(btlib.hardware) that caches what it measured. ``gemm`` needs linear(x, w, b, path=), path_available,
PATHS, INT8_PATHS, int8_matmul, onednn_int8_pack and onednn_int8_linear.
"""

from __future__ import annotations

import math
import time
from types import ModuleType
from typing import Callable

import torch
from torch import Tensor

__all__ = ["SHAPES", "TOKENS", "BUDGET_S", "INT8_MARGIN", "measure_paths", "picks"]

SHAPES = ((384, 384), (384, 1536), (1536, 384), (768, 768), (768, 3072), (3072, 768))  # (K, N)
TOKENS = (12, 128, 1024)
BUDGET_S = {"fp32": 1.5, "bf16": 1.0, "int8": 0.6}
INT8_MARGIN = 1.25  # oneDNN's int8 path replaces _int_mm for a weight shape where it measured >= 1.25x its rate
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_MAX_ROUNDS = 15


def _float_calls(gemm: ModuleType, path: str, dtype: torch.dtype, M: int, weights: list[tuple[Tensor, Tensor]],
                 g) -> list[Callable]:
    calls = []
    for w, b in weights:
        x = torch.randn(M, w.shape[1], generator=g).to(dtype)
        calls.append(lambda x=x, w=w, b=b: gemm.linear(x, w, b, path=path))
    return calls


def _int8_calls(gemm: ModuleType, path: str, M: int, weights: list[tuple[Tensor, Tensor]], g) -> list[Callable]:
    calls = []
    for w, b in weights:
        N, K = w.shape
        w8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
        if path == "int_mm":
            x8, w_t = torch.randint(-127, 128, (M, K), dtype=torch.int8, generator=g), w8.t().contiguous()
            calls.append(lambda x8=x8, w_t=w_t: gemm.int8_matmul(x8, w_t))
        else:
            qx = torch.randint(0, 256, (M, K), dtype=torch.uint8, generator=g)
            packed, scale = gemm.onednn_int8_pack(w8, (M, K)), torch.full((N,), 0.01)
            calls.append(lambda qx=qx, p=packed, s=scale, b=b: gemm.onednn_int8_linear(qx, 0.02, 128, p, s, b))
    return calls


def _setup(gemm: ModuleType, precision: str, path: str, M: int, weights, g) -> list[Callable] | None:
    """The six GEMMs of ``path`` at M tokens, each run once (warm-up, packing); None if the path fails here."""
    try:
        calls = _int8_calls(gemm, path, M, weights, g) if precision == "int8" else \
            _float_calls(gemm, path, _DTYPES[precision], M, weights, g)
        for call in calls:
            call()
    except (RuntimeError, TypeError, ValueError):  # a private op missing its ISA or changed its schema
        return None
    if precision != "int8" and gemm.path_available(path, _DTYPES[precision]) is not None:
        return None  # gemm.linear fell back to F.linear: the path does not run here
    return calls


def _paths(gemm: ModuleType, precision: str) -> tuple[str, ...]:
    paths = gemm.INT8_PATHS if precision == "int8" else gemm.PATHS
    return tuple(p for p in paths if gemm.path_available(p, _DTYPES.get(precision, torch.float32)) is None)


def measure_precision(gemm: ModuleType, precision: str, budget_s: float, tokens: tuple[int, ...] = TOKENS,
                      by_shape: dict | None = None) -> dict[str, dict[int, float]]:
    """{path: {M: GFLOP/s}} of ``gemm``'s paths (btlib.gemm) for one precision ("fp32", "bf16", "int8") within
    about ``budget_s`` seconds, M growing through ``tokens``. by_shape: a dict to fill with the same per weight
    shape, {(K, N): {path: {M: GFLOP/s}}} (the rates above sum the six shapes' times)."""
    g = torch.Generator().manual_seed(0)  # a local generator: the global RNG stays untouched
    weights = [(torch.randn(N, K, generator=g).to(_DTYPES.get(precision, torch.float32)), torch.randn(N, generator=g))
               for K, N in SHAPES]
    if precision in _DTYPES:
        weights = [(w, b.to(w.dtype)) for w, b in weights]
    rates: dict[str, dict[int, float]] = {}
    start, last_round = time.perf_counter(), 0.0
    with torch.no_grad():
        for i, M in enumerate(tokens):
            left = budget_s - (time.perf_counter() - start)
            if i and last_round * (M / tokens[i - 1]) * 3 > left:  # warm-up + 2 rounds at the next size would not fit
                break
            calls = {p: c for p in _paths(gemm, precision) if (c := _setup(gemm, precision, p, M, weights, g)) is not None}
            best = {p: [math.inf] * len(c) for p, c in calls.items()}
            t_M = time.perf_counter()
            for r in range(_MAX_ROUNDS):
                t_round = time.perf_counter()
                for p, cs in calls.items():
                    for j, call in enumerate(cs):
                        t0 = time.perf_counter()
                        call()
                        best[p][j] = min(best[p][j], time.perf_counter() - t0)
                last_round = time.perf_counter() - t_round
                spent = time.perf_counter() - t_M
                if r >= 1 and (spent > budget_s / len(tokens) or time.perf_counter() - start > budget_s):
                    break
            flops = sum(2 * M * K * N for K, N in SHAPES)
            for p, times in best.items():
                rates.setdefault(p, {})[M] = flops / sum(times) / 1e9
                if by_shape is not None:
                    for (K, N), t in zip(SHAPES, times):
                        by_shape.setdefault((K, N), {}).setdefault(p, {})[M] = 2 * M * K * N / t / 1e9
    return rates


def picks(rates: dict[str, dict[int, float]], incumbent: str | None = None, margin: float = 1.0) -> list[list]:
    """[[M_max, path], ...] from {path: {M: rate}}: the fastest path per measured M, switching at the
    geometric midpoint between measured sizes; the last entry's M_max is None (every larger M).
    incumbent, margin: another path replaces ``incumbent`` at an M only where it measured ``margin`` times its rate."""
    Ms = sorted({M for by_M in rates.values() for M in by_M})
    out: list[list] = []
    for i, M in enumerate(Ms):
        path = max((p for p in rates if M in rates[p]), key=lambda p: rates[p][M])
        if incumbent is not None and M in rates.get(incumbent, {}) and rates[path][M] < margin * rates[incumbent][M]:
            path = incumbent
        m_max = math.isqrt(M * Ms[i + 1]) if i + 1 < len(Ms) else None
        if out and out[-1][1] == path:
            out[-1][0] = m_max
        else:
            out.append([m_max, path])
    return out


def measure_paths(gemm: ModuleType, budget_s: dict[str, float] | None = None) -> dict:
    """Every path of ``gemm`` (btlib.gemm) timed, and the picks, as btlib.hardware caches them:

    {"gemm": {precision: {path: {str(M): GFLOP/s}}}, "gemm_pick": {"fp32" | "bf16" | "int8" | "int8 KxN": [[M_max, path], ...]},
     "fp32_gflops", "bf16_gflops": the best rate of one GEMM of that precision over every shape, path and M (the
     bound no run of these GEMMs beats),
     "fp32_n", "bf16_n": the largest M timed}. Takes about sum(budget_s.values()) seconds (~3 s).
    """
    budget_s = {**BUDGET_S, **(budget_s or {})}
    out: dict = {"gemm": {}, "gemm_pick": {}}
    for precision, budget in budget_s.items():
        shapes: dict = {}
        rates = measure_precision(gemm, precision, budget, by_shape=shapes)
        out["gemm"][precision] = {p: {str(M): r for M, r in by_M.items()} for p, by_M in rates.items()}
        if precision == "int8" and rates:
            out["gemm_pick"]["int8"] = picks(rates)
            # per shape too, oneDNN only where it is clearly faster: its int8 call costs ~25 us more than _int_mm's
            # (Xeon, 2 threads), which a one-shape timing of a few us at 12 tokens does not resolve from the noise
            for (K, N), by_path in shapes.items():
                out["gemm_pick"][f"int8 {K}x{N}"] = picks(by_path, incumbent="int_mm", margin=INT8_MARGIN)
        if precision in _DTYPES:
            out["gemm_pick"][precision] = picks(rates) if rates else [[None, "torch"]]
            # the bound: the fastest single GEMM measured (any shape, path, M), not the six shapes' summed rate,
            # which is a harmonic mean of theirs: an encoder whose FLOPs sit in the faster shapes beats that one
            out[f"{precision}_gflops"] = max((r for by_path in shapes.values() for by_M in by_path.values()
                                              for r in by_M.values()), default=0.0)
            out[f"{precision}_n"] = max((M for by_M in rates.values() for M in by_M), default=0)
    return out
