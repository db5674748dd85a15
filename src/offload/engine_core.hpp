// What every part of the offload engine reads (docs/offload.md "The map"): the settings, the
// placement, the device and its three streams, the model and its parameter table, the NVMe
// store, the tracer, this rank's communicators and the caller's step numbers. EngineCore owns
// them; the parts (param_homes.hpp, fetcher.hpp, gradient_path.hpp, device_optimizer.hpp,
// host_optimizer.hpp, ...) each own their own state and see the core through EnginePart.
//
// Written once, by setup() (engine_setup.cpp), before any part runs, except:
//   now          the caller's step numbers, written by the caller between passes and read by the
//                host functions of the pass it enqueues (stream order publishes them)
//   grad_norm    the step's norm: written by the caller, or by the device update's host function
//                before the caller synchronizes the compute stream
//   bound_*      the model's bindings: caller thread only (bind)
//   dp_bytes     counted by whichever thread waits on a data-parallel collective (atomic)
//   tracer       thread-safe (offload/trace.hpp)
//   pp_stats     the thread that merges the norm over the stages (one at a time per step)
//
// Streams. compute (the model's kernels), h2d (parameter fetches and uploads of updated
// parameters), grads (bucket restores and gradient copies to the host). Events order them:
//   slot.fetched : h2d → compute        (the fetched parameters are in the slot)
//   slot.free    : compute → h2d        (compute is done reading the slot's previous unit)
//   bucket.done  : compute → grads      (the bucket's backward is done)
//   bucket.free  : grads → compute      (the bucket's copy to the host is done)
//   landed[u]    : grads → optimizer thread (u's final gradients are on the host)
//   uploaded[u]  : h2d → compute        (u's updated resident parameters are on the device)
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "model/launcher.hpp"
#include "model/staging.hpp"
#include "nvme/faults.hpp"
#include "offload/trace.hpp"
#include "parallel/rank_comms.hpp"
#include "partition/placement.hpp"
#include "strata/alloc.hpp"
#include "strata/device.hpp"
#include "strata/model.hpp"
#include "strata/nvme.hpp"
#include "strata/offload.hpp"
#include "strata/optim.hpp"
#include "strata/parallel.hpp"
#include "strata/training.hpp"

namespace strata::offload_detail {

using detail::TraceCounter;

// Host memory of the plan: from the pinned pool or standalone page-aligned memory.
struct HostMem {
  ArenaBuffer pinned;
  AlignedBuffer plain;
  void* data() const { return pinned ? pinned.data() : plain.data(); }
  char* bytes() const { return static_cast<char*>(data()); }
  float* floats() const { return static_cast<float*>(data()); }

