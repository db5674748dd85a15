// The device optimizer (docs/offload.md "The optimizer on the device"): gradients, fp32 masters
// and moments in the device regions offload.grads and optim.*, updated on the compute stream after
// backward — the whole model (offload_optimizer none), or a partial split's device units
// (offload_optimizer.ratio < 1) once the host tier's norm is known. On the cpu backend the update
// is one host function running the CPU Adam on the same elements as the host tier (the same
// bits); on cuda the fused kernel (fused_adam_cuda) after a deterministic sum of squares.
//
// Data parallel (docs/parallel.md "ZeRO stages 1-3 in device memory"). Stage 0 all-reduces the
// gradients (per bucket on the cpu backend, DeviceBuckets; once after backward on cuda). Stages
// 1-3 (Sharding::device_state_sharded) hold this rank's slices of the state: the update
// reduce-scatters each unit's gradients (stage >= 2: already reduced per bucket), merges the
// per-unit statistics over the ranks in rank order and all-gathers the updated parameters
// (device_update_sharded), through offload.dp_staging. A partial split with data parallelism
// (Sharding::split_state_sharded) reduces its device units through offload.dp_staging on
// dp_device after backward (stage 2: every micro-batch, into offload.grad_slices) and updates
// this rank's slices once the norm is known (update_device_units_sharded).
//
// Threads: the caller enqueues; everything here that talks runs in compute-stream host
// functions, the only users of dp_params (sharded update), dp_device and tp_model.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "offload/device_buckets.hpp"
#include "offload/engine_core.hpp"
#include "offload/param_homes.hpp"

namespace strata::offload_detail {

class DeviceOptimizer : public EnginePart {
 public:
  DeviceOptimizer(EngineCore& core, ParamHomes& homes)
      : EnginePart(core), buckets(core, *this), homes_(homes) {}

  DeviceBuckets buckets;

  // Carved by the engine's setup, in the plan's order.
  float* dgrads = nullptr;                 // offload.grads ...
  std::uint64_t dgrad_bytes = 0;           // ... its bytes (device_grads_sharded: this rank's slices)
  float* dmaster = nullptr;                // optim.master (16-bit only; fp32 masters are the resident params)
  float* dm = nullptr;                     // optim.exp_avg
  float* dv = nullptr;                     // optim.exp_avg_sq
  float* dgrad_slices = nullptr;           // split, stage 2: offload.grad_slices (this rank's reduced slices)
  char* dev_staging = nullptr;             // offload.dp_staging
  std::optional<CpuOptimizer> device_opt;  // cpu backend
  ArenaBuffer cuda_partials, pinned_norm;  // cuda: the sum of squares' scratch and result
  std::vector<GradStats> dev_stats;        // per unit (device units only): its gradient scan (compute stream)
  std::vector<GradStats> shard_stats;      // device_state_sharded: this rank's slices' scans (compute stream)
  std::vector<GradStats> gathered_stats;   // ... and every rank's (per rank, per unit)

  // The update with the optimizer on the device, in stream order after backward. Writes the
  // step's norm (core.grad_norm) before it returns (cuda) or in its host function (cpu).
  Status device_update(double lr, std::int64_t step);
  // The sharded device optimizer's step (device_state_sharded; cpu backend), one host function on
  // the compute stream after backward: per unit the reduce-scatter of its gradients into this
  // rank's slice, the scan of the slice; the statistics all-gathered and merged unit by unit in
  // rank order; then per unit the update of the slice and the all-gather of its parameters.
  Status device_update_sharded(double lr, std::int64_t step);
  // Stage 0 without buckets (pipeline, cuda): one all-reduce of the whole gradient after backward.
  Status all_reduce_device_grads();
  // Partial optimizer offload, in compute order: the device units' gradient scans into
  // dev_stats (after backward), and their update once the step's norm is known.
  Status scan_device_units();
  Status update_device_units(double lr, std::int64_t step, float scale);
  // Partial offload with data parallelism, on the compute stream: the device units'
  // reduce-scatter into this rank's slices (`accumulate`: stage 2's later micro-batches add to
  // offload.grad_slices), and the update of the slices with the all-gather of their parameters.
  // `chunk` >= 0: only the device units chunk `chunk` of this stage reads (device_units_of_chunk).
  Status reduce_device_units(bool accumulate, int chunk = -1);
  // Zeroes the device units' gradients of chunk `chunk` (all of them for -1) on the compute stream.
  Status zero_device_grads(int chunk = -1);
  Status update_device_units_sharded(double lr, std::int64_t step, float scale);

  // Optimizer state of a device unit (which: 1 master, 2 exp_avg, 3 exp_avg_sq): where its part
  // starts in the device region, and which elements [first, first + len) of the unit it holds
  // (the whole unit, or this rank's slice when the device state is in slices).
  char* dev_state(int u, int which) const {
    const float* base = which == 1 ? dmaster : which == 2 ? dm : dv;
    const std::uint64_t off = placement.sharding.device_state_in_slices()
                                  ? 4 * placement.units[static_cast<std::size_t>(u)].slice_offset
                                  : grad_begin(u);
    return const_cast<char*>(reinterpret_cast<const char*>(base)) + off;
  }
  std::uint64_t dev_state_first(int u) const {
    return placement.sharding.device_state_in_slices()
               ? placement.units[static_cast<std::size_t>(u)].slice.begin
               : 0;
  }
  std::uint64_t dev_state_len(int u) const {
    return placement.sharding.device_state_in_slices()
               ? placement.units[static_cast<std::size_t>(u)].slice.len
               : placement.units[static_cast<std::size_t>(u)].grad_bytes / 4;
  }
  // The reduced gradients of this rank's slice of device unit u (split_state_sharded).
  float* dev_slice_grads(int u) const {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (settings.zero_stage >= 2) return dgrad_slices + placement.units[uu].slice_offset;
    return reinterpret_cast<float*>(reinterpret_cast<char*>(dgrads) + grad_begin(u)) +
           placement.units[uu].slice.begin;
  }
  // Parameter o's fp32 master (16-bit working weights) from its `values`: the part in this
  // rank's elements of the device state.
  Status upload_dev_master(const OwnedParam& o, const float* values);

 private:
  // The device optimizer's buffers of parameter o (master, gradient, moments in the device
  // regions; the working copy in the resident block), for the cpu backend's update.
  OptimizerBuffers device_buffers(const OwnedParam& o) const;
  // This rank's slice of unit u updated with the device optimizer, cut per parameter where the host
  // update of the slice cuts it (the same kernels on the same ranges: the same bits). grad_at(lo):
  // the fp32 gradient of the unit's element lo; param_at(o, lo): that element's working word in
  // parameter o. The updated working words are copied to ag_in (the all-gather's input, element e
  // at (e - begin) * w) unless it is null.
  template <class GradAt, class ParamAt>
  Status update_slice(int u, double lr, std::int64_t step, float scale, GradAt grad_at, ParamAt param_at,
                      char* ag_in);

  // Unit u's whole gradients in offload.grads reduce-scattered over `comm`: padded with zeros to
  // P x chunk in rs_in (the host tier's reduce_unit_grads: the same call and count, so the same
  // bits), this rank's chunk into rs_out.
  Status reduce_scatter_unit(int u, Comm& comm, int trace_track, float* rs_in, float* rs_out);

  ParamHomes& homes_;
};

}  // namespace strata::offload_detail
