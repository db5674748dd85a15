// The optimizer in device memory with data x tensor parallelism: stage 0's bucketed all-reduce,
// stage 2's gradient buckets (reduce-scatter per bucket during backward) and stage 3's parameter
// slices (all-gathered ahead of use) on each tensor rank's shard (docs/parallel.md "Gradient
// buckets", "Stage 3 in device memory"), on real processes: run by tests/mpi_run.sh under
// `mpirun -np 4` (tp 2 x dp 2, make_process_groups; each data-parallel rank trains global
// micro-batches d, d + DP, ... of each step, both tp ranks of it the same ones).
//
// What is compared, and how exactly (3 steps, losses, norms, and every parameter's working copy,
// master and moments gathered full over tp and dp):
// - Stage 2 with one micro-batch per data-parallel rank against stage 1 on the same ranks: bit
//   for bit. Each unit of the tp shard goes through the same reduce-scatter call as in stage 1's
//   update (same count, same size x chunk layout, same local values), and the scan, the merges
//   (dp, then tp) and the update are the same code on the same slices.
// - Stage 2 with accumulation 2 against the host optimizer's stage 2 on the same ranks: bit for
//   bit (both reduce every micro-batch and add the reduced slices in micro-batch order; stage 1
//   reduces the local sum instead, other bits). overlap_comm off and on: bit for bit.
// - Stage 3 against stage 2 on the same ranks: bit for bit (a fetch gathers the bits stage 2's
//   after-update all-gather lays into its whole copy).
// - Stage 0 with several buckets and overlap against one bucket: bit for bit (2 data-parallel
//   ranks: a sum of two values is the same whatever the algorithm).
// - fp32 against one process on the whole global batch: dist_compare.hpp's Tolerance (the fp32
//   tensor-parallel bounds; rank 0 prints the measured figures).
// - The engine's plan is OffloadPlan::make's for the same tp and dp sizes (what `strata train
//   --plan` prints under mpirun), and its device regions shrink to 1/dp of the tp shard's.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "comm_environment.hpp"
#include "dist_compare.hpp"
#include "dist_device_plans.hpp"
#include "offload/internal.hpp"
#include "offload_fixture.hpp"
#include "strata/parallel.hpp"

