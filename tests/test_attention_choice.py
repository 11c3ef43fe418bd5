"""btlib.kernels.choice: "auto" takes the kernel measured fastest here, checked first, cached like the GEMM rates.

The ranking rules are tested with a scripted clock (no timing in a test decides a verdict); one test measures
for real, on tiny cells, and asserts only what holds on any machine (every pick was timed and is a candidate).
"""

import json
import shutil

import pytest
import torch

import btlib
from btlib.kernels import choice, registry
from btlib.kernels import choice_measure as cm
from btlib.kernels.cpu import build


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """Measuring on, its cache in a fresh directory, tiny cells, nothing remembered from other tests."""
    monkeypatch.setenv(choice.MODE_VAR, "measure")
    monkeypatch.setattr(choice, "cache_file", lambda: tmp_path / "btlib_attention.json")  # the C++ build cache stays
    monkeypatch.setattr(cm, "CELLS", {"padded": (16, 64), "varlen": (16, 64)})
    monkeypatch.setattr(cm, "H", 2)
    monkeypatch.setattr(cm, "D", 16)
    monkeypatch.setattr(cm, "TOKENS", 64)
    choice.forget()
    yield tmp_path
    choice.forget()


def scripted(ms: dict, noise: float = 0.0, calls: list | None = None):
    """A timer that reports ms[name] (seconds per call x 1e3) for every round, spread by +-noise/2: no kernel runs."""
    def timer(fns, rounds):
        if calls is not None:
            calls.append((sorted(fns), rounds))
        t = {n: ms.get(n, 1.0) * 1e-3 for n in fns}
        return {n: [t[n] * (1 - noise / 2), t[n], t[n] * (1 + noise / 2)][:max(rounds, 1)] if rounds > 1 else [t[n]]
                for n in fns}
    return timer


def all_pass(monkeypatch):
    monkeypatch.setattr(cm, "_checked", lambda kernels, dtype: (list(kernels), {}))


def test_auto_follows_the_measurement_not_the_priority(measured, monkeypatch):
    all_pass(monkeypatch)
    # SDPA (priority 0) measured 3x faster than v3 (priority 10) in bf16: AMX Xeon's case
    t = choice.table(timer=scripted({"torch_sdpa": 1.0, "cpu_flash_v3": 3.0, "torch_sdpa_loop": 2.0, "cpu_flash_varlen": 1.0}))
    assert t.kept and t.source == "measured now"
    q = torch.randn(2, 2, 16, 16, dtype=torch.bfloat16)
    assert registry.select("padded", q, False, seqlen=16).name == "torch_sdpa"
    assert registry.select("varlen", q[0], False, seqlen=16).name == "cpu_flash_varlen"
    # what the call needs still rules: grad only for differentiable kernels, a bias only for those that take one
    assert registry.select("padded", q.requires_grad_(), False, seqlen=16).name == "torch_sdpa"
    why = choice.explain("padded", torch.bfloat16, 16)
    assert why.startswith("auto takes torch_sdpa for padded bf16 attention at T 16")
    assert "cpu_flash_v3 3 ms (3.00x)" in why and "(the cell for T <= 32)" in why


def test_a_higher_priority_within_the_tie_wins_and_a_far_slower_kernel_is_not_timed(measured, monkeypatch):
    all_pass(monkeypatch)
    rounds = []
    t = choice.table(timer=scripted({"torch_sdpa": 1.0, "cpu_flash_v3": 1.02, "torch_sdpa_loop": 10.0,
                                     "cpu_flash_varlen": 1.0}, calls=rounds))
    cell = t.cells[("padded", "fp32", 16)]
    assert cell.pick == "cpu_flash_v3" and "within the 3% tie" in cell.why()  # 2% slower, higher priority
    vcell = t.cells[("varlen", "fp32", 16)]
    assert vcell.order == ("cpu_flash_varlen",) and "torch_sdpa_loop" in vcell.skipped  # 10x at warm-up: not timed
    assert "10x the fastest's at T 16" in vcell.skipped["torch_sdpa_loop"]
    assert "torch_sdpa_loop" not in t.cells[("varlen", "fp32", 64)].ms  # nor at the larger T
    assert all(names for names, _ in rounds)


def test_the_cell_is_chosen_by_length_and_no_length_takes_the_best_over_all(measured, monkeypatch):
    all_pass(monkeypatch)
    times = {"torch_sdpa": 1.0, "cpu_flash_v3": 2.0}

    def timer(fns, rounds):  # SDPA wins at T 16, v3 at T 64 (the call's T is in the inputs' shape)
        t = {n: [times[n] * 1e-3] * max(rounds, 1) for n in fns}
        return t

    calls = []
    orig = cm._measure_cell

    def cell(layout, dname, T, kernels, skip, timer_):
        times.update({"torch_sdpa": 1.0, "cpu_flash_v3": 2.0} if T == 16 else {"torch_sdpa": 3.0, "cpu_flash_v3": 1.0})
        times.update({"torch_sdpa_loop": 1.0, "cpu_flash_varlen": 1.5})
        calls.append((layout, T))
        return orig(layout, dname, T, kernels, skip, timer_)

    monkeypatch.setattr(cm, "_measure_cell", cell)
    choice.table(timer=timer)
    assert cm.cell_for("padded", 1) == 16 and cm.cell_for("padded", 32) == 16 and cm.cell_for("padded", 33) == 64
    assert cm.cell_for("padded", 10_000) == 64 and cm.cell_for("padded", None) is None
    q = torch.randn(1, 2, 16, 16)
    assert registry.select("padded", q, False, seqlen=16).name == "torch_sdpa"
    assert registry.select("padded", q, False, seqlen=200).name == "cpu_flash_v3"
    # no length (the packed encoder picks once per dtype): the least time over the cells, as a geometric mean
    assert choice.ranking("padded", torch.float32, None, "cpu")[0] == "cpu_flash_v3"  # 2x slower once, 3x faster once
    assert choice.ranking("varlen", torch.float32, None, "cpu")[0] == "torch_sdpa_loop"
    assert choice.ranking("padded", torch.float64, 16, "cpu") is None  # fp64 is not measured: priority order
    assert choice.ranking("padded", torch.float32, 16, "meta") is None  # nor another device


