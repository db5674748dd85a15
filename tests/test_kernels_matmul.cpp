// Matmul (oneDNN on cpu): gemm with every transpose and accumulate, the linear layer's forward
// and backward against float64, finite differences, bf16 against fp32, the plan cache, errors.
// Tolerances: fp32 within ref::kF32Tol scaled by √(K/1024)+1 (K-term fp32 sums); bf16 inputs
// with fp32 accumulation within ref::kBF16Tol.
#include <cmath>

#include "harness/harness.hpp"
#include "kernel_ref/reference.hpp"

namespace strata::kernels {
namespace {

using ref::TestTensor;
using ref::Vec;

ref::Tolerance gemm_tolerance(DType dt, int K) {
  ref::Tolerance t = ref::tolerance_for(dt);
  const double grow = 1.0 + std::sqrt(K / 1024.0);
  return {t.atol * grow, t.rtol * grow};
}

struct GemmCase {
  int M, N, K;
};

class GemmTest : public ::testing::TestWithParam<DType> {};

TEST_P(GemmTest, EveryTransposeBiasAndAccumulateMatchesReference) {
  const DType dt = GetParam();
  ref::CpuContext cpu;
  std::uint32_t seed = 10;
  for (GemmCase g : {GemmCase{17, 33, 1025}, GemmCase{1, 1, 3}, GemmCase{64, 96, 64}, GemmCase{5, 257, 16}}) {
    for (int ta = 0; ta < 2; ++ta) {
      for (int tb = 0; tb < 2; ++tb) {
        for (int with_bias = 0; with_bias < 2; ++with_bias) {
          for (int add = 0; add < 2; ++add) {
            // The output is fp32 when accumulating, so accumulation across calls keeps precision.
            const DType cdt = add ? DType::kF32 : dt;
            const Vec a = ref::as_stored(dt, ref::random_vec(static_cast<std::size_t>(g.M) * g.K, ++seed));
            const Vec b = ref::as_stored(dt, ref::random_vec(static_cast<std::size_t>(g.K) * g.N, ++seed));
            const Vec bias = ref::as_stored(dt, ref::random_vec(g.N, ++seed));
            const Vec c0 = ref::as_stored(cdt, ref::random_vec(static_cast<std::size_t>(g.M) * g.N, ++seed));
            TestTensor ta_t = TestTensor::from(dt, a), tb_t = TestTensor::from(dt, b);
            TestTensor tbias = TestTensor::from(dt, bias), tc = TestTensor::from(cdt, c0);
            STRATA_ASSERT_OK(
                gemm(cpu.ctx, tc.arg(), ta_t.carg(), tb_t.carg(), with_bias ? tbias.carg() : kNone, g.M, g.N,
                     g.K, ta ? Transpose::kYes : Transpose::kNo, tb ? Transpose::kYes : Transpose::kNo,
                     add ? Accumulate::kAdd : Accumulate::kOverwrite));
            const Vec want =
                ref::gemm(a, b, with_bias ? &bias : nullptr, add ? &c0 : nullptr, g.M, g.N, g.K, ta, tb);
            ref::expect_close(tc.values(), want, gemm_tolerance(cdt == DType::kF32 ? dt : cdt, g.K),
                              "gemm M=" + std::to_string(g.M) + " N=" + std::to_string(g.N) +
                                  " K=" + std::to_string(g.K) + " ta=" + std::to_string(ta) +
                                  " tb=" + std::to_string(tb) + " bias=" + std::to_string(with_bias) +
                                  " add=" + std::to_string(add));
          }
        }
      }
    }
  }
}

TEST_P(GemmTest, LinearForwardAndBackwardMatchReference) {
  const DType dt = GetParam();
  ref::CpuContext cpu;
  const int M = 19, K = 1025, N = 40;
  const Vec x = ref::as_stored(dt, ref::random_vec(static_cast<std::size_t>(M) * K, 1));
  const Vec w = ref::as_stored(dt, ref::random_vec(static_cast<std::size_t>(N) * K, 2, 0.05));
  const Vec bias = ref::as_stored(dt, ref::random_vec(N, 3));
  const Vec dy = ref::as_stored(dt, ref::random_vec(static_cast<std::size_t>(M) * N, 4));
  TestTensor tx = TestTensor::from(dt, x), tw = TestTensor::from(dt, w), tb = TestTensor::from(dt, bias);
  TestTensor ty(dt, static_cast<std::size_t>(M) * N), tdy = TestTensor::from(dt, dy);
  STRATA_ASSERT_OK(matmul_forward(cpu.ctx, ty.arg(), tx.carg(), tw.carg(), tb.carg(), M, K, N));
  ref::expect_close(ty.values(), ref::gemm(x, w, &bias, nullptr, M, N, K, false, true), gemm_tolerance(dt, K),
                    "matmul_forward");

  // Parameter gradients accumulate into what is there (fp32 here); dinp is written.
  const Vec dw0 = ref::random_vec(static_cast<std::size_t>(N) * K, 5);
  const Vec db0 = ref::random_vec(N, 6);
  TestTensor tdx(dt, static_cast<std::size_t>(M) * K), tdw = TestTensor::from(DType::kF32, dw0),
                                                       tdb = TestTensor::from(DType::kF32, db0);
  tdx.fill(7.0);
  STRATA_ASSERT_OK(matmul_backward(cpu.ctx, tdx.arg(), tdw.arg(), tdb.arg(), tdy.carg(), tx.carg(), tw.carg(),
                                   M, K, N, Accumulate::kOverwrite));
  ref::expect_close(tdx.values(), ref::gemm(dy, w, nullptr, nullptr, M, K, N, false, false),
                    gemm_tolerance(dt, N), "dinp");
  const Vec dw0_stored = ref::as_stored(DType::kF32, dw0);
  ref::expect_close(tdw.values(), ref::gemm(dy, x, nullptr, &dw0_stored, N, K, M, true, false),
                    gemm_tolerance(dt, M), "dweight");
  Vec db_want = ref::as_stored(DType::kF32, db0);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) db_want[n] += dy[m * N + n];
  ref::expect_close(tdb.values(), db_want, gemm_tolerance(dt, M), "dbias");

