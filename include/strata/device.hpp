// The device layer: everything above it talks to a Device, never to CUDA or to threads directly.
//
// A Device owns (1) a fixed memory budget, reserved from the backend once at creation and
// carved by an Arena (so a training step never reaches the backend's raw allocator), (2) a
// PinnedPool of page-locked host memory, (3) in-order Streams and (4) Events.
//
// Backends:
//   cpu  - an emulated accelerator: its memory is a separate mapping, each stream is a worker
//          thread running its queue in order, host<->device copies run on copy-engine threads
//          (one per direction, like a GPU's DMA engines), and device compute on a stream uses
//          `compute_threads` OpenMP threads, kept apart from host-side work: stream workers
//          (and their OpenMP teams) pin themselves to the budget's compute cpus, copy engines
//          to its host cpus (cpu_budget.hpp).
//   cuda - one cudaMalloc'd arena per device, CUDA streams and events, cudaMemcpyAsync from
//          pinned memory, cudaHostAlloc'd pinned pool.
//
// Ordering: work enqueued on one stream runs in enqueue order; work on different streams may
// run concurrently and is ordered only through events (record on one, wait on another).
// Errors: a failure inside enqueued work (a host function returning an error, a failed copy, a
// kernel fault) is held by the stream; later work on that stream is skipped (reported as
// kCancelled in the log), and the first error surfaces at the stream's next synchronize(), or
// at synchronize() of an event recorded after it. After it is reported the stream is usable
// again.
// Thread safety: Device, Stream and Event methods may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "strata/alloc.hpp"
#include "strata/cpu_budget.hpp"
#include "strata/status.hpp"

namespace strata {

class Options;

enum class DeviceKind : std::uint8_t { kCpu, kCuda };
std::string_view to_string(DeviceKind kind);
Result<DeviceKind> parse_device_kind(std::string_view text);

enum class CopyKind : std::uint8_t { kHostToDevice, kDeviceToHost, kDeviceToDevice, kHostToHost };

struct DeviceConfig {
  DeviceKind kind = DeviceKind::kCpu;
  int ordinal = 0;
  std::uint64_t memory_bytes = 2ull << 30;   // the arena budget
  std::uint64_t pinned_bytes = 512ull << 20; // the pinned pool
  int compute_threads = 0;                   // cpu backend; 0 = one per compute cpu
  std::uint64_t arena_alignment = 256;
  // The process's cpu split (cpu_budget.hpp): pinning on or off, the compute and host cpus
  // ("auto" or a cpu list) and the host optimizer's threads (0 = one per host cpu).
  bool cpu_affinity = true;
  std::string compute_cpus = "auto";
  std::string host_cpus = "auto";
  int host_threads = 0;

  // From the tunables (device, device_ordinal, device_memory, pinned_memory, compute_threads,
  // arena_alignment, cpu_affinity, compute_cpus, host_cpus, host_threads).
  static DeviceConfig from_options(const Options& options);
};

struct DeviceInfo {
  DeviceKind kind = DeviceKind::kCpu;
  int ordinal = 0;
  std::string name;                     // "cpu:0 (emulated)", "NVIDIA H100 80GB HBM3"
  std::uint64_t memory_budget = 0;      // bytes in the arena
  std::uint64_t physical_memory = 0;    // what the hardware has in total
  int compute_threads = 0;              // cpu backend: per stream
  int copy_engines = 0;
};

struct DeviceStats {
  std::uint64_t raw_allocs = 0;   // calls into the backend's allocator (cudaMalloc / mmap)
  std::uint64_t raw_frees = 0;
  std::uint64_t bytes_h2d = 0;
  std::uint64_t bytes_d2h = 0;
  std::uint64_t bytes_d2d = 0;
  std::uint64_t host_fns = 0;     // host functions (cpu kernels) run on streams
  // cpu backend: CPU seconds (thread clocks) of the stream workers with their OpenMP teams, and
  // of the two copy engines. 0 on cuda, where compute runs on SMs and copies on DMA engines.
  double compute_cpu_seconds = 0.0;
  double copy_cpu_seconds = 0.0;
};

class Event {
 public:
  virtual ~Event() = default;
  // True when the last recorded work has completed (or the event was never recorded).
  virtual bool query() = 0;
  // Blocks until the last recorded work completed; returns the error of the stream it was
  // recorded on if that work failed.
  virtual Status synchronize() = 0;
};

// Milliseconds between two completed events recorded on the same device.
Result<double> elapsed_ms(Event& start, Event& end);

class Stream {
 public:
  virtual ~Stream() = default;
  virtual const std::string& name() const = 0;

  // Asynchronous copy. For host<->device copies the host side should be pinned memory from the
  // device's pool; pageable memory works but may serialise with the host. Both ranges must stay
  // valid until the copy completes (synchronize, or an event recorded after it).
  virtual Status copy_async(void* dst, const void* src, std::uint64_t bytes, CopyKind kind) = 0;
  virtual Status memset_async(void* dst, int value, std::uint64_t bytes) = 0;

  // Runs `fn` in stream order on the host (the cpu backend's kernels run this way, on the
  // stream's worker with its compute threads; on cuda it is cudaLaunchHostFunc and must not
  // call CUDA). A non-OK return fails the stream with that status, prefixed by `label`.
  virtual Status host_fn(std::string label, std::function<Status()> fn) = 0;

  virtual Status record(Event& event) = 0;
  // Later work on this stream waits for the work `event` last recorded (at the time of this call).
  virtual Status wait(Event& event) = 0;

  // Blocks until all enqueued work completed; returns the first error since the last synchronize.
  virtual Status synchronize() = 0;
  // True when all enqueued work has completed.
  virtual bool query() = 0;

  // cudaStream_t for cuda; nullptr for cpu. For kernel launchers in kernels/ only.
  virtual void* native_handle() const = 0;
};

class Device {
 public:
  static Result<std::unique_ptr<Device>> create(const DeviceConfig& config);
  virtual ~Device() = default;

  virtual const DeviceInfo& info() const = 0;
  DeviceKind kind() const { return info().kind; }

  // The arena over the whole budget (plan regions on it, allocate dynamic blocks).
  virtual Arena& memory() = 0;
  virtual PinnedPool& pinned() = 0;

  // A fixed dynamic block of device memory, freed on destruction.
  Result<ArenaBuffer> allocate(std::uint64_t bytes, std::string_view tag);

  // Streams live as long as the device; the returned pointer is never null on success.
  virtual Result<Stream*> create_stream(std::string name) = 0;
  virtual Result<std::unique_ptr<Event>> create_event() = 0;

  // Waits for every stream; returns the first error any of them held.
  virtual Status synchronize() = 0;
  // synchronize(), then compact the arena.
  Status compact();

  virtual DeviceStats stats() const = 0;

  // The split of the process's cpus between this device's compute (the cpu backend's stream
  // workers; nothing on cuda) and host work, made by create() from the config. The engines
  // above the device take their host thread counts and affinity from it.
  const CpuBudget& cpu_budget() const { return cpu_budget_; }

 private:
  CpuBudget cpu_budget_;
};

// Number of usable GPUs (0 without CUDA in the build or without a driver/device).
int cuda_device_count();

}  // namespace strata
