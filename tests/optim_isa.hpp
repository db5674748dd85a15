// The optimizer's per-ISA tests are value-parameterised over every path (scalar, avx2, avx512),
// so that a path this CPU cannot run shows up as SKIPPED with the reason instead of being left
// out of a PASSED run. On a CPU without AVX-512 the default path (best_optimizer_isa()) is then
// visibly untested here.
#pragma once

#include <ostream>
#include <string>

#include "harness/harness.hpp"
#include "strata/dtype.hpp"
#include "strata/optim.hpp"

namespace strata {
// gtest prints the parameter by name ("avx512") instead of as a byte.
inline void PrintTo(SimdIsa isa, std::ostream* os) { *os << to_string(isa); }
}  // namespace strata

namespace strata::testing {

inline constexpr SimdIsa kOptimizerIsas[] = {SimdIsa::kScalar, SimdIsa::kAvx2, SimdIsa::kAvx512};

class OptimizerIsaTest : public ::testing::TestWithParam<SimdIsa> {
 protected:
  void SetUp() override {
    if (!optimizer_supports(GetParam())) {
      GTEST_SKIP() << "this CPU cannot run the " << to_string(GetParam())
                   << " optimizer path (the best it runs is " << to_string(best_optimizer_isa()) << ")";
    }
  }
  SimdIsa isa() const { return GetParam(); }
};

}  // namespace strata::testing

// Instantiates `fixture` (derived from OptimizerIsaTest) once per path, named by the path.
#define STRATA_INSTANTIATE_OPTIMIZER_ISAS(fixture)                                               \
  INSTANTIATE_TEST_SUITE_P(Isa, fixture, ::testing::ValuesIn(::strata::testing::kOptimizerIsas), \
                           [](const auto& info) { return std::string(::strata::to_string(info.param)); })
