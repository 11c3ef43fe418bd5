"""The checks of notebooks 01 to 05's exercises: one function per exercise, named by notebook and number.

Each takes what the exercise cell defines (and, for a measured answer, a ``measure`` callable the check cell
builds, called only once the learner has answered) and returns a :class:`Verdict`. Hints name the idea to
revisit and, for a number, the side it is on; they never hold the expected value.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..observe import ops_that_ran, run_slow
from ..reference import reference_attention
from .core import Verdict, choice, correct, guarded, is_starter, not_attempted, not_yet, numeric

__all__ = ["ex_01_1", "ex_01_2", "speedup", "ex_02_1", "ex_02_2", "ex_03_1", "ex_03_2", "ex_03_3",
           "ex_04_1", "ex_04_2", "ex_04_3", "ex_05_1", "ex_05_2", "STARTER_03_2", "SPEED_CHOICES"]

SPEED_CHOICES = ("faster", "slower", "no clear difference")  # bench.Comparison.verdict's three words


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def ex_01_1(window_mask: Callable, masked_attention: Callable) -> Verdict:
    """window_mask(T, w): (T, T) bool, True where |i - j| <= w; checked at (97, 3), (5, 0) and (8, 10), and
    masked_attention with it against btlib.reference_attention."""
    def judge() -> Verdict:
        for T, w in ((97, 3), (5, 0), (8, 10)):
            mask = window_mask(T, w)
            if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and tuple(mask.shape) == (T, T)):
                return not_yet("01-1", f"window_mask({T}, {w}) must return a ({T}, {T}) bool tensor")
            if (T, w) == (97, 3) and bool(mask.all()):
                return not_attempted("01-1", "window_mask still allows every pair")
            i = torch.arange(T)
            want = (i[:, None] - i[None, :]).abs() <= w  # (T, T): the window, from its definition
            if bool((mask & ~want).any()):
                return not_yet("01-1", f"at T={T}, w={w} your mask allows pairs more than w positions apart")
            if bool((want & ~mask).any()):
                return not_yet("01-1", f"at T={T}, w={w} your mask forbids pairs within the window: it reaches w "
                                       "positions on both sides of the diagonal, the diagonal and distance w included")
        q, k, v = torch.randn(3, 2, 4, 97, 32, generator=torch.Generator().manual_seed(0))
        mask = window_mask(97, 3)
        err = _relative_error(masked_attention(q, k, v, mask), reference_attention(q, k, v, attn_mask=mask))
        if not err < 1e-5:
            return not_yet("01-1", "your mask is the window, but masked_attention with it no longer matches "
                                   "btlib.reference_attention: leave masked_attention as given")
        return correct("01-1", "window_mask is the sliding window |i - j| <= w at (T, w) = (97, 3), (5, 0), (8, 10), "
                               "and masked_attention with it matches btlib.reference_attention (error < 1e-5)")
    return guarded("01-1", judge)


def ex_01_2(predicted_mib, measure: Callable[[], float]) -> Verdict:
    """predicted_mib against the naive reference's measured peak (MiB), within 10%."""
    return numeric("01-2", predicted_mib, "predicted_mib", measure, rel=0.10, unit="MiB", against="the measured peak",
                   above="count only the tensors alive at the same moment; the inputs were there before the call",
                   below="the reference keeps more than one (B, H, T, T) fp32 tensor alive at its peak, 4 bytes an element",
                   verified=lambda x, m: f"predicted {x:.0f} MiB, measured {m:.0f} MiB: within 10%")


