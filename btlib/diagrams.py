"""Teaching diagrams drawn from btlib's own data structures, and one colour per method for every plot.

Each diagram computes what it draws with the code it teaches, so a picture cannot drift from the library:

    draw_packed([2, 4, 3])                     # the padded (B, T) grid beside the packed (total,) row, cu_seqlens marked
    draw_tile_walk(200, window=(64, 64), i=2)  # query block i visits its key blocks; m, l and O rescaled per block
    draw_batcher(arrivals_ms, tokens)          # requests over time, grouped by BatchEncoder's own policy

    method_style("btlib_packed_bf16")          # {"color": ..., "linestyle": "--", "marker": "o"}: plot(..., **style)

Every function returns the matplotlib Figure and Axes; nothing is shown or saved, and matplotlib is
imported only when something is drawn (``import btlib`` stays light).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from .blocks import DEAD, draw_tile_map, row_bands, tile_map
from .padding import check_int, check_lengths, pack
from .reference import reference_attention
from .serve.batcher import BatchEncoder

__all__ = ["METHOD_COLORS", "method_color", "method_style", "draw_packed", "WalkStep", "online_softmax_steps",
           "draw_tile_walk", "Batch", "simulate_batcher", "draw_batcher"]

# One colour per method, in every notebook's plots. PyTorch's paths are warm colours, btlib's blues, the
# other runtimes their own hue; the variants of one runtime (fp32, int8, sorted, ...) share its colour and
# differ in line style and marker (method_style). Keys are matched as prefixes of provider names, longest first.
METHOD_COLORS = {
    "reference": "#7f7f7f", "naive": "#7f7f7f", "slow": "#7f7f7f",  # the plain oracle / PyTorch's slow path
    "ideal": "#000000",
    "fastpath_nested": "#f4a259", "nested": "#f4a259", "torch_sdpa_nested": "#f4a259",  # PyTorch nested tensors
    "fastpath": "#d95f02",                                             # PyTorch's BetterTransformer fastpath
    "torch_sdpa_loop": "#e7298a",                                      # one SDPA call per sequence
    "sdpa": "#c0392b", "torch_sdpa": "#c0392b", "sdpa_padded_mask": "#c0392b",  # F.scaled_dot_product_attention
    "sdpa_flash": "#ff9896", "sdpa_efficient": "#9c755f",
    "flex": "#8e44ad",                                                 # FlexAttention
    "btlib_no_skip": "#9ecae1", "cpu_naive_v1": "#9ecae1", "cpu_tiled_v2": "#6baed6",
    "btlib": "#1f5fa8", "packed": "#1f5fa8", "cpu_flash": "#1f5fa8",  # btlib's packed / fused path, fp32
    "btlib_packed_bf16": "#17becf", "packed_bf16": "#17becf",
    "btlib_packed_int8": "#31a354", "packed_int8": "#31a354",
    "encode_per_request": "#7b9fc7",                                   # btlib's encode, one request per forward
    "transformers": "#8c564b", "sentence_transformers": "#c49c94",
    "ort": "#e6ab02", "tei_ort": "#e6ab02",                            # ONNX Runtime
    "ov": "#66a61e",                                                   # OpenVINO
    "ct2": "#a6761d",                                                  # CTranslate2
    "fastembed": "#e377c2",
}
_SPARE = ("#393b79", "#637939", "#843c39", "#7b4173", "#5254a3", "#8ca252", "#bd9e39", "#ad494a")


def method_color(name: str) -> str:
    """The colour of a method or benchmark provider name (the longest METHOD_COLORS key it starts with).

    A name no key matches gets a spare colour chosen by a hash of the name: the same in every plot.
    """
    for key in sorted(METHOD_COLORS, key=len, reverse=True):
        if name == key or name.startswith(key + "_") or name.startswith(key + " "):
            return METHOD_COLORS[key]
    return _SPARE[zlib.crc32(name.encode()) % len(_SPARE)]


def method_style(name: str) -> dict:
    """Keyword arguments for ``ax.plot``: the method's colour, a line style per precision (fp32 solid, bf16 dashed,
    int8 dotted), a marker per variant (sorted: square, optimised: diamond, NNCF: triangle, else a circle)."""
    low = name.lower()
    linestyle = ":" if "int8" in low else "--" if "bf16" in low or "fp16" in low else "-"
    if low.startswith("ideal"):
        linestyle = "--"
    marker = "s" if "sorted" in low else "D" if "opt" in low else "v" if "nncf" in low else "^" if "weights" in low else "o"
    return {"color": method_color(name), "linestyle": linestyle, "marker": marker}


def _seq_colors(B: int) -> list:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return [cmap(b % 10) for b in range(B)]


PAD_COLOR = "#e6e6e6"


def draw_packed(lengths, T: int | None = None):
    """Draw a batch padded to (B, T) beside the same tokens packed into one (total,) row, cu_seqlens marked.

    lengths: (B,) ints >= 0 (a list or an integer tensor). The packed row is ``btlib.pack`` applied to each
    cell's (b, t) position, so the drawing is what pack does; the offsets are ``btlib.lengths_to_cu_seqlens``.
    Returns (fig, (ax_padded, ax_packed)); each token is one Rectangle patch (padding cells too, in grey).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    L = torch.as_tensor(lengths).reshape(-1)
    check_lengths(L)
    B = L.numel()
    T = int(L.max()) if T is None else check_int(T, "T", low=int(L.max()))
    if B * T == 0 or B * T > 20_000:
        raise ValueError(f"draw 1 to 20,000 padded cells; got B={B}, T={T}: draw a smaller batch")
    where = torch.stack(torch.meshgrid(torch.arange(B), torch.arange(T), indexing="ij"), -1)  # (B, T, 2): (b, t)
    tokens, cu_seqlens, max_seqlen = pack(where, L)  # (total, 2): the (b, t) each packed token came from
    total, colors = tokens.shape[0], _seq_colors(B)
    fig, (ax_pad, ax_pk) = plt.subplots(2, 1, figsize=(min(14, max(7, 2 + 0.25 * max(T, total / 2))), 2.6 + 0.35 * B),
                                        gridspec_kw={"height_ratios": [max(B, 1), 1.6]})
    for b in range(B):
        for t in range(T):
            real = t < int(L[b])
            ax_pad.add_patch(Rectangle((t, B - 1 - b), 1, 1, facecolor=colors[b] if real else PAD_COLOR,
                                       edgecolor="white", lw=0.5, label="token" if real else "padding"))
    ax_pad.set(xlim=(0, T), ylim=(0, B), xlabel="position t", title=f"padded (B, T) = ({B}, {T}): "
               f"{B * T - total} of {B * T} cells are padding")
    ax_pad.set_yticks([B - 0.5 - b for b in range(B)], [f"seq {b}: L={int(L[b])}" for b in range(B)], fontsize=8)
    for n, (b, t) in enumerate(tokens.tolist()):
        ax_pk.add_patch(Rectangle((n, 0), 1, 1, facecolor=colors[b], edgecolor="white", lw=0.5, label="token"))
        if total <= 40:
            ax_pk.text(n + 0.5, 0.5, str(t), ha="center", va="center", fontsize=7, color="white")
    cu = cu_seqlens.tolist()
    for b, off in enumerate(cu):
        ax_pk.axvline(off, color="k", lw=1.2)
        dup = cu[:b].count(off)  # an empty sequence repeats its offset: stack the labels
        ax_pk.text(off, -0.35 - 0.45 * dup, str(off), ha="center", va="top", fontsize=8, gid="cu_seqlens")
    ax_pk.set(xlim=(0, max(total, 1)), ylim=(-0.4 - 0.45 * B, 1.05), yticks=[],
              title=f"packed tokens ({total},) + cu_seqlens {cu} + max_seqlen {max_seqlen}")
    ax_pk.set_xticks([])
    ax_pk.set_xlabel("packed index (numbers in cells: position t in the sequence); offsets below", fontsize=8)
    for side in ("left", "right", "top", "bottom"):
        ax_pk.spines[side].set_visible(False)
    fig.tight_layout()
    return fig, (ax_pad, ax_pk)


