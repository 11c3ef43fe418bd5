"""What a position bias costs btlib's CPU kernels: time against the same kernel without one, and memory.

The issue's targets for the in-kernel bias (btlib/position_bias.py, added per tile in kernels/cpu/flash/flash.h):
no (T, T) tensor allocated (peak memory measured at T = 4096) and within 10% of the same kernel without bias.

``attention_bias``: one attention call, fp32, heads of BERT / MPNet-base (H 12, D 64; MiniLM: ``--set D=32``),
against T. A point holds ``tokens`` tokens: B = tokens / T sequences of length T (4096: 16 x 256, 4 x 1024,
1 x 4096), so the work per call grows with T and T = 4096 takes about a second a call on 2 cores.

- ``v3``, ``v3_alibi``, ``v3_table``: cpu_flash_v3 on (B, H, T, D) without a bias, with ALiBi (the paper's
  slopes), and with MPNet's relative-position buckets (32 buckets, max_distance 128, as a (H, 257) table).
- ``varlen``, ``varlen_table``: cpu_flash_varlen without and with the table on packed tokens of mixed
  lengths: max(B, 2) sequences, the longest T, the rest log-uniform in [T / 4, T] (windowed.document_lengths).
- ``sdpa_table``: the padded baseline, btlib's torch_sdpa kernel with the table on (B, H, T, D): it builds
  the (H, T, T) fp32 bias (PositionBias.dense, 4 H T^2 bytes) plus two (T, T) int64 index tensors for its
  gather each call, then F.scaled_dot_product_attention takes it as a float mask.

Each provider is checked against btlib.reference_attention with the same bias (run per sequence and head,
so the reference holds one (T, T) score matrix at a time), then timed; the benchmark's ``memory`` flag makes
the harness add ``peak_mib``, the peak tensor memory of one call (btlib.bench.peak_memory), to each row.
Caveat: that counts torch tensors only. The C++ kernels' per-thread workspace (flash_tiles.h) is std::vector:
K^T and V of one (b, h), 2 T D floats, plus Br x Bc scores and Br x D output (T = 4096, D = 64: ~2.1 MB a
thread), O(T D) and outside the count; the bias is its values, (H,) or (H, 2R + 1) floats, and the kernel's
per-call expansion of them to every distance, H (2T - 1 + 16) floats (T = 4096, H = 12: 384 KiB), O(H T).
Measured (2-core Intel Xeon, AVX-512, T 256-4096, D 64): before commit 480c46d ALiBi cost 1.6-3.2x and the table
1.4-2.0x (denormal P from far keys' exp2, and unvectorised bias loops, flash.h / vec.h); with the bias added per
score in its own pass over the tile row, 1.04-1.12x (``--rounds 3``); with the expanded rows added inside the
softmax's max pass, 0.97-1.04x. :func:`bias_summary` prints, per T, each row's time over its own kernel without
bias and its peak next to the 4 H T^2 bytes a (H, T, T) fp32 bias would take.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels import get, relative_error
from ..lengths import attention_flops
from ..padding import lengths_to_cu_seqlens
from ..position_bias import PositionBias, alibi_slopes, relative_bucket_table
from ..reference import reference_attention
from .attention import dense_qkv
from .core import Benchmark, Provider, declare
from .windowed import document_lengths

__all__ = ["bias_inputs", "bias_summary", "PAIRS", "MPNET_BUCKETS", "MPNET_MAX_DISTANCE"]

MPNET_BUCKETS, MPNET_MAX_DISTANCE = 32, 128  # MPNet's relative_attention_num_buckets and max_distance
PAIRS = {"v3_alibi": "v3", "v3_table": "v3", "varlen_table": "varlen", "sdpa_table": "v3"}  # row -> its no-bias kernel


class Result(NamedTuple):
    """A provider's output with the case its reference is: (inputs' layout, bias) such as ("dense", "table")."""

    case: tuple[str, str | None]
    out: torch.Tensor


def bias_inputs(p: dict) -> dict:
    """Seeded inputs of one point: dense q, k, v (B, H, T, D), B = max(1, tokens // T); packed q, k, v (total, H, D)
    of max(B, 2) mixed lengths (longest T) with cu_seqlens; the ALiBi bias and MPNet's bucket table (H heads)."""
    T, H, B = p["T"], p["H"], _batch(p)
    dense = dense_qkv({**p, "B": B})
    lengths = _packed_lengths(p)
    cu_seqlens, max_seqlen = lengths_to_cu_seqlens(lengths)
    g = torch.Generator().manual_seed(p.get("seed", 0) + 1)
    packed = [torch.randn(int(lengths.sum()), H, p["D"], generator=g) for _ in range(3)]
    buckets = torch.randn(H, MPNET_BUCKETS, generator=g)  # (H, 32): MPNet's relative_attention_bias.weight.T
    return {**dense, "lengths": lengths, "packed": packed, "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen,
            "bias": {None: None, "alibi": PositionBias.alibi(alibi_slopes(H)),
                     "table": relative_bucket_table(buckets, MPNET_BUCKETS, MPNET_MAX_DISTANCE)},
            "key": (B, H, T, p["D"], p.get("seed", 0))}


def _head(bias: PositionBias | None, h: int) -> PositionBias | None:
    """Head h of ``bias`` as a one-head bias (the reference runs one head at a time)."""
    return None if bias is None else PositionBias(bias.kind, bias.values[h:h + 1], bias.max_distance)


class _Reference:
    """btlib.reference_attention with the case's bias, computed on first use, one (sequence, head) at a time:
    (T, T) scores, not (B, H, T, T) (at T = 4096 one head's are 64 MiB, all twelve 768 MiB and more for the bias)."""

    _cache: dict[tuple, torch.Tensor] = {}  # (inputs key, case) -> output, kept for the next rounds of run_rounds

    def __init__(self, x: dict):
        self.x = x
        if any(k[0] != x["key"] for k in self._cache):
            self._cache.clear()

    def __getitem__(self, case: tuple[str, str | None]) -> torch.Tensor:
        if (self.x["key"], case) not in self._cache:
            layout, kind = case
            bias = self.x["bias"][kind]
            if layout == "dense":
                q, k, v = self.x["q"], self.x["k"], self.x["v"]  # (B, H, T, D)
                seqs = [(q[b:b + 1], k[b:b + 1], v[b:b + 1]) for b in range(q.shape[0])]
            else:
                bounds = self.x["cu_seqlens"].tolist()
                seqs = [tuple(t[a:b].transpose(0, 1)[None] for t in self.x["packed"]) for a, b in zip(bounds[:-1], bounds[1:])]
            outs = [torch.cat([reference_attention(qs[:, h:h + 1], ks[:, h:h + 1], vs[:, h:h + 1], bias=_head(bias, h))
                               for h in range(qs.shape[1])], dim=1) for qs, ks, vs in seqs]  # each (1, H, L, D)
            out = torch.cat(outs) if layout == "dense" else torch.cat([o[0].transpose(0, 1) for o in outs])
            self._cache[(self.x["key"], case)] = out
        return self._cache[(self.x["key"], case)]


def _error(out: Result, ref: _Reference, x: dict) -> float:
    return relative_error(out.out, ref[out.case])


def _dense(name: str, kind: str | None):
    """Registered kernel ``name`` on the dense (B, H, T, D) inputs with bias ``kind`` (None: without)."""
    kernel = get(name).fn

    def fn(x: dict) -> Result:
        extra = {} if kind is None else {"bias": x["bias"][kind]}
        return Result(("dense", kind), kernel(x["q"], x["k"], x["v"], lengths=None, causal=False, scale=None, **extra))
    return fn


def _varlen(kind: str | None):
    """cpu_flash_varlen on the packed (total, H, D) tokens with bias ``kind`` (None: without)."""
    kernel = get("cpu_flash_varlen").fn

    def fn(x: dict) -> Result:
        extra = {} if kind is None else {"bias": x["bias"][kind]}
        return Result(("packed", kind), kernel(*x["packed"], x["cu_seqlens"], x["max_seqlen"], causal=False, scale=None, **extra))
    return fn


def _providers() -> list[Provider]:
    v3, varlen = (lambda n=n: get(n).available() for n in ("cpu_flash_v3", "cpu_flash_varlen"))
    return [
        Provider("v3", _dense("cpu_flash_v3", None), available=v3, label="C++ v3, no bias"),
        Provider("v3_alibi", _dense("cpu_flash_v3", "alibi"), available=v3, label="C++ v3, ALiBi in the tile loop"),
        Provider("v3_table", _dense("cpu_flash_v3", "table"), available=v3,
                 label=f"C++ v3, MPNet buckets ({MPNET_BUCKETS}, max_distance {MPNET_MAX_DISTANCE}) as a table"),
        Provider("varlen", _varlen(None), available=varlen, label="C++ varlen on packed mixed lengths, no bias"),
        Provider("varlen_table", _varlen("table"), available=varlen, label="C++ varlen on packed mixed lengths, MPNet table"),
        Provider("sdpa_table", _dense("torch_sdpa", "table"),
                 label="SDPA with the (H, T, T) fp32 bias materialised as a float mask (padded baseline)"),
    ]


def _batch(p: dict) -> int:
    """B, the dense batch of a point: tokens / T sequences of length T, at least one."""
    return max(1, p["tokens"] // p["T"])


def _packed_lengths(p: dict) -> torch.Tensor:
    """(max(B, 2),) int64 lengths of the packed batch: the longest T, the rest log-uniform in [T / 4, T]."""
    return document_lengths(max(_batch(p), 2), p["T"], seed=p.get("seed", 0))


def _flops(row: dict) -> float:
    """The useful flops of a row's call: 4 B H T^2 D dense, 4 H D sum(L_i^2) on the packed tokens."""
    p = row["params"]
    if row["provider"].startswith("varlen"):
        return attention_flops(_packed_lengths(p), p["H"], p["D"])
    return 4.0 * _batch(p) * p["H"] * p["T"] ** 2 * p["D"]


def bias_summary(rows: list[dict]) -> str:
    """Per T: each row's median, GFLOP/s (its own work), time over its kernel without bias (PAIRS), peak tensor memory
    of one call, and the 4 H T^2 bytes one (H, T, T) fp32 bias would take."""
    lines = []
    by = {(r["x"], r["provider"]): r for r in rows}
    for T in dict.fromkeys(r["x"] for r in rows):
        p = next(r["params"] for r in rows if r["x"] == T)
        B = _batch({**p, "T": T})
        tt = 4 * p["H"] * T * T / 2**20
        lines.append(f"T={T}: dense B={B} x T, packed {max(B, 2)} mixed lengths (longest T); H={p['H']}, D={p['D']}; "
                     f"one (H, T, T) fp32 bias = {tt:.1f} MiB")
        lines.append(f"  {'provider':13s} {'median ms':>10s} {'GFLOP/s':>8s} {'vs no bias':>10s} {'peak MiB':>9s} {'peak/(HTT)':>10s}")
        for (x, name), r in by.items():
            if x != T:
                continue
            if r["status"] != "ok":
                lines.append(f"  {name:13s} {r['status']}: {r.get('reason', '')}")
                continue
            base = by.get((T, PAIRS.get(name, "")))
            ratio = f"{r['median_ms'] / base['median_ms']:.3f}x" if base and base["status"] == "ok" else "-"
            peak = r.get("peak_mib")
            lines.append(f"  {name:13s} {r['median_ms']:10.2f} {_flops(r) / r['median_ms'] / 1e6:8.1f} {ratio:>10s} "
                         + (f"{peak:9.2f} {peak / tt:10.4f}" if peak is not None else f"{'-':>9s} {'-':>10s}"))
    return "\n".join(lines)


declare(Benchmark(
    name="attention_bias",
    description="position bias in the C++ kernels (ALiBi, MPNet table; dense and varlen) vs no bias vs SDPA with a "
                "float mask, fp32: time ratio and peak memory",
    x_name="T", x_vals=(256, 1024, 4096),
    providers=_providers,
    make_inputs=bias_inputs,
    reference=_Reference,
    error=_error,
    tol=1e-5,
    params={"tokens": 4096, "H": 12, "D": 64},
    quick={"tokens": 194, "H": 2, "D": 32, "x_vals": (97, 130)},
    memory=True,
    summary=bias_summary,
))
