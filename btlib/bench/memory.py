"""Peak tensor memory of one call: CUDA's allocator statistics on a GPU, the profiler on a CPU.

On CPU there is no resettable allocator counter, so :func:`peak_memory` runs the call under
torch.profiler with profile_memory=True and replays what it recorded in time order: each
operator's own allocations (self_cpu_memory_usage) and each free ("[memory]" events, negative).
The running sum's maximum is the peak of tensor bytes allocated *during* the call, above what
was already held before it (inputs are not counted).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["peak_memory"]


def peak_memory(fn: Callable[[], Any], device: str = "cpu") -> int:
    """Peak bytes of tensors allocated while ``fn()`` runs, above the memory held before the call."""
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from .._profiler import quiet_profile

    with quiet_profile(profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    current = peak = 0
    for e in events:
        current += e.self_cpu_memory_usage
        peak = max(peak, current)
    return peak
