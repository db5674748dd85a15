// strata bench offload: for each placement, the offloaded step against its physical lower bound,
// measured in the same run (physical_bound.hpp).
//
//   step_s          median step time of the placement (after warm-up)
//   bound_s         per resource, the least time the step's demand needs at the rates this machine
//                   reaches alone (best of several repetitions):
//                     compute  forward + backward with everything resident (all-device engine); for
//                              the all-device row, its whole step alone (forward, backward and the
//                              device update are all compute-stream work, so that row's efficiency
//                              says only whether it stalls; rates.compute_vs_gemm_roofline says how
//                              far compute itself is from the machine's matmul rate)
//                     host     the host cpus' work in core-seconds over their count: the copy
//                              engines' memcpy of the step's host<->device bytes, CPU Adam and the
//                              gradient scan over every parameter (optimizer off the device), the
//                              NVMe checksums
//                     disk     the step's NVMe reads and writes at the same time, through the I/O
//                              engine at its best request size and queue depth
//                     cores    (compute and host sharing cpus only) all of that CPU work over the cores
//   lower_bound_s   the largest of bound_s; bottleneck names it
//   efficiency      lower_bound_s / step_s: at most 1 (up to measurement noise); 1.0 is a step that
//                   keeps its bottleneck busy all the time
//   gap_s           step_s - lower_bound_s
//   stall_s         per step, the compute stream idle waiting for fetches plus the caller
//                   blocked on the host optimizer (OffloadStats)
//   cpu_s           per step, the CPU seconds (thread clocks) of each engine: compute (stream
//                   workers and their OpenMP teams), copy (the copy engines' memcpy), io (NVMe
//                   I/O threads), optimizer (the host optimizer thread and its team)
//   vs_ordinary     --delayed-update: one more row, the optimizer on the host with the one-step
//                   delayed update (strata.delayed_update, warm-up 0), and the ordinary row's step
//                   over its step, measured in the same run
//                   --offload-activations: one more row, the optimizer on the host with activation
//                   offload (docs/offload.md "Activation offload"); every row then runs with
//                   activation checkpointing, so vs_ordinary is the offload's cost alone
//   rates           what the bound is built from: the disk's best read and write (and the setting
//                   that reached it), the host memcpy and crc32c rates, and the GEMM roofline of
//                   the step's compute (compute_vs_gemm_roofline: how far compute itself is from it)
//
// The cpus are split by the device's CpuBudget (cpu_budget.hpp): compute pinned to compute_cpus,
// copies, I/O and the host optimizer to host_cpus; STRATA_CPU_AFFINITY=0 runs the same split's
// thread counts unpinned. docs/performance.md says how each row maps to a GPU machine.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string_view>
#include <thread>
#include <vector>

#include "bench_util.hpp"
#include "cli.hpp"
#include "measure.hpp"
#include "physical_bound.hpp"
#include "model_flags.hpp"
#include "strata/alloc.hpp"
#include "strata/data.hpp"
#include "strata/device.hpp"
#include "strata/engine.hpp"
#include "strata/model.hpp"
#include "strata/nvme.hpp"
#include "strata/offload.hpp"
#include "strata/optim.hpp"

