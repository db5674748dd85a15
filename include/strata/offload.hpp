// The offload engine: trains a model whose state need not fit in device memory by placing every
// kind of training state on a tier — device memory, host memory, or NVMe through the swap store
// — moving it ahead of need and updating it where it lives. docs/offload.md describes the states,
// invariants, the schedule of a step and the memory plan.
//
// One step algorithm serves every placement: the all-device placement is the resident trainer
// (trainer.hpp's Trainer runs on it), and every other placement must give the same parameters
// bit for bit on the cpu backend (tests/test_offload_engine.cpp checks it).
//
// Ownership and threads: an OffloadEngine is driven from one host thread at a time. It owns its
// streams (compute, "offload.h2d", "offload.grads"), the host optimizer thread, the I/O engine
// and swap store of the NVMe tier, and every buffer of the plan; all of it is allocated in
// create(), and a step after the first allocates no device, pinned or host tensor memory.
// Destroy it before its Device.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/checkpoint.hpp"
#include "strata/training.hpp"
#include "strata/nvme.hpp"
#include "strata/status.hpp"
#include "strata/tensor.hpp"

namespace strata {

namespace nvme_detail {
struct IoFaults;
}
namespace offload_detail {
struct EngineFaults;
}
class Comm;
class Device;
class Stream;
struct Config;

// Tiers are tensor.hpp's Tier (kDevice, kHost, kNvme).
// "device" (or DeepSpeed's "none"), "host" (or "cpu"), "nvme".
Result<Tier> parse_tier(std::string_view text);

// The order in which a pipeline stage runs the forwards and backwards of a step's micro-batches
// (docs/parallel.md "Pipeline parallel"): kGpipe every forward then every backward; kOneFOneB
// warm-up forwards, then one forward and one backward alternately, then the remaining backwards.
enum class PipelineSchedule : std::uint8_t { kGpipe, kOneFOneB };
std::string_view to_string(PipelineSchedule schedule);  // "gpipe", "1f1b"
// The error names the text and the accepted values.
Result<PipelineSchedule> parse_pipeline_schedule(std::string_view text);

// One stage's order of work in a step: (true, a) the forward of micro-batch a, (false, a) its
// backward. Forwards and backwards each run in micro-batch order. kOneFOneB on stage s of p runs
// min(p - s - 1, m) warm-up forwards.
struct PipelineOp {
  bool forward = true;
  int micro = 0;
  friend bool operator==(const PipelineOp&, const PipelineOp&) = default;
};
std::vector<PipelineOp> pipeline_ops(PipelineSchedule schedule, int stages, int stage, int micro_batches);
// The most micro-batches in flight (forward done, backward not) at once on that stage: the
// activation slots it needs.
int pipeline_slots(PipelineSchedule schedule, int stages, int stage, int micro_batches);

// Where the state lives and how it moves. DeepSpeed's keys map onto it (apply()).
struct OffloadSettings {
  // Working parameters (bf16/fp32): kDevice keeps every module resident; kHost/kNvme keep them
  // there and fetch each module into a device slot ahead of its use.
  Tier params = Tier::kDevice;  // zero_optimization.offload_param.device
  // fp32 master weights and Adam moments, and with them where the optimizer runs: kDevice (the
  // device's fused update; gradients stay on the device), kHost (CPU Adam on host memory;
  // gradients stream out to host), kNvme (CPU Adam streaming state through a pinned ring).
  Tier optimizer = Tier::kDevice;  // zero_optimization.offload_optimizer.device
  // zero_optimization.offload_optimizer.ratio: the fraction of the optimizer state (and of the
  // updates) on the host; the rest stays on the device with the device's update. The device
  // keeps the first modules (the largest prefix whose elements fit in 1 - ratio of the total):
  // their gradients land last in backward and the next forward reads them first, so they are
  // the ones the host would make the step wait for. < 1 needs optimizer = kHost or kNvme (the
  // host part then streams through the NVMe ring) and no delayed update; with data-parallel
  // ranks the conditions validate() names; with tensor parallelism each rank splits its shard,
  // with a pipeline each stage its own units (the first of the stage's units, in module order;
  // with data-parallel ranks per stage, stages 0-1 only). With the parameters off the device
  // the device's modules keep theirs resident (docs/offload.md).
  double optimizer_ratio = 1.0;
  // Where fp32 gradients wait for an off-device optimizer between backward and the update:
  // kHost (4 bytes per parameter of host memory) or kNvme (swap shards per sub-group, streamed
  // through one pinned staging buffer on the way out and in; needs optimizer = kNvme). A Strata
  // setting (DeepSpeed keeps them in host memory): --offload-gradients.
  Tier gradients = Tier::kHost;
  std::vector<std::string> nvme_path;  // swap directories (offload_*.nvme_path / aio.nvme_path)
  // The swap directories are this run's scratch space (strata train's default under $TMPDIR):
  // the swap files are unlinked once open, so a killed process leaves no swap data behind
  // (SwapStoreConfig::scratch). Needs directories without a store in them.
  bool nvme_scratch = false;
  // Modules fetched ahead of the one running, bounded by prefetch_elements (0 disables prefetch).
  int prefetch_modules = 2;
  std::int64_t prefetch_elements = 50'000'000;      // stage3_prefetch_bucket_size
  std::int64_t persistence_threshold = 100'000;     // stage3_param_persistence_threshold: modules
                                                    // with at most this many elements stay resident
  bool pin_memory = false;          // host-tier state in the pinned pool (offload_*.pin_memory)
  int nvme_buffer_count = 4;        // offload_optimizer.buffer_count: the NVMe pipeline's ring
  // zero_optimization.sub_group_size: the most elements of optimizer state the NVMe pipeline
  // moves and updates as one piece (one ring buffer holds [master | m | v] of one sub-group).
  // Modules larger than this are split, at multiples of 64 elements of a parameter, so the
  // update is the same bits whatever the size.
  std::int64_t sub_group_size = 1'000'000'000;
  // With clipping off and no fp16 loss scaling (either needs the whole step's gradients first),
  // update a module's state as soon as its gradients land, overlapped with the rest of backward
  // (host tier). Off: update after backward, in forward order, overlapped with
  // the next step's forward. Either way the result is the same bits.
  bool update_during_backward = true;
  // One-step delayed parameter update (ZeRO-Offload's DPU; docs/offload.md "Delayed update"): a
  // step's host update runs while the next step's forward and backward compute with the
  // parameters from before it, so step t+1 computes its gradients at the parameters after step
  // t-1's update. Not equivalent to the ordinary run (it trades exactness for overlap). Needs the
  // optimizer off the device; the working parameters may be off it too (each unit then has a
  // second version at home, written by the update in flight). Composes with data, tensor and
  // pipeline parallelism (each rank delays the update of its shard, slice or stage alike); not
  // with optimizer_ratio < 1. strata.delayed_update.
  bool delayed_update = false;
  // The first this many steps' updates are not delayed (the next step sees them).
  // strata.delayed_update_warmup.
  int delayed_update_warmup = 1;
  // Activation offload (docs/offload.md "Activation offload"): with activation checkpointing, the
  // checkpointed block inputs live in pinned host memory (Model::Options::offload_activations).
  // activation_checkpointing.cpu_checkpointing, --offload-activations. Bitwise the same training.
  bool offload_activations = false;
  // Threads of the host optimizer (0: the device's CpuBudget host_threads, one per host cpu).
  int host_threads = 0;
  // Host memory the plan may use (0: no limit beyond what the machine has available).
  std::uint64_t host_memory_limit = 0;
  IoEngineConfig io;  // the `aio` section
  // Data parallel (docs/parallel.md). zero_optimization.stage: with more than one rank, stage 0
  // all-reduces gradients (optimizer on the device), stages 1 and 2 shard the host optimizer's
  // state (and in stage 2 its gradients) over the ranks; with the optimizer on the device,
  // stages 1-3 shard its master and moments in device memory (cpu backend). dp_size is the number of data-parallel
  // ranks the plan is for: create() sets it from its Comm; strata estimate sets it to ask
  // "what would each rank need".
  int zero_stage = 0;
  int dp_size = 1;
  // Gradient buckets of data parallel with the optimizer on the device (docs/parallel.md
  // "Gradient buckets"): the units whose gradients are final in backward order are grouped into
  // buckets of at most reduce_bucket_elements fp32 elements (zero_optimization.reduce_bucket_size;
  // a larger unit is a bucket of its own); each bucket's collective (stage 0: all-reduce in place;
  // stage >= 2: reduce-scatter into this rank's shard) is launched as backward leaves its last
  // module. overlap_comm: the collective runs on the comm thread while backward continues (waited
  // before its buffer is reused and before the update); off: the compute stream waits for it at once.
  std::int64_t reduce_bucket_elements = 500'000'000;
  bool overlap_comm = false;
  // Tensor parallel (docs/parallel.md "Tensor parallel"): the number of ranks each model is split
  // over. The engine of each rank places, offloads and updates only its shard; the plan is for
  // the largest shard. create() sets it from its tensor-parallel Comm.
  int tp_size = 1;
  // Sequence parallel (docs/parallel.md "Sequence parallel", strata.sequence_parallel): with
  // tp_size > 1, each tensor-parallel rank keeps 1/tp_size of the token rows of the residual
  // stream and the norms (Model::Options::sequence_parallel). seq_len must be a multiple of
  // tp_size. With a pipeline each tp rank exchanges its rows of the boundary tensors with the same
  // tp rank of the neighbour stages (interleaved 1F1B too); with activation offload it offloads
  // its rows.
  bool sequence_parallel = false;
  // Pipeline parallel (docs/parallel.md "Pipeline parallel"): the stages' module bounds
  // (pipeline_stages; empty: one process runs every module) and this process's stage. create()
  // sets both from its pipeline group; strata estimate may set them to ask "what would stage s
  // need". The plan then covers only the stage's units.
  //
  // Interleaved 1F1B (strata.pipeline_virtual_stages = v > 1, docs/parallel.md "Schedules"): the
  // bounds are the v·p + 1 bounds of the v·p FLOP-balanced chunks (pipeline_stages(config, v·p,
  // seq_len)) and stage s runs chunks s, s + p, ..., s + (v−1)p (interleaved_stage_ranges) in
  // interleaved_pipeline_ops order; pipeline_schedule must then be kOneFOneB. v = 1: p + 1 bounds,
  // one contiguous range per stage.
  std::vector<int> pipeline_bounds;
  int pp_stage = 0;
  PipelineSchedule pipeline_schedule = PipelineSchedule::kOneFOneB;
  int pipeline_virtual_stages = 1;

