"""Peak tensor memory of one call: CUDA's allocator statistics on a GPU, the profiler on a CPU.

On CPU there is no resettable allocator counter, so :func:`peak_memory` runs the call under
torch.profiler with profile_memory=True, which records every allocation and free as a signed,
time-stamped "[memory]" event, and replays them in time order. The running sum's maximum is
the peak of tensor bytes allocated *during* the call, above what was already held before it
(inputs are not counted). Per-operator totals would miss temporaries allocated and freed
inside one composite operator (SDPA's math backend holds its scores that way).
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
    from ..observe import quiet_profile

    with quiet_profile(profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak
