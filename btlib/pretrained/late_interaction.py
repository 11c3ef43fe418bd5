"""Late interaction (ColBERT's MaxSim) over per-token vectors: what ``encode_tokens(output="token_embeddings")`` and the
server's /embed_all give.

    score(q, d) = sum_i max_j  q_i . d_j        q_i: query q's token vectors, d_j: document d's (Khattab & Zaharia 2020)

    Q (total_q, D), cu_seqlens_q (Bq + 1,)   D_ (total_d, D), cu_seqlens_d (Bd + 1,)   ->  scores (Bq, Bd) float32
    S = Q D_^T  (total_q, total_d)          one GEMM for every pair
    M = max of S over each document's columns   (total_q, Bd)   (scatter amax by the documents' segment ids)
    scores = sum of M over each query's rows    (Bq, Bd)        (btlib.padding.segment_sum)

No padding anywhere: a padded ColBERT batch scores (Bq, Tq) x (Bd, Td) and masks; packed, S holds the real tokens
only. S is built ``DOC_BLOCK`` document tokens at a time, so memory is total_q x DOC_BLOCK floats, not
total_q x total_d. ``normalize=True`` L2-normalises every token vector first (ColBERT's cosine MaxSim). Which tokens
count ([CLS], [SEP], the prompt, punctuation) is the caller's choice: pass the rows to keep.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..padding import segment_ids, segment_sum

__all__ = ["maxsim", "maxsim_lists", "DOC_BLOCK"]

DOC_BLOCK = 4096  # document tokens per GEMM block: total_q x 4096 fp32 scores (16 MB per 1,000 query tokens)


def _check(x: Tensor, cu_seqlens: Tensor, name: str) -> Tensor:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{name} must be (total, D) floating point token vectors; got {tuple(x.shape)} {x.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens of {name} must be (B + 1,) int32 / int64 with B >= 1")
    lengths = cu_seqlens.diff().long()
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != x.shape[0] or bool((lengths < 1).any()):
        raise ValueError(f"cu_seqlens of {name} must start at 0, end at {x.shape[0]} (its rows) and give every "
                         "sequence one token at least (MaxSim over no tokens is undefined)")
    return lengths


def maxsim(Q: Tensor, cu_seqlens_q: Tensor, D_: Tensor, cu_seqlens_d: Tensor, *, normalize: bool = False) -> Tensor:
    """ColBERT scores of every query with every document (module docstring): (Bq, Bd) float32.

    Q: (total_q, D) queries' token vectors packed, cu_seqlens_q: (Bq + 1,) int32 (lengths [2, 4] -> [0, 2, 6]);
    D_: (total_d, D) documents' token vectors packed, cu_seqlens_d: (Bd + 1,) int32. Computed in float32 whatever
    the inputs' float dtype. normalize: L2-normalise every token vector first (cosine MaxSim, ColBERT's).
    """
    lq, ld = _check(Q, cu_seqlens_q, "Q"), _check(D_, cu_seqlens_d, "D_")
    if Q.shape[1] != D_.shape[1]:
        raise ValueError(f"Q and D_ must have the same width; got {Q.shape[1]} and {D_.shape[1]}")
    Q, D_ = Q.float(), D_.float()
    if normalize:
        Q, D_ = F.normalize(Q, dim=-1), F.normalize(D_, dim=-1)
    Bq, Bd = lq.numel(), ld.numel()
    seq_d = segment_ids(ld)  # (total_d,) the document of each document token
    M = Q.new_full((Q.shape[0], Bd), float("-inf"))  # (total_q, Bd): every document has a token, so no -inf stays
    for a in range(0, D_.shape[0], DOC_BLOCK):
        S = Q @ D_[a:a + DOC_BLOCK].T  # (total_q, n): S = Q D^T for this block of document tokens
        cols = seq_d[a:a + DOC_BLOCK].view(1, -1).expand_as(S)
        M.scatter_reduce_(1, cols, S, reduce="amax")  # max over each document's tokens
    return segment_sum(M, segment_ids(lq), Bq)  # (Bq, Bd): sum over each query's tokens


def maxsim_lists(queries: Sequence[Tensor | list], documents: Sequence[Tensor | list], *, normalize: bool = False) -> Tensor:
    """:func:`maxsim` of per-input token vectors, as /embed_all answers them: ``queries[i]`` (Tq_i, D),
    ``documents[j]`` (Td_j, D), tensors or nested lists of floats -> (len(queries), len(documents)) float32."""
    def pack(items, name):
        rows = [torch.as_tensor(x, dtype=torch.float32) for x in items]
        if not rows or any(r.dim() != 2 for r in rows):
            raise ValueError(f"{name} must be a non-empty list of (tokens, D) token vectors")
        lengths = torch.tensor([r.shape[0] for r in rows])
        return torch.cat(rows), F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)

    return maxsim(*pack(queries, "queries"), *pack(documents, "documents"), normalize=normalize)
