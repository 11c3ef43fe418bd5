"""btlib's Triton attention kernel (flash_attn.py): one source for padded and packed (varlen) batches.

Importing this package registers ``triton_flash`` and ``triton_flash_varlen`` and does not import
triton: the kernel compiles on its first call on a CUDA tensor. Without a GPU it runs in Triton's
interpreter (TRITON_INTERPRET=1, flash_attn.py) and compiles for sm_75 / sm_80 / sm_90 anyway
(``python -m btlib.kernels.triton.targets``). Without triton (no wheel off Linux x86_64) the
source still imports, with stand-ins (_no_triton.py).
"""

from .ops import triton_attention, triton_available, triton_varlen_attention

__all__ = ["triton_attention", "triton_varlen_attention", "triton_available"]
