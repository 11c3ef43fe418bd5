"""The folder a corpus job writes (``python -m btlib.embed``): shards named by their rows, meta.json, checksums.

    OUT/shard-00000-<rows hash>.npy ...   each a (rows, d) float32 array of --shard-size consecutive rows
    OUT/meta.json                         the settings, "shards": every shard's rows hash, "sums": every shard's sha256

A shard's name says which rows it holds (:func:`rows_hash`: an edited input renames the shards whose rows changed);
its sha256 in meta.json says its bytes are the ones written (a flipped bit inside a float keeps the file's shape, so
only the bytes can tell). The sum is of the whole .npy file, recorded right after the shard is on disk: a shard
without one (its run was stopped between the two, or an older btlib.embed wrote it) is unverified and redone.
meta.json is checked as well: its rows, shard size and shard list must agree (or a shard dropped from the list went
unread), and one that is missing or unreadable leaves nothing to verify, so a run redoes every shard.

    old, lost = previous_meta(out)                                # what a run resumes from, or why it redoes all
    keep, redone = sort_out(out, hashes, sizes, d, old, lost)     # at the start of a run: what may be kept
    sums[k] = write_shard(out, k, hashes[k], emb); write_meta(out, meta)   # each shard, then its sum
    read_embeddings(out) -> (rows, d) float32                        # every shard checked: name, shape, sha256

Checking a shard reads it whole: sha256 runs at ~1 GB/s, so a resumed run of 1M MiniLM rows (1.5 GB of shards)
spends ~1.5 s verifying what it keeps.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = ["rows_hash", "shard_name", "shard_sizes", "read_meta", "previous_meta", "write_meta", "write_shard", "sort_out",
           "read_embeddings"]

_SHARD = re.compile(r"shard-(\d{5,})(?:-([0-9a-f]{16}))?\.npy")
_RERUN = "run the same command again, which redoes it"
_REDO_ALL = "run the same command again, which redoes every shard (nothing in the folder can be verified without it)"
_REWRITE = "run the same command again, which rewrites it from the input (or names the setting that changed)"


def rows_hash(texts: Sequence[str], column: str) -> str:
    """First 16 hex digits of the sha256 of a shard's rows: the column, then each text as UTF-8, length-prefixed
    (so ["ab", ""] and ["a", "b"] differ)."""
    h = hashlib.sha256(b"btlib.embed rows 1\0")
    for s in (column, *texts):
        b = s.encode("utf-8")
        h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()[:16]


def shard_name(k: int, h: str) -> str:
    return f"shard-{k:05d}-{h}.npy"


def shard_sizes(rows: int, shard_size: int) -> list[int]:
    return [min(shard_size, rows - i) for i in range(0, rows, shard_size)]


def read_meta(out: Path) -> dict:
    """OUT/meta.json as a dict; FileNotFoundError where it is missing, ValueError where it is not a JSON object (each
    saying that the same command redoes every shard: nothing in OUT can be verified without it)."""
    path = out / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"{out} has no meta.json (not a folder python -m btlib.embed wrote, its run never "
                                f"started, or it was deleted): {_REDO_ALL}")
    try:
        meta = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:  # written atomically, so edited by hand or damaged on disk
        raise ValueError(f"{path} is not readable JSON ({e}): {_REDO_ALL}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path} holds a JSON {type(meta).__name__}, not an object: {_REDO_ALL}")
    return meta


def previous_meta(out: Path) -> tuple[dict, str | None]:
    """(the meta.json a run resumes from, or {}; why every shard on disk is redone, or None). A missing or unreadable
    meta.json leaves nothing to verify a shard against, so a run redoes them all (it refused an unreadable one, and
    the folder had to be given up; a deleted one was redone as "the GEMM path changed (None at None threads)")."""
    try:
        return read_meta(out), None
    except FileNotFoundError:
        why = "meta.json is missing"
    except ValueError:
        why = "meta.json is not a readable JSON object"
    if not any(out.glob("shard-*.npy")):
        return {}, None  # a new folder, or one whose run never wrote a shard
    return {}, f"{why}, so it cannot be verified"


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX and Windows: readers see the old file or the whole new one


def write_meta(out: Path, meta: dict) -> None:
    _write_atomic(out / "meta.json", json.dumps(meta, indent=1).encode())


def write_shard(out: Path, k: int, h: str, emb: np.ndarray) -> str:
    """Write shard k (rows hash h) whole or not at all; returns the sha256 of the bytes written."""
    buf = io.BytesIO()
    np.save(buf, emb)
    data = buf.getvalue()
    _write_atomic(out / shard_name(k, h), data)
    return hashlib.sha256(data).hexdigest()


def _sums(meta: dict, n: int) -> list:
    """meta.json's shard checksums, one per shard (None: none recorded); [None] * n where it has none (older btlib.embed)."""
    sums = meta.get("sums")
    return sums if isinstance(sums, list) and len(sums) == n else [None] * n


