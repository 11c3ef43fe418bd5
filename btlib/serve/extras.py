"""Optional packages: import one, or say which extra of btlib installs it."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require", "missing"]


def missing(module: str, extra: str) -> str | None:
    """None if ``module`` imports, else the sentence telling what to install (for skips and errors)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return f"{module} is not installed: pip install -e '.[{extra}]' (or pip install 'btlib[{extra}]')"
    return None


def require(module: str, extra: str) -> ModuleType:
    """``import module``, or ImportError naming the btlib extra that installs it (``serve``: fastapi, uvicorn; ``scale``: ray, pyarrow)."""
    why = missing(module, extra)
    if why:
        raise ImportError(why)
    return importlib.import_module(module)
