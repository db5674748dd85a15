// Offload settings (DeepSpeed keys → tiers) and the memory plan: every buffer the engine will
// allocate, computed from the model's descriptor table before anything is allocated, and the
// check that it fits the device budget, the pinned pool, host memory and the NVMe directories.
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "offload/regions.hpp"
#include "partition/placement.hpp"
#include "strata/config.hpp"
#include "strata/device.hpp"
#include "strata/model.hpp"
#include "strata/pipeline_schedule.hpp"

namespace strata {

Result<Tier> parse_tier(std::string_view text) {
  if (text == "device" || text == "none") return Tier::kDevice;
  if (text == "host" || text == "cpu") return Tier::kHost;
  if (text == "nvme") return Tier::kNvme;
  return invalid_argument("tier '" + std::string(text) + "' is not one of: device (none), host (cpu), nvme");
}

Status OffloadSettings::validate() const {
  if (reduce_bucket_elements < 1) {
    return invalid_argument("zero_optimization.reduce_bucket_size: expected an integer >= 1 (elements per "
                            "gradient bucket), found " + std::to_string(reduce_bucket_elements));
  }
  if (params != Tier::kDevice && optimizer == Tier::kDevice) {
    return invalid_argument(
        "zero_optimization.offload_param.device = " + std::string(to_string(params)) +
        " needs the optimizer off the device too: set zero_optimization.offload_optimizer.device to cpu or nvme");
  }
  if (gradients == Tier::kDevice) {
    return invalid_argument("offload gradients = device: gradients live on the device only with the optimizer there; "
                            "choose host or nvme");
  }
  if (gradients == Tier::kNvme && optimizer != Tier::kNvme) {
    return invalid_argument("offload gradients = nvme needs the optimizer state on NVMe too "
                            "(zero_optimization.offload_optimizer.device = nvme)");
  }
  if ((params == Tier::kNvme || optimizer == Tier::kNvme) && nvme_path.empty()) {
    return invalid_argument(
        "an NVMe tier needs a directory: set zero_optimization.offload_*.nvme_path (or aio.nvme_path, or "
        "--nvme-path)");
  }
  if (prefetch_modules < 0) {
    return invalid_argument("offload prefetch depth = " + std::to_string(prefetch_modules) + " must be >= 0");
  }
  if (prefetch_elements < 0) {
    return invalid_argument("zero_optimization.stage3_prefetch_bucket_size = " +
                            std::to_string(prefetch_elements) + " must be >= 0");
  }
  if (persistence_threshold < 0) {
    return invalid_argument("zero_optimization.stage3_param_persistence_threshold = " +
                            std::to_string(persistence_threshold) + " must be >= 0");
  }
  if (nvme_buffer_count < 2 || nvme_buffer_count > 64) {
    return invalid_argument("zero_optimization.offload_optimizer.buffer_count = " +
                            std::to_string(nvme_buffer_count) + " must be in [2, 64]");
  }
  if (optimizer == Tier::kNvme && sub_group_size < 64) {
    return invalid_argument("zero_optimization.sub_group_size = " + std::to_string(sub_group_size) +
                            " must be >= 64 (elements)");
  }
  if (zero_stage < 0 || zero_stage > 3) {
    return invalid_argument("zero_optimization.stage = " + std::to_string(zero_stage) + " must be 0, 1, 2 or 3");
  }
  if (dp_size < 1) return invalid_argument("data-parallel size = " + std::to_string(dp_size) + " must be >= 1");
  if (tp_size < 1) {
    return invalid_argument("tensor_parallel_size = " + std::to_string(tp_size) + " must be >= 1");
  }
  if (host_threads < 0) {
    return invalid_argument("offload host threads = " + std::to_string(host_threads) + " must be >= 0");
  }
  if (!(optimizer_ratio > 0.0 && optimizer_ratio <= 1.0)) {
    return invalid_argument("zero_optimization.offload_optimizer.ratio = " + std::to_string(optimizer_ratio) +
                            " must be in (0, 1]: the fraction of the optimizer state on the host");
  }
  if (optimizer_ratio < 1.0 && optimizer != Tier::kDevice) {
    const std::string key = "zero_optimization.offload_optimizer.ratio = " + std::to_string(optimizer_ratio);
    // With data-parallel ranks every stage is built (docs/offload.md "Partial optimizer offload",
    // "Data parallel"): stages 0-3, the host or NVMe optimizer, the gradients of the host units in
    // host memory or on NVMe, the parameters anywhere (the device units' stay resident and whole,
    // also at stage 3). With a pipeline too, interleaved or not, at stages 0-3 ("Tensor and
    // pipeline parallel": at stages 2-3 each chunk's device units are reduced after each of its
    // backward ops). The cuda backend is refused at engine creation (check_data_parallel).
    if (delayed_update) {
      return invalid_argument(key + " with strata.delayed_update is not built yet: use one or the other");
    }
  }
  if (delayed_update && optimizer == Tier::kDevice) {
    return invalid_argument(
        "strata.delayed_update = true needs the optimizer off the device (the device's update is in stream order "
        "with the next step anyway): set zero_optimization.offload_optimizer.device to cpu or nvme, or turn "
        "strata.delayed_update off");
  }
  if (pipeline_virtual_stages < 1) {
    return invalid_argument("strata.pipeline_virtual_stages = " + std::to_string(pipeline_virtual_stages) +
                            " must be at least 1 (1: one module range per pipeline stage)");
  }
  if (pipeline_virtual_stages > 1 && pipeline_schedule != PipelineSchedule::kOneFOneB) {
    return invalid_argument("strata.pipeline_virtual_stages = " + std::to_string(pipeline_virtual_stages) +
                            " runs interleaved 1F1B; strata.pipeline_schedule = " +
                            std::string(to_string(pipeline_schedule)) + " with it is not built: use 1f1b");
  }
  if (delayed_update_warmup < 0) {
    return invalid_argument("strata.delayed_update_warmup = " + std::to_string(delayed_update_warmup) +
                            " must be >= 0");
  }
  if (params == Tier::kNvme || optimizer == Tier::kNvme) STRATA_RETURN_IF_ERROR(io.validate());
  return ok_status();
}

namespace {

Tier tier_of(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::kNone:
      return Tier::kDevice;
    case OffloadDevice::kCpu:
      return Tier::kHost;
    case OffloadDevice::kNvme:
      return Tier::kNvme;
  }
  return Tier::kDevice;
}

}  // namespace

