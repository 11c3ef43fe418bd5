"""Every private PyTorch API btlib uses, reached through this module and nowhere else, each with its fallback.

Private names (``torch._X``, ``torch._C``, ``torch.ops.mkldnn`` / ``onednn``, ``torch.nested._internal``)
change between releases without a deprecation. btlib needs a few; each is one entry below, looked up at call
time (never at import), with :func:`missing` as its cheap check (a getattr or an import, no computation) and the
fallback its call site needs:

    entry                      private symbol                                 where this torch lacks it
    int_mm                     torch._int_mm                                  raises: int8 is unavailable (why)
    addmm_activation           torch._addmm_activation                        addmm, then GELU / ReLU (same result)
    reorder_linear_weight,     torch.ops.mkldnn._reorder_linear_weight,       raises RuntimeError: btlib.gemm takes
    linear_pointwise(_binary)  _linear_pointwise (+ .binary)                  F.linear (path_available says why)
    qlinear_prepack,           torch.ops.onednn.qlinear_prepack,              raises: btlib.gemm's onednn_int8 path
    qlinear_pointwise          qlinear_pointwise                              is unavailable (path_available: why)
    mkldnn_linear              torch._C._nn.mkldnn_linear                     raises (oneDNN's rate is not measured)
    mask_left_aligned          torch._nested_tensor_from_mask_left_aligned    the same test in plain torch ops
    fused_sdp_choice           torch._fused_sdp_choice                        raises: explain_sdpa says it cannot
                                                                              ask the dispatcher
    sdp_priority_order         torch._C._get_sdp_priority_order               the default order (flash, efficient,
                                                                              math, cudnn)
    nested_sdpa                torch.nested._internal.sdpa                    None: explain_sdpa says it cannot ask
                                                                              the jagged gates
    recompile_limit            torch._dynamo.config.patch(recompile_limit=)   cache_size_limit (its older name),
                                                                              else no patch
    build_directory            torch.utils.cpp_extension._get_build_directory its rule with the public
                                                                              get_default_build_root
    global_forward_hooks       torch.nn.modules.module._global_forward_*hooks True (take the module's forward)
    check                      torch._check                                   raise RuntimeError(message())

``torch._check`` is documented (its own page in PyTorch's reference, and the custom-ops tutorial uses it in fake
kernels), but its name is private; it sits here so that one rule holds without exceptions: no private torch name
outside this module (tests/test_torch_private.py checks btlib's sources, and runs every entry with this torch
and with its symbol taken away). Logger names (:data:`NESTED_SDPA_LOGGER`, :data:`FX_TRACE_LOGGER`) need no
fallback: a logger nothing writes to is harmless.

Imports only torch: the bottom line of docs/architecture.md's layers.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["missing", "int_mm", "addmm_activation", "reorder_linear_weight", "linear_pointwise", "linear_pointwise_binary",
           "qlinear_prepack", "qlinear_pointwise", "mkldnn_linear", "mask_left_aligned", "fused_sdp_choice",
           "sdp_priority_order", "nested_sdpa", "recompile_limit", "build_directory", "global_forward_hooks", "check",
           "NESTED_SDPA_LOGGER", "FX_TRACE_LOGGER", "SYMBOLS"]

NESTED_SDPA_LOGGER = "torch.nested._internal.sdpa"  # where the jagged SDPA gates log their refusals
FX_TRACE_LOGGER = "torch.fx._symbolic_trace"  # logs "is_fx_tracing will return true ..." for jagged tensors (2.13)


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _ops(namespace: str):
    return getattr(torch.ops, namespace, None)


# entry -> (where the symbol lives: a function returning its owner or None, attribute, its dotted name for messages)
SYMBOLS: dict[str, tuple[Callable, str, str]] = {
    "int_mm": (lambda: torch, "_int_mm", "torch._int_mm"),
    "addmm_activation": (lambda: torch, "_addmm_activation", "torch._addmm_activation"),
    "reorder_linear_weight": (lambda: _ops("mkldnn"), "_reorder_linear_weight", "torch.ops.mkldnn._reorder_linear_weight"),
    "linear_pointwise": (lambda: _ops("mkldnn"), "_linear_pointwise", "torch.ops.mkldnn._linear_pointwise"),
    "qlinear_prepack": (lambda: _ops("onednn"), "qlinear_prepack", "torch.ops.onednn.qlinear_prepack"),
    "qlinear_pointwise": (lambda: _ops("onednn"), "qlinear_pointwise", "torch.ops.onednn.qlinear_pointwise"),
    "mkldnn_linear": (lambda: getattr(getattr(torch, "_C", None), "_nn", None), "mkldnn_linear", "torch._C._nn.mkldnn_linear"),
    "mask_left_aligned": (lambda: torch, "_nested_tensor_from_mask_left_aligned", "torch._nested_tensor_from_mask_left_aligned"),
    "fused_sdp_choice": (lambda: torch, "_fused_sdp_choice", "torch._fused_sdp_choice"),
    "sdp_priority_order": (lambda: getattr(torch, "_C", None), "_get_sdp_priority_order", "torch._C._get_sdp_priority_order"),
    "nested_sdpa": (lambda: _module("torch.nested._internal"), "sdpa", "torch.nested._internal.sdpa"),
    "recompile_limit": (lambda: _module("torch._dynamo.config"), "recompile_limit", "torch._dynamo.config.recompile_limit"),
    "build_directory": (lambda: _module("torch.utils.cpp_extension"), "_get_build_directory",
                        "torch.utils.cpp_extension._get_build_directory"),
    "global_forward_hooks": (lambda: torch.nn.modules.module, "_global_forward_hooks",
                             "torch.nn.modules.module._global_forward_hooks"),
    "check": (lambda: torch, "_check", "torch._check"),
}


def _get(entry: str):
    owner_of, attr, _ = SYMBOLS[entry]
    owner = owner_of()
    return None if owner is None else getattr(owner, attr, None)


def missing(entry: str) -> str | None:
    """None if this torch has ``entry``'s private symbol (a key of :data:`SYMBOLS`); else "this torch has no <name>"."""
    if entry == "nested_sdpa":  # a submodule: only importing it says whether it is there
        return None if nested_sdpa() is not None else f"this torch has no {SYMBOLS[entry][2]}"
    return None if _get(entry) is not None else f"this torch has no {SYMBOLS[entry][2]}"