def speedup(exercise: str, value, name: str, measure: Callable, *, rel: float, above: str, below: str,
            what: str, note: str | None = None) -> Verdict:
    """A predicted speedup against measure() -> bench.Comparison, accepted within rel or the measured noise,
    whichever is larger; ``what`` names the two paths in the verdict."""
    measured = {}

    def ratio() -> float:
        measured["c"] = measure()
        return measured["c"].ratio

    def judge() -> Verdict:
        v = numeric(exercise, value, name, ratio, rel=rel, against="the measured speedup", above=above, below=below,
                    note=note)
        c = measured.get("c")
        if c is None or not (v.correct or abs(float(value) / c.ratio - 1) <= c.noise):
            return v
        return correct(exercise, f"you predicted {float(value):.2f}x; measured {what}: {c}; "
                                 f"within {max(rel, c.noise):.0%}")
    return judge() if value is None else guarded(exercise, judge)


def ex_02_1(predicted_speedup, measure: Callable, padding: float) -> Verdict:
    """predicted_speedup against the measured nested-over-dense ratio (a bench.Comparison), within 20% or its noise.
    padding: the batch's padding fraction, whose bound 1/(1-p) the verdict recalls (the cost model, not the answer)."""
    bound = f"your batch is {padding:.0%} padding: skipping it can make the linear layers at most {1 / (1 - padding):.2f}x faster"
    return speedup("02-1", predicted_speedup, "predicted_speedup", measure, rel=0.20, note=f"set predicted_speedup; {bound}",
                   what="the nested path against the dense fastpath",
                   above="1/(1-p) bounds what skipping padding can gain in the linear layers; the nested path also "
                         "builds and unpacks nested tensors, and not all of the time is FLOPs",
                   below="the nested path skips the padded rows' work in every layer: start from the padding "
                         "fraction's bound 1/(1-p) and ask what is left of it")