Status OffloadSettings::apply(const Config& config) {
  const ZeroConfig& z = config.zero_optimization;
  params = tier_of(z.offload_param.device);
  optimizer = tier_of(z.offload_optimizer.device);
  io = IoEngineConfig::from(config.aio);
  nvme_path = config.aio.nvme_path;
  for (const std::string* p : {&z.offload_optimizer.nvme_path, &z.offload_param.nvme_path}) {
    if (!p->empty() && std::find(nvme_path.begin(), nvme_path.end(), *p) == nvme_path.end()) {
      nvme_path.insert(nvme_path.begin(), *p);
    }
  }
  io.nvme_path = nvme_path;
  offload_activations = config.activation_checkpointing.cpu_checkpointing;
  // "auto" keeps this placement's value (Strata's default unless the caller set one).
  if (!config.is_auto("zero_optimization.stage3_prefetch_bucket_size")) prefetch_elements = z.stage3_prefetch_bucket_size;
  if (!config.is_auto("zero_optimization.stage3_param_persistence_threshold"))
    persistence_threshold = z.stage3_param_persistence_threshold;
  pin_memory = z.offload_optimizer.pin_memory || z.offload_param.pin_memory;
  nvme_buffer_count = static_cast<int>(std::clamp<std::int64_t>(z.offload_optimizer.buffer_count, 2, 64));
  sub_group_size = z.sub_group_size;
  zero_stage = static_cast<int>(z.stage);
  reduce_bucket_elements = z.reduce_bucket_size;
  overlap_comm = z.overlap_comm;
  // Strata's own tunables of the placement (the `strata` section, or STRATA_OFFLOAD_*).
  prefetch_modules = static_cast<int>(config.strata.get_int(Option::kOffloadPrefetchModules));
  gradients = config.strata.get_string(Option::kOffloadGradients) == "nvme" ? Tier::kNvme : Tier::kHost;
  delayed_update = config.strata.get_bool(Option::kDelayedUpdate);
  sequence_parallel = config.strata.get_bool(Option::kSequenceParallel);
  pipeline_virtual_stages = static_cast<int>(config.strata.get_int(Option::kPipelineVirtualStages));
  delayed_update_warmup = static_cast<int>(config.strata.get_int(Option::kDelayedUpdateWarmup));
  optimizer_ratio = z.offload_optimizer.ratio;
  return validate().with_context(config.source);
}

// ---- the plan -----------------------------------------------------------------------------------