namespace strata::cli {
namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::ordered_json;

constexpr FlagSpec kOffloadFlags[] = {
    {"json", "", "print one JSON object (the default output)"},
    {"steps", "N", "timed steps per placement (default 6)"},
    {"warmup", "N", "untimed steps first (default 2)"},
    {"batch", "N", "sequences per step (default 8)"},
    {"seq-len", "T", "tokens per sequence (default 128)"},
    {"nvme-path", "DIR", "swap directory (default: a fresh directory under $TMPDIR, removed at exit)"},
    {"disk-bytes", "BYTES", "bytes of each pass of the disk-rate sweep (default 128MiB; the mixed read+write of "
                            "a placement moves at least twice that)"},
    {"delayed-update", "",
     "also time the optimizer on host with the one-step delayed update, and its ratio to the ordinary step"},
    {"offload-activations", "",
     "also time the optimizer on host with activation offload, and its ratio to the ordinary step (turns "
     "activation checkpointing on for every row)"},
    {"help", "", "show this help"},
};

std::vector<FlagSpec> all_flags() {
  std::vector<FlagSpec> f(std::begin(kOffloadFlags), std::end(kOffloadFlags));
  f.insert(f.end(), std::begin(kModelFlags), std::end(kModelFlags));
  return f;
}

std::string usage() {
  return "usage: strata bench offload [--json] [flags]\n\n"
         "Times training steps under each placement (all-device; optimizer on host; parameters on\n"
         "NVMe + optimizer on host; everything on NVMe) and, in the same run, what this machine's\n"
         "compute, host cpus and disk can do alone; prints efficiency = physical lower bound / step\n"
         "and the bottleneck resource.\n\nflags:\n" +
         format_flags(all_flags());
}

int fail(const Status& s) {
  std::fprintf(stderr, "strata bench offload: %s\n", s.message().c_str());
  return kExitFailure;
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Placement {
  const char* name;
  Tier params, optimizer, gradients;
  bool delayed = false;  // strata.delayed_update
  bool activations = false;  // OffloadSettings::offload_activations
};

constexpr Placement kPlacements[] = {
    {"all on the device", Tier::kDevice, Tier::kDevice, Tier::kHost},
    {"optimizer on host", Tier::kDevice, Tier::kHost, Tier::kHost},
    {"parameters on NVMe, optimizer on host", Tier::kNvme, Tier::kHost, Tier::kHost},
    {"everything on NVMe", Tier::kNvme, Tier::kNvme, Tier::kNvme},
};

int bench_offload(std::span<const std::string> argv) {
  // Measured as strata train runs: OpenMP threads wait passively, so the compute team's idle
  // threads do not spin on the cores the copy, I/O and optimizer engines need.
  std::vector<std::string> self = {"offload"};
  self.insert(self.end(), argv.begin(), argv.end());
  use_passive_openmp_wait("bench", self);
  const auto flags = all_flags();
  auto parsed = Args::parse(argv, flags);
  if (!parsed.ok()) return usage_error("bench offload", parsed.status().message(), usage());
  const Args& args = *parsed;
  if (args.has("help")) {
    std::fputs(usage().c_str(), stdout);
    return kExitOk;
  }
  if (!args.positionals().empty()) {
    return usage_error("bench offload", "unexpected argument '" + args.positionals()[0] + "'", usage());
  }
  std::int64_t steps = 6, warmup = 2;
  TrainerConfig tc;
  tc.model.n_layer = 4;
  tc.model.n_head = 4;
  tc.model.n_embd = 256;
  tc.model.vocab_size = 256;
  tc.micro_batch = 8;
  tc.seq_len = 128;
  tc.schedule.kind = LrScheduleKind::kConstant;
  tc.schedule.lr = 1e-3;
  tc.grad_clip = 1.0;
  Status s = int_flag(args, "steps", 1, 100000, &steps);
  if (s.ok()) s = int_flag(args, "warmup", 1, 100000, &warmup);
  if (s.ok()) s = int_flag(args, "batch", 1, 1 << 20, &tc.micro_batch);
  if (s.ok()) s = int_flag(args, "seq-len", 1, 1 << 20, &tc.seq_len);
  if (s.ok()) s = apply_model_flags(args, tc.seq_len, &tc.model);
  std::uint64_t disk_bytes = 128ull << 20;
  if (s.ok()) {
    auto b = args.get_bytes("disk-bytes", disk_bytes, 16ull << 20, 64ull << 30);
    if (b.ok()) disk_bytes = *b;
    s = b.status();
  }
  if (!s.ok()) return usage_error("bench offload", s.message(), usage());

  std::string dir = args.get("nvme-path").value_or("");
  std::string temp_dir;
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp != nullptr && *tmp != 0 ? tmp : "/tmp") + "/strata-bench-offload-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) return fail(io_error("cannot create a swap directory '" + tmpl + "'"));
    dir = temp_dir = tmpl;
  }
  struct Cleanup {
    std::string d;
    ~Cleanup() {
      std::error_code ec;
      if (!d.empty()) std::filesystem::remove_all(d, ec);
    }
  } cleanup{temp_dir};

  std::vector<Placement> placements(std::begin(kPlacements), std::end(kPlacements));
  constexpr const char* kOrdinaryHost = "optimizer on host";
  if (args.has("delayed-update")) {
    placements.push_back({"optimizer on host, delayed update", Tier::kDevice, Tier::kHost, Tier::kHost, true});
  }
  if (args.has("offload-activations")) {
    tc.model.activation_checkpointing = true;
    // Right after the ordinary row, so that the two steps of the ratio are measured back to back.
    placements.insert(placements.begin() + 2,
                      {"optimizer on host, activation offload", Tier::kDevice, Tier::kHost, Tier::kHost, false, true});
  }
  Options options;
  std::uint64_t device_need = 0;
  for (const Placement& p : placements) {
    OffloadSettings os;
    os.params = p.params;
    os.optimizer = p.optimizer;
    os.gradients = p.gradients;
    os.nvme_path = {dir};
    auto plan = OffloadPlan::make(tc, os);
    if (!plan.ok()) return usage_error("bench offload", plan.status().message(), usage());
    device_need = std::max(device_need, plan->device_bytes);
  }
  DeviceConfig dc;
  s = device_options(args, device_need + (256u << 20), &options, &dc, /*host_work=*/true);
  if (!s.ok()) return s.code() == StatusCode::kInvalidArgument ? usage_error("bench offload", s.message(), usage()) : fail(s);
  if (dc.kind != DeviceKind::kCpu) {
    return usage_error("bench offload", "bench offload measures the cpu backend (--device cpu)", usage());
  }
  dc.pinned_bytes = std::max<std::uint64_t>(dc.pinned_bytes, 1ull << 30);
  tc.optimizer_isa = options.get_string(Option::kAdamIsa);

