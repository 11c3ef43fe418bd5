"""Issue 49 (8): every value of ``python -m btlib.embed`` is checked at start: one line on stderr, exit status 2,
no traceback, nothing loaded or written (was: OUT an existing file gave a FileExistsError traceback after the model
loaded; a negative --max-batch-tokens was refused only after meta.json was written)."""

import subprocess
import sys

import pytest

import btlib.pretrained
from btlib.embed import main


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("one\ntwo\n")
    return path


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    """A refusal at start loads no model."""
    def load(*a, **k):
        raise AssertionError("a bad value must be refused before the model loads")
    monkeypatch.setattr(btlib.pretrained, "load_pretrained", load)


def refused(argv, capsys) -> str:
    """main(argv)'s one-line refusal (exit status 2 whether argparse or btlib.embed refuses)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (code, err)
    return err


def test_out_an_existing_file(tmp_path, src, capsys):
    (tmp_path / "out.npy").write_text("not a folder")
    assert "out.npy exists and is not a folder" in refused([src, tmp_path / "out.npy"], capsys)
    assert (tmp_path / "out.npy").read_text() == "not a folder"


def test_out_an_existing_file_from_the_command_line(tmp_path, src):
    (tmp_path / "out").write_text("")
    r = subprocess.run([sys.executable, "-m", "btlib.embed", str(src), str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "is not a folder" in r.stderr, r.stderr


@pytest.mark.parametrize("extra, expect", [
    (["--shard-size", "-1"], "shard_size (--shard-size) must be a positive integer; got -1"),
    (["--shard-size", "0"], "shard_size (--shard-size) must be a positive integer; got 0"),
    (["--shard-size", "many"], "argument --shard-size: invalid int value: 'many'"),
    (["--max-batch-tokens", "-5"], "max_batch_tokens (--max-batch-tokens) must be a positive integer; got -5"),
    (["--max-batch-tokens", "0"], "max_batch_tokens (--max-batch-tokens) must be a positive integer; got 0"),
    (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    (["--gemm", "cublas"], "argument --gemm: invalid choice: 'cublas'"),
    (["--column", ""], "column (--column) must be a non-empty string"),
    (["--model", "no/such/folder"], "the model folder no/such/folder (--model) is not a folder"),
    (["--no-such-option"], "unrecognized arguments: --no-such-option"),
])
def test_bad_values_are_one_line_before_any_work(tmp_path, src, capsys, extra, expect):
    assert expect in refused([src, tmp_path / "out", *extra], capsys)
    assert not (tmp_path / "out").exists()


def test_bad_paths(tmp_path, src, capsys):
    assert "missing.txt is not a file" in refused([tmp_path / "missing.txt", tmp_path / "out"], capsys)
    assert "(a folder: name one file in it)" in refused([tmp_path, tmp_path / "out"], capsys)
    assert "c.txt is a file, so" in refused([src, src / "sub" / "out"], capsys)
    assert "the following arguments are required: out" in refused([src], capsys)
