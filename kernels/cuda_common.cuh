// Device-side helpers shared by the CUDA kernel families: storage-type conversion and dispatch,
// deterministic warp/block reductions, a column-sum kernel for weight gradients, and launch
// error reporting. Included only by .cu files.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "kernels/bf16.hpp"
#include "kernels/kernels.hpp"

namespace strata::kernels::cuda {

inline cudaStream_t stream_of(const KernelContext& ctx) { return static_cast<cudaStream_t>(ctx.cuda_stream); }

// A launch that failed to start (bad configuration, no device, an earlier sticky error) is
// reported here; faults inside a running kernel surface at the stream's next synchronize.
// cudaErrorNotReady is never a launch failure: it is what a poll of unfinished work leaves as the
// thread's last error (the device backend clears it after its own polls; a poll elsewhere, in a
// library or a test, must not turn the next launch into a failure either).
inline Status launch_status(std::string_view op) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess || err == cudaErrorNotReady) return ok_status();
  return device_error(std::string(op) + ": kernel launch failed: " + cudaGetErrorName(err) + " (" +
                      cudaGetErrorString(err) + ")");
}

// ---- storage types: float, bf16 as uint16_t bit patterns, or fp16 as __half ----

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(std::uint16_t x) { return bf16_bits_to_f32(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <class T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ std::uint16_t from_f32<std::uint16_t>(float x) {
  return f32_to_bf16_bits_rne(x);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) {
  return __float2half_rn(x);
}

// p[i] = v, or p[i] += v (in fp32, one rounding) when `add`.
template <class T>
__device__ __forceinline__ void store(T* p, std::int64_t i, float v, bool add) {
  p[i] = from_f32<T>(add ? to_f32(p[i]) + v : v);
}

template <class T>
struct TypeTag {
  using type = T;
};

// Calls fn(TypeTag<float>), fn(TypeTag<uint16_t>) (bf16) or fn(TypeTag<__half>) (fp16) for the
// storage type `dtype`.
template <class Fn>
auto dispatch(DType dtype, Fn&& fn) {
  if (dtype == DType::kF32) return fn(TypeTag<float>{});
  if (dtype == DType::kF16) return fn(TypeTag<__half>{});
  return fn(TypeTag<std::uint16_t>{});
}

template <class T>
const T* typed(ConstTensorArg t) {
  return static_cast<const T*>(t.data);
}
template <class T>
T* typed(TensorArg t) {
  return static_cast<T*>(t.data);
}

// ---- reductions (fixed order, so results repeat bit for bit) ----

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block; every thread gets the result. `shared` holds 32 floats; blockDim.x is a
// multiple of 32.
__device__ __forceinline__ float block_sum(float v, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : 0.0f;
  return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : -INFINITY;
  return warp_max(v);
}

// Column sums over rows, for weight and bias gradients. Block (32, 32) owns 32 columns: thread
// (x, y) adds Op::values(r, c) for rows r = y, y + 32, ... in order, then thread (x, 0) adds the
// 32 lanes in order and calls Op::finish(c, sums). No atomics, so the result is deterministic.
// Op provides:  static constexpr int kSums;
//               __device__ void values(int64 r, int64 c, float (&acc)[kSums]) const;  // acc += ...
//               __device__ void finish(int64 c, const float (&sums)[kSums]) const;
// 1024 threads per block: without the bound nvcc may give the kernel more registers than a
// 1024-thread block can have, and the launch fails with "too many resources requested".
template <class Op>
__global__ void __launch_bounds__(1024) column_sums_kernel(Op op, std::int64_t rows, std::int64_t cols) {
  __shared__ float partial[Op::kSums][32][33];
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float acc[Op::kSums];
#pragma unroll
  for (int s = 0; s < Op::kSums; ++s) acc[s] = 0.0f;
  if (c < cols) {
    for (std::int64_t r = threadIdx.y; r < rows; r += 32) op.values(r, c, acc);
  }
#pragma unroll
  for (int s = 0; s < Op::kSums; ++s) partial[s][threadIdx.y][threadIdx.x] = acc[s];
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float sums[Op::kSums];
#pragma unroll
    for (int s = 0; s < Op::kSums; ++s) {
      float total = 0.0f;
      for (int y = 0; y < 32; ++y) total += partial[s][y][threadIdx.x];
      sums[s] = total;
    }
    op.finish(c, sums);
  }
}

template <class Op>
void launch_column_sums(const Op& op, std::int64_t rows, std::int64_t cols, cudaStream_t stream) {
  const dim3 block(32, 32);
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32));
  column_sums_kernel<Op><<<grid, block, 0, stream>>>(op, rows, cols);
}

// Blocks for a grid-stride loop over n elements with `threads` per block.
inline unsigned grid_for(std::int64_t n, int threads) {
  const std::int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

}  // namespace strata::kernels::cuda
