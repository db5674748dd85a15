// The fetcher: the prefetch trace, the parameter slots and what is in them (docs/offload.md
// "Prefetch"). A unit that is not resident is fetched into a device slot of offload.param_slots
// before a module that reads it runs (NVMe -> pinned staging -> device, or a stage-3 all-gather,
// on the h2d stream), prefetch_modules accesses ahead along the trace recorded in the first pass
// and re-recorded when the order changes. A slot is never refilled before compute has passed its
// last read (slot.free), and compute never reads a slot before its fetch (slot.fetched).
//
// Trace codes: one per module access, forward m: m, backward m: M + m. A pass records its codes
// (note_access) and, at its end, the record becomes the trace the next pass predicts from
// (`cyclic`: the next pass repeats it, more micro-batches this step).
//
// Early fetches (docs/offload.md "Early fetch across steps"): once a step returned, the first
// accesses of the next pass are fetched at once (prefetch_next_step), each gated on the h2d stream
// by its unit's update of that step (the ledger's updated_step).
//
// Threads: the caller enqueues; the gates and stage-3 gathers run in h2d host functions.
// Counters are the caller's.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "offload/engine_core.hpp"
#include "offload/param_homes.hpp"
#include "offload/update_ledger.hpp"

namespace strata::offload_detail {

struct ParamSlot {
  char* dev = nullptr;
  int unit = -1;
  bool used = false;  // compute read it since it was fetched
  std::unique_ptr<Event> fetched, free;
  HostMem staging;  // NVMe-home units: the swap read lands here, then H2D
  // An early fetch (prefetch_next_step): issued by the caller when a step returned, gated on the
  // h2d stream by the unit's update of that step. `early_ok` is set by the gate's host function
  // once the update was published and the read succeeded; read by the caller only after
  // `fetched` completed. A slot whose gate saw a failed update (or whose read failed) holds
  // nothing usable and is refetched on demand.
  bool early = false;
  std::unique_ptr<std::atomic<bool>> early_ok;
  std::int64_t gate_step = -1;      // early: the step whose update the gate waits for
  std::uint64_t gate_failures = 0;  // early: update_failures when it was issued
  // early: issued by prefetch_next_step (counted in early_fetch_hits), not by a pass's own
  // prefetch of a unit whose update was still running (prefetch_ahead).
  bool next_step = false;
};

class Fetcher : public EnginePart {
 public:
  Fetcher(EngineCore& core, UpdateLedger& ledger, ParamHomes& homes)
      : EnginePart(core), ledger_(ledger), homes_(homes) {}

  // The slots are carved by the engine's setup; slot_of is sized there.
  std::vector<ParamSlot> pslots;
  std::vector<int> slot_of;  // per unit: its param slot, -1

  std::vector<int> trace, record;
  bool trace_ok = false;
  std::size_t pos = 0;
  bool cyclic = false;  // the pass that follows repeats this trace (more micro-batches this step)

  // OffloadStats' counters (caller).
  std::uint64_t accesses = 0, hits = 0, mismatches = 0;
  std::uint64_t early_hits = 0;  // hits on a copy fetched early across steps (prefetch_next_step)

  void begin_pass();
  void note_access(int code);
  int predicted(std::size_t j) const;
  // Module m's units bound to the model: each waits for its update (not with the delayed update)
  // and, resident, for its upload; otherwise its slot's fetch (a miss fetches it now).
  Status access_params(int m);
  // After module m's work is enqueued: release the slots that the next accesses do not reuse,
  // then prefetch ahead.
  Status release_after(int m);
  // The units of the accesses [from, from + prefetch_modules) of the trace fetched into free
  // slots, within prefetch_elements. `gate_step` < 0: the pass in progress; a unit whose update
  // is still running is fetched gated by it (gated_in_pass) or waited for by the caller first.
  // Otherwise (prefetch_next_step) nothing waits on the caller: each fetch is gated on the h2d
  // stream by its unit's update of `gate_step` (fetch).
  Status prefetch_ahead(std::size_t from, std::int64_t gate_step = -1);
  // Whether a pass's prefetch of unit u, whose update is still running, is gated on the h2d
  // stream rather than waited for by the caller: not with the delayed update (the pass reads the
  // published version) and not for a unit all-gathered across ranks (stage 3: every rank must
  // issue the same fetches, and whether an update is done differs between ranks).
  bool gated_in_pass(int u) const {
    return !delayed && !placement.units[static_cast<std::size_t>(u)].gathered_at_fetch;
  }
  // Caller, once a step returned (its norm known, its update released to the optimizer thread):
  // the first accesses of the next pass fetched early, each as soon as its unit's update is
  // published, so a pass no longer begins with nothing in flight (docs/offload.md "One step").
  Status prefetch_next_step();
  // `gate_step` >= 0: an early fetch (ParamSlot::early), whose h2d work first waits, on the h2d
  // stream, until unit u holds that step's update or the optimizer thread failed.
  Result<int> fetch(int u, int current_module, std::int64_t gate_step = -1);
  // A fetched copy of unit u that is no longer its home's (set_param, loading state) forgotten.
  Status forget_fetched(int u);
  // Whether an early fetch's gate has ended its wait or will without waiting (the ledger's mu held).
  bool gate_open(const ParamSlot& slot) const;
  Status release_slot(int s);
  Status end_pass();
  // After a failed step: every slot forgotten (its contents may be partial) and the trace
  // re-recorded. Streams must be idle.
  void reset();
  // The traffic of early fetches not yet done, for stats(): their h2d bytes, NVMe reads and
  // data-parallel bytes. Waits for those whose gate is open; returns with the ledger's mu held
  // in `lock` (so that the gates stay closed until the caller has read its other counters).
  struct Pending {
    std::uint64_t h2d = 0, nvme_read = 0, dp = 0;
  };
  Pending pending_early(std::unique_lock<std::mutex>& lock);

 private:
  bool next_step_fetches = false;  // prefetch_next_step is issuing (ParamSlot::next_step)
  UpdateLedger& ledger_;
  ParamHomes& homes_;
};

}  // namespace strata::offload_detail
