// The cost model's data-parallel bytes per step (dp_traffic, what `strata estimate --ranks N`
// adds up) against the engine's counter (OffloadStats::bytes_dp over one step after warm-up) on
// the two 4-process grids beside data parallelism: tensor 2 x data 2 and pipeline 2 x data 2
// (make_process_groups), run by tests/mpi_run.sh under `mpirun -np 4`.
//
// dp_traffic plans one rank's collectives from the settings the rank plans with (tp_size: its
// tensor-parallel shard; the pipeline bounds and its stage: the stage's units). The engine counts
// every collective of its data-parallel group, including a few small per-step ones the model
// leaves out: the token count and the loss sums (one all-gather of 1 and one of 2 doubles per
// rank), the update's gradient statistics (one GradStats per module per rank, every module of
// the model's layout; the host optimizer adds one record, the failure flag that agrees a failure
// before the update) and, with the host optimizer, the agreement after each of the rank's units
// is updated (one 4-byte all-reduce per unit). The comparison is exact on every rank: the
// chunks, and so the buffers, are the same on every rank of a data-parallel group.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "comm_environment.hpp"
#include "dist_compare.hpp"
#include "offload/internal.hpp"
#include "offload_fixture.hpp"
#include "strata/parallel.hpp"

namespace strata {
namespace {

using testing::run_share;
using testing::Snapshot;
using testing::world;

struct Grid {
  int tp = 1, pp = 1;
  std::string name() const { return "tp " + std::to_string(tp) + " x pp " + std::to_string(pp) + " x dp 2"; }
};

struct Placement {
  const char* what;
  Tier optimizer;
  int stage;
};

// One step's data-parallel bytes on this rank, measured after two warm-up steps, and dp_traffic's
// count for the same rank.
void check_grid(const Grid& grid) {
  auto groups = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, grid.tp, grid.pp);
  ASSERT_TRUE(groups.ok()) << groups.status().to_string();
  ProcessGroups& g = *groups;
  const int DP = g.grid.dp();
  ASSERT_EQ(DP, 2);
  const auto P = static_cast<std::uint64_t>(DP);
  constexpr std::int64_t kMicro = 2;
  const TrainerConfig global = testing::tiny(ModelKind::kGpt2, DType::kBF16, kMicro * DP, 1.0);
  TrainerConfig local = global;
  local.grad_accum = kMicro;
  for (const Placement& p : {Placement{"device optimizer, stage 1", Tier::kDevice, 1},
                             Placement{"device optimizer, stage 2", Tier::kDevice, 2},
                             Placement{"device optimizer, stage 3", Tier::kDevice, 3},
                             Placement{"host optimizer, stage 1", Tier::kHost, 1},
                             Placement{"host optimizer, stage 2", Tier::kHost, 2}}) {
    const std::string what = grid.name() + ", " + p.what;
    OffloadSettings s;
    s.optimizer = p.optimizer;
    s.params = Tier::kDevice;
    s.zero_stage = p.stage;
    s.update_during_backward = false;
    s.reduce_bucket_elements = 20'000;  // several buckets
    s.overlap_comm = true;
    s.prefetch_modules = 1;
    s.prefetch_elements = 1'000'000'000;  // the look-ahead is the depth, as strata plan writes it
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(local, s, *device, nullptr, g.dp.get(), g.tp.get(), g.pp.get());
    ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
    Snapshot out;
    ASSERT_TRUE(run_share(**engine, global, g.coord.dp, DP, 2, out)) << what;
    ASSERT_TRUE((*engine)->synchronize().ok()) << what;
    const OffloadStats before = (*engine)->stats();
    ASSERT_TRUE(run_share(**engine, global, g.coord.dp, DP, 3, out, 2)) << what;
    ASSERT_TRUE((*engine)->synchronize().ok()) << what;
    const OffloadStats after = (*engine)->stats();
    const std::uint64_t measured = after.bytes_dp - before.bytes_dp;

    // The settings this rank plans with (strata train under mpirun, strata estimate's grid).
    OffloadSettings planned = s;
    planned.dp_size = DP;
    planned.tp_size = grid.tp;
    if (grid.pp > 1) {
      auto bounds = pipeline_stages(local.model, grid.pp, local.seq_len);
      ASSERT_TRUE(bounds.ok()) << bounds.status().to_string();
      planned.pipeline_bounds = *bounds;
      planned.pp_stage = g.coord.pp;
    }
    auto t = dp_traffic(local, planned);
    ASSERT_TRUE(t.ok()) << what << ": " << t.status().to_string();
    EXPECT_GT(t->buffer_bytes(), 0u) << what;
    const std::uint64_t M = (*engine)->model().layout().modules.size();
    const bool host = p.optimizer != Tier::kDevice;
    std::uint64_t agreed = 0;  // the units this rank's host optimizer updates (its stage's)
    if (host) {
      auto layout = describe_model(local.model, TensorParallel{grid.tp, g.coord.tp});
      ASSERT_TRUE(layout.ok()) << layout.status().to_string();
      const offload_detail::Units units = offload_detail::describe_units(*layout, planned);
      for (std::uint64_t b : units.gbytes) agreed += b > 0 ? 1 : 0;
      EXPECT_GT(agreed, 0u);
    }
    const std::uint64_t small = P * (8 + 16) + P * (M + (host ? 1 : 0)) * sizeof(GradStats) + 4 * agreed;
    EXPECT_EQ(measured, t->buffer_bytes() + small)
        << what << ": data-parallel bytes per step, tp rank " << g.coord.tp << ", stage " << g.coord.pp
        << ", dp rank " << g.coord.dp << " (model " << t->buffer_bytes() << " + small " << small << ")";
  }
}

TEST(CostModelGrid, TensorParallelDataParallelBytesAreTheEngines) {
  ASSERT_EQ(world().size(), 4);
  check_grid(Grid{2, 1});
}

TEST(CostModelGrid, PipelineDataParallelBytesAreTheEngines) {
  ASSERT_EQ(world().size(), 4);
  check_grid(Grid{1, 2});
}

}  // namespace
}  // namespace strata
