// btlib's int8 linear layers (btlib/quant.py): the two memory-bound passes around torch._int_mm, fused.
//
//   quantize_rows  x (M, K) f32, a (K,) f32 or empty, u8 -> q (M, K) int8, s (M, 1) f32
//                  s_m = max_k |x[m,k] a_k| / 127,  q[m,k] = round(x[m,k] a_k / s_m)
//                  u8: q is stored as uint8 q + 128 instead (oneDNN's int8 linear takes uint8 activations
//                  with a zero point: 128 gives back the same integers, so the two GEMM paths sum the same products)
//                  one read of x (the row stays in L1 between its two loops), one int8 write:
//                  unfused torch ops take 5 passes over (M, K) floats (mul, abs, amax, div, round, cast).
//                  A row holding NaN or inf gets s_m = NaN and q = 0 (casting NaN to int8 is undefined):
//                  btlib/quant.py recomputes those rows in fp32, so NaN and inf propagate as in fp32.
//   dequantize     acc (M, N) int32 or f32, s (M, 1), w (N,) or empty, b (N,) or empty, act, r (M, N) or empty
//                  -> into y (M, N) f32 (y may be acc itself when acc is f32)
//                  y[m,n] = act(acc[m,n] s_m w_n + b_n) + r[m,n]: one read of acc, one write of y; act 0 none,
//                  1 exact GELU (vec.h's vgelu), 2 ReLU (torch ops: 4-5 passes with the activation and residual).
//   requantize     acc, s, w, b, act as dequantize (no residual), a (N,) or empty, u8 -> into q (M, N), s_out (M, 1):
//                  quantize_rows(act(acc s w + b), a, u8) with the float row kept in L1, never written: linear1's
//                  output goes straight to linear2's int8 input.
//
// The vector loops are written with vec.h's type plus the int32 <-> float conversions below (AVX-512, AVX2);
// other builds run the same arithmetic in plain loops. Measured on an Intel Xeon (AMX, 2 threads): the plain
// quantize loop did not vectorise (std::nearbyint) and ran at ~6.6 GB/s of x, a third of what the explicit
// conversion reaches. Rows are split across threads by at::parallel_for, as torch's own elementwise ops are.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using namespace btlib_vec;

#if defined(BTLIB_VEC_AVX512)
constexpr bool kVec = true;
inline vf load_i32(const int32_t* p) { return _mm512_cvtepi32_ps(_mm512_loadu_si512(p)); }
// round to nearest even (the default MXCSR mode, as std::nearbyint), then to int8: |v| <= 127 by construction
inline void store_i8(int8_t* q, vf v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v))); }
inline uint32_t max_abs_bits(const float* x, const float* a, int64_t K, int64_t& k) {
  __m512i m = _mm512_setzero_si512();
  const __m512i mask = _mm512_set1_epi32(0x7fffffff);
  for (; k + W <= K; k += W) {
    vf v = vload(x + k);
    if (a) v = vmul(v, vload(a + k));
    m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_castps_si512(v), mask));
  }
  return _mm512_reduce_max_epu32(m);
}
#elif defined(BTLIB_VEC_AVX2)
constexpr bool kVec = true;
inline vf load_i32(const int32_t* p) { return _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void store_i8(int8_t* q, vf v) {
  const __m256i i = _mm256_cvtps_epi32(v);  // 8 int32 in [-127, 127]: their low bytes are the int8 values
  const __m256i lo = _mm256_shuffle_epi8(i, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                             0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
  const __m256i both = _mm256_permutevar8x32_epi32(lo, _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(q), _mm256_castsi256_si128(both));
}
inline uint32_t max_abs_bits(const float* x, const float* a, int64_t K, int64_t& k) {
  __m256i m = _mm256_setzero_si256();
  const __m256i mask = _mm256_set1_epi32(0x7fffffff);
  for (; k + W <= K; k += W) {
    vf v = vload(x + k);
    if (a) v = vmul(v, vload(a + k));
    m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_castps_si256(v), mask));
  }
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m);
  uint32_t r = 0;
  for (uint32_t l : lanes) r = std::max(r, l);
  return r;
}
#else
constexpr bool kVec = false;
inline vf load_i32(const int32_t* p) { vf r; for (int i = 0; i < W; ++i) reinterpret_cast<float*>(&r)[i] = static_cast<float>(p[i]); return r; }
inline void store_i8(int8_t* q, vf v) { float t[W]; vstore(t, v); for (int i = 0; i < W; ++i) q[i] = static_cast<int8_t>(std::nearbyint(t[i])); }
inline uint32_t max_abs_bits(const float*, const float*, int64_t, int64_t&) { return 0; }
#endif

