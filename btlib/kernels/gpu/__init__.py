"""btlib's GPU attention kernels: Triton (flash_attn.py) and CUDA C++ (flash_attn.cu + binding.cpp).

Importing this package registers the kernels (``triton_flash``, ``triton_flash_varlen``,
``cuda_flash``, ``cuda_flash_varlen``) and imports neither triton nor the CUDA toolchain:
the Triton kernel compiles on its first call on a CUDA tensor, the CUDA extension builds on its
first call (build.py). Without a GPU: the Triton kernel runs in Triton's interpreter
(TRITON_INTERPRET=1, flash_attn.py), the CUDA kernel's source runs on CPU threads (emulate.py),
and both compile for sm_75 / sm_80 / sm_90 (targets.py, build.nvcc_compile).
"""

from . import build
from .ops import (
    DTYPES,
    MAX_HEAD_DIM,
    cuda_attention,
    cuda_available,
    cuda_varlen_attention,
    triton_attention,
    triton_available,
    triton_varlen_attention,
)

__all__ = ["build", "DTYPES", "MAX_HEAD_DIM", "triton_attention", "triton_varlen_attention", "cuda_attention",
           "cuda_varlen_attention", "triton_available", "cuda_available"]