  static Result<HostMem> make(Device& device, bool pin, std::uint64_t bytes, std::string_view tag);
};

// One owning parameter, as the optimizer sees it.
struct OwnedParam {
  int index = -1;
  int unit = -1;
  bool decay = false;
  std::uint64_t grad_in_unit = 0;   // bytes from the unit's grad_begin (fp32 layout)
  std::uint64_t param_in_unit = 0;  // bytes from the unit's param_begin (working layout)
  std::uint64_t grad_offset = 0;    // in the engine's fp32 arrays (grad_begin(unit) + grad_in_unit)
  std::size_t n = 0;
};

OptimizerHyper hyper_of(const OptimizerSettings& o, double lr, bool decay);

// A swap key of unit u: "param.<u>", "optim.<u>", "grad.<u>", "grad_local.<u>".
std::string unit_key(const char* kind, int u);

// The timeline's tracks (added in setup).
struct Tracks {
  int caller = 0, compute = 0, h2d = 0, grads = 0, copy_h2d = 0, copy_d2h = 0, optimizer = 0;
  int nvme_fetch = 0, nvme_publish = 0, nvme_ring = 0;  // ring buffer r: nvme_ring + r
};

// The caller's numbers of the step in flight (set by step() before its first micro-batch).
struct StepNow {
  std::int64_t steps = 0;     // steps done (StepMetrics::step of the last one)
  std::int64_t opt_step = 0;  // the optimizer's update number of the step in flight (fp16 skips hold it back)
  double loss_scale = 1.0;    // the loss scale its gradients carry (fp16; 1 otherwise)
};

// Tests only (offload_detail::EngineFaults): every hook in one place, read where the engine
// checks it (one branch each, none on a per-element path).
struct FaultHooks {
  const nvme_detail::IoFaults* io = nullptr;  // the I/O engine injects these (create_with_faults)
  // fail_next_pass: the next step's call fails with it once its streams are idle, as a stream
  // error seen after the pass. Caller thread only.
  Status pass_error;
  // fail_compute_at: the next access of module compute_module enqueues compute_error on the
  // compute stream. Caller thread only.
  int compute_module = -1;
  Status compute_error;
  // fail_caller_at: the next access of module caller_module returns caller_error. Caller only.
  int caller_module = -1;
  Status caller_error;
  // hold_update_until_forward: the optimizer thread's next update of unit `held_unit` waits until
  // the compute stream ran the forward of module `hold_forward` in a pass that reads that update
  // (UpdateLedger::forward_ran_at). held_unit is read without the ledger's lock.
  std::atomic<int> held_unit{-1};
  int hold_forward = -1;
  // gather_weights_on_save: save_weights without a pipeline takes the gather path. Caller only.
  bool gather_weights_on_save = false;
  // hide_weights_file: this rank does not see the weights file the first rank created. Caller.
  bool hide_weights_file = false;
  // kill_during_save: when non-zero, write_weights_part raises SIGKILL on this rank once it
  // issued this many range writes into one weights file. Caller thread only.
  std::uint64_t kill_after_weights_writes = 0;

  // At the access of module m (Fetcher::access_params): fail_caller_at's error, or
  // fail_compute_at's on the compute stream. One comparison when neither is armed.
  Status at_module(int m, Stream& compute) {
    if (caller_module != m && compute_module != m) return ok_status();
    return fire_at_module(m, compute);
  }

 private:
  Status fire_at_module(int m, Stream& compute);
};

struct EngineCore {
  TrainerConfig config;
  OffloadSettings settings;
  OffloadPlan plan;
  partition::Placement placement;  // what lives where: built once in setup, then only read
  Device* device = nullptr;
  Stream* compute = nullptr;
  Stream* h2d = nullptr;
  Stream* gstream = nullptr;
  std::unique_ptr<Model> model;
  std::unique_ptr<detail::KernelLauncher> launch;  // the device optimizer's kernels
  std::unique_ptr<detail::HostStager> stager;      // state access's copies to and from the device
  int M = 0;
  DType wdtype = DType::kF32;  // working parameters
  bool half = false;           // 16-bit working parameters (bf16, fp16) with separate fp32 masters
  bool fp16 = false;           // fp16: loss scaling and skipped steps
  bool delayed = false;        // settings.delayed_update
  bool grads_on_nvme = false;  // the host tier's gradients wait on NVMe
  int chunks = 1;              // Placement::stage.chunks
  bool pp_update_may_fail = false;
  std::vector<OwnedParam> owned;                // every owning parameter this stage holds
  std::vector<std::vector<int>> owned_of_unit;  // indices into `owned`
  std::vector<char*> bound_params;              // what the model's modules read and write
  std::vector<float*> bound_grads;
  std::unique_ptr<IoEngine> io;
  std::unique_ptr<SwapStore> swap;
  std::optional<CpuOptimizer> host_opt;  // optimizer on host or NVMe: the host tier's scans and updates
  detail::Tracer tracer;
  Tracks track;
  parallel::RankComms comms;
  int dp_tracks[4] = {0, 0, 0, 0};  // caller, gradient stream, optimizer thread, h2d stream
  std::atomic<std::uint64_t> dp_bytes{0};
  std::vector<ModelLayout> tp_layouts;  // every tensor-parallel rank's shard layout, by tp rank
  std::vector<GradStats> pp_stats;      // this stage's per-unit statistics (+ a failure flag) ...
  std::vector<GradStats> pp_gathered;   // ... and every stage's (stage-major)
  StepNow now;
  double grad_norm = 0.0;
  std::optional<LossScaler> scaler;  // fp16 only; moved by the caller once a step's norm is known
  FaultHooks faults;

