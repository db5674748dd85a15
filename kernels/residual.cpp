// Residual connection: out = a + b elementwise over n values. Its backward hands dout to both
// branches: da (=|+=) dout, db (=|+=) dout; with kAdd that is how a branch's gradient joins the
// residual stream's.
#include <omp.h>

#include <algorithm>

#include "kernels/common.hpp"
#include "kernels/cuda_ops.hpp"

namespace strata::kernels {
namespace {

constexpr std::int64_t kChunk = 4096;

// ---- cpu kernels ----

Status residual_forward_cpu(const KernelContext& ctx, TensorArg out, ConstTensorArg a, ConstTensorArg b,
                            std::int64_t n) {
  const int threads = cpu_thread_count(ctx);
  const std::int64_t chunks = (n + kChunk - 1) / kChunk;
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch("residual_forward", threads * 2 * kChunk, 0));
#pragma omp parallel for num_threads(threads) schedule(static) if (chunks > 1)
  for (std::int64_t c = 0; c < chunks; ++c) {
    float* x = buf + omp_get_thread_num() * 2 * kChunk;  // (kChunk)
    float* y = x + kChunk;                               // (kChunk)
    const std::int64_t offset = c * kChunk;
    const std::int64_t len = std::min(kChunk, n - offset);
    load_f32(a, offset, len, x);
    load_f32(b, offset, len, y);
    for (std::int64_t i = 0; i < len; ++i) x[i] += y[i];
    store_f32(out, offset, len, x);
  }
  return ok_status();
}

Status residual_backward_cpu(const KernelContext& ctx, TensorArg da, TensorArg db, ConstTensorArg dout,
                             std::int64_t n, Accumulate mode) {
  const int threads = cpu_thread_count(ctx);
  const std::int64_t chunks = (n + kChunk - 1) / kChunk;
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch("residual_backward", threads * kChunk, 0));
#pragma omp parallel for num_threads(threads) schedule(static) if (chunks > 1)
  for (std::int64_t c = 0; c < chunks; ++c) {
    float* g = buf + omp_get_thread_num() * kChunk;  // (kChunk)
    const std::int64_t offset = c * kChunk;
    const std::int64_t len = std::min(kChunk, n - offset);
    load_f32(dout, offset, len, g);
    if (da.data != nullptr) store_f32(da, offset, len, g, mode);
    if (db.data != nullptr) store_f32(db, offset, len, g, mode);
  }
  return ok_status();
}

}  // namespace

// ---- launchers ----

Status residual_forward(const KernelContext& ctx, TensorArg out, ConstTensorArg a, ConstTensorArg b,
                        std::int64_t n) {
  ArgCheck check("residual_forward");
  check.context(ctx).tensor("out", out).tensor("a", a).tensor("b", b).non_negative("n", n);
  STRATA_RETURN_IF_ERROR(check.status());
  if (n == 0) return ok_status();
  if (ctx.backend == Backend::kCuda) return residual_forward_cuda(ctx, out, a, b, n);
  return residual_forward_cpu(ctx, out, a, b, n);
}

Status residual_backward(const KernelContext& ctx, TensorArg da, TensorArg db, ConstTensorArg dout,
                         std::int64_t n, Accumulate mode) {
  ArgCheck check("residual_backward");
  check.context(ctx).tensor("dout", dout).optional("da", da).optional("db", db).non_negative("n", n);
  STRATA_RETURN_IF_ERROR(check.status());
  if (n == 0 || (da.data == nullptr && db.data == nullptr)) return ok_status();
  if (ctx.backend == Backend::kCuda) return residual_backward_cuda(ctx, da, db, dout, n, mode);
  return residual_backward_cpu(ctx, da, db, dout, n, mode);
}

}  // namespace strata::kernels