  Status validate() const;
  // DeepSpeed's zero_optimization.offload_param / offload_optimizer / stage3_* and aio keys.
  // Errors name the key.
  Status apply(const Config& config);
};

// The memory plan: every buffer of the engine, its tier and bytes, computed before anything is
// allocated.
// What a plan line holds, for the per-kind totals of strata estimate.
enum class StateKind : std::uint8_t { kParameters, kGradients, kOptimizer, kActivations };
inline constexpr int kStateKinds = 4;
std::string_view to_string(StateKind kind);

struct PlanLine {
  std::string what;  // "working parameters (resident modules)", "Adam exp_avg", ...
  Tier tier = Tier::kDevice;
  StateKind kind = StateKind::kParameters;
  bool pinned = false;  // host lines: from the pinned pool
  std::uint64_t bytes = 0;
};

struct OffloadPlan {
  std::vector<PlanLine> lines;
  std::uint64_t device_bytes = 0;  // arena: regions + activations
  std::uint64_t host_bytes = 0;    // ordinary host memory (pinned excluded)
  std::uint64_t pinned_bytes = 0;  // pinned pool
  std::uint64_t nvme_bytes = 0;    // state on NVMe
  // The swap files the engine preallocates: nvme_bytes plus room for the versions being
  // rewritten while their previous version is live (the writes one step can have in flight)
  // and allocation granularity per swap key. This is what must be free on disk.
  std::uint64_t swap_bytes = 0;
  std::uint32_t param_slots = 0;
  std::uint64_t param_slot_bytes = 0;
  std::uint32_t grad_slots = 0;
  std::uint64_t grad_slot_bytes = 0;
  std::vector<Tier> module_home;  // where each module's working parameters live
  // Per module, 1 when its home is the device but only this rank's slice of its working
  // parameters lives there (stage 3 in device memory): gathered into a param slot for each use,
  // so not resident.
  std::vector<char> module_sliced;

