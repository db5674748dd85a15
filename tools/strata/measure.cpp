// Each part of an offloaded step alone (measure.hpp).
#include "measure.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <thread>

#include "bench_util.hpp"
#include "strata/alloc.hpp"
#include "strata/data.hpp"
#include "strata/model.hpp"
#include "strata/nvme.hpp"
#include "strata/optim.hpp"
#include "strata/options.hpp"

namespace strata::cli {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double process_cpu_seconds() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  auto s = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec);
  };
  return s(ru.ru_utime) + s(ru.ru_stime);
}

// Removes a directory however the measurement ends.
struct RemoveDir {
  std::string path;
  ~RemoveDir() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
};

}  // namespace

Result<double> time_copy(Device& device, std::uint64_t bytes, CopyKind kind, int reps) {
  if (bytes == 0) return 0.0;
  STRATA_ASSIGN_OR_RETURN(ArenaBuffer dev, device.allocate(bytes, "bench.copy.device"));
  STRATA_ASSIGN_OR_RETURN(ArenaBuffer host, device.pinned().allocate(bytes, "bench.copy.host"));
  STRATA_ASSIGN_OR_RETURN(auto stream,
                          device.create_stream(kind == CopyKind::kHostToDevice ? "bench.h2d" : "bench.d2h"));
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    if (kind == CopyKind::kHostToDevice) {
      STRATA_RETURN_IF_ERROR(stream->copy_async(dev.data(), host.data(), bytes, kind));
    } else {
      STRATA_RETURN_IF_ERROR(stream->copy_async(host.data(), dev.data(), bytes, kind));
    }
    STRATA_RETURN_IF_ERROR(stream->synchronize());
    t.push_back(seconds_since(t0));
  }
  return median(t);
}

double time_host_copy(std::uint64_t bytes, int reps) {
  if (bytes == 0) return 0.0;
  std::vector<char> from(bytes, 1), to(bytes, 0);
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    std::memcpy(to.data(), from.data(), bytes);
    t.push_back(seconds_since(t0));
  }
  // The copy is read back, so it cannot be optimised away.
  if (to[bytes / 2] != 1) return 0.0;
  return median(t);
}

namespace {
double summarise(const std::vector<double>& t, Summary summary) {
  if (summary == Summary::kBest) return t.empty() ? 0.0 : *std::min_element(t.begin(), t.end());
  return median(t);
}
}  // namespace

Result<double> time_optimizer(std::int64_t n, DType dtype, int threads, int reps, Summary summary) {
  CpuOptimizerConfig oc;
  STRATA_ASSIGN_OR_RETURN(oc.isa, select_optimizer_isa("auto"));
  oc.threads = threads;
  STRATA_ASSIGN_OR_RETURN(CpuOptimizer opt, CpuOptimizer::create(oc));
  const auto un = static_cast<std::size_t>(n);
  std::vector<float> master(un, 0.01f), grad(un, 1e-3f), m(un, 0.0f), v(un, 0.0f);
  std::vector<std::uint16_t> out(un);
  OptimizerBuffers b;
  b.master = master.data();
  b.grad = grad.data();
  b.grad_dtype = DType::kF32;
  b.exp_avg = m.data();
  b.exp_avg_sq = v.data();
  b.moment_dtype = DType::kF32;
  b.param_out = dtype != DType::kF32 ? out.data() : nullptr;
  b.out_dtype = dtype != DType::kF32 ? dtype : DType::kBF16;
  b.n = un;
  OptimizerHyper h;
  h.weight_decay = 0.1;
  std::vector<double> t;
  for (int r = 0; r < reps + 1; ++r) {
    const auto t0 = Clock::now();
    STRATA_RETURN_IF_ERROR(opt.update(h, r + 1, 1.0f, b));
    if (r > 0) t.push_back(seconds_since(t0));  // the first touches the pages
  }
  return summarise(t, summary);
}

Result<double> time_optimizer(std::int64_t n, DType dtype, const CpuBudget& budget, int reps, Summary summary) {
  Result<double> r = internal_error("optimizer timing did not run");
  std::thread worker([&] {
    Status pin = budget.pin_host();
    if (!pin.ok()) {
      r = pin;
      return;
    }
    r = time_optimizer(n, dtype, budget.host_threads, reps, summary);
  });
  worker.join();
  return r;
}

