// btlib's own fp32 GEMM for the encoder's linears (btlib/gemm.py's "btlib" path): y = x W^T + b (+ r).
//
//   pack    W (N, K) f32 -> P (ceil(N / kP), K, kP) f32: column panels of kP = 2 vectors, zero-padded
//           past N. Made once per weight (btlib/gemm.py caches it), so every call reads W in the order
//           the loop below consumes it: one panel, k by k, 2 vectors at a time.
//   linear  x (M, K), P, b (N,) or empty, act, r (M, N) or empty -> y (M, N) = act(x W^T + b) + r
//           act: 0 none, 1 GELU (exact, erf), 2 ReLU, applied to the registers before they are stored
//
// Why: an encoder answering one short query multiplies ~13 token rows by each weight. Such a GEMM does
// 2 M K N flops on 4 K N bytes of weights, ~6 flops a byte at M = 13: the time is reading W, and a
// library tuned for big squares spends it on blocking and packing that few rows never pay back. Here
// each thread takes whole panels; for a block of up to kMaxR rows it keeps the kMaxR x kP outputs in
// registers (2 * kMaxR accumulators + 2 weight vectors + 1 broadcast: 31 of 32 zmm on AVX-512, 15 of
// 16 ymm on AVX2 with kMaxR = 6) and streams the panel from memory once; more rows re-read the panel
// from L1/L2 (a K = 1536 panel is 192 KiB) for the next row block. Measured on an Intel Xeon with
// AMX (Sapphire Rapids class, 2 threads, torch 2.13): MiniLM's four GEMMs at M = 13 ran in ~0.12 ms
// against oneDNN's ~0.22 ms and MKL's ~0.30 ms; which path wins at which M is measured on the reader's
// CPU by btlib/gemm_measure.py.
//
// Sums run k = 0, 1, ..., K-1 with one FMA each (a different order from MKL's or oneDNN's, so results
// differ from F.linear's in the last bits, within fp32 rounding). NaN and inf propagate as in any
// fp32 GEMM: a NaN in row m of x makes row m of y NaN; an inf times a zero weight is NaN.
//
// The GELU is vec.h's vgelu (exact GELU through erfc, within 1e-6 of float64; +-inf give NaN as F.gelu's).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "vec.h"

namespace {

using namespace btlib_vec;

constexpr int kP = 2 * W;  // panel width in floats: 32 on AVX-512, 16 on AVX2, 8 on NEON, 16 portable
// Weights are prefetched (into L1) kAhead floats = 2 KiB before the loop reads them: the hardware prefetchers
// alone left the stream latency-bound. Measured on the Xeon above, MiniLM's 24 GEMMs at M = 13 with cold
// weights: 2.2-2.3 ms without, 1.6-1.7 ms at 1-2 KiB ahead, 2.0 ms at 4 KiB; a non-temporal hint (keep the
// stream out of L2) made them 2x slower. A prefetch past the end of W is harmless (prefetches never fault).
constexpr int64_t kAhead = 512;
#if defined(BTLIB_VEC_AVX2)
constexpr int kMaxR = 6;  // 16 ymm: 12 accumulators + 2 weight vectors + 1 broadcast
#elif defined(BTLIB_VEC_AVX512) || defined(BTLIB_VEC_NEON)
constexpr int kMaxR = 14;  // 32 registers: 28 + 2 + 1
#else
constexpr int kMaxR = 4;
#endif

void check_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous(),
              "btlib gemm: ", what, " must be a contiguous float32 CPU tensor; got ", t.scalar_type(), " ",
              t.device(), t.is_contiguous() ? "" : " (not contiguous: call .contiguous())");
}

at::Tensor pack(const at::Tensor& w) {
  check_float(w, "W");
  TORCH_CHECK(w.dim() == 2, "btlib gemm: W must be (N, K); got ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kP - 1) / kP;
  auto p = at::zeros({panels, K, kP}, w.options());
  const float* Wd = w.data_ptr<float>();
  float* Pd = p.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      const int64_t n0 = j * kP, nv = std::min<int64_t>(kP, N - n0);
      float* panel = Pd + j * K * kP;
      for (int64_t n = 0; n < nv; ++n)
        for (int64_t k = 0; k < K; ++k) panel[k * kP + n] = Wd[(n0 + n) * K + k];
    }
  });
  return p;
}

enum Act : int64_t { kNone = 0, kGelu = 1, kRelu = 2 };

template <int64_t A>
inline vf activate(vf x) {
  if constexpr (A == kGelu) return vgelu(x);
  if constexpr (A == kRelu) return vmax(vzero(), x);  // relu(NaN) = NaN, as torch's
  return x;
}

