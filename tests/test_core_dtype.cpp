// dtype: names, scalar rounding against an independent reference, every SIMD path against the
// scalar path, and the ISA selection.
//
// The reference rounds in double arithmetic over a table of every representable value built from
// the format's fields (not from the library's bit tricks): find the two neighbours of x, compare x
// with their exact midpoint, break ties towards the even pattern.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "harness/harness.hpp"
#include "strata/dtype.hpp"
#include "strata/options.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define STRATA_TEST_X86 1
#else
#define STRATA_TEST_X86 0
#endif

namespace strata {

// Names the path in gtest's messages (found by argument-dependent lookup).
void PrintTo(SimdIsa isa, std::ostream* os) { *os << to_string(isa); }

namespace {

std::uint32_t bits_of(float x) { return std::bit_cast<std::uint32_t>(x); }
float float_of(std::uint32_t u) { return std::bit_cast<float>(u); }

// A 16-bit binary format described by its field widths.
struct Format {
  const char* name;
  int exp_bits;
  int mant_bits;
  std::uint16_t (*narrow)(float);
  float (*widen)(std::uint16_t);
  DType dtype;

  int bias() const { return (1 << (exp_bits - 1)) - 1; }
  std::uint16_t exp_mask() const { return static_cast<std::uint16_t>(((1u << exp_bits) - 1) << mant_bits); }
  std::uint16_t inf_bits() const { return exp_mask(); }
  std::uint16_t quiet_bit() const { return static_cast<std::uint16_t>(1u << (mant_bits - 1)); }
  bool is_nan(std::uint16_t h) const { return (h & 0x7FFFu) > inf_bits(); }
  bool is_inf(std::uint16_t h) const { return (h & 0x7FFFu) == inf_bits(); }

  // The value of a finite pattern from its fields, in double.
  double decode(std::uint16_t h) const {
    const int e = (h >> mant_bits) & ((1 << exp_bits) - 1);
    const int m = h & ((1 << mant_bits) - 1);
    const double magnitude = e == 0 ? std::ldexp(m, 1 - bias() - mant_bits)
                                    : std::ldexp((1 << mant_bits) + m, e - bias() - mant_bits);
    return (h & 0x8000u) ? -magnitude : magnitude;
  }
};

const Format kBf16 = {"bf16", 8, 7, float_to_bf16_bits, bf16_bits_to_float, DType::kBF16};
const Format kF16 = {"f16", 5, 10, float_to_f16_bits, f16_bits_to_float, DType::kF16};

// Round-to-nearest-even into `format`, computed by table search in double.
class Reference {
 public:
  explicit Reference(const Format& f) : f_(f) {
    for (std::uint32_t h = 0; h < f.inf_bits(); ++h)
      values_.push_back(f.decode(static_cast<std::uint16_t>(h)));
    // The first value past the largest finite one if the exponent range went on; rounding to it
    // means overflow to Inf (whose pattern follows the largest finite one).
    values_.push_back(std::ldexp(1.0, f.bias() + 1));
  }

  // Non-NaN inputs only.
  std::uint16_t round(float x) const {
    const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    const double a = std::fabs(static_cast<double>(x));
    if (std::isinf(a)) return sign | f_.inf_bits();
    // values_[i] <= a < values_[i + 1]
    const auto it = std::upper_bound(values_.begin(), values_.end(), a);
    if (it == values_.end()) return sign | f_.inf_bits();
    const std::size_t hi = static_cast<std::size_t>(it - values_.begin());
    const std::size_t lo = hi - 1;
    const double mid = (values_[lo] + values_[hi]) / 2;  // exact: both have few significant bits
    std::size_t pick;
    if (a == values_[lo] || a < mid) {
      pick = lo;
    } else if (a > mid) {
      pick = hi;
    } else {
      pick = (lo % 2 == 0) ? lo : hi;
    }
    return static_cast<std::uint16_t>(sign | pick);
  }

  // The finite non-negative values, indexed by pattern, plus the overflow sentinel.
  const std::vector<double>& values() const { return values_; }

