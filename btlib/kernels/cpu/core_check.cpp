// core_check.cpp: the torch-free kernel core (teaching/teaching.h, flash/flash.h) against a double-precision
// reference, in one program: every version, fp32 and bf16, padded and varlen, on sizes that are
// not tile multiples, fully padded rows, causal on and off, local windows (v3 and varlen), and
// NaN/inf in q, k, v at real and padded positions, and position biases (ALiBi, a table) with and
// without windows (v3 and varlen). v3 also reports how many (query block, key
// tile) pairs it computed: that must be exactly the number of pairs where some row of the block
// may attend some key of the tile (the tile skip of padding, causal and windows, counted here by
// brute force). Built with -mamx-tile -mamx-bf16 on a CPU whose OS grants AMX tiles, every bf16 run is repeated
// with the products on AMX tiles (flash_amx.h); elsewhere it says why those runs are skipped. Exits non-zero on any mismatch. tests/test_cpu_core.py builds it for every
// ISA this CPU runs (-DISA flags as in build.py) and for aarch64 (NEON) under qemu-aarch64:
//   g++ -O2 -std=c++17 -pthread [-march=...] core_check.cpp -o core_check && ./core_check
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "flash/flash.h"
#include "flash/flash_amx.h"
#include "teaching/teaching.h"

using namespace btlib_core;

namespace {

// parallel_for on plain std::threads: checks the kernels under real concurrency, as at::parallel_for runs them
struct ThreadsFor {
  template <typename F> void operator()(int64_t n, F&& f) const {
    std::vector<std::thread> pool;
    for (int64_t i = 0; i < n; ++i) pool.emplace_back([&f, i] { f(i, i + 1); });
    for (auto& t : pool) t.join();
  }
};
constexpr int kThreads = 3;
const float kNaN = std::nanf(""), kInf = INFINITY;

struct Case {
  int64_t B, H, T, D;
  bool causal;
  std::vector<int64_t> lengths;  // (B,)
  bool specials;                 // NaN / inf injected
  int64_t win_left = -1, win_right = -1;  // local window, -1 = unbounded
  int bias_kind = kBiasNone;              // position bias: ALiBi slopes or a table with R = 5
};

// The position bias of head h, query i, key j from its definition (btlib/position_bias.py), in double.
double bias_of(const Problem& p, int64_t h, int64_t i, int64_t j) {
  if (p.bias_kind == kBiasAlibi) return -double(p.bias[h]) * double(std::abs(j - i));
  if (p.bias_kind == kBiasTable) return p.bias[h * (2 * p.bias_R + 1) + std::min(std::max(j - i, -p.bias_R), p.bias_R) + p.bias_R];
  return 0.0;
}

// May query row i of sequence b attend key j? From the definitions, not from Problem's helpers.
bool allowed(const Problem& p, int64_t b, int64_t i, int64_t j) {
  return j < p.len_k(b) && (!p.causal || j <= i) && (p.win_left < 0 || j >= i - p.win_left) &&
         (p.win_right < 0 || j <= i + p.win_right);
}

// O = softmax(Q K^T * scale) V in double over the allowed keys, IEEE NaN semantics as torch's
// reference: a NaN or +inf score gives a NaN row; a row of -inf scores gives 0 (times V: NaN
// where V is), as SDPA. Rows t >= len_q and rows without keys are 0. Same Problem, same strides.
// Rows are independent: one thread per core takes every n-th row, each row computed as in a serial loop (the same
// doubles). This scalar loop was 60% of the run natively and under qemu-aarch64 (tests/test_cpu_core.py).
std::vector<double> reference(const Problem& p, const std::vector<float>& q, const std::vector<float>& k,
                              const std::vector<float>& v, size_t out_size) {
  std::vector<double> o(out_size, 0.0);
  struct Row { int64_t b, h, i; };
  std::vector<Row> rows;  // every real query row
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.H; ++h)
      for (int64_t i = 0; i < p.len_q(b); ++i) rows.push_back({b, h, i});
  const int64_t n_threads = std::max(1u, std::thread::hardware_concurrency());
  ThreadsFor{}(n_threads, [&](int64_t first, int64_t) {
    for (size_t r = first; r < rows.size(); r += n_threads) {
      const auto [b, h, i] = rows[r];
      std::vector<int64_t> keys;
      for (int64_t j = 0; j < p.len_k(b); ++j)
        if (allowed(p, b, i, j)) keys.push_back(j);
      std::vector<double> s(keys.size());
      double m = -INFINITY, l = 0.0;
      for (size_t n = 0; n < keys.size(); ++n) {
        double dot = 0.0;
        for (int64_t d = 0; d < p.D; ++d) dot += double(p.at(q.data(), p.qs, b, h, i)[d]) * p.at(k.data(), p.ks, b, h, keys[n])[d];
        s[n] = dot * p.scale + bias_of(p, h, i, keys[n]);
        m = std::max(m, s[n]);
      }
      if (m == -INFINITY) m = 0.0;  // only -inf scores: P = 0, not exp(-inf + inf) = NaN
      for (auto& e : s) l += (e = std::exp(e - m));
      double* oi = o.data() + (p.at(q.data(), p.os, b, h, i) - q.data());
      for (size_t n = 0; n < keys.size(); ++n)
        for (int64_t d = 0; d < p.D; ++d) oi[d] += (l == 0.0 ? 0.0 : s[n] / l) * p.at(v.data(), p.vs, b, h, keys[n])[d];
    }
  });
  return o;
}

