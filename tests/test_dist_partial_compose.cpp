// Partial optimizer offload (zero_optimization.offload_optimizer.ratio < 1) with tensor and
// pipeline parallelism, on real processes: run by tests/mpi_run.sh under `mpirun -np N`
// (tests/CMakeLists.txt: the PartialNp2 cases on 2 ranks, tp 2 or pp 2; the PartialNp4 cases on 4
// ranks, tp 2 x dp 2 and tp 2 x pp 2). docs/offload.md "Partial optimizer offload".
//
// What is compared, and how exactly: each case trains the same batch twice on the same ranks and
// groups, once at ratio 1 (every unit's optimizer state on the host) and once with the first of
// each rank's units on the device. The split changes where a unit's gradients wait and where it
// is scanned and updated, not the arithmetic: the device units accumulate their micro-batches in
// the order the host buckets do, are scanned with the same per-unit call (scan_norm: with tensor
// parallelism the replicated parameters on tp rank 0 only, as the host scan counts them), the
// statistics are merged unit by unit in the same order (over dp, the stages, then the tp ranks),
// and the device update runs the same Adam kernels on the same elements. GPT-2's tied embedding
// is summed between the first and the last stage from wherever it waits on each end. So losses,
// norms, loss scales, every held parameter's working copy, master and moments are compared bit for
// bit (testing::expect_same), no tolerance; the split is checked to have happened (device modules
// on every rank that the case says, the plan's device state regions).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "comm_environment.hpp"
#include "dist_compare.hpp"
#include "offload/internal.hpp"
#include "offload_fixture.hpp"
#include "strata/parallel.hpp"

