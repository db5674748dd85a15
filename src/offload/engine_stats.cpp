// The engine's statistics and timeline (OffloadStats, observe, write_trace).
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
#include "offload/regions.hpp"
#include "optim/grad_norm_cuda.hpp"

namespace strata {

OffloadStats OffloadEngine::stats() const {
  Impl& t = *impl_;
  OffloadStats s;
  s.steps = t.now.steps;
  // Early fetches in flight count as done (Fetcher::pending_early); the ledger's mu stays held
  // until the counters below are read.
  std::unique_lock<std::mutex> lock(t.ledger.mu, std::defer_lock);
  const offload_detail::Fetcher::Pending pending = t.fetcher.pending_early(lock);
  const std::uint64_t pending_h2d = pending.h2d, pending_read = pending.nvme_read, pending_dp = pending.dp;
  const DeviceStats d = t.device->stats();
  const IoEngineStats io = t.io ? t.io->stats() : IoEngineStats{};
  const std::uint64_t dp_bytes = t.dp_bytes.load(std::memory_order_relaxed) + pending_dp;
  lock.unlock();
  s.bytes_h2d = d.bytes_h2d + pending_h2d;
  s.bytes_d2h = d.bytes_d2h;
  s.compute_cpu_seconds = d.compute_cpu_seconds;
  s.copy_cpu_seconds = d.copy_cpu_seconds;
  s.optimizer_cpu_seconds = t.host.worker_cpu.seconds();
  if (t.io) {
    s.bytes_nvme_read = io.bytes_read + pending_read;
    s.bytes_nvme_written = io.bytes_written;
    s.io_cpu_seconds = io.cpu_seconds;
  }
  s.param_accesses = t.fetcher.accesses;
  s.prefetch_hits = t.fetcher.hits;
  s.early_fetch_hits = t.fetcher.early_hits;
  s.trace_mismatches = t.fetcher.mismatches;
  s.early_optimizer_reads = t.host.nvme.early_reads_issued.load(std::memory_order_relaxed);
  s.early_optimizer_reads_dropped = t.host.nvme.early_reads_dropped.load(std::memory_order_relaxed);
  s.allocations_after_warmup = t.have_baseline ? t.allocation_count() - t.alloc_baseline : 0;
  s.stream_times = t.tracer.timing();
  s.compute_seconds = t.tracer.seconds(TraceCounter::kCompute);
  s.fetch_stall_seconds = t.tracer.seconds(TraceCounter::kFetchStall);
  s.h2d_seconds = t.tracer.seconds(TraceCounter::kH2D);
  s.d2h_seconds = t.tracer.seconds(TraceCounter::kD2H);
  s.nvme_read_seconds = t.tracer.seconds(TraceCounter::kNvmeRead);
  s.nvme_write_seconds = t.tracer.seconds(TraceCounter::kNvmeWrite);
  s.optimizer_seconds = t.tracer.seconds(TraceCounter::kOptimizer);
  s.update_stall_seconds = t.tracer.seconds(TraceCounter::kUpdateStall);
  s.bytes_dp = dp_bytes;
  s.dp_seconds = t.tracer.seconds(TraceCounter::kComm);
  s.pipeline_seconds = t.pipe.pp_seconds;
  s.pipeline_wait_seconds = t.pipe.pp_wait_seconds;
  s.bytes_pp = t.pipe.pp_bytes;
  s.bytes_checkpoint_written = t.state.checkpoint_bytes;
  s.weights_file_writes = t.state.weights_writes;
  if (t.model) {
    const Model::ActivationTraffic a = t.model->activation_traffic();
    s.bytes_activations_to_host = a.to_host;
    s.bytes_activations_to_device = a.to_device;
    s.bytes_tp = t.model->tensor_parallel_bytes();
  }
  return s;
}

void OffloadEngine::observe(const ObserveSettings& settings) {
  impl_->tracer.set_spans(settings.trace, settings.max_trace_spans);
  impl_->tracer.set_timing(settings.stream_times);
}

Status OffloadEngine::write_trace(const std::string& path) const {
  const Impl& t = *impl_;
  return t.tracer.write_json(path, "strata offload engine", [&t](int u) {
    return u >= 0 && u < t.M ? t.layout().modules[static_cast<std::size_t>(u)].name : std::to_string(u);
  });
}

}  // namespace strata
