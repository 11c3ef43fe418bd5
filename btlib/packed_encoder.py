"""A padding-free Transformer encoder: an nn.TransformerEncoder's weights run on packed tokens.

    padded (B, T, d) + lengths --pack once--> (total, d) --N layers--> (total, d) --unpack once--> (B, T, d)

Every layer works on the ``total = sum(lengths)`` real tokens only:

    qkv = x W_qkv^T + b            (total, 3d)      6 d^2 FLOPs per token
    o   = varlen_attention(q, k, v, cu_seqlens)     4 L_i^2 d per sequence, no padding
    x   = LayerNorm(x + o W_o^T)                    2 d^2
    x   = LayerNorm(x + W_2 act(W_1 x + b_1))       4 d d_ff

so linear layers cost sum(L) instead of B*T, and attention sum(L_i^2) instead of B*T^2.
PyTorch's nested path gets the first saving but not the second: its fastpath attention
(torch._transformer_encoder_layer_fwd) converts the nested q, k, v back to padded tensors.
Post-LN and pre-LN (norm_first) layers, ReLU, GELU or any callable activation,
with or without a final norm, and optionally one position bias (btlib.PositionBias) that every layer's
attention adds to its scaled scores (MPNet's relative-position table, shared by all layers), computed by
the varlen kernel from the positions within each sequence, never as a (T, T) tensor.

This module is for inference and runs the module exactly as its PyTorch forward would (with the
fastpath off), or refuses by name: dropout is not applied, so a layer in training mode with
dropout > 0 raises in forward; there is no backward through the C++ attention kernels.
batch_first=False layers take and return (T, B, d) as PyTorch does.

Checks and kernel choice happen once per call, at the entry point (``forward`` checks lengths,
``forward_packed`` checks cu_seqlens), and the attention kernel is selected once for all layers:
below that the layers call the kernel with trusted arguments. On CUDA every scalar read of a check
is a host sync, so per-layer checks would cost 12 syncs (and 12 registry look-ups) per forward.

torch.compile: ``forward_packed`` traces whole (fullgraph=True), fp32 and bf16, with the C++ varlen kernel in
the graph as ``torch.ops.btlib_cpu_<isa>.varlen_v3`` (its source: btlib/kernels/cpu/flash/; its schema and
fake kernel: btlib/kernels/cpu/schema.py) and the GEMMs as aten ops that inductor fuses (btlib.gemm). While
dynamo traces, the kernel choice and the build's load run once, outside the graph, and the graph checks
cu_seqlens' layout only: its values (start 0, non-decreasing, ending at total, none above max_seqlen) are
checked by the C++ kernel when the graph runs (the other varlen kernels read cu_seqlens in Python and do not
trace). ``forward`` (padded input) does not trace in one graph: packing reads the lengths, so the shapes
depend on data. The int8 twin (btlib.quant) does not trace either. tests/test_compile.py checks what traces
against eager.

Precision: the module's own dtype by default; ``precision="auto"`` takes bf16 only where this
CPU runs it natively and measured faster (btlib.precision.choose_precision); an explicit bf16
(``precision="bf16"`` or ``dtype=torch.bfloat16``) runs, and warns once where bf16 is slow.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._compile import constant_result
from . import gemm
from .kernels import registry
from .kernels.registry import Kernel
from .position_bias import PositionBias, check_position_bias
from .padding import _pack, _unpack, check_cu_seqlens, check_cu_seqlens_layout, check_lengths, padding_mask_to_lengths
from .precision import choose_precision, warn_if_slow_bf16

__all__ = ["PackedEncoder"]


def _fused_kind(layer: nn.TransformerEncoderLayer) -> str | None:
    """'relu' or 'gelu' when the activation is exactly ReLU or exact (erf) GELU, which the GEMM epilogue fuses.

    Not layer.activation_relu_or_gelu: PyTorch sets it to 2 for any nn.GELU (also approximate="tanh")
    and for subclasses of nn.ReLU / nn.GELU, which then must run as given. Anything else runs as given.
    """
    act = layer.activation
    if act is F.relu or type(act) is nn.ReLU:
        return "relu"
    if act is F.gelu or (type(act) is nn.GELU and act.approximate == "none"):
        return "gelu"
    return None


def _check_layer(i: int, layer: nn.Module) -> None:
    """Raise, naming the option, for a layer whose PyTorch forward PackedEncoder would not reproduce exactly."""
    where = f"layer {i}"
    if not isinstance(layer, nn.TransformerEncoderLayer):
        raise TypeError(f"{where}: PackedEncoder runs nn.TransformerEncoderLayer; got {type(layer).__name__}")
    for name in ("forward", "_sa_block", "_ff_block"):
        if getattr(type(layer), name) is not getattr(nn.TransformerEncoderLayer, name):
            raise ValueError(f"{where}: {type(layer).__name__} overrides {name}, which PackedEncoder would not run; "
                             "use the module itself")
    a = layer.self_attn
    if type(a) is not nn.MultiheadAttention:
        raise ValueError(f"{where}: self_attn is {type(a).__name__}, not nn.MultiheadAttention; use the module itself")
    if not a._qkv_same_embed_dim or a.bias_k is not None or a.add_zero_attn:
        raise ValueError(f"{where}: PackedEncoder needs plain self-attention (no kdim/vdim, add_bias_kv, add_zero_attn)")


def _dropouts(layers: nn.ModuleList) -> list[tuple[str, nn.Module]]:
    """(name, module) of every dropout the layers' forward could apply: each self-attention (its float p) and
    every nn.Dropout inside a layer (its dropout1/2 and any inside a custom activation). Found once per encoder."""
    found = []
    for i, layer in enumerate(layers):
        found.append((f"layers.{i}.self_attn.dropout", layer.self_attn))
        found += [(f"layers.{i}.{name}", m) for name, m in layer.named_modules() if isinstance(m, nn.Dropout)]
    return found


def _dropout_in_training(dropouts: list[tuple[str, nn.Module]]) -> str | None:
    """Which dropout would be applied (module name and p), or None: in eval mode, or every p is 0.
    A flag test per module (~5 us for 6 layers), not a walk over every submodule (~150 us) per forward."""
    for name, m in dropouts:
        p = m.dropout if isinstance(m, nn.MultiheadAttention) else m.p
        if m.training and p > 0:
            return f"{name}={p}" if isinstance(m, nn.MultiheadAttention) else f"{name} (p={p})"
    return None


# Under torch.compile this runs once while dynamo traces (the registry's checks read the toolchain, a lock and
# os.environ, which dynamo cannot trace) and its answer is a constant of the graph. A name, not the Kernel: dynamo
# follows attributes of an object it reached through registry.get, not of one a constant function returned.
@constant_result  # torch.compiler.assume_constant_result, without importing dynamo here
def _select_varlen(dtype: torch.dtype, device: torch.device, H: int, head_dim: int, needs_grad: bool, backend: str,
                   window: tuple[int, int] | None = None, bias_kind: str | None = None, causal: bool = False) -> str:
    """The name of the varlen kernel for (total, H, head_dim) q, k, v of this dtype and device (registry.select);
    window: a local window some layer uses (the kernel must take one), or None; bias_kind: "alibi" or "table"
    where the layers add a PositionBias of that kind (the kernel must take one), or None; causal: the layers mask
    keys after the query (a decoder: Qwen3), so the kernel must have a causal mask. Shared with ModernBERT,
    NomicBERT / GTE and Qwen3."""
    bias = None
    if bias_kind is not None:  # a stand-in of the kind: the registry asks whether a kernel takes one, not its values
        bias = PositionBias.alibi(torch.zeros(H)) if bias_kind == "alibi" else PositionBias.table(torch.zeros(H, 1), 0)
    return registry.select("varlen", torch.empty(0, H, head_dim, dtype=dtype, device=device), causal, backend,
                           needs_grad=needs_grad, window=window, bias=bias).name


class PackedEncoder(nn.Module):
    """Runs the layers of an nn.TransformerEncoder on packed tokens. Shares its parameters.

    Example:
        >>> enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, batch_first=True), 2).eval()
        >>> packed = PackedEncoder.from_module(enc)
        >>> out = packed(x, lengths=torch.tensor([5, 2]))   # x (2, 5, 64) -> (2, 5, 64), zeros at padding
    """

    def __init__(self, layers: nn.ModuleList, norm: nn.Module | None, attention_backend: str = "auto",
                 batch_first: bool = True, bias: PositionBias | None = None):
        super().__init__()
        self.layers = layers
        self.norm = norm
        self.attention_backend = attention_backend
        self.batch_first = batch_first
        # every layer's attention adds it (checked: one value per head, on the weights' device); None: no bias
        self.bias = check_position_bias(bias, layers[0].self_attn.num_heads, layers[0].linear1.weight.device)
        self.precision = None  # the PrecisionChoice from from_module(precision=...), printable; None: as given
        self._dropouts = _dropouts(layers)
        self._kernels: dict[tuple, Kernel] = {}  # (dtype, device, needs_grad) -> the varlen kernel, selected once

    @classmethod
    def from_module(cls, encoder: nn.TransformerEncoder | nn.TransformerEncoderLayer, *, attention_backend: str = "auto",
                    dtype: torch.dtype | None = None, precision: str | None = None,
                    bias: PositionBias | None = None) -> "PackedEncoder":
        """Wrap an existing encoder (or a single layer) without copying its weights.

        bias: a btlib.PositionBias (H heads, float32 values on the weights' device) that every layer's attention
        adds to its scaled scores, bias(h, j - i) within each sequence (MPNet's relative-position table); None: none.
        The encoder then runs only on kernels that take a bias; the module's own forward has no place for it.

        precision: None (default) runs in the module's own dtype; "auto" picks bf16 only where this
        CPU runs bf16 natively and its matmuls measured > 1.3x fp32's rate, else fp32
        (btlib.precision.choose_precision; the choice and why are in ``.precision``); "fp32" / "bf16" choose.
        dtype: an explicit dtype instead (e.g. torch.bfloat16); give dtype or precision, not both.
        A dtype other than the module's *copies* and converts the weights (the original is untouched);
        inputs are cast to it and outputs cast back. An explicit bf16 where bf16 is not native (or
        measured slower than fp32) runs, and warns once (btlib.precision.SlowPrecisionWarning) with the rates.

        Raises ValueError/TypeError, naming the option, for what it would not run exactly as PyTorch's
        forward does: separate k/v dimensions, add_bias_kv, add_zero_attn, layers or attention modules
        whose forward is overridden, layers that disagree on batch_first.
        """
        if isinstance(encoder, nn.TransformerEncoderLayer):
            layers, norm = nn.ModuleList([encoder]), None
        elif isinstance(encoder, nn.TransformerEncoder):
            if type(encoder).forward is not nn.TransformerEncoder.forward:
                raise ValueError(f"{type(encoder).__name__} overrides forward, which PackedEncoder would not run; use the module itself")
            layers, norm = encoder.layers, encoder.norm
        else:
            raise TypeError(f"PackedEncoder.from_module takes nn.TransformerEncoder(Layer); got {type(encoder).__name__}")
        for i, layer in enumerate(layers):
            _check_layer(i, layer)
        batch_first = {layer.self_attn.batch_first for layer in layers}
        if len(batch_first) != 1:
            raise ValueError("the layers disagree on batch_first; PackedEncoder takes one layout")
        choice = None
        if precision is not None:
            if dtype is not None:
                raise ValueError("give dtype or precision, not both")
            choice = choose_precision(precision)
            dtype = choice.dtype
        if dtype == torch.bfloat16 and (choice is None or precision == "bf16"):
            warn_if_slow_bf16("PackedEncoder in bf16")
        if dtype is not None and dtype != layers[0].linear1.weight.dtype:
            layers, norm = copy.deepcopy(layers).to(dtype), (copy.deepcopy(norm).to(dtype) if norm is not None else None)
        packed = cls(layers, norm, attention_backend, batch_first.pop(), bias)
        packed.precision = choice
        packed.training = any(m.training for m in layers)  # not train(): that would also flip the shared layers
        return packed

    def forward(self, src: Tensor, lengths: Tensor | None = None, src_key_padding_mask: Tensor | None = None) -> Tensor:
        """src: (B, T, d), or (T, B, d) when the wrapped layers have batch_first=False, real tokens first.
        Give ``lengths`` (B,) or a left-aligned ``src_key_padding_mask`` (B, T, True at padding; (B, T) in
        either layout, as in PyTorch). Returns src's layout and dtype, zeros at padding (as PyTorch's
        nested path returns)."""
        if src.dim() != 3:
            raise ValueError(f"src must be (B, T, d_model) or, batch_first=False, (T, B, d_model); got {tuple(src.shape)}")
        if not self.batch_first:
            src = src.transpose(0, 1)  # (T, B, d) -> (B, T, d), a view
        B, T = src.shape[:2]
        if lengths is None:  # lengths from a mask or from T are valid by construction
            lengths = padding_mask_to_lengths(src_key_padding_mask) if src_key_padding_mask is not None else \
                torch.full((B,), T, dtype=torch.int64)
        else:
            check_lengths(lengths, T=T, B=B)  # the one check of this call
        lengths = lengths.to(src.device)
        tokens, cu_seqlens, max_seqlen = _pack(src, lengths)  # pack once: (total, d)
        out = self._layers(tokens.to(self.layers[0].linear1.weight.dtype), cu_seqlens, max_seqlen)
        out = _unpack(out.to(src.dtype), lengths, T)  # unpack once, zeros at padding: (B, T, d)
        return out if self.batch_first else out.transpose(0, 1)

    def forward_packed(self, x: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        """x: (total, d) packed tokens; cu_seqlens: (B + 1,) int32 on x's device; max_seqlen: int -> (total, d).

        Raises RuntimeError if a layer is in training mode with dropout > 0 (dropout is not applied here).
        """
        if cu_seqlens.device != x.device:
            raise ValueError(f"cu_seqlens must be on x's device ({x.device}); got {cu_seqlens.device}")
        if self.bias is not None and self.bias.device != x.device:
            raise ValueError(f"the position bias is on {self.bias.device}, x on {x.device}: move the module and build "
                             "its PackedEncoder on x's device")
        if torch.compiler.is_compiling():
            # the value checks read cu_seqlens (data-dependent: no graph); the C++ varlen kernel repeats them
            # when the graph runs, and raises with the same facts
            check_cu_seqlens_layout(cu_seqlens)
        else:
            check_cu_seqlens(cu_seqlens, total=x.shape[0], max_seqlen=max_seqlen)
        return self._layers(x, cu_seqlens, int(max_seqlen))

    def _layers(self, x: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        """Every layer on checked packed tokens, with one attention kernel chosen for all of them."""
        if (active := _dropout_in_training(self._dropouts)) is not None:
            raise RuntimeError(f"PackedEncoder applies no dropout, but {active} is in training mode: call .eval() "
                               "for inference, or train with the PyTorch module itself")
        kernel = self._kernel(x)
        if torch.compiler.is_compiling():  # no contextvars in a graph: gemm.linear takes its traceable branch
            x = self._each_layer(x, cu_seqlens, max_seqlen, kernel)
        else:
            with gemm.planned(x.dtype, x.shape[0]):  # every linear here has M = total tokens: one GEMM path for all
                x = self._each_layer(x, cu_seqlens, max_seqlen, kernel)
        return self.norm(x) if self.norm is not None else x

    def _each_layer(self, x: Tensor, cu_seqlens: Tensor, max_seqlen: int, kernel: Kernel) -> Tensor:
        for layer in self.layers:
            # the residual add rides in the output projection's and linear2's GEMM epilogue (btlib.gemm)
            if layer.norm_first:
                x = self._attention(layer, layer.norm1(x), cu_seqlens, max_seqlen, kernel, residual=x, bias=self.bias)
                x = self._feed_forward(layer, layer.norm2(x), residual=x)
            else:
                x = layer.norm1(self._attention(layer, x, cu_seqlens, max_seqlen, kernel, residual=x, bias=self.bias))
                x = layer.norm2(self._feed_forward(layer, x, residual=x))
        return x

    def _kernel(self, x: Tensor) -> Kernel:
        """The varlen kernel for every layer's (total, H, Dh) q, k, v in x's dtype and device: selected once."""
        a = self.layers[0].self_attn
        head_dim = max(layer.self_attn.head_dim for layer in self.layers)  # the largest head decides max_head_dim
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters()))
        key = (x.dtype, x.device, needs_grad, self.attention_backend)
        if key not in self._kernels:  # ~80 us a selection: once per dtype, not per forward (one query's budget is ~2 ms)
            self._kernels[key] = registry.get(_select_varlen(x.dtype, x.device, a.num_heads, head_dim, needs_grad,
                                                             self.attention_backend,
                                                             bias_kind=None if self.bias is None else self.bias.kind))
        return self._kernels[key]

    @staticmethod
    def _attention(layer: nn.TransformerEncoderLayer, x: Tensor, cu_seqlens: Tensor, max_seqlen: int, kernel: Kernel,
                   residual: Tensor | None = None, bias: PositionBias | None = None) -> Tensor:
        """out_proj(attention(x)) + residual (None: no residual); bias added to the scaled scores (None: none)."""
        a = layer.self_attn
        total, d = x.shape
        H = a.num_heads
        qkv = gemm.linear(x, a.in_proj_weight, a.in_proj_bias).view(total, 3, H, d // H)  # (total, 3, H, Dh)
        # Strided views, not copies: every varlen kernel takes any strides with head_dim contiguous,
        # which saves writing 3 * total * d floats per layer into freshly faulted-in pages.
        q, k, v = qkv.unbind(1)  # (total, H, Dh) each
        o = kernel.fn(q, k, v, cu_seqlens, max_seqlen, causal=False, scale=None, **registry.bias_kwargs(kernel, bias))
        return gemm.module_linear(a.out_proj, o.view(total, d), residual)  # o: (total, H, Dh)

    @staticmethod
    def _feed_forward(layer: nn.TransformerEncoderLayer, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """linear2(act(linear1(x))) + residual (None: no residual)."""
        kind = _fused_kind(layer)
        # bias + activation fused into the GEMM's epilogue where the path has one (btlib.gemm): one pass over
        # the (total, d_ff) activations, not three; any other activation runs as given
        if kind is not None:
            h = gemm.linear(x, layer.linear1.weight, layer.linear1.bias, activation=kind)
        else:
            h = layer.activation(gemm.linear(x, layer.linear1.weight, layer.linear1.bias))
        return gemm.module_linear(layer.linear2, h, residual)

