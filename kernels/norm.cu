// LayerNorm and RMSNorm on CUDA (the formulas are in norm.cpp).
// Forward and the input gradient: one warp per row, two passes over the row (statistics, then
// output), reductions by warp shuffles in a fixed order. Weight gradients: a column-sum kernel
// (cuda_common.cuh) that recomputes x̂ from the saved mean and rstd; it reads the activations
// once more but needs no workspace and no atomics, so the sums are deterministic.
#include "kernels/cuda_common.cuh"
#include "kernels/cuda_ops.hpp"

namespace strata::kernels {
namespace {

using namespace cuda;

constexpr int kWarpsPerBlock = 4;

// ---- kernels ----

// rms = false: LayerNorm; true: RMSNorm (mean is then 0 and not stored).
template <bool kRms, class TO, class TI, class TW, class TB>
__global__ void norm_forward_kernel(TO* out, float* mean, float* rstd, const TI* inp, const TW* weight,
                                    const TB* bias, std::int64_t rows, std::int64_t C, float eps) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const TI* x = inp + r * C;
  float mu = 0.0f;
  if (!kRms) {
    for (std::int64_t c = lane; c < C; c += 32) mu += to_f32(x[c]);
    mu = warp_sum(mu) / static_cast<float>(C);
  }
  float sq = 0.0f;
  for (std::int64_t c = lane; c < C; c += 32) {
    const float d = to_f32(x[c]) - mu;
    sq += d * d;
  }
  const float rs = rsqrtf(warp_sum(sq) / static_cast<float>(C) + eps);
  for (std::int64_t c = lane; c < C; c += 32) {
    float y = (to_f32(x[c]) - mu) * rs * to_f32(weight[c]);
    if (bias != nullptr) y += to_f32(bias[c]);
    out[r * C + c] = from_f32<TO>(y);
  }
  if (lane == 0) {
    if (mean != nullptr) mean[r] = mu;
    if (rstd != nullptr) rstd[r] = rs;
  }
}

template <bool kRms, class TG, class TD, class TI, class TW>
__global__ void norm_backward_input_kernel(TG* dinp, const TD* dout, const TI* inp, const TW* weight,
                                           const float* mean, const float* rstd, std::int64_t rows,
                                           std::int64_t C, bool add) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const float mu = kRms ? 0.0f : mean[r];
  const float rs = rstd[r];
  const TI* x = inp + r * C;
  const TD* dy = dout + r * C;
  float g_sum = 0.0f, gx_sum = 0.0f;
  for (std::int64_t c = lane; c < C; c += 32) {
    const float g = to_f32(dy[c]) * to_f32(weight[c]);
    g_sum += g;
    gx_sum += g * (to_f32(x[c]) - mu) * rs;
  }
  const float g_mean = kRms ? 0.0f : warp_sum(g_sum) / static_cast<float>(C);
  const float gx_mean = warp_sum(gx_sum) / static_cast<float>(C);
  for (std::int64_t c = lane; c < C; c += 32) {
    const float xhat = (to_f32(x[c]) - mu) * rs;
    const float g = to_f32(dy[c]) * to_f32(weight[c]);
    store(dinp, r * C + c, rs * (g - g_mean - xhat * gx_mean), add);
  }
}

// dweight (C) += Σ_r dy·x̂, dbias (C) += Σ_r dy; either may be null.
template <bool kRms, class TD, class TI, class TGW, class TGB>
struct NormWeightGrads {
  static constexpr int kSums = 2;
  TGW* dweight;
  TGB* dbias;
  const TD* dout;
  const TI* inp;
  const float* mean;
  const float* rstd;
  std::int64_t C;
  __device__ void values(std::int64_t r, std::int64_t c, float (&acc)[2]) const {
    const float dy = to_f32(dout[r * C + c]);
    const float xhat = (to_f32(inp[r * C + c]) - (kRms ? 0.0f : mean[r])) * rstd[r];
    acc[0] += dy * xhat;
    acc[1] += dy;
  }
  __device__ void finish(std::int64_t c, const float (&sums)[2]) const {
    if (dweight != nullptr) store(dweight, c, sums[0], true);
    if (dbias != nullptr) store(dbias, c, sums[1], true);
  }
};

