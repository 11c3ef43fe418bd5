"""btlib's teaching versions of CPU attention, v1 and v2 (notebook 04): plain loops, slow on purpose.

The C++, in this folder (one hop from here):
    teaching.cpp   the torch binding of the ops attention_v1, attention_v2 (checks: ../binding.h)
    teaching.h     attention_v1 (materialise S = Q K^T, softmax, P V) and attention_v2 (Br x Bc tiles, two passes over K)
shared with flash/: ../core.h (Problem, Br, Bc). Each op's schema: ../schema.py. Its check: btlib.kernels.check against
btlib.reference_attention; its benchmark: cpu_attention_versions (bench.py, in this folder).
"""

from ...registry import Kernel, register
from ..ops import entry, wrapper

__all__ = ["attention_v1", "attention_v2"]

attention_v1 = wrapper("attention_v1", "attention_v1")
attention_v2 = wrapper("attention_v2", "attention_v2")

register(Kernel("cpu_naive_v1", "padded", attention_v1, **entry("attention_v1"),
                description="C++ v1: materialise S = QK^T, softmax, PV (plain loops)"))
register(Kernel("cpu_tiled_v2", "padded", attention_v2, **entry("attention_v2"),
                description="C++ v2: key/value tiles, two passes over K (plain loops)"))
