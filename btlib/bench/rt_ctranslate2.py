"""CTranslate2 on the same local model: converted once by its transformers converter, run as an Encoder.

    path = ct2_model(folder)                        # cached under build/ctranslate2/<key>/ (fp32 weights)
    emb = ct2_encode(ct2_encoder(path, "int8"), tokenizer_ids, batch_size=32, sort=True)

One conversion (``TransformersConverter(folder).convert(quantization="float32")``), two compute types chosen
when the model is loaded: "float32", and "int8" (int8 weights per output channel and int8 activations in its
GEMMs, the rest fp32; CTranslate2 quantizes the fp32 weights as it loads them). ``key`` = the weights'
sha256, the settings and the versions of torch, transformers and ctranslate2. The Encoder runs on "cpu"
with intra_threads = torch's thread count; it gets the padded batch and the lengths, so padding is masked
inside CTranslate2 exactly as the attention mask does elsewhere.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import torch

from . import runtimes

__all__ = ["CT2_SETTINGS", "CT2_COMPUTE_TYPES", "ct2_available", "ct2_model", "ct2_encoder", "ct2_encode"]

CT2_SETTINGS = {"converter": "ctranslate2.converters.TransformersConverter", "quantization": "float32"}
CT2_COMPUTE_TYPES = ("float32", "int8")


def ct2_available() -> str | None:
    """None if ctranslate2 imports, else why not (and what to install)."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        return "ctranslate2 is not installed (pip install -e '.[compare]', or pip install ctranslate2)"
    return None


def _convert(folder: Path, out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the converter loads the folder with transformers
    from ctranslate2.converters import TransformersConverter
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    TransformersConverter(str(folder)).convert(str(out), quantization=CT2_SETTINGS["quantization"], force=True)


def ct2_model(folder: str | Path) -> Path:
    """The cached CTranslate2 model folder of ``folder``'s model (made on first use, ~6 s on 2 cores)."""
    folder = Path(folder)
    d = runtimes.cache_root() / "ctranslate2" / runtimes.artefact_key(folder, CT2_SETTINGS, ("ctranslate2",))
    return runtimes.cached_dir(d, lambda tmp: _convert(folder, tmp))


@functools.lru_cache(maxsize=4)
def _encoder(path: str, compute_type: str, threads: int):
    import ctranslate2

    return ctranslate2.Encoder(path, device="cpu", compute_type=compute_type, intra_threads=threads, inter_threads=1)


def ct2_encoder(path: str | Path, compute_type: str = "float32"):
    """A ctranslate2.Encoder on ``path`` at torch's thread count (cached); compute_type "float32" or "int8"."""
    if compute_type not in CT2_COMPUTE_TYPES:
        raise ValueError(f"compute_type must be one of {CT2_COMPUTE_TYPES}; got {compute_type!r}")
    return _encoder(str(path), compute_type, torch.get_num_threads())


def ct2_encode(encoder, ids: list[list[int]], batch_size: int, *, sort: bool, pad_id: int = 0) -> torch.Tensor:
    """:func:`btlib.bench.runtimes.padded_encode` with a CTranslate2 Encoder as the forward: (N, d) float32."""
    from ctranslate2 import StorageView

    def run(tokens: torch.Tensor, mask: torch.Tensor):
        out = encoder.forward_batch(StorageView.from_array(tokens.int().numpy()),
                                    StorageView.from_array(mask.sum(1).int().numpy()))  # ids (B, T), lengths (B,)
        return np.asarray(out.last_hidden_state)  # (B, T, d) float32

    return runtimes.padded_encode(run, ids, batch_size, sort=sort, pad_id=pad_id)
