"""btlib's C++ ops under torch.library.opcheck, and torch.compile(fullgraph=True) through PackedEncoder with them inside.

opcheck runs each op of the build this CPU uses (build.isa()) on real and fake tensors (schema, autograd
registration, fake kernel against the real output's shape / dtype / strides, AOT dispatch) at sizes that are
never tile multiples: 1 and 97 tokens, a batch of 1, a sequence of length 0. The compile tests trace a small
random nn.TransformerEncoder (odd sizes) and the pretrained model's encoder, and check the graph holds one
btlib varlen op per layer and equals eager: fp32 within 1e-5; bf16 (where native) no further from fp32 than
2x eager bf16's own error, the house low-precision rule (inductor rounds to bf16 at other points than eager).
"""

import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from btlib import PackedEncoder, lengths_to_cu_seqlens
from btlib.device import SlowPrecisionWarning
from btlib.hardware import bf16_native
from btlib.kernels import relative_error
from btlib.kernels.cpu import build
from btlib.kernels.cpu.schema import OPS

from model_folder import needs_model

pytestmark = pytest.mark.skipif(build.available() is not None, reason=f"C++ kernels cannot build here: {build.available()}")


@pytest.fixture(scope="module")
def ops():
    build.load()
    return build.ops()


def _cu(lengths: list[int]) -> tuple[torch.Tensor, int]:
    cu, max_seqlen = lengths_to_cu_seqlens(torch.tensor(lengths))
    return cu, int(max_seqlen)


def _varlen_cases():
    # (lengths, H, D, dtype, window + position bias): 1 token; 97 tokens with a sequence of length 0; a batch of 1
    # of 97; the last two with an ALiBi and a table bias (its three op arguments, PositionBias.kernel_args)
    for dtype in (torch.float32, torch.bfloat16):
        yield [1], 1, 8, dtype, (-1, -1)
        yield [40, 0, 57], 3, 20, dtype, (-1, -1)
        yield [97], 2, 33, dtype, (5, 0)
        yield [40, 0, 57], 3, 20, dtype, (-1, -1, torch.rand(3), 1, 0)
        yield [97], 2, 33, dtype, (5, 0, torch.randn(2, 9), 2, 4)


@pytest.mark.parametrize("lengths, H, D, dtype, window", list(_varlen_cases()), ids=str)
def test_opcheck_varlen(ops, lengths, H, D, dtype, window):
    cu, max_seqlen = _cu(lengths)
    total = int(cu[-1])
    qkv = torch.randn(total, 3, H, D).to(dtype)  # strided views, as PackedEncoder passes them
    q, k, v = qkv.unbind(1)
    torch.library.opcheck(ops.varlen_v3, (q, k, v, cu, max_seqlen, False, D**-0.5, *window))


def _padded_cases():
    # (op, B, T, S, lengths, dtype, causal, window)
    for op in ("attention_v1", "attention_v2", "attention_v3"):
        dtypes = (torch.float32, torch.bfloat16) if op == "attention_v3" else (torch.float32,)
        for dtype in dtypes:
            yield op, 1, 1, 1, None, dtype, False, ()
            yield op, 3, 97, 97, [97, 0, 50], dtype, True, ()  # a fully padded row (length 0)
            yield op, 1, 97, 70, [70], dtype, False, ()
    yield "attention_v3", 2, 97, 97, [97, 13], torch.float32, False, (7, 3)
    yield "attention_v3", 2, 97, 70, [70, 13], torch.bfloat16, True, (-1, -1, torch.randn(2, 7), 2, 3)  # table bias


@pytest.mark.parametrize("op, B, T, S, lengths, dtype, causal, window", list(_padded_cases()), ids=str)
def test_opcheck_padded(ops, op, B, T, S, lengths, dtype, causal, window):
    H, D = 2, 24
    q = torch.randn(B, T, H, D).to(dtype).transpose(1, 2)  # (B, H, T, D) with head_dim contiguous
    k, v = torch.randn(2, B, H, S, D).to(dtype)
    L = None if lengths is None else torch.tensor(lengths)
    torch.library.opcheck(getattr(ops, op), (q, k, v, L, causal, 0.25, *window))


def test_opcheck_build_info(ops):
    # no tensor in or out, so no fake kernel: its catch-all runs under a FakeTensorMode as it does eagerly.
    # opcheck's AOT test compares outputs with torch.testing, which compares tensors and numbers, not strings
    torch.library.opcheck(ops.build_info, (), test_utils=("test_schema", "test_faketensor"))
    assert f"ops=btlib_cpu_{build.isa()}" in ops.build_info()


def test_every_op_has_a_fake_kernel(ops):
    for name in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(getattr(ops, name).default.name(), "Meta"), name
    q = torch.randn(5, 2, 8, device="meta")
    out = ops.varlen_v3(q, q, q, torch.empty(3, dtype=torch.int32, device="meta"), 4, False, 1.0)
    assert out.shape == (5, 2, 8) and out.is_contiguous() and out.device.type == "meta"


def test_fake_kernel_checks_what_needs_no_data(ops):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.randn(5, 2, 8)
        with pytest.raises(RuntimeError, match="head_dim must be contiguous"):
            qt = q.transpose(1, 2)
            ops.varlen_v3(qt, qt, qt, torch.zeros(2, dtype=torch.int32), 5, False, 1.0)
        with pytest.raises(RuntimeError, match="int32"):
            ops.varlen_v3(q, q, q, torch.zeros(2, dtype=torch.int64), 5, False, 1.0)
        with pytest.raises(RuntimeError, match="dtype must be float32;"):
            ops.attention_v1(*(torch.randn(1, 2, 3, 8, dtype=torch.bfloat16),) * 3, None, False, 1.0)
        with pytest.raises(RuntimeError, match=r"position bias must be \(2, 9\)"):
            ops.varlen_v3(q, q, q, torch.zeros(2, dtype=torch.int32), 5, False, 1.0, -1, -1, torch.zeros(2, 8), 2, 4)


