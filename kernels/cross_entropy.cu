// Fused softmax + cross-entropy on CUDA (the formulas are in cross_entropy.cpp). One block per
// row. The forward makes one pass: each thread keeps a running (max, Σexp) over its strided
// columns, and the block merges the pairs in a fixed tree. The backward recomputes each
// probability from the saved lse; every element is read and written by the same thread, so
// dlogits may alias logits. A target ≥ V gives a NaN loss (no device-side error channel).
#include "kernels/cuda_common.cuh"
#include "kernels/cuda_ops.hpp"

namespace strata::kernels {
namespace {

using namespace cuda;

constexpr int kThreads = 256;

// ---- kernels ----

// Merges running softmax statistics (m, s) = (max, Σ exp(z - max)).
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;
  s = s * expf(m - mx) + s2 * expf(m2 - mx);
  m = mx;
}

template <class TL>
__global__ void cross_entropy_forward_kernel(float* losses, float* lse, const TL* logits,
                                             const std::int32_t* targets, std::int64_t V, std::int64_t Vp) {
  __shared__ float shared_m[kThreads / 32], shared_s[kThreads / 32];
  const std::int64_t n = blockIdx.x;
  const TL* z = logits + n * Vp;
  float m = -INFINITY, s = 0.0f;
  for (std::int64_t v = threadIdx.x; v < V; v += blockDim.x) merge(m, s, to_f32(z[v]), 1.0f);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
    merge(m, s, m2, s2);
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    shared_m[warp] = m;
    shared_s[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float bm = shared_m[0], bs = shared_s[0];
    for (int w = 1; w < kThreads / 32; ++w) merge(bm, bs, shared_m[w], shared_s[w]);
    const float row_lse = bm + logf(bs);
    if (lse != nullptr) lse[n] = row_lse;
    const std::int32_t y = targets[n];
    losses[n] = y < 0 ? 0.0f : (y >= V ? NAN : row_lse - to_f32(z[y]));
  }
}

template <class TG, class TL>
__global__ void cross_entropy_backward_kernel(TG* dlogits, const TL* logits, const float* lse,
                                              const std::int32_t* targets, float dloss, std::int64_t V,
                                              std::int64_t Vp) {
  const std::int64_t n = blockIdx.x;
  const std::int32_t y = targets[n];
  const float row_lse = lse[n];
  for (std::int64_t v = threadIdx.x; v < Vp; v += blockDim.x) {
    float d = 0.0f;
    if (y >= 0 && v < V) d = (expf(to_f32(logits[n * Vp + v]) - row_lse) - (v == y ? 1.0f : 0.0f)) * dloss;
    if (y >= V) d = NAN;
    dlogits[n * Vp + v] = from_f32<TG>(d);
  }
}

// ---- vocabulary shards (formulas in kernels.hpp): one block per row, fixed-order tree merges ----

// Block-wide reduction of one float per thread with `op`, in a fixed order; thread 0 gets it.
template <class Op>
__device__ float block_reduce(float x, Op op) {
  __shared__ float shared[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) x = op(x, shared[w]);
  }
  return x;
}

struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct AddOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};

template <class TL>
__global__ void cross_entropy_shard_max_kernel(float* row_max, const TL* logits, std::int64_t Vs, std::int64_t R) {
  const std::int64_t n = blockIdx.x;
  float m = -INFINITY;
  for (std::int64_t v = threadIdx.x; v < R; v += blockDim.x) m = fmaxf(m, to_f32(logits[n * Vs + v]));
  m = block_reduce(m, MaxOp{});
  if (threadIdx.x == 0) row_max[n] = m;
}

template <class TL>
__global__ void cross_entropy_shard_sums_kernel(float* sums, const TL* logits, const float* row_max,
                                                const std::int32_t* targets, std::int64_t N, std::int64_t Vs,
                                                std::int64_t R, std::int64_t vocab_begin) {
  const std::int64_t n = blockIdx.x;
  const float m = row_max[n];
  float s = 0.0f;
  for (std::int64_t v = threadIdx.x; v < R; v += blockDim.x) s += expf(to_f32(logits[n * Vs + v]) - m);
  s = block_reduce(s, AddOp{});
  if (threadIdx.x == 0) {
    sums[n] = s;
    const std::int64_t y = static_cast<std::int64_t>(targets[n]) - vocab_begin;
    sums[N + n] = (targets[n] >= 0 && y >= 0 && y < R) ? to_f32(logits[n * Vs + y]) : 0.0f;
  }
}

__global__ void cross_entropy_shard_finish_kernel(float* losses, float* lse, const float* row_max,
                                                  const float* sums, const std::int32_t* targets, std::int64_t N) {
  for (std::int64_t n = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; n < N;
       n += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float row_lse = row_max[n] + logf(sums[n]);
    if (lse != nullptr) lse[n] = row_lse;
    losses[n] = targets[n] < 0 ? 0.0f : row_lse - sums[N + n];
  }
}

