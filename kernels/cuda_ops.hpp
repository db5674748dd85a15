// Host-side entry points of the CUDA kernels, one per op, called by the public functions in
// kernels.hpp after they have validated the arguments (so these do not re-check them). Each
// enqueues its kernels on ctx.cuda_stream and returns kDeviceError if a launch failed.
// They are declared whatever the build; without CUDA, cuda_unavailable.cpp defines them all to
// return kUnavailable.
#pragma once

#include <cstdint>
#include <memory>

#include "kernels/kernels.hpp"

namespace strata::kernels {

Result<std::unique_ptr<KernelState>> make_cuda_kernel_state();

Status embedding_forward_cuda(const KernelContext& ctx, TensorArg out, const std::int32_t* tokens,
                              ConstTensorArg wte, ConstTensorArg wpe, std::int64_t B, std::int64_t T,
                              std::int64_t C, std::int64_t V);
Status embedding_backward_cuda(const KernelContext& ctx, TensorArg dwte, TensorArg dwpe, ConstTensorArg dout,
                               const std::int32_t* tokens, std::int64_t B, std::int64_t T, std::int64_t C,
                               std::int64_t V);
std::uint64_t embedding_backward_workspace_bytes_cuda(std::int64_t B, std::int64_t T);
Status embedding_shard_forward_cuda(const KernelContext& ctx, TensorArg out, const std::int32_t* tokens,
                                    ConstTensorArg wte_shard, ConstTensorArg wpe, std::int64_t B, std::int64_t T,
                                    std::int64_t C, std::int64_t vocab_begin, std::int64_t Vs);
Status embedding_shard_backward_cuda(const KernelContext& ctx, TensorArg dwte_shard, ConstTensorArg dout,
                                     const std::int32_t* tokens, std::int64_t B, std::int64_t T, std::int64_t C,
                                     std::int64_t vocab_begin, std::int64_t Vs);

Status layernorm_forward_cuda(const KernelContext& ctx, TensorArg out, float* mean, float* rstd,
                              ConstTensorArg inp, ConstTensorArg weight, ConstTensorArg bias,
                              std::int64_t rows, std::int64_t C, float eps);
Status layernorm_backward_cuda(const KernelContext& ctx, TensorArg dinp, TensorArg dweight, TensorArg dbias,
                               ConstTensorArg dout, ConstTensorArg inp, ConstTensorArg weight,
                               const float* mean, const float* rstd, std::int64_t rows, std::int64_t C,
                               Accumulate dinp_mode);
Status rmsnorm_forward_cuda(const KernelContext& ctx, TensorArg out, float* rstd, ConstTensorArg inp,
                            ConstTensorArg weight, std::int64_t rows, std::int64_t C, float eps);
Status rmsnorm_backward_cuda(const KernelContext& ctx, TensorArg dinp, TensorArg dweight, ConstTensorArg dout,
                             ConstTensorArg inp, ConstTensorArg weight, const float* rstd, std::int64_t rows,
                             std::int64_t C, Accumulate dinp_mode);

Status gemm_cuda(const KernelContext& ctx, TensorArg c, ConstTensorArg a, ConstTensorArg b,
                 ConstTensorArg bias, std::int64_t M, std::int64_t N, std::int64_t K, Transpose trans_a,
                 Transpose trans_b, Accumulate mode);
// dbias (N) += Σ over M rows of dout (M,N).
Status bias_backward_cuda(const KernelContext& ctx, TensorArg dbias, ConstTensorArg dout, std::int64_t M,
                          std::int64_t N);
std::uint64_t matmul_workspace_bytes_cuda();

Status attention_forward_cuda(const KernelContext& ctx, TensorArg out, float* lse, ConstTensorArg q,
                              ConstTensorArg k, ConstTensorArg v, const AttentionShape& shape);
Status attention_backward_cuda(const KernelContext& ctx, TensorArg dq, TensorArg dk, TensorArg dv,
                               ConstTensorArg dout, ConstTensorArg q, ConstTensorArg k, ConstTensorArg v,
                               ConstTensorArg out, const float* lse, const AttentionShape& shape);
std::uint64_t attention_backward_workspace_bytes_cuda(const AttentionShape& shape);

Status gelu_forward_cuda(const KernelContext& ctx, TensorArg out, ConstTensorArg inp, std::int64_t n);
Status gelu_backward_cuda(const KernelContext& ctx, TensorArg dinp, ConstTensorArg dout, ConstTensorArg inp,
                          std::int64_t n, Accumulate dinp_mode);
Status swiglu_forward_cuda(const KernelContext& ctx, TensorArg out, ConstTensorArg gate_up, std::int64_t rows,
                           std::int64_t F);
Status swiglu_backward_cuda(const KernelContext& ctx, TensorArg dgate_up, ConstTensorArg dout,
                            ConstTensorArg gate_up, std::int64_t rows, std::int64_t F, Accumulate dinp_mode);

Status rope_forward_cuda(const KernelContext& ctx, TensorArg out, ConstTensorArg inp, const float* table,
                         std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t D,
                         std::int64_t row_stride, bool inverse);

Status residual_forward_cuda(const KernelContext& ctx, TensorArg out, ConstTensorArg a, ConstTensorArg b,
                             std::int64_t n);
Status residual_backward_cuda(const KernelContext& ctx, TensorArg da, TensorArg db, ConstTensorArg dout,
                              std::int64_t n, Accumulate mode);

Status cross_entropy_forward_cuda(const KernelContext& ctx, float* losses, float* lse, ConstTensorArg logits,
                                  const std::int32_t* targets, std::int64_t N, std::int64_t V,
                                  std::int64_t Vp);
Status cross_entropy_backward_cuda(const KernelContext& ctx, TensorArg dlogits, ConstTensorArg logits,
                                   const float* lse, const std::int32_t* targets, float dloss, std::int64_t N,
                                   std::int64_t V, std::int64_t Vp);

Status cross_entropy_shard_max_cuda(const KernelContext& ctx, float* row_max, ConstTensorArg logits, std::int64_t N,
                                    std::int64_t Vs, std::int64_t vocab_begin, std::int64_t V);
Status cross_entropy_shard_sums_cuda(const KernelContext& ctx, float* sums, ConstTensorArg logits,
                                     const float* row_max, const std::int32_t* targets, std::int64_t N,
                                     std::int64_t Vs, std::int64_t vocab_begin, std::int64_t V);
Status cross_entropy_shard_finish_cuda(const KernelContext& ctx, float* losses, float* lse, const float* row_max,
                                       const float* sums, const std::int32_t* targets, std::int64_t N);
Status cross_entropy_shard_backward_cuda(const KernelContext& ctx, TensorArg dlogits, ConstTensorArg logits,
                                         const float* lse, const std::int32_t* targets, float dloss,
                                         std::int64_t N, std::int64_t Vs, std::int64_t vocab_begin,
                                         std::int64_t V);

}  // namespace strata::kernels
