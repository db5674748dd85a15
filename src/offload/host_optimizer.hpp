// The host optimizer thread (docs/offload.md "One step"): CPU Adam over the host tier's state
// (host_master, host_m, host_v in pinned memory, or on NVMe through the ring, NvmeRing), run on a
// thread of its own that overlaps the device's backward and the next step's forward.
//
// It receives "landed" units in backward order (Command::kLanded). It scans each one (sum of
// squares per unit, merged in unit order: the same bits whatever the bucketing), and either
// updates it at once (clipping off, update_during_backward: CoreEngine::update_immediately) or,
// once every unit has landed (kFinish) and the norm is known, updates all units in forward order
// (the delayed update: backward order). The ledger's updated_step tells the step's caller when
// unit u may be read again: the next forward of u waits for exactly that unit, so the update of
// later units overlaps the next step's first modules.
//
// Data parallel (the host state sharded over the ranks): the optimizer thread all-gathers the
// per-unit norm statistics (merged in unit, then rank order: the same bits on every rank) and,
// after updating its slice of a unit, all-gathers the unit's updated parameters (dp_params).
// Tensor parallel: the norm is merged over tp_norm; pipeline: over pp_norm (merge_stage_stats).
//
// Faults (docs/offload.md "Faults"): a failure is recorded in the ledger (worker_error, failed)
// and reported by the next call; recover() retries a failed update in place where the ranks can
// agree on it (agree_unit per unit, agree_stages per step).
//
// Threads: the worker thread owns everything here but `recover` (caller) and the state access of
// a drained thread (load_checkpoint, set_param).
#pragma once

#include <cstdint>
#include <thread>
#include <vector>

#include "offload/device_optimizer.hpp"
#include "offload/engine_core.hpp"
#include "offload/gradient_path.hpp"
#include "offload/nvme_ring.hpp"
#include "offload/param_homes.hpp"
#include "offload/update_ledger.hpp"

namespace strata::offload_detail {

class HostOptimizer : public EnginePart {
 public:
  HostOptimizer(EngineCore& core, UpdateLedger& ledger, ParamHomes& homes, GradientPath& grads,
                DeviceOptimizer& devopt)
      : EnginePart(core),
        nvme(core, ledger, homes, grads, *this),
        ledger_(ledger),
        homes_(homes),
        grads_(grads),
        devopt_(devopt) {}

  NvmeRing nvme;

  // Carved by the engine's setup.
  HostMem host_master, host_m, host_v;  // optimizer on the host: at host_at(grad_begin(u)), or packed slices
  HostMem ag_send, ag_recv;             // sharded: this rank's updated chunk, and the gathered unit
  // Sharded: this rank's per-unit statistics plus its failure flag (M + 1 records), and every
  // rank's (dp_size x (M + 1)), sized once.
  std::vector<GradStats> flagged_stats, flagged_gathered;
  // Worker thread (and load_checkpoint, with the worker drained): per unit, the engine step
  // whose update the host master and moments hold (the publish of its parameters may still have
  // failed).
  std::vector<std::int64_t> host_opt_step;
  std::int64_t applied_step = 0;  // worker: the last step whose update started on some unit
  CpuAccount worker_cpu;          // the host optimizer thread and its OpenMP team

  Status start_worker();
  void stop_worker();
  // A caller's entry: reports an update error once, then retries the failed update in place
  // (FailedUpdate); ok once the engine may go on.
  Status recover();
  // `done_step`: the engine step the update belongs to (host_opt_step); a unit whose master and
  // moments already hold it only publishes its parameters again (a retry).
  Status update_unit_host(int u, std::int64_t step, double lr, float scale, std::int64_t done_step);
  // Optimizer thread (agree_per_unit): whether every rank's update of unit u succeeded: one
  // 4-byte all-reduce over dp_params, then one over tp_norm, in the update's unit order on every
  // rank. A rank whose own update failed returns its error, the others kUnavailable naming the
  // failing rank; either way no rank marks u (or a later unit) updated.
  Status agree_unit(int u, std::int64_t step, Status own);
  // Optimizer thread (defer_marks): whether every stage's update of `step` succeeded, one
  // all-reduce over pp_norm; the same contract as agree_unit.
  Status agree_stages(std::int64_t step, Status own);
  // Tests only (FaultHooks::held_unit): the update of the held unit waits for the forward that
  // reads it (see EngineFaults::hold_update_until_forward).
  Status hold_update(int u, std::int64_t done_step);

 private:
  void worker_main();
  // The commands (worker_main's loop): a landed unit scanned (and with immediate_ok updated),
  // a finished step's norm and update, a retry.
  Status on_landed(const Command& c);
  void on_finish(const Command& c, Status own);
  // The step's update of every unit that does not hold it yet, `scale` = clip / loss scale; on a
  // pipeline, marked only once every stage's update succeeded.
  Status update_stage(const Command& c, float scale);
  Status apply_update(const Command& c, float scale);
  // The failure of the command in flight recorded in the ledger; `agreed`: every rank fails
  // this step before its norm (FailPhase::kBeforeUpdate).
  void fail(Status s, FailPhase phase, const Command& c, bool agreed = false);
  // A failure before the step's first unit update leaves nothing to finish.
  FailPhase phase_of(const Command& c, FailPhase started) const {
    return applied_step >= c.step ? started : FailPhase::kBeforeUpdate;
  }

  std::thread worker;
  // Worker thread, set when it starts.
  std::vector<GradStats> stats;  // per unit: the step's gradient statistics
  // The order of a step's update. Forward order lets the next forward wait only for the unit it
  // reaches. The delayed update is not waited for by the next forward but by the next backward's
  // gradients of each unit (they reuse its gradient buffers), which come in backward order.
  std::vector<int> update_order;
  // Not when sharded: a rank's slice alone cannot tell every rank whether to skip the update.
  // Not with fp16: an overflow anywhere skips the whole step, so no unit may update before the
  // norm is known (as with clipping). Not with the delayed update: the step's update runs while
  // the next step computes.
  bool immediate_ok = false;
  // A retry needs no other process to agree on it (FailedUpdate) ...
  bool can_retry = false;
  // ... or, several processes, the ranks agreeing on each unit before it counts as updated
  // (agree_unit; the NVMe optimizer agrees inside update_units_nvme, after the unit's writes
  // retired) and the pipeline stages on each step (agree_stages): then a failed update stops at
  // the same unit on every rank, and every rank retries the same units (docs/offload.md "Faults").
  bool agreed_retry = false;
  // Several processes, a failure before the norm: every rank failed the step alike (a non-finite
  // norm merged over every group, or a flag gathered with the statistics, agree_before_norm).
  bool agree_before = false;
  // agree_before: this rank's failure of the step in flight before its norm (a landed unit's
  // copy or scan), held until the step's kFinish or kAbort agrees on it with the other ranks.
  Status own_before;

  UpdateLedger& ledger_;
  ParamHomes& homes_;
  GradientPath& grads_;
  DeviceOptimizer& devopt_;
};

}  // namespace strata::offload_detail
