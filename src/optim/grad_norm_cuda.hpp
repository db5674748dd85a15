// The sum of squares of a gradient buffer on a CUDA stream, for the device optimizer's global
// gradient norm (the update itself is fused_adam_cuda, strata/optim.hpp). Defined in
// grad_norm_cuda.cu when the build has CUDA, otherwise in grad_norm_cuda_unavailable.cpp (it
// returns kUnavailable). Private to src/optim and src/offload.
#pragma once

#include <cstddef>

#include "strata/status.hpp"

namespace strata::detail {

// Doubles of device scratch sum_of_squares_cuda needs for n elements.
std::size_t sum_of_squares_cuda_partials(std::size_t n);
// *result (device double) = Σ grad[i]², summed in a fixed order (the same bits run to run).
Status sum_of_squares_cuda(void* stream, const float* grad, std::size_t n, double* partials, double* result);

}  // namespace strata::detail