def test_outputs_stay_detached(ops):
    # no backward: the Autograd kernel runs the op below autograd, as the registry documents (differentiable=False)
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    out = ops.attention_v3(q, q, q, None, False, 1.0)
    assert not out.requires_grad
    torch.library.opcheck(ops.attention_v3, (q, q, q, None, False, 1.0), test_utils="test_autograd_registration")


# ---- torch.compile(fullgraph=True) ------------------------------------------------------------------------

def _compiled(fn, seen: list):
    """torch.compile(fn, fullgraph=True) through inductor, recording the ops of each graph dynamo hands it."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True)


def _varlen_ops(seen: list) -> int:
    # either varlen kernel: bf16 takes the AMX one where Linux grants tile state, everything else v3
    prefixes = tuple(f"btlib_cpu_{build.isa()}.{op}" for op in ("varlen_v3", "varlen_amx"))
    return sum(t.startswith(prefixes) for t in seen)


def test_gemm_linear_traces():
    # the traceable branch (aten addmm / _addmm_activation) against eager's measured path, every epilogue
    from btlib import gemm

    x, w, b, r = torch.randn(7, 33), torch.randn(19, 33), torch.randn(19), torch.randn(7, 19)
    with torch.no_grad():
        for act, res in (("none", None), ("gelu", None), ("relu", r), ("none", r)):
            fn = lambda x, act=act, res=res: gemm.linear(x, w, b, act, res)  # noqa: E731
            torch._dynamo.reset()
            compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
            assert relative_error(compiled, fn(x)) <= 1e-5, act


def _random_encoder() -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(36, 3, 52, dropout=0.0, activation="gelu", batch_first=True)  # head_dim 12
    return nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(36), enable_nested_tensor=False).eval()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_packed_encoder_equals_eager(ops, dtype):
    if dtype == torch.bfloat16 and not bf16_native()[0]:
        pytest.skip(f"bf16 is not native here: {bf16_native()[1]}")
    enc = _random_encoder()
    fp32 = PackedEncoder.from_module(enc)
    with warnings.catch_warnings():  # bf16 asked for explicitly: the speed warning is not this test's concern
        warnings.simplefilter("ignore", SlowPrecisionWarning)
        packed = PackedEncoder.from_module(enc, dtype=dtype)
    cu, max_seqlen = _cu([40, 0, 57])  # 97 tokens, one empty sequence
    x = torch.randn(97, 36)
    seen = []
    with torch.no_grad():
        # compiled first: dynamo meets the kernel choice (registry.select) still to be made
        compiled = _compiled(packed.forward_packed, seen)(x.to(dtype), cu, max_seqlen)
        eager = packed.forward_packed(x.to(dtype), cu, max_seqlen)
        ref = fp32.forward_packed(x, cu, max_seqlen)
    assert _varlen_ops(seen) == len(enc.layers)  # btlib's kernel inside the graph, once per layer
    assert compiled.dtype == dtype and compiled.shape == (97, 36)
    if dtype == torch.float32:
        assert relative_error(compiled, eager) <= 1e-5
    else:
        assert relative_error(compiled, ref) <= 2 * relative_error(eager, ref)


@pytest.mark.slow
@needs_model
def test_compiled_pretrained_encoder_equals_eager(ops, model):
    ids = model.tokenize(["a", "a longer sentence about packed tokens and compiled graphs", "b c"])
    seen = []
    with torch.inference_mode():
        x, cu, max_seqlen = model._packed_inputs(ids)  # what _forward_packed hands forward_packed
        encoder = model.packed_encoder(torch.float32)
        eager = encoder.forward_packed(x, cu, max_seqlen)
        compiled = _compiled(encoder.forward_packed, seen)(x, cu, max_seqlen)
    assert _varlen_ops(seen) == model.spec.num_layers
    assert relative_error(compiled, eager) <= 1e-5


@pytest.mark.slow
def test_compiles_before_anything_is_loaded():
    # a fresh process: the build loads (and the kernel is chosen) while dynamo traces, outside the graph
    code = """
import torch
from torch import nn
from btlib import PackedEncoder, lengths_to_cu_seqlens
from btlib.kernels.cpu import build
from btlib.kernels import relative_error
enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(20, 2, 28, 0.0, batch_first=True), 1, enable_nested_tensor=False)
packed = PackedEncoder.from_module(enc.eval())
cu, max_seqlen = lengths_to_cu_seqlens(torch.tensor([3, 0, 4]))
x = torch.randn(7, 20)
assert not build._loaded
with torch.no_grad():
    y = torch.compile(packed.forward_packed, backend="aot_eager", fullgraph=True)(x, cu, int(max_seqlen))
    print(sorted(map(str, build._loaded)), relative_error(y, packed.forward_packed(x, cu, int(max_seqlen))))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    loaded, err = r.stdout.rsplit(maxsplit=1)
    assert loaded == "['None']" and float(err) <= 1e-5


def test_constant_result_is_torchs_mark_without_importing_dynamo():
    """btlib marks its trace-time functions as torch.compiler.assume_constant_result does, without importing
    torch._dynamo (and with it triton) when btlib is imported: the mark must stay torch's own."""
    import torch._dynamo.decorators as decorators

    from btlib._compile import MARK, constant_result

    theirs, ours = decorators.assume_constant_result(lambda: 0), constant_result(lambda: 0)
    assert getattr(theirs, MARK) is True and vars(ours) == vars(theirs)