// The (query block, key tile) pairs v3 must compute: blocks of `rows` real rows (v3_block_rows: the lanes blocks'
// rows for fp32 on x86, else p.block_rows(); Br on AMX), tiles of Bc keys (both from 0 in each sequence), counted
// where some row of the block may attend some key of the tile.
int64_t band_tiles(const Problem& p, int64_t rows) {
  int64_t n = 0;
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t q0 = 0; q0 < p.len_q(b); q0 += rows)
      for (int64_t j0 = 0; j0 < p.len_k(b); j0 += Bc) {
        bool any = false;
        for (int64_t i = q0; i < std::min(q0 + rows, p.len_q(b)) && !any; ++i)
          for (int64_t j = j0; j < std::min(j0 + Bc, p.len_k(b)) && !any; ++j) any = allowed(p, b, i, j);
        n += any;
      }
  return n * p.H;
}

int failures = 0, checks = 0;
// AMX (flash_amx.h): compiled in (-mamx-tile -mamx-bf16) and granted by the OS; else its runs are skipped, and said so
const bool amx_ready = kAmx && amx_status().empty();
int64_t tiles_done = 0;  // (block, tile) pairs v3 computed over every check, printed at the end

// out vs ref: NaN exactly where ref is NaN, padded rows exactly 0, the rest within tol * max|ref|
void compare(const char* what, const Case& c, const Problem& p, const std::vector<float>& out, const std::vector<double>& ref,
             double tol) {
  double scale = 0.0, err = 0.0;
  int64_t nan_mismatch = 0, pad_nonzero = 0;
  for (size_t i = 0; i < ref.size(); ++i)
    if (std::isfinite(ref[i])) scale = std::max(scale, std::abs(ref[i]));
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.H; ++h)
      for (int64_t t = 0; t < p.rows_out(b); ++t)
        for (int64_t d = 0; d < p.D; ++d) {
          const size_t i = p.at(out.data(), p.os, b, h, t) - out.data() + d;
          if (t >= p.len_q(b)) pad_nonzero += out[i] != 0.0f;  // also catches NaN
          else if (std::isnan(ref[i]) != std::isnan(out[i])) ++nan_mismatch;
          else if (!std::isnan(ref[i])) err = std::max(err, std::abs(out[i] - ref[i]));
        }
  const double rel = err / std::max(scale, 1e-30);
  const bool ok = nan_mismatch == 0 && pad_nonzero == 0 && rel <= tol;
  ++checks;
  if (!ok) {
    ++failures;
    std::printf("FAIL %-14s B=%lld H=%lld T=%lld D=%lld causal=%d window=(%lld, %lld) specials=%d: rel err %.2e (tol %.0e), "
                "%lld NaN mismatches, %lld nonzero padded outputs\n", what, (long long)c.B, (long long)c.H, (long long)c.T,
                (long long)c.D, c.causal, (long long)c.win_left, (long long)c.win_right, c.specials, rel, tol,
                (long long)nan_mismatch, (long long)pad_nonzero);
  }
}

