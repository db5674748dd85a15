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
  // Where the file system has no O_DIRECT the benchmark refuses to run unless told --direct off
  // (it would measure the page cache), so the test asks for what the file system can do.
  const bool direct = testing::o_direct_unsupported_reason(dir.path()).empty();
  constexpr std::uint64_t kSize = 6u << 20, kBlock = 64u << 10;
  for (const char* verify : {"on", "off"}) {
    // A 1 MiB window: 4 slots of 256 KiB, so the 6 MiB go through 24 tensors, each slot reused.
    auto r = testing::run_cli("bench nvme --json --path " + dir.path().string() +
                              " --size 6MiB --window 1MiB --block-size 64KiB --queue-depth 4 --verify " +
                              verify + " --direct " + (direct ? "on" : "off"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    auto json = nlohmann::json::parse(r.output.substr(r.output.find('{')));
    SCOPED_TRACE(json.dump());
    for (const char* key : {"write_gbps",
                            "read_gbps",
                            "backend",
                            "verify",
                            "cpu_s_per_gb",
                            "write_cpu_s_per_gb",
                            "read_cpu_s_per_gb",
                            "direct",
                            "direct_requested",
                            "data_ok",
                            "size",
                            "tensors",
                            "tensor_bytes",
                            "tensors_verified",
                            "bytes_written",
                            "bytes_read",
                            "pieces",
                            "page_cache_dropped",
                            "device_read_bytes",
                            "block_size",
                            "queue_depth"}) {
      ASSERT_TRUE(json.contains(key)) << key << " missing";
    }
    EXPECT_EQ(json["size"].get<std::uint64_t>(), kSize);
    EXPECT_EQ(json["block_size"].get<std::uint64_t>(), kBlock);
    EXPECT_EQ(json["queue_depth"].get<std::uint64_t>(), 4u);
    EXPECT_EQ(json["verify"].get<bool>(), std::string(verify) == "on");
    EXPECT_EQ(json["direct_requested"].get<bool>(), direct);
    EXPECT_EQ(json["direct"].get<bool>(), direct);
    EXPECT_TRUE(json["page_cache_dropped"].get<bool>());
    // Exactly the bytes asked for went each way, as whole tensors, and every tensor came back.
    EXPECT_EQ(json["bytes_written"].get<std::uint64_t>(), kSize);
    EXPECT_EQ(json["bytes_read"].get<std::uint64_t>(), kSize);
    EXPECT_EQ(json["tensor_bytes"].get<std::uint64_t>(), 256u << 10);
    EXPECT_EQ(json["tensors"].get<std::uint64_t>(), 24u);
    EXPECT_EQ(json["tensors_verified"].get<std::uint64_t>(), 24u);
    EXPECT_TRUE(json["data_ok"].get<bool>());
    EXPECT_GE(json["pieces"].get<std::uint64_t>(), 2 * kSize / kBlock);
    EXPECT_GT(json["write_gbps"].get<double>(), 0.0);
    EXPECT_GT(json["read_gbps"].get<double>(), 0.0);
    const double w = json["write_cpu_s_per_gb"].get<double>(), rd = json["read_cpu_s_per_gb"].get<double>();
    EXPECT_GE(w, 0.0);
    EXPECT_GE(rd, 0.0);
    EXPECT_NEAR(json["cpu_s_per_gb"].get<double>(), (w + rd) / 2, 1e-12 + 1e-9 * (w + rd));
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
  r = testing::run_cli("bench nvme --path " + dir.path().string() + " --size 1MiB --direct sometimes");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--direct"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace strata
