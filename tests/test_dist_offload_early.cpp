// The early fetch across steps and the NVMe optimizer's reads during backward with several
// processes (docs/offload.md "One step"), on real MPI processes (tests/mpi_run.sh, label `dist`).
//
// An early fetch reads a unit from this rank's own home once the unit's (agreed) update is
// published; nothing in it talks at ZeRO stages 0-2 or with tensor parallelism, so it may change
// the timing only. At stage 3 it all-gathers the ranks' slices, after the ranks agreed (one flag
// all-reduce per early fetch) that every rank's gate saw the agreed mark: every rank keeps the
// copy or refetches it alike. On a pipeline each stage fetches the first units of its own
// schedule's trace (interleaved too: one trace over all its chunks). What is checked, on every
// rank:
// - the hit rate after warm-up (steps 2 on) is at least the one-process figure of the same
//   global batch (which is 1: every access, the pass's first included, fetched ahead), so the
//   early fetch is in effect with data (and tensor) parallelism; and every step from the second
//   on used copies fetched early (OffloadStats::early_fetch_hits grows each step; 0 with
//   prefetching off);
// - the run is bit for bit the run of the same ranks with prefetching off (prefetch_modules 0:
//   fetches on demand, no early fetch; its hit rate is below 1): losses, norms, every
//   parameter, master and moment (a pipeline stage: those it holds);
// - data parallel: within the fp32 data-parallel tolerances of one process of the same global
//   batch (not bitwise: the ranks sum the gradients in another order, test_dist_data_parallel.cpp),
//   and with the NVMe optimizer every step issues optimizer-state reads during backward;
// - stage 3: every rank counts the same hits and the same data-parallel bytes (each hit is an
//   all-gather not issued again), and the parameters are read at home on NVMe and on the host
//   (on NVMe an early read that did not wait for the update would read the previous version:
//   the bitwise comparison with prefetching off sees it).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "comm_environment.hpp"
#include "dist_compare.hpp"
#include "offload_fixture.hpp"
#include "strata/parallel.hpp"

namespace strata {
namespace {

using testing::Snapshot;
using testing::world;

struct Run {
  Snapshot state;
  std::vector<OffloadStats> stats;  // after each step
};

// kData: each rank its data-parallel share of the global batch (dp = the world); otherwise
// every rank the whole batch (tp = the world, pp = the world: each rank a stage, or one process).
// kDataPipeline: the 4-rank grid of 2 stages x 2 data-parallel ranks (rank = dp * 2 + stage), each
// data-parallel rank its share of the global batch. kTensorPipeline: the 4-rank grid of 2 stages
// x 2 tensor-parallel ranks (rank = stage * 2 + tensor rank), every rank the whole batch. kGrid:
// the 8-rank grid tensor 2 x pipeline 2 x data 2 (rank = (dp * 2 + stage) * 2 + tensor rank),
// each data-parallel rank its share of the global batch.
enum class Mode { kOneProcess, kData, kTensor, kPipeline, kDataPipeline, kTensorPipeline, kGrid };

Run train(const TrainerConfig& global, const OffloadSettings& s, Mode mode, int steps) {
  Run out;
  TrainerConfig c = global;
  if (mode == Mode::kData) c = testing::local_of(global);
  auto device = testing::make_device();
  Comm* dp = mode == Mode::kData ? &world() : nullptr;
  Comm* tp = mode == Mode::kTensor ? &world() : nullptr;
  Comm* pp = mode == Mode::kPipeline ? &world() : nullptr;
  int dp_rank = world().rank(), DP = world().size();
  Result<ProcessGroups> grid = failed_precondition("no grid");
  if (mode == Mode::kDataPipeline) {
    grid = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, 1, 2);
    EXPECT_TRUE(grid.ok()) << grid.status().to_string();
    if (!grid.ok()) return out;
    dp = grid->dp.get();
    pp = grid->pp.get();
    dp_rank = grid->coord.dp;
    DP = grid->grid.dp();
    c.grad_accum = global.grad_accum / DP;
  } else if (mode == Mode::kTensorPipeline || mode == Mode::kGrid) {
    grid = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, 2, 2);
    EXPECT_TRUE(grid.ok()) << grid.status().to_string();
    if (!grid.ok()) return out;
    tp = grid->tp.get();
    pp = grid->pp.get();
    if (mode == Mode::kGrid) {
      dp = grid->dp.get();
      dp_rank = grid->coord.dp;
      DP = grid->grid.dp();
      c.grad_accum = global.grad_accum / DP;
    }
  }
  const bool share = mode == Mode::kData || mode == Mode::kDataPipeline || mode == Mode::kGrid;
  const bool stages = mode == Mode::kPipeline || mode == Mode::kDataPipeline || mode == Mode::kTensorPipeline ||
                      mode == Mode::kGrid;
  auto engine = OffloadEngine::create(c, s, *device, nullptr, dp, tp, pp);
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  if (!engine.ok()) return out;
  for (int i = 0; i < steps; ++i) {
    const bool ok = share ? testing::run_share(**engine, global, dp_rank, DP, i + 1, out.state, i)
                          : testing::run_steps(**engine, c, i, i + 1, out.state);
    if (!ok) return out;
    out.stats.push_back((*engine)->stats());
  }
  EXPECT_TRUE((*engine)->synchronize().ok());
  out.stats.push_back((*engine)->stats());  // after every update finished
  if (stages) {
    std::vector<int> held;  // a stage holds its own modules
    EXPECT_TRUE(testing::capture_stage(**engine, out.state, held));
    EXPECT_FALSE(held.empty());
  } else {
    EXPECT_TRUE(testing::capture_state(**engine, out.state));
  }
  return out;
}

