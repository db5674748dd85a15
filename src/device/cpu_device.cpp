// The cpu backend: an emulated accelerator that runs real work on real threads.
//
// Memory: one anonymous MAP_NORESERVE mapping of the budget (pages appear only when touched),
// carved by the device Arena; a pinned pool from PinnedPool::create_host.
// Streams: one worker thread each, running its queue in order. The worker limits OpenMP to
// `compute_threads` and pins itself to the budget's compute cpus before its team exists (team
// threads inherit the mask when libgomp creates them), so "device compute" cannot silently take
// the cores host work (copies, I/O, CPU Adam) was given. Copies between host and device go to
// one of two copy-engine threads (H2D, D2H), pinned to the host cpus, as a GPU's DMA engines
// do: copies in one direction serialise, copies in opposite directions overlap each other and
// compute.
// CPU time: every stream worker and its team join the device's compute account, the copy
// engines its copy account (DeviceStats). libgomp replaces pool threads when a team shrinks
// and grows again, so the worker re-joins its team after host functions (at most every 10 ms);
// a replaced thread is counted from its start.
#include <omp.h>
#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "device/backends.hpp"
#include "strata/log.hpp"
#include "strata/options.hpp"

namespace strata::detail {
namespace {

using Clock = std::chrono::steady_clock;

class CpuDevice;

// Runs submitted jobs one at a time on its own thread; submit() blocks until the job ran.
class CopyEngine {
 public:
  CopyEngine(std::string name, const CpuBudget& budget, CpuAccount account)
      : name_(std::move(name)), budget_(budget), account_(std::move(account)), thread_([this] { loop(); }) {
    wait_started();
  }
  ~CopyEngine() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  void run(const std::function<void()>& job) {
    Job j{&job};
    {
      std::lock_guard lock(mu_);
      queue_.push_back(&j);
    }
    cv_.notify_all();
    std::unique_lock lock(mu_);
    done_cv_.wait(lock, [&] { return j.done; });
  }

 private:
  struct Job {
    const std::function<void()>* fn;
    bool done = false;
  };
  // The constructor returns once the thread is named, pinned and accounted, so what a device
  // reports about its threads holds as soon as it exists.
  void wait_started() {
    std::unique_lock lock(mu_);
    done_cv_.wait(lock, [&] { return started_; });
  }
  void loop() {
    name_current_thread("copy." + name_);
    if (Status s = budget_.pin_host(); !s.ok()) {
      STRATA_LOG(kWarn, kDevice) << "copy engine '" << name_ << "': " << s.message();
    }
    account_.join(/*since_start=*/true);
    std::unique_lock lock(mu_);
    started_ = true;
    done_cv_.notify_all();
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      Job* j = queue_.front();
      queue_.pop_front();
      lock.unlock();
      (*j->fn)();
      lock.lock();
      j->done = true;
      done_cv_.notify_all();
    }
  }

  std::string name_;
  const CpuBudget budget_;
  const CpuAccount account_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable done_cv_;
  std::deque<Job*> queue_;
  bool started_ = false;
  bool stop_ = false;
  std::thread thread_;
};

class CpuEvent final : public Event {
 public:
  bool query() override {
    std::lock_guard lock(mu_);
    return completed_ >= recorded_;
  }
  Status synchronize() override {
    std::unique_lock lock(mu_);
    std::uint64_t target = recorded_;
    cv_.wait(lock, [&] { return completed_ >= target; });
    return status_;
  }

