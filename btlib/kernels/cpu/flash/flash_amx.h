// flash_amx.h: v3's products on Intel AMX tiles (bf16 in, fp32 sums): Sapphire Rapids and later Xeons.
//
// FlashAttention-2's loop (Dao 2023) as flash.h runs it: per (query block, key tile) S = Q K^T on tiles,
// the online softmax of flash.h (AVX-512, fp32, row by row: causal, windows, position bias and NaN rules
// are the shared code's), P rounded to bf16, then O = diag(alpha) O + P V on tiles. Only the products move:
//
//   tdpbf16ps  C[16][16] fp32 += A[16][32] bf16 . B[32][16] bf16, B stored as 16 rows of 16 (k, k+1) pairs
//              ("VNNI" layout, what flash_bf16dot.h already packs): 16 K-pairs x 16 columns per 64-byte row.
//
// One tile configuration for both products: all 8 tiles 16 rows x 64 bytes. The products run in 2 x 2
// blocks of C tiles (tmm0-3) fed by two A tiles (tmm4-5) and two B tiles (tmm6-7): 4 tdpbf16ps per 4
// tile loads. At Br = Bc = 64, D = 32 a (block, tile) pair is 32 tdpbf16ps (QK^T 16, PV 16), ~16 cycles
// each, against ~4096 exp2 of the softmax on 16-lane vectors: the softmax, not the tiles, bounds it.
//
// Layouts (per thread, as flash_bf16dot.h's but the contraction padded to whole tiles):
//   Q   [Br][Dk] bf16, Dk = D rounded up to 32 (zeros beyond D): A tiles of QK^T
//   K^T [Dk / 2][Bc][2] per key tile: B tiles of QK^T
//   P   [Br][Bc] bf16: A tiles of PV (zeros beyond the tile's keys, up to a multiple of 32)
//   V   [Bc / 2][Dp][2] per key tile, Dp = D rounded up to 16: B tiles of PV
// Rows of Q and P past the block's nq real rows feed only rows of S and O that are never read.
//
// The OS must grant a process the 8 KiB of tile state first (Linux 5.16+: arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA)); without it the first tile instruction kills the process. amx_status() asks once
// and says why not; the binding refuses to run without it, and btlib's registry does not pick the kernel.
#pragma once

#include <string>

#include "flash.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define BTLIB_AMX 1

namespace btlib_core {

constexpr bool kAmx = true;
static_assert(W == 16 && Bc % 32 == 0 && Br % 16 == 0, "AMX tiles: 16-float rows of O and S, whole 32-key K steps");

// "" when this CPU has AMX-BF16 and the OS granted this process the tile state; else why not. Asked once.
inline const std::string& amx_status() {
  static const std::string why = [] () -> std::string {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22)))
      return "this CPU has no AMX-TILE / AMX-BF16 (cpuid leaf 7)";
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // <asm/prctl.h>, arch/x86/include/asm/fpu/types.h
    if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) != 0)
      return "the OS refused the AMX tile state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed: "
             "Linux 5.16 or later is needed)";
    return "";
  }();
  return why;
}

