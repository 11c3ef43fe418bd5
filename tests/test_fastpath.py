"""explain_fastpath's predictions, checked against the operators the profiler saw."""

import contextlib

import pytest
import torch
from torch import nn

from btlib import explain_fastpath, ops_that_ran
from btlib.models import EncoderConfig, build_encoder

# explain_fastpath, imported through btlib.
TESTED_HERE = ["btlib.fastpath"]

D, H, FF = 16, 2, 32


def make_encoder(**changes):
    cfg = EncoderConfig(2, D, H, FF, "gelu", dropout=0.0).scaled(**{k: v for k, v in changes.items() if k in EncoderConfig.__dataclass_fields__})
    return build_encoder(cfg, enable_nested_tensor=changes.get("enable_nested_tensor", True), seed=0).eval()


def batch(B=3, T=6, batch_first=True):
    src = torch.randn(B, T, D)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[1, 4:] = True
    mask[2, 2:] = True
    return (src, mask) if batch_first else (src.transpose(0, 1), mask)


def check(module, call, ctx=torch.no_grad, **explain_kw):
    with ctx():
        report = explain_fastpath(module, **explain_kw)
        ops = ops_that_ran(call)
    assert report.confirm(ops) == [], f"{report}\nops: {sorted(o for o in ops if 'transformer' in o or 'nested' in o or 'multi_head' in o)}"
    assert bool(report.fastpath_reasons) == (not report.fastpath)
    assert bool(report.nested_reasons) == (report.nested is False)
    return report


def test_eval_no_grad_with_mask_takes_fastpath_and_nested():
    enc = make_encoder()
    src, mask = batch()
    r = check(enc, lambda: enc(src, src_key_padding_mask=mask), src=src, src_key_padding_mask=mask)
    assert r.fastpath and r.nested


def test_inference_mode_too():
    enc = make_encoder()
    src, mask = batch()
    r = check(enc, lambda: enc(src, src_key_padding_mask=mask), ctx=torch.inference_mode, src=src, src_key_padding_mask=mask)
    assert r.fastpath and r.nested


def test_no_mask_fastpath_only():
    enc = make_encoder()
    src, _ = batch()
    r = check(enc, lambda: enc(src), src=src)
    assert r.fastpath and not r.nested
    assert any("no src_key_padding_mask" in x for x in r.nested_reasons)


def test_training_mode_blocks_both():
    enc = make_encoder().train()
    src, mask = batch()
    r = check(enc, lambda: enc(src, src_key_padding_mask=mask), src=src, src_key_padding_mask=mask)
    assert not r.fastpath and not r.nested
    assert any(".eval()" in x for x in r.fastpath_reasons)


def test_grad_enabled_blocks_both():
    enc = make_encoder()
    src, mask = batch()
    r = check(enc, lambda: enc(src, src_key_padding_mask=mask), ctx=contextlib.nullcontext, src=src, src_key_padding_mask=mask)
    assert not r.fastpath and any("no_grad" in x for x in r.fastpath_reasons)


def test_every_reason_is_listed():
    enc = make_encoder().train()
    enc.layers[0].register_forward_hook(lambda *a: None)
    src, mask = batch()
    with contextlib.nullcontext():
        r = explain_fastpath(enc, src, mask)
    text = " ".join(r.fastpath_reasons)
    assert "training" in text and "grad" in text and "hooks" in text


def test_norm_first_blocks_nested_not_fastpath():
    enc = make_encoder(norm_first=True)
    src, mask = batch()
    r = check(enc, lambda: enc(src, src_key_padding_mask=mask), src=src, src_key_padding_mask=mask)
    assert r.fastpath and not r.nested and any("norm_first" in x for x in r.nested_reasons)
    assert r.notes == []  # PyTorch itself turned nesting off: no pitfall to warn about


def test_custom_activation_blocks_fastpath():
    enc = make_encoder()
    for layer in enc.layers:
        layer.activation = lambda x: torch.tanh(x)
        layer.activation_relu_or_gelu = 0
    src, mask = batch()
    r = check(enc, lambda: enc(src, src_key_padding_mask=mask), src=src, src_key_padding_mask=mask)
    assert not r.fastpath and any("ReLU nor GELU" in x for x in r.fastpath_reasons)


