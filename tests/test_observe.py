"""btlib.observe: ops_that_ran names the aten ops that really ran, quiet_profile silences only its own
start/stop, and run_slow is the plain-module path (fastpath off, inference mode, setting restored)."""

import os

import pytest
import torch
from torch import nn

from btlib.observe import _silence_fd2, ops_that_ran, quiet_profile, run_slow

FASTPATH_OP = "aten::_transformer_encoder_layer_fwd"


def test_ops_that_ran_names_the_ops_of_the_call():
    a, b = torch.randn(97, 5), torch.randn(5, 1)
    assert "aten::mm" in ops_that_ran(lambda: a @ b)
    ops = ops_that_ran(lambda: torch.relu(a) + 1)
    assert {"aten::relu", "aten::add"} <= ops and "aten::mm" not in ops
    assert not any(op.startswith("aten::") for op in ops_that_ran(lambda: None))
    with pytest.raises(ZeroDivisionError):  # the call's error reaches the caller, and the profiler stops
        ops_that_ran(lambda: 1 / 0)
    assert "aten::mm" in ops_that_ran(lambda: a @ b)


def test_silence_fd2_drops_c_level_stderr_and_restores_it(capfd):
    with _silence_fd2():
        os.write(2, b"USDT: profiler_start\n")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"


def test_quiet_profile_records_and_prints_nothing(capfd):
    x = torch.randn(1, 97)
    with quiet_profile() as prof:
        x.sum()
    assert "aten::sum" in {e.key for e in prof.key_averages()}
    assert capfd.readouterr().err == ""


def _layer(d=16, nhead=2):
    return nn.TransformerEncoderLayer(d, nhead, 32, dropout=0.0, batch_first=True).eval()


@pytest.mark.parametrize("B, T, lengths", [(1, 1, [1]), (1, 97, [97]), (3, 97, [1, 97, 40])])
def test_run_slow_is_the_plain_path(B, T, lengths):
    layer, x = _layer(), torch.randn(B, T, 16)
    mask = torch.arange(T) >= torch.tensor(lengths).view(-1, 1)  # (B, T), True at padding
    slow = run_slow(layer, x, src_key_padding_mask=mask)
    assert FASTPATH_OP not in ops_that_ran(lambda: run_slow(layer, x, src_key_padding_mask=mask))
    with torch.inference_mode():  # the same call without run_slow takes PyTorch's fastpath here
        assert FASTPATH_OP in ops_that_ran(lambda: layer(x, src_key_padding_mask=mask))
    # the plain reference: autograd on the input also rules the fastpath out, without touching the global flag
    ref = layer(x.clone().requires_grad_(), src_key_padding_mask=mask).detach()
    real = ~mask
    assert torch.allclose(slow[real], ref[real], rtol=1e-5, atol=1e-6)
    assert slow.is_inference()


@pytest.mark.parametrize("before", [True, False])
def test_run_slow_restores_the_fastpath_setting(before):
    saved = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(before)
    try:
        inside = run_slow(lambda: (torch.backends.mha.get_fastpath_enabled(), torch.is_inference_mode_enabled()))
        assert inside == (False, True)
        assert torch.backends.mha.get_fastpath_enabled() is before

        def fail():
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            run_slow(fail)
        assert torch.backends.mha.get_fastpath_enabled() is before
        assert run_slow(lambda a, b=0: a + b, 2, b=3) == 5  # arguments are passed through
    finally:
        torch.backends.mha.set_fastpath_enabled(saved)
