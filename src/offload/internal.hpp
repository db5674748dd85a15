// Shared between the plan (plan.cpp) and the engine (engine.cpp): the per-module view of the
// descriptor table and the device regions a placement needs. Private to src/offload.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "strata/alloc.hpp"
#include "strata/engine.hpp"
#include "strata/model.hpp"
#include "strata/offload.hpp"
#include "nvme/faults.hpp"

namespace strata::offload_detail {

// A unit is one module's own storage: its parameters [param_begin, param_end) in the working
// dtype and gradients [grad_begin, grad_end) in fp32 (tied aliases read their owner's unit).
struct Units {
  std::vector<Tier> home;               // per module: where its working parameters live
  std::vector<std::uint64_t> pbytes;    // per module: working-parameter bytes
  std::vector<std::uint64_t> gbytes;    // per module: gradient bytes (fp32; n = gbytes / 4)
  std::vector<std::uint64_t> resident_offset;  // per module: offset in offload.params (resident)
  std::vector<std::vector<int>> storage;       // per module: the units it reads, itself first
  std::uint64_t resident_bytes = 0;
  std::uint64_t host_param_bytes = 0;  // host copy: units whose home is device or host (optimizer off-device)
  std::uint64_t nvme_param_bytes = 0;
  std::uint32_t param_slots = 0;
  std::uint64_t param_slot_bytes = 0;
  std::uint32_t grad_slots = 0;  // optimizer off the device: buckets for gradients in flight
  std::uint64_t grad_slot_bytes = 0;
  std::uint32_t ring_buffers = 0;  // NVMe optimizer pipeline
  std::uint64_t ring_buffer_bytes = 0;
  // NVMe optimizer: per module, the sub-group boundaries in elements of its fp32 layout
  // (0 = b0 < b1 < ... < bk = n); sub-group c is [b_c, b_c+1), swap key "optim.<u>" shard c.
  std::vector<std::vector<std::uint64_t>> sub_groups;
  std::uint64_t param_out_bytes = 0;  // NVMe optimizer: one updated-parameter staging buffer
  // Partial optimizer offload (optimizer_ratio < 1): the first device_opt_units of the units
  // this process holds, in module order (`device_opt`: per module, 1 for those), keep their
  // gradients and optimizer state on the device. Units are laid out in module order, so their
  // fp32 range is the prefix [0, device_opt_bytes) of the engine's fp32 arrays (grad_offset); the
  // host holds the rest. Without a pipeline they are modules [0, device_opt_units); with one, the
  // first of the stage's units (GPT-2's last stage: the tied embedding unit first, then its own).
  std::uint32_t device_opt_units = 0;
  std::uint64_t device_opt_bytes = 0;
  std::vector<char> device_opt;
  // Pipeline parallel: the units this stage holds (every unit without a pipeline); the others
  // have no bytes, no home beyond the device and no sub-groups. The engine's fp32 arrays
  // (device gradients and optimizer state, host gradients and optimizer state) hold only the
  // stage's units, unit u at grad_offset[u] (the layout's grad_begin without a pipeline).
  std::vector<char> in_stage;
  std::vector<std::uint64_t> grad_offset;
  std::uint64_t grad_bytes = 0;
  // Stage 3 in device memory (dp_device_param_sharded): per module, 1 when its home is the device
  // but offload.params holds only this rank's slice of its working parameters (DpSlices, in the
  // working dtype, laid out as the unit's fp32 elements: element e of the unit at (e - begin) * w).
  // Every rank reserves rank 0's chunk (the largest) at resident_offset; a sliced unit is
  // all-gathered into a param slot before use (param_slots, param_slot_bytes).
  std::vector<char> sliced;
};

// Stage 3 with the optimizer and the working parameters in device memory (docs/parallel.md
// "Stage 3 in device memory"): every module above stage3_param_persistence_threshold keeps only
// this rank's slice of its working parameters. With tensor parallelism the slices are of this
// tensor rank's shard (its own layout: every rank of one data-parallel group has the same tensor
// rank, so the same units and slices); with a pipeline of the stage's units (every rank of one
// data-parallel group is the same stage).
inline bool dp_device_param_sharded(const OffloadSettings& s) {
  return s.dp_size > 1 && s.optimizer == Tier::kDevice && s.params == Tier::kDevice && s.zero_stage == 3;
}

// Splits module m's fp32 range into sub-groups of at most `limit` elements (plus alignment
// padding between parameters). A parameter is split only at multiples of 64 of its own elements,
// so every SIMD lane sees the element it sees in an unsplit update: the same bits.
inline std::vector<std::uint64_t> sub_group_bounds(const ModelLayout& layout, std::size_t m, std::uint64_t limit) {
  const ModuleDesc& md = layout.modules[m];
  const std::uint64_t n_unit = (md.grad_end - md.grad_begin) / 4;
  std::vector<std::uint64_t> b{0};
  std::vector<std::pair<std::uint64_t, std::uint64_t>> params;  // (first element in the unit, count)
  for (int i : md.params) {
    const ParamDesc& p = layout.params[static_cast<std::size_t>(i)];
    if (!p.owns_storage()) continue;
    params.emplace_back((p.grad_offset - md.grad_begin) / 4, static_cast<std::uint64_t>(p.numel()));
  }
  std::sort(params.begin(), params.end());
  for (const auto& [a, n] : params) {
    std::uint64_t pos = 0;
    while (pos < n) {
      const std::uint64_t used = a + pos - b.back();
      const std::uint64_t room = used < limit ? limit - used : 0;
      if (room >= n - pos) break;
      pos += room / 64 * 64;
      if (a + pos > b.back()) b.push_back(a + pos);
      if (room < 64 && a + pos == b.back() && used == 0) pos += 64;  // limit < 64: never (validated)
    }
  }
  if (b.back() != n_unit) b.push_back(n_unit);
  return b;
}

inline std::vector<std::vector<int>> storage_of(const ModelLayout& layout) {
  std::vector<std::vector<int>> s(layout.modules.size());
  for (std::size_t m = 0; m < layout.modules.size(); ++m) {
    s[m].push_back(static_cast<int>(m));
    for (int i : layout.modules[m].params) {
      const ParamDesc& p = layout.params[static_cast<std::size_t>(i)];
      const int o = p.owns_storage() ? p.module : layout.params[static_cast<std::size_t>(p.tied_with)].module;
      if (std::find(s[m].begin(), s[m].end(), o) == s[m].end()) s[m].push_back(o);
    }
  }
  return s;
}

// Pipeline boundary exchange (engine.cpp run_pipeline): a receive is posted one op ahead of the
// op that reads it, so a stage holds two receive buffers per neighbour, used alternately.
inline constexpr int kPipelineRecvBuffers = 2;

// The module ranges stage `stage` runs, in chunk order: with `chunks` = v module chunks per stage
// (interleaved 1F1B) and bounds of v·p + 1 chunk bounds, chunks stage, stage + p, ...,
// stage + (v−1)p; with v = 1 the one range [bounds[stage], bounds[stage + 1]). The bounds are
// pipeline_stages' (checked there), so the ranges are non-empty and increasing.
inline std::vector<std::pair<int, int>> stage_ranges(const std::vector<int>& bounds, int chunks, int stage) {
  const int p = static_cast<int>(bounds.size() - 1) / chunks;
  std::vector<std::pair<int, int>> r;
  for (int c = 0; c < chunks; ++c) {
    const auto j = static_cast<std::size_t>(c * p + stage);
    r.emplace_back(bounds[j], bounds[j + 1]);
  }
  return r;
}

// Interleaved 1F1B moves groups of p micro-batches through the chunks: m must be a multiple of p
// (the error names the key, both values and what is expected; the engine and the plan use it).
inline Status check_interleaved_micro_batches(int chunks, int stages, std::int64_t micro_batches) {
  if (chunks <= 1 || micro_batches % stages == 0) return ok_status();
  return invalid_argument("strata.pipeline_virtual_stages = " + std::to_string(chunks) +
                          " with strata.pipeline_parallel_size = " + std::to_string(stages) +
                          ": gradient_accumulation_steps = " + std::to_string(micro_batches) +
                          " micro-batches is not a multiple of the " + std::to_string(stages) +
                          " stages (interleaving moves groups of one micro-batch per stage through the chunks)");
}

// The number of pipeline stages (processes) of the settings' bounds; 1 without a pipeline.
inline int pipeline_stage_count(const OffloadSettings& settings) {
  if (settings.pipeline_bounds.size() < 2) return 1;
  return static_cast<int>(settings.pipeline_bounds.size() - 1) / std::max(1, settings.pipeline_virtual_stages);
}

// The units stage `stage` of a pipeline with module bounds `bounds` (pipeline_stages; with
// `chunks` > 1 the chunk bounds, see stage_ranges) reads: its modules and what they read (GPT-2's
// last stage: the embedding, for the tied head). All units without a pipeline (bounds empty).
inline std::vector<char> stage_units(const ModelLayout& layout, const std::vector<int>& bounds, int stage,
                                     int chunks = 1) {
  const std::size_t M = layout.modules.size();
  if (bounds.size() < 2) return std::vector<char>(M, 1);
  std::vector<char> in(M, 0);
  const std::vector<std::vector<int>> st = storage_of(layout);
  for (const auto& [b, e] : stage_ranges(bounds, chunks, stage)) {
    for (int m = b; m < e; ++m) {
      for (int u : st[static_cast<std::size_t>(m)]) in[static_cast<std::size_t>(u)] = 1;
    }
  }
  return in;
}

// Data parallel: rank r's slice [begin, begin + len) of a unit of n fp32 elements, cut into
// `size` chunks of `chunk` elements (see DpSlices below).
struct DpSlice {
  std::uint64_t chunk = 0, begin = 0, len = 0;
};
inline DpSlice dp_slice_of(std::uint64_t n, int size, int rank) {
  const auto P = static_cast<std::uint64_t>(size);
  DpSlice d;
  d.chunk = align_up((n + P - 1) / P, 64);
  d.begin = std::min(n, static_cast<std::uint64_t>(rank) * d.chunk);
  d.len = std::min(d.chunk, n - d.begin);
  return d;
}

// `dp_rank`: with the optimizer state sharded over data-parallel ranks (dp_sharded below), the
// NVMe optimizer's sub-groups cover only this rank's slice of each unit.
inline Units describe_units(const ModelLayout& layout, const OffloadSettings& settings, int dp_rank = 0) {
  Units u;
  const std::size_t M = layout.modules.size();
  u.storage = storage_of(layout);
  u.home.resize(M);
  u.pbytes.resize(M);
  u.gbytes.resize(M);
  u.resident_offset.assign(M, 0);
  u.sliced.assign(M, 0);
  const bool slice_params = dp_device_param_sharded(settings);
  const std::uint64_t w = dtype_size(layout.config.dtype);
  u.in_stage = stage_units(layout, settings.pipeline_bounds, settings.pp_stage,
                           std::max(1, settings.pipeline_virtual_stages));
  u.grad_offset.assign(M, 0);
  const bool whole = settings.pipeline_bounds.size() < 2;
  u.grad_bytes = whole ? layout.grad_bytes : 0;
  // Partial optimizer offload: the largest prefix of the units this process holds (in module
  // order) whose elements fit in (1 - ratio) of their elements keeps its optimizer state on the
  // device (device_opt below; with a pipeline each stage splits its own units by this rule).
  // Their working parameters are resident whatever `params` says: the device's update writes
  // them in place, and they cost a fraction of the optimizer state the device holds for them
  // anyway (2 or 4 bytes per element beside 12 to 16).
  u.device_opt.assign(M, 0);
  std::size_t kdev = 0;
  if (settings.optimizer != Tier::kDevice && settings.optimizer_ratio < 1.0) {
    std::uint64_t total = 0, acc = 0;
    for (std::size_t m = 0; m < M; ++m) {
      if (u.in_stage[m]) total += (layout.modules[m].grad_end - layout.modules[m].grad_begin) / 4;
    }
    const double budget = (1.0 - settings.optimizer_ratio) * static_cast<double>(total);
    for (std::size_t m = 0; m < M; ++m) {
      if (!u.in_stage[m]) continue;
      const std::uint64_t e = (layout.modules[m].grad_end - layout.modules[m].grad_begin) / 4;
      if (static_cast<double>(acc + e) > budget) break;
      acc += e;
      u.device_opt[m] = 1;
      ++kdev;
    }
  }
  std::uint64_t max_grad = 0;
  for (std::size_t m = 0; m < M; ++m) {
    const ModuleDesc& md = layout.modules[m];
    if (!u.in_stage[m]) {
      u.home[m] = Tier::kDevice;  // nothing to place: pbytes = gbytes = 0
      continue;
    }
    u.pbytes[m] = md.param_end - md.param_begin;
    u.gbytes[m] = md.grad_end - md.grad_begin;
    if (whole) {
      u.grad_offset[m] = md.grad_begin;
    } else {
      u.grad_offset[m] = u.grad_bytes;
      u.grad_bytes += align_up(u.gbytes[m], kParamAlignment);
    }
    max_grad = std::max(max_grad, u.gbytes[m]);
    const auto elements = static_cast<std::int64_t>(u.gbytes[m] / 4);
    u.home[m] = elements <= settings.persistence_threshold || u.device_opt[m] ? Tier::kDevice : settings.params;
    if (u.home[m] == Tier::kDevice && slice_params && elements > settings.persistence_threshold) {
      // Stage 3 in device memory: this rank's slice at home, the whole unit only in a slot.
      u.sliced[m] = 1;
      u.resident_offset[m] = u.resident_bytes;
      const std::uint64_t chunk = dp_slice_of(u.gbytes[m] / 4, settings.dp_size, 0).chunk;
      u.resident_bytes += align_up(std::max<std::uint64_t>(w * chunk, 1), kParamAlignment);
      u.param_slot_bytes = std::max(u.param_slot_bytes, u.pbytes[m]);
    } else if (u.home[m] == Tier::kDevice) {
      u.resident_offset[m] = u.resident_bytes;
      u.resident_bytes += align_up(std::max<std::uint64_t>(u.pbytes[m], 1), kParamAlignment);
    } else {
      u.param_slot_bytes = std::max(u.param_slot_bytes, u.pbytes[m]);
    }
    if (u.home[m] == Tier::kNvme) u.nvme_param_bytes += u.pbytes[m];
    if (settings.optimizer != Tier::kDevice && u.home[m] != Tier::kNvme) u.host_param_bytes += u.pbytes[m];
  }
  if (u.param_slot_bytes > 0) {
    // The running module and each module of the look-ahead read at most `reads` units (2 with a
    // tied weight), plus one slot whose release trails the running module.
    std::size_t reads = 1;
    for (const auto& st : u.storage) reads = std::max(reads, st.size());
    u.param_slots = static_cast<std::uint32_t>(reads * static_cast<std::size_t>(1 + settings.prefetch_modules) + 1);
    u.param_slot_bytes = align_up(u.param_slot_bytes, 4096);
  }
  if (settings.optimizer != Tier::kDevice) {
    // Gradient buckets live from a unit's first backward touch to its last; count the most that
    // overlap during backward, plus one for the bucket whose copy to the host is in flight.
    std::uint32_t most = 0;
    for (std::size_t cur = 0; cur < M; ++cur) {
      std::uint32_t live = 0;
      for (std::size_t unit = 0; unit < M; ++unit) {
        int first = -1, last = static_cast<int>(M);
        for (std::size_t m = 0; m < M; ++m) {
          if (std::find(u.storage[m].begin(), u.storage[m].end(), static_cast<int>(unit)) != u.storage[m].end()) {
            first = std::max(first, static_cast<int>(m));
            last = std::min(last, static_cast<int>(m));
          }
        }
        if (first >= static_cast<int>(cur) && last <= static_cast<int>(cur)) ++live;
      }
      most = std::max(most, live);
    }
    u.grad_slots = most + 1;
    u.grad_slot_bytes = align_up(std::max<std::uint64_t>(max_grad, 4), 4096);
  }
  // The device units' fp32 range: the prefix of the layout up to the first unit held on the host.
  u.device_opt_units = static_cast<std::uint32_t>(kdev);
  u.device_opt_bytes = kdev == 0 ? 0 : u.grad_bytes;
  for (std::size_t m = 0; m < M && kdev > 0; ++m) {
    if (u.in_stage[m] && !u.device_opt[m]) {
      u.device_opt_bytes = u.grad_offset[m];
      break;
    }
  }
  if (settings.optimizer == Tier::kNvme) {
    u.ring_buffers = static_cast<std::uint32_t>(std::max(3, settings.nvme_buffer_count));
    std::uint64_t most = 0;
    u.sub_groups.resize(M);
    for (std::size_t m = 0; m < M; ++m) {
      if (settings.dp_size > 1) {
        // This rank's slice in pieces of sub_group_size elements (a multiple of 64 from the
        // slice's start, itself a multiple of 64: every parameter is split at multiples of 64).
        const DpSlice d = dp_slice_of(u.gbytes[m] / 4, settings.dp_size, dp_rank);
        const std::uint64_t step = std::max<std::uint64_t>(64, static_cast<std::uint64_t>(settings.sub_group_size) / 64 * 64);
        u.sub_groups[m] = {d.begin};
        for (std::uint64_t e = d.begin + step; e < d.begin + d.len; e += step) u.sub_groups[m].push_back(e);
        if (d.len > 0) u.sub_groups[m].push_back(d.begin + d.len);
      } else if (!u.in_stage[m]) {
        u.sub_groups[m] = {0};  // another stage's unit: no sub-groups
      } else {
        u.sub_groups[m] = sub_group_bounds(layout, m, static_cast<std::uint64_t>(settings.sub_group_size));
      }
      for (std::size_t c = 0; c + 1 < u.sub_groups[m].size(); ++c) {
        // [master | m | v], and the gradients when they wait on NVMe.
        const std::uint64_t per = settings.gradients == Tier::kNvme ? 16 : 12;
        most = std::max(most, per * (u.sub_groups[m][c + 1] - u.sub_groups[m][c]));
      }
      u.param_out_bytes = std::max(u.param_out_bytes, u.pbytes[m]);
    }
    u.ring_buffer_bytes = align_up(std::max<std::uint64_t>(most, 4096), 4096);
    u.param_out_bytes = align_up(std::max<std::uint64_t>(u.param_out_bytes, 1), 4096);
  }
  return u;
}

// Partial optimizer offload, for the plan's lines: the modules this process holds whose optimizer
// state is on the device (`device`) or on the host, as "modules a..b" runs in module order
// ("modules 0..1" without a pipeline; "modules 0, 4..5" on GPT-2's last stage, the tied
// embedding unit first).
inline std::string split_modules(const Units& u, bool device) {
  std::string out;
  const std::size_t M = u.device_opt.size();
  for (std::size_t m = 0; m < M;) {
    const auto taken = [&](std::size_t k) { return u.in_stage[k] && (u.device_opt[k] != 0) == device; };
    if (!taken(m)) {
      ++m;
      continue;
    }
    std::size_t e = m;
    while (e + 1 < M && taken(e + 1)) ++e;
    out += (out.empty() ? "" : ", ") + std::to_string(m) + ".." + std::to_string(e);
    m = e + 1;
  }
  return out.empty() ? "no modules" : "modules " + out;
}

// Stages 1-3 with the optimizer on the device and more than one data-parallel rank
// (docs/parallel.md "ZeRO stages 1-3 in device memory"): the fp32 master (16-bit working
// weights) and the Adam moments hold only this rank's slices (DpSlices) in device memory.
inline bool dp_device_sharded(const OffloadSettings& s) {
  return s.dp_size > 1 && s.optimizer == Tier::kDevice && s.zero_stage >= 1;
}

// Device bytes of each optimizer-state region (optim.master, optim.exp_avg, optim.exp_avg_sq)
// with the optimizer on the device: the fp32 layout of every unit, or, sharded, rank 0's slices
// (the largest: every rank carves this size, so the plan is every rank's).
inline std::uint64_t device_state_bytes(const Units& u, const OffloadSettings& settings);

// The data-parallel staging of the sharded device optimizer, in device memory: the reduce-scatter's
// input (size x chunk fp32) and output (chunk; stage 1 only: stages 2-3 reduce in their gradient
// buckets), the parameter all-gather's input (chunk) and output (size x chunk) in the working dtype
// (`w` bytes), for the largest chunk.
inline std::uint64_t device_dp_staging_bytes(const Units& u, const OffloadSettings& settings,
                                             std::uint64_t w);

// Partial optimizer offload with the host optimizer state sharded over data-parallel ranks
// (docs/offload.md "Partial optimizer offload", "Data parallel"): the device units' master and
// moments are this rank's slices too (DpSlices below), reduced and gathered on the compute stream.
inline bool dp_partial_sharded(const Units& u, const OffloadSettings& s) {
  return s.dp_size > 1 && s.optimizer != Tier::kDevice && u.device_opt_units > 0;
}

// Its bytes per state region (optim.master, optim.exp_avg, optim.exp_avg_sq, and stage 2's
// offload.grad_slices): rank 0's slices of the device units (the largest; DpSlices::dev_elements).
inline std::uint64_t partial_dp_state_bytes(const Units& u, const OffloadSettings& s) {
  std::uint64_t n = 0;
  for (std::size_t m = 0; m < u.device_opt.size(); ++m)
    if (u.device_opt[m]) n += dp_slice_of(u.gbytes[m] / 4, s.dp_size, 0).len;
  return std::max<std::uint64_t>(4 * n, kParamAlignment);
}

// Its device staging (offload.dp_staging), for the largest device unit's chunk c: the
// reduce-scatter's send (size x c fp32) and receive (c fp32), the all-gather's send (c working
// words) and receive (size x c working words).
inline std::uint64_t partial_dp_staging_bytes(const Units& u, const OffloadSettings& s, std::uint64_t w) {
  const std::uint64_t P = static_cast<std::uint64_t>(s.dp_size);
  std::uint64_t c = 0;  // DpSlices::dev_max_chunk
  for (std::size_t m = 0; m < u.device_opt.size(); ++m)
    if (u.device_opt[m]) c = std::max(c, dp_slice_of(u.gbytes[m] / 4, s.dp_size, 0).chunk);
  return std::max<std::uint64_t>((4 + w) * (P + 1) * c, kParamAlignment);
}

// Stage >= 2 with the optimizer on the device and more than one rank: the gradients are
// reduce-scattered per bucket during backward and each rank keeps only its slices of them
// (offload.grads holds this rank's shard; the full-size gradients exist only in the bucket
// buffers offload.grad_buckets). docs/parallel.md "Gradient buckets". With tensor parallelism the
// buckets are computed from this tensor rank's shard layout, the same on every rank of its
// data-parallel group. With a pipeline from the stage's modules, cut per chunk: a schedule's
// backward op runs one micro-batch through one chunk's modules without a break, so every bucket
// opens and closes inside one op (docs/parallel.md "Stages 2-3 in device memory with a pipeline").
inline bool dp_device_grad_sharded(const OffloadSettings& s) {
  return dp_device_sharded(s) && s.zero_stage >= 2;
}

// The gradient buckets of data parallel with the optimizer on the device. Units are taken in the
// order backward finishes them (their last backward module, latest first; ties by unit, highest
// first) and grouped while the bucket stays within reduce_bucket_elements and the units stay
// adjacent (unit u after u + 1: a bucket is one contiguous range of the fp32 layout, which stage
// 0 all-reduces in place). A unit is never split. Every rank computes the same buckets from the
// layout, so every rank launches the same collectives in the same order.
// With a pipeline only the modules this stage runs count as touching a unit (GPT-2's last
// stage: the head alone reads the tied embedding), and a bucket holds the units of one chunk only
// (interleaved 1F1B: chunk c's backward ops alternate with other chunks'; a unit is read by one
// chunk of its stage), so every bucket opens and closes inside one backward op of the schedule. The units of
// a bucket stay adjacent in the stage's compact fp32 layout (Units::grad_offset: only another stage's units,
// which have no bytes there, may lie between them), so stage 0 still all-reduces one contiguous range in
// place.
struct GradBuckets {
  std::vector<std::vector<int>> units;        // per bucket, in backward-finish order
  std::vector<int> bucket_of;                 // per unit (-1: no gradients)
  std::vector<int> open_at, close_after;      // per bucket: first backward module touching it, last
  std::vector<std::uint64_t> bytes;           // per bucket: its buffer (stage >= 2): units padded to
                                              // size x chunk elements, 256-aligned
  std::vector<std::uint64_t> offset;          // per unit: its gradients' offset in its bucket's buffer
  std::vector<std::uint64_t> rs_chunk;        // per bucket: elements each rank receives (sum of chunks)
  std::vector<std::uint64_t> rs_at;           // per unit: its chunk's offset in a rank's part
  std::uint32_t live = 0;                     // the most buckets open at once during backward
  std::uint64_t max_bytes = 0, max_rs_chunk = 0;
};

// Stage 0 buckets on the cpu backend (the engine's condition adds the stage and the device),
// with or without a pipeline.
inline bool dp_device_bucketed(const OffloadSettings& s) {
  return s.dp_size > 1 && s.optimizer == Tier::kDevice;
}

// Stage 0 with the optimizer on the device all-reduces per gradient bucket, each when backward
// leaves the bucket's last module on the last micro-batch, on the cpu backend; cuda keeps one
// all-reduce of the whole gradient after backward (a stream's host function may not call NCCL).
inline bool dp_stage0_bucketed(const OffloadSettings& s, bool cuda) {
  return !cuda && dp_device_bucketed(s) && s.zero_stage == 0;
}

inline GradBuckets grad_buckets(const Units& u, const OffloadSettings& settings) {
  GradBuckets g;
  const int M = static_cast<int>(u.gbytes.size());
  std::vector<int> first(static_cast<std::size_t>(M), -1), last(static_cast<std::size_t>(M), M);
  // Per module: the chunk of this stage that runs it (-1: another stage's); 0 for every module
  // without a pipeline.
  std::vector<int> chunk_of(static_cast<std::size_t>(M), settings.pipeline_bounds.size() < 2 ? 0 : -1);
  if (settings.pipeline_bounds.size() >= 2) {
    const auto ranges = stage_ranges(settings.pipeline_bounds, std::max(1, settings.pipeline_virtual_stages),
                                     settings.pp_stage);
    for (std::size_t c = 0; c < ranges.size(); ++c)
      for (int m = ranges[c].first; m < ranges[c].second; ++m)
        chunk_of[static_cast<std::size_t>(m)] = static_cast<int>(c);
  }
  std::vector<int> unit_chunk(static_cast<std::size_t>(M), -1);
  for (int m = 0; m < M; ++m) {
    if (chunk_of[static_cast<std::size_t>(m)] < 0) continue;
    for (int x : u.storage[static_cast<std::size_t>(m)]) {
      first[static_cast<std::size_t>(x)] = std::max(first[static_cast<std::size_t>(x)], m);
      last[static_cast<std::size_t>(x)] = std::min(last[static_cast<std::size_t>(x)], m);
      unit_chunk[static_cast<std::size_t>(x)] = chunk_of[static_cast<std::size_t>(m)];
    }
  }
  std::vector<int> order;
  for (int x = 0; x < M; ++x)
    if (u.gbytes[static_cast<std::size_t>(x)] > 0 && first[static_cast<std::size_t>(x)] >= 0) order.push_back(x);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    const int la = last[static_cast<std::size_t>(a)], lb = last[static_cast<std::size_t>(b)];
    return la != lb ? la > lb : a > b;
  });
  g.bucket_of.assign(static_cast<std::size_t>(M), -1);
  g.offset.assign(static_cast<std::size_t>(M), 0);
  g.rs_at.assign(static_cast<std::size_t>(M), 0);
  const std::uint64_t cap = 4 * static_cast<std::uint64_t>(std::max<std::int64_t>(settings.reduce_bucket_elements, 1));
  const int P = std::max(settings.dp_size, 1);
  std::uint64_t held = 0;  // bytes of the bucket being filled
  for (int x : order) {
    const std::size_t xx = static_cast<std::size_t>(x);
    // Below the bucket's last unit with no unit with gradients between them (another stage's
    // units have none), and the same chunk. (A pipeline's last stage of GPT-2 finishes the tied
    // embedding, unit 0, with the head, before the blocks below the head: it starts a bucket.)
    bool adjacent = !g.units.empty() && x < g.units.back().back() &&
                    unit_chunk[static_cast<std::size_t>(g.units.back().back())] == unit_chunk[xx];
    for (int y = x + 1; adjacent && y < g.units.back().back(); ++y) adjacent = u.gbytes[static_cast<std::size_t>(y)] == 0;
    const bool start = !adjacent || held + u.gbytes[xx] > cap;
    if (start) {
      g.units.emplace_back();
      g.open_at.push_back(-1);
      g.close_after.push_back(M);
      g.bytes.push_back(0);
      g.rs_chunk.push_back(0);
      held = 0;
    }
    const std::size_t b = g.units.size() - 1;
    g.units[b].push_back(x);
    g.bucket_of[xx] = static_cast<int>(b);
    g.open_at[b] = std::max(g.open_at[b], first[xx]);
    g.close_after[b] = std::min(g.close_after[b], last[xx]);
    const std::uint64_t c = dp_slice_of(u.gbytes[xx] / 4, P, 0).chunk;
    g.offset[xx] = g.bytes[b];
    g.bytes[b] += align_up(4 * static_cast<std::uint64_t>(P) * c, kParamAlignment);  // padded to P chunks
    g.rs_at[xx] = g.rs_chunk[b];
    g.rs_chunk[b] += c;
    held += u.gbytes[xx];
    g.max_bytes = std::max(g.max_bytes, g.bytes[b]);
    g.max_rs_chunk = std::max(g.max_rs_chunk, g.rs_chunk[b]);
  }
  // Backward runs modules M-1 .. 0 (a pipeline stage: each chunk's, one op at a time): bucket b
  // is open from open_at (its buffer zeroed) through close_after (its collective launched after
  // that module's backward). A pipeline's buckets lie inside one chunk's modules, so the count
  // per module is the count inside its op.
  for (int cur = M - 1; cur >= 0; --cur) {
    std::uint32_t open = 0;
    for (std::size_t b = 0; b < g.units.size(); ++b)
      if (g.open_at[b] >= cur && g.close_after[b] <= cur) ++open;
    g.live = std::max(g.live, open);
  }
  return g;
}

