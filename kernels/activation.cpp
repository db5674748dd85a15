// Activations of the MLP block.
// GELU (tanh form, as GPT-2 trained with): y = ½x(1 + tanh u), u = √(2/π)(x + 0.044715x³);
//   dy/dx = ½(1 + tanh u) + ½x(1 - tanh²u)·√(2/π)(1 + 3·0.044715x²).
// SwiGLU (LLaMA's MLP): gate_up (rows, 2F) = [g | u] from one fused projection;
//   y = silu(g)·u with silu(g) = g·σ(g); ∂y/∂u = silu(g), ∂y/∂g = u·σ(g)(1 + g(1 - σ(g))).
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "kernels/common.hpp"
#include "kernels/cpu_math.hpp"
#include "kernels/cuda_ops.hpp"

namespace strata::kernels {
namespace {

constexpr std::int64_t kChunk = 4096;
constexpr float kGeluScale = 0.7978845608028654f;  // √(2/π)
constexpr float kGeluCubic = 0.044715f;

// ---- cpu kernels ----

// x (n) <- gelu(x)
STRATA_CPU_CLONES void gelu_rows(float* x, std::int64_t n) {
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float u = kGeluScale * (v + kGeluCubic * v * v * v);
    x[i] = 0.5f * v * (1.0f + tanh_f32(u));
  }
}

// g (n) <- g · gelu'(x)
STRATA_CPU_CLONES void gelu_grad_rows(float* g, const float* x, std::int64_t n) {
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float u = kGeluScale * (v + kGeluCubic * v * v * v);
    const float th = tanh_f32(u);
    const float du = kGeluScale * (1.0f + 3.0f * kGeluCubic * v * v);
    g[i] *= 0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * du;
  }
}

// gu (2F) = [g | u]; the first F become silu(g)·u
STRATA_CPU_CLONES void swiglu_row(float* gu, std::int64_t F) {
#pragma omp simd
  for (std::int64_t i = 0; i < F; ++i) gu[i] = gu[i] * sigmoid_f32(gu[i]) * gu[F + i];
}

// gu (2F) = [g | u] becomes [dg | du] for dy (F)
STRATA_CPU_CLONES void swiglu_grad_row(float* gu, const float* dy, std::int64_t F) {
#pragma omp simd
  for (std::int64_t i = 0; i < F; ++i) {
    const float g = gu[i];
    const float u = gu[F + i];
    const float sig = sigmoid_f32(g);
    gu[i] = dy[i] * u * sig * (1.0f + g * (1.0f - sig));
    gu[F + i] = dy[i] * g * sig;
  }
}

Status gelu_forward_cpu(const KernelContext& ctx, TensorArg out, ConstTensorArg inp, std::int64_t n) {
  const int threads = cpu_thread_count(ctx);
  const std::int64_t chunks = (n + kChunk - 1) / kChunk;
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch("gelu_forward", threads * kChunk, 0));
#pragma omp parallel for num_threads(threads) schedule(static) if (chunks > 1)
  for (std::int64_t c = 0; c < chunks; ++c) {
    float* x = buf + omp_get_thread_num() * kChunk;  // (kChunk)
    const std::int64_t offset = c * kChunk;
    const std::int64_t len = std::min(kChunk, n - offset);
    load_f32(inp, offset, len, x);
    gelu_rows(x, len);
    store_f32(out, offset, len, x);
  }
  return ok_status();
}

Status gelu_backward_cpu(const KernelContext& ctx, TensorArg dinp, ConstTensorArg dout, ConstTensorArg inp,
                         std::int64_t n, Accumulate mode) {
  const int threads = cpu_thread_count(ctx);
  const std::int64_t chunks = (n + kChunk - 1) / kChunk;
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch("gelu_backward", threads * 2 * kChunk, 0));
#pragma omp parallel for num_threads(threads) schedule(static) if (chunks > 1)
  for (std::int64_t c = 0; c < chunks; ++c) {
    float* x = buf + omp_get_thread_num() * 2 * kChunk;  // (kChunk)
    float* g = x + kChunk;                               // (kChunk)
    const std::int64_t offset = c * kChunk;
    const std::int64_t len = std::min(kChunk, n - offset);
    load_f32(inp, offset, len, x);
    load_f32(dout, offset, len, g);
    gelu_grad_rows(g, x, len);
    store_f32(dinp, offset, len, g, mode);
  }
  return ok_status();
}

