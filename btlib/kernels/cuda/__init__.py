"""btlib's CUDA C++ attention kernel: flash_attn_kernel.cuh (the kernel), flash_attn.cu (launcher), binding.cpp (torch op).

Importing this package registers ``cuda_flash`` and ``cuda_flash_varlen`` and touches no CUDA
toolchain: the extension builds on its first call (build.py). Without a GPU the kernel's own
source runs on CPU threads (emulate.py), and nvcc compiles it for sm_75 / sm_80 / sm_90
(build.nvcc_compile) where the toolkit is installed.
"""

from . import build
from .ops import cuda_attention, cuda_available, cuda_varlen_attention

__all__ = ["build", "cuda_attention", "cuda_varlen_attention", "cuda_available"]