enum Act : int64_t { kNone = 0, kGelu = 1, kRelu = 2 };

constexpr uint32_t kInfBits = 0x7f800000u;  // |x| bits >= this: inf or NaN

inline uint32_t abs_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b & 0x7fffffffu;
}

// One row of quantize_rows: q = round(x a / s) (uint8 q + 128 if u8), returns s, or NaN (and q = 0) where the row
// holds NaN or inf.
float quantize_row(const float* xr, const float* A, int64_t K, int8_t* qr, bool u8) {
  // max |x a| over the row, taken on the bit patterns: for x >= 0 their integer order is the float
  // order, and NaN (above inf) is not dropped as std::max(float) drops it. Vectorises as well (pmaxud).
  int64_t k0 = 0;
  uint32_t mx_bits = kVec ? max_abs_bits(xr, A, K, k0) : 0;
  if (A) {
    for (int64_t k = k0; k < K; ++k) mx_bits = std::max(mx_bits, abs_bits(xr[k] * A[k]));
  } else {
    for (int64_t k = k0; k < K; ++k) mx_bits = std::max(mx_bits, abs_bits(xr[k]));
  }
  if (mx_bits >= kInfBits) {  // NaN or inf in the row
    std::memset(qr, u8 ? 0x80 : 0, K);
    return std::numeric_limits<float>::quiet_NaN();
  }
  float mx;
  std::memcpy(&mx, &mx_bits, sizeof mx);
  const float scale = std::max(mx, 1e-12f) / 127.f, inv = 1.f / scale;
  int64_t k = 0;
  if (kVec) {
    const vf vinv = vset1(inv);
    for (; k + W <= K; k += W) store_i8(qr + k, vmul(A ? vmul(vload(xr + k), vload(A + k)) : vload(xr + k), vinv));
  }
  if (A) {
    for (; k < K; ++k) qr[k] = static_cast<int8_t>(std::nearbyint(xr[k] * A[k] * inv));
  } else {
    for (; k < K; ++k) qr[k] = static_cast<int8_t>(std::nearbyint(xr[k] * inv));
  }
  if (u8) {  // q + 128 as uint8 is q's bit pattern with the top bit flipped; the row is still in L1
    auto* ur = reinterpret_cast<uint8_t*>(qr);
    for (int64_t j = 0; j < K; ++j) ur[j] ^= 0x80u;
  }
  return scale;
}

std::vector<at::Tensor> quantize_rows(const at::Tensor& x, const at::Tensor& a, bool u8) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "quantize_rows: x must be a contiguous (M, K) float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(a.numel() == 0 || (a.numel() == K && a.scalar_type() == at::kFloat && a.is_contiguous()),
              "quantize_rows: a must be empty or a contiguous (K,) float32 tensor");
  auto q = at::empty({M, K}, x.options().dtype(u8 ? at::kByte : at::kChar));
  auto s = at::empty({M, 1}, x.options());
  const float* X = x.data_ptr<float>();
  const float* A = a.numel() ? a.data_ptr<float>() : nullptr;
  int8_t* Q = static_cast<int8_t*>(q.data_ptr());  // uint8 when u8: the same bytes, offset in quantize_row
  float* S = s.data_ptr<float>();
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) S[m] = quantize_row(X + m * K, A, K, Q + m * K, u8);
  });
  return {q, s};
}

template <int64_t A>
inline float act1(float v) {
  if constexpr (A == kGelu) return 0.5f * v * (1.f + std::erf(v * 0.70710678118654752f));
  if constexpr (A == kRelu) return std::isnan(v) ? v : std::max(v, 0.f);
  return v;
}

