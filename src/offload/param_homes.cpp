// Parameter homes (param_homes.hpp).
#include "offload/param_homes.hpp"

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

#include "parallel/agreement.hpp"
#include "strata/log.hpp"

namespace strata::offload_detail {

Status ParamHomes::read_unit_params(int u, std::vector<char>& bytes) {
  const std::size_t uu = static_cast<std::size_t>(u);
  bytes.resize(placement.units[uu].param_bytes);
  if (bytes.empty()) return ok_status();
  if (placement.units[uu].gathered_at_fetch) {
    // Collective: every rank's slice, all-gathered on the caller's Comm.
    const std::uint64_t w = half ? 2 : 4, c = placement.units[uu].slice.chunk;
    std::vector<char> mine(c * w), all(c * w * static_cast<std::size_t>(dp_size));
    if (placement.sharding.device_params_sliced)
      STRATA_RETURN_IF_ERROR(compute->synchronize());  // the slice is read in place
    return gather_unit_params(u, *comms.dp_caller, dp_tracks[0], mine.data(), all.data(), bytes.data(),
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

Status ParamHomes::write_unit_params(int u, const std::vector<char>& bytes) {
  const std::size_t uu = static_cast<std::size_t>(u);
  if (bytes.empty()) return ok_status();
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
      STRATA_RETURN_IF_ERROR(
          stager->upload(resident + placement.units[uu].resident_offset, bytes.data(), bytes.size()));
      return compute->synchronize();
    case Tier::kHost:
      return ok_status();
    case Tier::kNvme:
      return swap->write(param_key(u), bytes.data(), bytes.size()).wait();
  }
  return ok_status();
}

Status ParamHomes::read_param_slice(int u, char* slice) {
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

Status ParamHomes::write_param_slice(int u, const char* slice, bool next) {
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
    std::memcpy(next ? delayed_next.bytes() + placement.units[uu].next_offset
                     : host_params.bytes() + placement.units[uu].host_offset,
                slice, bytes);
  }
  // Set before the unit is marked updated (publish_delayed reads it after waiting for that).
  if (next) next_fresh[uu] = 1;
  return ok_status();
}

void ParamHomes::to_elements(int u, const char* working, char* elements) const {
  const std::uint64_t w = half ? 2 : 4;
  for (int k : owned_of_unit[static_cast<std::size_t>(u)]) {
    const OwnedParam& o = owned[static_cast<std::size_t>(k)];
    std::memcpy(elements + o.grad_in_unit / 4 * w, working + o.param_in_unit, o.n * w);
  }
}

void ParamHomes::from_elements(int u, const char* elements, char* working) const {
  const std::uint64_t w = half ? 2 : 4;
  for (int k : owned_of_unit[static_cast<std::size_t>(u)]) {
    const OwnedParam& o = owned[static_cast<std::size_t>(k)];
    std::memcpy(working + o.param_in_unit, elements + o.grad_in_unit / 4 * w, o.n * w);
  }
}

Status ParamHomes::gather_unit_params(int u, Comm& comm, int trace_track, char* send, char* recv,
                                      char* working, bool agree) {
  const std::size_t uu = static_cast<std::size_t>(u);
  const std::uint64_t w = half ? 2 : 4, len = placement.units[uu].slice.len;
  {
    detail::HostSpan span(
        tracer, track.nvme_fetch,
        placement.units[uu].home == Tier::kNvme ? TraceCounter::kNvmeRead : TraceCounter::kNone, "read slice",
        u, len * w);
    Status read = read_param_slice(u, send);
    if (agree) {
      STRATA_RETURN_IF_ERROR(parallel::agree_on_read(
          comm, read, "its slice of module '" + layout().modules[uu].name + "' (working parameters)",
          "data-parallel"));
    }
    STRATA_RETURN_IF_ERROR(read);
  }
  return gather_read_slice(u, comm, trace_track, send, recv, working);
}

Status ParamHomes::gather_read_slice(int u, Comm& comm, int trace_track, char* send, char* recv,
                                     char* working) {
  const std::size_t uu = static_cast<std::size_t>(u);
  const std::uint64_t w = half ? 2 : 4, c = placement.units[uu].slice.chunk,
                      len = placement.units[uu].slice.len;
  std::memset(send + len * w, 0, (c - len) * w);
  STRATA_RETURN_IF_ERROR(dp_wait(trace_track,
                                 comm.all_gather(send, recv, c, half ? DType::kBF16 : DType::kF32),
                                 "gather parameters", u, static_cast<std::uint64_t>(dp_size) * c * w));
  from_elements(u, recv, working);
  return ok_status();
}

Status ParamHomes::early_gather_unit_params(int u, bool mine, char* working, std::atomic<bool>* early_ok) {
  early_ok->store(false);
  const std::size_t uu = static_cast<std::size_t>(u);
  const std::uint64_t w = half ? 2 : 4, len = placement.units[uu].slice.len;
  char* send = fetch_send.bytes();
  char* recv = fetch_recv.bytes();
  if (mine) {
    // Read only after the gate saw the agreed mark: the slice then holds the step's update, and
    // nothing rewrites it before this rank's next pass has used or dropped this copy.
    detail::HostSpan span(
        tracer, track.nvme_fetch,
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
  Status agreed = comms.dp_fetch->all_reduce(&missing, &any_missing, 1, DType::kF32, ReduceOp::kMax).wait();
  if (!agreed.ok()) {
    return agreed.with_context("data parallel: agreeing on the early fetch of module '" +
                               layout().modules[uu].name + "'");
  }
  if (any_missing != 0.0f) return ok_status();  // every rank refetches it on demand
  STRATA_RETURN_IF_ERROR(gather_read_slice(u, *comms.dp_fetch, dp_tracks[3], send, recv, working));
  early_ok->store(true);
  return ok_status();
}

// Publishes unit u's updated working parameters (`bytes`, the unit's working layout) to its home.
Status ParamHomes::publish_params(int u, const char* bytes) {
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
      STRATA_RETURN_IF_ERROR(traced_copy(*h2d, track.copy_h2d, "copy",
                                         resident + placement.units[uu].resident_offset, host, n,
                                         CopyKind::kHostToDevice, u));
      STRATA_RETURN_IF_ERROR(tracer.stream_end(*h2d, track.h2d, TraceCounter::kNone, "upload", u, n));
      STRATA_RETURN_IF_ERROR(h2d->record(*uploaded[uu]));
      uploaded_recorded[uu] = 1;
      return ok_status();
    }
    case Tier::kHost: {
      // Delayed update: the next copy; publish_delayed copies it home once no fetch reads it.
      char* host = delayed ? delayed_next.bytes() + placement.units[uu].next_offset
                           : host_params.bytes() + placement.units[uu].host_offset;
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

Status ParamHomes::working_from_master(int u, const float* master, std::uint64_t first, std::uint64_t n,
                                       char* out_unit) const {
  const std::uint64_t w = half ? 2 : 4;
  return core.for_each_part(u, first, n, [&](const OwnedParam& o, std::uint64_t lo, std::uint64_t hi) {
    return core.master_to_working(master + (lo - first),
                                  out_unit + o.param_in_unit + (lo - o.grad_in_unit / 4) * w, hi - lo);
  });
}

Status ParamHomes::publish_delayed() {
  if (pending_publish == 0) return ok_status();
  // Every unit's update first: a failed one uploads nothing, so the device keeps P[t-1] whole
  // and a retried step computes as before.
  for (int u = 0; u < M; ++u) STRATA_RETURN_IF_ERROR(ledger_.wait_update_of(u, pending_publish));
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
        const std::uint64_t bytes =
            placement.units[uu].gathered_at_fetch ? placement.units[uu].slice.len * (half ? 2 : 4) : n;
        std::memcpy(host_params.bytes() + placement.units[uu].host_offset,
                    delayed_next.bytes() + placement.units[uu].next_offset, bytes);
      } else {
        param_shard[uu] = 1 - param_shard[uu];
      }
      continue;
    }
    STRATA_RETURN_IF_ERROR(tracer.stream_begin(*h2d, track.h2d));
    STRATA_RETURN_IF_ERROR(
        traced_copy(*h2d, track.copy_h2d, "copy", resident + placement.units[uu].resident_offset,
                    host_params.bytes() + placement.units[uu].host_offset, n, CopyKind::kHostToDevice, u));
    STRATA_RETURN_IF_ERROR(tracer.stream_end(*h2d, track.h2d, TraceCounter::kNone, "upload (delayed)", u, n));
    STRATA_RETURN_IF_ERROR(h2d->record(*uploaded[uu]));
    uploaded_recorded[uu] = 1;
  }
  pending_publish = 0;
  publish_before_rerun = false;
  return ok_status();
}

Status ParamHomes::await_upload(int u) {
  const std::size_t uu = static_cast<std::size_t>(u);
  if (!uploaded_recorded[uu]) return ok_status();
  detail::HostSpan span(tracer, track.optimizer, TraceCounter::kNone, "wait upload", u);
  return uploaded[uu]->synchronize();
}

}  // namespace strata::offload_detail