namespace strata {
namespace {

using testing::capture_stage;
using testing::Snapshot;
using testing::world;

// Steps [from, steps) of `global`'s batches, this data-parallel rank's share (global micro-batches
// dp, dp + DP, ...); losses, norms, loss scales and skips recorded.
bool run_steps_of_share(OffloadEngine& engine, const TrainerConfig& global, int dp, int DP, int steps,
                        Snapshot& out, int from = 0) {
  std::vector<std::int32_t> in, tg;
  for (int step = from; step < steps; ++step) {
    testing::share_of(global, step, dp, DP, in, tg);
    auto m = engine.step(in, tg);
    EXPECT_TRUE(m.ok()) << m.status().to_string();
    if (!m.ok()) return false;
    out.losses.push_back(m->loss);
    out.norms.push_back(m->grad_norm);
    out.scales.push_back(m->loss_scale);
    out.skipped.push_back(m->skipped ? 1 : 0);
  }
  return true;
}

struct Groups {
  Comm* dp = nullptr;
  Comm* tp = nullptr;
  Comm* pp = nullptr;
  int dp_rank = 0, dp_size = 1;
};

// What a trained engine held: its state, the modules whose optimizer state its plan put on the
// device (Units::device_opt), the plan's bytes of exp_avg on the device (optim.exp_avg) and on the
// host ("Adam exp_avg" lines), the plan's device bytes and the device arena's bytes once created.
struct Trained {
  Snapshot snap;
  std::vector<int> device_modules;
  std::uint64_t exp_avg_device_bytes = 0, exp_avg_host_bytes = 0;
  std::uint64_t nvme_state_bytes = 0;  // the NVMe optimizer's [master | m | v] line
  std::uint64_t plan_device_bytes = 0, arena_bytes = 0;
};

Trained train(const TrainerConfig& global, const OffloadSettings& s, const Groups& g, int steps) {
  Trained out;
  TrainerConfig local = global;
  local.grad_accum = global.grad_accum / g.dp_size;
  // A swap store of its own per engine (each rank its own): a store is sized by its placement,
  // which the split changes.
  testing::TempDir swap("strata-partial-swap");
  OffloadSettings run = s;
  if (s.params == Tier::kNvme || s.optimizer == Tier::kNvme) {
    run.nvme_path = {swap.path().string()};
    run.io.nvme_path = run.nvme_path;
  }
  auto device = testing::make_device();
  auto engine = OffloadEngine::create(local, run, *device, nullptr, g.dp, g.tp, g.pp);
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  if (!engine.ok()) return out;
  out.arena_bytes = device->memory().stats().live_bytes;
  out.plan_device_bytes = (*engine)->plan().device_bytes;
  if (!run_steps_of_share(**engine, global, g.dp_rank, g.dp_size, steps, out.snap)) return out;
  std::vector<int> held;
  EXPECT_TRUE(capture_stage(**engine, out.snap, held));
  // The engine's own split, as its plan names it: the settings it runs with (dp, tp, stage).
  const OffloadSettings& used = (*engine)->settings();
  auto layout = describe_model(local.model, TensorParallel{used.tp_size, g.tp != nullptr ? g.tp->rank() : 0});
  EXPECT_TRUE(layout.ok());
  if (layout.ok()) {
    const offload_detail::Units units = offload_detail::describe_units(*layout, used, g.dp_rank);
    for (std::size_t m = 0; m < units.device_opt.size(); ++m)
      if (units.device_opt[m]) out.device_modules.push_back(static_cast<int>(m));
    EXPECT_EQ(out.device_modules.size(), units.device_opt_units);
  }
  for (const PlanLine& l : (*engine)->plan().lines) {
    if (l.what.rfind("device region optim.exp_avg ", 0) == 0 || l.what == "device region optim.exp_avg")
      out.exp_avg_device_bytes += l.bytes;
    if (l.what.rfind("Adam exp_avg ", 0) == 0 || l.what == "Adam exp_avg") out.exp_avg_host_bytes += l.bytes;
    if (l.what.rfind("fp32 master + exp_avg + exp_avg_sq", 0) == 0 && l.tier == Tier::kNvme)
      out.nvme_state_bytes += l.bytes;
  }
  return out;
}

std::string modules_text(const std::vector<int>& m) {
  std::string s;
  for (int x : m) s += (s.empty() ? "" : ",") + std::to_string(x);
  return "{" + s + "}";
}

// Ratio `ratio` against ratio 1 on the same groups, bit for bit. Returns the split's device
// modules on this rank (empty when the case failed before training).
std::vector<int> check(const std::string& what, const TrainerConfig& global, OffloadSettings s, double ratio,
                       const Groups& g) {
  constexpr int kSteps = 3;
  s.optimizer_ratio = 1.0;
  const Trained ref = train(global, s, g, kSteps);
  s.optimizer_ratio = ratio;
  const Trained got = train(global, s, g, kSteps);
  EXPECT_TRUE(ref.device_modules.empty()) << what;
  EXPECT_EQ(ref.exp_avg_device_bytes, 0u) << what << ": ratio 1 keeps no optimizer state on the device";
  std::printf("%s: rank %d keeps modules %s on the device\n", what.c_str(), world().rank(),
              modules_text(got.device_modules).c_str());
  if (!got.device_modules.empty()) {
    EXPECT_GT(got.exp_avg_device_bytes, 0u) << what << ": the device modules' moments in device memory";
  }
  if (g.dp_size == 1 && s.optimizer == Tier::kHost) {
    // The plan's two sides add up to the rank's whole state (its shard of its stage's units).
    EXPECT_EQ(got.exp_avg_device_bytes + got.exp_avg_host_bytes, ref.exp_avg_host_bytes) << what;
  }
  if (s.optimizer == Tier::kNvme) {
    // [master | m | v] of the host units on NVMe, three device regions' worth on the device
    // (with data-parallel ranks this rank's slices on NVMe, rank 0's on the device: fewer).
    EXPECT_GT(ref.nvme_state_bytes, 0u) << what;
    if (g.dp_size == 1) {
      EXPECT_EQ(got.nvme_state_bytes + 3 * got.exp_avg_device_bytes, ref.nvme_state_bytes) << what;
    } else if (!got.device_modules.empty()) {
      EXPECT_LT(got.nvme_state_bytes, ref.nvme_state_bytes) << what << ": the host modules' slices only";
    }
  }
  // The engine carves what its plan says: the split's extra device bytes are the plan's (each
  // carved block rounds up to 256 bytes; the split carves at most 6 more regions). With
  // data-parallel ranks the plan holds rank 0's slices, the largest: other ranks carve at most.
  const auto arena_more = static_cast<double>(got.arena_bytes) - static_cast<double>(ref.arena_bytes);
  const auto plan_more =
      static_cast<double>(got.plan_device_bytes) - static_cast<double>(ref.plan_device_bytes);
  if (g.dp_rank == 0) {
    EXPECT_NEAR(arena_more, plan_more, 6 * 256.0)
        << what << ": device bytes beyond ratio 1's, carved vs planned";
  } else {
    EXPECT_LE(arena_more, plan_more + 6 * 256.0)
        << what << ": device bytes beyond ratio 1's, carved vs planned";
  }
  testing::expect_same(ref.snap, got.snap, what);
  if (!ref.snap.losses.empty()) {
    EXPECT_NE(ref.snap.losses.front(), ref.snap.losses.back()) << what << ": trained";
  }
  return got.device_modules;
}

OffloadSettings host_optimizer() {
  OffloadSettings s;
  s.optimizer = Tier::kHost;
  s.persistence_threshold = 0;
  return s;
}

// Every rank's device-module count, gathered (to check what a case covers on the other ranks).
std::vector<int> counts_of_every_rank(std::size_t mine) {
  std::vector<float> all(static_cast<std::size_t>(world().size()));
  const float m = static_cast<float>(mine);
  EXPECT_TRUE(world().all_gather(&m, all.data(), 1, DType::kF32).wait().ok());
  return std::vector<int>(all.begin(), all.end());
}

// ---- tensor parallel (2 ranks: the world is the tp group) ---------------------------------------

void check_tp(ModelKind kind, DType dtype, double ratio, double clip) {
  ASSERT_EQ(world().size(), 2);
  const TrainerConfig c = testing::tiny(kind, dtype, 2, clip);
  Groups g;
  g.tp = &world();
  const std::string what = std::string(to_string(kind)) + " " + std::string(to_string(dtype)) +
                           ", tp 2, ratio " + std::to_string(ratio) + ", clip " + std::to_string(clip);
  const std::vector<int> dev = check(what, c, host_optimizer(), ratio, g);
  EXPECT_FALSE(dev.empty()) << what << ": the split keeps modules on the device";
  // Every tp rank's shard has the same shapes: the same split on both.
  const std::vector<int> counts = counts_of_every_rank(dev.size());
  EXPECT_EQ(counts[0], counts[1]) << what;
}

TEST(PartialNp2, TensorParallelGpt2Fp32) { check_tp(ModelKind::kGpt2, DType::kF32, 0.5, 0.5); }
TEST(PartialNp2, TensorParallelGpt2Bf16) { check_tp(ModelKind::kGpt2, DType::kBF16, 0.5, 0.5); }
// Every module but LLaMA's untied head on the device.
TEST(PartialNp2, TensorParallelLlamaMostModulesOnTheDevice) {
  check_tp(ModelKind::kLlama, DType::kF32, 0.01, 1.0);
}
// Clipping off: the host units update as they land, the device units after the norm.
TEST(PartialNp2, TensorParallelUpdatedDuringBackward) { check_tp(ModelKind::kGpt2, DType::kF32, 0.5, 0.0); }

// ---- pipeline (2 ranks: the world is one pipeline of 2 stages) ----------------------------------

struct PipeCase {
  ModelKind kind;
  DType dtype;
  double ratio;
  Tier params = Tier::kDevice;
  Tier optimizer = Tier::kHost;
  PipelineSchedule schedule = PipelineSchedule::kOneFOneB;
  int virtual_stages = 1;  // > 1: interleaved 1F1B
};

std::vector<int> check_pp(const PipeCase& k) {
  EXPECT_EQ(world().size(), 2);
  const TrainerConfig c = testing::tiny(k.kind, k.dtype, 2, 0.5);
  OffloadSettings s = host_optimizer();
  s.params = k.params;
  s.optimizer = k.optimizer;
  s.pipeline_schedule = k.schedule;
  s.pipeline_virtual_stages = k.virtual_stages;
  // The NVMe optimizer's sub-groups cut units (its swap store: train()).
  if (k.optimizer == Tier::kNvme) s.sub_group_size = 4097;
  Groups g;
  g.pp = &world();
  const std::string what =
      std::string(to_string(k.kind)) + " " + std::string(to_string(k.dtype)) + ", pp 2 (" +
      std::string(to_string(k.schedule)) +
      (k.virtual_stages > 1 ? " interleaved, v = " + std::to_string(k.virtual_stages) : "") +
      ", m = 2), ratio " + std::to_string(k.ratio) + ", params " + std::string(to_string(k.params)) +
      ", optimizer " + std::string(to_string(k.optimizer));
  return check(what, c, s, k.ratio, g);
}

// Whether this rank's device modules contain the tied embedding unit (module 0), on every rank.
std::vector<int> tied_on_device(const std::vector<int>& dev) {
  const bool mine = !dev.empty() && dev.front() == 0;
  return counts_of_every_rank(mine ? 1 : 0);
}

TEST(PartialNp2, PipelineLlama) {
  // The last stage (the last block and the head) is mostly its block: a small ratio so that its
  // share holds it.
  const std::vector<int> dev = check_pp({ModelKind::kLlama, DType::kF32, 0.05});
  // Each stage splits its own units: both keep their first ones on the device.
  const std::vector<int> counts = counts_of_every_rank(dev.size());
  EXPECT_GT(counts[0], 0);
  EXPECT_GT(counts[1], 0);
  if (world().rank() == 1 && !dev.empty()) {
    EXPECT_GT(dev.front(), 0) << "stage 1's first unit is its own";
  }
}

// GPT-2's tied embedding: the first of both ends' units, on the device at both ends.
TEST(PartialNp2, PipelineGpt2TiedOnTheDeviceAtBothEnds) {
  const std::vector<int> dev = check_pp({ModelKind::kGpt2, DType::kF32, 0.5});
  const std::vector<int> tied = tied_on_device(dev);
  EXPECT_EQ(tied[0], 1);
  EXPECT_EQ(tied[1], 1);
}

// A ratio whose share holds the embedding unit on one end only (the first stage, about twice the
// last's elements): the last stage runs ratio 1's path (no device unit) and sums the tied
// gradient from host memory, the first from device memory.
TEST(PartialNp2, PipelineGpt2TiedOnTheDeviceAtOneEnd) {
  const std::vector<int> dev = check_pp({ModelKind::kGpt2, DType::kF32, 0.88});
  const std::vector<int> tied = tied_on_device(dev);
  EXPECT_NE(tied[0], tied[1]) << "the case needs the tied unit on the device at one end only";
}

// Most modules on the device (each stage all but its last unit), GPipe.
TEST(PartialNp2, PipelineGpt2Bf16MostModulesOnTheDeviceGpipe) {
  const std::vector<int> dev =
      check_pp({ModelKind::kGpt2, DType::kBF16, 0.01, Tier::kDevice, Tier::kHost, PipelineSchedule::kGpipe});
  const std::vector<int> tied = tied_on_device(dev);
  EXPECT_EQ(tied[0], 1);
  EXPECT_EQ(tied[1], 1);
}

// The parameters on the host: the device modules resident, the others fetched.
TEST(PartialNp2, PipelineGpt2Bf16ParametersOnTheHost) {
  check_pp({ModelKind::kGpt2, DType::kBF16, 0.5, Tier::kHost, Tier::kHost});
}

// The NVMe optimizer: the host units' [master | m | v] stream through the ring in sub-groups.
TEST(PartialNp2, PipelineGpt2NvmeOptimizer) {
  check_pp({ModelKind::kGpt2, DType::kF32, 0.5, Tier::kDevice, Tier::kNvme});
}

// Interleaved 1F1B (2 chunks per stage, FLOP-balanced over the 5 modules, so a stage's modules are
// not contiguous; GPT-2's last stage also holds the tied embedding): each stage splits the units
// of all its chunks, in module order.
TEST(PartialNp2, PipelineInterleaved) {
  for (const auto& [kind, ratio] : {std::pair{ModelKind::kGpt2, 0.5}, std::pair{ModelKind::kLlama, 0.05}}) {
    PipeCase k{kind, DType::kF32, ratio};
    k.virtual_stages = 2;
    const std::vector<int> dev = check_pp(k);
    EXPECT_FALSE(dev.empty()) << to_string(kind);
  }
}

// ---- checkpoints with the split under tp and pp (2 ranks) ----------------------------------------
// Save after 2 steps with the split, resume in a fresh engine of the same groups (with the split,
// and at ratio 1: the files hold the placement's whole state, each rank its shard or stage), run
// 2 more: bit for bit the 4 uninterrupted steps (the same arithmetic resumes from the same bits).

// `c` is the global batch: with data-parallel ranks each trains its share (run_steps_of_share).
void check_checkpoint(const std::string& what, const TrainerConfig& c, OffloadSettings s, double ratio,
                      const Groups& g) {
  TrainerConfig local = c;
  local.grad_accum = c.grad_accum / g.dp_size;
  auto run_range = [&](OffloadEngine& engine, const TrainerConfig& global, int from, int to, Snapshot& out) {
    return run_steps_of_share(engine, global, g.dp_rank, g.dp_size, to, out, from);
  };
  auto create = [&](std::unique_ptr<Device>& device, double r) {
    device = testing::make_device();
    OffloadSettings run = s;
    run.optimizer_ratio = r;
    return OffloadEngine::create(local, run, *device, nullptr, g.dp, g.tp, g.pp);
  };
  Snapshot straight;
  std::vector<int> held;
  std::size_t device_modules = 0;
  const std::string root = testing::shared_temp_dir("partial-ckpt");
  {
    std::unique_ptr<Device> device;
    auto engine = create(device, ratio);
    ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
    ASSERT_TRUE(run_range(**engine, c, 0, 2, straight)) << what;
    auto saved = (*engine)->save_checkpoint(root, "{}", 2);
    ASSERT_TRUE(saved.ok()) << what << ": " << saved.status().to_string();
    ASSERT_TRUE(run_range(**engine, c, 2, 4, straight)) << what;
    ASSERT_TRUE(capture_stage(**engine, straight, held)) << what;
    const OffloadSettings& run = (*engine)->settings();
    auto layout =
        describe_model(local.model, TensorParallel{run.tp_size, g.tp != nullptr ? g.tp->rank() : 0});
    ASSERT_TRUE(layout.ok());
    device_modules = offload_detail::describe_units(*layout, run, g.dp_rank).device_opt_units;
  }
  const std::vector<int> counts = counts_of_every_rank(device_modules);
  for (int n : counts) EXPECT_GT(n, 0) << what << ": every rank keeps modules on the device";
  ASSERT_EQ(straight.losses.size(), 4u) << what;
  EXPECT_NE(straight.losses.front(), straight.losses.back()) << what << ": trained";
  for (const double resume_ratio : {ratio, 1.0}) {
    const std::string how = what + ", resumed at ratio " + std::to_string(resume_ratio);
    Snapshot resumed;
    for (std::size_t i = 0; i < 2; ++i) {
      resumed.losses.push_back(straight.losses[i]);
      resumed.norms.push_back(straight.norms[i]);
      resumed.scales.push_back(straight.scales[i]);
      resumed.skipped.push_back(straight.skipped[i]);
    }
    std::unique_ptr<Device> device;
    auto engine = create(device, resume_ratio);
    ASSERT_TRUE(engine.ok()) << how << ": " << engine.status().to_string();
    auto m = (*engine)->load_checkpoint(root);
    ASSERT_TRUE(m.ok()) << how << ": " << m.status().to_string();
    EXPECT_EQ(m->step, 2) << how;
    std::vector<int> held_again;
    ASSERT_TRUE(run_range(**engine, c, 2, 4, resumed)) << how;
    ASSERT_TRUE(capture_stage(**engine, resumed, held_again)) << how;
    EXPECT_EQ(held, held_again) << how;
    testing::expect_same(straight, resumed, how);
  }
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == 0) std::filesystem::remove_all(root);
}

TEST(PartialNp2, CheckpointResumesUnderTensorParallel) {
  ASSERT_EQ(world().size(), 2);
  Groups g;
  g.tp = &world();
  check_checkpoint("gpt2 bf16, tp 2, ratio 0.5", testing::tiny(ModelKind::kGpt2, DType::kBF16, 2, 0.5),
                   host_optimizer(), 0.5, g);
}

// GPT-2's tied unit on the device at both ends (ratio 0.5): its state saved by the first stage.
TEST(PartialNp2, CheckpointResumesUnderPipeline) {
  ASSERT_EQ(world().size(), 2);
  Groups g;
  g.pp = &world();
  check_checkpoint("gpt2 fp32, pp 2, ratio 0.5", testing::tiny(ModelKind::kGpt2, DType::kF32, 2, 0.5),
                   host_optimizer(), 0.5, g);
}

// ---- 4 ranks -------------------------------------------------------------------------------------

// The world's grid of `tp` x `pp` x (world size / (tp x pp)) data-parallel ranks.
Groups grid_groups(int tp, int pp, std::unique_ptr<ProcessGroups>& keep) {
  Groups g;
  auto groups = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, tp, pp);
  EXPECT_TRUE(groups.ok()) << groups.status().to_string();
  if (!groups.ok()) return g;
  keep = std::make_unique<ProcessGroups>(std::move(groups).value());
  g.dp = keep->dp.get();
  g.tp = tp > 1 ? keep->tp.get() : nullptr;
  g.pp = pp > 1 ? keep->pp.get() : nullptr;
  g.dp_rank = keep->dp->rank();
  g.dp_size = keep->dp->size();
  return g;
}

