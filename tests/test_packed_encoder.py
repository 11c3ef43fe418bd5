"""btlib.PackedEncoder runs nn.TransformerEncoder weights on packed tokens and matches it."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import btlib
from btlib.kernels import relative_error


def encoder(norm_first=False, activation="gelu", final_norm=False, d=32, heads=4, layers=2):
    layer = nn.TransformerEncoderLayer(d, heads, 2 * d, 0.0, activation, batch_first=True, norm_first=norm_first)
    return nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(d) if final_norm else None, enable_nested_tensor=False).eval()


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu", torch.tanh], ids=["relu", "gelu", "callable"])
@pytest.mark.parametrize("final_norm", [False, True])
def test_matches_nn_transformer_encoder(norm_first, activation, final_norm):
    enc = encoder(norm_first, activation, final_norm)
    lengths = torch.tensor([97, 1, 40, 0])  # odd length, a single token, a fully padded sequence
    x = torch.randn(4, 97, 32)
    mask = btlib.lengths_to_padding_mask(lengths, 97)
    with torch.inference_mode():
        ref = enc(x, src_key_padding_mask=mask)
        out = btlib.PackedEncoder.from_module(enc)(x, lengths)
    assert relative_error(out[~mask], ref[~mask]) < 1e-5
    assert torch.equal(out[mask], torch.zeros_like(out[mask]))  # padded rows are 0, as on PyTorch's nested path


def test_padding_mask_input_batch_1_and_no_padding():
    enc = encoder()
    packed = btlib.PackedEncoder.from_module(enc)
    x = torch.randn(1, 13, 32)
    with torch.inference_mode():
        ref = enc(x)
        assert relative_error(packed(x), ref) < 1e-5
        assert relative_error(packed(x, src_key_padding_mask=torch.zeros(1, 13, dtype=torch.bool)), ref) < 1e-5


def test_shares_weights_and_layer_alone():
    enc = encoder()
    packed = btlib.PackedEncoder.from_module(enc)
    assert packed.layers[0].linear1.weight is enc.layers[0].linear1.weight
    x = torch.randn(2, 7, 32)
    with torch.inference_mode():
        ref = enc.layers[0](x)
        assert relative_error(btlib.PackedEncoder.from_module(enc.layers[0])(x), ref) < 1e-5


def test_forward_packed_equals_padded():
    enc = encoder()
    packed = btlib.PackedEncoder.from_module(enc)
    lengths = torch.tensor([3, 5])
    x = torch.randn(2, 5, 32)
    tokens, cu, max_seqlen = btlib.pack(x, lengths)
    with torch.inference_mode():
        assert torch.allclose(packed.forward_packed(tokens, cu, max_seqlen), btlib.pack(packed(x, lengths), lengths).tokens)


def test_every_attention_backend_matches():
    enc = encoder()
    lengths = torch.tensor([6, 2, 4])
    x = torch.randn(3, 6, 32)
    mask = btlib.lengths_to_padding_mask(lengths, 6)
    with torch.inference_mode():
        ref = enc(x, src_key_padding_mask=mask)
        for k in btlib.kernels.kernels("varlen"):
            if k.supports(x, False) is None:
                out = btlib.PackedEncoder.from_module(enc, attention_backend=k.name)(x, lengths)
                assert relative_error(out[~mask], ref[~mask]) < 1e-5, k.name


def test_bf16_copy_is_accurate_and_leaves_original():
    enc = encoder(d=64, layers=3)
    lengths = torch.tensor([30, 11])
    x = torch.randn(2, 30, 64)
    mask = btlib.lengths_to_padding_mask(lengths, 30)
    packed = btlib.PackedEncoder.from_module(enc, dtype=torch.bfloat16)
    assert enc.layers[0].linear1.weight.dtype == torch.float32
    with torch.inference_mode():
        ref = enc(x, src_key_padding_mask=mask)
        out = packed(x, lengths)
    assert out.dtype == torch.float32
    assert F.cosine_similarity(out[~mask], ref[~mask], dim=-1).min() >= 0.999


@pytest.mark.parametrize("call, err, match", [
    (lambda p: p(torch.randn(2, 5)), ValueError, r"\(B, T, d_model\)"),
    (lambda p: p(torch.randn(2, 5, 32), torch.tensor([6, 1])), ValueError, "padded length T=5"),
    (lambda p: p(torch.randn(2, 5, 32), src_key_padding_mask=torch.tensor([[True] + [False] * 4] * 2)), ValueError, "left aligned"),
])
def test_bad_inputs(call, err, match):
    with pytest.raises(err, match=match):
        call(btlib.PackedEncoder.from_module(encoder()))


def test_rejects_unsupported_modules():
    with pytest.raises(TypeError, match="nn.TransformerEncoder"):
        btlib.PackedEncoder.from_module(nn.Linear(2, 2))
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    layer.self_attn = nn.MultiheadAttention(32, 4, add_bias_kv=True, batch_first=True)
    with pytest.raises(ValueError, match="add_bias_kv"):
        btlib.PackedEncoder.from_module(layer)


def test_one_check_and_one_kernel_selection_per_forward(monkeypatch):
    """12 layers: lengths (or cu_seqlens) checked once per call, not per layer; the kernel selected once per encoder."""
    import sys

    import btlib.checks
    import btlib.packed_encoder
    import btlib.padding
    from btlib.kernels import registry

    calls = {"check": 0, "select": 0}

    def counted(module, name, kind):
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    for module in (btlib.padding, btlib.checks, btlib.packed_encoder):
        for name in ("check_lengths", "check_cu_seqlens"):
            if hasattr(module, name):
                counted(module, name, "check")
    counted(sys.modules["btlib.attention"], "check_varlen_inputs", "check")  # btlib.attention is the function
    counted(registry, "select", "select")
    packed = btlib.PackedEncoder.from_module(encoder(layers=12))
    x, lengths = torch.randn(3, 20, 32), torch.tensor([20, 7, 0])
    with torch.inference_mode():
        out = packed(x, lengths)
        assert calls == {"check": 1, "select": 1}
        tokens, cu_seqlens, max_seqlen = btlib.pack(x, lengths)
        real = ~btlib.lengths_to_padding_mask(lengths, 20)
        calls.update(check=0, select=0)
        assert torch.equal(packed.forward_packed(tokens, cu_seqlens, max_seqlen), out[real])
        assert calls == {"check": 1, "select": 0}  # the kernel was selected once for this encoder and dtype


def test_a_packed_forward_checks_once_and_selects_its_kernel_once(monkeypatch):
    """One cu_seqlens check per forward and one kernel selection per (dtype, device, grad), whatever the depth."""
    import btlib.packed_encoder as pe
    from btlib.kernels import registry

    layer = nn.TransformerEncoderLayer(48, 4, 80, dropout=0.0, batch_first=True)
    packed = btlib.PackedEncoder.from_module(nn.TransformerEncoder(layer, 5, enable_nested_tensor=False).eval())
    lengths = torch.tensor([97, 1, 40])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    x = torch.randn(int(lengths.sum()), 48)
    calls = {"check": 0, "select": 0}
    check, select = pe.check_cu_seqlens, registry.select
    monkeypatch.setattr(pe, "check_cu_seqlens", lambda *a, **k: (calls.__setitem__("check", calls["check"] + 1), check(*a, **k))[1])
    monkeypatch.setattr(registry, "select", lambda *a, **k: (calls.__setitem__("select", calls["select"] + 1), select(*a, **k))[1])
    with torch.inference_mode():
        first = packed.forward_packed(x, cu, 97)
        second = packed.forward_packed(x, cu, 97)
    assert calls == {"check": 2, "select": 1} and torch.equal(first, second)
