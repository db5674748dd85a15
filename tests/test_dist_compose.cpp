// Gradients on NVMe and the sharded device optimizer composed with tensor and pipeline parallelism
// (docs/parallel.md "NVMe gradients and the device-sharded optimizer with tensor and pipeline
// parallelism"), on real processes: run by tests/mpi_run.sh under `mpirun -np 2|4|8`
// (tests/CMakeLists.txt runs the ComposeNp<N> cases on N ranks). The world is split by
// make_process_groups into tp x pp x dp; each data-parallel rank trains global micro-batches
// d, d + DP, ... of each step.
//
// What is compared, and how exactly:
// - Bit for bit against the same ranks with another placement, the one that trained before this
//   composition was built: gradients on NVMe against gradients on the host (the same additions,
//   reductions, scans and updates; only where the fp32 gradients wait differs), and the optimizer
//   sharded in device memory against the optimizer sharded in host memory (the sharded device
//   update reduces, scans, merges and updates as the host tier does, the tied embedding's slices
//   included; its stages 2 and 3 reduce every micro-batch in their gradient buckets, with or
//   without a pipeline, as the host tier's stage 2 does: the same stage). Losses, norms, and
//   every held parameter's working copy, master and moments.
// - On 8 ranks also the device optimizer's stage 3 against its stage 2 on the same grid, bit for
//   bit (the same placement, another stage: a fetch gathers the bits stage 2's after-update
//   all-gather lays into its whole copy), and stage 3 read back through loss(), evaluate() and a
//   checkpoint (dist_compare.hpp's expect_stage3_reads_back_as_stage2).
// - Every rank reports the same loss and norm bits.
// - Against one process on the whole global batch (fp32): dist_compare.hpp's Tolerance (the fp32
//   tensor-parallel bounds, which the pipeline's tied-gradient order and the data-parallel sum
//   order also stay inside; rank 0 prints each measured figure).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>

#include "comm_environment.hpp"
#include "dist_compare.hpp"
#include "offload_fixture.hpp"
#include "strata/parallel.hpp"