  static Result<OffloadPlan> make(const TrainerConfig& config, const OffloadSettings& settings);
  // Fails, naming the setting to change, when the plan exceeds the device budget, the pinned
  // pool, the host limit / available memory, or the free space of the NVMe directories.
  Status check_fits(const Device& device, const OffloadSettings& settings) const;
  std::string to_string() const;  // a table, one line per buffer, then the totals per tier
};

// strata estimate: the plan of every placement (params x optimizer tier) and ZeRO stage, each made
// by OffloadPlan::make, so the bytes are the engine's own. With base.dp_size 1 every stage of one
// placement has the same bytes and the stage column records which stages DeepSpeed allows for it
// (offload_param needs 3, offload_optimizer 1-3); with dp_size N the bytes are per rank, each stage
// planned with what it shards, and the combinations the engine refuses are left out.
struct TierBytes {
  std::uint64_t device = 0;
  std::uint64_t host = 0;  // ordinary host memory
  std::uint64_t pinned = 0;
  std::uint64_t nvme = 0;
};

struct EstimateBudgets {
  std::uint64_t device = 0;  // 0: no limit
  std::uint64_t host = 0;    // host + pinned
  std::uint64_t nvme = 0;    // free space of the NVMe directories
};

struct PlacementEstimate {
  int zero_stage = 0;
  Tier params = Tier::kDevice;
  Tier optimizer = Tier::kDevice;
  OffloadPlan plan;
  std::array<TierBytes, kStateKinds> by_kind{};  // indexed by StateKind
  std::uint64_t device_need = 0;  // device_bytes, plus the cuda kernel workspace on that backend
  std::uint64_t nvme_need = 0;    // swap space to reserve (the NVMe bytes with rewrite slack)
  bool fits_device = true;
  bool fits_host = true;
  bool fits_nvme = true;
  bool fits() const { return fits_device && fits_host && fits_nvme; }
};

// `base` supplies everything but the two tiers (prefetch, persistence, buffer counts, nvme_path:
// an NVMe placement needs a path only as a name, nothing is touched on disk). `cuda`: count the
// cuda backend's kernel workspace in the device need, as check_fits does.
Result<std::vector<PlacementEstimate>> estimate_placements(const TrainerConfig& config, const OffloadSettings& base,
                                                           const EstimateBudgets& budgets, bool cuda = false);

// `settings` with what only some placements take dropped, as estimate_placement plans them: the
// delayed update with the optimizer on the device, and the partial optimizer split
// (optimizer_ratio) where the engine does not take it (the optimizer on the device, the delayed
// update, and with several data-parallel ranks what validate() refuses: stage 3, NVMe, the
// parameters off the device).
OffloadSettings placement_settings(const OffloadSettings& settings);

// One placement's estimate (estimate_placements' row for `settings` as given: every setting that
// changes the bytes counts, prefetch depth, buffer count and sub-group size included).
Result<PlacementEstimate> estimate_placement(const TrainerConfig& config, const OffloadSettings& settings,
                                             const EstimateBudgets& budgets, bool cuda = false);

// ---- the step-time model (strata plan; docs/offload.md "Predicting the step") -------------------
//
// What the machine does alone, measured by the caller (tools/strata/measure.cpp measures it).
struct MachineRates {
  // Compute of one micro-batch with everything resident, per module in forward order.
  std::vector<double> forward_seconds;
  std::vector<double> backward_seconds;
  double device_update_seconds = 0;  // the optimizer step on the device (optimizer = device)
  double h2d_bytes_per_s = 0;        // pinned host -> device copies
  double d2h_bytes_per_s = 0;
  // Host memory to host memory (a memcpy on the caller's thread): the delayed update's publish of
  // the units whose home is host memory copies their next version over the published one.
  double host_copy_bytes_per_s = 0;
  double nvme_read_bytes_per_s = 0;  // through the swap store, checksums on
  double nvme_write_bytes_per_s = 0;
  double nvme_request_seconds = 0;  // fixed cost of one swap request on top of its bytes
  double adam_elements_per_s = 0;   // CPU Adam on the engine's host optimizer threads
  double scan_elements_per_s = 0;   // the gradient norm's sum of squares on that thread
  // The cpu backend: the device's compute threads occupy every core, so CPU work of the other
  // engines that runs while compute runs delays it by its CPU seconds over `cores`. Copies and
  // the optimizer are CPU work in full; NVMe transfers by nvme_cpu_fraction (checksums, page
  // copies: CPU seconds per second of transfer).
  bool shared_cores = false;
  int cores = 1;
  double nvme_cpu_fraction = 0;
  // The cuda backend: stage 0 with the optimizer on the device all-reduces the whole gradient once
  // after backward there (a stream's host function may not call NCCL); the cpu backend all-reduces
  // each gradient bucket when backward leaves it (dp_stage0_bucketed).
  bool cuda = false;
  // Data parallel (settings.dp_size > 1): the link between the ranks as a collective sees it.
  // dp_bus_bytes_per_s is the bus bandwidth (what strata bench comm reports, nccl-tests'
  // convention): a collective on B buffer bytes takes dp_collective_seconds + B * f / bus, with
  // f = (N-1)/N for a reduce-scatter (B its input) or an all-gather (B its output) and 2(N-1)/N
  // for an all-reduce. Unused (may be 0) with one rank.
  double dp_bus_bytes_per_s = 0;
  double dp_collective_seconds = 0;
  // Tensor parallel (settings.tp_size = t > 1): the tensor-parallel group's link, the same
  // convention as the data-parallel one (an all-reduce of B buffer bytes takes
  // tp_collective_seconds + B * 2(t-1)/t / tp_bus_bytes_per_s; a reduce-scatter of B input bytes
  // or an all-gather of B output bytes (t-1)/t of that). Unused (may be 0) without tensor
  // parallelism.
  double tp_bus_bytes_per_s = 0;
  double tp_collective_seconds = 0;
  // Pipeline parallel (settings.pipeline_bounds): one boundary tensor of B bytes sent to a
  // neighbour stage arrives pp_message_seconds + B / pp_link_bytes_per_s after it leaves; one
  // stage's sends in one direction share its link (one after another). Unused without a pipeline.
  double pp_link_bytes_per_s = 0;
  double pp_message_seconds = 0;
  Status validate(std::size_t modules) const;  // errors name the rate
};

// The default link for the data-parallel term when none is given (strata estimate and strata plan
// --link-bandwidth / --link-latency-us): 12.5 GB/s of bus bandwidth, a 100 Gb/s network port per
// rank,
// and a fixed 20 us per collective (a ring's start-up across a network; strata bench comm's small sizes
// measure it).
inline constexpr double kDefaultDpBusBytesPerSecond = 12.5e9;
inline constexpr double kDefaultDpCollectiveSeconds = 20e-6;

// The data-parallel collectives of one step, per rank (docs/performance.md "Data parallel: bytes
// per step per ZeRO stage"). Buffer bytes are what OffloadStats::bytes_dp counts (a reduce-scatter
// its input, an all-gather its output, an all-reduce its buffer; every module padded to dp_size
// chunks of a multiple of 64 elements); wire bytes are what a rank sends (and receives) with ring
// algorithms. The small per-step collectives (token count, loss, gradient statistics) are left out.
struct DpTraffic {
  int ranks = 1;
  int stage = 0;                           // the stage the engine runs (0 with the host optimizer runs as 1)
  std::uint64_t all_reduce_bytes = 0;      // stage 0: the whole gradient (cpu: per bucket, in backward)
  std::uint64_t reduce_scatter_bytes = 0;  // gradients: once per step (stage 1), per micro-batch (2, 3)
  std::uint64_t all_gather_bytes = 0;      // updated parameters (1, 2) or every stage-3 fetch
  std::uint64_t collectives = 0;           // how many of them
  std::uint64_t buffer_bytes() const { return all_reduce_bytes + reduce_scatter_bytes + all_gather_bytes; }
  double wire_bytes() const;  // sent per rank
  // With every collective back to back (no overlap) at this link.
  double seconds(double bus_bytes_per_s, double collective_seconds) const;
  // Some run beside compute: stages 1-3 with the optimizer off the device (per module); with it on
  // the device, stages 2-3's bucket reduce-scatters with overlap_comm and stage 3's gathers at
  // its fetches (data parallelism alone).
  bool overlapped = false;
};

// The data-parallel traffic of `settings` (dp_size ranks, zero_stage) for one step of `config`;
// all zero with dp_size 1. Stage 3 counts a gather per fetch of a non-resident module, the fetches
// being predict_step's (the slot rule with prefetch_modules).
// `cuda`: the cuda backend, whose stage 0 all-reduces once; the cpu backend's stage 0 all-reduces
// each gradient bucket (the same bytes in more collectives, beside backward with overlap_comm).
// With tp_size > 1 the bytes are a tensor-parallel rank's (its shard; the same shapes on every tp
// rank), with pipeline_bounds the stage pp_stage's units'.
Result<DpTraffic> dp_traffic(const TrainerConfig& config, const OffloadSettings& settings, bool cuda = false);

// The predicted steady-state step (the time between the returns of consecutive step() calls)
// and where it goes. Busy seconds per engine add up to more than the step when they overlap.
struct StepPrediction {
  double step_seconds = 0;
  double compute = 0;       // forward + backward (+ the device optimizer)
  double h2d = 0;           // parameter fetches, gradient restores, uploads of updated parameters
  double d2h = 0;           // gradients out
  double host_copy = 0;     // the caller's host copies (the delayed update's publish, host homes)
  double nvme_read = 0;     // parameter fetches, optimizer state and gradients in
  double nvme_write = 0;    // optimizer state, gradients and updated parameters out
  double optimizer = 0;     // host optimizer thread: gradient scans and CPU Adam
  double fetch_stall = 0;   // compute idle, waiting for parameters fetched or updated
  double update_stall = 0;  // the caller waiting for the gradient norm
  double contention = 0;    // shared_cores: the other engines' CPU work taken from compute
  double dp = 0;            // data-parallel collectives (busy seconds of the link, all threads)
  // The optimizer on the device: compute waiting for data-parallel collectives (their exposed
  // part: stages 0-1 all of them, stages 2-3 the buckets' tail and the update's all-gathers).
  // With the optimizer off the device the waits show as fetch and update stalls instead.
  double dp_stall = 0;
  std::uint64_t h2d_bytes = 0, d2h_bytes = 0, nvme_read_bytes = 0, nvme_write_bytes = 0;
  std::uint64_t host_copy_bytes = 0;
  std::uint64_t dp_bytes = 0;     // their buffer bytes (as OffloadStats::bytes_dp counts them)
  // Tensor parallel: the model's blocking collectives of every module's forward, backward and
  // recompute (the compute stream waits for each; counted in the step, not in `compute`), their
  // buffer bytes (an all-reduce its buffer, a reduce-scatter its input, an all-gather its output,
  // in the dtype the model moves; OffloadStats::bytes_tp counts the same) and how many.
  double tp = 0;
  std::uint64_t tp_bytes = 0;
  std::uint64_t tp_collectives = 0;
  // Pipeline parallel (the stage `pp_stage` of settings.pipeline_bounds): the boundary tensors
  // this stage sends in a step (OffloadStats::bytes_pp counts the same) and their link seconds;
  // pp_schedule the span of the whole pipeline's schedule (every stage's forwards, backwards and
  // sends), pp_bubble the part of it this stage is idle (waiting for a neighbour, or done early).
  int pp_stage = 0;
  double pp = 0;
  std::uint64_t pp_bytes = 0;
  double pp_schedule = 0;
  double pp_bubble = 0;
  std::string to_string() const;  // one line per part
};

// Predicts the step of `settings` by replaying the engine's schedule (docs/offload.md "One step")
// over the units of OffloadPlan::make: per micro-batch the forward and backward accesses in
// order, each non-resident unit fetched (NVMe read then H2D copy, serial on the h2d stream) up
// to prefetch_modules accesses ahead and no earlier than the slot it reuses is free; gradient
// buckets restored and copied out on the grads stream; the host optimizer thread scanning each
// landed unit and updating it then (update_during_backward with clipping off, no NVMe homes) or
// after the norm, in forward order, overlapped with the next step's forward, which waits for
// each unit's update; NVMe optimizer state streamed through the ring of nvme_buffer_count
// sub-groups (reads ahead, one disk for reads and writes). Partial optimizer offload: the device
// units keep their gradients and are scanned and updated on compute after the norm (their share
// of device_update_seconds). The delayed update: the next forward does not wait for the update,
// its backward waits per unit before the gradients go out, uploads follow the passes (steady
// state, warm-up left out). Activation offload: each evicted block input out after its forward
// and back before its backward, compute waiting where the ring of 3 buffers makes it. Several
// steps are replayed and the last step's period is the prediction. Data parallel (dp_size > 1):
// each stage's collectives on the thread that runs them (dp_traffic's bytes at the rates' link);
// with the optimizer on the device, stages 2-3's bucket reduce-scatters beside backward (the
// buckets of the engine's grad_buckets) and stage 3's gathers of its sliced modules in the
// fetches ahead of use.
// Tensor parallel (tp_size = t > 1): the rank's units are its shard (tp rank 0's, the largest);
// each module's measured compute (the whole model's, forward_seconds / backward_seconds) is
// scaled by its shard's share of the module's matrix and attention FLOPs, and the model's
// blocking collectives of each forward, backward and recompute (all-reduces; with
// sequence_parallel all-gathers and reduce-scatters) are charged on the compute clock at the
// tensor-parallel link. Pipeline (pipeline_bounds): every stage is replayed as above with its
// own units and modules, then the schedule (pipeline_schedule, pipeline_virtual_stages: the
// engine's op orders) is replayed over all stages with each op's compute and the boundary
// sends; the step is the schedule's span plus the largest stage's time outside its passes
// (its update, stalls). The parts are stage pp_stage's.
// A pure function of its arguments.
Result<StepPrediction> predict_step(const TrainerConfig& config, const OffloadSettings& settings,
                                    const MachineRates& rates);

struct OffloadStats {
  std::int64_t steps = 0;
  std::uint64_t bytes_h2d = 0;  // device traffic since create()
  std::uint64_t bytes_d2h = 0;
  std::uint64_t bytes_nvme_read = 0;
  std::uint64_t bytes_nvme_written = 0;
  // Accesses to a module's non-resident parameters, and how many found their fetch already
  // issued ahead (by the prefetcher) when the module was reached.
  std::uint64_t param_accesses = 0;
  std::uint64_t prefetch_hits = 0;
  // Of those, the hits on a copy fetched early across steps (issued when the previous step
  // returned, gated on its update; docs/offload.md "Early fetch across steps").
  std::uint64_t early_fetch_hits = 0;
  std::uint64_t trace_mismatches = 0;  // passes whose module order differed from the recorded trace
  // NVMe optimizer: reads of [master | m | v] sub-groups issued during backward (at a step's first
  // landed unit, ahead of its update), counted when issued, so a step() that returned has counted
  // its own; and those of them the update did not take over (a retry, a step that failed before
  // its update), counted when they end, once the update in flight finished (synchronize()). The
  // update took over early_optimizer_reads - early_optimizer_reads_dropped of them.
  std::uint64_t early_optimizer_reads = 0;
  std::uint64_t early_optimizer_reads_dropped = 0;
  // Device arena + pinned pool allocations and backend allocations made after the first step.
  std::uint64_t allocations_after_warmup = 0;
  // CPU seconds from thread clocks (busy time, not wall time; cpu_budget.hpp), per engine: the
  // host optimizer thread with its OpenMP team since create(); the device's compute (stream
  // workers with their teams) and copy engines, read from DeviceStats (0 on cuda, where SMs and
  // DMA engines do that work); the NVMe I/O threads since create().
  double optimizer_cpu_seconds = 0.0;
  double compute_cpu_seconds = 0.0;
  double copy_cpu_seconds = 0.0;
  double io_cpu_seconds = 0.0;
  // Where the time went, in seconds since create() (docs/observability.md). The engines overlap,
  // so these add up to more than the wall time when the overlap works. Host-side figures are
  // always measured (a clock around the work or the wait); stream-side ones only while
  // ObserveSettings::stream_times is on (`stream_times` says whether they were).
  bool stream_times = false;
  double compute_seconds = 0.0;       // stream: module forward/backward and the device optimizer
  double fetch_stall_seconds = 0.0;   // stream: compute idle until fetched/updated parameters landed
  double h2d_seconds = 0.0;           // stream: host-to-device copies (fetches, uploads, restores)
  double d2h_seconds = 0.0;           // stream: device-to-host gradient copies
  double nvme_read_seconds = 0.0;     // host: NVMe reads, issue until seen complete, summed per request
  double nvme_write_seconds = 0.0;    // host: NVMe writes, likewise
  double optimizer_seconds = 0.0;     // host: wall time of the host optimizer's scans and updates
  double update_stall_seconds = 0.0;  // host: the caller blocked on the host optimizer (an update
                                      // or the gradient norm)
  // Data parallel: bytes of the collectives' buffers this rank handed to the data-parallel group
  // (a reduce-scatter counts its input, an all-gather its output, an all-reduce its buffer), and
  // the seconds the engine's threads spent waiting for them.
  std::uint64_t bytes_dp = 0;
  double dp_seconds = 0.0;
  // Pipeline parallel: wall seconds of the steps' schedules on this stage, and the part of them
  // it sat waiting for a neighbour's activations or activation gradients (its bubble);
  // bytes_pp counts the boundary tensors it sent (with sequence parallelism this rank's rows).
  double pipeline_seconds = 0.0;
  double pipeline_wait_seconds = 0.0;
  std::uint64_t bytes_pp = 0;
  // Tensor parallel: buffer bytes of the model's collectives on the tensor-parallel group (the
  // activation all-reduces; with sequence parallelism the all-gathers and reduce-scatters; an
  // all-reduce counts its buffer, a reduce-scatter its input, an all-gather its output), in
  // forward, backward and recompute: what StepPrediction::tp_bytes predicts per step
  // (Model::tensor_parallel_bytes). The engine's own small agreements on the group (the gradient
  // statistics of the device update, two GradStats records per rank per step) are left out.
  std::uint64_t bytes_tp = 0;
  // Checkpoints: bytes of the checkpoint files this rank wrote (data and tensor parallel: the
  // first rank writes every file; a pipeline: each stage's first rank writes its stage's module
  // files, the first stage's first rank also the manifest's companions; the manifest itself is not
  // counted).
  std::uint64_t bytes_checkpoint_written = 0;
  // Weights files: the writes (pwrites) this rank issued into them (save_weights with more than
  // one rank: every rank writes the elements it holds, one write per run of adjacent file bytes).
  std::uint64_t weights_file_writes = 0;
  // Activation offload: checkpointed block inputs copied to the host and back (also in
  // bytes_d2h / bytes_h2d, which count every copy of the device).
  std::uint64_t bytes_activations_to_host = 0;
  std::uint64_t bytes_activations_to_device = 0;
  double hit_rate() const {
    return param_accesses == 0 ? 1.0 : static_cast<double>(prefetch_hits) / static_cast<double>(param_accesses);
  }
};

class Model;

// What the engine records beyond its always-on counters. Either may change between steps.
struct ObserveSettings {
  // Busy/stall seconds of the streams (OffloadStats): two host functions on the stream around
  // each module's work and each copy. Cheap on the cpu backend; on cuda each is a
  // cudaLaunchHostFunc, which costs a few microseconds of stream time.
  bool stream_times = false;
  // Buffer every span for write_trace() (implies stream_times); at most max_trace_spans are kept.
  bool trace = false;
  std::size_t max_trace_spans = 4'000'000;
};

class OffloadEngine {
 public:
  // Plans, checks the plan against the device, host and disk, allocates everything, initialises
  // parameters from config.seed and optimizer state to zero. The device arena must have no
  // regions yet. Runs the model on `compute`, or on a stream of its own.
  //
  // `data_parallel`: the data-parallel group (null or one rank: a single process). Collective:
  // every rank of the group creates its engine with the same config and settings, and then calls
  // step(), loss(), evaluate(), the state getters/setters and checkpoint save/load in the same
  // order; each step's batch is the rank's own share (docs/parallel.md). The engine splits the
  // group for its threads and keeps it referenced: the Comm must outlive the engine.
  //
  // `tensor_parallel`: the tensor-parallel group (null or one rank: the whole model). Collective
  // likewise; every rank of the group trains the same batch, holds and updates its shard
  // (describe_model(config.model, {size, rank})), and the state getters, set_param, and
  // save/load_weights speak of full parameters (gathered over the group, or sliced from
  // full values). Composes with `data_parallel` (make_process_groups' tp and dp groups).
  //
  // `pipeline`: the pipeline group (null or one rank: no pipeline). Its rank is this process's
  // stage: the engine places, fetches and updates only the stage's modules
  // (pipeline_stages(config.model, size, config.seq_len)) and step() runs
  // settings.pipeline_schedule with the activations sent to the next stage and the activation
  // gradients to the previous one. With settings.pipeline_virtual_stages = v > 1 (interleaved
  // 1F1B) the stage runs chunks s, s + p, ... of pipeline_stages(config.model, v·size, seq_len)
  // in interleaved_pipeline_ops order, each chunk's output going to stage (s + 1) mod size; the
  // errors for what it refuses name strata.pipeline_virtual_stages. Collective over the group
  // like the data-parallel group (every stage calls step() with the whole micro-batches: each
  // uses the tokens or targets its modules need); the Comm must outlive the engine. With a
  // data-parallel group too (pp x dp of
  // make_process_groups), each pipeline trains its share of the batch and the data-parallel
  // reductions run per stage over the stage's units. With a tensor-parallel group too (the
  // TP x PP x DP grid of make_process_groups), every stage is a tensor-parallel group: each rank
  // holds its shard of its stage's modules, and the state getters answer for the stage's
  // parameters, gathered over the stage's tensor-parallel group. With a pipeline, loss() and
  // evaluate() run the forwards through the stages and return the last stage's value on every
  // rank; save_weights() and save_checkpoint() are collective over every group and write the
  // files one process writes: each stage's first rank writes the state of the parameters its
  // stage holds (its tensors of the one weights file at their offsets, its checkpoint module
  // files), the first rank of the first stage creates and publishes the weights file and the
  // checkpoint directory once every stage agreed; loading reads the files on every rank and
  // keeps the stage's parameters, so files move between pipeline shapes and one process.
  static Result<std::unique_ptr<OffloadEngine>> create(const TrainerConfig& config,
                                                       const OffloadSettings& settings, Device& device,
                                                       Stream* compute = nullptr, Comm* data_parallel = nullptr,
                                                       Comm* tensor_parallel = nullptr, Comm* pipeline = nullptr);
  ~OffloadEngine();
  OffloadEngine(const OffloadEngine&) = delete;
  OffloadEngine& operator=(const OffloadEngine&) = delete;

