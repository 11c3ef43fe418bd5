"""btlib.quant: int8 linear layers, the int8 PackedEncoder, encode(precision="int8") and its accuracy target."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from btlib import PackedEncoder, device, quant, smoothquant

from model_folder import needs_model


def _lin(M, K, N, activation=None, smooth=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * 0.05, torch.randn(N, generator=g)
    a = torch.rand(K, generator=g) + 0.5 if smooth else None
    return x, w, b, quant.Int8Linear(w, b, a, activation)


@pytest.mark.parametrize("M", [1, 17, 97, 1500])  # not multiples of anything; 1500 spans two row blocks
@pytest.mark.parametrize("activation, smooth", [(None, False), ("gelu", True), ("relu", False)])
def test_int8_linear_against_fp32(M, activation, smooth):
    x, w, b, lin = _lin(M, 96, 40, activation, smooth)
    ref = x @ w.T + b
    ref = {"gelu": F.gelu, "relu": F.relu}.get(activation, lambda t: t)(ref)
    out = lin(x)
    assert out.shape == (M, 40) and out.dtype == torch.float32
    # two int8 roundings (1/254 of each row's / channel's range) over K=96 terms: ~1% of the output's scale
    assert (out - ref).abs().max() < 0.02 * ref.abs().max()
    # the fused C++ passes and the torch-op fallback compute the same thing (up to a flipped rounding)
    assert (out - lin._forward_torch(x)).abs().max() < 0.01 * ref.abs().max()


def test_quantize_rows_round_trips():
    x = torch.randn(5, 33)
    q, s = quant.quantize_rows(x)
    assert q.dtype == torch.int8 and s.shape == (5, 1)
    assert q.abs().amax(1).eq(127).all()  # each row's largest |x| maps to 127
    assert ((q.float() * s - x).abs() <= s / 2 + 1e-7).all()


def _encoder(d=64, nhead=4, layers=2, seed=0):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d, nhead, 4 * d, 0.0, "gelu", batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()


def test_quantized_packed_encoder_tracks_fp32_and_keeps_padding_zero():
    packed = PackedEncoder.from_module(_encoder())
    lengths = torch.tensor([1, 97, 3])  # 1 and 97: not tile multiples
    x = torch.randn(3, 97, 64)
    with torch.inference_mode():
        ref = packed(x, lengths)
        q8 = quant.quantize(packed)(x, lengths)
        everything_fp32 = quant.quantize(packed, keep_fp32=quant.LINEARS)(x, lengths)
    mask = torch.arange(97).view(1, -1) < lengths.view(-1, 1)
    assert F.cosine_similarity(q8[mask], ref[mask], dim=-1).min() > 0.99
    assert q8[~mask].eq(0).all()
    assert (everything_fp32 - ref).abs().max() < 1e-5  # nothing quantised: the fp32 path itself


def test_smoothquant_calibration_covers_every_linear():
    packed = PackedEncoder.from_module(_encoder())
    x = torch.randn(10, 64)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    stats = smoothquant.calibrate(packed, [(x, cu, 6)])
    assert [sorted(s) for s in stats] == [sorted(quant.LINEARS)] * 2
    assert stats[0]["qkv"].shape == (64,) and stats[0]["linear2"].shape == (256,)
    assert torch.equal(stats[0]["qkv"], x.abs().amax(0))
    with torch.inference_mode():
        ref = packed.forward_packed(x, cu, 6)
        out = quant.quantize(packed, stats=stats).forward_packed(x, cu, 6)
    assert F.cosine_similarity(out, ref, dim=-1).min() > 0.99


def test_quantize_checks_its_arguments():
    packed = PackedEncoder.from_module(_encoder())
    with pytest.raises(ValueError, match="keep_fp32 names linears"):
        quant.quantize(packed, keep_fp32=("linear3",))
    with pytest.raises(ValueError, match="takes an fp32 PackedEncoder"):
        quant.quantize(PackedEncoder.from_module(_encoder(), dtype=torch.bfloat16))


def test_slow_int8_warns_once(monkeypatch):
    monkeypatch.setattr(quant, "int8_gemm_gflops", lambda budget_s=0.5: 1.0)
    monkeypatch.setattr(quant, "_warned", set())
    assert "int8 is not faster here" in quant.int8_slow_reason()
    with pytest.warns(device.SlowPrecisionWarning, match="int8 matmuls"):
        assert quant.warn_if_slow_int8("test")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert quant.warn_if_slow_int8("test")  # once per what


def test_auto_never_means_int8():
    assert "int8" not in device.PRECISIONS  # precision="auto" chooses among fp32 / bf16 by measurement
    with pytest.raises(ValueError, match="precision must be one of"):
        device.choose_precision("int8")


@needs_model
def test_encode_int8_within_cosine_0995_on_the_workbook_sentences(model):
    from btlib.bench.pretrained import corpus

    texts = corpus()
    ref = model.encode(texts, precision="fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", device.SlowPrecisionWarning)  # accuracy is checked on every CPU
        q8 = model.encode(texts, precision="int8", batch_size=32)
        one = model.encode(texts[:5], precision="int8", batch_size=1)
    assert F.cosine_similarity(q8, ref).min() >= 0.995
    # activations are quantised per token: an embedding does not depend on its batch-mates
    assert F.cosine_similarity(one, q8[:5]).min() > 0.9999


@needs_model
@pytest.mark.parametrize("kw, match", [
    ({"precision": "int4"}, "precision must be None or one of"),
    ({"precision": "INT8"}, "precision must be None or one of"),
    ({"path": "slow", "precision": "int8"}, "applies to path='packed' only"),
    ({"path": "packed_bf16", "precision": "int8"}, "path='packed_bf16' is bf16"),
])
def test_bad_precision_names_raise(model, kw, match):
    with pytest.raises(ValueError, match=match):
        model.encode(["a"], **kw)
