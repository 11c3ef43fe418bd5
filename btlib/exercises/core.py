"""What every exercise check returns and the three ways an answer is judged (a number, a choice, a function).

A check prints one line, in one of four forms:

    exercise 09-2: not attempted yet (set answer_2)         the value is still the committed baseline
    exercise 09-2: correct: 300 requests/s x 0.040 s = ...   what was verified, the answer included
    exercise 09-2: not yet: above the answer: ...            which way, and the idea: never the answer
    exercise 05-1: cannot be checked here: needs triton      the machine lacks what the check runs

A measured answer (a prediction against a timing or a memory peak) is compared with what the check
cell measured on this machine, within a tolerance the verdict states; the hint says above or below,
not by how much, so the measurement stays the learner's to make.
"""

from __future__ import annotations

import inspect
import math
import textwrap
from dataclasses import dataclass
from typing import Callable, Sequence

__all__ = ["Verdict", "NotYet", "Unavailable", "not_attempted", "correct", "not_yet", "numeric", "choice",
           "is_starter", "guarded"]

NOT_ATTEMPTED, CORRECT, NOT_YET, UNAVAILABLE = "not attempted yet", "correct", "not yet", "cannot be checked here"


@dataclass(frozen=True)
class Verdict:
    """One exercise's result: ``state`` is one of the four forms above, ``text`` what follows it."""

    exercise: str
    state: str
    text: str

    @property
    def correct(self) -> bool:
        return self.state == CORRECT

    def __str__(self) -> str:
        if self.state == NOT_ATTEMPTED:
            return f"exercise {self.exercise}: {self.state} ({self.text})"
        return f"exercise {self.exercise}: {self.state}: {self.text}"


class NotYet(Exception):
    """Raised by a check cell's measure() when the learner's change cannot be measured (a build that fails,
    a kernel that differs from the reference): the message becomes the hint."""


class Unavailable(Exception):
    """Raised by a check cell's measure() when this machine lacks what the check needs (triton, a GPU)."""


def not_attempted(exercise: str, note: str) -> Verdict:
    return Verdict(exercise, NOT_ATTEMPTED, note)


def correct(exercise: str, what: str) -> Verdict:
    return Verdict(exercise, CORRECT, what)


def not_yet(exercise: str, hint: str) -> Verdict:
    return Verdict(exercise, NOT_YET, hint)


def guarded(exercise: str, fn: Callable[[], Verdict]) -> Verdict:
    """``fn()``, with NotYet and Unavailable from a measurement turned into their verdicts, and an error in the
    learner's code into a hint that quotes it (the error's first line says what to fix)."""
    try:
        return fn()
    except NotYet as e:
        return not_yet(exercise, str(e))
    except Unavailable as e:
        return Verdict(exercise, UNAVAILABLE, str(e))
    except Exception as e:  # the learner's code raised: the message is the most useful hint there is
        first = (str(e).splitlines() or [""])[0][:200]
        return not_yet(exercise, f"your code raised {type(e).__name__}: {first}")


def _number(value) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def numeric(exercise: str, value, name: str, measure: Callable[[], float], *, rel: float | None = None,
            abs_tol: float | None = None, unit: str = "", against: str = "the measurement",
            above: str, below: str, verified: Callable[[float, float], str] | None = None,
            note: str | None = None) -> Verdict:
    """A number against ``measure()`` (called only once ``value`` is set: it may take seconds or allocate what
    the learner predicts). Accepts |value - m| <= rel * m (or <= abs_tol); else the hint says above or below
    ``against`` and adds ``above`` or ``below``, the idea to revisit. ``note``: what "not attempted yet" adds."""
    if value is None:
        return not_attempted(exercise, note or f"set {name}")

    def judge() -> Verdict:
        x = _number(value)
        if x is None:
            return not_yet(exercise, f"{name} must be a finite number{f' ({unit})' if unit else ''}, not {value!r}")
        m = float(measure())
        tol = rel * abs(m) if rel is not None else abs_tol
        if abs(x - m) <= tol:
            bound = f"within {rel:.0%}" if rel is not None else f"within {abs_tol:g}{f' {unit}' if unit else ''}"
            return correct(exercise, verified(x, m) if verified else f"{name} = {x:g} {unit}".rstrip()
                           + f" is {bound} of {against} ({m:.3g})")
        side = "above" if x > m else "below"
        return not_yet(exercise, f"{name} is {side} {against}: {above if x > m else below}")

    return guarded(exercise, judge)


def choice(exercise: str, value, name: str, choices: Sequence[str], measure: Callable[[], tuple[str, str]],
           hints: dict[str, str]) -> Verdict:
    """One of ``choices`` against the outcome ``measure()`` returns as (outcome, what was seen). A wrong choice
    gets ``hints[value]``: the idea behind the choice made, worded so that it names no outcome."""
    if value is None:
        return not_attempted(exercise, f"set {name}")
    if value not in choices:
        return not_yet(exercise, f"{name} must be one of {', '.join(map(repr, choices))}, not {value!r}")

    def judge() -> Verdict:
        outcome, seen = measure()
        if outcome == value:
            return correct(exercise, f"{seen}, as you predicted")
        return not_yet(exercise, hints[value])

    return guarded(exercise, judge)


def _normalised(source: str) -> str:
    return "\n".join(line.rstrip() for line in textwrap.dedent(source).strip().splitlines() if line.strip())


def is_starter(fn: Callable, starter: str) -> bool:
    """True when ``fn``'s source is the committed starter (blank lines and indentation aside). A function whose
    source cannot be read (built with exec) counts as changed, so it is judged, never waved through."""
    try:
        return _normalised(inspect.getsource(fn)) == _normalised(starter)
    except (OSError, TypeError):
        return False
