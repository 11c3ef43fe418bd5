"""MPNet (sentence-transformers/all-mpnet-base-v2's architecture) on the BERT family's packed path.

    model = btlib.load_pretrained("path/to/all-mpnet-base-v2")   # config.json model_type "mpnet"
    emb = model.encode(texts)                                    # mean-pooled, normalised, as the folder says

MPNet (Song et al. 2020, arXiv:2004.09297) is BERT's post-LN layer with one addition, read here from
transformers 5.23's modeling_mpnet.py, which is the reference:

    x = LayerNorm(word[ids] + position[p])        p = 2, 3, ... (RoBERTa's positions, padding_idx 1), no token types
    S = q k^T / sqrt(Dh) + bias(h, j - i)         every layer; j - i counted within each sequence
    bias(h, d) = relative[bucket(d), h]           relative: (32, H), the first layer's relative_attention_bias,
                                                  shared by all layers (MPNetEncoder.compute_position_bias, once)
    bucket(d)                                     T5's bidirectional bucket, 32 buckets, max_distance 128: 8 exact
                                                  offsets each way, then log-spaced to 128, one bucket beyond

so it needs nothing of its own but the bias: the embeddings are bert.py's (no token type table), the layers
nn.TransformerEncoderLayer's (q, k, v, o -> in_proj / out_proj, attention.LayerNorm -> norm1, as
btlib.pretrained.folders.checkpoint maps them), and the bias a btlib.PositionBias table over offsets
-128 .. 128 (btlib.position_bias.relative_bucket_table: the bucket of |d| >= 128 is constant, so the clamped
table is exact at every length), which the varlen kernel adds per score from (h, i, j): no (T, T) tensor.

Paths and precisions: "packed" in fp32, bf16 and int8 (btlib.quant's twin of the same PackedEncoder, the bias
passed through); "slow" (PyTorch's nn.TransformerEncoder, fastpath off, on a padded batch: the bias and the
padding as one float mask (B * H, T, T), 4 B H T^2 bytes). PyTorch's fastpaths are refused by name:
"fastpath" reads a 3-D mask as a boolean one (MultiheadAttention.merge_masks hands it to the fused layer as
mask type 2; with MPNet's bias it returned NaN for every text, torch 2.13 CPU), and "fastpath_nested" takes
no nested path once a mask is given, so it would run dense under a nested name.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from ...position_bias import PositionBias, relative_bucket_table
from .bert import PretrainedEncoder, load_bert

__all__ = ["MPNetEncoder", "NUM_BUCKETS", "MAX_DISTANCE", "load_mpnet"]

NUM_BUCKETS, MAX_DISTANCE = 32, 128  # MPNetEncoder.compute_position_bias / relative_position_bucket's, fixed there


class MPNetEncoder(PretrainedEncoder):
    """The BERT family's encoder plus MPNet's relative-position bias (module docstring); loaded by load_bert.

    PretrainedEncoder.packed_encoder builds each dtype's PackedEncoder with :meth:`position_bias`, a table taken from
    ``embeddings.relative`` then (as the bf16 copy of the layers is): after changing that table, clear
    ``model._packed`` and ``model._int8``.
    """

    PATHS = ("packed", "packed_bf16", "slow")
    WHO = "MPNet"
    HAS_RELATIVE_BIAS = True  # load_bert builds this class only for a folder with relative buckets, and no other for one

    def position_bias(self) -> PositionBias:
        """bias(h, j - i) = relative[bucket(j - i), h] as a table over offsets -128 .. 128: values (H, 257) float32."""
        w = self.embeddings.relative.weight.detach()  # (32, H)
        return relative_bucket_table(w.T.float().contiguous(), NUM_BUCKETS, MAX_DISTANCE, bidirectional=True)

    def _check_path(self, path: str) -> None:
        why = {"fastpath": "PyTorch's fused layer reads a 3-D mask as a boolean one, so it cannot add the bias",
               "fastpath_nested": "PyTorch's encoder takes no nested path once a mask is given"}
        if path in why:
            raise ValueError(f"path={path!r} is not available for MPNet: its relative-position bias goes to PyTorch's "
                             f"layers as a float mask and {why[path]}; use 'packed' (padding-free, the bias computed "
                             "in the kernel) or 'slow' (PyTorch's plain modules, padded)")
        super()._check_path(path)

    def _padded_masks(self, pad: Tensor) -> dict[str, Tensor]:
        """One float mask (B * H, T, T): the bias, and float32's lowest value at padded keys, as transformers masks
        them (no key padding mask beside it: PyTorch warns when a bool one meets a float mask). exp() of it is 0, and
        every row keeps its real keys (lengths >= 1)."""
        B, T = pad.shape
        bias = self.position_bias().dense(T)  # (H, T, T)
        low = torch.finfo(torch.float32).min
        mask = bias.unsqueeze(0) + torch.zeros(B, 1, 1, T).masked_fill(pad.view(B, 1, 1, T), low)
        return {"mask": mask.reshape(B * bias.shape[0], T, T)}  # (B, H, T, T) -> (B * H, T, T), batch-major


def load_mpnet(plan, *, expected_sha256: str | None = None, config: tuple[dict, Path] | None = None) -> MPNetEncoder:
    """An MPNet folder (model_type "mpnet"): the BERT family's loader building an :class:`MPNetEncoder`."""
    return load_bert(plan, expected_sha256=expected_sha256, cls=MPNetEncoder, config=config)
