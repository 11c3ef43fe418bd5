"""Build btlib's C++ attention kernels on first use, with torch.utils.cpp_extension, into a cache.

    load(isa=None) -> str   compile (once, ~30 s) or load one build; returns its build info line
    ops(isa=None)           torch.ops.btlib_cpu_<isa>: that build's ops (loads it first)
    available() -> None | str   cheap: None if a C++ compiler is on PATH, else why not (never compiles)
    amx_available() -> None | str   None if the AMX varlen op can run here (AMX CPU, Linux's grant, avx512bf16 build)
    isa() -> str            the build the registered kernels use: $BTLIB_CPU_ISA, else the best this CPU runs
    runnable() -> list      every build this CPU can execute ("portable" first), for the tests
    load_copy(folder, tag)  build an edited copy of these sources (e.g. another Bc) as its own library
    int8_module()           int8.cpp (btlib.quant's fused int8 passes) for isa(); int8_available() like available()
    gemm_module()           gemm.cpp (btlib.gemm's own fp32 GEMM for few rows) for isa(); gemm_available() likewise

Every load first defines the ops from their one schema (schema.py: schema, fake kernel, Autograd
fallthrough), so torch.compile traces them and torch.library.opcheck passes on each; the library then
adds each op's CPU kernel (each family's TORCH_LIBRARY_IMPL).

The source is one folder per kernel family, its torch binding and its torch-free headers (flash/: flash.cpp,
flash.h, flash_tiles.h, flash_bf16dot.h, flash_amx.h; teaching/: teaching.cpp, teaching.h), and the headers they
share here (core.h, vec.h, binding.h). One library per instruction set, compiled from attention.cpp (one
translation unit that includes every family's .cpp), named ``btlib_cpu_attention_<isa>`` and registering its
ops as ``torch.ops.btlib_cpu_<isa>``, so several builds load side by side in one process. Cached in ``$TORCH_EXTENSIONS_DIR/<name>/``
(the Makefile points it at build/torch_extensions; torch's default is ~/.cache/torch_extensions).
Every build goes through btlib/kernels/_build.py: built once per process, announced on stderr when it
compiles, and a failed build remembered with the compiler's first errors (no compile per call after it).
Two processes building one library at once take turns: cpp_extension holds a file baton (a lock
file in that folder) while one of them compiles, and the other waits, then loads the result.

x86: AVX-512 is chosen when /proc/cpuinfo lists avx512f, avx512dq, avx512bw and avx512vl (plus
-mavx512bf16 where it lists avx512_bf16: bf16 then runs on vdpbf16ps); gcc 12's ``-march=native``
treats Zen 5 as znver3 and prefers 256-bit code, so the flags name x86-64-v4 and 512-bit vectors
explicitly (gcc 12 on an AMD EPYC Zen 5: -march=native alone gave ymm-only code). The avx512bf16 build
also gets -mamx-tile -mamx-bf16 where the compiler takes them (gcc 11+, clang 12+; :func:`isa_flags`): they only
make the AMX intrinsics of flash_amx.h available (no compiler emits tile instructions by itself), so the build
still runs on AVX512_BF16 CPUs without AMX (AMD Zen 4 / 5), where :func:`amx_available` keeps its op unused. arm64 / aarch64 (Linux, macOS) gets "neon". ``BTLIB_CPU_ISA=avx512bf16|
avx512|avx2|neon|portable`` overrides the choice.

Threads come from at::parallel_for. With torch's OpenMP backend (Linux, Windows wheels) its body is
an OpenMP region inlined into our code, so the build needs -fopenmp to run in parallel; Apple clang
has no -fopenmp, so on macOS the kernels build without it and the build info line says "serial" if
that torch uses OpenMP.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from ..._compile import constant_result
from ...hardware import amx, isa, runnable  # ISA detection lives with the other CPU facts; named here as before
from .. import _build
from .._build import Extension
from . import schema

__all__ = ["load", "info_fields", "ops", "load_copy", "available", "amx_available", "isa_flags", "isa", "runnable", "int8_module", "int8_available", "gemm_module",
           "gemm_available", "SOURCE", "FOLDERS", "SOURCES", "HEADER", "HEADERS", "include_dirs", "INT8_SOURCE", "GEMM_SOURCE", "build_directory", "library_path"]

HERE = Path(__file__).resolve().parent
FOLDERS = ("flash", "teaching")  # one folder per kernel family: <folder>/<folder>.cpp binds its torch-free headers
SOURCE = HERE / "attention.cpp"  # the library's one translation unit: it includes every family's .cpp
SOURCES = [SOURCE, *(HERE / f / f"{f}.cpp" for f in FOLDERS)]
HEADER = HERE / "vec.h"
INT8_SOURCE = HERE / "int8.cpp"  # btlib.quant's quantize / dequantize passes (a pybind11 module)
GEMM_SOURCE = HERE / "gemm.cpp"  # btlib.gemm's "btlib" path: fp32 GEMM on pre-packed column panels (pybind11)
HEADERS = [HERE / n for n in ("core.h", "vec.h", "binding.h")] + [h for f in FOLDERS for h in sorted((HERE / f).glob("*.h"))]


def include_dirs(root: Path = HERE) -> list[Path]:
    """The -I folders of the attention library: the shared headers' (core.h, vec.h, binding.h), which the families'
    files include by name; a family's own headers are found beside it."""
    return [root]

