// The offload engine (offload.hpp, docs/offload.md).
//
// Units and homes. Unit u is module u's own storage. Its working parameters live at home[u]:
// resident in the device region offload.params, or on the host (host_params), or on NVMe (swap
// key "param.<u>"); a non-resident unit is fetched into a device slot of offload.param_slots
// before a module that reads it runs. Optimizer state (fp32 master, exp_avg, exp_avg_sq) lives
// on the optimizer tier: device regions optim.*, host arrays, or one NVMe key "optim.<u>" per unit
// holding [master | exp_avg | exp_avg_sq]. With the optimizer off the device, gradients are
// accumulated in device buckets (offload.grad_slots) from a unit's first backward touch to its
// last, then copied to host_grads; a later micro-batch restores the bucket from host_grads first,
// so the device performs the very additions of the resident run (bitwise equivalence).
//
// Streams. compute (the model's kernels), h2d (parameter fetches and uploads of updated
// parameters), grads (bucket restores and gradient copies to the host). Events order them:
//   slot.fetched : h2d → compute        (the fetched parameters are in the slot)
//   slot.free    : compute → h2d        (compute is done reading the slot's previous unit)
//   bucket.done  : compute → grads      (the bucket's backward is done)
//   bucket.free  : grads → compute      (the bucket's copy to the host is done)
//   landed[u]    : grads → optimizer thread (u's final gradients are on the host)
//   uploaded[u]  : h2d → compute        (u's updated resident parameters are on the device)
//
// The host optimizer thread receives "landed" units in backward order. It scans each one (sum
// of squares per unit, merged in unit order: the same bits whatever the bucketing), and either
// updates it at once (clipping off, update_during_backward) or, once every unit has landed and the
// norm is known, updates all units in forward order. updated_step[u] tells the step's caller
// when unit u may be read again: the next forward of u waits for exactly that unit, so the update
// of later units overlaps the next step's first modules.
//
// Invariants (checked by tests/test_offload_engine.cpp): for every placement the parameters and
// optimizer state after N steps equal the all-device placement's bit for bit on the cpu backend;
// a unit is never read by compute while its update is pending; a slot is never refilled before
// compute has passed its last read (slot.free); a bucket is never zeroed or restored before its
// previous copy out finished (bucket.free).
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
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <utility>

#include "device/backends.hpp"
#include "kernels/bf16.hpp"
#include "model/launcher.hpp"
#include "model/staging.hpp"
#include "offload/internal.hpp"
#include "offload/regions.hpp"
#include "partition/placement.hpp"
#include "model/evaluate.hpp"
#include "optim/grad_norm_cuda.hpp"
#include "offload/trace.hpp"
#include "strata/checkpoint.hpp"
#include "strata/device.hpp"
#include "strata/log.hpp"
#include "strata/optim.hpp"
#include "strata/parallel.hpp"
#include "strata/pipeline_schedule.hpp"
#include "strata/safetensors.hpp"

namespace strata {

using detail::TraceCounter;

namespace {

// Host memory of the plan: from the pinned pool or standalone page-aligned memory.
struct HostMem {
  ArenaBuffer pinned;
  AlignedBuffer plain;
  void* data() const { return pinned ? pinned.data() : plain.data(); }
  char* bytes() const { return static_cast<char*>(data()); }
  float* floats() const { return static_cast<float*>(data()); }

  static Result<HostMem> make(Device& device, bool pin, std::uint64_t bytes, std::string_view tag) {
    HostMem h;
    bytes = std::max<std::uint64_t>(bytes, 4096);
    if (pin) {
      STRATA_ASSIGN_OR_RETURN(h.pinned, device.pinned().allocate(bytes, tag));
    } else {
      STRATA_ASSIGN_OR_RETURN(h.plain, AlignedBuffer::allocate(bytes));
    }
    std::memset(h.data(), 0, bytes);
    return h;
  }
};

struct ParamSlot {
  char* dev = nullptr;
  int unit = -1;
  bool used = false;  // compute read it since it was fetched
  std::unique_ptr<Event> fetched, free;
  HostMem staging;  // NVMe-home units: the swap read lands here, then H2D
  // An early fetch (prefetch_next_step): issued by the caller when a step returned, gated on the
  // h2d stream by the unit's update of that step. `early_ok` is set by the gate's host function
  // once the update was published and the read succeeded; read by the caller only after
  // `fetched` completed. A slot whose gate saw a failed update (or whose read failed) holds
  // nothing usable and is refetched on demand.
  bool early = false;
  std::unique_ptr<std::atomic<bool>> early_ok;
  std::int64_t gate_step = -1;     // early: the step whose update the gate waits for
  std::uint64_t gate_failures = 0;  // early: update_failures when it was issued
  // early: issued by prefetch_next_step (counted in early_fetch_hits), not by a pass's own
  // prefetch of a unit whose update was still running (prefetch_ahead).
  bool next_step = false;
};

struct GradSlot {
  float* dev = nullptr;
  int unit = -1;
  std::unique_ptr<Event> done, free, ready;
};

// One owning parameter, as the optimizer sees it.
struct OwnedParam {
  int index = -1;
  int unit = -1;
  bool decay = false;
  std::uint64_t grad_in_unit = 0;   // bytes from the unit's grad_begin (fp32 layout)
  std::uint64_t param_in_unit = 0;  // bytes from the unit's param_begin (working layout)
  std::uint64_t grad_offset = 0;    // in the engine's fp32 arrays (grad_begin(unit) + grad_in_unit)
  std::size_t n = 0;
};

OptimizerHyper hyper_of(const OptimizerSettings& o, double lr, bool decay) {
  OptimizerHyper h;
  h.kind = o.decoupled ? OptimizerKind::kAdamW : OptimizerKind::kAdam;
  h.lr = lr;
  h.beta1 = o.beta1;
  h.beta2 = o.beta2;
  h.eps = o.eps;
  h.weight_decay = decay ? o.weight_decay : 0.0;
  return h;
}

std::string unit_key(const char* kind, int u) { return std::string(kind) + "." + std::to_string(u); }

}  // namespace

struct OffloadEngine::Impl {
  TrainerConfig config;
  OffloadSettings settings;
  OffloadPlan plan;
  // What lives where (src/partition): read only once setup() built it.
  partition::Placement placement;
  Device* device = nullptr;
  Stream* compute = nullptr;
  Stream* h2d = nullptr;
  Stream* gstream = nullptr;
  std::unique_ptr<Model> model;
  std::unique_ptr<detail::KernelLauncher> launch;  // the device optimizer's kernels
  std::unique_ptr<detail::HostStager> stager;
  int M = 0;
  DType wdtype = DType::kF32;  // working parameters
  bool half = false;  // 16-bit working parameters (bf16, fp16) with separate fp32 masters
  bool fp16 = false;  // fp16: loss scaling and skipped steps
  std::optional<LossScaler> scaler;  // fp16 only; moved by the caller once a step's norm is known
  // Partial optimizer offload (Sharding::optimizer_split): the device units (StageShape::
  // device_units: the first of those this process holds, in module order: without a pipeline
  // [0, k), with one the stage's first units; per chunk, device_units_of_chunk) keep gradients,
  // masters and moments in the device regions (indexed by the engine's fp32 offsets, grad_begin,
  // the prefix [0, device_opt_bytes)) and are updated by the device after the norm is known; the
  // host arrays hold [device_opt_bytes, grad_bytes) (host_at).
  std::vector<GradStats> dev_stats;  // per unit (device units only): its gradient scan (compute stream)
  // Partial offload with data parallelism (Sharding::split_state_sharded; docs/offload.md
  // "Data parallel" under "Partial optimizer offload"): the device units' gradients stay whole in
  // offload.grads; after backward (stage 2: after every micro-batch) a compute-stream host
  // function reduce-scatters each of them through offload.dp_staging on dp_device into this
  // rank's slice (stage 1: written back in place; stage 2: added into offload.grad_slices), whose
  // scan goes to dev_stats; once the norm is known the compute stream updates this rank's slices
  // of master and moments (optim.*, packed at slices.offset) and all-gathers the working elements
  // into the resident copy. The host units take ratio 1's sharded path unchanged.
  float* dgrad_slices = nullptr;  // stage 2: offload.grad_slices (this rank's reduced slices)
  std::unique_ptr<Comm> dp_device;  // the compute stream's (reduce-scatters, then all-gathers)
  // Global fp32-layout offset `off` (of a host unit) in one of the host arrays.
  char* host_at(const HostMem& h, std::uint64_t off) const { return h.bytes() + (off - placement.sizes.device_opt_bytes); }
  std::vector<OwnedParam> owned;                 // every owning parameter
  std::vector<std::vector<int>> owned_of_unit;   // indices into `owned`

  // Device storage.
  char* resident = nullptr;  // offload.params
  float* dgrads = nullptr;   // optimizer on the device: offload.grads ...
  std::uint64_t dgrad_bytes = 0;  // ... its bytes (grad_sharded: this rank's slices)
  float* dmaster = nullptr;  // ... optim.master (16-bit only; fp32 masters are the resident params)
  float* dm = nullptr;
  float* dv = nullptr;
  std::vector<ParamSlot> pslots;
  std::vector<int> slot_of;  // per unit: its param slot, -1
  std::vector<GradSlot> gslots;
  std::vector<int> gslot_of;  // per unit: its gradient bucket, -1
  std::vector<char*> bound_params;
  std::vector<float*> bound_grads;

  // Host storage.
  HostMem host_grads, host_params, host_master, host_m, host_v;
  HostMem param_out_staging;                     // host optimizer + NVMe-home params
  std::vector<HostMem> ring;                     // NVMe optimizer pipeline: one sub-group each
  HostMem param_out[2];                          // NVMe optimizer: updated parameters, alternating units
  bool grads_on_nvme = false;
  HostMem grad_staging;                          // NVMe gradients: every landing and restore, in gstream order
  std::vector<GradStats> landed_stats;           // NVMe gradients: scanned on the way out (gstream thread)
  std::vector<std::unique_ptr<Event>> landed, uploaded;
  std::vector<char> uploaded_recorded;  // per unit (bytes, not bits: two threads touch different units)

  // NVMe.
  std::unique_ptr<IoEngine> io;
  std::unique_ptr<SwapStore> swap;

  // Optimizers.
  std::optional<CpuOptimizer> device_opt;  // cpu backend, optimizer on the device
  std::optional<CpuOptimizer> host_opt;    // optimizer on host or NVMe
  ArenaBuffer cuda_partials, pinned_norm;

  // The host optimizer thread.
  struct Command {
    // kRetry: finish the update of a step that failed part-way (FailedUpdate).
    enum Kind { kLanded, kFinish, kAbort, kRetry, kStop } kind = kLanded;
    int unit = -1;
    std::int64_t step = 0;  // the engine's step (StepMetrics::step): bookkeeping
    double lr = 0.0;
    std::int64_t opt_step = 0;  // the optimizer's update number (bias correction); fp16 skips hold it back
    double loss_scale = 1.0;    // the scale the step's gradients carry (fp16; 1 otherwise)
    float scale = 1.0f;         // kRetry: the update's clip / loss-scale factor
  };
  // Retrying a failed host update in place (docs/offload.md "Faults"). When the optimizer
  // thread fails, `failed` says how far the step got:
  //   kBeforeUpdate: nothing of the step was applied (its call failed); the step runs again.
  //   kAfterNorm: the norm was published (step() returned) and the update failed part-way;
  //     the next call reports the error, the call after it updates the remaining units with the
  //     recorded factor. The gradients wait: the next step cannot overwrite a unit's gradients
  //     before that unit holds this step (its forward, or with the delayed update its
  //     gradients' copy-out, waits for the unit's update first).
  //     With several processes every rank must fail the step alike: a non-finite norm is the
  //     same on every rank (the statistics are merged over every group), and a rank's own
  //     failure before the norm (a copy, a scan, a gradient read or write) travels with the
  //     statistics to every rank (agree_before_norm), so every rank fails that step and runs it
  //     again.
  //   kNone: not retryable — more than one process and a failure before the norm that is not
  //     agreed on (!agree_before_norm: data parallelism with unsharded state) or a failed
  //     collective (after the norm the ranks agree: agree_unit per unit over the data-parallel
  //     and tensor groups, agree_stages per step over the pipeline stages); or
  //     update_during_backward, where units are updated while the step's call is still running
  //     (only a non-finite gradient or a stream error can fail there, and neither goes away by
  //     retrying; with several processes the failure is agreed, so every rank reports it):
  //     sticky until load_checkpoint.
  // Which units (and NVMe sub-groups) already hold the step is what updated_step,
  // host_opt_step and group_step record; a failed swap write keeps the previous version
  // readable (swap_store.cpp), so a sub-group that is not marked reads back as before the step.
  enum class FailPhase : std::uint8_t { kNone, kBeforeUpdate, kAfterNorm };
  struct FailedUpdate {
    FailPhase phase = FailPhase::kNone;
    Command cmd;            // the step's numbers (and, after the norm, its factor)
    bool reported = false;  // a call has returned the error: the next one retries
  };
  FailedUpdate failed;  // guarded by mu
  // Worker thread (and load_checkpoint, with the worker drained): per unit, the engine step
  // whose update the host master and moments hold (the publish of its parameters may still have
  // failed), and per unit and NVMe sub-group the step whose [master | m | v] is on disk.
  std::vector<std::int64_t> host_opt_step;
  std::vector<std::vector<std::int64_t>> group_step;
  std::int64_t applied_step = 0;  // worker: the last step whose update started on some unit
  std::thread worker;
  mutable std::mutex mu;
  std::condition_variable cv;
  std::deque<Command> commands;
  std::vector<std::int64_t> updated_step;  // per unit
  // Optimizer thread (and load_checkpoint, with the worker drained), pipeline only: per unit, the
  // step whose update this stage finished, before the stages agreed on it (unit_done).
  std::vector<std::int64_t> stage_done;
  std::int64_t norm_step = 0;              // the last step whose norm is known
  // agree_before_norm: the caller's failure of the step in flight (a stream's error), handed to
  // the optimizer thread with its kAbort (guarded by mu), which agrees on it with the other ranks.
  Status abort_error;
  // agree_before_norm: the first gradient read or write error of the pass in flight (NVMe
  // gradients). It is kept here instead of failing the gradient stream, whose later host
  // functions hold collectives every rank joins (the reduce-scatters); the caller takes it once
  // the stream is idle (take_grad_io_error) and fails the step, agreed like any stream error.
  std::mutex grad_io_mu;
  Status grad_io_error;  // guarded by grad_io_mu
  Status keep_grad_io(Status s) {
    if (s.ok() || !agree_before_norm()) return s;
    std::lock_guard<std::mutex> lock(grad_io_mu);
    if (grad_io_error.ok()) grad_io_error = std::move(s);
    return ok_status();
  }
  Status take_grad_io_error() {
    std::lock_guard<std::mutex> lock(grad_io_mu);
    return std::exchange(grad_io_error, ok_status());
  }
  double norm_value = 0.0;                 // unscaled; inf or nan when the gradients overflowed
  // The step in flight (set by step() before its first micro-batch): its optimizer update number
  // and loss scale.
  std::int64_t opt_step_now = 0;
  double loss_scale_now = 1.0;
  // One-step delayed update (settings.delayed_update, docs/offload.md "Delayed update"). The
  // optimizer thread writes a unit's updated working parameters only to their host copy
  // (host_params); the caller uploads them (publish_delayed) once the device may see them: after
  // the next step's backward, or before anything else reads the parameters. pending_publish is
  // the step whose update has not been uploaded yet (0: none). Caller thread only.
  // With tensor or pipeline parallelism every rank delays its own shard's (stage's) update alike:
  // the norm is merged over the groups as without the delay, publish_delayed talks to no one and
  // runs at the same point of every rank's step (after its passes, or at a flush every rank's
  // collective call makes), and a backward waits only for this rank's own update of the previous
  // step, which needs nothing but that step's commands, already pushed on every rank.
  bool delayed = false;
  std::int64_t pending_publish = 0;
  // Several processes (agree_before_norm): this rank's call of a step that every rank failed
  // before its update returned before publishing step pending_publish's update, which its peers
  // whose pass succeeded did publish. The next step() publishes it first, so the step runs again
  // at P[pending_publish] on every rank (as after a flush). Caller thread only.
  bool publish_before_rerun = false;
  // The delayed update with working parameters off the device: the next step's fetches read the
  // home while the update in flight produces the next version, so every off-device unit has two.
  // Host home: the update writes `delayed_next` (offset next_offset[u]) and publish_delayed
  // copies it into host_params. NVMe home: the versions are the swap shards 0 and 1 of
  // "param.<u>"; param_shard[u] names the published one (what fetches and state reads use), the
  // update writes the other, and publish_delayed flips it (no I/O, so a publish cannot fail
  // half-way). Written by the caller in publish_delayed and load_checkpoint only while the
  // optimizer thread has no update of the unit in flight.
  HostMem delayed_next;  // at UnitPlacement::next_offset
  std::vector<std::uint32_t> param_shard;
  // Per unit: the optimizer thread wrote its next version since the last publish (an fp16 step
  // that overflowed writes none, and publishing would then bring back an older one). Set by the
  // optimizer thread before the unit is marked updated, read and cleared by publish_delayed after
  // waiting for that mark (mu orders them).
  std::vector<char> next_fresh;
  // Unit u's working parameters on NVMe: the published version, or (`next`) the one the delayed
  // update in flight writes.
  TensorKey param_key(int u, bool next = false) const {
    const std::uint32_t cur = param_shard.empty() ? 0 : param_shard[static_cast<std::size_t>(u)];
    return TensorKey{unit_key("param", u), next ? 1 - cur : cur};
  }
  Status worker_error;
  // Counts the optimizer thread's failures (guarded by mu): an early fetch's gate stops waiting
  // for its unit's update when one happened after the fetch was issued.
  std::uint64_t update_failures = 0;
  bool worker_busy = false;  // a command is being processed (guarded by mu)
  const nvme_detail::IoFaults* io_faults = nullptr;  // tests only (offload_detail::EngineFaults)
  // Tests only (EngineFaults::fail_next_pass): the next step's call fails with it once its
  // streams are idle, as a stream error seen after the pass. Caller thread only.
  Status injected_pass_error;
  // Tests only (EngineFaults::fail_compute_at): the next access of module injected_compute_module
  // enqueues injected_compute_error on the compute stream. Caller thread only.
  int injected_compute_module = -1;
  Status injected_compute_error;
  // Tests only (EngineFaults::hold_update_until_forward): the optimizer thread's next update of
  // unit `held_unit` waits until the compute stream ran the forward of module `hold_forward` in
  // a pass that reads that update (`forward_ran_at`: the largest `steps` of a pass whose forward
  // of it ran, set by a host function after it). Guarded by mu; held_unit is also read without.
  std::atomic<int> held_unit{-1};
  int hold_forward = -1;
  std::int64_t forward_ran_at = -1;
  Status hold_update(int u, std::int64_t done_step);
  // Tests only (EngineFaults::fail_caller_at): the next access of module injected_caller_module
  // returns injected_caller_error on the caller. Caller thread only.
  int injected_caller_module = -1;
  Status injected_caller_error;
  // Tests only (EngineFaults::gather_weights_on_save): save_weights without a pipeline takes the
  // gather path. Caller thread only.
  bool gather_weights_on_save = false;
  // Tests only (EngineFaults::hide_weights_file): this rank does not see the weights file the
  // first rank created, as a rank on another node without a shared file system. Caller thread.
  bool hide_weights_file = false;
  // Tests only (EngineFaults::kill_during_save): when non-zero, write_weights_part raises SIGKILL
  // on this rank once it issued this many range writes into one weights file. Caller thread only.
  std::uint64_t kill_after_weights_writes = 0;
  CpuAccount worker_cpu;  // the host optimizer thread and its OpenMP team

  // Prefetch trace: one code per module access (forward m: m; backward m: M + m).
  std::vector<int> trace, record;
  bool trace_ok = false;
  std::size_t pos = 0;
  bool cyclic = false;  // the pass that follows repeats this trace (more micro-batches this step)

  // The timeline and busy/stall seconds (offload/trace.hpp); tracks are added in setup().
  detail::Tracer tracer;
  struct Tracks {
    int caller = 0, compute = 0, h2d = 0, grads = 0, copy_h2d = 0, copy_d2h = 0, optimizer = 0;
    int nvme_fetch = 0, nvme_publish = 0, nvme_ring = 0;  // ring buffer r: nvme_ring + r
  } track;

  // Data parallel (null / size 1: one process).
  Comm* dp = nullptr;
  int dp_size = 1, dp_rank = 0;
  // Sharding::host_state_sharded: the host optimizer state holds this rank's slices.
  // Sharding::device_state_sharded (stages 1-3 with the optimizer on the device): dmaster, dm and
  // dv hold this rank's slices (UnitPlacement::slice, packed), the device update reduce-scatters
  // the gradients, merges the statistics and all-gathers the updated parameters on the compute
  // stream (device_update_sharded) through the device region offload.dp_staging.
  char* dev_staging = nullptr;
  // Gradient buckets (docs/parallel.md "Gradient buckets"; optimizer on the device, cpu backend;
  // stages 0 and 2-3, with or without a pipeline: a pipeline stage's buckets are cut per chunk
  // from its modules and each opens and closes inside one backward op of the schedule).
  // Sharding::device_grads_bucketed: stage 0 all-reduces each bucket's range of offload.grads in
  // place as backward leaves its last module (the last micro-batch only).
  // Sharding::device_grads_sharded (stage >= 2): offload.grads
  // holds this rank's slices; backward writes into bucket buffers (offload.grad_buckets, each unit
  // padded to size x chunk), reduce-scattered in place unit by unit into the slices every
  // micro-batch. The caller thread assigns the buffers (stream order keeps their uses apart); the
  // collectives, their waits and the slices' accumulation run in compute-stream host functions
  // (the compute thread only) over dp_buckets.
  // The buckets are Placement::buckets.
  std::unique_ptr<Comm> dp_buckets;
  std::vector<char*> bucket_buf;       // offload.grad_buckets slots (units padded, then the receive part)
  std::vector<int> bucket_buf_owner;   // per buffer: the open bucket using it, -1 free (caller)
  std::vector<int> bucket_buf_of;      // per bucket: its buffer while open, -1 (caller)
  // Per buffer: when it was last released in this step (0: not yet), and the step's release count
  // (caller). open_buckets takes the free buffer released longest ago: its reduce-scatter, the
  // oldest in flight, is the likeliest to be done, so compute rarely waits for it.
  std::vector<std::uint64_t> bucket_buf_freed;
  std::uint64_t bucket_frees = 0;
  struct InFlight {                    // stage >= 2: a bucket's reduce-scatters (compute thread only)
    int bucket = -1, buf = -1;
    bool accumulate = false;
    std::vector<CommWork> work;        // one per unit of the bucket
  };
  std::deque<InFlight> in_flight;      // launch order
  std::vector<std::pair<int, CommWork>> bucket_work;  // stage 0 in flight (compute thread)
  // Stage 0: bucket b's range of offload.grads (its units are adjacent): byte offset and elements.
  std::pair<std::uint64_t, std::uint64_t> bucket_range(int b) const {
    const std::vector<int>& us = placement.buckets.buckets[static_cast<std::size_t>(b)].units;
    const int lo = us.back(), hi = us.front();  // backward order: highest unit first
    const std::uint64_t begin = grad_begin(lo);
    return {begin, (grad_begin(hi) + placement.units[static_cast<std::size_t>(hi)].grad_bytes - begin) / 4};
  }
  std::vector<GradStats> shard_stats;  // per unit: this rank's slice's scan (compute stream)
  // Stage 3: every unit that is not resident keeps only this rank's slice of its working
  // parameters at its home (host or NVMe; UnitPlacement::gathered_at_fetch); a fetch all-gathers
  // the slices on the h2d stream. In device memory (Sharding::device_params_sliced) the slices
  // live in offload.params (UnitPlacement::slice_at_home), read and written there by
  // read_param_slice / write_param_slice; the device update writes only the slice (no all-gather
  // after it).
  std::unique_ptr<Comm> dp_caller, dp_grads, dp_params, dp_fetch;  // one per thread that talks
  HostMem fetch_send, fetch_recv;  // h2d stream: this rank's slice, and the gathered unit
  HostMem shard_grads;      // this rank's slices of the reduced gradients
  HostMem rs_send, rs_recv;  // gradient stream: one unit padded to size x chunk, and this rank's chunk
  HostMem ag_send, ag_recv;  // optimizer thread: this rank's updated chunk, and the gathered unit
  std::vector<GradStats> gathered_stats;  // optimizer thread: per rank, per unit
  // Optimizer thread, host tier sharded over data parallelism: this rank's per-unit statistics
  // plus its failure flag (M + 1 records), and every rank's (dp_size x (M + 1)), sized once.
  std::vector<GradStats> flagged_stats, flagged_gathered;
  std::vector<double> gathered_sums;      // caller: sum_over_ranks
  std::atomic<std::uint64_t> dp_bytes{0};
  int dp_tracks[4] = {0, 0, 0, 0};  // caller, gradient stream, optimizer thread, h2d stream

  // Tensor parallel (null / size 1: the whole model; docs/parallel.md "Tensor parallel"). This
  // rank's model, state and plan are its shard. One Comm per thread that talks, split from the
  // group: the compute stream (the model's collectives and the device update's norm), the caller
  // (gathering full parameters, save/load) and the host optimizer thread (the norm).
  Comm* tp = nullptr;
  int tp_size = 1, tp_rank = 0;
  std::unique_ptr<Comm> tp_model, tp_step, tp_norm;
  std::vector<ModelLayout> tp_layouts;  // every rank's shard layout, by tp rank
  // Pipeline parallel (null / size 1: every module here). This stage runs the modules of
  // Placement::stage (chunk_ranges); UnitPlacement::in_stage says which units it holds. Each thread that talks
  // has its own Comm split from the group, used in one order on every stage: the compute stream's
  // worker (activations and activation gradients, pp_stream), the caller (the loss, pp_caller),
  // the thread that computes the gradient norm
  // (the compute stream's optimizer step, or the host optimizer thread: per-unit statistics), and
  // the thread that holds the tied embedding's final gradient (compute stream / gradient stream:
  // its all-reduce between the first and the last stage).
  Comm* pp = nullptr;
  int pp_size = 1, pp_rank = 0;
  int chunks = 1;  // Placement::stage.chunks
  // Interleaved: the activation slot of each (micro-batch, chunk) of the step's schedule, and
  // per chunk a slot carved for it (forward only runs the chunks through these).
  InterleavedSlots chunk_slots;
  std::vector<int> forward_slot;
  std::unique_ptr<Comm> pp_caller, pp_norm, pp_tied;
  std::vector<GradStats> pp_stats;      // this stage's per-unit statistics, and ...
  std::vector<GradStats> pp_gathered;   // ... every stage's (stage-major)
  // Per micro-batch (interleaved: per micro-batch and chunk, a·v + c): the boundary tensors sent.
  std::vector<ArenaBuffer> act_send, grad_send;
  // kPipelineRecvBuffers each, used alternately (the n-th receive of a direction in the step: n % 2;
  // with one chunk that is micro-batch n): the boundary tensors received
  std::vector<ArenaBuffer> act_recv, grad_recv;
  // The boundary exchange runs in compute-stream order (host functions on the stream's worker,
  // the only thread using pp_stream): a receive is posted when the stream starts the op before
  // the one that needs it, each op waits only for its own receive, and each send leaves once its
  // output is copied. The handles below are written by the worker and read by the caller only
  // after compute->synchronize().
  std::unique_ptr<Comm> pp_stream;
  // Interleaved only: the activation gradients' Comm (pp_stream carries the activations). With
  // p = 2 both directions of a pair go to the same peer, and MPI matches per (pair, Comm) in
  // posting order; a Comm per direction keeps each direction's order its own.
  std::unique_ptr<Comm> pp_stream_grads;
  std::vector<CommWork> act_recv_work, grad_recv_work;  // per receive buffer: its posted receive
  std::vector<CommWork> sends;          // this step's sends, waited at its end
  double pp_stream_wait_seconds = 0.0;  // compute stream's receive waits (worker; read after a sync)
  std::optional<Command> tied_landed;   // host optimizer: the tied unit, landed but not yet summed
  double pp_seconds = 0.0, pp_wait_seconds = 0.0;  // OffloadStats::pipeline_seconds / _wait_seconds
  std::uint64_t pp_bytes = 0;
  // Bytes of checkpoint files this rank wrote (write_checkpoint_file; caller thread).
  std::uint64_t checkpoint_bytes = 0;
  // Writes this rank issued into weights files (save_weights_parallel; caller thread).
  std::uint64_t weights_writes = 0;

  // Counters.
  std::uint64_t accesses = 0, hits = 0, mismatches = 0;
  std::uint64_t early_hits = 0;  // hits on a copy fetched early across steps (prefetch_next_step)
  std::int64_t steps = 0;
  double grad_norm = 0.0;
  std::uint64_t alloc_baseline = 0;
  bool have_baseline = false;

  // ---- helpers ----
  std::uint64_t allocation_count() const {
    return device->memory().stats().allocations + device->pinned().stats().allocations + device->stats().raw_allocs;
  }
  const ModelLayout& layout() const { return model->layout(); }
  // Unit u's gradient offset in the engine's fp32 arrays (UnitPlacement::grad_offset: the
  // layout's grad_begin in one process; packed to the stage's units in a pipeline).
  std::uint64_t grad_begin(int u) const { return placement.units[static_cast<std::size_t>(u)].grad_offset; }
  std::uint64_t param_begin(int u) const { return layout().modules[static_cast<std::size_t>(u)].param_begin; }
  int owner_unit(int index) const {
    const ParamDesc& p = layout().params[static_cast<std::size_t>(index)];
    return p.owns_storage() ? p.module : layout().params[static_cast<std::size_t>(p.tied_with)].module;
  }
  // Steps skipped for overflowing fp16 gradients: they count in `steps` but not in the
  // optimizer's update number or the learning-rate schedule (DeepSpeed's skipped_steps).
  std::int64_t skipped_steps() const { return scaler ? scaler->state().overflows : 0; }
  // The factor the update multiplies gradients by: the clip coefficient of the unscaled norm,
  // over the loss scale. One formula for every placement, so every placement gets the same bits.
  float update_scale(double norm, double loss_scale) const {
    return static_cast<float>(clip_coefficient(norm, config.grad_clip) / loss_scale);
  }
  int owned_index(int index) const {
    const ParamDesc& p = layout().params[static_cast<std::size_t>(index)];
    const int target = p.owns_storage() ? index : p.tied_with;
    for (std::size_t k = 0; k < owned.size(); ++k)
      if (owned[k].index == target) return static_cast<int>(k);
    return -1;
  }
  // A copy with its span on a copy-engine track.
  Status traced_copy(Stream& s, int copy_track, const char* what, void* dst, const void* src, std::uint64_t n,
                     CopyKind kind, int u) {
    STRATA_RETURN_IF_ERROR(tracer.stream_begin(s, copy_track));
    STRATA_RETURN_IF_ERROR(s.copy_async(dst, src, n, kind));
    return tracer.stream_end(
        s, copy_track, kind == CopyKind::kDeviceToHost ? TraceCounter::kD2H : TraceCounter::kH2D, what, u, n);
  }
  // Operations that need every module in this process.
  Status single_stage(const char* what) const {
    if (pp_size == 1) return ok_status();
    return failed_precondition(std::string(what) + " with " + std::to_string(pp_size) +
                               " pipeline stages is not built yet (this stage holds modules " +
                               std::to_string(placement.stage.first) + ".." + std::to_string(placement.stage.end - 1) + ")");
  }
  Status bind(int u) {
    return model->bind_module(u, bound_params[static_cast<std::size_t>(u)], bound_grads[static_cast<std::size_t>(u)]);
  }

  Status setup();
  Status start_worker();
  void stop_worker();
  void worker_main();
  // `done_step`: the engine step the update belongs to (host_opt_step); a unit whose master and
  // moments already hold it only publishes its parameters again (a retry).
  Status update_unit_host(int u, std::int64_t step, double lr, float scale, std::int64_t done_step);
  // Unit u's owned parameters in `out_unit` (its working layout) from fp32 masters at `master`
  // (unit element offset `first`, `n` elements): the rounding the update's param_out does.
  Status working_from_master(int u, const float* master, std::uint64_t first, std::uint64_t n,
                             char* out_unit) const;
  // A caller's entry: reports an update error once, then retries the failed update in place
  // (FailedUpdate); ok once the engine may go on.
  Status recover();
  // Several processes whose failed host update is retried in place (docs/offload.md "Faults").
  // The ranks that update the same units together (data parallel with the optimizer state
  // sharded over them; the tensor group, each rank its shard) agree on every unit before it
  // counts as updated (agree_per_unit, agree_unit), so a failure stops them all at the same unit
  // and none waits in a unit's all-gather its peer skipped. Pipeline stages update different
  // units: each stage's optimizer thread agrees once more at the end of the update
  // (agree_stages) and marks its units updated only then (defer_marks), and a call first waits
  // for the update in flight (recover), so every stage's call sees the same verdict before it
  // sends or receives anything of the next step. That costs the pipeline the overlap of the
  // update with the next step's forward, so it is paid only where the update can fail after the
  // norm (`pp_update_may_fail`: the NVMe optimizer, NVMe gradients or NVMe parameter homes,
  // whose writes can fail); an update in memory cannot (a failed collective is not retried).
  bool agree_per_unit() const { return (placement.sharding.host_state_sharded && dp_params != nullptr) || tp_size > 1; }
  // Units updated as their gradients land, inside the step's call (worker_main's immediate_ok).
  bool update_immediately() const {
    return !delayed && settings.update_during_backward && config.grad_clip <= 0.0 && !fp16 &&
           settings.optimizer == Tier::kHost && !placement.sharding.host_state_sharded && pp_size == 1 &&
           !placement.any_nvme_home();
  }
  // Several processes, the host optimizer: a rank's own failure of a step before its norm (a
  // stream error the caller sees, a failed scan or copy of landed gradients, a gradient read or
  // write) travels as a flag with the statistics that every rank gathers for the norm anyway (the
  // data-parallel all-gather, the stages' and the tensor ranks' gathers: together they reach every
  // rank of the grid), so every rank fails the step alike and none waits in a gather its peer
  // skipped; nothing was updated anywhere and every rank runs the step again. With the delayed
  // update the failing rank's call may have skipped publishing the previous update that its
  // peers published: it publishes it before the step runs again (publish_before_rerun), so every
  // rank reruns at the same parameters. Units updated while they land (update_immediately) are
  // agreed the same way but not retryable: some ranks may have updated some units (sticky, every
  // rank naming the cause and the checkpoint to reload). Not with data parallelism whose
  // optimizer state is not sharded (no statistics gather over the data-parallel group).
  bool agree_before_norm() const {
    return !placement.sharding.optimizer_on_device && (dp_size > 1 || tp_size > 1 || pp_size > 1) &&
           (dp_size == 1 || (placement.sharding.host_state_sharded && dp_params != nullptr));
  }
  // The agreed place of a failing rank in the grid (1 + data-parallel rank + dp * (tensor rank +
  // tp * stage)), 0 for none, and the words naming it.
  float grid_place() const;
  std::string name_grid_place(float place) const;
  bool pp_update_may_fail = false;  // set by setup()
  bool defer_marks() const { return pp_update_may_fail; }
  // Several ranks agreeing per unit, no pipeline: a failed update is reported by the call that
  // waits for the first unit not holding the step (recover, wait_update_of). On a pipeline
  // every call first waits for the verdict instead, and reports it at once.
  bool report_at_wait() const { return agree_per_unit() && !defer_marks(); }
  // Optimizer thread (agree_per_unit): whether every rank's update of unit u succeeded: one
  // 4-byte all-reduce over dp_params, then one over tp_norm, in the update's unit order on every
  // rank. A rank whose own update failed returns its error, the others kUnavailable naming the
  // failing rank; either way no rank marks u (or a later unit) updated.
  Status agree_unit(int u, std::int64_t step, Status own);
  // Optimizer thread (defer_marks): whether every stage's update of `step` succeeded, one
  // all-reduce over pp_norm; the same contract as agree_unit.
  Status agree_stages(std::int64_t step, Status own);
  void note_reported() {
    std::lock_guard<std::mutex> lock(mu);
    if (!worker_error.ok()) failed.reported = true;
  }
  // `step`: the optimizer's update number; `done_step`: the engine step each unit is marked
  // updated for (they differ once fp16 steps were skipped).
  Status update_units_nvme(const std::vector<int>& order, std::int64_t step, double lr, float scale,
                           std::int64_t done_step);
  // NVMe optimizer: one sub-group of a unit streamed through the ring (kNoNvmeGroup: this rank's
  // slice of the unit is empty, or it has no state here but takes part in the unit's collectives).
  static constexpr std::size_t kNoNvmeGroup = SIZE_MAX;
  struct NvmeItem {
    int unit;
    std::size_t group;
  };
  // The sub-groups update_units_nvme streams for the units of `order`, in order.
  std::vector<NvmeItem> nvme_items(const std::vector<int>& order) const;
  // The units step `step`'s update of this stage's NVMe optimizer state covers, in update order
  // (forward order; the delayed update: backward order); a unit that holds the step is left out.
  std::vector<int> nvme_update_order(std::int64_t step) const;
  // Optimizer thread, NVMe optimizer. The reads of [master | m | v] of the first ring.size() - 1
  // sub-groups of step `step`'s update, issued at its first landed unit, while backward still
  // runs: that state does not depend on the gradients, and the previous update (the last to
  // write it) has finished, the optimizer thread running one command at a time. Item k of
  // nvme_items(nvme_update_order(step)) is read into ring buffer k, where update_units_nvme's
  // read of it would go; the update takes over the reads whose sub-group it streams first and
  // waits out any other before it reuses a buffer. Every command but kLanded ends with none in
  // flight (drop_early_reads), so the ring is free and nothing reads stale state between steps
  // (set_param, load_checkpoint and a retry write or read the state only then).
  struct EarlyRead {
    NvmeItem item;
    IoHandle handle;  // invalid for a kNoNvmeGroup item
    std::int64_t issued_at = 0;
  };
  std::vector<EarlyRead> early_reads;
  // The step whose reads were issued (once per step); -1 again after every command but kLanded,
  // so a step that failed before its update and runs again (the same step number) reads early too.
  std::int64_t early_reads_step = -1;
  // OffloadStats::early_optimizer_reads / _dropped: sub-group reads issued during backward, and
  // those of them no update took over (ended by drop_early_reads). Written by the optimizer
  // thread, read by stats().
  std::atomic<std::uint64_t> early_reads_issued{0}, early_reads_dropped{0};
  void issue_early_reads(std::int64_t step);
  void drop_early_reads();
  Status publish_params(int u, const char* bytes);
  void mark_updated(int u, std::int64_t step);
  // Unit u's update of `step` is done on this rank: marked updated, or on a pipeline
  // (defer_marks) recorded in stage_done until every stage agreed.
  void unit_done(int u, std::int64_t step) {
    if (defer_marks()) {
      stage_done[static_cast<std::size_t>(u)] = step;
    } else {
      mark_updated(u, step);
    }
  }
  // Whether unit u's update of `step` is done here (a retry skips it).
  bool unit_holds(int u, std::int64_t step) const {
    const std::size_t uu = static_cast<std::size_t>(u);
    return (defer_marks() ? stage_done[uu] : updated_step[uu]) >= step;
  }
  Status check_worker();
  // Waits until unit u holds step `step`'s update (wait_updated: the last step's).
  // `report`: a failed update's error returned here counts as reported (report_at_wait).
  Status wait_update_of(int u, std::int64_t step, bool report = true);
  Status wait_updated(int u, bool report = true) { return wait_update_of(u, steps, report); }
  // Waits for every update in flight; `publish` (the default): a delayed update is uploaded too,
  // so the device holds the latest parameters.
  Status wait_all_updates(bool publish = true);
  // Delayed update: waits for step pending_publish's update of every unit and enqueues the
  // uploads of the new working parameters on h2d (uploaded[u]). Compute must not be reading them.
  Status publish_delayed();
  // Optimizer thread, delayed update: before unit u's host copy is rewritten, the upload that
  // reads it (enqueued by publish_delayed before this update was released) must have finished.
  Status await_upload(int u);
  // Waits until the optimizer thread has processed every command (whatever its error state).
  void drain_worker();
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

  // The pass.
  void begin_pass();
  void note_access(int code);
  int predicted(std::size_t j) const;
  Status access_params(int m);
  Status release_after(int m);
  // The units of the accesses [from, from + prefetch_modules) of the trace fetched into free
  // slots, within prefetch_elements. `gate_step` < 0: the pass in progress; a unit whose update
  // is still running is fetched gated by it (gated_in_pass) or waited for by the caller first.
  // Otherwise (prefetch_next_step) nothing waits on the caller: each fetch is gated on the h2d
  // stream by its unit's update of `gate_step` (fetch).
  Status prefetch_ahead(std::size_t from, std::int64_t gate_step = -1);
  // Whether a pass's prefetch of unit u, whose update is still running, is gated on the h2d
  // stream rather than waited for by the caller: not with the delayed update (the pass reads the
  // published version) and not for a unit all-gathered across ranks (stage 3: every rank must
  // issue the same fetches, and whether an update is done differs between ranks).
  bool gated_in_pass(int u) const {
    return !delayed && !placement.units[static_cast<std::size_t>(u)].gathered_at_fetch;
  }
  bool next_step_fetches = false;  // prefetch_next_step is issuing (ParamSlot::next_step)
  // Caller, once a step returned (its norm known, its update released to the optimizer thread):
  // the first accesses of the next pass fetched early, each as soon as its unit's update is
  // published, so a pass no longer begins with nothing in flight (docs/offload.md "One step").
  Status prefetch_next_step();
  // `gate_step` >= 0: an early fetch (ParamSlot::early), whose h2d work first waits, on the h2d
  // stream, until unit u holds that step's update or the optimizer thread failed.
  Result<int> fetch(int u, int current_module, std::int64_t gate_step = -1);
  // A fetched copy of unit u that is no longer its home's (set_param, loading state) forgotten.
  Status forget_fetched(int u);
  // Whether an early fetch's gate has ended its wait or will without waiting (mu held).
  bool gate_open(const ParamSlot& slot) const;
  Status release_slot(int s);
  Status end_pass();
  Status acquire_grads(int m, bool first_micro);
  Status release_grads(int m, bool first_micro, bool last_micro, std::int64_t step, double lr);
  // Data parallel: unit u's gradients reduce-scattered into this rank's slice on the gradient
  // stream (from rs_send, where release_grads copied them).
  Status enqueue_reduce(int u, bool first_micro, bool last_micro, std::int64_t step);
  // keep_modules after a failure: the reduce-scatters of the units whose last touch is module m,
  // on whatever rs_send holds, so the data-parallel peers' collectives find this rank.
  Status reduce_after_failure(int m, bool first_micro, bool last_micro, std::int64_t step);
  // Data parallel.
  Status setup_data_parallel();
  // `values` summed over the data-parallel ranks, in rank order (the same bits on every rank).
  Status sum_over_ranks(std::span<double> values);
  // Gradient stream: unit u's gradients (in rs_send) reduce-scattered; this rank's slice stored
  // into (or, accumulate, added to) shard_grads. Gradients on NVMe: the slice is read back
  // through grad_staging to accumulate, scanned into landed_stats[u] when `scan` (the step's
  // final slice; the same scan the optimizer thread does on shard_grads) and written to NVMe.
  Status reduce_unit_grads(int u, bool accumulate, bool scan, float inv_scale);
  // A collective's wait, timed on the data-parallel track; errors name what it was for.
  Status dp_wait(int trace_track, CommWork w, const char* what, int u, std::uint64_t bytes);
  Status all_reduce_device_grads();  // optimizer on the device: stage 0 (pipeline, cuda)
  // Gradient buckets. Caller thread: open_buckets before module m's backward (a bucket's buffer
  // taken and zeroed, its units bound), close_buckets after it (each bucket finished there gets its
  // collective launched by a compute-stream host function). Compute thread: launch_bucket,
  // finish_through (this rank's slices of reduced buckets copied or added into offload.grads),
  // drain_buckets (every collective in flight waited and finished, in launch order; before the
  // update). run_micro_batches waits out and drops a failed step's collectives first.
  Status open_buckets(int m);
  Status close_buckets(int m, bool first_micro, bool last_micro, std::int64_t step);
  Status launch_bucket(int b, int buf, bool accumulate);  // buf: the bucket's buffer (stage >= 2)
  // Stage >= 2: the buckets in flight finished in launch order, up to and including the one in
  // buffer `buf` (all of them with -1); none when `buf` has none in flight.
  Status finish_through(int buf);
  Status drain_buckets();
  // Stage 3. A unit's working parameters between its layout (param_in_unit) and the fp32
  // element positions (grad_in_unit / 4, `w` bytes each) in which it is sliced.
  void to_elements(int u, const char* working, char* elements) const;
  void from_elements(int u, const char* elements, char* working) const;
  // This rank's slice (len x w bytes) at the unit's home, and back.
  Status read_param_slice(int u, char* slice);
  // `next`: the delayed update's next version (publish_delayed makes it the published one);
  // otherwise the published slice (initialisation, set_param, load_checkpoint).
  Status write_param_slice(int u, const char* slice, bool next = false);
  // The unit gathered from every rank's slice into `working` (its layout), on `comm` (collective):
  // `send` holds chunk elements, `recv` size x chunk. `agree`: the ranks first exchange whether
  // they read their slice (agree_on_read), so a rank whose read failed still takes part and every
  // rank returns the same error at once (state access: checkpoints, save_weights, get_param);
  // the h2d stream's fetches pass false (a failed fetch fails the step, and the comm timeout
  // ends its peers).
  Status gather_unit_params(int u, Comm& comm, int trace_track, char* send, char* recv, char* working,
                            bool agree = false);
  // h2d stream, stage 3: an early fetch's gather (prefetch_next_step). `mine`: this rank's gate
  // saw the unit's agreed mark; its slice is then read. Every rank exchanges whether it holds its
  // slice of that version (a 4-byte all-reduce over dp.fetch, issued by every rank for every
  // early fetch, in the same h2d order), and gathers the unit only when all do: `early_ok` is then
  // set, the same on every rank, so every rank's pass takes the copy or refetches (all-gathers)
  // alike (docs/offload.md "Early fetch across steps", stage 3). Neither a closed gate nor a
  // failed read is an error here; a failed exchange or gather is (the comm itself failed).
  Status early_gather_unit_params(int u, bool mine, char* working, std::atomic<bool>* early_ok);
  // The part both share: this rank's slice of unit u read into send[0, len), padded to the chunk,
  // all-gathered over `comm` into recv and laid out as the whole unit in `working`.
  Status gather_read_slice(int u, Comm& comm, int trace_track, char* send, char* recv, char* working);
  // Collective over `comm` (every rank of it calls it at the same point): each rank's outcome
  // of the read before a collective, `mine`, exchanged (a flag, the status code and the first
  // bytes of the message, kAgreeWords words per rank). OK when every rank read; otherwise every
  // rank returns the same error, naming the lowest failing rank of `group` ("data-parallel",
  // "tensor-parallel") and `what`, with that rank's message. Lets a rank that cannot read its
  // part keep its place in the collectives instead of leaving its peers to the comm timeout.
  static constexpr std::size_t kAgreeWords = 64;
  // `verb` names what failed ("read"; the pipeline checkpoint's stages agree on "write").
  Status agree_on_read(Comm& comm, const Status& mine, const std::string& what, const char* group,
                       const char* verb = "read");
  // The exchange agree_on_read makes: OK when every rank of `comm` succeeded, else the lowest
  // failing rank's status as that rank had it (its code and the first bytes of its message), its
  // rank in `*failing` where given; a failed exchange is returned with context naming `verb` and
  // `what` ("exchanging whether each could write its part of the weights"; `*failing` = -1).
  Status first_failure(Comm& comm, const Status& mine, const std::string& what, const char* group,
                       int* failing = nullptr, const char* verb = "read");
  // A checkpoint file written (SafetensorsWriter::write: temporary name, fsync, rename) and its
  // bytes added to checkpoint_bytes. Caller thread.
  Status write_checkpoint_file(const SafetensorsWriter& w, const std::string& path);
  // Whether a state read can fail on one rank alone: NVMe reads (I/O errors, checksums) can; host
  // memcpy cannot, and a device download failing on one rank only is left out. The same on every
  // rank (the settings are), so the exchanges above are skipped, on every rank alike, where
  // nothing can fail: state access costs no extra collective without NVMe.
  bool state_reads_can_fail() const {
    return settings.params == Tier::kNvme || settings.optimizer == Tier::kNvme ||
           settings.gradients == Tier::kNvme;
  }
  // The gradients the optimizer thread scans for unit u: this rank's slice when sharded.
  std::pair<char*, std::uint64_t> unit_grads(int u) const {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (placement.sharding.host_state_sharded) return {shard_grads.bytes() + 4 * placement.units[uu].slice_offset, placement.units[uu].slice.len};
    return {host_at(host_grads, grad_begin(u)), placement.units[uu].grad_bytes / 4};
  }
  // A pipeline stage that keeps its place through a caller error inside a module's work
  // (run_pipeline sets it: tensor or data parallelism in the stage, the cpu backend, the
  // optimizer on the host, stages 0-2).
  bool keep_modules = false;
  // The first such error of this pass: the compute stream was failed with it, and every later
  // module of the pass enqueues only the model's work (its kernels skipped, its tensor-parallel
  // collectives run) and its data-parallel reduce-scatters, so this rank still issues every
  // collective of the pass.
  Status pass_error;
  // Around a module: `s`, an error of the engine's work for module m, ends the pass, or (with
  // keep_modules) fails the compute stream with it and continues in the failed mode above.
  Status keep_module_place(Status s);
  // The modules of chunk_ranges[chunk] (the whole model, or the stage's only range, for chunk 0).
  Status run_forward(bool for_backward, int chunk = 0);
  Status run_backward(float dloss, bool first_micro, bool last_micro, std::int64_t step, double lr,
                      int chunk = 0);
  Status run_micro_batches(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets,
                           std::int64_t micro, bool update, std::int64_t step, double lr);
  // Pipeline parallel.
  Status setup_pipeline();
  Status run_pipeline(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets,
                      std::int64_t micro, float dloss, std::int64_t step, double lr);
  // `stats` (per unit, this stage's) merged over the stages in unit order, each unit's from the
  // lowest stage holding it: the single process's merge (collective over pp_norm).
  // `stats`' first M records are used; `verdict` as in merge_over_tp.
  Result<GradStats> merge_stage_stats(const std::vector<GradStats>& stats, float* verdict = nullptr);
  // The tied unit's gradient (`n` elements at `grads`: the whole unit, or this data-parallel
  // rank's slice of it, the same slice on both ends) summed over the first and the last stage
  // (collective).
  Status reduce_tied_grads(float* grads, std::size_t n);
  // Caller, after the schedule: the host optimizer's tied unit summed over the first and the
  // last stage (reduce_tied_grads), from host memory or, gradients on NVMe, read back, summed,
  // rescanned into landed_stats and written again.
  Status sum_tied_landed(const Command& c);
  DType wire_dtype() const { return half ? DType::kBF16 : DType::kF32; }  // 16-bit: moved as bits
  // Bytes of one boundary tensor of a training micro-batch: the residual stream's rows this rank
  // holds (sequence parallel: its 1/tp of them, exchanged with the same tp rank of the neighbour
  // stage, which holds the same rows), times the width, in the working dtype.
  std::uint64_t boundary_bytes() const {
    const std::int64_t sp = settings.sequence_parallel ? tp_size : 1;
    return static_cast<std::uint64_t>(config.micro_batch * config.seq_len / sp * config.model.n_embd) *
           dtype_size(wdtype);
  }
  // The stage whose copy of unit u counts (the lowest stage holding it: GPT-2's tied embedding
  // is the first stage's); 0 without a pipeline.
  int holder(int u) const { return pp_size > 1 ? placement.units[static_cast<std::size_t>(u)].holder_stage : 0; }
  // `bytes` (even) of host memory to / from stage `peer` over pp_caller, as raw 16-bit words in
  // pieces within a Comm call's element limit. Caller thread; waits.
  Status pp_send_bytes(const void* data, std::uint64_t bytes, int peer, const std::string& what);
  Status pp_recv_bytes(void* data, std::uint64_t bytes, int peer, const std::string& what);
  // Forward only of the batch set on the model through this stage: receive the input from the
  // previous stage, run the stage's modules, send the output to the next (loss, evaluate).
  Status forward_stage();
  // Every rank writes the part of the weights file it holds (docs/checkpoints.md "Who writes the
  // weights file"); collective over every group.
  // True once written; false when not every rank sees the file the first rank created (no file
  // system shared at the path) and there is no pipeline: the caller takes the gather path.
  Result<bool> save_weights_parallel(const std::string& path, WeightFormat format);
  // first_failure over the tensor-, then the data-parallel, then the pipeline group (those this
  // rank has): every rank of the grid ends with the same lowest failing rank's status.
  Status agree_everywhere(const Status& mine, const std::string& what, const char* verb);
  // Step 2 of it: this rank's elements of the parameters it writes, encoded and pwritten into
  // the temporary file, fsync'd. Errors start with rank_name().
  Status write_weights_part(const std::string& path, WeightFormat format, const ModelLayout& full,
                            const SafetensorsHeader& header);
  // `n` words from the writer (tp 0, dp 0, stage 0) to every rank: over the tensor-parallel
  // groups, the data-parallel groups, then the pipeline groups (collective over all three).
  Status broadcast_from_writer(std::uint32_t* words, std::size_t n, const char* what);
  // This rank in its groups, for errors: "pipeline stage 1, tensor-parallel rank 0 of 2".
  std::string rank_name() const;
  Result<std::string> save_checkpoint_pp(const std::string& root, const CheckpointManifest& manifest,
                                         int keep);
  Status device_update(double lr, std::int64_t step);
  // The sharded device optimizer's step (dev_sharded; cpu backend), one host function on the
  // compute stream after backward: per unit the reduce-scatter of its gradients into this
  // rank's slice, the scan of the slice; the statistics all-gathered and merged unit by unit in
  // rank order; then per unit the update of the slice and the all-gather of its parameters.
  Status device_update_sharded(double lr, std::int64_t step);
  // This rank's slice of unit u updated with the device optimizer, cut per parameter where the host
  // update of the slice cuts it (the same kernels on the same ranges: the same bits). grad_at(lo):
  // the fp32 gradient of the unit's element lo; param_at(o, lo): that element's working word in
  // parameter o. The updated working words are copied to ag_in (the all-gather's input, element e
  // at (e - begin) * w) unless it is null.
  template <class GradAt, class ParamAt>
  Status update_slice(int u, double lr, std::int64_t step, float scale, GradAt grad_at, ParamAt param_at,
                      char* ag_in);
  // Optimizer state of a device unit (which: 1 master, 2 exp_avg, 3 exp_avg_sq): where its part
  // starts in the device region, and which elements [first, first + len) of the unit it holds
  // (the whole unit, or this rank's slice when dev_sharded).
  char* dev_state(int u, int which) const {
    const float* base = which == 1 ? dmaster : which == 2 ? dm : dv;
    const std::uint64_t off = placement.sharding.device_state_in_slices() ? 4 * placement.units[static_cast<std::size_t>(u)].slice_offset : grad_begin(u);
    return const_cast<char*>(reinterpret_cast<const char*>(base)) + off;
  }
  std::uint64_t dev_state_first(int u) const {
    return placement.sharding.device_state_in_slices() ? placement.units[static_cast<std::size_t>(u)].slice.begin : 0;
  }
  std::uint64_t dev_state_len(int u) const {
    return placement.sharding.device_state_in_slices() ? placement.units[static_cast<std::size_t>(u)].slice.len
                        : placement.units[static_cast<std::size_t>(u)].grad_bytes / 4;
  }
  // Partial optimizer offload, in compute order: the device units' gradient scans into
  // dev_stats (after backward), and their update once the step's norm is known.
  Status scan_device_units();
  Status update_device_units(double lr, std::int64_t step, float scale);
  // Partial offload with data parallelism (part_dp), on the compute stream: the device units'
  // reduce-scatter into this rank's slices (`accumulate`: stage 2's later micro-batches add to
  // offload.grad_slices), and the update of the slices with the all-gather of their parameters.
  // `chunk` >= 0: only the device units chunk `chunk` of this stage reads (dev_units_of_chunk).
  Status reduce_device_units(bool accumulate, int chunk = -1);
  // Zeroes the device units' gradients of chunk `chunk` (all of them for -1) on the compute stream.
  Status zero_device_grads(int chunk = -1);
  Status update_device_units_sharded(double lr, std::int64_t step, float scale);
  // The reduced gradients of this rank's slice of device unit u (part_dp).
  float* dev_slice_grads(int u) const {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (settings.zero_stage >= 2) return dgrad_slices + placement.units[uu].slice_offset;
    return reinterpret_cast<float*>(reinterpret_cast<char*>(dgrads) + grad_begin(u)) + placement.units[uu].slice.begin;
  }
  // The device optimizer's buffers of parameter o (master, gradient, moments in the device
  // regions; the working copy in the resident block), for the cpu backend's update.
  OptimizerBuffers device_buffers(const OwnedParam& o) const;

  // State access (not on the hot path).
  Status read_unit_params(int u, std::vector<char>& bytes);
  Status write_unit_params(int u, const std::vector<char>& bytes);
  // [master | m | v], host/nvme tiers. `before`: the outcome of this rank's reads so far for the
  // unit (its parameters): sharded, the ranks exchange it with their own reads' before the gather
  // (every tier), so a failure anywhere fails the unit on every rank instead of stalling the gather.
  Status read_unit_optim(int u, std::vector<float>& blob, const Status& before = Status());
  Status write_unit_optim(int u, const std::vector<float>& blob);
  // NVMe gradients: unit u's fp32 gradients as swap shards "grad.<u>" (the optimizer's sub-groups).
  // Data parallel: this rank's reduced slice only (the sub-groups cut that slice), `buf` holding
  // the slice; the unsharded local gradients that stage 1 carries between micro-batches go to
  // one key "grad_local.<u>" (local_grads_io) instead.
  Status write_grad_shards(int u, const char* src);
  Status read_grad_shards(int u, char* dst);
  Status grad_shards_io(int u, char* buf, bool write);
  Status local_grads_io(int u, char* buf, bool write);
  Status write_values(int index, std::span<const float> values, bool master_too);
  Result<std::vector<float>> read_state(int index, int which);  // 0 working, 1 master, 2 m, 3 v
  // A unit's working parameters and [master | m | v] (fp32 layout) for every placement.
  Status read_unit_state(int u, std::vector<char>& pbytes, std::vector<float>& blob);
  Status write_unit_state(int u, const std::vector<char>& pbytes, const std::vector<float>& blob);
  // Parameter o's fp32 master (16-bit working weights, optimizer on the device) from its `values`:
  // the part in this rank's elements of the device state.
  Status upload_dev_master(const OwnedParam& o, const float* values);
  Status initialize();

  // Tensor parallel.
  // Collective over both groups: every rank gathers every full parameter's state, then the first
  // rank of both writes the single-process checkpoint; the outcome is broadcast back.
  Result<std::string> save_checkpoint_tp(const std::string& root, const CheckpointManifest& manifest, int keep);
  Status setup_tensor_parallel();
  // This rank's part of the gradient norm over `n` fp32 gradients at `grads`, elements
  // [first, first + n) of unit u's layout (the unit, or this rank's data-parallel slice of it).
  Result<GradStats> scan_norm(const CpuOptimizer& opt, int u, const char* grads, std::uint64_t first,
                              std::uint64_t n, float inv_scale) const;
  // The statistics of every tensor-parallel rank merged in rank order (the same bits on every rank).
  // `verdict` (optional): this rank's failure flag in, the max over the group out; it travels
  // as one more record of the same gather.
  Result<GradStats> merge_over_tp(const GradStats& local, Comm& comm, float* verdict = nullptr) const;
  // State `which` (read_state) of the full parameter: this rank's shard gathered over the group.
  Result<std::vector<float>> read_full(int index, int which);
  Status write_full(int index, std::span<const float> values);
};

// ---- setup ------------------------------------------------------------------------------------

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
  STRATA_ASSIGN_OR_RETURN(ModelLayout lay, describe_model(config.model, TensorParallel{tp_size, tp_rank}));
  // Gradient buckets: stage 0's all-reduce on the cpu backend only (cuda keeps the one all-reduce
  // after backward: a stream's host function may not call NCCL), and stage >= 2's reduce-scatter
  // (the sharded device optimizer is cpu-only, check_data_parallel).
  partition::Ranks ranks;
  ranks.dp_rank = dp != nullptr ? dp->rank() : 0;
  ranks.tp_rank = tp_rank;
  ranks.cuda = dev.info().kind == DeviceKind::kCuda;
  placement = partition::Placement::build(lay, settings, ranks);
  STRATA_RETURN_IF_ERROR(placement.is_valid());
  pp_update_may_fail = pp_size > 1 && !placement.sharding.optimizer_on_device &&
                       (settings.optimizer == Tier::kNvme || settings.gradients == Tier::kNvme ||
                        placement.any_nvme_home());
  M = static_cast<int>(lay.modules.size());
  dev_stats.assign(static_cast<std::size_t>(M), GradStats{});
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
  mo.tensor_parallel = tp_model.get();
  mo.sequence_parallel = settings.sequence_parallel;
  mo.offload_activations = settings.offload_activations;
  chunks = placement.stage.chunks;
  if (pp_size > 1) {
    if (chunks == 1) {
      mo.first_module = placement.stage.first;
      mo.end_module = placement.stage.end;
      mo.activation_slots =
          pipeline_slots(settings.pipeline_schedule, pp_size, pp_rank, static_cast<int>(config.grad_accum));
    } else {
      // Slots carved per (micro-batch, chunk), as many as the schedule's peak of live chunk
      // forwards (docs/parallel.md "Schedules").
      mo.module_ranges = placement.stage.chunk_ranges;
      STRATA_ASSIGN_OR_RETURN(chunk_slots, interleaved_slot_assignment(pp_size, pp_rank, chunks,
                                                                       static_cast<int>(config.grad_accum)));
      mo.activation_slots = static_cast<int>(chunk_slots.slot_chunks.size());
      mo.slot_ranges = chunk_slots.slot_chunks;
      forward_slot.assign(static_cast<std::size_t>(chunks), -1);
      for (int k = mo.activation_slots - 1; k >= 0; --k) {
        for (int c : chunk_slots.slot_chunks[static_cast<std::size_t>(k)])
          forward_slot[static_cast<std::size_t>(c)] = k;
      }
    }
  }
  // Every device unit is read by the modules of one chunk of this stage (device_units_of_chunk
  // partitions device_units): pipeline x data parallel at stages 2-3 reduces a chunk's list after
  // each of its backward ops (run_pipeline).
  for (int u : placement.stage.device_units) {
    if (placement.units[static_cast<std::size_t>(u)].several_chunks)
      return internal_error("offload: device module " + std::to_string(u) + " is read by several chunks of this stage");
    if (placement.units[static_cast<std::size_t>(u)].chunk < 0)
      return internal_error("offload: device module " + std::to_string(u) + " is read by no chunk");
  }
  STRATA_ASSIGN_OR_RETURN(model, Model::create(std::move(lay), dev, *compute, mo));
  const ModelLayout& L = layout();

  Arena& arena = dev.memory();
  char* base = static_cast<char*>(arena.base());
  STRATA_ASSIGN_OR_RETURN(std::uint64_t roff,
                          arena.allocate_persistent("offload.params", std::max<std::uint64_t>(placement.sizes.resident_bytes, 1)));
  resident = base + roff;
  bound_params.assign(static_cast<std::size_t>(M), nullptr);
  bound_grads.assign(static_cast<std::size_t>(M), nullptr);
  for (int u = 0; u < M; ++u) {
    if (placement.resident(u))  // a sliced unit (stage 3 in device memory) is bound to its slot when fetched
      bound_params[static_cast<std::size_t>(u)] = resident + placement.units[static_cast<std::size_t>(u)].resident_offset;
  }
  if (placement.sharding.optimizer_on_device || placement.sharding.optimizer_split) {
    // Stage >= 2 (grad_sharded): this rank's slices of the gradients only.
    const std::uint64_t dbytes = placement.sharding.device_grads_sharded   ? offload_detail::device_state_bytes(placement)
                                 : placement.sharding.optimizer_on_device ? placement.sizes.grad_bytes
                                                 : placement.sizes.device_opt_bytes;
    dgrad_bytes = dbytes;
    // Sharded (dev_sharded): the state regions hold this rank's slices only.
    // Partial offload with data parallelism: this rank's slices of the device units.
    const std::uint64_t sbytes = placement.sharding.optimizer_on_device ? offload_detail::device_state_bytes(placement)
                                 : placement.sharding.split_state_sharded     ? 4 * placement.slices.dev_elements
                                               : placement.sizes.device_opt_bytes;
    auto carve = [&](const char* name, std::uint64_t bytes) -> Result<float*> {
      STRATA_ASSIGN_OR_RETURN(std::uint64_t off,
                              arena.allocate_persistent(name, std::max<std::uint64_t>(bytes, 1)));
      STRATA_RETURN_IF_ERROR(compute->memset_async(base + off, 0, bytes));
      return reinterpret_cast<float*>(base + off);
    };
    STRATA_ASSIGN_OR_RETURN(dgrads, carve("offload.grads", dbytes));
    if (half) {
      STRATA_ASSIGN_OR_RETURN(dmaster, carve("optim.master", sbytes));
    }
    STRATA_ASSIGN_OR_RETURN(dm, carve("optim.exp_avg", sbytes));
    STRATA_ASSIGN_OR_RETURN(dv, carve("optim.exp_avg_sq", sbytes));
    if (placement.sharding.device_state_sharded) {
      float* staging = nullptr;
      STRATA_ASSIGN_OR_RETURN(staging, carve("offload.dp_staging", offload_detail::device_dp_staging_bytes(
                                                                       placement, half ? 2 : 4)));
      dev_staging = reinterpret_cast<char*>(staging);
    }
    if (placement.sharding.split_state_sharded) {
      float* staging = nullptr;
      STRATA_ASSIGN_OR_RETURN(staging, carve("offload.dp_staging", offload_detail::split_dp_staging_bytes(
                                                                       placement, half ? 2 : 4)));
      dev_staging = reinterpret_cast<char*>(staging);
      if (settings.zero_stage >= 2) {
        STRATA_ASSIGN_OR_RETURN(dgrad_slices, carve("offload.grad_slices", 4 * placement.slices.dev_elements));
      }
    }
    if (placement.sharding.device_grads_sharded) {
      // Backward writes into bucket buffers, bound per bucket (open_buckets).
      for (std::uint32_t i = 0; i < placement.buckets.slots(settings); ++i) {
        STRATA_ASSIGN_OR_RETURN(std::uint32_t idx, arena.acquire_slot("offload.grad_buckets"));
        STRATA_ASSIGN_OR_RETURN(std::uint64_t off, arena.slot_offset("offload.grad_buckets", idx));
        bucket_buf.push_back(base + off);
      }
      bucket_buf_owner.assign(bucket_buf.size(), -1);
      bucket_buf_freed.assign(bucket_buf.size(), 0);
    } else {
      for (int u = 0; u < M; ++u)
        if (placement.device_state(u))
          bound_grads[static_cast<std::size_t>(u)] = reinterpret_cast<float*>(reinterpret_cast<char*>(dgrads) + grad_begin(u));
    }
    bucket_buf_of.assign(placement.buckets.buckets.size(), -1);
  }
  STRATA_RETURN_IF_ERROR(compute->memset_async(resident, 0, placement.sizes.resident_bytes));
  for (int u = 0; u < M; ++u) STRATA_RETURN_IF_ERROR(bind(u));

  STRATA_RETURN_IF_ERROR(setup_data_parallel());
  STRATA_RETURN_IF_ERROR(setup_pipeline());

  // Slots and buckets.
  slot_of.assign(static_cast<std::size_t>(M), -1);
  gslot_of.assign(static_cast<std::size_t>(M), -1);
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
      STRATA_ASSIGN_OR_RETURN(slot.staging, HostMem::make(dev, true, placement.sizes.param_slot_bytes, "offload.fetch_staging"));
    }
    pslots.push_back(std::move(slot));
  }
  for (std::uint32_t s = 0; s < placement.sizes.grad_slots; ++s) {
    GradSlot slot;
    STRATA_ASSIGN_OR_RETURN(std::uint32_t idx, arena.acquire_slot("offload.grad_slots"));
    STRATA_ASSIGN_OR_RETURN(std::uint64_t off, arena.slot_offset("offload.grad_slots", idx));
    slot.dev = reinterpret_cast<float*>(base + off);
    STRATA_ASSIGN_OR_RETURN(slot.done, dev.create_event());
    STRATA_ASSIGN_OR_RETURN(slot.free, dev.create_event());
    STRATA_ASSIGN_OR_RETURN(slot.ready, dev.create_event());
    gslots.push_back(std::move(slot));
  }

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

  // Host tiers.
  const bool pin = settings.pin_memory;
  if (!placement.sharding.optimizer_on_device) {
    grads_on_nvme = settings.gradients == Tier::kNvme;
    if (grads_on_nvme) {
      STRATA_ASSIGN_OR_RETURN(grad_staging, HostMem::make(dev, true, placement.sizes.grad_slot_bytes, "offload.grad_staging"));
      landed_stats.assign(static_cast<std::size_t>(M), GradStats{});
    } else if (placement.sharding.host_state_sharded) {
      // Unsharded gradients only to carry stage 1's accumulation between micro-batches.
      if (settings.zero_stage < 2 && config.grad_accum > 1) {
        STRATA_ASSIGN_OR_RETURN(host_grads,
                                HostMem::make(dev, pin, placement.sizes.grad_bytes - placement.sizes.device_opt_bytes, "offload.host_grads"));
      }
    } else {
      STRATA_ASSIGN_OR_RETURN(host_grads, HostMem::make(dev, pin, placement.sizes.grad_bytes - placement.sizes.device_opt_bytes, "offload.host_grads"));
    }
    STRATA_ASSIGN_OR_RETURN(host_params, HostMem::make(dev, pin, placement.sizes.host_params_held, "offload.host_params"));
    if (delayed) {
      // The delayed update's second version of every off-device unit (delayed_next, param_shard;
      // stage 3: of this rank's slice only, what write_param_slice writes).
      param_shard.assign(static_cast<std::size_t>(M), 0);
      next_fresh.assign(static_cast<std::size_t>(M), 0);
      if (placement.sizes.delayed_next_bytes > 0) {
        STRATA_ASSIGN_OR_RETURN(delayed_next, HostMem::make(dev, pin, placement.sizes.delayed_next_bytes,
                                                            "offload.delayed_next_params"));
      }
    }
    for (int u = 0; u < M; ++u) {
      std::unique_ptr<Event> e;
      STRATA_ASSIGN_OR_RETURN(e, dev.create_event());
      landed.push_back(std::move(e));
      STRATA_ASSIGN_OR_RETURN(e, dev.create_event());
      uploaded.push_back(std::move(e));
    }
    uploaded_recorded.assign(static_cast<std::size_t>(M), 0);
    CpuOptimizerConfig oc;
    STRATA_ASSIGN_OR_RETURN(oc.isa, select_optimizer_isa(config.optimizer_isa));
    oc.threads = settings.host_threads > 0 ? settings.host_threads : dev.cpu_budget().host_threads;
    STRATA_ASSIGN_OR_RETURN(CpuOptimizer opt, CpuOptimizer::create(oc));
    host_opt = opt;
  }
  if (settings.optimizer == Tier::kHost) {
    const std::uint64_t bytes = placement.sharding.host_state_sharded ? 4 * placement.slices.shard_elements : placement.sizes.grad_bytes - placement.sizes.device_opt_bytes;
    STRATA_ASSIGN_OR_RETURN(host_master, HostMem::make(dev, pin, bytes, "offload.master"));
    STRATA_ASSIGN_OR_RETURN(host_m, HostMem::make(dev, pin, bytes, "offload.exp_avg"));
    STRATA_ASSIGN_OR_RETURN(host_v, HostMem::make(dev, pin, bytes, "offload.exp_avg_sq"));
  }
  if (placement.sharding.host_state_sharded) {
    const std::uint64_t P = static_cast<std::uint64_t>(dp_size), c = placement.slices.max_chunk;
    const std::uint64_t w = half ? 2 : 4;
    if (!grads_on_nvme) {  // on NVMe: only this rank's slices' keys, through grad_staging
      STRATA_ASSIGN_OR_RETURN(shard_grads, HostMem::make(dev, pin, 4 * placement.slices.shard_elements, "offload.dp_grads"));
    }
    STRATA_ASSIGN_OR_RETURN(rs_send, HostMem::make(dev, pin, 4 * P * c, "offload.dp_reduce"));
    STRATA_ASSIGN_OR_RETURN(rs_recv, HostMem::make(dev, pin, 4 * c, "offload.dp_reduce"));
    STRATA_ASSIGN_OR_RETURN(ag_send, HostMem::make(dev, pin, w * c, "offload.dp_gather"));
    STRATA_ASSIGN_OR_RETURN(ag_recv, HostMem::make(dev, pin, w * P * c, "offload.dp_gather"));
    flagged_stats.assign(static_cast<std::size_t>(M) + 1, GradStats{});
    flagged_gathered.assign(static_cast<std::size_t>(dp_size) * (static_cast<std::size_t>(M) + 1), GradStats{});
  }
  if (any_psharded) {
    const std::uint64_t P = static_cast<std::uint64_t>(dp_size), c = placement.slices.max_chunk, w = half ? 2 : 4;
    STRATA_ASSIGN_OR_RETURN(fetch_send, HostMem::make(dev, true, w * c, "offload.dp_fetch"));
    STRATA_ASSIGN_OR_RETURN(fetch_recv, HostMem::make(dev, true, w * P * c, "offload.dp_fetch"));
  }
  if (settings.optimizer == Tier::kNvme) {
    for (std::uint32_t r = 0; r < placement.sizes.ring_buffers; ++r) {
      STRATA_ASSIGN_OR_RETURN(HostMem h, HostMem::make(dev, true, placement.sizes.ring_buffer_bytes, "offload.optim_ring"));
      ring.push_back(std::move(h));
    }
    for (HostMem& h : param_out) {
      STRATA_ASSIGN_OR_RETURN(h, HostMem::make(dev, true, placement.sizes.param_out_bytes, "offload.param_out"));
    }
  }
  if (any_nvme_home && settings.optimizer == Tier::kHost) {
    STRATA_ASSIGN_OR_RETURN(param_out_staging,
                            HostMem::make(dev, true, placement.sizes.param_slot_bytes, "offload.param_out_staging"));
  }
  if (any_nvme_home || settings.optimizer == Tier::kNvme) {
    IoEngineConfig ioc = settings.io;
    ioc.nvme_path = settings.nvme_path;
    if (dev.cpu_budget().pin) ioc.cpus = dev.cpu_budget().host;
    if (io_faults != nullptr) {
      STRATA_ASSIGN_OR_RETURN(io, nvme_detail::IoFaults::create_engine(ioc, &dev.pinned(), io_faults));
    } else {
      STRATA_ASSIGN_OR_RETURN(io, IoEngine::create(ioc, &dev.pinned()));
    }
    SwapStoreConfig sc;
    sc.dirs = settings.nvme_path;
    sc.capacity = plan.swap_bytes;
    sc.scratch = settings.nvme_scratch;
    STRATA_ASSIGN_OR_RETURN(swap, SwapStore::open(*io, sc));
  }

  // The device optimizer.
  STRATA_ASSIGN_OR_RETURN(launch, detail::KernelLauncher::create(dev, *compute, 0));
  std::uint64_t largest = 4096;
  for (const auto& p : L.params) largest = std::max<std::uint64_t>(largest, static_cast<std::uint64_t>(p.numel()) * 4);
  for (const partition::UnitPlacement& u : placement.units) largest = std::max(largest, u.param_bytes);
  STRATA_ASSIGN_OR_RETURN(stager, detail::HostStager::create(dev, *compute, std::min<std::uint64_t>(largest, 16u << 20),
                                                             "offload.staging"));
  if (placement.sharding.optimizer_on_device || placement.sharding.optimizer_split) {
    if (launch->is_cpu()) {
      CpuOptimizerConfig oc;
      STRATA_ASSIGN_OR_RETURN(oc.isa, select_optimizer_isa(config.optimizer_isa));
      oc.threads = std::max(1, dev.info().compute_threads);
      STRATA_ASSIGN_OR_RETURN(CpuOptimizer opt, CpuOptimizer::create(oc));
      device_opt = opt;
    } else {
      STRATA_ASSIGN_OR_RETURN(
          cuda_partials,
          dev.allocate((detail::sum_of_squares_cuda_partials(placement.sizes.grad_bytes / 4) + 1) * sizeof(double), "offload.norm"));
      STRATA_ASSIGN_OR_RETURN(pinned_norm, dev.pinned().allocate(sizeof(double), "offload.norm"));
    }
  }
  updated_step.assign(static_cast<std::size_t>(M), 0);
  stage_done.assign(static_cast<std::size_t>(M), 0);
  host_opt_step.assign(static_cast<std::size_t>(M), 0);
  group_step.resize(static_cast<std::size_t>(M));
  for (int u = 0; u < M; ++u)
    group_step[static_cast<std::size_t>(u)].assign(placement.units[static_cast<std::size_t>(u)].sub_group_count(), 0);
  STRATA_RETURN_IF_ERROR(initialize());
  if (!placement.sharding.optimizer_on_device) STRATA_RETURN_IF_ERROR(start_worker());
  return compute->synchronize();
}

Status OffloadEngine::Impl::initialize() {
  const ModelLayout& L = layout();
  std::vector<float> values;
  for (int u = 0; u < M; ++u) {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (!placement.units[uu].in_stage) continue;  // another pipeline stage's
    std::vector<char> pbytes(placement.units[uu].param_bytes, 0);
    std::vector<float> blob;
    const bool via_blob = settings.optimizer == Tier::kNvme || placement.sharding.host_state_sharded;
    if (via_blob) blob.assign(3 * placement.units[uu].grad_bytes / 4, 0.0f);
    for (int k : owned_of_unit[uu]) {
      const OwnedParam& o = owned[static_cast<std::size_t>(k)];
      values.resize(o.n);
      init_values(L, o.index, config.seed, 0, static_cast<std::int64_t>(o.n), values.data());
      STRATA_RETURN_IF_ERROR(convert(values.data(), DType::kF32, pbytes.data() + o.param_in_unit, wdtype, o.n));
      if (settings.optimizer == Tier::kHost && !placement.sharding.host_state_sharded && !placement.device_state(u)) {
        std::memcpy(host_at(host_master, o.grad_offset), values.data(), o.n * 4);
      }
      if (via_blob) std::memcpy(blob.data() + o.grad_in_unit / 4, values.data(), o.n * 4);
      if (placement.device_state(u) && half) STRATA_RETURN_IF_ERROR(upload_dev_master(o, values.data()));
    }
    STRATA_RETURN_IF_ERROR(write_unit_params(u, pbytes));
    // Partial offload with data parallelism: a device unit's state is on the device (its moments
    // zeroed when carved, its master uploaded above).
    if (via_blob && !(placement.sharding.split_state_sharded && placement.device_state(u))) STRATA_RETURN_IF_ERROR(write_unit_optim(u, blob));
  }
  return compute->synchronize();
}

// ---- state access (initialisation, set/get, weights) -----------------------------------------

Status OffloadEngine::Impl::read_unit_params(int u, std::vector<char>& bytes) {
  const std::size_t uu = static_cast<std::size_t>(u);
  bytes.resize(placement.units[uu].param_bytes);
  if (bytes.empty()) return ok_status();
  if (placement.units[uu].gathered_at_fetch) {
    // Collective: every rank's slice, all-gathered on the caller's Comm.
    const std::uint64_t w = half ? 2 : 4, c = placement.units[uu].slice.chunk;
    std::vector<char> mine(c * w), all(c * w * static_cast<std::size_t>(dp_size));
    if (placement.sharding.device_params_sliced) STRATA_RETURN_IF_ERROR(compute->synchronize());  // the slice is read in place
    return gather_unit_params(u, *dp_caller, dp_tracks[0], mine.data(), all.data(), bytes.data(),
                              /*agree=*/state_reads_can_fail());
  }
  switch (placement.units[uu].home) {
    case Tier::kDevice:
      return stager->download(bytes.data(), resident + placement.units[uu].resident_offset, bytes.size());
    case Tier::kHost:
      std::memcpy(bytes.data(), host_params.bytes() + placement.units[uu].host_offset, bytes.size());
      return ok_status();
    case Tier::kNvme:
      return swap->read(param_key(u), bytes.data(), bytes.size()).wait();
  }
  return ok_status();
}

Status OffloadEngine::Impl::write_unit_params(int u, const std::vector<char>& bytes) {
  const std::size_t uu = static_cast<std::size_t>(u);
  if (bytes.empty()) return ok_status();
  // An early fetch of the unit (prefetch_next_step) holds the version this replaces. The caller
  // waited for every update and the h2d stream (wait_all_updates) or dropped the pass.
  STRATA_RETURN_IF_ERROR(forget_fetched(u));
  if (placement.units[uu].gathered_at_fetch) {  // every rank is given the whole unit and keeps its slice
    const std::uint64_t w = half ? 2 : 4;
    std::vector<char> elements(placement.units[uu].grad_bytes / 4 * w, 0);
    to_elements(u, bytes.data(), elements.data());
    return write_param_slice(u, elements.data() + placement.units[uu].slice.begin * w);
  }
  if (placement.units[uu].home != Tier::kNvme && !placement.sharding.optimizer_on_device) {
    std::memcpy(host_params.bytes() + placement.units[uu].host_offset, bytes.data(), bytes.size());
  }
  switch (placement.units[uu].home) {
    case Tier::kDevice:
      STRATA_RETURN_IF_ERROR(stager->upload(resident + placement.units[uu].resident_offset, bytes.data(), bytes.size()));
      return compute->synchronize();
    case Tier::kHost:
      return ok_status();
    case Tier::kNvme:
      return swap->write(param_key(u), bytes.data(), bytes.size()).wait();
  }
  return ok_status();
}

Status OffloadEngine::Impl::read_unit_optim(int u, std::vector<float>& blob, const Status& before) {
  const std::size_t n = placement.units[static_cast<std::size_t>(u)].grad_bytes / 4;
  blob.resize(3 * n);
  Status read = before;
  if (settings.optimizer == Tier::kNvme) {
    const auto& b = placement.units[static_cast<std::size_t>(u)].sub_groups;
    std::vector<float> piece;
    for (std::size_t c = 0; c + 1 < b.size() && read.ok(); ++c) {
      const std::size_t len = b[c + 1] - b[c];
      piece.resize(3 * len);
      read = swap->read(TensorKey{unit_key("optim", u), static_cast<std::uint32_t>(c)}, piece.data(),
                        3 * len * 4)
                 .wait();
      if (!read.ok()) break;
      for (int k = 0; k < 3; ++k) std::memcpy(blob.data() + k * n + b[c], piece.data() + k * len, len * 4);
    }
    if (!placement.sharding.host_state_sharded) return read;  // sharded: the groups held this rank's slice, gathered below
  }
  if (placement.sharding.host_state_sharded && state_reads_can_fail()) {
    // A rank that could not read its part still joins the exchange, so its peers do not wait in
    // the gather for it.
    STRATA_RETURN_IF_ERROR(agree_on_read(
        *dp_caller, read, "its state of module '" + layout().modules[static_cast<std::size_t>(u)].name + "'",
        "data-parallel"));
  }
  if (placement.sharding.host_state_sharded) {
    STRATA_RETURN_IF_ERROR(read);
    // Collective: every rank's slice of [master | m | v], all-gathered on the caller's Comm.
    const std::size_t uu = static_cast<std::size_t>(u);
    const std::uint64_t c = placement.units[uu].slice.chunk, b0 = placement.units[uu].slice.begin, len = placement.units[uu].slice.len, off = placement.units[uu].slice_offset;
    std::vector<float> mine(3 * c, 0.0f), all(3 * c * static_cast<std::size_t>(dp_size));
    for (int k = 0; k < 3; ++k) {
      const HostMem& h = k == 0 ? host_master : k == 1 ? host_m : host_v;
      const float* from = settings.optimizer == Tier::kNvme ? blob.data() + k * n + b0 : h.floats() + off;
      std::memcpy(mine.data() + k * c, from, len * 4);
    }
    STRATA_RETURN_IF_ERROR(dp_wait(dp_tracks[0], dp_caller->all_gather(mine.data(), all.data(), 3 * c, DType::kF32),
                                   "gather optimizer state", u, all.size() * 4));
    for (int r = 0; r < dp_size; ++r) {
      const partition::DpSlice theirs = partition::dp_slice_of(n, dp_size, r);
      for (int k = 0; k < 3; ++k) {
        std::memcpy(blob.data() + k * n + theirs.begin, all.data() + (static_cast<std::size_t>(r) * 3 + k) * c,
                    theirs.len * 4);
      }
    }
    return ok_status();
  }
  STRATA_RETURN_IF_ERROR(read);
  const std::uint64_t g = grad_begin(u);
  std::memcpy(blob.data(), host_at(host_master, g), n * 4);
  std::memcpy(blob.data() + n, host_at(host_m, g), n * 4);
  std::memcpy(blob.data() + 2 * n, host_at(host_v, g), n * 4);
  return ok_status();
}

Status OffloadEngine::Impl::write_unit_optim(int u, const std::vector<float>& blob) {
  const std::size_t n = placement.units[static_cast<std::size_t>(u)].grad_bytes / 4;
  if (settings.optimizer == Tier::kNvme) {
    const auto& b = placement.units[static_cast<std::size_t>(u)].sub_groups;
    std::vector<float> piece;
    for (std::size_t c = 0; c + 1 < b.size(); ++c) {
      const std::size_t len = b[c + 1] - b[c];
      piece.resize(3 * len);
      for (int k = 0; k < 3; ++k) std::memcpy(piece.data() + k * len, blob.data() + k * n + b[c], len * 4);
      STRATA_RETURN_IF_ERROR(
          swap->write(TensorKey{unit_key("optim", u), static_cast<std::uint32_t>(c)}, piece.data(), 3 * len * 4).wait());
    }
    return ok_status();
  }
  if (placement.sharding.host_state_sharded) {  // every rank is given the whole unit and keeps its slice
    const std::size_t uu = static_cast<std::size_t>(u);
    const std::uint64_t b = placement.units[uu].slice.begin, len = placement.units[uu].slice.len, off = placement.units[uu].slice_offset;
    std::memcpy(host_master.floats() + off, blob.data() + b, len * 4);
    std::memcpy(host_m.floats() + off, blob.data() + n + b, len * 4);
    std::memcpy(host_v.floats() + off, blob.data() + 2 * n + b, len * 4);
    return ok_status();
  }
  const std::uint64_t g = grad_begin(u);
  std::memcpy(host_at(host_master, g), blob.data(), n * 4);
  std::memcpy(host_at(host_m, g), blob.data() + n, n * 4);
  std::memcpy(host_at(host_v, g), blob.data() + 2 * n, n * 4);
  return ok_status();
}

Status OffloadEngine::Impl::write_grad_shards(int u, const char* src) {
  return grad_shards_io(u, const_cast<char*>(src), true);
}

Status OffloadEngine::Impl::read_grad_shards(int u, char* dst) { return grad_shards_io(u, dst, false); }

// Every shard of unit u's gradients at once (the optimizer's sub-groups), then waits for all.
// The sub-groups' bounds are unit element positions; sharded they cover this rank's slice, which
// `buf` holds from its first element.
Status OffloadEngine::Impl::grad_shards_io(int u, char* buf, bool write) {
  const auto& b = placement.units[static_cast<std::size_t>(u)].sub_groups;
  const std::uint64_t first_element = placement.sharding.host_state_sharded ? placement.units[static_cast<std::size_t>(u)].slice.begin : 0;
  std::vector<IoHandle> h;
  for (std::size_t c = 0; c + 1 < b.size(); ++c) {
    const TensorKey key{unit_key("grad", u), static_cast<std::uint32_t>(c)};
    char* p = buf + (b[c] - first_element) * 4;
    const std::uint64_t n = (b[c + 1] - b[c]) * 4;
    h.push_back(write ? swap->write(key, p, n) : swap->read(key, p, n));
  }
  Status first;
  for (IoHandle& x : h) {
    Status s = x.wait();
    if (first.ok() && !s.ok()) first = s;
  }
  return keep_grad_io(std::move(first));  // several processes: agreed with the step's norm
}

Status OffloadEngine::Impl::local_grads_io(int u, char* buf, bool write) {
  const TensorKey key{unit_key("grad_local", u), 0};
  const std::uint64_t n = placement.units[static_cast<std::size_t>(u)].grad_bytes;
  return keep_grad_io((write ? swap->write(key, buf, n) : swap->read(key, buf, n)).wait());
}

Status OffloadEngine::Impl::write_values(int index, std::span<const float> values, bool master_too) {
  const int k = owned_index(index);
  if (k < 0) return invalid_argument("set_param: no parameter with index " + std::to_string(index));
  const OwnedParam& o = owned[static_cast<std::size_t>(k)];
  if (values.size() != o.n) {
    return invalid_argument("set_param '" + layout().params[static_cast<std::size_t>(o.index)].name + "': got " +
                            std::to_string(values.size()) + " values for " + std::to_string(o.n) + " elements");
  }
  STRATA_RETURN_IF_ERROR(wait_all_updates());
  std::vector<char> bytes;
  STRATA_RETURN_IF_ERROR(read_unit_params(o.unit, bytes));
  STRATA_RETURN_IF_ERROR(convert(values.data(), DType::kF32, bytes.data() + o.param_in_unit, wdtype, o.n));
  STRATA_RETURN_IF_ERROR(write_unit_params(o.unit, bytes));
  if (!master_too) return ok_status();
  if (placement.device_state(o.unit)) {
    if (!half) return ok_status();  // the resident params are the master
    STRATA_RETURN_IF_ERROR(upload_dev_master(o, values.data()));
    return compute->synchronize();
  }
  std::vector<float> blob;
  STRATA_RETURN_IF_ERROR(read_unit_optim(o.unit, blob));
  std::memcpy(blob.data() + o.grad_in_unit / 4, values.data(), o.n * 4);
  return write_unit_optim(o.unit, blob);
}

Result<std::vector<float>> OffloadEngine::Impl::read_state(int index, int which) {
  const int k = owned_index(index);
  if (k < 0 && pp_size > 1 && index >= 0 && index < static_cast<int>(layout().params.size())) {
    return failed_precondition("parameter '" + layout().params[static_cast<std::size_t>(index)].name +
                               "' is held by pipeline stage " +
                               std::to_string(placement.units[static_cast<std::size_t>(owner_unit(index))].holder_stage) +
                               ", not by this stage (" + std::to_string(pp_rank) + ")");
  }
  if (k < 0) return invalid_argument("no parameter with index " + std::to_string(index));
  const OwnedParam& o = owned[static_cast<std::size_t>(k)];
  STRATA_RETURN_IF_ERROR(wait_all_updates());
  std::vector<float> out(o.n);
  if (which == 0 || (which == 1 && placement.device_state(o.unit) && !half)) {
    std::vector<char> bytes;
    STRATA_RETURN_IF_ERROR(read_unit_params(o.unit, bytes));
    STRATA_RETURN_IF_ERROR(convert(bytes.data() + o.param_in_unit, wdtype, out.data(), DType::kF32, o.n));
    return out;
  }
  if (placement.device_state(o.unit) && placement.sharding.device_state_in_slices()) {  // collective: the unit's slices gathered from every rank
    std::vector<char> pbytes;
    std::vector<float> blob;
    STRATA_RETURN_IF_ERROR(read_unit_state(o.unit, pbytes, blob));
    const std::size_t n = placement.units[static_cast<std::size_t>(o.unit)].grad_bytes / 4;
    std::memcpy(out.data(), blob.data() + static_cast<std::size_t>(which - 1) * n + o.grad_in_unit / 4,
                o.n * 4);
    return out;
  }
  if (placement.device_state(o.unit)) {
    const float* src = which == 1 ? dmaster : which == 2 ? dm : dv;
    STRATA_RETURN_IF_ERROR(stager->download(out.data(), reinterpret_cast<const char*>(src) + o.grad_offset, o.n * 4));
    return out;
  }
  std::vector<float> blob;
  STRATA_RETURN_IF_ERROR(read_unit_optim(o.unit, blob));
  const std::size_t n = placement.units[static_cast<std::size_t>(o.unit)].grad_bytes / 4;
  std::memcpy(out.data(), blob.data() + static_cast<std::size_t>(which - 1) * n + o.grad_in_unit / 4, o.n * 4);
  return out;
}

Status OffloadEngine::Impl::read_unit_state(int u, std::vector<char>& pbytes, std::vector<float>& blob) {
  Status params = read_unit_params(u, pbytes);
  // A sharded unit's parameter read is already agreed over the ranks (every rank failed it);
  // any other failure goes into the optimizer state's exchange, which the peers are in (where
  // state_reads_can_fail).
  if (!params.ok() && placement.units[static_cast<std::size_t>(u)].gathered_at_fetch) return params;
  if (!placement.device_state(u)) return read_unit_optim(u, blob, params);
  const std::size_t uu = static_cast<std::size_t>(u);
  const std::size_t n = placement.units[uu].grad_bytes / 4;
  blob.assign(3 * n, 0.0f);
  if (n == 0) return params;
  // This rank's elements [first, first + len) of the state (the whole unit unless sharded).
  const std::uint64_t first = dev_state_first(u), len = dev_state_len(u);
  Status read = params;  // this rank's first failure (a device copy can fail on one rank alone)
  if (read.ok() && half) {
    read = stager->download(blob.data() + first, dev_state(u, 1), len * 4);
  } else if (read.ok()) {  // fp32 on the device: the resident parameters are the master (whole on every rank)
    for (int k : owned_of_unit[uu]) {
      const OwnedParam& o = owned[static_cast<std::size_t>(k)];
      std::memcpy(blob.data() + o.grad_in_unit / 4, pbytes.data() + o.param_in_unit, o.n * 4);
    }
  }
  if (read.ok()) read = stager->download(blob.data() + n + first, dev_state(u, 2), len * 4);
  if (read.ok()) read = stager->download(blob.data() + 2 * n + first, dev_state(u, 3), len * 4);
  if (!placement.sharding.device_state_in_slices()) return read;
  // The gather below is collective: a rank whose download failed keeps its place and every rank
  // returns the same error naming it, at once (not its peers after the comm timeout). Always
  // exchanged, unlike the host tier's (state_reads_can_fail): any device copy can fail.
  STRATA_RETURN_IF_ERROR(agree_on_read(
      *dp_caller, read, "its slice of module '" + layout().modules[uu].name + "' (state on the device)",
      "data-parallel"));
  // Collective: every rank's slice of [master | m | v], all-gathered on the caller's Comm (as
  // read_unit_optim does for the host tier's shards).
  const std::uint64_t c = placement.units[uu].slice.chunk;
  std::vector<float> mine(3 * c, 0.0f), all(3 * c * static_cast<std::size_t>(dp_size));
  for (int k = 0; k < 3; ++k) std::memcpy(mine.data() + k * c, blob.data() + k * n + first, len * 4);
  STRATA_RETURN_IF_ERROR(dp_wait(dp_tracks[0],
                                 dp_caller->all_gather(mine.data(), all.data(), 3 * c, DType::kF32),
                                 "gather optimizer state", u, all.size() * 4));
  for (int r = 0; r < dp_size; ++r) {
    const partition::DpSlice theirs = partition::dp_slice_of(n, dp_size, r);
    for (int k = 0; k < 3; ++k) {
      if (k == 0 && !half) continue;  // the master is the (replicated) working copy
      std::memcpy(blob.data() + k * n + theirs.begin, all.data() + (static_cast<std::size_t>(r) * 3 + k) * c,
                  theirs.len * 4);
    }
  }
  return ok_status();
}

Status OffloadEngine::Impl::write_unit_state(int u, const std::vector<char>& pbytes, const std::vector<float>& blob) {
  STRATA_RETURN_IF_ERROR(write_unit_params(u, pbytes));
  if (!placement.device_state(u)) return write_unit_optim(u, blob);
  const std::size_t n = placement.units[static_cast<std::size_t>(u)].grad_bytes / 4;
  if (n == 0) return ok_status();
  // Every rank is given the whole unit and keeps its elements (its slice when sharded).
  const std::uint64_t first = dev_state_first(u), len = dev_state_len(u);
  if (half) STRATA_RETURN_IF_ERROR(stager->upload(dev_state(u, 1), blob.data() + first, len * 4));
  STRATA_RETURN_IF_ERROR(stager->upload(dev_state(u, 2), blob.data() + n + first, len * 4));
  STRATA_RETURN_IF_ERROR(stager->upload(dev_state(u, 3), blob.data() + 2 * n + first, len * 4));
  return compute->synchronize();
}

Status OffloadEngine::Impl::upload_dev_master(const OwnedParam& o, const float* values) {
  // The parameter's elements [a, a + n) of its unit, cut to this rank's [first, first + len).
  const std::uint64_t a = o.grad_in_unit / 4, first = dev_state_first(o.unit), len = dev_state_len(o.unit);
  const std::uint64_t lo = std::max<std::uint64_t>(a, first),
                      hi = std::min<std::uint64_t>(a + o.n, first + len);
  if (lo >= hi) return ok_status();
  return stager->upload(dev_state(o.unit, 1) + 4 * (lo - first), values + (lo - a), (hi - lo) * 4);
}

// ---- data parallel ---------------------------------------------------------------------------

Status OffloadEngine::Impl::setup_tensor_parallel() {
  if (tp == nullptr || tp->size() == 1) return ok_status();
  tp_size = tp->size();
  tp_rank = tp->rank();
  STRATA_ASSIGN_OR_RETURN(tp_model, tp->split(0, tp_rank, "tp.model"));
  STRATA_ASSIGN_OR_RETURN(tp_step, tp->split(0, tp_rank, "tp.step"));
  STRATA_ASSIGN_OR_RETURN(tp_norm, tp->split(0, tp_rank, "tp.norm"));
  for (int r = 0; r < tp_size; ++r) {
    STRATA_ASSIGN_OR_RETURN(ModelLayout l, describe_model(config.model, TensorParallel{tp_size, r}));
    tp_layouts.push_back(std::move(l));
  }
  // The norm's element ranges per unit are the placement's (UnitPlacement::norm_ranges).
  return ok_status();
}

Result<GradStats> OffloadEngine::Impl::scan_norm(const CpuOptimizer& opt, int u, const char* grads,
                                                 std::uint64_t first, std::uint64_t n, float inv_scale) const {
  if (tp_size == 1) return opt.scan_gradients(const_cast<char*>(grads), DType::kF32, n, inv_scale, false);
  GradStats total;
  for (const auto& [a, b] : placement.units[static_cast<std::size_t>(u)].norm_ranges) {
    const std::uint64_t lo = std::max(a, first), hi = std::min(b, first + n);
    if (lo >= hi) continue;
    STRATA_ASSIGN_OR_RETURN(GradStats g, opt.scan_gradients(const_cast<char*>(grads) + 4 * (lo - first), DType::kF32,
                                                            hi - lo, inv_scale, false));
    total.merge(g);
  }
  return total;
}

Result<GradStats> OffloadEngine::Impl::merge_over_tp(const GradStats& local, Comm& comm, float* verdict) const {
  static_assert(sizeof(GradStats) % 4 == 0);
  // Two records per rank: its statistics and its failure flag (agree_before_norm; 0 without).
  constexpr std::size_t kWords = 2 * sizeof(GradStats) / 4;
  const GradStats mine[2] = {local, GradStats{verdict != nullptr ? *verdict : 0.0, 0}};
  std::vector<GradStats> all(2 * static_cast<std::size_t>(tp_size));
  // The statistics travel as raw 32-bit words (an all-gather moves bits, it does not add).
  STRATA_RETURN_IF_ERROR(comm.all_gather(mine, all.data(), kWords, DType::kF32).wait().with_context(
      "tensor parallel: gathering the gradient statistics"));
  GradStats total;
  for (int r = 0; r < tp_size; ++r) {
    total.merge(all[2 * static_cast<std::size_t>(r)]);
    if (verdict != nullptr)
      *verdict = std::max(*verdict, static_cast<float>(all[2 * static_cast<std::size_t>(r) + 1].sum_of_squares));
  }
  return total;
}

Result<std::vector<float>> OffloadEngine::Impl::read_full(int index, int which) {
  Result<std::vector<float>> read = read_state(index, which);
  if (tp_size == 1) return read;
  // Every tensor-parallel rank learns whether every other read its shard before anything else
  // is gathered (replicated parameters too: a rank that stopped here would leave its peers in
  // the next parameter's gather), so a rank that cannot read fails the group at once.
  if (state_reads_can_fail() && index >= 0 && index < static_cast<int>(layout().params.size())) {
    STRATA_RETURN_IF_ERROR(agree_on_read(
        *tp_step, read.status(),
        "its shard of '" + layout().params[static_cast<std::size_t>(index)].name + "'", "tensor-parallel"));
  }
  STRATA_ASSIGN_OR_RETURN(std::vector<float> shard, std::move(read));
  const ParamDesc* p = &layout().params[static_cast<std::size_t>(index)];
  const int target = p->owns_storage() ? index : p->tied_with;
  p = &layout().params[static_cast<std::size_t>(target)];
  if (p->shard.kind == ShardKind::kReplicated) return shard;
  // Every shard of a parameter has the same number of elements.
  std::vector<float> gathered(shard.size() * static_cast<std::size_t>(tp_size));
  STRATA_RETURN_IF_ERROR(tp_step->all_gather(shard.data(), gathered.data(), shard.size(), DType::kF32)
                             .wait()
                             .with_context("tensor parallel: gathering '" + p->name + "'"));
  std::vector<float> full(static_cast<std::size_t>(p->shard.full_numel()));
  for (int r = 0; r < tp_size; ++r) {
    full_from_shard(tp_layouts[static_cast<std::size_t>(r)].params[static_cast<std::size_t>(target)],
                    gathered.data() + static_cast<std::size_t>(r) * shard.size(), full.data());
  }
  return full;
}

Status OffloadEngine::Impl::write_full(int index, std::span<const float> values) {
  if (tp_size == 1) return write_values(index, values, true);
  if (index < 0 || index >= static_cast<int>(layout().params.size())) {
    return invalid_argument("set_param: no parameter with index " + std::to_string(index));
  }
  const ParamDesc* p = &layout().params[static_cast<std::size_t>(index)];
  if (!p->owns_storage()) p = &layout().params[static_cast<std::size_t>(p->tied_with)];
  if (static_cast<std::int64_t>(values.size()) != p->shard.full_numel()) {
    return invalid_argument("set_param '" + p->name + "': got " + std::to_string(values.size()) +
                            " values for the full parameter of " + std::to_string(p->shard.full_numel()) +
                            " elements (tensor parallel: this rank keeps its shard)");
  }
  std::vector<float> shard(static_cast<std::size_t>(p->numel()));
  shard_from_full(*p, values.data(), shard.data());
  return write_values(index, shard, true);
}

Result<std::string> OffloadEngine::Impl::save_checkpoint_tp(const std::string& root, const CheckpointManifest& manifest,
                                                            int keep) {
  STRATA_ASSIGN_OR_RETURN(ModelLayout full, describe_model(config.model));
  struct State {
    std::vector<char> param;  // working dtype
    std::vector<float> master, m, v;
  };
  std::vector<State> state(full.params.size());
  Status read = [&]() -> Status {
    for (int u = 0; u < M; ++u) {
      for (int k : owned_of_unit[static_cast<std::size_t>(u)]) {
        const int index = owned[static_cast<std::size_t>(k)].index;
        State& st = state[static_cast<std::size_t>(index)];
        STRATA_ASSIGN_OR_RETURN(std::vector<float> working, read_full(index, 0));
        st.param.resize(working.size() * dtype_size(wdtype));
        STRATA_RETURN_IF_ERROR(convert(working.data(), DType::kF32, st.param.data(), wdtype, working.size()));
        STRATA_ASSIGN_OR_RETURN(st.master, read_full(index, 1));
        STRATA_ASSIGN_OR_RETURN(st.m, read_full(index, 2));
        STRATA_ASSIGN_OR_RETURN(st.v, read_full(index, 3));
      }
    }
    return ok_status();
  }();
  // read_full failed the same parameter on every rank of the tensor-parallel group; the other
  // data-parallel groups learn it here (each group's reads are collective only within it, but for
  // stage 3's, which fail together), so every rank returns the same error and none waits for the
  // outcome of a save that will not happen.
  if (dp_size > 1) read = agree_on_read(*dp_caller, read, "its part of the checkpoint", "data-parallel");
  if (!read.ok()) return read.with_context("checkpoint under '" + root + "'");
  const bool writer = tp_rank == 0 && dp_rank == 0;
  const std::string working = wdtype == DType::kBF16 ? "BF16" : wdtype == DType::kF16 ? "F16" : "F32";
  Result<std::string> published = std::string();
  if (writer) {
    published = publish_checkpoint(root, manifest, keep, [&](const std::string& dir, std::vector<std::string>* names) {
      for (int u = 0; u < M; ++u) {
        const auto& mine = owned_of_unit[static_cast<std::size_t>(u)];
        if (mine.empty()) continue;
        SafetensorsWriter w;
        for (int k : mine) {
          const ParamDesc& p = full.params[static_cast<std::size_t>(owned[static_cast<std::size_t>(k)].index)];
          const State& st = state[static_cast<std::size_t>(owned[static_cast<std::size_t>(k)].index)];
          STRATA_RETURN_IF_ERROR(w.add("param/" + p.name, working, p.shape, st.param.data(), st.param.size()));
          STRATA_RETURN_IF_ERROR(w.add("master/" + p.name, "F32", p.shape, st.master.data(), st.master.size() * 4));
          STRATA_RETURN_IF_ERROR(w.add("exp_avg/" + p.name, "F32", p.shape, st.m.data(), st.m.size() * 4));
          STRATA_RETURN_IF_ERROR(w.add("exp_avg_sq/" + p.name, "F32", p.shape, st.v.data(), st.v.size() * 4));
        }
        w.set_metadata("module", full.modules[static_cast<std::size_t>(u)].name);
        char name[40];
        std::snprintf(name, sizeof name, "module-%04d.safetensors", u);
        STRATA_RETURN_IF_ERROR(write_checkpoint_file(w, dir + "/" + name));
        names->push_back(name);
      }
      if (scaler) return failed_precondition("fp16 is not trained tensor-parallel");  // refused at create
      return ok_status();
    });
  }
  // The outcome, as 4-byte words: from the writer over its tensor-parallel group, then from each
  // data-parallel rank 0 (which now has it) over its data-parallel group.
  constexpr std::size_t kWords = 1 + 256;
  std::array<std::uint32_t, kWords> word{};
  if (writer && published.ok() && published->size() < 4 * (kWords - 1)) {
    word[0] = 1;
    std::memcpy(word.data() + 1, published->data(), published->size());
  }
  STRATA_RETURN_IF_ERROR(tp_step->broadcast(word.data(), kWords, DType::kF32, 0).wait());
  if (dp_size > 1) {
    STRATA_RETURN_IF_ERROR(
        dp_wait(dp_tracks[0], dp_caller->broadcast(word.data(), kWords, DType::kF32, 0), "checkpoint outcome", -1, 4 * kWords));
  }
  if (writer) return published;
  if (word[0] != 1) {
    return io_error("checkpoint under '" + root + "': the first rank, which writes it, failed (its log says why)");
  }
  return std::string(reinterpret_cast<const char*>(word.data() + 1));
}

Status OffloadEngine::Impl::setup_data_parallel() {
  if (dp == nullptr || dp->size() == 1) return ok_status();
  dp_size = dp->size();
  dp_rank = dp->rank();
  STRATA_ASSIGN_OR_RETURN(dp_caller, dp->split(0, dp_rank, "dp.step"));
  dp_tracks[0] = tracer.add_track("data parallel: step (caller)");
  if (placement.sharding.host_state_sharded) {
    STRATA_ASSIGN_OR_RETURN(dp_grads, dp->split(0, dp_rank, "dp.grads"));
    STRATA_ASSIGN_OR_RETURN(dp_params, dp->split(0, dp_rank, "dp.params"));
    dp_tracks[1] = tracer.add_track("data parallel: gradient reduce-scatter");
    dp_tracks[2] = tracer.add_track("data parallel: statistics and parameter all-gather");
  }
  if (placement.sharding.device_state_sharded) {
    // The compute stream's: the reduce-scatter, the statistics and the parameter all-gathers of
    // the device update (device_update_sharded), in unit order on every rank.
    STRATA_ASSIGN_OR_RETURN(dp_params, dp->split(0, dp_rank, "dp.device_update"));
    dp_tracks[2] = tracer.add_track("data parallel: device update (reduce-scatter, statistics, all-gather)");
    shard_stats.assign(static_cast<std::size_t>(M), GradStats{});
    gathered_stats.assign(static_cast<std::size_t>(dp_size * M), GradStats{});
  }
  if (placement.sharding.split_state_sharded) {
    // The compute stream's: the device units' reduce-scatters (every micro-batch at stage 2),
    // then their parameter all-gathers, in unit order on every rank.
    STRATA_ASSIGN_OR_RETURN(dp_device, dp->split(0, dp_rank, "dp.device_update"));
    dp_tracks[3] = tracer.add_track("data parallel: device modules (reduce-scatter, all-gather)");
  }
  if (placement.sharding.device_grads_bucketed) {
    // The compute stream's gradient buckets, in bucket order on every rank.
    STRATA_ASSIGN_OR_RETURN(dp_buckets, dp->split(0, dp_rank, "dp.buckets"));
    dp_tracks[1] = tracer.add_track(placement.sharding.device_grads_sharded ? "data parallel: gradient bucket reduce-scatter"
                                                 : "data parallel: gradient bucket all-reduce");
  }
  // Stage 3 (UnitPlacement::gathered_at_fetch), in device memory too (the sliced units keep their
  // slice in offload.params and are gathered by the same fetch; with a pipeline the stage's units,
  // docs/parallel.md "Stages 2-3 in device memory with a pipeline").
  if ((placement.sharding.host_state_sharded && settings.zero_stage == 3) || placement.sharding.device_params_sliced) {
    STRATA_ASSIGN_OR_RETURN(dp_fetch, dp->split(0, dp_rank, "dp.fetch"));
    dp_tracks[3] = tracer.add_track("data parallel: parameter fetch all-gather");
  }
  gathered_sums.reserve(static_cast<std::size_t>(4 * dp_size));
  return ok_status();
}

// ---- pipeline parallel -----------------------------------------------------------------------

Status OffloadEngine::Impl::setup_pipeline() {
  if (pp_size == 1) return ok_status();
  STRATA_ASSIGN_OR_RETURN(pp_caller, pp->split(0, pp_rank, "pp.step"));
  STRATA_ASSIGN_OR_RETURN(pp_norm, pp->split(0, pp_rank, "pp.norm"));
  STRATA_ASSIGN_OR_RETURN(pp_stream, pp->split(0, pp_rank, "pp.stream"));
  // The tied unit (StageShape::tied_unit): held by the first stage (its own module) and by the
  // last (read by the head).
  const ModelLayout& L = layout();
  if (chunks > 1) {
    STRATA_ASSIGN_OR_RETURN(pp_stream_grads, pp->split(0, pp_rank, "pp.stream_grads"));
  }
  if (placement.stage.tied_unit >= 0 && placement.units[static_cast<std::size_t>(placement.stage.tied_unit)].holder_stage != 0) {
    return internal_error("pipeline: the tied unit '" + L.modules[static_cast<std::size_t>(placement.stage.tied_unit)].name +
                          "' is not the first stage's");
  }
  if (placement.stage.tied_unit >= 0) {
    // The first and the last stage form one group; every other stage a group of its own (unused).
    const bool member = pp_rank == 0 || pp_rank == pp_size - 1;
    STRATA_ASSIGN_OR_RETURN(pp_tied, pp->split(member ? 0 : 1 + pp_rank, pp_rank, "pp.tied"));
    if (!member || !placement.units[static_cast<std::size_t>(placement.stage.tied_unit)].in_stage) pp_tied.reset();
  }
  pp_stats.assign(static_cast<std::size_t>(M) + 1, GradStats{});  // + the failure flag (merge_stage_stats)
  pp_gathered.assign((static_cast<std::size_t>(M) + 1) * static_cast<std::size_t>(pp_size), GradStats{});
  const std::uint64_t boundary = boundary_bytes();
  // Interleaved: every stage sends and receives in both directions (a chunk's output goes to the
  // next stage, the last stage's to the first), one send buffer per (micro-batch, chunk).
  const bool both = chunks > 1;
  for (std::int64_t a = 0; a < config.grad_accum * chunks; ++a) {
    if (both || pp_rank + 1 < pp_size) {
      STRATA_ASSIGN_OR_RETURN(ArenaBuffer b, device->allocate(boundary, "pipeline.send_activations"));
      act_send.push_back(std::move(b));
    }
    if (both || pp_rank > 0) {
      STRATA_ASSIGN_OR_RETURN(ArenaBuffer b, device->allocate(boundary, "pipeline.send_gradients"));
      grad_send.push_back(std::move(b));
    }
  }
  for (int i = 0; i < partition::kPipelineRecvBuffers; ++i) {
    if (both || pp_rank + 1 < pp_size) {
      STRATA_ASSIGN_OR_RETURN(ArenaBuffer r, device->allocate(boundary, "pipeline.recv_gradients"));
      grad_recv.push_back(std::move(r));
    }
    if (both || pp_rank > 0) {
      STRATA_ASSIGN_OR_RETURN(ArenaBuffer r, device->allocate(boundary, "pipeline.recv_activations"));
      act_recv.push_back(std::move(r));
    }
  }
  sends.reserve(static_cast<std::size_t>(2 * config.grad_accum * chunks));
  act_recv_work.resize(static_cast<std::size_t>(partition::kPipelineRecvBuffers));
  grad_recv_work.resize(static_cast<std::size_t>(partition::kPipelineRecvBuffers));
  return ok_status();
}

Result<GradStats> OffloadEngine::Impl::merge_stage_stats(const std::vector<GradStats>& stats, float* verdict) {
  static_assert(sizeof(GradStats) % 4 == 0);
  // M + 1 records per stage: its per-unit statistics and its failure flag (agree_before_norm).
  const std::size_t per = static_cast<std::size_t>(M) + 1;
  std::copy_n(stats.begin(), std::min<std::size_t>(stats.size(), per - 1), pp_stats.begin());
  pp_stats[per - 1] = GradStats{verdict != nullptr ? *verdict : 0.0, 0};
  Status s = pp_norm->all_gather(pp_stats.data(), pp_gathered.data(), pp_stats.size() * sizeof(GradStats) / 4,
                                 DType::kF32).wait();
  if (!s.ok()) return s.with_context("pipeline: gather of the gradient statistics");
  GradStats total;
  for (int u = 0; u < M; ++u) {
    const int st = placement.units[static_cast<std::size_t>(u)].holder_stage;
    total.merge(pp_gathered[static_cast<std::size_t>(st) * per + static_cast<std::size_t>(u)]);
  }
  if (verdict != nullptr) {
    for (int st = 0; st < pp_size; ++st) {
      const GradStats& flag = pp_gathered[static_cast<std::size_t>(st) * per + per - 1];
      *verdict = std::max(*verdict, static_cast<float>(flag.sum_of_squares));
    }
  }
  return total;
}

Status OffloadEngine::Impl::reduce_tied_grads(float* grads, std::size_t n) {
  if (!pp_tied) return ok_status();
  return pp_tied->all_reduce(grads, grads, n, DType::kF32, ReduceOp::kSum)
      .wait()
      .with_context("pipeline: all-reduce of the tied embedding's gradient between the first and the last stage");
}

Status OffloadEngine::Impl::sum_tied_landed(const Command& c) {
  if (!grads_on_nvme) {
    const auto [grads, n] = unit_grads(c.unit);  // data parallel: this rank's reduced slice
    return reduce_tied_grads(reinterpret_cast<float*>(grads), n);
  }
  // Gradients on NVMe: the unit's final gradients (this rank's reduced slice when sharded) were
  // scanned and written on the gradient stream before the other end's part was known. Read them
  // back through grad_staging (the gradient stream is idle: synchronized by the caller), sum,
  // scan again (the statistics the optimizer thread merges are the summed gradients', as
  // unit_grads' scan is with host gradients) and write them back for the ring's reads.
  const std::size_t uu = static_cast<std::size_t>(c.unit);
  const std::uint64_t first = placement.sharding.host_state_sharded ? placement.units[uu].slice.begin : 0;
  const std::uint64_t n = placement.sharding.host_state_sharded ? placement.units[uu].slice.len : placement.units[uu].grad_bytes / 4;
  char* buf = grad_staging.bytes();
  {
    detail::HostSpan span(tracer, track.nvme_fetch, TraceCounter::kNvmeRead, "read gradients", c.unit, 4 * n);
    STRATA_RETURN_IF_ERROR(read_grad_shards(c.unit, buf));
  }
  STRATA_RETURN_IF_ERROR(reduce_tied_grads(reinterpret_cast<float*>(buf), n));
  STRATA_ASSIGN_OR_RETURN(landed_stats[uu],
                          scan_norm(*host_opt, c.unit, buf, first, n, static_cast<float>(1.0 / c.loss_scale)));
  detail::HostSpan span(tracer, track.nvme_publish, TraceCounter::kNvmeWrite, "write gradients", c.unit, 4 * n);
  return write_grad_shards(c.unit, buf);
}

Status OffloadEngine::Impl::pp_send_bytes(const void* data, std::uint64_t bytes, int peer,
                                          const std::string& what) {
  if (bytes % 2 != 0) return internal_error("pipeline: sending " + what + ": an odd byte count");
  constexpr std::uint64_t kPiece = 1ull << 30;  // 16-bit words per call, within the Comm's 2^31 - 1
  const auto* words = static_cast<const std::uint16_t*>(data);
  for (std::uint64_t w = 0; w < bytes / 2; w += kPiece) {
    const auto n = static_cast<std::size_t>(std::min(kPiece, bytes / 2 - w));
    STRATA_RETURN_IF_ERROR(
        pp_caller->send(words + w, n, DType::kBF16, peer)
            .wait()
            .with_context("pipeline: sending " + what + " to stage " + std::to_string(peer)));
  }
  return ok_status();
}

Status OffloadEngine::Impl::pp_recv_bytes(void* data, std::uint64_t bytes, int peer,
                                          const std::string& what) {
  if (bytes % 2 != 0) return internal_error("pipeline: receiving " + what + ": an odd byte count");
  constexpr std::uint64_t kPiece = 1ull << 30;
  auto* words = static_cast<std::uint16_t*>(data);
  for (std::uint64_t w = 0; w < bytes / 2; w += kPiece) {
    const auto n = static_cast<std::size_t>(std::min(kPiece, bytes / 2 - w));
    STRATA_RETURN_IF_ERROR(
        pp_caller->recv(words + w, n, DType::kBF16, peer)
            .wait()
            .with_context("pipeline: receiving " + what + " from stage " + std::to_string(peer)));
  }
  return ok_status();
}

// Forward only (loss, evaluate) of the batch set on the model, in slot 0. Every stage runs it
// for every batch, in the same order; the last stage's losses are the single process's (each
// module computes what it computes there, on the same bits of its input).
Status OffloadEngine::Impl::forward_stage() {
  const DType wire = wire_dtype();
  const std::uint64_t bytes = model->boundary_bytes();
  const std::size_t count = bytes / dtype_size(wire);
  // Interleaved: chunk c's input comes from the previous stage (stage 0's chunks c > 0: from the
  // last stage's chunk c − 1) and its output goes to the next (the last stage's: to stage 0).
  // The chunks form one chain through the processes, so the blocking exchange cannot cycle.
  const int prev = (pp_rank + pp_size - 1) % pp_size, next = (pp_rank + 1) % pp_size;
  // Interleaved: each chunk runs in a slot carved for it (forward_slot), which takes the batch
  // from the slot it was set in.
  const int batch_slot = model->slot();
  for (int c = 0; c < chunks; ++c) {
    const auto [first, end] = placement.stage.chunk_ranges[static_cast<std::size_t>(c)];
    if (chunks > 1) {
      STRATA_RETURN_IF_ERROR(model->select_slot(forward_slot[static_cast<std::size_t>(c)]));
      STRATA_RETURN_IF_ERROR(model->share_batch(batch_slot));
      STRATA_RETURN_IF_ERROR(model->select_range(c));
    }
    if (pp_rank > 0 || c > 0) {
      STRATA_RETURN_IF_ERROR(compute->synchronize());  // the input buffer's previous reader is done
      STRATA_RETURN_IF_ERROR(
          pp_caller->recv(model->boundary_activation(first), count, wire, prev)
              .wait()
              .with_context("pipeline (forward only): receive of the activations from stage " +
                            std::to_string(prev)));
    }
    if (c == 0) begin_pass();
    STRATA_RETURN_IF_ERROR(run_forward(false, c));
    if (c + 1 == chunks) STRATA_RETURN_IF_ERROR(end_pass());
    if (pp_rank + 1 < pp_size || c + 1 < chunks) {
      STRATA_RETURN_IF_ERROR(compute->synchronize());
      STRATA_RETURN_IF_ERROR(pp_caller->send(model->boundary_activation(end), count, wire, next)
                                 .wait()
                                 .with_context("pipeline (forward only): send of the activations to stage " +
                                               std::to_string(next)));
    }
  }
  return ok_status();
}

// Weights written by every rank into the one file (docs/checkpoints.md "Who writes the weights
// file"). The header is a function of the full layout (weights_header), so every rank knows where
// each of its elements goes without hearing from anyone:
//   1. the writer (tp 0, dp 0, stage 0) creates "<path>.tmp" with the header at its final size and
//      broadcasts whether it could (broadcast_from_writer);
//   2. every rank checks that it sees the file, agreed (agree_everywhere); where one does not, the
//      writer removes it and, without a pipeline, every rank returns false (the gather path);
//   3. every rank writes what it holds (write_weights_part): its tensor-parallel shard of each
//      parameter its stage holds (replicated ones: tp rank 0 only), a contiguous 1/dp of it on
//      each dp rank or, where stage 3 slices the unit, each dp rank its slice; no collective,
//      nothing gathered; then fsyncs;
//   4. the outcomes are agreed (agree_everywhere: every rank learns the same lowest failing rank's
//      error, which names it); the writer renames the file into place only when every rank's part
//      is durable, else removes it, so the final name never holds a partial file and a previous
//      file there keeps its bytes;
//   5. the outcome (success, or the writer's error: the code and the first bytes of its message)
//      is broadcast from the writer: every rank returns the same success or the same error.
Result<bool> OffloadEngine::Impl::save_weights_parallel(const std::string& path, WeightFormat format) {
  STRATA_ASSIGN_OR_RETURN(ModelLayout full, describe_model(config.model));
  // The same on every rank (a function of the config): a failure here returns before any
  // collective, on every rank alike.
  auto header = weights_header(full, format, config.model.dtype);
  if (!header.ok()) return header.status().with_context("weights '" + path + "'");
  const bool writer = tp_rank == 0 && dp_rank == 0 && pp_rank == 0;
  // 1. The temporary file, then whether it exists.
  Status created;
  if (writer) created = SafetensorsPartWriter::create(path, *header);
  std::uint32_t have_file = created.ok() ? 1 : 0;
  Status mine = broadcast_from_writer(&have_file, 1, "weights: whether the temporary file exists");
  // 2. Whether every rank sees it: the ranks write into one file, so they must share a file
  // system at the path. Where one does not (node-local disks on several nodes), the writer removes
  // the file and, without a pipeline, every rank returns false for the gather path (the first
  // rank gathers the model and writes alone); a pipeline's stages must share it, so there it is
  // the error, naming the rank.
  if (mine.ok() && have_file == 1) {
    const std::string tmp = SafetensorsPartWriter::temp_path(path);
    Status sees;
    if (hide_weights_file || !std::filesystem::exists(tmp)) {
      sees = failed_precondition(rank_name() + " does not see '" + tmp +
                                 "', which the first rank created: the ranks do not share a file system at that path");
    }
    sees = agree_everywhere(sees, "the weights file", "see");
    if (!sees.ok() && sees.code() == StatusCode::kFailedPrecondition && pp_size == 1) {
      if (writer) SafetensorsPartWriter::discard(path);
      return false;
    }
    mine = sees;
  }
  // 3. This rank's part.
  if (mine.ok() && have_file == 1) mine = write_weights_part(path, format, full, *header);
  // 4. Every rank's outcome agreed; the writer publishes or removes the file.
  const Status all = agree_everywhere(mine, "its part of the weights", "write");
  Status written;  // the writer's outcome
  if (writer) {
    if (!created.ok()) {
      written = created.with_context("weights '" + path + "' not written");
    } else if (!all.ok()) {
      written = Status(all.code(), "weights '" + path +
                                       "' not written (a previous file at that path is unchanged): " + all.message());
    } else {
      written = SafetensorsPartWriter::publish(path).with_context("weights '" + path + "'");
    }
    if (!written.ok()) SafetensorsPartWriter::discard(path);
  }
  // 5. The outcome, as 4-byte words: 1, or 0, the status code and the first bytes of the
  // writer's error.
  constexpr std::size_t kWords = 1 + 256;
  std::array<std::uint32_t, kWords> word{};
  if (writer && written.ok()) {
    word[0] = 1;
  } else if (writer) {
    const std::string& m = written.message();
    word[1] = static_cast<std::uint32_t>(written.code());
    std::memcpy(word.data() + 2, m.data(), std::min<std::size_t>(m.size(), 4 * (kWords - 2) - 1));
  }
  Status b = broadcast_from_writer(word.data(), kWords, "weights outcome");
  if (writer) {
    STRATA_RETURN_IF_ERROR(written);
    return true;
  }
  if (!b.ok()) {
    if (!all.ok()) return all.with_context("weights '" + path + "' not written");
    return b.with_context("weights '" + path + "': broadcast of the outcome");
  }
  if (word[0] != 1) {
    const char* text = reinterpret_cast<const char*>(word.data() + 2);
    const std::string why(text, strnlen(text, 4 * (kWords - 2)));
    const auto code = word[1] == 0 || word[1] > static_cast<std::uint32_t>(StatusCode::kCancelled)
                          ? StatusCode::kIoError
                          : static_cast<StatusCode>(word[1]);
    return Status(code, why);
  }
  return true;
}

// Which ranks write a parameter's elements: the stage holding it (the lowest: GPT-2's tied
// embedding is the first stage's); of its tensor-parallel shards each its own, a replicated
// parameter tp rank 0 alone; of the data-parallel replicas each dp rank a contiguous 1/dp of the
// shard's elements (rank r: [n r / dp, n (r + 1) / dp)), or under stage 3 each rank the elements
// of its slice of the unit. The union is every element once. A shard's elements map
// onto the file by encode_weights_part: one pwrite per run of adjacent file bytes.
Status OffloadEngine::Impl::write_weights_part(const std::string& path, WeightFormat format,
                                               const ModelLayout& full, const SafetensorsHeader& header) {
  const std::string who = rank_name();
  SafetensorsPartWriter::WriteFault fault;
  if (io_faults != nullptr) {
    fault = [f = io_faults](const std::string& file, std::uint64_t offset, std::uint64_t nbytes) {
      return f->error_for(IoOp::kWrite, file, offset, nbytes);
    };
  }
  auto part = SafetensorsPartWriter::open(path, header, std::move(fault));
  auto cannot_write = [&](const Status& s) {
    return Status(s.code(), who + " could not write its tensors: " + s.message());
  };
  if (!part.ok()) return cannot_write(part.status());
  if (placement.sharding.device_params_sliced) STRATA_RETURN_IF_ERROR(compute->synchronize());  // slices are read in place
  const std::uint64_t w = half ? 2 : 4;
  int unit = -1;
  std::vector<char> bytes;  // unit `unit`: its working parameters, or this rank's slice (stage 3)
  std::vector<float> values;
  std::vector<EncodedRange> ranges;
  Status s;
  for (std::size_t i = 0; i < full.params.size() && s.ok(); ++i) {
    if (!full.params[i].owns_storage() || holder(full.params[i].module) != pp_rank) continue;
    const ParamDesc& p = layout().params[i];  // this rank's shard
    if (p.shard.kind == ShardKind::kReplicated && tp_rank != 0) continue;
    const int k = owned_index(static_cast<int>(i));
    if (k < 0) return internal_error(who + " holds no parameter '" + p.name + "'");
    const OwnedParam& o = owned[static_cast<std::size_t>(k)];
    const std::size_t uu = static_cast<std::size_t>(o.unit);
    const bool sliced = placement.units[uu].gathered_at_fetch;
    // This rank's elements [a, b) of the shard: of a replica, its contiguous 1/dp; under stage 3,
    // those its slice of the unit holds (below, once the slice is read).
    std::uint64_t a = 0, b = o.n;
    if (!sliced) {
      a = o.n * static_cast<std::uint64_t>(dp_rank) / static_cast<std::uint64_t>(dp_size);
      b = o.n * static_cast<std::uint64_t>(dp_rank + 1) / static_cast<std::uint64_t>(dp_size);
      if (a == b) continue;
    }
    if (o.unit != unit) {
      unit = o.unit;
      Status read;
      if (sliced) {
        bytes.resize(placement.units[uu].slice.len * w);
        read = read_param_slice(unit, bytes.data());
      } else {
        read = read_unit_params(unit, bytes);
      }
      if (!read.ok()) {
        const std::string what = sliced ? "its slice of module '" + layout().modules[uu].name + "'"
                                 : tp_size > 1 ? "its shard of '" + p.name + "'"
                                               : "'" + p.name + "'";
        return Status(read.code(), who + " could not read " + what + ": " + read.message());
      }
    }
    const char* src = nullptr;  // element a of the shard
    if (sliced) {  // the slice holds the unit's elements [begin, begin + len) (its fp32 order)
      const std::uint64_t first = o.grad_in_unit / 4, begin = placement.units[uu].slice.begin, end = begin + placement.units[uu].slice.len;
      a = std::max(first, begin) - first;
      b = std::min(first + o.n, end);
      if (b <= first + a) continue;
      b -= first;
      src = bytes.data() + (first + a - begin) * w;
    } else {
      src = bytes.data() + o.param_in_unit + a * w;
    }
    values.resize(b - a);
    STRATA_RETURN_IF_ERROR(convert(src, wdtype, values.data(), DType::kF32, b - a));
    const std::vector<ElementRun> runs =
        shard_runs(p, static_cast<std::int64_t>(a), static_cast<std::int64_t>(b));
    s = encode_weights_part(full, header, static_cast<int>(i), format, config.model.dtype, runs, values, ranges);
    for (std::size_t r = 0; s.ok() && r < ranges.size(); ++r) {
      s = part->write_range(ranges[r].tensor, ranges[r].offset, ranges[r].bytes.data(), ranges[r].bytes.size());
      if (kill_after_weights_writes != 0 && part->writes() >= kill_after_weights_writes) std::raise(SIGKILL);
    }
  }
  Status closed = part->close();
  weights_writes += part->writes();
  if (s.ok()) s = closed;
  return s.ok() ? s : cannot_write(s);
}

Status OffloadEngine::Impl::agree_everywhere(const Status& mine, const std::string& what, const char* verb) {
  Status all = mine;
  if (tp_size > 1) all = first_failure(*tp_step, all, what, "tensor-parallel", nullptr, verb);
  if (dp_size > 1) all = first_failure(*dp_caller, all, what, "data-parallel", nullptr, verb);
  if (pp_size > 1) all = first_failure(*pp_caller, all, what, "pipeline", nullptr, verb);
  return all;
}

Status OffloadEngine::Impl::broadcast_from_writer(std::uint32_t* words, std::size_t n, const char* what) {
  // The writer's tp group first, then the dp groups (the first stage's get it from theirs), then
  // the pp groups (every stage from the first).
  Status b;
  if (tp_size > 1) b = tp_step->broadcast(words, n, DType::kF32, 0).wait();
  if (b.ok() && dp_size > 1) b = dp_wait(dp_tracks[0], dp_caller->broadcast(words, n, DType::kF32, 0), what, -1, 4 * n);
  if (b.ok() && pp_size > 1) b = pp_caller->broadcast(words, n, DType::kF32, 0).wait();
  return b.ok() ? b : b.with_context(what);
}

std::string OffloadEngine::Impl::rank_name() const {
  std::string name;
  auto add = [&name](const std::string& part) { name += (name.empty() ? "" : ", ") + part; };
  if (pp_size > 1) add("pipeline stage " + std::to_string(pp_rank));
  if (tp_size > 1) add("tensor-parallel rank " + std::to_string(tp_rank) + " of " + std::to_string(tp_size));
  if (dp_size > 1) add("data-parallel rank " + std::to_string(dp_rank) + " of " + std::to_string(dp_size));
  return name;
}

// One step's micro-batches through this stage in the schedule's order. Forwards and backwards
// each run in micro-batch order, so every unit's gradient accumulates in the single process's
// order. The whole step is one pass of the prefetch trace (recorded in the first step).
//
// The boundary exchange is in compute-stream order, so the caller never synchronizes the stream
// mid-step and compute overlaps the transfers. A receive is posted by a host function at the
// start of the op before the one that reads it (the step's first receive, if op 0 needs one, when
// the step starts), into one of two buffers per direction used alternately: the transfer
// proceeds while that op computes. Posting earlier would keep more receives in flight, and the
// comm queue thread polls while anything is in flight, which costs compute time when the
// stages share cores. The op then has the stream wait for its receive alone and copy it into the
// model's buffer (the slot's boundary activation, or the shared activation gradient), which
// stream order makes free: every earlier reader of it was enqueued before; the buffer it used is
// reposted two receives later, after that copy in stream order. A send copies the output into its
// micro-batch's send buffer and is issued by the next host function, so it leaves as soon as the
// output exists while the stream goes on. Per peer, receives are posted and sends issued in
// micro-batch order on both sides (one direction per peer: activations go to s+1, gradients to
// s-1), which is what MPI's matching per (pair, Comm) needs. A stage blocks only on receives
// whose matching sends its neighbour issues in its own stream order without waiting for anything
// of ours later in the schedule than the op it unblocks: the same dependency graph as a blocking
// exchange, so no (p, m) deadlocks.
Status OffloadEngine::Impl::run_pipeline(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets,
                                         std::int64_t micro, float dloss, std::int64_t step, double lr) {
  const std::int64_t B = config.micro_batch, T = config.seq_len;
  const auto per = static_cast<std::size_t>(B * T);
  const int k = model->activation_slots();
  const int v = chunks;
  const int prev = (pp_rank + pp_size - 1) % pp_size, next = (pp_rank + 1) % pp_size;
  const DType wire = wire_dtype();
  const std::uint64_t bytes = boundary_bytes();
  const std::size_t count = bytes / dtype_size(wire);
  const auto started = std::chrono::steady_clock::now();
  Comm* const comm = pp_stream.get();
  // Interleaved: the activation gradients go on a Comm of their own (pp_stream_grads).
  Comm* const grad_comm = v > 1 ? pp_stream_grads.get() : comm;
  sends.clear();
  pp_stream_wait_seconds = 0.0;
  cyclic = false;
  begin_pass();
  // A stage with tensor or data parallelism: a caller error inside a module's work fails the
  // compute stream and the stage goes on issuing every later module's collectives and exchanges
  // (keep_module_place; the cpu backend, whose failed stream skips the kernels but runs those):
  // the model's work (its tensor collectives) and, with data parallelism, the gradient
  // reduce-scatters at each unit's last touch (reduce_after_failure). Not at stage 3 (its
  // parameter all-gathers are in the fetch, which that mode skips) nor with the optimizer on
  // the device (its buckets, and its tied sum after the pass). A stage without either keeps its
  // place through any caller error of the schedule (keep_place below).
  keep_modules = (tp_size > 1 || dp_size > 1) && settings.zero_stage < 3 && !placement.sharding.optimizer_on_device && !placement.sharding.optimizer_split &&
                 device->info().kind == DeviceKind::kCpu;
  pass_error = ok_status();
  struct EndKeep {
    Impl* t;
    ~EndKeep() {
      t->keep_modules = false;
      t->pass_error = ok_status();
      (void)t->model->set_failed_pass(false);
    }
  } end_keep{this};
  // The stage's ops as (forward, micro-batch, chunk): the schedule's with one chunk, the
  // interleaved order with several.
  std::vector<ChunkOp> ops;
  if (v == 1) {
    for (const PipelineOp& op :
         pipeline_ops(settings.pipeline_schedule, pp_size, pp_rank, static_cast<int>(micro)))
      ops.push_back(ChunkOp{op.forward, op.micro, 0});
  } else {
    STRATA_ASSIGN_OR_RETURN(ops, interleaved_pipeline_ops(pp_size, pp_rank, v, static_cast<int>(micro)));
  }
  // Whether an op receives its input (the first virtual stage's forward and the last one's
  // backward do not) and sends its output (the last virtual stage's forward, the first's backward
  // do not); virtual stage c·p + s is chunk c of stage s.
  auto receives = [&](const ChunkOp& op) {
    return op.forward ? !(pp_rank == 0 && op.chunk == 0) : !(pp_rank + 1 == pp_size && op.chunk + 1 == v);
  };
  auto sends_out = [&](const ChunkOp& op) {
    return op.forward ? !(pp_rank + 1 == pp_size && op.chunk + 1 == v) : !(pp_rank == 0 && op.chunk == 0);
  };
  // Per op, the receive buffer it uses: the n-th receive of its direction in the step takes
  // buffer n % kBuffers (with one chunk n is the micro-batch, as every op of a direction
  // receives).
  constexpr int kBuffers = partition::kPipelineRecvBuffers;
  std::vector<int> recv_buffer(ops.size(), -1);
  {
    int n_act = 0, n_grad = 0;
    for (std::size_t j = 0; j < ops.size(); ++j) {
      if (!receives(ops[j])) continue;
      recv_buffer[j] = (ops[j].forward ? n_act++ : n_grad++) % kBuffers;
    }
  }
  // Posts op j's receive, if it has one (in stream order, on the worker thread).
  auto post = [&](std::size_t j) -> Status {
    if (j >= ops.size()) return ok_status();
    const ChunkOp& op = ops[j];
    if (!receives(op)) return ok_status();
    const auto i = static_cast<std::size_t>(recv_buffer[j]);
    void* buf = op.forward ? act_recv[i].data() : grad_recv[i].data();
    CommWork* work = op.forward ? &act_recv_work[i] : &grad_recv_work[i];
    const int peer = op.forward ? prev : next;
    Comm* c = op.forward ? comm : grad_comm;
    return detail::host_fn_after_failure(*compute,
                                         "pipeline: post a receive from stage " + std::to_string(peer),
                                         [c, buf, work, count, wire, peer]() {
                                           *work = c->recv(buf, count, wire, peer);
                                           return ok_status();
                                         });
  };
  // The exchanges (posting a receive, waiting for it, issuing a send) run even after the stream
  // failed: a stage whose pass failed keeps its place in the schedule, so its neighbours' passes
  // go through and every stage reaches the step's agreement on the failure (docs/offload.md
  // "Faults", "A rank whose pass failed keeps its place"). What such a stage sends is whatever
  // its send buffer held; the step fails on every stage, so nothing reads it.
  // The stream waits for one receive (timed: the stage's idle time, its share of the bubble).
  auto wait_receive = [&](const std::vector<CommWork>& works, int buffer, std::string what) -> Status {
    const auto i = static_cast<std::size_t>(buffer);
    return detail::host_fn_after_failure(
        *compute, "pipeline: " + what, [this, w = &works[i], what]() -> Status {
          const auto t0 = std::chrono::steady_clock::now();
          Status st = w->wait();
          pp_stream_wait_seconds +=
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          return st.with_context("pipeline: " + what);
        });
  };
  // ... then copies it to where the model reads it.
  auto receive = [&](const std::vector<CommWork>& works, std::vector<ArenaBuffer>& bufs, int buffer,
                     void* dst, std::string what) -> Status {
    STRATA_RETURN_IF_ERROR(wait_receive(works, buffer, std::move(what)));
    return compute->copy_async(dst, bufs[static_cast<std::size_t>(buffer)].data(), bytes,
                               CopyKind::kDeviceToDevice);
  };
  // Issues the send of send buffer `index` (a·v + chunk) in stream order.
  auto issue_send = [&](std::vector<ArenaBuffer>& bufs, int index, int peer, Comm* c) -> Status {
    void* out = bufs[static_cast<std::size_t>(index)].data();
    pp_bytes += bytes;
    return detail::host_fn_after_failure(*compute, "pipeline: send to stage " + std::to_string(peer),
                                         [this, c, out, count, wire, peer]() {
                                           sends.push_back(c->send(out, count, wire, peer));
                                           return ok_status();
                                         });
  };
  // Copies an output to its send buffer and issues the send behind it.
  auto send = [&](std::vector<ArenaBuffer>& bufs, int index, const void* src, int peer, Comm* c) -> Status {
    STRATA_RETURN_IF_ERROR(compute->copy_async(bufs[static_cast<std::size_t>(index)].data(), src, bytes,
                                               CopyKind::kDeviceToDevice));
    return issue_send(bufs, index, peer, c);
  };
  auto chunk_name = [&](const ChunkOp& op) {
    return v == 1 ? std::string() : " (chunk " + std::to_string(op.chunk) + ")";
  };
  auto receive_name = [&](const ChunkOp& op) {
    return "receive of micro-batch " + std::to_string(op.micro) +
           (op.forward ? "'s activations" : "'s activation gradients") + chunk_name(op) + " from stage " +
           std::to_string(op.forward ? prev : next);
  };
  // Partial offload with data parallelism at stages 2-3: the device units reduced after each
  // micro-batch's backward op (interleaved: the units of the op's chunk).
  const bool reduce_each = placement.sharding.split_state_sharded && settings.zero_stage >= 2 && step > 0;
  // What of op j's exchanges was enqueued: a caller error inside the op leaves the rest to
  // finish_exchanges.
  struct Exchanged {
    bool posted = false, received = false, sent = false;
  };
  auto run_op = [&](std::size_t j, Exchanged& done) -> Status {
    const ChunkOp& op = ops[j];
    const int a = op.micro, c = op.chunk;
    const auto [first, end] = placement.stage.chunk_ranges[static_cast<std::size_t>(c)];
    STRATA_RETURN_IF_ERROR(post(j + 1));  // the next op's input arrives while this one computes
    done.posted = true;
    // Interleaved: each (micro-batch, chunk) has a slot of its own, which gets the batch
    // (the tokens for the embedding's chunk, the targets for the head's) at its forward.
    STRATA_RETURN_IF_ERROR(model->select_slot(v > 1 ? chunk_slots.slot(a, c, v) : a % k));
    if (v > 1) STRATA_RETURN_IF_ERROR(model->select_range(c));
    if (op.forward) {
      if (c == 0 || v > 1) {
        STRATA_RETURN_IF_ERROR(
            model->set_batch(inputs.subspan(a * per, per), targets.subspan(a * per, per), B, T));
      }
      if (model->boundary_bytes() != bytes) {
        return internal_error("pipeline: boundary tensor of " + std::to_string(model->boundary_bytes()) +
                              " bytes, expected " + std::to_string(bytes));
      }
      if (receives(op)) {
        done.received = true;
        STRATA_RETURN_IF_ERROR(receive(act_recv_work, act_recv, recv_buffer[j],
                                       model->boundary_activation(first), receive_name(op)));
      }
      STRATA_RETURN_IF_ERROR(run_forward(true, c));
      // The losses: the head's chunk (the last) computes them; a stage without the head copies zeros.
      if (c + 1 == v) STRATA_RETURN_IF_ERROR(model->copy_losses(a));
      if (sends_out(op)) {
        done.sent = true;
        STRATA_RETURN_IF_ERROR(send(act_send, a * v + c, model->boundary_activation(end), next, comm));
      }
    } else {
      if (receives(op)) {
        done.received = true;
        STRATA_RETURN_IF_ERROR(
            receive(grad_recv_work, grad_recv, recv_buffer[j], model->activation_grad(), receive_name(op)));
      }
      // Every unit is read by one chunk of this stage, whose backwards run in micro-batch
      // order: micro-batch 0 starts its gradient, micro-batch m − 1 completes it.
      STRATA_RETURN_IF_ERROR(run_backward(dloss, a == 0, a + 1 == micro, step, lr, c));
      if (sends_out(op)) {
        done.sent = true;
        STRATA_RETURN_IF_ERROR(send(grad_send, a * v + c, model->activation_grad(), prev, grad_comm));
      }
      if (reduce_each) {
        // Partial offload, pipeline x data parallel at stages 2-3: this micro-batch's gradients
        // of the device units chunk c reads are complete (the op ran every module of the chunk,
        // and no other chunk of this stage reads them), so they are reduce-scattered now, as
        // run_micro_batches does after each micro-batch, and added into offload.grad_slices;
        // then zeroed for the chunk's next backward op (the staging holds the copy the
        // collective reads). Per unit the micro-batches add in order (a chunk's backwards run
        // in micro-batch order): ratio 1's fp32 order. Behind the send in stream order: the
        // previous stage's backward does not wait for the collective.
        STRATA_RETURN_IF_ERROR(reduce_device_units(/*accumulate=*/a > 0, c));
        if (a + 1 < micro) STRATA_RETURN_IF_ERROR(zero_device_grads(c));
      }
    }
    return ok_status();
  };
  // After a caller error: op j's exchanges not yet enqueued, without its compute (the stream has
  // failed, so the copies around them would be skipped anyway).
  auto finish_exchanges = [&](std::size_t j, const Exchanged& done) -> Status {
    const ChunkOp& op = ops[j];
    if (!done.posted) STRATA_RETURN_IF_ERROR(post(j + 1));
    if (receives(op) && !done.received) {
      STRATA_RETURN_IF_ERROR(
          wait_receive(op.forward ? act_recv_work : grad_recv_work, recv_buffer[j], receive_name(op)));
    }
    if (sends_out(op) && !done.sent) {
      const int index = op.micro * v + op.chunk;
      STRATA_RETURN_IF_ERROR(op.forward ? issue_send(act_send, index, next, comm)
                                        : issue_send(grad_send, index, prev, grad_comm));
    }
    return ok_status();
  };
  // A caller error inside an op fails the compute stream (its later kernels are skipped) and the
  // stage keeps its place: the rest of the schedule's exchanges are still enqueued, then the tied
  // embedding's sum. Tensor or data parallelism inside the stage issue collectives of their own
  // in the skipped ops (they keep their place for an error inside a module's work through
  // keep_modules above), and the optimizer on the device (or partly there) sums the tied
  // embedding after the pass, so there a caller error still stops the pass (docs/offload.md
  // "Not built yet").
  const bool keep_place = tp_size <= 1 && dp_size <= 1 && !placement.sharding.optimizer_on_device && !placement.sharding.optimizer_split;
  auto schedule = [&]() -> Status {
    STRATA_RETURN_IF_ERROR(post(0));
    Status failed;
    for (std::size_t j = 0; j < ops.size(); ++j) {
      Exchanged done;
      if (failed.ok()) {
        Status st = run_op(j, done);
        if (st.ok()) continue;
        if (!keep_place) return st;
        failed = st;
        STRATA_RETURN_IF_ERROR(compute->host_fn("pipeline: the stage's pass failed", [st]() { return st; }));
      }
      STRATA_RETURN_IF_ERROR(finish_exchanges(j, done));
    }
    return failed.ok() ? pass_error : failed;
  };
  Status s = schedule();
  // Always drained before returning, also after an error: the stream's host functions use
  // pp_stream and the handle vectors, which the caller must not touch while they run.
  Status sync = compute->synchronize();
  if (s.ok()) s = sync;
  for (const CommWork& w : sends) {
    Status ws = w.wait();
    if (s.ok() && !ws.ok()) s = ws.with_context("pipeline: send");
  }
  sends.clear();
  pp_wait_seconds += pp_stream_wait_seconds;
  pp_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (!s.ok()) {
    // The tied embedding's sum is the step's last exchange between the first and the last stage,
    // and the other end's pass may have gone through: a stage that keeps its place joins it too,
    // on whatever its buffer holds (the step fails on every stage, so nothing reads the sum).
    tied_landed.reset();
    if ((keep_place || keep_modules) && step > 0 && pp_tied) {
      (void)gstream->synchronize();  // the gradient copies into the buffer have retired
      const std::size_t uu = static_cast<std::size_t>(placement.stage.tied_unit);
      auto [buf, n] = unit_grads(placement.stage.tied_unit);
      if (grads_on_nvme) buf = grad_staging.bytes(), n = placement.sharding.host_state_sharded ? placement.units[uu].slice.len : placement.units[uu].grad_bytes / 4;
      (void)reduce_tied_grads(reinterpret_cast<float*>(buf), n);
    }
    return s;
  }
  if (tied_landed) {  // the host optimizer's tied unit: summed, then handed to the optimizer thread
    const Command c = *tied_landed;
    tied_landed.reset();
    STRATA_RETURN_IF_ERROR(gstream->synchronize());
    STRATA_RETURN_IF_ERROR(sum_tied_landed(c));
    {
      std::lock_guard<std::mutex> lock(mu);
      commands.push_back(c);
    }
    cv.notify_all();
  }
  if (step > 0 && pp_tied && placement.split_device(placement.stage.tied_unit) && !placement.sharding.split_state_sharded) {
    // Partial offload, the tied unit among this stage's device units: its gradient accumulated
    // in offload.grads; summed with the other end's here, at the point where a host unit's is
    // (the other end's may be either, the all-reduce on the caller either way), before
    // scan_device_units reads it. The compute stream was synchronized above. With data
    // parallelism the reduced slice is summed instead (run_micro_batches).
    STRATA_RETURN_IF_ERROR(
        reduce_tied_grads(reinterpret_cast<float*>(reinterpret_cast<char*>(dgrads) + grad_begin(placement.stage.tied_unit)),
                          placement.units[static_cast<std::size_t>(placement.stage.tied_unit)].grad_bytes / 4));
  }
  return end_pass();
}

void OffloadEngine::Impl::to_elements(int u, const char* working, char* elements) const {
  const std::uint64_t w = half ? 2 : 4;
  for (int k : owned_of_unit[static_cast<std::size_t>(u)]) {
    const OwnedParam& o = owned[static_cast<std::size_t>(k)];
    std::memcpy(elements + o.grad_in_unit / 4 * w, working + o.param_in_unit, o.n * w);
  }
}

void OffloadEngine::Impl::from_elements(int u, const char* elements, char* working) const {
  const std::uint64_t w = half ? 2 : 4;
  for (int k : owned_of_unit[static_cast<std::size_t>(u)]) {
    const OwnedParam& o = owned[static_cast<std::size_t>(k)];
    std::memcpy(working + o.param_in_unit, elements + o.grad_in_unit / 4 * w, o.n * w);
  }
}

Status OffloadEngine::Impl::read_param_slice(int u, char* slice) {
  const std::size_t uu = static_cast<std::size_t>(u);
  const std::uint64_t bytes = placement.units[uu].slice.len * (half ? 2 : 4);
  if (bytes == 0) return ok_status();
  if (placement.units[uu].home == Tier::kNvme) return swap->read(param_key(u), slice, bytes).wait();
  if (placement.units[uu].slice_at_home) {
    // Stage 3 in device memory, cpu backend only (check_data_parallel): the arena is host memory.
    // Read on the h2d stream (a fetch, ordered after the update by the caller's synchronisation of
    // the compute stream at the end of the step) or by the caller with the compute stream idle
    // (read_unit_params).
    std::memcpy(slice, resident + placement.units[uu].resident_offset, bytes);
    return ok_status();
  }
  std::memcpy(slice, host_params.bytes() + placement.units[uu].host_offset, bytes);
  return ok_status();
}

Status OffloadEngine::Impl::write_param_slice(int u, const char* slice, bool next) {
  const std::size_t uu = static_cast<std::size_t>(u);
  const std::uint64_t bytes = placement.units[uu].slice.len * (half ? 2 : 4);
  if (bytes == 0) return ok_status();
  if (placement.units[uu].home == Tier::kNvme) {
    detail::HostSpan span(tracer, track.nvme_publish, TraceCounter::kNvmeWrite, "write", u, bytes);
    STRATA_RETURN_IF_ERROR(swap->write(param_key(u, next), slice, bytes).wait());
  } else if (placement.units[uu].slice_at_home) {
    // Stage 3 in device memory (the device optimizer, so never the delayed update's next version).
    STRATA_RETURN_IF_ERROR(stager->upload(resident + placement.units[uu].resident_offset, slice, bytes));
    STRATA_RETURN_IF_ERROR(compute->synchronize());
  } else {
    std::memcpy(next ? delayed_next.bytes() + placement.units[uu].next_offset : host_params.bytes() + placement.units[uu].host_offset,
                slice, bytes);
  }
  // Set before the unit is marked updated (publish_delayed reads it after waiting for that).
  if (next) next_fresh[uu] = 1;
  return ok_status();
}

Status OffloadEngine::Impl::gather_unit_params(int u, Comm& comm, int trace_track, char* send, char* recv,
                                               char* working, bool agree) {
  const std::size_t uu = static_cast<std::size_t>(u);
  const std::uint64_t w = half ? 2 : 4, len = placement.units[uu].slice.len;
  {
    detail::HostSpan span(tracer, track.nvme_fetch,
                          placement.units[uu].home == Tier::kNvme ? TraceCounter::kNvmeRead : TraceCounter::kNone, "read slice",
                          u, len * w);
    Status read = read_param_slice(u, send);
    if (agree) {
      STRATA_RETURN_IF_ERROR(agree_on_read(
          comm, read, "its slice of module '" + layout().modules[uu].name + "' (working parameters)",
          "data-parallel"));
    }
    STRATA_RETURN_IF_ERROR(read);
  }
  return gather_read_slice(u, comm, trace_track, send, recv, working);
}

Status OffloadEngine::Impl::gather_read_slice(int u, Comm& comm, int trace_track, char* send, char* recv,
                                              char* working) {
  const std::size_t uu = static_cast<std::size_t>(u);
  const std::uint64_t w = half ? 2 : 4, c = placement.units[uu].slice.chunk, len = placement.units[uu].slice.len;
  std::memset(send + len * w, 0, (c - len) * w);
  STRATA_RETURN_IF_ERROR(dp_wait(trace_track, comm.all_gather(send, recv, c, half ? DType::kBF16 : DType::kF32),
                                 "gather parameters", u, static_cast<std::uint64_t>(dp_size) * c * w));
  from_elements(u, recv, working);
  return ok_status();
}

Status OffloadEngine::Impl::early_gather_unit_params(int u, bool mine, char* working, std::atomic<bool>* early_ok) {
  early_ok->store(false);
  const std::size_t uu = static_cast<std::size_t>(u);
  const std::uint64_t w = half ? 2 : 4, len = placement.units[uu].slice.len;
  char* send = fetch_send.bytes();
  char* recv = fetch_recv.bytes();
  if (mine) {
    // Read only after the gate saw the agreed mark: the slice then holds the step's update, and
    // nothing rewrites it before this rank's next pass has used or dropped this copy.
    detail::HostSpan span(tracer, track.nvme_fetch,
                          placement.units[uu].home == Tier::kNvme ? TraceCounter::kNvmeRead : TraceCounter::kNone, "read slice",
                          u, len * w);
    Status read = read_param_slice(u, send);
    if (!read.ok()) {
      STRATA_LOG(kDebug, kOffload) << "offload: early read of this rank's slice of param." << u
                                   << " failed; refetched on demand: " << read.to_string();
      mine = false;
    }
  }
  // 1 where a rank does not hold its slice of the step's version, max over the ranks: the same
  // verdict on every rank, from what every rank sent (not from when its gate looked).
  float missing = mine ? 0.0f : 1.0f, any_missing = 0.0f;
  Status agreed = dp_fetch->all_reduce(&missing, &any_missing, 1, DType::kF32, ReduceOp::kMax).wait();
  if (!agreed.ok()) {
    return agreed.with_context("data parallel: agreeing on the early fetch of module '" +
                               layout().modules[uu].name + "'");
  }
  if (any_missing != 0.0f) return ok_status();  // every rank refetches it on demand
  STRATA_RETURN_IF_ERROR(gather_read_slice(u, *dp_fetch, dp_tracks[3], send, recv, working));
  early_ok->store(true);
  return ok_status();
}

Status OffloadEngine::Impl::write_checkpoint_file(const SafetensorsWriter& w, const std::string& path) {
  STRATA_RETURN_IF_ERROR(w.write(path));
  std::error_code ec;
  const auto bytes = std::filesystem::file_size(path, ec);
  if (!ec) checkpoint_bytes += bytes;
  return ok_status();
}

Status OffloadEngine::Impl::agree_on_read(Comm& comm, const Status& mine, const std::string& what,
                                          const char* group, const char* verb) {
  int failing = -1;
  Status s = first_failure(comm, mine, what, group, &failing, verb);
  if (s.ok() || failing < 0) return s;
  return Status(s.code(), std::string(group) + " rank " + std::to_string(failing) + " of " +
                              std::to_string(comm.size()) + " could not " + verb + " " + what + ": " + s.message());
}

Status OffloadEngine::Impl::first_failure(Comm& comm, const Status& mine, const std::string& what,
                                          const char* group, int* failing, const char* verb) {
  if (failing != nullptr) *failing = -1;
  // Word 0: 1 read, 0 failed; word 1: the status code; then the message's first bytes (NUL-padded).
  std::array<std::uint32_t, kAgreeWords> word{};
  word[0] = mine.ok() ? 1 : 0;
  word[1] = static_cast<std::uint32_t>(mine.code());
  if (!mine.ok())
    std::memcpy(word.data() + 2, mine.message().data(),
                std::min<std::size_t>(mine.message().size(), 4 * (kAgreeWords - 2) - 1));
  std::vector<std::uint32_t> all(kAgreeWords * static_cast<std::size_t>(comm.size()));
  // The words travel as raw f32 bits (an all-gather moves bits, it does not add).
  Status s = comm.all_gather(word.data(), all.data(), kAgreeWords, DType::kF32).wait();
  if (!s.ok()) {
    return s.with_context(std::string(group) + " ranks: exchanging whether each could " + verb + " " + what);
  }
  for (int r = 0; r < comm.size(); ++r) {
    const std::uint32_t* theirs = all.data() + static_cast<std::size_t>(r) * kAgreeWords;
    if (theirs[0] == 1) continue;
    const std::string cause(reinterpret_cast<const char*>(theirs + 2),
                            strnlen(reinterpret_cast<const char*>(theirs + 2), 4 * (kAgreeWords - 2)));
    const auto code = theirs[1] == 0 || theirs[1] > static_cast<std::uint32_t>(StatusCode::kCancelled)
                          ? StatusCode::kIoError
                          : static_cast<StatusCode>(theirs[1]);
    if (failing != nullptr) *failing = r;
    return Status(code, cause);
  }
  return ok_status();
}

Status OffloadEngine::Impl::dp_wait(int trace_track, CommWork w, const char* what, int u, std::uint64_t bytes) {
  detail::HostSpan span(tracer, trace_track, TraceCounter::kComm, what, u, bytes);
  dp_bytes.fetch_add(bytes, std::memory_order_relaxed);
  Status s = w.wait();
  if (s.ok()) return s;
  std::string context = std::string("data parallel: ") + what;
  if (u >= 0) context += " of module '" + layout().modules[static_cast<std::size_t>(u)].name + "'";
  return s.with_context(context);
}

Status OffloadEngine::Impl::sum_over_ranks(std::span<double> values) {
  const std::size_t n = values.size();
  gathered_sums.resize(n * static_cast<std::size_t>(dp_size));
  STRATA_RETURN_IF_ERROR(dp_wait(dp_tracks[0], dp_caller->all_gather(values.data(), gathered_sums.data(), 2 * n, DType::kF32),
                                 "sum over ranks", -1, gathered_sums.size() * 8));
  for (std::size_t i = 0; i < n; ++i) {
    double total = 0.0;
    for (int r = 0; r < dp_size; ++r) total += gathered_sums[static_cast<std::size_t>(r) * n + i];
    values[i] = total;
  }
  return ok_status();
}

Status OffloadEngine::Impl::reduce_unit_grads(int u, bool accumulate, bool scan, float inv_scale) {
  const std::size_t uu = static_cast<std::size_t>(u);
  const std::uint64_t n = placement.units[uu].grad_bytes / 4, c = placement.units[uu].slice.chunk, len = placement.units[uu].slice.len;
  const std::uint64_t P = static_cast<std::uint64_t>(dp_size);
  float* send = rs_send.floats();
  std::fill(send + n, send + P * c, 0.0f);
  STRATA_RETURN_IF_ERROR(dp_wait(dp_tracks[1], dp_grads->reduce_scatter(send, rs_recv.data(), c, DType::kF32, ReduceOp::kSum),
                                 "reduce-scatter gradients", u, 4 * P * c));
  const float* src = rs_recv.floats();
  if (grads_on_nvme) {
    // The same additions as on shard_grads below, on the slice read back from NVMe.
    char* slice = rs_recv.bytes();
    if (accumulate) {
      slice = grad_staging.bytes();
      {
        detail::HostSpan span(tracer, track.nvme_fetch, TraceCounter::kNvmeRead, "read gradients", u, 4 * len);
        STRATA_RETURN_IF_ERROR(read_grad_shards(u, slice));
      }
      float* acc = reinterpret_cast<float*>(slice);
      for (std::uint64_t i = 0; i < len; ++i) acc[i] += src[i];
    }
    if (scan) {
      STRATA_ASSIGN_OR_RETURN(landed_stats[uu], scan_norm(*host_opt, u, slice, placement.units[uu].slice.begin, len, inv_scale));
    }
    detail::HostSpan span(tracer, track.nvme_publish, TraceCounter::kNvmeWrite, "write gradients", u, 4 * len);
    return write_grad_shards(u, slice);
  }
  float* dst = shard_grads.floats() + placement.units[uu].slice_offset;
  if (accumulate) {
    for (std::uint64_t i = 0; i < len; ++i) dst[i] += src[i];
  } else {
    std::memcpy(dst, src, len * 4);
  }
  return ok_status();
}

Status OffloadEngine::Impl::all_reduce_device_grads() {
  STRATA_RETURN_IF_ERROR(compute->synchronize());
  const std::size_t n = placement.sizes.grad_bytes / 4;
  return dp_wait(dp_tracks[0], dp_caller->all_reduce(dgrads, dgrads, n, DType::kF32, ReduceOp::kSum),
                 "all-reduce gradients", -1, n * 4);
}

// ---- the host optimizer thread ---------------------------------------------------------------

Status OffloadEngine::Impl::start_worker() {
  worker = std::thread([this] { worker_main(); });
  return ok_status();
}

void OffloadEngine::Impl::stop_worker() {
  if (!worker.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu);
    commands.push_back(Command{Command::kStop});
  }
  cv.notify_all();
  worker.join();
}

void OffloadEngine::Impl::mark_updated(int u, std::int64_t step) {
  {
    std::lock_guard<std::mutex> lock(mu);
    updated_step[static_cast<std::size_t>(u)] = step;
  }
  cv.notify_all();
}

// Publishes unit u's updated working parameters (`bytes`, the unit's working layout) to its home.
Status OffloadEngine::Impl::publish_params(int u, const char* bytes) {
  const std::size_t uu = static_cast<std::size_t>(u);
  const std::uint64_t n = placement.units[uu].param_bytes;
  switch (placement.units[uu].home) {
    case Tier::kDevice: {
      char* host = host_params.bytes() + placement.units[uu].host_offset;
      if (delayed) {
        // The device keeps the previous parameters until the caller's publish_delayed.
        STRATA_RETURN_IF_ERROR(await_upload(u));
        if (bytes != host) std::memcpy(host, bytes, n);
        return ok_status();
      }
      if (bytes != host) std::memcpy(host, bytes, n);
      STRATA_RETURN_IF_ERROR(tracer.stream_begin(*h2d, track.h2d));
      STRATA_RETURN_IF_ERROR(traced_copy(*h2d, track.copy_h2d, "copy", resident + placement.units[uu].resident_offset,
                                         host, n, CopyKind::kHostToDevice, u));
      STRATA_RETURN_IF_ERROR(tracer.stream_end(*h2d, track.h2d, TraceCounter::kNone, "upload", u, n));
      STRATA_RETURN_IF_ERROR(h2d->record(*uploaded[uu]));
      uploaded_recorded[uu] = 1;
      return ok_status();
    }
    case Tier::kHost: {
      // Delayed update: the next copy; publish_delayed copies it home once no fetch reads it.
      char* host = delayed ? delayed_next.bytes() + placement.units[uu].next_offset : host_params.bytes() + placement.units[uu].host_offset;
      if (bytes != host) std::memcpy(host, bytes, n);
      if (delayed) next_fresh[uu] = 1;
      return ok_status();
    }
    case Tier::kNvme: {
      detail::HostSpan span(tracer, track.nvme_publish, TraceCounter::kNvmeWrite, "write", u, n);
      // Delayed update: the next version; publish_delayed makes it the one fetches read.
      STRATA_RETURN_IF_ERROR(swap->write(param_key(u, delayed), bytes, n).wait());
      if (delayed) next_fresh[uu] = 1;
      return ok_status();
    }
  }
  return ok_status();
}

Status OffloadEngine::Impl::working_from_master(int u, const float* master, std::uint64_t first,
                                                std::uint64_t n, char* out_unit) const {
  const std::uint64_t w = half ? 2 : 4;
  for (int k : owned_of_unit[static_cast<std::size_t>(u)]) {
    const OwnedParam& o = owned[static_cast<std::size_t>(k)];
    const std::uint64_t a = o.grad_in_unit / 4;
    const std::uint64_t lo = std::max<std::uint64_t>(a, first),
                        hi = std::min<std::uint64_t>(a + o.n, first + n);
    if (lo >= hi) continue;
    char* out = out_unit + o.param_in_unit + (lo - a) * w;
    if (half) {
      STRATA_RETURN_IF_ERROR(convert(master + (lo - first), DType::kF32, out, wdtype, hi - lo));
    } else {
      std::memcpy(out, master + (lo - first), (hi - lo) * 4);
    }
  }
  return ok_status();
}

Status OffloadEngine::Impl::hold_update(int u, std::int64_t done_step) {
  if (held_unit.load() != u) return ok_status();
  std::unique_lock<std::mutex> lock(mu);
  held_unit = -1;
  // The pass that reads this update waits for updated_step >= its `steps` (wait_updated).
  if (cv.wait_for(lock, std::chrono::seconds(30), [&] { return forward_ran_at >= done_step; })) return ok_status();
  return internal_error("offload: the test hold of unit " + std::to_string(u) +
                                 "'s update: no forward of module " + std::to_string(hold_forward) +
                                 " ran within 30 s");
}

Status OffloadEngine::Impl::update_unit_host(int u, std::int64_t step, double lr, float scale,
                                             std::int64_t done_step) {
  const std::size_t uu = static_cast<std::size_t>(u);
  STRATA_RETURN_IF_ERROR(hold_update(u, done_step));
  if (delayed) STRATA_RETURN_IF_ERROR(await_upload(u));  // the update writes the host copy in place
  const bool nvme_home = placement.units[uu].home == Tier::kNvme;
  char* out_unit = nvme_home                                 ? param_out_staging.bytes()
                   : delayed && placement.units[uu].home == Tier::kHost ? delayed_next.bytes() + placement.units[uu].next_offset
                                                              : host_params.bytes() + placement.units[uu].host_offset;
  if (!placement.sharding.host_state_sharded && host_opt_step[uu] >= done_step) {
    // A retry: master and moments hold the step already, only publishing the parameters failed.
    STRATA_RETURN_IF_ERROR(
        working_from_master(u, reinterpret_cast<const float*>(host_at(host_master, grad_begin(u))), 0,
                            placement.units[uu].grad_bytes / 4, out_unit));
    return publish_params(u, out_unit);
  }
  if (placement.sharding.host_state_sharded) {
    // This rank's slice [b, b + len) of the unit: its parts of each parameter are updated into
    // ag_send (the unit's fp32 element positions, working dtype), the ranks' chunks are
    // all-gathered, and every parameter is copied from there into the unit's working layout.
    const std::uint64_t b = placement.units[uu].slice.begin, len = placement.units[uu].slice.len, c = placement.units[uu].slice.chunk, off = placement.units[uu].slice_offset;
    const std::uint64_t w = half ? 2 : 4;
    if (host_opt_step[uu] >= done_step) {
      // A retry (data parallel): this rank's master and moments hold the step; only its slice of
      // the working parameters is rebuilt from the master (the rounding param_out does), then
      // gathered and published as below.
      for (int k : owned_of_unit[uu]) {
        const OwnedParam& o = owned[static_cast<std::size_t>(k)];
        const std::uint64_t a = o.grad_in_unit / 4;
        const std::uint64_t lo = std::max<std::uint64_t>(a, b), hi = std::min<std::uint64_t>(a + o.n, b + len);
        if (lo >= hi) continue;
        const float* master = host_master.floats() + off + (lo - b);
        char* out = ag_send.bytes() + (lo - b) * w;
        if (half) {
          STRATA_RETURN_IF_ERROR(convert(master, DType::kF32, out, wdtype, hi - lo));
        } else {
          std::memcpy(out, master, (hi - lo) * 4);
        }
      }
    } else {
      detail::HostSpan span(tracer, track.optimizer, TraceCounter::kOptimizer, "adam", u);
      for (int k : owned_of_unit[uu]) {
        const OwnedParam& o = owned[static_cast<std::size_t>(k)];
        const std::uint64_t a = o.grad_in_unit / 4;
        const std::uint64_t lo = std::max<std::uint64_t>(a, b), hi = std::min<std::uint64_t>(a + o.n, b + len);
        if (lo >= hi) continue;
        OptimizerBuffers ob;
        ob.master = host_master.floats() + off + (lo - b);
        ob.grad = shard_grads.bytes() + 4 * (off + (lo - b));
        ob.grad_dtype = DType::kF32;
        ob.exp_avg = host_m.floats() + off + (lo - b);
        ob.exp_avg_sq = host_v.floats() + off + (lo - b);
        ob.moment_dtype = DType::kF32;
        char* out = ag_send.bytes() + (lo - b) * w;
        ob.param_out = half ? out : nullptr;
        ob.out_dtype = wdtype;
        ob.n = hi - lo;
        STRATA_RETURN_IF_ERROR(host_opt->update(hyper_of(config.optimizer, lr, o.decay), step, scale, ob));
        if (!half) std::memcpy(out, ob.master, ob.n * 4);
      }
      host_opt_step[uu] = done_step;
    }
    if (placement.units[uu].gathered_at_fetch) return write_param_slice(u, ag_send.bytes(), delayed);  // gathered when next fetched
    STRATA_RETURN_IF_ERROR(dp_wait(dp_tracks[2], dp_params->all_gather(ag_send.data(), ag_recv.data(), c,
                                                                        // moves bits: fp16 travels as 16-bit words
                                                                        half ? DType::kBF16 : DType::kF32),
                                   "gather parameters", u, static_cast<std::uint64_t>(dp_size) * c * w));
    from_elements(u, ag_recv.bytes(), out_unit);
    return publish_params(u, out_unit);
  }
  std::optional<detail::HostSpan> span(std::in_place, tracer, track.optimizer, TraceCounter::kOptimizer,
                                       "adam", u);
  for (int k : owned_of_unit[uu]) {
    const OwnedParam& o = owned[static_cast<std::size_t>(k)];
    OptimizerBuffers b;
    b.master = reinterpret_cast<float*>(host_at(host_master, o.grad_offset));
    b.grad = host_at(host_grads, o.grad_offset);
    b.grad_dtype = DType::kF32;
    b.exp_avg = host_at(host_m, o.grad_offset);
    b.exp_avg_sq = host_at(host_v, o.grad_offset);
    b.moment_dtype = DType::kF32;
    b.param_out = half ? out_unit + o.param_in_unit : nullptr;
    b.out_dtype = wdtype;
    b.n = o.n;
    STRATA_RETURN_IF_ERROR(host_opt->update(hyper_of(config.optimizer, lr, o.decay), step, scale, b));
    if (!half) std::memcpy(out_unit + o.param_in_unit, b.master, o.n * 4);
  }
  span.reset();
  host_opt_step[uu] = done_step;
  return publish_params(u, out_unit);
}

std::vector<OffloadEngine::Impl::NvmeItem> OffloadEngine::Impl::nvme_items(const std::vector<int>& order) const {
  std::vector<NvmeItem> items;
  for (int u : order) {
    const std::size_t groups = placement.units[static_cast<std::size_t>(u)].sub_groups.size() - 1;
    for (std::size_t c = 0; c < groups; ++c) items.push_back({u, c});
    // Sharded, every rank takes part in every unit's parameter all-gather, even with nothing to
    // update; agreeing per unit, in every unit's agreement.
    if (groups == 0 && ((placement.sharding.host_state_sharded && placement.units[static_cast<std::size_t>(u)].param_bytes > 0) || agree_per_unit()))
      items.push_back({u, kNoNvmeGroup});
  }
  return items;
}

std::vector<int> OffloadEngine::Impl::nvme_update_order(std::int64_t step) const {
  std::vector<int> order;
  for (int i = 0; i < M; ++i) {
    const int u = delayed ? M - 1 - i : i;
    // Partial offload: the device units are the device's.
    if (!placement.split_device(u) && placement.units[static_cast<std::size_t>(u)].in_stage && !unit_holds(u, step)) order.push_back(u);
  }
  return order;
}

void OffloadEngine::Impl::issue_early_reads(std::int64_t step) {
  if (settings.optimizer != Tier::kNvme || !early_reads.empty() || early_reads_step == step) return;
  // With several processes too (data, tensor, pipeline parallel, any ZeRO stage): nothing here
  // talks. The reads are of this rank's own keys, which only this thread writes; the update's
  // collectives (the all-gathers, the per-unit and per-stage agreements) are issued as before, the
  // update only finding some of its reads done (docs/offload.md "Optimizer-state reads during
  // backward").
  early_reads_step = step;
  const std::vector<NvmeItem> items = nvme_items(nvme_update_order(step));
  const std::size_t R = ring.size();
  for (std::size_t k = 0; k < items.size() && k + 1 < R; ++k) {
    EarlyRead e{items[k], IoHandle(), 0};
    if (items[k].group != kNoNvmeGroup) {
      const auto& b = placement.units[static_cast<std::size_t>(items[k].unit)].sub_groups;
      const std::uint64_t len = b[items[k].group + 1] - b[items[k].group];
      e.issued_at = tracer.now_ns();
      e.handle = swap->read(TensorKey{unit_key("optim", items[k].unit), static_cast<std::uint32_t>(items[k].group)},
                            ring[k % R].data(), 12 * len);
      early_reads_issued.fetch_add(1, std::memory_order_relaxed);
    }
    early_reads.push_back(std::move(e));
  }
}

void OffloadEngine::Impl::drop_early_reads() {
  // A read not taken over by an update still writes its ring buffer: it must end first.
  // Those the update took over were moved out of the list (their handles are no longer valid).
  for (EarlyRead& e : early_reads) {
    if (!e.handle.valid()) continue;
    (void)e.handle.wait();
    early_reads_dropped.fetch_add(1, std::memory_order_relaxed);
  }
  early_reads.clear();
}

// Streams the optimizer state of each unit in `order` through the pinned ring, one sub-group
// ([master | m | v] of up to sub_group_size elements, swap key "optim.<u>" shard c) per buffer:
// reads run ahead of the update by up to ring.size() - 1 sub-groups and each is written back as
// soon as it is updated. A unit's updated working parameters gather in one of two staging
// buffers and go to their home after its last sub-group. Writes retire in issue order; a unit
// counts as updated (its parameters may be fetched) once all of its writes have retired, since a
// read before that would return the previous version.
Status OffloadEngine::Impl::update_units_nvme(const std::vector<int>& order, std::int64_t step, double lr,
                                              float scale, std::int64_t done_step) {
  using Item = NvmeItem;
  constexpr std::size_t kNoGroup = kNoNvmeGroup;
  const std::vector<Item> items = nvme_items(order);
  const std::size_t R = ring.size();
  std::vector<IoHandle> reads(items.size()), grad_reads(items.size());
  std::vector<std::int64_t> read_issued_at(items.size(), 0);
  // The reads issued during backward (issue_early_reads) for the items this update streams
  // first, each into the buffer its own read would use; the others are waited out before their
  // buffers are reused (a retry, a unit that already holds the step: a different list).
  std::size_t early_taken = 0;
  while (early_taken < early_reads.size() && early_taken < items.size() && early_taken + 1 < R &&
         early_reads[early_taken].item.unit == items[early_taken].unit &&
         early_reads[early_taken].item.group == items[early_taken].group) {
    reads[early_taken] = std::move(early_reads[early_taken].handle);
    read_issued_at[early_taken] = early_reads[early_taken].issued_at;
    ++early_taken;
  }
  drop_early_reads();
  struct Pending {
    std::uint64_t seq;
    IoHandle handle;  // invalid: nothing to wait for (parameters published synchronously)
    int unit_done;    // >= 0: the unit's last write
    int trace_track;  // where its span goes (-1: none)
    int unit;
    std::int64_t group;  // >= 0: the write of this sub-group of `unit` (group_step once it retired)
    std::uint64_t bytes;
    std::int64_t issued_at;
  };
  std::deque<Pending> writes;
  std::uint64_t seq = 0;
  std::vector<std::uint64_t> ring_seq(R, 0);
  std::uint64_t out_seq[2] = {0, 0};
  // Once a write failed no later unit counts as updated (writes retire in issue order, so a
  // unit's own sub-group writes retire before its last entry): a retry finishes the rest, and
  // group_step says which of their sub-groups are on disk already.
  bool write_failed = false;
  // Several ranks (agree_per_unit): a unit counts as updated only once every rank's update of it
  // succeeded. A rank's failure inside a unit (a read, the optimizer, a write retiring) is kept
  // in unit_status and the rank goes on through the unit's collectives (the parameters'
  // all-gather) without computing or writing more; at the unit's end its writes are retired and
  // the ranks agree (agree_unit). Every rank thus stops at the same unit and none waits in a
  // collective its peer skipped. The writes of a unit retire before the next unit's update starts
  // (its reads are already in flight), so that the verdict covers them.
  const bool agree = agree_per_unit();
  Status unit_status;
  auto note = [&](Status s) {
    if (!s.ok() && unit_status.ok()) unit_status = std::move(s);
  };
  auto retire_through = [&](std::uint64_t through) -> Status {
    Status first;
    while (!writes.empty() && writes.front().seq <= through) {
      Pending p = std::move(writes.front());
      writes.pop_front();
      Status s = p.handle.valid() ? p.handle.wait() : ok_status();
      if (!s.ok() && first.ok()) first = s;
      if (!s.ok()) write_failed = true;
      if (s.ok() && p.trace_track >= 0) {
        tracer.add_span(p.trace_track, TraceCounter::kNvmeWrite, "write", p.unit, p.bytes, p.issued_at);
      }
      if (s.ok() && p.group >= 0) {
        group_step[static_cast<std::size_t>(p.unit)][static_cast<std::size_t>(p.group)] = done_step;
      }
      if (!agree && !write_failed && p.unit_done >= 0) unit_done(p.unit_done, done_step);
    }
    return first;
  };
  auto push_write = [&](IoHandle h, int unit_done, int trace_track, int unit, std::uint64_t bytes,
                        std::int64_t issued_at, std::int64_t group = -1) {
    writes.push_back(Pending{++seq, std::move(h), unit_done, trace_track, unit, group, bytes, issued_at});
    return seq;
  };
  auto bounds = [&](const Item& it) {
    const auto& b = placement.units[static_cast<std::size_t>(it.unit)].sub_groups;
    return std::pair<std::uint64_t, std::uint64_t>{b[it.group], b[it.group + 1]};
  };
  // Returns the error of the write it retired first (agree: the read is issued all the same, the
  // ring buffer being free once that write ended either way).
  auto issue = [&](std::size_t i) -> Status {
    if (items[i].group == kNoGroup) return ok_status();
    const std::size_t r = i % R;
    // The ring buffer's previous sub-group must be fully written back before it is overwritten.
    Status retired = retire_through(ring_seq[r]);
    if (!retired.ok() && !agree) return retired;
    const auto [b0, b1] = bounds(items[i]);
    const TensorKey key{unit_key("optim", items[i].unit), static_cast<std::uint32_t>(items[i].group)};
    if (i >= early_taken) {  // else read during backward already
      read_issued_at[i] = tracer.now_ns();
      reads[i] = swap->read(key, ring[r].data(), 12 * (b1 - b0));
    }
    if (grads_on_nvme) {
      grad_reads[i] = swap->read(TensorKey{unit_key("grad", items[i].unit), key.shard}, ring[r].bytes() + 12 * (b1 - b0),
                                 4 * (b1 - b0));
    }
    return retired;
  };
  const std::uint64_t wsize = half ? 2 : 4;
  Status first_error;
  std::size_t issued = 0, units_started = 0;
  char* out_unit = nullptr;
  // After a unit's last sub-group. Sharded, this rank's slice of the updated parameters is in
  // ag_send: all-gathered into out_unit unless each rank keeps its slice (stage 3). A collective:
  // every rank runs it for every unit it reaches.
  auto gather_unit = [&](int u) -> Status {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (!placement.sharding.host_state_sharded || placement.units[uu].gathered_at_fetch || placement.units[uu].param_bytes == 0) return ok_status();
    const std::uint64_t c = placement.units[uu].slice.chunk;
    STRATA_RETURN_IF_ERROR(dp_wait(dp_tracks[2],
                                   dp_params->all_gather(ag_send.data(), ag_recv.data(), c, half ? DType::kBF16 : DType::kF32),
                                   "gather parameters", u, static_cast<std::uint64_t>(dp_size) * c * wsize));
    from_elements(u, ag_recv.bytes(), out_unit);
    return ok_status();
  };
  // Then its updated parameters (or, stage 3, this rank's slice) to their home.
  auto publish_unit = [&](int u) -> Status {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (placement.sharding.host_state_sharded && placement.units[uu].gathered_at_fetch) {
      STRATA_RETURN_IF_ERROR(write_param_slice(u, ag_send.bytes(), delayed));
      push_write(IoHandle(), u, -1, u, 0, 0);
      return ok_status();
    }
    if (placement.units[uu].home == Tier::kNvme) {
      const std::int64_t t0 = tracer.now_ns();
      out_seq[(units_started - 1) % 2] = push_write(swap->write(param_key(u, delayed), out_unit, placement.units[uu].param_bytes),
                                                    u, track.nvme_publish, u, placement.units[uu].param_bytes, t0);
      if (delayed) next_fresh[uu] = 1;  // counts once the write retired (the unit is marked updated then)
      return ok_status();
    }
    STRATA_RETURN_IF_ERROR(publish_params(u, out_unit));  // copied out at once: the staging buffer is free again
    push_write(IoHandle(), u, -1, u, 0, 0);
    return ok_status();
  };
  auto finish_unit = [&](int u) -> Status {
    if (!agree) {
      STRATA_RETURN_IF_ERROR(gather_unit(u));
      return publish_unit(u);
    }
    // A rank that failed in the unit still takes part in the all-gather; a peer that did not
    // publishes parameters holding its stale slice, which the agreed retry publishes again
    // before anything reads them (the unit is not marked updated). A failed all-gather is the
    // communicator's: reported as it is, not agreed on.
    STRATA_RETURN_IF_ERROR(gather_unit(u));
    if (unit_status.ok() && placement.units[static_cast<std::size_t>(u)].param_bytes > 0) note(publish_unit(u));
    note(retire_through(UINT64_MAX));
    Status own = std::exchange(unit_status, ok_status());
    STRATA_RETURN_IF_ERROR(agree_unit(u, done_step, std::move(own)));
    unit_done(u, done_step);
    return ok_status();
  };
  // The next forward reaches the first units of this order first, and its fetch of each waits
  // for the unit's mark, which the lazy retiring above would give only when a ring buffer or the
  // staging buffer is next reused (after a later unit's read and Adam). For the first `urgent`
  // units the writes are retired, and the unit marked, as soon as they are issued; later units
  // keep the overlap of one unit's writes with the next one's Adam. (Agreeing ranks retire every
  // unit's writes at its end already.)
  const int urgent = std::max(1, settings.prefetch_modules) + 1;
  // Their writes also go out with no later unit's read beside them: the reads ahead stop at the
  // last urgent unit's items until the current item is past it (the first R − 1 items' reads
  // were issued during backward anyway). `rank_of[i]`: the position of item i's unit in `order`.
  std::vector<int> rank_of(items.size(), 0);
  for (std::size_t i = 1; i < items.size(); ++i) {
    rank_of[i] = rank_of[i - 1] + (items[i].unit != items[i - 1].unit ? 1 : 0);
  }
  auto may_read_ahead = [&](std::size_t next, std::size_t current) {
    return agree || next <= current || rank_of[next] < urgent || rank_of[current] >= urgent;
  };
  auto end_unit = [&](int u) -> Status {
    STRATA_RETURN_IF_ERROR(finish_unit(u));
    if (agree || units_started > static_cast<std::size_t>(urgent)) return ok_status();
    return retire_through(seq);
  };
  // A sub-group whose new version is on disk already (a retry): only the working parameters are
  // taken from its master (read back), into out_unit or, sharded, this rank's slice in ag_send.
  auto rebuild_from_master = [&](int u, const float* master, std::uint64_t b0, std::uint64_t len) -> Status {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (!placement.sharding.host_state_sharded) return working_from_master(u, master, b0, len, out_unit);
    for (int k : owned_of_unit[uu]) {
      const OwnedParam& o = owned[static_cast<std::size_t>(k)];
      const std::uint64_t a = o.grad_in_unit / 4;
      const std::uint64_t lo = std::max<std::uint64_t>(a, b0), hi = std::min<std::uint64_t>(a + o.n, b0 + len);
      if (lo >= hi) continue;
      char* out = ag_send.bytes() + (lo - placement.units[uu].slice.begin) * wsize;
      if (half) {
        STRATA_RETURN_IF_ERROR(convert(master + (lo - b0), DType::kF32, out, wdtype, hi - lo));
      } else {
        std::memcpy(out, master + (lo - b0), (hi - lo) * 4);
      }
    }
    return ok_status();
  };
  for (std::size_t i = 0; i < items.size() && first_error.ok(); ++i) {
    if (i == 0 || items[i].unit != items[i - 1].unit) {
      first_error = hold_update(items[i].unit, done_step);
      if (!first_error.ok()) break;
    }
    while (issued < items.size() && issued < i + R - 1 && may_read_ahead(issued, i)) {
      Status s = issue(issued++);
      if (agree) {
        note(std::move(s));
      } else if (!s.ok()) {
        first_error = std::move(s);
        break;
      }
    }
    if (!first_error.ok()) break;
    const std::size_t r = i % R;
    const int u = items[i].unit;
    const std::size_t uu = static_cast<std::size_t>(u);
    if (items[i].group == kNoGroup) {
      ++units_started;
      first_error = retire_through(out_seq[(units_started - 1) % 2]);
      out_unit = param_out[(units_started - 1) % 2].bytes();
      if (agree) {
        note(std::move(first_error));
        first_error = ok_status();
      }
      if (first_error.ok()) first_error = end_unit(u);
      continue;
    }
    const auto [b0, b1] = bounds(items[i]);
    const std::uint64_t len = b1 - b0;
    const bool first_group = items[i].group == 0;
    const bool last_group = items[i].group + 2 == placement.units[uu].sub_groups.size();
    Status s = reads[i].wait();
    if (grads_on_nvme) {
      // Waited also when the state's read failed: the ring buffer is reused by a later read.
      Status g = grad_reads[i].wait();
      if (s.ok()) s = std::move(g);
    }
    if (s.ok()) {
      tracer.add_span(track.nvme_ring + static_cast<int>(r), TraceCounter::kNvmeRead, "read", u,
                      (grads_on_nvme ? 16 : 12) * len, read_issued_at[i]);
    }
    if (!s.ok()) {
      s = s.with_context("NVMe optimizer state of module '" + layout().modules[uu].name + "' (sub-group " +
                         std::to_string(items[i].group) + ")");
      if (!agree) {
        first_error = std::move(s);
        break;
      }
      note(std::move(s));
    }
    if (first_group) {
      ++units_started;
      // The staging buffer's previous unit must be written to its home first.
      Status retired = retire_through(out_seq[(units_started - 1) % 2]);
      if (!agree && !retired.ok()) {
        first_error = std::move(retired);
        break;
      }
      note(std::move(retired));
      out_unit = param_out[(units_started - 1) % 2].bytes();
    }
    if (agree && !unit_status.ok()) {
      // Failed in this unit: nothing more is computed or written; its end still agrees.
      if (last_group) first_error = finish_unit(u);
      continue;
    }
    float* master = ring[r].floats();
    if (group_step[uu][items[i].group] >= done_step) {
      // A retry: this sub-group's new version is on disk (read back above); only the unit's
      // working parameters are needed from it.
      Status rebuilt = rebuild_from_master(u, master, b0, len);
      if (!agree && !rebuilt.ok()) {
        first_error = std::move(rebuilt);
        break;
      }
      note(std::move(rebuilt));
      if (last_group) first_error = end_unit(u);
      continue;
    }
    std::optional<detail::HostSpan> span(std::in_place, tracer, track.optimizer, TraceCounter::kOptimizer, "adam", u);
    Status updated;
    for (int k : owned_of_unit[uu]) {
      const OwnedParam& o = owned[static_cast<std::size_t>(k)];
      const std::uint64_t a = o.grad_in_unit / 4;
      const std::uint64_t lo = std::max<std::uint64_t>(a, b0), hi = std::min<std::uint64_t>(a + o.n, b1);
      if (lo >= hi) continue;
      OptimizerBuffers b;
      b.master = master + (lo - b0);
      b.grad = grads_on_nvme ? ring[r].bytes() + 12 * len + (lo - b0) * 4
               : placement.sharding.host_state_sharded     ? shard_grads.bytes() + 4 * (placement.units[uu].slice_offset + lo - placement.units[uu].slice.begin)
                             : host_at(host_grads, grad_begin(u)) + lo * 4;
      b.grad_dtype = DType::kF32;
      b.exp_avg = master + len + (lo - b0);
      b.exp_avg_sq = master + 2 * len + (lo - b0);
      b.moment_dtype = DType::kF32;
      char* out = placement.sharding.host_state_sharded ? ag_send.bytes() + (lo - placement.units[uu].slice.begin) * wsize : out_unit + o.param_in_unit + (lo - a) * wsize;
      b.param_out = half ? out : nullptr;
      b.out_dtype = wdtype;
      b.n = hi - lo;
      updated = host_opt->update(hyper_of(config.optimizer, lr, o.decay), step, scale, b);
      if (!updated.ok()) break;
      if (!half) std::memcpy(out, b.master, b.n * 4);  // fp32: the working copy is the master
    }
    span.reset();
    if (!updated.ok()) {
      if (!agree) {
        first_error = std::move(updated);
        break;
      }
      note(std::move(updated));
      if (last_group) first_error = finish_unit(u);
      continue;
    }
    ring_seq[r] =
        push_write(swap->write(TensorKey{unit_key("optim", u), static_cast<std::uint32_t>(items[i].group)},
                               master, 12 * len),
                   -1, track.nvme_ring + static_cast<int>(r), u, 12 * len, tracer.now_ns(),
                   static_cast<std::int64_t>(items[i].group));
    if (!last_group) continue;
    first_error = end_unit(u);
  }
  Status s = retire_through(UINT64_MAX);
  if (first_error.ok()) first_error = s;
  for (IoHandle& h : reads) {
    if (h.valid()) (void)h.wait();
  }
  for (IoHandle& h : grad_reads) {
    if (h.valid()) (void)h.wait();
  }
  return first_error;
}

void OffloadEngine::Impl::worker_main() {
  name_current_thread("host.optimizer");
  if (Status s = device->cpu_budget().pin_host(); !s.ok()) {
    STRATA_LOG(kWarn, kOffload) << "host optimizer: " << s.message();
  }
  worker_cpu.join(/*since_start=*/true);
  std::vector<GradStats> stats(static_cast<std::size_t>(M));
  // The order of a step's update. Forward order lets the next forward wait only for the unit it
  // reaches. The delayed update is not waited for by the next forward but by the next backward's
  // gradients of each unit (they reuse its gradient buffers), which come in backward order.
  std::vector<int> update_order(static_cast<std::size_t>(M));
  for (int u = 0; u < M; ++u) update_order[static_cast<std::size_t>(u)] = delayed ? M - 1 - u : u;
  // Not when sharded: a rank's slice alone cannot tell every rank whether to skip the update.
  // Not with fp16: an overflow anywhere skips the whole step, so no unit may update before the
  // norm is known (as with clipping).
  // Not with the delayed update: the step's update runs while the next step computes.
  const bool immediate_ok = update_immediately();
  // A retry needs no other process to agree on it (FailedUpdate) ...
  const bool can_retry = dp_size == 1 && tp_size == 1 && pp_size == 1;
  // ... or, several processes, the ranks agreeing on each unit before it counts as updated
  // (agree_unit; the NVMe optimizer agrees inside update_units_nvme, after the unit's writes
  // retired) and the pipeline stages on each step (agree_stages): then a failed update stops at
  // the same unit on every rank, and every rank retries the same units (docs/offload.md "Faults").
  const bool agreed_retry = agree_per_unit() || defer_marks();
  // Several processes, a failure before the norm: every rank failed the step alike (a non-finite
  // norm merged over every group, or a flag gathered with the statistics, agree_before_norm).
  const bool agree_before = agree_before_norm();
  // agree_before: this rank's failure of the step in flight before its norm (a landed unit's
  // copy or scan), held until the step's kFinish or kAbort agrees on it with the other ranks.
  Status own_before;
  // `agreed`: every rank fails this step before its norm (FailPhase::kBeforeUpdate).
  auto fail = [&](Status s, FailPhase phase, const Command& c, bool agreed = false) {
    std::lock_guard<std::mutex> lock(mu);
    if (worker_error.ok()) {
      worker_error = std::move(s);
      ++update_failures;
      const bool retryable = can_retry || (agreed_retry && phase == FailPhase::kAfterNorm) ||
                             (agreed && phase == FailPhase::kBeforeUpdate);
      failed = FailedUpdate{retryable ? phase : FailPhase::kNone, c, false};
    }
    cv.notify_all();
  };
  // A failure before the step's first unit update leaves nothing to finish.
  auto phase_of = [&](const Command& c, FailPhase started) {
    return applied_step >= c.step ? started : FailPhase::kBeforeUpdate;
  };
  // Unit c.unit's landed gradients scanned into stats; with immediate_ok it is updated too.
  auto on_landed = [&](const Command& c) -> Status {
    const std::size_t uu = static_cast<std::size_t>(c.unit);
    if (grads_on_nvme) {
      stats[uu] = landed_stats[uu];  // scanned on the gstream thread, before the landed event
    } else {
      detail::HostSpan span(tracer, track.optimizer, TraceCounter::kOptimizer, "scan gradients", c.unit);
      const auto [grads, n] = unit_grads(c.unit);
      const std::uint64_t first = placement.sharding.host_state_sharded ? placement.units[uu].slice.begin : 0;
      STRATA_ASSIGN_OR_RETURN(
          stats[uu], scan_norm(*host_opt, c.unit, grads, first, n, static_cast<float>(1.0 / c.loss_scale)));
    }
    if (!immediate_ok) return ok_status();
    if (!stats[uu].finite()) {
      return invalid_argument(
          "step " + std::to_string(c.step) + ": the gradients of module '" + layout().modules[uu].name +
          "' are not finite; modules updated before it in this step keep their update. Lower "
          "the learning rate or enable clipping");
    }
    applied_step = c.step;
    STRATA_RETURN_IF_ERROR(update_unit_host(c.unit, c.opt_step, c.lr, 1.0f, c.step));
    mark_updated(c.unit, c.step);
    return ok_status();
  };
  // The step's update of every unit that does not hold it yet, `scale` = clip / loss scale.
  auto update_stage = [&](const Command& c, float scale) -> Status {
    applied_step = c.step;
    for (int u = 0; u < M; ++u)
      if (!placement.units[static_cast<std::size_t>(u)].in_stage) mark_updated(u, c.step);  // another stage's
    if (settings.optimizer == Tier::kNvme) {
      return update_units_nvme(nvme_update_order(c.step), c.opt_step, c.lr, scale, c.step);
    }
    for (int u : update_order) {
      if (placement.split_device(u)) continue;  // partial offload: on the device
      if (!placement.units[static_cast<std::size_t>(u)].in_stage) continue;
      if (unit_holds(u, c.step)) continue;  // a retry: done before the failure
      if (agree_per_unit()) {
        STRATA_RETURN_IF_ERROR(agree_unit(u, c.step, update_unit_host(u, c.opt_step, c.lr, scale, c.step)));
      } else {
        STRATA_RETURN_IF_ERROR(update_unit_host(u, c.opt_step, c.lr, scale, c.step));
      }
      unit_done(u, c.step);
    }
    return ok_status();
  };
  // Pipeline: this stage's units count as updated once every stage's update succeeded. A retry
  // on a stage that finished (stage_done) only agrees again.
  auto apply_update = [&](const Command& c, float scale) -> Status {
    Status s = update_stage(c, scale);
    if (!defer_marks()) return s;
    STRATA_RETURN_IF_ERROR(agree_stages(c.step, std::move(s)));
    for (int u = 0; u < M; ++u) {
      if (placement.units[static_cast<std::size_t>(u)].in_stage && !placement.split_device(u)) mark_updated(u, c.step);
    }
    return ok_status();
  };
  // Every unit has landed: the norm, then (unless immediate_ok did it) the update.
  // `own` (agree_before): this rank's failure of the step before its norm; it travels as a flag
  // with the statistics, so every rank learns of it in the same collectives.
  auto on_finish = [&](const Command& c, Status own) {
    GradStats total;
    float verdict = own.ok() ? 0.0f : grid_place();
    float* flag = agree_before ? &verdict : nullptr;
    // A gather of the statistics failed (a peer never joined: it waits in a collective of the
    // pass this rank skipped, docs/offload.md "Faults", "Not agreed"). This rank's own failure is
    // still the cause it reports, with what became of the agreement; not retryable.
    auto unagreed = [&](Status gathered) {
      if (own.ok()) return gathered;
      return own.with_context(
          "step " + std::to_string(c.step) +
          ": this rank's failure before the norm could not be agreed with the other ranks (" +
          gathered.to_string() + ")");
    };
    // Partial offload: the device units' statistics are their scans on the compute stream (with
    // data parallelism: of this rank's slices), which the caller synchronised before it pushed
    // this command; every merge below takes them where the host units' are.
    for (int u : placement.stage.device_units) stats[static_cast<std::size_t>(u)] = dev_stats[static_cast<std::size_t>(u)];
    if (placement.sharding.host_state_sharded) {
      // Every rank's per-unit statistics and its failure flag (one more record), merged unit by
      // unit in rank order.
      static_assert(sizeof(GradStats) % 4 == 0);
      const std::size_t per = static_cast<std::size_t>(M) + 1;
      std::vector<GradStats>& mine = flagged_stats;
      std::copy(stats.begin(), stats.end(), mine.begin());
      mine[per - 1] = GradStats{verdict, 0};
      std::vector<GradStats>& all = flagged_gathered;
      Status s = dp_wait(dp_tracks[2], dp_params->all_gather(mine.data(), all.data(), per * sizeof(GradStats) / 4,
                                                             DType::kF32),
                         "gather gradient statistics", -1, all.size() * sizeof(GradStats));
      if (!s.ok()) return fail(unagreed(s), phase_of(c, FailPhase::kNone), c);
      for (int r = 0; r < dp_size; ++r) {
        const GradStats& theirs = all[static_cast<std::size_t>(r) * per + per - 1];
        verdict = std::max(verdict, static_cast<float>(theirs.sum_of_squares));
      }
      auto at = [&](int r, int u) -> const GradStats& {
        return all[static_cast<std::size_t>(r) * per + static_cast<std::size_t>(u)];
      };
      if (pp_size > 1) {
        // Each unit's statistics over the data-parallel ranks, then over the pipeline stages.
        std::vector<GradStats> per_unit(static_cast<std::size_t>(M));
        for (int u = 0; u < M; ++u) {
          for (int r = 0; r < dp_size; ++r) per_unit[static_cast<std::size_t>(u)].merge(at(r, u));
        }
        auto merged = merge_stage_stats(per_unit, flag);
        if (!merged.ok()) return fail(unagreed(merged.status()), phase_of(c, FailPhase::kNone), c);
        total = *merged;
      } else {
        for (int u = 0; u < M; ++u) {
          for (int r = 0; r < dp_size; ++r) total.merge(at(r, u));
        }
      }
    } else if (pp_size > 1) {
      auto merged = merge_stage_stats(stats, flag);
      if (!merged.ok()) return fail(unagreed(merged.status()), phase_of(c, FailPhase::kNone), c);
      total = *merged;
    } else {
      for (int u = 0; u < M; ++u) total.merge(stats[static_cast<std::size_t>(u)]);
    }
    if (tp_size > 1) {
      auto merged = merge_over_tp(total, *tp_norm, flag);
      if (!merged.ok()) return fail(unagreed(merged.status()), phase_of(c, FailPhase::kNone), c);
      total = *merged;
    }
    if (verdict != 0.0f && immediate_ok) {
      // Units are updated as they land: by now some ranks may hold this step's update of some
      // units (whichever landed before the failure, or on a peer that did not fail), and the
      // gradients of the others are lost with the failed pass. Every rank learnt it in the same
      // collectives; none may run the step again: sticky (FailPhase::kNone) on every rank,
      // until a checkpoint is loaded.
      const std::string what = "step " + std::to_string(c.step) +
                               ": with update_during_backward the modules whose gradients landed before the "
                               "failure already hold this step's update on some ranks, so the step cannot "
                               "run again; load the last checkpoint (with gradient clipping, or "
                               "update_during_backward off, such a step can be run again)";
      if (!own.ok()) return fail(own.with_context(what), FailPhase::kNone, c);
      return fail(unavailable("step " + std::to_string(c.step) + ": the step failed before its norm on " +
                              name_grid_place(verdict) + " (its error names the cause); " +
                              what.substr(what.find("with "))),
                  FailPhase::kNone, c);
    }
    if (verdict != 0.0f) {
      // Some rank failed the step before its norm; every rank saw the same flags, in the same
      // collectives, and none publishes the norm: every rank's step() reports it (the failing
      // rank its own error) with nothing updated, and every rank runs the step again.
      if (!own.ok()) return fail(std::move(own), FailPhase::kBeforeUpdate, c, true);
      return fail(unavailable("step " + std::to_string(c.step) + ": the step failed before its update on " +
                              name_grid_place(verdict) +
                              " (its error names the cause); nothing was updated on any rank: call step() "
                              "again with the same batch"),
                  FailPhase::kBeforeUpdate, c, true);
    }
    const double norm = total.norm();
    if (!total.finite() && !fp16 && !immediate_ok) {
      // Nothing of the step was applied and the norm is not published: the step's own call
      // reports it with the state untouched (its step count, too), and calling again runs the
      // step again (FailPhase::kBeforeUpdate), e.g. once the input or the learning rate changed.
      // Every rank merged the same statistics (over every group), so with several processes all
      // fail alike and all run the step again: agreed without a flag.
      return fail(invalid_argument("step " + std::to_string(c.step) + ": the gradient norm is not finite (" +
                                   std::to_string(norm) +
                                   "); nothing was updated. Lower the learning rate or enable clipping"),
                  FailPhase::kBeforeUpdate, c, true);
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      norm_value = norm;
      norm_step = c.step;
    }
    cv.notify_all();
    // The device units' update is the caller's, in compute order before the next forward.
    for (int u : placement.stage.device_units) mark_updated(u, c.step);
    if (immediate_ok) return;
    if (!total.finite() && fp16) {
      // Overflow: the step is skipped on every unit (and, data parallel, on every rank: they all
      // merged the same statistics). The caller moves the loss scaler.
      for (int u = 0; u < M; ++u) mark_updated(u, c.step);
      return;
    }
    Command retry = c;
    retry.scale = update_scale(norm, c.loss_scale);
    Status s = apply_update(c, retry.scale);
    if (!s.ok()) fail(s, FailPhase::kAfterNorm, retry);
  };
  for (;;) {
    Command c;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return !commands.empty(); });
      c = commands.front();
      commands.pop_front();
      if (!worker_error.ok() && c.kind != Command::kStop) {
        // After an error nothing more is applied; the step's caller reports it. Reads issued
        // early end before the optimizer thread may look idle (drain_worker), while mu still
        // keeps the caller out.
        drop_early_reads();
        early_reads_step = -1;
        if (commands.empty()) cv.notify_all();
        continue;
      }
      worker_busy = true;
    }
    struct Idle {  // however the command ends
      Impl* t;
      ~Idle() {
        {
          std::lock_guard<std::mutex> lock(t->mu);
          t->worker_busy = false;
        }
        t->cv.notify_all();
      }
    } idle{this};
    // Whatever a command other than kLanded did, no early read outlives it (issue_early_reads);
    // the next kLanded of the same step number (a step run again after it failed before its
    // update) issues them afresh.
    struct DropEarly {
      Impl* t;
      bool on;
      ~DropEarly() {
        if (!on) return;
        t->drop_early_reads();
        t->early_reads_step = -1;
      }
    } drop_early{this, c.kind != Command::kLanded};
    if (c.kind == Command::kStop) break;
    if (c.kind == Command::kAbort) {
      // The caller's step failed before its norm. Alone, the next step's landed units overwrite
      // the stats. Agreeing (agree_before): the other ranks wait in the statistics gathers, so
      // this rank joins them with its failure flag.
      if (!agree_before) continue;
      Status caller;
      {
        std::lock_guard<std::mutex> lock(mu);
        caller = std::exchange(abort_error, ok_status());
      }
      if (caller.ok()) caller = internal_error("step " + std::to_string(c.step) + " was abandoned");
      own_before = ok_status();
      on_finish(c, std::move(caller));
      continue;
    }
    if (c.kind == Command::kLanded) {
      if (agree_before && !own_before.ok()) continue;  // the step failed here already
      // The step's first landed unit: its update's first optimizer-state reads go out now,
      // overlapped with the rest of backward.
      issue_early_reads(c.step);
      Status s = landed[static_cast<std::size_t>(c.unit)]->synchronize();
      if (s.ok()) s = on_landed(c);
      if (!s.ok() && agree_before) {
        // Kept until the step's kFinish (or kAbort) agrees on it with the other ranks.
        own_before = std::move(s);
      } else if (!s.ok()) {
        // A failed copy: the host gradients cannot be trusted, nor can a retry that rescans them.
        fail(s, phase_of(c, FailPhase::kNone), c);
      }
      continue;
    }
    if (c.kind == Command::kRetry) {
      Status s = apply_update(c, c.scale);
      if (!s.ok()) fail(s, FailPhase::kAfterNorm, c);
      continue;
    }
    on_finish(c, std::exchange(own_before, ok_status()));  // kFinish: every unit has landed.
  }
}

Status OffloadEngine::Impl::check_worker() {
  std::lock_guard<std::mutex> lock(mu);
  return worker_error;
}

Status OffloadEngine::Impl::agree_unit(int u, std::int64_t step, Status own) {
  // The verdict: 0 when every rank succeeded, else 1 + a failing rank's place in the grid
  // (data-parallel rank + dp_size * tensor rank); the max over the data-parallel group, then over
  // the tensor group, is the same number on every rank. Which failing rank is named does not
  // matter, only that every rank sees the same verdict.
  const bool over_dp = placement.sharding.host_state_sharded && dp_params != nullptr;
  const int dps = over_dp ? dp_size : 1, dpr = over_dp ? dp_rank : 0;
  float verdict = own.ok() ? 0.0f : static_cast<float>(1 + dpr + dps * tp_rank);
  if (over_dp) {
    float worst = 0.0f;
    STRATA_RETURN_IF_ERROR(dp_wait(dp_tracks[2],
                                   dp_params->all_reduce(&verdict, &worst, 1, DType::kF32, ReduceOp::kMax),
                                   "agree on the update", u, 4));
    verdict = worst;
  }
  if (tp_size > 1) {
    float worst = 0.0f;
    Status s = tp_norm->all_reduce(&verdict, &worst, 1, DType::kF32, ReduceOp::kMax).wait();
    if (!s.ok()) {
      return s.with_context("tensor parallel: agree on the update of module '" +
                            layout().modules[static_cast<std::size_t>(u)].name + "'");
    }
    verdict = worst;
  }
  if (!own.ok()) return own;
  if (verdict == 0.0f) return ok_status();
  const int r = static_cast<int>(verdict) - 1;
  const std::string where = tp_size == 1 ? "data-parallel rank " + std::to_string(r % dps)
                            : dps == 1   ? "tensor-parallel rank " + std::to_string(r / dps)
                                         : "data-parallel rank " + std::to_string(r % dps) +
                                             " of tensor-parallel rank " + std::to_string(r / dps);
  return unavailable("step " + std::to_string(step) + ": the update of module '" +
                     layout().modules[static_cast<std::size_t>(u)].name + "' failed on " + where +
                     " (its error names the cause); every rank retries it in place at the call after the next");
}

Status OffloadEngine::Impl::agree_stages(std::int64_t step, Status own) {
  const float mine = own.ok() ? 0.0f : static_cast<float>(pp_rank + 1);
  float worst = 0.0f;
  Status s = pp_norm->all_reduce(&mine, &worst, 1, DType::kF32, ReduceOp::kMax).wait();
  if (!s.ok()) return s.with_context("pipeline: agree on the update of step " + std::to_string(step));
  if (!own.ok()) return own;
  if (worst == 0.0f) return ok_status();
  return unavailable("step " + std::to_string(step) + ": the update failed on pipeline stage " +
                     std::to_string(static_cast<int>(worst) - 1) +
                     " (its error names the cause); every stage retries it in place at the call after the next");
}

float OffloadEngine::Impl::grid_place() const {
  const bool over_dp = placement.sharding.host_state_sharded && dp_params != nullptr;
  const int dps = over_dp ? dp_size : 1, dpr = over_dp ? dp_rank : 0;
  return static_cast<float>(1 + dpr + dps * (tp_rank + tp_size * pp_rank));
}

std::string OffloadEngine::Impl::name_grid_place(float place) const {
  const bool over_dp = placement.sharding.host_state_sharded && dp_params != nullptr;
  const int dps = over_dp ? dp_size : 1;
  const int r = static_cast<int>(place) - 1;
  std::string out;
  auto add = [&](const std::string& part) { out += (out.empty() ? "" : ", ") + part; };
  if (dps > 1) add("data-parallel rank " + std::to_string(r % dps));
  if (tp_size > 1) add("tensor-parallel rank " + std::to_string(r / dps % tp_size));
  if (pp_size > 1) add("pipeline stage " + std::to_string(r / dps / tp_size));
  return out;
}

Status OffloadEngine::Impl::recover() {
  if (placement.sharding.optimizer_on_device) return ok_status();
  // Pipeline: the verdict on the update in flight is agreed by the stages' optimizer threads;
  // waiting for it makes every stage's call report (or not) alike, before this call sends or
  // receives anything (defer_marks).
  if (defer_marks()) drain_worker();
  FailedUpdate f;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (worker_error.ok()) return ok_status();
    if (failed.phase == FailPhase::kNone || !failed.reported) {
      // Several ranks agreeing per unit: this rank's optimizer thread may know the verdict before
      // a peer's caller does, so the call goes on and reports the error where it waits for the
      // first unit that does not hold the step (wait_update_of), as every rank's call does,
      // after the same collectives of the units before it.
      if (failed.phase == FailPhase::kAfterNorm && report_at_wait()) return ok_status();
      // Reported once as it is (an asynchronous failure surfaces at the next call); retried by
      // the call after that.
      failed.reported = true;
      return worker_error;
    }
    f = failed;
  }
  // The failed step's remaining commands are skipped before the error may be cleared.
  drain_worker();
  const std::string which = "step " + std::to_string(f.cmd.step);
  if (f.phase == FailPhase::kAfterNorm && steps < f.cmd.step) {
    // The step's own call failed after its norm (not a state the engine can finish).
    return check_worker().with_context(which +
                                       "'s update failed part-way and its call did not complete; load a "
                                       "checkpoint");
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    worker_error = ok_status();
    failed = FailedUpdate{};
    abort_error = ok_status();  // a kAbort the optimizer thread skipped after the failure
    if (f.phase == FailPhase::kAfterNorm) {
      Command c = f.cmd;
      c.kind = Command::kRetry;
      commands.push_back(c);
    }
  }
  cv.notify_all();
  if (f.phase == FailPhase::kBeforeUpdate) return ok_status();  // nothing was applied: the step runs again
  STRATA_LOG(kInfo, kOffload) << "retrying the host update of " << which;
  drain_worker();
  std::lock_guard<std::mutex> lock(mu);
  if (worker_error.ok()) return ok_status();
  failed.reported = true;  // this call reports it; the next one retries again
  return worker_error.with_context("retrying the update of " + which);
}

Status OffloadEngine::Impl::wait_update_of(int u, std::int64_t step, bool report) {
  if (placement.sharding.optimizer_on_device) return ok_status();
  std::unique_lock<std::mutex> lock(mu);
  auto ready = [&] { return !worker_error.ok() || updated_step[static_cast<std::size_t>(u)] >= step; };
  if (!ready()) {
    detail::HostSpan span(tracer, track.caller, TraceCounter::kUpdateStall, "wait update", u);
    cv.wait(lock, ready);
  }
  if (!worker_error.ok() && failed.phase == FailPhase::kAfterNorm && report_at_wait()) {
    // The marks are agreed: a unit that holds the step is read alike on every rank; the first
    // that does not fails the call on every rank, which reports the error (recover retries).
    if (updated_step[static_cast<std::size_t>(u)] >= step) return ok_status();
    if (report) failed.reported = true;
  }
  return worker_error;
}

void OffloadEngine::Impl::drain_worker() {
  if (placement.sharding.optimizer_on_device) return;
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return commands.empty() && !worker_busy; });
}

void OffloadEngine::Impl::reset_pass_state() {
  for (ParamSlot& slot : pslots) {
    if (slot.unit >= 0) {
      slot_of[static_cast<std::size_t>(slot.unit)] = -1;
      bound_params[static_cast<std::size_t>(slot.unit)] = nullptr;
    }
    slot.unit = -1;
    slot.used = false;
    slot.early = false;
  }
  for (GradSlot& g : gslots) {
    if (g.unit >= 0) {
      gslot_of[static_cast<std::size_t>(g.unit)] = -1;
      bound_grads[static_cast<std::size_t>(g.unit)] = nullptr;
    }
    g.unit = -1;
  }
  trace.clear();
  record.clear();
  trace_ok = false;
  pos = 0;
  (void)take_grad_io_error();  // the failed pass's, reported by its call already
}

Status OffloadEngine::Impl::wait_all_updates(bool publish) {
  STRATA_RETURN_IF_ERROR(recover());
  for (int u = 0; u < M; ++u) STRATA_RETURN_IF_ERROR(wait_updated(u));
  if (publish) STRATA_RETURN_IF_ERROR(publish_delayed());
  if (!placement.sharding.optimizer_on_device) STRATA_RETURN_IF_ERROR(h2d->synchronize());
  return ok_status();
}

Status OffloadEngine::Impl::publish_delayed() {
  if (pending_publish == 0) return ok_status();
  // Every unit's update first: a failed one uploads nothing, so the device keeps P[t-1] whole
  // and a retried step computes as before.
  for (int u = 0; u < M; ++u) STRATA_RETURN_IF_ERROR(wait_update_of(u, pending_publish));
  for (int u = 0; u < M; ++u) {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (placement.units[uu].param_bytes == 0) continue;
    const std::uint64_t n = placement.units[uu].param_bytes;
    // Every stream is idle (step() synchronised them, a flush waited for them), so no fetch
    // reads the published version while it is replaced.
    if (placement.units[uu].home != Tier::kDevice) {
      if (!next_fresh[uu]) continue;  // a skipped step (fp16 overflow): the published version stands
      next_fresh[uu] = 0;
      if (placement.units[uu].home == Tier::kHost) {
        // Stage 3: this rank's slice only (write_param_slice).
        const std::uint64_t bytes = placement.units[uu].gathered_at_fetch ? placement.units[uu].slice.len * (half ? 2 : 4) : n;
        std::memcpy(host_params.bytes() + placement.units[uu].host_offset, delayed_next.bytes() + placement.units[uu].next_offset,
                    bytes);
      } else {
        param_shard[uu] = 1 - param_shard[uu];
      }
      continue;
    }
    STRATA_RETURN_IF_ERROR(tracer.stream_begin(*h2d, track.h2d));
    STRATA_RETURN_IF_ERROR(traced_copy(*h2d, track.copy_h2d, "copy", resident + placement.units[uu].resident_offset,
                                       host_params.bytes() + placement.units[uu].host_offset, n, CopyKind::kHostToDevice, u));
    STRATA_RETURN_IF_ERROR(tracer.stream_end(*h2d, track.h2d, TraceCounter::kNone, "upload (delayed)", u, n));
    STRATA_RETURN_IF_ERROR(h2d->record(*uploaded[uu]));
    uploaded_recorded[uu] = 1;
  }
  pending_publish = 0;
  publish_before_rerun = false;
  return ok_status();
}

Status OffloadEngine::Impl::await_upload(int u) {
  const std::size_t uu = static_cast<std::size_t>(u);
  if (!uploaded_recorded[uu]) return ok_status();
  detail::HostSpan span(tracer, track.optimizer, TraceCounter::kNone, "wait upload", u);
  return uploaded[uu]->synchronize();
}

// ---- the pass: prefetch, slots, buckets ------------------------------------------------------

void OffloadEngine::Impl::begin_pass() {
  record.clear();
  pos = 0;
  trace_ok = !trace.empty();
}

void OffloadEngine::Impl::note_access(int code) {
  if (trace_ok && (pos >= trace.size() || trace[pos] != code)) {
    trace_ok = false;  // the order changed: stay correct (fetch on demand) and re-record
    ++mismatches;
    STRATA_LOG(kDebug, kOffload) << "offload: module order differs from the recorded trace at access " << pos
                                 << "; re-tracing";
  }
  record.push_back(code);
  ++pos;
}

int OffloadEngine::Impl::predicted(std::size_t j) const {
  if (!trace_ok) return -1;
  if (j < trace.size()) return trace[j];
  if (cyclic && j - trace.size() < trace.size()) return trace[j - trace.size()];
  return -1;
}

Status OffloadEngine::Impl::release_slot(int s) {
  ParamSlot& slot = pslots[static_cast<std::size_t>(s)];
  if (slot.unit < 0) return ok_status();
  if (slot.used) STRATA_RETURN_IF_ERROR(compute->record(*slot.free));
  slot_of[static_cast<std::size_t>(slot.unit)] = -1;
  bound_params[static_cast<std::size_t>(slot.unit)] = nullptr;
  slot.unit = -1;
  slot.used = false;
  slot.early = false;
  return ok_status();
}

Status OffloadEngine::Impl::forget_fetched(int u) {
  if (slot_of.empty()) return ok_status();
  const int s = slot_of[static_cast<std::size_t>(u)];
  return s < 0 ? ok_status() : release_slot(s);
}

Result<int> OffloadEngine::Impl::fetch(int u, int current_module, std::int64_t gate_step) {
  int s = -1;
  for (std::size_t i = 0; i < pslots.size() && s < 0; ++i)
    if (pslots[i].unit < 0) s = static_cast<int>(i);
  if (s < 0) {
    // Evict a unit the running module does not read.
    const std::vector<int>& cur = current_module >= 0 ? placement.units[static_cast<std::size_t>(current_module)].reads
                                                      : std::vector<int>{};
    for (std::size_t i = 0; i < pslots.size() && s < 0; ++i) {
      if (std::find(cur.begin(), cur.end(), pslots[i].unit) == cur.end()) s = static_cast<int>(i);
    }
    if (s < 0) return internal_error("offload: no parameter slot free for module " + std::to_string(u));
    STRATA_RETURN_IF_ERROR(release_slot(s));
  }
  ParamSlot& slot = pslots[static_cast<std::size_t>(s)];
  const std::size_t uu = static_cast<std::size_t>(u);
  const std::uint64_t n = placement.units[uu].param_bytes;
  STRATA_RETURN_IF_ERROR(h2d->wait(*slot.free));
  STRATA_RETURN_IF_ERROR(tracer.stream_begin(*h2d, track.h2d));
  const bool early = gate_step >= 0;
  std::atomic<bool>* early_ok = slot.early_ok.get();
  // An early fetch waits, on the h2d stream, for the update it must see. It never fails the
  // stream: a failed update (the optimizer thread failed after the fetch was issued) or a
  // failed read leaves early_ok false, and the pass refetches the unit on demand, where a read
  // error fails the step as any fetch's does. The failure count, not only worker_error, ends the
  // wait: a retry may clear the error before this thread looks.
  std::uint64_t failures_at_issue = 0;
  if (early) {
    std::lock_guard<std::mutex> lock(mu);
    failures_at_issue = update_failures;
  }
  auto gate = [this, u, gate_step, failures_at_issue]() {
    std::unique_lock<std::mutex> lock(mu);
    auto done = [&] {
      return updated_step[static_cast<std::size_t>(u)] >= gate_step || !worker_error.ok() ||
             update_failures != failures_at_issue;
    };
    // No span of its own: the parameter-read lane holds reads only, and the caller's
    // "wait update" span shows the same wait.
    cv.wait(lock, done);
    return updated_step[static_cast<std::size_t>(u)] >= gate_step && worker_error.ok() &&
           update_failures == failures_at_issue;
  };
  // Stage 3: the unit is gathered from every rank's slice, whatever its home (host or NVMe); an
  // early one runs its gate inside the gather's host function (early_gather_unit_params).
  const bool gathered = placement.units[uu].gathered_at_fetch;
  if (early && !gathered && placement.units[uu].home != Tier::kNvme) {
    STRATA_RETURN_IF_ERROR(h2d->host_fn("offload: early fetch of param." + std::to_string(u) + " waits for its update",
                                        [gate, early_ok]() {
                                          early_ok->store(gate());
                                          return ok_status();
                                        }));
  }
  if (gathered) {
    char* staging = slot.staging.bytes();
    if (early) {
      STRATA_RETURN_IF_ERROR(h2d->host_fn(
          "offload: early data-parallel gather of param." + std::to_string(u) + " (waits for its update)",
          [this, u, staging, gate, early_ok]() { return early_gather_unit_params(u, gate(), staging, early_ok); }));
    } else {
      STRATA_RETURN_IF_ERROR(h2d->host_fn("offload: data-parallel gather of param." + std::to_string(u),
                                          [this, u, staging]() {
                                            return gather_unit_params(u, *dp_fetch, dp_tracks[3], fetch_send.bytes(),
                                                                      fetch_recv.bytes(), staging);
                                          }));
    }
    STRATA_RETURN_IF_ERROR(
        traced_copy(*h2d, track.copy_h2d, "copy", slot.dev, staging, n, CopyKind::kHostToDevice, u));
  } else if (placement.units[uu].home == Tier::kNvme) {
    SwapStore* store = swap.get();
    void* staging = slot.staging.data();
    const TensorKey key = param_key(u);
    detail::Tracer* tr = &tracer;
    const int lane = track.nvme_fetch;
    if (early) {
      STRATA_RETURN_IF_ERROR(h2d->host_fn(
          "offload: early NVMe read of " + key.name, [gate, early_ok, store, staging, key, n, tr, lane, u]() {
            if (!gate()) {
              early_ok->store(false);
              return ok_status();
            }
            detail::HostSpan span(*tr, lane, TraceCounter::kNvmeRead, "read", u, n);
            Status read = store->read(key, staging, n).wait();
            if (!read.ok()) {
              STRATA_LOG(kDebug, kOffload) << "offload: early fetch of " << key.name
                                           << " failed; refetched on demand: " << read.to_string();
            }
            early_ok->store(read.ok());
            return ok_status();
          }));
    } else {
      STRATA_RETURN_IF_ERROR(
          h2d->host_fn("offload: NVMe read of " + key.name, [store, staging, key, n, tr, lane, u]() {
            detail::HostSpan span(*tr, lane, TraceCounter::kNvmeRead, "read", u, n);
            return store->read(key, staging, n).wait();
          }));
    }
    STRATA_RETURN_IF_ERROR(
        traced_copy(*h2d, track.copy_h2d, "copy", slot.dev, staging, n, CopyKind::kHostToDevice, u));
  } else {
    STRATA_RETURN_IF_ERROR(traced_copy(*h2d, track.copy_h2d, "copy", slot.dev,
                                       host_params.bytes() + placement.units[uu].host_offset, n,
                                       CopyKind::kHostToDevice, u));
  }
  STRATA_RETURN_IF_ERROR(tracer.stream_end(*h2d, track.h2d, TraceCounter::kNone, "fetch", u, n));
  STRATA_RETURN_IF_ERROR(h2d->record(*slot.fetched));
  slot.unit = u;
  slot.used = false;
  slot.early = early;
  slot.next_step = early && next_step_fetches;
  slot.gate_step = gate_step;
  slot.gate_failures = failures_at_issue;
  slot_of[uu] = s;
  return s;
}

bool OffloadEngine::Impl::gate_open(const ParamSlot& slot) const {
  return updated_step[static_cast<std::size_t>(slot.unit)] >= slot.gate_step || !worker_error.ok() ||
         update_failures != slot.gate_failures;
}

Status OffloadEngine::Impl::access_params(int m) {
  if (injected_caller_module == m) {
    // Tests only (EngineFaults::fail_caller_at): the caller fails here, inside the pass.
    injected_caller_module = -1;
    return std::exchange(injected_caller_error, ok_status());
  }
  if (injected_compute_module == m) {
    // Tests only (EngineFaults::fail_compute_at): the compute stream fails here, so its later
    // work, the model's tensor all-reduces included, is skipped.
    injected_compute_module = -1;
    STRATA_RETURN_IF_ERROR(
        compute->host_fn("offload: injected compute fault", [f = injected_compute_error]() { return f; }));
  }
  for (int u : placement.units[static_cast<std::size_t>(m)].reads) {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (placement.units[uu].param_bytes == 0) continue;
    // The delayed update's caller publishes what this pass may read before the pass starts (the
    // update in flight is the next step's to see); compute then waits for the upload alone.
    if (!delayed) STRATA_RETURN_IF_ERROR(wait_updated(u));
    if (placement.resident(u)) {
      if (!placement.sharding.optimizer_on_device && uploaded_recorded[uu]) {
        STRATA_RETURN_IF_ERROR(tracer.stream_begin(*compute, track.compute));
        STRATA_RETURN_IF_ERROR(compute->wait(*uploaded[uu]));
        STRATA_RETURN_IF_ERROR(
            tracer.stream_end(*compute, track.compute, TraceCounter::kFetchStall, "wait upload", u));
      }
      continue;
    }
    ++accesses;
    int s = slot_of[uu];
    if (s >= 0 && pslots[static_cast<std::size_t>(s)].early) {
      // Fetched early, gated by the update that wait_updated has just seen published. Whether
      // the gate saw that update (and not a failure) is known once the fetch completed.
      ParamSlot& early = pslots[static_cast<std::size_t>(s)];
      STRATA_RETURN_IF_ERROR(early.fetched->synchronize());
      early.early = false;
      if (!early.early_ok->load()) {
        STRATA_RETURN_IF_ERROR(release_slot(s));
        s = -1;
      } else if (early.next_step) {
        ++early_hits;
      }
    }
    if (s >= 0) {
      ++hits;
    } else {
      STRATA_ASSIGN_OR_RETURN(s, fetch(u, m));
    }
    ParamSlot& slot = pslots[static_cast<std::size_t>(s)];
    STRATA_RETURN_IF_ERROR(tracer.stream_begin(*compute, track.compute));
    STRATA_RETURN_IF_ERROR(compute->wait(*slot.fetched));
    STRATA_RETURN_IF_ERROR(
        tracer.stream_end(*compute, track.compute, TraceCounter::kFetchStall, "wait fetch", u));
    slot.used = true;
    bound_params[uu] = slot.dev;
    STRATA_RETURN_IF_ERROR(bind(u));
  }
  return ok_status();
}

// After module m's work is enqueued: release the slots that the next accesses do not reuse.
Status OffloadEngine::Impl::release_after(int m) {
  const std::size_t window = static_cast<std::size_t>(std::max(1, settings.prefetch_modules));
  for (int u : placement.units[static_cast<std::size_t>(m)].reads) {
    const int s = slot_of[static_cast<std::size_t>(u)];
    if (s < 0) continue;
    bool reused = false;
    for (std::size_t j = pos; j < pos + window && !reused; ++j) {
      const int code = predicted(j);
      if (code < 0) break;
      const auto& st = placement.units[static_cast<std::size_t>(code % M)].reads;
      reused = std::find(st.begin(), st.end(), u) != st.end();
    }
    if (!reused) STRATA_RETURN_IF_ERROR(release_slot(s));
  }
  return prefetch_ahead(pos);
}

Status OffloadEngine::Impl::prefetch_ahead(std::size_t from, std::int64_t gate_step) {
  if (settings.prefetch_modules == 0 || settings.prefetch_elements == 0) return ok_status();
  std::int64_t budget = settings.prefetch_elements;
  bool fetched_any = false;
  for (std::size_t j = from; j < from + static_cast<std::size_t>(settings.prefetch_modules); ++j) {
    const int code = predicted(j);
    if (code < 0) break;
    for (int u : placement.units[static_cast<std::size_t>(code % M)].reads) {
      const std::size_t uu = static_cast<std::size_t>(u);
      if (placement.resident(u) || slot_of[uu] >= 0 || placement.units[uu].param_bytes == 0) continue;
      // A unit whose update is still running is fetched behind a gate on the h2d stream, as an
      // early fetch is: the caller goes on to enqueue the module it is about to run instead of
      // waiting here for a unit the forward reaches a few modules later (it waited for that one
      // before the next module could start: the first units of a step after an NVMe update). The
      // fetch is issued either way, so the prefetch schedule (and the hit rate) does not depend
      // on how fast the optimizer thread runs. Where it cannot be gated (gated_in_pass) the caller
      // waits. Not with the delayed update: the update in flight writes the next version, and
      // this step reads the published one.
      std::int64_t gate = gate_step;
      if (!delayed && gate_step < 0) {
        if (!gated_in_pass(u)) {
          STRATA_RETURN_IF_ERROR(wait_updated(u));
        } else {
          std::lock_guard<std::mutex> lock(mu);
          if (updated_step[uu] < steps) gate = steps;
        }
      }
      // The budget bounds what is fetched beyond the first unit: a module larger than the whole
      // budget is still fetched one ahead, or it would never be prefetched at all.
      budget -= static_cast<std::int64_t>(placement.units[uu].grad_bytes / 4);
      if (budget < 0 && fetched_any) return ok_status();
      fetched_any = true;
      // ... into a free slot.
      bool free_slot = false;
      for (const ParamSlot& sl : pslots) free_slot = free_slot || sl.unit < 0;
      if (!free_slot) return ok_status();
      STRATA_RETURN_IF_ERROR(fetch(u, -1, gate).status());
    }
  }
  return ok_status();
}

Status OffloadEngine::Impl::prefetch_next_step() {
  // Not with the optimizer on the device (every unit is resident), nor with the delayed update
  // (publish_delayed decides what the next pass reads). On a pipeline a stage's pass is its whole
  // schedule (one trace per step, begin_pass to end_pass), so its first accesses are known from
  // it as in one process; a stage reads its own units and its gate waits for their marks, set
  // only once every stage agreed on the update where it may fail (defer_marks), which needs the
  // stages' optimizer threads only. With data parallelism at stages 0-2 and with tensor
  // parallelism every fetch reads this rank's own home: nothing in it talks, and the gate waits
  // for the agreed per-unit mark. At stage 3 a fetch all-gathers the ranks' slices on the h2d
  // stream, so every rank must issue the same early fetches and take the same decision on each:
  // the early fetches follow the trace, the slots and the budget (the same on every rank), and
  // whether the pass uses a copy is agreed inside its gather (early_gather_unit_params), never
  // taken from when this rank's gate looked (docs/offload.md "Early fetch across steps").
  if (placement.sharding.optimizer_on_device || delayed || trace.empty()) return ok_status();
  const bool gathers = placement.any_gathered_at_fetch();
  if (!gathers) {
    // This rank's own view suffices where nothing talks. At stage 3 an optimizer-thread failure
    // reaches the ranks at different times: they issue the fetches regardless, and every gate
    // ends at once on the failure (each rank's `missing`), so the agreement drops the copies.
    std::lock_guard<std::mutex> lock(mu);
    if (!worker_error.ok()) return ok_status();  // the next call reports or retries first
  }
  // The next pass starts the recorded trace at its first access (begin_pass); end_pass released
  // every slot, since the update changes every unit.
  trace_ok = true;
  next_step_fetches = true;
  Status issued = prefetch_ahead(0, steps);
  next_step_fetches = false;
  return issued;
}

Status OffloadEngine::Impl::end_pass() {
  trace = record;
  trace_ok = !trace.empty();
  // Keep what the next pass (same trace, same step) starts with; release everything else.
  const std::size_t window = static_cast<std::size_t>(std::max(1, settings.prefetch_modules));
  for (std::size_t s = 0; s < pslots.size(); ++s) {
    const int u = pslots[s].unit;
    if (u < 0) continue;
    bool keep = false;
    if (cyclic) {
      for (std::size_t j = 0; j < std::min(window, trace.size()) && !keep; ++j) {
        const auto& st = placement.units[static_cast<std::size_t>(trace[j] % M)].reads;
        keep = std::find(st.begin(), st.end(), u) != st.end();
      }
    }
    if (!keep) STRATA_RETURN_IF_ERROR(release_slot(static_cast<int>(s)));
  }
  return ok_status();
}

Status OffloadEngine::Impl::acquire_grads(int m, bool first_micro) {
  if (placement.sharding.optimizer_on_device) return ok_status();
  for (int u : placement.units[static_cast<std::size_t>(m)].reads) {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (gslot_of[uu] >= 0 || placement.units[uu].grad_bytes == 0 || placement.device_state(u)) continue;
    int s = -1;
    for (std::size_t i = 0; i < gslots.size() && s < 0; ++i)
      if (gslots[i].unit < 0) s = static_cast<int>(i);
    if (s < 0) return internal_error("offload: no gradient bucket free for module " + std::to_string(u));
    GradSlot& g = gslots[static_cast<std::size_t>(s)];
    // Stage 2 reduces every micro-batch's gradients on their own: each starts from zero.
    if (first_micro || (placement.sharding.host_state_sharded && settings.zero_stage >= 2)) {
      STRATA_RETURN_IF_ERROR(compute->wait(*g.free));
      STRATA_RETURN_IF_ERROR(compute->memset_async(g.dev, 0, placement.units[uu].grad_bytes));
    } else {
      // Restore the gradients accumulated so far: the device then adds exactly as when resident.
      const char* from = grads_on_nvme ? nullptr : host_at(host_grads, grad_begin(u));
      if (grads_on_nvme) {
        char* staging = grad_staging.bytes();
        STRATA_RETURN_IF_ERROR(gstream->host_fn("offload: NVMe read of grad." + std::to_string(u),
                                                [this, u, staging]() {
                                                  detail::HostSpan span(tracer, track.nvme_fetch,
                                                                        TraceCounter::kNvmeRead, "read gradients", u,
                                                                        placement.units[static_cast<std::size_t>(u)].grad_bytes);
                                                  // Sharded: only stage 1 restores, its unsharded local sum.
                                                  return placement.sharding.host_state_sharded ? local_grads_io(u, staging, false)
                                                                 : read_grad_shards(u, staging);
                                                }));
        from = staging;
      }
      STRATA_RETURN_IF_ERROR(tracer.stream_begin(*gstream, track.grads));
      STRATA_RETURN_IF_ERROR(gstream->copy_async(g.dev, from, placement.units[uu].grad_bytes, CopyKind::kHostToDevice));
      STRATA_RETURN_IF_ERROR(tracer.stream_end(*gstream, track.grads, TraceCounter::kH2D, "restore gradients",
                                               u, placement.units[uu].grad_bytes));
      STRATA_RETURN_IF_ERROR(gstream->record(*g.ready));
      STRATA_RETURN_IF_ERROR(compute->wait(*g.ready));
    }
    g.unit = u;
    gslot_of[uu] = s;
    bound_grads[uu] = g.dev;
    STRATA_RETURN_IF_ERROR(bind(u));
  }
  return ok_status();
}

Status OffloadEngine::Impl::enqueue_reduce(int u, bool first_micro, bool last_micro, std::int64_t step) {
  const bool accumulate = settings.zero_stage >= 2 && !first_micro;
  const bool scan = grads_on_nvme && last_micro && step > 0;
  const auto inv_scale = static_cast<float>(1.0 / loss_scale_now);
  return gstream->host_fn(
      "offload: data-parallel reduce-scatter of grad." + std::to_string(u),
      [this, u, accumulate, scan, inv_scale]() { return reduce_unit_grads(u, accumulate, scan, inv_scale); });
}

Status OffloadEngine::Impl::reduce_after_failure(int m, bool first_micro, bool last_micro,
                                                 std::int64_t step) {
  if (!placement.sharding.host_state_sharded || !(last_micro || settings.zero_stage >= 2)) return ok_status();
  for (int u : placement.units[static_cast<std::size_t>(m)].reads) {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (placement.units[uu].last_touch != m || placement.units[uu].grad_bytes == 0 || placement.device_state(u)) continue;
    STRATA_RETURN_IF_ERROR(enqueue_reduce(u, first_micro, last_micro, step));
  }
  return ok_status();
}

Status OffloadEngine::Impl::release_grads(int m, bool first_micro, bool last_micro, std::int64_t step,
                                         double lr) {
  if (placement.sharding.optimizer_on_device) return ok_status();
  for (int u : placement.units[static_cast<std::size_t>(m)].reads) {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (placement.units[uu].last_touch != m || gslot_of[uu] < 0 || placement.device_state(u)) continue;
    // Delayed update: the previous step's update of u may still read its gradients (host_grads,
    // the shard or the NVMe shards), which this copy out overwrites. (Otherwise the forward
    // already waited for it.)
    if (delayed) STRATA_RETURN_IF_ERROR(wait_updated(u));
    GradSlot& g = gslots[static_cast<std::size_t>(gslot_of[uu])];
    STRATA_RETURN_IF_ERROR(compute->record(*g.done));
    STRATA_RETURN_IF_ERROR(gstream->wait(*g.done));
    // Data parallel: the final local gradients (every micro-batch's in stage 2) go to the
    // reduce-scatter; stage 1's earlier micro-batches wait in host_grads, unreduced.
    const bool reduce = placement.sharding.host_state_sharded && (last_micro || settings.zero_stage >= 2);
    char* out = reduce          ? rs_send.bytes()
                : grads_on_nvme ? grad_staging.bytes()
                                : host_at(host_grads, grad_begin(u));
    STRATA_RETURN_IF_ERROR(tracer.stream_begin(*gstream, track.grads));
    STRATA_RETURN_IF_ERROR(
        traced_copy(*gstream, track.copy_d2h, "copy", out, g.dev, placement.units[uu].grad_bytes, CopyKind::kDeviceToHost, u));
    STRATA_RETURN_IF_ERROR(
        tracer.stream_end(*gstream, track.grads, TraceCounter::kNone, "gradients out", u, placement.units[uu].grad_bytes));
    STRATA_RETURN_IF_ERROR(gstream->record(*g.free));
    if (reduce) {
      STRATA_RETURN_IF_ERROR(enqueue_reduce(u, first_micro, last_micro, step));
    } else if (grads_on_nvme && placement.sharding.host_state_sharded) {
      // Stage 1's earlier micro-batches: the unsharded local sum waits on NVMe, unreduced.
      STRATA_RETURN_IF_ERROR(gstream->host_fn("offload: NVMe write of grad_local." + std::to_string(u),
                                              [this, u, out]() -> Status {
                                                detail::HostSpan span(tracer, track.nvme_publish,
                                                                      TraceCounter::kNvmeWrite, "write gradients", u,
                                                                      placement.units[static_cast<std::size_t>(u)].grad_bytes);
                                                return local_grads_io(u, out, true);
                                              }));
    } else if (grads_on_nvme) {
      // Out through the one staging buffer (gstream order keeps its uses apart), scanned for the
      // norm on the way when this is the step's last touch, then to NVMe.
      const bool scan = last_micro && step > 0;
      const auto inv_scale = static_cast<float>(1.0 / loss_scale_now);
      STRATA_RETURN_IF_ERROR(gstream->host_fn("offload: NVMe write of grad." + std::to_string(u),
                                              [this, u, out, scan, inv_scale]() -> Status {
                                                const std::size_t uu = static_cast<std::size_t>(u);
                                                if (scan) {
                                                  // scan_norm: tensor parallel counts replicated
                                                  // parameters on tp rank 0 only.
                                                  STRATA_ASSIGN_OR_RETURN(
                                                      landed_stats[uu],
                                                      scan_norm(*host_opt, u, out, 0, placement.units[uu].grad_bytes / 4, inv_scale));
                                                }
                                                detail::HostSpan span(tracer, track.nvme_publish,
                                                                      TraceCounter::kNvmeWrite, "write gradients", u,
                                                                      placement.units[uu].grad_bytes);
                                                return write_grad_shards(u, out);
                                              }));
    }
    g.unit = -1;
    gslot_of[uu] = -1;
    bound_grads[uu] = nullptr;
    if (last_micro && step > 0 && u == placement.stage.tied_unit && pp_tied) {
      // Pipeline: the tied unit's gradient is summed with the other end's once this stage's whole
      // schedule has run (run_pipeline), not on the gradient stream here: the other end may still
      // need this stage's activation gradients, which wait behind this stream's buckets.
      STRATA_RETURN_IF_ERROR(gstream->record(*landed[uu]));
      tied_landed = Command{Command::kLanded, u, step, lr, opt_step_now, loss_scale_now};
    } else if (last_micro && step > 0) {
      STRATA_RETURN_IF_ERROR(gstream->record(*landed[uu]));
      {
        std::lock_guard<std::mutex> lock(mu);
        commands.push_back(Command{Command::kLanded, u, step, lr, opt_step_now, loss_scale_now});
      }
      cv.notify_all();
    }
  }
  return ok_status();
}

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
      note_access(m);
      STRATA_RETURN_IF_ERROR(keep_module_place(access_params(m)));
    }
    if (!pass_error.ok()) {  // keep_modules after a failure: the model's work alone
      STRATA_RETURN_IF_ERROR(model->forward_module(m, for_backward));
      continue;
    }
    STRATA_RETURN_IF_ERROR(tracer.stream_begin(*compute, track.compute));
    STRATA_RETURN_IF_ERROR(model->forward_module(m, for_backward));
    STRATA_RETURN_IF_ERROR(tracer.stream_end(*compute, track.compute, TraceCounter::kCompute,
                                             for_backward ? "forward" : "forward (no grad)", m));
    if (hold_forward == m) {
      STRATA_RETURN_IF_ERROR(compute->host_fn("offload: test hold's forward", [this, at = steps]() {
        {
          std::lock_guard<std::mutex> lock(mu);
          forward_ran_at = std::max(forward_ran_at, at);
        }
        cv.notify_all();
        return ok_status();
      }));
    }
    STRATA_RETURN_IF_ERROR(keep_module_place(release_after(m)));
  }
  return ok_status();
}

Status OffloadEngine::Impl::run_backward(float dloss, bool first_micro, bool last_micro, std::int64_t step,
                                         double lr, int chunk) {
  const auto [first, end] = placement.stage.chunk_ranges[static_cast<std::size_t>(chunk)];
  for (int m = end - 1; m >= first; --m) {
    if (pass_error.ok()) {
      note_access(M + m);
      Status before = access_params(m);
      if (before.ok()) before = acquire_grads(m, first_micro);
      if (before.ok() && placement.sharding.device_grads_sharded) before = open_buckets(m);
      STRATA_RETURN_IF_ERROR(keep_module_place(std::move(before)));
    }
    if (!pass_error.ok()) {  // keep_modules after a failure: the model's work and the collectives alone
      STRATA_RETURN_IF_ERROR(model->backward_module(m, dloss));
      STRATA_RETURN_IF_ERROR(reduce_after_failure(m, first_micro, last_micro, step));
      continue;
    }
    STRATA_RETURN_IF_ERROR(tracer.stream_begin(*compute, track.compute));
    STRATA_RETURN_IF_ERROR(model->backward_module(m, dloss));
    STRATA_RETURN_IF_ERROR(tracer.stream_end(*compute, track.compute, TraceCounter::kCompute, "backward", m));
    Status after = release_grads(m, first_micro, last_micro, step, lr);
    if (after.ok() && placement.sharding.device_grads_bucketed) after = close_buckets(m, first_micro, last_micro, step);
    if (after.ok()) after = release_after(m);
    STRATA_RETURN_IF_ERROR(keep_module_place(std::move(after)));
  }
  return ok_status();
}

Status OffloadEngine::Impl::open_buckets(int m) {
  for (int u : placement.units[static_cast<std::size_t>(m)].reads) {
    const int b = placement.units[static_cast<std::size_t>(u)].bucket.index;
    if (b < 0 || bucket_buf_of[static_cast<std::size_t>(b)] >= 0) continue;
    // The free buffer released longest ago (ties: the lowest). The lowest free one is often the
    // buffer whose reduce-scatter the previous module just launched, and compute would wait for it
    // at once. Which buffer a bucket takes changes no bits: finish_through reduces in launch order.
    int i = -1;
    for (std::size_t k = 0; k < bucket_buf_owner.size(); ++k)
      if (bucket_buf_owner[k] < 0 && (i < 0 || bucket_buf_freed[k] < bucket_buf_freed[static_cast<std::size_t>(i)]))
        i = static_cast<int>(k);
    if (i < 0) {
      return internal_error("offload: no gradient bucket buffer free for bucket " + std::to_string(b) + " at module " +
                            std::to_string(m) + " (the plan counted " + std::to_string(bucket_buf.size()) + ")");
    }
    bucket_buf_owner[static_cast<std::size_t>(i)] = b;
    bucket_buf_of[static_cast<std::size_t>(b)] = i;
    char* buf = bucket_buf[static_cast<std::size_t>(i)];
    // The buffer's previous bucket may still be reduce-scattering from it (overlap_comm): finished
    // first, in compute-stream order, then zeroed (the padding to size x chunk included).
    if (settings.overlap_comm) {
      STRATA_RETURN_IF_ERROR(compute->host_fn("offload: gradient bucket buffer " + std::to_string(i) + " free",
                                              [this, i]() { return finish_through(i); }));
    }
    STRATA_RETURN_IF_ERROR(compute->memset_async(buf, 0, placement.buckets.buckets[static_cast<std::size_t>(b)].bytes));
    for (int v : placement.buckets.buckets[static_cast<std::size_t>(b)].units) {
      bound_grads[static_cast<std::size_t>(v)] = reinterpret_cast<float*>(buf + placement.units[static_cast<std::size_t>(v)].bucket.offset);
      STRATA_RETURN_IF_ERROR(bind(v));
    }
  }
  return ok_status();
}

Status OffloadEngine::Impl::close_buckets(int m, bool first_micro, bool last_micro, std::int64_t step) {
  for (std::size_t b = 0; b < placement.buckets.buckets.size(); ++b) {
    if (placement.buckets.buckets[b].close_after != m) continue;
    const int bi = static_cast<int>(b);
    if (placement.sharding.device_grads_sharded) {
      // Every micro-batch: reduced into the slices (the first micro-batch's overwrite them).
      const int i = bucket_buf_of[b];
      if (i < 0) return internal_error("offload: gradient bucket " + std::to_string(b) + " closed but never opened");
      const bool accumulate = !first_micro;
      STRATA_RETURN_IF_ERROR(compute->host_fn("offload: data-parallel reduce-scatter of gradient bucket " + std::to_string(b),
                                              [this, bi, i, accumulate]() -> Status {
                                                return launch_bucket(bi, i, accumulate);
                                              }));
      bucket_buf_owner[static_cast<std::size_t>(i)] = -1;
      bucket_buf_freed[static_cast<std::size_t>(i)] = ++bucket_frees;
      bucket_buf_of[b] = -1;
      for (int v : placement.buckets.buckets[b].units) {
        bound_grads[static_cast<std::size_t>(v)] = nullptr;
        STRATA_RETURN_IF_ERROR(bind(v));
      }
    } else if (last_micro && step > 0) {
      // Stage 0: the local sum of every micro-batch, all-reduced once (earlier micro-batches only add).
      STRATA_RETURN_IF_ERROR(compute->host_fn("offload: data-parallel all-reduce of gradient bucket " + std::to_string(b),
                                              [this, bi]() -> Status { return launch_bucket(bi, -1, false); }));
    }
  }
  return ok_status();
}

Status OffloadEngine::Impl::launch_bucket(int b, int buf, bool accumulate) {
  const std::size_t bb = static_cast<std::size_t>(b);
  const std::vector<int>& us = placement.buckets.buckets[bb].units;
  if (!placement.sharding.device_grads_sharded) {
    const auto [begin, n] = bucket_range(b);
    float* g = reinterpret_cast<float*>(reinterpret_cast<char*>(dgrads) + begin);
    CommWork w = dp_buckets->all_reduce(g, g, n, DType::kF32, ReduceOp::kSum);
    if (settings.overlap_comm) {
      bucket_work.emplace_back(b, std::move(w));
      return ok_status();
    }
    return dp_wait(dp_tracks[1], std::move(w), "all-reduce gradient bucket", us.front(), 4 * n);
  }
  // Each unit sits in the buffer padded with zeros to size x chunk (the sharded optimizer's
  // chunks): one reduce-scatter per unit, in place from there into the buffer's receive part.
  char* base = bucket_buf[static_cast<std::size_t>(buf)];
  float* recv = reinterpret_cast<float*>(base + placement.buckets.recv_offset());
  InFlight f;
  f.bucket = b;
  f.buf = buf;
  f.accumulate = accumulate;
  for (int u : us) {
    const std::size_t uu = static_cast<std::size_t>(u);
    f.work.push_back(dp_buckets->reduce_scatter(base + placement.units[uu].bucket.offset, recv + placement.units[uu].bucket.rs_at, placement.units[uu].slice.chunk,
                                                DType::kF32, ReduceOp::kSum));
  }
  in_flight.push_back(std::move(f));
  if (settings.overlap_comm) return ok_status();
  return finish_through(buf);
}

Status OffloadEngine::Impl::finish_through(int buf) {
  if (buf >= 0 && std::none_of(in_flight.begin(), in_flight.end(), [buf](const InFlight& f) { return f.buf == buf; }))
    return ok_status();
  const std::uint64_t P = static_cast<std::uint64_t>(dp_size);
  while (!in_flight.empty()) {
    InFlight f = std::move(in_flight.front());
    in_flight.pop_front();
    const std::vector<int>& us = placement.buckets.buckets[static_cast<std::size_t>(f.bucket)].units;
    const float* recv = reinterpret_cast<const float*>(bucket_buf[static_cast<std::size_t>(f.buf)] +
                                                       placement.buckets.recv_offset());
    for (std::size_t k = 0; k < us.size(); ++k) {
      const std::size_t uu = static_cast<std::size_t>(us[k]);
      STRATA_RETURN_IF_ERROR(
          dp_wait(dp_tracks[1], f.work[k], "reduce-scatter gradient bucket", us[k], 4 * P * placement.units[uu].slice.chunk));
      // This rank's slice: the first micro-batch's overwrites, later ones add (the host tier's
      // stage-2 sum, in micro-batch order: buckets finish in launch order).
      float* dst = dgrads + placement.units[uu].slice_offset;
      const float* src = recv + placement.units[uu].bucket.rs_at;
      const std::uint64_t len = placement.units[uu].slice.len;
      if (f.accumulate) {
        for (std::uint64_t i = 0; i < len; ++i) dst[i] += src[i];
      } else {
        std::memcpy(dst, src, len * 4);
      }
    }
    if (f.buf == buf) break;
  }
  return ok_status();
}

Status OffloadEngine::Impl::drain_buckets() {
  for (auto& [b, w] : bucket_work) {
    STRATA_RETURN_IF_ERROR(dp_wait(dp_tracks[1], w, "all-reduce gradient bucket",
                                   placement.buckets.buckets[static_cast<std::size_t>(b)].units.front(), 4 * bucket_range(b).second));
  }
  bucket_work.clear();
  return finish_through(-1);
}

Status OffloadEngine::Impl::run_micro_batches(std::span<const std::int32_t> inputs,
                                              std::span<const std::int32_t> targets, std::int64_t micro, bool update,
                                              std::int64_t step, double lr) {
  const std::int64_t B = config.micro_batch, T = config.seq_len;
  const auto per = static_cast<std::size_t>(B * T);
  if (inputs.size() != per * static_cast<std::size_t>(micro) || targets.size() != inputs.size()) {
    return invalid_argument("train step: expected " + std::to_string(per * static_cast<std::size_t>(micro)) +
                            " inputs and targets (" + std::to_string(micro) + " micro-batches of " + std::to_string(B) +
                            " x " + std::to_string(T) + "), got " + std::to_string(inputs.size()) + " and " +
                            std::to_string(targets.size()));
  }
  std::int64_t count = 0;
  for (auto t : targets) count += t >= 0 ? 1 : 0;
  if (dp_size > 1) {  // the loss is the mean over every rank's tokens
    double global = static_cast<double>(count);
    STRATA_RETURN_IF_ERROR(sum_over_ranks(std::span<double>(&global, 1)));
    count = static_cast<std::int64_t>(global);
  }
  if (count == 0) return invalid_argument("train step: every target is ignored (negative)");
  // grad_sharded: the slices are written, not added to, by each step's first micro-batch.
  if (placement.sharding.optimizer_on_device && !placement.sharding.device_grads_sharded) STRATA_RETURN_IF_ERROR(compute->memset_async(dgrads, 0, dgrad_bytes));
  if (placement.sharding.device_grads_bucketed) {
    // A failed step may have left collectives in flight and buffers taken: wait them out, drop them.
    std::fill(bucket_buf_owner.begin(), bucket_buf_owner.end(), -1);
    std::fill(bucket_buf_freed.begin(), bucket_buf_freed.end(), 0);
    bucket_frees = 0;
    std::fill(bucket_buf_of.begin(), bucket_buf_of.end(), -1);
    STRATA_RETURN_IF_ERROR(compute->host_fn("offload: discard gradient buckets in flight", [this]() -> Status {
      for (InFlight& f : in_flight)
        for (CommWork& w : f.work) (void)w.wait();
      in_flight.clear();
      for (auto& [b, w] : bucket_work) (void)w.wait();
      bucket_work.clear();
      return ok_status();
    }));
  }
  if (placement.sharding.optimizer_split) STRATA_RETURN_IF_ERROR(compute->memset_async(dgrads, 0, placement.sizes.device_opt_bytes));
  // fp16: the loss gradient carries the loss scale (a power of two, so the product is exact).
  const float dloss = (1.0f / static_cast<float>(count)) * static_cast<float>(update ? loss_scale_now : 1.0);
  if (pp_size > 1) {
    STRATA_RETURN_IF_ERROR(run_pipeline(inputs, targets, micro, dloss, update ? step : 0, lr));
    if (!placement.sharding.split_state_sharded || !update) return ok_status();
    // Partial offload with data parallelism, stages 0-1: the device units' sums over the
    // schedule's micro-batches, reduce-scattered once as below, after every pipeline transfer of
    // the step (run_pipeline drained the stream). Stage 2 reduced each micro-batch inside the
    // schedule (run_pipeline) into offload.grad_slices.
    if (settings.zero_stage < 2) STRATA_RETURN_IF_ERROR(reduce_device_units(/*accumulate=*/false));
    if (pp_tied && placement.split_device(placement.stage.tied_unit)) {
      // The tied unit's reduced slice summed with the other end's (the same slice of the same
      // unit), as sum_tied_landed sums a host unit's, before scan_device_units reads it.
      STRATA_RETURN_IF_ERROR(compute->synchronize());
      STRATA_RETURN_IF_ERROR(
          reduce_tied_grads(dev_slice_grads(placement.stage.tied_unit), placement.units[static_cast<std::size_t>(placement.stage.tied_unit)].slice.len));
    }
    return ok_status();
  }
  // Partial offload with data parallelism: stage 2 reduces the device units' gradients of every
  // micro-batch on their own (each starts from zero, as ratio 1's buckets do); stage 1 reduces
  // their sum once, after the last micro-batch.
  const bool reduce_each = placement.sharding.split_state_sharded && settings.zero_stage >= 2;
  for (std::int64_t a = 0; a < micro; ++a) {
    STRATA_RETURN_IF_ERROR(model->set_batch(inputs.subspan(a * per, per), targets.subspan(a * per, per), B, T));
    cyclic = a + 1 < micro;
    begin_pass();
    if (reduce_each && a > 0) STRATA_RETURN_IF_ERROR(compute->memset_async(dgrads, 0, placement.sizes.device_opt_bytes));
    STRATA_RETURN_IF_ERROR(run_forward(true));
    STRATA_RETURN_IF_ERROR(model->copy_losses(static_cast<int>(a)));
    STRATA_RETURN_IF_ERROR(run_backward(dloss, a == 0, a + 1 == micro, update ? step : 0, lr));
    if (placement.sharding.split_state_sharded && (reduce_each || a + 1 == micro))
      STRATA_RETURN_IF_ERROR(reduce_device_units(/*accumulate=*/reduce_each && a > 0));
    STRATA_RETURN_IF_ERROR(end_pass());
  }
  cyclic = false;
  return ok_status();
}

// The update with the optimizer on the device, in stream order after backward.
Status OffloadEngine::Impl::device_update(double lr, std::int64_t step) {
  if (placement.sharding.device_state_sharded) return device_update_sharded(lr, step);
  if (launch->is_cpu()) {
    // One host function: the gradient scan per unit (merged in unit order, as the host tiers
    // merge theirs), then every update with the clip applied.
    struct Job {
      const CpuOptimizer* opt;
      const Impl* engine;
      Comm* tp;  // tensor parallel: the model's group (this stream's), null otherwise
      std::vector<std::pair<float*, std::size_t>> unit_grads;
      struct P {
        OptimizerBuffers b;
        bool decay;
      };
      std::vector<P> params;
    };
    auto job = std::make_shared<Job>();
    job->opt = &*device_opt;
    job->engine = this;
    job->tp = tp_size > 1 ? tp_model.get() : nullptr;
    for (int u = 0; u < M; ++u)
      job->unit_grads.emplace_back(reinterpret_cast<float*>(reinterpret_cast<char*>(dgrads) + grad_begin(u)),
                                   placement.units[static_cast<std::size_t>(u)].grad_bytes / 4);
    for (const OwnedParam& o : owned) {
      const OptimizerBuffers b = device_buffers(o);
      job->params.push_back(Job::P{b, o.decay});
    }
    double* norm_out = &grad_norm;
    const OptimizerSettings os = config.optimizer;
    const double loss_scale = loss_scale_now;
    const auto inv_scale = static_cast<float>(1.0 / loss_scale);
    const bool skip_overflow = fp16;
    return launch->run("optimizer step", [=, this](const kernels::KernelContext&) -> Status {
      GradStats total;
      if (pp_size > 1) {
        // Every stage's units, merged in unit order (merge_stage_stats): the tied unit's gradient
        // was summed over the first and last stage before this step ran (step()).
        // Tensor parallel too (the grid): each unit's scan counts replicated parameters on tp
        // rank 0 only (scan_norm), the stages merge per tp rank, merge_over_tp below adds the ranks.
        std::vector<GradStats> per_unit;
        for (std::size_t u = 0; u < job->unit_grads.size(); ++u) {
          const auto& [g, n] = job->unit_grads[u];
          STRATA_ASSIGN_OR_RETURN(GradStats s,
                                  job->engine->scan_norm(*job->opt, static_cast<int>(u),
                                                         reinterpret_cast<const char*>(g), 0, n, inv_scale));
          per_unit.push_back(s);
        }
        STRATA_ASSIGN_OR_RETURN(total, merge_stage_stats(per_unit));
      } else {
        // Tensor parallel: scan_norm counts replicated parameters on one rank only.
        for (std::size_t u = 0; u < job->unit_grads.size(); ++u) {
          const auto& [g, n] = job->unit_grads[u];
          STRATA_ASSIGN_OR_RETURN(GradStats s, job->engine->scan_norm(*job->opt, static_cast<int>(u),
                                                                      reinterpret_cast<const char*>(g), 0, n, inv_scale));
          total.merge(s);
        }
      }
      if (job->tp != nullptr) {
        // On the compute stream, after every rank's backward: the model's group, in stream order.
        STRATA_ASSIGN_OR_RETURN(total, job->engine->merge_over_tp(total, *job->tp));
      }
      const double norm = total.norm();
      *norm_out = norm;
      if (!total.finite() && skip_overflow) return ok_status();  // fp16 overflow: the step is skipped
      if (!total.finite()) {
        return invalid_argument("step " + std::to_string(step) + ": the gradient norm is not finite (" +
                                std::to_string(norm) + "); lower the learning rate or enable clipping");
      }
      const float scale = update_scale(norm, loss_scale);
      for (const auto& p : job->params) {
        STRATA_RETURN_IF_ERROR(job->opt->update(hyper_of(os, lr, p.decay), step, scale, p.b));
      }
      return ok_status();
    });
  }
  // cuda: the norm is needed on the host to pick the clip scale.
  const std::size_t n = placement.sizes.grad_bytes / 4;
  auto* partials = static_cast<double*>(cuda_partials.data());
  double* result = partials + detail::sum_of_squares_cuda_partials(n);
  void* cs = compute->native_handle();
  STRATA_RETURN_IF_ERROR(detail::sum_of_squares_cuda(cs, dgrads, n, partials, result));
  STRATA_RETURN_IF_ERROR(compute->copy_async(pinned_norm.data(), result, sizeof(double), CopyKind::kDeviceToHost));
  STRATA_RETURN_IF_ERROR(compute->synchronize());
  grad_norm = std::sqrt(*static_cast<double*>(pinned_norm.data())) / loss_scale_now;
  if (!std::isfinite(grad_norm) && fp16) return ok_status();  // fp16 overflow: the step is skipped
  if (!std::isfinite(grad_norm)) {
    return invalid_argument("step " + std::to_string(step) +
                            ": the gradient norm is not finite; lower the learning rate or enable clipping");
  }
  const float scale = update_scale(grad_norm, loss_scale_now);
  // The bit-exact fused kernel (the cpu update's arithmetic), one call per weight-decay group.
  std::vector<DeviceAdamTensor> group[2];  // [0]: no decay, [1]: decay
  for (const OwnedParam& o : owned) {
    char* wp = resident + placement.units[static_cast<std::size_t>(o.unit)].resident_offset + o.param_in_unit;
    DeviceAdamTensor x;
    x.master = half ? reinterpret_cast<float*>(reinterpret_cast<char*>(dmaster) + o.grad_offset) : reinterpret_cast<float*>(wp);
    x.param = half ? static_cast<void*>(wp) : static_cast<void*>(x.master);  // fp32: the master is the weight
    x.grad = reinterpret_cast<const float*>(reinterpret_cast<char*>(dgrads) + o.grad_offset);
    x.exp_avg = reinterpret_cast<float*>(reinterpret_cast<char*>(dm) + o.grad_offset);
    x.exp_avg_sq = reinterpret_cast<float*>(reinterpret_cast<char*>(dv) + o.grad_offset);
    x.n = o.n;
    group[o.decay ? 1 : 0].push_back(x);
  }
  const DType param_dtype = wdtype;
  for (int decay = 0; decay < 2; ++decay) {
    STRATA_RETURN_IF_ERROR(fused_adam_cuda(group[decay], param_dtype, DType::kF32,
                                           hyper_of(config.optimizer, lr, decay == 1), step, scale, cs));
  }
  return ok_status();
}

// Host-synchronous collectives inside one host function of the compute stream (the tensor-parallel
// merge's way): the stream's order puts them after every rank's backward, and the caller, which
// synchronizes the stream after the step, is the only other thread that uses the group (through
// dp_caller, never while this runs). The gradient reduction, the scan, the merge and the update
// are the host tier's sharded ones (reduce_unit_grads, scan_norm, the worker's merge,
// update_unit_host), so the two placements give the same bits.
template <class GradAt, class ParamAt>
Status OffloadEngine::Impl::update_slice(int u, double lr, std::int64_t step, float scale, GradAt grad_at,
                                         ParamAt param_at, char* ag_in) {
  const std::size_t uu = static_cast<std::size_t>(u);
  const std::uint64_t b = placement.units[uu].slice.begin, len = placement.units[uu].slice.len, off = placement.units[uu].slice_offset, w = half ? 2 : 4;
  for (int k : owned_of_unit[uu]) {
    const OwnedParam& o = owned[static_cast<std::size_t>(k)];
    const std::uint64_t a = o.grad_in_unit / 4;
    const std::uint64_t lo = std::max<std::uint64_t>(a, b), hi = std::min<std::uint64_t>(a + o.n, b + len);
    if (lo >= hi) continue;
    char* wp = param_at(o, lo);
    OptimizerBuffers ob;
    ob.master = half ? dmaster + off + (lo - b) : reinterpret_cast<float*>(wp);  // fp32: the weight is the master
    ob.grad = reinterpret_cast<char*>(grad_at(lo));
    ob.grad_dtype = DType::kF32;
    ob.exp_avg = dm + off + (lo - b);
    ob.exp_avg_sq = dv + off + (lo - b);
    ob.moment_dtype = DType::kF32;
    ob.param_out = half ? wp : nullptr;
    ob.out_dtype = wdtype;
    ob.n = hi - lo;
    STRATA_RETURN_IF_ERROR(device_opt->update(hyper_of(config.optimizer, lr, o.decay), step, scale, ob));
    if (ag_in != nullptr) std::memcpy(ag_in + (lo - b) * w, wp, ob.n * w);
  }
  return ok_status();
}

Status OffloadEngine::Impl::device_update_sharded(double lr, std::int64_t step) {
  if (!launch->is_cpu()) {
    return failed_precondition(
        "the sharded device optimizer (zero_optimization.stage >= 1 with the optimizer on the "
        "device) runs on the cpu backend only");
  }
  const double loss_scale = loss_scale_now;
  return launch->run(
      "optimizer step (sharded)", [this, lr, step, loss_scale](const kernels::KernelContext&) -> Status {
        const std::uint64_t P = static_cast<std::uint64_t>(dp_size), w = half ? 2 : 4;
        const std::uint64_t cmax = placement.slices.max_chunk;
        float* rs_in = reinterpret_cast<float*>(dev_staging);  // P x chunk (stage 1)
        float* rs_out = rs_in + P * cmax;                      // chunk (stage 1)
        // chunk, working dtype (stages 2-3: the staging holds only the all-gather's part)
        char* ag_in = placement.sharding.device_grads_sharded ? dev_staging : reinterpret_cast<char*>(rs_out + cmax);
        char* ag_out = ag_in + w * cmax;                       // P x chunk
        const auto inv_scale = static_cast<float>(1.0 / loss_scale);
        // 1. Each unit's gradients reduce-scattered; this rank's slice is written back in place (the
        //    rest of the unit's gradient buffer is not read again this step).
        std::vector<GradStats>& stats = shard_stats;
        for (int u = 0; u < M; ++u) {
          stats[static_cast<std::size_t>(u)] = GradStats{};
          const std::size_t uu = static_cast<std::size_t>(u);
          const std::uint64_t n = placement.units[uu].grad_bytes / 4, c = placement.units[uu].slice.chunk, b = placement.units[uu].slice.begin,
                              len = placement.units[uu].slice.len;
          if (n == 0) continue;  // the same on every rank
          if (placement.sharding.device_grads_sharded) {
            // Stage >= 2: reduced per bucket during backward (drain_buckets ran before this).
            float* slice = dgrads + placement.units[uu].slice_offset;
            if (u == placement.stage.tied_unit && pp_tied) {
              // Pipeline: GPT-2's embedding unit, its slice summed between the first and the
              // last stage once every micro-batch's reduction has been added (the host tier's
              // sum_tied_landed on its stage-2 shard; stage 1's below).
              STRATA_RETURN_IF_ERROR(reduce_tied_grads(slice, len));
            }
            STRATA_ASSIGN_OR_RETURN(stats[uu], scan_norm(*device_opt, u, reinterpret_cast<const char*>(slice),
                                                         b, len, inv_scale));
            continue;
          }
          float* g = reinterpret_cast<float*>(reinterpret_cast<char*>(dgrads) + grad_begin(u));
          std::memcpy(rs_in, g, n * 4);
          std::fill(rs_in + n, rs_in + P * c, 0.0f);
          STRATA_RETURN_IF_ERROR(
              dp_wait(dp_tracks[2], dp_params->reduce_scatter(rs_in, rs_out, c, DType::kF32, ReduceOp::kSum),
                      "reduce-scatter gradients", u, 4 * P * c));
          std::memcpy(g + b, rs_out, len * 4);
          if (u == placement.stage.tied_unit && pp_tied) {
            // Pipeline: GPT-2's embedding unit, held by the first and the last stage, summed
            // between them slice by slice after the data-parallel reduction (both ends hold the
            // same dp rank's slice), as the host tier sums its reduced slices (sum_tied_landed).
            STRATA_RETURN_IF_ERROR(reduce_tied_grads(g + b, len));
          }
          STRATA_ASSIGN_OR_RETURN(
              stats[uu], scan_norm(*device_opt, u, reinterpret_cast<const char*>(g + b), b, len, inv_scale));
        }
        // 2. Every rank's per-unit statistics, merged unit by unit in rank order: the same bits on
        //    every rank, and the host tier's merge.
        static_assert(sizeof(GradStats) % 4 == 0);
        std::vector<GradStats>& all = gathered_stats;
        STRATA_RETURN_IF_ERROR(
            dp_wait(dp_tracks[2],
                    dp_params->all_gather(stats.data(), all.data(), stats.size() * sizeof(GradStats) / 4,
                                          DType::kF32),
                    "gather gradient statistics", -1, all.size() * sizeof(GradStats)));
        GradStats total;
        if (pp_size > 1) {
          // Each unit over the data-parallel ranks, then over the stages in unit order, then (the
          // grid) over the tensor-parallel ranks: the host tier's merge order (worker_main).
          std::vector<GradStats> per_unit(static_cast<std::size_t>(M));
          for (int u = 0; u < M; ++u) {
            for (int r = 0; r < dp_size; ++r)
              per_unit[static_cast<std::size_t>(u)].merge(all[static_cast<std::size_t>(r * M + u)]);
          }
          STRATA_ASSIGN_OR_RETURN(total, merge_stage_stats(per_unit));
        } else {
          for (int u = 0; u < M; ++u) {
            for (int r = 0; r < dp_size; ++r) total.merge(all[static_cast<std::size_t>(r * M + u)]);
          }
        }
        if (tp_size > 1) {
          // Tensor parallel: scan_norm counted replicated parameters on tp rank 0 only. The model's
          // group, in this stream's order (after every rank's backward), as the unsharded device
          // update merges.
          STRATA_ASSIGN_OR_RETURN(total, merge_over_tp(total, *tp_model));
        }
        const double norm = total.norm();
        grad_norm = norm;
        if (!total.finite() && fp16) return ok_status();  // fp16 overflow: every rank skips the step
        if (!total.finite()) {
          return invalid_argument("step " + std::to_string(step) + ": the gradient norm is not finite (" +
                                  std::to_string(norm) + "); lower the learning rate or enable clipping");
        }
        const float scale = update_scale(norm, loss_scale);
        // 3. Per unit in forward order: this rank's slice updated in place (master, moments, and the
        //    working copy's elements), its working elements all-gathered into every rank's copy.
        //    Stage 3 in device memory: a sliced unit's working copy is the slice itself (element e
        //    at (e - b) * w), written in place and not gathered (the next fetch gathers it).
        for (int u = 0; u < M; ++u) {
          const std::size_t uu = static_cast<std::size_t>(u);
          const std::uint64_t c = placement.units[uu].slice.chunk, b = placement.units[uu].slice.begin, off = placement.units[uu].slice_offset;
          if (placement.units[uu].grad_bytes == 0) continue;
          char* unit_params = resident + placement.units[uu].resident_offset;
          const bool slice_only = placement.units[uu].slice_at_home != 0;
          std::memset(ag_in, 0, c * w);
          STRATA_RETURN_IF_ERROR(update_slice(
              u, lr, step, scale,
              [&](std::uint64_t lo) {
                return placement.sharding.device_grads_sharded ? dgrads + off + (lo - b)
                                    : reinterpret_cast<float*>(reinterpret_cast<char*>(dgrads) + grad_begin(u)) + lo;
              },
              [&](const OwnedParam& o, std::uint64_t lo) {
                return slice_only ? unit_params + (lo - b) * w
                                  : unit_params + o.param_in_unit + (lo - o.grad_in_unit / 4) * w;
              },
              slice_only ? nullptr : ag_in));
          if (slice_only) continue;  // the same units on every rank: the same collectives
          // Moves bits: fp16 travels as 16-bit words.
          STRATA_RETURN_IF_ERROR(dp_wait(
              dp_tracks[2], dp_params->all_gather(ag_in, ag_out, c, half ? DType::kBF16 : DType::kF32),
              "gather parameters", u, P * c * w));
          from_elements(u, ag_out, unit_params);
        }
        return ok_status();
      });
}

Status OffloadEngine::Impl::scan_device_units() {
  const auto inv_scale = static_cast<float>(1.0 / loss_scale_now);
  if (placement.sharding.split_state_sharded) {
    // This rank's reduced slice of each device unit, with the host shard's call (on_landed's
    // scan_norm from the slice's first element): ratio 1's statistics of the same slices.
    return launch->run("gradient scan (device modules, this rank's slices)",
                       [this, inv_scale](const kernels::KernelContext&) -> Status {
                         for (int u : placement.stage.device_units) {
                           const std::size_t uu = static_cast<std::size_t>(u);
                           STRATA_ASSIGN_OR_RETURN(
                               dev_stats[uu],
                               scan_norm(*device_opt, u, reinterpret_cast<const char*>(dev_slice_grads(u)),
                                         placement.units[uu].slice.begin, placement.units[uu].slice.len, inv_scale));
                         }
                         return ok_status();
                       });
  }
  if (launch->is_cpu()) {
    // The same per-unit scan as the host optimizer's (scan_norm: with tensor parallelism the
    // replicated parameters on tp rank 0 only, as on_landed counts them): the same bits.
    return launch->run("gradient scan (device modules)", [this, inv_scale](const kernels::KernelContext&) -> Status {
      for (int u : placement.stage.device_units) {
        const std::size_t uu = static_cast<std::size_t>(u);
        STRATA_ASSIGN_OR_RETURN(dev_stats[uu],
                                scan_norm(*device_opt, u, reinterpret_cast<const char*>(dgrads) + grad_begin(u), 0,
                                          placement.units[uu].grad_bytes / 4, inv_scale));
      }
      return ok_status();
    });
  }
  // cuda: one sum of squares per unit, read back in turn (not bitwise with the cpu scan).
  auto* partials = static_cast<double*>(cuda_partials.data());
  void* cs = compute->native_handle();
  for (int u : placement.stage.device_units) {
    const std::size_t n = placement.units[static_cast<std::size_t>(u)].grad_bytes / 4;
    double* result = partials + detail::sum_of_squares_cuda_partials(n);
    const auto* g = reinterpret_cast<const float*>(reinterpret_cast<const char*>(dgrads) + grad_begin(u));
    STRATA_RETURN_IF_ERROR(detail::sum_of_squares_cuda(cs, g, n, partials, result));
    STRATA_RETURN_IF_ERROR(compute->copy_async(pinned_norm.data(), result, sizeof(double), CopyKind::kDeviceToHost));
    STRATA_RETURN_IF_ERROR(compute->synchronize());
    GradStats& st = dev_stats[static_cast<std::size_t>(u)];
    st.sum_of_squares = *static_cast<double*>(pinned_norm.data()) * static_cast<double>(inv_scale) * inv_scale;
    st.count = n;
  }
  return ok_status();
}

OptimizerBuffers OffloadEngine::Impl::device_buffers(const OwnedParam& o) const {
  OptimizerBuffers b;
  char* wp = resident + placement.units[static_cast<std::size_t>(o.unit)].resident_offset + o.param_in_unit;
  b.master = half ? reinterpret_cast<float*>(reinterpret_cast<char*>(dmaster) + o.grad_offset)
                  : reinterpret_cast<float*>(wp);
  b.grad = reinterpret_cast<char*>(dgrads) + o.grad_offset;
  b.grad_dtype = DType::kF32;
  b.exp_avg = reinterpret_cast<char*>(dm) + o.grad_offset;
  b.exp_avg_sq = reinterpret_cast<char*>(dv) + o.grad_offset;
  b.moment_dtype = DType::kF32;
  b.param_out = half ? wp : nullptr;
  b.out_dtype = wdtype;
  b.n = o.n;
  return b;
}

Status OffloadEngine::Impl::zero_device_grads(int chunk) {
  if (chunk < 0 || chunks == 1) return compute->memset_async(dgrads, 0, placement.sizes.device_opt_bytes);
  for (int u : placement.stage.device_units_of_chunk[static_cast<std::size_t>(chunk)]) {
    STRATA_RETURN_IF_ERROR(compute->memset_async(reinterpret_cast<char*>(dgrads) + grad_begin(u), 0,
                                                 placement.units[static_cast<std::size_t>(u)].grad_bytes));
  }
  return ok_status();
}

Status OffloadEngine::Impl::reduce_device_units(bool accumulate, int chunk) {
  if (!launch->is_cpu()) {
    return failed_precondition(
        "partial optimizer offload with data parallelism reduces the device modules' gradients on the cpu "
        "backend only");
  }
  const std::vector<int>* which =
      chunk < 0 ? &placement.stage.device_units : &placement.stage.device_units_of_chunk[static_cast<std::size_t>(chunk)];
  if (which->empty()) return ok_status();  // the same on every rank of the group: the same collectives
  return launch->run(
      "data-parallel reduce-scatter (device modules)",
      [this, accumulate, which](const kernels::KernelContext&) -> Status {
        const std::uint64_t P = static_cast<std::uint64_t>(dp_size);
        float* rs_in = reinterpret_cast<float*>(dev_staging);  // P x chunk
        float* rs_out = rs_in + P * placement.slices.dev_max_chunk;      // chunk
        for (int u : *which) {
          const std::size_t uu = static_cast<std::size_t>(u);
          const std::uint64_t n = placement.units[uu].grad_bytes / 4, c = placement.units[uu].slice.chunk, len = placement.units[uu].slice.len;
          if (n == 0) continue;  // the same on every rank
          // The gradient stream's reduce_unit_grads at ratio 1: the unit padded with zeros to
          // P x chunk, the same call and count, so the same bits.
          float* g = reinterpret_cast<float*>(reinterpret_cast<char*>(dgrads) + grad_begin(u));
          std::memcpy(rs_in, g, n * 4);
          std::fill(rs_in + n, rs_in + P * c, 0.0f);
          STRATA_RETURN_IF_ERROR(
              dp_wait(dp_tracks[3], dp_device->reduce_scatter(rs_in, rs_out, c, DType::kF32, ReduceOp::kSum),
                      "reduce-scatter gradients", u, 4 * P * c));
          // Stage 1: the slice goes back in place (the rest of the unit is not read again this
          // step); stage 2: the slices of the micro-batches add up as ratio 1's shard does.
          float* dst = dev_slice_grads(u);
          if (accumulate) {
            for (std::uint64_t i = 0; i < len; ++i) dst[i] += rs_out[i];
          } else {
            std::memcpy(dst, rs_out, len * 4);
          }
        }
        return ok_status();
      });
}

// The device_update_sharded update for the device units (the same per-parameter cuts of the slice,
// the same kernels, so the bits of ratio 1's host update of the slice), the gradients read from
// dev_slice_grads.
Status OffloadEngine::Impl::update_device_units_sharded(double lr, std::int64_t step, float scale) {
  return launch->run(
      "optimizer step (device modules, this rank's slices)",
      [this, lr, step, scale](const kernels::KernelContext&) -> Status {
        const std::uint64_t P = static_cast<std::uint64_t>(dp_size), w = half ? 2 : 4;
        const std::uint64_t cmax = placement.slices.dev_max_chunk;
        char* ag_in = reinterpret_cast<char*>(reinterpret_cast<float*>(dev_staging) + (P + 1) * cmax);  // chunk
        char* ag_out = ag_in + w * cmax;                                                                 // P x chunk
        for (int u : placement.stage.device_units) {
          const std::size_t uu = static_cast<std::size_t>(u);
          const std::uint64_t c = placement.units[uu].slice.chunk, b = placement.units[uu].slice.begin;
          if (placement.units[uu].grad_bytes == 0) continue;
          char* unit_params = resident + placement.units[uu].resident_offset;
          const float* grads = dev_slice_grads(u);
          std::memset(ag_in, 0, c * w);
          STRATA_RETURN_IF_ERROR(update_slice(
              u, lr, step, scale, [&](std::uint64_t lo) { return const_cast<float*>(grads + (lo - b)); },
              [&](const OwnedParam& o, std::uint64_t lo) {
                return unit_params + o.param_in_unit + (lo - o.grad_in_unit / 4) * w;
              },
              ag_in));
          // Moves bits: fp16 travels as 16-bit words.
          STRATA_RETURN_IF_ERROR(
              dp_wait(dp_tracks[3], dp_device->all_gather(ag_in, ag_out, c, half ? DType::kBF16 : DType::kF32),
                      "gather parameters", u, P * c * w));
          from_elements(u, ag_out, unit_params);
        }
        return ok_status();
      });
}

Status OffloadEngine::Impl::update_device_units(double lr, std::int64_t step, float scale) {
  if (placement.sharding.split_state_sharded) return update_device_units_sharded(lr, step, scale);
  if (launch->is_cpu()) {
    struct P {
      OptimizerBuffers b;
      bool decay;
    };
    std::vector<P> params;
    for (const OwnedParam& o : owned) {
      if (!placement.split_device(o.unit)) continue;
      const OptimizerBuffers b = device_buffers(o);
      params.push_back(P{b, o.decay});
    }
    const CpuOptimizer* opt = &*device_opt;
    const OptimizerSettings os = config.optimizer;
    return launch->run("optimizer step (device modules)",
                       [params, opt, os, lr, step, scale](const kernels::KernelContext&) -> Status {
                         for (const P& p : params) {
                           STRATA_RETURN_IF_ERROR(opt->update(hyper_of(os, lr, p.decay), step, scale, p.b));
                         }
                         return ok_status();
                       });
  }
  std::vector<DeviceAdamTensor> group[2];  // [0]: no decay, [1]: decay
  for (const OwnedParam& o : owned) {
    if (!placement.split_device(o.unit)) continue;
    char* wp = resident + placement.units[static_cast<std::size_t>(o.unit)].resident_offset + o.param_in_unit;
    DeviceAdamTensor x;
    x.master = half ? reinterpret_cast<float*>(reinterpret_cast<char*>(dmaster) + o.grad_offset) : reinterpret_cast<float*>(wp);
    x.param = half ? static_cast<void*>(wp) : static_cast<void*>(x.master);
    x.grad = reinterpret_cast<const float*>(reinterpret_cast<char*>(dgrads) + o.grad_offset);
    x.exp_avg = reinterpret_cast<float*>(reinterpret_cast<char*>(dm) + o.grad_offset);
    x.exp_avg_sq = reinterpret_cast<float*>(reinterpret_cast<char*>(dv) + o.grad_offset);
    x.n = o.n;
    group[o.decay ? 1 : 0].push_back(x);
  }
  void* cs = compute->native_handle();
  for (int decay = 0; decay < 2; ++decay) {
    if (group[decay].empty()) continue;
    STRATA_RETURN_IF_ERROR(fused_adam_cuda(group[decay], wdtype, DType::kF32,
                                           hyper_of(config.optimizer, lr, decay == 1), step, scale, cs));
  }
  return ok_status();
}

// ---- OffloadEngine ----------------------------------------------------------------------------

OffloadEngine::OffloadEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

OffloadEngine::~OffloadEngine() {
  if (!impl_) return;
  impl_->stop_worker();
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
  return create_with_faults(config, settings, device, compute, data_parallel, tensor_parallel, pipeline, nullptr);
}

Result<std::unique_ptr<OffloadEngine>> offload_detail::EngineFaults::create(
    const TrainerConfig& config, const OffloadSettings& settings, Device& device,
    const nvme_detail::IoFaults* faults, Comm* pipeline, Comm* data_parallel, Comm* tensor_parallel) {
  return OffloadEngine::create_with_faults(config, settings, device, nullptr, data_parallel, tensor_parallel,
                                           pipeline, faults);
}

void offload_detail::EngineFaults::fail_state_downloads(OffloadEngine& engine, Status fault) {
  engine.impl_->stager->set_download_fault(std::move(fault));
}

void offload_detail::EngineFaults::fail_next_pass(OffloadEngine& engine, Status fault) {
  engine.impl_->injected_pass_error = std::move(fault);
}

void offload_detail::EngineFaults::hold_update_until_forward(OffloadEngine& engine, int held_module,
                                                             int forward_module) {
  OffloadEngine::Impl& t = *engine.impl_;
  std::lock_guard<std::mutex> lock(t.mu);
  t.hold_forward = forward_module;
  t.held_unit = t.placement.units[static_cast<std::size_t>(held_module)].reads.front();
}

void offload_detail::EngineFaults::fail_compute_at(OffloadEngine& engine, int module, Status fault) {
  engine.impl_->injected_compute_module = module;
  engine.impl_->injected_compute_error = std::move(fault);
}

void offload_detail::EngineFaults::fail_caller_at(OffloadEngine& engine, int module, Status fault) {
  engine.impl_->injected_caller_module = module;
  engine.impl_->injected_caller_error = std::move(fault);
}

void offload_detail::EngineFaults::hide_weights_file(OffloadEngine& engine, bool on) {
  engine.impl_->hide_weights_file = on;
}

void offload_detail::EngineFaults::gather_weights_on_save(OffloadEngine& engine, bool on) {
  engine.impl_->gather_weights_on_save = on;
}

void offload_detail::EngineFaults::kill_during_save(OffloadEngine& engine, std::uint64_t writes) {
  engine.impl_->kill_after_weights_writes = writes;
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
    return invalid_argument("tensor parallel on the cuda backend" + ranks +
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
                            " is not a multiple of " + tp + " (each rank keeps 1/tensor_parallel_size of the token rows)");
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
    return invalid_argument("zero_optimization.offload_optimizer.ratio = " + std::to_string(s.optimizer_ratio) +
                            " with " + ranks + " on the " + std::string(device.info().name) +
                            " device is not built yet (the device modules' collectives run on the cpu backend "
                            "only); use ratio 1 or the cpu device");
  }
  // The optimizer on the device reduces device buffers; the host optimizer reduces host buffers.
  const bool device_buffers = s.optimizer == Tier::kDevice && device.info().kind == DeviceKind::kCuda;
  const CommBackend want = device_buffers ? CommBackend::kNccl : CommBackend::kMpi;
  if (dp.backend() != want) {
    return invalid_argument("data-parallel group '" + dp.name() + "' uses the " + std::string(to_string(dp.backend())) +
                            " backend, but this placement reduces " + (device_buffers ? "device" : "host") +
                            " buffers: it needs " + std::string(to_string(want)));
  }
  return ok_status();
}

// What pipeline parallelism supports today (docs/parallel.md "Pipeline parallel"); the errors
// say what to use instead.
Status check_pipeline(Device& device, const Comm& pp) {
  const std::string stages = std::to_string(pp.size()) + " pipeline stages";
  if (device.info().kind != DeviceKind::kCpu) {
    return invalid_argument(stages + " on the " + std::string(device.info().name) +
                            " device: the pipeline runs on the cpu device backend so far (its boundary tensors go "
                            "over the mpi backend); use --device cpu");
  }
  if (pp.backend() != CommBackend::kMpi) {
    return invalid_argument("pipeline group '" + pp.name() + "' uses the " + std::string(to_string(pp.backend())) +
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

Result<std::unique_ptr<OffloadEngine>> OffloadEngine::create_with_faults(const TrainerConfig& config,
                                                                         const OffloadSettings& settings_in,
                                                                         Device& device, Stream* compute,
                                                                         Comm* data_parallel,
                                                                         Comm* tensor_parallel, Comm* pipeline,
                                                                         const nvme_detail::IoFaults* faults) {
  OffloadSettings settings = settings_in;
  if (data_parallel != nullptr) settings.dp_size = data_parallel->size();
  if (tensor_parallel != nullptr) settings.tp_size = tensor_parallel->size();
  const int pp_size = pipeline != nullptr ? pipeline->size() : 1;
  if (settings.tp_size > 1) {
    if (tensor_parallel == nullptr) {
      return invalid_argument("offload settings: tp_size = " + std::to_string(settings.tp_size) +
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
  impl->dp = data_parallel;
  impl->tp = tensor_parallel;
  impl->pp = pp_size > 1 ? pipeline : nullptr;
  impl->pp_size = pp_size;
  impl->pp_rank = pp_size > 1 ? pipeline->rank() : 0;
  impl->plan = std::move(plan);
  impl->device = &device;
  impl->compute = compute;
  impl->io_faults = faults;
  std::unique_ptr<OffloadEngine> engine(new OffloadEngine(std::move(impl)));
  STRATA_RETURN_IF_ERROR(engine->impl_->setup());
  return engine;
}

Status offload_detail::EngineFaults::set_working_param(OffloadEngine& engine, int index,
                                                      std::span<const float> values) {
  return engine.impl_->write_values(index, values, /*master_too=*/false);
}

const OffloadPlan& OffloadEngine::plan() const { return impl_->plan; }
const OffloadSettings& OffloadEngine::settings() const { return impl_->settings; }
const TrainerConfig& OffloadEngine::config() const { return impl_->config; }
Model& OffloadEngine::model() { return *impl_->model; }
std::int64_t OffloadEngine::steps_done() const { return impl_->steps; }

std::string OffloadEngine::optimizer_name() const {
  const Impl& t = *impl_;
  if (!t.placement.sharding.optimizer_on_device) {
    return std::string("CPU AdamW (") + std::string(to_string(t.host_opt->isa())) + ", " +
           std::to_string(t.host_opt->threads()) + " host threads) over " + std::string(to_string(t.settings.optimizer)) +
           "-tier state";
  }
  if (t.launch->is_cpu()) {
    return std::string("CPU AdamW (") + std::string(to_string(t.device_opt->isa())) + ") on the device's compute threads";
  }
  return "fused AdamW on the GPU (fused_adam_cuda)";
}

Result<StepMetrics> OffloadEngine::step(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets) {
  auto r = step_once(inputs, targets);
  if (!r.ok()) impl_->note_reported();  // the next call retries a failed update (recover)
  return r;
}

Result<StepMetrics> OffloadEngine::step_once(std::span<const std::int32_t> inputs,
                                             std::span<const std::int32_t> targets) {
  Impl& t = *impl_;
  // A failed update of an earlier step is reported, or finished in place (FailedUpdate).
  STRATA_RETURN_IF_ERROR(t.recover());
  detail::HostSpan step_span(t.tracer, t.track.caller, TraceCounter::kNone, "step");
  const auto start = std::chrono::steady_clock::now();
  StepMetrics m;
  m.step = t.steps + 1;
  // Skipped fp16 steps advance neither the optimizer's update number nor the schedule.
  const std::int64_t applied = t.steps - t.skipped_steps();
  m.lr = t.config.schedule.at(applied);
  m.loss_scale = t.scaler ? t.scaler->scale() : 1.0;
  t.opt_step_now = applied + 1;
  t.loss_scale_now = m.loss_scale;
  // Delayed update: the update of a warm-up step (the first delayed_update_warmup) is seen by
  // the next step, like a flush (synchronize, a checkpoint, an evaluation).
  // A step every rank failed before its update runs again at the same parameters on every rank:
  // a rank whose failed call skipped the publish its peers made catches up first.
  if (t.delayed && t.pending_publish > 0 &&
      (t.pending_publish <= t.settings.delayed_update_warmup || t.publish_before_rerun)) {
    STRATA_RETURN_IF_ERROR(t.publish_delayed());
  }
  Status s = t.run_micro_batches(inputs, targets, t.config.grad_accum, true, m.step, m.lr);
  if (s.ok() && t.placement.sharding.optimizer_split) s = t.scan_device_units();
  if (t.placement.sharding.optimizer_on_device) {
    // Gradient buckets (stage 0 and stage >= 2 on the cpu backend, with or without a pipeline;
    // each tp rank's shard): their collectives were launched during backward; every
    // one is waited (and stage >= 2's slices complete) before the update.
    if (s.ok() && t.placement.sharding.device_grads_bucketed)
      s = t.compute->host_fn("offload: wait for the gradient buckets", [&t]() { return t.drain_buckets(); });
    // Stage 1: the device update reduce-scatters the gradients itself; stage 0 without buckets
    // (cuda): one all-reduce after backward.
    if (s.ok() && t.dp_size > 1 && !t.placement.sharding.device_state_sharded && !t.placement.sharding.device_grads_bucketed) s = t.all_reduce_device_grads();
    // Pipeline: the tied embedding's gradient of the first and last stage (sharded: its reduced
    // slices, summed inside device_update_sharded).
    if (s.ok() && t.pp_tied && !t.placement.sharding.device_state_sharded) {
      s = t.compute->synchronize();
      if (s.ok())
        s = t.reduce_tied_grads(reinterpret_cast<float*>(reinterpret_cast<char*>(t.dgrads) + t.grad_begin(t.placement.stage.tied_unit)),
                                t.placement.units[static_cast<std::size_t>(t.placement.stage.tied_unit)].grad_bytes / 4);
    }
    // Stage 3 in device memory: every fetch (a prefetch the pass did not use included) has read
    // its slice before the update rewrites the slices, and a failed fetch fails the step here.
    if (s.ok() && t.placement.sharding.device_params_sliced) s = t.h2d->synchronize();
    if (s.ok()) s = t.tracer.stream_begin(*t.compute, t.track.compute);
    if (s.ok()) s = t.device_update(m.lr, t.opt_step_now);
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
    if (s.ok()) s = t.take_grad_io_error();
    if (s.ok() && !t.injected_pass_error.ok()) s = std::exchange(t.injected_pass_error, ok_status());
    // Delayed update: compute is done with the parameters of this step; the previous step's
    // update (which this step did not see) goes to the device now, before this step's update
    // may rewrite the host copy it is uploaded from (await_upload).
    if (s.ok() && t.delayed) s = t.publish_delayed();
    {
      std::lock_guard<std::mutex> lock(t.mu);
      t.commands.push_back(Impl::Command{s.ok() ? Impl::Command::kFinish : Impl::Command::kAbort, -1, m.step, m.lr,
                                         t.opt_step_now, t.loss_scale_now});
      // Several processes: the optimizer thread agrees on the failure with the other ranks,
      // which wait for this rank's statistics (agree_before_norm).
      // Not after an agreed failure of an earlier update (every rank's call failed on it alike
      // and the optimizer thread skips the kAbort).
      if (!s.ok() && t.agree_before_norm() && t.worker_error.ok()) t.abort_error = s;
    }
    t.cv.notify_all();
    if (!s.ok()) {
      // Let the optimizer thread drain this step's landed units before the caller retries.
      s = t.abandon_pass(s);
      t.drain_worker();
      if (t.agree_before_norm()) {
        std::lock_guard<std::mutex> lock(t.mu);
        const bool this_step = !t.worker_error.ok() && t.failed.cmd.step == m.step;
        // Every rank failed this step before its update (agreed): the peers whose pass went
        // through published the previous update, this call did not; the rerun publishes first.
        if (this_step && t.failed.phase == Impl::FailPhase::kBeforeUpdate && t.delayed &&
            t.pending_publish > 0)
          t.publish_before_rerun = true;
        // Agreed but not retryable (update_during_backward): the verdict every rank reports,
        // which names this rank's cause and what to do.
        if (this_step && t.failed.phase == Impl::FailPhase::kNone) return t.worker_error;
      }
      return s;
    }
    std::unique_lock<std::mutex> lock(t.mu);
    detail::HostSpan wait_span(t.tracer, t.track.caller, TraceCounter::kUpdateStall, "wait gradient norm");
    t.cv.wait(lock, [&] { return !t.worker_error.ok() || t.norm_step == m.step; });
    // Once the norm is known the step has happened; an error of its update (after the norm)
    // belongs to the update and surfaces at the next call.
    if (t.norm_step != m.step) return t.worker_error;
    t.grad_norm = t.norm_value;
    if (t.delayed) t.pending_publish = m.step;
    lock.unlock();
    // Partial offload: a finite norm applies the step on the device units too (an fp16 overflow
    // skips it everywhere; any other non-finite norm failed on the optimizer thread).
    if (t.placement.sharding.optimizer_split && std::isfinite(t.grad_norm)) {
      s = t.tracer.stream_begin(*t.compute, t.track.compute);
      if (s.ok()) s = t.update_device_units(m.lr, t.opt_step_now, t.update_scale(t.grad_norm, t.loss_scale_now));
      if (s.ok()) s = t.tracer.stream_end(*t.compute, t.track.compute, TraceCounter::kCompute, "optimizer step (device modules)", -1);
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
  if (t.dp_size > 1) {
    double sums[2] = {total.sum, static_cast<double>(total.count)};
    STRATA_RETURN_IF_ERROR(t.sum_over_ranks(sums));
    total.sum = sums[0];
    total.count = static_cast<std::int64_t>(sums[1]);
  }
  if (t.pp_size > 1) {
    // The last stage computed the losses; every stage reports them (its bits, moved as words).
    double sums[2] = {total.sum, static_cast<double>(total.count)};
    STRATA_RETURN_IF_ERROR(t.pp_caller->broadcast(sums, 4, DType::kF32, t.pp_size - 1)
                               .wait()
                               .with_context("pipeline: broadcast of the loss from the last stage"));
    total.sum = sums[0];
    total.count = static_cast<std::int64_t>(sums[1]);
  }
  t.steps += 1;
  if (!t.have_baseline) {
    // Not published: a delayed update stays delayed (its upload allocates nothing). An error of
    // the update is not this step's (its norm is known): the next call reports it, and the
    // baseline is taken after a later step.
    bool settled = true;
    for (int u = 0; u < t.M && settled; ++u) settled = t.wait_updated(u, /*report=*/false).ok();
    if (settled && !t.placement.sharding.optimizer_on_device) settled = t.h2d->synchronize().ok();
    if (settled) {
      t.alloc_baseline = t.allocation_count();
      t.have_baseline = true;
    }
  }
  // The next pass's first fetches, each gated on the h2d stream by its unit's update of this step.
  // The step has happened; a failure to enqueue them surfaces at the next call's first wait.
  if (Status early = t.prefetch_next_step(); !early.ok()) {
    STRATA_LOG(kWarn, kOffload) << "offload: early fetch for the next step not issued: " << early.to_string();
  }
  m.loss = total.sum / static_cast<double>(total.count);
  m.grad_norm = t.grad_norm;
  m.tokens = static_cast<std::int64_t>(inputs.size()) * t.dp_size;
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
    return failed_precondition("loss_and_gradients: with zero_optimization.stage " +
                               std::to_string(t.settings.zero_stage) + " and the optimizer on the device over " +
                               std::to_string(t.dp_size) +
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

Result<double> OffloadEngine::loss(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets) {
  Impl& t = *impl_;
  STRATA_RETURN_IF_ERROR(t.recover());
  if (t.delayed) STRATA_RETURN_IF_ERROR(t.wait_all_updates());  // evaluates the latest parameters
  if (t.pp_size > 1) STRATA_RETURN_IF_ERROR(t.model->select_slot(0));
  STRATA_RETURN_IF_ERROR(t.model->set_batch(inputs, targets, t.config.micro_batch, t.config.seq_len));
  Status s;
  if (t.pp_size > 1) {
    s = t.forward_stage();  // collective over the pipeline: every stage, the same batch
  } else {
    t.begin_pass();
    s = t.run_forward(false);
    if (s.ok()) s = t.end_pass();
  }
  if (s.ok()) s = t.model->copy_losses(0);
  if (s.ok()) s = t.compute->synchronize();
  if (s.ok()) s = t.h2d->synchronize();
  if (!s.ok()) return t.abandon_pass(s);
  const LossSum sum = t.model->loss_sum(0);
  // A stage before the last holds no losses (nan here): every stage returns the last stage's
  // value, its bits moved as words.
  double mean = sum.sum / static_cast<double>(sum.count);
  if (t.pp_size > 1) {
    STRATA_RETURN_IF_ERROR(t.pp_caller->broadcast(&mean, 2, DType::kF32, t.pp_size - 1)
                               .wait()
                               .with_context("pipeline: broadcast of the loss from the last stage"));
  }
  return mean;
}

Result<EvalResult> OffloadEngine::evaluate(std::span<const std::int32_t> tokens, std::int64_t max_windows) {
  Impl& t = *impl_;
  STRATA_RETURN_IF_ERROR(t.recover());
  if (t.delayed) STRATA_RETURN_IF_ERROR(t.wait_all_updates());  // evaluates the latest parameters
  auto forward = [&t]() -> Status {
    if (t.pp_size > 1) return t.forward_stage();  // every stage, every window batch, in order
    t.begin_pass();
    STRATA_RETURN_IF_ERROR(t.run_forward(false));
    return t.end_pass();
  };
  if (t.pp_size > 1) STRATA_RETURN_IF_ERROR(t.model->select_slot(0));
  detail::HostSpan span(t.tracer, t.track.caller, TraceCounter::kNone, "evaluate");
  auto r = detail::evaluate_windows_with(*t.model, tokens, t.config.seq_len, t.config.micro_batch, max_windows, forward);
  Status s = r.ok() ? t.h2d->synchronize() : r.status();
  if (!s.ok()) return t.abandon_pass(s);
  if (t.pp_size > 1) {
    // The last stage summed the losses (the others hold none): its result, moved as words.
    double v[2] = {r->loss, static_cast<double>(r->tokens)};
    STRATA_RETURN_IF_ERROR(t.pp_caller->broadcast(v, 4, DType::kF32, t.pp_size - 1)
                               .wait()
                               .with_context("pipeline: broadcast of the evaluation from the last stage"));
    return EvalResult{v[0], static_cast<std::int64_t>(v[1])};
  }
  return r;
}

Status OffloadEngine::synchronize() {
  Status s = impl_->wait_all_updates();
  if (!s.ok()) {
    impl_->note_reported();
    return s;
  }
  return impl_->device->synchronize();
}

Status OffloadEngine::set_param(int index, std::span<const float> values) { return impl_->write_full(index, values); }
Result<std::vector<float>> OffloadEngine::get_param(int index) { return impl_->read_full(index, 0); }
Result<std::vector<float>> OffloadEngine::get_master(int index) { return impl_->read_full(index, 1); }
Result<std::vector<float>> OffloadEngine::get_exp_avg(int index) { return impl_->read_full(index, 2); }
Result<std::vector<float>> OffloadEngine::get_exp_avg_sq(int index) { return impl_->read_full(index, 3); }

Status OffloadEngine::save_weights(const std::string& path, WeightFormat format) {
  Impl& t = *impl_;
  STRATA_RETURN_IF_ERROR(t.wait_all_updates());
  // Every rank writes its part, unless a test asked for the earlier path (the first rank
  // gathers everything and writes alone; EngineFaults::gather_weights_on_save, the reference of
  // the tests and of bench/weights_save.cpp).
  const bool gathered = t.gather_weights_on_save && t.pp_size == 1;
  if (!gathered && (t.pp_size > 1 || t.tp_size > 1 || t.dp_size > 1)) {
    STRATA_ASSIGN_OR_RETURN(const bool written, t.save_weights_parallel(path, format));
    if (written) return ok_status();
    // Not every rank sees the file system at the path: the gather path below.
  }
  if (t.tp_size > 1) {
    // Collective: every rank gathers every owning parameter in table order (over the tensor- and,
    // stage 3, the data-parallel group), then the first rank of both writes the full model, the
    // same file as one process saves.
    // A rank that cannot read a parameter takes part in read_full's exchange, so its group fails
    // that parameter together; the other data-parallel groups learn it in the exchange after the
    // reads: every rank returns the same error, none waits for a peer's gather until the timeout.
    STRATA_ASSIGN_OR_RETURN(ModelLayout full, describe_model(t.config.model));
    std::vector<std::vector<float>> values(full.params.size());
    Status read = [&]() -> Status {
      for (std::size_t i = 0; i < full.params.size(); ++i) {
        if (!full.params[i].owns_storage()) continue;
        STRATA_ASSIGN_OR_RETURN(values[i], t.read_full(static_cast<int>(i), 0));
      }
      return ok_status();
    }();
    if (t.dp_size > 1) read = t.agree_on_read(*t.dp_caller, read, "its part of the weights", "data-parallel");
    if (!read.ok()) return read.with_context("save_weights '" + path + "'");
    if (t.tp_rank != 0 || t.dp_rank != 0) return ok_status();
    return write_weights(full, path, format, t.config.model.dtype, [&](int index, std::vector<float>& out) {
      out = std::move(values[static_cast<std::size_t>(index)]);
      return ok_status();
    });
  }
  if (t.dp_size == 1) {
    return write_weights(t.layout(), path, format, t.config.model.dtype, [&](int index, std::vector<float>& values) {
      STRATA_ASSIGN_OR_RETURN(values, t.read_state(index, 0));
      return ok_status();
    });
  }
  // Data parallel: collective, rank 0 writes. Sharded parameters (stage 3) are gathered unit by
  // unit on every rank first (the whole model's working parameters, as DeepSpeed's
  // stage3_gather_16bit_weights_on_model_save does).
  // A rank that cannot read its slice still joins the unit's exchange (read_unit_params), so every
  // rank returns the same error at that unit.
  std::vector<std::vector<char>> units(static_cast<std::size_t>(t.M));
  for (int u = 0; u < t.M; ++u) {
    if (t.placement.units[static_cast<std::size_t>(u)].gathered_at_fetch) {
      STRATA_RETURN_IF_ERROR(t.read_unit_params(u, units[static_cast<std::size_t>(u)])
                                 .with_context("save_weights '" + path + "'"));
    }
  }
  if (t.dp_rank != 0) return ok_status();
  return write_weights(t.layout(), path, format, t.config.model.dtype, [&](int index, std::vector<float>& values) {
    const int k = t.owned_index(index);
    if (k < 0) return invalid_argument("save_weights: no parameter with index " + std::to_string(index));
    const OwnedParam& o = t.owned[static_cast<std::size_t>(k)];
    if (!t.placement.units[static_cast<std::size_t>(o.unit)].gathered_at_fetch) {
      STRATA_ASSIGN_OR_RETURN(values, t.read_state(index, 0));
      return ok_status();
    }
    const char* p = units[static_cast<std::size_t>(o.unit)].data() + o.param_in_unit;
    values.resize(o.n);
    if (t.half) {
      const auto* in = reinterpret_cast<const std::uint16_t*>(p);
      const bool f16 = t.wdtype == DType::kF16;
      for (std::size_t i = 0; i < o.n; ++i)
        values[i] = f16 ? kernels::f16_bits_to_f32(in[i]) : kernels::bf16_bits_to_f32(in[i]);
    } else {
      std::memcpy(values.data(), p, o.n * 4);
    }
    return ok_status();
  });
}

Status OffloadEngine::load_weights(const std::string& path) {
  Impl& t = *impl_;
  // A pipeline stage keeps the parameters it holds (both ends of the tied embedding read it).
  auto here = [&t](int index) { return t.pp_size == 1 || t.owned_index(index) >= 0; };
  if (t.tp_size > 1) {
    // Every rank reads the full file and keeps its shard of each parameter.
    STRATA_ASSIGN_OR_RETURN(ModelLayout full, describe_model(t.config.model));
    return read_weights(full, path, [&](int index, std::span<const float> values) {
      return here(index) ? t.write_full(index, values) : ok_status();
    });
  }
  return read_weights(t.layout(), path, [&](int index, std::span<const float> values) {
    return here(index) ? t.write_values(index, values, true) : ok_status();
  });
}

namespace {

// The safetensors dtype of the working parameters.
std::string working_tensor_dtype(DType d) { return d == DType::kBF16 ? "BF16" : d == DType::kF16 ? "F16" : "F32"; }

// fp16: the loss scaler's state rides in the checkpoint as one small F64 tensor, so a resumed
// run continues with the same scale, window position and hysteresis (and so the same bits).
constexpr const char* kScalerFile = "loss-scaler.safetensors";
constexpr const char* kScalerTensor = "loss_scaler";  // [scale, iteration, last overflow, hysteresis left, overflows]
constexpr std::int64_t kScalerFields = 5;

std::array<double, kScalerFields> scaler_fields(const LossScalerState& s) {
  return {s.scale, static_cast<double>(s.iteration), static_cast<double>(s.last_overflow_iteration),
          static_cast<double>(s.hysteresis_left), static_cast<double>(s.overflows)};
}

LossScalerState scaler_state(const std::array<double, kScalerFields>& f) {
  LossScalerState s;
  s.scale = f[0];
  s.iteration = static_cast<std::int64_t>(f[1]);
  s.last_overflow_iteration = static_cast<std::int64_t>(f[2]);
  s.hysteresis_left = static_cast<int>(f[3]);
  s.overflows = static_cast<std::int64_t>(f[4]);
  return s;
}

std::string module_file(int u) {
  char name[40];
  std::snprintf(name, sizeof name, "module-%04d.safetensors", u);
  return name;
}

// The first key whose value differs between two model configs, as "key: a vs b".
std::string config_difference(const std::string& saved, const std::string& current) {
  const auto a = nlohmann::json::parse(saved, nullptr, false);
  const auto b = nlohmann::json::parse(current, nullptr, false);
  if (a.is_discarded() || b.is_discarded() || !a.is_object() || !b.is_object()) return "unreadable config";
  for (auto it = b.begin(); it != b.end(); ++it) {
    if (!a.contains(it.key())) return it.key() + ": missing in the checkpoint";
    if (a[it.key()] != it.value()) return it.key() + ": checkpoint " + a[it.key()].dump() + ", this run " + it.value().dump();
  }
  for (auto it = a.begin(); it != a.end(); ++it) {
    if (!b.contains(it.key())) return it.key() + ": only in the checkpoint";
  }
  return "";
}

}  // namespace

// A checkpoint of a pipeline (docs/parallel.md "Saving and loading a pipeline"): the single
// process's files, each stage writing its own. The first stage's first rank (the writer) opens
// the checkpoint's temporary directory (publish_checkpoint) and broadcasts its path over its
// pipeline group, whose members are the stages' first ranks (the stage writers). Every stage then
// reads, in module order, the full state of the units it holds (collective over the stage's
// tensor- and data-parallel groups) and its first rank writes each unit's file (temporary name,
// fsync, rename) into that directory; the stage writers then agree (an all-gather over the
// pipeline group) that every stage's files are durable, or on the lowest failing stage's error.
// Only then does the writer checksum the files from disk and write the manifest, last; `latest`
// moves after that (publish_checkpoint), so a rank that dies mid-save leaves the previous
// checkpoint current (the writer's agreement fails, or the writer is gone and nothing is
// published). Every rank takes part in every collective even after a failure (no peer waits
// forever); the outcome is then broadcast to every rank.
Result<std::string> OffloadEngine::Impl::save_checkpoint_pp(const std::string& root,
                                                            const CheckpointManifest& manifest, int keep) {
  STRATA_ASSIGN_OR_RETURN(ModelLayout full, describe_model(config.model));
  const bool stage_writer = tp_rank == 0 && dp_rank == 0;
  const bool writer = stage_writer && pp_rank == 0;
  const std::uint64_t wsize = dtype_size(wdtype);
  const std::string working = working_tensor_dtype(wdtype);
  // Per unit, its owning parameters in table order: the order one process writes them in.
  std::vector<std::vector<int>> params_of(static_cast<std::size_t>(M));
  for (std::size_t i = 0; i < full.params.size(); ++i) {
    if (full.params[i].owns_storage())
      params_of[static_cast<std::size_t>(full.params[i].module)].push_back(static_cast<int>(i));
  }
  // A unit is gathered as, per parameter, [working copy | master | exp_avg | exp_avg_sq] of the
  // full parameter.
  auto unit_bytes = [&](int u) {
    std::uint64_t b = 0;
    for (int i : params_of[static_cast<std::size_t>(u)])
      b += static_cast<std::uint64_t>(full.params[static_cast<std::size_t>(i)].numel()) * (wsize + 12);
    return b;
  };
  std::vector<char> buf, pbytes;
  std::vector<float> blob;
  auto gather = [&](int u) -> Status {
    buf.assign(unit_bytes(u), 0);
    char* out = buf.data();
    if (tp_size == 1) {  // this rank's layout is the full one: owned_of_unit is params_of's order
      STRATA_RETURN_IF_ERROR(read_unit_state(u, pbytes, blob));
      const std::size_t n = placement.units[static_cast<std::size_t>(u)].grad_bytes / 4;
      for (int k : owned_of_unit[static_cast<std::size_t>(u)]) {
        const OwnedParam& o = owned[static_cast<std::size_t>(k)];
        std::memcpy(out, pbytes.data() + o.param_in_unit, o.n * wsize);
        out += o.n * wsize;
        for (std::size_t kind = 0; kind < 3; ++kind) {
          std::memcpy(out, blob.data() + kind * n + o.grad_in_unit / 4, o.n * 4);
          out += o.n * 4;
        }
      }
    } else {
      for (int i : params_of[static_cast<std::size_t>(u)]) {
        STRATA_ASSIGN_OR_RETURN(std::vector<float> v, read_full(i, 0));
        STRATA_RETURN_IF_ERROR(convert(v.data(), DType::kF32, out, wdtype, v.size()));
        out += v.size() * wsize;
        for (int which = 1; which <= 3; ++which) {
          STRATA_ASSIGN_OR_RETURN(v, read_full(i, which));
          std::memcpy(out, v.data(), v.size() * 4);
          out += v.size() * 4;
        }
      }
    }
    if (out != buf.data() + buf.size()) return internal_error("pipeline checkpoint: unit size");
    return ok_status();
  };
  const std::string stage_name = "pipeline stage " + std::to_string(pp_rank);
  // Every rank: its stage's units in module order, each gathered over the stage's groups
  // (collective, so every unit even after a failure: no peer waits for a rank that stopped); the
  // stage's first rank writes each unit's file into `dir` (empty: the save already failed, only
  // the gathers run). The first rank of the first stage also writes the loss scaler's file.
  // Returns this rank's first failure, naming the stage.
  auto write_stage = [&](const std::string& dir) -> Status {
    Status first;
    for (int u = 0; u < M; ++u) {
      const auto& mine = params_of[static_cast<std::size_t>(u)];
      if (mine.empty() || holder(u) != pp_rank) continue;
      Status g = gather(u);
      if (!g.ok()) {
        if (first.ok()) {
          first = Status(g.code(), stage_name + " could not read module " + std::to_string(u) +
                                       "'s state: " + g.message());
        }
        continue;
      }
      if (!stage_writer || dir.empty() || !first.ok()) continue;
      SafetensorsWriter w;  // points into buf until written
      const char* in = buf.data();
      for (int i : mine) {
        const ParamDesc& p = full.params[static_cast<std::size_t>(i)];
        const auto n = static_cast<std::uint64_t>(p.numel());
        Status added = w.add("param/" + p.name, working, p.shape, in, n * wsize);
        in += n * wsize;
        for (const char* kind : {"master/", "exp_avg/", "exp_avg_sq/"}) {
          if (added.ok()) added = w.add(kind + p.name, "F32", p.shape, in, n * 4);
          in += n * 4;
        }
        if (!added.ok()) first = added;
      }
      w.set_metadata("module", full.modules[static_cast<std::size_t>(u)].name);
      if (first.ok()) first = write_checkpoint_file(w, dir + "/" + module_file(u));
      if (!first.ok())
        first = Status(first.code(), stage_name + " could not write its part: " + first.message());
    }
    if (writer && scaler && first.ok() && !dir.empty()) {  // every stage holds the same scaler state
      const std::array<double, kScalerFields> fields = scaler_fields(scaler->state());
      SafetensorsWriter w;
      first = w.add(kScalerTensor, "F64", {kScalerFields}, fields.data(), sizeof fields);
      if (first.ok()) first = write_checkpoint_file(w, dir + "/" + kScalerFile);
    }
    return first;
  };
  // Stage writers (the pp group of world rank 0): the writer's temporary directory, as 4-byte
  // words (1 and the path; 0: no directory, the save failed before its files).
  constexpr std::size_t kWords = 1 + 256;
  auto share_dir = [&](const std::string& dir) -> Result<std::string> {
    std::array<std::uint32_t, kWords> word{};
    if (writer && !dir.empty() && dir.size() < 4 * (kWords - 1)) {
      word[0] = 1;
      std::memcpy(word.data() + 1, dir.data(), dir.size());
    }
    STRATA_RETURN_IF_ERROR(pp_caller->broadcast(word.data(), kWords, DType::kF32, 0)
                               .wait()
                               .with_context("checkpoint: sharing the temporary directory"));
    if (word[0] != 1) return std::string();
    return std::string(reinterpret_cast<const char*>(word.data() + 1));
  };
  // Stage writers: the agreement that every stage's files are durable (each file was fsync'd and
  // renamed into place before its writer got here), or the lowest failing stage's error on all.
  auto agree = [&](const Status& mine) {
    return agree_on_read(*pp_caller, mine, "its part of the checkpoint", "pipeline stage", "write");
  };
  Status local;  // this rank's first failure in its part
  Result<std::string> published = std::string();
  if (writer) {
    bool shared = false;
    published = publish_checkpoint(
        root, manifest, keep, [&](const std::string& dir, std::vector<std::string>* names) {
          shared = true;
          Result<std::string> got = share_dir(dir);
          local = write_stage(got.ok() ? *got : std::string());
          Status all = agree(got.ok() ? local : got.status());
          if (got.ok() && got->empty()) {
            return invalid_argument("checkpoint: the temporary directory's path '" + dir +
                                    "' is longer than " + std::to_string(4 * (kWords - 1) - 1) + " bytes");
          }
          STRATA_RETURN_IF_ERROR(got.status());
          STRATA_RETURN_IF_ERROR(all);
          // The names one process lists, in its order: modules, then the scaler.
          for (int u = 0; u < M; ++u) {
            if (!params_of[static_cast<std::size_t>(u)].empty()) names->push_back(module_file(u));
          }
          if (scaler) names->push_back(kScalerFile);
          return ok_status();
        });
    if (!shared) {  // publishing failed before the files: the stages still meet in every collective
      Result<std::string> got = share_dir(std::string());
      local = write_stage(std::string());
      (void)agree(got.ok() ? local : got.status());
    }
  } else if (stage_writer) {
    Result<std::string> got = share_dir(std::string());
    local = write_stage(got.ok() ? *got : std::string());
    Status all = agree(got.ok() ? local : got.status());
    if (local.ok()) local = got.ok() ? ok_status() : got.status();
    (void)all;  // another stage's failure reaches this rank in the outcome below
  } else {
    local = write_stage(std::string());
  }
  // The outcome, as 4-byte words: 1 and the published directory, or 0, the status code and the
  // first bytes of the writer's error (so every rank returns the same error, naming the stage
  // that failed); from the writer over its tensor-parallel group, then over the first stage's
  // data-parallel groups, then from the first stage over every pipeline group.
  std::array<std::uint32_t, kWords> word{};
  if (writer && published.ok() && published->size() < 4 * (kWords - 1)) {
    word[0] = 1;
    std::memcpy(word.data() + 1, published->data(), published->size());
  } else if (writer && !published.ok()) {
    const std::string& m = published.status().message();
    word[1] = static_cast<std::uint32_t>(published.status().code());
    std::memcpy(word.data() + 2, m.data(), std::min<std::size_t>(m.size(), 4 * (kWords - 2) - 1));
  }
  Status b;
  if (tp_size > 1) b = tp_step->broadcast(word.data(), kWords, DType::kF32, 0).wait();
  if (b.ok() && dp_size > 1) {
    b = dp_wait(dp_tracks[0], dp_caller->broadcast(word.data(), kWords, DType::kF32, 0), "checkpoint outcome",
                -1, 4 * kWords);
  }
  if (b.ok()) b = pp_caller->broadcast(word.data(), kWords, DType::kF32, 0).wait();
  if (writer) return published;
  STRATA_RETURN_IF_ERROR(b.with_context("checkpoint: broadcast of the outcome"));
  if (word[0] != 1) {
    const char* text = reinterpret_cast<const char*>(word.data() + 2);
    const std::string why(text, strnlen(text, 4 * (kWords - 2)));
    if (why.empty()) {
      STRATA_RETURN_IF_ERROR(local);
      return io_error(
          "checkpoint under '" + root +
          "': the first rank of the first pipeline stage, which publishes it, failed (its log says why)");
    }
    const auto code = word[1] == 0 || word[1] > static_cast<std::uint32_t>(StatusCode::kCancelled)
                          ? StatusCode::kIoError
                          : static_cast<StatusCode>(word[1]);
    return Status(code, why);
  }
  STRATA_RETURN_IF_ERROR(local);
  return std::string(reinterpret_cast<const char*>(word.data() + 1));
}

Result<std::string> OffloadEngine::save_checkpoint(const std::string& root, const std::string& client_state, int keep) {
  Impl& t = *impl_;
  STRATA_RETURN_IF_ERROR(t.recover());
  STRATA_RETURN_IF_ERROR(t.wait_all_updates());
  CheckpointManifest manifest;
  manifest.step = t.steps;
  manifest.model_config = hf_config_json(t.config.model);
  manifest.placement = "parameters on " + std::string(to_string(t.settings.params)) + ", optimizer state on " +
                       std::string(to_string(t.settings.optimizer));
  manifest.client_state = client_state;
  const ModelLayout& L = t.layout();
  const std::string working = working_tensor_dtype(t.wdtype);
  const std::uint64_t wsize = dtype_size(t.wdtype);
  if (t.pp_size > 1) return t.save_checkpoint_pp(root, manifest, keep);
  if (t.tp_size > 1) return t.save_checkpoint_tp(root, manifest, keep);
  // Data parallel: rank 0 writes the checkpoint; sharded state is gathered unit by unit (every
  // rank takes part, in unit order, even after rank 0 failed to write), then rank 0 broadcasts
  // the outcome and the published directory.
  int gathered_through = 0;  // units whose state every rank has gathered
  std::vector<char> pbytes;
  std::vector<float> blob;
  auto gather_rest = [&]() {  // the collective part of read_unit_state, for the units not yet read
    for (; gathered_through < t.M; ++gathered_through) {
      if ((t.placement.sharding.host_state_sharded || t.placement.sharding.device_state_sharded) &&
          !t.owned_of_unit[static_cast<std::size_t>(gathered_through)].empty()) {
        (void)t.read_unit_state(gathered_through, pbytes, blob);
      }
    }
  };
  Result<std::string> published = std::string();
  if (t.dp_rank == 0) {
    published = publish_checkpoint(root, manifest, keep, [&](const std::string& dir, std::vector<std::string>* names) {
      for (int u = 0; u < t.M; ++u) {
        gathered_through = u;
        const auto& mine = t.owned_of_unit[static_cast<std::size_t>(u)];
        if (mine.empty()) continue;
        Status read = t.read_unit_state(u, pbytes, blob);
        // Read or not, every rank has been through the unit's collectives: a failed read is
        // exchanged (agree_on_read) and fails the unit on every rank.
        gathered_through = u + 1;
        STRATA_RETURN_IF_ERROR(read);
      const std::size_t n = t.placement.units[static_cast<std::size_t>(u)].grad_bytes / 4;
      SafetensorsWriter w;
      for (int k : mine) {
        const OwnedParam& o = t.owned[static_cast<std::size_t>(k)];
        const ParamDesc& p = L.params[static_cast<std::size_t>(o.index)];
        const float* master = blob.data() + o.grad_in_unit / 4;
        STRATA_RETURN_IF_ERROR(w.add("param/" + p.name, working, p.shape, pbytes.data() + o.param_in_unit, o.n * wsize));
        STRATA_RETURN_IF_ERROR(w.add("master/" + p.name, "F32", p.shape, master, o.n * 4));
        STRATA_RETURN_IF_ERROR(w.add("exp_avg/" + p.name, "F32", p.shape, master + n, o.n * 4));
        STRATA_RETURN_IF_ERROR(w.add("exp_avg_sq/" + p.name, "F32", p.shape, master + 2 * n, o.n * 4));
      }
      w.set_metadata("module", L.modules[static_cast<std::size_t>(u)].name);
      const std::string name = module_file(u);
      STRATA_RETURN_IF_ERROR(t.write_checkpoint_file(w, dir + "/" + name));
      names->push_back(name);
    }
    gathered_through = t.M;
    if (t.scaler) {
      const std::array<double, kScalerFields> fields = scaler_fields(t.scaler->state());
      SafetensorsWriter w;
      STRATA_RETURN_IF_ERROR(w.add(kScalerTensor, "F64", {kScalerFields}, fields.data(), sizeof fields));
      STRATA_RETURN_IF_ERROR(t.write_checkpoint_file(w, dir + "/" + kScalerFile));
      names->push_back(kScalerFile);
    }
    return ok_status();
    });
  }
  if (t.dp_size == 1) return published;
  gather_rest();
  // The outcome, as 4-byte words from rank 0: 1 and the directory, or 0, the status code and the
  // first bytes of rank 0's error (so every rank returns the same error, e.g. the rank that could
  // not read its slice).
  constexpr std::size_t kWords = 1 + 256;
  std::array<std::uint32_t, kWords> word{};
  if (t.dp_rank == 0 && published.ok() && published->size() < 4 * (kWords - 1)) {
    word[0] = 1;
    std::memcpy(word.data() + 1, published->data(), published->size());
  } else if (t.dp_rank == 0 && !published.ok()) {
    const std::string& m = published.status().message();
    word[1] = static_cast<std::uint32_t>(published.status().code());
    std::memcpy(word.data() + 2, m.data(), std::min<std::size_t>(m.size(), 4 * (kWords - 2) - 1));
  }
  STRATA_RETURN_IF_ERROR(
      t.dp_wait(t.dp_tracks[0], t.dp_caller->broadcast(word.data(), kWords, DType::kF32, 0), "checkpoint outcome", -1, 4 * kWords));
  if (t.dp_rank == 0) return published;
  if (word[0] != 1) {
    const char* text = reinterpret_cast<const char*>(word.data() + 2);
    const std::string why(text, strnlen(text, 4 * (kWords - 2)));
    if (why.empty()) {
      return io_error("checkpoint under '" + root +
                      "': data-parallel rank 0, which writes it, failed (its log says why)");
    }
    const auto code = word[1] == 0 || word[1] > static_cast<std::uint32_t>(StatusCode::kCancelled)
                          ? StatusCode::kIoError
                          : static_cast<StatusCode>(word[1]);
    return Status(code, why);
  }
  return std::string(reinterpret_cast<const char*>(word.data() + 1));
}

Result<CheckpointManifest> OffloadEngine::load_checkpoint(const std::string& path) {
  Impl& t = *impl_;
  // Allowed after a failed step (the way to recover from one): the error stays until the
  // checkpoint is verified and loaded.
  STRATA_ASSIGN_OR_RETURN(std::string dir, resolve_checkpoint(path));
  STRATA_ASSIGN_OR_RETURN(CheckpointManifest manifest, read_checkpoint_manifest(dir, true));
  const std::string diff = config_difference(manifest.model_config, hf_config_json(t.config.model));
  if (!diff.empty()) {
    return failed_precondition("checkpoint '" + dir + "' is of another model (" + diff +
                               "); a checkpoint loads only into the model it was saved from");
  }
  // Every tensor located and checked before any state changes.
  std::vector<SafetensorsFile> files;
  files.reserve(manifest.files.size());
  std::map<std::string, std::size_t> where;
  for (const auto& f : manifest.files) {
    STRATA_ASSIGN_OR_RETURN(SafetensorsFile sf, SafetensorsFile::open(dir + "/" + f.name));
    files.push_back(std::move(sf));
    for (const auto& e : files.back().entries()) where[e.name] = files.size() - 1;
  }
  const ModelLayout& L = t.layout();
  const std::string working = working_tensor_dtype(t.wdtype);
  std::size_t expected = 0;
  for (const OwnedParam& o : t.owned) {
    const ParamDesc& p = L.params[static_cast<std::size_t>(o.index)];
    for (const char* kind : {"param/", "master/", "exp_avg/", "exp_avg_sq/"}) {
      const std::string name = kind + p.name;
      auto it = where.find(name);
      if (it == where.end()) return data_loss("checkpoint '" + dir + "' has no tensor '" + name + "'");
      const SafetensorsEntry* e = files[it->second].find(name);
      const std::string dtype = std::string(kind) == "param/" ? working : "F32";
      if (e->dtype != dtype || e->shape != p.shard.full_shape) {  // tensor parallel: the full parameter
        return data_loss("checkpoint file '" + files[it->second].path() + "': tensor '" + name + "' is " + e->dtype +
                         " of another shape or dtype than this model's " + dtype + " parameter");
      }
      ++expected;
    }
  }
  std::optional<LossScaler> scaler = t.scaler;
  if (scaler) {
    auto it = where.find(kScalerTensor);
    if (it == where.end()) {
      return data_loss("checkpoint '" + dir + "' has no tensor '" + kScalerTensor +
                       "' (the fp16 loss scaler's state, in " + kScalerFile + ")");
    }
    const SafetensorsEntry* e = files[it->second].find(kScalerTensor);
    if (e->dtype != "F64" || e->shape != std::vector<std::int64_t>{kScalerFields}) {
      return data_loss("checkpoint file '" + files[it->second].path() + "': tensor '" + kScalerTensor + "' is " +
                       e->dtype + " of another shape than F64 (" + std::to_string(kScalerFields) + ")");
    }
    std::array<double, kScalerFields> fields{};
    STRATA_RETURN_IF_ERROR(files[it->second].read(kScalerTensor, fields.data(), sizeof fields));
    Status rs = scaler->restore(scaler_state(fields));
    if (!rs.ok()) return data_loss("checkpoint file '" + files[it->second].path() + "': " + rs.message());
    ++expected;
  }
  if (t.pp_size > 1) {
    // A pipeline stage checked the tensors of its own parameters; the checkpoint holds the whole
    // model's (any pipeline shape, or one process, wrote the same files).
    STRATA_ASSIGN_OR_RETURN(ModelLayout full, describe_model(t.config.model));
    expected = scaler ? 1 : 0;
    for (const ParamDesc& p : full.params) expected += p.owns_storage() ? 4 : 0;
  }
  if (where.size() != expected) {
    return data_loss("checkpoint '" + dir + "' holds " + std::to_string(where.size()) + " tensors; this model has " +
                     std::to_string(expected));
  }
  t.drain_worker();
  (void)t.abandon_pass(ok_status());
  {
    std::lock_guard<std::mutex> lock(t.mu);
    t.worker_error = ok_status();
    t.failed = Impl::FailedUpdate{};
  }
  t.pending_publish = 0;  // the checkpoint's parameters replace the delayed update's
  t.publish_before_rerun = false;
  std::fill(t.next_fresh.begin(), t.next_fresh.end(), 0);
  const std::uint64_t wsize = dtype_size(t.wdtype);
  std::vector<char> pbytes;
  std::vector<float> blob;
  for (int u = 0; u < t.M; ++u) {
    const std::size_t uu = static_cast<std::size_t>(u);
    const auto& mine = t.owned_of_unit[uu];
    if (mine.empty()) continue;
    const std::size_t n = t.placement.units[uu].grad_bytes / 4;
    pbytes.assign(t.placement.units[uu].param_bytes, 0);
    blob.assign(3 * n, 0.0f);
    for (int k : mine) {
      const OwnedParam& o = t.owned[static_cast<std::size_t>(k)];
      const std::string& pname = L.params[static_cast<std::size_t>(o.index)].name;
      float* master = blob.data() + o.grad_in_unit / 4;
      const ParamDesc& pd = L.params[static_cast<std::size_t>(o.index)];
      std::vector<char> full_bytes;
      std::vector<float> full_values, shard_values;
      auto read = [&](const std::string& name, void* dst, std::uint64_t bytes) -> Status {
        if (pd.shard.kind == ShardKind::kReplicated) return files[where[name]].read(name, dst, bytes);
        // Tensor parallel: the file holds the full parameter; keep this rank's shard of it (the
        // values pass through fp32 exactly, whatever the stored dtype).
        const bool param = name.rfind("param/", 0) == 0;
        const DType dt = param ? t.wdtype : DType::kF32;
        const auto full_n = static_cast<std::size_t>(pd.shard.full_numel());
        full_bytes.resize(full_n * dtype_size(dt));
        STRATA_RETURN_IF_ERROR(files[where[name]].read(name, full_bytes.data(), full_bytes.size()));
        full_values.resize(full_n);
        STRATA_RETURN_IF_ERROR(convert(full_bytes.data(), dt, full_values.data(), DType::kF32, full_n));
        shard_values.resize(o.n);
        shard_from_full(pd, full_values.data(), shard_values.data());
        if (bytes != o.n * dtype_size(dt)) return internal_error("load_checkpoint: shard size of '" + name + "'");
        return convert(shard_values.data(), DType::kF32, dst, dt, o.n);
      };
      STRATA_RETURN_IF_ERROR(read("param/" + pname, pbytes.data() + o.param_in_unit, o.n * wsize));
      STRATA_RETURN_IF_ERROR(read("master/" + pname, master, o.n * 4));
      STRATA_RETURN_IF_ERROR(read("exp_avg/" + pname, master + n, o.n * 4));
      STRATA_RETURN_IF_ERROR(read("exp_avg_sq/" + pname, master + 2 * n, o.n * 4));
    }
    STRATA_RETURN_IF_ERROR(t.write_unit_state(u, pbytes, blob));
  }
  STRATA_RETURN_IF_ERROR(t.compute->synchronize());
  {
    std::lock_guard<std::mutex> lock(t.mu);
    t.steps = manifest.step;
    std::fill(t.updated_step.begin(), t.updated_step.end(), manifest.step);
    std::fill(t.stage_done.begin(), t.stage_done.end(), manifest.step);
    t.norm_step = manifest.step;
    // The worker is drained: the checkpoint's state holds no later step anywhere.
    std::fill(t.host_opt_step.begin(), t.host_opt_step.end(), manifest.step);
    for (auto& g : t.group_step) std::fill(g.begin(), g.end(), manifest.step);
    t.applied_step = manifest.step;
  }
  t.scaler = scaler;
  t.grad_norm = 0.0;
  return manifest;
}

OffloadStats OffloadEngine::stats() const {
  Impl& t = *impl_;
  OffloadStats s;
  s.steps = t.steps;
  // Early fetches (prefetch_next_step) in flight count as done, so that a step's traffic (the
  // difference of two calls between steps) is the same whenever the update lets them run: one
  // whose gate is open (or opens while we look) is waited for (its read and copy take
  // milliseconds), one whose gate is still closed, with mu held so that it stays closed until
  // the counters are read, adds its read and copy bytes.
  std::uint64_t pending_h2d = 0, pending_read = 0, pending_dp = 0;
  std::vector<char> settled(t.pslots.size(), 0);
  std::unique_lock<std::mutex> lock(t.mu, std::defer_lock);
  for (;;) {
    std::vector<std::size_t> open;
    lock.lock();
    pending_h2d = pending_read = pending_dp = 0;
    for (std::size_t i = 0; i < t.pslots.size(); ++i) {
      const ParamSlot& slot = t.pslots[i];
      if (!slot.early || slot.unit < 0 || settled[i]) continue;
      if (t.gate_open(slot)) {
        open.push_back(i);
        continue;
      }
      const std::size_t uu = static_cast<std::size_t>(slot.unit);
      const std::uint64_t n = t.placement.units[uu].param_bytes;
      pending_h2d += n;
      if (t.placement.units[uu].gathered_at_fetch) {
        // Stage 3: this rank's slice is read and the unit all-gathered (early_gather_unit_params).
        const std::uint64_t w = t.half ? 2 : 4;
        if (t.placement.units[uu].home == Tier::kNvme) pending_read += t.placement.units[uu].slice.len * w;
        pending_dp += static_cast<std::uint64_t>(t.dp_size) * t.placement.units[uu].slice.chunk * w;
      } else if (t.placement.units[uu].home == Tier::kNvme) {
        pending_read += n;
      }
    }
    if (open.empty()) break;  // the counters are read with mu still held
    lock.unlock();
    for (std::size_t i : open) {
      (void)t.pslots[i].fetched->synchronize();  // an error surfaces at the pass that uses it
      settled[i] = 1;
    }
  }
  const DeviceStats d = t.device->stats();
  const IoEngineStats io = t.io ? t.io->stats() : IoEngineStats{};
  const std::uint64_t dp_bytes = t.dp_bytes.load(std::memory_order_relaxed) + pending_dp;
  lock.unlock();
  s.bytes_h2d = d.bytes_h2d + pending_h2d;
  s.bytes_d2h = d.bytes_d2h;
  s.compute_cpu_seconds = d.compute_cpu_seconds;
  s.copy_cpu_seconds = d.copy_cpu_seconds;
  s.optimizer_cpu_seconds = t.worker_cpu.seconds();
  if (t.io) {
    s.bytes_nvme_read = io.bytes_read + pending_read;
    s.bytes_nvme_written = io.bytes_written;
    s.io_cpu_seconds = io.cpu_seconds;
  }
  s.param_accesses = t.accesses;
  s.prefetch_hits = t.hits;
  s.early_fetch_hits = t.early_hits;
  s.trace_mismatches = t.mismatches;
  s.early_optimizer_reads = t.early_reads_issued.load(std::memory_order_relaxed);
  s.early_optimizer_reads_dropped = t.early_reads_dropped.load(std::memory_order_relaxed);
  s.allocations_after_warmup = t.have_baseline ? t.allocation_count() - t.alloc_baseline : 0;
  s.stream_times = t.tracer.timing();
  s.compute_seconds = t.tracer.seconds(TraceCounter::kCompute);
  s.fetch_stall_seconds = t.tracer.seconds(TraceCounter::kFetchStall);
  s.h2d_seconds = t.tracer.seconds(TraceCounter::kH2D);
  s.d2h_seconds = t.tracer.seconds(TraceCounter::kD2H);
  s.nvme_read_seconds = t.tracer.seconds(TraceCounter::kNvmeRead);
  s.nvme_write_seconds = t.tracer.seconds(TraceCounter::kNvmeWrite);
  s.optimizer_seconds = t.tracer.seconds(TraceCounter::kOptimizer);
  s.update_stall_seconds = t.tracer.seconds(TraceCounter::kUpdateStall);
  s.bytes_dp = dp_bytes;
  s.dp_seconds = t.tracer.seconds(TraceCounter::kComm);
  s.pipeline_seconds = t.pp_seconds;
  s.pipeline_wait_seconds = t.pp_wait_seconds;
  s.bytes_pp = t.pp_bytes;
  s.bytes_checkpoint_written = t.checkpoint_bytes;
  s.weights_file_writes = t.weights_writes;
  if (t.model) {
    const Model::ActivationTraffic a = t.model->activation_traffic();
    s.bytes_activations_to_host = a.to_host;
    s.bytes_activations_to_device = a.to_device;
    s.bytes_tp = t.model->tensor_parallel_bytes();
  }
  return s;
}

void OffloadEngine::observe(const ObserveSettings& settings) {
  impl_->tracer.set_spans(settings.trace, settings.max_trace_spans);
  impl_->tracer.set_timing(settings.stream_times);
}

Status OffloadEngine::write_trace(const std::string& path) const {
  const Impl& t = *impl_;
  return t.tracer.write_json(path, "strata offload engine", [&t](int u) {
    return u >= 0 && u < t.M ? t.layout().modules[static_cast<std::size_t>(u)].name : std::to_string(u);
  });
}

}  // namespace strata
