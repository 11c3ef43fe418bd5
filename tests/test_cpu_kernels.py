"""btlib's C++ CPU kernels beyond the registry's check (test_kernel_check.py): every ISA build, strides, NaN/inf, errors, build cache.

The registered kernels use one build (build.isa()); every other build this CPU runs (build.runnable())
goes through the same check (btlib.kernels.check with that build's op), since each costs a ~30 s
compile on a cold cache. Sizes are never tile multiples (Br = Bc = 64).
"""

import os
import subprocess
import sys

import pytest
import torch

import btlib
from btlib.kernels import check, kernels, registry, relative_error
from btlib.kernels.cpu import build
from btlib.position_bias import kernel_args

pytestmark = pytest.mark.skipif(build.available() is not None, reason=f"C++ kernels cannot build here: {build.available()}")

CPP = kernels(backend="cpp")
PADDED = [k for k in CPP if k.layout == "padded"]
@pytest.fixture(scope="module", autouse=True)
def built(request):
    """The registered build, loaded. Before that, the builds the selected tests of this file load (every ISA's, the
    Bc = 128 copy's) that the cache lacks are compiled side by side in subprocesses, two at a time (each is one
    single-threaded compile of 15-20 s), into the shared cache, where the tests' own loads find them, as on a second
    run. Only a cache warmer: a subprocess that fails is ignored, and the test's own load compiles again and reports
    the compiler's error."""
    from concurrent.futures import ThreadPoolExecutor

    from btlib.kernels import _build

    selected = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    isas = {item.callspec.params["isa"] for item in selected if "isa" in getattr(getattr(item, "callspec", None), "params", {})}
    needed = dict.fromkeys([build.isa(), *(isa for isa in build.runnable() if isa in isas)])  # the registered build first
    calls = [f"build.load({isa!r})" for isa in needed if _build.needs_build(build._name(isa), [*build.SOURCES, *build.HEADERS])]
    if any(item.originalname == "test_a_copy_with_another_key_tile_builds_beside_and_matches" for item in selected):
        calls.append(f"build.load_copy({str(request.getfixturevalue('bc128_copy'))!r}, 'test_bc128')")
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda call: subprocess.run([sys.executable, "-c", "from btlib.kernels.cpu import build; " + call],
                                                  capture_output=True, timeout=600), calls))
    return build.load()


@pytest.mark.parametrize("kernel", PADDED, ids=lambda k: k.name)
def test_strided_inputs(kernel):
    # (B, T, H, D) projections viewed as (B, H, T, D): no copy needed, only head_dim contiguous
    q, k, v = (x.transpose(1, 2) for x in torch.randn(3, 2, 70, 3, 32))
    L = torch.tensor([70, 41])
    out = kernel.fn(q, k, v, lengths=L, causal=False, scale=0.3)
    assert out.is_contiguous()
    assert relative_error(out, btlib.reference_attention(q, k, v, lengths=L, scale=0.3)) <= kernel.tol


def test_auto_picks_the_cpp_kernels_on_cpu():
    q = torch.randn(1, 2, 5, 16)
    assert registry.select("padded", q, causal=True).name == "cpu_flash_v3"
    assert registry.select("varlen", q[0], causal=False).name == "cpu_flash_varlen"
    assert registry.select("padded", q.double(), causal=False).backend == "torch"  # fp64: PyTorch's kernel


q4 = torch.randn(2, 2, 5, 8)
x3 = torch.randn(6, 2, 8)
cu_ok = torch.tensor([0, 2, 6], dtype=torch.int32)
cu_bad = torch.tensor([0, 4, 2, 6], dtype=torch.int32)


class _Ops:
    """torch.ops.btlib_cpu_<isa> of the registered build, resolved at call time (after it is loaded)."""

    def __getattr__(self, name):
        return getattr(build.ops(), name)


ops = _Ops()