Result<OffloadPlan> OffloadPlan::make(const TrainerConfig& config, const OffloadSettings& settings) {
  STRATA_RETURN_IF_ERROR(config.validate());
  STRATA_RETURN_IF_ERROR(settings.validate());
  // Tensor parallel: rank 0's shard (every shard has the same shapes).
  STRATA_ASSIGN_OR_RETURN(ModelLayout layout, describe_model(config.model, TensorParallel{settings.tp_size, 0}));
  const partition::Placement placement = partition::Placement::build(layout, settings);
  const partition::PlacementSizes& sizes = placement.sizes;
  const partition::Sharding& sharding = placement.sharding;
  OffloadPlan plan;
  for (const partition::UnitPlacement& u : placement.units) {
    plan.module_home.push_back(u.home);
    plan.module_sliced.push_back(u.slice_at_home ? 1 : 0);
  }
  auto line = [&](std::string what, Tier tier, StateKind kind, std::uint64_t bytes, bool pinned = false) {
    if (bytes == 0) return;
    plan.lines.push_back(PlanLine{std::move(what), tier, kind, pinned, bytes});
    if (tier == Tier::kDevice) plan.device_bytes += bytes;
    if (tier == Tier::kHost) (pinned ? plan.pinned_bytes : plan.host_bytes) += bytes;
    if (tier == Tier::kNvme) plan.nvme_bytes += bytes;
  };
  for (const RegionSpec& r : offload_detail::device_regions(placement, settings, config.model.dtype)) {
    const StateKind kind = r.name.rfind("optim.", 0) == 0 ? StateKind::kOptimizer
                           : r.name.rfind("offload.grad", 0) == 0 ? StateKind::kGradients
                                                                   : StateKind::kParameters;
    // Sharded device optimizer: the state regions hold this rank's slices (rank 0's, the largest).
    // Stage >= 2 in device memory: offload.grads is this rank's slices of the gradients too.
    // Stage 3 in device memory: offload.params holds this rank's slices of the modules above the
    // persistence threshold (and the persistent ones whole).
    // Partial optimizer offload with data parallelism: the device modules' state and (stage 2)
    // their reduced gradient slices are this rank's; their gradients stay whole in offload.grads.
    const bool partial_dp = sharding.split_state_sharded;
    const bool mine = (sharding.device_state_sharded && kind == StateKind::kOptimizer) ||
                      (sharding.device_grads_sharded && r.name == "offload.grads") ||
                      (partial_dp && (kind == StateKind::kOptimizer || r.name == "offload.grad_slices"));
    const bool sliced =
        sharding.device_params_sliced && r.name == "offload.params" && placement.any_slice_at_home();
    const std::string of = mine     ? " (this rank's 1/" + std::to_string(settings.dp_size) + ")"
                           : sliced ? " (this rank's 1/" + std::to_string(settings.dp_size) +
                                          " of the modules above stage3_param_persistence_threshold)"
                                    : std::string();
    const std::string modules =
        partial_dp && (kind == StateKind::kOptimizer || r.name == "offload.grads" || r.name == "offload.grad_slices")
            ? " (" + placement.split_modules(true) + ")"
            : std::string();
    line("device region " + r.name + of + modules, Tier::kDevice, kind,
         r.is_slots() ? r.slot_bytes * r.slot_count : r.bytes);
  }
  plan.param_slots = sizes.param_slots;
  plan.param_slot_bytes = sizes.param_slot_bytes;
  plan.grad_slots = sizes.grad_slots;
  plan.grad_slot_bytes = sizes.grad_slot_bytes;
  const bool act_offload = settings.offload_activations;
  if (act_offload && !config.model.activation_checkpointing) {
    return invalid_argument(
        "activation offload (activation_checkpointing.cpu_checkpointing / --offload-activations) keeps the "
        "checkpointed block inputs on the host: it needs activation checkpointing (--checkpointing on, "
        "ModelConfig::activation_checkpointing)");
  }
  // One residual of a micro-batch as this rank holds it: with sequence parallelism its 1/tp of
  // the token rows (the pipeline's boundary buffers and the activation-offload ring and copies).
  const std::int64_t sp_rows = settings.sequence_parallel ? std::max(settings.tp_size, 1) : 1;
  const std::uint64_t boundary =
      static_cast<std::uint64_t>(config.micro_batch * config.seq_len / sp_rows * config.model.n_embd) *
      dtype_size(config.model.dtype);
  const int pp_stages = partition::pipeline_stage_count(settings);
  const int chunks = settings.pipeline_virtual_stages;
  int act_slots = 1;
  // Interleaved: slots carved per (micro-batch, chunk); per slot, the largest chunk it holds.
  std::uint64_t chunk_slot_bytes = 0;
  if (settings.pipeline_bounds.size() > 2 && chunks > 1) {
    STRATA_RETURN_IF_ERROR(
        partition::check_interleaved_micro_batches(chunks, pp_stages, config.grad_accum));
    STRATA_ASSIGN_OR_RETURN(InterleavedSlots assigned,
                            interleaved_slot_assignment(pp_stages, settings.pp_stage, chunks,
                                                        static_cast<int>(config.grad_accum)));
    const auto ranges = partition::stage_ranges(settings.pipeline_bounds, chunks, settings.pp_stage);
    act_slots = static_cast<int>(assigned.slot_chunks.size());
    for (const std::vector<int>& held : assigned.slot_chunks) {
      std::uint64_t most = 0;
      for (int c : held) {
        const auto [b, e] = ranges[static_cast<std::size_t>(c)];
        most = std::max(most, offload_detail::activation_slot_estimate(config, b, e, act_offload));
      }
      chunk_slot_bytes += most;
    }
  } else if (settings.pipeline_bounds.size() > 2) {
    act_slots = pipeline_slots(settings.pipeline_schedule, pp_stages, settings.pp_stage,
                               static_cast<int>(config.grad_accum));
  }
  const std::uint64_t act_bytes = offload_detail::activation_bytes_estimate(config, act_offload);
  if (chunks > 1 && settings.pipeline_bounds.size() > 2) {
    // The shared part only (activation gradients, token staging, tables): the slots follow.
    const int M = static_cast<int>(config.model.n_layer) + 2;
    line("activation gradients, token buffers", Tier::kDevice, StateKind::kActivations,
         act_bytes - offload_detail::activation_slot_estimate(config, 0, M, act_offload));
    line("pipeline: activation slots (" + std::to_string(act_slots) +
             " carved per (micro-batch, chunk): the schedule's most live chunk forwards)",
         Tier::kDevice, StateKind::kActivations, chunk_slot_bytes);
  } else {
    line("activations, activation gradients, token buffers", Tier::kDevice, StateKind::kActivations,
         act_bytes);
  }
  if (act_offload) {
    // docs/offload.md "Activation offload": per activation slot a ring of block inputs on the
    // device and every block input's copy in the pinned pool.
    const std::int64_t ring = std::min<std::int64_t>(Model::kActivationRing, config.model.n_layer + 1);
    line("activation offload: device ring (" + std::to_string(ring) +
             " block inputs per micro-batch in flight)",
         Tier::kDevice, StateKind::kActivations,
         static_cast<std::uint64_t>(act_slots * ring) * (boundary + 256));
    line("activation offload: checkpointed block inputs (pinned)", Tier::kHost, StateKind::kActivations,
         static_cast<std::uint64_t>(act_slots * (config.model.n_layer + 1)) * boundary + 4096, true);
  }
  if (settings.pipeline_bounds.size() > 2) {
    // A stage keeps one activation set per micro-batch in flight (bounded above by the whole
    // model's set each) and, per neighbour, a send buffer per micro-batch and two receive buffers
    // (docs/parallel.md, the boundary exchange).
    // Interleaved (v chunks): both directions on every stage, a send buffer per (micro-batch, chunk).
    const int slots = act_slots;
    const int stages = pp_stages;
    const int neighbours =
        chunks > 1 ? 2 : (settings.pp_stage > 0 ? 1 : 0) + (settings.pp_stage + 1 < stages ? 1 : 0);
    if (chunks == 1) {
      line("pipeline: more activation slots", Tier::kDevice, StateKind::kActivations,
           static_cast<std::uint64_t>(slots - 1) * act_bytes);
    }
    line("pipeline: send and receive buffers", Tier::kDevice, StateKind::kActivations,
         static_cast<std::uint64_t>(neighbours) *
             static_cast<std::uint64_t>(config.grad_accum * chunks + partition::kPipelineRecvBuffers) *
             boundary);
  }
  const bool pin = settings.pin_memory;
  const bool sharded = sharding.host_state_sharded;
  // Partial optimizer offload: which modules' state each side holds.
  // With a pipeline, of the stage's units (GPT-2's last stage: the tied embedding unit first).
  const std::string host_part =
      sizes.device_opt_units == 0
          ? std::string()
          : " (" + placement.split_modules(false) + "; " + placement.split_modules(true) +
                " on the device)";
  if (sharded) {
    // Rank 0 holds the largest slices: its bytes bound every rank's.
    const partition::SliceTotals d = placement.slice_totals(0);
    const std::uint64_t shard = 4 * d.shard_elements;
    const std::uint64_t P = static_cast<std::uint64_t>(settings.dp_size);
    // Partial offload: the host holds this rank's slices of modules k..M-1 only.
    const std::string of = " (this rank's 1/" + std::to_string(settings.dp_size) + ")" + host_part;
    if (settings.gradients == Tier::kNvme) {
      // This rank's reduced slices on its own NVMe keys; host memory only for the staging.
      line("gradients (fp32)" + of, Tier::kNvme, StateKind::kGradients, shard);
      line("gradient staging (pinned)", Tier::kHost, StateKind::kGradients, sizes.grad_slot_bytes, true);
      if (settings.zero_stage < 2 && config.grad_accum > 1) {
        line("gradient accumulation (fp32, unsharded in stage 1)", Tier::kNvme, StateKind::kGradients,
             sizes.grad_bytes);
      }
    } else {
      line("gradients (fp32, host)" + of, Tier::kHost, StateKind::kGradients, shard, pin);
      if (settings.zero_stage < 2 && config.grad_accum > 1) {
        line("gradient accumulation (fp32, host, unsharded in stage 1)" + host_part, Tier::kHost,
             StateKind::kGradients, sizes.grad_bytes - sizes.device_opt_bytes, pin);
      }
    }
    line("data-parallel reduce-scatter staging", Tier::kHost, StateKind::kGradients, 4 * (P + 1) * d.max_chunk, pin);
    line("data-parallel all-gather staging", Tier::kHost, StateKind::kParameters,
         dtype_size(config.model.dtype) * (P + 1) * d.max_chunk, pin);
    if (settings.zero_stage == 3) {
      // Stage 3: modules that are not resident keep this rank's slice at their home.
      const std::uint64_t w = dtype_size(config.model.dtype);
      std::uint64_t resident_copy = 0, host_slices = 0;
      for (const partition::UnitPlacement& u : placement.units) {
        if (u.home == Tier::kDevice) resident_copy += u.param_bytes;
        if (u.home == Tier::kHost && u.param_bytes > 0) host_slices += w * u.slice.len;
      }
      line("working parameters (host copy of resident modules)", Tier::kHost, StateKind::kParameters, resident_copy,
           pin);
      line("working parameters" + of, Tier::kHost, StateKind::kParameters, host_slices, pin);
      line("data-parallel parameter fetch staging (pinned)", Tier::kHost, StateKind::kParameters,
           w * (P + 1) * d.max_chunk + static_cast<std::uint64_t>(sizes.param_slots) * sizes.param_slot_bytes, true);
      if (settings.delayed_update && host_slices > 0) {
        // The slices the delayed update in flight writes while the step's fetches gather the
        // published ones.
        line("working parameters (the delayed update's next version, this rank's 1/" +
                 std::to_string(settings.dp_size) + ")",
             Tier::kHost, StateKind::kParameters, host_slices, pin);
      }
    } else {
      line("working parameters (host copy)", Tier::kHost, StateKind::kParameters, sizes.host_param_bytes, pin);
      std::uint64_t next = 0;
      for (const partition::UnitPlacement& u : placement.units) {
        if (u.home == Tier::kHost) next += u.param_bytes;
      }
      if (settings.delayed_update && next > 0) {
        line("working parameters (the delayed update's next version)", Tier::kHost, StateKind::kParameters,
             next, pin);
      }
    }
    if (settings.optimizer == Tier::kHost) {
      line("fp32 master weights" + of, Tier::kHost, StateKind::kOptimizer, shard, pin);
      line("Adam exp_avg" + of, Tier::kHost, StateKind::kOptimizer, shard, pin);
      line("Adam exp_avg_sq" + of, Tier::kHost, StateKind::kOptimizer, shard, pin);
    }
  } else if (settings.optimizer != Tier::kDevice) {
    if (settings.gradients == Tier::kNvme) {
      line("gradients (fp32)" + host_part, Tier::kNvme, StateKind::kGradients,
           sizes.grad_bytes - sizes.device_opt_bytes);
      line("gradient staging (pinned)", Tier::kHost, StateKind::kGradients, sizes.grad_slot_bytes, true);
    } else {
      line("gradients (fp32, host)" + host_part, Tier::kHost, StateKind::kGradients,
           sizes.grad_bytes - sizes.device_opt_bytes, pin);
    }
    line("working parameters (host copy)", Tier::kHost, StateKind::kParameters, sizes.host_param_bytes, pin);
    if (settings.delayed_update) {
      // The version the delayed update in flight writes while the step reads the published one.
      std::uint64_t next = 0;
      for (const partition::UnitPlacement& u : placement.units) {
        if (u.home == Tier::kHost) next += u.param_bytes;
      }
      if (next > 0) {
        line("working parameters (the delayed update's next version)", Tier::kHost, StateKind::kParameters, next,
             pin);
      }
    }
  }
  if (settings.optimizer == Tier::kHost && !sharded) {
    // Partial offload: the first modules' state is in the device regions optim.* above.
    const std::uint64_t host_state = sizes.grad_bytes - sizes.device_opt_bytes;
    line("fp32 master weights" + host_part, Tier::kHost, StateKind::kOptimizer, host_state, pin);
    line("Adam exp_avg" + host_part, Tier::kHost, StateKind::kOptimizer, host_state, pin);
    line("Adam exp_avg_sq" + host_part, Tier::kHost, StateKind::kOptimizer, host_state, pin);
  }
  if (settings.optimizer == Tier::kNvme) {
    // Partial offload: the first modules' state is in the device regions optim.* above.
    const std::uint64_t state =
        sharded ? 12 * placement.slice_totals(0).shard_elements
                : 3 * (sizes.grad_bytes - sizes.device_opt_bytes);
    line(sharded
             ? "fp32 master + exp_avg + exp_avg_sq (this rank's 1/" + std::to_string(settings.dp_size) + ")"
             : "fp32 master + exp_avg + exp_avg_sq" + host_part,
         Tier::kNvme, StateKind::kOptimizer, state);
    line("optimizer pipeline ring (pinned)", Tier::kHost, StateKind::kOptimizer,
         static_cast<std::uint64_t>(sizes.ring_buffers) * sizes.ring_buffer_bytes, true);
    line("updated parameter staging (pinned)", Tier::kHost, StateKind::kParameters, 2 * sizes.param_out_bytes, true);
  }
  if (sizes.nvme_param_bytes > 0 && sharded && settings.zero_stage == 3) {
    std::uint64_t slices = 0;
    for (const partition::UnitPlacement& u : placement.units) {
      if (u.home == Tier::kNvme) slices += dtype_size(config.model.dtype) * u.slice.len;
    }
    line("working parameters (this rank's 1/" + std::to_string(settings.dp_size) + ")", Tier::kNvme,
         StateKind::kParameters, slices);  // fetch staging: counted with the data-parallel lines
    if (settings.delayed_update) {
      line("working parameters (the delayed update's next version, this rank's 1/" +
               std::to_string(settings.dp_size) + ")",
           Tier::kNvme, StateKind::kParameters, slices);
    }
  } else if (sizes.nvme_param_bytes > 0) {
    line("working parameters", Tier::kNvme, StateKind::kParameters, sizes.nvme_param_bytes);
    if (settings.delayed_update) {
      line("working parameters (the delayed update's next version)", Tier::kNvme, StateKind::kParameters,
           sizes.nvme_param_bytes);
    }
    line("parameter fetch staging (pinned)", Tier::kHost, StateKind::kParameters,
         static_cast<std::uint64_t>(sizes.param_slots) * sizes.param_slot_bytes, true);
  }
  if (sharding.device_params_sliced && sizes.param_slots > 0) {
    // Stage 3 in device memory: a fetch gathers the slices in pinned buffers (this rank's slice,
    // every rank's) and lays the unit out in its slot's pinned staging before the copy.
    const partition::SliceTotals d = placement.slice_totals(0);
    const std::uint64_t w = dtype_size(config.model.dtype), P = static_cast<std::uint64_t>(settings.dp_size);
    line("data-parallel parameter fetch staging (pinned)", Tier::kHost, StateKind::kParameters,
         w * (P + 1) * d.max_chunk + static_cast<std::uint64_t>(sizes.param_slots) * sizes.param_slot_bytes, true);
  }
  plan.swap_bytes = offload_detail::swap_capacity(plan, placement, settings);
  return plan;
}

