"""Every GEMM path btlib takes on a CPU, behind one function, with ``F.linear`` as the fallback.

    y = act(x W^T + b) (+ residual)      x (M, K), W (N, K) -> y (M, N), M = tokens in the batch

Paths for fp32 and bf16 (what :func:`linear` runs):

    torch    F.linear: MKL sgemm on x86 (OpenBLAS or another BLAS as torch was built); bias added
             by the GEMM, activation and residual as separate passes
    onednn   oneDNN with W reordered once into its blocked layout (cached per weight and dtype) and
             bias, exact GELU / ReLU or a residual add fused into the GEMM's epilogue:
             torch.ops.mkldnn._reorder_linear_weight + _linear_pointwise, the ops inductor's
             freezing pass emits
    btlib    fp32 only: btlib's own GEMM (kernels/cpu/gemm.cpp), W packed once into column panels of two
             vectors; each thread streams whole panels while a block of up to 14 rows (6 on AVX2)
             accumulates in registers; bias, exact GELU / ReLU and the residual in its epilogue.
             Built for few rows (one query: ~13 tokens), where a GEMM is bound
             by reading W and the libraries' blocking for large M does not pay back

int8 paths (btlib.quant's Int8Linear runs them; :func:`choose_int8` picks one per M):

    int_mm       torch._int_mm: int8 x int8 -> int32, scales applied after
    onednn_int8  torch.ops.onednn.qlinear_prepack + qlinear_pointwise: uint8 activations (int8 + 128 with
                 zero point 128: the same integers), int8 weights pre-packed, fp32 out. Called with unit scales,
                 it returns the exact int32 sums as floats, so btlib.quant applies its per-token scales after
                 either path alike, and the two paths give the same bits.

Which path is fastest is a fact about the CPU and the token count M, not about the library: oneDNN's
pre-packed weights beat MKL's F.linear by a wide margin on some AMD CPUs and lose to it at large M on others,
and btlib's own GEMM wins only at a few rows. So :mod:`btlib.gemm_measure` times every path here at the
encoder's shapes (``btlib.hardware.machine().gemm`` holds this machine's rates), and :func:`linear`
takes the fastest for the precision and M (:func:`plan`). ``BTLIB_GEMM=torch`` or ``onednn``
forces a path (for comparisons), ``with forcing(path):`` does so for a block, ``path=`` for one call.

The paths themselves, and the cache of packed weights, are in :mod:`btlib.gemm_paths`; every private torch op
they use is called through btlib._torch_private. A path
whose op is missing, refuses the input (oneDNN bf16 needs AVX-512 or AVX-NE-CONVERT) or raises
falls back to F.linear, and stays off for that dtype in this process. Autograd and non-CPU
tensors always take F.linear (the oneDNN ops have no derivative here).

torch.compile: :func:`linear` and :func:`module_linear` trace (fullgraph=True) when no ``path=`` is given:
under dynamo they take the torch path's aten ops (addmm, _addmm_activation, linear), which inductor
lowers and fuses itself; the path choice, :func:`planned`, :func:`forcing` and :func:`pack` (contextvars,
os.environ, an id/weakref cache) are eager-only. An explicit ``path="onednn"`` does not trace. The int8
helpers here are eager-only too.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
import platform
import sys
from typing import Iterator

import torch
from torch import Tensor
from torch.compiler import is_compiling as _is_compiling  # dynamo reads it as True while tracing

from . import _torch_private as tp, gemm_measure, hardware
from .gemm_paths import (_btlib, _gemm_cpp, _onednn, _packs, _torch, int8_matmul, onednn_int8_linear,  # noqa: F401
                         onednn_int8_pack, pack)

__all__ = ["PATHS", "INT8_PATHS", "ACTIVATIONS", "linear", "module_linear", "plan", "choose", "choose_int8", "planned",
           "forcing", "forced_path",
           "path_available", "pack", "int8_broke", "int8_matmul", "onednn_int8_linear", "onednn_int8_pack"]

PATHS = ("torch", "onednn", "btlib")
INT8_PATHS = ("int_mm", "onednn_int8")
ACTIVATIONS = ("none", "gelu", "relu")
_FLOAT = (torch.float32, torch.bfloat16)

_broken: dict[tuple[str, torch.dtype], str] = {}  # (path, dtype) -> why it fell back (off for this process)
_ready: set[tuple[str, torch.dtype]] = set()  # (path, dtype) that path_available said yes to; emptied when a path breaks
_plans: dict[tuple, tuple[tuple[int | None, str], ...]] = {}  # (threads, dtype, BTLIB_GEMM) -> ((M_max, path), ...)
_forcing: contextvars.ContextVar[str | None] = contextvars.ContextVar("btlib_gemm_forcing", default=None)
_planned: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("btlib_gemm_planned", default=None)  # (dtype, M, path)


@contextlib.contextmanager
def forcing(path: str | None) -> Iterator[None]:
    """Inside the block (this thread / task), every :func:`linear` takes ``path`` (one of :data:`PATHS`; None:
    BTLIB_GEMM or the measured choice): how benchmarks compare the paths side by side in one process."""
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be one of {PATHS} or None; got {path!r}")
    token = _forcing.set(path)
    try:
        yield
    finally:
        _forcing.reset(token)


@contextlib.contextmanager
def planned(dtype: torch.dtype, M: int) -> Iterator[str]:
    """Choose the path for ``dtype`` GEMMs of M rows once (:func:`choose`) and let every :func:`linear` of that
    dtype and M inside the block take it without asking again: how an encoder's forward, whose GEMMs all have
    M = the tokens in the batch, decides once instead of at each of its ~24 linears (for one short query the
    per-call choice cost more than the choice itself is worth: ~20 us a call with the caches cold after a GEMM)."""
    path = choose(dtype, M)
    token = _planned.set((dtype, M, path))
    try:
        yield path
    finally:
        _planned.reset(token)


def forced_path() -> str | None:
    """The path forced by :func:`forcing`, else BTLIB_GEMM's (None: neither, take the measured choice).
    Raises ValueError on an unknown BTLIB_GEMM."""
    if (path := _forcing.get()) is not None:
        return path
    value = os.environ.get("BTLIB_GEMM", "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in PATHS:
        raise ValueError(f"BTLIB_GEMM must be one of {PATHS} or auto; got {value!r}")
    return value


def path_available(path: str, dtype: torch.dtype = torch.float32) -> str | None:
    """None if ``path`` can run ``dtype`` GEMMs in this torch (as far as is known before trying); else why not."""
    if path == "torch" or (path, dtype) in _ready:  # asked at every linear: a "yes" is remembered until a path breaks
        return None
    why = _path_available(path, dtype)
    if why is None:
        _ready.add((path, dtype))
    return why


def _path_available(path: str, dtype: torch.dtype) -> str | None:
    if path == "onednn":
        if not _has_onednn():
            return (tp.missing("linear_pointwise") or tp.missing("reorder_linear_weight")
                    or "this torch has no oneDNN (torch.backends.mkldnn.is_available() is False)")
        return _broken.get((path, dtype))
    if path == "btlib":
        if dtype != torch.float32:
            return f"btlib's own GEMM (kernels/cpu/gemm.cpp) is fp32 only; got {dtype}"
        if (why := _broken.get((path, dtype))) is not None:
            return why
        from .kernels.cpu import build

        return build.gemm_available()
    if path == "int_mm":
        return tp.missing("int_mm")
    if path == "onednn_int8":
        return tp.missing("qlinear_prepack") or tp.missing("qlinear_pointwise") or _broken.get((path, torch.int8)) \
            or _no_vnni()
    raise ValueError(f"path must be one of {PATHS + INT8_PATHS}; got {path!r}")


@functools.cache
def _has_onednn() -> bool:  # asked at every linear: the answer is fixed for the process
    return torch.backends.mkldnn.is_available() and not (tp.missing("linear_pointwise") or tp.missing("reorder_linear_weight"))


def plan(dtype: torch.dtype) -> tuple[tuple[int | None, str], ...]:
    """((M_max, path), ...) for ``dtype``: the path for M <= M_max, the last entry (M_max None) for the rest.

    From BTLIB_GEMM where set, else from :func:`btlib.hardware.machine`'s measured choice (measured
    once per thread count, a few seconds, then cached on disk); dtypes it did not measure take F.linear.
    """
    forced = forced_path()
    key = (torch.get_num_threads(), dtype, forced)
    got = _plans.get(key)
    if got is None:
        if forced is not None:
            got = ((None, forced),)
        else:
            precision = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype)
            picks = hardware.machine().gemm_pick.get(precision) if precision else None
            got = tuple((m, p) for m, p in picks) if picks else ((None, "torch"),)
        _plans[key] = got
    return got


def choose(dtype: torch.dtype, M: int) -> str:
    """The path :func:`linear` takes for ``dtype`` GEMMs of M rows: forced (:func:`forcing`, BTLIB_GEMM), else measured."""
    for m_max, path in plan(dtype):
        if m_max is None or M <= m_max:
            return path
    return "torch"


def _no_vnni() -> str | None:
    """Why oneDNN's int8 linear is wrong on an x86 CPU without VNNI, or None: its u8 x s8 products are summed in pairs
    into saturating 16-bit lanes (vpmaddubsw), so large activations clip (9% of the output's scale off on an AMD EPYC
    Zen 3, where _int_mm was within 0.5%)."""
    flags = hardware.cpu_flags()
    if platform.machine().lower() not in ("x86_64", "amd64") or not flags:
        return None
    if flags & {"avx512_vnni", "avx_vnni", "amx_int8"}:
        return None
    return ("oneDNN's int8 linear saturates 16-bit sums on an x86 CPU without VNNI (no avx512_vnni, avx_vnni or "
            "amx_int8 in /proc/cpuinfo): torch._int_mm runs instead")


def choose_int8(M: int, K: int | None = None, N: int | None = None) -> str:
    """The int8 path (:data:`INT8_PATHS`) for an (M, K) x (K, N) GEMM: BTLIB_GEMM_INT8 where set (int_mm, onednn_int8
    or auto), else the faster one measured here for the nearest measured weight shape (:func:`btlib.hardware.machine`'s
    "int8 KxN" picks; without K, N or those picks, the pick over all shapes), switching where fp32's do; int_mm where
    oneDNN's int8 ops are missing or broke in this process. Per shape because oneDNN's int8 call has a larger
    fixed cost than _int_mm's, so which wins depends on M and on the weight's size (``btlib.hardware.machine().gemm``
    holds this machine's int8 rates per path and M); a shape switches to oneDNN only where it measured
    btlib.gemm_measure.INT8_MARGIN times _int_mm's rate."""
    value = os.environ.get("BTLIB_GEMM_INT8", "").strip().lower()
    if value not in ("", "auto", *INT8_PATHS):
        raise ValueError(f"BTLIB_GEMM_INT8 must be one of {INT8_PATHS} or auto; got {value!r}")
    key = (torch.get_num_threads(), "int8", value, K, N)
    got = _plans.get(key)
    if got is None:
        if value in INT8_PATHS:
            got = ((None, value),)
        else:
            all_picks = hardware.machine().gemm_pick
            picks = all_picks.get(_nearest_int8_shape(all_picks, K, N)) or all_picks.get("int8")
            got = tuple((m, p) for m, p in picks) if picks else ((None, "int_mm"),)
        _plans[key] = got
    for m_max, path in got:
        if m_max is None or M <= m_max:
            return path if path == "int_mm" or _int8_ok(path) else "int_mm"
    return "int_mm"


def _nearest_int8_shape(picks: dict, K: int | None, N: int | None) -> str | None:
    """The "int8 KxN" key of the measured shape nearest (K, N) in log scale, or None."""
    shapes = [tuple(map(int, k[5:].split("x"))) for k in picks if k.startswith("int8 ")]
    if K is None or N is None or not shapes:
        return None
    k, n = min(shapes, key=lambda s: abs(math.log(s[0] / K)) + abs(math.log(s[1] / N)))
    return f"int8 {k}x{n}"


def _int8_ok(path: str) -> bool:
    return (path, torch.int8) not in _broken and path_available(path, torch.int8) is None


def int8_broke(path: str, error: Exception) -> None:
    """Turn ``path`` (an int8 path) off for this process after it raised; :func:`choose_int8` takes int_mm from now on."""
    _broken[(path, torch.int8)] = f"{path} raised: {str(error).splitlines()[0][:200]}"
    _ready.discard((path, torch.int8))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str = "none",
           residual: Tensor | None = None, *, path: str | None = None) -> Tensor:
    """act(x W^T + b) + residual by the fastest GEMM path measured here for x's dtype and M rows.

    x: (M, K) or (..., K), fp32 or bf16 (other dtypes: F.linear); weight: (N, K) in x's dtype;
    bias: (N,) or None; activation: "none", "gelu" (exact, erf) or "relu", applied before the
    residual; residual: x's leading shape + (N,), or None. Returns (..., N) in x's dtype.
    path: "torch", "onednn" or "btlib" forces one (default: BTLIB_GEMM, else :func:`plan`'s choice for M).
    oneDNN's result differs from F.linear's only by summation order (within 1e-5 relative in fp32).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}; got {path!r}")
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias, residual))
    if x.device.type == "cpu" and x.dtype in _FLOAT and weight.dtype == x.dtype and not grad:
        M = x.shape[:-1].numel()
        chosen = path
        if chosen is None:
            if _is_compiling():
                # torch.compile: dynamo cannot trace the choice (contextvars, os.environ, the measured plan) nor
                # pack(): its id/weakref cache. The graph gets aten addmm / _addmm_activation / linear instead,
                # which inductor lowers itself (fusing the bias, activation and residual into the GEMM's epilogue;
                # with torch._inductor.config.freezing it also pre-packs W for oneDNN, as the onednn path does)
                return _torch(x, weight, bias, activation, residual, grad)
            ahead = _planned.get()
            chosen = ahead[2] if ahead is not None and ahead[0] is x.dtype and ahead[1] == M else choose(x.dtype, M)
        if chosen != "torch" and path_available(chosen, x.dtype) is None:
            try:
                return (_onednn if chosen == "onednn" else _btlib)(x, weight, bias, activation, residual)
            except RuntimeError as e:  # e.g. bf16 without AVX-512: mkldnn_reorder_linear_weight refuses
                y = _torch(x, weight, bias, activation, residual, grad)  # a wrong input raises here, with torch's message
                _broken[(chosen, x.dtype)] = f"{'oneDNN' if chosen == 'onednn' else 'gemm.cpp'} raised: {str(e).splitlines()[0][:200]}"
                _ready.discard((chosen, x.dtype))
                _plans.clear()
                return y
    return _torch(x, weight, bias, activation, residual, grad)


def module_linear(module: torch.nn.Linear, x: Tensor, residual: Tensor | None = None) -> Tensor:
    """module(x) (+ residual) by :func:`linear`'s path; through the module itself where forward hooks watch it
    (SmoothQuant's calibration, a user's probes), so they run as in PyTorch's own forward."""
    if module._forward_hooks or module._forward_pre_hooks or tp.global_forward_hooks():
        y = module(x)
        return y if residual is None else y + residual
    return linear(x, module.weight, module.bias, residual=residual)


# btlib.hardware measures this module's paths and caches the picks that plan() reads; it sits below this
# module, so it gets the measurement handed over here rather than importing it.
def _measure() -> dict:
    """Every path timed by btlib.gemm_measure, gemm.cpp built first: its first build (~20 s) inside the measurement's
    time box would leave no time for the larger token counts, and the short measurement would be cached."""
    if path_available("btlib") is None:
        try:
            _gemm_cpp()
        except RuntimeError:  # the failure is remembered: path_available says why, and the path is not measured
            pass
    return gemm_measure.measure_paths(sys.modules[__name__])


hardware.use_gemm(_measure, lambda: _plans.clear())