Status swiglu_forward_cpu(const KernelContext& ctx, TensorArg out, ConstTensorArg gate_up, std::int64_t rows,
                          std::int64_t F) {
  const int threads = cpu_thread_count(ctx);
  const std::size_t stripe = scratch_stripe(2 * F);
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch("swiglu_forward", threads * stripe, 0));
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * F > kChunk)
  for (std::int64_t r = 0; r < rows; ++r) {
    float* gu = buf + omp_get_thread_num() * stripe;  // (2F) = [gate | up]
    load_f32(gate_up, r * 2 * F, 2 * F, gu);
    swiglu_row(gu, F);
    store_f32(out, r * F, F, gu);
  }
  return ok_status();
}

Status swiglu_backward_cpu(const KernelContext& ctx, TensorArg dgate_up, ConstTensorArg dout,
                           ConstTensorArg gate_up, std::int64_t rows, std::int64_t F, Accumulate mode) {
  const int threads = cpu_thread_count(ctx);
  const std::size_t stripe = scratch_stripe(3 * F);
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch("swiglu_backward", threads * stripe, 0));
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * F > kChunk)
  for (std::int64_t r = 0; r < rows; ++r) {
    float* gu = buf + omp_get_thread_num() * stripe;  // (2F) = [gate | up], becomes [dgate | dup]
    float* dy = gu + 2 * F;                           // (F)
    load_f32(gate_up, r * 2 * F, 2 * F, gu);
    load_f32(dout, r * F, F, dy);
    swiglu_grad_row(gu, dy, F);
    store_f32(dgate_up, r * 2 * F, 2 * F, gu, mode);
  }
  return ok_status();
}

}  // namespace

// ---- launchers ----

Status gelu_forward(const KernelContext& ctx, TensorArg out, ConstTensorArg inp, std::int64_t n) {
  ArgCheck check("gelu_forward");
  check.context(ctx).tensor("out", out).tensor("inp", inp).non_negative("n", n);
  STRATA_RETURN_IF_ERROR(check.status());
  if (n == 0) return ok_status();
  if (ctx.backend == Backend::kCuda) return gelu_forward_cuda(ctx, out, inp, n);
  return gelu_forward_cpu(ctx, out, inp, n);
}

Status gelu_backward(const KernelContext& ctx, TensorArg dinp, ConstTensorArg dout, ConstTensorArg inp,
                     std::int64_t n, Accumulate dinp_mode) {
  ArgCheck check("gelu_backward");
  check.context(ctx).tensor("dinp", dinp).tensor("dout", dout).tensor("inp", inp).non_negative("n", n);
  STRATA_RETURN_IF_ERROR(check.status());
  if (n == 0) return ok_status();
  if (ctx.backend == Backend::kCuda) return gelu_backward_cuda(ctx, dinp, dout, inp, n, dinp_mode);
  return gelu_backward_cpu(ctx, dinp, dout, inp, n, dinp_mode);
}

Status swiglu_forward(const KernelContext& ctx, TensorArg out, ConstTensorArg gate_up, std::int64_t rows,
                      std::int64_t F) {
  ArgCheck check("swiglu_forward");
  check.context(ctx)
      .tensor("out", out)
      .tensor("gate_up", gate_up)
      .non_negative("rows", rows)
      .positive("F", F);
  STRATA_RETURN_IF_ERROR(check.status());
  if (rows == 0) return ok_status();
  if (ctx.backend == Backend::kCuda) return swiglu_forward_cuda(ctx, out, gate_up, rows, F);
  return swiglu_forward_cpu(ctx, out, gate_up, rows, F);
}

Status swiglu_backward(const KernelContext& ctx, TensorArg dgate_up, ConstTensorArg dout,
                       ConstTensorArg gate_up, std::int64_t rows, std::int64_t F, Accumulate dinp_mode) {
  ArgCheck check("swiglu_backward");
  check.context(ctx)
      .tensor("dgate_up", dgate_up)
      .tensor("dout", dout)
      .tensor("gate_up", gate_up)
      .non_negative("rows", rows)
      .positive("F", F);
  STRATA_RETURN_IF_ERROR(check.status());
  if (rows == 0) return ok_status();
  if (ctx.backend == Backend::kCuda)
    return swiglu_backward_cuda(ctx, dgate_up, dout, gate_up, rows, F, dinp_mode);
  return swiglu_backward_cpu(ctx, dgate_up, dout, gate_up, rows, F, dinp_mode);
}

}  // namespace strata::kernels
