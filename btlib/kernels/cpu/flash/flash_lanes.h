// flash_lanes.h: v3 in fp32 with the score tile transposed, one query row per vector lane (AVX-512, AVX2); bf16 inputs
// take it too where the CPU has no vdpbf16ps (converted to fp32 as Q is packed and K, V copied; the output rounded once).
//
// flash.h's tiles hold S row by row (a query row's keys along a vector), which costs per row and key
// tile a horizontal max and a horizontal sum (a chain of shuffles), a scalar exp2 for alpha and the
// K^T transpose of every key tile (W x W in-register transposes), and V copied into a packed tile.
// Here S^T = K Q^T is computed as Bc keys x kLanesRows rows: a vector holds W query rows of one key, so
//   - Q^T (D x kLanesRows, times scale * log2 e) is packed once per query block, and K and V are not transposed:
//     their rows are copied, contiguous, once per (b, h) per thread (LanesWorkspace says why); K gives one
//     broadcast element per (key, d), V its rows to P V;
//   - the online softmax runs across keys, element-wise over the rows: m, l and alpha are vectors
//     (W rows each) and no horizontal reduction or scalar exp2 remains;
//   - P V is flash_tiles.h's pv_tile reading P^T[key][row] (its kPT form) and V's rows.
// Work and NaN / inf behaviour are flash.h's (see there); the masks are per key: the rows that may
// attend key j are one run [ilo, ihi) of lanes, since key_lo and key_hi do not decrease with the row.
// Taken by attention_v3 for fp32 (and bf16 without vdpbf16ps) without a window or a position bias and with D a
// multiple of W (the row-tile path keeps those: a per-key bias would be a reversed slice of BiasRows, and under a narrow
// window a block has 16 rows, one AVX-512 vector, so each FMA of qk_lanes needs its own broadcast load of
// K and the loads bound it: lanes blocks of 16 rows with spans, as flash.h's, ran the (64, 64) window at
// 0.83-0.85x the row tiles' speed, and (128, 128) / (256, 256) at 0.97 / 0.99x). Measured against the
// row tiles on an AMD EPYC Zen 4: AVX-512 +4-8% for padded and packed fp32 at T 256-1024 (CPU time of
// 1 thread), and a block of fewer rows computing only ceil(rows / W) vectors +8% on 8 sequences of 200,
// +31% on 64 of 20; AVX2 (blocks of 16 rows) +6% / +15% padded at T 256 / 1024, +5% on the 20-1000 mix,
// +9% causal (2 threads, interleaved medians of copies built side by side); then K and V copied contiguous (kCopyKeys)
// and the next block's Q prefetched, the AVX2 build's 20-1000 mix +13% fp32, +18% bf16 (bf16 had the row tiles); then
// the copy's rows prefetched and the max taken in qk_lanes without causal, +2-3% on the mix, +4-12% on 8 of 200,
// 32 of 40 and 64 of 20. NEON keeps the row tiles: it has not been measured on hardware.
#pragma once

#include "flash_tiles.h"

