// The fused CUDA AdamW/Adam against the CPU update (which test_optim_kernels checks against the
// double-precision reference). The device kernel performs the same fp32 operations in the same
// order with round-to-nearest intrinsics, so master, moments and the working parameters must
// match the CPU's bit for bit, over many tensors of awkward sizes (several launches).
#include <cstring>
#include <random>
#include <vector>

#include "harness/harness.hpp"
#include "optim/numerics.hpp"
#include "strata/build_config.hpp"
#include "strata/optim.hpp"

#if STRATA_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace strata {
namespace {

#if STRATA_HAVE_CUDA

#define CUDA_OK(expr)                                                      \
  do {                                                                     \
    const cudaError_t e_ = (expr);                                         \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_); \
  } while (0)

struct HostTensor {
  std::vector<float> master, m, v;
  std::vector<unsigned char> grad;   // grad dtype
  std::vector<unsigned char> param;  // param dtype
};

struct DeviceTensor {
  void* param = nullptr;
  float* master = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  void* grad = nullptr;
};

void fill(HostTensor& t, std::size_t n, DType gdt, DType pdt, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  t.master.resize(n);
  t.m.resize(n);
  t.v.resize(n);
  t.grad.resize(n * dtype_size(gdt));
  t.param.assign(n * dtype_size(pdt), 0);
  for (std::size_t i = 0; i < n; ++i) {
    t.master[i] = normal(rng);
    t.m[i] = 0.01f * normal(rng);
    t.v[i] = 1e-4f * std::fabs(normal(rng));
    const float g = 100.0f * normal(rng);
    if (gdt == DType::kF32) {
      std::memcpy(t.grad.data() + 4 * i, &g, 4);
    } else {
      const std::uint16_t h =
          gdt == DType::kBF16 ? optim_detail::f32_to_bf16(g) : optim_detail::f32_to_f16(g);
      std::memcpy(t.grad.data() + 2 * i, &h, 2);
    }
  }
}

TEST(GpuFusedAdam, MatchesTheCpuUpdateBitForBit) {
  STRATA_SKIP_WITHOUT_GPU();
  std::vector<std::size_t> sizes = {1, 17, 1023, 65536 + 5, (1u << 20) + 3, 4 * 65536 + 1};
  for (int k = 0; k < 40; ++k) sizes.push_back(100 + 37 * k);  // more tensors than one launch lists

  CpuOptimizerConfig cc;
  cc.isa = best_optimizer_isa();
  cc.threads = 2;
  const CpuOptimizer cpu = std::move(CpuOptimizer::create(cc)).value();

  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdam}) {
    for (DType pdt : {DType::kBF16, DType::kF16, DType::kF32}) {
      for (DType gdt : {DType::kF32, DType::kBF16, DType::kF16}) {
        SCOPED_TRACE(std::string(to_string(kind)) + " param " + std::string(to_string(pdt)) + " grad " +
                     std::string(to_string(gdt)));
        OptimizerHyper h = OptimizerHyper::defaults(kind);
        h.weight_decay = 0.1;
        h.lr = 1e-2;
        std::vector<HostTensor> host(sizes.size());
        std::vector<DeviceTensor> dev(sizes.size());
        std::vector<DeviceAdamTensor> list(sizes.size());
        for (std::size_t t = 0; t < sizes.size(); ++t) {
          const std::size_t n = sizes[t];
          fill(host[t], n, gdt, pdt, static_cast<std::uint32_t>(t + 1));
          CUDA_OK(cudaMalloc(&dev[t].param, n * dtype_size(pdt)));
          CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dev[t].master), n * 4));
          CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dev[t].m), n * 4));
          CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dev[t].v), n * 4));
          CUDA_OK(cudaMalloc(&dev[t].grad, n * dtype_size(gdt)));
          CUDA_OK(cudaMemcpy(dev[t].master, host[t].master.data(), n * 4, cudaMemcpyHostToDevice));
          CUDA_OK(cudaMemcpy(dev[t].m, host[t].m.data(), n * 4, cudaMemcpyHostToDevice));
          CUDA_OK(cudaMemcpy(dev[t].v, host[t].v.data(), n * 4, cudaMemcpyHostToDevice));
          CUDA_OK(cudaMemcpy(dev[t].grad, host[t].grad.data(), n * dtype_size(gdt), cudaMemcpyHostToDevice));
          list[t] = DeviceAdamTensor{dev[t].param, dev[t].master, dev[t].m, dev[t].v, dev[t].grad, n};
        }
        const float grad_scale = 1.0f / 128.0f;
        for (std::int64_t step = 1; step <= 3; ++step) {
          STRATA_ASSERT_OK(fused_adam_cuda(list, pdt, gdt, h, step, grad_scale, nullptr));
          for (std::size_t t = 0; t < sizes.size(); ++t) {
            OptimizerBuffers b;
            b.master = host[t].master.data();
            b.grad = host[t].grad.data();
            b.grad_dtype = gdt;
            b.exp_avg = host[t].m.data();
            b.exp_avg_sq = host[t].v.data();
            b.param_out = pdt == DType::kF32 ? nullptr : host[t].param.data();
            b.out_dtype = pdt;
            b.n = sizes[t];
            STRATA_ASSERT_OK(cpu.update(h, step, grad_scale, b));
          }
        }
        CUDA_OK(cudaDeviceSynchronize());
        for (std::size_t t = 0; t < sizes.size(); ++t) {
          const std::size_t n = sizes[t];
          std::vector<float> master(n), m(n), v(n);
          std::vector<unsigned char> param(n * dtype_size(pdt));
          CUDA_OK(cudaMemcpy(master.data(), dev[t].master, n * 4, cudaMemcpyDeviceToHost));
          CUDA_OK(cudaMemcpy(m.data(), dev[t].m, n * 4, cudaMemcpyDeviceToHost));
          CUDA_OK(cudaMemcpy(v.data(), dev[t].v, n * 4, cudaMemcpyDeviceToHost));
          CUDA_OK(cudaMemcpy(param.data(), dev[t].param, param.size(), cudaMemcpyDeviceToHost));
          EXPECT_EQ(std::memcmp(master.data(), host[t].master.data(), n * 4), 0) << "master, tensor " << t;
          EXPECT_EQ(std::memcmp(m.data(), host[t].m.data(), n * 4), 0) << "exp_avg, tensor " << t;
          EXPECT_EQ(std::memcmp(v.data(), host[t].v.data(), n * 4), 0) << "exp_avg_sq, tensor " << t;
          const void* want = pdt == DType::kF32 ? static_cast<const void*>(host[t].master.data())
                                                : static_cast<const void*>(host[t].param.data());
          EXPECT_EQ(std::memcmp(param.data(), want, param.size()), 0) << "working params, tensor " << t;
          cudaFree(dev[t].param);
          cudaFree(dev[t].master);
          cudaFree(dev[t].m);
          cudaFree(dev[t].v);
          cudaFree(dev[t].grad);
        }
      }
    }
  }
}

