// The Placement: what of the model's training state lives where on this process, computed once
// from the offload settings, the model's layout (this tensor-parallel rank's shard) and the
// process's place in the grid, and then only read. The offload engine (setup), its plan
// (OffloadPlan::make, and through it the estimator) and the cost model (predict_step,
// dp_traffic) all take their facts from it; nothing here allocates, talks or touches a device.
//
// Units. Unit u is module u's own storage: its working parameters (the layout's [param_begin,
// param_end), in the working dtype) and its fp32 gradients ([grad_begin, grad_end)). A module
// reads its own unit and, for a tied weight, its owner's (UnitPlacement::reads). One record per
// unit says where each kind of its state lives and how it is cut:
//
//   home, resident_offset      where the working parameters live; resident ones (home device) at
//                              resident_offset in the device region offload.params
//   grad_offset                its place in the engine's fp32 arrays (device gradients and
//                              optimizer state, host gradients and optimizer state)
//   optimizer_on_device        partial optimizer offload (offload_optimizer.ratio < 1): its
//                              gradients and optimizer state stay on the device
//   slice, slice_offset        this data-parallel rank's elements of the unit (ZeRO slices) and
//                              where they sit packed in the rank's shard
//   gathered_at_fetch          stage 3: its home holds only this rank's slice of the working
//                              parameters; a fetch all-gathers every rank's
//   slice_at_home              stage 3 in device memory: the slice lives in offload.params
//   sub_groups                 NVMe optimizer: the pieces [master | m | v] streams in
//   in_stage, holder_stage,    pipeline: whether this stage holds it, the lowest stage that does
//   chunk                      (its statistics count), the chunk of this stage whose modules read it
//   bucket                     the device optimizer's data-parallel gradient bucket holding it
//   norm_ranges                tensor parallel: the elements whose squares this rank adds to the
//                              gradient norm (every element of the full model counted once)
//
// Invariants (checked by is_valid, which the tests call): units are laid out in module order, so
// a stage's grad_offsets increase; the device units of a partial split are the prefix
// [0, device_opt_bytes) of the fp32 arrays; a unit this stage does not hold has no bytes, home
// device and no sub-groups; the slices of a unit tile [0, elements) over the ranks.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "strata/model.hpp"
#include "strata/offload.hpp"

