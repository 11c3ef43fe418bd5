"""The one plain attention reference: every kernel in btlib is checked against it.

    O = softmax(Q K^T * scale + mask) V          Q: (B, H, T, D), K, V: (B, H, S, D)

It is written from the equations with nothing fused, so it materialises the (B, H, T, S)
score matrix: 4*B*H*T*S bytes in fp32 (B=8, H=12, T=S=1024 is 400 MB). That is the cost the
fused kernels remove; here it buys obviousness.

Masks (all optional, combined with AND):
- ``lengths`` (B,) int: sequence b has ``lengths[b]`` real tokens. Keys at positions >= L are
  ignored, and query rows at positions >= L are padding: their output is 0. This is the
  padding-free convention (FlashAttention's pad/unpad, PyTorch's nested path).
- ``key_padding_mask`` (B, S) bool, True marks padding (nn.MultiheadAttention's convention).
  Masks keys only; padded query rows still attend to the real keys (as SDPA does).
- ``causal``: query i sees keys j <= i (top-left aligned, as SDPA's is_causal).
- ``window=(left, right)``: local (sliding-window) attention, query i sees keys
  i - left <= j <= i + right (ModernBERT's local layers: (64, 64)); with causal, (left, 0).
- ``attn_mask``: (T, S), (B, T, S) or (B, H, T, S); bool where True means *may attend*
  (SDPA's convention) or float, added to the scores.

A position bias (``bias=btlib.PositionBias.alibi(slopes)`` or ``.table(values, max_distance)``,
btlib/position_bias.py) is added to the scaled scores: here materialised as its (H, T, S) tensor
(``bias.dense(T, S)``), which is what every fused kernel's in-tile bias is checked against.

A query row that may attend to no key at all (a fully padded row) returns 0, and its
weights are 0: the same answer as F.scaled_dot_product_attention on torch >= 2.5.

Precision: fp16/bf16 inputs are computed in fp32 and the result is fp32 (the oracle keeps its
precision); fp32 and fp64 are computed in their own dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .checks import check_window
from .padding import INT32_MAX, check_int, cu_seqlens_to_lengths, pack, unpack
from .position_bias import PositionBias, check_position_bias

__all__ = ["reference_attention", "reference_varlen_attention", "allowed_mask", "naive_attention"]


def allowed_mask(
    B: int,
    T: int,
    S: int,
    *,
    lengths: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    attn_mask: Tensor | None = None,
    device: torch.device | str = "cpu",
) -> Tensor | None:
    """Which (query, key) pairs may attend, as one boolean tensor broadcastable to (B, H, T, S).

    ``window=(left, right)``: query i may attend keys i - left <= j <= i + right (None: all).
    Returns None when nothing is masked. Float ``attn_mask`` values are not part of it
    (they are added to the scores); ``-inf`` entries in a float mask are.

    Example: allowed_mask(1, 4, 4, window=(1, 0))[0, 0].int() -> the band
    [[1,0,0,0], [1,1,0,0], [0,1,1,0], [0,0,1,1]].
    """
    window = check_window(window)
    allowed: Tensor | None = None

    def both(a: Tensor | None, b: Tensor) -> Tensor:
        return b if a is None else a & b

    if lengths is not None:
        keys = torch.arange(S, device=device) < lengths.to(device).view(B, 1)  # (B, S)
        allowed = both(allowed, keys.view(B, 1, 1, S))
    if key_padding_mask is not None:
        allowed = both(allowed, (~key_padding_mask.to(device, torch.bool)).view(B, 1, 1, S))
    if causal or window is not None:  # one band over the key's offset j - i: causal caps it at 0
        d = torch.arange(S, device=device).view(1, S) - torch.arange(T, device=device).view(T, 1)
        band = d <= (0 if causal else window[1])
        if window is not None:
            band = band & (d >= -window[0])
        allowed = both(allowed, band.view(1, 1, T, S))
    if attn_mask is not None:
        m = attn_mask if attn_mask.dtype == torch.bool else attn_mask != float("-inf")
        while m.dim() < 4:
            m = m.unsqueeze(0 if m.dim() != 3 else 1)  # (T,S)->(1,1,T,S); (B,T,S)->(B,1,T,S)
        allowed = both(allowed, m.to(device))
    return allowed


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    lengths: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    bias: PositionBias | None = None,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Naive scaled dot-product attention, the oracle for every kernel.

    Args:
        q: (B, H, T, D) float.
        k, v: (B, H, S, D), same dtype and device as ``q``.
        lengths: (B,) integer, 0 <= lengths[b] <= min(T, S). See the module docstring.
        key_padding_mask: (B, S) bool, True = padding key (ignored).
        causal: mask keys j > i.
        window: (left, right) ints >= 0: query i attends only keys i - left <= j <= i + right; None: all.
        attn_mask: bool (True = may attend) or float (added), shape (T, S), (B, T, S) or (B, H, T, S).
        scale: defaults to 1 / sqrt(D).
        bias: a btlib.PositionBias of H heads on q's device, added after the scale: bias(h, j - i).
        return_weights: also return the attention probabilities.

    Returns:
        out: (B, H, T, D) in fp32 for fp16/bf16 inputs, else in the input dtype. Rows with
        no allowed key, and with ``lengths`` every query row t >= lengths[b], are 0.
        weights (if asked): (B, H, T, S), same dtype as ``out``.

    Example:
        >>> q = torch.randn(1, 1, 3, 4)
        >>> out = reference_attention(q, q, q, lengths=torch.tensor([2]))
        >>> out[0, 0, 2].abs().sum().item()   # query 2 is padding
        0.0
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"reference_attention expects q, k, v of shape (B, H, T, D); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}. Use btlib.varlen_attention for packed (total, H, D)."
        )
    B, H, T, D = q.shape
    S = k.shape[2]
    if k.shape != (B, H, S, D) or v.shape[:3] != (B, H, S):
        raise ValueError(f"k and v must be (B, H, S, D) matching q {tuple(q.shape)}; got {tuple(k.shape)}, {tuple(v.shape)}")
    if lengths is not None:
        if lengths.shape != (B,):
            raise ValueError(f"lengths must have shape (B,) = ({B},); got {tuple(lengths.shape)}")
        if lengths.dtype.is_floating_point:
            raise TypeError(f"lengths must be an integer tensor; got {lengths.dtype}")
        if len(lengths) and (int(lengths.min()) < 0 or int(lengths.max()) > min(T, S)):
            raise ValueError(
                f"lengths must lie in [0, {min(T, S)}] (the padded length); got min {int(lengths.min())}, "
                f"max {int(lengths.max())}. Pad the batch to the longest sequence first."
            )

    if D == 0:
        raise ValueError(f"head_dim is 0 (q has shape {tuple(q.shape)}): attention needs D >= 1, and its default "
                         "scale 1/sqrt(D) is undefined; check how the heads were split (d_model // nhead)")
    if key_padding_mask is not None and key_padding_mask.shape != (B, S):
        raise ValueError(f"key_padding_mask must be (B, S) = ({B}, {S}), True at padding; got {tuple(key_padding_mask.shape)}")

    compute = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    qc, kc, vc = (x.to(compute) for x in (q, k, v))
    # Padding must not matter, whatever it holds: a masked probability is 0, but 0 * NaN (or inf)
    # in a padded value is NaN, and so is a NaN score under the -inf mask. Padded keys, values
    # (and, with lengths, padded queries) are replaced by 0 with torch.where, not a multiply.
    # NaN or inf at real positions still propagates as in PyTorch's math: through the allowed
    # scores, and through P V also from real values a causal or attn_mask mask hides (0 * NaN).
    zero = qc.new_zeros(())
    real_q = None
    if lengths is not None:
        real_q = (torch.arange(T, device=q.device) < lengths.to(q.device).view(B, 1)).view(B, 1, T, 1)
        real_k = (torch.arange(S, device=q.device) < lengths.to(q.device).view(B, 1)).view(B, 1, S, 1)
        qc = torch.where(real_q, qc, zero)
        kc, vc = torch.where(real_k, kc, zero), torch.where(real_k, vc, zero)
    if key_padding_mask is not None:
        pad_k = key_padding_mask.to(q.device, torch.bool).view(B, 1, S, 1)
        kc, vc = torch.where(pad_k, zero, kc), torch.where(pad_k, zero, vc)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    bias = check_position_bias(bias, H, q.device)

    scores = torch.matmul(qc, kc.transpose(-2, -1)) * scale  # S = Q K^T: (B, H, T, S)
    if bias is not None:
        scores = scores + bias.dense(T, S, compute)  # (H, T, S): materialised, the reference's privilege
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        scores = scores + attn_mask.to(compute)
    allowed = allowed_mask(
        B, T, S, lengths=lengths, key_padding_mask=key_padding_mask, causal=causal, window=window,
        attn_mask=attn_mask, device=q.device,
    )
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))

    # A row the masks leave no key would be NaN after softmax; subtracting a finite max keeps it
    # -inf everywhere, exp gives 0s, and the guarded division leaves weights 0 for that row.
    # (A row that is all -inf because of inf in q or k is 0 too, as in F.scaled_dot_product_attention.)
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    weights = p / torch.where(denom > 0, denom, torch.ones_like(denom))

    out = torch.matmul(weights, vc)  # O = P V: (B, H, T, D)
    if real_q is not None:
        out, weights = torch.where(real_q, out, zero), torch.where(real_q, weights, zero)
    return (out, weights) if return_weights else out


def reference_varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, causal: bool = False,
    window: tuple[int, int] | None = None, scale: float | None = None, bias: PositionBias | None = None
) -> Tensor:
    """The varlen oracle: repad, run :func:`btlib.reference_attention` with lengths, unpad.

    q, k, v: (total, H, D) -> (total, H, D), fp32 for fp16/bf16 inputs. ``window`` and ``bias`` positions
    are within each sequence (token i of a sequence attends its tokens i - left .. i + right, with bias(j - i)).
    """
    lengths = cu_seqlens_to_lengths(cu_seqlens)
    T = max(check_int(max_seqlen, "max_seqlen", high=INT32_MAX), 1)
    padded = [unpack(x, cu_seqlens, T).transpose(1, 2) for x in (q, k, v)]  # (B, H, T, D)
    out = reference_attention(*padded, lengths=lengths, causal=causal, window=window, scale=scale, bias=bias)
    return pack(out.transpose(1, 2), lengths).tokens


def naive_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, dropout_p: float = 0.0) -> Tensor:
    """softmax(q k^T / sqrt(D) + mask) v with nothing fused, in q's dtype: the baseline benchmarks time.

    q: (B, H, T, D); k, v: (B, H, S, D); mask: broadcastable to (B, H, T, S), bool (True: may attend)
    or float (added). The (B, H, T, S) scores live in memory (the cost the fused kernels remove);
    the softmax runs in fp32, and a row with no key to attend is 0 (as SDPA's).
    """
    att = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, T, S)
    if mask is not None:
        att = att.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else att + mask
    p = att.softmax(dim=-1, dtype=torch.float32)
    p = (p.nan_to_num(0.0) if mask is not None else p).to(q.dtype)
    return torch.nn.functional.dropout(p, dropout_p) @ v  # (B, H, T, D)
