/*
 * btlib CPU attention, the teaching versions v1 and v2 (ops attention_v1, attention_v2): the torch binding of
 * teaching.h (torch-free; core_check.cpp builds it alone). Shared checks, masks: ../binding.h.
 *   teaching.h  v1 materialise: S = Q K^T for the whole sequence, softmax, O = P V. 4 T^2 D
 *               flops; S costs 4 T^2 bytes per (b, h) (4 MB at T = 1024), out of L2.
 *               v2 tiled: Br x Bc tiles, no T x T buffer; without the online softmax it needs two
 *               passes over K (row max, then exp-sum and P V): 6 T^2 D flops.
 */
#include "binding.h"
#include "teaching.h"

namespace {

using namespace btlib_binding;

at::Tensor v1_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& lengths, bool causal, double scale) {
  return padded(q, k, v, lengths, causal, scale, -1, -1, false, [](const Problem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& o) {
    attention_v1(p, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), o.data_ptr<float>(), threads(), TorchParallelFor{});
  });
}

at::Tensor v2_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& lengths, bool causal, double scale) {
  return padded(q, k, v, lengths, causal, scale, -1, -1, false, [](const Problem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& o) {
    attention_v2(p, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), o.data_ptr<float>(), threads(), TorchParallelFor{});
  });
}

}  // namespace

// The ops' schemas come from btlib/kernels/cpu/schema.py (see ../binding.h); this file adds their CPU kernels.
BTLIB_TORCH_LIBRARY_IMPL(BTLIB_OPS_NS, CPU, m) {
  m.impl("attention_v1", &v1_op);
  m.impl("attention_v2", &v2_op);
}
