// GELU (tanh form) and SwiGLU on CUDA; the formulas are in activation.cpp. Grid-stride loops
// over independent elements, so in-place use (dinp aliasing dout, out aliasing inp) is safe.
#include "kernels/cuda_common.cuh"
#include "kernels/cuda_ops.hpp"

namespace strata::kernels {
namespace {

using namespace cuda;

constexpr float kGeluScale = 0.7978845608028654f;  // √(2/π)
constexpr float kGeluCubic = 0.044715f;

// ---- kernels ----

template <class TO, class TI>
__global__ void gelu_forward_kernel(TO* out, const TI* inp, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float x = to_f32(inp[i]);
    const float u = kGeluScale * (x + kGeluCubic * x * x * x);
    out[i] = from_f32<TO>(0.5f * x * (1.0f + tanhf(u)));
  }
}

template <class TG, class TD, class TI>
__global__ void gelu_backward_kernel(TG* dinp, const TD* dout, const TI* inp, std::int64_t n, bool add) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float x = to_f32(inp[i]);
    const float u = kGeluScale * (x + kGeluCubic * x * x * x);
    const float th = tanhf(u);
    const float du = kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
    const float grad = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
    store(dinp, i, to_f32(dout[i]) * grad, add);
  }
}

// gate_up (rows, 2F) = [g | u]; out (rows, F)
template <class TO, class TI>
__global__ void swiglu_forward_kernel(TO* out, const TI* gate_up, std::int64_t rows, std::int64_t F) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < rows * F;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / F, f = i % F;
    const float g = to_f32(gate_up[r * 2 * F + f]);
    const float u = to_f32(gate_up[r * 2 * F + F + f]);
    out[i] = from_f32<TO>(g / (1.0f + expf(-g)) * u);
  }
}

template <class TG, class TD, class TI>
__global__ void swiglu_backward_kernel(TG* dgate_up, const TD* dout, const TI* gate_up, std::int64_t rows,
                                       std::int64_t F, bool add) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < rows * F;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / F, f = i % F;
    const float g = to_f32(gate_up[r * 2 * F + f]);
    const float u = to_f32(gate_up[r * 2 * F + F + f]);
    const float dy = to_f32(dout[i]);
    const float sig = 1.0f / (1.0f + expf(-g));
    store(dgate_up, r * 2 * F + f, dy * u * sig * (1.0f + g * (1.0f - sig)), add);
    store(dgate_up, r * 2 * F + F + f, dy * g * sig, add);
  }
}

}  // namespace

// ---- launchers ----

Status gelu_forward_cuda(const KernelContext& ctx, TensorArg out, ConstTensorArg inp, std::int64_t n) {
  dispatch(out.dtype, [&](auto to) {
    dispatch(inp.dtype, [&](auto ti) {
      using TO = typename decltype(to)::type;
      using TI = typename decltype(ti)::type;
      gelu_forward_kernel<<<grid_for(n, 256), 256, 0, stream_of(ctx)>>>(typed<TO>(out), typed<TI>(inp), n);
    });
  });
  return launch_status("gelu_forward");
}

Status gelu_backward_cuda(const KernelContext& ctx, TensorArg dinp, ConstTensorArg dout, ConstTensorArg inp,
                          std::int64_t n, Accumulate dinp_mode) {
  dispatch(dinp.dtype, [&](auto tg) {
    dispatch(dout.dtype, [&](auto td) {
      dispatch(inp.dtype, [&](auto ti) {
        using TG = typename decltype(tg)::type;
        using TD = typename decltype(td)::type;
        using TI = typename decltype(ti)::type;
        gelu_backward_kernel<<<grid_for(n, 256), 256, 0, stream_of(ctx)>>>(
            typed<TG>(dinp), typed<TD>(dout), typed<TI>(inp), n, dinp_mode == Accumulate::kAdd);
      });
    });
  });
  return launch_status("gelu_backward");
}

Status swiglu_forward_cuda(const KernelContext& ctx, TensorArg out, ConstTensorArg gate_up, std::int64_t rows,
                           std::int64_t F) {
  dispatch(out.dtype, [&](auto to) {
    dispatch(gate_up.dtype, [&](auto ti) {
      using TO = typename decltype(to)::type;
      using TI = typename decltype(ti)::type;
      swiglu_forward_kernel<<<grid_for(rows * F, 256), 256, 0, stream_of(ctx)>>>(typed<TO>(out),
                                                                                 typed<TI>(gate_up), rows, F);
    });
  });
  return launch_status("swiglu_forward");
}

Status swiglu_backward_cuda(const KernelContext& ctx, TensorArg dgate_up, ConstTensorArg dout,
                            ConstTensorArg gate_up, std::int64_t rows, std::int64_t F, Accumulate dinp_mode) {
  dispatch(dgate_up.dtype, [&](auto tg) {
    dispatch(dout.dtype, [&](auto td) {
      dispatch(gate_up.dtype, [&](auto ti) {
        using TG = typename decltype(tg)::type;
        using TD = typename decltype(td)::type;
        using TI = typename decltype(ti)::type;
        swiglu_backward_kernel<<<grid_for(rows * F, 256), 256, 0, stream_of(ctx)>>>(
            typed<TG>(dgate_up), typed<TD>(dout), typed<TI>(gate_up), rows, F, dinp_mode == Accumulate::kAdd);
      });
    });
  });
  return launch_status("swiglu_backward");
}

}  // namespace strata::kernels
