// flash_tiles.h: v3's per-thread workspace and its fp32 SIMD micro-kernels (vec.h).
//
// F32Path is how v3 (flash.h) computes S = Q K^T and O += P V in fp32: K^T and V are packed
// per key tile, once per (b, h) per thread, then register-blocked micro-tiles of kR rows x kNV
// vectors do both products. bf16 inputs take this path too where the CPU has no AVX512_BF16 (converted while
// packing); flash_bf16dot.h is the path for CPUs that have it.
#pragma once

#include <type_traits>
#include <vector>

#include "core.h"

namespace btlib_core {

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Under a window a block's work is small (16 rows x ~144 keys) while its rows, keys and outputs are new memory, rows
// H D apart in the packed (total, H, D) layout: reading Q and writing O took ~17% of a (64, 64) layer at 4,096
// tokens (AMD EPYC Zen 4, 2 threads). So while block q0 runs its online softmax, row i asks for what the next
// blocks need: the next block's query row i, the key and value Bc + i past this block's band (packed when a later
// block reaches its tile) and this block's output row i, into L2: 1.15-1.2x on that layer. All of it in one burst
// at the block's start gained 2% (the misses queue up), into L1 3% (it evicts the block's own tiles). Measure it on
// your CPU: python -m btlib.bench run windowed_attention_local (its "of bound" column), against a copy without it
// (btlib.kernels.cpu.build.load_copy). flash_lanes.h's blocks ask for the next block's query rows and their own output
// rows the same way (no keys: they copy a head's K and V once).
// always_inline: GCC finds that a function whose only statements are prefetches changes nothing and deletes the
// call (-O1 and up; an inline helper, or a lambda, emitted no prefetch at all), while prefetch statements inside
// flash_block are kept.
template <typename T>
[[gnu::always_inline]] inline void prefetch_ahead(const Problem& p, const T* q, const T* k, const T* v, T* o, int64_t b,
                                                  int64_t h, int64_t q_next, int64_t key_next, int64_t q_out) {
  constexpr int64_t kLine = 64 / sizeof(T);
  if (q_next < p.len_q(b)) {
    const T* x = p.at(q, p.qs, b, h, q_next);
    for (int64_t d = 0; d < p.D; d += kLine) __builtin_prefetch(x + d, 0, 2);
  }
  if (key_next < p.len_k(b)) {
    const T* x = p.at(k, p.ks, b, h, key_next);
    const T* y = p.at(v, p.vs, b, h, key_next);
    for (int64_t d = 0; d < p.D; d += kLine) {
      __builtin_prefetch(x + d, 0, 2);
      __builtin_prefetch(y + d, 0, 2);
    }
  }
  T* out = p.at(o, p.os, b, h, q_out);  // to be written: asked for with intent to write (prefetchw where the CPU has it)
  for (int64_t d = 0; d < p.D; d += kLine) __builtin_prefetch(out + d, 1, 2);
}

// Per-thread buffers. K^T and V of the (b, h) last used are kept, tile by tile as blocks first
// need them: consecutive tasks of a thread are mostly query blocks of the same (b, h), which then
// skip the packing, and with a window a thread packs only the tiles its blocks' bands reach.
struct Workspace {
  int64_t packed = -1;    // b * H + h whose tiles kt / vp hold, -1 for none
  std::vector<uint8_t> tile_ready;  // per key tile of that (b, h): packed yet?
  std::vector<float> kt;  // K^T in key blocks: [ceil(Lk / Bc)][D][Bc], zero beyond Lk
  std::vector<float> vp;  // V: [ceil(Lk / Bc) * Bc][Dp], zero beyond Lk and D
  std::vector<float> qs;  // Q block * scale * log2(e): [Br][D]
  std::vector<float> S;   // scores, then P, of one tile: [Br][Bc]
  std::vector<float> O;   // unnormalised output of the query block: [Br][Dp]
  float m[Br], l[Br], alpha[Br];
  float qk_scale = 1.0f;  // scale * log2(e), applied to S on the bf16 path
  // bf16 dot-product path: K^T [ceil(Lk / Bc)][D2 / 2][Bc][2], V [ceil(Lk / Bc) * Bc / 2][Dp][2],
  // Q [Br][D2 / 2] pairs, P [Br][Bc]: pairs along the summed dimension, as vdpbf16ps reads them.
  std::vector<uint16_t> kt2, vp2, q2, p2;
};

#if defined(BTLIB_VEC_AVX512)
// dst[c * dst_stride + r] = src[r * src_stride + c], a 16 x 16 block of 32-bit values (fp32, or bf16 pairs):
// rows r < nr and columns c < nc of src are read, the rest taken as 0; dst rows c < nc are written, all 16
// lanes. The K^T packing of both AVX-512 paths: 16 loads, 64 in-register shuffles and 16 stores per 256
// values, where the scalar transpose stored each value alone, 64 cache lines apart per key (it cost ~12%
// of v3 at T 1000, fp32 and bf16, AMD EPYC Zen 4, 2 threads).
inline void transpose16_u32(const uint32_t* src, int64_t src_stride, int nr, int nc, uint32_t* dst, int64_t dst_stride) {
  const __mmask16 cm = first_lanes(nc);
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = i < nr ? _mm512_maskz_loadu_epi32(cm, src + i * src_stride) : _mm512_setzero_si512();
  for (int i = 0; i < 16; i += 2) {  // pairs of rows, interleaved by 32 bits
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // quads of rows, by 64 bits: r[i + c] holds columns c, c + 4, c + 8, c + 12
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)  // 128-bit lanes of rows 0-7 / 8-15
    for (int c = 0; c < 4; ++c) {
      t[h + c] = _mm512_shuffle_i32x4(r[h + c], r[h + 4 + c], 0x88);
      t[h + 4 + c] = _mm512_shuffle_i32x4(r[h + c], r[h + 4 + c], 0xdd);
    }
  for (int c = 0; c < 8; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd);
  }
  for (int c = 0; c < nc; ++c) _mm512_storeu_si512(dst + c * dst_stride, r[c]);
}

