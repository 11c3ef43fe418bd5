"""btlib.fold: the lab's detail one click away: the whole text to print(), one summary line in view in a notebook."""

from IPython.lib.pretty import pretty

from btlib import bench
from btlib.fold import Folded, fold


def test_a_folded_text_is_the_text_and_shows_its_summary():
    f = fold("how it was timed\nignored second line", "line one\n<b>two</b> & three")
    assert isinstance(f, str) and f == "line one\n<b>two</b> & three" and f.summary == "how it was timed"
    assert pretty(f) == "▸ how it was timed (2 lines folded; print() shows them)"
    html = f._repr_html_()
    assert html.startswith("<details><summary>how it was timed</summary>") and "&lt;b&gt;two&lt;/b&gt; &amp; three" in html
    assert "<details open" not in html  # folded until clicked


def test_describe_and_the_protocol_fold_in_a_notebook():
    d = bench.describe("attention_dense", providers=["reference"])
    assert isinstance(d, Folded) and d.startswith("attention_dense:") and "attention_dense" in d.summary
    note = bench.protocol_note(quick=False)
    assert str(note) == f"every benchmark below: {bench.protocol(quick=False)}" and len(note.summary) < 150