// Hits and accesses from after step `from` to after step `to` (1-based step counts).
double hit_rate(const Run& r, int from, int to) {
  const OffloadStats& a = r.stats[static_cast<std::size_t>(from - 1)];
  const OffloadStats& b = r.stats[static_cast<std::size_t>(to - 1)];
  const std::uint64_t accesses = b.param_accesses - a.param_accesses;
  EXPECT_GT(accesses, 0u) << "the parameters off the device are fetched every step";
  return accesses == 0
             ? 0.0
             : static_cast<double>(b.prefetch_hits - a.prefetch_hits) / static_cast<double>(accesses);
}

void expect_bitwise(const Snapshot& ref, const Snapshot& got, const std::string& what) {
  ASSERT_EQ(ref.losses.size(), got.losses.size()) << what;
  for (std::size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_EQ(ref.losses[i], got.losses[i]) << what << ": loss of step " << i + 1;
    EXPECT_EQ(ref.norms[i], got.norms[i]) << what << ": norm of step " << i + 1;
  }
  ASSERT_EQ(ref.param.size(), got.param.size()) << what;
  ASSERT_FALSE(ref.param.empty()) << what;
  for (std::size_t i = 0; i < ref.param.size(); ++i) {
    EXPECT_TRUE(testing::bitwise_equal(ref.param[i], got.param[i])) << what << ": parameter " << i;
    EXPECT_TRUE(testing::bitwise_equal(ref.master[i], got.master[i])) << what << ": master " << i;
    EXPECT_TRUE(testing::bitwise_equal(ref.m[i], got.m[i])) << what << ": exp_avg " << i;
    EXPECT_TRUE(testing::bitwise_equal(ref.v[i], got.v[i])) << what << ": exp_avg_sq " << i;
  }
}

struct Case {
  const char* name;
  Mode mode;
  int stage;
  Tier optimizer;
  std::int64_t sub_group_size = 1'000'000'000;
  Tier params = Tier::kNvme;  // the working parameters' home (never the device: fetched every pass)
  ModelKind kind = ModelKind::kGpt2;
  int virtual_stages = 1;  // > 1: interleaved 1F1B (strata.pipeline_virtual_stages)
};

