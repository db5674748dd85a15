// Backend-independent Device tests. Included by test_device_cpu.cpp (cpu) and
// test_gpu_device.cpp (cuda, label gpu). Host functions only touch pinned host memory, never
// device memory, so every test is valid on both backends.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <numeric>
#include <vector>

#include "harness/harness.hpp"
#include "strata/device.hpp"

namespace strata::testing {

inline std::string device_kind_name(const ::testing::TestParamInfo<DeviceKind>& info) {
  return std::string(to_string(info.param));
}

class DeviceConformance : public ::testing::TestWithParam<DeviceKind> {
 protected:
  void SetUp() override {
    if (GetParam() == DeviceKind::kCuda) STRATA_SKIP_WITHOUT_GPU();
    DeviceConfig cfg;
    cfg.kind = GetParam();
    cfg.memory_bytes = 64ull << 20;
    cfg.pinned_bytes = 16ull << 20;
    cfg.compute_threads = 1;
    auto d = Device::create(cfg);
    ASSERT_TRUE(d.ok()) << d.status().to_string();
    device_ = std::move(d).value();
  }
  std::unique_ptr<Device> device_;
};

// A latch the test opens by hand; waiting on it times out (as a failure guard, not a timing
// assertion) so a broken implementation fails instead of hanging.
class Gate {
 public:
  void open() {
    std::lock_guard lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  bool wait() {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(30), [&] { return open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

TEST_P(DeviceConformance, RoundTripThroughDeviceMemoryAtAwkwardSizes) {
  auto* s = *device_->create_stream("copy");
  for (std::size_t n : awkward_sizes()) {
    if (n == 0) continue;
    auto src = *device_->pinned().allocate(n, "src");
    auto dst = *device_->pinned().allocate(n, "dst");
    auto dev = *device_->allocate(n, "dev");
    auto dev2 = *device_->allocate(n, "dev2");
    auto* in = static_cast<std::uint8_t*>(src.data());
    for (std::size_t i = 0; i < n; ++i) in[i] = static_cast<std::uint8_t>(i * 131 + n);
    std::memset(dst.data(), 0, n);
    STRATA_ASSERT_OK(s->copy_async(dev.data(), src.data(), n, CopyKind::kHostToDevice));
    STRATA_ASSERT_OK(s->copy_async(dev2.data(), dev.data(), n, CopyKind::kDeviceToDevice));
    STRATA_ASSERT_OK(s->copy_async(dst.data(), dev2.data(), n, CopyKind::kDeviceToHost));
    STRATA_ASSERT_OK(s->synchronize());
    ASSERT_EQ(std::memcmp(src.data(), dst.data(), n), 0) << "size " << n;
  }
  auto st = device_->stats();
  EXPECT_GT(st.bytes_h2d, 0u);
  EXPECT_EQ(st.bytes_h2d, st.bytes_d2h);
}

TEST_P(DeviceConformance, WorkOnOneStreamRunsInOrder) {
  auto* s = *device_->create_stream("ordered");
  std::vector<int> order;
  std::mutex mu;
  for (int i = 0; i < 500; ++i) {
    STRATA_ASSERT_OK(s->host_fn("append", [&, i]() -> Status {
      std::lock_guard lock(mu);
      order.push_back(i);
      return ok_status();
    }));
  }
  STRATA_ASSERT_OK(s->synchronize());
  std::vector<int> expect(500);
  std::iota(expect.begin(), expect.end(), 0);
  EXPECT_EQ(order, expect);
}

TEST_P(DeviceConformance, EventOrdersWorkAcrossStreams) {
  auto* producer = *device_->create_stream("producer");
  auto* consumer = *device_->create_stream("consumer");
  auto ev = std::move(device_->create_event()).value();
  Gate gate;
  auto buf = *device_->pinned().allocate(sizeof(int), "flag");
  auto* value = static_cast<std::atomic<int>*>(buf.data());
  value->store(0);
  int seen = -1;
  STRATA_ASSERT_OK(producer->host_fn("produce", [&]() -> Status {
    if (!gate.wait()) return internal_error("gate never opened");
    value->store(42);
    return ok_status();
  }));
  STRATA_ASSERT_OK(producer->record(*ev));
  STRATA_ASSERT_OK(consumer->wait(*ev));
  STRATA_ASSERT_OK(consumer->host_fn("consume", [&]() -> Status {
    seen = value->load();
    return ok_status();
  }));
  EXPECT_FALSE(ev->query()) << "the producer is still blocked";
  EXPECT_FALSE(consumer->query()) << "the consumer must be waiting for the event";
  gate.open();
  STRATA_ASSERT_OK(consumer->synchronize());
  EXPECT_EQ(seen, 42);
  EXPECT_TRUE(ev->query());
  STRATA_ASSERT_OK(ev->synchronize());
}

TEST_P(DeviceConformance, WaitingOnANeverRecordedEventDoesNotBlock) {
  auto* s = *device_->create_stream("s");
  auto ev = std::move(device_->create_event()).value();
  EXPECT_TRUE(ev->query());
  STRATA_ASSERT_OK(s->wait(*ev));
  STRATA_ASSERT_OK(s->synchronize());
}

TEST_P(DeviceConformance, ErrorsSurfaceAtSynchronizeAndLaterWorkIsSkipped) {
  auto* s = *device_->create_stream("compute");
  auto ev = std::move(device_->create_event()).value();
  bool later_ran = false;
  STRATA_ASSERT_OK(s->host_fn("layernorm.forward", []() -> Status { return internal_error("NaN in block 3"); }));
  STRATA_ASSERT_OK(s->host_fn("later", [&]() -> Status {
    later_ran = true;
    return ok_status();
  }));
  STRATA_ASSERT_OK(s->record(*ev));
  Status es = ev->synchronize();
  EXPECT_FALSE(es.ok()) << "an event recorded after a failure carries it";
  Status st = s->synchronize();
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_NE(st.message().find("stream 'compute'"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("layernorm.forward"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("NaN in block 3"), std::string::npos) << st.message();
  EXPECT_FALSE(later_ran);
  // Reported once; the stream works again.
  bool ran = false;
  STRATA_ASSERT_OK(s->host_fn("again", [&]() -> Status {
    ran = true;
    return ok_status();
  }));
  STRATA_ASSERT_OK(s->synchronize());
  EXPECT_TRUE(ran);
}

TEST_P(DeviceConformance, DeviceSynchronizeReportsAnyStreamsError) {
  auto* a = *device_->create_stream("a");
  auto* b = *device_->create_stream("b");
  STRATA_ASSERT_OK(a->host_fn("fine", []() -> Status { return ok_status(); }));
  STRATA_ASSERT_OK(b->host_fn("broken", []() -> Status { return io_error("disk gone"); }));
  Status s = device_->synchronize();
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find("disk gone"), std::string::npos);
  STRATA_EXPECT_OK(device_->synchronize());
}

// The events bracket a host function that sleeps, and sleep_for never returns early, so the
// elapsed time is at least the sleep: a lower bound that cannot be flaky (no upper bound is
// asserted, since a loaded machine may stretch it arbitrarily). The 1 us allowance is for CUDA
// events, whose timestamps have about 0.5 us resolution.
TEST_P(DeviceConformance, ElapsedTimeBetweenEvents) {
  static constexpr double kSleptMs = 2.0;
  auto* s = *device_->create_stream("timed");
  auto start = std::move(device_->create_event()).value();
  auto end = std::move(device_->create_event()).value();
  STRATA_ASSERT_OK(s->record(*start));
  STRATA_ASSERT_OK(s->host_fn("work", []() -> Status {
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(kSleptMs));
    return ok_status();
  }));
  STRATA_ASSERT_OK(s->record(*end));
  STRATA_ASSERT_OK(end->synchronize());
  auto ms = elapsed_ms(*start, *end);
  ASSERT_TRUE(ms.ok()) << ms.status().to_string();
  EXPECT_GE(*ms, kSleptMs - 1e-3) << "the events bracket a " << kSleptMs << " ms sleep";
}

TEST_P(DeviceConformance, BudgetIsEnforcedWithAClearError) {
  auto big = device_->allocate(48ull << 20, "params");
  ASSERT_TRUE(big.ok());
  auto more = device_->allocate(32ull << 20, "activations");
  STRATA_EXPECT_ERROR(more, kOutOfMemory, "device_memory");
  STRATA_EXPECT_ERROR(more, kOutOfMemory, "activations");
}

TEST_P(DeviceConformance, CompactionPreservesRelocatableContents) {
  auto* s = *device_->create_stream("s");
  Arena& arena = device_->memory();
  std::vector<ArenaHandle> hs;
  const std::uint64_t n = 100000;
  for (int i = 0; i < 6; ++i) hs.push_back(*arena.allocate(n, Lifetime::kRelocatable, "act"));
  auto host = *device_->pinned().allocate(n, "host");
  for (int i = 0; i < 6; ++i) {
    std::memset(host.data(), 0x30 + i, n);
    STRATA_ASSERT_OK(s->copy_async(arena.ptr(hs[i]), host.data(), n, CopyKind::kHostToDevice));
    STRATA_ASSERT_OK(s->synchronize());
  }
  STRATA_ASSERT_OK(arena.free(hs[0]));
  STRATA_ASSERT_OK(arena.free(hs[3]));
  STRATA_ASSERT_OK(device_->compact());
  STRATA_ASSERT_OK(arena.is_valid());
  for (int i : {1, 2, 4, 5}) {
    STRATA_ASSERT_OK(s->copy_async(host.data(), arena.ptr(hs[i]), n, CopyKind::kDeviceToHost));
    STRATA_ASSERT_OK(s->synchronize());
    auto* p = static_cast<std::uint8_t*>(host.data());
    for (std::uint64_t k = 0; k < n; ++k) ASSERT_EQ(p[k], 0x30 + i) << "block " << i;
  }
  EXPECT_EQ(*arena.offset(hs[1]), 0u);
}

TEST_P(DeviceConformance, NoRawAllocationsAfterCreation) {
  auto before = device_->stats().raw_allocs;
  for (int i = 0; i < 100; ++i) {
    auto b = device_->allocate(1000 + i * 4096, "tmp");
    ASSERT_TRUE(b.ok());
  }
  EXPECT_EQ(device_->stats().raw_allocs, before);
}

}  // namespace strata::testing
