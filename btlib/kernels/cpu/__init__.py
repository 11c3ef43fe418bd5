"""btlib's C++ CPU attention kernels: v1 (materialise), v2 (tiled), v3 (flash), varlen.

Importing this package registers the kernels; nothing is compiled until the first call
(see build.py). Source: attention.cpp (torch binding) and the torch-free kernel headers
(core.h, vec.h, teaching.h, flash*.h) in this folder; core_check.cpp tests the headers alone.
"""

from . import build
from .ops import MAX_HEAD_DIM, attention_v1, attention_v2, attention_v3, varlen_attention_v3

__all__ = ["build", "MAX_HEAD_DIM", "attention_v1", "attention_v2", "attention_v3", "varlen_attention_v3"]
