// The comm layer in one process: the rank grid's formula, the comm tunables, and a world of one
// rank (MPI's singleton start, no mpirun), and the polling pace both backends share (PollPacer, at
// given times: no clock). Multi-process behaviour is in test_dist_comm.cpp.
#include <gtest/gtest.h>
#include <sys/prctl.h>

#include <atomic>
#include <cstdlib>
#include <set>
#include <thread>

#include "harness/harness.hpp"
#include "parallel/work_state.hpp"
#include "parallel/poll_pacer.hpp"
#include "strata/build_config.hpp"
#include "strata/parallel.hpp"

namespace strata {
namespace {

TEST(RankGrid, FormulaPlacesTensorParallelInnermost) {
  auto g = RankGrid::create(24, 2, 3);
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  EXPECT_EQ(g->dp(), 4);
  EXPECT_TRUE(g->is_valid());
  // rank = (dp * PP + pp) * TP + tp, written out for a few points.
  EXPECT_EQ(g->rank_of({0, 0, 0}), 0);
  EXPECT_EQ(g->rank_of({1, 0, 0}), 1);
  EXPECT_EQ(g->rank_of({0, 1, 0}), 2);
  EXPECT_EQ(g->rank_of({1, 2, 0}), 5);
  EXPECT_EQ(g->rank_of({0, 0, 1}), 6);
  EXPECT_EQ(g->rank_of({1, 2, 3}), 23);
  for (int r = 0; r < 24; ++r) {
    const GridCoord c = g->coord_of(r);
    EXPECT_EQ(g->rank_of(c), r);
    EXPECT_EQ(r, (c.dp * 3 + c.pp) * 2 + c.tp);
  }
  EXPECT_EQ(g->group_ranks(GridAxis::kTensor, 5), (std::vector<int>{4, 5}));
  EXPECT_EQ(g->group_ranks(GridAxis::kPipeline, 7), (std::vector<int>{7, 9, 11}));
  EXPECT_EQ(g->group_ranks(GridAxis::kData, 3), (std::vector<int>{3, 9, 15, 21}));
}

TEST(RankGrid, GroupsAlongEachAxisPartitionTheWorld) {
  for (auto [w, tp, pp] :
       {std::tuple{8, 2, 2}, std::tuple{12, 3, 2}, std::tuple{6, 1, 6}, std::tuple{5, 5, 1}}) {
    auto g = RankGrid::create(w, tp, pp);
    ASSERT_TRUE(g.ok());
    for (GridAxis axis : {GridAxis::kTensor, GridAxis::kPipeline, GridAxis::kData}) {
      std::set<int> seen;
      std::set<int> indices;
      for (int r = 0; r < w; ++r) {
        const std::vector<int> members = g->group_ranks(axis, r);
        ASSERT_EQ(static_cast<int>(members.size()), g->size(axis));
        // The group rank of r is its coordinate on the axis.
        const GridCoord c = g->coord_of(r);
        const int coord = axis == GridAxis::kTensor ? c.tp : axis == GridAxis::kPipeline ? c.pp : c.dp;
        EXPECT_EQ(members[coord], r);
        for (int m : members) {
          EXPECT_EQ(g->group_index(axis, m), g->group_index(axis, r))
              << "w=" << w << " axis " << to_string(axis);
        }
        seen.insert(r);
        indices.insert(g->group_index(axis, r));
      }
      EXPECT_EQ(static_cast<int>(seen.size()), w);
      EXPECT_EQ(static_cast<int>(indices.size()), w / g->size(axis));
      EXPECT_EQ(*indices.rbegin(), w / g->size(axis) - 1);
    }
  }
}

TEST(RankGrid, SizesThatDoNotDivideAreErrors) {
  STRATA_EXPECT_ERROR(RankGrid::create(6, 4, 1).status(), kInvalidArgument, "not a multiple");
  STRATA_EXPECT_ERROR(RankGrid::create(8, 2, 3).status(), kInvalidArgument, "2 x 3");
  STRATA_EXPECT_ERROR(RankGrid::create(4, 0, 1).status(), kInvalidArgument, "at least 1");
}

// The rule every polling loop of the mpi and nccl backends waits by (docs/parallel.md "Waiting
// without burning a core"), evaluated at chosen times.
TEST(PollPacer, SpinsThenSleepsAnEighthOfTheWaitCappedAndStartsOverOnReset) {
  using detail::PollPacer;
  using std::chrono::microseconds;
  using std::chrono::nanoseconds;
  static_assert(PollPacer::kSpin == microseconds(500) && PollPacer::kMaxSleep == microseconds(100));
  const auto t0 = std::chrono::steady_clock::time_point{} + std::chrono::seconds(1000);
  PollPacer p;
  EXPECT_EQ(p.next_at(t0), nanoseconds(0));  // the wait starts here
  EXPECT_EQ(p.next_at(t0 + microseconds(1)), nanoseconds(0));
  EXPECT_EQ(p.next_at(t0 + microseconds(499)), nanoseconds(0));  // inside the spin window: yield
  // Past it: an eighth of the time waited so far (so a completion is seen <= 12.5% late) ...
  EXPECT_EQ(p.next_at(t0 + microseconds(500)), nanoseconds(62500));
  EXPECT_EQ(p.next_at(t0 + microseconds(640)), microseconds(80));
  EXPECT_EQ(p.next_at(t0 + microseconds(800)), microseconds(100));
  // ... and never more than kMaxSleep, however long the wait (the deadline is checked that often).
  EXPECT_EQ(p.next_at(t0 + microseconds(801)), microseconds(100));
  EXPECT_EQ(p.next_at(t0 + std::chrono::seconds(30)), microseconds(100));
  // Progress: the next wait starts over with its own spin window, measured from its first poll.
  p.reset();
  const auto t1 = t0 + std::chrono::seconds(31);
  EXPECT_EQ(p.next_at(t1), nanoseconds(0));
  EXPECT_EQ(p.next_at(t1 + microseconds(499)), nanoseconds(0));
  EXPECT_EQ(p.next_at(t1 + microseconds(720)), microseconds(90));
  // A fresh pacer (the nccl backend makes one per operation, as the mpi backend's finish does).
  PollPacer q;
  EXPECT_EQ(q.next_at(t1 + std::chrono::seconds(5)), nanoseconds(0));
}

// The first kHotSpin of a wait polls without yielding (a yield on a loaded machine gives the
// core away for a time slice, longer than a small message takes); the rest of the spin window
// yields (next_at is zero), then the sleeps start as above.
TEST(PollPacer, PollsWithoutYieldingForTheHotWindowOnly) {
  using detail::PollPacer;
  using std::chrono::microseconds;
  using std::chrono::nanoseconds;
  static_assert(PollPacer::kHotSpin == microseconds(50) && PollPacer::kHotSpin < PollPacer::kSpin);
  const auto t0 = std::chrono::steady_clock::time_point{} + std::chrono::seconds(1000);
  PollPacer p;
  EXPECT_TRUE(p.hot_at(t0));  // no wait started yet
  EXPECT_EQ(p.next_at(t0), nanoseconds(0));
  EXPECT_TRUE(p.hot_at(t0 + microseconds(49)));
  EXPECT_FALSE(p.hot_at(t0 + microseconds(50)));
  EXPECT_EQ(p.next_at(t0 + microseconds(50)), nanoseconds(0));  // yielding from here to kSpin
  EXPECT_FALSE(p.hot_at(t0 + std::chrono::seconds(3)));
  // Progress starts a new wait with its own hot window.
  p.reset();
  const auto t1 = t0 + std::chrono::seconds(5);
  EXPECT_TRUE(p.hot_at(t1));
  EXPECT_EQ(p.next_at(t1), nanoseconds(0));
  EXPECT_TRUE(p.hot_at(t1 + microseconds(10)));
  EXPECT_FALSE(p.hot_at(t1 + microseconds(60)));
}

// A wait for an operation that moves many bytes through this rank is its own transfer, not a
// late peer: expect() stretches the hot window to that transfer time (at most kMaxExpected),
// and the yielding window and the sleeps follow it as usual. A reset keeps it.
TEST(PollPacer, PollsThroughTheExpectedTransferTimeBeforePacing) {
  using detail::PollPacer;
  using std::chrono::microseconds;
  using std::chrono::milliseconds;
  using std::chrono::nanoseconds;
  const auto t0 = std::chrono::steady_clock::time_point{} + std::chrono::seconds(1000);
  PollPacer p;
  p.expect(milliseconds(3));
  EXPECT_EQ(p.next_at(t0), nanoseconds(0));
  EXPECT_TRUE(p.hot_at(t0 + microseconds(2999)));  // no yield for the transfer's 3 ms
  EXPECT_EQ(p.next_at(t0 + microseconds(2999)), nanoseconds(0));
  EXPECT_FALSE(p.hot_at(t0 + milliseconds(3)));
  // Then the usual kSpin - kHotSpin of yields, then sleeps of an eighth of the wait, capped.
  EXPECT_EQ(p.next_at(t0 + microseconds(3449)), nanoseconds(0));
  EXPECT_EQ(p.next_at(t0 + microseconds(3450)), microseconds(100));
  // Progress starts a new wait with the same window.
  p.reset();
  const auto t1 = t0 + std::chrono::seconds(10);
  EXPECT_EQ(p.next_at(t1), nanoseconds(0));
  EXPECT_TRUE(p.hot_at(t1 + microseconds(2500)));
  // Never longer than kMaxExpected, and never shorter than kHotSpin (a tiny operation).
  PollPacer q;
  q.expect(std::chrono::seconds(5));
  EXPECT_EQ(q.next_at(t0), nanoseconds(0));
  EXPECT_TRUE(q.hot_at(t0 + PollPacer::kMaxExpected - microseconds(1)));
  EXPECT_FALSE(q.hot_at(t0 + PollPacer::kMaxExpected));
  PollPacer r;
  r.expect(nanoseconds(10));
  EXPECT_EQ(r.next_at(t0), nanoseconds(0));
  EXPECT_TRUE(r.hot_at(t0 + PollPacer::kHotSpin - microseconds(1)));
  EXPECT_FALSE(r.hot_at(t0 + PollPacer::kHotSpin));
  EXPECT_EQ(r.next_at(t0 + PollPacer::kSpin), microseconds(62) + nanoseconds(500));
}

// The polling loops read the clock for every poll only once a wait has left its hot window: the
// first kHotPolls polls after progress read none, then one in kPollsPerRead while the last read
// was inside kHotSpin.
TEST(PollPacer, ReadsTheClockRarelyWhileTheWaitIsHot) {
  using detail::PollPacer;
  using std::chrono::microseconds;
  static_assert(PollPacer::kHotPolls == 32 && PollPacer::kPollsPerRead == 8);
  const auto t0 = std::chrono::steady_clock::time_point{} + std::chrono::seconds(1000);
  const auto skipped = [](PollPacer& p, int polls) {
    int n = 0;
    for (int i = 0; i < polls; ++i) n += p.skip_clock() ? 1 : 0;
    return n;
  };
  PollPacer p;
  EXPECT_EQ(skipped(p, 32), 32);  // no read at all at first
  EXPECT_EQ(skipped(p, 7), 7);    // then one in 8: poll 40 reads ...
  EXPECT_FALSE(p.skip_clock());
  (void)p.next_at(t0);  // ... and starts the wait: hot
  EXPECT_EQ(skipped(p, 7), 7);
  EXPECT_FALSE(p.skip_clock());
  (void)p.next_at(t0 + microseconds(49));  // still hot
  EXPECT_EQ(skipped(p, 8), 7);
  (void)p.next_at(t0 + microseconds(50));  // past kHotSpin: every poll reads and paces
  EXPECT_EQ(skipped(p, 16), 0);
  // Progress starts over.
  p.reset();
  EXPECT_EQ(skipped(p, 39), 39);
  EXPECT_FALSE(p.skip_clock());
}

// A wait's sleeps run with a 1 us timer slack (Linux's default, 50 us, let a 12 us sleep last
// ~80 us), and the thread gets its own slack back when the wait makes progress or ends.
TEST(PollPacer, SleepsWithATightTimerSlackAndPutsTheThreadsBack) {
  using detail::PollPacer;
  using std::chrono::microseconds;
  const int before = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
  ASSERT_GT(before, 0);
  ASSERT_NE(before, PollPacer::kSleepSlackNs);
  const auto t0 = std::chrono::steady_clock::now() - std::chrono::seconds(1);
  {
    PollPacer p;
    (void)p.next_at(t0);  // a wait that started a second ago: the next pause sleeps (100 us)
    p.pause_at(t0 + std::chrono::seconds(1));
    EXPECT_EQ(prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0), PollPacer::kSleepSlackNs);
    p.reset();  // progress
    EXPECT_EQ(prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0), before);
    (void)p.next_at(t0);
    p.pause_at(t0 + microseconds(100));  // inside the spin window: a yield, the slack untouched
    EXPECT_EQ(prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0), before);
    p.pause_at(t0 + std::chrono::seconds(1));
    EXPECT_EQ(prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0), PollPacer::kSleepSlackNs);
  }  // a wait that ends (the pacer goes) puts it back too
  EXPECT_EQ(prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0), before);
}

