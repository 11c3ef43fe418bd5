"""Issue 12, "no silent wrong answers": one regression test per defect found.

btlib either computes what the equivalent PyTorch code computes (values, NaN, gradients) or
raises an error that says what to do. Each test names the defect it pins down.
"""

import json
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

import btlib
from btlib.kernels import registry, relative_error

NAN = float("nan")


def _cpp_available() -> bool:
    return registry.get("cpu_flash_v3").supports(torch.empty(1, 1, 1, 8)) is None


needs_cpp = pytest.mark.skipif(not _cpp_available(), reason="no C++ compiler: the C++ kernels cannot run here")


# 1. Gradients: compiled kernels have no backward; "auto" must not pick them when grad is needed.

def test_auto_attention_keeps_gradients():
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    (btlib.attention(q, q, q) + q).sum().backward()  # was: q.grad all ones (C++ output detached)
    x = q.detach().clone().requires_grad_(True)
    (btlib.reference_attention(x, x, x) + x).sum().backward()
    assert relative_error(q.grad, x.grad) < 1e-5 and not torch.equal(q.grad, torch.ones_like(q))


def test_only_v_requires_grad_still_counts():
    q, k, v = torch.randn(3, 2, 2, 6, 8)
    v.requires_grad_(True)
    L = torch.tensor([6, 3])
    btlib.attention(q, k, v, lengths=L).pow(2).sum().backward()
    v2 = v.detach().clone().requires_grad_(True)
    btlib.reference_attention(q, k, v2, lengths=L).pow(2).sum().backward()
    assert relative_error(v.grad, v2.grad) < 1e-5


@needs_cpp
def test_select_skips_kernels_without_backward():
    q = torch.randn(1, 1, 4, 8, requires_grad=True)
    assert registry.select("padded", q, False, needs_grad=True).name == "torch_sdpa"
    assert registry.select("varlen", q[0], False, needs_grad=True).name == "torch_sdpa_loop"
    assert registry.select("padded", q, False, needs_grad=False).name == "cpu_flash_v3"
    with torch.no_grad():
        assert registry.select("padded", q, False).name == "cpu_flash_v3"  # needs_grad inferred: grad mode off
    assert registry.select("padded", q, False).name == "torch_sdpa"  # inferred from q.requires_grad
    with torch.inference_mode():
        assert btlib.attention(q, q, q, backend="cpu_flash_v3").shape == q.shape


@needs_cpp
@pytest.mark.parametrize("layout, name, fallback", [("padded", "cpu_flash_v3", "torch_sdpa"),
                                                    ("varlen", "cpu_flash_varlen", "torch_sdpa_loop")])
def test_named_kernel_without_backward_raises(layout, name, fallback):
    q = torch.randn(1, 1, 4, 8, requires_grad=True)
    msg = rf"kernel '{name}' has no backward; call under torch.no_grad\(\)/inference_mode or use backend='{fallback}'"
    with pytest.raises(ValueError, match=msg):
        if layout == "padded":
            btlib.attention(q, q, q, backend=name)
        else:
            x = q[0].transpose(0, 1)  # (total=4, H=1, D)
            btlib.varlen_attention(x, x, x, torch.tensor([0, 4], dtype=torch.int32), 4, backend=name)


def test_differentiable_flags():
    flags = {k.name: k.differentiable for k in registry.kernels()}
    assert all(flags[n] for n in ("reference", "torch_sdpa", "reference_varlen", "torch_sdpa_loop", "torch_sdpa_nested"))
    assert not any(v for n, v in flags.items() if n.startswith(("cpu_", "triton_", "cuda_")))


def _encoder(activation, bias):
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, activation=activation, bias=bias, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


@pytest.mark.parametrize("activation, bias", [("relu", True), ("gelu", True),
                                              (nn.SiLU(), True), ("gelu", False)],
                         ids=["relu", "gelu", "silu", "gelu-nobias"])
def test_packed_encoder_gradients_equal_pytorch(activation, bias):
    torch.manual_seed(0)
    enc = _encoder(activation, bias)
    packed = btlib.PackedEncoder.from_module(enc)
    lengths = torch.tensor([7, 3, 1, 5])
    x = torch.randn(4, 7, 16)
    pad = btlib.lengths_to_padding_mask(lengths, 7)
    xa = x.clone().requires_grad_(True)
    ref = enc(xa, src_key_padding_mask=pad)  # grad on: the slow path, no fastpath
    tokens, cu, max_seqlen = btlib.pack(x, lengths)
    tokens.requires_grad_(True)
    out = packed.forward_packed(tokens, cu, max_seqlen)
    w = torch.randn(out.shape)
    assert relative_error(out, btlib.pack(ref, lengths).tokens) < 1e-5
    (btlib.pack(ref, lengths).tokens * w).sum().backward()
    (out * w).sum().backward()
    assert relative_error(tokens.grad, btlib.pack(xa.grad, lengths).tokens) < 1e-5
    ours = dict(packed.named_parameters())
    for name, p in enc.named_parameters():
        assert ours[name].grad is not None, name
        assert relative_error(ours[name].grad, p.grad) < 1e-5, name


