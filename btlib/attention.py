"""btlib's public attention entry points: one call, any registered kernel.

    attention(q, k, v, lengths=..., causal=..., backend="auto")              (B, H, T, D)
    varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal=..., backend=)   (total, H, D)

``backend="auto"`` takes the highest-priority registered kernel that accepts the inputs
(device, dtype, head_dim, causal); a name forces one kernel and explains why it cannot run.
When autograd will need a backward (grad mode on and q, k or v requires grad) only
differentiable kernels qualify: "auto" falls back to PyTorch's SDPA, a named compiled kernel
raises rather than return an output detached from its inputs.
"""

from __future__ import annotations

from torch import Tensor

from .checks import check_padded_inputs, check_varlen_inputs
from .kernels import registry

__all__ = ["attention", "varlen_attention"]


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    lengths: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """Fused scaled dot-product attention on a padded batch.

    Args:
        q, k, v: (B, H, T, D), one float dtype and device.
        lengths: (B,) integer on q's device, real tokens per sequence; None means all T.
        causal: query i attends keys j <= i.
        scale: defaults to 1 / sqrt(D).
        backend: "auto" or a kernel name from ``btlib.kernels.kernels("padded")``.

    Returns:
        (B, H, T, D) in q's dtype; rows t >= lengths[b] are 0.
    """
    check_padded_inputs(q, k, v, lengths)
    kernel = registry.select("padded", q, causal, backend, needs_grad=registry.needs_grad(q, k, v))
    return kernel.fn(q, k, v, lengths=lengths, causal=causal, scale=scale)


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """Attention on packed tokens: each sequence attends only to itself; no work on padding.

    Args:
        q, k, v: (total, H, D), total = cu_seqlens[-1].
        cu_seqlens: (B + 1,) int32 on q's device, e.g. [0, 2, 6, 9] for lengths [2, 4, 3].
        max_seqlen: >= the longest sequence. GPU kernels size their grid by it (reading the lengths
            from the device would sync); the CPU kernels read cu_seqlens directly and only check it.
        causal, scale, backend: as in :func:`attention` (kernels from ``kernels("varlen")``).

    Returns:
        (total, H, D) in q's dtype.
    """
    check_varlen_inputs(q, k, v, cu_seqlens, max_seqlen)
    kernel = registry.select("varlen", q, causal, backend, needs_grad=registry.needs_grad(q, k, v))
    return kernel.fn(q, k, v, cu_seqlens, int(max_seqlen), causal=causal, scale=scale)
