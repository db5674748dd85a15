// The engine's test entry points (EngineFaults) and the column view of the placement that the
// tests read. Private to src/offload and the tests; the engine itself reads partition::Placement
// (src/partition/placement.hpp) and the memory sizes of offload/regions.hpp.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "nvme/faults.hpp"
#include "offload/regions.hpp"
#include "partition/placement.hpp"
#include "strata/training.hpp"
#include "strata/model.hpp"
#include "strata/offload.hpp"

namespace strata::offload_detail {

using partition::dp_slice_of;
using partition::DpSlice;
using partition::kPipelineRecvBuffers;
using partition::stage_ranges;

// Stage 3 with the optimizer and the working parameters in device memory (docs/parallel.md
// "Stage 3 in device memory"): every module above stage3_param_persistence_threshold keeps only
// this rank's slice of its working parameters (partition::Sharding::device_params_sliced).
inline bool dp_device_param_sharded(const OffloadSettings& s) {
  return s.dp_size > 1 && s.optimizer == Tier::kDevice && s.params == Tier::kDevice && s.zero_stage == 3;
}

// Stage >= 2 with the optimizer on the device and more than one rank: each rank keeps only its
// slices of the reduced gradients (partition::Sharding::device_grads_sharded).
inline bool dp_device_grad_sharded(const OffloadSettings& s) {
  return s.dp_size > 1 && s.optimizer == Tier::kDevice && s.zero_stage >= 2;
}

// The placement as per-module columns, for the tests that predate partition::Placement: built
// from it (describe_units) and holding it (`placement`), so grad_buckets below cuts the same
// buckets the engine does.
struct Units {
  std::vector<Tier> home;
  std::vector<std::uint64_t> pbytes, gbytes, resident_offset, grad_offset;
  std::vector<std::vector<int>> storage;
  std::vector<std::vector<std::uint64_t>> sub_groups;  // empty without the NVMe optimizer
  std::vector<char> device_opt, in_stage, sliced;
  std::uint64_t resident_bytes = 0, host_param_bytes = 0, nvme_param_bytes = 0;
  std::uint32_t param_slots = 0, grad_slots = 0, ring_buffers = 0, device_opt_units = 0;
  std::uint64_t param_slot_bytes = 0, grad_slot_bytes = 0, ring_buffer_bytes = 0, param_out_bytes = 0;
  std::uint64_t device_opt_bytes = 0, grad_bytes = 0;
  std::shared_ptr<const partition::Placement> placement;
};

// `dp_rank`: the NVMe optimizer's sub-groups of a data-parallel rank cover its slice only.
Units describe_units(const ModelLayout& layout, const OffloadSettings& settings, int dp_rank = 0);

// partition::GradBuckets as columns: per bucket, and per unit its bucket (-1: none), its offset in
// the bucket's buffer and its chunk's offset in a rank's receive part.
struct GradBuckets {
  std::vector<std::vector<int>> units;
  std::vector<int> bucket_of;
  std::vector<int> open_at, close_after;
  std::vector<std::uint64_t> bytes;
  std::vector<std::uint64_t> offset;
  std::vector<std::uint64_t> rs_chunk;
  std::vector<std::uint64_t> rs_at;
  std::uint32_t live = 0;
  std::uint64_t max_bytes = 0, max_rs_chunk = 0;
};
GradBuckets grad_buckets(const Units& u, const OffloadSettings& settings);
std::uint32_t grad_bucket_slots(const GradBuckets& g, const OffloadSettings& s);
std::uint64_t grad_bucket_slot_bytes(const GradBuckets& g);

// Tests only: an engine whose I/O engine injects `faults` (src/nvme/faults.hpp), which must
// outlive it.
struct EngineFaults {
  // `pipeline`, `data_parallel`, `tensor_parallel`: as OffloadEngine::create's (a rank of a group
  // whose disk fails).
  static Result<std::unique_ptr<OffloadEngine>> create(const TrainerConfig& config,
                                                       const OffloadSettings& settings, Device& device,
                                                       const nvme_detail::IoFaults* faults,
                                                       Comm* pipeline = nullptr,
                                                       Comm* data_parallel = nullptr,
                                                       Comm* tensor_parallel = nullptr);
  // Tests only: parameter `index`'s working copy set to `values`, its fp32 master left as it is
  // (the delayed update's reference: gradients taken at other parameters than the ones updated).
  static Status set_working_param(OffloadEngine& engine, int index, std::span<const float> values);
  // Tests only: every device-to-host copy of the engine's state (parameters, master, moments read
  // for get_param, the state getters, save_weights, checkpoints) returns `fault` until it is
  // cleared with ok_status(), as a failing device copy would. Caller thread, between calls.
  static void fail_state_downloads(OffloadEngine& engine, Status fault);
  // Tests only: the next step() (host optimizer) fails with `fault` once its passes ran through
  // and its streams are idle, as a stream error its call sees then (a local failure before the
  // norm, after every collective of the pass). Once. Caller thread, between calls.
  static void fail_next_pass(OffloadEngine& engine, Status fault);
  // Tests only: the compute stream fails with `fault` at the next access of module `module` (the
  // next forward's), so the rest of the pass's compute work, collectives included, is skipped:
  // a failure that stops this rank's pass before its peers' next collective. Once.
  static void fail_compute_at(OffloadEngine& engine, int module, Status fault);
  // Tests only: the optimizer thread's next update of module `held_module`'s (first) unit waits,
  // before it starts, until the compute stream has run the forward of module `forward_module` in
  // the pass that reads that update; after 30 s the update fails with an error naming both.
  // Once. Caller thread, between calls. Says whether a pass enqueues a module's work while a
  // later unit's update is still running (docs/offload.md "One step").
  static void hold_update_until_forward(OffloadEngine& engine, int held_module, int forward_module);
  // Tests only: the caller's next access of module `module` (the next forward's) returns `fault`,
  // as a caller-side error inside the pass (a pipeline's schedule). Once.
  static void fail_caller_at(OffloadEngine& engine, int module, Status fault);
  // Tests and bench/weights_save.cpp only: while `on`, save_weights without a pipeline takes the
  // earlier path (the first rank gathers every parameter and writes alone), the reference that
  // every rank writing its part must equal byte for byte. Caller thread, between calls.
  static void gather_weights_on_save(OffloadEngine& engine, bool on);
  // This rank does not see the weights file the first rank creates (a rank on another node
  // without a shared file system): save_weights takes the gather path, or fails with a pipeline.
  static void hide_weights_file(OffloadEngine& engine, bool on);
  // Tests only: a rank dying in the middle of a parallel save. While `writes` is non-zero, this
  // rank raises SIGKILL in save_weights (every rank writing its part) right after its `writes`-th
  // range write into the temporary file: after the header was written (the writer's, before any
  // rank writes) and some of this rank's ranges were. 0 turns it off. Caller thread, between calls.
  static void kill_during_save(OffloadEngine& engine, std::uint64_t writes);
};

}  // namespace strata::offload_detail
