"""btlib.sdpa.forced on its own: the pieces run_forced is made of, on small odd shapes on the CPU.

test_sdpa.py compares run_forced with explain_sdpa on every backend; here each helper is held to a plain
expectation: clean_messages drops torch's headers and source locations, sdpa_ops keeps only the SDPA backend ops,
catch_messages collects warnings and the nested-SDPA logger without letting them out, forced_backend refuses an
unknown name, and run_forced reports the op that ran or torch's refusal.
"""

import logging
import warnings

import pytest
import torch
import torch.nn.functional as F

from btlib import _torch_private as tp
from btlib.sdpa.forced import BACKENDS, SDPA_OPS, ForcedRun, catch_messages, clean_messages, forced_backend, run_forced, sdpa_ops



def test_clean_messages_drops_headers_and_locations_and_repeats():
    raw = ["Memory efficient kernel not used because:",
           "Flash attention requires q and k to have the same head dim (Triggered internally at /pytorch/aten/sdp_utils.cpp:12.)",
           "Flash attention requires q and k to have the same head dim",
           "  ", "No available kernel. Aborting execution."]
    assert clean_messages(raw) == ["Flash attention requires q and k to have the same head dim",
                                   "No available kernel. Aborting execution."]


def test_sdpa_ops_keeps_backend_ops_only():
    math_op = SDPA_OPS[("cpu", "dense")]["MATH"]
    flash_op = SDPA_OPS[("cpu", "dense")]["FLASH_ATTENTION"]
    assert sdpa_ops(["aten::mm", flash_op, math_op, math_op, "aten::softmax"]) == sorted([flash_op, math_op])
    assert sdpa_ops([]) == []


def test_sdpa_ops_of_a_query_keeps_its_device_and_layouts_ops():
    """On a GPU a dense call records the dense op and the kernel it calls, which is the jagged layout's op
    (aten::_scaled_dot_product_efficient_attention, then aten::_efficient_attention_forward): given q, only the first."""
    dense, inner = SDPA_OPS[("cuda", "dense")]["EFFICIENT_ATTENTION"], SDPA_OPS[("any", "jagged")]["EFFICIENT_ATTENTION"]
    q = torch.zeros(1, 1, 2, 8)
    assert sdpa_ops([dense, inner]) == sorted([dense, inner])
    assert sdpa_ops([SDPA_OPS[("cpu", "dense")]["MATH"], inner], q) == [SDPA_OPS[("cpu", "dense")]["MATH"]]
    nested = torch.nested.nested_tensor([torch.zeros(1, 2, 8), torch.zeros(1, 3, 8)], layout=torch.jagged)
    assert sdpa_ops([dense, inner], nested) == [inner]


def test_catch_messages_collects_warnings_and_the_logger_quietly():
    log = logging.getLogger(tp.NESTED_SDPA_LOGGER)
    propagate = log.propagate
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        with catch_messages() as messages:
            warnings.warn("from TORCH_WARN")
            log.warning("from the nested gate")
    assert messages == ["from TORCH_WARN", "from the nested gate"] and outside == []
    assert log.propagate == propagate and not log.handlers


def test_forced_backend_refuses_an_unknown_name():
    with pytest.raises(ValueError, match="FLASH_ATTENTION"):
        forced_backend("FLASH")


q = torch.randn(1, 3, 7, 24)  # odd T, head dim not a power of two


def test_math_and_cpu_flash_run_and_name_their_op():
    for backend in ("MATH", "FLASH_ATTENTION"):
        r = run_forced(backend, q, q, q)
        assert isinstance(r, ForcedRun) and r.ran and r.ops == [SDPA_OPS[("cpu", "dense")][backend]], r
        assert str(r).startswith(backend) and "ran " in str(r)


def test_forced_backend_really_forces():
    with forced_backend("MATH"):
        out = F.scaled_dot_product_attention(q, q, q)
    torch.testing.assert_close(out, torch.softmax(q @ q.transpose(-1, -2) / 24**0.5, -1) @ q)


def test_a_backend_without_a_cpu_kernel_is_refused_with_torchs_reason():
    r = run_forced("EFFICIENT_ATTENTION", q, q, q)
    assert not r.ran and r.ops == [] and r.messages, r
    assert "refused: " in str(r) and "Triggered internally" not in str(r)
    assert set(BACKENDS) == {"FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"}
