// The device optimizer's gradient sum of squares on CUDA, in fp64 and deterministic: the buffer
// is cut into fixed chunks of kChunk elements; one block reduces each chunk (every thread adds
// its strided elements in order, then a fixed shared-memory tree); one block then reduces the
// chunk partials the same way (thread t adds partials t, t + kThreads, ... in order, then the
// tree). No atomics, and the order depends only on n, so the result repeats bit for bit.
#include <cuda_runtime.h>

#include "kernels/cuda_common.cuh"
#include "optim/grad_norm_cuda.hpp"

namespace strata::detail {
namespace {

constexpr std::size_t kChunk = 4096;
constexpr int kThreads = 256;

// s[0] = Σ s[0..kThreads) by a fixed pairwise tree; every thread of the block must call it.
__device__ __forceinline__ void block_tree_sum(double* s) {
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) s[threadIdx.x] += s[threadIdx.x + stride];
    __syncthreads();
  }
}

// grid: one block per chunk of grad.
__global__ void __launch_bounds__(kThreads) sum_of_squares_chunks(const float* grad, std::size_t n, double* partials) {
  __shared__ double s[kThreads];
  const std::size_t begin = static_cast<std::size_t>(blockIdx.x) * kChunk;
  const std::size_t end = begin + kChunk < n ? begin + kChunk : n;
  double acc = 0.0;
  for (std::size_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const double g = grad[i];
    acc += g * g;
  }
  s[threadIdx.x] = acc;
  block_tree_sum(s);
  if (threadIdx.x == 0) partials[blockIdx.x] = s[0];
}

// grid: one block.
__global__ void __launch_bounds__(kThreads) sum_partials(const double* partials, std::size_t count, double* result) {
  __shared__ double s[kThreads];
  double acc = 0.0;
  for (std::size_t i = threadIdx.x; i < count; i += kThreads) acc += partials[i];
  s[threadIdx.x] = acc;
  block_tree_sum(s);
  if (threadIdx.x == 0) *result = s[0];
}

}  // namespace

std::size_t sum_of_squares_cuda_partials(std::size_t n) { return (n + kChunk - 1) / kChunk; }

Status sum_of_squares_cuda(void* stream, const float* grad, std::size_t n, double* partials, double* result) {
  auto s = static_cast<cudaStream_t>(stream);
  const std::size_t chunks = sum_of_squares_cuda_partials(n);
  if (chunks > 0) {
    sum_of_squares_chunks<<<static_cast<unsigned>(chunks), kThreads, 0, s>>>(grad, n, partials);
    STRATA_RETURN_IF_ERROR(kernels::cuda::launch_status("gradient sum of squares"));
  }
  sum_partials<<<1, kThreads, 0, s>>>(partials, chunks, result);
  return kernels::cuda::launch_status("gradient sum of squares (partials)");
}

}  // namespace strata::detail
