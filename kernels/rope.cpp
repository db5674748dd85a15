// Rotary position embedding (RoPE). For position t and frequency i < D/2 the pair
// (x[i], x[i + D/2]) of every head is rotated by the angle a = t·θ^(-2i/D):
//   y[i] = x[i]·cos a - x[i+D/2]·sin a,   y[i+D/2] = x[i+D/2]·cos a + x[i]·sin a.
// Pairing i with i + D/2 ("rotate half") matches GPT-NeoX and the Hugging Face LLaMA, so exported
// q/k projections load there unchanged. The backward is the transpose, a rotation by -a.
// cos/sin come from a table computed once in double precision, so the cpu and cuda kernels agree
// bit for bit on the angles.
#include <omp.h>

#include <cmath>

#include "kernels/common.hpp"
#include "kernels/cuda_ops.hpp"

namespace strata::kernels {
namespace {

// ---- cpu kernel ----

// x (B,T,H,D), tokens row_stride apart. inverse = rotate by -a (the backward).
Status rope_cpu(const KernelContext& ctx, TensorArg out, ConstTensorArg inp, const float* table,
                std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t D, std::int64_t row_stride,
                bool inverse) {
  const int threads = cpu_thread_count(ctx);
  const std::int64_t half = D / 2;
  const std::size_t stripe = scratch_stripe(H * D);
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch("rope", threads * stripe, 0));
  const float sign = inverse ? -1.0f : 1.0f;
#pragma omp parallel for num_threads(threads) schedule(static) if (B * T * H * D > 8192)
  for (std::int64_t bt = 0; bt < B * T; ++bt) {
    float* x = buf + omp_get_thread_num() * stripe;  // (H, D)
    const std::int64_t t = bt % T;
    const float* cs = table + t * half * 2;  // (D/2, 2) = (cos, sin)
    load_f32(inp, bt * row_stride, H * D, x);
    for (std::int64_t h = 0; h < H; ++h) {
      float* xh = x + h * D;
      for (std::int64_t i = 0; i < half; ++i) {
        const float c = cs[2 * i];
        const float s = sign * cs[2 * i + 1];
        const float x1 = xh[i];
        const float x2 = xh[i + half];
        xh[i] = x1 * c - x2 * s;
        xh[i + half] = x2 * c + x1 * s;
      }
    }
    store_f32(out, bt * row_stride, H * D, x);
  }
  return ok_status();
}

Status check_rope(std::string_view op, const KernelContext& ctx, ConstTensorArg out, ConstTensorArg inp,
                  const float* table, std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t D,
                  std::int64_t row_stride) {
  ArgCheck check(op);
  check.context(ctx)
      .tensor("out", out)
      .tensor("inp", inp)
      .ptr("table", table)
      .non_negative("B", B)
      .non_negative("T", T)
      .positive("H", H)
      .positive("D", D)
      .fail_if(D % 2 != 0, "head_dim D = " + std::to_string(D) + " must be even")
      .at_least("row_stride", row_stride, "H*D", H * D);
  return check.status();
}

}  // namespace

// ---- launchers ----

Status rope_table(float* table, std::int64_t max_T, std::int64_t head_dim, double theta) {
  ArgCheck check("rope_table");
  check.ptr("table", table)
      .non_negative("max_T", max_T)
      .positive("head_dim", head_dim)
      .fail_if(head_dim % 2 != 0, "head_dim = " + std::to_string(head_dim) + " must be even")
      .fail_if(!(theta > 0.0), "theta must be positive");
  STRATA_RETURN_IF_ERROR(check.status());
  const std::int64_t half = head_dim / 2;
  for (std::int64_t t = 0; t < max_T; ++t) {
    for (std::int64_t i = 0; i < half; ++i) {
      const double freq = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
      const double angle = static_cast<double>(t) * freq;
      table[(t * half + i) * 2] = static_cast<float>(std::cos(angle));
      table[(t * half + i) * 2 + 1] = static_cast<float>(std::sin(angle));
    }
  }
  return ok_status();
}

Status rope_forward(const KernelContext& ctx, TensorArg out, ConstTensorArg inp, const float* table,
                    std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t D, std::int64_t row_stride) {
  if (row_stride == 0) row_stride = H * D;
  STRATA_RETURN_IF_ERROR(check_rope("rope_forward", ctx, out, inp, table, B, T, H, D, row_stride));
  if (B == 0 || T == 0) return ok_status();
  if (ctx.backend == Backend::kCuda)
    return rope_forward_cuda(ctx, out, inp, table, B, T, H, D, row_stride, false);
  return rope_cpu(ctx, out, inp, table, B, T, H, D, row_stride, false);
}

Status rope_backward(const KernelContext& ctx, TensorArg dinp, ConstTensorArg dout, const float* table,
                     std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t D,
                     std::int64_t row_stride) {
  if (row_stride == 0) row_stride = H * D;
  STRATA_RETURN_IF_ERROR(check_rope("rope_backward", ctx, dinp, dout, table, B, T, H, D, row_stride));
  if (B == 0 || T == 0) return ok_status();
  if (ctx.backend == Backend::kCuda)
    return rope_forward_cuda(ctx, dinp, dout, table, B, T, H, D, row_stride, true);
  return rope_cpu(ctx, dinp, dout, table, B, T, H, D, row_stride, true);
}

}  // namespace strata::kernels
