// The NVMe optimizer ring (docs/offload.md "NVMe optimizer"): the host optimizer thread streams
// each unit's [master | m | v] (swap key "optim.<u>", one shard per sub-group of
// UnitPlacement::sub_groups) through a ring of pinned buffers: reads run ahead of the update by
// up to ring.size() - 1 sub-groups and each sub-group is written back as soon as it is updated.
// A unit's updated working parameters gather in one of two staging buffers (param_out) and go to
// their home after its last sub-group. Writes retire in issue order; a unit counts as updated
// (its parameters may be fetched) once all of its writes have retired, since a read before that
// would return the previous version. group_step records, per unit and sub-group, the step whose
// state is on disk (a retry skips what is there).
//
// Part of the host optimizer (HostOptimizer::nvme): the optimizer thread alone runs it, one
// command at a time.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "offload/engine_core.hpp"
#include "offload/gradient_path.hpp"
#include "offload/param_homes.hpp"
#include "offload/update_ledger.hpp"

namespace strata::offload_detail {

class HostOptimizer;

class NvmeRing : public EnginePart {
 public:
  NvmeRing(EngineCore& core, UpdateLedger& ledger, ParamHomes& homes, GradientPath& grads,
           HostOptimizer& host)
      : EnginePart(core), ledger_(ledger), homes_(homes), grads_(grads), host_(host) {}

  // Carved by the engine's setup.
  std::vector<HostMem> ring;  // one sub-group each
  HostMem param_out[2];       // updated parameters, alternating units
  // Optimizer thread (and load_checkpoint, with the thread drained): per unit and sub-group the
  // step whose [master | m | v] is on disk.
  std::vector<std::vector<std::int64_t>> group_step;
  // OffloadStats::early_optimizer_reads / _dropped: sub-group reads issued during backward, and
  // those of them no update took over (ended by drop_early_reads). Written by the optimizer
  // thread, read by stats().
  std::atomic<std::uint64_t> early_reads_issued{0}, early_reads_dropped{0};
  // The step whose reads were issued (once per step); -1 again after every command but kLanded,
  // so a step that failed before its update and runs again (the same step number) reads early too.
  std::int64_t early_reads_step = -1;

  // One sub-group of a unit streamed through the ring (kNoNvmeGroup: this rank's slice of the
  // unit is empty, or it has no state here but takes part in the unit's collectives).
  static constexpr std::size_t kNoNvmeGroup = SIZE_MAX;
  struct NvmeItem {
    int unit;
    std::size_t group;
  };
  // The sub-groups update_units_nvme streams for the units of `order`, in order.
  std::vector<NvmeItem> nvme_items(const std::vector<int>& order) const;
  // The units step `step`'s update of this stage's NVMe optimizer state covers, in update order
  // (forward order; the delayed update: backward order); a unit that holds the step is left out.
  std::vector<int> nvme_update_order(std::int64_t step) const;
  // The reads of [master | m | v] of the first ring.size() - 1 sub-groups of step `step`'s
  // update, issued at its first landed unit, while backward still runs: that state does not
  // depend on the gradients, and the previous update (the last to write it) has finished, the
  // optimizer thread running one command at a time. Item k of nvme_items(nvme_update_order(step))
  // is read into ring buffer k, where update_units_nvme's read of it would go; the update takes
  // over the reads whose sub-group it streams first and waits out any other before it reuses a
  // buffer. Every command but kLanded ends with none in flight (drop_early_reads), so the ring is
  // free and nothing reads stale state between steps (set_param, load_checkpoint and a retry
  // write or read the state only then).
  void issue_early_reads(std::int64_t step);
  void drop_early_reads();
  // `step`: the optimizer's update number; `done_step`: the engine step each unit is marked
  // updated for (they differ once fp16 steps were skipped).
  Status update_units_nvme(const std::vector<int>& order, std::int64_t step, double lr, float scale,
                           std::int64_t done_step);

 private:
  struct EarlyRead {
    NvmeItem item;
    IoHandle handle;  // invalid for a kNoNvmeGroup item
    std::int64_t issued_at = 0;
  };
  std::vector<EarlyRead> early_reads;
  UpdateLedger& ledger_;
  ParamHomes& homes_;
  GradientPath& grads_;
  HostOptimizer& host_;
};

}  // namespace strata::offload_detail
