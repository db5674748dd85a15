// The host optimizer thread (host_optimizer.hpp): its loop, the norm, agreement and retry.
#include "offload/host_optimizer.hpp"

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

Status HostOptimizer::start_worker() {
  worker = std::thread([this] { worker_main(); });
  return ok_status();
}

void HostOptimizer::stop_worker() {
  if (!worker.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(ledger_.mu);
    ledger_.commands.push_back(Command{Command::kStop});
  }
  ledger_.cv.notify_all();
  worker.join();
}

Status HostOptimizer::hold_update(int u, std::int64_t done_step) {
  if (faults.held_unit.load() != u) return ok_status();
  std::unique_lock<std::mutex> lock(ledger_.mu);
  faults.held_unit = -1;
  // The pass that reads this update waits for updated_step >= its `steps` (wait_updated).
  if (ledger_.cv.wait_for(lock, std::chrono::seconds(30),
                          [&] { return ledger_.forward_ran_at >= done_step; }))
    return ok_status();
  return internal_error("offload: the test hold of unit " + std::to_string(u) +
                        "'s update: no forward of module " + std::to_string(faults.hold_forward) +
                        " ran within 30 s");
}

// `agreed`: every rank fails this step before its norm (FailPhase::kBeforeUpdate).
void HostOptimizer::fail(Status s, FailPhase phase, const Command& c, bool agreed) {
  std::lock_guard<std::mutex> lock(ledger_.mu);
  if (ledger_.worker_error.ok()) {
    ledger_.worker_error = std::move(s);
    ++ledger_.update_failures;
    const bool retryable = can_retry || (agreed_retry && phase == FailPhase::kAfterNorm) ||
                           (agreed && phase == FailPhase::kBeforeUpdate);
    ledger_.failed = FailedUpdate{retryable ? phase : FailPhase::kNone, c, false};
  }
  ledger_.cv.notify_all();
}

// Unit c.unit's landed gradients scanned into stats; with immediate_ok it is updated too.
Status HostOptimizer::on_landed(const Command& c) {
  const std::size_t uu = static_cast<std::size_t>(c.unit);
  if (grads_on_nvme) {
    stats[uu] = grads_.landed_stats[uu];  // scanned on the gstream thread, before the landed event
  } else {
    detail::HostSpan span(tracer, track.optimizer, TraceCounter::kOptimizer, "scan gradients", c.unit);
    const auto [grads, n] = grads_.unit_grads(c.unit);
    const std::uint64_t first = placement.sharding.host_state_sharded ? placement.units[uu].slice.begin : 0;
    STRATA_ASSIGN_OR_RETURN(
        stats[uu], scan_norm(*host_opt, c.unit, grads, first, n, static_cast<float>(1.0 / c.loss_scale)));
  }
  if (!immediate_ok) return ok_status();
  if (!stats[uu].finite()) {
    return invalid_argument(
        "step " + std::to_string(c.step) + ": the gradients of module '" + layout().modules[uu].name +
        "' are not finite; modules updated before it in this step keep their update. Lower "
        "the learning rate or enable clipping");
  }
  applied_step = c.step;
  STRATA_RETURN_IF_ERROR(update_unit_host(c.unit, c.opt_step, c.lr, 1.0f, c.step));
  ledger_.mark_updated(c.unit, c.step);
  return ok_status();
}

// The step's update of every unit that does not hold it yet, `scale` = clip / loss scale.
Status HostOptimizer::update_stage(const Command& c, float scale) {
  applied_step = c.step;
  for (int u = 0; u < M; ++u)
    if (!placement.units[static_cast<std::size_t>(u)].in_stage)
      ledger_.mark_updated(u, c.step);  // another stage's
  if (settings.optimizer == Tier::kNvme) {
    return nvme.update_units_nvme(nvme.nvme_update_order(c.step), c.opt_step, c.lr, scale, c.step);
  }
  for (int u : update_order) {
    if (placement.split_device(u)) continue;  // partial offload: on the device
    if (!placement.units[static_cast<std::size_t>(u)].in_stage) continue;
    if (ledger_.unit_holds(u, c.step)) continue;  // a retry: done before the failure
    if (agree_per_unit()) {
      STRATA_RETURN_IF_ERROR(agree_unit(u, c.step, update_unit_host(u, c.opt_step, c.lr, scale, c.step)));
    } else {
      STRATA_RETURN_IF_ERROR(update_unit_host(u, c.opt_step, c.lr, scale, c.step));
    }
    ledger_.unit_done(u, c.step);
  }
  return ok_status();
}

