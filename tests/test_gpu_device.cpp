// The cuda backend against the shared Device conformance suite (label gpu; skips without a GPU),
// plus what only the cuda backend can get wrong.
#include <cstring>

#include "device_conformance.hpp"
#include "kernels/kernels.hpp"
#include "strata/build_config.hpp"

#if STRATA_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace strata::testing {
namespace {

INSTANTIATE_TEST_SUITE_P(Cuda, DeviceConformance, ::testing::Values(DeviceKind::kCuda), device_kind_name);

// Polling unfinished work leaves cudaErrorNotReady as the thread's last error; the kernel
// launchers read the last error to detect a failed launch. A poll, by the backend's Event/Stream
// query or by anyone calling the runtime directly, must not make the next launch report failure.
// The stream is held by a host function on a gate the test opens, so the work is unfinished when
// polled, deterministically.
TEST(GpuDevice, PollingUnfinishedWorkDoesNotFailTheNextLaunch) {
  STRATA_SKIP_WITHOUT_GPU();
#if STRATA_HAVE_CUDA
  DeviceConfig cfg;
  cfg.kind = DeviceKind::kCuda;
  cfg.memory_bytes = 64ull << 20;
  cfg.pinned_bytes = 16ull << 20;
  auto device = Device::create(cfg);
  ASSERT_TRUE(device.ok()) << device.status().to_string();
  Device& dev = **device;
  auto stream = dev.create_stream("poll");
  ASSERT_TRUE(stream.ok()) << stream.status().to_string();
  Stream& s = **stream;
  constexpr std::int64_t n = 4097;
  auto a = dev.allocate(n * sizeof(float), "test.a");
  auto out = dev.allocate(n * sizeof(float), "test.out");
  auto host = dev.pinned().allocate(n * sizeof(float), "test.host");
  ASSERT_TRUE(a.ok() && out.ok() && host.ok());
  STRATA_ASSERT_OK(s.memset_async(a->data(), 0x3f, n * sizeof(float)));  // every float 0x3f3f3f3f

  Gate gate;
  STRATA_ASSERT_OK(s.host_fn("hold", [&] { return gate.wait() ? ok_status() : internal_error("gate never opened"); }));
  auto event = dev.create_event();
  ASSERT_TRUE(event.ok()) << event.status().to_string();
  STRATA_ASSERT_OK(s.record(**event));
  EXPECT_FALSE((*event)->query()) << "the event is behind a held host function";
  EXPECT_FALSE(s.query()) << "the stream is held by a host function";

  kernels::KernelContext ctx;
  ctx.backend = kernels::Backend::kCuda;
  ctx.cuda_stream = s.native_handle();
  const kernels::ConstTensorArg in{a->data(), DType::kF32};
  STRATA_EXPECT_OK(kernels::residual_forward(ctx, {out->data(), DType::kF32}, in, in, n));
  // A poll straight through the runtime, which the backend cannot clear up after.
  EXPECT_EQ(cudaStreamQuery(static_cast<cudaStream_t>(s.native_handle())), cudaErrorNotReady);
  STRATA_EXPECT_OK(kernels::residual_forward(ctx, {out->data(), DType::kF32}, {out->data(), DType::kF32}, in, n));

  gate.open();
  STRATA_ASSERT_OK(s.copy_async(host->data(), out->data(), n * sizeof(float), CopyKind::kDeviceToHost));
  STRATA_ASSERT_OK(s.synchronize());
  EXPECT_TRUE((*event)->query());
  float one = 0;
  const std::uint32_t bits = 0x3f3f3f3fu;
  std::memcpy(&one, &bits, sizeof one);
  const auto* got = static_cast<const float*>(host->data());
  for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], 3 * one) << "element " << i;  // (a + a) + a
#endif
}

}  // namespace
}  // namespace strata::testing
