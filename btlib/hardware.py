"""What this CPU is, and how fast it multiplies matrices in fp32, bf16 and int8: measured, never assumed.

    >>> from btlib.hardware import machine
    >>> hw = machine()                    # doctest: +SKIP
    >>> hw.isa, hw.bf16_native, round(hw.fp32_gflops), round(hw.bf16_gflops)   # doctest: +SKIP
    ('avx512bf16', True, 540, 1050)
    >>> hw.gemm_pick["fp32"]             # doctest: +SKIP
    [[None, 'onednn']]

Facts (cheap, read from the OS): the CPU model, the build of btlib's C++ kernels it gets
(:func:`isa`, which btlib.kernels.cpu.build compiles), and whether bf16 arithmetic is native:

    x86           avx512_bf16 or amx_bf16 among /proc/cpuinfo's flags
    Linux aarch64 bf16 among /proc/cpuinfo's Features
    macOS arm64   sysctl hw.optional.arm.FEAT_BF16 = 1
    otherwise     False

``BTLIB_ASSUME_NO_BF16=1`` makes bf16 count as not native (to see, on a bf16 CPU, what a laptop
or Colab reader gets). Where bf16 is not native torch emulates it: its bf16 matmul ran below
1 GFLOP/s on an AVX2 CPU that does 161 GFLOP/s in fp32.

Rates (measured once, ~3 s, on first use, never at import): every GEMM path of
:mod:`btlib.gemm` at the encoder's shapes and a few token counts (:mod:`btlib.gemm_measure`),
at torch's current thread count. ``gemm`` holds every path's rate, ``gemm_pick`` the path
btlib.gemm.linear takes per token count, and ``fp32_gflops`` / ``bf16_gflops`` the best rate of
one GEMM of that precision over every shape, path and token count: the yardstick for "bound",
"ideal" and the bf16 factor, so that a kernel is compared with the fastest GEMM this machine has,
never a slow library's (btlib.bench measures again when a run beats it: a cached rate taken while
the machine was slower is not a bound). This module
sits below btlib.gemm and imports nothing above it: btlib.gemm hands over how to time its paths
when it is imported (:func:`use_gemm`; ``import btlib`` imports it), and reads its choice back
from :func:`machine`. torch._int_mm's own rate (:func:`int8_gemm_gflops`, btlib.quant's int8
path) is measured here too, once per process. The GEMM rates are cached in this process and on
disk in ``$TORCH_EXTENSIONS_DIR`` (else the checkout's build/; else nowhere) as btlib_hardware.json
(:mod:`btlib.hardware_cache`), keyed by CPU model, flags, torch version, threads and the variables
that restrict torch's ISA (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA, ...).
Only a measurement whose fp32 run reached the largest size goes to disk: fp32 that stops early
means the CPU was busy with other work (or is very slow), and a rate measured then would be
reused for good. A cache that is corrupt, of the wrong shape or holds rates that are not finite
and >= 0 is measured again and rewritten (one warning). ``machine(refresh=True)`` measures again.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import _torch_private as tp
from .gemm_measure import TOKENS
from .hardware_cache import FIELDS, read_cache, write_cache

__all__ = ["Hardware", "machine", "cpu_name", "cpu_flags", "bf16_native", "amx", "measure_rates", "cache_file", "isa", "runnable",
           "ISAS", "use_gemm", "int8_gemm_gflops", "cache_key"]

_VERSION = 6  # bump when the measurement changes, so old cached rates are not reused (2: GEMM paths, encoder shapes; 3: gemm.cpp;
#               4: an int8 pick, which btlib.quant follows; 5: int8 picks per weight shape; 6: the fp32 / bf16 bound is
#               the fastest single shape's rate)
_memo: dict[str, "Hardware"] = {}
# threads at first use measure once: two measurements at once would each time half the CPU, and cache that
_measure_lock = threading.Lock()
_warned: set[str] = set()
_gemm: dict[str, Callable] = {}  # "measure", "forget": handed over by btlib.gemm at its import (use_gemm)


@dataclass(frozen=True)
class Hardware:
    """One CPU as btlib sees it. Rates are GFLOP/s of the encoder's GEMMs at ``threads`` (btlib.gemm_measure)."""

    cpu: str                 # model name, e.g. "AMD EPYC 9R45"
    arch: str                # platform.machine(): x86_64, aarch64, arm64, AMD64
    cores: int               # os.cpu_count()
    threads: int             # torch.get_num_threads() when measured
    torch: str               # torch.__version__
    torch_capability: str    # the vector ISA torch's own kernels dispatch to (AVX512, AVX2, DEFAULT, ...)
    isa: str                 # the build of btlib's C++ kernels: avx512bf16, avx512, avx2 or portable
    bf16_native: bool
    bf16_why: str            # where bf16_native comes from, e.g. "avx512_bf16 in /proc/cpuinfo"
    fp32_gflops: float       # the best fp32 rate of one GEMM over every shape, path and token count
    bf16_gflops: float       # the same in bf16
    fp32_n: int              # the largest token count M timed in fp32 (smaller: the time box stopped it)
    bf16_n: int
    gemm: dict = field(default_factory=dict, compare=False)       # {precision: {path: {str(M): GFLOP/s}}}, int8 too
    gemm_pick: dict = field(default_factory=dict, compare=False)  # {"fp32" | "bf16" | "int8" | "int8 KxN": [[M_max | None, path], ...]}

    @property
    def bf16_speedup(self) -> float:
        """best bf16 rate / best fp32 rate (below 1: bf16 is slower)."""
        return self.bf16_gflops / self.fp32_gflops if self.fp32_gflops else 0.0

    def best(self, precision: str) -> tuple[str, int, float] | None:
        """(path, M, GFLOP/s) of the fastest measured GEMM in ``precision`` ("fp32", "bf16", "int8"), or None."""
        found = [(p, int(M), r) for p, by_M in self.gemm.get(precision, {}).items() for M, r in by_M.items()]
        return max(found, key=lambda f: f[2]) if found else None


