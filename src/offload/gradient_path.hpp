// The gradient path of the host optimizer (docs/offload.md "Gradients"): with the optimizer off
// the device, gradients are accumulated in device buckets (offload.grad_slots) from a unit's
// first backward touch to its last, then copied to the host (host_grads), or reduce-scattered
// into this rank's slice (shard_grads, data parallel), or written to NVMe (swap keys "grad.<u>");
// a later micro-batch restores the bucket from the host first, so the device performs the very
// additions of the resident run (bitwise equivalence). A unit's final gradients "land": its
// landed[u] event is recorded on the gradient stream and the optimizer thread is told (kLanded).
//
// Invariants: a bucket is never zeroed or restored before its previous copy out finished
// (bucket.free); the landed event of u follows every write of u's final gradients.
//
// Threads: the caller enqueues; the copies, reduce-scatters and NVMe writes run on the gradient
// stream (its host functions); the optimizer thread reads what landed.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "offload/engine_core.hpp"
#include "offload/update_ledger.hpp"

namespace strata::offload_detail {

struct GradSlot {
  float* dev = nullptr;
  int unit = -1;
  std::unique_ptr<Event> done, free, ready;
};

class GradientPath : public EnginePart {
 public:
  GradientPath(EngineCore& core, UpdateLedger& ledger) : EnginePart(core), ledger_(ledger) {}

  // Carved by the engine's setup, in the plan's order.
  std::vector<GradSlot> gslots;
  std::vector<int> gslot_of;            // per unit: its gradient bucket, -1
  HostMem host_grads;                   // at host_at(grad_begin(u)): landed (or stage 1's local) gradients
  HostMem grad_staging;                 // NVMe gradients: every landing and restore, in gradient-stream order
  std::vector<GradStats> landed_stats;  // NVMe gradients: scanned on the way out (gradient stream)
  std::vector<std::unique_ptr<Event>> landed;  // per unit: its final gradients are on the host
  HostMem shard_grads;                         // data parallel: this rank's slices of the reduced gradients
  HostMem rs_send, rs_recv;  // gradient stream: one unit padded to size x chunk, and this rank's chunk
  // Pipeline: the host optimizer's tied unit, landed but not yet summed with the other end's.
  std::optional<Command> tied_landed;

  // Before module m's backward: a bucket for each unit it starts (zeroed, or restored from the
  // host on later micro-batches), bound to the model.
  Status acquire_grads(int m, bool first_micro);
  // After module m's backward: each unit whose last touch it was leaves its bucket (copy out,
  // reduce-scatter, NVMe write); on the last micro-batch it lands.
  Status release_grads(int m, bool first_micro, bool last_micro, std::int64_t step, double lr);
  // Data parallel: unit u's gradients reduce-scattered into this rank's slice on the gradient
  // stream (from rs_send, where release_grads copied them).
  Status enqueue_reduce(int u, bool first_micro, bool last_micro, std::int64_t step);
  // keep_modules after a failure: the reduce-scatters of the units whose last touch is module m,
  // on whatever rs_send holds, so the data-parallel peers' collectives find this rank.
  Status reduce_after_failure(int m, bool first_micro, bool last_micro, std::int64_t step);
  // Gradient stream: unit u's gradients (in rs_send) reduce-scattered; this rank's slice stored
  // into (or, accumulate, added to) shard_grads. Gradients on NVMe: the slice is read back
  // through grad_staging to accumulate, scanned into landed_stats[u] when `scan` (the step's
  // final slice; the same scan the optimizer thread does on shard_grads) and written to NVMe.
  Status reduce_unit_grads(int u, bool accumulate, bool scan, float inv_scale);
  // NVMe gradients: unit u's fp32 gradients as swap shards "grad.<u>" (the optimizer's
  // sub-groups), every shard at once, then waited for all. Data parallel: this rank's reduced
  // slice only (the sub-groups cut that slice), `buf` holding the slice; the unsharded local
  // gradients that stage 1 carries between micro-batches go to one key "grad_local.<u>"
  // (local_grads_io) instead.
  Status write_grad_shards(int u, const char* src);
  Status read_grad_shards(int u, char* dst);
  Status grad_shards_io(int u, char* buf, bool write);
  Status local_grads_io(int u, char* buf, bool write);
  // Caller, after the schedule: the host optimizer's tied unit summed over the first and the
  // last stage (reduce_tied_grads), from host memory or, gradients on NVMe, read back, summed,
  // rescanned into landed_stats and written again.
  Status sum_tied_landed(const Command& c);
  // The gradients the optimizer thread scans for unit u: this rank's slice when sharded.
  std::pair<char*, std::uint64_t> unit_grads(int u) const {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (placement.sharding.host_state_sharded)
      return {shard_grads.bytes() + 4 * placement.units[uu].slice_offset, placement.units[uu].slice.len};
    return {host_at(host_grads, grad_begin(u)), placement.units[uu].grad_bytes / 4};
  }
  // agree_before_norm: the first gradient read or write error of the pass in flight (NVMe
  // gradients). It is kept here instead of failing the gradient stream, whose later host
  // functions hold collectives every rank joins (the reduce-scatters); the caller takes it once
  // the stream is idle (take_grad_io_error) and fails the step, agreed like any stream error.
  Status keep_grad_io(Status s) {
    if (s.ok() || !agree_before_norm()) return s;
    std::lock_guard<std::mutex> lock(grad_io_mu_);
    if (grad_io_error_.ok()) grad_io_error_ = std::move(s);
    return ok_status();
  }
  Status take_grad_io_error() {
    std::lock_guard<std::mutex> lock(grad_io_mu_);
    return std::exchange(grad_io_error_, ok_status());
  }
  // After a failed step: every bucket forgotten. Streams must be idle.
  void reset();

 private:
  UpdateLedger& ledger_;
  std::mutex grad_io_mu_;
  Status grad_io_error_;  // guarded by grad_io_mu_
};

}  // namespace strata::offload_detail