  const ModelLayout& layout() const { return model->layout(); }
  // Unit u's gradient offset in the engine's fp32 arrays (UnitPlacement::grad_offset: the
  // layout's grad_begin in one process; packed to the stage's units in a pipeline).
  std::uint64_t grad_begin(int u) const { return placement.units[static_cast<std::size_t>(u)].grad_offset; }
  std::uint64_t param_begin(int u) const { return layout().modules[static_cast<std::size_t>(u)].param_begin; }
  int owner_unit(int index) const;
  int owned_index(int index) const;
  // Unit u's owned parameters cut to elements [first, first + n) of the unit's fp32 layout (a
  // data-parallel slice, an NVMe sub-group): f(o, lo, hi) for each parameter o with a non-empty
  // part [lo, hi) (unit element positions), in table order; the first error ends the walk.
  template <class F>
  Status for_each_part(int u, std::uint64_t first, std::uint64_t n, F&& f) const {
    for (int k : owned_of_unit[static_cast<std::size_t>(u)]) {
      const OwnedParam& o = owned[static_cast<std::size_t>(k)];
      const std::uint64_t a = o.grad_in_unit / 4;
      const std::uint64_t lo = std::max<std::uint64_t>(a, first),
                          hi = std::min<std::uint64_t>(a + o.n, first + n);
      if (lo >= hi) continue;
      STRATA_RETURN_IF_ERROR(f(o, lo, hi));
    }
    return ok_status();
  }
  // `n` fp32 masters as working words at `out`: 16-bit converted (the rounding the update's
  // param_out does), fp32 copied (the working copy is the master).
  Status master_to_working(const float* master, char* out, std::uint64_t n) const {
    if (half) return convert(master, DType::kF32, out, wdtype, n);
    std::memcpy(out, master, n * 4);
    return ok_status();
  }
  // Global fp32-layout offset `off` (of a host unit) in one of the host arrays (gradients,
  // master, moments), which start at the device units' end with a partial split.
  char* host_at(const HostMem& h, std::uint64_t off) const {
    return h.bytes() + (off - placement.sizes.device_opt_bytes);
  }
  // The factor the update multiplies gradients by: the clip coefficient of the unscaled norm,
  // over the loss scale. One formula for every placement, so every placement gets the same bits.
  float update_scale(double norm, double loss_scale) const {
    return static_cast<float>(clip_coefficient(norm, config.grad_clip) / loss_scale);
  }
  Status bind(int u) {
    return model->bind_module(u, bound_params[static_cast<std::size_t>(u)],
                              bound_grads[static_cast<std::size_t>(u)]);
  }
  // A copy with its span on a copy-engine track.
  Status traced_copy(Stream& s, int copy_track, const char* what, void* dst, const void* src, std::uint64_t n,
                     CopyKind kind, int u);
  // A collective's wait, timed on the data-parallel track; errors name what it was for.
  Status dp_wait(int trace_track, CommWork w, const char* what, int u, std::uint64_t bytes);
  // Whether a state read can fail on one rank alone: NVMe reads (I/O errors, checksums) can; host
  // memcpy cannot, and a device download failing on one rank only is left out. The same on every
  // rank (the settings are), so the agreement exchanges are skipped, on every rank alike, where
  // nothing can fail: state access costs no extra collective without NVMe.
  bool state_reads_can_fail() const {
    return settings.params == Tier::kNvme || settings.optimizer == Tier::kNvme ||
           settings.gradients == Tier::kNvme;
  }
  // The stage whose copy of unit u counts (the lowest stage holding it: GPT-2's tied embedding
  // is the first stage's); 0 without a pipeline.
  int holder(int u) const {
    return comms.pp_size > 1 ? placement.units[static_cast<std::size_t>(u)].holder_stage : 0;
  }

