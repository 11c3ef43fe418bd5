// btlib CUDA attention: the torch-free interface between the kernel (flash_attn.cu) and its
// callers (binding.cpp: torch; emulate.cpp: a CPU emulation used by the tests). No CUDA or torch
// headers here, so every side compiles it with any C++17 compiler.
#pragma once
#include <cstdint>

typedef struct CUstream_st* cudaStream_t;  // the CUDA runtime's own typedef, repeated

namespace btlib_cuda {

constexpr int kBr = 64;           // query rows per block = threads per block (one row per thread)
constexpr int kBc = 32;           // keys per shared-memory tile
constexpr int kMaxHeadDim = 128;  // head_dim is rounded up to 32, 64 or 128 (a template argument)

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// One attention problem. Padded: q (B, H, Tq, D), k and v (B, H, Tk, D), lengths optional.
// Varlen: (total, H, D) tensors, batch stride 0, sequence b starting at row cu_seqlens[b].
// Strides in elements, for (batch, head, row); head_dim is contiguous.
struct Params {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  const int32_t* lengths = nullptr;     // (B,) real tokens per sequence, device memory, or null
  const int32_t* cu_seqlens = nullptr;  // (B + 1,) offsets, device memory, or null (padded)
  int64_t q_stride[3] = {0, 0, 0}, k_stride[3] = {0, 0, 0}, v_stride[3] = {0, 0, 0}, o_stride[3] = {0, 0, 0};
  int B = 0, H = 0, Tq = 0, Tk = 0, D = 0;  // varlen: Tq = Tk = max_seqlen
  bool causal = false;
  // Local window: query i attends keys i - win_left .. i + win_right; -1 = unbounded. The binding
  // stores a reach >= T as -1, so first + kBr + win_right cannot overflow.
  int win_left = -1, win_right = -1;
  float scale_log2e = 0.f;  // softmax scale * log2(e): the kernel uses exp2
  // Position bias (btlib/position_bias.py), added to the scaled score of query i, key j (positions within
  // the sequence): bias_kind 1 ALiBi, bias = H slopes, -slope_h |j - i|; 2 a table, bias = (H, 2 bias_R + 1),
  // bias[h][clamp(j - i, -R, R) + R]; 0 none. float32 in device memory.
  const float* bias = nullptr;
  int bias_kind = 0, bias_R = 0;
};

// Launch the forward kernel on `stream`. Returns nullptr on success, else the CUDA error text
// (the launch's cudaGetLastError: bad configuration, no kernel image for this GPU, ...).
const char* flash_attention_forward(const Params& p, DType dtype, cudaStream_t stream);

}  // namespace btlib_cuda
