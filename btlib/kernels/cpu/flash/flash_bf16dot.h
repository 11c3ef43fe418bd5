// flash_bf16dot.h: v3's path for bf16 inputs on CPUs with AVX512_BF16 (vdpbf16ps).
//
// vdpbf16ps multiplies pairs of bf16 and adds both products to an fp32 lane: twice the
// multiply-adds per instruction of fp32 FMA, and half the bytes packed. So K^T, V, Q and P are
// stored in pairs along the summed dimension; P is rounded to bf16 for P V, as PyTorch's bf16
// kernels do. The online softmax and the block loop are flash.h's, shared with fp32.
#pragma once

#include "flash_tiles.h"

namespace btlib_core {
// The path v3 takes for element type T: fp32 products, unless bf16 can use vdpbf16ps.
template <typename T> struct PathFor { using type = F32Path<T>; };
}  // namespace btlib_core

#if defined(__AVX512BF16__)
namespace btlib_core {

constexpr bool kBf16Dot = true;

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// S[R][kNV * W] = c * Q[R][D] K^T: per pair of d, one 32-bit broadcast of two Q values and
// kNV loads of 16 keys x 2 d; c = scale * log2(e) is applied in fp32 (Q stays the input bf16).
template <int R, int NV = kNV>
inline void qk_tile_bf16(const uint32_t* q2, int64_t Dh, const uint16_t* kt2, float c, float* S, int64_t ldS) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) acc[r][n] = vzero();
  for (int64_t d2 = 0; d2 < Dh; ++d2) {
    __m512bh kv[NV];
    for (int n = 0; n < NV; ++n) kv[n] = as_bh(_mm512_loadu_si512(kt2 + (d2 * Bc + n * W) * 2));
    for (int r = 0; r < R; ++r) {
      const __m512bh qv = as_bh(_mm512_set1_epi32(int(q2[r * Dh + d2])));
      for (int n = 0; n < NV; ++n) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], qv, kv[n]);
    }
  }
  const vf cv = vset1(c);
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) vstore(S + r * ldS + n * W, vmul(acc[r][n], cv));
}

// O[R][NV * W] = diag(alpha) O + P V over pairs of keys (P in bf16, V packed in pairs).
template <int R, int NV>
inline void pv_tile_bf16(const uint16_t* P2, int64_t ldP, int64_t nk, const uint16_t* vp2, int64_t Dp, const float* alpha, float* O) {
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
      std::memcpy(&pair, P2 + r * ldP + 2 * j2, 4);
      const __m512bh pv = as_bh(_mm512_set1_epi32(int(pair)));
      for (int n = 0; n < NV; ++n) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], pv, vv[n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) vstore(O + r * Dp + n * W, acc[r][n]);
}

