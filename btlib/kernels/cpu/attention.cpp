/*
 * btlib CPU attention, forward only:  O = softmax(Q K^T * scale + mask) V,  fp32 accumulation.
 * This file is the torch binding; the kernels are torch-free headers (core_check.cpp builds them
 * alone, for every ISA and for aarch64 under qemu):
 *   teaching.h  v1 materialise: S = Q K^T for the whole sequence, softmax, O = P V. 4 T^2 D
 *               flops; S costs 4 T^2 bytes per (b, h) (4 MB at T = 1024), out of L2.
 *               v2 tiled: Br x Bc tiles, no T x T buffer; without the online softmax it needs two
 *               passes over K (row max, then exp-sum and P V): 6 T^2 D flops.
 *   flash.h     v3 flash: one pass, online softmax, register-blocked SIMD micro-kernels (vec.h:
 *               AVX-512, AVX2, NEON or portable; flash_tiles.h, flash_bf16dot.h). 4 T^2 D flops;
 *               with a local window (left, right) only the key tiles meeting each query block's
 *               band: about 4 T D (Br + left + right) flops, rounded up to whole Bc tiles.
 *               varlen is v3 on packed tokens + cu_seqlens: no work on padding.
 *   flash_amx.h v3 with Q K^T and P V on AMX tiles (bf16, tdpbf16ps), op varlen_amx: the same blocks, softmax,
 *               masks, window and bias; built into the avx512bf16 library (-mamx-tile -mamx-bf16), run only
 *               where amx_status() is "" (AMX-BF16 in cpuid and the tile state granted by Linux).
 *   core.h      Problem, bf16, Br / Bc, and the thread-pool hook.
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
 * OpenMP backend its body is an OpenMP region compiled into this file, hence -fopenmp (build.py).
 */
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>

#include "flash.h"
#include "flash_amx.h"
#include "teaching.h"

#ifndef BTLIB_OPS_NS
#define BTLIB_OPS_NS btlib_cpu
#endif
#define BTLIB_STR2(x) #x
#define BTLIB_STR(x) BTLIB_STR2(x)
#define BTLIB_TORCH_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)  // expands BTLIB_OPS_NS before the macro pastes it
#define BTLIB_TORCH_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

using namespace btlib_core;
static_assert(sizeof(bf16) == sizeof(at::BFloat16), "bf16 must have at::BFloat16's bits");

namespace {

// core.h's thread-pool hook on torch's pool: one item per worker, each pulls tasks itself.
struct TorchParallelFor {
  template <typename F> void operator()(int64_t n, F&& f) const { at::parallel_for(0, n, 1, f); }
};

int threads() { return at::get_num_threads(); }

// ---------------------------------------------------------------------------------------------
// Bindings: checks with messages, then a Problem. btlib's Python wrappers check first too;
// these checks guard direct calls of torch.ops.btlib_cpu_<isa>.*.
// ---------------------------------------------------------------------------------------------
void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t rank, bool allow_bf16) {
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

// The window's two reaches, checked; a reach past every key (>= T) is the same as none and is
// stored as -1, which also keeps i + right + 1 from overflowing.
void set_window(Problem& p, int64_t left, int64_t right, int64_t T) {
  TORCH_CHECK(left >= -1 && right >= -1, "btlib CPU attention: window_left and window_right must be >= 0, or -1 for no "
              "limit on that side; got ", left, " and ", right);
  p.win_left = left >= T ? -1 : left;
  p.win_right = right >= T ? -1 : right;
}

// The position bias, checked: kind 0 none; 1 ALiBi, bias (H,) slopes; 2 table, bias (H, 2R + 1). The
// returned tensor must outlive the call (p.bias points into it).
at::Tensor set_bias(Problem& p, const std::optional<at::Tensor>& bias, int64_t kind, int64_t R) {
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

void run_v3(const Problem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& o) {
  auto as_bf16 = [](const at::Tensor& x) { return reinterpret_cast<bf16*>(x.data_ptr<at::BFloat16>()); };
  if (q.scalar_type() == at::kBFloat16)
    attention_v3(p, as_bf16(q), as_bf16(k), as_bf16(v), as_bf16(o), threads(), TorchParallelFor{});
  else
    attention_v3(p, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), o.data_ptr<float>(), threads(), TorchParallelFor{});
}

at::Tensor v3_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& lengths, bool causal, double scale,
                 int64_t window_left, int64_t window_right, const std::optional<at::Tensor>& bias, int64_t bias_kind,
                 int64_t bias_max_distance) {
  return padded(q, k, v, lengths, causal, scale, window_left, window_right, true, run_v3, bias, bias_kind, bias_max_distance);
}

