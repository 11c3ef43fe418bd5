"""Keep freed memory in the process, so that the next batch's activations reuse it instead of faulting in new pages.

    btlib.keep_freed_memory()      # once, at start-up: None, or why it did nothing (not glibc)

Every forward allocates its activations afresh. For a large batch they are large: one (tokens, 1536) fp32
feed-forward activation of 12,000 tokens is 74 MB. glibc's malloc serves a block that large with mmap and gives
it back to the kernel on free (its adaptive mmap threshold stops at 32 MB), so the next batch's block of the same
size is fresh pages again, which the kernel zeroes and maps one 4 KiB page at a time on first touch: writing a
fresh tensor that large costs about ten times writing a reused one. Large batches gain the most (int8 most of all:
it allocates int8 copies, int32 sums and fp32 outputs); short batches hardly change.
``python -m btlib.bench run pretrained_encode`` shows what it buys here.

What it does: ``mallopt(M_MMAP_THRESHOLD, 1 GiB)`` serves blocks below 1 GiB from the heap, and
``mallopt(M_TRIM_THRESHOLD, 2 GiB)`` keeps up to 2 GiB of freed heap instead of returning it. The cost: the
process keeps its peak memory for the rest of its life (what a server wants, and what ONNX Runtime's and
OpenVINO's own arena allocators do for their tensors). It changes the allocator for the whole process, every
library in it included, so btlib never does it on import or inside encode(): call it yourself, as btlib's own
long-running programs do (``python -m btlib.serve``, ``python -m btlib.embed``, the peers benchmark). jemalloc or
tcmalloc through LD_PRELOAD reach the same end from outside the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import threading

__all__ = ["keep_freed_memory", "freed_memory_kept"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = 2**31 - 1  # 2 GiB: the largest a C int holds
_state: dict[str, object] = {}
_lock = threading.Lock()


def keep_freed_memory() -> str | None:
    """From now on, keep freed memory in this process (glibc's malloc): None once done (again: a no-op), else why it
    did nothing (another C library, e.g. macOS or musl; mallopt refused)."""
    with _lock:
        if "why" in _state:
            return _state["why"]  # type: ignore[return-value]
        why = _apply()
        _state["why"] = why
        return why


def freed_memory_kept() -> bool:
    """True after :func:`keep_freed_memory` took effect in this process."""
    return _state.get("why", "not asked") is None


def _apply() -> str | None:
    libc_name, version = platform.libc_ver()
    if libc_name != "glibc":
        return f"freed memory is kept through glibc's mallopt; this process runs on {libc_name or 'another C library'} " \
               f"({platform.system()}): preload jemalloc or tcmalloc instead"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as e:
        return f"glibc {version}: mallopt not found ({e})"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) or not mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        return f"glibc {version}: mallopt refused the thresholds"
    return None