void check(const Case& k) {
  SCOPED_TRACE(k.name);
  const int P = world().size();
  constexpr int kSteps = 5;
  // fp32, clipping 1: the norm decides the update (it runs after step() returned, overlapped with
  // the next step's early fetches). Data parallel: one micro-batch per rank.
  const TrainerConfig global =
      testing::tiny(k.kind, DType::kF32,
                    k.mode == Mode::kData                                   ? P
                    : k.mode == Mode::kDataPipeline || k.mode == Mode::kGrid ? 4
                                                                             : 2,
                    1.0);
  testing::TempDir dir_a("strata-dist-early"), dir_b("strata-dist-early"), dir_c("strata-dist-early");
  auto settings_in = [&](const testing::TempDir& dir) {
    OffloadSettings s;
    s.params = k.params;
    s.optimizer = k.optimizer;
    s.zero_stage = k.stage;
    s.sub_group_size = k.sub_group_size;
    s.persistence_threshold = 0;  // every module at its home (NVMe or host), fetched each pass
    s.nvme_path = {dir.path().string()};
    s.pipeline_virtual_stages = k.virtual_stages;
    return s;
  };
  const OffloadSettings early = settings_in(dir_a);
  OffloadSettings on_demand = settings_in(dir_b);
  on_demand.prefetch_modules = 0;  // every fetch on demand: no prefetch, no early fetch
  OffloadSettings single = settings_in(dir_c);
  single.zero_stage = 0;
  single.pipeline_virtual_stages = 1;  // one process has no chunks

  const Run got = train(global, early, k.mode, kSteps);
  const Run ref = train(global, on_demand, k.mode, kSteps);
  const Run one = train(global, single, Mode::kOneProcess, kSteps);
  ASSERT_EQ(got.stats.size(), static_cast<std::size_t>(kSteps + 1));
  ASSERT_EQ(ref.stats.size(), static_cast<std::size_t>(kSteps + 1));
  ASSERT_EQ(one.stats.size(), static_cast<std::size_t>(kSteps + 1));

  // After warm-up (step 1 records the trace): at least the one-process figure, which is every
  // access; without the early fetch each pass's first access would be a miss.
  const double rate = hit_rate(got, 1, kSteps), rate_one = hit_rate(one, 1, kSteps);
  EXPECT_EQ(rate_one, 1.0) << "one process: every access after the first step fetched ahead";
  EXPECT_GE(rate, rate_one) << "rank " << world().rank() << ": hit rate " << rate << " vs one process "
                            << rate_one;
  // Prefetching off, only a unit still in its slot from the access before is a hit: the two runs
  // compared bit for bit below fetch on different schedules.
  EXPECT_LT(hit_rate(ref, 1, kSteps), rate_one) << "prefetching off: fetches on demand";
  EXPECT_EQ(got.stats.back().trace_mismatches, got.stats.front().trace_mismatches);
  // The early fetch itself: from step 2 on, every step's pass starts on copies fetched when the
  // previous step returned (at least its first access; end_pass released every slot), and none
  // with prefetching off.
  for (int i = 1; i < kSteps; ++i) {
    const auto at = static_cast<std::size_t>(i);
    EXPECT_GT(got.stats[at].early_fetch_hits, got.stats[at - 1].early_fetch_hits)
        << "rank " << world().rank() << ": step " << i + 1 << " used no early copy";
    EXPECT_LE(got.stats[at].early_fetch_hits, got.stats[at].prefetch_hits);
  }
  EXPECT_EQ(got.stats.front().early_fetch_hits, 0u) << "step 1 has no previous step to fetch early from";
  EXPECT_EQ(ref.stats.back().early_fetch_hits, 0u) << "prefetching off";

  // The early fetch changes the timing only.
  expect_bitwise(ref.state, got.state, std::string(k.name) + ", early fetch vs every fetch on demand");
  if (k.mode == Mode::kData) testing::expect_close(one.state, got.state, testing::Tolerance{}, k.name);

  if (k.stage == 3 && k.mode == Mode::kData) {
    // Each rank's decisions (an early copy taken, or refetched with another all-gather) are the
    // same: equal hits and accesses on every rank after every step (counted by the pass, so
    // final when step() returns), and equal data-parallel bytes once every update finished. The
    // bytes are not compared right after step() returns: the update's gathers and agreements
    // and the next step's early gathers are then in flight on each rank's own threads, so how
    // many of them a rank has counted is timing (it differs under load).
    for (std::size_t i = 0; i < got.stats.size(); ++i) {
      const OffloadStats& st = got.stats[i];
      const bool settled = i + 1 == got.stats.size();  // after synchronize()
      testing::expect_same_text_on_every_rank(
          "hits " + std::to_string(st.prefetch_hits) + ", accesses " + std::to_string(st.param_accesses) +
              (settled ? ", data-parallel bytes " + std::to_string(st.bytes_dp) : std::string()),
          std::string(k.name) + (settled ? ", counters after synchronize()" : ", counters after step " +
                                                                                   std::to_string(i + 1)));
    }
  }

  if (k.optimizer == Tier::kNvme) {
    // Every step's update finds reads issued during its backward, and takes them over.
    for (int i = 0; i < kSteps; ++i) {
      const std::uint64_t before =
          i == 0 ? 0 : got.stats[static_cast<std::size_t>(i - 1)].early_optimizer_reads;
      EXPECT_GT(got.stats[static_cast<std::size_t>(i)].early_optimizer_reads, before) << "step " << i + 1;
    }
    EXPECT_EQ(got.stats.back().early_optimizer_reads_dropped, 0u);
  } else {
    EXPECT_EQ(got.stats.back().early_optimizer_reads, 0u);
  }
}

