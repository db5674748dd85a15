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
//
// On 2 processes (dist.cost_grid.np2) the tensor-parallel and pipeline terms of predict_step:
// tensor 2 (with and without sequence parallelism, with activation checkpointing) and pipeline 2
// (1F1B and GPipe). The tensor-parallel bytes are checked twice: against the engine's counter
// (OffloadStats::bytes_tp, the model's collectives) and, independently of it, through
// CountingComm, a wrapper of the tensor-parallel group handed to the engine that forwards every
// call to the real MPI group and adds up the buffer bytes of each sub-group the engine splits off
// (the model's collectives run on "tp.model", with the device update's gradient statistics);
// the pipeline's boundary sends are OffloadStats::bytes_pp. All exact.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
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

// Buffer bytes per sub-group name, as OffloadStats::bytes_dp counts them: an all-reduce its
// buffer, a reduce-scatter its input, an all-gather its output; anything else apart.
struct Counts {
  std::uint64_t collective = 0, other = 0;
};
using CountsByName = std::map<std::string, Counts>;

// A real group that counts what passes through it: every call goes to `inner` (the MPI group);
// split() wraps the sub-group, counting under the name the caller gives it.
class CountingComm final : public Comm {
 public:
  CountingComm(Comm* inner, std::unique_ptr<Comm> owned, std::shared_ptr<CountsByName> counts,
               std::string key)
      : inner_(inner), owned_(std::move(owned)), counts_(std::move(counts)), key_(std::move(key)) {}
  CommBackend backend() const override { return inner_->backend(); }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const std::string& name() const override { return inner_->name(); }
  const std::vector<int>& world_ranks() const override { return inner_->world_ranks(); }
  CommWork all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op) override {
    (*counts_)[key_].collective += count * dtype_size(dtype);
    return inner_->all_reduce(send, recv, count, dtype, op);
  }
  CommWork reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype,
                          ReduceOp op) override {
    (*counts_)[key_].collective += recv_count * static_cast<std::size_t>(size()) * dtype_size(dtype);
    return inner_->reduce_scatter(send, recv, recv_count, dtype, op);
  }
  CommWork all_gather(const void* send, void* recv, std::size_t send_count, DType dtype) override {
    (*counts_)[key_].collective += send_count * static_cast<std::size_t>(size()) * dtype_size(dtype);
    return inner_->all_gather(send, recv, send_count, dtype);
  }
  CommWork broadcast(void* buf, std::size_t count, DType dtype, int root) override {
    (*counts_)[key_].other += count * dtype_size(dtype);
    return inner_->broadcast(buf, count, dtype, root);
  }
  CommWork send(const void* buf, std::size_t count, DType dtype, int peer) override {
    (*counts_)[key_].other += count * dtype_size(dtype);
    return inner_->send(buf, count, dtype, peer);
  }
  CommWork recv(void* buf, std::size_t count, DType dtype, int peer) override {
    return inner_->recv(buf, count, dtype, peer);
  }
  CommWork barrier() override { return inner_->barrier(); }
  Result<std::unique_ptr<Comm>> split(int color, int key, std::string_view name) override {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Comm> sub, inner_->split(color, key, name));
    Comm* raw = sub.get();
    return std::unique_ptr<Comm>(new CountingComm(raw, std::move(sub), counts_, std::string(name)));
  }

 private:
  Comm* inner_;
  std::unique_ptr<Comm> owned_;
  std::shared_ptr<CountsByName> counts_;
  std::string key_;
};

// Rates for the byte counts only (every rate positive; the times are not checked here).
MachineRates any_rates(std::size_t modules) {
  MachineRates r;
  r.forward_seconds.assign(modules, 1.0);
  r.backward_seconds.assign(modules, 2.0);
  r.h2d_bytes_per_s = r.d2h_bytes_per_s = r.host_copy_bytes_per_s = 1e9;
  r.nvme_read_bytes_per_s = r.nvme_write_bytes_per_s = 1e9;
  r.adam_elements_per_s = r.scan_elements_per_s = 1e9;
  r.tp_bus_bytes_per_s = r.pp_link_bytes_per_s = 1e9;
  return r;
}

