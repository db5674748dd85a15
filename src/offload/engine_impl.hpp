// The engine facade (offload.hpp's OffloadEngine::Impl): the core every part reads, the parts
// that own the engine's state, and the step that drives them in order (docs/offload.md "The
// map"). Who owns what:
//
//   EngineCore       settings, placement, device and streams, model, parameter table, NVMe store,
//                    tracer, communicators, the caller's step numbers   (engine_core.hpp)
//   UpdateLedger     which unit holds which step's update; the optimizer thread's inbox and
//                    failure state                                        (update_ledger.hpp)
//   ParamHomes       working parameters where they live; the delayed update's versions
//   Fetcher          the prefetch trace, the parameter slots and early fetches
//   GradientPath     the host optimizer's gradient buckets, copies out, reduce-scatters, landings
//   DeviceOptimizer  gradients and optimizer state on the device, its update; DeviceBuckets
//   HostOptimizer    the host optimizer thread and its state; NvmeRing, its NVMe pipeline
//   StateAccess      whole-unit state for initialisation, getters, weights and checkpoints
//   PipelineBuffers  a pipeline stage's boundary buffers and exchanges in flight
//
// The facade's own state is the pass's failure mode (keep_modules, pass_error) and the caller's
// scratch. Its methods run the step (engine.cpp), the setup (engine_setup.cpp), a pipeline
// stage's schedule (pipeline_stage.cpp), weights and checkpoints (weights_io.cpp,
// checkpoint_io.cpp) and the statistics (engine_stats.cpp).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "offload/device_optimizer.hpp"
#include "offload/engine_core.hpp"
#include "offload/fetcher.hpp"
#include "offload/gradient_path.hpp"
#include "offload/host_optimizer.hpp"
#include "offload/param_homes.hpp"
#include "offload/state_access.hpp"
#include "offload/update_ledger.hpp"
#include "strata/offload.hpp"
#include "strata/pipeline_schedule.hpp"

namespace strata {

namespace offload_detail {

// A pipeline stage's boundary exchange (pipeline_stage.cpp, docs/parallel.md "Pipeline
// parallel"). The exchange runs in compute-stream order (host functions on the stream's worker,
// the only thread using pp_stream): a receive is posted when the stream starts the op before the
// one that needs it, each op waits only for its own receive, and each send leaves once its output
// is copied. The handles are written by the worker and read by the caller only after
// compute->synchronize().
struct PipelineBuffers {
  // Interleaved: the activation slot of each (micro-batch, chunk) of the step's schedule, and per
  // chunk a slot carved for it (forward only runs the chunks through these).
  InterleavedSlots chunk_slots;
  std::vector<int> forward_slot;
  // Per micro-batch (interleaved: per micro-batch and chunk, a·v + c): the boundary tensors sent.
  std::vector<ArenaBuffer> act_send, grad_send;
  // kPipelineRecvBuffers each, used alternately (the n-th receive of a direction in the step:
  // n % 2; with one chunk that is micro-batch n): the boundary tensors received.
  std::vector<ArenaBuffer> act_recv, grad_recv;
  std::vector<CommWork> act_recv_work, grad_recv_work;  // per receive buffer: its posted receive
  std::vector<CommWork> sends;                          // this step's sends, waited at its end
  double pp_stream_wait_seconds = 0.0;  // compute stream's receive waits (worker; read after a sync)
  double pp_seconds = 0.0, pp_wait_seconds = 0.0;  // OffloadStats::pipeline_seconds / _wait_seconds
  std::uint64_t pp_bytes = 0;
};

}  // namespace offload_detail

// The facade's files (engine*.cpp, pipeline_stage.cpp, weights_io.cpp, checkpoint_io.cpp) name
// the parts' types directly.
using offload_detail::Command;
using offload_detail::GradSlot;
using offload_detail::HostMem;
using offload_detail::OwnedParam;
using offload_detail::ParamSlot;
using offload_detail::TraceCounter;

struct OffloadEngine::Impl : offload_detail::EngineCore {
  offload_detail::UpdateLedger ledger{*this};
  offload_detail::ParamHomes homes{*this, ledger};
  offload_detail::Fetcher fetcher{*this, ledger, homes};
  offload_detail::GradientPath grads{*this, ledger};
  offload_detail::DeviceOptimizer devopt{*this, homes};
  offload_detail::HostOptimizer host{*this, ledger, homes, grads, devopt};
  offload_detail::StateAccess state{*this, homes, fetcher, host, devopt};
  offload_detail::PipelineBuffers pipe;

