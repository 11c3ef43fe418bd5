"""btlib against every CPU engine people embed text with: ``python -m btlib.bench run peers --rounds 3``.

Engines (rows), all on all-MiniLM-L6-v2 from its local folder, the same tokenizer and truncation (btlib's
``tokenize``: tokenizer.json, 256 tokens; fastembed tokenizes itself with the same file and length), text in,
normalised mean-pooled embeddings out, at torch's thread count:

    btlib_fp32 / _bf16 / _int8      btlib's padding-free encode(), fp32 / bf16 (where native) / int8 (btlib.quant)
    ort_fp32, ort_int8              ONNX Runtime: bert-optimized export / its dynamic int8, longest first (runtimes)
    ov_fp32, ov_default             OpenVINO with INFERENCE_PRECISION_HINT=f32 / its own choice (bf16 on
                                    an AVX512_BF16 CPU), longest first (rt_openvino)
    ov_int8_weights, ov_int8_nncf   OpenVINO weight-only int8 / NNCF full int8, default hint
    ct2_fp32, ct2_int8              CTranslate2 Encoder, float32 / int8 compute, longest first (rt_ctranslate2)
    fastembed                       fastembed's own embed() (ONNX Runtime inside, corpus order) (rt_fastembed)

Cells (x): corpus/batch size for the three corpora of btlib.bench.pretrained ("file": the workbook's
sentences in file order, ``repeat`` times; "draws": ``draws`` seeded draws from them; "passages":
``passages`` texts of 100-250 words, most truncated at 256 tokens) at batch 32 and 128, and "query/1": one
10-word sentence (:data:`QUERY`), the one-query latency. Every engine is checked against btlib fp32 in every
cell before it is timed: ``error`` = 1 - the lowest cosine of an embedding with btlib's (in float64), at most
1e-6 for fp32 engines (fp32 reorderings measured ~1e-12, bf16 lands near 1e-4: a silent precision drop fails) and
0.15 for bf16 / int8 ones: their accuracy is what it is on this CPU, stated by ``min_cos`` and not judged (OpenVINO's
NNCF int8 measured min cos .89 on an AVX2 CPU without VNNI, .964 on Zen 5); each shares its graph, batching and
pooling with an fp32 sibling that passed 1e-6, and 0.15 still stops a broken run. An engine whose package is
missing is skipped with the pip command. :func:`summary` prints the pivot: sentences/s per cell, the query's
median ms, the lowest min_cos and, for btlib's rows, the GEMM path (:func:`gemm_path`).

The process keeps freed memory (:func:`btlib.keep_freed_memory`, glibc's mallopt; isolated workers too), as
btlib's own server and corpus embedder run: every engine here runs under it alike. It matters to whoever
allocates large activations afresh per batch (torch, hence btlib); ONNX Runtime and OpenVINO reuse memory
through their own arenas. The summary says whether it took effect.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from ..device import describe_ranges
from ..memory import freed_memory_kept, keep_freed_memory
from ..precision import bf16_slow_reason
from . import pretrained, rt_openvino, runtimes
from .core import Benchmark, Provider, declare
from .pretrained import _ids, _needs, peer_providers

__all__ = ["QUERY", "CELLS", "FP32_TOL", "LOW_TOL", "gemm_path", "cell_texts", "peer_providers", "summary"]

QUERY = "How do I reset the password on my work laptop?"  # 10 words, 13 tokens with [CLS] and [SEP]
CELLS = ("file/32", "file/128", "draws/32", "draws/128", "passages/32", "passages/128", "query/1")
FP32_TOL = 1e-6
LOW_TOL = 0.15
def gemm_path(env: dict, precision: str) -> str:
    """The GEMM path btlib's ``precision`` rows ran on, from a row's ``env`` (:func:`btlib.device.describe_machine`).

    fp32 / bf16: btlib.hardware's measured choice per token range (``gemm_pick``) and the best rate of that
    precision; int8: the same for btlib.quant's paths (int_mm where no int8 pick is recorded: rows saved before
    the pick); F.linear where no choice is recorded (btlib.gemm's fallback).
    """
    pick = (env.get("gemm_pick") or {}).get(precision)  # [[M_max | None, path], ...]
    if precision == "int8":
        rates = (env.get("gemm") or {}).get("int8") or {}
        best = max((r for by_M in rates.values() for r in by_M.values()), default=None)
        where = describe_ranges(pick, " tokens") if pick else "int_mm"
        per_shape = " per weight shape, overall" if any(k.startswith("int8 ") for k in env.get("gemm_pick") or {}) else ""
        return f"{where} (btlib.quant{per_shape})" + (f"; best {best:.0f} GOP/s" if best else "")
    rate = env.get(f"{precision}_gflops")
    if not pick:
        return "F.linear" + (f"; best {rate:.0f} GFLOP/s" if rate else "")
    where = describe_ranges(pick, " tokens")
    return f"{where}; best {rate:.0f} GFLOP/s" if rate else where


def cell_texts(p: dict) -> tuple[list[str], int]:
    """(texts, batch size) of one cell, p["cell"] = "corpus/batch" (corpus: file, draws, passages or query)."""
    corpus, _, batch = p["cell"].partition("/")
    if not batch.isdigit() or int(batch) < 1:
        raise ValueError(f"cell must be 'corpus/batch_size', e.g. 'file/32'; got {p['cell']!r}")
    return ([QUERY] if corpus == "query" else pretrained.texts({**p, "corpus": corpus})), int(batch)


def _inputs(p: dict) -> dict:
    keep_freed_memory()  # every engine in this process (and in an isolated worker, which makes its inputs here too)
    texts, batch_size = cell_texts(p)
    return {"texts": texts, "batch_size": batch_size}


def _btlib(precision: str):
    return lambda x: pretrained._model().encode(x["texts"], batch_size=x["batch_size"], precision=precision)


def _ort(variant: str):
    def fn(x):
        ids, pad = _ids(x)
        return runtimes.ort_encode(runtimes.ort_session(runtimes.onnx_model(pretrained._folder(), variant)), ids,
                                   x["batch_size"], sort=True, pad_id=pad)
    return fn


def _providers() -> list[Provider]:
    onnx, low = pretrained._onnx_available, {"tol": LOW_TOL}
    peers = {p.name: p for p in peer_providers(LOW_TOL)}
    return [
        Provider("btlib_fp32", _btlib("fp32"), available=_needs(), label="btlib encode fp32"),
        Provider("ort_fp32", _ort("opt"), available=_needs(onnx), label="ONNX Runtime fp32 (bert optimizer), length-sorted"),
        *[peers[n] for n in ("ov_fp32", "ct2_fp32", "fastembed")],
        Provider("btlib_bf16", _btlib("bf16"), available=_needs(bf16_slow_reason), precision="bf16", label="btlib bf16", **low),
        peers["ov_default"],
        Provider("btlib_int8", _btlib("int8"), available=pretrained._int8_available, precision="int8", label="btlib int8", **low),
        *[peers[n] for n in ("ov_int8_weights", "ov_int8_nncf")],
        Provider("ort_int8", _ort("int8"), available=_needs(onnx), precision="int8", label="ONNX Runtime dynamic int8", **low),
        peers["ct2_int8"],
    ]


def _reference(x: dict) -> torch.Tensor:
    return _btlib("fp32")(x)


def _cosines(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(out.double(), ref.double(), dim=-1)  # float64: fp32's own rounding is ~1e-7


def _metrics(out: torch.Tensor, ref: torch.Tensor, x: dict) -> dict:
    return {"min_cos": float(_cosines(out, ref).min()), "max_diff": float((out.float() - ref).abs().max()),
            "sentences": len(x["texts"]), "freed_memory_kept": freed_memory_kept()}


def _label(name: str) -> str:
    label = next((p.label for p in _providers() if p.name == name), None) or name
    if name == "ov_default" and rt_openvino.openvino_available() is None:
        path = rt_openvino.ov_model(pretrained._folder(), "fp32")  # cached: made by the run that timed it
        label += f": {rt_openvino.ov_precision(rt_openvino.ov_compiled(path))} here"
    return label


def summary(rows: list[dict]) -> str:
    """The issue-21 table from ``rows`` of this benchmark: one line per engine, sentences/s per cell (the
    rows' best median), the query's median ms, the lowest min cosine vs btlib fp32, btlib's GEMM path;
    then one line per engine that was skipped or wrong, with the reason."""
    cells = list(dict.fromkeys(r["x"] for r in rows))
    head = ["engine", *[c.replace("/", " ") if c != "query/1" else "query ms" for c in cells], "min cos", "GEMM (btlib rows)"]
    lines, notes = [], []
    for name in dict.fromkeys(r["provider"] for r in rows):
        mine = {r["x"]: r for r in rows if r["provider"] == name}
        ok = [r for r in mine.values() if r["status"] == "ok"]
        if not ok:
            notes.append(f"{name}: {next(iter(mine.values()))['status']}: {next(iter(mine.values())).get('reason')}")
            continue
        cols = []
        for c in cells:
            r = mine.get(c)
            if r is None or r["status"] != "ok":
                cols.append("-" if r is None else r["status"])
            else:
                cols.append(f"{r['median_ms']:.2f}" if c == "query/1" else f"{r['sentences'] / r['median_ms'] * 1e3:.0f}")
        precision = name.removeprefix("btlib_") if name.startswith("btlib_") else None
        gemm = gemm_path(ok[0]["env"], precision) if precision else ""
        lines.append([_label(name), *cols, f"{min(r['min_cos'] for r in ok):.6f}", gemm])
        notes += [f"{name} {c}: {r['status']}: {r.get('reason')}" for c, r in mine.items() if r["status"] != "ok"]
    widths = [max(len(str(row[i])) for row in [head, *lines]) for i in range(len(head))]
    fmt = "| " + " | ".join(f"{{:<{w}}}" for w in widths) + " |"
    out = [fmt.format(*head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *[fmt.format(*line) for line in lines]]
    kept = {r.get("freed_memory_kept") for r in rows if r["status"] == "ok"} - {None}
    allocator = {frozenset({True}): "freed memory kept in every process (btlib.keep_freed_memory)",
                 frozenset({False}): "freed memory returned to the OS (glibc's default: btlib.keep_freed_memory did not "
                                     "take effect here)"}.get(frozenset(kept), "mixed: some rows kept freed memory, some not")
    return "\n".join(out + [f"- {n}" for n in notes] + ([f"- allocator: {allocator}"] if kept else []))


declare(Benchmark(
    name="peers",
    description="all-MiniLM-L6-v2 end to end, sentences/s: btlib vs ONNX Runtime, OpenVINO, CTranslate2, fastembed, "
                "three corpora x batch 32 / 128 and one query",
    x_name="cell", x_vals=CELLS,
    providers=_providers,
    make_inputs=_inputs,
    reference=_reference,
    error=lambda out, ref, x: float(1.0 - _cosines(out, ref).min()),
    metrics=_metrics,
    tol=FP32_TOL,
    params={"repeat": 4, "draws": 512, "passages": 64, "seed": 0},
    quick={"repeat": 1, "draws": 16, "passages": 2, "x_vals": ("file/32", "draws/32", "passages/32", "query/1")},
    baseline="btlib_fp32",
    summary=summary,
))
