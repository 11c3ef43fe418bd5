"""fastembed (Qdrant's embedding library, ONNX Runtime inside) on the same local model, nothing downloaded.

    model = fastembed_model(folder, max_length=256)     # a TextEmbedding on build/fastembed/<key>/
    emb = fastembed_encode(model, texts, batch_size=32)  # its own tokenizer, padding, pooling and normalisation

fastembed normally downloads an ONNX export from the hub; ``specific_model_path`` points it at a local
folder instead, which :func:`fastembed_folder` lays out once from the model folder: tokenizer.json,
special_tokens_map.json and config.json as they are, tokenizer_config.json with ``model_max_length`` set to
btlib's max length (fastembed truncates at that key; the folder's own says 512, sentence-transformers
and btlib truncate at 256), and model.onnx = btlib.bench.runtimes' fp32 export (the graph fastembed's own
download is: a plain export, no ORT fusions). fastembed then tokenizes, pads per batch in the given
order, runs ORT (intra_op threads = torch's thread count), mean-pools and normalises: what a user gets.
fastembed picks the pooling by model name, so this is for all-MiniLM-L6-v2 (:data:`FASTEMBED_NAME`); the
benchmark's cosine check against btlib catches any other mismatch before anything is timed.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from . import runtimes

__all__ = ["FASTEMBED_NAME", "fastembed_available", "fastembed_folder", "fastembed_model", "fastembed_encode"]

FASTEMBED_NAME = "sentence-transformers/all-MiniLM-L6-v2"  # fastembed's entry for it: mean pooling, normalised
_COPIED = ("tokenizer.json", "special_tokens_map.json", "config.json")


def fastembed_available() -> str | None:
    """None if fastembed and the ONNX export's packages (onnx, onnxruntime) import, else why not."""
    try:
        import fastembed  # noqa: F401
    except ImportError:
        return "fastembed is not installed (pip install -e '.[compare]', or pip install fastembed)"
    return runtimes.onnx_available()


def _lay_out(folder: Path, max_length: int, onnx: Path, out: Path) -> None:
    for name in _COPIED:
        shutil.copyfile(folder / name, out / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": max_length}, indent=1))
    try:
        os.link(onnx, out / "model.onnx")  # a hard link: no second 90 MB copy where the file system allows it
    except OSError:
        shutil.copyfile(onnx, out / "model.onnx")


def fastembed_folder(folder: str | Path, max_length: int) -> Path:
    """The local folder fastembed loads (see the module docstring), made once under build/fastembed/<key>/."""
    folder = Path(folder)
    onnx = runtimes.onnx_model(folder, "fp32")
    settings = {"onnx": onnx.parent.name, "max_length": max_length}
    d = runtimes.cache_root() / "fastembed" / runtimes.artefact_key(folder, settings, ("fastembed",))
    return runtimes.cached_dir(d, lambda tmp: _lay_out(folder, max_length, onnx, tmp))


@functools.lru_cache(maxsize=2)
def _model(path: str, threads: int):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from fastembed import TextEmbedding

    return TextEmbedding(FASTEMBED_NAME, specific_model_path=path, threads=threads, cache_dir=str(Path(path).parent / "hub"))


def fastembed_model(folder: str | Path, max_length: int):
    """fastembed.TextEmbedding on :func:`fastembed_folder` at torch's thread count (cached)."""
    return _model(str(fastembed_folder(folder, max_length)), torch.get_num_threads())


def fastembed_encode(model, texts: Sequence[str], batch_size: int) -> torch.Tensor:
    """fastembed's own embed(), text in, (N, d) float32 out (it tokenizes, pools and normalises)."""
    return torch.from_numpy(np.stack(list(model.embed(list(texts), batch_size=batch_size))))
