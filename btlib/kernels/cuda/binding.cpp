// btlib CUDA attention: the thin torch binding of flash_attention_forward (flash_attn.cu).
// Checks every input at the boundary with a message that says what to fix, fills Params, launches
// on torch's current stream and turns a CUDA launch error into a Python RuntimeError.
// Built by build.py with torch.utils.cpp_extension on machines with a CUDA torch and toolkit.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <torch/types.h>

#include <optional>
#include <string>

#include "flash_attn.h"

namespace {

constexpr double kLog2e = 1.4426950408889634;  // exp(x) = exp2(x * log2 e): folded into the scale once

using btlib_cuda::DType;
using btlib_cuda::Params;

DType dtype_of(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "btlib CUDA attention: q, k, v must be float16, bfloat16 or float32; got ", x.scalar_type());
  }
  return DType::kFloat32;  // unreachable
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t rank) {
  const char* shape = rank == 4 ? "(B, H, T, D)" : "(total, H, D)";
  for (const at::Tensor* x : {&q, &k, &v}) {
    TORCH_CHECK(x->is_cuda(), "btlib CUDA attention: inputs must be CUDA tensors; got ", x->device(),
                ". Move them with .cuda(), or use btlib.attention(backend='auto') on the CPU");
    TORCH_CHECK(x->dim() == rank, "btlib CUDA attention: expected q, k, v of shape ", shape, "; got ", x->sizes());
    TORCH_CHECK(x->numel() == 0 || x->stride(-1) == 1, "btlib CUDA attention: head_dim must be contiguous (stride 1); call .contiguous()");
    TORCH_CHECK(x->device() == q.device(), "btlib CUDA attention: q, k, v must be on one device; got ", q.device(), " and ", x->device());
  }
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "btlib CUDA attention: q, k, v must share one dtype; got ", q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(k.sizes() == v.sizes(), "btlib CUDA attention: k and v must have one shape; got ", k.sizes(), " and ", v.sizes());
  const int64_t D = q.size(-1);
  TORCH_CHECK(D >= 1 && D <= btlib_cuda::kMaxHeadDim, "btlib CUDA attention: head_dim must be in [1, ", btlib_cuda::kMaxHeadDim,
              "]; got ", D, ". Use btlib.attention(backend='auto') for larger heads");
  TORCH_CHECK(k.size(-1) == D, "btlib CUDA attention: q and k must have one head_dim; got ", D, " and ", k.size(-1));
}

void fill_strides(int64_t* s, const at::Tensor& x, bool varlen) {
  if (varlen) {
    s[0] = 0, s[1] = x.stride(1), s[2] = x.stride(0);  // (total, H, D): sequence b starts at row cu_seqlens[b]
  } else {
    s[0] = x.stride(0), s[1] = x.stride(1), s[2] = x.stride(2);
  }
}

at::Tensor run(Params& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool varlen) {
  at::Tensor o = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr(), p.o = o.data_ptr();
  fill_strides(p.q_stride, q, varlen), fill_strides(p.k_stride, k, varlen);
  fill_strides(p.v_stride, v, varlen), fill_strides(p.o_stride, o, varlen);
  p.D = static_cast<int>(q.size(-1));
  TORCH_CHECK(p.B <= 65535 && p.H <= 65535, "btlib CUDA attention: at most 65535 sequences and heads (grid limits); got B=", p.B, ", H=", p.H);
  if (o.numel() == 0) return o;
  const char* err = btlib_cuda::flash_attention_forward(p, dtype_of(q), c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  TORCH_CHECK(err == nullptr, "btlib CUDA attention: kernel launch failed: ", err ? err : "",
              ". If it says 'no kernel image', the extension was built for another GPU: clear its build directory "
              "(btlib.kernels.cuda.build.build_directory()) and rebuild");
  return o;
}

// The window's reaches, checked; a reach >= T (past every key) is the same as none: stored as -1.
void set_window(Params& p, int64_t left, int64_t right, int64_t T) {
  TORCH_CHECK(left >= -1 && right >= -1, "btlib CUDA attention: window_left and window_right must be >= 0, or -1 for no limit "
              "on that side; got ", left, " and ", right);
  p.win_left = left >= T ? -1 : static_cast<int>(left);
  p.win_right = right >= T ? -1 : static_cast<int>(right);
}

// The position bias, checked (shapes, dtype, device; its values are checked finite by btlib.PositionBias when
// built, not here: that would sync): kind 0 none, 1 ALiBi (H,) slopes, 2 table (H, 2R + 1). The returned tensor
// must outlive the launch (p.bias points into it).
at::Tensor set_bias(Params& p, const at::Tensor& q, const std::optional<at::Tensor>& bias, int64_t kind, int64_t R) {
  TORCH_CHECK(kind >= 0 && kind <= 2, "btlib CUDA attention: bias_kind must be 0 (none), 1 (ALiBi) or 2 (table); got ", kind);
  TORCH_CHECK((kind == 0) == !bias.has_value(), "btlib CUDA attention: pass a bias tensor exactly when bias_kind is 1 or 2 "
              "(btlib.PositionBias.kernel_args() gives the three arguments)");
  if (kind == 0) return at::Tensor();
  const at::Tensor& b = *bias;
  TORCH_CHECK(b.device() == q.device() && b.scalar_type() == at::kFloat, "btlib CUDA attention: the position bias must be a "
              "float32 tensor on q's device (", q.device(), "); got ", b.scalar_type(), " on ", b.device());
  const int64_t H = q.size(1);
  if (kind == 1) {
    TORCH_CHECK(b.dim() == 1 && b.size(0) == H, "btlib CUDA attention: ALiBi slopes must be (H,) = (", H, ",); got ", b.sizes());
  } else {
    TORCH_CHECK(R >= 0 && R <= (int64_t(1) << 30), "btlib CUDA attention: bias_max_distance must be in [0, 2^30]; got ", R);
    TORCH_CHECK(b.dim() == 2 && b.size(0) == H && b.size(1) == 2 * R + 1, "btlib CUDA attention: the bias table must be "
                "(H, 2 * bias_max_distance + 1) = (", H, ", ", 2 * R + 1, "); got ", b.sizes());
  }
  at::Tensor c = b.contiguous();
  p.bias = c.data_ptr<float>(), p.bias_kind = static_cast<int>(kind), p.bias_R = kind == 2 ? static_cast<int>(R) : 0;
  return c;
}

at::Tensor attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& lengths,
                         bool causal, double scale, int64_t window_left, int64_t window_right, const std::optional<at::Tensor>& bias,
                         int64_t bias_kind, int64_t bias_max_distance) {
  check_qkv(q, k, v, 4);
  const c10::cuda::CUDAGuard guard(q.device());
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) == q.size(1), "btlib CUDA attention: k must be (B, H, S, D) with q's B and H; got q ",
              q.sizes(), ", k ", k.sizes());
  Params p;
  p.B = static_cast<int>(q.size(0)), p.H = static_cast<int>(q.size(1));
  p.Tq = static_cast<int>(q.size(2)), p.Tk = static_cast<int>(k.size(2));
  p.causal = causal;
  p.scale_log2e = static_cast<float>(scale * kLog2e);
  set_window(p, window_left, window_right, std::max(p.Tq, p.Tk));
  const at::Tensor bias_c = set_bias(p, q, bias, bias_kind, bias_max_distance);
  at::Tensor len;
  if (lengths.has_value()) {
    TORCH_CHECK(lengths->dim() == 1 && lengths->size(0) == q.size(0), "btlib CUDA attention: lengths must be (B,) = (", q.size(0),
                ",); got ", lengths->sizes());
    TORCH_CHECK(!at::isFloatingType(lengths->scalar_type()) && lengths->scalar_type() != at::kBool,
                "btlib CUDA attention: lengths must be an integer tensor; got ", lengths->scalar_type());
    len = lengths->to(q.device(), at::kInt).contiguous();
    if (len.numel() > 0) {
      const int64_t lo = len.min().item<int64_t>(), hi = len.max().item<int64_t>();  // one sync: checks beat silent garbage
      TORCH_CHECK(lo >= 0 && hi <= std::min(p.Tq, p.Tk), "btlib CUDA attention: lengths must lie in [0, ", std::min(p.Tq, p.Tk),
                  "] (the padded length); got [", lo, ", ", hi, "]");
    }
    p.lengths = len.data_ptr<int32_t>();
  }
  return run(p, q, k, v, false);
}

