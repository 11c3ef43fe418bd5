"""What tests/fuzz_corpus.py does to a finished corpus folder's bytes, and what must follow.

Shards (:func:`damage_shard`): truncated, emptied, a row short, float64, garbage, one bit of one float flipped,
deleted, swapped (two shards' bytes exchanged, names kept), moved (another shard's file renamed to this shard's
index, its own gone). meta.json (:func:`edit_meta`): a shard's sha256 changed or null, no "sums", a shard's rows hash
changed, "rows" +1 / 0 / doubled / a string, "dim" changed, the shard list one short, another GEMM path recorded, not
JSON, cut short, a JSON list, deleted; or a setting changed (shard_size, column, max_batch_tokens, model).

The rule (:func:`check`), from btlib/embed_shards.py's docstring: read_embeddings(out) gives the rows it gave before,
bit for bit (where nothing was lost: another GEMM path recorded, two equal shards swapped), or raises naming the
shard or meta.json and saying "run the same command again"; then the same command gives those bits back. A changed
setting is the one exception: the folder then holds another job as far as anything can tell, and the same command
refuses it, naming the setting. An empty corpus reads back as (0, dim) with meta.json's dim: no shard can check an
edited one (meta.json has no checksum of its own), so its width is not held to the rule.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

import numpy as np

SETTINGS = ("shard_size", "column", "max_batch_tokens", "model")


def damage_shard(rng: random.Random, out: Path) -> tuple[str, Path, list[str]]:
    """Damage one shard of ``out``: (how, the shard, what an error may name: a shard's file, or the count of those
    missing)."""
    shards = sorted(out.glob("shard-*.npy"))
    path = rng.choice(shards)
    others = [p for p in shards if p != path]
    how = rng.choice(["truncated", "empty", "short", "float64", "garbage", "flipped", "deleted"] +
                     (["swapped", "moved"] if others else []))
    a = np.load(path)
    if how == "truncated":
        path.write_bytes(path.read_bytes()[: rng.randint(1, path.stat().st_size - 1)])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "short":
        np.save(path, a[:-1] if len(a) > 1 else np.zeros((2, a.shape[1]), np.float32))
    elif how == "float64":
        np.save(path, a.astype(np.float64))
    elif how == "garbage":
        path.write_bytes(b"not a numpy file at all" * 3)
    elif how == "flipped":  # one bit of one float: still a whole array of the right shape, only its sha256 tells
        data = bytearray(path.read_bytes())
        data[len(data) - 1 - rng.randrange(a.nbytes)] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
    elif how == "swapped":
        other = rng.choice(others)
        mine, theirs = path.read_bytes(), other.read_bytes()
        path.write_bytes(theirs)
        other.write_bytes(mine)
    elif how == "moved":  # shard j's file under shard k's index (its name still carries j's rows hash)
        other = rng.choice(others)
        path.unlink()
        other.rename(path.with_name(path.name[:12] + other.name[12:]))
    else:
        path.unlink()
    names = [path.name, "lacks"] + ([other.name, path.name[:12] + other.name[12:]] if how in ("swapped", "moved") else [])
    return how, path, names


def edit_meta(rng: random.Random, out: Path) -> str:
    """Edit ``out``/meta.json: what was done."""
    path = out / "meta.json"
    meta = json.loads(path.read_text())
    n = len(meta["shards"])
    how = rng.choice(["a sum", "a null sum", "no sums", "a rows hash", "rows", "dim", "a shard fewer", "the GEMM path",
                      "not JSON", "cut short", "a JSON list", "deleted", "setting"])
    if how in ("a sum", "a null sum", "a rows hash", "a shard fewer") and n == 0:
        how = "rows"
    if how == "a sum":
        meta["sums"][rng.randrange(n)] = "%064x" % rng.getrandbits(256)
    elif how == "a null sum":
        meta["sums"][rng.randrange(n)] = None
    elif how == "no sums":
        del meta["sums"]
    elif how == "a rows hash":
        meta["shards"][rng.randrange(n)] = "%016x" % rng.getrandbits(64)
    elif how == "rows":
        meta["rows"] = rng.choice([meta["rows"] + 1, 0, 2 * meta["rows"] + 2, str(meta["rows"])])
    elif how == "dim":
        meta["dim"] = rng.choice([meta["dim"] + 1, 1, 0])
    elif how == "a shard fewer":
        meta["shards"], meta["sums"] = meta["shards"][:-1], meta["sums"][:-1]
    elif how == "the GEMM path":
        meta["gemm"] = rng.choice(["torch", "onednn", "btlib", "mkl"])
    elif how == "setting":
        name = rng.choice(SETTINGS)
        meta[name] = {"shard_size": meta["shard_size"] + 1, "column": "other", "max_batch_tokens": 8,
                      "model": "another"}[name]
        how = f"setting {name}"
    if how == "not JSON":
        path.write_text("{not json")
    elif how == "cut short":
        path.write_bytes(path.read_bytes()[: rng.randint(0, path.stat().st_size - 1)])
    elif how == "a JSON list":
        path.write_text("[]")
    elif how == "deleted":
        path.unlink()
    else:
        path.write_text(json.dumps(meta))
    return how


def check(how: str, names: list[str], out: Path, read: Callable, rerun: Callable[[], dict], good: np.ndarray) -> str | None:
    """The module docstring's rule after ``how``: None if it holds, else the finding. names: what an error may name."""
    try:
        got = read(out)
        if not (got.shape == good.shape and np.array_equal(got, good)) and (len(got), len(good)) != (0, 0):
            return f"after {how}, read_embeddings gave other rows {got.shape} (were {good.shape}) without a word"
    except (ValueError, FileNotFoundError) as e:
        if not any(n in str(e) for n in names):
            return f"the error after {how} names none of {names}: {e}"
        if "run the same command again" not in str(e):
            return f"the error after {how} gives no advice: {e}"
    setting = how.removeprefix("setting ") if how.startswith("setting ") else None
    try:
        r = rerun()
    except ValueError as e:
        return None if setting and setting in str(e) else f"the same command after {how} refused: {e}"
    if setting:
        return f"the same command after {how} in meta.json ran on ({r['redone']}): it holds another job's settings"
    again = read(out)
    if not (again.shape == good.shape and np.array_equal(again, good)):
        return f"the same command after {how}: the bits differ from before ({r['redone']})"
    return None
