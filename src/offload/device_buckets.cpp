// The device optimizer's gradient buckets (device_buckets.hpp).
#include "offload/device_buckets.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <utility>

#include "offload/device_optimizer.hpp"

namespace strata::offload_detail {

Status DeviceBuckets::open_buckets(int m) {
  for (int u : placement.units[static_cast<std::size_t>(m)].reads) {
    const int b = placement.units[static_cast<std::size_t>(u)].bucket.index;
    if (b < 0 || bucket_buf_of[static_cast<std::size_t>(b)] >= 0) continue;
    // The free buffer released longest ago (ties: the lowest). The lowest free one is often the
    // buffer whose reduce-scatter the previous module just launched, and compute would wait for it
    // at once. Which buffer a bucket takes changes no bits: finish_through reduces in launch order.
    int i = -1;
    for (std::size_t k = 0; k < bucket_buf_owner.size(); ++k)
      if (bucket_buf_owner[k] < 0 &&
          (i < 0 || bucket_buf_freed[k] < bucket_buf_freed[static_cast<std::size_t>(i)]))
        i = static_cast<int>(k);
    if (i < 0) {
      return internal_error("offload: no gradient bucket buffer free for bucket " + std::to_string(b) +
                            " at module " + std::to_string(m) + " (the plan counted " +
                            std::to_string(bucket_buf.size()) + ")");
    }
    bucket_buf_owner[static_cast<std::size_t>(i)] = b;
    bucket_buf_of[static_cast<std::size_t>(b)] = i;
    char* buf = bucket_buf[static_cast<std::size_t>(i)];
    // The buffer's previous bucket may still be reduce-scattering from it (overlap_comm): finished
    // first, in compute-stream order, then zeroed (the padding to size x chunk included).
    if (settings.overlap_comm) {
      STRATA_RETURN_IF_ERROR(
          compute->host_fn("offload: gradient bucket buffer " + std::to_string(i) + " free",
                           [this, i]() { return finish_through(i); }));
    }
    STRATA_RETURN_IF_ERROR(
        compute->memset_async(buf, 0, placement.buckets.buckets[static_cast<std::size_t>(b)].bytes));
    for (int v : placement.buckets.buckets[static_cast<std::size_t>(b)].units) {
      bound_grads[static_cast<std::size_t>(v)] =
          reinterpret_cast<float*>(buf + placement.units[static_cast<std::size_t>(v)].bucket.offset);
      STRATA_RETURN_IF_ERROR(bind(v));
    }
  }
  return ok_status();
}

Status DeviceBuckets::close_buckets(int m, bool first_micro, bool last_micro, std::int64_t step) {
  for (std::size_t b = 0; b < placement.buckets.buckets.size(); ++b) {
    if (placement.buckets.buckets[b].close_after != m) continue;
    const int bi = static_cast<int>(b);
    if (placement.sharding.device_grads_sharded) {
      // Every micro-batch: reduced into the slices (the first micro-batch's overwrite them).
      const int i = bucket_buf_of[b];
      if (i < 0)
        return internal_error("offload: gradient bucket " + std::to_string(b) + " closed but never opened");
      const bool accumulate = !first_micro;
      STRATA_RETURN_IF_ERROR(compute->host_fn(
          "offload: data-parallel reduce-scatter of gradient bucket " + std::to_string(b),
          [this, bi, i, accumulate]() -> Status { return launch_bucket(bi, i, accumulate); }));
      bucket_buf_owner[static_cast<std::size_t>(i)] = -1;
      bucket_buf_freed[static_cast<std::size_t>(i)] = ++bucket_frees;
      bucket_buf_of[b] = -1;
      for (int v : placement.buckets.buckets[b].units) {
        bound_grads[static_cast<std::size_t>(v)] = nullptr;
        STRATA_RETURN_IF_ERROR(bind(v));
      }
    } else if (last_micro && step > 0) {
      // Stage 0: the local sum of every micro-batch, all-reduced once (earlier micro-batches only add).
      STRATA_RETURN_IF_ERROR(
          compute->host_fn("offload: data-parallel all-reduce of gradient bucket " + std::to_string(b),
                           [this, bi]() -> Status { return launch_bucket(bi, -1, false); }));
    }
  }
  return ok_status();
}

Status DeviceBuckets::launch_bucket(int b, int buf, bool accumulate) {
  const std::size_t bb = static_cast<std::size_t>(b);
  const std::vector<int>& us = placement.buckets.buckets[bb].units;
  if (!placement.sharding.device_grads_sharded) {
    const auto [begin, n] = bucket_range(b);
    float* g = reinterpret_cast<float*>(reinterpret_cast<char*>(devopt_.dgrads) + begin);
    CommWork w = comms.dp_buckets->all_reduce(g, g, n, DType::kF32, ReduceOp::kSum);
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
    f.work.push_back(comms.dp_buckets->reduce_scatter(
        base + placement.units[uu].bucket.offset, recv + placement.units[uu].bucket.rs_at,
        placement.units[uu].slice.chunk, DType::kF32, ReduceOp::kSum));
  }
  in_flight.push_back(std::move(f));
  if (settings.overlap_comm) return ok_status();
  return finish_through(buf);
}

Status DeviceBuckets::finish_through(int buf) {
  if (buf >= 0 &&
      std::none_of(in_flight.begin(), in_flight.end(), [buf](const InFlight& f) { return f.buf == buf; }))
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
      STRATA_RETURN_IF_ERROR(dp_wait(dp_tracks[1], f.work[k], "reduce-scatter gradient bucket", us[k],
                                     4 * P * placement.units[uu].slice.chunk));
      // This rank's slice: the first micro-batch's overwrites, later ones add (the host tier's
      // stage-2 sum, in micro-batch order: buckets finish in launch order).
      float* dst = devopt_.dgrads + placement.units[uu].slice_offset;
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

Status DeviceBuckets::drain_buckets() {
  for (auto& [b, w] : bucket_work) {
    STRATA_RETURN_IF_ERROR(dp_wait(dp_tracks[1], w, "all-reduce gradient bucket",
                                   placement.buckets.buckets[static_cast<std::size_t>(b)].units.front(),
                                   4 * bucket_range(b).second));
  }
  bucket_work.clear();
  return finish_through(-1);
}

Status DeviceBuckets::discard() {
  // A failed step may have left collectives in flight and buffers taken: wait them out, drop them.
  std::fill(bucket_buf_owner.begin(), bucket_buf_owner.end(), -1);
  std::fill(bucket_buf_freed.begin(), bucket_buf_freed.end(), 0);
  bucket_frees = 0;
  std::fill(bucket_buf_of.begin(), bucket_buf_of.end(), -1);
  return compute->host_fn("offload: discard gradient buckets in flight", [this]() -> Status {
    for (InFlight& f : in_flight)
      for (CommWork& w : f.work) (void)w.wait();
    in_flight.clear();
    for (auto& [b, w] : bucket_work) (void)w.wait();
    bucket_work.clear();
    return ok_status();
  });
}

std::pair<std::uint64_t, std::uint64_t> DeviceBuckets::bucket_range(int b) const {
  const std::vector<int>& us = placement.buckets.buckets[static_cast<std::size_t>(b)].units;
  const int lo = us.back(), hi = us.front();  // backward order: highest unit first
  const std::uint64_t begin = grad_begin(lo);
  return {begin, (grad_begin(hi) + placement.units[static_cast<std::size_t>(hi)].grad_bytes - begin) / 4};
}

}  // namespace strata::offload_detail
