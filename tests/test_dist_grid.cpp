// Tensor x pipeline x data parallel in one run (the TP x PP x DP grid of make_process_groups), on
// the offload engine, on real processes: run by tests/mpi_run.sh under `mpirun -np 4` (tp 2 x pp 2)
// and `mpirun -np 8` (tp 2 x pp 2 x dp 2), tests/CMakeLists.txt. Every stage is a tensor-parallel
// group of shard engines; each pipeline (dp coordinate d) trains global micro-batches d, d + DP,
// ... of each step. Every rank also trains, in the same process, the single-process engine on the
// whole global batch as the reference.
//
// What is compared, and how exactly (docs/parallel.md "Tensor x pipeline x data parallel"):
// - Every rank reports the same loss and gradient norm, bit for bit (the loss comes from the last
//   stage of its own pipeline; the norm is merged over dp, then the stages, then tp, in one order).
// - The ranks of one stage (its tp ranks, and the same stage of every pipeline) end with the same
//   bits of every full parameter and its optimizer state; GPT-2's first and last stage hold the
//   same wte, bit for bit (the tied gradient is summed between them per tp and dp coordinate).
// - Against one process: the tensor-parallel rounding (row-parallel sums, the split softmax), the
//   data-parallel sum order and GPT-2's tied-gradient order, all fp32: within test_dist_tensor_
//   parallel's fp32 tolerances (each figure printed by rank 0; measured well inside them).
// - LLaMA (no tied unit): the pipeline computes what one process computes, module by module, so
//   the grid gives the bits of the tensor-parallel (x data-parallel) engine on the same tp and dp
//   groups without a pipeline: parameters, masters and moments bit for bit; the loss too; the
//   norm bit for bit without data parallelism (with it, the grid merges per unit over dp before
//   the stages, one process of the tp x dp run merges unit by unit and rank by rank: the same
//   double-precision sums associated differently, within 1e-12 relative; clipping is off so that
//   the norm does not enter the update).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "comm_environment.hpp"
#include "offload_fixture.hpp"
#include "strata/parallel.hpp"

