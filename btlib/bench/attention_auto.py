"""``attention_auto``: what ``backend="auto"`` takes on this CPU, against PyTorch's own SDPA and every btlib kernel.

One row per (case, provider); the cases are a padded batch without padding (fp32 and bf16, T 256 and 1024)
and 8 packed sequences of mixed lengths 20-1000 (fp32 and bf16), H 12, D 64. Providers:

- ``sdpa``: F.scaled_dot_product_attention: on the padded batch directly, on the packed one once per
  sequence on contiguous (1, H, L, D) slices from a Python loop (torch_sdpa / torch_sdpa_loop);
- ``auto``: btlib.attention / btlib.varlen_attention with ``backend="auto"`` (the choice measured here,
  btlib.kernels.choice); each row stores the kernel it took as ``auto_pick``;
- ``btlib_v3``: btlib's C++ v3, cpu_flash_v3 (padded) / cpu_flash_varlen (packed); ``btlib_amx``: cpu_amx_varlen,
  the same with both products on AMX tiles (bf16, packed; skipped with the reason where the CPU has no AMX).

The check: the error against the fp32 reference in units of the kernel's tolerance (fp32: 1e-5 of the
reference's scale; bf16: twice SDPA's own bf16 error on the same inputs), must be <= 1. The summary prints the
issue-style table: per case, auto's pick, SDPA's time over auto's and over the fastest btlib kernel's.
Run it native and with torch restricted to AVX2 (docs/setup.md) to see both machines a reader may have.
"""

from __future__ import annotations

import torch

from ..attention import attention, varlen_attention
from ..kernels import get, registry, relative_error
from ..kernels.registry import LOW_PRECISION_FACTOR
from ..padding import lengths_to_cu_seqlens
from ..reference import reference_attention, reference_varlen_attention
from .core import Benchmark, Provider, declare

__all__ = ["CASES", "auto_table"]

MIX = (20, 50, 100, 200, 350, 500, 750, 1000)  # 8 mixed lengths, 20-1000
CASES = ("padded fp32 T 256", "padded fp32 T 1024", "padded bf16 T 256", "padded bf16 T 1024",
         "varlen fp32 20-1000", "varlen bf16 20-1000")
_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}
_QUICK_MIX = (1, 5, 33, 64)


def _case(x: str) -> tuple[str, torch.dtype, str]:
    layout, dname, *rest = x.split()
    return layout, _DTYPE[dname], " ".join(rest)