// One case on a grid with data-parallel ranks: the global batch of accumulation 2 per rank.
struct GridCase {
  ModelKind kind;
  DType dtype;
  double ratio;
  int stage;
  Tier params = Tier::kDevice;
  Tier optimizer = Tier::kHost;
  int virtual_stages = 1;  // > 1: interleaved 1F1B
  int n_layer = 0;         // > 0: the tiny model with this many blocks
  Tier gradients = Tier::kHost;  // kNvme goes with the NVMe optimizer
};

TrainerConfig global_of(const GridCase& k, const Groups& g) {
  TrainerConfig c = testing::tiny(k.kind, k.dtype, 2 * g.dp_size, 0.5);
  if (k.n_layer > 0) c.model.n_layer = k.n_layer;
  return c;
}

std::vector<int> check_grid(const GridCase& k, const Groups& g, const std::string& grid) {
  const TrainerConfig global = global_of(k, g);
  OffloadSettings s = host_optimizer();
  s.zero_stage = k.stage;
  s.params = k.params;
  s.optimizer = k.optimizer;
  s.pipeline_virtual_stages = k.virtual_stages;
  s.gradients = k.gradients;
  // The NVMe optimizer's sub-groups cut units (its swap store: train()).
  if (k.optimizer == Tier::kNvme) s.sub_group_size = 4097;
  const std::string what =
      std::string(to_string(k.kind)) + " " + std::string(to_string(k.dtype)) + ", " + grid +
      (k.virtual_stages > 1 ? " interleaved (v = " + std::to_string(k.virtual_stages) + ")" : "") +
      ", stage " + std::to_string(k.stage) + ", ratio " + std::to_string(k.ratio) + ", params " +
      std::string(to_string(k.params)) + ", optimizer " + std::string(to_string(k.optimizer)) +
      (k.gradients != Tier::kHost ? ", gradients " + std::string(to_string(k.gradients)) : std::string());
  return check(what, global, s, k.ratio, g);
}

