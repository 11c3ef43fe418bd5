"""Will PyTorch's BetterTransformer fastpath run, and if not, why not?

PyTorch runs nn.TransformerEncoderLayer and nn.MultiheadAttention through fused native kernels
(``aten::_transformer_encoder_layer_fwd``, ``aten::_native_multi_head_attention``) only when a
long list of conditions holds, and nn.TransformerEncoder skips padding with nested tensors
(``aten::_nested_tensor_from_mask``) only under a few more. When a condition fails PyTorch
silently takes the slow path and reports only the *first* failed condition, in a local variable.

:func:`explain_fastpath` evaluates every condition that torch 2.x checks in those forward
methods (torch/nn/modules/transformer.py and activation.py) and returns all that fail, each
with the fix. :func:`ops_that_ran` and :meth:`FastpathReport.confirm` check the prediction
against the operators the profiler saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import Tensor, nn

from . import _torch_private as tp
from .observe import ops_that_ran

__all__ = ["FastpathReport", "explain_fastpath"]

LAYER_OP = "aten::_transformer_encoder_layer_fwd"
MHA_OP = "aten::_native_multi_head_attention"
NESTED_OPS = ("aten::_nested_tensor_from_mask", "aten::to_padded_tensor")


@dataclass
class FastpathReport:
    """Prediction for one module and its inputs.

    fastpath: the fused layer / MHA kernel will run.
    nested: the encoder's nested-tensor sparsity path will run (None for a layer or MHA).
    """

    module: str
    fastpath: bool
    nested: bool | None
    fastpath_reasons: list[str] = field(default_factory=list)
    nested_reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fused_op: str = LAYER_OP

    def expected_ops(self) -> dict[str, bool]:
        """Operator name -> whether it should appear in a profile of the forward."""
        ops = {self.fused_op: self.fastpath}
        if self.nested is not None:
            ops.update({op: self.nested for op in NESTED_OPS})
        return ops

    def confirm(self, ops: Iterable[str]) -> list[str]:
        """Compare with the operators that ran (see :func:`ops_that_ran`); returns the mismatches."""
        seen = set(ops)
        return [
            f"{op} {'expected but not seen' if want else 'seen but not expected'}"
            for op, want in self.expected_ops().items()
            if (op in seen) != want
        ]

    def __str__(self) -> str:
        lines = [f"{self.module}: fastpath {'YES' if self.fastpath else 'no'}"
                 + ("" if self.nested is None else f", nested-tensor sparsity {'YES' if self.nested else 'no'}")]
        lines += [f"  fastpath blocked: {r}" for r in self.fastpath_reasons]
        lines += [f"  sparsity blocked: {r}" for r in self.nested_reasons]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle) -> None:  # IPython display
        p.text(str(self))


def _tensor_reasons(tensors: Iterable[Tensor | None]) -> list[str]:
    ts = tuple(t for t in tensors if t is not None)
    reasons = []
    if torch.overrides.has_torch_function(ts):
        reasons.append("a tensor argument is a subclass with __torch_function__: pass plain tensors")
    if any(t.device.type not in ("cpu", "cuda", "xpu") for t in ts):
        reasons.append("a tensor is on a device other than cpu/cuda/xpu")
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        reasons.append("grad is enabled and the input or weights require grad: run under torch.inference_mode() or torch.no_grad()")
    return reasons


def _global_reasons(module: nn.Module) -> list[str]:
    reasons = []
    if not torch.backends.mha.get_fastpath_enabled():
        reasons.append("disabled globally: torch.backends.mha.set_fastpath_enabled(True)")
    if module.training:
        reasons.append("module is in training mode: call .eval()")
    if torch.is_autocast_enabled():
        reasons.append("autocast is enabled: cast the model instead (model.half()) or leave autocast")
    return reasons


def _mha_reasons(mha: nn.MultiheadAttention) -> list[str]:
    """Conditions on the attention module's configuration, shared by MHA and encoder layers."""
    reasons = []
    if not mha.batch_first:
        reasons.append("batch_first=False: build the module with batch_first=True")
    if mha.in_proj_bias is None:
        reasons.append("attention built with bias=False")
    if not mha._qkv_same_embed_dim:
        reasons.append("kdim/vdim differ from embed_dim (separate q/k/v projections)")
    if mha.num_heads % 2:
        reasons.append(f"num_heads={mha.num_heads} is odd")
    return reasons


