// The update ledger (update_ledger.hpp).
#include "offload/update_ledger.hpp"

namespace strata::offload_detail {

void UpdateLedger::reset_units(int units) {
  updated_step.assign(static_cast<std::size_t>(units), 0);
  stage_done.assign(static_cast<std::size_t>(units), 0);
}

void UpdateLedger::push(const Command& c) {
  {
    std::lock_guard<std::mutex> lock(mu);
    commands.push_back(c);
  }
  cv.notify_all();
}

void UpdateLedger::mark_updated(int u, std::int64_t step) {
  {
    std::lock_guard<std::mutex> lock(mu);
    updated_step[static_cast<std::size_t>(u)] = step;
  }
  cv.notify_all();
}

Status UpdateLedger::check_worker() {
  std::lock_guard<std::mutex> lock(mu);
  return worker_error;
}

Status UpdateLedger::wait_update_of(int u, std::int64_t step, bool report) {
  if (placement.sharding.optimizer_on_device) return ok_status();
  std::unique_lock<std::mutex> lock(mu);
  auto ready = [&] { return !worker_error.ok() || updated_step[static_cast<std::size_t>(u)] >= step; };
  if (!ready()) {
    detail::HostSpan span(tracer, track.caller, TraceCounter::kUpdateStall, "wait update", u);
    cv.wait(lock, ready);
  }
  if (!worker_error.ok() && failed.phase == FailPhase::kAfterNorm && report_at_wait()) {
    // The marks are agreed: a unit that holds the step is read alike on every rank; the first
    // that does not fails the call on every rank, which reports the error (recover retries).
    if (updated_step[static_cast<std::size_t>(u)] >= step) return ok_status();
    if (report) failed.reported = true;
  }
  return worker_error;
}

void UpdateLedger::drain() {
  if (placement.sharding.optimizer_on_device) return;
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return commands.empty() && !worker_busy; });
}

void UpdateLedger::note_reported() {
  std::lock_guard<std::mutex> lock(mu);
  if (!worker_error.ok()) failed.reported = true;
}

}  // namespace strata::offload_detail
