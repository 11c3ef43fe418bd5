/*
 * btlib CPU attention, forward only:  O = softmax(Q K^T * scale + mask) V,  fp32 accumulation.
 *
 * Versions, side by side (tests/test_cpu_kernels.py checks each against btlib.reference_attention):
 *   v1  materialise: S = Q K^T for the whole sequence, softmax, O = P V. Plain loops, OpenMP
 *       over (b, h). 4 T^2 D flops; S costs 4 T^2 bytes per (b, h) (4 MB at T = 1024), which
 *       falls out of L2 and is written, read and rewritten.
 *   v2  tiled: Br query rows x Bc keys at a time, no T x T buffer. Without the online softmax
 *       it needs two passes over K: first the row max m, then l = sum exp(S - m) and P V.
 *       Q K^T is computed twice: 6 T^2 D flops. Plain loops, OpenMP over (b, h).
 *   v3  flash: one pass with the online softmax (FlashAttention, Dao et al. 2022, Algorithm 1).
 *       K^T and V are packed once per (b, h) per thread; register-blocked SIMD micro-kernels for
 *       S = Q K^T and O += P V (vec.h: AVX-512, AVX2 or portable); vectorised exp2. OpenMP over
 *       (b, h, query block). 4 T^2 D flops; per query block Q (Br x D), S (Br x Bc) and O
 *       (Br x D) stay in L1/L2, K and V stream through once.
 *   varlen  v3 on packed tokens (total, H, D) + cu_seqlens: tasks exist only for real query
 *       blocks and read only their own sequence's keys: 4 D sum(L_i^2) flops, none on padding.
 *
 * Masks: key padding by `lengths` (keys j >= L ignored, query rows t >= L output 0) and causal
 * (key j <= query i, top-left aligned). A query row with no key to attend outputs 0.
 * Inputs: float32 (all versions) or bfloat16 (v3, varlen). With AVX512_BF16, bf16 runs both
 * products on vdpbf16ps (two bf16 products summed into fp32 per lane: twice the multiply-adds per
 * instruction of fp32 FMA); P is rounded to bf16 for P V, as PyTorch's bf16 kernels do. Without
 * it, bf16 is converted to fp32 while packing and runs at fp32 speed.
 */
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "vec.h"

using namespace btlib_vec;

namespace {

constexpr int64_t Br = 64;         // query rows per block (v2, v3)
constexpr int64_t Bc = 64;         // keys per block; a multiple of kNV * W in every build
constexpr int64_t kMaxD = 256;     // head_dim limit (buffers are sized by it)
constexpr float kLog2e = 1.4426950408889634f;

// One attention problem. Padded: (B, H, T, D) tensors, lengths optional. Varlen: (total, H, D)
// tensors, batch stride 0 and sequence b starting at row cu_seqlens[b]. Strides in elements.
struct Problem {
  int64_t B, H, D, Tq, Tk;
  int64_t qs[3], ks[3], vs[3], os[3];  // strides of (batch, head, row); head_dim is contiguous
  const int64_t* lengths = nullptr;
  const int32_t* cu_seqlens = nullptr;
  bool causal = false;
  float scale = 1.0f;