@dataclass(frozen=True)
class WalkStep:
    """One key block j visited by one query row: the online softmax's state after it (FlashAttention's m, l, O)."""

    j: int             # key block
    m: float           # running max of the scores seen
    l: float           # running sum of exp(s - m)
    alpha: float       # exp(m_old - m_new): how much O and l were rescaled by on this step
    out: torch.Tensor  # (D,) O / l so far: the softmax-weighted mean of the values seen


def online_softmax_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: int, *, Bc: int = 64,
                         causal: bool = False, window: tuple[int, int] | None = None) -> list[WalkStep]:
    """The online softmax (Milakov & Gimelshein 2018) of one query row over the key blocks its band reaches.

    q, k, v: (T, D) float of one head. Blocks holding none of the row's keys (lo..hi from btlib.blocks.row_bands)
    are skipped, as btlib's kernel skips dead tiles. After the last step O / l is the row of attention's output.
    """
    T, D = q.shape
    lo, hi = (int(x[row]) for x in row_bands(T, T, causal=causal, window=window))
    s = (k @ q[row]) / math.sqrt(D)  # (T,) scores of this row
    m, l, o, steps = -math.inf, 0.0, torch.zeros(D, dtype=q.dtype), []
    for j in range(lo // Bc, hi // Bc + 1 if hi >= lo else 0):
        keys = torch.arange(max(j * Bc, lo), min((j + 1) * Bc, hi + 1))
        s_j = s[keys]
        m_new = max(m, float(s_j.max()))
        alpha = math.exp(m - m_new) if m > -math.inf else 0.0  # rescale what was summed under the old max
        p = torch.exp(s_j - m_new)
        l = alpha * l + float(p.sum())
        o = alpha * o + p @ v[keys]
        m = m_new
        steps.append(WalkStep(j, m, l, alpha, o / l))
    return steps


def draw_tile_walk(T: int = 200, *, i: int = 1, Br: int = 64, Bc: int = 64, causal: bool = False,
                   window: tuple[int, int] | None = None, D: int = 16, seed: int = 0):
    """Query block i walking its key blocks: the tile map with the visit order, and m, l, alpha and O per step.

    The numbers are those of the first row of block i on random (T, D) inputs (seeded), and the last step's O
    is checked against btlib.reference_attention (raises if it differs by more than 1e-5).
    Returns (fig, (ax_map, ax_ml, ax_o)).
    """
    import matplotlib.pyplot as plt

    T, D = check_int(T, "T", low=1), check_int(D, "D", low=1)
    kinds = tile_map(T, causal=causal, window=window, Br=Br, Bc=Bc)  # (nq, nk)
    i = check_int(i, "i", high=kinds.shape[0] - 1, hint=f"T={T} has {kinds.shape[0]} query blocks of {Br}")
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, D, generator=g, dtype=torch.float64) for _ in range(3))
    row = i * Br
    steps = online_softmax_steps(q, k, v, row, Bc=Bc, causal=causal, window=window)
    ref = reference_attention(q[None, None], k[None, None], v[None, None], causal=causal, window=window)[0, 0, row]
    if steps and not torch.allclose(steps[-1].out, ref, rtol=0, atol=1e-5 * float(ref.abs().max())):
        raise AssertionError("the online softmax's O / l differs from btlib.reference_attention: a bug in this diagram")
    fig, (ax_map, ax_ml, ax_o) = plt.subplots(1, 3, figsize=(13, 3.6), gridspec_kw={"width_ratios": [1, 1.3, 1.3]})
    draw_tile_map(kinds, ax=ax_map, title=f"T={T}, tiles {Br}x{Bc}: query block {i}'s walk", legend=False)
    ax_map.axhspan(i - 0.5, i + 0.5, color="k", alpha=0.12)
    ax_map.set_xticks(range(kinds.shape[1]))
    ax_map.set_yticks(range(kinds.shape[0]))
    alive = [j for j in range(kinds.shape[1]) if kinds[i, j] != DEAD]
    for n, j in enumerate(alive, 1):
        ax_map.text(j, i, str(n), ha="center", va="center", fontsize=9, color="white", weight="bold", gid="visit")
    js = list(range(1, len(steps) + 1))
    ax_ml.step(js, [s.m for s in steps], where="mid", marker="o", label="m: running max")
    ax_ml.plot(js, [s.alpha for s in steps], "s:", label=r"$\alpha = e^{m_{old} - m_{new}}$")
    ax_l = ax_ml.twinx()
    ax_l.plot(js, [s.l for s in steps], "^--", color="C2", label=r"$\ell$: running sum of $e^{s-m}$")
    ax_ml.set(xlabel=f"step (key block visited by row {row})", title="the state carried from block to block")
    lines = ax_ml.get_legend_handles_labels(), ax_l.get_legend_handles_labels()
    ax_ml.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], fontsize=7, loc="best")
    for d in range(min(D, 3)):
        ax_o.plot(js, [float(s.out[d]) for s in steps], "o-", color=f"C{d}", label=f"O[{d}] / l")
        ax_o.axhline(float(ref[d]), color=f"C{d}", ls=":", lw=1)
    ax_o.set(xlabel="step", title="O / l after each step (dotted: the reference)")
    ax_o.legend(fontsize=7)
    for ax in (ax_ml, ax_o):
        ax.set_xticks(js)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig, (ax_map, ax_ml, ax_o)


