// The CPU optimizer update on every ISA path against a double-precision reference, and the paths
// against each other (bitwise), over awkward lengths, misaligned pointers, every gradient dtype,
// both moment dtypes, the copy-out, thread counts, and nan/inf gradients.
//
// Tolerances (fp32 state vs the double reference after T steps, per element; lr = 1e-2 so that
// the update, not the weight's own rounding, dominates):
//   master:     |p - p_ref| <= T * 2^-23 * max(|p|, |p_ref|)   (<= two roundings of p per step)
//                              + 1e-5 * lr * T                  (the update's relative error;
//                                2e-4 for Adam, whose g + wd * p cancels for some elements)
//   exp_avg:    |m - m_ref| <= 1e-6 * T * max|m_ref| over the buffer
//   exp_avg_sq: |v - v_ref| <= 1e-6 * T * max|v_ref| over the buffer
// Measured worst cases (T = 12): update term 5e-7 (AdamW), 3.4e-5 (Adam), 1.5e-7 (Lion), 7e-8
// (Adagrad); moments 8e-8. Every ISA path is checked against the reference, and every path must
// also equal the scalar path bit for bit. Lion's sign() is discontinuous, so elements whose reference c is
// within 1e-5 relative of 0 are excluded (and counted; they must stay rare). bf16 moments have
// their own, statistical test.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "harness/harness.hpp"
#include "optim/kernels.hpp"
#include "optim/numerics.hpp"
#include "optim_isa.hpp"
#include "optim_reference.hpp"
#include "strata/dtype.hpp"
#include "strata/optim.hpp"

namespace strata {
namespace {

using optim_detail::bf16_to_f32;
using optim_detail::f16_to_f32;
using optim_detail::f32_to_bf16;
using optim_detail::f32_to_f16;
using testing::ref_bf16_to_double;
using testing::ref_f16_to_double;

// Per-ISA tests: one instance per path, skipped with the reason where this CPU lacks it.
class OptimConvertIsa : public testing::OptimizerIsaTest {};
class OptimUpdateIsa : public testing::OptimizerIsaTest {};
STRATA_INSTANTIATE_OPTIMIZER_ISAS(OptimConvertIsa);
STRATA_INSTANTIATE_OPTIMIZER_ISAS(OptimUpdateIsa);

CpuOptimizer make_optimizer(SimdIsa isa, int threads, std::uint32_t seed = 7) {
  CpuOptimizerConfig c;
  c.isa = isa;
  c.threads = threads;
  c.seed = seed;
  auto r = CpuOptimizer::create(c);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return std::move(r).value();
}

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
std::uint32_t to_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// ---- Conversions -------------------------------------------------------------------------------

TEST(OptimConvert, Bf16RoundsToNearestEvenAndKeepsNan) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f808000)), 0x3f80);  // tie, even stays
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f818000)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f808001)), 0x3f81);  // above the tie
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f807fff)), 0x3f80);  // below the tie
  EXPECT_EQ(f32_to_bf16(from_bits(0x00008000)), 0x0000);  // subnormal tie to even: not flushed by rule
  EXPECT_EQ(f32_to_bf16(from_bits(0x00018000)), 0x0002);  // subnormals round, they are not flushed
  EXPECT_EQ(f32_to_bf16(from_bits(0x7f7fffff)), 0x7f80);  // max float rounds to inf
  EXPECT_EQ(f32_to_bf16(INFINITY), 0x7f80);
  EXPECT_EQ(f32_to_bf16(-INFINITY), 0xff80);
  EXPECT_EQ(f32_to_bf16(from_bits(0x7f800001)), 0x7fc0);  // signalling NaN stays NaN (quieted)
  EXPECT_EQ(f32_to_bf16(from_bits(0xffffffff)), 0xffff);  // would round to zero exponent, must not
  EXPECT_EQ(f32_to_bf16(from_bits(0x7fc12345)), 0x7fc1);
}

