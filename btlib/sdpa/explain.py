"""Which kernel will F.scaled_dot_product_attention run, and why not the others?

PyTorch 2 replaced BetterTransformer's attention with one function,
``F.scaled_dot_product_attention`` (SDPA), that picks a backend per call:

    CPU:  FLASH_ATTENTION (the flash CPU kernel, tiled online softmax)  ->  MATH
    CUDA: the order ``torch._C._get_sdp_priority_order()`` gives (by default FLASH_ATTENTION,
          EFFICIENT_ATTENTION, MATH, CUDNN_ATTENTION)
    jagged nested tensors: FLASH, EFFICIENT, MATH, CUDNN (torch/nested/_internal/sdpa.py)

and silently falls back when a backend refuses the inputs. :func:`explain_sdpa` asks torch's own
gate functions, live, for every backend, and returns all the reasons each one refuses:

- dense CPU tensors: each backend is forced alone with ``sdpa_kernel`` and
  ``torch._fused_sdp_choice`` (the dispatcher SDPA calls) is asked; its warnings are the reasons.
- dense CUDA tensors: ``torch.backends.cuda.can_use_{flash,efficient,cudnn}_attention(params,
  debug=True)`` under the same forcing (they check dtype, head_dim, masks, dropout and the GPU's
  compute capability).
- jagged nested tensors: the gates of torch/nested/_internal/sdpa.py, which log their reasons.

:meth:`SDPAReport.confirm` checks the prediction against the profiler, and :func:`run_forced`
(forced.py) runs SDPA itself under one forced backend: the independent check of every refusal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import Tensor
from torch.nn.attention import SDPAParams, SDPBackend

from .. import _torch_private as tp
from .forced import BACKENDS, SDPA_OPS, catch_messages, clean_messages, forced_backend

__all__ = ["SDPAReport", "explain_sdpa"]

# backend -> the switch in torch.backends.cuda (global, CPU included): {flag}_sdp_enabled / enable_{flag}_sdp
_SWITCH = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "mem_efficient", "CUDNN_ATTENTION": "cudnn", "MATH": "math"}
_CAN_USE = {"FLASH_ATTENTION": "can_use_flash_attention", "EFFICIENT_ATTENTION": "can_use_efficient_attention",
            "CUDNN_ATTENTION": "can_use_cudnn_attention"}


def _op_table(device: str, layout: str) -> dict[str, str]:
    return SDPA_OPS[("any", "jagged")] if layout == "jagged" else SDPA_OPS.get((device, "dense"), {})


@dataclass
class SDPAReport:
    """Prediction for one SDPA call.

    chosen: the backend SDPA will run (a name from BACKENDS), or None when the call will raise ``error``, or when
    this torch lacks what explain_sdpa asks (``error`` then starts with "cannot predict: " and says what is missing).
    reasons: backend -> why it refuses these inputs; an empty list means it accepts them.
    order: the order SDPA tries backends in on this device and layout.
    """

    device: str
    layout: str
    chosen: str | None
    reasons: dict[str, list[str]]
    order: list[str]
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    def accepted(self, backend: str) -> bool:
        return not self.reasons[backend]

    def op(self, backend: str) -> str | None:
        """The profiler op name of ``backend`` for this device and layout (None: it has none here)."""
        return _op_table(self.device, self.layout).get(backend)

    @property
    def expected_op(self) -> str | None:
        """The profiler op name of the chosen backend (None if SDPA will raise)."""
        return self.op(self.chosen) if self.chosen else None

    def expected_ops(self) -> dict[str, bool]:
        """Backend op name -> whether it should appear in a profile of the call."""
        return {op: backend == self.chosen for backend, op in _op_table(self.device, self.layout).items()}

    def confirm(self, ops: Iterable[str]) -> list[str]:
        """Compare with the operators that ran (see :func:`btlib.ops_that_ran`); returns the mismatches."""
        seen = set(ops)
        return [f"{op} {'expected but not seen' if want else 'seen but not expected'}"
                for op, want in self.expected_ops().items() if (op in seen) != want]

    def __str__(self) -> str:
        head = f"SDPA on {self.device} ({self.layout}): " + (f"runs {self.chosen} ({self.expected_op})" if self.chosen
                                                            else self.error if self.error.startswith(CANNOT_ASK)
                                                            else f"raises: {self.error}")
        lines = [head]
        for b in self.order + [b for b in BACKENDS if b not in self.order]:
            mark = "chosen" if b == self.chosen else ("accepts" if self.accepted(b) else "refuses")
            lines.append(f"  {b:20s} {mark}" + ("" if self.accepted(b) else ": " + self.reasons[b][0]))
            lines += [f"  {'':20s}         {r}" for r in self.reasons[b][1:]]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle) -> None:  # IPython display
        p.text(str(self))


def _disabled(backend: str) -> list[str]:
    flag = _SWITCH[backend]
    if getattr(torch.backends.cuda, f"{flag}_sdp_enabled")():
        return []
    return [f"disabled in the current context (torch.nn.attention.sdpa_kernel or torch.backends.cuda.enable_{flag}_sdp)"]


def _dense_cpu(args: tuple, kwargs: dict) -> dict[str, list[str]]:
    reasons = {}
    for b in BACKENDS:
        with catch_messages() as msgs, forced_backend(b):
            try:
                choice, error = tp.fused_sdp_choice(*args, **kwargs), None
            except (RuntimeError, NotImplementedError) as e:
                choice, error = None, str(e)
        why = clean_messages(msgs)
        if choice == SDPBackend.__members__[b].value:
            reasons[b] = []
        elif why:
            reasons[b] = why
        else:  # nothing to report but a refusal: the backend has no kernel on this device
            said = (error or f"choice {choice}").split(". ")[0]
            reasons[b] = [f"no CPU kernel in this torch: forced alone, SDPA says '{said}'"]
    return reasons


def _can_use(backend: str, params: SDPAParams, device: str) -> list[str]:
    """torch.backends.cuda.can_use_*(params, debug=True) with only ``backend`` enabled: its reasons."""
    name = _CAN_USE[backend]
    with catch_messages() as msgs, forced_backend(backend):
        ok = getattr(torch.backends.cuda, name)(params, True)
    if ok:
        return []
    why = clean_messages(msgs)
    build = " (always, on a torch build without CUDA)" if torch.version.cuda is None else ""
    return why or [f"torch.backends.cuda.{name}(params) is False for these {device} inputs and gives no reason{build}"]


def _jagged(q: Tensor, k: Tensor, v: Tensor, mask, dropout_p: float, is_causal: bool, gqa: bool) -> dict[str, list[str]]:
    nsdpa = tp.nested_sdpa()  # what F.scaled_dot_product_attention calls for jagged inputs (explain_sdpa checked it)

    params = SDPAParams(q, k, v, mask, dropout_p, is_causal, gqa)
    jagged_gate = {"FLASH_ATTENTION": nsdpa._can_use_flash_sdpa_jagged,
                   "EFFICIENT_ATTENTION": nsdpa._can_use_efficient_sdpa_jagged}
    reasons = {}
    for b in BACKENDS:
        if b == "MATH":
            with catch_messages() as msgs:
                ok = nsdpa._can_use_math_sdpa_jagged(params, True)
            reasons[b] = [] if ok else clean_messages(msgs) or ["refused by _can_use_math_sdpa_jagged"]
            continue
        why = _can_use(b, params, q.device.type)
        if b in jagged_gate:
            with catch_messages() as msgs, forced_backend(b):
                ok = jagged_gate[b](params, True)
            why += [] if ok else clean_messages(msgs) or [f"refused by {jagged_gate[b].__name__}"]
        reasons[b] = why
    return reasons


CANNOT_ASK = "cannot predict: "  # an SDPAReport.error that starts so: this torch lacks what explain_sdpa asks


def _cannot_ask(device: str, layout: str, order: list[str], what: str, notes: list[str]) -> SDPAReport:
    """The report where this torch lacks the private function explain_sdpa asks: no prediction, and why."""
    why = CANNOT_ASK + what  # what: "this torch has no <the private name>, <what it is>"
    hint = "btlib.run_forced(backend, q, k, v) runs SDPA under each backend instead"
    return SDPAReport(device, layout, None, {b: [why] for b in BACKENDS}, order, why, notes + [hint])


def explain_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> SDPAReport:
    """Predict which backend ``F.scaled_dot_product_attention`` runs for these arguments, and why not the others.

    Takes SDPA's own arguments. Call it where SDPA would run (same ``sdpa_kernel`` context,
    grad mode and dtypes). Nothing is computed: only torch's backend checks run.

    Args:
        q: (B, H, T, D) (or (..., T, D)); a jagged nested tensor (B, H, j, D) is explained too.
        k, v: (B, H_kv, S, D) / (B, H_kv, S, D_v); H_kv < H only with enable_gqa.
        attn_mask: bool (True = may attend) or float (added), broadcastable to (B, H, T, S).

    Example:
        >>> q = torch.randn(2, 4, 16, 32)
        >>> explain_sdpa(q, q, q, dropout_p=0.1).chosen          # the CPU flash kernel has no dropout
        'MATH'
    """
    device = q.device.type
    notes: list[str] = []
    if q.is_nested and q.layout == torch.jagged:
        if q.dim() > 3 and q._ragged_idx == 1:
            notes.append("the ragged dimension is dim 1 (B, j, H, D): SDPA attends over values() of shape (total, H, D), "
                         "i.e. across heads; transpose(1, 2) to (B, H, j, D) for attention over tokens")
            r = explain_sdpa(q.values(), k.values(), v.values(), attn_mask, dropout_p, is_causal, scale, enable_gqa)
            r.notes = notes + r.notes
            return r
        layout, order = "jagged", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", "CUDNN_ATTENTION"]
        nsdpa = tp.nested_sdpa()
        if nsdpa is None:
            return _cannot_ask(device, layout, order, f"{tp.missing('nested_sdpa')}, whose gates pick the jagged "
                                                      "backend", notes)
        try:
            nsdpa._validate_sdpa_input(q, k, v, attn_mask, dropout_p, is_causal, scale)
        except ValueError as e:
            return SDPAReport(device, layout, None, {b: [f"input refused before any backend is asked: {e}"] for b in BACKENDS},
                              order, str(e), notes)
        reasons = _jagged(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
        with catch_messages():
            choice = nsdpa._select_sdp_backend(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
        chosen_val = choice.value
    else:
        layout = "strided nested" if q.is_nested else "dense"  # strided nested tensors go through aten's dense dispatcher
        names = {m.value: n for n, m in SDPBackend.__members__.items()}
        order = (["FLASH_ATTENTION", "MATH"] if device == "cpu"  # select_sdp_backend_cpp: fixed, no priority setting
                 else [names[i] for i in tp.sdp_priority_order() if names.get(i) in BACKENDS])
        if (why := tp.missing("fused_sdp_choice")) is not None:
            return _cannot_ask(device, layout, order, f"{why}, the dispatcher SDPA calls", notes)
        if device == "cpu":
            reasons = _dense_cpu((q, k, v), dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                                 scale=scale, enable_gqa=enable_gqa))
        else:
            params = SDPAParams(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
            reasons = {b: [] if b == "MATH" else _can_use(b, params, device) for b in BACKENDS}
        try:
            with catch_messages():
                chosen_val = tp.fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        except (RuntimeError, NotImplementedError) as e:
            chosen_val, notes = SDPBackend.ERROR.value, notes + [f"SDPA raises: {clean_messages([str(e)]) or [type(e).__name__]}"]
    for b in BACKENDS:
        reasons[b] = _disabled(b) + reasons[b]
    chosen = next((n for n, m in SDPBackend.__members__.items() if m.value == chosen_val and n in BACKENDS), None)
    error = None if chosen else "No viable backend for scaled_dot_product_attention was found."
    if chosen and not reasons[chosen] == []:
        notes.append(f"torch chose {chosen} although its checks refuse it: report this explainer's gap")
    return SDPAReport(device, layout, chosen, reasons, order, error, notes)
