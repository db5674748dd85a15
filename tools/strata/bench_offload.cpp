// strata bench offload: for each placement, the offloaded step against its parts run alone in the
// same process.
//
//   step_s          median step time of the placement (after warm-up)
//   parts_s         each part alone, on a fresh device of the same configuration:
//                     compute    forward + backward with everything resident (all-device engine)
//                     h2d, d2h   copies of the bytes one step moved over each link, pinned <-> device
//                     optimizer  CPU Adam over every parameter with the engine's host threads
//                                (placements whose optimizer is off the device)
//                     nvme_read, nvme_write  the bytes one step moved to and from NVMe, through
//                                a swap store on the same directory, checksums on
//   lower_bound_s   the largest part: a step cannot be shorter than its busiest engine
//   efficiency      lower_bound_s / step_s: 1.0 is perfect overlap
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
//
// The cpus are split by the device's CpuBudget (cpu_budget.hpp): compute pinned to compute_cpus,
// copies, I/O and the host optimizer to host_cpus; STRATA_CPU_AFFINITY=0 runs the same split's
// thread counts unpinned. The optimizer part alone runs on a thread pinned like the engine's.
//
// On the cpu backend "device" compute, copies (memcpy on copy-engine threads), I/O threads and the
// host optimizer share the machine's cores, so a part alone runs faster than it can inside the
// step; docs/performance.md says how the figure maps to a GPU machine.
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
         "NVMe + optimizer on host; everything on NVMe) and, in the same run, each part of the step\n"
         "alone; prints efficiency = largest part / step.\n\nflags:\n" +
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

  // Compute alone: forward + backward with everything resident. Measured again before each
  // placement (interleaved), so a change in the machine's load moves both sides of the ratio.
  std::int64_t parameters = 0;
  int compute_threads = 0;
  CpuBudget budget;
  auto compute_alone = [&]() -> Result<double> {
    STRATA_ASSIGN_OR_RETURN(auto device, Device::create(dc));
    STRATA_ASSIGN_OR_RETURN(auto engine, OffloadEngine::create(tc, OffloadSettings{}, *device));
    std::vector<double> t;
    for (std::int64_t i = 0; i < warmup + steps; ++i) {
      batcher->batch(static_cast<std::uint64_t>(i), inputs, targets);
      const auto t0 = Clock::now();
      STRATA_RETURN_IF_ERROR(engine->loss_and_gradients(inputs, targets).status());
      if (i >= warmup) t.push_back(seconds_since(t0));
    }
    return median(t);
  };
  {
    auto layout = describe_model(tc.model);
    if (!layout.ok()) return fail(layout.status());
    parameters = layout->num_parameters();
    auto probe = Device::create(dc);
    if (!probe.ok()) return fail(probe.status());
    compute_threads = (*probe)->info().compute_threads;
    budget = (*probe)->cpu_budget();
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
  Json rows = Json::array();
  double all_device_step = 0, ordinary_host_step = 0;
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
    auto compute = compute_alone();
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
    Json parts;
    parts["compute"] = compute_s;
    {
      auto device = Device::create(dc);
      if (!device.ok()) return fail(device.status());
      auto a = time_copy(**device, h2d, CopyKind::kHostToDevice, 5);
      if (!a.ok()) return fail(a.status());
      auto b = time_copy(**device, d2h, CopyKind::kDeviceToHost, 5);
      if (!b.ok()) return fail(b.status());
      parts["h2d"] = *a;
      parts["d2h"] = *b;
    }
    if (p.optimizer != Tier::kDevice) {
      auto o = time_optimizer(parameters, tc.model.dtype, budget, 3);
      if (!o.ok()) return fail(o.status());
      parts["optimizer"] = *o;
    }
    if (nr + nw > 0) {
      auto t = time_nvme(swap_dir, nr, nw, 16u << 20, 3);
      if (!t.ok()) return fail(t.status());
      parts["nvme_read"] = t->read_s;
      parts["nvme_write"] = t->write_s;
    }
    double lower = 0;
    for (auto it = parts.begin(); it != parts.end(); ++it) lower = std::max(lower, it.value().get<double>());
    const double step_s = median(step_times);
    if (p.params == Tier::kDevice && p.optimizer == Tier::kDevice) all_device_step = step_s;
    if (std::string_view(p.name) == kOrdinaryHost) ordinary_host_step = step_s;
    Json row;
    row["placement"] = p.name;
    row["step_s"] = step_s;
    row["lower_bound_s"] = lower;
    row["efficiency"] = lower / step_s;
    row["vs_all_device"] = all_device_step > 0 ? all_device_step / step_s : 1.0;
    if (p.delayed || p.activations) row["vs_ordinary"] = ordinary_host_step / step_s;
    row["parts_s"] = parts;
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
  out["target_efficiency"] = 0.85;
  std::printf("%s\n", out.dump(2).c_str());
  return kExitOk;
}

}  // namespace

STRATA_CLI_BENCH(offload, "time the step of each placement against its parts run alone", bench_offload);

}  // namespace strata::cli
