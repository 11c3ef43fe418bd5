"""Print the C++ that btlib compiles, by file and function name (the notebooks' source cells).

    show(path)                       the file's opening comment (what it holds)
    show(path, function)             that function: its comment, its template line, its body
    show(path, function, matching=r"...")   only the lines of it that match, numbered as in the file

``path`` is relative to btlib/kernels/cpu/ ("flash/flash_tiles.h", "core.h") and must be a file btlib compiles
(build.SOURCES, build.HEADERS, the int8 and GEMM sources, core_check.cpp), so a renamed file or function fails
here, in the notebook's cell, instead of printing something else. A function defined once per ISA (vec.h's vexp2)
prints its first definition, the AVX-512 one.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from . import build

__all__ = ["show", "function_lines", "files", "binding"]


def files() -> dict[str, Path]:
    """Every C++ file btlib compiles, by its path relative to btlib/kernels/cpu/."""
    paths = [*build.SOURCES, *build.HEADERS, build.INT8_SOURCE, build.GEMM_SOURCE, build.HERE / "core_check.cpp"]
    return {p.relative_to(build.HERE).as_posix(): p for p in paths}


@lru_cache(maxsize=None)  # describe asks once per provider; the sources do not change within a process
def binding(op: str) -> tuple[str, int]:
    """(path relative to btlib/kernels/cpu/, line) of the ``m.impl("op", ...)`` that binds torch op ``op`` to its C++:
    the family folder's .cpp, whose includes are the kernel's headers beside it."""
    for path in build.SOURCES:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(rf'm\.impl\("{re.escape(op)}"', line):
                return path.relative_to(build.HERE).as_posix(), i
    raise LookupError(f"no btlib C++ source binds the op {op!r} (m.impl(\"{op}\", ...)); ops bound: see build.SOURCES")


def _file(path: str) -> list[str]:
    known = files()
    if path not in known:
        raise FileNotFoundError(f"btlib compiles no {path!r} under btlib/kernels/cpu/; it compiles {', '.join(sorted(known))}")
    return known[path].read_text().splitlines()


def _code(line: str) -> str:
    """The line without its // comment and string literals (enough for this source's braces)."""
    return re.sub(r'"(\\.|[^"\\])*"', '""', line).split("//")[0]


def function_lines(path: str, function: str) -> tuple[int, int]:
    """(first, last) line index (0-based, inclusive) of ``function``'s definition in ``path``, with the comment and
    template lines right above it. Raises LookupError if the file defines no such function."""
    lines = _file(path)
    name = re.compile(rf"(?<![\w:.]){re.escape(function)}\s*\(")
    for i, line in enumerate(lines):
        if not name.search(_code(line)):
            continue
        depth, end, opened = 0, None, False
        for j in range(i, len(lines)):  # a definition reaches "{" before any ";" (a call or declaration ends in ";")
            code = _code(lines[j]) if j > i else _code(line)[name.search(_code(line)).start():]
            for ch in code:
                if ch == ";" and not opened and depth == 0:
                    end = -1
                    break
                if ch == "{":
                    depth, opened = depth + 1, True
                elif ch == "}":
                    depth -= 1
                    if opened and depth == 0:
                        end = j
                        break
                elif ch == "(" or ch == ")":
                    continue
            if end is not None:
                break
        if end is None or end < 0:
            continue
        start = i
        while start > 0 and (lines[start - 1].lstrip().startswith(("//", "template")) or lines[start - 1].strip().endswith(",")):
            start -= 1
        return start, end
    raise LookupError(f"btlib/kernels/cpu/{path} defines no function {function!r}")


def show(path: str, function: str | None = None, *, matching: str | None = None) -> None:
    """Print ``function`` of ``path`` (or, without one, the file's opening comment); with ``matching`` only the lines
    of the function that match that regex, numbered as in the file."""
    lines = _file(path)
    if function is None:
        end = next(i for i, line in enumerate(lines) if not line.startswith(("/*", " *", "//")) or line.startswith(" */"))
        print(f"--- btlib/kernels/cpu/{path}")
        print("\n".join(lines[:end + 1] if lines[end].startswith(" */") else lines[:end]))
        return
    first, last = function_lines(path, function)
    print(f"--- btlib/kernels/cpu/{path}: {function}")
    if matching is None:
        print("\n".join(lines[first:last + 1]))
        return
    keep = [i for i in range(first, last + 1) if re.search(matching, lines[i]) and not lines[i].lstrip().startswith("//")]
    for prev, i in zip([None, *keep], keep):
        if prev is not None and i != prev + 1:
            print("     ...")
        print(f"{i + 1:4d}  {lines[i]}")