def _inputs(p: dict) -> dict:
    layout, dtype, size = _case(p["case"])
    H, D = p["H"], p["D"]
    g = torch.Generator().manual_seed(0)
    if layout == "padded":
        T = int(size.split()[-1]) if not p.get("T") else p["T"]
        B = max(1, p["tokens"] // T)
        q32, k32, v32 = torch.randn(3, B, H, T, D, generator=g).unbind(0)
        args, kw = (q32, k32, v32), {"lengths": None}
        seqlen = T
    else:
        L = list(p.get("lengths") or MIX)
        cu, seqlen = lengths_to_cu_seqlens(torch.tensor(L))
        q32, k32, v32 = torch.randn(3, sum(L), H, D, generator=g).unbind(0)
        args, kw = (q32, k32, v32, cu, seqlen), {}
    low = tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    ref_fn = reference_attention if layout == "padded" else reference_varlen_attention
    ref = ref_fn(*(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in low), **kw)  # fp32 oracle on the rounded inputs
    sdpa = get("torch_sdpa" if layout == "padded" else "torch_sdpa_loop")
    tol = 1e-5 if dtype == torch.float32 else max(LOW_PRECISION_FACTOR * relative_error(sdpa.fn(*low, **kw, causal=False, scale=None).float(), ref), 1.2e-7)
    probe = low[0]
    pick = registry.select(layout, probe, False, needs_grad=False, seqlen=seqlen).name
    return {"layout": layout, "args": low, "kw": kw, "ref": ref, "tol": tol, "auto_pick": pick}


def _v3(x):
    return get("cpu_flash_v3" if x["layout"] == "padded" else "cpu_flash_varlen").fn(*x["args"], **x["kw"], causal=False, scale=None)


def _amx(x):
    if x["layout"] == "padded":
        raise NotImplementedError("no padded AMX kernel: cpu_amx_varlen takes packed tokens")
    return get("cpu_amx_varlen").fn(*x["args"], causal=False, scale=None)


def _sdpa(x):
    return get("torch_sdpa" if x["layout"] == "padded" else "torch_sdpa_loop").fn(*x["args"], **x["kw"], causal=False, scale=None)


def _auto(x):
    if x["layout"] == "padded":
        return attention(*x["args"], **x["kw"])
    return varlen_attention(*x["args"])


def _providers() -> list[Provider]:
    return [Provider("sdpa", _sdpa, label="PyTorch's SDPA (padded: one call; packed: one call per sequence)"),
            Provider("auto", _auto, label='btlib backend="auto" (the kernel measured fastest here)'),
            Provider("btlib_v3", _v3, available=lambda: get("cpu_flash_v3").available(),
                     label="btlib C++ v3: cpu_flash_v3 (padded) / cpu_flash_varlen (packed)"),
            Provider("btlib_amx", _amx, available=lambda: get("cpu_amx_varlen").available(),
                     label="btlib C++ v3 with both products on AMX tiles: cpu_amx_varlen (packed, bf16)")]


def auto_table(rows: list[dict]) -> str:
    """Per case: auto's pick, SDPA time / auto time, SDPA time / the fastest btlib kernel's time, and that kernel."""
    by = {}
    for r in rows:
        by.setdefault(r["x"], {})[r["provider"]] = r
    env = rows[0].get("env", {}) if rows else {}
    lines = [f"CPU {env.get('cpu')}, btlib build {env.get('isa')}, torch {env.get('torch')} ({env.get('torch_capability')}), "
             f"{env.get('threads')} threads; medians",
             f"{'case':22} {'auto takes':18} {'SDPA / auto':>12} {'SDPA / best btlib':>18}  best btlib kernel"]
    for case, provs in by.items():
        sdpa, auto = provs.get("sdpa"), provs.get("auto")
        if not sdpa or sdpa.get("status") != "ok":
            lines.append(f"{case:22} (SDPA not timed: {sdpa.get('reason') if sdpa else 'missing'})")
            continue
        ours = [r for n, r in provs.items() if n not in ("sdpa", "auto") and r.get("status") == "ok"]
        best = min(ours, key=lambda r: r["median_ms"]) if ours else None
        pick = (auto or {}).get("auto_pick", "?")
        a = f"{sdpa['median_ms'] / auto['median_ms']:.2f}" if auto and auto.get("status") == "ok" else "-"
        b = f"{sdpa['median_ms'] / best['median_ms']:.2f}" if best else "-"
        lines.append(f"{case:22} {pick:18} {a:>12} {b:>18}  {best['provider'] if best else '-'}")
    lines.append("(ratios above 1: SDPA takes longer; btlib_v3 is cpu_flash_v3 padded, cpu_flash_varlen packed; btlib_amx is cpu_amx_varlen)")
    return "\n".join(lines)


declare(Benchmark(
    name="attention_auto",
    description="what backend='auto' takes here vs PyTorch's SDPA (padded, or once per sequence) and every btlib kernel, fp32 and bf16",
    x_name="case", x_vals=CASES,
    providers=_providers,
    make_inputs=_inputs,
    reference=lambda x: x["ref"],
    error=lambda out, ref, x: relative_error(out, ref) / x["tol"],  # in units of the tolerance
    tol=1.0,
    params={"H": 12, "D": 64, "tokens": 2048},
    quick={"H": 2, "D": 32, "tokens": 128, "T": 64, "lengths": _QUICK_MIX},
    baseline="sdpa",  # no FLOP rate: one provider list spans fp32 and bf16 cases, whose bounds differ (notebook 04's roofline has them)
    metrics=lambda out, ref, x: {"auto_pick": x["auto_pick"]},
    summary=auto_table,
))