// tp 2 x dp 2: the data-parallel split of the device units (their slices reduced, scanned with
// scan_norm and gathered on the compute stream) on each tp rank's shard, stages 1-3.
TEST(PartialNp4, TensorTimesDataParallel) {
  ASSERT_EQ(world().size(), 4);
  std::unique_ptr<ProcessGroups> keep;
  const Groups g = grid_groups(2, 1, keep);
  ASSERT_NE(g.dp, nullptr);
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    for (int stage : {1, 2, 3}) {
      const std::vector<int> dev = check_grid({ModelKind::kGpt2, dtype, 0.5, stage}, g, "tp 2 x dp 2");
      EXPECT_FALSE(dev.empty());
    }
  }
}

// tp 2 x dp 2 at stage 3 with the parameters off the device: the device modules resident and
// whole on every rank, the host modules' slices of this tp rank's shard at their home, gathered
// by the fetch.
TEST(PartialNp4, TensorTimesDataParallelStage3ParametersOffTheDevice) {
  ASSERT_EQ(world().size(), 4);
  std::unique_ptr<ProcessGroups> keep;
  const Groups g = grid_groups(2, 1, keep);
  ASSERT_NE(g.dp, nullptr);
  for (const GridCase& k : {GridCase{ModelKind::kGpt2, DType::kBF16, 0.5, 3, Tier::kHost, Tier::kHost},
                            GridCase{ModelKind::kGpt2, DType::kF32, 0.5, 3, Tier::kNvme, Tier::kNvme}}) {
    const std::vector<int> dev = check_grid(k, g, "tp 2 x dp 2");
    EXPECT_FALSE(dev.empty());
  }
}

