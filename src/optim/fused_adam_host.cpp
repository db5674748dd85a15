// The host side of the fused device AdamW. With CUDA in the build the definition lives in
// fused_adam.cu; without it, callers get a clear kUnavailable instead of a link error.
#include "strata/build_config.hpp"
#include "strata/optim.hpp"

namespace strata {

#if !STRATA_HAVE_CUDA
Status fused_adam_cuda(std::span<const DeviceAdamTensor> /*tensors*/, DType /*param_dtype*/,
                       DType /*grad_dtype*/, const OptimizerHyper& /*hyper*/, std::int64_t /*step*/,
                       float /*grad_scale*/, void* /*cuda_stream*/) {
  return unavailable("fused Adam: this build of Strata has no CUDA (configure with -DSTRATA_ENABLE_CUDA=ON)");
}
#endif

}  // namespace strata
