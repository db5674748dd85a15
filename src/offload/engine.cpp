// The offload engine (offload.hpp, docs/offload.md): the facade's step, in order. What each part
// owns is engine_impl.hpp's map; the placement is src/partition's; the streams and their events
// are engine_core.hpp's.
//
// Invariants (checked by tests/test_offload_engine.cpp): for every placement the parameters and
// optimizer state after N steps equal the all-device placement's bit for bit on the cpu backend;
// a unit is never read by compute while its update is pending (UpdateLedger); a slot is never
// refilled before compute has passed its last read (Fetcher); a bucket is never zeroed or
// restored before its previous copy out finished (GradientPath).
//
// Data parallel (docs/parallel.md). With the optimizer on the device, the step all-reduces the
// whole gradient after backward (ZeRO stage 0), or, stages 1-3 (dev_sharded), the device update
// reduce-scatters each unit's gradients, merges the per-unit statistics over the ranks and updates
// this rank's slice of master and moments (held sharded in the device regions optim.*), then
// all-gathers the unit's parameters (device_update_sharded). With the host optimizer, the state is sharded
// (internal.hpp's DpSlices): the gradient stream reduce-scatters each unit's final gradients into
// this rank's slice as the unit lands (overlapped with the rest of backward; stage 2 does it for
// every micro-batch and keeps no unsharded gradients), the optimizer thread all-gathers the
// per-unit norm statistics (merged in unit, then rank order: the same bits on every rank) and,
// after updating its slice of a unit, all-gathers the unit's updated parameters. Each of the
// three threads that talk (caller, gradient stream, optimizer thread) has its own Comm, split
// from the group, which it uses in the same order on every rank.
//
// Tensor parallel (docs/parallel.md "Tensor parallel"). The model, units, plan and optimizer state
// are this rank's shard (describe_model with {tp_size, tp_rank}); everything above works on it
// unchanged. The model's collectives run on the compute stream (tp.model); the gradient norm adds
// the sharded parameters' squares on every rank and the replicated ones on rank 0 (norm_ranges),
// merged over the group in rank order (tp.norm on the optimizer thread, tp.model in the device
// update); the state getters, weights and checkpoints gather full parameters (tp.step, caller).
// Sequence parallelism (settings.sequence_parallel) changes only the model: it sums the norms'
// parameter gradients over the group inside backward, so the replicated gradients the engine
// buckets, reduces, scans and updates are identical on every rank, as without it.
//
// Pipeline parallel (docs/parallel.md "Pipeline parallel"). A stage runs modules [stage_first,
// stage_end) (interleaved 1F1B: the v module ranges of chunk_ranges, chunks s, s + p, ...) and
// holds only the units they read (Units::in_stage; the others have no bytes, no
// plan lines, no NVMe keys, and count as updated every step). step() runs the schedule's
// forwards and backwards (run_pipeline) with the same per-module fetches and gradient buckets as
// one process, exchanging boundary tensors with the neighbouring stages; the gradient norm merges
// every stage's per-unit statistics in unit order (merge_stage_stats) and GPT-2's embedding unit,
// held by the first and the last stage, has its gradient summed between them before the update
// (gradients on NVMe: read back, summed, rescanned and written again, sum_tied_landed; the sharded
// device optimizer: its reduced slice, inside device_update_sharded).
// loss() and evaluate() run the forwards only through the stages (forward_stage) and broadcast
// the last stage's result. Weights and checkpoints are the single process's files: each stage
// reads the full state of the units it holds (the tied unit: the first stage's copy). Every
// rank writes the elements it holds into the one weights file at their offsets, the first
// stage's first rank its header and the rename (save_weights_parallel); a checkpoint's
// module files are written by each stage's first rank into the shared temporary directory, and
// the first stage's first rank publishes the manifest once every stage agreed its files are
// durable (save_checkpoint_pp); loading reads the files on every rank and keeps the stage's units.
//
// The TP x PP x DP grid (docs/parallel.md "Tensor x pipeline x data parallel"). Every stage is a
// tensor-parallel group of shard engines: the shard layout restricted to the stage's units. The
// groups of make_process_groups nest without extra code: the pp group holds the ranks of one tp
// and dp coordinate, so boundary tensors (the residual stream, replicated over tp) go from each
// tp rank to the same tp rank of the neighbouring stage, the tied unit's two ends hold the same
// wte shard and slice, and the loss is broadcast from the last stage of one's own pipeline. The
// norm merges per unit over dp, then over the stages in unit order (pp), then over tp in rank
// order: the same bits on every rank.
#include <time.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstring>
#include <deque>
#include <mutex>
#include <utility>

#include "device/backends.hpp"
#include "model/evaluate.hpp"
#include "offload/engine_impl.hpp"
#include "offload/internal.hpp"
#include "offload/regions.hpp"
#include "optim/grad_norm_cuda.hpp"
#include "strata/log.hpp"
#include "strata/pipeline_schedule.hpp"

