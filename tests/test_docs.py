"""README.md is the front door and docs/ holds btlib's reference: the README stays short, every docs page opens
with one paragraph saying what it covers, and every relative link (a file, or a heading of one) resolves, in the
README, in docs/ and in the notebooks' markdown (issue 50, item 3). Reads files only; runs nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
PAGES = sorted((ROOT / "docs").glob("*.md"))
_LINK = re.compile(r"\]\(([^()\s]+)\)")  # [text](target): targets here hold no spaces or parentheses


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"`|\*\*", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor in a markdown text, outside fenced code."""
    prose = "".join(text.split("```")[0::2])
    return {slug(m[1]) for m in re.finditer(r"^#{1,6} (.+)$", prose, re.MULTILINE)}


def broken_links(text: str, source: Path) -> list[str]:
    """The relative links of ``text`` (a file at ``source``) whose file or heading does not exist."""
    prose = "".join(text.split("```")[0::2])
    broken = []
    for target in _LINK.findall(prose):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (source.parent / path).resolve() if path else source
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target}: {file.relative_to(ROOT)} has no heading #{anchor}")
    return broken


def test_the_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md is {lines} lines: move reference text to a page under docs/"


def test_the_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert PAGES, "docs/ holds no pages"
    missing = [p.name for p in PAGES if f"(docs/{p.name})" not in readme]
    assert missing == [], f"docs pages the README does not link: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_docs_page_opens_with_what_it_covers(page):
    """A title, then one paragraph of prose (no list, table, code or heading) before anything else."""
    blocks = page.read_text().split("\n\n")
    assert blocks[0].startswith("# ") and "\n" not in blocks[0], f"{page.name}: start with one '# Title' line"
    first = blocks[1]
    assert not re.match(r"```|[-*] |[|#<>]", first), f"{page.name}: the title's next block must be a paragraph of prose"
    assert len(first.split()) >= 25, f"{page.name}: say what the page covers in its first paragraph"


@pytest.mark.parametrize("page", [ROOT / "README.md", *PAGES], ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    assert broken_links(page.read_text(), page) == []


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("[0-9]*.ipynb")), ids=lambda p: p.stem[:2])
def test_notebook_links_into_the_readme_and_docs_resolve(path):
    """A notebook that links a README section breaks when the section moves to docs/: the link must follow."""
    nb = nbformat.read(path, as_version=4)
    text = "\n\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    local = [t for t in _LINK.findall(text) if "README" in t or "docs/" in t]
    broken = broken_links("".join(f"]({t})" for t in local), path)
    assert broken == [], f"{path.name}: {broken}"


def test_slug_is_githubs():
    assert slug("btlib in your code") == "btlib-in-your-code"
    assert slug("Limits, status codes and errors") == "limits-status-codes-and-errors"
    assert slug("`encode`'s outputs") == "encodes-outputs"
    assert slug("Set-up") == "set-up"
