// Scalar AdamW (see adamw.hpp). One pass per buffer: read master, gradient and moments, write
// them back, and the bf16 copy when asked. fp32 arithmetic in the order torch.optim.AdamW uses.
#include "runtime/adamw.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "kernels/bf16.hpp"

namespace strata::detail {
namespace {

constexpr std::size_t kChunk = 4096;

}  // namespace

void adamw_update(const AdamHyper& h, std::int64_t step, float grad_scale, const AdamBuffers& b,
                  int threads) {
  const float lr = static_cast<float>(h.lr);
  const float beta1 = static_cast<float>(h.beta1);
  const float beta2 = static_cast<float>(h.beta2);
  const float eps = static_cast<float>(h.eps);
  const float wd = static_cast<float>(h.weight_decay);
  const double t = static_cast<double>(step);
  const float bc1 = static_cast<float>(1.0 - std::pow(h.beta1, t));
  const float bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(h.beta2, t)));
  const float step_size = lr / bc1;
  const float decay = h.decoupled ? 1.0f - lr * wd : 1.0f;
  const float l2 = h.decoupled ? 0.0f : wd;
  const auto n = static_cast<std::int64_t>(b.n);
#pragma omp parallel for num_threads(threads) schedule(static) if (n > 32768)
  for (std::int64_t i = 0; i < n; ++i) {
    float p = b.master[i];
    const float g = b.grad[i] * grad_scale + l2 * p;
    const float m = beta1 * b.exp_avg[i] + (1.0f - beta1) * g;
    const float v = beta2 * b.exp_avg_sq[i] + (1.0f - beta2) * g * g;
    b.exp_avg[i] = m;
    b.exp_avg_sq[i] = v;
    const float denom = std::sqrt(v) / bc2_sqrt + eps;
    p = p * decay - step_size * (m / denom);
    b.master[i] = p;
    if (b.param_out != nullptr) b.param_out[i] = kernels::f32_to_bf16_bits_rne(p);
  }
}

std::size_t sum_of_squares_chunks(std::size_t n) { return (n + kChunk - 1) / kChunk; }

double sum_of_squares(const float* grad, std::size_t n, int threads, double* partial) {
  const std::size_t chunks = sum_of_squares_chunks(n);
#pragma omp parallel for num_threads(threads) schedule(static) if (chunks > 8)
  for (std::size_t c = 0; c < chunks; ++c) {
    const std::size_t end = std::min(n, (c + 1) * kChunk);
    double s = 0.0;
    for (std::size_t i = c * kChunk; i < end; ++i) s += static_cast<double>(grad[i]) * grad[i];
    partial[c] = s;
  }
  double total = 0.0;
  for (std::size_t c = 0; c < chunks; ++c) total += partial[c];
  return total;
}

}  // namespace strata::detail