namespace strata {
namespace {

using testing::Snapshot;
using testing::world;

std::uint64_t fnv(const std::vector<std::vector<float>>& tensors, std::uint64_t h = 1469598103934665603ull) {
  for (const auto& t : tensors) {
    const auto* p = reinterpret_cast<const unsigned char*>(t.data());
    for (std::size_t i = 0; i < t.size() * 4; ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
  return h;
}

// The full state (gathered over the stage's tensor-parallel group) of the parameters this stage
// holds, in layout order; `held` lists their indices. The others are refused, naming the stage.
bool capture_stage(OffloadEngine& engine, Snapshot& out, std::vector<int>& held) {
  const ModelLayout& L = engine.model().layout();
  for (std::size_t i = 0; i < L.params.size(); ++i) {
    if (!L.params[i].owns_storage()) continue;
    const int idx = static_cast<int>(i);
    auto p = engine.get_param(idx);
    if (!p.ok()) {
      EXPECT_NE(p.status().message().find("held by pipeline stage"), std::string::npos)
          << p.status().to_string();
      continue;
    }
    auto ma = engine.get_master(idx);
    auto mm = engine.get_exp_avg(idx);
    auto vv = engine.get_exp_avg_sq(idx);
    EXPECT_TRUE(ma.ok() && mm.ok() && vv.ok()) << L.params[i].name;
    if (!(ma.ok() && mm.ok() && vv.ok())) return false;
    held.push_back(idx);
    out.param.push_back(*p);
    out.master.push_back(*ma);
    out.m.push_back(*mm);
    out.v.push_back(*vv);
  }
  return true;
}

// The state of `held` from an engine that holds every parameter (collective over its groups).
bool capture_held(OffloadEngine& engine, const std::vector<int>& held, Snapshot& out) {
  for (int idx : held) {
    auto p = engine.get_param(idx);
    auto ma = engine.get_master(idx);
    auto mm = engine.get_exp_avg(idx);
    auto vv = engine.get_exp_avg_sq(idx);
    EXPECT_TRUE(p.ok() && ma.ok() && mm.ok() && vv.ok()) << "parameter " << idx;
    if (!(p.ok() && ma.ok() && mm.ok() && vv.ok())) return false;
    out.param.push_back(*p);
    out.master.push_back(*ma);
    out.m.push_back(*mm);
    out.v.push_back(*vv);
  }
  return true;
}

// Steps of the global batch: this data-parallel rank's share (global micro-batches d, d + DP, ...).
bool run_share(OffloadEngine& engine, const TrainerConfig& global, int dp, int DP, int steps, Snapshot& out) {
  const std::size_t per = static_cast<std::size_t>(global.micro_batch * global.seq_len);
  for (int step = 0; step < steps; ++step) {
    std::vector<std::int32_t> gin, gtg, in, tg;
    testing::batch(global, step, gin, gtg);
    for (std::size_t i = static_cast<std::size_t>(dp); i < static_cast<std::size_t>(global.grad_accum);
         i += static_cast<std::size_t>(DP)) {
      in.insert(in.end(), gin.begin() + static_cast<std::ptrdiff_t>(i * per),
                gin.begin() + static_cast<std::ptrdiff_t>((i + 1) * per));
      tg.insert(tg.end(), gtg.begin() + static_cast<std::ptrdiff_t>(i * per),
                gtg.begin() + static_cast<std::ptrdiff_t>((i + 1) * per));
    }
    auto m = engine.step(in, tg);
    EXPECT_TRUE(m.ok()) << m.status().to_string();
    if (!m.ok()) return false;
    out.losses.push_back(m->loss);
    out.norms.push_back(m->grad_norm);
  }
  return true;
}

// test_dist_tensor_parallel's fp32 tolerances (measured there on 2 ranks: loss 6.5e-7 relative,
// norm 7.6e-6, parameters rms 1.6e-6 and max 4.2e-4, moments rms 1.2e-6 and max 9e-5 of their
// scale). A wrong shard, a missing reduction or a lost tied gradient moves the parameters by
// about the learning rate (1e-2).
struct Tolerance {
  double loss = 1e-5;  // relative
  double norm = 1e-4;  // relative
  double rms = 1e-5;   // parameters and master weights: absolute; moments: of their largest value
  double max = 2e-3;
};

struct Diff {
  double max = 0.0, rms = 0.0;
};

Diff diff_of(const std::vector<std::vector<float>>& ref, const std::vector<std::vector<float>>& got) {
  Diff d;
  double sum = 0.0;
  std::size_t n = 0;
  for (std::size_t i = 0; i < ref.size() && i < got.size(); ++i) {
    EXPECT_EQ(ref[i].size(), got[i].size()) << "tensor " << i;
    for (std::size_t k = 0; k < ref[i].size() && k < got[i].size(); ++k) {
      const double e = std::fabs(static_cast<double>(ref[i][k]) - got[i][k]);
      d.max = std::max(d.max, e);
      sum += e * e;
      ++n;
    }
  }
  d.rms = n == 0 ? 0.0 : std::sqrt(sum / static_cast<double>(n));
  return d;
}

void expect_close(const Snapshot& ref, const Snapshot& got, const std::string& what) {
  const Tolerance tol;
  ASSERT_EQ(ref.losses.size(), got.losses.size()) << what;
  ASSERT_EQ(ref.param.size(), got.param.size()) << what;
  ASSERT_FALSE(ref.param.empty()) << what;
  double worst_loss = 0.0, worst_norm = 0.0;
  for (std::size_t i = 0; i < ref.losses.size(); ++i) {
    worst_loss = std::max(worst_loss, std::fabs(got.losses[i] - ref.losses[i]) / std::fabs(ref.losses[i]));
    worst_norm = std::max(worst_norm, std::fabs(got.norms[i] - ref.norms[i]) / std::fabs(ref.norms[i]));
    EXPECT_NEAR(got.losses[i], ref.losses[i], tol.loss * std::fabs(ref.losses[i]))
        << what << ": loss of step " << i + 1;
    EXPECT_NEAR(got.norms[i], ref.norms[i], tol.norm * std::fabs(ref.norms[i]))
        << what << ": norm of step " << i + 1;
  }
  if (world().rank() == 0)
    std::printf("%s: loss rel %.3g, norm rel %.3g\n", what.c_str(), worst_loss, worst_norm);
  const char* names[] = {"working parameters", "master weights", "exp_avg", "exp_avg_sq"};
  const std::vector<std::vector<float>>* r[] = {&ref.param, &ref.master, &ref.m, &ref.v};
  const std::vector<std::vector<float>>* g[] = {&got.param, &got.master, &got.m, &got.v};
  for (int k = 0; k < 4; ++k) {
    const Diff d = diff_of(*r[k], *g[k]);
    double scale = 1.0;
    if (k >= 2) {
      std::vector<std::vector<float>> zero;
      for (const auto& t : *r[k]) zero.emplace_back(t.size(), 0.0f);
      scale = diff_of(*r[k], zero).max;
    }
    if (world().rank() == 0) {
      std::printf("%s: %s |difference| max %.3g rms %.3g (scale %.3g)\n", what.c_str(), names[k], d.max,
                  d.rms, scale);
    }
    EXPECT_LE(d.rms, tol.rms * scale) << what << ": " << names[k] << " (rms of the differences)";
    EXPECT_LE(d.max, tol.max * scale) << what << ": " << names[k] << " (largest difference)";
  }
  EXPECT_NE(ref.losses.front(), ref.losses.back()) << what << ": the run trained";
}

// Losses and norms equal on every rank; the state equal on the ranks of one stage; GPT-2's wte
// (parameter 0) equal on the first and the last stage.
void expect_grid_consistent(const Snapshot& got, const std::vector<int>& held, const GridCoord& coord, int PP,
                            bool tied, const std::string& what) {
  std::vector<double> mine = got.losses;
  mine.insert(mine.end(), got.norms.begin(), got.norms.end());
  const std::size_t W = static_cast<std::size_t>(world().size());
  std::vector<double> every(mine.size() * W);
  ASSERT_TRUE(world().all_gather(mine.data(), every.data(), 2 * mine.size(), DType::kF32).wait().ok());
  for (std::size_t r = 0; r < W; ++r) {
    for (std::size_t i = 0; i < mine.size(); ++i)
      EXPECT_EQ(every[r * mine.size() + i], mine[i]) << what << ": loss/norm " << i << " of rank " << r;
  }
  // Per rank: its stage, the hash of its state, and the hash of its wte (0 when not held).
  std::uint64_t row[3] = {static_cast<std::uint64_t>(coord.pp), fnv(got.param), 0};
  row[1] = fnv(got.v, fnv(got.m, fnv(got.master, row[1])));
  if (tied && !held.empty() && held.front() == 0)
    row[2] = fnv({got.param[0], got.master[0], got.m[0], got.v[0]});
  std::vector<std::uint64_t> rows(3 * W);
  ASSERT_TRUE(world().all_gather(row, rows.data(), 6, DType::kF32).wait().ok());
  for (std::size_t r = 0; r < W; ++r) {
    for (std::size_t q = 0; q < W; ++q) {
      if (rows[3 * r] != rows[3 * q]) continue;
      EXPECT_EQ(rows[3 * r + 1], rows[3 * q + 1]) << what << ": ranks " << r << " and " << q << " hold stage "
                                                  << rows[3 * r] << " with different state";
    }
  }
  if (!tied) return;
  for (std::size_t r = 0; r < W; ++r) {
    if (rows[3 * r] == 0 || rows[3 * r] == static_cast<std::uint64_t>(PP - 1)) {
      EXPECT_NE(rows[3 * r + 2], 0u) << what << ": rank " << r << " holds no wte";
      EXPECT_EQ(rows[3 * r + 2], rows[2]) << what << ": rank " << r << "'s wte differs from rank 0's";
    }
  }
}

struct Case {
  ModelKind kind;
  Tier params, optimizer;
  int zero_stage;
  PipelineSchedule schedule;
  std::int64_t micro;  // per pipeline
};

// One run on the tp 2 x pp 2 grid of the world (DP = world / 4).
void check_case(const Case& c) {
  constexpr int kSteps = 3;
  auto groups = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, 2, 2);
  ASSERT_TRUE(groups.ok()) << groups.status().to_string();
  const int DP = groups->grid.dp(), PP = groups->grid.pp();
  const GridCoord coord = groups->coord;
  const std::string what = std::string(to_string(c.kind)) + " params=" + std::string(to_string(c.params)) +
                           " optimizer=" + std::string(to_string(c.optimizer)) +
                           (DP > 1 ? " zero " + std::to_string(c.zero_stage) : std::string()) + " " +
                           std::string(to_string(c.schedule)) + " m=" + std::to_string(c.micro) +
                           ", tp 2 x pp 2 x dp " + std::to_string(DP);
  const TrainerConfig global =
      testing::tiny(c.kind, DType::kF32, c.micro * DP, c.kind == ModelKind::kGpt2 ? 1.0 : 0.0);
  TrainerConfig local = global;
  local.grad_accum = c.micro;
  OffloadSettings s;
  s.params = c.params;
  s.optimizer = c.optimizer;
  s.zero_stage = c.zero_stage;
  s.persistence_threshold = 0;
  s.pipeline_schedule = c.schedule;
  Snapshot got;
  std::vector<int> held;
  {
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(local, s, *device, nullptr, DP > 1 ? groups->dp.get() : nullptr,
                                        groups->tp.get(), groups->pp.get());
    ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
    ASSERT_TRUE(run_share(**engine, global, coord.dp, DP, kSteps, got)) << what;
    ASSERT_TRUE(capture_stage(**engine, got, held)) << what;
    EXPECT_FALSE(held.empty()) << what;
    // Whole-model operations of a pipeline stay refused, naming it.
    auto loss = (*engine)->loss(std::vector<std::int32_t>(32, 1), std::vector<std::int32_t>(32, 1));
    ASSERT_FALSE(loss.ok()) << what;
    EXPECT_NE(loss.status().message().find("pipeline stages is not built yet"), std::string::npos)
        << loss.status().to_string();
  }
  expect_grid_consistent(got, held, coord, PP, c.kind == ModelKind::kGpt2, what);

  Snapshot ref;
  {
    auto device = testing::make_device();
    OffloadSettings single = s;
    single.zero_stage = 0;
    auto engine = OffloadEngine::create(global, single, *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    ASSERT_TRUE(testing::run_steps(**engine, global, 0, kSteps, ref)) << what;
    ASSERT_TRUE(capture_held(**engine, held, ref)) << what;
  }
  expect_close(ref, got, what + " against one process");

  if (c.kind != ModelKind::kLlama) return;
  // The same tp and dp groups without a pipeline: every stage's ranks run the whole model.
  Snapshot tpdp;
  {
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(local, s, *device, nullptr, DP > 1 ? groups->dp.get() : nullptr,
                                        groups->tp.get());
    ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
    ASSERT_TRUE(run_share(**engine, global, coord.dp, DP, kSteps, tpdp)) << what;
    ASSERT_TRUE(capture_held(**engine, held, tpdp)) << what;
  }
  const std::string vs = what + " against tp 2 x dp " + std::to_string(DP) + " without a pipeline";
  ASSERT_EQ(tpdp.param.size(), got.param.size()) << vs;
  for (std::size_t i = 0; i < held.size(); ++i) {
    EXPECT_TRUE(testing::bitwise_equal(tpdp.param[i], got.param[i])) << vs << ": parameter " << held[i];
    EXPECT_TRUE(testing::bitwise_equal(tpdp.master[i], got.master[i])) << vs << ": master " << held[i];
    EXPECT_TRUE(testing::bitwise_equal(tpdp.m[i], got.m[i])) << vs << ": exp_avg " << held[i];
    EXPECT_TRUE(testing::bitwise_equal(tpdp.v[i], got.v[i])) << vs << ": exp_avg_sq " << held[i];
  }
  for (std::size_t i = 0; i < got.losses.size(); ++i) {
    EXPECT_EQ(tpdp.losses[i], got.losses[i]) << vs << ": loss of step " << i + 1;
    if (DP == 1) {
      EXPECT_EQ(tpdp.norms[i], got.norms[i]) << vs << ": norm of step " << i + 1;
    } else {
      EXPECT_NEAR(tpdp.norms[i], got.norms[i], 1e-12 * std::fabs(tpdp.norms[i]))
          << vs << ": norm of step " << i + 1;
    }
  }
}

// GPT-2 (the tied embedding: wte's shard on the first and the last stage of each pipeline),
// everything on the device (ZeRO 0: the gradients all-reduced over dp per stage), 1F1B, clipping.
TEST(Grid, Gpt2AllDevice) {
  if (world().size() % 4 != 0) GTEST_SKIP() << "needs a multiple of 4 ranks (tp 2 x pp 2)";
  check_case({ModelKind::kGpt2, Tier::kDevice, Tier::kDevice, 0, PipelineSchedule::kOneFOneB, 2});
}

// LLaMA with grouped kv heads (4 query heads, 2 kv heads: 1 per tp rank), parameters and the
// optimizer on the host (ZeRO 1 over dp: each tp shard's state sliced over the pipelines), GPipe.
TEST(Grid, LlamaGroupedKvHostOptimizer) {
  if (world().size() % 4 != 0) GTEST_SKIP() << "needs a multiple of 4 ranks (tp 2 x pp 2)";
  check_case({ModelKind::kLlama, Tier::kHost, Tier::kHost, 1, PipelineSchedule::kGpipe, 2});
}

// GPT-2 with the host optimizer (ZeRO 2: gradients reduce-scattered per micro-batch, the tied
// unit's slice summed between the first and the last stage).
TEST(Grid, Gpt2HostOptimizerZero2) {
  if (world().size() % 4 != 0) GTEST_SKIP() << "needs a multiple of 4 ranks (tp 2 x pp 2)";
  check_case({ModelKind::kGpt2, Tier::kDevice, Tier::kHost, 2, PipelineSchedule::kOneFOneB, 2});
}

}  // namespace
}  // namespace strata
