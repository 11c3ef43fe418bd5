// flash.h: v3, one pass with the online softmax (FlashAttention, Dao et al. 2022, Algorithm 1),
// on padded (B, H, T, D) or packed (total, H, D) + cu_seqlens inputs; no torch in here.
//
// Work: 4 D sum(Lq Lk) flops (causal about half), none on padding: tasks exist only for real query
// blocks and read only their own sequence's keys. With a local window (left, right) a query block
// visits only the key tiles that intersect its band [key_lo(q0), key_hi(q0 + Br - 1)): about
// 4 D L (Br + left + right) rounded up to whole Bc tiles per sequence instead of 4 D L^2 (at
// (64, 64) and Br = Bc = 64: 3 tiles, 192 keys per row for 129 allowed). Per query block Q (Br x D),
// S (Br x Bc) and O (Br x Dp) stay in L1/L2; K^T and V tiles are packed once per (b, h) per
// thread, when a block first reaches them, and stream through.
// The products run on a Path (flash_tiles.h: fp32; flash_bf16dot.h: vdpbf16ps; flash_amx.h: AMX tiles,
// through attention_v3_on); the softmax, the masks, the position bias and the block loop below are the same for all.
//
// Position bias (ALiBi or a relative-position table, core.h's Problem::bias_kind): added to each row's
// scores of the tile after Q K^T, inside the online softmax's max pass, from (h, j - i) alone: a (T, T)
// bias never exists. Per call the bias of every distance is written out once per head (BiasRows, H x 2T
// floats, in log2 units like S); a tile row reads its slice of that, so each score costs one load and
// one add beside the ~2D flops of its Q K^T product, whatever the kind. Without a bias the per-row
// pointer test is all that remains.
//
// NaN and inf, as in the reference: a row whose attended scores hold a NaN or +inf is NaN in every
// element (softmax of it is NaN); a row whose attended scores are all -inf outputs 0 (as SDPA; a
// window of one key makes that one inf key away); NaN or inf in V at an attended key flows
// through P V (and, as in the reference's P V, may reach rows that share its key tile without
// attending it: 0 * NaN); keys beyond the sequence's length are never packed and padded query
// rows are written as exact 0, so nothing in the padding reaches a real row.
#pragma once

#include <cstdlib>

#include "flash_bf16dot.h"
#include "flash_lanes.h"
#include "flash_tiles.h"

