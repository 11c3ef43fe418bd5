"""The one build path of every compiled piece of btlib: attention kernels, int8 helpers, CUDA kernel, emulator.

    ext = Extension("C++ attention kernels", fallback, toolchain, about_s=30)
    ext.available(name) -> None | str    cheap: name's remembered failure, else None once built, else toolchain()
    ext.load(name, ops, detail, depends, **cpp_extension_kwargs) -> str   a TORCH_LIBRARY library: its build_info()
    ext.module(name, detail, depends, **cpp_extension_kwargs)             a pybind11 module (int8.cpp)
    ext.build(name, make, detail, depends) -> what make() returns         any other build (the emulator's g++)

Every build goes through :meth:`Extension.build`, which gives them the same rules:

- cache: ``$TORCH_EXTENSIONS_DIR/<name>/`` (torch's default ~/.cache/torch_extensions without it);
- once per library name and process: later calls return the first result (one dict lookup), and threads
  asking at once build it once. One lock serves every Extension, not one each: torch does not document
  cpp_extension.load as thread-safe, and a compile already keeps every core busy, so taking turns costs
  little. Across processes cpp_extension's file baton takes turns;
- one line on stderr before a compile, ``btlib: compiling the <what> (<detail>) into <dir> - once, about
  N s ...``, printed only when the library is missing or older than a source it depends on;
- a failed build is remembered with its reason (the compiler's first error lines), so the next call
  raises that reason at once instead of compiling again, and :meth:`Extension.available` says it, so
  ``backend="auto"`` or Int8Linear move on to their fallback. ``remember_failure=False`` (experiments
  on an edited copy) lets the user fix the source and call again.

cpp_extension is imported on the first build, never at ``import btlib``.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Callable, Iterable, TypeVar

import torch

from .. import _torch_private as tp

__all__ = ["Extension", "build_directory", "needs_build", "first_errors"]

T = TypeVar("T")

# Re-entrant: a make() that itself asks for another library waits on no one.
_LOCK = threading.RLock()


def build_directory(name: str) -> Path:
    """Where library ``name`` is cached: $TORCH_EXTENSIONS_DIR/<name>, else torch's default."""
    return Path(tp.build_directory(name))


def needs_build(name: str, depends: Iterable[Path]) -> bool:
    """True if <cache>/<name>/<name>.so is missing or older than one of ``depends`` (the announcement's test)."""
    lib = build_directory(name) / f"{name}.so"
    return not lib.exists() or lib.stat().st_mtime < max((Path(f).stat().st_mtime for f in depends), default=0.0)


def first_errors(message: str, lines: int = 3) -> str:
    """The compiler's first ``lines`` error lines (``error:``) of a failed build's message, else its first lines.

    cpp_extension's message is ``Error building extension '<name>': `` + ninja's log: the command
    lines (``[1/2] c++ ... ``, hundreds of characters), ``FAILED: x.o`` and the compiler's output.
    """
    text = [line.strip() for line in message.splitlines() if line.strip()]
    noise = ("Error building extension", "[", "FAILED:", "ninja:")
    errors = [line for line in text if "error:" in line.lower() and not line.startswith(noise)]
    return "\n".join(line[:300] for line in (errors or [t for t in text if not t.startswith(noise)] or text)[:lines])


class Extension:
    """available() / build once / remember the failure with its reason / say so, for one family of builds.

    what: the noun of the messages ("C++ attention kernels"); fallback: what btlib does after a failed
    build, the last line of the error; toolchain: None if a build can be attempted here, else why not
    (cheap: never compiles); about_s: the announced compile time on a cold cache.
    """

    def __init__(self, what: str, fallback: str, toolchain: Callable[[], str | None], about_s: int) -> None:
        self.what, self.fallback, self.toolchain, self.about_s = what, fallback, toolchain, about_s
        self.failed: dict[str, str] = {}  # library name -> why its build failed (remembered builds)
        self.built: dict[str, object] = {}  # library name -> what its build returned
        self.attempts: dict[str, int] = {}  # library name -> compiles started in this process (the tests read it)

    def available(self, name: str) -> str | None:
        """None if library ``name`` is built or can be built here; else why not. Never compiles."""
        if name in self.failed:
            return self.failed[name]
        if name in self.built:
            return None
        return self.toolchain()

    def build(self, name: str, make: Callable[[], T], *, detail: str, depends: Iterable[Path],
              remember_failure: bool = True) -> T:
        """make()'s result for library ``name``, built once per process with the rules of this module.

        make: compiles (or loads the cached) library and returns what callers use; it raises with the
            compiler's output on failure. detail: the announcement's parenthesis (an ISA, a tag).
        Raises RuntimeError: why not (no toolchain, or the remembered failure, without compiling again),
            or the compiler's whole message the first time a build fails.
        """
        got = self.built.get(name)
        if got is not None:
            return got  # type: ignore[return-value]
        with _LOCK:
            if name in self.built:
                return self.built[name]  # type: ignore[return-value]
            why = self.available(name)
            if why:
                raise RuntimeError(f"btlib {self.what} unavailable: {why}\n{self.fallback}")
            if needs_build(name, depends):
                print(f"btlib: compiling the {self.what} ({detail}) into {build_directory(name)} - once, about "
                      f"{self.about_s} s ...", file=sys.stderr, flush=True)
            self.attempts[name] = self.attempts.get(name, 0) + 1
            try:
                got = make()
            except Exception as e:  # noqa: BLE001 - any build failure becomes one clear error
                if remember_failure:
                    self.failed[name] = f"building the {self.what} ({detail}) failed:\n{first_errors(str(e))}"
                raise RuntimeError(f"btlib: building the {self.what} ({detail}) failed: {e}\n{self.fallback}") from e
            self.built[name] = got
            return got

    def load(self, name: str, ops: str, *, detail: str, depends: Iterable[Path], remember_failure: bool = True,
             **kwargs) -> str:
        """Build or load library ``name``, which registers ``torch.ops.<ops>`` with a ``build_info()`` op; returns it."""
        def make() -> str:
            from torch.utils import cpp_extension

            cpp_extension.load(name=name, is_python_module=False, verbose=False, **kwargs)
            return getattr(torch.ops, ops).build_info()

        return self.build(name, make, detail=detail, depends=depends, remember_failure=remember_failure)

    def module(self, name: str, *, detail: str, depends: Iterable[Path], **kwargs):
        """Build or load the pybind11 module ``name`` (its PYBIND11_MODULE functions are attributes); returns it."""
        def make():
            from torch.utils import cpp_extension

            return cpp_extension.load(name=name, verbose=False, **kwargs)

        return self.build(name, make, detail=detail, depends=depends)
