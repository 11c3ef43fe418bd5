"""What this runtime is and what it means for the workbook: the second half of every notebook's setup cell.

    >>> from btlib.device import describe_device
    >>> describe_device()                       # doctest: +SKIP
    btlib 0.1.0 from ./bettertransformer-workbook, torch 2.13.0+cpu, Python 3.11.7
    device: CPU AMD EPYC, x86_64, 2 cores, 2 torch threads, torch AVX512, btlib kernels avx512bf16
      bf16 native (avx512_bf16 in /proc/cpuinfo); best GEMM measured 540 GFLOP/s fp32 (onednn), 1.05e+03 bf16 (onednn) (1.9x fp32)
      GEMM at the encoder's shapes, GFLOP/s at 12 | 128 | 1024 tokens (* the path btlib takes):
        fp32: torch 60 | 180 | 226, onednn 120* | 420* | 540*
        ...
      precision="auto": bf16: bf16 is native and 1.9x fp32 (> 1.3x): ...
      no GPU: the GPU cells skip and say why; the C++ kernels compile with the system compiler on first use
    sizes: default (BTLIB_QUICK=1 shrinks them to seconds)

One source for the machine: :func:`describe_machine` (a dict, in every benchmark row) and
:func:`machine_line` (its text, here and in ``python -m btlib.bench summary``), both from
:func:`btlib.hardware.machine`. The precision policy (bf16 only where it pays: ``choose_precision``,
``warn_if_slow_bf16``, ``bf16_slow_reason``, SlowPrecisionWarning) is :mod:`btlib.precision`'s; its
names are importable from here too, as notebooks and older code import them. On a GPU the device
line names it with its compute capability. Queries the GPU and measures the CPU only when called,
never on import.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path
from typing import Any

import torch

from ._version import __version__
from .fold import Folded
from .cpu_generation import cpu_generation
from .gemm import forced_path
from .hardware import as_dict, machine
from .precision import (AUTO_MARGIN, PRECISIONS, PrecisionChoice, SlowPrecisionWarning, bf16_slow_reason, choose_precision,
                        warn_if_slow_bf16)
from .quick import quick_mode

__all__ = ["describe_device", "describe_machine", "machine_line", "gemm_lines", "gpu_notes", "choose_precision", "PrecisionChoice",
           "warn_if_slow_bf16", "bf16_slow_reason", "SlowPrecisionWarning", "PRECISIONS", "AUTO_MARGIN"]


def gpu_notes(major: int, minor: int) -> list[str]:
    """What a CUDA device of compute capability ``major.minor`` means for btlib's GPU notebooks (05, 06, 07)."""
    sm = major * 10 + minor
    if sm < 75:
        return [f"sm_{sm} is older than anything btlib's GPU kernels were compiled for (sm_75, sm_80, sm_90): "
                "expect the Triton and CUDA kernels to fail or crawl; PyTorch's own paths still run"]
    if sm < 80:  # T4 (sm_75): Triton 3 emits FMA instead of mma for tl.dot there, and has no bf16 units
        return ["Turing (e.g. the T4 of Colab's free tier): btlib's Triton kernels run without tensor cores "
                "(FMA only), so expect them well behind SDPA; no bf16 arithmetic (use fp16)",
                "SDPA has no FlashAttention backend below sm_80: it uses the memory-efficient one"]
    return [f"sm_{sm}: tensor cores for fp16 and bf16 (Triton emits mma), SDPA's FlashAttention backend available"]


def describe_machine() -> dict[str, Any]:
    """The facts a timing depends on, as stored in every benchmark row. No host names or paths.

    Keys: cpu, arch, os, cores (= cpu_count), threads, torch, python, torch_capability (= cpu_capability),
    isa, bf16_native, bf16_why, fp32_gflops, bf16_gflops (the best GEMM rate of each precision over every
    path), fp32_n, bf16_n, gemm (every path's rates), gemm_pick (the path per token count), bf16_speedup, gpu.
    """
    hw = as_dict(machine())
    env = {**hw, "python": platform.python_version(), "os": f"{platform.system()} {platform.machine()}",
           "cpu_count": hw["cores"], "cpu_capability": hw["torch_capability"], "gpu": None}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = f"{p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB)"
    return env


def machine_line(env: dict[str, Any] | None = None, *, rates: bool = True) -> str:
    """The machine in one line (from :func:`describe_machine`'s dict; rows saved before it had fewer keys).

    rates=False leaves out bf16 and the measured matmul rates (describe_device gives them a line of their own).
    """
    env = describe_machine() if env is None else env
    g = env.get
    parts = [f"CPU {g('cpu')}", g("arch") or g("os"), f"{g('cores', g('cpu_count'))} cores", f"{g('threads')} torch threads",
             f"torch {g('torch_capability', g('cpu_capability'))}"]
    if g("isa"):
        parts.append(f"btlib kernels {g('isa')}")
    if rates and g("bf16_native") is not None:
        parts.append(f"bf16 {'native' if g('bf16_native') else 'not native'}")
    if rates and g("fp32_gflops"):
        parts.append(f"GEMM {g('fp32_gflops'):.0f} GFLOP/s fp32{_via(env, 'fp32')}, {g('bf16_gflops'):.3g} bf16{_via(env, 'bf16')} "
                     f"({g('bf16_gflops') / g('fp32_gflops'):.2g}x)")
    if g("gpu"):
        parts.append(f"GPU {g('gpu')}")
    return ", ".join(str(p) for p in parts)


