// strata plan [flags]: measures this machine (a resident step of the model, copies both ways,
// NVMe through the swap store, CPU Adam), then predicts the step time of every placement and
// tuning that fits the budgets (offload_param x offload_optimizer x gradients tier, prefetch
// depth, NVMe ring buffers, sub-group size) with the engine's step-time model (predict_step),
// prints them ranked and writes the fastest as a DeepSpeed-style config that strata train
// --config and strata config accept. With strata.tensor_parallel_size / pipeline_parallel_size
// in the config each candidate is one rank's: its tensor-parallel shard of its pipeline stage
// (the stage with the most device memory, as strata estimate shows it), with the whole
// pipeline's schedule in the step. Exit 0 planned, 1 nothing fits or a measurement failed,
// 2 bad flags.
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cli.hpp"
#include "measure.hpp"
#include "model_flags.hpp"
#include "profiles.hpp"
#include "settings.hpp"
#include "strata/config.hpp"
#include "strata/offload.hpp"

namespace strata::cli {
namespace {

using Json = nlohmann::ordered_json;

constexpr FlagSpec kPlanFlags[] = {
    {"device-memory", "BYTES", "device budget (default: the device_memory tunable, 2GiB)"},
    {"host-memory", "BYTES", "host budget, pinned included (default: the memory available now)"},
    {"nvme-free", "BYTES", "swap space the NVMe tier may take (default: the free space of --nvme-path)"},
    {"vocab-size", "N",
     "vocabulary size (default 256: the byte tokenizer strata train uses without --vocab)"},
    {"out", "FILE", "write the chosen configuration here (DeepSpeed-style JSON)"},
    {"json", "", "print JSON (machine rates, ranked placements, the chosen one and its config)"},
    {"measure-nvme", "BYTES", "bytes written and read back to measure NVMe (default 128MiB)"},
    {"measure-steps", "N", "timed resident steps to measure compute (default 5, after 1 warm-up)"},
    {"measure-memory", "BYTES",
     "the most the resident model may take while compute is measured; a model above it is measured "
     "at a smaller depth and scaled (default: half the available memory)"},
    {"ranks", "N",
     "data-parallel ranks (default 1): plan each rank's bytes and predict its step with the collectives of "
     "the ZeRO stage the config gets (3 with parameters offloaded, 2 with the optimizer; all on the device: "
     "each of stages 0-3 on the cpu backend, 0 on cuda)"},
    {"link-bandwidth", "GB/s",
     "with --ranks N, tensor or pipeline parallelism: the ranks' link as bus bandwidth (strata bench comm's "
     "busbw; default 12.5, a 100 Gb/s port), for the data- and tensor-parallel collectives and the "
     "pipeline's boundary sends alike"},
    {"link-latency-us", "US",
     "fixed cost of one collective or pipeline message on that link in microseconds (default 20)"},
    {"help", "", "show this help"},
};

std::vector<FlagSpec> all_flags() {
  std::vector<FlagSpec> f(std::begin(kPlanFlags), std::end(kPlanFlags));
  f.insert(f.end(), kProfileFlags, kProfileFlags + kProfileFlagCount);
  for (const FlagSpec& flag : kSettingsFlags) {
    if (flag.name == "config" || flag.name == "strict" || flag.name == "batch" || flag.name == "seq-len" ||
        flag.name == "grad-accum" || flag.name == "grad-clip" || flag.name == "nvme-path" ||
        flag.name.rfind("offload-", 0) == 0)
      f.push_back(flag);
  }
  f.insert(f.end(), std::begin(kModelFlags), std::end(kModelFlags));
  return f;
}

std::string plan_usage() {
  return "usage: strata plan [flags]\n\n"
         "Measures this machine (a resident step of the model, host<->device copies, NVMe through the\n"
         "swap store in --nvme-path, CPU Adam), predicts the step time of every placement and tuning\n"
         "that fits the budgets, prints them ranked, and writes the fastest as a config for\n"
         "strata train --config (--out). NVMe placements are considered only with --nvme-path (or a\n"
         "config's nvme_path). --offload-param / --offload-optimizer / --offload-gradients given here\n"
         "fix that tier and plan the rest. --profile GPU predicts for another machine instead (a GPU,\n"
         "its host link, NVMe drives, cores and memory bandwidth; nothing is measured), with the\n"
         "fraction of each step the GPU computes.\n\nflags:\n" +
         format_flags(all_flags());
}

int fail(const Status& s) {
  std::fprintf(stderr, "strata plan: %s\n", s.message().c_str());
  return kExitFailure;
}

std::string tier_name(Tier t) { return std::string(to_string(t)); }

// DeepSpeed's spelling of a tier in offload_*.device.
const char* ds_device(Tier t) { return t == Tier::kDevice ? "none" : t == Tier::kHost ? "cpu" : "nvme"; }

struct Candidate {
  OffloadSettings settings;
  PlacementEstimate estimate;
  StepPrediction prediction;
};

// The tiers; with several ranks and `with_stage`, the ZeRO stage too (a candidate's; a placement
// refused or left out is every stage of it).
std::string placement_name(const OffloadSettings& s, bool with_stage = true) {
  std::string name = "params " + tier_name(s.params) + ", optimizer " + tier_name(s.optimizer);
  if (s.optimizer != Tier::kDevice) name += ", gradients " + tier_name(s.gradients);
  if (with_stage && s.dp_size > 1) name += ", stage " + std::to_string(s.zero_stage);
  return name;
}

// The ZeRO stage a placement's config gets by default: 3 with the parameters offloaded, 2 with
// the optimizer, else 0.
int default_stage(Tier params, Tier optimizer) {
  return params != Tier::kDevice ? 3 : optimizer != Tier::kDevice ? 2 : 0;
}

// The stages plan tries for a placement. With the optimizer on the device and several ranks on
// the cpu backend, stages 1-3 shard its state, then the gradients, then the parameters over the
// ranks' device memory (docs/parallel.md "ZeRO stages 1-3 in device memory"): less device memory
// for more collectives, so each is a candidate of its own. Elsewhere the default stage only (the
// host optimizer is sharded at any stage; cuda refuses stages 1-3 in device memory).
std::vector<int> stages_to_try(Tier params, Tier optimizer, std::int64_t ranks, bool cuda) {
  if (ranks > 1 && optimizer == Tier::kDevice && params == Tier::kDevice && !cuda) return {0, 1, 2, 3};
  return {default_stage(params, optimizer)};
}

// The gradient buckets tried with the optimizer on the device and several ranks on the cpu
// backend (docs/parallel.md "Gradient buckets"): stage 0 all-reduces and stages 2-3 reduce-scatter
// each bucket as backward leaves it, so the bucket size sets how much of that hides under the rest
// of backward, and at stages 2-3 the bucket buffers are device memory (the config's size, often
// the whole gradient, can take more than the sharding saves). Tried: the config's size, the
// largest module and 4 modules' worth, each with overlap_comm off and on. Elsewhere the config's.
struct BucketTuning {
  std::int64_t elements;
  bool overlap_comm;
};
std::vector<BucketTuning> bucket_tunings(const OffloadSettings& base, int stage, std::int64_t ranks,
                                         bool cuda, std::uint64_t largest) {
  const bool bucketed = ranks > 1 && !cuda && base.optimizer == Tier::kDevice && stage != 1;
  if (!bucketed) return {{base.reduce_bucket_elements, base.overlap_comm}};
  std::vector<std::int64_t> sizes{base.reduce_bucket_elements};
  for (std::uint64_t n : {largest, 4 * largest}) {
    const auto e = static_cast<std::int64_t>(n);
    if (std::find(sizes.begin(), sizes.end(), e) == sizes.end()) sizes.push_back(e);
  }
  std::vector<BucketTuning> out;
  for (std::int64_t e : sizes)
    for (bool overlap : {false, true}) out.push_back({e, overlap});
  return out;
}

Json prediction_json(const StepPrediction& p) {
  return Json{{"step_s", p.step_seconds},
              {"parts_s",
               {{"compute", p.compute},
                {"h2d", p.h2d},
                {"d2h", p.d2h},
                {"nvme_read", p.nvme_read},
                {"nvme_write", p.nvme_write},
                {"optimizer", p.optimizer},
                {"fetch_stall", p.fetch_stall},
                {"update_stall", p.update_stall},
                {"contention", p.contention},
                {"data_parallel", p.dp},
                {"data_parallel_stall", p.dp_stall},
                {"tensor_parallel", p.tp},
                {"pipeline", p.pp},
                {"pipeline_schedule", p.pp_schedule},
                {"pipeline_bubble", p.pp_bubble}}},
              {"bytes_per_step",
               {{"h2d", p.h2d_bytes},
                {"d2h", p.d2h_bytes},
                {"nvme_read", p.nvme_read_bytes},
                {"nvme_write", p.nvme_write_bytes},
                {"data_parallel", p.dp_bytes},
                {"tensor_parallel", p.tp_bytes},
                {"pipeline", p.pp_bytes}}}};
}

// With a profile: the fraction of the step the GPU computes, and the model's TFLOPS (its forward and
// backward FLOPs, recompute not counted, over the step).
void add_gpu_figures(const Candidate& c, const TrainerConfig& tc, Json* j) {
  const double step = c.prediction.step_seconds;
  (*j)["gpu_utilization"] = step > 0 ? c.prediction.compute / step : 0.0;
  (*j)["model_tflops"] = step > 0 ? step_flops(tc) / step / 1e12 : 0.0;
}

Json candidate_json(const Candidate& c) {
  const OffloadSettings& s = c.settings;
  Json j;
  j["placement"] = placement_name(s);
  j["offload_param"] = tier_name(s.params);
  j["offload_optimizer"] = tier_name(s.optimizer);
  j["offload_gradients"] = s.optimizer == Tier::kDevice ? "device" : tier_name(s.gradients);
  j["zero_stage"] = s.zero_stage;
  j["reduce_bucket_size"] = s.reduce_bucket_elements;
  j["overlap_comm"] = s.overlap_comm;
  j["prefetch_modules"] = s.prefetch_modules;
  j["prefetch_elements"] = s.prefetch_elements;
  j["buffer_count"] = s.nvme_buffer_count;
  j["sub_group_size"] = s.sub_group_size;
  if (s.pipeline_bounds.size() > 2) j["pipeline_stage"] = s.pp_stage;
  j["predicted"] = prediction_json(c.prediction);
  j["bytes"] = {{"device", c.estimate.device_need},
                {"host", c.estimate.plan.host_bytes},
                {"pinned", c.estimate.plan.pinned_bytes},
                {"nvme", c.estimate.plan.nvme_bytes},
                {"swap", c.estimate.nvme_need}};
  return j;
}

// The chosen candidate as a config: the --config file's keys (when one was given) with the
// placement's keys set over them.
Json config_json(const RunSettings& rs, const Candidate& c, const std::string& source_path,
                 std::optional<std::uint64_t> device_memory) {
  Json j = Json::object();
  if (!source_path.empty()) {
    std::ifstream in(source_path);
    j = Json::parse(in, nullptr, false);
    if (j.is_discarded() || !j.is_object()) j = Json::object();
  }
  const TrainerConfig& tc = rs.trainer;
  const OffloadSettings& s = c.settings;
  // The batch shape the plan was made for (DeepSpeed's keys; train_batch_size follows from them
  // at world size 1, so a conflicting one from the source config goes).
  j.erase("train_batch_size");
  j["train_micro_batch_size_per_gpu"] = tc.micro_batch;
  j["gradient_accumulation_steps"] = tc.grad_accum;
  j["gradient_clipping"] = tc.grad_clip;
  j["bf16"]["enabled"] = tc.model.dtype == DType::kBF16;
  Json& z = j["zero_optimization"];
  z["stage"] = s.zero_stage;
  z["reduce_bucket_size"] = s.reduce_bucket_elements;
  z["overlap_comm"] = s.overlap_comm;
  z["offload_param"]["device"] = ds_device(s.params);
  z["offload_optimizer"]["device"] = ds_device(s.optimizer);
  const std::string dir = s.nvme_path.empty() ? "" : s.nvme_path.front();
  for (const char* section : {"offload_param", "offload_optimizer"}) {
    z[section].erase("nvme_path");
    z[section]["pin_memory"] = s.pin_memory;
  }
  if (s.params == Tier::kNvme) z["offload_param"]["nvme_path"] = dir;
  if (s.optimizer == Tier::kNvme) z["offload_optimizer"]["nvme_path"] = dir;
  z["offload_optimizer"]["buffer_count"] = s.nvme_buffer_count;
  // The split and the delayed update as planned for this placement (the source config's may not
  // apply to it: the engine would refuse them).
  if (s.optimizer_ratio < 1.0) {
    z["offload_optimizer"]["ratio"] = s.optimizer_ratio;
  } else {
    z["offload_optimizer"].erase("ratio");
  }
  if (s.delayed_update) {
    j["strata"]["delayed_update"] = true;
  } else if (j.contains("strata")) {
    j["strata"].erase("delayed_update");
  }
  z["sub_group_size"] = s.sub_group_size;
  z["stage3_prefetch_bucket_size"] = s.prefetch_elements;
  z["stage3_param_persistence_threshold"] = s.persistence_threshold;
  j["strata"]["offload_prefetch_modules"] = s.prefetch_modules;
  j["strata"]["offload_gradients"] = s.gradients == Tier::kNvme ? "nvme" : "cpu";
  if (device_memory) j["strata"]["device_memory"] = std::to_string(*device_memory);
  return j;
}

std::uint64_t free_space(const std::string& dir) {
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) != 0) return 0;
  return static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
}

