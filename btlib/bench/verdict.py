"""Verdicts chosen by the data: "faster", "slower" or "no clear difference", with the spread measured.

A sentence such as "the fused kernel is faster" is a fact about one machine. The notebooks print
it from the measured rows instead of typing it, so it stays true wherever they run:

    >>> a = {"provider": "packed", "median_ms": 50.0, "min_ms": 49.0, "round_medians_ms": [50.0, 51.0]}
    >>> b = {"provider": "nested", "median_ms": 80.0, "min_ms": 79.0, "round_medians_ms": [80.0, 82.0]}
    >>> str(compare(a, b))
    '1.60x faster (noise ±2%)'
    >>> str(compare(a, {**b, "median_ms": 50.5, "round_medians_ms": [50.5, 53.0]}))
    'no clear difference (noise ±5%)'

The spread ("noise") of a row is how reproducible its kept time is, measured across repeats: when
the row comes from :func:`btlib.bench.run_rounds` (``round_medians_ms``: the same point timed in
several rounds, interleaved with the other providers), the gap between its best round and the next
best (the row keeps the best round, so one round that a burst of other work landed on neither sets
the time nor the spread; with two rounds this is their whole spread), else the spread of its one
run's repeated calls (median over min).

Other work only adds time, so a row's time t lies in the interval [t, t (1 + s)]. Two rows are held
to the larger spread s of the two (never below ``floor``, 2%: below that, clock and cache effects
decide): when the faster row's interval reaches the slower row's time, the intervals overlap and
the verdict is "no clear difference", printed without a factor, so no factor inside the noise is
ever quoted. A difference clear of the noise but under 5% (MIN_FACTOR) reads "about the same (within 5%)", with the
same verdict word: a 2% edge measured here does not carry to a reader's CPU, so no sentence is built on it.
"2x slower" and "2x faster" are the same distance from equal. A spread above NOISE_LIMIT (50%,
btlib.bench.timing) is a failed measurement, not a wide interval: the verdict is "too noisy to compare here",
with no factor and no share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .timing import NOISE_LIMIT

__all__ = ["Comparison", "compare", "faster_first", "noise", "find_row", "share_of_ideal", "NO_CLEAR_DIFFERENCE", "TOO_NOISY",
           "MIN_FACTOR"]

FLOOR = 0.02
MIN_FACTOR = 1.05  # the smallest factor a verdict names, however small the noise


def noise(row: dict) -> float:
    """Relative spread of one row's time across repeats: next-best / best - 1 over its rounds' medians, else
    median / min - 1 over its one run's calls."""
    rounds = sorted(row.get("round_medians_ms") or [])
    if len(rounds) >= 2:
        return rounds[1] / rounds[0] - 1.0
    return row["median_ms"] / row["min_ms"] - 1.0 if row.get("min_ms") else 0.0


NO_CLEAR_DIFFERENCE = "no clear difference"
TOO_NOISY = "too noisy to compare here"  # a row's noise above NOISE_LIMIT: a failed measurement, not a verdict


