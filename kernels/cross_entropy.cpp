// Softmax and cross-entropy over the vocabulary, fused so the (N, V) probabilities are never
// stored. For row n with logits z (the first V of Vp columns) and target y:
//   lse = log Σ_v exp(z_v)   (computed as m + log Σ exp(z_v - m), m = max z),
//   loss = lse - z_y,
//   dz_v = (exp(z_v - lse) - [v = y])·dloss, and 0 in the padded columns.
// A negative target marks a row to ignore (padding, prompt tokens): loss 0, gradient 0.
// The backward recomputes the probabilities from the saved lse, and may overwrite the logits.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "kernels/common.hpp"
#include "kernels/cpu_math.hpp"
#include "kernels/cuda_ops.hpp"

namespace strata::kernels {
namespace {

constexpr std::int64_t kSumChunk = 256;

Status check_targets(std::string_view op, const std::int32_t* targets, std::int64_t N, std::int64_t V) {
  for (std::int64_t n = 0; n < N; ++n) {
    if (targets[n] >= V) {
      return invalid_argument(std::string(op) + ": target " + std::to_string(targets[n]) + " of row " +
                              std::to_string(n) + " is outside the vocabulary [0, " + std::to_string(V) +
                              ")");
    }
  }
  return ok_status();
}

// ---- cpu kernels ----

// log Σ exp(z) over one row. fp32 partial sums of short chunks are added in double: a sequential
// fp32 sum over a 50k vocabulary would lose ~1e-4 relative in lse, which every probability inherits.
STRATA_CPU_CLONES float logsumexp_row(const float* z, std::int64_t V) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (std::int64_t v = 0; v < V; ++v) m = std::max(m, z[v]);
  double sum = 0.0;
  for (std::int64_t v0 = 0; v0 < V; v0 += kSumChunk) {
    const std::int64_t v1 = std::min(V, v0 + kSumChunk);
    float part = 0.0f;
#pragma omp simd reduction(+ : part)
    for (std::int64_t v = v0; v < v1; ++v) part += exp_f32(z[v] - m);
    sum += part;
  }
  return m + static_cast<float>(std::log(sum));
}

// z (V) <- softmax(z)·dloss, from the row's lse
STRATA_CPU_CLONES void softmax_grad_row(float* z, std::int64_t V, float row_lse, float dloss) {
#pragma omp simd
  for (std::int64_t v = 0; v < V; ++v) z[v] = exp_f32(z[v] - row_lse) * dloss;
}

Status cross_entropy_forward_cpu(const KernelContext& ctx, float* losses, float* lse, ConstTensorArg logits,
                                 const std::int32_t* targets, std::int64_t N, std::int64_t V,
                                 std::int64_t Vp) {
  STRATA_RETURN_IF_ERROR(check_targets("cross_entropy_forward", targets, N, V));
  const int threads = cpu_thread_count(ctx);
  const std::size_t stripe = scratch_stripe(V);
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch("cross_entropy_forward", threads * stripe, 0));
#pragma omp parallel for num_threads(threads) schedule(static) if (N * V > 8192)
  for (std::int64_t n = 0; n < N; ++n) {
    float* z = buf + omp_get_thread_num() * stripe;  // (V)
    load_f32(logits, n * Vp, V, z);
    const float row_lse = logsumexp_row(z, V);
    if (lse != nullptr) lse[n] = row_lse;
    losses[n] = targets[n] < 0 ? 0.0f : row_lse - z[targets[n]];
  }
  return ok_status();
}

