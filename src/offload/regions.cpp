// Memory needs of a placement (regions.hpp).
#include "offload/regions.hpp"

#include <algorithm>

namespace strata::offload_detail {

using partition::Placement;

std::uint64_t device_state_bytes(const Placement& p) {
  const std::uint64_t bytes =
      p.sharding.device_state_sharded ? 4 * p.slice_totals(0).shard_elements : p.sizes.grad_bytes;
  return std::max<std::uint64_t>(bytes, kParamAlignment);
}

std::uint64_t device_dp_staging_bytes(const Placement& p, std::uint64_t w) {
  const std::uint64_t P = static_cast<std::uint64_t>(p.dp_size);
  const std::uint64_t c = p.slice_totals(0).max_chunk;
  // Stage >= 2 reduces in its gradient buckets: only the all-gather's part.
  const std::uint64_t per = p.sharding.device_grads_sharded ? w : 4 + w;
  return std::max<std::uint64_t>(per * (P + 1) * c, kParamAlignment);
}

std::uint64_t split_dp_state_bytes(const Placement& p) {
  return std::max<std::uint64_t>(4 * p.slice_totals(0).dev_elements, kParamAlignment);
}

std::uint64_t split_dp_staging_bytes(const Placement& p, std::uint64_t w) {
  const std::uint64_t P = static_cast<std::uint64_t>(p.dp_size);
  return std::max<std::uint64_t>((4 + w) * (P + 1) * p.slices.dev_max_chunk, kParamAlignment);
}

std::vector<RegionSpec> device_regions(const Placement& p, const OffloadSettings& settings, DType working) {
  std::vector<RegionSpec> r;
  const auto& z = p.sizes;
  r.push_back(RegionSpec{"offload.params", std::max<std::uint64_t>(z.resident_bytes, kParamAlignment), 0, 0});
  if (z.param_slots > 0) r.push_back(RegionSpec{"offload.param_slots", 0, z.param_slot_bytes, z.param_slots});
  const std::uint64_t gb = std::max<std::uint64_t>(z.grad_bytes, kParamAlignment);
  if (p.sharding.optimizer_on_device) {
    const std::uint64_t sb = device_state_bytes(p);
    if (p.sharding.device_grads_sharded) {
      // This rank's reduced slices (rank 0's, the largest), and the buckets backward writes into.
      r.push_back(RegionSpec{"offload.grads", sb, 0, 0});
      r.push_back(RegionSpec{"offload.grad_buckets", 0, p.buckets.slot_bytes(), p.buckets.slots(settings)});
    } else {
      r.push_back(RegionSpec{"offload.grads", gb, 0, 0});
    }
    if (working != DType::kF32) r.push_back(RegionSpec{"optim.master", sb, 0, 0});
    r.push_back(RegionSpec{"optim.exp_avg", sb, 0, 0});
    r.push_back(RegionSpec{"optim.exp_avg_sq", sb, 0, 0});
    if (p.sharding.device_state_sharded) {
      r.push_back(RegionSpec{"offload.dp_staging", device_dp_staging_bytes(p, dtype_size(working)), 0, 0});
    }
  } else {
    r.push_back(RegionSpec{"offload.grad_slots", 0, z.grad_slot_bytes, z.grad_slots});
    if (z.device_opt_units > 0) {
      // Partial optimizer offload: the first modules' gradients (whole), in the fp32 layout, and
      // their state: whole, or with several data-parallel ranks this rank's slices (rank 0's, the
      // largest) beside the staging of their collectives and, stage 2, the reduced slices.
      const std::uint64_t db = std::max<std::uint64_t>(z.device_opt_bytes, kParamAlignment);
      const bool dp = p.sharding.split_state_sharded;
      const std::uint64_t sb = dp ? split_dp_state_bytes(p) : db;
      r.push_back(RegionSpec{"offload.grads", db, 0, 0});
      if (dp && settings.zero_stage >= 2) r.push_back(RegionSpec{"offload.grad_slices", sb, 0, 0});
      if (working != DType::kF32) r.push_back(RegionSpec{"optim.master", sb, 0, 0});
      r.push_back(RegionSpec{"optim.exp_avg", sb, 0, 0});
      r.push_back(RegionSpec{"optim.exp_avg_sq", sb, 0, 0});
      if (dp)
        r.push_back(RegionSpec{"offload.dp_staging", split_dp_staging_bytes(p, dtype_size(working)), 0, 0});
    }
  }
  return r;
}

std::uint64_t activation_bytes_estimate(const TrainerConfig& config, bool offload_activations) {
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

std::uint64_t activation_slot_estimate(const TrainerConfig& config, int b, int e, bool offload_activations) {
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

std::uint64_t swap_capacity(const OffloadPlan& plan, const Placement& p, const OffloadSettings& settings) {
  if (plan.nvme_bytes == 0) return 0;
  std::uint64_t keys = 0;
  for (const partition::UnitPlacement& u : p.units) {
    if (u.home == Tier::kNvme) keys += settings.delayed_update ? 2 : 1;  // delayed: two versions
    keys += u.sub_group_count() * (settings.gradients == Tier::kNvme ? 2 : 1);
  }
  const std::uint64_t granule = align_up(std::max<std::uint64_t>(settings.io.block_size, 4096), 64u << 10);
  const auto& z = p.sizes;
  const std::uint64_t in_flight = static_cast<std::uint64_t>(z.ring_buffers) * z.ring_buffer_bytes +
                                  2 * z.param_out_bytes + z.grad_slot_bytes + z.param_slot_bytes;
  return align_up(plan.nvme_bytes + 2 * in_flight + keys * granule + (64u << 20), 1u << 20);
}

}  // namespace strata::offload_detail