namespace strata::partition {

// A unit of n fp32 elements cut over `size` data-parallel ranks: `size` chunks of `chunk`
// elements, chunk = ceil(n / size) rounded up to a multiple of 64 (parameters start at multiples
// of 64 elements of their unit, kParamAlignment, so each parameter is split at multiples of 64 of
// its own elements and the update is the same bits as unsplit). Rank r owns [begin, begin + len).
struct DpSlice {
  std::uint64_t chunk = 0, begin = 0, len = 0;
};
DpSlice dp_slice_of(std::uint64_t n, int size, int rank);

// Pipeline boundary exchange: a receive is posted one op ahead of the op that reads it, so a
// stage holds two receive buffers per neighbour, used alternately.
inline constexpr int kPipelineRecvBuffers = 2;

// The module ranges stage `stage` runs, in chunk order: with `chunks` = v module chunks per stage
// (interleaved 1F1B) and bounds of v·p + 1 chunk bounds, chunks stage, stage + p, ...,
// stage + (v−1)p; with v = 1 the one range [bounds[stage], bounds[stage + 1]). The bounds are
// pipeline_stages' (checked there), so the ranges are non-empty and increasing.
std::vector<std::pair<int, int>> stage_ranges(const std::vector<int>& bounds, int chunks, int stage);

// The number of pipeline stages (processes) of the settings' bounds; 1 without a pipeline.
int pipeline_stage_count(const OffloadSettings& settings);

// Per module: the units it reads, itself first (tied aliases read their owner's unit).
std::vector<std::vector<int>> reads_of(const ModelLayout& layout);

// The units stage `stage` of a pipeline with module bounds `bounds` (with `chunks` > 1 the chunk
// bounds, see stage_ranges) reads: its modules and what they read (GPT-2's last stage: the
// embedding, for the tied head). All units without a pipeline (bounds empty).
std::vector<char> stage_units(const ModelLayout& layout, const std::vector<int>& bounds, int stage,
                              int chunks = 1);

// Splits module m's fp32 range into sub-groups of at most `limit` elements (plus alignment
// padding between parameters). A parameter is split only at multiples of 64 of its own elements,
// so every SIMD lane sees the element it sees in an unsplit update: the same bits.
std::vector<std::uint64_t> sub_group_bounds(const ModelLayout& layout, std::size_t m, std::uint64_t limit);

// Interleaved 1F1B moves groups of p micro-batches through the chunks: m must be a multiple of p
// (the error names the key, both values and what is expected; the engine and the plan use it).
Status check_interleaved_micro_batches(int chunks, int stages, std::int64_t micro_batches);

// Where unit u sits in a data-parallel gradient bucket of the device optimizer.
struct BucketSeat {
  int index = -1;            // the bucket (-1: none; no gradients, or not bucketed)
  std::uint64_t offset = 0;  // its gradients' byte offset in the bucket's buffer
  std::uint64_t rs_at = 0;   // its chunk's offset (elements) in a rank's receive part
};

// One gradient bucket (docs/parallel.md "Gradient buckets").
struct GradBucket {
  std::vector<int> units;      // in backward-finish order (the highest unit first)
  int open_at = -1;            // the first backward module touching it
  int close_after = 0;         // the last: its collective is launched after that module
  std::uint64_t bytes = 0;     // its buffer (stage >= 2): units padded to size x chunk, aligned
  std::uint64_t rs_chunk = 0;  // elements each rank receives (the sum of its units' chunks)
};

// The gradient buckets of data parallelism with the optimizer on the device. Units are taken in
// the order backward finishes them (their last backward module, latest first; ties by unit,
// highest first) and grouped while the bucket stays within reduce_bucket_elements and the units
// stay adjacent (unit u after u + 1: a bucket is one contiguous range of the fp32 layout, which
// stage 0 all-reduces in place). A unit is never split. Every rank computes the same buckets from
// the layout, so every rank launches the same collectives in the same order. With a pipeline only
// the modules this stage runs count as touching a unit (GPT-2's last stage: the head alone reads
// the tied embedding), and a bucket holds the units of one chunk only (interleaved 1F1B: chunk
// c's backward ops alternate with other chunks'), so every bucket opens and closes inside one
// backward op of the schedule. The units of a bucket stay adjacent in the stage's compact fp32
// layout (grad_offset: only another stage's units, which have no bytes there, may lie between
// them), so stage 0 still all-reduces one contiguous range in place.
struct GradBuckets {
  std::vector<GradBucket> buckets;
  std::uint32_t live = 0;  // the most buckets open at once during backward
  std::uint64_t max_bytes = 0, max_rs_chunk = 0;

