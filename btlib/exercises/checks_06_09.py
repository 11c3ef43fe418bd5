"""The checks of notebooks 06 to 09's exercises (see checks_01_05 for the conventions)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from ..blocks import tile_stats
from ..lengths import batch_lengths, padding_stats, zipf_lengths
from .checks_01_05 import speedup
from .core import Verdict, choice, correct, guarded, is_starter, not_attempted, not_yet, numeric

__all__ = ["ex_06_1", "ex_06_2", "ex_07_1", "ex_07_2", "ex_08_1", "ex_08_2", "ex_08_3",
           "ex_09_1", "ex_09_2", "ex_09_3", "STARTER_07_2"]


def ex_06_1(predicted_speedup: Callable, cfg, B: int, T: int, measure: Callable[[], str] | None = None) -> Verdict:
    """predicted_speedup(lengths, T, cfg) against padding_stats' FLOP model (linear layers and attention), within
    0.5%, on a uniform batch at p = 0.6 and a Zipf batch. measure(), if given, runs once the model is right and
    its sentence (the packed path against the dense fastpath at p = 0.6) ends the verdict."""
    batches = {"uniform p=0.6": batch_lengths({"B": B, "T": T, "padding": 0.6}), "Zipf": zipf_lengths(B, T, seed=1)}

    def judge() -> Verdict:
        mine, flop, linear = {}, {}, {}
        for name, lens in batches.items():
            s = padding_stats(lens, T, d_model=cfg.d_model, d_ff=cfg.dim_feedforward, num_layers=cfg.num_layers)
            mine[name], flop[name] = float(predicted_speedup(lens, T, cfg)), s.ideal_speedup
            linear[name] = 1 / (1 - s.padding_fraction)
        if all(abs(mine[n] / linear[n] - 1) < 1e-9 for n in batches):
            return not_attempted("06-1", "the starter's 1/(1-p) counts the linear layers only")
        for n in batches:
            if not abs(mine[n] / flop[n] - 1) < 0.005:
                return not_yet("06-1", f"on the {n} batch your model is {'above' if mine[n] > flop[n] else 'below'} the "
                                       "FLOP model: padded, every sequence costs T tokens of linear layers and 4 T^2 d "
                                       "of attention; packed, L tokens and 4 L^2 d; sum both over the batch")
        tail = f"; measured at p=0.6: {measure()}" if measure is not None else ""
        return correct("06-1", "your model matches the FLOP model within 0.5% on a uniform (p=0.6) and a Zipf batch ("
                       + ", ".join(f"{n}: {mine[n]:.3f}x" for n in batches) + ")" + tail)
    return guarded("06-1", judge)


def ex_06_2(MY_GUESS, measure: Callable[[], tuple[str, str]]) -> Verdict:
    """MY_GUESS ("zipf", "uniform" or "same") against measure() -> (which batch the packed path gains more on,
    or "same" within the noise; the measured sentence)."""
    return choice("06-2", MY_GUESS, "MY_GUESS", ("zipf", "uniform", "same"), measure, {
        "zipf": "at equal padding the linear layers save the same share on both batches; does attention's extra "
                "waste show above the noise in this encoder's time?",
        "uniform": "at equal padding, which batch wastes more of attention's T^2 pairs? (exercise 1's attention waste)",
        "same": "attention's waste depends on how the lengths spread, not only on the padding fraction: compare "
                "the two batches' attention waste"})


def ex_07_1(MY_PREDICTION, measure: Callable) -> Verdict:
    """MY_PREDICTION against the measured packed-over-fastpath ratio at batch 64, within 15% or the noise: a batch
    size the notebook's benchmark does not run, so its tables cannot give the answer away."""
    return speedup("07-1", MY_PREDICTION, "MY_PREDICTION", measure, rel=0.15,
                   what="btlib's packed path against the padded fastpath at batch 64",
                   above="the speedup is engine x padding: tokenization, embeddings and pooling cost the same on "
                         "both paths and dilute both factors (Amdahl's law)",
                   below="the speedup is engine x padding: the padding factor at batch 64 follows its token ratio "
                         "(the prediction table), and the engine factor (packed_padded against the fastpath) was "
                         "measured at the other batch sizes")