namespace strata {

// ---- the passes ----------------------------------------------------------------------------------

Status OffloadEngine::Impl::keep_module_place(Status s) {
  if (s.ok() || !keep_modules) return s;
  if (pass_error.ok()) {
    STRATA_RETURN_IF_ERROR(compute->host_fn("offload: the stage's pass failed", [s]() { return s; }));
    STRATA_RETURN_IF_ERROR(model->set_failed_pass(true));
    pass_error = std::move(s);
  }
  return ok_status();
}

Status OffloadEngine::Impl::run_forward(bool for_backward, int chunk) {
  const auto [first, end] = placement.stage.chunk_ranges[static_cast<std::size_t>(chunk)];
  for (int m = first; m < end; ++m) {
    if (pass_error.ok()) {
      fetcher.note_access(m);
      STRATA_RETURN_IF_ERROR(keep_module_place(fetcher.access_params(m)));
    }
    if (!pass_error.ok()) {  // keep_modules after a failure: the model's work alone
      STRATA_RETURN_IF_ERROR(model->forward_module(m, for_backward));
      continue;
    }
    STRATA_RETURN_IF_ERROR(tracer.stream_begin(*compute, track.compute));
    STRATA_RETURN_IF_ERROR(model->forward_module(m, for_backward));
    STRATA_RETURN_IF_ERROR(tracer.stream_end(*compute, track.compute, TraceCounter::kCompute,
                                             for_backward ? "forward" : "forward (no grad)", m));
    if (faults.hold_forward == m) {
      STRATA_RETURN_IF_ERROR(compute->host_fn("offload: test hold's forward", [this, at = now.steps]() {
        {
          std::lock_guard<std::mutex> lock(ledger.mu);
          ledger.forward_ran_at = std::max(ledger.forward_ran_at, at);
        }
        ledger.cv.notify_all();
        return ok_status();
      }));
    }
    STRATA_RETURN_IF_ERROR(keep_module_place(fetcher.release_after(m)));
  }
  return ok_status();
}

Status OffloadEngine::Impl::run_backward(float dloss, bool first_micro, bool last_micro, std::int64_t step,
                                         double lr, int chunk) {
  const auto [first, end] = placement.stage.chunk_ranges[static_cast<std::size_t>(chunk)];
  for (int m = end - 1; m >= first; --m) {
    if (pass_error.ok()) {
      fetcher.note_access(M + m);
      Status before = fetcher.access_params(m);
      if (before.ok()) before = grads.acquire_grads(m, first_micro);
      if (before.ok() && placement.sharding.device_grads_sharded) before = devopt.buckets.open_buckets(m);
      STRATA_RETURN_IF_ERROR(keep_module_place(std::move(before)));
    }
    if (!pass_error.ok()) {  // keep_modules after a failure: the model's work and the collectives alone
      STRATA_RETURN_IF_ERROR(model->backward_module(m, dloss));
      STRATA_RETURN_IF_ERROR(grads.reduce_after_failure(m, first_micro, last_micro, step));
      continue;
    }
    STRATA_RETURN_IF_ERROR(tracer.stream_begin(*compute, track.compute));
    STRATA_RETURN_IF_ERROR(model->backward_module(m, dloss));
    STRATA_RETURN_IF_ERROR(tracer.stream_end(*compute, track.compute, TraceCounter::kCompute, "backward", m));
    Status after = grads.release_grads(m, first_micro, last_micro, step, lr);
    if (after.ok() && placement.sharding.device_grads_bucketed)
      after = devopt.buckets.close_buckets(m, first_micro, last_micro, step);
    if (after.ok()) after = fetcher.release_after(m);
    STRATA_RETURN_IF_ERROR(keep_module_place(std::move(after)));
  }
  return ok_status();
}

Status OffloadEngine::Impl::run_micro_batches(std::span<const std::int32_t> inputs,
                                              std::span<const std::int32_t> targets, std::int64_t micro,
                                              bool update, std::int64_t step, double lr) {
  const std::int64_t B = config.micro_batch, T = config.seq_len;
  const auto per = static_cast<std::size_t>(B * T);
  if (inputs.size() != per * static_cast<std::size_t>(micro) || targets.size() != inputs.size()) {
    return invalid_argument("train step: expected " + std::to_string(per * static_cast<std::size_t>(micro)) +
                            " inputs and targets (" + std::to_string(micro) + " micro-batches of " +
                            std::to_string(B) + " x " + std::to_string(T) + "), got " +
                            std::to_string(inputs.size()) + " and " + std::to_string(targets.size()));
  }
  std::int64_t count = 0;
  for (auto t : targets) count += t >= 0 ? 1 : 0;
  if (comms.dp_size > 1) {  // the loss is the mean over every rank's tokens
    double global = static_cast<double>(count);
    STRATA_RETURN_IF_ERROR(sum_over_ranks(std::span<double>(&global, 1)));
    count = static_cast<std::int64_t>(global);
  }
  if (count == 0) return invalid_argument("train step: every target is ignored (negative)");
  // grad_sharded: the slices are written, not added to, by each step's first micro-batch.
  if (placement.sharding.optimizer_on_device && !placement.sharding.device_grads_sharded)
    STRATA_RETURN_IF_ERROR(compute->memset_async(devopt.dgrads, 0, devopt.dgrad_bytes));
  if (placement.sharding.device_grads_bucketed) {
    STRATA_RETURN_IF_ERROR(devopt.buckets.discard());
  }
  if (placement.sharding.optimizer_split)
    STRATA_RETURN_IF_ERROR(compute->memset_async(devopt.dgrads, 0, placement.sizes.device_opt_bytes));
  // fp16: the loss gradient carries the loss scale (a power of two, so the product is exact).
  const float dloss = (1.0f / static_cast<float>(count)) * static_cast<float>(update ? now.loss_scale : 1.0);
  if (comms.pp_size > 1) {
    STRATA_RETURN_IF_ERROR(run_pipeline(inputs, targets, micro, dloss, update ? step : 0, lr));
    if (!placement.sharding.split_state_sharded || !update) return ok_status();
    // Partial offload with data parallelism, stages 0-1: the device units' sums over the
    // schedule's micro-batches, reduce-scattered once as below, after every pipeline transfer of
    // the step (run_pipeline drained the stream). Stage 2 reduced each micro-batch inside the
    // schedule (run_pipeline) into offload.grad_slices.
    if (settings.zero_stage < 2) STRATA_RETURN_IF_ERROR(devopt.reduce_device_units(/*accumulate=*/false));
    if (comms.pp_tied && placement.split_device(placement.stage.tied_unit)) {
      // The tied unit's reduced slice summed with the other end's (the same slice of the same
      // unit), as sum_tied_landed sums a host unit's, before scan_device_units reads it.
      STRATA_RETURN_IF_ERROR(compute->synchronize());
      STRATA_RETURN_IF_ERROR(
          reduce_tied_grads(devopt.dev_slice_grads(placement.stage.tied_unit),
                            placement.units[static_cast<std::size_t>(placement.stage.tied_unit)].slice.len));
    }
    return ok_status();
  }
  // Partial offload with data parallelism: stage 2 reduces the device units' gradients of every
  // micro-batch on their own (each starts from zero, as ratio 1's buckets do); stage 1 reduces
  // their sum once, after the last micro-batch.
  const bool reduce_each = placement.sharding.split_state_sharded && settings.zero_stage >= 2;
  for (std::int64_t a = 0; a < micro; ++a) {
    STRATA_RETURN_IF_ERROR(
        model->set_batch(inputs.subspan(a * per, per), targets.subspan(a * per, per), B, T));
    fetcher.cyclic = a + 1 < micro;
    fetcher.begin_pass();
    if (reduce_each && a > 0)
      STRATA_RETURN_IF_ERROR(compute->memset_async(devopt.dgrads, 0, placement.sizes.device_opt_bytes));
    STRATA_RETURN_IF_ERROR(run_forward(true));
    STRATA_RETURN_IF_ERROR(model->copy_losses(static_cast<int>(a)));
    STRATA_RETURN_IF_ERROR(run_backward(dloss, a == 0, a + 1 == micro, update ? step : 0, lr));
    if (placement.sharding.split_state_sharded && (reduce_each || a + 1 == micro))
      STRATA_RETURN_IF_ERROR(devopt.reduce_device_units(/*accumulate=*/reduce_each && a > 0));
    STRATA_RETURN_IF_ERROR(fetcher.end_pass());
  }
  fetcher.cyclic = false;
  return ok_status();
}

void OffloadEngine::Impl::reset_pass_state() {
  fetcher.reset();
  grads.reset();
}

Status OffloadEngine::Impl::wait_all_updates(bool publish) {
  STRATA_RETURN_IF_ERROR(host.recover());
  for (int u = 0; u < M; ++u) STRATA_RETURN_IF_ERROR(ledger.wait_updated(u));
  if (publish) STRATA_RETURN_IF_ERROR(homes.publish_delayed());
  if (!placement.sharding.optimizer_on_device) STRATA_RETURN_IF_ERROR(h2d->synchronize());
  return ok_status();
}

Status OffloadEngine::Impl::sum_over_ranks(std::span<double> values) {
  const std::size_t n = values.size();
  gathered_sums.resize(n * static_cast<std::size_t>(comms.dp_size));
  STRATA_RETURN_IF_ERROR(dp_wait(
      dp_tracks[0], comms.dp_caller->all_gather(values.data(), gathered_sums.data(), 2 * n, DType::kF32),
      "sum over ranks", -1, gathered_sums.size() * 8));
  for (std::size_t i = 0; i < n; ++i) {
    double total = 0.0;
    for (int r = 0; r < comms.dp_size; ++r) total += gathered_sums[static_cast<std::size_t>(r) * n + i];
    values[i] = total;
  }
  return ok_status();
}

// ---- OffloadEngine ----------------------------------------------------------------------------

OffloadEngine::OffloadEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

OffloadEngine::~OffloadEngine() {
  if (!impl_) return;
  impl_->host.stop_worker();
  if (impl_->device != nullptr) {
    Status s = impl_->device->synchronize();
    if (!s.ok()) {
      STRATA_LOG(kWarn, kOffload) << "offload engine: unreported error at destruction: " << s.to_string();
    }
  }
}

Result<std::unique_ptr<OffloadEngine>> OffloadEngine::create(const TrainerConfig& config,
                                                             const OffloadSettings& settings, Device& device,
                                                             Stream* compute, Comm* data_parallel,
                                                             Comm* tensor_parallel, Comm* pipeline) {
  return create_with_faults(config, settings, device, compute, data_parallel, tensor_parallel, pipeline,
                            nullptr);
}

namespace {

// What tensor parallelism supports today; the errors say what to use instead.
Status check_tensor_parallel_placement(const OffloadSettings& s, Device& device) {
  const std::string ranks = " with tensor_parallel_size = " + std::to_string(s.tp_size);
  // Gradients on NVMe train: each rank's shard's gradients (or its dp slice of them) on its own
  // keys, scanned with scan_norm's tensor-parallel rule on the way out.
  // Partial optimizer offload trains: the device units' scan is scan_norm too (replicated
  // parameters on tp rank 0 only), merged with the host units' before merge_over_tp. The delayed
  // update trains too (each tp rank publishes its shard's update at the same point of its step).
  if (device.info().kind == DeviceKind::kCuda) {
    // The model's collectives reduce device buffers (nccl), while the norm statistics and the
    // parameter gathers reduce host buffers, which need an mpi group beside it.
    return invalid_argument(
        "tensor parallel on the cuda backend" + ranks +
        " is not built yet (the engine's host-buffer collectives need an mpi group beside "
        "the nccl one); use the cpu backend");
  }
  return ok_status();
}

// Sequence parallelism splits a tensor-parallel group's tokens; the errors name the keys.
Status check_sequence_parallel(const TrainerConfig& config, const OffloadSettings& s) {
  if (!s.sequence_parallel) return ok_status();
  const std::string tp = "strata.tensor_parallel_size = " + std::to_string(s.tp_size);
  if (s.tp_size < 2) {
    return invalid_argument(
        "strata.sequence_parallel = true splits the tokens over the tensor-parallel group, but " + tp +
        ": set tensor_parallel_size > 1 or sequence_parallel false");
  }
  if (config.seq_len % s.tp_size != 0) {
    return invalid_argument("strata.sequence_parallel: seq_len = " + std::to_string(config.seq_len) +
                            " is not a multiple of " + tp +
                            " (each rank keeps 1/tensor_parallel_size of the token rows)");
  }
  // With a pipeline (interleaved too) each tp rank sends its rows of the boundary tensors to the
  // same tp rank of the neighbour stage (boundary_bytes); with activation offload each rank
  // offloads its rows.
  return ok_status();
}

// What data parallelism supports today; the errors say what to use instead.
Status check_data_parallel(const OffloadSettings& s, Device& device, const Comm& dp) {
  const std::string ranks = std::to_string(s.dp_size) + " data-parallel ranks";
  // Gradients on NVMe: each rank's reduced slices on its own NVMe keys (reduce_unit_grads), also
  // with tensor and pipeline parallelism.
  if (s.optimizer == Tier::kDevice && s.zero_stage >= 1) {
    // Sharded device optimizer state (docs/parallel.md "ZeRO stages 1-3 in device memory").
    const std::string what = "zero_optimization.stage " + std::to_string(s.zero_stage) +
                             " with the optimizer on the device and " + ranks;
    const std::string instead =
        "use stage 0 (gradients all-reduced, state replicated) or offload_optimizer.device "
        "cpu (state sharded over the ranks' host memory)";
    if (device.info().kind != DeviceKind::kCpu) {
      return invalid_argument(
          what + " on the " + std::string(device.info().name) +
          " device is not built yet (its collectives would run on device buffers over nccl, "
          "untested); " +
          instead);
    }
    // With tensor and pipeline parallelism: the device update merges the statistics over the
    // stages and the tp group and sums the tied embedding's slices (device_update_sharded).
  }
  if (s.optimizer != Tier::kDevice && s.optimizer_ratio < 1.0 && device.info().kind != DeviceKind::kCpu) {
    // The device modules' reduce-scatters and all-gathers run in compute-stream host functions
    // over host-buffer collectives (as the sharded device optimizer's): the cpu backend's.
    return invalid_argument(
        "zero_optimization.offload_optimizer.ratio = " + std::to_string(s.optimizer_ratio) + " with " +
        ranks + " on the " + std::string(device.info().name) +
        " device is not built yet (the device modules' collectives run on the cpu backend "
        "only); use ratio 1 or the cpu device");
  }
  // The optimizer on the device reduces device buffers; the host optimizer reduces host buffers.
  const bool device_buffers = s.optimizer == Tier::kDevice && device.info().kind == DeviceKind::kCuda;
  const CommBackend want = device_buffers ? CommBackend::kNccl : CommBackend::kMpi;
  if (dp.backend() != want) {
    return invalid_argument("data-parallel group '" + dp.name() + "' uses the " +
                            std::string(to_string(dp.backend())) + " backend, but this placement reduces " +
                            (device_buffers ? "device" : "host") + " buffers: it needs " +
                            std::string(to_string(want)));
  }
  return ok_status();
}

// What pipeline parallelism supports today (docs/parallel.md "Pipeline parallel"); the errors
// say what to use instead.
Status check_pipeline(Device& device, const Comm& pp) {
  const std::string stages = std::to_string(pp.size()) + " pipeline stages";
  if (device.info().kind != DeviceKind::kCpu) {
    return invalid_argument(
        stages + " on the " + std::string(device.info().name) +
        " device: the pipeline runs on the cpu device backend so far (its boundary tensors go "
        "over the mpi backend); use --device cpu");
  }
  if (pp.backend() != CommBackend::kMpi) {
    return invalid_argument("pipeline group '" + pp.name() + "' uses the " +
                            std::string(to_string(pp.backend())) +
                            " backend; the cpu device's pipeline needs mpi");
  }
  // Gradients on NVMe train: the stage's units' keys only; the tied embedding's are read back,
  // summed with the other end's and written again (sum_tied_landed).
  return ok_status();
}

// Interleaved 1F1B (strata.pipeline_virtual_stages = v > 1): what it needs and what is not built
// with it yet (docs/parallel.md "Schedules"). Each error names the key and value.
Status check_virtual_stages(const TrainerConfig& config, const OffloadSettings& s, int pp_size) {
  const int v = s.pipeline_virtual_stages;
  if (v == 1) return ok_status();
  const std::string key = "strata.pipeline_virtual_stages = " + std::to_string(v);
  if (v < 1) return invalid_argument(key + " must be at least 1");
  if (pp_size < 2) {
    return invalid_argument(
        key +
        " interleaves the chunks of a pipeline and needs strata.pipeline_parallel_size > 1 "
        "(this engine has no pipeline group, or one of size 1): set it to 1");
  }
  // Tensor parallelism needs nothing of its own either: a chunk's modules run their tp
  // collectives in compute-stream order, the same chunk order on every tp rank of the stage, and
  // each tp rank exchanges the (replicated) boundary tensors with the same tp rank of its
  // neighbours, as without interleaving (docs/parallel.md "Tensor × pipeline × data parallel").
  // Gradients on NVMe need nothing of their own: every landing and restore goes through the one
  // grad_staging in gradient-stream order, whichever chunk's backward issues it, and the tied
  // unit's final gradient is summed after the schedule (sum_tied_landed), as with one chunk.
  // Data parallelism needs nothing of its own: the ranks of one dp group are the same stage and
  // run the same op list, so their per-unit reductions (issued as each unit's last micro-batch
  // backward releases it) come in the same order on every rank (docs/parallel.md "Interleaved
  // 1F1B with data parallelism").
  // Activation offload needs nothing of its own: the model's per-chunk slots share one ring and
  // one set of host copies per slot, used by one chunk at a time (docs/offload.md "Activation
  // offload").
  if (s.pipeline_schedule != PipelineSchedule::kOneFOneB) {
    return invalid_argument(key + " runs interleaved 1F1B; strata.pipeline_schedule = " +
                            std::string(to_string(s.pipeline_schedule)) + " with it is not built: use 1f1b");
  }
  STRATA_RETURN_IF_ERROR(partition::check_interleaved_micro_batches(v, pp_size, config.grad_accum));
  STRATA_ASSIGN_OR_RETURN(ModelLayout layout, describe_model(config.model));
  const auto modules = static_cast<int>(layout.modules.size());
  if (v * pp_size > modules) {
    return invalid_argument(key + " with strata.pipeline_parallel_size = " + std::to_string(pp_size) + ": " +
                            std::to_string(v * pp_size) + " chunks, but the model has " +
                            std::to_string(modules) +
                            " modules (every chunk needs one): lower pipeline_virtual_stages");
  }
  return ok_status();
}

}  // namespace

Result<std::unique_ptr<OffloadEngine>> OffloadEngine::create_with_faults(
    const TrainerConfig& config, const OffloadSettings& settings_in, Device& device, Stream* compute,
    Comm* data_parallel, Comm* tensor_parallel, Comm* pipeline, const nvme_detail::IoFaults* faults) {
  OffloadSettings settings = settings_in;
  if (data_parallel != nullptr) settings.dp_size = data_parallel->size();
  if (tensor_parallel != nullptr) settings.tp_size = tensor_parallel->size();
  const int pp_size = pipeline != nullptr ? pipeline->size() : 1;
  if (settings.tp_size > 1) {
    if (tensor_parallel == nullptr) {
      return invalid_argument(
          "offload settings: tp_size = " + std::to_string(settings.tp_size) +
          " needs the tensor-parallel group (the Comm argument of OffloadEngine::create)");
    }
    STRATA_RETURN_IF_ERROR(check_tensor_parallel(config.model, settings.tp_size));
    STRATA_RETURN_IF_ERROR(check_tensor_parallel_placement(settings, device));
  }
  STRATA_RETURN_IF_ERROR(check_sequence_parallel(config, settings));
  settings.pipeline_bounds.clear();
  settings.pp_stage = 0;
  STRATA_RETURN_IF_ERROR(check_virtual_stages(config, settings, pp_size));
  if (pp_size > 1) {
    STRATA_RETURN_IF_ERROR(check_pipeline(device, *pipeline));
    STRATA_ASSIGN_OR_RETURN(
        settings.pipeline_bounds,
        pipeline_stages(config.model, pp_size * settings.pipeline_virtual_stages, config.seq_len));
    settings.pp_stage = pipeline->rank();
    settings.update_during_backward = false;  // the norm needs every stage's gradients
  }
  if (settings.dp_size > 1) {
    if (data_parallel == nullptr) {
      return invalid_argument("offload settings: dp_size = " + std::to_string(settings.dp_size) +
                              " needs the data-parallel group (the Comm argument of OffloadEngine::create)");
    }
    STRATA_RETURN_IF_ERROR(check_data_parallel(settings, device, *data_parallel));
  }
  STRATA_ASSIGN_OR_RETURN(OffloadPlan plan, OffloadPlan::make(config, settings));
  STRATA_RETURN_IF_ERROR(plan.check_fits(device, settings));
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->settings = settings;
  impl->comms.dp = data_parallel;
  impl->comms.tp = tensor_parallel;
  impl->comms.pp = pp_size > 1 ? pipeline : nullptr;
  impl->comms.pp_size = pp_size;
  impl->comms.pp_rank = pp_size > 1 ? pipeline->rank() : 0;
  impl->plan = std::move(plan);
  impl->device = &device;
  impl->compute = compute;
  impl->faults.io = faults;
  std::unique_ptr<OffloadEngine> engine(new OffloadEngine(std::move(impl)));
  STRATA_RETURN_IF_ERROR(engine->impl_->setup());
  return engine;
}

const OffloadPlan& OffloadEngine::plan() const { return impl_->plan; }
const OffloadSettings& OffloadEngine::settings() const { return impl_->settings; }
const TrainerConfig& OffloadEngine::config() const { return impl_->config; }
Model& OffloadEngine::model() { return *impl_->model; }
std::int64_t OffloadEngine::steps_done() const { return impl_->now.steps; }

std::string OffloadEngine::optimizer_name() const {
  const Impl& t = *impl_;
  if (!t.placement.sharding.optimizer_on_device) {
    return std::string("CPU AdamW (") + std::string(to_string(t.host_opt->isa())) + ", " +
           std::to_string(t.host_opt->threads()) + " host threads) over " +
           std::string(to_string(t.settings.optimizer)) + "-tier state";
  }
  if (t.launch->is_cpu()) {
    return std::string("CPU AdamW (") + std::string(to_string(t.devopt.device_opt->isa())) +
           ") on the device's compute threads";
  }
  return "fused AdamW on the GPU (fused_adam_cuda)";
}

Result<StepMetrics> OffloadEngine::step(std::span<const std::int32_t> inputs,
                                        std::span<const std::int32_t> targets) {
  auto r = step_once(inputs, targets);
  if (!r.ok()) impl_->ledger.note_reported();  // the next call retries a failed update (recover)
  return r;
}

// The step in order; long because the order is the contract (docs/offload.md "One step"): every
// stream's errors surface before the update may run, the optimizer thread hears of the step
// before the caller waits for its norm, and the loss is reported once the step has happened.
Result<StepMetrics> OffloadEngine::step_once(std::span<const std::int32_t> inputs,
                                             std::span<const std::int32_t> targets) {
  Impl& t = *impl_;
  // A failed update of an earlier step is reported, or finished in place (FailedUpdate).
  STRATA_RETURN_IF_ERROR(t.host.recover());
  detail::HostSpan step_span(t.tracer, t.track.caller, TraceCounter::kNone, "step");
  const auto start = std::chrono::steady_clock::now();
  StepMetrics m;
  m.step = t.now.steps + 1;
  // Skipped fp16 steps advance neither the optimizer's update number nor the schedule.
  const std::int64_t applied = t.now.steps - t.skipped_steps();
  m.lr = t.config.schedule.at(applied);
  m.loss_scale = t.scaler ? t.scaler->scale() : 1.0;
  t.now.opt_step = applied + 1;
  t.now.loss_scale = m.loss_scale;
  // Delayed update: the update of a warm-up step (the first delayed_update_warmup) is seen by
  // the next step, like a flush (synchronize, a checkpoint, an evaluation).
  // A step every rank failed before its update runs again at the same parameters on every rank:
  // a rank whose failed call skipped the publish its peers made catches up first.
  if (t.delayed && t.homes.pending_publish > 0 &&
      (t.homes.pending_publish <= t.settings.delayed_update_warmup || t.homes.publish_before_rerun)) {
    STRATA_RETURN_IF_ERROR(t.homes.publish_delayed());
  }
  Status s = t.run_micro_batches(inputs, targets, t.config.grad_accum, true, m.step, m.lr);
  if (s.ok() && t.placement.sharding.optimizer_split) s = t.devopt.scan_device_units();
  if (t.placement.sharding.optimizer_on_device) {
    // Gradient buckets (stage 0 and stage >= 2 on the cpu backend, with or without a pipeline;
    // each tp rank's shard): their collectives were launched during backward; every
    // one is waited (and stage >= 2's slices complete) before the update.
    if (s.ok() && t.placement.sharding.device_grads_bucketed)
      s = t.compute->host_fn("offload: wait for the gradient buckets",
                             [&t]() { return t.devopt.buckets.drain_buckets(); });
    // Stage 1: the device update reduce-scatters the gradients itself; stage 0 without buckets
    // (cuda): one all-reduce after backward.
    if (s.ok() && t.comms.dp_size > 1 && !t.placement.sharding.device_state_sharded &&
        !t.placement.sharding.device_grads_bucketed)
      s = t.devopt.all_reduce_device_grads();
    // Pipeline: the tied embedding's gradient of the first and last stage (sharded: its reduced
    // slices, summed inside device_update_sharded).
    if (s.ok() && t.comms.pp_tied && !t.placement.sharding.device_state_sharded) {
      s = t.compute->synchronize();
      if (s.ok())
        s = t.reduce_tied_grads(
            reinterpret_cast<float*>(reinterpret_cast<char*>(t.devopt.dgrads) +
                                     t.grad_begin(t.placement.stage.tied_unit)),
            t.placement.units[static_cast<std::size_t>(t.placement.stage.tied_unit)].grad_bytes / 4);
    }
    // Stage 3 in device memory: every fetch (a prefetch the pass did not use included) has read
    // its slice before the update rewrites the slices, and a failed fetch fails the step here.
    if (s.ok() && t.placement.sharding.device_params_sliced) s = t.h2d->synchronize();
    if (s.ok()) s = t.tracer.stream_begin(*t.compute, t.track.compute);
    if (s.ok()) s = t.devopt.device_update(m.lr, t.now.opt_step);
    if (s.ok())
      s = t.tracer.stream_end(*t.compute, t.track.compute, TraceCounter::kCompute, "optimizer step", -1);
    if (s.ok()) s = t.compute->synchronize();
    if (!s.ok()) return t.abandon_pass(s);
  } else {
    // Every stream's errors surface before the step's update may run: a failed fetch or copy
    // aborts the step and leaves parameters and optimizer state as they were.
    if (s.ok()) s = t.compute->synchronize();
    if (s.ok()) s = t.h2d->synchronize();
    if (s.ok()) s = t.gstream->synchronize();
    // Several processes: a gradient read or write error kept while the gradient stream went on
    // (its reduce-scatters are every rank's); the step fails here, agreed with the norm.
    if (s.ok()) s = t.grads.take_grad_io_error();
    if (s.ok() && !t.faults.pass_error.ok()) s = std::exchange(t.faults.pass_error, ok_status());
    // Delayed update: compute is done with the parameters of this step; the previous step's
    // update (which this step did not see) goes to the device now, before this step's update
    // may rewrite the host copy it is uploaded from (await_upload).
    if (s.ok() && t.delayed) s = t.homes.publish_delayed();
    {
      std::lock_guard<std::mutex> lock(t.ledger.mu);
      t.ledger.commands.push_back(
          offload_detail::Command{s.ok() ? offload_detail::Command::kFinish : offload_detail::Command::kAbort,
                                  -1, m.step, m.lr, t.now.opt_step, t.now.loss_scale});
      // Several processes: the optimizer thread agrees on the failure with the other ranks,
      // which wait for this rank's statistics (agree_before_norm).
      // Not after an agreed failure of an earlier update (every rank's call failed on it alike
      // and the optimizer thread skips the kAbort).
      if (!s.ok() && t.agree_before_norm() && t.ledger.worker_error.ok()) t.ledger.abort_error = s;
    }
    t.ledger.cv.notify_all();
    if (!s.ok()) {
      // Let the optimizer thread drain this step's landed units before the caller retries.
      s = t.abandon_pass(s);
      t.ledger.drain();
      if (t.agree_before_norm()) {
        std::lock_guard<std::mutex> lock(t.ledger.mu);
        const bool this_step = !t.ledger.worker_error.ok() && t.ledger.failed.cmd.step == m.step;
        // Every rank failed this step before its update (agreed): the peers whose pass went
        // through published the previous update, this call did not; the rerun publishes first.
        if (this_step && t.ledger.failed.phase == offload_detail::FailPhase::kBeforeUpdate && t.delayed &&
            t.homes.pending_publish > 0)
          t.homes.publish_before_rerun = true;
        // Agreed but not retryable (update_during_backward): the verdict every rank reports,
        // which names this rank's cause and what to do.
        if (this_step && t.ledger.failed.phase == offload_detail::FailPhase::kNone)
          return t.ledger.worker_error;
      }
      return s;
    }
    std::unique_lock<std::mutex> lock(t.ledger.mu);
    detail::HostSpan wait_span(t.tracer, t.track.caller, TraceCounter::kUpdateStall, "wait gradient norm");
    t.ledger.cv.wait(lock, [&] { return !t.ledger.worker_error.ok() || t.ledger.norm_step == m.step; });
    // Once the norm is known the step has happened; an error of its update (after the norm)
    // belongs to the update and surfaces at the next call.
    if (t.ledger.norm_step != m.step) return t.ledger.worker_error;
    t.grad_norm = t.ledger.norm_value;
    if (t.delayed) t.homes.pending_publish = m.step;
    lock.unlock();
    // Partial offload: a finite norm applies the step on the device units too (an fp16 overflow
    // skips it everywhere; any other non-finite norm failed on the optimizer thread).
    if (t.placement.sharding.optimizer_split && std::isfinite(t.grad_norm)) {
      s = t.tracer.stream_begin(*t.compute, t.track.compute);
      if (s.ok())
        s = t.devopt.update_device_units(m.lr, t.now.opt_step, t.update_scale(t.grad_norm, t.now.loss_scale));
      if (s.ok())
        s = t.tracer.stream_end(*t.compute, t.track.compute, TraceCounter::kCompute,
                                "optimizer step (device modules)", -1);
      if (!s.ok()) return s;
    }
  }
  if (t.scaler) {
    // Every unit skipped or every unit updated; either way the scaler moves (and fails the step
    // when the scale is already at fp16.min_loss_scale and still overflows, as DeepSpeed raises).
    m.skipped = !std::isfinite(t.grad_norm);
    auto applied_now = t.scaler->update(m.skipped);
    if (!applied_now.ok()) return applied_now.status().with_context("step " + std::to_string(m.step));
  }
  LossSum total;
  for (int a = 0; a < static_cast<int>(t.config.grad_accum); ++a) {
    const LossSum ls = t.model->loss_sum(a);
    total.sum += ls.sum;
    total.count += ls.count;
  }
  if (t.comms.dp_size > 1) {
    double sums[2] = {total.sum, static_cast<double>(total.count)};
    STRATA_RETURN_IF_ERROR(t.sum_over_ranks(sums));
    total.sum = sums[0];
    total.count = static_cast<std::int64_t>(sums[1]);
  }
  if (t.comms.pp_size > 1) {
    // The last stage computed the losses; every stage reports them (its bits, moved as words).
    double sums[2] = {total.sum, static_cast<double>(total.count)};
    STRATA_RETURN_IF_ERROR(t.comms.pp_caller->broadcast(sums, 4, DType::kF32, t.comms.pp_size - 1)
                               .wait()
                               .with_context("pipeline: broadcast of the loss from the last stage"));
    total.sum = sums[0];
    total.count = static_cast<std::int64_t>(sums[1]);
  }
  t.now.steps += 1;
  if (!t.have_baseline) {
    // Not published: a delayed update stays delayed (its upload allocates nothing). An error of
    // the update is not this step's (its norm is known): the next call reports it, and the
    // baseline is taken after a later step.
    bool settled = true;
    for (int u = 0; u < t.M && settled; ++u) settled = t.ledger.wait_updated(u, /*report=*/false).ok();
    if (settled && !t.placement.sharding.optimizer_on_device) settled = t.h2d->synchronize().ok();
    if (settled) {
      t.alloc_baseline = t.allocation_count();
      t.have_baseline = true;
    }
  }
  // The next pass's first fetches, each gated on the h2d stream by its unit's update of this step.
  // The step has happened; a failure to enqueue them surfaces at the next call's first wait.
  if (Status early = t.fetcher.prefetch_next_step(); !early.ok()) {
    STRATA_LOG(kWarn, kOffload) << "offload: early fetch for the next step not issued: " << early.to_string();
  }
  m.loss = total.sum / static_cast<double>(total.count);
  m.grad_norm = t.grad_norm;
  m.tokens = static_cast<std::int64_t>(inputs.size()) * t.comms.dp_size;
  m.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return m;
}

Result<double> OffloadEngine::loss_and_gradients(std::span<const std::int32_t> inputs,
                                                 std::span<const std::int32_t> targets) {
  Impl& t = *impl_;
  if (!t.placement.sharding.optimizer_on_device) {
    return failed_precondition("loss_and_gradients: needs the optimizer (and gradients) on the device");
  }
  STRATA_RETURN_IF_ERROR(t.single_stage("loss_and_gradients"));
  if (t.placement.sharding.device_grads_sharded) {
    return failed_precondition(
        "loss_and_gradients: with zero_optimization.stage " + std::to_string(t.settings.zero_stage) +
        " and the optimizer on the device over " + std::to_string(t.comms.dp_size) +
        " data-parallel ranks each rank keeps only its slice of the reduced gradients; "
        "use stage 0 or 1 to read whole gradients");
  }
  const auto micro = static_cast<std::int64_t>(inputs.size()) / (t.config.micro_batch * t.config.seq_len);
  if (micro < 1 || micro > t.config.grad_accum) {
    return invalid_argument("loss_and_gradients: expected 1 to " + std::to_string(t.config.grad_accum) +
                            " micro-batches of tokens");
  }
  STRATA_RETURN_IF_ERROR(t.run_micro_batches(inputs, targets, micro, false, 0, 0.0));
  STRATA_RETURN_IF_ERROR(t.compute->synchronize());
  LossSum total;
  for (int a = 0; a < static_cast<int>(micro); ++a) {
    total.sum += t.model->loss_sum(a).sum;
    total.count += t.model->loss_sum(a).count;
  }
  return total.sum / static_cast<double>(total.count);
}

Result<double> OffloadEngine::loss(std::span<const std::int32_t> inputs,
                                   std::span<const std::int32_t> targets) {
  Impl& t = *impl_;
  STRATA_RETURN_IF_ERROR(t.host.recover());
  if (t.delayed) STRATA_RETURN_IF_ERROR(t.wait_all_updates());  // evaluates the latest parameters
  if (t.comms.pp_size > 1) STRATA_RETURN_IF_ERROR(t.model->select_slot(0));
  STRATA_RETURN_IF_ERROR(t.model->set_batch(inputs, targets, t.config.micro_batch, t.config.seq_len));
  Status s;
  if (t.comms.pp_size > 1) {
    s = t.forward_stage();  // collective over the pipeline: every stage, the same batch
  } else {
    t.fetcher.begin_pass();
    s = t.run_forward(false);
    if (s.ok()) s = t.fetcher.end_pass();
  }
  if (s.ok()) s = t.model->copy_losses(0);
  if (s.ok()) s = t.compute->synchronize();
  if (s.ok()) s = t.h2d->synchronize();
  if (!s.ok()) return t.abandon_pass(s);
  const LossSum sum = t.model->loss_sum(0);
  // A stage before the last holds no losses (nan here): every stage returns the last stage's
  // value, its bits moved as words.
  double mean = sum.sum / static_cast<double>(sum.count);
  if (t.comms.pp_size > 1) {
    STRATA_RETURN_IF_ERROR(t.comms.pp_caller->broadcast(&mean, 2, DType::kF32, t.comms.pp_size - 1)
                               .wait()
                               .with_context("pipeline: broadcast of the loss from the last stage"));
  }
  return mean;
}

Result<EvalResult> OffloadEngine::evaluate(std::span<const std::int32_t> tokens, std::int64_t max_windows) {
  Impl& t = *impl_;
  STRATA_RETURN_IF_ERROR(t.host.recover());
  if (t.delayed) STRATA_RETURN_IF_ERROR(t.wait_all_updates());  // evaluates the latest parameters
  auto forward = [&t]() -> Status {
    if (t.comms.pp_size > 1) return t.forward_stage();  // every stage, every window batch, in order
    t.fetcher.begin_pass();
    STRATA_RETURN_IF_ERROR(t.run_forward(false));
    return t.fetcher.end_pass();
  };
  if (t.comms.pp_size > 1) STRATA_RETURN_IF_ERROR(t.model->select_slot(0));
  detail::HostSpan span(t.tracer, t.track.caller, TraceCounter::kNone, "evaluate");
  auto r = detail::evaluate_windows_with(*t.model, tokens, t.config.seq_len, t.config.micro_batch,
                                         max_windows, forward);
  Status s = r.ok() ? t.h2d->synchronize() : r.status();
  if (!s.ok()) return t.abandon_pass(s);
  if (t.comms.pp_size > 1) {
    // The last stage summed the losses (the others hold none): its result, moved as words.
    double v[2] = {r->loss, static_cast<double>(r->tokens)};
    STRATA_RETURN_IF_ERROR(t.comms.pp_caller->broadcast(v, 4, DType::kF32, t.comms.pp_size - 1)
                               .wait()
                               .with_context("pipeline: broadcast of the evaluation from the last stage"));
    return EvalResult{v[0], static_cast<std::int64_t>(v[1])};
  }
  return r;
}

Status OffloadEngine::synchronize() {
  Status s = impl_->wait_all_updates();
  if (!s.ok()) {
    impl_->ledger.note_reported();
    return s;
  }
  return impl_->device->synchronize();
}

Status OffloadEngine::set_param(int index, std::span<const float> values) {
  return impl_->state.write_full(index, values);
}
Result<std::vector<float>> OffloadEngine::get_param(int index) { return impl_->state.read_full(index, 0); }
Result<std::vector<float>> OffloadEngine::get_master(int index) { return impl_->state.read_full(index, 1); }
Result<std::vector<float>> OffloadEngine::get_exp_avg(int index) { return impl_->state.read_full(index, 2); }
Result<std::vector<float>> OffloadEngine::get_exp_avg_sq(int index) {
  return impl_->state.read_full(index, 3);
}

}  // namespace strata
