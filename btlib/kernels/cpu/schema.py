"""The C++ CPU attention ops, each declared once: its schema, the dtypes it takes, what it computes.

    OPS                   op name -> Op(schema, dtypes, doc): the one place each op's signature is written
    define(namespace)     define every op in ``torch.ops.<namespace>`` from its schema, with its fake kernel and
                          its Autograd fallthrough (build.py calls it before the library loads, for every ISA and
                          every load_copy tag); each family's TORCH_LIBRARY_IMPL then adds the CPU kernels
    call_args(spec, values)  an op's positional arguments, in its schema's order, from their names (ops.py's wrappers)

What is derived from the schema rather than written again: the Python wrappers of ops.py (which arguments
an op takes, so whether it has a window or a position bias), the fake kernels below (one function for
every op: the arguments bound by name, the checks that need no data), and the registry's entries (dtypes,
window, bias). The C++ side only implements: a family's ``m.impl(name, fn)`` (flash/flash.cpp,
teaching/teaching.cpp) names each op once.

A fake kernel computes only what the real one returns: shape, dtype, device and strides, from the inputs'
metadata: (B, H, T, D) or (total, H, D), q's dtype, contiguous (at::empty(q.sizes())). It repeats the
binding's checks that need no data (rank, dtype, shapes, head_dim, strides, the window's reaches, the
position bias's kind and shape), with its messages. The checks that read values (lengths in [0, min(T, S)],
cu_seqlens 0-based, non-decreasing, ending at total, no sequence above max_seqlen) cannot run on fake
tensors: the C++ kernel makes them when the compiled graph runs. build_info() and amx_status() take and
return no tensor: flash/flash.cpp defines them, catch-all kernels never in a graph.

What traces: these ops, with torch.compile(fullgraph=True) (btlib.PackedEncoder.forward_packed with
the C++ varlen kernel inside: tests/test_compile.py). What does not: btlib.quant's int8 helpers in
int8.cpp, which are pybind functions, not torch ops (dynamo cannot trace into them).
"""

from __future__ import annotations

import ast
import re
import threading
from typing import NamedTuple

import torch
from torch import Tensor

from ... import _torch_private as tp

__all__ = ["Op", "OPS", "MAX_HEAD_DIM", "define", "call_args"]

MAX_HEAD_DIM = 256  # kMaxD in core.h
_F32 = (torch.float32,)
_F32_BF16 = (torch.float32, torch.bfloat16)


class Op(NamedTuple):
    """One op: its schema (torch.library's syntax), the dtypes q, k, v may have, and what it computes."""

    schema: str
    dtypes: tuple[torch.dtype, ...]
    doc: str

    @property
    def args(self) -> tuple[tuple[str, object], ...]:
        """(name, default) of each argument, in order; default is :data:`REQUIRED` where there is none."""
        return _parse(self.schema)

    @property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.args)


REQUIRED = object()  # an argument without a default
_COMMON = "Tensor q, Tensor k, Tensor v"
_EXTRAS = "int window_left=-1, int window_right=-1, Tensor? bias=None, int bias_kind=0, int bias_max_distance=0"