// Stage >= 2 (dp_device_grad_sharded): the bucket buffers, each a bucket's units laid out padded to
// size x chunk elements (each unit is reduce-scattered in place from there) followed by the
// receive buffer of this rank's chunks (rs_chunk); the most buckets open at once, plus one whose
// reduce-scatter is in flight with overlap_comm.
inline std::uint32_t grad_bucket_slots(const GradBuckets& g, const OffloadSettings& s) {
  return std::max<std::uint32_t>(g.live, 1) + (s.overlap_comm ? 1 : 0);
}
inline std::uint64_t grad_bucket_recv_offset(const GradBuckets& g) {
  return align_up(std::max<std::uint64_t>(g.max_bytes, 4), kParamAlignment);
}
inline std::uint64_t grad_bucket_slot_bytes(const GradBuckets& g) {
  return grad_bucket_recv_offset(g) + align_up(std::max<std::uint64_t>(4 * g.max_rs_chunk, 4), kParamAlignment);
}

inline std::vector<RegionSpec> device_regions(const ModelLayout& layout, const Units& u,
                                              const OffloadSettings& settings) {
  std::vector<RegionSpec> r;
  r.push_back(RegionSpec{"offload.params", std::max<std::uint64_t>(u.resident_bytes, kParamAlignment), 0, 0});
  if (u.param_slots > 0) r.push_back(RegionSpec{"offload.param_slots", 0, u.param_slot_bytes, u.param_slots});
  const std::uint64_t gb = std::max<std::uint64_t>(u.grad_bytes, kParamAlignment);
  if (settings.optimizer == Tier::kDevice) {
    const std::uint64_t sb = device_state_bytes(u, settings);
    if (dp_device_grad_sharded(settings)) {
      // This rank's reduced slices (rank 0's, the largest), and the buckets backward writes into.
      const GradBuckets g = grad_buckets(u, settings);
      r.push_back(RegionSpec{"offload.grads", sb, 0, 0});
      r.push_back(RegionSpec{"offload.grad_buckets", 0, grad_bucket_slot_bytes(g), grad_bucket_slots(g, settings)});
    } else {
      r.push_back(RegionSpec{"offload.grads", gb, 0, 0});
    }
    if (layout.config.dtype != DType::kF32) r.push_back(RegionSpec{"optim.master", sb, 0, 0});
    r.push_back(RegionSpec{"optim.exp_avg", sb, 0, 0});
    r.push_back(RegionSpec{"optim.exp_avg_sq", sb, 0, 0});
    if (dp_device_sharded(settings)) {
      r.push_back(RegionSpec{"offload.dp_staging",
                             device_dp_staging_bytes(u, settings, dtype_size(layout.config.dtype)), 0, 0});
    }
  } else {
    r.push_back(RegionSpec{"offload.grad_slots", 0, u.grad_slot_bytes, u.grad_slots});
    if (u.device_opt_units > 0) {
      // Partial optimizer offload: the first modules' gradients (whole), in the fp32 layout, and
      // their state: whole, or with several data-parallel ranks this rank's slices (rank 0's, the
      // largest) beside the staging of their collectives and, stage 2, the reduced slices.
      const std::uint64_t db = std::max<std::uint64_t>(u.device_opt_bytes, kParamAlignment);
      const bool dp = dp_partial_sharded(u, settings);
      const std::uint64_t sb = dp ? partial_dp_state_bytes(u, settings) : db;
      r.push_back(RegionSpec{"offload.grads", db, 0, 0});
      if (dp && settings.zero_stage >= 2) r.push_back(RegionSpec{"offload.grad_slices", sb, 0, 0});
      if (layout.config.dtype != DType::kF32) r.push_back(RegionSpec{"optim.master", sb, 0, 0});
      r.push_back(RegionSpec{"optim.exp_avg", sb, 0, 0});
      r.push_back(RegionSpec{"optim.exp_avg_sq", sb, 0, 0});
      if (dp) {
        r.push_back(RegionSpec{"offload.dp_staging",
                               partial_dp_staging_bytes(u, settings, dtype_size(layout.config.dtype)), 0, 0});
      }
    }
  }
  return r;
}

