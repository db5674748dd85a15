// The delayed parameter update (strata.delayed_update) with the working parameters off the device
// (offload_param cpu / nvme) and several data-parallel ranks, on real processes (tests/mpi_run.sh
// under `mpirun -np N`, tests/CMakeLists.txt).
//
// Reference: the same delayed run on the same ranks with the parameters on the device. Where the
// parameters live changes no arithmetic of the delayed update: the gradients are reduce-scattered
// over the same chunks, the statistics merged in the same order, each rank's slice updated with
// the same Adam calls; what differs is only where the next version goes (a second host copy or
// NVMe shard, at stage 3 this rank's slice of it) and when it becomes the one fetches read
// (publish_delayed). So the comparison is bit for bit: losses, norms, loss scales, skipped steps,
// and every parameter, master weight and moment after the last step, on 2 and 3 ranks.
//
// With tensor parallelism (DelayedUpdateTensorParallel, the world one tensor-parallel group) and
// a pipeline (DelayedUpdatePipeline, the world one pipeline): the reference is one process
// running the same delayed update on the same batch, in the same process. Every tensor rank and
// every stage delays its own update alike: its optimizer thread updates its shard or its stage's
// units in backward order while the next step computes, and publish_delayed runs at the same
// point of every rank's step (after its passes, with every stream synchronised), so step t + 1
// computes at the shards (the stages) of P[t - 1] on every rank. What differs from one process is
// what differs without the delay: tensor parallel fp32 rounds its row-parallel sums and split
// softmax differently (within the tensor-parallel tolerances, see below); a pipeline computes
// every module as one process does and merges the norm in unit order (bit for bit for LLaMA and
// for GPT-2 with one micro-batch, whose tied embedding's two parts are added once).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "comm_environment.hpp"
#include "dist_compare.hpp"
#include "offload_fixture.hpp"
#include "strata/parallel.hpp"