@functools.cache
def _cpuinfo() -> str:
    """/proc/cpuinfo, read once per process: it does not change, and re-reading it cost ~0.2 ms a call (once
    per bf16 attention call, ~1 ms of a 4 ms query, before it was cached)."""
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


@functools.cache
def cpu_name() -> str:
    """The CPU model (no host names)."""
    name = _field(_cpuinfo(), "model name")
    if not name and platform.system() == "Darwin":
        name = _sysctl("machdep.cpu.brand_string")
    return name or platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo ("flags" on x86, "Features" on aarch64); empty elsewhere."""
    return set(_flags())


@functools.cache
def _flags() -> frozenset[str]:  # parsed once: asked on every bf16 attention call and every machine() lookup
    info = _cpuinfo()
    return frozenset((_field(info, "flags") or _field(info, "Features")).split())


def bf16_native() -> tuple[bool, str]:
    """(native?, why): does this CPU do bf16 arithmetic in hardware. Honours BTLIB_ASSUME_NO_BF16=1."""
    if os.environ.get("BTLIB_ASSUME_NO_BF16", "").lower() in ("1", "true", "yes"):
        return False, "BTLIB_ASSUME_NO_BF16=1"
    arch = platform.machine().lower()
    flags = _flags()
    if arch in ("x86_64", "amd64", "i686", "x86"):
        have = sorted(flags & {"avx512_bf16", "amx_bf16"})
        return (True, f"{' and '.join(have)} in /proc/cpuinfo") if have else (False, "no avx512_bf16 or amx_bf16 on this x86 CPU")
    if arch in ("aarch64", "arm64"):
        if platform.system() == "Darwin":
            native = _sysctl("hw.optional.arm.FEAT_BF16") == "1"
            return native, f"sysctl hw.optional.arm.FEAT_BF16 = {int(native)}"
        return ("bf16" in flags), ("bf16 in /proc/cpuinfo Features" if "bf16" in flags else "no bf16 in /proc/cpuinfo Features")
    return False, f"no bf16 detection for {platform.system()} {platform.machine()}"


@functools.cache
def _amx_granted() -> tuple[bool, str]:
    """Ask Linux once for this process's AMX tile state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA))."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False, f"AMX tiles are used only on x86_64 Linux, not {platform.system()} {platform.machine()}"
    flags = _flags()
    if not {"amx_tile", "amx_bf16"} <= flags:
        return False, "no amx_tile / amx_bf16 in /proc/cpuinfo"
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    sys_arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18  # x86_64 syscall number, <asm/prctl.h>
    if libc.syscall(ctypes.c_long(sys_arch_prctl), ctypes.c_long(req_xcomp_perm), ctypes.c_long(xfeature_xtiledata)) != 0:
        return False, (f"Linux refused the AMX tile state (arch_prctl(ARCH_REQ_XCOMP_PERM): {os.strerror(ctypes.get_errno())}; "
                       "Linux 5.16 or later grants it)")
    return True, "amx_tile and amx_bf16 in /proc/cpuinfo, tile state granted by Linux"


