"""What this CPU is, and how fast it multiplies matrices in fp32 and bf16: measured, never assumed.

    >>> from btlib.hardware import machine
    >>> hw = machine()                    # doctest: +SKIP
    >>> hw.isa, hw.bf16_native, round(hw.fp32_gflops), round(hw.bf16_gflops)   # doctest: +SKIP
    ('avx512bf16', True, 160, 610)

Facts (cheap, read from the OS): the CPU model, the build of btlib's C++ kernels it gets
(:func:`btlib.kernels.cpu.build.isa`), and whether bf16 arithmetic is native:

    x86           avx512_bf16 or amx_bf16 among /proc/cpuinfo's flags
    Linux aarch64 bf16 among /proc/cpuinfo's Features
    macOS arm64   sysctl hw.optional.arm.FEAT_BF16 = 1
    otherwise     False

``BTLIB_ASSUME_NO_BF16=1`` makes bf16 count as not native (to see, on a bf16 CPU, what a laptop
or Colab reader gets). Where bf16 is not native torch emulates it: its bf16 matmul ran below
1 GFLOP/s on an AVX2 CPU that does 161 GFLOP/s in fp32.

Rates (measured once, ~1-2 s): the best GFLOP/s of n x n matmuls at torch's current thread
count, n up to 1024, each dtype time-boxed so an emulated bf16 stops at small n. They are cached
in this process and on disk in ``$TORCH_EXTENSIONS_DIR`` (else the checkout's build/; else
nowhere) as btlib_hardware.json, keyed by CPU model, flags, torch version and threads. Only a
measurement whose fp32 run reached the largest size goes to disk: fp32 that stops early means the
CPU was busy with other work (or is very slow), and a rate measured then would be reused for good.
``machine(refresh=True)`` measures again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = ["Hardware", "machine", "cpu_name", "cpu_flags", "bf16_native", "measure_gemm_gflops", "cache_file"]

_VERSION = 1  # bump when the measurement changes, so old cached rates are not reused
_memo: dict[str, "Hardware"] = {}


@dataclass(frozen=True)
class Hardware:
    """One CPU as btlib sees it. Rates are GFLOP/s of n x n matmuls (n = fp32_n, bf16_n) at ``threads``."""

    cpu: str                 # model name, e.g. "AMD EPYC 9R45"
    arch: str                # platform.machine(): x86_64, aarch64, arm64, AMD64
    cores: int               # os.cpu_count()
    threads: int             # torch.get_num_threads() when measured
    torch: str               # torch.__version__
    torch_capability: str    # the vector ISA torch's own kernels dispatch to (AVX512, AVX2, DEFAULT, ...)
    isa: str                 # the build of btlib's C++ kernels: avx512bf16, avx512, avx2 or portable
    bf16_native: bool
    bf16_why: str            # where bf16_native comes from, e.g. "avx512_bf16 in /proc/cpuinfo"
    fp32_gflops: float
    bf16_gflops: float
    fp32_n: int
    bf16_n: int

    @property
    def bf16_speedup(self) -> float:
        """bf16 rate / fp32 rate (below 1: bf16 is slower)."""
        return self.bf16_gflops / self.fp32_gflops if self.fp32_gflops else 0.0


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _field(info: str, *names: str) -> str:
    """The first value of the first /proc/cpuinfo field among ``names`` ('' if none)."""
    for line in info.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in names:
            return value.strip()
    return ""


def _sysctl(name: str) -> str:
    try:
        return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_name() -> str:
    """The CPU model (no host names)."""
    name = _field(_cpuinfo(), "model name")
    if not name and platform.system() == "Darwin":
        name = _sysctl("machdep.cpu.brand_string")
    return name or platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo ("flags" on x86, "Features" on aarch64); empty elsewhere."""
    info = _cpuinfo()
    return set((_field(info, "flags") or _field(info, "Features")).split())


def bf16_native() -> tuple[bool, str]:
    """(native?, why): does this CPU do bf16 arithmetic in hardware. Honours BTLIB_ASSUME_NO_BF16=1."""
    if os.environ.get("BTLIB_ASSUME_NO_BF16", "").lower() in ("1", "true", "yes"):
        return False, "BTLIB_ASSUME_NO_BF16=1"
    arch = platform.machine().lower()
    flags = cpu_flags()
    if arch in ("x86_64", "amd64", "i686", "x86"):
        have = sorted(flags & {"avx512_bf16", "amx_bf16"})
        return (True, f"{' and '.join(have)} in /proc/cpuinfo") if have else (False, "no avx512_bf16 or amx_bf16 on this x86 CPU")
    if arch in ("aarch64", "arm64"):
        if platform.system() == "Darwin":
            native = _sysctl("hw.optional.arm.FEAT_BF16") == "1"
            return native, f"sysctl hw.optional.arm.FEAT_BF16 = {int(native)}"
        return ("bf16" in flags), ("bf16 in /proc/cpuinfo Features" if "bf16" in flags else "no bf16 in /proc/cpuinfo Features")
    return False, f"no bf16 detection for {platform.system()} {platform.machine()}"


