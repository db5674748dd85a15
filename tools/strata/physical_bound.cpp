// The physical lower bound of an offloaded step (physical_bound.hpp).
#include "physical_bound.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include "kernels/kernels.hpp"
#include "strata/alloc.hpp"
#include "strata/nvme.hpp"

namespace strata::cli {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct RemoveDir {
  std::string path;
  ~RemoveDir() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
};

// A scratch directory of its own under `dir`, and a file in it opened for direct I/O.
struct DiskScratch {
  std::unique_ptr<IoEngine> io;
  FileId file;
  RemoveDir remove;
};

Result<DiskScratch> open_scratch(const std::string& dir, const char* name, std::uint64_t block,
                                 std::uint32_t depth, const CpuSet& cpus, std::uint64_t bytes) {
  DiskScratch d;
  const std::string sub = dir + "/" + name + "-" + std::to_string(::getpid());
  std::error_code ec;
  std::filesystem::create_directories(sub, ec);
  if (ec) return io_error("cannot create '" + sub + "' (--nvme-path): " + ec.message());
  d.remove.path = sub;
  IoEngineConfig c;
  c.nvme_path = {sub};
  c.block_size = block;
  c.queue_depth = depth;
  c.cpus = cpus;
  STRATA_ASSIGN_OR_RETURN(d.io, IoEngine::create(c));
  STRATA_ASSIGN_OR_RETURN(d.file, d.io->open(sub + "/disk.bin", OpenMode::kCreate));
  STRATA_RETURN_IF_ERROR(d.io->preallocate(d.file, bytes));
  return d;
}

// Best of `reps` timings of fn().
template <typename Fn>
Result<double> best_of(int reps, Fn fn) {
  double best = 0;
  for (int r = 0; r < std::max(reps, 1); ++r) {
    STRATA_ASSIGN_OR_RETURN(double t, fn());
    if (r == 0 || t < best) best = t;
  }
  return best;
}

// Runs fn on a thread pinned to `cpus` (the caller's affinity is left alone).
template <typename Fn>
Status on_cpus(const CpuSet& cpus, Fn fn) {
  Status s = ok_status();
  std::thread worker([&] {
    if (!cpus.empty()) s = pin_current_thread(cpus);
    if (s.ok()) s = fn();
  });
  worker.join();
  return s;
}

}  // namespace

Result<DiskRates> measure_disk(const std::string& dir, std::uint64_t bytes, const CpuSet& cpus, int reps) {
  constexpr std::uint64_t kBlocks[] = {1u << 20, 4u << 20, 16u << 20};
  constexpr std::uint32_t kDepths[] = {8, 32};
  bytes = std::max<std::uint64_t>((bytes + (16u << 20) - 1) / (16u << 20) * (16u << 20), 16u << 20);
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer buf, AlignedBuffer::allocate(bytes));
  // Not zeros: a device that compresses or deduplicates must not look faster than it is.
  auto* words = static_cast<std::uint64_t*>(buf.data());
  for (std::uint64_t i = 0, x = 0x9e3779b97f4a7c15ull; i < bytes / 8; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    words[i] = x;
  }
  DiskRates out;
  out.bytes = bytes;
  for (std::uint64_t block : kBlocks) {
    for (std::uint32_t depth : kDepths) {
      STRATA_ASSIGN_OR_RETURN(DiskScratch d,
                              open_scratch(dir, "strata-disk-rate", block, depth, cpus, bytes));
      STRATA_ASSIGN_OR_RETURN(double w, best_of(reps, [&]() -> Result<double> {
                                const auto t0 = Clock::now();
                                STRATA_RETURN_IF_ERROR(d.io->write(d.file, 0, buf.data(), bytes).wait());
                                return seconds_since(t0);
                              }));
      if (!d.io->is_direct(d.file)) {
        return io_error("the disk rate needs direct I/O, and '" + d.remove.path +
                        "' does not allow O_DIRECT (choose --nvme-path on a file system that does)");
      }
      STRATA_ASSIGN_OR_RETURN(double r, best_of(reps, [&]() -> Result<double> {
                                const auto t0 = Clock::now();
                                STRATA_RETURN_IF_ERROR(d.io->read(d.file, 0, buf.data(), bytes).wait());
                                return seconds_since(t0);
                              }));
      const double wr = static_cast<double>(bytes) / w, rr = static_cast<double>(bytes) / r;
      if (wr > out.write_bytes_per_s)
        out.write_bytes_per_s = wr, out.write_block = block, out.write_depth = depth;
      if (rr > out.read_bytes_per_s)
        out.read_bytes_per_s = rr, out.read_block = block, out.read_depth = depth;
    }
  }
  return out;
}

