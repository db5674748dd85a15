// CUDA entry points of the device optimizer: the sum of squares of a gradient buffer and the
// AdamW update, enqueued on a CUDA stream. Defined in optimizer_cuda.cu when the build has CUDA,
// otherwise in optimizer_cuda_unavailable.cpp (each returns kUnavailable). Private to src/runtime.
#pragma once

#include <cstddef>
#include <cstdint>

#include "strata/status.hpp"

namespace strata::detail {

// The trainer's view of one parameter for the device update (flat fp32 buffers).
struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled = true;  // AdamW: p ← p·(1 − lr·wd); else Adam: g ← g + wd·p
};

struct AdamBuffers {
  float* master = nullptr;             // n fp32 weights, updated in place
  const float* grad = nullptr;         // n fp32 gradients
  float* exp_avg = nullptr;            // m
  float* exp_avg_sq = nullptr;         // v
  std::uint16_t* param_out = nullptr;  // optional: the updated weights rounded to bf16
  std::size_t n = 0;
};


// Doubles of device scratch sum_of_squares_cuda needs for n elements.
std::size_t sum_of_squares_cuda_partials(std::size_t n);
// *result (device double) = Σ grad[i]², summed in a fixed order (deterministic run to run).
Status sum_of_squares_cuda(void* stream, const float* grad, std::size_t n, double* partials, double* result);
// The AdamW update on device buffers (the same arithmetic as CpuOptimizer::update, optim.hpp).
Status adamw_update_cuda(void* stream, const AdamHyper& hyper, std::int64_t step, float grad_scale,
                         const AdamBuffers& buffers);

}  // namespace strata::detail