  // Called at record() time on the enqueuing thread: the sequence number to complete.
  std::uint64_t arm() {
    std::lock_guard lock(mu_);
    return ++recorded_;
  }
  std::uint64_t target() {
    std::lock_guard lock(mu_);
    return recorded_;
  }
  void complete(std::uint64_t seq, Status status) {
    // Notify under the lock: a waiter may destroy the event as soon as it sees completion.
    std::lock_guard lock(mu_);
    if (seq > completed_) {
      completed_ = seq;
      status_ = std::move(status);
      time_ = Clock::now();
    }
    cv_.notify_all();
  }
  void wait_for(std::uint64_t seq) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return completed_ >= seq; });
  }
  Clock::time_point time() {
    std::lock_guard lock(mu_);
    return time_;
  }
  bool done() { return query(); }
  bool ever_recorded() {
    std::lock_guard lock(mu_);
    return recorded_ > 0;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::uint64_t recorded_ = 0;
  std::uint64_t completed_ = 0;
  Status status_;
  Clock::time_point time_{};
};

class CpuStream final : public Stream {
 public:
  CpuStream(CpuDevice* device, std::string name, int compute_threads, const CpuBudget& budget, CpuAccount account)
      : device_(device),
        name_(std::move(name)),
        compute_threads_(compute_threads),
        budget_(budget),
        account_(std::move(account)),
        thread_([this] { loop(); }) {
    // Returns once the thread is named, pinned and accounted (as the copy engines do).
    std::unique_lock lock(mu_);
    idle_cv_.wait(lock, [&] { return started_; });
  }

  ~CpuStream() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  const std::string& name() const override { return name_; }
  Status copy_async(void* dst, const void* src, std::uint64_t bytes, CopyKind kind) override;
  Status memset_async(void* dst, int value, std::uint64_t bytes) override;
  Status host_fn(std::string label, std::function<Status()> fn) override {
    return enqueue_host_fn(std::move(label), std::move(fn), /*always_run=*/false);
  }
  // detail::host_fn_after_failure (backends.hpp).
  Status host_fn_after_failure(std::string label, std::function<Status()> fn) {
    return enqueue_host_fn(std::move(label), std::move(fn), /*always_run=*/true);
  }
  Status record(Event& event) override {
    auto* ev = dynamic_cast<CpuEvent*>(&event);
    if (ev == nullptr) return invalid_argument("stream '" + name_ + "': event belongs to another backend");
    std::uint64_t seq = ev->arm();
    // Records run even after a failure so waiters are released; they carry the failure.
    enqueue(Op{"record", [this, ev, seq]() -> Status {
                 ev->complete(seq, error_snapshot());
                 return ok_status();
               },
               true});
    return ok_status();
  }
  Status wait(Event& event) override {
    auto* ev = dynamic_cast<CpuEvent*>(&event);
    if (ev == nullptr) return invalid_argument("stream '" + name_ + "': event belongs to another backend");
    std::uint64_t seq = ev->target();
    if (seq == 0) return ok_status();  // never recorded: nothing to wait for
    enqueue(Op{"wait", [ev, seq]() -> Status {
                 ev->wait_for(seq);
                 return ok_status();
               },
               true});
    return ok_status();
  }
  Status synchronize() override {
    std::unique_lock lock(mu_);
    idle_cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
    Status s = std::move(error_);
    error_ = Status();
    return s;
  }
  bool query() override {
    std::lock_guard lock(mu_);
    return queue_.empty() && !busy_;
  }
  void* native_handle() const override { return nullptr; }

 private:
  struct Op {
    std::string label;
    std::function<Status()> fn;
    bool always_run;         // event records, waits and host_fn_after_failure run even after a failure
    bool uses_team = false;  // a host function: may have run OpenMP regions
  };

  Status enqueue_host_fn(std::string label, std::function<Status()> fn, bool always_run);

  void enqueue(Op op) {
    {
      std::lock_guard lock(mu_);
      queue_.push_back(std::move(op));
    }
    cv_.notify_all();
  }

  // Pool threads libgomp created since the last join (a team re-formed after a smaller one) join
  // the compute account, from their start. At most every 10 ms: a parallel region per host
  // function would cost more than the accounting is worth on small kernels.
  void rejoin_team() {
    if (compute_threads_ <= 1) return;
    const auto now = Clock::now();
    if (now - last_team_join_ < std::chrono::milliseconds(10)) return;
    last_team_join_ = now;
    account_.join_team(compute_threads_);
  }

