// teaching.h: v1 (materialise S) and v2 (tiled, two passes over K), fp32, plain loops.
// They exist to be read and timed against v3 (flash.h); the parallel_for hook is core.h's.
//
// A row's valid keys are a prefix (key padding and the causal mask both cut from the right), so
// the loops stop at keys_of_row instead of writing -inf: a real -inf or NaN score then takes part
// in the softmax as in the reference (a NaN or +inf score makes the row NaN; a row of -inf
// scores outputs 0, as SDPA's), while masked keys never do.
#pragma once

#include <vector>

#include "core.h"

namespace btlib_core {

// v1: materialise S (Lq x Lk), softmax row by row, O = P V. S costs 4 Lq Lk bytes per (b, h).
template <typename ParallelFor>
void attention_v1(const Problem& p, const float* q, const float* k, const float* v, float* o, int threads,
                  ParallelFor&& parallel_for) {
  const int64_t D = p.D;
  struct None {};
  for_tasks<None>(parallel_for, threads, p.B * p.H, 1, [&](int64_t task, None&) {
    const int64_t b = task / p.H, h = task % p.H, Lq = p.len_q(b), Lk = p.len_k(b);
    std::vector<float> S(Lq * Lk);
    for (int64_t i = 0; i < Lq; ++i) {
      const float* qi = p.at(q, p.qs, b, h, i);
      float* Si = S.data() + i * Lk;
      const int64_t n = p.keys_of_row(b, i);
      for (int64_t j = 0; j < n; ++j) {  // S = Q K^T * scale
        const float* kj = p.at(k, p.ks, b, h, j);
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += qi[d] * kj[d];
        Si[j] = dot * p.scale;
      }
      float m = kNegInf, l = 0.0f;  // P = softmax(S); exp(NaN - m) is NaN
      for (int64_t j = 0; j < n; ++j) m = std::max(m, Si[j]);
      if (m == kNegInf) m = 0.0f;  // only -inf scores (or none): P = 0, l = 0, not exp(-inf + inf) = NaN
      for (int64_t j = 0; j < n; ++j) l += (Si[j] = std::exp(Si[j] - m));
      const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;  // no key, or only -inf scores: 0; a NaN l keeps its NaN P
      float* oi = p.at(o, p.os, b, h, i);  // O = P V
      std::fill_n(oi, D, 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const float pij = Si[j] * inv_l;
        const float* vj = p.at(v, p.vs, b, h, j);
        for (int64_t d = 0; d < D; ++d) oi[d] += pij * vj[d];
      }
    }
    zero_rows(p, o, b, h, Lq, p.rows_out(b));
  });
}

// v2: Br x Bc tiles, two passes over K (max, then exp-sum and P V): 6 T^2 D flops, no T x T buffer.
template <typename ParallelFor>
void attention_v2(const Problem& p, const float* q, const float* k, const float* v, float* o, int threads,
                  ParallelFor&& parallel_for) {
  const int64_t D = p.D;
  struct Buffers {
    std::vector<float> S = std::vector<float>(Br * Bc), O = std::vector<float>(Br * kMaxD), m = std::vector<float>(Br),
                       l = std::vector<float>(Br);
  };
  for_tasks<Buffers>(parallel_for, threads, p.B * p.H, 1, [&](int64_t task, Buffers& w) {
    const int64_t b = task / p.H, h = task % p.H, Lq = p.len_q(b);
    for (int64_t q0 = 0; q0 < Lq; q0 += Br) {
      const int64_t nq = std::min(Br, Lq - q0);
      const int64_t kv_end = p.keys_of_row(b, q0 + nq - 1);  // the block's last row sees the most keys
      auto scores = [&](int64_t j0, int64_t nk) {  // S tile = Q K^T * scale for keys [j0, j0 + nk)
        for (int64_t i = 0; i < nq; ++i) {
          const float* qi = p.at(q, p.qs, b, h, q0 + i);
          for (int64_t jj = 0; jj < nk; ++jj) {
            const float* kj = p.at(k, p.ks, b, h, j0 + jj);
            float dot = 0.0f;
            for (int64_t d = 0; d < D; ++d) dot += qi[d] * kj[d];
            w.S[i * Bc + jj] = dot * p.scale;
          }
        }
      };
      std::fill(w.m.begin(), w.m.end(), kNegInf);
      for (int64_t j0 = 0; j0 < kv_end; j0 += Bc) {  // pass 1: m = rowmax(S)
        const int64_t nk = std::min(Bc, kv_end - j0);
        scores(j0, nk);
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t n = std::min(nk, p.keys_of_row(b, q0 + i) - j0);
          for (int64_t jj = 0; jj < n; ++jj) w.m[i] = std::max(w.m[i], w.S[i * Bc + jj]);
        }
      }
      for (float& m : w.m) m = m == kNegInf ? 0.0f : m;  // only -inf scores (or none): P = 0, not NaN
      std::fill(w.l.begin(), w.l.end(), 0.0f);
      std::fill_n(w.O.begin(), nq * D, 0.0f);
      for (int64_t j0 = 0; j0 < kv_end; j0 += Bc) {  // pass 2: recompute S; P = exp(S - m); l += rowsum(P); O += P V
        const int64_t nk = std::min(Bc, kv_end - j0);
        scores(j0, nk);
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t n = std::min(nk, p.keys_of_row(b, q0 + i) - j0);
          float* Oi = w.O.data() + i * D;
          for (int64_t jj = 0; jj < n; ++jj) {
            const float pij = std::exp(w.S[i * Bc + jj] - w.m[i]);
            w.l[i] += pij;
            const float* vj = p.at(v, p.vs, b, h, j0 + jj);
            for (int64_t d = 0; d < D; ++d) Oi[d] += pij * vj[d];
          }
        }
      }
      for (int64_t i = 0; i < nq; ++i) {  // O /= l
        const float inv_l = w.l[i] > 0.0f ? 1.0f / w.l[i] : 0.0f;  // as v1
        float* oi = p.at(o, p.os, b, h, q0 + i);
        for (int64_t d = 0; d < D; ++d) oi[d] = w.O[i * D + d] * inv_l;
      }
    }
    zero_rows(p, o, b, h, Lq, p.rows_out(b));
  });
}

}  // namespace btlib_core