TEST(OptimConvert, F16MatchesTheFormatDefinition) {
  // Every half decodes exactly.
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const double want = ref_f16_to_double(static_cast<std::uint16_t>(h));
    const float got = f16_to_f32(static_cast<std::uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << h;
    } else {
      ASSERT_EQ(static_cast<double>(got), want) << h;
      ASSERT_EQ(std::signbit(got), std::signbit(want)) << h;
    }
  }
  // Encoding: nearest half by value, ties to even mantissa, checked against decoded neighbours.
  std::mt19937 rng(1);
  for (int k = 0; k < 200000; ++k) {
    const float f = from_bits(rng());
    const std::uint16_t h = f32_to_f16(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(ref_f16_to_double(h)));
      continue;
    }
    const double x = f;
    const double got = ref_f16_to_double(h);
    if (std::fabs(x) >= 65520.0) {
      ASSERT_TRUE(std::isinf(got)) << x;
      continue;
    }
    // The neighbours of h on both sides must not be closer.
    const std::uint16_t mag = h & 0x7fff;
    for (int d : {-1, 1}) {
      const int nb = static_cast<int>(mag) + d;
      if (nb < 0 || nb >= 0x7c00) continue;
      const double other = std::copysign(ref_f16_to_double(static_cast<std::uint16_t>(nb)), x);
      const double e_got = std::fabs(got - x);
      const double e_other = std::fabs(other - x);
      ASSERT_LE(e_got, e_other) << "x=" << x << " h=" << h;
      if (e_got == e_other) {
        ASSERT_EQ(h & 1, 0) << "tie must go to even, x=" << x;
      }
    }
  }
}

// Each ISA's vector rounding equals the scalar rounding, over a sweep of all bit patterns.
TEST_P(OptimConvertIsa, RoundingMatchesScalarOverBitPatterns) {
  std::vector<float> in;
  for (std::uint64_t u = 0; u < (1ull << 32); u += 4099)
    in.push_back(from_bits(static_cast<std::uint32_t>(u)));
  for (std::uint32_t u :
       {0x7f800000u, 0xff800000u, 0x7f800001u, 0x7fbfffffu, 0x7fc00000u, 0xffffffffu, 0x477fefffu,
        0x477ff000u, 0x33000000u, 0x33000001u, 0x387fffffu, 0x38800000u, 0x00000001u}) {
    in.push_back(from_bits(u));
  }
  std::vector<std::uint16_t> want(in.size()), got(in.size());
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (std::size_t i = 0; i < in.size(); ++i)
      want[i] = dt == DType::kBF16 ? f32_to_bf16(in[i]) : f32_to_f16(in[i]);
    const SimdIsa isa = GetParam();
    std::fill(got.begin(), got.end(), 0);
    optim_detail::round_with_isa(isa, in.data(), got.data(), dt, in.size());
    std::size_t bad = 0;
    for (std::size_t i = 0; i < in.size(); ++i) {
      if (got[i] != want[i] && bad++ < 5) {
        ADD_FAILURE() << to_string(isa) << " " << to_string(dt) << " bits " << std::hex << to_bits(in[i])
                      << ": got " << got[i] << " want " << want[i];
      }
    }
    EXPECT_EQ(bad, 0u) << to_string(isa) << " " << to_string(dt);
  }
}

// The optimizer keeps its own conversions (they also compile as CUDA device code); they must
// agree with the dtype module's bit for bit.
TEST(OptimConvert, AgreesWithTheDtypeModule) {
  for (std::uint64_t u = 0; u < (1ull << 32); u += 65537) {
    const float f = from_bits(static_cast<std::uint32_t>(u));
    ASSERT_EQ(f32_to_bf16(f), float_to_bf16_bits(f)) << std::hex << u;
    ASSERT_EQ(f32_to_f16(f), float_to_f16_bits(f)) << std::hex << u;
  }
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float a = f16_to_f32(static_cast<std::uint16_t>(h));
    const float b = f16_bits_to_float(static_cast<std::uint16_t>(h));
    ASSERT_TRUE(to_bits(a) == to_bits(b)) << std::hex << h;
    ASSERT_EQ(to_bits(bf16_to_f32(static_cast<std::uint16_t>(h))),
              to_bits(bf16_bits_to_float(static_cast<std::uint16_t>(h))));
  }
}

