"""btlib.explain_sdpa against what SDPA actually runs, the GPT block's two attentions, and the sdpa benchmarks.

Also the tests of btlib.sdpa.forced: run_forced (with sdpa_ops, catch_messages, clean_messages) is the forced run
every explainer verdict is compared with, dense and jagged, on every backend.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from btlib import ops_that_ran, padded_to_nested
from btlib.bench import run
from btlib.reference import naive_attention
from btlib.kernels import relative_error
from btlib.models.gpt import GPTConfig, build_gpt, gpt_batch, train_step, with_attention
from btlib.sdpa import BACKENDS, explain_sdpa, run_forced, sdpa_ops

# explain_sdpa and run_forced through btlib.sdpa; the sdpa benchmarks through load_all.
TESTED_HERE = ["btlib.sdpa.explain", "btlib.sdpa.forced", "btlib.bench.sdpa"]

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu,
                                               pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]
B, H, T, D = 2, 4, 16, 32


def _case(name: str, device: str) -> tuple[tuple, dict]:
    """SDPA arguments for one named case: q, k, v (B, H, T, D) and keyword arguments."""
    g = torch.Generator().manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}.get(name, torch.float32)
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(device, dtype) for _ in range(3))
    keep = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    kw = {
        "bool_mask": {"attn_mask": keep},
        "float_mask": {"attn_mask": torch.zeros(T, T, device=device).masked_fill(~keep, float("-inf"))},
        "mask_4d": {"attn_mask": keep.expand(B, 1, T, T)},
        "mask_3d": {"attn_mask": keep.expand(H, T, T)},  # broadcasts as (1, H, T, S); the fused CPU kernel refuses 3-D
        "causal": {"is_causal": True},
        "dropout": {"dropout_p": 0.2},
        "scale": {"scale": 0.3},
    }.get(name, {})
    if name == "gqa":
        k, v = k[:, :2], v[:, :2]
        kw = {"enable_gqa": True}
    if name == "head_dim_mismatch":
        v = v[..., :16].contiguous()
    if name == "last_dim_stride":
        q = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    if name == "requires_grad":
        q.requires_grad_()
    return (q, k, v), kw


CASES = ["fp32", "bf16", "fp16", "fp64", "bool_mask", "float_mask", "mask_4d", "mask_3d", "causal", "dropout",
         "scale", "gqa", "head_dim_mismatch", "last_dim_stride", "requires_grad"]


def _agree(report, args, kwargs) -> None:
    ops = ops_that_ran(lambda: F.scaled_dot_product_attention(*args, **kwargs))
    assert report.confirm(ops) == [], f"{report}\nran: {sdpa_ops(ops)}"
    for b in BACKENDS:
        forced = run_forced(b, *args, **kwargs)
        assert report.accepted(b) == forced.ran, f"{b}: explainer {report.reasons[b]} vs forced run {forced}"
        if forced.ran:
            assert forced.ops == [report.op(b)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CASES)
def test_explainer_agrees_with_profiler_and_forced_runs(name, device):
    args, kwargs = _case(name, device)
    report = explain_sdpa(*args, **kwargs)
    assert report.chosen in BACKENDS and report.expected_op is not None
    for b in BACKENDS:  # reasons are non-empty exactly when a backend is refused
        assert report.accepted(b) == (report.reasons[b] == [])
        assert all(isinstance(r, str) and r for r in report.reasons[b])
    assert report.accepted(report.chosen)
    _agree(report, args, kwargs)


def test_cpu_refusals_name_their_cause():
    cases = {"dropout": "dropout", "mask_3d": "mask", "last_dim_stride": "stride", "head_dim_mismatch": "last dimension"}
    for name, word in cases.items():
        args, kwargs = _case(name, "cpu")
        r = explain_sdpa(*args, **kwargs)
        assert r.chosen == "MATH" and word in " ".join(r.reasons["FLASH_ATTENTION"]).lower(), str(r)


def test_disabled_backend_is_a_reason():
    args, kwargs = _case("fp32", "cpu")
    with sdpa_kernel([SDPBackend.MATH]):
        r = explain_sdpa(*args)
        ops = ops_that_ran(lambda: F.scaled_dot_product_attention(*args))
    assert r.chosen == "MATH" and any("disabled" in why for why in r.reasons["FLASH_ATTENTION"])
    assert r.confirm(ops) == []


def _jagged(device: str, requires_grad: bool = False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 10, H, D, generator=g).to(device)  # (B, T, H, D)
    nt = padded_to_nested(x, torch.tensor([3, 10, 1], device=device)).transpose(1, 2)  # (B, H, j, D)
    return nt.detach().requires_grad_(requires_grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kwargs", [{}, {"dropout_p": 0.2}, {"is_causal": True}, {"attn_mask": "mask"}],
                         ids=["plain", "dropout", "causal", "mask"])
def test_jagged_inputs(device, kwargs):
    nt = _jagged(device)
    if kwargs.get("attn_mask") == "mask":
        kwargs = {"attn_mask": torch.ones(10, 10, dtype=torch.bool, device=device)}
    report = explain_sdpa(nt, nt, nt, **kwargs)
    assert report.layout == "jagged"
    for b in BACKENDS:
        assert report.accepted(b) == (report.reasons[b] == [])
    with torch.no_grad():
        if report.chosen is None:
            with pytest.raises((RuntimeError, ValueError)):
                F.scaled_dot_product_attention(nt, nt, nt, **kwargs)
            assert not any(report.accepted(b) for b in BACKENDS)
        else:
            _agree(report, (nt, nt, nt), kwargs)


def test_strided_nested_inputs():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The PyTorch API of nested tensors is in prototype stage", once per process
        nt = torch.nested.nested_tensor([torch.randn(H, L, D) for L in (3, 5)])  # the old layout, (B, H, j, D)
    r = explain_sdpa(nt, nt, nt)
    assert r.layout == "strided nested" and not r.accepted("FLASH_ATTENTION")
    _agree(r, (nt, nt, nt), {})


def test_jagged_with_ragged_dim_1_is_flagged():
    nt = _jagged("cpu").transpose(1, 2)  # (B, j, H, D): SDPA would attend across heads
    r = explain_sdpa(nt, nt, nt)
    assert any("across heads" in n for n in r.notes)


def test_gpt_sdpa_and_naive_match():
    cfg = GPTConfig(d_model=64, n_head=4, block_size=32)
    sdpa = build_gpt(cfg, "sdpa")
    naive = with_attention(sdpa, "naive")
    idx, targets = gpt_batch(cfg, 4)
    opt_s, opt_n = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (sdpa, naive))
    for _ in range(3):  # a few optimizer steps: the two stay the same function
        ls, gs = train_step(sdpa, idx, targets, opt_s)
        ln, gn = train_step(naive, idx, targets, opt_n)
        assert relative_error(ls, ln) < 1e-5 and relative_error(gs, gn) < 1e-5
    ops = ops_that_ran(lambda: train_step(sdpa, idx, targets))
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in ops
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops


@pytest.mark.parametrize("name", ["sdpa_backends", "sdpa_causal", "mha_need_weights", "mha_masks", "gpt_train",
                                  pytest.param("gpt_compile", marks=pytest.mark.slow)])
def test_sdpa_benchmarks_check_out(name):
    from btlib.bench import load_all

    bench = load_all()[name]
    rows = run(bench, quick=True, warmup=0, min_runs=1, max_runs=1)
    assert rows and not [r for r in rows if r["status"] == "wrong"]
    assert any(r["status"] == "ok" for r in rows)


def test_constraint_table_messages_are_in_this_torch():
    """Every row said to be checked by the installed torch names a message that torch really carries."""
    from btlib.sdpa.constraints import CONSTRAINTS, constraint_table, evidence

    installed = [r for r in CONSTRAINTS if r.how == "installed"]
    assert installed and all(r.found_in for r in installed)
    found = {r.topic: evidence(r) for r in installed}
    if None in found.values():
        pytest.skip(f"this torch ships no copy of a checked file: {found}")
    assert all(found.values()), found
    assert constraint_table().count("\n") == len(CONSTRAINTS) + 1


def test_constraint_rows_say_which_part_their_message_proves():
    """A row whose "today" entry covers several kernels names the part its one message proves (a piece of the entry
    itself) and how the rest is known, and the table prints both: one message never vouches for a whole row."""
    from btlib.sdpa.constraints import CONSTRAINTS, constraint_table

    partial = [r for r in CONSTRAINTS if r.proves is not None]
    assert {r.topic for r in partial} >= {"attn_mask", "dropout", "nested inputs"}
    table = constraint_table()
    for r in partial:
        assert r.how == "installed" and r.proves in r.today and r.rest, r
        assert f"*{r.proves}*" in table and r.rest in table
