"""The Python op of each C++ CPU kernel, derived from its one schema (schema.OPS): the wrapper and the registry
fields every family's folder (flash/, teaching/) takes from here.

    wrapper(name, python_name)   the wrapper of torch.ops.btlib_cpu_<isa>.<name>
    entry(name)                  its Kernel's fields that follow from the build and the schema

Each wrapper builds the library on its first call (build.ops), fills in the default scale, turns window=
and bias= into the op's arguments (where its schema has them) and calls ``torch.ops.btlib_cpu_<isa>.<op>`` of the build :func:`build.isa` picks. Shapes:

    attention_v1/v2(q, k, v, *, lengths=None, causal=False, scale=None)
    attention_v3(q, k, v, *, lengths=None, causal=False, scale=None, window=None, bias=None)
        q: (B, H, T, D); k, v: (B, H, S, D); lengths: (B,) int, <= min(T, S) -> (B, H, T, D)
        Any strides with head_dim contiguous: q.transpose(1, 2) of a (B, T, H, D) projection works.
    varlen_attention_v3(q, k, v, cu_seqlens, max_seqlen, *, causal=False, scale=None, window=None, bias=None)
        q, k, v: (total, H, D); cu_seqlens: (B + 1,) int32 -> (total, H, D)

window=(left, right): local attention, query i attends keys i - left .. i + right; v3 and varlen
visit only the key tiles that meet each query block's band (v1/v2, the teaching versions, take none).
bias=btlib.PositionBias (ALiBi or a relative-position table): v3 and varlen add it per score inside the
tile loop (flash/flash.h), from the positions within each sequence; v1/v2 take none (the registry says so).

Only float32 for v1/v2; float32 and bfloat16 for v3 and varlen. bf16 sums in fp32: on a CPU with
AVX512_BF16 both products run on vdpbf16ps (P is rounded to bf16 for P V, as PyTorch does);
elsewhere bf16 is converted to fp32 while packing. The output is rounded to bf16 once.

torch.compile: every op has a fake kernel (schema.py), so these wrappers trace with fullgraph=True and the
op lands in the graph; the build's load and the bf16 warning run once while dynamo traces, not in the graph.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from ... import precision
from ..._compile import constant_result
from ...checks import INT32_MAX, check_int, window_reach
from ...hardware import bf16_native
from ...position_bias import PositionBias, kernel_args
from . import build
from .schema import MAX_HEAD_DIM, OPS, call_args

__all__ = ["wrapper", "entry", "MAX_HEAD_DIM"]


def _scale(q: Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


_bf16_fine: tuple | None = None  # (build, BTLIB_ASSUME_NO_BF16) for which a bf16 call found nothing to warn about


# Under torch.compile both helpers run once while dynamo traces (they read os.environ and /proc/cpuinfo, which
# dynamo cannot trace) and their results are constants of the graph: the warning comes at compile time.
@constant_result  # torch.compiler.assume_constant_result, without importing dynamo here
def _bf16_state() -> tuple:
    return build.isa(), os.environ.get("BTLIB_ASSUME_NO_BF16", "")


def _check_bf16(q: Tensor) -> None:
    """Warn once when bf16 inputs reach a build without bf16 dot products: they then run at the fp32 rate.

    Silent if btlib already warned about bf16 in this process (PackedEncoder and encode() warn about
    the slower matmuls, which matter more than this).
    """
    if q.dtype != torch.bfloat16 or _bf16_fine == _bf16_state():  # the hot paths pay one comparison
        return
    _bf16_verdict()


@constant_result  # torch.compiler.assume_constant_result, without importing dynamo here
def _bf16_verdict() -> None:
    global _bf16_fine
    if precision.warned("bf16"):
        return
    isa = build.isa()
    native, why = bf16_native()
    if isa == "avx512bf16" and native:
        _bf16_fine = _bf16_state()
        return
    reason = why if not native else f"the {isa} build was chosen (BTLIB_CPU_ISA)"
    precision.warn_once("C++ attention", (
        f"btlib's C++ attention in bf16 on the {isa} build: {reason}, so bf16 inputs are converted to fp32 "
        "while packing and run at the fp32 rate plus the conversion, no faster than fp32. It runs as asked; "
        "pass fp32 tensors (or precision='auto', which picks fp32 here) for the same speed without the rounding."), stacklevel=4)


def wrapper(name: str, python_name: str):
    """The Python wrapper of op ``name`` (called ``python_name``), derived from its schema (schema.OPS): the registry's
    call convention (keywords; ``window`` and ``bias`` where the schema has their arguments) turned into the op's
    arguments."""
    op = OPS[name]
    spec = op.args  # parsed once; the call only looks names up
    window, bias, bf16 = "window_left" in op.arg_names, "bias" in op.arg_names, torch.bfloat16 in op.dtypes

    def call(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None, win, pos_bias, given: dict) -> Tensor:
        if bf16:
            _check_bf16(q)
        if win is not None and not window:
            raise TypeError(f"{name} takes no window (its schema has no window_left / window_right)")
        if pos_bias is not None and not bias:
            raise TypeError(f"{name} takes no position bias (its schema has no bias)")
        given.update(q=q, k=k, v=v, causal=causal, scale=_scale(q, scale))
        if window:
            given["window_left"], given["window_right"] = window_reach(win)
        if bias:
            given["bias"], given["bias_kind"], given["bias_max_distance"] = kernel_args(pos_bias)
        return getattr(build.ops(), name)(*call_args(spec, given))

    if "cu_seqlens" in op.arg_names:
        def fn(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, causal: bool = False,
               scale: float | None = None, window: tuple[int, int] | None = None, bias: PositionBias | None = None) -> Tensor:
            max_seqlen = check_int(max_seqlen, "max_seqlen", high=INT32_MAX)
            return call(q, k, v, causal, scale, window, bias, {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen})
    else:
        def fn(q: Tensor, k: Tensor, v: Tensor, *, lengths: Tensor | None = None, causal: bool = False,
               scale: float | None = None, window: tuple[int, int] | None = None, bias: PositionBias | None = None) -> Tensor:
            return call(q, k, v, causal, scale, window, bias, {"lengths": lengths})
    fn.__name__ = fn.__qualname__ = python_name
    fn.op_name = name  # the torch op it calls: btlib.kernels.cpu.source.binding(name) finds the C++ that binds it
    fn.__doc__ = f"torch.ops.btlib_cpu_<isa>.{op.schema}\n\n{op.doc}"
    return fn


def entry(name: str) -> dict:
    """The registry fields of op ``name``'s Kernel that are not the family's to say: backend, device, head_dim limit,
    availability (the build), and, from its schema, its dtypes and whether it has a window and a bias."""
    op = OPS[name]
    return dict(backend="cpp", devices=("cpu",), max_head_dim=MAX_HEAD_DIM, available=build.available, dtypes=op.dtypes,
                window="window_left" in op.arg_names, bias="bias" in op.arg_names)
