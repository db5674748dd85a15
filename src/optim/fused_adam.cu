// Fused AdamW / Adam over many tensors on a CUDA device.
//
// What it computes: for every element of every tensor, the update of kernel_body.inc (the CPU
// optimizer's), with the same fp32 operations in the same order, written with explicit
// round-to-nearest intrinsics (__fmaf_rn, __fmul_rn, __fdiv_rn, __fsqrt_rn) so that nvcc cannot
// contract or approximate anything: the device result equals CpuOptimizer::update bit for bit.
// The updated master is also written, rounded to nearest even, into the tensor's working
// parameters (bf16, fp16 or fp32).
//
// Layout: tensors are cut into chunks of kChunk elements; one thread block updates one chunk.
// A launch carries up to kMaxTensors tensor descriptors and kMaxBlocks (tensor, chunk) pairs in
// its parameter block, so no device-side table (and no device allocation) is needed; large
// lists take several launches on the same stream.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "optim/numerics.hpp"
#include "strata/optim.hpp"

namespace strata {
namespace {

using optim_detail::UpdateConstants;

constexpr int kMaxTensors = 24;
constexpr int kMaxBlocks = 320;
constexpr std::size_t kChunk = 1 << 16;
constexpr int kThreads = 256;

struct TensorList {
  void* param[kMaxTensors];
  float* master[kMaxTensors];
  float* exp_avg[kMaxTensors];
  float* exp_avg_sq[kMaxTensors];
  const void* grad[kMaxTensors];
  std::uint64_t n[kMaxTensors];
  std::uint8_t block_tensor[kMaxBlocks];
  std::uint32_t block_chunk[kMaxBlocks];
};
static_assert(sizeof(TensorList) + sizeof(UpdateConstants) < 4000, "kernel parameters must stay under 4 KiB");

template <DType T>
__device__ __forceinline__ float load_elem(const void* p, std::uint64_t i) {
  if constexpr (T == DType::kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (T == DType::kBF16) {
    return optim_detail::bf16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
  } else {
    return optim_detail::f16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
  }
}

template <DType T>
__device__ __forceinline__ void store_param(void* p, std::uint64_t i, float x) {
  if constexpr (T == DType::kF32) {
    static_cast<float*>(p)[i] = x;
  } else if constexpr (T == DType::kBF16) {
    static_cast<std::uint16_t*>(p)[i] = optim_detail::f32_to_bf16(x);
  } else {
    static_cast<std::uint16_t*>(p)[i] = optim_detail::f32_to_f16(x);
  }
}

// grid: one block per listed chunk; block: kThreads threads striding over the chunk.
template <DType P, DType G, bool kDecoupled>
__global__ void __launch_bounds__(kThreads) fused_adam_kernel(TensorList list, UpdateConstants c) {
  const int t = list.block_tensor[blockIdx.x];
  const std::uint64_t n = list.n[t];
  const std::uint64_t begin = static_cast<std::uint64_t>(list.block_chunk[blockIdx.x]) * kChunk;
  const std::uint64_t end = begin + kChunk < n ? begin + kChunk : n;
  float* master = list.master[t];
  float* exp_avg = list.exp_avg[t];
  float* exp_avg_sq = list.exp_avg_sq[t];
  const void* grad = list.grad[t];
  void* param = list.param[t];
  for (std::uint64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    float g = __fmul_rn(load_elem<G>(grad, i), c.grad_scale);
    float p = master[i];
    if (!kDecoupled && c.l2 != 0.0f) g = __fmaf_rn(c.l2, p, g);
    float m = exp_avg[i];
    float v = exp_avg_sq[i];
    m = __fmaf_rn(c.beta1, m, __fmul_rn(c.one_minus_beta1, g));
    v = __fmaf_rn(c.beta2, v, __fmul_rn(__fmul_rn(c.one_minus_beta2, g), g));
    const float denom = __fmaf_rn(__fsqrt_rn(v), c.inv_sqrt_bc2, c.eps);
    if (kDecoupled) p = __fmul_rn(p, c.decay);
    p = __fmaf_rn(c.neg_step_size, __fdiv_rn(m, denom), p);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    master[i] = p;
    store_param<P>(param, i, p);
  }
}

using KernelFn = void (*)(TensorList, UpdateConstants);

template <DType P, DType G>
KernelFn pick_decoupled(bool decoupled) {
  return decoupled ? fused_adam_kernel<P, G, true> : fused_adam_kernel<P, G, false>;
}

template <DType P>
KernelFn pick_grad(DType g, bool decoupled) {
  switch (g) {
    case DType::kF32:
      return pick_decoupled<P, DType::kF32>(decoupled);
    case DType::kBF16:
      return pick_decoupled<P, DType::kBF16>(decoupled);
    case DType::kF16:
      return pick_decoupled<P, DType::kF16>(decoupled);
  }
  return nullptr;
}

KernelFn pick_kernel(DType p, DType g, bool decoupled) {
  switch (p) {
    case DType::kF32:
      return pick_grad<DType::kF32>(g, decoupled);
    case DType::kBF16:
      return pick_grad<DType::kBF16>(g, decoupled);
    case DType::kF16:
      return pick_grad<DType::kF16>(g, decoupled);
  }
  return nullptr;
}

Status launch(KernelFn kernel, const TensorList& list, int blocks, const UpdateConstants& c,
              cudaStream_t stream) {
  kernel<<<blocks, kThreads, 0, stream>>>(list, c);
  // cudaErrorNotReady is a poll's leftover (Event::query), not a failure of this launch.
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess && err != cudaErrorNotReady) {
    return device_error(std::string("fused Adam: kernel launch failed: ") + cudaGetErrorString(err));
  }
  return ok_status();
}

}  // namespace

Status fused_adam_cuda(std::span<const DeviceAdamTensor> tensors, DType param_dtype, DType grad_dtype,
                       const OptimizerHyper& hyper, std::int64_t step, float grad_scale, void* cuda_stream) {
  STRATA_RETURN_IF_ERROR(hyper.validate());
  if (hyper.kind != OptimizerKind::kAdamW && hyper.kind != OptimizerKind::kAdam) {
    return invalid_argument("fused Adam: optimizer " + std::string(to_string(hyper.kind)) +
                            " has no fused device kernel (adamw and adam do)");
  }
  if (step < 1) return invalid_argument("fused Adam: step " + std::to_string(step) + " (steps count from 1)");
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const DeviceAdamTensor& x = tensors[t];
    if (x.n == 0) continue;
    if (!x.param || !x.master || !x.exp_avg || !x.exp_avg_sq || !x.grad) {
      return invalid_argument("fused Adam: tensor " + std::to_string(t) + " has a null pointer");
    }
    if ((x.n + kChunk - 1) / kChunk > UINT32_MAX) {
      return invalid_argument("fused Adam: tensor " + std::to_string(t) + " is too large");
    }
  }
  const UpdateConstants c = optim_detail::make_update_constants(hyper, step, grad_scale, 0);
  const KernelFn kernel = pick_kernel(param_dtype, grad_dtype, hyper.kind == OptimizerKind::kAdamW);
  auto stream = static_cast<cudaStream_t>(cuda_stream);

