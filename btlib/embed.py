"""Embed a corpus on one machine, resumably: ``python -m btlib.embed IN OUT [--column text] [--shard-size 1024]``.

IN: Parquet (``.parquet``; needs pyarrow, the ``scale`` extra), JSON lines (``.jsonl``: one object per
line) or plain text (one text per line, empty lines included, so row i is line i + 1), read by the rules of
:mod:`btlib.serve.corpus` (a row ends at b"\\n"; a CRLF's "\\r" and a BOM at the start are dropped). OUT: a folder of
shards, ``shard-00000.npy`` ... each a (rows, d) float32 array of ``--shard-size`` consecutive rows,
plus ``meta.json`` (the settings). Read them back with :func:`read_embeddings`.

A shard is written to a temporary file, flushed to disk and renamed into place: it exists whole or
not at all. So a killed run (Ctrl-C, OOM, a lost machine) is resumed by running the same command
again: finished shards are skipped, the rest are computed, and since a shard's rows always form the
same length-sorted batches (:func:`btlib.serve.encode_by_tokens`), the result equals an uninterrupted
run's bit for bit. A changed setting (model, precision, shard size, column) in an existing OUT is an
error, never a silent mix.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from .gemm import PATHS, forced_path, forcing, plan
from .precision import ENCODE_PRECISIONS, check_precision, resolve_dtype
from .serve.corpus import count_rows, iter_texts

__all__ = ["embed_file", "read_embeddings", "iter_texts", "count_rows", "main"]


def _write_atomic(path: Path, write: Callable[[object], None]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX and Windows: readers see the old file or the whole new one


def embed_file(source: str | Path, out: str | Path, *, column: str = "text", model_folder: str | Path | None = None,
               shard_size: int = 1024, precision: str | None = None, max_batch_tokens: int = 8192, progress: bool = True,
               on_shard: Callable[[int], None] | None = None) -> dict:
    """Embed every text of ``source`` into shards under ``out``, skipping shards a previous run finished.

    on_shard(k) is called after shard k is safely on disk (a hook for progress or tests). Returns
    {"rows", "shards", "written", "skipped", "seconds", "texts_per_s"} (texts_per_s over the rows written now).
    """
    from .pretrained import load_pretrained
    from .serve.corpus import encode_by_tokens

    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size <= 0:
        raise ValueError(f"shard_size must be a positive int; got {shard_size!r}")
    check_precision(precision, ENCODE_PRECISIONS)
    source, out = Path(source), Path(out)
    if not source.is_file():
        raise FileNotFoundError(f"{source} is not a file")
    rows = count_rows(source, column)
    settings = {"source": source.name, "rows": rows, "column": column, "shard_size": shard_size,
                "model": str(model_folder) if model_folder else "all-MiniLM-L6-v2 (default)", "precision": precision or "fp32",
                "max_batch_tokens": max_batch_tokens}
    out.mkdir(parents=True, exist_ok=True)
    meta = out / "meta.json"
    if meta.is_file():
        old = json.loads(meta.read_text())
        changed = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        if changed:
            raise ValueError(f"{out} holds a run with other settings {changed} (was, now): use a new folder or the same settings")
    model = load_pretrained(model_folder)  # before meta.json: a wrong folder leaves nothing to clean up
    # One GEMM path for the whole run, kept in meta.json: the measured choice can differ between processes
    # (another thread count, a busy CPU), and two paths round the last bits differently, so a resumed run
    # forces the path the first run took and its shards equal an uninterrupted run's bit for bit. The thread
    # count too: MKL's sgemm rounds differently at another one (1.3e-7 between 1 and 2 threads, measured on an
    # Intel Xeon; oneDNN gave the same bits), so a resumed run computes at the first run's thread count.
    recorded = json.loads(meta.read_text()) if meta.is_file() else {}
    gemm, threads = recorded.get("gemm"), recorded.get("threads")
    if gemm not in PATHS or not isinstance(threads, int) or threads < 1:
        gemm = gemm if gemm in PATHS else forced_path() or plan(resolve_dtype(None if precision == "int8" else precision))[-1][1]
        threads = torch.get_num_threads()
        _write_atomic(meta, lambda f: f.write(json.dumps({**settings, "gemm": gemm, "threads": threads}, indent=1).encode()))
    for stale in out.glob(".shard-*.tmp-*"):  # a killed run's half-written shard
        stale.unlink()
    shards = -(-rows // shard_size)
    written = skipped = done_rows = 0
    t0 = time.perf_counter()
    for k, texts in enumerate(iter_texts(source, column, shard_size)):
        path = out / f"shard-{k:05d}.npy"
        if path.is_file():
            skipped += 1
        else:
            with forcing(gemm), _threads(threads):
                emb = encode_by_tokens(model, texts, max_batch_tokens=max_batch_tokens, precision=precision).numpy()
            _write_atomic(path, lambda f: np.save(f, emb))
            written += 1
            done_rows += len(texts)
        if on_shard:
            on_shard(k)
        if progress:
            _progress(k + 1, shards, done_rows, time.perf_counter() - t0)
    if progress:
        print(file=sys.stderr)
    seconds = time.perf_counter() - t0
    return {"rows": rows, "shards": shards, "written": written, "skipped": skipped, "seconds": seconds,
            "texts_per_s": done_rows / seconds if seconds > 0 else None}


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


def read_embeddings(out: str | Path) -> np.ndarray:
    """All shards of a finished run, in row order: (rows, d) float32. Raises if a shard is missing (resume the run)."""
    out = Path(out)
    settings = json.loads((out / "meta.json").read_text())
    shards = -(-settings["rows"] // settings["shard_size"])
    missing = [k for k in range(shards) if not (out / f"shard-{k:05d}.npy").is_file()]
    if missing:
        raise FileNotFoundError(f"{out} lacks {len(missing)} of {shards} shards (first: {missing[0]}): run the same command again to finish")
    if not shards:
        return np.empty((0, 0), dtype=np.float32)
    return np.concatenate([np.load(out / f"shard-{k:05d}.npy") for k in range(shards)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m btlib.embed", description="embed a corpus into resumable shards")
    p.add_argument("source", help="a .parquet, .jsonl or text file (one text per line)")
    p.add_argument("out", help="output folder of shard-*.npy (created; an existing one is resumed)")
    p.add_argument("--column", default="text", help="the text column (Parquet) or field (JSON lines)")
    p.add_argument("--model", default=None, help="model folder (default: all-MiniLM-L6-v2)")
    p.add_argument("--shard-size", type=int, default=1024, help="rows per shard: the most a killed run loses")
    p.add_argument("--precision", default=None, choices=ENCODE_PRECISIONS)
    p.add_argument("--max-batch-tokens", type=int, default=8192, help="tokens per forward pass")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    from .memory import keep_freed_memory

    keep_freed_memory()  # the corpus's batches reuse their activations' memory (btlib.memory; a no-op off glibc)
    try:
        r = embed_file(args.source, args.out, column=args.column, model_folder=args.model, shard_size=args.shard_size,
                       precision=args.precision, max_batch_tokens=args.max_batch_tokens, progress=not args.quiet)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
        print(f"python -m btlib.embed: {e}", file=sys.stderr)
        return 2
    rate = f", {r['texts_per_s']:,.0f} texts/s" if r["texts_per_s"] else ""
    print(f"{r['rows']} rows in {r['shards']} shards under {args.out}: {r['written']} written, {r['skipped']} already done "
          f"({r['seconds']:.1f} s{rate})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