# 3. Thread-safe registry loading: four threads making their first call at once.

RACE = r"""
import json, threading, torch, btlib
from btlib.kernels import registry
assert not registry._loaded, "the registry must be unloaded at the start"
N = 4
barrier, results = threading.Barrier(N), [None] * N
q = torch.randn(1, 1, 4, 8)
def first_call(i):
    barrier.wait()
    try:
        results[i] = [registry.get("cpu_flash_v3").name, registry.select("padded", q, False).name,
                      registry.select("varlen", q[0], False).name, len(registry.kernels())]
    except Exception as e:
        results[i] = f"{type(e).__name__}: {e}"
threads = [threading.Thread(target=first_call, args=(i,)) for i in range(N)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(results))
"""


def test_first_use_from_four_threads_at_once():
    expect = [registry.get("cpu_flash_v3").name, registry.select("padded", torch.randn(1, 1, 4, 8), False).name,
              registry.select("varlen", torch.randn(4, 1, 8), False).name, len(registry.kernels())]
    for _ in range(6):  # on the old registry every run failed (3 of 4 threads); 6 fresh processes, ~1 s each
        r = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout.strip().splitlines()[-1]) == [expect] * 4


def test_failed_provider_import_is_not_silently_half_loaded(monkeypatch):
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    def _import__broken_for_test():  # a provider whose import raises (the registry names it btlib.kernels._broken_for_test)
        raise RuntimeError("boom")

    monkeypatch.setattr(registry, "_PROVIDERS", registry._PROVIDERS + (_import__broken_for_test,))
    for _ in range(2):  # every call raises, not just the first
        with pytest.raises(ImportError, match="could not load the kernel provider btlib.kernels._broken_for_test: RuntimeError: boom"):
            registry.select("padded", torch.randn(1, 1, 2, 8), False)
    assert registry._loaded is False


# 4. NaN (or inf) in padding must not reach real rows; padded query rows are exactly 0.

def _padded_with_garbage(fill, where):
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 2, 6, 8)
    L = torch.tensor([4, 6])
    clean = [x.clone() for x in (q, k, v)]
    for x in {"q": [q], "k": [k], "v": [v], "all": [q, k, v]}[where]:
        x[0, :, 4:] = fill
    return (q, k, v), clean, L


@pytest.mark.parametrize("name", ["reference", "torch_sdpa"] + (["cpu_flash_v3", "cpu_naive_v1", "cpu_tiled_v2"] if _cpp_available() else []))
@pytest.mark.parametrize("fill", [NAN, math.inf])
@pytest.mark.parametrize("where", ["q", "k", "v", "all"])
@pytest.mark.parametrize("causal", [False, True])
def test_garbage_in_padding_does_not_matter(name, fill, where, causal):
    (q, k, v), clean, L = _padded_with_garbage(fill, where)
    out = btlib.attention(q, k, v, lengths=L, causal=causal, backend=name)
    ref = btlib.reference_attention(*clean, lengths=L, causal=causal)
    assert torch.equal(out[0, :, 4:], torch.zeros_like(out[0, :, 4:]))  # padded query rows: exactly 0
    assert relative_error(out, ref) <= registry.get(name).tol  # was NaN in every row of sequence 0 (torch_sdpa)


def test_reference_nan_in_padded_v_was_leaking():
    q, k, v = torch.randn(3, 1, 1, 5, 4)
    v[0, 0, 3:] = NAN
    out = btlib.reference_attention(q, k, v, lengths=torch.tensor([3]))
    assert not out.isnan().any()  # was: every real row NaN (0 * NaN)
    out = btlib.reference_attention(q, k, v, key_padding_mask=torch.tensor([[False] * 3 + [True] * 2]))
    assert not out.isnan().any()


