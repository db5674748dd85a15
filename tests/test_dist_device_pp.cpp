// The optimizer in device memory with data x pipeline parallelism: stage 2's gradient buckets
// (reduce-scattered per bucket during each backward op of the schedule, every micro-batch) and
// stage 3's parameter slices (all-gathered ahead of use within the stage) on each stage's units
// (docs/parallel.md "Stages 2-3 in device memory with a pipeline"), on real processes: run by
// tests/mpi_run.sh under `mpirun -np 4` (pp 2 x dp 2, make_process_groups; each pipeline trains
// global micro-batches d, d + DP, ... of each step).
//
// What is compared, and how exactly (3 steps; losses, norms, and every parameter the stage holds:
// working copy, master and moments gathered over dp; loss and norm the same bits on every rank):
// - Stage 2 with accumulation 2 against the host optimizer's stage 2 on the same grid: bit for
//   bit. Both reduce every micro-batch's gradients unit by unit (the same reduce-scatter call:
//   the unit padded to size x chunk, the same count), add the reduced slices in micro-batch order
//   (each unit's backwards run in micro-batch order on its stage), sum the tied embedding's slices
//   between the two ends after the last micro-batch, and scan, merge (dp, then stages) and update
//   with the same code. overlap_comm off and on: bit for bit (the same collectives).
// - Stage 2 with accumulation 2 against stage 1 on the same grid (the path that trained before):
//   not bit for bit, because stage 1 reduces each rank's local sum (a0 + a1) + (b0 + b1) while
//   stage 2 adds the reductions (a0 + b0) + (a1 + b1): fp32 within dist_compare.hpp's Tolerance,
//   bf16 within bf16_tolerance() below (rank 0 prints the measured figures; measured here: fp32
//   parameters max 1.9e-5, bf16 parameters rms 2.0e-4 and max 0.016, loss 2.8e-5). With one
//   micro-batch per pipeline the two orders are one: bit for bit.
// - Interleaved 1F1B (v = 2) and GPipe: stage 2 bit for bit the host tier's stage 2 on the same
//   grid; each bucket of an interleaved stage holds one chunk's units.
// - Stage 0 (the stage's buckets all-reduced in place on the last micro-batch): small buckets
//   bit for bit the default ones, both within the tolerances of one process.
// - Stage 3 against stage 2 on the same grid: bit for bit (a fetch gathers the bits stage 2's
//   after-update all-gather lays into its whole copy); loss() and evaluate() equal; a checkpoint
//   resumes bit for bit and loads into one process with the grid's state.
// - fp32 against one process on the whole global batch: dist_compare.hpp's Tolerance.
// - The plan of a stage's rank (OffloadPlan::make with dp_size, the pipeline bounds and the stage,
//   as `strata train --plan` makes it under mpirun) is the engine's line for line; stage 2's
//   device gradients are 1/DP of the stage's plus the buckets, stage 3's parameters 1/DP of the
//   sliced modules' plus the slots, and the arena's live bytes follow the plan.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
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
using testing::device_optimizer_settings;
using testing::plan_bytes;
using testing::smallest_unit;
using testing::expect_close;
using testing::run_share;
using testing::Snapshot;
using testing::Tolerance;
using testing::world;

constexpr int kPp = 2;
constexpr int kSteps = 3;
// A transformer block of the tiny model is about 50k elements: with this reduce_bucket_size every
// block is a bucket of its own (a unit is never split), so a stage has several buckets.
constexpr std::int64_t kSmallBucket = 20'000;

// bf16 working weights round the master to 8 bits: where stage 1 and stage 2 sum in another
// order, a master that differs by rounding rounds to a neighbouring bf16 value now and then. The
// data-parallel bf16 bounds (test_dist_data_parallel.cpp, measured there against one process:
// loss 2e-5 relative, norm 7e-4, parameters rms 3.5e-4 and max 0.035).
Tolerance bf16_tolerance() {
  Tolerance t;
  t.loss = 2e-4;
  t.norm = 5e-3;
  t.rms = 3e-3;
  t.max = 0.1;
  return t;
}

