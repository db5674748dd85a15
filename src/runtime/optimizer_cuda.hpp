// CUDA entry points of the device optimizer: the sum of squares of a gradient buffer and the
// AdamW update, enqueued on a CUDA stream. Defined in optimizer_cuda.cu when the build has CUDA,
// otherwise in optimizer_cuda_unavailable.cpp (each returns kUnavailable). Private to src/runtime.
#pragma once

#include <cstddef>
#include <cstdint>

#include "runtime/adamw.hpp"
#include "strata/status.hpp"

namespace strata::detail {

// Doubles of device scratch sum_of_squares_cuda needs for n elements.
std::size_t sum_of_squares_cuda_partials(std::size_t n);
// *result (device double) = Σ grad[i]², summed in a fixed order (deterministic run to run).
Status sum_of_squares_cuda(void* stream, const float* grad, std::size_t n, double* partials, double* result);
// The AdamW update of adamw.hpp on device buffers.
Status adamw_update_cuda(void* stream, const AdamHyper& hyper, std::int64_t step, float grad_scale,
                         const AdamBuffers& buffers);

}  // namespace strata::detail
