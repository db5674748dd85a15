// Parameter homes: where each unit's working parameters live, and reading and writing them there
// (docs/offload.md "Homes"). Unit u's working parameters live at UnitPlacement::home: resident in
// the device region offload.params, or on the host (host_params, the host optimizer's copy), or
// on NVMe (swap key "param.<u>"); at stage 3 the home holds only this rank's slice and a read
// all-gathers the unit. ParamHomes owns those buffers and the published/next versions of the
// delayed update; the fetcher copies from them, the optimizers publish into them, state access
// reads and writes through them.
//
// One-step delayed update (settings.delayed_update, docs/offload.md "Delayed update"). The
// optimizer thread writes a unit's updated working parameters only to their host copy
// (host_params); the caller uploads them (publish_delayed) once the device may see them: after the
// next step's backward, or before anything else reads the parameters. pending_publish is the step
// whose update has not been uploaded yet (0: none). Caller thread only. With tensor or pipeline
// parallelism every rank delays its own shard's (stage's) update alike: the norm is merged over
// the groups as without the delay, publish_delayed talks to no one and runs at the same point of
// every rank's step (after its passes, or at a flush every rank's collective call makes), and a
// backward waits only for this rank's own update of the previous step, which needs nothing but
// that step's commands, already pushed on every rank.
//
// With the working parameters off the device the next step's fetches read the home while the
// update in flight produces the next version, so every off-device unit has two. Host home: the
// update writes `delayed_next` (UnitPlacement::next_offset) and publish_delayed copies it into
// host_params. NVMe home: the versions are the swap shards 0 and 1 of "param.<u>"; param_shard[u]
// names the published one (what fetches and state reads use), the update writes the other, and
// publish_delayed flips it (no I/O, so a publish cannot fail half-way). Written by the caller in
// publish_delayed and load_checkpoint only while the optimizer thread has no update of the unit
// in flight.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "offload/engine_core.hpp"
#include "offload/update_ledger.hpp"

namespace strata::offload_detail {

class ParamHomes : public EnginePart {
 public:
  ParamHomes(EngineCore& core, UpdateLedger& ledger) : EnginePart(core), ledger_(ledger) {}

  // The buffers below are carved by the engine's setup (engine_setup.cpp), in the plan's order.
  char* resident = nullptr;  // offload.params
  HostMem host_params;       // at UnitPlacement::host_offset (optimizer off the device)
  HostMem delayed_next;      // at UnitPlacement::next_offset
  std::vector<std::uint32_t> param_shard;
  // Per unit: the optimizer thread wrote its next version since the last publish (an fp16 step
  // that overflowed writes none, and publishing would then bring back an older one). Set by the
  // optimizer thread before the unit is marked updated, read and cleared by publish_delayed after
  // waiting for that mark (the ledger's mutex orders them).
  std::vector<char> next_fresh;
  std::int64_t pending_publish = 0;
  // Several processes (agree_before_norm): this rank's call of a step that every rank failed
  // before its update returned before publishing step pending_publish's update, which its peers
  // whose pass succeeded did publish. The next step() publishes it first, so the step runs again
  // at P[pending_publish] on every rank (as after a flush). Caller thread only.
  bool publish_before_rerun = false;
  // uploaded[u]: h2d → compute, u's updated resident parameters are on the device; recorded
  // per unit (bytes, not bits: two threads touch different units).
  std::vector<std::unique_ptr<Event>> uploaded;
  std::vector<char> uploaded_recorded;
  HostMem fetch_send, fetch_recv;  // stage 3, h2d stream: this rank's slice, and the gathered unit
  HostMem param_out_staging;       // the host optimizer's updated parameters of an NVMe-homed unit

  // Unit u's working parameters on NVMe: the published version, or (`next`) the one the delayed
  // update in flight writes.
  TensorKey param_key(int u, bool next = false) const {
    const std::uint32_t cur = param_shard.empty() ? 0 : param_shard[static_cast<std::size_t>(u)];
    return TensorKey{unit_key("param", u), next ? 1 - cur : cur};
  }

  // The unit's working parameters (its layout), wherever they live. At stage 3 a collective on
  // the caller's data-parallel Comm. Not on the hot path.
  Status read_unit_params(int u, std::vector<char>& bytes);
  // The caller first forgets any fetched copy (Fetcher::forget_fetched): it holds the version
  // this replaces.
  Status write_unit_params(int u, const std::vector<char>& bytes);
  // Stage 3. A unit's working parameters between its layout (param_in_unit) and the fp32
  // element positions (grad_in_unit / 4, `w` bytes each) in which it is sliced.
  void to_elements(int u, const char* working, char* elements) const;
  void from_elements(int u, const char* elements, char* working) const;
  // This rank's slice (len x w bytes) at the unit's home, and back. `next`: the delayed update's
  // next version (publish_delayed makes it the published one); otherwise the published slice
  // (initialisation, set_param, load_checkpoint).
  Status read_param_slice(int u, char* slice);
  Status write_param_slice(int u, const char* slice, bool next = false);
  // The unit gathered from every rank's slice into `working` (its layout), on `comm` (collective):
  // `send` holds chunk elements, `recv` size x chunk. `agree`: the ranks first exchange whether
  // they read their slice (agree_on_read), so a rank whose read failed still takes part and every
  // rank returns the same error at once (state access: checkpoints, save_weights, get_param);
  // the h2d stream's fetches pass false (a failed fetch fails the step, and the comm timeout
  // ends its peers).
  Status gather_unit_params(int u, Comm& comm, int trace_track, char* send, char* recv, char* working,
                            bool agree = false);
  // h2d stream, stage 3: an early fetch's gather (Fetcher::prefetch_next_step). `mine`: this
  // rank's gate saw the unit's agreed mark; its slice is then read. Every rank exchanges whether
  // it holds its slice of that version (a 4-byte all-reduce over dp_fetch, issued by every rank
  // for every early fetch, in the same h2d order), and gathers the unit only when all do:
  // `early_ok` is then set, the same on every rank, so every rank's pass takes the copy or
  // refetches (all-gathers) alike (docs/offload.md "Early fetch across steps", stage 3). Neither
  // a closed gate nor a failed read is an error here; a failed exchange or gather is (the comm
  // itself failed).
  Status early_gather_unit_params(int u, bool mine, char* working, std::atomic<bool>* early_ok);
  // The part both share: this rank's slice of unit u read into send[0, len), padded to the chunk,
  // all-gathered over `comm` into recv and laid out as the whole unit in `working`.
  Status gather_read_slice(int u, Comm& comm, int trace_track, char* send, char* recv, char* working);
  // Optimizer thread: unit u's updated working parameters (`bytes`, the unit's working layout)
  // to its home (the delayed update: to its next version; a resident unit: uploaded on h2d).
  Status publish_params(int u, const char* bytes);
  // Unit u's owned parameters in `out_unit` (its working layout) from fp32 masters at `master`
  // (unit element offset `first`, `n` elements): the rounding the update's param_out does.
  Status working_from_master(int u, const float* master, std::uint64_t first, std::uint64_t n,
                             char* out_unit) const;
  // Delayed update: waits for step pending_publish's update of every unit and enqueues the
  // uploads of the new working parameters on h2d (uploaded[u]). Compute must not be reading them.
  Status publish_delayed();
  // Optimizer thread, delayed update: before unit u's host copy is rewritten, the upload that
  // reads it (enqueued by publish_delayed before this update was released) must have finished.
  Status await_upload(int u);

 private:
  UpdateLedger& ledger_;
};

}  // namespace strata::offload_detail