def _layer_reasons(layer: nn.TransformerEncoderLayer, src: Tensor, has_mask: bool) -> list[str]:
    reasons = _global_reasons(layer) + _mha_reasons(layer.self_attn)
    if src.dim() != 3:
        reasons.append(f"input is not batched (dim {src.dim()}, needs 3)")
    if not layer.activation_relu_or_gelu:
        reasons.append("activation is neither ReLU nor GELU (pass activation='relu' or 'gelu')")
    if layer.norm1.eps != layer.norm2.eps:
        reasons.append(f"norm1.eps ({layer.norm1.eps}) != norm2.eps ({layer.norm2.eps})")
    if src.is_nested and has_mask:
        reasons.append("nested input together with a mask")
    if any(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in layer.modules()):
        reasons.append("forward hooks are attached to the layer or its children: remove them")
    a, f = layer.self_attn, layer
    reasons += _tensor_reasons((src, a.in_proj_weight, a.in_proj_bias, a.out_proj.weight, a.out_proj.bias,
                                f.norm1.weight, f.norm1.bias, f.norm2.weight, f.norm2.bias,
                                f.linear1.weight, f.linear1.bias, f.linear2.weight, f.linear2.bias))
    return reasons


def _explain_mha(mha, query, key, value, key_padding_mask, attn_mask, need_weights) -> FastpathReport:
    key = query if key is None else key
    value = key if value is None else value
    reasons = _global_reasons(mha) + _mha_reasons(mha)
    if any(m is not None and torch.is_floating_point(m) for m in (key_padding_mask, attn_mask)):
        reasons.append("a floating-point mask was given: pass a bool mask (True = ignore)")
    if query.dim() != 3:
        reasons.append(f"query is not batched (dim {query.dim()}, needs 3)")
    if query is not key or key is not value:
        reasons.append("not self-attention: query, key and value must be the same tensor object")
    if mha.in_proj_weight is not None and query.dtype != mha.in_proj_weight.dtype:
        reasons.append(f"query dtype {query.dtype} != weight dtype {mha.in_proj_weight.dtype}")
    if mha.bias_k is not None or mha.bias_v is not None:
        reasons.append("add_bias_kv=True")
    if mha.add_zero_attn:
        reasons.append("add_zero_attn=True")
    if query.is_nested and (key_padding_mask is not None or attn_mask is not None):
        reasons.append("nested input together with a mask")
    reasons += _tensor_reasons((query, key, value, mha.in_proj_weight, mha.in_proj_bias, mha.out_proj.weight, mha.out_proj.bias))
    notes = []
    if need_weights:
        notes.append("need_weights=True returns the (T x T) weights, so attention cannot run a fused SDPA kernel: pass need_weights=False")
    return FastpathReport("MultiheadAttention", not reasons, None, reasons, [], notes, MHA_OP)


def _init_nested_reasons(layer: nn.Module) -> list[str]:
    """Why nn.TransformerEncoder.__init__ would have turned use_nested_tensor off."""
    if not isinstance(layer, nn.TransformerEncoderLayer):
        return ["layers are not nn.TransformerEncoderLayer"]
    reasons = []
    if layer.norm_first:
        reasons.append("norm_first=True (pre-LN): the nested path supports post-LN layers only")
    reasons += [r for r in _mha_reasons(layer.self_attn) if not r.startswith("num_heads")]
    if not layer.activation_relu_or_gelu:
        reasons.append("activation is neither ReLU nor GELU")
    if layer.norm1.eps != layer.norm2.eps:
        reasons.append("norm1.eps != norm2.eps")
    if layer.self_attn.num_heads % 2:
        reasons.append("num_heads is odd")
    return reasons


