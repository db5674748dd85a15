// The vocabulary-parallel kernels of tensor parallelism (embedding_shard_*, cross_entropy_shard_*)
// against the whole-vocabulary kernels: the vocabulary is cut into S shards, each shard's kernels
// run, and the test does what the model's all-reduces do (max or sum over the shards, in shard
// order). Expected:
//  * embedding forward and wte backward: bit for bit (a token's row comes from exactly one shard,
//    the others add exact zeros; each token's rows are summed in the same order as unsharded);
//  * cross-entropy: losses and lse within ref::kF32Tol of float64, dlogits within the dtype's
//    tolerance (the exp-sum is split into per-shard sums: fp32 rounding differs from unsharded).
// Cases include a shard holding only vocabulary padding and ignored rows.
#include "harness/harness.hpp"
#include "kernel_ref/reference.hpp"

namespace strata::kernels {
namespace {

using ref::TestTensor;
using ref::Vec;

class VocabParallelTest : public ::testing::TestWithParam<DType> {};

TEST_P(VocabParallelTest, EmbeddingShardsSumToTheWholeTable) {
  const DType dt = GetParam();
  ref::CpuContext cpu;
  const int B = 3, T = 7, C = 24, Vp = 128, n = B * T;
  std::mt19937 gen(7);
  std::vector<std::int32_t> tok(n);
  for (auto& t : tok) t = static_cast<std::int32_t>(gen() % 97);
  tok[4] = tok[9] = tok[11];  // a repeated token: its rows are summed
  const Vec wte = ref::as_stored(dt, ref::random_vec(static_cast<std::size_t>(Vp) * C, 1));
  const Vec wpe = ref::as_stored(dt, ref::random_vec(static_cast<std::size_t>(T) * C, 2));
  const Vec dout = ref::as_stored(dt, ref::random_vec(static_cast<std::size_t>(n) * C, 3));
  TestTensor twte = TestTensor::from(dt, wte), twpe = TestTensor::from(dt, wpe),
             tdout = TestTensor::from(dt, dout);
  TestTensor whole(dt, static_cast<std::size_t>(n) * C),
      dwhole(DType::kF32, static_cast<std::size_t>(Vp) * C);
  STRATA_ASSERT_OK(
      embedding_forward(cpu.ctx, whole.arg(), tok.data(), twte.carg(), twpe.carg(), B, T, C, Vp));
  STRATA_ASSERT_OK(
      embedding_backward(cpu.ctx, dwhole.arg(), kNoOutput, tdout.carg(), tok.data(), B, T, C, Vp));
  for (int S : {2, 4}) {
    const int Vs = Vp / S;
    Vec sum(static_cast<std::size_t>(n) * C, 0.0), dwte(static_cast<std::size_t>(Vp) * C, 0.0);
    for (int s = 0; s < S; ++s) {
      const Vec rows(wte.begin() + static_cast<std::ptrdiff_t>(s) * Vs * C,
                     wte.begin() + static_cast<std::ptrdiff_t>(s + 1) * Vs * C);
      TestTensor shard = TestTensor::from(dt, rows), out(dt, sum.size()), dshard(DType::kF32, rows.size());
      STRATA_ASSERT_OK(embedding_shard_forward(cpu.ctx, out.arg(), tok.data(), shard.carg(),
                                               s == 0 ? twpe.carg() : kNone, B, T, C, s * Vs, Vs));
      const Vec o = out.values();
      // The all-reduce: fp32 sums (bf16 rounded once), exact here as all but one term are zero.
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = static_cast<float>(sum[i] + o[i]);
      STRATA_ASSERT_OK(
          embedding_shard_backward(cpu.ctx, dshard.arg(), tdout.carg(), tok.data(), B, T, C, s * Vs, Vs));
      const Vec d = dshard.values();
      std::copy(d.begin(), d.end(), dwte.begin() + static_cast<std::ptrdiff_t>(s) * Vs * C);
    }
    TestTensor rounded = TestTensor::from(dt, sum);
    EXPECT_EQ(rounded.values(), whole.values()) << "forward, " << S << " shards";
    EXPECT_EQ(dwte, dwhole.values()) << "wte backward, " << S << " shards";
  }
}

TEST_P(VocabParallelTest, CrossEntropyShardsMatchReference) {
  const DType dt = GetParam();
  ref::CpuContext cpu;
  struct Case {
    int N, V, Vp, S;
  };
  std::uint32_t seed = 11;
  // 90 of 128 with 4 shards: the last shard holds only padding.
  for (Case c : {Case{9, 257, 264, 2}, Case{9, 257, 264, 4}, Case{5, 90, 128, 4}, Case{4, 1025, 1032, 3}}) {
    const int Vs = c.Vp / c.S;
    ASSERT_EQ(Vs * c.S, c.Vp);
    const Vec logits = ref::as_stored(dt, ref::random_vec(static_cast<std::size_t>(c.N) * c.Vp, ++seed, 3.0));
    std::mt19937 gen(++seed);
    std::vector<std::int32_t> targets(c.N);
    for (int n = 0; n < c.N; ++n) targets[n] = n % 4 == 2 ? -1 : static_cast<std::int32_t>(gen() % c.V);
    targets[0] = c.V - 1;  // the last real column
    const double dloss = 1.0 / c.N;
    std::vector<TestTensor> shards;
    for (int s = 0; s < c.S; ++s) {
      Vec part(static_cast<std::size_t>(c.N) * Vs);
      for (int n = 0; n < c.N; ++n)
        for (int v = 0; v < Vs; ++v)
          part[static_cast<std::size_t>(n) * Vs + v] =
              logits[static_cast<std::size_t>(n) * c.Vp + s * Vs + v];
      shards.push_back(TestTensor::from(dt, part));
    }
    std::vector<float> row_max(c.N, -INFINITY), part_max(c.N), sums(2 * c.N, 0.0f), part_sums(2 * c.N);
    for (int s = 0; s < c.S; ++s) {
      STRATA_ASSERT_OK(
          cross_entropy_shard_max(cpu.ctx, part_max.data(), shards[s].carg(), c.N, Vs, s * Vs, c.V));
      for (int n = 0; n < c.N; ++n) row_max[n] = std::max(row_max[n], part_max[n]);
    }
    for (int s = 0; s < c.S; ++s) {
      STRATA_ASSERT_OK(cross_entropy_shard_sums(cpu.ctx, part_sums.data(), shards[s].carg(), row_max.data(),
                                                targets.data(), c.N, Vs, s * Vs, c.V));
      for (int i = 0; i < 2 * c.N; ++i) sums[i] += part_sums[i];
    }
    std::vector<float> losses(c.N), lse(c.N);
    STRATA_ASSERT_OK(cross_entropy_shard_finish(cpu.ctx, losses.data(), lse.data(), row_max.data(),
                                                sums.data(), targets.data(), c.N));
    Vec dlogits(static_cast<std::size_t>(c.N) * c.Vp, 0.0);
    for (int s = 0; s < c.S; ++s) {
      TestTensor d(dt, static_cast<std::size_t>(c.N) * Vs);
      d.fill(5.0);  // padding columns must come back zero
      const bool in_place = s % 2 == 1;
      STRATA_ASSERT_OK(cross_entropy_shard_backward(cpu.ctx, in_place ? shards[s].arg() : d.arg(),
                                                    shards[s].carg(), lse.data(), targets.data(),
                                                    static_cast<float>(dloss), c.N, Vs, s * Vs, c.V));
      const Vec got = in_place ? shards[s].values() : d.values();
      for (int n = 0; n < c.N; ++n)
        for (int v = 0; v < Vs; ++v)
          dlogits[static_cast<std::size_t>(n) * c.Vp + s * Vs + v] =
              got[static_cast<std::size_t>(n) * Vs + v];
    }
    const ref::CrossEntropy want = ref::cross_entropy(logits, targets, dloss, c.N, c.V, c.Vp);
    const std::string what = "N=" + std::to_string(c.N) + " V=" + std::to_string(c.V) +
                             " Vp=" + std::to_string(c.Vp) + " shards=" + std::to_string(c.S);
    Vec got_lse(lse.begin(), lse.end()), got_losses(losses.begin(), losses.end());
    ref::expect_close(got_lse, want.lse, ref::kF32Tol, what + " lse");
    ref::expect_close(got_losses, want.losses, {2 * ref::kF32Tol.atol, 2 * ref::kF32Tol.rtol},
                      what + " losses");
    ref::expect_close(dlogits, want.dlogits, ref::tolerance_for(dt), what + " dlogits");
  }
}

TEST(VocabParallel, BadArguments) {
  ref::CpuContext cpu;
  std::vector<std::int32_t> tok = {0, -1};
  TestTensor wte(DType::kF32, 8), out(DType::kF32, 8);
  EXPECT_EQ(embedding_shard_forward(cpu.ctx, out.arg(), tok.data(), wte.carg(), kNone, 1, 2, 4, 2, 2).code(),
            StatusCode::kInvalidArgument);
  std::vector<std::int32_t> targets = {5};
  std::vector<float> row_max(1, 0.0f), sums(2);
  TestTensor logits(DType::kF32, 4);
  const Status s = cross_entropy_shard_sums(cpu.ctx, sums.data(), logits.carg(), row_max.data(),
                                            targets.data(), 1, 4, 0, 5);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("target 5"), std::string::npos) << s.message();
}

INSTANTIATE_TEST_SUITE_P(Dtypes, VocabParallelTest, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace strata::kernels
