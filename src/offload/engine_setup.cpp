// The engine's setup (engine_impl.hpp): the placement, the streams, the model, every buffer of
// the plan carved in its order, the communicators, then the initial state.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <utility>

#include "device/backends.hpp"
#include "offload/engine_impl.hpp"
#include "offload/regions.hpp"
#include "optim/grad_norm_cuda.hpp"

namespace strata {

Status OffloadEngine::Impl::setup() {
  Device& dev = *device;
  wdtype = config.model.dtype;
  half = wdtype != DType::kF32;
  fp16 = wdtype == DType::kF16;
  if (fp16) {
    STRATA_ASSIGN_OR_RETURN(LossScaler ls, LossScaler::create(config.loss_scaling));
    scaler.emplace(ls);
  }
  delayed = settings.delayed_update;
  STRATA_RETURN_IF_ERROR(setup_tensor_parallel());
  STRATA_ASSIGN_OR_RETURN(ModelLayout lay,
                          describe_model(config.model, TensorParallel{comms.tp_size, comms.tp_rank}));
  // Gradient buckets: stage 0's all-reduce on the cpu backend only (cuda keeps the one all-reduce
  // after backward: a stream's host function may not call NCCL), and stage >= 2's reduce-scatter
  // (the sharded device optimizer is cpu-only, check_data_parallel).
  partition::Ranks ranks;
  ranks.dp_rank = comms.dp != nullptr ? comms.dp->rank() : 0;
  ranks.tp_rank = comms.tp_rank;
  ranks.cuda = dev.info().kind == DeviceKind::kCuda;
  placement = partition::Placement::build(lay, settings, ranks);
  STRATA_RETURN_IF_ERROR(placement.is_valid());
  pp_update_may_fail =
      comms.pp_size > 1 && !placement.sharding.optimizer_on_device &&
      (settings.optimizer == Tier::kNvme || settings.gradients == Tier::kNvme || placement.any_nvme_home());
  M = static_cast<int>(lay.modules.size());
  devopt.dev_stats.assign(static_cast<std::size_t>(M), GradStats{});
  const std::vector<RegionSpec> regions = offload_detail::device_regions(placement, settings, wdtype);
  STRATA_RETURN_IF_ERROR(dev.memory().plan(regions).with_context("offload engine: planning device memory"));
  if (compute == nullptr) {
    STRATA_ASSIGN_OR_RETURN(compute, dev.create_stream("train"));
  }
  STRATA_ASSIGN_OR_RETURN(h2d, dev.create_stream("offload.h2d"));
  STRATA_ASSIGN_OR_RETURN(gstream, dev.create_stream("offload.grads"));
  track.caller = tracer.add_track("engine caller (host)");
  track.compute = tracer.add_track("stream " + compute->name() + " (compute)");
  track.h2d = tracer.add_track("stream offload.h2d");
  track.grads = tracer.add_track("stream offload.grads");
  track.copy_h2d = tracer.add_track("copy engine host->device");
  track.copy_d2h = tracer.add_track("copy engine device->host");
  track.optimizer = tracer.add_track("host optimizer thread");
  track.nvme_fetch = tracer.add_track("NVMe I/O: parameter reads");
  track.nvme_publish = tracer.add_track("NVMe I/O: parameter writes");
  track.nvme_ring = track.nvme_publish + 1;
  for (std::uint32_t r = 0; settings.optimizer == Tier::kNvme && r < placement.sizes.ring_buffers; ++r)
    tracer.add_track("NVMe I/O: optimizer ring " + std::to_string(r));

  Model::Options mo;
  mo.max_batch = config.micro_batch;
  mo.max_seq_len = config.seq_len;
  mo.with_grads = true;
  mo.plan_arena = false;
  mo.own_storage = false;
  mo.loss_slots = static_cast<int>(config.grad_accum);
  mo.tensor_parallel = comms.tp_model.get();
  mo.sequence_parallel = settings.sequence_parallel;
  mo.offload_activations = settings.offload_activations;
  chunks = placement.stage.chunks;
  if (comms.pp_size > 1) {
    if (chunks == 1) {
      mo.first_module = placement.stage.first;
      mo.end_module = placement.stage.end;
      mo.activation_slots = pipeline_slots(settings.pipeline_schedule, comms.pp_size, comms.pp_rank,
                                           static_cast<int>(config.grad_accum));
    } else {
      // Slots carved per (micro-batch, chunk), as many as the schedule's peak of live chunk
      // forwards (docs/parallel.md "Schedules").
      mo.module_ranges = placement.stage.chunk_ranges;
      STRATA_ASSIGN_OR_RETURN(pipe.chunk_slots,
                              interleaved_slot_assignment(comms.pp_size, comms.pp_rank, chunks,
                                                          static_cast<int>(config.grad_accum)));
      mo.activation_slots = static_cast<int>(pipe.chunk_slots.slot_chunks.size());
      mo.slot_ranges = pipe.chunk_slots.slot_chunks;
      pipe.forward_slot.assign(static_cast<std::size_t>(chunks), -1);
      for (int k = mo.activation_slots - 1; k >= 0; --k) {
        for (int c : pipe.chunk_slots.slot_chunks[static_cast<std::size_t>(k)])
          pipe.forward_slot[static_cast<std::size_t>(c)] = k;
      }
    }
  }
  // Every device unit is read by the modules of one chunk of this stage (device_units_of_chunk
  // partitions device_units): pipeline x data parallel at stages 2-3 reduces a chunk's list after
  // each of its backward ops (run_pipeline).
  for (int u : placement.stage.device_units) {
    if (placement.units[static_cast<std::size_t>(u)].several_chunks)
      return internal_error("offload: device module " + std::to_string(u) +
                            " is read by several chunks of this stage");
    if (placement.units[static_cast<std::size_t>(u)].chunk < 0)
      return internal_error("offload: device module " + std::to_string(u) + " is read by no chunk");
  }
  STRATA_ASSIGN_OR_RETURN(model, Model::create(std::move(lay), dev, *compute, mo));

  STRATA_RETURN_IF_ERROR(carve_device_regions());
  STRATA_RETURN_IF_ERROR(setup_data_parallel());
  STRATA_RETURN_IF_ERROR(setup_pipeline());
  STRATA_RETURN_IF_ERROR(carve_slots());
  STRATA_RETURN_IF_ERROR(table_owned_params());
  STRATA_RETURN_IF_ERROR(carve_host_tiers());
  STRATA_RETURN_IF_ERROR(create_kernels());
  ledger.updated_step.assign(static_cast<std::size_t>(M), 0);
  ledger.stage_done.assign(static_cast<std::size_t>(M), 0);
  host.host_opt_step.assign(static_cast<std::size_t>(M), 0);
  host.nvme.group_step.resize(static_cast<std::size_t>(M));
  for (int u = 0; u < M; ++u)
    host.nvme.group_step[static_cast<std::size_t>(u)].assign(
        placement.units[static_cast<std::size_t>(u)].sub_group_count(), 0);
  state.settle_ = [this]() { return wait_all_updates(); };
  STRATA_RETURN_IF_ERROR(state.initialize());
  if (!placement.sharding.optimizer_on_device) STRATA_RETURN_IF_ERROR(host.start_worker());
  return compute->synchronize();
}

// offload.params, and with the optimizer (or part of it) on the device its gradients and state,
// in the plan's order (device_regions).
Status OffloadEngine::Impl::carve_device_regions() {
  Device& dev = *device;
  Arena& arena = dev.memory();
  char* base = static_cast<char*>(arena.base());
  STRATA_ASSIGN_OR_RETURN(std::uint64_t roff,
                          arena.allocate_persistent(
                              "offload.params", std::max<std::uint64_t>(placement.sizes.resident_bytes, 1)));
  homes.resident = base + roff;
  bound_params.assign(static_cast<std::size_t>(M), nullptr);
  bound_grads.assign(static_cast<std::size_t>(M), nullptr);
  for (int u = 0; u < M; ++u) {
    if (placement.resident(u))  // a sliced unit (stage 3 in device memory) is bound to its slot when fetched
      bound_params[static_cast<std::size_t>(u)] =
          homes.resident + placement.units[static_cast<std::size_t>(u)].resident_offset;
  }
  if (placement.sharding.optimizer_on_device || placement.sharding.optimizer_split) {
    // Stage >= 2 (grad_sharded): this rank's slices of the gradients only.
    const std::uint64_t dbytes = placement.sharding.device_grads_sharded
                                     ? offload_detail::device_state_bytes(placement)
                                 : placement.sharding.optimizer_on_device ? placement.sizes.grad_bytes
                                                                          : placement.sizes.device_opt_bytes;
    devopt.dgrad_bytes = dbytes;
    // Sharded (dev_sharded): the state regions hold this rank's slices only.
    // Partial offload with data parallelism: this rank's slices of the device units.
    const std::uint64_t sbytes = placement.sharding.optimizer_on_device
                                     ? offload_detail::device_state_bytes(placement)
                                 : placement.sharding.split_state_sharded ? 4 * placement.slices.dev_elements
                                                                          : placement.sizes.device_opt_bytes;
    auto carve = [&](const char* name, std::uint64_t bytes) -> Result<float*> {
      STRATA_ASSIGN_OR_RETURN(std::uint64_t off,
                              arena.allocate_persistent(name, std::max<std::uint64_t>(bytes, 1)));
      STRATA_RETURN_IF_ERROR(compute->memset_async(base + off, 0, bytes));
      return reinterpret_cast<float*>(base + off);
    };
    STRATA_ASSIGN_OR_RETURN(devopt.dgrads, carve("offload.grads", dbytes));
    if (half) {
      STRATA_ASSIGN_OR_RETURN(devopt.dmaster, carve("optim.master", sbytes));
    }
    STRATA_ASSIGN_OR_RETURN(devopt.dm, carve("optim.exp_avg", sbytes));
    STRATA_ASSIGN_OR_RETURN(devopt.dv, carve("optim.exp_avg_sq", sbytes));
    if (placement.sharding.device_state_sharded) {
      float* staging = nullptr;
      STRATA_ASSIGN_OR_RETURN(staging, carve("offload.dp_staging", offload_detail::device_dp_staging_bytes(
                                                                       placement, half ? 2 : 4)));
      devopt.dev_staging = reinterpret_cast<char*>(staging);
    }
    if (placement.sharding.split_state_sharded) {
      float* staging = nullptr;
      STRATA_ASSIGN_OR_RETURN(staging, carve("offload.dp_staging", offload_detail::split_dp_staging_bytes(
                                                                       placement, half ? 2 : 4)));
      devopt.dev_staging = reinterpret_cast<char*>(staging);
      if (settings.zero_stage >= 2) {
        STRATA_ASSIGN_OR_RETURN(devopt.dgrad_slices,
                                carve("offload.grad_slices", 4 * placement.slices.dev_elements));
      }
    }
    if (placement.sharding.device_grads_sharded) {
      // Backward writes into bucket buffers, bound per bucket (open_buckets).
      for (std::uint32_t i = 0; i < placement.buckets.slots(settings); ++i) {
        STRATA_ASSIGN_OR_RETURN(std::uint32_t idx, arena.acquire_slot("offload.grad_buckets"));
        STRATA_ASSIGN_OR_RETURN(std::uint64_t off, arena.slot_offset("offload.grad_buckets", idx));
        devopt.buckets.bucket_buf.push_back(base + off);
      }
      devopt.buckets.bucket_buf_owner.assign(devopt.buckets.bucket_buf.size(), -1);
      devopt.buckets.bucket_buf_freed.assign(devopt.buckets.bucket_buf.size(), 0);
    } else {
      for (int u = 0; u < M; ++u)
        if (placement.device_state(u))
          bound_grads[static_cast<std::size_t>(u)] =
              reinterpret_cast<float*>(reinterpret_cast<char*>(devopt.dgrads) + grad_begin(u));
    }
    devopt.buckets.bucket_buf_of.assign(placement.buckets.buckets.size(), -1);
  }
  STRATA_RETURN_IF_ERROR(compute->memset_async(homes.resident, 0, placement.sizes.resident_bytes));
  for (int u = 0; u < M; ++u) STRATA_RETURN_IF_ERROR(bind(u));
  return ok_status();
}

Status OffloadEngine::Impl::carve_slots() {
  Device& dev = *device;
  Arena& arena = dev.memory();
  char* base = static_cast<char*>(arena.base());
  // Slots and buckets.
  fetcher.slot_of.assign(static_cast<std::size_t>(M), -1);
  grads.gslot_of.assign(static_cast<std::size_t>(M), -1);
  const bool any_nvme_home = placement.any_nvme_home();
  const bool any_psharded = placement.any_gathered_at_fetch();
  for (std::uint32_t s = 0; s < placement.sizes.param_slots; ++s) {
    ParamSlot slot;
    STRATA_ASSIGN_OR_RETURN(std::uint32_t idx, arena.acquire_slot("offload.param_slots"));
    STRATA_ASSIGN_OR_RETURN(std::uint64_t off, arena.slot_offset("offload.param_slots", idx));
    slot.dev = base + off;
    STRATA_ASSIGN_OR_RETURN(slot.fetched, dev.create_event());
    STRATA_ASSIGN_OR_RETURN(slot.free, dev.create_event());
    slot.early_ok = std::make_unique<std::atomic<bool>>(false);
    if (any_nvme_home || any_psharded) {
      STRATA_ASSIGN_OR_RETURN(
          slot.staging, HostMem::make(dev, true, placement.sizes.param_slot_bytes, "offload.fetch_staging"));
    }
    fetcher.pslots.push_back(std::move(slot));
  }
  for (std::uint32_t s = 0; s < placement.sizes.grad_slots; ++s) {
    GradSlot slot;
    STRATA_ASSIGN_OR_RETURN(std::uint32_t idx, arena.acquire_slot("offload.grad_slots"));
    STRATA_ASSIGN_OR_RETURN(std::uint64_t off, arena.slot_offset("offload.grad_slots", idx));
    slot.dev = reinterpret_cast<float*>(base + off);
    STRATA_ASSIGN_OR_RETURN(slot.done, dev.create_event());
    STRATA_ASSIGN_OR_RETURN(slot.free, dev.create_event());
    STRATA_ASSIGN_OR_RETURN(slot.ready, dev.create_event());
    grads.gslots.push_back(std::move(slot));
  }
  return ok_status();
}

Status OffloadEngine::Impl::table_owned_params() {
  const ModelLayout& L = layout();
  // Owning parameters.
  owned_of_unit.assign(static_cast<std::size_t>(M), {});
  for (std::size_t i = 0; i < L.params.size(); ++i) {
    const ParamDesc& p = L.params[i];
    if (!p.owns_storage() || !placement.units[static_cast<std::size_t>(p.module)].in_stage) continue;
    OwnedParam o;
    o.index = static_cast<int>(i);
    o.unit = p.module;
    o.decay = p.weight_decay;
    o.grad_in_unit = p.grad_offset - L.modules[static_cast<std::size_t>(p.module)].grad_begin;
    o.grad_offset = grad_begin(p.module) + o.grad_in_unit;
    o.param_in_unit = p.param_offset - param_begin(p.module);
    o.n = static_cast<std::size_t>(p.numel());
    owned_of_unit[static_cast<std::size_t>(p.module)].push_back(static_cast<int>(owned.size()));
    owned.push_back(o);
  }
  return ok_status();
}

// The host tiers: gradients, working-parameter copies, optimizer state, data-parallel staging,
// the NVMe ring and the swap store.
Status OffloadEngine::Impl::carve_host_tiers() {
  Device& dev = *device;
  const bool any_nvme_home = placement.any_nvme_home();
  const bool any_psharded = placement.any_gathered_at_fetch();
  // Host tiers.
  const bool pin = settings.pin_memory;
  if (!placement.sharding.optimizer_on_device) {
    grads_on_nvme = settings.gradients == Tier::kNvme;
    if (grads_on_nvme) {
      STRATA_ASSIGN_OR_RETURN(grads.grad_staging, HostMem::make(dev, true, placement.sizes.grad_slot_bytes,
                                                                "offload.grad_staging"));
      grads.landed_stats.assign(static_cast<std::size_t>(M), GradStats{});
    } else if (placement.sharding.host_state_sharded) {
      // Unsharded gradients only to carry stage 1's accumulation between micro-batches.
      if (settings.zero_stage < 2 && config.grad_accum > 1) {
        STRATA_ASSIGN_OR_RETURN(
            grads.host_grads,
            HostMem::make(dev, pin, placement.sizes.grad_bytes - placement.sizes.device_opt_bytes,
                          "offload.host_grads"));
      }
    } else {
      STRATA_ASSIGN_OR_RETURN(
          grads.host_grads,
          HostMem::make(dev, pin, placement.sizes.grad_bytes - placement.sizes.device_opt_bytes,
                        "offload.host_grads"));
    }
    STRATA_ASSIGN_OR_RETURN(homes.host_params,
                            HostMem::make(dev, pin, placement.sizes.host_params_held, "offload.host_params"));
    if (delayed) {
      // The delayed update's second version of every off-device unit (delayed_next, param_shard;
      // stage 3: of this rank's slice only, what write_param_slice writes).
      homes.param_shard.assign(static_cast<std::size_t>(M), 0);
      homes.next_fresh.assign(static_cast<std::size_t>(M), 0);
      if (placement.sizes.delayed_next_bytes > 0) {
        STRATA_ASSIGN_OR_RETURN(
            homes.delayed_next,
            HostMem::make(dev, pin, placement.sizes.delayed_next_bytes, "offload.delayed_next_params"));
      }
    }
    for (int u = 0; u < M; ++u) {
      std::unique_ptr<Event> e;
      STRATA_ASSIGN_OR_RETURN(e, dev.create_event());
      grads.landed.push_back(std::move(e));
      STRATA_ASSIGN_OR_RETURN(e, dev.create_event());
      homes.uploaded.push_back(std::move(e));
    }
    homes.uploaded_recorded.assign(static_cast<std::size_t>(M), 0);
    CpuOptimizerConfig oc;
    STRATA_ASSIGN_OR_RETURN(oc.isa, select_optimizer_isa(config.optimizer_isa));
    oc.threads = settings.host_threads > 0 ? settings.host_threads : dev.cpu_budget().host_threads;
    STRATA_ASSIGN_OR_RETURN(CpuOptimizer opt, CpuOptimizer::create(oc));
    host_opt = opt;
  }
  if (settings.optimizer == Tier::kHost) {
    const std::uint64_t bytes = placement.sharding.host_state_sharded
                                    ? 4 * placement.slices.shard_elements
                                    : placement.sizes.grad_bytes - placement.sizes.device_opt_bytes;
    STRATA_ASSIGN_OR_RETURN(host.host_master, HostMem::make(dev, pin, bytes, "offload.master"));
    STRATA_ASSIGN_OR_RETURN(host.host_m, HostMem::make(dev, pin, bytes, "offload.exp_avg"));
    STRATA_ASSIGN_OR_RETURN(host.host_v, HostMem::make(dev, pin, bytes, "offload.exp_avg_sq"));
  }
  if (placement.sharding.host_state_sharded) {
    const std::uint64_t P = static_cast<std::uint64_t>(comms.dp_size), c = placement.slices.max_chunk;
    const std::uint64_t w = half ? 2 : 4;
    if (!grads_on_nvme) {  // on NVMe: only this rank's slices' keys, through grad_staging
      STRATA_ASSIGN_OR_RETURN(grads.shard_grads, HostMem::make(dev, pin, 4 * placement.slices.shard_elements,
                                                               "offload.dp_grads"));
    }
    STRATA_ASSIGN_OR_RETURN(grads.rs_send, HostMem::make(dev, pin, 4 * P * c, "offload.dp_reduce"));
    STRATA_ASSIGN_OR_RETURN(grads.rs_recv, HostMem::make(dev, pin, 4 * c, "offload.dp_reduce"));
    STRATA_ASSIGN_OR_RETURN(host.ag_send, HostMem::make(dev, pin, w * c, "offload.dp_gather"));
    STRATA_ASSIGN_OR_RETURN(host.ag_recv, HostMem::make(dev, pin, w * P * c, "offload.dp_gather"));
    host.flagged_stats.assign(static_cast<std::size_t>(M) + 1, GradStats{});
    host.flagged_gathered.assign(static_cast<std::size_t>(comms.dp_size) * (static_cast<std::size_t>(M) + 1),
                                 GradStats{});
  }
  if (any_psharded) {
    const std::uint64_t P = static_cast<std::uint64_t>(comms.dp_size), c = placement.slices.max_chunk,
                        w = half ? 2 : 4;
    STRATA_ASSIGN_OR_RETURN(homes.fetch_send, HostMem::make(dev, true, w * c, "offload.dp_fetch"));
    STRATA_ASSIGN_OR_RETURN(homes.fetch_recv, HostMem::make(dev, true, w * P * c, "offload.dp_fetch"));
  }
  if (settings.optimizer == Tier::kNvme) {
    for (std::uint32_t r = 0; r < placement.sizes.ring_buffers; ++r) {
      STRATA_ASSIGN_OR_RETURN(
          HostMem h, HostMem::make(dev, true, placement.sizes.ring_buffer_bytes, "offload.optim_ring"));
      host.nvme.ring.push_back(std::move(h));
    }
    for (HostMem& h : host.nvme.param_out) {
      STRATA_ASSIGN_OR_RETURN(h,
                              HostMem::make(dev, true, placement.sizes.param_out_bytes, "offload.param_out"));
    }
  }
  if (any_nvme_home && settings.optimizer == Tier::kHost) {
    STRATA_ASSIGN_OR_RETURN(
        homes.param_out_staging,
        HostMem::make(dev, true, placement.sizes.param_slot_bytes, "offload.param_out_staging"));
  }
  if (any_nvme_home || settings.optimizer == Tier::kNvme) {
    IoEngineConfig ioc = settings.io;
    ioc.nvme_path = settings.nvme_path;
    if (dev.cpu_budget().pin) ioc.cpus = dev.cpu_budget().host;
    if (faults.io != nullptr) {
      STRATA_ASSIGN_OR_RETURN(io, nvme_detail::IoFaults::create_engine(ioc, &dev.pinned(), faults.io));
    } else {
      STRATA_ASSIGN_OR_RETURN(io, IoEngine::create(ioc, &dev.pinned()));
    }
    SwapStoreConfig sc;
    sc.dirs = settings.nvme_path;
    sc.capacity = plan.swap_bytes;
    sc.scratch = settings.nvme_scratch;
    STRATA_ASSIGN_OR_RETURN(swap, SwapStore::open(*io, sc));
  }
  return ok_status();
}

// The device optimizer's kernels and the stager of state access.
Status OffloadEngine::Impl::create_kernels() {
  Device& dev = *device;
  const ModelLayout& L = layout();
  STRATA_ASSIGN_OR_RETURN(launch, detail::KernelLauncher::create(dev, *compute, 0));
  std::uint64_t largest = 4096;
  for (const auto& p : L.params)
    largest = std::max<std::uint64_t>(largest, static_cast<std::uint64_t>(p.numel()) * 4);
  for (const partition::UnitPlacement& u : placement.units) largest = std::max(largest, u.param_bytes);
  STRATA_ASSIGN_OR_RETURN(
      stager, detail::HostStager::create(dev, *compute, std::min<std::uint64_t>(largest, 16u << 20),
                                         "offload.staging"));
  if (placement.sharding.optimizer_on_device || placement.sharding.optimizer_split) {
    if (launch->is_cpu()) {
      CpuOptimizerConfig oc;
      STRATA_ASSIGN_OR_RETURN(oc.isa, select_optimizer_isa(config.optimizer_isa));
      oc.threads = std::max(1, dev.info().compute_threads);
      STRATA_ASSIGN_OR_RETURN(CpuOptimizer opt, CpuOptimizer::create(oc));
      devopt.device_opt = opt;
    } else {
      STRATA_ASSIGN_OR_RETURN(
          devopt.cuda_partials,
          dev.allocate(
              (detail::sum_of_squares_cuda_partials(placement.sizes.grad_bytes / 4) + 1) * sizeof(double),
              "offload.norm"));
      STRATA_ASSIGN_OR_RETURN(devopt.pinned_norm, dev.pinned().allocate(sizeof(double), "offload.norm"));
    }
  }
  return ok_status();
}

Status OffloadEngine::Impl::setup_tensor_parallel() {
  if (comms.tp == nullptr || comms.tp->size() == 1) return ok_status();
  comms.tp_size = comms.tp->size();
  comms.tp_rank = comms.tp->rank();
  STRATA_ASSIGN_OR_RETURN(comms.tp_model, comms.tp->split(0, comms.tp_rank, "tp.model"));
  STRATA_ASSIGN_OR_RETURN(comms.tp_step, comms.tp->split(0, comms.tp_rank, "tp.step"));
  STRATA_ASSIGN_OR_RETURN(comms.tp_norm, comms.tp->split(0, comms.tp_rank, "tp.norm"));
  for (int r = 0; r < comms.tp_size; ++r) {
    STRATA_ASSIGN_OR_RETURN(ModelLayout l, describe_model(config.model, TensorParallel{comms.tp_size, r}));
    tp_layouts.push_back(std::move(l));
  }
  // The norm's element ranges per unit are the placement's (UnitPlacement::norm_ranges).
  return ok_status();
}

Status OffloadEngine::Impl::setup_data_parallel() {
  if (comms.dp == nullptr || comms.dp->size() == 1) return ok_status();
  comms.dp_size = comms.dp->size();
  comms.dp_rank = comms.dp->rank();
  STRATA_ASSIGN_OR_RETURN(comms.dp_caller, comms.dp->split(0, comms.dp_rank, "dp.step"));
  dp_tracks[0] = tracer.add_track("data parallel: step (caller)");
  if (placement.sharding.host_state_sharded) {
    STRATA_ASSIGN_OR_RETURN(comms.dp_grads, comms.dp->split(0, comms.dp_rank, "dp.grads"));
    STRATA_ASSIGN_OR_RETURN(comms.dp_params, comms.dp->split(0, comms.dp_rank, "dp.params"));
    dp_tracks[1] = tracer.add_track("data parallel: gradient reduce-scatter");
    dp_tracks[2] = tracer.add_track("data parallel: statistics and parameter all-gather");
  }
  if (placement.sharding.device_state_sharded) {
    // The compute stream's: the reduce-scatter, the statistics and the parameter all-gathers of
    // the device update (device_update_sharded), in unit order on every rank.
    STRATA_ASSIGN_OR_RETURN(comms.dp_params, comms.dp->split(0, comms.dp_rank, "dp.device_update"));
    dp_tracks[2] = tracer.add_track("data parallel: device update (reduce-scatter, statistics, all-gather)");
    devopt.shard_stats.assign(static_cast<std::size_t>(M), GradStats{});
    devopt.gathered_stats.assign(static_cast<std::size_t>(comms.dp_size * M), GradStats{});
  }
  if (placement.sharding.split_state_sharded) {
    // The compute stream's: the device units' reduce-scatters (every micro-batch at stage 2),
    // then their parameter all-gathers, in unit order on every rank.
    STRATA_ASSIGN_OR_RETURN(comms.dp_device, comms.dp->split(0, comms.dp_rank, "dp.device_update"));
    dp_tracks[3] = tracer.add_track("data parallel: device modules (reduce-scatter, all-gather)");
  }
  if (placement.sharding.device_grads_bucketed) {
    // The compute stream's gradient buckets, in bucket order on every rank.
    STRATA_ASSIGN_OR_RETURN(comms.dp_buckets, comms.dp->split(0, comms.dp_rank, "dp.buckets"));
    dp_tracks[1] = tracer.add_track(placement.sharding.device_grads_sharded
                                        ? "data parallel: gradient bucket reduce-scatter"
                                        : "data parallel: gradient bucket all-reduce");
  }
  // Stage 3 (UnitPlacement::gathered_at_fetch), in device memory too (the sliced units keep their
  // slice in offload.params and are gathered by the same fetch; with a pipeline the stage's units,
  // docs/parallel.md "Stages 2-3 in device memory with a pipeline").
  if ((placement.sharding.host_state_sharded && settings.zero_stage == 3) ||
      placement.sharding.device_params_sliced) {
    STRATA_ASSIGN_OR_RETURN(comms.dp_fetch, comms.dp->split(0, comms.dp_rank, "dp.fetch"));
    dp_tracks[3] = tracer.add_track("data parallel: parameter fetch all-gather");
  }
  gathered_sums.reserve(static_cast<std::size_t>(4 * comms.dp_size));
  return ok_status();
}

Status OffloadEngine::Impl::setup_pipeline() {
  if (comms.pp_size == 1) return ok_status();
  STRATA_ASSIGN_OR_RETURN(comms.pp_caller, comms.pp->split(0, comms.pp_rank, "pp.step"));
  STRATA_ASSIGN_OR_RETURN(comms.pp_norm, comms.pp->split(0, comms.pp_rank, "pp.norm"));
  STRATA_ASSIGN_OR_RETURN(comms.pp_stream, comms.pp->split(0, comms.pp_rank, "pp.stream"));
  // The tied unit (StageShape::tied_unit): held by the first stage (its own module) and by the
  // last (read by the head).
  const ModelLayout& L = layout();
  if (chunks > 1) {
    STRATA_ASSIGN_OR_RETURN(comms.pp_stream_grads, comms.pp->split(0, comms.pp_rank, "pp.stream_grads"));
  }
  if (placement.stage.tied_unit >= 0 &&
      placement.units[static_cast<std::size_t>(placement.stage.tied_unit)].holder_stage != 0) {
    return internal_error("pipeline: the tied unit '" +
                          L.modules[static_cast<std::size_t>(placement.stage.tied_unit)].name +
                          "' is not the first stage's");
  }
  if (placement.stage.tied_unit >= 0) {
    // The first and the last stage form one group; every other stage a group of its own (unused).
    const bool member = comms.pp_rank == 0 || comms.pp_rank == comms.pp_size - 1;
    STRATA_ASSIGN_OR_RETURN(comms.pp_tied,
                            comms.pp->split(member ? 0 : 1 + comms.pp_rank, comms.pp_rank, "pp.tied"));
    if (!member || !placement.units[static_cast<std::size_t>(placement.stage.tied_unit)].in_stage)
      comms.pp_tied.reset();
  }
  pp_stats.assign(static_cast<std::size_t>(M) + 1, GradStats{});  // + the failure flag (merge_stage_stats)
  pp_gathered.assign((static_cast<std::size_t>(M) + 1) * static_cast<std::size_t>(comms.pp_size),
                     GradStats{});
  const std::uint64_t boundary = boundary_bytes();
  // Interleaved: every stage sends and receives in both directions (a chunk's output goes to the
  // next stage, the last stage's to the first), one send buffer per (micro-batch, chunk).
  const bool both = chunks > 1;
  const bool to_next = both || comms.pp_rank + 1 < comms.pp_size, to_prev = both || comms.pp_rank > 0;
  auto add = [&](bool wanted, std::vector<ArenaBuffer>& to, const char* tag) -> Status {
    if (!wanted) return ok_status();
    STRATA_ASSIGN_OR_RETURN(ArenaBuffer b, device->allocate(boundary, tag));
    to.push_back(std::move(b));
    return ok_status();
  };
  for (std::int64_t a = 0; a < config.grad_accum * chunks; ++a) {
    STRATA_RETURN_IF_ERROR(add(to_next, pipe.act_send, "pipeline.send_activations"));
    STRATA_RETURN_IF_ERROR(add(to_prev, pipe.grad_send, "pipeline.send_gradients"));
  }
  for (int i = 0; i < partition::kPipelineRecvBuffers; ++i) {
    STRATA_RETURN_IF_ERROR(add(to_next, pipe.grad_recv, "pipeline.recv_gradients"));
    STRATA_RETURN_IF_ERROR(add(to_prev, pipe.act_recv, "pipeline.recv_activations"));
  }
  pipe.sends.reserve(static_cast<std::size_t>(2 * config.grad_accum * chunks));
  pipe.act_recv_work.resize(static_cast<std::size_t>(partition::kPipelineRecvBuffers));
  pipe.grad_recv_work.resize(static_cast<std::size_t>(partition::kPipelineRecvBuffers));
  return ok_status();
}

}  // namespace strata