// The nk x D rows of a key tile (row stride ld) transposed into kt [D][Bc]; kt is zero where j >= nk
inline void transpose_tile_u32(const uint32_t* src, int64_t ld, int64_t nk, int64_t D, uint32_t* kt) {
  for (int64_t j = 0; j < nk; j += 16)
    for (int64_t d = 0; d < D; d += 16)
      transpose16_u32(src + j * ld + d, ld, int(std::min<int64_t>(16, nk - j)), int(std::min<int64_t>(16, D - d)),
                      kt + d * Bc + j, Bc);
}
#endif

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

// S[R][NV * W] = Q[R][D] K^T[D][NV * W] (S rows ldS apart): R * NV accumulators in registers, one
// broadcast of Q and NV loads of K^T per d: 2 R NV W flops per (R + NV) loads. NV < kNV only for a
// window's partial tile (flash.h computes just the vectors its band reaches).
template <int R, int NV = kNV>
inline void qk_tile(const float* q, int64_t D, const float* kt, float* S, int64_t ldS) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = vzero();
  for (int64_t d = 0; d < D; ++d) {
    vf kv[NV];
    for (int c = 0; c < NV; ++c) kv[c] = vload(kt + d * Bc + c * W);
    for (int r = 0; r < R; ++r) {
      const vf qv = vset1(q[r * D + d]);
      for (int c = 0; c < NV; ++c) acc[r][c] = vfma(qv, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) vstore(S + r * ldS + c * W, acc[r][c]);
}

// O[R][NV * W] = diag(alpha) O + P[R][nk] V[nk][NV * W]: P rows ldP apart, or with kPT stored transposed (P^T,
// key rows ldP apart: flash_lanes.h's scores); V rows ldV apart, O rows ldO apart. The rescale by alpha is folded
// into loading the accumulators, so O is read and written once per span of keys.
template <int R, int NV, bool kPT = false>
inline void pv_tile(const float* P, int64_t ldP, int64_t nk, const float* v, int64_t ldV, const float* alpha, float* O,
                    int64_t ldO) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r) {
    const vf a = vset1(alpha[r]);
    for (int c = 0; c < NV; ++c) acc[r][c] = vmul(vload(O + r * ldO + c * W), a);
  }
  for (int64_t j = 0; j < nk; ++j) {
    vf vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = vload(v + j * ldV + c * W);
    for (int r = 0; r < R; ++r) {
      const vf pv = vset1(kPT ? P[j * ldP + r] : P[r * ldP + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = vfma(pv, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) vstore(O + r * ldO + c * W, acc[r][c]);
}

// Calls f(std::integral_constant<int, NV>{}) for a runtime NV in [1, kNV] (instantiates only those).
template <int N = 1, typename F>
inline void with_vectors(int64_t NV, F&& f) {
  if constexpr (N < kNV) {
    if (NV > N) return with_vectors<N + 1>(NV, f);
  }
  f(std::integral_constant<int, N>{});
}

// A row of n columns from c0 in pieces of up to kNV vectors: tile(c, NV) for each piece (the last may be shorter).
template <typename Tile>
inline void across_columns(int64_t c0, int64_t n, Tile&& tile) {
  for (int64_t c = c0; c < n; c += kNV * W) with_vectors(std::min<int64_t>(kNV, (round_up(n, W) - c) / W), [&](auto NV) { tile(c, NV); });
}

// pv_tile across the padded head_dim Dp: whole kNV-vector tiles, then a 1..kNV-1 vector rest.
template <int R, typename Tile>
inline void across_d(int64_t Dp, Tile&& tile) {
  across_columns(0, Dp, tile);
}

// The block loops of the paths that compute kR query rows at a time (F32Path, Bf16DotPath). flash.h
// works on spans of keys: one tile (Bc keys) for a block of Br rows, up to Br / rows tiles for a
// narrower block, whose S then has rows ldS = Bc Br / rows apart in the same buffer. qk_block fills
// the span's columns of one key tile; pv_block runs P V once over the whole span. Both start at c0 (a
// multiple of W), where the block's band enters the span: a window's first tile costs only the
// vectors it uses, and P is never read before c0. A path with other tiles (flash_amx.h) has its own.
template <typename Path>
struct RowTiles {
  using Local = Workspace;  // the per-thread state for_tasks makes
  static constexpr bool kColumns = true;  // honours c0 and spans (AmxPath computes whole 16 x 16 tiles of one key tile)
  // S rows [0, nq), columns [c0, nk) of S (rows ldS apart) = Q K^T * scale * log2(e) for the keys of tile j0
  static void qk_block(Workspace& ws, int64_t D, int64_t nq, int64_t j0, int64_t c0, int64_t nk, float* S, int64_t ldS) {
    for (int64_t i0 = 0; i0 < nq; i0 += kR)
      with_rows(std::min<int64_t>(kR, nq - i0), [&](auto R) { Path::template qk<R()>(ws, D, i0, j0, c0, nk, S, ldS); });
  }
  // O rows [0, nq) = diag(alpha) O + P V, over the span's keys [j0 + c0, j0 + nk) (V is packed contiguously across tiles)
  static void pv_block(Workspace& ws, int64_t Dp, int64_t nq, int64_t j0, int64_t c0, int64_t nk, int64_t ldS) {
    for (int64_t i0 = 0; i0 < nq; i0 += kR)
      with_rows(std::min<int64_t>(kR, nq - i0), [&](auto R) { Path::template pv<R()>(ws, Dp, i0, j0, c0, nk, ldS); });
  }
};

template <typename T>
struct F32Path : RowTiles<F32Path<T>> {
  // room for sequence b's K^T and V; tiles are packed by pack_kv_tile
  static void reserve_kv(const Problem& p, int64_t b, int64_t Dp, Workspace& ws) {
    const int64_t Tp = round_up(p.len_k(b), Bc);
    ws.kt.resize(Tp * p.D);
    ws.vp.resize(Tp * Dp);
  }
  // key tile [j0, j0 + Bc): K^T as [D][Bc], V as [Bc][Dp], zero beyond Lk and D
  static void pack_kv_tile(const Problem& p, const T* k, const T* v, int64_t b, int64_t h, int64_t Dp, int64_t j0,
                           Workspace& ws) {
    const int64_t D = p.D, nk = std::min(Bc, p.len_k(b) - j0);
    float* kt = ws.kt.data() + j0 * D;
    float* vp = ws.vp.data() + j0 * Dp;
    if (nk < Bc) std::fill_n(kt, D * Bc, 0.0f);
    if (nk < Bc || Dp > D) std::fill_n(vp, Bc * Dp, 0.0f);
#if defined(BTLIB_VEC_AVX512)
    if constexpr (std::is_same_v<T, float>) {
      transpose_tile_u32(reinterpret_cast<const uint32_t*>(p.at(k, p.ks, b, h, j0)), p.ks[2], nk, D,
                         reinterpret_cast<uint32_t*>(kt));
      for (int64_t j = 0; j < nk; ++j) std::memcpy(vp + j * Dp, p.at(v, p.vs, b, h, j0 + j), D * sizeof(float));
      return;
    }
#endif
    for (int64_t j = 0; j < nk; ++j) {
      const T* kj = p.at(k, p.ks, b, h, j0 + j);
      const T* vj = p.at(v, p.vs, b, h, j0 + j);
      for (int64_t d = 0; d < D; ++d) kt[d * Bc + j] = to_float(kj[d]);
      for (int64_t d = 0; d < D; ++d) vp[j * Dp + d] = to_float(vj[d]);
    }
  }
  // Q * scale * log2(e): the softmax runs in base 2, exp(x) = 2^(x log2 e)
  static void pack_q(const Problem& p, const T* q, int64_t b, int64_t h, int64_t q0, int64_t nq, Workspace& ws) {
    const float c = p.scale * kLog2e;
    ws.qs.resize(Br * p.D);
    for (int64_t i = 0; i < nq; ++i) {
      const T* qi = p.at(q, p.qs, b, h, q0 + i);
      for (int64_t d = 0; d < p.D; ++d) ws.qs[i * p.D + d] = to_float(qi[d]) * c;
    }
  }
  // S rows [i0, i0 + R) for the nk keys of block j0
  template <int R>
  static void qk(Workspace& ws, int64_t D, int64_t i0, int64_t j0, int64_t c0, int64_t nk, float* S, int64_t ldS) {
    const float* kt = ws.kt.data() + j0 * D;  // key block j0 / Bc: [D][Bc]
    across_columns(c0, nk, [&](int64_t c, auto NV) { qk_tile<R, NV()>(ws.qs.data() + i0 * D, D, kt + c, S + i0 * ldS + c, ldS); });
  }
  static void store_p(Workspace&, int64_t, int64_t, int64_t, int64_t) {}  // P V reads P from S, in fp32
  template <int R>
  static void pv(Workspace& ws, int64_t Dp, int64_t i0, int64_t j0, int64_t c0, int64_t nk, int64_t ldS) {
    across_d<R>(Dp, [&](int64_t c, auto NV) {
      pv_tile<R, NV()>(ws.S.data() + i0 * ldS + c0, ldS, nk - c0, ws.vp.data() + (j0 + c0) * Dp + c, Dp, ws.alpha + i0,
                       ws.O.data() + i0 * Dp + c, Dp);
    });
  }
};

}  // namespace btlib_core