// ---- The update ------------------------------------------------------------------------------

enum class Out { kNone, kBF16, kF16 };

struct Case {
  OptimizerKind kind;
  DType grad;
  DType moments;
  Out out;
  std::size_t n;
  std::size_t misalign;  // elements by which every pointer is shifted off its allocation
  int steps;
};

std::string describe(const Case& c) {
  return std::string(to_string(c.kind)) + " grad=" + std::string(to_string(c.grad)) +
         " moments=" + std::string(to_string(c.moments)) + " out=" +
         (c.out == Out::kNone   ? "none"
          : c.out == Out::kBF16 ? "bf16"
                                : "fp16") +
         " n=" + std::to_string(c.n) + " misalign=" + std::to_string(c.misalign) +
         " steps=" + std::to_string(c.steps);
}

OptimizerHyper hyper_for(OptimizerKind kind) {
  OptimizerHyper h = OptimizerHyper::defaults(kind);
  h.weight_decay = 0.05;
  if (kind == OptimizerKind::kAdagrad) h.lr_decay = 0.01;
  // A large lr makes the update, not the rounding of the weight, the dominant term of the
  // comparison, so an error in the update formula shows (see the tolerance at the top).
  h.lr = 1e-2;
  return h;
}

// Raw byte storage with pointers deliberately shifted off any vector alignment.
struct State {
  std::vector<unsigned char> master_b, grad_b, m_b, v_b, out_b;
  float* master = nullptr;
  void* grad = nullptr;
  void* m = nullptr;
  void* v = nullptr;
  std::uint16_t* out = nullptr;
  std::size_t n = 0;
  DType grad_dt = DType::kF32, mom_dt = DType::kF32;

  void init(std::size_t n_, DType g, DType mom, std::size_t misalign) {
    n = n_;
    grad_dt = g;
    mom_dt = mom;
    auto carve = [&](std::vector<unsigned char>& b, std::size_t elem, std::size_t shift) -> void* {
      b.assign((n + 64) * elem + 128, 0);
      auto base = reinterpret_cast<std::uintptr_t>(b.data());
      base = (base + 63) / 64 * 64;  // known alignment, then shift by whole elements
      return reinterpret_cast<void*>(base + shift * elem);
    };
    // Different shifts per buffer, so the buffers are misaligned relative to each other as well.
    master = static_cast<float*>(carve(master_b, 4, misalign));
    grad = carve(grad_b, dtype_size(g), misalign * 3 % 17);
    m = carve(m_b, dtype_size(mom), misalign * 5 % 19);
    v = carve(v_b, dtype_size(mom), misalign * 7 % 23);
    out = static_cast<std::uint16_t*>(carve(out_b, 2, misalign * 11 % 29));
  }
  float master_at(std::size_t i) const { return master[i]; }
  double mom_at(const void* p, std::size_t i) const {
    return mom_dt == DType::kF32 ? static_cast<const float*>(p)[i]
                                 : ref_bf16_to_double(static_cast<const std::uint16_t*>(p)[i]);
  }
  void set_grad(std::size_t i, float x) {
    if (grad_dt == DType::kF32)
      static_cast<float*>(grad)[i] = x;
    else if (grad_dt == DType::kBF16)
      static_cast<std::uint16_t*>(grad)[i] = f32_to_bf16(x);
    else
      static_cast<std::uint16_t*>(grad)[i] = f32_to_f16(x);
  }
  double grad_at(std::size_t i) const {
    if (grad_dt == DType::kF32) return static_cast<const float*>(grad)[i];
    if (grad_dt == DType::kBF16) return ref_bf16_to_double(static_cast<const std::uint16_t*>(grad)[i]);
    return ref_f16_to_double(static_cast<const std::uint16_t*>(grad)[i]);
  }
  OptimizerBuffers buffers(Out o) const {
    OptimizerBuffers b;
    b.master = master;
    b.grad = grad;
    b.grad_dtype = grad_dt;
    b.exp_avg = m;
    b.exp_avg_sq = v;
    b.moment_dtype = mom_dt;
    b.param_out = o == Out::kNone ? nullptr : out;
    b.out_dtype = o == Out::kF16 ? DType::kF16 : DType::kBF16;
    b.n = n;
    return b;
  }
  // Bytes of every live buffer, for bitwise comparison.
  std::vector<unsigned char> snapshot(Out o) const {
    std::vector<unsigned char> s;
    auto add = [&](const void* p, std::size_t bytes) {
      const auto* c = static_cast<const unsigned char*>(p);
      s.insert(s.end(), c, c + bytes);
    };
    add(master, n * 4);
    add(m, n * dtype_size(mom_dt));
    add(v, n * dtype_size(mom_dt));
    if (o != Out::kNone) add(out, n * 2);
    return s;
  }
};