template <int64_t A>
inline vf actv(vf v) {
  if constexpr (A == kGelu) return vgelu(v);
  if constexpr (A == kRelu) return vmax(vzero(), v);  // relu(NaN) = NaN
  return v;
}

inline vf load_acc(const int32_t* p) { return load_i32(p); }
inline vf load_acc(const float* p) { return vload(p); }

// One row: yr = act(cr sm w + b) + rr (rr may be null).
template <int64_t A, typename T>
inline void dequantize_rows_serial(const T* cr, float sm, const float* Wt, const float* B, const float* rr, float* yr,
                                   int64_t N) {
  int64_t n = 0;
  if (kVec) {
    const vf vs = vset1(sm);
    for (; n + W <= N; n += W) {
      vf v = vmul(load_acc(cr + n), vs);
      if (Wt) v = vmul(v, vload(Wt + n));
      if (B) v = vadd(v, vload(B + n));
      v = actv<A>(v);
      vstore(yr + n, rr ? vadd(v, vload(rr + n)) : v);
    }
  }
  for (; n < N; ++n) {
    const float v = act1<A>(static_cast<float>(cr[n]) * sm * (Wt ? Wt[n] : 1.f) + (B ? B[n] : 0.f));
    yr[n] = rr ? v + rr[n] : v;
  }
}

template <int64_t A, typename T>
void dequantize_rows(const T* C, const float* Sp, const float* Wt, const float* B, const float* R, float* Y,
                     int64_t M, int64_t N) {
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      dequantize_rows_serial<A>(C + m * N, Sp[m], Wt, B, R ? R + m * N : nullptr, Y + m * N, N);
  });
}

// The one dispatch of dequantize and requantize: f(C, A) with acc's data as int32_t* or float* and act as the
// compile-time constant A (std::integral_constant), so each of the six row loops is its own instantiation.
template <typename F>
void with_epilogue(const at::Tensor& acc, int64_t act, F&& f) {
  auto on = [&](auto* C) {
    if (act == kGelu) f(C, std::integral_constant<int64_t, kGelu>{});
    else if (act == kRelu) f(C, std::integral_constant<int64_t, kRelu>{});
    else f(C, std::integral_constant<int64_t, kNone>{});
  };
  if (acc.scalar_type() == at::kInt) on(acc.data_ptr<int32_t>());
  else on(acc.data_ptr<float>());
}

// The arguments dequantize and requantize share: acc (M, N) int32 or float32, s (M, 1), w and b (N,) or empty, act.
void check_epilogue(const char* fn, const at::Tensor& acc, const at::Tensor& s, const at::Tensor& w, const at::Tensor& b,
                    int64_t act) {
  TORCH_CHECK(acc.dim() == 2 && (acc.scalar_type() == at::kInt || acc.scalar_type() == at::kFloat) && acc.is_contiguous(),
              fn, ": acc must be a contiguous (M, N) int32 or float32 tensor");
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(s.numel() == M && s.scalar_type() == at::kFloat && s.is_contiguous(), fn, ": s must be (M, 1) float32");
  TORCH_CHECK(w.numel() == 0 || (w.numel() == N && w.scalar_type() == at::kFloat && w.is_contiguous()),
              fn, ": w must be empty or (N,) float32");
  TORCH_CHECK(b.numel() == 0 || (b.numel() == N && b.scalar_type() == at::kFloat && b.is_contiguous()),
              fn, ": b must be empty or (N,) float32");
  TORCH_CHECK(act == kNone || act == kGelu || act == kRelu, fn, ": act must be 0 (none), 1 (GELU) or 2 (ReLU)");
}

