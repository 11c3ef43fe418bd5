"""The workbook's exercise checks: every notebook's check cell calls :func:`check` and prints its verdict.

    >>> from btlib import exercises
    >>> print(exercises.check("09-2", None))
    exercise 09-2: not attempted yet (set answer_2)

One function per exercise, named by notebook and number ("06-1" is notebook 06's first exercise), in
checks_01_05 and checks_06_09; the verdicts and the judging of numbers, choices and functions in core.
"""

from __future__ import annotations

from . import checks_01_05 as _a
from . import checks_06_09 as _b
from .core import NotYet, Unavailable, Verdict

__all__ = ["check", "CHECKS", "Verdict", "NotYet", "Unavailable"]

CHECKS = {name.removeprefix("ex_").replace("_", "-"): getattr(module, name)
          for module in (_a, _b) for name in module.__all__ if name.startswith("ex_")}


def check(exercise: str, *args, **kwargs) -> Verdict:
    """The verdict of exercise ``exercise`` ("01-1" ... "09-3") on the learner's values (see each ex_ function)."""
    if exercise not in CHECKS:
        raise ValueError(f"no exercise {exercise!r}: the exercises are {', '.join(CHECKS)}")
    return CHECKS[exercise](*args, **kwargs)
