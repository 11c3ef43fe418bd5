"""ModernBERT end to end on a mixed-length batch of documents (notebook 08).

``modernbert_e2e``: one batch of B documents (the longest x tokens, the others log-uniform down to
x / spread, btlib.bench.windowed.document_lengths), random token ids, fp32, 2 threads in the notebook.

- ``transformers_sdpa``: transformers' ModernBertModel, attn_implementation "sdpa", on the padded
  batch with its attention mask: every layer computes the padding, and every local layer the whole
  (T, T) score matrix under a dense sliding-window mask. It is also the reference.
- ``btlib_packed``: btlib.load_pretrained on a folder that transformers wrote from the *same* model
  (same weights, bit for bit): packed tokens, no padding, local layers through
  btlib.varlen_attention(window=(64, 64)).
- ``ideal`` (:func:`btlib.bench.windowed.add_ideal`): the FLOPs that must be done, GEMMs on the real
  tokens plus window-aware attention (:func:`modernbert_flops`), over the measured fp32 matmul rate.

Checked on real tokens, relative to the reference's scale, to 1e-4: 22 pre-LN layers of fp32 GEMMs
summed in a different order drift by ~1e-6 each.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch

from ..kernels import relative_error
from ..lengths import attention_flops
from ..padding import lengths_to_cu_seqlens, lengths_to_padding_mask
from .core import Benchmark, Provider, declare
from .windowed import document_lengths

__all__ = ["MODERNBERT_SHAPES", "modernbert_flops", "modernbert_pair", "check"]

# ModernBERT-base's shape (answerdotai/ModernBERT-base): 22 layers, d 768, 12 heads, GeGLU 1152,
# local_attention 128 (window (64, 64)), every 3rd layer global from layer 0.
MODERNBERT_SHAPES = {
    "base": {"hidden_size": 768, "num_hidden_layers": 22, "num_attention_heads": 12, "intermediate_size": 1152,
             "vocab_size": 50368, "local_attention": 128, "max_position_embeddings": 8192},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2, "intermediate_size": 96,
             "vocab_size": 1000, "local_attention": 128, "max_position_embeddings": 8192},
}
_SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1, "sep_token_id": 2}


def modernbert_flops(lengths: torch.Tensor, shape: dict) -> float:
    """FLOPs of the encoder layers on the real tokens: GEMMs (Wqkv, Wo, GeGLU Wi, Wo: 8 d^2 + 6 d I per
    token and layer) plus attention, global on layers 0, 3, 6, ... and window (w/2, w/2) on the others."""
    d, n, H, inter = shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"], shape["intermediate_size"]
    half = shape["local_attention"] // 2
    gemm = (8 * d * d + 6 * d * inter) * float(lengths.sum()) * n
    n_global = len(range(0, n, 3))
    attn = n_global * attention_flops(lengths, H, d // H) + (n - n_global) * attention_flops(lengths, H, d // H, window=(half, half))
    return gemm + attn


@functools.lru_cache(maxsize=1)

def _save_quietly(model, folder: str) -> None:
    """model.save_pretrained(folder) without transformers' progress bar (a notebook would keep its 0% frame)."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(folder)
    finally:
        if shown:
            hf_logging.enable_progress_bar()

def modernbert_pair(shape_name: str, seed: int = 0):
    """(transformers ModernBertModel "sdpa", btlib's ModernBertEncoder) holding the same random weights.

    transformers builds the model in memory (seeded) and writes it to a temporary folder, which
    btlib.load_pretrained reads back: what btlib runs is exactly the file transformers runs.
    """
    import transformers as tf
    from tokenizers import Tokenizer, models

    from ..pretrained import load_pretrained

    cfg = tf.ModernBertConfig(**MODERNBERT_SHAPES[shape_name], **_SPECIAL)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = tf.ModernBertModel(cfg).eval()
    hf.config._attn_implementation = "sdpa"
    with tempfile.TemporaryDirectory() as tmp:
        _save_quietly(hf, tmp)
        Tokenizer(models.WordLevel({"[PAD]": 0, "[CLS]": 1, "[SEP]": 2, "[UNK]": 3}, unk_token="[UNK]")).save(
            str(Path(tmp) / "tokenizer.json"))  # the loader wants one; the benchmark feeds token ids
        ours = load_pretrained(tmp).eval()
    return hf, ours


