// What a placement needs in memory before anything is allocated: the device regions the engine
// carves (and the plan lists), activation estimates, and the swap space. Shared by the plan
// (plan.cpp) and the engine (setup); private to src/offload.
#pragma once

#include <cstdint>
#include <vector>

#include "partition/placement.hpp"
#include "strata/alloc.hpp"
#include "strata/training.hpp"
#include "strata/offload.hpp"

namespace strata::offload_detail {

// Device bytes of each optimizer-state region (optim.master, optim.exp_avg, optim.exp_avg_sq)
// with the optimizer on the device: the fp32 layout of every unit, or, sharded, rank 0's slices
// (the largest: every rank carves this size, so the plan is every rank's).
std::uint64_t device_state_bytes(const partition::Placement& p);

// The data-parallel staging of the sharded device optimizer, in device memory: the reduce-scatter's
// input (size x chunk fp32) and output (chunk; stage 1 only: stages 2-3 reduce in their gradient
// buckets), the parameter all-gather's input (chunk) and output (size x chunk) in the working dtype
// (`w` bytes), for the largest chunk.
std::uint64_t device_dp_staging_bytes(const partition::Placement& p, std::uint64_t w);

// Partial optimizer offload with data parallelism (Sharding::split_state_sharded): the device
// units' bytes per state region (optim.master, optim.exp_avg, optim.exp_avg_sq, and stage 2's
// offload.grad_slices): rank 0's slices of the device units (the largest).
std::uint64_t split_dp_state_bytes(const partition::Placement& p);

// Its device staging (offload.dp_staging), for the largest device unit's chunk c: the
// reduce-scatter's send (size x c fp32) and receive (c fp32), the all-gather's send (c working
// words) and receive (size x c working words).
std::uint64_t split_dp_staging_bytes(const partition::Placement& p, std::uint64_t w);

// The device regions of the placement (the engine carves them in this order; the plan lists them).
std::vector<RegionSpec> device_regions(const partition::Placement& p, const OffloadSettings& settings,
                                       DType working);

// Device bytes of the model's activations, activation gradients and io buffers (model.cpp's
// carving, per token, with alignment slack). The cuda backend's kernel workspace comes on top
// (kCudaWorkspaceBytes, added by OffloadPlan::check_fits). With activation offload the residual
// stream is not counted here: the plan's activation-offload lines hold its ring.
std::uint64_t activation_bytes_estimate(const TrainerConfig& config, bool offload_activations = false);

// The part of activation_bytes_estimate one activation slot holds for modules [b, e) of the
// model (Model::carve_activations, per token): the residuals the range reads and writes, its
// blocks' sets (one shared set with checkpointing), the head's buffers where the range ends with
// the head, and the batch, losses and statistics; with the same 1/16 slack. [0, M) is every
// module's: a slot of plain 1F1B or GPipe (bounded above by the whole model's set).
std::uint64_t activation_slot_estimate(const TrainerConfig& config, int b, int e,
                                       bool offload_activations = false);

inline constexpr std::uint64_t kCudaWorkspaceBytes = 64ull << 20;

// Swap space: every key once; room for the versions being rewritten (a write goes to fresh
// extents and frees the old ones only once published): at most the NVMe optimizer ring, the two
// staging buffers of updated parameters, one unit of gradients and one of host-optimizer
// parameters in flight at a time; and per key, rounding to the allocation granule.
std::uint64_t swap_capacity(const OffloadPlan& plan, const partition::Placement& p,
                            const OffloadSettings& settings);

}  // namespace strata::offload_detail