TEST(DistOffloadEarly, DataParallelHitsAsOneProcessAndChangesNoBits) {
  ASSERT_GE(world().size(), 2) << "run under mpirun -np 2 or more";
  check({"data parallel, stage 2, host optimizer", Mode::kData, 2, Tier::kHost});
  // Stage 1 with the NVMe optimizer in sub-groups: the reads during backward, every rank its own.
  check({"data parallel, stage 1, NVMe optimizer", Mode::kData, 1, Tier::kNvme, 4097});
}

// Stage 3: every fetch of a module all-gathers the ranks' slices (parameters on NVMe: each
// rank's slice is its own NVMe key, read behind the gate; on the host: its host slice).
TEST(DistOffloadEarly, StageThreeAgreesOnEveryEarlyCopyAndChangesNoBits) {
  ASSERT_GE(world().size(), 2) << "run under mpirun -np 2 or more";
  check({"data parallel, stage 3, host optimizer, parameters on NVMe", Mode::kData, 3, Tier::kHost});
  check({"data parallel, stage 3, NVMe optimizer, parameters on the host", Mode::kData, 3, Tier::kNvme, 4097,
         Tier::kHost});
}

TEST(DistOffloadEarly, TensorParallelHitsAsOneProcessAndChangesNoBits) {
  ASSERT_GE(world().size(), 2) << "run under mpirun -np 2 or more";
  check({"tensor parallel, host optimizer", Mode::kTensor, 0, Tier::kHost});
}

// A pipeline (each rank a stage, two micro-batches): a stage's pass is its whole schedule, and
// the early fetch reads the first units of its trace. Parameters on NVMe (the update may fail
// after the norm: each stage marks its units only once the stages agreed on the update) and on
// the host (an update in memory: marked unit by unit, overlapped with the next step).
TEST(DistOffloadEarly, PipelineHitsAsOneProcessAndChangesNoBits) {
  ASSERT_GE(world().size(), 2) << "run under mpirun -np 2 or more";
  check({"pipeline, host optimizer, parameters on NVMe", Mode::kPipeline, 0, Tier::kHost});
  check({"pipeline, host optimizer, parameters on the host", Mode::kPipeline, 0, Tier::kHost, 1'000'000'000,
         Tier::kHost, ModelKind::kLlama});
}