def _damage(data: bytes, rows: int, d: int, want: object) -> str | None:
    """Why a shard file's bytes are not the (rows, d) float32 array whose sha256 is ``want`` (None: they are)."""
    try:
        a = np.load(io.BytesIO(data))
    except (OSError, ValueError, EOFError) as e:  # truncated, empty, a pickle, a header cut short
        return f"{type(e).__name__}: {e}"
    if a.dtype != np.float32 or a.shape != (rows, d):
        return f"{a.dtype} {a.shape}, expected float32 {(rows, d)}"
    if hashlib.sha256(data).hexdigest() != want:
        return "its bytes differ from the sha256 meta.json recorded for it: changed on disk since it was written"
    return None


def sort_out(out: Path, hashes: list[str], sizes: list[int], d: int, old: dict,
             redo_all: str | None) -> tuple[dict[int, str], dict[int, str]]:
    """Delete what a run must not keep (a killed run's temporary files, shards of other rows or of another GEMM path,
    unverified or damaged ones, shards past the end); return ({k: sha256 of each shard kept}, {k: why k is redone}).
    redo_all: why no shard on disk may be kept (the GEMM path differs from the one they were computed on; meta.json is
    missing or unreadable), or None."""
    for stale in out.glob(".*.tmp-*"):  # a killed run's half-written shard or meta.json
        stale.unlink()
    old_sums = _sums(old, len(old.get("shards") or []))
    keep, redone = {}, {}
    for path in sorted(out.glob("shard-*.npy")):
        if (m := _SHARD.fullmatch(path.name)) is None:
            continue
        k, h = int(m.group(1)), m.group(2)
        if k < len(hashes):
            want = old_sums[k] if k < len(old_sums) else None
            if h is None:
                why = "it was written by an older btlib.embed"
            elif h != hashes[k]:
                why = "its rows changed"
            elif redo_all:
                why = redo_all
            elif not isinstance(want, str):
                why = "no checksum was recorded for it (written by an older btlib.embed, or its run stopped first)"
            elif (damage := _damage(path.read_bytes(), sizes[k], d, want)) is not None:
                why = f"it was damaged ({damage})"
            else:
                keep[k] = want
                continue
            redone[k] = why
        path.unlink()
    return keep, {k: why for k, why in redone.items() if k not in keep}


def read_embeddings(out: str | Path) -> np.ndarray:
    """All shards of a finished run, in row order: (rows, d) float32.

    Every shard is checked against meta.json: its name (its rows' hash: a shard of another version of the input is
    refused), its shape and dtype, and its bytes' sha256 (a damaged or changed one is named). Every error says what
    mends it: run the same command again. FileNotFoundError for missing shards, ValueError for the rest.
    """
    out = Path(out)
    meta = read_meta(out)
    hashes, d = meta.get("shards"), meta.get("dim")
    if not isinstance(hashes, list) or not isinstance(d, int):
        raise ValueError(f"{out}/meta.json was written by an older btlib.embed (no shard hashes): {_RERUN}")
    if not isinstance(meta.get("sums"), list) or len(meta["sums"]) != len(hashes):
        raise ValueError(f"{out}/meta.json was written by an older btlib.embed (no shard checksums, so its shards "
                         f"cannot be verified): {_RERUN} (all its shards)")
    rows, size = meta.get("rows"), meta.get("shard_size")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (rows, size, d)) or rows < 0 or size < 1 or d < 1:
        raise ValueError(f"{out}/meta.json holds rows={rows!r}, shard_size={size!r}, dim={d!r}, which no run writes "
                         f"(edited by hand?): {_REWRITE}")
    sizes = shard_sizes(rows, size)
    if len(sizes) != len(hashes):  # each listed shard could verify and the rows still be short: 8 of 10 were read
        raise ValueError(f"{out}/meta.json lists {len(hashes)} shards for {rows} rows in shards of {size} ({len(sizes)} "
                         f"shards): they do not agree (edited by hand?): {_REWRITE}")
    on_disk = {(int(m.group(1)), m.group(2)): p for p in out.glob("shard-*.npy") if (m := _SHARD.fullmatch(p.name))}
    for (k, h), path in sorted(on_disk.items(), key=lambda kv: kv[0][0]):
        if k < len(hashes) and h != hashes[k] and (k, hashes[k]) not in on_disk:
            raise ValueError(f"{path.name} holds rows of another version of {meta['source']} (it was edited since that "
                             f"shard was written): {_RERUN}")
    missing = [k for k, h in enumerate(hashes) if (k, h) not in on_disk]
    if missing:
        raise FileNotFoundError(f"{out} lacks {len(missing)} of {len(hashes)} shards (first: {missing[0]}): "
                                "run the same command again to finish")
    parts = []
    for k, (h, want) in enumerate(zip(hashes, meta["sums"])):
        path = out / shard_name(k, h)
        if not isinstance(want, str):
            raise ValueError(f"{path.name} has no checksum in meta.json (its run stopped before recording it): {_RERUN}")
        data = path.read_bytes()
        if (damage := _damage(data, sizes[k], d, want)) is not None:
            raise ValueError(f"{path.name} is damaged ({damage}): {_RERUN}")
        parts.append(np.load(io.BytesIO(data)))
    return np.concatenate(parts) if parts else np.empty((0, d), dtype=np.float32)
