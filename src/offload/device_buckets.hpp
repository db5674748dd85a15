// Gradient buckets of the device optimizer with data parallelism (docs/parallel.md "Gradient
// buckets"; the cpu backend; stages 0 and 2-3, with or without a pipeline: a pipeline stage's
// buckets are cut per chunk from its modules and each opens and closes inside one backward op of
// the schedule). The buckets themselves are the placement's (partition::GradBuckets); this part
// owns their buffers and the collectives in flight.
//
// Stage 0 (Sharding::device_grads_bucketed alone) all-reduces each bucket's range of
// offload.grads in place as backward leaves its last module (the last micro-batch only). Stage >= 2
// (Sharding::device_grads_sharded): offload.grads holds this rank's slices; backward writes into
// bucket buffers (offload.grad_buckets, each unit padded to size x chunk), reduce-scattered in
// place unit by unit into the slices every micro-batch.
//
// Threads: the caller assigns the buffers (open_buckets, close_buckets; stream order keeps their
// uses apart); the collectives, their waits and the slices' accumulation run in compute-stream
// host functions (launch_bucket, finish_through, drain_buckets; the compute thread only) over
// dp_buckets.
#pragma once

#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

#include "offload/engine_core.hpp"

namespace strata::offload_detail {

class DeviceOptimizer;

class DeviceBuckets : public EnginePart {
 public:
  DeviceBuckets(EngineCore& core, DeviceOptimizer& devopt) : EnginePart(core), devopt_(devopt) {}

  // Carved by the engine's setup (stage >= 2: the offload.grad_buckets slots).
  std::vector<char*> bucket_buf;      // the slots (units padded, then the receive part)
  std::vector<int> bucket_buf_owner;  // per buffer: the open bucket using it, -1 free (caller)
  std::vector<int> bucket_buf_of;     // per bucket: its buffer while open, -1 (caller)
  // Per buffer: when it was last released in this step (0: not yet), and the step's release count
  // (caller). open_buckets takes the free buffer released longest ago: its reduce-scatter, the
  // oldest in flight, is the likeliest to be done, so compute rarely waits for it.
  std::vector<std::uint64_t> bucket_buf_freed;
  std::uint64_t bucket_frees = 0;

  // Caller: before module m's backward, a buffer for each bucket it opens (taken, zeroed, its
  // units bound); after it, each bucket it closes gets its collective launched by a
  // compute-stream host function.
  Status open_buckets(int m);
  Status close_buckets(int m, bool first_micro, bool last_micro, std::int64_t step);
  // Compute thread: bucket b's collective (stage >= 2: one reduce-scatter per unit, from buffer
  // `buf`; the first micro-batch's overwrite the slices, later ones add).
  Status launch_bucket(int b, int buf, bool accumulate);
  // Stage >= 2: the buckets in flight finished in launch order, up to and including the one in
  // buffer `buf` (all of them with -1); none when `buf` has none in flight.
  Status finish_through(int buf);
  // Every collective in flight waited and finished, in launch order (before the update).
  Status drain_buckets();
  // Caller, at a step's start: a failed step may have left collectives in flight and buffers
  // taken: the buffers are freed and a compute-stream host function waits out and drops them.
  Status discard();
  // Stage 0: bucket b's range of offload.grads (its units are adjacent): byte offset and elements.
  std::pair<std::uint64_t, std::uint64_t> bucket_range(int b) const;

 private:
  struct InFlight {  // stage >= 2: a bucket's reduce-scatters (compute thread only)
    int bucket = -1, buf = -1;
    bool accumulate = false;
    std::vector<CommWork> work;  // one per unit of the bucket
  };
  DeviceOptimizer& devopt_;
  std::deque<InFlight> in_flight;                     // launch order
  std::vector<std::pair<int, CommWork>> bucket_work;  // stage 0 in flight (compute thread)
};

}  // namespace strata::offload_detail
