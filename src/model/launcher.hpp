// Runs kernels in a stream's order without the caller knowing the backend.
//
//   cpu:  the kernel call is wrapped in Stream::host_fn and runs on the stream's worker with a
//         KernelContext{kCpu, cpu_threads = the device's compute_threads};
//   cuda: the kernel call runs now, enqueueing its launches on the stream's native handle, with
//         the launcher's device workspace.
//
// A launcher owns the per-stream KernelState (oneDNN primitives / cuBLASLt plans), so it must
// not be shared between streams. Private to src/model and src/runtime.
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "kernels/kernels.hpp"
#include "strata/device.hpp"

namespace strata::detail {

class KernelLauncher {
 public:
  // `workspace_bytes`: device scratch the cuda kernels need (the largest *_workspace_bytes of the
  // ops this launcher will run); ignored on cpu.
  static Result<std::unique_ptr<KernelLauncher>> create(Device& device, Stream& stream,
                                                        std::uint64_t workspace_bytes) {
    auto l = std::unique_ptr<KernelLauncher>(new KernelLauncher(device, stream));
    const bool cuda = device.kind() == DeviceKind::kCuda;
    l->ctx_.backend = cuda ? kernels::Backend::kCuda : kernels::Backend::kCpu;
    l->ctx_.cpu_threads = device.info().compute_threads;
    l->ctx_.cuda_stream = stream.native_handle();
    STRATA_ASSIGN_OR_RETURN(l->state_, kernels::KernelState::create(l->ctx_.backend));
    l->ctx_.state = l->state_.get();
    if (cuda && workspace_bytes > 0) {
      STRATA_ASSIGN_OR_RETURN(l->workspace_, device.allocate(workspace_bytes, "kernel workspace"));
      l->ctx_.workspace = l->workspace_.data();
      l->ctx_.workspace_bytes = workspace_bytes;
    }
    return l;
  }

  // Enqueues `fn(const KernelContext&) -> Status` in stream order. On cpu `fn` is copied into the
  // stream's queue: it must capture by value (pointers and sizes), never references to locals.
  template <typename Fn>
  Status run(const char* label, Fn&& fn) {
    if (ctx_.backend == kernels::Backend::kCpu) {
      return stream_.host_fn(label, [ctx = ctx_, f = std::forward<Fn>(fn)]() -> Status { return f(ctx); });
    }
    Status s = fn(ctx_);
    if (!s.ok()) return s.with_context(label);
    return s;
  }

  const kernels::KernelContext& context() const { return ctx_; }
  kernels::KernelState& state() { return *state_; }
  bool is_cpu() const { return ctx_.backend == kernels::Backend::kCpu; }
  Device& device() { return device_; }
  Stream& stream() { return stream_; }

 private:
  KernelLauncher(Device& device, Stream& stream) : device_(device), stream_(stream) {}
  Device& device_;
  Stream& stream_;
  kernels::KernelContext ctx_;
  std::unique_ptr<kernels::KernelState> state_;
  ArenaBuffer workspace_;
};

}  // namespace strata::detail
