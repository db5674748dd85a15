// The nccl comm backend in one process (a world of one rank on one GPU): device buffers through
// every collective, with the unique id bootstrapped over MPI as on many ranks. Skips cleanly in a
// build without NCCL or on a machine without a GPU. The multi-rank run needs several GPUs.
#include <gtest/gtest.h>

#include <vector>

#include "strata/build_config.hpp"
#include "strata/parallel.hpp"

#if STRATA_HAVE_NCCL
#include <cuda_runtime.h>
#endif

namespace strata {
namespace {

TEST(NcclComm, WorldOfOneOnTheDevice) {
#if !STRATA_HAVE_NCCL
  GTEST_SKIP() << "this build has no NCCL (configure with -DSTRATA_ENABLE_CUDA=ON)";
#else
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) GTEST_SKIP() << "no CUDA device";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  CommConfig config;
  config.timeout = std::chrono::milliseconds(60'000);
  auto ctx = CommContext::create(config);
  ASSERT_TRUE(ctx.ok()) << ctx.status().to_string();
  {
    auto world = (*ctx)->world(CommBackend::kNccl);
    ASSERT_TRUE(world.ok()) << world.status().to_string();
    Comm& c = **world;
    EXPECT_EQ(c.backend(), CommBackend::kNccl);
    EXPECT_EQ(c.size(), 1);
    const std::size_t n = 4097;
    std::vector<float> host(n);
    for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 251) * 0.25f - 30.0f;
    float* a = nullptr;
    float* b = nullptr;
    ASSERT_EQ(cudaMalloc(&a, n * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&b, n * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(a, host.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_TRUE(c.all_reduce(a, b, n, DType::kF32, ReduceOp::kAvg).wait().ok());
    ASSERT_TRUE(c.all_gather(b, a, n, DType::kF32).wait().ok());
    ASSERT_TRUE(c.broadcast(a, n, DType::kF32, 0).wait().ok());
    ASSERT_TRUE(c.barrier().wait().ok());
    std::vector<float> back(n, -1.0f);
    ASSERT_EQ(cudaMemcpy(back.data(), a, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(back, host);
    cudaFree(a);
    cudaFree(b);
  }
  EXPECT_TRUE((*ctx)->failure().ok());
#endif
}

}  // namespace
}  // namespace strata