constexpr double kGradScale = 1.0 / 64.0;

// The gradients of step t: a spread of magnitudes (1e-4 .. 10, times the loss scale 64), signs
// mixed, fixed by (seed, t) so every path sees the same values.
void fill_grads(State& s, int t) {
  // Generated once per (step, length) and reused by every run of the same case.
  static std::map<std::pair<int, std::size_t>, std::vector<float>> cache;
  std::vector<float>& g = cache[{t, s.n}];
  if (g.size() != s.n) {
    std::mt19937 rng(1000 + t);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> expo(-4.0f, 1.0f);
    g.resize(s.n);
    for (std::size_t i = 0; i < s.n; ++i)
      g[i] = static_cast<float>(64.0 * std::pow(10.0f, expo(rng)) * normal(rng));
  }
  for (std::size_t i = 0; i < s.n; ++i) s.set_grad(i, g[i]);
}

void fill_initial(State& s, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (std::size_t i = 0; i < s.n; ++i) s.master[i] = u(rng);
  std::memset(s.m, 0, s.n * dtype_size(s.mom_dt));
  std::memset(s.v, 0, s.n * dtype_size(s.mom_dt));
}

struct RunResult {
  std::vector<unsigned char> bytes;
  std::vector<float> master;
  std::vector<double> m, v;
  std::vector<std::uint16_t> out;
};

RunResult run_case(const Case& c, const CpuOptimizer& opt, State& s, const OptimizerHyper& h) {
  s.init(c.n, c.grad, c.moments, c.misalign);
  fill_initial(s, 42);
  for (int t = 1; t <= c.steps; ++t) {
    fill_grads(s, t);
    STRATA_EXPECT_OK(opt.update(h, t, static_cast<float>(kGradScale), s.buffers(c.out)));
  }
  RunResult r;
  r.bytes = s.snapshot(c.out);
  r.master.assign(s.master, s.master + c.n);
  for (std::size_t i = 0; i < c.n; ++i) {
    r.m.push_back(s.mom_at(s.m, i));
    r.v.push_back(s.mom_at(s.v, i));
  }
  if (c.out != Out::kNone) r.out.assign(s.out, s.out + c.n);
  return r;
}

struct Reference {
  std::vector<double> p, m, v;
  std::vector<bool> ambiguous;  // Lion: the sign of c was within rounding of 0 at some step
  double max_m = 0, max_v = 0;
};

// The double reference run of case c.
Reference reference_run(const Case& c, const OptimizerHyper& h) {
  State s;
  s.init(c.n, c.grad, c.moments, 0);
  fill_initial(s, 42);
  Reference ref;
  ref.p.resize(c.n);
  ref.m.assign(c.n, 0.0);
  ref.v.assign(c.n, 0.0);
  ref.ambiguous.assign(c.n, false);
  for (std::size_t i = 0; i < c.n; ++i) ref.p[i] = s.master[i];
  for (int t = 1; t <= c.steps; ++t) {
    fill_grads(s, t);
    for (std::size_t i = 0; i < c.n; ++i) {
      if (h.kind == OptimizerKind::kLion) {
        const double g = s.grad_at(i) * kGradScale;
        const double a = h.beta1 * ref.m[i], b = (1 - h.beta1) * g;
        if (std::fabs(a + b) <= 1e-5 * (std::fabs(a) + std::fabs(b))) ref.ambiguous[i] = true;
      }
      testing::ref_update(h, t, kGradScale, s.grad_at(i), ref.p[i], ref.m[i], ref.v[i]);
    }
  }
  for (std::size_t i = 0; i < c.n; ++i) {
    ref.max_m = std::max(ref.max_m, std::fabs(ref.m[i]));
    ref.max_v = std::max(ref.max_v, std::fabs(ref.v[i]));
  }
  return ref;
}

