"""Every exercise check (btlib.exercises) on a right answer, a wrong one and the committed baseline; every notebook's
committed check output is the baseline's "not attempted yet" line and nothing else.

The right answers live here, never in a notebook's output. A measured answer is fed a fake measurement (the check
compares with whatever the cell measured), so these tests time nothing; a wrong answer's hint must not hold the
expected value in any printed form.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import re
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
import torch

import btlib
from btlib import exercises
from btlib.blocks import tile_stats
from btlib.exercises.core import Verdict

# every check goes through exercises.check(name, ...), which dispatches into these two modules
TESTED_HERE = ["btlib.exercises.checks_01_05", "btlib.exercises.checks_06_09"]

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("0*.ipynb"))
CHECK_CALL = re.compile(r'exercises\.check\("(\d\d-\d)"')


@dataclass(frozen=True)
class FakeComparison:
    """What bench.compare returns, with the numbers chosen here."""

    ratio: float
    noise: float = 0.03

    @property
    def verdict(self) -> str:
        if max(self.ratio, 1 / self.ratio) - 1 <= self.noise:
            return "no clear difference"
        return "faster" if self.ratio > 1 else "slower"

    def __str__(self) -> str:
        return f"{self.ratio:.2f}x (noise ±{self.noise:.0%})"


def never():
    raise AssertionError("the check measured before the learner answered")


def renderings(answer) -> set[str]:
    """The ways a check could print ``answer``: as given, and a number in the formats the checks use."""
    if isinstance(answer, str):
        return {answer}
    if isinstance(answer, (tuple, list)):
        return set().union(*(renderings(a) for a in answer))
    x = float(answer)
    forms = {str(answer), f"{x:g}", f"{x:.0f}", f"{x:.1f}", f"{x:.2f}", f"{x:.3f}", f"{x:.3g}"}
    if 0 < x < 1:
        forms |= {f"{x:.0%}", f"{x:.1%}"}
    return forms


def hides(text: str, *answers) -> list[str]:
    """The renderings of ``answers`` that ``text`` shows (a number counts only as a whole number, not inside one)."""
    shown = []
    for form in set().union(*(renderings(a) for a in answers)):
        numeral = re.fullmatch(r"[\d.%]+", form)  # a number counts only standing alone: not 16 in fp16 or 45.5
        pattern = rf"(?<![\w.]){re.escape(form)}(?!\d|\.\d)" if numeral else re.escape(form)
        if re.search(pattern, text):
            shown.append(form)
    return shown


def assert_correct(v: Verdict, name: str):
    assert v.state == "correct", str(v)
    assert str(v).startswith(f"exercise {name}: correct: ") and len(v.text) > 10


def assert_not_yet(v: Verdict, name: str, *answers, says: str = ""):
    """A rejection: "not yet" with a hint of some length, which holds none of the expected ``answers``."""
    assert v.state == "not yet", str(v)
    assert str(v).startswith(f"exercise {name}: not yet: ") and len(v.text) > 20, str(v)
    assert hides(v.text, *answers) == [], f"the hint shows the answer: {v}"
    assert says in v.text, str(v)


def assert_not_attempted(v: Verdict, name: str):
    assert v.state == "not attempted yet", str(v)
    assert str(v).startswith(f"exercise {name}: not attempted yet (")


# --- the notebooks' own cells: baselines are fed from the committed exercise cells ---

def notebook(prefix: str):
    return nbformat.read(next(p for p in NOTEBOOKS if p.name.startswith(prefix)), as_version=4)


def cell_module(prefix: str, cell_id: str, tmp_path: Path, header: str = "import math\nimport torch\n"
                "import torch.nn.functional as F\nfrom torch import nn\n"):
    """The committed exercise cell as a module in a file (so inspect.getsource sees it, as in Jupyter)."""
    source = next(c for c in notebook(prefix).cells if c.get("id") == cell_id).source
    path = tmp_path / f"cell_{prefix}_{cell_id.replace('-', '_')}.py"
    path.write_text(header + source + "\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def committed_line(name: str) -> str:
    nb = notebook(name[:2])
    cell = next(c for c in nb.cells if c.cell_type == "code" and f'exercises.check("{name}"' in c.source)
    return cell.outputs[0]["text"]


def check_cells(nb) -> dict[str, dict]:
    return {m: c for c in nb.cells if c.cell_type == "code" for m in CHECK_CALL.findall(c.source)}


def committed_problems(nb, prefix: str) -> list[str]:
    """What is wrong with one notebook's committed exercise outputs: a check cell whose output is not exactly one
    stream line "exercise NN-K: not attempted yet (...)" (a verdict, a measurement or a solution printed), or
    an exercise cell with output."""
    problems = []
    cells = check_cells(nb)
    for name, cell in cells.items():
        outs = cell.outputs
        text = outs[0].get("text", "") if len(outs) == 1 and outs[0].output_type == "stream" else None
        if text is None or not re.fullmatch(rf"exercise {name}: not attempted yet \([^\n]*\)\n", text):
            problems.append(f"{prefix} {name}: committed output is not the unanswered line: {outs!r:.300}")
    if not cells:
        problems.append(f"{prefix}: no exercise check cell")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_committed_check_outputs_are_unanswered(path):
    nb = nbformat.read(path, as_version=4)
    assert committed_problems(nb, path.name[:2]) == []
    assert all(name.startswith(path.name[:2]) for name in check_cells(nb)), "a check cell names another notebook's exercise"
    for cell in check_cells(nb).values():
        assert cell.source.startswith("# NBVAL_CHECK_OUTPUT\n"), "the baseline line is deterministic: nbval checks it"


def test_every_exercise_has_one_check_cell_and_every_check_cell_one_exercise():
    names = [name for p in NOTEBOOKS for name in check_cells(nbformat.read(p, as_version=4))]
    assert sorted(names) == sorted(exercises.CHECKS)


def test_the_scan_fails_on_a_check_that_prints_its_answer():
    """The committed-output scan on notebook 09 with its 09-2 check cell run on the right answer, and with the
    unanswered line followed by the answer: both are caught."""
    for text in ("exercise 09-2: correct: 300 requests/s x 0.040 s = 12 requests in the system on average\n",
                 "exercise 09-2: not attempted yet (set answer_2)\nL = 12\n",
                 "exercise 09-2: not yet: answer_2 is 12.0\n"):
        nb = notebook("09")
        check_cells(nb)["09-2"].outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
        assert [p for p in committed_problems(nb, "09") if "09-2" in p], text
    nb = notebook("09")
    check_cells(nb)["09-1"].outputs.append(nbformat.v4.new_output("execute_result", data={"text/plain": "(1600, 284)"}))
    assert committed_problems(nb, "09")


def test_the_hint_test_fails_on_a_hint_that_holds_the_answer():
    with pytest.raises(AssertionError, match="shows the answer"):
        assert_not_yet(Verdict("09-2", "not yet", "below: 300 requests/s x 0.040 s is what you want"), "09-2", 12.0, 0.04)
    with pytest.raises(AssertionError, match="shows the answer"):
        assert_not_yet(Verdict("09-1", "not yet", "padded tokens: it is 1600, recount the packed ones"), "09-1", (1600, 284))
    assert hides("fp16 tiles of Br=128", 16.0, 12.0) == []  # a number inside another is not shown


# --- each exercise: baseline, right, wrong ---

def test_01_1(tmp_path):
    cell = cell_module("01", "e1a2b3c5", tmp_path)
    assert str(exercises.check("01-1", cell.window_mask, cell.masked_attention)) == committed_line("01-1").rstrip("\n")

    def window(T, w):
        i = torch.arange(T)
        return (i[:, None] - i[None, :]).abs() <= w

    def window_strict(T, w):  # forgets the keys exactly w away
        i = torch.arange(T)
        return (i[:, None] - i[None, :]).abs() < w

    def causal_window(T, w):  # one side only
        i = torch.arange(T)
        return ((i[:, None] - i[None, :]) <= w) & ((i[:, None] - i[None, :]) >= 0)

    assert_correct(exercises.check("01-1", window, cell.masked_attention), "01-1")
    assert_not_yet(exercises.check("01-1", window_strict, cell.masked_attention), "01-1", "<= w", says="forbids")
    assert_not_yet(exercises.check("01-1", causal_window, cell.masked_attention), "01-1", says="forbids")
    assert_not_yet(exercises.check("01-1", lambda T, w: window(T, w + 1), cell.masked_attention), "01-1", says="allows")
    assert_not_yet(exercises.check("01-1", lambda T, w: window(T, w).int(), cell.masked_attention), "01-1", says="bool")
    broken = lambda q, k, v, allowed: (q @ k.transpose(-2, -1)).softmax(-1) @ v  # drops the mask and the scale
    assert_not_yet(exercises.check("01-1", window, broken), "01-1", says="masked_attention")


def test_01_2():
    assert str(exercises.check("01-2", None, never)) == committed_line("01-2").rstrip("\n")
    measured = 431.5  # MiB, as the cell would measure
    assert_correct(exercises.check("01-2", 400, lambda: measured), "01-2")
    assert_not_yet(exercises.check("01-2", 200, lambda: measured), "01-2", measured, says="below")
    assert_not_yet(exercises.check("01-2", 900, lambda: measured), "01-2", measured, says="above")
    assert_not_yet(exercises.check("01-2", "a lot", lambda: measured), "01-2", measured, says="number")


def test_02_1():
    padding = 0.6537
    assert exercises.check("02-1", None, never, padding=padding).state == "not attempted yet"
    assert committed_line("02-1").startswith("exercise 02-1: not attempted yet (set predicted_speedup; your batch is ")
    c = FakeComparison(2.31, noise=0.04)
    assert_correct(exercises.check("02-1", 2.0, lambda: c, padding=padding), "02-1")
    assert_correct(exercises.check("02-1", 2.6, lambda: c, padding=padding), "02-1")
    assert_not_yet(exercises.check("02-1", 2.89, lambda: c, padding=padding), "02-1", c.ratio, says="above")
    assert_not_yet(exercises.check("02-1", 1.2, lambda: FakeComparison(2.31, 0.3), padding=padding), "02-1", 2.31,
                   says="below")
    assert_correct(exercises.check("02-1", 1.7, lambda: FakeComparison(2.31, 0.3), padding=padding), "02-1")  # the noise


def test_02_2(tmp_path):
    cell = cell_module("02", "f2a0c00a", tmp_path)
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2).eval()
    x, mask = torch.randn(2, 5, 16), torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 3:] = True
    original = (enc, x, mask)

    def run(triple):
        e, xb, mb = triple
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")
            return btlib.explain_fastpath(e, xb, mb), btlib.ops_that_ran(lambda: e(xb, src_key_padding_mask=mb))

    def made(change):
        return change(copy.deepcopy(enc), x.clone(), mask.clone())

    baseline = made(cell.break_it)
    assert str(exercises.check("02-2", original, baseline, never)) == committed_line("02-2").rstrip("\n")

    def train(e, xb, mb):
        return e.train(), xb, mb

    def norm_first(e, xb, mb):  # read when the encoder is built: set afterwards, the fused layer takes it in its stride
        e.layers[0].norm_first = True
        return e, xb, mb

    def weights(e, xb, mb):  # changes the encoder, but nothing the fastpath looks at
        with torch.no_grad():
            e.layers[0].linear1.weight.mul_(2)
        return e, xb, mb

    v = exercises.check("02-2", original, made(train), run)
    assert_correct(v, "02-2")
    assert "training mode" in v.text, v  # the explainer's reason is quoted
    for wrong in (weights, norm_first):
        assert_not_yet(exercises.check("02-2", original, made(wrong), run), "02-2", "eval", says="still runs")


def test_03_1():
    assert str(exercises.check("03-1", 128, None, never)) == committed_line("03-1").rstrip("\n")
    faster = lambda T: FakeComparison(1.4)
    assert_correct(exercises.check("03-1", 512, "faster", faster), "03-1")
    assert_not_yet(exercises.check("03-1", 512, "no clear difference", faster), "03-1", "faster", "1.40x")
    assert_not_yet(exercises.check("03-1", 512, "slower", faster), "03-1", "faster")
    same = lambda T: FakeComparison(1.01)
    assert_correct(exercises.check("03-1", 128, "no clear difference", same), "03-1")
    assert_not_yet(exercises.check("03-1", 128, "faster", same), "03-1", "no clear difference")
    assert_not_yet(exercises.check("03-1", 128, "quicker", same), "03-1", says="one of")  # lists the choices


def test_03_2(tmp_path):
    cell = cell_module("03", "c0a5f00c", tmp_path)
    assert str(exercises.check("03-2", cell.my_mha_call)) == committed_line("03-2").rstrip("\n")

    def right(mha, x):  # off the fastpath (autograd on) and without the weights: MHA calls SDPA
        return mha(x, x, x, need_weights=False)[0]

    def one_of_two(mha, x):  # need_weights=False alone: the CPU fastpath never calls SDPA
        with torch.inference_mode():
            return mha(x, x, x, need_weights=False)[0]

    def other_output(mha, x):
        return mha(x, x, x, need_weights=False)[0] * 2

    assert_correct(exercises.check("03-2", right), "03-2")
    assert_not_yet(exercises.check("03-2", one_of_two), "03-2", "need_weights=False", "inference_mode", says="need_weights")
    assert_not_yet(exercises.check("03-2", other_output), "03-2", "need_weights=False", says="output")


def test_03_3(tmp_path):
    cell = cell_module("03", "c0a5f00f", tmp_path)
    assert str(exercises.check("03-3", cell.my_peak_bytes, never)) == committed_line("03-3").rstrip("\n")
    from btlib.bench import peak_memory
    from btlib.reference import naive_attention
    qe, ke, ve = (torch.randn(2, 4, 300, 64, generator=torch.Generator().manual_seed(i)) for i in range(3))
    causal = torch.ones(300, 300, dtype=torch.bool).tril()
    measure = lambda: peak_memory(lambda: naive_attention(qe, ke, ve, causal))
    # masked_fill's scores, the fp32 softmax and its nan_to_num copy are alive at once; the output comes after the
    # softmax's first copy is gone
    three_scores = lambda B, H, T, D: 4 * 3 * B * H * T * T
    unmasked = lambda B, H, T, D: 4 * (2 * B * H * T * T + B * H * T * D)  # the no-mask call's peak: a wrong answer here
    assert_correct(exercises.check("03-3", three_scores, measure), "03-3")
    v = exercises.check("03-3", unmasked, measure)
    assert_not_yet(v, "03-3", three_scores(2, 4, 300, 64), three_scores(2, 4, 300, 64) / 2**20, says="below")
    assert_not_yet(exercises.check("03-3", lambda B, H, T, D: 1 / 0, measure), "03-3", says="ZeroDivisionError")


def test_04_1():
    assert str(exercises.check("04-1", 64, 64, None, never)) == committed_line("04-1").rstrip("\n")
    slower = lambda: FakeComparison(0.8)
    assert_correct(exercises.check("04-1", 256, 64, "slower", slower), "04-1")
    assert_not_yet(exercises.check("04-1", 256, 64, "faster", slower), "04-1", "slower", "1.25x", "0.80x")
    assert_not_yet(exercises.check("04-1", 64, 64, "faster", never), "04-1", says="BC")

    def no_build():
        raise exercises.NotYet("the copy with Bc=100 did not build (error: static assertion failed): Bc must be a "
                               "multiple of kNV * W")
    assert_not_yet(exercises.check("04-1", 100, 64, "faster", no_build), "04-1", says="did not build")


def test_04_2():
    assert str(exercises.check("04-2", None, never)) == committed_line("04-2").rstrip("\n")
    measured = 123.4
    assert_correct(exercises.check("04-2", 140, lambda: measured), "04-2")
    assert_not_yet(exercises.check("04-2", 60, lambda: measured), "04-2", measured, says="below")
    assert_not_yet(exercises.check("04-2", 400, lambda: measured), "04-2", measured, says="above")


def windowed_online_softmax(q, k, v, window, Bc=16, guard=True):
    """The Reference section's online softmax with the causal window i - window < j <= i; guard=False leaves out
    the fully-masked-row guard (exp(-inf + inf) = NaN)."""
    B, H, T, D = q.shape
    m = torch.full((B, H, T, 1), -math.inf)
    l = torch.zeros(B, H, T, 1)
    o = torch.zeros(B, H, T, D)
    i = torch.arange(T)[:, None]
    for j0 in range(0, k.shape[2], Bc):
        j = torch.arange(j0, min(j0 + Bc, k.shape[2]))[None, :]
        S = q @ k[:, :, j0:j0 + Bc].transpose(-2, -1) / math.sqrt(D)
        S = S.masked_fill(~((j <= i) & (j > i - window)), -math.inf)
        m_new = torch.maximum(m, S.amax(-1, keepdim=True))
        safe = torch.where(m_new == -math.inf, 0.0, m_new) if guard else m_new  # all masked so far: no rescale
        alpha = torch.exp(m - safe)
        P = torch.exp(S - safe)
        l = alpha * l + P.sum(-1, keepdim=True)
        o = alpha * o + P @ v[:, :, j0:j0 + Bc]
        m = m_new
    return o / l


def test_04_3(tmp_path):
    cell = cell_module("04", "ce6b0d48", tmp_path)
    assert str(exercises.check("04-3", cell.online_softmax_attention_window, 8)) == committed_line("04-3").rstrip("\n")
    assert_correct(exercises.check("04-3", windowed_online_softmax, 8), "04-3")
    nan = lambda q, k, v, w, Bc: windowed_online_softmax(q, k, v, w, Bc, guard=False)
    assert_not_yet(exercises.check("04-3", nan, 8), "04-3", says="NaN")
    off_by_one = lambda q, k, v, w, Bc: windowed_online_softmax(q, k, v, w + 1, Bc)
    assert_not_yet(exercises.check("04-3", off_by_one, 8), "04-3", "j > i - window", says="differs")


def test_05_1():
    assert str(exercises.check("05-1", {"Br": 32, "Bc": 32}, None, never)) == committed_line("05-1").rstrip("\n")
    fails = lambda: ("fails", "causal=False: Triton refused: CompilationError: arange's range must be a power of 2")
    assert_correct(exercises.check("05-1", {"Br": 48, "Bc": 32}, "fails", fails), "05-1")
    assert_not_yet(exercises.check("05-1", {"Br": 48, "Bc": 32}, "runs", fails), "05-1", "fails", "refused", "power of 2")
    runs = lambda: ("runs", "matches the reference (rel. error < 1e-5), causal and not")
    assert_not_yet(exercises.check("05-1", {"Br": 32, "Bc": 128}, "fails", runs), "05-1", "runs", "matches")

    def no_triton():
        raise exercises.Unavailable("needs triton: No module named 'triton'")
    assert exercises.check("05-1", {"Br": 32, "Bc": 128}, "runs", no_triton).state == "cannot be checked here"


def test_05_2():
    assert str(exercises.check("05-2", None, never)) == committed_line("05-2").rstrip("\n")
    kib = 37.0
    assert_correct(exercises.check("05-2", 37.5, lambda: kib), "05-2")
    assert_not_yet(exercises.check("05-2", 48, lambda: kib), "05-2", kib, says="above")
    assert_not_yet(exercises.check("05-2", 24, lambda: kib), "05-2", kib, says="below")


CFG = types.SimpleNamespace(d_model=64, dim_feedforward=256, num_layers=2)


def flop_speedup(lengths, T, cfg):
    """FLOPs(padded) / FLOPs(packed): linear layers per token, attention 4 L^2 d per sequence (T^2 when padded)."""
    d, ff = cfg.d_model, cfg.dim_feedforward
    L = lengths.double()
    padded = len(L) * T * (8 * d * d + 4 * d * ff) + len(L) * 4 * T * T * d
    packed = float(L.sum()) * (8 * d * d + 4 * d * ff) + float((4 * L * L * d).sum())
    return padded / packed


def test_06_1(tmp_path):
    cell = cell_module("06", "ex1-06", tmp_path)
    assert str(exercises.check("06-1", cell.predicted_speedup, CFG, 8, 128, never)) == committed_line("06-1").rstrip("\n")
    v = exercises.check("06-1", flop_speedup, CFG, 8, 128, lambda: "btlib_packed against the dense fastpath 2.50x")
    assert_correct(v, "06-1")
    assert v.text.endswith("2.50x")

    def attention_unpadded(lengths, T, cfg):  # forgets that a padded sequence pays attention over all of T
        d, ff = cfg.d_model, cfg.dim_feedforward
        L = lengths.double()
        return (len(L) * T * (8 * d * d + 4 * d * ff) + float((4 * L * L * d).sum())) / \
               (float(L.sum()) * (8 * d * d + 4 * d * ff) + float((4 * L * L * d).sum()))

    want = flop_speedup(btlib.uniform_lengths(8, 128, 0.6), 128, CFG)
    assert_not_yet(exercises.check("06-1", attention_unpadded, CFG, 8, 128, never), "06-1", want, says="below")


def test_06_2():
    assert str(exercises.check("06-2", None, never)) == committed_line("06-2").rstrip("\n")
    zipf = lambda: ("zipf", "at 80% padding, packed against the fastpath: Zipf 4.90x, uniform 4.50x")
    assert_correct(exercises.check("06-2", "zipf", zipf), "06-2")
    for wrong in ("uniform", "same"):
        assert_not_yet(exercises.check("06-2", wrong, zipf), "06-2", "zipf", "4.90x")
    assert_not_yet(exercises.check("06-2", "Zipf", zipf), "06-2", says="one of")


def test_07_1():
    assert str(exercises.check("07-1", None, never)) == committed_line("07-1").rstrip("\n")
    c = FakeComparison(3.66, noise=0.07)
    assert_correct(exercises.check("07-1", 3.3, lambda: c), "07-1")
    assert_not_yet(exercises.check("07-1", 2.5, lambda: c), "07-1", c.ratio, says="below")
    assert_not_yet(exercises.check("07-1", 5.0, lambda: c), "07-1", c.ratio, says="above")


def pooling_case():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 1, 7, 4, 2])
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    h = torch.randn(int(lengths.sum()), 16, generator=g)
    expected = torch.stack([h[s:e].mean(0) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())])
    return h, cu, torch.nn.functional.normalize(expected, dim=-1)


def vector_pool(h, cu_seqlens):
    counts = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    sentence = torch.repeat_interleave(torch.arange(len(counts)), counts)  # (total,) sentence of each token
    sums = torch.zeros(len(counts), h.shape[1], dtype=h.dtype).index_add_(0, sentence, h)
    return torch.nn.functional.normalize(sums / counts[:, None], dim=-1)


def test_07_2(tmp_path):
    cell = cell_module("07", "ex2-07", tmp_path)
    assert str(exercises.check("07-2", cell.pool, never)) == committed_line("07-2").rstrip("\n")
    assert_correct(exercises.check("07-2", vector_pool, pooling_case), "07-2")

    def other_loop(h, cu_seqlens):
        out = [h[int(cu_seqlens[n]):int(cu_seqlens[n + 1])].mean(0) for n in range(len(cu_seqlens) - 1)]
        return torch.nn.functional.normalize(torch.stack(out), dim=-1)

    def cls(h, cu_seqlens):
        return torch.nn.functional.normalize(h[cu_seqlens[:-1].long()], dim=-1)

    def unnormalised(h, cu_seqlens):
        return vector_pool(h, cu_seqlens) * 2

    assert_not_yet(exercises.check("07-2", other_loop, pooling_case), "07-2", "index_add_(0, sentence", says="loop")
    assert_not_yet(exercises.check("07-2", cls, pooling_case), "07-2", says="differs")
    assert_not_yet(exercises.check("07-2", unnormalised, pooling_case), "07-2", says="differs")


ALIVE_08_1 = 1 + 2 + 14 * 3  # query block 0 touches 1 key tile, block 1 two, every later block its own and two before


def test_08_1():
    assert tile_stats([1024], causal=True, window=(128, 0)).alive == ALIVE_08_1  # the count above is the checker's
    assert str(exercises.check("08-1", None)) == committed_line("08-1").rstrip("\n")
    assert_correct(exercises.check("08-1", ALIVE_08_1), "08-1")
    assert_not_yet(exercises.check("08-1", 48), "08-1", ALIVE_08_1, says="above")
    assert_not_yet(exercises.check("08-1", 16 * 3 - 6), "08-1", ALIVE_08_1, says="below")
    assert_not_yet(exercises.check("08-1", 45.5), "08-1", ALIVE_08_1, says="whole number")


BEST_08_2 = (16, 0.896)  # tiles of 16 on 8,192 tokens with a (64, 64) window: 129 allowed keys of about 144 computed


def test_08_2():
    assert str(exercises.check("08-2", None, (64, 64))) == committed_line("08-2").rstrip("\n")
    assert_correct(exercises.check("08-2", BEST_08_2, (64, 64)), "08-2")
    assert_correct(exercises.check("08-2", (16, 0.88), (64, 64)), "08-2")
    assert_not_yet(exercises.check("08-2", (64, 0.67), (64, 64)), "08-2", 16, "0.896", "90%", says="wastes least")
    assert_not_yet(exercises.check("08-2", (16, 0.67), (64, 64)), "08-2", "0.896", "90%", says="below")
    assert_not_yet(exercises.check("08-2", 16, (64, 64)), "08-2", says="tile size, efficiency")


def test_08_3():
    assert str(exercises.check("08-3", None, never)) == committed_line("08-3").rstrip("\n")
    point = types.SimpleNamespace(tiles_speedup=6.4, pairs_speedup=15.8, measured_speedup=4.7)
    assert_correct(exercises.check("08-3", 6.3, lambda: point), "08-3")   # the tile model's count
    assert_correct(exercises.check("08-3", 5.2, lambda: point), "08-3")   # near the measurement
    assert_not_yet(exercises.check("08-3", 15.8, lambda: point), "08-3", 4.7, 6.4, says="above")
    assert_not_yet(exercises.check("08-3", 2.0, lambda: point), "08-3", 4.7, 6.4, says="below")


def test_09_1():
    assert str(exercises.check("09-1", None)) == committed_line("09-1").rstrip("\n")
    assert_correct(exercises.check("09-1", (1600, 284)), "09-1")
    assert_not_yet(exercises.check("09-1", (1600, 1600)), "09-1", 284, says="packed")
    assert_not_yet(exercises.check("09-1", (284, 284)), "09-1", 1600, says="padded")
    assert_not_yet(exercises.check("09-1", 1884), "09-1", 1600, 284, says="(padded tokens, packed tokens)")


def test_09_2():
    assert str(exercises.check("09-2", None)) == committed_line("09-2").rstrip("\n")
    assert_correct(exercises.check("09-2", 12.0), "09-2")
    assert_not_yet(exercises.check("09-2", 12000), "09-2", 12.0, says="above")
    assert_not_yet(exercises.check("09-2", 7.5), "09-2", 12.0, says="below")


def test_09_3():
    assert str(exercises.check("09-3", None, 5.0, 0.1)) == committed_line("09-3").rstrip("\n")
    want = 16 / ((5.0 + 0.1 * 16 * 14) / 1e3)  # 584 requests/s
    assert_correct(exercises.check("09-3", 580, 5.0, 0.1), "09-3")
    assert_not_yet(exercises.check("09-3", 16 / (5.0 / 1e3), 5.0, 0.1), "09-3", want, says="above")
    assert_not_yet(exercises.check("09-3", 16 / (5.0 + 0.1 * 16 * 14), 5.0, 0.1), "09-3", want, says="below")


def test_an_unknown_exercise_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match="01-1"):
        exercises.check("10-1", 1)
