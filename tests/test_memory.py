"""btlib.memory.keep_freed_memory: glibc's thresholds set once, a reason (and nothing done) elsewhere, in a fresh
process each (it changes the allocator for the rest of the process)."""

import platform
import subprocess
import sys

import pytest

from btlib import memory

GLIBC = platform.libc_ver()[0] == "glibc"


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.mark.skipif(not GLIBC, reason="keep_freed_memory acts through glibc's mallopt")
def test_keeps_freed_memory_once_and_says_so():
    code = ("import torch, btlib; from btlib import memory; "
            "print(memory.freed_memory_kept(), btlib.keep_freed_memory(), memory.freed_memory_kept(), "
            "btlib.keep_freed_memory()); "
            "a = torch.empty(64 << 20, dtype=torch.uint8).fill_(1); del a; "  # 64 MiB: mmapped by glibc's default
            "b = torch.empty(64 << 20, dtype=torch.uint8).fill_(2); print(int(b.sum()) == 2 * (64 << 20))")
    first, last = _run(code).splitlines()
    assert first == "False None True None" and last == "True"


def test_elsewhere_it_does_nothing_and_says_what_to_do(monkeypatch):
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    monkeypatch.setattr(memory, "_state", {})
    why = memory.keep_freed_memory()
    assert "jemalloc" in why and not memory.freed_memory_kept()
    assert memory.keep_freed_memory() == why  # remembered, not retried