OPS: dict[str, Op] = {
    "attention_v1": Op(f"attention_v1({_COMMON}, Tensor? lengths, bool causal, float scale) -> Tensor", _F32,
                       "v1: materialise S = Q K^T (T x S per (b, h)), softmax, P V. (B, H, T, D) float32."),
    "attention_v2": Op(f"attention_v2({_COMMON}, Tensor? lengths, bool causal, float scale) -> Tensor", _F32,
                       "v2: Br x Bc tiles, two passes over K (max, then exp-sum and P V). (B, H, T, D) float32."),
    "attention_v3": Op(f"attention_v3({_COMMON}, Tensor? lengths, bool causal, float scale, {_EXTRAS}) -> Tensor", _F32_BF16,
                       "v3: one pass, online softmax, SIMD micro-kernels, threads over (b, h, query block). (B, H, T, D) "
                       "fp32/bf16.\n\nwindow=(left, right): local attention; only the key tiles meeting a query block's band "
                       "are computed.\nbias: a btlib.PositionBias of H heads on the CPU, added per score in the tile loop."),
    "varlen_v3": Op(f"varlen_v3({_COMMON}, Tensor cu_seqlens, int max_seqlen, bool causal, float scale, {_EXTRAS}) -> Tensor",
                    _F32_BF16,
                    "v3 on packed tokens: (total, H, D) fp32/bf16, cu_seqlens (B + 1,) int32; work 4 H D sum(L_i^2), with\n"
                    "window=(left, right) about 4 H D sum_i L_i (64 + left + right) (whole 64-key tiles around each block's "
                    "band).\n\nmax_seqlen only bounds the lengths here: on a CPU the kernel reads cu_seqlens itself (host "
                    "memory,\nB integers, no sync) and makes one task per real query block, so nothing is sized by it. The "
                    "GPU\nkernels size their grid by it instead of reading the lengths back from the device.\n"
                    "bias: a btlib.PositionBias, positions counted from each sequence's first token."),
    # float32 in and out runs too, with bf16 products (q, k, v rounded while packing): its error is bf16's, so the
    # registry offers it for bfloat16 inputs only (ops.py)
    "varlen_amx": Op(f"varlen_amx({_COMMON}, Tensor cu_seqlens, int max_seqlen, bool causal, float scale, {_EXTRAS}) -> Tensor",
                     _F32_BF16,
                     "varlen_v3 with both products on AMX tiles (flash/flash_amx.h): (total, H, D) bfloat16 (float32 in and out: bf16 products),\ncu_seqlens "
                     "(B + 1,) int32. The online softmax, masks, window and bias are v3's own code (AVX-512, fp32);\nP is "
                     "rounded to bf16 for P V, as on the vdpbf16ps path. Runs where build.amx_available() is None."),
}


def _parse(schema: str) -> tuple[tuple[str, object], ...]:
    """The (name, default) pairs of a schema's arguments: "name(Type a, Type? b=None) -> Tensor"."""
    inner = re.fullmatch(r"\w+\((.*)\) -> \w+", schema).group(1)
    out = []
    for arg in inner.split(", "):
        decl, _, default = arg.partition("=")
        out.append((decl.split()[-1], ast.literal_eval(default) if default else REQUIRED))
    return tuple(out)


def call_args(spec: tuple[tuple[str, object], ...], values: dict) -> tuple:
    """An op's arguments in its schema's order (``spec``: its :attr:`Op.args`), each taken from ``values`` by name,
    its default where absent."""
    return tuple(values.get(name, default) for name, default in spec)


# ---- fake kernels: one for every op, its arguments bound by the schema's names ----------------------------

def _check_qkv(q: Tensor, k: Tensor, v: Tensor, rank: int, dtypes: tuple[torch.dtype, ...]) -> None:
    """binding.h's check_qkv, on metadata only (the device is the dispatcher's: only CPU and fake tensors get here)."""
    allowed = " or ".join(str(d).replace("torch.", "") for d in dtypes)
    for x in (q, k, v):
        tp.check(x.dim() == rank, lambda: f"btlib CPU attention: expected {'(B, H, T, D)' if rank == 4 else '(total, H, D)'} "
                                           f"inputs; got {list(x.shape)}")
        tp.check(x.dtype in dtypes, lambda: f"btlib CPU attention: dtype must be {allowed}; got {x.dtype}")
        tp.check(x.numel() == 0 or x.stride(-1) == 1,
                  lambda: "btlib CPU attention: head_dim must be contiguous (stride 1); call .contiguous()")
    tp.check(q.dtype == k.dtype == v.dtype, lambda: "btlib CPU attention: q, k, v must share one dtype")
    tp.check(k.shape == v.shape,
              lambda: f"btlib CPU attention: k and v must have one shape; got {list(k.shape)} and {list(v.shape)}")
    D = q.shape[-1]
    tp.check(1 <= D <= MAX_HEAD_DIM, lambda: f"btlib CPU attention: head_dim must be in [1, {MAX_HEAD_DIM}]; got {D}")
    tp.check(k.shape[-1] == D, lambda: f"btlib CPU attention: q and k must have one head_dim; got {D} and {k.shape[-1]}")


def _check_window(left: int, right: int) -> None:
    tp.check(left >= -1 and right >= -1, lambda: "btlib CPU attention: window_left and window_right must be >= 0, or -1 "
                                                  f"for no limit on that side; got {left} and {right}")


