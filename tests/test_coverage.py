"""btlib.pretrained.coverage: docs/families.md's "model families" table is the registry's, and every row names real tests.

The table is written by ``python .ci/workbook.py readme`` (workbook_readme.render_families); this test fails,
with a diff, while docs/families.md's block differs from coverage_table(), so a family added to FAMILIES without
regenerating the page (or a hand edit of the table) is caught.
"""

from pathlib import Path

import pytest
import workbook_readme as wr

from btlib.pretrained import FAMILIES, coverage_table
from btlib.pretrained.coverage import family

ROOT = Path(__file__).resolve().parents[1]


def test_families_page_table_is_the_generated_one():
    text = (ROOT / "docs" / "families.md").read_text()
    begin, end = wr.markers(wr.FAMILIES)
    assert text.count(begin) == 1 and text.count(end) == 1, f"docs/families.md must hold {begin!r} and {end!r} once each"
    new = wr.render_families(text, {k: v for s in wr.load(ROOT / "notebooks") for k, v in s.family_speeds.items()})
    assert new == text, wr.diff(text, new, "docs/families.md") + "\nrun: python .ci/workbook.py readme"


def test_every_row_is_complete_and_names_existing_tests():
    names = [f.name for f in FAMILIES]
    assert len(names) == len(set(names))
    for f in FAMILIES:
        assert f.loads and f.reference and f.precisions and 0 < f.fp32_tol <= 1e-3, f.name
        missing = [t for t in f.tests if not (ROOT / t).is_file()]
        assert f.tests and not missing, f"{f.name}: no such test file {missing}"
    for name in ("bert", "roberta", "xlm-roberta", "distilbert", "camembert", "electra", "modernbert", "cross-encoder heads"):
        assert f"| {name} |" in coverage_table()
    with pytest.raises(KeyError, match="no family 'gpt2'"):
        family("gpt2")


def test_the_speed_column_comes_from_the_families_summary_a_notebook_printed():
    printed = """family      shape               transformers ms  packed ms  packed vs transformers    predicted  >= 2x  error
----------  ------------------  ---------------  ---------  ------------------------  ---------  -----  -------
camembert   12 x 768, FFN 3072  1729             635        2.72x faster (noise ±7%)  2.95x      yes    1.1e-06
gte         -                   -                -          packed skipped: no transformers  -  -  -
"""
    speeds = wr.family_speeds(printed)
    assert speeds == {"camembert": "2.72x faster (noise ±7%); FLOP prediction 2.95x; 12 x 768, FFN 3072"}
    table = coverage_table(speeds)
    assert table.splitlines()[0].endswith("| packed vs transformers (workbook corpus, batch 32) |")
    row = next(line for line in table.splitlines() if line.startswith("| camembert |"))
    assert row.endswith("| 2.72x faster (noise ±7%); FLOP prediction 2.95x; 12 x 768, FFN 3072 |")
    assert "family_speed --set \"x_vals=['gte']\"" in next(line for line in table.splitlines() if line.startswith("| gte |"))
    assert wr.family_speeds("no table here") == {}


def test_a_family_is_a_row_load_pretrained_reads_config_once_and_looks_the_row_up(tmp_path, monkeypatch):
    """Every model_type belongs to one row, and each row that load_pretrained serves carries its loader;
    load_pretrained reads the Transformer's config.json once (it read it up to 5 times: once per family test, then
    the loader) and calls the row's loader with what it read."""
    import dataclasses
    import sys

    import btlib.pretrained as bp
    from btlib.pretrained import coverage
    from btlib.pretrained.folders.checkpoint import MODEL_TYPES
    from btlib.pretrained.folders.rotary_bert_config import MODEL_TYPES as ROTARY

    sys.path.insert(0, str(ROOT / "tests"))
    from st_folders import write_hf

    types = [t for f in FAMILIES for t in f.model_types]
    assert len(types) == len(set(types)), "a model_type in two rows"
    assert set(MODEL_TYPES) | set(ROTARY) | {"modernbert", "qwen3"} == set(types)
    assert all(callable(f.load) for f in FAMILIES if f.model_types)
    assert coverage.family_of("gpt2") is None and coverage.family_of(None) is None

    reads = []
    real = Path.read_text

    def counted(self, *a, **k):
        if self.name == "config.json" and self.parent.name != "1_Pooling":
            reads.append(self)
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", counted)
    bp.load_pretrained()
    assert len(reads) == 1
    folder = write_hf(tmp_path / "distil", "distilbert")
    reads.clear()
    calls = []
    row = coverage.family("distilbert")
    traced = dataclasses.replace(row, load=lambda plan, **kw: (calls.append(kw["config"][0]["model_type"]), row.load(plan, **kw))[1])
    monkeypatch.setattr(coverage, "FAMILIES", tuple(traced if f is row else f for f in FAMILIES))
    model = bp.load_pretrained(folder)
    assert calls == ["distilbert"] and type(model).__name__ == "PretrainedEncoder" and len(reads) == 1
    (folder / "config.json").write_text('{"model_type": "gpt2"}')  # no row: the BERT loader refuses it by name
    with pytest.raises(bp.CheckpointError, match="gpt2"):
        bp.load_pretrained(folder)