template <typename T>
std::vector<T> convert(const std::vector<float>& x) {
  std::vector<T> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = from_float<T>(x[i]);
  return r;
}
template <typename T>
std::vector<float> widen(const std::vector<T>& x) {
  std::vector<float> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = to_float(x[i]);
  return r;
}

// One (layout, dtype) run of v3: the kernel on T-typed inputs vs the reference on the same (rounded) values.
// amx: bf16 on AMX tiles (flash_amx.h) instead of PathFor<bf16>'s products.
template <typename T>
void check_v3(const char* what, const Case& c, const Problem& p, const std::vector<float>& q, const std::vector<float>& k,
              const std::vector<float>& v, double tol, bool amx = false) {
  const auto qt = convert<T>(q), kt = convert<T>(k), vt = convert<T>(v);
  std::vector<T> o(q.size(), from_float<T>(kNaN));  // NaN-filled: a row the kernel forgets to write shows up
  int64_t tiles = 0;
#if defined(BTLIB_AMX)
  if constexpr (std::is_same_v<T, bf16>)
    if (amx) tiles = attention_amx(p, qt.data(), kt.data(), vt.data(), o.data(), kThreads, ThreadsFor{});
#endif
  if (!amx) tiles = attention_v3(p, qt.data(), kt.data(), vt.data(), o.data(), kThreads, ThreadsFor{});
  compare(what, c, p, widen(o), reference(p, widen(qt), widen(kt), widen(vt), q.size()), tol);
  const int64_t want = band_tiles(p, amx ? Br : v3_block_rows<T>(p));
  ++checks;
  if (tiles != want) {
    ++failures;
    std::printf("FAIL %-14s B=%lld T=%lld causal=%d window=(%lld, %lld): computed %lld (block, tile) pairs, the band has %lld\n",
                what, (long long)c.B, (long long)c.T, c.causal, (long long)c.win_left, (long long)c.win_right,
                (long long)tiles, (long long)want);
  }
  tiles_done += tiles;
}