namespace strata {
namespace {

using testing::capture_held;
using testing::capture_stage;
using testing::expect_close;
using testing::run_share;
using testing::Snapshot;
using testing::Tolerance;
using testing::world;

struct Placement {
  Tier optimizer;
  Tier gradients;
};

struct Case {
  int tp, pp;  // DP = world / (tp * pp)
  ModelKind kind;
  DType dtype;
  std::int64_t micro;  // per data-parallel rank
  double clip;
  int zero_stage;
  Tier params;
  Placement tested;
  Placement baseline;  // the same bits on the same ranks
  PipelineSchedule schedule = PipelineSchedule::kOneFOneB;
  // The baseline's ZeRO stage (-1: the tested one). Device stage 3 against device stage 2 on the
  // same grid: the same placement, another stage, the same bits.
  int baseline_zero_stage = -1;
  // reduce_bucket_size in elements, with overlap_comm on (0: the default buckets, overlap off).
  std::int64_t reduce_bucket_elements = 0;
};

std::string name_of(const Case& c, int DP) {
  auto placement = [](const Placement& p) {
    return "optimizer " + std::string(to_string(p.optimizer)) + ", gradients " +
           std::string(to_string(p.gradients));
  };
  return std::string(to_string(c.kind)) + " " + std::string(to_string(c.dtype)) + " tp " +
         std::to_string(c.tp) + " x pp " + std::to_string(c.pp) + " x dp " + std::to_string(DP) + ", zero " +
         std::to_string(c.zero_stage) + ", m=" + std::to_string(c.micro) + ", clip " +
         std::to_string(c.clip) + ", params " + std::string(to_string(c.params)) + ", " + placement(c.tested);
}

OffloadSettings settings_of(const Case& c, const Placement& p, const testing::TempDir& swap) {
  OffloadSettings s;
  s.params = c.params;
  s.optimizer = p.optimizer;
  s.gradients = p.gradients;
  s.zero_stage = c.zero_stage;
  s.persistence_threshold = 0;
  s.pipeline_schedule = c.schedule;
  s.update_during_backward = false;
  s.sub_group_size = 1000;  // several NVMe sub-groups (and gradient shards) per module
  if (c.reduce_bucket_elements > 0) {
    s.reduce_bucket_elements = c.reduce_bucket_elements;
    s.overlap_comm = true;
  }
  if (p.optimizer == Tier::kNvme || c.params == Tier::kNvme) s.nvme_path = {swap.path().string()};
  return s;
}

// Trains `kSteps` steps of the global batch with placement `p` on the grid; `held` lists the
// parameters this rank's stage holds (the state is gathered full over tp and dp).
constexpr int kSteps = 3;

bool train_grid(const Case& c, const Placement& p, ProcessGroups& g, const TrainerConfig& global,
                Snapshot& out, std::vector<int>& held) {
  const int DP = g.grid.dp();
  TrainerConfig local = global;
  local.grad_accum = c.micro;
  testing::TempDir swap("strata-compose-swap");  // this rank's own directory
  // The device optimizer's stages 2-3 reduce every micro-batch in their gradient buckets (with a
  // pipeline inside each backward op of the schedule), as the host tier's stage 2 does: the same
  // stage on both sides (docs/parallel.md "Gradient buckets").
  const OffloadSettings s = settings_of(c, p, swap);
  auto device = testing::make_device();
  auto engine = OffloadEngine::create(local, s, *device, nullptr, DP > 1 ? g.dp.get() : nullptr,
                                      c.tp > 1 ? g.tp.get() : nullptr, c.pp > 1 ? g.pp.get() : nullptr);
  EXPECT_TRUE(engine.ok()) << name_of(c, DP) << ": " << engine.status().to_string();
  if (!engine.ok()) return false;
  // The device optimizer's stage 3 slices the working parameters (the param slots exist only
  // then), stages 2-3 reduce in gradient buckets: a comparison says something only on that path.
  if (DP > 1 && p.optimizer == Tier::kDevice && c.params == Tier::kDevice && c.zero_stage >= 2) {
    std::uint64_t buckets = 0, slots = 0;
    for (const PlanLine& l : (*engine)->plan().lines) {
      if (l.tier != Tier::kDevice) continue;
      if (l.what.rfind("device region offload.grad_buckets", 0) == 0) buckets += l.bytes;
      if (l.what.rfind("device region offload.param_slots", 0) == 0) slots += l.bytes;
    }
    EXPECT_GT(buckets, 0u) << name_of(c, DP) << ": gradient buckets";
    if (c.zero_stage == 3) {
      EXPECT_GT(slots, 0u) << name_of(c, DP) << ": parameter slots";
    } else {
      EXPECT_EQ(slots, 0u) << name_of(c, DP) << ": parameter slots";
    }
  }
  if (!run_share(**engine, global, g.coord.dp, DP, kSteps, out)) return false;
  // run_share records no loss scale or skip flags: fp32 and bf16 scale 1 and never skip.
  out.scales.assign(out.losses.size(), 1.0);
  out.skipped.assign(out.losses.size(), 0);
  held.clear();
  return capture_stage(**engine, out, held);
}

void check(const Case& c) {
  auto groups = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, c.tp, c.pp);
  ASSERT_TRUE(groups.ok()) << groups.status().to_string();
  const int DP = groups->grid.dp();
  const std::string what = name_of(c, DP);
  const TrainerConfig global = testing::tiny(c.kind, c.dtype, c.micro * DP, c.clip);
  Snapshot got, base;
  std::vector<int> held, held_base;
  Case b = c;
  if (c.baseline_zero_stage >= 0) b.zero_stage = c.baseline_zero_stage;
  ASSERT_TRUE(train_grid(c, c.tested, *groups, global, got, held)) << what;
  ASSERT_TRUE(train_grid(b, c.baseline, *groups, global, base, held_base)) << what;
  ASSERT_EQ(held, held_base) << what;
  ASSERT_FALSE(held.empty()) << what;
  testing::expect_same(base, got,
                       what + " against " + std::string(to_string(c.baseline.optimizer)) + " optimizer, " +
                           std::string(to_string(c.baseline.gradients)) + " gradients, zero " +
                           std::to_string(b.zero_stage) + " on the same ranks");
  // The same loss and norm bits on every rank.
  std::vector<double> mine = got.losses;
  mine.insert(mine.end(), got.norms.begin(), got.norms.end());
  std::vector<double> every(mine.size() * static_cast<std::size_t>(world().size()));
  ASSERT_TRUE(world().all_gather(mine.data(), every.data(), 2 * mine.size(), DType::kF32).wait().ok());
  for (std::size_t r = 0; r < static_cast<std::size_t>(world().size()); ++r) {
    for (std::size_t i = 0; i < mine.size(); ++i)
      EXPECT_EQ(every[r * mine.size() + i], mine[i]) << what << ": loss/norm " << i << " of rank " << r;
  }
  if (c.dtype != DType::kF32) return;  // one process: the fp32 cases are the precise check
  Snapshot ref;
  {
    testing::TempDir swap("strata-compose-swap");
    OffloadSettings single = settings_of(c, c.tested, swap);
    single.zero_stage = 0;
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(global, single, *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    ASSERT_TRUE(testing::run_steps(**engine, global, 0, kSteps, ref)) << what;
    ASSERT_TRUE(capture_held(**engine, held, ref)) << what;
  }
  expect_close(ref, got, Tolerance{}, what + " against one process");
}

// A checkpoint of the composed placement (collective: the stages' sharded state gathered over dp
// and tp, then written by the first rank): a fresh engine on the same grid loads it and continues
// the uninterrupted run bit for bit.
void check_checkpoint(const Case& c) {
  auto groups = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, c.tp, c.pp);
  ASSERT_TRUE(groups.ok()) << groups.status().to_string();
  const int DP = groups->grid.dp();
  const std::string what = name_of(c, DP) + ", checkpoint";
  const TrainerConfig global = testing::tiny(c.kind, c.dtype, c.micro * DP, c.clip);
  TrainerConfig local = global;
  local.grad_accum = c.micro;
  const std::string root = testing::shared_temp_dir("compose-state");
  testing::TempDir swap_a("strata-compose-swap"), swap_b("strata-compose-swap");
  auto create = [&](std::unique_ptr<Device>& device, const testing::TempDir& swap) {
    device = testing::make_device();
    return OffloadEngine::create(local, settings_of(c, c.tested, swap), *device, nullptr,
                                 DP > 1 ? groups->dp.get() : nullptr, c.tp > 1 ? groups->tp.get() : nullptr,
                                 c.pp > 1 ? groups->pp.get() : nullptr);
  };
  Snapshot warm, straight, resumed;
  std::vector<int> held, held_again;
  std::string dir;
  {
    std::unique_ptr<Device> device;
    auto engine = create(device, swap_a);
    ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
    ASSERT_TRUE(run_share(**engine, global, groups->coord.dp, DP, 2, warm)) << what;
    auto saved = (*engine)->save_checkpoint(root + "/ck", "{}", 1);
    ASSERT_TRUE(saved.ok()) << what << ": " << saved.status().to_string();
    dir = *saved;
    ASSERT_TRUE(run_share(**engine, global, groups->coord.dp, DP, 3, straight, 2)) << what;
    ASSERT_TRUE(capture_stage(**engine, straight, held)) << what;
  }
  {
    std::unique_ptr<Device> device;
    auto engine = create(device, swap_b);
    ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
    auto m = (*engine)->load_checkpoint(dir);
    ASSERT_TRUE(m.ok()) << what << ": " << m.status().to_string();
    EXPECT_EQ(m->step, 2) << what;
    ASSERT_TRUE(run_share(**engine, global, groups->coord.dp, DP, 3, resumed, 2)) << what;
    ASSERT_TRUE(capture_stage(**engine, resumed, held_again)) << what;
  }
  EXPECT_EQ(held, held_again) << what;
  ASSERT_EQ(resumed.losses.size(), 1u) << what;
  for (Snapshot* snap : {&straight, &resumed}) {
    snap->scales.assign(snap->losses.size(), 1.0);
    snap->skipped.assign(snap->losses.size(), 0);
  }
  testing::expect_same(straight, resumed, what + ": resumed against uninterrupted");
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == 0) std::filesystem::remove_all(root);
}

