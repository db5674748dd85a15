// The gradient scan (unscale, inf/nan detection, sum of squares) on every ISA, and clipping by
// a global norm over several buffers.
//
// Tolerance: the scan sums exact squares in double, so against a long-double reference sum the
// relative error is below n * 2^-53 (we check 1e-12 for n <= 2^20 + 3). Across ISAs and thread
// counts the sums must be bitwise equal (the summation order is fixed by n alone).
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "harness/harness.hpp"
#include "optim/numerics.hpp"
#include "optim_isa.hpp"
#include "optim_reference.hpp"
#include "strata/optim.hpp"

namespace strata {
namespace {

using optim_detail::f32_to_bf16;
using optim_detail::f32_to_f16;

// Per-ISA tests: one instance per path, skipped with the reason where this CPU lacks it.
class OptimScanIsa : public testing::OptimizerIsaTest {};
STRATA_INSTANTIATE_OPTIMIZER_ISAS(OptimScanIsa);

CpuOptimizer make_optimizer(SimdIsa isa, int threads) {
  CpuOptimizerConfig c;
  c.isa = isa;
  c.threads = threads;
  auto r = CpuOptimizer::create(c);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return std::move(r).value();
}

// A gradient buffer of some dtype, shifted off vector alignment by `misalign` elements.
struct GradBuffer {
  std::vector<unsigned char> bytes;
  void* data = nullptr;
  DType dtype = DType::kF32;
  std::size_t n = 0;

  GradBuffer(std::size_t n_, DType dt, std::size_t misalign, std::uint32_t seed, float scale)
      : dtype(dt), n(n_) {
    bytes.assign((n + 64) * 4 + 64, 0);
    auto base = (reinterpret_cast<std::uintptr_t>(bytes.data()) + 63) / 64 * 64;
    data = reinterpret_cast<void*>(base + misalign * dtype_size(dt));
    if (scale <= 0) return;
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, scale);
    for (std::size_t i = 0; i < n; ++i) set(i, normal(rng));
  }
  void set(std::size_t i, float x) {
    if (dtype == DType::kF32)
      static_cast<float*>(data)[i] = x;
    else if (dtype == DType::kBF16)
      static_cast<std::uint16_t*>(data)[i] = f32_to_bf16(x);
    else
      static_cast<std::uint16_t*>(data)[i] = f32_to_f16(x);
  }
  double get(std::size_t i) const {
    if (dtype == DType::kF32) return static_cast<const float*>(data)[i];
    if (dtype == DType::kBF16) return testing::ref_bf16_to_double(static_cast<const std::uint16_t*>(data)[i]);
    return testing::ref_f16_to_double(static_cast<const std::uint16_t*>(data)[i]);
  }
  std::vector<unsigned char> contents() const {
    const auto* p = static_cast<const unsigned char*>(data);
    return {p, p + n * dtype_size(dtype)};
  }
};

const DType kTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

// Each path, at several thread counts, must equal the scalar path on one thread bit for bit.
TEST_P(OptimScanIsa, SumOfSquaresMatchesReferenceAndIsBitwiseAcrossIsasAndThreads) {
  const float inv_scale = 1.0f / 1024.0f;
  for (DType dt : kTypes) {
    for (std::size_t n : testing::awkward_sizes()) {
      const GradBuffer g(n, dt, n % 5 + 1, static_cast<std::uint32_t>(n), 100.0f);
      long double want = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const long double y = static_cast<float>(g.get(i) * inv_scale);  // y is formed in fp32
        want += y * y;
      }
      double first = -1;
      for (SimdIsa isa : {SimdIsa::kScalar, GetParam()}) {
        for (int threads : {1, 2, 5}) {
          GradBuffer copy = g;
          copy.data = copy.bytes.data() + (static_cast<unsigned char*>(g.data) - g.bytes.data());
          const auto before = copy.contents();
          auto s = make_optimizer(isa, threads).scan_gradients(copy.data, dt, n, inv_scale, false);
          ASSERT_TRUE(s.ok()) << s.status().to_string();
          EXPECT_EQ(s->count, n);
          EXPECT_TRUE(s->finite());
          EXPECT_NEAR(s->sum_of_squares, static_cast<double>(want), 1e-12 * static_cast<double>(want))
              << to_string(dt) << " n=" << n << " " << to_string(isa);
          if (first < 0) first = s->sum_of_squares;
          EXPECT_EQ(s->sum_of_squares, first)
              << to_string(dt) << " n=" << n << " " << to_string(isa) << " threads " << threads
              << " is not bitwise equal to the scalar path on one thread";
          EXPECT_TRUE(copy.contents() == before) << "a read-only scan wrote to the gradients";
        }
      }
    }
  }
}

TEST_P(OptimScanIsa, DetectsInfAndNanAnywhere) {
  const std::size_t n = 1023;
  for (DType dt : kTypes) {
    {  // this instance's path
      const SimdIsa isa = GetParam();
      const CpuOptimizer opt = make_optimizer(isa, 2);
      for (std::size_t pos : {std::size_t{0}, std::size_t{1}, std::size_t{15}, std::size_t{16},
                              std::size_t{17}, std::size_t{512}, n - 2, n - 1}) {
        for (float bad : {NAN, INFINITY, -INFINITY}) {
          GradBuffer g(n, dt, 3, 11, 1.0f);
          g.set(pos, bad);
          for (bool write : {false, true}) {
            auto s = opt.scan_gradients(g.data, dt, n, 0.5f, write);
            ASSERT_TRUE(s.ok());
            EXPECT_FALSE(s->finite())
                << to_string(dt) << " " << to_string(isa) << " pos " << pos << " value " << bad;
          }
        }
      }
    }
  }
}