def test_the_table_is_cached_on_disk_and_a_busy_measurement_is_not(measured, monkeypatch):
    all_pass(monkeypatch)
    fast = {"torch_sdpa": 1.0, "cpu_flash_v3": 2.0}
    choice.table(timer=scripted(fast))
    f = measured / "btlib_attention.json"
    entries = json.loads(f.read_text())
    assert len(entries) == 1
    (entry,) = entries.values()
    assert entry["machine"] == choice.table().machine and {c["layout"] for c in entry["cells"]} == {"padded", "varlen"}
    choice.forget()
    again = choice.table(timer=lambda *a: pytest.fail("measured again although the cache holds the table"))
    assert again.source.startswith("cached in btlib_attention.json") and again.cells.keys() == choice.table().cells.keys()
    # a hand-edited entry (a time that is not a time) is measured again
    entry["cells"][0]["ms"] = {"torch_sdpa": -1, "cpu_flash_v3": 2.0}
    f.write_text(json.dumps({k: entry for k in entries}))
    choice.forget()
    assert choice.table(timer=scripted(fast)).source == "measured now"
    # noise above NOISE_LIMIT even after the second, longer try: used in this process, never written
    f.unlink()
    choice.forget()
    rounds = []
    noisy = choice.table(timer=scripted(fast, noise=0.9, calls=rounds))
    assert not noisy.kept and "busy machine" in noisy.source and "noise ±90%" in noisy.source
    assert not f.exists()
    assert (["cpu_flash_v3", "torch_sdpa"], 2 * cm.ROUNDS) in rounds  # it tried again with twice the rounds
    # refresh measures again even with a good table in hand
    assert choice.table(refresh=True, timer=scripted(fast)).kept and f.exists()


def test_a_changed_kernel_in_a_family_folder_is_measured_again(tmp_path):
    """The cache key's digest covers the family folders (flash/, teaching/), not only the shared top-level sources."""
    root = tmp_path / "cpu"
    shutil.copytree(build.HERE, root, ignore=shutil.ignore_patterns("__pycache__"))
    digest = choice._sources.__wrapped__  # the package's digest is taken once per process
    before = digest(root)
    assert digest(root) == before  # a digest, not a clock
    (root / "flash" / "__init__.py").write_text("# a Python edit is no kernel change\n")
    assert digest(root) == before
    for header in ("flash/flash_lanes.h", "teaching/teaching.h", "vec.h"):
        (root / header).write_text((root / header).read_text() + "// edited\n")
        assert digest(root) != before, header
        before = digest(root)


def test_a_kernel_that_fails_its_check_is_never_timed_nor_taken(measured, monkeypatch):
    def checked(kernels, dtype):
        return [k for k in kernels if k.name != "cpu_flash_v3"], {"cpu_flash_v3": "failed its check: error 1e-2 > 1e-5"}

    monkeypatch.setattr(cm, "_checked", checked)
    t = choice.table(timer=scripted({"torch_sdpa": 5.0, "cpu_flash_v3": 1.0}))
    cell = t.cells[("padded", "fp32", 16)]
    assert cell.order == ("torch_sdpa",) and cell.skipped == {"cpu_flash_v3": "failed its check: error 1e-2 > 1e-5"}
    assert "cpu_flash_v3 not timed: failed its check" in cell.why()


def test_measuring_off_and_a_bad_mode_value(measured, monkeypatch):
    monkeypatch.setenv(choice.MODE_VAR, "priority")
    assert choice.ranking("padded", torch.float32, 16, "cpu") is None
    assert "measuring is off (BTLIB_ATTENTION_CHOICE=priority)" in choice.explain("padded", torch.float32, 16)
    monkeypatch.setenv(choice.MODE_VAR, "fastest")
    with pytest.raises(ValueError, match="BTLIB_ATTENTION_CHOICE must be 'measure'.*or 'priority'.*'fastest'"):
        btlib.attention(*torch.randn(3, 1, 1, 4, 8))


def test_a_real_measurement_on_tiny_cells(measured):
    """Real kernels, real clock: every cell's pick is a checked candidate that was timed, and auto runs it."""
    t = choice.table()
    assert set(t.cells) == {(lay, d, T) for lay in ("padded", "varlen") for d in ("fp32", "bf16") for T in (16, 64)}
    for (layout, dname, T), cell in t.cells.items():
        candidates = {k.name for k in registry.kernels(layout) if k.priority >= 0}
        assert cell.pick in candidates and cell.pick in cell.ms and set(cell.order) == set(cell.ms)
        assert all(v > 0 for v in cell.ms.values())
    q = torch.randn(2, 2, 16, 16)
    out = btlib.attention(q, q, q)
    assert torch.allclose(out, btlib.reference_attention(q, q, q), atol=1e-5)
    assert str(t).startswith("attention kernels measured on ") and "padded fp32 T <= 32" in str(t)
