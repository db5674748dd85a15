// The fetcher (fetcher.hpp).
#include "offload/fetcher.hpp"

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

#include "strata/log.hpp"

namespace strata::offload_detail {

void Fetcher::begin_pass() {
  record.clear();
  pos = 0;
  trace_ok = !trace.empty();
}

void Fetcher::note_access(int code) {
  if (trace_ok && (pos >= trace.size() || trace[pos] != code)) {
    trace_ok = false;  // the order changed: stay correct (fetch on demand) and re-record
    ++mismatches;
    STRATA_LOG(kDebug, kOffload) << "offload: module order differs from the recorded trace at access " << pos
                                 << "; re-tracing";
  }
  record.push_back(code);
  ++pos;
}

int Fetcher::predicted(std::size_t j) const {
  if (!trace_ok) return -1;
  if (j < trace.size()) return trace[j];
  if (cyclic && j - trace.size() < trace.size()) return trace[j - trace.size()];
  return -1;
}

Status Fetcher::release_slot(int s) {
  ParamSlot& slot = pslots[static_cast<std::size_t>(s)];
  if (slot.unit < 0) return ok_status();
  if (slot.used) STRATA_RETURN_IF_ERROR(compute->record(*slot.free));
  slot_of[static_cast<std::size_t>(slot.unit)] = -1;
  bound_params[static_cast<std::size_t>(slot.unit)] = nullptr;
  slot.unit = -1;
  slot.used = false;
  slot.early = false;
  return ok_status();
}

Status Fetcher::forget_fetched(int u) {
  if (slot_of.empty()) return ok_status();
  const int s = slot_of[static_cast<std::size_t>(u)];
  return s < 0 ? ok_status() : release_slot(s);
}

Result<int> Fetcher::fetch(int u, int current_module, std::int64_t gate_step) {
  int s = -1;
  for (std::size_t i = 0; i < pslots.size() && s < 0; ++i)
    if (pslots[i].unit < 0) s = static_cast<int>(i);
  if (s < 0) {
    // Evict a unit the running module does not read.
    const std::vector<int>& cur = current_module >= 0
                                      ? placement.units[static_cast<std::size_t>(current_module)].reads
                                      : std::vector<int>{};
    for (std::size_t i = 0; i < pslots.size() && s < 0; ++i) {
      if (std::find(cur.begin(), cur.end(), pslots[i].unit) == cur.end()) s = static_cast<int>(i);
    }
    if (s < 0) return internal_error("offload: no parameter slot free for module " + std::to_string(u));
    STRATA_RETURN_IF_ERROR(release_slot(s));
  }
  ParamSlot& slot = pslots[static_cast<std::size_t>(s)];
  const std::size_t uu = static_cast<std::size_t>(u);
  const std::uint64_t n = placement.units[uu].param_bytes;
  STRATA_RETURN_IF_ERROR(h2d->wait(*slot.free));
  STRATA_RETURN_IF_ERROR(tracer.stream_begin(*h2d, track.h2d));
  const bool early = gate_step >= 0;
  std::atomic<bool>* early_ok = slot.early_ok.get();
  // An early fetch waits, on the h2d stream, for the update it must see. It never fails the
  // stream: a failed update (the optimizer thread failed after the fetch was issued) or a
  // failed read leaves early_ok false, and the pass refetches the unit on demand, where a read
  // error fails the step as any fetch's does. The failure count, not only worker_error, ends the
  // wait: a retry may clear the error before this thread looks.
  std::uint64_t failures_at_issue = 0;
  if (early) {
    std::lock_guard<std::mutex> lock(ledger_.mu);
    failures_at_issue = ledger_.update_failures;
  }
  auto gate = [this, u, gate_step, failures_at_issue]() {
    std::unique_lock<std::mutex> lock(ledger_.mu);
    auto done = [&] {
      return ledger_.updated_step[static_cast<std::size_t>(u)] >= gate_step || !ledger_.worker_error.ok() ||
             ledger_.update_failures != failures_at_issue;
    };
    // No span of its own: the parameter-read lane holds reads only, and the caller's
    // "wait update" span shows the same wait.
    ledger_.cv.wait(lock, done);
    return ledger_.updated_step[static_cast<std::size_t>(u)] >= gate_step && ledger_.worker_error.ok() &&
           ledger_.update_failures == failures_at_issue;
  };
  // Stage 3: the unit is gathered from every rank's slice, whatever its home (host or NVMe); an
  // early one runs its gate inside the gather's host function (early_gather_unit_params).
  const bool gathered = placement.units[uu].gathered_at_fetch;
  if (early && !gathered && placement.units[uu].home != Tier::kNvme) {
    STRATA_RETURN_IF_ERROR(h2d->host_fn(
        "offload: early fetch of param." + std::to_string(u) + " waits for its update", [gate, early_ok]() {
          early_ok->store(gate());
          return ok_status();
        }));
  }
  if (gathered) {
    char* staging = slot.staging.bytes();
    if (early) {
      STRATA_RETURN_IF_ERROR(h2d->host_fn(
          "offload: early data-parallel gather of param." + std::to_string(u) + " (waits for its update)",
          [this, u, staging, gate, early_ok]() {
            return homes_.early_gather_unit_params(u, gate(), staging, early_ok);
          }));
    } else {
      STRATA_RETURN_IF_ERROR(
          h2d->host_fn("offload: data-parallel gather of param." + std::to_string(u), [this, u, staging]() {
            return homes_.gather_unit_params(u, *comms.dp_fetch, dp_tracks[3], homes_.fetch_send.bytes(),
                                             homes_.fetch_recv.bytes(), staging);
          }));
    }
    STRATA_RETURN_IF_ERROR(
        traced_copy(*h2d, track.copy_h2d, "copy", slot.dev, staging, n, CopyKind::kHostToDevice, u));
  } else if (placement.units[uu].home == Tier::kNvme) {
    SwapStore* store = swap.get();
    void* staging = slot.staging.data();
    const TensorKey key = homes_.param_key(u);
    detail::Tracer* tr = &tracer;
    const int lane = track.nvme_fetch;
    if (early) {
      STRATA_RETURN_IF_ERROR(h2d->host_fn(
          "offload: early NVMe read of " + key.name, [gate, early_ok, store, staging, key, n, tr, lane, u]() {
            if (!gate()) {
              early_ok->store(false);
              return ok_status();
            }
            detail::HostSpan span(*tr, lane, TraceCounter::kNvmeRead, "read", u, n);
            Status read = store->read(key, staging, n).wait();
            if (!read.ok()) {
              STRATA_LOG(kDebug, kOffload) << "offload: early fetch of " << key.name
                                           << " failed; refetched on demand: " << read.to_string();
            }
            early_ok->store(read.ok());
            return ok_status();
          }));
    } else {
      STRATA_RETURN_IF_ERROR(
          h2d->host_fn("offload: NVMe read of " + key.name, [store, staging, key, n, tr, lane, u]() {
            detail::HostSpan span(*tr, lane, TraceCounter::kNvmeRead, "read", u, n);
            return store->read(key, staging, n).wait();
          }));
    }
    STRATA_RETURN_IF_ERROR(
        traced_copy(*h2d, track.copy_h2d, "copy", slot.dev, staging, n, CopyKind::kHostToDevice, u));
  } else {
    STRATA_RETURN_IF_ERROR(traced_copy(*h2d, track.copy_h2d, "copy", slot.dev,
                                       homes_.host_params.bytes() + placement.units[uu].host_offset, n,
                                       CopyKind::kHostToDevice, u));
  }
  STRATA_RETURN_IF_ERROR(tracer.stream_end(*h2d, track.h2d, TraceCounter::kNone, "fetch", u, n));
  STRATA_RETURN_IF_ERROR(h2d->record(*slot.fetched));
  slot.unit = u;
  slot.used = false;
  slot.early = early;
  slot.next_step = early && next_step_fetches;
  slot.gate_step = gate_step;
  slot.gate_failures = failures_at_issue;
  slot_of[uu] = s;
  return s;
}

bool Fetcher::gate_open(const ParamSlot& slot) const {
  return ledger_.updated_step[static_cast<std::size_t>(slot.unit)] >= slot.gate_step ||
         !ledger_.worker_error.ok() || ledger_.update_failures != slot.gate_failures;
}

Status Fetcher::access_params(int m) {
  STRATA_RETURN_IF_ERROR(faults.at_module(m, *compute));  // tests only (EngineFaults)
  for (int u : placement.units[static_cast<std::size_t>(m)].reads) {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (placement.units[uu].param_bytes == 0) continue;
    // The delayed update's caller publishes what this pass may read before the pass starts (the
    // update in flight is the next step's to see); compute then waits for the upload alone.
    if (!delayed) STRATA_RETURN_IF_ERROR(ledger_.wait_updated(u));
    if (placement.resident(u)) {
      if (!placement.sharding.optimizer_on_device && homes_.uploaded_recorded[uu]) {
        STRATA_RETURN_IF_ERROR(tracer.stream_begin(*compute, track.compute));
        STRATA_RETURN_IF_ERROR(compute->wait(*homes_.uploaded[uu]));
        STRATA_RETURN_IF_ERROR(
            tracer.stream_end(*compute, track.compute, TraceCounter::kFetchStall, "wait upload", u));
      }
      continue;
    }
    ++accesses;
    int s = slot_of[uu];
    if (s >= 0 && pslots[static_cast<std::size_t>(s)].early) {
      // Fetched early, gated by the update that wait_updated has just seen published. Whether
      // the gate saw that update (and not a failure) is known once the fetch completed.
      ParamSlot& early = pslots[static_cast<std::size_t>(s)];
      STRATA_RETURN_IF_ERROR(early.fetched->synchronize());
      early.early = false;
      if (!early.early_ok->load()) {
        STRATA_RETURN_IF_ERROR(release_slot(s));
        s = -1;
      } else if (early.next_step) {
        ++early_hits;
      }
    }
    if (s >= 0) {
      ++hits;
    } else {
      STRATA_ASSIGN_OR_RETURN(s, fetch(u, m));
    }
    ParamSlot& slot = pslots[static_cast<std::size_t>(s)];
    STRATA_RETURN_IF_ERROR(tracer.stream_begin(*compute, track.compute));
    STRATA_RETURN_IF_ERROR(compute->wait(*slot.fetched));
    STRATA_RETURN_IF_ERROR(
        tracer.stream_end(*compute, track.compute, TraceCounter::kFetchStall, "wait fetch", u));
    slot.used = true;
    bound_params[uu] = slot.dev;
    STRATA_RETURN_IF_ERROR(bind(u));
  }
  return ok_status();
}

// After module m's work is enqueued: release the slots that the next accesses do not reuse.
Status Fetcher::release_after(int m) {
  const std::size_t window = static_cast<std::size_t>(std::max(1, settings.prefetch_modules));
  for (int u : placement.units[static_cast<std::size_t>(m)].reads) {
    const int s = slot_of[static_cast<std::size_t>(u)];
    if (s < 0) continue;
    bool reused = false;
    for (std::size_t j = pos; j < pos + window && !reused; ++j) {
      const int code = predicted(j);
      if (code < 0) break;
      const auto& st = placement.units[static_cast<std::size_t>(code % M)].reads;
      reused = std::find(st.begin(), st.end(), u) != st.end();
    }
    if (!reused) STRATA_RETURN_IF_ERROR(release_slot(s));
  }
  return prefetch_ahead(pos);
}

Status Fetcher::prefetch_ahead(std::size_t from, std::int64_t gate_step) {
  if (settings.prefetch_modules == 0 || settings.prefetch_elements == 0) return ok_status();
  std::int64_t budget = settings.prefetch_elements;
  bool fetched_any = false;
  for (std::size_t j = from; j < from + static_cast<std::size_t>(settings.prefetch_modules); ++j) {
    const int code = predicted(j);
    if (code < 0) break;
    for (int u : placement.units[static_cast<std::size_t>(code % M)].reads) {
      const std::size_t uu = static_cast<std::size_t>(u);
      if (placement.resident(u) || slot_of[uu] >= 0 || placement.units[uu].param_bytes == 0) continue;
      // A unit whose update is still running is fetched behind a gate on the h2d stream, as an
      // early fetch is: the caller goes on to enqueue the module it is about to run instead of
      // waiting here for a unit the forward reaches a few modules later (it waited for that one
      // before the next module could start: the first units of a step after an NVMe update). The
      // fetch is issued either way, so the prefetch schedule (and the hit rate) does not depend
      // on how fast the optimizer thread runs. Where it cannot be gated (gated_in_pass) the caller
      // waits. Not with the delayed update: the update in flight writes the next version, and
      // this step reads the published one.
      std::int64_t gate = gate_step;
      if (!delayed && gate_step < 0) {
        if (!gated_in_pass(u)) {
          STRATA_RETURN_IF_ERROR(ledger_.wait_updated(u));
        } else {
          std::lock_guard<std::mutex> lock(ledger_.mu);
          if (ledger_.updated_step[uu] < core.now.steps) gate = core.now.steps;
        }
      }
      // The budget bounds what is fetched beyond the first unit: a module larger than the whole
      // budget is still fetched one ahead, or it would never be prefetched at all.
      budget -= static_cast<std::int64_t>(placement.units[uu].grad_bytes / 4);
      if (budget < 0 && fetched_any) return ok_status();
      fetched_any = true;
      // ... into a free slot.
      bool free_slot = false;
      for (const ParamSlot& sl : pslots) free_slot = free_slot || sl.unit < 0;
      if (!free_slot) return ok_status();
      STRATA_RETURN_IF_ERROR(fetch(u, -1, gate).status());
    }
  }
  return ok_status();
}

Status Fetcher::prefetch_next_step() {
  // Not with the optimizer on the device (every unit is resident), nor with the delayed update
  // (publish_delayed decides what the next pass reads). On a pipeline a stage's pass is its whole
  // schedule (one trace per step, begin_pass to end_pass), so its first accesses are known from
  // it as in one process; a stage reads its own units and its gate waits for their marks, set
  // only once every stage agreed on the update where it may fail (defer_marks), which needs the
  // stages' optimizer threads only. With data parallelism at stages 0-2 and with tensor
  // parallelism every fetch reads this rank's own home: nothing in it talks, and the gate waits
  // for the agreed per-unit mark. At stage 3 a fetch all-gathers the ranks' slices on the h2d
  // stream, so every rank must issue the same early fetches and take the same decision on each:
  // the early fetches follow the trace, the slots and the budget (the same on every rank), and
  // whether the pass uses a copy is agreed inside its gather (early_gather_unit_params), never
  // taken from when this rank's gate looked (docs/offload.md "Early fetch across steps").
  if (placement.sharding.optimizer_on_device || delayed || trace.empty()) return ok_status();
  const bool gathers = placement.any_gathered_at_fetch();
  if (!gathers) {
    // This rank's own view suffices where nothing talks. At stage 3 an optimizer-thread failure
    // reaches the ranks at different times: they issue the fetches regardless, and every gate
    // ends at once on the failure (each rank's `missing`), so the agreement drops the copies.
    std::lock_guard<std::mutex> lock(ledger_.mu);
    if (!ledger_.worker_error.ok()) return ok_status();  // the next call reports or retries first
  }
  // The next pass starts the recorded trace at its first access (begin_pass); end_pass released
  // every slot, since the update changes every unit.
  trace_ok = true;
  next_step_fetches = true;
  Status issued = prefetch_ahead(0, core.now.steps);
  next_step_fetches = false;
  return issued;
}

Status Fetcher::end_pass() {
  trace = record;
  trace_ok = !trace.empty();
  // Keep what the next pass (same trace, same step) starts with; release everything else.
  const std::size_t window = static_cast<std::size_t>(std::max(1, settings.prefetch_modules));
  for (std::size_t s = 0; s < pslots.size(); ++s) {
    const int u = pslots[s].unit;
    if (u < 0) continue;
    bool keep = false;
    if (cyclic) {
      for (std::size_t j = 0; j < std::min(window, trace.size()) && !keep; ++j) {
        const auto& st = placement.units[static_cast<std::size_t>(trace[j] % M)].reads;
        keep = std::find(st.begin(), st.end(), u) != st.end();
      }
    }
    if (!keep) STRATA_RETURN_IF_ERROR(release_slot(static_cast<int>(s)));
  }
  return ok_status();
}

void Fetcher::reset() {
  for (ParamSlot& slot : pslots) {
    if (slot.unit >= 0) {
      slot_of[static_cast<std::size_t>(slot.unit)] = -1;
      bound_params[static_cast<std::size_t>(slot.unit)] = nullptr;
    }
    slot.unit = -1;
    slot.used = false;
    slot.early = false;
  }
  trace.clear();
  record.clear();
  trace_ok = false;
  pos = 0;
}

// Early fetches (prefetch_next_step) in flight count as done, so that a step's traffic (the
// difference of two calls between steps) is the same whenever the update lets them run: one whose
// gate is open (or opens while we look) is waited for (its read and copy take milliseconds), one
// whose gate is still closed, with the ledger's mu held so that it stays closed until the caller
// has read its counters, adds its read and copy bytes.
Fetcher::Pending Fetcher::pending_early(std::unique_lock<std::mutex>& lock) {
  Pending p;
  std::vector<char> settled(pslots.size(), 0);
  for (;;) {
    std::vector<std::size_t> open;
    lock.lock();
    p = Pending{};
    for (std::size_t i = 0; i < pslots.size(); ++i) {
      const ParamSlot& slot = pslots[i];
      if (!slot.early || slot.unit < 0 || settled[i]) continue;
      if (gate_open(slot)) {
        open.push_back(i);
        continue;
      }
      const std::size_t uu = static_cast<std::size_t>(slot.unit);
      const std::uint64_t n = placement.units[uu].param_bytes;
      p.h2d += n;
      if (placement.units[uu].gathered_at_fetch) {
        // Stage 3: this rank's slice is read and the unit all-gathered (early_gather_unit_params).
        const std::uint64_t w = half ? 2 : 4;
        if (placement.units[uu].home == Tier::kNvme) p.nvme_read += placement.units[uu].slice.len * w;
        p.dp += static_cast<std::uint64_t>(dp_size) * placement.units[uu].slice.chunk * w;
      } else if (placement.units[uu].home == Tier::kNvme) {
        p.nvme_read += n;
      }
    }
    if (open.empty()) return p;  // the counters are read with mu still held
    lock.unlock();
    for (std::size_t i : open) {
      (void)pslots[i].fetched->synchronize();  // an error surfaces at the pass that uses it
      settled[i] = 1;
    }
  }
}

}  // namespace strata::offload_detail