Result<double> time_scan(std::int64_t n, int reps, Summary summary) {
  CpuOptimizerConfig oc;
  STRATA_ASSIGN_OR_RETURN(oc.isa, select_optimizer_isa("auto"));
  oc.threads = 1;  // the engine's optimizer thread scans on its own thread
  STRATA_ASSIGN_OR_RETURN(CpuOptimizer opt, CpuOptimizer::create(oc));
  std::vector<float> grad(static_cast<std::size_t>(n), 1e-3f);
  std::vector<double> t;
  for (int r = 0; r < reps + 1; ++r) {
    const auto t0 = Clock::now();
    STRATA_RETURN_IF_ERROR(opt.scan_gradients(grad.data(), DType::kF32, grad.size(), 1.0f, false).status());
    if (r > 0) t.push_back(seconds_since(t0));
  }
  return summarise(t, summary);
}

Result<NvmeTimes> time_nvme(const std::string& dir, std::uint64_t read_bytes, std::uint64_t write_bytes,
                            std::uint64_t piece, int reps) {
  NvmeTimes out;
  const std::uint64_t total = std::max(read_bytes, write_bytes);
  if (total == 0) return out;
  piece = std::max<std::uint64_t>(std::min(piece, total), 4096);
  IoEngineConfig ioc;
  ioc.nvme_path = {dir};
  STRATA_ASSIGN_OR_RETURN(auto io, IoEngine::create(ioc));
  SwapStoreConfig sc;
  sc.dirs = {dir + "/bench-parts"};
  std::error_code ec;
  std::filesystem::create_directories(sc.dirs[0], ec);
  if (ec) return io_error("cannot create '" + sc.dirs[0] + "' (nvme_path): " + ec.message());
  RemoveDir remove{sc.dirs[0]};
  sc.capacity = 2 * (total + piece) + (64u << 20);
  STRATA_ASSIGN_OR_RETURN(auto store, SwapStore::open(*io, sc));
  AlignedBuffer buf;
  STRATA_ASSIGN_OR_RETURN(buf, AlignedBuffer::allocate(total));
  std::memset(buf.data(), 0x5a, total);
  auto run = [&](IoOp op, std::uint64_t bytes) -> Result<double> {
    const auto t0 = Clock::now();
    std::vector<IoHandle> h;
    for (std::uint64_t off = 0, k = 0; off < bytes; off += piece, ++k) {
      const std::uint64_t n = std::min(piece, bytes - off);
      char* p = static_cast<char*>(buf.data()) + off;
      h.push_back(op == IoOp::kWrite ? store->write(TensorKey{"bench", static_cast<std::uint32_t>(k)}, p, n)
                                     : store->read(TensorKey{"bench", static_cast<std::uint32_t>(k)}, p, n));
    }
    for (IoHandle& x : h) STRATA_RETURN_IF_ERROR(x.wait());
    return seconds_since(t0);
  };
  std::vector<double> w, r;
  double wall = 0, cpu = 0;
  for (int i = 0; i < reps; ++i) {
    const double c0 = process_cpu_seconds();
    STRATA_ASSIGN_OR_RETURN(double ws, run(IoOp::kWrite, total));
    STRATA_ASSIGN_OR_RETURN(double rs, run(IoOp::kRead, total));
    cpu += process_cpu_seconds() - c0;
    wall += ws + rs;
    w.push_back(ws * static_cast<double>(write_bytes) / static_cast<double>(total));
    r.push_back(rs * static_cast<double>(read_bytes) / static_cast<double>(total));
  }
  out.read_s = median(r);
  out.write_s = median(w);
  out.cpu_fraction = wall > 0 ? std::min(1.0, cpu / wall) : 0.0;
  // The fixed cost: single 4 KiB reads, each waited for.
  std::vector<double> lat;
  STRATA_RETURN_IF_ERROR(store->write(TensorKey{"latency", 0}, buf.data(), 4096).wait());
  for (int i = 0; i < 9; ++i) {
    const auto t0 = Clock::now();
    STRATA_RETURN_IF_ERROR(store->read(TensorKey{"latency", 0}, buf.data(), 4096).wait());
    lat.push_back(seconds_since(t0));
  }
  out.request_s = median(lat);
  return out;
}