  int64_t row0(int64_t b) const { return cu_seqlens ? cu_seqlens[b] : 0; }
  int64_t len_q(int64_t b) const { return cu_seqlens ? cu_seqlens[b + 1] - cu_seqlens[b] : lengths ? lengths[b] : Tq; }
  int64_t len_k(int64_t b) const { return cu_seqlens ? cu_seqlens[b + 1] - cu_seqlens[b] : lengths ? lengths[b] : Tk; }
  // rows of the output that belong to sequence b: padded rows t >= len_q are written as 0
  int64_t rows_out(int64_t b) const { return cu_seqlens ? len_q(b) : Tq; }
  template <typename T> const T* at(const T* x, const int64_t* s, int64_t b, int64_t h, int64_t t) const {
    return x + b * s[0] + h * s[1] + (row0(b) + t) * s[2];
  }
  template <typename T> T* at(T* x, const int64_t* s, int64_t b, int64_t h, int64_t t) const {
    return x + b * s[0] + h * s[1] + (row0(b) + t) * s[2];
  }
};

template <typename scalar_t>
void zero_rows(const Problem& p, scalar_t* o, int64_t b, int64_t h, int64_t from, int64_t to) {
  for (int64_t t = from; t < to; ++t) std::fill_n(p.at(o, p.os, b, h, t), p.D, scalar_t(0));
}

// ---------------------------------------------------------------------------------------------
// v1: materialise S (Lq x Lk), softmax row by row, O = P V.
// ---------------------------------------------------------------------------------------------
void attention_v1(const Problem& p, const float* q, const float* k, const float* v, float* o) {
  const int64_t D = p.D;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t h = 0; h < p.H; ++h) {
      const int64_t Lq = p.len_q(b), Lk = p.len_k(b);
      std::vector<float> S(Lq * Lk);
      for (int64_t i = 0; i < Lq; ++i) {  // S = Q K^T * scale, masked keys -inf
        const float* qi = p.at(q, p.qs, b, h, i);
        for (int64_t j = 0; j < Lk; ++j) {
          const float* kj = p.at(k, p.ks, b, h, j);
          float dot = 0.0f;
          for (int64_t d = 0; d < D; ++d) dot += qi[d] * kj[d];
          S[i * Lk + j] = (p.causal && j > i) ? kNegInf : dot * p.scale;
        }
      }
      for (int64_t i = 0; i < Lq; ++i) {  // P = softmax(S) per row; a row with no key stays 0
        float* Si = S.data() + i * Lk;
        float m = kNegInf, l = 0.0f;
        for (int64_t j = 0; j < Lk; ++j) m = std::max(m, Si[j]);
        for (int64_t j = 0; j < Lk; ++j) l += (Si[j] = m == kNegInf ? 0.0f : std::exp(Si[j] - m));
        const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
        float* oi = p.at(o, p.os, b, h, i);  // O = P V
        std::fill_n(oi, D, 0.0f);
        for (int64_t j = 0; j < Lk; ++j) {
          const float pij = Si[j] * inv_l;
          const float* vj = p.at(v, p.vs, b, h, j);
          for (int64_t d = 0; d < D; ++d) oi[d] += pij * vj[d];
        }
      }
      zero_rows(p, o, b, h, Lq, p.rows_out(b));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// v2: Br x Bc tiles, two passes over K (max, then exp-sum and P V).
// ---------------------------------------------------------------------------------------------
void attention_v2(const Problem& p, const float* q, const float* k, const float* v, float* o) {
  const int64_t D = p.D;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t h = 0; h < p.H; ++h) {
      const int64_t Lq = p.len_q(b), Lk = p.len_k(b);
      std::vector<float> S(Br * Bc), O(Br * D), m(Br), l(Br);
      for (int64_t q0 = 0; q0 < Lq; q0 += Br) {
        const int64_t nq = std::min(Br, Lq - q0);
        const int64_t kv_end = p.causal ? std::min(Lk, q0 + nq) : Lk;  // later keys are masked for every row
        // S tile = Q K^T * scale for keys [j0, j0 + nk), masked entries -inf
        auto scores = [&](int64_t j0, int64_t nk) {
          for (int64_t i = 0; i < nq; ++i) {
            const float* qi = p.at(q, p.qs, b, h, q0 + i);
            for (int64_t jj = 0; jj < nk; ++jj) {
              const float* kj = p.at(k, p.ks, b, h, j0 + jj);
              float dot = 0.0f;
              for (int64_t d = 0; d < D; ++d) dot += qi[d] * kj[d];
              S[i * Bc + jj] = (p.causal && j0 + jj > q0 + i) ? kNegInf : dot * p.scale;
            }
          }
        };
        std::fill(m.begin(), m.end(), kNegInf);
        for (int64_t j0 = 0; j0 < kv_end; j0 += Bc) {  // pass 1: m = rowmax(S)
          const int64_t nk = std::min(Bc, kv_end - j0);
          scores(j0, nk);
          for (int64_t i = 0; i < nq; ++i)
            for (int64_t jj = 0; jj < nk; ++jj) m[i] = std::max(m[i], S[i * Bc + jj]);
        }
        std::fill(l.begin(), l.end(), 0.0f);
        std::fill(O.begin(), O.end(), 0.0f);
        for (int64_t j0 = 0; j0 < kv_end; j0 += Bc) {  // pass 2: recompute S; P = exp(S - m); l += rowsum(P); O += P V
          const int64_t nk = std::min(Bc, kv_end - j0);
          scores(j0, nk);
          for (int64_t i = 0; i < nq; ++i) {
            if (m[i] == kNegInf) continue;
            float* Oi = O.data() + i * D;
            for (int64_t jj = 0; jj < nk; ++jj) {
              const float pij = std::exp(S[i * Bc + jj] - m[i]);
              l[i] += pij;
              const float* vj = p.at(v, p.vs, b, h, j0 + jj);
              for (int64_t d = 0; d < D; ++d) Oi[d] += pij * vj[d];
            }
          }
        }
        for (int64_t i = 0; i < nq; ++i) {  // O /= l
          const float inv_l = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
          float* oi = p.at(o, p.os, b, h, q0 + i);
          for (int64_t d = 0; d < D; ++d) oi[d] = O[i * D + d] * inv_l;
        }
      }
      zero_rows(p, o, b, h, Lq, p.rows_out(b));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// v3: one pass, online softmax, SIMD micro-kernels.
// ---------------------------------------------------------------------------------------------

// Per-thread buffers. K^T and V of the (b, h) last packed are kept: consecutive tasks of a
// thread are mostly query blocks of the same (b, h), which then skip the packing.
struct Workspace {
  int64_t packed = -1;         // b * H + h of the packed K^T / V, -1 for none
  std::vector<float> kt;       // K^T in key blocks: [ceil(Lk / Bc)][D][Bc], zero beyond Lk
  std::vector<float> vp;       // V: [ceil(Lk / Bc) * Bc][Dp], zero beyond Lk and D
  std::vector<float> qs;       // Q block * scale * log2(e): [Br][D]
  std::vector<float> S;        // scores, then P, of one tile: [Br][Bc]
  std::vector<float> O;        // unnormalised output of the query block: [Br][Dp]
  float m[Br], l[Br], alpha[Br];
  // bf16 dot-product path: K^T [ceil(Lk / Bc)][D2 / 2][Bc][2], V [ceil(Lk / Bc) * Bc / 2][Dp][2],
  // Q [Br][D2 / 2] pairs, P [Br][Bc]: pairs along the summed dimension, as vdpbf16ps reads them.
  std::vector<uint16_t> kt2, vp2, q2, p2;
};

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

template <typename scalar_t>
void pack_kv(const Problem& p, const scalar_t* k, const scalar_t* v, int64_t b, int64_t h, int64_t Dp, Workspace& ws) {
  const int64_t D = p.D, Lk = p.len_k(b), Tp = round_up(Lk, Bc);
  ws.kt.assign(Tp * D, 0.0f);
  ws.vp.assign(Tp * Dp, 0.0f);
  for (int64_t j = 0; j < Lk; ++j) {
    const scalar_t* kj = p.at(k, p.ks, b, h, j);
    const scalar_t* vj = p.at(v, p.vs, b, h, j);
    float* kt = ws.kt.data() + (j / Bc) * D * Bc + j % Bc;
    for (int64_t d = 0; d < D; ++d) kt[d * Bc] = static_cast<float>(kj[d]);
    for (int64_t d = 0; d < D; ++d) ws.vp[j * Dp + d] = static_cast<float>(vj[d]);
  }
  ws.packed = b * p.H + h;
}

// S[R][kNV * W] = Q[R][D] K^T[D][kNV * W]: R * kNV accumulators in registers, one broadcast of
// Q and kNV loads of K^T per d: 2 R kNV W flops per (R + kNV) loads.
template <int R>
inline void qk_tile(const float* q, int64_t D, const float* kt, float* S) {
  vf acc[R][kNV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kNV; ++c) acc[r][c] = vzero();
  for (int64_t d = 0; d < D; ++d) {
    vf kv[kNV];
    for (int c = 0; c < kNV; ++c) kv[c] = vload(kt + d * Bc + c * W);
    for (int r = 0; r < R; ++r) {
      const vf qv = vset1(q[r * D + d]);
      for (int c = 0; c < kNV; ++c) acc[r][c] = vfma(qv, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kNV; ++c) vstore(S + r * Bc + c * W, acc[r][c]);
}

// O[R][NV * W] = diag(alpha) O + P[R][nk] V[nk][NV * W]: the rescale by alpha is folded into
// loading the accumulators, so O is read and written once per key block.
template <int R, int NV>
inline void pv_tile(const float* P, int64_t nk, const float* v, int64_t Dp, const float* alpha, float* O) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r) {
    const vf a = vset1(alpha[r]);
    for (int c = 0; c < NV; ++c) acc[r][c] = vmul(vload(O + r * Dp + c * W), a);
  }
  for (int64_t j = 0; j < nk; ++j) {
    vf vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = vload(v + j * Dp + c * W);
    for (int r = 0; r < R; ++r) {
      const vf pv = vset1(P[r * Bc + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = vfma(pv, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) vstore(O + r * Dp + c * W, acc[r][c]);
}

// Calls f(std::integral_constant<int, R>) for a runtime R in [1, kR].
template <typename F>
inline void with_rows(int64_t R, F&& f) {
  static_assert(kR <= 6, "with_rows covers up to 6 rows");
  switch (R) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    default: f(std::integral_constant<int, 6>{}); break;
  }
}

template <int R>
inline void pv_rows(const float* P, int64_t nk, const float* v, int64_t Dp, const float* alpha, float* O) {
  static_assert(kNV <= 4, "pv_rows covers up to 4 vectors");
  int64_t c = 0;
  for (; c + kNV * W <= Dp; c += kNV * W) pv_tile<R, kNV>(P, nk, v + c, Dp, alpha, O + c);
  switch ((Dp - c) / W) {
    case 1: pv_tile<R, 1>(P, nk, v + c, Dp, alpha, O + c); break;
    case 2: pv_tile<R, 2>(P, nk, v + c, Dp, alpha, O + c); break;
    case 3: pv_tile<R, 3>(P, nk, v + c, Dp, alpha, O + c); break;
    default: break;
  }
}

// Online softmax of one row of the tile: `valid` of the nk scores may attend (the rest are
// masked). Updates the running max m and sum l, leaves P = 2^(S - m_new) in place (0 where
// masked) and returns alpha = 2^(m_old - m_new), the factor that rescales what O holds.
inline float online_softmax_row(float* S, int64_t nk, int64_t valid, float& m, float& l) {
  if (valid <= 0) {
    std::fill_n(S, round_up(nk, W), 0.0f);  // whole vectors: the bf16 path reads P in pairs
    return 1.0f;
  }
  vf mx = vset1(kNegInf);
  for (int64_t c = 0; c < valid; c += W) mx = vmax(mx, vkeep_first(vload(S + c), int(valid - c), kNegInf));
  const float m_new = std::max(m, vhmax(mx));                            // m_new = max(m, rowmax(S))
  const float alpha = m == kNegInf ? 0.0f : std::exp2(m - m_new);         // rescale l and O to the new max
  const vf mv = vset1(m_new);
  vf sum = vzero();
  for (int64_t c = 0; c < nk; c += W) {
    const vf P = vkeep_first(vexp2(vsub(vload(S + c), mv)), int(valid - c), 0.0f);  // P = exp(S - m_new)
    vstore(S + c, P);
    sum = vadd(sum, P);
  }
  l = l * alpha + vhsum(sum);                                             // l = alpha l + rowsum(P)
  m = m_new;
  return alpha;
}

template <typename scalar_t>
void flash_block(const Problem& p, const scalar_t* q, const scalar_t* k, const scalar_t* v, scalar_t* o,
                 int64_t b, int64_t h, int64_t q0, Workspace& ws) {
  const int64_t D = p.D, Dp = round_up(D, W), Lk = p.len_k(b);
  const int64_t nq = std::min(Br, p.len_q(b) - q0);  // real query rows of this block
  if (ws.packed != b * p.H + h) pack_kv(p, k, v, b, h, Dp, ws);
  const float qscale = p.scale * kLog2e;  // softmax in base 2: exp(x) = 2^(x log2 e)
  for (int64_t i = 0; i < nq; ++i) {
    const scalar_t* qi = p.at(q, p.qs, b, h, q0 + i);
    for (int64_t d = 0; d < D; ++d) ws.qs[i * D + d] = static_cast<float>(qi[d]) * qscale;
  }
  std::fill_n(ws.O.data(), nq * Dp, 0.0f);
  std::fill_n(ws.m, nq, kNegInf);
  std::fill_n(ws.l, nq, 0.0f);
  const int64_t kv_end = p.causal ? std::min(Lk, q0 + nq) : Lk;  // causal: later keys are masked for every row
  for (int64_t j0 = 0; j0 < kv_end; j0 += Bc) {
    const int64_t nk = std::min(Bc, kv_end - j0);
    const float* kt = ws.kt.data() + j0 * D;  // key block j0 / Bc: [D][Bc]
    for (int64_t i0 = 0; i0 < nq; i0 += kR) {  // S = Q K^T
      with_rows(std::min<int64_t>(kR, nq - i0), [&](auto R) {
        for (int64_t c = 0; c < nk; c += kNV * W) qk_tile<R()>(ws.qs.data() + i0 * D, D, kt + c, ws.S.data() + i0 * Bc + c);
      });
    }
    for (int64_t i = 0; i < nq; ++i) {  // m, l, P, alpha per row
      const int64_t valid = p.causal ? std::min(nk, q0 + i + 1 - j0) : nk;
      ws.alpha[i] = online_softmax_row(ws.S.data() + i * Bc, nk, valid, ws.m[i], ws.l[i]);
    }
    for (int64_t i0 = 0; i0 < nq; i0 += kR) {  // O = diag(alpha) O + P V
      with_rows(std::min<int64_t>(kR, nq - i0), [&](auto R) {
        pv_rows<R()>(ws.S.data() + i0 * Bc, nk, ws.vp.data() + j0 * Dp, Dp, ws.alpha + i0, ws.O.data() + i0 * Dp);
      });
    }
  }
  for (int64_t i = 0; i < nq; ++i) {  // O = O / l; a row that saw no key is 0
    const float inv_l = ws.l[i] > 0.0f ? 1.0f / ws.l[i] : 0.0f;
    scalar_t* oi = p.at(o, p.os, b, h, q0 + i);
    for (int64_t d = 0; d < D; ++d) oi[d] = static_cast<scalar_t>(ws.O[i * Dp + d] * inv_l);
  }
}

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;

inline uint16_t bits(at::BFloat16 x) { return x.x; }

void pack_kv_bf16(const Problem& p, const at::BFloat16* k, const at::BFloat16* v, int64_t b, int64_t h, int64_t Dp, Workspace& ws) {
  const int64_t D = p.D, Dh = (D + 1) / 2, Lk = p.len_k(b), Tp = round_up(Lk, Bc);
  ws.kt2.assign(Tp * Dh * 2, 0);
  ws.vp2.assign(Tp * Dp, 0);
  for (int64_t j = 0; j < Lk; ++j) {
    const at::BFloat16* kj = p.at(k, p.ks, b, h, j);
    const at::BFloat16* vj = p.at(v, p.vs, b, h, j);
    uint16_t* kt = ws.kt2.data() + ((j / Bc) * Dh * Bc + j % Bc) * 2;
    for (int64_t d = 0; d < D; ++d) kt[(d / 2) * Bc * 2 + d % 2] = bits(kj[d]);
    uint16_t* vp = ws.vp2.data() + (j / 2) * Dp * 2 + j % 2;
    for (int64_t d = 0; d < D; ++d) vp[d * 2] = bits(vj[d]);
  }
  ws.packed = b * p.H + h;
}

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// S[R][kNV * W] = c * Q[R][D] K^T: per pair of d, one 32-bit broadcast of two Q values and
// kNV loads of 16 keys x 2 d; vdpbf16ps adds both products to the fp32 accumulator.
template <int R>
inline void qk_tile_bf16(const uint32_t* q2, int64_t Dh, const uint16_t* kt2, float c, float* S) {
  vf acc[R][kNV];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < kNV; ++n) acc[r][n] = vzero();
  for (int64_t d2 = 0; d2 < Dh; ++d2) {
    __m512bh kv[kNV];
    for (int n = 0; n < kNV; ++n) kv[n] = as_bh(_mm512_loadu_si512(kt2 + (d2 * Bc + n * W) * 2));
    for (int r = 0; r < R; ++r) {
      const __m512bh qv = as_bh(_mm512_set1_epi32(int(q2[r * Dh + d2])));
      for (int n = 0; n < kNV; ++n) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], qv, kv[n]);
    }
  }
  const vf cv = vset1(c);  // scale * log2(e), applied in fp32 (Q stays exactly the input bf16)
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < kNV; ++n) vstore(S + r * Bc + n * W, vmul(acc[r][n], cv));
}

// O[R][NV * W] = diag(alpha) O + P V over pairs of keys (P rounded to bf16, V packed in pairs).
template <int R, int NV>
inline void pv_tile_bf16(const uint16_t* P2, int64_t nk, const uint16_t* vp2, int64_t Dp, const float* alpha, float* O) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r) {
    const vf a = vset1(alpha[r]);
    for (int n = 0; n < NV; ++n) acc[r][n] = vmul(vload(O + r * Dp + n * W), a);
  }
  for (int64_t j2 = 0; j2 < (nk + 1) / 2; ++j2) {  // an odd last key pairs with P = 0
    __m512bh vv[NV];
    for (int n = 0; n < NV; ++n) vv[n] = as_bh(_mm512_loadu_si512(vp2 + (j2 * Dp + n * W) * 2));
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, P2 + r * Bc + 2 * j2, 4);
      const __m512bh pv = as_bh(_mm512_set1_epi32(int(pair)));
      for (int n = 0; n < NV; ++n) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], pv, vv[n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) vstore(O + r * Dp + n * W, acc[r][n]);
}