Status cross_entropy_backward_cpu(const KernelContext& ctx, TensorArg dlogits, ConstTensorArg logits,
                                  const float* lse, const std::int32_t* targets, float dloss, std::int64_t N,
                                  std::int64_t V, std::int64_t Vp) {
  STRATA_RETURN_IF_ERROR(check_targets("cross_entropy_backward", targets, N, V));
  const int threads = cpu_thread_count(ctx);
  const std::size_t stripe = scratch_stripe(Vp);
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch("cross_entropy_backward", threads * stripe, 0));
#pragma omp parallel for num_threads(threads) schedule(static) if (N * V > 8192)
  for (std::int64_t n = 0; n < N; ++n) {
    float* z = buf + omp_get_thread_num() * stripe;  // (Vp)
    const std::int32_t y = targets[n];
    if (y < 0) {
      std::fill(z, z + Vp, 0.0f);
    } else {
      load_f32(logits, n * Vp, V, z);
      softmax_grad_row(z, V, lse[n], dloss);
      z[y] -= dloss;
      std::fill(z + V, z + Vp, 0.0f);
    }
    store_f32(dlogits, n * Vp, Vp, z);
  }
  return ok_status();
}

// ---- vocabulary shards ----
// The shard's real columns: full columns [vocab_begin, min(vocab_begin + Vs, V)).
std::int64_t real_columns(std::int64_t Vs, std::int64_t vocab_begin, std::int64_t V) {
  return std::clamp<std::int64_t>(V - vocab_begin, 0, Vs);
}

Status cross_entropy_shard_max_cpu(const KernelContext& ctx, float* row_max, ConstTensorArg logits,
                                   std::int64_t N, std::int64_t Vs, std::int64_t vocab_begin, std::int64_t V) {
  const std::int64_t R = real_columns(Vs, vocab_begin, V);
  const int threads = cpu_thread_count(ctx);
  const std::size_t stripe = scratch_stripe(Vs);
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch("cross_entropy_shard_max", threads * stripe, 0));
#pragma omp parallel for num_threads(threads) schedule(static) if (N * Vs > 8192)
  for (std::int64_t n = 0; n < N; ++n) {
    float* z = buf + omp_get_thread_num() * stripe;  // (R)
    load_f32(logits, n * Vs, R, z);
    float m = -std::numeric_limits<float>::infinity();
    for (std::int64_t v = 0; v < R; ++v) m = std::max(m, z[v]);
    row_max[n] = m;
  }
  return ok_status();
}

Status cross_entropy_shard_sums_cpu(const KernelContext& ctx, float* sums, ConstTensorArg logits,
                                    const float* row_max, const std::int32_t* targets, std::int64_t N,
                                    std::int64_t Vs, std::int64_t vocab_begin, std::int64_t V) {
  STRATA_RETURN_IF_ERROR(check_targets("cross_entropy_shard_sums", targets, N, V));
  const std::int64_t R = real_columns(Vs, vocab_begin, V);
  const int threads = cpu_thread_count(ctx);
  const std::size_t stripe = scratch_stripe(Vs);
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch("cross_entropy_shard_sums", threads * stripe, 0));
#pragma omp parallel for num_threads(threads) schedule(static) if (N * Vs > 8192)
  for (std::int64_t n = 0; n < N; ++n) {
    float* z = buf + omp_get_thread_num() * stripe;  // (R)
    load_f32(logits, n * Vs, R, z);
    const float m = row_max[n];
    double sum = 0.0;  // chunked as in logsumexp_row
    for (std::int64_t v0 = 0; v0 < R; v0 += kSumChunk) {
      const std::int64_t v1 = std::min(R, v0 + kSumChunk);
      float part = 0.0f;
      for (std::int64_t v = v0; v < v1; ++v) part += exp_f32(z[v] - m);
      sum += part;
    }
    sums[n] = static_cast<float>(sum);
    const std::int64_t y = static_cast<std::int64_t>(targets[n]) - vocab_begin;
    sums[N + n] = (targets[n] >= 0 && y >= 0 && y < R) ? z[y] : 0.0f;
  }
  return ok_status();
}

