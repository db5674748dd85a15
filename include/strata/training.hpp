// The training vocabulary every layer shares: the learning-rate schedule, the optimizer's
// numbers, TrainerConfig (what to train and how: model, batch, optimizer, schedule, clipping,
// fp16 loss scaling), a step's metrics and the windowed evaluation. The engines that train are
// OffloadEngine (strata/offload.hpp, every placement) and the Trainer (strata/trainer.hpp, its
// all-device placement).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/model.hpp"
#include "strata/optim.hpp"
#include "strata/status.hpp"

namespace strata {

struct Config;

// Learning-rate schedules with DeepSpeed's meaning (scheduler.type and scheduler.params).
enum class LrScheduleKind : std::uint8_t {
  kConstant,      // lr throughout
  kWarmupLR,      // warmup_min_lr -> warmup_max_lr over warmup_steps, then constant
  kWarmupCosine,  // ratio warmup_min_ratio -> 1 over warmup_steps, then cosine to min_ratio at total_steps; ×
                  // lr
  kWarmupDecay,  // as kWarmupLR, then linear decay to 0 at total_steps
};

struct LrSchedule {
  LrScheduleKind kind = LrScheduleKind::kWarmupCosine;
  double lr = 1e-3;  // peak learning rate (kConstant, kWarmupCosine)
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 1;
  bool log_warmup = false;        // DeepSpeed warmup_type "log" (default "linear" here)
  double warmup_min_ratio = 0.0;  // kWarmupCosine
  double min_ratio = 1e-4;        // kWarmupCosine: cos_min_ratio
  double warmup_min_lr = 0.0;     // kWarmupLR, kWarmupDecay
  double warmup_max_lr = 1e-3;    // kWarmupLR, kWarmupDecay

  // The learning rate of update number `step` (0-based).
  double at(std::int64_t step) const;
  Status validate() const;
};

struct OptimizerSettings {
  double lr = 1e-3;  // superseded by the schedule's own numbers; kept for reporting
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // applied to parameters whose descriptor says weight_decay
  bool decoupled = true;      // AdamW; false = Adam with L2 weight decay added to the gradient
};

struct TrainerConfig {
  ModelConfig model;
  std::int64_t micro_batch = 8;
  std::int64_t grad_accum = 1;
  std::int64_t seq_len = 128;  // ≤ model.n_positions
  OptimizerSettings optimizer;
  LrSchedule schedule;
  double grad_clip = 1.0;     // max global gradient norm; 0 = off
  std::uint64_t seed = 1234;  // parameter initialisation
  // cpu backend: the optimizer's instruction set, as the `adam_isa` tunable (auto | avx512 |
  // avx2 | scalar).
  std::string optimizer_isa = "auto";
  // fp16 training (model.dtype kF16): DeepSpeed's `fp16` section. A step whose gradients hold an
  // inf or nan is skipped: no parameter, moment or bias-correction step changes and the
  // learning-rate schedule does not advance (DeepSpeed's skipped_steps), but the step still counts
  // in StepMetrics::step. Ignored for fp32 and bf16.
  LossScalerConfig loss_scaling;

  Status validate() const;
  // Applies a DeepSpeed config (optimizer, scheduler, gradient_clipping, bf16/fp16, batch
  // sizes) on top of this one. Unsupported settings (Lion/Adagrad) are errors; the offload sections are
  // OffloadSettings::apply's naming the key. `present_keys` lists the top-level keys the file actually set,
  // so that a section the file leaves out keeps this config's value. `data_parallel_size` is the number of
  // ranks sharing the batch (train_batch_size = micro batch x accumulation x ranks).
  Status apply(const Config& config, const std::vector<std::string>& present_keys,
               std::int64_t data_parallel_size = 1);
};

struct StepMetrics {
  std::int64_t step = 0;  // 1-based number of this update
  double loss = 0.0;      // mean cross-entropy over the step's tokens (nats)
  double lr = 0.0;
  double grad_norm = 0.0;  // global norm before clipping
  std::int64_t tokens = 0;
  double seconds = 0.0;  // wall time of the step
  // fp16: the loss scale this step's gradients carried (1 otherwise), and whether they
  // overflowed so that the step was skipped (grad_norm is then inf or nan).
  double loss_scale = 1.0;
  bool skipped = false;
};

struct EvalResult {
  double loss = 0.0;        // mean next-token cross-entropy (nats)
  std::int64_t tokens = 0;  // predictions it averages
};

// Mean loss over consecutive non-overlapping windows of seq_len+1 tokens from the start of
// `tokens` (a final partial window is dropped), at most `max_windows` of them (0 = all), run
// `batch` windows at a time (the model's max_batch or less). Forward only.
Result<EvalResult> evaluate_windows(Model& model, std::span<const std::int32_t> tokens, std::int64_t seq_len,
                                    std::int64_t batch, std::int64_t max_windows);

}  // namespace strata