_FLAGS = {
    "avx512bf16": ["-march=x86-64-v4", "-mavx512bf16", "-mprefer-vector-width=512"],
    "avx512": ["-march=x86-64-v4", "-mprefer-vector-width=512"],
    "avx2": ["-march=x86-64-v3"],
    "neon": [],  # NEON and FMA are baseline on aarch64
    "portable": [],
}  # one entry per btlib.hardware.ISAS
_default_isa = isa  # for the functions whose ``isa`` argument hides isa() (dynamo cannot trace globals())


def _compiler() -> str:
    return os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension invokes


def _no_compiler() -> str | None:
    if shutil.which(_compiler()) is None:
        return f"no C++ compiler: {_compiler()!r} is not on PATH (install g++ or set CXX)"
    return None


def _toolchain() -> str | None:
    why = _no_compiler()
    return why and f"{why}; btlib.attention falls back to PyTorch's kernels"


_ext = Extension("C++ attention kernels",
                 "btlib.attention(backend='auto') now falls back to PyTorch's kernels; "
                 "backend='torch_sdpa' or 'reference' choose one explicitly.", _toolchain, about_s=30)
_int8 = Extension("int8 helpers", "btlib.quant.Int8Linear runs the same arithmetic as torch ops (slower).",
                  _no_compiler, about_s=20)
_gemm = Extension("fp32 GEMM for few rows", "btlib.gemm measures and takes its other paths (oneDNN, F.linear).",
                  _no_compiler, about_s=20)


def available() -> str | None:
    """None if the registered build (:func:`isa`) can be built or is built; else why not (no compiler, a bad
    $BTLIB_CPU_ISA, its failed build with the compiler's first errors). Never compiles."""
    try:
        isa_ = isa()
    except ValueError as e:
        return str(e)
    return _ext.available(_name(isa_))


def _name(isa_: str | None = None) -> str:
    return f"btlib_cpu_attention_{isa_ or isa()}"


def build_directory(isa_: str | None = None) -> Path:
    """Where the library is cached: $TORCH_EXTENSIONS_DIR/<name>, else torch's default."""
    return _build.build_directory(_name(isa_))


def library_path(isa_: str | None = None) -> Path:
    return build_directory(isa_) / f"{_name(isa_)}.so"


@functools.lru_cache(maxsize=None)
def _thread_flags() -> tuple[str, ...]:
    """-fopenmp where torch's at::parallel_for is OpenMP and the compiler has it (not Apple clang)."""
    if sys.platform == "darwin" or not torch.backends.openmp.is_available():
        return ()
    return ("-fopenmp",)


def _checked_isa(isa_: str | None) -> str:
    isa_ = isa_ or isa()
    if isa_ not in _FLAGS:
        raise ValueError(f"isa must be one of {', '.join(_FLAGS)}; got {isa_!r}")
    return isa_


_AMX_FLAGS = ("-mamx-tile", "-mamx-bf16")


