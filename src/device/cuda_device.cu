// The cuda backend: one cudaMalloc'd arena per device, CUDA streams and events,
// cudaMemcpyAsync, a cudaHostAlloc'd pinned pool. Host functions run through
// cudaLaunchHostFunc; their failures are held by the stream and surface at its next
// synchronize(), like a kernel fault.
#include <cuda_runtime.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

#include "device/backends.hpp"
#include "strata/log.hpp"
#include "strata/options.hpp"

namespace strata::detail {
namespace {

Status cuda_status(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return ok_status();
  return device_error(what + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

// cudaEventQuery / cudaStreamQuery answer "not finished yet" with cudaErrorNotReady, and the
// runtime records that as the thread's last error. Left there, the next launcher's
// cudaGetLastError() would report a kernel that started fine as failed, so a poll clears it here.
// Any other result means the work is done (successfully or not: a fault surfaces at the next
// synchronize, which reports it with the stream's name).
bool finished(cudaError_t query_result) {
  if (query_result != cudaErrorNotReady) return true;
  if (cudaPeekAtLastError() == cudaErrorNotReady) cudaGetLastError();
  return false;
}

class CudaDevice;

// What a stream's host functions and events share: the first error since the last synchronize.
struct StreamErrors {
  std::mutex mu;
  Status first;
  void set(Status s) {
    std::lock_guard lock(mu);
    if (first.ok()) first = std::move(s);
  }
  Status take() {
    std::lock_guard lock(mu);
    Status s = std::move(first);
    first = Status();
    return s;
  }
  Status peek() {
    std::lock_guard lock(mu);
    return first;
  }
};

class CudaEvent final : public Event {
 public:
  CudaEvent(int ordinal, cudaEvent_t ev) : ordinal_(ordinal), ev_(ev) {}
  ~CudaEvent() override {
    cudaSetDevice(ordinal_);
    cudaEventDestroy(ev_);
  }
  bool query() override {
    cudaSetDevice(ordinal_);
    return finished(cudaEventQuery(ev_));
  }
  Status synchronize() override {
    cudaSetDevice(ordinal_);
    STRATA_RETURN_IF_ERROR(cuda_status(cudaEventSynchronize(ev_), "event synchronize"));
    std::lock_guard lock(mu_);
    return errors_ ? errors_->peek() : ok_status();
  }
  void set_stream_errors(std::shared_ptr<StreamErrors> e) {
    std::lock_guard lock(mu_);
    errors_ = std::move(e);
  }
  cudaEvent_t handle() const { return ev_; }
  int ordinal() const { return ordinal_; }

 private:
  int ordinal_;
  cudaEvent_t ev_;
  std::mutex mu_;
  std::shared_ptr<StreamErrors> errors_;
};

class CudaStream final : public Stream {
 public:
  CudaStream(CudaDevice* device, int ordinal, std::string name, cudaStream_t s)
      : device_(device), ordinal_(ordinal), name_(std::move(name)), stream_(s), errors_(std::make_shared<StreamErrors>()) {}
  ~CudaStream() override {
    cudaSetDevice(ordinal_);
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  const std::string& name() const override { return name_; }

  Status copy_async(void* dst, const void* src, std::uint64_t bytes, CopyKind kind) override;

  Status memset_async(void* dst, int value, std::uint64_t bytes) override {
    if (bytes == 0) return ok_status();
    cudaSetDevice(ordinal_);
    return cuda_status(cudaMemsetAsync(dst, value, bytes, stream_), "stream '" + name_ + "': memset");
  }

  Status host_fn(std::string label, std::function<Status()> fn) override {
    if (!fn) return invalid_argument("stream '" + name_ + "': host_fn '" + label + "' is empty");
    struct Closure {
      std::string label;
      std::string stream;
      std::function<Status()> fn;
      std::shared_ptr<StreamErrors> errors;
    };
    auto* c = new Closure{std::move(label), name_, std::move(fn), errors_};
    cudaSetDevice(ordinal_);
    cudaError_t err = cudaLaunchHostFunc(
        stream_,
        [](void* p) {
          std::unique_ptr<Closure> c(static_cast<Closure*>(p));
          if (!c->errors->peek().ok()) return;  // skip work after a failure, like the cpu backend
          Status s = c->fn();
          if (!s.ok()) c->errors->set(s.with_context("stream '" + c->stream + "': " + c->label));
        },
        c);
    if (err != cudaSuccess) {
      delete c;
      return cuda_status(err, "stream '" + name_ + "': launching host function");
    }
    return ok_status();
  }

  Status record(Event& event) override {
    auto* ev = dynamic_cast<CudaEvent*>(&event);
    if (ev == nullptr) return invalid_argument("stream '" + name_ + "': event belongs to another backend");
    cudaSetDevice(ordinal_);
    ev->set_stream_errors(errors_);
    return cuda_status(cudaEventRecord(ev->handle(), stream_), "stream '" + name_ + "': event record");
  }
  Status wait(Event& event) override {
    auto* ev = dynamic_cast<CudaEvent*>(&event);
    if (ev == nullptr) return invalid_argument("stream '" + name_ + "': event belongs to another backend");
    cudaSetDevice(ordinal_);
    return cuda_status(cudaStreamWaitEvent(stream_, ev->handle(), 0), "stream '" + name_ + "': event wait");
  }
  Status synchronize() override {
    cudaSetDevice(ordinal_);
    Status s = cuda_status(cudaStreamSynchronize(stream_), "stream '" + name_ + "': synchronize");
    Status held = errors_->take();
    return s.ok() ? held : s;
  }
  bool query() override {
    cudaSetDevice(ordinal_);
    return finished(cudaStreamQuery(stream_));
  }
  void* native_handle() const override { return stream_; }

 private:
  CudaDevice* device_;
  int ordinal_;
  std::string name_;
  cudaStream_t stream_;
  std::shared_ptr<StreamErrors> errors_;
};

class CudaDevice final : public Device {
 public:
  static Result<std::unique_ptr<Device>> create(const DeviceConfig& config) {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
      return unavailable("device 'cuda': no usable GPU (" +
                         std::string(err == cudaSuccess ? "no device found" : cudaGetErrorString(err)) +
                         "); use device 'cpu' to run on the emulated accelerator");
    }
    if (config.ordinal < 0 || config.ordinal >= count) {
      return invalid_argument("device_ordinal " + std::to_string(config.ordinal) + " is out of range: " +
                              std::to_string(count) + " GPU(s) present");
    }
    auto dev = std::unique_ptr<CudaDevice>(new CudaDevice());
    dev->ordinal_ = config.ordinal;
    STRATA_RETURN_IF_ERROR(cuda_status(cudaSetDevice(config.ordinal), "cudaSetDevice"));
    cudaDeviceProp prop{};
    STRATA_RETURN_IF_ERROR(cuda_status(cudaGetDeviceProperties(&prop, config.ordinal), "cudaGetDeviceProperties"));
    std::uint64_t bytes = align_up(config.memory_bytes, config.arena_alignment);
    void* p = nullptr;
    err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return out_of_memory("device 'cuda:" + std::to_string(config.ordinal) + "': cannot reserve " + format_bytes(bytes) +
                           " of device memory (" + cudaGetErrorString(err) + "; the GPU has " +
                           format_bytes(prop.totalGlobalMem) + "): lower device_memory / STRATA_DEVICE_MEMORY");
    }
    dev->raw_allocs_++;
    dev->base_ = p;
    cudaStream_t mover_stream = nullptr;
    STRATA_RETURN_IF_ERROR(cuda_status(cudaStreamCreateWithFlags(&mover_stream, cudaStreamNonBlocking), "stream create"));
    dev->mover_stream_ = mover_stream;
    Arena::Config ac;
    ac.name = "cuda:" + std::to_string(config.ordinal);
    ac.capacity = bytes;
    ac.alignment = config.arena_alignment;
    ac.base = p;
    ac.origin = MemoryOrigin::kDeviceArena;
    CudaDevice* raw = dev.get();
    ac.mover = [raw](std::uint64_t dst, std::uint64_t src, std::uint64_t n) { return raw->move(dst, src, n); };
    STRATA_ASSIGN_OR_RETURN(dev->arena_, Arena::create(std::move(ac)));
    void* host = nullptr;
    std::uint64_t pinned = align_up(config.pinned_bytes, PinnedPool::kIoAlignment);
    err = cudaHostAlloc(&host, pinned, cudaHostAllocPortable);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return out_of_memory("device 'cuda:" + std::to_string(config.ordinal) + "': cannot allocate " +
                           format_bytes(pinned) + " of pinned host memory (" + cudaGetErrorString(err) +
                           "): lower pinned_memory / STRATA_PINNED_MEMORY");
    }
    dev->raw_allocs_++;
    STRATA_ASSIGN_OR_RETURN(dev->pinned_, PinnedPool::adopt(host, pinned, [](void* b, std::uint64_t) { cudaFreeHost(b); }));
    dev->info_.kind = DeviceKind::kCuda;
    dev->info_.ordinal = config.ordinal;
    dev->info_.name = prop.name;
    dev->info_.memory_budget = bytes;
    dev->info_.physical_memory = prop.totalGlobalMem;
    dev->info_.compute_threads = 0;
    dev->info_.copy_engines = prop.asyncEngineCount;
    STRATA_LOG(kInfo, kDevice) << "cuda:" << config.ordinal << " " << prop.name << ": " << format_bytes(bytes)
                               << " arena, " << format_bytes(pinned) << " pinned";
    return std::unique_ptr<Device>(std::move(dev));
  }

  ~CudaDevice() override {
    Status s = synchronize();
    if (!s.ok()) {
      STRATA_LOG(kWarn, kDevice) << info_.name << ": unreported stream error at shutdown: " << s.to_string();
    }
    streams_.clear();
    pinned_.reset();
    arena_.reset();
    cudaSetDevice(ordinal_);
    if (mover_stream_ != nullptr) cudaStreamDestroy(mover_stream_);
    if (base_ != nullptr) cudaFree(base_);
  }

  const DeviceInfo& info() const override { return info_; }
  Arena& memory() override { return *arena_; }
  PinnedPool& pinned() override { return *pinned_; }

  Result<Stream*> create_stream(std::string name) override {
    return streams_.add(info_.name, std::move(name), [this](std::string n) -> Result<std::unique_ptr<CudaStream>> {
      cudaSetDevice(ordinal_);
      cudaStream_t s = nullptr;
      STRATA_RETURN_IF_ERROR(cuda_status(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream create '" + n + "'"));
      return std::make_unique<CudaStream>(this, ordinal_, std::move(n), s);
    });
  }

  Result<std::unique_ptr<Event>> create_event() override {
    cudaSetDevice(ordinal_);
    cudaEvent_t ev = nullptr;
    STRATA_RETURN_IF_ERROR(cuda_status(cudaEventCreate(&ev), "event create"));
    return std::unique_ptr<Event>(new CudaEvent(ordinal_, ev));
  }

  Status synchronize() override { return streams_.synchronize_all(); }

  DeviceStats stats() const override {
    DeviceStats st;
    st.raw_allocs = raw_allocs_.load();
    st.bytes_h2d = bytes_h2d_.load();
    st.bytes_d2h = bytes_d2h_.load();
    st.bytes_d2d = bytes_d2d_.load();
    return st;
  }

  // Compaction move: overlapping ranges are copied in chunks no larger than the distance moved.
  Status move(std::uint64_t dst, std::uint64_t src, std::uint64_t n) {
    cudaSetDevice(ordinal_);
    auto* base = static_cast<std::byte*>(base_);
    std::uint64_t step = src > dst ? src - dst : n;
    for (std::uint64_t done = 0; done < n; done += step) {
      std::uint64_t len = std::min(step, n - done);
      STRATA_RETURN_IF_ERROR(cuda_status(
          cudaMemcpyAsync(base + dst + done, base + src + done, len, cudaMemcpyDeviceToDevice, mover_stream_),
          "arena compaction copy"));
    }
    return cuda_status(cudaStreamSynchronize(mover_stream_), "arena compaction copy");
  }

  std::atomic<std::uint64_t> bytes_h2d_{0}, bytes_d2h_{0}, bytes_d2d_{0};

 private:
  CudaDevice() = default;
  int ordinal_ = 0;
  DeviceInfo info_;
  void* base_ = nullptr;
  cudaStream_t mover_stream_ = nullptr;
  std::unique_ptr<Arena> arena_;
  std::unique_ptr<PinnedPool> pinned_;
  StreamSet<CudaStream> streams_;
  std::atomic<std::uint64_t> raw_allocs_{0};
};

Status CudaStream::copy_async(void* dst, const void* src, std::uint64_t bytes, CopyKind kind) {
  if (bytes == 0) return ok_status();
  cudaMemcpyKind k = cudaMemcpyDefault;
  switch (kind) {
    case CopyKind::kHostToDevice: k = cudaMemcpyHostToDevice; device_->bytes_h2d_ += bytes; break;
    case CopyKind::kDeviceToHost: k = cudaMemcpyDeviceToHost; device_->bytes_d2h_ += bytes; break;
    case CopyKind::kDeviceToDevice: k = cudaMemcpyDeviceToDevice; device_->bytes_d2d_ += bytes; break;
    case CopyKind::kHostToHost: k = cudaMemcpyHostToHost; break;
  }
  cudaSetDevice(ordinal_);
  return cuda_status(cudaMemcpyAsync(dst, src, bytes, k, stream_), "stream '" + name_ + "': copy of " + std::to_string(bytes) + " bytes");
}

}  // namespace

Result<std::unique_ptr<Device>> make_cuda_device(const DeviceConfig& config) { return CudaDevice::create(config); }

int cuda_device_count_impl() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

Result<double> cuda_elapsed_ms(Event& start, Event& end) {
  auto* a = dynamic_cast<CudaEvent*>(&start);
  auto* b = dynamic_cast<CudaEvent*>(&end);
  if (a == nullptr || b == nullptr) return invalid_argument("elapsed_ms: events must both come from the same device backend");
  float ms = 0;
  cudaSetDevice(a->ordinal());
  STRATA_RETURN_IF_ERROR(cuda_status(cudaEventElapsedTime(&ms, a->handle(), b->handle()), "elapsed_ms"));
  return static_cast<double>(ms);
}

}  // namespace strata::detail