 private:
  const Format& f_;
  std::vector<double> values_;
};

// Checks the NaN contract for narrowing x (a NaN): NaN, same sign, quiet, top payload bits kept.
::testing::AssertionResult narrow_nan_ok(const Format& f, float x, std::uint16_t got) {
  const std::uint32_t u = bits_of(x);
  const int dropped = 23 - f.mant_bits;
  const std::uint16_t payload = static_cast<std::uint16_t>((u & 0x7FFFFFu) >> dropped);
  const std::uint16_t want =
      static_cast<std::uint16_t>(((u >> 16) & 0x8000u) | f.inf_bits() | f.quiet_bit() | payload);
  if (got == want) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << f.name << ": NaN 0x" << std::hex << u << " became 0x" << got << ", expected 0x" << want;
}

// ---- Names and value types ---------------------------------------------------------------------

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF16), 2u);
  EXPECT_EQ(dtype_size(static_cast<DType>(77)), 0u);
  EXPECT_EQ(to_string(DType::kF32), "f32");
  EXPECT_EQ(to_string(DType::kBF16), "bf16");
  EXPECT_EQ(to_string(DType::kF16), "f16");
  EXPECT_EQ(to_string(static_cast<DType>(77)), "unknown");
}

TEST(DType, ParseAcceptsEveryAliasAndNamesBadText) {
  const std::vector<std::pair<std::string, DType>> good = {
      {"fp32", DType::kF32},      {"float32", DType::kF32}, {"f32", DType::kF32},   {"bf16", DType::kBF16},
      {"bfloat16", DType::kBF16}, {"BF16", DType::kBF16},   {"fp16", DType::kF16},  {"float16", DType::kF16},
      {"half", DType::kF16},      {"f16", DType::kF16},     {" fp32 ", DType::kF32}};
  for (const auto& [text, want] : good) {
    auto d = parse_dtype(text);
    ASSERT_TRUE(d.ok()) << text << ": " << d.status().to_string();
    EXPECT_EQ(*d, want) << text;
  }
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) EXPECT_EQ(*parse_dtype(to_string(d)), d);
  STRATA_EXPECT_ERROR(parse_dtype("fp8"), kInvalidArgument, "'fp8'");
  STRATA_EXPECT_ERROR(parse_dtype("fp8"), kInvalidArgument,
                      "f32, fp32, float32, bf16, bfloat16, f16, fp16, float16, half");
  STRATA_EXPECT_ERROR(parse_dtype(""), kInvalidArgument, "unknown dtype ''");
}

TEST(DType, ValueTypesAreTrivial16BitStorage) {
  static_assert(std::is_trivially_copyable_v<bf16> && std::is_trivially_copyable_v<f16>);
  static_assert(std::is_trivially_default_constructible_v<bf16> && std::is_standard_layout_v<f16>);
  static_assert(sizeof(bf16) == 2 && alignof(bf16) == 2 && sizeof(f16) == 2 && alignof(f16) == 2);
  static_assert(!std::is_convertible_v<float, bf16> && !std::is_convertible_v<f16, float>,
                "conversions are explicit");
  // Usable at compile time.
  static_assert(bf16(1.0f).bits == 0x3F80 && f16(1.0f).bits == 0x3C00);
  static_assert(static_cast<float>(bf16::from_bits(0xC040)) == -3.0f);
  static_assert(static_cast<float>(f16::from_bits(0x7BFF)) == 65504.0f);
  EXPECT_EQ(f16(-2.5f).bits, 0xC100);
  EXPECT_EQ(static_cast<float>(bf16(0.1f)), 0.10009765625f);
}

// ---- Exhaustive round trips --------------------------------------------------------------------

void check_every_pattern(const Format& f) {
  int failures = 0;
  for (std::uint32_t i = 0; i <= 0xFFFF && failures < 10; ++i) {
    const auto h = static_cast<std::uint16_t>(i);
    const float x = f.widen(h);
    if (f.is_nan(h)) {
      const bool ok = std::isnan(x) && std::signbit(x) == ((h & 0x8000u) != 0) &&
                      (bits_of(x) & 0x003FFFFFu) ==
                          (static_cast<std::uint32_t>(h & (f.quiet_bit() - 1)) << (23 - f.mant_bits));
      EXPECT_TRUE(ok) << f.name << " NaN 0x" << std::hex << i << " widened to 0x" << bits_of(x);
      EXPECT_TRUE(f.is_nan(f.narrow(x)) && (f.narrow(x) & 0x8000u) == (h & 0x8000u))
          << f.name << " NaN 0x" << std::hex << i << " came back as 0x" << f.narrow(x);
      failures += !ok;
      continue;
    }
    const bool exact = static_cast<double>(x) == f.decode(h) && std::signbit(x) == ((h & 0x8000u) != 0);
    const bool inf_ok = !f.is_inf(h) || (std::isinf(x) && std::signbit(x) == ((h & 0x8000u) != 0));
    EXPECT_TRUE(f.is_inf(h) ? inf_ok : exact) << f.name << " 0x" << std::hex << i << " widened to " << x;
    EXPECT_EQ(f.narrow(x), h) << f.name << " 0x" << std::hex << i << " does not round-trip";
    failures += !(f.is_inf(h) ? inf_ok : exact) || f.narrow(x) != h;
  }
}