// Data parallel with the optimizer off the device (docs/parallel.md): every unit's fp32 range of
// n elements is cut into `size` chunks of `chunk` elements, chunk = ceil(n / size) rounded up to a
// multiple of 64 (parameters start at multiples of 64 elements of their unit, kParamAlignment, so
// each parameter is split at multiples of 64 of its own elements and the update is the same bits
// as unsplit). Rank r owns elements [r * chunk, min((r + 1) * chunk, n)) of every unit: its
// gradients come from a reduce-scatter, its optimizer state lives only there, and its updated
// parameters reach the other ranks by an all-gather. A rank's slices are packed back to back
// (`offset`) in its shard of master, moments and gradients.
//
// Partial optimizer offload (Units::device_opt_units = k > 0): the device units [0, k) and the
// host units [k, M) are packed apart. offset[u] of a device unit is its slice's place in the
// device regions optim.* (and offload.grad_slices), of a host unit its place in the host arrays
// (restarted at unit k); shard_elements and max_chunk count the host units only, dev_elements and
// dev_max_chunk the device units.
struct DpSlices {
  int size = 1;
  int rank = 0;
  std::vector<std::uint64_t> chunk, begin, len, offset;  // per unit, in elements
  std::uint64_t shard_elements = 0;                      // this rank's slices, host units (all units at k = 0)
  std::uint64_t max_chunk = 0;
  std::uint64_t dev_elements = 0;   // partial offload: this rank's slices of the device units
  std::uint64_t dev_max_chunk = 0;  // partial offload: the largest chunk of a device unit
};

