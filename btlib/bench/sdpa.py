"""PyTorch 2 attention benchmarks (notebook 03): SDPA's backends, masks, MHA, training, torch.compile.

- ``sdpa_backends``: F.scaled_dot_product_attention with each backend forced (a backend that
  refuses the inputs or this device is reported with torch's reason) against naive attention.
  FLOPs 4 B H T^2 D; the naive path also writes and reads the (B, H, T, T) scores: 8 B H T^2 bytes.
- ``sdpa_causal``: is_causal=True against the same causal mask passed explicitly (bool, float)
  and naive masked attention. Useful FLOPs 2 B H T^2 D (half the score matrix).
- ``mha_need_weights``: nn.MultiheadAttention returning the (B, T, T) weights or not.
- ``mha_masks``: key padding, a causal attn_mask, and both (merged into one (B, H, T, S) mask).
- ``gpt_train``: forward + backward of the small causal GPT block, SDPA against naive attention;
  checked on the loss and every gradient.
- ``encoder_compile``: torch.compile of an eval encoder against eager. Compilation happens in
  make_inputs (untimed); its wall time is kept in :data:`COMPILE_SECONDS`.
- ``gpt_compile``: torch.compile of the GPT training step (forward + backward, nanoGPT's
  ``model = torch.compile(model)``) against eager, the same way: compile time apart, in COMPILE_SECONDS.

:func:`btlib.bench.peak_memory` measures the peak tensor memory of one call on CPU or CUDA.
Every input is built on ``params["device"]`` ("cpu" by default; pass "cuda" on a GPU).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import relative_error
from ..lengths import uniform_lengths
from ..models import BERT_BASE, TINY, build_encoder, dense_twin
from ..models.gpt import GPTConfig, build_gpt, gpt_batch, train_step, with_attention
from ..padding import lengths_to_padding_mask, pack
from ..reference import naive_attention, reference_attention
from ..sdpa import forced_backend
from .attention import attn_flops, dense_qkv
from .core import Benchmark, Provider, declare

__all__ = ["COMPILE_SECONDS"]


def _forced(backend: str, **kw) -> Callable[[dict], torch.Tensor]:
    def fn(x: dict) -> torch.Tensor:
        with forced_backend(backend):
            return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], **kw)
    return fn


_ATTN = dict(params={"B": 4, "H": 8, "D": 64, "device": "cpu"}, quick={"B": 2, "H": 2, "D": 32, "x_vals": (32, 97)})
_err = lambda out, ref, x: relative_error(out, ref)  # noqa: E731

declare(Benchmark(
    name="sdpa_backends",
    description="F.scaled_dot_product_attention with each backend forced, against naive attention, fp32",
    x_name="T", x_vals=(128, 512, 1024),
    providers=lambda: [
        Provider("sdpa", lambda x: F.scaled_dot_product_attention(x["q"], x["k"], x["v"]), label="SDPA's own choice"),
        *(Provider(b.lower(), _forced(b), label=f"forced {b}")
          for b in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")),
        Provider("naive", lambda x: naive_attention(x["q"], x["k"], x["v"]), label="matmul-softmax-matmul"),
    ],
    make_inputs=dense_qkv, reference=lambda x: reference_attention(x["q"], x["k"], x["v"]),
    error=_err, tol=1e-5, **_ATTN, flops=attn_flops, baseline="naive",
))


def _causal_inputs(p: dict) -> dict:
    x = dense_qkv(p)
    T = p["T"]
    keep = torch.ones(T, T, dtype=torch.bool, device=x["q"].device).tril()  # (T, T), True = may attend
    x.update(bool_mask=keep, float_mask=torch.zeros(T, T, device=keep.device).masked_fill(~keep, float("-inf")))
    return x


declare(Benchmark(
    name="sdpa_causal",
    description="causal attention: is_causal=True vs the same mask passed explicitly vs naive, fp32",
    x_name="T", x_vals=(128, 512, 1024),
    providers=lambda: [
        Provider("is_causal", lambda x: F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True)),
        Provider("bool_mask", lambda x: F.scaled_dot_product_attention(x["q"], x["k"], x["v"], attn_mask=x["bool_mask"])),
        Provider("float_mask", lambda x: F.scaled_dot_product_attention(x["q"], x["k"], x["v"], attn_mask=x["float_mask"])),
        Provider("naive", lambda x: naive_attention(x["q"], x["k"], x["v"], x["bool_mask"])),
    ],
    make_inputs=_causal_inputs, reference=lambda x: reference_attention(x["q"], x["k"], x["v"], causal=True),
    error=_err, tol=1e-5, **_ATTN, flops=lambda p: attn_flops(p) / 2, baseline="naive",
))


@functools.lru_cache(maxsize=4)
def _mha(d_model: int, nhead: int, device: str, seed: int = 0) -> nn.MultiheadAttention:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.MultiheadAttention(d_model, nhead, batch_first=True).to(device).eval()


def _mha_inputs(p: dict) -> dict:
    dev = p.get("device", "cpu")
    B, T, d = p["B"], p["T"], p["d_model"]
    g = torch.Generator().manual_seed(p.get("seed", 0))
    lengths = uniform_lengths(B, T, 0.25, seed=p.get("seed", 0))
    masks = {"none": (None, None), "key_padding": (lengths_to_padding_mask(lengths, T), None),
             "causal": (None, nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.bool))}
    masks["both"] = (masks["key_padding"][0], masks["causal"][1])
    kpm, attn_mask = masks[p.get("mask", "none")]
    to = lambda t: None if t is None else t.to(dev)  # noqa: E731
    return {"mha": _mha(d, p["nhead"], dev), "src": torch.randn(B, T, d, generator=g).to(dev),
            "kpm": to(kpm), "attn_mask": to(attn_mask), "lengths": lengths}


def _mha_call(x: dict, need_weights: bool, fastpath: bool = True):
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(fastpath)
    try:
        with torch.inference_mode():
            s = x["src"]
            return x["mha"](s, s, s, key_padding_mask=x["kpm"], attn_mask=x["attn_mask"], need_weights=need_weights)[0]
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def _mha_error(out: torch.Tensor, ref: torch.Tensor, x: dict) -> float:
    """At real query rows only: the fastpath writes 0 at padded rows, the slow path does not."""
    return relative_error(pack(out, x["lengths"]).tokens, pack(ref, x["lengths"]).tokens) if x["kpm"] is not None \
        else relative_error(out, ref)


_MHA = dict(params={"B": 8, "d_model": 768, "nhead": 12, "device": "cpu"},
            quick={"B": 4, "d_model": 64, "nhead": 4})

declare(Benchmark(
    name="mha_need_weights",
    description="nn.MultiheadAttention self-attention (eval, inference_mode): need_weights True vs False, fastpath on/off",
    x_name="T", x_vals=(128, 512),
    providers=lambda: [Provider(f"{'fast' if fp else 'slow'}_weights_{nw}", lambda x, nw=nw, fp=fp: _mha_call(x, nw, fp))
                       for fp in (True, False) for nw in (True, False)],
    make_inputs=_mha_inputs, reference=lambda x: _mha_call(x, False, False),
    error=_mha_error, tol=1e-5, params=_MHA["params"], quick={**_MHA["quick"], "x_vals": (32, 64)}, baseline="slow_weights_True",
))

declare(Benchmark(
    name="mha_masks",
    description="nn.MultiheadAttention (eval, inference_mode, need_weights=False) with key padding, causal attn_mask, both",
    x_name="mask", x_vals=("none", "key_padding", "causal", "both"),
    providers=lambda: [Provider("fastpath", lambda x: _mha_call(x, False, True)),
                       Provider("slow", lambda x: _mha_call(x, False, False))],
    make_inputs=_mha_inputs, reference=lambda x: _mha_call(x, False, False),
    error=_mha_error, tol=1e-5, params={**_MHA["params"], "T": 256}, quick={**_MHA["quick"], "T": 32}, baseline="slow",
))


def _gpt_inputs(p: dict) -> dict:
    dev = p.get("device", "cpu")
    cfg = GPTConfig(d_model=p["d_model"], n_head=p["n_head"], block_size=p["T"])
    sdpa = build_gpt(cfg, "sdpa").to(dev)
    idx, targets = gpt_batch(cfg, p["B"], device=dev)
    return {"sdpa": sdpa, "naive": with_attention(sdpa, "naive"), "reference": with_attention(sdpa, "naive"),
            "idx": idx, "targets": targets}


def _gpt_step(model: nn.Module, x: dict) -> torch.Tensor:
    loss, grads = train_step(model, x["idx"], x["targets"])
    return torch.cat([loss.view(1), grads])  # (1 + n_params,): the loss, then every gradient


def _gpt_flops(p: dict) -> float:
    """Attention only, forward + backward (3x forward), causal half: 3 * 2 B H T^2 D."""
    return 3 * 2.0 * p["B"] * p["T"] ** 2 * p["d_model"]


declare(Benchmark(
    name="gpt_train",
    description="forward + backward of a nanoGPT-style causal block (d 128, 4 heads): SDPA vs naive attention, fp32",
    x_name="T", x_vals=(64, 256, 1024),
    providers=lambda: [Provider("sdpa", lambda x: _gpt_step(x["sdpa"], x), label="is_causal=True (flash)"),
                       Provider("naive", lambda x: _gpt_step(x["naive"], x), label="masked_fill + softmax")],
    make_inputs=_gpt_inputs, reference=lambda x: _gpt_step(x["reference"], x),
    error=_err, tol=1e-5, params={"B": 16, "d_model": 128, "n_head": 4, "device": "cpu"},
    quick={"B": 4, "x_vals": (64, 128)}, flops=_gpt_flops, baseline="naive",
))

# (config, B, T, device) -> seconds of the first call of the compiled encoder (compile + run), or the error.
COMPILE_SECONDS: dict[tuple, float | str] = {}
_ENCODERS = {"bert_base": BERT_BASE, "bert_small": BERT_BASE.scaled(num_layers=4), "tiny": TINY}


@functools.lru_cache(maxsize=3)
def _compiled(name: str, device: str) -> tuple[nn.Module, Any]:
    enc = dense_twin(build_encoder(_ENCODERS[name], seed=0)).to(device).eval()
    return enc, torch.compile(enc)


def _compile_once(key: tuple, compiled: Any, first_call) -> Any:
    """``compiled`` once its first call (timed, into COMPILE_SECONDS[key], once per key) has worked; None if it failed.

    A failure is kept in COMPILE_SECONDS[key] as its message: inductor failing here is a result to report.
    """
    if key not in COMPILE_SECONDS:
        t0 = time.perf_counter()
        try:
            first_call()
            COMPILE_SECONDS[key] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - inductor failing here is a result to report
            COMPILE_SECONDS[key] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None if isinstance(COMPILE_SECONDS[key], str) else compiled


def _compile_inputs(p: dict) -> dict:
    dev, name, B, T = p.get("device", "cpu"), p["config"], p["B"], p["T"]
    enc, compiled = _compiled(name, dev)
    g = torch.Generator().manual_seed(p.get("seed", 0))
    lengths = uniform_lengths(B, T, 0.25, seed=p.get("seed", 0))
    x = {"eager": enc, "src": torch.randn(B, T, enc.layers[0].linear1.in_features, generator=g).to(dev),
         "mask": lengths_to_padding_mask(lengths, T).to(dev), "lengths": lengths, "compiled": None}

    def first_call():
        with torch.no_grad():
            compiled(x["src"], src_key_padding_mask=x["mask"])

    x["compiled"] = _compile_once((name, B, T, dev), compiled, first_call)
    return x


def _encode(module: nn.Module | None, x: dict) -> torch.Tensor:
    if module is None:
        raise RuntimeError(f"torch.compile failed: {COMPILE_SECONDS.get(next(reversed(COMPILE_SECONDS)))}")
    with torch.no_grad():
        return module(x["src"], src_key_padding_mask=x["mask"])


declare(Benchmark(
    name="encoder_compile",
    description="torch.compile of an eval nn.TransformerEncoder (no nested tensors) vs eager, fp32, under no_grad",
    x_name="T", x_vals=(64, 128),
    providers=lambda: [Provider("eager", lambda x: _encode(x["eager"], x)),
                       Provider("compiled", lambda x: _encode(x["compiled"], x), label="torch.compile, inductor")],
    make_inputs=_compile_inputs, reference=lambda x: _encode(x["eager"], x),
    error=lambda out, ref, x: relative_error(pack(out, x["lengths"]).tokens, pack(ref, x["lengths"]).tokens),
    tol=1e-4, params={"config": "bert_small", "B": 8, "device": "cpu"}, quick={"config": "tiny", "B": 4, "x_vals": (32,)},
    baseline="eager",
))


@functools.lru_cache(maxsize=4)
def _gpt_compiled(d_model: int, n_head: int, T: int, device: str) -> tuple[nn.Module, Any]:
    model = build_gpt(GPTConfig(d_model=d_model, n_head=n_head, block_size=T), "sdpa").to(device)
    return model, torch.compile(model, dynamic=False)  # one static graph per T, as a training run with fixed blocks has


def _gpt_compile_inputs(p: dict) -> dict:
    dev, T = p.get("device", "cpu"), p["T"]
    eager, compiled = _gpt_compiled(p["d_model"], p["n_head"], T, dev)
    idx, targets = gpt_batch(eager.cfg, p["B"], device=dev)
    x = {"eager": eager, "compiled": None, "idx": idx, "targets": targets}
    # the first call traces forward and backward and compiles both (Inductor: C++/OpenMP on CPU, Triton on GPU)
    x["compiled"] = _compile_once(("gpt_train_step", p["B"], T, dev), compiled, lambda: train_step(compiled, idx, targets))
    return x


def _compiled_step(x: dict) -> torch.Tensor:
    if x["compiled"] is None:
        raise RuntimeError(f"torch.compile failed: {COMPILE_SECONDS.get(next(reversed(COMPILE_SECONDS)))}")
    return _gpt_step(x["compiled"], x)


declare(Benchmark(
    name="gpt_compile",
    description="training step (forward + backward) of the nanoGPT-style block: torch.compile vs eager, fp32",
    x_name="T", x_vals=(64, 256),
    providers=lambda: [Provider("eager", lambda x: _gpt_step(x["eager"], x)),
                       Provider("compiled", _compiled_step, label="torch.compile, inductor")],
    make_inputs=_gpt_compile_inputs, reference=lambda x: _gpt_step(x["eager"], x),
    # 1e-4, not 1e-5: Inductor's fused kernels sum in another order, and the error is taken over every gradient
    error=_err, tol=1e-4, params={"B": 16, "d_model": 128, "n_head": 4, "device": "cpu"},
    quick={"B": 4, "x_vals": (64,)}, baseline="eager",
))
