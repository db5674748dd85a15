// The cpu budget applied: each engine's threads (compute streams and their OpenMP teams, copy
// engines, NVMe I/O threads, the host optimizer and its team) run on the cpus the budget gave
// them, read back from the threads themselves; pinning off leaves them alone; and each engine's
// CPU seconds are counted.
#include <dirent.h>
#include <gtest/gtest.h>
#include <omp.h>
#include <sched.h>

#include <chrono>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include "harness/harness.hpp"
#include "offload_fixture.hpp"
#include "strata/cpu_budget.hpp"
#include "strata/device.hpp"
#include "strata/nvme.hpp"
#include "strata/offload.hpp"
#include "strata/optim.hpp"
#include "strata/options.hpp"

namespace strata::testing {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The affinity of every thread of this process named `name` (engine threads name themselves;
// OpenMP pool threads inherit their leader's name).
std::vector<CpuSet> threads_named(const std::string& name) {
  std::vector<CpuSet> out;
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) return out;
  while (dirent* e = ::readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream comm(std::string("/proc/self/task/") + e->d_name + "/comm");
    std::string line;
    std::getline(comm, line);
    if (line != name) continue;
    cpu_set_t mask;
    CPU_ZERO(&mask);
    if (::sched_getaffinity(std::atoi(e->d_name), sizeof mask, &mask) != 0) continue;
    std::vector<int> v;
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &mask)) v.push_back(c);
    }
    out.emplace_back(std::move(v));
  }
  ::closedir(dir);
  return out;
}

// Burns about `seconds` of CPU on the calling thread.
void spin(double seconds) {
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  volatile double x = 1.0;
  while (Clock::now() < end) x = x * 1.0000001 + 1e-9;
}

// Compute on the first allowed cpu, host work on the second (tests using it skip below 2 cpus).
DeviceConfig split_config(bool affinity) {
  const CpuSet allowed = process_cpus();
  DeviceConfig dc;
  dc.memory_bytes = 128ull << 20;
  dc.pinned_bytes = 64ull << 20;
  dc.compute_threads = 2;
  dc.cpu_affinity = affinity;
  dc.compute_cpus = std::to_string(allowed.cpus()[0]);
  dc.host_cpus = std::to_string(allowed.cpus()[1]);
  return dc;
}

#define SKIP_BELOW_TWO_CPUS()                                                                \
  do {                                                                                       \
    if (process_cpus().size() < 2)                                                           \
      GTEST_SKIP() << "the process may run on one cpu only: " << process_cpus().to_string(); \
  } while (0)

// What the compute stream's worker and its OpenMP team see from inside a kernel.
std::vector<CpuSet> affinity_inside_kernel(Stream& stream, int team) {
  std::vector<CpuSet> seen(static_cast<std::size_t>(team));
  auto kernel = [&]() -> Status {
#pragma omp parallel num_threads(team)
    seen[static_cast<std::size_t>(omp_get_thread_num())] = current_thread_cpus();
    return ok_status();
  };
  STRATA_EXPECT_OK(stream.host_fn("affinity", kernel));
  STRATA_EXPECT_OK(stream.synchronize());
  return seen;
}

TEST(CpuBudgetApplied, ComputeStreamsAndTheirTeamsRunOnComputeCpusAndCopyEnginesOnHostCpus) {
  SKIP_BELOW_TWO_CPUS();
  const DeviceConfig dc = split_config(true);
  auto dev = Device::create(dc);
  ASSERT_TRUE(dev.ok()) << dev.status().to_string();
  const CpuBudget& b = (*dev)->cpu_budget();
  const CpuSet compute = process_cpus().first(1);
  const CpuSet host = process_cpus().minus(compute).first(1);
  EXPECT_EQ(b.compute, compute);
  EXPECT_EQ(b.host, host);
  EXPECT_EQ((*dev)->info().compute_threads, 2);
  auto* s = *(*dev)->create_stream("budget");
  for (const CpuSet& seen : affinity_inside_kernel(*s, 2)) EXPECT_EQ(seen, compute);
  // Read from outside too: the worker and its pool thread, and both copy engines.
  const auto stream_threads = threads_named("stream:budget");
  EXPECT_EQ(stream_threads.size(), 2u);
  for (const CpuSet& c : stream_threads) EXPECT_EQ(c, compute);
  for (const char* name : {"copy.h2d", "copy.d2h"}) {
    const auto copies = threads_named(name);
    EXPECT_FALSE(copies.empty()) << name;
    for (const CpuSet& c : copies) EXPECT_EQ(c, host) << name;
  }
  EXPECT_EQ(current_thread_cpus(), process_cpus()) << "the caller's thread is not the device's to pin";
}

