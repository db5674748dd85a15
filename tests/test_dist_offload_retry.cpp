// Retrying a failed host update in place with several processes (docs/offload.md "Faults"), on
// real MPI processes (tests/mpi_run.sh, label `dist`). The world is one group: data parallel (the
// optimizer state sharded over the ranks), tensor parallel (each rank its shard of every
// module) or a pipeline (each rank a stage). Rank 1's disk fails part-way through one step's
// update. The ranks agree before anything counts as updated (per module over the data-parallel
// and tensor groups, per step over the stages), so every rank reports the failure at its next
// call (rank 1 its I/O error naming its swap file, the others naming rank 1), a retry while the
// disk is still failing fails again on every rank, and once it is back the next call finishes
// the update in place on every rank. The run then continues bit for bit as the same ranks
// without the fault: the reduction order is the same, so the comparison is bitwise (losses,
// norms, and every parameter, master and moment this rank holds). Also on the 2 x 2 grids of 4
// ranks and the 2 x 2 x 2 grid of 8, with the delayed update, with update_during_backward
// (agreed, sticky), a failure that stops one rank's pass before a collective of the pass (a
// compute-stream or a caller error; agreed: the rank keeps its place, DistOffloadPassRetry, and
// on the tensor 2 x pipeline 2 and data 2 x pipeline 2 grids DistOffloadPassRetryGrid), and a killed rank (not agreed:
// the job ends with an error, DistOffloadKilledRank).
#include <gtest/gtest.h>

#include <csignal>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "comm_environment.hpp"
#include "dist_compare.hpp"
#include "nvme/faults.hpp"
#include "offload/internal.hpp"
#include "offload_fixture.hpp"
#include "strata/checkpoint.hpp"
#include "strata/parallel.hpp"

namespace strata {
namespace {

using testing::Snapshot;
using testing::world;

// kDataTensor, kDataPipeline, kTensorPipeline: the 2 x 2 grids of 4 ranks (data 2 x tensor 2,
// data 2 x pipeline 2, tensor 2 x pipeline 2; make_process_groups); kDataTensorPipeline the
// whole grid of 8 (tensor 2 x pipeline 2 x data 2); the others use the whole world as their one
// group.
enum class Group {
  kData,
  kTensor,
  kPipeline,
  kDataTensor,
  kDataPipeline,
  kTensorPipeline,
  kDataTensorPipeline
};

bool is_grid(Group g) {
  return g == Group::kDataTensor || g == Group::kDataPipeline || g == Group::kTensorPipeline ||
         g == Group::kDataTensorPipeline;
}

// One case: how the world is used, the ZeRO stage, the dtype, where the working parameters and
// the optimizer state live and (NVMe optimizer) the sub-group size, small enough that a
// module's state is written in several pieces and a failure can stop inside a module.
struct Case {
  Group group;
  int stage;
  DType dtype;
  Tier params = Tier::kNvme;
  Tier optimizer = Tier::kHost;
  std::int64_t sub_group_size = 1'000'000'000;
  ModelKind kind = ModelKind::kGpt2;
  // Rank 1's writes fail once this share of one step's write bytes went through (1: at the last
  // write, for a stage whose first module holds most of its bytes).
  double fail_share = 0.5;
  // The call after the failed update is the next step() instead of synchronize(): with data or
  // tensor parallelism it runs the forward up to the failed module (stage 3's all-gathers, the
  // tensor all-reduces of the modules before it) and fails there on every rank.
  bool next_is_step = false;
};

OffloadSettings settings(const testing::TempDir& dir, const Case& k) {
  OffloadSettings s;
  s.params = k.params;
  s.optimizer = k.optimizer;
  s.zero_stage = k.stage;
  s.sub_group_size = k.sub_group_size;
  s.persistence_threshold = 0;  // every module's parameters at their home
  s.nvme_path = {dir.path().string()};
  return s;
}

const char* name_of(Group g) {
  switch (g) {
    case Group::kData: return "data parallel";
    case Group::kTensor: return "tensor parallel";
    case Group::kPipeline: return "pipeline";
    case Group::kDataTensor: return "data 2 x tensor 2";
    case Group::kDataPipeline: return "data 2 x pipeline 2";
    case Group::kTensorPipeline: return "tensor 2 x pipeline 2";
    case Group::kDataTensorPipeline: return "tensor 2 x pipeline 2 x data 2";
  }
  return "?";
}

// This rank's groups for `g`: the world as the one group, or a grid of 4 ranks.
struct Groups {
  Comm* dp = nullptr;
  Comm* tp = nullptr;
  Comm* pp = nullptr;
  int dp_rank = 0, dp_size = 1;  // this rank's share of the global batch
  Result<ProcessGroups> grid = failed_precondition("no grid");

  explicit Groups(Group g) {
    switch (g) {
      case Group::kData:
        dp = &world();
        dp_rank = world().rank();
        dp_size = world().size();
        break;
      case Group::kTensor: tp = &world(); break;
      case Group::kPipeline: pp = &world(); break;
      case Group::kDataTensor:
        grid = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, 2, 1);
        if (!grid.ok()) break;
        dp = grid->dp.get();
        tp = grid->tp.get();
        dp_rank = grid->coord.dp;
        dp_size = grid->grid.dp();
        break;
      case Group::kDataPipeline:
        // rank = dp * 2 + stage: world rank 1 is data-parallel rank 0 of stage 1.
        grid = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, 1, 2);
        if (!grid.ok()) break;
        dp = grid->dp.get();
        pp = grid->pp.get();
        dp_rank = grid->coord.dp;
        dp_size = grid->grid.dp();
        break;
      case Group::kTensorPipeline:
        // rank = stage * 2 + tensor rank: world rank 1 is tensor-parallel rank 1 of stage 0.
        grid = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, 2, 2);
        if (!grid.ok()) break;
        tp = grid->tp.get();
        pp = grid->pp.get();
        break;
      case Group::kDataTensorPipeline:
        // rank = (dp * 2 + stage) * 2 + tensor rank: world rank 1 is tensor-parallel rank 1 of
        // data-parallel rank 0 of stage 0; stage 0 is world ranks 0, 1, 4, 5.
        grid = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, 2, 2);
        if (!grid.ok()) break;
        dp = grid->dp.get();
        tp = grid->tp.get();
        pp = grid->pp.get();
        dp_rank = grid->coord.dp;
        dp_size = grid->grid.dp();
        break;
    }
  }
  bool data() const { return dp != nullptr; }
  bool pipeline() const { return pp != nullptr; }
};

// The engine of this rank for its groups, with `faults` when given.
Result<std::unique_ptr<OffloadEngine>> make_engine(const TrainerConfig& c, const OffloadSettings& s, Device& device,
                                                   const Groups& g, const nvme_detail::IoFaults* faults) {
  if (faults == nullptr) return OffloadEngine::create(c, s, device, nullptr, g.dp, g.tp, g.pp);
  return offload_detail::EngineFaults::create(c, s, device, faults, g.pp, g.dp, g.tp);
}

// One step of batch `index` (this rank's data-parallel share of it), its status only.
Status step_status(OffloadEngine& e, const TrainerConfig& global, const Groups& g, int index) {
  std::vector<std::int32_t> in, tg;
  if (g.data()) {
    testing::share_of(global, index, g.dp_rank, g.dp_size, in, tg);
  } else {
    testing::batch(global, index, in, tg);
  }
  return e.step(in, tg).status();
}

