// btlib's int8 linear layers (btlib/quant.py): the two memory-bound passes around torch._int_mm, fused.
//
//   quantize_rows  x (M, K) f32, a (K,) f32 or empty -> q (M, K) int8, s (M, 1) f32
//                  s_m = max_k |x[m,k] a_k| / 127,  q[m,k] = round(x[m,k] a_k / s_m)
//                  one read of x (the row stays in L1 between its two loops), one int8 write:
//                  unfused torch ops take 5 passes over (M, K) floats (mul, abs, amax, div, round, cast).
//                  A row holding NaN or inf gets s_m = NaN and q = 0 (casting NaN to int8 is undefined):
//                  btlib/quant.py recomputes those rows in fp32, so NaN and inf propagate as in fp32.
//   dequantize     acc (M, N) int32, s (M, 1), w (N,), b (N,) or empty -> into y (M, N) f32
//                  y[m,n] = acc[m,n] s_m w_n + b_n: one read of acc, one write of y (torch ops: 2-3 passes).
//
// Plain loops: the compiler vectorises them (-O3, no math errno); rows are split across threads by
// at::parallel_for, as torch's own elementwise ops are.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr uint32_t kInfBits = 0x7f800000u;  // |x| bits >= this: inf or NaN

inline uint32_t abs_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b & 0x7fffffffu;
}

std::vector<at::Tensor> quantize_rows(const at::Tensor& x, const at::Tensor& a) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "quantize_rows: x must be a contiguous (M, K) float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(a.numel() == 0 || (a.numel() == K && a.scalar_type() == at::kFloat && a.is_contiguous()),
              "quantize_rows: a must be empty or a contiguous (K,) float32 tensor");
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto s = at::empty({M, 1}, x.options());
  const float* X = x.data_ptr<float>();
  const float* A = a.numel() ? a.data_ptr<float>() : nullptr;
  int8_t* Q = q.data_ptr<int8_t>();
  float* S = s.data_ptr<float>();
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* xr = X + m * K;
      int8_t* qr = Q + m * K;
      // max |x a| over the row, taken on the bit patterns: for x >= 0 their integer order is the float
      // order, and NaN (above inf) is not dropped as std::max(float) drops it. Vectorises as well (pmaxud).
      uint32_t mx_bits = 0;
      if (A) {
        for (int64_t k = 0; k < K; ++k) mx_bits = std::max(mx_bits, abs_bits(xr[k] * A[k]));
      } else {
        for (int64_t k = 0; k < K; ++k) mx_bits = std::max(mx_bits, abs_bits(xr[k]));
      }
      if (mx_bits >= kInfBits) {  // NaN or inf in the row
        std::memset(qr, 0, K);
        S[m] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      float mx;
      std::memcpy(&mx, &mx_bits, sizeof mx);
      const float scale = std::max(mx, 1e-12f) / 127.f, inv = 1.f / scale;
      if (A) {
        for (int64_t k = 0; k < K; ++k) qr[k] = static_cast<int8_t>(std::nearbyint(xr[k] * A[k] * inv));
      } else {
        for (int64_t k = 0; k < K; ++k) qr[k] = static_cast<int8_t>(std::nearbyint(xr[k] * inv));
      }
      S[m] = scale;
    }
  });
  return {q, s};
}

void dequantize(const at::Tensor& acc, const at::Tensor& s, const at::Tensor& w, const at::Tensor& b, at::Tensor& y) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kInt && acc.is_contiguous(),
              "dequantize: acc must be a contiguous (M, N) int32 tensor");
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(s.numel() == M && s.scalar_type() == at::kFloat && s.is_contiguous(), "dequantize: s must be (M, 1) float32");
  TORCH_CHECK(w.numel() == N && w.scalar_type() == at::kFloat && w.is_contiguous(), "dequantize: w must be (N,) float32");
  TORCH_CHECK(b.numel() == 0 || (b.numel() == N && b.scalar_type() == at::kFloat && b.is_contiguous()),
              "dequantize: b must be empty or (N,) float32");
  TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) == N && y.scalar_type() == at::kFloat && y.is_contiguous(),
              "dequantize: y must be a contiguous (M, N) float32 tensor");
  const int32_t* C = acc.data_ptr<int32_t>();
  const float *Sp = s.data_ptr<float>(), *W = w.data_ptr<float>(), *B = b.numel() ? b.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int32_t* cr = C + m * N;
      float* yr = Y + m * N;
      const float sm = Sp[m];
      if (B) {
        for (int64_t n = 0; n < N; ++n) yr[n] = static_cast<float>(cr[n]) * sm * W[n] + B[n];
      } else {
        for (int64_t n = 0; n < N; ++n) yr[n] = static_cast<float>(cr[n]) * sm * W[n];
      }
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_rows", &quantize_rows, "per-row symmetric int8 of x * a: (q (M, K) int8, s (M, 1) float32)");
  m.def("dequantize", &dequantize, "y (M, N) float32 = acc (M, N) int32 * s (M, 1) * w (N,) + b (N,)");
}
