// The Placement (placement.hpp): arithmetic on the descriptor table, in the order the engine
// lays its buffers out.
#include "partition/placement.hpp"

#include <algorithm>

#include "strata/alloc.hpp"

namespace strata::partition {

DpSlice dp_slice_of(std::uint64_t n, int size, int rank) {
  const auto P = static_cast<std::uint64_t>(size);
  DpSlice d;
  d.chunk = align_up((n + P - 1) / P, 64);
  d.begin = std::min(n, static_cast<std::uint64_t>(rank) * d.chunk);
  d.len = std::min(d.chunk, n - d.begin);
  return d;
}

std::vector<std::pair<int, int>> stage_ranges(const std::vector<int>& bounds, int chunks, int stage) {
  const int p = static_cast<int>(bounds.size() - 1) / chunks;
  std::vector<std::pair<int, int>> r;
  for (int c = 0; c < chunks; ++c) {
    const auto j = static_cast<std::size_t>(c * p + stage);
    r.emplace_back(bounds[j], bounds[j + 1]);
  }
  return r;
}

int pipeline_stage_count(const OffloadSettings& settings) {
  if (settings.pipeline_bounds.size() < 2) return 1;
  return static_cast<int>(settings.pipeline_bounds.size() - 1) /
         std::max(1, settings.pipeline_virtual_stages);
}

std::vector<std::vector<int>> reads_of(const ModelLayout& layout) {
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

std::vector<char> stage_units(const ModelLayout& layout, const std::vector<int>& bounds, int stage,
                              int chunks) {
  const std::size_t M = layout.modules.size();
  if (bounds.size() < 2) return std::vector<char>(M, 1);
  std::vector<char> in(M, 0);
  const std::vector<std::vector<int>> st = reads_of(layout);
  for (const auto& [b, e] : stage_ranges(bounds, chunks, stage)) {
    for (int m = b; m < e; ++m) {
      for (int u : st[static_cast<std::size_t>(m)]) in[static_cast<std::size_t>(u)] = 1;
    }
  }
  return in;
}

std::vector<std::uint64_t> sub_group_bounds(const ModelLayout& layout, std::size_t m, std::uint64_t limit) {
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

Status check_interleaved_micro_batches(int chunks, int stages, std::int64_t micro_batches) {
  if (chunks <= 1 || micro_batches % stages == 0) return ok_status();
  return invalid_argument(
      "strata.pipeline_virtual_stages = " + std::to_string(chunks) +
      " with strata.pipeline_parallel_size = " + std::to_string(stages) + ": gradient_accumulation_steps = " +
      std::to_string(micro_batches) + " micro-batches is not a multiple of the " + std::to_string(stages) +
      " stages (interleaving moves groups of one micro-batch per stage through the chunks)");
}

std::uint32_t GradBuckets::slots(const OffloadSettings& s) const {
  return std::max<std::uint32_t>(live, 1) + (s.overlap_comm ? 1 : 0);
}
std::uint64_t GradBuckets::recv_offset() const {
  return align_up(std::max<std::uint64_t>(max_bytes, 4), kParamAlignment);
}
std::uint64_t GradBuckets::slot_bytes() const {
  return recv_offset() + align_up(std::max<std::uint64_t>(4 * max_rs_chunk, 4), kParamAlignment);
}

GradBuckets cut_grad_buckets(const Placement& p, const OffloadSettings& settings,
                             std::vector<BucketSeat>* seats) {
  GradBuckets g;
  const int M = p.size();
  // The touches and chunks of this stage's modules (every module's without a pipeline).
  std::vector<int> order;
  for (int x = 0; x < M; ++x)
    if (p.unit(x).grad_bytes > 0 && p.unit(x).first_touch >= 0) order.push_back(x);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    const int la = p.unit(a).last_touch, lb = p.unit(b).last_touch;
    return la != lb ? la > lb : a > b;
  });
  if (seats != nullptr) seats->assign(static_cast<std::size_t>(M), BucketSeat{});
  const std::uint64_t cap =
      4 * static_cast<std::uint64_t>(std::max<std::int64_t>(settings.reduce_bucket_elements, 1));
  const int P = std::max(settings.dp_size, 1);
  std::uint64_t held = 0;  // bytes of the bucket being filled
  for (int x : order) {
    const UnitPlacement& ux = p.unit(x);
    // Below the bucket's last unit with no unit with gradients between them (another stage's
    // units have none), and the same chunk. (A pipeline's last stage of GPT-2 finishes the tied
    // embedding, unit 0, with the head, before the blocks below the head: it starts a bucket.)
    const int back = g.buckets.empty() ? -1 : g.buckets.back().units.back();
    bool adjacent = back >= 0 && x < back && p.unit(back).chunk == ux.chunk;
    for (int y = x + 1; adjacent && y < back; ++y) adjacent = p.unit(y).grad_bytes == 0;
    if (!adjacent || held + ux.grad_bytes > cap) {
      GradBucket b;
      b.close_after = M;
      g.buckets.push_back(std::move(b));
      held = 0;
    }
    GradBucket& b = g.buckets.back();
    b.units.push_back(x);
    b.open_at = std::max(b.open_at, ux.first_touch);
    b.close_after = std::min(b.close_after, ux.last_touch);
    const std::uint64_t c = dp_slice_of(ux.elements(), P, 0).chunk;
    if (seats != nullptr) {
      (*seats)[static_cast<std::size_t>(x)] =
          BucketSeat{static_cast<int>(g.buckets.size() - 1), b.bytes, b.rs_chunk};
    }
    b.bytes += align_up(4 * static_cast<std::uint64_t>(P) * c, kParamAlignment);  // padded to P chunks
    b.rs_chunk += c;
    held += ux.grad_bytes;
    g.max_bytes = std::max(g.max_bytes, b.bytes);
    g.max_rs_chunk = std::max(g.max_rs_chunk, b.rs_chunk);
  }
  // Backward runs modules M-1 .. 0 (a pipeline stage: each chunk's, one op at a time): bucket b
  // is open from open_at (its buffer zeroed) through close_after (its collective launched after
  // that module's backward). A pipeline's buckets lie inside one chunk's modules, so the count
  // per module is the count inside its op.
  for (int cur = M - 1; cur >= 0; --cur) {
    std::uint32_t open = 0;
    for (const GradBucket& b : g.buckets)
      if (b.open_at >= cur && b.close_after <= cur) ++open;
    g.live = std::max(g.live, open);
  }
  return g;
}

namespace {

// Partial optimizer offload: the largest prefix of the units this process holds (in module
// order) whose elements fit in (1 - ratio) of their elements keeps its optimizer state on the
// device (with a pipeline each stage splits its own units by this rule). Their working parameters
// are resident whatever `params` says: the device's update writes them in place, and they cost a
// fraction of the optimizer state the device holds for them anyway (2 or 4 bytes per element
// beside 12 to 16).
void split_optimizer(const ModelLayout& layout, const OffloadSettings& settings, Placement& p) {
  if (settings.optimizer == Tier::kDevice || settings.optimizer_ratio >= 1.0) return;
  const std::size_t M = p.units.size();
  std::uint64_t total = 0, acc = 0;
  for (std::size_t m = 0; m < M; ++m) {
    if (p.units[m].in_stage) total += (layout.modules[m].grad_end - layout.modules[m].grad_begin) / 4;
  }
  const double budget = (1.0 - settings.optimizer_ratio) * static_cast<double>(total);
  for (std::size_t m = 0; m < M; ++m) {
    if (!p.units[m].in_stage) continue;
    const std::uint64_t e = (layout.modules[m].grad_end - layout.modules[m].grad_begin) / 4;
    if (static_cast<double>(acc + e) > budget) break;
    acc += e;
    p.units[m].optimizer_on_device = true;
    ++p.sizes.device_opt_units;
  }
}

// Homes, the resident block, the fp32 layout and the slot sizes.
void place_homes(const ModelLayout& layout, const OffloadSettings& settings, Placement& p) {
  const std::size_t M = p.units.size();
  const bool whole = settings.pipeline_bounds.size() < 2;
  const bool slice_params = settings.dp_size > 1 && settings.optimizer == Tier::kDevice &&
                            settings.params == Tier::kDevice && settings.zero_stage == 3;
  const std::uint64_t w = dtype_size(layout.config.dtype);
  PlacementSizes& z = p.sizes;
  z.grad_bytes = whole ? layout.grad_bytes : 0;
  for (std::size_t m = 0; m < M; ++m) {
    const ModuleDesc& md = layout.modules[m];
    UnitPlacement& u = p.units[m];
    if (!u.in_stage) {
      u.home = Tier::kDevice;  // nothing to place: no bytes
      continue;
    }
    u.param_bytes = md.param_end - md.param_begin;
    u.grad_bytes = md.grad_end - md.grad_begin;
    if (whole) {
      u.grad_offset = md.grad_begin;
    } else {
      u.grad_offset = z.grad_bytes;
      z.grad_bytes += align_up(u.grad_bytes, kParamAlignment);
    }
    const auto elements = static_cast<std::int64_t>(u.elements());
    u.home =
        elements <= settings.persistence_threshold || u.optimizer_on_device ? Tier::kDevice : settings.params;
    if (u.home == Tier::kDevice && slice_params && elements > settings.persistence_threshold) {
      // Stage 3 in device memory: this rank's slice at home, the whole unit only in a slot.
      u.slice_at_home = true;
      u.resident_offset = z.resident_bytes;
      const std::uint64_t chunk = dp_slice_of(u.elements(), settings.dp_size, 0).chunk;
      z.resident_bytes += align_up(std::max<std::uint64_t>(w * chunk, 1), kParamAlignment);
      z.param_slot_bytes = std::max(z.param_slot_bytes, u.param_bytes);
    } else if (u.home == Tier::kDevice) {
      u.resident_offset = z.resident_bytes;
      z.resident_bytes += align_up(std::max<std::uint64_t>(u.param_bytes, 1), kParamAlignment);
    } else {
      z.param_slot_bytes = std::max(z.param_slot_bytes, u.param_bytes);
    }
    if (u.home == Tier::kNvme) z.nvme_param_bytes += u.param_bytes;
    if (settings.optimizer != Tier::kDevice && u.home != Tier::kNvme) z.host_param_bytes += u.param_bytes;
  }
  if (z.param_slot_bytes > 0) {
    // The running module and each module of the look-ahead read at most `reads` units (2 with a
    // tied weight), plus one slot whose release trails the running module.
    std::size_t reads = 1;
    for (const UnitPlacement& u : p.units) reads = std::max(reads, u.reads.size());
    z.param_slots =
        static_cast<std::uint32_t>(reads * static_cast<std::size_t>(1 + settings.prefetch_modules) + 1);
    z.param_slot_bytes = align_up(z.param_slot_bytes, 4096);
  }
}

// Optimizer off the device: gradient buckets live from a unit's first backward touch to its last;
// count the most that overlap during backward (over every module, as backward runs them), plus one
// for the bucket whose copy to the host is in flight.
void size_grad_slots(Placement& p) {
  const std::size_t M = p.units.size();
  std::uint32_t most = 0;
  std::uint64_t max_grad = 0;
  for (const UnitPlacement& u : p.units) max_grad = std::max(max_grad, u.grad_bytes);
  for (std::size_t cur = 0; cur < M; ++cur) {
    std::uint32_t live = 0;
    for (std::size_t unit = 0; unit < M; ++unit) {
      int first = -1, last = static_cast<int>(M);
      for (std::size_t m = 0; m < M; ++m) {
        const std::vector<int>& r = p.units[m].reads;
        if (std::find(r.begin(), r.end(), static_cast<int>(unit)) != r.end()) {
          first = std::max(first, static_cast<int>(m));
          last = std::min(last, static_cast<int>(m));
        }
      }
      if (first >= static_cast<int>(cur) && last <= static_cast<int>(cur)) ++live;
    }
    most = std::max(most, live);
  }
  p.sizes.grad_slots = most + 1;
  p.sizes.grad_slot_bytes = align_up(std::max<std::uint64_t>(max_grad, 4), 4096);
}

// The NVMe optimizer's sub-groups and ring. With the optimizer state sharded over data-parallel
// ranks the sub-groups cover only this rank's slice of each unit.
void cut_sub_groups(const ModelLayout& layout, const OffloadSettings& settings, Placement& p) {
  PlacementSizes& z = p.sizes;
  z.ring_buffers = static_cast<std::uint32_t>(std::max(3, settings.nvme_buffer_count));
  std::uint64_t most = 0;
  for (std::size_t m = 0; m < p.units.size(); ++m) {
    UnitPlacement& u = p.units[m];
    if (settings.dp_size > 1) {
      // This rank's slice in pieces of sub_group_size elements (a multiple of 64 from the
      // slice's start, itself a multiple of 64: every parameter is split at multiples of 64).
      const DpSlice d = dp_slice_of(u.elements(), settings.dp_size, p.dp_rank);
      const std::uint64_t step =
          std::max<std::uint64_t>(64, static_cast<std::uint64_t>(settings.sub_group_size) / 64 * 64);
      u.sub_groups = {d.begin};
      for (std::uint64_t e = d.begin + step; e < d.begin + d.len; e += step) u.sub_groups.push_back(e);
      if (d.len > 0) u.sub_groups.push_back(d.begin + d.len);
    } else if (!u.in_stage) {
      u.sub_groups = {0};  // another stage's unit: no sub-groups
    } else {
      u.sub_groups = sub_group_bounds(layout, m, static_cast<std::uint64_t>(settings.sub_group_size));
    }
    for (std::size_t c = 0; c + 1 < u.sub_groups.size(); ++c) {
      // [master | m | v], and the gradients when they wait on NVMe.
      const std::uint64_t per = settings.gradients == Tier::kNvme ? 16 : 12;
      most = std::max(most, per * (u.sub_groups[c + 1] - u.sub_groups[c]));
    }
    z.param_out_bytes = std::max(z.param_out_bytes, u.param_bytes);
  }
  z.ring_buffer_bytes = align_up(std::max<std::uint64_t>(most, 4096), 4096);
  z.param_out_bytes = align_up(std::max<std::uint64_t>(z.param_out_bytes, 1), 4096);
}

// Data parallel: rank `rank`'s slice of every unit, packed (device units of a split apart), into
// `units` where given.
SliceTotals pack_slices(const Placement& p, int rank, std::vector<UnitPlacement>* units) {
  SliceTotals t;
  for (std::size_t m = 0; m < p.units.size(); ++m) {
    const UnitPlacement& u = p.units[m];
    const DpSlice s = dp_slice_of(u.elements(), p.dp_size, rank);
    std::uint64_t offset = 0;
    if (u.optimizer_on_device) {
      offset = t.dev_elements;
      t.dev_elements += s.len;
      t.dev_max_chunk = std::max(t.dev_max_chunk, s.chunk);
    } else {
      offset = t.shard_elements;
      t.shard_elements += s.len;
      t.max_chunk = std::max(t.max_chunk, s.chunk);
    }
    if (units != nullptr) {
      (*units)[m].slice = s;
      (*units)[m].slice_offset = offset;
    }
  }
  return t;
}

// The pipeline stage: its chunks' module ranges, which chunk reads each unit, the backward
// touches of the stage's modules, who holds each unit and the tied unit.
void shape_stage(const ModelLayout& layout, const OffloadSettings& settings, Placement& p) {
  const int M = p.size();
  StageShape& s = p.stage;
  s.stages = pipeline_stage_count(settings);
  s.stage = s.stages > 1 ? settings.pp_stage : 0;
  s.chunks = s.stages > 1 ? std::max(1, settings.pipeline_virtual_stages) : 1;
  s.chunk_ranges = {{0, M}};
  if (s.stages > 1) s.chunk_ranges = stage_ranges(settings.pipeline_bounds, s.chunks, s.stage);
  s.first = s.chunk_ranges.front().first;
  s.end = s.chunk_ranges.back().second;
  for (UnitPlacement& u : p.units) {
    u.chunk = -1;
    u.first_touch = -1;
    u.last_touch = M;
  }
  for (std::size_t c = 0; c < s.chunk_ranges.size(); ++c) {
    for (int m = s.chunk_ranges[c].first; m < s.chunk_ranges[c].second; ++m) {
      for (int x : p.units[static_cast<std::size_t>(m)].reads) {
        UnitPlacement& u = p.units[static_cast<std::size_t>(x)];
        u.first_touch = std::max(u.first_touch, m);
        u.last_touch = std::min(u.last_touch, m);
        if (u.chunk >= 0 && u.chunk != static_cast<int>(c)) u.several_chunks = true;
        u.chunk = static_cast<int>(c);
      }
    }
  }
  if (s.stages > 1) {
    for (int st = s.stages - 1; st >= 0; --st) {
      const std::vector<char> in = stage_units(layout, settings.pipeline_bounds, st, s.chunks);
      for (int u = 0; u < M; ++u)
        if (in[static_cast<std::size_t>(u)]) p.units[static_cast<std::size_t>(u)].holder_stage = st;
    }
    const std::vector<char> last = stage_units(layout, settings.pipeline_bounds, s.stages - 1, s.chunks);
    for (int u = 0; u < M && s.tied_unit < 0; ++u)
      if (last[static_cast<std::size_t>(u)] && p.unit(u).holder_stage != s.stages - 1) s.tied_unit = u;
  }
}

// Tensor parallel: per unit, the element ranges of its fp32 layout whose squares this rank adds to
// the gradient norm: sharded parameters on every rank, replicated ones (identical on every rank)
// on rank 0 only, so the sum over the group counts each element of the full model once.
void cut_norm_ranges(const ModelLayout& layout, Placement& p) {
  for (std::size_t u = 0; u < layout.modules.size(); ++u) {
    const ModuleDesc& md = layout.modules[u];
    auto& r = p.units[u].norm_ranges;
    if (p.tp_rank == 0) {
      r.emplace_back(0, (md.grad_end - md.grad_begin) / 4);
      continue;
    }
    for (int i : md.params) {
      const ParamDesc& pd = layout.params[static_cast<std::size_t>(i)];
      if (!pd.owns_storage() || pd.shard.kind == ShardKind::kReplicated) continue;
      const std::uint64_t first = (pd.grad_offset - md.grad_begin) / 4;
      r.emplace_back(first, first + static_cast<std::uint64_t>(pd.numel()));
    }
  }
}

}  // namespace

Placement Placement::build(const ModelLayout& layout, const OffloadSettings& settings, const Ranks& ranks) {
  Placement p;
  const std::size_t M = layout.modules.size();
  p.dp_size = std::max(1, settings.dp_size);
  p.dp_rank = ranks.dp_rank;
  p.tp_size = std::max(1, settings.tp_size);
  p.tp_rank = ranks.tp_rank;
  p.units.resize(M);
  const std::vector<std::vector<int>> reads = reads_of(layout);
  const std::vector<char> in_stage = stage_units(layout, settings.pipeline_bounds, settings.pp_stage,
                                                 std::max(1, settings.pipeline_virtual_stages));
  for (std::size_t m = 0; m < M; ++m) {
    p.units[m].reads = reads[m];
    p.units[m].in_stage = in_stage[m] != 0;
  }
  split_optimizer(layout, settings, p);
  place_homes(layout, settings, p);
  if (settings.optimizer != Tier::kDevice) size_grad_slots(p);
  // The device units' fp32 range: the prefix of the layout up to the first unit held on the host.
  PlacementSizes& z = p.sizes;
  z.device_opt_bytes = z.device_opt_units == 0 ? 0 : z.grad_bytes;
  for (std::size_t m = 0; m < M && z.device_opt_units > 0; ++m) {
    if (p.units[m].in_stage && !p.units[m].optimizer_on_device) {
      z.device_opt_bytes = p.units[m].grad_offset;
      break;
    }
  }
  if (settings.optimizer == Tier::kNvme) cut_sub_groups(layout, settings, p);
  p.slices = pack_slices(p, p.dp_rank, &p.units);
  shape_stage(layout, settings, p);
  if (p.tp_size > 1) cut_norm_ranges(layout, p);

  Sharding& f = p.sharding;
  const bool dp = p.dp_size > 1;
  f.optimizer_on_device = settings.optimizer == Tier::kDevice;
  f.host_state_sharded = dp && !f.optimizer_on_device;
  f.device_state_sharded = dp && f.optimizer_on_device && settings.zero_stage >= 1;
  f.device_grads_sharded = f.device_state_sharded && settings.zero_stage >= 2;
  // Stage 0 buckets on the cpu backend only: cuda keeps one all-reduce of the whole gradient
  // after backward (a stream's host function may not call NCCL).
  const bool stage0_bucketed = !ranks.cuda && dp && f.optimizer_on_device && settings.zero_stage == 0;
  f.device_grads_bucketed = f.device_grads_sharded || stage0_bucketed;
  f.device_params_sliced =
      dp && f.optimizer_on_device && settings.params == Tier::kDevice && settings.zero_stage == 3;
  f.optimizer_split = !f.optimizer_on_device && z.device_opt_units > 0;
  f.split_state_sharded = f.optimizer_split && dp;

  // Stage 3: every unit that is not resident keeps only this rank's slice of its working
  // parameters at its home (host or NVMe), or in device memory the units sliced above.
  if ((f.host_state_sharded && settings.zero_stage == 3) || f.device_params_sliced) {
    for (UnitPlacement& u : p.units) {
      u.gathered_at_fetch =
          (f.device_params_sliced ? u.slice_at_home : u.home != Tier::kDevice) && u.param_bytes > 0;
    }
  }
  // The host optimizer's copy of the working parameters, and the delayed update's next version.
  const std::uint64_t w = dtype_size(layout.config.dtype);
  if (!f.optimizer_on_device) {
    for (UnitPlacement& u : p.units) {
      u.host_offset = z.host_params_held;
      if (u.home == Tier::kNvme) continue;
      z.host_params_held += u.gathered_at_fetch ? u.slice.len * w : u.param_bytes;
    }
    for (UnitPlacement& u : p.units) {
      u.next_offset = z.delayed_next_bytes;
      // Stage 3: the next version of this rank's slice only.
      if (settings.delayed_update && u.home == Tier::kHost)
        z.delayed_next_bytes += u.gathered_at_fetch ? u.slice.len * w : u.param_bytes;
    }
  }
  if (f.device_grads_bucketed) {
    std::vector<BucketSeat> seats;
    p.buckets = cut_grad_buckets(p, settings, &seats);
    for (std::size_t m = 0; m < M; ++m) p.units[m].bucket = seats[m];
  }
  p.stage.device_units_of_chunk.assign(p.stage.chunk_ranges.size(), {});
  if (f.optimizer_split) {
    for (int u = 0; u < p.size(); ++u) {
      if (!p.unit(u).optimizer_on_device) continue;
      p.stage.device_units.push_back(u);
      const int c = p.unit(u).chunk;
      if (c >= 0) p.stage.device_units_of_chunk[static_cast<std::size_t>(c)].push_back(u);
    }
  }
  return p;
}

SliceTotals Placement::slice_totals(int rank) const { return pack_slices(*this, rank, nullptr); }

bool Placement::any_gathered_at_fetch() const {
  return std::any_of(units.begin(), units.end(), [](const UnitPlacement& u) { return u.gathered_at_fetch; });
}
bool Placement::any_nvme_home() const {
  return std::any_of(units.begin(), units.end(),
                     [](const UnitPlacement& u) { return u.home == Tier::kNvme; });
}
bool Placement::any_slice_at_home() const {
  return std::any_of(units.begin(), units.end(), [](const UnitPlacement& u) { return u.slice_at_home; });
}

std::string Placement::split_modules(bool device) const {
  std::string out;
  const std::size_t M = units.size();
  for (std::size_t m = 0; m < M;) {
    const auto taken = [&](std::size_t k) {
      return units[k].in_stage && units[k].optimizer_on_device == device;
    };
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

Status Placement::is_valid() const {
  std::uint64_t next = 0;
  for (int u = 0; u < size(); ++u) {
    const UnitPlacement& x = unit(u);
    const std::string who = "placement: unit " + std::to_string(u);
    if (!x.in_stage && (x.param_bytes != 0 || x.grad_bytes != 0 || x.home != Tier::kDevice))
      return internal_error(who + " is another stage's but has bytes or a home");
    if (x.grad_bytes == 0) continue;
    if (x.grad_offset < next) return internal_error(who + ": its fp32 offset goes back");
    next = x.grad_offset + x.grad_bytes;
    if (x.optimizer_on_device && x.grad_offset + x.grad_bytes > sizes.device_opt_bytes)
      return internal_error(who + " is a device unit outside the device prefix");
    if (!x.optimizer_on_device && sharding.optimizer_split && x.in_stage &&
        x.grad_offset < sizes.device_opt_bytes)
      return internal_error(who + " is a host unit inside the device prefix");
    if (x.slice.begin + x.slice.len > x.elements()) return internal_error(who + ": its slice passes its end");
    if (x.slice_at_home && x.home != Tier::kDevice)
      return internal_error(who + " is sliced at a home off the device");
  }
  if (next > sizes.grad_bytes)
    return internal_error("placement: the fp32 arrays are smaller than their units");
  return ok_status();
}

}  // namespace strata::partition
