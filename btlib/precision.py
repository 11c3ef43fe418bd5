"""The precision policy, in one place: the names, what "auto" resolves to, and the slow-precision warnings.

    PRECISIONS           ("auto", "fp32", "bf16"): PackedEncoder.from_module and ModernBERT's forward
    ENCODE_PRECISIONS    PRECISIONS + ("int8",): what encode() takes (PretrainedEncoder, btlib.embed, the server)
    check_precision(p)   p if it is None or allowed, else a ValueError naming what is allowed
    choose_precision()   "auto" -> PrecisionChoice("bf16" | "fp32", why): bf16 only where native and measured faster
    resolve_dtype(p)     a checked None / "fp32" / "bf16" / "auto" -> the dtype to run in (None: fp32)
    bf16_slow_reason()   None where bf16 pays here, else why not (a benchmark's skip); int8_slow_reason() the same
    warn_if_slow_bf16(what), warn_if_slow_int8(what)   a SlowPrecisionWarning with the measured rates, once per what
    warn_once(what, message)   the same warning for another layer's reason (the C++ attention's bf16 build)
    warned(precision)    whether any slow-``precision`` warning was given in this process
    forget_warnings()    every warning may be given again (tests, a notebook cell that shows one)

Checked at the public edge once (from_module, forward, encode, the CLIs): the edge calls
:func:`check_precision` (or :func:`choose_precision`, which checks) and passes what it got inside,
unchecked. Rates come from :func:`btlib.hardware.machine` (measured once, cached on disk); nothing
here is measured or queried at import. Explicit bf16 and int8 run where they are slow, with one
warning that names the measured rates and what to pass instead: the run was asked for.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from . import _torch_private as tp
from .hardware import Hardware, int8_gemm_gflops, machine

__all__ = ["PRECISIONS", "ENCODE_PRECISIONS", "AUTO_MARGIN", "SlowPrecisionWarning", "PrecisionChoice", "check_precision",
           "choose_precision", "resolve_dtype", "bf16_slow_reason", "int8_slow_reason", "warn_if_slow_bf16", "warn_if_slow_int8",
           "warn_once", "warned", "forget_warnings"]

PRECISIONS = ("auto", "fp32", "bf16")
ENCODE_PRECISIONS = (*PRECISIONS, "int8")  # int8: explicit only, never what "auto" picks (it changes the numbers)
AUTO_MARGIN = 1.3  # "auto" takes bf16 only when its measured matmul rate beats fp32's by this much
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_warned: dict[str, set[str]] = {"bf16": set(), "int8": set()}  # precision -> the whats warned about


class SlowPrecisionWarning(UserWarning):
    """A precision was requested explicitly that this machine runs slower than fp32 (e.g. emulated bf16)."""


def check_precision(precision: str | None, allowed: tuple[str, ...] = PRECISIONS, *, who: str | None = None) -> str | None:
    """``precision`` unchanged if it is None or in ``allowed``; else a ValueError saying what is allowed.

    who: names the model where a precision btlib knows is not offered by it ("precision='int8' is not
    available for ModernBERT; ...").
    """
    if precision is None or precision in allowed:
        return precision
    if who is not None and precision in ENCODE_PRECISIONS:
        raise ValueError(f"precision={precision!r} is not available for {who}; use one of {allowed}")
    raise ValueError(f"precision must be None or one of {allowed}; got {precision!r}")


@dataclass(frozen=True)
class PrecisionChoice:
    """What precision="auto" (or an explicit precision) resolves to here, and why. ``print()`` it."""

    precision: str       # "fp32" or "bf16"
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.precision]

    def __str__(self) -> str:
        return f"{self.precision}: {self.reason}"


def choose_precision(precision: str = "auto", hw: Hardware | None = None, margin: float = AUTO_MARGIN) -> PrecisionChoice:
    """Resolve "auto" | "fp32" | "bf16". "auto" is bf16 only where bf16 is native and measured > margin x fp32.

    hw: the machine (default :func:`btlib.hardware.machine`, measured once); tests pass their own.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    if precision != "auto":
        return PrecisionChoice(precision, "asked for explicitly")
    hw = hw or machine()
    rates = f"the best GEMMs measured here run {hw.bf16_gflops:.3g} GFLOP/s in bf16 vs {hw.fp32_gflops:.0f} in fp32"
    if not hw.bf16_native:
        return PrecisionChoice("fp32", f"bf16 is not native on this CPU ({hw.bf16_why}); {rates}")
    if hw.bf16_speedup <= margin:
        return PrecisionChoice("fp32", f"bf16 is native but gains only {hw.bf16_speedup:.2g}x (<= {margin}x): {rates}")
    return PrecisionChoice("bf16", f"bf16 is native and {hw.bf16_speedup:.2g}x fp32 (> {margin}x): {rates}")


def resolve_dtype(precision: str | None) -> torch.dtype:
    """The dtype a checked precision runs in: None or "fp32" -> float32, "bf16" -> bfloat16, "auto" -> the choice here.

    Not checked again (the public edge did, with :func:`check_precision`): anything else raises KeyError.
    """
    return choose_precision("auto").dtype if precision == "auto" else _DTYPES[precision or "fp32"]


def bf16_slow_reason(hw: Hardware | None = None) -> str | None:
    """None where bf16 is native and measured at least as fast as fp32; else why not (for a benchmark's skip)."""
    hw = hw or machine()
    if hw.bf16_native and hw.bf16_speedup >= 1.0:
        return None
    native = "native" if hw.bf16_native else f"not native ({hw.bf16_why})"
    return (f"bf16 is {native} on this CPU: matmuls measured {hw.bf16_gflops:.3g} GFLOP/s bf16 vs {hw.fp32_gflops:.0f} fp32; "
            "not timed (it runs, slowly, when asked for explicitly)")


def int8_slow_reason(margin: float = 1.0) -> str | None:
    """None where torch._int_mm measured above ``margin`` x this machine's fp32 matmul rate; else why int8 does not pay."""
    if (why := tp.missing("int_mm")) is not None:
        return f"{why}: int8 matmuls cannot run here"
    fp32, int8 = machine().fp32_gflops, int8_gemm_gflops()
    if int8 > margin * fp32:
        return None
    return (f"int8 matmuls (torch._int_mm) measured {int8:.0f} GOP/s vs {fp32:.0f} GFLOP/s fp32 on this CPU "
            "(no fast int8 dot products, e.g. AVX-512 VNNI / AVX-VNNI / Arm i8mm): int8 is not faster here")


def warn_once(what: str, message: str, *, precision: str = "bf16", stacklevel: int = 2) -> bool:
    """Warn ``message`` (a SlowPrecisionWarning) unless one was given for ``what`` already; True if this call warned.

    stacklevel: as for warnings.warn, counted from the caller of warn_once.
    """
    if what in _warned[precision]:
        return False
    _warned[precision].add(what)
    warnings.warn(SlowPrecisionWarning(message), stacklevel=stacklevel + 1)
    return True


def warned(precision: str = "bf16") -> bool:
    """Whether a slow-``precision`` warning ("bf16" or "int8") was given in this process."""
    return bool(_warned[precision])


def forget_warnings() -> None:
    """Every slow-precision warning may be given again (each is given once per process otherwise)."""
    for whats in _warned.values():
        whats.clear()


def warn_if_slow_bf16(what: str, hw: Hardware | None = None, stacklevel: int = 3) -> bool:
    """Warn once per ``what`` (a SlowPrecisionWarning) if bf16 is not native here or measured slower than fp32.

    The run goes on in bf16 (it was asked for); the warning names the measured rates and what to do.
    Returns True if bf16 is slow here (whether or not this call warned).
    """
    hw = hw or machine()
    if bf16_slow_reason(hw) is None:
        return False
    native = "native on this CPU" if hw.bf16_native else f"not native on this CPU ({hw.bf16_why})"
    slower = f"{1 / hw.bf16_speedup:.0f}x slower" if hw.bf16_speedup < 1 else f"{hw.bf16_speedup:.2g}x fp32's rate"
    warn_once(what, f"{what}: bf16 is {native}; its bf16 matmuls measured {hw.bf16_gflops:.3g} GFLOP/s vs "
                    f"{hw.fp32_gflops:.0f} GFLOP/s in fp32 ({slower}, {hw.threads} threads). It runs as asked; where bf16 is "
                    "emulated, precision='fp32' is the fast choice, and precision='auto' picks what is fastest here.",
              stacklevel=stacklevel)
    return True


def warn_if_slow_int8(what: str, stacklevel: int = 3) -> bool:
    """Warn once per ``what`` (a SlowPrecisionWarning) where int8 matmuls are not faster than fp32; True if slow."""
    why = int8_slow_reason()
    if why is None:
        return False
    warn_once(what, f"{what}: {why}. It runs as asked; precision='fp32' or 'auto' is faster here.", precision="int8",
              stacklevel=stacklevel)
    return True