template <int R>
inline void pv_rows_bf16(const uint16_t* P2, int64_t nk, const uint16_t* vp2, int64_t Dp, const float* alpha, float* O) {
  int64_t c = 0;
  for (; c + kNV * W <= Dp; c += kNV * W) pv_tile_bf16<R, kNV>(P2, nk, vp2 + 2 * c, Dp, alpha, O + c);
  switch ((Dp - c) / W) {
    case 1: pv_tile_bf16<R, 1>(P2, nk, vp2 + 2 * c, Dp, alpha, O + c); break;
    case 2: pv_tile_bf16<R, 2>(P2, nk, vp2 + 2 * c, Dp, alpha, O + c); break;
    case 3: pv_tile_bf16<R, 3>(P2, nk, vp2 + 2 * c, Dp, alpha, O + c); break;
    default: break;
  }
}

// flash_block for bf16 inputs on vdpbf16ps: the same algorithm, pairs instead of floats.
void flash_block_bf16(const Problem& p, const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v, at::BFloat16* o,
                      int64_t b, int64_t h, int64_t q0, Workspace& ws) {
  const int64_t D = p.D, Dh = (D + 1) / 2, Dp = round_up(D, W), Lk = p.len_k(b);
  const int64_t nq = std::min(Br, p.len_q(b) - q0);
  if (ws.packed != b * p.H + h) pack_kv_bf16(p, k, v, b, h, Dp, ws);
  ws.q2.assign(Br * Dh * 2, 0);
  for (int64_t i = 0; i < nq; ++i) {
    const at::BFloat16* qi = p.at(q, p.qs, b, h, q0 + i);
    for (int64_t d = 0; d < D; ++d) ws.q2[i * Dh * 2 + d] = bits(qi[d]);
  }
  const uint32_t* q2 = reinterpret_cast<const uint32_t*>(ws.q2.data());
  ws.p2.resize(Br * Bc);
  std::fill_n(ws.O.data(), nq * Dp, 0.0f);
  std::fill_n(ws.m, nq, kNegInf);
  std::fill_n(ws.l, nq, 0.0f);
  const float c = p.scale * kLog2e;
  const int64_t kv_end = p.causal ? std::min(Lk, q0 + nq) : Lk;
  for (int64_t j0 = 0; j0 < kv_end; j0 += Bc) {
    const int64_t nk = std::min(Bc, kv_end - j0);
    const uint16_t* kt2 = ws.kt2.data() + j0 * Dh * 2;
    for (int64_t i0 = 0; i0 < nq; i0 += kR) {  // S = Q K^T * scale * log2(e)
      with_rows(std::min<int64_t>(kR, nq - i0), [&](auto R) {
        for (int64_t n = 0; n < nk; n += kNV * W) qk_tile_bf16<R()>(q2 + i0 * Dh, Dh, kt2 + n * 2, c, ws.S.data() + i0 * Bc + n);
      });
    }
    for (int64_t i = 0; i < nq; ++i) {  // online softmax in fp32, then P rounded to bf16 for P V
      const int64_t valid = p.causal ? std::min(nk, q0 + i + 1 - j0) : nk;
      ws.alpha[i] = online_softmax_row(ws.S.data() + i * Bc, nk, valid, ws.m[i], ws.l[i]);
      for (int64_t n = 0; n < nk; n += W)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ws.p2.data() + i * Bc + n),
                            (__m256i)_mm512_cvtneps_pbh(vload(ws.S.data() + i * Bc + n)));
    }
    for (int64_t i0 = 0; i0 < nq; i0 += kR) {  // O = diag(alpha) O + P V
      with_rows(std::min<int64_t>(kR, nq - i0), [&](auto R) {
        pv_rows_bf16<R()>(ws.p2.data() + i0 * Bc, nk, ws.vp2.data() + j0 * Dp, Dp, ws.alpha + i0, ws.O.data() + i0 * Dp);
      });
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    const float inv_l = ws.l[i] > 0.0f ? 1.0f / ws.l[i] : 0.0f;
    at::BFloat16* oi = p.at(o, p.os, b, h, q0 + i);
    for (int64_t d = 0; d < D; ++d) oi[d] = static_cast<at::BFloat16>(ws.O[i * Dp + d] * inv_l);
  }
}
#else
constexpr bool kBf16Dot = false;
#endif