namespace strata {
namespace {

using testing::Snapshot;
using testing::world;

using testing::local_of;
using testing::share;

// `steps` steps of the global batch on this rank; with `flush_after` > 0 the state is read
// (a flush: the update in flight is waited for and published) after that many steps.
Snapshot train_dp(const TrainerConfig& global, const OffloadSettings& s, int steps, int flush_after = 0) {
  Snapshot out;
  auto device = testing::make_device();
  auto engine = OffloadEngine::create(local_of(global), s, *device, nullptr, &world());
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  if (!engine.ok()) return out;
  std::vector<std::int32_t> in, tg;
  for (int step = 0; step < steps; ++step) {
    share(global, step, in, tg);
    auto m = (*engine)->step(in, tg);
    EXPECT_TRUE(m.ok()) << m.status().to_string();
    if (!m.ok()) return out;
    out.losses.push_back(m->loss);
    out.norms.push_back(m->grad_norm);
    out.scales.push_back(m->loss_scale);
    out.skipped.push_back(m->skipped ? 1 : 0);
    if (step + 1 == flush_after) {
      Status flushed = (*engine)->synchronize();
      EXPECT_TRUE(flushed.ok()) << flushed.to_string();
    }
  }
  testing::capture_state(**engine, out);
  return out;
}

struct DpuCase {
  const char* name;
  int stage;
  DType dtype;
  std::int64_t accum;  // per rank
  double clip;
  Tier params, optimizer;
  Tier gradients = Tier::kHost;
  int warmup = 0;
  int flush_after = 0;
};

void check_dpu(const DpuCase& c) {
  const int P = world().size();
  const TrainerConfig global = testing::tiny(ModelKind::kGpt2, c.dtype, c.accum * P, c.clip);
  OffloadSettings s;
  s.zero_stage = c.stage;
  s.optimizer = c.optimizer;
  s.gradients = c.gradients;
  s.persistence_threshold = 0;  // every module moves (stage 3: every module sliced)
  s.delayed_update = true;
  s.delayed_update_warmup = c.warmup;
  s.sub_group_size = 1000;  // several sub-groups per slice on NVMe
  testing::TempDir swap_dev("strata-dpu-swap"), swap_off("strata-dpu-swap");  // each rank its own
  const bool nvme_opt = c.optimizer == Tier::kNvme;
  constexpr int kSteps = 5;
  OffloadSettings on_device = s;
  on_device.params = Tier::kDevice;
  if (nvme_opt) on_device.nvme_path = {swap_dev.path().string()};
  const Snapshot ref = train_dp(global, on_device, kSteps, c.flush_after);
  OffloadSettings off = s;
  off.params = c.params;
  if (nvme_opt || c.params == Tier::kNvme) off.nvme_path = {swap_off.path().string()};
  const Snapshot got = train_dp(global, off, kSteps, c.flush_after);
  ASSERT_EQ(ref.losses.size(), static_cast<std::size_t>(kSteps)) << c.name;
  testing::expect_same(ref, got, std::string(c.name) + " on " + std::to_string(P) + " ranks");
  // The delayed run really is delayed: step 2 computes at the initial parameters with warm-up 0,
  // so its loss differs from an ordinary run's step 2 (a run that ignored the setting would pass
  // the comparison above as well).
  if (c.warmup == 0 && !ref.skipped.empty() && !ref.skipped[0]) {
    OffloadSettings ordinary = on_device;
    ordinary.delayed_update = false;
    testing::TempDir swap_ord("strata-dpu-swap");
    if (nvme_opt) ordinary.nvme_path = {swap_ord.path().string()};
    const Snapshot plain = train_dp(global, ordinary, 2);
    ASSERT_EQ(plain.losses.size(), 2u) << c.name;
    EXPECT_NE(plain.losses[1], got.losses[1])
        << c.name << ": step 2 should compute at the initial parameters";
  }
}

TEST(DelayedUpdateDataParallel, Stage1ParamsOnHostFp32AccumulationClipping) {
  check_dpu({"stage 1, params on host, fp32, accumulation 2, clip 1", 1, DType::kF32, 2, 1.0, Tier::kHost,
             Tier::kHost});
}

TEST(DelayedUpdateDataParallel, Stage2ParamsOnNvmeBf16NvmeOptimizer) {
  check_dpu({"stage 2, params and optimizer on NVMe, bf16, accumulation 2, clip 1", 2, DType::kBF16, 2, 1.0,
             Tier::kNvme, Tier::kNvme, Tier::kHost, 1});
}

TEST(DelayedUpdateDataParallel, Stage3ParamsOnHostBf16WithFlush) {
  check_dpu({"stage 3, params on host, bf16, clip 0.5, a flush after step 2", 3, DType::kBF16, 1, 0.5,
             Tier::kHost, Tier::kHost, Tier::kHost, 0, 2});
}

TEST(DelayedUpdateDataParallel, Stage3ParamsOnNvmeFp32AccumulationNvmeGradients) {
  check_dpu({"stage 3, everything on NVMe (gradients too), fp32, accumulation 2", 3, DType::kF32, 2, 0.0,
             Tier::kNvme, Tier::kNvme, Tier::kNvme});
}

TEST(DelayedUpdateDataParallel, Stage3ParamsOnNvmeHostOptimizerFp16Skips) {
  // fp16 with a loss scale that overflows (testing::tiny): skipped steps write no next version.
  check_dpu({"stage 3, params on NVMe, host optimizer, fp16, accumulation 2", 3, DType::kF16, 2, 1.0,
             Tier::kNvme, Tier::kHost, Tier::kHost, 1});
}

// A checkpoint saved with an update in flight (stage 3, each rank's slices on NVMe): the save
// flushes (the update waited for and published), and a run resumed from it continues the saving
// run's trajectory bit for bit.
TEST(DelayedUpdateDataParallel, Stage3CheckpointWithAnUpdateInFlightResumesBitwise) {
  const int P = world().size();
  const TrainerConfig global = testing::tiny(ModelKind::kGpt2, DType::kBF16, 2 * P, 1.0);
  testing::TempDir swap_a("strata-dpu-swap"), swap_b("strata-dpu-swap");
  OffloadSettings s;
  s.zero_stage = 3;
  s.params = Tier::kNvme;
  s.optimizer = Tier::kHost;
  s.persistence_threshold = 0;
  s.delayed_update = true;
  s.delayed_update_warmup = 0;
  s.nvme_path = {swap_a.path().string()};
  const std::string root = testing::shared_temp_dir("dpu-ckpt");
  constexpr int kSave = 3, kSteps = 5;
  Snapshot straight;
  {
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(local_of(global), s, *device, nullptr, &world());
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    std::vector<std::int32_t> in, tg;
    for (int step = 0; step < kSteps; ++step) {
      share(global, step, in, tg);
      auto m = (*engine)->step(in, tg);
      ASSERT_TRUE(m.ok()) << m.status().to_string();
      if (step >= kSave) {
        straight.losses.push_back(m->loss);
        straight.norms.push_back(m->grad_norm);
        straight.scales.push_back(m->loss_scale);
        straight.skipped.push_back(m->skipped ? 1 : 0);
      }
      if (step + 1 == kSave) {
        auto saved = (*engine)->save_checkpoint(root, "{}", kSave);
        ASSERT_TRUE(saved.ok()) << saved.status().to_string();
      }
    }
    ASSERT_TRUE(testing::capture_state(**engine, straight));
  }
  Snapshot resumed;
  {
    OffloadSettings r = s;
    r.nvme_path = {swap_b.path().string()};
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(local_of(global), r, *device, nullptr, &world());
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    auto m = (*engine)->load_checkpoint(root);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    EXPECT_EQ(m->step, kSave);
    std::vector<std::int32_t> in, tg;
    for (int step = kSave; step < kSteps; ++step) {
      share(global, step, in, tg);
      auto sm = (*engine)->step(in, tg);
      ASSERT_TRUE(sm.ok()) << sm.status().to_string();
      resumed.losses.push_back(sm->loss);
      resumed.norms.push_back(sm->grad_norm);
      resumed.scales.push_back(sm->loss_scale);
      resumed.skipped.push_back(sm->skipped ? 1 : 0);
    }
    ASSERT_TRUE(testing::capture_state(**engine, resumed));
  }
  testing::expect_same(straight, resumed,
                       "stage 3 delayed update, resumed from a checkpoint saved in flight");
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == 0) std::filesystem::remove_all(root);
}

// The plan holds the next version where the update writes it: this rank's slices at stage 3.
TEST(DelayedUpdateDataParallel, PlanHoldsTheNextVersion) {
  const int P = world().size();
  const TrainerConfig c = local_of(testing::tiny(ModelKind::kGpt2, DType::kBF16, P, 0.0));
  for (Tier params : {Tier::kHost, Tier::kNvme}) {
    for (int stage : {2, 3}) {
      OffloadSettings s;
      s.zero_stage = stage;
      s.params = params;
      s.optimizer = Tier::kHost;
      s.persistence_threshold = 0;
      s.nvme_path = {"nvme"};  // a name: the plan touches no disk
      s.io.nvme_path = s.nvme_path;
      s.dp_size = P;
      s.delayed_update = true;
      const std::string name =
          std::string("params on ") + std::string(to_string(params)) + ", stage " + std::to_string(stage);
      auto plan = OffloadPlan::make(c, s);
      ASSERT_TRUE(plan.ok()) << name << ": " << plan.status().to_string();
      std::uint64_t published = 0, next = 0;
      for (const PlanLine& l : plan->lines) {
        if (l.kind != StateKind::kParameters || l.tier != params) continue;
        if (l.what.find("next version") != std::string::npos) {
          next += l.bytes;
        } else if (l.what.rfind("working parameters", 0) == 0 &&
                   l.what.find("resident") == std::string::npos) {
          published += l.bytes;
        }
      }
      EXPECT_GT(next, 0u) << name;
      EXPECT_EQ(next, published) << name << ": one next version of what the home holds";
      OffloadSettings plain = s;
      plain.delayed_update = false;
      auto without = OffloadPlan::make(c, plain);
      ASSERT_TRUE(without.ok()) << without.status().to_string();
      for (const PlanLine& l : without->lines) {
        EXPECT_EQ(l.what.find("next version"), std::string::npos) << name << ": " << l.what;
      }
    }
  }
}

// ---- Tensor and pipeline parallelism ------------------------------------------------------

// How a delayed run uses the world: one process (the reference), one tensor-parallel group, one
// pipeline, (4 ranks) the grid tensor 2 x pipeline 2, or (8 ranks) the whole grid tensor 2 x
// pipeline 2 x data 2 (make_process_groups), each data-parallel rank its share of the batch.
enum class Split { kNone, kTensor, kPipeline, kTensorPipeline, kGrid };

// `steps` steps of the deterministic batches of `c` (every rank the whole batch; on the whole
// grid each data-parallel rank its share), with a flush (synchronize) after `flush_after` steps
// when > 0; the state this rank holds afterwards (a pipeline stage: its own parameters, listed
// in `held`; one process: the parameters of `held` when given, else all).
Snapshot train_split(const TrainerConfig& c, const OffloadSettings& s, Split split, int steps, int flush_after,
                     std::vector<int>& held) {
  Snapshot out;
  auto device = testing::make_device();
  Comm* dp = nullptr;
  Comm* tp = split == Split::kTensor ? &world() : nullptr;
  Comm* pp = split == Split::kPipeline ? &world() : nullptr;
  Result<ProcessGroups> grid = failed_precondition("no grid");  // outlives the engine
  if (split == Split::kTensorPipeline || split == Split::kGrid) {
    grid = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, 2, 2);
    EXPECT_TRUE(grid.ok()) << grid.status().to_string();
    if (!grid.ok()) return out;
    tp = grid->tp.get();
    pp = grid->pp.get();
    if (split == Split::kGrid) dp = grid->dp.get();
  }
  const int dp_rank = dp != nullptr ? dp->rank() : 0, DP = dp != nullptr ? dp->size() : 1;
  TrainerConfig local = c;
  local.grad_accum = c.grad_accum / DP;
  auto engine = OffloadEngine::create(local, s, *device, nullptr, dp, tp, pp);
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  if (!engine.ok()) return out;
  for (int step = 0; step < steps; ++step) {
    const bool ran = dp != nullptr ? testing::run_share(**engine, c, dp_rank, DP, step + 1, out, step)
                                   : testing::run_steps(**engine, c, step, step + 1, out);
    if (!ran) return out;
    if (step + 1 == flush_after) {
      Status flushed = (*engine)->synchronize();
      EXPECT_TRUE(flushed.ok()) << flushed.to_string();
    }
  }
  if (split == Split::kPipeline || split == Split::kTensorPipeline || split == Split::kGrid) {
    EXPECT_TRUE(testing::capture_stage(**engine, out, held));
  } else if (split == Split::kNone && !held.empty()) {
    EXPECT_TRUE(testing::capture_held(**engine, held, out));
  } else {
    EXPECT_TRUE(testing::capture_state(**engine, out));
  }
  return out;
}

