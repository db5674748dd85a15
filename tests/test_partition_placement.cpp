// partition::Placement (src/partition/placement.hpp): the one record per unit that the engine,
// the plan and the cost model read. Over a matrix of placements (tiers, ZeRO stages, data-parallel
// ranks, tensor-parallel shards, pipeline stages, the partial split, the delayed update) the
// records hold their invariants, the ranks' slices tile every unit, the pipeline stages hold every
// unit once (the tied unit twice), and the plan's lines and homes are the records'.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "offload/regions.hpp"
#include "offload_fixture.hpp"
#include "partition/placement.hpp"
#include "strata/model.hpp"
#include "strata/offload.hpp"

namespace strata::testing {
namespace {

using partition::Placement;
using partition::UnitPlacement;

struct Shape {
  Tier params, optimizer;
  int stage;     // ZeRO stage
  int dp;        // data-parallel ranks
  double ratio;  // offload_optimizer.ratio
  bool delayed;
};

std::vector<Shape> shapes() {
  std::vector<Shape> out;
  const Tier tiers[] = {Tier::kDevice, Tier::kHost, Tier::kNvme};
  for (Tier p : tiers) {
    for (Tier o : tiers) {
      if (p != Tier::kDevice && o == Tier::kDevice) continue;
      for (int stage : {0, 1, 2, 3}) {
        for (int dp : {1, 2, 3}) {
          out.push_back({p, o, stage, dp, 1.0, false});
          if (o != Tier::kDevice) out.push_back({p, o, stage, dp, 0.5, false});
          if (o != Tier::kDevice && dp == 1) out.push_back({p, o, stage, dp, 1.0, true});
        }
      }
    }
  }
  return out;
}

OffloadSettings settings_of(const Shape& s) {
  OffloadSettings o;
  o.params = s.params;
  o.optimizer = s.optimizer;
  o.zero_stage = s.stage;
  o.dp_size = s.dp;
  o.optimizer_ratio = s.ratio;
  o.delayed_update = s.delayed;
  o.persistence_threshold = 0;  // every unit takes the params tier
  o.sub_group_size = 1000;      // several sub-groups per block (NVMe optimizer)
  o.reduce_bucket_elements = 5000;
  if (s.params == Tier::kNvme || s.optimizer == Tier::kNvme) o.nvme_path = {"nvme"};
  return o;
}

std::string name(const Shape& s) {
  return std::string("params ") + std::string(to_string(s.params)) + ", optimizer " +
         std::string(to_string(s.optimizer)) + ", stage " + std::to_string(s.stage) + ", dp " +
         std::to_string(s.dp) + ", ratio " + std::to_string(s.ratio) + (s.delayed ? ", delayed" : "");
}

// Catches: a rank's slices cut as another rank's, or sub-groups and stage-3 flags that disagree
// with the slices and homes (mutation: pack_slices giving every rank rank 0's slice).
TEST(Placement, EveryShapeIsValidAndItsSlicesTileEachUnit) {
  const TrainerConfig c = tiny(ModelKind::kGpt2, DType::kBF16, 2, 1.0);
  auto layout = describe_model(c.model);
  ASSERT_TRUE(layout.ok());
  for (const Shape& sh : shapes()) {
    const OffloadSettings s = settings_of(sh);
    std::vector<std::uint64_t> covered(layout->modules.size(), 0);
    for (int r = 0; r < sh.dp; ++r) {
      partition::Ranks ranks;
      ranks.dp_rank = r;
      const Placement p = Placement::build(*layout, s, ranks);
      ASSERT_TRUE(p.is_valid().ok()) << name(sh) << " rank " << r << ": " << p.is_valid().to_string();
      ASSERT_EQ(p.size(), static_cast<int>(layout->modules.size()));
      for (int u = 0; u < p.size(); ++u) {
        const UnitPlacement& x = p.unit(u);
        // The rank's slice starts where the rank before ended.
        EXPECT_EQ(x.slice.begin, std::min(covered[static_cast<std::size_t>(u)], x.elements())) << name(sh);
        covered[static_cast<std::size_t>(u)] += x.slice.len;
        // NVMe sub-groups cover exactly this rank's slice (the whole unit alone).
        if (s.optimizer == Tier::kNvme && x.sub_group_count() > 0) {
          EXPECT_EQ(x.sub_groups.front(), sh.dp > 1 ? x.slice.begin : 0) << name(sh);
          EXPECT_EQ(x.sub_groups.back(), sh.dp > 1 ? x.slice.begin + x.slice.len : x.elements()) << name(sh);
        }
        // Stage 3 gathers exactly the units that are not resident (off the device) or sliced.
        const bool stage3 = sh.stage == 3 && sh.dp > 1;
        const bool gathered =
            stage3 && (s.optimizer != Tier::kDevice ? x.home != Tier::kDevice : x.slice_at_home);
        EXPECT_EQ(x.gathered_at_fetch, gathered && x.param_bytes > 0) << name(sh) << " unit " << u;
      }
      // The flags say the same as the settings.
      EXPECT_EQ(p.sharding.host_state_sharded, sh.dp > 1 && s.optimizer != Tier::kDevice) << name(sh);
      EXPECT_EQ(p.sharding.device_state_sharded, sh.dp > 1 && s.optimizer == Tier::kDevice && sh.stage >= 1)
          << name(sh);
      EXPECT_EQ(p.sharding.optimizer_split, p.sizes.device_opt_units > 0) << name(sh);
    }
    for (std::size_t u = 0; u < covered.size(); ++u) {
      const std::uint64_t n = (layout->modules[u].grad_end - layout->modules[u].grad_begin) / 4;
      EXPECT_EQ(covered[u], n) << name(sh) << ": the ranks' slices of unit " << u << " do not tile it";
    }
  }
}

// Catches: the plan taking homes, slots or region sizes from anywhere but the placement
// (mutation: OffloadPlan::make reporting one parameter slot more than the placement carves).
TEST(Placement, ThePlanListsTheRecordsHomesAndSlots) {
  const TrainerConfig c = tiny(ModelKind::kLlama, DType::kF32, 1, 0.0);
  auto layout = describe_model(c.model);
  ASSERT_TRUE(layout.ok());
  int planned = 0;
  for (const Shape& sh : shapes()) {
    if (sh.dp != 1) continue;
    OffloadSettings s = settings_of(sh);
    s.persistence_threshold = 300;     // the small units stay resident
    if (!s.validate().ok()) continue;  // a combination the settings refuse (the plan would too)
    auto plan = OffloadPlan::make(c, s);
    ASSERT_TRUE(plan.ok()) << name(sh) << ": " << plan.status().to_string();
    const Placement p = Placement::build(*layout, s);
    ASSERT_EQ(plan->module_home.size(), p.units.size());
    for (int u = 0; u < p.size(); ++u) {
      EXPECT_EQ(plan->module_home[static_cast<std::size_t>(u)], p.unit(u).home) << name(sh) << " unit " << u;
      if (p.unit(u).elements() <= 300) {
        EXPECT_EQ(p.unit(u).home, Tier::kDevice) << name(sh);
      }
    }
    EXPECT_EQ(plan->param_slots, p.sizes.param_slots) << name(sh);
    EXPECT_EQ(plan->grad_slots, p.sizes.grad_slots) << name(sh);
    std::uint64_t device = 0;
    for (const RegionSpec& r : offload_detail::device_regions(p, s, c.model.dtype))
      device += r.is_slots() ? r.slot_bytes * r.slot_count : r.bytes;
    std::uint64_t listed = 0;
    for (const PlanLine& l : plan->lines)
      if (l.what.rfind("device region ", 0) == 0) listed += l.bytes;
    EXPECT_EQ(listed, device) << name(sh);
    ++planned;
  }
  EXPECT_GE(planned, 20) << "too few shapes planned to say anything";
}

// Catches: stage ownership computed apart from the layout's stages (mutation: holder_stage taken
// as the highest stage holding a unit: GPT-2's tied embedding then counts on the last stage).
TEST(Placement, PipelineStagesHoldEveryUnitOnceAndTheTiedUnitTwice) {
  TrainerConfig c = tiny(ModelKind::kGpt2, DType::kF32, 2, 1.0);
  c.model.n_layer = 4;
  auto layout = describe_model(c.model);
  ASSERT_TRUE(layout.ok());
  for (int v : {1, 2}) {
    constexpr int kStages = 2;
    auto bounds = pipeline_stages(c.model, kStages * v, c.seq_len);
    ASSERT_TRUE(bounds.ok());
    std::vector<int> held(layout->modules.size(), 0);
    int tied = -1;
    for (int st = 0; st < kStages; ++st) {
      OffloadSettings s;
      s.pipeline_bounds = *bounds;
      s.pipeline_virtual_stages = v;
      s.pp_stage = st;
      const Placement p = Placement::build(*layout, s);
      ASSERT_TRUE(p.is_valid().ok()) << p.is_valid().to_string();
      EXPECT_EQ(p.stage.stages, kStages);
      EXPECT_EQ(static_cast<int>(p.stage.chunk_ranges.size()), v);
      for (int u = 0; u < p.size(); ++u) {
        if (!p.unit(u).in_stage) continue;
        ++held[static_cast<std::size_t>(u)];
        EXPECT_LE(p.unit(u).holder_stage, st);
        EXPECT_GE(p.unit(u).first_touch, 0) << "stage " << st << " holds unit " << u << " but never reads it";
      }
      if (st == kStages - 1) tied = p.stage.tied_unit;
    }
    ASSERT_EQ(tied, 0) << "GPT-2's embedding is the tied unit";
    for (std::size_t u = 0; u < held.size(); ++u)
      EXPECT_EQ(held[u], u == 0 ? 2 : 1) << "unit " << u << ", v " << v;
  }
}

// Catches: the device optimizer's buckets not tiling the units with gradients (mutation: a unit
// skipped when a bucket is full instead of starting the next one).
TEST(Placement, GradientBucketsSeatEveryUnitWithGradientsOnce) {
  const TrainerConfig c = tiny(ModelKind::kLlama, DType::kBF16, 2, 1.0);
  auto layout = describe_model(c.model);
  ASSERT_TRUE(layout.ok());
  for (std::int64_t cap : {1, 3000, 100000000}) {
    OffloadSettings s;
    s.dp_size = 2;
    s.zero_stage = 2;
    s.reduce_bucket_elements = cap;
    const Placement p = Placement::build(*layout, s);
    ASSERT_TRUE(p.sharding.device_grads_bucketed);
    std::vector<int> seen(static_cast<std::size_t>(p.size()), 0);
    for (std::size_t b = 0; b < p.buckets.buckets.size(); ++b) {
      for (int u : p.buckets.buckets[b].units) {
        ++seen[static_cast<std::size_t>(u)];
        EXPECT_EQ(p.unit(u).bucket.index, static_cast<int>(b));
      }
    }
    for (int u = 0; u < p.size(); ++u)
      EXPECT_EQ(seen[static_cast<std::size_t>(u)], p.unit(u).grad_bytes > 0 ? 1 : 0);
    if (cap == 1) {
      EXPECT_EQ(p.buckets.buckets.size(), static_cast<std::size_t>(p.size()));  // one unit each
    }
    if (cap == 100000000) {
      EXPECT_EQ(p.buckets.buckets.size(), 1u);
    }
  }
}

}  // namespace
}  // namespace strata::testing
