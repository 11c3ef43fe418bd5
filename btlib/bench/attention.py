"""Attention benchmarks, with every registered kernel as a provider.

- ``attention_dense``: (B, H, T, D) without padding, time against T. FLOPs 4 B H T^2 D
  (QK^T and PV); bytes 16 B H T D (read q, k, v, write o in fp32): what a fused kernel must move.
  :func:`dense_qkv`, :func:`attn_flops` and :func:`attn_bytes` serve the other attention benchmarks too.
- ``attention_varlen``: one batch at a chosen padding fraction, padded kernels (which compute
  the padding) against varlen kernels on the packed tokens. Useful FLOPs 4 H D sum(L_i^2).
"""

from __future__ import annotations

import torch

from ..kernels import kernels, relative_error
from ..lengths import attention_flops, uniform_lengths
from ..padding import pack
from ..reference import reference_attention
from .core import Benchmark, Provider, declare


def attn_flops(p: dict) -> float:
    """4 B H T^2 D: QK^T and PV, two multiply-adds per score and output element."""
    return 4.0 * p["B"] * p["H"] * p["T"] ** 2 * p["D"]


def attn_bytes(p: dict) -> float:
    """Read q, k, v and write o once, in p["dtype"] (fp32 by default): what a fused kernel must move."""
    return 4.0 * p.get("dtype", torch.float32).itemsize * p["B"] * p["H"] * p["T"] * p["D"]


def _qkv(B: int, H: int, T: int, D: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g) for _ in range(3)]


def dense_qkv(p: dict) -> dict:
    """Seeded q, k, v (B, H, T, D), drawn in fp32 on the CPU, then moved to p["device"] in p["dtype"]."""
    device, dtype = p.get("device", "cpu"), p.get("dtype", torch.float32)
    q, k, v = (x.to(device, dtype) for x in _qkv(p["B"], p["H"], p["T"], p["D"], p.get("seed", 0)))
    return {"q": q, "k": k, "v": v}


def _listed(k) -> bool:
    """CPU kernels for fp32 worth timing here. The teaching versions v1/v2 (priority < -10) are slow on purpose and
    have their own benchmark (cpu_attention_versions); the naive reference stays as the baseline to beat. A kernel
    registered for bf16 only (cpu_amx_varlen) is not offered fp32 inputs: these benchmarks hold fp32 to 1e-5."""
    return "cpu" in k.devices and torch.float32 in k.dtypes and (k.priority >= -10 or k.name == "reference")


def _dense_providers() -> list[Provider]:
    return [Provider(k.name, lambda x, k=k: k.fn(x["q"], x["k"], x["v"], lengths=None, causal=False, scale=None),
                     available=lambda k=k: k.available(), label=k.description)
            for k in kernels("padded") if _listed(k)]


declare(Benchmark(
    name="attention_dense",
    description="attention on (B, H, T, D) without padding, fp32, every padded kernel",
    x_name="T", x_vals=(128, 256, 512, 1024),
    providers=_dense_providers,
    make_inputs=dense_qkv,
    reference=lambda x: reference_attention(x["q"], x["k"], x["v"]),
    error=lambda out, ref, x: relative_error(out, ref),
    tol=1e-5,
    params={"B": 8, "H": 12, "D": 64},
    quick={"B": 2, "H": 2, "D": 32, "x_vals": (32, 97)},
    flops=attn_flops, bytes=attn_bytes, baseline="torch_sdpa",
))


def _varlen_inputs(p: dict) -> dict:
    B, H, T, D = p["B"], p["H"], p["T"], p["D"]
    lengths = uniform_lengths(B, T, p["padding"], seed=p.get("seed", 0))
    q, k, v = _qkv(B, H, T, D, p.get("seed", 0))
    packed = [pack(x.transpose(1, 2), lengths).tokens.contiguous() for x in (q, k, v)]  # (total, H, D)
    cu_seqlens, max_seqlen = pack(q.transpose(1, 2), lengths)[1:]
    return {"q": q, "k": k, "v": v, "lengths": lengths, "packed": packed, "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}


def _varlen_reference(x: dict) -> dict:
    out = reference_attention(x["q"], x["k"], x["v"], lengths=x["lengths"])  # (B, H, T, D), padded rows 0
    return {"padded": out, "packed": pack(out.transpose(1, 2), x["lengths"]).tokens}


def _varlen_error(out: torch.Tensor, ref: dict, x: dict) -> float:
    return relative_error(out, ref["padded"] if out.dim() == 4 else ref["packed"])


def _varlen_providers() -> list[Provider]:
    padded = [Provider(k.name, lambda x, k=k: k.fn(x["q"], x["k"], x["v"], lengths=x["lengths"], causal=False, scale=None),
                       available=lambda k=k: k.available(), label=k.description)
              for k in kernels("padded") if _listed(k) and k.name != "reference"]
    varlen = [Provider(k.name, lambda x, k=k: k.fn(*x["packed"], x["cu_seqlens"], x["max_seqlen"], causal=False, scale=None),
                       available=lambda k=k: k.available(), label=k.description)
              for k in kernels("varlen") if _listed(k) and k.name != "reference_varlen"]
    return padded + varlen


def varlen_flops(p: dict) -> float:
    """4 H D sum(L_i^2): the FLOPs of attention on the real tokens of a uniform_lengths batch at p["padding"].

    With p["window"] = (left, right) and/or p["causal"], only the allowed pairs count (btlib.lengths.attention_flops).
    """
    L = uniform_lengths(p["B"], p["T"], p["padding"], seed=p.get("seed", 0))
    return attention_flops(L, p["H"], p["D"], causal=p.get("causal", False), window=p.get("window"))


declare(Benchmark(
    name="attention_varlen",
    description="attention on a padded batch at a given padding fraction: padded kernels vs varlen kernels on packed tokens",
    x_name="padding", x_vals=(0.0, 0.25, 0.5, 0.75),
    providers=_varlen_providers,
    make_inputs=_varlen_inputs,
    reference=_varlen_reference,
    error=_varlen_error,
    tol=1e-5,
    params={"B": 8, "H": 12, "D": 64, "T": 512},
    quick={"B": 4, "H": 2, "D": 32, "T": 64, "x_vals": (0.0, 0.5)},
    flops=varlen_flops, baseline="torch_sdpa",
))