// pp 2 x dp 2 (stages 0-1): each stage's device units reduced once after the schedule on the
// compute stream, the tied unit's reduced slice summed between the ends; at ratio 0.88 the tied
// unit is on the device at the first stage only (the last sums its slice from host memory).
// Stage 2: reduced after each micro-batch's backward op inside the schedule (1F1B: the next
// micro-batch's forward may run before it), the slices added as ratio 1's host shard adds them.
TEST(PartialNp4, PipelineTimesDataParallel) {
  ASSERT_EQ(world().size(), 4);
  std::unique_ptr<ProcessGroups> keep;
  const Groups g = grid_groups(1, 2, keep);
  ASSERT_NE(g.dp, nullptr);
  for (const GridCase& k :
       {GridCase{ModelKind::kGpt2, DType::kF32, 0.5, 1}, GridCase{ModelKind::kGpt2, DType::kF32, 0.88, 1},
        GridCase{ModelKind::kLlama, DType::kBF16, 0.05, 0}, GridCase{ModelKind::kGpt2, DType::kF32, 0.5, 2},
        GridCase{ModelKind::kGpt2, DType::kBF16, 0.88, 2}}) {
    check_grid(k, g, "pp 2 x dp 2");
  }
}

// pp 2 x dp 2 at stage 2 with the host part off host memory: the NVMe optimizer (sub-groups of
// 4097 over this rank's slices of the stage's host units), the parameters on the host, and
// the parameters and optimizer on NVMe.
TEST(PartialNp4, PipelineTimesDataParallelTiers) {
  ASSERT_EQ(world().size(), 4);
  std::unique_ptr<ProcessGroups> keep;
  const Groups g = grid_groups(1, 2, keep);
  ASSERT_NE(g.dp, nullptr);
  for (const GridCase& k : {GridCase{ModelKind::kGpt2, DType::kF32, 0.5, 2, Tier::kDevice, Tier::kNvme},
                            GridCase{ModelKind::kGpt2, DType::kBF16, 0.5, 2, Tier::kHost, Tier::kHost},
                            GridCase{ModelKind::kLlama, DType::kBF16, 0.05, 2, Tier::kNvme, Tier::kNvme}}) {
    const std::vector<int> dev = check_grid(k, g, "pp 2 x dp 2");
    EXPECT_FALSE(dev.empty());
  }
}