TEST(Bf16, EveryPatternWidensExactlyAndRoundTrips) {
  check_every_pattern(kBf16);
  // bf16 -> float is a pure shift: a signalling NaN stays signalling.
  EXPECT_EQ(bits_of(bf16_bits_to_float(0x7F81)), 0x7F810000u);
  for (std::uint32_t i = 0; i <= 0xFFFF; ++i) {
    const bf16 v = bf16::from_bits(static_cast<std::uint16_t>(i));
    ASSERT_EQ(bits_of(static_cast<float>(v)), i << 16);
  }
}

TEST(F16, EveryPatternWidensExactlyAndRoundTrips) {
  check_every_pattern(kF16);
  // fp16 -> float quiets NaNs (as F16C does) and keeps the payload.
  EXPECT_EQ(bits_of(f16_bits_to_float(0x7C01)), 0x7FC02000u);
  EXPECT_EQ(bits_of(f16_bits_to_float(0xFE00)), 0xFFC00000u);
}

// ---- Rounding against the reference ------------------------------------------------------------

void check_float_sweep(const Format& f, std::uint64_t stride) {
  const Reference ref(f);
  int failures = 0;
  std::uint64_t count = 0;
  for (std::uint64_t u = 0; u <= 0xFFFFFFFFull && failures < 10; u += stride, ++count) {
    const float x = float_of(static_cast<std::uint32_t>(u));
    const std::uint16_t got = f.narrow(x);
    if (std::isnan(x)) {
      const auto r = narrow_nan_ok(f, x, got);
      EXPECT_TRUE(r);
      failures += !r;
      continue;
    }
    const std::uint16_t want = ref.round(x);
    EXPECT_EQ(got, want) << f.name << ": float 0x" << std::hex << u << " (" << x << ")";
    failures += got != want;
  }
  EXPECT_GT(count, 33000000u);
}

TEST(Bf16, RoundingMatchesReferenceOnFloatSweep) { check_float_sweep(kBf16, 127); }
TEST(F16, RoundingMatchesReferenceOnFloatSweep) { check_float_sweep(kF16, 127); }

// Every midpoint between neighbouring representable values (including the largest finite value
// and the overflow threshold), and the floats just either side of it, in both signs.
void check_every_halfway_case(const Format& f) {
  const Reference ref(f);
  const auto& v = ref.values();
  int failures = 0;
  for (std::size_t lo = 0; lo + 1 < v.size() && failures < 10; ++lo) {
    const std::size_t hi = lo + 1;
    const double mid_d = (v[lo] + v[hi]) / 2;
    const auto mid = static_cast<float>(mid_d);
    ASSERT_EQ(static_cast<double>(mid), mid_d) << "midpoints of 16-bit formats are floats";
    const std::uint16_t hi_bits = static_cast<std::uint16_t>(hi == v.size() - 1 ? f.inf_bits() : hi);
    const std::uint16_t even = (lo % 2 == 0) ? static_cast<std::uint16_t>(lo) : hi_bits;
    for (std::uint16_t sign : {std::uint16_t{0}, std::uint16_t{0x8000}}) {
      const float s = sign ? -1.0f : 1.0f;
      const struct {
        float x;
        std::uint16_t want;
      } cases[] = {
          {s * mid, static_cast<std::uint16_t>(sign | even)},
          {s * std::nextafter(mid, 0.0f), static_cast<std::uint16_t>(sign | lo)},
          {s * std::nextafter(mid, INFINITY), static_cast<std::uint16_t>(sign | hi_bits)},
          {s * static_cast<float>(v[lo]), static_cast<std::uint16_t>(sign | lo)},
      };
      for (const auto& c : cases) {
        const std::uint16_t got = f.narrow(c.x);
        EXPECT_EQ(got, c.want) << f.name << ": " << c.x << " (0x" << std::hex << bits_of(c.x) << ")";
        EXPECT_EQ(ref.round(c.x), c.want) << "reference disagrees at " << c.x;
        failures += got != c.want;
      }
    }
  }
}

TEST(Bf16, EveryHalfwayCaseRoundsToEven) { check_every_halfway_case(kBf16); }
TEST(F16, EveryHalfwayCaseRoundsToEven) { check_every_halfway_case(kF16); }

