"""Watching PyTorch run: which aten operators ran (:func:`ops_that_ran`), and the plain-module path
every fast path is checked against (:func:`run_slow`).

quiet_profile is torch.profiler without the noise: this build prints 'USDT: ... profiler_start/stop'
lines on the process's C-level stderr at every start and stop, which Jupyter shows in the cell output."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator

import torch

from torch.profiler import ProfilerActivity, profile

__all__ = ["quiet_profile", "ops_that_ran", "run_slow"]


@contextlib.contextmanager
def _silence_fd2() -> Iterator[None]:
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 (some embedded interpreters): nothing to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def quiet_profile(**kwargs) -> Iterator[profile]:
    """torch.profiler.profile(activities=[CPU], **kwargs), with the C-level stderr lines suppressed."""
    prof = profile(activities=[ProfilerActivity.CPU], **kwargs)
    with _silence_fd2():
        prof.start()
    try:
        yield prof
    finally:
        with _silence_fd2():
            prof.stop()


def ops_that_ran(fn: Callable[[], object]) -> set[str]:
    """Names of the aten operators the profiler records while ``fn()`` runs once."""
    with quiet_profile() as prof:
        fn()
    return {evt.key for evt in prof.key_averages()}


def run_slow(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` under torch.inference_mode with PyTorch's MHA/encoder fastpath switched
    off (torch.backends.mha.set_fastpath_enabled(False)): the plain-module path, as the reference
    every fast path is checked against. The previous setting is restored."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.inference_mode():
            return fn(*args, **kwargs)
    finally:
        torch.backends.mha.set_fastpath_enabled(before)