inline DpSlices dp_slices(const Units& u, int size, int rank) {
  DpSlices d;
  d.size = size;
  d.rank = rank;
  for (std::size_t m = 0; m < u.gbytes.size(); ++m) {
    const DpSlice s = dp_slice_of(u.gbytes[m] / 4, size, rank);
    d.chunk.push_back(s.chunk);
    d.begin.push_back(s.begin);
    d.len.push_back(s.len);
    if (m < u.device_opt.size() && u.device_opt[m]) {
      d.offset.push_back(d.dev_elements);
      d.dev_elements += s.len;
      d.dev_max_chunk = std::max(d.dev_max_chunk, s.chunk);
      continue;
    }
    d.offset.push_back(d.shard_elements);
    d.shard_elements += s.len;
    d.max_chunk = std::max(d.max_chunk, s.chunk);
  }
  return d;
}


// Whether the engine shards the host tiers' optimizer state over data-parallel ranks (stages 1-3
// with the optimizer on the host or NVMe). With the optimizer on the device, stage 0 replicates
// and stages 1-3 shard it in device memory (dp_device_sharded).
inline bool dp_sharded(const OffloadSettings& s) { return s.dp_size > 1 && s.optimizer != Tier::kDevice; }

inline std::uint64_t device_state_bytes(const Units& u, const OffloadSettings& settings) {
  const std::uint64_t bytes =
      dp_device_sharded(settings) ? 4 * dp_slices(u, settings.dp_size, 0).shard_elements : u.grad_bytes;
  return std::max<std::uint64_t>(bytes, kParamAlignment);
}