_SIZES = (256, 512, 1024)


def measure_gemm_gflops(dtype: torch.dtype, budget_s: float = 0.6, sizes: tuple[int, ...] = _SIZES) -> tuple[float, int]:
    """(best GFLOP/s, largest n timed) of (n, n) @ (n, n) in ``dtype``, within about ``budget_s`` seconds.

    Grows n only while the predicted time of the next size (8x per doubling) fits the budget, so an
    emulated bf16 (~1 GFLOP/s: 34 ms at n=256) stops early instead of taking seconds per call.
    """
    g = torch.Generator().manual_seed(0)  # a local generator: the global RNG stays untouched
    best, n_done = 0.0, 0
    deadline = time.perf_counter() + budget_s
    with torch.no_grad():
        for n in sizes:
            a, b = (torch.randn(n, n, generator=g).to(dtype) for _ in range(2))
            c = torch.empty(n, n, dtype=dtype)
            t0 = time.perf_counter()
            torch.mm(a, b, out=c)  # warm-up: weight packing, first-touch of c
            last = time.perf_counter() - t0
            for _ in range(5):
                if time.perf_counter() + last > deadline and n_done:
                    break
                t0 = time.perf_counter()
                torch.mm(a, b, out=c)
                last = time.perf_counter() - t0
                best, n_done = max(best, 2 * n**3 / last / 1e9), n
            if time.perf_counter() + 2 * 8 * last > deadline:
                break
    return best, n_done


def cache_file() -> Path | None:
    """$TORCH_EXTENSIONS_DIR/btlib_hardware.json, else <checkout>/build/btlib_hardware.json, else None."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "btlib_hardware.json"
    root = Path(__file__).resolve().parents[1]
    return root / "build" / "btlib_hardware.json" if (root / "pyproject.toml").is_file() else None


def _key(threads: int) -> str:
    facts = f"{_VERSION}|{cpu_name()}|{platform.machine()}|{' '.join(sorted(cpu_flags()))}|{torch.__version__}|{threads}"
    return hashlib.sha256(facts.encode()).hexdigest()[:16]


def _read_cache(path: Path | None, key: str) -> dict | None:
    try:
        return json.loads(path.read_text()).get(key) if path else None
    except (OSError, ValueError, AttributeError):
        return None


def _write_cache(path: Path | None, key: str, rates: dict) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError):
            entries = {}
        entries[key] = rates
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError:
        pass  # a read-only checkout: the rates stay cached in this process only


def machine(*, refresh: bool = False) -> Hardware:
    """This machine's :class:`Hardware`, rates at the current torch thread count (measured once, then cached).

    refresh: measure again and overwrite the cached rates.
    """
    from .kernels.cpu.build import isa  # cheap: reads /proc/cpuinfo, never compiles

    threads = torch.get_num_threads()
    native, why = bf16_native()
    key = _key(threads)
    memo_key = f"{key}|{native}"
    if not refresh and memo_key in _memo:
        return _memo[memo_key]
    path = cache_file()
    rates = None if refresh else _read_cache(path, key)
    if rates is None:
        fp32, fp32_n = measure_gemm_gflops(torch.float32)
        bf16, bf16_n = measure_gemm_gflops(torch.bfloat16)
        rates = {"fp32_gflops": fp32, "bf16_gflops": bf16, "fp32_n": fp32_n, "bf16_n": bf16_n}
        if fp32_n == _SIZES[-1]:  # else kept for this process only (see the module docstring)
            _write_cache(path, key, rates)
    hw = Hardware(cpu=cpu_name(), arch=platform.machine(), cores=os.cpu_count() or 1, threads=threads,
                  torch=torch.__version__, torch_capability=torch.backends.cpu.get_cpu_capability(), isa=isa(),
                  bf16_native=native, bf16_why=why, **rates)
    _memo[memo_key] = hw
    return hw


def as_dict(hw: Hardware) -> dict:
    """The fields of ``hw`` plus bf16_speedup, for JSON rows."""
    return {**asdict(hw), "bf16_speedup": hw.bf16_speedup}
