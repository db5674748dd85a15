// strata estimate's numbers are the engine's: for several placements, real OffloadEngines are
// created and their plans compared, line by line and byte for byte, with estimate_placements; the
// per-kind totals add up to the per-tier totals; the stage column follows DeepSpeed's rules; the
// budgets mark what does not fit.
#include <gtest/gtest.h>

#include "harness/harness.hpp"
#include "strata/device.hpp"
#include "strata/engine.hpp"
#include "strata/offload.hpp"

namespace strata::testing {
namespace {

TrainerConfig small_model(DType dtype) {
  TrainerConfig t;
  t.model.kind = ModelKind::kGpt2;
  t.model.n_layer = 3;
  t.model.n_embd = 96;
  t.model.n_head = 3;
  t.model.n_positions = 32;
  t.model.vocab_size = 101;
  t.model.dtype = dtype;
  t.micro_batch = 2;
  t.seq_len = 24;
  return t;
}

OffloadSettings small_modules_offloaded() {
  OffloadSettings s;
  s.persistence_threshold = 1000;  // so that the blocks (not only the tiny norms) leave the device
  return s;
}

const PlacementEstimate& find(const std::vector<PlacementEstimate>& rows, Tier params, Tier optimizer) {
  for (const PlacementEstimate& e : rows) {
    if (e.params == params && e.optimizer == optimizer) return e;
  }
  ADD_FAILURE() << "no row for " << to_string(params) << "/" << to_string(optimizer);
  return rows.front();
}

TEST(OffloadEstimate, EqualsTheEnginesOwnPlanForEachPlacement) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const TrainerConfig config = small_model(dtype);
    const OffloadSettings base = small_modules_offloaded();
    auto rows = estimate_placements(config, base, EstimateBudgets{});
    ASSERT_TRUE(rows.ok()) << rows.status().to_string();
    const std::pair<Tier, Tier> placements[] = {{Tier::kDevice, Tier::kDevice},
                                                {Tier::kDevice, Tier::kHost},
                                                {Tier::kHost, Tier::kHost},
                                                {Tier::kNvme, Tier::kNvme}};
    for (const auto& [params, optimizer] : placements) {
      SCOPED_TRACE(std::string(to_string(dtype)) + " " + std::string(to_string(params)) + "/" +
                   std::string(to_string(optimizer)));
      TempDir dir("strata-estimate");  // a fresh swap store per engine
      OffloadSettings s = base;
      s.params = params;
      s.optimizer = optimizer;
      s.nvme_path = {dir.path().string()};
      s.io.nvme_path = s.nvme_path;
      DeviceConfig dc;
      dc.kind = DeviceKind::kCpu;
      dc.memory_bytes = 256ull << 20;
      dc.pinned_bytes = 64ull << 20;
      dc.compute_threads = 1;
      auto device = Device::create(dc);
      ASSERT_TRUE(device.ok()) << device.status().to_string();
      auto engine = OffloadEngine::create(config, s, **device);
      ASSERT_TRUE(engine.ok()) << engine.status().to_string();
      const OffloadPlan& actual = (*engine)->plan();
      const PlacementEstimate& e = find(*rows, params, optimizer);
      ASSERT_EQ(e.plan.lines.size(), actual.lines.size()) << e.plan.to_string() << actual.to_string();
      for (std::size_t i = 0; i < actual.lines.size(); ++i) {
        EXPECT_EQ(e.plan.lines[i].what, actual.lines[i].what);
        EXPECT_EQ(e.plan.lines[i].tier, actual.lines[i].tier) << actual.lines[i].what;
        EXPECT_EQ(e.plan.lines[i].pinned, actual.lines[i].pinned) << actual.lines[i].what;
        EXPECT_EQ(e.plan.lines[i].bytes, actual.lines[i].bytes) << actual.lines[i].what;
      }
      EXPECT_EQ(e.plan.device_bytes, actual.device_bytes);
      EXPECT_EQ(e.plan.host_bytes, actual.host_bytes);
      EXPECT_EQ(e.plan.pinned_bytes, actual.pinned_bytes);
      EXPECT_EQ(e.plan.nvme_bytes, actual.nvme_bytes);
      EXPECT_EQ(e.plan.module_home, actual.module_home);
      EXPECT_EQ(e.device_need, actual.device_bytes);  // cpu backend: no kernel workspace on top
      // The per-kind split adds up to the per-tier totals.
      TierBytes sum;
      for (const TierBytes& t : e.by_kind) {
        sum.device += t.device;
        sum.host += t.host;
        sum.pinned += t.pinned;
        sum.nvme += t.nvme;
      }
      EXPECT_EQ(sum.device, actual.device_bytes);
      EXPECT_EQ(sum.host, actual.host_bytes);
      EXPECT_EQ(sum.pinned, actual.pinned_bytes);
      EXPECT_EQ(sum.nvme, actual.nvme_bytes);
    }
  }
}