template <typename scalar_t>
void attention_v3(const Problem& p, const scalar_t* q, const scalar_t* k, const scalar_t* v, scalar_t* o) {
  struct Task { int64_t b, h, q0; };
  std::vector<Task> tasks;  // (b, h, query block), only blocks with real query rows
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.H; ++h)
      for (int64_t q0 = 0; q0 < p.len_q(b); q0 += Br) tasks.push_back({b, h, q0});
  const int64_t D = p.D, Dp = round_up(D, W);
  const int threads = at::get_num_threads();
  // Chunks of consecutive tasks, about 8 per thread: a thread then runs runs of query blocks of
  // one (b, h) and packs its K^T and V once, while the chunks still balance uneven (causal,
  // varlen) work.
  const int64_t chunk = std::max<int64_t>(1, int64_t(tasks.size()) / (8 * threads));
#pragma omp parallel num_threads(threads)
  {
    Workspace ws;
    ws.qs.resize(Br * D);
    ws.S.resize(Br * Bc);
    ws.O.resize(Br * Dp);
#pragma omp for schedule(dynamic, chunk) nowait
    for (size_t t = 0; t < tasks.size(); ++t) {
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
        flash_block_bf16(p, q, k, v, o, tasks[t].b, tasks[t].h, tasks[t].q0, ws);
        continue;
      }
#endif
      flash_block(p, q, k, v, o, tasks[t].b, tasks[t].h, tasks[t].q0, ws);
    }
