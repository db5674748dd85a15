// optimizer_step(): skip on overflow leaves every byte and step count untouched; clipping by the
// global norm over several buffers and groups; errors write nothing. Also the tunables that
// configure the CPU optimizer, and the benchmark's command line.
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "harness/harness.hpp"
#include "strata/build_config.hpp"
#include "strata/optim.hpp"
#include "strata/options.hpp"

namespace strata {
namespace {

struct Buf {
  std::vector<float> master, grad, m, v;
  std::vector<std::uint16_t> out;
  Buf(std::size_t n, std::uint32_t seed, float grad_scale) : master(n), grad(n), m(n), v(n), out(n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::size_t i = 0; i < n; ++i) {
      master[i] = normal(rng);
      grad[i] = grad_scale * normal(rng);
      m[i] = 0.01f * normal(rng);
      v[i] = 0.001f * std::fabs(normal(rng));
    }
  }
  OptimizerBuffers view() {
    OptimizerBuffers b;
    b.master = master.data();
    b.grad = grad.data();
    b.exp_avg = m.data();
    b.exp_avg_sq = v.data();
    b.param_out = out.data();
    b.n = master.size();
    return b;
  }
  bool operator==(const Buf& o) const {
    return std::memcmp(master.data(), o.master.data(), master.size() * 4) == 0 &&
           std::memcmp(m.data(), o.m.data(), m.size() * 4) == 0 &&
           std::memcmp(v.data(), o.v.data(), v.size() * 4) == 0 && out == o.out &&
           std::memcmp(grad.data(), o.grad.data(), grad.size() * 4) == 0;
  }
};

CpuOptimizer optimizer() {
  CpuOptimizerConfig c;
  c.isa = best_optimizer_isa();
  c.threads = 2;
  return std::move(CpuOptimizer::create(c)).value();
}

LossScaler scaler() {
  LossScalerConfig c;
  c.initial_scale_power = 10;
  c.loss_scale_window = 3;
  c.hysteresis = 1;
  return std::move(LossScaler::create(c)).value();
}

TEST(OptimizerStep, OverflowSkipsAndLeavesEverythingUntouched) {
  const CpuOptimizer opt = optimizer();
  LossScaler ls = scaler();
  ParamGroup a{"decay", OptimizerHyper::defaults(OptimizerKind::kAdamW), 7};
  ParamGroup b{"no_decay", OptimizerHyper::defaults(OptimizerKind::kAdam), 7};
  Buf x(3000, 1, 1024.0f), y(17, 2, 1024.0f), z(40000, 3, 1024.0f);
  for (float bad : {NAN, INFINITY}) {
    z.grad[39999] = bad;
    const Buf x0 = x, y0 = y, z0 = z;
    const double scale_before = ls.scale();
    const GroupBuffers list[] = {{&a, x.view()}, {&b, y.view()}, {&a, z.view()}};
    auto r = optimizer_step(opt, ls, list, 1.0);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_FALSE(r->applied);
    EXPECT_EQ(r->loss_scale, scale_before);
    EXPECT_EQ(r->next_loss_scale, scale_before / 2);
    EXPECT_EQ(ls.scale(), scale_before / 2);
    EXPECT_TRUE(x == x0 && y == y0 && z == z0) << "a skipped step wrote to optimizer state";
    EXPECT_EQ(a.step, 7);
    EXPECT_EQ(b.step, 7);
  }
}

TEST(OptimizerStep, ClipsByTheGlobalNormOfAllBuffersAndAdvancesEachGroupOnce) {
  const CpuOptimizer opt = optimizer();
  LossScaler ls = scaler();
  const double scale = ls.scale();
  ParamGroup a{"a", OptimizerHyper::defaults(OptimizerKind::kAdamW), 0};
  ParamGroup b{"b", OptimizerHyper::defaults(OptimizerKind::kLion), 0};
  Buf x(3000, 1, 1024.0f), y(17, 2, 1024.0f), z(40000, 3, 1024.0f);
  Buf x2 = x, y2 = y, z2 = z;  // the same step done by hand

  const GroupBuffers list[] = {{&a, x.view()}, {&b, y.view()}, {&a, z.view()}};
  const double max_norm = 1.0;
  auto r = optimizer_step(opt, ls, list, max_norm);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_TRUE(r->applied);
  EXPECT_EQ(a.step, 1);  // two buffers, one step
  EXPECT_EQ(b.step, 1);

  // By hand: the norm of all unscaled gradients together, then one clip factor for everyone.
  double sum = 0;
  for (const Buf* buf : {&x2, &y2, &z2}) {
    for (float g : buf->grad) {
      const double u = static_cast<float>(g * static_cast<float>(1.0 / scale));
      sum += u * u;
    }
  }
  const double norm = std::sqrt(sum);
  EXPECT_NEAR(r->grad_norm, norm, 1e-12 * norm);
  EXPECT_GT(norm, max_norm) << "the test data should need clipping";
  const double clip = clip_coefficient(norm, max_norm);
  EXPECT_NEAR(r->clip_coefficient, clip, 1e-12 * clip);
  const float grad_scale =
      static_cast<float>(static_cast<double>(static_cast<float>(1.0 / scale)) * r->clip_coefficient);
  STRATA_ASSERT_OK(opt.update(a.hyper, 1, grad_scale, x2.view()));
  STRATA_ASSERT_OK(opt.update(b.hyper, 1, grad_scale, y2.view()));
  STRATA_ASSERT_OK(opt.update(a.hyper, 1, grad_scale, z2.view()));
  EXPECT_TRUE(x == x2 && y == y2 && z == z2);

  // Without clipping (max_norm 0) the coefficient is 1.
  auto r2 = optimizer_step(opt, ls, list, 0.0);
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->clip_coefficient, 1.0);
  EXPECT_EQ(a.step, 2);
}