@functools.lru_cache(maxsize=None)
def _compiler_takes(flags: tuple[str, ...]) -> bool:
    """Does the C++ compiler accept these flags (preprocessing an empty file: ~20 ms, once per process)."""
    import subprocess

    try:
        return subprocess.run([_compiler(), *flags, "-x", "c++", "-E", os.devnull], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def isa_flags(isa: str) -> list[str]:
    """The compiler flags of one build of the attention kernels: :data:`_FLAGS`, plus the AMX intrinsics' flags
    for avx512bf16 where the compiler takes them."""
    flags = list(_FLAGS[isa])
    if isa == "avx512bf16" and _compiler_takes(_AMX_FLAGS):
        flags += _AMX_FLAGS
    return flags


def amx_available() -> str | None:
    """None if the AMX varlen kernel (flash_amx.h, op ``varlen_amx``) can run here, else why not. Never compiles.

    Needs: the avx512bf16 build registered (:func:`isa`) and buildable with the AMX flags, and this process
    granted AMX tile state by Linux (btlib.hardware.amx: asked once, through arch_prctl).
    """
    usable, why = amx()
    if not usable:
        return why
    isa_ = isa()
    if isa_ != "avx512bf16":
        return f"the {isa_} build has no AMX code (BTLIB_CPU_ISA; the avx512bf16 build has it)"
    if not _compiler_takes(_AMX_FLAGS):
        return f"the C++ compiler {_compiler()!r} does not take {' '.join(_AMX_FLAGS)} (gcc 11+ or clang 12+ does)"
    return available()


def _cflags(isa_: str, namespace: str) -> list[str]:
    return ["-O3", "-std=c++17", f"-DBTLIB_OPS_NS={namespace}", *_thread_flags(), *isa_flags(isa_)]


def load(isa: str | None = None) -> str:
    """Build (first use) or load one build (default :func:`isa`); registers torch.ops.btlib_cpu_<isa>.*.

    Returns the build info line. Raises RuntimeError with the compiler's message if the build fails;
    the failure is remembered: a second call raises its first errors without compiling again, and for
    the registered build :func:`available` reports it, so ``backend="auto"`` moves on to PyTorch's kernels.
    """
    isa_ = _checked_isa(isa)
    schema.define(f"btlib_cpu_{isa_}")  # the ops' schemas and fake kernels, before the library adds its CPU kernels
    info = _ext.load(_name(isa_), f"btlib_cpu_{isa_}", detail=isa_, depends=[*SOURCES, *HEADERS], sources=[str(SOURCE)],
                     extra_cflags=_cflags(isa_, f"btlib_cpu_{isa_}"), extra_ldflags=list(_thread_flags()),
                     extra_include_paths=list(map(str, include_dirs())))
    return info


def info_fields(info: str) -> dict:
    """The build info line :func:`load` returns, as fields: one parser for what a caller decides on (a cell may still
    print the line, or its head, as it is).

    ``"avx512+bf16dot+amx W=16 kR=6 kNV=4 Br=64 Bc=64 max_head_dim=256 threads=... ops=btlib_cpu_avx512bf16"``
    -> ``{"vector": "avx512", "bf16dot": True, "amx": True, "W": 16, "kR": 6, "kNV": 4, "Br": 64, "Bc": 64,
    "max_head_dim": 256, "threads": "...", "ops": "btlib_cpu_avx512bf16"}`` (flash/flash.cpp's build_info writes it;
    ``threads`` may hold spaces, so it is read up to `` ops=``). ``vector``: the SIMD code the build runs (avx512,
    avx2, neon or portable), not the build's name; ``amx``: the build holds the AMX kernel, which this CPU may still
    lack (:func:`amx_available` says)."""
    head, _, rest = info.partition(" W=")
    vector, *extras = head.split("+")
    rest, _, ops_ns = ("W=" + rest).partition(" ops=")
    rest, _, threads = rest.partition(" threads=")
    fields: dict = {"vector": vector, "bf16dot": "bf16dot" in extras, "amx": "amx" in extras}
    for item in rest.split():
        key, _, value = item.partition("=")
        fields[key] = int(value)
    return {**fields, "threads": threads, "ops": ops_ns}


_loaded: dict[str | None, object] = {}  # isa (None: isa()'s) -> torch.ops.btlib_cpu_<isa>, once loaded in this process


def ops(isa: str | None = None):
    """torch.ops.btlib_cpu_<isa>: the ops of one build (default :func:`isa`), loaded on first use.

    Asked once per attention call: after the first load it is one dict lookup (the load path cost ~20 us a
    call with the caches cold after a layer's GEMMs, ~0.1 ms of a short query's forward)."""
    got = _loaded.get(isa)  # isa None (the default build) is a key too: no isa() call on the hot path
    if got is None:
        got = _loaded[isa] = getattr(torch.ops, _loaded_namespace(isa))
    return got


# Under torch.compile this runs (builds or loads the library) once while dynamo traces: file locks, the compiler
# and /proc/cpuinfo have no place in a graph, and the namespace it returns is a constant of it.
@constant_result  # torch.compiler.assume_constant_result, without importing dynamo here
def _loaded_namespace(isa: str | None) -> str:
    """Load one build (default :func:`isa`) and return its op namespace, "btlib_cpu_<isa>"."""
    isa_ = isa or _default_isa()
    load(isa_)
    return f"btlib_cpu_{isa_}"


def load_copy(folder: str | Path, tag: str, isa: str | None = None):
    """Build ``folder``'s kernel sources and headers (an edited copy of :data:`HERE`, its family folders included)
    as a library of its own.

    For experiments such as another key tile: copy this folder, change ``Bc`` in the copy's core.h,
    then ``load_copy(copy, "bc128")``. The copy registers ``torch.ops.btlib_cpu_<isa>_<tag>`` (the ops
    of :func:`ops`, same signatures) beside the registered build, which it never replaces; a failed
    copy raises with the compiler's message and leaves ``backend="auto"`` as it was.
    tag: letters, digits and _ (it names the library and the op namespace); one tag per edit, since
    a library name loads once per process. Returns that ops namespace.
    """
    isa_ = _checked_isa(isa)
    if not tag.isidentifier() or not tag.isascii():
        raise ValueError(f"tag must be letters, digits and _ (it names a library and an op namespace); got {tag!r}")
    folder = Path(folder).resolve()
    sources = [folder / s.relative_to(HERE) for s in SOURCES]
    missing = [s.relative_to(folder).as_posix() for s in sources if not s.is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} has no {', '.join(missing)}: copy the whole folder {HERE.name}/ "
                                "(shutil.copytree(build.HERE, ...))")
    namespace, name = f"btlib_cpu_{isa_}_{tag}", f"btlib_cpu_attention_{isa_}_{tag}"
    schema.define(namespace)  # the copy implements the same ops: the same schemas and fake kernels
    # not remembered: a copy that fails to compile is fixed and loaded again under the same tag
    _ext.load(name, namespace, detail=f"{isa_}, copy {folder.name}/ {tag}", depends=[*sources, *folder.rglob("*.h")],
              remember_failure=False, sources=[str(sources[0])], extra_cflags=_cflags(isa_, namespace),
              extra_ldflags=list(_thread_flags()), extra_include_paths=list(map(str, include_dirs(folder))))
    return getattr(torch.ops, namespace)