// Pipeline: this stage's units count as updated once every stage's update succeeded. A retry
// on a stage that finished (stage_done) only agrees again.
Status HostOptimizer::apply_update(const Command& c, float scale) {
  Status s = update_stage(c, scale);
  if (!defer_marks()) return s;
  STRATA_RETURN_IF_ERROR(agree_stages(c.step, std::move(s)));
  for (int u = 0; u < M; ++u) {
    if (placement.units[static_cast<std::size_t>(u)].in_stage && !placement.split_device(u))
      ledger_.mark_updated(u, c.step);
  }
  return ok_status();
}

// Every unit has landed: the norm, then (unless immediate_ok did it) the update.
// `own` (agree_before): this rank's failure of the step before its norm; it travels as a flag
// with the statistics, so every rank learns of it in the same collectives.
void HostOptimizer::on_finish(const Command& c, Status own) {
  GradStats total;
  float verdict = own.ok() ? 0.0f : core.grid_place();
  float* flag = agree_before ? &verdict : nullptr;
  // A gather of the statistics failed (a peer never joined: it waits in a collective of the
  // pass this rank skipped, docs/offload.md "Faults", "Not agreed"). This rank's own failure is
  // still the cause it reports, with what became of the agreement; not retryable.
  auto unagreed = [&](Status gathered) {
    if (own.ok()) return gathered;
    return own.with_context(
        "step " + std::to_string(c.step) +
        ": this rank's failure before the norm could not be agreed with the other ranks (" +
        gathered.to_string() + ")");
  };
  // Partial offload: the device units' statistics are their scans on the compute stream (with
  // data parallelism: of this rank's slices), which the caller synchronised before it pushed
  // this command; every merge below takes them where the host units' are.
  for (int u : placement.stage.device_units)
    stats[static_cast<std::size_t>(u)] = devopt_.dev_stats[static_cast<std::size_t>(u)];
  if (placement.sharding.host_state_sharded) {
    // Every rank's per-unit statistics and its failure flag (one more record), merged unit by
    // unit in rank order.
    static_assert(sizeof(GradStats) % 4 == 0);
    const std::size_t per = static_cast<std::size_t>(M) + 1;
    std::vector<GradStats>& mine = flagged_stats;
    std::copy(stats.begin(), stats.end(), mine.begin());
    mine[per - 1] = GradStats{verdict, 0};
    std::vector<GradStats>& all = flagged_gathered;
    Status s = dp_wait(
        dp_tracks[2],
        comms.dp_params->all_gather(mine.data(), all.data(), per * sizeof(GradStats) / 4, DType::kF32),
        "gather gradient statistics", -1, all.size() * sizeof(GradStats));
    if (!s.ok()) return fail(unagreed(s), phase_of(c, FailPhase::kNone), c);
    for (int r = 0; r < dp_size; ++r) {
      const GradStats& theirs = all[static_cast<std::size_t>(r) * per + per - 1];
      verdict = std::max(verdict, static_cast<float>(theirs.sum_of_squares));
    }
    auto at = [&](int r, int u) -> const GradStats& {
      return all[static_cast<std::size_t>(r) * per + static_cast<std::size_t>(u)];
    };
    if (pp_size > 1) {
      // Each unit's statistics over the data-parallel ranks, then over the pipeline stages.
      std::vector<GradStats> per_unit(static_cast<std::size_t>(M));
      for (int u = 0; u < M; ++u) {
        for (int r = 0; r < dp_size; ++r) per_unit[static_cast<std::size_t>(u)].merge(at(r, u));
      }
      auto merged = core.merge_stage_stats(per_unit, flag);
      if (!merged.ok()) return fail(unagreed(merged.status()), phase_of(c, FailPhase::kNone), c);
      total = *merged;
    } else {
      for (int u = 0; u < M; ++u) {
        for (int r = 0; r < dp_size; ++r) total.merge(at(r, u));
      }
    }
  } else if (pp_size > 1) {
    auto merged = core.merge_stage_stats(stats, flag);
    if (!merged.ok()) return fail(unagreed(merged.status()), phase_of(c, FailPhase::kNone), c);
    total = *merged;
  } else {
    for (int u = 0; u < M; ++u) total.merge(stats[static_cast<std::size_t>(u)]);
  }
  if (tp_size > 1) {
    auto merged = core.merge_over_tp(total, *comms.tp_norm, flag);
    if (!merged.ok()) return fail(unagreed(merged.status()), phase_of(c, FailPhase::kNone), c);
    total = *merged;
  }
  if (verdict != 0.0f && immediate_ok) {
    // Units are updated as they land: by now some ranks may hold this step's update of some
    // units (whichever landed before the failure, or on a peer that did not fail), and the
    // gradients of the others are lost with the failed pass. Every rank learnt it in the same
    // collectives; none may run the step again: sticky (FailPhase::kNone) on every rank,
    // until a checkpoint is loaded.
    const std::string what = "step " + std::to_string(c.step) +
                             ": with update_during_backward the modules whose gradients landed before the "
                             "failure already hold this step's update on some ranks, so the step cannot "
                             "run again; load the last checkpoint (with gradient clipping, or "
                             "update_during_backward off, such a step can be run again)";
    if (!own.ok()) return fail(own.with_context(what), FailPhase::kNone, c);
    return fail(unavailable("step " + std::to_string(c.step) + ": the step failed before its norm on " +
                            core.name_grid_place(verdict) + " (its error names the cause); " +
                            what.substr(what.find("with "))),
                FailPhase::kNone, c);
  }
  if (verdict != 0.0f) {
    // Some rank failed the step before its norm; every rank saw the same flags, in the same
    // collectives, and none publishes the norm: every rank's step() reports it (the failing
    // rank its own error) with nothing updated, and every rank runs the step again.
    if (!own.ok()) return fail(std::move(own), FailPhase::kBeforeUpdate, c, true);
    return fail(unavailable("step " + std::to_string(c.step) + ": the step failed before its update on " +
                            core.name_grid_place(verdict) +
                            " (its error names the cause); nothing was updated on any rank: call step() "
                            "again with the same batch"),
                FailPhase::kBeforeUpdate, c, true);
  }
  const double norm = total.norm();
  if (!total.finite() && !fp16 && !immediate_ok) {
    // Nothing of the step was applied and the norm is not published: the step's own call
    // reports it with the state untouched (its step count, too), and calling again runs the
    // step again (FailPhase::kBeforeUpdate), e.g. once the input or the learning rate changed.
    // Every rank merged the same statistics (over every group), so with several processes all
    // fail alike and all run the step again: agreed without a flag.
    return fail(invalid_argument("step " + std::to_string(c.step) + ": the gradient norm is not finite (" +
                                 std::to_string(norm) +
                                 "); nothing was updated. Lower the learning rate or enable clipping"),
                FailPhase::kBeforeUpdate, c, true);
  }
  {
    std::lock_guard<std::mutex> lock(ledger_.mu);
    ledger_.norm_value = norm;
    ledger_.norm_step = c.step;
  }
  ledger_.cv.notify_all();
  // The device units' update is the caller's, in compute order before the next forward.
  for (int u : placement.stage.device_units) ledger_.mark_updated(u, c.step);
  if (immediate_ok) return;
  if (!total.finite() && fp16) {
    // Overflow: the step is skipped on every unit (and, data parallel, on every rank: they all
    // merged the same statistics). The caller moves the loss scaler.
    for (int u = 0; u < M; ++u) ledger_.mark_updated(u, c.step);
    return;
  }
  Command retry = c;
  retry.scale = core.update_scale(norm, c.loss_scale);
  Status s = apply_update(c, retry.scale);
  if (!s.ok()) fail(s, FailPhase::kAfterNorm, retry);
}

