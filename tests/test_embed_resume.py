"""python -m btlib.embed keyed on its input's content: an edited input redoes the shards whose rows changed, a damaged
shard is named and redone, a folder of mixed versions is refused, and every run of one job takes one GEMM path."""

import json

import numpy as np
import pytest
import torch

from btlib.embed import embed_file, main, read_embeddings
from model_folder import needs_model

pytestmark = needs_model

KW = dict(shard_size=4, max_batch_tokens=64, progress=False)
ROWS = [f"row {i}: " + " ".join(["packed", "tokens", "cost", "their", "length"][: 1 + i % 5]) for i in range(10)]


@pytest.fixture(autouse=True)
def jobs(tmp_path, monkeypatch):
    """This test's own record of GEMM paths per job (btlib.embed.jobs_file), not the checkout's."""
    monkeypatch.setattr("btlib.embed.jobs_file", lambda: tmp_path / "jobs.json", raising=False)


def write(path, rows):
    path.write_text("".join(r + "\n" for r in rows))
    return path


def stop_after(n):
    def hook(k):
        if k == n:
            raise KeyboardInterrupt
    return hook


def shard(out, k):
    (path,) = out.glob(f"shard-{k:05d}*.npy")
    return path


def assert_encodes(out, model, rows):
    got = read_embeddings(out)
    assert got.shape == (len(rows), 384) and json.loads((out / "meta.json").read_text())["rows"] == len(rows)
    torch.testing.assert_close(torch.from_numpy(got), model.encode(rows), atol=1e-6, rtol=0)


def test_an_edited_input_redoes_the_shards_whose_rows_changed(tmp_path, model):
    """Was: "0 written, 6 already done" after an edit that kept the row count; the edited row kept its old vector."""
    src = write(tmp_path / "c.txt", ROWS)
    embed_file(src, tmp_path / "out", **KW)
    kept = np.load(shard(tmp_path / "out", 0))
    edited = ROWS[:5] + ["an entirely different sentence about cats"] + ROWS[6:]
    r = embed_file(write(src, edited), tmp_path / "out", **KW)
    assert (r["written"], r["skipped"], r["redone"]) == (1, 2, {1: "its rows changed"})
    assert np.array_equal(np.load(shard(tmp_path / "out", 0)), kept)
    assert_encodes(tmp_path / "out", model, edited)


def test_rows_added_or_removed_are_followed(tmp_path, model):
    """Was: a changed row count was refused as a changed setting."""
    src = write(tmp_path / "c.txt", ROWS)
    embed_file(src, tmp_path / "out", **KW)
    r = embed_file(write(src, ROWS + ["one more", "and another"]), tmp_path / "out", **KW)
    assert (r["rows"], r["written"], r["skipped"]) == (12, 1, 2)  # shard 2 grew from 2 to 4 rows
    assert_encodes(tmp_path / "out", model, ROWS + ["one more", "and another"])
    embed_file(write(src, ROWS[:3]), tmp_path / "out", **KW)
    assert len(list((tmp_path / "out").glob("shard-*.npy"))) == 1  # the old shards 1 and 2 are deleted
    assert_encodes(tmp_path / "out", model, ROWS[:3])


def test_killed_then_edited_then_resumed_mixes_nothing(tmp_path, model):
    """Was: old and new rows mixed after a kill, an edit and a resume."""
    src = write(tmp_path / "c.txt", ROWS)
    with pytest.raises(KeyboardInterrupt):
        embed_file(src, tmp_path / "out", **KW, on_shard=stop_after(1))
    edited = ["changed first row"] + ROWS[1:9] + ["changed last row"]
    r = embed_file(write(src, edited), tmp_path / "out", **KW)
    assert (r["written"], r["skipped"], r["redone"]) == (2, 1, {0: "its rows changed"})
    assert_encodes(tmp_path / "out", model, edited)