def amx() -> tuple[bool, str]:
    """(usable?, why): can this process run bf16 on AMX tiles (Intel Xeon since Sapphire Rapids).

    True when /proc/cpuinfo lists amx_tile and amx_bf16 and Linux grants the process the 8 KiB of tile state
    (asked once; without the grant the first tile instruction kills the process). BTLIB_ASSUME_NO_BF16=1
    makes it False, as it does :func:`bf16_native`.
    """
    if os.environ.get("BTLIB_ASSUME_NO_BF16", "").lower() in ("1", "true", "yes"):
        return False, "BTLIB_ASSUME_NO_BF16=1"
    return _amx_granted()


# The builds of btlib's C++ kernels (btlib.kernels.cpu.build holds each one's compiler flags), and the
# /proc/cpuinfo flags each x86 build needs to run.
ISAS = ("avx512bf16", "avx512", "avx2", "neon", "portable")
_X86 = {"avx512bf16": {"avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_bf16"},
        "avx512": {"avx512f", "avx512dq", "avx512bw", "avx512vl"}, "avx2": {"avx2", "fma"}}


def _arm() -> bool:
    return platform.machine().lower() in ("arm64", "aarch64")


def runnable() -> list[str]:
    """Every build of btlib's C++ kernels this CPU can execute, most portable first (the native one last)."""
    if _arm():
        return ["portable", "neon"]
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["portable"]
    flags = cpu_flags()
    return ["portable"] + [name for name in ("avx2", "avx512", "avx512bf16") if _X86[name] <= flags]


@functools.lru_cache(maxsize=None)
def isa() -> str:
    """The build the registered kernels use: $BTLIB_CPU_ISA, else the best one this CPU runs."""
    forced = os.environ.get("BTLIB_CPU_ISA", "").lower()
    if forced:
        if forced not in ISAS:
            raise ValueError(f"BTLIB_CPU_ISA must be one of {', '.join(ISAS)}; got {forced!r}")
        return forced
    return runnable()[-1]


def cache_file() -> Path | None:
    """$TORCH_EXTENSIONS_DIR/btlib_hardware.json, else <checkout>/build/btlib_hardware.json, else None."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "btlib_hardware.json"
    root = Path(__file__).resolve().parents[1]
    return root / "build" / "btlib_hardware.json" if (root / "pyproject.toml").is_file() else None


# Variables that restrict what torch's GEMM libraries may use (docs/setup.md: "what an AVX2-only laptop gets"): rates
# measured under them are another machine's, so they are part of the cache key.
ISA_VARS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_CBWR")


def _key(threads: int) -> str:
    limits = ",".join(f"{v}={os.environ[v]}" for v in ISA_VARS if os.environ.get(v))
    facts = f"{_VERSION}|{cpu_name()}|{platform.machine()}|{' '.join(sorted(cpu_flags()))}|{torch.__version__}|{threads}|{limits}"
    return hashlib.sha256(facts.encode()).hexdigest()[:16]


def cache_key(threads: int | None = None) -> str:
    """The key this machine's measurements are cached under (CPU model and flags, torch, threads, the variables
    that restrict torch's ISA): btlib.kernels.choice keys its attention table by it too."""
    return _key(torch.get_num_threads() if threads is None else threads)


