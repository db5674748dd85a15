// Normalisation over the last dimension of (rows, C).
// LayerNorm: μ = mean(x), rstd = 1/√(var(x) + ε), x̂ = (x - μ)·rstd, y = x̂·w + b.
//   Backward, with g = dy·w: dx = rstd·(g - mean(g) - x̂·mean(g·x̂)), dw += Σ dy·x̂, db += Σ dy.
// RMSNorm: rstd = 1/√(mean(x²) + ε), x̂ = x·rstd, y = x̂·w.
//   Backward: dx = rstd·(g - x̂·mean(g·x̂)), dw += Σ dy·x̂.
// The weight gradients are sums over rows. They are reduced in fixed blocks of rows (the block
// size depends only on `rows`), then the block partials are added in order, so the result does
// not depend on the thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "kernels/common.hpp"
#include "kernels/cuda_ops.hpp"

namespace strata::kernels {
namespace {

// Rows per partial sum of the weight gradients: at least 32, at most 256 partials.
std::int64_t rows_per_partial(std::int64_t rows) { return std::max<std::int64_t>(32, (rows + 255) / 256); }

// ---- cpu kernels ----

// rms = false: LayerNorm (mean may be null, bias may be absent); rms = true: RMSNorm.
Status norm_forward_cpu(std::string_view op, const KernelContext& ctx, bool rms, TensorArg out, float* mean,
                        float* rstd, ConstTensorArg inp, ConstTensorArg weight, ConstTensorArg bias,
                        std::int64_t rows, std::int64_t C, float eps) {
  const int threads = cpu_thread_count(ctx);
  const std::size_t stripe = scratch_stripe(C);
  STRATA_ASSIGN_OR_RETURN(float* params, scratch(op, 2 * C, 0));  // (2, C) weight, bias
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch(op, threads * stripe, 1));
  float* w = params;
  float* b = params + C;
  load_f32(weight, 0, C, w);
  if (bias.data != nullptr) {
    load_f32(bias, 0, C, b);
  } else {
    std::fill(b, b + C, 0.0f);
  }
  const float inv_c = 1.0f / static_cast<float>(C);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * C > 8192)
  for (std::int64_t r = 0; r < rows; ++r) {
    float* x = buf + omp_get_thread_num() * stripe;  // (C)
    load_f32(inp, r * C, C, x);
    float mu = 0.0f;
    if (!rms) {
      for (std::int64_t c = 0; c < C; ++c) mu += x[c];
      mu *= inv_c;
    }
    float sq = 0.0f;
    for (std::int64_t c = 0; c < C; ++c) {
      const float d = x[c] - mu;
      sq += d * d;
    }
    const float rs = 1.0f / std::sqrt(sq * inv_c + eps);
    for (std::int64_t c = 0; c < C; ++c) x[c] = (x[c] - mu) * rs * w[c] + b[c];
    store_f32(out, r * C, C, x);
    if (mean != nullptr) mean[r] = mu;
    if (rstd != nullptr) rstd[r] = rs;
  }
  return ok_status();
}

Status norm_backward_cpu(std::string_view op, const KernelContext& ctx, bool rms, TensorArg dinp,
                         TensorArg dweight, TensorArg dbias, ConstTensorArg dout, ConstTensorArg inp,
                         ConstTensorArg weight, const float* mean, const float* rstd, std::int64_t rows,
                         std::int64_t C, Accumulate dinp_mode) {
  const int threads = cpu_thread_count(ctx);
  const std::size_t stripe = scratch_stripe(3 * C);
  const std::int64_t block = rows_per_partial(rows);
  const std::int64_t partials = (rows + block - 1) / block;
  STRATA_ASSIGN_OR_RETURN(float* w, scratch(op, C, 0));
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch(op, threads * stripe, 1));
  STRATA_ASSIGN_OR_RETURN(float* part, scratch(op, partials * 2 * C, 2));  // (partials, 2, C) dw, db
  load_f32(weight, 0, C, w);
  const float inv_c = 1.0f / static_cast<float>(C);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * C > 8192)
  for (std::int64_t p = 0; p < partials; ++p) {
    float* x = buf + omp_get_thread_num() * stripe;  // (C) x, then x̂
    float* dy = x + C;                               // (C)
    float* dx = dy + C;                              // (C)
    float* dw = part + p * 2 * C;                    // (C)
    float* db = dw + C;                              // (C)
    std::fill(dw, dw + 2 * C, 0.0f);
    for (std::int64_t r = p * block; r < std::min(rows, (p + 1) * block); ++r) {
      load_f32(inp, r * C, C, x);
      load_f32(dout, r * C, C, dy);
      const float mu = rms ? 0.0f : mean[r];
      const float rs = rstd[r];
      float g_mean = 0.0f;
      float gx_mean = 0.0f;
      for (std::int64_t c = 0; c < C; ++c) {
        x[c] = (x[c] - mu) * rs;
        const float g = dy[c] * w[c];
        g_mean += g;
        gx_mean += g * x[c];
        dw[c] += dy[c] * x[c];
        db[c] += dy[c];
      }
      g_mean = rms ? 0.0f : g_mean * inv_c;
      gx_mean *= inv_c;
      if (dinp.data != nullptr) {
        for (std::int64_t c = 0; c < C; ++c) dx[c] = rs * (dy[c] * w[c] - g_mean - x[c] * gx_mean);
        store_f32(dinp, r * C, C, dx, dinp_mode);
      }
    }
  }
  // Add the partials in block order; columns are independent.
  const std::int64_t col_chunk = 256;
  const std::int64_t col_chunks = (C + col_chunk - 1) / col_chunk;
