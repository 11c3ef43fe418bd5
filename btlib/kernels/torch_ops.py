"""PyTorch's own attention, registered as kernels so tests and benchmarks treat it like btlib's.

- reference / reference_varlen: the naive oracle (materialises the T x T scores).
- torch_sdpa: F.scaled_dot_product_attention with a boolean mask built from lengths. On CPU it
  dispatches to the flash CPU kernel, which still computes every padded key and query: B*T^2.
  A local window is one more term of that explicit (B, 1, T, S) mask, and SDPA still computes
  every masked score: B*T^2 however narrow the window (the cost btlib's windowed kernels avoid).
- torch_sdpa_loop: one SDPA call per sequence of the packed tokens: sum(L^2) work plus one
  Python-level call per sequence (on CPU the fastest of PyTorch's options once padding is
  large: notebook 06 measures it against torch_sdpa and torch_sdpa_nested). With a window, each
  call gets the (L, L) band mask: still sum(L^2).
- torch_sdpa_nested: SDPA on a torch.nested jagged tensor (no causal, no window; math path on CPU).

All are PyTorch ops, so autograd differentiates them (``differentiable=True``): they are what
``backend="auto"`` falls back to when the inputs require grad.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..nested import packed_to_nested, quiet_jagged
from ..reference import allowed_mask, reference_attention, reference_varlen_attention
from .registry import Kernel, register

_ALL_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _real(lengths: Tensor, T: int) -> Tensor:
    """(B, 1, T, 1) bool, True at real tokens, to broadcast over (B, H, T, D)."""
    return (torch.arange(T, device=lengths.device).view(1, T) < lengths.view(-1, 1)).view(-1, 1, T, 1)


def reference(q: Tensor, k: Tensor, v: Tensor, *, lengths=None, causal=False, scale=None, window=None) -> Tensor:
    return reference_attention(q, k, v, lengths=lengths, causal=causal, window=window, scale=scale).to(q.dtype)


def torch_sdpa(q: Tensor, k: Tensor, v: Tensor, *, lengths=None, causal=False, scale=None, window=None) -> Tensor:
    B, _, T, _ = q.shape
    if lengths is None:
        if window is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        mask = allowed_mask(B, T, k.shape[2], causal=causal, window=window, device=q.device)  # (1, 1, T, S) band
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    # Padding must not matter, whatever it holds: SDPA adds its -inf mask to the scores (NaN + -inf
    # is NaN) and multiplies V by probabilities (0 * NaN is NaN), so NaN or inf in a padded key or
    # value would reach real rows. torch.where (not a multiply) replaces padding by 0; it also
    # keeps the backward of padded rows free of NaN. One pass over q, k, v each.
    zero = q.new_zeros(())
    q = torch.where(_real(lengths, T), q, zero)
    real_k = _real(lengths, k.shape[2])
    k, v = torch.where(real_k, k, zero), torch.where(real_k, v, zero)
    mask = allowed_mask(B, T, k.shape[2], lengths=lengths, causal=causal, window=window, device=q.device)  # (B, 1, T|1, S)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return torch.where(_real(lengths, T), out, zero)  # padded query rows: exactly 0


def reference_varlen(q, k, v, cu_seqlens, max_seqlen, *, causal=False, scale=None, window=None) -> Tensor:
    return reference_varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal=causal, window=window, scale=scale).to(q.dtype)


def torch_sdpa_loop(q, k, v, cu_seqlens, max_seqlen, *, causal=False, scale=None, window=None) -> Tensor:
    outs = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))  # (H, L, D)
            if window is None:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)
            else:
                L = end - start
                mask = allowed_mask(1, L, L, causal=causal, window=window, device=q.device)[0]  # (1, L, L) band
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
            outs.append(o.transpose(0, 1))
    # torch.cat, not writes into an empty buffer: autograd follows it, and no token is left unwritten.
    return torch.cat(outs) if outs else q.clone()


def torch_sdpa_nested(q, k, v, cu_seqlens, max_seqlen, *, causal=False, scale=None) -> Tensor:
    if q.shape[0] == 0:  # no tokens: PyTorch's jagged SDPA cannot pad an all-empty batch
        return q.clone()
    # A jagged tensor's values must be contiguous; q, k, v may be strided views of one QKV projection.
    # Jagged tensors cannot be built from inference tensors inside inference_mode (torch 2.13 raises
    # "Cannot set version_counter"); outside it, under no_grad, they can, and nothing is recorded.
    inference = torch.is_inference_mode_enabled()
    with torch.inference_mode(False), torch.set_grad_enabled(torch.is_grad_enabled() and not inference):
        qn, kn, vn = (packed_to_nested(x.contiguous(), cu_seqlens).transpose(1, 2) for x in (q, k, v))  # (B, H, j, D)
        with quiet_jagged():
            out = F.scaled_dot_product_attention(qn, kn, vn, scale=scale)
            return out.transpose(1, 2).values()


register(Kernel("reference", "padded", reference, "torch", ("cpu", "cuda"), _ALL_FLOATS,
                "naive matmul-softmax-matmul, the oracle (T x T scores in memory)", priority=-100, differentiable=True,
                window=True))
register(Kernel("torch_sdpa", "padded", torch_sdpa, "torch", ("cpu", "cuda"), _ALL_FLOATS,
                "F.scaled_dot_product_attention with a boolean key-padding mask (and window band)", priority=0,
                differentiable=True, window=True))
register(Kernel("reference_varlen", "varlen", reference_varlen, "torch", ("cpu", "cuda"), _ALL_FLOATS,
                "repad, naive attention, unpad: the varlen oracle", priority=-100, differentiable=True, window=True))
register(Kernel("torch_sdpa_loop", "varlen", torch_sdpa_loop, "torch", ("cpu", "cuda"), _ALL_FLOATS,
                "one F.scaled_dot_product_attention call per sequence (window: a band mask each)", priority=0,
                differentiable=True, window=True))
register(Kernel("torch_sdpa_nested", "varlen", torch_sdpa_nested, "torch", ("cpu", "cuda"), _ALL_FLOATS,
                "F.scaled_dot_product_attention on a torch.nested jagged tensor", priority=-10, causal=False, differentiable=True))