@dataclass(frozen=True)
class Batch:
    """One forward pass of the simulated batcher: which requests (indices), when it ran (ms), its tokens."""

    requests: tuple[int, ...]
    start_ms: float
    end_ms: float
    tokens: int


class _Req:
    """One simulated request of one text: what btlib.serve.slices.take reads of a Request."""

    def __init__(self, n: int, tokens: int, arrival: float):
        self.n, self.tokens, self.arrival, self.texts = n, tokens, arrival, [n]
        self.lengths, self.taken = [tokens], 0


class _Queue:
    """The fields BatchEncoder._take and _full read, so the simulation runs the batcher's own policy code."""

    def __init__(self, max_batch_tokens: int, max_batch_requests: int | None):
        from collections import deque

        self._queue, self._queued_texts, self._queued_tokens = deque(), 0, 0
        self.max_batch_tokens, self.max_batch_requests = max_batch_tokens, max_batch_requests

    def put(self, r: _Req) -> None:
        self._queue.append(r)
        self._queued_texts, self._queued_tokens = self._queued_texts + 1, self._queued_tokens + r.tokens


def simulate_batcher(arrivals_ms, tokens, *, max_batch_tokens: int = 512, max_wait_ms: float = 2.0,
                     c0_ms: float = 3.5, c1_ms: float = 0.1, max_batch_requests: int | None = None) -> list[Batch]:
    """Replay btlib.serve.BatchEncoder's schedule on a clock: which requests share each forward pass.

    arrivals_ms: one arrival time per request (ms, any order); tokens: its token count. A forward pass takes
    c0_ms + c1_ms * tokens (notebook 09 fits both; the defaults are MiniLM's on 2 Zen 5 threads). The worker
    loop is BatchEncoder._run's: wait until the oldest request is max_wait_ms old or the budget is full, then
    BatchEncoder._take (the oldest request, then later ones that still fit, in arrival order). No queue bound.
    """
    arr = [float(a) for a in arrivals_ms]
    tok = [check_int(t, f"tokens[{n}]", low=1) for n, t in enumerate(tokens)]
    if not (c0_ms >= 0 and c1_ms >= 0 and max_wait_ms >= 0):
        raise ValueError(f"c0_ms, c1_ms and max_wait_ms must be >= 0; got {c0_ms}, {c1_ms}, {max_wait_ms}")
    if len(arr) != len(tok):
        raise ValueError(f"one token count per arrival: got {len(arr)} arrivals and {len(tok)} token counts")
    pending = sorted(range(len(arr)), key=lambda n: (arr[n], n))
    q, now, batches = _Queue(max_batch_tokens, max_batch_requests), 0.0, []

    def admit(until: float) -> None:
        while pending and arr[pending[0]] <= until:
            n = pending.pop(0)
            q.put(_Req(n, tok[n], arr[n]))

    while pending or q._queue:
        admit(now)
        if not q._queue:
            now = arr[pending[0]]
            continue
        deadline = q._queue[0].arrival + max_wait_ms
        while not BatchEncoder._full(q) and now < deadline:
            now = min(deadline, arr[pending[0]]) if pending else deadline
            admit(now)
        batch = [s.request for s in BatchEncoder._take(q)]  # one text a request: each slice is a whole request
        n_tok = sum(r.tokens for r in batch)
        end = now + c0_ms + c1_ms * n_tok
        batches.append(Batch(tuple(r.n for r in batch), now, end, n_tok))
        now = end
    return batches


