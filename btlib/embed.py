"""Embed a corpus on one machine, resumably: ``python -m btlib.embed IN OUT [--column text] [--shard-size 1024] [--gemm PATH]``.

IN: Parquet (``.parquet``; needs pyarrow, the ``scale`` extra), JSON lines (``.jsonl``: one object per
line) or plain text (one text per line, empty lines included, so row i is line i + 1), read by the rules of
:mod:`btlib.serve.corpus` (a row ends at b"\\n"; a CRLF's "\\r" and a BOM at the start are dropped). OUT: a
folder of shards, ``shard-00000-<hash>.npy`` ... each a (rows, d) float32 array of ``--shard-size``
consecutive rows, named by the first 16 hex digits of the sha256 of its rows' texts, plus ``meta.json``
(the settings, every shard's expected hash and the sha256 of its bytes: :mod:`btlib.embed_shards`). Read them back
with :func:`read_embeddings`, which checks every shard's name, shape and bytes against meta.json.

A run first reads the whole input once: every input error is found before any work, naming its line, and
each shard's rows are hashed. A shard is written to a temporary file, flushed to disk and renamed into
place: it exists whole or not at all. So a killed run (Ctrl-C, OOM, a lost machine) is resumed by running
the same command again: a shard on disk whose rows are unchanged and whose bytes match their recorded sha256 is
kept; one whose rows changed (the input was edited), or that is damaged (a flipped bit included), is named and
redone; the rest are computed. A changed setting (model, precision, shard size, column, batch budget) in an existing
OUT is an error, never a silent mix. Every value is checked before any work: a bad one is a one-line error (exit 2).

Bits: a shard's rows always form the same length-sorted batches (:func:`btlib.serve.encode_by_tokens`), and
every run of one job (the input's content and those settings) computes on the GEMM path and thread count its
first run took, recorded in btlib's cache (:func:`jobs_file`) and in meta.json. So on one machine a resumed
run, a run into a fresh folder and an uninterrupted run write the same bits; ``--gemm`` pins another path
(all shards are then redone on it). Another machine, torch or MKL may round the last bits differently; where
btlib has no cache folder (an installed btlib without TORCH_EXTENSIONS_DIR) only a resumed run is held to it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from .embed_shards import previous_meta, read_embeddings, rows_hash, sort_out, write_meta, write_shard
from .gemm import PATHS, forced_path, forcing, path_available, plan
from .hardware import cache_file
from .hardware_cache import write_cache
from .precision import ENCODE_PRECISIONS, check_precision, resolve_dtype
from .serve.corpus import count_rows, iter_texts

__all__ = ["embed_file", "read_embeddings", "iter_texts", "count_rows", "rows_hash", "jobs_file", "main"]

_BITS = ("column", "shard_size", "model", "precision", "max_batch_tokens")  # the settings that change a job's bits


def jobs_file() -> Path | None:
    """Where each corpus job's GEMM path and thread count are recorded: btlib_embed_jobs.json beside btlib's hardware
    cache (:func:`btlib.hardware.cache_file`), keyed by the job; None where btlib caches nothing."""
    path = cache_file()
    return path.with_name("btlib_embed_jobs.json") if path else None


def _recorded(path: Path | None, job: str) -> tuple[str, int] | None:
    try:
        entry = json.loads(path.read_text()).get(job) if path else None
    except (OSError, ValueError, AttributeError):  # no file yet, or not a JSON object: nothing recorded
        return None
    ok = isinstance(entry, dict) and entry.get("gemm") in PATHS and type(entry.get("threads")) is int and entry["threads"] > 0
    return (entry["gemm"], entry["threads"]) if ok else None


def _job_gemm(job: str, pin: str | None, old: dict, precision: str | None) -> tuple[str, int, str]:
    """(GEMM path, thread count, how they were chosen) for a job. The measured choice can differ between processes
    (another thread count, a busy CPU) and two paths round the last bits differently; MKL's sgemm rounds differently
    at another thread count too (1.3e-7 between 1 and 2 threads on an Intel Xeon). So the job's first choice is
    recorded and reused: --gemm, else the job's record, else this folder's, else BTLIB_GEMM or the measured path."""
    threads, path = torch.get_num_threads(), jobs_file()
    dtype = resolve_dtype(None if precision == "int8" else precision)
    if pin is not None:
        if (why := path_available(pin, dtype)) is not None:
            raise ValueError(f"--gemm {pin} cannot run here ({why}): pass another of {PATHS}")
        gemm, how = pin, "pinned with --gemm"
    elif (got := _recorded(path, job)) is not None:
        return (*got, f"this job's recorded path, reused from {path}")
    elif old.get("gemm") in PATHS and type(old.get("threads")) is int and old["threads"] > 0:
        gemm, threads, how = old["gemm"], old["threads"], "this folder's, reused"
    elif (gemm := forced_path()) is not None:
        how = "BTLIB_GEMM's"
    else:
        gemm, how = plan(dtype)[-1][1], "measured here"  # the path for the largest batches, where the time goes
    write_cache(path, job, {"gemm": gemm, "threads": threads})
    return gemm, threads, how + (f"; recorded for this job in {path}" if path else "")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


def _checked(source: str | Path, out: str | Path, *, column: object, model_folder: str | Path | None, shard_size: int,
             precision: str | None, max_batch_tokens: int, gemm: str | None) -> tuple[Path, Path]:
    """(source, out) as paths once every value is one a run can take: each error is one line naming the value, raised
    before any work (a bad value found after the model loaded or meta.json was written cost a minute or left a folder)."""
    _positive_int("shard_size (--shard-size)", shard_size)
    _positive_int("max_batch_tokens (--max-batch-tokens)", max_batch_tokens)
    if gemm is not None and gemm not in PATHS:
        raise ValueError(f"gemm must be one of {PATHS}; got {gemm!r}")
    check_precision(precision, ENCODE_PRECISIONS)
    if not isinstance(column, str) or not column:
        raise ValueError(f"column (--column) must be a non-empty string; got {column!r}")
    source, out = Path(source), Path(out)
    if not source.is_file():
        raise FileNotFoundError(f"{source} is not a file" + (" (a folder: name one file in it)" if source.is_dir() else ""))
    if model_folder is not None and not Path(model_folder).is_dir():
        raise FileNotFoundError(f"the model folder {model_folder} (--model) is not a folder")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder: OUT is the folder the shards go in; name a new or existing folder")
    up = next((p for p in (out, *out.parents) if p.exists()), Path("."))
    if not up.is_dir():
        raise ValueError(f"{up} is a file, so {out} cannot be made under it: name a folder")
    if not os.access(up, os.W_OK | os.X_OK):
        raise PermissionError(f"{up} is not writable by this user, so {out} cannot be written: name another folder")
    return source, out


def embed_file(source: str | Path, out: str | Path, *, column: str = "text", model_folder: str | Path | None = None,
               shard_size: int = 1024, precision: str | None = None, max_batch_tokens: int = 8192, gemm: str | None = None,
               progress: bool = True, on_shard: Callable[[int], None] | None = None) -> dict:
    """Embed every text of ``source`` into shards under ``out``, keeping the shards a previous run finished on the same rows.

    gemm: one of btlib.gemm.PATHS to pin (default: the job's recorded path, see the module docstring). on_shard(k)
    is called after shard k is safely on disk (a hook for progress or tests). Returns {"rows", "shards", "written",
    "skipped", "redone": {k: why}, "gemm", "threads", "gemm_how", "seconds", "texts_per_s"} (texts_per_s over the
    rows written now).
    """
    from .pretrained import load_pretrained
    from .serve.corpus import encode_by_tokens

    source, out = _checked(source, out, column=column, model_folder=model_folder, shard_size=shard_size,
                           precision=precision, max_batch_tokens=max_batch_tokens, gemm=gemm)
    settings = {"source": source.name, "column": column, "shard_size": shard_size, "max_batch_tokens": max_batch_tokens,
                "model": str(model_folder) if model_folder else "all-MiniLM-L6-v2 (default)", "precision": precision or "fp32"}
    old, lost = previous_meta(out)
    changed = {k: (old.get(k), v) for k, v in settings.items() if old and old.get(k) != v}
    if changed:
        raise ValueError(f"{out} holds a run with other settings {changed} (was, now): use a new folder or the same settings")
    hashes, sizes = [], []
    for texts in iter_texts(source, column, shard_size):  # the one pass that checks and hashes the input
        hashes.append(rows_hash(texts, column))
        sizes.append(len(texts))
    model = load_pretrained(model_folder)  # before meta.json: a wrong folder leaves nothing to clean up
    d = model.encode([], batch_size=1).shape[1]
    job = hashlib.sha256(json.dumps([[settings[k] for k in _BITS], hashes]).encode()).hexdigest()[:32]
    gemm, threads, how = _job_gemm(job, gemm, old, precision)
    out.mkdir(parents=True, exist_ok=True)
    same_path = (old.get("gemm"), old.get("threads")) == (gemm, threads)
    keep, redone = sort_out(out, hashes, sizes, d, old, lost or (None if same_path else
                            f"the GEMM path changed ({old.get('gemm')} at {old.get('threads')} threads, now {gemm} at {threads})"))
    # meta.json after the shards it no longer describes are gone: a kill between the two leaves no shard of another
    # input version or GEMM path under it, only missing ones
    sums = [keep.get(k) for k in range(len(hashes))]  # each shard's sha256, recorded once it is on disk
    meta = {**settings, "rows": sum(sizes), "dim": d, "gemm": gemm, "threads": threads, "shards": hashes, "sums": sums}
    write_meta(out, meta)
    written = done_rows = 0
    t0 = time.perf_counter()
    for k, texts in enumerate(iter_texts(source, column, shard_size)):
        if k not in keep:
            if k >= len(hashes) or rows_hash(texts, column) != hashes[k]:
                raise ValueError(f"{source.name} changed while this run read it (shard {k}'s rows): run the same command "
                                 "again once nothing writes to it")
            with forcing(gemm), _threads(threads):
                emb = encode_by_tokens(model, texts, max_batch_tokens=max_batch_tokens, precision=precision).numpy()
            sums[k] = write_shard(out, k, hashes[k], emb)
            write_meta(out, meta)  # one small file per shard: a kill between the two leaves the shard unverified, redone
            written += 1
            done_rows += len(texts)
        if on_shard:
            on_shard(k)
        if progress:
            _progress(k + 1, len(hashes), done_rows, time.perf_counter() - t0)
    if progress and hashes:
        print(file=sys.stderr)
    seconds = time.perf_counter() - t0
    return {"rows": sum(sizes), "shards": len(hashes), "written": written, "skipped": len(keep), "redone": redone,
            "gemm": gemm, "threads": threads, "gemm_how": how, "seconds": seconds,
            "texts_per_s": done_rows / seconds if seconds > 0 and done_rows else None}


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _progress(k: int, shards: int, done_rows: int, seconds: float) -> None:
    rate = done_rows / seconds if seconds > 0 else 0.0
    bar = "#" * (30 * k // shards)
    eta = f", ETA {(shards - k) * seconds / max(k, 1):.0f} s" if k < shards else ""
    print(f"\rembed [{bar:30s}] shard {k}/{shards}, {rate:,.0f} texts/s{eta}", end="", file=sys.stderr, flush=True)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, as every other refusal of a value here (argparse adds its usage block)
        print(f"{self.prog}: {message} (--help lists the options)", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m btlib.embed", description="embed a corpus into resumable shards")
    p.add_argument("source", help="a .parquet, .jsonl or text file (one text per line)")
    p.add_argument("out", help="output folder of shard-*.npy (created; an existing one is resumed)")
    p.add_argument("--column", default="text", help="the text column (Parquet) or field (JSON lines)")
    p.add_argument("--model", default=None, help="model folder (default: all-MiniLM-L6-v2)")
    p.add_argument("--shard-size", type=int, default=1024, help="rows per shard: the most a killed run loses")
    p.add_argument("--precision", default=None, choices=ENCODE_PRECISIONS)
    p.add_argument("--max-batch-tokens", type=int, default=8192, help="tokens per forward pass")
    p.add_argument("--gemm", default=None, choices=PATHS,
                   help="pin the GEMM path at this process's thread count (default: the one this job's first run took)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    from .memory import keep_freed_memory

    keep_freed_memory()  # the corpus's batches reuse their activations' memory (btlib.memory; a no-op off glibc)
    try:
        r = embed_file(args.source, args.out, column=args.column, model_folder=args.model, shard_size=args.shard_size,
                       precision=args.precision, max_batch_tokens=args.max_batch_tokens, gemm=args.gemm,
                       progress=not args.quiet)
    except (ValueError, TypeError, OSError, ImportError) as e:  # OSError: a folder not writable, a disk full
        print(f"python -m btlib.embed: {e}", file=sys.stderr)
        return 2
    print(f"GEMM path {r['gemm']} at {r['threads']} thread{'s' * (r['threads'] != 1)} ({r['gemm_how']})")
    for k, why in sorted(r["redone"].items()):
        print(f"shard {k} redone: {why}")
    rate = f", {r['texts_per_s']:,.0f} texts/s" if r["texts_per_s"] else ""
    print(f"{r['rows']} rows in {r['shards']} shards under {args.out}: {r['written']} written, {r['skipped']} already done "
          f"({r['seconds']:.1f} s{rate})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