@dataclass(frozen=True)
class Comparison:
    """How row ``a`` compares with row ``b``: ``ratio`` = b's median / a's median (> 1: a is faster).

    ``noise``: the larger spread of the two rows (at least the floor). ``str()`` says the factor as one
    would, only where it is clear: ratio 0.25 prints "4.00x slower (noise ±3%)", ratio 1.02 with a 3%
    spread "no clear difference (noise ±3%)".
    """

    ratio: float
    noise: float

    @property
    def too_noisy(self) -> bool:
        """A row's noise is above NOISE_LIMIT (50%): the rounds disagree by more than half, so nothing is concluded."""
        return self.noise > NOISE_LIMIT

    @property
    def factor(self) -> float:
        """How many times faster the faster row is (>= 1): 0.5 is as far from 1 as 2."""
        return max(self.ratio, 1.0 / self.ratio)

    @property
    def beyond_noise(self) -> bool:
        """The two rows' intervals [t, t (1 + noise)] do not overlap (never when the measurement is too noisy)."""
        return not self.too_noisy and self.factor - 1.0 > self.noise

    @property
    def clear(self) -> bool:
        """True when the faster is faster by more than the noise and by at least MIN_FACTOR (5%)."""
        return self.beyond_noise and self.factor >= MIN_FACTOR

    @property
    def verdict(self) -> str:
        """"faster", "slower" (a compared with b), "no clear difference" or "too noisy to compare here"."""
        if self.too_noisy:
            return TOO_NOISY
        if not self.clear:
            return NO_CLEAR_DIFFERENCE
        return "faster" if self.ratio > 1.0 else "slower"

    def __str__(self) -> str:
        band = f"noise ±{self.noise:.0%}"
        if self.too_noisy:
            return f"{TOO_NOISY} (noise ±{self.noise:.0%}: measure on a quiet machine)"
        if self.beyond_noise and not self.clear:
            return f"about the same (within {MIN_FACTOR - 1:.0%}; {band})"  # no factor: a 2% edge does not carry
        if not self.clear:
            return f"{NO_CLEAR_DIFFERENCE} ({band})"  # no factor: one inside the noise says nothing
        times = self.ratio if self.ratio >= 1.0 else 1.0 / self.ratio  # "4.00x slower", not "0.25x slower"
        return f"{times:.2f}x {self.verdict} ({band})"


def compare(a: dict, b: dict, *, floor: float = FLOOR) -> Comparison:
    """Compare two "ok" benchmark rows measured side by side (a against b)."""
    for r in (a, b):
        if r.get("status", "ok") != "ok":
            raise ValueError(f"row {r.get('provider')!r} was not timed ({r.get('status')}: {r.get('reason')}); "
                             "compare only rows with status 'ok'")
    return Comparison(ratio=b["median_ms"] / a["median_ms"], noise=max(noise(a), noise(b), floor))


def faster_first(a: dict, b: dict, name_a: str, name_b: str) -> str:
    """"<faster> against <slower>: 1.80x faster (noise ±3%)": the comparison with the faster row named first,
    so a sentence never reads "4.00x slower"; where the difference is not clear, in the order given:
    "<a> against <b>: no clear difference (noise ±3%)"."""
    c = compare(a, b)
    if c.clear and c.ratio < 1:
        a, b, name_a, name_b = b, a, name_b, name_a
    return f"{name_a} against {name_b}: {compare(a, b)}"


def share_of_ideal(row: dict, ideal: dict, name: str = "the ideal") -> str:
    """How close ``row`` came to its ``ideal`` row (a yardstick: the ideal time, useful FLOPs over the bound, or a
    measured run without the waste), never as a fraction above 100% nor as a share inside the noise:
    "87% of the ideal (noise ±3%)"; "as fast as the ideal within noise (±4%)" where the two intervals overlap
    (on either side); beyond noise above it, a sentence saying that the ideal is too low to be a bound."""
    c = compare(row, ideal)
    if c.too_noisy:
        return f"{TOO_NOISY} against {name} (noise ±{c.noise:.0%}: measure on a quiet machine)"
    if c.beyond_noise and not c.clear:
        return f"as fast as {name} within {MIN_FACTOR - 1:.0%} (noise ±{c.noise:.0%})"
    if not c.clear:
        return f"as fast as {name} within noise (±{c.noise:.0%})"
    if c.ratio < 1:
        return f"{c.ratio:.0%} of {name} (noise ±{c.noise:.0%})"
    return f"{c.ratio:.2f}x faster than {name}, beyond noise (±{c.noise:.0%}): {name} is too low to be a bound"


def find_row(rows: Sequence[dict], provider: str, x: Any = None, **params: Any) -> dict:
    """The one row of ``provider`` (at ``x``, with these params) among ``rows``; raises if none or several."""
    hits = [r for r in rows if r["provider"] == provider and (x is None or r["x"] == x)
            and all(r.get("params", {}).get(k) == v for k, v in params.items())]
    if len(hits) != 1:
        raise LookupError(f"{len(hits)} rows of provider {provider!r} at x={x!r} {params or ''}; expected one")
    return hits[0]