std::uint64_t available_memory() {
  const long pages = ::sysconf(_SC_AVPHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
}

// The model-shape flags as given, for the strata train line printed with the config.
std::string shape_flags(const Args& args) {
  std::string out;
  for (const FlagSpec& f : kModelFlags) {
    if (f.name == "device" || f.name == "threads") continue;
    if (auto v = args.get(f.name)) out += " --" + std::string(f.name) + " " + *v;
  }
  for (const char* f : {"batch", "seq-len", "grad-accum", "grad-clip"}) {
    if (auto v = args.get(f)) out += " --" + std::string(f) + " " + *v;
  }
  return out;
}

int run_plan(std::span<const std::string> argv) {
  use_passive_openmp_wait("plan", argv);  // measure compute as strata train runs it
  const auto flags = all_flags();
  auto parsed = Args::parse(argv, flags);
  if (!parsed.ok()) return usage_error("plan", parsed.status().message(), plan_usage());
  const Args& args = *parsed;
  if (args.has("help")) {
    std::fputs(plan_usage().c_str(), stdout);
    return kExitOk;
  }
  if (!args.positionals().empty()) {
    return usage_error("plan", "unexpected argument '" + args.positionals()[0] + "'", plan_usage());
  }
  auto usage = [&](const Status& s) { return usage_error("plan", s.message(), plan_usage()); };
  std::optional<MachineProfile> profile;
  if (args.has("profile")) {
    auto p = profile_from_flags(args);
    if (!p.ok()) return usage(p.status());
    profile = *p;
  } else {
    for (std::size_t i = 0; i < kProfileFlagCount; ++i) {
      if (args.has(kProfileFlags[i].name))
        return usage(invalid_argument("flag '--" + std::string(kProfileFlags[i].name) + "' needs --profile"));
    }
  }
  const std::string config_path = args.get("config").value_or("");
  RunSettings rs;
  if (Status s = load_settings(args, config_path, &rs); !s.ok()) return fail(s);
  if (Status s = apply_settings_flags(args, &rs); !s.ok()) return usage(s);
  if (Status v = int_flag(args, "vocab-size", 1, 1 << 24, &rs.trainer.model.vocab_size); !v.ok())
    return usage(v);
  if (Status v = rs.trainer.validate(); !v.ok()) return usage(v);
  // The config's tensor and pipeline parallel layout (as strata estimate reads it): each candidate
  // is one rank's shard of one stage, and the step model adds the tensor-parallel collectives and
  // the pipeline's schedule (docs/offload.md "Predicting the step").
  int pp = 1;
  if (Status g = apply_model_parallel(&rs, &pp); !g.ok()) return fail(g);
  const int tp = rs.offload.tp_size;
  constexpr std::uint64_t kMax = ~0ull;
  auto device_mem = args.get_bytes("device-memory", 0, 1u << 20, kMax);
  auto host_mem = args.get_bytes("host-memory", 0, 1u << 20, kMax);
  auto nvme_free = args.get_bytes("nvme-free", 0, 1, kMax);
  auto measure_nvme = args.get_bytes("measure-nvme", 128ull << 20, 1u << 20, 1ull << 40);
  auto measure_memory = args.get_bytes("measure-memory", 0, 1u << 20, kMax);
  for (const auto* r : {&device_mem, &host_mem, &nvme_free, &measure_nvme, &measure_memory}) {
    if (!r->ok()) return usage(r->status());
  }
  MeasureSettings ms;
  ms.steps = 5;
  if (Status v = int_flag(args, "measure-steps", 1, 1000, &ms.steps); !v.ok()) return usage(v);
  ms.nvme_bytes = *measure_nvme;
  std::int64_t ranks = 1;
  if (Status v = int_flag(args, "ranks", 1, 1 << 20, &ranks); !v.ok()) return usage(v);
  auto link = args.get_double("link-bandwidth", kDefaultDpBusBytesPerSecond / 1e9, 1e-6, 1e6);
  auto latency = args.get_double("link-latency-us", kDefaultDpCollectiveSeconds * 1e6, 0.0, 1e7);
  for (const auto* r : {&link, &latency}) {
    if (!r->ok()) return usage(r->status());
  }
  rs.offload.dp_size = static_cast<int>(ranks);
  ms.compute_memory = *measure_memory;
  const std::string out_path = args.get("out").value_or("");
  if (!out_path.empty()) {
    std::filesystem::path dir = std::filesystem::path(out_path).parent_path();
    if (dir.empty()) dir = ".";
    if (!std::filesystem::is_directory(dir)) {
      return fail(io_error("--out file '" + out_path + "' cannot be written: directory '" + dir.string() +
                           "' does not exist"));
    }
  }

  // ---- budgets ----
  Options& options = rs.options;
  DeviceConfig dc;
  if (Status s = device_options(args, 0, &options, &dc); !s.ok()) {
    return s.code() == StatusCode::kInvalidArgument ? usage(s) : fail(s);
  }
  const bool cuda = profile || dc.kind == DeviceKind::kCuda;
  if (cuda && (tp > 1 || pp > 1)) {
    // The engine refuses both there (check_tensor_parallel_placement, check_pipeline), so no
    // placement could train.
    Options o = rs.options;
    (void)o.load_env();
    const Option key = tp > 1 ? Option::kTensorParallelSize : Option::kPipelineParallelSize;
    return fail(
        invalid_argument(o.source(key) + " = " + std::to_string(tp > 1 ? tp : pp) + ": " +
                         (tp > 1 ? "tensor parallel" : "pipeline parallel") +
                         " on the cuda backend is not built yet; plan on the cpu backend (--device cpu)"));
  }
  EstimateBudgets budgets;
  budgets.device = args.has("device-memory") ? *device_mem
                   : profile                  ? profile->device_memory
                                              : options.get_bytes(Option::kDeviceMemory);
  budgets.host = args.has("host-memory") ? *host_mem : profile ? profile->host_memory : available_memory();
  if (profile && rs.offload.nvme_path.empty()) {
    // The profiled machine's drives: a name only (nothing touches a disk), which the written config
    // keeps for the user to replace.
    rs.offload.nvme_path = {"/path/to/nvme"};
    rs.offload.io.nvme_path = rs.offload.nvme_path;
  }
  const std::string nvme_dir = rs.offload.nvme_path.empty() ? "" : rs.offload.nvme_path.front();
  if (!nvme_dir.empty() && !profile && !std::filesystem::is_directory(nvme_dir)) {
    return fail(not_found("--nvme-path '" + nvme_dir + "' is not a directory"));
  }
  budgets.nvme = args.has("nvme-free") ? *nvme_free
                 : profile             ? profile->nvme_bytes * static_cast<std::uint64_t>(profile->nvme_drives)
                 : nvme_dir.empty()    ? 0
                                       : free_space(nvme_dir);

  // ---- candidates: placements that fit, each with its tuning ----
  const bool fix_params = args.has("offload-param");
  const bool fix_optimizer = args.has("offload-optimizer");
  const bool fix_gradients = args.has("offload-gradients");
  if (fix_gradients && rs.offload.gradients == Tier::kNvme && fix_optimizer &&
      rs.offload.optimizer != Tier::kNvme) {
    return usage(invalid_argument(
        "flag '--offload-gradients nvme' needs the optimizer on NVMe: --offload-optimizer nvme"));
  }
  if (fix_params && fix_optimizer && rs.offload.params != Tier::kDevice &&
      rs.offload.optimizer == Tier::kDevice) {
    return usage(
        invalid_argument("flag '--offload-param " + tier_name(rs.offload.params) +
                         "' needs the optimizer off the device too: --offload-optimizer cpu or nvme"));
  }
  if (fix_gradients && rs.offload.gradients == Tier::kDevice) {
    return usage(invalid_argument("flag '--offload-gradients': gradients wait on cpu or nvme"));
  }
  auto layout = describe_model(rs.trainer.model);
  if (!layout.ok()) return usage(layout.status());
  std::uint64_t largest = 1;
  for (const ModuleDesc& md : layout->modules)
    largest = std::max<std::uint64_t>(largest, (md.grad_end - md.grad_begin) / 4);
  struct Refused {
    std::string placement;
    std::string why;
  };
  std::vector<Candidate> candidates;
  std::vector<Refused> refused;
  std::vector<std::string> left_out;
  constexpr Tier kTiers[] = {Tier::kDevice, Tier::kHost, Tier::kNvme};
  for (Tier params : kTiers) {
    for (Tier optimizer : kTiers) {
      for (Tier gradients : {Tier::kHost, Tier::kNvme}) {
        if (params != Tier::kDevice && optimizer == Tier::kDevice) continue;
        if (gradients == Tier::kNvme && optimizer != Tier::kNvme) continue;
        if (fix_params && params != rs.offload.params) continue;
        if (fix_optimizer && optimizer != rs.offload.optimizer) continue;
        if (fix_gradients && gradients != rs.offload.gradients) continue;
        OffloadSettings base = rs.offload;
        base.params = params;
        base.optimizer = optimizer;
        base.gradients = gradients;
        const bool nvme = params == Tier::kNvme || optimizer == Tier::kNvme;
        if (nvme && nvme_dir.empty()) {
          left_out.push_back(placement_name(base, /*with_stage=*/false));
          continue;
        }
        std::vector<int> buffers =
            optimizer == Tier::kNvme ? std::vector<int>{3, 4, 8} : std::vector<int>{base.nvme_buffer_count};
        std::vector<std::int64_t> groups{base.sub_group_size};
        if (optimizer == Tier::kNvme) {
          groups.clear();
          for (std::uint64_t div : {1, 4, 16}) {
            const std::uint64_t g = std::max<std::uint64_t>(65536, (largest + div - 1) / div);
            const auto gg = static_cast<std::int64_t>((g + 63) / 64 * 64);
            if (std::find(groups.begin(), groups.end(), gg) == groups.end()) groups.push_back(gg);
          }
        }
        std::string why;
        // One tuning: planned, kept if it fits, else the first reason it does not is remembered.
        auto consider = [&](OffloadSettings s) -> Status {
          // Settings only some placements take (as estimate_placement): the delayed update and the
          // partial optimizer split are predicted and written where the engine takes them, and
          // left out elsewhere.
          s = placement_settings(s);
          // A pipeline: every stage planned; the row is the stage with the most device memory
          // (strata estimate's), and it fits only where every stage does.
          auto e = estimate_placement(rs.trainer, s, budgets, cuda);
          if (!e.ok()) return pp > 1 ? e.status().with_context("pipeline stage 0") : e.status();
          for (int st = 1; st < pp; ++st) {
            OffloadSettings other = s;
            other.pp_stage = st;
            auto e2 = estimate_placement(rs.trainer, other, budgets, cuda);
            if (!e2.ok()) return e2.status().with_context("pipeline stage " + std::to_string(st));
            if (fold_stage_estimate(*e, std::move(*e2))) s.pp_stage = st;
          }
          // The cpu backend's device memory is this machine's memory too.
          const std::uint64_t all_memory = e->device_need + e->plan.host_bytes + e->plan.pinned_bytes;
          const bool fits_memory = cuda || args.has("host-memory") || all_memory <= budgets.host;
          if (e->fits() && fits_memory) {
            Candidate c;
            c.settings = s;
            c.estimate = std::move(*e);
            candidates.push_back(std::move(c));
            return ok_status();
          }
          if (!why.empty()) return ok_status();
          if (!e->fits_device)
            why =
                "device needs " + format_bytes(e->device_need) + " > budget " + format_bytes(budgets.device);
          else if (!e->fits_host)
            why = "host needs " + format_bytes(e->plan.host_bytes + e->plan.pinned_bytes) + " > budget " +
                  format_bytes(budgets.host);
          else if (!fits_memory)
            why = "device + host need " + format_bytes(all_memory) + " > " + format_bytes(budgets.host) +
                  " available (the cpu backend's device memory is host memory)";
          else
            why = "swap needs " + format_bytes(e->nvme_need) + " > " + format_bytes(budgets.nvme) + " free";
          return ok_status();
        };
        for (int stage : stages_to_try(params, optimizer, ranks, cuda)) {
          // Fetched parameters (offloaded, or stage 3's slices in device memory, gathered by the
          // same prefetcher): the prefetch depth is tuned.
          const bool fetched = params != Tier::kDevice || (stage == 3 && ranks > 1);
          const std::vector<int> depths =
              fetched ? std::vector<int>{0, 1, 2, 4} : std::vector<int>{base.prefetch_modules};
          for (const BucketTuning& b : bucket_tunings(base, stage, ranks, cuda, largest)) {
            for (int k : depths) {
              for (int r : buffers) {
                for (std::int64_t g : groups) {
                  OffloadSettings s = base;
                  s.prefetch_modules = k;
                  // The prefetch budget holds the look-ahead, so the depth is what limits it.
                  if (fetched)
                    s.prefetch_elements =
                        std::max<std::int64_t>(1, static_cast<std::int64_t>(largest) * std::max(1, k));
                  s.nvme_buffer_count = r;
                  s.sub_group_size = g;
                  if (nvme) s.io.nvme_path = s.nvme_path;
                  // The stage config_json writes for this candidate (bytes and collectives follow it).
                  s.zero_stage = stage;
                  s.reduce_bucket_elements = b.elements;
                  s.overlap_comm = b.overlap_comm;
                  if (Status st = consider(s); !st.ok()) return fail(st);
                }
              }
            }
          }
        }
        bool any = false;
        for (const Candidate& c : candidates) {
          any = any || (c.settings.params == params && c.settings.optimizer == optimizer &&
                        c.settings.gradients == gradients);
        }
        if (!any) refused.push_back({placement_name(base, /*with_stage=*/false), why});
      }
    }
  }
  const bool as_json = args.has("json");
  if (candidates.empty()) {
    std::string msg = "no placement fits the budgets (device " + format_bytes(budgets.device) + ", host " +
                      format_bytes(budgets.host) +
                      (nvme_dir.empty() ? "" : ", nvme " + format_bytes(budgets.nvme)) + "):";
    for (const Refused& r : refused) msg += "\n  " + r.placement + ": " + r.why;
    for (const std::string& p : left_out) msg += "\n  " + p + ": not considered without --nvme-path";
    msg += "\nraise --device-memory or --host-memory, give --nvme-path, or lower --batch / --seq-len";
    return fail(out_of_memory(msg));
  }

  // ---- measure ----
  ms.nvme_dir = std::any_of(candidates.begin(), candidates.end(),
                            [](const Candidate& c) {
                              return c.settings.params == Tier::kNvme || c.settings.optimizer == Tier::kNvme;
                            })
                    ? nvme_dir
                    : "";
  // The run's device is the one strata train makes for the placement (device_options): with
  // anything offloaded, the cpu budget's split (compute on its cpus, the host engines on theirs);
  // with nothing offloaded, every cpu for compute. Each candidate is predicted with the rates of
  // the device it will run on: measured twice when both kinds are candidates and they differ.
  const auto offloaded = [](const Candidate& c) {
    return c.settings.params != Tier::kDevice || c.settings.optimizer != Tier::kDevice;
  };
  const bool any_offloaded = std::any_of(candidates.begin(), candidates.end(), offloaded);
  const bool any_resident = !std::all_of(candidates.begin(), candidates.end(), offloaded);
  DeviceConfig split_dc;
  if (Status s = device_options(args, 0, &options, &split_dc, /*host_work=*/true); !s.ok()) return fail(s);
  MeasureReport report;
  Result<MachineRates> rates = internal_error("no rates");
  std::optional<MachineRates> resident_rates;  // the all-device candidates', when they differ
  if (profile) {
    rates = profile_rates(*profile, rs.trainer);
  } else {
    if (!as_json) std::printf("measuring this machine ...\n");
    std::fflush(stdout);
    DeviceConfig mdc = any_offloaded ? split_dc : dc;
    mdc.memory_bytes = 64ull << 20;  // measure_machine sizes each device for its part
    rates = measure_machine(rs.trainer, mdc, ms, &report);
    if (rates.ok() && any_offloaded && any_resident && dc.compute_threads != split_dc.compute_threads) {
      DeviceConfig rdc = dc;
      rdc.memory_bytes = 64ull << 20;
      MeasureSettings compute_only = ms;
      compute_only.nvme_dir.clear();
      MeasureReport unused;
      auto r = measure_machine(rs.trainer, rdc, compute_only, &unused);
      if (!r.ok()) return fail(r.status());
      resident_rates = *r;
    }
  }
  if (!rates.ok()) return fail(rates.status());
  for (MachineRates* r : {&*rates, resident_rates ? &*resident_rates : nullptr}) {
    if (r == nullptr) continue;
    r->dp_bus_bytes_per_s = *link * 1e9;
    r->dp_collective_seconds = *latency * 1e-6;
    // One link for every group (the cpu backend's ranks share this machine; across machines
    // --link-bandwidth is the slowest hop the groups cross).
    r->tp_bus_bytes_per_s = r->pp_link_bytes_per_s = *link * 1e9;
    r->tp_collective_seconds = r->pp_message_seconds = *latency * 1e-6;
  }

  // ---- predict and rank ----
  for (Candidate& c : candidates) {
    auto p = predict_step(rs.trainer, c.settings, resident_rates && !offloaded(c) ? *resident_rates : *rates);
    if (!p.ok()) return fail(p.status().with_context(placement_name(c.settings)));
    c.prediction = *p;
  }
  std::stable_sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    // Predictions within 1% are a tie: the one with less device memory wins, then less pinned.
    const double x = a.prediction.step_seconds, y = b.prediction.step_seconds;
    if (std::abs(x - y) > 0.01 * std::min(x, y)) return x < y;
    if (a.estimate.device_need != b.estimate.device_need)
      return a.estimate.device_need < b.estimate.device_need;
    return a.estimate.plan.pinned_bytes < b.estimate.plan.pinned_bytes;
  });
  // The best tuning of each placement, ranked.
  std::vector<const Candidate*> best;
  for (const Candidate& c : candidates) {
    bool seen = false;
    for (const Candidate* b : best) {
      seen =
          seen ||
          (b->settings.params == c.settings.params && b->settings.optimizer == c.settings.optimizer &&
           b->settings.gradients == c.settings.gradients && b->settings.zero_stage == c.settings.zero_stage);
    }
    if (!seen) best.push_back(&c);
  }
  const Candidate& chosen = candidates.front();
  std::optional<std::uint64_t> device_memory;
  if (args.has("device-memory")) device_memory = *device_mem;
  const Json config = config_json(rs, chosen, config_path, device_memory);
  if (!out_path.empty()) {
    std::ofstream out(out_path, std::ios::trunc);
    out << config.dump(2) << '\n';
    out.flush();
    if (!out) return fail(io_error("cannot write --out file '" + out_path + "'"));
  }
  const std::string train_line =
      "strata train --config " + (out_path.empty() ? std::string("FILE") : out_path) + shape_flags(args);

  if (as_json) {
    Json j;
    j["model"] = Json::parse(model_config_to_json(rs.trainer.model));
    j["parameters"] = layout->num_parameters();
    j["micro_batch"] = rs.trainer.micro_batch;
    j["grad_accum"] = rs.trainer.grad_accum;
    j["seq_len"] = rs.trainer.seq_len;
    j["data_parallel_size"] = ranks;
    j["tensor_parallel_size"] = tp;
    j["pipeline_parallel_size"] = pp;
    j["sequence_parallel"] = rs.offload.sequence_parallel;
    if (pp > 1) {
      j["pipeline_schedule"] = std::string(to_string(rs.offload.pipeline_schedule));
      j["pipeline_virtual_stages"] = rs.offload.pipeline_virtual_stages;
    }
    j["budgets"] = {{"device", budgets.device}, {"host", budgets.host}, {"nvme", budgets.nvme}};
    const MachineRates& r = *rates;
    j["machine"] = {{"cores", report.cores},
                    {"compute_threads", report.compute_threads},
                    {"host_threads", report.host_threads},
                    {"measured_layers", report.measured_layers},
                    {"resident_step_s", report.step_s},
                    {"forward_s", report.forward_s},
                    {"forward_backward_s", report.forward_backward_s},
                    {"device_update_s", r.device_update_seconds},
                    {"h2d_bytes_per_s", r.h2d_bytes_per_s},
                    {"d2h_bytes_per_s", r.d2h_bytes_per_s},
                    {"host_copy_bytes_per_s", r.host_copy_bytes_per_s},
                    {"nvme_measured", !ms.nvme_dir.empty()},
                    {"nvme_read_bytes_per_s", ms.nvme_dir.empty() ? 0.0 : r.nvme_read_bytes_per_s},
                    {"nvme_write_bytes_per_s", ms.nvme_dir.empty() ? 0.0 : r.nvme_write_bytes_per_s},
                    {"nvme_request_s", r.nvme_request_seconds},
                    {"nvme_cpu_fraction", r.nvme_cpu_fraction},
                    {"adam_elements_per_s", r.adam_elements_per_s},
                    {"scan_elements_per_s", r.scan_elements_per_s},
                    {"shared_cores", r.shared_cores},
                    {"ranks", ranks},
                    {"dp_bus_bytes_per_s", r.dp_bus_bytes_per_s},
                    {"dp_collective_s", r.dp_collective_seconds},
                    {"tp_bus_bytes_per_s", r.tp_bus_bytes_per_s},
                    {"tp_collective_s", r.tp_collective_seconds},
                    {"pp_link_bytes_per_s", r.pp_link_bytes_per_s},
                    {"pp_message_s", r.pp_message_seconds},
                    {"measure_s", report.seconds}};
    if (profile) {
      j["machine"] = {{"profile", describe(*profile)},
                      {"gpu", profile->gpu},
                      {"gpu_peak_tflops", profile->gpu_peak_flops / 1e12},
                      {"gpu_efficiency", profile->gpu_efficiency},
                      {"host_link", profile->host_link},
                      {"host_link_bytes_per_s", profile->link_bytes_per_s},
                      {"nvme_drives", profile->nvme_drives},
                      {"nvme_read_bytes_per_s", r.nvme_read_bytes_per_s},
                      {"nvme_write_bytes_per_s", r.nvme_write_bytes_per_s},
                      {"cpu_cores", profile->cpu_cores},
                      {"host_memory_bytes_per_s", profile->host_memory_bytes_per_s},
                      {"adam_elements_per_s", r.adam_elements_per_s},
                      {"device_update_s", r.device_update_seconds}};
    }
    Json rows = Json::array();
    for (const Candidate* c : best) {
      rows.push_back(candidate_json(*c));
      if (profile) add_gpu_figures(*c, rs.trainer, &rows.back());
    }
    j["placements"] = rows;
    Json ref = Json::array();
    for (const Refused& r2 : refused) ref.push_back({{"placement", r2.placement}, {"why", r2.why}});
    for (const std::string& p : left_out)
      ref.push_back({{"placement", p}, {"why", "not considered without --nvme-path"}});
    j["refused"] = ref;
    j["evaluated"] = candidates.size();
    j["chosen"] = candidate_json(chosen);
    if (profile) add_gpu_figures(chosen, rs.trainer, &j["chosen"]);
    j["config"] = config;
    j["out"] = out_path;
    j["train_command"] = train_line;
    std::printf("%s\n", j.dump(2).c_str());
    return kExitOk;
  }

  const MachineRates& r = *rates;
  if (profile) {
    double fwd = 0, bwd = 0;
    for (double f : r.forward_seconds) fwd += f;
    for (double b : r.backward_seconds) bwd += b;
    std::printf("machine  profile (predicted, nothing measured): %s\n", describe(*profile).c_str());
    std::printf("  compute   forward %.4f s, backward %.4f s per micro-batch; device update %.4f s\n", fwd, bwd,
                r.device_update_seconds);
    std::printf("  cpu adam  %.0f M elements/s; nvme %.1f GB/s read, %.1f GB/s write\n",
                r.adam_elements_per_s / 1e6, r.nvme_read_bytes_per_s / 1e9, r.nvme_write_bytes_per_s / 1e9);
  } else {
  std::printf("machine  %d cores (%d compute threads, host optimizer on %d); measured in %.1f s\n",
              report.cores, report.compute_threads, report.host_threads, report.seconds);
  std::printf("  compute   resident step %.4f s (forward %.4f s, backward %.4f s per micro-batch%s)\n",
              report.step_s, report.forward_s, report.forward_backward_s - report.forward_s,
              report.measured_layers != rs.trainer.model.n_layer
                  ? (", measured at " + std::to_string(report.measured_layers) + " layers and scaled").c_str()
                  : "");
  std::printf("  copies    h2d %.2f GB/s, d2h %.2f GB/s, host to host %.2f GB/s (%s each)\n",
              r.h2d_bytes_per_s / 1e9, r.d2h_bytes_per_s / 1e9, r.host_copy_bytes_per_s / 1e9,
              format_bytes(report.copy_bytes).c_str());
  if (!ms.nvme_dir.empty()) {
    std::printf("  nvme      read %.2f GB/s, write %.2f GB/s, %.3f ms per request, %.0f%% CPU (%s in %s)\n",
                r.nvme_read_bytes_per_s / 1e9, r.nvme_write_bytes_per_s / 1e9, 1e3 * r.nvme_request_seconds,
                100 * r.nvme_cpu_fraction, format_bytes(report.nvme_bytes).c_str(), nvme_dir.c_str());
  }
  std::printf("  cpu adam  %.1f M elements/s on %d threads; gradient scan %.1f M elements/s\n",
              r.adam_elements_per_s / 1e6, report.host_threads, r.scan_elements_per_s / 1e6);
  }
  if (ranks > 1 || tp > 1 || pp > 1) {
    std::printf(
        "  link      %lld data-parallel x %d tensor-parallel x %d pipeline ranks, bus bandwidth %.3g GB/s, "
        "%.3g us per collective or message (given)\n",
        static_cast<long long>(ranks), tp, pp, r.dp_bus_bytes_per_s / 1e9, r.dp_collective_seconds * 1e6);
  }
  const bool grid = tp > 1 || pp > 1;
  if (grid) {
    const std::string shard = tp > 1 ? "its 1/" + std::to_string(tp) + " tensor-parallel shard" : "";
    const std::string stage = pp > 1
                                  ? std::string(tp > 1 ? " of " : "") +
                                        "its pipeline stage (pp st: the one with the most device memory), " +
                                        std::string(to_string(rs.offload.pipeline_schedule)) + " over " +
                                        std::to_string(pp) + " stages, the step the whole pipeline's"
                                  : "";
    std::printf("  grid      each row is one rank: %s%s\n", shard.c_str(), stage.c_str());
  }
  std::printf("budgets  device %s, host %s, nvme %s\n\n", format_bytes(budgets.device).c_str(),
              format_bytes(budgets.host).c_str(),
              nvme_dir.empty() ? "(no --nvme-path)" : format_bytes(budgets.nvme).c_str());
  std::printf("%-4s %-6s %-9s %-9s %5s %8s %7s %10s | %9s %8s %8s %8s %8s %8s %8s %8s | %10s %10s %10s",
              "rank", "params", "optimizer", "gradients", "stage", "prefetch", "buffers", "sub-group",
              "step s", "compute", "h2d", "d2h", "nvme", "adam", "dp", "stalls", "device", "host+pin",
              "nvme");
  // The grid's columns: the tensor-parallel collectives, the pipeline stage shown and its bubble.
  if (grid) std::printf(" | %8s %5s %8s", "tp", "pp st", "bubble");
  if (profile) std::printf(" | %5s %7s", "gpu", "TFLOPS");
  std::printf("\n");
  int rank = 0;
  for (const Candidate* c : best) {
    const OffloadSettings& s = c->settings;
    const StepPrediction& p = c->prediction;
    std::printf(
        "%-4d %-6s %-9s %-9s %5d %8d %7s %10s | %9.4f %8.4f %8.4f %8.4f %8.4f %8.4f %8.4f %8.4f | %10s %10s "
        "%10s",
        ++rank, tier_name(s.params).c_str(), tier_name(s.optimizer).c_str(),
        s.optimizer == Tier::kDevice ? "device" : tier_name(s.gradients).c_str(), s.zero_stage,
        s.prefetch_modules, s.optimizer == Tier::kNvme ? std::to_string(s.nvme_buffer_count).c_str() : "-",
        s.optimizer == Tier::kNvme ? std::to_string(s.sub_group_size).c_str() : "-", p.step_seconds,
        p.compute, p.h2d, p.d2h, p.nvme_read + p.nvme_write, p.optimizer, p.dp,
        p.fetch_stall + p.update_stall + p.dp_stall, format_bytes(c->estimate.device_need).c_str(),
        format_bytes(c->estimate.plan.host_bytes + c->estimate.plan.pinned_bytes).c_str(),
        format_bytes(c->estimate.plan.nvme_bytes).c_str());
    if (grid) std::printf(" | %8.4f %5d %8.4f", p.tp, s.pp_stage, p.pp_bubble);
    if (profile) {
      Json g;
      add_gpu_figures(*c, rs.trainer, &g);
      std::printf(" | %4.0f%% %7.1f", 100 * g["gpu_utilization"].get<double>(), g["model_tflops"].get<double>());
    }
    std::printf("\n");
  }
  for (const Refused& x : refused)
    std::printf("  does not fit: %s (%s)\n", x.placement.c_str(), x.why.c_str());
  for (const std::string& p : left_out) std::printf("  not considered: %s (no --nvme-path)\n", p.c_str());
  std::printf("\n%zu tunings evaluated; chosen: %s, prefetch %d", candidates.size(),
              placement_name(chosen.settings).c_str(), chosen.settings.prefetch_modules);
  if (chosen.settings.optimizer == Tier::kNvme) {
    std::printf(", %d ring buffers of sub-groups of %lld elements", chosen.settings.nvme_buffer_count,
                static_cast<long long>(chosen.settings.sub_group_size));
  }
  if (ranks > 1 && chosen.settings.optimizer == Tier::kDevice) {
    std::printf(", gradient buckets of %lld elements, overlap_comm %s",
                static_cast<long long>(chosen.settings.reduce_bucket_elements),
                chosen.settings.overlap_comm ? "on" : "off");
  }
  std::printf("\n%s", chosen.prediction.to_string().c_str());
  if (!out_path.empty()) {
    std::printf("\nwrote %s\n  %s\n", out_path.c_str(), train_line.c_str());
  } else {
    std::printf("\n(no --out FILE: the config was not written)\n%s\n", config.dump(2).c_str());
  }
  return kExitOk;
}

}  // namespace

STRATA_CLI_COMMAND(plan,
                   "measure this machine, predict every placement's step time and write the fastest config",
                   run_plan);

}  // namespace strata::cli