// pp 2 x dp 2 at stage 3: the device units' parameters whole and resident, their gradients
// reduced after each backward op as at stage 2; the host units' parameters sliced at their home
// and gathered by the fetch (ratio 1's stage 3 on a pipeline).
TEST(PartialNp4, PipelineTimesDataParallelStage3) {
  ASSERT_EQ(world().size(), 4);
  std::unique_ptr<ProcessGroups> keep;
  const Groups g = grid_groups(1, 2, keep);
  ASSERT_NE(g.dp, nullptr);
  for (const GridCase& k : {GridCase{ModelKind::kGpt2, DType::kF32, 0.5, 3},
                            GridCase{ModelKind::kGpt2, DType::kBF16, 0.5, 3, Tier::kHost, Tier::kHost}}) {
    const std::vector<int> dev = check_grid(k, g, "pp 2 x dp 2");
    EXPECT_FALSE(dev.empty());
  }
}

// Interleaved 1F1B (v = 2) x dp 2 at stages 2 and 3: after each backward op of (micro-batch a,
// chunk c) the device units chunk c reads are reduced (GPT-2's last stage: the tied unit with the
// head's chunk) and zeroed for the chunk's next op. LLaMA with 5 blocks (7 modules in 4 chunks):
// the first stage's device units lie in both of its chunks, so their reductions interleave with
// the other chunk's backward ops.
TEST(PartialNp4, InterleavedTimesDataParallel) {
  ASSERT_EQ(world().size(), 4);
  std::unique_ptr<ProcessGroups> keep;
  const Groups g = grid_groups(1, 2, keep);
  ASSERT_NE(g.dp, nullptr);
  GridCase gpt2{ModelKind::kGpt2, DType::kF32, 0.5, 2};
  gpt2.virtual_stages = 2;
  GridCase llama{ModelKind::kLlama, DType::kF32, 0.05, 3};
  llama.virtual_stages = 2;
  llama.n_layer = 5;
  for (const GridCase& k : {gpt2, llama}) {
    const std::vector<int> dev = check_grid(k, g, "pp 2 x dp 2");
    EXPECT_FALSE(dev.empty());
    // The chunks of this stage whose modules hold device units.
    const TrainerConfig global = global_of(k, g);
    auto bounds = pipeline_stages(global.model, 2 * k.virtual_stages, global.seq_len);
    ASSERT_TRUE(bounds.ok()) << bounds.status().to_string();
    std::size_t chunks_with_device_units = 0;
    for (const auto& [b, e] : offload_detail::stage_ranges(*bounds, k.virtual_stages, g.pp->rank())) {
      if (std::any_of(dev.begin(), dev.end(), [b = b, e = e](int m) { return m >= b && m < e; }))
        ++chunks_with_device_units;
    }
    const std::vector<int> counts = counts_of_every_rank(chunks_with_device_units);
    if (k.kind == ModelKind::kLlama) {
      EXPECT_EQ(*std::max_element(counts.begin(), counts.end()), 2)
          << "a stage with device units in both of its chunks";
    }
  }
}

