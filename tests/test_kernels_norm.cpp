// LayerNorm and RMSNorm: forward and backward against float64 for both storage types at
// awkward widths, finite differences, accumulation, and independence from the thread count.
// Tolerances: ref::kF32Tol for fp32, ref::kBF16Tol for bf16 (the output's one rounding; the
// statistics are fp32 either way).
#include "harness/harness.hpp"
#include "kernel_ref/reference.hpp"

namespace strata::kernels {
namespace {

using ref::TestTensor;
using ref::Vec;

constexpr float kEps = 1e-5f;

struct NormRun {
  Vec out, mean, rstd, dx, dw, db;
};

// Runs forward and backward of LayerNorm (rms = false) or RMSNorm on `cpu`.
NormRun run_norm(ref::CpuContext& cpu, bool rms, DType dt, const Vec& x, const Vec& w, const Vec& b,
                 const Vec& dy, int rows, int C, Accumulate mode = Accumulate::kOverwrite,
                 const Vec* dx0 = nullptr) {
  TestTensor tx = TestTensor::from(dt, x), tw = TestTensor::from(dt, w), tb = TestTensor::from(dt, b);
  TestTensor ty(dt, x.size()), tdy = TestTensor::from(dt, dy), tdx(dt, x.size());
  if (dx0 != nullptr) tdx.set(*dx0);
  TestTensor tdw(DType::kF32, C), tdb(DType::kF32, C);
  std::vector<float> mean(rows), rstd(rows);
  NormRun r;
  if (rms) {
    EXPECT_TRUE(rmsnorm_forward(cpu.ctx, ty.arg(), rstd.data(), tx.carg(), tw.carg(), rows, C, kEps).ok());
    EXPECT_TRUE(rmsnorm_backward(cpu.ctx, tdx.arg(), tdw.arg(), tdy.carg(), tx.carg(), tw.carg(), rstd.data(),
                                 rows, C, mode)
                    .ok());
  } else {
    EXPECT_TRUE(layernorm_forward(cpu.ctx, ty.arg(), mean.data(), rstd.data(), tx.carg(), tw.carg(),
                                  tb.carg(), rows, C, kEps)
                    .ok());
    EXPECT_TRUE(layernorm_backward(cpu.ctx, tdx.arg(), tdw.arg(), tdb.arg(), tdy.carg(), tx.carg(), tw.carg(),
                                   mean.data(), rstd.data(), rows, C, mode)
                    .ok());
  }
  r.out = ty.values();
  r.mean = Vec(mean.begin(), mean.end());
  r.rstd = Vec(rstd.begin(), rstd.end());
  r.dx = tdx.values();
  r.dw = tdw.values();
  r.db = tdb.values();
  return r;
}

struct NormCase {
  bool rms;
  DType dtype;
};

class NormTest : public ::testing::TestWithParam<NormCase> {};

TEST_P(NormTest, ForwardAndBackwardMatchReferenceAtAwkwardWidths) {
  const auto [rms, dt] = GetParam();
  ref::CpuContext cpu;
  std::uint32_t seed = 1;
  for (auto [rows, C] : {std::pair{1, 1}, std::pair{7, 17}, std::pair{37, 1025}, std::pair{300, 64}}) {
    const std::size_t n = static_cast<std::size_t>(rows) * C;
    Vec x = ref::random_vec(n, ++seed, 2.0);
    for (auto& v : x) v += 0.5;  // a non-zero mean, as activations have
    x = ref::as_stored(dt, x);
    const Vec w = ref::as_stored(dt, ref::random_vec(C, ++seed));
    const Vec b = ref::as_stored(dt, ref::random_vec(C, ++seed));
    const Vec dy = ref::as_stored(dt, ref::random_vec(n, ++seed));
    const NormRun got = run_norm(cpu, rms, dt, x, w, b, dy, rows, C);
    const ref::NormForward f = ref::norm_forward(rms, x, w, rms ? nullptr : &b, rows, C, kEps);
    const ref::NormBackward g = ref::norm_backward(rms, dy, x, w, rows, C, kEps);
    const std::string what = std::string(rms ? "rmsnorm" : "layernorm") + " rows=" + std::to_string(rows) +
                             " C=" + std::to_string(C);
    const ref::Tolerance tol = ref::tolerance_for(dt);
    if (C > 1) {  // with C = 1 LayerNorm's output is exactly the bias; rstd is then 1/√ε
      ref::expect_close(got.out, f.out, tol, what + " out");
      ref::expect_close(got.rstd, f.rstd, ref::kF32Tol, what + " rstd");
    }
    if (!rms) ref::expect_close(got.mean, f.mean, ref::kF32Tol, what + " mean");
    // The weight gradients sum `rows` terms; dx combines C terms with cancellation.
    const ref::Tolerance grad_tol{tol.atol * 4, tol.rtol * 4};
    // With C = 1, dx = rstd·g·(1 - x̂²) cancels to O(ε) and says nothing about the kernel.
    if (C > 1) ref::expect_close(got.dx, g.dx, grad_tol, what + " dx");
    ref::expect_close(got.dw, g.dw, grad_tol, what + " dweight");
    if (!rms) ref::expect_close(got.db, g.db, grad_tol, what + " dbias");
  }
}

INSTANTIATE_TEST_SUITE_P(Norms, NormTest,
                         ::testing::Values(NormCase{false, DType::kF32}, NormCase{false, DType::kBF16},
                                           NormCase{true, DType::kF32}, NormCase{true, DType::kBF16},
                                           NormCase{false, DType::kF16}, NormCase{true, DType::kF16}),
                         [](const auto& info) {
                           return std::string(info.param.rms ? "rmsnorm_" : "layernorm_") +
                                  std::string(to_string(info.param.dtype));
                         });

TEST(Norm, BackwardMatchesFiniteDifferences) {
  ref::CpuContext cpu;
  const int rows = 3, C = 6;
  const std::size_t n = rows * C;
  for (bool rms : {false, true}) {
    const Vec x = ref::as_stored(DType::kF32, ref::random_vec(n, 1));
    const Vec w = ref::as_stored(DType::kF32, ref::random_vec(C, 2));
    const Vec b = ref::as_stored(DType::kF32, ref::random_vec(C, 3));
    const Vec r = ref::random_vec(n, 4);
    auto loss = [&](const Vec& p) {  // p = [x | w | b]
      TestTensor tx = TestTensor::from(DType::kF32, Vec(p.begin(), p.begin() + n));
      TestTensor tw = TestTensor::from(DType::kF32, Vec(p.begin() + n, p.begin() + n + C));
      TestTensor tb = TestTensor::from(DType::kF32, Vec(p.begin() + n + C, p.end()));
      TestTensor ty(DType::kF32, n);
      if (rms) {
        EXPECT_TRUE(rmsnorm_forward(cpu.ctx, ty.arg(), nullptr, tx.carg(), tw.carg(), rows, C, kEps).ok());
      } else {
        EXPECT_TRUE(layernorm_forward(cpu.ctx, ty.arg(), nullptr, nullptr, tx.carg(), tw.carg(), tb.carg(),
                                      rows, C, kEps)
                        .ok());
      }
      return ref::dot(ty.values(), r);
    };
    const NormRun got = run_norm(cpu, rms, DType::kF32, x, w, b, r, rows, C);
    Vec p = x, g = got.dx;
    p.insert(p.end(), w.begin(), w.end());
    p.insert(p.end(), b.begin(), b.end());
    g.insert(g.end(), got.dw.begin(), got.dw.end());
    g.insert(g.end(), got.db.begin(), got.db.end());  // zero for rmsnorm, which has no bias
    ref::expect_fd_match(loss, p, g, rms ? "rmsnorm" : "layernorm", 4, 1e-2, 3e-3);
  }
}

TEST(Norm, AccumulateAddsIntoTheInputGradient) {
  ref::CpuContext cpu;
  const int rows = 5, C = 33;
  const std::size_t n = rows * C;
  const Vec x = ref::random_vec(n, 1), w = ref::random_vec(C, 2), b = ref::random_vec(C, 3),
            dy = ref::random_vec(n, 4);
  const Vec dx0 = ref::as_stored(DType::kF32, ref::random_vec(n, 5));
  for (bool rms : {false, true}) {
    const NormRun fresh = run_norm(cpu, rms, DType::kF32, x, w, b, dy, rows, C);
    const NormRun added = run_norm(cpu, rms, DType::kF32, x, w, b, dy, rows, C, Accumulate::kAdd, &dx0);
    Vec want(n);
    for (std::size_t i = 0; i < n; ++i) want[i] = dx0[i] + fresh.dx[i];
    ref::expect_close(added.dx, want, ref::kF32Tol, rms ? "rmsnorm" : "layernorm");
  }
}

TEST(Norm, ResultsDoNotDependOnTheThreadCount) {
  ref::CpuContext one(1), three(3);
  const int rows = 1000, C = 96;  // many row blocks for the weight-gradient partials
  const std::size_t n = rows * C;
  const Vec x = ref::random_vec(n, 1), w = ref::random_vec(C, 2), b = ref::random_vec(C, 3),
            dy = ref::random_vec(n, 4);
  for (bool rms : {false, true}) {
    const NormRun a = run_norm(one, rms, DType::kF32, x, w, b, dy, rows, C);
    const NormRun c = run_norm(three, rms, DType::kF32, x, w, b, dy, rows, C);
    EXPECT_EQ(a.out, c.out);
    EXPECT_EQ(a.dx, c.dx);
    EXPECT_EQ(a.dw, c.dw);
    EXPECT_EQ(a.db, c.db);
  }
}

TEST(Norm, BadArgumentsAreNamed) {
  ref::CpuContext cpu;
  float x = 1, w = 1, y = 0, s = 0;
  STRATA_EXPECT_ERROR(layernorm_forward(cpu.ctx, f32(&y), &s, &s, f32(&x), kNone, kNone, 1, 1, kEps),
                      kInvalidArgument, "'weight' is null");
  STRATA_EXPECT_ERROR(rmsnorm_forward(cpu.ctx, f32(&y), &s, f32(&x), f32(&w), 1, 0, kEps), kInvalidArgument,
                      "C = 0");
  STRATA_EXPECT_ERROR(rmsnorm_forward(cpu.ctx, f32(&y), &s, f32(&x), f32(&w), 1, 1, 0.0f), kInvalidArgument,
                      "eps");
  STRATA_EXPECT_ERROR(layernorm_backward(cpu.ctx, f32(&y), f32(&y), kNoOutput, f32(&x), f32(&x), f32(&w),
                                         nullptr, &s, 1, 1, Accumulate::kOverwrite),
                      kInvalidArgument, "'mean' is null");
}

}  // namespace
}  // namespace strata::kernels
