// The multi-process tests' one communication context (MPI initialises once per process) and one
// world Comm, set up before the first test and torn down after the last. Include it from exactly
// one file of a test program; world() is the group every test of that program uses.
#pragma once

#include <gtest/gtest.h>

#include <memory>

#include "strata/options.hpp"
#include "strata/parallel.hpp"

namespace strata::testing {

class CommEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    Options options;
    Status env = options.load_env();
    ASSERT_TRUE(env.ok()) << env.to_string();
    Result<CommConfig> config = CommConfig::from_options(options);
    ASSERT_TRUE(config.ok()) << config.status().to_string();
    auto ctx = CommContext::create(*config);
    ASSERT_TRUE(ctx.ok()) << ctx.status().to_string();
    context = std::move(*ctx);
    auto w = context->world(CommBackend::kMpi);
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    world = std::move(*w);
  }
  void TearDown() override {
    world.reset();
    context.reset();
  }
  std::unique_ptr<CommContext> context;
  std::unique_ptr<Comm> world;
};

inline CommEnvironment* const g_comm_env =
    static_cast<CommEnvironment*>(::testing::AddGlobalTestEnvironment(new CommEnvironment));

inline Comm& world() { return *g_comm_env->world; }

}  // namespace strata::testing
