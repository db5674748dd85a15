// The device optimizer's CUDA entry points in a build without CUDA: each reports kUnavailable.
#include "strata/build_config.hpp"

#if !STRATA_HAVE_CUDA

#include "runtime/optimizer_cuda.hpp"

namespace strata::detail {

std::size_t sum_of_squares_cuda_partials(std::size_t) { return 0; }

Status sum_of_squares_cuda(void*, const float*, std::size_t, double*, double*) {
  return unavailable("gradient norm on cuda: this build of Strata has no CUDA support");
}

Status adamw_update_cuda(void*, const AdamHyper&, std::int64_t, float, const AdamBuffers&) {
  return unavailable("AdamW on cuda: this build of Strata has no CUDA support");
}

}  // namespace strata::detail

#endif  // !STRATA_HAVE_CUDA