// Interleaved 1F1B (v = 2) x dp 2 with the gradients on NVMe (the NVMe optimizer, sub-groups of
// 4097): the host units' gradients land on NVMe through the staging buffer whichever chunk's
// backward issues them, the device units' are reduced after each backward op; GPT-2's tied unit
// summed between the ends (stage 2; stage 1: reduced once after the schedule).
TEST(PartialNp4, InterleavedNvmeGradientsTimesDataParallel) {
  ASSERT_EQ(world().size(), 4);
  std::unique_ptr<ProcessGroups> keep;
  const Groups g = grid_groups(1, 2, keep);
  ASSERT_NE(g.dp, nullptr);
  for (int stage : {1, 2}) {
    GridCase k{ModelKind::kGpt2, DType::kF32, 0.5, stage, Tier::kDevice, Tier::kNvme};
    k.virtual_stages = 2;
    k.gradients = Tier::kNvme;
    const std::vector<int> dev = check_grid(k, g, "pp 2 x dp 2");
    EXPECT_FALSE(dev.empty());
  }
}

// A checkpoint with the split under pp 2 x dp 2 (stage 2, GPT-2 fp32, the tied unit on the device
// at both ends): resumed with the split and at ratio 1, bit for bit the uninterrupted run.
TEST(PartialNp4, CheckpointResumesUnderPipelineTimesDataParallel) {
  ASSERT_EQ(world().size(), 4);
  std::unique_ptr<ProcessGroups> keep;
  const Groups g = grid_groups(1, 2, keep);
  ASSERT_NE(g.dp, nullptr);
  OffloadSettings s = host_optimizer();
  s.zero_stage = 2;
  check_checkpoint("gpt2 fp32, pp 2 x dp 2, stage 2, ratio 0.5",
                   testing::tiny(ModelKind::kGpt2, DType::kF32, 2 * g.dp_size, 0.5), s, 0.5, g);
}

