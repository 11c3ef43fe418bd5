/*
 * btlib CPU attention's torch binding, shared by the kernel folders (flash/flash.cpp, teaching/teaching.cpp): the
 * checks of every op's arguments (with messages) and the Problem they fill, around torch-free kernels.
 *
 * Each op is declared once, in btlib/kernels/cpu/schema.py (OPS): build.py defines its schema, its fake (meta)
 * kernel and an Autograd fallthrough from Python before it loads the library, and each folder's .cpp adds only the
 * CPU kernel of its ops (TORCH_LIBRARY_IMPL; not a catch-all kernel: that would be CompositeImplicitAutograd, which
 * torch.compile "decomposes" by running it on fake tensors, and which takes no fake kernel). So
 * torch.library.opcheck passes and torch.compile(fullgraph=True) traces them. No backward: the fallthrough sends
 * autograd on to the CPU kernel and the output is detached from q, k, v, as the registry documents.
 *
 * Masks: key padding by `lengths` (keys j >= L ignored, query rows t >= L output 0), causal
 * (key j <= query i, top-left aligned) and, v3 and varlen only, a local window (window_left,
 * window_right): key j allowed iff i - window_left <= j <= i + window_right, -1 = unbounded.
 * A query row with no key to attend outputs 0; a NaN or +inf among its scores makes it NaN, as
 * in the reference.
 * Position bias, v3 and varlen only (btlib/position_bias.py): bias_kind 1 ALiBi, bias (H,) slopes,
 * scores += -slope_h |j - i|; bias_kind 2 a table, bias (H, 2R + 1), R = bias_max_distance, scores +=
 * bias[h, clamp(j - i, -R, R) + R]; float32, finite, on the CPU. Computed per score in the tile loop.
 * Threads: at::parallel_for, torch's intra-op pool (honours torch.set_num_threads). With torch's
 * OpenMP backend its body is an OpenMP region compiled into each .cpp, hence -fopenmp (build.py).
 */
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "core.h"

#ifndef BTLIB_OPS_NS
#define BTLIB_OPS_NS btlib_cpu
#endif
#define BTLIB_STR2(x) #x
#define BTLIB_STR(x) BTLIB_STR2(x)
#define BTLIB_TORCH_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)  // expands BTLIB_OPS_NS before the macro pastes it
#define BTLIB_TORCH_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

namespace btlib_binding {

using namespace btlib_core;
static_assert(sizeof(bf16) == sizeof(at::BFloat16), "bf16 must have at::BFloat16's bits");

// core.h's thread-pool hook on torch's pool: one item per worker, each pulls tasks itself.
struct TorchParallelFor {
  template <typename F> void operator()(int64_t n, F&& f) const { at::parallel_for(0, n, 1, f); }
};

inline int threads() { return at::get_num_threads(); }

// ---------------------------------------------------------------------------------------------
// Bindings: checks with messages, then a Problem. btlib's Python wrappers check first too;
// these checks guard direct calls of torch.ops.btlib_cpu_<isa>.*.
// ---------------------------------------------------------------------------------------------
inline void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t rank, bool allow_bf16) {
  for (const at::Tensor* x : {&q, &k, &v}) {
    TORCH_CHECK(x->device().is_cpu(), "btlib CPU attention: inputs must be CPU tensors; got ", x->device());
    TORCH_CHECK(x->dim() == rank, "btlib CPU attention: expected ", rank == 4 ? "(B, H, T, D)" : "(total, H, D)",
                " inputs; got ", x->sizes());
    TORCH_CHECK(x->scalar_type() == at::kFloat || (allow_bf16 && x->scalar_type() == at::kBFloat16),
                "btlib CPU attention: dtype must be float32", allow_bf16 ? " or bfloat16" : "", "; got ", x->scalar_type());
    TORCH_CHECK(x->numel() == 0 || x->stride(-1) == 1, "btlib CPU attention: head_dim must be contiguous (stride 1); call .contiguous()");
  }
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "btlib CPU attention: q, k, v must share one dtype");
  TORCH_CHECK(k.sizes() == v.sizes(), "btlib CPU attention: k and v must have one shape; got ", k.sizes(), " and ", v.sizes());
  const int64_t D = q.size(-1);
  TORCH_CHECK(D >= 1 && D <= kMaxD, "btlib CPU attention: head_dim must be in [1, ", kMaxD, "]; got ", D);
  TORCH_CHECK(k.size(-1) == D, "btlib CPU attention: q and k must have one head_dim; got ", D, " and ", k.size(-1));
}