TEST(CpuBudgetApplied, PinningOffLeavesEveryThreadsAffinityAlone) {
  SKIP_BELOW_TWO_CPUS();
  auto dev = Device::create(split_config(false));
  ASSERT_TRUE(dev.ok()) << dev.status().to_string();
  EXPECT_FALSE((*dev)->cpu_budget().pin);
  auto* s = *(*dev)->create_stream("unpinned");
  for (const CpuSet& seen : affinity_inside_kernel(*s, 2)) EXPECT_EQ(seen, process_cpus());
  for (const char* name : {"stream:unpinned", "copy.h2d", "copy.d2h"}) {
    const auto threads = threads_named(name);
    EXPECT_FALSE(threads.empty()) << name;
    for (const CpuSet& c : threads) EXPECT_EQ(c, process_cpus()) << name;
  }
}

TEST(CpuBudgetApplied, BadCpusFailDeviceCreationNamingTheKey) {
  DeviceConfig dc;
  dc.memory_bytes = 16ull << 20;
  dc.pinned_bytes = 4ull << 20;
  dc.compute_cpus = "1000";
  STRATA_EXPECT_ERROR(Device::create(dc), kInvalidArgument, "compute_cpus: cpus 1000 are not among");
  dc.compute_cpus = "auto";
  dc.host_cpus = "0-";
  STRATA_EXPECT_ERROR(Device::create(dc), kInvalidArgument, "host_cpus");
}

TEST(CpuBudgetApplied, DeviceOptimizerAndCliDefaultsAgree) {
  // One split for everyone: the device's compute threads, the host optimizer's threads.
  Options o;
  auto dev = Device::create(DeviceConfig::from_options(o));
  ASSERT_TRUE(dev.ok()) << dev.status().to_string();
  auto budget = CpuBudget::for_process({});
  ASSERT_TRUE(budget.ok());
  EXPECT_EQ((*dev)->info().compute_threads, budget->compute_threads);
  EXPECT_EQ((*dev)->cpu_budget().host, budget->host);
  auto oc = CpuOptimizerConfig::from_options(o);
  ASSERT_TRUE(oc.ok()) << oc.status().to_string();
  EXPECT_EQ(oc->threads, budget->host_threads);
  EXPECT_EQ(budget->compute_threads + (budget->shared() ? 0 : budget->host_threads), process_cpus().size());
  EXPECT_FALSE(o.set(Option::kHostCpus, "99999", "STRATA_HOST_CPUS").ok()) << "beyond CPU_SETSIZE";
  STRATA_EXPECT_OK(o.set(Option::kHostCpus, "1000", "STRATA_HOST_CPUS"));
  STRATA_EXPECT_ERROR(CpuOptimizerConfig::from_options(o), kInvalidArgument, "host_cpus");
}

TEST(CpuBudgetApplied, DeviceCountsComputeAndCopyCpuSeconds) {
  const auto t0 = Clock::now();
  DeviceConfig dc;
  dc.memory_bytes = 64ull << 20;
  dc.pinned_bytes = 32ull << 20;
  dc.compute_threads = 2;
  auto dev = Device::create(dc);
  ASSERT_TRUE(dev.ok()) << dev.status().to_string();
  auto* s = *(*dev)->create_stream("work");
  auto kernel = []() -> Status {
#pragma omp parallel num_threads(2)
    spin(0.02);
    return ok_status();
  };
  STRATA_ASSERT_OK(s->host_fn("spin", kernel));
  auto d = (*dev)->allocate(16ull << 20, "t");
  ASSERT_TRUE(d.ok());
  auto h = (*dev)->pinned().allocate(16ull << 20, "t");
  ASSERT_TRUE(h.ok());
  for (int i = 0; i < 4; ++i) {
    STRATA_ASSERT_OK(s->copy_async(d->data(), h->data(), 16ull << 20, CopyKind::kHostToDevice));
    STRATA_ASSERT_OK(s->copy_async(h->data(), d->data(), 16ull << 20, CopyKind::kDeviceToHost));
  }
  STRATA_ASSERT_OK(s->synchronize());
  const DeviceStats st = (*dev)->stats();
  const double wall = seconds_since(t0);
  EXPECT_GT(st.compute_cpu_seconds, 0.0);
  EXPECT_GT(st.copy_cpu_seconds, 0.0);
  EXPECT_LE(st.compute_cpu_seconds, wall * 2 + 0.01) << "one stream of 2 compute threads";
  EXPECT_LE(st.copy_cpu_seconds, wall * 2 + 0.01) << "two copy engines";
}

