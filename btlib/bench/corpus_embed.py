"""corpus_embed: texts/s embedding one Parquet corpus with ``python -m btlib.embed`` and with Ray Data (issue 25's corpus scale).

    python -m btlib.bench run corpus_embed [--quick] [--runs 3]

Both sides embed the same generated corpus, written once per run as Parquet (columns id, text):
``btlib.serve.load.workload("mixed", n, seed=5)``, 80% short queries and 20% ~200-token passages.

    embed_file  btlib.embed.embed_file, what ``python -m btlib.embed IN OUT`` runs: this process, torch's threads,
                shards of 1024 rows in length-sorted batches of <= 8192 tokens
    ray_data    btlib.serve.ray_embed_parquet on a local ``ray.init(num_cpus=3)``: read_parquet -> map_batches(
                CorpusEmbedder, a pool of 2 actors) -> write_parquet. Ray gives each actor 1 CPU and
                OMP_NUM_THREADS=1, so 2 actors compute on the 2 cores; the third logical CPU is for the read and
                write tasks, which 2 actors on ``num_cpus=2`` would leave no CPU to run on

Check before timing: each side's output, read back in row order, against ``model.encode`` of the same texts
(``error``: the max abs difference, <= 1e-5; ``min_cos``: the lowest cosine similarity).

One timed call is one whole job into a fresh folder, as a user runs it; ``texts_per_s`` in the summary is
n / median. Start-up is timed apart: ``startup_s`` is one job on the corpus's first 8 rows (embed_file: load the
model, one shard; Ray: start the actors, each loading the model, plan and run one batch), and the summary's
steady rate is (n - 8) / (median - startup_s), the marginal rate of the texts past the first batch. Ray's
cluster start, ``ray.init``, is once per session and not in any call: ``ray_init_s``. The Ray driver, raylet
and object store run on the same 2 cores and are counted against Ray.

Needs the ``scale`` extra (pyarrow; ray for the Ray row): pip install -e '.[scale]'. A side whose package is
missing is skipped with this line.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from ..serve.extras import missing
from ..serve.load import workload
from .core import Benchmark, Provider, declare

__all__ = ["SMALL", "LABELS", "corpus_table"]

SMALL = 8  # rows of the start-up job
RAY_ACTORS = 2


@functools.lru_cache(maxsize=1)
def _model():
    from ..pretrained import load_pretrained

    return load_pretrained()


def _write_parquet(path: Path, texts: Sequence[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(texts))), "text": list(texts)}), path)


@contextlib.contextmanager
def _corpus(inputs, name: str) -> Iterator[dict]:
    """A folder with corpus.parquet and small.parquet (its first SMALL rows), and for Ray a local cluster: both gone after.

    Yields {"root", "corpus", "small": paths, "run": the provider's job (ctx, source) -> (n, d) embeddings, "ray_init_s"}.
    """
    with tempfile.TemporaryDirectory(prefix="btlib-corpus-") as root:
        ctx = {"root": Path(root), "corpus": Path(root) / "corpus.parquet", "small": Path(root) / "small.parquet",
               "run": _RUN[name], "ray_init_s": None}
        _write_parquet(ctx["corpus"], inputs["texts"])
        _write_parquet(ctx["small"], inputs["texts"][:SMALL])
        if name != "ray_data":
            yield ctx
            return
        import ray as ray_

        started = not ray_.is_initialized()  # a cluster the caller started is theirs to keep
        if started:
            t0 = time.perf_counter()
            ray_.init(num_cpus=RAY_ACTORS + 1, include_dashboard=False, log_to_driver=False)
            ctx["ray_init_s"] = time.perf_counter() - t0
        try:
            yield ctx
        finally:
            if started:
                ray_.shutdown()


def _embed_file(ctx: dict, source: Path) -> torch.Tensor:
    from ..embed import embed_file, read_embeddings

    out = Path(tempfile.mkdtemp(dir=ctx["root"]))  # fresh: an existing folder would be resumed, its shards skipped
    try:
        embed_file(source, out, progress=False)
        return torch.from_numpy(read_embeddings(out))  # (n, d) float32, row order
    finally:
        shutil.rmtree(out)


def _ray_data(ctx: dict, source: Path) -> torch.Tensor:
    import pyarrow.parquet as pq

    from ..serve.corpus import ray_embed_parquet

    out = Path(tempfile.mkdtemp(dir=ctx["root"]))
    try:
        ray_embed_parquet(source, out, concurrency=RAY_ACTORS, batch_size=256)
        table = pq.read_table(out).sort_by("id")  # Ray writes several files, in no promised order
        return torch.from_numpy(np.stack(table.column("embedding").to_numpy(zero_copy_only=False)).astype(np.float32))
    finally:
        shutil.rmtree(out)


_RUN = {"embed_file": _embed_file, "ray_data": _ray_data}
LABELS = {"embed_file": "python -m btlib.embed", "ray_data": f"Ray Data ({RAY_ACTORS} actors)"}


def _provider(name: str) -> Provider:
    def available() -> str | None:
        return missing("pyarrow", "scale") or (missing("ray", "scale") if name == "ray_data" else None)

    def fn(inputs) -> torch.Tensor:
        ctx = inputs["context"]
        return ctx["run"](ctx, ctx["corpus"])

    return Provider(name, fn, available=available, label=LABELS[name], context=functools.partial(_corpus, name=name))


def _inputs(p: dict) -> dict:
    return {"texts": workload("mixed", p["texts"], seed=5)}


def _reference(inputs) -> torch.Tensor:
    return _model().encode(inputs["texts"])  # (n, d) float32: the plain path, batches of 64 in input order


def _metrics(out: torch.Tensor, ref: torch.Tensor, inputs) -> dict:
    """min_cos; the start-up apart (one job on the first SMALL rows); for Ray, ray.init's time."""
    ctx = inputs["context"]
    t0 = time.perf_counter()
    ctx["run"](ctx, ctx["small"])
    row = {"min_cos": float(torch.nn.functional.cosine_similarity(out, ref, dim=-1).min()), "startup_s": time.perf_counter() - t0}
    if ctx["ray_init_s"] is not None:
        row["ray_init_s"] = ctx["ray_init_s"]
    return row


def corpus_table(rows: Sequence[dict]) -> str:
    """The two sides per corpus size: texts/s of a whole job, the start-up apart and the steady rate past it."""
    lines = ["| texts | " + " | ".join(f"{LABELS[m]} texts/s (start-up s, steady texts/s)" for m in _RUN) + " |",
             "|---" * (len(_RUN) + 1) + "|"]
    got = {(r["x"], r["provider"]): r for r in rows}
    for n in dict.fromkeys(r["x"] for r in rows):
        cells = []
        for m in _RUN:
            r = got.get((n, m))
            if not r or r.get("status") != "ok":
                cells.append(f"- ({r['reason']})" if r and r.get("reason") else "-")
                continue
            whole = r["median_ms"] / 1e3
            steady = (n - SMALL) / (whole - r["startup_s"]) if whole > r["startup_s"] else float("nan")
            cells.append(f"{n / whole:,.0f} ({r['startup_s']:.1f} s, {steady:,.0f})")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    inits = [r["ray_init_s"] for r in rows if r.get("ray_init_s") is not None]
    if inits:
        lines.append(f"ray.init(num_cpus={RAY_ACTORS + 1}): {min(inits):.1f} s, once per session, in no job's time")
    return "\n".join(lines)


declare(Benchmark(
    name="corpus_embed",
    description="texts/s embedding one Parquet corpus: python -m btlib.embed vs Ray Data on a local 2-actor pool",
    x_name="texts", x_vals=[4096],
    providers=lambda: [_provider(m) for m in _RUN],
    make_inputs=_inputs,
    reference=_reference,
    error=lambda out, ref, inputs: float((out - ref).abs().max()),
    tol=1e-5,
    quick={"x_vals": [96]},
    baseline="embed_file",
    metrics=_metrics,
    summary=corpus_table,
))