  const Corpus corpus = builtin_corpus(1234, 1u << 20);
  auto batcher = Batcher::create(make_byte_tokenizer()->encode(corpus.train), tc.micro_batch, tc.seq_len, 1);
  if (!batcher.ok()) return fail(batcher.status());
  std::vector<std::int32_t> inputs, targets;

  // Compute alone: forward + backward with everything resident, the best of the timed steps (what
  // the compute cpus can do). Measured again before each placement (interleaved), so a change in
  // the machine's load moves both sides of the ratio.
  std::int64_t parameters = 0;
  int compute_threads = 0, copy_engines = 0;
  CpuBudget budget;
  // `with_update`: the whole all-device step (forward, backward and the device update: all of it
  // compute-stream work), the compute of a placement whose optimizer is on the device.
  auto compute_alone = [&](bool with_update) -> Result<double> {
    STRATA_ASSIGN_OR_RETURN(auto device, Device::create(dc));
    STRATA_ASSIGN_OR_RETURN(auto engine, OffloadEngine::create(tc, OffloadSettings{}, *device));
    std::vector<double> t;
    // At least 10 timed samples: the best of few is a poor estimate of what the cpus can do.
    for (std::int64_t i = 0; i < warmup + std::max<std::int64_t>(steps, 10); ++i) {
      batcher->batch(static_cast<std::uint64_t>(i), inputs, targets);
      const auto t0 = Clock::now();
      if (with_update) {
        STRATA_RETURN_IF_ERROR(engine->step(inputs, targets).status());
        STRATA_RETURN_IF_ERROR(engine->synchronize());
      } else {
        STRATA_RETURN_IF_ERROR(engine->loss_and_gradients(inputs, targets).status());
      }
      if (i >= warmup) t.push_back(seconds_since(t0));
    }
    return *std::min_element(t.begin(), t.end());
  };
  GemmRoofline roofline;
  {
    auto layout = describe_model(tc.model);
    if (!layout.ok()) return fail(layout.status());
    parameters = layout->num_parameters();
    auto probe = Device::create(dc);
    if (!probe.ok()) return fail(probe.status());
    compute_threads = (*probe)->info().compute_threads;
    copy_engines = (*probe)->info().copy_engines;
    budget = (*probe)->cpu_budget();
    auto stream = (*probe)->create_stream("bench.roofline");
    if (!stream.ok()) return fail(stream.status());
    auto r = measure_gemm_roofline(**probe, **stream, tc.model, tc.micro_batch, tc.seq_len, 3);
    if (!r.ok()) return fail(r.status());
    roofline = *r;
  }
  // The rates of the host cpus and the disk, alone.
  auto host_rates = measure_host(budget, copy_engines, 3);
  if (!host_rates.ok()) return fail(host_rates.status());
  bool any_nvme = false;
  for (const Placement& p : placements) any_nvme |= p.params == Tier::kNvme || p.optimizer == Tier::kNvme;
  DiskRates disk;
  if (any_nvme) {
    auto d = measure_disk(dir, disk_bytes, budget.host, 2);
    if (!d.ok()) return fail(d.status());
    disk = *d;
  }

