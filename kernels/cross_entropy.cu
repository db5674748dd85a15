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

}  // namespace strata::kernels