  const OffloadPlan& plan() const;
  const OffloadSettings& settings() const;
  const TrainerConfig& config() const;

  // One update from grad_accum micro-batches (as Trainer::step). Returns once the loss and the
  // gradient norm are known; host optimizer work may still run, overlapped with the next call.
  //
  // Faults (docs/offload.md "Faults"): a failed call is retried by calling again. A step whose
  // call failed changed nothing and simply runs again. An error of a step's host update after
  // step() returned (e.g. an NVMe write under the NVMe optimizer) is reported by the next call;
  // the call after that first finishes the failed update in place — only the units and NVMe
  // sub-groups that do not hold it yet, from the gradients kept for it — and then does its own
  // work, so the trajectory continues bit for bit. With more than one process, or when units
  // were updated during backward, the error stays until load_checkpoint.
  Result<StepMetrics> step(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets);
  // Forward only over one micro-batch; the mean loss.
  Result<double> loss(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets);
  Result<EvalResult> evaluate(std::span<const std::int32_t> tokens, std::int64_t max_windows);
  // Forward and backward of up to grad_accum micro-batches, no update; gradients are left where
  // they live (all-device optimizer placement only: for gradient checks).
  Result<double> loss_and_gradients(std::span<const std::int32_t> inputs,
                                    std::span<const std::int32_t> targets);