void run_case(const Case& c, std::mt19937& rng) {
  const int64_t B = c.B, H = c.H, T = c.T, D = c.D, n = B * H * T * D;
  std::normal_distribution<float> normal;
  std::vector<float> q(n), k(n), v(n);
  for (auto* x : {&q, &k, &v})
    for (auto& e : *x) e = normal(rng);
  auto at = [&](std::vector<float>& x, int64_t b, int64_t h, int64_t t) { return x.data() + ((b * H + h) * T + t) * D; };
  if (c.specials) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t L = c.lengths[b];
      if (L < T) {  // padding: NaN in every padded q row, k and v position; must not reach real rows
        at(q, b, 0, L)[0] = kNaN, at(k, b, 0, L)[D - 1] = kNaN, at(v, b, H - 1, L)[1 % D] = kNaN;
        at(k, b, H - 1, T - 1)[0] = kInf;
      }
      if (L > 0) at(q, b, 0, L - 1)[0] = kNaN;  // a NaN query: its row is NaN
      // A NaN value at key 0: every row that attends it. Not with a window: rows that do not attend
      // key 0 but share its tile multiply it by P = 0 (NaN, as in the Python reference's P V), while
      // this reference sums allowed keys only. NaN or inf scores outside a window are masked exactly.
      if (L > 1 && c.win_left < 0) at(v, b, H - 1, 0)[0] = kNaN;
      if (L > 2) at(k, b, 0, 1)[D / 2] = kInf;  // an inf key: rows whose score is +inf are NaN
      if (L > 2) at(q, b, 0, 1)[D / 2] = -1.0f;  // ... and -inf for row 1: alone in window (0, 0), it outputs 0
    }
  }
  Problem p;  // padded (B, H, T, D)
  p.B = B, p.H = H, p.D = D, p.Tq = p.Tk = T, p.causal = c.causal, p.scale = 1.0f / std::sqrt(float(D));
  p.lengths = c.lengths.data();
  const int64_t s[3] = {H * T * D, T * D, D};
  for (int i = 0; i < 3; ++i) p.qs[i] = p.ks[i] = p.vs[i] = p.os[i] = s[i];
  if (c.win_left < 0 && c.win_right < 0 && c.bias_kind == kBiasNone) {  // the teaching versions take no window, no bias
    const auto ref = reference(p, q, k, v, n);
    std::vector<float> o(n, kNaN);
    attention_v1(p, q.data(), k.data(), v.data(), o.data(), kThreads, ThreadsFor{});
    compare("v1", c, p, o, ref, 1e-5);
    std::fill(o.begin(), o.end(), kNaN);
    attention_v2(p, q.data(), k.data(), v.data(), o.data(), kThreads, ThreadsFor{});
    compare("v2", c, p, o, ref, 1e-5);
  }
  p.win_left = c.win_left, p.win_right = c.win_right;
  std::vector<float> bias;  // ALiBi: H slopes in [0.05, 1]; table: (H, 11), R = 5, N(0, 1)
  if (c.bias_kind != kBiasNone) {
    std::uniform_real_distribution<float> slope(0.05f, 1.0f);
    p.bias_R = c.bias_kind == kBiasTable ? 5 : 0;
    bias.resize(c.bias_kind == kBiasAlibi ? H : H * 11);
    for (auto& e : bias) e = c.bias_kind == kBiasAlibi ? slope(rng) : normal(rng);
    p.bias_kind = c.bias_kind, p.bias = bias.data();
  }
  check_v3<float>("v3 fp32", c, p, q, k, v, 1e-5);
  check_v3<bf16>("v3 bf16", c, p, q, k, v, 1.5e-2);  // P and O rounded to bf16: 2^-8 relative, twice
  if (amx_ready) check_v3<bf16>("v3 amx", c, p, q, k, v, 1.5e-2, true);

  std::vector<int32_t> cu(B + 1, 0);  // varlen: the real rows packed as (total, H, D)
  for (int64_t b = 0; b < B; ++b) cu[b + 1] = cu[b] + int32_t(c.lengths[b]);
  std::vector<float> qp(cu[B] * H * D), kp(qp.size()), vp(qp.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < c.lengths[b]; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          const int64_t i = ((cu[b] + t) * H + h) * D + d;
          qp[i] = at(q, b, h, t)[d], kp[i] = at(k, b, h, t)[d], vp[i] = at(v, b, h, t)[d];
        }
  Problem pv = p;
  pv.lengths = nullptr, pv.cu_seqlens = cu.data();
  const int64_t sv[3] = {0, D, H * D};
  for (int i = 0; i < 3; ++i) pv.qs[i] = pv.ks[i] = pv.vs[i] = pv.os[i] = sv[i];
  if (qp.empty()) return;
  check_v3<float>("varlen fp32", c, pv, qp, kp, vp, 1e-5);
  check_v3<bf16>("varlen bf16", c, pv, qp, kp, vp, 1.5e-2);
  if (amx_ready) check_v3<bf16>("varlen amx", c, pv, qp, kp, vp, 1.5e-2, true);
}

}  // namespace

