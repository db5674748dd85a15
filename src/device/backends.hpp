// Private: the backend factories behind Device::create.
#pragma once

#include <memory>

#include "strata/device.hpp"

namespace strata::detail {

Result<std::unique_ptr<Device>> make_cpu_device(const DeviceConfig& config);
// Defined in cuda_device.cu when CUDA is built, else in cuda_unavailable.cpp.
Result<std::unique_ptr<Device>> make_cuda_device(const DeviceConfig& config);
int cuda_device_count_impl();
// elapsed_ms for two cuda events (kInvalidArgument for events of mixed backends).
Result<double> cuda_elapsed_ms(Event& start, Event& end);

}  // namespace strata::detail

namespace strata {
// Half the hardware threads, at least 1: the default share of the cores for device compute.
int default_compute_threads();
}  // namespace strata

namespace strata::detail {

}  // namespace strata::detail