// R rows of x (row stride K) times one panel -> y's R x nv block at column n0: act(. + bias) + residual.
template <int R, int64_t A>
inline void block(const float* x, const float* panel, int64_t K, const float* bias, const float* res, float* y,
                  int64_t N, int64_t n0, int64_t nv) {
  vf a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    for (int l = 0; l < kP; l += 16) __builtin_prefetch(panel + k * kP + kAhead + l, 0, 3);  // each 64-byte line
    const vf w0 = vload(panel + k * kP), w1 = vload(panel + k * kP + W);
    for (int r = 0; r < R; ++r) {
      const vf xb = vset1(x[r * K + k]);
      a0[r] = vfma(xb, w0, a0[r]);
      a1[r] = vfma(xb, w1, a1[r]);
    }
  }
  if (nv == kP) {
    const vf b0 = bias ? vload(bias + n0) : vzero(), b1 = bias ? vload(bias + n0 + W) : vzero();
    for (int r = 0; r < R; ++r) {
      vf y0 = activate<A>(vadd(a0[r], b0)), y1 = activate<A>(vadd(a1[r], b1));
      if (res) {
        y0 = vadd(y0, vload(res + r * N + n0));
        y1 = vadd(y1, vload(res + r * N + n0 + W));
      }
      vstore(y + r * N + n0, y0);
      vstore(y + r * N + n0 + W, y1);
    }
    return;
  }
  alignas(64) float tmp[kP], bt[kP] = {};  // the last panel, narrower than kP
  if (bias)
    for (int64_t j = 0; j < nv; ++j) bt[j] = bias[n0 + j];
  for (int r = 0; r < R; ++r) {
    vstore(tmp, activate<A>(vadd(a0[r], vload(bt))));
    vstore(tmp + W, activate<A>(vadd(a1[r], vload(bt + W))));
    for (int64_t j = 0; j < nv; ++j) y[r * N + n0 + j] = tmp[j] + (res ? res[r * N + n0 + j] : 0.f);
  }
}

// the block for m (1..R) rows: R - m template steps down to the instantiation with m accumulators
template <int R, int64_t A>
inline void rows(int m, const float* x, const float* panel, int64_t K, const float* bias, const float* res, float* y,
                 int64_t N, int64_t n0, int64_t nv) {
  if constexpr (R > 0) {
    if (m == R) return block<R, A>(x, panel, K, bias, res, y, N, n0, nv);
    rows<R - 1, A>(m, x, panel, K, bias, res, y, N, n0, nv);
  }
}

template <int64_t A>
void run(const float* X, const float* P, const float* B, const float* Rd, float* Y, int64_t M, int64_t K, int64_t N) {
  const int64_t panels = (N + kP - 1) / kP;
  at::parallel_for(0, panels, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      const int64_t n0 = j * kP, nv = std::min<int64_t>(kP, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxR) {
        const int m = static_cast<int>(std::min<int64_t>(kMaxR, M - m0));
        rows<kMaxR, A>(m, X + m0 * K, P + j * K * kP, K, B, Rd ? Rd + m0 * N : nullptr, Y + m0 * N, N, n0, nv);
      }
    }
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& p, int64_t N, const at::Tensor& b, int64_t act,
                  const at::Tensor& r) {
  check_float(x, "x");
  check_float(p, "the packed W");
  TORCH_CHECK(x.dim() == 2, "btlib gemm: x must be (M, K); got ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1), panels = (N + kP - 1) / kP;
  TORCH_CHECK(p.dim() == 3 && p.size(0) == panels && p.size(1) == K && p.size(2) == kP,
              "btlib gemm: the packed W has shape ", p.sizes(), "; for x of ", K, " columns and N = ", N, " it must be (",
              panels, ", ", K, ", ", kP, "): pack W (N, K) with this build's pack()");
  if (b.numel()) {
    check_float(b, "b");
    TORCH_CHECK(b.numel() == N, "btlib gemm: b must have N = ", N, " elements; got ", b.numel());
  }
  if (r.numel()) {
    check_float(r, "the residual");
    TORCH_CHECK(r.dim() == 2 && r.size(0) == M && r.size(1) == N, "btlib gemm: the residual must be (", M, ", ", N,
                "); got ", r.sizes());
  }
  TORCH_CHECK(act == kNone || act == kGelu || act == kRelu, "btlib gemm: act must be 0 (none), 1 (GELU) or 2 (ReLU); got ", act);
  auto y = at::empty({M, N}, x.options());
  const float *X = x.data_ptr<float>(), *P = p.data_ptr<float>();
  const float *B = b.numel() ? b.data_ptr<float>() : nullptr, *Rd = r.numel() ? r.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  if (act == kGelu) run<kGelu>(X, P, B, Rd, Y, M, K, N);
  else if (act == kRelu) run<kRelu>(X, P, B, Rd, Y, M, K, N);
  else run<kNone>(X, P, B, Rd, Y, M, K, N);
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("panel_width") = kP;
  m.attr("max_rows") = kMaxR;
  m.attr("isa") = kIsa;
  m.def("pack", &pack, "W (N, K) float32 -> column panels (ceil(N / panel_width), K, panel_width), zero-padded");
  // The GIL is released while the GEMM runs, as PyTorch's own ops do: holding it, a 13 ms linear (512 x 384 -> 1536, 2
  // threads) kept a server's event loop thread from running Python for as long (a 1 ms sleep there took p50 4 ms, max 20 ms)
  m.def("linear", &linear, "y (M, N) = act(x (M, K) W^T + b) + r from pack(W); b, r: tensors or empty; act 0/1/2: "
        "none/GELU/ReLU", py::arg("x"), py::arg("packed"), py::arg("N"), py::arg("b"), py::arg("act"), py::arg("r"),
        py::call_guard<py::gil_scoped_release>());
}