// y = g * inv_scale can overflow in fp32 (loss scale below 1), and fp16 write-back can overflow
// the fp16 range: both are overflows the update would see, so both must be reported.
TEST(OptimScan, OverflowCreatedByUnscalingIsDetected) {
  const CpuOptimizer opt = make_optimizer(best_optimizer_isa(), 1);
  GradBuffer g(100, DType::kF32, 0, 1, 1.0f);
  g.set(40, 3e38f);
  auto s = opt.scan_gradients(g.data, DType::kF32, 100, 4.0f, false);
  ASSERT_TRUE(s.ok());
  EXPECT_FALSE(s->finite());
  GradBuffer h(100, DType::kF16, 0, 1, 1.0f);
  h.set(99, 60000.0f);
  auto read_only = opt.scan_gradients(h.data, DType::kF16, 100, 2.0f, false);
  ASSERT_TRUE(read_only.ok());
  EXPECT_TRUE(read_only->finite());  // 120000 is a fine fp32
  auto written = opt.scan_gradients(h.data, DType::kF16, 100, 2.0f, true);
  ASSERT_TRUE(written.ok());
  EXPECT_FALSE(written->finite());  // but not an fp16: the stored gradient became inf
}

TEST_P(OptimScanIsa, WriteUnscaledStoresTheUnscaledGradients) {
  const float inv_scale = 1.0f / 256.0f;
  for (DType dt : kTypes) {
    {  // this instance's path
      const SimdIsa isa = GetParam();
      const std::size_t n = 1027;
      GradBuffer g(n, dt, 1, 5, 300.0f);
      std::vector<double> want(n);
      for (std::size_t i = 0; i < n; ++i) {
        const float y = static_cast<float>(g.get(i)) * inv_scale;
        GradBuffer one(1, dt, 0, 0, 0.0f);
        one.set(0, y);
        want[i] = one.get(0);  // y rounded to the buffer's dtype
      }
      auto s = make_optimizer(isa, 2).scan_gradients(g.data, dt, n, inv_scale, true);
      ASSERT_TRUE(s.ok());
      double sum = 0;
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(g.get(i), want[i]) << to_string(dt) << " " << to_string(isa) << " element " << i;
        sum += want[i] * want[i];
      }
      // The norm is of the stored values (what the update will read).
      EXPECT_NEAR(s->sum_of_squares, sum, 1e-12 * sum);
    }
  }
}

TEST(OptimScan, RejectsBadArguments) {
  const CpuOptimizer opt = make_optimizer(SimdIsa::kScalar, 1);
  float g[4] = {};
  STRATA_EXPECT_ERROR(opt.scan_gradients(g, DType::kF32, 4, 0.0f, false), kInvalidArgument,
                      "inverse loss scale");
  STRATA_EXPECT_ERROR(opt.scan_gradients(nullptr, DType::kF32, 4, 1.0f, false), kInvalidArgument, "null");
  auto empty = opt.scan_gradients(nullptr, DType::kF32, 0, 1.0f, false);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->sum_of_squares, 0.0);
}

// ---- Clipping --------------------------------------------------------------------------------

TEST(OptimClip, CoefficientFollowsTorchAndDeepSpeed) {
  EXPECT_EQ(clip_coefficient(0.5, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(clip_coefficient(4.0, 1.0), 1.0 / (4.0 + 1e-6));
  EXPECT_EQ(clip_coefficient(4.0, 0.0), 1.0);   // disabled
  EXPECT_EQ(clip_coefficient(4.0, -1.0), 1.0);  // disabled
  EXPECT_EQ(clip_coefficient(INFINITY, 1.0), 1.0);
  EXPECT_EQ(clip_coefficient(NAN, 1.0), 1.0);
}

TEST(OptimClip, GlobalNormOverSeveralBuffers) {
  // Three buffers of different dtypes; the global norm is sqrt of the summed squares.
  const CpuOptimizer opt = make_optimizer(best_optimizer_isa(), 2);
  GradBuffer a(1000, DType::kF32, 1, 1, 3.0f);
  GradBuffer b(17, DType::kBF16, 2, 2, 3.0f);
  GradBuffer c(70000, DType::kF16, 3, 3, 3.0f);
  GradStats total;
  double want = 0;
  for (GradBuffer* g : {&a, &b, &c}) {
    auto s = opt.scan_gradients(g->data, g->dtype, g->n, 0.125f, false);
    ASSERT_TRUE(s.ok());
    total.merge(*s);
    for (std::size_t i = 0; i < g->n; ++i) {
      const double y = static_cast<float>(g->get(i) * 0.125);
      want += y * y;
    }
  }
  EXPECT_EQ(total.count, 1000u + 17u + 70000u);
  EXPECT_NEAR(total.norm(), std::sqrt(want), 1e-12 * std::sqrt(want));
  // Merging is how ranks combine too: an inf anywhere makes the merged stats non-finite.
  GradStats poisoned;
  poisoned.sum_of_squares = INFINITY;
  EXPECT_FALSE(GradStats(total).merge(poisoned).finite());
}

}  // namespace
}  // namespace strata