void HostOptimizer::worker_main() {
  name_current_thread("host.optimizer");
  if (Status s = device->cpu_budget().pin_host(); !s.ok()) {
    STRATA_LOG(kWarn, kOffload) << "host optimizer: " << s.message();
  }
  worker_cpu.join(/*since_start=*/true);
  stats.assign(static_cast<std::size_t>(M), GradStats{});
  update_order.resize(static_cast<std::size_t>(M));
  for (int u = 0; u < M; ++u) update_order[static_cast<std::size_t>(u)] = delayed ? M - 1 - u : u;
  immediate_ok = core.update_immediately();
  can_retry = dp_size == 1 && tp_size == 1 && pp_size == 1;
  agreed_retry = agree_per_unit() || defer_marks();
  agree_before = agree_before_norm();
  own_before = ok_status();
  for (;;) {
    Command c;
    {
      std::unique_lock<std::mutex> lock(ledger_.mu);
      ledger_.cv.wait(lock, [&] { return !ledger_.commands.empty(); });
      c = ledger_.commands.front();
      ledger_.commands.pop_front();
      if (!ledger_.worker_error.ok() && c.kind != Command::kStop) {
        // After an error nothing more is applied; the step's caller reports it. Reads issued
        // early end before the optimizer thread may look idle (drain_worker), while mu still
        // keeps the caller out.
        nvme.drop_early_reads();
        nvme.early_reads_step = -1;
        if (ledger_.commands.empty()) ledger_.cv.notify_all();
        continue;
      }
      ledger_.worker_busy = true;
    }
    struct Idle {  // however the command ends
      HostOptimizer* t;
      ~Idle() {
        {
          std::lock_guard<std::mutex> lock(t->ledger_.mu);
          t->ledger_.worker_busy = false;
        }
        t->ledger_.cv.notify_all();
      }
    } idle{this};
    // Whatever a command other than kLanded did, no early read outlives it (issue_early_reads);
    // the next kLanded of the same step number (a step run again after it failed before its
    // update) issues them afresh.
    struct DropEarly {
      HostOptimizer* t;
      bool on;
      ~DropEarly() {
        if (!on) return;
        t->nvme.drop_early_reads();
        t->nvme.early_reads_step = -1;
      }
    } drop_early{this, c.kind != Command::kLanded};
    if (c.kind == Command::kStop) break;
    if (c.kind == Command::kAbort) {
      // The caller's step failed before its norm. Alone, the next step's landed units overwrite
      // the stats. Agreeing (agree_before): the other ranks wait in the statistics gathers, so
      // this rank joins them with its failure flag.
      if (!agree_before) continue;
      Status caller;
      {
        std::lock_guard<std::mutex> lock(ledger_.mu);
        caller = std::exchange(ledger_.abort_error, ok_status());
      }
      if (caller.ok()) caller = internal_error("step " + std::to_string(c.step) + " was abandoned");
      own_before = ok_status();
      on_finish(c, std::move(caller));
      continue;
    }
    if (c.kind == Command::kLanded) {
      if (agree_before && !own_before.ok()) continue;  // the step failed here already
      // The step's first landed unit: its update's first optimizer-state reads go out now,
      // overlapped with the rest of backward.
      nvme.issue_early_reads(c.step);
      Status s = grads_.landed[static_cast<std::size_t>(c.unit)]->synchronize();
      if (s.ok()) s = on_landed(c);
      if (!s.ok() && agree_before) {
        // Kept until the step's kFinish (or kAbort) agrees on it with the other ranks.
        own_before = std::move(s);
      } else if (!s.ok()) {
        // A failed copy: the host gradients cannot be trusted, nor can a retry that rescans them.
        fail(s, phase_of(c, FailPhase::kNone), c);
      }
      continue;
    }
    if (c.kind == Command::kRetry) {
      Status s = apply_update(c, c.scale);
      if (!s.ok()) fail(s, FailPhase::kAfterNorm, c);
      continue;
    }
    on_finish(c, std::exchange(own_before, ok_status()));  // kFinish: every unit has landed.
  }
}

