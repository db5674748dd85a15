// The small shared harness for Strata's tests: temp dirs, running the CLI, status matchers.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "strata/status.hpp"

namespace strata::testing {

// A fresh directory under $TMPDIR (or /tmp), removed with everything in it on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "strata-test");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

struct CommandResult {
  int exit_code = -1;   // the process's exit status, or 128+signal
  std::string output;   // stdout and stderr, interleaved
};

// Runs `args` through /bin/sh with stderr merged into stdout.
CommandResult run_command(const std::string& command_line);

// Runs the built `strata` CLI with the given argument string.
CommandResult run_cli(const std::string& args);

std::string write_file(const std::filesystem::path& path, const std::string& contents);
// A file's bytes ("" when it cannot be read), and a JSON-lines file as one value per line.
std::string read_file(const std::filesystem::path& path);
std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& path);

// n bytes from a seeded generator (the same bytes for the same seed).
std::vector<unsigned char> random_bytes(std::size_t n, std::uint64_t seed);

// Awkward sizes every size-parameterised test should cover.
const std::vector<std::size_t>& awkward_sizes();

// Removes every STRATA_* variable from this process's environment and returns their names. The
// harness's main() calls it before any test runs (see harness/main.cpp). A test that runs a
// test executable as a child and means to pass it tunables names them in STRATA_TEST_KEEP
// (comma-separated); STRATA_TEST_KEEP itself is always removed.
std::vector<std::string> clear_strata_environment();

// The directory TempDir uses: $TMPDIR, or /tmp.
std::filesystem::path temp_root();

// Probes of what the machine allows, each run once per process. They return an empty string
// when the feature works, else the reason it does not (for GTEST_SKIP() << reason). They call
// the kernel directly, not Strata, so a bug in Strata's own setup cannot turn into a skip.
//   io_uring: io_uring_setup(2) of a one-entry ring (fails under seccomp filters, container
//             policies, kernel.io_uring_disabled, or kernels without it).
//   libaio:   io_setup(2) of a one-event context.
//   O_DIRECT: creating a file in `dir` with O_DIRECT and writing one aligned 4 KiB block.
std::string io_uring_unavailable_reason();
std::string libaio_unavailable_reason();
std::string o_direct_unsupported_reason(const std::filesystem::path& dir);

// Whether this machine has a GPU to run the `gpu` tests on. Only a machine without one skips:
// a build without CUDA, no NVIDIA driver installed (libcuda.so.1 cannot be loaded), or a driver
// that reports cudaErrorNoDevice or zero devices. Any other CUDA error (a driver older than the
// runtime, a device in a bad state) is kBroken, and the test fails: a broken GPU setup must not
// read as "skipped". With STRATA_REQUIRE_GPU=1 a missing GPU fails too (the documented GPU test
// command sets it, so a run on a GPU machine cannot pass by skipping).
enum class GpuState { kPresent, kAbsent, kBroken };
struct GpuProbe {
  GpuState state = GpuState::kAbsent;
  std::string reason;  // why there is no usable GPU; empty when kPresent
};
GpuProbe probe_gpu();

// STRATA_REQUIRE_GPU as main() found it (the harness clears STRATA_* before tests run).
bool gpu_required();
void set_gpu_required(bool required);

}  // namespace strata::testing

// The first statement of a GPU test (or its fixture's SetUp): skips without a GPU, fails when
// the GPU setup is broken or a GPU is required and missing.
#define STRATA_SKIP_WITHOUT_GPU()                                                               \
  do {                                                                                          \
    const ::strata::testing::GpuProbe strata_gpu_ = ::strata::testing::probe_gpu();             \
    if (strata_gpu_.state == ::strata::testing::GpuState::kBroken) {                            \
      FAIL() << "the GPU is present but unusable: " << strata_gpu_.reason;                      \
    }                                                                                           \
    if (strata_gpu_.state == ::strata::testing::GpuState::kAbsent) {                            \
      if (::strata::testing::gpu_required()) {                                                  \
        FAIL() << "STRATA_REQUIRE_GPU=1 but there is no GPU: " << strata_gpu_.reason;           \
      }                                                                                         \
      GTEST_SKIP() << "no GPU: " << strata_gpu_.reason;                                         \
    }                                                                                           \
  } while (0)

#define STRATA_ASSERT_OK(expr)                                        \
  do {                                                                \
    const ::strata::Status strata_s_ = (expr);                        \
    ASSERT_TRUE(strata_s_.ok()) << strata_s_.to_string();             \
  } while (0)
#define STRATA_EXPECT_OK(expr)                                        \
  do {                                                                \
    const ::strata::Status strata_s_ = (expr);                        \
    EXPECT_TRUE(strata_s_.ok()) << strata_s_.to_string();             \
  } while (0)

// Asserts a Status/Result failed with `code` and a message containing `needle`.
#define STRATA_EXPECT_ERROR(expr, code_, needle)                                          \
  do {                                                                                    \
    const ::strata::Status strata_s_ = ::strata::testing::status_of(expr);                \
    EXPECT_EQ(strata_s_.code(), ::strata::StatusCode::code_) << strata_s_.to_string();    \
    EXPECT_NE(strata_s_.message().find(needle), std::string::npos)                        \
        << "message '" << strata_s_.message() << "' does not mention '" << (needle) << "'"; \
  } while (0)

namespace strata::testing {
inline Status status_of(const Status& s) { return s; }
template <typename T>
Status status_of(const Result<T>& r) { return r.status(); }
}  // namespace strata::testing
