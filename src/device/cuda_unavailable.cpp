// The cuda backend's entry points in a build without CUDA: a clear kUnavailable.
#include "strata/build_config.hpp"

#if !STRATA_HAVE_CUDA
#include "device/backends.hpp"

namespace strata::detail {

Result<std::unique_ptr<Device>> make_cuda_device(const DeviceConfig&) {
  return unavailable("device 'cuda': this build of Strata has no CUDA backend (configure with "
                     "-DSTRATA_ENABLE_CUDA=ON and an nvcc on the PATH, or use device 'cpu')");
}

int cuda_device_count_impl() { return 0; }

Result<double> cuda_elapsed_ms(Event&, Event&) {
  return invalid_argument("elapsed_ms: events must both come from the same device backend");
}

}  // namespace strata::detail
#endif