TEST(Bf16, SpecialValues) {
  EXPECT_EQ(float_to_bf16_bits(0.0f), 0x0000);
  EXPECT_EQ(float_to_bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(float_to_bf16_bits(INFINITY), 0x7F80);
  EXPECT_EQ(float_to_bf16_bits(-INFINITY), 0xFF80);
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::max()), 0x7F80);  // overflows after rounding
  EXPECT_EQ(float_to_bf16_bits(float_of(0x7F7F7FFF)), 0x7F7F);               // just below the threshold
  // Float subnormals are rounded, not flushed.
  EXPECT_EQ(float_to_bf16_bits(float_of(0x00010000)), 0x0001);
  EXPECT_EQ(float_to_bf16_bits(float_of(0x00008000)), 0x0000);  // tie, to even
  EXPECT_EQ(float_to_bf16_bits(float_of(0x00008001)), 0x0001);
  EXPECT_EQ(float_to_bf16_bits(float_of(0x00018000)), 0x0002);  // tie, to even
  EXPECT_EQ(float_to_bf16_bits(float_of(0x807FFFFF)), 0x8080);  // rounds up to the smallest normal
  EXPECT_EQ(float_to_bf16_bits(float_of(0x00000001)), 0x0000);
  // NaNs: quiet, sign and top payload kept, never turned into Inf.
  EXPECT_EQ(float_to_bf16_bits(float_of(0x7F800001)), 0x7FC0);
  EXPECT_EQ(float_to_bf16_bits(float_of(0xFFFFFFFF)), 0xFFFF);
  EXPECT_EQ(float_to_bf16_bits(float_of(0x7FA50000)), 0x7FE5);
}