STARTER_07_2 = '''
def pool(h: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """h: (total, d) float32 packed token states; cu_seqlens: (N + 1,) int32 -> (N, d) L2-normalised sentence vectors."""
    bounds = cu_seqlens.tolist()
    return F.normalize(torch.stack([h[s:e].mean(0) for s, e in zip(bounds[:-1], bounds[1:])]), dim=-1)  # starter: a loop
'''


class _CountCalls(TorchFunctionMode):
    """Counts torch calls (functions, methods, indexing): a loop over sentences makes more of them for more sentences."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _calls(pool: Callable, N: int) -> int:
    g = torch.Generator().manual_seed(N)
    lengths = torch.randint(1, 9, (N,), generator=g)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    h = torch.randn(int(lengths.sum()), 8, generator=g)
    with _CountCalls() as counter:
        pool(h, cu)
    return counter.calls


def ex_07_2(pool: Callable, inputs: Callable[[], tuple]) -> Verdict:
    """pool(h, cu_seqlens) must match encode() to 1e-5 (inputs() -> (h, cu_seqlens, encode's vectors)) with as many
    torch calls for 16 sentences as for 4: no per-sentence Python loop."""
    if is_starter(pool, STARTER_07_2):
        return not_attempted("07-2", "pool is the starter's loop")

    def judge() -> Verdict:
        h, cu_seqlens, expected = inputs()
        with torch.inference_mode():
            mine = pool(h, cu_seqlens)
        if not (isinstance(mine, torch.Tensor) and mine.shape == expected.shape):
            return not_yet("07-2", f"pool must return ({len(cu_seqlens) - 1}, d) sentence vectors")
        err = float((mine - expected).abs().max())
        if not err < 1e-5:
            return not_yet("07-2", "differs from encode(): average each sentence's own tokens only (cu_seqlens gives "
                                   "its bounds), then L2-normalise each vector")
        if _calls(pool, 16) != _calls(pool, 4):
            return not_yet("07-2", "matches encode(), but pool makes more torch calls for more sentences: a Python "
                                   "loop is still there; sum with one index_add_ over a sentence index per token")
        ms = []
        for _ in range(7):
            t0 = time.perf_counter()
            pool(h, cu_seqlens)
            ms.append((time.perf_counter() - t0) * 1e3)
        return correct("07-2", f"matches encode() (max |difference| {err:.1e}) with the same number of torch calls for "
                               f"16 sentences as for 4; {statistics.median(ms):.3f} ms for {len(cu_seqlens) - 1} sentences")
    return guarded("07-2", judge)


def ex_08_1(answer_1) -> Verdict:
    """answer_1 against the alive 64 x 64 tiles of one 1,024-token document under a causal window (128, 0)."""
    if answer_1 is None:
        return not_attempted("08-1", "set answer_1")
    s = tile_stats([1024], causal=True, window=(128, 0))
    if not isinstance(answer_1, int) or isinstance(answer_1, bool):
        return not_yet("08-1", f"answer_1 must be a whole number of tiles, not {answer_1!r}")
    if answer_1 != s.alive:
        return not_yet("08-1", f"your count is {'above' if answer_1 > s.alive else 'below'} the alive tiles: rows "
                               "q0 .. q0 + 63 reach keys q0 - 128 .. q0 + 63; count the 64-key tiles that range touches "
                               "for each of the 16 query blocks (the first ones reach fewer)")
    return correct("08-1", f"{s.alive} alive tiles ({s.full} full, {s.partial} partial) of {s.tiles}")


def ex_08_2(answer_2, window: tuple[int, int]) -> Verdict:
    """answer_2 = (tile size, efficiency) against tile_stats on an 8,192-token document with ``window``, tiles of
    16, 32, 64 and 128: the most efficient size and its efficiency within 0.02."""
    if answer_2 is None:
        return not_attempted("08-2", "set answer_2")
    try:
        n, e = int(answer_2[0]), float(answer_2[1])
    except (TypeError, ValueError, IndexError):
        return not_yet("08-2", f"answer_2 must be (tile size, efficiency as a fraction), not {answer_2!r}")
    eff = {t: tile_stats([8192], window=window, Br=t, Bc=t).tile_efficiency for t in (16, 32, 64, 128)}
    best = max(eff, key=eff.get)
    if n != best:
        return not_yet("08-2", "not the tile size that wastes least: the band's edge crosses tiles that are computed "
                               "whole; compare tile_stats(..., Br=n, Bc=n).tile_efficiency for each n")
    if abs(e - eff[best]) >= 0.02:
        return not_yet("08-2", f"right tile size; your efficiency is {'above' if e > eff[best] else 'below'} its "
                               "tile_efficiency (allowed pairs over computed pairs, a fraction)")
    return correct("08-2", ", ".join(f"tiles of {t}: {x:.0%}" for t, x in eff.items()) + "; smaller tiles load K and V "
                   "for fewer query rows each (less reuse per byte) and leave the SIMD micro-kernel shorter loops")


def ex_08_3(answer_3, measure: Callable) -> Verdict:
    """answer_3 against measure() -> explorer point (tiles_speedup, pairs_speedup, measured_speedup) for a
    window (32, 32) on 2,048 tokens: right within 5% of the tile model or 20% of the measurement."""
    point = {}

    def measured() -> float:
        point["p"] = p = measure()
        return p.measured_speedup

    def judge() -> Verdict:
        v = numeric("08-3", answer_3, "answer_3", measured, rel=0.20, against="the measured speedup",
                    above="count the alive 64 x 64 tiles with the window and without it: the band's edge tiles are "
                          "computed whole, and a tile costs more than its pairs",
                    below="count the alive 64 x 64 tiles with the window and without it: the window leaves a few "
                          "tiles per query block out of T/64")
        p = point.get("p")
        if p is None or not (v.correct or abs(float(answer_3) / p.tiles_speedup - 1) <= 0.05):
            return v
        return correct("08-3", f"tile model {p.tiles_speedup:.2f}x, FLOP model {p.pairs_speedup:.2f}x, yours "
                               f"{float(answer_3):.2f}x; measured {p.measured_speedup:.2f}x")
    return not_attempted("08-3", "set answer_3") if answer_3 is None else guarded("08-3", judge)


def ex_09_1(answer_1) -> Verdict:
    """answer_1 = (padded, packed) tokens of a batch of 7 queries of 12 tokens and one passage of 200."""
    if answer_1 is None:
        return not_attempted("09-1", "set answer_1")
    lengths = [12] * 7 + [200]
    padded, packed = len(lengths) * max(lengths), sum(lengths)
    try:
        a, b = (int(x) for x in answer_1)
    except (TypeError, ValueError):
        return not_yet("09-1", f"answer_1 must be (padded tokens, packed tokens), not {answer_1!r}")
    if a != padded:
        return not_yet("09-1", "padded: a padded batch computes every request at the longest request's length")
    if b != packed:
        return not_yet("09-1", "packed: a packed batch computes each request's real tokens and nothing else")
    return correct("09-1", f"padded {padded} tokens, packed {packed}: padding makes the batch {padded / packed:.1f}x the work")


def ex_09_2(answer_2) -> Verdict:
    """answer_2 against Little's law at 300 requests/s and 40 ms."""
    return numeric("09-2", answer_2, "answer_2", lambda: 300 * 0.040, abs_tol=0.01, unit="requests",
                   against="what Little's law gives", above="L = lambda W: is W in seconds?", below="L = lambda W: is W in seconds?",
                   verified=lambda x, m: f"300 requests/s x 0.040 s = {m:g} requests in the system on average")


def ex_09_3(answer_3, c0: float, c1: float) -> Verdict:
    """answer_3 against the cost model's ceiling for batches of 16 queries of 14 tokens (c0 ms + c1 ms per token)."""
    return numeric("09-3", answer_3, "answer_3", lambda: 16 / ((c0 + c1 * 16 * 14) / 1e3), rel=0.10,
                   unit="requests/s", against="the cost model's ceiling",
                   above="one forward of 16 queries costs c0 + c1 ms for each of its tokens: is every token counted?",
                   below="the ceiling is the requests one forward answers over the seconds it takes: is c0 paid "
                         "once per forward, and are the times in seconds?",
                   verified=lambda x, m: f"{x:.0f} requests/s is within 10% of the cost model's {m:.0f}")
