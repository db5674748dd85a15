// Pipeline parallelism on the offload engine, on real processes: run by tests/mpi_run.sh under
// `mpirun -np P` (tests/CMakeLists.txt); the world is one pipeline of P stages. Every stage
// trains with the pipeline engine and, in the same process, the single-process engine on the
// same global batch (grad_accum micro-batches) as the reference, then compares the state of the
// parameters its stage holds.
//
// What is compared, and how exactly (docs/parallel.md "Pipeline parallel"):
// - LLaMA (untied head), and GPT-2 with one micro-batch: bit for bit (losses, gradient norms,
//   parameters, master weights, Adam moments). Each module computes what it computes in one
//   process, every stage runs the backwards in micro-batch order (the same accumulation), the
//   norm merges per-unit statistics in unit order, and the tied wte's two parts e + h are added
//   once (a sum of two is exact whatever the order).
// - GPT-2 with several micro-batches: the tied wte's gradient is (e0 + e1 + ...) + (h0 + h1 + ...)
//   instead of e0 + h0 + e1 + h1 + ...: rounding, so the state agrees within the tolerance below
//   (relative, measured with a 10x margin), and the runs' losses within 1e-5 relative.
// - The first and the last stage's copies of the embedding are identical bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "comm_environment.hpp"
#include "dist_compare.hpp"
#include "offload_fixture.hpp"
#include "strata/parallel.hpp"