#pragma omp for collapse(2) nowait
    for (int64_t b = 0; b < p.B; ++b)
      for (int64_t h = 0; h < p.H; ++h) zero_rows(p, o, b, h, p.len_q(b), p.rows_out(b));
  }
}

// ---------------------------------------------------------------------------------------------
// Bindings: checks with messages, then a Problem. btlib's Python wrappers check first too;
// these checks guard direct calls of torch.ops.btlib_cpu.*.
// ---------------------------------------------------------------------------------------------
void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t rank, bool allow_bf16) {
  for (const at::Tensor* x : {&q, &k, &v}) {
    TORCH_CHECK(x->device().is_cpu(), "btlib CPU attention: inputs must be CPU tensors; got ", x->device());
    TORCH_CHECK(x->dim() == rank, "btlib CPU attention: expected ", rank == 4 ? "(B, H, T, D)" : "(total, H, D)",
                " inputs; got ", x->sizes());
    TORCH_CHECK(x->scalar_type() == at::kFloat || (allow_bf16 && x->scalar_type() == at::kBFloat16),
                "btlib CPU attention: dtype must be float32", allow_bf16 ? " or bfloat16" : "", "; got ", x->scalar_type());
    TORCH_CHECK(x->numel() == 0 || x->stride(-1) == 1, "btlib CPU attention: head_dim must be contiguous (stride 1); call .contiguous()");
  }
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "btlib CPU attention: q, k, v must share one dtype");
  TORCH_CHECK(k.sizes() == v.sizes(), "btlib CPU attention: k and v must have one shape; got ", k.sizes(), " and ", v.sizes());
  const int64_t D = q.size(-1);
  TORCH_CHECK(D >= 1 && D <= kMaxD, "btlib CPU attention: head_dim must be in [1, ", kMaxD, "]; got ", D);
  TORCH_CHECK(k.size(-1) == D, "btlib CPU attention: q and k must have one head_dim; got ", D, " and ", k.size(-1));
}

