// Partial optimizer offload (zero_optimization.offload_optimizer.ratio < 1) with data parallelism,
// on real processes: run by tests/mpi_run.sh under `mpirun -np N` (tests/CMakeLists.txt, 2 and 3
// ranks; 3: chunks that do not divide the units evenly). docs/offload.md "Partial optimizer
// offload", "Data parallel".
//
// What is compared, and how exactly: every rank trains its share of one global batch twice on the
// same ranks and stage, once at ratio 1 (every unit's state sharded over the ranks' host memory)
// and once with the first modules' state on the device. The split changes where a unit's slice
// is reduced, scanned and updated, not the arithmetic: the same reduce-scatter call on the same
// zero-padded unit, the same fp32 additions of the micro-batches' slices (stage 2), the same scan
// of the same slice, the statistics merged unit by unit in rank order, the same per-parameter
// cuts of the slice through the same Adam kernels. So losses, norms, every working parameter,
// master and moment are compared bit for bit (testing::expect_same), no tolerance.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "comm_environment.hpp"
#include "dist_compare.hpp"
#include "offload/internal.hpp"
#include "offload_fixture.hpp"
#include "strata/parallel.hpp"

namespace strata {
namespace {

using testing::local_of;
using testing::Snapshot;
using testing::world;

// fp16: a first loss scale of 2^24 overflows the tiny GPT-2's first steps (the reference run
// checks it). Measured on 2 ranks: batches 0-3 overflow at 2^24 down to 2^21, batches 4 and 5
// apply at 2^20 (2^16 overflows nothing): 6 steps see both.
constexpr int kOverflowScalePower = 24;

// Steps [from, to) of the global batch, this rank's share.
bool run_share(OffloadEngine& engine, const TrainerConfig& global, int from, int to, Snapshot& out) {
  std::vector<std::int32_t> in, tg;
  for (int step = from; step < to; ++step) {
    testing::share(global, step, in, tg);
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

// What an engine's plan put where: the device's exp_avg region, and the NVMe optimizer's state.
struct PlanBytes {
  std::uint64_t exp_avg_device = 0, nvme_state = 0;
  std::uint64_t param_slices = 0;  // stage 3: this rank's slices of the parameters at their home
};

// Steps [0, steps); then the full state (collective).
Snapshot train_share(const TrainerConfig& global, const OffloadSettings& s, int steps, PlanBytes* bytes = nullptr) {
  Snapshot out;
  auto device = testing::make_device();
  auto engine = OffloadEngine::create(local_of(global), s, *device, nullptr, &world());
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  if (!engine.ok()) return out;
  if (bytes != nullptr) {
    for (const PlanLine& l : (*engine)->plan().lines) {
      if (l.what.rfind("device region optim.exp_avg ", 0) == 0) bytes->exp_avg_device += l.bytes;
      if (l.what.rfind("fp32 master + exp_avg + exp_avg_sq", 0) == 0 && l.tier == Tier::kNvme)
        bytes->nvme_state += l.bytes;
      if (l.what.rfind("working parameters (this rank's 1/", 0) == 0 && l.tier != Tier::kDevice)
        bytes->param_slices += l.bytes;
    }
  }
  if (!run_share(**engine, global, 0, steps, out)) return out;
  testing::capture_state(**engine, out);
  return out;
}

OffloadSettings host_sharded(int stage, double ratio) {
  OffloadSettings s;
  s.optimizer = Tier::kHost;
  s.zero_stage = stage;
  s.optimizer_ratio = ratio;
  return s;
}

// The modules the device keeps at `ratio` (the plan's split; the same on every rank).
std::uint32_t device_modules(const TrainerConfig& c, double ratio) {
  auto layout = describe_model(c.model);
  EXPECT_TRUE(layout.ok());
  if (!layout.ok()) return 0;
  OffloadSettings s = host_sharded(1, ratio);
  s.dp_size = world().size();
  return offload_detail::describe_units(*layout, s).device_opt_units;
}

struct Case {
  ModelKind kind;
  DType dtype;
  double ratio;
  Tier params = Tier::kDevice;     // offload_param.device
  Tier optimizer = Tier::kHost;    // offload_optimizer.device (the host part's)
  Tier gradients = Tier::kHost;    // strata.offload_gradients (the host units')
  std::vector<int> stages = {1, 2};
  // fp16: > 0 starts at this loss scale power with no growth, so that the first step overflows
  // (checked on the reference run: a skipped step, then applied ones).
  int overflow_scale_power = 0;
};

// A case of the host part's placement (params, optimizer, gradients) at ratio 0.5.
Case placed(ModelKind kind, DType dtype, Tier params, Tier optimizer, Tier gradients = Tier::kHost,
            std::vector<int> stages = {1, 2}) {
  Case k{kind, dtype, 0.5};
  k.params = params;
  k.optimizer = optimizer;
  k.gradients = gradients;
  k.stages = std::move(stages);
  return k;
}

// The placement of a case at `stage` and `ratio`, its NVMe files (if any) under `swap`.
OffloadSettings settings_of(const Case& k, int stage, double ratio, const testing::TempDir& swap) {
  OffloadSettings s = host_sharded(stage, ratio);
  s.params = k.params;
  s.optimizer = k.optimizer;
  s.gradients = k.gradients;
  s.persistence_threshold = 0;  // every module off the device moves
  if (k.params == Tier::kNvme || k.optimizer == Tier::kNvme || k.gradients == Tier::kNvme) {
    s.nvme_path = {swap.path().string()};
    s.io.nvme_path = s.nvme_path;
    s.sub_group_size = 4097;  // sub-groups that cut units: the ring indexes the host units only
  }
  return s;
}

// Accumulation 2 per rank, clipping on: bit for bit ratio 1 on the same ranks and stage, in the
// same placement (parameters, optimizer and gradient tiers).
void check(const Case& k) {
  const int P = world().size();
  TrainerConfig global = testing::tiny(k.kind, k.dtype, 2 * P, 0.5);
  if (k.overflow_scale_power > 0) {
    global.loss_scaling.initial_scale_power = k.overflow_scale_power;
    global.loss_scaling.loss_scale_window = 1000;
  }
  const std::uint32_t kdev = device_modules(local_of(global), k.ratio);
  ASSERT_GT(kdev, 0u) << "ratio " << k.ratio << " keeps no module on the device";
  for (int stage : k.stages) {
    const std::string what = std::string(k.kind == ModelKind::kGpt2 ? "GPT-2" : "LLaMA") + " " +
                             std::string(to_string(k.dtype)) + ", stage " + std::to_string(stage) +
                             ", ratio " + std::to_string(k.ratio) + " (" + std::to_string(kdev) +
                             " modules on the device), params " + std::string(to_string(k.params)) +
                             ", optimizer " + std::string(to_string(k.optimizer)) + ", gradients " +
                             std::string(to_string(k.gradients)) + ", " + std::to_string(P) + " ranks";
    const int kSteps = k.overflow_scale_power > 0 ? 6 : 3;
    testing::TempDir swap_ref("strata-partdp-ref"), swap_got("strata-partdp-got");  // each rank its own
    PlanBytes ref_bytes, got_bytes;
    const Snapshot ref = train_share(global, settings_of(k, stage, 1.0, swap_ref), kSteps, &ref_bytes);
    const Snapshot got = train_share(global, settings_of(k, stage, k.ratio, swap_got), kSteps, &got_bytes);
    // The engine split its state: the device modules' moments on the device (this rank's
    // slices), and with the NVMe optimizer only the host modules' slices on NVMe.
    EXPECT_EQ(ref_bytes.exp_avg_device, 0u) << what;
    EXPECT_GT(got_bytes.exp_avg_device, 0u) << what;
    if (stage == 3 && k.params != Tier::kDevice) {
      // Stage 3: the host modules' parameters sliced at their home, fewer than ratio 1's (the
      // device modules' are resident and whole).
      EXPECT_GT(got_bytes.param_slices, 0u) << what;
      EXPECT_LT(got_bytes.param_slices, ref_bytes.param_slices) << what;
    }
    if (k.optimizer == Tier::kNvme) {
      EXPECT_GT(got_bytes.nvme_state, 0u) << what;
      EXPECT_LT(got_bytes.nvme_state, ref_bytes.nvme_state) << what << ": the host modules' slices only";
    }
    testing::expect_same(ref, got, what);
    ASSERT_FALSE(ref.losses.empty()) << what;
    EXPECT_NE(ref.losses.front(), ref.losses.back()) << what << ": the run trained";
    if (k.overflow_scale_power > 0) {
      // The forced overflow: the first step skipped (every unit, the device units too, on every
      // rank: expect_same compared the state), and the lowered scale lets later steps apply.
      EXPECT_EQ(ref.skipped.front(), 1) << what << ": the first step overflows";
      EXPECT_GE(std::count(ref.skipped.begin(), ref.skipped.end(), 0), 1) << what << ": a step applied";
    }
  }
}

TEST(PartialOffloadDataParallel, Fp32MatchesRatioOneBitForBit) {
  check({ModelKind::kGpt2, DType::kF32, 0.5});
}

TEST(PartialOffloadDataParallel, Bf16MatchesRatioOneBitForBit) {
  check({ModelKind::kGpt2, DType::kBF16, 0.5});
}

// Every module's state on the device (the host optimizer thread updates nothing) and LLaMA's
// untied head.
TEST(PartialOffloadDataParallel, EveryModuleOnTheDeviceLlamaBf16) {
  check({ModelKind::kLlama, DType::kBF16, 0.01});
}

// fp16: the loss scale and the skipped steps (an overflow skips the device units on every rank,
// as ratio 1 skips every unit).
TEST(PartialOffloadDataParallel, Fp16SkipsAlikeBitForBit) { check({ModelKind::kGpt2, DType::kF16, 0.2}); }

// ---- the host part off host memory, the parameters off the device (PartialOffloadDpTiers) ----
// The host units take ratio 1's sharded path in each placement unchanged (the NVMe ring over
// their slices, their parameters fetched from their home); the device units keep their
// parameters resident and take the sharded device path above. Bit for bit ratio 1 in the same
// placement on the same ranks.

// The NVMe optimizer: the host units' slices of [master | m | v] stream through the ring in
// sub-groups of 4097 elements; with the host units' reduced gradient slices on NVMe too.
TEST(PartialOffloadDpTiers, NvmeOptimizerFp32) {
  check(placed(ModelKind::kGpt2, DType::kF32, Tier::kDevice, Tier::kNvme));
}
TEST(PartialOffloadDpTiers, NvmeOptimizerBf16) {
  check(placed(ModelKind::kGpt2, DType::kBF16, Tier::kDevice, Tier::kNvme));
}
TEST(PartialOffloadDpTiers, NvmeOptimizerAndGradientsBf16) {
  check(placed(ModelKind::kGpt2, DType::kBF16, Tier::kDevice, Tier::kNvme, Tier::kNvme));
}
// The parameters on the host and on NVMe: the device modules resident, the others fetched.
TEST(PartialOffloadDpTiers, ParametersOnTheHostBf16) {
  check(placed(ModelKind::kGpt2, DType::kBF16, Tier::kHost, Tier::kHost));
}
TEST(PartialOffloadDpTiers, ParametersOnTheHostFp32) {
  check(placed(ModelKind::kGpt2, DType::kF32, Tier::kHost, Tier::kHost));
}
TEST(PartialOffloadDpTiers, ParametersAndOptimizerOnNvmeBf16) {
  check(placed(ModelKind::kGpt2, DType::kBF16, Tier::kNvme, Tier::kNvme));
}
// ---- other models and dtypes off the device (PartialOffloadDpModels) ----
// LLaMA (untied head, grouped-query attention) with the parameters on the host, and on NVMe with
// the NVMe optimizer and gradients.
TEST(PartialOffloadDpModels, LlamaParametersOnTheHostBf16) {
  check(placed(ModelKind::kLlama, DType::kBF16, Tier::kHost, Tier::kHost, Tier::kHost, {2}));
}
TEST(PartialOffloadDpModels, LlamaEverythingOnNvmeFp32) {
  check(placed(ModelKind::kLlama, DType::kF32, Tier::kNvme, Tier::kNvme, Tier::kNvme, {1}));
}
// fp16 with a forced overflow (the first step's scale far too large): the skip and the lowered
// scale alike with the split, the parameters on the host, and on NVMe with the NVMe optimizer.
TEST(PartialOffloadDpModels, Fp16OverflowParametersOnTheHost) {
  Case k = placed(ModelKind::kGpt2, DType::kF16, Tier::kHost, Tier::kHost, Tier::kHost, {2});
  k.overflow_scale_power = kOverflowScalePower;
  check(k);
}
TEST(PartialOffloadDpModels, Fp16OverflowEverythingOnNvme) {
  Case k = placed(ModelKind::kGpt2, DType::kF16, Tier::kNvme, Tier::kNvme, Tier::kNvme, {1});
  k.overflow_scale_power = kOverflowScalePower;
  check(k);
}

// ---- stage 3 (PartialOffloadDpStage3) ----------------------------------------------------------
// The device units' working parameters stay whole and resident on every rank at stage 3 (their
// update writes them in place and all-gathers the slices, as at stages 1-2); the host units take
// ratio 1's stage 3 path (their parameters sliced at their home, gathered by the fetch). Their
// gradients are reduced after every micro-batch as at stage 2. Bit for bit ratio 1 at stage 3.

// The units of the split at stage 3: the device modules resident (home device), the others at
// the parameters' home.
void expect_device_modules_resident(const Case& k) {
  auto layout = describe_model(local_of(testing::tiny(k.kind, k.dtype, 2 * world().size(), 0.5)).model);
  ASSERT_TRUE(layout.ok());
  OffloadSettings s = host_sharded(3, k.ratio);
  s.params = k.params;
  s.persistence_threshold = 0;  // as settings_of: every module off the device moves
  s.dp_size = world().size();
  const offload_detail::Units u = offload_detail::describe_units(*layout, s, world().rank());
  ASSERT_GT(u.device_opt_units, 0u);
  for (std::size_t m = 0; m < u.device_opt.size(); ++m) {
    if (u.device_opt[m]) {
      EXPECT_EQ(u.home[m], Tier::kDevice) << "module " << m << ": a device module stays resident";
    } else if (u.pbytes[m] > 0) {
      EXPECT_EQ(u.home[m], k.params) << "module " << m << ": a host module at the parameters' home";
    }
  }
}

TEST(PartialOffloadDpStage3, ParametersOnTheDeviceFp32) {
  check(placed(ModelKind::kGpt2, DType::kF32, Tier::kDevice, Tier::kHost, Tier::kHost, {3}));
}
TEST(PartialOffloadDpStage3, ParametersOnTheHostBf16) {
  const Case k = placed(ModelKind::kGpt2, DType::kBF16, Tier::kHost, Tier::kHost, Tier::kHost, {3});
  expect_device_modules_resident(k);
  check(k);
}
TEST(PartialOffloadDpStage3, ParametersAndOptimizerOnNvmeFp32) {
  const Case k = placed(ModelKind::kGpt2, DType::kF32, Tier::kNvme, Tier::kNvme, Tier::kHost, {3});
  expect_device_modules_resident(k);
  check(k);
}

// The device regions of the device modules' state are this rank's 1/N of one process's split
// (the plan's lines, and the arena bytes the engine carved), beside the staging of their
// collectives and, stage 2, their reduced slices; their gradients stay whole.
TEST(PartialOffloadDataParallel, DeviceStateIsOneSlicePerRank) {
  const int P = world().size();
  const auto Pu = static_cast<std::uint64_t>(P);
  const TrainerConfig global = testing::tiny(ModelKind::kGpt2, DType::kBF16, P, 0.0);
  const TrainerConfig local = local_of(global);
  auto bytes_of = [](const OffloadPlan& p, const std::string& prefix) {
    std::uint64_t b = 0;
    for (const PlanLine& l : p.lines)
      if (l.what.rfind(prefix, 0) == 0 && l.tier == Tier::kDevice) b += l.bytes;
    return b;
  };
  auto exact = [](const OffloadPlan& p, const std::string& what) {
    std::uint64_t b = 0;
    for (const PlanLine& l : p.lines)
      if (l.what == what && l.tier == Tier::kDevice) b += l.bytes;
    return b;
  };
  for (int stage : {1, 2}) {
    const OffloadSettings s = host_sharded(stage, 0.5);
    // One process with the same split: its arena and plan.
    std::uint64_t live_one = 0;
    {
      auto device = testing::make_device();
      auto engine = OffloadEngine::create(local, s, *device);
      ASSERT_TRUE(engine.ok()) << engine.status().to_string();
      live_one = device->memory().stats().live_bytes;
    }
    OffloadSettings one = s;
    one.dp_size = 1;
    auto single = OffloadPlan::make(local, one);
    ASSERT_TRUE(single.ok()) << single.status().to_string();
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(local, s, *device, nullptr, &world());
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    const OffloadPlan& plan = (*engine)->plan();
    std::uint64_t saved = 0;
    for (const char* region : {"optim.master", "optim.exp_avg", "optim.exp_avg_sq"}) {
      const std::string line = std::string("device region ") + region + " ";
      // One process names the region alone; N ranks add "(this rank's 1/N) (modules 0..k-1)".
      const std::uint64_t full = exact(*single, std::string("device region ") + region),
                          mine = bytes_of(plan, line + "(this rank's 1/");
      EXPECT_GT(full, 0u) << region;
      EXPECT_EQ(bytes_of(plan, line), mine) << region << ": every line of it is this rank's";
      // Rank 0's slices (the largest): one chunk per module, rounded up to 64 elements.
      EXPECT_LE(mine, full / Pu + 64u * 4u * 8u) << region << ": one slice plus rounding per module";
      EXPECT_GE(mine, full / Pu) << region;
      saved += full - mine;
    }
    const std::uint64_t staging = bytes_of(plan, "device region offload.dp_staging");
    const std::uint64_t slices = bytes_of(plan, "device region offload.grad_slices");
    EXPECT_GT(staging, 0u);
    if (stage >= 2) {
      EXPECT_EQ(slices, bytes_of(plan, "device region optim.exp_avg_sq ")) << "one fp32 slice per element";
    } else {
      EXPECT_EQ(slices, 0u) << "stage 1 reduces in place";
    }
    EXPECT_EQ(bytes_of(plan, "device region offload.grads ("), exact(*single, "device region offload.grads"))
        << "the device modules' gradients stay whole";
    // Every rank carves its own slices (rank 0's the largest): at most the plan's bytes.
    const auto got = static_cast<double>(device->memory().stats().live_bytes + saved);
    const auto want = static_cast<double>(live_one + staging + slices);
    if (world().rank() == 0) {
      EXPECT_NEAR(got, want, 6 * 256.0) << "stage " << stage << " (each carved block rounds to 256 bytes)";
    } else {
      EXPECT_LE(got, want + 6 * 256.0) << "stage " << stage;
    }
    EXPECT_LT(plan.device_bytes, single->device_bytes + staging + slices);
    // The host keeps this rank's slices of the other modules only.
    EXPECT_LT(plan.pinned_bytes + plan.host_bytes, single->pinned_bytes + single->host_bytes);
  }
}

// A checkpoint written with the split (the device slices gathered over the ranks) resumes at ratio
// 1 and the other way round, bit for bit the straight run: the files are the placement's whole
// state, each rank keeping its slices on load.
void check_checkpoint(const Case& k, int stage) {
  const int P = world().size();
  const TrainerConfig global = testing::tiny(k.kind, k.dtype, 2 * P, 0.5);
  testing::TempDir swap_straight("strata-partdp-ckpt-a");  // each rank its own
  const Snapshot straight = train_share(global, settings_of(k, stage, 1.0, swap_straight), 4);
  ASSERT_EQ(straight.losses.size(), 4u);
  for (const bool split_first : {true, false}) {
    // A swap store per engine: each sizes its files by its own placement.
    testing::TempDir swap_first("strata-partdp-ckpt-b"), swap_second("strata-partdp-ckpt-c");
    const std::string root = testing::shared_temp_dir("partial-ckpt");
    const std::string what = std::string(split_first ? "saved at the split, resumed at ratio 1"
                                                     : "saved at ratio 1, resumed at the split") +
                             ", stage " + std::to_string(stage) + ", params " + std::string(to_string(k.params)) +
                             ", optimizer " + std::string(to_string(k.optimizer));
    const OffloadSettings split = settings_of(k, stage, k.ratio, swap_first),
                          whole = settings_of(k, stage, 1.0, swap_first);
    Snapshot got;
    {
      auto device = testing::make_device();
      auto engine =
          OffloadEngine::create(local_of(global), split_first ? split : whole, *device, nullptr, &world());
      ASSERT_TRUE(engine.ok()) << engine.status().to_string();
      ASSERT_TRUE(run_share(**engine, global, 0, 2, got));
      auto saved = (*engine)->save_checkpoint(root, "{}", 1);
      ASSERT_TRUE(saved.ok()) << saved.status().to_string();
    }
    {
      const OffloadSettings split2 = settings_of(k, stage, k.ratio, swap_second),
                            whole2 = settings_of(k, stage, 1.0, swap_second);
      auto device = testing::make_device();
      auto engine =
          OffloadEngine::create(local_of(global), split_first ? whole2 : split2, *device, nullptr, &world());
      ASSERT_TRUE(engine.ok()) << engine.status().to_string();
      auto m = (*engine)->load_checkpoint(root);
      ASSERT_TRUE(m.ok()) << m.status().to_string();
      EXPECT_EQ(m->step, 2);
      ASSERT_TRUE(run_share(**engine, global, 2, 4, got));
      ASSERT_TRUE(testing::capture_state(**engine, got));
    }
    testing::expect_same(straight, got, what);
    ASSERT_TRUE(world().barrier().wait().ok());
    if (world().rank() == 0) std::filesystem::remove_all(root);
  }
}

TEST(PartialOffloadDataParallel, CheckpointsMoveBetweenTheSplitAndRatioOne) {
  check_checkpoint(Case{ModelKind::kGpt2, DType::kBF16, 0.5}, 2);
}

// Stage 3 with the parameters on the host and the NVMe optimizer: the host modules' slices read
// from their homes and the ring, the device modules' from the device.
TEST(PartialOffloadDpStage3, CheckpointsWithTheParametersOnTheHostAndTheNvmeOptimizer) {
  check_checkpoint(placed(ModelKind::kGpt2, DType::kBF16, Tier::kHost, Tier::kNvme), 3);
}

// What is not built stays refused, naming the key (the delayed update; the cuda backend is refused
// at engine creation), and what is built validates.
TEST(PartialOffloadDataParallel, RefusedWhereNotBuilt) {
  // Built: a pipeline with data-parallel ranks per stage at stage 3 (test_dist_partial_compose).
  OffloadSettings piped = host_sharded(3, 0.5);
  piped.pipeline_bounds = {0, 2, 5};
  piped.dp_size = world().size();
  EXPECT_TRUE(piped.validate().ok()) << piped.validate().to_string();
  OffloadSettings dpu = host_sharded(2, 0.5);
  dpu.delayed_update = true;
  Status e = [&] {
    dpu.dp_size = world().size();
    return dpu.validate();
  }();
  EXPECT_FALSE(e.ok());
  EXPECT_NE(e.message().find("strata.delayed_update"), std::string::npos) << e.message();
  EXPECT_NE(e.message().find("zero_optimization.offload_optimizer.ratio"), std::string::npos) << e.message();
  for (int stage : {0, 1, 2, 3}) {
    OffloadSettings ok = host_sharded(stage, 0.5);
    ok.dp_size = world().size();
    EXPECT_TRUE(ok.validate().ok()) << "stage " << stage;
    // Built: the NVMe optimizer and gradients, the parameters on the host or NVMe.
    OffloadSettings nvme = ok;
    nvme.optimizer = Tier::kNvme;
    nvme.gradients = Tier::kNvme;
    nvme.params = Tier::kNvme;
    nvme.nvme_path = {"nvme"};  // validate touches no disk
    nvme.io.nvme_path = nvme.nvme_path;
    const Status st = nvme.validate();
    EXPECT_TRUE(st.ok()) << "stage " << stage << ": " << st.to_string();
  }
}

}  // namespace
}  // namespace strata
