// The cuda backend against the shared Device conformance suite (label gpu; skips without a GPU).
#include "device_conformance.hpp"

namespace strata::testing {
namespace {

INSTANTIATE_TEST_SUITE_P(Cuda, DeviceConformance, ::testing::Values(DeviceKind::kCuda), device_kind_name);

}  // namespace
}  // namespace strata::testing
