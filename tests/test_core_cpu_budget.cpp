// The cpu budget as a pure function of given core sets, its tunables and their errors, thread
// pinning and CpuAccount's bookkeeping of thread CPU clocks.
#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "harness/harness.hpp"
#include "strata/config.hpp"
#include "strata/cpu_budget.hpp"
#include "strata/options.hpp"

namespace strata::testing {
namespace {

CpuBudget split(const CpuSet& allowed, CpuBudgetConfig config = {}) {
  auto b = CpuBudget::make(config, allowed);
  EXPECT_TRUE(b.ok()) << b.status().to_string();
  return b.ok() ? *b : CpuBudget{};
}

CpuSet cpus(std::string_view list) {
  auto s = CpuSet::parse(list, "test");
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  return s.ok() ? *s : CpuSet{};
}

// Burns about `seconds` of CPU on the calling thread.
void spin(double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  volatile double x = 1.0;
  while (std::chrono::steady_clock::now() < end) x = x * 1.0000001 + 1e-9;
}

TEST(CpuSet, ParsesAndPrintsCpuLists) {
  EXPECT_EQ(cpus("3").cpus(), (std::vector<int>{3}));
  EXPECT_EQ(cpus("0-3").cpus(), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(cpus("6,0-2,2").cpus(), (std::vector<int>{0, 1, 2, 6}));
  EXPECT_EQ(cpus("6,0-2,4,5").to_string(), "0-2,4-6");
  EXPECT_EQ(CpuSet::range(4, 3).to_string(), "4-6");
  EXPECT_EQ(CpuSet().to_string(), "");
  EXPECT_TRUE(cpus("0-7").contains(cpus("2,5")));
  EXPECT_FALSE(cpus("0-3").contains(cpus("3-4")));
  EXPECT_EQ(cpus("0-7").minus(cpus("1-6")).to_string(), "0,7");
  EXPECT_EQ(cpus("2-9").first(3).to_string(), "2-4");
  for (const char* bad : {"", "a", "1-", "-1", "3-1", "1,,2", "1,", "0-99999", " 1"}) {
    STRATA_EXPECT_ERROR(CpuSet::parse(bad, "compute_cpus"), kInvalidArgument, "compute_cpus");
  }
}

TEST(CpuBudget, OneCpuIsSharedByComputeAndHostWork) {
  const CpuBudget b = split(cpus("5"));
  EXPECT_EQ(b.compute, cpus("5"));
  EXPECT_EQ(b.host, cpus("5"));
  EXPECT_TRUE(b.shared());
  EXPECT_EQ(b.compute_threads, 1);
  EXPECT_EQ(b.host_threads, 1);
  EXPECT_NE(b.to_string().find("shared"), std::string::npos) << b.to_string();
}

TEST(CpuBudget, TwoCpusGiveComputeOneAndHostWorkTheOther) {
  const CpuBudget b = split(cpus("0-1"));
  EXPECT_EQ(b.compute, cpus("0"));
  EXPECT_EQ(b.host, cpus("1"));
  EXPECT_FALSE(b.shared());
  EXPECT_TRUE(b.pin);
  EXPECT_EQ(b.compute_threads, 1);
  EXPECT_EQ(b.host_threads, 1);
  EXPECT_EQ(b.to_string(), "compute cpus 0 (1 thread), host cpus 1 (1 thread), pinned");
}

TEST(CpuBudget, ManyCpusSplitInHalvesOrByComputeThreads) {
  // A cpuset that is neither contiguous nor starting at 0 (as taskset or a container gives).
  const CpuSet allowed = cpus("2-5,8-10");
  CpuBudget b = split(allowed);
  EXPECT_EQ(b.compute, cpus("2-4"));
  EXPECT_EQ(b.host, cpus("5,8-10"));
  EXPECT_EQ(b.compute_threads, 3);
  EXPECT_EQ(b.host_threads, 4);

  CpuBudgetConfig c;
  c.compute_threads = 5;
  b = split(allowed, c);
  EXPECT_EQ(b.compute, cpus("2-5,8"));
  EXPECT_EQ(b.host, cpus("9-10"));
  EXPECT_EQ(b.compute_threads, 5);
  EXPECT_EQ(b.host_threads, 2);

  // compute_threads covering every cpu: compute gets all of them and host work shares them.
  c.compute_threads = 40;
  b = split(allowed, c);
  EXPECT_EQ(b.compute, allowed);
  EXPECT_EQ(b.host, allowed);
  EXPECT_TRUE(b.shared());
  EXPECT_EQ(b.compute_threads, 40);
  EXPECT_EQ(b.host_threads, 7);

  c = {};
  c.host_threads = 3;
  b = split(cpus("0-15"), c);
  EXPECT_EQ(b.compute, cpus("0-7"));
  EXPECT_EQ(b.host, cpus("8-15"));
  EXPECT_EQ(b.host_threads, 3);
}

TEST(CpuBudget, ExplicitSetsAndTheirComplements) {
  const CpuSet allowed = cpus("0-7");
  CpuBudgetConfig c;
  c.compute_cpus = "4-7";
  CpuBudget b = split(allowed, c);
  EXPECT_EQ(b.compute, cpus("4-7"));
  EXPECT_EQ(b.host, cpus("0-3"));
  EXPECT_EQ(b.compute_threads, 4);

  c = {};
  c.host_cpus = "0";
  b = split(allowed, c);
  EXPECT_EQ(b.compute, cpus("1-7"));
  EXPECT_EQ(b.host, cpus("0"));
  EXPECT_EQ(b.host_threads, 1);

  c = {};
  c.compute_cpus = "0-7";  // everything: host work shares it
  b = split(allowed, c);
  EXPECT_EQ(b.host, allowed);
  EXPECT_TRUE(b.shared());

  c.compute_cpus = "1";
  c.host_cpus = "1-2";  // overlapping on request
  b = split(allowed, c);
  EXPECT_EQ(b.compute, cpus("1"));
  EXPECT_EQ(b.host, cpus("1-2"));
  EXPECT_TRUE(b.shared());

  c = {};
  c.affinity = false;
  b = split(allowed, c);
  EXPECT_FALSE(b.pin);
  EXPECT_EQ(b.compute, cpus("0-3")) << "the split stands; only pinning is off";
  EXPECT_NE(b.to_string().find("not pinned"), std::string::npos);
}

TEST(CpuBudget, LocalRanksSharingTheCpusTakeASliceEach) {
  CpuBudgetConfig c;
  c.local_size = 2;
  c.local_rank = 0;
  CpuBudget b = split(cpus("0-7"), c);
  EXPECT_EQ(b.allowed, cpus("0-3"));
  EXPECT_EQ(b.compute, cpus("0-1"));
  EXPECT_EQ(b.host, cpus("2-3"));
  c.local_rank = 1;
  b = split(cpus("0-7"), c);
  EXPECT_EQ(b.compute, cpus("4-5"));
  EXPECT_EQ(b.host, cpus("6-7"));
  // Two ranks on two cpus: one each, compute and host work sharing it.
  c.local_rank = 1;
  b = split(cpus("0-1"), c);
  EXPECT_EQ(b.compute, cpus("1"));
  EXPECT_EQ(b.host, cpus("1"));
  EXPECT_TRUE(b.shared());
  // More ranks than cpus: round robin.
  c.local_size = 4;
  c.local_rank = 3;
  b = split(cpus("0-1"), c);
  EXPECT_EQ(b.compute, cpus("1"));
  // Explicit sets are taken as given.
  c.compute_cpus = "0";
  b = split(cpus("0-1"), c);
  EXPECT_EQ(b.compute, cpus("0"));
  EXPECT_EQ(b.host, cpus("1"));
  c = {};
  c.local_size = 2;
  c.local_rank = 2;
  STRATA_EXPECT_ERROR(CpuBudget::make(c, cpus("0-3")), kInvalidArgument, "local rank 2 of 2");
}

TEST(CpuBudget, ADeviceThatComputesElsewhereGivesTheHostEverything) {
  auto b = CpuBudget::make({}, cpus("0-7"), /*device_on_host=*/false);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_TRUE(b->compute.empty());
  EXPECT_EQ(b->host, cpus("0-7"));
  EXPECT_EQ(b->compute_threads, 0);
  EXPECT_EQ(b->host_threads, 7) << "one core left to the thread driving the device";
  EXPECT_FALSE(b->shared());
  b = CpuBudget::make({}, cpus("3"), false);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->host_threads, 1);
}

TEST(CpuBudget, BadValuesNameTheKey) {
  const CpuSet allowed = cpus("0-3");
  CpuBudgetConfig c;
  c.compute_cpus = "2-5";
  STRATA_EXPECT_ERROR(CpuBudget::make(c, allowed), kInvalidArgument, "compute_cpus: cpus 4-5 are not among");
  c = {};
  c.host_cpus = "9";
  STRATA_EXPECT_ERROR(CpuBudget::make(c, allowed), kInvalidArgument, "host_cpus");
  STRATA_EXPECT_ERROR(CpuBudget::make(c, allowed), kInvalidArgument, "(0-3)");
  c = {};
  c.host_cpus = "1-";
  STRATA_EXPECT_ERROR(CpuBudget::make(c, allowed), kInvalidArgument, "host_cpus");
  c = {};
  c.compute_threads = -1;
  STRATA_EXPECT_ERROR(CpuBudget::make(c, allowed), kInvalidArgument, "compute_threads");
  c = {};
  c.host_threads = -2;
  STRATA_EXPECT_ERROR(CpuBudget::make(c, allowed), kInvalidArgument, "host_threads");
  STRATA_EXPECT_ERROR(CpuBudget::make({}, CpuSet()), kInvalidArgument, "no cpu");
}

TEST(CpuBudget, TunablesReachTheBudgetAndBadOnesNameTheKey) {
  Options o;
  EXPECT_TRUE(o.get_bool(Option::kCpuAffinity));
  EXPECT_EQ(o.get_string(Option::kComputeCpus), "auto");
  EXPECT_EQ(o.get_string(Option::kHostCpus), "auto");
  STRATA_EXPECT_OK(o.set(Option::kCpuAffinity, "0", "STRATA_CPU_AFFINITY"));
  STRATA_EXPECT_OK(o.set(Option::kComputeCpus, "0", "--x"));
  STRATA_EXPECT_OK(o.set(Option::kHostCpus, "0,1", "--x"));
  STRATA_EXPECT_OK(o.set(Option::kHostThreads, "3", "--x"));
  const CpuBudgetConfig c = CpuBudgetConfig::from_options(o);
  EXPECT_FALSE(c.affinity);
  EXPECT_EQ(c.compute_cpus, "0");
  EXPECT_EQ(c.host_cpus, "0,1");
  EXPECT_EQ(c.host_threads, 3);
  STRATA_EXPECT_ERROR(o.set(Option::kComputeCpus, "0-", "STRATA_COMPUTE_CPUS"), kInvalidArgument,
                      "STRATA_COMPUTE_CPUS: value '0-' for option 'compute_cpus'");
  STRATA_EXPECT_ERROR(o.set(Option::kCpuAffinity, "maybe", "STRATA_CPU_AFFINITY"), kInvalidArgument,
                      "cpu_affinity");

  STRATA_EXPECT_ERROR(parse_config(R"({"strata": {"host_cpus": "x"}})", "c.json"), kInvalidArgument,
                      "strata.host_cpus");
  auto config = parse_config(R"({"strata": {"host_cpus": "1", "cpu_affinity": false}})", "c.json");
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  EXPECT_EQ(config->strata.get_string(Option::kHostCpus), "1");
  EXPECT_FALSE(config->strata.get_bool(Option::kCpuAffinity));
}

TEST(CpuAffinity, PinningAThreadSetsWhatItReadsBack) {
  const CpuSet allowed = process_cpus();
  ASSERT_FALSE(allowed.empty());
  const CpuSet one = allowed.first(1);
  CpuSet seen, seen_team;
  std::thread t([&] {
    STRATA_EXPECT_OK(pin_current_thread(one));
    seen = current_thread_cpus();
    // Threads created later inherit the mask: an OpenMP team led by this thread.
    std::vector<CpuSet> team(2);
#pragma omp parallel num_threads(2)
    team[static_cast<std::size_t>(omp_get_thread_num())] = current_thread_cpus();
    seen_team = team[1];
  });
  t.join();
  EXPECT_EQ(seen, one);
  EXPECT_EQ(seen_team, one);
  EXPECT_EQ(current_thread_cpus(), allowed) << "other threads are untouched";
  STRATA_EXPECT_ERROR(pin_current_thread(CpuSet()), kInvalidArgument, "empty");
}

TEST(CpuAccount, SumsTheClocksOfItsThreadsAndKeepsThoseThatExited) {
  CpuAccount account;
  EXPECT_EQ(account.seconds(), 0.0);
  EXPECT_EQ(account.threads(), 0);
  const auto t0 = std::chrono::steady_clock::now();
  std::thread a([&] {
    account.join();
    account.join();  // again: a no-op
    spin(0.05);
  });
  a.join();
  const double after_exit = account.seconds();
  EXPECT_GT(after_exit, 0.0) << "an exited member's time stays";
  EXPECT_EQ(account.threads(), 1);

  std::atomic<bool> joined{false}, stop{false};
  std::thread b([&] {
    account.join(/*since_start=*/true);
    joined = true;
    spin(0.02);
    while (!stop) std::this_thread::yield();
  });
  while (!joined) std::this_thread::yield();
  const double live = account.seconds();
  EXPECT_GE(live, after_exit);
  EXPECT_EQ(account.threads(), 2);
  stop = true;
  b.join();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(account.seconds(), live);
  EXPECT_LE(account.seconds(), wall * account.threads() + 0.01);
}

TEST(CpuAccount, AThreadMovingToAnotherAccountLeavesItsTimeBehind) {
  CpuAccount first, second;
  EXPECT_FALSE(CpuAccount::of_current_thread().valid());
  std::thread t([&] {
    first.join();
    spin(0.02);
    EXPECT_TRUE(CpuAccount::of_current_thread().valid());
    second.join();
    const double kept = first.seconds();
    spin(0.02);
    EXPECT_EQ(first.seconds(), kept) << "time after the move goes to the new account";
  });
  t.join();
  EXPECT_GT(first.seconds(), 0.0);
  EXPECT_GT(second.seconds(), 0.0);
  EXPECT_EQ(first.threads(), 1);
  EXPECT_EQ(second.threads(), 1);
}

TEST(CpuAccount, JoinTeamCountsTheOpenMpTeamOfTheLeader) {
  CpuAccount account;
  std::thread t([&] {
    account.join(true);
    account.join_team(3);
#pragma omp parallel num_threads(3)
    spin(0.01);
  });
  t.join();
  EXPECT_EQ(account.threads(), 3) << "the leader and its two pool threads";
  EXPECT_GT(account.seconds(), 0.0);
}

}  // namespace
}  // namespace strata::testing