def _warn_once(path: Path, problem: str) -> None:
    if str(path) not in _warned:
        _warned.add(str(path))
        warnings.warn(f"btlib's hardware cache {path}: {problem}; measuring this machine's GEMM rates again "
                      "and rewriting it", stacklevel=3)


def machine(*, refresh: bool = False) -> Hardware:
    """This machine's :class:`Hardware`, rates at the current torch thread count (measured once, then cached).

    refresh: measure again and overwrite the cached rates. A cache file or entry that is corrupt,
    of the wrong shape or holds rates that are not finite and >= 0 is measured again and rewritten
    (with one warning per file).
    """
    threads = torch.get_num_threads()
    native, why = bf16_native()
    key = _key(threads)
    memo_key = f"{key}|{native}"
    if not refresh and memo_key in _memo:
        return _memo[memo_key]
    with _measure_lock:
        if not refresh and memo_key in _memo:
            return _memo[memo_key]
        path = cache_file()
        rates, problem = (None, None) if refresh else read_cache(path, key)
        if problem:
            _warn_once(path, problem)
        if rates is None:
            rates = measure_rates()
            if rates["fp32_n"] == TOKENS[-1]:  # else kept for this process only (see the module docstring)
                write_cache(path, key, rates)
        hw = Hardware(cpu=cpu_name(), arch=platform.machine(), cores=os.cpu_count() or 1, threads=threads,
                      torch=torch.__version__, torch_capability=torch.backends.cpu.get_cpu_capability(), isa=isa(),
                      bf16_native=native, bf16_why=why, **{k: rates[k] for k in FIELDS})
        _memo[memo_key] = hw
        if "forget" in _gemm:
            _gemm["forget"]()  # btlib.gemm's choice follows the newest measurement
        return hw


def use_gemm(measure: Callable[[], dict], forget: Callable[[], None]) -> None:
    """What btlib.gemm hands over when imported: ``measure()`` times its paths (btlib.gemm_measure.measure_paths
    on them, the cache's shape), ``forget()`` drops the GEMM choice it derived from an older :func:`machine`."""
    _gemm.update(measure=measure, forget=forget)


def measure_rates() -> dict:
    """A fresh measurement of every GEMM path of btlib.gemm (btlib.gemm_measure.measure_paths, ~3 s), in the cache's shape."""
    if "measure" not in _gemm:
        raise RuntimeError("btlib.hardware measures btlib.gemm's GEMM paths, and btlib.gemm is not imported yet: "
                           "import btlib (or btlib.gemm) first")
    return _gemm["measure"]()


@functools.lru_cache(maxsize=8)
def _int8_rate(threads: int, budget_s: float) -> float:
    if tp.missing("int_mm") is not None:  # no int8 GEMM in this torch: no rate (btlib.precision says why)
        return 0.0
    g = torch.Generator().manual_seed(0)
    best, deadline = 0.0, time.perf_counter() + budget_s
    for n in (256, 512, 1024):
        a, b = (torch.randint(-127, 128, (n, n), generator=g, dtype=torch.int8) for _ in range(2))
        tp.int_mm(a, b)  # warm-up
        for _ in range(5):
            t0 = time.perf_counter()
            tp.int_mm(a, b)
            best = max(best, 2 * n**3 / (time.perf_counter() - t0) / 1e9)
            if time.perf_counter() > deadline:
                return best
    return best


def int8_gemm_gflops(budget_s: float = 0.5) -> float:
    """Best GOP/s of (n, n) int8 @ (n, n) int8 -> int32 with torch._int_mm at torch's thread count (measured once);
    0.0 where this torch has no torch._int_mm."""
    return _int8_rate(torch.get_num_threads(), budget_s)


def as_dict(hw: Hardware) -> dict:
    """The fields of ``hw`` plus bf16_speedup, for JSON rows."""
    return {**asdict(hw), "bf16_speedup": hw.bf16_speedup}