  // Stage >= 2: the bucket buffers, each a bucket's units laid out padded to size x chunk
  // elements (each unit is reduce-scattered in place from there) followed by the receive buffer
  // of this rank's chunks; the most buckets open at once, plus one whose reduce-scatter is in
  // flight with overlap_comm.
  std::uint32_t slots(const OffloadSettings& s) const;
  std::uint64_t recv_offset() const;
  std::uint64_t slot_bytes() const;
};

// Everything about one unit; see the top of this file.
struct UnitPlacement {
  std::uint64_t param_bytes = 0;  // working parameters (0: another pipeline stage's unit)
  std::uint64_t grad_bytes = 0;   // fp32 gradients
  std::vector<int> reads;         // the units module u reads, itself first
  // Homes.
  Tier home = Tier::kDevice;
  std::uint64_t resident_offset = 0;  // offload.params: the whole unit, or its slice (slice_at_home)
  std::uint64_t grad_offset = 0;      // in the engine's fp32 arrays
  bool optimizer_on_device = false;   // partial optimizer offload: one of the device units
  bool slice_at_home = false;         // stage 3 in device memory: offload.params holds the slice
  bool gathered_at_fetch = false;     // stage 3: the home holds this rank's slice; fetches gather
  // The host optimizer's copy of the working parameters (host_params): the whole unit, or this
  // rank's slice when gathered_at_fetch; none for an NVMe home. The delayed update's next version
  // (delayed_next) of a host-homed unit likewise.
  std::uint64_t host_offset = 0;
  std::uint64_t next_offset = 0;
  // Data parallel.
  DpSlice slice;                   // this rank's elements of the unit
  std::uint64_t slice_offset = 0;  // in this rank's packed shard (device units apart, see Placement)
  // NVMe optimizer: sub-group boundaries in unit elements (0 = b0 < ... < bk = n; with data
  // parallelism this rank's slice's); sub-group c is swap key "optim.<u>" shard c.
  std::vector<std::uint64_t> sub_groups;
  // Pipeline.
  bool in_stage = true;
  int holder_stage = 0;         // the lowest stage holding the unit (0 without a pipeline)
  int chunk = 0;                // the chunk of this stage whose (highest) module reads it; -1 none
  bool several_chunks = false;  // modules of more than one chunk of this stage read it
  int first_touch = -1;         // this stage's backward modules reading it: the first (highest) ...
  int last_touch = 0;           // ... and the last; first_touch < 0: none
  // Data-parallel gradient bucket (device optimizer).
  BucketSeat bucket;
  // Tensor parallel: element ranges [a, b) of the unit's fp32 layout counted in the norm here
  // (empty without tensor parallelism: every element).
  std::vector<std::pair<std::uint64_t, std::uint64_t>> norm_ranges;

  std::uint64_t elements() const { return grad_bytes / 4; }
  std::size_t sub_group_count() const { return sub_groups.empty() ? 0 : sub_groups.size() - 1; }
};

// The buffers the placement needs, by count and size (the plan's lines and the engine's carving).
struct PlacementSizes {
  std::uint64_t resident_bytes = 0;      // offload.params
  std::uint64_t grad_bytes = 0;          // the engine's fp32 arrays (the stage's units, packed)
  std::uint64_t host_param_bytes = 0;    // host copy of every non-NVMe unit, whole (optimizer off the device)
  std::uint64_t nvme_param_bytes = 0;    // working parameters homed on NVMe, whole
  std::uint64_t host_params_held = 0;    // host_params as carved: whole units, or slices (stage 3)
  std::uint64_t delayed_next_bytes = 0;  // the delayed update's next version of host-homed units
  std::uint32_t param_slots = 0;
  std::uint64_t param_slot_bytes = 0;
  std::uint32_t grad_slots = 0;  // optimizer off the device: gradient buckets in flight
  std::uint64_t grad_slot_bytes = 0;
  std::uint32_t ring_buffers = 0;  // NVMe optimizer pipeline
  std::uint64_t ring_buffer_bytes = 0;
  std::uint64_t param_out_bytes = 0;   // NVMe optimizer: one updated-parameter staging buffer
  std::uint32_t device_opt_units = 0;  // partial offload: the units whose state stays on the device
  std::uint64_t device_opt_bytes = 0;  // ... their fp32 range, the prefix of the engine's arrays
};

// This rank's data-parallel slices, summed. With a partial split the device units and the host
// units are packed apart: slice_offset of a device unit is its slice's place in the device
// regions optim.* (and offload.grad_slices), of a host unit its place in the host arrays.
struct SliceTotals {
  std::uint64_t shard_elements = 0;  // host units (every unit without a split)
  std::uint64_t max_chunk = 0;
  std::uint64_t dev_elements = 0;  // partial split: the device units
  std::uint64_t dev_max_chunk = 0;
};

// How the state is sharded: each flag is named for what it does, and says which of the engine's
// paths run.
struct Sharding {
  bool optimizer_on_device = false;  // offload_optimizer none: update on the compute stream
  // Stages 1-3, optimizer on host or NVMe, several data-parallel ranks: the host master, moments
  // and gradients hold this rank's slices; units land reduce-scattered, updates all-gather.
  bool host_state_sharded = false;
  // Stages 1-3 with the optimizer on the device and several ranks: optim.* hold this rank's
  // slices; the device update reduce-scatters, updates its slice and all-gathers.
  bool device_state_sharded = false;
  // ... stage >= 2: offload.grads holds this rank's slices too; backward writes into bucket
  // buffers reduce-scattered per bucket.
  bool device_grads_sharded = false;
  // Gradient buckets on the compute stream (stage 0 on the cpu backend, or stage >= 2).
  bool device_grads_bucketed = false;
  // Stage 3 in device memory: units above the persistence threshold keep only their slice in
  // offload.params (UnitPlacement::slice_at_home).
  bool device_params_sliced = false;
  // Partial optimizer offload: some units' state on the device, the rest on the host tiers.
  bool optimizer_split = false;
  // ... with several data-parallel ranks: the device units' state holds this rank's slices too.
  bool split_state_sharded = false;
  // The device units' optimizer state holds this rank's slices only.
  bool device_state_in_slices() const { return device_state_sharded || split_state_sharded; }
};

// This process's pipeline stage.
struct StageShape {
  int stages = 1;  // pipeline stages (1: no pipeline)
  int stage = 0;   // this one
  int chunks = 1;  // interleaved 1F1B: module chunks per stage
  // The module ranges this stage runs, in chunk order ({[0, M)} without a pipeline); first and
  // end: the first chunk's start and the last one's end.
  std::vector<std::pair<int, int>> chunk_ranges;
  int first = 0, end = 0;
  int tied_unit = -1;  // the unit both the first and the last stage hold (GPT-2's embedding)
  // Partial split: the device units, in unit order, and per chunk those its modules read.
  std::vector<int> device_units;
  std::vector<std::vector<int>> device_units_of_chunk;
};

// This process's place where the settings do not say it (its data-parallel and tensor-parallel
// rank; sizes and the pipeline stage are the settings'), and the backend (stage 0's buckets run
// on the cpu backend only).
struct Ranks {
  int dp_rank = 0;
  int tp_rank = 0;
  bool cuda = false;
};

struct Placement {
  std::vector<UnitPlacement> units;  // one per module of the layout
  PlacementSizes sizes;
  SliceTotals slices;
  Sharding sharding;
  StageShape stage;
  GradBuckets buckets;  // when sharding.device_grads_bucketed
  int dp_size = 1, dp_rank = 0;
  int tp_size = 1, tp_rank = 0;