TEST(F16, SpecialValues) {
  EXPECT_EQ(float_to_f16_bits(0.0f), 0x0000);
  EXPECT_EQ(float_to_f16_bits(-0.0f), 0x8000);
  EXPECT_EQ(float_to_f16_bits(65504.0f), 0x7BFF);
  EXPECT_EQ(float_to_f16_bits(std::nextafter(65520.0f, 0.0f)), 0x7BFF);
  EXPECT_EQ(float_to_f16_bits(65520.0f), 0x7C00);  // tie between 65504 and 2^16: overflow
  EXPECT_EQ(float_to_f16_bits(-1e10f), 0xFC00);
  EXPECT_EQ(float_to_f16_bits(-INFINITY), 0xFC00);
  EXPECT_EQ(float_to_f16_bits(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(float_to_f16_bits(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_f16_bits(std::ldexp(1.0f, -25)), 0x0000);  // tie, to even: underflow
  EXPECT_EQ(float_to_f16_bits(-std::ldexp(1.0f, -25)), 0x8000);
  EXPECT_EQ(float_to_f16_bits(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(float_to_f16_bits(std::ldexp(3.0f, -25)), 0x0002);     // 1.5 units: tie, to even
  EXPECT_EQ(float_to_f16_bits(std::ldexp(5.0f, -25)), 0x0002);     // 2.5 units: tie, to even
  EXPECT_EQ(float_to_f16_bits(std::ldexp(1023.5f, -24)), 0x0400);  // largest subnormal tie goes up
  EXPECT_EQ(float_to_f16_bits(float_of(0x00000001)), 0x0000);
  EXPECT_EQ(float_to_f16_bits(float_of(0x80400000)), 0x8000);
  EXPECT_EQ(float_to_f16_bits(float_of(0x7F800001)), 0x7E00);
  EXPECT_EQ(float_to_f16_bits(float_of(0xFFC00000)), 0xFE00);
  EXPECT_EQ(float_to_f16_bits(float_of(0x7FFFFFFF)), 0x7FFF);
}

// ---- SIMD paths against the scalar path --------------------------------------------------------

const DType kAllTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

// Converts with `isa` and with the scalar path and requires identical bits.
void expect_same_as_scalar(const std::vector<std::uint8_t>& src, DType from, DType to, std::size_t n,
                           SimdIsa isa) {
  std::vector<std::uint8_t> want(n * dtype_size(to)), got(n * dtype_size(to), 0xA5);
  STRATA_ASSERT_OK(convert(src.data(), from, want.data(), to, n, SimdIsa::kScalar));
  STRATA_ASSERT_OK(convert(src.data(), from, got.data(), to, n, isa));
  if (want == got) return;
  const std::size_t es = dtype_size(to);
  for (std::size_t i = 0; i < n; ++i) {
    if (std::memcmp(&want[i * es], &got[i * es], es) != 0) {
      std::uint64_t in = 0, w = 0, g = 0;
      std::memcpy(&in, &src[i * dtype_size(from)], dtype_size(from));
      std::memcpy(&w, &want[i * es], es);
      std::memcpy(&g, &got[i * es], es);
      ADD_FAILURE() << to_string(isa) << " " << to_string(from) << "->" << to_string(to) << " element " << i
                    << ": input 0x" << std::hex << in << " scalar 0x" << w << " " << to_string(isa) << " 0x"
                    << g;
      return;
    }
  }
}

class IsaPath : public ::testing::TestWithParam<SimdIsa> {
 protected:
  void SetUp() override {
    if (!cpu_supports(GetParam())) GTEST_SKIP() << "this CPU lacks " << to_string(GetParam());
  }
};

std::vector<std::uint8_t> every_16bit_pattern() {
  std::vector<std::uint8_t> bytes(2 * 65536);
  for (std::uint32_t i = 0; i <= 0xFFFF; ++i) {
    const auto h = static_cast<std::uint16_t>(i);
    std::memcpy(&bytes[2 * i], &h, 2);
  }
  return bytes;
}

// Floats on a stride walk over all 2^32 patterns, then +-300 ulps around every boundary that
// matters to the narrowing conversions.
std::vector<std::uint8_t> float_patterns() {
  std::vector<std::uint32_t> u;
  for (std::uint64_t x = 7; x <= 0xFFFFFFFFull; x += 251) u.push_back(static_cast<std::uint32_t>(x));
  const std::uint32_t centers[] = {0x00000000, 0x00008000, 0x00800000, 0x33000000, 0x33800000, 0x387FC000,
                                   0x38800000, 0x3F800000, 0x477FE000, 0x477FF000, 0x47800000, 0x7F7F8000,
                                   0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x7FFFFFFF};
  for (std::uint32_t c : centers) {
    for (std::uint32_t sign : {0u, 0x80000000u}) {
      for (std::int64_t d = -300; d <= 300; ++d) u.push_back(static_cast<std::uint32_t>((c | sign) + d));
    }
  }
  std::vector<std::uint8_t> bytes(4 * u.size());
  std::memcpy(bytes.data(), u.data(), bytes.size());
  return bytes;
}

TEST_P(IsaPath, EveryHalfPatternMatchesScalar) {
  const auto src = every_16bit_pattern();
  for (DType from : {DType::kBF16, DType::kF16}) {
    for (DType to : kAllTypes) expect_same_as_scalar(src, from, to, 65536, GetParam());
  }
}

TEST_P(IsaPath, FloatSweepMatchesScalar) {
  const auto src = float_patterns();
  const std::size_t n = src.size() / 4;
  ASSERT_GT(n, 17000000u);
  for (DType to : kAllTypes) expect_same_as_scalar(src, DType::kF32, to, n, GetParam());
}

// Lengths that exercise every tail, pointers at every offset within a vector lane; the bytes just
// outside the destination must be left alone.
TEST_P(IsaPath, AwkwardLengthsAndMisalignedPointers) {
  const std::size_t lengths[] = {0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 1023, 1025, 4097, (1u << 20) + 3};
  const std::pair<std::size_t, std::size_t> offsets[] = {{0, 0}, {1, 3}, {2, 6}, {3, 1},
                                                         {4, 2}, {6, 0}, {0, 5}, {60, 62}};
  constexpr std::size_t kGuard = 64;
  std::uint32_t seed = 12345;
  auto next = [&] {
    seed = seed * 1664525u + 1013904223u;
    return seed;
  };
  for (std::size_t n : lengths) {
    for (auto [src_off, dst_off] : offsets) {
      if (n > 4097 && src_off != 1) continue;  // the big length once, misaligned
      for (DType from : kAllTypes) {
        for (DType to : kAllTypes) {
          std::vector<std::uint8_t> src(src_off + n * dtype_size(from) + kGuard);
          for (auto& b : src) b = static_cast<std::uint8_t>(next() >> 24);
          const std::size_t out_bytes = n * dtype_size(to);
          std::vector<std::uint8_t> want(out_bytes);
          std::vector<std::uint8_t> got(kGuard + dst_off + out_bytes + kGuard, 0xA5);
          STRATA_ASSERT_OK(convert(src.data() + src_off, from, want.data(), to, n, SimdIsa::kScalar));
          STRATA_ASSERT_OK(
              convert(src.data() + src_off, from, got.data() + kGuard + dst_off, to, n, GetParam()));
          const std::string what = std::string(to_string(from)) + "->" + std::string(to_string(to)) +
                                   " n=" + std::to_string(n) + " offsets " + std::to_string(src_off) + "/" +
                                   std::to_string(dst_off);
          ASSERT_TRUE(std::equal(want.begin(), want.end(),
                                 got.begin() + static_cast<std::ptrdiff_t>(kGuard + dst_off)))
              << what;
          for (std::size_t i = 0; i < kGuard + dst_off; ++i)
            ASSERT_EQ(got[i], 0xA5) << what << " wrote before dst";
          for (std::size_t i = kGuard + dst_off + out_bytes; i < got.size(); ++i) {
            ASSERT_EQ(got[i], 0xA5) << what << " wrote past the end";
          }
        }
      }
    }
  }
}

#if STRATA_TEST_X86
// The SIMD paths take the rounding mode from the instruction, and must not be changed by
// flush-to-zero / denormals-are-zero (set, for example, by code built with -ffast-math).
TEST_P(IsaPath, IgnoresMxcsrRoundingAndDenormalFlags) {
  const auto halves = every_16bit_pattern();
  std::vector<std::uint8_t> floats(4 * 65536 * 2);
  for (std::uint32_t i = 0; i < 2 * 65536; ++i) {
    // Float subnormals, the fp16 subnormal range, and their negatives.
    const std::uint32_t k = i & 0xFFFF;
    const std::uint32_t u =
        ((i >> 16) ? 0x33000000u + k * 0x581u : k * 0x81u) | (i % 3 == 0 ? 0x80000000u : 0u);
    std::memcpy(&floats[4 * i], &u, 4);
  }
  struct Job {
    const std::vector<std::uint8_t>* src;
    DType from, to;
    std::size_t n;
    std::vector<std::uint8_t> want;
  };
  std::vector<Job> jobs;
  for (DType from : {DType::kBF16, DType::kF16}) {
    for (DType to : kAllTypes) jobs.push_back({&halves, from, to, 65536, {}});
  }
  for (DType to : kAllTypes) jobs.push_back({&floats, DType::kF32, to, 2 * 65536, {}});
  for (auto& j : jobs) {
    j.want.resize(j.n * dtype_size(j.to));
    STRATA_ASSERT_OK(convert(j.src->data(), j.from, j.want.data(), j.to, j.n, SimdIsa::kScalar));
  }
  const unsigned saved = _mm_getcsr();
  // FTZ (bit 15), DAZ (bit 6), rounding toward +inf (bits 13-14 = 10).
  _mm_setcsr((saved & ~0x6000u) | 0x8000u | 0x0040u | 0x4000u);
  std::vector<std::vector<std::uint8_t>> got;
  for (auto& j : jobs) {
    got.emplace_back(j.n * dtype_size(j.to));
    if (!convert(j.src->data(), j.from, got.back().data(), j.to, j.n, GetParam()).ok()) got.back().clear();
  }
  _mm_setcsr(saved);
  for (std::size_t k = 0; k < jobs.size(); ++k) {
    EXPECT_TRUE(got[k] == jobs[k].want)
        << to_string(jobs[k].from) << "->" << to_string(jobs[k].to) << " differs under FTZ/DAZ/round-up";
  }
}
#endif

// Runs every float through every path and the reference. Minutes of CPU: disabled in the default
// run; ctest runs it as dtype.every_float_exhaustive.<isa> under the `slow` label (scripts/test -L slow),
// one test per path, so a path this CPU lacks is reported as skipped.
TEST_P(IsaPath, DISABLED_EveryFloatMatchesScalarAndReference) {
  const Reference ref_bf16(kBf16), ref_f16(kF16);
  constexpr std::size_t kChunk = 1u << 20;
  std::vector<std::uint32_t> src(kChunk);
  std::vector<std::uint16_t> a(kChunk), b(kChunk);
  int failures = 0;
  for (std::uint64_t base = 0; base <= 0xFFFFFFFFull && failures < 10; base += kChunk) {
    for (std::size_t i = 0; i < kChunk; ++i) src[i] = static_cast<std::uint32_t>(base + i);
    for (const Format* f : {&kBf16, &kF16}) {
      const Reference& ref = f == &kBf16 ? ref_bf16 : ref_f16;
      STRATA_ASSERT_OK(convert(src.data(), DType::kF32, a.data(), f->dtype, kChunk, SimdIsa::kScalar));
      STRATA_ASSERT_OK(convert(src.data(), DType::kF32, b.data(), f->dtype, kChunk, GetParam()));
      for (std::size_t i = 0; i < kChunk; ++i) {
        const float x = float_of(src[i]);
        const bool ok =
            a[i] == b[i] && (std::isnan(x) ? bool(narrow_nan_ok(*f, x, a[i])) : a[i] == ref.round(x));
        if (!ok) {
          ADD_FAILURE() << f->name << " float 0x" << std::hex << src[i] << ": scalar 0x" << a[i] << " "
                        << to_string(GetParam()) << " 0x" << b[i];
          ++failures;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Simd, IsaPath, ::testing::Values(SimdIsa::kAvx2, SimdIsa::kAvx512),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// ---- The bulk API ------------------------------------------------------------------------------

TEST(Convert, RejectsBadArgumentsWithoutWriting) {
  float f[4] = {1, 2, 3, 4};
  std::uint16_t h[4] = {7, 7, 7, 7};
  STRATA_EXPECT_ERROR(convert(nullptr, DType::kF32, h, DType::kBF16, 4), kInvalidArgument,
                      "source pointer is null");
  STRATA_EXPECT_ERROR(convert(f, DType::kF32, nullptr, DType::kBF16, 4), kInvalidArgument,
                      "destination pointer is null");
  STRATA_EXPECT_ERROR(convert(f, DType::kF32, h, static_cast<DType>(9), 4), kInvalidArgument,
                      "dtype value 9 is not a known dtype");
  STRATA_EXPECT_ERROR(convert(f, static_cast<DType>(200), h, DType::kF16, 4, SimdIsa::kScalar),
                      kInvalidArgument, "dtype value 200");
  EXPECT_EQ(h[0], 7);
  STRATA_EXPECT_OK(convert(nullptr, DType::kF32, nullptr, DType::kF16, 0));
  for (SimdIsa isa : {SimdIsa::kScalar, SimdIsa::kAvx2, SimdIsa::kAvx512}) {
    Status s = convert(f, DType::kF32, h, DType::kF16, 4, isa);
    if (cpu_supports(isa)) {
      STRATA_EXPECT_OK(s);
      EXPECT_EQ(h[3], 0x4400);
    } else {
      EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();
    }
  }
}

TEST(Convert, SameTypeCopiesAndCrossTypesGoThroughFloat) {
  const std::uint16_t in[3] = {0x3C00, 0x7BFF, 0x0001};  // f16: 1, 65504, 2^-24
  std::uint16_t out[3] = {};
  STRATA_ASSERT_OK(convert(in, DType::kF16, out, DType::kF16, 3));
  EXPECT_EQ(std::memcmp(in, out, sizeof in), 0);
  STRATA_ASSERT_OK(convert(in, DType::kF16, out, DType::kBF16, 3));
  EXPECT_EQ(out[0], 0x3F80);
  EXPECT_EQ(out[1], 0x4780);  // 65504 rounds to 65536 in bf16
  EXPECT_EQ(out[2], 0x3380);  // 2^-24 exactly
}

TEST(Convert, TypedHelpersMatchTheGenericCall) {
  std::vector<float> x(1000);
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = std::ldexp(static_cast<float>(i) - 500.3f, static_cast<int>(i % 40) - 20);
  std::vector<bf16> b(x.size());
  std::vector<f16> h(x.size());
  std::vector<std::uint16_t> want_b(x.size()), want_h(x.size());
  convert(x.data(), b.data(), x.size());
  convert(x.data(), h.data(), x.size());
  STRATA_ASSERT_OK(convert(x.data(), DType::kF32, want_b.data(), DType::kBF16, x.size(), SimdIsa::kScalar));
  STRATA_ASSERT_OK(convert(x.data(), DType::kF32, want_h.data(), DType::kF16, x.size(), SimdIsa::kScalar));
  std::vector<float> back_b(x.size()), back_h(x.size());
  convert(b.data(), back_b.data(), x.size());
  convert(h.data(), back_h.data(), x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(b[i].bits, want_b[i]) << i;
    ASSERT_EQ(h[i].bits, want_h[i]) << i;
    ASSERT_EQ(bits_of(back_b[i]), bits_of(static_cast<float>(b[i]))) << i;
    ASSERT_EQ(bits_of(back_h[i]), bits_of(static_cast<float>(h[i]))) << i;
  }
  convert(static_cast<const float*>(nullptr), static_cast<bf16*>(nullptr), 0);
}

// ---- ISA selection -----------------------------------------------------------------------------

TEST(DtypeIsa, NamesAndCpuSupport) {
  EXPECT_TRUE(cpu_supports(SimdIsa::kScalar));
  EXPECT_TRUE(cpu_supports(best_simd_isa()));
  if (cpu_supports(SimdIsa::kAvx512)) {
    EXPECT_TRUE(cpu_supports(SimdIsa::kAvx2));
  }
  for (SimdIsa isa : {SimdIsa::kScalar, SimdIsa::kAvx2, SimdIsa::kAvx512}) {
    EXPECT_EQ(*parse_simd_isa(to_string(isa)), isa);
  }
  EXPECT_EQ(*parse_simd_isa("AVX512"), SimdIsa::kAvx512);
  STRATA_EXPECT_ERROR(parse_simd_isa("sse9"), kInvalidArgument, "'sse9'");
}

TEST(DtypeIsa, SetByNameAndRejectUnknownOrUnsupported) {
  auto s = set_dtype_isa("scalar");
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(dtype_isa(), SimdIsa::kScalar);
  STRATA_EXPECT_ERROR(set_dtype_isa("avx3"), kInvalidArgument,
                      "'avx3' is not one of auto, scalar, avx2, avx512");
  EXPECT_EQ(dtype_isa(), SimdIsa::kScalar) << "a failed set keeps the current choice";
  for (SimdIsa isa : {SimdIsa::kAvx2, SimdIsa::kAvx512}) {
    auto r = set_dtype_isa(to_string(isa));
    if (cpu_supports(isa)) {
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      EXPECT_EQ(dtype_isa(), isa);
    } else {
      STRATA_EXPECT_ERROR(r, kUnavailable, "cannot run the " + std::string(to_string(isa)));
    }
  }
  auto a = set_dtype_isa("auto");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, best_simd_isa());
  EXPECT_EQ(dtype_isa(), best_simd_isa());
}

TEST(DtypeIsa, TunableRowAndEnvironment) {
  const OptionDesc& d = describe(Option::kDtypeIsa);
  EXPECT_EQ(d.name, "dtype_isa");
  EXPECT_EQ(d.default_value, "auto");
  EXPECT_EQ(Options::env_name(d), "STRATA_DTYPE_ISA");

  ::setenv("STRATA_DTYPE_ISA", "scalar", 1);
  STRATA_EXPECT_OK(load_dtype_isa_from_env());
  EXPECT_EQ(dtype_isa(), SimdIsa::kScalar);
  ::setenv("STRATA_DTYPE_ISA", "mmx", 1);
  STRATA_EXPECT_ERROR(load_dtype_isa_from_env(), kInvalidArgument, "STRATA_DTYPE_ISA: 'mmx'");
  EXPECT_EQ(dtype_isa(), SimdIsa::kScalar);
  ::unsetenv("STRATA_DTYPE_ISA");
  STRATA_EXPECT_OK(load_dtype_isa_from_env());
  EXPECT_EQ(dtype_isa(), SimdIsa::kScalar) << "an unset variable changes nothing";
  ASSERT_TRUE(set_dtype_isa("auto").ok());
}

// Run only as a child of FirstUseReadsTheEnvironment: prints the path the first conversion used.
TEST(DtypeIsaChild, DISABLED_ReportPath) {
  float x = 1.0f;
  bf16 y;
  convert(&x, &y, 1);
  std::printf("dtype_isa=%s\n", std::string(to_string(dtype_isa())).c_str());
}

TEST(DtypeIsa, FirstUseReadsTheEnvironment) {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  // The harness clears inherited STRATA_* variables in every test executable; these are the
  // test's own, so it asks for them to be kept.
  const std::string run =
      " STRATA_TEST_KEEP=STRATA_DTYPE_ISA,STRATA_LOG_LEVEL,STRATA_LOG_SUBSYS '" + self +
      "' --gtest_also_run_disabled_tests --gtest_filter=DtypeIsaChild.DISABLED_ReportPath";
  auto child = testing::run_command("STRATA_DTYPE_ISA=scalar" + run);
  EXPECT_EQ(child.exit_code, 0) << child.output;
  EXPECT_NE(child.output.find("dtype_isa=scalar"), std::string::npos) << child.output;

  child = testing::run_command("STRATA_LOG_LEVEL=warn STRATA_LOG_SUBSYS=all STRATA_DTYPE_ISA=bogus" + run);
  EXPECT_EQ(child.exit_code, 0) << child.output;
  EXPECT_NE(child.output.find("STRATA_DTYPE_ISA: 'bogus' is not one of"), std::string::npos) << child.output;
  EXPECT_NE(child.output.find("dtype_isa=" + std::string(to_string(best_simd_isa()))), std::string::npos)
      << child.output;
}

}  // namespace
}  // namespace strata
