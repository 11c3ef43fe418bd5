// core_check.cpp: the torch-free kernel core (teaching.h, flash.h) against a double-precision
// reference, in one program: every version, fp32 and bf16, padded and varlen, on sizes that are
// not tile multiples, fully padded rows, causal on and off, and NaN/inf in q, k, v at real and
// padded positions. Exits non-zero on any mismatch. tests/test_cpu_core.py builds it for every
// ISA this CPU runs (-DISA flags as in build.py) and for aarch64 (NEON) under qemu-aarch64:
//   g++ -O2 -std=c++17 -pthread [-march=...] core_check.cpp -o core_check && ./core_check
#include <cmath>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "flash.h"
#include "teaching.h"

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
};

// O = softmax(Q K^T * scale) V in double, IEEE NaN semantics as torch's reference: a NaN or +inf
// score gives a NaN row. Rows t >= len_q and rows without keys are 0. Same Problem, same strides.
std::vector<double> reference(const Problem& p, const std::vector<float>& q, const std::vector<float>& k,
                              const std::vector<float>& v, size_t out_size) {
  std::vector<double> o(out_size, 0.0);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.H; ++h)
      for (int64_t i = 0; i < p.len_q(b); ++i) {
        const int64_t n = p.keys_of_row(b, i);
        std::vector<double> s(n);
        double m = -INFINITY, l = 0.0;
        for (int64_t j = 0; j < n; ++j) {
          double dot = 0.0;
          for (int64_t d = 0; d < p.D; ++d) dot += double(p.at(q.data(), p.qs, b, h, i)[d]) * p.at(k.data(), p.ks, b, h, j)[d];
          s[j] = dot * p.scale;
          m = std::max(m, s[j]);
        }
        for (int64_t j = 0; j < n; ++j) l += (s[j] = std::exp(s[j] - m));
        double* oi = o.data() + (p.at(q.data(), p.os, b, h, i) - q.data());
        for (int64_t j = 0; j < n; ++j)
          for (int64_t d = 0; d < p.D; ++d) oi[d] += s[j] / l * p.at(v.data(), p.vs, b, h, j)[d];
      }
  return o;
}

int failures = 0, checks = 0;

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
    std::printf("FAIL %-14s B=%lld H=%lld T=%lld D=%lld causal=%d specials=%d: rel err %.2e (tol %.0e), %lld NaN mismatches, "
                "%lld nonzero padded outputs\n", what, (long long)c.B, (long long)c.H, (long long)c.T, (long long)c.D, c.causal,
                c.specials, rel, tol, (long long)nan_mismatch, (long long)pad_nonzero);
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
template <typename T>
void check_v3(const char* what, const Case& c, const Problem& p, const std::vector<float>& q, const std::vector<float>& k,
              const std::vector<float>& v, double tol) {
  const auto qt = convert<T>(q), kt = convert<T>(k), vt = convert<T>(v);
  std::vector<T> o(q.size(), from_float<T>(kNaN));  // NaN-filled: a row the kernel forgets to write shows up
  attention_v3(p, qt.data(), kt.data(), vt.data(), o.data(), kThreads, ThreadsFor{});
  compare(what, c, p, widen(o), reference(p, widen(qt), widen(kt), widen(vt), q.size()), tol);
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
      if (L > 1) at(v, b, H - 1, 0)[0] = kNaN;  // a NaN value at key 0: every row that attends it
      if (L > 2) at(k, b, 0, 1)[D / 2] = kInf;  // an inf key: rows whose score is +inf are NaN
    }
  }
  Problem p;  // padded (B, H, T, D)
  p.B = B, p.H = H, p.D = D, p.Tq = p.Tk = T, p.causal = c.causal, p.scale = 1.0f / std::sqrt(float(D));
  p.lengths = c.lengths.data();
  const int64_t s[3] = {H * T * D, T * D, D};
  for (int i = 0; i < 3; ++i) p.qs[i] = p.ks[i] = p.vs[i] = p.os[i] = s[i];
  const auto ref = reference(p, q, k, v, n);
  std::vector<float> o(n, kNaN);
  attention_v1(p, q.data(), k.data(), v.data(), o.data(), kThreads, ThreadsFor{});
  compare("v1", c, p, o, ref, 1e-5);
  std::fill(o.begin(), o.end(), kNaN);
  attention_v2(p, q.data(), k.data(), v.data(), o.data(), kThreads, ThreadsFor{});
  compare("v2", c, p, o, ref, 1e-5);
  check_v3<float>("v3 fp32", c, p, q, k, v, 1e-5);
  check_v3<bf16>("v3 bf16", c, p, q, k, v, 1.5e-2);  // P and O rounded to bf16: 2^-8 relative, twice

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
  std::printf("core_check %s W=%d kR=%d kNV=%d bf16dot=%d: %d checks, %d failures\n", kIsa, W, kR, kNV, int(kBf16Dot), checks,
              failures);
  return failures == 0 ? 0 : 1;
}