inline std::uint64_t device_dp_staging_bytes(const Units& u, const OffloadSettings& settings,
                                             std::uint64_t w) {
  const std::uint64_t P = static_cast<std::uint64_t>(settings.dp_size);
  const std::uint64_t c = dp_slices(u, settings.dp_size, 0).max_chunk;
  // Stage >= 2 reduces in its gradient buckets: only the all-gather's part.
  const std::uint64_t per = dp_device_grad_sharded(settings) ? w : 4 + w;
  return std::max<std::uint64_t>(per * (P + 1) * c, kParamAlignment);
}

// Device bytes of the model's activations, activation gradients and io buffers (model.cpp's
// carving, per token, with alignment slack). The cuda backend's kernel workspace comes on top
// (kCudaWorkspaceBytes, added by OffloadPlan::check_fits). With activation offload the residual
// stream is not counted here: the plan's activation-offload lines hold its ring.
inline std::uint64_t activation_bytes_estimate(const TrainerConfig& config,
                                               bool offload_activations = false) {
  const ModelConfig& c = config.model;
  const std::int64_t N = config.micro_batch * config.seq_len;
  const std::int64_t C = c.n_embd, F = c.ffn(), Q = (c.n_head + 2 * c.kv_heads()) * c.head_dim();
  const std::int64_t per_set = 4 * C + Q + (c.kind == ModelKind::kGpt2 ? 2 * F : 3 * F);
  const std::int64_t sets = c.activation_checkpointing ? 1 : c.n_layer;
  const std::uint64_t w = dtype_size(c.dtype);
  std::uint64_t acts = static_cast<std::uint64_t>(N) *
                       (w * static_cast<std::uint64_t>((offload_activations ? 0 : (c.n_layer + 1) * C) +
                                                       sets * per_set + C + c.padded_vocab()) +
                        4 * static_cast<std::uint64_t>(sets * (4 + c.n_head) + 4));
  acts += static_cast<std::uint64_t>(N) * w * static_cast<std::uint64_t>(3 * C + Q + 3 * F);
  acts += static_cast<std::uint64_t>(N) * 8 + static_cast<std::uint64_t>(c.n_positions * c.head_dim()) * 4;
  return acts + acts / 16 + (1u << 20);
}