// A handle completes without a lock unless somebody sleeps on it (WorkState, internal.hpp): a
// waiter that checks, then sleeps, must never miss a completion that lands in between. One
// thread completes a fresh handle per round while this one waits for it, both released at once
// with head starts that vary by round, so the completion falls before, during and after the
// waiter's check; a lost wake-up hangs the round (the test's timeout), and each round's status
// must be the one set.
TEST(WorkState, AWaiterNeverMissesTheCompletion) {
  constexpr int kRounds = 20000;
  std::vector<std::unique_ptr<detail::WorkState>> states(kRounds);
  for (auto& st : states) st = std::make_unique<detail::WorkState>();
  std::atomic<int> released{-1};  // the round both threads may start
  const auto spin = [](int n) {
    std::atomic<int> steps{0};
    for (int i = 0; i < n; ++i) steps.fetch_add(1, std::memory_order_relaxed);
  };
  std::thread completer([&] {
    for (int round = 0; round < kRounds; ++round) {
      while (released.load(std::memory_order_acquire) < round) {
      }
      spin((round * 7) % 61 * 8);
      states[round]->complete(round % 2 == 0 ? ok_status() : internal_error("round " + std::to_string(round)));
    }
  });
  int wrong = 0;
  for (int round = 0; round < kRounds; ++round) {
    detail::WorkState& state = *states[round];
    released.store(round, std::memory_order_release);
    spin((round * 13) % 61 * 8);
    if (!state.finished()) state.sleep_until_done();
    if (!state.finished() || state.status.ok() != (round % 2 == 0)) ++wrong;
  }
  completer.join();
  EXPECT_EQ(wrong, 0) << "rounds whose wait returned before completion or with another status";
  for (auto& st : states) EXPECT_EQ(st->sleepers.load(), 0);
}

