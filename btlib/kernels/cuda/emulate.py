"""Run the CUDA kernel's source on the CPU: emulate.cpp compiles flash_attn_kernel.cuh with g++.

    available() -> None | str        cheap: None if g++ and the CUDA headers (cuda_fp16.h) are found
    emulated_attention(q, k, v, *, lengths=None, causal=False, scale=None, window=None, bias=None)              (B, H, T, D)
    emulated_varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, causal=False, scale=None, window=None, bias=None)
                                                                                                     (total, H, D)

One OS thread per CUDA thread, a std::barrier for __syncthreads, blocks one after another, so
it is slow (64 threads started per block): for tiny shapes in tests and the notebook. It proves
the kernel's indexing, masking, online softmax and barrier placement on a machine without a GPU;
it says nothing about speed or about the GPU's memory system. CPU tensors, fp32/fp16/bf16.

The library (~2 s to build) is cached in ``$TORCH_EXTENSIONS_DIR/btlib_cuda_emulator/``.
"""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import subprocess
from pathlib import Path

import torch
from torch import Tensor

from ...checks import window_reach
from .._build import Extension, build_directory, needs_build
from ...position_bias import PositionBias, check_position_bias, kernel_args
from ..gpu_limits import LOG2E

__all__ = ["available", "load", "emulated_attention", "emulated_varlen_attention", "cuda_include_dir"]

HERE = Path(__file__).resolve().parent
SOURCES = [HERE / "emulate.cpp", HERE / "flash_attn_kernel.cuh", HERE / "flash_attn.h"]
_DTYPE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # btlib_cuda::DType


def cuda_include_dir() -> Path | None:
    """The CUDA toolkit's include/ (for cuda_fp16.h): $CUDA_HOME, $CUDA_PATH, nvcc's toolkit, /usr/local/cuda."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(os.path.realpath(nvcc)).parents[1]))
        try:  # a wrapper script (e.g. /usr/local/bin/nvcc -> exec .../cuda-13.0/bin/nvcc) hides the toolkit
            text = Path(nvcc).read_text(errors="ignore")[:500]
            roots += [str(Path(tok).parents[1]) for tok in text.split() if tok.endswith("/bin/nvcc")]
        except OSError:
            pass
    roots.append("/usr/local/cuda")
    for root in filter(None, roots):
        inc = Path(root) / "include"
        if (inc / "cuda_fp16.h").exists():
            return inc
    return None


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def _toolchain() -> str | None:
    if shutil.which(_compiler()) is None:
        return f"no C++ compiler: {_compiler()!r} is not on PATH"
    if cuda_include_dir() is None:
        return "no CUDA headers (cuda_fp16.h): install the CUDA toolkit or set CUDA_HOME"
    return None


NAME = "btlib_cuda_emulator"
_ext = Extension("CUDA kernel emulator", "the emulated rows skip; a CUDA GPU runs the kernel itself.", _toolchain, about_s=2)


def available() -> str | None:
    """None if the emulator can be built here (or is built), else why not (its failed build's first errors included).
    Never compiles."""
    return _ext.available(NAME)


def _make() -> ctypes.CDLL:
    out = build_directory(NAME) / f"{NAME}.so"
    if needs_build(NAME, SOURCES):
        cmd = [_compiler(), "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", f"-I{cuda_include_dir()}",
               str(HERE / "emulate.cpp"), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)}\n{done.stderr}")
    lib = ctypes.CDLL(str(out))
    lib.btlib_emulate_flash_forward.restype = ctypes.c_int
    return lib


def load() -> ctypes.CDLL:
    """Build (once, ~2 s) or load the emulator library; a failed build is remembered (no compile per call after it)."""
    return _ext.build(NAME, _make, detail="g++, no GPU", depends=SOURCES)


def _run(q, k, v, o, lengths, cu_seqlens, strides, B, H, Tq, Tk, causal, scale, window, bias=None) -> Tensor:
    if q.device.type != "cpu" or q.dtype not in _DTYPE:
        raise TypeError(f"the emulator takes CPU float32/float16/bfloat16 tensors; got {q.dtype} on {q.device}")
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    # as the binding: -1 = no limit, and a reach past every key is none (keeps the int sums in range)
    left, right = (-1 if w >= max(Tq, Tk) else w for w in window_reach(window))
    bias_values, bias_kind, bias_R = kernel_args(check_position_bias(bias, H, q.device))
    st = (ctypes.c_int64 * 12)(*strides)
    ptr = lambda t: ctypes.c_void_p(t.data_ptr() if t is not None else 0)  # noqa: E731
    rc = load().btlib_emulate_flash_forward(
        ptr(q), ptr(k), ptr(v), ptr(o), ptr(lengths), ptr(cu_seqlens), st, B, H, Tq, Tk, D, int(causal),
        ctypes.c_float(scale * LOG2E), _DTYPE[q.dtype], left, right, ptr(bias_values), bias_kind, bias_R)
    if rc:
        raise ValueError(f"the emulated kernel refused the inputs (code {rc}): head_dim must be in [1, 128], "
                         "bias_kind 0, 1 or 2 with bias values exactly when it is not 0")
    return o


def emulated_attention(q: Tensor, k: Tensor, v: Tensor, *, lengths: Tensor | None = None, causal: bool = False,
                       scale: float | None = None, window: tuple[int, int] | None = None,
                       bias: PositionBias | None = None) -> Tensor:
    """The CUDA kernel on a padded batch, on CPU threads. q: (B, H, T, D); k, v: (B, H, S, D) -> (B, H, T, D)."""
    q, k, v = (x.contiguous() for x in (q, k, v))
    B, H, Tq, _ = q.shape
    o = torch.empty_like(q)
    L = None if lengths is None else lengths.to(torch.int32).contiguous()
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3])
    return _run(q, k, v, o, L, None, strides, B, H, Tq, k.shape[2], causal, scale, window, bias)


def emulated_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, causal: bool = False,
                              scale: float | None = None, window: tuple[int, int] | None = None,
                              bias: PositionBias | None = None) -> Tensor:
    """The CUDA kernel on packed tokens, on CPU threads. q, k, v: (total, H, D); cu_seqlens (B + 1,) int32."""
    q, k, v = (x.contiguous() for x in (q, k, v))
    o = torch.empty_like(q)
    cu = cu_seqlens.to(torch.int32).contiguous()
    strides = tuple(s for x in (q, k, v, o) for s in (0, x.stride(1), x.stride(0)))  # batch stride 0: rows via cu_seqlens
    return _run(q, k, v, o, None, cu, strides, cu.numel() - 1, q.shape[1], int(max_seqlen), int(max_seqlen), causal, scale,
                window, bias)
