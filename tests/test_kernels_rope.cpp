// Rotary position embedding: the table, forward (in place and out of place, with a row stride
// as in a packed q/k/v buffer) and backward against float64, the backward as the exact inverse,
// and finite differences. Tolerances: ref::kF32Tol for fp32 (the table's fp32 cos/sin), ref::kBF16Tol
// for bf16.
#include <cmath>

#include "harness/harness.hpp"
#include "kernel_ref/reference.hpp"

namespace strata::kernels {
namespace {

using ref::TestTensor;
using ref::Vec;

constexpr double kTheta = 10000.0;

TEST(Rope, TableHoldsCosAndSinOfEachAngle) {
  const int T = 9, D = 6;
  std::vector<float> table(T * D);
  STRATA_ASSERT_OK(rope_table(table.data(), T, D, kTheta));
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < D / 2; ++i) {
      const double a = t * std::pow(kTheta, -2.0 * i / D);
      EXPECT_FLOAT_EQ(table[(t * D / 2 + i) * 2], static_cast<float>(std::cos(a)));
      EXPECT_FLOAT_EQ(table[(t * D / 2 + i) * 2 + 1], static_cast<float>(std::sin(a)));
    }
  STRATA_EXPECT_ERROR(rope_table(table.data(), T, 5, kTheta), kInvalidArgument, "must be even");
}

class RopeTest : public ::testing::TestWithParam<DType> {};

TEST_P(RopeTest, ForwardAndBackwardMatchReference) {
  const DType dt = GetParam();
  ref::CpuContext cpu;
  struct Case {
    int B, T, H, D, stride;
  };
  for (Case c : {Case{1, 1, 1, 2, 2}, Case{2, 17, 3, 16, 3 * 16 + 5}, Case{1, 70, 2, 64, 3 * 2 * 64},
                 Case{2, 9, 4, 32, 4 * 32}}) {
    std::vector<float> table(static_cast<std::size_t>(c.T) * c.D);
    STRATA_ASSERT_OK(rope_table(table.data(), c.T, c.D, kTheta));
    const std::size_t n = static_cast<std::size_t>(c.B) * c.T * c.stride;
    const Vec x = ref::as_stored(dt, ref::random_vec(n, 1));
    const std::string what = "B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) +
                             " H=" + std::to_string(c.H) + " D=" + std::to_string(c.D) +
                             " stride=" + std::to_string(c.stride);
    // Out of place into a copy (so the elements outside the heads keep their values), then in place.
    TestTensor tx = TestTensor::from(dt, x), ty = TestTensor::from(dt, x);
    STRATA_ASSERT_OK(rope_forward(cpu.ctx, ty.arg(), tx.carg(), table.data(), c.B, c.T, c.H, c.D, c.stride));
    const Vec want = ref::rope(x, c.B, c.T, c.H, c.D, c.stride, kTheta, false);
    ref::expect_close(ty.values(), want, ref::tolerance_for(dt), what + " forward");
    STRATA_ASSERT_OK(rope_forward(cpu.ctx, tx.arg(), tx.carg(), table.data(), c.B, c.T, c.H, c.D, c.stride));
    ref::expect_close(tx.values(), want, ref::tolerance_for(dt), what + " forward in place");
    // The backward rotates back: applied to the forward's fp32 output it returns the input.
    TestTensor tg = TestTensor::from(dt, x);
    STRATA_ASSERT_OK(rope_backward(cpu.ctx, tg.arg(), tg.carg(), table.data(), c.B, c.T, c.H, c.D, c.stride));
    ref::expect_close(tg.values(), ref::rope(x, c.B, c.T, c.H, c.D, c.stride, kTheta, true),
                      ref::tolerance_for(dt), what + " backward");
    if (dt == DType::kF32) {
      STRATA_ASSERT_OK(
          rope_backward(cpu.ctx, ty.arg(), ty.carg(), table.data(), c.B, c.T, c.H, c.D, c.stride));
      ref::expect_close(ty.values(), x, ref::kF32Tol, what + " inverse");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, RopeTest, ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(Rope, BackwardMatchesFiniteDifferences) {
  ref::CpuContext cpu;
  const int B = 1, T = 4, H = 2, D = 4;
  std::vector<float> table(T * D);
  STRATA_ASSERT_OK(rope_table(table.data(), T, D, kTheta));
  const int n = B * T * H * D;
  const Vec x = ref::as_stored(DType::kF32, ref::random_vec(n, 1));
  const Vec r = ref::random_vec(n, 2);
  auto loss = [&](const Vec& p) {
    TestTensor tx = TestTensor::from(DType::kF32, p), ty(DType::kF32, n);
    EXPECT_TRUE(rope_forward(cpu.ctx, ty.arg(), tx.carg(), table.data(), B, T, H, D, 0).ok());
    return ref::dot(ty.values(), r);
  };
  TestTensor tr = TestTensor::from(DType::kF32, r), tdx(DType::kF32, n);
  STRATA_ASSERT_OK(rope_backward(cpu.ctx, tdx.arg(), tr.carg(), table.data(), B, T, H, D, 0));
  ref::expect_fd_match(loss, x, tdx.values(), "rope");
}

TEST(Rope, BadArgumentsAreNamed) {
  ref::CpuContext cpu;
  float x = 0, table = 0;
  STRATA_EXPECT_ERROR(rope_forward(cpu.ctx, f32(&x), f32(&x), &table, 1, 1, 2, 3, 0), kInvalidArgument,
                      "D = 3 must be even");
  STRATA_EXPECT_ERROR(rope_forward(cpu.ctx, f32(&x), f32(&x), &table, 1, 1, 2, 4, 6), kInvalidArgument,
                      "row_stride = 6 is less than H*D = 8");
  STRATA_EXPECT_ERROR(rope_backward(cpu.ctx, f32(&x), f32(&x), nullptr, 1, 1, 1, 2, 0), kInvalidArgument,
                      "'table' is null");
}

}  // namespace
}  // namespace strata::kernels