def _require(entry: str, consequence: str):
    fn = _get(entry)
    if fn is None:
        raise RuntimeError(f"{missing(entry)}: {consequence}")
    return fn


def int_mm(a: Tensor, b: Tensor) -> Tensor:
    """a (M, K) int8 @ b (K, N) int8 -> (M, N) int32, exact integer sums. Raises RuntimeError where torch has none."""
    if hasattr(torch, "_int_mm"):  # per call (btlib.quant: every row block): an attribute read, not a SYMBOLS lookup
        return torch._int_mm(a, b)
    raise RuntimeError(f"{missing('int_mm')}: int8 matmuls are unavailable here; use precision='fp32'")


def addmm_activation(bias: Tensor, x: Tensor, w_t: Tensor, use_gelu: bool) -> Tensor:
    """act(bias + x @ w_t), act exact GELU (use_gelu) or ReLU; x (M, K), w_t (K, N), bias (N,) -> (M, N).

    With torch._addmm_activation the activation runs in the GEMM's epilogue (one pass over (M, N), not two);
    without it, addmm then the activation: the same values.
    """
    if hasattr(torch, "_addmm_activation"):  # plain hasattr: dynamo traces it (btlib.gemm.linear under torch.compile)
        return torch._addmm_activation(bias, x, w_t, use_gelu=use_gelu)
    y = torch.addmm(bias, x, w_t)
    return F.gelu(y) if use_gelu else F.relu(y)


_NO_ONEDNN = "btlib.gemm's onednn path is unavailable (F.linear runs instead)"


def reorder_linear_weight(w: Tensor) -> Tensor:
    """W (N, K) fp32 / bf16 -> oneDNN's blocked copy of it (for :func:`linear_pointwise`)."""
    return _require("reorder_linear_weight", _NO_ONEDNN)(w, None)


def linear_pointwise(x: Tensor, packed_w: Tensor, bias: Tensor | None, attr: str, scalars: list, algorithm: str) -> Tensor:
    """oneDNN's x W^T + b with the ``attr`` epilogue ("none", "gelu", "relu"); packed_w from :func:`reorder_linear_weight`."""
    ops = getattr(torch.ops, "mkldnn", None)  # per call: attribute reads only (~0.1 us), as the op call it replaces
    if ops is None or not hasattr(ops, "_linear_pointwise"):
        raise RuntimeError(f"{missing('linear_pointwise')}: {_NO_ONEDNN}")
    return ops._linear_pointwise(x, packed_w, bias, attr, scalars, algorithm)


def linear_pointwise_binary(x: Tensor, other: Tensor, packed_w: Tensor, bias: Tensor | None, attr: str) -> Tensor:
    """oneDNN's x W^T + b combined with ``other`` (x's leading shape + (N,)) by ``attr`` ("add") in the epilogue."""
    ops = getattr(torch.ops, "mkldnn", None)
    if ops is None or not hasattr(ops, "_linear_pointwise"):
        raise RuntimeError(f"{missing('linear_pointwise')}: {_NO_ONEDNN}")
    return ops._linear_pointwise.binary(x, other, packed_w, bias, attr)


_NO_QLINEAR = "btlib.gemm's onednn_int8 path is unavailable"