def test_fastpath_disabled_globally():
    enc = make_encoder()
    src, mask = batch()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        r = check(enc, lambda: enc(src, src_key_padding_mask=mask), src=src, src_key_padding_mask=mask)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert not r.fastpath and not r.nested


def test_batch_first_false():
    layer = nn.TransformerEncoderLayer(D, H, FF, 0.0, batch_first=False)
    with pytest.warns(UserWarning, match="batch_first"):
        enc = nn.TransformerEncoder(layer, 2).eval()
    src, mask = batch(batch_first=False)
    r = check(enc, lambda: enc(src, src_key_padding_mask=mask), src=src, src_key_padding_mask=mask)
    assert not r.fastpath and not r.nested


def test_odd_heads():
    enc = build_encoder(EncoderConfig(1, 15, 3, 32, "relu", dropout=0.0)).eval()
    src = torch.randn(2, 4, 15)
    mask = torch.tensor([[False] * 4, [False, False, True, True]])
    r = check(enc, lambda: enc(src, src_key_padding_mask=mask), src=src, src_key_padding_mask=mask)
    assert not r.fastpath and any("odd" in x for x in r.fastpath_reasons)


def test_pitfall_enable_nested_tensor_after_construction():
    enc = make_encoder()
    enc.enable_nested_tensor = False  # what the original tutorial did: changes nothing
    src, mask = batch()
    r = check(enc, lambda: enc(src, src_key_padding_mask=mask), src=src, src_key_padding_mask=mask)
    assert r.nested and any("changes nothing" in n for n in r.notes)


def test_built_without_nested():
    enc = make_encoder(enable_nested_tensor=False)
    src, mask = batch()
    r = check(enc, lambda: enc(src, src_key_padding_mask=mask), src=src, src_key_padding_mask=mask)
    assert r.fastpath and not r.nested


def test_mask_not_left_aligned():
    enc = make_encoder()
    src, mask = batch()
    mask[0, 0] = True  # padding before a real token
    r = check(enc, lambda: enc(src, src_key_padding_mask=mask), src=src, src_key_padding_mask=mask)
    assert not r.nested and any("left aligned" in x for x in r.nested_reasons)


def test_src_mask_with_padding_mask():
    enc = make_encoder()
    src, mask = batch()
    causal = torch.ones(src.shape[1], src.shape[1], dtype=torch.bool).triu(1)  # True = masked, as the padding mask
    r = check(enc, lambda: enc(src, mask=causal, src_key_padding_mask=mask), src=src, src_key_padding_mask=mask, mask=causal)
    assert not r.nested and r.fastpath


def test_layer_alone():
    layer = make_encoder().layers[0]
    src, mask = batch()
    r = check(layer, lambda: layer(src, src_key_padding_mask=mask), src=src, src_key_padding_mask=mask)
    assert r.fastpath and r.nested is None


@pytest.mark.parametrize("case", ["self", "cross", "float_mask", "bias_kv"])
def test_multihead_attention(case):
    mha = nn.MultiheadAttention(D, H, batch_first=True, add_bias_kv=case == "bias_kv").eval()
    x, pad = batch()
    kv = torch.randn_like(x) if case == "cross" else x
    m = pad.float().masked_fill(pad, float("-inf")) if case == "float_mask" else pad
    r = check(mha, lambda: mha(x, kv, kv, key_padding_mask=m, need_weights=False),
              src=x, src_key_padding_mask=m, key=kv, value=kv, need_weights=False)
    assert r.fastpath == (case == "self")


def test_need_weights_note_and_unknown_module():
    mha = nn.MultiheadAttention(D, H, batch_first=True).eval()
    x, _ = batch()
    with torch.no_grad():
        assert any("need_weights" in n for n in explain_fastpath(mha, x, need_weights=True).notes)
    with pytest.raises(TypeError, match="knows nn.TransformerEncoder"):
        explain_fastpath(nn.Linear(2, 2), x)