struct SplitCase {
  const char* name;
  ModelKind kind;
  DType dtype;
  std::int64_t accum;  // micro-batches per step (every rank the whole batch; the grid: the global batch)
  double clip;
  Tier params, optimizer;
  int warmup;
  int flush_after = 0;
  int stage = 0;  // ZeRO stage (over the data-parallel ranks of the grid)
};

// Every rank holds the same losses, norms and (tensor parallel: the full, gathered) state.
void expect_ranks_identical(const Snapshot& s, const std::string& what) {
  std::uint64_t h = testing::fnv(s.param);
  h = testing::fnv(s.master, h);
  h = testing::fnv(s.m, h);
  h = testing::fnv(s.v, h);
  h = testing::fnv({std::vector<float>(s.losses.begin(), s.losses.end()),
                    std::vector<float>(s.norms.begin(), s.norms.end())},
                   h);
  std::vector<std::uint64_t> all(static_cast<std::size_t>(world().size()));
  ASSERT_TRUE(world().all_gather(&h, all.data(), 2, DType::kF32).wait().ok());
  for (std::size_t r = 0; r < all.size(); ++r) EXPECT_EQ(all[r], all[0]) << what << ": rank " << r;
}

// The delayed run over the world (`split`) against one process's delayed run; also: the
// reference is really delayed (a tolerance comparison could not tell otherwise), and the split
// run learns.
void check_split(Split split, const SplitCase& c) {
  const int P = world().size();
  const std::string what = std::string(c.name) + (split == Split::kTensor     ? ", tp " + std::to_string(P)
                                                   : split == Split::kPipeline ? ", pp " + std::to_string(P)
                                                   : split == Split::kGrid     ? std::string(", tp 2 x pp 2 x dp 2")
                                                                               : std::string(", tp 2 x pp 2"));
  TrainerConfig config = testing::tiny(c.kind, c.dtype, c.accum, c.clip);
  OffloadSettings s;
  s.params = c.params;
  s.optimizer = c.optimizer;
  s.persistence_threshold = 0;  // every module's parameters at their home
  s.sub_group_size = 4097;      // several sub-groups per module on NVMe
  s.delayed_update = true;
  s.delayed_update_warmup = c.warmup;
  s.zero_stage = c.stage;
  testing::TempDir swap_split("strata-dpu-swap"), swap_one("strata-dpu-swap");  // each rank its own
  const bool nvme = c.params == Tier::kNvme || c.optimizer == Tier::kNvme;
  if (nvme) s.nvme_path = {swap_split.path().string()};
  constexpr int kSteps = 6;
  std::vector<int> held;
  const Snapshot got = train_split(config, s, split, kSteps, c.flush_after, held);
  ASSERT_EQ(got.losses.size(), static_cast<std::size_t>(kSteps)) << what;
  OffloadSettings one = s;
  if (nvme) one.nvme_path = {swap_one.path().string()};
  const Snapshot ref = train_split(config, one, Split::kNone, kSteps, c.flush_after, held);
  ASSERT_EQ(ref.losses.size(), static_cast<std::size_t>(kSteps)) << what;
  testing::Tolerance tol;  // fp32 tensor parallel (dist_compare.hpp)
  if (split == Split::kTensor) {
    expect_ranks_identical(got, what);
    testing::expect_close(ref, got, tol, what);
  } else if (split == Split::kTensorPipeline || split == Split::kGrid) {
    // Each stage's full (gathered) state within the tensor-parallel bounds; the pipeline adds no
    // rounding of its own (one micro-batch per rank). The grid's data-parallel ranks sum their
    // micro-batches' gradients in another order than one process (each rank's, then across the
    // ranks): the fp32 data-parallel rounding, orders of magnitude below these bounds
    // (test_dist_data_parallel.cpp, PipelineEngine.ComposedWithDataParallel: 2.4e-5 of each
    // quantity's scale at most).
    testing::expect_close(ref, got, tol, what);
  } else {
    testing::expect_same(ref, got, what);
  }
  // The delay is in effect: the steps up to warm-up + 1 are the ordinary run's (bit for bit in
  // one process); step warm-up + 2 computes at P[warm-up], not P[warm-up + 1], and so differs
  // from the ordinary step by more than the tolerance above.
  OffloadSettings ordinary = one;
  ordinary.delayed_update = false;
  testing::TempDir swap_ord("strata-dpu-swap");
  if (nvme) ordinary.nvme_path = {swap_ord.path().string()};
  std::vector<int> none;
  const std::size_t first_delayed = static_cast<std::size_t>(c.warmup) + 1;  // 0-based
  const Snapshot plain = train_split(config, ordinary, Split::kNone, static_cast<int>(first_delayed) + 1, 0, none);
  ASSERT_EQ(plain.losses.size(), first_delayed + 1) << what;
  for (std::size_t i = 0; i < first_delayed; ++i)
    EXPECT_EQ(plain.losses[i], ref.losses[i]) << what << ": step " << i + 1 << " is not delayed (warm-up)";
  EXPECT_GT(std::fabs(plain.losses[first_delayed] - ref.losses[first_delayed]),
            10 * tol.loss * std::fabs(ref.losses[first_delayed]))
      << what << ": step " << first_delayed + 1 << " should compute at the parameters before the previous update";
  // It learns: the last two steps' mean loss is below the first two's.
  EXPECT_LT(got.losses[kSteps - 1] + got.losses[kSteps - 2], got.losses[0] + got.losses[1])
      << what << ": the delayed run's loss did not fall";
  if (world().rank() == 0) {
    std::printf("%s: losses", what.c_str());
    for (double l : got.losses) std::printf(" %.5f", l);
    std::printf("\n");
  }
}