Status cross_entropy_shard_finish_cpu(float* losses, float* lse, const float* row_max, const float* sums,
                                      const std::int32_t* targets, std::int64_t N) {
  for (std::int64_t n = 0; n < N; ++n) {
    const float row_lse = row_max[n] + std::log(sums[n]);
    if (lse != nullptr) lse[n] = row_lse;
    losses[n] = targets[n] < 0 ? 0.0f : row_lse - sums[N + n];
  }
  return ok_status();
}

Status cross_entropy_shard_backward_cpu(const KernelContext& ctx, TensorArg dlogits, ConstTensorArg logits,
                                        const float* lse, const std::int32_t* targets, float dloss,
                                        std::int64_t N, std::int64_t Vs, std::int64_t vocab_begin,
                                        std::int64_t V) {
  STRATA_RETURN_IF_ERROR(check_targets("cross_entropy_shard_backward", targets, N, V));
  const std::int64_t R = real_columns(Vs, vocab_begin, V);
  const int threads = cpu_thread_count(ctx);
  const std::size_t stripe = scratch_stripe(Vs);
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch("cross_entropy_shard_backward", threads * stripe, 0));
#pragma omp parallel for num_threads(threads) schedule(static) if (N * Vs > 8192)
  for (std::int64_t n = 0; n < N; ++n) {
    float* z = buf + omp_get_thread_num() * stripe;  // (Vs)
    std::fill(z, z + Vs, 0.0f);
    if (targets[n] >= 0) {
      load_f32(logits, n * Vs, R, z);
      softmax_grad_row(z, R, lse[n], dloss);
      const std::int64_t y = static_cast<std::int64_t>(targets[n]) - vocab_begin;
      if (y >= 0 && y < R) z[y] -= dloss;
    }
    store_f32(dlogits, n * Vs, Vs, z);
  }
  return ok_status();
}

Status check_shard(ArgCheck& check, const KernelContext& ctx, ConstTensorArg logits, std::int64_t N,
                   std::int64_t Vs, std::int64_t vocab_begin, std::int64_t V) {
  check.context(ctx)
      .tensor("logits", logits)
      .non_negative("N", N)
      .positive("Vs", Vs)
      .non_negative("vocab_begin", vocab_begin)
      .positive("V", V)
      .fail_if(V >= (std::int64_t{1} << 31), "V = " + std::to_string(V) + " does not fit int32 targets");
  return check.status();
}

Status check_cross_entropy(ArgCheck& check, const KernelContext& ctx, ConstTensorArg logits,
                           const void* targets, std::int64_t N, std::int64_t V, std::int64_t Vp) {
  check.context(ctx)
      .tensor("logits", logits)
      .ptr("targets", targets)
      .non_negative("N", N)
      .positive("V", V)
      .at_least("Vp", Vp, "V", V)
      .fail_if(V >= (std::int64_t{1} << 31), "V = " + std::to_string(V) + " does not fit int32 targets");
  return check.status();
}

}  // namespace

// ---- launchers ----

Status cross_entropy_forward(const KernelContext& ctx, float* losses, float* lse, ConstTensorArg logits,
                             const std::int32_t* targets, std::int64_t N, std::int64_t V, std::int64_t Vp) {
  ArgCheck check("cross_entropy_forward");
  check.ptr("losses", losses);
  STRATA_RETURN_IF_ERROR(check_cross_entropy(check, ctx, logits, targets, N, V, Vp));
  if (N == 0) return ok_status();
  if (ctx.backend == Backend::kCuda)
    return cross_entropy_forward_cuda(ctx, losses, lse, logits, targets, N, V, Vp);
  return cross_entropy_forward_cpu(ctx, losses, lse, logits, targets, N, V, Vp);
}