int main() {
  std::mt19937 rng(0);
  // bf16 rounding is at::BFloat16's: nearest, ties to even, NaN -> 0x7FC0
  const bool rne = from_float<bf16>(1.00390625f).x == 0x3F80 && from_float<bf16>(1.01171875f).x == 0x3F82 &&
                   from_float<bf16>(kNaN).x == 0x7FC0 && from_float<bf16>(-kInf).x == 0xFF80;
  ++checks, failures += !rne;
  if (!rne) std::printf("FAIL bf16 rounding differs from at::BFloat16\n");
  const int64_t sizes[][4] = {{2, 2, 1, 24}, {2, 2, 1, 64}, {3, 2, 97, 24}, {3, 2, 97, 64}, {2, 2, 97, 80},
                              {2, 2, 97, 128}, {2, 1, 333, 64}, {2, 1, 333, 128}};
  for (const auto& s : sizes)
    for (bool causal : {false, true})
      for (bool specials : {false, true}) {
        Case c{s[0], s[1], s[2], s[3], causal, {}, specials};
        std::uniform_int_distribution<int64_t> len(0, c.T);
        for (int64_t b = 0; b < c.B; ++b) c.lengths.push_back(b == 0 ? c.T : b == 1 ? 0 : len(rng));  // full, empty, random
        if (c.T > 1 && c.B > 1) c.lengths[1] = specials ? c.T - 1 : 0;
        run_case(c, rng);
      }
  // Local windows: a row alone, lopsided and narrower than a tile, ModernBERT's (64, 64), wider than
  // every T here, and unbounded on one side. Lengths: full, empty (fully padded rows), random.
  const int64_t wsizes[][4] = {{2, 2, 1, 64}, {3, 2, 97, 64}, {2, 2, 97, 24}, {3, 1, 333, 64}, {2, 1, 333, 128}};
  const int64_t windows[][2] = {{0, 0}, {1, 2}, {64, 64}, {400, 400}, {-1, 3}, {70, -1}};
  const int64_t tiles_before = tiles_done;
  for (const auto& s : wsizes)
    for (const auto& w : windows)
      for (bool causal : {false, true}) {
        Case c{s[0], s[1], s[2], s[3], causal, {}, (w[0] == 64 || w[0] == 0) && s[3] == 64, w[0], w[1]};
        std::uniform_int_distribution<int64_t> len(0, c.T);
        for (int64_t b = 0; b < c.B; ++b) c.lengths.push_back(b == 0 ? c.T : b == 1 ? 0 : len(rng));
        run_case(c, rng);
      }
  // The skip at work: (64, 64) on one sequence of 333 (21 blocks of 16 rows) computes 3 tiles per
  // block at most (2 at either end), 58 pairs; without a window 6 blocks of 64 rows compute 36.
  Problem band;
  const int64_t len333[1] = {333};
  band.B = 1, band.H = 1, band.D = 64, band.Tq = band.Tk = 333, band.lengths = len333, band.win_left = band.win_right = 64;
  const int64_t want58 = band_tiles(band, band.block_rows());
  band.win_left = band.win_right = -1;
  const int64_t want36 = band_tiles(band, band.block_rows());
  ++checks, failures += !(want58 == 58 && want36 == 36);
  if (want58 != 58 || want36 != 36) std::printf("FAIL band_tiles: %lld and %lld, expected 58 and 36\n", (long long)want58, (long long)want36);
  std::printf("window cases: %lld (query block, key tile) pairs computed, each equal to its band's count\n",
              (long long)(tiles_done - tiles_before));
  // Position biases: ALiBi and a table (R = 5, narrower than every T but 1), alone and with windows, causal
  // on and off; lengths full, empty, random (the bias restarts at each packed sequence).
  const int64_t bsizes[][4] = {{2, 3, 1, 24}, {3, 3, 97, 24}, {2, 1, 333, 64}};
  const int64_t bwindows[][2] = {{-1, -1}, {3, 5}, {64, 64}};
  for (const auto& s : bsizes)
    for (const auto& w : bwindows)
      for (int kind : {int(kBiasAlibi), int(kBiasTable)})
        for (bool causal : {false, true}) {
          Case c{s[0], s[1], s[2], s[3], causal, {}, false, w[0], w[1], kind};
          std::uniform_int_distribution<int64_t> len(0, c.T);
          for (int64_t b = 0; b < c.B; ++b) c.lengths.push_back(b == 0 ? c.T : b == 1 ? 0 : len(rng));
          run_case(c, rng);
        }
  if (!amx_ready) std::printf("amx: not checked: %s\n", amx_status().c_str());
  std::printf("core_check %s W=%d kR=%d kNV=%d bf16dot=%d amx=%d: %d checks, %d failures\n", kIsa, W, kR, kNV, int(kBf16Dot),
              int(amx_ready), checks, failures);
  return failures == 0 ? 0 : 1;
}