  Status error_snapshot() {
    std::lock_guard lock(mu_);
    return error_;
  }

  void loop() {
    name_current_thread("stream:" + name_);
    if (Status s = budget_.pin_compute(); !s.ok()) {
      STRATA_LOG(kWarn, kDevice) << "stream '" << name_ << "': " << s.message();
    }
    omp_set_num_threads(compute_threads_);  // the ICV is per thread: this bounds the stream's kernels
    account_.join(/*since_start=*/true);
    account_.join_team(compute_threads_);
    std::unique_lock lock(mu_);
    started_ = true;
    idle_cv_.notify_all();
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      Op op = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      bool failed = !error_.ok();
      lock.unlock();
      if (!failed || op.always_run) {
        Status s = op.fn();
        if (op.uses_team) rejoin_team();
        if (!s.ok()) {
          lock.lock();
          if (error_.ok()) error_ = s.with_context("stream '" + name_ + "': " + op.label);
          lock.unlock();
        }
      } else {
        STRATA_LOG(kDebug, kDevice) << "stream '" << name_ << "': skipping '" << op.label
                                    << "' after an earlier failure";
      }
      lock.lock();
      busy_ = false;
      if (queue_.empty()) idle_cv_.notify_all();
    }
  }

  CpuDevice* device_;
  std::string name_;
  int compute_threads_;
  const CpuBudget budget_;
  const CpuAccount account_;
  Clock::time_point last_team_join_{};
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<Op> queue_;
  bool busy_ = false;
  bool started_ = false;
  bool stop_ = false;
  Status error_;
  std::thread thread_;
};