// Interleaved 1F1B (pipeline_virtual_stages 2: stage 0 runs chunks 0 and 2, stage 1 chunks 1 and
// 3 of the tiny model's 5 modules): a stage's pass is still its whole schedule, one trace over
// both chunks' ops in the schedule's order, so the early fetch reads the first units of that
// trace (chunk 0's on stage 0, chunk 1's on stage 1) as with one chunk. GPT-2 with its tied
// embedding (in chunk 0 and chunk 3) and the parameters on NVMe, LLaMA with them on the host.
TEST(DistOffloadEarly, InterleavedPipelineHitsAsOneProcessAndChangesNoBits) {
  ASSERT_EQ(world().size(), 2) << "run under mpirun -np 2 (2 stages x 2 chunks of the tiny model)";
  Case nvme{"interleaved pipeline, host optimizer, parameters on NVMe", Mode::kPipeline, 0, Tier::kHost};
  nvme.virtual_stages = 2;
  check(nvme);
  Case host{"interleaved pipeline, host optimizer, parameters on the host",
            Mode::kPipeline,
            0,
            Tier::kHost,
            1'000'000'000,
            Tier::kHost,
            ModelKind::kLlama};
  host.virtual_stages = 2;
  check(host);
}

// 2 stages x 2 data-parallel ranks (4 ranks; tests/CMakeLists.txt runs it in the 4-rank job
// only), each rank two micro-batches of the global batch of four: stage 3 with the parameters on
// NVMe (each stage's early fetches agreed and gathered over its data-parallel group), and stage 2.
TEST(DistOffloadEarlyGrid, DataTimesPipelineHitsAsOneProcessAndChangesNoBits) {
  ASSERT_EQ(world().size(), 4) << "run under mpirun -np 4";
  check({"data 2 x pipeline 2, stage 3, host optimizer, parameters on NVMe", Mode::kDataPipeline, 3, Tier::kHost});
  check({"data 2 x pipeline 2, stage 2, host optimizer, parameters on the host", Mode::kDataPipeline, 2,
         Tier::kHost, 1'000'000'000, Tier::kHost});
}

// 2 stages x 2 tensor-parallel ranks (4 ranks, every rank the whole batch of two micro-batches):
// each rank fetches its shard of its stage's units early, on the plain and the interleaved
// schedule; nothing in the early fetch talks (no data parallelism), so the tensor ranks'
// all-reduces and the stages' sends are those of the run with prefetching off.
TEST(DistOffloadEarlyGrid, TensorTimesPipelineHitsAsOneProcessAndChangesNoBits) {
  ASSERT_EQ(world().size(), 4) << "run under mpirun -np 4";
  check({"tensor 2 x pipeline 2, host optimizer, parameters on the host", Mode::kTensorPipeline, 0,
         Tier::kHost, 1'000'000'000, Tier::kHost});
  Case interleaved{"tensor 2 x pipeline 2, interleaved, host optimizer, parameters on NVMe",
                   Mode::kTensorPipeline, 0, Tier::kHost};
  interleaved.virtual_stages = 2;
  check(interleaved);
}

// The whole grid tensor 2 x pipeline 2 x data 2 (8 ranks, dist.offload_early.np8), each
// data-parallel rank two micro-batches of the global batch of four: stage 3 with the parameters
// on NVMe (each stage's early fetches of its tensor shard agreed and gathered over its
// data-parallel pair), and stage 2 with them on the host. Hit rate 1 after step 1, early copies
// used every step after the first, bit for bit against prefetching off.
TEST(DistOffloadEarlyGridFull, TensorTimesPipelineTimesDataHitsAsOneProcessAndChangesNoBits) {
  ASSERT_EQ(world().size(), 8) << "run under mpirun -np 8";
  check({"tensor 2 x pipeline 2 x data 2, stage 3, host optimizer, parameters on NVMe", Mode::kGrid, 3,
         Tier::kHost});
  check({"tensor 2 x pipeline 2 x data 2, stage 2, host optimizer, parameters on the host", Mode::kGrid, 2,
         Tier::kHost, 1'000'000'000, Tier::kHost});
}

}  // namespace
}  // namespace strata