template <typename F>
at::Tensor padded(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& lengths,
                  bool causal, double scale, bool allow_bf16, F&& kernel) {
  check_qkv(q, k, v, 4, allow_bf16);
  Problem p;
  p.B = q.size(0), p.H = q.size(1), p.Tq = q.size(2), p.D = q.size(3), p.Tk = k.size(2);
  TORCH_CHECK(k.size(0) == p.B && k.size(1) == p.H, "btlib CPU attention: k must be (B, H, S, D) with q's B and H; got ", k.sizes());
  at::Tensor len;
  if (lengths.has_value()) {
    len = lengths->to(at::kLong).contiguous();
    TORCH_CHECK(len.dim() == 1 && len.size(0) == p.B, "btlib CPU attention: lengths must be (B,) = (", p.B, ",); got ", len.sizes());
    if (p.B > 0) {
      const int64_t lo = len.min().item<int64_t>(), hi = len.max().item<int64_t>();
      TORCH_CHECK(lo >= 0 && hi <= std::min(p.Tq, p.Tk), "btlib CPU attention: lengths must lie in [0, ",
                  std::min(p.Tq, p.Tk), "] (the padded length); got [", lo, ", ", hi, "]");
    }
    p.lengths = len.data_ptr<int64_t>();
  }
  p.causal = causal;
  p.scale = float(scale);
  at::Tensor o = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  for (int i = 0; i < 3; ++i) p.qs[i] = q.stride(i), p.ks[i] = k.stride(i), p.vs[i] = v.stride(i), p.os[i] = o.stride(i);
  if (q.numel() > 0) kernel(p, q, k, v, o);
  return o;
}

