// The CLI's contract: help and version, usage errors exit 2 with a message naming the bad
// input, and the alloc benchmark's output meets its targets on a small trace.
#include <nlohmann/json.hpp>

#include "harness/harness.hpp"

namespace strata::testing {
namespace {

TEST(Cli, HelpAndVersion) {
  auto help = run_cli("--help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.output.find("usage: strata <command>"), std::string::npos);
  EXPECT_NE(help.output.find("bench"), std::string::npos);
  auto version = run_cli("--version");
  EXPECT_EQ(version.exit_code, 0);
  EXPECT_EQ(version.output.rfind("strata ", 0), 0u) << version.output;
}

TEST(Cli, BadInputExitsTwoWithAMessageAndUsage) {
  struct Case {
    const char* args;
    const char* needle;
  };
  for (const Case& c : {Case{"", "no command given"}, Case{"frobnicate", "unknown command 'frobnicate'"},
                        Case{"--frobnicate", "unknown flag '--frobnicate'"}, Case{"bench", "no benchmark named"},
                        Case{"bench nope", "unknown benchmark 'nope'"},
                        Case{"bench alloc --steps", "'--steps' needs a value"},
                        Case{"bench alloc --steps many", "'--steps' expects an integer, got 'many'"},
                        Case{"bench alloc --bogus 1", "unknown flag '--bogus'"},
                        Case{"bench alloc --compact sometimes", "--compact expects none, step or demand"},
                        Case{"device --device tpu", "'tpu'"}, Case{"device --memory 12parsecs", "--memory"},
                        Case{"device extra", "unexpected argument 'extra'"}}) {
    auto r = run_cli(c.args);
    EXPECT_EQ(r.exit_code, 2) << "strata " << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.needle), std::string::npos) << "strata " << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find("usage: strata"), std::string::npos) << "strata " << c.args << "\n" << r.output;
  }
}

TEST(Cli, DeviceReportsTheCpuBackend) {
  auto r = run_cli("device --device cpu --memory 64MiB --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["kind"], "cpu");
  EXPECT_EQ(j["memory_budget_bytes"], 64u << 20);
}

TEST(Cli, BenchAllocMeetsItsTargetsOnASmallTrace) {
  auto r = run_cli("bench alloc --json --steps 6 --layers 4 --width 256 --batch 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["os_allocs_after_warmup"], 0);
  EXPECT_LE(j["reserved_over_peak_live"].get<double>(), 1.05);
  EXPECT_GE(j["reserved_over_peak_live"].get<double>(), 1.0);
  if (j["baseline_measured"].get<bool>()) {  // false when a sanitizer replaces malloc
    EXPECT_GT(j["baseline_os_allocs_after_warmup"].get<int>(), 0) << "malloc had to grow the heap in steady state";
  }
  for (const char* key : {"peak_live_bytes", "reserved_bytes", "baseline_reserved_over_peak_live"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
}

}  // namespace
}  // namespace strata::testing
