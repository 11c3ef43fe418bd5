"""What btlib tells torch.compile, without importing the compiler at btlib's import.

``torch.compiler.assume_constant_result`` imports torch._dynamo, and torch._dynamo imports triton where it is
installed: at btlib's import that came before notebook 05 could set ``TRITON_INTERPRET=1`` (its Triton cells then
failed: "Cannot call @triton.jit'd outside of the scope of a kernel") and made ``import btlib`` heavy.
:func:`constant_result` sets the same mark that decorator sets (torch 2.13: ``fn._dynamo_marked_constant = True``,
which dynamo reads when it traces); tests/test_compile.py checks that the mark is still torch's own.
"""

from __future__ import annotations

from typing import Callable, TypeVar

__all__ = ["constant_result", "MARK"]

MARK = "_dynamo_marked_constant"
F = TypeVar("F", bound=Callable)


def constant_result(fn: F) -> F:
    """``torch.compiler.assume_constant_result(fn)``, lazily: dynamo runs ``fn`` once while tracing and keeps its
    result as a constant of the graph (for a kernel choice or a library load, which have no place in a graph)."""
    setattr(fn, MARK, True)
    return fn
