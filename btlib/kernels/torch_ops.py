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
- torch_sdpa_nested: SDPA on a torch.nested jagged tensor (no causal, no window, no position bias;
  math path on CPU).

A position bias (btlib.PositionBias) reaches the reference and SDPA as what it is to them, a float
(H, T, S) tensor added to the scores (``bias.dense``, 4 H T S bytes; for torch_sdpa_loop one (H, L, L)
per sequence), -inf where the boolean mask forbids. SDPA wants the float mask in q's dtype, so in
fp16 / bf16 the bias is rounded there (|bias| 50 moves by up to 0.1 in bf16): these are baselines,
the fused kernels add it in fp32. torch_sdpa_nested cannot take a per-sequence mask and refuses it.

All are PyTorch ops, so autograd differentiates them (``differentiable=True``): they are what
``backend="auto"`` falls back to when the inputs require grad (and for fp64, fp16, head_dim > 256).
torch_sdpa and torch_sdpa_loop call SDPA through :func:`_sdpa`, which holds SDPA to the reference's NaN
policy where SDPA alone departs from it (a NaN query row, a NaN key under a band mask).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..nested import packed_to_nested, quiet_jagged
from ..reference import allowed_mask, reference_attention, reference_varlen_attention
from .registry import Kernel, register

_ALL_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _real(lengths: Tensor, T: int) -> Tensor:
    """(B, 1, T, 1) bool, True at real tokens, to broadcast over (B, H, T, D)."""
    return (torch.arange(T, device=lengths.device).view(1, T) < lengths.view(-1, 1)).view(-1, 1, T, 1)


def _maybe_nonfinite(x: Tensor) -> bool:
    """False when x surely holds no NaN or inf: its sum is finite. One reduction, about 1% of SDPA's own time on
    the same q; a per-row isnan(q).any(-1) cost over half of SDPA's time.
    A sum that overflows (fp16) reads True: the exact check runs then."""
    return not bool(x.detach().sum().isfinite())


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float | None,
          band: bool, bias: Tensor | None = None) -> Tensor:
    """F.scaled_dot_product_attention with btlib.reference_attention's NaN policy.

    q: (..., T, D); k, v: (..., S, D); mask: bool broadcastable to (..., T, S), True = may attend, holding
    the causal band and window if any; None: no mask (``causal`` is then SDPA's is_causal);
    band: a causal band or a window hides real keys, and k may hold NaN or inf (False: k is known finite,
    or every real key is attended). bias: float (H, T, S) added to the allowed scores (a position bias
    materialised), or None. Two departures of SDPA alone, both fixed here:
    - a query row holding NaN comes out as 0 from SDPA's CPU flash kernel (taken without a mask: every
      score of the row is NaN and it reads the row as fully masked); the reference gives NaN, as does
      every btlib kernel. Cost on clean inputs: one sum of q (on the CPU; elsewhere, to avoid a host
      sync, a per-row isnan of q and a select over the output).
    - SDPA adds its -inf mask to the scores (so does its math path for is_causal), and NaN + -inf is NaN:
      a NaN (or inf) key reaches every row of its sequence, also the rows a causal band or a window keeps
      from it. With ``band``, k is checked (one sum, one host sync); only if a key is non-finite, a second
      SDPA with those keys zeroed gives the rows that attend none of them (twice the work, on such inputs only).
    """
    nan_rows_possible = q.device.type != "cpu" or _maybe_nonfinite(q)
    if bias is not None and mask is None and causal:  # SDPA takes is_causal or a mask, not both
        mask = allowed_mask(1, q.shape[-2], k.shape[-2], causal=True, device=q.device)[0, 0]  # (T, S)

    def masked(m: Tensor | None) -> Tensor | None:  # the float mask: bias where m allows, -inf elsewhere
        if bias is None:
            return m
        b = bias.to(q.dtype)
        return b if m is None else torch.where(m, b, float("-inf"))

    out = F.scaled_dot_product_attention(q, k, v, attn_mask=masked(mask), is_causal=causal and mask is None, scale=scale)
    if band and _maybe_nonfinite(k):
        bad = ~torch.isfinite(k).all(-1)  # (..., S): keys whose scores are non-finite
        if bool(bad.any()):
            if mask is None:
                mask = allowed_mask(1, q.shape[-2], k.shape[-2], causal=True, device=q.device)[0, 0]  # (T, S)
            clean = F.scaled_dot_product_attention(q, torch.where(bad.unsqueeze(-1), 0.0, k), v, attn_mask=masked(mask),
                                                   scale=scale)
            hits = (mask & bad.unsqueeze(-2)).any(-1, keepdim=True)  # (..., T, 1): rows attending a bad key
            out = torch.where(hits, out, clean)
    if not nan_rows_possible:
        return out
    has_key = mask.any(-1, keepdim=True) if mask is not None else k.shape[-2] > 0  # a row with no key stays 0
    return torch.where(q.isnan().any(-1, keepdim=True) & has_key, out.new_full((), float("nan")), out)


def reference(q: Tensor, k: Tensor, v: Tensor, *, lengths=None, causal=False, scale=None, window=None, bias=None) -> Tensor:
    return reference_attention(q, k, v, lengths=lengths, causal=causal, window=window, scale=scale, bias=bias).to(q.dtype)


