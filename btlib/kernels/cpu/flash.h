// flash.h: v3, one pass with the online softmax (FlashAttention, Dao et al. 2022, Algorithm 1),
// on padded (B, H, T, D) or packed (total, H, D) + cu_seqlens inputs; no torch in here.
//
// Work: 4 D sum(Lq Lk) flops (causal about half), none on padding: tasks exist only for real query
// blocks and read only their own sequence's keys. Per query block Q (Br x D), S (Br x Bc) and
// O (Br x Dp) stay in L1/L2; K^T and V are packed once per (b, h) per thread and stream through.
// The products run on a Path (flash_tiles.h: fp32; flash_bf16dot.h: vdpbf16ps); the softmax, the
// masks and the block loop below are the same for both.
//
// NaN and inf, as in the reference: a row whose attended scores hold a NaN or +inf is NaN in every
// element (softmax of it is NaN); NaN or inf in V at an attended key flows through P V; keys
// beyond the sequence's length are never packed and padded query rows are written as exact 0,
// so nothing in the padding reaches a real row.
#pragma once

#include "flash_bf16dot.h"
#include "flash_tiles.h"

namespace btlib_core {

// Online softmax of one row of the tile: `valid` of the nk scores may attend (the rest are
// masked). Updates the running max m and sum l, leaves P = 2^(S - m_new) in place (0 where
// masked) and returns alpha = 2^(m_old - m_new), the factor that rescales what O holds.
// A NaN score can be lost by the max but not by S - m_new: its P is NaN, so l and O are.
inline float online_softmax_row(float* S, int64_t nk, int64_t valid, float& m, float& l) {
  if (valid <= 0) {
    std::fill_n(S, round_up(nk, W), 0.0f);  // whole vectors: the bf16 path reads P in pairs
    return 1.0f;
  }
  vf mx = vset1(kNegInf);
  for (int64_t c = 0; c < valid; c += W) mx = vmax(mx, vkeep_first(vload(S + c), int(valid - c), kNegInf));
  const float m_new = std::max(m, vhmax(mx));                     // m_new = max(m, rowmax(S))
  const float alpha = m == kNegInf ? 0.0f : std::exp2(m - m_new);  // rescale l and O to the new max
  const vf mv = vset1(m_new);
  vf sum = vzero();
  for (int64_t c = 0; c < nk; c += W) {
    const vf P = vkeep_first(vexp2(vsub(vload(S + c), mv)), int(valid - c), 0.0f);  // P = exp(S - m_new)
    vstore(S + c, P);
    sum = vadd(sum, P);
  }
  l = l * alpha + vhsum(sum);  // l = alpha l + rowsum(P)
  m = m_new;
  return alpha;
}

// One query block [q0, q0 + Br) of (b, h): O = softmax(Q K^T * scale) V over the keys it attends.
template <typename Path, typename T>
void flash_block(const Problem& p, const T* q, const T* k, const T* v, T* o, int64_t b, int64_t h, int64_t q0,
                 Workspace& ws) {
  const int64_t D = p.D, Dp = round_up(D, W);
  const int64_t nq = std::min(Br, p.len_q(b) - q0);  // real query rows of this block
  ws.S.resize(Br * Bc);
  ws.O.resize(Br * Dp);
  if (ws.packed != b * p.H + h) {
    Path::pack_kv(p, k, v, b, h, Dp, ws);
    ws.packed = b * p.H + h;
  }
  Path::pack_q(p, q, b, h, q0, nq, ws);
  std::fill_n(ws.O.data(), nq * Dp, 0.0f);
  std::fill_n(ws.m, nq, kNegInf);
  std::fill_n(ws.l, nq, 0.0f);
  const int64_t kv_end = p.keys_of_row(b, q0 + nq - 1);  // causal: later keys are masked for every row
  for (int64_t j0 = 0; j0 < kv_end; j0 += Bc) {
    const int64_t nk = std::min(Bc, kv_end - j0);
    for (int64_t i0 = 0; i0 < nq; i0 += kR)  // S = Q K^T * scale * log2(e)
      with_rows(std::min<int64_t>(kR, nq - i0), [&](auto R) { Path::template qk<R()>(ws, D, i0, j0, nk); });
    for (int64_t i = 0; i < nq; ++i) {  // m, l, P, alpha per row
      const int64_t valid = std::min(nk, p.keys_of_row(b, q0 + i) - j0);
      ws.alpha[i] = online_softmax_row(ws.S.data() + i * Bc, nk, valid, ws.m[i], ws.l[i]);
      Path::store_p(ws, i, nk);
    }
    for (int64_t i0 = 0; i0 < nq; i0 += kR)  // O = diag(alpha) O + P V
      with_rows(std::min<int64_t>(kR, nq - i0), [&](auto R) { Path::template pv<R()>(ws, Dp, i0, j0, nk); });
  }
  for (int64_t i = 0; i < nq; ++i) {
    // O = O / l. A row with no key outputs 0. With keys, l >= 1 unless every attended score was
    // -inf (then 1 / l = inf and O = 0 give NaN, the reference's softmax of a row of -inf).
    const float inv_l = p.keys_of_row(b, q0 + i) > 0 ? 1.0f / ws.l[i] : 0.0f;
    T* oi = p.at(o, p.os, b, h, q0 + i);
    for (int64_t d = 0; d < D; ++d) oi[d] = from_float<T>(ws.O[i * Dp + d] * inv_l);
  }
}

// v3 over all (b, h, query block) tasks on `threads` workers of parallel_for (core.h), then the
// padded output rows set to 0. T is float or bf16.
template <typename T, typename ParallelFor>
void attention_v3(const Problem& p, const T* q, const T* k, const T* v, T* o, int threads, ParallelFor&& parallel_for) {
  using Path = typename PathFor<T>::type;
  struct Task { int64_t b, h, q0; };
  std::vector<Task> tasks;  // only blocks with real query rows
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.H; ++h)
      for (int64_t q0 = 0; q0 < p.len_q(b); q0 += Br) tasks.push_back({b, h, q0});
  // Longest sequences first (a block costs about len_k): the last chunks handed out are then the
  // cheapest, so workers finish together. Stable, so one (b, h)'s blocks stay adjacent.
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& x, const Task& y) { return p.len_k(x.b) > p.len_k(y.b); });
  // Chunks of consecutive tasks, about 8 per thread: a thread then runs runs of query blocks of
  // one (b, h) and packs its K^T and V once, while the chunks still balance uneven (causal,
  // varlen) work.
  const int64_t n = int64_t(tasks.size()), chunk = std::max<int64_t>(1, n / (8 * std::max(threads, 1)));
  for_tasks<Workspace>(parallel_for, threads, n, chunk, [&](int64_t t, Workspace& ws) {
    flash_block<Path>(p, q, k, v, o, tasks[t].b, tasks[t].h, tasks[t].q0, ws);
  });
  if (p.cu_seqlens || !p.lengths) return;  // no padded rows
  struct None {};
  const int64_t BH = p.B * p.H;
  for_tasks<None>(parallel_for, threads, BH, std::max<int64_t>(1, BH / std::max(threads, 1)), [&](int64_t t, None&) {
    zero_rows(p, o, t / p.H, t % p.H, p.len_q(t / p.H), p.rows_out(t / p.H));
  });
}

}  // namespace btlib_core