ProcessGroups groups() {
  auto g = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, 1, kPp);
  EXPECT_TRUE(g.ok()) << g.status().to_string();
  return std::move(g).value();
}

std::string name_of(ModelKind kind, DType dtype, std::int64_t micro, int chunks = 1) {
  return std::string(to_string(kind)) + " " + std::string(to_string(dtype)) + ", pp 2 x dp 2" +
         (chunks > 1 ? " (v=" + std::to_string(chunks) + ")" : std::string()) +
         ", m=" + std::to_string(micro);
}

OffloadSettings host_settings(int stage) {
  OffloadSettings s;
  s.optimizer = Tier::kHost;
  s.params = Tier::kDevice;
  s.zero_stage = stage;
  s.persistence_threshold = 0;
  s.update_during_backward = false;
  return s;
}

// The settings a stage's rank plans with (strata train under mpirun): the pipeline's bounds,
// this stage, the data-parallel size.
OffloadSettings stage_settings(const TrainerConfig& c, OffloadSettings s, const ProcessGroups& g) {
  auto bounds = pipeline_stages(c.model, kPp * s.pipeline_virtual_stages, c.seq_len);
  EXPECT_TRUE(bounds.ok()) << bounds.status().to_string();
  s.pipeline_bounds = *bounds;
  s.pp_stage = g.coord.pp;
  s.dp_size = g.grid.dp();
  return s;
}

// This stage's units and buckets (the data-parallel group's: its ranks are the same stage).
offload_detail::GradBuckets stage_buckets(const TrainerConfig& c, const OffloadSettings& s,
                                          const ProcessGroups& g) {
  const OffloadSettings ss = stage_settings(c, s, g);
  auto layout = describe_model(c.model);
  EXPECT_TRUE(layout.ok());
  return offload_detail::grad_buckets(offload_detail::describe_units(*layout, ss), ss);
}

// Trains kSteps of `global` (grad_accum = micro x DP) with `s` on the grid; every parameter the
// stage holds gathered full (`held`), the loss and norm bits checked equal on every rank.
Snapshot train_grid(ProcessGroups& g, const TrainerConfig& global, std::int64_t micro,
                    const OffloadSettings& s, const std::string& what, std::vector<int>* held_out = nullptr) {
  Snapshot out;
  const int DP = g.grid.dp();
  TrainerConfig local = global;
  local.grad_accum = micro;
  auto device = testing::make_device();
  auto engine = OffloadEngine::create(local, s, *device, nullptr, g.dp.get(), nullptr, g.pp.get());
  EXPECT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
  if (!engine.ok()) return out;
  // The device optimizer's stages 2-3 take the bucketed path (and stage 3 slices the stage's
  // parameters), not stage 1's reduction in the update: a comparison says something only then.
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
  if (held_out != nullptr) *held_out = held;
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

// The single-process reference on the whole global batch: the state of `held`.
Snapshot one_process(const TrainerConfig& global, OffloadSettings s, const std::vector<int>& held) {
  s.zero_stage = 0;
  s.reduce_bucket_elements = OffloadSettings{}.reduce_bucket_elements;
  s.overlap_comm = false;
  s.pipeline_virtual_stages = 1;
  s.pipeline_schedule = PipelineSchedule::kOneFOneB;
  Snapshot ref;
  auto device = testing::make_device();
  auto engine = OffloadEngine::create(global, s, *device);
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  if (!engine.ok()) return ref;
  EXPECT_TRUE(testing::run_steps(**engine, global, 0, kSteps, ref));
  EXPECT_TRUE(capture_held(**engine, held, ref));
  return ref;
}

// Stage 2 with accumulation 2 (1F1B, clipping 1, one bucket per block, overlap_comm off and on):
// bit for bit the host optimizer's stage 2 on the same grid; against stage 1 on the same grid
// within the fp32 / bf16 bounds (another summation order); fp32 also against one process.
TEST(DevicePipeline, Stage2BucketsEqualHostStage2) {
  ASSERT_EQ(world().size(), 4);
  ProcessGroups g = groups();
  const int DP = g.grid.dp();
  ASSERT_EQ(DP, 2);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const std::string what = name_of(ModelKind::kGpt2, dtype, 2) + ", clip 1";
    const TrainerConfig global = testing::tiny(ModelKind::kGpt2, dtype, 2 * DP, 1.0);
    const Snapshot host = train_grid(g, global, 2, host_settings(2), what + ", host stage 2");
    const Snapshot stage1 = train_grid(g, global, 2, device_optimizer_settings(1), what + ", device stage 1");
    OffloadSettings s = device_optimizer_settings(2);
    s.reduce_bucket_elements = kSmallBucket;
    EXPECT_GE(stage_buckets(global, s, g).units.size(), 2u) << what << ": several buckets on the stage";
    const Snapshot serial = train_grid(g, global, 2, s, what + ", device stage 2");
    s.overlap_comm = true;
    std::vector<int> held;
    const Snapshot dev = train_grid(g, global, 2, s, what + ", device stage 2, overlap", &held);
    testing::expect_same(host, serial, what + ": host stage 2 vs device stage 2");
    testing::expect_same(serial, dev, what + ": device stage 2, overlap_comm off vs on");
    expect_close(stage1, dev, dtype == DType::kF32 ? Tolerance{} : bf16_tolerance(),
                 what + ": device stage 2 against device stage 1");
    if (dtype == DType::kF32)
      expect_close(one_process(global, s, held), dev, Tolerance{}, what + " against one process");
  }
}