def _check_bias(bias: Tensor | None, kind: int, R: int, H: int) -> None:
    tp.check(0 <= kind <= 2, lambda: f"btlib CPU attention: bias_kind must be 0 (none), 1 (ALiBi) or 2 (table); got {kind}")
    tp.check((kind == 0) == (bias is None), lambda: "btlib CPU attention: pass a bias tensor exactly when bias_kind is 1 or 2 "
                                                    "(btlib.PositionBias.kernel_args() gives the three arguments)")
    if bias is None:
        return
    tp.check(bias.dtype == torch.float32, lambda: f"btlib CPU attention: the position bias must be a float32 CPU tensor; got {bias.dtype}")
    want = (H,) if kind == 1 else (H, 2 * R + 1)
    tp.check(tuple(bias.shape) == want, lambda: f"btlib CPU attention: the position bias must be {want}; got {list(bias.shape)}")


def _fake(op: Op):
    """The fake kernel of ``op``: its arguments bound by the schema's names, then the checks they call for."""
    names, defaults = op.arg_names, dict(op.args)

    def fake(*args, **kwargs):
        a = {**defaults, **dict(zip(names, args)), **kwargs}
        q, k, v = a["q"], a["k"], a["v"]
        if "cu_seqlens" in a:  # packed tokens: (total, H, D)
            _check_qkv(q, k, v, 3, op.dtypes)
            tp.check(k.shape == q.shape, lambda: "btlib CPU varlen attention: q, k, v must have one shape (total, H, D); "
                                                  f"got {list(q.shape)} and {list(k.shape)}")
            cu = a["cu_seqlens"]
            tp.check(cu.dtype == torch.int32 and cu.dim() == 1 and cu.numel() >= 1,
                      lambda: "btlib CPU varlen attention: cu_seqlens must be a 1-D int32 tensor of B + 1 offsets; "
                              f"got {cu.dtype} {list(cu.shape)}")
        else:  # padded: (B, H, T, D)
            _check_qkv(q, k, v, 4, op.dtypes)
            tp.check(k.shape[0] == q.shape[0] and k.shape[1] == q.shape[1],
                      lambda: f"btlib CPU attention: k must be (B, H, S, D) with q's B and H; got {list(k.shape)}")
            lengths = a["lengths"]
            if lengths is not None:
                tp.check(lengths.dim() == 1 and lengths.shape[0] == q.shape[0],
                          lambda: f"btlib CPU attention: lengths must be (B,) = ({q.shape[0]},); got {list(lengths.shape)}")
        if "window_left" in a:
            _check_window(a["window_left"], a["window_right"])
        if "bias" in a:
            _check_bias(a["bias"], a["bias_kind"], a["bias_max_distance"], q.shape[1])
        return q.new_empty(q.shape)  # contiguous, whatever q's strides

    fake.__name__ = fake.__qualname__ = f"fake_{op.schema.split('(')[0]}"
    return fake


_libraries: dict[str, torch.library.Library] = {}  # namespace -> its definitions (they live as long as this object)
# One lock for every namespace (each ISA's build, each load_copy tag): the check and the definitions are one step, so
# threads at first use define a namespace once (two defines raise "registered ... multiple times")
_define_lock = threading.Lock()


def define(namespace: str) -> None:
    """Define every op of :data:`OPS` in ``torch.ops.<namespace>`` (once per namespace and process): its schema,
    its fake kernel (torch.compile, opcheck) and an Autograd fallthrough.

    No backward: the fallthrough sends autograd on to the CPU (or, under a FakeTensorMode, the fake) kernel, so the
    output is detached from q, k, v, as the registry documents (only kernels marked differentiable are picked when
    inputs require grad); the default autograd fallback would hand back outputs whose backward only warns.
    """
    if namespace in _libraries:  # set only once every op is defined: a hit needs no lock
        return
    with _define_lock:
        if namespace in _libraries:
            return
        lib = torch.library.Library(namespace, "FRAGMENT")  # flash/flash.cpp adds build_info and amx_status
        for name, op in OPS.items():
            lib.define(op.schema)
            torch.library.register_fake(f"{namespace}::{name}", _fake(op), lib=lib)
            lib.impl(name, torch.library.fallthrough_kernel, "Autograd")
        _libraries[namespace] = lib