@pytest.mark.parametrize("call, err, match", [
    # through the public entry points (btlib/checks.py, the registry)
    (lambda: btlib.attention(*(q4.double(),) * 3, backend="cpu_flash_v3"), ValueError, "supports float32, bfloat16"),
    (lambda: btlib.attention(q4.half(), q4.half(), q4.half(), backend="cpu_naive_v1"), ValueError, "supports float32"),
    (lambda: btlib.attention(*(q4.to("meta"),) * 3, backend="cpu_flash_v3"), ValueError, "runs on cpu"),
    (lambda: btlib.attention(*torch.randn(3, 1, 1, 4, 300), backend="cpu_flash_v3"), ValueError, "head_dim 300 > 256"),
    (lambda: btlib.attention(q4[0], q4[0], q4[0], backend="cpu_flash_v3"), ValueError, r"\(B, H, T, D\)"),
    (lambda: btlib.attention(*(q4.transpose(2, 3),) * 3, backend="cpu_flash_v3"), ValueError, "contiguous"),
    (lambda: btlib.attention(q4, q4, q4, lengths=torch.tensor([5, 6]), backend="cpu_flash_v3"), ValueError, "<= the padded"),
    (lambda: btlib.varlen_attention(x3, x3, x3, cu_bad, 4, backend="cpu_flash_varlen"), ValueError, "non-decreasing"),
    # straight into the C++ ops: the binding's own checks
    (lambda: ops.attention_v3(*(q4.double(),) * 3, None, False, 1.0), RuntimeError, "dtype must be float32"),
    (lambda: ops.attention_v1(*(q4.bfloat16(),) * 3, None, False, 1.0), RuntimeError, "dtype must be float32;"),
    (lambda: ops.attention_v3(q4[0], q4[0], q4[0], None, False, 1.0), RuntimeError, r"expected \(B, H, T, D\)"),
    (lambda: ops.attention_v3(*(q4.transpose(2, 3),) * 3, None, False, 1.0), RuntimeError, "head_dim must be contiguous"),
    (lambda: ops.attention_v2(*torch.randn(3, 1, 1, 4, 300), None, False, 1.0), RuntimeError, r"head_dim must be in \[1, 256\]"),
    (lambda: ops.attention_v3(q4, q4, q4, torch.tensor([5, 6]), False, 1.0), RuntimeError, r"lengths must lie in \[0, 5\]"),
    (lambda: ops.varlen_v3(x3, x3, x3, cu_bad, 4, False, 1.0), RuntimeError, "non-decreasing"),
    (lambda: ops.varlen_v3(x3, x3, x3, cu_ok, 3, False, 1.0), RuntimeError, "length 4 > max_seqlen 3"),
    (lambda: ops.varlen_v3(x3, x3, x3, cu_ok.long(), 4, False, 1.0), RuntimeError, "int32"),
    (lambda: ops.varlen_v3(x3, x3, x3, cu_ok[:2], 4, False, 1.0), RuntimeError, "must equal the number of tokens"),
    (lambda: ops.attention_v3(q4, q4, q4, None, False, 1.0, -2, 3), RuntimeError, "window_left and window_right must be >= 0"),
    (lambda: ops.varlen_v3(x3, x3, x3, cu_ok, 4, False, 1.0, 1, -5), RuntimeError, "or -1 for no limit"),
    (lambda: btlib.attention(q4, q4, q4, window=(1, -1), backend="cpu_flash_v3"), ValueError, "right must be >= 0"),
    (lambda: btlib.attention(q4, q4, q4, window=(1, 1), backend="cpu_tiled_v2"), ValueError, "has no local window"),
])
def test_bad_inputs_raise(call, err, match):
    with pytest.raises(err, match=match):
        call()


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_second_load_does_not_recompile():
    lib = build.library_path()
    assert lib.exists()
    before = lib.stat().st_mtime_ns
    r = _python("from btlib.kernels.cpu import build; info, s = build.timed_load(); print(info); print(f'{s:.3f}')")
    assert r.returncode == 0, r.stderr
    assert "compiling" not in r.stderr  # the one-line build message is printed only when building
    assert lib.stat().st_mtime_ns == before
    assert float(r.stdout.split()[-1]) < 5.0  # a load, not a ~30 s compile


