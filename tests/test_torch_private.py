"""btlib._torch_private: every private torch API btlib uses, tested on both sides.

Each entry runs once with this torch (the private symbol there: the result matches a plain-torch reference) and
once with the symbol taken away (monkeypatch: deleted, or its module made unimportable), where the fallback must
give the same result or a clear reason. The last tests check that no private torch name is used in btlib outside
that module.
"""

from __future__ import annotations

import ast
import contextlib
import re
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend

from btlib import _torch_private as tp
from btlib import explain_fastpath, gemm, hardware, padded_to_nested, precision, quant
from btlib.packed_encoder import PackedEncoder
from btlib.sdpa import explain_sdpa

ROOT = Path(__file__).resolve().parents[1]


def _ints(*shape, low=-127, high=128, dtype=torch.int8):
    return torch.randint(low, high, shape, dtype=dtype, generator=torch.Generator().manual_seed(0))


def test_every_entry_is_there_in_this_torch():
    """torch 2.13 (CPU) has every symbol; a missing one here means the table names it wrongly."""
    assert {e: tp.missing(e) for e in tp.SYMBOLS if tp.missing(e) is not None} == {}


# ---- int8: torch._int_mm -------------------------------------------------------------------------------------

def test_int_mm_is_exact():
    a, b = _ints(32, 64), _ints(64, 24)
    assert torch.equal(tp.int_mm(a, b), (a.double() @ b.double()).to(torch.int32))  # |sums| < 2^53: float64 is exact


def test_without_int_mm_int8_is_refused_with_the_reason(monkeypatch):
    monkeypatch.delattr(torch, "_int_mm")
    monkeypatch.setattr(gemm, "_ready", set())  # path_available's remembered yes
    why = "this torch has no torch._int_mm"
    assert tp.missing("int_mm") == why and gemm.path_available("int_mm") == why
    with pytest.raises(RuntimeError, match=re.escape(why) + ".*precision='fp32'"):
        tp.int_mm(_ints(32, 64), _ints(64, 24))
    assert hardware._int8_rate.__wrapped__(1, 0.01) == 0.0  # not the cached rate: the measurement itself
    assert precision.int8_slow_reason().startswith(why)
    layer = nn.TransformerEncoderLayer(32, 2, 64, 0.0, "gelu", batch_first=True)
    packed = PackedEncoder.from_module(nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval())
    with pytest.raises(RuntimeError, match=re.escape(why)):
        quant.quantize(packed)


# ---- GEMM epilogue: torch._addmm_activation ---------------------------------------------------------------------

@pytest.mark.parametrize("gelu", [True, False], ids=["gelu", "relu"])
@pytest.mark.parametrize("present", [True, False], ids=["torch", "fallback"])
def test_addmm_activation(monkeypatch, gelu, present):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(13, 32, generator=g), torch.randn(24, 32, generator=g), torch.randn(24, generator=g)
    ref = F.linear(x, w, b)
    ref = F.gelu(ref) if gelu else F.relu(ref)
    if not present:
        monkeypatch.delattr(torch, "_addmm_activation")
    torch.testing.assert_close(tp.addmm_activation(b, x, w.t(), use_gelu=gelu), ref, rtol=1e-5, atol=1e-5)
    got = gemm.linear(x, w, b, "gelu" if gelu else "relu", path="torch")  # the call site: gemm's torch path
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


# ---- oneDNN fp32 and int8 ops -----------------------------------------------------------------------------------

ONEDNN = torch.backends.mkldnn.is_available() and tp.missing("linear_pointwise") is None


@pytest.fixture
def fresh_gemm(monkeypatch):
    """gemm's remembered answers emptied before and after (a test below hides the oneDNN ops)."""
    monkeypatch.setattr(gemm, "_ready", set())
    monkeypatch.setattr(gemm, "_broken", {})
    monkeypatch.setattr(gemm, "_plans", {})
    gemm._has_onednn.cache_clear()
    yield
    gemm._has_onednn.cache_clear()


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN linear")
def test_onednn_linear_matches_f_linear():
    g = torch.Generator().manual_seed(0)
    x, w, b, r = (torch.randn(*s, generator=g) for s in ((13, 32), (24, 32), (24,), (13, 24)))
    packed = tp.reorder_linear_weight(w)
    torch.testing.assert_close(tp.linear_pointwise(x, packed, b, "relu", [], ""), F.relu(F.linear(x, w, b)),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tp.linear_pointwise_binary(x, r, packed, b, "add"), F.linear(x, w, b) + r,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not ONEDNN or tp.missing("qlinear_pointwise") is not None, reason="this torch has no oneDNN int8 linear")
