"""Text a click away: one summary line in view, the whole folded under it (the lab's detail, out of the lesson's way).

    display(fold("sdpa_backends: what runs, checked how, timed how", text))   # a notebook cell
    print(fold(...))                                                          # a terminal: the whole text

A :class:`Folded` is the text itself (a ``str``: ``print``, ``in`` and ``splitlines`` see all of it), and shows in a
notebook as an HTML ``<details>`` element, folded, whose summary is the one line (JupyterLab, Colab, VS Code, nbviewer
and GitHub render it); a front end that shows text only gets the summary line and how to print the rest.
"""

from __future__ import annotations

import html

__all__ = ["Folded", "fold"]


class Folded(str):
    """``str`` of the whole text, with ``summary`` (one line) shown in view and the text folded under it."""

    summary: str

    def __new__(cls, summary: str, text: str):
        self = super().__new__(cls, text)
        self.summary = summary.strip().splitlines()[0] if summary.strip() else "details"
        return self

    def _repr_html_(self) -> str:
        return (f"<details><summary>{html.escape(self.summary)}</summary>"
                f"<pre style=\"font-size: 85%\">{html.escape(str(self))}</pre></details>")

    def _repr_pretty_(self, p, cycle) -> None:  # IPython's text/plain: the summary alone
        p.text(f"▸ {self.summary} ({len(self.splitlines())} lines folded; print() shows them)")

    def __repr__(self) -> str:
        return f"Folded({self.summary!r}, {len(self.splitlines())} lines)"


def fold(summary: str, text: str) -> Folded:
    """``text`` under the one-line ``summary`` (see the module docstring)."""
    return Folded(summary, text)