namespace strata {
namespace {

using testing::capture_held;
using testing::capture_stage;
using testing::expect_close;
using testing::plan_bytes;
using testing::smallest_unit;
using testing::run_share;
using testing::Snapshot;
using testing::Tolerance;
using testing::world;

constexpr int kTp = 2;
constexpr int kSteps = 3;
// Each transformer block of the tiny model's tp shard is about 25k elements: with this
// reduce_bucket_size every block is a bucket of its own (a unit is never split).
constexpr std::int64_t kSmallBucket = 20'000;

ProcessGroups groups() {
  auto g = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, kTp, 1);
  EXPECT_TRUE(g.ok()) << g.status().to_string();
  return std::move(g).value();
}

std::string name_of(ModelKind kind, DType dtype, std::int64_t micro) {
  return std::string(to_string(kind)) + " " + std::string(to_string(dtype)) +
         ", tp 2 x dp 2, m=" + std::to_string(micro);
}

// Trains kSteps of `global` (grad_accum = micro x DP) with `s` on the grid; the state of every
// parameter gathered full, the loss and norm bits checked equal on every rank.
Snapshot train_grid(ProcessGroups& g, const TrainerConfig& global, std::int64_t micro,
                    const OffloadSettings& s, const std::string& what) {
  Snapshot out;
  const int DP = g.grid.dp();
  TrainerConfig local = global;
  local.grad_accum = micro;
  auto device = testing::make_device();
  auto engine = OffloadEngine::create(local, s, *device, nullptr, g.dp.get(), g.tp.get());
  EXPECT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
  if (!engine.ok()) return out;
  // The device optimizer's stages 2-3 take the bucketed path (and stage 3 slices the shard's
  // parameters), not stage 1's reduction in the update: a bitwise match with stage 1 says
  // something only then.
  const OffloadPlan& plan = (*engine)->plan();
  if (s.optimizer == Tier::kDevice && s.zero_stage >= 2) {
    EXPECT_GT(plan_bytes(plan, "device region offload.grad_buckets"), 0u) << what << ": gradient buckets";
  }
  if (s.optimizer == Tier::kDevice && s.zero_stage == 3) {
    EXPECT_GT(plan_bytes(plan, "device region offload.param_slots"), 0u) << what << ": parameter slices";
  }
  if (!run_share(**engine, global, g.coord.dp, DP, kSteps, out)) return out;
  out.scales.assign(out.losses.size(), 1.0);  // fp32 and bf16: scale 1, never skipped
  out.skipped.assign(out.losses.size(), 0);
  std::vector<int> held;
  EXPECT_TRUE(capture_stage(**engine, out, held)) << what;
  std::vector<double> mine = out.losses;
  mine.insert(mine.end(), out.norms.begin(), out.norms.end());
  std::vector<double> every(mine.size() * static_cast<std::size_t>(world().size()));
  EXPECT_TRUE(world().all_gather(mine.data(), every.data(), 2 * mine.size(), DType::kF32).wait().ok());
  for (std::size_t r = 0; r < static_cast<std::size_t>(world().size()); ++r) {
    for (std::size_t i = 0; i < mine.size(); ++i)
      EXPECT_EQ(every[r * mine.size() + i], mine[i]) << what << ": loss/norm " << i << " of rank " << r;
  }
  return out;
}

// The single-process reference on the whole global batch (every parameter).
Snapshot one_process(const TrainerConfig& global, OffloadSettings s) {
  s.zero_stage = 0;
  s.reduce_bucket_elements = OffloadSettings{}.reduce_bucket_elements;
  s.overlap_comm = false;
  Snapshot ref;
  auto device = testing::make_device();
  auto engine = OffloadEngine::create(global, s, *device);
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  if (!engine.ok()) return ref;
  EXPECT_TRUE(testing::run_steps(**engine, global, 0, kSteps, ref));
  std::vector<int> all;
  const ModelLayout& L = (*engine)->model().layout();
  for (std::size_t i = 0; i < L.params.size(); ++i)
    if (L.params[i].owns_storage()) all.push_back(static_cast<int>(i));
  EXPECT_TRUE(capture_held(**engine, all, ref));
  return ref;
}

// This rank's tp shard's units and buckets for `s` (the data-parallel group's, whose ranks all
// have this tp rank).
offload_detail::Units shard_units(const TrainerConfig& c, OffloadSettings s, int tp_rank) {
  s.dp_size = world().size() / kTp;
  s.tp_size = kTp;
  auto layout = describe_model(c.model, TensorParallel{kTp, tp_rank});
  EXPECT_TRUE(layout.ok());
  return offload_detail::describe_units(*layout, s);
}

OffloadSettings device_settings(int stage) {
  OffloadSettings s;
  s.optimizer = Tier::kDevice;
  s.params = Tier::kDevice;
  s.zero_stage = stage;
  return s;
}

// Stage 2 with one micro-batch per data-parallel rank is bitwise stage 1 on the same ranks, with
// one bucket and with one per block (overlap_comm on): GPT-2 (the tied embedding's shard, whose
// bucket stays open through backward) fp32 and bf16, LLaMA (grouped kv heads) bf16; clipping 1.
TEST(DeviceTensorParallel, Stage2BucketsBitwiseStage1) {
  ASSERT_EQ(world().size(), 4);
  ProcessGroups g = groups();
  const int DP = g.grid.dp();
  struct C {
    ModelKind kind;
    DType dtype;
  };
  for (const C& c : {C{ModelKind::kGpt2, DType::kF32}, C{ModelKind::kGpt2, DType::kBF16},
                     C{ModelKind::kLlama, DType::kBF16}}) {
    const std::string what = name_of(c.kind, c.dtype, 1) + ", clip 1";
    const TrainerConfig global = testing::tiny(c.kind, c.dtype, DP, 1.0);
    OffloadSettings s = device_settings(1);
    const Snapshot stage1 = train_grid(g, global, 1, s, what + ", stage 1");
    s.zero_stage = 2;
    EXPECT_EQ(offload_detail::grad_buckets(shard_units(global, s, g.coord.tp), s).units.size(), 1u)
        << "the default bucket holds the whole shard's gradient";
    const Snapshot one_bucket = train_grid(g, global, 1, s, what + ", stage 2, one bucket");
    s.reduce_bucket_elements = kSmallBucket;
    s.overlap_comm = true;
    EXPECT_GE(offload_detail::grad_buckets(shard_units(global, s, g.coord.tp), s).units.size(), 4u) << what;
    const Snapshot buckets = train_grid(g, global, 1, s, what + ", stage 2, buckets");
    testing::expect_same(stage1, one_bucket, what + ": stage 1 vs stage 2 (one bucket)");
    testing::expect_same(stage1, buckets, what + ": stage 1 vs stage 2 (buckets, overlap)");
  }
}

// Stage 2 with accumulation 2 reduces every micro-batch: bitwise the host optimizer's stage 2 on
// the same ranks, overlap_comm off and on; fp32 also within the tolerances of one process.
TEST(DeviceTensorParallel, Stage2AccumulationBitwiseHostStage2) {
  ASSERT_EQ(world().size(), 4);
  ProcessGroups g = groups();
  const int DP = g.grid.dp();
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const std::string what = name_of(ModelKind::kGpt2, dtype, 2) + ", clip 1";
    const TrainerConfig global = testing::tiny(ModelKind::kGpt2, dtype, 2 * DP, 1.0);
    OffloadSettings s;
    s.zero_stage = 2;
    s.persistence_threshold = 0;
    s.optimizer = Tier::kHost;
    s.update_during_backward = false;
    const Snapshot host = train_grid(g, global, 2, s, what + ", host stage 2");
    s.optimizer = Tier::kDevice;
    s.reduce_bucket_elements = kSmallBucket;
    s.overlap_comm = false;
    const Snapshot serial = train_grid(g, global, 2, s, what + ", device stage 2");
    s.overlap_comm = true;
    const Snapshot dev = train_grid(g, global, 2, s, what + ", device stage 2, overlap");
    testing::expect_same(host, dev, what + ": host stage 2 vs device stage 2");
    testing::expect_same(serial, dev, what + ": device stage 2, overlap_comm off vs on");
    if (dtype == DType::kF32)
      expect_close(one_process(global, s), dev, Tolerance{}, what + " against one process");
  }
}