  // A pipeline stage that keeps its place through a caller error inside a module's work
  // (run_pipeline sets it: tensor or data parallelism in the stage, the cpu backend, the
  // optimizer on the host, stages 0-2).
  bool keep_modules = false;
  // The first such error of this pass: the compute stream was failed with it, and every later
  // module of the pass enqueues only the model's work (its kernels skipped, its tensor-parallel
  // collectives run) and its data-parallel reduce-scatters, so this rank still issues every
  // collective of the pass.
  Status pass_error;
  std::vector<double> gathered_sums;  // caller: sum_over_ranks
  std::uint64_t alloc_baseline = 0;
  bool have_baseline = false;

  // ---- setup (engine_setup.cpp) ----
  Status setup();
  Status carve_device_regions();
  Status carve_slots();
  Status table_owned_params();
  Status carve_host_tiers();
  Status create_kernels();
  Status setup_tensor_parallel();
  Status setup_data_parallel();
  Status setup_pipeline();

  // ---- the step (engine.cpp) ----
  // Around a module: `s`, an error of the engine's work for module m, ends the pass, or (with
  // keep_modules) fails the compute stream with it and continues in the failed mode above.
  Status keep_module_place(Status s);
  // The modules of chunk_ranges[chunk] (the whole model, or the stage's only range, for chunk 0).
  Status run_forward(bool for_backward, int chunk = 0);
  Status run_backward(float dloss, bool first_micro, bool last_micro, std::int64_t step, double lr,
                      int chunk = 0);
  Status run_micro_batches(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets,
                           std::int64_t micro, bool update, std::int64_t step, double lr);
  // `values` summed over the data-parallel ranks, in rank order (the same bits on every rank).
  Status sum_over_ranks(std::span<double> values);
  // After a failed step: every slot and bucket forgotten (their contents may be partial) and
  // the trace re-recorded. Streams must be idle.
  void reset_pass_state();
  // A step, loss or evaluation failed: let the streams finish, forget the pass; returns `s`.
  Status abandon_pass(Status s) {
    (void)compute->synchronize();
    if (h2d) (void)h2d->synchronize();
    if (gstream) (void)gstream->synchronize();
    reset_pass_state();
    return s;
  }
  // Waits for every update in flight; `publish` (the default): a delayed update is uploaded too,
  // so the device holds the latest parameters.
  Status wait_all_updates(bool publish = true);
  // Operations that need every module in this process.
  Status single_stage(const char* what) const {
    if (comms.pp_size == 1) return ok_status();
    return failed_precondition(std::string(what) + " with " + std::to_string(comms.pp_size) +
                               " pipeline stages is not built yet (this stage holds modules " +
                               std::to_string(placement.stage.first) + ".." +
                               std::to_string(placement.stage.end - 1) + ")");
  }
  // Steps skipped for overflowing fp16 gradients: they count in `steps` but not in the
  // optimizer's update number or the learning-rate schedule (DeepSpeed's skipped_steps).
  std::int64_t skipped_steps() const { return scaler ? scaler->state().overflows : 0; }
  std::uint64_t allocation_count() const {
    return device->memory().stats().allocations + device->pinned().stats().allocations +
           device->stats().raw_allocs;
  }

  // ---- a pipeline stage (pipeline_stage.cpp) ----
  Status run_pipeline(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets,
                      std::int64_t micro, float dloss, std::int64_t step, double lr);
  // Forward only of the batch set on the model through this stage: receive the input from the
  // previous stage, run the stage's modules, send the output to the next (loss, evaluate).
  Status forward_stage();
  DType wire_dtype() const { return half ? DType::kBF16 : DType::kF32; }  // 16-bit: moved as bits
  // Bytes of one boundary tensor of a training micro-batch: the residual stream's rows this rank
  // holds (sequence parallel: its 1/tp of them, exchanged with the same tp rank of the neighbour
  // stage, which holds the same rows), times the width, in the working dtype.
  std::uint64_t boundary_bytes() const {
    const std::int64_t sp = settings.sequence_parallel ? comms.tp_size : 1;
    return static_cast<std::uint64_t>(config.micro_batch * config.seq_len / sp * config.model.n_embd) *
           dtype_size(wdtype);
  }
};

}  // namespace strata