// The part of activation_bytes_estimate one activation slot holds for modules [b, e) of the
// model (Model::carve_activations, per token): the residuals the range reads and writes, its
// blocks' sets (one shared set with checkpointing), the head's buffers where the range ends with
// the head, and the batch, losses and statistics; with the same 1/16 slack. [0, M) is every
// module's: a slot of plain 1F1B or GPipe (bounded above by the whole model's set).
inline std::uint64_t activation_slot_estimate(const TrainerConfig& config, int b, int e,
                                              bool offload_activations = false) {
  const ModelConfig& c = config.model;
  const std::int64_t L = c.n_layer, M = L + 2;
  const std::int64_t N = config.micro_batch * config.seq_len;
  const std::int64_t C = c.n_embd, F = c.ffn(), Q = (c.n_head + 2 * c.kv_heads()) * c.head_dim();
  const std::int64_t per_set = 4 * C + Q + (c.kind == ModelKind::kGpt2 ? 2 * F : 3 * F);
  const std::int64_t resid = std::min<std::int64_t>(e - 1, L) - std::max(b - 1, 0) + 1;
  const std::int64_t blocks = std::min<std::int64_t>(e, L + 1) - std::max(b, 1);
  const std::int64_t sets = c.activation_checkpointing ? 1 : std::max<std::int64_t>(blocks, 0);
  const std::int64_t head = e == M ? C + c.padded_vocab() : 0;
  const std::uint64_t w = dtype_size(c.dtype);
  const std::uint64_t acts =
      static_cast<std::uint64_t>(N) *
      (w * static_cast<std::uint64_t>((offload_activations ? 0 : resid * C) + sets * per_set + head) +
       4 * static_cast<std::uint64_t>(sets * (4 + c.n_head) + 4));
  return acts + acts / 16;
}