constexpr Placement kNvmeGrads{Tier::kNvme, Tier::kNvme};
constexpr Placement kNvmeHostGrads{Tier::kNvme, Tier::kHost};
constexpr Placement kDeviceOpt{Tier::kDevice, Tier::kHost};
constexpr Placement kHostOpt{Tier::kHost, Tier::kHost};

// ---- 2 ranks ----------------------------------------------------------------------------------

// Tensor parallel, gradients on NVMe: each shard's gradients on its rank's keys; the norm counts
// replicated parameters on tp rank 0 only (a scan of every element on both ranks fails the norm
// against one process). Accumulation restores the buckets from NVMe.
TEST(ComposeNp2, NvmeGradientsTensorParallel) {
  ASSERT_EQ(world().size(), 2);
  check({2, 1, ModelKind::kGpt2, DType::kF32, 2, 1.0, 0, Tier::kDevice, kNvmeGrads, kNvmeHostGrads});
  check({2, 1, ModelKind::kLlama, DType::kBF16, 1, 1.0, 0, Tier::kHost, kNvmeGrads, kNvmeHostGrads});
}

// Pipeline, gradients on NVMe: GPT-2's tied embedding unit is read back on the first and the last
// stage, summed between them, rescanned and written again before the update.
TEST(ComposeNp2, NvmeGradientsPipeline) {
  ASSERT_EQ(world().size(), 2);
  check({1, 2, ModelKind::kGpt2, DType::kF32, 2, 1.0, 0, Tier::kDevice, kNvmeGrads, kNvmeHostGrads});
  check({1, 2, ModelKind::kGpt2, DType::kF32, 1, 0.0, 0, Tier::kNvme, kNvmeGrads, kNvmeHostGrads,
         PipelineSchedule::kGpipe});
  check({1, 2, ModelKind::kLlama, DType::kF32, 2, 1.0, 0, Tier::kDevice, kNvmeGrads, kNvmeHostGrads});
}

