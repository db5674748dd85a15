// Machine profiles for strata plan --profile (profiles.hpp).
#include "profiles.hpp"

#include <algorithm>
#include <cstdio>

#include "strata/model.hpp"

namespace strata::cli {
namespace {

struct GpuSpec {
  const char* name;
  const char* what;
  double peak_16bit;  // dense tensor-core FLOP/s
  double peak_fp32;   // dense TF32 tensor-core FLOP/s (V100: plain fp32)
  double hbm;         // bytes/s
  double memory;      // bytes
  const char* link;   // the host link it usually sits behind
};

// Vendor datasheet figures (dense, no sparsity).
constexpr GpuSpec kGpus[] = {
    {"v100", "V100 32 GB (SXM2)", 125e12, 15.7e12, 900e9, 32e9, "pcie3"},
    {"a100", "A100 80 GB (SXM4)", 312e12, 156e12, 2039e9, 80e9, "pcie4"},
    {"h100", "H100 80 GB (SXM5)", 989e12, 494.7e12, 3.35e12, 80e9, "pcie5"},
    {"h200", "H200 141 GB (SXM5)", 989e12, 494.7e12, 4.8e12, 141e9, "pcie5"},
};

struct LinkSpec {
  const char* name;
  double bytes_per_s;  // what pinned cudaMemcpyAsync usually reaches, per direction, on x16
};

// x16 links: 15.8 / 31.5 / 63 GB/s raw per direction; pinned copies reach about 80% of it.
constexpr LinkSpec kLinks[] = {
    {"pcie3", 12e9},
    {"pcie4", 25e9},
    {"pcie5", 50e9},
};

// A PCIe 4.0 data-centre NVMe drive's sequential rates and a common capacity.
constexpr double kDriveRead = 7e9, kDriveWrite = 5.5e9;
constexpr double kDriveBytes = 3.84e12;
// crc32c on one core (the swap store's checksums), for the CPU share of NVMe traffic.
constexpr double kCrcBytesPerSecond = 20e9;
// The fixed cost of one swap request on a data-centre NVMe drive at depth.
constexpr double kNvmeRequestSeconds = 50e-6;

}  // namespace

const FlagSpec kProfileFlags[] = {
    {"profile", "GPU",
     "predict for a machine with this GPU (v100, a100, h100, h200) instead of measuring this one; "
     "--device-memory, --host-memory and --nvme-free default to the profile's"},
    {"host-link", "pcie3|pcie4|pcie5", "with --profile: the GPU's host link (default: the GPU's usual one)"},
    {"gpu-efficiency", "F",
     "with --profile: fraction of the GPU's dense peak the kernels reach (default 0.5)"},
    {"nvme-drives", "N", "with --profile: NVMe drives striped together (default 1)"},
    {"nvme-read-gbps", "GB/s", "with --profile: one drive's read rate (default 7, a PCIe 4.0 drive)"},
    {"nvme-write-gbps", "GB/s", "with --profile: one drive's write rate (default 5.5)"},
    {"cpu-cores", "N", "with --profile: host cores (default 32)"},
    {"host-bandwidth", "GB/s", "with --profile: host memory bandwidth (default 200)"},
};
const std::size_t kProfileFlagCount = std::size(kProfileFlags);

std::string profile_names() {
  std::string s;
  for (const GpuSpec& g : kGpus) s += (s.empty() ? "" : ", ") + std::string(g.name);
  return s;
}

Result<MachineProfile> profile_from_flags(const Args& args) {
  const std::string gpu = args.get("profile").value_or("");
  const GpuSpec* spec = nullptr;
  for (const GpuSpec& g : kGpus)
    if (gpu == g.name) spec = &g;
  if (spec == nullptr) {
    return invalid_argument("flag '--profile': unknown GPU '" + gpu + "' (expected one of " +
                            profile_names() + ")");
  }
  for (const FlagSpec& f : kProfileFlags) {
    if (f.name != "profile" && args.has(f.name) && !args.has("profile")) {
      return invalid_argument("flag '--" + std::string(f.name) + "' needs --profile");
    }
  }
  MachineProfile p;
  p.gpu = spec->name;
  p.gpu_peak_flops = spec->peak_16bit;
  p.gpu_peak_flops_fp32 = spec->peak_fp32;
  p.hbm_bytes_per_s = spec->hbm;
  p.device_memory = static_cast<std::uint64_t>(spec->memory * 0.92);
  p.host_link = args.get("host-link").value_or(spec->link);
  const LinkSpec* link = nullptr;
  for (const LinkSpec& l : kLinks)
    if (p.host_link == l.name) link = &l;
  if (link == nullptr) {
    return invalid_argument("flag '--host-link': unknown link '" + p.host_link +
                            "' (expected pcie3, pcie4 or pcie5)");
  }
  p.link_bytes_per_s = link->bytes_per_s;
  STRATA_ASSIGN_OR_RETURN(p.gpu_efficiency, args.get_double("gpu-efficiency", 0.5, 0.01, 1.0));
  STRATA_ASSIGN_OR_RETURN(std::int64_t drives, args.get_int("nvme-drives", 1, 1, 64));
  p.nvme_drives = static_cast<int>(drives);
  STRATA_ASSIGN_OR_RETURN(double read, args.get_double("nvme-read-gbps", kDriveRead / 1e9, 0.01, 1000));
  STRATA_ASSIGN_OR_RETURN(double write, args.get_double("nvme-write-gbps", kDriveWrite / 1e9, 0.01, 1000));
  p.nvme_read_bytes_per_s = read * 1e9;
  p.nvme_write_bytes_per_s = write * 1e9;
  p.nvme_bytes = static_cast<std::uint64_t>(kDriveBytes);
  STRATA_ASSIGN_OR_RETURN(std::int64_t cores, args.get_int("cpu-cores", 32, 1, 4096));
  p.cpu_cores = static_cast<int>(cores);
  STRATA_ASSIGN_OR_RETURN(double bw, args.get_double("host-bandwidth", 200, 1, 100000));
  p.host_memory_bytes_per_s = bw * 1e9;
  p.host_memory = 512ull << 30;
  return p;
}

Result<MachineRates> profile_rates(const MachineProfile& p, const TrainerConfig& config) {
  const bool fp32 = config.model.dtype == DType::kF32;
  const double flops_per_s = (fp32 ? p.gpu_peak_flops_fp32 : p.gpu_peak_flops) * p.gpu_efficiency;
  MachineRates r;
  STRATA_ASSIGN_OR_RETURN(ModelLayout layout, describe_model(config.model));
  const std::vector<double> forward = module_flops(config.model, config.micro_batch, config.seq_len);
  for (std::size_t m = 0; m < forward.size(); ++m) {
    const double f = forward[m] / flops_per_s;
    const bool block = layout.modules[m].kind == ModuleKind::kBlock;
    r.forward_seconds.push_back(f);
    // Backward: the input and the weight gradients (twice the forward), plus the recompute of a
    // checkpointed block.
    r.backward_seconds.push_back(2 * f + (block && config.model.activation_checkpointing ? f : 0.0));
  }
  const double params = static_cast<double>(layout.num_parameters());
  // The fused Adam on the device: master, moments and gradient read, master and moments written,
  // the working copy written.
  const double update_bytes = fp32 ? 28 : 28 + static_cast<double>(dtype_size(config.model.dtype));
  r.device_update_seconds = params * update_bytes / p.hbm_bytes_per_s;
  r.h2d_bytes_per_s = r.d2h_bytes_per_s = p.link_bytes_per_s;
  r.host_copy_bytes_per_s = p.host_memory_bytes_per_s / 2;  // read + write
  r.nvme_read_bytes_per_s = p.nvme_read_bytes_per_s * p.nvme_drives;
  r.nvme_write_bytes_per_s = p.nvme_write_bytes_per_s * p.nvme_drives;
  r.nvme_request_seconds = kNvmeRequestSeconds;
  const double host_stream = std::min(p.host_memory_bytes_per_s, p.cpu_cores * kCoreBytesPerSecond);
  r.adam_elements_per_s = host_stream / update_bytes;
  r.scan_elements_per_s = host_stream / 4;
  r.shared_cores = false;
  r.cores = p.cpu_cores;
  r.nvme_cpu_fraction = (r.nvme_read_bytes_per_s + r.nvme_write_bytes_per_s) / kCrcBytesPerSecond;
  r.cuda = true;
  STRATA_RETURN_IF_ERROR(r.validate(forward.size()));
  return r;
}

double step_flops(const TrainerConfig& config) {
  return model_flops(config.model, config.micro_batch, config.seq_len) *
         static_cast<double>(config.grad_accum);
}

std::string describe(const MachineProfile& p) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "%s (%.0f TFLOPS dense 16-bit, %.0f%% reached; %.1f TB/s HBM), %s host link (%.0f GB/s each "
                "way), %d NVMe drive%s (%.1f / %.1f GB/s read / write each), %d cores, %.0f GB/s host memory",
                p.gpu.c_str(), p.gpu_peak_flops / 1e12, 100 * p.gpu_efficiency, p.hbm_bytes_per_s / 1e12,
                p.host_link.c_str(), p.link_bytes_per_s / 1e9, p.nvme_drives, p.nvme_drives == 1 ? "" : "s",
                p.nvme_read_bytes_per_s / 1e9, p.nvme_write_bytes_per_s / 1e9, p.cpu_cores,
                p.host_memory_bytes_per_s / 1e9);
  return buf;
}

}  // namespace strata::cli
