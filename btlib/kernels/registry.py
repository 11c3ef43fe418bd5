"""The kernel registry: one entry per attention kernel, with its reference and tolerance.

Tests and benchmarks iterate the registry, so a new kernel gets its correctness test and its
benchmark row by registering itself. Two layouts, two call signatures:

    padded:  fn(q, k, v, *, lengths, causal, scale[, window]) -> out     q, k, v, out: (B, H, T, D)
    varlen:  fn(q, k, v, cu_seqlens, max_seqlen, *, causal, scale[, window]) -> out
                                                               q, k, v, out: (total, H, D)

``window=(left, right)`` (local attention: query i attends keys i - left .. i + right) is passed
only to kernels registered with ``window=True`` (:func:`window_kwargs`); the others are called
exactly as before and are never selected for a windowed call ("has no local window").
Likewise ``bias=`` (a btlib.PositionBias: ALiBi or a relative-position table, added to the scores) is
passed only to kernels registered with ``bias=True`` (:func:`bias_kwargs`); "auto" skips the rest and
naming one raises ("has no position bias"), so no kernel ever ignores a bias.

Every padded kernel follows btlib.reference_attention's conventions (rows t >= lengths[b]
are 0; a query row with no key to attend is 0).

Kernel modules register on import; the registry imports them on first use, by name: btlib/kernels/__init__.py
holds one function per provider, each a plain ``from . import ...`` a reader and an IDE can follow, and hands
them over (:func:`use_providers`; the registry cannot import them itself, since every provider imports it). That
is cheap: compiled kernels build on their first *call*, never at import, and the Triton and CUDA providers
import neither triton nor a CUDA toolchain until then. Loading is
thread-safe: the first caller imports every provider under a lock while the others wait, and
the registry counts as loaded only once all imports succeeded (a provider that fails to import
raises on every call, rather than leaving "auto" to pick among the kernels that did load).

Gradients: only kernels marked ``differentiable`` (PyTorch's own ops, which autograd follows)
have a backward. When grad mode is on and q, k or v requires grad, "auto" skips the others
and naming one raises, so no call silently returns an output detached from its inputs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
from torch import Tensor

__all__ = ["Kernel", "CpuRun", "register", "get", "kernels", "select", "needs_grad", "relative_error", "window_kwargs",
           "bias_kwargs", "use_ranking", "use_providers"]

Layout = Literal["padded", "varlen"]

# fp32 and fp64 kernels must agree with the reference to this error relative to the
# reference's scale (max |ref|): reordering a D- or T-long sum in fp32 moves results by a
# few ulps (1.2e-7 each) times sqrt(length), well below 1e-5 for T <= 4096.
FP32_TOL = 1e-5
# Low precision: a kernel's error against the fp32 reference may be at most this multiple of
# PyTorch's own SDPA error in the same dtype on the same inputs: the rounding of fp16/bf16
# inputs and outputs alone costs ~1e-3 (bf16: 8 mantissa bits), which no fixed bound tracks.
LOW_PRECISION_FACTOR = 2.0
EXACT = (torch.float32, torch.float64)  # the dtypes held to FP32_TOL
_ULP32 = 1.2e-7  # floor of a low-precision tolerance: SDPA can round a tiny case exactly



# Kernel choice, in one place: the order backend="auto" tries the kernels in. On CPU fp32 / bf16 tensors "auto" takes
# the candidate measured fastest on this machine (btlib.kernels.choice; candidates: priority >= 0), and this order only
# breaks a tie within 3%; it alone orders what is not measured (GPU tensors, other dtypes, a call of a kernel that is
# not a candidate, BTLIB_ATTENTION_CHOICE=priority). Below 0: never timed, taken only where nothing above runs. Which
# instruction-set body a C++ kernel runs is its folder's choice (cpu/build.py: the build; flash.h: the micro-kernel).
PRIORITY = {
    # padded (B, H, T, D)
    "cpu_flash_v3": 10,            # btlib's FlashAttention: SIMD micro-kernels, skips tiles outside a window
    "torch_sdpa": 0,               # PyTorch's SDPA with a mask: differentiable, every dtype and device
    "triton_flash": -5,            # GPU kernels: SDPA first on CUDA tensors (triton/ops.py, cuda/ops.py say why)
    "cuda_flash": -20,
    "cpu_tiled_v2": -40,           # the teaching versions: slow on purpose
    "cpu_naive_v1": -50,
    "reference": -100,             # the oracle
    # varlen (total, H, D) + cu_seqlens
    "cpu_amx_varlen": 20,          # where AMX runs (bf16); "auto" times it against cpu_flash_varlen and the SDPA loop
    "cpu_flash_varlen": 10,
    "torch_sdpa_loop": 0,
    "triton_flash_varlen": -5,
    "torch_sdpa_nested": -10,      # no causal mask; re-pads on a CPU
    "cuda_flash_varlen": -20,
    "reference_varlen": -100,
}


@dataclass(frozen=True)
class CpuRun:
    """How a GPU kernel's own source runs on CPU tensors, so its check needs no GPU.

    how: "interpreter": ``Kernel.fn`` itself under TRITON_INTERPRET=1, which must be set before
        triton is imported (a fresh process); "emulator": ``fn`` runs the source on CPU threads.
    available: None if this run is possible here, else why not.
    """

    how: Literal["interpreter", "emulator"]
    available: Callable[[], str | None]
    fn: Callable[..., Tensor] | None = None


@dataclass(frozen=True)
class Kernel:
    """One registered attention kernel.

    name: unique, e.g. "cpu_flash_v3"; backend: "torch", "cpp", "triton", "cuda".
    available: returns None when the kernel can run here, else the reason it cannot.
    priority: the tie-break of ``backend="auto"`` (the available kernel with the highest priority where nothing is
        measured); None (the default): :data:`PRIORITY`'s entry for ``name``, else 0.
    differentiable: autograd can differentiate ``fn`` (it is built from PyTorch ops); False for
        compiled kernels, whose output is detached from q, k, v.
    reference: the oracle ``fn`` is checked against, with ``fn``'s signature; defaults to the
        layout's (btlib.reference_attention, btlib.reference_varlen_attention).
    tol: the fp32/fp64 tolerance; low precision follows :meth:`tolerance`.
    causal: the kernel has a causal mask. window: it takes ``window=(left, right)`` (local attention).
    bias: it takes ``bias=`` (a btlib.PositionBias), computed from the positions (or, for PyTorch's, materialised).
    cpu_run: how to check this GPU kernel's source on a machine without a GPU (None: not possible).
    """

    name: str
    layout: Layout
    fn: Callable[..., Tensor]
    backend: str
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    description: str
    reference: Callable[..., Tensor] | None = None
    tol: float = FP32_TOL
    priority: int | None = None
    causal: bool = True
    window: bool = False
    bias: bool = False
    max_head_dim: int | None = None
    available: Callable[[], str | None] = field(default=lambda: None)
    differentiable: bool = False
    cpu_run: CpuRun | None = None

    def __post_init__(self):
        if self.priority is None:
            object.__setattr__(self, "priority", PRIORITY.get(self.name, 0))
        if self.reference is None:
            from ..reference import reference_attention, reference_varlen_attention

            object.__setattr__(self, "reference", reference_attention if self.layout == "padded" else reference_varlen_attention)

    def tolerance(self, dtype: torch.dtype, sdpa_error: float | None = None) -> float:
        """The largest relative error allowed in ``dtype``: ``tol`` for fp32/fp64; for fp16/bf16
        LOW_PRECISION_FACTOR x ``sdpa_error``, PyTorch's SDPA error on the same inputs in that dtype."""
        if dtype in EXACT:
            return self.tol
        if sdpa_error is None:
            raise ValueError(f"a {dtype} tolerance is relative to PyTorch's SDPA error in {dtype}: pass sdpa_error")
        return max(LOW_PRECISION_FACTOR * sdpa_error, _ULP32)

    def supports(self, x: Tensor, causal: bool = False, needs_grad: bool = False,
                 window: tuple[int, int] | None = None, bias=None) -> str | None:
        """None if this kernel takes these inputs (and, with ``needs_grad``, can backpropagate), else why not.

        window: the call's local window (left, right), or None for global attention.
        bias: the call's btlib.PositionBias, or None.
        """
        why = self.available()
        if why:
            return why
        if needs_grad and not self.differentiable:
            return "has no backward (inputs require grad)"
        if x.device.type not in self.devices:
            return f"runs on {'/'.join(self.devices)}, inputs are on {x.device.type}"
        if x.dtype not in self.dtypes:
            return f"supports {', '.join(str(d).replace('torch.', '') for d in self.dtypes)}, inputs are {x.dtype}"
        if causal and not self.causal:
            return "has no causal mask"
        if window is not None and not self.window:
            return "has no local window (window=(left, right)); use one registered with window=True"
        if bias is not None and not self.bias:
            return "has no position bias (bias=PositionBias...); use one registered with bias=True"
        if self.max_head_dim is not None and x.shape[-1] > self.max_head_dim:
            return f"head_dim {x.shape[-1]} > {self.max_head_dim}"
        return None


_REGISTRY: dict[str, Kernel] = {}
_ranking: Callable[..., tuple[str, ...] | None] | None = None  # btlib.kernels.choice.ranking, handed over by use_ranking
_PROVIDERS: tuple[Callable[[], None], ...] = ()  # btlib.kernels' provider imports, handed over by use_providers
_loaded = False
_load_lock = threading.RLock()  # re-entrant: a provider's import may itself ask the registry


def register(kernel: Kernel) -> Kernel:
    """Add a kernel; names are unique."""
    if kernel.name in _REGISTRY and _REGISTRY[kernel.name] is not kernel:
        raise ValueError(f"a kernel named {kernel.name!r} is already registered")
    _REGISTRY[kernel.name] = kernel
    return kernel


def use_providers(providers: tuple[Callable[[], None], ...]) -> None:
    """What btlib/kernels/__init__.py hands over when imported: one function per kernel provider, in the order they
    register, named ``_import_<module>``; each imports its provider by name (which registers its kernels)."""
    global _PROVIDERS
    _PROVIDERS = tuple(providers)


def _load() -> None:
    global _loaded
    if _loaded:  # set only after every provider imported: a True read needs no lock
        return
    with _load_lock:
        if _loaded or not _PROVIDERS:  # none yet: a call while btlib/kernels/__init__.py imports, before the hand-over
            return
        for provider in _PROVIDERS:
            mod = f"{__package__}.{provider.__name__.removeprefix('_import_')}"
            before = dict(_REGISTRY)
            try:
                provider()
            except ModuleNotFoundError as e:
                _REGISTRY.clear()
                _REGISTRY.update(before)
                raise ImportError(f"btlib could not load the kernel provider {mod}: {e}. "
                                  "Install what it names (pip install -e . in the btlib checkout)") from e
            except Exception as e:
                # Python drops a failed module from sys.modules, so the next call imports it again:
                # forget what it registered halfway, or that import would clash with these names.
                _REGISTRY.clear()
                _REGISTRY.update(before)
                raise ImportError(f"btlib could not load the kernel provider {mod}: {type(e).__name__}: {e}. "
                                  "No attention kernel is selected until it imports; fix the error above") from e
        _loaded = True


def kernels(layout: Layout | None = None, *, backend: str | None = None) -> list[Kernel]:
    """All registered kernels, optionally of one layout or backend, highest priority first."""
    _load()
    ks = [k for k in _REGISTRY.values() if (layout is None or k.layout == layout) and (backend is None or k.backend == backend)]
    return sorted(ks, key=lambda k: -k.priority)


def get(name: str) -> Kernel:
    """The kernel registered under ``name``; a KeyError lists the names there are."""
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no kernel named {name!r}; registered: {', '.join(sorted(_REGISTRY))}") from None


def use_ranking(ranking: Callable[..., tuple[str, ...] | None] | None) -> None:
    """What btlib.kernels.choice hands over when imported: ``ranking(layout, dtype, seqlen, device)`` -> the kernel
    names "auto" tries first, fastest on this machine first, or None for the priority order. None: priority only."""
    global _ranking
    _ranking = ranking


def _auto_order(layout: Layout, x: Tensor, seqlen: int | None) -> list[Kernel]:
    """The kernels "auto" tries, in order: the measured ranking for this call (btlib.kernels.choice), then the
    kernels it does not hold by priority; the priority order alone where nothing is measured."""
    ks = kernels(layout)
    ranked = _ranking(layout, x.dtype, seqlen, x.device) if _ranking is not None else None
    if not ranked:
        return ks
    by_name = {k.name: k for k in ks}
    return [by_name[n] for n in ranked if n in by_name] + [k for k in ks if k.name not in ranked]


def needs_grad(*xs: Tensor) -> bool:
    """True when autograd will need a backward through a call on ``xs``: grad mode on, and one requires grad."""
    return torch.is_grad_enabled() and any(x.requires_grad for x in xs)


def select(layout: Layout, x: Tensor, causal: bool, backend: str = "auto", *, needs_grad: bool | None = None,
           window: tuple[int, int] | None = None, bias=None, seqlen: int | None = None) -> Kernel:
    """The kernel ``backend`` names, or for "auto" the best one that takes these inputs.

    "auto" on CPU fp32 / bf16 tensors tries the kernels in the order measured on this machine for the call's
    ``seqlen`` (padded: T, varlen: max_seqlen; None: the best over every measured length), then the rest by
    priority (btlib.kernels.choice: ``choice.explain(...)`` says why a kernel was taken); elsewhere by priority.

    ``window``: the call's local window (left, right) or None; "auto" then considers only kernels
    registered with ``window=True``. ``bias``: the call's btlib.PositionBias or None; likewise ``bias=True``.

    ``needs_grad``: the caller will backpropagate through the output; None means "if grad mode
    is on and ``x`` requires grad" (btlib.attention passes it for q, k and v together).
    Raises ValueError with each kernel's reason when none (or not the named one) can run.
    """
    if needs_grad is None:
        needs_grad = torch.is_grad_enabled() and x.requires_grad
    if backend != "auto":
        k = get(backend)
        if k.layout != layout:
            raise ValueError(f"kernel {backend!r} is a {k.layout} kernel; use the {k.layout} entry point")
        if needs_grad and not k.differentiable:
            fallback = "torch_sdpa" if layout == "padded" else "torch_sdpa_loop"
            raise ValueError(f"kernel {backend!r} has no backward; call under torch.no_grad()/inference_mode "
                             f"or use backend={fallback!r}")
        why = k.supports(x, causal, window=window, bias=bias)
        if why:
            raise ValueError(f"kernel {backend!r} cannot run these inputs: {why}")
        return k
    reasons = []
    for k in _auto_order(layout, x, seqlen):
        why = k.supports(x, causal, needs_grad, window, bias)
        if why is None:
            return k
        reasons.append(f"{k.name}: {why}")
    raise ValueError(f"no {layout} attention kernel takes these inputs:\n  " + "\n  ".join(reasons))


def window_kwargs(kernel: Kernel, window: tuple[int, int] | None) -> dict:
    """The ``window=`` keyword for a call of ``kernel.fn``: passed to kernels that support a window,
    omitted for the rest (which :func:`select` only picks when ``window`` is None)."""
    if window is not None and not kernel.window:
        raise ValueError(f"kernel {kernel.name!r} has no local window; select one with registry.select(..., window=window)")
    return {"window": window} if kernel.window else {}


def bias_kwargs(kernel: Kernel, bias) -> dict:
    """The ``bias=`` keyword for a call of ``kernel.fn``: passed to kernels that take a position bias, omitted for
    the rest (which :func:`select` only picks when ``bias`` is None)."""
    if bias is not None and not kernel.bias:
        raise ValueError(f"kernel {kernel.name!r} has no position bias; select one with registry.select(..., bias=bias)")
    return {"bias": bias} if kernel.bias else {}


def relative_error(out: Tensor, ref: Tensor) -> float:
    """max |out - ref| / max |ref|: the error measure every tolerance in btlib is stated in."""
    scale = ref.abs().max().item() if ref.numel() else 0.0
    err = (out.to(ref.dtype) - ref).abs().max().item() if ref.numel() else 0.0
    return err / max(scale, 1e-30) if scale > 0 else err
