// The Trainer (strata/trainer.hpp): the all-device placement of the offload engine, which it
// creates and forwards to; and TrainerConfig's checks and DeepSpeed sections (strata/training.hpp).
// The learning-rate schedule is src/optim/lr_schedule.cpp's, the evaluation loop
// src/model/evaluate.cpp's.
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <nlohmann/json.hpp>

#include "strata/config.hpp"
#include "strata/data.hpp"
#include "strata/device.hpp"
#include "strata/trainer.hpp"
#include "strata/log.hpp"
#include "strata/offload.hpp"
#include "strata/optim.hpp"

namespace strata {

// ---- config ----------------------------------------------------------------------------------

Status TrainerConfig::validate() const {
  STRATA_RETURN_IF_ERROR(model.validate());
  auto bad = [](const std::string& what) { return invalid_argument(what); };
  if (micro_batch < 1)
    return bad("micro batch size = " + std::to_string(micro_batch) + " must be at least 1");
  if (grad_accum < 1)
    return bad("gradient accumulation steps = " + std::to_string(grad_accum) + " must be at least 1");
  if (seq_len < 1 || seq_len > model.n_positions) {
    return bad("sequence length = " + std::to_string(seq_len) +
               " must be in [1, n_positions = " + std::to_string(model.n_positions) + "]");
  }
  if (!(optimizer.beta1 >= 0.0 && optimizer.beta1 < 1.0))
    return bad("optimizer beta1 = " + std::to_string(optimizer.beta1) + " is not in [0, 1)");
  if (!(optimizer.beta2 >= 0.0 && optimizer.beta2 < 1.0))
    return bad("optimizer beta2 = " + std::to_string(optimizer.beta2) + " is not in [0, 1)");
  if (!(optimizer.eps >= 0.0) || !std::isfinite(optimizer.eps))
    return bad("optimizer eps must be a non-negative number");
  if (!(optimizer.weight_decay >= 0.0) || !std::isfinite(optimizer.weight_decay)) {
    return bad("optimizer weight_decay must be a non-negative number");
  }
  if (!(grad_clip >= 0.0) || !std::isfinite(grad_clip))
    return bad("gradient clipping = " + std::to_string(grad_clip) + " must be >= 0");
  if (model.dtype == DType::kF16) STRATA_RETURN_IF_ERROR(loss_scaling.validate());
  return schedule.validate();
}

Status TrainerConfig::apply(const Config& config, const std::vector<std::string>& present_keys,
                            std::int64_t data_parallel_size) {
  auto present = [&](std::string_view key) {
    return std::find(present_keys.begin(), present_keys.end(), key) != present_keys.end();
  };
  const std::string& src = config.source;
  // A key set to "auto" keeps this config's value (the caller's default or flag).
  auto given = [&](std::string_view path) { return !config.is_auto(path); };
  const auto& zero = config.zero_optimization;
  // zero_optimization.offload_* and aio are the placement's (OffloadSettings::apply).
  if (zero.stage > 0) {
    STRATA_LOG(kInfo, kRuntime) << src << ": zero_optimization.stage " << zero.stage
                                << " trains like stage 0 in one process (world size 1)";
  }
  if (present("optimizer")) {
    const OptimizerConfig& o = config.optimizer;
    if (o.type != OptimizerType::kAdam && o.type != OptimizerType::kAdamW) {
      const std::string row = "optimizer.type=" + std::string(to_string(o.type));
      return invalid_argument(src + ": optimizer.type: \"" + std::string(to_string(o.type)) +
                              "\" is not supported: " + std::string(find_config_key(row)->note));
    }
    if (given("optimizer.params.lr")) {
      optimizer.lr = o.lr;
      schedule.lr = o.lr;
    }
    if (given("optimizer.params.betas")) {
      optimizer.beta1 = o.betas[0];
      optimizer.beta2 = o.betas[1];
    }
    if (given("optimizer.params.eps")) optimizer.eps = o.eps;
    if (given("optimizer.params.weight_decay")) optimizer.weight_decay = o.weight_decay;
    optimizer.decoupled = o.type == OptimizerType::kAdamW || o.adam_w_mode;
  }
  if (present("scheduler")) {
    const SchedulerConfig& s = config.scheduler;
    schedule.log_warmup = s.warmup_type == WarmupType::kLog;
    if (given("scheduler.params.warmup_num_steps")) schedule.warmup_steps = s.warmup_num_steps;
    if (given("scheduler.params.warmup_min_lr")) schedule.warmup_min_lr = s.warmup_min_lr;
    schedule.warmup_max_lr = given("scheduler.params.warmup_max_lr") ? s.warmup_max_lr : schedule.lr;
    if (s.type != SchedulerType::kWarmupLR && given("scheduler.params.total_num_steps")) {
      schedule.total_steps = s.total_num_steps;
    }
    switch (s.type) {
      case SchedulerType::kNone:
        schedule.kind = LrScheduleKind::kConstant;
        break;
      case SchedulerType::kWarmupLR:
        schedule.kind = LrScheduleKind::kWarmupLR;
        break;
      case SchedulerType::kWarmupDecayLR:
        schedule.kind = LrScheduleKind::kWarmupDecay;
        break;
      case SchedulerType::kWarmupCosineLR:
        schedule.kind = LrScheduleKind::kWarmupCosine;
        schedule.warmup_min_ratio = s.warmup_min_ratio;
        schedule.min_ratio = s.cos_min_ratio;
        break;
    }
  }
  if (present("gradient_clipping") && given("gradient_clipping")) grad_clip = config.gradient_clipping;
  const std::string_view bf16_key = config.has("bfloat16.enabled") ? "bfloat16.enabled" : "bf16.enabled";
  if ((present("bf16") || present("bfloat16")) && given(bf16_key)) {
    model.dtype = config.bf16.enabled ? DType::kBF16 : DType::kF32;
  }
  if (present("fp16")) {
    // The scaler's keys apply whether or not this file enables fp16 (a --dtype fp16 run uses them).
    loss_scaling = LossScalerConfig::from_config(config.fp16);
    if (given("fp16.enabled")) {
      if (config.fp16.enabled) {
        model.dtype = DType::kF16;
      } else if (model.dtype == DType::kF16) {
        model.dtype = DType::kF32;
      }
    }
    Status s = loss_scaling.validate();
    if (!s.ok()) return s.with_context(src);
  }
  // Batch sizes: an "auto" micro batch or accumulation is this config's; an "auto" total is derived.
  Config sizes_of = config;
  if (config.is_auto("train_micro_batch_size_per_gpu")) sizes_of.train_micro_batch_size_per_gpu = micro_batch;
  if (config.is_auto("gradient_accumulation_steps")) sizes_of.gradient_accumulation_steps = grad_accum;
  if (sizes_of.train_batch_size || sizes_of.train_micro_batch_size_per_gpu || sizes_of.gradient_accumulation_steps) {
    auto sizes = resolve_batch_sizes(sizes_of, data_parallel_size);
    if (!sizes.ok()) return sizes.status().with_context(src);
    micro_batch = sizes->train_micro_batch_size_per_gpu;
    grad_accum = sizes->gradient_accumulation_steps;
  }
  return ok_status();
}

// ---- the trainer: the all-device placement of the offload engine ------------------------------

struct Trainer::Impl {
  std::unique_ptr<OffloadEngine> engine;
};

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::~Trainer() = default;

Result<std::uint64_t> Trainer::device_bytes(const TrainerConfig& config) {
  STRATA_ASSIGN_OR_RETURN(OffloadPlan plan, OffloadPlan::make(config, OffloadSettings{}));
  return plan.device_bytes;
}

Result<std::unique_ptr<Trainer>> Trainer::create(const TrainerConfig& config, Device& device, Stream* stream) {
  auto impl = std::make_unique<Impl>();
  STRATA_ASSIGN_OR_RETURN(impl->engine, OffloadEngine::create(config, OffloadSettings{}, device, stream));
  return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
}

Result<StepMetrics> Trainer::step(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets) {
  return impl_->engine->step(inputs, targets);
}

Result<double> Trainer::loss_and_gradients(std::span<const std::int32_t> inputs,
                                           std::span<const std::int32_t> targets) {
  return impl_->engine->loss_and_gradients(inputs, targets);
}

Result<double> Trainer::loss(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets) {
  return impl_->engine->loss(inputs, targets);
}

Result<EvalResult> Trainer::evaluate(std::span<const std::int32_t> tokens, std::int64_t max_windows) {
  return impl_->engine->evaluate(tokens, max_windows);
}

Status Trainer::set_param(int index, std::span<const float> values) { return impl_->engine->set_param(index, values); }

Status Trainer::save_weights(const std::string& path, WeightFormat format) {
  return impl_->engine->save_weights(path, format);
}

Status Trainer::load_weights(const std::string& path) { return impl_->engine->load_weights(path); }

Model& Trainer::model() { return impl_->engine->model(); }
const TrainerConfig& Trainer::config() const { return impl_->engine->config(); }
std::int64_t Trainer::steps_done() const { return impl_->engine->steps_done(); }
std::string Trainer::optimizer_name() const { return impl_->engine->optimizer_name(); }
OffloadEngine& Trainer::engine() { return *impl_->engine; }

}  // namespace strata