// The window's two reaches, checked; a reach that spans every key (>= T - 1: row T - 1 reaches key 0,
// row 0 key T - 1) is the same as none and is stored as -1, so such a window runs the kernel of no
// window, bit for bit, and i + right + 1 cannot overflow.
inline void set_window(Problem& p, int64_t left, int64_t right, int64_t T) {
  TORCH_CHECK(left >= -1 && right >= -1, "btlib CPU attention: window_left and window_right must be >= 0, or -1 for no "
              "limit on that side; got ", left, " and ", right);
  p.win_left = left >= T - 1 ? -1 : left;
  p.win_right = right >= T - 1 ? -1 : right;
}

// The position bias, checked: kind 0 none; 1 ALiBi, bias (H,) slopes; 2 table, bias (H, 2R + 1). The
// returned tensor must outlive the call (p.bias points into it).
inline at::Tensor set_bias(Problem& p, const std::optional<at::Tensor>& bias, int64_t kind, int64_t R) {
  TORCH_CHECK(kind >= kBiasNone && kind <= kBiasTable, "btlib CPU attention: bias_kind must be 0 (none), 1 (ALiBi) or 2 "
              "(table); got ", kind);
  TORCH_CHECK((kind == kBiasNone) == !bias.has_value(), "btlib CPU attention: pass a bias tensor exactly when bias_kind is "
              "1 or 2 (btlib.PositionBias.kernel_args() gives the three arguments)");
  if (kind == kBiasNone) return at::Tensor();
  const at::Tensor& b = *bias;
  TORCH_CHECK(b.device().is_cpu() && b.scalar_type() == at::kFloat, "btlib CPU attention: the position bias must be a float32 "
              "CPU tensor; got ", b.scalar_type(), " on ", b.device());
  if (kind == kBiasAlibi) {
    TORCH_CHECK(b.dim() == 1 && b.size(0) == p.H, "btlib CPU attention: ALiBi slopes must be (H,) = (", p.H, ",); got ", b.sizes());
  } else {
    TORCH_CHECK(R >= 0 && R <= (int64_t(1) << 30), "btlib CPU attention: bias_max_distance must be in [0, 2^30]; got ", R);
    TORCH_CHECK(b.dim() == 2 && b.size(0) == p.H && b.size(1) == 2 * R + 1, "btlib CPU attention: the bias table must be "
                "(H, 2 * bias_max_distance + 1) = (", p.H, ", ", 2 * R + 1, "); got ", b.sizes());
  }
  TORCH_CHECK(at::isfinite(b).all().item<bool>(), "btlib CPU attention: the position bias holds NaN or inf; pass finite values");
  at::Tensor c = b.contiguous();
  p.bias_kind = int(kind), p.bias = c.data_ptr<float>(), p.bias_R = kind == kBiasTable ? R : 0;
  return c;
}

template <typename F>
at::Tensor padded(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& lengths,
                  bool causal, double scale, int64_t window_left, int64_t window_right, bool allow_bf16, F&& kernel,
                  const std::optional<at::Tensor>& bias = std::nullopt, int64_t bias_kind = 0, int64_t bias_R = 0) {
  check_qkv(q, k, v, 4, allow_bf16);
  Problem p;
  p.B = q.size(0), p.H = q.size(1), p.Tq = q.size(2), p.D = q.size(3), p.Tk = k.size(2);
  TORCH_CHECK(k.size(0) == p.B && k.size(1) == p.H, "btlib CPU attention: k must be (B, H, S, D) with q's B and H; got ", k.sizes());
  at::Tensor len;
  if (lengths.has_value()) {
    len = lengths->to(at::kLong).contiguous();
    TORCH_CHECK(len.dim() == 1 && len.size(0) == p.B, "btlib CPU attention: lengths must be (B,) = (", p.B, ",); got ", len.sizes());
    if (p.B > 0) {
      const int64_t lo = len.min().item<int64_t>(), hi = len.max().item<int64_t>();
      TORCH_CHECK(lo >= 0 && hi <= std::min(p.Tq, p.Tk), "btlib CPU attention: lengths must lie in [0, ",
                  std::min(p.Tq, p.Tk), "] (the padded length); got [", lo, ", ", hi, "]");
    }
    p.lengths = len.data_ptr<int64_t>();
  }
  p.causal = causal;
  p.scale = float(scale);
  set_window(p, window_left, window_right, std::max(p.Tq, p.Tk));
  const at::Tensor bias_c = set_bias(p, bias, bias_kind, bias_R);
  at::Tensor o = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  for (int i = 0; i < 3; ++i) p.qs[i] = q.stride(i), p.ks[i] = k.stride(i), p.vs[i] = v.stride(i), p.os[i] = o.stride(i);
  if (q.numel() > 0) kernel(p, q, k, v, o);
  return o;
}

}  // namespace btlib_binding