// Checks one path's result against the reference with the tolerances at the top of the file.
void check_against_reference(const Case& c, const OptimizerHyper& h, const Reference& ref, const RunResult& r,
                             SimdIsa isa) {
  const double T = c.steps;
  std::size_t bad = 0;
  for (std::size_t i = 0; i < c.n; ++i) {
    if (ref.ambiguous[i]) continue;
    const double tol_p = T * 0x1p-23 * std::max(std::fabs(ref.p[i]), std::fabs(double(r.master[i]))) +
                         (h.kind == OptimizerKind::kAdam ? 2e-4 : 1e-5) * h.lr * T;
    const double tol_m = 1e-6 * T * ref.max_m;
    const double tol_v = 1e-6 * T * ref.max_v;
    const bool uses_m = h.kind != OptimizerKind::kAdagrad;
    const bool uses_v = h.kind != OptimizerKind::kLion;
    const bool ok = std::fabs(r.master[i] - ref.p[i]) <= tol_p &&
                    (!uses_m || std::fabs(r.m[i] - ref.m[i]) <= tol_m) &&
                    (!uses_v || std::fabs(r.v[i] - ref.v[i]) <= tol_v);
    if (!ok && bad++ < 3) {
      ADD_FAILURE() << describe(c) << " " << to_string(isa) << " element " << i << ": p " << r.master[i]
                    << " vs " << ref.p[i] << " (tol " << tol_p << "), m " << r.m[i] << " vs " << ref.m[i]
                    << ", v " << r.v[i] << " vs " << ref.v[i];
    }
  }
  EXPECT_EQ(bad, 0u) << describe(c) << " " << to_string(isa);
  // The copy-out is the master rounded to nearest even.
  if (c.out != Out::kNone) {
    for (std::size_t i = 0; i < c.n; ++i) {
      const std::uint16_t want = c.out == Out::kBF16 ? f32_to_bf16(r.master[i]) : f32_to_f16(r.master[i]);
      if (r.out[i] != want) {
        ADD_FAILURE() << describe(c) << " " << to_string(isa) << " copy-out element " << i << ": " << r.out[i]
                      << " != " << want;
        break;
      }
    }
  }
}

// Runs case c on `isa`: the path is checked against the double reference (fp32 moments) and
// must reproduce the scalar path bitwise.
void run_on_isa(const Case& c, SimdIsa isa, int threads = 2) {
  const OptimizerHyper h = hyper_for(c.kind);
  State s;
  const RunResult scalar = run_case(c, make_optimizer(SimdIsa::kScalar, threads), s, h);
  const bool exact_moments = c.moments == DType::kF32;
  Reference ref;
  if (exact_moments) {
    ref = reference_run(c, h);
    const auto skipped =
        static_cast<std::size_t>(std::count(ref.ambiguous.begin(), ref.ambiguous.end(), true));
    EXPECT_LE(skipped, c.n / 1000 + 2) << describe(c) << ": too many sign-ambiguous Lion elements";
  }
  {
    const RunResult r = isa == SimdIsa::kScalar ? scalar : run_case(c, make_optimizer(isa, threads), s, h);
    if (exact_moments) check_against_reference(c, h, ref, r, isa);
    if (isa == SimdIsa::kScalar) return;
    ASSERT_EQ(r.bytes.size(), scalar.bytes.size());
    if (r.bytes != scalar.bytes) {
      std::size_t first = 0;
      while (first < c.n && r.master[first] == scalar.master[first] && r.m[first] == scalar.m[first] &&
             r.v[first] == scalar.v[first])
        ++first;
      ADD_FAILURE() << describe(c) << ": " << to_string(isa) << " differs from scalar; first element "
                    << first;
    }
  }
}

