"""OpenVINO on the same local model: converted once from transformers' BertModel, compiled per precision.

    path = ov_model(folder, "fp32")                 # cached under build/openvino/<key>/fp32/model.xml
    compiled = ov_compiled(path, hint="f32")        # INFERENCE_PRECISION_HINT=f32; hint=None: OpenVINO's default
    emb = ov_encode(compiled, tokenizer_ids, batch_size=32, sort=True)

Variants, each made once and cached (``key`` = the weights' sha256, the settings below and the
versions of torch, transformers, openvino and nncf, so nothing stale is reused):

    fp32          openvino.convert_model(BertModel, example_input=...), saved with compress_to_fp16=False
                  (save_model's default would store fp16 weights)
    int8_weights  nncf.compress_weights(mode=INT8_ASYM): int8 weights per output channel, activations and
                  arithmetic stay in the compiled precision (weight-only)
    int8_nncf     nncf.quantize(model_type=TRANSFORMER) calibrated on btlib.smoothquant.CALIBRATION_TEXTS (the
                  sentences btlib's own int8 is calibrated on): int8 weights and activations ("full" int8)

OpenVINO's converter and NNCF send usage telemetry unless opted out; the workbook sends nothing, so both
run with the switches they read for CI (``CI=true``, ``NNCF_CI=1``), set only while they convert or import.

Compiled on "CPU" with INFERENCE_NUM_THREADS = torch's thread count. Its default precision is bf16 on a CPU
with AVX512_BF16 (or AMX) and f32 elsewhere: :func:`ov_precision` says which one a compiled model runs.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import torch

from . import runtimes

__all__ = ["OV_SETTINGS", "OV_VARIANTS", "openvino_available", "nncf_available", "ov_model", "ov_compiled", "ov_precision",
           "ov_encode"]

OV_SETTINGS = {"converter": "openvino.convert_model(example_input)", "attention": "sdpa", "weights": "fp32 (no fp16 compression)",
               "int8_weights": "nncf.compress_weights(INT8_ASYM)", "int8_nncf": "nncf.quantize(TRANSFORMER), CALIBRATION_TEXTS"}
OV_VARIANTS = ("fp32", "int8_weights", "int8_nncf")


@contextlib.contextmanager
def _no_telemetry():
    """CI=true (openvino_telemetry's check, read at each conversion) and NNCF_CI=1 (read when nncf is imported)."""
    old = {k: os.environ.get(k) for k in ("CI", "NNCF_CI")}
    os.environ.update(CI="true", NNCF_CI="1")
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def openvino_available() -> str | None:
    """None if openvino imports, else why not (and what to install)."""
    try:
        import openvino  # noqa: F401
    except ImportError:
        return "openvino is not installed (pip install -e '.[compare]', or pip install openvino)"
    return None


def nncf_available() -> str | None:
    """None if openvino and nncf import (the int8 variants are made with nncf), else why not."""
    if (why := openvino_available()) is not None:
        return why
    try:
        with _no_telemetry():  # nncf decides at its first import whether it sends telemetry
            import nncf  # noqa: F401
    except ImportError:
        return "nncf is not installed (pip install -e '.[compare]', or pip install nncf)"
    return None


def _feed(tokens: torch.Tensor, mask: torch.Tensor) -> dict:
    return {"input_ids": tokens.numpy(), "attention_mask": mask.numpy(), "token_type_ids": torch.zeros_like(tokens).numpy()}


def _quiet_nncf():
    import logging

    with _no_telemetry():
        import nncf

    nncf.set_log_level(logging.ERROR)  # its tables and progress bars are noise in a benchmark log
    return nncf


def _make(folder: Path, variant: str, out: Path) -> None:
    with _no_telemetry():
        _convert(folder, variant, out)


def _convert(folder: Path, variant: str, out: Path) -> None:
    import openvino as ov

    if variant == "fp32":
        ids = runtimes.EXAMPLE_IDS
        with torch.no_grad():
            model = ov.convert_model(runtimes.hidden_model(folder, "sdpa"),
                                     example_input={"input_ids": ids, "attention_mask": (ids != 0).long(),
                                                    "token_type_ids": torch.zeros_like(ids)})
    else:
        nncf = _quiet_nncf()
        model = ov.Core().read_model(ov_model(folder, "fp32"))
        if variant == "int8_weights":
            model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
        else:
            from ..pretrained import load_pretrained
            from ..smoothquant import CALIBRATION_TEXTS

            ids = load_pretrained(folder).tokenize(CALIBRATION_TEXTS)
            data = nncf.Dataset([torch.tensor([s]) for s in ids], lambda t: _feed(t, torch.ones_like(t)))
            model = nncf.quantize(model, data, model_type=nncf.ModelType.TRANSFORMER, subset_size=len(ids))
    ov.save_model(model, str(out / "model.xml"), compress_to_fp16=False)


def ov_model(folder: str | Path, variant: str = "fp32") -> Path:
    """The cached OpenVINO IR (model.xml) of ``folder``'s model: variant "fp32", "int8_weights" or "int8_nncf".

    Made on first use (conversion ~2 s, weight compression ~3 s, calibration ~10 s on 2 cores), then reused.
    """
    if variant not in OV_VARIANTS:
        raise ValueError(f"variant must be one of {OV_VARIANTS}; got {variant!r}")
    folder = Path(folder)
    packages = ("openvino",) if variant == "fp32" else ("openvino", "nncf")
    d = runtimes.cache_root() / "openvino" / runtimes.artefact_key(folder, OV_SETTINGS, packages) / variant
    return runtimes.cached_dir(d, lambda tmp: _make(folder, variant, tmp)) / "model.xml"


@functools.lru_cache(maxsize=8)
def _compiled(path: str, hint: str | None, threads: int):
    import openvino as ov

    config = {"INFERENCE_NUM_THREADS": threads} | ({"INFERENCE_PRECISION_HINT": hint} if hint else {})
    return ov.Core().compile_model(path, "CPU", config)


def ov_compiled(path: str | Path, hint: str | None = None):
    """``path`` compiled for the CPU at torch's thread count (cached); hint: INFERENCE_PRECISION_HINT ("f32",
    "bf16"), or None for OpenVINO's own choice."""
    return _compiled(str(path), hint, torch.get_num_threads())


def ov_precision(compiled) -> str:
    """The precision a compiled model computes in ("f32", "bf16", ...): its INFERENCE_PRECISION_HINT."""
    return compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()


def ov_encode(compiled, ids: list[list[int]], batch_size: int, *, sort: bool, pad_id: int = 0) -> torch.Tensor:
    """:func:`btlib.bench.runtimes.padded_encode` with a compiled OpenVINO model as the forward: (N, d) float32."""
    request = compiled.create_infer_request()  # one request reused: no allocation per batch
    return runtimes.padded_encode(lambda t, m: request.infer(_feed(t, m))[0], ids, batch_size, sort=sort, pad_id=pad_id)
