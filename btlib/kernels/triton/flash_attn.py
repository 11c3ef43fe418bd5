"""FlashAttention forward in Triton: padded batches (key padding, causal, local window) and packed varlen tokens.

One kernel, two layouts (the ``VARLEN`` constexpr picks one at compile time):

    padded  q: (B, H, T, D), k, v: (B, H, S, D), lengths (B,) optional -> (B, H, T, D)
    varlen  q, k, v: (total, H, D), cu_seqlens (B + 1,) int32, max_seqlen -> (total, H, D)

Tiles are named as in the paper (and in btlib's C++ and CUDA kernels): Br query rows by Bc key
rows. Program (pid_bh, pid_m) owns Br query rows of one (batch, head): it loads Q once, streams
K and V through in Bc-row tiles, and keeps the running max m, the running sum l and the
output accumulator in registers, so the T x S score matrix never reaches HBM (FlashAttention,
Dao et al. 2022, Algorithm 1; the layout follows the Triton fused-attention tutorial).
HBM traffic: Q, O once, K and V once per query block: (2 + 2 * T / Br) * T * D elements
per (b, h) instead of the naive kernel's extra 2-3 T * S score reads and writes. With a local
window (left, right) a program loops only over the key tiles its rows' band reaches
[start_m - left, start_m + Br + right): about (Br + left + right) keys instead of T.

Position bias (``bias=btlib.PositionBias``, the ``BIAS`` constexpr: 0 none, 1 ALiBi, 2 table): added
to each (Br, Bc) tile of scores from the positions, i = offs_m and j = cols within the sequence:
ALiBi -slope_h |j - i| (one scalar load per tile), a table by a gather of values[h, clamp(j - i, -R,
R) + R] (the (H, 2R + 1) table stays in L1/L2: 1 KiB a head at R = 128). In log2 units like the
scores; never a (T, T) tensor. Without a bias the constexpr removes the code.

Precision: tl.dot accumulates in fp32 for every input dtype; P is rounded to the input dtype
before P V (as FlashAttention does) for fp16/bf16. fp32 inputs use ``input_precision="ieee"``
(no TF32), so fp32 results meet the fp32 tolerance on a GPU as in the interpreter.

Off a GPU, with TRITON_INTERPRET=1 set before triton is imported, :func:`flash_attention` runs
the same kernel on CPU tensors in Triton's interpreter (numpy, one program at a time: slow, for
tiny checks). Two interpreter bugs in Triton 3.9 touch bf16: tl.dot multiplies raw bf16 bit
patterns, and fp32 -> bf16 casts truncate. So there (only) bf16 dots run in fp32 and the output is
rounded by torch: the interpreter checks the algorithm, the GPU run checks the bf16 arithmetic.

Without triton (it has wheels for Linux x86_64 only) this module still imports, with stand-ins
(_no_triton.py): the source reads the same, :func:`block_config` works, a launch raises
:data:`TRITON_MISSING`, which says why.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl

    TRITON_MISSING: str | None = None
except ModuleNotFoundError:  # no triton wheel for this platform: the module imports, a launch says why
    from ._no_triton import MISSING as TRITON_MISSING
    from ._no_triton import tl, triton

__all__ = ["flash_attention", "flash_varlen_attention", "block_config", "interpreted", "MAX_HEAD_DIM", "DTYPES", "attn_fwd",
           "TRITON_MISSING"]

from ...checks import check_window  # noqa: E402
from ...position_bias import PositionBias, check_position_bias, kernel_args  # noqa: E402
from ..gpu_limits import DTYPES, LOG2E, MAX_HEAD_DIM  # noqa: E402  (after the triton import and its stand-ins)


@triton.jit
def attn_fwd(
    Q, K, V, O, Lengths, CuSeqlens, Bias,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
    H, Tq, Tk, D, qk_scale, win_left, win_right, bias_R,
    Br: tl.constexpr, Bc: tl.constexpr, BLOCK_D: tl.constexpr,
    VARLEN: tl.constexpr, HAS_LENGTHS: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    # Which rows belong to sequence b: Lq real queries, Lk real keys, rows_out rows to write.
    if VARLEN:
        row0 = tl.load(CuSeqlens + b).to(tl.int64)  # sequence b starts at token cu_seqlens[b]
        Lq = (tl.load(CuSeqlens + b + 1) - tl.load(CuSeqlens + b)).to(tl.int32)
        Lk = Lq
        rows_out = Lq
    else:
        row0 = 0
        rows_out = Tq
        if HAS_LENGTHS:
            Lq = tl.load(Lengths + b).to(tl.int32)
            Lk = Lq
        else:
            Lq = Tq
            Lk = Tk
    start_m = pid_m * Br
    if start_m < rows_out:  # varlen: programs past a short sequence's end have no rows
        offs_m = start_m + tl.arange(0, Br)
        offs_n = tl.arange(0, Bc)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
        v_base = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
        q = tl.load(q_base + (row0 + offs_m)[:, None] * stride_qt + offs_d[None, :],
                    mask=(offs_m < Lq)[:, None] & d_ok[None, :], other=0.0)  # (Br, BLOCK_D), stays in registers

        m_i = tl.full([Br], float("-inf"), tl.float32)  # running row max of S (log2 units)
        l_i = tl.zeros([Br], dtype=tl.float32)  # running row sum of exp2(S - m)
        acc = tl.zeros([Br, BLOCK_D], dtype=tl.float32)  # running P V, rescaled as m grows

        lo = 0
        hi = Lk
        if CAUSAL:
            hi = tl.minimum(hi, start_m + Br)  # key tiles past the block's last query are all masked
        if WINDOW:  # win_left, win_right >= 0 here: keys outside every row's band are skipped
            hi = tl.minimum(hi, start_m + Br + win_right)
            lo = tl.maximum(start_m - win_left, 0) // Bc * Bc  # from the tile holding the first row's first key
        hi = tl.where(start_m < Lq, hi, 0)  # padded query rows: no keys to read, output 0
        for start_n in range(lo, hi, Bc):
            cols = start_n + offs_n
            kv_ok = (cols < Lk)[:, None] & d_ok[None, :]
            k = tl.load(k_base + (row0 + cols)[:, None] * stride_kt + offs_d[None, :], mask=kv_ok, other=0.0)
            # S = Q K^T, scaled by scale * log2(e) so the softmax can use exp2
            if DOT_FP32:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION)
            else:
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            s = s * qk_scale
            if BIAS == 1:  # ALiBi: -slope_h |j - i|, times log2(e) like the scores
                slope = tl.load(Bias + h) * 1.4426950408889634
                s = s - slope * tl.abs(cols[None, :] - offs_m[:, None]).to(tl.float32)
            if BIAS == 2:  # table: row h at clamp(j - i, -R, R) + R
                rel = tl.minimum(tl.maximum(cols[None, :] - offs_m[:, None], -bias_R), bias_R) + bias_R
                s = s + tl.load(Bias + h * (2 * bias_R + 1) + rel) * 1.4426950408889634
            allowed = (cols < Lk)[None, :]
            if CAUSAL:
                allowed = allowed & (cols[None, :] <= offs_m[:, None])
            if WINDOW:
                allowed = allowed & (cols[None, :] >= offs_m[:, None] - win_left) & (cols[None, :] <= offs_m[:, None] + win_right)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with no allowed key so far keeps m = -inf; subtracting 0 instead of -inf
            # keeps exp2 at 0 (not NaN) for it, so fully masked rows end with l = 0 and O = 0.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])  # P = exp(S - m_new): (Br, Bc)
            alpha = tl.exp2(m_i - m_safe)  # rescale l and O to the new max
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = tl.load(v_base + (row0 + cols)[:, None] * stride_vt + offs_d[None, :], mask=kv_ok, other=0.0)
            # O += P V
            if DOT_FP32:
                acc += tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
            else:
                acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
            m_i = m_new

        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # O = diag(l)^-1 O; rows with l = 0 stay 0
        out = tl.where((offs_m < Lq)[:, None], out, 0.0)  # padded query rows t >= L output 0
        o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
        tl.store(o_base + (row0 + offs_m)[:, None] * stride_ot + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=(offs_m < rows_out)[:, None] & d_ok[None, :])


# Shared memory (SRAM) per streaming multiprocessor that one program may use, by compute capability.
SHARED_LIMIT = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def block_config(head_dim: int, dtype: torch.dtype, capability: int) -> dict:
    """Tile sizes and launch settings for one head_dim, dtype and GPU (capability 75 = T4, 80 = A100, 90 = H100).

    What lands in shared memory is the compiler's decision, so it is measured, not assumed:
    compiled by Triton 3.9 for sm_80 (fp16, D=64), this kernel reports (Br + Bc) x BLOCK_D elements,
    the Q tile and one K/V tile, for num_stages 1, 2 and 3 alike; for sm_75 (no mma) it reports more,
    as the dots' operands are staged for FMA. A T4 has 64 KiB per block and no asynchronous copies
    (num_stages=1 there); tests/test_gpu_kernels.py compiles every choice for sm_75, sm_80 and
    sm_90 and checks it fits (SHARED_LIMIT); ``targets.compile_for`` reports the bytes.
    """
    BLOCK_D = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:  # 4-byte elements, and ieee fp32 dots run on FMA units: small tiles
        Br, Bc, stages = 64, 32, (1 if capability < 80 else 2)
    elif capability < 80:  # T4: 64 KiB of shared memory, no cp.async (one stage), no tensor cores in Triton 3.9
        Br, Bc, stages = 64, (64 if BLOCK_D <= 64 else 32), 1
    else:  # A100 (163 KiB), H100 (227 KiB): taller query tiles; num_stages=2 lets Triton pipeline the K/V loop
        Br, Bc, stages = 128, (64 if BLOCK_D <= 64 or capability >= 90 else 32), 2
    return dict(Br=Br, Bc=Bc, BLOCK_D=BLOCK_D, num_warps=4 if BLOCK_D <= 64 else 8, num_stages=stages)


def _capability(device: torch.device) -> int:
    if device.type != "cuda":
        return 80  # the interpreter ignores warps and stages; only the tile sizes matter there
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def interpreted() -> bool:
    """True when this process runs Triton kernels in the interpreter (TRITON_INTERPRET=1 before triton's import).

    Triton 3.9 reads TRITON_INTERPRET when ``@triton.jit`` runs, for triton.language's own helpers
    (tl.zeros, tl.max, ...) as much as for this file's kernel, so the choice is per process: set
    it before the first ``import triton``. Then kernels take CPU tensors (numpy underneath).
    """
    return TRITON_MISSING is None and not isinstance(attn_fwd, triton.runtime.JITFunction)


def _launch(q, k, v, o, lengths, cu_seqlens, strides, B, H, Tq, Tk, grid_m, causal, scale, blocks, window=None, bias=None):
    if TRITON_MISSING:
        raise RuntimeError(TRITON_MISSING)
    D = q.shape[-1]
    if D > MAX_HEAD_DIM:
        raise ValueError(f"btlib Triton attention: head_dim {D} > {MAX_HEAD_DIM}; use btlib.attention(backend='auto')")
    if q.dtype not in DTYPES:
        raise TypeError(f"btlib Triton attention: supports float16, bfloat16, float32; got {q.dtype}")
    interpret = interpreted()
    if q.device.type != "cuda" and not interpret:
        raise RuntimeError(
            f"btlib Triton attention: inputs are on {q.device.type}; compiled Triton kernels need CUDA tensors. "
            "To run the kernel on the CPU in Triton's interpreter, set TRITON_INTERPRET=1 before triton is first "
            "imported (os.environ['TRITON_INTERPRET'] = '1' at the top of the script or notebook)."
        )
    bias = check_position_bias(bias, H, q.device)
    bias_values, bias_kind, bias_R = kernel_args(bias)
    cfg = block_config(D, q.dtype, _capability(q.device))
    cfg.update(blocks or {})
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dummy = torch.empty(1, dtype=torch.int32, device=q.device)
    grid = (B * H, triton.cdiv(max(grid_m, 1), cfg["Br"]))
    if B * H == 0 or q.numel() == 0:
        return o
    # Interpreter workarounds for bf16 (Triton 3.9): its tl.dot multiplies raw bf16 bit patterns
    # and its fp32 -> bf16 cast truncates instead of rounding to nearest even as a GPU does. So
    # there the dots run in fp32 and the kernel writes fp32, which torch rounds (RNE) below.
    bf16_fix = interpret and q.dtype == torch.bfloat16
    # A reach past every key is no limit; clamping keeps start_m + Br + win_right in int32.
    win = (0, 0) if window is None else tuple(min(int(w), max(Tq, Tk)) for w in window)
    out = torch.empty(o.shape, dtype=torch.float32, device=o.device) if bf16_fix else o  # same (contiguous) strides
    attn_fwd[grid](
        q, k, v, out, lengths if lengths is not None else dummy, cu_seqlens if cu_seqlens is not None else dummy,
        bias_values if bias_values is not None else dummy.float(),
        *strides, H, Tq, Tk, D, scale * LOG2E, *win, bias_R,
        VARLEN=cu_seqlens is not None, HAS_LENGTHS=lengths is not None, CAUSAL=bool(causal), WINDOW=window is not None,
        BIAS=bias_kind,
        DOT_FP32=bf16_fix,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **cfg,
    )
    if bf16_fix:
        o.copy_(out)
    return o


def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, lengths: Tensor | None = None, causal: bool = False,
                    scale: float | None = None, window: tuple[int, int] | None = None, bias: PositionBias | None = None,
                    blocks: dict | None = None) -> Tensor:
    """Fused attention on a padded batch. CUDA tensors run compiled; CPU tensors run interpreted.

    Args:
        q: (B, H, T, D); k, v: (B, H, S, D); fp16, bf16 or fp32, head_dim contiguous, D <= 128.
        lengths: (B,) int, real tokens per sequence (keys j >= L ignored, rows t >= L output 0).
        causal: query i attends keys j <= i.  scale: defaults to 1 / sqrt(D).
        window: (left, right) ints >= 0: query i attends keys i - left .. i + right only; None: all.
        bias: a btlib.PositionBias of H heads on q's device (ALiBi or a table), added from the positions.
        blocks: overrides of :func:`block_config` (e.g. ``{"Br": 16, "Bc": 16}``).

    Returns:
        (B, H, T, D) in q's dtype.
    """
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (B, H, T, D) contiguous
    L = None if lengths is None else lengths.to(device=q.device, dtype=torch.int32)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3])
    return _launch(q, k, v, o, L, None, strides, B, H, Tq, Tk, Tq, causal, scale, blocks, check_window(window), bias)


def flash_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, causal: bool = False,
                           scale: float | None = None, window: tuple[int, int] | None = None,
                           bias: PositionBias | None = None, blocks: dict | None = None) -> Tensor:
    """Fused attention on packed tokens: sequence b is rows cu_seqlens[b]:cu_seqlens[b+1]; no work on padding.

    Args:
        q, k, v: (total, H, D); fp16, bf16 or fp32, head_dim contiguous, D <= 128.
        cu_seqlens: (B + 1,) int32 on q's device, e.g. [0, 2, 6, 9] for lengths [2, 4, 3].
        max_seqlen: the longest sequence (sets the grid: B * H * ceil(max_seqlen / Br) programs).
        causal, scale, window, bias, blocks: as in :func:`flash_attention` (window and bias positions within each
            sequence).

    Returns:
        (total, H, D) in q's dtype.
    """
    total, H, D = q.shape
    B = cu_seqlens.numel() - 1
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (total, H, D) contiguous
    # Batch stride 0: sequence b's rows are found through cu_seqlens[b], not b * stride.
    strides = (0, q.stride(1), q.stride(0), 0, k.stride(1), k.stride(0), 0, v.stride(1), v.stride(0), 0, o.stride(1), o.stride(0))
    return _launch(q, k, v, o, None, cu_seqlens, strides, B, H, max_seqlen, max_seqlen, max_seqlen, causal, scale, blocks,
                   check_window(window), bias)