const DType kGradTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
const OptimizerKind kKinds[] = {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kLion,
                                OptimizerKind::kAdagrad};

TEST_P(OptimUpdateIsa, MatchesReferenceOnAwkwardLengths) {
  for (OptimizerKind kind : kKinds) {
    for (DType g : kGradTypes) {
      for (Out out : {Out::kNone, Out::kBF16, Out::kF16}) {
        for (std::size_t n : {0u, 1u, 3u, 15u, 16u, 17u, 31u, 33u, 255u, 1023u, 4097u}) {
          const Case c{kind, g, DType::kF32, out, n, n % 7 + 1, 40};
          SCOPED_TRACE(describe(c));
          run_on_isa(c, GetParam());
        }
      }
    }
  }
}

TEST_P(OptimUpdateIsa, MatchesReferenceOnAMillionElements) {
  const std::size_t n = (1u << 20) + 3;
  for (OptimizerKind kind : kKinds) {
    for (DType g : {DType::kF32, DType::kBF16}) {
      const Case c{kind, g, DType::kF32, g == DType::kF32 ? Out::kNone : Out::kBF16, n, 5, 3};
      SCOPED_TRACE(describe(c));
      run_on_isa(c, GetParam(), 3);
    }
  }
  const Case fp16{OptimizerKind::kAdamW, DType::kF16, DType::kF32, Out::kF16, n, 1, 2};
  run_on_isa(fp16, GetParam(), 2);
}

TEST(OptimUpdate, ResultDoesNotDependOnThreadCount) {
  const std::size_t n = (1u << 20) + 3;
  for (DType mom : {DType::kF32, DType::kBF16}) {
    const Case c{OptimizerKind::kAdamW, DType::kBF16, mom, Out::kBF16, n, 3, 2};
    const OptimizerHyper h = hyper_for(c.kind);
    const SimdIsa isa = best_optimizer_isa();
    State s;
    const RunResult one = run_case(c, make_optimizer(isa, 1), s, h);
    for (int threads : {2, 3, 8}) {
      const RunResult many = run_case(c, make_optimizer(isa, threads), s, h);
      EXPECT_TRUE(many.bytes == one.bytes) << describe(c) << " threads " << threads;
    }
  }
}

// ---- bf16 moments ----------------------------------------------------------------------------

TEST_P(OptimUpdateIsa, Bf16MomentsAreBitwiseAcrossIsasAndPieces) {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kLion}) {
    for (std::size_t n : {1u, 17u, 1023u, 70001u}) {
      const Case c{kind, DType::kBF16, DType::kBF16, Out::kBF16, n, 3, 6};
      SCOPED_TRACE(describe(c));
      run_on_isa(c, GetParam());
    }
  }
  // Updating a buffer in two pieces (with element_offset) equals updating it whole.
  const std::size_t n = 5000, cut = 1234;
  const OptimizerHyper h = hyper_for(OptimizerKind::kAdamW);
  const CpuOptimizer opt = make_optimizer(GetParam(), 2);
  State whole, pieces;
  for (State* s : {&whole, &pieces}) {
    s->init(n, DType::kF32, DType::kBF16, 0);
    fill_initial(*s, 3);
  }
  for (int t = 1; t <= 4; ++t) {
    fill_grads(whole, t);
    fill_grads(pieces, t);
    STRATA_ASSERT_OK(opt.update(h, t, 1.0f, whole.buffers(Out::kNone)));
    OptimizerBuffers a = pieces.buffers(Out::kNone);
    OptimizerBuffers b = a;
    a.n = cut;
    b.master += cut;
    b.grad = static_cast<const float*>(b.grad) + cut;
    b.exp_avg = static_cast<std::uint16_t*>(b.exp_avg) + cut;
    b.exp_avg_sq = static_cast<std::uint16_t*>(b.exp_avg_sq) + cut;
    b.n = n - cut;
    b.element_offset = cut;
    STRATA_ASSERT_OK(opt.update(h, t, 1.0f, b));
    STRATA_ASSERT_OK(opt.update(h, t, 1.0f, a));
  }
  EXPECT_TRUE(whole.snapshot(Out::kNone) == pieces.snapshot(Out::kNone));
}