def _explain_encoder(enc: nn.TransformerEncoder, src: Tensor, mask, src_key_padding_mask) -> FastpathReport:
    first = enc.layers[0]
    nested, notes = [], []
    enabled, used = getattr(enc, "enable_nested_tensor", None), getattr(enc, "use_nested_tensor", False)
    init = _init_nested_reasons(first)
    if not used:
        nested += (["use_nested_tensor is False because " + r for r in init] if init
                   else ["use_nested_tensor is False (built with enable_nested_tensor=False)"])
    if enabled is False and used:
        notes.append("enable_nested_tensor=False was set after construction and changes nothing: forward reads "
                     "use_nested_tensor (set it, or build the encoder with enable_nested_tensor=False)")
    nested += [r for r in _global_reasons(first) if r not in nested]
    if src.dim() != 3:
        nested.append(f"input is not batched (dim {src.dim()}, needs 3)")
    if src_key_padding_mask is None:
        nested.append("no src_key_padding_mask: nothing to skip")
    elif getattr(enc, "mask_check", True) and src.dim() == 3 and not src.is_nested and src.shape[:2] == src_key_padding_mask.shape:
        valid = ~src_key_padding_mask.bool() if src_key_padding_mask.dtype == torch.bool else src_key_padding_mask == 0
        if not tp.mask_left_aligned(src, valid):
            nested.append("src_key_padding_mask is not left aligned (padding must come after the real tokens)")
    if src.is_nested:
        nested.append("input is already a nested tensor")
    if mask is not None:
        nested.append("src_mask was given together with src_key_padding_mask")
    a = first.self_attn
    nested += _tensor_reasons((src, a.in_proj_weight))
    takes_nested = not nested
    layer_input_has_mask = (mask is not None) or (src_key_padding_mask is not None and not takes_nested)
    fast = _layer_reasons(first, src, has_mask=False) if isinstance(first, nn.TransformerEncoderLayer) else \
        ["layers are not nn.TransformerEncoderLayer"]
    if layer_input_has_mask and src.is_nested:
        fast.append("nested input together with a mask")
    return FastpathReport("TransformerEncoder", not fast, takes_nested, fast, nested, notes, LAYER_OP)


def explain_fastpath(
    module: nn.Module,
    src: Tensor,
    src_key_padding_mask: Tensor | None = None,
    mask: Tensor | None = None,
    *,
    key: Tensor | None = None,
    value: Tensor | None = None,
    need_weights: bool = True,
) -> FastpathReport:
    """Predict whether PyTorch's fastpath (and the nested sparsity path) runs for this call.

    Call it where the forward would run (inside the same ``torch.no_grad()``/``inference_mode``
    and autocast state), with the same arguments:

    - nn.TransformerEncoder: ``explain_fastpath(enc, src, src_key_padding_mask, mask)``
    - nn.TransformerEncoderLayer: ``explain_fastpath(layer, src, src_key_padding_mask, src_mask)``
    - nn.MultiheadAttention: ``explain_fastpath(mha, query, key_padding_mask, attn_mask, key=, value=, need_weights=)``
      (key and value default to ``query``, i.e. self-attention).

    src: (B, T, d_model) with batch_first modules. src_key_padding_mask: (B, T), True at padding.
    """
    if isinstance(module, nn.TransformerEncoder):
        return _explain_encoder(module, src, mask, src_key_padding_mask)
    if isinstance(module, nn.TransformerEncoderLayer):
        reasons = _layer_reasons(module, src, has_mask=src_key_padding_mask is not None or mask is not None)
        return FastpathReport("TransformerEncoderLayer", not reasons, None, reasons, [], [], LAYER_OP)
    if isinstance(module, nn.MultiheadAttention):
        return _explain_mha(module, src, key, value, src_key_padding_mask, mask, need_weights)
    raise TypeError(
        f"explain_fastpath knows nn.TransformerEncoder, nn.TransformerEncoderLayer and nn.MultiheadAttention; got {type(module).__name__}"
    )