def qlinear_prepack(w: Tensor, x_shape: list[int]) -> Tensor:
    """w (N, K) int8 -> oneDNN's packed int8 weight for inputs of shape x_shape."""
    return _require("qlinear_prepack", _NO_QLINEAR)(w, x_shape)


def qlinear_pointwise(*args) -> Tensor:
    """torch.ops.onednn.qlinear_pointwise with its own arguments (see btlib.gemm.onednn_int8_linear)."""
    return _require("qlinear_pointwise", _NO_QLINEAR)(*args)


def mkldnn_linear(a: Tensor, b: Tensor) -> Tensor:
    """a @ b^T on tensors already in oneDNN's layout (``.to_mkldnn()``), no conversion per call."""
    return _require("mkldnn_linear", "oneDNN's matmul rate cannot be measured")(a, b)


def mask_left_aligned(t: Tensor, mask: Tensor) -> bool:
    """Whether every row of mask (B, T) bool (True = a real token) is True up to its length and False after:
    what nn.TransformerEncoder asks before it packs the batch into a nested tensor. Without torch's op, the
    same test as two shifted slices: no row may have a True right after a False."""
    fn = _get("mask_left_aligned")
    if fn is not None:
        return bool(fn(t, mask))
    if mask.dtype != torch.bool or mask.dim() != 2:
        raise RuntimeError(f"mask must be a (B, T) bool tensor; got {mask.dtype} of shape {tuple(mask.shape)}")
    return not bool((mask[:, 1:] & ~mask[:, :-1]).any())


def fused_sdp_choice(*args, **kwargs) -> int:
    """The SDPBackend value F.scaled_dot_product_attention's dispatcher picks for these arguments (SDPA's own)."""
    return _require("fused_sdp_choice", "explain_sdpa cannot ask the dispatcher which backend it picks")(*args, **kwargs)


def sdp_priority_order() -> list[int]:
    """SDPBackend values in the order CUDA's dispatcher tries them; without torch's getter, its default order."""
    fn = _get("sdp_priority_order")
    if fn is not None:
        return list(fn())
    from torch.nn.attention import SDPBackend

    return [SDPBackend.FLASH_ATTENTION.value, SDPBackend.EFFICIENT_ATTENTION.value, SDPBackend.MATH.value,
            SDPBackend.CUDNN_ATTENTION.value]


def nested_sdpa():
    """torch.nested._internal.sdpa (what SDPA calls for jagged nested tensors), or None where this torch has none."""
    return _module("torch.nested._internal.sdpa")


def recompile_limit(n: int) -> contextlib.AbstractContextManager:
    """A context in which dynamo compiles a function for up to n input shapes (default 8) before it falls back
    to eager. Imports torch._dynamo (only when called). Older torch names the setting cache_size_limit; where
    neither exists, no patch."""
    config = _module("torch._dynamo.config")
    for name in ("recompile_limit", "cache_size_limit"):
        if config is not None and hasattr(config, name) and hasattr(config, "patch"):
            return config.patch(**{name: n})
    return contextlib.nullcontext()


def build_directory(name: str) -> str:
    """Where torch.utils.cpp_extension.load builds and caches extension ``name`` (created if absent):
    $TORCH_EXTENSIONS_DIR/<name>, else <default root>/py<ver>_<cpu|cuXY|rocmXY>/<name>."""
    fn = _get("build_directory")
    if fn is not None:
        return fn(name, verbose=False)
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        hip, cuda = torch.version.hip, torch.version.cuda
        accelerator = f"rocm{hip.replace('.', '')}" if hip else f"cu{cuda.replace('.', '')}" if cuda else "cpu"
        py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{py}_{accelerator}")
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    return path


def global_forward_hooks() -> bool:
    """Whether any global forward (pre-)hook is registered (torch.nn.modules.module.register_module_forward_hook):
    then a module's own forward must run for it. True where this torch keeps them elsewhere (the safe answer)."""
    m = torch.nn.modules.module  # plain attribute reads: dynamo traces them (btlib.gemm.module_linear, compiled)
    if not (hasattr(m, "_global_forward_hooks") and hasattr(m, "_global_forward_pre_hooks")):
        return True
    return bool(m._global_forward_hooks) or bool(m._global_forward_pre_hooks)


def _check_fallback(cond, message: Callable[[], str] | None = None) -> None:
    if not cond:
        raise RuntimeError(message() if message is not None else "Expected cond to be True")


def check(cond, message: Callable[[], str] | None = None) -> None:
    """torch._check(cond, message): raise RuntimeError(message()) unless cond; on fake tensors it records the
    condition instead of reading data. Without it, a plain test of cond (real shapes only)."""
    if hasattr(torch, "_check"):
        torch._check(cond, message)
    else:
        _check_fallback(cond, message)