template <typename F>
at::Tensor varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens, int64_t max_seqlen,
                  bool causal, double scale, int64_t window_left, int64_t window_right, const std::optional<at::Tensor>& bias,
                  int64_t bias_kind, int64_t bias_max_distance, F&& kernel) {
  check_qkv(q, k, v, 3, true);
  TORCH_CHECK(k.sizes() == q.sizes(), "btlib CPU varlen attention: q, k, v must have one shape (total, H, D); got ", q.sizes(), " and ", k.sizes());
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt && cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1,
              "btlib CPU varlen attention: cu_seqlens must be a 1-D int32 tensor of B + 1 offsets; got ", cu_seqlens.scalar_type(), " ", cu_seqlens.sizes());
  const at::Tensor cu = cu_seqlens.contiguous();
  const int32_t* c = cu.data_ptr<int32_t>();
  const int64_t B = cu.numel() - 1;
  TORCH_CHECK(c[0] == 0, "btlib CPU varlen attention: cu_seqlens must start at 0; got ", c[0]);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(c[b + 1] >= c[b], "btlib CPU varlen attention: cu_seqlens must be non-decreasing; got ", c[b], " then ", c[b + 1], " at index ", b);
    TORCH_CHECK(c[b + 1] - c[b] <= max_seqlen, "btlib CPU varlen attention: sequence ", b, " has length ", c[b + 1] - c[b], " > max_seqlen ", max_seqlen);
  }
  TORCH_CHECK(c[B] == q.size(0), "btlib CPU varlen attention: cu_seqlens[-1] = ", c[B], " must equal the number of tokens ", q.size(0));
  Problem p;
  p.B = B, p.H = q.size(1), p.D = q.size(2), p.Tq = p.Tk = max_seqlen;
  p.cu_seqlens = c;
  p.causal = causal;
  p.scale = float(scale);
  set_window(p, window_left, window_right, max_seqlen);
  const at::Tensor bias_c = set_bias(p, bias, bias_kind, bias_max_distance);
  at::Tensor o = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  auto strides = [](const at::Tensor& x, int64_t* s) { s[0] = 0, s[1] = x.stride(1), s[2] = x.stride(0); };
  strides(q, p.qs), strides(k, p.ks), strides(v, p.vs), strides(o, p.os);  // sequence b starts at token cu_seqlens[b]
  if (q.numel() > 0) kernel(p, q, k, v, o);
  return o;
}

at::Tensor varlen_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens, int64_t max_seqlen,
                     bool causal, double scale, int64_t window_left, int64_t window_right, const std::optional<at::Tensor>& bias,
                     int64_t bias_kind, int64_t bias_max_distance) {
  return varlen(q, k, v, cu_seqlens, max_seqlen, causal, scale, window_left, window_right, bias, bias_kind, bias_max_distance, run_v3);
}

// varlen_v3 with its products on AMX tiles (flash_amx.h), only where amx_status() is "": bfloat16, or float32 in and
// out with bf16 products.
at::Tensor varlen_amx_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                         int64_t max_seqlen, bool causal, double scale, int64_t window_left, int64_t window_right,
                         const std::optional<at::Tensor>& bias, int64_t bias_kind, int64_t bias_max_distance) {
  TORCH_CHECK(amx_status().empty(), "btlib CPU AMX attention cannot run here: ", amx_status(), "; use varlen_v3");
  // float32 in and out is bf16 inside: q, k, v rounded to bf16 while packing (no separate pass), sums fp32; the
  // error is bf16's, not fp32's, so btlib's registry offers this op for bf16 inputs only.
  return varlen(q, k, v, cu_seqlens, max_seqlen, causal, scale, window_left, window_right, bias, bias_kind, bias_max_distance,
                [](const Problem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& o) {
#if defined(BTLIB_AMX)
    auto as_bf16 = [](const at::Tensor& x) { return reinterpret_cast<bf16*>(x.data_ptr<at::BFloat16>()); };
    if (q.scalar_type() == at::kBFloat16)
      attention_amx(p, as_bf16(q), as_bf16(k), as_bf16(v), as_bf16(o), threads(), TorchParallelFor{});
    else
      attention_amx(p, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), o.data_ptr<float>(), threads(),
                    TorchParallelFor{});
#endif
  });
}

// e.g. "avx512+bf16dot W=16 kR=6 kNV=4 Br=64 Bc=64 max_head_dim=256 threads=at::parallel_for/openmp ops=btlib_cpu_avx512bf16"
std::string build_info() {
#if defined(INTRA_OP_PARALLEL) && AT_PARALLEL_OPENMP
  const char* pool = "at::parallel_for/openmp";
#elif defined(INTRA_OP_PARALLEL)
  const char* pool = "at::parallel_for/native";
#else
  const char* pool = "serial (torch uses OpenMP but this build has no -fopenmp)";
#endif
  return std::string(kIsa) + (kBf16Dot ? "+bf16dot" : "") + (kAmx ? "+amx" : "") + " W=" + std::to_string(W) + " kR=" + std::to_string(kR) +
         " kNV=" + std::to_string(kNV) + " Br=" + std::to_string(Br) + " Bc=" + std::to_string(Bc) +
         " max_head_dim=" + std::to_string(kMaxD) + " threads=" + pool + " ops=" BTLIB_STR(BTLIB_OPS_NS);
}

}  // namespace

// Each op is declared once, in btlib/kernels/cpu/schema.py (OPS): build.py defines its schema, its fake (meta) kernel
// and an Autograd fallthrough from Python before it loads this library, which adds only the CPU kernel of each
// (not a catch-all kernel: that would be CompositeImplicitAutograd, which torch.compile "decomposes" by running it
// on fake tensors, and which takes no fake kernel). So torch.library.opcheck passes and torch.compile(fullgraph=True)
// traces them. No backward: the fallthrough sends autograd on to this kernel and the output is detached from
// q, k, v, as the registry documents.
BTLIB_TORCH_LIBRARY_FRAGMENT(BTLIB_OPS_NS, m) {
  // build_info and amx_status take and return no tensor: catch-all kernels, never in a graph
  m.def("build_info() -> str", &build_info);
  m.def("amx_status() -> str", [] { return amx_status(); });  // "" when varlen_amx can run, else why not
}

BTLIB_TORCH_LIBRARY_IMPL(BTLIB_OPS_NS, CPU, m) {
  m.impl("attention_v1", &v1_op);
  m.impl("attention_v2", &v2_op);
  m.impl("attention_v3", &v3_op);
  m.impl("varlen_v3", &varlen_op);
  m.impl("varlen_amx", &varlen_amx_op);
}
