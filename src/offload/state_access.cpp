// State access (state_access.hpp): a unit's whole state wherever it lives, and a parameter's.
#include "offload/state_access.hpp"

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

#include "parallel/agreement.hpp"

namespace strata::offload_detail {

Status StateAccess::initialize() {
  const ModelLayout& L = layout();
  std::vector<float> values;
  for (int u = 0; u < M; ++u) {
    const std::size_t uu = static_cast<std::size_t>(u);
    if (!placement.units[uu].in_stage) continue;  // another pipeline stage's
    std::vector<char> pbytes(placement.units[uu].param_bytes, 0);
    std::vector<float> blob;
    const bool via_blob = settings.optimizer == Tier::kNvme || placement.sharding.host_state_sharded;
    if (via_blob) blob.assign(3 * placement.units[uu].grad_bytes / 4, 0.0f);
    for (int k : owned_of_unit[uu]) {
      const OwnedParam& o = owned[static_cast<std::size_t>(k)];
      values.resize(o.n);
      init_values(L, o.index, config.seed, 0, static_cast<std::int64_t>(o.n), values.data());
      STRATA_RETURN_IF_ERROR(
          convert(values.data(), DType::kF32, pbytes.data() + o.param_in_unit, wdtype, o.n));
      if (settings.optimizer == Tier::kHost && !placement.sharding.host_state_sharded &&
          !placement.device_state(u)) {
        std::memcpy(host_at(host_.host_master, o.grad_offset), values.data(), o.n * 4);
      }
      if (via_blob) std::memcpy(blob.data() + o.grad_in_unit / 4, values.data(), o.n * 4);
      if (placement.device_state(u) && half)
        STRATA_RETURN_IF_ERROR(devopt_.upload_dev_master(o, values.data()));
    }
    STRATA_RETURN_IF_ERROR(write_unit_params(u, pbytes));
    // Partial offload with data parallelism: a device unit's state is on the device (its moments
    // zeroed when carved, its master uploaded above).
    if (via_blob && !(placement.sharding.split_state_sharded && placement.device_state(u)))
      STRATA_RETURN_IF_ERROR(write_unit_optim(u, blob));
  }
  return compute->synchronize();
}

Status StateAccess::read_unit_optim(int u, std::vector<float>& blob, const Status& before) {
  const std::size_t n = placement.units[static_cast<std::size_t>(u)].grad_bytes / 4;
  blob.resize(3 * n);
  Status read = before;
  if (settings.optimizer == Tier::kNvme) {
    const auto& b = placement.units[static_cast<std::size_t>(u)].sub_groups;
    std::vector<float> piece;
    for (std::size_t c = 0; c + 1 < b.size() && read.ok(); ++c) {
      const std::size_t len = b[c + 1] - b[c];
      piece.resize(3 * len);
      read = swap->read(TensorKey{unit_key("optim", u), static_cast<std::uint32_t>(c)}, piece.data(),
                        3 * len * 4)
                 .wait();
      if (!read.ok()) break;
      for (int k = 0; k < 3; ++k) std::memcpy(blob.data() + k * n + b[c], piece.data() + k * len, len * 4);
    }
    if (!placement.sharding.host_state_sharded)
      return read;  // sharded: the groups held this rank's slice, gathered below
  }
  if (placement.sharding.host_state_sharded && state_reads_can_fail()) {
    // A rank that could not read its part still joins the exchange, so its peers do not wait in
    // the gather for it.
    STRATA_RETURN_IF_ERROR(parallel::agree_on_read(
        *comms.dp_caller, read,
        "its state of module '" + layout().modules[static_cast<std::size_t>(u)].name + "'", "data-parallel"));
  }
  if (placement.sharding.host_state_sharded) {
    STRATA_RETURN_IF_ERROR(read);
    // Collective: every rank's slice of [master | m | v], all-gathered on the caller's Comm.
    const std::size_t uu = static_cast<std::size_t>(u);
    const std::uint64_t c = placement.units[uu].slice.chunk, b0 = placement.units[uu].slice.begin,
                        len = placement.units[uu].slice.len, off = placement.units[uu].slice_offset;
    std::vector<float> mine(3 * c, 0.0f), all(3 * c * static_cast<std::size_t>(dp_size));
    for (int k = 0; k < 3; ++k) {
      const HostMem& h = k == 0 ? host_.host_master : k == 1 ? host_.host_m : host_.host_v;
      const float* from = settings.optimizer == Tier::kNvme ? blob.data() + k * n + b0 : h.floats() + off;
      std::memcpy(mine.data() + k * c, from, len * 4);
    }
    return gather_state_slices(u, mine, all, blob, /*with_master=*/true);
  }
  STRATA_RETURN_IF_ERROR(read);
  const std::uint64_t g = grad_begin(u);
  std::memcpy(blob.data(), host_at(host_.host_master, g), n * 4);
  std::memcpy(blob.data() + n, host_at(host_.host_m, g), n * 4);
  std::memcpy(blob.data() + 2 * n, host_at(host_.host_v, g), n * 4);
  return ok_status();
}

Status StateAccess::write_unit_optim(int u, const std::vector<float>& blob) {
  const std::size_t n = placement.units[static_cast<std::size_t>(u)].grad_bytes / 4;
  if (settings.optimizer == Tier::kNvme) {
    const auto& b = placement.units[static_cast<std::size_t>(u)].sub_groups;
    std::vector<float> piece;
    for (std::size_t c = 0; c + 1 < b.size(); ++c) {
      const std::size_t len = b[c + 1] - b[c];
      piece.resize(3 * len);
      for (int k = 0; k < 3; ++k) std::memcpy(piece.data() + k * len, blob.data() + k * n + b[c], len * 4);
      STRATA_RETURN_IF_ERROR(swap->write(TensorKey{unit_key("optim", u), static_cast<std::uint32_t>(c)},
                                         piece.data(), 3 * len * 4)
                                 .wait());
    }
    return ok_status();
  }
  if (placement.sharding.host_state_sharded) {  // every rank is given the whole unit and keeps its slice
    const std::size_t uu = static_cast<std::size_t>(u);
    const std::uint64_t b = placement.units[uu].slice.begin, len = placement.units[uu].slice.len,
                        off = placement.units[uu].slice_offset;
    std::memcpy(host_.host_master.floats() + off, blob.data() + b, len * 4);
    std::memcpy(host_.host_m.floats() + off, blob.data() + n + b, len * 4);
    std::memcpy(host_.host_v.floats() + off, blob.data() + 2 * n + b, len * 4);
    return ok_status();
  }
  const std::uint64_t g = grad_begin(u);
  std::memcpy(host_at(host_.host_master, g), blob.data(), n * 4);
  std::memcpy(host_at(host_.host_m, g), blob.data() + n, n * 4);
  std::memcpy(host_at(host_.host_v, g), blob.data() + 2 * n, n * 4);
  return ok_status();
}

Status StateAccess::write_values(int index, std::span<const float> values, bool master_too) {
  const int k = owned_index(index);
  if (k < 0) return invalid_argument("set_param: no parameter with index " + std::to_string(index));
  const OwnedParam& o = owned[static_cast<std::size_t>(k)];
  if (values.size() != o.n) {
    return invalid_argument("set_param '" + layout().params[static_cast<std::size_t>(o.index)].name +
                            "': got " + std::to_string(values.size()) + " values for " + std::to_string(o.n) +
                            " elements");
  }
  STRATA_RETURN_IF_ERROR(settle_());
  std::vector<char> bytes;
  STRATA_RETURN_IF_ERROR(homes_.read_unit_params(o.unit, bytes));
  STRATA_RETURN_IF_ERROR(convert(values.data(), DType::kF32, bytes.data() + o.param_in_unit, wdtype, o.n));
  STRATA_RETURN_IF_ERROR(write_unit_params(o.unit, bytes));
  if (!master_too) return ok_status();
  if (placement.device_state(o.unit)) {
    if (!half) return ok_status();  // the resident params are the master
    STRATA_RETURN_IF_ERROR(devopt_.upload_dev_master(o, values.data()));
    return compute->synchronize();
  }
  std::vector<float> blob;
  STRATA_RETURN_IF_ERROR(read_unit_optim(o.unit, blob));
  std::memcpy(blob.data() + o.grad_in_unit / 4, values.data(), o.n * 4);
  return write_unit_optim(o.unit, blob);
}

Result<std::vector<float>> StateAccess::read_state(int index, int which) {
  const int k = owned_index(index);
  if (k < 0 && pp_size > 1 && index >= 0 && index < static_cast<int>(layout().params.size())) {
    return failed_precondition(
        "parameter '" + layout().params[static_cast<std::size_t>(index)].name +
        "' is held by pipeline stage " +
        std::to_string(placement.units[static_cast<std::size_t>(core.owner_unit(index))].holder_stage) +
        ", not by this stage (" + std::to_string(pp_rank) + ")");
  }
  if (k < 0) return invalid_argument("no parameter with index " + std::to_string(index));
  const OwnedParam& o = owned[static_cast<std::size_t>(k)];
  STRATA_RETURN_IF_ERROR(settle_());
  std::vector<float> out(o.n);
  if (which == 0 || (which == 1 && placement.device_state(o.unit) && !half)) {
    std::vector<char> bytes;
    STRATA_RETURN_IF_ERROR(homes_.read_unit_params(o.unit, bytes));
    STRATA_RETURN_IF_ERROR(convert(bytes.data() + o.param_in_unit, wdtype, out.data(), DType::kF32, o.n));
    return out;
  }
  if (placement.device_state(o.unit) &&
      placement.sharding
          .device_state_in_slices()) {  // collective: the unit's slices gathered from every rank
    std::vector<char> pbytes;
    std::vector<float> blob;
    STRATA_RETURN_IF_ERROR(read_unit_state(o.unit, pbytes, blob));
    const std::size_t n = placement.units[static_cast<std::size_t>(o.unit)].grad_bytes / 4;
    std::memcpy(out.data(), blob.data() + static_cast<std::size_t>(which - 1) * n + o.grad_in_unit / 4,
                o.n * 4);
    return out;
  }
  if (placement.device_state(o.unit)) {
    const float* src = which == 1 ? devopt_.dmaster : which == 2 ? devopt_.dm : devopt_.dv;
    STRATA_RETURN_IF_ERROR(
        stager->download(out.data(), reinterpret_cast<const char*>(src) + o.grad_offset, o.n * 4));
    return out;
  }
  std::vector<float> blob;
  STRATA_RETURN_IF_ERROR(read_unit_optim(o.unit, blob));
  const std::size_t n = placement.units[static_cast<std::size_t>(o.unit)].grad_bytes / 4;
  std::memcpy(out.data(), blob.data() + static_cast<std::size_t>(which - 1) * n + o.grad_in_unit / 4,
              o.n * 4);
  return out;
}

Status StateAccess::read_unit_state(int u, std::vector<char>& pbytes, std::vector<float>& blob) {
  Status params = homes_.read_unit_params(u, pbytes);
  // A sharded unit's parameter read is already agreed over the ranks (every rank failed it);
  // any other failure goes into the optimizer state's exchange, which the peers are in (where
  // state_reads_can_fail).
  if (!params.ok() && placement.units[static_cast<std::size_t>(u)].gathered_at_fetch) return params;
  if (!placement.device_state(u)) return read_unit_optim(u, blob, params);
  const std::size_t uu = static_cast<std::size_t>(u);
  const std::size_t n = placement.units[uu].grad_bytes / 4;
  blob.assign(3 * n, 0.0f);
  if (n == 0) return params;
  // This rank's elements [first, first + len) of the state (the whole unit unless sharded).
  const std::uint64_t first = devopt_.dev_state_first(u), len = devopt_.dev_state_len(u);
  Status read = params;  // this rank's first failure (a device copy can fail on one rank alone)
  if (read.ok() && half) {
    read = stager->download(blob.data() + first, devopt_.dev_state(u, 1), len * 4);
  } else if (read.ok()) {  // fp32 on the device: the resident parameters are the master (whole on every rank)
    for (int k : owned_of_unit[uu]) {
      const OwnedParam& o = owned[static_cast<std::size_t>(k)];
      std::memcpy(blob.data() + o.grad_in_unit / 4, pbytes.data() + o.param_in_unit, o.n * 4);
    }
  }
  if (read.ok()) read = stager->download(blob.data() + n + first, devopt_.dev_state(u, 2), len * 4);
  if (read.ok()) read = stager->download(blob.data() + 2 * n + first, devopt_.dev_state(u, 3), len * 4);
  if (!placement.sharding.device_state_in_slices()) return read;
  // The gather below is collective: a rank whose download failed keeps its place and every rank
  // returns the same error naming it, at once (not its peers after the comm timeout). Always
  // exchanged, unlike the host tier's (state_reads_can_fail): any device copy can fail.
  STRATA_RETURN_IF_ERROR(parallel::agree_on_read(
      *comms.dp_caller, read, "its slice of module '" + layout().modules[uu].name + "' (state on the device)",
      "data-parallel"));
  // Collective: every rank's slice of [master | m | v], all-gathered on the caller's Comm (as
  // read_unit_optim does for the host tier's shards).
  const std::uint64_t c = placement.units[uu].slice.chunk;
  std::vector<float> mine(3 * c, 0.0f), all(3 * c * static_cast<std::size_t>(dp_size));
  for (int k = 0; k < 3; ++k) std::memcpy(mine.data() + k * c, blob.data() + k * n + first, len * 4);
  // The master is the (replicated) working copy in fp32.
  return gather_state_slices(u, mine, all, blob, /*with_master=*/half);
}

Status StateAccess::write_unit_state(int u, const std::vector<char>& pbytes, const std::vector<float>& blob) {
  STRATA_RETURN_IF_ERROR(write_unit_params(u, pbytes));
  if (!placement.device_state(u)) return write_unit_optim(u, blob);
  const std::size_t n = placement.units[static_cast<std::size_t>(u)].grad_bytes / 4;
  if (n == 0) return ok_status();
  // Every rank is given the whole unit and keeps its elements (its slice when sharded).
  const std::uint64_t first = devopt_.dev_state_first(u), len = devopt_.dev_state_len(u);
  if (half) STRATA_RETURN_IF_ERROR(stager->upload(devopt_.dev_state(u, 1), blob.data() + first, len * 4));
  STRATA_RETURN_IF_ERROR(stager->upload(devopt_.dev_state(u, 2), blob.data() + n + first, len * 4));
  STRATA_RETURN_IF_ERROR(stager->upload(devopt_.dev_state(u, 3), blob.data() + 2 * n + first, len * 4));
  return compute->synchronize();
}

Result<std::vector<float>> StateAccess::read_full(int index, int which) {
  Result<std::vector<float>> read = read_state(index, which);
  if (tp_size == 1) return read;
  // Every tensor-parallel rank learns whether every other read its shard before anything else
  // is gathered (replicated parameters too: a rank that stopped here would leave its peers in
  // the next parameter's gather), so a rank that cannot read fails the group at once.
  if (state_reads_can_fail() && index >= 0 && index < static_cast<int>(layout().params.size())) {
    STRATA_RETURN_IF_ERROR(parallel::agree_on_read(
        *comms.tp_step, read.status(),
        "its shard of '" + layout().params[static_cast<std::size_t>(index)].name + "'", "tensor-parallel"));
  }
  STRATA_ASSIGN_OR_RETURN(std::vector<float> shard, std::move(read));
  const ParamDesc* p = &layout().params[static_cast<std::size_t>(index)];
  const int target = p->owns_storage() ? index : p->tied_with;
  p = &layout().params[static_cast<std::size_t>(target)];
  if (p->shard.kind == ShardKind::kReplicated) return shard;
  // Every shard of a parameter has the same number of elements.
  std::vector<float> gathered(shard.size() * static_cast<std::size_t>(tp_size));
  STRATA_RETURN_IF_ERROR(comms.tp_step->all_gather(shard.data(), gathered.data(), shard.size(), DType::kF32)
                             .wait()
                             .with_context("tensor parallel: gathering '" + p->name + "'"));
  std::vector<float> full(static_cast<std::size_t>(p->shard.full_numel()));
  for (int r = 0; r < tp_size; ++r) {
    full_from_shard(core.tp_layouts[static_cast<std::size_t>(r)].params[static_cast<std::size_t>(target)],
                    gathered.data() + static_cast<std::size_t>(r) * shard.size(), full.data());
  }
  return full;
}

Status StateAccess::write_full(int index, std::span<const float> values) {
  if (tp_size == 1) return write_values(index, values, true);
  if (index < 0 || index >= static_cast<int>(layout().params.size())) {
    return invalid_argument("set_param: no parameter with index " + std::to_string(index));
  }
  const ParamDesc* p = &layout().params[static_cast<std::size_t>(index)];
  if (!p->owns_storage()) p = &layout().params[static_cast<std::size_t>(p->tied_with)];
  if (static_cast<std::int64_t>(values.size()) != p->shard.full_numel()) {
    return invalid_argument("set_param '" + p->name + "': got " + std::to_string(values.size()) +
                            " values for the full parameter of " + std::to_string(p->shard.full_numel()) +
                            " elements (tensor parallel: this rank keeps its shard)");
  }
  std::vector<float> shard(static_cast<std::size_t>(p->numel()));
  shard_from_full(*p, values.data(), shard.data());
  return write_values(index, shard, true);
}

Status StateAccess::gather_state_slices(int u, const std::vector<float>& mine, std::vector<float>& all,
                                        std::vector<float>& blob, bool with_master) {
  const std::size_t uu = static_cast<std::size_t>(u);
  const std::size_t n = placement.units[uu].grad_bytes / 4;
  const std::uint64_t c = placement.units[uu].slice.chunk;
  STRATA_RETURN_IF_ERROR(dp_wait(dp_tracks[0],
                                 comms.dp_caller->all_gather(mine.data(), all.data(), 3 * c, DType::kF32),
                                 "gather optimizer state", u, all.size() * 4));
  for (int r = 0; r < dp_size; ++r) {
    const partition::DpSlice theirs = partition::dp_slice_of(n, dp_size, r);
    for (int k = 0; k < 3; ++k) {
      if (k == 0 && !with_master) continue;
      std::memcpy(blob.data() + k * n + theirs.begin, all.data() + (static_cast<std::size_t>(r) * 3 + k) * c,
                  theirs.len * 4);
    }
  }
  return ok_status();
}

}  // namespace strata::offload_detail