  // `layout`: this tensor-parallel rank's shard (describe_model with {tp_size, ranks.tp_rank}).
  static Placement build(const ModelLayout& layout, const OffloadSettings& settings, const Ranks& ranks = {});

  int size() const { return static_cast<int>(units.size()); }
  const UnitPlacement& unit(int u) const { return units[static_cast<std::size_t>(u)]; }
  // The unit's whole working parameters live in offload.params (not a stage-3 slice: those are
  // fetched into param slots like units at home on the host).
  bool resident(int u) const { return unit(u).home == Tier::kDevice && !unit(u).slice_at_home; }
  // The unit's optimizer state is on the device (everything, or one of the split's device units).
  bool device_state(int u) const { return sharding.optimizer_on_device || split_device(u); }
  bool split_device(int u) const { return sharding.optimizer_split && unit(u).optimizer_on_device; }
  bool any_gathered_at_fetch() const;
  bool any_nvme_home() const;
  bool any_slice_at_home() const;
  // Data-parallel rank `rank`'s slices summed (rank 0's are the largest: the plan sizes every
  // rank's buffers by them).
  SliceTotals slice_totals(int rank) const;
  // Partial split, for the plan's lines: the modules this process holds whose optimizer state is
  // on the device (`device`) or on the host, as "modules a..b" runs in module order.
  std::string split_modules(bool device) const;
  // Internal consistency (tests and debug builds): the invariants at the top of this file.
  Status is_valid() const;
};

// The buckets of `p`'s units for `settings` (whether or not the engine buckets: the tests and the
// cost model ask for them), with each unit's seat in `seats` (one per unit) when given.
GradBuckets cut_grad_buckets(const Placement& p, const OffloadSettings& settings,
                             std::vector<BucketSeat>* seats = nullptr);

}  // namespace strata::partition