TEST(OptimizerStep, ABadBufferFailsTheStepBeforeAnythingIsWritten) {
  const CpuOptimizer opt = optimizer();
  LossScaler ls = scaler();
  ParamGroup a{"a", OptimizerHyper::defaults(OptimizerKind::kAdamW), 3};
  Buf x(1000, 1, 1.0f), y(1000, 2, 1.0f);
  const Buf x0 = x;
  OptimizerBuffers broken = y.view();
  broken.exp_avg_sq = nullptr;
  const GroupBuffers list[] = {{&a, x.view()}, {&a, broken}};
  STRATA_EXPECT_ERROR(optimizer_step(opt, ls, list, 1.0), kInvalidArgument, "exp_avg_sq is null");
  EXPECT_TRUE(x == x0);
  EXPECT_EQ(a.step, 3);
  const GroupBuffers orphan[] = {{nullptr, x.view()}};
  STRATA_EXPECT_ERROR(optimizer_step(opt, ls, orphan, 1.0), kInvalidArgument, "no parameter group");
  ParamGroup bad{"wrong", OptimizerHyper::defaults(OptimizerKind::kAdamW), 0};
  bad.hyper.lr = -1;
  const GroupBuffers bad_list[] = {{&bad, x.view()}};
  STRATA_EXPECT_ERROR(optimizer_step(opt, ls, bad_list, 1.0), kInvalidArgument, "group 'wrong'");
}

// ---- Tunables ---------------------------------------------------------------------------------

TEST(OptimOptions, AdamIsaAndHostThreadsComeFromTheTunables) {
  Options o;
  EXPECT_EQ(o.get_string(Option::kAdamIsa), "auto");
  auto c = CpuOptimizerConfig::from_options(o);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->isa, best_optimizer_isa());
  EXPECT_GE(c->threads, 1);

  ::setenv("STRATA_ADAM_ISA", "scalar", 1);
  ::setenv("STRATA_HOST_THREADS", "3", 1);
  Options env;
  const Status s = env.load_env();
  ::unsetenv("STRATA_ADAM_ISA");
  ::unsetenv("STRATA_HOST_THREADS");
  STRATA_ASSERT_OK(s);
  auto ce = CpuOptimizerConfig::from_options(env);
  ASSERT_TRUE(ce.ok());
  EXPECT_EQ(ce->isa, SimdIsa::kScalar);
  EXPECT_EQ(ce->threads, 3);

  Options bad;
  STRATA_EXPECT_ERROR(bad.set(Option::kAdamIsa, "sse2", "STRATA_ADAM_ISA"), kInvalidArgument, "avx512");
}

// ---- The fused device AdamW's argument checks (no GPU needed: they run before any CUDA call) -----

TEST(FusedAdamArguments, CheckedBeforeAnyLaunch) {
  const OptimizerHyper adamw = OptimizerHyper::defaults(OptimizerKind::kAdamW);
#if STRATA_HAVE_CUDA
  STRATA_EXPECT_OK(fused_adam_cuda({}, DType::kBF16, DType::kF32, adamw, 1, 1.0f, nullptr));
  STRATA_EXPECT_ERROR(fused_adam_cuda({}, DType::kBF16, DType::kF32,
                                      OptimizerHyper::defaults(OptimizerKind::kLion), 1, 1.0f, nullptr),
                      kInvalidArgument, "lion");
  STRATA_EXPECT_ERROR(fused_adam_cuda({}, DType::kBF16, DType::kF32, adamw, 0, 1.0f, nullptr),
                      kInvalidArgument, "steps count from 1");
  const DeviceAdamTensor missing{nullptr, nullptr, nullptr, nullptr, nullptr, 10};
  STRATA_EXPECT_ERROR(fused_adam_cuda({&missing, 1}, DType::kBF16, DType::kF32, adamw, 1, 1.0f, nullptr),
                      kInvalidArgument, "tensor 0 has a null pointer");
#else
  STRATA_EXPECT_ERROR(fused_adam_cuda({}, DType::kBF16, DType::kF32, adamw, 1, 1.0f, nullptr), kUnavailable,
                      "no CUDA");
#endif
}