// ---- 4 ranks ----------------------------------------------------------------------------------

// TP 2 x DP 2: each tp shard's reduced slice on NVMe (stage 1 with accumulation keeps the
// unsharded local sum on NVMe between micro-batches; stage 2 reads the slice back to add).
TEST(ComposeNp4, NvmeGradientsTensorParallelDataParallel) {
  ASSERT_EQ(world().size(), 4);
  check({2, 1, ModelKind::kLlama, DType::kF32, 2, 1.0, 1, Tier::kDevice, kNvmeGrads, kNvmeHostGrads});
  check({2, 1, ModelKind::kGpt2, DType::kF32, 2, 1.0, 2, Tier::kDevice, kNvmeGrads, kNvmeHostGrads});
}

// PP 2 x DP 2: the tied unit's reduced slices on NVMe, summed between the two ends per dp rank.
TEST(ComposeNp4, NvmeGradientsPipelineDataParallel) {
  ASSERT_EQ(world().size(), 4);
  check({1, 2, ModelKind::kGpt2, DType::kF32, 2, 1.0, 2, Tier::kDevice, kNvmeGrads, kNvmeHostGrads});
  check({1, 2, ModelKind::kGpt2, DType::kF32, 2, 1.0, 1, Tier::kDevice, kNvmeGrads, kNvmeHostGrads});
  check({1, 2, ModelKind::kGpt2, DType::kBF16, 1, 1.0, 3, Tier::kNvme, kNvmeGrads, kNvmeHostGrads});
}

// TP 2 x PP 2: both at once (the tied unit's shard on the first and the last stage of each tp rank).
TEST(ComposeNp4, NvmeGradientsGrid) {
  ASSERT_EQ(world().size(), 4);
  check({2, 2, ModelKind::kGpt2, DType::kF32, 2, 1.0, 0, Tier::kDevice, kNvmeGrads, kNvmeHostGrads});
  check_checkpoint(
      {2, 2, ModelKind::kGpt2, DType::kF32, 2, 1.0, 0, Tier::kDevice, kNvmeGrads, kNvmeHostGrads});
}

// TP 2 x DP 2, the optimizer sharded in device memory: the device update merges the statistics
// over dp, then over the tp group (replicated parameters counted on tp rank 0 only). Stages 2-3
// reduce-scatter each tp shard's gradient buckets during backward (stage 3 also slices the
// shard's parameters): bitwise the host tier's stage 2 (3), which also reduces every micro-batch.
TEST(ComposeNp4, DeviceShardedTensorParallel) {
  ASSERT_EQ(world().size(), 4);
  check({2, 1, ModelKind::kLlama, DType::kF32, 2, 1.0, 1, Tier::kDevice, kDeviceOpt, kHostOpt});
  check({2, 1, ModelKind::kGpt2, DType::kF32, 2, 1.0, 2, Tier::kDevice, kDeviceOpt, kHostOpt});
  check({2, 1, ModelKind::kGpt2, DType::kBF16, 2, 1.0, 3, Tier::kDevice, kDeviceOpt, kHostOpt});
  check_checkpoint({2, 1, ModelKind::kLlama, DType::kBF16, 2, 1.0, 2, Tier::kDevice, kDeviceOpt, kHostOpt});
}

// PP 2 x DP 2, the optimizer sharded in device memory: the tied unit's reduced slices summed
// between the first and the last stage inside the device update, then the statistics merged over
// dp and over the stages. Stage 2 (GPipe, accumulation 2) reduces each micro-batch in its stage's
// gradient buckets: bitwise the host tier's stage 2; stage 3 also slices the stage's parameters.
TEST(ComposeNp4, DeviceShardedPipeline) {
  ASSERT_EQ(world().size(), 4);
  check({1, 2, ModelKind::kGpt2, DType::kF32, 2, 1.0, 1, Tier::kDevice, kDeviceOpt, kHostOpt});
  check({1, 2, ModelKind::kLlama, DType::kF32, 2, 1.0, 2, Tier::kDevice, kDeviceOpt, kHostOpt,
         PipelineSchedule::kGpipe});
  check({1, 2, ModelKind::kGpt2, DType::kBF16, 1, 1.0, 3, Tier::kDevice, kDeviceOpt, kHostOpt});
  check_checkpoint({1, 2, ModelKind::kGpt2, DType::kF32, 2, 1.0, 1, Tier::kDevice, kDeviceOpt, kHostOpt});
}

