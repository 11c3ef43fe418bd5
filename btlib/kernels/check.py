"""One correctness check for every registered kernel: its output against its own reference.

    r = check(get("cpu_flash_v3"), "cpu", torch.bfloat16)
    r.ok, r.error, r.tolerance, r.shapes      # worst case over every shape, causal off and on

The cases are the ones kernels get wrong: a single token (T = 1), a length that is no tile
multiple (97), a sequence of length 0 (every row of it fully padded), batch 1 and one head.
Padded kernels see (B, H, T, D) inputs with ``lengths``; varlen kernels see the same batches
packed, (total, H, D) + cu_seqlens. Besides the error, padded query rows must be exactly 0, the
output must keep q's shape and dtype and hold no NaN.

Kernels registered with ``window=True`` also run every case under each local window of
``WINDOWS``, causal off and on: (0, 0) (each row attends only itself), (3, 5) (lopsided, narrower
than a tile), (64, 64) (ModernBERT's, narrower than T = 97) and (200, 200) (wider than every
sequence: must equal global attention).

Kernels registered with ``bias=True`` also run every case under each position bias of ``BIASES``
(btlib.PositionBias), causal off and on: ALiBi with random slopes in [0.05, 1] (steeper than most
heads' slopes, so a sign or a |i - j| wrong shows) without a window, and a table with R = 8
(narrower than T = 97 and 40: the clamp at +-R is reached from both sides) of random values under
the run's first window (for a kernel with one): 4 runs a case, not a cross product, to keep the
interpreter's check short (tests/test_position_bias.py runs the cross product). Positions count
within each sequence, so the packed varlen cases check that the bias restarts at every sequence.

Tolerance (:meth:`Kernel.tolerance`): fp32/fp64 within ``kernel.tol`` (1e-5) of the reference's
scale; fp16/bf16 at most ``LOW_PRECISION_FACTOR`` x PyTorch's own SDPA error in the same dtype
on the same inputs, both measured against the fp32 reference.

``fn`` runs something other than ``kernel.fn`` with its signature: a GPU kernel's CPU stand-in
(``kernel.cpu_run.fn``, e.g. the CUDA emulator), so the same check covers it without a GPU.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from ..padding import lengths_to_cu_seqlens
from ..position_bias import PositionBias
from ..precision import SlowPrecisionWarning
from .registry import EXACT, Kernel, get, relative_error

__all__ = ["check", "CheckResult", "PADDED_CASES", "VARLEN_CASES", "WINDOWS", "BIASES", "make_bias"]

# (B, H, T, D, lengths): batch 1 with one token; odd lengths; a sequence of length 0. Head dims
# 16, 64 and 80 reach every head-dim bucket of the GPU kernels (32, 64, 128), 24 and 80 with masked columns.
PADDED_CASES = [
    (1, 1, 1, 16, None),
    (2, 2, 97, 64, [97, 40]),
    (3, 2, 33, 80, [0, 33, 5]),
]
# (lengths, H, D): the same situations, packed.
VARLEN_CASES = [
    ([1], 1, 16),
    ([97, 3, 0, 40], 2, 64),
    ([5, 5], 2, 24),
]
# (left, right) local windows run for kernels that support one, besides global attention (None).
WINDOWS = [(0, 0), (3, 5), (64, 64), (200, 200)]
# position biases run for kernels that take one (make_bias builds each for a case's H)
BIASES = ("alibi", "table")
TABLE_R = 8


def make_bias(kind: str, H: int, device: str | torch.device = "cpu", g: torch.Generator | None = None) -> PositionBias:
    """A random position bias of ``kind`` ("alibi": slopes in [0.05, 1]; "table": R = TABLE_R, values N(0, 1)) for H heads."""
    if kind == "alibi":
        return PositionBias.alibi(0.05 + 0.95 * torch.rand(H, generator=g)).to(device)
    return PositionBias.table(torch.randn(H, 2 * TABLE_R + 1, generator=g), TABLE_R).to(device)


@dataclass
class CheckResult:
    """The worst case of one kernel's check: error and its tolerance, and what was run."""

    kernel: str
    device: str
    dtype: torch.dtype
    error: float  # relative error (max |out - ref| / max |ref|) of the case nearest its tolerance
    tolerance: float
    ok: bool
    shapes: list[str] = field(default_factory=list)  # one per case run, e.g. "(2, 2, 97, 32) lengths [97, 40] causal window (3, 5)"
    failures: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        verdict = "ok" if self.ok else "FAILED: " + "; ".join(self.failures)
        return (f"{self.kernel} on {self.device} {dt}: error {self.error:.1e} <= {self.tolerance:.1e} over "
                f"{len(self.shapes)} cases: {verdict}")


