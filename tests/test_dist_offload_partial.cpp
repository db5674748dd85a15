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

// Steps [0, steps); then the full state (collective).
Snapshot train_share(const TrainerConfig& global, const OffloadSettings& s, int steps) {
  Snapshot out;
  auto device = testing::make_device();
  auto engine = OffloadEngine::create(local_of(global), s, *device, nullptr, &world());
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  if (!engine.ok()) return out;
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
};

// Stages 1 and 2, accumulation 2 per rank, clipping on: bit for bit ratio 1 on the same ranks.
void check(const Case& k) {
  const int P = world().size();
  const TrainerConfig global = testing::tiny(k.kind, k.dtype, 2 * P, 0.5);
  const std::uint32_t kdev = device_modules(local_of(global), k.ratio);
  ASSERT_GT(kdev, 0u) << "ratio " << k.ratio << " keeps no module on the device";
  for (int stage : {1, 2}) {
    const std::string what = std::string(k.kind == ModelKind::kGpt2 ? "GPT-2" : "LLaMA") + " " +
                             std::string(to_string(k.dtype)) + ", stage " + std::to_string(stage) +
                             ", ratio " + std::to_string(k.ratio) + " (" + std::to_string(kdev) +
                             " modules on the device), " + std::to_string(P) + " ranks";
    constexpr int kSteps = 3;
    const Snapshot ref = train_share(global, host_sharded(stage, 1.0), kSteps);
    const Snapshot got = train_share(global, host_sharded(stage, k.ratio), kSteps);
    testing::expect_same(ref, got, what);
    EXPECT_NE(ref.losses.front(), ref.losses.back()) << what << ": the run trained";
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
TEST(PartialOffloadDataParallel, CheckpointsMoveBetweenTheSplitAndRatioOne) {
  const int P = world().size();
  const TrainerConfig global = testing::tiny(ModelKind::kGpt2, DType::kBF16, 2 * P, 0.5);
  const OffloadSettings split = host_sharded(2, 0.5), whole = host_sharded(2, 1.0);
  const Snapshot straight = train_share(global, whole, 4);
  for (const bool split_first : {true, false}) {
    const std::string root = testing::shared_temp_dir("partial-ckpt");
    const std::string what =
        split_first ? "saved at ratio 0.5, resumed at ratio 1" : "saved at ratio 1, resumed at 0.5";
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
      auto device = testing::make_device();
      auto engine =
          OffloadEngine::create(local_of(global), split_first ? whole : split, *device, nullptr, &world());
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

// What is not built stays refused, naming the key and what to use instead.
TEST(PartialOffloadDataParallel, RefusedWhereNotBuilt) {
  auto refused = [](OffloadSettings s, const std::string& want) {
    s.dp_size = world().size();
    Status e = s.validate();
    EXPECT_FALSE(e.ok()) << want;
    EXPECT_NE(e.message().find("zero_optimization.offload_optimizer.ratio"), std::string::npos)
        << e.message();
    EXPECT_NE(e.message().find("data-parallel ranks"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find(want), std::string::npos) << e.message();
  };
  refused(host_sharded(3, 0.5), "stage 3");
  OffloadSettings nvme = host_sharded(2, 0.5);
  nvme.optimizer = Tier::kNvme;
  nvme.nvme_path = {"nvme"};  // validate touches no disk
  nvme.io.nvme_path = nvme.nvme_path;
  refused(nvme, "nvme");
  OffloadSettings params = host_sharded(2, 0.5);
  params.params = Tier::kHost;
  refused(params, "offload_param.device");
  OffloadSettings dpu = host_sharded(2, 0.5);
  dpu.delayed_update = true;
  Status e = [&] {
    dpu.dp_size = world().size();
    return dpu.validate();
  }();
  EXPECT_FALSE(e.ok());
  EXPECT_NE(e.message().find("strata.delayed_update"), std::string::npos) << e.message();
  for (int stage : {0, 1, 2}) {
    OffloadSettings ok = host_sharded(stage, 0.5);
    ok.dp_size = world().size();
    EXPECT_TRUE(ok.validate().ok()) << "stage " << stage;
  }
}

}  // namespace
}  // namespace strata