Status HostOptimizer::agree_unit(int u, std::int64_t step, Status own) {
  // The verdict: 0 when every rank succeeded, else 1 + a failing rank's place in the grid
  // (data-parallel rank + dp_size * tensor rank); the max over the data-parallel group, then over
  // the tensor group, is the same number on every rank. Which failing rank is named does not
  // matter, only that every rank sees the same verdict.
  const bool over_dp = placement.sharding.host_state_sharded && comms.dp_params != nullptr;
  const int dps = over_dp ? dp_size : 1, dpr = over_dp ? dp_rank : 0;
  float verdict = own.ok() ? 0.0f : static_cast<float>(1 + dpr + dps * tp_rank);
  if (over_dp) {
    float worst = 0.0f;
    STRATA_RETURN_IF_ERROR(
        dp_wait(dp_tracks[2], comms.dp_params->all_reduce(&verdict, &worst, 1, DType::kF32, ReduceOp::kMax),
                "agree on the update", u, 4));
    verdict = worst;
  }
  if (tp_size > 1) {
    float worst = 0.0f;
    Status s = comms.tp_norm->all_reduce(&verdict, &worst, 1, DType::kF32, ReduceOp::kMax).wait();
    if (!s.ok()) {
      return s.with_context("tensor parallel: agree on the update of module '" +
                            layout().modules[static_cast<std::size_t>(u)].name + "'");
    }
    verdict = worst;
  }
  if (!own.ok()) return own;
  if (verdict == 0.0f) return ok_status();
  const int r = static_cast<int>(verdict) - 1;
  const std::string where = tp_size == 1 ? "data-parallel rank " + std::to_string(r % dps)
                            : dps == 1   ? "tensor-parallel rank " + std::to_string(r / dps)
                                         : "data-parallel rank " + std::to_string(r % dps) +
                                             " of tensor-parallel rank " + std::to_string(r / dps);
  return unavailable(
      "step " + std::to_string(step) + ": the update of module '" +
      layout().modules[static_cast<std::size_t>(u)].name + "' failed on " + where +
      " (its error names the cause); every rank retries it in place at the call after the next");
}

