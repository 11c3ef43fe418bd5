// btlib CUDA attention kernel, forward: O = softmax(Q K^T * scale + mask) V, fp32 accumulation.
//
// The plain SIMT form of FlashAttention (Dao et al. 2022, Algorithm 1; the layout follows
// flash-attention-minimal): one block of kBr threads per (query tile, head, batch), one thread
// per query row. Each K/V tile (kBc x D) is loaded once from HBM into shared memory (SRAM) by the
// whole block, then every thread reads it: K and V cross HBM once per query tile, T / kBr times
// per (b, h), and the T x T scores exist only as kBc floats in a thread's registers.
//   Cost: 4 T^2 D flops on FMA units (no tensor cores: the Triton kernel uses them on sm_80+).
//   A thread holds q and the output row in registers (2 kD floats): at kD = 128 they spill to
//   local memory, which the L1 cache absorbs. A teaching kernel, not a tuned one.
// Masks: key padding (keys j >= L), causal (j <= i), a local window (i - win_left <= j <= i +
// win_right), padded query rows (i >= L) written as 0; a row with no allowed key outputs 0. The
// tile loop runs only over the keys some row of the block may attend: with a window about
// kBr + win_left + win_right keys (rounded out to kBc tiles) instead of L, so 4 L D (kBr + left +
// right) flops per (b, h) instead of 4 L^2 D.
// Position bias (Params::bias_kind): ALiBi -slope_h |j - i| or a table row h at clamp(j - i, -R, R) + R,
// added to each allowed score from the positions (the table is read through L1; no (T, T) tensor).
//
// Torch-free and launch-free: flash_attn.cu includes it and launches it; emulate.cpp includes it
// and runs it on CPU threads for the tests. Needs Params (flash_attn.h), <cmath> and the
// fp16/bf16 conversions below from <cuda_fp16.h> / <cuda_bf16.h>.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "flash_attn.h"

namespace btlib_cuda {

constexpr float kLog2eF = 1.4426950408889634f;  // the scores are in log2 units: the bias is scaled alike

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// grid (ceil(Tq / kBr), H, B), block kBr threads. kD: head_dim rounded up (32, 64 or 128).
template <typename T, int kD>
__global__ void __launch_bounds__(kBr) flash_fwd_kernel(const Params p) {
  const int b = blockIdx.z, h = blockIdx.y, tid = threadIdx.x;
  // Sequence b: Lq real queries, Lk real keys, rows_out rows to write (padded: all Tq).
  const int64_t row0 = p.cu_seqlens ? p.cu_seqlens[b] : 0;
  const int Lq = p.cu_seqlens ? p.cu_seqlens[b + 1] - p.cu_seqlens[b] : (p.lengths ? p.lengths[b] : p.Tq);
  const int Lk = p.cu_seqlens ? Lq : (p.lengths ? p.lengths[b] : p.Tk);
  const int rows_out = p.cu_seqlens ? Lq : p.Tq;
  const int first = blockIdx.x * kBr;
  if (first >= rows_out) return;  // the same for every thread of the block: no barrier is skipped
  const int i = first + tid;      // this thread's query row
  const bool active = i < Lq;     // a real query (padded rows only write zeros)

  const T* q = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1] + row0 * p.q_stride[2];
  const T* k = static_cast<const T*>(p.k) + b * p.k_stride[0] + h * p.k_stride[1] + row0 * p.k_stride[2];
  const T* v = static_cast<const T*>(p.v) + b * p.v_stride[0] + h * p.v_stride[1] + row0 * p.v_stride[2];
  T* o = static_cast<T*>(p.o) + b * p.o_stride[0] + h * p.o_stride[1] + row0 * p.o_stride[2];

  // 2 * kBc * kD * 4 bytes: 32 KiB at kD = 128, under the 48 KiB of static shared memory every
  // GPU since sm_30 gives a block (a T4 has 64 KiB per SM: two such blocks cannot share one SM).
  // Every thread reads the same Ks[j][d] at once: a broadcast, no bank conflicts.
  __shared__ float Ks[kBc][kD];
  __shared__ float Vs[kBc][kD];