// One micro-batch per pipeline: stage 1's local sum is the one micro-batch, so stage 2 reduces
// the same values with the same call: bit for bit stage 1 (GPT-2 fp32 with buckets and overlap,
// LLaMA bf16 with one bucket).
TEST(DevicePipeline, Stage2OneMicroBatchBitwiseStage1) {
  ASSERT_EQ(world().size(), 4);
  ProcessGroups g = groups();
  const int DP = g.grid.dp();
  struct C {
    ModelKind kind;
    DType dtype;
    bool small_buckets;
  };
  for (const C& c : {C{ModelKind::kGpt2, DType::kF32, true}, C{ModelKind::kLlama, DType::kBF16, false}}) {
    const std::string what = name_of(c.kind, c.dtype, 1) + ", clip 1";
    const TrainerConfig global = testing::tiny(c.kind, c.dtype, DP, 1.0);
    const Snapshot stage1 = train_grid(g, global, 1, device_optimizer_settings(1), what + ", stage 1");
    OffloadSettings s = device_optimizer_settings(2);
    if (c.small_buckets) {
      s.reduce_bucket_elements = kSmallBucket;
      s.overlap_comm = true;
    }
    const Snapshot stage2 = train_grid(g, global, 1, s, what + ", stage 2");
    testing::expect_same(stage1, stage2, what + ": stage 1 vs stage 2");
  }
}

