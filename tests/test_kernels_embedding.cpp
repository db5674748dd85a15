// Token + position embedding: forward and backward (sorted, deterministic scatter-add) against
// float64 for both storage types, repeated tokens, missing position table, finite differences,
// thread-count independence and out-of-range tokens. Tolerances: ref::tolerance_for(dtype).
#include "harness/harness.hpp"
#include "kernel_ref/reference.hpp"

namespace strata::kernels {
namespace {

using ref::TestTensor;
using ref::Vec;

std::vector<std::int32_t> random_tokens(int n, int V, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<std::int32_t> t(n);
  for (auto& x : t) x = static_cast<std::int32_t>(gen() % static_cast<std::uint32_t>(V));
  return t;
}

class EmbeddingTest : public ::testing::TestWithParam<DType> {};

TEST_P(EmbeddingTest, ForwardAndBackwardMatchReference) {
  const DType dt = GetParam();
  ref::CpuContext cpu;
  struct Case {
    int B, T, C, V;
    bool wpe;
  };
  std::uint32_t seed = 1;
  for (Case c : {Case{1, 1, 1, 1, true}, Case{2, 17, 33, 257, true}, Case{3, 5, 1025, 7, false},
                 Case{4, 64, 48, 11, true}}) {
    const int n = c.B * c.T;
    const auto tok = random_tokens(n, c.V, ++seed);
    const Vec wte = ref::as_stored(dt, ref::random_vec(static_cast<std::size_t>(c.V) * c.C, ++seed));
    const Vec wpe = ref::as_stored(dt, ref::random_vec(static_cast<std::size_t>(c.T) * c.C, ++seed));
    const Vec dout = ref::as_stored(dt, ref::random_vec(static_cast<std::size_t>(n) * c.C, ++seed));
    TestTensor twte = TestTensor::from(dt, wte), twpe = TestTensor::from(dt, wpe), out(dt, dout.size());
    STRATA_ASSERT_OK(embedding_forward(cpu.ctx, out.arg(), tok.data(), twte.carg(),
                                       c.wpe ? twpe.carg() : kNone, c.B, c.T, c.C, c.V));
    const std::string what = "B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) +
                             " C=" + std::to_string(c.C) + " V=" + std::to_string(c.V);
    ref::expect_close(out.values(), ref::embedding_forward(tok, wte, c.wpe ? &wpe : nullptr, c.B, c.T, c.C),
                      ref::tolerance_for(dt), what + " forward");

    // Gradients accumulate onto what is there, in the gradient's own storage type.
    const Vec dwte0 = ref::as_stored(dt, ref::random_vec(wte.size(), ++seed));
    const Vec dwpe0 = ref::as_stored(dt, ref::random_vec(wpe.size(), ++seed));
    TestTensor tdwte = TestTensor::from(dt, dwte0), tdwpe = TestTensor::from(dt, dwpe0),
               tdout = TestTensor::from(dt, dout);
    STRATA_ASSERT_OK(embedding_backward(cpu.ctx, tdwte.arg(), c.wpe ? tdwpe.arg() : kNoOutput, tdout.carg(),
                                        tok.data(), c.B, c.T, c.C, c.V));
    Vec dwte = dwte0, dwpe = dwpe0;
    ref::embedding_backward(dwte, c.wpe ? &dwpe : nullptr, dout, tok, c.B, c.T, c.C);
    ref::expect_close(tdwte.values(), dwte, ref::tolerance_for(dt), what + " dwte");
    ref::expect_close(tdwpe.values(), dwpe, ref::tolerance_for(dt), what + " dwpe");
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, EmbeddingTest, ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(Embedding, BackwardMatchesFiniteDifferences) {
  ref::CpuContext cpu;
  const int B = 2, T = 3, C = 4, V = 5;
  const std::vector<std::int32_t> tok = {1, 3, 1, 0, 1, 4};  // token 1 three times, 2 never
  const Vec wte = ref::as_stored(DType::kF32, ref::random_vec(V * C, 1));
  const Vec wpe = ref::as_stored(DType::kF32, ref::random_vec(T * C, 2));
  const Vec r = ref::random_vec(B * T * C, 3);
  auto loss = [&](const Vec& p) {
    TestTensor a = TestTensor::from(DType::kF32, Vec(p.begin(), p.begin() + V * C));
    TestTensor b = TestTensor::from(DType::kF32, Vec(p.begin() + V * C, p.end()));
    TestTensor out(DType::kF32, B * T * C);
    EXPECT_TRUE(embedding_forward(cpu.ctx, out.arg(), tok.data(), a.carg(), b.carg(), B, T, C, V).ok());
    return ref::dot(out.values(), r);
  };
  TestTensor dwte(DType::kF32, V * C), dwpe(DType::kF32, T * C), tr = TestTensor::from(DType::kF32, r);
  STRATA_ASSERT_OK(embedding_backward(cpu.ctx, dwte.arg(), dwpe.arg(), tr.carg(), tok.data(), B, T, C, V));
  Vec p = wte, g = dwte.values();
  p.insert(p.end(), wpe.begin(), wpe.end());
  const Vec gp = dwpe.values();
  g.insert(g.end(), gp.begin(), gp.end());
  ref::expect_fd_match(loss, p, g, "embedding");
}

TEST(Embedding, BackwardDoesNotDependOnTheThreadCount) {
  ref::CpuContext one(1), three(3);
  const int B = 8, T = 64, C = 40, V = 9;  // few tokens: long runs per token
  const auto tok = random_tokens(B * T, V, 5);
  const Vec dout = ref::random_vec(static_cast<std::size_t>(B) * T * C, 6);
  Vec results[2];
  int i = 0;
  for (ref::CpuContext* cpu : {&one, &three}) {
    TestTensor dwte(DType::kBF16, V * C), tdout = TestTensor::from(DType::kBF16, dout);
    STRATA_ASSERT_OK(
        embedding_backward(cpu->ctx, dwte.arg(), kNoOutput, tdout.carg(), tok.data(), B, T, C, V));
    results[i++] = dwte.values();
  }
  EXPECT_EQ(results[0], results[1]);
}

TEST(Embedding, OutOfRangeTokensAreNamed) {
  ref::CpuContext cpu;
  const std::vector<std::int32_t> tok = {0, 1, 9, 2};
  TestTensor wte(DType::kF32, 4 * 3), out(DType::kF32, 4 * 3);
  STRATA_EXPECT_ERROR(embedding_forward(cpu.ctx, out.arg(), tok.data(), wte.carg(), kNone, 2, 2, 3, 4),
                      kInvalidArgument, "token 9 at (b=1, t=0) is outside the vocabulary [0, 4)");
  STRATA_EXPECT_ERROR(embedding_backward(cpu.ctx, wte.arg(), kNoOutput, out.carg(), tok.data(), 2, 2, 3, 4),
                      kInvalidArgument, "token 9");
  STRATA_EXPECT_ERROR(embedding_forward(cpu.ctx, out.arg(), nullptr, wte.carg(), kNone, 2, 2, 3, 4),
                      kInvalidArgument, "'tokens' is null");
}

}  // namespace
}  // namespace strata::kernels
