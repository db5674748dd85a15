// The step-time model of strata plan (offload.hpp's predict_step; docs/offload.md "Predicting the
// step"). It replays the engine's schedule (engine.cpp) over the units of the plan with measured
// rates instead of running it: one clock per engine — the caller (host thread that enqueues and
// blocks on updates), the compute stream, the h2d stream (parameter fetches: NVMe read then copy,
// serial), the grads stream (bucket restores and copies out), the host optimizer thread, and for
// the NVMe optimizer pipeline one disk that serves its reads and writes in issue order. Each
// event starts when its engine is free and its inputs are ready (the same events the engine
// records: slot.fetched, slot.free, bucket done, landed, updated_step), so overlap and
// serialisation come from the schedule, not from a formula. Several steps are replayed; the
// period of the last is the prediction (a step's update overlaps the next step's forward).
// Tensor parallelism shrinks each module's compute to the rank's shard and adds the model's
// blocking collectives to its passes (module_costs); a pipeline replays every stage so, then the
// schedule's op order over all stages with the boundary sends (replay_pipeline).
//
// What is left out, and why it is small for the placements strata plan writes: the prefetch
// budget (strata plan sets stage3_prefetch_bucket_size to hold the look-ahead), memsets of
// gradient buckets, the fixed cost of enqueueing, and contention for the disk between parameter
// fetches, gradient shards and the optimizer ring (each is charged at the full measured rate).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

#include "offload/regions.hpp"
#include "partition/placement.hpp"
#include "strata/offload.hpp"
#include "strata/options.hpp"
#include "strata/pipeline_schedule.hpp"

namespace strata {
namespace {

using partition::Placement;
using partition::UnitPlacement;

bool finite_nonneg(double x) { return std::isfinite(x) && x >= 0; }

std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// Which accesses of one step fetch which units: engine.cpp's slot rule replayed. A unit read by
// an access stays in its slot while one of the next max(1, k) accesses reads it again; between
// micro-batches of one step the units of the trace's first max(1, k) accesses stay (cyclic
// trace); across steps everything is released. `sliced_fetched`: stage 3 in device memory, whose
// sliced units are fetched as units at home on the host are (the same trace and slots).
std::vector<std::vector<int>> fetches_of_step(const Placement& placement, bool sliced_fetched, int M,
                                              std::int64_t passes, int k) {
  const std::vector<UnitPlacement>& units = placement.units;
  const std::size_t per_pass = 2 * static_cast<std::size_t>(M);
  const std::size_t J = per_pass * static_cast<std::size_t>(passes);
  auto module_at = [&](std::size_t j) {
    const std::size_t i = j % per_pass;
    return i < static_cast<std::size_t>(M) ? static_cast<int>(i) : static_cast<int>(per_pass - 1 - i);
  };
  auto reads = [&](std::size_t j, int u) {
    const auto& st = units[static_cast<std::size_t>(module_at(j))].reads;
    return std::find(st.begin(), st.end(), u) != st.end();
  };
  const std::size_t window = static_cast<std::size_t>(std::max(1, k));
  std::vector<std::vector<int>> fetch(J);
  std::vector<char> held(static_cast<std::size_t>(M), 0);
  for (std::size_t j = 0; j < J; ++j) {
    const int m = module_at(j);
    for (int u : units[static_cast<std::size_t>(m)].reads) {
      const std::size_t uu = static_cast<std::size_t>(u);
      const bool fetched = units[uu].home != Tier::kDevice || (sliced_fetched && units[uu].slice_at_home);
      if (!fetched || units[uu].param_bytes == 0 || held[uu]) continue;
      fetch[j].push_back(u);
      held[uu] = 1;
    }
    // release_after: the trace predicts within this pass, and into the next one when cyclic.
    const std::size_t pass_end = (j / per_pass + 1) * per_pass;
    const std::size_t horizon = std::min(pass_end < J ? pass_end + per_pass : J, j + 1 + window);
    for (int u : units[static_cast<std::size_t>(m)].reads) {
      bool reused = false;
      for (std::size_t i = j + 1; i < horizon && !reused; ++i) reused = reads(i, u);
      if (!reused) held[static_cast<std::size_t>(u)] = 0;
    }
    if (j + 1 == pass_end) {  // end_pass
      for (int u = 0; u < M; ++u) {
        bool keep = false;
        for (std::size_t i = pass_end; i < std::min(J, pass_end + window) && !keep; ++i) keep = reads(i, u);
        if (!keep) held[static_cast<std::size_t>(u)] = 0;
      }
    }
  }
  return fetch;
}

}  // namespace

Status MachineRates::validate(std::size_t modules) const {
  if (forward_seconds.size() != modules || backward_seconds.size() != modules) {
    return invalid_argument(
        "machine rates: forward_seconds and backward_seconds need one entry per module (" +
        std::to_string(modules) + "), got " + std::to_string(forward_seconds.size()) + " and " +
        std::to_string(backward_seconds.size()));
  }
  for (std::size_t m = 0; m < modules; ++m) {
    if (!finite_nonneg(forward_seconds[m]) || !finite_nonneg(backward_seconds[m])) {
      return invalid_argument("machine rates: compute seconds of module " + std::to_string(m) +
                              " must be finite and >= 0");
    }
  }
  const std::pair<const char*, double> positive[] = {{"h2d_bytes_per_s", h2d_bytes_per_s},
                                                     {"d2h_bytes_per_s", d2h_bytes_per_s},
                                                     {"host_copy_bytes_per_s", host_copy_bytes_per_s},
                                                     {"nvme_read_bytes_per_s", nvme_read_bytes_per_s},
                                                     {"nvme_write_bytes_per_s", nvme_write_bytes_per_s},
                                                     {"adam_elements_per_s", adam_elements_per_s},
                                                     {"scan_elements_per_s", scan_elements_per_s}};
  for (const auto& [name, v] : positive) {
    if (!std::isfinite(v) || v <= 0)
      return invalid_argument("machine rates: " + std::string(name) + " = " + number(v) + " must be > 0");
  }
  const std::pair<const char*, double> nonneg[] = {{"device_update_seconds", device_update_seconds},
                                                   {"nvme_request_seconds", nvme_request_seconds},
                                                   {"nvme_cpu_fraction", nvme_cpu_fraction}};
  for (const auto& [name, v] : nonneg) {
    if (!finite_nonneg(v))
      return invalid_argument("machine rates: " + std::string(name) + " = " + number(v) + " must be >= 0");
  }
  if (cores < 1) return invalid_argument("machine rates: cores = " + std::to_string(cores) + " must be >= 1");
  if (!finite_nonneg(dp_bus_bytes_per_s))
    return invalid_argument("machine rates: dp_bus_bytes_per_s = " + number(dp_bus_bytes_per_s) +
                            " must be >= 0");
  if (!finite_nonneg(dp_collective_seconds)) {
    return invalid_argument("machine rates: dp_collective_seconds = " + number(dp_collective_seconds) +
                            " must be >= 0");
  }
  const std::pair<const char*, double> links[] = {{"tp_bus_bytes_per_s", tp_bus_bytes_per_s},
                                                  {"tp_collective_seconds", tp_collective_seconds},
                                                  {"pp_link_bytes_per_s", pp_link_bytes_per_s},
                                                  {"pp_message_seconds", pp_message_seconds}};
  for (const auto& [name, v] : links) {
    if (!finite_nonneg(v))
      return invalid_argument("machine rates: " + std::string(name) + " = " + number(v) + " must be >= 0");
  }
  return ok_status();
}

namespace {

// The data-parallel schedule's facts shared by dp_traffic and predict_step (docs/parallel.md
// "Data parallel on the offload engine"): which stage runs, and each module's collective buffers.
struct DpShape {
  int ranks = 1;
  int stage = 0;
  bool device_opt = true;
  bool device_sharded = false;  // stages 1-3 with the optimizer on the device (sharded update)
  std::vector<std::uint64_t> rs_bytes, ag_bytes, slice_elements;
  std::uint64_t all_reduce_bytes = 0;
  bool active() const { return ranks > 1; }
  // Stages 1-2 (and stage 3's resident modules) all-gather a module's parameters after its update;
  // stage 3 gathers the others at every fetch instead.
  bool gathers_after_update(const std::vector<UnitPlacement>& units, int u) const {
    return active() && (stage < 3 || units[static_cast<std::size_t>(u)].home == Tier::kDevice);
  }
  bool gathers_at_fetch(const std::vector<UnitPlacement>& units, int u) const {
    return active() && !device_opt && stage == 3 && units[static_cast<std::size_t>(u)].home != Tier::kDevice;
  }
};

DpShape dp_shape(const TrainerConfig& config, const OffloadSettings& settings, const std::vector<UnitPlacement>& units) {
  DpShape d;
  d.ranks = std::max(1, settings.dp_size);
  d.device_opt = settings.optimizer == Tier::kDevice;
  // The host optimizer exists only sharded: stage 0 runs as stage 1.
  d.stage = !d.device_opt && settings.zero_stage == 0 ? 1 : settings.zero_stage;
  d.device_sharded = d.active() && d.device_opt && d.stage >= 1;
  const std::uint64_t w = dtype_size(config.model.dtype);
  const std::uint64_t P = static_cast<std::uint64_t>(d.ranks);
  for (std::size_t u = 0; u < units.size(); ++u) {
    const std::uint64_t n = units[u].grad_bytes / 4;
    const partition::DpSlice s = partition::dp_slice_of(n, d.ranks, 0);  // rank 0: the largest
    d.rs_bytes.push_back(n == 0 ? 0 : 4 * P * s.chunk);
    d.ag_bytes.push_back(n == 0 ? 0 : w * P * s.chunk);
    d.slice_elements.push_back(d.active() ? s.len : n);
    d.all_reduce_bytes += units[u].grad_bytes;
  }
  return d;
}

double ring_factor(int ranks) { return ranks > 1 ? static_cast<double>(ranks - 1) / ranks : 0.0; }

}  // namespace

double DpTraffic::wire_bytes() const {
  const double f = ring_factor(ranks);
  return 2 * f * static_cast<double>(all_reduce_bytes) +
         f * static_cast<double>(reduce_scatter_bytes + all_gather_bytes);
}

double DpTraffic::seconds(double bus_bytes_per_s, double collective_seconds) const {
  if (ranks <= 1 || collectives == 0) return 0.0;
  return static_cast<double>(collectives) * collective_seconds +
         (bus_bytes_per_s > 0 ? wire_bytes() / bus_bytes_per_s : 0.0);
}

Result<DpTraffic> dp_traffic(const TrainerConfig& config, const OffloadSettings& settings, bool cuda) {
  STRATA_RETURN_IF_ERROR(config.validate());
  STRATA_RETURN_IF_ERROR(settings.validate());
  // Tensor parallel: a rank's data-parallel group reduces its shard (the same shapes on every
  // tensor-parallel rank); with a pipeline, the units of its stage (describe_units).
  STRATA_ASSIGN_OR_RETURN(ModelLayout layout, describe_model(config.model, TensorParallel{settings.tp_size, 0}));
  const Placement placement = Placement::build(layout, settings);
  const std::vector<UnitPlacement>& units = placement.units;
  const DpShape d = dp_shape(config, settings, units);
  DpTraffic t;
  t.ranks = d.ranks;
  t.stage = d.stage;
  if (!d.active()) return t;
  const int M = static_cast<int>(layout.modules.size());
  const std::uint64_t A = static_cast<std::uint64_t>(config.grad_accum);
  if (d.device_opt && !d.device_sharded) {
    t.all_reduce_bytes = d.all_reduce_bytes;
    t.collectives = 1;
    if (!cuda && settings.zero_stage == 0) {
      // One all-reduce per gradient bucket, beside backward with overlap_comm (stage 0 buckets on
      // the cpu backend).
      t.collectives = std::max<std::uint64_t>(1, partition::cut_grad_buckets(placement, settings).buckets.size());
      t.overlapped = settings.overlap_comm;
    }
    return t;
  }
  // With the optimizer on the device, stage 1 reduces once in the update; stages 2-3 (data
  // parallelism alone, or with tensor or pipeline parallelism) reduce each bucket every
  // micro-batch (docs/parallel.md "Gradient buckets"), as the host tier's stage 2.
  const bool device_buckets = placement.sharding.device_grads_sharded;
  // Beside compute: every collective with the optimizer off the device; on it, stage 2-3's bucket
  // reduce-scatters with overlap_comm and stage 3's gathers in the prefetched fetches.
  t.overlapped = !d.device_opt || (device_buckets && (settings.overlap_comm || settings.zero_stage == 3));
  const std::uint64_t rs_times = (d.device_opt && !device_buckets) || d.stage == 1 ? 1 : A;
  for (int u = 0; u < M; ++u) {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (d.rs_bytes[uu] == 0) continue;
    t.reduce_scatter_bytes += rs_times * d.rs_bytes[uu];
    t.collectives += rs_times;
    // Stage 3 in device memory: a sliced unit is not gathered after its update (its fetches are).
    if (!units[uu].slice_at_home && (d.device_opt || d.gathers_after_update(units, u))) {
      t.all_gather_bytes += d.ag_bytes[uu];
      ++t.collectives;
    }
  }
  const bool any_sliced = placement.any_slice_at_home();
  if ((!d.device_opt && d.stage == 3) || any_sliced) {
    // The sliced units are fetched as units at home on the host are (the same trace and slots).
    const int k = settings.prefetch_elements == 0 ? 0 : settings.prefetch_modules;
    for (const std::vector<int>& at : fetches_of_step(placement, true, M, config.grad_accum, k)) {
      for (int u : at) {
        if (!units[static_cast<std::size_t>(u)].slice_at_home && !d.gathers_at_fetch(units, u)) continue;
        t.all_gather_bytes += d.ag_bytes[static_cast<std::size_t>(u)];
        ++t.collectives;
      }
    }
  }
  return t;
}

namespace {

// What one micro-batch's pass through module m costs on the compute clock: its compute (the
// rank's shard of it) and, with tensor parallelism, the model's blocking collectives inside it.
struct ModuleCosts {
  std::vector<double> fwd, bwd;        // compute seconds
  std::vector<double> tp_fwd, tp_bwd;  // tensor-parallel collectives' seconds
  std::vector<std::uint64_t> tp_fwd_bytes, tp_bwd_bytes, tp_fwd_n, tp_bwd_n;