// Stage 3 slices each tp shard's modules over the data-parallel ranks: bitwise stage 2 on the same
// ranks. GPT-2 fp32 with accumulation 2, clipping, small buckets with overlap and one persistent
// module (the head reads the sliced embedding shard); LLaMA bf16. GPT-2 fp32 also within the
// tolerances of one process.
TEST(DeviceTensorParallel, Stage3SlicesBitwiseStage2) {
  ASSERT_EQ(world().size(), 4);
  ProcessGroups g = groups();
  const int DP = g.grid.dp();
  struct C {
    ModelKind kind;
    DType dtype;
    std::int64_t micro;
    bool small_buckets;
  };
  for (const C& c :
       {C{ModelKind::kGpt2, DType::kF32, 2, true}, C{ModelKind::kLlama, DType::kBF16, 1, false}}) {
    const std::string what = name_of(c.kind, c.dtype, c.micro) + ", clip 1";
    const TrainerConfig global = testing::tiny(c.kind, c.dtype, c.micro * DP, 1.0);
    OffloadSettings s = device_settings(2);
    s.persistence_threshold = smallest_unit(global, kTp);
    if (c.small_buckets) {
      s.reduce_bucket_elements = kSmallBucket;
      s.overlap_comm = true;
    }
    const Snapshot stage2 = train_grid(g, global, c.micro, s, what + ", stage 2");
    s.zero_stage = 3;
    const offload_detail::Units u = shard_units(global, s, g.coord.tp);
    const auto sliced = std::count(u.sliced.begin(), u.sliced.end(), 1);
    EXPECT_GE(sliced, 4) << what;
    EXPECT_LT(sliced, std::count_if(u.gbytes.begin(), u.gbytes.end(), [](std::uint64_t b) { return b > 0; }))
        << what << ": the smallest module stays whole";
    const Snapshot stage3 = train_grid(g, global, c.micro, s, what + ", stage 3");
    testing::expect_same(stage2, stage3, what + ": stage 2 vs stage 3 in device memory");
    if (c.dtype == DType::kF32)
      expect_close(one_process(global, s), stage3, Tolerance{}, what + " against one process");
  }
}