class CpuDevice final : public Device {
 public:
  static Result<std::unique_ptr<Device>> create(const DeviceConfig& config, const CpuBudget& budget) {
    auto dev = std::unique_ptr<CpuDevice>(new CpuDevice());
    dev->config_ = config;
    dev->budget_ = budget;
    const int threads = std::max(1, budget.compute_threads);
    std::uint64_t bytes = align_up(config.memory_bytes, config.arena_alignment);
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      return out_of_memory("device 'cpu:" + std::to_string(config.ordinal) + "': cannot map " + format_bytes(bytes) +
                           " of device memory: " + std::strerror(errno) + " (lower device_memory / STRATA_DEVICE_MEMORY)");
    }
    dev->raw_allocs_.fetch_add(1);
    dev->base_ = p;
    dev->bytes_ = bytes;
    Arena::Config ac;
    ac.name = "cpu:" + std::to_string(config.ordinal);
    ac.capacity = bytes;
    ac.alignment = config.arena_alignment;
    ac.base = p;
    ac.origin = MemoryOrigin::kDeviceArena;
    STRATA_ASSIGN_OR_RETURN(dev->arena_, Arena::create(std::move(ac)));
    STRATA_ASSIGN_OR_RETURN(dev->pinned_, PinnedPool::create_host(config.pinned_bytes));
    dev->raw_allocs_.fetch_add(1);
    dev->info_.kind = DeviceKind::kCpu;
    dev->info_.ordinal = config.ordinal;
    dev->info_.name = "cpu:" + std::to_string(config.ordinal) + " (emulated accelerator)";
    dev->info_.memory_budget = bytes;
    dev->info_.physical_memory = static_cast<std::uint64_t>(::sysconf(_SC_PHYS_PAGES)) *
                                 static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
    dev->info_.compute_threads = threads;
    dev->info_.copy_engines = 2;
    dev->h2d_ = std::make_unique<CopyEngine>("h2d", budget, dev->copy_account_);
    dev->d2h_ = std::make_unique<CopyEngine>("d2h", budget, dev->copy_account_);
    STRATA_LOG(kInfo, kDevice) << dev->info_.name << ": " << format_bytes(bytes) << " device memory, "
                               << format_bytes(config.pinned_bytes) << " pinned, " << threads
                               << " compute threads per stream; " << budget.to_string();
    if (budget.shared()) {
      STRATA_LOG(kInfo, kDevice) << dev->info_.name << ": device compute (cpus " << budget.compute.to_string()
                                 << ") and host work (cpus " << budget.host.to_string()
                                 << ") share cpus, so their overlap here is time slicing, not parallelism";
    }
    return std::unique_ptr<Device>(std::move(dev));
  }

  ~CpuDevice() override {
    Status s = synchronize();
    if (!s.ok()) {
      STRATA_LOG(kWarn, kDevice) << info_.name << ": unreported stream error at shutdown: " << s.to_string();
    }
    streams_.clear();
    h2d_.reset();
    d2h_.reset();
    pinned_.reset();
    arena_.reset();
    if (base_ != nullptr) ::munmap(base_, bytes_);
  }

  const DeviceInfo& info() const override { return info_; }
  Arena& memory() override { return *arena_; }
  PinnedPool& pinned() override { return *pinned_; }

  Result<Stream*> create_stream(std::string name) override {
    return streams_.add(info_.name, std::move(name), [this](std::string n) -> Result<std::unique_ptr<CpuStream>> {
      return std::make_unique<CpuStream>(this, std::move(n), info_.compute_threads, budget_, compute_account_);
    });
  }

  Result<std::unique_ptr<Event>> create_event() override { return std::unique_ptr<Event>(new CpuEvent()); }

  Status synchronize() override { return streams_.synchronize_all(); }

  DeviceStats stats() const override {
    DeviceStats st;
    st.raw_allocs = raw_allocs_.load();
    st.raw_frees = 0;
    st.bytes_h2d = bytes_h2d_.load();
    st.bytes_d2h = bytes_d2h_.load();
    st.bytes_d2d = bytes_d2d_.load();
    st.host_fns = host_fns_.load();
    st.compute_cpu_seconds = compute_account_.seconds();
    st.copy_cpu_seconds = copy_account_.seconds();
    return st;
  }

  bool in_device(const void* p, std::uint64_t n) const {
    auto* b = static_cast<const std::byte*>(base_);
    auto* q = static_cast<const std::byte*>(p);
    return q >= b && q + n <= b + bytes_;
  }

  CopyEngine& h2d() { return *h2d_; }
  CopyEngine& d2h() { return *d2h_; }
  std::atomic<std::uint64_t> bytes_h2d_{0}, bytes_d2h_{0}, bytes_d2d_{0}, host_fns_{0};

 private:
  CpuDevice() = default;
  DeviceConfig config_;
  CpuBudget budget_;
  CpuAccount compute_account_;  // stream workers and their OpenMP teams
  CpuAccount copy_account_;     // the copy engines
  DeviceInfo info_;
  void* base_ = nullptr;
  std::uint64_t bytes_ = 0;
  std::unique_ptr<Arena> arena_;
  std::unique_ptr<PinnedPool> pinned_;
  std::unique_ptr<CopyEngine> h2d_, d2h_;
  StreamSet<CpuStream> streams_;
  std::atomic<std::uint64_t> raw_allocs_{0};
};

std::string_view copy_name(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice: return "host-to-device";
    case CopyKind::kDeviceToHost: return "device-to-host";
    case CopyKind::kDeviceToDevice: return "device-to-device";
    case CopyKind::kHostToHost: return "host-to-host";
  }
  return "copy";
}

