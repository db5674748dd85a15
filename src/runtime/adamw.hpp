// The optimizer update the Trainer runs until the CPU optimizer of include/strata/optim.hpp is
// available: plain AdamW (or Adam with L2 decay) over flat fp32 buffers, scalar loops split over
// OpenMP threads, plus a deterministic sum of squares for the global gradient norm.
//
// The interface mirrors CpuOptimizer::update / scan_gradients (hyperparameters, 1-based step,
// gradient scale, one buffer set), so swapping the implementation is a local change in
// device_optimizer.cpp. Private to src/runtime.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::detail {

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

// Update number `step` (1-based; bias correction uses it). Gradients are multiplied by
// `grad_scale` (the clip coefficient) first. The result is independent of `threads`.
void adamw_update(const AdamHyper& hyper, std::int64_t step, float grad_scale, const AdamBuffers& buffers,
                  int threads);

// Σ g² in double, summed in fixed chunks whose partials are added in order: the result depends
// on n alone, not on `threads`. `partials` holds sum_of_squares_chunks(n) doubles of scratch.
std::size_t sum_of_squares_chunks(std::size_t n);
double sum_of_squares(const float* grad, std::size_t n, int threads, double* partials);

}  // namespace strata::detail