// Interleaved 1F1B (v = 2: the tiny model's 5 modules in 4 chunks) and GPipe: stage 2 bit for
// bit the host tier's stage 2 on the same grid. An interleaved stage's buckets each hold one
// chunk's units (a chunk's backward op opens and closes them).
TEST(DevicePipeline, Stage2InterleavedAndGpipeEqualHostStage2) {
  ASSERT_EQ(world().size(), 4);
  ProcessGroups g = groups();
  const int DP = g.grid.dp();
  struct C {
    ModelKind kind;
    DType dtype;
    int chunks;
    PipelineSchedule schedule;
  };
  for (const C& c : {C{ModelKind::kGpt2, DType::kF32, 2, PipelineSchedule::kOneFOneB},
                     C{ModelKind::kLlama, DType::kBF16, 1, PipelineSchedule::kGpipe}}) {
    const std::string what =
        name_of(c.kind, c.dtype, 2, c.chunks) + " " + std::string(to_string(c.schedule)) + ", clip 1";
    const TrainerConfig global = testing::tiny(c.kind, c.dtype, 2 * DP, 1.0);
    OffloadSettings h = host_settings(2);
    h.pipeline_virtual_stages = c.chunks;
    h.pipeline_schedule = c.schedule;
    const Snapshot host = train_grid(g, global, 2, h, what + ", host stage 2");
    OffloadSettings s = device_optimizer_settings(2);
    s.pipeline_virtual_stages = c.chunks;
    s.pipeline_schedule = c.schedule;
    s.reduce_bucket_elements = kSmallBucket;
    s.overlap_comm = true;
    if (c.chunks > 1) {
      const OffloadSettings ss = stage_settings(global, s, g);
      const auto ranges = offload_detail::stage_ranges(ss.pipeline_bounds, c.chunks, g.coord.pp);
      const offload_detail::GradBuckets b = stage_buckets(global, s, g);
      auto chunk_of = [&](int u) {
        // The chunk whose modules read unit u (its own module, or GPT-2's head for the embedding).
        for (std::size_t k = 0; k < ranges.size(); ++k) {
          if (u >= ranges[k].first && u < ranges[k].second) return static_cast<int>(k);
        }
        return static_cast<int>(ranges.size()) - 1;
      };
      std::vector<int> chunks_with_buckets;
      for (const std::vector<int>& units : b.units) {
        ASSERT_FALSE(units.empty());
        for (int u : units)
          EXPECT_EQ(chunk_of(u), chunk_of(units.front())) << what << ": a bucket spans chunks";
        chunks_with_buckets.push_back(chunk_of(units.front()));
      }
      std::sort(chunks_with_buckets.begin(), chunks_with_buckets.end());
      chunks_with_buckets.erase(std::unique(chunks_with_buckets.begin(), chunks_with_buckets.end()),
                                chunks_with_buckets.end());
      EXPECT_EQ(chunks_with_buckets.size(), ranges.size()) << what << ": every chunk has buckets";
    }
    const Snapshot dev = train_grid(g, global, 2, s, what + ", device stage 2");
    testing::expect_same(host, dev, what + ": host stage 2 vs device stage 2");
  }
}

// Stage 0 takes the stage's buckets too: each bucket's range of the (whole) gradients all-reduced
// in place as the last micro-batch's backward op leaves it; every bucket one contiguous range of
// the stage's layout. Small buckets with overlap_comm give the bits of the default ones (2
// data-parallel ranks: a sum of two values is the same whatever the grouping), and both are
// within the tolerances of one process (a bucket left out or reduced twice is not); 1F1B and
// interleaved (v = 2), GPT-2 fp32 with accumulation 2.
TEST(DevicePipeline, Stage0BucketsWithAPipeline) {
  ASSERT_EQ(world().size(), 4);
  ProcessGroups g = groups();
  const int DP = g.grid.dp();
  for (int chunks : {1, 2}) {
    const std::string what = name_of(ModelKind::kGpt2, DType::kF32, 2, chunks) + ", stage 0, clip 1";
    const TrainerConfig global = testing::tiny(ModelKind::kGpt2, DType::kF32, 2 * DP, 1.0);
    OffloadSettings s = device_optimizer_settings(0);
    s.pipeline_virtual_stages = chunks;
    // Each bucket is one contiguous range of the stage's fp32 layout (the in-place all-reduce's):
    // its units in descending order with no unit of the stage between them.
    auto expect_contiguous = [&](const offload_detail::GradBuckets& b) {
      auto layout = describe_model(global.model);
      ASSERT_TRUE(layout.ok());
      const offload_detail::Units u = offload_detail::describe_units(*layout, stage_settings(global, s, g));
      for (const std::vector<int>& us : b.units) {
        for (std::size_t k = 0; k + 1 < us.size(); ++k) {
          ASSERT_GT(us[k], us[k + 1]) << what;
          for (int y = us[k + 1] + 1; y < us[k]; ++y)
            EXPECT_EQ(u.gbytes[static_cast<std::size_t>(y)], 0u)
                << what << ": unit " << y << " inside a bucket";
        }
      }
    };
    const offload_detail::GradBuckets whole = stage_buckets(global, s, g);
    expect_contiguous(whole);
    const Snapshot one = train_grid(g, global, 2, s, what + ", default bucket size");
    s.reduce_bucket_elements = kSmallBucket;
    s.overlap_comm = true;
    const offload_detail::GradBuckets small = stage_buckets(global, s, g);
    expect_contiguous(small);
    // More buckets than the default on some stage (a stage whose every block is a bucket of its
    // own already has no more).
    EXPECT_GE(small.units.size(), whole.units.size()) << what;
    float more = small.units.size() > whole.units.size() ? 1.0f : 0.0f;
    std::vector<float> every(static_cast<std::size_t>(world().size()));
    ASSERT_TRUE(world().all_gather(&more, every.data(), 1, DType::kF32).wait().ok());
    EXPECT_GT(*std::max_element(every.begin(), every.end()), 0.0f) << what << ": small buckets split a stage";
    std::vector<int> held;
    const Snapshot several = train_grid(g, global, 2, s, what + ", buckets", &held);
    testing::expect_same(one, several, what + ": default buckets vs small ones");
    expect_close(one_process(global, s, held), several, Tolerance{}, what + " against one process");
  }
}