def _same_module(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Same class, mode, options and weights in every submodule: break_it changed nothing."""
    for (na, ma), (nb, mb) in zip(a.named_modules(), b.named_modules()):
        if na != nb or type(ma) is not type(mb) or ma.training != mb.training:
            return False
        plain = lambda m: {k: x for k, x in vars(m).items() if isinstance(x, (bool, int, float, str, type(None)))}
        if plain(ma) != plain(mb):
            return False
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


def _same_tensor(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


FUSED, NESTED = "aten::_transformer_encoder_layer_fwd", "aten::_nested_tensor_from_mask"


def ex_02_2(original: tuple, broken: tuple, run: Callable) -> Verdict:
    """original and broken: (encoder, x, mask) before and after break_it; run(triple) -> (FastpathReport, ops that
    ran). Correct once the fused layer, or the nested-tensor sparsity path, ran on the original and not after."""
    (enc, x, mask), (enc_b, x_b, mask_b) = original, broken
    if _same_module(enc, enc_b) and _same_tensor(x_b, x) and _same_tensor(mask_b, mask):
        return not_attempted("02-2", "break_it changes nothing yet")

    def judge() -> Verdict:
        _, before = run(original)
        report, ops = run(broken)
        lost = [what for op, what in ((FUSED, "the fused layer"), (NESTED, "the nested-tensor sparsity path"))
                if op in before and op not in ops]
        if not lost:
            return not_yet("02-2", "the fastpath still runs as before: it looks at the module's mode and options, "
                                   "autograd, and the dtypes of the input and the mask (some options only when the encoder is "
                                   "built), not at weight values")
        reason = next((line.strip() for line in str(report).splitlines() if "blocked" in line), str(report).splitlines()[0])
        return correct("02-2", f"{' and '.join(lost)} no longer ran; the explainer says {reason!r}; "
                               f"its prediction and the profile agree: {report.confirm(ops) == []}")
    return guarded("02-2", judge)


def ex_03_1(my_T: int, my_prediction, measure: Callable) -> Verdict:
    """my_prediction against bench.compare(is_causal, float mask) at my_T: measure(my_T) -> Comparison. Against the
    float mask, not the bool one: a bool mask is converted to an additive one inside SDPA, a cost that has nothing to
    do with skipping blocks."""
    def outcome():
        c = measure(my_T)
        return c.verdict, f"T={my_T}: is_causal against the float mask: {c}"
    return choice("03-1", my_prediction, "my_prediction", SPEED_CHOICES, outcome, {
        "faster": "does is_causal skip a whole key block at this T? The CPU flash kernel skips whole blocks only, "
                  "and the measurement must clear the noise",
        "slower": "a causal row reads no more keys than a masked one: what could make skipping blocks cost time?",
        "no clear difference": "count the whole key blocks above the diagonal at this T: below one block there is "
                               "nothing to skip, and a difference under 5% is not named"})


STARTER_03_2 = '''
def my_mha_call(mha, x):
    with torch.inference_mode():
        return mha(x, x, x)[0]
'''


def ex_03_2(my_mha_call: Callable) -> Verdict:
    """The profile of my_mha_call(mha, x) must show SDPA's flash CPU kernel, with the output of the plain module."""
    if is_starter(my_mha_call, STARTER_03_2):
        return not_attempted("03-2", "my_mha_call is the starter")

    def judge() -> Verdict:
        mha = torch.nn.MultiheadAttention(64, 4, batch_first=True).eval()
        x = torch.randn(2, 33, 64, generator=torch.Generator().manual_seed(0))
        ops = ops_that_ran(lambda: my_mha_call(mha, x))
        with torch.no_grad():
            out = my_mha_call(mha, x)
            want = run_slow(lambda: mha(x, x, x, need_weights=False)[0])
        if not (isinstance(out, torch.Tensor) and out.shape == want.shape and _relative_error(out.float(), want) < 1e-5):
            return not_yet("03-2", "the output changed: return what mha returns first, for the same module and inputs")
        if "aten::_scaled_dot_product_flash_attention_for_cpu" not in ops:
            ran = sorted(o for o in ops if "attention" in o or "softmax" in o or o == "aten::bmm")
            return not_yet("03-2", f"attention ran as {', '.join(ran)}: two things keep it off SDPA; the section on "
                                   "need_weights names both")
        return correct("03-2", "the profile shows aten::_scaled_dot_product_flash_attention_for_cpu and the output "
                               "matches the plain module (error < 1e-5)")
    return guarded("03-2", judge)


def ex_03_3(my_peak_bytes: Callable, measure: Callable[[], float]) -> Verdict:
    """my_peak_bytes(2, 4, 300, 64) against the measured peak of naive_attention with a causal (T, T) bool mask,
    within 5%."""
    return guarded("03-3", lambda: numeric(
                   "03-3", my_peak_bytes(2, 4, 300, 64), "my_peak_bytes(2, 4, 300, 64)", measure, rel=0.05,
                   unit="bytes", against="the measured peak", note="my_peak_bytes returns None",
                   above="a temporary freed before the next one is allocated does not add to the peak",
                   below="count every (B, H, T, T) and (B, H, T, D) tensor naive_attention holds at the same moment "
                         "on its masked path, 4 bytes per fp32 element: a name given a new tensor lets go of the old "
                         "one only once the new one exists",
                   verified=lambda x, m: f"your formula gives {x / 2**20:.2f} MiB; measured {m / 2**20:.2f} MiB: within 5%"))


def ex_04_1(BC: int, default_bc: int, my_prediction, measure: Callable) -> Verdict:
    """my_prediction against bench.compare(copy with Bc=BC, registered build); measure() -> Comparison, raising
    NotYet when the copy does not build or differs from the reference."""
    if my_prediction is not None and BC == default_bc:
        return not_yet("04-1", "BC is still the registered build's Bc: set another multiple of kNV * W")

    def outcome():
        c = measure()
        return c.verdict, f"Bc={BC} against Bc={default_bc}: {c}"
    return choice("04-1", my_prediction, "BC and MY_PREDICTION", SPEED_CHOICES, outcome, {
        "faster": "fewer rescales only pay while the larger S tile (Br x Bc x 4 bytes) still sits in L1 beside K and V",
        "slower": "a larger Bc means one rescale per longer key block and longer runs of FMAs: weigh that against L1",
        "no clear difference": "the two effects of a larger Bc (fewer rescales, a larger S tile against L1) need not "
                               "cancel: which one dominates on this core?"})


def ex_04_2(predicted_ms, measure: Callable[[], float]) -> Verdict:
    """predicted_ms against v3's measured time at B=1, H=8, T=2048, D=64 on 2 threads, within 25%."""
    return numeric("04-2", predicted_ms, "predicted_ms", measure, rel=0.25, unit="ms", against="the measured time",
                   above="v3 keeps more of the compute roof at T = 2048 than you assumed",
                   below="FLOPs over the share of the roof v3 reached at T = 1024 assumes that share holds: do one "
                         "head's K and V still fit in L2 at T = 2048?",
                   verified=lambda x, m: f"predicted {x:.1f} ms, measured {m:.1f} ms: within 25%")


def ex_04_3(fn: Callable, window: int) -> Verdict:
    """fn(q, k, v, window, Bc) against btlib.reference_attention with the causal window i - window < j <= i, for
    Bc = 1, 16, 64 on T = 97 (Bc = 1 has rows whose first blocks are all masked)."""
    def judge() -> Verdict:
        q, k, v = torch.randn(3, 1, 2, 97, 32, generator=torch.Generator().manual_seed(0))
        i, j = torch.arange(97)[:, None], torch.arange(97)[None, :]
        ref = reference_attention(q, k, v, attn_mask=(j <= i) & (j > i - window))
        outs = {Bc: fn(q, k, v, window, Bc) for Bc in (1, 16, 64)}
        plain = reference_attention(q, k, v)
        if all(_relative_error(o, plain) < 1e-5 for o in outs.values()):
            return not_attempted("04-3", "the function still ignores the window")
        wrong = [Bc for Bc, o in outs.items() if not _relative_error(o, ref) < 1e-5]
        if any(bool(o.isnan().any()) for o in outs.values()):
            return not_yet("04-3", f"NaN in the output (Bc = {wrong}): a row whose keys so far are all masked has "
                                   "m' = -inf; see how online_softmax_row avoids exp(-inf + inf)")
        if wrong:
            return not_yet("04-3", f"differs from the reference for Bc = {wrong}: mask, in each block and before "
                                   "the max, every key outside i - window < j <= i")
        return correct("04-3", f"matches btlib.reference_attention with the causal window w={window} for Bc = 1, 16, 64, "
                               "fully masked blocks included")
    return guarded("04-3", judge)


def ex_05_1(my_blocks: dict, my_prediction, measure: Callable) -> Verdict:
    """my_prediction ("runs" or "fails") against measure() -> ("runs" | "fails", what happened): the kernel with
    my_blocks against the reference on T = 97 with a fully padded sequence, causal and not."""
    def outcome():
        result, seen = measure()
        return result, f"blocks {my_blocks}: {seen}"
    return choice("05-1", my_prediction, "my_prediction", ("runs", "fails"), outcome, {
        "runs": "what does Triton ask of a block size (tl.arange's length, tl.dot's smallest tile)?",
        "fails": "the kernel masks rows and keys past each sequence's length, so a tile need not divide T or fit "
                 "inside it: which of Triton's own rules on block sizes do these tiles break?"})


def ex_05_2(my_shared_kib, measure: Callable[[], float]) -> Verdict:
    """my_shared_kib against the shared memory Triton allocates for Br=64, Bc=128 on sm_80 (KiB), within 1 KiB."""
    return numeric("05-2", my_shared_kib, "my_shared_kib", measure, abs_tol=1.0, unit="KiB",
                   against="what the compiler allocates",
                   above="from the Br=128, Bc=64 line: which tiles are staged in shared memory (of Q, K and V), "
                         "at 2 bytes per fp16 element, and which of them grow with Br and which with Bc?",
                   below="from the Br=128, Bc=64 line: which tiles are staged in shared memory, how many copies of "
                         "each (pipelining), and which of them grow with Bc?",
                   verified=lambda x, m: f"you predicted {x:g} KiB; the compiler allocates {m:.0f} KiB")