def test_no_compiler_falls_back_to_pytorch():
    code = ("import torch, btlib\n"
            "from btlib.kernels import registry\n"
            "q = torch.randn(1, 2, 5, 16)\n"
            "print(registry.select('padded', q, False).name)\n"
            "try:\n    btlib.attention(q, q, q, backend='cpu_flash_v3')\n"
            "except ValueError as e:\n    print(e)\n")
    r = _python(code, CXX="/nonexistent/c++")
    assert r.returncode == 0, r.stderr
    chosen, why = r.stdout.splitlines()[:2]
    assert chosen == "torch_sdpa"
    assert "no C++ compiler" in why


# --- Every build this CPU can run: a cheap subset each -----------------------------------------

OTHER_BUILDS = [i for i in build.runnable() if i != build.isa()]


def _v3(isa, q, k, v, L, causal, layout, window=None):
    """(out, fp32 reference) of build `isa`'s v3 or varlen on (B, H, T, D) q, k, v, in that layout.

    The reference sees the inputs with their padded positions zeroed: what lies there must not matter.
    """
    B, H, T, D = q.shape
    keep = (torch.arange(T)[None, :] < L[:, None])[:, None, :, None]  # (B, 1, T, 1)
    ref = btlib.reference_attention(*(x.float().masked_fill(~keep, 0) for x in (q, k, v)), lengths=L, causal=causal,
                                    window=window)
    w = window or (-1, -1)
    if layout == "padded":
        return build.ops(isa).attention_v3(q, k, v, L, causal, D**-0.5, *w), ref
    packed = [btlib.pack(x.transpose(1, 2), L).tokens.contiguous() for x in (q, k, v)]  # (total, H, D)
    cu, max_seqlen = btlib.lengths_to_cu_seqlens(L)
    out = build.ops(isa).varlen_v3(*packed, cu, max_seqlen, causal, D**-0.5, *w)
    return out, btlib.pack(ref.transpose(1, 2), L).tokens


def _build_op(isa: str, layout: str):
    """Build ``isa``'s v3 (or varlen) op with the registered kernel's signature, for check(fn=...)
    (check also runs its position biases through it: btlib.kernels.check.BIASES)."""
    if layout == "padded":
        return lambda q, k, v, *, lengths, causal, scale, window=None, bias=None: build.ops(isa).attention_v3(
            q, k, v, lengths, causal, q.shape[-1] ** -0.5, *(window or (-1, -1)), *kernel_args(bias))
    return lambda q, k, v, cu, max_seqlen, *, causal, scale, window=None, bias=None: build.ops(isa).varlen_v3(
        q, k, v, cu, max_seqlen, causal, q.shape[-1] ** -0.5, *(window or (-1, -1)), *kernel_args(bias))