namespace {

std::uint64_t available_host_memory() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return 0;
  char key[64];
  unsigned long long kb = 0;
  std::uint64_t avail = 0;
  while (std::fscanf(f, "%63s %llu kB\n", key, &kb) == 2) {
    if (std::string(key) == "MemAvailable:") avail = kb * 1024ull;
  }
  std::fclose(f);
  return avail;
}

}  // namespace

Status OffloadPlan::check_fits(const Device& device, const OffloadSettings& settings) const {
  const DeviceInfo& info = const_cast<Device&>(device).info();
  const std::uint64_t need =
      device_bytes + (info.kind == DeviceKind::kCuda ? offload_detail::kCudaWorkspaceBytes : 0);
  if (need > info.memory_budget) {
    return out_of_memory("offload plan: the device needs " + format_bytes(need) + " but its budget is " +
                         format_bytes(info.memory_budget) +
                         "; raise device_memory (STRATA_DEVICE_MEMORY / --device-memory), offload more "
                         "(offload_param / offload_optimizer), or lower the micro-batch or sequence length");
  }
  const ArenaStats pinned = const_cast<Device&>(device).pinned().stats();
  if (pinned_bytes > pinned.free_bytes) {
    return out_of_memory("offload plan: pinned host buffers need " + format_bytes(pinned_bytes) +
                         " but the pinned pool has " + format_bytes(pinned.free_bytes) +
                         " free; raise pinned_memory (STRATA_PINNED_MEMORY), set pin_memory false, or lower "
                         "offload_optimizer.buffer_count");
  }
  const std::uint64_t host_limit = settings.host_memory_limit > 0 ? settings.host_memory_limit : available_host_memory();
  if (host_limit > 0 && host_bytes > host_limit) {
    return out_of_memory("offload plan: host-tier state needs " + format_bytes(host_bytes) + " but " +
                         format_bytes(host_limit) +
                         (settings.host_memory_limit > 0 ? " is the host memory limit" : " of host memory is available") +
                         "; move the optimizer state to NVMe (offload_optimizer.device = nvme)");
  }
  if (nvme_bytes > 0) {
    const std::string& dir = settings.nvme_path.front();
    struct statvfs vfs {};
    if (::statvfs(dir.c_str(), &vfs) != 0) {
      return not_found("offload plan: cannot use NVMe directory '" + dir + "' (nvme_path): it does not exist or is not accessible");
    }
    const std::uint64_t free_bytes = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    const std::uint64_t need = swap_bytes;
    if (need > free_bytes * settings.nvme_path.size()) {
      return out_of_memory("offload plan: the NVMe tier needs " + format_bytes(need) + " of swap space but '" + dir +
                           "' has " + format_bytes(free_bytes) + " free; free disk space or choose another nvme_path");
    }
  }
  return ok_status();
}

