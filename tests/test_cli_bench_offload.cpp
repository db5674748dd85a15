// strata bench offload on a tiny model: its figures are consistent with each other and with what
// each placement must move (the optimizer state of an NVMe optimizer crosses NVMe every step, the
// all-device placement moves nothing but losses), and no step allocates after warm-up.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "harness/harness.hpp"

namespace strata::testing {
namespace {

bool has_nvme_traffic(const nlohmann::json& placement) {
  const auto& b = placement.at("bytes_per_step");
  return b.at("nvme_read").get<double>() + b.at("nvme_write").get<double>() > 0;
}

TEST(CliBenchOffload, FiguresAreConsistentAndTrafficMatchesThePlacement) {
  auto r = run_cli("bench offload --layers 2 --width 64 --heads 2 --seq-len 32 --batch 2 --steps 2 --warmup 1 --threads 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto json_begin = r.output.find('{');
  ASSERT_NE(json_begin, std::string::npos) << r.output;
  const auto d = nlohmann::json::parse(r.output.substr(json_begin));
  const double params = d.at("parameters").get<double>();
  ASSERT_GT(params, 10000);
  ASSERT_EQ(d.at("placements").size(), 4u);
  // The cpu split every engine ran under, and each engine's CPU seconds per step.
  const auto& cpus = d.at("cpus");
  EXPECT_FALSE(cpus.at("allowed").get<std::string>().empty());
  EXPECT_FALSE(cpus.at("compute").get<std::string>().empty());
  EXPECT_FALSE(cpus.at("host").get<std::string>().empty());
  EXPECT_TRUE(cpus.at("pinned").get<bool>());
  EXPECT_EQ(d.at("compute_threads").get<int>(), 1);
  for (const auto& p : d.at("placements")) {
    const std::string name = p.at("placement");
    double largest = 0;
    for (const auto& [k, v] : p.at("parts_s").items()) largest = std::max(largest, v.get<double>());
    EXPECT_DOUBLE_EQ(p.at("lower_bound_s").get<double>(), largest) << name;
    EXPECT_NEAR(p.at("efficiency").get<double>(), largest / p.at("step_s").get<double>(), 1e-9) << name;
    EXPECT_EQ(p.at("allocations_after_warmup").get<int>(), 0) << name;
    const auto& cpu = p.at("cpu_s");
    EXPECT_GT(cpu.at("compute").get<double>(), 0.0) << name;
    EXPECT_NEAR(cpu.at("total").get<double>(),
                cpu.at("compute").get<double>() + cpu.at("copy").get<double>() + cpu.at("io").get<double>() +
                    cpu.at("optimizer").get<double>(),
                1e-9)
        << name;
    EXPECT_EQ(cpu.at("optimizer").get<double>() > 0.0, p.at("parts_s").contains("optimizer")) << name;
    EXPECT_EQ(cpu.at("io").get<double>() > 0.0, has_nvme_traffic(p)) << name;
    const auto& b = p.at("bytes_per_step");
    if (name == "all on the device") {
      EXPECT_EQ(b.at("nvme_read").get<double>(), 0.0);
      EXPECT_EQ(b.at("nvme_write").get<double>(), 0.0);
      EXPECT_LT(b.at("d2h").get<double>(), params) << "only the losses leave the device";
      EXPECT_FALSE(p.at("parts_s").contains("optimizer"));
    }
    if (name == "optimizer on host") {
      EXPECT_GE(b.at("d2h").get<double>(), 4 * params) << "fp32 gradients leave the device every step";
      EXPECT_TRUE(p.at("parts_s").contains("optimizer"));
    }
    if (name == "everything on NVMe") {
      // master + two moments read and written, gradients written and read, every step.
      EXPECT_GE(b.at("nvme_write").get<double>(), 16 * params) << name;
      EXPECT_GE(b.at("nvme_read").get<double>(), 16 * params) << name;
      EXPECT_TRUE(p.at("parts_s").contains("nvme_read"));
    }
  }
}

// --delayed-update adds the host optimizer with the one-step delayed update, and its step against
// the ordinary host-optimizer step measured in the same run.
TEST(CliBenchOffload, DelayedUpdateRowComparesWithTheOrdinaryStep) {
  auto r = run_cli(
      "bench offload --layers 2 --width 64 --heads 2 --seq-len 32 --batch 2 --steps 2 --warmup 1 --threads 1 "
      "--delayed-update");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto json_begin = r.output.find('{');
  ASSERT_NE(json_begin, std::string::npos) << r.output;
  const auto d = nlohmann::json::parse(r.output.substr(json_begin));
  const auto& rows = d.at("placements");
  ASSERT_EQ(rows.size(), 5u);
  const auto& ordinary = rows.at(1);
  const auto& delayed = rows.at(4);
  ASSERT_EQ(ordinary.at("placement"), "optimizer on host");
  ASSERT_EQ(delayed.at("placement"), "optimizer on host, delayed update");
  EXPECT_FALSE(ordinary.contains("vs_ordinary"));
  EXPECT_NEAR(delayed.at("vs_ordinary").get<double>(),
              ordinary.at("step_s").get<double>() / delayed.at("step_s").get<double>(), 1e-9);
  EXPECT_EQ(delayed.at("allocations_after_warmup").get<int>(), 0);
  // The same traffic as the ordinary step: gradients out, updated parameters in.
  const double params = d.at("parameters").get<double>();
  EXPECT_GE(delayed.at("bytes_per_step").at("d2h").get<double>(), 4 * params);
  EXPECT_GE(delayed.at("bytes_per_step").at("h2d").get<double>(), 4 * params);
  EXPECT_TRUE(delayed.at("parts_s").contains("optimizer"));
}

}  // namespace
}  // namespace strata::testing