void dequantize(const at::Tensor& acc, const at::Tensor& s, const at::Tensor& w, const at::Tensor& b, int64_t act,
                const at::Tensor& r, at::Tensor& y) {
  check_epilogue("dequantize", acc, s, w, b, act);
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(r.numel() == 0 || (r.dim() == 2 && r.size(0) == M && r.size(1) == N && r.scalar_type() == at::kFloat &&
                                 r.is_contiguous()), "dequantize: r must be empty or a contiguous (M, N) float32 tensor");
  TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) == N && y.scalar_type() == at::kFloat && y.is_contiguous(),
              "dequantize: y must be a contiguous (M, N) float32 tensor");
  const float *Sp = s.data_ptr<float>(), *Wt = w.numel() ? w.data_ptr<float>() : nullptr;
  const float* B = b.numel() ? b.data_ptr<float>() : nullptr;
  const float* R = r.numel() ? r.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();  // y == acc (float) is fine: each element is read before it is written
  with_epilogue(acc, act, [&](auto* C, auto A) { dequantize_rows<decltype(A)::value>(C, Sp, Wt, B, R, Y, M, N); });
}

// requantize: dequantize's row (act(acc s w + b), no residual) quantized again for the next int8 linear without
// being written as floats: the row lives in a per-thread buffer (N floats, L1) between the two loops. Saves the
// float (M, N) write and its read back, the widest activation of a layer (linear1's output, 4 x d_model).
template <int64_t A, typename T>
void requantize_rows(const T* C, const float* Sp, const float* Wt, const float* B, const float* An, bool u8, int8_t* Q,
                     float* S, int64_t M, int64_t N) {
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(N);
    for (int64_t m = begin; m < end; ++m) {
      dequantize_rows_serial<A>(C + m * N, Sp[m], Wt, B, nullptr, row.data(), N);
      S[m] = quantize_row(row.data(), An, N, Q + m * N, u8);
    }
  });
}

void requantize(const at::Tensor& acc, const at::Tensor& s, const at::Tensor& w, const at::Tensor& b, int64_t act,
                const at::Tensor& a, bool u8, at::Tensor& q, at::Tensor& s_out) {
  check_epilogue("requantize", acc, s, w, b, act);
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(a.numel() == 0 || (a.numel() == N && a.scalar_type() == at::kFloat && a.is_contiguous()),
              "requantize: a must be empty or a contiguous (N,) float32 tensor");
  TORCH_CHECK(q.dim() == 2 && q.size(0) == M && q.size(1) == N && q.is_contiguous() &&
              q.scalar_type() == (u8 ? at::kByte : at::kChar), "requantize: q must be a contiguous (M, N) int8 tensor "
              "(uint8 if u8)");
  TORCH_CHECK(s_out.numel() == M && s_out.scalar_type() == at::kFloat && s_out.is_contiguous(),
              "requantize: s_out must be a contiguous (M, 1) float32 tensor");
  const float *Sp = s.data_ptr<float>(), *Wt = w.numel() ? w.data_ptr<float>() : nullptr;
  const float* B = b.numel() ? b.data_ptr<float>() : nullptr;
  const float* An = a.numel() ? a.data_ptr<float>() : nullptr;
  auto* Q = static_cast<int8_t*>(q.data_ptr());
  float* So = s_out.data_ptr<float>();
  with_epilogue(acc, act, [&](auto* C, auto A) { requantize_rows<decltype(A)::value>(C, Sp, Wt, B, An, u8, Q, So, M, N); });
}

}  // namespace

// All three release the GIL while they run, as gemm.cpp's linear and PyTorch's own ops do: they touch no Python object
// (pybind11 converts the arguments before the guard and the result after it), and holding the GIL through a pass
// kept a server's event loop thread waiting for as long.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_rows", &quantize_rows, "per-row symmetric int8 of x * a: (q (M, K) int8, or uint8 q + 128 if u8, "
        "s (M, 1) float32)", py::arg("x"), py::arg("a"), py::arg("u8") = false, py::call_guard<py::gil_scoped_release>());
  m.def("dequantize", &dequantize, "y (M, N) float32 = act(acc (M, N) int32 or float32 * s (M, 1) * w (N,) + b (N,)) "
        "+ r (M, N); w, b, r: tensors or empty; act 0/1/2: none/GELU/ReLU", py::call_guard<py::gil_scoped_release>());
  m.def("requantize", &requantize, "dequantize's act(acc * s * w + b), quantized per row as quantize_rows(., a, u8) "
        "into q (M, N) and s_out (M, 1) without a float write; w, b, a: tensors or empty",
        py::call_guard<py::gil_scoped_release>());
}