std::string_view to_string(PipelineSchedule schedule) {
  return schedule == PipelineSchedule::kGpipe ? "gpipe" : "1f1b";
}

Result<PipelineSchedule> parse_pipeline_schedule(std::string_view text) {
  if (text == "gpipe") return PipelineSchedule::kGpipe;
  if (text == "1f1b") return PipelineSchedule::kOneFOneB;
  return invalid_argument("pipeline schedule '" + std::string(text) + "': expected \"gpipe\" or \"1f1b\"");
}

std::vector<PipelineOp> pipeline_ops(PipelineSchedule schedule, int stages, int stage, int micro_batches) {
  std::vector<PipelineOp> ops;
  const int m = micro_batches;
  const int warm = schedule == PipelineSchedule::kGpipe ? m : std::min(std::max(stages - stage - 1, 0), m);
  for (int a = 0; a < warm; ++a) ops.push_back({true, a});
  for (int i = 0; warm + i < m; ++i) {  // steady state: one forward, one backward
    ops.push_back({true, warm + i});
    ops.push_back({false, i});
  }
  for (int a = m - warm; a < m; ++a) ops.push_back({false, a});  // cool-down
  return ops;
}

int pipeline_slots(PipelineSchedule schedule, int stages, int stage, int micro_batches) {
  int live = 0, most = 0;
  for (const PipelineOp& op : pipeline_ops(schedule, stages, stage, micro_batches)) {
    live += op.forward ? 1 : -1;
    most = std::max(most, live);
  }
  return std::max(most, 1);
}

