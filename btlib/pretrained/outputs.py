"""What encode does to its rows after the head, as sentence-transformers 6.2's ``encode`` does it:

    truncate_dim           keep the first features (Matryoshka); overrides the folder's truncate_dim, as
                           sentence-transformers' encode(truncate_dim=) overrides config_sentence_transformers.json's
    normalize_embeddings   then L2-normalise each row (torch.nn.functional.normalize, eps 1e-12); without it a
                           truncated row of a normalising model is *not* unit length (sentence-transformers' rule)
    output_precision       then quantize (sentence-transformers' ``precision=``, util/quantization.py's
                           quantize_embeddings): "float32" (N, dim) float32; "int8" / "uint8" (N, dim), per-feature
                           buckets between ranges[0] and ranges[1]; "binary" (N, ceil(dim / 8)) int8 (packed bits
                           of x > 0, minus 128); "ubinary" the same bits as uint8

int8 / uint8 need a range per feature. sentence-transformers' encode takes them from the embeddings of the call
itself (min and max over its N rows, with a warning below 100 rows) and raises for one row; so does btlib, and
``ranges`` (2, dim) or ``calibration_embeddings`` (M, dim) give them from elsewhere, as quantize_embeddings takes
them. The serve routes' ``dimensions`` run :func:`truncate_rows` (btlib.serve.service.Service.shape).
"""

from __future__ import annotations

import logging
import numbers

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["OUTPUT_PRECISIONS", "check_truncate_dim", "check_output_precision", "truncate_rows", "quantize_embeddings",
           "finish_rows"]

OUTPUT_PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")
_log = logging.getLogger("btlib.pretrained")


def check_truncate_dim(truncate_dim: object, width: int | None, name: str = "truncate_dim") -> int | None:
    """None, or an int in 1..width (``width``: the head's features before any truncation; None: not known yet).
    sentence-transformers slices silently (0 gives empty rows, past the width the whole row); btlib refuses both."""
    if truncate_dim is None:
        return None
    if isinstance(truncate_dim, bool) or not isinstance(truncate_dim, numbers.Integral):
        raise ValueError(f"{name} must be an int (features to keep); got {type(truncate_dim).__name__} {truncate_dim!r}")
    if not 1 <= truncate_dim <= (width or truncate_dim):
        raise ValueError(f"{name}={truncate_dim}: this model gives {width} features; ask for 1 to {width} "
                         f"(or leave {name} out)")
    return int(truncate_dim)


def check_output_precision(output_precision: str) -> str:
    if output_precision not in OUTPUT_PRECISIONS:
        raise ValueError(f"output_precision must be one of {OUTPUT_PRECISIONS} (sentence-transformers' encode precision=; "
                         f"btlib's precision= is the forward's: fp32, bf16, auto, int8); got {output_precision!r}")
    return output_precision


def truncate_rows(emb: Tensor, dim: int | None, normalize: bool) -> Tensor:
    """(N, d) float32 -> (N, dim) float32 (dim None: d), then L2-normalised where ``normalize`` (eps 1e-12)."""
    if dim is not None:
        emb = emb[:, :dim]
    return F.normalize(emb, p=2, dim=1) if normalize else emb


def _numpy(x) -> np.ndarray | None:
    if x is None:
        return None
    return x.detach().cpu().float().numpy() if isinstance(x, Tensor) else np.asarray(x)


def quantize_embeddings(emb: Tensor | np.ndarray, precision: str, ranges: Tensor | np.ndarray | None = None,
                        calibration_embeddings: Tensor | np.ndarray | None = None) -> np.ndarray:
    """sentence-transformers' quantize_embeddings on an (N, dim) float matrix, the same numpy operations in the same
    dtypes, so equal bit for bit on the same input. ranges: (2, dim) min / max per feature; calibration_embeddings:
    (M, dim) to take them from; neither: the N rows themselves (ValueError for N == 1, a warning below 100)."""
    check_output_precision(precision)
    e = _numpy(emb)
    if e.ndim != 2:
        raise ValueError(f"quantize_embeddings takes an (N, dim) matrix; got shape {tuple(e.shape)}")
    if e.dtype in (np.int8, np.uint8):
        raise ValueError("embeddings to quantize must be float, not int8 or uint8")
    dim = e.shape[1]
    if e.shape[0] == 0 and precision != "float32":
        width = dim if precision.endswith("int8") else (dim + 7) // 8
        return np.zeros((0, width), dtype=np.int8 if precision in ("int8", "binary") else np.uint8)
    if precision == "float32":
        return e.astype(np.float32)
    if precision == "binary":
        return (np.packbits(e > 0, axis=-1) - 128).astype(np.int8)
    if precision == "ubinary":
        return np.packbits(e > 0, axis=-1)
    ranges, calibration = _numpy(ranges), _numpy(calibration_embeddings)
    if ranges is None:
        if calibration is None:
            if e.shape[0] == 1:
                raise ValueError(f"cannot compute {precision} quantization ranges from a single embedding (as "
                                 "sentence-transformers): pass ranges= ((2, dim): min and max per feature) or "
                                 "calibration_embeddings= ((M, dim) from a representative set), or encode more texts at once")
            if e.shape[0] < 100:
                _log.warning("computing %s quantization buckets from %d embeddings; ranges from more embeddings "
                             "(ranges= or calibration_embeddings=) are more stable", precision, e.shape[0])
            calibration = e
        ranges = np.vstack((np.min(calibration, axis=0), np.max(calibration, axis=0)))
    if ranges.shape != (2, dim):
        raise ValueError(f"ranges must be (2, {dim}): min and max of each kept feature; got {tuple(ranges.shape)}")
    ranges = ranges.astype(np.float32, copy=False)
    starts = ranges[0, :]
    steps = (ranges[1, :] - starts) / 255
    steps = np.where(steps == 0, 1, steps)
    q = np.clip(np.floor((e - starts) / steps), 0, 255)
    return q.astype(np.uint8) if precision == "uint8" else (q - 128).astype(np.int8)


def finish_rows(rows: Tensor, truncate_dim: int | None, normalize_embeddings: bool, output_precision: str,
                ranges=None, calibration_embeddings=None) -> Tensor:
    """The head's rows (N, d) float32 -> encode's answer: truncate, normalise, quantize (module docstring); a float32
    Tensor, or the quantized rows as an int8 / uint8 Tensor."""
    rows = truncate_rows(rows, truncate_dim, normalize_embeddings)
    if output_precision == "float32":
        if ranges is not None or calibration_embeddings is not None:
            raise ValueError("ranges / calibration_embeddings apply to output_precision 'int8' and 'uint8' only")
        return rows
    if output_precision not in ("int8", "uint8") and (ranges is not None or calibration_embeddings is not None):
        raise ValueError(f"ranges / calibration_embeddings apply to output_precision 'int8' and 'uint8' only; got "
                         f"{output_precision!r}")
    return torch.from_numpy(quantize_embeddings(rows, output_precision, ranges, calibration_embeddings))
