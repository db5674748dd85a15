// Residual add: forward and backward against float64, both storage types, awkward sizes,
// aliasing, accumulation, argument errors, and the cuda entry point in a cpu-only build.
#include "harness/harness.hpp"
#include "kernel_ref/reference.hpp"
#include "strata/build_config.hpp"

namespace strata::kernels {
namespace {

using ref::TestTensor;
using ref::Vec;

class ResidualTest : public ::testing::TestWithParam<DType> {};

TEST_P(ResidualTest, ForwardMatchesReferenceAtAwkwardSizes) {
  const DType dt = GetParam();
  ref::CpuContext cpu;
  for (std::size_t n :
       {std::size_t{1}, std::size_t{17}, std::size_t{1025}, std::size_t{4097}, std::size_t{65537}}) {
    const Vec a = ref::as_stored(dt, ref::random_vec(n, 1));
    const Vec b = ref::as_stored(dt, ref::random_vec(n, 2));
    TestTensor ta = TestTensor::from(dt, a), tb = TestTensor::from(dt, b), out(dt, n);
    STRATA_ASSERT_OK(
        residual_forward(cpu.ctx, out.arg(), ta.carg(), tb.carg(), static_cast<std::int64_t>(n)));
    Vec want(n);
    for (std::size_t i = 0; i < n; ++i) want[i] = a[i] + b[i];
    ref::expect_close(out.values(), want, ref::tolerance_for(dt), "residual_forward n=" + std::to_string(n));
  }
}

TEST_P(ResidualTest, ForwardInPlaceAndBackwardModes) {
  const DType dt = GetParam();
  ref::CpuContext cpu;
  const std::size_t n = 4099;
  const Vec a = ref::as_stored(dt, ref::random_vec(n, 3));
  const Vec b = ref::as_stored(dt, ref::random_vec(n, 4));
  TestTensor ta = TestTensor::from(dt, a), tb = TestTensor::from(dt, b);
  STRATA_ASSERT_OK(residual_forward(cpu.ctx, ta.arg(), ta.carg(), tb.carg(), n));  // a += b in place
  Vec sum(n);
  for (std::size_t i = 0; i < n; ++i) sum[i] = a[i] + b[i];
  ref::expect_close(ta.values(), sum, ref::tolerance_for(dt), "in place");

  // da = dout (overwrite), db += dout (accumulate onto b)
  const Vec dout = ref::as_stored(dt, ref::random_vec(n, 5));
  TestTensor tdout = TestTensor::from(dt, dout), da(dt, n), db = TestTensor::from(dt, b);
  da.fill(123.0);
  STRATA_ASSERT_OK(residual_backward(cpu.ctx, da.arg(), kNoOutput, tdout.carg(), n, Accumulate::kOverwrite));
  STRATA_ASSERT_OK(residual_backward(cpu.ctx, kNoOutput, db.arg(), tdout.carg(), n, Accumulate::kAdd));
  ref::expect_close(da.values(), dout, ref::tolerance_for(dt), "da");
  Vec db_want(n);
  for (std::size_t i = 0; i < n; ++i) db_want[i] = b[i] + dout[i];
  ref::expect_close(db.values(), db_want, ref::tolerance_for(dt), "db");
}

INSTANTIATE_TEST_SUITE_P(DTypes, ResidualTest, ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(Residual, BackwardMatchesFiniteDifferences) {
  ref::CpuContext cpu;
  const int n = 37;
  const Vec a = ref::as_stored(DType::kF32, ref::random_vec(n, 6));
  const Vec b = ref::as_stored(DType::kF32, ref::random_vec(n, 7));
  const Vec r = ref::random_vec(n, 8);
  auto loss = [&](const Vec& x) {  // x = [a | b]
    TestTensor ta = TestTensor::from(DType::kF32, Vec(x.begin(), x.begin() + n));
    TestTensor tb = TestTensor::from(DType::kF32, Vec(x.begin() + n, x.end()));
    TestTensor out(DType::kF32, n);
    EXPECT_TRUE(residual_forward(cpu.ctx, out.arg(), ta.carg(), tb.carg(), n).ok());
    return ref::dot(out.values(), r);
  };
  TestTensor tr = TestTensor::from(DType::kF32, r), da(DType::kF32, n), db(DType::kF32, n);
  STRATA_ASSERT_OK(residual_backward(cpu.ctx, da.arg(), db.arg(), tr.carg(), n, Accumulate::kOverwrite));
  Vec x = a, grad = da.values();
  x.insert(x.end(), b.begin(), b.end());
  const Vec gb = db.values();
  grad.insert(grad.end(), gb.begin(), gb.end());
  ref::expect_fd_match(loss, x, grad, "residual");
}

TEST(Residual, ZeroSizeIsANoOpAndBadArgumentsAreNamed) {
  ref::CpuContext cpu;
  STRATA_EXPECT_ERROR(residual_forward(cpu.ctx, kNoOutput, kNone, kNone, 0), kInvalidArgument,
                      "'out' is null");
  float x = 1.0f;
  STRATA_EXPECT_ERROR(residual_forward(cpu.ctx, f32(&x), f32(&x), kNone, 1), kInvalidArgument, "'b' is null");
  STRATA_EXPECT_ERROR(residual_forward(cpu.ctx, f32(&x), f32(&x), f32(&x), -1), kInvalidArgument, "n = -1");
  KernelContext bad = cpu.ctx;
  bad.cpu_threads = -3;
  STRATA_EXPECT_ERROR(residual_forward(bad, f32(&x), f32(&x), f32(&x), 1), kInvalidArgument, "cpu_threads");
  STRATA_EXPECT_OK(residual_forward(cpu.ctx, f32(&x), f32(&x), f32(&x), 0));
  std::uint16_t half = 0;
  const auto bogus = static_cast<DType>(7);  // outside the enum
  STRATA_EXPECT_ERROR(residual_forward(cpu.ctx, f32(&x), f32(&x), ConstTensorArg{&half, bogus}, 1),
                      kInvalidArgument, "'b' is unknown; the kernels take f32, bf16 or f16");
  STRATA_EXPECT_ERROR(residual_backward(cpu.ctx, TensorArg{&half, bogus}, kNoOutput, f32(&x), 1,
                                        Accumulate::kOverwrite),
                      kInvalidArgument, "'da' is unknown");
}

// The kernels' fp16 helpers (usable in CUDA device code) round exactly like strata/dtype.hpp:
// every fp16 bit pattern widens identically, and narrowing agrees on edge cases (ties, the
// overflow threshold 65520, subnormals, NaN payloads) and on random floats.
TEST(KernelF16, HelpersMatchTheDtypeModule) {
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const float a = f16_bits_to_f32(static_cast<std::uint16_t>(h));
    const float b = f16_bits_to_float(static_cast<std::uint16_t>(h));
    ASSERT_EQ(std::memcmp(&a, &b, sizeof a), 0) << std::hex << h;
  }
  std::mt19937 gen(5);
  std::vector<std::uint32_t> bits = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00001u,
                                     0x7f800001u, 0x477fe000u, 0x477ff000u, 0x477fefffu, 0x33000000u,
                                     0x33000001u, 0x387fc000u, 0x38800000u, 0x3f801000u, 0x3f803000u};
  for (int i = 0; i < 100000; ++i) bits.push_back(gen());
  for (std::uint32_t u : bits) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    ASSERT_EQ(f32_to_f16_bits_rne(f), float_to_f16_bits(f)) << std::hex << u;
  }
}