// With round-to-nearest, a bf16 second moment cannot follow a slow decay (each step changes it by
// 0.1%, below half a bf16 ulp), so it would stall at its peak. Stochastic rounding must track the
// double reference on average.
TEST_P(OptimUpdateIsa, Bf16MomentsTrackSlowDecayWithoutStalling) {
  const std::size_t n = 4096;
  const int steps = 600;
  OptimizerHyper h = OptimizerHyper::defaults(OptimizerKind::kAdamW);
  h.lr = 0.0;  // isolate the moments
  {
    const SimdIsa isa = GetParam();
    State s;
    s.init(n, DType::kF32, DType::kBF16, 1);
    fill_initial(s, 5);
    const CpuOptimizer opt = make_optimizer(isa, 2);
    double m_ref = 0, v_ref = 0;
    for (int t = 1; t <= steps; ++t) {
      const float g = t <= 50 ? 1.0f : 0.01f;  // a burst, then a long quiet phase
      for (std::size_t i = 0; i < n; ++i) static_cast<float*>(s.grad)[i] = g;
      STRATA_ASSERT_OK(opt.update(h, t, 1.0f, s.buffers(Out::kNone)));
      m_ref = h.beta1 * m_ref + (1 - h.beta1) * g;
      v_ref = h.beta2 * v_ref + (1 - h.beta2) * g * g;
    }
    double m_mean = 0, v_mean = 0;
    for (std::size_t i = 0; i < n; ++i) {
      m_mean += s.mom_at(s.m, i) / n;
      v_mean += s.mom_at(s.v, i) / n;
    }
    // v fell from ~0.0488 to ~0.0287; round-to-nearest would have left it at the peak.
    EXPECT_NEAR(v_mean, v_ref, 0.01 * v_ref) << to_string(isa);
    EXPECT_NEAR(m_mean, m_ref, 0.02 * m_ref + 1e-4) << to_string(isa);
  }
}

// ---- nan / inf gradients -----------------------------------------------------------------------

TEST_P(OptimUpdateIsa, NonFiniteGradientsPoisonOnlyTheirElement) {
  const std::size_t n = 1000;
  {
    const SimdIsa isa = GetParam();
    for (DType g : kGradTypes) {
      for (float bad : {NAN, INFINITY, -INFINITY}) {
        const CpuOptimizer opt = make_optimizer(isa, 1);
        const OptimizerHyper h = hyper_for(OptimizerKind::kAdamW);
        State clean, dirty;
        for (State* s : {&clean, &dirty}) {
          s->init(n, g, DType::kF32, 2);
          fill_initial(*s, 9);
          fill_grads(*s, 1);
        }
        const std::size_t poisoned[] = {0, 15, 16, 500, n - 1};
        for (std::size_t i : poisoned) dirty.set_grad(i, bad);
        STRATA_ASSERT_OK(opt.update(h, 1, 1.0f, clean.buffers(Out::kBF16)));
        STRATA_ASSERT_OK(opt.update(h, 1, 1.0f, dirty.buffers(Out::kBF16)));
        for (std::size_t i = 0; i < n; ++i) {
          const bool is_poisoned =
              std::find(std::begin(poisoned), std::end(poisoned), i) != std::end(poisoned);
          if (is_poisoned) {
            EXPECT_FALSE(std::isfinite(dirty.master[i])) << to_string(isa) << " element " << i;
            EXPECT_TRUE(std::isnan(bf16_to_f32(dirty.out[i])) || std::isinf(bf16_to_f32(dirty.out[i])));
          } else {
            ASSERT_EQ(to_bits(dirty.master[i]), to_bits(clean.master[i]))
                << to_string(isa) << " element " << i;
            ASSERT_EQ(dirty.out[i], clean.out[i]);
          }
        }
      }
    }
  }
}

