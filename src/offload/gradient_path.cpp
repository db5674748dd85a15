// The host optimizer's gradient path (gradient_path.hpp).
#include "offload/gradient_path.hpp"

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

namespace strata::offload_detail {

Status GradientPath::acquire_grads(int m, bool first_micro) {
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
        STRATA_RETURN_IF_ERROR(
            gstream->host_fn("offload: NVMe read of grad." + std::to_string(u), [this, u, staging]() {
              detail::HostSpan span(tracer, track.nvme_fetch, TraceCounter::kNvmeRead, "read gradients", u,
                                    placement.units[static_cast<std::size_t>(u)].grad_bytes);
              // Sharded: only stage 1 restores, its unsharded local sum.
              return placement.sharding.host_state_sharded ? local_grads_io(u, staging, false)
                                                           : read_grad_shards(u, staging);
            }));
        from = staging;
      }
      STRATA_RETURN_IF_ERROR(tracer.stream_begin(*gstream, track.grads));
      STRATA_RETURN_IF_ERROR(
          gstream->copy_async(g.dev, from, placement.units[uu].grad_bytes, CopyKind::kHostToDevice));
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

Status GradientPath::enqueue_reduce(int u, bool first_micro, bool last_micro, std::int64_t step) {
  const bool accumulate = settings.zero_stage >= 2 && !first_micro;
  const bool scan = grads_on_nvme && last_micro && step > 0;
  const auto inv_scale = static_cast<float>(1.0 / core.now.loss_scale);
  return gstream->host_fn(
      "offload: data-parallel reduce-scatter of grad." + std::to_string(u),
      [this, u, accumulate, scan, inv_scale]() { return reduce_unit_grads(u, accumulate, scan, inv_scale); });
}

Status GradientPath::reduce_after_failure(int m, bool first_micro, bool last_micro, std::int64_t step) {
  if (!placement.sharding.host_state_sharded || !(last_micro || settings.zero_stage >= 2)) return ok_status();
  for (int u : placement.units[static_cast<std::size_t>(m)].reads) {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (placement.units[uu].last_touch != m || placement.units[uu].grad_bytes == 0 ||
        placement.device_state(u))
      continue;
    STRATA_RETURN_IF_ERROR(enqueue_reduce(u, first_micro, last_micro, step));
  }
  return ok_status();
}

Status GradientPath::release_grads(int m, bool first_micro, bool last_micro, std::int64_t step, double lr) {
  if (placement.sharding.optimizer_on_device) return ok_status();
  for (int u : placement.units[static_cast<std::size_t>(m)].reads) {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (placement.units[uu].last_touch != m || gslot_of[uu] < 0 || placement.device_state(u)) continue;
    // Delayed update: the previous step's update of u may still read its gradients (host_grads,
    // the shard or the NVMe shards), which this copy out overwrites. (Otherwise the forward
    // already waited for it.)
    if (delayed) STRATA_RETURN_IF_ERROR(ledger_.wait_updated(u));
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
    STRATA_RETURN_IF_ERROR(traced_copy(*gstream, track.copy_d2h, "copy", out, g.dev,
                                       placement.units[uu].grad_bytes, CopyKind::kDeviceToHost, u));
    STRATA_RETURN_IF_ERROR(tracer.stream_end(*gstream, track.grads, TraceCounter::kNone, "gradients out", u,
                                             placement.units[uu].grad_bytes));
    STRATA_RETURN_IF_ERROR(gstream->record(*g.free));
    if (reduce) {
      STRATA_RETURN_IF_ERROR(enqueue_reduce(u, first_micro, last_micro, step));
    } else if (grads_on_nvme && placement.sharding.host_state_sharded) {
      // Stage 1's earlier micro-batches: the unsharded local sum waits on NVMe, unreduced.
      STRATA_RETURN_IF_ERROR(gstream->host_fn(
          "offload: NVMe write of grad_local." + std::to_string(u), [this, u, out]() -> Status {
            detail::HostSpan span(tracer, track.nvme_publish, TraceCounter::kNvmeWrite, "write gradients", u,
                                  placement.units[static_cast<std::size_t>(u)].grad_bytes);
            return local_grads_io(u, out, true);
          }));
    } else if (grads_on_nvme) {
      // Out through the one staging buffer (gstream order keeps its uses apart), scanned for the
      // norm on the way when this is the step's last touch, then to NVMe.
      const bool scan = last_micro && step > 0;
      const auto inv_scale = static_cast<float>(1.0 / core.now.loss_scale);
      STRATA_RETURN_IF_ERROR(gstream->host_fn(
          "offload: NVMe write of grad." + std::to_string(u), [this, u, out, scan, inv_scale]() -> Status {
            const std::size_t uu = static_cast<std::size_t>(u);
            if (scan) {
              // scan_norm: tensor parallel counts replicated
              // parameters on tp rank 0 only.
              STRATA_ASSIGN_OR_RETURN(
                  landed_stats[uu],
                  scan_norm(*host_opt, u, out, 0, placement.units[uu].grad_bytes / 4, inv_scale));
            }
            detail::HostSpan span(tracer, track.nvme_publish, TraceCounter::kNvmeWrite, "write gradients", u,
                                  placement.units[uu].grad_bytes);
            return write_grad_shards(u, out);
          }));
    }
    g.unit = -1;
    gslot_of[uu] = -1;
    bound_grads[uu] = nullptr;
    if (last_micro && step > 0 && u == placement.stage.tied_unit && comms.pp_tied) {
      // Pipeline: the tied unit's gradient is summed with the other end's once this stage's whole
      // schedule has run (run_pipeline), not on the gradient stream here: the other end may still
      // need this stage's activation gradients, which wait behind this stream's buckets.
      STRATA_RETURN_IF_ERROR(gstream->record(*landed[uu]));
      tied_landed = Command{Command::kLanded, u, step, lr, core.now.opt_step, core.now.loss_scale};
    } else if (last_micro && step > 0) {
      STRATA_RETURN_IF_ERROR(gstream->record(*landed[uu]));
      {
        std::lock_guard<std::mutex> lock(ledger_.mu);
        ledger_.commands.push_back(
            Command{Command::kLanded, u, step, lr, core.now.opt_step, core.now.loss_scale});
      }
      ledger_.cv.notify_all();
    }
  }
  return ok_status();
}

Status GradientPath::reduce_unit_grads(int u, bool accumulate, bool scan, float inv_scale) {
  const std::size_t uu = static_cast<std::size_t>(u);
  const std::uint64_t n = placement.units[uu].grad_bytes / 4, c = placement.units[uu].slice.chunk,
                      len = placement.units[uu].slice.len;
  const std::uint64_t P = static_cast<std::uint64_t>(dp_size);
  float* send = rs_send.floats();
  std::fill(send + n, send + P * c, 0.0f);
  STRATA_RETURN_IF_ERROR(dp_wait(
      dp_tracks[1], comms.dp_grads->reduce_scatter(send, rs_recv.data(), c, DType::kF32, ReduceOp::kSum),
      "reduce-scatter gradients", u, 4 * P * c));
  const float* src = rs_recv.floats();
  if (grads_on_nvme) {
    // The same additions as on shard_grads below, on the slice read back from NVMe.
    char* slice = rs_recv.bytes();
    if (accumulate) {
      slice = grad_staging.bytes();
      {
        detail::HostSpan span(tracer, track.nvme_fetch, TraceCounter::kNvmeRead, "read gradients", u,
                              4 * len);
        STRATA_RETURN_IF_ERROR(read_grad_shards(u, slice));
      }
      float* acc = reinterpret_cast<float*>(slice);
      for (std::uint64_t i = 0; i < len; ++i) acc[i] += src[i];
    }
    if (scan) {
      STRATA_ASSIGN_OR_RETURN(
          landed_stats[uu], scan_norm(*host_opt, u, slice, placement.units[uu].slice.begin, len, inv_scale));
    }
    detail::HostSpan span(tracer, track.nvme_publish, TraceCounter::kNvmeWrite, "write gradients", u,
                          4 * len);
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

Status GradientPath::write_grad_shards(int u, const char* src) {
  return grad_shards_io(u, const_cast<char*>(src), true);
}

Status GradientPath::read_grad_shards(int u, char* dst) { return grad_shards_io(u, dst, false); }

// Every shard of unit u's gradients at once (the optimizer's sub-groups), then waits for all.
// The sub-groups' bounds are unit element positions; sharded they cover this rank's slice, which
// `buf` holds from its first element.
Status GradientPath::grad_shards_io(int u, char* buf, bool write) {
  const auto& b = placement.units[static_cast<std::size_t>(u)].sub_groups;
  const std::uint64_t first_element =
      placement.sharding.host_state_sharded ? placement.units[static_cast<std::size_t>(u)].slice.begin : 0;
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

Status GradientPath::local_grads_io(int u, char* buf, bool write) {
  const TensorKey key{unit_key("grad_local", u), 0};
  const std::uint64_t n = placement.units[static_cast<std::size_t>(u)].grad_bytes;
  return keep_grad_io((write ? swap->write(key, buf, n) : swap->read(key, buf, n)).wait());
}

Status GradientPath::sum_tied_landed(const Command& c) {
  if (!grads_on_nvme) {
    const auto [grads, n] = unit_grads(c.unit);  // data parallel: this rank's reduced slice
    return core.reduce_tied_grads(reinterpret_cast<float*>(grads), n);
  }
  // Gradients on NVMe: the unit's final gradients (this rank's reduced slice when sharded) were
  // scanned and written on the gradient stream before the other end's part was known. Read them
  // back through grad_staging (the gradient stream is idle: synchronized by the caller), sum,
  // scan again (the statistics the optimizer thread merges are the summed gradients', as
  // unit_grads' scan is with host gradients) and write them back for the ring's reads.
  const std::size_t uu = static_cast<std::size_t>(c.unit);
  const std::uint64_t first = placement.sharding.host_state_sharded ? placement.units[uu].slice.begin : 0;
  const std::uint64_t n = placement.sharding.host_state_sharded ? placement.units[uu].slice.len
                                                                : placement.units[uu].grad_bytes / 4;
  char* buf = grad_staging.bytes();
  {
    detail::HostSpan span(tracer, track.nvme_fetch, TraceCounter::kNvmeRead, "read gradients", c.unit, 4 * n);
    STRATA_RETURN_IF_ERROR(read_grad_shards(c.unit, buf));
  }
  STRATA_RETURN_IF_ERROR(core.reduce_tied_grads(reinterpret_cast<float*>(buf), n));
  STRATA_ASSIGN_OR_RETURN(
      landed_stats[uu], scan_norm(*host_opt, c.unit, buf, first, n, static_cast<float>(1.0 / c.loss_scale)));
  detail::HostSpan span(tracer, track.nvme_publish, TraceCounter::kNvmeWrite, "write gradients", c.unit,
                        4 * n);
  return write_grad_shards(c.unit, buf);
}

void GradientPath::reset() {
  // A unit is in a bucket exactly when its gslot_of names one (acquire_grads and release_grads
  // set and clear both together).
  for (std::size_t u = 0; u < gslot_of.size(); ++u) {
    if (gslot_of[u] < 0) continue;
    gslot_of[u] = -1;
    bound_grads[u] = nullptr;
  }
  for (GradSlot& g : gslots) g.unit = -1;
  (void)take_grad_io_error();  // the failed pass's, reported by its call already
}

}  // namespace strata::offload_detail
