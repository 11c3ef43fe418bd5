"""Run F.scaled_dot_product_attention with one backend forced, and hear what torch says when it refuses.

    forced_backend("FLASH_ATTENTION")        a context in which SDPA may use only that backend
    run_forced(backend, q, k, v, **kw)       -> ForcedRun: the backend ops that ran, or torch's refusal
    sdpa_ops(profiler op names)              -> the SDPA backend ops among them (SDPA_OPS: which op is which)
    catch_messages() / clean_messages(...)   torch's warnings and the nested-SDPA logger, collected quietly

run_forced is the independent check of :func:`btlib.explain_sdpa`'s predictions: it runs SDPA
itself, so a backend the explainer calls refused must refuse here too.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import _torch_private as tp
from ..observe import ops_that_ran

__all__ = ["ForcedRun", "run_forced", "forced_backend", "sdpa_ops", "catch_messages", "clean_messages", "SDPA_OPS", "BACKENDS"]

BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")

# (device, layout) -> backend -> the aten op the profiler shows when that backend runs.
SDPA_OPS: dict[tuple[str, str], dict[str, str]] = {
    ("cpu", "dense"): {"FLASH_ATTENTION": "aten::_scaled_dot_product_flash_attention_for_cpu",
                       "MATH": "aten::_scaled_dot_product_attention_math"},
    ("cuda", "dense"): {"FLASH_ATTENTION": "aten::_scaled_dot_product_flash_attention",
                        "EFFICIENT_ATTENTION": "aten::_scaled_dot_product_efficient_attention",
                        "CUDNN_ATTENTION": "aten::_scaled_dot_product_cudnn_attention",
                        "MATH": "aten::_scaled_dot_product_attention_math"},
    ("any", "jagged"): {"FLASH_ATTENTION": "aten::_flash_attention_forward",
                        "EFFICIENT_ATTENTION": "aten::_efficient_attention_forward",
                        "CUDNN_ATTENTION": "aten::_cudnn_attention_forward",
                        "MATH": "aten::_scaled_dot_product_attention_math"},
}
_ALL_OPS = {op for table in SDPA_OPS.values() for op in table.values()}

_TRIGGERED = re.compile(r"\s*\(Triggered internally at [^)]*\)\s*$")
_HEADER = re.compile(r"kernel not used because:$", re.IGNORECASE)


def clean_messages(messages: Iterable[str]) -> list[str]:
    """Drop torch's section headers and source locations; keep each reason once, in order."""
    out = [_TRIGGERED.sub("", str(m)).strip() for m in messages]
    return list(dict.fromkeys(m for m in out if m and not _HEADER.search(m)))


class _LogCatcher(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def catch_messages(logger: str = tp.NESTED_SDPA_LOGGER) -> Iterator[list[str]]:
    """Collect torch's warnings (TORCH_WARN) and the nested SDPA logger's records, without printing them."""
    log, catcher = logging.getLogger(logger), _LogCatcher()
    propagate = log.propagate
    log.addHandler(catcher)
    log.propagate = False
    messages: list[str] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield messages
    finally:
        log.removeHandler(catcher)
        log.propagate = propagate
        messages += [str(w.message) for w in caught] + catcher.messages


def forced_backend(backend: str) -> contextlib.AbstractContextManager:
    """A context in which SDPA may use only ``backend`` (an SDPBackend name, e.g. "FLASH_ATTENTION")."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown SDPA backend {backend!r}: use one of {', '.join(BACKENDS)}")
    return sdpa_kernel([SDPBackend.__members__[backend]])


def sdpa_ops(ops: Iterable[str], q: Tensor | None = None) -> list[str]:
    """The SDPA backend ops among profiler op names, sorted; given the query ``q``, only those of its device and layout.

    On a GPU a dense call records both the dense op (aten::_scaled_dot_product_efficient_attention) and the kernel
    it calls (aten::_efficient_attention_forward, the jagged layout's op): with ``q`` the inner one is left out."""
    if q is None:
        return sorted(set(ops) & _ALL_OPS)
    table = SDPA_OPS[("any", "jagged")] if q.is_nested else SDPA_OPS.get((q.device.type, "dense"), {})
    return sorted(set(ops) & set(table.values()))


@dataclass
class ForcedRun:
    """SDPA run with one backend forced: the backend ops that ran, or the refusal torch printed and raised."""

    backend: str
    ran: bool
    ops: list[str]
    messages: list[str]

    def __str__(self) -> str:
        return f"{self.backend:20s} " + (f"ran {', '.join(self.ops)}" if self.ran else "refused: " + " | ".join(self.messages))


def run_forced(backend: str, q: Tensor, k: Tensor, v: Tensor, **kwargs) -> ForcedRun:
    """Run ``F.scaled_dot_product_attention(q, k, v, **kwargs)`` with only ``backend`` enabled."""
    with catch_messages() as msgs:
        with forced_backend(backend):
            try:
                ops, error = ops_that_ran(lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)), None
            except (RuntimeError, ValueError) as e:
                ops, error = set(), str(e)
    messages = clean_messages(msgs) + ([clean_messages([error])[0]] if error else [])
    return ForcedRun(backend, error is None, sdpa_ops(ops, q), messages)
