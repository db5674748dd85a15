// Measurements of this machine, each part of an offloaded step alone: shared by strata bench
// offload (the step against its parts) and strata plan (the rates of its step-time model).
// Private to tools/strata.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/cpu_budget.hpp"
#include "strata/device.hpp"
#include "strata/dtype.hpp"
#include "strata/engine.hpp"
#include "strata/offload.hpp"
#include "strata/status.hpp"

namespace strata::cli {

// Copies of `bytes` over one link alone (pinned host <-> device, one stream), median of `reps`.
Result<double> time_copy(Device& device, std::uint64_t bytes, CopyKind kind, int reps);

// How a timing summarises its repetitions: the median (what a run sees) or the best (what the
// machine can do: the physical bound, physical_bound.hpp).
enum class Summary : std::uint8_t { kMedian, kBest };

// CPU Adam over n parameters (fp32 master, moments and gradients; working copy in `dtype`) on
// `threads` threads, median (or best) of `reps` after one that touches the pages.
Result<double> time_optimizer(std::int64_t n, DType dtype, int threads, int reps,
                              Summary summary = Summary::kMedian);
// A memcpy of `bytes` between two host buffers whose pages are touched first, median of `reps`.
double time_host_copy(std::uint64_t bytes, int reps);
// The same on a thread pinned as the engine's host optimizer thread is (the budget's host cpus),
// with its threads.
Result<double> time_optimizer(std::int64_t n, DType dtype, const CpuBudget& budget, int reps,
                              Summary summary = Summary::kMedian);

// The gradient norm's sum of squares over n fp32 values on one thread, median (or best) of `reps`.
Result<double> time_scan(std::int64_t n, int reps, Summary summary = Summary::kMedian);

// Writes then reads through a swap store in a directory of its own under `dir` (removed after),
// in requests of `piece` bytes, checksums on; median of `reps`. read_s / write_s are scaled to
// `read_bytes` / `write_bytes` from one pass over max(read_bytes, write_bytes). cpu_fraction is
// the process's CPU seconds per wall second while the transfers ran (checksums, page copies).
struct NvmeTimes {
  double read_s = 0;
  double write_s = 0;
  double cpu_fraction = 0;
  double request_s = 0;  // one 4 KiB read waited for alone (the fixed cost per request)
};
Result<NvmeTimes> time_nvme(const std::string& dir, std::uint64_t read_bytes, std::uint64_t write_bytes,
                            std::uint64_t piece, int reps);

// How much strata plan measures (a few seconds for a small model).
struct MeasureSettings {
  std::int64_t steps = 3;   // timed steps of the resident model (median)
  std::int64_t warmup = 1;  // untimed steps first
  std::uint64_t copy_bytes = 64ull << 20;
  std::uint64_t nvme_bytes = 128ull << 20;  // written then read back (0: no NVMe measurement)
  std::uint64_t nvme_piece = 8ull << 20;
  std::int64_t adam_elements = 4'000'000;
  std::uint64_t compute_memory = 0;  // the most the resident model may take (0: half of what is available)
  std::string nvme_dir;              // where to measure NVMe (empty: no NVMe measurement)
};

// What was measured, for the report.
struct MeasureReport {
  std::int64_t measured_layers = 0;  // the depth whose resident step was timed (scaled to the model)
  double step_s = 0;                 // resident step (all micro-batches and the device update)
  double forward_s = 0;              // one micro-batch, forward only
  double forward_backward_s = 0;     // one micro-batch, forward and backward
  double copy_h2d_s = 0, copy_d2h_s = 0;
  double copy_host_s = 0;  // host memory to host memory (memcpy), copy_bytes
  std::uint64_t copy_bytes = 0;
  NvmeTimes nvme;
  std::uint64_t nvme_bytes = 0;
  double adam_s = 0;
  std::int64_t adam_elements = 0;
  double scan_s = 0;
  int compute_threads = 0;
  int host_threads = 0;
  int cores = 0;
  double seconds = 0;  // wall time of the whole measurement
};

// Measures the rates of predict_step on the device `dc` describes (a fresh device per part), as
// the run it predicts will have them: `dc` is the device strata train makes for the placement (its
// compute threads and cpu budget: all cpus for compute with nothing offloaded, the budget's split
// otherwise). A resident step of the model (`config`; shallower when its resident state is above
// compute_memory, per-block times scaled to the full depth), split over the modules by their
// arithmetic, copies both ways, NVMe through the swap store, CPU Adam and the gradient scan on the
// host optimizer's threads pinned as the engine pins them; shared_cores from the budget.
Result<MachineRates> measure_machine(const TrainerConfig& config, const DeviceConfig& dc,
                                     const MeasureSettings& settings, MeasureReport* report);

// Floating-point operations of each module's forward for one micro-batch (matrix products and
// attention), the weights by which measured compute is split over the modules.
std::vector<double> module_forward_flops(const TrainerConfig& config);

}  // namespace strata::cli
