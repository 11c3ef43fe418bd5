"""What people run today to embed text on a CPU: sentence-transformers and ONNX Runtime, on the same local model.

    st = sentence_transformer(folder)                 # its own encode: sorts by length, pads per batch
    path = onnx_model(folder, "opt")                  # exported once, cached under build/onnx/<key>/
    emb = ort_encode(ort_session(path), tokenizer, texts, batch_size=32, sort=True)

ONNX variants, each made once from the one before and cached (``key`` = the weights' sha256 and
the exporter settings, so new weights or a new torch never reuse a stale file):

    fp32   torch.onnx.export(dynamo=False, opset 17) of transformers' BertModel, dynamic batch/sequence
    opt    onnxruntime.transformers' optimizer (model_type bert): fused Attention, SkipLayerNorm, BiasGelu
    int8   onnxruntime.quantization.quantize_dynamic of ``opt``: int8 weights per channel (reduce_range),
           uint8 activations with one dynamic scale per tensor (ORT's documented CPU recipe)

Sessions run with ORT_ENABLE_ALL and torch's thread count. Nothing is downloaded: the model folder
is local and HF_HUB_OFFLINE=1 is set before transformers or sentence-transformers load it.

The other engines' modules (rt_openvino, rt_ctranslate2, rt_fastembed) share this module's cache
(:func:`cache_root`, :func:`artefact_key`, :func:`cached_dir`), its traced model (:func:`hidden_model`)
and its padded runner (:func:`padded_encode`): one batching, padding and pooling for every engine.
"""

from __future__ import annotations

import functools
import hashlib
import json
import importlib.metadata
import os
import shutil
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

__all__ = ["ONNX_SETTINGS", "onnx_available", "st_available", "cache_root", "onnx_dir", "artefact_key", "cached_dir",
           "hidden_model", "onnx_model", "ort_session", "ort_encode", "padded_encode", "sentence_transformer", "st_encode",
           "batch_order"]

ONNX_SETTINGS = {"exporter": "torch.onnx.export(dynamo=False)", "opset": 17, "optimizer": "bert, opt_level 1",
                 "quantize": "dynamic, QInt8 weights per channel, reduce_range"}


def onnx_available() -> str | None:
    """None if onnx and onnxruntime import, else why not (and what to install)."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError as e:
        return f"{e.name} is not installed (pip install -e '.[compare]')"
    return None


def st_available() -> str | None:
    """None if sentence-transformers imports, else why not."""
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        return "sentence-transformers is not installed (pip install -e '.[compare]')"
    return None


def cache_root() -> Path:
    """Where converted models go: <checkout>/build, else (an installed btlib) ~/.cache/btlib."""
    root = Path(__file__).resolve().parents[2]
    return root / "build" if (root / "pyproject.toml").is_file() else Path.home() / ".cache" / "btlib"


def onnx_dir() -> Path:
    """$BTLIB_ONNX_DIR, else cache_root()/onnx."""
    if os.environ.get("BTLIB_ONNX_DIR"):
        return Path(os.environ["BTLIB_ONNX_DIR"])
    return cache_root() / "onnx"


@functools.lru_cache(maxsize=4)
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def artefact_key(folder: Path, settings: dict, packages: Sequence[str] = ()) -> str:
    """16 hex digits naming a converted model: the weights' sha256, the conversion settings, torch's and
    transformers' versions and those of ``packages`` (the converter's), so nothing stale is ever reused."""
    versions = {name: importlib.metadata.version(name) for name in ("transformers", *packages)}
    facts = {"weights": _sha256(folder / "model.safetensors"), **settings, "torch": torch.__version__, **versions}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def _key(folder: Path) -> str:
    return artefact_key(folder, ONNX_SETTINGS)


def cached_dir(d: Path, make: Callable[[Path], None]) -> Path:
    """``d``, made on first use: ``make(tmp)`` fills a temporary sibling folder that is then renamed to ``d``
    (atomic: a concurrent process sees no folder or the whole one; if it made ``d`` first, its copy is kept)."""
    if d.is_dir():
        return d
    tmp = d.parent / f".{d.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        make(tmp)
        os.replace(tmp, d)
    except OSError:
        if not d.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return d


EXAMPLE_IDS = torch.tensor([[101, 7592, 2088, 102], [101, 7592, 102, 0]])  # (2, 4): "[CLS] hello world [SEP]", one padded


def hidden_model(folder: Path, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """transformers' BertModel of ``folder`` (offline, eval) as forward(input_ids, attention_mask, token_type_ids)
    -> last_hidden_state (B, T, d) float32: the graph every converter traces (the pooler is left out)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModel.from_pretrained(str(folder), attn_implementation=attn_implementation).eval()

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state

    return Hidden()


def _export(folder: Path, out: Path) -> None:
    ids = EXAMPLE_IDS
    names = ["input_ids", "attention_mask", "token_type_ids"]
    axes = {n: {0: "batch", 1: "sequence"} for n in names} | {"last_hidden_state": {0: "batch", 1: "sequence"}}
    with torch.no_grad():  # eager attention: the pattern ORT's optimizer fuses
        torch.onnx.export(hidden_model(folder, "eager"), (ids, (ids != 0).long(), torch.zeros_like(ids)), str(out),
                          input_names=names, output_names=["last_hidden_state"], dynamic_axes=axes,
                          opset_version=ONNX_SETTINGS["opset"], dynamo=False)


