"""btlib's C++ CPU attention kernels, one folder per family: teaching/ (v1 materialise, v2 tiled) and flash/
(v3 flash, varlen, AMX), each with its C++ source, its Python op and its registry entries.

Importing this package registers the kernels; nothing is compiled until the first call (see build.py). Shared
here: schema.py (each op declared once), ops.py (the wrapper and registry fields derived from it), build.py (one
library per ISA from every family's .cpp), the torch-free headers core.h and vec.h, binding.h (the torch-side
checks), source.py (prints a named function of a named file, for the notebooks); core_check.cpp tests the
headers alone.
"""

from . import build
from .flash import attention_v3, varlen_attention_v3
from .ops import MAX_HEAD_DIM
from .teaching import attention_v1, attention_v2

__all__ = ["build", "MAX_HEAD_DIM", "attention_v1", "attention_v2", "attention_v3", "varlen_attention_v3"]