  float qr[kD], acc[kD];
  for (int d = 0; d < kD; ++d) {
    qr[d] = (active && d < p.D) ? to_float(q[i * p.q_stride[2] + d]) * p.scale_log2e : 0.f;
    acc[d] = 0.f;
  }
  // the bias of head h: ALiBi's slope, or the table row centred on j - i = 0 (in log2 units)
  const float alibi = p.bias_kind == 1 ? -p.bias[h] * kLog2eF : 0.f;
  const float* table = p.bias_kind == 2 ? p.bias + int64_t(h) * (2 * int64_t(p.bias_R) + 1) + p.bias_R : nullptr;
  float m = -INFINITY;  // running max of this row's scores (log2 units)
  float l = 0.f;        // running sum of exp2(s - m)

  int kv_end = first < Lq ? Lk : 0;  // a tile of only padded rows reads no keys
  if (p.causal) kv_end = min(kv_end, first + kBr);  // keys past the tile's last query are masked
  if (p.win_right >= 0) kv_end = min(kv_end, first + kBr + p.win_right);  // ... or past its last query's window
  const int kv_begin = p.win_left >= 0 ? max(0, first - p.win_left) : 0;  // keys before its first query's window
  for (int j0 = kv_begin / kBc * kBc; j0 < kv_end; j0 += kBc) {
    // Load K and V tiles: consecutive threads read consecutive d (coalesced); zeros past Lk and D.
    for (int idx = tid; idx < kBc * kD; idx += kBr) {
      const int jj = idx / kD, d = idx % kD, j = j0 + jj;
      const bool ok = j < Lk && d < p.D;
      Ks[jj][d] = ok ? to_float(k[j * p.k_stride[2] + d]) : 0.f;
      Vs[jj][d] = ok ? to_float(v[j * p.v_stride[2] + d]) : 0.f;
    }
    __syncthreads();  // the tile is complete before anyone reads it
    if (active) {
      float s[kBc];  // S = Q K^T for this row and tile
      float m_tile = -INFINITY;
      for (int jj = 0; jj < kBc; ++jj) {
        const int j = j0 + jj;
        float dot = 0.f;
        for (int d = 0; d < kD; ++d) dot += qr[d] * Ks[jj][d];
        const bool in_window = (p.win_left < 0 || j >= i - p.win_left) && (p.win_right < 0 || j <= i + p.win_right);
        if (p.bias_kind == 1) dot += alibi * fabsf(float(j - i));
        else if (p.bias_kind == 2) dot += table[min(max(j - i, -p.bias_R), p.bias_R)] * kLog2eF;
        s[jj] = (j < Lk && (!p.causal || j <= i) && in_window) ? dot : -INFINITY;
        m_tile = fmaxf(m_tile, s[jj]);
      }
      const float m_new = fmaxf(m, m_tile);
      if (m_new != -INFINITY) {  // else no allowed key yet: nothing to add, l and O stay 0
        const float alpha = exp2f(m - m_new);  // rescale l and O to the new max (0 when m = -inf)
        l *= alpha;
        for (int d = 0; d < kD; ++d) acc[d] *= alpha;
        for (int jj = 0; jj < kBc; ++jj) {
          const float pj = exp2f(s[jj] - m_new);  // P = exp(S - m); masked keys give exp2(-inf) = 0
          l += pj;
          for (int d = 0; d < kD; ++d) acc[d] += pj * Vs[jj][d];  // O += P V
        }
        m = m_new;
      }
    }
    __syncthreads();  // everyone is done with the tile before the next load overwrites it
  }
  if (i < rows_out) {
    const float inv_l = (active && l > 0.f) ? 1.f / l : 0.f;  // O = diag(l)^-1 O; no key or padded row -> 0
    for (int d = 0; d < p.D && d < kD; ++d) o[i * p.o_stride[2] + d] = from_float<T>(acc[d] * inv_l);
  }
}

}  // namespace btlib_cuda
