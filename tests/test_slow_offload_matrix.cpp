// The full equivalence matrix of the offload engine (label `slow`; the default run checks a
// representative subset in test_offload_engine.cpp): model {GPT-2, LLaMA} x dtype {fp32, bf16, fp16} x
// gradient accumulation {1, 4} x clipping {off, 1.0}, each under every placement (offload_param
// {device, host, nvme} x offload_optimizer {host, nvme}, the optimizer never above the
// parameters), with the NVMe optimizer's gradients on the host and on NVMe and the host
// optimizer's update during backward on and off. After 3 steps every parameter, master weight and
// moment, and every loss and gradient norm, equals the all-device run bit for bit.
//   scripts/test -L slow -R OffloadMatrix
#include <gtest/gtest.h>

#include <string>

#include "offload_fixture.hpp"

namespace strata::testing {
namespace {

struct Case {
  ModelKind kind;
  DType dtype;
  std::int64_t accum;
  double clip;
};

std::string name_of(const Case& c) {
  return std::string(c.kind == ModelKind::kGpt2 ? "Gpt2" : "Llama") +
         (c.dtype == DType::kBF16 ? "Bf16" : c.dtype == DType::kF16 ? "Fp16" : "Fp32") +
         "Accum" + std::to_string(c.accum) + (c.clip > 0 ? "Clip" : "NoClip");
}

class OffloadMatrix : public ::testing::TestWithParam<Case> {};

TEST_P(OffloadMatrix, EveryPlacementAndVariantMatchesTheAllDeviceRun) {
  const Case mc = GetParam();
  const TrainerConfig c = tiny(mc.kind, mc.dtype, mc.accum, mc.clip);
  TempDir dir("strata-matrix");
  const Snapshot ref = train(c, OffloadSettings{}, 3);
  ASSERT_EQ(ref.losses.size(), 3u);
  EXPECT_LT(ref.losses.back(), ref.losses.front());
  int runs = 0;
  for (const Placement& p : kPlacements) {
    for (int variant = 0; variant < 2; ++variant) {
      OffloadSettings s = settings_for(p, dir);
      std::string what = std::string("params on ") + std::string(to_string(p.params)) + ", optimizer on " +
                         std::string(to_string(p.optimizer));
      if (p.optimizer == Tier::kNvme) {
        s.gradients = variant == 0 ? Tier::kHost : Tier::kNvme;
        s.sub_group_size = variant == 0 ? 1'000'000'000 : 4097;
        what += variant == 0 ? ", gradients on host" : ", gradients on NVMe, sub-groups of 4097";
      } else {
        s.update_during_backward = variant == 0;
        what += variant == 0 ? ", update during backward" : ", update after backward";
      }
      const Snapshot got = train(c, s, 3);
      expect_same(ref, got, name_of(mc) + ": " + what);
      ++runs;
      std::filesystem::remove_all(dir.path());
      std::filesystem::create_directories(dir.path());
    }
  }
  EXPECT_EQ(runs, 12);
}

std::vector<Case> all_cases() {
  std::vector<Case> v;
  for (ModelKind k : {ModelKind::kGpt2, ModelKind::kLlama})
    for (DType d : {DType::kF32, DType::kBF16, DType::kF16})
      for (std::int64_t a : {1, 4})
        for (double clip : {0.0, 1.0}) v.push_back(Case{k, d, a, clip});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Full, OffloadMatrix, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return name_of(info.param); });

}  // namespace
}  // namespace strata::testing