TEST(CommConfig, TimeoutComesFromTheTunable) {
  Options o;
  auto c = CommConfig::from_options(o);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->timeout.count(), 300'000);
  ASSERT_TRUE(o.set(Option::kCommTimeout, "2.5", "STRATA_COMM_TIMEOUT").ok());
  c = CommConfig::from_options(o);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->timeout.count(), 2'500);
  ASSERT_TRUE(o.set(Option::kCommTimeout, "0", "STRATA_COMM_TIMEOUT").ok());
  STRATA_EXPECT_ERROR(CommConfig::from_options(o).status(), kInvalidArgument, "STRATA_COMM_TIMEOUT");
  STRATA_EXPECT_ERROR(o.set(Option::kCommTimeout, "soon", "STRATA_COMM_TIMEOUT"), kInvalidArgument,
                      "comm_timeout");
}

TEST(CommNames, ParseAndDeviceMapping) {
  EXPECT_EQ(*parse_comm_backend("mpi"), CommBackend::kMpi);
  EXPECT_EQ(*parse_comm_backend("nccl"), CommBackend::kNccl);
  STRATA_EXPECT_ERROR(parse_comm_backend("gloo").status(), kInvalidArgument, "'gloo'");
  EXPECT_EQ(*comm_backend_for_device("cpu"), CommBackend::kMpi);
  EXPECT_EQ(*comm_backend_for_device("cuda"), CommBackend::kNccl);
  STRATA_EXPECT_ERROR(comm_backend_for_device("tpu").status(), kInvalidArgument, "'tpu'");
  EXPECT_EQ(to_string(ReduceOp::kAvg), "avg");
  EXPECT_EQ(to_string(GridAxis::kPipeline), "pp");
}