// ---- 8 ranks ----------------------------------------------------------------------------------

// TP 2 x PP 2 x DP 2: the sharded device optimizer and gradients on NVMe on the whole grid; stage
// 2 in device memory reduce-scatters each tp shard's stage buckets inside every backward op.
TEST(ComposeNp8, Grid) {
  ASSERT_EQ(world().size(), 8);
  check({2, 2, ModelKind::kGpt2, DType::kF32, 2, 1.0, 1, Tier::kDevice, kDeviceOpt, kHostOpt});
  check({2, 2, ModelKind::kGpt2, DType::kF32, 2, 1.0, 2, Tier::kDevice, kDeviceOpt, kHostOpt});
  check({2, 2, ModelKind::kGpt2, DType::kF32, 1, 1.0, 2, Tier::kDevice, kNvmeGrads, kNvmeHostGrads});
}

// TP 2 x PP 2 x DP 2, the optimizer and the parameters in device memory at stage 3: each stage's
// tp shard's units sliced over dp and all-gathered ahead of use (the prefetcher follows the
// stage's recorded trace), gradients reduce-scattered per bucket inside every backward op, the
// tied embedding's slice of each tp shard summed between the ends. Bit for bit the device stage 2
// on the same grid (a fetch gathers the bits stage 2's after-update all-gather lays into its whole
// copy), as dist.device_pp checks on pp 2 x dp 2 and dist.device_tp on tp 2 x dp 2: GPT-2 fp32
// with accumulation 2, clipping and one bucket per block with overlap (also within the tolerances
// of one process), LLaMA bf16 with the default buckets.
TEST(ComposeNp8, DeviceStage3Grid) {
  ASSERT_EQ(world().size(), 8);
  Case gpt2{2, 2, ModelKind::kGpt2, DType::kF32, 2, 1.0, 3, Tier::kDevice, kDeviceOpt, kDeviceOpt};
  gpt2.baseline_zero_stage = 2;
  gpt2.reduce_bucket_elements = 20'000;  // a tp shard's block is about 25k elements: one bucket each
  check(gpt2);
  Case llama{2, 2, ModelKind::kLlama, DType::kBF16, 2, 1.0, 3, Tier::kDevice, kDeviceOpt, kDeviceOpt};
  llama.baseline_zero_stage = 2;
  check(llama);
}


// Stage 3 on tp 2 x pp 2 x dp 2 read back through its slices and shards (GPT-2 bf16, the tied
// embedding's slices on both ends): loss() and evaluate() give device stage 2's values on the same
// grid; a checkpoint (each stage's units gathered over dp and tp, written by the stage's first
// rank) resumes in a fresh grid bit for bit and loads into one process with the grid's state, bit
// for bit (dist_compare.hpp's expect_stage3_reads_back_as_stage2, as dist.device_pp and
// dist.device_tp check on their grids).
TEST(ComposeNp8, DeviceStage3GridReadBack) {
  ASSERT_EQ(world().size(), 8);
  auto groups = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, 2, 2);
  ASSERT_TRUE(groups.ok()) << groups.status().to_string();
  const int DP = groups->grid.dp();
  const TrainerConfig global = testing::tiny(ModelKind::kGpt2, DType::kBF16, 2 * DP, 1.0);
  TrainerConfig local = global;
  local.grad_accum = 2;
  const auto settings = testing::device_optimizer_settings;
  auto create = [&](std::unique_ptr<Device>& device, int stage) {
    device = testing::make_device();
    OffloadSettings s = settings(stage);
    s.reduce_bucket_elements = 20'000;
    s.overlap_comm = true;
    return OffloadEngine::create(local, s, *device, nullptr, groups->dp.get(), groups->tp.get(),
                                 groups->pp.get());
  };
  testing::expect_stage3_reads_back_as_stage2(global, groups->coord.dp, DP, create, settings(0),
                                              "compose-stage3-state",
                                              "gpt2 bf16 tp 2 x pp 2 x dp 2, m=2, clip 1, device stage 3");
}

}  // namespace
}  // namespace strata
