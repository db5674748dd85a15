#include "harness/harness.hpp"
#include "strata/log.hpp"
#include "strata/options.hpp"
#include "strata/status.hpp"

namespace strata {
namespace {

Result<int> parse_positive(int x) {
  if (x <= 0) return invalid_argument("value " + std::to_string(x) + " is not positive");
  return x;
}

Result<int> twice_positive(int x) {
  STRATA_ASSIGN_OR_RETURN(int v, parse_positive(x));
  return 2 * v;
}

TEST(Status, OkAndErrorsCarryCodeAndMessage) {
  Status ok;
  EXPECT_TRUE(ok.ok());
  EXPECT_EQ(ok.to_string(), "OK");
  Status e = io_error("read /data/x at offset 4096: Input/output error");
  EXPECT_FALSE(e.ok());
  EXPECT_EQ(e.code(), StatusCode::kIoError);
  EXPECT_EQ(e.to_string(), "IO_ERROR: read /data/x at offset 4096: Input/output error");
  EXPECT_EQ(e.with_context("swap store").message(), "swap store: read /data/x at offset 4096: Input/output error");
}

TEST(Status, ResultPropagatesThroughMacros) {
  auto good = twice_positive(21);
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(*good, 42);
  auto bad = twice_positive(-1);
  STRATA_EXPECT_ERROR(bad, kInvalidArgument, "-1 is not positive");
}

TEST(Status, ResultFromOkStatusIsAnInternalError) {
  Result<int> r{Status{}};
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

TEST(Options, DefaultsFromTheTableAreValid) {
  Options o;
  for (const auto& d : option_table()) {
    EXPECT_EQ(o.source(d.id), "default") << d.name;
    Options fresh;
    STRATA_EXPECT_OK(fresh.set(d.id, d.default_value, "test"));
  }
  EXPECT_EQ(o.get_string(Option::kDevice), "cpu");
  EXPECT_EQ(o.get_bytes(Option::kDeviceMemory), 2ull << 30);
}

TEST(Options, EnvironmentOverridesAndBadValuesNameTheVariable) {
  Options o;
  ::setenv("STRATA_DEVICE_MEMORY", "64MiB", 1);
  STRATA_EXPECT_OK(o.load_env());
  EXPECT_EQ(o.get_bytes(Option::kDeviceMemory), 64ull << 20);
  EXPECT_EQ(o.source(Option::kDeviceMemory), "STRATA_DEVICE_MEMORY");
  ::setenv("STRATA_DEVICE_MEMORY", "lots", 1);
  STRATA_EXPECT_ERROR(o.load_env(), kInvalidArgument, "STRATA_DEVICE_MEMORY");
  ::unsetenv("STRATA_DEVICE_MEMORY");
  ::setenv("STRATA_DTYPE_ISA", "sse9", 1);
  STRATA_EXPECT_ERROR(o.load_env(), kInvalidArgument, "STRATA_DTYPE_ISA");
  ::unsetenv("STRATA_DTYPE_ISA");
  ::setenv("STRATA_DEVICE", "tpu", 1);
  STRATA_EXPECT_ERROR(o.load_env(), kInvalidArgument, "one of: cpu, cuda");
  ::unsetenv("STRATA_DEVICE");
}

// Integer options count small things; a value that would wrap when narrowed to int is refused.
TEST(Options, IntegersAndByteSizesThatDoNotFitAreRefused) {
  Options o;
  STRATA_EXPECT_ERROR(
      o.set(Option::kComputeThreads, "4294967297", "STRATA_COMPUTE_THREADS"), kInvalidArgument,
      "STRATA_COMPUTE_THREADS: value '4294967297' for option 'compute_threads' is not an integer "
      "in [0, 4096]");
  STRATA_EXPECT_ERROR(o.set(Option::kHostThreads, "99999999999999999999", "--x"), kInvalidArgument,
                      "[0, 4096]");
  STRATA_EXPECT_ERROR(o.set(Option::kDeviceOrdinal, " 1", "--x"), kInvalidArgument, "' 1'");
  STRATA_EXPECT_ERROR(o.set(Option::kDeviceMemory, "10000000TiB", "--memory"), kInvalidArgument,
                      "below 8 EiB");
  EXPECT_EQ(o.get_int(Option::kComputeThreads), 0) << "a refused value changes nothing";
  STRATA_EXPECT_OK(o.set(Option::kComputeThreads, "4096", "--x"));
  EXPECT_EQ(o.get_int(Option::kComputeThreads), 4096);
}

TEST(Options, ParseBytesUnitsAndErrors) {
  EXPECT_EQ(*parse_bytes("4096"), 4096u);
  EXPECT_EQ(*parse_bytes("64k"), 65536u);
  EXPECT_EQ(*parse_bytes("2GiB"), 2ull << 30);
  EXPECT_EQ(*parse_bytes("1.5 MiB"), 3ull << 19);
  STRATA_EXPECT_ERROR(parse_bytes("12 parsecs"), kInvalidArgument, "unknown unit 'parsecs'");
  STRATA_EXPECT_ERROR(parse_bytes(""), kInvalidArgument, "not a byte size");
  STRATA_EXPECT_ERROR(parse_bytes("0.5"), kInvalidArgument, "whole number");
  EXPECT_EQ(format_bytes(3ull << 30), "3.00 GiB");
}

TEST(Log, FilterBySubsystemAndLevel) {
  STRATA_ASSERT_OK(set_log_filter(LogLevel::kInfo, "ALLOC,NVME"));
  EXPECT_TRUE(log_enabled(LogLevel::kInfo, Subsys::kAlloc));
  EXPECT_TRUE(log_enabled(LogLevel::kWarn, Subsys::kNvme));
  EXPECT_FALSE(log_enabled(LogLevel::kDebug, Subsys::kAlloc));
  EXPECT_FALSE(log_enabled(LogLevel::kError, Subsys::kDevice));
  STRATA_ASSERT_OK(set_log_filter(LogLevel::kWarn, "^DEVICE"));
  EXPECT_FALSE(log_enabled(LogLevel::kError, Subsys::kDevice));
  EXPECT_TRUE(log_enabled(LogLevel::kError, Subsys::kOptim));
  STRATA_EXPECT_ERROR(set_log_filter(LogLevel::kWarn, "ALLOC,^NVME"), kInvalidArgument, "mixes");
  STRATA_EXPECT_ERROR(set_log_filter(LogLevel::kWarn, "ALOC"), kInvalidArgument, "'ALOC'");
  STRATA_EXPECT_ERROR(parse_log_level("loud"), kInvalidArgument, "'loud'");
  STRATA_ASSERT_OK(set_log_filter(LogLevel::kWarn, "all"));
}

}  // namespace
}  // namespace strata
