// The host optimizer's update of one unit (host_optimizer.hpp), in memory: CPU Adam on the
// unit (or this rank's slice of it), then its parameters published home.
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

#include "offload/host_optimizer.hpp"

namespace strata::offload_detail {

Status HostOptimizer::update_unit_host(int u, std::int64_t step, double lr, float scale,
                                       std::int64_t done_step) {
  const std::size_t uu = static_cast<std::size_t>(u);
  STRATA_RETURN_IF_ERROR(hold_update(u, done_step));
  if (delayed) STRATA_RETURN_IF_ERROR(homes_.await_upload(u));  // the update writes the host copy in place
  const bool nvme_home = placement.units[uu].home == Tier::kNvme;
  char* out_unit = nvme_home ? homes_.param_out_staging.bytes()
                   : delayed && placement.units[uu].home == Tier::kHost
                       ? homes_.delayed_next.bytes() + placement.units[uu].next_offset
                       : homes_.host_params.bytes() + placement.units[uu].host_offset;
  if (!placement.sharding.host_state_sharded && host_opt_step[uu] >= done_step) {
    // A retry: master and moments hold the step already, only publishing the parameters failed.
    STRATA_RETURN_IF_ERROR(
        homes_.working_from_master(u, reinterpret_cast<const float*>(host_at(host_master, grad_begin(u))), 0,
                                   placement.units[uu].grad_bytes / 4, out_unit));
    return homes_.publish_params(u, out_unit);
  }
  if (placement.sharding.host_state_sharded) {
    // This rank's slice [b, b + len) of the unit: its parts of each parameter are updated into
    // ag_send (the unit's fp32 element positions, working dtype), the ranks' chunks are
    // all-gathered, and every parameter is copied from there into the unit's working layout.
    const std::uint64_t b = placement.units[uu].slice.begin, len = placement.units[uu].slice.len,
                        c = placement.units[uu].slice.chunk, off = placement.units[uu].slice_offset;
    const std::uint64_t w = half ? 2 : 4;
    if (host_opt_step[uu] >= done_step) {
      // A retry (data parallel): this rank's master and moments hold the step; only its slice of
      // the working parameters is rebuilt from the master (the rounding param_out does), then
      // gathered and published as below.
      STRATA_RETURN_IF_ERROR(
          core.for_each_part(u, b, len, [&](const OwnedParam&, std::uint64_t lo, std::uint64_t hi) {
            return core.master_to_working(host_master.floats() + off + (lo - b),
                                          ag_send.bytes() + (lo - b) * w, hi - lo);
          }));
    } else {
      detail::HostSpan span(tracer, track.optimizer, TraceCounter::kOptimizer, "adam", u);
      STRATA_RETURN_IF_ERROR(core.for_each_part(
          u, b, len, [&](const OwnedParam& o, std::uint64_t lo, std::uint64_t hi) -> Status {
            OptimizerBuffers ob;
            ob.master = host_master.floats() + off + (lo - b);
            ob.grad = grads_.shard_grads.bytes() + 4 * (off + (lo - b));
            ob.grad_dtype = DType::kF32;
            ob.exp_avg = host_m.floats() + off + (lo - b);
            ob.exp_avg_sq = host_v.floats() + off + (lo - b);
            ob.moment_dtype = DType::kF32;
            char* out = ag_send.bytes() + (lo - b) * w;
            ob.param_out = half ? out : nullptr;
            ob.out_dtype = wdtype;
            ob.n = hi - lo;
            STRATA_RETURN_IF_ERROR(
                host_opt->update(hyper_of(config.optimizer, lr, o.decay), step, scale, ob));
            if (!half) std::memcpy(out, ob.master, ob.n * 4);
            return ok_status();
          }));
      host_opt_step[uu] = done_step;
    }
    if (placement.units[uu].gathered_at_fetch)
      return homes_.write_param_slice(u, ag_send.bytes(), delayed);  // gathered when next fetched
    STRATA_RETURN_IF_ERROR(dp_wait(dp_tracks[2],
                                   comms.dp_params->all_gather(ag_send.data(), ag_recv.data(), c,
                                                               // moves bits: fp16 travels as 16-bit words
                                                               half ? DType::kBF16 : DType::kF32),
                                   "gather parameters", u, static_cast<std::uint64_t>(dp_size) * c * w));
    homes_.from_elements(u, ag_recv.bytes(), out_unit);
    return homes_.publish_params(u, out_unit);
  }
  std::optional<detail::HostSpan> span(std::in_place, tracer, track.optimizer, TraceCounter::kOptimizer,
                                       "adam", u);
  for (int k : owned_of_unit[uu]) {
    const OwnedParam& o = owned[static_cast<std::size_t>(k)];
    OptimizerBuffers b;
    b.master = reinterpret_cast<float*>(host_at(host_master, o.grad_offset));
    b.grad = host_at(grads_.host_grads, o.grad_offset);
    b.grad_dtype = DType::kF32;
    b.exp_avg = host_at(host_m, o.grad_offset);
    b.exp_avg_sq = host_at(host_v, o.grad_offset);
    b.moment_dtype = DType::kF32;
    b.param_out = half ? out_unit + o.param_in_unit : nullptr;
    b.out_dtype = wdtype;
    b.n = o.n;
    STRATA_RETURN_IF_ERROR(host_opt->update(hyper_of(config.optimizer, lr, o.decay), step, scale, b));
    if (!half) std::memcpy(out_unit + o.param_in_unit, b.master, o.n * 4);
  }
  span.reset();
  host_opt_step[uu] = done_step;
  return homes_.publish_params(u, out_unit);
}

}  // namespace strata::offload_detail
