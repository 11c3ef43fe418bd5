"""Local (sliding-window) attention on long documents, ModernBERT's shape (notebook 08).

ModernBERT's local layers let query i attend keys |i - j| <= 64 (window (64, 64), 129 keys);
every third layer, from layer 0, is global. One point is a batch of B documents: the longest has
x tokens, the others are drawn log-uniformly between x / 4 and x (:func:`document_lengths`).

``windowed_attention_local`` / ``windowed_attention_global``: one attention layer (H 12, D 64, fp32).

- ``btlib``: btlib.varlen_attention on the packed tokens (cpu_flash_varlen), with the window in
  the local benchmark: no padding, no tile outside the band.
- ``btlib_no_skip`` (local only, unchecked yardstick): the same kernel on the same tokens without
  the window, i.e. what the local layer would cost if the kernel did not skip tiles. It computes
  global attention, a different result, so it is timed but not checked.
- ``sdpa_padded_mask``: F.scaled_dot_product_attention on the padded (B, H, x, D) batch with a dense
  (B, 1, x, x) boolean mask (key padding AND window): what transformers' ModernBertModel does on a
  CPU ("sdpa"). It computes every padded token and every masked tile.
- ``flex_block_mask``: PyTorch's FlexAttention, torch.compile'd, on the packed tokens as one
  sequence with a document (+ window) block mask: it skips the blocks the mask kills (its own
  block size, 128). Compiled for static shapes (torch 2.13's dynamic-shape build of it fails on a
  CPU), so every batch shape compiles once: the harness makes that first call (the check) before
  it times, and :data:`FLEX_FIRST_CALL_S` keeps how long each shape's first call took.

Checked on real tokens only against btlib.reference_attention, run per document on chunks of query
rows (the reference materialises its scores: 12 heads x 8,192 x 8,192 would be 3.2 GB). The ideal
for a point is the window-aware FLOP count over the measured fp32 matmul rate (:func:`add_ideal`).
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from .. import _torch_private as tp
from ..kernels import relative_error
from ..lengths import attention_flops
from ..padding import lengths_to_cu_seqlens, pack, segment_ids, unpack
from ..reference import allowed_mask, reference_attention
from .core import Benchmark, Provider, declare

__all__ = ["LOCAL_WINDOW", "document_lengths", "add_ideal", "FLEX_FIRST_CALL_S", "attention_inputs"]

LOCAL_WINDOW = (64, 64)  # ModernBERT: local_attention 128 -> |i - j| <= 64
FLEX_FIRST_CALL_S: dict[tuple, float] = {}  # (benchmark window, lengths) -> seconds of FlexAttention's first (compiling) call
_REFERENCE: dict[tuple, torch.Tensor] = {}  # reference outputs, reused by the rounds of run_rounds


def document_lengths(B: int, T: int, *, seed: int = 0, spread: float = 4.0) -> torch.Tensor:
    """(B,) int64 document lengths: the first is T, the others log-uniform in [T / spread, T] (seeded).

    With spread 4 every length lies within a factor 4 of T, and the draws scale with T: the benchmarks'
    batch (B = 4, seed 0) padded to its longest pays about 44% padding at every T (notebook 08 prints it).
    """
    rng = np.random.default_rng(seed)
    rest = np.exp(rng.uniform(np.log(max(1.0, T / spread)), np.log(T), B - 1))
    return torch.tensor([T, *np.round(rest).astype(np.int64).tolist()], dtype=torch.int64)


def _key(p: dict) -> tuple:
    return (p["B"], p["T"], p["H"], p["D"], p["window"], p.get("seed", 0))


def attention_inputs(p: dict) -> dict:
    """Seeded packed q, k, v (total, H, D), the same padded (B, H, T, D), masks and the FlexAttention block mask."""
    B, T, H, D, window = p["B"], p["T"], p["H"], p["D"], p["window"]
    lengths = document_lengths(B, T, seed=p.get("seed", 0))
    cu_seqlens, max_seqlen = lengths_to_cu_seqlens(lengths)
    g = torch.Generator().manual_seed(p.get("seed", 0))
    packed = [torch.randn(int(lengths.sum()), H, D, generator=g) for _ in range(3)]
    padded = [unpack(x, cu_seqlens, T).transpose(1, 2).contiguous() for x in packed]  # (B, H, T, D)
    mask = allowed_mask(B, T, T, lengths=lengths, window=window)  # (B, 1, T, T): real keys & window, transformers' SDPA mask
    return {"key": _key(p), "lengths": lengths, "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, "window": window,
            "packed": packed, "padded": padded, "mask": mask}


def _reference(x: dict, chunk: int = 512) -> torch.Tensor:
    """(total, H, D): btlib.reference_attention per document, on chunks of ``chunk`` query rows and the keys
    they may attend (a key outside the window gets probability exactly 0, so leaving it out changes nothing);
    the window itself is passed as the reference's boolean attn_mask. Kept for the next rounds of run_rounds."""
    if x["key"] not in _REFERENCE:
        q, k, v = (t.transpose(0, 1) for t in x["packed"])  # (H, total, D)
        out = torch.empty_like(q)
        window = x["window"]
        bounds = x["cu_seqlens"].tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            for i0 in range(0, b - a, chunk):
                i1 = min(b - a, i0 + chunk)
                j0, j1 = (0, b - a) if window is None else (max(0, i0 - window[0]), min(b - a, i1 + window[1]))
                i, j = torch.arange(i0, i1)[:, None], torch.arange(j0, j1)[None, :]
                mask = None if window is None else (j >= i - window[0]) & (j <= i + window[1])
                out[:, a + i0:a + i1] = reference_attention(q[None, :, a + i0:a + i1], k[None, :, a + j0:a + j1],
                                                            v[None, :, a + j0:a + j1], attn_mask=mask)[0]
        _REFERENCE[x["key"]] = out.transpose(0, 1)
    return _REFERENCE[x["key"]]