// Stage 0's all-reduce bucketed into backward with tensor parallelism: several buckets with
// overlap give the bits of one bucket (2 data-parallel ranks), within the tolerances of one
// process.
TEST(DeviceTensorParallel, Stage0BucketsBitwiseOneBucket) {
  ASSERT_EQ(world().size(), 4);
  ProcessGroups g = groups();
  const int DP = g.grid.dp();
  const std::string what = name_of(ModelKind::kGpt2, DType::kF32, 2) + ", stage 0, clip 1";
  const TrainerConfig global = testing::tiny(ModelKind::kGpt2, DType::kF32, 2 * DP, 1.0);
  OffloadSettings s = device_settings(0);
  const Snapshot whole = train_grid(g, global, 2, s, what + ", one bucket");
  s.reduce_bucket_elements = kSmallBucket;
  s.overlap_comm = true;
  EXPECT_GE(offload_detail::grad_buckets(shard_units(global, s, g.coord.tp), s).units.size(), 4u) << what;
  const Snapshot buckets = train_grid(g, global, 2, s, what + ", buckets");
  testing::expect_same(whole, buckets, what + ": one bucket vs several");
  expect_close(one_process(global, s), buckets, Tolerance{}, what + " against one process");
}

// The plan of a rank: OffloadPlan::make with the tp and dp sizes (strata train --plan under
// mpirun) is the engine's, line for line. Against stage 1 on the same shard: stage 2's
// offload.grads is 1/DP of the shard's gradients (within each unit's rounding to 64 elements)
// plus the bucket buffers; stage 3's offload.params is stage 2's less (DP - 1)/DP of the sliced
// units' bytes, plus the param slots. The arena's live bytes follow the plan.
TEST(DeviceTensorParallel, PlanShrinksToOneOverDp) {
  ASSERT_EQ(world().size(), 4);
  ProcessGroups g = groups();
  const int DP = g.grid.dp();
  TrainerConfig local = testing::tiny(ModelKind::kGpt2, DType::kBF16, 1, 0.0);
  local.model.n_layer = 12;
  OffloadSettings s = device_settings(1);
  s.reduce_bucket_elements = kSmallBucket;
  s.persistence_threshold = smallest_unit(local, kTp);
  const testing::DeviceStagePlans p = testing::record_device_stage_plans(
      local, s, DP,
      [&](const OffloadSettings& t) {
        OffloadSettings ps = t;
        ps.dp_size = DP;
        ps.tp_size = kTp;
        return ps;
      },
      [&](const OffloadSettings& t, Device& device) {
        return OffloadEngine::create(local, t, device, nullptr, g.dp.get(), g.tp.get());
      });
  OffloadSettings s1 = s;
  s1.zero_stage = 1;
  OffloadSettings s3 = s;
  s3.zero_stage = 3;
  // 12 layers: the slices and the buckets together below the shard's whole gradient.
  testing::expect_device_stages_shrink(p, shard_units(local, s1, g.coord.tp), shard_units(local, s3, g.coord.tp), DP,
                                       "tensor rank " + std::to_string(g.coord.tp));
}

// Stage 3 on tp 2 x dp 2, the state read back through the slices and the shards: a checkpoint
// (collective: each unit's slices gathered over dp, the shards over tp, the first rank writes)
// resumes in a fresh engine bit for bit against the uninterrupted run and loads into one process
// with the grid's state bit for bit; loss() and evaluate() (collective fetches) give stage 2's
// values on the same ranks.
TEST(DeviceTensorParallel, Stage3CheckpointLossAndEvaluate) {
  ASSERT_EQ(world().size(), 4);
  ProcessGroups g = groups();
  const int DP = g.grid.dp();
  const std::string what = name_of(ModelKind::kLlama, DType::kBF16, 2) + ", stage 3";
  const TrainerConfig global = testing::tiny(ModelKind::kLlama, DType::kBF16, 2 * DP, 1.0);
  TrainerConfig local = global;
  local.grad_accum = 2;
  auto create = [&](std::unique_ptr<Device>& device, int stage) {
    device = testing::make_device();
    OffloadSettings s = device_settings(stage);
    s.reduce_bucket_elements = kSmallBucket;
    s.overlap_comm = true;
    return OffloadEngine::create(local, s, *device, nullptr, g.dp.get(), g.tp.get());
  };
  testing::expect_stage3_reads_back_as_stage2(global, g.coord.dp, DP, create, device_settings(0),
                                              "device-tp-state", what);
}

}  // namespace
}  // namespace strata
