// GELU (tanh form) and SwiGLU: forward and backward against float64 for both storage types at
// awkward sizes, accumulation, in-place use and finite differences.
// Tolerances: ref::kF32Tol for fp32 (2x for the backward, which chains tanh and polynomials),
// ref::kBF16Tol for bf16.
#include "harness/harness.hpp"
#include "kernel_ref/reference.hpp"

namespace strata::kernels {
namespace {

using ref::TestTensor;
using ref::Vec;

ref::Tolerance grad_tolerance(DType dt) {
  const ref::Tolerance t = ref::tolerance_for(dt);
  return {2 * t.atol, 2 * t.rtol};
}

class ActivationTest : public ::testing::TestWithParam<DType> {};

TEST_P(ActivationTest, GeluMatchesReferenceAtAwkwardSizes) {
  const DType dt = GetParam();
  ref::CpuContext cpu;
  for (std::size_t n :
       {std::size_t{1}, std::size_t{17}, std::size_t{1025}, std::size_t{4097}, std::size_t{65537}}) {
    const Vec x = ref::as_stored(dt, ref::random_vec(n, 1, 3.0));
    const Vec dy = ref::as_stored(dt, ref::random_vec(n, 2));
    TestTensor tx = TestTensor::from(dt, x), ty(dt, n), tdy = TestTensor::from(dt, dy), tdx(dt, n);
    STRATA_ASSERT_OK(gelu_forward(cpu.ctx, ty.arg(), tx.carg(), n));
    STRATA_ASSERT_OK(gelu_backward(cpu.ctx, tdx.arg(), tdy.carg(), tx.carg(), n, Accumulate::kOverwrite));
    Vec y(n), dx(n);
    for (std::size_t i = 0; i < n; ++i) {
      y[i] = ref::gelu(x[i]);
      dx[i] = dy[i] * ref::gelu_grad(x[i]);
    }
    ref::expect_close(ty.values(), y, ref::tolerance_for(dt), "gelu n=" + std::to_string(n));
    ref::expect_close(tdx.values(), dx, grad_tolerance(dt), "gelu backward n=" + std::to_string(n));

    // In place: dinp aliases dout, then accumulate a second time.
    STRATA_ASSERT_OK(gelu_backward(cpu.ctx, tdy.arg(), tdy.carg(), tx.carg(), n, Accumulate::kOverwrite));
    ref::expect_close(tdy.values(), dx, grad_tolerance(dt), "gelu backward in place");
    STRATA_ASSERT_OK(
        gelu_backward(cpu.ctx, tdx.arg(), TestTensor::from(dt, dy).carg(), tx.carg(), n, Accumulate::kAdd));
    Vec twice(n);
    for (std::size_t i = 0; i < n; ++i) twice[i] = 2 * dx[i];
    ref::expect_close(tdx.values(), twice, grad_tolerance(dt), "gelu backward accumulate");
  }
}

TEST_P(ActivationTest, SwigluMatchesReference) {
  const DType dt = GetParam();
  ref::CpuContext cpu;
  for (auto [rows, F] : {std::pair{1, 1}, std::pair{3, 1025}, std::pair{17, 64}}) {
    const std::size_t n = static_cast<std::size_t>(rows) * F;
    const Vec gu = ref::as_stored(dt, ref::random_vec(2 * n, 3, 2.0));
    const Vec dy = ref::as_stored(dt, ref::random_vec(n, 4));
    const Vec d0 = ref::as_stored(dt, ref::random_vec(2 * n, 5));
    TestTensor tgu = TestTensor::from(dt, gu), ty(dt, n), tdy = TestTensor::from(dt, dy);
    TestTensor tdgu = TestTensor::from(dt, d0);
    STRATA_ASSERT_OK(swiglu_forward(cpu.ctx, ty.arg(), tgu.carg(), rows, F));
    STRATA_ASSERT_OK(swiglu_backward(cpu.ctx, tdgu.arg(), tdy.carg(), tgu.carg(), rows, F, Accumulate::kAdd));
    const std::string what = "swiglu rows=" + std::to_string(rows) + " F=" + std::to_string(F);
    ref::expect_close(ty.values(), ref::swiglu_forward(gu, rows, F), ref::tolerance_for(dt), what);
    Vec want = ref::swiglu_backward(dy, gu, rows, F);
    for (std::size_t i = 0; i < want.size(); ++i) want[i] += d0[i];
    ref::expect_close(tdgu.values(), want, grad_tolerance(dt), what + " backward");
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, ActivationTest, ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(Activation, BackwardsMatchFiniteDifferences) {
  ref::CpuContext cpu;
  const int n = 24;
  const Vec x = ref::as_stored(DType::kF32, ref::random_vec(n, 1, 2.0));
  const Vec r = ref::random_vec(n, 2);
  {
    auto loss = [&](const Vec& p) {
      TestTensor tx = TestTensor::from(DType::kF32, p), ty(DType::kF32, n);
      EXPECT_TRUE(gelu_forward(cpu.ctx, ty.arg(), tx.carg(), n).ok());
      return ref::dot(ty.values(), r);
    };
    TestTensor tx = TestTensor::from(DType::kF32, x), tr = TestTensor::from(DType::kF32, r),
               tdx(DType::kF32, n);
    STRATA_ASSERT_OK(gelu_backward(cpu.ctx, tdx.arg(), tr.carg(), tx.carg(), n, Accumulate::kOverwrite));
    ref::expect_fd_match(loss, x, tdx.values(), "gelu");
  }
  {
    const int rows = 3, F = 4;  // gate_up is (3, 8) = the 24 values of x
    auto loss = [&](const Vec& p) {
      TestTensor tgu = TestTensor::from(DType::kF32, p), ty(DType::kF32, rows * F);
      EXPECT_TRUE(swiglu_forward(cpu.ctx, ty.arg(), tgu.carg(), rows, F).ok());
      return ref::dot(ty.values(), Vec(r.begin(), r.begin() + rows * F));
    };
    TestTensor tgu = TestTensor::from(DType::kF32, x), tr = TestTensor::from(DType::kF32, r),
               tdgu(DType::kF32, n);
    STRATA_ASSERT_OK(
        swiglu_backward(cpu.ctx, tdgu.arg(), tr.carg(), tgu.carg(), rows, F, Accumulate::kOverwrite));
    ref::expect_fd_match(loss, x, tdgu.values(), "swiglu");
  }
}

TEST(Activation, BadArgumentsAreNamed) {
  ref::CpuContext cpu;
  float x = 0;
  STRATA_EXPECT_ERROR(gelu_backward(cpu.ctx, f32(&x), f32(&x), kNone, 1, Accumulate::kOverwrite),
                      kInvalidArgument, "'inp' is null");
  STRATA_EXPECT_ERROR(swiglu_forward(cpu.ctx, f32(&x), f32(&x), 1, 0), kInvalidArgument, "F = 0");
}

}  // namespace
}  // namespace strata::kernels