inline constexpr std::uint64_t kCudaWorkspaceBytes = 64ull << 20;

// Swap space: every key once; room for the versions being rewritten (a write goes to fresh
// extents and frees the old ones only once published): at most the NVMe optimizer ring, the two
// staging buffers of updated parameters, one unit of gradients and one of host-optimizer
// parameters in flight at a time; and per key, rounding to the allocation granule.
inline std::uint64_t swap_capacity(const OffloadPlan& plan, const Units& u, const OffloadSettings& settings) {
  if (plan.nvme_bytes == 0) return 0;
  std::uint64_t keys = 0;
  for (std::size_t m = 0; m < u.home.size(); ++m) {
    if (u.home[m] == Tier::kNvme) keys += settings.delayed_update ? 2 : 1;  // delayed: two versions
    if (!u.sub_groups.empty()) {
      const std::uint64_t shards = u.sub_groups[m].size() - 1;
      keys += shards * (settings.gradients == Tier::kNvme ? 2 : 1);
    }
  }
  const std::uint64_t granule = align_up(std::max<std::uint64_t>(settings.io.block_size, 4096), 64u << 10);
  const std::uint64_t in_flight = static_cast<std::uint64_t>(u.ring_buffers) * u.ring_buffer_bytes +
                                  2 * u.param_out_bytes + u.grad_slot_bytes + u.param_slot_bytes;
  return align_up(plan.nvme_bytes + 2 * in_flight + keys * granule + (64u << 20), 1u << 20);
}