// Tensor parallel, fp32: the tolerances of test_dist_tensor_parallel.cpp (dist_compare.hpp's
// Tolerance defaults, set there from 3 ordinary steps with at least 5x headroom). Measured over
// these 6 delayed steps on 2 ranks (printed by rank 0): loss 8.6e-7 relative, norm 7.0e-6,
// parameters rms 1.1e-6 and max 1.9e-4, moments rms 6.5e-7 and max 3.7e-5 of their scale, so the
// defaults still hold at least 9x headroom. Computing a step at the wrong version (not delayed,
// or delayed by more) moves its loss by more than 10x the loss bound: the delay check in
// check_split requires that of the delayed and the ordinary one-process runs.
TEST(DelayedUpdateTensorParallel, Gpt2ParamsOnHostAccumulationClippingWarmup1) {
  ASSERT_EQ(world().size(), 2) << "run under mpirun -np 2";
  check_split(Split::kTensor, {"gpt2 fp32, params and optimizer on host, accumulation 2, clip 0.5, warm-up 1",
                               ModelKind::kGpt2, DType::kF32, 2, 0.5, Tier::kHost, Tier::kHost, 1});
}

TEST(DelayedUpdateTensorParallel, LlamaNvmeOptimizerParamsOnNvmeWithFlush) {
  ASSERT_EQ(world().size(), 2) << "run under mpirun -np 2";
  check_split(Split::kTensor, {"llama fp32, params and optimizer on NVMe, clip 1, warm-up 0, a flush after step 3",
                               ModelKind::kLlama, DType::kF32, 1, 1.0, Tier::kNvme, Tier::kNvme, 0, 3});
}

