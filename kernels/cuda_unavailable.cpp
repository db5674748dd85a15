// The CUDA entry points of a build without CUDA: each reports kUnavailable, so a cpu-only build
// links and a request for the cuda backend fails with a clear message instead of a link error.
#include "strata/build_config.hpp"

#if !STRATA_HAVE_CUDA

#include <string>

#include "kernels/cuda_ops.hpp"

namespace strata::kernels {
namespace {

Status no_cuda(std::string_view op) {
  return unavailable(std::string(op) +
                     ": this build of Strata has no CUDA support (configure with -DSTRATA_ENABLE_CUDA=ON)");
}

}  // namespace

Result<std::unique_ptr<KernelState>> make_cuda_kernel_state() {
  return no_cuda("KernelState::create(kCuda)");
}

Status embedding_forward_cuda(const KernelContext&, TensorArg, const std::int32_t*, ConstTensorArg,
                              ConstTensorArg, std::int64_t, std::int64_t, std::int64_t, std::int64_t) {
  return no_cuda("embedding_forward");
}
Status embedding_backward_cuda(const KernelContext&, TensorArg, TensorArg, ConstTensorArg,
                               const std::int32_t*, std::int64_t, std::int64_t, std::int64_t, std::int64_t) {
  return no_cuda("embedding_backward");
}
std::uint64_t embedding_backward_workspace_bytes_cuda(std::int64_t, std::int64_t) { return 0; }
Status embedding_shard_forward_cuda(const KernelContext&, TensorArg, const std::int32_t*, ConstTensorArg,
                                    ConstTensorArg, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                                    std::int64_t) {
  return no_cuda("embedding_shard_forward");
}
Status embedding_shard_backward_cuda(const KernelContext&, TensorArg, ConstTensorArg, const std::int32_t*,
                                     std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t) {
  return no_cuda("embedding_shard_backward");
}

Status layernorm_forward_cuda(const KernelContext&, TensorArg, float*, float*, ConstTensorArg, ConstTensorArg,
                              ConstTensorArg, std::int64_t, std::int64_t, float) {
  return no_cuda("layernorm_forward");
}
Status layernorm_backward_cuda(const KernelContext&, TensorArg, TensorArg, TensorArg, ConstTensorArg,
                               ConstTensorArg, ConstTensorArg, const float*, const float*, std::int64_t,
                               std::int64_t, Accumulate) {
  return no_cuda("layernorm_backward");
}
Status rmsnorm_forward_cuda(const KernelContext&, TensorArg, float*, ConstTensorArg, ConstTensorArg,
                            std::int64_t, std::int64_t, float) {
  return no_cuda("rmsnorm_forward");
}
Status rmsnorm_backward_cuda(const KernelContext&, TensorArg, TensorArg, ConstTensorArg, ConstTensorArg,
                             ConstTensorArg, const float*, std::int64_t, std::int64_t, Accumulate) {
  return no_cuda("rmsnorm_backward");
}

Status gemm_cuda(const KernelContext&, TensorArg, ConstTensorArg, ConstTensorArg, ConstTensorArg,
                 std::int64_t, std::int64_t, std::int64_t, Transpose, Transpose, Accumulate) {
  return no_cuda("gemm");
}
Status bias_backward_cuda(const KernelContext&, TensorArg, ConstTensorArg, std::int64_t, std::int64_t) {
  return no_cuda("matmul_backward");
}
std::uint64_t matmul_workspace_bytes_cuda() { return 0; }

Status attention_forward_cuda(const KernelContext&, TensorArg, float*, ConstTensorArg, ConstTensorArg,
                              ConstTensorArg, const AttentionShape&) {
  return no_cuda("attention_forward");
}
Status attention_backward_cuda(const KernelContext&, TensorArg, TensorArg, TensorArg, ConstTensorArg,
                               ConstTensorArg, ConstTensorArg, ConstTensorArg, ConstTensorArg, const float*,
                               const AttentionShape&) {
  return no_cuda("attention_backward");
}
std::uint64_t attention_backward_workspace_bytes_cuda(const AttentionShape&) { return 0; }

Status gelu_forward_cuda(const KernelContext&, TensorArg, ConstTensorArg, std::int64_t) {
  return no_cuda("gelu_forward");
}
Status gelu_backward_cuda(const KernelContext&, TensorArg, ConstTensorArg, ConstTensorArg, std::int64_t,
                          Accumulate) {
  return no_cuda("gelu_backward");
}
Status swiglu_forward_cuda(const KernelContext&, TensorArg, ConstTensorArg, std::int64_t, std::int64_t) {
  return no_cuda("swiglu_forward");
}
Status swiglu_backward_cuda(const KernelContext&, TensorArg, ConstTensorArg, ConstTensorArg, std::int64_t,
                            std::int64_t, Accumulate) {
  return no_cuda("swiglu_backward");
}

Status rope_forward_cuda(const KernelContext&, TensorArg, ConstTensorArg, const float*, std::int64_t,
                         std::int64_t, std::int64_t, std::int64_t, std::int64_t, bool inverse) {
  return no_cuda(inverse ? "rope_backward" : "rope_forward");
}

Status residual_forward_cuda(const KernelContext&, TensorArg, ConstTensorArg, ConstTensorArg, std::int64_t) {
  return no_cuda("residual_forward");
}
Status residual_backward_cuda(const KernelContext&, TensorArg, TensorArg, ConstTensorArg, std::int64_t,
                              Accumulate) {
  return no_cuda("residual_backward");
}

Status cross_entropy_forward_cuda(const KernelContext&, float*, float*, ConstTensorArg, const std::int32_t*,
                                  std::int64_t, std::int64_t, std::int64_t) {
  return no_cuda("cross_entropy_forward");
}
Status cross_entropy_backward_cuda(const KernelContext&, TensorArg, ConstTensorArg, const float*,
                                   const std::int32_t*, float, std::int64_t, std::int64_t, std::int64_t) {
  return no_cuda("cross_entropy_backward");
}

Status cross_entropy_shard_max_cuda(const KernelContext&, float*, ConstTensorArg, std::int64_t, std::int64_t,
                                    std::int64_t, std::int64_t) {
  return no_cuda("cross_entropy_shard_max");
}
Status cross_entropy_shard_sums_cuda(const KernelContext&, float*, ConstTensorArg, const float*, const std::int32_t*,
                                     std::int64_t, std::int64_t, std::int64_t, std::int64_t) {
  return no_cuda("cross_entropy_shard_sums");
}
Status cross_entropy_shard_finish_cuda(const KernelContext&, float*, float*, const float*, const float*,
                                       const std::int32_t*, std::int64_t) {
  return no_cuda("cross_entropy_shard_finish");
}
Status cross_entropy_shard_backward_cuda(const KernelContext&, TensorArg, ConstTensorArg, const float*,
                                         const std::int32_t*, float, std::int64_t, std::int64_t, std::int64_t,
                                         std::int64_t) {
  return no_cuda("cross_entropy_shard_backward");
}

}  // namespace strata::kernels

#endif  // !STRATA_HAVE_CUDA
