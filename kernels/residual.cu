// Residual connection on CUDA: out = a + b, and its backward da (=|+=) dout, db (=|+=) dout.
// Grid-stride loops; every element is independent, so aliasing out with a or b is safe.
#include "kernels/cuda_common.cuh"
#include "kernels/cuda_ops.hpp"

namespace strata::kernels {
namespace {

using namespace cuda;

// ---- kernels ----

template <class TO, class TA, class TB>
__global__ void residual_forward_kernel(TO* out, const TA* a, const TB* b, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    out[i] = from_f32<TO>(to_f32(a[i]) + to_f32(b[i]));
  }
}

template <class TG, class TD>
__global__ void residual_backward_kernel(TG* dx, const TD* dout, std::int64_t n, bool add) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    store(dx, i, to_f32(dout[i]), add);
  }
}

}  // namespace

// ---- launchers ----

Status residual_forward_cuda(const KernelContext& ctx, TensorArg out, ConstTensorArg a, ConstTensorArg b,
                             std::int64_t n) {
  dispatch(out.dtype, [&](auto to) {
    dispatch(a.dtype, [&](auto ta) {
      dispatch(b.dtype, [&](auto tb) {
        using TO = typename decltype(to)::type;
        using TA = typename decltype(ta)::type;
        using TB = typename decltype(tb)::type;
        residual_forward_kernel<<<grid_for(n, 256), 256, 0, stream_of(ctx)>>>(typed<TO>(out), typed<TA>(a),
                                                                              typed<TB>(b), n);
      });
    });
  });
  return launch_status("residual_forward");
}

Status residual_backward_cuda(const KernelContext& ctx, TensorArg da, TensorArg db, ConstTensorArg dout,
                              std::int64_t n, Accumulate mode) {
  for (TensorArg dx : {da, db}) {
    if (dx.data == nullptr) continue;
    dispatch(dx.dtype, [&](auto tg) {
      dispatch(dout.dtype, [&](auto td) {
        using TG = typename decltype(tg)::type;
        using TD = typename decltype(td)::type;
        residual_backward_kernel<<<grid_for(n, 256), 256, 0, stream_of(ctx)>>>(typed<TG>(dx), typed<TD>(dout),
                                                                               n, mode == Accumulate::kAdd);
      });
    });
  }
  return launch_status("residual_backward");
}

}  // namespace strata::kernels