Status CpuStream::copy_async(void* dst, const void* src, std::uint64_t bytes, CopyKind kind) {
  if (bytes == 0) return ok_status();
  if (dst == nullptr || src == nullptr) {
    return invalid_argument("stream '" + name_ + "': " + std::string(copy_name(kind)) + " copy with a null pointer");
  }
  const bool dst_dev = device_->in_device(dst, bytes);
  const bool src_dev = device_->in_device(src, bytes);
  const bool want_dst_dev = kind == CopyKind::kHostToDevice || kind == CopyKind::kDeviceToDevice;
  const bool want_src_dev = kind == CopyKind::kDeviceToHost || kind == CopyKind::kDeviceToDevice;
  if (dst_dev != want_dst_dev || src_dev != want_src_dev) {
    return invalid_argument("stream '" + name_ + "': " + std::string(copy_name(kind)) + " copy of " +
                            std::to_string(bytes) + " bytes: destination is " + (dst_dev ? "" : "not ") +
                            "device memory and source is " + (src_dev ? "" : "not ") + "device memory");
  }
  std::string label = std::string(copy_name(kind)) + " copy (" + format_bytes(bytes) + ")";
  CpuDevice* dev = device_;
  enqueue(Op{std::move(label), [dev, dst, src, bytes, kind]() -> Status {
               auto job = [&] { std::memcpy(dst, src, bytes); };
               switch (kind) {
                 case CopyKind::kHostToDevice:
                   dev->h2d().run(job);
                   dev->bytes_h2d_ += bytes;
                   break;
                 case CopyKind::kDeviceToHost:
                   dev->d2h().run(job);
                   dev->bytes_d2h_ += bytes;
                   break;
                 case CopyKind::kDeviceToDevice:
                   std::memmove(dst, src, bytes);
                   dev->bytes_d2d_ += bytes;
                   break;
                 case CopyKind::kHostToHost:
                   std::memmove(dst, src, bytes);
                   break;
               }
               return ok_status();
             },
             false});
  return ok_status();
}

Status CpuStream::enqueue_host_fn(std::string label, std::function<Status()> fn, bool always_run) {
  if (!fn) return invalid_argument("stream '" + name_ + "': host_fn '" + label + "' is empty");
  CpuDevice* dev = device_;
  enqueue(Op{std::move(label),
             [dev, fn = std::move(fn)]() -> Status {
               dev->host_fns_.fetch_add(1, std::memory_order_relaxed);
               return fn();
             },
             always_run, true});
  return ok_status();
}

Status CpuStream::memset_async(void* dst, int value, std::uint64_t bytes) {
  if (bytes == 0) return ok_status();
  if (!device_->in_device(dst, bytes)) {
    return invalid_argument("stream '" + name_ + "': memset of " + std::to_string(bytes) +
                            " bytes outside device memory");
  }
  enqueue(Op{"memset", [dst, value, bytes]() -> Status {
               std::memset(dst, value, bytes);
               return ok_status();
             },
             false});
  return ok_status();
}

}  // namespace

Status host_fn_after_failure(Stream& stream, std::string label, std::function<Status()> fn) {
  if (auto* cpu = dynamic_cast<CpuStream*>(&stream))
    return cpu->host_fn_after_failure(std::move(label), std::move(fn));
  return stream.host_fn(std::move(label), std::move(fn));
}

Result<std::unique_ptr<Device>> make_cpu_device(const DeviceConfig& config, const CpuBudget& budget) {
  return CpuDevice::create(config, budget);
}

}  // namespace strata::detail

namespace strata {

Result<double> elapsed_ms(Event& start, Event& end) {
  auto* a = dynamic_cast<detail::CpuEvent*>(&start);
  auto* b = dynamic_cast<detail::CpuEvent*>(&end);
  if (a == nullptr || b == nullptr) return detail::cuda_elapsed_ms(start, end);
  if (!a->ever_recorded() || !b->ever_recorded()) return failed_precondition("elapsed_ms: an event was never recorded");
  if (!a->done() || !b->done()) return failed_precondition("elapsed_ms: an event has not completed yet");
  return std::chrono::duration<double, std::milli>(b->time() - a->time()).count();
}

}  // namespace strata