  Json out;
  out["benchmark"] = "offload";
  out["model"] = std::string(to_string(tc.model.kind));
  out["dtype"] = std::string(to_string(tc.model.dtype));
  out["layers"] = tc.model.n_layer;
  out["width"] = tc.model.n_embd;
  out["parameters"] = parameters;
  out["batch"] = tc.micro_batch;
  out["seq_len"] = tc.seq_len;
  out["steps"] = steps;
  out["compute_threads"] = compute_threads;
  out["omp_wait_policy"] = std::getenv("OMP_WAIT_POLICY") ? std::getenv("OMP_WAIT_POLICY") : "default";
  out["host_threads"] = budget.host_threads;
  out["cores"] = budget.allowed.size();
  out["cpus"] = Json{{"allowed", budget.allowed.to_string()},
                     {"compute", budget.compute.to_string()},
                     {"host", budget.host.to_string()},
                     {"pinned", budget.pin},
                     {"shared", budget.shared()}};
  Json rates;
  rates["host_copy_gb_per_s"] = host_rates->copy_bytes_per_s / 1e9;
  rates["host_copy_threads"] = host_rates->copy_threads;
  rates["crc32c_gb_per_s"] = host_rates->crc_bytes_per_s / 1e9;
  rates["gemm_roofline_gflops_per_s"] = roofline.flops_per_s() / 1e9;
  if (any_nvme) {
    rates["disk"] = Json{{"read_gb_per_s", disk.read_bytes_per_s / 1e9},
                         {"read_block", disk.read_block},
                         {"read_queue_depth", disk.read_depth},
                         {"write_gb_per_s", disk.write_bytes_per_s / 1e9},
                         {"write_block", disk.write_block},
                         {"write_queue_depth", disk.write_depth},
                         {"bytes_per_pass", disk.bytes}};
  }
  Json rows = Json::array();
  double all_device_step = 0, ordinary_host_step = 0, compute_best = 0;
  int index = 0;
  for (const Placement& p : placements) {
    // Each placement's swap files in a directory of their own, removed after it.
    const std::string swap_dir = dir + "/placement-" + std::to_string(index++);
    std::filesystem::create_directories(swap_dir);
    struct RemoveSwap {
      std::string d;
      ~RemoveSwap() {
        std::error_code ec;
        std::filesystem::remove_all(d, ec);
      }
    } remove_swap{swap_dir};
    OffloadSettings os;
    os.params = p.params;
    os.optimizer = p.optimizer;
    os.gradients = p.gradients;
    os.nvme_path = {swap_dir};
    os.io.nvme_path = os.nvme_path;
    // Its own directory (no --nvme-path): a scratch store, whose data files go with the process
    // however it ends (docs/nvme.md "Scratch stores").
    os.nvme_scratch = !temp_dir.empty();
    os.persistence_threshold = 0;
    os.delayed_update = p.delayed;
    os.delayed_update_warmup = 0;
    os.offload_activations = p.activations;
    auto compute = compute_alone(p.optimizer == Tier::kDevice);
    if (!compute.ok()) return fail(compute.status());
    const double compute_s = *compute;
    OffloadStats before, after;
    std::vector<double> step_times;
    {
      auto device = Device::create(dc);
      if (!device.ok()) return fail(device.status());
      auto engine = OffloadEngine::create(tc, os, **device);
      if (!engine.ok()) return fail(engine.status().with_context(p.name));
      ObserveSettings obs;
      obs.stream_times = true;
      (*engine)->observe(obs);
      for (std::int64_t i = 0; i < warmup + steps; ++i) {
        if (i == warmup) {
          Status w = (*engine)->synchronize();
          if (!w.ok()) return fail(w);
          before = (*engine)->stats();
        }
        batcher->batch(static_cast<std::uint64_t>(i), inputs, targets);
        const auto t0 = Clock::now();
        auto m = (*engine)->step(inputs, targets);
        if (!m.ok()) return fail(m.status().with_context(p.name));
        if (i >= warmup) step_times.push_back(seconds_since(t0));
      }
      // The last step's update overlaps nothing: waiting for it belongs to the timed work.
      const auto t0 = Clock::now();
      Status w = (*engine)->synchronize();
      if (!w.ok()) return fail(w);
      step_times.back() += seconds_since(t0);
      after = (*engine)->stats();
    }
    const double n = static_cast<double>(steps);
    const auto per = [&](std::uint64_t a, std::uint64_t b) { return static_cast<std::uint64_t>((b - a) / n); };
    const std::uint64_t h2d = per(before.bytes_h2d, after.bytes_h2d), d2h = per(before.bytes_d2h, after.bytes_d2h);
    const std::uint64_t nr = per(before.bytes_nvme_read, after.bytes_nvme_read);
    const std::uint64_t nw = per(before.bytes_nvme_written, after.bytes_nvme_written);
    // What the step asks of each resource, and the least time each needs alone.
    StepDemand demand;
    demand.compute_s = compute_s;
    if (p.optimizer != Tier::kDevice) {
      auto o = time_optimizer(parameters, tc.model.dtype, budget, 3, Summary::kBest);
      if (!o.ok()) return fail(o.status());
      demand.optimizer_s = *o;
      demand.optimizer_threads = budget.host_threads;
      if (tc.grad_clip > 0) {
        auto sc = time_scan(parameters, 3, Summary::kBest);
        if (!sc.ok()) return fail(sc.status());
        demand.scan_s = *sc;
      }
    }
    demand.copy_bytes = h2d + d2h;
    demand.nvme_read = nr;
    demand.nvme_write = nw;
    if (nr + nw > 0) {
      auto t = time_disk_mixed(swap_dir, disk, nr, nw, 2 * disk_bytes, budget.host, 3);
      if (!t.ok()) return fail(t.status());
      demand.disk_s = *t;
    }
    const PhysicalBound bound = physical_bound(demand, *host_rates, budget, compute_threads);
    Json bound_s;
    for (const BoundTerm& t : bound.terms) bound_s[t.resource] = t.seconds;
    const double step_s = median(step_times);
    if (p.params == Tier::kDevice && p.optimizer == Tier::kDevice) all_device_step = step_s;
    if (std::string_view(p.name) == kOrdinaryHost) ordinary_host_step = step_s;
    if (p.optimizer != Tier::kDevice) compute_best = compute_best > 0 ? std::min(compute_best, compute_s) : compute_s;
    Json row;
    row["placement"] = p.name;
    row["step_s"] = step_s;
    row["lower_bound_s"] = bound.seconds;
    row["bottleneck"] = bound.bottleneck;
    row["efficiency"] = bound.seconds / step_s;
    row["gap_s"] = step_s - bound.seconds;
    row["bound_s"] = bound_s;
    row["demand"] = Json{{"compute_s", demand.compute_s},
                         {"copy_bytes", demand.copy_bytes},
                         {"optimizer_s", demand.optimizer_s},
                         {"scan_s", demand.scan_s},
                         {"disk_s", demand.disk_s}};
    row["vs_all_device"] = all_device_step > 0 ? all_device_step / step_s : 1.0;
    if (p.delayed || p.activations) row["vs_ordinary"] = ordinary_host_step / step_s;
    row["stall_s"] = (after.fetch_stall_seconds - before.fetch_stall_seconds + after.update_stall_seconds -
                      before.update_stall_seconds) /
                     n;
    const double accesses = static_cast<double>(after.param_accesses - before.param_accesses);
    row["prefetch_hit_rate"] =
        accesses > 0 ? static_cast<double>(after.prefetch_hits - before.prefetch_hits) / accesses : 1.0;
    // NVMe optimizer: sub-group reads issued during backward, ahead of the update, per step.
    row["early_optimizer_reads_per_step"] =
        static_cast<double>(after.early_optimizer_reads - before.early_optimizer_reads) / n;
    row["bytes_per_step"] =
        Json{{"h2d", h2d},
             {"d2h", d2h},
             {"nvme_read", nr},
             {"nvme_write", nw},
             // The model's tensor-parallel collectives: 0 here (one process, no group), kept so
             // the row has every link strata train --metrics shows.
             {"tensor_parallel", per(before.bytes_tp, after.bytes_tp)},
             {"activations", per(before.bytes_activations_to_host + before.bytes_activations_to_device,
                                 after.bytes_activations_to_host + after.bytes_activations_to_device)}};
    row["allocations_after_warmup"] = after.allocations_after_warmup;
    {
      const double compute_cpu = (after.compute_cpu_seconds - before.compute_cpu_seconds) / n;
      const double copy_cpu = (after.copy_cpu_seconds - before.copy_cpu_seconds) / n;
      const double io_cpu = (after.io_cpu_seconds - before.io_cpu_seconds) / n;
      const double opt_cpu = (after.optimizer_cpu_seconds - before.optimizer_cpu_seconds) / n;
      row["cpu_s"] = Json{{"compute", compute_cpu},
                          {"copy", copy_cpu},
                          {"io", io_cpu},
                          {"optimizer", opt_cpu},
                          {"total", compute_cpu + copy_cpu + io_cpu + opt_cpu}};
    }
    rows.push_back(row);
  }
  out["placements"] = rows;
  // The step's GEMMs alone over the best compute alone: how much of compute is matmul at the
  // machine's matmul rate (the rest is the other kernels and the schedule's gaps).
  rates["compute_vs_gemm_roofline"] = compute_best > 0 ? roofline.seconds / compute_best : 0.0;
  out["rates"] = rates;
  out["target_efficiency"] = 0.9;
  std::printf("%s\n", out.dump(2).c_str());
  return kExitOk;
}

}  // namespace

STRATA_CLI_BENCH(offload, "time the step of each placement against its parts run alone", bench_offload);

}  // namespace strata::cli