  // Waits for every update in flight; reports the first error any engine thread held.
  Status synchronize();

  // Parameter `index` (its owner's storage for a tied alias) wherever it lives. Tensor parallel:
  // full parameters (the getters gather the shards over the group: collective).
  Status set_param(int index, std::span<const float> values);  // working and master copies
  Result<std::vector<float>> get_param(int index);              // working copy, widened to fp32
  Result<std::vector<float>> get_master(int index);             // fp32 master
  Result<std::vector<float>> get_exp_avg(int index);
  Result<std::vector<float>> get_exp_avg_sq(int index);

  Status save_weights(const std::string& path, WeightFormat format = WeightFormat::kHuggingFace);
  Status load_weights(const std::string& path);

  // The complete training state — per parameter its working copy, fp32 master and Adam moments,
  // wherever each lives, plus the step count that drives the schedule and bias correction — as a
  // checkpoint under `root` (checkpoint.hpp: atomic, checksummed, one file per module, tensors
  // named "param/", "master/", "exp_avg/", "exp_avg_sq/" + the parameter's name). client_state
  // is the caller's JSON object (data position, RNG, run settings), returned by
  // load_checkpoint. Waits for updates in flight. Returns the published directory.
  Result<std::string> save_checkpoint(const std::string& root, const std::string& client_state = "{}",
                                      int keep = 2);
  // Restores a checkpoint (a checkpoint directory, or a root: the one its `latest` names) saved
  // under any placement. Everything is verified first — every file's checksum, the model
  // config, every tensor's presence, dtype and shape — so a bad checkpoint is an error naming
  // the file or tensor and leaves the engine as it was. (An I/O error while reading after that
  // leaves the state undefined: load again.) The next step() continues as step manifest.step+1.
  Result<CheckpointManifest> load_checkpoint(const std::string& path);

  OffloadStats stats() const;
  void observe(const ObserveSettings& settings);
  // The spans buffered since observe({.trace = true}) as Chrome/Perfetto trace JSON: one track
  // per stream (compute, offload.h2d, offload.grads), per copy engine direction, the host
  // optimizer thread, the NVMe lanes and the engine's caller (docs/observability.md).
  Status write_trace(const std::string& path) const;
  Model& model();
  std::int64_t steps_done() const;
  std::string optimizer_name() const;

  struct Impl;

 private:
  friend struct offload_detail::EngineFaults;
  static Result<std::unique_ptr<OffloadEngine>> create_with_faults(const TrainerConfig& config,
                                                                   const OffloadSettings& settings, Device& device,
                                                                   Stream* compute, Comm* data_parallel,
                                                                   Comm* tensor_parallel,
                                                                   Comm* pipeline,
                                                                   const nvme_detail::IoFaults* faults);
  explicit OffloadEngine(std::unique_ptr<Impl> impl);
  Result<StepMetrics> step_once(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata
