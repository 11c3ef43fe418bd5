"""The build state machine both compiled kernels share (cpu/build.py, cuda/build.py).

    ext = Extension("C++ attention kernels", "C++ kernels", fallback, toolchain)
    ext.available() -> None | str   cheap: the remembered failure, else None once built, else toolchain()
    ext.load(key, name, ops, announce, **cpp_extension_kwargs) -> str   build once per key, return build_info()

A build is one ``torch.utils.cpp_extension.load`` of a library that registers ``torch.ops.<ops>``
with a ``build_info()`` op. It runs at most once per key and process (later calls return the info
line), and a failed build is remembered (``remember_failure``), so :meth:`Extension.available`
says why from then on and ``backend="auto"`` moves on to the next kernel instead of recompiling
on every call. cpp_extension is imported on the first build, never at ``import btlib``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch

__all__ = ["Extension", "build_directory"]


def build_directory(name: str) -> Path:
    """Where library ``name`` is cached: $TORCH_EXTENSIONS_DIR/<name>, else torch's default."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


class Extension:
    """available() / load() once / remember the failure / say why, for one family of builds.

    what: the noun of the messages ("CUDA attention kernel"); short: the failure's ("CUDA kernel");
    fallback: what btlib.attention does after a failed build, the last line of the error;
    toolchain: None if a build can be attempted here, else why not (cheap: never compiles).
    """

    def __init__(self, what: str, short: str, fallback: str, toolchain: Callable[[], str | None]) -> None:
        self.what, self.short, self.fallback, self.toolchain = what, short, fallback, toolchain
        self.error: str | None = None  # why the last remembered build failed
        self.info: dict[str, str] = {}  # key -> build_info() of each loaded build

    def available(self) -> str | None:
        if self.error:
            return self.error
        if self.info:
            return None
        return self.toolchain()

    def load(self, key: str, name: str, ops: str, announce: Callable[[], str | None], *, remember_failure: bool = True,
             **kwargs) -> str:
        """Build or load library ``name`` (once per key); returns ``torch.ops.<ops>.build_info()``.

        announce: the line printed to stderr before cpp_extension runs (None: nothing to say, e.g. a warm
            cache); called only when a build is attempted, so a loaded build costs one dict lookup per call.
        Raises RuntimeError: why not (unavailable), or the compiler's message (build failed).
        """
        if key in self.info:
            return self.info[key]
        why = self.available()
        if why:
            raise RuntimeError(f"btlib {self.what} unavailable: {why}")
        from torch.utils import cpp_extension

        line = announce()
        if line:
            print(line, file=sys.stderr, flush=True)
        try:
            cpp_extension.load(name=name, is_python_module=False, verbose=False, **kwargs)
        except Exception as e:  # noqa: BLE001 - any build failure becomes one clear error
            if remember_failure:
                self.error = f"building the {self.short} failed ({type(e).__name__}); see the first error for the compiler output"
            raise RuntimeError(f"btlib: building the {self.what} failed: {e}\n{self.fallback}") from e
        self.info[key] = getattr(torch.ops, ops).build_info()
        return self.info[key]
