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
  SCOPED_TRACE(j.dump());
  for (const char* key :
       {"peak_live_bytes", "reserved_bytes", "high_water_bytes", "reserved_over_peak_live",
        "high_water_over_peak_live", "os_allocs_after_warmup", "backend_allocs_after_warmup",
        "arena_growths_after_warmup", "pinned_growths_after_warmup", "baseline_reserved_bytes",
        "baseline_peak_live_bytes", "baseline_reserved_over_peak_live", "allocations"}) {
    ASSERT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["steps"], 6);
  EXPECT_EQ(j["layers"], 4);
  EXPECT_EQ(j["width"], 256);
  // Per step: the embedding, 11 blocks per layer forward, logits + losses + dlogits, dx, 6 per
  // layer backward, 2 carried buffers (see the trace in tools/strata/bench_alloc.cpp).
  EXPECT_EQ(j["allocations"], 6 * (1 + 11 * 4 + 3 + 1 + 6 * 4 + 2));
  // reserved is the budget the device holds, planned from a dry run: it covers the high-water
  // mark, which covers the peak of live bytes, and exceeds it by less than the 1 MiB rounding.
  const auto peak = j["peak_live_bytes"].get<std::uint64_t>();
  const auto high = j["high_water_bytes"].get<std::uint64_t>();
  const auto reserved = j["reserved_bytes"].get<std::uint64_t>();
  EXPECT_GT(peak, 0u);
  EXPECT_GE(high, peak);
  EXPECT_GE(reserved, high);
  EXPECT_LT(reserved - high, 1u << 20);
  EXPECT_DOUBLE_EQ(j["reserved_over_peak_live"].get<double>(), double(reserved) / double(peak));
  EXPECT_DOUBLE_EQ(j["high_water_over_peak_live"].get<double>(), double(high) / double(peak));
  // The targets: footprint within 5% of the peak, nothing from the OS after warm-up.
  EXPECT_LE(j["reserved_over_peak_live"].get<double>(), 1.05);
  EXPECT_EQ(j["os_allocs_after_warmup"].get<std::uint64_t>(),
            j["backend_allocs_after_warmup"].get<std::uint64_t>() +
                j["arena_growths_after_warmup"].get<std::uint64_t>() +
                j["pinned_growths_after_warmup"].get<std::uint64_t>());
  EXPECT_EQ(j["os_allocs_after_warmup"], 0);
  if (j["baseline_measured"].get<bool>()) {  // false when a sanitizer replaces malloc
    EXPECT_GT(j["baseline_os_allocs_after_warmup"].get<int>(), 0) << "malloc had to grow the heap in steady state";
    // The same trace went through both; the arena rounds every block up to its alignment.
    const auto base_peak = j["baseline_peak_live_bytes"].get<std::uint64_t>();
    EXPECT_GE(peak, base_peak);
    EXPECT_LT(peak - base_peak, peak / 100);
    const auto base_reserved = j["baseline_reserved_bytes"].get<std::uint64_t>();
    EXPECT_DOUBLE_EQ(j["baseline_reserved_over_peak_live"].get<double>(),
                     double(base_reserved) / double(j["baseline_peak_live_bytes"].get<std::uint64_t>()));
  }
}

}  // namespace
}  // namespace strata::testing
