"""torch.profiler without the noise: this build prints 'USDT: ... profiler_start/stop' lines on
the process's C-level stderr at every start and stop, which Jupyter shows in the cell output."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

from torch.profiler import ProfilerActivity, profile


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