def torch_sdpa(q: Tensor, k: Tensor, v: Tensor, *, lengths=None, causal=False, scale=None, window=None, bias=None) -> Tensor:
    B, _, T, _ = q.shape
    dense = None if bias is None else bias.dense(T, k.shape[2])  # (H, T, S)
    if lengths is None:
        if window is None:
            return _sdpa(q, k, v, None, causal, scale, band=causal, bias=dense)
        mask = allowed_mask(B, T, k.shape[2], causal=causal, window=window, device=q.device)  # (1, 1, T, S) band
        return _sdpa(q, k, v, mask, causal, scale, band=True, bias=dense)
    # Padding must not matter, whatever it holds: SDPA adds its -inf mask to the scores (NaN + -inf
    # is NaN) and multiplies V by probabilities (0 * NaN is NaN), so NaN or inf in a padded key or
    # value would reach real rows. torch.where (not a multiply) replaces padding by 0; it also
    # keeps the backward of padded rows free of NaN. One pass over q, k, v each.
    zero = q.new_zeros(())
    q = torch.where(_real(lengths, T), q, zero)
    real_k = _real(lengths, k.shape[2])
    k, v = torch.where(real_k, k, zero), torch.where(real_k, v, zero)
    mask = allowed_mask(B, T, k.shape[2], lengths=lengths, causal=causal, window=window, device=q.device)  # (B, 1, T|1, S)
    out = _sdpa(q, k, v, mask, causal, scale, band=causal or window is not None, bias=dense)
    return torch.where(_real(lengths, T), out, zero)  # padded query rows: exactly 0


def reference_varlen(q, k, v, cu_seqlens, max_seqlen, *, causal=False, scale=None, window=None, bias=None) -> Tensor:
    return reference_varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal=causal, window=window, scale=scale,
                                      bias=bias).to(q.dtype)


def torch_sdpa_loop(q, k, v, cu_seqlens, max_seqlen, *, causal=False, scale=None, window=None, bias=None) -> Tensor:
    outs = []
    bounds = cu_seqlens.tolist()
    # one finiteness check of all keys, not one host sync per sequence (_sdpa checks each sequence only if it fails)
    bad_keys = _maybe_nonfinite(k)
    band = (causal or window is not None) and bad_keys
    # SDPA's CPU flash kernel reads a row whose every score is NaN (its only keys NaN) as fully masked and returns 0
    # where the reference returns NaN; with a non-finite key anywhere the loop runs SDPA's math path, which propagates it
    with sdpa_kernel(SDPBackend.MATH) if bad_keys and q.device.type == "cpu" else contextlib.nullcontext():
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end > start:
                # (1, H, L, D): a batch of one. SDPA takes its flash kernel on the CPU for 4-D inputs only; given the
                # (H, L, D) view it ran the math path (scores materialised), 2.6x slower on 8 lengths 20-1000, H 12,
                # D 64, 2 threads (AMD EPYC Zen 4), which made every kernel compared with this loop look that much better
                qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
                L = end - start
                dense = None if bias is None else bias.dense(L)  # (H, L, L): positions from the sequence's start
                if window is None:
                    o = _sdpa(qs, ks, vs, None, causal, scale, band=band, bias=dense)
                else:
                    mask = allowed_mask(1, L, L, causal=causal, window=window, device=q.device)  # (1, 1, L, L) band
                    o = _sdpa(qs, ks, vs, mask, causal, scale, band=band, bias=dense)
                outs.append(o[0].transpose(0, 1))  # (L, H, D)
    # torch.cat, not writes into an empty buffer: autograd follows it, and no token is left unwritten.
    return torch.cat(outs) if outs else q.clone()


def torch_sdpa_nested(q, k, v, cu_seqlens, max_seqlen, *, causal=False, scale=None) -> Tensor:
    if q.shape[0] == 0:  # no tokens: PyTorch's jagged SDPA cannot pad an all-empty batch
        return q.clone()
    # A jagged tensor's values must be contiguous; q, k, v may be strided views of one QKV projection.
    # Jagged tensors cannot be built inside inference_mode, nor from inference tensors (made inside it)
    # anywhere (torch 2.13 raises "Cannot set version_counter"); outside it, under no_grad, from a
    # normal tensor, they can, and nothing is recorded. An inference tensor is copied once (clone) first.
    inference = torch.is_inference_mode_enabled()
    with torch.inference_mode(False), torch.set_grad_enabled(torch.is_grad_enabled() and not inference):
        qn, kn, vn = (packed_to_nested(x.clone() if x.is_inference() else x.contiguous(), cu_seqlens).transpose(1, 2)
                      for x in (q, k, v))  # (B, H, j, D)
        with quiet_jagged():
            out = F.scaled_dot_product_attention(qn, kn, vn, scale=scale)
            return out.transpose(1, 2).values()


register(Kernel("reference", "padded", reference, "torch", ("cpu", "cuda"), _ALL_FLOATS,
                "naive matmul-softmax-matmul, the oracle (T x T scores in memory)", differentiable=True,
                window=True, bias=True))
register(Kernel("torch_sdpa", "padded", torch_sdpa, "torch", ("cpu", "cuda"), _ALL_FLOATS,
                "F.scaled_dot_product_attention with a boolean key-padding mask (and window band, position bias)",
                differentiable=True, window=True, bias=True))
register(Kernel("reference_varlen", "varlen", reference_varlen, "torch", ("cpu", "cuda"), _ALL_FLOATS,
                "repad, naive attention, unpad: the varlen oracle", differentiable=True, window=True, bias=True))
register(Kernel("torch_sdpa_loop", "varlen", torch_sdpa_loop, "torch", ("cpu", "cuda"), _ALL_FLOATS,
                "one F.scaled_dot_product_attention call per sequence (window: a band mask each; bias: a float mask)",
                differentiable=True, window=True, bias=True))
register(Kernel("torch_sdpa_nested", "varlen", torch_sdpa_nested, "torch", ("cpu", "cuda"), _ALL_FLOATS,
                "F.scaled_dot_product_attention on a torch.nested jagged tensor", causal=False, differentiable=True))