TEST(OffloadEstimate, KindsLandWhereThePlacementPutsThem) {
  auto rows = estimate_placements(small_model(DType::kF32), small_modules_offloaded(), EstimateBudgets{});
  ASSERT_TRUE(rows.ok()) << rows.status().to_string();
  const auto opt = static_cast<std::size_t>(StateKind::kOptimizer);
  const auto acts = static_cast<std::size_t>(StateKind::kActivations);
  const auto params = static_cast<std::size_t>(StateKind::kParameters);
  const PlacementEstimate& dd = find(*rows, Tier::kDevice, Tier::kDevice);
  const PlacementEstimate& dh = find(*rows, Tier::kDevice, Tier::kHost);
  const PlacementEstimate& nn = find(*rows, Tier::kNvme, Tier::kNvme);
  // fp32 Adam: two moments of 4 bytes per gradient element (the master is the working copy).
  EXPECT_GT(dd.by_kind[opt].device, 0u);
  EXPECT_EQ(dd.by_kind[opt].host + dd.by_kind[opt].nvme, 0u);
  EXPECT_EQ(dh.by_kind[opt].device, 0u);
  EXPECT_EQ(dh.by_kind[opt].host, 3 * dd.by_kind[opt].device / 2);  // master + two moments
  EXPECT_EQ(nn.by_kind[opt].nvme, dh.by_kind[opt].host);
  EXPECT_EQ(nn.by_kind[opt].host, 0u);
  EXPECT_GT(nn.by_kind[params].nvme, 0u);
  // Activations do not depend on the placement.
  EXPECT_GT(dd.by_kind[acts].device, 0u);
  for (const PlacementEstimate& e : *rows) EXPECT_EQ(e.by_kind[acts].device, dd.by_kind[acts].device);
}

TEST(OffloadEstimate, StagesFollowDeepSpeedsRulesAndAllStagesNeedTheSameBytes) {
  auto rows = estimate_placements(small_model(DType::kF32), OffloadSettings{}, EstimateBudgets{});
  ASSERT_TRUE(rows.ok()) << rows.status().to_string();
  // device/device: stages 0-3; optimizer offloaded: 1-3; parameters offloaded: 3 only.
  EXPECT_EQ(rows->size(), 4u + 3u + 3u + 4u * 1u);
  for (const PlacementEstimate& e : *rows) {
    if (e.params != Tier::kDevice) {
      EXPECT_EQ(e.zero_stage, 3);
    }
    if (e.optimizer != Tier::kDevice) {
      EXPECT_GE(e.zero_stage, 1);
    }
    EXPECT_FALSE(e.params != Tier::kDevice && e.optimizer == Tier::kDevice);
    const PlacementEstimate& first = find(*rows, e.params, e.optimizer);
    EXPECT_EQ(e.plan.device_bytes, first.plan.device_bytes);
    EXPECT_EQ(e.plan.host_bytes + e.plan.pinned_bytes, first.plan.host_bytes + first.plan.pinned_bytes);
  }
}

TEST(OffloadEstimate, BudgetsMarkWhatDoesNotFit) {
  const TrainerConfig config = small_model(DType::kF32);
  auto all = estimate_placements(config, small_modules_offloaded(), EstimateBudgets{});
  ASSERT_TRUE(all.ok());
  const std::uint64_t dd = find(*all, Tier::kDevice, Tier::kDevice).plan.device_bytes;
  const std::uint64_t dh = find(*all, Tier::kDevice, Tier::kHost).plan.device_bytes;
  ASSERT_LT(dh, dd);
  // A device budget between the two: the all-device placement no longer fits, offloading does.
  auto rows = estimate_placements(config, small_modules_offloaded(), EstimateBudgets{(dd + dh) / 2, 0, 0});
  ASSERT_TRUE(rows.ok());
  EXPECT_FALSE(find(*rows, Tier::kDevice, Tier::kDevice).fits_device);
  EXPECT_TRUE(find(*rows, Tier::kDevice, Tier::kHost).fits());
  // No NVMe space at all (1 byte): every NVMe placement fails on nvme only.
  auto no_disk = estimate_placements(config, small_modules_offloaded(), EstimateBudgets{0, 0, 1});
  ASSERT_TRUE(no_disk.ok());
  for (const PlacementEstimate& e : *no_disk) {
    const bool uses_nvme = e.params == Tier::kNvme || e.optimizer == Tier::kNvme;
    EXPECT_EQ(e.fits_nvme, !uses_nvme);
    if (uses_nvme) {
      EXPECT_GT(e.nvme_need, e.plan.nvme_bytes);  // the swap reserve holds rewrites too
    } else {
      EXPECT_EQ(e.nvme_need, 0u);
    }
  }
}

// Stage 3 in device memory: a sliced module (home on the device, only this rank's slice there)
// is fetched into a slot for each use, so the plan's modules line counts it apart from the
// resident ones. Here the embedding and the 3 blocks are above the persistence threshold and the
// head (ln_f, 192 elements) stays whole.
TEST(Estimate, PlanCountsSlicedModulesApartFromResidentOnes) {
  const TrainerConfig c = small_model(DType::kF32);
  OffloadSettings s = small_modules_offloaded();
  s.dp_size = 2;
  s.zero_stage = 3;
  auto three = OffloadPlan::make(c, s);
  ASSERT_TRUE(three.ok()) << three.status().to_string();
  EXPECT_EQ(three->module_sliced, (std::vector<char>{1, 1, 1, 1, 0}));
  const std::string text = three->to_string();
  EXPECT_NE(text.find("modules' working parameters: 1 resident on the device, 4 sliced on the device"),
            std::string::npos)
      << text;
  s.zero_stage = 2;
  auto two = OffloadPlan::make(c, s);
  ASSERT_TRUE(two.ok()) << two.status().to_string();
  EXPECT_NE(two->to_string().find("modules' working parameters: 5 resident on the device, 0 on host"),
            std::string::npos)
      << two->to_string();
  EXPECT_EQ(two->to_string().find("sliced"), std::string::npos) << two->to_string();
}

}  // namespace
}  // namespace strata::testing