std::vector<double> module_forward_flops(const TrainerConfig& config) {
  auto layout = describe_model(config.model);
  if (!layout.ok()) return {};
  const double tokens = static_cast<double>(config.micro_batch * config.seq_len);
  const double C = static_cast<double>(config.model.n_embd);
  const double T = static_cast<double>(config.seq_len);
  std::vector<double> flops;
  for (const ModuleDesc& md : layout->modules) {
    double weights = 0;  // elements of the matrices the module multiplies by, tied ones included
    for (int i : md.params) {
      const ParamDesc& p = layout->params[static_cast<std::size_t>(i)];
      if (p.shape.size() == 2) weights += static_cast<double>(p.numel());
    }
    switch (md.kind) {
      case ModuleKind::kEmbedding:
        flops.push_back(2 * tokens * C);  // a gather and an add per element
        break;
      case ModuleKind::kBlock:
        // Q·Kᵀ and the weighted sum of V: 2·T·C multiply-adds per token each.
        flops.push_back(2 * tokens * weights + 4 * tokens * T * C);
        break;
      case ModuleKind::kHead:
        flops.push_back(2 * tokens * weights);
        break;
    }
  }
  return flops;
}

Result<MachineRates> measure_machine(const TrainerConfig& config, const DeviceConfig& dc,
                                     const MeasureSettings& settings, MeasureReport* report) {
  const auto start = Clock::now();
  MeasureReport rep;
  MachineRates rates;
  rep.cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  CpuBudget budget;

  // ---- compute: the resident model, shallower when its state is too large to hold ----
  std::uint64_t limit = settings.compute_memory;
  if (limit == 0) {
    const long pages = ::sysconf(_SC_AVPHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    limit = pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) / 2
                                  : (4ull << 30);
  }
  TrainerConfig mc = config;
  OffloadSettings resident;  // everything on the device
  std::uint64_t need = 0;
  for (;;) {
    STRATA_ASSIGN_OR_RETURN(OffloadPlan plan, OffloadPlan::make(mc, resident));
    need = plan.device_bytes;
    if (need <= limit || mc.model.n_layer == 1) break;
    mc.model.n_layer -= 1;
  }
  if (need > limit) {
    return out_of_memory("measuring compute: one block of the model with everything resident needs " +
                         format_bytes(need) + ", above the " + format_bytes(limit) +
                         " the measurement may use (--measure-memory)");
  }
  rep.measured_layers = mc.model.n_layer;
  DeviceConfig cdc = dc;
  cdc.memory_bytes = std::max(dc.memory_bytes, align_up(need + need / 4 + (64u << 20), 1u << 20));
  {
    STRATA_ASSIGN_OR_RETURN(auto device, Device::create(cdc));
    rep.compute_threads = device->info().compute_threads;
    budget = device->cpu_budget();
    rep.host_threads = budget.host_threads;
    STRATA_ASSIGN_OR_RETURN(auto engine, OffloadEngine::create(mc, resident, *device));
    const Corpus corpus = builtin_corpus(1234, 1u << 20);
    const std::vector<std::int32_t> tokens = make_byte_tokenizer()->encode(corpus.train);
    STRATA_ASSIGN_OR_RETURN(Batcher batcher, Batcher::create(tokens, mc.micro_batch, mc.seq_len, 1));
    std::vector<std::int32_t> in, tg, mb_in, mb_tg;
    auto fill = [&](std::int64_t i, std::int64_t micro) {
      in.clear();
      tg.clear();
      for (std::int64_t a = 0; a < micro; ++a) {
        batcher.batch(static_cast<std::uint64_t>(i * micro + a), mb_in, mb_tg);
        for (auto& x : mb_in) x %= static_cast<std::int32_t>(mc.model.vocab_size);
        for (auto& x : mb_tg) x %= static_cast<std::int32_t>(mc.model.vocab_size);
        in.insert(in.end(), mb_in.begin(), mb_in.end());
        tg.insert(tg.end(), mb_tg.begin(), mb_tg.end());
      }
    };
    std::vector<double> step_t, fb_t, f_t;
    for (std::int64_t i = 0; i < settings.warmup + settings.steps; ++i) {
      fill(i, mc.grad_accum);
      auto t0 = Clock::now();
      STRATA_RETURN_IF_ERROR(engine->step(in, tg).status());
      if (i >= settings.warmup) step_t.push_back(seconds_since(t0));
      fill(i, 1);
      t0 = Clock::now();
      STRATA_RETURN_IF_ERROR(engine->loss_and_gradients(in, tg).status());
      if (i >= settings.warmup) fb_t.push_back(seconds_since(t0));
      t0 = Clock::now();
      STRATA_RETURN_IF_ERROR(engine->loss(in, tg).status());
      if (i >= settings.warmup) f_t.push_back(seconds_since(t0));
    }
    rep.step_s = median(step_t);
    rep.forward_backward_s = median(fb_t);
    rep.forward_s = std::min(median(f_t), rep.forward_backward_s);
  }
  // Split over the modules by their arithmetic, scaled from the measured depth to the model's:
  // each module of the full model takes its flops' share of the measured model's, so the
  // shares add up to the full model's flops over the measured model's.
  const std::vector<double> measured = module_forward_flops(mc), full = module_forward_flops(config);
  double measured_total = 0;
  for (double f : measured) measured_total += f;
  const double fwd = rep.forward_s, bwd = rep.forward_backward_s - rep.forward_s;
  for (double f : full) {
    const double share = measured_total > 0 ? f / measured_total : 0.0;
    rates.forward_seconds.push_back(fwd * share);
    rates.backward_seconds.push_back(bwd * share);
  }
  {
    STRATA_ASSIGN_OR_RETURN(ModelLayout ml, describe_model(mc.model));
    STRATA_ASSIGN_OR_RETURN(ModelLayout fl, describe_model(config.model));
    const double update =
        std::max(0.0, rep.step_s - static_cast<double>(mc.grad_accum) * rep.forward_backward_s);
    rates.device_update_seconds = update * static_cast<double>(fl.num_parameters()) /
                                  static_cast<double>(std::max<std::int64_t>(1, ml.num_parameters()));
  }

  // ---- copies ----
  {
    DeviceConfig xdc = dc;
    xdc.memory_bytes = std::max(dc.memory_bytes, align_up(settings.copy_bytes + (16u << 20), 1u << 20));
    xdc.pinned_bytes = std::max(dc.pinned_bytes, align_up(settings.copy_bytes + (16u << 20), 1u << 20));
    STRATA_ASSIGN_OR_RETURN(auto device, Device::create(xdc));
    STRATA_ASSIGN_OR_RETURN(rep.copy_h2d_s,
                            time_copy(*device, settings.copy_bytes, CopyKind::kHostToDevice, 5));
    STRATA_ASSIGN_OR_RETURN(rep.copy_d2h_s,
                            time_copy(*device, settings.copy_bytes, CopyKind::kDeviceToHost, 5));
    rep.copy_host_s = time_host_copy(settings.copy_bytes, 5);
    rep.copy_bytes = settings.copy_bytes;
  }
  const double copy_bytes = static_cast<double>(std::max<std::uint64_t>(settings.copy_bytes, 1));
  rates.h2d_bytes_per_s = copy_bytes / std::max(rep.copy_h2d_s, 1e-9);
  rates.d2h_bytes_per_s = copy_bytes / std::max(rep.copy_d2h_s, 1e-9);
  rates.host_copy_bytes_per_s = copy_bytes / std::max(rep.copy_host_s, 1e-9);

  // ---- NVMe ----
  if (!settings.nvme_dir.empty() && settings.nvme_bytes > 0) {
    STRATA_ASSIGN_OR_RETURN(rep.nvme, time_nvme(settings.nvme_dir, settings.nvme_bytes, settings.nvme_bytes,
                                                settings.nvme_piece, 2));
    rep.nvme_bytes = settings.nvme_bytes;
    rates.nvme_read_bytes_per_s = static_cast<double>(settings.nvme_bytes) / std::max(rep.nvme.read_s, 1e-9);
    rates.nvme_write_bytes_per_s =
        static_cast<double>(settings.nvme_bytes) / std::max(rep.nvme.write_s, 1e-9);
    rates.nvme_request_seconds = rep.nvme.request_s;
    rates.nvme_cpu_fraction = rep.nvme.cpu_fraction;
  } else {
    // Not measured: placements on NVMe are not planned (the caller leaves them out).
    rates.nvme_read_bytes_per_s = rates.nvme_write_bytes_per_s = 1.0;
  }

  // ---- the host optimizer ----
  rep.adam_elements = std::max<std::int64_t>(4096, settings.adam_elements);
  STRATA_ASSIGN_OR_RETURN(rep.adam_s, time_optimizer(rep.adam_elements, config.model.dtype, budget, 3));
  STRATA_ASSIGN_OR_RETURN(rep.scan_s, time_scan(rep.adam_elements, 3));
  rates.adam_elements_per_s = static_cast<double>(rep.adam_elements) / std::max(rep.adam_s, 1e-9);
  rates.scan_elements_per_s = static_cast<double>(rep.adam_elements) / std::max(rep.scan_s, 1e-9);

  // The cpu backend's compute and host engines compete only where the budget makes them share cpus.
  rates.shared_cores = dc.kind == DeviceKind::kCpu && budget.shared();
  rates.cuda = dc.kind == DeviceKind::kCuda;
  rates.cores = rep.cores;
  rep.seconds = seconds_since(start);
  if (report != nullptr) *report = rep;
  return rates;
}

}  // namespace strata::cli