// The kernels' bf16 helpers (usable in CUDA device code) round exactly like strata/dtype.hpp.
TEST(KernelBf16, HelpersMatchTheDtypeModule) {
  std::mt19937 gen(3);
  std::vector<std::uint32_t> bits = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u,
                                     0x7fc00001u, 0x7f800001u, 0x3f808000u, 0x3f818000u,
                                     0x7f7fffffu, 0x00000001u, 0x3f7fffffu};
  for (int i = 0; i < 100000; ++i) bits.push_back(gen());
  for (std::uint32_t u : bits) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    ASSERT_EQ(f32_to_bf16_bits_rne(f), float_to_bf16_bits(f)) << std::hex << u;
    const std::uint16_t h = static_cast<std::uint16_t>(u);
    const float a = bf16_bits_to_f32(h), b = bf16_bits_to_float(h);
    ASSERT_EQ(std::memcmp(&a, &b, sizeof a), 0) << std::hex << h;
  }
}

TEST(Residual, CudaBackendWithoutCudaIsUnavailable) {
  if (STRATA_HAVE_CUDA) GTEST_SKIP() << "this build has CUDA; covered by test_gpu_kernels";
  KernelContext ctx;
  ctx.backend = Backend::kCuda;
  float x = 1.0f;
  STRATA_EXPECT_ERROR(residual_forward(ctx, f32(&x), f32(&x), f32(&x), 1), kUnavailable, "no CUDA");
  STRATA_EXPECT_ERROR(KernelState::create(Backend::kCuda), kUnavailable, "no CUDA");
}

}  // namespace
}  // namespace strata::kernels
