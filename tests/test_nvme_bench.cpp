// strata bench nvme: a tiny run prints the documented JSON fields, cleans up after itself, and
// bad flags are usage errors (exit 2) that name the flag.
#include <filesystem>
#include <nlohmann/json.hpp>

#include "harness/harness.hpp"

namespace strata {
namespace {

using testing::TempDir;

TEST(BenchNvme, PrintsTheFiguresAndCleansUp) {
  TempDir dir("strata-bench");
  for (const char* verify : {"on", "off"}) {
    auto r = testing::run_cli("bench nvme --json --path " + dir.path().string() +
                              " --size 6MiB --block-size 64KiB --queue-depth 4 --verify " + verify);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    auto json = nlohmann::json::parse(r.output.substr(r.output.find('{')));
    for (const char* key : {"write_gbps", "read_gbps", "backend", "verify", "cpu_s_per_gb", "direct", "data_ok"}) {
      EXPECT_TRUE(json.contains(key)) << key << " missing in " << r.output;
    }
    EXPECT_GT(json["write_gbps"].get<double>(), 0.0);
    EXPECT_GT(json["read_gbps"].get<double>(), 0.0);
    EXPECT_GE(json["cpu_s_per_gb"].get<double>(), 0.0);
    EXPECT_EQ(json["verify"].get<bool>(), std::string(verify) == "on");
    EXPECT_TRUE(json["data_ok"].get<bool>());
    EXPECT_EQ(json["size"].get<std::uint64_t>(), 6u << 20);
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "the benchmark's swap files are removed";
}

TEST(BenchNvme, BadFlagsAreUsageErrors) {
  TempDir dir("strata-bench");
  auto r = testing::run_cli("bench nvme --size 1MiB");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--path"), std::string::npos) << r.output;
  r = testing::run_cli("bench nvme --path " + dir.path().string() + " --size 1MiB --verify maybe");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--verify"), std::string::npos) << r.output;
  r = testing::run_cli("bench nvme --path " + dir.path().string() + " --size 1MiB --block-size 1000");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("aio.block_size"), std::string::npos) << r.output;
  r = testing::run_cli("bench nvme --path " + dir.path().string() + " --size 1MiB --backend spdk");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("io_uring"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace strata
