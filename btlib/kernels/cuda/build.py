"""Build btlib's CUDA attention kernel on first use, with torch.utils.cpp_extension, into a cache.

    load() -> str                 compile (once, about a minute) or load the cached library; returns its build info
    available() -> None | str     cheap: None if a CUDA torch, a GPU and nvcc are here, else why not (never compiles)
    nvcc() -> str | None          the nvcc on PATH or in $CUDA_HOME, or None
    nvcc_compile(archs, out)      nvcc -c of the torch-free flash_attn.cu for the given sm_XX: the tests' compile check
    binding_syntax_check()        g++ -fsyntax-only of binding.cpp against this torch's headers (no CUDA torch needed)

Sources next to this file: flash_attn.cu + flash_attn_kernel.cuh + flash_attn.h (torch-free kernel
and launcher) and binding.cpp (the torch op). One library, ``btlib_cuda_attention``, cached in
``$TORCH_EXTENSIONS_DIR/btlib_cuda_attention/``, built for the GPU it runs on (torch's default
when TORCH_CUDA_ARCH_LIST is unset). A CPU build of torch cannot build it at all:
cpp_extension sets CUDA_HOME to None there and the CUDA libraries are absent (torch 2.13.0+cpu), so
:func:`available` says so and ``btlib.attention`` uses the other kernels.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import torch

from .. import _build
from .._build import Extension

__all__ = ["load", "available", "nvcc", "nvcc_compile", "binding_syntax_check", "SOURCES", "build_directory"]

HERE = Path(__file__).resolve().parent
KERNEL = HERE / "flash_attn.cu"
SOURCES = [HERE / "binding.cpp", KERNEL]
HEADERS = [HERE / "flash_attn.h", HERE / "flash_attn_kernel.cuh"]
NAME = "btlib_cuda_attention"


def nvcc() -> str | None:
    """Path of nvcc: $CUDA_HOME/bin/nvcc, else the one on PATH, else None."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _toolchain() -> str | None:
    if torch.version.cuda is None:
        return (f"needs a CUDA build of torch (this is {torch.__version__}, a CPU build) and a CUDA GPU; "
                "btlib.attention falls back to the other kernels")
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    if nvcc() is None:
        return "needs the CUDA toolkit's nvcc (on PATH or in $CUDA_HOME) to build the extension on first use"
    return None


_ext = Extension("CUDA attention kernel",
                 "btlib.attention(backend='auto') now uses the other kernels; backend='triton_flash' or 'torch_sdpa' choose one.",
                 _toolchain, about_s=60)


def available() -> str | None:
    """None if the CUDA kernel can be built or is built here; else the reason (its failed build's first errors
    included). Cheap: never compiles."""
    return _ext.available(NAME)


def build_directory() -> Path:
    """Where the library is cached: $TORCH_EXTENSIONS_DIR/btlib_cuda_attention, else torch's default."""
    return _build.build_directory(NAME)


def load() -> str:
    """Build (first use) or load the CUDA kernel; registers torch.ops.btlib_cuda.*. Returns the build info line.

    Raises RuntimeError with the compiler's message if the build fails; the failure is remembered:
    :func:`available` reports it (``backend="auto"`` moves on to the next kernel) and a second call
    raises it without compiling again.
    """
    return _ext.load(NAME, "btlib_cuda", detail="for this GPU", depends=[*SOURCES, *HEADERS],
                     sources=[str(s) for s in SOURCES], extra_include_paths=[str(HERE)], extra_cflags=["-O3"],
                     extra_cuda_cflags=["-O3", "-lineinfo"])


def nvcc_compile(archs: tuple[int, ...] = (75, 80, 90), out: str | Path | None = None, *, verbose: bool = False) -> tuple[str, float]:
    """Compile the torch-free flash_attn.cu with nvcc for sm_<arch> of each arch (75 = T4, 80 = A100, 90 = H100).

    One nvcc call with one -gencode per arch (about 20 s for three). Returns (ptxas report or "",
    seconds). Raises RuntimeError with nvcc's output if it fails, FileNotFoundError without nvcc.
    """
    exe = nvcc()
    if exe is None:
        raise FileNotFoundError("nvcc not found (not on PATH, no $CUDA_HOME/bin/nvcc)")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    target = str(out) if out else os.devnull
    cmd = [exe, "-c", str(KERNEL), "-o", target, "-std=c++17", "-O3", f"-I{HERE}", *gencode]
    if verbose:
        cmd.append("-Xptxas=-v")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{done.stdout}{done.stderr}")
    return done.stdout + done.stderr, seconds


def binding_syntax_check() -> float:
    """Parse and type-check binding.cpp against this torch's C++ headers with the host compiler; returns seconds.

    A CPU torch ships the c10/cuda headers but not the CUDA libraries, so the binding cannot be
    linked here; ``-fsyntax-only`` still catches every API misuse (about 20 s, mostly torch's
    headers). Needs the CUDA headers (cuda_runtime_api.h). Raises RuntimeError with the errors.
    """
    from torch.utils.cpp_extension import include_paths

    from .emulate import cuda_include_dir

    cuda_inc = cuda_include_dir()
    if cuda_inc is None:
        raise FileNotFoundError("CUDA headers not found (set CUDA_HOME)")
    cmd = [os.environ.get("CXX", "g++"), "-std=c++20", "-fsyntax-only", "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE",
           *[f"-I{p}" for p in include_paths()], f"-I{cuda_inc}", f"-I{HERE}", str(HERE / "binding.cpp")]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"binding.cpp does not compile against torch {torch.__version__}:\n{done.stderr[-4000:]}")
    return time.perf_counter() - t0
