// Machine profiles: the step-time model's rates for a machine that is not this one (strata plan
// --profile), from the datasheet figures of its GPU, host link, NVMe drives, CPU cores and memory
// bandwidth. With a profile, strata plan measures nothing: it predicts each placement's step and
// the fraction of it the GPU computes, so a user can size a run before renting the machine.
// Private to tools/strata.
//
// The figures are a model, not a measurement: compute is each module's FLOPs at `gpu_efficiency`
// of the GPU's dense 16-bit peak (fp32 models: its TF32 peak); the device update is the fused
// Adam's bytes at HBM bandwidth; copies run at the host link's usual pinned rate; CPU Adam streams
// its state at the host's memory bandwidth (the CPU optimizer reaches that roofline: docs/optim.md),
// limited by the cores at kCoreBytesPerSecond each; NVMe drives add up. docs/performance.md
// ("Past this machine") lists the table this produces for 7B-175B models and compares it with
// published offload systems.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cli.hpp"
#include "strata/engine.hpp"
#include "strata/offload.hpp"
#include "strata/status.hpp"

namespace strata::cli {

struct MachineProfile {
  std::string gpu;                 // "h100", ...
  double gpu_peak_flops = 0;       // dense bf16/fp16 tensor-core peak
  double gpu_peak_flops_fp32 = 0;  // dense TF32 (fp32 models)
  double gpu_efficiency = 0.5;     // fraction of the peak the step's kernels reach
  double hbm_bytes_per_s = 0;
  std::uint64_t device_memory = 0;  // the budget strata plan gives the engine (the GPU's, less 8%)
  std::string host_link;            // "pcie4", ...
  double link_bytes_per_s = 0;      // pinned host <-> device, each direction
  int nvme_drives = 1;
  double nvme_read_bytes_per_s = 0;  // per drive
  double nvme_write_bytes_per_s = 0;
  std::uint64_t nvme_bytes = 0;  // per drive
  int cpu_cores = 0;
  double host_memory_bytes_per_s = 0;
  std::uint64_t host_memory = 0;
};

// One core streams at most this much memory (a CPU Adam thread's share of the roofline).
inline constexpr double kCoreBytesPerSecond = 12e9;

// The profile flags strata plan takes (--profile and its overrides).
extern const FlagSpec kProfileFlags[];
extern const std::size_t kProfileFlagCount;

// The built-in GPU and host-link names, for usage text and errors.
std::string profile_names();

// --profile GPU with its overrides (--host-link, --nvme-drives, --cpu-cores, ...). Errors name the
// flag and what was expected.
Result<MachineProfile> profile_from_flags(const Args& args);

// The step-time model's rates for `config` on the profiled machine (cuda semantics: no shared
// cores).
Result<MachineRates> profile_rates(const MachineProfile& profile, const TrainerConfig& config);

// Floating-point operations of one training step (every micro-batch's forward and backward, plus
// the recompute of activation checkpointing), for TFLOPS figures.
double step_flops(const TrainerConfig& config);

// One line describing the profile (strata plan's header).
std::string describe(const MachineProfile& profile);

}  // namespace strata::cli