// ---- Arguments -----------------------------------------------------------------------------------

TEST(OptimUpdate, RejectsBadArguments) {
  const CpuOptimizer opt = make_optimizer(SimdIsa::kScalar, 1);
  State s;
  s.init(10, DType::kF32, DType::kF32, 0);
  OptimizerHyper h = hyper_for(OptimizerKind::kAdamW);
  OptimizerBuffers b = s.buffers(Out::kNone);
  STRATA_EXPECT_ERROR(opt.update(h, 0, 1.0f, b), kInvalidArgument, "steps count from 1");
  STRATA_EXPECT_ERROR(opt.update(h, 1, NAN, b), kInvalidArgument, "grad_scale");
  OptimizerBuffers no_m = b;
  no_m.exp_avg = nullptr;
  STRATA_EXPECT_ERROR(opt.update(h, 1, 1.0f, no_m), kInvalidArgument, "exp_avg is null");
  OptimizerBuffers odd = b;
  odd.master = reinterpret_cast<float*>(reinterpret_cast<char*>(b.master) + 1);
  STRATA_EXPECT_ERROR(opt.update(h, 1, 1.0f, odd), kInvalidArgument, "master is not aligned");
  OptimizerBuffers f16m = b;
  f16m.moment_dtype = DType::kF16;
  STRATA_EXPECT_ERROR(opt.update(h, 1, 1.0f, f16m), kInvalidArgument, "fp16 is not supported");
  OptimizerBuffers f32out = b;
  f32out.param_out = s.out;
  f32out.out_dtype = DType::kF32;
  STRATA_EXPECT_ERROR(opt.update(h, 1, 1.0f, f32out), kInvalidArgument, "bf16 or fp16");
  OptimizerHyper bad = h;
  bad.beta2 = 1.0;
  STRATA_EXPECT_ERROR(opt.update(bad, 1, 1.0f, b), kInvalidArgument, "optimizer.beta2");
  OptimizerHyper ada = hyper_for(OptimizerKind::kAdagrad);
  OptimizerBuffers bf16m = b;
  bf16m.moment_dtype = DType::kBF16;
  STRATA_EXPECT_ERROR(opt.update(ada, 1, 1.0f, bf16m), kInvalidArgument, "adagrad");
  // Lion needs no exp_avg_sq, Adagrad no exp_avg.
  OptimizerBuffers lion = b;
  lion.exp_avg_sq = nullptr;
  STRATA_EXPECT_OK(opt.update(hyper_for(OptimizerKind::kLion), 1, 1.0f, lion));
  OptimizerBuffers adagrad = b;
  adagrad.exp_avg = nullptr;
  STRATA_EXPECT_OK(opt.update(ada, 1, 1.0f, adagrad));
  // n = 0 touches nothing, null pointers included.
  STRATA_EXPECT_OK(opt.update(h, 1, 1.0f, OptimizerBuffers{}));
}

TEST(OptimIsa, SelectionByNameAndAvailability) {
  auto a = select_optimizer_isa("auto");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, best_optimizer_isa());
  auto s = select_optimizer_isa("SCALAR");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, SimdIsa::kScalar);
  STRATA_EXPECT_ERROR(select_optimizer_isa("sse9"), kInvalidArgument, "auto, avx512, avx2, scalar");
  for (SimdIsa isa : {SimdIsa::kAvx2, SimdIsa::kAvx512}) {
    auto r = select_optimizer_isa(to_string(isa));
    if (optimizer_supports(isa)) {
      EXPECT_TRUE(r.ok());
    } else {
      STRATA_EXPECT_ERROR(r, kUnavailable, "missing");
    }
  }
  EXPECT_TRUE(optimizer_supports(SimdIsa::kScalar));
  CpuOptimizerConfig c;
  c.threads = 0;
  STRATA_EXPECT_ERROR(CpuOptimizer::create(c), kInvalidArgument, "threads");
}

}  // namespace
}  // namespace strata
