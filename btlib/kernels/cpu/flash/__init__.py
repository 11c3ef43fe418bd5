"""btlib's FlashAttention on the CPU (v3, varlen, AMX): the kernel family, its Python op and its registry entries.

The C++, in this folder (one hop from here):
    flash.cpp        the torch binding of the ops attention_v3, varlen_v3, varlen_amx (checks: ../binding.h)
    flash.h          v3: one task per (sequence, head, query block): flash_block, online_softmax_row
    flash_tiles.h    the fp32 micro-kernels: qk_tile (S = Q K^T in registers), pv_tile (O = diag(alpha) O + P V)
    flash_bf16dot.h  the same on vdpbf16ps (AVX512_BF16): qk_tile_bf16, pv_tile_bf16
    flash_amx.h      both products on AMX tiles (op varlen_amx)
shared with the teaching versions: ../core.h (Problem, Br, Bc, key_lo / key_hi) and ../vec.h (vexp2 and the vector
type of each ISA). Which ISA body runs is this folder's choice (the build, ../build.py; the micro-kernel, flash.h's
PathFor); which kernel "auto" takes is the registry's (registry.PRIORITY and what btlib.kernels.choice measures).
Each op's schema: ../schema.py. Its check: btlib.kernels.check (the registry entry's reference, by default
btlib.reference_attention / reference_varlen_attention); its benchmarks: attention_dense_bf16 (bench.py, in this folder), and
attention_dense, attention_varlen beside the other kernels (btlib/bench/attention.py).
"""

import torch

from ...registry import Kernel, register
from .. import build
from ..ops import entry, wrapper

__all__ = ["attention_v3", "varlen_attention_v3", "varlen_attention_amx"]

attention_v3 = wrapper("attention_v3", "attention_v3")
varlen_attention_v3 = wrapper("varlen_v3", "varlen_attention_v3")
varlen_attention_amx = wrapper("varlen_amx", "varlen_attention_amx")

register(Kernel("cpu_flash_v3", "padded", attention_v3, **entry("attention_v3"),
                description="C++ v3: one-pass online softmax, SIMD micro-kernels, threads over (b, h, block); "
                            "a window skips the key tiles outside it"))
register(Kernel("cpu_flash_varlen", "varlen", varlen_attention_v3, **entry("varlen_v3"),
                description="C++ v3 on packed tokens + cu_seqlens: no work on padding (nor outside a window)"))
register(Kernel("cpu_amx_varlen", "varlen", varlen_attention_amx,
                **{**entry("varlen_amx"), "dtypes": (torch.bfloat16,), "available": build.amx_available},  # fp32: bf16's error
                description="C++ v3 on packed tokens with Q K^T and P V on AMX tiles (bf16; Intel Xeon since Sapphire Rapids)"))