std::string_view to_string(StateKind kind) {
  switch (kind) {
    case StateKind::kParameters:
      return "parameters";
    case StateKind::kGradients:
      return "gradients";
    case StateKind::kOptimizer:
      return "optimizer";
    case StateKind::kActivations:
      return "activations";
  }
  return "unknown";
}

OffloadSettings placement_settings(const OffloadSettings& settings) {
  OffloadSettings s = settings;
  // Settings only some placements take (strata estimate and strata plan enumerate placements
  // from one base): the others are estimated without them. The delayed update adds a second
  // version of the parameters off the device;
  // the partial optimizer split applies to the host or NVMe optimizer in one process and, with
  // several data-parallel ranks or a pipeline, where validate() takes it (with data parallelism
  // alone: every stage and placement of the host or NVMe optimizer).
  if (s.optimizer == Tier::kDevice) s.delayed_update = false;
  if (s.optimizer == Tier::kDevice || s.delayed_update) {
    s.optimizer_ratio = 1.0;
  } else if (s.optimizer_ratio < 1.0 && (s.dp_size > 1 || s.pipeline_bounds.size() > 2) && !s.validate().ok()) {
    s.optimizer_ratio = 1.0;
  }
  return s;
}

Result<PlacementEstimate> estimate_placement(const TrainerConfig& config, const OffloadSettings& settings,
                                             const EstimateBudgets& budgets, bool cuda) {
  OffloadSettings s = placement_settings(settings);
  if ((s.params == Tier::kNvme || s.optimizer == Tier::kNvme) && s.nvme_path.empty()) {
    s.nvme_path = {"nvme"};  // a name only: the plan does not touch the disk
    s.io.nvme_path = s.nvme_path;
  }
  STRATA_ASSIGN_OR_RETURN(OffloadPlan plan, OffloadPlan::make(config, s));
  PlacementEstimate e;
  e.params = s.params;
  e.optimizer = s.optimizer;
  for (const PlanLine& l : plan.lines) {
    TierBytes& t = e.by_kind[static_cast<std::size_t>(l.kind)];
    if (l.tier == Tier::kDevice) t.device += l.bytes;
    if (l.tier == Tier::kHost) (l.pinned ? t.pinned : t.host) += l.bytes;
    if (l.tier == Tier::kNvme) t.nvme += l.bytes;
  }
  e.device_need = plan.device_bytes + (cuda ? offload_detail::kCudaWorkspaceBytes : 0);
  e.nvme_need = plan.swap_bytes;
  e.fits_device = budgets.device == 0 || e.device_need <= budgets.device;
  e.fits_host = budgets.host == 0 || plan.host_bytes + plan.pinned_bytes <= budgets.host;
  e.fits_nvme = budgets.nvme == 0 || e.nvme_need <= budgets.nvme;
  e.plan = std::move(plan);
  // DeepSpeed's rules: parameter offload is stage 3 only, optimizer offload stages 1-3.
  e.zero_stage = s.params != Tier::kDevice ? 3 : s.optimizer != Tier::kDevice ? 1 : 0;
  return e;
}