// The run against the same ranks without the fault: losses and norms, and every parameter,
// master and moment this rank holds, bit for bit.
void expect_bitwise(const Snapshot& ref, const Snapshot& got) {
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

// This rank's state: every parameter, or on a pipeline the stage's own.
bool capture_rank_state(OffloadEngine& e, const Groups& g, Snapshot& out) {
  if (!g.pipeline()) return testing::capture_state(e, out);
  std::vector<int> held;
  return testing::capture_stage(e, out, held) && !held.empty();
}

// The run against the same ranks without the fault: a fresh engine (no faults) makes the calls
// of `run` (its steps, into `ref`), then `ref` gets this rank's state.
template <class Run>
void reference_run(const TrainerConfig& c, const OffloadSettings& s, const Groups& g, Run run,
                   Snapshot& ref) {
  auto device = testing::make_device();
  auto engine = make_engine(c, s, *device, g, nullptr);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  ASSERT_TRUE(run(**engine, ref));
  ASSERT_TRUE(capture_rank_state(**engine, g, ref));
}

// How a peer of world rank 1 names it when rank 1's host update failed: the ranks that update
// the same units learn it in the per-unit agreement (over the data-parallel, then the tensor
// group), the other stage in the stages' agreement.
std::string update_failure_named(Group g, const Groups& groups) {
  const int stage = groups.grid.ok() ? groups.grid->coord.pp : 0;
  switch (g) {
    case Group::kData: return "failed on data-parallel rank 1";
    case Group::kTensor: return "failed on tensor-parallel rank 1";
    case Group::kPipeline: return "failed on pipeline stage 1";
    // World rank 1 is data-parallel rank 0 of tensor-parallel rank 1.
    case Group::kDataTensor: return "failed on data-parallel rank 0 of tensor-parallel rank 1";
    // World rank 1 is data-parallel rank 0 of stage 1.
    case Group::kDataPipeline:
      return stage == 1 ? "failed on data-parallel rank 0" : "failed on pipeline stage 1";
    // World rank 1 is tensor-parallel rank 1 of stage 0.
    case Group::kTensorPipeline:
      return stage == 0 ? "failed on tensor-parallel rank 1" : "failed on pipeline stage 0";
    // World rank 1 is data-parallel rank 0, tensor-parallel rank 1 of stage 0: stage 0's other
    // three ranks learn it over their data-parallel and tensor groups, stage 1's four over their
    // pipelines.
    case Group::kDataTensorPipeline:
      return stage == 0 ? "failed on data-parallel rank 0 of tensor-parallel rank 1"
                        : "failed on pipeline stage 0";
  }
  return "?";
}

// Where world rank 1 sits in the grid, as a failure before the update names it to every other
// rank (the axes of size 1 left out).
std::string place_of_rank1(Group g) {
  switch (g) {
    case Group::kData: return "data-parallel rank 1";
    case Group::kTensor: return "tensor-parallel rank 1";
    case Group::kPipeline: return "pipeline stage 1";
    case Group::kDataTensor: return "data-parallel rank 0, tensor-parallel rank 1";
    case Group::kDataPipeline: return "data-parallel rank 0, pipeline stage 1";
    case Group::kTensorPipeline: return "tensor-parallel rank 1, pipeline stage 0";
    case Group::kDataTensorPipeline: return "data-parallel rank 0, tensor-parallel rank 1, pipeline stage 0";
  }
  return "?";
}

void retry_case(const Case& which) {
  const int stage = which.stage;
  const DType dtype = which.dtype;
  SCOPED_TRACE(std::string(name_of(which.group)) + (which.next_is_step ? " (next call: step)" : "") + ", stage " +
               std::to_string(stage) + ", " +
               std::string(to_string(dtype)) + ", parameters on " + std::string(to_string(which.params)) +
               ", optimizer on " + std::string(to_string(which.optimizer)));
  const int R = world().rank();
  const int failing = 1;  // the (world) rank whose disk fails
  const Groups groups(which.group);
  ASSERT_TRUE(!is_grid(which.group) || groups.grid.ok()) << groups.grid.status().to_string();
  const bool data = groups.data();
  const int DP = groups.dp_size;
  // Data parallel: the global batch of DP micro-batches (with a pipeline 2 DP: two per rank),
  // each rank its share; otherwise every rank runs the whole batch (two micro-batches: the
  // pipeline's schedule has something to overlap).
  const TrainerConfig global = testing::tiny(which.kind, dtype, data ? DP * (groups.pipeline() ? 2 : 1) : 2, 1.0);
  TrainerConfig c = global;
  if (data) c.grad_accum = global.grad_accum / DP;
  auto run = [&](OffloadEngine& e, int from, int to, Snapshot& out) {
    return data ? testing::run_share(e, global, groups.dp_rank, DP, to, out, from)
                : testing::run_steps(e, c, from, to, out);
  };
  auto capture = [&](OffloadEngine& e, Snapshot& out) { return capture_rank_state(e, groups, out); };
  constexpr int kSteps = 5, k = 2;  // batch index k's update fails (step k + 1)
  testing::TempDir ref_dir("strata-dist-retry-ref"), dir("strata-dist-retry");  // each rank its own

  Snapshot ref;
  ASSERT_NO_FATAL_FAILURE(reference_run(
      c, settings(ref_dir, which), groups,
      [&](OffloadEngine& r, Snapshot& out) { return run(r, 0, kSteps, out); }, ref));

  nvme_detail::IoFaults faults;
  auto device = testing::make_device();
  auto engine = make_engine(c, settings(dir, which), *device, groups, &faults);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  OffloadEngine& e = **engine;
  Snapshot got;
  ASSERT_TRUE(run(e, 0, k - 1, got));
  ASSERT_TRUE(e.synchronize().ok());
  const std::uint64_t b1 = faults.write_bytes_started.load();
  ASSERT_TRUE(run(e, k - 1, k, got));
  ASSERT_TRUE(e.synchronize().ok());
  const std::uint64_t b2 = faults.write_bytes_started.load();
  const std::uint64_t per_step = b2 - b1;
  ASSERT_GT(per_step, 0u);
  // Rank 1's writes fail part-way through one step's update.
  const std::uint64_t through = which.fail_share >= 1.0 ? per_step - 1
                                                        : static_cast<std::uint64_t>(which.fail_share * per_step);
  if (R == failing) faults.fail_writes_after_bytes = b2 + through;
  ASSERT_TRUE(run(e, k, k + 1, got));  // returns once the norm is known
  const std::string step_name = "step " + std::to_string(k + 1);
  Status first = which.next_is_step ? step_status(e, global, groups, k + 1) : e.synchronize();
  ASSERT_FALSE(first.ok()) << "rank " << R << ": the update of " << step_name << " did not fail";
  if (R == failing) {
    EXPECT_EQ(first.code(), StatusCode::kIoError) << first.to_string();
    EXPECT_NE(first.message().find(dir.path().string()), std::string::npos) << first.to_string();
  } else {
    EXPECT_EQ(first.code(), StatusCode::kUnavailable) << first.to_string();
    EXPECT_NE(first.message().find(update_failure_named(which.group, groups)), std::string::npos)
        << first.to_string();
  }
  EXPECT_EQ(e.steps_done(), k + 1);
  // Still failing: every rank's retry fails again, together.
  Status again = e.synchronize();
  ASSERT_FALSE(again.ok()) << "rank " << R;
  EXPECT_NE(again.message().find("retrying the update of " + step_name), std::string::npos) << again.to_string();
  // The disk is back: the next call finishes the update in place on every rank, writing less
  // than a whole step on every rank (what went through is not written again; a pipeline stage
  // that finished its part writes nothing).
  faults.fail_writes_after_bytes = 0;
  const std::uint64_t before_retry = faults.write_bytes_started.load();
  Status retried = e.synchronize();
  ASSERT_TRUE(retried.ok()) << "rank " << R << ": " << retried.to_string();
  const std::uint64_t retry_bytes = faults.write_bytes_started.load() - before_retry;
  if (!groups.pipeline() || R == failing) {
    EXPECT_GT(retry_bytes, 0u) << "rank " << R;
  }
  EXPECT_LT(retry_bytes, per_step) << "rank " << R << ": the retry rewrote what had already gone through";
  ASSERT_TRUE(run(e, k + 1, kSteps - 1, got));
  const OffloadStats before_last = e.stats();
  ASSERT_TRUE(run(e, kSteps - 1, kSteps, got));
  const OffloadStats last = e.stats();
  // The data-parallel bytes once the last update finished (right after step() returned, the
  // update's collectives and the early gathers are in flight: counted or not is timing).
  ASSERT_TRUE(e.synchronize().ok()) << "rank " << R;
  const OffloadStats settled = e.stats();
  ASSERT_TRUE(capture(e, got));
  expect_bitwise(ref, got);
  // The early fetch across steps (docs/offload.md "One step"; data parallel at stages 0-3,
  // tensor parallel, pipelines) is in effect again after the agreed retry: every access of the
  // last step, its first included, was fetched ahead.
  if (which.params != Tier::kDevice) {
    const std::uint64_t accesses = last.param_accesses - before_last.param_accesses;
    EXPECT_GT(accesses, 0u) << "rank " << R;
    EXPECT_EQ(last.prefetch_hits - before_last.prefetch_hits, accesses) << "rank " << R;
  }
  // Stage 3: an early copy taken or dropped (refetched: another all-gather) is decided alike on
  // every rank, through the failed step, the reports and the retries: the same hits, accesses
  // and data-parallel bytes on every rank.
  if (stage == 3 && which.group == Group::kData) {
    testing::expect_same_text_on_every_rank("hits " + std::to_string(last.prefetch_hits) + ", accesses " +
                                                std::to_string(last.param_accesses) + ", data-parallel bytes " +
                                                std::to_string(settled.bytes_dp),
                                            "the counters after the last step");
  }
}

// A failure before the update (docs/offload.md "Faults", "Before the update"): kNonFinite puts
// NaN into one parameter on rank 1 only (fp32, so restoring it restores its master exactly), so
// the gradient norm every rank merges is not finite; kGradientWrite (with the NVMe optimizer, as
// NVMe gradients need) fails rank 1's NVMe gradient writes half-way through one step's backward
// (its gradient stream goes on: the reduce-scatters after the failed write are every rank's), a
// local failure that travels as a flag with the norm's statistics. Either way every rank's step()
// fails, nothing is updated on any rank (the step count stays; a retry while the disk still fails
// fails again on every rank) and calling step() again with the same batch on every rank, once
// the cause is gone, continues bit for bit as the same ranks without the fault.
enum class Before { kNonFinite, kGradientWrite };

void before_update_case(Group group, Before fault, int stage, Tier params, ModelKind kind) {
  const bool nonfinite = fault == Before::kNonFinite;
  SCOPED_TRACE(std::string(name_of(group)) + (nonfinite ? ", a non-finite norm" : ", a gradient write fails") +
               ", stage " + std::to_string(stage) + ", parameters on " + std::string(to_string(params)) + ", " +
               std::string(to_string(kind)));
  const int R = world().rank();
  const int failing = 1;  // the (world) rank whose gradients are bad or whose disk fails
  const Groups groups(group);
  ASSERT_TRUE(!is_grid(group) || groups.grid.ok()) << groups.grid.status().to_string();
  const bool data = groups.data();
  const int DP = groups.dp_size;
  const TrainerConfig global = testing::tiny(kind, DType::kF32, data ? DP * (groups.pipeline() ? 2 : 1) : 2, 1.0);
  TrainerConfig c = global;
  if (data) c.grad_accum = global.grad_accum / DP;
  auto run = [&](OffloadEngine& e, int from, int to, Snapshot& out) {
    return data ? testing::run_share(e, global, groups.dp_rank, DP, to, out, from)
                : testing::run_steps(e, c, from, to, out);
  };
  auto capture = [&](OffloadEngine& e, Snapshot& out) { return capture_rank_state(e, groups, out); };
  auto make_settings = [&](const testing::TempDir& dir) {
    OffloadSettings s;
    s.params = params;
    // NVMe gradients go with the NVMe optimizer.
    s.optimizer = nonfinite ? Tier::kHost : Tier::kNvme;
    s.zero_stage = stage;
    s.persistence_threshold = 0;
    s.gradients = nonfinite ? Tier::kHost : Tier::kNvme;
    s.update_during_backward = false;  // the norm decides (clipping is on anyway)
    s.nvme_path = {dir.path().string()};
    return s;
  };
  constexpr int kSteps = 4, k = 2;  // batch k (step k + 1) fails
  testing::TempDir ref_dir("strata-dist-before-ref"), dir("strata-dist-before");  // each rank its own
  Snapshot ref;
  ASSERT_NO_FATAL_FAILURE(reference_run(
      c, make_settings(ref_dir), groups,
      [&](OffloadEngine& r, Snapshot& out) { return run(r, 0, kSteps, out); }, ref));

  nvme_detail::IoFaults faults;
  auto device = testing::make_device();
  auto engine = make_engine(c, make_settings(dir), *device, groups, &faults);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  OffloadEngine& e = **engine;
  Snapshot got;
  ASSERT_TRUE(run(e, 0, k - 1, got));
  ASSERT_TRUE(e.synchronize().ok());
  const std::uint64_t b1 = faults.write_bytes_started.load();
  ASSERT_TRUE(run(e, k - 1, k, got));
  ASSERT_TRUE(e.synchronize().ok());
  const std::uint64_t b2 = faults.write_bytes_started.load();
  Snapshot before;  // the state the failed step must leave as it is
  ASSERT_TRUE(capture(e, before));
  // Every rank's first owning parameter it holds (a pipeline stage its own; tensor parallel reads
  // are collective: every rank reads the same ones in the same order).
  int index = -1;
  std::vector<float> original;
  const ModelLayout& L = e.model().layout();
  for (std::size_t i = 0; i < L.params.size() && index < 0; ++i) {
    if (!L.params[i].owns_storage()) continue;
    auto p = e.get_param(static_cast<int>(i));
    if (!p.ok()) continue;  // held by another stage
    index = static_cast<int>(i);
    original = std::move(*p);
  }
  ASSERT_GE(index, 0);
  if (nonfinite) {
    // Every rank writes (data parallel: set_param gathers the sharded master over the ranks), the
    // others the values they hold (fp32: the master is the parameter, so nothing changes there).
    std::vector<float> bad(original.size(), std::nanf(""));
    ASSERT_TRUE(e.set_param(index, R == failing ? bad : original).ok());
  } else {
    // With the parameters on the device a step writes its fp32 gradients during backward, then
    // [master | m | v] in the update: a quarter of its bytes are the gradients, which come
    // first (the previous step's update has finished: synchronize). An eighth of the step's
    // bytes is half-way through its gradient writes.
    const std::uint64_t per_step = b2 - b1;
    ASSERT_GT(per_step, 0u);
    if (R == failing) faults.fail_writes_after_bytes = b2 + per_step / 8;
  }
  const std::string step_name = "step " + std::to_string(k + 1);
  auto expect_failed = [&](const Status& s, const char* when) {
    ASSERT_FALSE(s.ok()) << "rank " << R << ": " << step_name << " did not fail " << when;
    if (nonfinite) {
      // Every rank merged the same statistics: every rank reports the norm itself.
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
      EXPECT_NE(s.message().find("not finite"), std::string::npos) << s.to_string();
      EXPECT_NE(s.message().find("nothing was updated"), std::string::npos) << s.to_string();
    } else if (R == failing) {
      EXPECT_EQ(s.code(), StatusCode::kIoError) << s.to_string();
      EXPECT_NE(s.message().find(dir.path().string()), std::string::npos) << s.to_string();
    } else {
      const std::string named = place_of_rank1(group);
      EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();
      EXPECT_NE(s.message().find(step_name + ": the step failed before its update on " + named), std::string::npos)
          << s.to_string();
    }
    EXPECT_EQ(e.steps_done(), k) << "rank " << R << " " << when;
  };
  expect_failed(step_status(e, global, groups, k), "the first time");
  // The cause is still there: the same step fails again on every rank, alike.
  expect_failed(step_status(e, global, groups, k), "while its cause is still there");
  // The cause is gone (the parameter repaired on rank 1, the disk back): the same batch again on
  // every rank, and the run goes on as if nothing had happened.
  if (nonfinite) {
    ASSERT_TRUE(e.set_param(index, original).ok());
  }
  faults.fail_writes_after_bytes = 0;
  // Nothing of the failed step was applied on any rank: every parameter, master and moment this
  // rank holds is as before it (and the step count, checked above).
  Snapshot after;
  ASSERT_TRUE(capture(e, after));
  expect_bitwise(before, after);
  ASSERT_TRUE(run(e, k, kSteps, got));
  ASSERT_TRUE(capture(e, got));
  expect_bitwise(ref, got);
}

TEST(DistOffloadRetry, NonFiniteNormOnOneRankFailsTheStepOnEveryRankAndItRunsAgain) {
  ASSERT_GE(world().size(), 2) << "run under mpirun -np 2 or more";
  before_update_case(Group::kData, Before::kNonFinite, 2, Tier::kHost, ModelKind::kGpt2);
  before_update_case(Group::kTensor, Before::kNonFinite, 0, Tier::kHost, ModelKind::kGpt2);
  before_update_case(Group::kPipeline, Before::kNonFinite, 0, Tier::kDevice, ModelKind::kGpt2);
}

// A local failure before the norm: the failing rank's flag travels with the statistics every
// rank gathers for the norm (the data-parallel all-gather, the stages', the tensor ranks').
TEST(DistOffloadRetry, GradientWriteErrorOnOneRankFailsTheStepOnEveryRankAndItRunsAgain) {
  ASSERT_GE(world().size(), 2) << "run under mpirun -np 2 or more";
  before_update_case(Group::kData, Before::kGradientWrite, 2, Tier::kDevice, ModelKind::kGpt2);
  before_update_case(Group::kTensor, Before::kGradientWrite, 0, Tier::kDevice, ModelKind::kGpt2);
  // GPT-2: the tied embedding's gradient is read back, summed over the two stages and written
  // again (the read or the write may be the one that fails; the sum is still every stage's).
  before_update_case(Group::kPipeline, Before::kGradientWrite, 0, Tier::kDevice, ModelKind::kGpt2);
}

// The grid of 4 ranks (data 2 x tensor 2; dist.offload_retry.np4): world rank 1 (data-parallel
// rank 0, tensor-parallel rank 1) fails part-way through one step's update, and, in the second
// case, half-way through one step's gradient writes. The per-unit agreement runs over the
// data-parallel group, then the tensor group; the flag before the norm over the same two.
TEST(DistOffloadRetryGrid, DataTimesTensorFailureOnOneRankIsAgreedOnEveryRank) {
  ASSERT_EQ(world().size(), 4) << "run under mpirun -np 4";
  retry_case({Group::kDataTensor, 2, DType::kBF16});  // host optimizer, parameters on NVMe
  before_update_case(Group::kDataTensor, Before::kGradientWrite, 2, Tier::kDevice, ModelKind::kGpt2);
}

TEST(DistOffloadRetry, HostUpdateWriteErrorOnOneRankIsRetriedInPlaceOnEveryRank) {
  ASSERT_GE(world().size(), 2) << "run under mpirun -np 2 or more";
  retry_case({Group::kData, 2, DType::kBF16});  // the parameters' write after the all-gather fails
  retry_case({Group::kData, 3, DType::kF32});   // stage 3: each rank's slice of the parameters is written at home
  // Stage 0 with the host optimizer shards the optimizer state as stage 1 does: the same path.
  retry_case({Group::kData, 0, DType::kF32});
  // The next call is a step: stage 3's forward all-gathers the modules before the failed one on
  // every rank, then fails on every rank where it waits for the failed one.
  Case step_next{Group::kData, 3, DType::kF32};
  step_next.next_is_step = true;
  retry_case(step_next);
}

// The NVMe optimizer: each rank streams its slice's [master | m | v] sub-groups through the ring
// and writes them back while the next ones are read; rank 1's sub-group (or parameter) write
// fails part-way. The ranks agree once a module's writes retired, so they stop at the same module
// and its all-gather is never left waiting for a peer; the retry reads back the sub-groups that
// were written (taking only the working parameters from their master) and updates the rest.
TEST(DistOffloadRetry, NvmeOptimizerWriteErrorOnOneRankIsRetriedInPlaceOnEveryRank) {
  ASSERT_GE(world().size(), 2) << "run under mpirun -np 2 or more";
  // Parameters on the device: only the sub-groups' writes can fail.
  retry_case({Group::kData, 1, DType::kF32, Tier::kDevice, Tier::kNvme, 4097});
  // Parameters on NVMe too (bf16): the parameters' write after the all-gather fails as well.
  retry_case({Group::kData, 2, DType::kBF16, Tier::kNvme, Tier::kNvme, 4097});
  // Stage 3: each rank's slice of the parameters is written at home after its sub-groups.
  retry_case({Group::kData, 3, DType::kF32, Tier::kNvme, Tier::kNvme, 4097});
  // Stage 3 with the parameters on the host (each rank's slice in host memory; the sub-group
  // writes fail): the next call is a step whose early fetches were gated on the failed update.
  Case host_params{Group::kData, 3, DType::kBF16, Tier::kHost, Tier::kNvme, 4097};
  host_params.next_is_step = true;
  retry_case(host_params);
}

// Tensor parallelism: each rank updates its own shard of every module (no collective inside the
// update); the tensor group agrees per module, so every rank's next forward stops at the same
// module, before that module's all-reduces.
TEST(DistOffloadRetry, TensorParallelWriteErrorOnOneRankIsRetriedInPlaceOnEveryRank) {
  ASSERT_GE(world().size(), 2) << "run under mpirun -np 2 or more";
  retry_case({Group::kTensor, 0, DType::kBF16});                                 // host optimizer, parameters on NVMe
  retry_case({Group::kTensor, 0, DType::kF32, Tier::kNvme, Tier::kNvme, 4097});  // NVMe optimizer
  Case step_next{Group::kTensor, 0, DType::kBF16};  // the next call is a step (its forward's all-reduces)
  step_next.next_is_step = true;
  retry_case(step_next);
}

// A pipeline: each stage updates its own modules; the stages agree once per update and a call
// waits for that verdict first, so no stage starts the next step's sends or receives while
// another reports the failure.
TEST(DistOffloadRetry, PipelineWriteErrorOnOneStageIsRetriedInPlaceOnEveryStage) {
  ASSERT_GE(world().size(), 2) << "run under mpirun -np 2 or more";
  // The host optimizer with the parameters on NVMe (LLaMA: no tied embedding). The last stage's
  // first module (a block) holds most of its bytes, so half-way would fail inside it and the
  // retry would rewrite everything: its last write fails instead.
  retry_case({Group::kPipeline, 0, DType::kBF16, Tier::kNvme, Tier::kHost, 1'000'000'000, ModelKind::kLlama, 1.0});
  // The NVMe optimizer (GPT-2: its tied embedding is updated on the first and the last stage).
  retry_case({Group::kPipeline, 0, DType::kF32, Tier::kDevice, Tier::kNvme, 4097});
  // The next call is a step: every stage reports at its start, before any send or receive.
  Case step_next{Group::kPipeline, 0, DType::kF32, Tier::kDevice, Tier::kNvme, 4097};
  step_next.next_is_step = true;
  retry_case(step_next);
}

// The grid of 4 ranks data 2 x pipeline 2 (dist.offload_retry_pp.np4): world rank 1
// (data-parallel rank 0 of stage 1) fails part-way through one step's update (host optimizer,
// stage 2 bf16, GPT-2 with its tied embedding on both stages, parameters on NVMe). The per-module
// agreement runs over each stage's data-parallel group, then the stages agree on the step over
// each pipeline; every rank reports, a retry while the disk fails fails on every rank, and then
// the run continues bit for bit against the same grid without the fault. The next call is
// synchronize(), and in the second case the next step() (every rank reports at its start, before
// any send or receive). Then, before the update: world rank 1's NVMe gradient writes fail
// half-way through a step's backward; its flag travels with the data-parallel statistics gather
// and the stages' gather, so all four ranks fail the step and run it again.
TEST(DistOffloadRetryGridPipeline, DataTimesPipelineFailureOnOneRankIsAgreedOnEveryRank) {
  ASSERT_EQ(world().size(), 4) << "run under mpirun -np 4";
  retry_case({Group::kDataPipeline, 2, DType::kBF16});
  Case step_next{Group::kDataPipeline, 2, DType::kBF16};
  step_next.next_is_step = true;
  retry_case(step_next);
  before_update_case(Group::kDataPipeline, Before::kGradientWrite, 2, Tier::kDevice, ModelKind::kGpt2);
}

// The grid of 4 ranks tensor 2 x pipeline 2 (dist.offload_retry_tp_pp.np4): world rank 1
// (tensor-parallel rank 1 of stage 0) fails part-way through one step's update (host optimizer,
// bf16, GPT-2 with its tied embedding on both stages, parameters on NVMe). The per-module
// agreement runs over each stage's tensor group, then the stages agree on the step over each
// pipeline (one per tensor rank); every rank reports (rank 1 its kIoError, its tensor peer
// "failed on tensor-parallel rank 1", stage 1's ranks "failed on pipeline stage 0"), a retry
// while the disk fails fails on every rank, and the run continues bit for bit against the same
// grid without the fault. The next call is synchronize(), and in the second case the next
// step(). Then, before the update: world rank 1's NVMe gradient writes fail half-way through a
// step's backward; its flag travels with the stages' statistics gather and the tensor ranks'
// gather, so all four ranks fail the step and run it again.
TEST(DistOffloadRetryGridTensorPipeline, TensorTimesPipelineFailureOnOneRankIsAgreedOnEveryRank) {
  ASSERT_EQ(world().size(), 4) << "run under mpirun -np 4";
  retry_case({Group::kTensorPipeline, 0, DType::kBF16});
  Case step_next{Group::kTensorPipeline, 0, DType::kBF16};
  step_next.next_is_step = true;
  retry_case(step_next);
  before_update_case(Group::kTensorPipeline, Before::kGradientWrite, 0, Tier::kDevice, ModelKind::kGpt2);
}

// The delayed update (bf16, host optimizer, parameters on NVMe: the update writes each unit's
// next version; warm-up 1, so step 2 on is delayed) with data parallelism (dp 2, stage 2), tensor
// parallelism (tp 2), a pipeline (pp 2, GPT-2's tied embedding on both stages) and the whole grid
// (tp 2 x pp 2 x dp 2, stage 2).
//   kBeforeNorm: rank 1's call of step k + 1 fails once its pass ran through (a stream error its
//     call sees then; EngineFaults::fail_next_pass), with step k's update in flight and not yet
//     published: the other ranks' passes went through and published P[k], rank 1's call skipped
//     the publish. Every rank's step() fails with nothing updated (rank 1 its own error, the
//     others naming rank 1's place in the grid: the flag travels with the norm's statistics over
//     every group), again while the cause is there, and then the same batch runs on every rank
//     at P[k] (rank 1 publishes first): bit for bit the same ranks without the fault that flush
//     after step k (synchronize(): the next step computes at P[k]). Bitwise because the rerun is
//     the same computation in the same reduction order as the reference's step k + 1.
//   kHostUpdate: rank 1's next-version writes fail half-way through step k + 1's update; the
//     ranks agree per module, every rank's synchronize() reports, a retry while the disk fails
//     fails on every rank, then it finishes in place: bit for bit the same ranks without the
//     fault making the same calls.
enum class DelayedFault { kBeforeNorm, kHostUpdate };

void delayed_case(DelayedFault fault, Group group = Group::kData) {
  const bool before = fault == DelayedFault::kBeforeNorm;
  SCOPED_TRACE(std::string("delayed update, ") + name_of(group) + ", " +
               (before ? "a failure before the norm" : "a failed host update"));
  const int R = world().rank();
  const int failing = 1;
  const Groups groups(group);
  ASSERT_TRUE(!is_grid(group) || groups.grid.ok()) << groups.grid.status().to_string();
  const int DP = groups.dp_size;  // 1 without data parallelism: every rank the whole batch
  const TrainerConfig global = testing::tiny(ModelKind::kGpt2, DType::kBF16, DP, 1.0);
  TrainerConfig c = global;
  c.grad_accum = global.grad_accum / DP;
  auto run = [&](OffloadEngine& e, int from, int to, Snapshot& out) {
    return testing::run_share(e, global, groups.dp_rank, DP, to, out, from);
  };
  auto make_settings = [&](const testing::TempDir& dir) {
    OffloadSettings s;
    s.params = Tier::kNvme;
    s.optimizer = Tier::kHost;
    s.zero_stage = groups.data() ? 2 : 0;
    s.persistence_threshold = 0;
    s.delayed_update = true;
    s.delayed_update_warmup = 1;
    s.nvme_path = {dir.path().string()};
    return s;
  };
  constexpr int kSteps = 6, k = 3;  // step k + 1 (batch k) fails
  const std::string step_name = "step " + std::to_string(k + 1);
  testing::TempDir ref_dir("strata-dist-dpu-ref"), dir("strata-dist-dpu");  // each rank its own

  // The run without the fault, making the same flushing calls (synchronize()) as the faulty one.
  Snapshot ref;
  {
    auto device = testing::make_device();
    auto engine = make_engine(c, make_settings(ref_dir), *device, groups, nullptr);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    OffloadEngine& e = **engine;
    if (before) {
      ASSERT_TRUE(run(e, 0, k, ref));
      ASSERT_TRUE(e.synchronize().ok());
      ASSERT_TRUE(run(e, k, kSteps, ref));
    } else {
      ASSERT_TRUE(run(e, 0, k - 1, ref));
      ASSERT_TRUE(e.synchronize().ok());
      ASSERT_TRUE(run(e, k - 1, k, ref));
      ASSERT_TRUE(e.synchronize().ok());
      ASSERT_TRUE(run(e, k, k + 1, ref));
      ASSERT_TRUE(e.synchronize().ok());
      ASSERT_TRUE(run(e, k + 1, kSteps, ref));
    }
    ASSERT_TRUE(capture_rank_state(e, groups, ref));
  }

  nvme_detail::IoFaults faults;
  auto device = testing::make_device();
  auto engine = make_engine(c, make_settings(dir), *device, groups, &faults);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  OffloadEngine& e = **engine;
  Snapshot got;
  if (before) {
    ASSERT_TRUE(run(e, 0, k, got));  // step k's update in flight, not published
    const std::string cause = "injected: the compute stream of rank 1 failed after its pass";
    auto expect_failed = [&](const char* when) {
      if (R == failing) offload_detail::EngineFaults::fail_next_pass(e, internal_error(cause));
      const Status s = step_status(e, global, groups, k);
      ASSERT_FALSE(s.ok()) << "rank " << R << ": " << step_name << " did not fail " << when;
      if (R == failing) {
        EXPECT_EQ(s.code(), StatusCode::kInternal) << s.to_string();
        EXPECT_NE(s.message().find(cause), std::string::npos) << s.to_string();
      } else {
        EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();
        const std::string named =
            step_name + ": the step failed before its update on " + place_of_rank1(group);
        EXPECT_NE(s.message().find(named), std::string::npos)
            << s.to_string();
      }
      EXPECT_EQ(e.steps_done(), k) << "rank " << R << " " << when;
    };
    expect_failed("the first time");
    expect_failed("while its cause is still there");
    // The same batch on every rank: rank 1 publishes P[k] first, as rank 0 did in its failed call.
    ASSERT_TRUE(run(e, k, kSteps, got));
  } else {
    ASSERT_TRUE(run(e, 0, k - 1, got));
    ASSERT_TRUE(e.synchronize().ok());
    const std::uint64_t b1 = faults.write_bytes_started.load();
    ASSERT_TRUE(run(e, k - 1, k, got));
    ASSERT_TRUE(e.synchronize().ok());
    const std::uint64_t b2 = faults.write_bytes_started.load();
    const std::uint64_t per_step = b2 - b1;
    ASSERT_GT(per_step, 0u);
    if (R == failing) faults.fail_writes_after_bytes = b2 + per_step / 2;
    ASSERT_TRUE(run(e, k, k + 1, got));  // returns once the norm is known; the update runs on
    Status first = e.synchronize();
    ASSERT_FALSE(first.ok()) << "rank " << R << ": the update of " << step_name << " did not fail";
    if (R == failing) {
      EXPECT_EQ(first.code(), StatusCode::kIoError) << first.to_string();
      EXPECT_NE(first.message().find(dir.path().string()), std::string::npos) << first.to_string();
    } else {
      EXPECT_EQ(first.code(), StatusCode::kUnavailable) << first.to_string();
      EXPECT_NE(first.message().find(update_failure_named(group, groups)), std::string::npos)
          << first.to_string();
    }
    Status again = e.synchronize();
    ASSERT_FALSE(again.ok()) << "rank " << R;
    EXPECT_NE(again.message().find("retrying the update of " + step_name), std::string::npos)
        << again.to_string();
    faults.fail_writes_after_bytes = 0;
    const std::uint64_t before_retry = faults.write_bytes_started.load();
    Status retried = e.synchronize();
    ASSERT_TRUE(retried.ok()) << "rank " << R << ": " << retried.to_string();
    const std::uint64_t retry_bytes = faults.write_bytes_started.load() - before_retry;
    // A pipeline stage that finished its part of the update writes nothing in the retry.
    if (!groups.pipeline() || R == failing) {
      EXPECT_GT(retry_bytes, 0u) << "rank " << R;
    }
    EXPECT_LT(retry_bytes, per_step) << "rank " << R << ": the retry rewrote what had already gone through";
    ASSERT_TRUE(run(e, k + 1, kSteps, got));
  }
  ASSERT_TRUE(capture_rank_state(e, groups, got));
  expect_bitwise(ref, got);
}

TEST(DistOffloadRetry, DelayedUpdateFailureOnOneRankIsAgreedAndRetriedOnEveryRank) {
  ASSERT_GE(world().size(), 2) << "run under mpirun -np 2 or more";
  delayed_case(DelayedFault::kBeforeNorm);
  delayed_case(DelayedFault::kHostUpdate);
  // The agreed rerun with tensor parallelism (the flag over the tensor ranks' norm gather) and a
  // pipeline (over the stages' gather; rank 1 is the last stage).
  delayed_case(DelayedFault::kBeforeNorm, Group::kTensor);
  delayed_case(DelayedFault::kBeforeNorm, Group::kPipeline);
  // The failed host update retried in place with tensor parallelism (each rank writes its shard's
  // next version; the tensor ranks agree per module) and a pipeline (each stage its own units'
  // next version; the stages agree on the step, and the stage that finished writes nothing more).
  delayed_case(DelayedFault::kHostUpdate, Group::kTensor);
  delayed_case(DelayedFault::kHostUpdate, Group::kPipeline);
}

// The whole grid of 8 ranks, tensor 2 x pipeline 2 x data 2 (dist.offload_retry_grid.np8;
// rank = (dp * 2 + stage) * 2 + tensor rank): world rank 1 is tensor-parallel rank 1 and
// data-parallel rank 0 of stage 0. GPT-2 (its tied embedding on both stages), stage 2, two
// micro-batches per rank. Its update fails half-way (host optimizer, bf16, parameters on NVMe):
// the per-unit agreement runs over each stage's data-parallel group, then its tensor group, so
// stage 0's three other ranks name "data-parallel rank 0 of tensor-parallel rank 1"; then the
// stages agree over each pipeline, so stage 1's four ranks name "pipeline stage 0"; the next call
// is synchronize() and, in the second case, step(). Then, before the norm (fp32, NVMe optimizer
// and gradients): rank 1's gradient writes fail half-way through a step's backward, and its flag
// reaches every rank through the data-parallel, the stages' and the tensor ranks' statistics
// gathers ("data-parallel rank 0, tensor-parallel rank 1, pipeline stage 0"). Each case
// continues bit for bit against the same grid without the fault: the same reductions in the
// same order.
TEST(DistOffloadRetryGridFull, TensorTimesPipelineTimesDataFailureOnOneRankIsAgreedOnEveryRank) {
  ASSERT_EQ(world().size(), 8) << "run under mpirun -np 8";
  retry_case({Group::kDataTensorPipeline, 2, DType::kBF16});
  Case step_next{Group::kDataTensorPipeline, 2, DType::kBF16};
  step_next.next_is_step = true;
  retry_case(step_next);
  before_update_case(Group::kDataTensorPipeline, Before::kGradientWrite, 2, Tier::kDevice, ModelKind::kGpt2);
}

// The delayed update's agreed rerun on the whole grid (stage 2, bf16, host optimizer, parameters
// on NVMe, one micro-batch per rank): rank 1's call of step 4 fails once its pass ran through
// while step 3's update is in flight; the seven others published it in their calls. Every rank's
// step() fails, again while the cause is there, and the same batch then runs at P[3] on every
// rank, bit for bit against the same grid without the fault flushing after step 3. Then its
// failed host update: rank 1's next-version writes fail half-way through step 4's update; the
// per-unit agreement over stage 0's data-parallel and tensor groups and the stages' agreement
// name it on every rank (as in the case without the delay above), a retry while the disk fails
// fails on every rank, and the next synchronize() finishes it in place: bit for bit the grid
// without the fault making the same calls.
TEST(DistOffloadRetryGridFull, DelayedUpdateFailureBeforeTheNormIsAgreedAndRunAgainOnEveryRank) {
  ASSERT_EQ(world().size(), 8) << "run under mpirun -np 8";
  delayed_case(DelayedFault::kBeforeNorm, Group::kDataTensorPipeline);
  delayed_case(DelayedFault::kHostUpdate, Group::kDataTensorPipeline);
}

// update_during_backward with tensor parallelism (tp 2, fp32, clipping off, host optimizer,
// parameters on the device): each rank updates its shard of a module as soon as its gradients
// land, before the norm. Rank 1's call of step 3 fails once its pass ran through
// (EngineFaults::fail_next_pass); by then rank 0 has updated every module and rank 1 those that
// landed, so the step cannot run again. Its flag travels with the tensor ranks' norm gather, so
// every rank's step() fails (no rank waits for the other) with an error naming the cause (rank
// 1 its own, rank 0 "tensor-parallel rank 1") and the checkpoint to reload; every later call
// fails alike (sticky), and loading the checkpoint saved after step 2 recovers: the run goes on
// bit for bit as the same ranks without the fault.
TEST(DistOffloadRetry, UpdateDuringBackwardFailureOnOneRankIsStickyOnEveryRank) {
  ASSERT_GE(world().size(), 2) << "run under mpirun -np 2 or more";
  const int R = world().rank();
  const int failing = 1;
  const Groups groups(Group::kTensor);
  const TrainerConfig c = testing::tiny(ModelKind::kGpt2, DType::kF32, 2, 0.0);  // clipping off
  OffloadSettings s;
  s.params = Tier::kDevice;
  s.optimizer = Tier::kHost;
  s.persistence_threshold = 0;
  s.update_during_backward = true;
  constexpr int kSteps = 4, k = 2;  // step k + 1 (batch k) fails
  Snapshot ref;
  ASSERT_NO_FATAL_FAILURE(reference_run(
      c, s, groups, [&](OffloadEngine& r, Snapshot& out) { return testing::run_steps(r, c, 0, kSteps, out); },
      ref));
  const std::string root = testing::shared_temp_dir("udb-sticky");
  nvme_detail::IoFaults faults;
  auto device = testing::make_device();
  auto engine = make_engine(c, s, *device, groups, &faults);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  OffloadEngine& e = **engine;
  Snapshot got;
  ASSERT_TRUE(testing::run_steps(e, c, 0, k, got));
  auto saved = e.save_checkpoint(root + "/ck", "{}", k);
  ASSERT_TRUE(saved.ok()) << saved.status().to_string();
  const std::string cause = "injected: the compute stream of rank 1 failed after its pass";
  if (R == failing) offload_detail::EngineFaults::fail_next_pass(e, internal_error(cause));
  const std::string step_name = "step " + std::to_string(k + 1);
  auto expect_sticky = [&](const Status& st, const char* when) {
    ASSERT_FALSE(st.ok()) << "rank " << R << ": " << when << " did not fail";
    EXPECT_NE(st.message().find(step_name + ": "), std::string::npos) << when << ": " << st.to_string();
    EXPECT_NE(st.message().find("with update_during_backward"), std::string::npos)
        << when << ": " << st.to_string();
    EXPECT_NE(st.message().find("load the last checkpoint"), std::string::npos)
        << when << ": " << st.to_string();
    if (R == failing) {
      EXPECT_EQ(st.code(), StatusCode::kInternal) << when << ": " << st.to_string();
      EXPECT_NE(st.message().find(cause), std::string::npos) << when << ": " << st.to_string();
    } else {
      EXPECT_EQ(st.code(), StatusCode::kUnavailable) << when << ": " << st.to_string();
      EXPECT_NE(st.message().find("failed before its norm on tensor-parallel rank 1"), std::string::npos)
          << when << ": " << st.to_string();
    }
  };
  std::vector<std::int32_t> in, tg;
  testing::batch(c, k, in, tg);
  expect_sticky(e.step(in, tg).status(), "the failing step");
  EXPECT_EQ(e.steps_done(), k) << "rank " << R;
  // Sticky: the same step again, and a flush, fail alike on every rank (nothing runs).
  expect_sticky(e.step(in, tg).status(), "the step again");
  expect_sticky(e.synchronize(), "synchronize()");
  EXPECT_EQ(e.steps_done(), k) << "rank " << R;
  // The way out: the checkpoint after step k, then the run goes on as without the fault.
  auto loaded = e.load_checkpoint(root + "/ck");
  ASSERT_TRUE(loaded.ok()) << "rank " << R << ": " << loaded.status().to_string();
  EXPECT_EQ(loaded->step, k);
  ASSERT_TRUE(testing::run_steps(e, c, k, kSteps, got));
  ASSERT_TRUE(testing::capture_state(e, got));
  expect_bitwise(ref, got);
}

// A failure that stops one rank's pass before a collective of the pass (docs/offload.md
// "Faults", "A rank whose pass failed keeps its place"; dist.offload_pass_retry.np2, run with
// STRATA_COMM_TIMEOUT=60 and a hang limit well under it, so waiting for a timeout fails the job).
// kCompute: rank 1's compute stream fails at the forward of a module
// (EngineFaults::fail_compute_at), so its later kernels are skipped; kCaller: rank 1's caller
// fails there (EngineFaults::fail_caller_at), inside the pass. Either way rank 1 keeps its place:
// its tensor all-reduces, or its pipeline sends and receives, still run (on whatever the buffers
// hold, never read), both ranks reach the norm's statistics gathers, and the failure is agreed
// there like any failure before the norm. Every rank's step() fails (rank 1 its own cause, rank 0
// kUnavailable naming rank 1's place), nothing is updated, and step() again with the same batch
// on both ranks continues bit for bit as the same ranks without the fault.
enum class PassFault { kCompute, kCaller };

struct PassCase {
  Group group;
  PassFault fault;
  bool at_last_module;  // the fault at rank 1's last module (the head) instead of its module 1
  int virtual_stages = 1;
  int zero_stage = 0;
};

void pass_fault_case(const PassCase& k) {
  const bool caller = k.fault == PassFault::kCaller;
  SCOPED_TRACE(std::string(name_of(k.group)) +
               (caller ? ", the caller fails" : ", the compute stream fails") +
               (k.at_last_module ? " at the last module's forward" : " at module 1's forward") +
               (k.virtual_stages > 1 ? ", interleaved" : "") + ", stage " + std::to_string(k.zero_stage));
  const int np = is_grid(k.group) ? 4 : 2;
  ASSERT_EQ(world().size(), np) << "run under mpirun -np " << np;
  const int R = world().rank();
  const int failing = 1;
  const Groups groups(k.group);
  ASSERT_TRUE(!is_grid(k.group) || groups.grid.ok()) << groups.grid.status().to_string();
  // A pipeline: two micro-batches, so the fault is followed by exchanges of both directions.
  const TrainerConfig c = testing::tiny(ModelKind::kGpt2, DType::kF32, groups.pipeline() ? 2 : 1, 1.0);
  OffloadSettings s;
  s.params = groups.pipeline() ? Tier::kHost : Tier::kDevice;
  s.optimizer = Tier::kHost;
  s.persistence_threshold = 0;
  s.pipeline_virtual_stages = k.virtual_stages;
  s.zero_stage = k.zero_stage;
  constexpr int kSteps = 3, step = 1;  // batch `step` (step 2) fails
  auto capture = [&](OffloadEngine& e, Snapshot& out) { return capture_rank_state(e, groups, out); };
  Snapshot ref;
  ASSERT_NO_FATAL_FAILURE(reference_run(
      c, s, groups, [&](OffloadEngine& r, Snapshot& out) { return testing::run_steps(r, c, 0, kSteps, out); },
      ref));
  nvme_detail::IoFaults faults;
  auto device = testing::make_device();
  auto engine = make_engine(c, s, *device, groups, &faults);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  OffloadEngine& e = **engine;
  Snapshot got;
  ASSERT_TRUE(testing::run_steps(e, c, 0, step, got));
  Snapshot before;  // the state the failed step must leave as it is
  ASSERT_TRUE(capture(e, before));
  const int module = k.at_last_module ? e.model().num_modules() - 1 : 1;
  const std::string cause = std::string("injected: the ") + (caller ? "caller" : "compute stream") +
                            " of rank 1 failed in module " + std::to_string(module);
  if (R == failing) {
    if (caller) {
      offload_detail::EngineFaults::fail_caller_at(e, module, internal_error(cause));
    } else {
      offload_detail::EngineFaults::fail_compute_at(e, module, internal_error(cause));
    }
  }
  const std::string step_name = "step " + std::to_string(step + 1);
  std::vector<std::int32_t> in, tg;
  testing::batch(c, step, in, tg);
  const Status st = e.step(in, tg).status();
  ASSERT_FALSE(st.ok()) << "rank " << R << ": " << step_name << " did not fail";
  if (R == failing) {
    EXPECT_EQ(st.code(), StatusCode::kInternal) << st.to_string();
    EXPECT_NE(st.message().find(cause), std::string::npos) << st.to_string();
    EXPECT_EQ(st.message().find("could not be agreed"), std::string::npos) << st.to_string();
  } else {
    EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
    EXPECT_NE(
        st.message().find(step_name + ": the step failed before its update on " + place_of_rank1(k.group)),
        std::string::npos)
        << st.to_string();
  }
  EXPECT_EQ(st.message().find("comm timeout"), std::string::npos) << st.to_string();
  EXPECT_EQ(e.steps_done(), step) << "rank " << R;
  // Nothing of the failed step was applied on either rank.
  Snapshot after;
  ASSERT_TRUE(capture(e, after));
  expect_bitwise(before, after);
  // The fault was once: the same batch again on both ranks, and the run goes on as without it.
  ASSERT_TRUE(testing::run_steps(e, c, step, kSteps, got));
  ASSERT_TRUE(capture(e, got));
  expect_bitwise(ref, got);
}

TEST(DistOffloadPassRetry, ComputeFailureBeforeATensorAllReduceIsAgreedAndRunAgainOnEveryRank) {
  pass_fault_case({Group::kTensor, PassFault::kCompute, /*at_last_module=*/false});
  pass_fault_case({Group::kTensor, PassFault::kCompute, /*at_last_module=*/true});
}

// The last stage's caller, then its compute stream, fails at the head's forward of the first
// micro-batch. The compute-stream case also holds the next micro-batch's set_batch, recorded on
// the failed stream: the rerun's first set_batch must not take that stale error as its own.
TEST(DistOffloadPassRetry, FailureInsideThePipelineScheduleIsAgreedAndRunAgainOnEveryStage) {
  for (int v : {1, 2}) {
    pass_fault_case({Group::kPipeline, PassFault::kCaller, /*at_last_module=*/true, v});
    pass_fault_case({Group::kPipeline, PassFault::kCompute, /*at_last_module=*/true, v});
  }
}

// The tensor 2 x pipeline 2 grid (dist.offload_pass_retry.np4; rank = stage * 2 + tensor rank):
// world rank 1, tensor-parallel rank 1 of stage 0, fails at the forward of module 1 (a block,
// whose forward holds two tensor all-reduces) in the first micro-batch. Its caller's error
// inside the module's work (plain and interleaved) fails its compute stream and the stage goes
// on with the model's work alone, so its tensor peer's all-reduces and the other stage's
// exchanges all find it (keep_module_place); a compute-stream error there keeps its place the
// same way. Every rank's step() fails (rank 1 its cause, the three others naming "tensor-parallel
// rank 1, pipeline stage 0"), and the same batch then runs bit for bit as the same grid without
// the fault.
TEST(DistOffloadPassRetryGrid, FailureInATensorParallelStageIsAgreedAndRunAgainOnEveryRank) {
  for (int v : {1, 2})
    pass_fault_case({Group::kTensorPipeline, PassFault::kCaller, /*at_last_module=*/false, v});
  pass_fault_case({Group::kTensorPipeline, PassFault::kCompute, /*at_last_module=*/false});
}

// The data 2 x pipeline 2 grid (rank = dp * 2 + stage): world rank 1, data-parallel rank 0 of
// stage 1, fails at the head's forward of the first micro-batch (host optimizer sharded over the
// data-parallel pair: stage 1 reduce-scatters each unit's gradients after the last micro-batch,
// stage 2 after every micro-batch). Its caller's error fails its compute stream; the stage goes
// on with the model's work and the gradient reduce-scatters of every later module
// (reduce_after_failure), so its data-parallel peer's reduce-scatters and the other stage's
// exchanges all find it. Every rank's step() fails (the three others naming "data-parallel rank
// 0, pipeline stage 1"), and the same batch runs again bit for bit. Then (stage 2) interleaved,
// and its compute stream failing there instead.
TEST(DistOffloadPassRetryGrid, FailureInADataParallelStageIsAgreedAndRunAgainOnEveryRank) {
  for (int stage : {1, 2}) {
    PassCase k{Group::kDataPipeline, PassFault::kCaller, /*at_last_module=*/true};
    k.zero_stage = stage;
    pass_fault_case(k);
  }
  PassCase interleaved{Group::kDataPipeline, PassFault::kCaller, /*at_last_module=*/true, 2};
  interleaved.zero_stage = 2;
  pass_fault_case(interleaved);
  PassCase compute{Group::kDataPipeline, PassFault::kCompute, /*at_last_module=*/true};
  compute.zero_stage = 2;
  pass_fault_case(compute);
}

// A rank that is really gone (dist.offload_killed_rank.np2, STRATA_COMM_TIMEOUT=3, mpirun told
// not to end the job when a rank dies): tensor parallel (tp 2), rank 1 SIGKILLs itself before
// step 2, so rank 0 waits in the step's first tensor all-reduce for a peer that will never come.
// No agreement can reach it: its step() returns the comm timeout naming the operation and the
// group within comm_timeout, and the watchdog then ends the job (non-zero), as for any failed
// collective (docs/parallel.md "Timeouts and failure"). DISABLED_ because it ends the job: the
// ordinary runs of this program skip it and only that job runs it (--gtest_also_run_disabled_tests).
TEST(DistOffloadKilledRank, DISABLED_KilledTensorRankEndsTheJobThroughTheWatchdog) {
  ASSERT_EQ(world().size(), 2) << "run under mpirun -np 2";
  const int R = world().rank();
  const Groups groups(Group::kTensor);
  const TrainerConfig c = testing::tiny(ModelKind::kGpt2, DType::kF32, 1, 1.0);
  OffloadSettings s;
  s.params = Tier::kDevice;
  s.optimizer = Tier::kHost;
  s.persistence_threshold = 0;
  auto device = testing::make_device();
  auto engine = make_engine(c, s, *device, groups, nullptr);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  OffloadEngine& e = **engine;
  Snapshot got;
  ASSERT_TRUE(testing::run_steps(e, c, 0, 1, got));
  ASSERT_TRUE(e.synchronize().ok());
  if (R == 1) std::raise(SIGKILL);
  std::vector<std::int32_t> in, tg;
  testing::batch(c, 1, in, tg);
  const Status st = e.step(in, tg).status();
  ASSERT_FALSE(st.ok()) << "rank " << R;
  EXPECT_NE(st.message().find("comm timeout"), std::string::npos) << st.to_string();
  EXPECT_EQ(e.steps_done(), 1) << "rank " << R;
  std::printf("rank %d: step 2 failed: %s\n", R, st.to_string().c_str());
  std::fflush(stdout);
}

}  // namespace
}  // namespace strata
