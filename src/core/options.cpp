#include "strata/options.hpp"

#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>

#include "strata/cpu_budget.hpp"
#include "strata/dtype.hpp"
#include "strata/log.hpp"

namespace strata {
namespace {

constexpr std::array<OptionDesc, static_cast<size_t>(Option::kCount)> kTable = {{
    {Option::kDevice, "device", OptionKind::kString, "cpu",
     "device backend: cpu (emulated accelerator) or cuda"},
    {Option::kDeviceOrdinal, "device_ordinal", OptionKind::kInt, "0", "which device to open"},
    {Option::kDeviceMemory, "device_memory", OptionKind::kBytes, "2GiB",
     "device memory budget: the arena reserves this much up front"},
    {Option::kPinnedMemory, "pinned_memory", OptionKind::kBytes, "512MiB",
     "pinned host memory pool size (staging for copies and direct I/O)"},
    {Option::kComputeThreads, "compute_threads", OptionKind::kInt, "0",
     "cpu backend: threads each stream uses for device compute (0 = one per compute cpu)"},
    {Option::kHostThreads, "host_threads", OptionKind::kInt, "0",
     "threads of the host optimizer (CPU Adam) (0 = one per host cpu)"},
    {Option::kCpuAffinity, "cpu_affinity", OptionKind::kBool, "true",
     "pin device compute threads to compute_cpus and host work (copies, I/O, CPU Adam) to host_cpus"},
    {Option::kComputeCpus, "compute_cpus", OptionKind::kString, "auto",
     "cpu backend: cpus for device compute, a list such as 0-3 (auto = the first half of the "
     "allowed cpus, at least 1, or compute_threads of them)"},
    {Option::kHostCpus, "host_cpus", OptionKind::kString, "auto",
     "cpus for host work: copy engines, NVMe I/O threads, CPU Adam (auto = the allowed cpus "
     "compute does not get; all of them on one cpu)"},
    {Option::kArenaAlignment, "arena_alignment", OptionKind::kBytes, "256",
     "alignment of device arena blocks in bytes (power of two)"},
    {Option::kLogLevel, "log_level", OptionKind::kString, "warn",
     "log level: error, warn, info, debug or trace"},
    {Option::kLogSubsys, "log_subsys", OptionKind::kString, "all",
     "subsystems to log: all, a list (ALLOC,NVME) or exclusions (^DEVICE)"},
    {Option::kDtypeIsa, "dtype_isa", OptionKind::kString, "auto",
     "SIMD path for bulk dtype conversion: auto (the best this CPU has), scalar, avx2 or avx512"},
    {Option::kAdamIsa, "adam_isa", OptionKind::kString, "auto",
     "CPU optimizer code path: auto (best this CPU runs), avx512, avx2 or scalar"},
    {Option::kCommTimeout, "comm_timeout", OptionKind::kFloat, "300",
     "seconds a collective or send/recv may take before it fails and the job is aborted"},
    {Option::kOffloadPrefetchModules, "offload_prefetch_modules", OptionKind::kInt, "2",
     "offload: modules whose parameters are fetched ahead of the running one (0 = fetch on demand)"},
    {Option::kOffloadGradients, "offload_gradients", OptionKind::kString, "cpu",
     "offload: where fp32 gradients wait for an off-device optimizer: cpu (host memory) or nvme"},
    {Option::kTensorParallelSize, "tensor_parallel_size", OptionKind::kInt, "1",
     "under mpirun: ranks each model is split over (Megatron-style tensor parallel); the data-parallel "
     "size is the world size over it"},
    {Option::kDelayedUpdate, "delayed_update", OptionKind::kBool, "false",
     "offload: one-step delayed parameter update (ZeRO-Offload's DPU): step t's host update runs while step "
     "t+1 computes with the parameters before it; not equivalent to the ordinary step; needs the optimizer "
     "off the device; composes with data, tensor and pipeline parallelism"},
    {Option::kDelayedUpdateWarmup, "delayed_update_warmup", OptionKind::kInt, "1",
     "offload: with delayed_update, the first this many steps' updates are seen by the next step (not "
     "delayed)"},
    {Option::kPipelineParallelSize, "pipeline_parallel_size", OptionKind::kInt, "1",
     "pipeline parallel: stages per pipeline under mpirun (the model's modules split over them, balanced "
     "by forward FLOPs); data parallel = ranks / this"},
    {Option::kPipelineSchedule, "pipeline_schedule", OptionKind::kString, "1f1b",
     "pipeline parallel: the order of a stage's micro-batches: gpipe (all forwards, then all backwards) "
     "or 1f1b (one forward, one backward)"},
    {Option::kSequenceParallel, "sequence_parallel", OptionKind::kBool, "false",
     "tensor parallel: each of the tensor_parallel_size ranks keeps 1/tensor_parallel_size of the tokens of "
     "the residual stream and the norms (Megatron-style sequence parallelism); needs tensor_parallel_size > 1 "
     "and seq_len a multiple of it; with a pipeline each tensor-parallel rank sends its rows across a stage "
     "boundary"},
    {Option::kPipelineVirtualStages, "pipeline_virtual_stages", OptionKind::kInt, "1",
     "pipeline parallel: module chunks per stage (interleaved 1F1B): the model is split into "
     "pipeline_parallel_size x this FLOP-balanced chunks and stage s runs chunks s, s + P, ...; 1 is plain "
     "1F1B; more than 1 needs the 1f1b schedule and gradient_accumulation_steps a multiple of "
     "pipeline_parallel_size"},
}};

constexpr std::int64_t kMaxIntOption = 4096;

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

std::span<const OptionDesc> option_table() { return kTable; }
const OptionDesc& describe(Option id) { return kTable[static_cast<size_t>(id)]; }

Result<std::uint64_t> parse_bytes(std::string_view text) {
  std::string t(text);
  while (!t.empty() && std::isspace(static_cast<unsigned char>(t.back()))) t.pop_back();
  size_t i = 0;
  while (i < t.size() && std::isspace(static_cast<unsigned char>(t[i]))) ++i;
  size_t num_begin = i;
  while (i < t.size() && (std::isdigit(static_cast<unsigned char>(t[i])) || t[i] == '.')) ++i;
  if (i == num_begin) {
    return invalid_argument("'" + std::string(text) + "' is not a byte size (expected e.g. 4096, 64KiB, 2GiB)");
  }
  double number = std::strtod(t.substr(num_begin, i - num_begin).c_str(), nullptr);
  std::string unit = lower(t.substr(i));
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.front()))) unit.erase(0, 1);
  double mult = 1;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kb" || unit == "kib") mult = 1024.0;
  else if (unit == "m" || unit == "mb" || unit == "mib") mult = 1024.0 * 1024;
  else if (unit == "g" || unit == "gb" || unit == "gib") mult = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "tb" || unit == "tib") mult = 1024.0 * 1024 * 1024 * 1024;
  else {
    return invalid_argument("'" + std::string(text) + "' has unknown unit '" + unit +
                            "' (expected B, KiB, MiB, GiB or TiB)");
  }
  double bytes = number * mult;
  if (!std::isfinite(bytes) || bytes < 0 || bytes > 1.8e19 || bytes != std::floor(bytes)) {
    return invalid_argument("'" + std::string(text) + "' is not a whole number of bytes");
  }
  return static_cast<std::uint64_t>(bytes);
}