namespace btlib_core {

// Online softmax of one row of the tile: scores [first, last) of the nk may attend (the rest are
// masked: padding and causal cut a suffix, a window also a prefix). Only columns [c0, nk) exist
// (c0 <= first, a multiple of W: where the block's band enters the tile); P is written there. Updates the running max m
// and sum l, leaves P = 2^(S - m_new) in place (exact 0 where masked: replaced, never multiplied,
// so a NaN or inf score there cannot leak) and returns alpha = 2^(m_old - m_new), the factor
// that rescales what O holds. A NaN score can be lost by the max but not by S - m_new: its P is
// NaN, so l and O are. bias (or nullptr): the row's position bias in log2 units, bias[c] for key c,
// added to S in the max pass (one extra load, add and store per vector; the scores are read once).
inline float online_softmax_row(float* S, int64_t c0, int64_t nk, int64_t first, int64_t last, float& m, float& l,
                                const float* bias = nullptr) {
  if (last <= first) {
    std::fill(S + c0, S + round_up(nk, W), 0.0f);  // whole vectors: the bf16 path reads P in pairs
    return 1.0f;
  }
  vf mx = vset1(kNegInf);
  if (bias) {
    for (int64_t c = first / W * W; c < last; c += W) {
      const vf x = vadd(vload(S + c), vload(bias + c));  // lanes outside [first, last) are masked below and by the exp pass
      vstore(S + c, x);
      mx = vmax(mx, vkeep_range(x, int(first - c), int(last - c), kNegInf));
    }
  } else {
    for (int64_t c = first / W * W; c < last; c += W) mx = vmax(mx, vkeep_range(vload(S + c), int(first - c), int(last - c), kNegInf));
  }
  const float m_new = std::max(m, vhmax(mx));                     // m_new = max(m, rowmax(S))
  const float alpha = m == kNegInf ? 0.0f : std::exp2(m - m_new);  // rescale l and O to the new max
  if (m_new == kNegInf) {
    // Every attended score so far is -inf (or NaN, which the max drops): P = 0, NaN stays NaN, so
    // l = 0 and the row outputs 0 as SDPA's does, unless a NaN came. 2^(S - m_new) would be NaN,
    // and the vector exp2 of -inf is only ~1e-38 on AVX2/NEON, not 0. Rare: a scalar loop.
    float sum = 0.0f;
    for (int64_t j = c0; j < round_up(nk, W); ++j) sum += (S[j] = j >= first && j < last && std::isnan(S[j]) ? S[j] : 0.0f);
    l = l * alpha + sum;
    return alpha;
  }
  const vf mv = vset1(m_new);
  vf sum = vzero();
  for (int64_t c = c0; c < nk; c += W) {
    if (c + W <= first || c >= last) {  // a vector wholly outside the row's keys: P = 0, no exp
      vstore(S + c, vzero());
      continue;
    }
    const vf P = vkeep_range(vexp2(vsub(vload(S + c), mv)), int(first - c), int(last - c), 0.0f);  // P = exp(S - m_new)
    vstore(S + c, P);
    sum = vadd(sum, P);
  }
  l = l * alpha + vhsum(sum);  // l = alpha l + rowsum(P)
  m = m_new;
  return alpha;
}

// The position bias of every distance a call can meet, per head, in log2 units: row h holds
// bias(h, d) * log2(e) for d = j - i in [-(L - 1), L - 1] at index d + L - 1, L the longest sequence
// (query or key side), then W zeros (a row's last vector may read up to W - 1 past its last key).
// H (2L - 1 + W) floats, built once per call: O(H T), never a (T, T) tensor. A tile row then reads
// its bias as one contiguous slice, bias(h, j0 + c - i) for key c, whatever the kind: ALiBi's
// -slope |d| and the table's clamp to [-R, R] are paid here, not per score.
struct BiasRows {
  std::vector<float> v;
  int64_t stride = 0, zero = 0;  // row h starts at h * stride; distance d sits at zero + d
  const float* at(int64_t h, int64_t i, int64_t j0) const { return v.data() + h * stride + zero + (j0 - i); }
};
inline BiasRows expand_position_bias(const Problem& p) {
  BiasRows r;
  if (p.bias_kind == kBiasNone) return r;
  int64_t L = 1;
  for (int64_t b = 0; b < p.B; ++b) L = std::max({L, p.len_q(b), p.len_k(b)});
  r.zero = L - 1, r.stride = 2 * L - 1 + W;
  r.v.assign(p.H * r.stride, 0.0f);
  for (int64_t h = 0; h < p.H; ++h) {
    float* row = r.v.data() + h * r.stride + r.zero;
    if (p.bias_kind == kBiasAlibi) {
      const float slope = -p.bias[h] * kLog2e;  // -slope |d| in base 2
      for (int64_t d = -(L - 1); d < L; ++d) row[d] = slope * float(std::abs(d));
    } else {  // kBiasTable: row h of (H, 2R + 1), centred on d = 0, its end values beyond |d| = R
      const int64_t R = p.bias_R;
      const float* t = p.bias + h * (2 * R + 1) + R;
      for (int64_t d = -(L - 1); d < L; ++d) row[d] = t[std::clamp(d, -R, R)] * kLog2e;
    }
  }
  return r;
}

// Query rows per block on a path: Problem::block_rows() where the path computes spans and partial
// tiles (RowTiles), Br on AMX (whole 16 x 16 tiles of one key tile).
template <typename Path>
int64_t rows_per_block(const Problem& p) {
  return Path::kColumns ? p.block_rows() : Br;
}

// One query block [q0, q0 + rows) of (b, h): O = softmax(Q K^T * scale + bias) V over the keys it attends.
// Returns the number of key tiles it visited (core_check.cpp checks it against the band).
template <typename Path, typename T>
int64_t flash_block(const Problem& p, const BiasRows& bias, const T* q, const T* k, const T* v, T* o, int64_t b,
                    int64_t h, int64_t q0, Workspace& ws) {
  const int64_t D = p.D, Dp = round_up(D, W), rows = rows_per_block<Path>(p);
  const int64_t nq = std::min(rows, p.len_q(b) - q0);  // real query rows of this block
  // Keys are taken a span at a time: the scores of the span (rows x ldS) fill the same Br x Bc buffer
  // whatever the rows, so a block of 16 rows takes up to 4 key tiles per online-softmax step. Under a
  // window (64, 64) its whole band (144 keys) is then one step: one max, one sum and one rescale of O
  // per row, where one step per tile made three.
  const int64_t ldS = Bc * (Br / rows);
  ws.S.resize(Br * Bc);
  ws.O.resize(Br * Dp);
  // K^T and V tiles are packed when a block of this thread first reaches them, into buffers sized
  // for the whole sequence (one tile index for every block; a thread's chunk of tasks is mostly
  // consecutive blocks of one (b, h), which reuse them). With a window a thread then packs only
  // the tiles its blocks' bands reach: packing a tile (a transpose, 2 Bc D copies; 16 x 16 in-register
  // transposes on AVX-512, scalar elsewhere) is a fair part of one (block, tile) product, and at (64, 64)
  // a block computes only 3 of them.
  if (ws.packed != b * p.H + h) {
    Path::reserve_kv(p, b, Dp, ws);
    ws.tile_ready.assign(round_up(p.len_k(b), Bc) / Bc, 0);
    ws.packed = b * p.H + h;
  }
  Path::pack_q(p, q, b, h, q0, nq, ws);
  std::fill_n(ws.O.data(), nq * Dp, 0.0f);
  std::fill_n(ws.m, nq, kNegInf);
  std::fill_n(ws.l, nq, 0.0f);
  // The block's rows attend keys in [kv_begin, kv_end): padding and causal end it, a window also
  // starts it. Tiles stay aligned to Bc (the packing's), so the first is the one holding kv_begin.
  const int64_t kv_begin = p.key_lo(q0), kv_end = p.key_hi(b, q0 + nq - 1);
  int64_t tiles = 0;
  for (int64_t j0 = kv_begin / Bc * Bc; j0 < kv_end; j0 += ldS) {
    const int64_t nk = std::min(ldS, kv_end - j0);  // the span's keys [j0, j0 + nk)
    // The band enters the span at key kv_begin: the vectors before it are never computed (a window's
    // first tile), unless the path computes whole tiles (AMX).
    const int64_t c0 = Path::kColumns ? std::max<int64_t>(0, kv_begin - j0) / W * W : 0;
    for (int64_t t0 = j0; t0 < j0 + nk; t0 += Bc, ++tiles) {  // S = Q K^T * scale * log2(e), tile by tile
      if (!ws.tile_ready[t0 / Bc]) {
        Path::pack_kv_tile(p, k, v, b, h, Dp, t0, ws);
        ws.tile_ready[t0 / Bc] = 1;
      }
      Path::qk_block(ws, D, nq, t0, std::max<int64_t>(0, c0 - (t0 - j0)), std::min(Bc, j0 + nk - t0), ws.S.data() + (t0 - j0), ldS);
    }
    const bool ahead = p.win_left >= 0 && j0 == kv_begin / Bc * Bc;  // a window's first span: prefetch_ahead
    for (int64_t i = 0; i < nq; ++i) {  // m, l, P, alpha per row, over its keys [lo, hi) within the span
      if (ahead) prefetch_ahead(p, q, k, v, o, b, h, q0 + rows + i, kv_end + Bc + i, q0 + i);
      const int64_t first = std::clamp<int64_t>(p.key_lo(q0 + i) - j0, 0, nk);
      const int64_t last = std::clamp<int64_t>(p.key_hi(b, q0 + i) - j0, 0, nk);
      const float* row_bias = bias.v.empty() ? nullptr : bias.at(h, q0 + i, j0);
      ws.alpha[i] = online_softmax_row(ws.S.data() + i * ldS, c0, nk, first, last, ws.m[i], ws.l[i], row_bias);
      Path::store_p(ws, i, c0, nk, ldS);
    }
    Path::pv_block(ws, Dp, nq, j0, c0, nk, ldS);  // O = diag(alpha) O + P V
  }
  for (int64_t i = 0; i < nq; ++i) {
    // O = O / l. l >= 1 once a score is finite; l = 0 for a row with no key or only -inf scores,
    // which outputs 0 (O is 0 there, or NaN from 0 * inf in V, as in the reference); a NaN l comes
    // with a NaN O, which stays NaN.
    const float inv_l = ws.l[i] > 0.0f ? 1.0f / ws.l[i] : 0.0f;
    T* oi = p.at(o, p.os, b, h, q0 + i);
    for (int64_t d = 0; d < D; ++d) oi[d] = from_float<T>(ws.O[i * Dp + d] * inv_l);
  }
  return tiles;
}

// v3 over all (b, h, query block) tasks on `threads` workers of parallel_for (core.h), then the
// padded output rows set to 0. T is float or bf16. Returns the number of (query block, key tile)
// pairs computed: the work done, which a window cuts (core_check.cpp counts the band's tiles).
// Path: how the two products run (PathFor<T>: fp32 or vdpbf16ps; flash_amx.h's AmxPath on AMX tiles).
template <typename Path, typename T, typename ParallelFor>
int64_t attention_v3_on(const Problem& p, const T* q, const T* k, const T* v, T* o, int threads, ParallelFor&& parallel_for) {
  const BiasRows bias = expand_position_bias(p);
  return for_query_blocks<typename Path::Local>(p, rows_per_block<Path>(p), o, threads, parallel_for,
                                                [&](int64_t b, int64_t h, int64_t q0, Workspace& ws) {
                                                  return flash_block<Path>(p, bias, q, k, v, o, b, h, q0, ws);
                                                });
}

// Does v3 take the lanes blocks (flash_lanes.h) for this problem? On AVX-512 and AVX2, without a window or bias: fp32,
// and bf16 where the CPU has no vdpbf16ps (bf16 then computes in fp32 on either path, converted as K and V are copied).
template <typename T>
bool v3_takes_lanes(const Problem& p) {
#if defined(BTLIB_VEC_AVX512) || defined(BTLIB_VEC_AVX2)
  if constexpr (std::is_same_v<T, float> || !kBf16Dot) return lanes_take(p);
#endif
  return false;
}

// v3's one entry: the lanes blocks where v3_takes_lanes, everything else the row tiles above on the ISA's path.
template <typename T, typename ParallelFor>
int64_t attention_v3(const Problem& p, const T* q, const T* k, const T* v, T* o, int threads, ParallelFor&& parallel_for) {
#if defined(BTLIB_VEC_AVX512) || defined(BTLIB_VEC_AVX2)
  if (v3_takes_lanes<T>(p)) return attention_lanes(p, q, k, v, o, threads, parallel_for);
#endif
  return attention_v3_on<typename PathFor<T>::type>(p, q, k, v, o, threads, parallel_for);
}

// The query rows per block attention_v3 uses for this problem (core_check.cpp counts the band with them).
template <typename T>
int64_t v3_block_rows(const Problem& p) {
#if defined(BTLIB_VEC_AVX512) || defined(BTLIB_VEC_AVX2)
  if (v3_takes_lanes<T>(p)) return kLanesRows;
#endif
  return p.block_rows();
}

}  // namespace btlib_core
