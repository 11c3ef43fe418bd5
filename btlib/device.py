"""What this runtime is and what it means for the workbook: the second half of every notebook's setup cell.

    >>> from btlib.device import describe_device
    >>> describe_device()                       # doctest: +SKIP
    btlib 0.1.0 from ./bettertransformer-workbook, torch 2.13.0+cpu, Python 3.11.7
    device: CPU, AMD EPYC 9R45 (2 cores, 2 torch threads, AVX512)
      no GPU: the GPU cells skip and say why; the C++ kernels compile with the system compiler on first use
    sizes: default (BTLIB_QUICK=1 shrinks them to seconds)

On a GPU the device line names it with its compute capability (``sm_75`` for a T4) and says what
that capability gives: tensor cores for the Triton kernels from sm_80 on, SDPA's FlashAttention
backend from sm_80 on. Queries the GPU only when called, never on import.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

__all__ = ["describe_device", "gpu_notes"]


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


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def describe_device(file=None) -> str:
    """Print (to ``file``, default stdout) and return where btlib was imported from, the device, and what it means."""
    import torch

    import btlib
    from btlib.bench.core import quick_mode

    lines = [f"btlib {btlib.__version__} from {Path(btlib.__file__).resolve().parents[1]}, "
             f"torch {torch.__version__}, Python {platform.python_version()}"]
    cpu = (f"CPU, {_cpu_name()} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
           f"{torch.backends.cpu.get_cpu_capability()})")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        lines.append(f"device: GPU {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB "
                     f"(and {cpu}); the GPU cells run")
        lines += [f"  {note}" for note in gpu_notes(p.major, p.minor)]
    else:
        lines.append(f"device: {cpu}")
        lines.append("  no GPU: the GPU cells skip and say why; the C++ kernels compile with the system compiler on first use")
    lines.append("sizes: quick (BTLIB_QUICK=1; timings mean little)" if quick_mode()
                 else "sizes: default (BTLIB_QUICK=1 shrinks them to seconds)")
    text = "\n".join(lines)
    print(text, file=file or sys.stdout)
    return text