std::string format_bytes(std::uint64_t bytes) {
  static constexpr std::array<const char*, 5> kUnits = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  size_t u = 0;
  while (v >= 1024.0 && u + 1 < kUnits.size()) {
    v /= 1024.0;
    ++u;
  }
  char buf[64];
  if (u == 0) {
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof buf, "%.2f %s", v, kUnits[u]);
  }
  return buf;
}

Options::Options() : values_(kTable.size()) {
  for (const auto& d : kTable) {
    Status s = set(d.id, d.default_value, "default");
    (void)s;  // table defaults are valid by construction (tested)
  }
}

std::string Options::env_name(const OptionDesc& desc) {
  std::string env = "STRATA_";
  for (char c : desc.name) env += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return env;
}

Option Options::find(std::string_view name) {
  for (const auto& d : kTable) {
    if (d.name == name) return d.id;
  }
  return Option::kCount;
}

Status Options::set(std::string_view name, std::string_view value, std::string_view source) {
  Option id = find(name);
  if (id == Option::kCount) return invalid_argument(std::string(source) + ": unknown option '" + std::string(name) + "'");
  return set(id, value, source);
}

Status Options::set(Option id, std::string_view value, std::string_view source) {
  const OptionDesc& d = describe(id);
  Value v;
  v.text = std::string(value);
  v.source = std::string(source);
  auto fail = [&](std::string_view expected) {
    return invalid_argument(std::string(source) + ": value '" + std::string(value) + "' for option '" +
                            std::string(d.name) + "' is not " + std::string(expected));
  };
  switch (d.kind) {
    case OptionKind::kInt: {
      // Every integer option counts something small (a device, threads): a bound keeps a
      // value like 2^32 from wrapping when it is narrowed to int.
      std::int64_t x = -1;
      auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), x);
      if (ec != std::errc() || end != value.data() + value.size() || x < 0 || x > kMaxIntOption) {
        return fail("an integer in [0, " + std::to_string(kMaxIntOption) + "]");
      }
      v.i = x;
      break;
    }
    case OptionKind::kBytes: {
      auto b = parse_bytes(value);
      if (!b.ok()) return fail("a byte size such as 4096, 64KiB or 2GiB");
      if (*b > static_cast<std::uint64_t>(INT64_MAX)) return fail("a byte size below 8 EiB");
      v.i = static_cast<std::int64_t>(*b);
      break;
    }
    case OptionKind::kBool: {
      std::string t = lower(value);
      if (t == "1" || t == "true" || t == "on" || t == "yes") v.i = 1;
      else if (t == "0" || t == "false" || t == "off" || t == "no") v.i = 0;
      else return fail("a boolean (true/false, 1/0, on/off)");
      break;
    }
    case OptionKind::kFloat: {
      char* end = nullptr;
      std::string t(value);
      double x = std::strtod(t.c_str(), &end);
      if (t.empty() || *end != '\0' || !std::isfinite(x)) return fail("a finite number");
      v.f = x;
      break;
    }
    case OptionKind::kString:
      break;
  }
  // Per-option validation beyond the kind.
  switch (id) {
    case Option::kDevice:
      if (v.text != "cpu" && v.text != "cuda") return fail("one of: cpu, cuda");
      break;
    case Option::kArenaAlignment:
      if (v.i < 16 || (v.i & (v.i - 1)) != 0) return fail("a power of two >= 16");
      break;
    case Option::kDeviceMemory:
      if (v.i < 1024 * 1024) return fail("at least 1MiB");
      break;
    case Option::kLogLevel:
      if (!parse_log_level(v.text).ok()) return fail("one of: error, warn, info, debug, trace");
      break;
    case Option::kDtypeIsa:
      if (v.text != "auto" && !parse_simd_isa(v.text).ok()) return fail("one of: auto, scalar, avx2, avx512");
      break;
    case Option::kAdamIsa:
      if (v.text != "auto" && !parse_simd_isa(v.text).ok()) return fail("one of: auto, scalar, avx2, avx512");
      break;
    case Option::kOffloadGradients:
      if (v.text != "cpu" && v.text != "host" && v.text != "nvme") return fail("one of: cpu (host), nvme");
      break;
    case Option::kComputeCpus:
    case Option::kHostCpus:
      if (v.text != "auto" && !CpuSet::parse(v.text, d.name).ok()) {
        return fail("auto or a cpu list such as 0, 0-3 or 0,2,4-7");
      }
      break;
    default:
      break;
  }
  values_[static_cast<size_t>(id)] = std::move(v);
  return ok_status();
}

Status Options::load_env() {
  for (const auto& d : kTable) {
    std::string env = env_name(d);
    if (const char* value = std::getenv(env.c_str())) {
      STRATA_RETURN_IF_ERROR(set(d.id, value, env));
    }
  }
  return ok_status();
}

std::int64_t Options::get_int(Option id) const { return values_[static_cast<size_t>(id)].i; }
std::uint64_t Options::get_bytes(Option id) const {
  return static_cast<std::uint64_t>(values_[static_cast<size_t>(id)].i);
}
bool Options::get_bool(Option id) const { return values_[static_cast<size_t>(id)].i != 0; }
double Options::get_float(Option id) const { return values_[static_cast<size_t>(id)].f; }
const std::string& Options::get_string(Option id) const { return values_[static_cast<size_t>(id)].text; }
const std::string& Options::source(Option id) const { return values_[static_cast<size_t>(id)].source; }

}  // namespace strata
