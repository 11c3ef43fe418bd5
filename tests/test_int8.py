"""btlib.quant: int8 linear layers, the int8 PackedEncoder, encode(precision="int8") and its accuracy target.

Also the tests of btlib.smoothquant: calibrate (maxima against x.abs().amax, every linear, four threads at once)
and quantize_auto (which runs sensitivity) against the single-thread answer.
"""

import dataclasses
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from btlib import PackedEncoder, device, gemm, gemm_measure, hardware, quant, quant_linear, smoothquant
from btlib.kernels import registry

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


@pytest.mark.skipif(quant.kernels() is None, reason="int8.cpp does not build here (no C++ compiler)")
@pytest.mark.parametrize("K", [1, 7, 16, 17, 33, 384])  # vector loops (8 or 16 lanes) and their scalar tails
def test_int8_cpp_passes_match_the_torch_arithmetic(K):
    """int8.cpp's quantize_rows (vectorised, smoothing on and off) gives torch's q and s (a rounding tie may flip one
    step); dequantize with GELU / ReLU and a residual gives act(acc s w + b) + r in one pass."""
    k = quant.kernels()
    g = torch.Generator().manual_seed(K)
    x, a = torch.randn(13, K, generator=g) * 3, torch.rand(K, generator=g) + 0.5
    for smooth in (None, a):
        q, s = k.quantize_rows(x, quant._EMPTY if smooth is None else smooth)
        q_ref, s_ref = quant.quantize_rows(x if smooth is None else x * smooth)
        assert torch.allclose(s, s_ref, rtol=1e-6) and (q.int() - q_ref.int()).abs().max() <= 1
    N = K + 3
    acc = torch.randint(-50000, 50000, (13, N), generator=g, dtype=torch.int32)
    w, b, r = torch.rand(N, generator=g) * 1e-3, torch.randn(N, generator=g), torch.randn(13, N, generator=g)
    base = acc.double() * s.double() * w.double() + b.double()
    for code, act in ((0, lambda t: t), (1, F.gelu), (2, F.relu)):
        for res in (None, r):
            y = torch.empty(13, N)
            k.dequantize(acc, s, w, b, code, quant._EMPTY if res is None else res, y)
            ref = act(base) + (0 if res is None else res.double())
            assert (y.double() - ref).abs().max() < 1e-5 * (1 + ref.abs().max()), (code, res is None)
    with pytest.raises(RuntimeError, match="act must be"):
        k.dequantize(acc, s, w, b, 3, quant._EMPTY, torch.empty(13, N))


@pytest.mark.skipif(quant.kernels() is None, reason="int8.cpp does not build here (no C++ compiler)")
def test_int8_linear_adds_the_residual_and_keeps_nan_rows_exact():
    x, w, b, lin = _lin(9, 40, 24, "gelu")
    r = torch.randn(9, 24)
    x[4, 3] = float("nan")
    with torch.inference_mode():
        out, plain = lin(x, r), lin(x)
    ok = torch.arange(9) != 4
    assert torch.allclose(out[ok], plain[ok] + r[ok], atol=1e-6) and out[4].isnan().all()
    x[4, 3] = float("inf")
    with torch.inference_mode():
        fixed = lin(x, r)[4]
    # the row recomputed in fp32 (inf times weights of both signs: NaN, as fp32 gives), residual added
    torch.testing.assert_close(fixed, F.gelu(F.linear(x[4:5], w, b))[0] + r[4], rtol=0, atol=0, equal_nan=True)


_ONEDNN_INT8 = gemm.path_available("onednn_int8", torch.int8)


