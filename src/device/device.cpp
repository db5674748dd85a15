#include "device/backends.hpp"
#include "strata/device.hpp"
#include "strata/options.hpp"

namespace strata {

std::string_view to_string(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kCpu: return "cpu";
    case DeviceKind::kCuda: return "cuda";
  }
  return "unknown";
}

Result<DeviceKind> parse_device_kind(std::string_view text) {
  if (text == "cpu") return DeviceKind::kCpu;
  if (text == "cuda") return DeviceKind::kCuda;
  return invalid_argument("device '" + std::string(text) + "' is not one of: cpu, cuda");
}

DeviceConfig DeviceConfig::from_options(const Options& options) {
  DeviceConfig c;
  auto kind = parse_device_kind(options.get_string(Option::kDevice));
  c.kind = kind.ok() ? *kind : DeviceKind::kCpu;  // Options validated the value already
  c.ordinal = static_cast<int>(options.get_int(Option::kDeviceOrdinal));
  c.memory_bytes = options.get_bytes(Option::kDeviceMemory);
  c.pinned_bytes = options.get_bytes(Option::kPinnedMemory);
  c.compute_threads = static_cast<int>(options.get_int(Option::kComputeThreads));
  c.arena_alignment = options.get_bytes(Option::kArenaAlignment);
  c.cpu_affinity = options.get_bool(Option::kCpuAffinity);
  c.compute_cpus = options.get_string(Option::kComputeCpus);
  c.host_cpus = options.get_string(Option::kHostCpus);
  c.host_threads = static_cast<int>(options.get_int(Option::kHostThreads));
  return c;
}

Result<std::unique_ptr<Device>> Device::create(const DeviceConfig& config) {
  if (config.arena_alignment < 16 || (config.arena_alignment & (config.arena_alignment - 1)) != 0) {
    return invalid_argument("arena_alignment " + std::to_string(config.arena_alignment) +
                            " is not a power of two >= 16");
  }
  if (config.memory_bytes < (1u << 20)) {
    return invalid_argument("device_memory " + format_bytes(config.memory_bytes) + " is below the 1 MiB minimum");
  }
  CpuBudgetConfig bc;
  bc.affinity = config.cpu_affinity;
  bc.compute_cpus = config.compute_cpus;
  bc.host_cpus = config.host_cpus;
  bc.compute_threads = config.compute_threads;
  bc.host_threads = config.host_threads;
  STRATA_ASSIGN_OR_RETURN(CpuBudget budget, CpuBudget::for_process(bc, config.kind == DeviceKind::kCpu));
  Result<std::unique_ptr<Device>> dev = invalid_argument("unknown device kind");
  switch (config.kind) {
    case DeviceKind::kCpu:
      dev = detail::make_cpu_device(config, budget);
      break;
    case DeviceKind::kCuda:
      dev = detail::make_cuda_device(config);
      break;
  }
  if (dev.ok()) (*dev)->cpu_budget_ = std::move(budget);
  return dev;
}

Result<ArenaBuffer> Device::allocate(std::uint64_t bytes, std::string_view tag) {
  STRATA_ASSIGN_OR_RETURN(ArenaHandle h, memory().allocate(bytes, Lifetime::kFixed, tag));
  return ArenaBuffer(&memory(), h);
}

Status Device::compact() {
  STRATA_RETURN_IF_ERROR(synchronize());
  return memory().compact();
}

int cuda_device_count() { return detail::cuda_device_count_impl(); }

}  // namespace strata
