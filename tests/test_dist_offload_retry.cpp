// Retrying a failed host update in place with several data-parallel processes (docs/offload.md
// "Faults"), on real MPI processes (tests/mpi_run.sh, label `dist`). The host optimizer's state is
// sharded over the ranks (ZeRO stage 2, parameters on NVMe): every rank updates its slice of a
// module, the slices are all-gathered, and each rank writes the module's new parameters to its
// own NVMe directory. Rank 1's disk fails part-way through one step's update; the ranks agree
// per module before it counts as updated, so every rank stops at the same module, every rank
// reports the failure at its next call (rank 1 its I/O error, the others naming rank 1), a retry
// while the disk is still failing fails again on every rank, and once it is back the next call
// finishes the update in place on every rank. The run then continues bit for bit as the same
// ranks without the fault: the reduction order is the same, so the comparison is bitwise.
#include <gtest/gtest.h>

#include <string>

#include "comm_environment.hpp"
#include "dist_compare.hpp"
#include "nvme/faults.hpp"
#include "offload/internal.hpp"
#include "offload_fixture.hpp"
#include "strata/parallel.hpp"

namespace strata {
namespace {

using testing::Snapshot;
using testing::world;

TrainerConfig local_of(const TrainerConfig& global) {
  TrainerConfig c = global;
  c.grad_accum = global.grad_accum / world().size();
  return c;
}

OffloadSettings settings(const testing::TempDir& dir, int stage) {
  OffloadSettings s;
  s.params = Tier::kNvme;
  s.optimizer = Tier::kHost;
  s.zero_stage = stage;
  s.persistence_threshold = 0;  // every module's parameters at home on NVMe
  s.nvme_path = {dir.path().string()};
  return s;
}

void retry_case(int stage, DType dtype) {
  SCOPED_TRACE("stage " + std::to_string(stage) + ", " + std::string(to_string(dtype)));
  const int P = world().size();
  const int R = world().rank();
  const int failing = 1;  // the rank whose disk fails
  const TrainerConfig global = testing::tiny(ModelKind::kGpt2, dtype, P, 1.0);
  const TrainerConfig c = local_of(global);
  constexpr int kSteps = 5, k = 2;  // batch index k's update fails (step k + 1)
  testing::TempDir ref_dir("strata-dist-retry-ref"), dir("strata-dist-retry");  // each rank its own

  Snapshot ref;
  {
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(c, settings(ref_dir, stage), *device, nullptr, &world());
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    ASSERT_TRUE(testing::run_share(**engine, global, R, P, kSteps, ref));
    ASSERT_TRUE(testing::capture_state(**engine, ref));
  }

  nvme_detail::IoFaults faults;
  auto device = testing::make_device();
  auto engine = offload_detail::EngineFaults::create(c, settings(dir, stage), *device, &faults, nullptr, &world());
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  OffloadEngine& e = **engine;
  Snapshot got;
  ASSERT_TRUE(testing::run_share(e, global, R, P, k - 1, got));
  ASSERT_TRUE(e.synchronize().ok());
  const std::uint64_t b1 = faults.write_bytes_started.load();
  ASSERT_TRUE(testing::run_share(e, global, R, P, k, got, k - 1));
  ASSERT_TRUE(e.synchronize().ok());
  const std::uint64_t b2 = faults.write_bytes_started.load();
  const std::uint64_t per_step = b2 - b1;
  ASSERT_GT(per_step, 0u);
  // Rank 1's writes fail after half of one step's bytes went through.
  if (R == failing) faults.fail_writes_after_bytes = b2 + per_step / 2;
  ASSERT_TRUE(testing::run_share(e, global, R, P, k + 1, got, k));  // returns once the norm is known
  const std::string step_name = "step " + std::to_string(k + 1);
  Status first = e.synchronize();
  ASSERT_FALSE(first.ok()) << "rank " << R << ": the update of " << step_name << " did not fail";
  if (R == failing) {
    EXPECT_EQ(first.code(), StatusCode::kIoError) << first.to_string();
    EXPECT_NE(first.message().find(dir.path().string()), std::string::npos) << first.to_string();
  } else {
    EXPECT_EQ(first.code(), StatusCode::kUnavailable) << first.to_string();
    EXPECT_NE(first.message().find("failed on data-parallel rank " + std::to_string(failing)), std::string::npos)
        << first.to_string();
  }
  EXPECT_EQ(e.steps_done(), k + 1);
  // Still failing: every rank's retry fails again, together.
  Status again = e.synchronize();
  ASSERT_FALSE(again.ok()) << "rank " << R;
  EXPECT_NE(again.message().find("retrying the update of " + step_name), std::string::npos) << again.to_string();
  // The disk is back: the next call finishes the update in place on every rank, writing less
  // than a whole step on the failing rank (what went through is not written again).
  faults.fail_writes_after_bytes = 0;
  const std::uint64_t before_retry = faults.write_bytes_started.load();
  Status retried = e.synchronize();
  ASSERT_TRUE(retried.ok()) << "rank " << R << ": " << retried.to_string();
  const std::uint64_t retry_bytes = faults.write_bytes_started.load() - before_retry;
  EXPECT_GT(retry_bytes, 0u);
  EXPECT_LT(retry_bytes, per_step) << "rank " << R << ": the retry rewrote what had already gone through";
  ASSERT_TRUE(testing::run_share(e, global, R, P, kSteps, got, k + 1));
  ASSERT_TRUE(testing::capture_state(e, got));
  ASSERT_EQ(ref.losses.size(), got.losses.size());
  for (std::size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_EQ(ref.losses[i], got.losses[i]) << "loss of step " << i + 1;
    EXPECT_EQ(ref.norms[i], got.norms[i]) << "norm of step " << i + 1;
  }
  ASSERT_EQ(ref.param.size(), got.param.size());
  for (std::size_t i = 0; i < ref.param.size(); ++i) {
    EXPECT_TRUE(testing::bitwise_equal(ref.param[i], got.param[i])) << "parameter " << i;
    EXPECT_TRUE(testing::bitwise_equal(ref.master[i], got.master[i])) << "master " << i;
    EXPECT_TRUE(testing::bitwise_equal(ref.m[i], got.m[i])) << "exp_avg " << i;
    EXPECT_TRUE(testing::bitwise_equal(ref.v[i], got.v[i])) << "exp_avg_sq " << i;
  }
}

TEST(DistOffloadRetry, HostUpdateWriteErrorOnOneRankIsRetriedInPlaceOnEveryRank) {
  ASSERT_GE(world().size(), 2) << "run under mpirun -np 2 or more";
  retry_case(2, DType::kBF16);  // the parameters' write after the all-gather fails
  retry_case(3, DType::kF32);   // stage 3: each rank's slice of the parameters is written at home
}

}  // namespace
}  // namespace strata
