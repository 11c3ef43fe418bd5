"""PackedEncoder runs every module option as PyTorch's (fastpath-off) forward does, or refuses it by name."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import btlib
from btlib.observe import run_slow
from btlib.kernels import relative_error

D, H = 32, 4


def _check(enc, batch_first=True, lengths=(9, 1, 5, 0)):
    """PackedEncoder vs the plain PyTorch module on real tokens, fastpath off (its exact definition)."""
    lengths = torch.tensor(lengths)
    B, T = len(lengths), int(lengths.max())
    x = torch.randn(B, T, D)
    mask = btlib.lengths_to_padding_mask(lengths, T)  # (B, T) in either layout, as in PyTorch
    src = x if batch_first else x.transpose(0, 1).contiguous()  # (T, B, d)
    ref = run_slow(enc, src, src_key_padding_mask=mask)
    with torch.inference_mode():
        out = btlib.PackedEncoder.from_module(enc)(src, src_key_padding_mask=mask)
    assert out.shape == src.shape
    if not batch_first:
        out, ref = out.transpose(0, 1), ref.transpose(0, 1)
    assert relative_error(out[~mask], ref[~mask]) < 1e-5


def _encoder(activation="gelu", **kw):
    kw = {"batch_first": True, **kw}
    layer = nn.TransformerEncoderLayer(D, H, 2 * D, 0.0, activation, **kw)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


@pytest.mark.parametrize("activation", [
    nn.GELU(approximate="tanh"), functools.partial(F.gelu, approximate="tanh"), nn.GELU(), F.gelu, nn.ReLU(), F.relu,
    nn.SiLU(), lambda x: x * torch.sigmoid(1.702 * x),
], ids=["GELU_tanh", "partial_gelu_tanh", "GELU", "F.gelu", "ReLU", "F.relu", "SiLU", "lambda"])
def test_activation_runs_exactly_as_given(activation):
    _check(_encoder(activation))


def test_gelu_tanh_is_not_run_as_exact_gelu():
    """PyTorch flags nn.GELU(approximate='tanh') as fusable GELU (activation_relu_or_gelu == 2); we must not."""
    enc = _encoder(nn.GELU(approximate="tanh"))
    assert enc.layers[0].activation_relu_or_gelu == 2
    assert btlib.packed_encoder._fused_kind(enc.layers[0]) is None


def test_subclassed_activation_module_runs_as_given():
    class Shifted(nn.ReLU):
        def forward(self, x):
            return super().forward(x) - 0.5

    _check(_encoder(Shifted()))


def test_batch_first_false_takes_and_returns_time_major():
    _check(_encoder(batch_first=False), batch_first=False)


@pytest.mark.parametrize("norm_first", [False, True])
def test_layer_norm_eps_and_bias_false(norm_first):
    _check(_encoder(layer_norm_eps=0.3, bias=False, norm_first=norm_first))
    enc = _encoder(bias=False)
    assert enc.layers[0].linear1.bias is None and enc.layers[0].self_attn.in_proj_bias is None


def test_training_with_dropout_refuses_in_forward():
    enc = _encoder()
    enc.layers[0].dropout1.p = 0.1
    packed = btlib.PackedEncoder.from_module(enc)
    x = torch.randn(2, 5, D)
    packed(x)  # eval: dropout is the identity
    enc.train()
    with pytest.raises(RuntimeError, match=r"layers.0.dropout1 \(p=0.1\).*\.eval\(\)"):
        packed(x)
    packed.eval()
    assert not enc.layers[0].training
    packed(x)


def test_training_without_dropout_runs():
    enc = _encoder().train()
    packed = btlib.PackedEncoder.from_module(enc)
    assert packed.training
    with torch.no_grad():
        out, ref = packed(torch.ones(1, 3, D)), enc(torch.ones(1, 3, D))
    assert relative_error(out, ref) < 1e-5


def test_attention_dropout_in_training_refuses():
    layer = nn.TransformerEncoderLayer(D, H, 2 * D, dropout=0.2, batch_first=True)  # train mode by default
    layer.dropout.p = layer.dropout1.p = layer.dropout2.p = 0.0
    with pytest.raises(RuntimeError, match="self_attn.dropout=0.2"):
        btlib.PackedEncoder.from_module(layer)(torch.randn(1, 3, D))


def test_overridden_forward_refused_by_name():
    class Mine(nn.TransformerEncoderLayer):
        def _ff_block(self, x):
            return 2 * super()._ff_block(x)

    with pytest.raises(ValueError, match="Mine overrides _ff_block"):
        btlib.PackedEncoder.from_module(Mine(D, H, batch_first=True).eval())


def test_precision_arguments():
    enc = _encoder()
    with pytest.raises(ValueError, match="precision must be one of"):
        btlib.PackedEncoder.from_module(enc, precision="fp16")
    with pytest.raises(ValueError, match="not both"):
        btlib.PackedEncoder.from_module(enc, precision="fp32", dtype=torch.float32)
    fp32 = btlib.PackedEncoder.from_module(enc, precision="fp32")
    assert fp32.layers[0].linear1.weight is enc.layers[0].linear1.weight  # same dtype: shared, not copied
    assert str(fp32.precision).startswith("fp32")


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("kind", ["table", "alibi"])
def test_a_position_bias_is_added_in_every_layer(norm_first, kind):
    """bias=PositionBias: PyTorch's plain module given the same bias as a float mask (B * H, T, T), padding at
    float32's lowest value, is the reference; a table with max_distance 3 < the length 9 checks the clamp. The int8
    twin (btlib.quant) carries the same bias."""
    from btlib.quant import quantize

    torch.manual_seed(0)
    enc = _encoder(norm_first=norm_first)
    bias = btlib.PositionBias.table(torch.randn(H, 7), 3) if kind == "table" else btlib.PositionBias.alibi(btlib.alibi_slopes(H))
    lengths = torch.tensor([9, 1, 5])
    B, T = len(lengths), int(lengths.max())
    x = torch.randn(B, T, D)
    pad = btlib.lengths_to_padding_mask(lengths, T)
    mask = bias.dense(T).unsqueeze(0) + torch.zeros(B, 1, 1, T).masked_fill(pad.view(B, 1, 1, T), torch.finfo(torch.float32).min)
    ref = run_slow(enc, x, mask=mask.reshape(B * H, T, T))
    packed = btlib.PackedEncoder.from_module(enc, bias=bias)
    with torch.inference_mode():
        out = packed(x, lengths=lengths)
        plain = btlib.PackedEncoder.from_module(enc)(x, lengths=lengths)
        q8 = quantize(packed)
        int8 = q8(x, lengths=lengths)
    assert relative_error(out[~pad], ref[~pad]) < 1e-5 and relative_error(plain[~pad], ref[~pad]) > 1e-3
    assert q8.bias is bias and relative_error(int8[~pad], ref[~pad]) < relative_error(plain[~pad], ref[~pad]) / 2
    with pytest.raises(ValueError, match="the position bias has 2 heads, the inputs have H=4"):
        btlib.PackedEncoder.from_module(enc, bias=btlib.PositionBias.alibi(torch.ones(2)))
