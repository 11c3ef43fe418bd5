// core.h: what every version shares, with no torch in it (core_check.cpp builds it alone).
//   - Br, Bc, kMaxD; bf16, an element type with at::BFloat16's bits and rounding;
//   - Problem: one attention call (padded or varlen, optionally a local window and a position bias),
//     strides in elements;
//   - for_tasks: the thread-pool hook. The kernels take a parallel_for(n, f) callable that runs
//     f(begin, end) over [0, n) on the caller's pool (attention.cpp passes at::parallel_for);
//     tasks are handed out by an atomic counter, in chunks, so uneven work still balances.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace btlib_core {

using namespace btlib_vec;

constexpr int64_t Br = 64;      // query rows per block (v2, v3)
constexpr int64_t Bc = 64;      // keys per block; a multiple of kNV * W in every build
constexpr int64_t kMaxD = 256;  // head_dim limit (buffers are sized by it)
constexpr float kLog2e = 1.4426950408889634f;
enum BiasKind : int { kBiasNone = 0, kBiasAlibi = 1, kBiasTable = 2 };  // btlib.position_bias.BIAS_KINDS
static_assert(Bc % (kNV * W) == 0, "a key block must be whole micro-tiles");

// bfloat16: the top 16 bits of a float. float -> bf16 rounds to nearest, ties to even, and NaN
// becomes the quiet NaN 0x7FC0: bit for bit what c10::BFloat16 does, so the torch binding can
// reinterpret at::BFloat16* as bf16*.
struct bf16 {
  uint16_t x;
};
inline float to_float(float a) { return a; }
inline float to_float(bf16 a) {
  const uint32_t u = uint32_t(a.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
template <typename T> T from_float(float f);
template <> inline float from_float<float>(float f) { return f; }
template <> inline bf16 from_float<bf16>(float f) {
  if (std::isnan(f)) return bf16{0x7FC0};
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return bf16{uint16_t((u + ((u >> 16) & 1) + 0x7FFF) >> 16)};
}

// One attention problem. Padded: (B, H, T, D) tensors, lengths optional. Varlen: (total, H, D)
// tensors, batch stride 0 and sequence b starting at row cu_seqlens[b]. Strides in elements.
struct Problem {
  int64_t B, H, D, Tq, Tk;
  int64_t qs[3], ks[3], vs[3], os[3];  // strides of (batch, head, row); head_dim is contiguous
  const int64_t* lengths = nullptr;
  const int32_t* cu_seqlens = nullptr;
  bool causal = false;
  float scale = 1.0f;
  // Local window: row i may attend keys j with i - win_left <= j <= i + win_right (ModernBERT: 64, 64),
  // intersected with its real keys and the causal prefix (key_lo / key_hi below); a negative reach is
  // no limit on that side. binding.h's set_window stores a reach >= T - 1 as -1, so i + win_right + 1
  // cannot overflow. Only v3 (flash.h) reads the window, through key_lo / key_hi; v1 / v2 (teaching.h)
  // stop at keys_of_row, and their bindings always pass -1, -1.
  int64_t win_left = -1, win_right = -1;
  // Position bias (btlib/position_bias.py), added to the scaled score of row i, key j (both counted from
  // the sequence's start): kBiasAlibi: -bias[h] * |j - i| (bias: H slopes); kBiasTable: bias[h * (2R + 1) +
  // clamp(j - i, -R, R) + R] (bias: an (H, 2R + 1) table, R = bias_R). Only v3 (flash.h) reads it.
  int bias_kind = 0;  // kBiasNone
  const float* bias = nullptr;
  int64_t bias_R = 0;

  int64_t row0(int64_t b) const { return cu_seqlens ? cu_seqlens[b] : 0; }
  int64_t len_q(int64_t b) const { return cu_seqlens ? cu_seqlens[b + 1] - cu_seqlens[b] : lengths ? lengths[b] : Tq; }
  int64_t len_k(int64_t b) const { return cu_seqlens ? cu_seqlens[b + 1] - cu_seqlens[b] : lengths ? lengths[b] : Tk; }
  // keys query row i may attend without a window: the causal mask is a prefix of the real keys
  int64_t keys_of_row(int64_t b, int64_t i) const { return causal ? std::min(len_k(b), i + 1) : len_k(b); }
  // [key_lo(i), key_hi(b, i)): the keys row i may attend under padding, causal and the window
  // (none when key_hi <= key_lo). Both are non-decreasing in i, so rows [i0, i1] of a block
  // attend only keys in [key_lo(i0), key_hi(b, i1)): the tiles v3 visits.
  int64_t key_lo(int64_t i) const { return win_left < 0 ? 0 : std::max<int64_t>(0, i - win_left); }
  int64_t key_hi(int64_t b, int64_t i) const {
    const int64_t hi = keys_of_row(b, i);
    return win_right < 0 ? hi : std::min(hi, i + win_right + 1);
  }
  // Query rows per v3 block: Br, or 16 under a narrow window (causal counts as a right reach of 0).
  // A block of r rows reaches r + left + right keys, of which each row may attend left + right + 1:
  // at (64, 64), 64 rows compute 192 keys per row (3 whole tiles), 16 rows 144 (flash.h skips the
  // vectors of a tile before the band and takes the band in one span).
  int64_t block_rows() const {
    const int64_t right = causal ? 0 : win_right;
    return win_left >= 0 && right >= 0 && win_left + right < 4 * Bc ? 16 : Br;
  }
  // rows of the output that belong to sequence b: padded rows t >= len_q are written as 0
  int64_t rows_out(int64_t b) const { return cu_seqlens ? len_q(b) : Tq; }
  template <typename T> T* at(T* x, const int64_t* s, int64_t b, int64_t h, int64_t t) const {
    return x + b * s[0] + h * s[1] + (row0(b) + t) * s[2];
  }
};

template <typename T>
void zero_rows(const Problem& p, T* o, int64_t b, int64_t h, int64_t from, int64_t to) {
  for (int64_t t = from; t < to; ++t) std::fill_n(p.at(o, p.os, b, h, t), p.D, from_float<T>(0.0f));
}

// n tasks on `threads` workers through parallel_for: each worker makes its own Local (buffers)
// and takes chunks of `chunk` consecutive tasks from a shared counter until none is left. A pool
// that runs fewer workers than asked, or runs them one after another, still runs every task once.
template <typename Local, typename ParallelFor, typename Body>
void for_tasks(ParallelFor&& parallel_for, int threads, int64_t n, int64_t chunk, Body&& body) {
  std::atomic<int64_t> next{0};
  parallel_for(int64_t(std::max(threads, 1)), [&](int64_t, int64_t) {
    Local local;
    for (int64_t c; (c = next.fetch_add(chunk)) < n;)
      for (int64_t t = c; t < std::min(n, c + chunk); ++t) body(t, local);
  });
}

// Every (b, h, query block of `rows` rows) with real query rows, run as for_tasks tasks, then the padded
// output rows set to 0; block(b, h, q0, local) computes one block and returns the key tiles it visited.
// Returns their sum (core_check.cpp compares it with the band's count). v3's row tiles and lanes
// blocks (flash/) both run through here.
template <typename Local, typename T, typename ParallelFor, typename Block>
int64_t for_query_blocks(const Problem& p, int64_t rows, T* o, int threads, ParallelFor&& parallel_for, Block&& block) {
  struct Task { int64_t b, h, q0; };
  std::vector<Task> tasks;  // only blocks with real query rows
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.H; ++h)
      for (int64_t q0 = 0; q0 < p.len_q(b); q0 += rows) tasks.push_back({b, h, q0});
  // Longest sequences first (a block costs about len_k): the last chunks handed out are then the
  // cheapest, so workers finish together. Stable, so one (b, h)'s blocks stay adjacent.
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& x, const Task& y) { return p.len_k(x.b) > p.len_k(y.b); });
  // Chunks of consecutive tasks, about 8 per thread: a thread then runs runs of query blocks of
  // one (b, h) and packs its keys once, while the chunks still balance uneven (causal, varlen) work.
  const int64_t n = int64_t(tasks.size()), chunk = std::max<int64_t>(1, n / (8 * std::max(threads, 1)));
  std::atomic<int64_t> tiles{0};
  for_tasks<Local>(parallel_for, threads, n, chunk, [&](int64_t t, Local& local) {
    tiles.fetch_add(block(tasks[t].b, tasks[t].h, tasks[t].q0, local), std::memory_order_relaxed);
  });
  if (p.cu_seqlens || !p.lengths) return tiles.load();  // no padded rows
  struct None {};
  const int64_t BH = p.B * p.H;
  for_tasks<None>(parallel_for, threads, BH, std::max<int64_t>(1, BH / std::max(threads, 1)), [&](int64_t t, None&) {
    zero_rows(p, o, t / p.H, t % p.H, p.len_q(t / p.H), p.rows_out(t / p.H));
  });
  return tiles.load();
}

// parallel_for for callers without a pool: runs everything on the calling thread.
struct SerialFor {
  template <typename F> void operator()(int64_t n, F&& f) const { f(0, n); }
};

}  // namespace btlib_core