// Stage 3 slices each stage's modules over its data-parallel ranks: bit for bit stage 2 on the
// same grid. GPT-2 fp32 with accumulation 2, clipping, small buckets with overlap and one
// persistent module (the last stage's head reads the sliced embedding copy); LLaMA bf16; GPT-2
// bf16 interleaved. GPT-2 fp32 also within the tolerances of one process.
TEST(DevicePipeline, Stage3SlicesBitwiseStage2) {
  ASSERT_EQ(world().size(), 4);
  ProcessGroups g = groups();
  const int DP = g.grid.dp();
  struct C {
    ModelKind kind;
    DType dtype;
    int chunks;
    bool small_buckets;
  };
  for (const C& c : {C{ModelKind::kGpt2, DType::kF32, 1, true}, C{ModelKind::kLlama, DType::kBF16, 1, false},
                     C{ModelKind::kGpt2, DType::kBF16, 2, true}}) {
    const std::string what = name_of(c.kind, c.dtype, 2, c.chunks) + ", clip 1";
    const TrainerConfig global = testing::tiny(c.kind, c.dtype, 2 * DP, 1.0);
    OffloadSettings s = device_optimizer_settings(2);
    s.pipeline_virtual_stages = c.chunks;
    s.persistence_threshold = smallest_unit(global);
    if (c.small_buckets) {
      s.reduce_bucket_elements = kSmallBucket;
      s.overlap_comm = true;
    }
    const Snapshot stage2 = train_grid(g, global, 2, s, what + ", stage 2");
    s.zero_stage = 3;
    {
      const OffloadSettings ss = stage_settings(global, s, g);
      auto layout = describe_model(global.model);
      ASSERT_TRUE(layout.ok());
      const offload_detail::Units u = offload_detail::describe_units(*layout, ss);
      EXPECT_GE(std::count(u.sliced.begin(), u.sliced.end(), 1), 2) << what << ": the stage's sliced modules";
    }
    std::vector<int> held;
    const Snapshot stage3 = train_grid(g, global, 2, s, what + ", stage 3", &held);
    testing::expect_same(stage2, stage3, what + ": stage 2 vs stage 3 in device memory");
    if (c.dtype == DType::kF32)
      expect_close(one_process(global, s, held), stage3, Tolerance{}, what + " against one process");
  }
}