Result<std::vector<PlacementEstimate>> estimate_placements(const TrainerConfig& config, const OffloadSettings& base,
                                                           const EstimateBudgets& budgets, bool cuda) {
  std::vector<PlacementEstimate> out;
  constexpr Tier kTiers[] = {Tier::kDevice, Tier::kHost, Tier::kNvme};
  for (Tier params : kTiers) {
    for (Tier optimizer : kTiers) {
      // The engine keeps the optimizer next to or below the parameters (OffloadSettings::validate).
      if (params != Tier::kDevice && optimizer == Tier::kDevice) continue;
      OffloadSettings s = base;
      s.params = params;
      s.optimizer = optimizer;
      STRATA_ASSIGN_OR_RETURN(PlacementEstimate e, estimate_placement(config, s, budgets, cuda));
      for (int stage = e.zero_stage; stage <= 3; ++stage) {
        if (base.dp_size == 1) {  // one process: every stage the same bytes
          e.zero_stage = stage;
          out.push_back(e);
          continue;
        }
        // Data parallel: what each stage shards (the engine shards device optimizer state on the
        // cpu backend only; cuda refuses it).
        if (cuda && optimizer == Tier::kDevice && stage >= 1) continue;
        OffloadSettings st = s;
        st.zero_stage = stage;
        STRATA_ASSIGN_OR_RETURN(PlacementEstimate es, estimate_placement(config, st, budgets, cuda));
        es.zero_stage = stage;
        out.push_back(std::move(es));
      }
    }
  }
  return out;
}

