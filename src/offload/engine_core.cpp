// The engine core (engine_core.hpp): its helpers, and the gradient norm over the groups.
#include "offload/engine_core.hpp"

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

namespace strata::offload_detail {

Result<HostMem> HostMem::make(Device& device, bool pin, std::uint64_t bytes, std::string_view tag) {
  HostMem h;
  bytes = std::max<std::uint64_t>(bytes, 4096);
  if (pin) {
    STRATA_ASSIGN_OR_RETURN(h.pinned, device.pinned().allocate(bytes, tag));
  } else {
    STRATA_ASSIGN_OR_RETURN(h.plain, AlignedBuffer::allocate(bytes));
  }
  std::memset(h.data(), 0, bytes);
  return h;
}

OptimizerHyper hyper_of(const OptimizerSettings& o, double lr, bool decay) {
  OptimizerHyper h;
  h.kind = o.decoupled ? OptimizerKind::kAdamW : OptimizerKind::kAdam;
  h.lr = lr;
  h.beta1 = o.beta1;
  h.beta2 = o.beta2;
  h.eps = o.eps;
  h.weight_decay = decay ? o.weight_decay : 0.0;
  return h;
}

std::string unit_key(const char* kind, int u) { return std::string(kind) + "." + std::to_string(u); }

int EngineCore::owner_unit(int index) const {
  const ParamDesc& p = layout().params[static_cast<std::size_t>(index)];
  return p.owns_storage() ? p.module : layout().params[static_cast<std::size_t>(p.tied_with)].module;
}

int EngineCore::owned_index(int index) const {
  const ParamDesc& p = layout().params[static_cast<std::size_t>(index)];
  const int target = p.owns_storage() ? index : p.tied_with;
  for (std::size_t k = 0; k < owned.size(); ++k)
    if (owned[k].index == target) return static_cast<int>(k);
  return -1;
}

Status EngineCore::traced_copy(Stream& s, int copy_track, const char* what, void* dst, const void* src,
                               std::uint64_t n, CopyKind kind, int u) {
  STRATA_RETURN_IF_ERROR(tracer.stream_begin(s, copy_track));
  STRATA_RETURN_IF_ERROR(s.copy_async(dst, src, n, kind));
  return tracer.stream_end(
      s, copy_track, kind == CopyKind::kDeviceToHost ? TraceCounter::kD2H : TraceCounter::kH2D, what, u, n);
}

EnginePart::EnginePart(EngineCore& c)
    : core(c),
      config(c.config),
      settings(c.settings),
      placement(c.placement),
      device(c.device),
      compute(c.compute),
      h2d(c.h2d),
      gstream(c.gstream),
      model(c.model),
      launch(c.launch),
      stager(c.stager),
      M(c.M),
      wdtype(c.wdtype),
      half(c.half),
      fp16(c.fp16),
      delayed(c.delayed),
      grads_on_nvme(c.grads_on_nvme),
      owned(c.owned),
      owned_of_unit(c.owned_of_unit),
      bound_params(c.bound_params),
      bound_grads(c.bound_grads),
      swap(c.swap),
      host_opt(c.host_opt),
      tracer(c.tracer),
      track(c.track),
      comms(c.comms),
      dp_tracks(c.dp_tracks),
      dp_size(c.comms.dp_size),
      dp_rank(c.comms.dp_rank),
      tp_size(c.comms.tp_size),
      tp_rank(c.comms.tp_rank),
      pp_size(c.comms.pp_size),
      pp_rank(c.comms.pp_rank),
      faults(c.faults) {}

Result<GradStats> EngineCore::scan_norm(const CpuOptimizer& opt, int u, const char* grads,
                                        std::uint64_t first, std::uint64_t n, float inv_scale) const {
  if (comms.tp_size == 1)
    return opt.scan_gradients(const_cast<char*>(grads), DType::kF32, n, inv_scale, false);
  GradStats total;
  for (const auto& [a, b] : placement.units[static_cast<std::size_t>(u)].norm_ranges) {
    const std::uint64_t lo = std::max(a, first), hi = std::min(b, first + n);
    if (lo >= hi) continue;
    STRATA_ASSIGN_OR_RETURN(GradStats g, opt.scan_gradients(const_cast<char*>(grads) + 4 * (lo - first),
                                                            DType::kF32, hi - lo, inv_scale, false));
    total.merge(g);
  }
  return total;
}

Result<GradStats> EngineCore::merge_over_tp(const GradStats& local, Comm& comm, float* verdict) const {
  static_assert(sizeof(GradStats) % 4 == 0);
  // Two records per rank: its statistics and its failure flag (agree_before_norm; 0 without).
  constexpr std::size_t kWords = 2 * sizeof(GradStats) / 4;
  const GradStats mine[2] = {local, GradStats{verdict != nullptr ? *verdict : 0.0, 0}};
  std::vector<GradStats> all(2 * static_cast<std::size_t>(comms.tp_size));
  // The statistics travel as raw 32-bit words (an all-gather moves bits, it does not add).
  STRATA_RETURN_IF_ERROR(comm.all_gather(mine, all.data(), kWords, DType::kF32)
                             .wait()
                             .with_context("tensor parallel: gathering the gradient statistics"));
  GradStats total;
  for (int r = 0; r < comms.tp_size; ++r) {
    total.merge(all[2 * static_cast<std::size_t>(r)]);
    if (verdict != nullptr)
      *verdict =
          std::max(*verdict, static_cast<float>(all[2 * static_cast<std::size_t>(r) + 1].sum_of_squares));
  }
  return total;
}

Result<GradStats> EngineCore::merge_stage_stats(const std::vector<GradStats>& stats, float* verdict) {
  static_assert(sizeof(GradStats) % 4 == 0);
  // M + 1 records per stage: its per-unit statistics and its failure flag (agree_before_norm).
  const std::size_t per = static_cast<std::size_t>(M) + 1;
  std::copy_n(stats.begin(), std::min<std::size_t>(stats.size(), per - 1), pp_stats.begin());
  pp_stats[per - 1] = GradStats{verdict != nullptr ? *verdict : 0.0, 0};
  Status s = comms.pp_norm
                 ->all_gather(pp_stats.data(), pp_gathered.data(), pp_stats.size() * sizeof(GradStats) / 4,
                              DType::kF32)
                 .wait();
  if (!s.ok()) return s.with_context("pipeline: gather of the gradient statistics");
  GradStats total;
  for (int u = 0; u < M; ++u) {
    const int st = placement.units[static_cast<std::size_t>(u)].holder_stage;
    total.merge(pp_gathered[static_cast<std::size_t>(st) * per + static_cast<std::size_t>(u)]);
  }
  if (verdict != nullptr) {
    for (int st = 0; st < comms.pp_size; ++st) {
      const GradStats& flag = pp_gathered[static_cast<std::size_t>(st) * per + per - 1];
      *verdict = std::max(*verdict, static_cast<float>(flag.sum_of_squares));
    }
  }
  return total;
}

Status EngineCore::reduce_tied_grads(float* grads, std::size_t n) {
  if (!comms.pp_tied) return ok_status();
  return comms.pp_tied->all_reduce(grads, grads, n, DType::kF32, ReduceOp::kSum)
      .wait()
      .with_context(
          "pipeline: all-reduce of the tied embedding's gradient between the first and the last stage");
}

float EngineCore::grid_place() const {
  const bool over_dp = placement.sharding.host_state_sharded && comms.dp_params != nullptr;
  const int dps = over_dp ? comms.dp_size : 1, dpr = over_dp ? comms.dp_rank : 0;
  return static_cast<float>(1 + dpr + dps * (comms.tp_rank + comms.tp_size * comms.pp_rank));
}

std::string EngineCore::name_grid_place(float place) const {
  const bool over_dp = placement.sharding.host_state_sharded && comms.dp_params != nullptr;
  const int dps = over_dp ? comms.dp_size : 1;
  const int r = static_cast<int>(place) - 1;
  std::string out;
  auto add = [&](const std::string& part) { out += (out.empty() ? "" : ", ") + part; };
  if (dps > 1) add("data-parallel rank " + std::to_string(r % dps));
  if (comms.tp_size > 1) add("tensor-parallel rank " + std::to_string(r / dps % comms.tp_size));
  if (comms.pp_size > 1) add("pipeline stage " + std::to_string(r / dps / comms.tp_size));
  return out;
}

Status EngineCore::dp_wait(int trace_track, CommWork w, const char* what, int u, std::uint64_t bytes) {
  detail::HostSpan span(tracer, trace_track, TraceCounter::kComm, what, u, bytes);
  dp_bytes.fetch_add(bytes, std::memory_order_relaxed);
  Status s = w.wait();
  if (s.ok()) return s;
  std::string context = std::string("data parallel: ") + what;
  if (u >= 0) context += " of module '" + layout().modules[static_cast<std::size_t>(u)].name + "'";
  return s.with_context(context);
}

}  // namespace strata::offload_detail
