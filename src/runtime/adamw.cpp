// Scalar AdamW (see adamw.hpp). One pass per buffer: read master, gradient and moments, write
// them back, and the bf16 copy when asked. fp32 arithmetic in the order torch.optim.AdamW uses.
#include "runtime/adamw.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "kernels/bf16.hpp"
#include "kernels/cpu_math.hpp"

namespace strata::detail {
namespace {

constexpr std::size_t kChunk = 4096;

}  // namespace

namespace {

// One chunk [begin, end): the update, vectorised (compiled per x86-64 level, chosen at load
// time); kWriteBf16 also writes the bf16 copy.
template <bool kWriteBf16>
STRATA_CPU_CLONES void adamw_chunk(const AdamBuffers& b, std::int64_t begin, std::int64_t end,
                                   float grad_scale, float l2, float beta1, float beta2, float bc2_sqrt,
                                   float eps, float step_size, float decay) {
  float* __restrict master = b.master;
  const float* __restrict grad = b.grad;
  float* __restrict m1 = b.exp_avg;
  float* __restrict m2 = b.exp_avg_sq;
  std::uint16_t* __restrict out = b.param_out;
#pragma omp simd
  for (std::int64_t i = begin; i < end; ++i) {
    float p = master[i];
    const float g = grad[i] * grad_scale + l2 * p;
    const float m = beta1 * m1[i] + (1.0f - beta1) * g;
    const float v = beta2 * m2[i] + (1.0f - beta2) * g * g;
    m1[i] = m;
    m2[i] = v;
    const float denom = std::sqrt(v) / bc2_sqrt + eps;
    p = p * decay - step_size * (m / denom);
    master[i] = p;
    if constexpr (kWriteBf16) out[i] = kernels::f32_to_bf16_bits_rne(p);
  }
}

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
  const auto chunk = static_cast<std::int64_t>(kChunk);
  const std::int64_t chunks = (n + chunk - 1) / chunk;
  // Elements are independent: any split gives the same bits.
#pragma omp parallel for num_threads(threads) schedule(static) if (chunks > 8)
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::int64_t begin = c * chunk, end = std::min(n, begin + chunk);
    if (b.param_out != nullptr) {
      adamw_chunk<true>(b, begin, end, grad_scale, l2, beta1, beta2, bc2_sqrt, eps, step_size, decay);
    } else {
      adamw_chunk<false>(b, begin, end, grad_scale, l2, beta1, beta2, bc2_sqrt, eps, step_size, decay);
    }
  }
}

std::size_t sum_of_squares_chunks(std::size_t n) { return (n + kChunk - 1) / kChunk; }

double sum_of_squares(const float* grad, std::size_t n, int threads, double* partial) {
  const std::size_t chunks = sum_of_squares_chunks(n);
#pragma omp parallel for num_threads(threads) schedule(static) if (chunks > 8)
  for (std::size_t c = 0; c < chunks; ++c) {
    const std::size_t end = std::min(n, (c + 1) * kChunk);
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (std::size_t i = c * kChunk; i < end; ++i) s += static_cast<double>(grad[i]) * grad[i];
    partial[c] = s;
  }
  double total = 0.0;
  for (std::size_t c = 0; c < chunks; ++c) total += partial[c];
  return total;
}

}  // namespace strata::detail