def _inputs(p: dict) -> dict:
    shape = MODERNBERT_SHAPES[p["model"]]
    lengths = document_lengths(p["B"], p["T"], seed=p.get("seed", 0), spread=p["spread"])
    g = torch.Generator().manual_seed(p.get("seed", 0))
    ids = torch.randint(4, shape["vocab_size"], (int(lengths.sum()),), generator=g)  # (total,) real tokens only
    cu_seqlens, max_seqlen = lengths_to_cu_seqlens(lengths)
    real = ~lengths_to_padding_mask(lengths, p["T"])  # (B, T), True at real tokens
    padded = torch.zeros(p["B"], p["T"], dtype=torch.int64)
    padded[real] = ids
    hf, ours = modernbert_pair(p["model"])
    return {"key": (p["model"], p["B"], p["T"], p["spread"], p.get("seed", 0)), "hf": hf, "ours": ours, "ids": ids,
            "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, "padded": padded, "attention_mask": real.long(), "real": real}


def _transformers(x: dict) -> torch.Tensor:
    with torch.inference_mode():
        return x["hf"](input_ids=x["padded"], attention_mask=x["attention_mask"]).last_hidden_state  # (B, T, d)


def _btlib(x: dict) -> torch.Tensor:
    with torch.inference_mode():
        return x["ours"](x["ids"], x["cu_seqlens"], x["max_seqlen"])  # (total, d)


_REFERENCE: dict[tuple, torch.Tensor] = {}


def _reference(x: dict) -> torch.Tensor:
    """transformers' last hidden states of the real tokens (total, d); kept for the next rounds of run_rounds."""
    if x["key"] not in _REFERENCE:
        _REFERENCE.clear()
        _REFERENCE[x["key"]] = _transformers(x)[x["real"]]
    return _REFERENCE[x["key"]]


def _error(out: torch.Tensor, ref: torch.Tensor, x: dict) -> float:
    return relative_error(out[x["real"]] if out.dim() == 3 else out, ref)


def _transformers_available() -> str | None:
    try:
        import transformers  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as e:
        return f"needs transformers and tokenizers ({e}): pip install -e '.[lab]' (what make setup installs)"
    return None


def check(quick: bool | None = None, **params) -> dict:
    """The benchmark's check alone, untimed: btlib's packed model against transformers' on one batch of ``modernbert_e2e``'s
    (its params and x, quick ones under BTLIB_QUICK, ``params`` overriding, e.g. ``T=512`` for a shorter batch).

    Returns {"error": relative error on the real tokens, "tol", "lengths": (B,) documents, "model", "T"}, or
    {"why": ...} where transformers is missing.
    """
    from .core import quick_mode

    if why := _transformers_available():
        return {"why": why}
    quick = quick_mode() if quick is None else quick
    p = {**BENCH.params, "T": BENCH.x_vals[0], **(BENCH.quick if quick else {}), **params}
    p["T"] = params.get("T", p.pop("x_vals", (p["T"],))[0])
    x = _inputs(p)
    err = _error(_btlib(x), _reference(x), x)
    return {"error": err, "tol": BENCH.tol, "lengths": document_lengths(p["B"], p["T"], seed=p.get("seed", 0), spread=p["spread"]),
            "model": p["model"], "T": p["T"]}


BENCH = declare(Benchmark(
    name="modernbert_e2e",
    description="ModernBERT-base shape (22 layers, d 768, GeGLU 1152, window 128 every 2 of 3 layers), fp32, "
                "mixed-length documents: btlib packed vs transformers sdpa (padded, dense window masks)",
    x_name="T", x_vals=(2048,),
    providers=lambda: [
        Provider("btlib_packed", _btlib, available=_transformers_available, label="btlib ModernBERT, packed, window skip"),
        Provider("transformers_sdpa", _transformers, available=_transformers_available,
                 label="transformers ModernBertModel, sdpa, padded"),
    ],
    make_inputs=_inputs,
    reference=_reference,
    error=_error,
    tol=1e-4,
    params={"model": "base", "B": 4, "spread": 8.0},
    quick={"model": "tiny", "B": 3, "x_vals": (300,)},
    flops=lambda p: modernbert_flops(document_lengths(p["B"], p["T"], seed=p.get("seed", 0), spread=p["spread"]),
                                     MODERNBERT_SHAPES[p["model"]]),
    baseline="transformers_sdpa",
))
