// The NVMe optimizer ring (nvme_ring.hpp).
#include "offload/nvme_ring.hpp"

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

#include "offload/host_optimizer.hpp"

namespace strata::offload_detail {

std::vector<NvmeRing::NvmeItem> NvmeRing::nvme_items(const std::vector<int>& order) const {
  std::vector<NvmeItem> items;
  for (int u : order) {
    const std::size_t groups = placement.units[static_cast<std::size_t>(u)].sub_groups.size() - 1;
    for (std::size_t c = 0; c < groups; ++c) items.push_back({u, c});
    // Sharded, every rank takes part in every unit's parameter all-gather, even with nothing to
    // update; agreeing per unit, in every unit's agreement.
    if (groups == 0 && ((placement.sharding.host_state_sharded &&
                         placement.units[static_cast<std::size_t>(u)].param_bytes > 0) ||
                        agree_per_unit()))
      items.push_back({u, kNoNvmeGroup});
  }
  return items;
}

std::vector<int> NvmeRing::nvme_update_order(std::int64_t step) const {
  std::vector<int> order;
  for (int i = 0; i < M; ++i) {
    const int u = delayed ? M - 1 - i : i;
    // Partial offload: the device units are the device's.
    if (!placement.split_device(u) && placement.units[static_cast<std::size_t>(u)].in_stage &&
        !ledger_.unit_holds(u, step))
      order.push_back(u);
  }
  return order;
}

void NvmeRing::issue_early_reads(std::int64_t step) {
  if (settings.optimizer != Tier::kNvme || !early_reads.empty() || early_reads_step == step) return;
  // With several processes too (data, tensor, pipeline parallel, any ZeRO stage): nothing here
  // talks. The reads are of this rank's own keys, which only this thread writes; the update's
  // collectives (the all-gathers, the per-unit and per-stage agreements) are issued as before, the
  // update only finding some of its reads done (docs/offload.md "Optimizer-state reads during
  // backward").
  early_reads_step = step;
  const std::vector<NvmeItem> items = nvme_items(nvme_update_order(step));
  const std::size_t R = ring.size();
  for (std::size_t k = 0; k < items.size() && k + 1 < R; ++k) {
    EarlyRead e{items[k], IoHandle(), 0};
    if (items[k].group != kNoNvmeGroup) {
      const auto& b = placement.units[static_cast<std::size_t>(items[k].unit)].sub_groups;
      const std::uint64_t len = b[items[k].group + 1] - b[items[k].group];
      e.issued_at = tracer.now_ns();
      e.handle =
          swap->read(TensorKey{unit_key("optim", items[k].unit), static_cast<std::uint32_t>(items[k].group)},
                     ring[k % R].data(), 12 * len);
      early_reads_issued.fetch_add(1, std::memory_order_relaxed);
    }
    early_reads.push_back(std::move(e));
  }
}

void NvmeRing::drop_early_reads() {
  // A read not taken over by an update still writes its ring buffer: it must end first.
  // Those the update took over were moved out of the list (their handles are no longer valid).
  for (EarlyRead& e : early_reads) {
    if (!e.handle.valid()) continue;
    (void)e.handle.wait();
    early_reads_dropped.fetch_add(1, std::memory_order_relaxed);
  }
  early_reads.clear();
}

// One function on purpose: the ring's reads, the writes in flight and their retiring, the staging
// buffers and the per-unit agreement are one pipeline whose local state (the write queue, each
// ring buffer's last write, the unit in flight) every step of the loop reads; its invariants are
// stated once, here, beside the code that keeps them.
//
// Streams the optimizer state of each unit in `order` through the pinned ring, one sub-group
// ([master | m | v] of up to sub_group_size elements, swap key "optim.<u>" shard c) per buffer:
// reads run ahead of the update by up to ring.size() - 1 sub-groups and each is written back as
// soon as it is updated. A unit's updated working parameters gather in one of two staging
// buffers and go to their home after its last sub-group. Writes retire in issue order; a unit
// counts as updated (its parameters may be fetched) once all of its writes have retired, since a
// read before that would return the previous version.
Status NvmeRing::update_units_nvme(const std::vector<int>& order, std::int64_t step, double lr, float scale,
                                   std::int64_t done_step) {
  using Item = NvmeItem;
  constexpr std::size_t kNoGroup = kNoNvmeGroup;
  const std::vector<Item> items = nvme_items(order);
  const std::size_t R = ring.size();
  std::vector<IoHandle> reads(items.size()), grad_reads(items.size());
  std::vector<std::int64_t> read_issued_at(items.size(), 0);
  // The reads issued during backward (issue_early_reads) for the items this update streams
  // first, each into the buffer its own read would use; the others are waited out before their
  // buffers are reused (a retry, a unit that already holds the step: a different list).
  std::size_t early_taken = 0;
  while (early_taken < early_reads.size() && early_taken < items.size() && early_taken + 1 < R &&
         early_reads[early_taken].item.unit == items[early_taken].unit &&
         early_reads[early_taken].item.group == items[early_taken].group) {
    reads[early_taken] = std::move(early_reads[early_taken].handle);
    read_issued_at[early_taken] = early_reads[early_taken].issued_at;
    ++early_taken;
  }
  drop_early_reads();
  struct Pending {
    std::uint64_t seq;
    IoHandle handle;  // invalid: nothing to wait for (parameters published synchronously)
    int unit_done;    // >= 0: the unit's last write
    int trace_track;  // where its span goes (-1: none)
    int unit;
    std::int64_t group;  // >= 0: the write of this sub-group of `unit` (group_step once it retired)
    std::uint64_t bytes;
    std::int64_t issued_at;
  };
  std::deque<Pending> writes;
  std::uint64_t seq = 0;
  std::vector<std::uint64_t> ring_seq(R, 0);
  std::uint64_t out_seq[2] = {0, 0};
  // Once a write failed no later unit counts as updated (writes retire in issue order, so a
  // unit's own sub-group writes retire before its last entry): a retry finishes the rest, and
  // group_step says which of their sub-groups are on disk already.
  bool write_failed = false;
  // Several ranks (agree_per_unit): a unit counts as updated only once every rank's update of it
  // succeeded. A rank's failure inside a unit (a read, the optimizer, a write retiring) is kept
  // in unit_status and the rank goes on through the unit's collectives (the parameters'
  // all-gather) without computing or writing more; at the unit's end its writes are retired and
  // the ranks agree (agree_unit). Every rank thus stops at the same unit and none waits in a
  // collective its peer skipped. The writes of a unit retire before the next unit's update starts
  // (its reads are already in flight), so that the verdict covers them.
  const bool agree = agree_per_unit();
  Status unit_status;
  auto note = [&](Status s) {
    if (!s.ok() && unit_status.ok()) unit_status = std::move(s);
  };
  auto retire_through = [&](std::uint64_t through) -> Status {
    Status first;
    while (!writes.empty() && writes.front().seq <= through) {
      Pending p = std::move(writes.front());
      writes.pop_front();
      Status s = p.handle.valid() ? p.handle.wait() : ok_status();
      if (!s.ok() && first.ok()) first = s;
      if (!s.ok()) write_failed = true;
      if (s.ok() && p.trace_track >= 0) {
        tracer.add_span(p.trace_track, TraceCounter::kNvmeWrite, "write", p.unit, p.bytes, p.issued_at);
      }
      if (s.ok() && p.group >= 0) {
        group_step[static_cast<std::size_t>(p.unit)][static_cast<std::size_t>(p.group)] = done_step;
      }
      if (!agree && !write_failed && p.unit_done >= 0) ledger_.unit_done(p.unit_done, done_step);
    }
    return first;
  };
  auto push_write = [&](IoHandle h, int unit_done, int trace_track, int unit, std::uint64_t bytes,
                        std::int64_t issued_at, std::int64_t group = -1) {
    writes.push_back(Pending{++seq, std::move(h), unit_done, trace_track, unit, group, bytes, issued_at});
    return seq;
  };
  auto bounds = [&](const Item& it) {
    const auto& b = placement.units[static_cast<std::size_t>(it.unit)].sub_groups;
    return std::pair<std::uint64_t, std::uint64_t>{b[it.group], b[it.group + 1]};
  };
  // Returns the error of the write it retired first (agree: the read is issued all the same, the
  // ring buffer being free once that write ended either way).
  auto issue = [&](std::size_t i) -> Status {
    if (items[i].group == kNoGroup) return ok_status();
    const std::size_t r = i % R;
    // The ring buffer's previous sub-group must be fully written back before it is overwritten.
    Status retired = retire_through(ring_seq[r]);
    if (!retired.ok() && !agree) return retired;
    const auto [b0, b1] = bounds(items[i]);
    const TensorKey key{unit_key("optim", items[i].unit), static_cast<std::uint32_t>(items[i].group)};
    if (i >= early_taken) {  // else read during backward already
      read_issued_at[i] = tracer.now_ns();
      reads[i] = swap->read(key, ring[r].data(), 12 * (b1 - b0));
    }
    if (grads_on_nvme) {
      grad_reads[i] = swap->read(TensorKey{unit_key("grad", items[i].unit), key.shard},
                                 ring[r].bytes() + 12 * (b1 - b0), 4 * (b1 - b0));
    }
    return retired;
  };
  const std::uint64_t wsize = half ? 2 : 4;
  Status first_error;
  std::size_t issued = 0, units_started = 0;
  char* out_unit = nullptr;
  // After a unit's last sub-group. Sharded, this rank's slice of the updated parameters is in
  // ag_send: all-gathered into out_unit unless each rank keeps its slice (stage 3). A collective:
  // every rank runs it for every unit it reaches.
  auto gather_unit = [&](int u) -> Status {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (!placement.sharding.host_state_sharded || placement.units[uu].gathered_at_fetch ||
        placement.units[uu].param_bytes == 0)
      return ok_status();
    const std::uint64_t c = placement.units[uu].slice.chunk;
    STRATA_RETURN_IF_ERROR(dp_wait(dp_tracks[2],
                                   comms.dp_params->all_gather(host_.ag_send.data(), host_.ag_recv.data(), c,
                                                               half ? DType::kBF16 : DType::kF32),
                                   "gather parameters", u, static_cast<std::uint64_t>(dp_size) * c * wsize));
    homes_.from_elements(u, host_.ag_recv.bytes(), out_unit);
    return ok_status();
  };
  // Then its updated parameters (or, stage 3, this rank's slice) to their home.
  auto publish_unit = [&](int u) -> Status {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (placement.sharding.host_state_sharded && placement.units[uu].gathered_at_fetch) {
      STRATA_RETURN_IF_ERROR(homes_.write_param_slice(u, host_.ag_send.bytes(), delayed));
      push_write(IoHandle(), u, -1, u, 0, 0);
      return ok_status();
    }
    if (placement.units[uu].home == Tier::kNvme) {
      const std::int64_t t0 = tracer.now_ns();
      out_seq[(units_started - 1) % 2] =
          push_write(swap->write(homes_.param_key(u, delayed), out_unit, placement.units[uu].param_bytes), u,
                     track.nvme_publish, u, placement.units[uu].param_bytes, t0);
      if (delayed)
        homes_.next_fresh[uu] = 1;  // counts once the write retired (the unit is marked updated then)
      return ok_status();
    }
    STRATA_RETURN_IF_ERROR(
        homes_.publish_params(u, out_unit));  // copied out at once: the staging buffer is free again
    push_write(IoHandle(), u, -1, u, 0, 0);
    return ok_status();
  };
  auto finish_unit = [&](int u) -> Status {
    if (!agree) {
      STRATA_RETURN_IF_ERROR(gather_unit(u));
      return publish_unit(u);
    }
    // A rank that failed in the unit still takes part in the all-gather; a peer that did not
    // publishes parameters holding its stale slice, which the agreed retry publishes again
    // before anything reads them (the unit is not marked updated). A failed all-gather is the
    // communicator's: reported as it is, not agreed on.
    STRATA_RETURN_IF_ERROR(gather_unit(u));
    if (unit_status.ok() && placement.units[static_cast<std::size_t>(u)].param_bytes > 0)
      note(publish_unit(u));
    note(retire_through(UINT64_MAX));
    Status own = std::exchange(unit_status, ok_status());
    STRATA_RETURN_IF_ERROR(host_.agree_unit(u, done_step, std::move(own)));
    ledger_.unit_done(u, done_step);
    return ok_status();
  };
  // The next forward reaches the first units of this order first, and its fetch of each waits
  // for the unit's mark, which the lazy retiring above would give only when a ring buffer or the
  // staging buffer is next reused (after a later unit's read and Adam). For the first `urgent`
  // units the writes are retired, and the unit marked, as soon as they are issued; later units
  // keep the overlap of one unit's writes with the next one's Adam. (Agreeing ranks retire every
  // unit's writes at its end already.)
  const int urgent = std::max(1, settings.prefetch_modules) + 1;
  // Their writes also go out with no later unit's read beside them: the reads ahead stop at the
  // last urgent unit's items until the current item is past it (the first R − 1 items' reads
  // were issued during backward anyway). `rank_of[i]`: the position of item i's unit in `order`.
  std::vector<int> rank_of(items.size(), 0);
  for (std::size_t i = 1; i < items.size(); ++i) {
    rank_of[i] = rank_of[i - 1] + (items[i].unit != items[i - 1].unit ? 1 : 0);
  }
  auto may_read_ahead = [&](std::size_t next, std::size_t current) {
    return agree || next <= current || rank_of[next] < urgent || rank_of[current] >= urgent;
  };
  auto end_unit = [&](int u) -> Status {
    STRATA_RETURN_IF_ERROR(finish_unit(u));
    if (agree || units_started > static_cast<std::size_t>(urgent)) return ok_status();
    return retire_through(seq);
  };
  // A sub-group whose new version is on disk already (a retry): only the working parameters are
  // taken from its master (read back), into out_unit or, sharded, this rank's slice in ag_send.
  auto rebuild_from_master = [&](int u, const float* master, std::uint64_t b0, std::uint64_t len) -> Status {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (!placement.sharding.host_state_sharded)
      return homes_.working_from_master(u, master, b0, len, out_unit);
    return core.for_each_part(u, b0, len, [&](const OwnedParam&, std::uint64_t lo, std::uint64_t hi) {
      return core.master_to_working(master + (lo - b0),
                                    host_.ag_send.bytes() + (lo - placement.units[uu].slice.begin) * wsize,
                                    hi - lo);
    });
  };
  for (std::size_t i = 0; i < items.size() && first_error.ok(); ++i) {
    if (i == 0 || items[i].unit != items[i - 1].unit) {
      first_error = host_.hold_update(items[i].unit, done_step);
      if (!first_error.ok()) break;
    }
    while (issued < items.size() && issued < i + R - 1 && may_read_ahead(issued, i)) {
      Status s = issue(issued++);
      if (agree) {
        note(std::move(s));
      } else if (!s.ok()) {
        first_error = std::move(s);
        break;
      }
    }
    if (!first_error.ok()) break;
    const std::size_t r = i % R;
    const int u = items[i].unit;
    const std::size_t uu = static_cast<std::size_t>(u);
    if (items[i].group == kNoGroup) {
      ++units_started;
      first_error = retire_through(out_seq[(units_started - 1) % 2]);
      out_unit = param_out[(units_started - 1) % 2].bytes();
      if (agree) {
        note(std::move(first_error));
        first_error = ok_status();
      }
      if (first_error.ok()) first_error = end_unit(u);
      continue;
    }
    const auto [b0, b1] = bounds(items[i]);
    const std::uint64_t len = b1 - b0;
    const bool first_group = items[i].group == 0;
    const bool last_group = items[i].group + 2 == placement.units[uu].sub_groups.size();
    Status s = reads[i].wait();
    if (grads_on_nvme) {
      // Waited also when the state's read failed: the ring buffer is reused by a later read.
      Status g = grad_reads[i].wait();
      if (s.ok()) s = std::move(g);
    }
    if (s.ok()) {
      tracer.add_span(track.nvme_ring + static_cast<int>(r), TraceCounter::kNvmeRead, "read", u,
                      (grads_on_nvme ? 16 : 12) * len, read_issued_at[i]);
    }
    if (!s.ok()) {
      s = s.with_context("NVMe optimizer state of module '" + layout().modules[uu].name + "' (sub-group " +
                         std::to_string(items[i].group) + ")");
      if (!agree) {
        first_error = std::move(s);
        break;
      }
      note(std::move(s));
    }
    if (first_group) {
      ++units_started;
      // The staging buffer's previous unit must be written to its home first.
      Status retired = retire_through(out_seq[(units_started - 1) % 2]);
      if (!agree && !retired.ok()) {
        first_error = std::move(retired);
        break;
      }
      note(std::move(retired));
      out_unit = param_out[(units_started - 1) % 2].bytes();
    }
    if (agree && !unit_status.ok()) {
      // Failed in this unit: nothing more is computed or written; its end still agrees.
      if (last_group) first_error = finish_unit(u);
      continue;
    }
    float* master = ring[r].floats();
    if (group_step[uu][items[i].group] >= done_step) {
      // A retry: this sub-group's new version is on disk (read back above); only the unit's
      // working parameters are needed from it.
      Status rebuilt = rebuild_from_master(u, master, b0, len);
      if (!agree && !rebuilt.ok()) {
        first_error = std::move(rebuilt);
        break;
      }
      note(std::move(rebuilt));
      if (last_group) first_error = end_unit(u);
      continue;
    }
    std::optional<detail::HostSpan> span(std::in_place, tracer, track.optimizer, TraceCounter::kOptimizer,
                                         "adam", u);
    Status updated;
    for (int k : owned_of_unit[uu]) {
      const OwnedParam& o = owned[static_cast<std::size_t>(k)];
      const std::uint64_t a = o.grad_in_unit / 4;
      const std::uint64_t lo = std::max<std::uint64_t>(a, b0), hi = std::min<std::uint64_t>(a + o.n, b1);
      if (lo >= hi) continue;
      OptimizerBuffers b;
      b.master = master + (lo - b0);
      b.grad = grads_on_nvme ? ring[r].bytes() + 12 * len + (lo - b0) * 4
               : placement.sharding.host_state_sharded
                   ? grads_.shard_grads.bytes() +
                         4 * (placement.units[uu].slice_offset + lo - placement.units[uu].slice.begin)
                   : host_at(grads_.host_grads, grad_begin(u)) + lo * 4;
      b.grad_dtype = DType::kF32;
      b.exp_avg = master + len + (lo - b0);
      b.exp_avg_sq = master + 2 * len + (lo - b0);
      b.moment_dtype = DType::kF32;
      char* out = placement.sharding.host_state_sharded
                      ? host_.ag_send.bytes() + (lo - placement.units[uu].slice.begin) * wsize
                      : out_unit + o.param_in_unit + (lo - a) * wsize;
      b.param_out = half ? out : nullptr;
      b.out_dtype = wdtype;
      b.n = hi - lo;
      updated = host_opt->update(hyper_of(config.optimizer, lr, o.decay), step, scale, b);
      if (!updated.ok()) break;
      if (!half) std::memcpy(out, b.master, b.n * 4);  // fp32: the working copy is the master
    }
    span.reset();
    if (!updated.ok()) {
      if (!agree) {
        first_error = std::move(updated);
        break;
      }
      note(std::move(updated));
      if (last_group) first_error = finish_unit(u);
      continue;
    }
    ring_seq[r] =
        push_write(swap->write(TensorKey{unit_key("optim", u), static_cast<std::uint32_t>(items[i].group)},
                               master, 12 * len),
                   -1, track.nvme_ring + static_cast<int>(r), u, 12 * len, tracer.now_ns(),
                   static_cast<std::int64_t>(items[i].group));
    if (!last_group) continue;
    first_error = end_unit(u);
  }
  Status s = retire_through(UINT64_MAX);
  if (first_error.ok()) first_error = s;
  for (IoHandle& h : reads) {
    if (h.valid()) (void)h.wait();
  }
  for (IoHandle& h : grad_reads) {
    if (h.valid()) (void)h.wait();
  }
  return first_error;
}

}  // namespace strata::offload_detail
