// Rotary position embedding on CUDA (the formula is in rope.cpp): one thread per rotated pair
// (x[i], x[i+D/2]) of one head of one token, reading cos/sin from the precomputed table. The
// thread reads both elements before writing them, so in-place use is safe.
#include "kernels/cuda_common.cuh"
#include "kernels/cuda_ops.hpp"

namespace strata::kernels {
namespace {

using namespace cuda;

// ---- kernel ----

// x (B,T,H,D), tokens row_stride apart; sign = -1 rotates back (the backward).
template <class TO, class TI>
__global__ void rope_kernel(TO* out, const TI* inp, const float* table, std::int64_t BT, std::int64_t T,
                            std::int64_t H, std::int64_t D, std::int64_t row_stride, float sign) {
  const std::int64_t half = D / 2;
  const std::int64_t pairs = BT * H * half;
  for (std::int64_t p = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; p < pairs;
       p += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i = p % half;
    const std::int64_t h = (p / half) % H;
    const std::int64_t bt = p / (half * H);
    const std::int64_t t = bt % T;
    const float c = table[(t * half + i) * 2];
    const float s = sign * table[(t * half + i) * 2 + 1];
    const std::int64_t o = bt * row_stride + h * D + i;
    const float x1 = to_f32(inp[o]);
    const float x2 = to_f32(inp[o + half]);
    out[o] = from_f32<TO>(x1 * c - x2 * s);
    out[o + half] = from_f32<TO>(x2 * c + x1 * s);
  }
}

}  // namespace

// ---- launcher ----

Status rope_forward_cuda(const KernelContext& ctx, TensorArg out, ConstTensorArg inp, const float* table,
                         std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t D,
                         std::int64_t row_stride, bool inverse) {
  const std::int64_t pairs = B * T * H * (D / 2);
  dispatch(out.dtype, [&](auto to) {
    dispatch(inp.dtype, [&](auto ti) {
      using TO = typename decltype(to)::type;
      using TI = typename decltype(ti)::type;
      rope_kernel<<<grid_for(pairs, 256), 256, 0, stream_of(ctx)>>>(
          typed<TO>(out), typed<TI>(inp), table, B * T, T, H, D, row_stride, inverse ? -1.0f : 1.0f);
    });
  });
  return launch_status(inverse ? "rope_backward" : "rope_forward");
}

}  // namespace strata::kernels