template <class TG, class TL>
__global__ void cross_entropy_shard_backward_kernel(TG* dlogits, const TL* logits, const float* lse,
                                                    const std::int32_t* targets, float dloss, std::int64_t Vs,
                                                    std::int64_t R, std::int64_t vocab_begin) {
  const std::int64_t n = blockIdx.x;
  const std::int32_t target = targets[n];
  const std::int64_t y = static_cast<std::int64_t>(target) - vocab_begin;
  const float row_lse = lse[n];
  for (std::int64_t v = threadIdx.x; v < Vs; v += blockDim.x) {
    float d = 0.0f;
    if (target >= 0 && v < R) d = (expf(to_f32(logits[n * Vs + v]) - row_lse) - (v == y ? 1.0f : 0.0f)) * dloss;
    dlogits[n * Vs + v] = from_f32<TG>(d);
  }
}

std::int64_t real_columns(std::int64_t Vs, std::int64_t vocab_begin, std::int64_t V) {
  const std::int64_t r = V - vocab_begin;
  return r < 0 ? 0 : (r > Vs ? Vs : r);
}

}  // namespace

// ---- launchers ----

Status cross_entropy_forward_cuda(const KernelContext& ctx, float* losses, float* lse, ConstTensorArg logits,
                                  const std::int32_t* targets, std::int64_t N, std::int64_t V,
                                  std::int64_t Vp) {
  dispatch(logits.dtype, [&](auto tl) {
    using TL = typename decltype(tl)::type;
    cross_entropy_forward_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream_of(ctx)>>>(
        losses, lse, typed<TL>(logits), targets, V, Vp);
  });
  return launch_status("cross_entropy_forward");
}

Status cross_entropy_backward_cuda(const KernelContext& ctx, TensorArg dlogits, ConstTensorArg logits,
                                   const float* lse, const std::int32_t* targets, float dloss, std::int64_t N,
                                   std::int64_t V, std::int64_t Vp) {
  dispatch(dlogits.dtype, [&](auto tg) {
    dispatch(logits.dtype, [&](auto tl) {
      using TG = typename decltype(tg)::type;
      using TL = typename decltype(tl)::type;
      cross_entropy_backward_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream_of(ctx)>>>(
          typed<TG>(dlogits), typed<TL>(logits), lse, targets, dloss, V, Vp);
    });
  });
  return launch_status("cross_entropy_backward");
}

Status cross_entropy_shard_max_cuda(const KernelContext& ctx, float* row_max, ConstTensorArg logits, std::int64_t N,
                                    std::int64_t Vs, std::int64_t vocab_begin, std::int64_t V) {
  const std::int64_t R = real_columns(Vs, vocab_begin, V);
  dispatch(logits.dtype, [&](auto tl) {
    using TL = typename decltype(tl)::type;
    cross_entropy_shard_max_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream_of(ctx)>>>(
        row_max, typed<TL>(logits), Vs, R);
  });
  return launch_status("cross_entropy_shard_max");
}

Status cross_entropy_shard_sums_cuda(const KernelContext& ctx, float* sums, ConstTensorArg logits,
                                     const float* row_max, const std::int32_t* targets, std::int64_t N,
                                     std::int64_t Vs, std::int64_t vocab_begin, std::int64_t V) {
  const std::int64_t R = real_columns(Vs, vocab_begin, V);
  dispatch(logits.dtype, [&](auto tl) {
    using TL = typename decltype(tl)::type;
    cross_entropy_shard_sums_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream_of(ctx)>>>(
        sums, typed<TL>(logits), row_max, targets, N, Vs, R, vocab_begin);
  });
  return launch_status("cross_entropy_shard_sums");
}

Status cross_entropy_shard_finish_cuda(const KernelContext& ctx, float* losses, float* lse, const float* row_max,
                                       const float* sums, const std::int32_t* targets, std::int64_t N) {
  cross_entropy_shard_finish_kernel<<<grid_for(N, kThreads), kThreads, 0, stream_of(ctx)>>>(losses, lse, row_max,
                                                                                              sums, targets, N);
  return launch_status("cross_entropy_shard_finish");
}

Status cross_entropy_shard_backward_cuda(const KernelContext& ctx, TensorArg dlogits, ConstTensorArg logits,
                                         const float* lse, const std::int32_t* targets, float dloss,
                                         std::int64_t N, std::int64_t Vs, std::int64_t vocab_begin,
                                         std::int64_t V) {
  const std::int64_t R = real_columns(Vs, vocab_begin, V);
  dispatch(dlogits.dtype, [&](auto tg) {
    dispatch(logits.dtype, [&](auto tl) {
      using TG = typename decltype(tg)::type;
      using TL = typename decltype(tl)::type;
      cross_entropy_shard_backward_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream_of(ctx)>>>(
          typed<TG>(dlogits), typed<TL>(logits), lse, targets, dloss, Vs, R, vocab_begin);
    });
  });
  return launch_status("cross_entropy_shard_backward");
}

}  // namespace strata::kernels
