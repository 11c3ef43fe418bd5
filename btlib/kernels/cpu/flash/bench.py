"""attention_dense_bf16: this folder's v3 on bfloat16 inputs against SDPA in bfloat16 (notebook 04).

The check is btlib's low-precision rule (Kernel.tolerance): the error against the fp32 reference, divided by
twice SDPA's own bf16 error, must be <= 1. Declared here, beside the kernel it times; the harness (btlib.bench)
runs it: ``python -m btlib.bench run attention_dense_bf16``.
"""

from __future__ import annotations

import torch

from ....bench.attention import attn_bytes, attn_flops, dense_qkv
from ....bench.core import Benchmark, Provider, declare
from ....reference import reference_attention
from ...registry import get, kernels, relative_error

def _bf16_inputs(p: dict) -> dict:
    x = dense_qkv(p)
    return {**x, "bf16": [x[n].bfloat16() for n in ("q", "k", "v")]}


def _bf16_reference(x: dict) -> dict:
    ref = reference_attention(x["q"], x["k"], x["v"])
    sdpa_err = relative_error(get("torch_sdpa").fn(*x["bf16"]).float(), ref)
    return {"ref": ref, "sdpa_err": sdpa_err}


def _bf16_providers() -> list[Provider]:
    names = [k.name for k in kernels("padded") if torch.bfloat16 in k.dtypes and k.name in ("cpu_flash_v3", "torch_sdpa")]
    return [Provider(n, lambda x, k=get(n): k.fn(*x["bf16"], lengths=None, causal=False, scale=None),
                     available=get(n).available, label=get(n).description, precision="bf16") for n in names]


declare(Benchmark(
    name="attention_dense_bf16",
    description="bfloat16 attention on (B, H, T, D): C++ v3 (fp32 sums) vs SDPA; error in units of 2x SDPA's bf16 error",
    x_name="T", x_vals=(128, 256, 512, 1024),
    providers=_bf16_providers,
    make_inputs=_bf16_inputs,
    reference=_bf16_reference,
    error=lambda out, ref, x: relative_error(out.float(), ref["ref"]) / get("cpu_flash_v3").tolerance(torch.bfloat16, ref["sdpa_err"]),
    tol=1.0,
    params={"B": 8, "H": 12, "D": 64},
    quick={"B": 2, "H": 2, "D": 32, "x_vals": (32, 97)},
    flops=attn_flops, bytes=lambda p: attn_bytes({**p, "dtype": torch.bfloat16}), baseline="torch_sdpa",
))
