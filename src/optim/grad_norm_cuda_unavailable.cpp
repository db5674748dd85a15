// The gradient norm's CUDA entry point in a build without CUDA: it reports kUnavailable.
#include "strata/build_config.hpp"

#if !STRATA_HAVE_CUDA

#include "optim/grad_norm_cuda.hpp"

namespace strata::detail {

std::size_t sum_of_squares_cuda_partials(std::size_t) { return 0; }

Status sum_of_squares_cuda(void*, const float*, std::size_t, double*, double*) {
  return unavailable("gradient norm on cuda: this build of Strata has no CUDA support");
}

}  // namespace strata::detail

#endif  // !STRATA_HAVE_CUDA
