// Tests only (offload_detail::EngineFaults, internal.hpp): the hooks of FaultHooks armed.
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

#include "device/backends.hpp"
#include "offload/engine_impl.hpp"
#include "offload/internal.hpp"
#include "offload/regions.hpp"
#include "optim/grad_norm_cuda.hpp"

namespace strata {

Status offload_detail::FaultHooks::fire_at_module(int m, Stream& compute) {
  if (caller_module == m) {
    // EngineFaults::fail_caller_at: the caller fails here, inside the pass.
    caller_module = -1;
    return std::exchange(caller_error, ok_status());
  }
  if (compute_module == m) {
    // EngineFaults::fail_compute_at: the compute stream fails here, so its later work, the
    // model's tensor all-reduces included, is skipped.
    compute_module = -1;
    STRATA_RETURN_IF_ERROR(
        compute.host_fn("offload: injected compute fault", [f = compute_error]() { return f; }));
  }
  return ok_status();
}

Result<std::unique_ptr<OffloadEngine>> offload_detail::EngineFaults::create(
    const TrainerConfig& config, const OffloadSettings& settings, Device& device,
    const nvme_detail::IoFaults* faults, Comm* pipeline, Comm* data_parallel, Comm* tensor_parallel) {
  return OffloadEngine::create_with_faults(config, settings, device, nullptr, data_parallel, tensor_parallel,
                                           pipeline, faults);
}

void offload_detail::EngineFaults::fail_state_downloads(OffloadEngine& engine, Status fault) {
  engine.impl_->stager->set_download_fault(std::move(fault));
}

void offload_detail::EngineFaults::fail_next_pass(OffloadEngine& engine, Status fault) {
  engine.impl_->faults.pass_error = std::move(fault);
}

void offload_detail::EngineFaults::hold_update_until_forward(OffloadEngine& engine, int held_module,
                                                             int forward_module) {
  OffloadEngine::Impl& t = *engine.impl_;
  std::lock_guard<std::mutex> lock(t.ledger.mu);
  t.faults.hold_forward = forward_module;
  t.faults.held_unit = t.placement.units[static_cast<std::size_t>(held_module)].reads.front();
}

void offload_detail::EngineFaults::fail_compute_at(OffloadEngine& engine, int module, Status fault) {
  engine.impl_->faults.compute_module = module;
  engine.impl_->faults.compute_error = std::move(fault);
}

void offload_detail::EngineFaults::fail_caller_at(OffloadEngine& engine, int module, Status fault) {
  engine.impl_->faults.caller_module = module;
  engine.impl_->faults.caller_error = std::move(fault);
}

void offload_detail::EngineFaults::hide_weights_file(OffloadEngine& engine, bool on) {
  engine.impl_->faults.hide_weights_file = on;
}

void offload_detail::EngineFaults::gather_weights_on_save(OffloadEngine& engine, bool on) {
  engine.impl_->faults.gather_weights_on_save = on;
}

void offload_detail::EngineFaults::kill_during_save(OffloadEngine& engine, std::uint64_t writes) {
  engine.impl_->faults.kill_after_weights_writes = writes;
}

Status offload_detail::EngineFaults::set_working_param(OffloadEngine& engine, int index,
                                                       std::span<const float> values) {
  return engine.impl_->state.write_values(index, values, /*master_too=*/false);
}

}  // namespace strata