at::Tensor varlen_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens, int64_t max_seqlen,
                      bool causal, double scale, int64_t window_left, int64_t window_right, const std::optional<at::Tensor>& bias,
                      int64_t bias_kind, int64_t bias_max_distance) {
  check_qkv(q, k, v, 3);
  const c10::cuda::CUDAGuard guard(q.device());
  TORCH_CHECK(k.sizes() == q.sizes(), "btlib CUDA varlen attention: q, k, v must have one shape (total, H, D); got ", q.sizes(), " and ",
              k.sizes());
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt && cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1,
              "btlib CUDA varlen attention: cu_seqlens must be a 1-D int32 tensor of B + 1 offsets; got ", cu_seqlens.scalar_type(), " ",
              cu_seqlens.sizes(), ". Use btlib.lengths_to_cu_seqlens(lengths)");
  TORCH_CHECK(cu_seqlens.device() == q.device(), "btlib CUDA varlen attention: cu_seqlens must be on q's device (", q.device(), "); got ",
              cu_seqlens.device());
  TORCH_CHECK(max_seqlen >= 0 && max_seqlen <= INT32_MAX, "btlib CUDA varlen attention: max_seqlen must be in [0, 2^31); got ", max_seqlen);
  // cu_seqlens' values are trusted here: btlib.varlen_attention (and PackedEncoder, once per forward)
  // checks them on the host. Reading them back here would copy them to the host and sync the
  // stream on every call, i.e. on every layer. The grid is sized by max_seqlen, which is why the
  // GPU kernels need it: they never see the lengths on the host.
  const at::Tensor cu = cu_seqlens.contiguous();
  const int64_t B = cu.numel() - 1;
  Params p;
  p.B = static_cast<int>(B), p.H = static_cast<int>(q.size(1));
  p.Tq = p.Tk = static_cast<int>(max_seqlen);
  p.cu_seqlens = cu.data_ptr<int32_t>();
  p.causal = causal;
  p.scale_log2e = static_cast<float>(scale * kLog2e);
  set_window(p, window_left, window_right, max_seqlen);
  const at::Tensor bias_c = set_bias(p, q, bias, bias_kind, bias_max_distance);
  return run(p, q, k, v, true);
}

std::string build_info() {
  return "Br=" + std::to_string(btlib_cuda::kBr) + " Bc=" + std::to_string(btlib_cuda::kBc) +
         " max_head_dim=" + std::to_string(btlib_cuda::kMaxHeadDim);
}

}  // namespace

TORCH_LIBRARY(btlib_cuda, m) {
  m.def("attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? lengths, bool causal, float scale, int window_left=-1, "
        "int window_right=-1, Tensor? bias=None, int bias_kind=0, int bias_max_distance=0) -> Tensor", &attention_fwd);
  m.def("varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, int max_seqlen, bool causal, float scale, "
        "int window_left=-1, int window_right=-1, Tensor? bias=None, int bias_kind=0, int bias_max_distance=0) -> Tensor",
        &varlen_fwd);
  m.def("build_info() -> str", &build_info);
}
