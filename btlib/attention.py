"""btlib's public attention entry points: one call, any registered kernel.

    attention(q, k, v, lengths=..., causal=..., window=..., bias=..., backend="auto")              (B, H, T, D)
    varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal=..., window=..., bias=..., backend=)   (total, H, D)

``window=(left, right)`` is local (sliding-window) attention: query i attends keys
i - left <= j <= i + right of its own sequence (ModernBERT's local layers: (64, 64)), combined
with causal and the padding. Kernels that support it skip the key tiles outside the band, so the
cost is 4 H D sum_i L_i min(L_i, left + right + 1) flops instead of 4 H D sum_i L_i^2.

``backend="auto"`` takes, among the registered kernels that accept the inputs (device, dtype, head_dim,
causal, window, bias), the one measured fastest on this machine for the layout, dtype and length
(CPU fp32 / bf16: btlib.kernels.choice times them once and caches the table; ``choice.explain`` says
why), else the highest priority; a name forces one kernel and explains why it cannot run.

``bias=PositionBias.alibi(slopes)`` or ``PositionBias.table(values, max_distance)`` (btlib/position_bias.py)
adds a per-head bias(j - i) to the scaled scores: ALiBi (JinaBERT) or T5 / MPNet relative-position buckets
(``relative_bucket_table``). The C++, Triton and CUDA kernels compute it per score from the positions
within each sequence; PyTorch's SDPA kernels get it as a float mask; the nested one refuses it.
When autograd will need a backward (grad mode on and q, k or v requires grad) only
differentiable kernels qualify: "auto" falls back to PyTorch's SDPA, a named compiled kernel
raises rather than return an output detached from its inputs.
"""

from __future__ import annotations

from torch import Tensor

from .checks import check_padded_inputs, check_varlen_inputs, check_window
from .kernels import registry
from .position_bias import PositionBias, check_position_bias

__all__ = ["attention", "varlen_attention"]


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    lengths: Tensor | None = None,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    scale: float | None = None,
    bias: PositionBias | None = None,
    backend: str = "auto",
) -> Tensor:
    """Fused scaled dot-product attention on a padded batch.

    Args:
        q, k, v: (B, H, T, D), one float dtype and device.
        lengths: (B,) integer on q's device, real tokens per sequence; None means all T.
        causal: query i attends keys j <= i.
        window: (left, right) ints >= 0: query i attends only keys i - left <= j <= i + right; None: global.
        scale: defaults to 1 / sqrt(D).
        bias: a btlib.PositionBias with H heads on q's device, or None: scores += bias(h, j - i), query row i
            and key row j counted from 0 in each sequence.
        backend: "auto" or a kernel name from ``btlib.kernels.kernels("padded")``.

    Returns:
        (B, H, T, D) in q's dtype; rows t >= lengths[b] are 0.
    """
    check_padded_inputs(q, k, v, lengths)
    window = check_window(window)
    bias = check_position_bias(bias, q.shape[1], q.device)
    kernel = registry.select("padded", q, causal, backend, needs_grad=_needs_grad(q, k, v, bias), window=window, bias=bias,
                             seqlen=q.shape[2])
    return kernel.fn(q, k, v, lengths=lengths, causal=causal, scale=scale, **registry.window_kwargs(kernel, window),
                     **registry.bias_kwargs(kernel, bias))


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    scale: float | None = None,
    bias: PositionBias | None = None,
    backend: str = "auto",
) -> Tensor:
    """Attention on packed tokens: each sequence attends only to itself; no work on padding.

    Args:
        q, k, v: (total, H, D), total = cu_seqlens[-1].
        cu_seqlens: (B + 1,) int32 on q's device, e.g. [0, 2, 6, 9] for lengths [2, 4, 3].
        max_seqlen: >= the longest sequence. GPU kernels size their grid by it (reading the lengths
            from the device would sync); the CPU kernels read cu_seqlens directly and only check it.
        causal, window, scale, bias, backend: as in :func:`attention` (kernels from ``kernels("varlen")``);
            window and bias positions count within each sequence, so packing does not change them.

    Returns:
        (total, H, D) in q's dtype.
    """
    check_varlen_inputs(q, k, v, cu_seqlens, max_seqlen)
    window = check_window(window)
    bias = check_position_bias(bias, q.shape[1], q.device)
    kernel = registry.select("varlen", q, causal, backend, needs_grad=_needs_grad(q, k, v, bias), window=window, bias=bias,
                             seqlen=int(max_seqlen))
    return kernel.fn(q, k, v, cu_seqlens, int(max_seqlen), causal=causal, scale=scale,
                     **registry.window_kwargs(kernel, window), **registry.bias_kwargs(kernel, bias))


def _needs_grad(q: Tensor, k: Tensor, v: Tensor, bias: PositionBias | None) -> bool:
    """Autograd will need a backward: for q, k, v, or for bias values that require grad (a trained table)."""
    return registry.needs_grad(q, k, v, *(() if bias is None else (bias.values,)))