@pytest.mark.skipif(gemm._no_vnni() is not None,
                    reason="x86 without VNNI: oneDNN's int8 linear saturates, so btlib never takes it here (btlib.gemm._no_vnni)")
def test_onednn_int8_linear_matches_its_dequantized_reference():
    qx, w8 = _ints(13, 32, low=0, high=256, dtype=torch.uint8), _ints(24, 32)
    w_scale, b = torch.full((24,), 0.01), torch.randn(24, generator=torch.Generator().manual_seed(1))
    y = gemm.onednn_int8_linear(qx, 0.02, 128, gemm.onednn_int8_pack(w8, (13, 32)), w_scale, b)
    ref = F.linear((qx.float() - 128) * 0.02, w8.float() * w_scale[:, None], b)  # x = (qx - zp) * s, W = w8 * w_n
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


def test_without_the_onednn_ops_gemm_takes_f_linear_and_says_why(monkeypatch, fresh_gemm):
    # torch.ops namespaces make any op name on first access, so deleting one does not hide it: a torch.ops without
    # the mkldnn and onednn ops stands in for a build that lacks them
    monkeypatch.setattr(torch, "ops", SimpleNamespace(mkldnn=SimpleNamespace(), onednn=SimpleNamespace()))
    assert tp.missing("linear_pointwise") == "this torch has no torch.ops.mkldnn._linear_pointwise"
    assert "torch.ops.mkldnn._linear_pointwise" in gemm.path_available("onednn")
    assert gemm.path_available("onednn_int8") == "this torch has no torch.ops.onednn.qlinear_prepack"
    g = torch.Generator().manual_seed(0)
    x, w, b, r = (torch.randn(*s, generator=g) for s in ((13, 32), (24, 32), (24,), (13, 24)))
    for call in (lambda: tp.reorder_linear_weight(w), lambda: tp.linear_pointwise(x, w, b, "none", [], ""),
                 lambda: tp.linear_pointwise_binary(x, r, w, b, "add"), lambda: tp.qlinear_prepack(w, [13, 32])):
        with pytest.raises(RuntimeError, match="this torch has no torch.ops.(mkldnn|onednn)"):
            call()
    torch.testing.assert_close(gemm.linear(x, w, b, "gelu", r, path="onednn"), F.gelu(F.linear(x, w, b)) + r,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN")
def test_mkldnn_linear(monkeypatch):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 32, generator=g), torch.randn(24, 32, generator=g)
    got = tp.mkldnn_linear(a.to_mkldnn(), b.to_mkldnn()).to_dense()
    torch.testing.assert_close(got, a @ b.t(), rtol=1e-5, atol=1e-5)
    monkeypatch.delattr(torch._C._nn, "mkldnn_linear")
    with pytest.raises(RuntimeError, match=re.escape("this torch has no torch._C._nn.mkldnn_linear")):
        tp.mkldnn_linear(a.to_mkldnn(), b.to_mkldnn())


# ---- fastpath: torch._nested_tensor_from_mask_left_aligned ------------------------------------------------------

MASKS = {  # True = a real token; (mask, left aligned?)
    "full": ([[1, 1, 1], [1, 1, 1]], True),
    "left aligned": ([[1, 1, 0], [1, 0, 0]], True),
    "an empty row": ([[1, 1, 1], [0, 0, 0]], True),
    "padding first": ([[0, 1, 1], [1, 1, 1]], False),
    "a hole": ([[1, 0, 1], [1, 1, 1]], False),
}


@pytest.mark.parametrize("present", [True, False], ids=["torch", "fallback"])
@pytest.mark.parametrize("name", list(MASKS))
def test_mask_left_aligned(monkeypatch, present, name):
    mask, expected = MASKS[name]
    mask = torch.tensor(mask, dtype=torch.bool)
    if not present:
        monkeypatch.delattr(torch, "_nested_tensor_from_mask_left_aligned")
    assert tp.mask_left_aligned(torch.randn(2, 3, 8), mask) is expected


