"""cpu_attention_versions: this folder's v1 and v2 beside v3, the naive reference and SDPA (notebook 04).

Time against T on a small batch, fp32, every provider checked against btlib.reference_attention first (v1 and
v2 are plain scalar loops, tens of times slower than v3). Declared here, beside the kernels it times; the
harness (btlib.bench) runs it: ``python -m btlib.bench run cpu_attention_versions``.
"""

from __future__ import annotations

from ....bench.attention import attn_bytes, attn_flops, dense_qkv
from ....bench.core import Benchmark, Provider, declare
from ....reference import reference_attention
from ...registry import get, kernels, relative_error

_VERSIONS = ("reference", "cpu_naive_v1", "cpu_tiled_v2", "cpu_flash_v3", "torch_sdpa")


def _padded_provider(name: str) -> Provider:
    k = get(name)
    return Provider(name, lambda x: k.fn(x["q"], x["k"], x["v"], lengths=None, causal=False, scale=None),
                    available=k.available, label=k.description)


def _version_providers() -> list[Provider]:
    names = {k.name for k in kernels("padded")}
    return [_padded_provider(n) for n in _VERSIONS if n in names]


declare(Benchmark(
    name="cpu_attention_versions",
    description="C++ v1 (materialise), v2 (tiled, two passes), v3 (online softmax, SIMD) vs reference and SDPA, fp32",
    x_name="T", x_vals=(128, 256, 512, 1024),
    providers=_version_providers,
    make_inputs=dense_qkv,
    reference=lambda x: reference_attention(x["q"], x["k"], x["v"]),
    error=lambda out, ref, x: relative_error(out, ref),
    tol=1e-5,
    params={"B": 2, "H": 4, "D": 64},
    quick={"B": 1, "H": 2, "D": 32, "x_vals": (64, 97)},
    flops=attn_flops, bytes=attn_bytes, baseline="torch_sdpa",
))