// A single process (no mpirun) is a world of one: every collective is a copy, and the queue,
// handles and argument checks behave as on many ranks.
TEST(CommSingleProcess, WorldOfOne) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "this build has no MPI";
  ASSERT_FALSE(launched_by_mpirun());
  CommConfig config;
  config.timeout = std::chrono::milliseconds(30'000);
  auto ctx = CommContext::create(config);
  ASSERT_TRUE(ctx.ok()) << ctx.status().to_string();
  EXPECT_EQ((*ctx)->world_size(), 1);
  EXPECT_EQ((*ctx)->world_rank(), 0);
  {
    auto groups = make_process_groups(**ctx, CommBackend::kMpi, 1, 1);
    ASSERT_TRUE(groups.ok()) << groups.status().to_string();
    Comm& w = *groups->world;
    EXPECT_EQ(w.size(), 1);
    EXPECT_EQ(groups->dp->world_ranks(), std::vector<int>{0});
    std::vector<float> a(1025);
    for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i) * 0.5f;
    std::vector<float> b(1025, -1.0f);
    std::vector<bf16> h(1025, bf16(3.0f));
    std::vector<bf16> hout(1025);
    CommWork w1 = w.all_reduce(a.data(), b.data(), a.size(), DType::kF32, ReduceOp::kAvg);
    CommWork w2 = w.reduce_scatter(h.data(), hout.data(), h.size(), DType::kBF16, ReduceOp::kSum);
    CommWork w3 = w.barrier();
    ASSERT_TRUE(w3.wait().ok());
    EXPECT_TRUE(w1.test());
    EXPECT_TRUE(w2.test());
    EXPECT_EQ(a, b);
    for (const bf16& x : hout) ASSERT_EQ(static_cast<float>(x), 3.0f);
    STRATA_EXPECT_ERROR(w.recv(b.data(), 1, DType::kF32, 0).wait(), kInvalidArgument, "peer 0");
    STRATA_EXPECT_ERROR(w.all_reduce(a.data(), b.data(), 1, DType::kF16, ReduceOp::kSum).wait(),
                        kInvalidArgument, "dtype f16");
    STRATA_EXPECT_ERROR(make_process_groups(**ctx, CommBackend::kMpi, 2, 1).status(), kInvalidArgument,
                        "world size 1");
    if (!STRATA_HAVE_NCCL) {
      STRATA_EXPECT_ERROR((*ctx)->world(CommBackend::kNccl).status(), kUnavailable, "no NCCL");
    }
    EXPECT_TRUE((*ctx)->failure().ok());
  }
  ctx->reset();
  // MPI cannot start twice in one process: a second context says so instead of crashing.
  STRATA_EXPECT_ERROR(CommContext::create(config).status(), kFailedPrecondition, "one CommContext");
}

}  // namespace
}  // namespace strata
