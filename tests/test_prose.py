"""The notebooks' markdown types no measured run time and no measured speedup.

A sentence such as "v3 is 1.3x faster" or "this section takes about three minutes" is a fact about one
machine, and the outputs beside it come from whichever machine last ran the notebook: typed, it goes stale
or contradicts them. The rule (issue 24): a measured number is printed by a code cell from the measured rows
(``btlib.bench.compare`` for verdicts), the markdown says what to look for; run times live in one place, the
README's notebook table, written from each notebook's metadata (``.ci/workbook.py``). This test holds every
markdown cell of ``notebooks/0*.ipynb`` to two patterns, cheaply (no notebook is run):

- a typed run time: a number (digits, or a number word such as "three" or "a few") followed by minutes or
  hours ("about 3 min", "two minutes", "a few minutes"), or "about / ~ / takes" and a number of seconds
  ("about 30 s", "~15-30 seconds");
- a speedup typed as a number and "x" ("2.24x", "1.5x"), except the analytic figures listed in
  ``ANALYTIC``: factors that follow from the code, a FLOP count, a tolerance rule or a setting, the same on
  every machine. A new one goes there with its reason; a measured one goes into a code cell.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("0*.ipynb"))

_NUMBER = r"(?:\d+(?:\.\d+)?|one|two|three|four|five|six|seven|eight|nine|ten|a few|several)"
_RANGE = r"(?:\s*(?:-|–|to)\s*\d+(?:\.\d+)?)?"
RUN_TIME = re.compile(
    rf"\b{_NUMBER}{_RANGE}\s*(?:minutes?|mins?|hours?|hrs?)\b"
    rf"|(?:\babout|\baround|~|\btakes?|\btook)\s*\d+(?:\.\d+)?{_RANGE}\s*(?:s|secs?|seconds?)\b",
    re.IGNORECASE,
)
SPEEDUP = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?[x×](?!\w|\s*\d)")  # not "64 x 64", not "16x32"

# Factors that do not depend on the machine: the phrase as the markdown has it, and why it holds everywhere.
ANALYTIC = {
    "about 3.6x base's linear-layer FLOPs": "02: FLOP ratio of XLM-R large to base, printed by the model cell",
    "v2 executes 1.5x that": "04: v2 computes Q K^T twice, 6 T^2 D FLOPs against 4 T^2 D",
    "(1.5x the FLOPs)": "04: the same FLOP count",
    "expect up to 2x between them": "04: AVX-512 vectors are twice AVX2's width, an upper bound",
    "roughly 10x faster than HBM": "05: datasheet orders of magnitude, said to be unmeasured",
    "~1000x smaller": "05: datasheet orders of magnitude, said to be unmeasured",
    "at most 2x PyTorch's own": "the low-precision tolerance rule",
    "stay at 1x whatever": "06: a dense path's speedup over itself, by definition",
    "(1.6x by the tile model)": "08: 16 tiles over 10, counted by btlib.blocks",
    "2x overload": "09: the overload run's offered rate, a setting",
}


@functools.cache
def markdown_cells(path: Path) -> tuple[tuple[int, str], ...]:
    """(cell index, source) of every markdown cell of one notebook."""
    nb = nbformat.read(path, as_version=4)
    return tuple((i, cell.source) for i, cell in enumerate(nb.cells) if cell.cell_type == "markdown")


def typed_run_times(text: str) -> list[str]:
    return [m.group(0) for m in RUN_TIME.finditer(text)]


def typed_speedups(text: str) -> list[str]:
    for phrase in ANALYTIC:
        text = text.replace(phrase, "")
    return [m.group(0) for m in SPEEDUP.finditer(text)]


def test_the_patterns_catch_what_they_are_for():
    for typed in ("about 3 min", "About three minutes at the default sizes", "about 15-30 s, once", "a few minutes",
                  "takes 2 hours", "~40 seconds"):
        assert typed_run_times(typed), typed
    for fine in ("seconds to a minute", "a 2-second trial", "the command's defaults are 4 s and three", "~4 ms at a T4's peak",
                 "T = 1024", "64 x 64 tiles", "16x32 bf16 tiles"):
        assert not typed_run_times(fine), fine
    for typed in ("2.24x faster", "v3 is 1.3x SDPA", "a 4x gain", "up to 3 ×"):
        assert typed_speedups(typed), typed
    for fine in ("64 x 64 tiles", "16x32 bf16 tiles", "x^2", "$1/(1-p)$", "a 2x overload run", "sm_75"):
        assert not typed_speedups(fine), fine


def test_every_analytic_phrase_is_still_in_a_notebook():
    text = "\n".join(source for path in NOTEBOOKS for _, source in markdown_cells(path))
    assert [p for p in ANALYTIC if p not in text] == [], "drop these from ANALYTIC: no markdown cell has them any more"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_markdown_types_no_run_time_and_no_measured_speedup(path):
    found = [f"cell {i}: run time {hit!r}" for i, source in markdown_cells(path) for hit in typed_run_times(source)]
    found += [f"cell {i}: speedup {hit!r}" for i, source in markdown_cells(path) for hit in typed_speedups(source)]
    assert found == [], ("typed in markdown; print it from the measured rows in a code cell (or, for a run time, "
                         "leave it to the README's table); an analytic factor goes into ANALYTIC with its reason:\n"
                         + "\n".join(found))


OF_BOUND = re.compile(r"(\d+(?:\.\d+)?)%\s+of\s+(?:its\s+|the\s+)?(?:bound|ideal|roofline)", re.IGNORECASE)


def _over_100(text: str) -> list[str]:
    """Lines of ``text`` that print a fraction of a bound above 100%: the "of bound" column of a bench.table (read
    at the header's column) or a sentence "N% of (its) bound / ideal / roofline"."""
    out, col = [], None
    for line in text.splitlines():
        if "of bound" in line and "median ms" in line:
            col = line.index("of bound")
            continue
        if col is not None:
            m = re.match(r"\s*(\d+)%", line[col:col + 9]) if len(line) > col else None
            if m and int(m[1]) > 100:
                out.append(line.strip())
            if not line.strip():
                col = None
        out += [line.strip() for m in OF_BOUND.finditer(line) if float(m[1]) > 100]
    return out


def test_the_bound_scan_catches_a_table_column_and_a_sentence():
    table = ("benchmark  x  provider  median ms  min ms  GFLOP/s  of bound  vs base\n"
             "enc        0  packed    1.0        1.0     330.9    111%      2.00x\n"
             "enc        0  fastpath  2.0        2.0     165.0    55%       1.00x\n")
    assert _over_100(table) == ["enc        0  packed    1.0        1.0     330.9    111%      2.00x"]
    assert _over_100("ran at 169% of bound here") and _over_100("reaches 104% of its ideal")
    assert not _over_100("reaches 71% of its ideal (noise 17%)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_no_committed_output_prints_a_fraction_of_a_bound_above_100_percent(path):
    """Issue 21's rule: a bound is this machine's fastest measured GEMM of the precision; where a run beats it, the
    bound is what gets fixed (btlib.bench measures it again), never printed as 110% of itself."""
    nb = nbformat.read(path, as_version=4)
    over = [f"cell {i}: {line}" for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
            for o in cell.get("outputs", []) for line in _over_100(str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", "")))]
    assert over == [], "fractions of a bound above 100% in committed outputs: re-run the notebook (the harness now " \
                       "re-measures a bound that a row beats) or fix the bound:\n" + "\n".join(over)


@pytest.mark.parametrize("page", ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))])
def test_the_readme_and_docs_print_no_fraction_of_a_bound_above_100_percent(page):
    assert _over_100((ROOT / page).read_text()) == []


ROUNDS_TYPED = re.compile(r"\b(?:[2-9]|two|three|four|five|six|seven|eight|nine|ten|a few|several)\s+(?:interleaved\s+)?rounds?\b"
                          r"|\bbest of (?:\d+|two|three|four|five) rounds\b|\bat least \d+ (?:timed )?calls\b"
                          r"|\b\d+ warm-?up calls?\b"
                          r"|\bruns? (?:[\w`]+ ){0,3}(?:twice|three times|four times|five times)\b", re.IGNORECASE)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_number_of_rounds_or_calls_is_typed(path):
    """The measurement protocol (rounds, warm-up, calls) is defined once, in btlib.bench.timing, and printed by the
    cells that time: a number of rounds typed in markdown goes stale the day the code changes (issue 37)."""
    nb = nbformat.read(path, as_version=4)
    typed = [(i, m.group(0)) for i, c in enumerate(nb.cells) if c.cell_type == "markdown"
             for m in ROUNDS_TYPED.finditer(c.source)]
    assert not typed, f"{path.name}: rounds or calls typed in markdown (print bench.protocol() instead): {typed}"