TEST(CostModelTwo, TensorParallelBytesAreTheModels) {
  ASSERT_EQ(world().size(), 2);
  auto groups = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, 2, 1);
  ASSERT_TRUE(groups.ok()) << groups.status().to_string();
  ProcessGroups& g = *groups;
  struct Case {
    const char* what;
    ModelKind kind;
    Tier optimizer;
    bool sequence_parallel, checkpointing;
    std::int64_t accum;
  };
  for (const Case& k :
       {Case{"GPT-2, device optimizer", ModelKind::kGpt2, Tier::kDevice, false, false, 1},
        Case{"GPT-2, host optimizer, checkpointing, accumulation 2", ModelKind::kGpt2, Tier::kHost, false,
             true, 2},
        Case{"GPT-2, sequence parallel, checkpointing", ModelKind::kGpt2, Tier::kDevice, true, true, 1},
        Case{"LLaMA (grouped-query heads), device optimizer", ModelKind::kLlama, Tier::kDevice, false, false,
             1},
        Case{"LLaMA, sequence parallel, host optimizer, accumulation 2", ModelKind::kLlama, Tier::kHost, true,
             false, 2}}) {
    TrainerConfig config = testing::tiny(k.kind, DType::kBF16, k.accum, 1.0);
    config.model.activation_checkpointing = k.checkpointing;
    OffloadSettings s;
    s.optimizer = k.optimizer;
    s.update_during_backward = false;
    s.sequence_parallel = k.sequence_parallel;
    auto counts = std::make_shared<CountsByName>();
    CountingComm tp(g.tp.get(), nullptr, counts, "tp");
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(config, s, *device, nullptr, g.dp.get(), &tp, g.pp.get());
    ASSERT_TRUE(engine.ok()) << k.what << ": " << engine.status().to_string();
    Snapshot out;
    ASSERT_TRUE(run_share(**engine, config, 0, 1, 2, out)) << k.what;
    ASSERT_TRUE((*engine)->synchronize().ok()) << k.what;
    const CountsByName before = *counts;
    const OffloadStats stats_before = (*engine)->stats();
    ASSERT_TRUE(run_share(**engine, config, 0, 1, 3, out, 2)) << k.what;
    ASSERT_TRUE((*engine)->synchronize().ok()) << k.what;
    const std::uint64_t measured = (*counts)["tp.model"].collective - before.at("tp.model").collective;
    const std::uint64_t counted = (*engine)->stats().bytes_tp - stats_before.bytes_tp;

    OffloadSettings planned = s;
    planned.tp_size = 2;
    auto p = predict_step(config, planned, any_rates((*engine)->model().layout().modules.size()));
    ASSERT_TRUE(p.ok()) << k.what << ": " << p.status().to_string();
    EXPECT_GT(p->tp_bytes, 0u) << k.what;
    EXPECT_EQ(counted, p->tp_bytes) << k.what << ": OffloadStats::bytes_tp per step on tp rank "
                                    << g.coord.tp;
    // The device optimizer's update merges the gradient statistics over the model's group too:
    // one all-gather of two GradStats records per rank.
    const std::uint64_t stats = k.optimizer == Tier::kDevice ? 2 * 2 * sizeof(GradStats) : 0;
    EXPECT_EQ(measured, p->tp_bytes + stats)
        << k.what << ": tensor-parallel bytes per step on tp rank " << g.coord.tp << " (model " << p->tp_bytes
        << " + statistics " << stats << ")";
  }
}

TEST(CostModelTwo, PipelineBytesAreTheEngines) {
  ASSERT_EQ(world().size(), 2);
  auto groups = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, 1, 2);
  ASSERT_TRUE(groups.ok()) << groups.status().to_string();
  ProcessGroups& g = *groups;
  for (PipelineSchedule schedule : {PipelineSchedule::kOneFOneB, PipelineSchedule::kGpipe}) {
    const std::string what(to_string(schedule));
    const TrainerConfig config = testing::tiny(ModelKind::kGpt2, DType::kBF16, 3, 1.0);
    OffloadSettings s;
    s.optimizer = Tier::kHost;
    s.update_during_backward = false;
    s.pipeline_schedule = schedule;
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(config, s, *device, nullptr, g.dp.get(), g.tp.get(), g.pp.get());
    ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
    Snapshot out;
    ASSERT_TRUE(run_share(**engine, config, 0, 1, 2, out)) << what;
    ASSERT_TRUE((*engine)->synchronize().ok()) << what;
    const OffloadStats before = (*engine)->stats();
    ASSERT_TRUE(run_share(**engine, config, 0, 1, 3, out, 2)) << what;
    ASSERT_TRUE((*engine)->synchronize().ok()) << what;
    const std::uint64_t measured = (*engine)->stats().bytes_pp - before.bytes_pp;

    OffloadSettings planned = s;
    auto bounds = pipeline_stages(config.model, 2, config.seq_len);
    ASSERT_TRUE(bounds.ok()) << bounds.status().to_string();
    planned.pipeline_bounds = *bounds;
    planned.pp_stage = g.coord.pp;
    auto p = predict_step(config, planned, any_rates((*engine)->model().layout().modules.size()));
    ASSERT_TRUE(p.ok()) << what << ": " << p.status().to_string();
    EXPECT_GT(p->pp_bytes, 0u) << what;
    EXPECT_EQ(measured, p->pp_bytes) << what << ": boundary bytes per step on stage " << g.coord.pp;
  }
}

}  // namespace
}  // namespace strata