Status cross_entropy_backward(const KernelContext& ctx, TensorArg dlogits, ConstTensorArg logits,
                              const float* lse, const std::int32_t* targets, float dloss, std::int64_t N,
                              std::int64_t V, std::int64_t Vp) {
  ArgCheck check("cross_entropy_backward");
  check.tensor("dlogits", dlogits).ptr("lse", lse);
  STRATA_RETURN_IF_ERROR(check_cross_entropy(check, ctx, logits, targets, N, V, Vp));
  if (N == 0) return ok_status();
  if (ctx.backend == Backend::kCuda) {
    return cross_entropy_backward_cuda(ctx, dlogits, logits, lse, targets, dloss, N, V, Vp);
  }
  return cross_entropy_backward_cpu(ctx, dlogits, logits, lse, targets, dloss, N, V, Vp);
}

Status cross_entropy_shard_max(const KernelContext& ctx, float* row_max, ConstTensorArg logits, std::int64_t N,
                               std::int64_t Vs, std::int64_t vocab_begin, std::int64_t V) {
  ArgCheck check("cross_entropy_shard_max");
  check.ptr("row_max", row_max);
  STRATA_RETURN_IF_ERROR(check_shard(check, ctx, logits, N, Vs, vocab_begin, V));
  if (N == 0) return ok_status();
  if (ctx.backend == Backend::kCuda)
    return cross_entropy_shard_max_cuda(ctx, row_max, logits, N, Vs, vocab_begin, V);
  return cross_entropy_shard_max_cpu(ctx, row_max, logits, N, Vs, vocab_begin, V);
}

Status cross_entropy_shard_sums(const KernelContext& ctx, float* sums, ConstTensorArg logits, const float* row_max,
                                const std::int32_t* targets, std::int64_t N, std::int64_t Vs,
                                std::int64_t vocab_begin, std::int64_t V) {
  ArgCheck check("cross_entropy_shard_sums");
  check.ptr("sums", sums).ptr("row_max", row_max).ptr("targets", targets);
  STRATA_RETURN_IF_ERROR(check_shard(check, ctx, logits, N, Vs, vocab_begin, V));
  if (N == 0) return ok_status();
  if (ctx.backend == Backend::kCuda)
    return cross_entropy_shard_sums_cuda(ctx, sums, logits, row_max, targets, N, Vs, vocab_begin, V);
  return cross_entropy_shard_sums_cpu(ctx, sums, logits, row_max, targets, N, Vs, vocab_begin, V);
}

Status cross_entropy_shard_finish(const KernelContext& ctx, float* losses, float* lse, const float* row_max,
                                  const float* sums, const std::int32_t* targets, std::int64_t N) {
  ArgCheck check("cross_entropy_shard_finish");
  check.context(ctx).ptr("losses", losses).ptr("row_max", row_max).ptr("sums", sums).ptr("targets", targets).non_negative("N", N);
  STRATA_RETURN_IF_ERROR(check.status());
  if (N == 0) return ok_status();
  if (ctx.backend == Backend::kCuda)
    return cross_entropy_shard_finish_cuda(ctx, losses, lse, row_max, sums, targets, N);
  return cross_entropy_shard_finish_cpu(losses, lse, row_max, sums, targets, N);
}

Status cross_entropy_shard_backward(const KernelContext& ctx, TensorArg dlogits, ConstTensorArg logits,
                                    const float* lse, const std::int32_t* targets, float dloss, std::int64_t N,
                                    std::int64_t Vs, std::int64_t vocab_begin, std::int64_t V) {
  ArgCheck check("cross_entropy_shard_backward");
  check.tensor("dlogits", dlogits).ptr("lse", lse).ptr("targets", targets);
  STRATA_RETURN_IF_ERROR(check_shard(check, ctx, logits, N, Vs, vocab_begin, V));
  if (N == 0) return ok_status();
  if (ctx.backend == Backend::kCuda) {
    return cross_entropy_shard_backward_cuda(ctx, dlogits, logits, lse, targets, dloss, N, Vs, vocab_begin, V);
  }
  return cross_entropy_shard_backward_cpu(ctx, dlogits, logits, lse, targets, dloss, N, Vs, vocab_begin, V);
}

}  // namespace strata::kernels