// ldtilecfg's 64-byte operand: palette 1, tiles 0-7 all 16 rows x 64 bytes
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Per-thread state: flash.h's Workspace, and the tiles released when the thread's tasks are done (a thread
// holding tile state makes every context switch save 8 KiB more).
struct AmxWorkspace : Workspace {
  AmxWorkspace() {
    static const TileConfig cfg;
    _tile_loadconfig(&cfg);
  }
  ~AmxWorkspace() { _tile_release(); }
  AmxWorkspace(const AmxWorkspace&) = delete;
  AmxWorkspace& operator=(const AmxWorkspace&) = delete;
};

// C (NR x NC tiles of 16 x 16 fp32, row stride cs bytes) = [C +] sum over ksteps of A (NR x 1 tiles of 16 rows
// x 32 bf16, row stride as bytes, next K step 64 bytes on) . B (1 x NC tiles of 16 pair rows x 16 columns,
// row stride bs bytes, next K step bk bytes on, next column tile 64 bytes on). Tile numbers are immediates.
template <int NR, int NC>
inline void tile_product(const char* a, int64_t as, const char* b, int64_t bs, int64_t bk, int64_t ksteps, char* c,
                         int64_t cs, bool accumulate) {
  static_assert(NR >= 1 && NR <= 2 && NC >= 1 && NC <= 2, "2 x 2 C tiles at most: tmm0-3");
  if (accumulate) {
    _tile_loadd(0, c, cs);
    if constexpr (NC > 1) _tile_loadd(1, c + 64, cs);
    if constexpr (NR > 1) _tile_loadd(2, c + 16 * cs, cs);
    if constexpr (NR > 1 && NC > 1) _tile_loadd(3, c + 16 * cs + 64, cs);
  } else {
    _tile_zero(0);
    if constexpr (NC > 1) _tile_zero(1);
    if constexpr (NR > 1) _tile_zero(2);
    if constexpr (NR > 1 && NC > 1) _tile_zero(3);
  }
  for (int64_t k = 0; k < ksteps; ++k) {
    _tile_loadd(4, a + 64 * k, as);
    if constexpr (NR > 1) _tile_loadd(5, a + 16 * as + 64 * k, as);
    _tile_loadd(6, b + bk * k, bs);
    if constexpr (NC > 1) _tile_loadd(7, b + bk * k + 64, bs);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NC > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (NR > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (NR > 1 && NC > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, cs);
  if constexpr (NC > 1) _tile_stored(1, c + 64, cs);
  if constexpr (NR > 1) _tile_stored(2, c + 16 * cs, cs);
  if constexpr (NR > 1 && NC > 1) _tile_stored(3, c + 16 * cs + 64, cs);
}

// C = [C +] A . B over nr x nc tiles of 16 x 16, in 2 x 2 blocks (1-wide at an odd edge).
inline void tile_products(const char* a, int64_t as, const char* b, int64_t bs, int64_t bk, int64_t ksteps, char* c,
                          int64_t cs, int64_t nr, int64_t nc, bool accumulate) {
  for (int64_t r = 0; r < nr; r += 2)
    for (int64_t n = 0; n < nc; n += 2) {
      const char* ar = a + r * 16 * as;
      const char* bn = b + n * 64;
      char* cr = c + r * 16 * cs + n * 64;
      const bool two_r = r + 1 < nr, two_n = n + 1 < nc;
      if (two_r && two_n) tile_product<2, 2>(ar, as, bn, bs, bk, ksteps, cr, cs, accumulate);
      else if (two_r) tile_product<2, 1>(ar, as, bn, bs, bk, ksteps, cr, cs, accumulate);
      else if (two_n) tile_product<1, 2>(ar, as, bn, bs, bk, ksteps, cr, cs, accumulate);
      else tile_product<1, 1>(ar, as, bn, bs, bk, ksteps, cr, cs, accumulate);
    }
}

inline int64_t amx_dk(int64_t D) { return round_up(D, 32); }  // Q and K^T padded to whole 32-element K steps

// Elements [0, n) of 16 (n < 16: the rest 0) as bf16 bits: a masked load, and for fp32 inputs one rounding
// (vcvtneps2bf16: nearest even, as at::BFloat16; a NaN stays a NaN).
inline __m256i bf16x16(const bf16* x, int64_t n) { return _mm256_maskz_loadu_epi16(first_lanes(int(n)), x); }
inline __m256i bf16x16(const float* x, int64_t n) {
  return (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(first_lanes(int(n)), x));
}

// T: the element type of q, k, v and o (bf16, or fp32 rounded to bf16 while packing); sums are fp32 either way.
template <typename T>
struct AmxPath {
  using Local = AmxWorkspace;
  static constexpr bool kColumns = false;  // whole 16 x 16 tiles of one key tile: flash.h passes c0 = 0, ldS = Bc, Br rows

  static void reserve_kv(const Problem& p, int64_t b, int64_t Dp, Workspace& ws) {
    const int64_t Tp = round_up(p.len_k(b), Bc);
    ws.kt2.resize(Tp * amx_dk(p.D));
    ws.vp2.resize(Tp * Dp);
  }
  // key tile [j0, j0 + Bc): K^T as [Dk / 2][Bc][2] (a key's (d, d + 1) pair is one 32-bit move), V as
  // [Bc / 2][Dp][2] (two keys' rows interleaved, 16 columns a vector), zero beyond Lk and D
  static void pack_kv_tile(const Problem& p, const T* k, const T* v, int64_t b, int64_t h, int64_t Dp, int64_t j0,
                           Workspace& ws) {
    const int64_t D = p.D, Dk = amx_dk(D), nk = std::min(Bc, p.len_k(b) - j0);
    uint32_t* kt = reinterpret_cast<uint32_t*>(ws.kt2.data() + j0 * Dk);
    uint16_t* vp = ws.vp2.data() + j0 * Dp;  // Bc is even: a tile starts a pair
    if (nk < Bc) {
      std::fill_n(kt, Dk / 2 * Bc, 0u);
      std::fill_n(vp, Bc * Dp, uint16_t(0));
    }
    alignas(64) uint16_t row[kMaxD + 32];  // one key as bf16, zeros from D to Dk
    for (int64_t j = 0; j < nk; ++j) {
      const T* kj = p.at(k, p.ks, b, h, j0 + j);
      for (int64_t d = 0; d < Dk; d += 16) _mm256_store_si256(reinterpret_cast<__m256i*>(row + d), bf16x16(kj + d, D - d));
      const uint32_t* pairs = reinterpret_cast<const uint32_t*>(row);
      for (int64_t d2 = 0; d2 < Dk / 2; ++d2) kt[d2 * Bc + j] = pairs[d2];
    }
    for (int64_t j = 0; j < nk; j += 2) {  // keys j, j + 1 -> pair row j / 2; a lone last key pairs with 0
      const T* va = p.at(v, p.vs, b, h, j0 + j);
      const T* vb = j + 1 < nk ? p.at(v, p.vs, b, h, j0 + j + 1) : nullptr;
      for (int64_t d = 0; d < Dp; d += 16) {
        const __m512i a = _mm512_cvtepu16_epi32(bf16x16(va + d, D - d));
        const __m512i c = vb ? _mm512_cvtepu16_epi32(bf16x16(vb + d, D - d)) : _mm512_setzero_si512();
        _mm512_storeu_si512(vp + (j / 2 * Dp + d) * 2, _mm512_or_si512(a, _mm512_slli_epi32(c, 16)));
      }
    }
  }
  // Q block [Br][Dk] as bf16 (zeros beyond D); the tiles are configured once per thread (AmxWorkspace)
  static void pack_q(const Problem& p, const T* q, int64_t b, int64_t h, int64_t q0, int64_t nq, Workspace& ws) {
    const int64_t D = p.D, Dk = amx_dk(D);
    if (ws.q2.size() != size_t(Br * Dk)) ws.q2.assign(Br * Dk, 0);  // zero once: columns past round_up(D, 16) stay 0
    ws.p2.resize(Br * Bc);
    ws.qk_scale = p.scale * kLog2e;
    for (int64_t i = 0; i < nq; ++i) {
      const T* qi = p.at(q, p.qs, b, h, q0 + i);
      for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ws.q2.data() + i * Dk + d), bf16x16(qi + d, D - d));
    }
  }
  // S rows [0, nq), keys [0, nk) of block j0 (whole 16 x 16 tiles), then times scale * log2(e) in fp32
  static void qk_block(Workspace& ws, int64_t D, int64_t nq, int64_t j0, int64_t /*c0 = 0*/, int64_t nk, float* /*S = ws.S*/,
                       int64_t /*ldS = Bc*/) {
    const int64_t Dk = amx_dk(D), nr = (nq + 15) / 16, nc = (nk + 15) / 16;
    tile_products(reinterpret_cast<const char*>(ws.q2.data()), Dk * 2, reinterpret_cast<const char*>(ws.kt2.data() + j0 * Dk),
                  Bc * 4, 16 * Bc * 4, Dk / 32, reinterpret_cast<char*>(ws.S.data()), Bc * 4, nr, nc, false);
    const vf c = vset1(ws.qk_scale);
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t n = 0; n < nc * 16; n += W) vstore(ws.S.data() + i * Bc + n, vmul(vload(ws.S.data() + i * Bc + n), c));
  }
  // P row i rounded to bf16 (nearest even; NaN stays NaN), zeros after its keys up to the next 32 (a whole K step)
  static void store_p(Workspace& ws, int64_t i, int64_t /*c0 = 0*/, int64_t nk, int64_t /*ldS = Bc*/) {
    uint16_t* pi = ws.p2.data() + i * Bc;
    int64_t n = 0;
    for (; n < nk; n += W)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pi + n), (__m256i)_mm512_cvtneps_pbh(vload(ws.S.data() + i * Bc + n)));
    for (; n < round_up(nk, 32); n += W) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pi + n), _mm256_setzero_si256());
  }
  // O rows [0, nq) = diag(alpha) O (AVX-512), then += P V on tiles over the tile's keys in steps of 32
  static void pv_block(Workspace& ws, int64_t Dp, int64_t nq, int64_t j0, int64_t /*c0 = 0*/, int64_t nk, int64_t /*ldS = Bc*/) {
    for (int64_t i = 0; i < nq; ++i) {
      const vf a = vset1(ws.alpha[i]);
      for (int64_t d = 0; d < Dp; d += W) vstore(ws.O.data() + i * Dp + d, vmul(vload(ws.O.data() + i * Dp + d), a));
    }
    tile_products(reinterpret_cast<const char*>(ws.p2.data()), Bc * 2, reinterpret_cast<const char*>(ws.vp2.data() + j0 * Dp),
                  Dp * 4, 16 * Dp * 4, (nk + 31) / 32, reinterpret_cast<char*>(ws.O.data()), Dp * 4, (nq + 15) / 16, Dp / 16,
                  true);
  }
};

// v3 (flash.h's blocks, tasks and masks) with AmxPath's products. Call only when amx_status() is "".
template <typename T, typename ParallelFor>
int64_t attention_amx(const Problem& p, const T* q, const T* k, const T* v, T* o, int threads, ParallelFor&& parallel_for) {
  return attention_v3_on<AmxPath<T>>(p, q, k, v, o, threads, parallel_for);
}

}  // namespace btlib_core
#else
namespace btlib_core {
constexpr bool kAmx = false;
inline const std::string& amx_status() {
  static const std::string why = "this build of btlib's kernels has no AMX code (the avx512bf16 build on Linux, "
                                 "compiled with -mamx-tile -mamx-bf16, has it)";
  return why;
}
}  // namespace btlib_core
#endif