at::Tensor v1_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& lengths, bool causal, double scale) {
  return padded(q, k, v, lengths, causal, scale, false, [](const Problem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& o) {
    attention_v1(p, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), o.data_ptr<float>());
  });
}

at::Tensor v2_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& lengths, bool causal, double scale) {
  return padded(q, k, v, lengths, causal, scale, false, [](const Problem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& o) {
    attention_v2(p, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), o.data_ptr<float>());
  });
}

void run_v3(const Problem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& o) {
  if (q.scalar_type() == at::kBFloat16)
    attention_v3(p, q.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), o.data_ptr<at::BFloat16>());
  else
    attention_v3(p, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), o.data_ptr<float>());
}

at::Tensor v3_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& lengths, bool causal, double scale) {
  return padded(q, k, v, lengths, causal, scale, true, run_v3);
}

at::Tensor varlen_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens, int64_t max_seqlen,
                     bool causal, double scale) {
  check_qkv(q, k, v, 3, true);
  TORCH_CHECK(k.sizes() == q.sizes(), "btlib CPU varlen attention: q, k, v must have one shape (total, H, D); got ", q.sizes(), " and ", k.sizes());
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt && cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1,
              "btlib CPU varlen attention: cu_seqlens must be a 1-D int32 tensor of B + 1 offsets; got ", cu_seqlens.scalar_type(), " ", cu_seqlens.sizes());
  const at::Tensor cu = cu_seqlens.contiguous();
  const int32_t* c = cu.data_ptr<int32_t>();
  const int64_t B = cu.numel() - 1;
  TORCH_CHECK(c[0] == 0, "btlib CPU varlen attention: cu_seqlens must start at 0; got ", c[0]);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(c[b + 1] >= c[b], "btlib CPU varlen attention: cu_seqlens must be non-decreasing; got ", c[b], " then ", c[b + 1], " at index ", b);
    TORCH_CHECK(c[b + 1] - c[b] <= max_seqlen, "btlib CPU varlen attention: sequence ", b, " has length ", c[b + 1] - c[b], " > max_seqlen ", max_seqlen);
  }
  TORCH_CHECK(c[B] == q.size(0), "btlib CPU varlen attention: cu_seqlens[-1] = ", c[B], " must equal the number of tokens ", q.size(0));
  Problem p;
  p.B = B, p.H = q.size(1), p.D = q.size(2), p.Tq = p.Tk = max_seqlen;
  p.cu_seqlens = c;
  p.causal = causal;
  p.scale = float(scale);
  at::Tensor o = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  auto strides = [](const at::Tensor& x, int64_t* s) { s[0] = 0, s[1] = x.stride(1), s[2] = x.stride(0); };
  strides(q, p.qs), strides(k, p.ks), strides(v, p.vs), strides(o, p.os);  // sequence b starts at token cu_seqlens[b]
  if (q.numel() > 0) run_v3(p, q, k, v, o);
  return o;
}

std::string build_info() {
  return std::string(kIsa) + (kBf16Dot ? "+bf16dot" : "") + " W=" + std::to_string(W) + " kR=" + std::to_string(kR) + " kNV=" + std::to_string(kNV) +
         " Br=" + std::to_string(Br) + " Bc=" + std::to_string(Bc) + " max_head_dim=" + std::to_string(kMaxD);
}

}  // namespace

TORCH_LIBRARY(btlib_cpu, m) {
  m.def("attention_v1(Tensor q, Tensor k, Tensor v, Tensor? lengths, bool causal, float scale) -> Tensor", &v1_op);
  m.def("attention_v2(Tensor q, Tensor k, Tensor v, Tensor? lengths, bool causal, float scale) -> Tensor", &v2_op);
  m.def("attention_v3(Tensor q, Tensor k, Tensor v, Tensor? lengths, bool causal, float scale) -> Tensor", &v3_op);
  m.def("varlen_v3(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, int max_seqlen, bool causal, float scale) -> Tensor", &varlen_op);
  m.def("build_info() -> str", &build_info);
}