Status HostOptimizer::agree_stages(std::int64_t step, Status own) {
  const float mine = own.ok() ? 0.0f : static_cast<float>(pp_rank + 1);
  float worst = 0.0f;
  Status s = comms.pp_norm->all_reduce(&mine, &worst, 1, DType::kF32, ReduceOp::kMax).wait();
  if (!s.ok()) return s.with_context("pipeline: agree on the update of step " + std::to_string(step));
  if (!own.ok()) return own;
  if (worst == 0.0f) return ok_status();
  return unavailable(
      "step " + std::to_string(step) + ": the update failed on pipeline stage " +
      std::to_string(static_cast<int>(worst) - 1) +
      " (its error names the cause); every stage retries it in place at the call after the next");
}

Status HostOptimizer::recover() {
  if (placement.sharding.optimizer_on_device) return ok_status();
  // Pipeline: the verdict on the update in flight is agreed by the stages' optimizer threads;
  // waiting for it makes every stage's call report (or not) alike, before this call sends or
  // receives anything (defer_marks).
  if (defer_marks()) ledger_.drain();
  FailedUpdate f;
  {
    std::lock_guard<std::mutex> lock(ledger_.mu);
    if (ledger_.worker_error.ok()) return ok_status();
    if (ledger_.failed.phase == FailPhase::kNone || !ledger_.failed.reported) {
      // Several ranks agreeing per unit: this rank's optimizer thread may know the verdict before
      // a peer's caller does, so the call goes on and reports the error where it waits for the
      // first unit that does not hold the step (wait_update_of), as every rank's call does,
      // after the same collectives of the units before it.
      if (ledger_.failed.phase == FailPhase::kAfterNorm && report_at_wait()) return ok_status();
      // Reported once as it is (an asynchronous failure surfaces at the next call); retried by
      // the call after that.
      ledger_.failed.reported = true;
      return ledger_.worker_error;
    }
    f = ledger_.failed;
  }
  // The failed step's remaining commands are skipped before the error may be cleared.
  ledger_.drain();
  const std::string which = "step " + std::to_string(f.cmd.step);
  if (f.phase == FailPhase::kAfterNorm && core.now.steps < f.cmd.step) {
    // The step's own call failed after its norm (not a state the engine can finish).
    return ledger_.check_worker().with_context(
        which +
        "'s update failed part-way and its call did not complete; load a "
        "checkpoint");
  }
  {
    std::lock_guard<std::mutex> lock(ledger_.mu);
    ledger_.worker_error = ok_status();
    ledger_.failed = FailedUpdate{};
    ledger_.abort_error = ok_status();  // a kAbort the optimizer thread skipped after the failure
    if (f.phase == FailPhase::kAfterNorm) {
      Command c = f.cmd;
      c.kind = Command::kRetry;
      ledger_.commands.push_back(c);
    }
  }
  ledger_.cv.notify_all();
  if (f.phase == FailPhase::kBeforeUpdate) return ok_status();  // nothing was applied: the step runs again
  STRATA_LOG(kInfo, kOffload) << "retrying the host update of " << which;
  ledger_.drain();
  std::lock_guard<std::mutex> lock(ledger_.mu);
  if (ledger_.worker_error.ok()) return ok_status();
  ledger_.failed.reported = true;  // this call reports it; the next one retries again
  return ledger_.worker_error.with_context("retrying the update of " + which);
}

}  // namespace strata::offload_detail
