// Partial optimizer offload (zero_optimization.offload_optimizer.ratio < 1, docs/offload.md
// "Partial optimizer offload"): the first modules keep gradients, masters and moments on the
// device and are updated there; the rest as with the host optimizer. Every split trains to the
// same bits as the all-device run and the all-host run on the cpu backend: the device units are
// scanned with the same per-unit gradient scan, merged in unit order with the host units', and
// updated by the same CPU Adam on the same elements. With the optimizer on NVMe the host part
// streams through the NVMe ring (sub-groups, NVMe gradients) and the device part is unchanged.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "harness/harness.hpp"
#include "offload/internal.hpp"
#include "offload_fixture.hpp"
#include "strata/model.hpp"
#include "strata/config.hpp"
#include "strata/offload.hpp"

namespace strata::testing {
namespace {

struct PartialCase {
  ModelKind kind;
  DType dtype;
  std::int64_t accum;
  double clip;
};

OffloadSettings partial(double ratio) {
  OffloadSettings s;
  s.optimizer = Tier::kHost;
  s.optimizer_ratio = ratio;
  return s;
}

std::uint64_t plan_bytes(const OffloadPlan& p, const std::string& prefix) {
  std::uint64_t b = 0;
  for (const PlanLine& l : p.lines)
    if (l.what.rfind(prefix, 0) == 0) b += l.bytes;
  return b;
}

// gtest prints the case with its name (not the struct's bytes, padding included).
void PrintTo(const PartialCase& k, std::ostream* os) {
  *os << (k.kind == ModelKind::kGpt2 ? "gpt2" : "llama") << " " << to_string(k.dtype) << " accum " << k.accum
      << " clip " << k.clip;
}

class PartialOffload : public ::testing::TestWithParam<PartialCase> {};

TEST_P(PartialOffload, EverySplitMatchesTheAllDeviceAndAllHostRunsBitForBit) {
  const PartialCase k = GetParam();
  const TrainerConfig c = tiny(k.kind, k.dtype, k.accum, k.clip);
  constexpr int kSteps = 3;
  const Snapshot device = train(c, OffloadSettings{}, kSteps);
  const Snapshot host = train(c, partial(1.0), kSteps);
  expect_same(device, host, "ratio 1 (all on the host)");
  // Splits that keep 1, 2 and every but the last module on the device (tiny's modules: the
  // embedding, 3 blocks, the head).
  std::set<std::uint32_t> splits;
  for (double ratio : {0.9, 0.5, 0.2, 0.01}) {
    auto plan = OffloadPlan::make(c, partial(ratio));
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    const Snapshot got = train(c, partial(ratio), kSteps);
    expect_same(device, got, "ratio " + std::to_string(ratio));
    splits.insert(static_cast<std::uint32_t>(plan_bytes(*plan, "device region optim.exp_avg_sq")));
  }
  EXPECT_GE(splits.size(), 3u) << "the ratios should give different splits";
}

INSTANTIATE_TEST_SUITE_P(Matrix, PartialOffload,
                         ::testing::Values(PartialCase{ModelKind::kGpt2, DType::kF32, 1, 0.0},
                                           PartialCase{ModelKind::kGpt2, DType::kBF16, 2, 1.0},
                                           PartialCase{ModelKind::kLlama, DType::kBF16, 1, 0.5},
                                           PartialCase{ModelKind::kLlama, DType::kF32, 2, 0.0},
                                           PartialCase{ModelKind::kGpt2, DType::kF16, 2, 1.0},
                                           PartialCase{ModelKind::kLlama, DType::kF16, 1, 0.0}),
                         [](const ::testing::TestParamInfo<PartialCase>& info) {
                           const PartialCase& k = info.param;
                           return std::string(k.kind == ModelKind::kGpt2 ? "Gpt2" : "Llama") + "_" +
                                  std::string(to_string(k.dtype)) + "_accum" + std::to_string(k.accum) +
                                  (k.clip > 0 ? "_clip" : "");
                         });

// The plan splits the optimizer state (and the gradients) between the device and the host: the
// two sides add up to the whole, the device keeps a prefix of the modules within 1 - ratio of
// the elements, and a smaller ratio moves more to the device.
TEST(PartialOffloadPlan, SplitsTheStateBetweenDeviceAndHost) {
  const TrainerConfig c = tiny(ModelKind::kGpt2, DType::kBF16, 1, 1.0);
  auto whole = OffloadPlan::make(c, partial(1.0));
  ASSERT_TRUE(whole.ok());
  const std::uint64_t full = plan_bytes(*whole, "Adam exp_avg_sq");
  ASSERT_GT(full, 0u);
  EXPECT_EQ(plan_bytes(*whole, "device region optim."), 0u);
  std::uint64_t last_device = 0;
  for (double ratio : {0.9, 0.5, 0.2}) {
    auto p = OffloadPlan::make(c, partial(ratio));
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    const std::uint64_t dev = plan_bytes(*p, "device region optim.exp_avg_sq");
    const std::uint64_t host = plan_bytes(*p, "Adam exp_avg_sq");
    EXPECT_EQ(dev + host, full) << "ratio " << ratio;
    EXPECT_LE(static_cast<double>(dev), (1.0 - ratio) * static_cast<double>(full) + 4096)
        << "ratio " << ratio;
    EXPECT_GT(dev, last_device) << "ratio " << ratio;
    last_device = dev;
    // bf16: the device keeps fp32 masters and gradients for its modules too.
    EXPECT_EQ(plan_bytes(*p, "device region optim.master"), dev);
    EXPECT_EQ(plan_bytes(*p, "device region offload.grads"), dev);
    EXPECT_EQ(plan_bytes(*p, "gradients (fp32, host)"), host);
    EXPECT_NE(p->to_string().find("on the device)"), std::string::npos) << p->to_string();
  }
}

// With a pipeline each stage's plan splits the stage's own units (docs/offload.md "Tensor and
// pipeline parallel"): the device keeps the first of them in module order (GPT-2's last stage:
// the tied embedding unit first), the two sides add up to the stage's state at ratio 1, and the
// lines name each side's modules. The tensor-parallel plan is rank 0's shard, split alike.
TEST(PartialOffloadPlan, EachPipelineStageSplitsItsOwnUnits) {
  const TrainerConfig c = tiny(ModelKind::kGpt2, DType::kBF16, 2, 1.0);
  auto bounds = pipeline_stages(c.model, 2, c.seq_len);
  ASSERT_TRUE(bounds.ok()) << bounds.status().to_string();
  ASSERT_EQ(*bounds, (std::vector<int>{0, 3, 5}))
      << "the tiny GPT-2's 2 stages: embedding and 2 blocks | block, head";
  auto layout = describe_model(c.model);
  ASSERT_TRUE(layout.ok());
  const char* names[] = {"(modules 1..2; modules 0..0 on the device)",
                         "(modules 3..4; modules 0..0 on the device)"};
  for (int stage : {0, 1}) {
    OffloadSettings s = partial(0.5);
    s.pipeline_bounds = *bounds;
    s.pp_stage = stage;
    OffloadSettings whole_settings = s;
    whole_settings.optimizer_ratio = 1.0;
    auto whole = OffloadPlan::make(c, whole_settings);
    auto p = OffloadPlan::make(c, s);
    ASSERT_TRUE(whole.ok() && p.ok()) << (p.ok() ? whole.status() : p.status()).to_string();
    const offload_detail::Units units = offload_detail::describe_units(*layout, s);
    const std::string what = "stage " + std::to_string(stage);
    ASSERT_EQ(units.device_opt_units, 1u) << what;
    EXPECT_TRUE(units.device_opt[0]) << what << ": the embedding unit is the first of the stage's units";
    const std::uint64_t full = plan_bytes(*whole, "Adam exp_avg_sq");
    const std::uint64_t dev = plan_bytes(*p, "device region optim.exp_avg_sq");
    const std::uint64_t host = plan_bytes(*p, "Adam exp_avg_sq");
    EXPECT_EQ(dev, units.device_opt_bytes) << what;
    EXPECT_EQ(dev + host, full) << what;
    EXPECT_EQ(full, units.grad_bytes) << what << ": ratio 1 holds the stage's units only";
    EXPECT_EQ(plan_bytes(*p, "device region optim.master"), dev) << what;
    EXPECT_EQ(plan_bytes(*p, "device region offload.grads"), dev) << what;
    EXPECT_NE(p->to_string().find(names[stage]), std::string::npos) << what << "\n" << p->to_string();
  }
  // Tensor parallel: rank 0's shard, the same prefix of modules as one process at this ratio.
  OffloadSettings tp = partial(0.5);
  tp.tp_size = 2;
  auto sharded = OffloadPlan::make(c, tp);
  auto one = OffloadPlan::make(c, partial(0.5));
  ASSERT_TRUE(sharded.ok() && one.ok());
  const std::uint64_t tp_dev = plan_bytes(*sharded, "device region optim.exp_avg_sq");
  EXPECT_GT(tp_dev, 0u);
  EXPECT_LT(tp_dev, plan_bytes(*one, "device region optim.exp_avg_sq")) << "a shard of the same modules";
  EXPECT_NE(sharded->to_string().find("(modules 2..4; modules 0..1 on the device)"), std::string::npos)
      << sharded->to_string();
}

// The host part on NVMe: its [master | m | v] streams through the ring in sub-groups (and its
// gradients through NVMe shards), the device part as above; the same bits as the all-device run.
TEST(PartialOffload, NvmeOptimizerSplitsMatchTheAllDeviceRunBitForBit) {
  constexpr int kSteps = 3;
  const PartialCase cases[] = {{ModelKind::kGpt2, DType::kBF16, 2, 1.0},
                               {ModelKind::kLlama, DType::kF16, 1, 0.0},
                               {ModelKind::kGpt2, DType::kF32, 1, 0.0}};
  for (const PartialCase& k : cases) {
    const TrainerConfig c = tiny(k.kind, k.dtype, k.accum, k.clip);
    const Snapshot device = train(c, OffloadSettings{}, kSteps);
    for (double ratio : {0.5, 0.01}) {
      for (bool nvme_grads : {false, true}) {
        TempDir dir("strata-partial-nvme");
        OffloadSettings s = partial(ratio);
        s.optimizer = Tier::kNvme;
        s.nvme_path = {dir.path().string()};
        s.sub_group_size = 4097;
        if (nvme_grads) s.gradients = Tier::kNvme;
        const std::string what = std::string(k.kind == ModelKind::kGpt2 ? "gpt2 " : "llama ") +
                                 std::string(to_string(k.dtype)) + ", ratio " + std::to_string(ratio) +
                                 (nvme_grads ? ", NVMe gradients" : "");
        auto plan = OffloadPlan::make(c, s);
        ASSERT_TRUE(plan.ok()) << plan.status().to_string();
        // The two sides add up to the whole state: the NVMe holds [master | m | v] of the rest.
        auto whole = OffloadPlan::make(c, partial(1.0));
        ASSERT_TRUE(whole.ok());
        const std::uint64_t full = plan_bytes(*whole, "Adam exp_avg_sq");
        const std::uint64_t dev = plan_bytes(*plan, "device region optim.exp_avg_sq");
        EXPECT_GT(dev, 0u) << what;
        EXPECT_EQ(plan_bytes(*plan, "fp32 master + exp_avg + exp_avg_sq"), 3 * (full - dev)) << what;
        if (nvme_grads) {
          EXPECT_EQ(plan_bytes(*plan, "gradients (fp32)"), full - dev) << what;
        }
        const Snapshot got = train(c, s, kSteps);
        expect_same(device, got, what);
      }
    }
  }
}

// Parameters off the device (host or NVMe home): the device's modules keep their working
// parameters resident (the device's update writes them in place), the other modules are fetched
// from their home and updated by the host or NVMe optimizer. The same bits as the all-device run.
TEST(PartialOffload, ParametersOffTheDeviceMatchTheAllDeviceRunBitForBit) {
  constexpr int kSteps = 3;
  const PartialCase cases[] = {{ModelKind::kGpt2, DType::kBF16, 2, 1.0}, {ModelKind::kLlama, DType::kF16, 1, 0.0}};
  for (const PartialCase& k : cases) {
    const TrainerConfig c = tiny(k.kind, k.dtype, k.accum, k.clip);
    const Snapshot device = train(c, OffloadSettings{}, kSteps);
    for (const Placement p : {Placement{Tier::kHost, Tier::kHost}, Placement{Tier::kNvme, Tier::kHost},
                              Placement{Tier::kHost, Tier::kNvme}, Placement{Tier::kNvme, Tier::kNvme}}) {
      for (double ratio : {0.5, 0.01}) {
        TempDir dir("strata-partial-params");
        OffloadSettings s = settings_for(p, dir);
        s.optimizer_ratio = ratio;
        if (p.optimizer == Tier::kNvme) s.sub_group_size = 4097;
        const std::string what = std::string(k.kind == ModelKind::kGpt2 ? "gpt2 " : "llama ") +
                                 std::string(to_string(k.dtype)) + ", params " + std::string(to_string(p.params)) +
                                 ", optimizer " + std::string(to_string(p.optimizer)) + ", ratio " +
                                 std::to_string(ratio);
        auto plan = OffloadPlan::make(c, s);
        ASSERT_TRUE(plan.ok()) << plan.status().to_string();
        auto layout = describe_model(c.model);
        ASSERT_TRUE(layout.ok()) << layout.status().to_string();
        const offload_detail::Units units = offload_detail::describe_units(*layout, s);
        ASSERT_GT(units.device_opt_units, 0u) << what;
        ASSERT_LT(units.device_opt_units, units.home.size()) << what;
        for (std::size_t m = 0; m < units.home.size(); ++m) {
          EXPECT_EQ(units.home[m], m < units.device_opt_units ? Tier::kDevice : p.params) << what << ": module " << m;
        }
        Snapshot got;
        {
          auto dev = make_device();
          auto engine = OffloadEngine::create(c, s, *dev);
          ASSERT_TRUE(engine.ok()) << engine.status().to_string();
          ASSERT_TRUE(run_steps(**engine, c, 0, kSteps, got)) << what;
          EXPECT_GT((*engine)->stats().param_accesses, 0u) << what << ": the host modules are fetched";
          ASSERT_TRUE(capture_state(**engine, got));
        }
        expect_same(device, got, what);
      }
    }
  }
}

// strata estimate and strata plan enumerate every placement from the run's settings: the split
// and the delayed update apply where the engine takes them and are left out elsewhere.
TEST(PartialOffloadPlan, EstimatesEveryPlacementWithTheSplitWhereItApplies) {
  const TrainerConfig c = tiny(ModelKind::kGpt2, DType::kBF16, 1, 1.0);
  for (bool delayed : {false, true}) {
    OffloadSettings base = partial(0.5);
    base.delayed_update = delayed;
    auto rows = estimate_placements(c, base, EstimateBudgets{});
    ASSERT_TRUE(rows.ok()) << rows.status().to_string();
    bool saw_split = false;
    for (const PlacementEstimate& e : *rows) {
      const std::uint64_t dev = plan_bytes(e.plan, "device region optim.exp_avg_sq");
      if (e.optimizer != Tier::kDevice && !delayed) {
        EXPECT_GT(dev, 0u);
        saw_split = true;
      } else if (e.optimizer != Tier::kDevice) {
        EXPECT_EQ(dev, 0u) << to_string(e.params) << " / " << to_string(e.optimizer);
      }
    }
    EXPECT_EQ(saw_split, !delayed);
  }
}

// A checkpoint saved under a split resumes bit for bit under another placement (the all-device
// run here) and the other way round.
TEST(PartialOffloadCheckpoint, ResumesUnderAnyPlacement) {
  const TrainerConfig c = tiny(ModelKind::kLlama, DType::kBF16, 2, 1.0);
  const Snapshot ref = train(c, OffloadSettings{}, 6);
  for (const auto& [first, second] :
       {std::pair{partial(0.5), OffloadSettings{}}, std::pair{OffloadSettings{}, partial(0.5)}}) {
    TempDir ckpt("strata-partial-ckpt");
    Snapshot got;
    {
      auto device = make_device();
      auto engine = OffloadEngine::create(c, first, *device);
      ASSERT_TRUE(engine.ok()) << engine.status().to_string();
      ASSERT_TRUE(run_steps(**engine, c, 0, 3, got));
      ASSERT_TRUE((*engine)->save_checkpoint(ckpt.path().string()).ok());
    }
    auto device = make_device();
    auto engine = OffloadEngine::create(c, second, *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    auto m = (*engine)->load_checkpoint(ckpt.path().string());
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    ASSERT_TRUE(run_steps(**engine, c, 3, 6, got));
    ASSERT_TRUE(capture_state(**engine, got));
    expect_same(ref, got,
                first.optimizer_ratio < 1 ? "saved at ratio 0.5, resumed all-device"
                                          : "saved all-device, resumed at ratio 0.5");
  }
}

// What is not built is refused, naming the key.
TEST(PartialOffloadSettings, RefusedWhereNotBuilt) {
  TempDir dir("strata-partial");
  auto refused = [](OffloadSettings s, const std::string& want) {
    Status e = s.validate();
    EXPECT_FALSE(e.ok()) << want;
    EXPECT_NE(e.message().find("zero_optimization.offload_optimizer.ratio"), std::string::npos)
        << e.message();
    EXPECT_NE(e.message().find(want), std::string::npos) << e.message();
  };
  OffloadSettings nvme = partial(0.5);
  nvme.optimizer = Tier::kNvme;
  nvme.nvme_path = {dir.path().string()};
  EXPECT_TRUE(nvme.validate().ok()) << "the NVMe optimizer takes the split";
  for (Tier home : {Tier::kHost, Tier::kNvme}) {
    OffloadSettings params = partial(0.5);
    params.params = home;
    params.nvme_path = {dir.path().string()};
    EXPECT_TRUE(params.validate().ok()) << "parameters on " << to_string(home) << " take the split";
  }
  // Data parallelism: stages 0-3, the host or NVMe optimizer and gradients, the parameters on
  // the device, host or NVMe train (test_dist_offload_partial.cpp).
  OffloadSettings dp = partial(0.5);
  dp.dp_size = 2;
  for (int stage : {0, 1, 2, 3}) {
    OffloadSettings st = dp;
    st.zero_stage = stage;
    EXPECT_TRUE(st.validate().ok()) << "stage " << stage << " with 2 data-parallel ranks";
    for (Tier home : {Tier::kHost, Tier::kNvme}) {
      OffloadSettings tiers = st;
      tiers.optimizer = Tier::kNvme;
      tiers.gradients = Tier::kNvme;
      tiers.params = home;
      tiers.nvme_path = {dir.path().string()};
      EXPECT_TRUE(tiers.validate().ok()) << "stage " << stage << ", parameters on " << to_string(home)
                                         << ", NVMe optimizer and gradients, 2 data-parallel ranks";
    }
  }
  // A pipeline: each stage splits its own units (test_dist_partial_compose.cpp), interleaved
  // stages too, and with data-parallel ranks per stage at stages 0-3, interleaved or not.
  OffloadSettings piped = partial(0.5);
  piped.pipeline_bounds = {0, 2, 5};
  EXPECT_TRUE(piped.validate().ok()) << "one pipeline of 2 stages takes the split";
  OffloadSettings interleaved = piped;
  interleaved.pipeline_virtual_stages = 2;
  interleaved.pipeline_bounds = {0, 1, 2, 3, 5};
  EXPECT_TRUE(interleaved.validate().ok()) << "interleaved stages take the split";
  for (const OffloadSettings& pipe : {piped, interleaved}) {
    for (int stage : {0, 1, 2, 3}) {
      OffloadSettings piped_dp = pipe;
      piped_dp.dp_size = 2;
      piped_dp.zero_stage = stage;
      EXPECT_TRUE(piped_dp.validate().ok()) << "pipeline stages (v = " << pipe.pipeline_virtual_stages
                                            << ") with 2 data-parallel ranks, stage " << stage;
    }
  }
  OffloadSettings dpu = partial(0.5);
  dpu.delayed_update = true;
  refused(dpu, "strata.delayed_update");
  refused(partial(0.0), "(0, 1]");
  refused(partial(1.5), "(0, 1]");
  EXPECT_TRUE(partial(0.5).validate().ok());
  // The DeepSpeed key reaches the setting.
  auto config = parse_config(
      R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})",
      "partial.json");
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  OffloadSettings s;
  ASSERT_TRUE(s.apply(*config).ok());
  EXPECT_EQ(s.optimizer_ratio, 0.3);
}

}  // namespace
}  // namespace strata::testing