  TensorList list{};
  int ntensors = 0;
  int nblocks = 0;
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const DeviceAdamTensor& x = tensors[t];
    if (x.n == 0) continue;
    const std::uint64_t chunks = (x.n + kChunk - 1) / kChunk;
    for (std::uint64_t chunk = 0; chunk < chunks; ++chunk) {
      if (chunk == 0) {  // list this tensor in the current launch
        list.param[ntensors] = x.param;
        list.master[ntensors] = x.master;
        list.exp_avg[ntensors] = x.exp_avg;
        list.exp_avg_sq[ntensors] = x.exp_avg_sq;
        list.grad[ntensors] = x.grad;
        list.n[ntensors] = x.n;
        ++ntensors;
      }
      list.block_tensor[nblocks] = static_cast<std::uint8_t>(ntensors - 1);
      list.block_chunk[nblocks] = static_cast<std::uint32_t>(chunk);
      ++nblocks;
      const bool last_chunk = chunk + 1 == chunks;
      if (nblocks == kMaxBlocks || (last_chunk && ntensors == kMaxTensors)) {
        STRATA_RETURN_IF_ERROR(launch(kernel, list, nblocks, c, stream));
        nblocks = 0;
        // A tensor whose chunks continue is listed again as the first of the next launch.
        ntensors = 0;
        if (!last_chunk) {
          list.param[0] = x.param;
          list.master[0] = x.master;
          list.exp_avg[0] = x.exp_avg;
          list.exp_avg_sq[0] = x.exp_avg_sq;
          list.grad[0] = x.grad;
          list.n[0] = x.n;
          ntensors = 1;
        }
      }
    }
  }
  if (nblocks > 0) STRATA_RETURN_IF_ERROR(launch(kernel, list, nblocks, c, stream));
  return ok_status();
}

}  // namespace strata