  // ---- the gradient norm over the groups (grad_norm.cpp) ----
  // This rank's part of the gradient norm over `n` fp32 gradients at `grads`, elements
  // [first, first + n) of unit u's layout (the unit, or this rank's data-parallel slice of it).
  // Tensor parallel: replicated parameters count on tp rank 0 only (UnitPlacement::norm_ranges).
  Result<GradStats> scan_norm(const CpuOptimizer& opt, int u, const char* grads, std::uint64_t first,
                              std::uint64_t n, float inv_scale) const;
  // The statistics of every tensor-parallel rank merged in rank order (the same bits on every rank).
  // `verdict` (optional): this rank's failure flag in, the max over the group out; it travels
  // as one more record of the same gather.
  Result<GradStats> merge_over_tp(const GradStats& local, Comm& comm, float* verdict = nullptr) const;
  // `stats` (per unit, this stage's) merged over the stages in unit order, each unit's from the
  // lowest stage holding it: the single process's merge (collective over pp_norm).
  // `stats`' first M records are used; `verdict` as in merge_over_tp.
  Result<GradStats> merge_stage_stats(const std::vector<GradStats>& stats, float* verdict = nullptr);
  // The tied unit's gradient (`n` elements at `grads`: the whole unit, or this data-parallel
  // rank's slice of it, the same slice on both ends) summed over the first and the last stage
  // (collective).
  Status reduce_tied_grads(float* grads, std::size_t n);

  // ---- who agrees on what when an update fails (docs/offload.md "Faults") ----
  // Several processes whose failed host update is retried in place. The ranks that update the
  // same units together (data parallel with the optimizer state sharded over them; the tensor
  // group, each rank its shard) agree on every unit before it counts as updated (agree_per_unit,
  // HostOptimizer::agree_unit), so a failure stops them all at the same unit and none waits in a
  // unit's all-gather its peer skipped. Pipeline stages update different units: each stage's
  // optimizer thread agrees once more at the end of the update (agree_stages) and marks its units
  // updated only then (defer_marks), and a call first waits for the update in flight (recover),
  // so every stage's call sees the same verdict before it sends or receives anything of the next
  // step. That costs the pipeline the overlap of the update with the next step's forward, so it
  // is paid only where the update can fail after the norm (`pp_update_may_fail`: the NVMe
  // optimizer, NVMe gradients or NVMe parameter homes, whose writes can fail); an update in
  // memory cannot (a failed collective is not retried).
  bool agree_per_unit() const {
    return (placement.sharding.host_state_sharded && comms.dp_params != nullptr) || comms.tp_size > 1;
  }
  // Units updated as their gradients land, inside the step's call (HostOptimizer's immediate_ok).
  bool update_immediately() const {
    return !delayed && settings.update_during_backward && config.grad_clip <= 0.0 && !fp16 &&
           settings.optimizer == Tier::kHost && !placement.sharding.host_state_sharded &&
           comms.pp_size == 1 && !placement.any_nvme_home();
  }
  // Several processes, the host optimizer: a rank's own failure of a step before its norm (a
  // stream error the caller sees, a failed scan or copy of landed gradients, a gradient read or
  // write) travels as a flag with the statistics that every rank gathers for the norm anyway (the
  // data-parallel all-gather, the stages' and the tensor ranks' gathers: together they reach every
  // rank of the grid), so every rank fails the step alike and none waits in a gather its peer
  // skipped; nothing was updated anywhere and every rank runs the step again. With the delayed
  // update the failing rank's call may have skipped publishing the previous update that its
  // peers published: it publishes it before the step runs again (publish_before_rerun), so every
  // rank reruns at the same parameters. Units updated while they land (update_immediately) are
  // agreed the same way but not retryable: some ranks may have updated some units (sticky, every
  // rank naming the cause and the checkpoint to reload). Not with data parallelism whose
  // optimizer state is not sharded (no statistics gather over the data-parallel group).
  bool agree_before_norm() const {
    return !placement.sharding.optimizer_on_device &&
           (comms.dp_size > 1 || comms.tp_size > 1 || comms.pp_size > 1) &&
           (comms.dp_size == 1 || (placement.sharding.host_state_sharded && comms.dp_params != nullptr));
  }
  bool defer_marks() const { return pp_update_may_fail; }
  // Several ranks agreeing per unit, no pipeline: a failed update is reported by the call that
  // waits for the first unit not holding the step (recover, wait_update_of). On a pipeline every
  // call first waits for the verdict instead, and reports it at once.
  bool report_at_wait() const { return agree_per_unit() && !defer_marks(); }
  // The agreed place of a failing rank in the grid (1 + data-parallel rank + dp * (tensor rank +
  // tp * stage)), 0 for none, and the words naming it.
  float grid_place() const;
  std::string name_grid_place(float place) const;
};

// A part of the engine: it owns its own state and sees the core's through these references,
// named as the core names them (bound at construction; the core's fields are filled in by setup
// before any part runs, and a reference sees them then).
class EnginePart {
 public:
  explicit EnginePart(EngineCore& core);
  EnginePart(const EnginePart&) = delete;
  EnginePart& operator=(const EnginePart&) = delete;