#if defined(BTLIB_VEC_AVX512) || defined(BTLIB_VEC_AVX2)
namespace btlib_core {

constexpr bool kLanes = true;
// Vectors of query rows in a full block, kNVR: a micro-tile keeps JR x NVR accumulators, NVR loaded vectors of Q^T and
// one broadcast, in 32 zmm registers (AVX-512: 4 vectors, 64 rows, 6 x 4) or 16 ymm (AVX2: 2 vectors, 16 rows, 6 x 2).
#if defined(BTLIB_VEC_AVX512)
constexpr int kNVR = 4;
#else
constexpr int kNVR = 2;
#endif
constexpr int64_t kLanesRows = kNVR * W;  // query rows per lanes block: 64 on AVX-512, 16 on AVX2

struct LanesWorkspace {
  std::vector<float> qt;  // Q^T * scale * log2(e): [D][kLanesRows], zero in lanes past the block's rows
  std::vector<float> st;  // S^T, then P^T, of one key tile: [Bc + kJRMax][kLanesRows] (qk_lanes writes whole groups of JR keys)
  std::vector<float> O;   // unnormalised output: [kLanesRows][D]
  // K and V of (b, h) `packed` in fp32, rows contiguous: [Lk][D], copied when a block of this thread first needs
  // them. Read in place, the rows of the packed (total, H, D) layout lie H D floats apart, and those strides share
  // few cache sets: at H 12, D 64 (3 KB) a key row maps to 1 of 4 groups of L1 sets and 1 of 128 of L2 sets, so the
  // K and V of a 1,000-token head (512 KB) did not stay in L2 from one query block to the next.
  std::vector<float> kc, vc;
  int64_t packed = -1;
  alignas(64) float alpha[kLanesRows], l[kLanesRows];
};
// fp32 keys are copied (LanesWorkspace::kc) for a (b, h) of more than one query block and at least kCopyKeys keys. Copies
// against reads in place (AVX2 build, AMD EPYC Zen 4, 2 threads, interleaved medians): 64 sequences of 20 0.95x, 32 of
// 40 0.94x (their keys stay in L1 either way), 8 of 200 1.03x, the 20-1000 mix 1.13x. bf16 is always copied (converted):
// its lanes blocks then ran 64 of 20 1.30x and 32 of 40 1.14x faster than the row tiles.
constexpr int64_t kCopyKeys = 2 * Bc;

// A block of nq rows computes NVR = ceil(nq / W) vectors of them (on AVX-512 a block of 8 rows one vector, not four),
// with JR keys per micro-tile: JR x NVR accumulators, 24 for a full AVX-512 block as flash_tiles.h's 6 x 4, 12 for a
// full AVX2 block, and at least 12 for fewer vectors so that enough independent FMAs are in flight.
constexpr int jr_for(int NVR) { return NVR == 1 ? 12 : NVR == 2 ? (kNVR == 2 ? 6 : 8) : 6; }
constexpr int kJRMax = 12;

// S^T[JR][kLanesRows] = K[JR][D] Q^T[D][kLanesRows] for the first NVR vectors of rows: per d one broadcast of each key's element
// and NVR loads of Q^T. kMax: also mx[v] = max(mx[v], the scores), taken from the registers (without causal every row
// attends every key of the tile, so the max needs no separate pass over S^T).
template <int NVR, int JR, bool kMax>
inline void qk_lanes(const float* qt, int64_t D, const float* const* krow, float* st, vf* mx) {
  vf acc[JR][NVR];
  for (int j = 0; j < JR; ++j)
    for (int v = 0; v < NVR; ++v) acc[j][v] = vzero();
  for (int64_t d = 0; d < D; ++d) {
    vf qv[NVR];
    for (int v = 0; v < NVR; ++v) qv[v] = vload(qt + d * kLanesRows + v * W);
    for (int j = 0; j < JR; ++j) {
      const vf kb = vset1(krow[j][d]);
      for (int v = 0; v < NVR; ++v) acc[j][v] = vfma(kb, qv[v], acc[j][v]);
    }
  }
  for (int j = 0; j < JR; ++j)
    for (int v = 0; v < NVR; ++v) {
      vstore(st + j * kLanesRows + v * W, acc[j][v]);
      if constexpr (kMax) mx[v] = vmax(mx[v], acc[j][v]);
    }
}

// One query block [q0, q0 + nq) of (b, h), nq <= NVR W. Returns the key tiles visited (core_check.cpp counts the band).
template <int NVR, typename T>
inline int64_t flash_block_lanes_n(const Problem& p, const T* q, const T* k, const T* v, T* o, int64_t b, int64_t h,
                                   int64_t q0, int64_t nq, LanesWorkspace& ws) {
  constexpr int kJR = jr_for(NVR);
  const int64_t D = p.D;
  ws.qt.assign(D * kLanesRows, 0.0f);
  ws.st.resize((Bc + kJRMax) * kLanesRows);
  ws.O.assign(kLanesRows * D, 0.0f);
  const float c = p.scale * kLog2e;
  for (int64_t i = 0; i < nq; ++i) {
    const T* qi = p.at(q, p.qs, b, h, q0 + i);
    for (int64_t d = 0; d < D; ++d) ws.qt[d * kLanesRows + i] = to_float(qi[d]) * c;
  }
  // While this block runs, the next block's query rows and this block's output rows come into L2: both are new
  // memory, rows H D apart in the packed layout (reading Q took ~5% of the 20-1000 mix on AVX2 before). A block of
  // fewer than kLanesRows rows is its sequence's last, so rows i < nq cover the next block; no keys (key_next = Lk).
  for (int64_t i = 0; i < nq; ++i) prefetch_ahead(p, q, k, v, o, b, h, q0 + kLanesRows + i, p.len_k(b), q0 + i);
  // K and V rows, ks / vs elements apart: the contiguous fp32 copy, or in place for fp32 whose rows are contiguous
  // already (the padded (B, H, T, D) layout) or where the copy would cost more than it saves (kCopyKeys).
  const bool in_place = std::is_same_v<T, float> && ((p.ks[2] == D && p.vs[2] == D) || p.len_q(b) <= kLanesRows ||
                                                    p.len_k(b) < kCopyKeys);
  if (!in_place && ws.packed != b * p.H + h) {
    const int64_t Lk = p.len_k(b);
    ws.kc.resize(Lk * D);
    ws.vc.resize(Lk * D);
    for (int64_t j = 0; j < Lk; ++j) {
      if (j + 8 < Lk)  // rows H D apart: the hardware prefetcher does not follow them
        for (int64_t d = 0; d < D; d += 64 / sizeof(T)) {
          __builtin_prefetch(p.at(k, p.ks, b, h, j + 8) + d, 0, 3);
          __builtin_prefetch(p.at(v, p.vs, b, h, j + 8) + d, 0, 3);
        }
      const T* kj = p.at(k, p.ks, b, h, j);
      const T* vj = p.at(v, p.vs, b, h, j);
      for (int64_t d = 0; d < D; ++d) ws.kc[j * D + d] = to_float(kj[d]), ws.vc[j * D + d] = to_float(vj[d]);
    }
    ws.packed = b * p.H + h;
  }
  // (a bf16 pointer is never read as float: in_place is false for bf16)
  const float* kf = in_place ? reinterpret_cast<const float*>(p.at(k, p.ks, b, h, 0)) : ws.kc.data();
  const float* vf_ = in_place ? reinterpret_cast<const float*>(p.at(v, p.vs, b, h, 0)) : ws.vc.data();
  const int64_t ks = in_place ? p.ks[2] : D, vs = in_place ? p.vs[2] : D;
  vf m[NVR], l[NVR];
  for (int v = 0; v < NVR; ++v) m[v] = vset1(kNegInf), l[v] = vzero();
  // Key j may be attended by rows [ilo(j), ihi(j)) of the block: causal cuts rows below j, padding
  // never reaches here (the span ends at kv_end); without a window every real row attends.
  const int64_t kv_end = p.key_hi(b, q0 + nq - 1);
  auto rows_of = [&](int64_t j, int64_t& ilo, int64_t& ihi) {
    ilo = p.causal ? std::max<int64_t>(0, j - q0) : 0;
    ihi = nq;
  };
  const float* krow[kJR];
  int64_t tiles = 0;
  for (int64_t j0 = 0; j0 < kv_end; j0 += Bc, ++tiles) {
    const int64_t nk = std::min(Bc, kv_end - j0);
    vf mx[NVR];
    for (int v = 0; v < NVR; ++v) mx[v] = vset1(kNegInf);
    for (int64_t j = 0; j < nk; j += kJR) {  // S^T = K Q^T; a short last group repeats its last key
      for (int r = 0; r < kJR; ++r) krow[r] = kf + (j0 + std::min<int64_t>(j + r, nk - 1)) * ks;
      if (p.causal)
        qk_lanes<NVR, kJR, false>(ws.qt.data(), D, krow, ws.st.data() + j * kLanesRows, mx);
      else
        qk_lanes<NVR, kJR, true>(ws.qt.data(), D, krow, ws.st.data() + j * kLanesRows, mx);
    }
    // m_new = max(m, max over the tile's keys): element-wise, 16 rows a vector. Masked scores are -inf. Without causal
    // qk_lanes took it.
    for (int64_t j = 0; j < (p.causal ? nk : 0); ++j) {
      int64_t ilo, ihi;
      rows_of(j0 + j, ilo, ihi);
      for (int v = 0; v < NVR; ++v) {
        const vf s = vload(ws.st.data() + j * kLanesRows + v * W);
        mx[v] = vmax(mx[v], ilo <= v * W && ihi >= (v + 1) * W ? s : vkeep_range(s, int(ilo - v * W), int(ihi - v * W), kNegInf));
      }
    }
    // A row whose attended scores are all -inf so far subtracts 0 instead (P = 0, not NaN), and its
    // alpha is 0 while m was -inf, as online_softmax_row does row by row.
    vf msub[NVR];
    for (int v = 0; v < NVR; ++v) {
      const vf mn = vmax(m[v], mx[v]);
      msub[v] = vselect_neginf(mn, vzero(), mn);
      const vf a = vselect_neginf(m[v], vzero(), vexp2(vsub(m[v], msub[v])));
      vstore(ws.alpha + v * W, a);
      l[v] = vmul(l[v], a);
      m[v] = mn;
    }
    for (int64_t j = 0; j < nk; ++j) {  // P^T = 2^(S^T - m_new), exact 0 where masked; l += P
      int64_t ilo, ihi;
      rows_of(j0 + j, ilo, ihi);
      for (int v = 0; v < NVR; ++v) {
        const vf e = vexp2(vsub(vload(ws.st.data() + j * kLanesRows + v * W), msub[v]));
        const vf P = ilo <= v * W && ihi >= (v + 1) * W ? e : vkeep_range(e, int(ilo - v * W), int(ihi - v * W), 0.0f);
        vstore(ws.st.data() + j * kLanesRows + v * W, P);
        l[v] = vadd(l[v], P);
      }
    }
    const float* vj = vf_ + j0 * vs;
    for (int64_t i0 = 0; i0 < nq; i0 += kR)  // O = diag(alpha) O + P V
      with_rows(std::min<int64_t>(kR, nq - i0), [&](auto R) {
        across_d<R()>(D, [&](int64_t cc, auto NV) {
          pv_tile<R(), NV(), true>(ws.st.data() + i0, kLanesRows, nk, vj + cc, vs, ws.alpha + i0, ws.O.data() + i0 * D + cc, D);
        });
      });
  }
  for (int v = 0; v < NVR; ++v) vstore(ws.l + v * W, l[v]);
  for (int64_t i = 0; i < nq; ++i) {  // O = O / l, as flash_block
    const float inv_l = ws.l[i] > 0.0f ? 1.0f / ws.l[i] : 0.0f;
    T* oi = p.at(o, p.os, b, h, q0 + i);
    for (int64_t d = 0; d < D; ++d) oi[d] = from_float<T>(ws.O[i * D + d] * inv_l);
  }
  return tiles;
}

template <typename T>
inline int64_t flash_block_lanes(const Problem& p, const T* q, const T* k, const T* v, T* o, int64_t b, int64_t h, int64_t q0,
                                 LanesWorkspace& ws) {
  const int64_t nq = std::min(kLanesRows, p.len_q(b) - q0);
  const int64_t nvr = (nq + W - 1) / W;
  if constexpr (kNVR == 4) {
    if (nvr == 3) return flash_block_lanes_n<3>(p, q, k, v, o, b, h, q0, nq, ws);
    if (nvr == 4) return flash_block_lanes_n<4>(p, q, k, v, o, b, h, q0, nq, ws);
  }
  return nvr == 1 ? flash_block_lanes_n<1>(p, q, k, v, o, b, h, q0, nq, ws) : flash_block_lanes_n<2>(p, q, k, v, o, b, h, q0, nq, ws);
}

// Can the lanes path run this problem? fp32 (the caller's type), no window, no bias, whole vectors of D.
inline bool lanes_take(const Problem& p) { return p.win_left < 0 && p.win_right < 0 && p.bias_kind == kBiasNone && p.D % W == 0; }

// v3 over every (b, h, query block) with the lanes blocks (core.h's for_query_blocks: flash.h's task
// order and chunks, then the padded output rows set to 0). Returns the (query block, key tile) pairs computed.
template <typename T, typename ParallelFor>
int64_t attention_lanes(const Problem& p, const T* q, const T* k, const T* v, T* o, int threads, ParallelFor&& parallel_for) {
  return for_query_blocks<LanesWorkspace>(p, kLanesRows, o, threads, parallel_for, [&](int64_t b, int64_t h, int64_t q0, LanesWorkspace& ws) {
    return flash_block_lanes(p, q, k, v, o, b, h, q0, ws);
  });
}

}  // namespace btlib_core
#else
namespace btlib_core {
constexpr bool kLanes = false;
}  // namespace btlib_core
#endif
