// The update ledger: the contract between the step's caller, the h2d stream and the host
// optimizer thread about which unit holds which step's update (docs/offload.md "One step"). It
// owns the one mutex and condition variable they share and everything guarded by them:
//
//   commands       the caller's messages to the optimizer thread, in order (kLanded per unit as its
//                  gradients land, kFinish or kAbort per step, kRetry, kStop)
//   updated_step   per unit: the last engine step whose update it holds; the next forward of u
//                  waits for exactly that unit (wait_update_of), so the update of later units
//                  overlaps the next step's first modules; an early fetch's gate on the h2d stream
//                  waits for it too
//   stage_done     pipeline only: per unit, the step this stage finished before the stages agreed
//   norm_step      the last step whose norm is known (norm_value): the caller's step() returns then
//   worker_error   the optimizer thread's failure, and `failed`: how far the step got (retry)
//   update_failures  counts the failures: an early fetch's gate stops waiting on a later one
//   worker_busy    a command is being processed (drain waits for it)
//   abort_error    agree_before_norm: the caller's failure of the step in flight, for the thread
//   forward_ran_at tests only (FaultHooks::hold_forward): the largest `steps` of a pass whose
//                  forward of the held module ran
//
// Invariants: a unit is never read by compute while its update is pending (its forward waits for
// updated_step >= the step); updated_step only grows, except load_checkpoint, which sets every
// entry with the optimizer thread drained.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

#include "offload/engine_core.hpp"

namespace strata::offload_detail {

// A message to the host optimizer thread.
struct Command {
  // kRetry: finish the update of a step that failed part-way (FailedUpdate).
  enum Kind { kLanded, kFinish, kAbort, kRetry, kStop } kind = kLanded;
  int unit = -1;
  std::int64_t step = 0;  // the engine's step (StepMetrics::step): bookkeeping
  double lr = 0.0;
  std::int64_t opt_step = 0;  // the optimizer's update number (bias correction); fp16 skips hold it back
  double loss_scale = 1.0;    // the scale the step's gradients carry (fp16; 1 otherwise)
  float scale = 1.0f;         // kRetry: the update's clip / loss-scale factor
};

// Retrying a failed host update in place (docs/offload.md "Faults"). When the optimizer thread
// fails, `failed` says how far the step got:
//   kBeforeUpdate: nothing of the step was applied (its call failed); the step runs again.
//   kAfterNorm: the norm was published (step() returned) and the update failed part-way; the
//     next call reports the error, the call after it updates the remaining units with the
//     recorded factor. The gradients wait: the next step cannot overwrite a unit's gradients
//     before that unit holds this step (its forward, or with the delayed update its gradients'
//     copy-out, waits for the unit's update first). With several processes every rank must fail
//     the step alike: a non-finite norm is the same on every rank (the statistics are merged over
//     every group), and a rank's own failure before the norm (a copy, a scan, a gradient read or
//     write) travels with the statistics to every rank (agree_before_norm), so every rank fails
//     that step and runs it again.
//   kNone: not retryable — more than one process and a failure before the norm that is not
//     agreed on (!agree_before_norm: data parallelism with unsharded state) or a failed
//     collective (after the norm the ranks agree: agree_unit per unit over the data-parallel and
//     tensor groups, agree_stages per step over the pipeline stages); or update_during_backward,
//     where units are updated while the step's call is still running (only a non-finite gradient
//     or a stream error can fail there, and neither goes away by retrying; with several processes
//     the failure is agreed, so every rank reports it): sticky until load_checkpoint.
// Which units (and NVMe sub-groups) already hold the step is what updated_step, the host
// optimizer's host_opt_step and the NVMe ring's group_step record; a failed swap write keeps the
// previous version readable (swap_store.cpp), so a sub-group that is not marked reads back as
// before the step.
enum class FailPhase : std::uint8_t { kNone, kBeforeUpdate, kAfterNorm };
struct FailedUpdate {
  FailPhase phase = FailPhase::kNone;
  Command cmd;            // the step's numbers (and, after the norm, its factor)
  bool reported = false;  // a call has returned the error: the next one retries
};

class UpdateLedger : public EnginePart {
 public:
  explicit UpdateLedger(EngineCore& core) : EnginePart(core) {}

  // Sized for the model's units (setup).
  void reset_units(int units);

  mutable std::mutex mu;
  std::condition_variable cv;
  std::deque<Command> commands;            // guarded by mu
  bool worker_busy = false;                // guarded by mu
  std::vector<std::int64_t> updated_step;  // per unit, guarded by mu
  std::vector<std::int64_t> stage_done;    // per unit; optimizer thread (and load_checkpoint)
  std::int64_t norm_step = 0;              // guarded by mu
  double norm_value = 0.0;                 // unscaled; inf or nan when the gradients overflowed
  Status worker_error;                     // guarded by mu
  FailedUpdate failed;                     // guarded by mu
  std::uint64_t update_failures = 0;       // guarded by mu
  Status abort_error;                      // guarded by mu
  std::int64_t forward_ran_at = -1;        // guarded by mu (tests only)

  // A command for the optimizer thread.
  void push(const Command& c);
  void mark_updated(int u, std::int64_t step);
  // Unit u's update of `step` is done on this rank: marked updated, or on a pipeline
  // (defer_marks) recorded in stage_done until every stage agreed.
  void unit_done(int u, std::int64_t step) {
    if (defer_marks()) {
      stage_done[static_cast<std::size_t>(u)] = step;
    } else {
      mark_updated(u, step);
    }
  }
  // Whether unit u's update of `step` is done here (a retry skips it).
  bool unit_holds(int u, std::int64_t step) const {
    const std::size_t uu = static_cast<std::size_t>(u);
    return (defer_marks() ? stage_done[uu] : updated_step[uu]) >= step;
  }
  Status check_worker();
  // Waits until unit u holds step `step`'s update (wait_updated: the last step's).
  // `report`: a failed update's error returned here counts as reported (report_at_wait).
  Status wait_update_of(int u, std::int64_t step, bool report = true);
  Status wait_updated(int u, bool report = true) { return wait_update_of(u, core.now.steps, report); }
  // Waits until the optimizer thread has processed every command (whatever its error state).
  void drain();
  // A call returned the optimizer thread's error: the next one retries (recover).
  void note_reported();
};

}  // namespace strata::offload_detail
