// The physical lower bound of an offloaded step (strata bench offload).
//
// A step moves bytes and does arithmetic on a few resources; none of them can go faster than the
// hardware does when it does nothing else. This file measures those rates in the run (best of
// several repetitions: what the machine can do, not what it did once) and turns a step's demand
// into the least time each resource needs:
//
//   compute  the model's forward and backward alone, everything resident (and, when the optimizer
//            is on the device, its update and gradient scan on the compute threads)
//   host     the work of the host cpus in core-seconds over their count: the copy engines' memcpy
//            (the cpu backend's host<->device links), CPU Adam and the gradient scan alone at the
//            step's element count, and the NVMe checksums (crc32c); never less than the longest
//            of them alone
//   disk     reading and writing the step's NVMe bytes at the same time (one device) through the
//            I/O engine at its best request size and queue depth
//   cores    only when compute and host share cpus (CpuBudget::shared): all of the above CPU work
//            over the cores
//
// bound = the largest; a step cannot be shorter, so bound / step <= 1 up to measurement noise,
// and the largest resource is the step's bottleneck. On a GPU machine compute is the GPU, the
// copies are PCIe DMA (no host cpu), and host is CPU Adam alone; docs/performance.md says how
// each row maps.
// Private to tools/strata.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/cpu_budget.hpp"
#include "strata/device.hpp"
#include "strata/dtype.hpp"
#include "strata/model.hpp"
#include "strata/status.hpp"

namespace strata::cli {

// The disk through the I/O engine (O_DIRECT, checksums off), swept over request sizes and queue
// depths; the best of each direction and the setting that reached it.
struct DiskRates {
  double read_bytes_per_s = 0;
  double write_bytes_per_s = 0;
  std::uint64_t read_block = 0, write_block = 0;
  std::uint32_t read_depth = 0, write_depth = 0;
  std::uint64_t bytes = 0;  // per timed pass
};

// Host-side rates on the host cpus of `budget`.
struct HostRates {
  double copy_bytes_per_s = 0;  // memcpy, all copy threads together (bytes copied)
  int copy_threads = 0;         // min(copy engines, host cpus)
  double crc_bytes_per_s = 0;   // crc32c on one thread
};

// The GEMMs of one forward + backward at the model's shapes alone on `stream` (its compute
// threads): their FLOPs and best time (the GEMM roofline of the step's compute).
struct GemmRoofline {
  double flops = 0;
  double seconds = 0;
  double flops_per_s() const { return seconds > 0 ? flops / seconds : 0.0; }
};

// What one step of a placement asks of each resource (per step, all micro-batches).
struct StepDemand {
  double compute_s = 0;          // forward + backward alone (best), plus the device update when there
  std::uint64_t copy_bytes = 0;  // host<->device, both directions
  double optimizer_s = 0;        // CPU Adam alone over the host-updated elements (best)
  int optimizer_threads = 0;     // threads it ran on
  double scan_s = 0;             // the gradient scan alone (clipping), one thread
  std::uint64_t nvme_read = 0;   // bytes
  std::uint64_t nvme_write = 0;
  double disk_s = 0;  // nvme_read and nvme_write at the same time (time_disk_mixed)
};

struct BoundTerm {
  std::string resource;  // compute, host, disk, cores
  double seconds = 0;
};

struct PhysicalBound {
  double seconds = 0;
  std::string bottleneck;
  std::vector<BoundTerm> terms;  // every resource the step uses, in a fixed order
};

// Sweeps request sizes {1, 4, 16} MiB x depths {8, 32} (one I/O thread pinned to `cpus`)
// writing then reading `bytes` of a file in a directory of its own under `dir` (removed after),
// `reps` times each; keeps the best of each direction.
Result<DiskRates> measure_disk(const std::string& dir, std::uint64_t bytes, const CpuSet& cpus, int reps);

// Reads `read_bytes` and writes `write_bytes` concurrently at `rates`' best settings, scaled up to
// at least `min_bytes` in all (time scaled back linearly: a bandwidth, not a latency), best of
// `reps`. 0 when there is nothing to move.
Result<double> time_disk_mixed(const std::string& dir, const DiskRates& rates, std::uint64_t read_bytes,
                               std::uint64_t write_bytes, std::uint64_t min_bytes, const CpuSet& cpus,
                               int reps);

// memcpy on min(copy_engines, host cpus) threads pinned to the host cpus, and crc32c on one.
Result<HostRates> measure_host(const CpuBudget& budget, int copy_engines, int reps);

Result<GemmRoofline> measure_gemm_roofline(Device& device, Stream& stream, const ModelConfig& model,
                                           std::int64_t batch, std::int64_t seq_len, int reps);

// The bound of a step with `demand` on a machine with `host` rates and `budget`'s split.
PhysicalBound physical_bound(const StepDemand& demand, const HostRates& host, const CpuBudget& budget,
                             int compute_threads);

}  // namespace strata::cli
