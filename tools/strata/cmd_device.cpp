// strata device: open a device backend with the current tunables and print what it offers.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <span>

#include "cli.hpp"
#include "strata/device.hpp"
#include "strata/options.hpp"

namespace strata::cli {
namespace {

constexpr FlagSpec kFlags[] = {
    {"device", "KIND", "backend: cpu or cuda (default: the 'device' tunable, STRATA_DEVICE)"},
    {"memory", "BYTES", "device memory budget (default: STRATA_DEVICE_MEMORY or 2GiB)"},
    {"json", "", "print JSON"},
    {"help", "", "show this help"},
};

std::string usage() { return "usage: strata device [flags]\n\nflags:\n" + format_flags(kFlags); }

int run_device(std::span<const std::string> argv) {
  auto args = Args::parse(argv, kFlags);
  if (!args.ok()) return usage_error("device", args.status().message(), usage());
  if (args->has("help")) {
    std::fputs(usage().c_str(), stdout);
    return kExitOk;
  }
  if (!args->positionals().empty()) {
    return usage_error("device", "unexpected argument '" + args->positionals()[0] + "'", usage());
  }
  Options options;
  Status s = options.load_env();
  if (!s.ok()) {
    std::fprintf(stderr, "strata device: %s\n", s.to_string().c_str());
    return kExitFailure;
  }
  if (auto d = args->get("device")) {
    s = options.set(Option::kDevice, *d, "--device");
    if (!s.ok()) return usage_error("device", s.message(), usage());
  }
  if (auto m = args->get("memory")) {
    s = options.set(Option::kDeviceMemory, *m, "--memory");
    if (!s.ok()) return usage_error("device", s.message(), usage());
  }
  auto dev = Device::create(DeviceConfig::from_options(options));
  if (!dev.ok()) {
    std::fprintf(stderr, "strata device: %s\n", dev.status().to_string().c_str());
    return kExitFailure;
  }
  const DeviceInfo& info = (*dev)->info();
  nlohmann::json out = {
      {"kind", std::string(to_string(info.kind))},
      {"name", info.name},
      {"ordinal", info.ordinal},
      {"memory_budget_bytes", info.memory_budget},
      {"physical_memory_bytes", info.physical_memory},
      {"compute_threads", info.compute_threads},
      {"copy_engines", info.copy_engines},
      {"pinned_pool_bytes", (*dev)->pinned().stats().capacity},
      {"pinned_pool_locked", (*dev)->pinned().locked()},
      {"cuda_devices", cuda_device_count()},
      {"cpus", (*dev)->cpu_budget().to_string()},
  };
  if (args->has("json")) {
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    std::printf("%s\n  memory budget  %s (of %s)\n  pinned pool    %s%s\n  compute        %d threads per stream\n"
                "  copy engines   %d\n  GPUs visible   %d\n  cpus           %s\n",
                info.name.c_str(), format_bytes(info.memory_budget).c_str(), format_bytes(info.physical_memory).c_str(),
                format_bytes((*dev)->pinned().stats().capacity).c_str(),
                (*dev)->pinned().locked() ? " (locked)" : " (not locked: raise RLIMIT_MEMLOCK)", info.compute_threads,
                info.copy_engines, cuda_device_count(), (*dev)->cpu_budget().to_string().c_str());
  }
  return kExitOk;
}

}  // namespace

STRATA_CLI_COMMAND(device, "open a device backend and print what it offers", run_device);

}  // namespace strata::cli
