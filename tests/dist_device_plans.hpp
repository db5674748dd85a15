// The device optimizer's plan at ZeRO stages 1-3 on one rank of a grid (the `PlanShrinksToOneOverDp`
// tests of test_dist_device_pp and test_dist_device_tp): the engine's plan equals
// OffloadPlan::make's line for line at every stage, and between the stages the device regions
// shrink as data parallelism shards them.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "dist_compare.hpp"
#include "offload/internal.hpp"

namespace strata::testing {

// One rank's device regions at stages 1-3 (index = stage), and the arena's live bytes.
struct DeviceStagePlans {
  std::uint64_t grads[4] = {}, params[4] = {}, live[4] = {}, buckets[4] = {}, slots[4] = {}, regions[4] = {};
};

// Creates the engine at stages 1, 2 and 3 of `s` on a fresh device with `create` and checks its
// plan against OffloadPlan::make(local, planned(s)) line for line, and the lines each stage adds:
// stage 2's gradients are this rank's 1/DP with bucket buffers, stage 3's parameters of the
// modules above the persistence threshold are this rank's slices, fetched through pinned staging.
inline DeviceStagePlans record_device_stage_plans(
    const TrainerConfig& local, OffloadSettings s, int DP,
    const std::function<OffloadSettings(const OffloadSettings&)>& planned,
    const std::function<Result<std::unique_ptr<OffloadEngine>>(const OffloadSettings&, Device&)>& create) {
  const std::string of = " (this rank's 1/" + std::to_string(DP);
  DeviceStagePlans r;
  for (int stage : {1, 2, 3}) {
    s.zero_stage = stage;
    auto made = OffloadPlan::make(local, planned(s));
    EXPECT_TRUE(made.ok()) << made.status().to_string();
    if (!made.ok()) return r;
    auto device = make_device();
    auto engine = create(s, *device);
    EXPECT_TRUE(engine.ok()) << engine.status().to_string();
    if (!engine.ok()) return r;
    const OffloadPlan& plan = (*engine)->plan();
    EXPECT_EQ(plan.lines.size(), made->lines.size()) << "stage " << stage;
    if (plan.lines.size() != made->lines.size()) return r;
    for (std::size_t i = 0; i < plan.lines.size(); ++i) {
      EXPECT_EQ(plan.lines[i].what, made->lines[i].what) << "stage " << stage;
      EXPECT_EQ(plan.lines[i].bytes, made->lines[i].bytes) << plan.lines[i].what;
      EXPECT_EQ(plan.lines[i].tier, made->lines[i].tier) << plan.lines[i].what;
    }
    EXPECT_EQ(plan.device_bytes, made->device_bytes) << "stage " << stage;
    r.grads[stage] = plan_bytes(plan, "device region offload.grads");
    r.params[stage] = plan_bytes(plan, "device region offload.params");
    r.buckets[stage] = plan_bytes(plan, "device region offload.grad_buckets");
    r.slots[stage] = plan_bytes(plan, "device region offload.param_slots");
    r.live[stage] = device->memory().stats().live_bytes;
    r.regions[stage] = plan_bytes(plan, "device region ");
    if (stage >= 2) {
      EXPECT_EQ(r.grads[stage], plan_bytes(plan, "device region offload.grads" + of + ")")) << "stage " << stage;
      EXPECT_GT(r.buckets[stage], 0u) << "stage " << stage;
    }
    if (stage == 3) {
      EXPECT_GT(plan_bytes(plan, "device region offload.params" + of + " of the modules above"), 0u);
      EXPECT_GT(plan_bytes(plan, "data-parallel parameter fetch staging (pinned)", Tier::kHost), 0u);
    }
  }
  return r;
}

// Against stage 1 (units `u1`): stage 2's gradients are 1/DP of stage 1's (within each unit's
// rounding to 64 elements) and, with enough modules, below stage 1's whole gradient even with the
// bucket buffers; stage 3's parameters are stage 2's less (DP - 1)/DP of the sliced units (`u3`)
// in the working dtype (2 bytes), plus the param slots. The arena's live bytes follow the plan's
// device regions between the stages (within each region's alignment).
inline void expect_device_stages_shrink(const DeviceStagePlans& p, const offload_detail::Units& u1,
                                        const offload_detail::Units& u3, int DP, const std::string& what) {
  const auto DPu = static_cast<std::uint64_t>(DP);
  const auto M = u1.gbytes.size();
  EXPECT_GE(p.grads[2], p.grads[1] / DPu) << what;
  EXPECT_LE(p.grads[2], p.grads[1] / DPu + 2 * 4 * 64 * M) << what;
  EXPECT_EQ(p.buckets[1], 0u) << what;
  EXPECT_EQ(p.slots[2], 0u) << what;
  EXPECT_EQ(p.params[1], p.params[2]) << what;
  // Stage 3: the sliced units keep rank 0's chunk (the largest) in the working dtype.
  std::uint64_t whole = 0, kept = 0;
  for (std::size_t m = 0; m < M; ++m) {
    if (!u3.sliced[m]) continue;
    whole += u3.pbytes[m];
    kept += 2 * offload_detail::dp_slice_of(u3.gbytes[m] / 4, DP, 0).chunk;
  }
  ASSERT_GT(whole, 0u) << what;
  EXPECT_LE(p.params[3], p.params[2] - whole + kept + 256 * M) << what;
  EXPECT_GE(p.params[3] + whole, p.params[2] + kept) << what;
  EXPECT_GT(p.slots[3], 0u) << what;
  EXPECT_LT(p.grads[2] + p.buckets[2], p.grads[1]) << what;
  for (int stage : {2, 3}) {
    EXPECT_NEAR(static_cast<double>(p.live[stage]) - static_cast<double>(p.live[1]),
                static_cast<double>(p.regions[stage]) - static_cast<double>(p.regions[1]), 16.0 * 4096)
        << what << ", stage " << stage;
  }
  EXPECT_LT(p.live[2], p.live[1]) << what;
  EXPECT_LT(p.live[3], p.live[2] + p.slots[3]) << what;
}

}  // namespace strata::testing
