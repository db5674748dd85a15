// The column view of partition::Placement that the tests read (internal.hpp's Units and
// GradBuckets): a copy of the records, field by field.
#include <utility>

#include "offload/internal.hpp"

namespace strata::offload_detail {

Units describe_units(const ModelLayout& layout, const OffloadSettings& settings, int dp_rank) {
  partition::Ranks ranks;
  ranks.dp_rank = dp_rank;
  auto p = std::make_shared<const partition::Placement>(partition::Placement::build(layout, settings, ranks));
  Units u;
  for (const partition::UnitPlacement& x : p->units) {
    u.home.push_back(x.home);
    u.pbytes.push_back(x.param_bytes);
    u.gbytes.push_back(x.grad_bytes);
    u.resident_offset.push_back(x.resident_offset);
    u.grad_offset.push_back(x.grad_offset);
    u.storage.push_back(x.reads);
    if (settings.optimizer == Tier::kNvme) u.sub_groups.push_back(x.sub_groups);
    u.device_opt.push_back(x.optimizer_on_device ? 1 : 0);
    u.in_stage.push_back(x.in_stage ? 1 : 0);
    u.sliced.push_back(x.slice_at_home ? 1 : 0);
  }
  const partition::PlacementSizes& z = p->sizes;
  u.resident_bytes = z.resident_bytes;
  u.host_param_bytes = z.host_param_bytes;
  u.nvme_param_bytes = z.nvme_param_bytes;
  u.param_slots = z.param_slots;
  u.param_slot_bytes = z.param_slot_bytes;
  u.grad_slots = z.grad_slots;
  u.grad_slot_bytes = z.grad_slot_bytes;
  u.ring_buffers = z.ring_buffers;
  u.ring_buffer_bytes = z.ring_buffer_bytes;
  u.param_out_bytes = z.param_out_bytes;
  u.device_opt_units = z.device_opt_units;
  u.device_opt_bytes = z.device_opt_bytes;
  u.grad_bytes = z.grad_bytes;
  u.placement = std::move(p);
  return u;
}

GradBuckets grad_buckets(const Units& u, const OffloadSettings& settings) {
  std::vector<partition::BucketSeat> seats;
  const partition::GradBuckets cut = partition::cut_grad_buckets(*u.placement, settings, &seats);
  GradBuckets g;
  for (const partition::GradBucket& b : cut.buckets) {
    g.units.push_back(b.units);
    g.open_at.push_back(b.open_at);
    g.close_after.push_back(b.close_after);
    g.bytes.push_back(b.bytes);
    g.rs_chunk.push_back(b.rs_chunk);
  }
  for (const partition::BucketSeat& s : seats) {
    g.bucket_of.push_back(s.index);
    g.offset.push_back(s.offset);
    g.rs_at.push_back(s.rs_at);
  }
  g.live = cut.live;
  g.max_bytes = cut.max_bytes;
  g.max_rs_chunk = cut.max_rs_chunk;
  return g;
}

std::uint32_t grad_bucket_slots(const GradBuckets& g, const OffloadSettings& s) {
  return std::max<std::uint32_t>(g.live, 1) + (s.overlap_comm ? 1 : 0);
}

std::uint64_t grad_bucket_slot_bytes(const GradBuckets& g) {
  partition::GradBuckets p;
  p.max_bytes = g.max_bytes;
  p.max_rs_chunk = g.max_rs_chunk;
  return p.slot_bytes();
}

}  // namespace strata::offload_detail