// Tests only: an engine whose I/O engine injects `faults` (src/nvme/faults.hpp), which must
// outlive it.
struct EngineFaults {
  // `pipeline`, `data_parallel`, `tensor_parallel`: as OffloadEngine::create's (a rank of a group
  // whose disk fails).
  static Result<std::unique_ptr<OffloadEngine>> create(const TrainerConfig& config,
                                                       const OffloadSettings& settings, Device& device,
                                                       const nvme_detail::IoFaults* faults,
                                                       Comm* pipeline = nullptr,
                                                       Comm* data_parallel = nullptr,
                                                       Comm* tensor_parallel = nullptr);
  // Tests only: parameter `index`'s working copy set to `values`, its fp32 master left as it is
  // (the delayed update's reference: gradients taken at other parameters than the ones updated).
  static Status set_working_param(OffloadEngine& engine, int index, std::span<const float> values);
  // Tests only: every device-to-host copy of the engine's state (parameters, master, moments read
  // for get_param, the state getters, save_weights, checkpoints) returns `fault` until it is
  // cleared with ok_status(), as a failing device copy would. Caller thread, between calls.
  static void fail_state_downloads(OffloadEngine& engine, Status fault);
  // Tests only: the next step() (host optimizer) fails with `fault` once its passes ran through
  // and its streams are idle, as a stream error its call sees then (a local failure before the
  // norm, after every collective of the pass). Once. Caller thread, between calls.
  static void fail_next_pass(OffloadEngine& engine, Status fault);
  // Tests only: the compute stream fails with `fault` at the next access of module `module` (the
  // next forward's), so the rest of the pass's compute work, collectives included, is skipped:
  // a failure that stops this rank's pass before its peers' next collective. Once.
  static void fail_compute_at(OffloadEngine& engine, int module, Status fault);
  // Tests only: the optimizer thread's next update of module `held_module`'s (first) unit waits,
  // before it starts, until the compute stream has run the forward of module `forward_module` in
  // the pass that reads that update; after 30 s the update fails with an error naming both.
  // Once. Caller thread, between calls. Says whether a pass enqueues a module's work while a
  // later unit's update is still running (docs/offload.md "One step").
  static void hold_update_until_forward(OffloadEngine& engine, int held_module, int forward_module);
  // Tests only: the caller's next access of module `module` (the next forward's) returns `fault`,
  // as a caller-side error inside the pass (a pipeline's schedule). Once.
  static void fail_caller_at(OffloadEngine& engine, int module, Status fault);
  // Tests and bench/weights_save.cpp only: while `on`, save_weights without a pipeline takes the
  // earlier path (the first rank gathers every parameter and writes alone), the reference that
  // every rank writing its part must equal byte for byte. Caller thread, between calls.
  static void gather_weights_on_save(OffloadEngine& engine, bool on);
  // This rank does not see the weights file the first rank creates (a rank on another node
  // without a shared file system): save_weights takes the gather path, or fails with a pipeline.
  static void hide_weights_file(OffloadEngine& engine, bool on);
  // Tests only: a rank dying in the middle of a parallel save. While `writes` is non-zero, this
  // rank raises SIGKILL in save_weights (every rank writing its part) right after its `writes`-th
  // range write into the temporary file: after the header was written (the writer's, before any
  // rank writes) and some of this rank's ranges were. 0 turns it off. Caller thread, between calls.
  static void kill_during_save(OffloadEngine& engine, std::uint64_t writes);
};

}  // namespace strata::offload_detail