std::string OffloadPlan::to_string() const {
  std::ostringstream o;
  o << "memory plan:\n";
  for (const PlanLine& l : lines) {
    char buf[256];
    std::snprintf(buf, sizeof buf, "  %-6s %-7s %12s  %s\n", std::string(strata::to_string(l.tier)).c_str(),
                  l.tier == Tier::kHost ? (l.pinned ? "pinned" : "") : "", format_bytes(l.bytes).c_str(),
                  l.what.c_str());
    o << buf;
  }
  o << "  total: device " << format_bytes(device_bytes) << ", host " << format_bytes(host_bytes) << " + pinned "
    << format_bytes(pinned_bytes) << ", nvme " << format_bytes(nvme_bytes);
  if (swap_bytes > 0) o << " (swap files " << format_bytes(swap_bytes) << ")";
  o << "\n";
  // A sliced module (stage 3 in device memory) has its home on the device but is fetched into a
  // slot like a host module: counted apart from the resident ones.
  int homes[3] = {0, 0, 0}, sliced = 0;
  for (std::size_t m = 0; m < module_home.size(); ++m) {
    if (m < module_sliced.size() && module_sliced[m]) {
      ++sliced;
      continue;
    }
    homes[static_cast<int>(module_home[m])]++;
  }
  o << "  modules' working parameters: " << homes[0] << " resident on the device, ";
  if (sliced > 0)
    o << sliced << " sliced on the device (this rank's slice, gathered into a slot for each use), ";
  o << homes[1] << " on host, " << homes[2] << " on nvme; " << param_slots << " prefetch slots of "
    << format_bytes(param_slot_bytes);
  if (grad_slots > 0) o << ", " << grad_slots << " gradient buckets of " << format_bytes(grad_slot_bytes);
  o << "\n";
  return o.str();
}

}  // namespace strata