def draw_batcher(arrivals_ms, tokens, *, max_batch_tokens: int = 512, max_wait_ms: float = 2.0, c0_ms: float = 3.5,
                 c1_ms: float = 0.1, max_batch_requests: int | None = None):
    """Requests over time (one row each: waiting, then in its batch) above the worker's forward passes.

    Arguments as for :func:`simulate_batcher`. Returns (fig, (ax_requests, ax_worker)); the worker axis holds
    one Rectangle per batch, labelled with its requests and tokens.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    batches = simulate_batcher(arrivals_ms, tokens, max_batch_tokens=max_batch_tokens, max_wait_ms=max_wait_ms,
                               c0_ms=c0_ms, c1_ms=c1_ms, max_batch_requests=max_batch_requests)
    arr, tok = [float(a) for a in arrivals_ms], [int(t) for t in tokens]
    N, colors = len(arr), _seq_colors(len(batches))
    fig, (ax_r, ax_w) = plt.subplots(2, 1, sharex=True, figsize=(11, 1.6 + 0.18 * max(N, 8)),
                                     gridspec_kw={"height_ratios": [max(N, 4), 2]})
    order = {n: y for y, n in enumerate(sorted(range(N), key=lambda n: (arr[n], n)))}
    for b, batch in enumerate(batches):
        for n in batch.requests:
            y = N - 1 - order[n]
            ax_r.plot([arr[n], batch.start_ms], [y, y], color="0.6", lw=1.5)  # waiting in the queue
            ax_r.plot([batch.start_ms, batch.end_ms], [y, y], color=colors[b], lw=4, solid_capstyle="butt")
            ax_r.plot(arr[n], y, "k|", ms=8)
            ax_r.text(arr[n], y + 0.25, f"{tok[n]}", fontsize=6, ha="right", va="bottom")
        head = batch.requests[0]
        ax_r.axvspan(arr[head], arr[head] + max_wait_ms, color=colors[b], alpha=0.08)
        ax_w.add_patch(Rectangle((batch.start_ms, 0), batch.end_ms - batch.start_ms, 1, facecolor=colors[b],
                                 edgecolor="k", lw=0.5, label="batch"))
        ax_w.text((batch.start_ms + batch.end_ms) / 2, 0.5, f"{len(batch.requests)} req\n{batch.tokens} tok",
                  ha="center", va="center", fontsize=7)
    ax_r.set(yticks=[], ylabel="requests (by arrival)", ylim=(-1, max(N, 1)),
             title=f"token budget {max_batch_tokens}, max wait {max_wait_ms:g} ms, forward = {c0_ms:g} + "
                   f"{c1_ms:g} x tokens ms: | arrival (tokens above), grey waiting, colour its batch")
    ax_r.title.set_fontsize(9)
    end = max((b.end_ms for b in batches), default=1.0)
    ax_w.set(ylim=(0, 1), yticks=[], xlim=(min(arr, default=0.0) - 1, end + 1), xlabel="time (ms)",
             ylabel="worker")
    fig.tight_layout()
    return fig, (ax_r, ax_w)
