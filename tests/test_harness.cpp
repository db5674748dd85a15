// The shared test harness: the environment a test run inherits cannot change what the tests
// check (harness/main.cpp clears every STRATA_* variable before any test runs), and the
// machine probes give a reason when they say no.
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "harness/harness.hpp"
#include "strata/options.hpp"

namespace strata::testing {
namespace {

std::string adam_isa_from_config_cli(const std::string& env_prefix, const std::string& config_path) {
  auto r = run_command(env_prefix + std::string(STRATA_CLI_PATH) + " config " + config_path + " --json");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output, nullptr, false);
  if (j.is_discarded() || !j.contains("strata")) {
    ADD_FAILURE() << "no strata section in: " << r.output;
    return "";
  }
  return j["strata"]["adam_isa"].get<std::string>();
}

// Run only as a child of InheritedTunablesDoNotReachTests, with bogus STRATA_* values exported.
TEST(HarnessChild, DISABLED_SeesNoInheritedTunables) {
  for (const auto& d : option_table()) {
    EXPECT_EQ(std::getenv(Options::env_name(d).c_str()), nullptr)
        << Options::env_name(d) << " reached the test";
  }
  Options options;
  STRATA_EXPECT_OK(options.load_env());
  EXPECT_EQ(options.get_string(Option::kAdamIsa), "auto");
  EXPECT_EQ(options.source(Option::kAdamIsa), "default");
  // The CLI a test runs inherits the cleaned environment ...
  TempDir dir("strata-harness");
  const std::string config = write_file(dir / "c.json", "{}");
  EXPECT_EQ(adam_isa_from_config_cli("", config), "auto");
  // ... and a value the test sets itself still applies.
  EXPECT_EQ(adam_isa_from_config_cli("STRATA_ADAM_ISA=scalar ", config), "scalar");
}

TEST(Harness, InheritedTunablesDoNotReachTests) {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const auto child = run_command(
      "STRATA_ADAM_ISA=bogus STRATA_DEVICE_MEMORY=lots STRATA_LOG_LEVEL=chatty '" + self +
      "' --gtest_also_run_disabled_tests --gtest_filter=HarnessChild.DISABLED_SeesNoInheritedTunables");
  EXPECT_EQ(child.exit_code, 0) << child.output;
  EXPECT_NE(child.output.find("[  PASSED  ] 1 test."), std::string::npos) << child.output;
  EXPECT_NE(child.output.find("ignoring inherited"), std::string::npos) << child.output;
  EXPECT_NE(child.output.find("STRATA_ADAM_ISA"), std::string::npos) << child.output;
  // Without the harness's clean-up the bogus value is an error for anything that reads it.
  TempDir dir("strata-harness");
  const std::string config = write_file(dir / "c.json", "{}");
  const auto raw = run_command("STRATA_ADAM_ISA=bogus " + std::string(STRATA_CLI_PATH) + " config " + config);
  EXPECT_NE(raw.exit_code, 0) << raw.output;
  EXPECT_NE(raw.output.find("STRATA_ADAM_ISA"), std::string::npos) << raw.output;
}

TEST(Harness, ProbesGiveAReasonOrNothing) {
  for (const std::string& why : {io_uring_unavailable_reason(), libaio_unavailable_reason(),
                                 o_direct_unsupported_reason(temp_root())}) {
    if (!why.empty()) {
      EXPECT_NE(why.find("failed"), std::string::npos) << why;
    }
  }
  EXPECT_EQ(io_uring_unavailable_reason(), io_uring_unavailable_reason()) << "probed once";
  const auto missing = o_direct_unsupported_reason(temp_root() / "no-such-dir-for-strata-probe");
  EXPECT_NE(missing.find("no-such-dir-for-strata-probe"), std::string::npos) << missing;
}

// Run as a child by the test below: a GPU test body.
TEST(HarnessChild, DISABLED_NeedsAGpu) {
  STRATA_SKIP_WITHOUT_GPU();
  SUCCEED();
}

// On a machine without a GPU a GPU test skips, naming why; with STRATA_REQUIRE_GPU=1 (the
// documented GPU command) the same test fails instead, so a GPU run cannot pass by skipping.
TEST(Harness, GpuTestsSkipWithoutAGpuUnlessOneIsRequired) {
  const GpuProbe gpu = probe_gpu();
  if (gpu.state != GpuState::kAbsent) GTEST_SKIP() << "this machine has a GPU (or a broken one): nothing to skip";
  EXPECT_FALSE(gpu.reason.empty());
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string run_child =
      "'" + self + "' --gtest_also_run_disabled_tests --gtest_filter=HarnessChild.DISABLED_NeedsAGpu";
  const auto skipped = run_command(run_child);
  EXPECT_EQ(skipped.exit_code, 0) << skipped.output;
  EXPECT_NE(skipped.output.find("[  SKIPPED ] 1 test"), std::string::npos) << skipped.output;
  EXPECT_NE(skipped.output.find("no GPU: " + gpu.reason), std::string::npos) << skipped.output;
  const auto required = run_command("STRATA_REQUIRE_GPU=1 " + run_child);
  EXPECT_NE(required.exit_code, 0) << required.output;
  EXPECT_NE(required.output.find("STRATA_REQUIRE_GPU=1 but there is no GPU"), std::string::npos) << required.output;
  EXPECT_NE(required.output.find("[  FAILED  ] 1 test"), std::string::npos) << required.output;
}

}  // namespace
}  // namespace strata::testing