  // kAdd on dinp adds to what is there.
  const Vec dx_before = tdx.values();
  STRATA_ASSERT_OK(matmul_backward(cpu.ctx, tdx.arg(), kNoOutput, kNoOutput, tdy.carg(), tx.carg(), tw.carg(),
                                   M, K, N, Accumulate::kAdd));
  Vec twice(dx_before.size());
  for (std::size_t i = 0; i < twice.size(); ++i) twice[i] = 2 * dx_before[i];
  ref::expect_close(tdx.values(), twice, gemm_tolerance(dt, N), "dinp accumulate");
}

INSTANTIATE_TEST_SUITE_P(DTypes, GemmTest, ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(Matmul, BackwardMatchesFiniteDifferences) {
  ref::CpuContext cpu;
  const int M = 3, K = 5, N = 4;
  const std::size_t nx = M * K, nw = N * K;
  const Vec x = ref::as_stored(DType::kF32, ref::random_vec(nx, 1));
  const Vec w = ref::as_stored(DType::kF32, ref::random_vec(nw, 2));
  const Vec bias = ref::as_stored(DType::kF32, ref::random_vec(N, 3));
  const Vec r = ref::random_vec(M * N, 4);
  auto loss = [&](const Vec& p) {  // p = [x | w | bias]
    TestTensor tx = TestTensor::from(DType::kF32, Vec(p.begin(), p.begin() + nx));
    TestTensor tw = TestTensor::from(DType::kF32, Vec(p.begin() + nx, p.begin() + nx + nw));
    TestTensor tb = TestTensor::from(DType::kF32, Vec(p.begin() + nx + nw, p.end()));
    TestTensor ty(DType::kF32, M * N);
    EXPECT_TRUE(matmul_forward(cpu.ctx, ty.arg(), tx.carg(), tw.carg(), tb.carg(), M, K, N).ok());
    return ref::dot(ty.values(), r);
  };
  TestTensor tx = TestTensor::from(DType::kF32, x), tw = TestTensor::from(DType::kF32, w);
  TestTensor tr = TestTensor::from(DType::kF32, r), tdx(DType::kF32, nx), tdw(DType::kF32, nw),
             tdb(DType::kF32, N);
  STRATA_ASSERT_OK(matmul_backward(cpu.ctx, tdx.arg(), tdw.arg(), tdb.arg(), tr.carg(), tx.carg(), tw.carg(),
                                   M, K, N, Accumulate::kOverwrite));
  Vec p = x, g = tdx.values();
  p.insert(p.end(), w.begin(), w.end());
  p.insert(p.end(), bias.begin(), bias.end());
  for (const Vec& part : {tdw.values(), tdb.values()}) g.insert(g.end(), part.begin(), part.end());
  ref::expect_fd_match(loss, p, g, "matmul");
}

TEST(Matmul, Bf16AgreesWithFp32OnTheSameInputs) {
  ref::CpuContext cpu;
  const int M = 64, K = 768, N = 96;
  const Vec x = ref::as_stored(DType::kBF16, ref::random_vec(static_cast<std::size_t>(M) * K, 1));
  const Vec w = ref::as_stored(DType::kBF16, ref::random_vec(static_cast<std::size_t>(N) * K, 2, 0.05));
  Vec out[2];
  int i = 0;
  for (DType dt : {DType::kF32, DType::kBF16}) {
    TestTensor tx = TestTensor::from(dt, x), tw = TestTensor::from(dt, w),
               ty(dt, static_cast<std::size_t>(M) * N);
    STRATA_ASSERT_OK(matmul_forward(cpu.ctx, ty.arg(), tx.carg(), tw.carg(), kNone, M, K, N));
    out[i++] = ty.values();
  }
  ref::expect_close(out[1], out[0], ref::kBF16Tol, "bf16 vs fp32");
}

// fp16 inputs (11 significant bits) with fp32 accumulation; the output rounds once to fp16.
TEST(Matmul, F16AgreesWithFp32OnTheSameInputs) {
  ref::CpuContext cpu;
  const int M = 64, K = 768, N = 96;
  const Vec x = ref::as_stored(DType::kF16, ref::random_vec(static_cast<std::size_t>(M) * K, 1));
  const Vec w = ref::as_stored(DType::kF16, ref::random_vec(static_cast<std::size_t>(N) * K, 2, 0.05));
  const Vec bias = ref::as_stored(DType::kF16, ref::random_vec(static_cast<std::size_t>(N), 3));
  Vec out[2];
  int i = 0;
  for (DType dt : {DType::kF32, DType::kF16}) {
    TestTensor tx = TestTensor::from(dt, x), tw = TestTensor::from(dt, w), tb = TestTensor::from(dt, bias),
               ty(dt, static_cast<std::size_t>(M) * N);
    STRATA_ASSERT_OK(matmul_forward(cpu.ctx, ty.arg(), tx.carg(), tw.carg(), tb.carg(), M, K, N));
    out[i++] = ty.values();
  }
  ref::expect_close(out[1], out[0], ref::kF16Tol, "f16 vs fp32");
}

TEST(Matmul, PlansAreCachedByShapeAndResultsRepeatBitwise) {
  ref::CpuContext cpu;
  const int M = 33, K = 64, N = 48;
  TestTensor tx = TestTensor::from(DType::kF32, ref::random_vec(M * K, 1));
  TestTensor tw = TestTensor::from(DType::kF32, ref::random_vec(N * K, 2));
  TestTensor y1(DType::kF32, M * N), y2(DType::kF32, M * N);
  EXPECT_EQ(cpu.state->cached_plans(), 0u);
  STRATA_ASSERT_OK(matmul_forward(cpu.ctx, y1.arg(), tx.carg(), tw.carg(), kNone, M, K, N));
  EXPECT_EQ(cpu.state->cached_plans(), 1u);
  STRATA_ASSERT_OK(matmul_forward(cpu.ctx, y2.arg(), tx.carg(), tw.carg(), kNone, M, K, N));
  EXPECT_EQ(cpu.state->cached_plans(), 1u);
  EXPECT_EQ(y1.values(), y2.values());
  STRATA_ASSERT_OK(matmul_forward(cpu.ctx, y2.arg(), tx.carg(), tw.carg(), kNone, M - 1, K, N));
  EXPECT_EQ(cpu.state->cached_plans(), 2u);
}

TEST(Matmul, EmptyInnerDimensionGivesTheBias) {
  ref::CpuContext cpu;
  TestTensor bias = TestTensor::from(DType::kF32, {1.0, 2.0, 3.0}), c(DType::kF32, 6);
  c.fill(10.0);
  STRATA_ASSERT_OK(gemm(cpu.ctx, c.arg(), kNone, kNone, bias.carg(), 2, 3, 0, Transpose::kNo, Transpose::kNo,
                        Accumulate::kAdd));
  EXPECT_EQ(c.values(), (Vec{11, 12, 13, 11, 12, 13}));
}

TEST(Matmul, BadArgumentsAreNamed) {
  ref::CpuContext cpu;
  float a = 1, b = 1, c = 0;
  std::uint16_t hb = 0;
  KernelContext no_state = cpu.ctx;
  no_state.state = nullptr;
  STRATA_EXPECT_ERROR(matmul_forward(no_state, f32(&c), f32(&a), f32(&b), kNone, 1, 1, 1), kInvalidArgument,
                      "KernelContext::state is null");
  STRATA_EXPECT_ERROR(matmul_forward(cpu.ctx, f32(&c), f32(&a), bf16(&hb), kNone, 1, 1, 1), kInvalidArgument,
                      "'inp' is f32 but 'weight' is bf16");
  STRATA_EXPECT_ERROR(gemm(cpu.ctx, f32(&c), f32(&a), f32(&b), kNone, 1, -2, 1, Transpose::kNo,
                           Transpose::kNo, Accumulate::kOverwrite),
                      kInvalidArgument, "N = -2");
  STRATA_EXPECT_ERROR(matmul_backward(cpu.ctx, f32(&c), kNoOutput, kNoOutput, f32(&a), kNone, kNone, 1, 1, 1,
                                      Accumulate::kOverwrite),
                      kInvalidArgument, "'weight' is null");
}

}  // namespace
}  // namespace strata::kernels
