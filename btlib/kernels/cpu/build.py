"""Build btlib's C++ attention kernels on first use, with torch.utils.cpp_extension, into a cache.

    load() -> str        compile (once, ~30 s) or load the cached library; returns its build info
    available() -> None | str   cheap: None if a C++ compiler is on PATH, else why not (never compiles)
    isa() -> str         "avx512bf16", "avx512", "avx2" or "portable": the build this CPU gets

The source is attention.cpp (+ vec.h) next to this file. One library per instruction set, named
``btlib_cpu_attention_<isa>``, cached in ``$TORCH_EXTENSIONS_DIR/<name>/`` (the Makefile points
it at build/torch_extensions; torch's default is ~/.cache/torch_extensions). A second load,
in this process or a new one, finds the library built and takes milliseconds.

AVX-512 is chosen when /proc/cpuinfo lists avx512f, avx512dq, avx512bw and avx512vl (plus
-mavx512bf16 where it lists avx512_bf16: bf16 then runs on vdpbf16ps); gcc 12's
``-march=native`` treats Zen 5 as znver3 and prefers 256-bit code, so the flags name x86-64-v4
and 512-bit vectors explicitly (FACTS.md). ``BTLIB_CPU_ISA=avx512bf16|avx512|avx2|portable`` overrides the
choice (one per process: the library registers torch.ops.btlib_cpu).
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

__all__ = ["load", "available", "isa", "SOURCE", "HEADER", "build_directory", "library_path"]

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "attention.cpp"
HEADER = HERE / "vec.h"

_FLAGS = {
    "avx512bf16": ["-march=x86-64-v4", "-mavx512bf16", "-mprefer-vector-width=512"],
    "avx512": ["-march=x86-64-v4", "-mprefer-vector-width=512"],
    "avx2": ["-march=x86-64-v3"],
    "portable": [],
}
_state: dict[str, str] = {}  # "error": why the last build failed


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


@functools.lru_cache(maxsize=None)
def isa() -> str:
    """The instruction set the kernels are built for: $BTLIB_CPU_ISA, else what this CPU has."""
    forced = os.environ.get("BTLIB_CPU_ISA", "").lower()
    if forced:
        if forced not in _FLAGS:
            raise ValueError(f"BTLIB_CPU_ISA must be one of {', '.join(_FLAGS)}; got {forced!r}")
        return forced
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "portable"
    flags = _cpu_flags()
    if {"avx512f", "avx512dq", "avx512bw", "avx512vl"} <= flags:
        return "avx512bf16" if "avx512_bf16" in flags else "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "portable"


def _compiler() -> str:
    return os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension invokes


def available() -> str | None:
    """None if the kernels can be built or are built; else the reason (no compiler, failed build). Never compiles."""
    if "error" in _state:
        return _state["error"]
    if "info" in _state:
        return None
    if shutil.which(_compiler()) is None:
        return (f"no C++ compiler: {_compiler()!r} is not on PATH (install g++ or set CXX); "
                "btlib.attention falls back to PyTorch's kernels")
    return None


def _name() -> str:
    return f"btlib_cpu_attention_{isa()}"


def build_directory() -> Path:
    """Where the library is cached: $TORCH_EXTENSIONS_DIR/<name>, else torch's default."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(_name(), verbose=False))


def library_path() -> Path:
    return build_directory() / f"{_name()}.so"


def _needs_build() -> bool:
    lib = library_path()
    return not lib.exists() or lib.stat().st_mtime < max(SOURCE.stat().st_mtime, HEADER.stat().st_mtime)


def load() -> str:
    """Build (first use) or load the kernels; registers torch.ops.btlib_cpu.*. Returns the build info line.

    Raises RuntimeError with the compiler's message if the build fails; afterwards
    :func:`available` reports the failure, so ``backend="auto"`` moves on to PyTorch's kernels.
    """
    if "info" in _state:
        return _state["info"]
    why = available()
    if why:
        raise RuntimeError(f"btlib C++ attention kernels unavailable: {why}")
    from torch.utils import cpp_extension

    if _needs_build():
        print(f"btlib: compiling C++ attention kernels ({isa()}) into {build_directory()} - once, about 30 s ...",
              file=sys.stderr, flush=True)
    flags = ["-O3", "-fopenmp", "-std=c++17", *_FLAGS[isa()]]
    try:
        cpp_extension.load(name=_name(), sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                           extra_include_paths=[str(HERE)], is_python_module=False, verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure becomes one clear error
        _state["error"] = f"building the C++ kernels failed ({type(e).__name__}); see the first error for the compiler output"
        raise RuntimeError(
            f"btlib: building the C++ attention kernels failed: {e}\n"
            "btlib.attention(backend='auto') now falls back to PyTorch's kernels; "
            "backend='torch_sdpa' or 'reference' choose one explicitly."
        ) from e
    _state["info"] = torch.ops.btlib_cpu.build_info()
    return _state["info"]


def timed_load() -> tuple[str, float]:
    """:func:`load` and the seconds it took (compile on a cold cache, milliseconds on a warm one)."""
    t0 = time.perf_counter()
    info = load()
    return info, time.perf_counter() - t0