def test_a_folder_of_two_input_versions_is_refused_until_run_again(tmp_path, model):
    """Was: a folder holding shards of two versions of the input (old code: killed mid-way after an edit) was read as
    one. Now a run deletes the shards of the old version before it writes meta.json (a kill leaves missing shards,
    never old ones), and read_embeddings refuses a shard whose rows' hash is not meta.json's (say, one put back from
    a copy of the folder), naming it."""
    src = write(tmp_path / "c.txt", ROWS)
    embed_file(src, tmp_path / "out", **KW)
    old_shard = shard(tmp_path / "out", 2).read_bytes(), shard(tmp_path / "out", 2).name
    edited = ["new 0"] + ROWS[1:9] + ["new 9"]
    with pytest.raises(KeyboardInterrupt):
        embed_file(write(src, edited), tmp_path / "out", **KW, on_shard=stop_after(0))
    with pytest.raises(FileNotFoundError, match=r"lacks 1 of 3 shards \(first: 2\): run the same command again"):
        read_embeddings(tmp_path / "out")
    (tmp_path / "out" / old_shard[1]).write_bytes(old_shard[0])
    with pytest.raises(ValueError, match=rf"{old_shard[1]} holds rows of another version of c\.txt.*run the same command again"):
        read_embeddings(tmp_path / "out")
    assert main([str(src), str(tmp_path / "out"), "--shard-size", "4", "--max-batch-tokens", "64", "--quiet"]) == 0
    assert_encodes(tmp_path / "out", model, edited)


@pytest.mark.parametrize("damage", ["short", "truncated", "empty", "float64"])
def test_a_damaged_shard_is_named_and_the_advice_mends_it(tmp_path, model, capsys, damage):
    """Was: a shard saved short (3 of 4 rows) was read silently as (9, 384); a truncated one raised numpy's own error."""
    src = write(tmp_path / "c.txt", ROWS)
    embed_file(src, tmp_path / "out", **KW)
    good = read_embeddings(tmp_path / "out")
    path = shard(tmp_path / "out", 1)
    if damage == "short":
        np.save(path, good[4:7])
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        np.save(path, good[4:8].astype(np.float64))
    with pytest.raises(ValueError, match=rf"{path.name} is damaged \(.+\): run the same command again, which redoes it"):
        read_embeddings(tmp_path / "out")
    assert main([str(src), str(tmp_path / "out"), "--shard-size", "4", "--max-batch-tokens", "64", "--quiet"]) == 0
    assert "shard 1 redone: it was damaged" in capsys.readouterr().out
    assert np.array_equal(read_embeddings(tmp_path / "out"), good)


@pytest.mark.parametrize("first, then", [("onednn", "torch"), ("torch", "onednn")])
def test_every_run_of_one_job_takes_its_first_gemm_path(tmp_path, monkeypatch, capsys, first, then):
    """Was: two uninterrupted runs into two folders differed by up to 2.3e-7 (each process measured its own GEMM path).
    The job's path is recorded by content and settings (btlib.embed.jobs_file) and reused, also into a fresh folder."""
    src = write(tmp_path / "c.txt", ROWS)
    args = [str(src), "--shard-size", "4", "--max-batch-tokens", "64", "--quiet"]
    monkeypatch.setenv("BTLIB_GEMM", first)
    assert main([args[0], str(tmp_path / "a"), *args[1:]]) == 0
    assert f"GEMM path {first}" in capsys.readouterr().out
    monkeypatch.setenv("BTLIB_GEMM", then)  # another process would measure another path
    assert main([args[0], str(tmp_path / "b"), *args[1:]]) == 0
    out = capsys.readouterr().out
    assert f"GEMM path {first}" in out and "reused" in out, out
    assert np.array_equal(read_embeddings(tmp_path / "a"), read_embeddings(tmp_path / "b"))
    assert main([args[0], str(tmp_path / "c"), *args[1:], "--gemm", then]) == 0  # pinned
    assert f"GEMM path {then}" in capsys.readouterr().out
    assert json.loads((tmp_path / "c" / "meta.json").read_text())["gemm"] == then
