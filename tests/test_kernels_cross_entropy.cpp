// Fused softmax + cross-entropy: losses, lse and dlogits against float64 for both storage types,
// a vocabulary of 257 padded to 264 and one of 50257, ignored rows, in-place backward, finite
// differences and bad targets. Tolerances: ref::kF32Tol for fp32 (2x for the losses: lse minus a
// logit cancels), ref::kBF16Tol for bf16 dlogits; losses are fp32 whatever the logits' type.
#include "harness/harness.hpp"
#include "kernel_ref/reference.hpp"

namespace strata::kernels {
namespace {

using ref::TestTensor;
using ref::Vec;

struct CeRun {
  Vec losses, lse, dlogits;
};

CeRun run_ce(ref::CpuContext& cpu, DType dt, const Vec& logits, const std::vector<std::int32_t>& targets,
             double dloss, int N, int V, int Vp, bool in_place) {
  TestTensor tl = TestTensor::from(dt, logits), td(dt, logits.size());
  td.fill(5.0);  // padding columns must come back zero
  std::vector<float> losses(N), lse(N);
  EXPECT_TRUE(
      cross_entropy_forward(cpu.ctx, losses.data(), lse.data(), tl.carg(), targets.data(), N, V, Vp).ok());
  TensorArg out = in_place ? tl.arg() : td.arg();
  EXPECT_TRUE(cross_entropy_backward(cpu.ctx, out, tl.carg(), lse.data(), targets.data(),
                                     static_cast<float>(dloss), N, V, Vp)
                  .ok());
  return {Vec(losses.begin(), losses.end()), Vec(lse.begin(), lse.end()),
          in_place ? tl.values() : td.values()};
}

class CrossEntropyTest : public ::testing::TestWithParam<DType> {};

TEST_P(CrossEntropyTest, MatchesReference) {
  const DType dt = GetParam();
  ref::CpuContext cpu;
  struct Case {
    int N, V, Vp;
    bool in_place;
  };
  std::uint32_t seed = 3;
  for (Case c : {Case{1, 1, 1, false}, Case{9, 257, 264, false}, Case{13, 257, 257, true},
                 Case{3, 50257, 50304, true}}) {
    const Vec logits = ref::as_stored(dt, ref::random_vec(static_cast<std::size_t>(c.N) * c.Vp, ++seed, 3.0));
    std::mt19937 gen(++seed);
    std::vector<std::int32_t> targets(c.N);
    for (int n = 0; n < c.N; ++n) targets[n] = n % 4 == 2 ? -1 : static_cast<std::int32_t>(gen() % c.V);
    const double dloss = 1.0 / c.N;
    const CeRun got = run_ce(cpu, dt, logits, targets, dloss, c.N, c.V, c.Vp, c.in_place);
    const ref::CrossEntropy want = ref::cross_entropy(logits, targets, dloss, c.N, c.V, c.Vp);
    const std::string what =
        "N=" + std::to_string(c.N) + " V=" + std::to_string(c.V) + " Vp=" + std::to_string(c.Vp);
    ref::expect_close(got.lse, want.lse, ref::kF32Tol, what + " lse");
    ref::expect_close(got.losses, want.losses, {2 * ref::kF32Tol.atol, 2 * ref::kF32Tol.rtol},
                      what + " losses");
    ref::expect_close(got.dlogits, want.dlogits, ref::tolerance_for(dt), what + " dlogits");
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, CrossEntropyTest, ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(CrossEntropy, BackwardMatchesFiniteDifferences) {
  ref::CpuContext cpu;
  const int N = 4, V = 7, Vp = 8;
  const Vec logits = ref::as_stored(DType::kF32, ref::random_vec(N * Vp, 1));
  const std::vector<std::int32_t> targets = {3, -1, 0, 6};
  const double dloss = 1.0 / 3;
  auto loss = [&](const Vec& p) {  // the mean loss over the three counted rows
    TestTensor tl = TestTensor::from(DType::kF32, p);
    std::vector<float> losses(N);
    EXPECT_TRUE(
        cross_entropy_forward(cpu.ctx, losses.data(), nullptr, tl.carg(), targets.data(), N, V, Vp).ok());
    double s = 0;
    for (float l : losses) s += l;
    return s * dloss;
  };
  const CeRun got = run_ce(cpu, DType::kF32, logits, targets, dloss, N, V, Vp, false);
  ref::expect_fd_match(loss, logits, got.dlogits, "cross_entropy");
}

TEST(CrossEntropy, BadTargetsAndShapesAreNamed) {
  ref::CpuContext cpu;
  TestTensor logits(DType::kF32, 2 * 4);
  std::vector<float> losses(2), lse(2);
  const std::vector<std::int32_t> targets = {1, 4};
  STRATA_EXPECT_ERROR(
      cross_entropy_forward(cpu.ctx, losses.data(), lse.data(), logits.carg(), targets.data(), 2, 4, 4),
      kInvalidArgument, "target 4 of row 1 is outside the vocabulary [0, 4)");
  STRATA_EXPECT_ERROR(
      cross_entropy_forward(cpu.ctx, losses.data(), lse.data(), logits.carg(), targets.data(), 2, 5, 4),
      kInvalidArgument, "Vp = 4 is less than V = 5");
  STRATA_EXPECT_ERROR(
      cross_entropy_backward(cpu.ctx, logits.arg(), logits.carg(), nullptr, targets.data(), 1.0f, 2, 4, 4),
      kInvalidArgument, "'lse' is null");
}

}  // namespace
}  // namespace strata::kernels
