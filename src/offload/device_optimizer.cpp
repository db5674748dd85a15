// The device optimizer (device_optimizer.hpp).
#include "offload/device_optimizer.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "optim/grad_norm_cuda.hpp"

namespace strata::offload_detail {

// The update with the optimizer on the device, in stream order after backward.
Status DeviceOptimizer::device_update(double lr, std::int64_t step) {
  if (placement.sharding.device_state_sharded) return device_update_sharded(lr, step);
  if (launch->is_cpu()) {
    // One host function: the gradient scan per unit (merged in unit order, as the host tiers
    // merge theirs), then every update with the clip applied.
    struct Job {
      const CpuOptimizer* opt;
      const EngineCore* engine;
      Comm* tp;  // tensor parallel: the model's group (this stream's), null otherwise
      std::vector<std::pair<float*, std::size_t>> unit_grads;
      struct P {
        OptimizerBuffers b;
        bool decay;
      };
      std::vector<P> params;
    };
    auto job = std::make_shared<Job>();
    job->opt = &*device_opt;
    job->engine = &core;
    job->tp = tp_size > 1 ? comms.tp_model.get() : nullptr;
    for (int u = 0; u < M; ++u)
      job->unit_grads.emplace_back(reinterpret_cast<float*>(reinterpret_cast<char*>(dgrads) + grad_begin(u)),
                                   placement.units[static_cast<std::size_t>(u)].grad_bytes / 4);
    for (const OwnedParam& o : owned) {
      const OptimizerBuffers b = device_buffers(o);
      job->params.push_back(Job::P{b, o.decay});
    }
    double* norm_out = &core.grad_norm;
    const OptimizerSettings os = config.optimizer;
    const double loss_scale = core.now.loss_scale;
    const auto inv_scale = static_cast<float>(1.0 / loss_scale);
    const bool skip_overflow = fp16;
    return launch->run("optimizer step", [=, this](const kernels::KernelContext&) -> Status {
      GradStats total;
      // Each unit's scan (tensor parallel: scan_norm counts replicated parameters on one rank
      // only), merged in unit order; with a pipeline every stage's units, merged in unit order
      // (merge_stage_stats): the tied unit's gradient was summed over the first and last stage
      // before this step ran (step()). The grid: the stages merge per tp rank, merge_over_tp
      // below adds the ranks.
      std::vector<GradStats> per_unit;
      for (std::size_t u = 0; u < job->unit_grads.size(); ++u) {
        const auto& [g, n] = job->unit_grads[u];
        STRATA_ASSIGN_OR_RETURN(GradStats s,
                                job->engine->scan_norm(*job->opt, static_cast<int>(u),
                                                       reinterpret_cast<const char*>(g), 0, n, inv_scale));
        per_unit.push_back(s);
      }
      if (pp_size > 1) {
        STRATA_ASSIGN_OR_RETURN(total, core.merge_stage_stats(per_unit));
      } else {
        for (const GradStats& s : per_unit) total.merge(s);
      }
      if (job->tp != nullptr) {
        // On the compute stream, after every rank's backward: the model's group, in stream order.
        STRATA_ASSIGN_OR_RETURN(total, job->engine->merge_over_tp(total, *job->tp));
      }
      const double norm = total.norm();
      *norm_out = norm;
      if (!total.finite() && skip_overflow) return ok_status();  // fp16 overflow: the step is skipped
      if (!total.finite()) {
        return invalid_argument("step " + std::to_string(step) + ": the gradient norm is not finite (" +
                                std::to_string(norm) + "); lower the learning rate or enable clipping");
      }
      const float scale = core.update_scale(norm, loss_scale);
      for (const auto& p : job->params) {
        STRATA_RETURN_IF_ERROR(job->opt->update(hyper_of(os, lr, p.decay), step, scale, p.b));
      }
      return ok_status();
    });
  }
  // cuda: the norm is needed on the host to pick the clip scale.
  const std::size_t n = placement.sizes.grad_bytes / 4;
  auto* partials = static_cast<double*>(cuda_partials.data());
  double* result = partials + detail::sum_of_squares_cuda_partials(n);
  void* cs = compute->native_handle();
  STRATA_RETURN_IF_ERROR(detail::sum_of_squares_cuda(cs, dgrads, n, partials, result));
  STRATA_RETURN_IF_ERROR(
      compute->copy_async(pinned_norm.data(), result, sizeof(double), CopyKind::kDeviceToHost));
  STRATA_RETURN_IF_ERROR(compute->synchronize());
  core.grad_norm = std::sqrt(*static_cast<double*>(pinned_norm.data())) / core.now.loss_scale;
  if (!std::isfinite(core.grad_norm) && fp16) return ok_status();  // fp16 overflow: the step is skipped
  if (!std::isfinite(core.grad_norm)) {
    return invalid_argument("step " + std::to_string(step) +
                            ": the gradient norm is not finite; lower the learning rate or enable clipping");
  }
  const float scale = core.update_scale(core.grad_norm, core.now.loss_scale);
  // The bit-exact fused kernel (the cpu update's arithmetic), one call per weight-decay group.
  std::vector<DeviceAdamTensor> group[2];  // [0]: no decay, [1]: decay
  for (const OwnedParam& o : owned) {
    char* wp =
        homes_.resident + placement.units[static_cast<std::size_t>(o.unit)].resident_offset + o.param_in_unit;
    DeviceAdamTensor x;
    x.master = half ? reinterpret_cast<float*>(reinterpret_cast<char*>(dmaster) + o.grad_offset)
                    : reinterpret_cast<float*>(wp);
    x.param = half ? static_cast<void*>(wp) : static_cast<void*>(x.master);  // fp32: the master is the weight
    x.grad = reinterpret_cast<const float*>(reinterpret_cast<char*>(dgrads) + o.grad_offset);
    x.exp_avg = reinterpret_cast<float*>(reinterpret_cast<char*>(dm) + o.grad_offset);
    x.exp_avg_sq = reinterpret_cast<float*>(reinterpret_cast<char*>(dv) + o.grad_offset);
    x.n = o.n;
    group[o.decay ? 1 : 0].push_back(x);
  }
  const DType param_dtype = wdtype;
  for (int decay = 0; decay < 2; ++decay) {
    STRATA_RETURN_IF_ERROR(fused_adam_cuda(group[decay], param_dtype, DType::kF32,
                                           hyper_of(config.optimizer, lr, decay == 1), step, scale, cs));
  }
  return ok_status();
}

// Host-synchronous collectives inside one host function of the compute stream (the tensor-parallel
// merge's way): the stream's order puts them after every rank's backward, and the caller, which
// synchronizes the stream after the step, is the only other thread that uses the group (through
// dp_caller, never while this runs). The gradient reduction, the scan, the merge and the update
// are the host tier's sharded ones (reduce_unit_grads, scan_norm, the worker's merge,
// update_unit_host), so the two placements give the same bits.
template <class GradAt, class ParamAt>
Status DeviceOptimizer::update_slice(int u, double lr, std::int64_t step, float scale, GradAt grad_at,
                                     ParamAt param_at, char* ag_in) {
  const std::size_t uu = static_cast<std::size_t>(u);
  const std::uint64_t b = placement.units[uu].slice.begin, len = placement.units[uu].slice.len,
                      off = placement.units[uu].slice_offset, w = half ? 2 : 4;
  for (int k : owned_of_unit[uu]) {
    const OwnedParam& o = owned[static_cast<std::size_t>(k)];
    const std::uint64_t a = o.grad_in_unit / 4;
    const std::uint64_t lo = std::max<std::uint64_t>(a, b), hi = std::min<std::uint64_t>(a + o.n, b + len);
    if (lo >= hi) continue;
    char* wp = param_at(o, lo);
    OptimizerBuffers ob;
    ob.master =
        half ? dmaster + off + (lo - b) : reinterpret_cast<float*>(wp);  // fp32: the weight is the master
    ob.grad = reinterpret_cast<char*>(grad_at(lo));
    ob.grad_dtype = DType::kF32;
    ob.exp_avg = dm + off + (lo - b);
    ob.exp_avg_sq = dv + off + (lo - b);
    ob.moment_dtype = DType::kF32;
    ob.param_out = half ? wp : nullptr;
    ob.out_dtype = wdtype;
    ob.n = hi - lo;
    STRATA_RETURN_IF_ERROR(device_opt->update(hyper_of(config.optimizer, lr, o.decay), step, scale, ob));
    if (ag_in != nullptr) std::memcpy(ag_in + (lo - b) * w, wp, ob.n * w);
  }
  return ok_status();
}

Status DeviceOptimizer::device_update_sharded(double lr, std::int64_t step) {
  if (!launch->is_cpu()) {
    return failed_precondition(
        "the sharded device optimizer (zero_optimization.stage >= 1 with the optimizer on the "
        "device) runs on the cpu backend only");
  }
  const double loss_scale = core.now.loss_scale;
  return launch->run(
      "optimizer step (sharded)", [this, lr, step, loss_scale](const kernels::KernelContext&) -> Status {
        const std::uint64_t P = static_cast<std::uint64_t>(dp_size), w = half ? 2 : 4;
        const std::uint64_t cmax = placement.slices.max_chunk;
        float* rs_in = reinterpret_cast<float*>(dev_staging);  // P x chunk (stage 1)
        float* rs_out = rs_in + P * cmax;                      // chunk (stage 1)
        // chunk, working dtype (stages 2-3: the staging holds only the all-gather's part)
        char* ag_in =
            placement.sharding.device_grads_sharded ? dev_staging : reinterpret_cast<char*>(rs_out + cmax);
        char* ag_out = ag_in + w * cmax;  // P x chunk
        const auto inv_scale = static_cast<float>(1.0 / loss_scale);
        // 1. Each unit's gradients reduce-scattered; this rank's slice is written back in place (the
        //    rest of the unit's gradient buffer is not read again this step).
        std::vector<GradStats>& stats = shard_stats;
        for (int u = 0; u < M; ++u) {
          stats[static_cast<std::size_t>(u)] = GradStats{};
          const std::size_t uu = static_cast<std::size_t>(u);
          const std::uint64_t n = placement.units[uu].grad_bytes / 4, b = placement.units[uu].slice.begin,
                              len = placement.units[uu].slice.len;
          if (n == 0) continue;  // the same on every rank
          if (placement.sharding.device_grads_sharded) {
            // Stage >= 2: reduced per bucket during backward (drain_buckets ran before this).
            float* slice = dgrads + placement.units[uu].slice_offset;
            if (u == placement.stage.tied_unit && comms.pp_tied) {
              // Pipeline: GPT-2's embedding unit, its slice summed between the first and the
              // last stage once every micro-batch's reduction has been added (the host tier's
              // sum_tied_landed on its stage-2 shard; stage 1's below).
              STRATA_RETURN_IF_ERROR(core.reduce_tied_grads(slice, len));
            }
            STRATA_ASSIGN_OR_RETURN(stats[uu], scan_norm(*device_opt, u, reinterpret_cast<const char*>(slice),
                                                         b, len, inv_scale));
            continue;
          }
          float* g = reinterpret_cast<float*>(reinterpret_cast<char*>(dgrads) + grad_begin(u));
          STRATA_RETURN_IF_ERROR(reduce_scatter_unit(u, *comms.dp_params, dp_tracks[2], rs_in, rs_out));
          std::memcpy(g + b, rs_out, len * 4);
          if (u == placement.stage.tied_unit && comms.pp_tied) {
            // Pipeline: GPT-2's embedding unit, held by the first and the last stage, summed
            // between them slice by slice after the data-parallel reduction (both ends hold the
            // same dp rank's slice), as the host tier sums its reduced slices (sum_tied_landed).
            STRATA_RETURN_IF_ERROR(core.reduce_tied_grads(g + b, len));
          }
          STRATA_ASSIGN_OR_RETURN(
              stats[uu], scan_norm(*device_opt, u, reinterpret_cast<const char*>(g + b), b, len, inv_scale));
        }
        // 2. Every rank's per-unit statistics, merged unit by unit in rank order: the same bits on
        //    every rank, and the host tier's merge.
        static_assert(sizeof(GradStats) % 4 == 0);
        std::vector<GradStats>& all = gathered_stats;
        STRATA_RETURN_IF_ERROR(
            dp_wait(dp_tracks[2],
                    comms.dp_params->all_gather(stats.data(), all.data(),
                                                stats.size() * sizeof(GradStats) / 4, DType::kF32),
                    "gather gradient statistics", -1, all.size() * sizeof(GradStats)));
        GradStats total;
        if (pp_size > 1) {
          // Each unit over the data-parallel ranks, then over the stages in unit order, then (the
          // grid) over the tensor-parallel ranks: the host tier's merge order (worker_main).
          std::vector<GradStats> per_unit(static_cast<std::size_t>(M));
          for (int u = 0; u < M; ++u) {
            for (int r = 0; r < dp_size; ++r)
              per_unit[static_cast<std::size_t>(u)].merge(all[static_cast<std::size_t>(r * M + u)]);
          }
          STRATA_ASSIGN_OR_RETURN(total, core.merge_stage_stats(per_unit));
        } else {
          for (int u = 0; u < M; ++u) {
            for (int r = 0; r < dp_size; ++r) total.merge(all[static_cast<std::size_t>(r * M + u)]);
          }
        }
        if (tp_size > 1) {
          // Tensor parallel: scan_norm counted replicated parameters on tp rank 0 only. The model's
          // group, in this stream's order (after every rank's backward), as the unsharded device
          // update merges.
          STRATA_ASSIGN_OR_RETURN(total, core.merge_over_tp(total, *comms.tp_model));
        }
        const double norm = total.norm();
        core.grad_norm = norm;
        if (!total.finite() && fp16) return ok_status();  // fp16 overflow: every rank skips the step
        if (!total.finite()) {
          return invalid_argument("step " + std::to_string(step) + ": the gradient norm is not finite (" +
                                  std::to_string(norm) + "); lower the learning rate or enable clipping");
        }
        const float scale = core.update_scale(norm, loss_scale);
        // 3. Per unit in forward order: this rank's slice updated in place (master, moments, and the
        //    working copy's elements), its working elements all-gathered into every rank's copy.
        //    Stage 3 in device memory: a sliced unit's working copy is the slice itself (element e
        //    at (e - b) * w), written in place and not gathered (the next fetch gathers it).
        for (int u = 0; u < M; ++u) {
          const std::size_t uu = static_cast<std::size_t>(u);
          const std::uint64_t c = placement.units[uu].slice.chunk, b = placement.units[uu].slice.begin,
                              off = placement.units[uu].slice_offset;
          if (placement.units[uu].grad_bytes == 0) continue;
          char* unit_params = homes_.resident + placement.units[uu].resident_offset;
          const bool slice_only = placement.units[uu].slice_at_home != 0;
          std::memset(ag_in, 0, c * w);
          STRATA_RETURN_IF_ERROR(update_slice(
              u, lr, step, scale,
              [&](std::uint64_t lo) {
                return placement.sharding.device_grads_sharded
                           ? dgrads + off + (lo - b)
                           : reinterpret_cast<float*>(reinterpret_cast<char*>(dgrads) + grad_begin(u)) + lo;
              },
              [&](const OwnedParam& o, std::uint64_t lo) {
                return slice_only ? unit_params + (lo - b) * w
                                  : unit_params + o.param_in_unit + (lo - o.grad_in_unit / 4) * w;
              },
              slice_only ? nullptr : ag_in));
          if (slice_only) continue;  // the same units on every rank: the same collectives
          // Moves bits: fp16 travels as 16-bit words.
          STRATA_RETURN_IF_ERROR(dp_wait(
              dp_tracks[2], comms.dp_params->all_gather(ag_in, ag_out, c, half ? DType::kBF16 : DType::kF32),
              "gather parameters", u, P * c * w));
          homes_.from_elements(u, ag_out, unit_params);
        }
        return ok_status();
      });
}

Status DeviceOptimizer::scan_device_units() {
  const auto inv_scale = static_cast<float>(1.0 / core.now.loss_scale);
  if (placement.sharding.split_state_sharded) {
    // This rank's reduced slice of each device unit, with the host shard's call (on_landed's
    // scan_norm from the slice's first element): ratio 1's statistics of the same slices.
    return launch->run(
        "gradient scan (device modules, this rank's slices)",
        [this, inv_scale](const kernels::KernelContext&) -> Status {
          for (int u : placement.stage.device_units) {
            const std::size_t uu = static_cast<std::size_t>(u);
            STRATA_ASSIGN_OR_RETURN(
                dev_stats[uu],
                scan_norm(*device_opt, u, reinterpret_cast<const char*>(dev_slice_grads(u)),
                          placement.units[uu].slice.begin, placement.units[uu].slice.len, inv_scale));
          }
          return ok_status();
        });
  }
  if (launch->is_cpu()) {
    // The same per-unit scan as the host optimizer's (scan_norm: with tensor parallelism the
    // replicated parameters on tp rank 0 only, as on_landed counts them): the same bits.
    return launch->run(
        "gradient scan (device modules)", [this, inv_scale](const kernels::KernelContext&) -> Status {
          for (int u : placement.stage.device_units) {
            const std::size_t uu = static_cast<std::size_t>(u);
            STRATA_ASSIGN_OR_RETURN(
                dev_stats[uu],
                scan_norm(*device_opt, u, reinterpret_cast<const char*>(dgrads) + grad_begin(u), 0,
                          placement.units[uu].grad_bytes / 4, inv_scale));
          }
          return ok_status();
        });
  }
  // cuda: one sum of squares per unit, read back in turn (not bitwise with the cpu scan).
  auto* partials = static_cast<double*>(cuda_partials.data());
  void* cs = compute->native_handle();
  for (int u : placement.stage.device_units) {
    const std::size_t n = placement.units[static_cast<std::size_t>(u)].grad_bytes / 4;
    double* result = partials + detail::sum_of_squares_cuda_partials(n);
    const auto* g = reinterpret_cast<const float*>(reinterpret_cast<const char*>(dgrads) + grad_begin(u));
    STRATA_RETURN_IF_ERROR(detail::sum_of_squares_cuda(cs, g, n, partials, result));
    STRATA_RETURN_IF_ERROR(
        compute->copy_async(pinned_norm.data(), result, sizeof(double), CopyKind::kDeviceToHost));
    STRATA_RETURN_IF_ERROR(compute->synchronize());
    GradStats& st = dev_stats[static_cast<std::size_t>(u)];
    st.sum_of_squares =
        *static_cast<double*>(pinned_norm.data()) * static_cast<double>(inv_scale) * inv_scale;
    st.count = n;
  }
  return ok_status();
}

OptimizerBuffers DeviceOptimizer::device_buffers(const OwnedParam& o) const {
  OptimizerBuffers b;
  char* wp =
      homes_.resident + placement.units[static_cast<std::size_t>(o.unit)].resident_offset + o.param_in_unit;
  b.master = half ? reinterpret_cast<float*>(reinterpret_cast<char*>(dmaster) + o.grad_offset)
                  : reinterpret_cast<float*>(wp);
  b.grad = reinterpret_cast<char*>(dgrads) + o.grad_offset;
  b.grad_dtype = DType::kF32;
  b.exp_avg = reinterpret_cast<char*>(dm) + o.grad_offset;
  b.exp_avg_sq = reinterpret_cast<char*>(dv) + o.grad_offset;
  b.moment_dtype = DType::kF32;
  b.param_out = half ? wp : nullptr;
  b.out_dtype = wdtype;
  b.n = o.n;
  return b;
}

Status DeviceOptimizer::zero_device_grads(int chunk) {
  if (chunk < 0 || core.chunks == 1)
    return compute->memset_async(dgrads, 0, placement.sizes.device_opt_bytes);
  for (int u : placement.stage.device_units_of_chunk[static_cast<std::size_t>(chunk)]) {
    STRATA_RETURN_IF_ERROR(compute->memset_async(reinterpret_cast<char*>(dgrads) + grad_begin(u), 0,
                                                 placement.units[static_cast<std::size_t>(u)].grad_bytes));
  }
  return ok_status();
}

Status DeviceOptimizer::reduce_device_units(bool accumulate, int chunk) {
  if (!launch->is_cpu()) {
    return failed_precondition(
        "partial optimizer offload with data parallelism reduces the device modules' gradients on the cpu "
        "backend only");
  }
  const std::vector<int>* which =
      chunk < 0 ? &placement.stage.device_units
                : &placement.stage.device_units_of_chunk[static_cast<std::size_t>(chunk)];
  if (which->empty()) return ok_status();  // the same on every rank of the group: the same collectives
  return launch->run(
      "data-parallel reduce-scatter (device modules)",
      [this, accumulate, which](const kernels::KernelContext&) -> Status {
        const std::uint64_t P = static_cast<std::uint64_t>(dp_size);
        float* rs_in = reinterpret_cast<float*>(dev_staging);        // P x chunk
        float* rs_out = rs_in + P * placement.slices.dev_max_chunk;  // chunk
        for (int u : *which) {
          const std::size_t uu = static_cast<std::size_t>(u);
          const std::uint64_t n = placement.units[uu].grad_bytes / 4, len = placement.units[uu].slice.len;
          if (n == 0) continue;  // the same on every rank
          // The gradient stream's reduce_unit_grads at ratio 1: the unit padded with zeros to
          // P x chunk, the same call and count, so the same bits.
          STRATA_RETURN_IF_ERROR(reduce_scatter_unit(u, *comms.dp_device, dp_tracks[3], rs_in, rs_out));
          // Stage 1: the slice goes back in place (the rest of the unit is not read again this
          // step); stage 2: the slices of the micro-batches add up as ratio 1's shard does.
          float* dst = dev_slice_grads(u);
          if (accumulate) {
            for (std::uint64_t i = 0; i < len; ++i) dst[i] += rs_out[i];
          } else {
            std::memcpy(dst, rs_out, len * 4);
          }
        }
        return ok_status();
      });
}

// The device_update_sharded update for the device units (the same per-parameter cuts of the slice,
// the same kernels, so the bits of ratio 1's host update of the slice), the gradients read from
// dev_slice_grads.
Status DeviceOptimizer::update_device_units_sharded(double lr, std::int64_t step, float scale) {
  return launch->run(
      "optimizer step (device modules, this rank's slices)",
      [this, lr, step, scale](const kernels::KernelContext&) -> Status {
        const std::uint64_t P = static_cast<std::uint64_t>(dp_size), w = half ? 2 : 4;
        const std::uint64_t cmax = placement.slices.dev_max_chunk;
        char* ag_in =
            reinterpret_cast<char*>(reinterpret_cast<float*>(dev_staging) + (P + 1) * cmax);  // chunk
        char* ag_out = ag_in + w * cmax;                                                      // P x chunk
        for (int u : placement.stage.device_units) {
          const std::size_t uu = static_cast<std::size_t>(u);
          const std::uint64_t c = placement.units[uu].slice.chunk, b = placement.units[uu].slice.begin;
          if (placement.units[uu].grad_bytes == 0) continue;
          char* unit_params = homes_.resident + placement.units[uu].resident_offset;
          const float* grads = dev_slice_grads(u);
          std::memset(ag_in, 0, c * w);
          STRATA_RETURN_IF_ERROR(update_slice(
              u, lr, step, scale, [&](std::uint64_t lo) { return const_cast<float*>(grads + (lo - b)); },
              [&](const OwnedParam& o, std::uint64_t lo) {
                return unit_params + o.param_in_unit + (lo - o.grad_in_unit / 4) * w;
              },
              ag_in));
          // Moves bits: fp16 travels as 16-bit words.
          STRATA_RETURN_IF_ERROR(dp_wait(
              dp_tracks[3], comms.dp_device->all_gather(ag_in, ag_out, c, half ? DType::kBF16 : DType::kF32),
              "gather parameters", u, P * c * w));
          homes_.from_elements(u, ag_out, unit_params);
        }
        return ok_status();
      });
}

Status DeviceOptimizer::update_device_units(double lr, std::int64_t step, float scale) {
  if (placement.sharding.split_state_sharded) return update_device_units_sharded(lr, step, scale);
  if (launch->is_cpu()) {
    struct P {
      OptimizerBuffers b;
      bool decay;
    };
    std::vector<P> params;
    for (const OwnedParam& o : owned) {
      if (!placement.split_device(o.unit)) continue;
      const OptimizerBuffers b = device_buffers(o);
      params.push_back(P{b, o.decay});
    }
    const CpuOptimizer* opt = &*device_opt;
    const OptimizerSettings os = config.optimizer;
    return launch->run("optimizer step (device modules)",
                       [params, opt, os, lr, step, scale](const kernels::KernelContext&) -> Status {
                         for (const P& p : params) {
                           STRATA_RETURN_IF_ERROR(opt->update(hyper_of(os, lr, p.decay), step, scale, p.b));
                         }
                         return ok_status();
                       });
  }
  std::vector<DeviceAdamTensor> group[2];  // [0]: no decay, [1]: decay
  for (const OwnedParam& o : owned) {
    if (!placement.split_device(o.unit)) continue;
    char* wp =
        homes_.resident + placement.units[static_cast<std::size_t>(o.unit)].resident_offset + o.param_in_unit;
    DeviceAdamTensor x;
    x.master = half ? reinterpret_cast<float*>(reinterpret_cast<char*>(dmaster) + o.grad_offset)
                    : reinterpret_cast<float*>(wp);
    x.param = half ? static_cast<void*>(wp) : static_cast<void*>(x.master);
    x.grad = reinterpret_cast<const float*>(reinterpret_cast<char*>(dgrads) + o.grad_offset);
    x.exp_avg = reinterpret_cast<float*>(reinterpret_cast<char*>(dm) + o.grad_offset);
    x.exp_avg_sq = reinterpret_cast<float*>(reinterpret_cast<char*>(dv) + o.grad_offset);
    x.n = o.n;
    group[o.decay ? 1 : 0].push_back(x);
  }
  void* cs = compute->native_handle();
  for (int decay = 0; decay < 2; ++decay) {
    if (group[decay].empty()) continue;
    STRATA_RETURN_IF_ERROR(fused_adam_cuda(group[decay], wdtype, DType::kF32,
                                           hyper_of(config.optimizer, lr, decay == 1), step, scale, cs));
  }
  return ok_status();
}

Status DeviceOptimizer::all_reduce_device_grads() {
  STRATA_RETURN_IF_ERROR(compute->synchronize());
  const std::size_t n = placement.sizes.grad_bytes / 4;
  return dp_wait(dp_tracks[0], comms.dp_caller->all_reduce(dgrads, dgrads, n, DType::kF32, ReduceOp::kSum),
                 "all-reduce gradients", -1, n * 4);
}

Status DeviceOptimizer::upload_dev_master(const OwnedParam& o, const float* values) {
  // The parameter's elements [a, a + n) of its unit, cut to this rank's [first, first + len).
  const std::uint64_t a = o.grad_in_unit / 4, first = dev_state_first(o.unit), len = dev_state_len(o.unit);
  const std::uint64_t lo = std::max<std::uint64_t>(a, first),
                      hi = std::min<std::uint64_t>(a + o.n, first + len);
  if (lo >= hi) return ok_status();
  return stager->upload(dev_state(o.unit, 1) + 4 * (lo - first), values + (lo - a), (hi - lo) * 4);
}

Status DeviceOptimizer::reduce_scatter_unit(int u, Comm& comm, int trace_track, float* rs_in, float* rs_out) {
  const std::size_t uu = static_cast<std::size_t>(u);
  const std::uint64_t n = placement.units[uu].grad_bytes / 4, c = placement.units[uu].slice.chunk;
  const std::uint64_t P = static_cast<std::uint64_t>(dp_size);
  const float* g = reinterpret_cast<const float*>(reinterpret_cast<const char*>(dgrads) + grad_begin(u));
  std::memcpy(rs_in, g, n * 4);
  std::fill(rs_in + n, rs_in + P * c, 0.0f);
  return dp_wait(trace_track, comm.reduce_scatter(rs_in, rs_out, c, DType::kF32, ReduceOp::kSum),
                 "reduce-scatter gradients", u, 4 * P * c);
}

}  // namespace strata::offload_detail