// Stage 3 on pp 2 x dp 2, the state read back through the slices: loss() and evaluate() (the
// stage's fetches, collective over dp) give stage 2's values; a checkpoint (each stage's units
// gathered over dp and written by the stage's first rank) resumes in a fresh grid bit for bit
// against the uninterrupted run and loads into one process with the grid's state bit for bit.
TEST(DevicePipeline, Stage3CheckpointLossAndEvaluate) {
  ASSERT_EQ(world().size(), 4);
  ProcessGroups g = groups();
  const int DP = g.grid.dp();
  const std::string what = name_of(ModelKind::kGpt2, DType::kBF16, 2) + ", stage 3";
  const TrainerConfig global = testing::tiny(ModelKind::kGpt2, DType::kBF16, 2 * DP, 1.0);
  TrainerConfig local = global;
  local.grad_accum = 2;
  auto create = [&](std::unique_ptr<Device>& device, int stage) {
    device = testing::make_device();
    OffloadSettings s = device_optimizer_settings(stage);
    s.reduce_bucket_elements = kSmallBucket;
    s.overlap_comm = true;
    return OffloadEngine::create(local, s, *device, nullptr, g.dp.get(), nullptr, g.pp.get());
  };
  testing::expect_stage3_reads_back_as_stage2(global, g.coord.dp, DP, create, device_optimizer_settings(0),
                                              "device-pp-state", what);
}

// The plan of a stage's rank: OffloadPlan::make with the pipeline bounds, the stage and the dp
// size (strata train --plan under mpirun) is the engine's, line for line. Against stage 1 on the
// same stage: stage 2's offload.grads is 1/DP of the stage's gradients (within each unit's
// rounding to 64 elements) plus the bucket buffers, and with 12 layers the two together are
// below the stage's whole gradient; stage 3's offload.params is stage 2's less (DP - 1)/DP of
// the sliced units' bytes, plus the param slots. The arena's live bytes follow the plan.
TEST(DevicePipeline, PlanShrinksToOneOverDp) {
  ASSERT_EQ(world().size(), 4);
  ProcessGroups g = groups();
  const int DP = g.grid.dp();
  TrainerConfig local = testing::tiny(ModelKind::kGpt2, DType::kBF16, 2, 0.0);
  local.model.n_layer = 12;
  OffloadSettings s = device_optimizer_settings(1);
  s.reduce_bucket_elements = kSmallBucket;
  s.persistence_threshold = smallest_unit(local);
  const testing::DeviceStagePlans p = testing::record_device_stage_plans(
      local, s, DP, [&](const OffloadSettings& t) { return stage_settings(local, t, g); },
      [&](const OffloadSettings& t, Device& device) {
        return OffloadEngine::create(local, t, device, nullptr, g.dp.get(), nullptr, g.pp.get());
      });
  OffloadSettings s1 = s;
  s1.zero_stage = 1;
  OffloadSettings s3 = s;
  s3.zero_stage = 3;
  auto layout = describe_model(local.model);
  ASSERT_TRUE(layout.ok());
  const offload_detail::Units u1 = offload_detail::describe_units(*layout, stage_settings(local, s1, g));
  const offload_detail::Units u3 = offload_detail::describe_units(*layout, stage_settings(local, s3, g));
  // Stage 1 holds the stage's whole gradient.
  EXPECT_EQ(p.grads[1], std::max<std::uint64_t>(u1.grad_bytes, kParamAlignment));
  // 12 layers (about 6 per stage): the slices and the buckets together below the stage's whole
  // gradient.
  testing::expect_device_stages_shrink(p, u1, u3, DP, "pipeline stage " + std::to_string(g.coord.pp));
  if (world().rank() < kPp) {
    std::printf(
        "pipeline stage %d, rank of dp 0: device gradients stage 1 %llu bytes, stage 2 %llu + buckets %llu\n",
        g.coord.pp, static_cast<unsigned long long>(p.grads[1]), static_cast<unsigned long long>(p.grads[2]),
        static_cast<unsigned long long>(p.buckets[2]));
  }
}

}  // namespace
}  // namespace strata