def onnx_model(folder: str | Path, variant: str = "fp32") -> Path:
    """The cached ONNX file of ``folder``'s model: variant "fp32", "opt" or "int8" (see the module docstring).

    Made on first use (the export takes ~10 s, the optimizer and quantizer a few more), then reused.
    """
    if variant not in ("fp32", "opt", "int8"):
        raise ValueError(f"variant must be 'fp32', 'opt' or 'int8'; got {variant!r}")
    folder = Path(folder)
    d = onnx_dir() / _key(folder)
    path = d / f"model_{variant}.onnx"
    if path.is_file():
        return path
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{variant}.{os.getpid()}.onnx"
    if variant == "fp32":
        _export(folder, tmp)
    elif variant == "opt":
        from onnxruntime.transformers.optimizer import optimize_model

        cfg = json.loads((folder / "config.json").read_text())
        opt = optimize_model(str(onnx_model(folder, "fp32")), model_type="bert", num_heads=cfg["num_attention_heads"],
                             hidden_size=cfg["hidden_size"], opt_level=1)
        opt.save_model_to_file(str(tmp))
    else:
        from onnx import TensorProto
        from onnxruntime.quantization import QuantType, quantize_dynamic

        # DefaultTensorType: shape inference cannot type the outputs of the optimizer's com.microsoft ops
        quantize_dynamic(str(onnx_model(folder, "opt")), str(tmp), weight_type=QuantType.QInt8, per_channel=True,
                         reduce_range=True, extra_options={"DefaultTensorType": TensorProto.FLOAT})
    (d / "settings.json").write_text(json.dumps({**ONNX_SETTINGS, "folder": folder.name}, indent=1))
    os.replace(tmp, path)  # atomic: a concurrent process sees no file or the whole file
    return path


@functools.lru_cache(maxsize=8)
def _session(path: str, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def ort_session(path: str | Path):
    """An onnxruntime CPU session on ``path`` with ORT_ENABLE_ALL and torch's thread count (cached)."""
    return _session(str(path), torch.get_num_threads())


def batch_order(lengths: Sequence[int], sort: bool) -> list[int]:
    """Indices in the order they are batched: as given, or longest first (sentence-transformers' order)."""
    idx = list(range(len(lengths)))
    return sorted(idx, key=lambda i: -lengths[i]) if sort else idx


def padded_encode(run: Callable[[torch.Tensor, torch.Tensor], object], ids: list[list[int]], batch_size: int, *,
                  sort: bool, pad_id: int = 0) -> torch.Tensor:
    """Mean-pooled, L2-normalised embeddings (N, d) float32 from token ids (N lists), padded per batch.

    run(tokens (B, T) int64, mask (B, T) int64) -> last hidden state (B, T, d) float32 (a tensor or a numpy
    array): one engine's forward. sort: batch longest-first (less padding), then restore the input order.
    """
    order = batch_order([len(s) for s in ids], sort)
    out = [None] * len(ids)
    for i in range(0, len(ids), batch_size):
        chunk = order[i:i + batch_size]
        T = max(len(ids[j]) for j in chunk)
        tokens = torch.tensor([ids[j] + [pad_id] * (T - len(ids[j])) for j in chunk])  # (B, T)
        mask = torch.tensor([[1] * len(ids[j]) + [0] * (T - len(ids[j])) for j in chunk])
        h = torch.as_tensor(run(tokens, mask)).float()  # (B, T, d)
        keep = mask.unsqueeze(-1).to(h.dtype)
        for j, e in zip(chunk, F.normalize((h * keep).sum(1) / keep.sum(1), dim=-1)):
            out[j] = e
    return torch.stack(out)


def ort_encode(session, ids: list[list[int]], batch_size: int, *, sort: bool, pad_id: int = 0) -> torch.Tensor:
    """:func:`padded_encode` with an onnxruntime session as the forward: (N, d) float32."""
    def run(tokens: torch.Tensor, mask: torch.Tensor):
        return session.run(None, {"input_ids": tokens.numpy(), "attention_mask": mask.numpy(),
                                  "token_type_ids": torch.zeros_like(tokens).numpy()})[0]
    return padded_encode(run, ids, batch_size, sort=sort, pad_id=pad_id)


@functools.lru_cache(maxsize=2)
def sentence_transformer(folder: str | Path):
    """sentence_transformers.SentenceTransformer on the local folder, CPU, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return SentenceTransformer(str(folder), device="cpu", local_files_only=True)


def st_encode(model, texts: Sequence[str], batch_size: int) -> torch.Tensor:
    """sentence-transformers' own encode (it sorts by length and pads per batch): (N, d) float32."""
    return model.encode(list(texts), batch_size=batch_size, convert_to_tensor=True, show_progress_bar=False)