TEST(DelayedUpdateTensorParallel, Gpt2ParamsOnDeviceWarmup0) {
  ASSERT_EQ(world().size(), 2) << "run under mpirun -np 2";
  check_split(Split::kTensor, {"gpt2 fp32, params on the device, optimizer on host, clip 1, warm-up 0",
                               ModelKind::kGpt2, DType::kF32, 1, 1.0, Tier::kDevice, Tier::kHost, 0});
}

// A pipeline of 2 stages: bit for bit against one process (see the file comment).
TEST(DelayedUpdatePipeline, Gpt2TiedEmbeddingParamsOnHostWarmup1) {
  ASSERT_EQ(world().size(), 2) << "run under mpirun -np 2";
  // One micro-batch: the tied embedding's gradient is e + h in both runs.
  check_split(Split::kPipeline, {"gpt2 fp32, params and optimizer on host, clip 1, warm-up 1", ModelKind::kGpt2,
                                 DType::kF32, 1, 1.0, Tier::kHost, Tier::kHost, 1});
}

TEST(DelayedUpdatePipeline, LlamaNvmeOptimizerParamsOnNvmeMicroBatchesWithFlush) {
  ASSERT_EQ(world().size(), 2) << "run under mpirun -np 2";
  // The NVMe optimizer: the stages agree on each update (defer_marks) before the next call.
  check_split(Split::kPipeline,
              {"llama fp32, params and optimizer on NVMe, 2 micro-batches, clip 1, warm-up 0, a flush after step 3",
               ModelKind::kLlama, DType::kF32, 2, 1.0, Tier::kNvme, Tier::kNvme, 0, 3});
}

