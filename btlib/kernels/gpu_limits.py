"""What btlib's two GPU kernels (triton/ and cuda/) share, in one place.

MAX_HEAD_DIM: Triton rounds D up to BLOCK_D (a power of two) and a 128-wide fp32 tile set is
what a T4's 64 KiB of shared memory holds; the CUDA kernel's largest head-dim bucket (flash_attn.h
kMaxHeadDim) matches. LOG2E: both kernels compute exp(x) as exp2(x * log2 e), with log2 e folded
into the softmax scale, so each score costs one multiply-add and one exp2.
"""

import torch

MAX_HEAD_DIM = 128
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634