// One tensor longer than a launch can list (kMaxBlocks = 320 chunks of 65536 elements), placed
// after a small one so that the split falls in the middle of the long tensor: its chunks continue
// in the next launch, re-listed as that launch's first tensor. Every element must still match.
TEST(GpuFusedAdam, ATensorSpanningLaunchesMatchesTheCpuUpdate) {
  STRATA_SKIP_WITHOUT_GPU();
  const std::vector<std::size_t> sizes = {1000, 330ull * 65536 + 7};
  CpuOptimizerConfig cc;
  cc.isa = best_optimizer_isa();
  cc.threads = 2;
  const CpuOptimizer cpu = std::move(CpuOptimizer::create(cc)).value();
  const DType pdt = DType::kBF16, gdt = DType::kF32;
  OptimizerHyper h = OptimizerHyper::defaults(OptimizerKind::kAdamW);
  h.weight_decay = 0.1;
  h.lr = 1e-2;
  std::vector<HostTensor> host(sizes.size());
  std::vector<DeviceTensor> dev(sizes.size());
  std::vector<DeviceAdamTensor> list(sizes.size());
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    const std::size_t n = sizes[t];
    fill(host[t], n, gdt, pdt, static_cast<std::uint32_t>(t + 101));
    CUDA_OK(cudaMalloc(&dev[t].param, n * dtype_size(pdt)));
    CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dev[t].master), n * 4));
    CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dev[t].m), n * 4));
    CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dev[t].v), n * 4));
    CUDA_OK(cudaMalloc(&dev[t].grad, n * dtype_size(gdt)));
    CUDA_OK(cudaMemcpy(dev[t].master, host[t].master.data(), n * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dev[t].m, host[t].m.data(), n * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dev[t].v, host[t].v.data(), n * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dev[t].grad, host[t].grad.data(), n * dtype_size(gdt), cudaMemcpyHostToDevice));
    list[t] = DeviceAdamTensor{dev[t].param, dev[t].master, dev[t].m, dev[t].v, dev[t].grad, n};
  }
  STRATA_ASSERT_OK(fused_adam_cuda(list, pdt, gdt, h, 1, 1.0f, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    const std::size_t n = sizes[t];
    OptimizerBuffers b;
    b.master = host[t].master.data();
    b.grad = host[t].grad.data();
    b.grad_dtype = gdt;
    b.exp_avg = host[t].m.data();
    b.exp_avg_sq = host[t].v.data();
    b.param_out = host[t].param.data();
    b.out_dtype = pdt;
    b.n = n;
    STRATA_ASSERT_OK(cpu.update(h, 1, 1.0f, b));
    std::vector<float> master(n);
    std::vector<unsigned char> param(n * dtype_size(pdt));
    CUDA_OK(cudaMemcpy(master.data(), dev[t].master, n * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(param.data(), dev[t].param, param.size(), cudaMemcpyDeviceToHost));
    EXPECT_EQ(std::memcmp(master.data(), host[t].master.data(), n * 4), 0) << "master, tensor " << t;
    EXPECT_EQ(std::memcmp(param.data(), host[t].param.data(), param.size()), 0) << "working params, tensor " << t;
    cudaFree(dev[t].param);
    cudaFree(dev[t].master);
    cudaFree(dev[t].m);
    cudaFree(dev[t].v);
    cudaFree(dev[t].grad);
  }
}

#else

TEST(GpuFusedAdam, MatchesTheCpuUpdateBitForBit) { STRATA_SKIP_WITHOUT_GPU(); }
TEST(GpuFusedAdam, ATensorSpanningLaunchesMatchesTheCpuUpdate) { STRATA_SKIP_WITHOUT_GPU(); }

#endif

}  // namespace
}  // namespace strata