def test_garbage_in_padding_gives_clean_gradients():
    (q, k, v), clean, L = _padded_with_garbage(NAN, "all")
    for x in (q, k, v):
        x.requires_grad_(True)
    btlib.attention(q, k, v, lengths=L).sum().backward()
    cq, ck, cv = (x.requires_grad_(True) for x in clean)
    btlib.reference_attention(cq, ck, cv, lengths=L).sum().backward()
    for a, b in ((q, cq), (k, ck), (v, cv)):
        assert not a.grad.isnan().any() and relative_error(a.grad, b.grad) < 1e-5


def test_nan_in_a_real_position_still_propagates():
    q, k, v = torch.randn(3, 2, 1, 5, 8)
    v[0, 0, 1] = NAN  # a real value of sequence 0
    L = torch.tensor([3, 5])
    for name in ("reference", "torch_sdpa"):
        out = btlib.attention(q, k, v, lengths=L, backend=name)
        assert out[0, 0, :3].isnan().all() and not out[1].isnan().any()  # what F.scaled_dot_product_attention gives
        assert torch.equal(out[0, 0, 3:], torch.zeros(2, 8))


# 7. nested_to_padded must not truncate.

def test_nested_to_padded_short_T_raises():
    nt = btlib.padded_to_nested(torch.randn(2, 5, 3), torch.tensor([5, 2]))
    with pytest.raises(ValueError, match=r"T=3 is shorter than the longest sequence \(5\).*Pass T >= 5"):
        btlib.nested_to_padded(nt, T=3)  # was: (2, 3, 3), sequence 0 cut silently
    assert btlib.nested_to_padded(nt, T=6).shape == (2, 6, 3)


# 9. Raw errors become errors that say what to do.

def test_head_dim_zero():
    x = torch.randn(1, 1, 3, 0)
    for call in (lambda: btlib.attention(x, x, x), lambda: btlib.reference_attention(x, x, x),
                 lambda: btlib.varlen_attention(x[0].transpose(0, 1), x[0].transpose(0, 1), x[0].transpose(0, 1),
                                                torch.tensor([0, 3], dtype=torch.int32), 3)):
        with pytest.raises(ValueError, match="head_dim is 0"):  # was ZeroDivisionError
            call()


def test_padding_stats_all_zero_lengths():
    with pytest.raises(ValueError, match="every length is 0 and T is 0.*pass T"):  # was ZeroDivisionError
        btlib.padding_stats(torch.zeros(3, dtype=torch.int64))
    s = btlib.padding_stats(torch.zeros(3, dtype=torch.int64), T=4)
    assert s.padding_fraction == 1.0 and s.attention_waste == 1.0 and s.ideal_speedup == math.inf
    with pytest.raises(ValueError, match="0 sequences"):
        btlib.padding_stats(torch.zeros(0, dtype=torch.int64))


def test_cu_seqlens_int32_overflow():
    with pytest.raises(ValueError, match=r"2147483648 tokens in all.*split it"):  # was: cu_seqlens wrapped negative
        btlib.lengths_to_cu_seqlens(torch.tensor([2**30, 2**30]))
    cu, m = btlib.lengths_to_cu_seqlens(torch.tensor([2**30, 2**30 - 1]))
    assert cu.dtype == torch.int32 and int(cu[-1]) == 2**31 - 1 and m == 2**30


# 6 and 9. Checkpoints: config fields btlib cannot reproduce are refused by name; damaged files say what to do.

def _tiny_folder(tmp_path, arch="bert"):
    from test_pretrained import _write_tiny  # the tiny Hugging Face checkpoints of test_pretrained.py

    _write_tiny(tmp_path, arch)
    return tmp_path


def _edit_config(folder, **fields):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(fields)
    (folder / "config.json").write_text(json.dumps(cfg))


transformers_missing = pytest.mark.skipif(
    __import__("btlib.pretrained.reference", fromlist=["_"]).transformers_available() is not None,
    reason="transformers is not installed")


