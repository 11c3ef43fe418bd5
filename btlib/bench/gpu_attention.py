"""GPU attention benchmarks: btlib's Triton and CUDA kernels against SDPA's three CUDA backends and naive attention.

- ``gpu_attention``: (B, H, T, D) fp16 without padding, time against T. FLOPs 4 B H T^2 D;
  bytes 8 B H T D (read q, k, v and write o once, 2 bytes each): the fused kernels' HBM floor.
  Naive attention also writes and reads the (B, H, T, T) scores: ~4 B H T^2 more bytes in fp16.
- ``gpu_attention_varlen``: one batch at a padding fraction: padded kernels (SDPA with a boolean
  mask: flash refuses masks, so efficient and math) against btlib's kernels with lengths and on
  packed tokens. Useful FLOPs 4 H D sum(L_i^2).

Every provider says "needs a CUDA GPU" where there is none, so on a CPU the harness skips them
with that reason and builds nothing large (the reference is computed only when a provider runs).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..kernels import get, relative_error
from ..lengths import uniform_lengths
from ..padding import pack
from ..padding import zero_padded_rows
from ..reference import allowed_mask, naive_attention, reference_attention
from ..sdpa import forced_backend
from .attention import attn_bytes, attn_flops, dense_qkv, varlen_flops
from .core import Benchmark, Provider, declare

# fp16 output: a few fp16 ulps (2^-10) relative to the output's scale, whatever the summation order.
TOL_FP16 = 5e-3


def _need_gpu() -> str | None:
    return None if torch.cuda.is_available() else "needs a CUDA GPU"


def _kernel_available(name: str):
    def available() -> str | None:
        return _need_gpu() or get(name).available()

    return available


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sdpa(backend: str):
    def run(q, k, v, mask=None):
        with forced_backend(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return run


class _LazyReference:
    """The fp32 reference, computed on first use (one batch element at a time: (H, T, T) fp32 scores, not (B, H, T, T))."""

    def __init__(self, x: dict):
        self.x = x

    @functools.cached_property
    def padded(self) -> torch.Tensor:
        q, k, v, L = self.x["q"], self.x["k"], self.x["v"], self.x.get("lengths")
        return torch.cat([reference_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], lengths=None if L is None else L[b:b + 1])
                          for b in range(q.shape[0])])

    @functools.cached_property
    def packed(self) -> torch.Tensor:
        return pack(self.padded.transpose(1, 2), self.x["lengths"]).tokens  # (total, H, D)


def _error(out: torch.Tensor, ref: _LazyReference, x: dict) -> float:
    return relative_error(out.float(), ref.padded if out.dim() == 4 else ref.packed)


def _dense_inputs(p: dict) -> dict:
    return dense_qkv({**p, "device": _device(), "dtype": torch.float16})


def _bytes(p: dict) -> float:
    return attn_bytes({**p, "dtype": torch.float16})


def _dense_providers() -> list[Provider]:
    sdpa = [Provider(f"sdpa_{name.split('_')[0].lower()}", lambda x, f=_sdpa(name): f(x["q"], x["k"], x["v"]),
                     available=_need_gpu, label=f"F.scaled_dot_product_attention forced to {name}")
            for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")]
    ours = [Provider(name, lambda x, name=name: get(name).fn(x["q"], x["k"], x["v"], lengths=None, causal=False, scale=None),
                     available=_kernel_available(name), label=f"btlib {name}") for name in ("triton_flash", "cuda_flash")]
    naive = Provider("naive", lambda x: naive_attention(x["q"], x["k"], x["v"]), available=_need_gpu,
                     label="matmul-softmax-matmul in fp16 (scores in HBM)")
    return ours + sdpa + [naive]


declare(Benchmark(
    name="gpu_attention",
    description="GPU attention, (B, H, T, D) fp16 without padding: btlib Triton/CUDA vs SDPA flash/efficient/math vs naive",
    x_name="T", x_vals=(256, 512, 1024, 2048, 4096),
    providers=_dense_providers,
    make_inputs=_dense_inputs,
    reference=_LazyReference,
    error=_error,
    tol=TOL_FP16,
    params={"B": 4, "H": 16, "D": 64},
    quick={"B": 2, "H": 4, "D": 64, "x_vals": (128, 256)},
    flops=attn_flops, bytes=_bytes, baseline="sdpa_flash",
))


def _varlen_inputs(p: dict) -> dict:
    x = _dense_inputs(p)
    lengths = uniform_lengths(p["B"], p["T"], p["padding"], seed=p.get("seed", 0)).to(_device())
    x["lengths"] = lengths
    x["mask"] = allowed_mask(p["B"], p["T"], p["T"], lengths=lengths, device=_device())  # (B, 1, 1, T) keys
    x["packed"] = [pack(t.transpose(1, 2), lengths).tokens.contiguous() for t in (x["q"], x["k"], x["v"])]  # (total, H, D)
    x["cu_seqlens"], x["max_seqlen"] = pack(x["q"].transpose(1, 2), lengths)[1:]
    return x


def _varlen_providers() -> list[Provider]:
    padded = [Provider(f"sdpa_{name.split('_')[0].lower()}_masked",
                       lambda x, f=_sdpa(name): zero_padded_rows(f(x["q"], x["k"], x["v"], x["mask"]), x["lengths"]),
                       available=_need_gpu, label=f"SDPA forced to {name} with a boolean key mask (computes the padding)")
              for name in ("EFFICIENT_ATTENTION", "MATH")]
    padded.append(Provider("naive_masked", lambda x: zero_padded_rows(naive_attention(x["q"], x["k"], x["v"], x["mask"]), x["lengths"]),
                           available=_need_gpu, label="naive attention with the key mask"))
    ours = [Provider("triton_flash", lambda x: get("triton_flash").fn(x["q"], x["k"], x["v"], lengths=x["lengths"], causal=False,
                                                                      scale=None),
                     available=_kernel_available("triton_flash"), label="btlib Triton, padded batch + lengths (skips padded tiles)")]
    ours += [Provider(name, lambda x, name=name: get(name).fn(*x["packed"], x["cu_seqlens"], x["max_seqlen"], causal=False, scale=None),
                      available=_kernel_available(name), label=f"btlib {name} on packed tokens")
             for name in ("triton_flash_varlen", "cuda_flash_varlen")]
    return ours + padded


declare(Benchmark(
    name="gpu_attention_varlen",
    description="GPU attention on a padded batch at a padding fraction, fp16: masked SDPA/naive vs btlib with lengths and on packed tokens",
    x_name="padding", x_vals=(0.0, 0.25, 0.5, 0.75),
    providers=_varlen_providers,
    make_inputs=_varlen_inputs,
    reference=_LazyReference,
    error=_error,
    tol=TOL_FP16,
    params={"B": 8, "H": 16, "D": 64, "T": 2048},
    quick={"B": 4, "H": 4, "D": 64, "T": 256, "x_vals": (0.0, 0.5)},
    flops=varlen_flops, baseline="sdpa_efficient_masked",
))