struct Bf16DotPath : RowTiles<Bf16DotPath> {
  static void reserve_kv(const Problem& p, int64_t b, int64_t Dp, Workspace& ws) {
    const int64_t Tp = round_up(p.len_k(b), Bc);
    ws.kt2.resize(Tp * (p.D + 1) / 2 * 2);
    ws.vp2.resize(Tp * Dp);
  }
  // key tile [j0, j0 + Bc): K^T as [Dh][Bc][2], V as [Bc / 2][Dp][2], zero beyond Lk and D
  static void pack_kv_tile(const Problem& p, const bf16* k, const bf16* v, int64_t b, int64_t h, int64_t Dp, int64_t j0,
                           Workspace& ws) {
    const int64_t D = p.D, Dh = (D + 1) / 2, nk = std::min(Bc, p.len_k(b) - j0);
    uint16_t* kt = ws.kt2.data() + j0 * Dh * 2;
    uint16_t* vp = ws.vp2.data() + j0 * Dp;  // Bc is even: a tile starts a pair
    if (nk < Bc || D % 2) std::fill_n(kt, Dh * Bc * 2, uint16_t(0));
    if (D % 2 == 0 && p.ks[2] % 2 == 0) {  // K rows as D / 2 pairs: K^T is their 32-bit transpose
      transpose_tile_u32(reinterpret_cast<const uint32_t*>(p.at(k, p.ks, b, h, j0)), p.ks[2] / 2, nk, Dh,
                         reinterpret_cast<uint32_t*>(kt));
    } else {  // an odd D's last pair is (K, 0)
      for (int64_t j = 0; j < nk; ++j) {
        const bf16* kj = p.at(k, p.ks, b, h, j0 + j);
        for (int64_t d = 0; d < D; ++d) kt[((d / 2) * Bc + j) * 2 + d % 2] = kj[d].x;
      }
    }
    // V rows j, j + 1 interleaved: 16 values of each widened to 32 bits, the second shifted up; zero
    // past D (masked loads) up to Dp, and the pairs of keys past nk (a missing odd row reads as 0)
    for (int64_t j = 0; j < Bc; j += 2) {
      const bf16* v0 = j < nk ? p.at(v, p.vs, b, h, j0 + j) : nullptr;
      const bf16* v1 = j + 1 < nk ? p.at(v, p.vs, b, h, j0 + j + 1) : nullptr;
      for (int64_t d = 0; d < Dp; d += 16) {
        const __mmask16 m = first_lanes(int(D - d));
        const __m512i a = v0 ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, v0 + d)) : _mm512_setzero_si512();
        const __m512i c = v1 ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, v1 + d)) : _mm512_setzero_si512();
        _mm512_storeu_si512(vp + (j / 2) * Dp * 2 + d * 2, _mm512_or_si512(a, _mm512_slli_epi32(c, 16)));
      }
    }
  }
  static void pack_q(const Problem& p, const bf16* q, int64_t b, int64_t h, int64_t q0, int64_t nq, Workspace& ws) {
    const int64_t Dh = (p.D + 1) / 2;
    ws.q2.assign(Br * Dh * 2, 0);  // an odd D pairs its last element with 0
    ws.qk_scale = p.scale * kLog2e;
    ws.p2.resize(Br * Bc);
    for (int64_t i = 0; i < nq; ++i) {
      const bf16* qi = p.at(q, p.qs, b, h, q0 + i);
      for (int64_t d = 0; d < p.D; ++d) ws.q2[i * Dh * 2 + d] = qi[d].x;
    }
  }
  template <int R>
  static void qk(Workspace& ws, int64_t D, int64_t i0, int64_t j0, int64_t c0, int64_t nk, float* S, int64_t ldS) {
    const int64_t Dh = (D + 1) / 2;
    const uint32_t* q2 = reinterpret_cast<const uint32_t*>(ws.q2.data());
    const float c = ws.qk_scale;
    across_columns(c0, nk, [&](int64_t n, auto NV) {
      qk_tile_bf16<R, NV()>(q2 + i0 * Dh, Dh, ws.kt2.data() + (j0 * Dh + n) * 2, c, S + i0 * ldS + n, ldS);
    });
  }
  // P row i, columns [c0, nk), rounded to bf16 (round to nearest even; NaN stays NaN) for the P V product
  static void store_p(Workspace& ws, int64_t i, int64_t c0, int64_t nk, int64_t ldS) {
    for (int64_t n = c0; n < nk; n += W)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ws.p2.data() + i * ldS + n),
                          (__m256i)_mm512_cvtneps_pbh(vload(ws.S.data() + i * ldS + n)));
  }
  template <int R>
  static void pv(Workspace& ws, int64_t Dp, int64_t i0, int64_t j0, int64_t c0, int64_t nk, int64_t ldS) {
    across_d<R>(Dp, [&](int64_t c, auto NV) {  // c0 is even (a multiple of W): it starts a pair of keys
      pv_tile_bf16<R, NV()>(ws.p2.data() + i0 * ldS + c0, ldS, nk - c0, ws.vp2.data() + (j0 + c0) * Dp + 2 * c, Dp, ws.alpha + i0,
                            ws.O.data() + i0 * Dp + c);
    });
  }
};
template <> struct PathFor<bf16> { using type = Bf16DotPath; };

}  // namespace btlib_core
#else
namespace btlib_core {
constexpr bool kBf16Dot = false;
}  // namespace btlib_core
#endif
