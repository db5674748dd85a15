// defaults < --config < flags, shared by strata train, config and estimate (settings.hpp).
#include "settings.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "model_flags.hpp"
#include "strata/model.hpp"
#include "strata/parallel.hpp"

namespace strata::cli {

Status load_settings(const Args& args, const std::string& config_path, RunSettings* rs) {
  TrainerConfig& tc = rs->trainer;
  rs->world_size = mpirun_world_size();
  tc.model.kind = ModelKind::kGpt2;
  tc.model.n_layer = Defaults::kLayers;
  tc.model.n_head = Defaults::kHeads;
  tc.model.n_embd = Defaults::kWidth;
  tc.micro_batch = Defaults::kBatch;
  tc.seq_len = Defaults::kSeqLen;
  tc.optimizer.beta2 = Defaults::kBeta2;
  tc.optimizer.weight_decay = Defaults::kWeightDecay;
  tc.optimizer.lr = Defaults::kLr;
  tc.schedule.kind = LrScheduleKind::kWarmupCosine;
  tc.schedule.lr = Defaults::kLr;
  tc.schedule.warmup_max_lr = Defaults::kLr;
  tc.schedule.min_ratio = Defaults::kMinLrRatio;
  tc.grad_clip = Defaults::kGradClip;
  tc.seed = Defaults::kSeed;
  rs->offload.params = Tier::kNvme;
  rs->offload.optimizer = Tier::kHost;
  if (config_path.empty()) return ok_status();
  auto config = load_config_file(config_path, &rs->options, ParseOptions{args.has("strict")});
  if (!config.ok()) return config.status();
  std::vector<std::string> top;
  for (const std::string& p : config->present_paths) {
    if (p.find('.') == std::string::npos) top.push_back(p);
  }
  // Under mpirun the data-parallel size is the world over strata.tensor_parallel_size and
  // strata.pipeline_parallel_size: the config's train_batch_size is global (strata train refuses
  // a size that does not divide).
  STRATA_RETURN_IF_ERROR(tc.apply(*config, top, rs->data_parallel_size()));
  if (config->has("zero_optimization") || config->has("aio")) {
    STRATA_RETURN_IF_ERROR(rs->offload.apply(*config));
  }
  rs->config = std::move(*config);
  return ok_status();
}

Status apply_settings_flags(const Args& args, RunSettings* rs) {
  TrainerConfig& tc = rs->trainer;
  const Config* config = rs->config ? &*rs->config : nullptr;
  auto from_config = [&](std::string_view path) {
    return config != nullptr && config->has(path) && !config->is_auto(path);
  };
  // A scheduler's total_num_steps is the run length unless --steps says otherwise; its warmup
  // stays unless --warmup says otherwise.
  const bool total_from_config =
      from_config("scheduler.params.total_num_steps") && config->scheduler.type != SchedulerType::kWarmupLR;
  const bool warmup_from_config = from_config("scheduler.params.warmup_num_steps");
  if (total_from_config) rs->steps = config->scheduler.total_num_steps;
  std::int64_t seed = static_cast<std::int64_t>(tc.seed);
  STRATA_RETURN_IF_ERROR(int_flag(args, "steps", 1, 1ll << 40, &rs->steps));
  STRATA_RETURN_IF_ERROR(int_flag(args, "batch", 1, 1 << 20, &tc.micro_batch));
  STRATA_RETURN_IF_ERROR(int_flag(args, "grad-accum", 1, 1 << 20, &tc.grad_accum));
  STRATA_RETURN_IF_ERROR(int_flag(args, "seq-len", 1, 1 << 20, &tc.seq_len));
  STRATA_RETURN_IF_ERROR(int_flag(args, "seed", 0, std::numeric_limits<std::int64_t>::max(), &seed));
  STRATA_RETURN_IF_ERROR(double_flag(args, "weight-decay", 0.0, 1e3, &tc.optimizer.weight_decay));
  STRATA_RETURN_IF_ERROR(double_flag(args, "grad-clip", 0.0, 1e12, &tc.grad_clip));
  STRATA_RETURN_IF_ERROR(double_flag(args, "min-lr-ratio", 0.0, 1.0, &tc.schedule.min_ratio));
  if (args.has("lr")) {
    double lr = tc.schedule.lr;
    STRATA_RETURN_IF_ERROR(double_flag(args, "lr", 0.0, 10.0, &lr));
    tc.schedule.lr = lr;
    tc.optimizer.lr = lr;
    tc.schedule.warmup_max_lr = lr;
  }
  if (!total_from_config || args.has("steps")) tc.schedule.total_steps = rs->steps;
  if (!warmup_from_config) tc.schedule.warmup_steps = std::max<std::int64_t>(1, rs->steps / 20);
  STRATA_RETURN_IF_ERROR(int_flag(args, "warmup", 0, 1ll << 40, &tc.schedule.warmup_steps));
  STRATA_RETURN_IF_ERROR(apply_model_flags(args, tc.seq_len, &tc.model));
  tc.seed = static_cast<std::uint64_t>(seed);
  // The strata section's offload tunables (or their STRATA_* variables) count whether or not the
  // config has a zero_optimization or aio section (OffloadSettings::apply reads them only with
  // one); the flags below win.
  const Options& o = rs->options;
  if (o.source(Option::kOffloadPrefetchModules) != "default") {
    rs->offload.prefetch_modules = static_cast<int>(o.get_int(Option::kOffloadPrefetchModules));
  }
  if (o.source(Option::kOffloadGradients) != "default") {
    rs->offload.gradients = o.get_string(Option::kOffloadGradients) == "nvme" ? Tier::kNvme : Tier::kHost;
  }
  if (o.source(Option::kDelayedUpdate) != "default") rs->offload.delayed_update = o.get_bool(Option::kDelayedUpdate);
  if (o.source(Option::kDelayedUpdateWarmup) != "default") {
    rs->offload.delayed_update_warmup = static_cast<int>(o.get_int(Option::kDelayedUpdateWarmup));
  }
  for (const auto& [flag, tier] : {std::pair{"offload-param", &rs->offload.params},
                                   std::pair{"offload-optimizer", &rs->offload.optimizer},
                                   std::pair{"offload-gradients", &rs->offload.gradients}}) {
    if (auto v = args.get(flag)) {
      auto t = parse_tier(*v);
      if (!t.ok()) return invalid_argument("flag '--" + std::string(flag) + "': " + t.status().message());
      *tier = *t;
    }
  }
  if (args.has("delayed-update")) rs->offload.delayed_update = true;
  // activation_checkpointing.cpu_checkpointing of a config without a zero_optimization section,
  // then the flag.
  if (config != nullptr && config->activation_checkpointing.cpu_checkpointing)
    rs->offload.offload_activations = true;
  if (args.has("offload-activations")) rs->offload.offload_activations = true;
  if (auto dir = args.get("nvme-path")) {
    rs->offload.nvme_path = {*dir};
    rs->offload.io.nvme_path = rs->offload.nvme_path;
  }
  return ok_status();
}

Status apply_model_parallel(RunSettings* rs, int* stages) {
  Options o = rs->options;  // the config's, then the environment's (as strata train reads them)
  STRATA_RETURN_IF_ERROR(o.load_env());
  const std::int64_t tp = o.get_int(Option::kTensorParallelSize);
  const std::int64_t pp = o.get_int(Option::kPipelineParallelSize);
  const std::int64_t v = o.get_int(Option::kPipelineVirtualStages);
  if (tp < 1) {
    return invalid_argument(o.source(Option::kTensorParallelSize) + ": tensor_parallel_size = " +
                            std::to_string(tp) + " must be at least 1");
  }
  if (pp < 1) {
    return invalid_argument(o.source(Option::kPipelineParallelSize) + ": pipeline_parallel_size = " +
                            std::to_string(pp) + " must be at least 1");
  }
  if (v < 1 || (v > 1 && pp < 2)) {
    return invalid_argument(o.source(Option::kPipelineVirtualStages) + ": pipeline_virtual_stages = " +
                            std::to_string(v) +
                            (v < 1 ? " must be at least 1"
                                   : " interleaves the chunks of a pipeline and needs pipeline_parallel_size > 1"));
  }
  OffloadSettings& s = rs->offload;
  if (tp > 1) {
    if (Status c = check_tensor_parallel(rs->trainer.model, static_cast<int>(tp)); !c.ok()) {
      return c.with_context(o.source(Option::kTensorParallelSize) + " = " + std::to_string(tp));
    }
  }
  s.tp_size = static_cast<int>(tp);
  s.sequence_parallel = o.get_bool(Option::kSequenceParallel);
  if (s.sequence_parallel && tp < 2) {
    return invalid_argument(o.source(Option::kSequenceParallel) +
                            ": sequence_parallel = true splits the tokens over the tensor-parallel group, but "
                            "strata.tensor_parallel_size = " +
                            std::to_string(tp) + ": set tensor_parallel_size > 1 or sequence_parallel false");
  }
  auto schedule = parse_pipeline_schedule(o.get_string(Option::kPipelineSchedule));
  if (!schedule.ok()) return invalid_argument(o.source(Option::kPipelineSchedule) + ": " + schedule.status().message());
  s.pipeline_schedule = *schedule;
  s.pipeline_virtual_stages = static_cast<int>(v);
  s.pipeline_bounds.clear();
  s.pp_stage = 0;
  if (pp > 1) {
    auto bounds = strata::pipeline_stages(rs->trainer.model, static_cast<int>(pp * v), rs->trainer.seq_len);
    if (!bounds.ok()) {
      return bounds.status().with_context(o.source(v > 1 ? Option::kPipelineVirtualStages
                                                          : Option::kPipelineParallelSize) +
                                          " (pipeline_parallel_size " + std::to_string(pp) +
                                          ", pipeline_virtual_stages " + std::to_string(v) + ")");
    }
    s.pipeline_bounds = std::move(*bounds);
  }
  *stages = static_cast<int>(pp);
  return ok_status();
}

bool fold_stage_estimate(PlacementEstimate& row, PlacementEstimate stage) {
  const bool fits_device = row.fits_device && stage.fits_device, fits_host = row.fits_host && stage.fits_host,
             fits_nvme = row.fits_nvme && stage.fits_nvme;
  const bool shown = stage.device_need > row.device_need;
  if (shown) row = std::move(stage);
  row.fits_device = fits_device;
  row.fits_host = fits_host;
  row.fits_nvme = fits_nvme;
  return shown;
}

namespace {

std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// The resolved value of an "auto" key.
std::string auto_value(std::string_view path, const RunSettings& rs) {
  const TrainerConfig& tc = rs.trainer;
  if (path == "train_batch_size") return std::to_string(tc.micro_batch * tc.grad_accum * rs.data_parallel_size());
  if (path == "train_micro_batch_size_per_gpu") return std::to_string(tc.micro_batch);
  if (path == "gradient_accumulation_steps") return std::to_string(tc.grad_accum);
  if (path == "gradient_clipping") return number(tc.grad_clip);
  if (path == "bf16.enabled" || path == "bfloat16.enabled")
    return tc.model.dtype == DType::kBF16 ? "true" : "false";
  if (path == "fp16.enabled") return tc.model.dtype == DType::kF16 ? "true" : "false";
  if (path == "optimizer.params.lr") return number(tc.optimizer.lr);
  if (path == "optimizer.params.betas")
    return "[" + number(tc.optimizer.beta1) + ", " + number(tc.optimizer.beta2) + "]";
  if (path == "optimizer.params.eps") return number(tc.optimizer.eps);
  if (path == "optimizer.params.weight_decay") return number(tc.optimizer.weight_decay);
  if (path == "scheduler.params.warmup_min_lr") return number(tc.schedule.warmup_min_lr);
  if (path == "scheduler.params.warmup_max_lr") return number(tc.schedule.warmup_max_lr);
  if (path == "scheduler.params.warmup_num_steps") return std::to_string(tc.schedule.warmup_steps);
  if (path == "scheduler.params.total_num_steps") return std::to_string(rs.steps);
  if (path == "zero_optimization.stage3_prefetch_bucket_size")
    return std::to_string(rs.offload.prefetch_elements);
  if (path == "zero_optimization.stage3_param_persistence_threshold")
    return std::to_string(rs.offload.persistence_threshold);
  if (path == "zero_optimization.reduce_bucket_size" && rs.config)
    return std::to_string(rs.config->zero_optimization.reduce_bucket_size);
  return "?";
}

}  // namespace

std::vector<AutoValue> auto_resolution(const RunSettings& rs, const Args& args) {
  std::vector<AutoValue> lines;
  if (!rs.config) return lines;
  for (const std::string& path : rs.config->auto_keys) {
    const ConfigKey* key = find_config_key(path);
    std::string from = key != nullptr ? std::string(key->auto_from) : "";
    std::string source = from;
    if (from.rfind("--", 0) == 0) {
      const std::string flag = from.substr(0, from.find(' '));
      source = args.has(flag.substr(2)) ? "from " + flag : "Strata's default; " + flag + " not given";
    }
    lines.push_back({path, auto_value(path, rs), source});
  }
  return lines;
}

}  // namespace strata::cli