Result<double> time_disk_mixed(const std::string& dir, const DiskRates& rates, std::uint64_t read_bytes,
                               std::uint64_t write_bytes, std::uint64_t min_bytes, const CpuSet& cpus,
                               int reps) {
  const std::uint64_t total = read_bytes + write_bytes;
  if (total == 0) return 0.0;
  // Scaled so that the pass moves at least min_bytes, each part in whole 1 MiB pieces.
  const double scale = std::max(1.0, static_cast<double>(min_bytes) / static_cast<double>(total));
  const auto round = [](double b) {
    return static_cast<std::uint64_t>((b + (1u << 20) - 1) / (1u << 20)) * (1u << 20);
  };
  const std::uint64_t r = read_bytes ? round(read_bytes * scale) : 0;
  const std::uint64_t w = write_bytes ? round(write_bytes * scale) : 0;
  const double back = static_cast<double>(total) / static_cast<double>(r + w);
  // Reads and writes each at their best setting, on engines of their own (two rings, as the
  // step's reads and writes are in flight together); two files, so neither waits for the other.
  const std::uint64_t span = std::max<std::uint64_t>(std::max(r, w), 1u << 20);
  STRATA_ASSIGN_OR_RETURN(
      DiskScratch rd, open_scratch(dir, "strata-disk-read", rates.read_block, rates.read_depth, cpus, span));
  STRATA_ASSIGN_OR_RETURN(DiskScratch wd, open_scratch(dir, "strata-disk-write", rates.write_block,
                                                       rates.write_depth, cpus, span));
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer rbuf, AlignedBuffer::allocate(span));
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer wbuf, AlignedBuffer::allocate(span));
  std::memset(wbuf.data(), 0x5a, span);
  // The read side's file holds data first (a read of unwritten extents would cost nothing).
  if (r > 0) STRATA_RETURN_IF_ERROR(rd.io->write(rd.file, 0, wbuf.data(), r).wait());
  STRATA_ASSIGN_OR_RETURN(
      double t, best_of(reps, [&]() -> Result<double> {
        const auto t0 = Clock::now();
        IoHandle hr = r ? rd.io->read(rd.file, 0, rbuf.data(), r) : IoHandle::completed(ok_status());
        IoHandle hw = w ? wd.io->write(wd.file, 0, wbuf.data(), w) : IoHandle::completed(ok_status());
        Status sr = hr.wait(), sw = hw.wait();
        STRATA_RETURN_IF_ERROR(sr);
        STRATA_RETURN_IF_ERROR(sw);
        return seconds_since(t0);
      }));
  return t * back;
}

Result<HostRates> measure_host(const CpuBudget& budget, int copy_engines, int reps) {
  HostRates out;
  const CpuSet& cpus = budget.host;
  out.copy_threads = std::max(1, std::min(copy_engines, std::max(cpus.size(), 1)));
  // Far beyond the last-level cache: a bandwidth, not a cache copy.
  constexpr std::uint64_t kBytes = 256ull << 20;
  const std::uint64_t per = kBytes / static_cast<std::uint64_t>(out.copy_threads);
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer from, AlignedBuffer::allocate(kBytes));
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer to, AlignedBuffer::allocate(kBytes));
  std::memset(from.data(), 1, kBytes);
  std::memset(to.data(), 0, kBytes);
  STRATA_ASSIGN_OR_RETURN(double copy_s, best_of(reps + 1, [&]() -> Result<double> {
                            std::vector<std::thread> team;
                            std::vector<Status> st(static_cast<std::size_t>(out.copy_threads), ok_status());
                            const auto t0 = Clock::now();
                            for (int i = 0; i < out.copy_threads; ++i) {
                              team.emplace_back([&, i] {
                                if (!cpus.empty()) st[i] = pin_current_thread(cpus);
                                const std::uint64_t off = per * static_cast<std::uint64_t>(i);
                                std::memcpy(static_cast<char*>(to.data()) + off,
                                            static_cast<const char*>(from.data()) + off, per);
                              });
                            }
                            for (auto& t : team) t.join();
                            const double s = seconds_since(t0);
                            for (const Status& x : st) STRATA_RETURN_IF_ERROR(x);
                            return s;
                          }));
  if (static_cast<const char*>(to.data())[kBytes - 1] != 1)
    return internal_error("host copy rate: the copy did not land");
  out.copy_bytes_per_s = static_cast<double>(per * static_cast<std::uint64_t>(out.copy_threads)) / copy_s;
  double crc_s = 0;
  std::uint32_t crc = 0;
  STRATA_RETURN_IF_ERROR(on_cpus(cpus, [&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(crc_s, best_of(reps, [&]() -> Result<double> {
                              const auto t0 = Clock::now();
                              crc ^= crc32c(from.data(), 64ull << 20);
                              return seconds_since(t0);
                            }));
    return ok_status();
  }));
  (void)crc;  // crc32c is an opaque call; its result only keeps the loop honest to a reader
  out.crc_bytes_per_s = static_cast<double>(64ull << 20) / crc_s;
  return out;
}