def _inputs(case, layout: str, device: str, dtype: torch.dtype, g: torch.Generator):
    """(q, k, v, extra kwargs or args) for one case: padded (B, H, T, D) or packed (total, H, D)."""
    if layout == "padded":
        B, H, T, D, lengths = case
        q, k, v = torch.randn(3, B, H, T, D, generator=g).to(device=device, dtype=dtype)
        L = None if lengths is None else torch.tensor(lengths, device=device)
        return (q, k, v), {"lengths": L}, f"{(B, H, T, D)} lengths {lengths}"
    lengths, H, D = case
    cu_seqlens, max_seqlen = lengths_to_cu_seqlens(torch.tensor(lengths, device=device))
    q, k, v = torch.randn(3, sum(lengths), H, D, generator=g).to(device=device, dtype=dtype)
    return (q, k, v, cu_seqlens, max_seqlen), {}, f"{(sum(lengths), H, D)} lengths {lengths}"


def check(kernel: Kernel, device: str = "cpu", dtype: torch.dtype = torch.float32, *,
          causal: tuple[bool, ...] = (False, True), windows: tuple | list | None = None,
          biases: tuple | list | None = None, fn: Callable[..., Tensor] | None = None, seed: int = 0) -> CheckResult:
    """Run ``kernel`` (or ``fn`` with its signature) on every case against ``kernel.reference``.

    causal: the settings to run (True is skipped for a kernel without a causal mask).
    windows: the local windows to run besides global attention; None: :data:`WINDOWS` for a kernel
        registered with ``window=True``, none otherwise (``fn`` then gets no ``window=``).
    biases: the position-bias kinds to run besides none; None: :data:`BIASES` for a kernel registered
        with ``bias=True``, none otherwise (``fn`` then gets no ``bias=``). "alibi" runs without a window,
        "table" with ``windows[0]`` (if any).
    Returns the case whose error is largest relative to its tolerance; ``ok`` covers every case.
    """
    run = kernel.fn if fn is None else fn
    # A CPU generator, then .to(device): the same numbers on every device, so a failure reproduces on a CPU.
    g = torch.Generator().manual_seed(seed)
    gb = torch.Generator().manual_seed(seed + 1)  # the biases' own stream: the cases' inputs stay those of every kernel
    sdpa = get("torch_sdpa" if kernel.layout == "padded" else "torch_sdpa_loop").fn
    if windows is None:
        windows = WINDOWS if kernel.window else []
    if biases is None:
        biases = BIASES if kernel.bias else ()
    worst, shapes, failures = (0.0, kernel.tol, -1.0), [], []
    for case in PADDED_CASES if kernel.layout == "padded" else VARLEN_CASES:
        args, kw, shape = _inputs(case, kernel.layout, device, dtype, g)
        H = args[0].shape[1]
        runs = [(w, c, None) for w in [None, *windows] for c in causal]
        runs += [(windows[0] if b == "table" and windows else None, c, make_bias(b, H, device, gb)) for b in biases for c in causal]
        for w, c, bias in runs:
            if c and not kernel.causal:
                continue
            wkw = {} if w is None else {"window": w}  # kernels without a window are called as before
            if bias is not None:
                wkw["bias"] = bias  # ... and so are those without a bias
            name = (f"{shape} {'causal' if c else 'full'}" + ("" if w is None else f" window {w}")
                    + ("" if bias is None else f" bias {bias.kind}"))
            shapes.append(name)
            with warnings.catch_warnings():  # a correctness check: whether bf16 is slow here is the benchmarks' business
                warnings.simplefilter("ignore", SlowPrecisionWarning)
                out = run(*args, **kw, causal=c, scale=None, **wkw)
            ref = kernel.reference(*args, **kw, causal=c, **wkw)  # fp32 for fp16/bf16 inputs
            sdpa_error = None if dtype in EXACT else relative_error(sdpa(*args, **kw, causal=c, scale=None, **wkw).float(), ref)
            tol = kernel.tolerance(dtype, sdpa_error)
            err = relative_error(out, ref)
            if out.shape != args[0].shape or out.dtype != dtype:
                failures.append(f"{name}: output {tuple(out.shape)} {out.dtype}, expected q's {tuple(args[0].shape)} {dtype}")
            if out.isnan().any():
                failures.append(f"{name}: NaN in the output")
            if err > tol:
                failures.append(f"{name}: error {err:.2e} > tolerance {tol:.2e}")
            L = kw.get("lengths")
            if L is not None and any(out[b, :, int(n):].abs().max() != 0 for b, n in enumerate(L.tolist()) if n < out.shape[2]):
                failures.append(f"{name}: padded query rows are not 0")
            if err / tol > worst[2]:
                worst = (err, tol, err / tol)
    return CheckResult(kernel.name, device, dtype, worst[0], worst[1], not failures, shapes, failures)