def _via(env: dict[str, Any], precision: str) -> str:
    """" (onednn)": the path whose rate is the machine's best in ``precision`` ('' for rows saved before paths)."""
    found = [(r, p) for p, by_M in (env.get("gemm") or {}).get(precision, {}).items() for r in by_M.values()]
    return f" ({max(found)[1]})" if found else ""


def gemm_lines(env: dict[str, Any] | None = None) -> list[str]:
    """What btlib.gemm picked here, per precision and token count, and every path's measured rate.

    e.g. ["GEMM at the encoder's shapes, GFLOP/s at 12 | 128 | 1024 tokens (picked: *):",
          "  fp32: torch 54 | 150* | 178*, onednn 101* | 148 | 158", ...]; [] for rows saved before paths.
    """
    env = describe_machine() if env is None else env
    gemm, picks = env.get("gemm") or {}, env.get("gemm_pick") or {}
    Ms = sorted({int(M) for by_path in gemm.values() for by_M in by_path.values() for M in by_M})
    if not Ms:
        return []
    lines = [f"GEMM at the encoder's shapes, GFLOP/s at {' | '.join(map(str, Ms))} tokens (* the path btlib takes"
             f"{'; BTLIB_GEMM=' + forced + ' forces it now' if (forced := forced_path()) else ''}):"]
    for precision, by_path in gemm.items():
        chosen = {M: _picked(picks.get(precision), M) for M in Ms}
        cells = [f"{path} " + " | ".join(f"{by_M[str(M)]:.3g}{'*' if chosen[M] == path else ''}" if str(M) in by_M else "-"
                                         for M in Ms) for path, by_M in by_path.items()]
        lines.append(f"  {precision}: " + ", ".join(cells) if cells else f"  {precision}: no path ran")
    shapes = {k[5:]: v for k, v in picks.items() if k.startswith("int8 ")}
    if shapes:  # btlib.quant takes the pick of the nearest measured weight shape (K x N), not the summed one above
        lines.append("  int8 per weight shape (what btlib.quant takes): " + "; ".join(
            f"{shape} {describe_ranges(r)}" for shape, r in shapes.items()))
    return lines


def describe_ranges(ranges: list, unit: str = "") -> str:
    """[[M_max | None, path], ...] (a gemm_pick entry) as text: "int_mm <= 362{unit}, onednn_int8 above"; one path alone."""
    return ", ".join(p if m is None and len(ranges) == 1 else f"{p} {'above' if m is None else f'<= {m}{unit}'}"
                     for m, p in ranges)


def _picked(ranges: list | None, M: int) -> str | None:
    for m_max, path in ranges or ():
        if m_max is None or M <= m_max:
            return path
    return None


def describe_device(file=None, *, full: bool = False) -> str:
    """Print (to ``file``, default stdout) and return the runtime in four lines: btlib, torch and Python; the CPU with
    its generation, cores, threads and the kernel build; the GPU or its absence; the sizes. In a notebook the rest
    (bf16, every GEMM path's measured rate, what precision="auto" picks) is displayed folded under one line;
    ``full=True`` prints it too.

    Measures this CPU's GEMM paths the first time (~3 s, then cached on disk) for that folded part.
    """
    env = describe_machine()
    lines = [f"btlib {__version__} from {Path(__file__).resolve().parents[1]}, "
             f"torch {torch.__version__}, Python {platform.python_version()}"]
    cpu = machine_line({**env, "gpu": None}, rates=False).replace(f"CPU {env['cpu']}", f"CPU {env['cpu']} {cpu_generation()}", 1)
    lines.append(f"device: {cpu}")
    if torch.cuda.is_available():
        lines.append(f"GPU {env['gpu']}: the GPU cells run")
    else:
        lines.append("no GPU: the GPU cells skip and say why; the C++ kernels compile with the system compiler on first use")
    lines.append("sizes: quick (BTLIB_QUICK=1; timings mean little)" if quick_mode()
                 else "sizes: default (BTLIB_QUICK=1 shrinks them to seconds)")
    rest = [f"bf16 {'native' if env['bf16_native'] else 'not native'} ({env['bf16_why']}); best GEMM measured "
            f"{env['fp32_gflops']:.0f} GFLOP/s fp32{_via(env, 'fp32')}, {env['bf16_gflops']:.3g} bf16{_via(env, 'bf16')} "
            f"({env['bf16_speedup']:.2g}x fp32)", *gemm_lines(env), f'precision="auto": {choose_precision()}']
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        rest += gpu_notes(p.major, p.minor)
    text = "\n".join(lines + ([f"  {line}" for line in rest] if full else []))
    print(text, file=file or sys.stdout)
    if not full and _in_notebook():
        from IPython.display import display

        display(Folded("the machine in full: bf16, every GEMM path's measured rate, what precision=\"auto\" picks",
                       "\n".join(rest)))
    return text


def _in_notebook() -> bool:
    """Whether an IPython kernel runs this (a notebook, or IPython in a terminal)."""
    return "IPython" in sys.modules and getattr(sys.modules["IPython"], "get_ipython", lambda: None)() is not None
