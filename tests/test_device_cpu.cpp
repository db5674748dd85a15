// The cpu backend: the shared Device conformance suite, plus what only the emulated accelerator
// promises (compute thread budget, copy validation, no GPU needed).
#include <omp.h>

#include <string>
#include <vector>

#include "device/backends.hpp"
#include "device_conformance.hpp"
#include "strata/options.hpp"

namespace strata::testing {
namespace {

INSTANTIATE_TEST_SUITE_P(Cpu, DeviceConformance, ::testing::Values(DeviceKind::kCpu), device_kind_name);

std::unique_ptr<Device> cpu_device(int compute_threads) {
  DeviceConfig cfg;
  cfg.memory_bytes = 16ull << 20;
  cfg.pinned_bytes = 4ull << 20;
  cfg.compute_threads = compute_threads;
  auto d = Device::create(cfg);
  EXPECT_TRUE(d.ok()) << d.status().to_string();
  return std::move(d).value();
}

TEST(CpuDevice, ComputeRunsWithTheConfiguredThreadBudget) {
  for (int threads : {1, 2, 3}) {
    auto dev = cpu_device(threads);
    EXPECT_EQ(dev->info().compute_threads, threads);
    auto* s = *dev->create_stream("compute");
    int seen_max = 0;
    int seen_team = 0;
    auto kernel = [&]() -> Status {
      seen_max = omp_get_max_threads();
#pragma omp parallel
      {
#pragma omp single
        seen_team = omp_get_num_threads();
      }
      return ok_status();
    };
    STRATA_ASSERT_OK(s->host_fn("kernel", kernel));
    STRATA_ASSERT_OK(s->synchronize());
    EXPECT_EQ(seen_max, threads);
    EXPECT_EQ(seen_team, threads);
  }
}

// CUDA runs host functions of all streams on one internal thread, so only the cpu backend
// promises that two streams' host work runs at the same time.
TEST(CpuDevice, StreamsRunConcurrently) {
  auto dev = cpu_device(1);
  auto* a = *dev->create_stream("a");
  auto* b = *dev->create_stream("b");
  Gate gate;
  std::atomic<bool> a_released{false};
  // a blocks until b opens the gate: only possible if b runs while a is blocked.
  STRATA_ASSERT_OK(a->host_fn("wait for b", [&]() -> Status {
    a_released = gate.wait();
    return ok_status();
  }));
  STRATA_ASSERT_OK(b->host_fn("open", [&]() -> Status {
    gate.open();
    return ok_status();
  }));
  STRATA_ASSERT_OK(b->synchronize());
  STRATA_ASSERT_OK(a->synchronize());
  EXPECT_TRUE(a_released.load());
}

TEST(CpuDevice, CopiesCheckWhichSideIsDeviceMemory) {
  auto dev = cpu_device(1);
  auto* s = *dev->create_stream("s");
  auto host = *dev->pinned().allocate(4096, "h");
  auto devbuf = *dev->allocate(4096, "d");
  STRATA_EXPECT_ERROR(s->copy_async(host.data(), host.data(), 4096, CopyKind::kHostToDevice), kInvalidArgument,
                      "destination is not device memory");
  STRATA_EXPECT_ERROR(s->copy_async(host.data(), devbuf.data(), 4096, CopyKind::kHostToDevice), kInvalidArgument,
                      "host-to-device");
  STRATA_EXPECT_ERROR(s->copy_async(nullptr, host.data(), 1, CopyKind::kHostToDevice), kInvalidArgument, "null");
  STRATA_EXPECT_ERROR(s->memset_async(host.data(), 0, 16), kInvalidArgument, "outside device memory");
  STRATA_EXPECT_OK(s->synchronize());
}

// A pass's collectives run even after the stream failed (detail::host_fn_after_failure): the
// host functions after the failure are skipped, those marked run, in order, and the stream keeps
// its first error; a marked function's own error fails a healthy stream as host_fn's would.
TEST(CpuDevice, MarkedHostFunctionsRunAfterAFailure) {
  auto dev = cpu_device(1);
  auto* s = *dev->create_stream("s");
  std::vector<std::string> ran;
  auto note = [&](std::string what) {
    return [&ran, what]() -> Status {
      ran.push_back(what);
      return ok_status();
    };
  };
  STRATA_ASSERT_OK(s->host_fn("kernel 1", note("kernel 1")));
  STRATA_ASSERT_OK(s->host_fn("fault", []() { return internal_error("the first failure"); }));
  STRATA_ASSERT_OK(s->host_fn("kernel 2", note("kernel 2")));
  STRATA_ASSERT_OK(detail::host_fn_after_failure(*s, "collective", note("collective")));
  STRATA_ASSERT_OK(detail::host_fn_after_failure(*s, "failing collective",
                                                 []() { return unavailable("a later failure"); }));
  STRATA_ASSERT_OK(s->host_fn("kernel 3", note("kernel 3")));
  STRATA_EXPECT_ERROR(s->synchronize(), kInternal, "the first failure");
  EXPECT_EQ(ran, (std::vector<std::string>{"kernel 1", "collective"}));
  // Healthy again: a marked function's error fails the stream.
  STRATA_ASSERT_OK(detail::host_fn_after_failure(*s, "failing collective",
                                                 []() { return unavailable("its own failure"); }));
  STRATA_ASSERT_OK(s->host_fn("kernel 4", note("kernel 4")));
  STRATA_EXPECT_ERROR(s->synchronize(), kUnavailable, "failing collective: its own failure");
  EXPECT_EQ(ran.size(), 2u);
}

TEST(CpuDevice, StreamNamesAreUnique) {
  auto dev = cpu_device(1);
  ASSERT_TRUE(dev->create_stream("x").ok());
  STRATA_EXPECT_ERROR(dev->create_stream("x"), kInvalidArgument, "'x'");
}

TEST(CpuDevice, ConfigFromOptionsAndBadConfig) {
  Options o;
  STRATA_ASSERT_OK(o.set(Option::kDeviceMemory, "32MiB", "test"));
  STRATA_ASSERT_OK(o.set(Option::kComputeThreads, "2", "test"));
  auto cfg = DeviceConfig::from_options(o);
  EXPECT_EQ(cfg.kind, DeviceKind::kCpu);
  EXPECT_EQ(cfg.memory_bytes, 32ull << 20);
  EXPECT_EQ(cfg.compute_threads, 2);
  cfg.memory_bytes = 1000;
  STRATA_EXPECT_ERROR(Device::create(cfg), kInvalidArgument, "device_memory");
  cfg.memory_bytes = 32ull << 20;
  cfg.arena_alignment = 48;
  STRATA_EXPECT_ERROR(Device::create(cfg), kInvalidArgument, "arena_alignment");
}

TEST(CudaBackend, UnavailableWithoutAGpuSaysWhatToDo) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a GPU is present; test_gpu_device covers the backend";
  DeviceConfig cfg;
  cfg.kind = DeviceKind::kCuda;
  cfg.memory_bytes = 16ull << 20;
  STRATA_EXPECT_ERROR(Device::create(cfg), kUnavailable, "cpu");
}

}  // namespace
}  // namespace strata::testing