def test_fastpath_explains_a_mask_not_left_aligned_without_torchs_check(monkeypatch):
    monkeypatch.delattr(torch, "_nested_tensor_from_mask_left_aligned")
    layer = nn.TransformerEncoderLayer(16, 2, 32, 0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2).eval()
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 0] = True  # padding before a real token
    with torch.no_grad():
        r = explain_fastpath(enc, torch.randn(2, 5, 16), pad)
    assert any("left aligned" in x for x in r.nested_reasons)
    pad[1, 0], pad[1, 3:] = False, True
    with torch.no_grad():
        r = explain_fastpath(enc, torch.randn(2, 5, 16), pad)
    assert not any("left aligned" in x for x in r.nested_reasons)


# ---- SDPA: torch._fused_sdp_choice, torch._C._get_sdp_priority_order, torch.nested._internal.sdpa --------------

def test_fused_sdp_choice_with_and_without(monkeypatch):
    q = torch.randn(2, 2, 16, 8)
    assert tp.fused_sdp_choice(q, q, q) == SDPBackend.FLASH_ATTENTION.value  # CPU fp32, no mask: the flash kernel
    assert explain_sdpa(q, q, q).chosen == "FLASH_ATTENTION"
    monkeypatch.delattr(torch, "_fused_sdp_choice")
    why = "this torch has no torch._fused_sdp_choice"
    with pytest.raises(RuntimeError, match=re.escape(why)):
        tp.fused_sdp_choice(q, q, q)
    r = explain_sdpa(q, q, q)
    assert r.chosen is None and r.error.startswith("cannot predict: " + why)
    assert str(r).splitlines()[0] == f"SDPA on cpu (dense): {r.error}" and "raises" not in str(r)
    assert all(r.reasons[b] == [r.error] for b in r.reasons) and any("run_forced" in n for n in r.notes)


def test_sdp_priority_order_with_and_without(monkeypatch):
    default = [SDPBackend.FLASH_ATTENTION.value, SDPBackend.EFFICIENT_ATTENTION.value, SDPBackend.MATH.value,
               SDPBackend.CUDNN_ATTENTION.value]
    assert set(default) <= set(tp.sdp_priority_order())
    monkeypatch.delattr(torch._C, "_get_sdp_priority_order")
    assert tp.missing("sdp_priority_order") == "this torch has no torch._C._get_sdp_priority_order"
    assert tp.sdp_priority_order() == default


def test_nested_sdpa_with_and_without(monkeypatch):
    x = torch.randn(3, 10, 2, 8, generator=torch.Generator().manual_seed(0))  # (B, T, H, D)
    nt = padded_to_nested(x, torch.tensor([3, 10, 1])).transpose(1, 2)  # (B, H, j, D)
    assert hasattr(tp.nested_sdpa(), "_select_sdp_backend")
    assert explain_sdpa(nt, nt, nt).chosen is not None
    monkeypatch.setitem(sys.modules, "torch.nested._internal.sdpa", None)  # import now raises ImportError
    why = "this torch has no torch.nested._internal.sdpa"
    assert tp.nested_sdpa() is None and tp.missing("nested_sdpa") == why
    r = explain_sdpa(nt, nt, nt)
    assert r.chosen is None and r.layout == "jagged" and r.error.startswith("cannot predict: " + why)


# ---- torch._dynamo.config.patch(recompile_limit=) ----------------------------------------------------------------

def test_recompile_limit_with_and_without(monkeypatch):
    import torch._dynamo.config as config

    before = config.recompile_limit
    with tp.recompile_limit(before + 56):
        assert config.recompile_limit == before + 56
    assert config.recompile_limit == before
    monkeypatch.setitem(sys.modules, "torch._dynamo.config", SimpleNamespace(cache_size_limit=8, patch=lambda **kw: kw))
    assert tp.recompile_limit(64) == {"cache_size_limit": 64}  # an older torch's name for it
    monkeypatch.setitem(sys.modules, "torch._dynamo.config", None)
    assert isinstance(tp.recompile_limit(64), contextlib.nullcontext)


# ---- torch.utils.cpp_extension._get_build_directory --------------------------------------------------------------

@pytest.mark.parametrize("env", [True, False], ids=["TORCH_EXTENSIONS_DIR", "default root"])
def test_build_directory_with_and_without(monkeypatch, tmp_path, env):
    from torch.utils import cpp_extension

    if env:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    else:
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path / "root"))
    with_torch = tp.build_directory("btlib_probe")
    monkeypatch.delattr(cpp_extension, "_get_build_directory")
    assert tp.build_directory("btlib_probe") == with_torch and Path(with_torch).is_dir()
    assert with_torch.startswith(str(tmp_path))


# ---- torch.nn.modules.module's global forward hooks -----------------------------------------------------------------