def _int8_name(isa_: str) -> str:
    return f"btlib_int8_{isa_}"


def _available(ext: Extension, name) -> str | None:
    """None if ext's library ``name(isa())`` can be built or is built; else why not (never compiles)."""
    try:
        isa_ = isa()
    except ValueError as e:
        return str(e)
    return ext.available(name(isa_))


def int8_available() -> str | None:
    """None if int8.cpp (btlib.quant's fused passes) can be built or is built for :func:`isa`; else why not."""
    return _available(_int8, _int8_name)


def int8_module():
    """int8.cpp built for :func:`isa` (once per process, ~20 s on a cold cache): ``quantize_rows``, ``dequantize``.

    Same cache, announcement and ISA flags as the attention kernels, plus -fno-math-errno -fno-trapping-math
    (the loops vectorise without errno writes) and -ffp-contract=off: g++ otherwise fuses a multiply and an add
    into one FMA where it inlines them, differently in dequantize and requantize, which then rounded the same
    row 1 ulp apart (int8.cpp promises requantize the bits of quantize_rows after dequantize). Raises RuntimeError like :func:`load`; a failure is
    remembered, so :func:`int8_available` reports it and the next call raises without compiling.
    """
    isa_ = _checked_isa(None)
    flags = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", *_FLAGS[isa_], *_thread_flags()]
    return _int8.module(_int8_name(isa_), detail=f"{INT8_SOURCE.name}, {isa_}", depends=[INT8_SOURCE, HEADER],
                        sources=[str(INT8_SOURCE)], extra_cflags=flags, extra_ldflags=list(_thread_flags()),
                        extra_include_paths=[str(HERE)])


def _gemm_name(isa_: str) -> str:
    return f"btlib_gemm_{isa_}"


def gemm_available() -> str | None:
    """None if gemm.cpp (btlib.gemm's "btlib" path) can be built or is built for :func:`isa`; else why not."""
    return _available(_gemm, _gemm_name)


def gemm_module():
    """gemm.cpp built for :func:`isa` (once per process, ~20 s on a cold cache): ``pack``, ``linear``,
    ``panel_width``, ``max_rows``. Raises RuntimeError like :func:`load`, the failure remembered. btlib.gemm keeps
    the module it gets (a call per linear on its hot path)."""
    isa_ = _checked_isa(None)
    return _gemm.module(_gemm_name(isa_), detail=f"{GEMM_SOURCE.name}, {isa_}", depends=[GEMM_SOURCE, HEADER],
                       sources=[str(GEMM_SOURCE)], extra_cflags=["-O3", *_FLAGS[isa_], *_thread_flags()],
                       extra_ldflags=list(_thread_flags()), extra_include_paths=[str(HERE)])


def timed_load() -> tuple[str, float]:
    """:func:`load` and the seconds it took (compile on a cold cache, milliseconds on a warm one)."""
    t0 = time.perf_counter()
    info = load()
    return info, time.perf_counter() - t0
