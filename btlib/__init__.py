"""btlib: fast Transformer-encoder inference in PyTorch, and the workbook that teaches it.

Importing btlib is cheap: no kernel is compiled and no device is queried until used.

    btlib.reference_attention(q, k, v, lengths=...)      the plain oracle, (B, H, T, D)
    btlib.attention(q, k, v, lengths=..., backend=)      fused kernels from the registry
    btlib.varlen_attention(q, k, v, cu_seqlens, max_seqlen)   packed tokens, no padding work
    btlib.PositionBias.alibi(slopes) / .table(values, R)    ALiBi or T5/MPNet relative positions, bias=
    btlib.pack / unpack / lengths_to_cu_seqlens ...      the packed-token format
    btlib.PackedEncoder.from_module(encoder)             an nn.TransformerEncoder on packed tokens
    btlib.load_pretrained(folder).encode(texts)          BERT-family and ModernBERT checkpoints, padding-free
    btlib.load_reranker(folder).rank(query, documents)   cross-encoders (*ForSequenceClassification), padding-free
    btlib.explain_fastpath(module, src, mask)            why PyTorch's fastpath does (not) run
    python -m btlib.bench list | run NAME                benchmarks
"""

from ._version import __version__
from . import _mkl_vml  # noqa: F401  (one serial VML call first: see btlib/_mkl_vml.py)
from .attention import attention, varlen_attention
from .fastpath import FastpathReport, explain_fastpath
from .observe import ops_that_ran
from .sdpa import ForcedRun, SDPAReport, explain_sdpa, run_forced, sdpa_ops
from .lengths import PaddingStats, padding_stats, uniform_lengths, zipf_lengths
from .memory import keep_freed_memory
from .packed_encoder import PackedEncoder
from .precision import PrecisionChoice, SlowPrecisionWarning, choose_precision
from .pretrained import load_pretrained, load_reranker, to_hf_state_dict
from .nested import nested_to_packed, nested_to_padded, packed_to_nested, padded_to_nested
from .padding import (
    Packed,
    cu_seqlens_to_lengths,
    lengths_to_cu_seqlens,
    lengths_to_padding_mask,
    pack,
    padding_mask_to_lengths,
    unpack,
)
from .reference import reference_attention, reference_varlen_attention
from .position_bias import PositionBias, alibi_slopes, relative_bucket_table


__all__ = [
    "choose_precision", "PrecisionChoice", "SlowPrecisionWarning",
    "attention", "varlen_attention", "reference_attention", "reference_varlen_attention",
    "PositionBias", "alibi_slopes", "relative_bucket_table",
    "explain_fastpath", "FastpathReport", "ops_that_ran", "PackedEncoder", "load_pretrained", "load_reranker",
    "to_hf_state_dict",
    "explain_sdpa", "SDPAReport", "run_forced", "ForcedRun", "sdpa_ops",
    "Packed", "pack", "unpack", "lengths_to_cu_seqlens", "cu_seqlens_to_lengths",
    "lengths_to_padding_mask", "padding_mask_to_lengths",
    "packed_to_nested", "nested_to_packed", "padded_to_nested", "nested_to_padded",
    "uniform_lengths", "zipf_lengths", "padding_stats", "PaddingStats", "keep_freed_memory",
]