TEST(CpuBudgetApplied, IoThreadsPinThemselvesAndCountTheirCpu) {
  TempDir dir("strata-budget-io");
  const CpuSet one =
      process_cpus().cpus().size() > 1 ? process_cpus().minus(process_cpus().first(1)) : process_cpus();
  IoEngineConfig c;
  c.nvme_path = {dir.path().string()};
  c.backend = IoBackendKind::kPsync;
  c.cpus = one.first(1);
  auto io = IoEngine::create(c);
  ASSERT_TRUE(io.ok()) << io.status().to_string();
  const auto t0 = Clock::now();
  auto f = (*io)->open((dir / "f").string(), OpenMode::kCreate);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  std::vector<char> buf(4u << 20, 'x');
  for (int i = 0; i < 4; ++i) STRATA_ASSERT_OK((*io)->write(*f, 0, buf.data(), buf.size()).wait());
  const double wall = seconds_since(t0);
  const auto threads = threads_named("io.0");
  ASSERT_EQ(threads.size(), 1u);
  EXPECT_EQ(threads[0], one.first(1));
  const IoEngineStats st = (*io)->stats();
  EXPECT_GT(st.cpu_seconds, 0.0);
  EXPECT_LE(st.cpu_seconds, wall + 1.0) << "one I/O thread (its start-up counts too)";
}

TEST(CpuBudgetApplied, OffloadEngineRunsTheHostOptimizerOnHostCpusAndCountsEveryEngine) {
  SKIP_BELOW_TWO_CPUS();
  TempDir dir("strata-budget-offload");
  const auto t0 = Clock::now();
  DeviceConfig dc = split_config(true);
  dc.compute_threads = 1;
  dc.host_threads = 2;  // a team of two on the one host cpu
  auto dev = Device::create(dc);
  ASSERT_TRUE(dev.ok()) << dev.status().to_string();
  const CpuSet host = (*dev)->cpu_budget().host;
  TrainerConfig tc = tiny(ModelKind::kGpt2, DType::kF32, 1, 1.0);
  OffloadSettings os;
  os.params = Tier::kNvme;
  os.optimizer = Tier::kHost;
  os.nvme_path = {dir.path().string()};
  os.io.nvme_path = os.nvme_path;
  os.persistence_threshold = 0;
  {
    auto engine = OffloadEngine::create(tc, os, **dev);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    std::vector<std::int32_t> in, tg;
    for (int s = 0; s < 2; ++s) {
      batch(tc, s, in, tg);
      auto m = (*engine)->step(in, tg);
      ASSERT_TRUE(m.ok()) << m.status().to_string();
    }
    STRATA_ASSERT_OK((*engine)->synchronize());
    const auto optimizer_threads = threads_named("host.optimizer");
    EXPECT_EQ(optimizer_threads.size(), 2u) << "the optimizer thread and its pool thread";
    for (const CpuSet& c : optimizer_threads) EXPECT_EQ(c, host);
    const auto io_threads = threads_named("io.0");
    EXPECT_EQ(io_threads.size(), 1u);
    for (const CpuSet& c : io_threads) EXPECT_EQ(c, host);

    const OffloadStats st = (*engine)->stats();
    const double wall = seconds_since(t0);
    EXPECT_GT(st.compute_cpu_seconds, 0.0);
    EXPECT_GT(st.copy_cpu_seconds, 0.0);
    EXPECT_GT(st.io_cpu_seconds, 0.0);
    EXPECT_GT(st.optimizer_cpu_seconds, 0.0);
    // Busy time cannot exceed what the cpus the engines were pinned to could give.
    const double total =
        st.compute_cpu_seconds + st.copy_cpu_seconds + st.io_cpu_seconds + st.optimizer_cpu_seconds;
    EXPECT_LE(total, wall * 2 + 0.05) << "pinned to two cpus";
    EXPECT_LE(st.optimizer_cpu_seconds, wall + 0.05) << "two threads sharing one host cpu";
  }
}

}  // namespace
}  // namespace strata::testing