// ---- The benchmark's command line ----------------------------------------------------------------

// Sizes that fit in the cache are usage errors naming --params and the minimum, which the
// test then uses (the smallest size the benchmark accepts on this machine).
std::uint64_t minimum_bench_params() {
  const auto r = testing::run_cli("bench adam --json --params 40000 --reps 1 --threads 1");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--params 40000 is too small"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("last-level cache"), std::string::npos) << r.output;
  const std::string marker = "the minimum is --params ";
  const auto at = r.output.find(marker);
  if (at == std::string::npos) return 0;
  return std::strtoull(r.output.c_str() + at + marker.size(), nullptr, 10);
}

TEST(OptimBench, RejectsSizesThatFitInCache) {
  const std::uint64_t min_params = minimum_bench_params();
  EXPECT_GE(min_params * 20, 64u << 20) << "at least 64 MiB of state";
  EXPECT_EQ(testing::run_cli("bench adam --params 1").exit_code, 2);
  const auto below = testing::run_cli("bench adam --params " + std::to_string(min_params - 1) + " --help");
  EXPECT_EQ(below.exit_code, 0) << "--help wins over a bad size";
}

TEST(OptimBench, PrintsTheFiguresForThreeVariants) {
  const std::uint64_t n = minimum_bench_params();
  ASSERT_GT(n, 0u);
  // One thread timed by its own CPU time: the ratios stay meaningful on a shared machine.
  const auto r = testing::run_cli("bench adam --json --params " + std::to_string(n) +
                                  " --reps 3 --threads 1 --clock cpu");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.output;
  EXPECT_EQ(j["isa"], std::string(to_string(best_optimizer_isa())));
  EXPECT_EQ(j["threads"], 1);
  EXPECT_EQ(j["params"].get<std::uint64_t>(), n) << "the size asked for";
  EXPECT_EQ(j["min_params"].get<std::uint64_t>(), n);
  EXPECT_EQ(j["reps"], 3);
  EXPECT_EQ(j["clock"], "cpu");
  ASSERT_EQ(j["variants"].size(), 3u);
  const std::uint64_t bytes_per_param[] = {28, 28, 20};
  for (std::size_t k = 0; k < 3; ++k) {
    const auto& v = j["variants"][k];
    SCOPED_TRACE(v.dump());
    for (const char* key :
         {"mparams_per_s", "roofline_mparams_per_s", "ratio_to_roofline", "ratio_min", "ratio_max",
          "best_ratio", "roofline_gb_per_s", "min_cpu_share", "isa", "threads"}) {
      ASSERT_TRUE(v.contains(key)) << key;
    }
    EXPECT_EQ(v["bytes_per_param"], bytes_per_param[k]);
    EXPECT_EQ(v["isa"], j["isa"]);
    const double ratio = v["ratio_to_roofline"].get<double>();
    EXPECT_GT(ratio, 0.0);
    EXPECT_LE(ratio, 1.5) << "the update cannot move its bytes much faster than a plain stream of them";
    EXPECT_LE(v["ratio_min"].get<double>(), ratio);
    EXPECT_GE(v["ratio_max"].get<double>(), ratio);
    const double mparams = v["mparams_per_s"].get<double>(), roof = v["roofline_mparams_per_s"].get<double>();
    EXPECT_GT(mparams, 0.0);
    EXPECT_GT(roof, 0.0);
    EXPECT_GE(v["best_mparams_per_s"].get<double>(), mparams) << "the best rep is at least the median";
    EXPECT_NEAR(v["roofline_gb_per_s"].get<double>(), roof * 1e6 * bytes_per_param[k] / 1e9, 1e-9 * roof);
    EXPECT_NEAR(v["best_ratio"].get<double>(),
                v["best_mparams_per_s"].get<double>() / v["best_roofline_mparams_per_s"].get<double>(), 1e-9);
    EXPECT_GT(v["min_cpu_share"].get<double>(), 0.0);
  }
  EXPECT_TRUE(j["variants"][2].contains("speedup_vs_fp32_moments"));

  EXPECT_EQ(testing::run_cli("bench adam --params lots").exit_code, 2);
  EXPECT_EQ(testing::run_cli("bench adam --isa mmx").exit_code, 2);
}

}  // namespace
}  // namespace strata
