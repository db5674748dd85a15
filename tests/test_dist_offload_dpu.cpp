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
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace strata