def test_global_forward_hooks_with_and_without(monkeypatch):
    assert tp.global_forward_hooks() is False
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        assert tp.global_forward_hooks() is True
    finally:
        handle.remove()
    assert tp.global_forward_hooks() is False
    monkeypatch.delattr(nn.modules.module, "_global_forward_hooks")
    assert tp.global_forward_hooks() is True  # unknown: the module's own forward runs, which is always right


# ---- torch._check -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("present", [True, False], ids=["torch", "fallback"])
def test_check(monkeypatch, present):
    if not present:
        monkeypatch.delattr(torch, "_check")
    tp.check(True, lambda: "not raised")
    with pytest.raises(RuntimeError, match="head_dim must be in"):
        tp.check(2 > 3, lambda: "head_dim must be in [1, 256]")


# ---- no private torch name outside btlib._torch_private --------------------------------------------------------------

_PRIVATE = re.compile(r"torch\.(?:ops\.(?:mkldnn|onednn)\b|(?:\w+\.)*_(?!_))")  # torch._X, torch.a._b; not torch.__x__
_CALL_IN_STRING = re.compile(r"\btorch\.(?:ops\.(?:mkldnn|onednn)\.|(?:\w+\.)*_(?!_))[\w.]*\(")  # code in a string


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, name) of every private torch name the code uses: attribute chains rooted at torch (or at a name
    imported from it), imports, and strings that name one (a logger's dotted name, code run in a subprocess).
    Comments and docstrings are prose; strings that mention a name in a message (no call, not the whole string)
    are too."""
    tree = ast.parse(source)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    aliases, found = {"torch": "torch"}, []
    for node in ast.walk(tree):  # imports first: an alias must be known before its uses are read
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    found.append((node.lineno, a.name))
                    aliases[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            found.append((node.lineno, node.module))
            for a in node.names:
                full = f"{node.module}.{a.name}"
                found.append((node.lineno, full))
                aliases[a.asname or a.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts, root = [node.attr], node.value
            while isinstance(root, ast.Attribute):
                parts.append(root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in aliases:
                found.append((node.lineno, ".".join([aliases[root.id], *reversed(parts)])))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            s = node.value.strip()
            if re.fullmatch(r"torch(\.\w+)+", s) or _CALL_IN_STRING.search(s):
                found.append((node.lineno, s if "\n" not in s else _CALL_IN_STRING.search(s).group(0)))
    return sorted({(line, name) for line, name in found if _PRIVATE.match(name + ".")})


def test_the_scan_finds_private_uses_and_ignores_prose():
    src = textwrap.dedent('''\
        """A docstring naming torch._int_mm(a, b) is prose."""
        import logging
        import torch
        import torch.nn.functional as F
        from torch.utils.cpp_extension import _get_build_directory
        from torch.nested._internal import sdpa

        def f(a, b):
            """torch._C._get_sdp_priority_order() here is prose too."""
            # torch._addmm_activation in a comment
            print(torch.__version__, torch.__file__, F.linear, torch.backends.mkldnn.is_available())
            log = logging.getLogger("torch.nested._internal.sdpa")
            msg = f"this torch has no torch._int_mm (so {a} cannot run)"
            script = "x = 1\\nrun = lambda: torch._C._nn.mkldnn_linear(a, b)\\n"
            return torch._int_mm(a, b), torch.ops.mkldnn._linear_pointwise, torch.ops.onednn.qlinear_prepack, F._x
        ''')
    names = [name for _, name in private_uses(src)]
    assert names == ["torch.utils.cpp_extension._get_build_directory", "torch.nested._internal",
                     "torch.nested._internal.sdpa", "torch.nested._internal.sdpa", "torch._C._nn.mkldnn_linear(",
                     "torch._int_mm", "torch.nn.functional._x", "torch.ops.mkldnn", "torch.ops.mkldnn._linear_pointwise",
                     "torch.ops.onednn", "torch.ops.onednn.qlinear_prepack"], names


def test_no_private_torch_name_outside_torch_private():
    allowed = ROOT / "btlib" / "_torch_private.py"
    uses = [f"{path.relative_to(ROOT)}:{line}: {name}" for path in sorted((ROOT / "btlib").rglob("*.py")) if path != allowed
            for line, name in private_uses(path.read_text())]
    assert uses == [], ("private torch names outside btlib/_torch_private.py: add an entry there (a check and the "
                        "fallback the call site needs) and call it:\n" + "\n".join(uses))
