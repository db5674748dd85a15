// The device optimizer on CUDA: a deterministic sum of squares (fixed chunks, each reduced by one
// block in a fixed tree, then the partials added in order by one thread) and the AdamW update,
// the same fp32 arithmetic as the cpu path in adamw.cpp (the order of operations matches; the
// results may differ in the last bit where nvcc contracts to fused multiply-adds).
#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "kernels/bf16.hpp"
#include "runtime/optimizer_cuda.hpp"

namespace strata::detail {
namespace {

constexpr std::size_t kChunk = 4096;
constexpr int kThreads = 256;

__global__ void sum_of_squares_chunks(const float* grad, std::size_t n, double* partials) {
  __shared__ double s[kThreads];
  const std::size_t begin = static_cast<std::size_t>(blockIdx.x) * kChunk;
  const std::size_t end = begin + kChunk < n ? begin + kChunk : n;
  double acc = 0.0;
  for (std::size_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const double g = grad[i];
    acc += g * g;
  }
  s[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) s[threadIdx.x] += s[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = s[0];
}

__global__ void sum_partials(const double* partials, std::size_t count, double* result) {
  double total = 0.0;
  for (std::size_t i = 0; i < count; ++i) total += partials[i];
  *result = total;
}

__global__ void adamw_kernel(float* master, const float* grad, float* exp_avg, float* exp_avg_sq,
                             std::uint16_t* param_out, std::size_t n, float grad_scale, float l2, float beta1,
                             float beta2, float bc2_sqrt, float eps, float step_size, float decay) {
  const std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float p = master[i];
  const float g = grad[i] * grad_scale + l2 * p;
  const float m = beta1 * exp_avg[i] + (1.0f - beta1) * g;
  const float v = beta2 * exp_avg_sq[i] + (1.0f - beta2) * g * g;
  exp_avg[i] = m;
  exp_avg_sq[i] = v;
  const float denom = sqrtf(v) / bc2_sqrt + eps;
  p = p * decay - step_size * (m / denom);
  master[i] = p;
  if (param_out != nullptr) param_out[i] = kernels::f32_to_bf16_bits_rne(p);
}

Status launch_status(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return device_error(std::string(what) + ": launch failed: " + cudaGetErrorString(e));
  return ok_status();
}

}  // namespace

std::size_t sum_of_squares_cuda_partials(std::size_t n) { return (n + kChunk - 1) / kChunk; }

Status sum_of_squares_cuda(void* stream, const float* grad, std::size_t n, double* partials, double* result) {
  auto s = static_cast<cudaStream_t>(stream);
  const std::size_t chunks = sum_of_squares_cuda_partials(n);
  if (chunks > 0) {
    sum_of_squares_chunks<<<static_cast<unsigned>(chunks), kThreads, 0, s>>>(grad, n, partials);
    STRATA_RETURN_IF_ERROR(launch_status("gradient sum of squares"));
  }
  sum_partials<<<1, 1, 0, s>>>(partials, chunks, result);
  return launch_status("gradient sum of squares (partials)");
}

Status adamw_update_cuda(void* stream, const AdamHyper& h, std::int64_t step, float grad_scale,
                         const AdamBuffers& b) {
  if (b.n == 0) return ok_status();
  const double t = static_cast<double>(step);
  const float lr = static_cast<float>(h.lr);
  const float wd = static_cast<float>(h.weight_decay);
  const float bc1 = static_cast<float>(1.0 - std::pow(h.beta1, t));
  const float bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(h.beta2, t)));
  const unsigned blocks = static_cast<unsigned>((b.n + kThreads - 1) / kThreads);
  adamw_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      b.master, b.grad, b.exp_avg, b.exp_avg_sq, b.param_out, b.n, grad_scale, h.decoupled ? 0.0f : wd,
      static_cast<float>(h.beta1), static_cast<float>(h.beta2), bc2_sqrt, static_cast<float>(h.eps), lr / bc1,
      h.decoupled ? 1.0f - lr * wd : 1.0f);
  return launch_status("AdamW update");
}

}  // namespace strata::detail