@transformers_missing
@pytest.mark.parametrize("arch, fields, match", [
    ("bert", {"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key'"),
    ("roberta", {"position_embedding_type": "relative_key_query"}, "position_embedding_type='relative_key_query'"),
    ("bert", {"is_decoder": True}, "is_decoder=True"),
    ("xlm-roberta", {"add_cross_attention": True}, "add_cross_attention=True"),
    ("bert", {"is_encoder_decoder": True}, "is_encoder_decoder=True"),
    ("bert", {"pruned_heads": {"0": [1]}}, "pruned_heads="),
    ("bert", {"hidden_act": "silu"}, "hidden_act='silu'"),
    ("distilbert", {"activation": "quick_gelu"}, "activation='quick_gelu'"),
])
def test_config_fields_btlib_cannot_reproduce_are_refused(tmp_path, arch, fields, match):
    from btlib.pretrained import CheckpointError, load_pretrained

    folder = _tiny_folder(tmp_path, arch)
    _edit_config(folder, **fields)
    with pytest.raises(CheckpointError, match=rf"cannot reproduce exactly:\n  {match}"):  # was: loaded, default output
        load_pretrained(folder)


@transformers_missing
def test_config_fields_that_cannot_matter_still_load(tmp_path):
    from btlib.pretrained import load_pretrained

    folder = _tiny_folder(tmp_path)
    base = load_pretrained(folder).encode(["w1 w2 w3", "w4"])
    _edit_config(folder, chunk_size_feed_forward=2, position_embedding_type="absolute", is_decoder=False,
                 hidden_dropout_prob=0.5, attention_probs_dropout_prob=0.5, use_cache=False)
    assert torch.equal(load_pretrained(folder).encode(["w1 w2 w3", "w4"]), base)


@transformers_missing
def test_broken_config_and_weights_raise_checkpoint_error(tmp_path):
    from btlib.pretrained import CheckpointError, load_pretrained

    folder = _tiny_folder(tmp_path)
    good = (folder / "config.json").read_text()
    (folder / "config.json").write_text(good[:-20])
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON .*restore the file"):  # was JSONDecodeError
        load_pretrained(folder)
    cfg = json.loads(good)
    del cfg["hidden_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="has no 'hidden_size', which a bert config must give"):  # was KeyError
        load_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**json.loads(good), "num_attention_heads": 0}))
    with pytest.raises(CheckpointError, match="num_attention_heads must be a positive integer; got 0"):
        load_pretrained(folder)
    (folder / "config.json").write_text(good)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors cannot be read \(SafetensorError.*download it again"):
        load_pretrained(folder)


# Issue 22, "what real model folders and real callers send": config fields checked at load time by name,
# RoBERTa positions as transformers computes them, texts and integer arguments checked at the call.
# (sentence-transformers folders read whole: tests/test_st_modules.py; pairs: tests/test_pairs.py.)

@transformers_missing
@pytest.mark.parametrize("fields, match", [
    ({"layer_norm_eps": "1e-12"}, "layer_norm_eps must be a finite number >= 0 .*got '1e-12'"),  # was: crash at encode
    ({"layer_norm_eps": None}, "layer_norm_eps must be a finite number >= 0 .*got None"),
    ({"layer_norm_eps": -1.0}, "layer_norm_eps must be a finite number >= 0"),
    ({"type_vocab_size": 0}, "type_vocab_size must be a positive integer; got 0"),  # was: token types dropped (cos 0.83)
    ({"pad_token_id": 99}, r"pad_token_id must be a token id \(an integer in \[0, vocab_size=44\)\); got 99"),
    ({"pad_token_id": True}, "pad_token_id must be a token id"),
])
def test_config_fields_are_checked_at_load_time_by_name(tmp_path, fields, match):
    from btlib.pretrained import CheckpointError, load_pretrained

    folder = _tiny_folder(tmp_path)
    _edit_config(folder, **fields)
    with pytest.raises(CheckpointError, match=match):
        load_pretrained(folder)


@transformers_missing
@pytest.mark.parametrize("arch", ["roberta", "xlm-roberta"])
def test_roberta_literal_pad_gets_transformers_positions(tmp_path, arch):
    """transformers: position = pad + cumsum(id != pad), and pad for a pad id; a <pad> written in a text keeps it."""
    import transformers as tf
    from st_folders import write_hf

    from btlib.pretrained import load_pretrained

    folder = write_hf(tmp_path, arch)
    texts = ["w1 <pad> w2 w3", "<pad> <pad> w4", "w5 w6 <pad>", "w7"]
    tok, hf = tf.AutoTokenizer.from_pretrained(str(folder)), tf.AutoModel.from_pretrained(str(folder)).eval()
    enc = tok(texts, padding=True, return_tensors="pt")
    pad = hf.config.pad_token_id
    assert (enc["input_ids"][enc["attention_mask"].bool()] == pad).sum() == 4  # the literal <pad>s are real tokens
    with torch.inference_mode():
        h = hf(**enc).last_hidden_state
    keep = enc["attention_mask"].unsqueeze(-1).float()
    ref = (h * keep).sum(1) / keep.sum(1)
    model = load_pretrained(folder)
    for path in ("packed", "fastpath_nested", "fastpath", "slow"):  # was: positions counted every token (cos 0.98)
        assert relative_error(model.encode(texts, path=path), ref) < 1e-5, path


@transformers_missing
def test_texts_and_batch_size_are_checked_at_the_call(tmp_path):
    import numpy as np

    from btlib.pretrained import load_pretrained

    model = load_pretrained(_tiny_folder(tmp_path))
    for bad in (None, 3, b"w1", ("w1",), ("w1", 2)):  # was: the tokenizer's internal TypeError / a silent pair
        with pytest.raises(TypeError, match=r"texts\[1\] is .*encode takes str texts or \(str, str\) pairs"):
            model.encode(["w1", bad])
    with pytest.raises(TypeError, match="encode takes a list of texts"):
        model.encode(t for t in ["w1"])
    texts = ["w1 w2", "w3", "w4 w5 w6"]
    assert torch.equal(model.encode(texts, batch_size=np.int64(2)), model.encode(texts, batch_size=2))  # was refused
    for bad in (True, np.bool_(True), np.float64(2.0)):
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            model.encode(texts, batch_size=bad)

# Issue 22: the NaN policy on every backend "auto" can choose, with and without a window.

@pytest.mark.parametrize("route", ["fp64", "fp16", "requires_grad", "head_dim 300"])
@pytest.mark.parametrize("layout", ["padded", "varlen"])
def test_nan_query_row_is_nan_on_every_auto_route(route, layout):
    """auto sends these to torch_sdpa / torch_sdpa_loop, whose SDPA (CPU flash, no mask) returned a NaN query row as 0."""
    dtype = {"fp64": torch.float64, "fp16": torch.float16}.get(route, torch.float32)
    D = 300 if route == "head_dim 300" else 8
    q, k, v = torch.randn(3, 6, 2, D).to(dtype)  # (total, H, D) each
    q[2, 1, 0] = NAN
    q, k, v = (x.requires_grad_(route == "requires_grad") for x in (q, k, v))
    cu = torch.tensor([0, 6], dtype=torch.int32)
    if layout == "padded":
        out = btlib.attention(*(x.unsqueeze(0).transpose(1, 2) for x in (q, k, v))).transpose(1, 2)[0]  # no lengths
    else:
        out = btlib.varlen_attention(q, k, v, cu, 6)
    assert out[2, 1].isnan().all()  # was 0
    assert not out[2, 0].isnan().any() and not out[:2].isnan().any() and not out[3:].isnan().any()


@pytest.mark.parametrize("name", ["torch_sdpa", "torch_sdpa_loop", "reference", "reference_varlen"])
@pytest.mark.parametrize("causal, window, rows", [(False, (1, 1), [3, 4, 5]), (True, (2, 0), [4, 5, 6]),
                                                  (True, None, [4, 5, 6, 7])])
def test_nan_key_reaches_only_the_rows_that_attend_it(name, causal, window, rows):
    """With a window (or causal band), SDPA added its -inf mask to the NaN scores: the NaN reached every row."""
    q, k, v = torch.randn(3, 8, 2, 4)  # (total, H, D): one sequence of 8
    k[4, 0, 1] = NAN
    kernel = registry.get(name)
    if kernel.layout == "padded":
        padded = [x.unsqueeze(0).transpose(1, 2) for x in (q, k, v)]
        out = btlib.attention(*padded, lengths=torch.tensor([8]), causal=causal, window=window, backend=name)
        out = out.transpose(1, 2)[0]
    else:
        out = btlib.varlen_attention(q, k, v, torch.tensor([0, 8], dtype=torch.int32), 8, causal=causal, window=window,
                                     backend=name)
    assert out[:, 0].isnan().any(-1).nonzero().view(-1).tolist() == rows  # was every row 0..7
    assert not out[:, 1].isnan().any()
    clean = k.clone()
    clean[4, 0, 1] = 0.0
    ref = btlib.reference_varlen_attention(q, clean, v, torch.tensor([0, 8], dtype=torch.int32), 8, causal=causal,
                                           window=window)
    others = [i for i in range(8) if i not in rows]
    assert relative_error(out[others], ref[others]) < 1e-5  # the rows that never attend it are the clean answer


def test_sdpa_nested_takes_inference_tensors():
    """Packed tokens made inside inference_mode raised "Cannot set version_counter for inference tensor"."""
    with torch.inference_mode():
        q, k, v = torch.randn(3, 7, 2, 8)
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        out = btlib.varlen_attention(q, k, v, cu, 4, backend="torch_sdpa_nested")
    assert relative_error(out, btlib.reference_varlen_attention(q, k, v, cu, 4)) < 1e-5
