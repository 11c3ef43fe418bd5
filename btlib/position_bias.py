"""Position biases for attention: a per-head additive term that depends only on the key's offset d = j - i.

    S[h, i, j] = scale * q_i . k_j + bias(h, j - i)                 i, j: positions within one sequence

Two kinds, both computed by the fused kernels from (h, i, j) inside the tile loop; no kernel ever
builds the (T, T) bias (only the reference and PyTorch's SDPA baselines materialise it):

- ``PositionBias.alibi(slopes)``: bias(h, d) = -slopes[h] * |d|. Symmetric, as JinaBERT's encoder
  uses ALiBi (Press et al. 2022 define it causal, -slope * (i - j) for j <= i, which is the same
  where causal masks the rest). ``alibi_slopes(H)`` gives the paper's geometric slopes.
- ``PositionBias.table(values, max_distance)``: bias(h, d) = values[h, clamp(d, -R, R) + R] with
  values (H, 2R + 1) float32, R = max_distance. T5's and MPNet's bucketed relative positions are
  exactly such a table, because their bucket is constant once |d| >= max_distance:
  ``relative_bucket_table(bucket_values, num_buckets, max_distance)`` converts their (H, num_buckets)
  embedding into it. Example: num_buckets 32, max_distance 128 (MPNet) -> a (H, 257) table.

Positions count within each sequence (varlen: from cu_seqlens[b]; padded: from row 0), so packing
never changes the bias. The bias comes after the scale (it is not scaled), and it is fp32 for
every input dtype (the kernels add it to their fp32 scores). It combines with causal, a window and
padding: masked keys stay masked, whatever their bias.

Values are checked once, when the bias is built (shape, float32, finite): a NaN in a table would
turn every row it reaches into NaN. Each call checks only the head count and the device.
Gradients: the compiled kernels have no backward; with inputs (or the bias values) that require
grad, btlib.attention falls back to PyTorch's SDPA with the bias as a float mask, which autograd
follows into q, k, v and the bias values.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from .padding import check_int

__all__ = ["PositionBias", "alibi_slopes", "relative_position_bucket", "relative_bucket_table", "check_position_bias",
           "BIAS_KINDS"]

BIAS_KINDS = {"alibi": 1, "table": 2}  # the kernels' bias_kind codes; 0 = no bias
MAX_DISTANCE = 2**30  # R beyond this would be a table of over 2^31 entries per head


def _float32(x, name: str, hint: str) -> Tensor:
    if not isinstance(x, Tensor):
        try:
            x = torch.tensor(x, dtype=torch.float32)
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be a float32 tensor; got {type(x).__name__}: {hint}") from None
    if x.dtype != torch.float32:
        raise ValueError(f"{name} must be float32 (the kernels add it to fp32 scores); got {x.dtype}: pass {name}.float()")
    return x


@dataclass(frozen=True, eq=False)
class PositionBias:
    """A per-head additive attention bias, a function of the offset d = j - i within each sequence.

    kind: "alibi" (values: (H,) slopes, bias -slope * |d|) or "table" (values: (H, 2R + 1), bias
    values[h, clamp(d, -R, R) + R]); max_distance: R for a table, 0 for alibi. Build it with
    :meth:`alibi` or :meth:`table`; the values are checked here, once (float32, finite, shapes).
    """

    kind: Literal["alibi", "table"]
    values: Tensor
    max_distance: int = 0

    def __post_init__(self):
        if self.kind not in BIAS_KINDS:
            raise ValueError(f"kind must be 'alibi' or 'table'; got {self.kind!r}: use PositionBias.alibi(slopes) "
                             "or PositionBias.table(values, max_distance)")
        if self.kind == "alibi":
            hint = "pass PositionBias.alibi(slopes) with slopes (H,) float32, one per head (btlib.alibi_slopes(H))"
            values = _float32(self.values, "slopes", hint)
            if values.dim() != 1 or values.shape[0] < 1:
                raise ValueError(f"ALiBi slopes must be 1-D (H,), one per head; got shape {tuple(values.shape)}: {hint}")
            if self.max_distance != 0:
                raise ValueError(f"an ALiBi bias has no max_distance; got {self.max_distance}: {hint}")
        else:
            hint = "pass PositionBias.table(values, max_distance) with values (H, 2 * max_distance + 1) float32"
            R = check_int(self.max_distance, "max_distance", high=MAX_DISTANCE, hint=hint)
            object.__setattr__(self, "max_distance", R)
            values = _float32(self.values, "the bias table", hint)
            if values.dim() != 2 or values.shape[0] < 1 or values.shape[1] != 2 * R + 1:
                raise ValueError(f"the bias table must be (H, 2 * max_distance + 1) = (H, {2 * R + 1}); got "
                                 f"{tuple(values.shape)}: {hint}")
        if not bool(torch.isfinite(values.detach()).all()):
            raise ValueError(f"the {self.kind} bias holds NaN or inf values; pass finite values (a masked key is "
                             "masked by causal, window or lengths, not by an -inf bias)")
        object.__setattr__(self, "values", values)

    @classmethod
    def alibi(cls, slopes) -> PositionBias:
        """bias(h, i, j) = -slopes[h] * |i - j| (symmetric ALiBi, JinaBERT's). slopes: (H,) float32."""
        return cls("alibi", slopes)

    @classmethod
    def table(cls, values, max_distance: int) -> PositionBias:
        """bias(h, i, j) = values[h, clamp(j - i, -R, R) + R], R = max_distance. values: (H, 2R + 1) float32."""
        return cls("table", values, max_distance)

    @property
    def H(self) -> int:
        return self.values.shape[0]

    @property
    def device(self) -> torch.device:
        return self.values.device

    def to(self, device: torch.device | str) -> PositionBias:
        """The same bias with its values on ``device`` (once, before the calls: the kernels read them there)."""
        moved = copy.copy(self)  # no __post_init__: the values were checked when built (a check on a GPU would sync)
        object.__setattr__(moved, "values", self.values.to(device))
        return moved

    def at(self, d: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """bias for key offsets ``d`` = j - i (any shape, integer): (H, *d.shape) in ``dtype`` (the slope's
        product is taken in it: float64 for the float64 reference)."""
        values = self.values.to(dtype)
        if self.kind == "alibi":
            return -values.view(-1, *[1] * d.dim()) * d.abs().to(dtype)
        R = self.max_distance
        return values[:, d.clamp(-R, R) + R]

    def dense(self, T: int, S: int | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
        """The bias materialised for T queries and S keys (default T): (H, T, S) in ``dtype`` on the values' device.

        For the reference and PyTorch's SDPA paths only: 4 H T S bytes (H = 12, T = S = 512: 12 MB)."""
        S = T if S is None else S
        d = torch.arange(S, device=self.device).view(1, S) - torch.arange(T, device=self.device).view(T, 1)  # (T, S): j - i
        return self.at(d, dtype)

    def kernel_args(self) -> tuple[Tensor, int, int]:
        """(values contiguous, kind code, R) as the compiled ops take them: bias_kind 1 alibi, 2 table."""
        return self.values.detach().contiguous(), BIAS_KINDS[self.kind], self.max_distance

    def __repr__(self) -> str:
        extra = f", max_distance={self.max_distance}" if self.kind == "table" else ""
        return f"PositionBias.{self.kind}(H={self.H}{extra}, device={self.device})"


def kernel_args(bias: PositionBias | None) -> tuple[Tensor | None, int, int]:
    """:meth:`PositionBias.kernel_args`, or (None, 0, 0) without a bias."""
    return (None, 0, 0) if bias is None else bias.kernel_args()


def check_position_bias(bias, H: int, device: torch.device) -> PositionBias | None:
    """``bias`` for a call with H heads on ``device``: None or a PositionBias of H heads there (no sync)."""
    if bias is None:
        return None
    if not isinstance(bias, PositionBias):
        raise TypeError(f"bias must be a btlib.PositionBias or None; got {type(bias).__name__}: build one with "
                        "PositionBias.alibi(slopes) or PositionBias.table(values, max_distance)")
    if bias.H != H:
        raise ValueError(f"the position bias has {bias.H} heads, the inputs have H={H}: pass one slope (or table row) per head")
    if bias.device != device:
        raise ValueError(f"the position bias is on {bias.device}, the inputs on {device}: pass bias.to({str(device)!r}) "
                         "(once, outside the loop)")
    return bias


def alibi_slopes(H: int) -> Tensor:
    """ALiBi's per-head slopes (Press et al. 2022), as JinaBERT builds them: (H,) float32.

    H a power of two: 2^(-8 / H), 2^(-16 / H), ...; otherwise the slopes of the power of two below H,
    then every other slope of twice that power, until there are H."""
    H = check_int(H, "H", low=1)

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(H).is_integer():
        slopes = power_of_2(H)
    else:
        closest = 2 ** math.floor(math.log2(H))
        slopes = power_of_2(closest) + alibi_slopes(2 * closest).tolist()[0::2][: H - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def relative_position_bucket(d: Tensor, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True) -> Tensor:
    """T5's relative-position bucket of key offsets ``d`` = j - i (MPNet's is the bidirectional one): same shape, int64.

    Bidirectional: half the buckets for keys after the query. Offsets below max_exact = buckets / 2 get a
    bucket each; larger ones share log-spaced buckets up to max_distance, and all beyond it the last one.
    Computed in float32 as T5 and MPNet compute it, so the buckets are theirs exactly."""
    ret = torch.zeros_like(d)
    if bidirectional:
        num_buckets //= 2
        ret = ret + (d > 0).long() * num_buckets
        n = d.abs()
    else:
        n = -torch.min(d, torch.zeros_like(d))
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = max_exact + (torch.log(n.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return ret + torch.where(is_small, n, large)


def relative_bucket_table(bucket_values: Tensor, num_buckets: int, max_distance: int,
                          bidirectional: bool = True) -> PositionBias:
    """A T5 / MPNet bucketed relative-position embedding as a table bias, exact for every offset.

    bucket_values: (H, num_buckets) float32, the bias of each bucket per head (T5's
    relative_attention_bias.weight.T; MPNet's too). The bucket of d is constant for |d| >= max_distance,
    so a table over d in [-max_distance, max_distance] (clamped beyond) gives every offset its bucket's value.
    Returns PositionBias.table(bucket_values[:, bucket(d)], max_distance): (H, 2 max_distance + 1).
    """
    hint = "pass (H, num_buckets) float32 bucket values, e.g. relative_attention_bias.weight.T.float()"
    nb = check_int(num_buckets, "num_buckets", low=2, hint=hint)
    max_exact = (nb // 2 if bidirectional else nb) // 2
    R = check_int(max_distance, "max_distance", low=max_exact + 1, high=MAX_DISTANCE,
                  hint=f"the bucket function needs max_distance > {max_exact} (half the exact buckets) for {nb} buckets")
    bucket_values = _float32(bucket_values, "bucket_values", hint)
    if bucket_values.dim() != 2 or bucket_values.shape[1] != nb:
        raise ValueError(f"bucket_values must be (H, num_buckets) = (H, {nb}); got {tuple(bucket_values.shape)}: {hint}")
    d = torch.arange(-R, R + 1, device=bucket_values.device)
    return PositionBias.table(bucket_values[:, relative_position_bucket(d, nb, R, bidirectional)], R)