def _error(out: torch.Tensor, ref: torch.Tensor, x: dict) -> float:
    if out.dim() == 4:  # padded (B, H, T, D): real tokens only
        out = pack(out.transpose(1, 2), x["lengths"]).tokens
    return relative_error(out, ref)


def _btlib(x: dict, window) -> torch.Tensor:
    from ..attention import varlen_attention

    return varlen_attention(*x["packed"], x["cu_seqlens"], x["max_seqlen"], window=window, backend="cpu_flash_varlen")


def _btlib_available(window) -> str | None:
    from ..kernels import get

    k = get("cpu_flash_varlen")
    return k.available() or (None if window is None or k.window else "cpu_flash_varlen takes no window in this checkout")


def _sdpa(x: dict) -> torch.Tensor:
    return F.scaled_dot_product_attention(*x["padded"], attn_mask=x["mask"])


_flex = None


def _flex_available() -> str | None:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError as e:
        return f"FlexAttention is not in torch {torch.__version__} ({e})"
    return None


def _flex_call(x: dict) -> torch.Tensor:
    """FlexAttention on the packed tokens as one (1, H, total, D) sequence; block mask built once per input."""
    global _flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex is None:
        _flex = torch.compile(flex_attention, dynamic=False)  # dynamic=True fails to build its C++ kernel (torch 2.13, CPU)
    if "block_mask" not in x:
        doc = segment_ids(x["lengths"])  # (total,) sequence of each packed token
        left, right = x["window"] if x["window"] is not None else (None, None)

        def mask_mod(b, h, i, j):
            same = doc[i] == doc[j]
            return same if left is None else same & (j >= i - left) & (j <= i + right)

        total = int(x["lengths"].sum())
        x["block_mask"] = create_block_mask(mask_mod, None, None, total, total, device="cpu")
    q, k, v = (t.transpose(0, 1)[None] for t in x["packed"])  # (1, H, total, D)
    key = (x["window"], tuple(x["lengths"].tolist()))
    t0 = time.perf_counter()
    try:
        with tp.recompile_limit(64):  # one compile per shape: more shapes than the default 8
            out = _flex(q, k, v, block_mask=x["block_mask"])
    except Exception as e:  # noqa: BLE001 - inductor's errors run to pages; the row keeps the first line
        raise RuntimeError(f"FlexAttention failed here: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}") from None
    FLEX_FIRST_CALL_S.setdefault(key, time.perf_counter() - t0)
    return out[0].transpose(0, 1)


def _providers(window) -> list[Provider]:
    provs = [Provider("btlib", lambda x: _btlib(x, x["window"]), available=lambda: _btlib_available(window),
                      label="btlib varlen" + (", window skip" if window else ""))]
    if window is not None:
        provs.append(Provider("btlib_no_skip", lambda x: _btlib(x, None), available=lambda: _btlib_available(None), checked=False,
                              label="btlib varlen without the window (yardstick)"))
    return provs + [
        Provider("sdpa_padded_mask", _sdpa, label="SDPA, padded + dense mask (transformers on a CPU)"),
        Provider("flex_block_mask", _flex_call, available=_flex_available, label="FlexAttention, block mask, compiled"),
    ]


def _flops(p: dict) -> float:
    return attention_flops(document_lengths(p["B"], p["T"], seed=p.get("seed", 0)), p["H"], p["D"], window=p["window"])


def add_ideal(rows: list[dict], bench: Benchmark) -> list[dict]:
    """rows + one "ideal" row per x: the benchmark's FLOPs over the run's measured fp32 matmul rate (env)."""
    ideal = []
    for x in dict.fromkeys(r["x"] for r in rows):
        r = next(r for r in rows if r["x"] == x)
        ms = bench.flops({**r["params"], r["x_name"]: x}) / (r["env"]["fp32_gflops"] * 1e9) * 1e3
        ideal.append({**{k: r[k] for k in ("benchmark", "x_name", "x", "params", "env")}, "provider": "ideal",
                      "status": "ok", "median_ms": ms, "min_ms": ms, "max_ms": ms, "round_medians_ms": [ms],
                      "gflops": r["env"]["fp32_gflops"], "label": "window-aware FLOPs / fp32 matmul rate"})
    return rows + ideal


for _name, _window in (("windowed_attention_local", LOCAL_WINDOW), ("windowed_attention_global", None)):
    declare(Benchmark(
        name=_name,
        description=f"one {'local (window ' + str(_window) + ')' if _window else 'global'} attention layer on B documents "
                    "(longest x tokens), fp32: btlib varlen vs SDPA padded + mask vs FlexAttention",
        x_name="T", x_vals=(256, 512, 1024, 2048, 4096, 8192),
        providers=lambda w=_window: _providers(w),
        make_inputs=attention_inputs,
        reference=_reference,
        error=_error,
        tol=1e-5,
        params={"B": 4, "H": 12, "D": 64, "window": _window},
        quick={"B": 3, "H": 2, "D": 32, "x_vals": (130, 300)},
        flops=_flops, baseline="sdpa_padded_mask",
    ))
