// The main() of every test executable (instead of gtest_main): it first removes every
// STRATA_* variable inherited from the environment, so that a tunable a developer or CI job
// exported (STRATA_ADAM_ISA, STRATA_DEVICE_MEMORY, ...) cannot change what a test checks. Tests
// that exercise the environment set the variables they need themselves, and CLI runs inherit
// the cleared environment. A test that passes tunables to a test executable it runs as a child
// names them in STRATA_TEST_KEEP (see clear_strata_environment()).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "harness/harness.hpp"

int main(int argc, char** argv) {
  // Read before the environment is cleared: it tells the GPU tests whether skipping is allowed.
  const char* require_gpu = std::getenv("STRATA_REQUIRE_GPU");
  strata::testing::set_gpu_required(require_gpu != nullptr && std::string(require_gpu) == "1");
  const std::vector<std::string> cleared = strata::testing::clear_strata_environment();
  ::testing::InitGoogleTest(&argc, argv);
  if (!cleared.empty() && !GTEST_FLAG_GET(list_tests)) {
    std::string names;
    for (const auto& n : cleared) names += (names.empty() ? "" : ", ") + n;
    std::fprintf(stderr, "strata test harness: ignoring inherited %s\n", names.c_str());
  }
  return RUN_ALL_TESTS();
}
