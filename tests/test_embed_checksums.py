"""Issue 49 (4): a corpus job's shards carry the sha256 of their bytes in meta.json, checked on read and on resume.

A flipped bit inside a float keeps the file a whole (rows, d) float32 array, so neither the name (the rows' hash)
nor the shape can tell: only the bytes can. read_embeddings names the shard and says to run the same command again;
that run names it and redoes it. A meta.json of an older btlib.embed (no checksums) is refused on read and its
shards are redone on resume, as unverified.
"""

import hashlib
import json

import numpy as np
import pytest

from btlib.embed import embed_file, main, read_embeddings
from model_folder import needs_model

TESTED_HERE = ["btlib.embed_shards"]  # through btlib.embed, which runs it and re-exports read_embeddings
pytestmark = needs_model

KW = dict(shard_size=4, max_batch_tokens=64, progress=False)
ROWS = [f"row {i}: " + " ".join(["a", "corpus", "job", "writes", "shards"][: 1 + i % 5]) for i in range(10)]
ARGS = ["--shard-size", "4", "--max-batch-tokens", "64", "--quiet"]


@pytest.fixture(autouse=True)
def jobs(tmp_path, monkeypatch):
    """This test's own record of GEMM paths per job (btlib.embed.jobs_file), not the checkout's."""
    monkeypatch.setattr("btlib.embed.jobs_file", lambda: tmp_path / "jobs.json")


@pytest.fixture
def job(tmp_path):
    """(input file, output folder, its embeddings) of a finished run."""
    src = tmp_path / "c.txt"
    src.write_text("".join(r + "\n" for r in ROWS))
    embed_file(src, tmp_path / "out", **KW)
    return src, tmp_path / "out", read_embeddings(tmp_path / "out")


def shard(out, k):
    (path,) = out.glob(f"shard-{k:05d}-*.npy")
    return path


def meta(out):
    return json.loads((out / "meta.json").read_text())


def flip_a_bit(path, rows=4, d=384):
    """Flip bit 3 of a float's low byte in the data part of a .npy: the file stays a whole (rows, d) float32 array."""
    data = bytearray(path.read_bytes())
    data[len(data) - 4 * rows * d + 4 * (d + 7)] ^= 0x08  # row 1, column 7
    path.write_bytes(bytes(data))
    a = np.load(path)
    assert a.shape == (rows, d) and a.dtype == np.float32  # the old checks could not see it


def test_meta_records_each_shards_sha256(job):
    _, out, _ = job
    m = meta(out)
    assert m["sums"] == [hashlib.sha256(shard(out, k).read_bytes()).hexdigest() for k in range(3)]


def test_a_flipped_bit_is_named_on_read_and_mended_by_the_same_command(job, capsys):
    """Was: read_embeddings returned the flipped float, and a rerun kept the shard ("0 written, 3 already done")."""
    src, out, clean = job
    path = shard(out, 1)
    flip_a_bit(path)
    with pytest.raises(ValueError, match=rf"{path.name} is damaged \(its bytes differ from the sha256 meta.json "
                                         r"recorded.*\): run the same command again, which redoes it"):
        read_embeddings(out)
    assert main([str(src), str(out), *ARGS]) == 0
    printed = capsys.readouterr().out
    assert "shard 1 redone: it was damaged (its bytes differ from the sha256" in printed
    assert "1 written, 2 already done" in printed
    assert np.array_equal(read_embeddings(out), clean)


def test_a_shard_whose_sum_was_never_recorded_is_refused_then_redone(job):
    """A run stopped between a shard's rename and meta.json's update leaves the shard unverified."""
    src, out, clean = job
    m = meta(out)
    m["sums"][2] = None
    (out / "meta.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match=rf"{shard(out, 2).name} has no checksum in meta.json.*run the same command again"):
        read_embeddings(out)
    r = embed_file(src, out, **KW)
    assert (r["written"], r["skipped"]) == (1, 2) and r["redone"][2].startswith("no checksum was recorded")
    assert np.array_equal(read_embeddings(out), clean)


def test_an_older_meta_without_checksums_is_refused_then_every_shard_redone(job):
    src, out, clean = job
    m = meta(out)
    del m["sums"]
    (out / "meta.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"written by an older btlib.embed \(no shard checksums.*run the same command "
                                         r"again, which redoes it"):
        read_embeddings(out)
    r = embed_file(src, out, **KW)
    assert (r["written"], r["skipped"]) == (3, 0) and all(why.startswith("no checksum") for why in r["redone"].values())
    assert np.array_equal(read_embeddings(out), clean)
    assert embed_file(src, out, **KW)["skipped"] == 3  # verified now: kept


def edit_meta(out, **fields):
    (out / "meta.json").write_text(json.dumps({**meta(out), **fields}))


@pytest.mark.parametrize("edit", ["one shard fewer", "rows past the shards"])
def test_a_meta_json_whose_shards_do_not_cover_its_rows_is_refused_not_read_short(job, edit):
    """Campaign 3 (issue 49): read_embeddings read the shards meta.json listed, whatever its rows said: with its last
    shard dropped from "shards" and "sums" (or "rows" past what its shards hold, all of them full), 8 of 10 rows came
    back without a word. Now meta.json is named; the same command rewrites it from the input."""
    src, out, good = job
    if edit == "one shard fewer":
        m = meta(out)
        edit_meta(out, shards=m["shards"][:-1], sums=m["sums"][:-1])
    else:
        edit_meta(out, rows=12, shards=meta(out)["shards"][:2], sums=meta(out)["sums"][:2])  # 2 full shards, "12 rows"
    with pytest.raises(ValueError, match=r"meta\.json.*run the same command again"):
        read_embeddings(out)
    embed_file(src, out, **KW)
    assert np.array_equal(read_embeddings(out), good)


@pytest.mark.parametrize("fields", [{"rows": 0}, {"rows": "10"}, {"rows": -1}, {"shard_size": 0}, {"dim": 0},
                                    {"shards": "not a list"}, {"sums": [None, 5, "x"]}])
def test_a_meta_json_of_wrong_values_is_named_on_read(job, fields):
    """rows 0 was an IndexError, rows "10" a TypeError, shard_size 0 'range() arg 3 must not be zero': now a
    ValueError naming meta.json and saying what mends it."""
    _, out, _ = job
    edit_meta(out, **fields)
    with pytest.raises(ValueError, match=r"meta\.json"):
        read_embeddings(out)


@pytest.mark.parametrize("damage", ["not JSON", "cut short", "a JSON list", "deleted"])
def test_an_unreadable_meta_json_is_mended_by_the_same_command(job, damage):
    """An unreadable meta.json (edited by hand, or a disk's damage: btlib writes it whole or not at all) made every
    later run refuse ("use a new folder"): now, as a missing one, it is named and every shard redone, unverified."""
    src, out, good = job
    path = out / "meta.json"
    if damage == "not JSON":
        path.write_text("{not json")
    elif damage == "cut short":
        path.write_bytes(path.read_bytes()[:40])
    elif damage == "a JSON list":
        path.write_text("[]")
    else:
        path.unlink()
    with pytest.raises((ValueError, FileNotFoundError), match=r"meta\.json.*run the same command again"):
        read_embeddings(out)
    r = embed_file(src, out, **KW)
    assert r["written"] == 3 and all("meta.json" in why for why in r["redone"].values()), r["redone"]
    assert np.array_equal(read_embeddings(out), good)