@pytest.mark.parametrize("isa", OTHER_BUILDS)
@pytest.mark.parametrize("name", ["cpu_flash_v3", "cpu_flash_varlen"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_build_matches_reference(isa, name, dtype):
    kernel = registry.get(name)
    r = check(kernel, "cpu", dtype, fn=_build_op(isa, kernel.layout))
    assert r.ok, str(r)


def _with_specials(dtype):
    """(B, H, T, D) q, k, v and lengths [97, 40, 0] with NaN/inf at real and padded positions."""
    B, H, T, D = 3, 2, 97, 64
    q, k, v = torch.randn(3, B, H, T, D)
    L = torch.tensor([97, 40, 0])
    q[1, 0, 5, 0] = float("nan")  # a real query: its row is NaN
    v[0, 1, 10, 3] = float("nan")  # a real value at key 10: rows that attend it are NaN
    k[0, 0, 3, 0] = float("inf")  # a real inf key: rows with q[..., 0] > 0 score +inf (NaN row), < 0 score -inf
    q[1, :, 60] = k[1, :, 70] = v[1, :, 80] = float("nan")  # padding: must not reach real rows
    q[2], k[2], v[2] = float("nan"), float("inf"), float("nan")  # a fully padded sequence
    return q.to(dtype), k.to(dtype), v.to(dtype), L


@pytest.mark.parametrize("isa", build.runnable())
@pytest.mark.parametrize("layout", ["padded", "varlen"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nan_and_inf_propagate_like_the_reference(isa, layout, dtype, causal):
    q, k, v, L = _with_specials(dtype)
    out, ref = _v3(isa, q, k, v, L, causal, layout)
    out = out.float()
    assert ref.isnan().any() and not ref.isnan().all()  # the case holds NaN rows and finite rows
    assert torch.equal(out.isnan(), ref.isnan())  # NaN exactly where the reference has it, whole rows
    finite = ~ref.isnan()
    if dtype == torch.float32:  # bf16 values are held to the low-precision rule by test_every_build_matches_reference
        assert relative_error(out[finite], ref[finite]) <= registry.FP32_TOL
    if layout == "padded":
        padded_rows = (torch.arange(q.shape[2])[None, :] >= L[:, None])[:, None, :, None].expand_as(out)
        assert (out[padded_rows] == 0).all()  # padded rows are exact 0, whatever the padding held


@pytest.mark.parametrize("isa", build.runnable())
@pytest.mark.parametrize("layout", ["padded", "varlen"])
@pytest.mark.parametrize("window", [(0, 0), (5, 70), (64, 64)])
def test_nan_and_inf_with_a_window(isa, layout, window):
    """Scores outside the window are replaced, never added to: an inf key or NaN query there changes nothing.

    NaN or inf in *values* outside a row's window may reach it through P = 0 times NaN, in this kernel
    (keys in a tile the block visits) as in the reference's P V (every key), so this case has none.
    """
    q, k, v, L = _with_specials(torch.float32)
    v = v.nan_to_num(0.0, 0.0, 0.0)
    v[2] = float("nan")  # padding only
    out, ref = _v3(isa, q, k, v, L, True, layout, window)
    assert ref.isnan().any() and not ref.isnan().all()
    assert torch.equal(out.isnan(), ref.isnan())
    assert relative_error(out[~ref.isnan()], ref[~ref.isnan()]) <= registry.FP32_TOL


def test_window_wider_than_the_sequence_is_global_attention():
    q, k, v = torch.randn(3, 2, 3, 150, 32)
    L = torch.tensor([150, 77])
    glob = btlib.attention(q, k, v, lengths=L, backend="cpu_flash_v3")
    for window in [(149, 149), (10**12, 10**12)]:  # both reaches past every key: stored as "none"
        assert torch.equal(btlib.attention(q, k, v, lengths=L, window=window, backend="cpu_flash_v3"), glob)
    assert registry.select("padded", q, False, window=(64, 64)).name == "cpu_flash_v3"
    assert registry.select("varlen", q[0], True, window=(64, 64)).name == "cpu_flash_varlen"


# --- An edited copy of the sources, built beside the registered build (notebook 04's tile exercise) ---

@pytest.fixture(scope="module")
def bc128_copy(tmp_path_factory):
    """build.HERE copied, with Bc = 128 in its core.h (made once: the fixture `built` compiles it beside the others)."""
    import shutil

    copy = tmp_path_factory.mktemp("bc128") / "cpu"
    shutil.copytree(build.HERE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    core = copy / "core.h"
    line = "constexpr int64_t Bc = 64;"
    assert line in core.read_text()
    core.write_text(core.read_text().replace(line, "constexpr int64_t Bc = 128;"))  # a multiple of kNV * W in every build
    return copy


def test_a_copy_with_another_key_tile_builds_beside_and_matches(bc128_copy):
    ops = build.load_copy(bc128_copy, "test_bc128")
    assert " Bc=128 " in ops.build_info() and " Bc=64 " in build.ops().build_info()
    for name in ("cpu_flash_v3", "cpu_flash_varlen"):
        kernel = registry.get(name)
        # the ops take the window as two reaches, -1 = no limit (what ops.py's wrappers pass for None)
        fn = (lambda q, k, v, *, lengths, causal, scale, window=None, bias=None:
              ops.attention_v3(q, k, v, lengths, causal, q.shape[-1] ** -0.5, *(window or (-1, -1)), *kernel_args(bias))) \
            if kernel.layout == "padded" else \
            (lambda q, k, v, cu, max_seqlen, *, causal, scale, window=None, bias=None:
             ops.varlen_v3(q, k, v, cu, max_seqlen, causal, q.shape[-1] ** -0.5, *(window or (-1, -1)), *kernel_args(bias)))
        for dtype in (torch.float32, torch.bfloat16):
            r = check(kernel, "cpu", dtype, fn=fn)
            assert r.ok, f"{name} {dtype}: {r}"
    assert build.available() is None  # the registered kernels stay as they were


@pytest.mark.parametrize("tag, folder, err", [("bc-128", None, ValueError), ("bc128", "empty", FileNotFoundError)])
def test_load_copy_rejects_bad_tags_and_folders(tmp_path, tag, folder, err):
    with pytest.raises(err, match="tag must be|has no attention.cpp"):
        build.load_copy(tmp_path if folder else build.HERE, tag)


# --- AMX tiles (flash_amx.h): bf16 varlen with both products on tiles, where the CPU and Linux allow ---------

AMX = build.amx_available()
needs_amx = pytest.mark.skipif(AMX is not None, reason=f"the AMX kernel cannot run here: {AMX}")


def _amx_vs_reference(lengths, H, D, causal, *, window=None, strided=False, seed=0):
    """(AMX error, its tolerance) on packed bf16 inputs: the fp32 reference, tolerance 2x SDPA's own bf16 error."""
    g = torch.Generator().manual_seed(seed)
    L = torch.tensor(lengths)
    cu, max_seqlen = btlib.lengths_to_cu_seqlens(L)
    total = int(L.sum())
    if strided:  # q, k, v as views of one (total, 3, H, D) projection, as the encoders pass them
        q, k, v = torch.randn(total, 3, H, D, generator=g).bfloat16().unbind(1)
    else:
        q, k, v = torch.randn(3, total, H, D, generator=g).bfloat16()
    kernel = registry.get("cpu_amx_varlen")
    out = kernel.fn(q, k, v, cu, max_seqlen, causal=causal, window=window)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    ref = btlib.reference_varlen_attention(q, k, v, cu, max_seqlen, causal=causal, window=window)  # fp32
    sdpa = registry.get("torch_sdpa_loop").fn(q, k, v, cu, max_seqlen, causal=causal, scale=None, window=window)
    return relative_error(out, ref), kernel.tolerance(torch.bfloat16, relative_error(sdpa.float(), ref))


@needs_amx
@pytest.mark.parametrize("lengths", [[1], [2], [17], [97], [300], [300, 1, 97, 0, 17, 2, 64, 65]], ids=str)
@pytest.mark.parametrize("D", [32, 64])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_amx_matches_reference_on_odd_sizes(lengths, D, causal):
    err, tol = _amx_vs_reference(lengths, 3, D, causal)
    assert err <= tol, f"error {err:.2e} > {tol:.2e}"


@needs_amx
@pytest.mark.parametrize("D", [1, 8, 24, 48, 80, 96, 128, 200, 256])  # padded to 32-element K steps inside
def test_amx_takes_every_head_dim_up_to_256(D):
    err, tol = _amx_vs_reference([97, 33, 130], 2, D, causal=False, seed=D)
    assert err <= tol, f"error {err:.2e} > {tol:.2e}"


@needs_amx
@pytest.mark.parametrize("window", [(0, 0), (64, 64), (3, 200)])
def test_amx_with_strided_inputs_and_windows(window):
    err, tol = _amx_vs_reference([300, 97, 5], 4, 32, causal=True, window=window, strided=True)
    assert err <= tol, f"error {err:.2e} > {tol:.2e}"


@needs_amx
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_amx_nan_and_inf_propagate_like_the_reference(causal):
    q, k, v, L = _with_specials(torch.bfloat16)
    ref = btlib.pack(btlib.reference_attention(*(x.float().masked_fill(
        ~(torch.arange(q.shape[2])[None, :] < L[:, None])[:, None, :, None], 0) for x in (q, k, v)), lengths=L,
        causal=causal).transpose(1, 2), L).tokens
    packed = [btlib.pack(x.transpose(1, 2), L).tokens.contiguous() for x in (q, k, v)]
    cu, max_seqlen = btlib.lengths_to_cu_seqlens(L)
    out = registry.get("cpu_amx_varlen").fn(*packed, cu, max_seqlen, causal=causal).float()
    assert ref.isnan().any() and not ref.isnan().all()
    assert torch.equal(out.isnan(), ref.isnan())


@needs_amx
def test_auto_picks_amx_for_bf16_and_falls_back_for_the_rest(monkeypatch):
    x = torch.randn(6, 2, 32)
    assert registry.select("varlen", x.bfloat16(), causal=True, window=(3, 3)).name == "cpu_amx_varlen"
    assert registry.select("varlen", x, causal=False).name == "cpu_flash_varlen"  # fp32: the exact kernel
    wide = torch.randn(6, 2, 300, dtype=torch.bfloat16)
    assert registry.select("varlen", wide, causal=False).name != "cpu_amx_varlen"  # head_dim 300 > 256
    monkeypatch.setenv("BTLIB_ASSUME_NO_BF16", "1")  # what a CPU without AMX gets
    assert registry.get("cpu_amx_varlen").available() == "BTLIB_ASSUME_NO_BF16=1"
    assert registry.select("varlen", x.bfloat16(), causal=False).name == "cpu_flash_varlen"


@needs_amx
def test_amx_op_on_fp32_rounds_to_bf16_while_packing():
    """float32 in and out, bf16 products: equal to the op on inputs rounded to bf16 first, up to the output's rounding."""
    x = torch.randn(3, 300, 2, 32)
    cu, max_seqlen = btlib.lengths_to_cu_seqlens(torch.tensor([200, 97, 3]))
    out = ops.varlen_amx(*x, cu, max_seqlen, False, 32**-0.5)
    assert out.dtype == torch.float32
    rounded = ops.varlen_amx(*x.bfloat16(), cu, max_seqlen, False, 32**-0.5)
    assert relative_error(out.bfloat16(), rounded.float()) <= 2**-8  # one bf16 rounding of the output apart


def test_amx_refuses_what_it_cannot_run():
    x = torch.randn(6, 2, 32)
    if AMX is None:
        with pytest.raises(RuntimeError, match="dtype must be float32 or bfloat16"):
            ops.varlen_amx(x.double(), x.double(), x.double(), cu_ok, 4, False, 1.0)
        with pytest.raises(ValueError, match="supports bfloat16"):
            btlib.varlen_attention(x, x, x, cu_ok, 4, backend="cpu_amx_varlen")
    else:  # no AMX here (or not granted, or no AMX code in this build): the op says why, and "auto" never picks it
        if ops.amx_status():  # "" only where the C++ side could run it and Python said no (BTLIB_ASSUME_NO_BF16=1)
            with pytest.raises(RuntimeError, match="cannot run here"):
                ops.varlen_amx(x.bfloat16(), x.bfloat16(), x.bfloat16(), cu_ok, 4, False, 1.0)
        assert registry.select("varlen", x.bfloat16(), causal=False).name != "cpu_amx_varlen"
