// Private: the backend factories behind Device::create.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "strata/device.hpp"

namespace strata::detail {

// `budget`: the cpus its stream workers (compute) and copy engines (host) pin themselves to.
Result<std::unique_ptr<Device>> make_cpu_device(const DeviceConfig& config, const CpuBudget& budget);
// Defined in cuda_device.cu when CUDA is built, else in cuda_unavailable.cpp.
Result<std::unique_ptr<Device>> make_cuda_device(const DeviceConfig& config);
int cuda_device_count_impl();
// elapsed_ms for two cuda events (kInvalidArgument for events of mixed backends).
Result<double> cuda_elapsed_ms(Event& start, Event& end);

// As Stream::host_fn, but on the cpu backend `fn` runs even after an earlier operation of the
// stream failed (the stream keeps its first error; a failure of `fn` is kept only if there was
// none). For a collective of the pass, which every rank must issue whatever its stream
// computed: a failing rank keeps its place in the pass, its collectives run on garbage whose
// results are discarded, and every rank reaches the pass-end agreement on the failure
// (docs/offload.md "Faults"). On cuda it is host_fn: a device fault is not retried.
Status host_fn_after_failure(Stream& stream, std::string label, std::function<Status()> fn);

}  // namespace strata::detail

namespace strata::detail {

// The streams a device owns, shared by both backends: unique names, lifetime of the device,
// and synchronize-all reporting the first error.
template <typename StreamT>
class StreamSet {
 public:
  // `make(name)` builds the stream (a Result<std::unique_ptr<StreamT>>).
  template <typename Make>
  Result<Stream*> add(const std::string& device_name, std::string name, Make make) {
    std::lock_guard lock(mu_);
    for (const auto& s : streams_) {
      if (s->name() == name) return invalid_argument(device_name + ": a stream named '" + name + "' already exists");
    }
    Result<std::unique_ptr<StreamT>> made = make(std::move(name));
    if (!made.ok()) return made.status();
    streams_.push_back(std::move(made).value());
    return static_cast<Stream*>(streams_.back().get());
  }

  Status synchronize_all() {
    std::vector<StreamT*> streams;
    {
      std::lock_guard lock(mu_);
      for (auto& s : streams_) streams.push_back(s.get());
    }
    Status first;
    for (auto* s : streams) {
      Status st = s->synchronize();
      if (first.ok() && !st.ok()) first = st;
    }
    return first;
  }

  void clear() {
    std::lock_guard lock(mu_);
    streams_.clear();
  }

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<StreamT>> streams_;
};

}  // namespace strata::detail