Result<GemmRoofline> measure_gemm_roofline(Device& device, Stream& stream, const ModelConfig& model,
                                           std::int64_t batch, std::int64_t seq_len, int reps) {
  const DType wdt = model.dtype;
  const std::uint64_t w = dtype_size(wdt);
  const auto gemms = model_gemms(model, batch, seq_len);
  std::uint64_t a_max = 0, b_max = 0, c_max = 0;
  for (const auto& g : gemms) {
    a_max = std::max<std::uint64_t>(a_max, static_cast<std::uint64_t>(g.M * g.K) * w);
    b_max = std::max<std::uint64_t>(b_max, static_cast<std::uint64_t>(g.K * g.N) * w);
    c_max = std::max<std::uint64_t>(c_max, static_cast<std::uint64_t>(g.M * g.N) * 4);
  }
  STRATA_ASSIGN_OR_RETURN(ArenaBuffer a, device.allocate(a_max, "bench.roofline.a"));
  STRATA_ASSIGN_OR_RETURN(ArenaBuffer b, device.allocate(b_max, "bench.roofline.b"));
  STRATA_ASSIGN_OR_RETURN(ArenaBuffer c, device.allocate(c_max, "bench.roofline.c"));
  STRATA_RETURN_IF_ERROR(stream.memset_async(a.data(), 0x3c, a_max));
  STRATA_RETURN_IF_ERROR(stream.memset_async(b.data(), 0x3c, b_max));
  STRATA_RETURN_IF_ERROR(stream.memset_async(c.data(), 0, c_max));
  STRATA_ASSIGN_OR_RETURN(auto state, kernels::KernelState::create(kernels::Backend::kCpu));
  kernels::KernelContext ctx;
  ctx.backend = kernels::Backend::kCpu;
  ctx.cpu_threads = device.info().compute_threads;
  ctx.state = state.get();
  GemmRoofline out;
  void *pa = a.data(), *pb = b.data(), *pc = c.data();
  STRATA_RETURN_IF_ERROR(stream.host_fn("bench: the step's GEMMs alone", [&, pa, pb, pc]() -> Status {
    for (const GemmShape& g : gemms) {
      const kernels::TensorArg cc{pc, g.accumulate ? DType::kF32 : wdt};
      auto call = [&]() {
        return kernels::gemm(ctx, cc, {pa, wdt}, {pb, wdt}, kernels::kNone, g.M, g.N, g.K,
                             g.trans_a ? kernels::Transpose::kYes : kernels::Transpose::kNo,
                             g.trans_b ? kernels::Transpose::kYes : kernels::Transpose::kNo,
                             g.accumulate ? kernels::Accumulate::kAdd : kernels::Accumulate::kOverwrite);
      };
      STRATA_RETURN_IF_ERROR(call());  // builds and caches the plan
      STRATA_ASSIGN_OR_RETURN(double t, best_of(reps, [&]() -> Result<double> {
                                const auto t0 = Clock::now();
                                STRATA_RETURN_IF_ERROR(call());
                                return seconds_since(t0);
                              }));
      out.flops +=
          2.0 * static_cast<double>(g.M) * static_cast<double>(g.N) * static_cast<double>(g.K) * g.count;
      out.seconds += t * g.count;
    }
    return ok_status();
  }));
  STRATA_RETURN_IF_ERROR(stream.synchronize());
  return out;
}

PhysicalBound physical_bound(const StepDemand& d, const HostRates& host, const CpuBudget& budget,
                             int compute_threads) {
  PhysicalBound out;
  out.terms.push_back({"compute", d.compute_s});
  // The host cpus' work, alone at the measured rates, in core-seconds.
  const double copy_s =
      host.copy_bytes_per_s > 0 ? static_cast<double>(d.copy_bytes) / host.copy_bytes_per_s : 0;
  const double crc_s =
      host.crc_bytes_per_s > 0 ? static_cast<double>(d.nvme_read + d.nvme_write) / host.crc_bytes_per_s : 0;
  const double host_core_s =
      copy_s * host.copy_threads + d.optimizer_s * std::max(d.optimizer_threads, 1) + d.scan_s + crc_s;
  const int host_cpus = std::max(budget.host.size(), 1);
  const double longest = std::max({copy_s, d.optimizer_s, d.scan_s, crc_s});
  const double host_s = std::max(host_core_s / host_cpus, longest);
  if (host_s > 0) out.terms.push_back({"host", host_s});
  if (d.nvme_read + d.nvme_write > 0) out.terms.push_back({"disk", d.disk_s});
  if (budget.shared()) {
    const int cores = std::max(budget.allowed.size(), 1);
    out.terms.push_back({"cores", (d.compute_s * std::max(compute_threads, 1) + host_core_s) / cores});
  }
  for (const BoundTerm& t : out.terms) {
    if (t.seconds > out.seconds) out.seconds = t.seconds, out.bottleneck = t.resource;
  }
  return out;
}

}  // namespace strata::cli