@pytest.mark.skipif(quant.kernels() is None, reason="int8.cpp does not build here (no C++ compiler)")
@pytest.mark.skipif(_ONEDNN_INT8 is not None, reason=str(_ONEDNN_INT8))
@pytest.mark.parametrize("M, K, N", [(1, 96, 40), (17, 33, 7), (97, 384, 1536), (1500, 1536, 40)])  # 1500: two blocks
@pytest.mark.parametrize("activation, smooth", [(None, False), ("gelu", True), ("relu", False)])
def test_the_two_int8_gemm_paths_give_the_same_bits(M, K, N, activation, smooth):
    """oneDNN's int8 linear (uint8 + 128, unit scales) returns _int_mm's integer sums as floats, so after the same
    dequantize pass the two paths agree exactly, residual and non-finite rows included; the pack follows the weight."""
    g = torch.Generator().manual_seed(M + K)
    x, w, b = torch.randn(M, K, generator=g) * 20, torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    x[0, 0] = 1e4  # a large row: sums past 2^24 at K=1536, rounded alike by both conversions
    if M > 2:
        x[2, 1] = float("nan")
    lin = quant.Int8Linear(w, b, torch.rand(K, generator=g) + 0.5 if smooth else None, activation)
    r = torch.randn(M, N, generator=g)
    with torch.inference_mode():
        for res in (None, r):
            a, c = lin(x, res, path="int_mm"), lin(x, res, path="onednn_int8")
            torch.testing.assert_close(c, a, rtol=0, atol=0, equal_nan=True)
        ref = {"gelu": F.gelu, "relu": F.relu}.get(activation, lambda t: t)(F.linear(x, w, b))
        ok = x.isfinite().all(1) & (torch.arange(M) > 0)  # row 0's outlier squeezes its other entries to 0 (int8's limit)
        if ok.any():  # and both are int8's answer (test_int8_linear_against_fp32 bounds it closely at K=96)
            assert (c[ok] - ref[ok]).abs().max() < 0.05 * ref[ok].abs().max()