// tp 2 x pp 2: each stage's tp ranks split the stage's units alike; GPT-2's tied unit on both ends.
TEST(PartialNp4, TensorTimesPipeline) {
  ASSERT_EQ(world().size(), 4);
  std::unique_ptr<ProcessGroups> keep;
  Groups g = grid_groups(2, 2, keep);
  ASSERT_NE(g.tp, nullptr);
  g.dp = nullptr;  // one rank per group: no data parallelism
  g.dp_rank = 0;
  g.dp_size = 1;
  // LLaMA's last stage is mostly its last block: a small ratio so that its share holds it.
  for (const auto& [kind, ratio] : {std::pair{ModelKind::kGpt2, 0.5}, std::pair{ModelKind::kLlama, 0.05}}) {
    const TrainerConfig c = testing::tiny(kind, DType::kF32, 2, 0.5);
    const std::string what =
        std::string(to_string(kind)) + " fp32, tp 2 x pp 2, ratio " + std::to_string(ratio);
    const std::vector<int> dev = check(what, c, host_optimizer(), ratio, g);
    EXPECT_FALSE(dev.empty()) << what;
  }
}

// ---- 8 ranks -------------------------------------------------------------------------------------

// The whole grid tp 2 x pp 2 x dp 2 (dist.partial_compose.np8; rank = (dp * 2 + stage) * 2 + tp
// rank): each stage's tensor ranks split their shard of the stage's units alike, and each
// data-parallel pair reduces the device units' slices (stage 1: once after the schedule; 2 and 3:
// after each backward op inside it; 3: the host units' parameters sliced at home and gathered,
// the device units' resident and whole), GPT-2's tied unit summed between the ends. Stages 1-3 on
// 1F1B, and stage 2 interleaved (v = 2), bit for bit against ratio 1 on the same grid.
TEST(PartialNp8, TensorTimesPipelineTimesData) {
  ASSERT_EQ(world().size(), 8);
  std::unique_ptr<ProcessGroups> keep;
  const Groups g = grid_groups(2, 2, keep);
  ASSERT_NE(g.dp, nullptr);
  ASSERT_NE(g.tp, nullptr);
  ASSERT_NE(g.pp, nullptr);
  ASSERT_EQ(g.dp_size, 2);
  GridCase interleaved{ModelKind::kGpt2, DType::kF32, 0.5, 2};
  interleaved.virtual_stages = 2;
  for (const GridCase& k : {GridCase{ModelKind::kGpt2, DType::kF32, 0.5, 1}, GridCase{ModelKind::kGpt2, DType::kF32, 0.5, 2},
                            GridCase{ModelKind::kGpt2, DType::kF32, 0.5, 3, Tier::kHost, Tier::kHost}, interleaved}) {
    const std::vector<int> dev = check_grid(k, g, "tp 2 x pp 2 x dp 2");
    EXPECT_FALSE(dev.empty());
  }
}

}  // namespace
}  // namespace strata
