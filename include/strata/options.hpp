// Tunables: one table of (name, kind, default, description). Every tunable can be set from
// the environment as STRATA_<NAME> (upper case) and from the config file under "strata".
// Precedence, lowest first: table default < config file < environment < explicit set() (CLI).
// An Options object is plain data owned by whoever runs (an Engine, a CLI command); there is no
// process-global copy.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/status.hpp"

namespace strata {

enum class OptionKind : std::uint8_t { kInt, kBytes, kBool, kFloat, kString };

enum class Option : std::uint16_t {
  kDevice = 0,      // device backend: cpu | cuda
  kDeviceOrdinal,   // which accelerator (cuda) / which emulated device (cpu)
  kDeviceMemory,    // bytes of device memory the runtime may use (the arena budget)
  kPinnedMemory,    // bytes of pinned host memory in the pinned pool
  kComputeThreads,  // cpu backend: threads per stream for device compute (0 = auto)
  kHostThreads,     // threads for host-side work such as CPU Adam (0 = auto)
  kCpuAffinity,     // pin compute and host threads to their cpus (cpu_budget.hpp)
  kComputeCpus,     // cpus for device compute on the cpu backend: auto | a cpu list
  kHostCpus,        // cpus for host work (copies, I/O, CPU Adam): auto | a cpu list
  kArenaAlignment,  // alignment of every device arena block, bytes (power of two)
  kLogLevel,        // error | warn | info | debug | trace
  kLogSubsys,       // all | ALLOC,NVME,... | ^ALLOC,...
  kDtypeIsa,        // dtype conversion path: auto | scalar | avx2 | avx512
  kAdamIsa,         // CPU optimizer code path: auto | avx512 | avx2 | scalar
  kCommTimeout,     // seconds a collective or send/recv may take before it fails
  kOffloadPrefetchModules,  // offload: modules whose parameters are fetched ahead of the one running
  kOffloadGradients,        // offload: where gradients wait for an off-device optimizer (cpu | nvme)
  kTensorParallelSize,      // ranks each model is split over under mpirun (1 = no tensor parallel)
  kDelayedUpdate,           // offload: one-step delayed parameter update (DPU)
  kDelayedUpdateWarmup,     // offload: steps whose update is not delayed before DPU starts
  kPipelineParallelSize,    // pipeline stages (processes) per pipeline under mpirun
  kPipelineSchedule,        // pipeline schedule: gpipe | 1f1b
  kSequenceParallel,        // tensor parallel: split the residual stream's tokens over the group
  kPipelineVirtualStages,   // pipeline parallel: module chunks per process (interleaved 1F1B)
  kCount
};

struct OptionDesc {
  Option id;
  std::string_view name;  // config key under "strata"; env var is STRATA_ + upper(name)
  OptionKind kind;
  std::string_view default_value;
  std::string_view description;
};

// The table, indexed by Option.
std::span<const OptionDesc> option_table();
const OptionDesc& describe(Option id);

// "1GiB", "512MiB", "64k", "4096", "1.5G" -> bytes. Binary units (k = KiB). Errors name the text.
Result<std::uint64_t> parse_bytes(std::string_view text);
std::string format_bytes(std::uint64_t bytes);

class Options {
 public:
  Options();  // every option at its table default

  // Validates `value` against the option's kind; `source` (e.g. "STRATA_DEVICE_MEMORY" or
  // "strata.device_memory") is named in the error.
  Status set(Option id, std::string_view value, std::string_view source);
  Status set(std::string_view name, std::string_view value, std::string_view source);

  // Applies STRATA_<NAME> for every option present in the environment.
  Status load_env();

  std::int64_t get_int(Option id) const;
  std::uint64_t get_bytes(Option id) const;
  bool get_bool(Option id) const;
  double get_float(Option id) const;
  const std::string& get_string(Option id) const;

  // Where the current value came from ("default", "STRATA_X", "config strata.x", "--flag").
  const std::string& source(Option id) const;

  static std::string env_name(const OptionDesc& desc);
  // The option whose config name is `name`, or kCount; used for did-you-mean errors.
  static Option find(std::string_view name);

 private:
  struct Value {
    std::string text;
    std::int64_t i = 0;
    double f = 0.0;
    std::string source;
  };
  std::vector<Value> values_;
};

}  // namespace strata
