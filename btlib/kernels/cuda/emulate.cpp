// Runs flash_fwd_kernel (flash_attn_kernel.cuh, the very file nvcc compiles) on the CPU, for tests
// on machines without a GPU. Compiled by g++ (emulate.py), not nvcc.
//
// How: one std::thread per CUDA thread of a block, blocks one after another; __syncthreads() is a
// std::barrier over the block's threads; __shared__ arrays become function-local statics, shared
// by the threads of the running block; threadIdx/blockIdx are thread_local. This checks the
// kernel's indexing, masks, online softmax, fp16/bf16 conversions and barrier placement (a
// barrier some threads skip deadlocks here, so the test times out). It does not model warps,
// memory coalescing, caches or the GPU's floating-point contraction.
#define __shared__ static  // before the CUDA headers, which leave a defined __shared__ alone
#define __launch_bounds__(...)
#include <barrier>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
static thread_local Dim3 threadIdx, blockIdx;
static std::barrier<>* g_block_barrier = nullptr;
static inline void __syncthreads() { g_block_barrier->arrive_and_wait(); }
using std::max;
using std::min;

#include "flash_attn_kernel.cuh"

namespace {

template <typename T, int kD>
void run_grid(const btlib_cuda::Params& p) {
  const int tiles = (std::max(p.Tq, 1) + btlib_cuda::kBr - 1) / btlib_cuda::kBr;
  for (int b = 0; b < p.B; ++b)
    for (int h = 0; h < p.H; ++h)
      for (int x = 0; x < tiles; ++x) {
        std::barrier<> bar(btlib_cuda::kBr);
        g_block_barrier = &bar;
        std::vector<std::thread> threads;
        for (int t = 0; t < btlib_cuda::kBr; ++t)
          threads.emplace_back([&p, b, h, x, t] {
            blockIdx = {unsigned(x), unsigned(h), unsigned(b)};
            threadIdx = {unsigned(t), 0, 0};
            btlib_cuda::flash_fwd_kernel<T, kD>(p);
          });
        for (auto& th : threads) th.join();
      }
}

template <typename T>
void run_dtype(const btlib_cuda::Params& p) {
  if (p.D <= 32) run_grid<T, 32>(p);
  else if (p.D <= 64) run_grid<T, 64>(p);
  else run_grid<T, 128>(p);
}

}  // namespace

// C ABI for ctypes. Pointers are host memory; strides as in Params (batch, head, row) x (q, k, v, o).
extern "C" int btlib_emulate_flash_forward(const void* q, const void* k, const void* v, void* o, const int32_t* lengths,
                                           const int32_t* cu_seqlens, const int64_t* strides, int B, int H, int Tq, int Tk,
                                           int D, int causal, float scale_log2e, int dtype, int win_left, int win_right,
                                           const float* bias, int bias_kind, int bias_R) {
  btlib_cuda::Params p;
  p.q = q, p.k = k, p.v = v, p.o = o, p.lengths = lengths, p.cu_seqlens = cu_seqlens;
  std::memcpy(p.q_stride, strides, 3 * sizeof(int64_t));
  std::memcpy(p.k_stride, strides + 3, 3 * sizeof(int64_t));
  std::memcpy(p.v_stride, strides + 6, 3 * sizeof(int64_t));
  std::memcpy(p.o_stride, strides + 9, 3 * sizeof(int64_t));
  p.B = B, p.H = H, p.Tq = Tq, p.Tk = Tk, p.D = D, p.causal = causal != 0, p.scale_log2e = scale_log2e;
  p.win_left = win_left, p.win_right = win_right;
  p.bias = bias, p.bias_kind = bias_kind, p.bias_R = bias_R;
  if (bias_kind < 0 || bias_kind > 2 || (bias_kind != 0) != (bias != nullptr)) return 3;
  if (D < 1 || D > btlib_cuda::kMaxHeadDim) return 1;
  switch (static_cast<btlib_cuda::DType>(dtype)) {
    case btlib_cuda::DType::kFloat32: run_dtype<float>(p); break;
    case btlib_cuda::DType::kFloat16: run_dtype<__half>(p); break;
    case btlib_cuda::DType::kBFloat16: run_dtype<__nv_bfloat16>(p); break;
    default: return 2;
  }
  return 0;
}
