// btlib CUDA attention, forward: the launcher of flash_fwd_kernel (flash_attn_kernel.cuh).
// Torch-free: nvcc compiles this file alone for sm_75 (T4), sm_80 (A100) and sm_90 (H100) in the
// tests; binding.cpp adds the torch API when a CUDA build of torch is present.
#include <cuda_runtime.h>

#include <algorithm>

#include "flash_attn.h"
#include "flash_attn_kernel.cuh"

namespace btlib_cuda {

template <typename T>
static void launch(const Params& p, cudaStream_t stream) {
  const dim3 grid((std::max(p.Tq, 1) + kBr - 1) / kBr, p.H, p.B);  // (query tiles, heads, batch)
  const dim3 block(kBr);
  if (p.D <= 32)
    flash_fwd_kernel<T, 32><<<grid, block, 0, stream>>>(p);
  else if (p.D <= 64)
    flash_fwd_kernel<T, 64><<<grid, block, 0, stream>>>(p);
  else
    flash_fwd_kernel<T, 128><<<grid, block, 0, stream>>>(p);
}

const char* flash_attention_forward(const Params& p, DType dtype, cudaStream_t stream) {
  if (p.D < 1 || p.D > kMaxHeadDim) return "head_dim must be in [1, 128]";
  if (p.B == 0 || p.H == 0 || p.Tq == 0) return nullptr;  // nothing to compute
  switch (dtype) {
    case DType::kFloat32: launch<float>(p, stream); break;
    case DType::kFloat16: launch<__half>(p, stream); break;
    case DType::kBFloat16: launch<__nv_bfloat16>(p, stream); break;
  }
  const cudaError_t err = cudaGetLastError();  // launch errors: bad grid, no image for this GPU, ...
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace btlib_cuda