namespace strata {
namespace {

using testing::capture_stage;
using testing::fnv;
using testing::Snapshot;
using testing::world;

// The tied wte's sum order moves GPT-2's state by rounding (largest difference relative to the
// quantity's largest value; check_case prints the measured figures). Measured on 2 and 3 stages,
// fp32, lr 1e-2, 3 steps: parameters 3.0e-5, exp_avg 1e-6, exp_avg_sq 7e-7 of their scale; a
// missing or doubled tied gradient moves the parameters by about the learning rate.
constexpr double kRelTolerance = 3e-4;

struct Case {
  ModelKind kind;
  PipelineSchedule schedule;
  std::int64_t micro;
  Tier params, optimizer;
  DType dtype = DType::kF32;
};

std::string name_of(const Case& c) {
  return std::string(to_string(c.kind)) + " " + std::string(to_string(c.schedule)) +
         " m=" + std::to_string(c.micro) + " params=" + std::string(to_string(c.params)) +
         " optimizer=" + std::string(to_string(c.optimizer)) + " " + std::string(to_string(c.dtype));
}

void check_case(const Case& c) {
  const std::string what = name_of(c) + " on " + std::to_string(world().size()) + " stages";
  const TrainerConfig config = testing::tiny(c.kind, c.dtype, c.micro, 1.0);
  OffloadSettings s;
  s.params = c.params;
  s.optimizer = c.optimizer;
  s.persistence_threshold = 0;
  s.pipeline_schedule = c.schedule;
  testing::TempDir swap_pp("strata-pp-swap"), swap_ref("strata-pp-swap");  // each rank its own
  OffloadSettings ref_settings = s;
  if (c.params == Tier::kNvme || c.optimizer == Tier::kNvme) {
    s.nvme_path = {swap_pp.path().string()};
    ref_settings.nvme_path = {swap_ref.path().string()};
  }
  constexpr int kSteps = 3;
  Snapshot got, ref;
  std::vector<int> held;
  {
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(config, s, *device, nullptr, nullptr, nullptr, &world());
    ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
    ASSERT_TRUE(testing::run_steps(**engine, config, 0, kSteps, got)) << what;
    ASSERT_TRUE(capture_stage(**engine, got, held)) << what;
    // Only this stage's parameters are placed: the plan is smaller than one process's.
    EXPECT_FALSE(held.empty()) << what;
    auto loss = (*engine)->loss(std::vector<std::int32_t>(32, 1), std::vector<std::int32_t>(32, 1));
    ASSERT_FALSE(loss.ok());
    EXPECT_NE(loss.status().message().find("pipeline stages is not built yet"), std::string::npos);
  }
  {
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(config, ref_settings, *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    ASSERT_TRUE(testing::run_steps(**engine, config, 0, kSteps, ref)) << what;
    for (int idx : held) {
      ref.param.push_back(*(*engine)->get_param(idx));
      ref.master.push_back(*(*engine)->get_master(idx));
      ref.m.push_back(*(*engine)->get_exp_avg(idx));
      ref.v.push_back(*(*engine)->get_exp_avg_sq(idx));
    }
  }
  const bool exact = c.kind == ModelKind::kLlama || c.micro == 1;
  if (exact) {
    testing::expect_same(ref, got, what);
  } else {
    // Relative to each quantity's largest value; measured (see the file comment).
    const std::vector<std::vector<float>>* r[] = {&ref.param, &ref.master, &ref.m, &ref.v};
    const std::vector<std::vector<float>>* g[] = {&got.param, &got.master, &got.m, &got.v};
    const char* names[] = {"parameters", "master weights", "exp_avg", "exp_avg_sq"};
    for (int k = 0; k < 4; ++k) {
      double worst = 0, scale = 0;
      for (std::size_t i = 0; i < r[k]->size(); ++i) {
        for (std::size_t e = 0; e < (*r[k])[i].size(); ++e) {
          worst = std::max(worst, std::fabs(static_cast<double>((*r[k])[i][e]) - (*g[k])[i][e]));
          scale = std::max(scale, std::fabs(static_cast<double>((*r[k])[i][e])));
        }
      }
      if (world().rank() == 0)
        std::printf("%s: %s max |difference| %.3g of %.3g\n", what.c_str(), names[k], worst, scale);
      EXPECT_LE(worst, kRelTolerance * scale) << what << ": " << names[k];
    }
    for (std::size_t i = 0; i < ref.losses.size(); ++i) {
      EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * std::fabs(ref.losses[i]))
          << what << ": loss " << i + 1;
      EXPECT_NEAR(got.norms[i], ref.norms[i], 1e-4 * std::fabs(ref.norms[i])) << what << ": norm " << i + 1;
    }
  }
  // Every stage reports the same loss (the last stage's) and norm.
  double mine[2] = {got.losses.back(), got.norms.back()};
  std::vector<double> all(static_cast<std::size_t>(2 * world().size()));
  ASSERT_TRUE(world().all_gather(mine, all.data(), 4, DType::kF32).wait().ok());
  for (int r = 0; r < world().size(); ++r) {
    EXPECT_EQ(all[static_cast<std::size_t>(2 * r)], mine[0]) << what << ": loss on stage " << r;
    EXPECT_EQ(all[static_cast<std::size_t>(2 * r + 1)], mine[1]) << what << ": norm on stage " << r;
  }
  // GPT-2: the first and the last stage hold the same embedding, bit for bit.
  if (c.kind == ModelKind::kGpt2) {
    std::uint64_t h = 0;
    if (!held.empty() && held.front() == 0) {  // wte (parameter 0) held here
      h = fnv({got.param[0], got.master[0], got.m[0], got.v[0]});
    }
    std::vector<std::uint64_t> hs(static_cast<std::size_t>(world().size()));
    ASSERT_TRUE(world().all_gather(&h, hs.data(), 2, DType::kF32).wait().ok());
    EXPECT_NE(hs.front(), 0u);
    EXPECT_EQ(hs.front(), hs.back()) << what << ": the first and the last stage's wte differ";
  }
}

TEST(PipelineEngine, AllDeviceEverySchedule) {
  for (ModelKind kind : {ModelKind::kLlama, ModelKind::kGpt2}) {
    for (PipelineSchedule sched : {PipelineSchedule::kGpipe, PipelineSchedule::kOneFOneB}) {
      for (std::int64_t m : {1, 2, 4}) check_case({kind, sched, m, Tier::kDevice, Tier::kDevice});
    }
  }
}

TEST(PipelineEngine, HostOptimizer) {
  for (ModelKind kind : {ModelKind::kLlama, ModelKind::kGpt2}) {
    check_case({kind, PipelineSchedule::kOneFOneB, 2, Tier::kDevice, Tier::kHost});
    check_case({kind, PipelineSchedule::kGpipe, 1, Tier::kHost, Tier::kHost});
  }
}

TEST(PipelineEngine, NvmeParamsAndOptimizer) {
  check_case({ModelKind::kLlama, PipelineSchedule::kOneFOneB, 4, Tier::kNvme, Tier::kHost});
  check_case({ModelKind::kGpt2, PipelineSchedule::kOneFOneB, 1, Tier::kHost, Tier::kNvme});
}

// 16-bit working weights; fp16 with dynamic loss scaling (the tiny config overflows now and then:
// the overflow decision comes from the global norm, so every stage skips the same steps).
TEST(PipelineEngine, HalfPrecision) {
  check_case({ModelKind::kLlama, PipelineSchedule::kOneFOneB, 2, Tier::kDevice, Tier::kHost, DType::kBF16});
  check_case({ModelKind::kLlama, PipelineSchedule::kGpipe, 2, Tier::kDevice, Tier::kDevice, DType::kF16});
  check_case({ModelKind::kLlama, PipelineSchedule::kOneFOneB, 4, Tier::kDevice, Tier::kHost, DType::kF16});
}

// Pipeline x data parallel on 4 ranks (make_process_groups: 2 stages x 2 data-parallel ranks,
// ranks {0,1} and {2,3} the pipelines, {0,2} and {1,3} the data-parallel groups): each pipeline
// trains its share of the global batch (global micro-batches d, d + 2, ...), against one process
// on the whole batch. The data-parallel sums run in another order (each rank's micro-batches,
// then across ranks), so within rounding, as in test_dist_data_parallel: measured max 2.4e-5 of
// each quantity's scale (3 steps, lr 1e-2); held to 3e-4. A missing reduction moves the
// parameters by about the learning rate.
TEST(PipelineEngine, ComposedWithDataParallel) {
  ASSERT_EQ(world().size(), 4) << "runs on 4 ranks (2 stages x 2 data-parallel ranks; tests/CMakeLists.txt filters it elsewhere)";
  auto groups = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, 1, 2);
  ASSERT_TRUE(groups.ok()) << groups.status().to_string();
  const int DP = groups->grid.dp(), d = groups->coord.dp;
  ASSERT_EQ(DP, 2);
  struct Composed {
    ModelKind kind;
    Tier optimizer;
    int zero_stage;
    Tier params = Tier::kDevice;
  };
  // Stage 3 with the parameters on the host: each stage's modules are partitioned over its
  // data-parallel group and every fetch all-gathers them (the tied embedding's copy on the last
  // stage too).
  for (const Composed& c :
       {Composed{ModelKind::kGpt2, Tier::kDevice, 0}, Composed{ModelKind::kGpt2, Tier::kHost, 1},
        Composed{ModelKind::kLlama, Tier::kHost, 2}, Composed{ModelKind::kGpt2, Tier::kHost, 3, Tier::kHost}}) {
    const std::string what = std::string(to_string(c.kind)) + " params=" + std::string(to_string(c.params)) +
                             " optimizer=" + std::string(to_string(c.optimizer)) + " stage " +
                             std::to_string(c.zero_stage) + ", 2 stages x 2 data-parallel ranks";
    const TrainerConfig global = testing::tiny(c.kind, DType::kF32, 2 * DP, 1.0);
    TrainerConfig local = global;
    local.grad_accum = 2;
    OffloadSettings s;
    s.optimizer = c.optimizer;
    s.params = c.params;
    s.zero_stage = c.zero_stage;
    s.persistence_threshold = 0;
    constexpr int kSteps = 3;
    Snapshot got, ref;
    std::vector<int> held;
    {
      auto device = testing::make_device();
      auto engine = OffloadEngine::create(local, s, *device, nullptr, groups->dp.get(), nullptr, groups->pp.get());
      ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
      std::vector<std::int32_t> gin, gtg, in, tg;
      const std::size_t per = static_cast<std::size_t>(global.micro_batch * global.seq_len);
      for (int step = 0; step < kSteps; ++step) {
        testing::batch(global, step, gin, gtg);
        in.clear();
        tg.clear();
        for (std::size_t i = static_cast<std::size_t>(d); i < static_cast<std::size_t>(global.grad_accum);
             i += DP) {
          in.insert(in.end(), gin.begin() + static_cast<std::ptrdiff_t>(i * per),
                    gin.begin() + static_cast<std::ptrdiff_t>((i + 1) * per));
          tg.insert(tg.end(), gtg.begin() + static_cast<std::ptrdiff_t>(i * per),
                    gtg.begin() + static_cast<std::ptrdiff_t>((i + 1) * per));
        }
        auto m = (*engine)->step(in, tg);
        ASSERT_TRUE(m.ok()) << what << ": " << m.status().to_string();
        got.losses.push_back(m->loss);
        got.norms.push_back(m->grad_norm);
      }
      ASSERT_TRUE(capture_stage(**engine, got, held)) << what;
    }
    {
      auto device = testing::make_device();
      OffloadSettings rs = s;
      rs.zero_stage = 0;
      auto engine = OffloadEngine::create(global, rs, *device);
      ASSERT_TRUE(engine.ok()) << engine.status().to_string();
      ASSERT_TRUE(testing::run_steps(**engine, global, 0, kSteps, ref)) << what;
      for (int idx : held) {
        ref.param.push_back(*(*engine)->get_param(idx));
        ref.master.push_back(*(*engine)->get_master(idx));
        ref.m.push_back(*(*engine)->get_exp_avg(idx));
        ref.v.push_back(*(*engine)->get_exp_avg_sq(idx));
      }
    }
    const std::vector<std::vector<float>>* r[] = {&ref.param, &ref.master, &ref.m, &ref.v};
    const std::vector<std::vector<float>>* g[] = {&got.param, &got.master, &got.m, &got.v};
    const char* names[] = {"parameters", "master weights", "exp_avg", "exp_avg_sq"};
    ASSERT_EQ(ref.param.size(), got.param.size()) << what;
    for (int k = 0; k < 4; ++k) {
      double worst = 0, scale = 0;
      for (std::size_t i = 0; i < r[k]->size(); ++i) {
        for (std::size_t e = 0; e < (*r[k])[i].size(); ++e) {
          worst = std::max(worst, std::fabs(static_cast<double>((*r[k])[i][e]) - (*g[k])[i][e]));
          scale = std::max(scale, std::fabs(static_cast<double>((*r[k])[i][e])));
        }
      }
      if (world().rank() == 0)
        std::printf("%s: %s max |difference| %.3g of %.3g\n", what.c_str(), names[k], worst, scale);
      EXPECT_LE(worst, 3e-4 * scale) << what << ": " << names[k];
    }
    for (std::size_t i = 0; i < ref.losses.size(); ++i) {
      EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * std::fabs(ref.losses[i]))
          << what << ": loss " << i + 1;
      EXPECT_NEAR(got.norms[i], ref.norms[i], 1e-4 * std::fabs(ref.norms[i])) << what << ": norm " << i + 1;
    }
  }
}

}  // namespace
}  // namespace strata
