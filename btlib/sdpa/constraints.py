"""The "Accelerated PyTorch 2 Transformers" post's constraints on the fused GPU kernels, next to what torch checks today.

The post (pytorch.org/blog/accelerated-pytorch-2, March 2023, PyTorch 2.0) listed what a call must look like
to reach the fused kernels (flash, memory-efficient). The list moved since. Each :class:`Constraint` row
says what the post said, what torch checks today, and how we know:

- ``"source"``: read in PyTorch's CUDA gate functions (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
  a recent main-branch version: it knows sm121 and CUDA 13) and *not run*: a CPU build of torch has no CUDA
  code to call, and ships no copy of that file to check against.
- ``"installed"``: the check's own message is in a file of the torch installed here (the C++ header
  sdp_utils_cpp.h that the CPU and CUDA gates share, or torch's Python sources); :func:`evidence` looks it up.
- ``"live"``: run here (btlib.explain_sdpa, the profiler): the notebook prints those rows itself.

On a GPU, ``btlib.explain_sdpa`` asks ``torch.backends.cuda.can_use_*_attention(params, debug=True)``
live; that replaces every "source" entry with the GPU's own answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Constraint", "CONSTRAINTS", "evidence", "constraint_table"]

_HEADER = "include/ATen/native/transformers/sdp_utils_cpp.h"
_CUDA_REST = "the rest read in torch's CUDA source, not run"


@dataclass(frozen=True)
class Constraint:
    """One row. found_in: (file relative to torch's package folder, text that must occur in it) for "installed" rows."""

    topic: str
    post: str
    today: str
    how: str
    found_in: tuple[str, str] | None = None
    # For an "installed" row whose "today" says more than its one message proves: the part it proves (a piece of
    # ``today``) and how the rest is known. None: the message covers the whole entry.
    proves: str | None = None
    rest: str | None = None


CONSTRAINTS: tuple[Constraint, ...] = (
    Constraint("dtype", "flash: fp16, bf16 only; mem-efficient: fp16, bf16, fp32",
               "flash: fp16, bf16 (fp8 e4m3 too where FA3 is switched on, sm90+); mem-efficient: fp16, fp32, "
               "and bf16 on sm80+; cuDNN: fp16, and bf16 on sm80+", "source"),
    Constraint("GPU", "flash: sm80; mem-efficient: sm5x or newer",
               "flash: sm80 to sm121; mem-efficient: sm50 to sm121; cuDNN: sm80 to sm121 (tried first only on "
               "sm90/sm100 with cuDNN newer than 9.15)", "source"),
    Constraint("head_dim", "a multiple of 8 (16-bit) or 4 (32-bit); flash: at most 128",
               "flash: q, k, v equal and <= 256 (a multiple of 8 only for nested inputs); training on sm86/89/120 "
               "refuses 192 < D <= 224; mem-efficient: a multiple of 8 (16-bit) or 4 (32-bit), v may differ", "source"),
    Constraint("attn_mask", "none in the fused kernels: causal only, as is_causal=True with attn_mask=None",
               "flash: still none, and is_causal only with T_q == T_k; mem-efficient: any bool or additive mask "
               "broadcastable to (B, H, T, S); cuDNN: 2-D or 4-D masks", "installed",
               (_HEADER, "Flash Attention does not support non-null attn_mask."), "flash: still none", _CUDA_REST),
    Constraint("dropout", "flash: yes; mem-efficient: no (p must be 0 in 2.0)",
               "flash and mem-efficient: yes; cuDNN: p a multiple of 1/16; the CPU flash kernel: no", "installed",
               (_HEADER, "Both fused kernels do not support non-zero dropout."), "the CPU flash kernel: no", _CUDA_REST),
    Constraint("need_weights", "nn.MultiheadAttention must get need_weights=False (the default is True)",
               "unchanged: the weights need the (B, H, T, S) probabilities, which a fused kernel never stores",
               "installed", ("nn/modules/activation.py", "Set ``need_weights=False`` to use the optimized")),
    Constraint("batch_first", "the Transformer/MHA fastpath needs batch_first=True",
               "unchanged for the fastpath; SDPA itself takes (B, H, T, D) in any case", "installed",
               ("nn/modules/activation.py", "batch_first was not True")),
    Constraint("nested inputs", "forward through all kernels; training only with math; not under torch.compile",
               "jagged layout: flash and mem-efficient on CUDA (varlen); mem-efficient refuses nested + grad; "
               "on CPU math only, no masks, no is_causal", "installed",
               (_HEADER, "Memory efficient attention currently doesn't support training with NT inputs."),
               "mem-efficient refuses nested + grad",
               "the CPU part run live by explain_sdpa on a nested tensor (notebook 03, after this table); the CUDA part read in torch's "
               "CUDA source, not run"),
    Constraint("layout", "(not listed)",
               "4-D (B, H, T, D) inputs with the last dimension contiguous (stride 1) for every fused kernel",
               "installed", (_HEADER, "All fused kernels require the last dimension of the input to have stride 1.")),
    Constraint("GQA", "(not in 2.0)", "enable_gqa=True: fewer k/v heads than q heads, in flash and mem-efficient",
               "source"),
)


def _torch_file(rel: str) -> Path:
    return Path(torch.__file__).parent / rel


def evidence(row: Constraint) -> bool | None:
    """Whether the row's message occurs in the installed torch (None: nothing to look up, or the file is absent)."""
    if row.found_in is None or not _torch_file(row.found_in[0]).is_file():
        return None
    return row.found_in[1] in _torch_file(row.found_in[0]).read_text(errors="replace")


def constraint_table() -> str:
    """The rows as a markdown table, with how each "today" entry is known on this installation."""
    how = {"source": "read in torch's CUDA source, not run", "live": "run here"}
    lines = ["| constraint | the 2.0 post | torch today | how we know |", "|---|---|---|---|"]
    for r in CONSTRAINTS:
        if r.how == "installed":
            found = evidence(r)
            file = r.found_in[0].split("/")[-1]
            known = {True: f"message found in this torch's `{file}`" if r.proves is None else
                     f"*{r.proves}*: message found in this torch's `{file}`; {r.rest}",
                     False: f"message NOT found in this torch's `{file}`: changed since",
                     None: "file not shipped with this torch"}[found]
        else:
            known = how[r.how]
        lines.append(f"| {r.topic} | {r.post} | {r.today} | {known} |")
    return "\n".join(lines)