 protected:
  EngineCore& core;
  TrainerConfig& config;
  OffloadSettings& settings;
  partition::Placement& placement;
  Device*& device;
  Stream*& compute;
  Stream*& h2d;
  Stream*& gstream;
  std::unique_ptr<Model>& model;
  std::unique_ptr<detail::KernelLauncher>& launch;
  std::unique_ptr<detail::HostStager>& stager;
  int& M;
  DType& wdtype;
  bool& half;
  bool& fp16;
  bool& delayed;
  bool& grads_on_nvme;
  std::vector<OwnedParam>& owned;
  std::vector<std::vector<int>>& owned_of_unit;
  std::vector<char*>& bound_params;
  std::vector<float*>& bound_grads;
  std::unique_ptr<SwapStore>& swap;
  std::optional<CpuOptimizer>& host_opt;
  detail::Tracer& tracer;
  Tracks& track;
  parallel::RankComms& comms;
  int (&dp_tracks)[4];
  int& dp_size;
  int& dp_rank;
  int& tp_size;
  int& tp_rank;
  int& pp_size;
  int& pp_rank;
  FaultHooks& faults;

  const ModelLayout& layout() const { return core.layout(); }
  std::uint64_t grad_begin(int u) const { return core.grad_begin(u); }
  std::uint64_t param_begin(int u) const { return core.param_begin(u); }
  int owned_index(int index) const { return core.owned_index(index); }
  char* host_at(const HostMem& h, std::uint64_t off) const { return core.host_at(h, off); }
  Status bind(int u) { return core.bind(u); }
  Status traced_copy(Stream& s, int copy_track, const char* what, void* dst, const void* src, std::uint64_t n,
                     CopyKind kind, int u) {
    return core.traced_copy(s, copy_track, what, dst, src, n, kind, u);
  }
  Status dp_wait(int trace_track, CommWork w, const char* what, int u, std::uint64_t bytes) {
    return core.dp_wait(trace_track, std::move(w), what, u, bytes);
  }
  Result<GradStats> scan_norm(const CpuOptimizer& opt, int u, const char* grads, std::uint64_t first,
                              std::uint64_t n, float inv_scale) const {
    return core.scan_norm(opt, u, grads, first, n, inv_scale);
  }
  bool state_reads_can_fail() const { return core.state_reads_can_fail(); }
  bool agree_per_unit() const { return core.agree_per_unit(); }
  bool agree_before_norm() const { return core.agree_before_norm(); }
  bool defer_marks() const { return core.defer_marks(); }
  bool report_at_wait() const { return core.report_at_wait(); }
};

}  // namespace strata::offload_detail