#pragma omp parallel for num_threads(threads) schedule(static) if (partials * C > 8192)
  for (std::int64_t cc = 0; cc < col_chunks; ++cc) {
    const std::int64_t c0 = cc * col_chunk;
    const std::int64_t len = std::min(col_chunk, C - c0);
    float* dw = part + c0;  // partial 0 collects the sums
    float* db = part + C + c0;
    for (std::int64_t p = 1; p < partials; ++p) {
      const float* pw = part + p * 2 * C + c0;
      const float* pb = pw + C;
      for (std::int64_t c = 0; c < len; ++c) {
        dw[c] += pw[c];
        db[c] += pb[c];
      }
    }
    if (dweight.data != nullptr) store_f32(dweight, c0, len, dw, Accumulate::kAdd);
    if (dbias.data != nullptr) store_f32(dbias, c0, len, db, Accumulate::kAdd);
  }
  return ok_status();
}

Status check_norm(ArgCheck& check, const KernelContext& ctx, ConstTensorArg inp, ConstTensorArg weight,
                  std::int64_t rows, std::int64_t C) {
  check.context(ctx).tensor("inp", inp).tensor("weight", weight).non_negative("rows", rows).positive("C", C);
  return check.status();
}

}  // namespace

// ---- launchers ----

Status layernorm_forward(const KernelContext& ctx, TensorArg out, float* mean, float* rstd,
                         ConstTensorArg inp, ConstTensorArg weight, ConstTensorArg bias, std::int64_t rows,
                         std::int64_t C, float eps) {
  ArgCheck check("layernorm_forward");
  check.tensor("out", out).optional("bias", bias).fail_if(!(eps > 0.0f), "eps must be positive");
  STRATA_RETURN_IF_ERROR(check_norm(check, ctx, inp, weight, rows, C));
  if (rows == 0) return ok_status();
  if (ctx.backend == Backend::kCuda)
    return layernorm_forward_cuda(ctx, out, mean, rstd, inp, weight, bias, rows, C, eps);
  return norm_forward_cpu("layernorm_forward", ctx, false, out, mean, rstd, inp, weight, bias, rows, C, eps);
}

Status layernorm_backward(const KernelContext& ctx, TensorArg dinp, TensorArg dweight, TensorArg dbias,
                          ConstTensorArg dout, ConstTensorArg inp, ConstTensorArg weight, const float* mean,
                          const float* rstd, std::int64_t rows, std::int64_t C, Accumulate dinp_mode) {
  ArgCheck check("layernorm_backward");
  check.tensor("dout", dout).ptr("mean", mean).ptr("rstd", rstd);
  check.optional("dinp", dinp).optional("dweight", dweight).optional("dbias", dbias);
  STRATA_RETURN_IF_ERROR(check_norm(check, ctx, inp, weight, rows, C));
  if (rows == 0) return ok_status();
  if (ctx.backend == Backend::kCuda) {
    return layernorm_backward_cuda(ctx, dinp, dweight, dbias, dout, inp, weight, mean, rstd, rows, C,
                                   dinp_mode);
  }
  return norm_backward_cpu("layernorm_backward", ctx, false, dinp, dweight, dbias, dout, inp, weight, mean,
                           rstd, rows, C, dinp_mode);
}

Status rmsnorm_forward(const KernelContext& ctx, TensorArg out, float* rstd, ConstTensorArg inp,
                       ConstTensorArg weight, std::int64_t rows, std::int64_t C, float eps) {
  ArgCheck check("rmsnorm_forward");
  check.tensor("out", out).fail_if(!(eps > 0.0f), "eps must be positive");
  STRATA_RETURN_IF_ERROR(check_norm(check, ctx, inp, weight, rows, C));
  if (rows == 0) return ok_status();
  if (ctx.backend == Backend::kCuda) return rmsnorm_forward_cuda(ctx, out, rstd, inp, weight, rows, C, eps);
  return norm_forward_cpu("rmsnorm_forward", ctx, true, out, nullptr, rstd, inp, weight, kNone, rows, C, eps);
}

Status rmsnorm_backward(const KernelContext& ctx, TensorArg dinp, TensorArg dweight, ConstTensorArg dout,
                        ConstTensorArg inp, ConstTensorArg weight, const float* rstd, std::int64_t rows,
                        std::int64_t C, Accumulate dinp_mode) {
  ArgCheck check("rmsnorm_backward");
  check.tensor("dout", dout).ptr("rstd", rstd).optional("dinp", dinp).optional("dweight", dweight);
  STRATA_RETURN_IF_ERROR(check_norm(check, ctx, inp, weight, rows, C));
  if (rows == 0) return ok_status();
  if (ctx.backend == Backend::kCuda) {
    return rmsnorm_backward_cuda(ctx, dinp, dweight, dout, inp, weight, rstd, rows, C, dinp_mode);
  }
  return norm_backward_cpu("rmsnorm_backward", ctx, true, dinp, dweight, kNoOutput, dout, inp, weight,
                           nullptr, rstd, rows, C, dinp_mode);
}

}  // namespace strata::kernels