@pytest.mark.skipif(_ONEDNN_INT8 is not None, reason=str(_ONEDNN_INT8))
def test_onednn_int8_pack_is_remade_after_an_in_place_change():
    x, w, b, lin = _lin(5, 32, 8)
    with torch.no_grad():
        before = lin(x, path="onednn_int8")
        lin.qweight_t.neg_()  # W -> -W: the output without bias flips
        after = lin(x, path="onednn_int8")
    torch.testing.assert_close(after - b, -(before - b), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(quant.kernels() is None, reason="int8.cpp does not build here (no C++ compiler)")
@pytest.mark.skipif(_ONEDNN_INT8 is not None, reason=str(_ONEDNN_INT8))
def test_a_raising_onednn_int8_falls_back_to_int_mm_and_stays_off(monkeypatch):
    x, w, b, lin = _lin(7, 32, 8)
    with torch.no_grad():
        want = lin(x, path="int_mm")

        def broken(*args):
            raise RuntimeError("onednn: could not create a primitive\nmore")
        monkeypatch.setattr(gemm, "onednn_int8_linear", broken)
        monkeypatch.setenv("BTLIB_GEMM_INT8", "onednn_int8")
        try:
            torch.testing.assert_close(lin(x, path="onednn_int8"), want, rtol=0, atol=0)
            assert "could not create a primitive" in gemm.path_available("onednn_int8", torch.int8)
            assert gemm.choose_int8(7) == "int_mm"  # off for the process, even where forced
        finally:
            gemm._broken.pop(("onednn_int8", torch.int8), None)
    assert gemm.path_available("onednn_int8", torch.int8) is None


def test_choose_int8_follows_btlib_gemm_int8_and_refuses_unknown_paths(monkeypatch):
    for path in gemm.INT8_PATHS:
        monkeypatch.setenv("BTLIB_GEMM_INT8", path)
        expected = path if path == "int_mm" or _ONEDNN_INT8 is None else "int_mm"  # missing oneDNN: int_mm
        assert gemm.choose_int8(1) == gemm.choose_int8(5000) == expected
    monkeypatch.setenv("BTLIB_GEMM_INT8", "fbgemm")
    with pytest.raises(ValueError, match="BTLIB_GEMM_INT8 must be one of"):
        gemm.choose_int8(8)
    monkeypatch.delenv("BTLIB_GEMM_INT8")
    x, w, b, lin = _lin(3, 16, 4)
    with pytest.raises(ValueError, match="path must be one of"):
        lin(x, path="fbgemm")


def test_choose_int8_takes_the_faster_path_measured_per_row_count(monkeypatch):
    if _ONEDNN_INT8 is not None:
        pytest.skip(str(_ONEDNN_INT8))
    rates = {"int_mm": {"12": 300.0, "128": 1900.0, "1024": 1500.0}, "onednn_int8": {"12": 350.0, "128": 1200.0, "1024": 2400.0}}
    by_M = {p: {int(M): r for M, r in v.items()} for p, v in rates.items()}
    hw = dataclasses.replace(hardware.machine(), gemm={**hardware.machine().gemm, "int8": rates},
                             gemm_pick={**hardware.machine().gemm_pick, "int8": gemm_measure.picks(by_M)})
    monkeypatch.setattr(hardware, "machine", lambda **kw: hw)
    monkeypatch.delenv("BTLIB_GEMM_INT8", raising=False)
    gemm._plans.clear()
    try:
        # switch points at the geometric midpoints: sqrt(12 * 128) = 39, sqrt(128 * 1024) = 362
        assert [gemm.choose_int8(M) for M in (1, 39, 40, 362, 363, 9000)] == \
            ["onednn_int8", "onednn_int8", "int_mm", "int_mm", "onednn_int8", "onednn_int8"]
    finally:
        gemm._plans.clear()


def test_choose_int8_takes_the_nearest_measured_weight_shape(monkeypatch):
    if _ONEDNN_INT8 is not None:
        pytest.skip(str(_ONEDNN_INT8))
    picks = {"int8": [[None, "onednn_int8"]], "int8 384x1536": [[362, "int_mm"], [None, "onednn_int8"]],
             "int8 768x3072": [[None, "onednn_int8"]]}
    hw = dataclasses.replace(hardware.machine(), gemm_pick={**hardware.machine().gemm_pick, **picks})
    monkeypatch.setattr(hardware, "machine", lambda **kw: hw)
    monkeypatch.delenv("BTLIB_GEMM_INT8", raising=False)
    gemm._plans.clear()
    try:
        assert gemm.choose_int8(13, 384, 1152) == "int_mm"  # nearest: 384x1536 (log distance), small M
        assert gemm.choose_int8(1024, 384, 1152) == "onednn_int8"
        assert gemm.choose_int8(13, 768, 3072) == "onednn_int8"
        assert gemm.choose_int8(13) == "onednn_int8"  # no shape given: the pick over all shapes
        x, w, b, lin = _lin(13, 384, 1536)
        with torch.inference_mode():  # Int8Linear asks with its own shape: int_mm at 13 rows, the same bits either way
            torch.testing.assert_close(lin(x), lin(x, path="int_mm"), rtol=0, atol=0)
    finally:
        gemm._plans.clear()


@pytest.mark.skipif(quant.kernels() is None, reason="int8.cpp does not build here (no C++ compiler)")
@pytest.mark.parametrize("K", [1, 17, 384])
def test_quantize_rows_u8_is_int8_plus_128_and_dequantize_takes_float_sums(K):
    k = quant.kernels()
    g = torch.Generator().manual_seed(K)
    x = torch.randn(6, K, generator=g)
    x[3, 0] = float("inf")
    q, s = k.quantize_rows(x, quant._EMPTY)
    u, s8 = k.quantize_rows(x, quant._EMPTY, True)
    assert u.dtype == torch.uint8 and torch.equal(u.int() - 128, q.int())
    torch.testing.assert_close(s8, s, rtol=0, atol=0, equal_nan=True)
    assert u[3].eq(128).all()  # a non-finite row: zeros, as int8 gives
    acc = torch.randint(-50000, 50000, (6, K + 3), generator=g, dtype=torch.int32)
    w, b = torch.rand(K + 3, generator=g), torch.randn(K + 3, generator=g)
    y_int, y_float = torch.empty(6, K + 3), acc.float()
    k.dequantize(acc, s, w, b, 1, quant._EMPTY, y_int)
    k.dequantize(y_float, s, w, b, 1, quant._EMPTY, y_float)  # in place, float sums
    torch.testing.assert_close(y_float, y_int, rtol=0, atol=0, equal_nan=True)
    y_nw = torch.empty(6, K + 3)
    k.dequantize(acc, s, quant._EMPTY, quant._EMPTY, 0, quant._EMPTY, y_nw)  # w empty: unit scales
    torch.testing.assert_close(y_nw, acc.float() * s, rtol=1e-6, atol=0, equal_nan=True)


@pytest.mark.skipif(quant.kernels() is None, reason="int8.cpp does not build here (no C++ compiler)")
@pytest.mark.parametrize("N", [1, 37, 256])  # 37: a vector tail on every ISA
@pytest.mark.parametrize("act", [0, 1, 2])
@pytest.mark.parametrize("float_sums, smooth, u8", [(False, False, False), (False, True, True), (True, True, False)])
def test_requantize_is_quantize_rows_after_dequantize(N, act, float_sums, smooth, u8):
    """int8.cpp's requantize keeps the row in L1 instead of writing it: the same q and s, to the bit, as
    quantize_rows(dequantize(...)), NaN scale rows included (q 0, or 128 as uint8; s NaN)."""
    g = torch.Generator().manual_seed(N + act)
    M = 97
    acc = torch.randint(-2**20, 2**20, (M, N), generator=g, dtype=torch.int32)
    acc = acc.float() if float_sums else acc
    s = torch.rand(M, 1, generator=g) * 1e-3
    s[5] = float("nan")  # an input row that held NaN / inf
    w, b = torch.rand(N, generator=g) * 0.1, torch.randn(N, generator=g)
    a = torch.rand(N, generator=g) + 0.5 if smooth else torch.empty(0)
    k = quant.kernels()
    y = torch.empty(M, N)
    k.dequantize(acc, s, w, b, act, torch.empty(0), y)
    want_q, want_s = k.quantize_rows(y, a, u8)
    q, s_out = torch.empty(M, N, dtype=torch.uint8 if u8 else torch.int8), torch.empty(M, 1)
    k.requantize(acc, s, w, b, act, a, u8, q, s_out)
    assert torch.equal(q, want_q)
    torch.testing.assert_close(s_out, want_s, rtol=0, atol=0, equal_nan=True)
    assert s_out[5].isnan().all() and q[5].eq(128 if u8 else 0).all()
    with pytest.raises(RuntimeError, match="q must be a contiguous"):
        k.requantize(acc, s, w, b, act, a, not u8, q, s_out)  # the other dtype than u8 says


def _ffn(K=64, hidden=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1, b1 = torch.randn(hidden, K, generator=g) * 0.1, torch.randn(hidden, generator=g)
    w2, b2 = torch.randn(K, hidden, generator=g) * 0.1, torch.randn(K, generator=g)
    l1 = quant.Int8Linear(w1, b1, torch.rand(K, generator=g) + 0.5, activation="gelu")
    l2 = quant.Int8Linear(w2, b2, torch.rand(hidden, generator=g) + 0.5)
    return l1, l2


@pytest.mark.skipif(quant.kernels() is None, reason="int8.cpp does not build here (no C++ compiler)")
@pytest.mark.parametrize("path", ["int_mm", "onednn_int8"])
@pytest.mark.parametrize("M", [1, 97, quant.ROWS + 3])  # ROWS + 3: two row blocks
def test_fused_feed_forward_gives_the_two_linears_bits(path, M, monkeypatch):
    """The int8 encoder's feed-forward (linear1's output requantised for linear2, never written as floats) returns
    exactly l2(l1(x)) + residual, on either GEMM path; rows holding NaN or inf come out as the fp32 layers'."""
    if path == "onednn_int8" and _ONEDNN_INT8 is not None:
        pytest.skip(str(_ONEDNN_INT8))
    monkeypatch.setattr(gemm, "choose_int8", lambda *a, **kw: path)
    l1, l2 = _ffn()
    g = torch.Generator().manual_seed(M)
    x, r = torch.randn(M, 64, generator=g), torch.randn(M, 64, generator=g)
    if M > 2:
        x[1, 3], x[2, 7] = float("nan"), float("inf")
    with torch.inference_mode():
        fused, two = quant._feed_forward_int8(l1, l2, x, r), l2(l1(x), r)
        no_residual = quant._feed_forward_int8(l1, l2, x, None), l2(l1(x))
    torch.testing.assert_close(fused, two, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(*no_residual, rtol=0, atol=0, equal_nan=True)
    if M > 2:
        fp32 = F.linear(F.gelu(F.linear(x[1:3], l1.weight_fp32, l1.bias)), l2.weight_fp32, l2.bias) + r[1:3]
        torch.testing.assert_close(fused[1:3], fp32, rtol=0, atol=0, equal_nan=True)
        assert fused[1].isnan().all()


def test_int8_encoder_attention_runs_on_amx_where_it_runs():
    """int8 attention takes the AMX kernel (fp32 in, bf16 products) where AMX runs; nothing quantised, or a named
    backend, keeps the fp32 kernel."""
    packed = PackedEncoder.from_module(_encoder())
    named = PackedEncoder.from_module(_encoder(), attention_backend="cpu_flash_varlen")
    x = torch.randn(5, 64)
    amx = registry.get("cpu_amx_varlen").available() is None
    with torch.inference_mode():
        fp32 = packed._kernel(x).name
        assert quant.quantize(packed)._kernel(x).name == ("cpu_amx_varlen" if amx else fp32)
        assert quant.quantize(packed, keep_fp32=quant.LINEARS)._kernel(x).name == fp32
        assert quant.quantize(named)._kernel(x).name == "cpu_flash_varlen"


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


def test_slow_int8_warns_once(monkeypatch, fresh_warnings):
    from btlib import precision

    monkeypatch.setattr(precision, "int8_gemm_gflops", lambda budget_s=0.5: 1.0)  # the policy reads the measured rate
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


# Autograd, NaN / inf, threads (issue 22) -----------------------------------------------------------------

def test_int8_refuses_autograd():
    """It used to run: input gradients at cosine 0.85 of fp32's (only the attention and residual paths), none for the weights."""
    packed = PackedEncoder.from_module(_encoder())
    q8 = quant.quantize(packed)
    x = torch.randn(2, 5, 64, requires_grad=True)
    with pytest.raises(ValueError, match="int8 has no backward.*inference_mode"):
        q8(x, torch.tensor([5, 3]))
    with pytest.raises(ValueError, match="int8 has no backward"):  # the shared fp32 LayerNorms require grad
        q8(x.detach(), torch.tensor([5, 3]))
    with pytest.raises(ValueError, match="x requires grad"):
        q8.qlinears[0]["qkv"](x[0])
    with torch.no_grad():  # what the message says to do
        assert q8(x, torch.tensor([5, 3])).shape == (2, 5, 64)


@pytest.mark.parametrize("torch_ops", [False, True], ids=["cpp", "torch_ops"])
@pytest.mark.parametrize("activation, smooth", [(None, False), ("gelu", True), ("relu", False)])
def test_int8_nan_and_inf_propagate_as_in_fp32(torch_ops, activation, smooth, monkeypatch):
    """The C++ quantizer turned NaN / inf into numbers (std::max drops NaN; NaN cast to int8 is undefined)."""
    if torch_ops:
        monkeypatch.setattr(quant_linear, "kernels", lambda: None)
    x, w, b, lin = _lin(6, 96, 40, activation, smooth)
    w[3, 5] = 0.0  # a zero weight: inf * 0 is NaN in fp32
    lin = quant.Int8Linear(w, b, lin.inv_smooth.reciprocal() if smooth else None, activation)
    x[1, 5] = float("nan")
    x[2, 5], x[3, 7] = float("inf"), float("-inf")
    x[4, 5], x[4, 9] = float("inf"), float("-inf")  # inf - inf: NaN where both weights are non-zero
    ref = {"gelu": F.gelu, "relu": F.relu}.get(activation, lambda t: t)(x @ w.T + b)
    with torch.inference_mode():
        out = lin(x)
    bad = ~x.isfinite().all(1)
    assert bad.tolist() == [False, True, True, True, True, False]
    # torch's vectorised GELU gives NaN for +inf too (0.5 x (1 + erf(x / sqrt 2)) in SIMD lanes; the scalar tail gives
    # inf), so after GELU the bad rows may hold no inf at all: fp32's answer either way, and out must match it
    assert ref[bad].isnan().any() and (activation == "gelu" or ref[bad].isinf().any()) and not ref[bad].isinf().all()
    torch.testing.assert_close(out[bad], ref[bad], rtol=1e-6, atol=1e-6, equal_nan=True)  # NaN, +-inf, finite: fp32's
    assert (out[~bad] - ref[~bad]).abs().max() < 0.02 * ref[~bad].abs().max()  # clean rows: int8 as before
    assert out[1].isnan().all()  # a NaN token is NaN throughout, as in fp32


def test_int8_refuses_non_finite_weights():
    w = torch.randn(4, 8)
    w[1, 2] = float("nan")
    with pytest.raises(ValueError, match="weight holds NaN or inf"):
        quant.Int8Linear(w, None)


def test_calibration_from_four_threads_at_once_gives_the_single_thread_answer():
    """calibrate hooked the shared out_proj: another thread's forward (its sensitivity pass) landed in the maxima."""
    packed = PackedEncoder.from_module(_encoder())
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    batches = [(torch.randn(20, 64, generator=g) * (i + 1), cu, 13) for i in range(4)]  # each thread its own scale
    alone = [smoothquant.calibrate(packed, [b]) for b in batches]
    probe = (torch.randn(20, 64, generator=g), cu, 13)
    barrier = threading.Barrier(4)
    got: list = [None] * 4

    def run(i):
        barrier.wait()
        got[i] = [smoothquant.calibrate(packed, [batches[i]]) for _ in range(3)]
        if i == 0:
            with torch.inference_mode():
                got[i].append(smoothquant.quantize_auto(packed, [batches[i]]).forward_packed(*probe))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        for stats in got[i][:3]:
            assert all(torch.equal(s[n], a[n]) for s, a in zip(stats, alone[i]) for n in quant.LINEARS)
    with torch.inference_mode():
        one = smoothquant.quantize_auto(packed, [batches[0]]).forward_packed(*probe)
    assert torch.equal(got[0][3], one)  # quantize_auto (calibrate + sensitivity) beside three calibrations