TEST(DelayedUpdatePipeline, LlamaBf16ParamsOnDeviceMicroBatches) {
  ASSERT_EQ(world().size(), 2) << "run under mpirun -np 2";
  check_split(Split::kPipeline, {"llama bf16, params on the device, optimizer on host, 2 micro-batches, warm-up 0",
                                 ModelKind::kLlama, DType::kBF16, 2, 1.0, Tier::kDevice, Tier::kHost, 0});
}

// The grid tensor 2 x pipeline 2 on 4 ranks (dist.offload_dpu_grid.np4): every stage a tensor
// group of shard engines, each rank delaying its shard of its stage's units; GPT-2 with one
// micro-batch (the tied embedding's shard on both ends of each pipeline), against one process
// within the tensor-parallel bounds.
TEST(DelayedUpdateGrid, TensorTimesPipelineGpt2ParamsOnHostWarmup1) {
  ASSERT_EQ(world().size(), 4) << "run under mpirun -np 4";
  check_split(Split::kTensorPipeline, {"gpt2 fp32, params and optimizer on host, clip 1, warm-up 1", ModelKind::kGpt2,
                                       DType::kF32, 1, 1.0, Tier::kHost, Tier::kHost, 1});
}

// The whole grid tensor 2 x pipeline 2 x data 2 on 8 ranks (dist.offload_dpu_grid.np8): each
// stage's tensor ranks delay their shard's update, each data-parallel pair its slices of it
// (ZeRO 2: the gradients reduce-scattered, the next version all-gathered before it is
// published). Against one process running the same global batch of 2 micro-batches with the
// delayed update, within the tensor-parallel bounds (the data-parallel sums add fp32 rounding far
// below them; see check_split). GPT-2 (its tied embedding on both stages), the parameters on
// NVMe (the next version written to each rank's swap file), warm-up 1, a flush after step 3.
TEST(DelayedUpdateGridFull, TensorTimesPipelineTimesDataGpt2ParamsOnNvmeStage2) {
  ASSERT_EQ(world().size(), 8) << "run under mpirun -np 8";
  SplitCase k{"gpt2 fp32, params on NVMe, optimizer on host, ZeRO 2, 2 micro-batches, clip 1, warm-up 1, "
              "a flush after step 3",
              ModelKind::kGpt2, DType::kF32, 2, 1.0, Tier::kNvme, Tier::kHost, 1, 3};
  k.stage = 2;
  check_split(Split::kGrid, k);
}

}  // namespace
}  // namespace strata
