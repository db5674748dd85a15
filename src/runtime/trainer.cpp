// The single-device, no-offload training engine (see engine.hpp): memory plan, the step
// (micro-batches → gradient norm → clipping → AdamW), learning-rate schedules, evaluation and
// weight I/O.
//
// Optimizer state layout: optim.exp_avg and optim.exp_avg_sq (and optim.master in bf16 mode)
// are each one fp32 value per gradient element at the gradient's own offset, so parameter i's
// state is base + grad_offset(i) in every one of them and the grads region's zero padding is
// mirrored (padding never changes: its gradient is always zero).
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <nlohmann/json.hpp>

#include "runtime/evaluate.hpp"
#include "strata/config.hpp"
#include "strata/data.hpp"
#include "strata/device.hpp"
#include "strata/engine.hpp"
#include "strata/log.hpp"
#include "strata/offload.hpp"
#include "strata/optim.hpp"

namespace strata {

// ---- learning-rate schedules ---------------------------------------------------------------

double LrSchedule::at(std::int64_t step) const {
  const double s = static_cast<double>(step);
  const double warm = static_cast<double>(warmup_steps);
  // DeepSpeed's warmup fraction: linear s/W, or log(s+1)/log(W).
  auto warmup_fraction = [&]() {
    if (log_warmup) return warmup_steps > 1 ? std::log(s + 1.0) / std::log(warm) : 1.0;
    return s / warm;
  };
  switch (kind) {
    case LrScheduleKind::kConstant:
      return lr;
    case LrScheduleKind::kWarmupLR: {
      const double gamma = step < warmup_steps ? warmup_fraction() : 1.0;
      return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma;
    }
    case LrScheduleKind::kWarmupDecay: {
      if (step < warmup_steps) return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * warmup_fraction();
      const double left = static_cast<double>(total_steps - step) /
                          std::max(1.0, static_cast<double>(total_steps - warmup_steps));
      return warmup_max_lr * std::max(0.0, left);
    }
    case LrScheduleKind::kWarmupCosine: {
      if (step < warmup_steps) return lr * (warmup_min_ratio + warmup_fraction() * (1.0 - warmup_min_ratio));
      const double real_step = static_cast<double>(step - warmup_steps + 1);
      const double real_total = static_cast<double>(std::max<std::int64_t>(total_steps - warmup_steps, 1));
      const double cosine =
          (1.0 + std::cos(3.14159265358979323846 * std::min(1.0, real_step / real_total))) / 2.0;
      return lr * std::max(0.0, min_ratio + (1.0 - min_ratio) * cosine);
    }
  }
  return lr;
}

Status LrSchedule::validate() const {
  auto bad = [](const std::string& what) { return invalid_argument("learning-rate schedule: " + what); };
  if (!(lr >= 0.0) || !std::isfinite(lr))
    return bad("lr = " + std::to_string(lr) + " must be a non-negative number");
  if (warmup_steps < 0)
    return bad("warmup steps = " + std::to_string(warmup_steps) + " must not be negative");
  if ((kind == LrScheduleKind::kWarmupCosine || kind == LrScheduleKind::kWarmupDecay) && total_steps < 1) {
    return bad("total steps = " + std::to_string(total_steps) + " must be at least 1");
  }
  if (!(min_ratio >= 0.0 && min_ratio <= 1.0))
    return bad("cos_min_ratio = " + std::to_string(min_ratio) + " is not in [0, 1]");
  if (!(warmup_min_ratio >= 0.0 && warmup_min_ratio <= 1.0)) {
    return bad("warmup_min_ratio = " + std::to_string(warmup_min_ratio) + " is not in [0, 1]");
  }
  if (!(warmup_min_lr >= 0.0) || !(warmup_max_lr >= 0.0))
    return bad("warmup_min_lr and warmup_max_lr must be non-negative");
  return ok_status();
}

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

// ---- evaluation --------------------------------------------------------------------------------

Result<EvalResult> evaluate_windows(Model& model, std::span<const std::int32_t> tokens, std::int64_t seq_len,
                                    std::int64_t batch, std::int64_t max_windows) {
  return detail::evaluate_windows_with(model, tokens, seq_len, batch, max_windows,
                                       [&model]() { return model.forward(false); });
}

Result<EvalResult> detail::evaluate_windows_with(Model& model, std::span<const std::int32_t> tokens,
                                                 std::int64_t seq_len, std::int64_t batch, std::int64_t max_windows,
                                                 const std::function<Status()>& forward) {
  if (seq_len < 1 || batch < 1)
    return invalid_argument("evaluate: sequence length and batch must be at least 1");
  std::int64_t windows = static_cast<std::int64_t>(tokens.size()) / (seq_len + 1);
  if (windows == 0) {
    return invalid_argument("evaluate: the data has " + std::to_string(tokens.size()) +
                            " tokens; a window of seq_len + 1 = " + std::to_string(seq_len + 1) +
                            " needs more");
  }
  if (max_windows > 0) windows = std::min(windows, max_windows);
  std::vector<std::int32_t> inputs, targets;
  LossSum total;
  for (std::int64_t w0 = 0; w0 < windows; w0 += batch) {
    const std::int64_t rows = std::min(batch, windows - w0);
    inputs.resize(static_cast<std::size_t>(rows * seq_len));
    targets.resize(inputs.size());
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int32_t* win = tokens.data() + (w0 + r) * (seq_len + 1);
      std::memcpy(inputs.data() + r * seq_len, win, static_cast<std::size_t>(seq_len) * 4);
      std::memcpy(targets.data() + r * seq_len, win + 1, static_cast<std::size_t>(seq_len) * 4);
    }
    STRATA_RETURN_IF_ERROR(model.set_batch(inputs, targets, rows, seq_len));
    STRATA_RETURN_IF_ERROR(forward());
    STRATA_RETURN_IF_ERROR(model.copy_losses(0));
    STRATA_RETURN_IF_ERROR(model.stream().synchronize());
    const LossSum s = model.loss_sum(0);
    total.sum += s.sum;
    total.count += s.count;
  }
  return EvalResult{total.sum / static_cast<double>(total.count), total.count};
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