unsigned row_blocks(std::int64_t rows) {
  return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

template <bool kRms>
Status norm_forward(std::string_view op, const KernelContext& ctx, TensorArg out, float* mean, float* rstd,
                    ConstTensorArg inp, ConstTensorArg weight, ConstTensorArg bias, std::int64_t rows,
                    std::int64_t C, float eps) {
  dispatch(out.dtype, [&](auto to) {
    dispatch(inp.dtype, [&](auto ti) {
      dispatch(weight.dtype, [&](auto tw) {
        dispatch(bias.dtype, [&](auto tb) {
          using TO = typename decltype(to)::type;
          using TI = typename decltype(ti)::type;
          using TW = typename decltype(tw)::type;
          using TB = typename decltype(tb)::type;
          norm_forward_kernel<kRms><<<row_blocks(rows), 32 * kWarpsPerBlock, 0, stream_of(ctx)>>>(
              typed<TO>(out), mean, rstd, typed<TI>(inp), typed<TW>(weight), typed<TB>(bias), rows, C, eps);
        });
      });
    });
  });
  return launch_status(op);
}

template <bool kRms>
Status norm_backward(std::string_view op, const KernelContext& ctx, TensorArg dinp, TensorArg dweight,
                     TensorArg dbias, ConstTensorArg dout, ConstTensorArg inp, ConstTensorArg weight,
                     const float* mean, const float* rstd, std::int64_t rows, std::int64_t C,
                     Accumulate dinp_mode) {
  cudaStream_t stream = stream_of(ctx);
  dispatch(dout.dtype, [&](auto td) {
    dispatch(inp.dtype, [&](auto ti) {
      using TD = typename decltype(td)::type;
      using TI = typename decltype(ti)::type;
      if (dinp.data != nullptr) {
        dispatch(dinp.dtype, [&](auto tg) {
          dispatch(weight.dtype, [&](auto tw) {
            using TG = typename decltype(tg)::type;
            using TW = typename decltype(tw)::type;
            norm_backward_input_kernel<kRms><<<row_blocks(rows), 32 * kWarpsPerBlock, 0, stream>>>(
                typed<TG>(dinp), typed<TD>(dout), typed<TI>(inp), typed<TW>(weight), mean, rstd, rows, C,
                dinp_mode == Accumulate::kAdd);
          });
        });
      }
      if (dweight.data != nullptr || dbias.data != nullptr) {
        dispatch(dweight.dtype, [&](auto tgw) {
          dispatch(dbias.dtype, [&](auto tgb) {
            using TGW = typename decltype(tgw)::type;
            using TGB = typename decltype(tgb)::type;
            const NormWeightGrads<kRms, TD, TI, TGW, TGB> grads{
                typed<TGW>(dweight), typed<TGB>(dbias), typed<TD>(dout), typed<TI>(inp), mean, rstd, C};
            launch_column_sums(grads, rows, C, stream);
          });
        });
      }
    });
  });
  return launch_status(op);
}

}  // namespace

// ---- launchers ----

Status layernorm_forward_cuda(const KernelContext& ctx, TensorArg out, float* mean, float* rstd,
                              ConstTensorArg inp, ConstTensorArg weight, ConstTensorArg bias,
                              std::int64_t rows, std::int64_t C, float eps) {
  return norm_forward<false>("layernorm_forward", ctx, out, mean, rstd, inp, weight, bias, rows, C, eps);
}

Status layernorm_backward_cuda(const KernelContext& ctx, TensorArg dinp, TensorArg dweight, TensorArg dbias,
                               ConstTensorArg dout, ConstTensorArg inp, ConstTensorArg weight,
                               const float* mean, const float* rstd, std::int64_t rows, std::int64_t C,
                               Accumulate dinp_mode) {
  return norm_backward<false>("layernorm_backward", ctx, dinp, dweight, dbias, dout, inp, weight, mean, rstd,
                              rows, C, dinp_mode);
}

Status rmsnorm_forward_cuda(const KernelContext& ctx, TensorArg out, float* rstd, ConstTensorArg inp,
                            ConstTensorArg weight, std::int64_t rows, std::int64_t C, float eps) {
  return norm_forward<true>("rmsnorm_forward", ctx, out, nullptr, rstd, inp, weight, kNone, rows, C, eps);
}

Status rmsnorm_backward_cuda(const KernelContext& ctx, TensorArg dinp, TensorArg dweight, ConstTensorArg dout,
                             ConstTensorArg inp, ConstTensorArg weight, const float* rstd, std::int64_t rows,
                             std::int64_t C, Accumulate dinp_mode) {
  return norm_backward<true>("rmsnorm_backward", ctx, dinp, dweight, kNoOutput, dout, inp, weight, nullptr,
                             rstd, rows, C, dinp_mode);
}

}  // namespace strata::kernels
