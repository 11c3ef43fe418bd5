/*
 * btlib CPU attention, forward only:  O = softmax(Q K^T * scale + mask) V,  fp32 accumulation.
 * FlashAttention v3 (ops attention_v3, varlen_v3, varlen_amx): this file is the torch binding; the kernels are
 * torch-free headers (core_check.cpp builds them alone, for every ISA and for aarch64 under qemu). Shared checks,
 * masks and position bias: ../binding.h; the teaching versions v1, v2: ../teaching/.
 *   flash.h     v3 flash: one pass, online softmax, register-blocked SIMD micro-kernels (vec.h:
 *               AVX-512, AVX2, NEON or portable; flash_tiles.h, flash_bf16dot.h). 4 T^2 D flops;
 *               with a local window (left, right) only the key tiles meeting each query block's
 *               band: about 4 T D (Br + left + right) flops, rounded up to whole Bc tiles.
 *               varlen is v3 on packed tokens + cu_seqlens: no work on padding.
 *   flash_amx.h v3 with Q K^T and P V on AMX tiles (bf16, tdpbf16ps), op varlen_amx: the same blocks, softmax,
 *               masks, window and bias; built into the avx512bf16 library (-mamx-tile -mamx-bf16), run only
 *               where amx_status() is "" (AMX-BF16 in cpuid and the tile state granted by Linux).
 *   ../core.h   Problem, bf16, Br / Bc, and the thread-pool hook; ../vec.h the vector type of each ISA.
 */
#include <string>

#include "binding.h"
#include "flash.h"
#include "flash_amx.h"

namespace {

using namespace btlib_binding;

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

// The ops' schemas come from btlib/kernels/cpu/schema.py (see ../binding.h); this file adds their CPU kernels.
BTLIB_TORCH_LIBRARY_FRAGMENT(BTLIB_OPS_NS, m) {
  // build_info and amx_status take and return no tensor: catch-all kernels, never in a graph
  m.def("build_info() -> str", &build_info);
  m.def("amx_status() -> str", [] { return amx_status(); });  // "" when varlen_amx can run, else why not
}

BTLIB_TORCH_LIBRARY_IMPL(BTLIB_OPS_NS, CPU, m) {
  m.impl("attention_v3", &v3_op);
  m.impl("varlen_v3", &varlen_op);
  m.impl("varlen_amx", &varlen_amx_op);
}