  double seconds(int m, bool backward) const {
    const std::size_t mm = static_cast<std::size_t>(m);
    return backward ? bwd[mm] + tp_bwd[mm] : fwd[mm] + tp_fwd[mm];
  }
  // Counts the pass's parts in `p` (compute, the collectives apart).
  void charge(int m, bool backward, StepPrediction& p) const {
    const std::size_t mm = static_cast<std::size_t>(m);
    p.compute += backward ? bwd[mm] : fwd[mm];
    p.tp += backward ? tp_bwd[mm] : tp_fwd[mm];
    p.tp_bytes += backward ? tp_bwd_bytes[mm] : tp_fwd_bytes[mm];
    p.tp_collectives += backward ? tp_bwd_n[mm] : tp_fwd_n[mm];
  }
  // Only the modules in `keep` (a pipeline stage's) run on this rank.
  void keep_only(const std::vector<char>& keep) {
    for (std::size_t m = 0; m < fwd.size(); ++m) {
      if (keep[m]) continue;
      fwd[m] = bwd[m] = tp_fwd[m] = tp_bwd[m] = 0;
      tp_fwd_bytes[m] = tp_bwd_bytes[m] = tp_fwd_n[m] = tp_bwd_n[m] = 0;
    }
  }
};

// Elements of the matrices module m of `layout` multiplies by (tied ones included), as
// tools/strata/measure.cpp's module_forward_flops weighs the measured compute.
double matrix_elements(const ModelLayout& layout, std::size_t m) {
  double w = 0;
  for (int i : layout.modules[m].params) {
    const ParamDesc& p = layout.params[static_cast<std::size_t>(i)];
    if (p.shape.size() == 2) w += static_cast<double>(p.numel());
  }
  return w;
}

// The module costs of `shard` (tensor-parallel rank 0's layout, the largest shard) from the
// measured whole-model rates. Compute: a block's and the head's measured seconds times the
// shard's share of the module's FLOPs (2 per multiply-add of its matrices, which shrink to the
// shard's columns or rows, plus causal attention over its 1/t of the heads), the embedding's
// unchanged (every rank gathers every token's row of its vocabulary shard). Collectives: those
// src/model/model.cpp issues per micro-batch (forward_module / block_forward, backward_module /
// block_backward, sp_add_norm_grads), with N = micro_batch * seq_len tokens, C = n_embd and w the
// working dtype's size:
//   embedding  forward  all-reduce N*C*w (SP: reduce-scatter)        backward  SP: all-gather N*C*w
//   block      forward  2 all-reduces of N*C*w (attention and MLP projections; SP: all-gather,
//                       reduce-scatter, all-gather, reduce-scatter)
//              backward 2 all-reduces of N*C*w (c_fc / gate_up and qkv input gradients; SP: 4
//                       all-gathers, 2 reduce-scatters and the norms' gradients, an all-reduce of
//                       4*C fp32), plus the recompute with activation checkpointing (the forward
//                       up to the MLP: 1 all-reduce; SP: all-gather, reduce-scatter, all-gather);
//                       the last block of each module range is not recomputed (the shared set
//                       still holds it from the forward, engine order: each range's backward
//                       starts with it)
//   head       forward  all-reduces of N and 2N fp32 (row maxima, exp sums; SP: first an
//                       all-gather of N*C*w)
//              backward all-reduce N*C*w (SP: all-gather and reduce-scatter of N*C*w, the final
//                       norm's gradients: all-reduce of 2*C fp32 for GPT-2, C for LLaMA)
// With sequence parallelism each all-gather's output and reduce-scatter's input is N*C*w too.
Result<ModuleCosts> module_costs(const TrainerConfig& config, const OffloadSettings& settings,
                                 const ModelLayout& shard, const MachineRates& rates) {
  const std::size_t MM = shard.modules.size();
  ModuleCosts c;
  c.fwd = rates.forward_seconds;
  c.bwd = rates.backward_seconds;
  c.tp_fwd.assign(MM, 0.0);
  c.tp_bwd.assign(MM, 0.0);
  c.tp_fwd_bytes.assign(MM, 0);
  c.tp_bwd_bytes.assign(MM, 0);
  c.tp_fwd_n.assign(MM, 0);
  c.tp_bwd_n.assign(MM, 0);
  const int t = std::max(1, settings.tp_size);
  if (t == 1) return c;
  STRATA_ASSIGN_OR_RETURN(ModelLayout whole, describe_model(config.model));
  const double tokens = static_cast<double>(config.micro_batch * config.seq_len);
  const double attention =
      4 * tokens * static_cast<double>(config.seq_len) * static_cast<double>(config.model.n_embd);
  for (std::size_t m = 0; m < MM; ++m) {
    const ModuleKind kind = shard.modules[m].kind;
    if (kind == ModuleKind::kEmbedding) continue;
    const double heads = kind == ModuleKind::kBlock ? 1.0 : 0.0;
    const double full = 2 * tokens * matrix_elements(whole, m) + heads * attention;
    const double mine = 2 * tokens * matrix_elements(shard, m) + heads * attention / t;
    const double share = full > 0 ? mine / full : 1.0;
    c.fwd[m] *= share;
    c.bwd[m] *= share;
  }

  const bool seq = settings.sequence_parallel;
  const std::uint64_t N = static_cast<std::uint64_t>(config.micro_batch * config.seq_len);
  const std::uint64_t C = static_cast<std::uint64_t>(config.model.n_embd);
  const std::uint64_t rows = N * C * dtype_size(config.model.dtype);  // one residual-stream tensor
  const double ring = static_cast<double>(t - 1) / t;
  enum class Op { kAllReduce, kReduceScatter, kAllGather };
  auto add = [&](std::size_t m, bool backward, Op op, std::uint64_t bytes) {
    const double f = op == Op::kAllReduce ? 2 * ring : ring;
    (backward ? c.tp_bwd : c.tp_fwd)[m] +=
        rates.tp_collective_seconds + static_cast<double>(bytes) * f / rates.tp_bus_bytes_per_s;
    (backward ? c.tp_bwd_bytes : c.tp_fwd_bytes)[m] += bytes;
    (backward ? c.tp_bwd_n : c.tp_fwd_n)[m] += 1;
  };
  // With checkpointing the last block of each module range is not recomputed.
  std::vector<int> bounds = settings.pipeline_bounds.size() > 2 ? settings.pipeline_bounds
                                                                : std::vector<int>{0, static_cast<int>(MM)};
  std::vector<char> recomputed(MM, 0);
  const bool checkpointing = config.model.activation_checkpointing && config.model.n_layer > 1;
  for (std::size_t r = 0; checkpointing && r + 1 < bounds.size(); ++r) {
    int last = -1;
    for (int m = bounds[r]; m < bounds[r + 1]; ++m) {
      if (shard.modules[static_cast<std::size_t>(m)].kind != ModuleKind::kBlock) continue;
      recomputed[static_cast<std::size_t>(m)] = 1;
      last = m;
    }
    if (last >= 0) recomputed[static_cast<std::size_t>(last)] = 0;
  }
  const bool gpt2 = config.model.kind == ModelKind::kGpt2;
  for (std::size_t m = 0; m < MM; ++m) {
    switch (shard.modules[m].kind) {
      case ModuleKind::kEmbedding:
        add(m, false, seq ? Op::kReduceScatter : Op::kAllReduce, rows);
        if (seq) add(m, true, Op::kAllGather, rows);
        break;
      case ModuleKind::kBlock:
        if (seq) {
          for (Op op : {Op::kAllGather, Op::kReduceScatter, Op::kAllGather, Op::kReduceScatter})
            add(m, false, op, rows);
          if (recomputed[m])
            for (Op op : {Op::kAllGather, Op::kReduceScatter, Op::kAllGather}) add(m, true, op, rows);
          for (Op op : {Op::kAllGather, Op::kAllGather, Op::kReduceScatter, Op::kAllGather, Op::kAllGather,
                        Op::kReduceScatter})
            add(m, true, op, rows);
          add(m, true, Op::kAllReduce, 4 * C * 4);
        } else {
          add(m, false, Op::kAllReduce, rows);
          add(m, false, Op::kAllReduce, rows);
          if (recomputed[m]) add(m, true, Op::kAllReduce, rows);
          add(m, true, Op::kAllReduce, rows);
          add(m, true, Op::kAllReduce, rows);
        }
        break;
      case ModuleKind::kHead:
        if (seq) add(m, false, Op::kAllGather, rows);
        add(m, false, Op::kAllReduce, N * 4);
        add(m, false, Op::kAllReduce, 2 * N * 4);
        if (seq) {
          add(m, true, Op::kAllGather, rows);
          add(m, true, Op::kReduceScatter, rows);
          add(m, true, Op::kAllReduce, (gpt2 ? 2 : 1) * C * 4);
        } else {
          add(m, true, Op::kAllReduce, rows);
        }
        break;
    }
  }
  return c;
}

// One rank's step with its units and its modules' costs (modules it does not run cost 0): the
// replay of docs/offload.md "Predicting the step".
Result<StepPrediction> replay_stage(const TrainerConfig& config, const OffloadSettings& settings,
                                    const MachineRates& rates, const ModelLayout& layout,
                                    const ModuleCosts& mc) {
  const Placement placement = Placement::build(layout, settings);
  const std::vector<UnitPlacement>& units = placement.units;
  const int M = static_cast<int>(layout.modules.size());
  const std::size_t MM = static_cast<std::size_t>(M);
  const std::int64_t A = config.grad_accum;
  // Data parallel (docs/offload.md "Predicting the step", the data-parallel term): each
  // collective is charged on the engine thread that runs it, where the engine runs it.
  const DpShape dps = dp_shape(config, settings, units);
  if (dps.active() && rates.dp_bus_bytes_per_s <= 0) {
    return invalid_argument("machine rates: dp_bus_bytes_per_s = " + number(rates.dp_bus_bytes_per_s) +
                            " must be > 0 with " + std::to_string(dps.ranks) +
                            " data-parallel ranks (strata estimate / plan --link-bandwidth)");
  }
  auto collective = [&](std::uint64_t b, double factor) {
    return rates.dp_collective_seconds + static_cast<double>(b) * factor / rates.dp_bus_bytes_per_s;
  };
  const double ring = ring_factor(dps.ranks);

  StepPrediction p;
  auto h2d = [&](std::uint64_t b) { return static_cast<double>(b) / rates.h2d_bytes_per_s; };
  auto d2h = [&](std::uint64_t b) { return static_cast<double>(b) / rates.d2h_bytes_per_s; };
  auto host_copy = [&](std::uint64_t b) { return static_cast<double>(b) / rates.host_copy_bytes_per_s; };

  // Activation offload (docs/offload.md "Activation offload"): block l's input x_l (l = 0..L,
  // x_L the head's) lives in a ring of R = min(3, L + 1) device buffers; an input a later write
  // of the pass evicts (l + R <= L) is copied out after block l's forward and back before its
  // backward, on the model's own copy stream (lanes of their own here: the parameter fetches'
  // h2d stream is not shared). Compute waits where the ring makes it: block j's forward writes
  // x_{j+1} into the buffer of x_{j+1-R}, so it waits for that copy out; block i's backward waits
  // for x_i's copy in, which is issued behind the last read of x_{i+R} (the buffer's previous
  // index). Needs the modules to be embedding, blocks 0..L-1, head (block l is module l + 1).
  const int L = static_cast<int>(config.model.n_layer);
  // With a pipeline each stage's ring covers its own module range (not modelled yet: left out).
  const bool act = settings.offload_activations && config.model.activation_checkpointing && M == L + 2 &&
                   settings.pipeline_bounds.size() <= 2;
  const int R_act = std::min(3, L + 1);
  const std::uint64_t act_bytes =
      static_cast<std::uint64_t>(config.micro_batch) * static_cast<std::uint64_t>(config.seq_len) /
      static_cast<std::uint64_t>(settings.sequence_parallel ? std::max(1, settings.tp_size) : 1) *
      static_cast<std::uint64_t>(config.model.n_embd) * dtype_size(config.model.dtype);
  auto evicted = [&](int l) { return l >= 0 && l + R_act <= L; };
  struct ActClock {
    double out_lane = 0, in_lane = 0;
    std::vector<double> out_done, in_done;  // per index of the pass
  } ac;
  ac.out_done.assign(static_cast<std::size_t>(L + 1), 0.0);
  ac.in_done.assign(static_cast<std::size_t>(L + 1), 0.0);
  // When module m's compute may start as far as the ring is concerned.
  auto act_ready = [&](int m, bool backward) -> double {
    if (!act || m < 1 || m > L + (backward ? 1 : 0)) return 0.0;
    if (!backward) {
      if (m > L) return 0.0;
      const int l = m - 1;  // block l writes x_{l+1}
      return evicted(l + 1 - R_act) ? ac.out_done[static_cast<std::size_t>(l + 1 - R_act)] : 0.0;
    }
    const int i = m - 1;  // block i (or the head, i = L) reads x_i
    return evicted(i) ? ac.in_done[static_cast<std::size_t>(i)] : 0.0;
  };
  // After module m's compute (ending at `end`): the copies it makes possible.
  auto act_after = [&](int m, bool backward, double end, StepPrediction& cur) {
    if (!act || m < 1 || m > L + 1) return;
    const int i = m - 1;
    if (!backward) {
      if (i >= L || !evicted(i)) return;
      ac.out_lane = std::max(ac.out_lane, end) + d2h(act_bytes);
      ac.out_done[static_cast<std::size_t>(i)] = ac.out_lane;
      cur.d2h += d2h(act_bytes);
      cur.d2h_bytes += act_bytes;
      return;
    }
    // x_i has been read: its buffer takes x_{i-R}.
    if (!evicted(i - R_act)) return;
    ac.in_lane = std::max(ac.in_lane, end) + h2d(act_bytes);
    ac.in_done[static_cast<std::size_t>(i - R_act)] = ac.in_lane;
    cur.h2d += h2d(act_bytes);
    cur.h2d_bytes += act_bytes;
  };

  if (settings.optimizer == Tier::kDevice) {
    // The optimizer on the device: the passes and the update run on the compute stream. Every
    // stream is idle when a step starts (the step synchronises compute after the update), so one
    // step replayed from zero is the steady state. Data parallel, as the engine runs it:
    // - stage 0: on cuda one all-reduce of the whole gradient after backward, exposed; on the
    //   cpu backend (dp_stage0_bucketed) one all-reduce per bucket of grad_buckets when the last
    //   micro-batch's backward leaves the bucket's last module, with overlap_comm on the comm lane
    //   while backward goes on (compute waits for all before the update), without it at once;
    // - stage 1: inside the update, per
    //   module a reduce-scatter of its gradients and an all-gather of its parameters, exposed;
    // - stages 2-3 (dp_device_grad_sharded): the buckets of grad_buckets, each reduce-scattered
    //   (one collective per unit) when backward leaves its last module, every micro-batch: with
    //   overlap_comm on the buckets' comm lane while backward goes on (compute waits when it
    //   takes the bucket's buffer again, grad_bucket_slots of them, and for all before the
    //   update), without it on compute at once; the update all-gathers the parameters of every
    //   unit but the sliced ones;
    // - stage 3 (UnitPlacement::slice_at_home): each fetch of a sliced unit gathers its slices and copies the
    //   whole unit into a param slot (serial on the h2d stream, the slot rule of fetches_of_step,
    //   prefetch_modules accesses ahead), and compute waits for it; the update waits for the h2d
    //   stream.
    const int k = settings.prefetch_elements == 0 ? 0 : settings.prefetch_modules;
    const bool bucketed = dps.device_sharded && placement.sharding.device_grads_sharded;
    // Stage 0 on the cpu backend: each bucket's range all-reduced in place when backward leaves
    // its last module on the last micro-batch (earlier micro-batches only add); no bucket buffers.
    const bool stage0_buckets = dps.active() && !dps.device_sharded && !rates.cuda && settings.zero_stage == 0;
    const bool any_sliced = placement.any_slice_at_home();
    const std::size_t per_pass = 2 * MM;
    const std::size_t J = per_pass * static_cast<std::size_t>(A);
    double compute = 0;
    std::vector<double> compute_end(J, 0.0);
    // Compute waits for a collective that ends at `done` (the exposed part of data parallel).
    auto wait_dp = [&](double done) {
      if (done <= compute) return;
      p.dp_stall += done - compute;
      compute = done;
    };

    // Stage 3: the sliced units fetched as units at home on the host are (the same trace, slots).
    double h2d_stream = 0;
    std::vector<double> fetched(MM, 0.0);
    std::vector<std::vector<int>> fetch_at(J);
    if (any_sliced) {
      fetch_at = fetches_of_step(placement, true, M, A, k);
    }
    auto issue_fetch = [&](std::size_t t) {
      for (int u : fetch_at[t]) {
        const std::size_t uu = static_cast<std::size_t>(u);
        // The slot it reuses is free after the compute of the access k + 1 before.
        const std::size_t kk = static_cast<std::size_t>(k);
        const double slot_free = t >= kk + 1 ? compute_end[t - kk - 1] : 0.0;
        const double g = collective(dps.ag_bytes[uu], ring);
        const double c = h2d(units[uu].param_bytes);
        h2d_stream = std::max(h2d_stream, slot_free) + g + c;
        fetched[uu] = h2d_stream;
        p.dp += g;
        p.dp_bytes += dps.ag_bytes[uu];
        p.h2d += c;
        p.h2d_bytes += units[uu].param_bytes;
      }
    };

    // Stages 2-3: the gradient buckets, their buffers and the collectives in flight.
    partition::GradBuckets gb;
    std::vector<partition::BucketSeat> seat;
    std::vector<int> buf_owner, buf_of;
    std::vector<std::uint64_t> buf_freed;  // per buffer: its release order in the step (0: not yet)
    std::uint64_t frees = 0;
    struct InFlight {
      int buf;
      double done;
    };
    std::vector<InFlight> in_flight;  // launch order
    double comm = 0;
    if (bucketed) {
      gb = partition::cut_grad_buckets(placement, settings, &seat);
      buf_owner.assign(gb.slots(settings), -1);
      buf_freed.assign(buf_owner.size(), 0);
      buf_of.assign(gb.buckets.size(), -1);
    }
    if (stage0_buckets) gb = partition::cut_grad_buckets(placement, settings, &seat);
    // finish_through: compute waits for the collectives in flight up to the one in buffer i
    // (all of them for i < 0), first in first out.
    auto finish_through = [&](int i) {
      if (i >= 0 &&
          std::none_of(in_flight.begin(), in_flight.end(), [i](const InFlight& f) { return f.buf == i; }))
        return;
      std::size_t n = 0;
      while (n < in_flight.size()) {
        wait_dp(in_flight[n].done);
        if (in_flight[n++].buf == i) break;
      }
      in_flight.erase(in_flight.begin(), in_flight.begin() + static_cast<std::ptrdiff_t>(n));
    };

    for (std::size_t j = 0; j < J; ++j) {
      const std::size_t i = j % per_pass;
      const bool backward = i >= MM;
      const int m = backward ? static_cast<int>(per_pass - 1 - i) : static_cast<int>(i);
      const std::size_t mm = static_cast<std::size_t>(m);
      if (i == 0) {  // a new micro-batch: the activation ring starts over
        std::fill(ac.out_done.begin(), ac.out_done.end(), 0.0);
        std::fill(ac.in_done.begin(), ac.in_done.end(), 0.0);
      }
      if (k == 0 || j == 0) issue_fetch(j);
      double ready = act_ready(m, backward);
      for (int u : units[mm].reads)
        if (units[static_cast<std::size_t>(u)].slice_at_home)
          ready = std::max(ready, fetched[static_cast<std::size_t>(u)]);
      if (backward && bucketed) {
        // open_buckets: a bucket its first module touches takes the free buffer released longest
        // ago (ties: the lowest), whose previous bucket's collectives (overlap_comm) compute
        // waits for first.
        for (int u : units[mm].reads) {
          const int b = seat[static_cast<std::size_t>(u)].index;
          if (b < 0 || buf_of[static_cast<std::size_t>(b)] >= 0) continue;
          int slot = -1;
          for (std::size_t q = 0; q < buf_owner.size(); ++q)
            if (buf_owner[q] < 0 && (slot < 0 || buf_freed[q] < buf_freed[static_cast<std::size_t>(slot)]))
              slot = static_cast<int>(q);
          if (slot < 0)
            return internal_error("predict_step: no gradient bucket buffer free for bucket " +
                                  std::to_string(b));
          buf_owner[static_cast<std::size_t>(slot)] = b;
          buf_of[static_cast<std::size_t>(b)] = slot;
          if (settings.overlap_comm) finish_through(slot);
        }
      }
      const double start = std::max(compute, ready);
      p.fetch_stall += start - compute;
      const double dur = mc.seconds(m, backward);
      compute = start + dur;
      mc.charge(m, backward, p);
      act_after(m, backward, compute, p);
      if (backward && bucketed) {
        // close_buckets: each bucket whose last module this was launches one reduce-scatter per
        // unit (after this module's backward in compute order); its buffer is free to take again.
        for (std::size_t b = 0; b < gb.buckets.size(); ++b) {
          if (gb.buckets[b].close_after != m) continue;
          double d = 0;
          for (int u : gb.buckets[b].units) {
            d += collective(dps.rs_bytes[static_cast<std::size_t>(u)], ring);
            p.dp_bytes += dps.rs_bytes[static_cast<std::size_t>(u)];
          }
          p.dp += d;
          comm = std::max(comm, compute) + d;
          const int slot = buf_of[b];
          in_flight.push_back({slot, comm});
          buf_owner[static_cast<std::size_t>(slot)] = -1;
          buf_freed[static_cast<std::size_t>(slot)] = ++frees;
          buf_of[b] = -1;
          if (!settings.overlap_comm) finish_through(slot);
        }
      }
      if (backward && stage0_buckets && j / per_pass == static_cast<std::size_t>(A - 1)) {
        // close_buckets at stage 0: the last micro-batch all-reduces each bucket it leaves (its
        // units' whole gradients: the range is contiguous), on the comm lane with overlap_comm
        // (drain_buckets waits for all before the update), else compute waits at once.
        for (std::size_t b = 0; b < gb.buckets.size(); ++b) {
          if (gb.buckets[b].close_after != m) continue;
          std::uint64_t bytes = 0;
          for (int u : gb.buckets[b].units) bytes += units[static_cast<std::size_t>(u)].grad_bytes;
          const double d = collective(bytes, 2 * ring);
          p.dp += d;
          p.dp_bytes += bytes;
          comm = std::max(comm, compute) + d;
          in_flight.push_back({-2, comm});  // no buffer (-1 would end finish_through(-1) early)
          if (!settings.overlap_comm) finish_through(-1);
        }
      }
      compute_end[j] = compute;
      // prefetch_ahead: the units of the next k accesses (the window slides by one).
      if (k > 0) {
        for (std::size_t t = j + 1; t <= j + static_cast<std::size_t>(k) && t < J; ++t)
          if (t == j + static_cast<std::size_t>(k) || j == 0) issue_fetch(t);
      }
    }
    // The step's end: every bucket waited (drain_buckets), the h2d stream synchronised (stage 3:
    // no fetch reads a slice the update rewrites), then the update.
    finish_through(-1);
    if (h2d_stream > compute) {
      p.fetch_stall += h2d_stream - compute;
      compute = h2d_stream;
    }
    double update = rates.device_update_seconds;
    if (dps.active() && !dps.device_sharded && !stage0_buckets) {
      // Stage 0 on cuda: the caller all-reduces the whole gradient after backward, before the update.
      const double t = collective(dps.all_reduce_bytes, 2 * ring);
      p.dp += t;
      p.dp_bytes += dps.all_reduce_bytes;
      wait_dp(compute + t);
    } else if (dps.device_sharded) {
      // Stages 1-3 in device memory: one host function after backward; per module the
      // reduce-scatter of its gradients (not with buckets: reduced during backward), then per
      // module the update of this rank's slice and the all-gather of its parameters (not a
      // sliced unit's: its fetches gather it); nothing overlaps.
      std::uint64_t all = 0, mine = 0;
      for (std::size_t u = 0; u < MM; ++u) {
        if (dps.rs_bytes[u] == 0) continue;
        double t = 0;
        if (!bucketed) {
          t += collective(dps.rs_bytes[u], ring);
          p.dp_bytes += dps.rs_bytes[u];
        }
        if (!units[u].slice_at_home) {
          t += collective(dps.ag_bytes[u], ring);
          p.dp_bytes += dps.ag_bytes[u];
        }
        p.dp += t;
        wait_dp(compute + t);
        all += units[u].grad_bytes / 4;
        mine += dps.slice_elements[u];
      }
      if (all > 0) update *= static_cast<double>(mine) / static_cast<double>(all);
    }
    p.compute += update;
    p.step_seconds = compute + update;
    return p;
  }

  const int k = settings.prefetch_elements == 0 ? 0 : settings.prefetch_modules;
  const bool grads_nvme = settings.gradients == Tier::kNvme;
  const bool any_nvme_home = placement.any_nvme_home();
  // The delayed update (docs/offload.md "Delayed update"): step t+1's forward does not wait for
  // step t's update; its backward waits for a unit's update before that unit's gradients leave
  // the device; after its passes the caller waits for every unit of step t and uploads them
  // (h2d), and step t+1's update — in backward order — waits for each unit's upload before
  // rewriting its host copy. The warm-up steps (not delayed) are left out: the steady state.
  const bool delayed = settings.delayed_update;
  const bool immediate = settings.update_during_backward && config.grad_clip <= 0.0 &&
                         config.model.dtype != DType::kF16 && !delayed && settings.optimizer == Tier::kHost &&
                         !any_nvme_home && !dps.active();  // sharded: one slice cannot decide a skip
  // Partial optimizer offload: the units of UnitPlacement::optimizer_on_device (kdev of them) keep gradients and
  // optimizer state on the device.
  // Their gradients accumulate in place (no bucket, no copy out, no host scan); after the norm
  // the compute stream scans and updates them, charged as the device optimizer's time in
  // proportion to their elements, before the next forward (stream order).
  const int kdev = settings.optimizer_ratio < 1.0 ? static_cast<int>(placement.sizes.device_opt_units) : 0;
  auto dev_opt = [&](int u) { return kdev > 0 && units[static_cast<std::size_t>(u)].optimizer_on_device != 0; };
  std::uint64_t all_elements = 0, dev_elements = 0;
  for (int u = 0; u < M; ++u) {
    all_elements += units[static_cast<std::size_t>(u)].grad_bytes / 4;
    if (dev_opt(u)) dev_elements += units[static_cast<std::size_t>(u)].grad_bytes / 4;
  }
  const double dev_update = all_elements == 0
                                ? 0.0
                                : rates.device_update_seconds * static_cast<double>(dev_elements) /
                                      static_cast<double>(all_elements);
  auto nvme_read = [&](std::uint64_t b) {
    return b == 0 ? 0.0 : rates.nvme_request_seconds + static_cast<double>(b) / rates.nvme_read_bytes_per_s;
  };
  auto nvme_write = [&](std::uint64_t b) {
    return b == 0 ? 0.0 : rates.nvme_request_seconds + static_cast<double>(b) / rates.nvme_write_bytes_per_s;
  };
  auto adam = [&](std::uint64_t n) { return static_cast<double>(n) / rates.adam_elements_per_s; };
  auto scan = [&](std::uint64_t n) { return static_cast<double>(n) / rates.scan_elements_per_s; };
  // The host optimizer scans and updates this rank's slice of each unit (the whole unit alone).
  auto elements = [&](int u) { return dps.slice_elements[static_cast<std::size_t>(u)]; };
  // What the engine moves to and from NVMe per rank (docs/offload.md "Predicting the step"):
  // stage 3 keeps only this rank's slice of a gathered unit's working parameters there (read at
  // the fetch, written at the publish); everything else the whole unit.
  auto param_io = [&](int u) {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (!dps.gathers_at_fetch(units, u) || units[uu].grad_bytes == 0) return units[uu].param_bytes;
    return units[uu].param_bytes / (units[uu].grad_bytes / 4) * elements(u);
  };

  // Backward touches: a unit's bucket lives from its first backward touch to its last.
  std::vector<int> first_touch(MM, -1), last_touch(MM, M);
  for (int m = M - 1; m >= 0; --m) {
    for (int u : units[static_cast<std::size_t>(m)].reads) {
      const std::size_t uu = static_cast<std::size_t>(u);
      if (first_touch[uu] < 0) first_touch[uu] = m;
      last_touch[uu] = std::min(last_touch[uu], m);
    }
  }
  const std::vector<std::vector<int>> fetch_at = fetches_of_step(placement, false, M, A, k);
  const std::size_t per_pass = 2 * MM;
  const std::size_t J = per_pass * static_cast<std::size_t>(A);

  // Clocks: when each engine is next free (seconds since the first replayed step began).
  double host = 0, compute = 0, h2d_stream = 0, grads = 0, worker = 0, upload_lane = 0;
  double disk_free = 0;  // NVMe optimizer: when the last update's disk work ends
  std::vector<double> updated(MM, 0.0), uploaded(MM, 0.0), fetched(MM, 0.0);
  constexpr int kSteps = 4;
  double last_return = 0, period = 0;
  for (int s = 0; s < kSteps; ++s) {
    StepPrediction cur;
    const double step_start = host;
    // NVMe optimizer: when the step's first landed unit reaches the optimizer thread, which then
    // issues the reads of the update's first R - 1 sub-groups (issue_early_reads); -1 until then.
    double early_at = -1;
    std::vector<double> compute_end(J, 0.0);
    // Units' updated parameters go home: in place (host), to NVMe (the caller of this helper
    // charges that), or to the device copy through an upload (h2d, after the host copy).
    auto publish_resident = [&](int u, double at) {
      const std::size_t uu = static_cast<std::size_t>(u);
      if (units[uu].home != Tier::kDevice) return;
      upload_lane = std::max(upload_lane, at) + h2d(units[uu].param_bytes);
      uploaded[uu] = upload_lane;
      cur.h2d += h2d(units[uu].param_bytes);
      cur.h2d_bytes += units[uu].param_bytes;
    };
    auto issue_fetch = [&](std::size_t t) {
      for (int u : fetch_at[t]) {
        const std::size_t uu = static_cast<std::size_t>(u);
        // A pending update gates the fetch on the h2d stream (prefetch_ahead), or, for a unit
        // all-gathered at its fetch (stage 3), the caller waits for it; neither for the delayed
        // update (it writes the next version, which publish_delayed makes current after the step).
        const bool gathered = dps.gathers_at_fetch(units, u);
        double gate = 0;
        if (!delayed && gathered) host = std::max(host, updated[uu]);
        if (!delayed && !gathered) gate = updated[uu];
        const double slot_free =
            t >= static_cast<std::size_t>(k) + 1 ? compute_end[t - static_cast<std::size_t>(k) - 1] : 0.0;
        const double start = std::max({h2d_stream, host, slot_free, gate});
        double d = h2d(units[uu].param_bytes);
        cur.h2d += d;
        cur.h2d_bytes += units[uu].param_bytes;
        if (units[uu].home == Tier::kNvme) {
          const double r = nvme_read(param_io(u));
          cur.nvme_read += r;
          cur.nvme_read_bytes += param_io(u);
          d += r;
        }
        if (gathered) {
          // Stage 3: the fetch (a host function on the h2d stream) all-gathers the slices.
          const double g = collective(dps.ag_bytes[uu], ring);
          cur.dp += g;
          cur.dp_bytes += dps.ag_bytes[uu];
          d += g;
        }
        h2d_stream = start + d;
        fetched[uu] = h2d_stream;
      }
    };
    for (std::size_t j = 0; j < J; ++j) {
      const std::size_t i = j % per_pass;
      const bool backward = i >= MM;
      const int m = backward ? static_cast<int>(per_pass - 1 - i) : static_cast<int>(i);
      const std::size_t mm = static_cast<std::size_t>(m);
      const std::int64_t micro = static_cast<std::int64_t>(j / per_pass);
      const bool last_micro = micro + 1 == A;
      // access_params: wait for the units' updates, fetch what is not in a slot (a miss, or the
      // first k accesses of the step, which nothing fetched ahead).
      double ready = 0;
      if (!delayed)
        for (int u : units[mm].reads) host = std::max(host, updated[static_cast<std::size_t>(u)]);
      if (k == 0 || j == 0) issue_fetch(j);
      for (int u : units[mm].reads) {
        const std::size_t uu = static_cast<std::size_t>(u);
        ready = std::max(ready, units[uu].home == Tier::kDevice ? uploaded[uu] : fetched[uu]);
      }
      // acquire_grads: later micro-batches restore the bucket (grads stream) first; data parallel
      // at stage 2-3 reduces every micro-batch on its own, so the bucket starts from zero instead.
      if (backward && !(dps.active() && dps.stage >= 2)) {
        for (int u : units[mm].reads) {
          const std::size_t uu = static_cast<std::size_t>(u);
          if (first_touch[uu] != m || units[uu].grad_bytes == 0 || micro == 0 || dev_opt(u)) continue;
          double d = h2d(units[uu].grad_bytes);
          cur.h2d += d;
          cur.h2d_bytes += units[uu].grad_bytes;
          if (grads_nvme) {
            const double r = nvme_read(units[uu].grad_bytes);
            cur.nvme_read += r;
            cur.nvme_read_bytes += units[uu].grad_bytes;
            d += r;
          }
          grads = std::max(grads, host) + d;
          ready = std::max(ready, grads);
        }
      }
      const double dur = mc.seconds(m, backward);
      if (j % per_pass == 0) {  // a new micro-batch: the activation ring starts over
        std::fill(ac.out_done.begin(), ac.out_done.end(), 0.0);
        std::fill(ac.in_done.begin(), ac.in_done.end(), 0.0);
      }
      ready = std::max(ready, act_ready(m, backward));
      const double start = std::max({compute, host, ready});
      cur.fetch_stall += std::max(0.0, start - std::max(compute, step_start));
      compute = start + dur;
      compute_end[j] = compute;
      mc.charge(m, backward, cur);
      act_after(m, backward, compute, cur);
      // release_grads: at a unit's last backward touch its bucket goes out (grads stream); on the
      // last micro-batch the unit lands and the optimizer thread scans it (and may update it).
      if (backward) {
        for (int u : units[mm].reads) {
          const std::size_t uu = static_cast<std::size_t>(u);
          if (last_touch[uu] != m || units[uu].grad_bytes == 0 || dev_opt(u)) continue;
          // Delayed update: the previous step's update of u must have read its gradients.
          if (delayed) host = std::max(host, updated[uu]);
          double d = d2h(units[uu].grad_bytes);
          cur.d2h += d;
          cur.d2h_bytes += units[uu].grad_bytes;
          if (grads_nvme) {
            // Data parallel: a reduced bucket leaves this rank's slice on NVMe (stage 2-3 read it
            // back first on later micro-batches, to add); stage 1's earlier micro-batches write
            // the unsharded local sum whole.
            const bool reduced = dps.active() && (last_micro || dps.stage >= 2);
            const std::uint64_t out = reduced ? 4 * elements(u) : units[uu].grad_bytes;
            if (reduced && dps.stage >= 2 && micro > 0) {
              const double r = nvme_read(4 * elements(u));
              cur.nvme_read += r;
              cur.nvme_read_bytes += 4 * elements(u);
              d += r;
            }
            const double w = nvme_write(out);
            cur.nvme_write += w;
            cur.nvme_write_bytes += out;
            d += w;
            if (last_micro) {
              d += scan(elements(u));
              cur.optimizer += scan(elements(u));
            }
          }
          if (dps.active() && (last_micro || dps.stage >= 2)) {
            // The gradient stream reduce-scatters the bucket after its copy out: once per step
            // at stage 1 (the local sum accumulates unsharded), every micro-batch at 2 and 3.
            const double r = collective(dps.rs_bytes[uu], ring);
            cur.dp += r;
            cur.dp_bytes += dps.rs_bytes[uu];
            d += r;
          }
          grads = std::max({grads, compute, delayed ? host : 0.0}) + d;
          if (!last_micro) continue;
          // The caller's kLanded reaches the optimizer thread once it finished the command before
          // (the previous step's update), before the unit's copy out has landed.
          if (early_at < 0) early_at = std::max(worker, host);
          double work = grads_nvme ? 0.0 : scan(elements(u));
          if (immediate) work += adam(elements(u));
          worker = std::max(worker, grads) + work;
          cur.optimizer += work;
          if (immediate) {
            updated[uu] = worker;
            publish_resident(u, worker);
          }
        }
      }
      // release_after -> prefetch_ahead: the units of the next k accesses.
      if (k > 0) {
        for (std::size_t t = j + 1; t <= j + static_cast<std::size_t>(k) && t < J; ++t) {
          // Only once per access: the window slides by one, so access t is first in reach now.
          if (t == j + static_cast<std::size_t>(k) || j == 0) issue_fetch(t);
        }
      }
    }
    // The step's end: every stream synchronised, then the norm from the optimizer thread.
    host = std::max({host, compute, h2d_stream, grads});
    if (delayed) {
      // publish_delayed: the previous step's update of every unit, then their uploads; a unit at
      // home in host memory instead has its next version copied over the published one on the
      // caller's thread (before the step returns), an NVMe-homed unit flips its version (no I/O).
      for (int u = 0; u < M; ++u) host = std::max(host, updated[static_cast<std::size_t>(u)]);
      for (int u = 0; u < M; ++u) {
        const std::size_t uu = static_cast<std::size_t>(u);
        if (units[uu].param_bytes == 0) continue;
        if (units[uu].home == Tier::kHost) {
          const double c = host_copy(units[uu].param_bytes);
          host += c;
          cur.host_copy += c;
          cur.host_copy_bytes += units[uu].param_bytes;
          continue;
        }
        if (units[uu].home != Tier::kDevice) continue;
        upload_lane = std::max(upload_lane, host) + h2d(units[uu].param_bytes);
        uploaded[uu] = upload_lane;
        cur.h2d += h2d(units[uu].param_bytes);
        cur.h2d_bytes += units[uu].param_bytes;
      }
    }
    const double norm_known = std::max(worker, host);
    cur.update_stall = norm_known - host;
    host = norm_known;
    worker = norm_known;
    const double step_return = host;
    if (kdev > 0) {
      // The device units' scan and update, on compute after the norm (before the next forward).
      compute = std::max(compute, norm_known) + dev_update;
      cur.compute += dev_update;
      for (int u = 0; u < M; ++u)
        if (dev_opt(u)) updated[static_cast<std::size_t>(u)] = norm_known;
    }
    // The update's order: forward, or backward for the delayed update (whose publish is the
    // caller's: the worker only waits for the unit's upload before rewriting its host copy).
    std::vector<int> order;
    for (int i = 0; i < M; ++i) {
      const int u = delayed ? M - 1 - i : i;
      if (!dev_opt(u)) order.push_back(u);
    }
    auto publish = [&](int u, double at) {
      if (!delayed) publish_resident(u, at);
    };
    if (!immediate) {
      if (settings.optimizer == Tier::kHost) {
        for (int u : order) {
          const std::size_t uu = static_cast<std::size_t>(u);
          if (delayed) worker = std::max(worker, uploaded[uu]);
          worker += adam(elements(u));
          cur.optimizer += adam(elements(u));
          if (units[uu].home == Tier::kNvme) {
            const double w = nvme_write(param_io(u));  // published synchronously
            worker += w;
            cur.nvme_write += w;
            cur.nvme_write_bytes += param_io(u);
          }
          if (dps.gathers_after_update(units, u)) {
            // The optimizer thread all-gathers the updated parameters before they count as updated.
            const double g = collective(dps.ag_bytes[uu], ring);
            worker += g;
            cur.dp += g;
            cur.dp_bytes += dps.ag_bytes[uu];
          }
          updated[uu] = worker;
          publish(u, worker);
        }
      } else {
        // update_units_nvme: sub-groups through the ring; reads run up to R-1 ahead, a buffer is
        // reused once its write retired, writes retire in order and mark units updated.
        struct Item {
          int unit;
          std::uint64_t len;
          bool first, last;
        };
        std::vector<Item> items;
        for (int u : order) {
          const auto& b = units[static_cast<std::size_t>(u)].sub_groups;
          for (std::size_t c = 0; c + 1 < b.size(); ++c)
            items.push_back({u, b[c + 1] - b[c], c == 0, c + 2 == b.size()});
        }
        const std::size_t R = placement.sizes.ring_buffers;
        struct Pending {
          std::uint64_t seq;
          double done;
          int unit_done;
        };
        std::vector<Pending> writes;
        std::size_t retired = 0;
        std::uint64_t seq = 0;
        double disk = disk_free;
        double& t = worker;
        std::vector<std::uint64_t> ring_seq(R, 0);
        std::uint64_t out_seq[2] = {0, 0};
        std::vector<double> read_done(items.size(), 0.0);
        // The reads of [master | m | v] of the first R - 1 items, issued during backward at
        // early_at (issue_early_reads), one after another on the disk; the update takes them over
        // (the gradients of an item, on NVMe, are still read at the update).
        const std::size_t early_n = early_at >= 0 && R > 1 ? std::min(items.size(), R - 1) : 0;
        for (std::size_t i = 0; i < early_n; ++i) {
          const double r = nvme_read(12 * items[i].len);
          cur.nvme_read += r;
          cur.nvme_read_bytes += 12 * items[i].len;
          disk = std::max(disk, early_at) + r;  // the previous update's disk work came first
          read_done[i] = disk;
        }
        disk = std::max(disk, worker);
        auto retire_through = [&](std::uint64_t through) {
          while (retired < writes.size() && writes[retired].seq <= through) {
            t = std::max(t, writes[retired].done);
            if (writes[retired].unit_done >= 0)
              updated[static_cast<std::size_t>(writes[retired].unit_done)] = t;
            ++retired;
          }
        };
        auto disk_op = [&](double d) {
          disk = std::max(disk, t) + d;
          return disk;
        };
        // The next forward's first `urgent` units: their writes retire (and the unit is marked)
        // as soon as they are issued, with no later unit's read issued beside them; ranks that
        // agree on each unit retire every unit's writes at its end.
        const bool agree = dps.ranks > 1 || settings.tp_size > 1;
        const std::size_t urgent = static_cast<std::size_t>(std::max(1, settings.prefetch_modules)) + 1;
        std::vector<std::size_t> rank_of(items.size(), 0);
        for (std::size_t i = 1; i < items.size(); ++i) rank_of[i] = rank_of[i - 1] + (items[i].first ? 1 : 0);
        auto may_read_ahead = [&](std::size_t next, std::size_t current) {
          return agree || next <= current || rank_of[next] < urgent || rank_of[current] >= urgent;
        };
        std::size_t issued = 0, units_started = 0;
        for (std::size_t i = 0; i < items.size(); ++i) {
          while (issued < items.size() && issued < i + R - 1 && may_read_ahead(issued, i)) {
            retire_through(ring_seq[issued % R]);
            const std::uint64_t len = items[issued].len;
            const bool early = issued < early_n;  // its state was read during backward
            double r = early ? 0.0 : nvme_read(12 * len);
            if (!early) cur.nvme_read_bytes += 12 * len;
            if (grads_nvme) {
              r += nvme_read(4 * len);
              cur.nvme_read_bytes += 4 * len;
            }
            cur.nvme_read += r;
            if (!early || r > 0) read_done[issued] = std::max(read_done[issued], disk_op(r));
            ++issued;
          }
          const Item& it = items[i];
          t = std::max(t, read_done[i]);
          if (it.first) {
            ++units_started;
            retire_through(out_seq[(units_started - 1) % 2]);
          }
          t += adam(it.len);
          cur.optimizer += adam(it.len);
          const double w = nvme_write(12 * it.len);
          cur.nvme_write += w;
          cur.nvme_write_bytes += 12 * it.len;
          writes.push_back({++seq, disk_op(w), -1});
          ring_seq[i % R] = seq;
          if (!it.last) continue;
          const std::size_t uu = static_cast<std::size_t>(it.unit);
          if (units[uu].home == Tier::kNvme) {
            const double pw = nvme_write(param_io(it.unit));
            cur.nvme_write += pw;
            cur.nvme_write_bytes += param_io(it.unit);
            writes.push_back({++seq, disk_op(pw), it.unit});
            out_seq[(units_started - 1) % 2] = seq;
          } else {
            if (dps.gathers_after_update(units, it.unit)) {
              // The parameter all-gather follows the module's last sub-group.
              const double g = collective(dps.ag_bytes[uu], ring);
              t += g;
              cur.dp += g;
              cur.dp_bytes += dps.ag_bytes[uu];
            }
            if (delayed) t = std::max(t, uploaded[uu]);  // await_upload before the host copy is rewritten
            publish(it.unit, t);
            writes.push_back({++seq, t, it.unit});
          }
          if (agree || units_started <= urgent) retire_through(seq);
        }
        retire_through(std::numeric_limits<std::uint64_t>::max());
        disk_free = disk;
      }
    }
    if (s > 0) period = step_return - last_return;
    last_return = step_return;
    if (s + 1 == kSteps) {
      cur.step_seconds = period;
      if (rates.shared_cores) {
        // The other engines' CPU work, as far as it ran while compute ran, takes its share of
        // the cores compute would have used.
        // The collectives are CPU work here too (the MPI backend copies through shared memory).
        const double cpu_work = cur.h2d + cur.d2h + cur.host_copy + cur.optimizer + cur.dp +
                                rates.nvme_cpu_fraction * (cur.nvme_read + cur.nvme_write);
        const double overlap = period > 0 ? std::min(1.0, cur.compute / period) : 1.0;
        cur.contention = cpu_work * overlap / static_cast<double>(rates.cores);
        cur.step_seconds += cur.contention;
      }
      p = cur;
    }
  }
  return p;
}

// The pipeline's schedule over every stage (docs/offload.md "Predicting the step", pipelines):
// each stage runs its ops in the engine's order (pipeline_ops, or interleaved_pipeline_ops with
// v > 1 chunks), an op starting when the stage is free and its input has arrived (a forward of
// virtual stage j > 0 the activations of j - 1, a backward of j < v*p - 1 the gradients of
// j + 1); each output goes out on the stage's link in its direction (one message after another)
// and arrives `message` seconds after it leaves.
struct PipelineReplay {
  std::vector<double> end, busy, link;
  std::vector<std::uint64_t> sends;
  double span = 0;
};

Result<PipelineReplay> replay_pipeline(PipelineSchedule schedule, int P, int V, int A,
                                       const std::vector<std::vector<double>>& f,
                                       const std::vector<std::vector<double>>& b, double message) {
  std::vector<std::vector<ChunkOp>> ops(static_cast<std::size_t>(P));
  std::size_t left = 0;
  for (int s = 0; s < P; ++s) {
    auto& o = ops[static_cast<std::size_t>(s)];
    if (V == 1) {
      for (const PipelineOp& op : pipeline_ops(schedule, P, s, A))
        o.push_back(ChunkOp{op.forward, op.micro, 0});
    } else {
      STRATA_ASSIGN_OR_RETURN(o, interleaved_pipeline_ops(P, s, V, A));
    }
    left += o.size();
  }
  const int VP = V * P;
  auto at = [&](int a, int j) {
    return static_cast<std::size_t>(a) * static_cast<std::size_t>(VP) + static_cast<std::size_t>(j);
  };
  std::vector<double> act(static_cast<std::size_t>(A) * static_cast<std::size_t>(VP), -1.0), grad = act;
  std::vector<double> clock(static_cast<std::size_t>(P), 0.0), out_link = clock, back_link = clock;
  PipelineReplay r;
  r.busy.assign(static_cast<std::size_t>(P), 0.0);
  r.link.assign(static_cast<std::size_t>(P), 0.0);
  r.sends.assign(static_cast<std::size_t>(P), 0);
  std::vector<std::size_t> next(static_cast<std::size_t>(P), 0);
  while (left > 0) {
    bool moved = false;
    for (int s = 0; s < P; ++s) {
      const std::size_t ss = static_cast<std::size_t>(s);
      while (next[ss] < ops[ss].size()) {
        const ChunkOp& op = ops[ss][next[ss]];
        const int j = op.chunk * P + s;
        double ready = 0;
        if (op.forward && j > 0) ready = act[at(op.micro, j)];
        if (!op.forward && j + 1 < VP) ready = grad[at(op.micro, j)];
        if (ready < 0) break;  // its input has not been sent yet
        const std::size_t c = static_cast<std::size_t>(op.chunk);
        const double d = op.forward ? f[ss][c] : b[ss][c];
        clock[ss] = std::max(clock[ss], ready) + d;
        r.busy[ss] += d;
        if (op.forward && j + 1 < VP) {
          out_link[ss] = std::max(out_link[ss], clock[ss]) + message;
          act[at(op.micro, j + 1)] = out_link[ss];
        } else if (!op.forward && j > 0) {
          back_link[ss] = std::max(back_link[ss], clock[ss]) + message;
          grad[at(op.micro, j - 1)] = back_link[ss];
        }
        if ((op.forward && j + 1 < VP) || (!op.forward && j > 0)) {
          ++r.sends[ss];
          r.link[ss] += message;
        }
        ++next[ss];
        --left;
        moved = true;
      }
    }
    if (!moved)
      return internal_error(
          "predict_step: the pipeline schedule does not progress (no stage's next op has its input)");
  }
  r.end = clock;
  r.span = *std::max_element(clock.begin(), clock.end());
  return r;
}

}  // namespace

Result<StepPrediction> predict_step(const TrainerConfig& config, const OffloadSettings& settings,
                                    const MachineRates& rates) {
  STRATA_RETURN_IF_ERROR(config.validate());
  STRATA_RETURN_IF_ERROR(settings.validate());
  const int t = std::max(1, settings.tp_size);
  // Tensor parallel: the units are rank 0's shard (the largest; the same shapes on every rank).
  STRATA_ASSIGN_OR_RETURN(ModelLayout layout, t > 1 ? describe_model(config.model, TensorParallel{t, 0})
                                                    : describe_model(config.model));
  const std::size_t MM = layout.modules.size();
  STRATA_RETURN_IF_ERROR(rates.validate(MM));
  const bool pipeline = settings.pipeline_bounds.size() > 2;
  if (t > 1 && rates.tp_bus_bytes_per_s <= 0) {
    return invalid_argument("machine rates: tp_bus_bytes_per_s = " + number(rates.tp_bus_bytes_per_s) +
                            " must be > 0 with tensor_parallel_size = " + std::to_string(t) +
                            " (strata plan --link-bandwidth)");
  }
  if (pipeline && rates.pp_link_bytes_per_s <= 0) {
    return invalid_argument("machine rates: pp_link_bytes_per_s = " + number(rates.pp_link_bytes_per_s) +
                            " must be > 0 with a pipeline (strata plan --link-bandwidth)");
  }
  STRATA_ASSIGN_OR_RETURN(ModuleCosts costs, module_costs(config, settings, layout, rates));
  if (t == 1 && !pipeline) return replay_stage(config, settings, rates, layout, costs);

  // The device optimizer's measured time is the whole model's: a rank updates its units' share.
  STRATA_ASSIGN_OR_RETURN(ModelLayout whole, describe_model(config.model));
  double all_elements = 0;
  for (const ModuleDesc& md : whole.modules)
    all_elements += static_cast<double>((md.grad_end - md.grad_begin) / 4);
  auto rates_of = [&](const OffloadSettings& s) {
    MachineRates r = rates;
    const Placement placement = Placement::build(layout, s);
    std::uint64_t mine = 0;
    for (const UnitPlacement& u : placement.units) mine += u.elements();
    if (all_elements > 0) r.device_update_seconds *= static_cast<double>(mine) / all_elements;
    return r;
  };
  if (!pipeline) return replay_stage(config, settings, rates_of(settings), layout, costs);

  // Pipeline: each stage's replay, then the schedule over all of them.
  const int P = partition::pipeline_stage_count(settings);
  const int V = std::max(1, settings.pipeline_virtual_stages);
  const int A = static_cast<int>(config.grad_accum);
  if (settings.pp_stage < 0 || settings.pp_stage >= P) {
    return invalid_argument("predict_step: pp_stage = " + std::to_string(settings.pp_stage) +
                            " outside the " + std::to_string(P) + " pipeline stages");
  }
  std::vector<std::vector<double>> f(static_cast<std::size_t>(P),
                                     std::vector<double>(static_cast<std::size_t>(V), 0.0));
  std::vector<std::vector<double>> b = f;
  std::vector<double> outside(static_cast<std::size_t>(P), 0.0);
  StepPrediction shown;
  for (int s = 0; s < P; ++s) {
    OffloadSettings ss = settings;
    ss.pp_stage = s;
    const auto ranges = partition::stage_ranges(settings.pipeline_bounds, V, s);
    std::vector<char> keep(MM, 0);
    for (const auto& [lo, hi] : ranges)
      for (int m = lo; m < hi; ++m) keep[static_cast<std::size_t>(m)] = 1;
    ModuleCosts cs = costs;
    cs.keep_only(keep);
    STRATA_ASSIGN_OR_RETURN(StepPrediction r, replay_stage(config, ss, rates_of(ss), layout, cs));
    double passes = 0;
    for (std::size_t c = 0; c < ranges.size(); ++c) {
      for (int m = ranges[c].first; m < ranges[c].second; ++m) {
        f[static_cast<std::size_t>(s)][c] += cs.seconds(m, false);
        b[static_cast<std::size_t>(s)][c] += cs.seconds(m, true);
      }
      passes +=
          static_cast<double>(A) * (f[static_cast<std::size_t>(s)][c] + b[static_cast<std::size_t>(s)][c]);
    }
    // What the stage spends outside its passes (the update, stalls, contention) when it runs its
    // micro-batches back to back.
    outside[static_cast<std::size_t>(s)] = std::max(0.0, r.step_seconds - passes);
    if (s == settings.pp_stage) shown = r;
  }
  // The boundary tensor: this rank's rows of the residual stream (sequence parallel: 1/t of them),
  // in the working dtype (the engine's boundary_bytes).
  const std::uint64_t boundary =
      static_cast<std::uint64_t>(config.micro_batch * config.seq_len / (settings.sequence_parallel ? t : 1)) *
      static_cast<std::uint64_t>(config.model.n_embd) * dtype_size(config.model.dtype);
  const double message = rates.pp_message_seconds + static_cast<double>(boundary) / rates.pp_link_bytes_per_s;
  STRATA_ASSIGN_OR_RETURN(PipelineReplay pr,
                          replay_pipeline(settings.pipeline_schedule, P, V, A, f, b, message));
  const std::size_t ps = static_cast<std::size_t>(settings.pp_stage);
  shown.pp_stage = settings.pp_stage;
  shown.pp = pr.link[ps];
  shown.pp_bytes = pr.sends[ps] * boundary;
  shown.pp_schedule = pr.span;
  shown.pp_bubble = pr.span - pr.busy[ps];
  shown.step_seconds = pr.span + *std::max_element(outside.begin(), outside.end());
  return shown;
}

std::string StepPrediction::to_string() const {
  std::ostringstream o;
  char buf[160];
  auto line = [&](const char* part, double seconds, std::uint64_t bytes, const char* what) {
    if (bytes > 0) {
      std::snprintf(buf, sizeof buf, "  %-13s %9.4f s  %12s  %s\n", part, seconds,
                    format_bytes(bytes).c_str(), what);
    } else {
      std::snprintf(buf, sizeof buf, "  %-13s %9.4f s  %12s  %s\n", part, seconds, "", what);
    }
    o << buf;
  };
  std::snprintf(buf, sizeof buf, "predicted step %.4f s\n", step_seconds);
  o << buf;
  line("compute", compute, 0, "forward + backward (+ the device optimizer)");
  line("h2d", h2d, h2d_bytes, "parameter fetches, gradient restores, uploads of updated parameters");
  line("d2h", d2h, d2h_bytes, "gradients out");
  if (host_copy_bytes > 0)
    line("host copy", host_copy, host_copy_bytes, "delayed update: next versions published in host memory");
  line("nvme read", nvme_read, nvme_read_bytes, "parameters, optimizer state, gradients in");
  line("nvme write", nvme_write, nvme_write_bytes, "optimizer state, gradients, updated parameters out");
  line("optimizer", optimizer, 0, "host optimizer thread: gradient scans and CPU Adam");
  line("fetch stall", fetch_stall, 0, "compute waiting for fetched or updated parameters");
  line("update stall", update_stall, 0, "the caller waiting for the gradient norm");
  line("contention", contention, 0, "cpu backend: the other engines' CPU work taken from compute");
  if (dp_bytes > 0) {
    line("data parallel", dp, dp_bytes, "collectives: gradient reductions, parameter gathers");
    if (dp_stall > 0) line("dp stall", dp_stall, 0, "compute waiting for data-parallel collectives");
  }
  if (tp_bytes > 0)
    line("tensor par.", tp, tp_bytes, "the model's blocking collectives (on the compute stream)");
  if (pp_schedule > 0) {
    char what[64];
    std::snprintf(what, sizeof what, "boundary tensors stage %d sends", pp_stage);
    line("pipeline", pp, pp_bytes, what);
    line("schedule", pp_schedule, 0, "every stage's forwards, backwards and sends");
    line("bubble", pp_bubble, 0, "this stage idle inside the schedule");
  }
  return o.str();
}

}  // namespace strata
