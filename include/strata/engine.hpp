// The training engine for a model that fits on one device: the all-device placement of the
// offload engine (offload.hpp), which runs the one step algorithm for every placement. A step is
// forward and backward over each micro-batch (gradients accumulate), then the global gradient
// norm, clipping, and an AdamW update of every parameter, with the learning rate from a
// warmup + decay schedule. In bf16 and fp16 mode the optimizer keeps fp32 master weights and
// writes the 16-bit working weights the model computes with; in fp32 mode the working weights are
// the master. fp16 adds dynamic loss scaling (DeepSpeed's): the loss gradient is multiplied by
// the loss scale, a step whose gradients overflow is skipped, and the update unscales.
//
// Memory: everything is planned before the first step. The device arena gets the model's
// regions (model.params, model.grads) and the optimizer's (optim.master in bf16 mode,
// optim.exp_avg, optim.exp_avg_sq: one fp32 value per parameter, laid out like the gradients);
// activations are allocated once by the model. A steady-state step allocates no device memory
// and no pinned memory.
//
// Ordering and threads: the Trainer enqueues everything on its stream and waits for the step to
// finish before returning (it needs the loss). A Trainer is used from one host thread at a time.
// Destroy it before its Device.
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

class Device;
class Stream;
struct Config;
class Batcher;
class OffloadEngine;

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
  // sizes) on top of this one. Unsupported settings (Lion/Adagrad) are errors; the offload sections are OffloadSettings::apply's
  // naming the key. `present_keys` lists the top-level keys the file actually set, so that a
  // section the file leaves out keeps this config's value. `data_parallel_size` is the number of
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

class Trainer {
 public:
  // Device bytes the plan needs (parameters, gradients, optimizer state, activations).
  static Result<std::uint64_t> device_bytes(const TrainerConfig& config);

  // Plans the device arena (it must have no regions yet), builds the model, initialises the
  // parameters from config.seed and the optimizer state to zero. Uses `stream` or creates one.
  static Result<std::unique_ptr<Trainer>> create(const TrainerConfig& config, Device& device,
                                                 Stream* stream = nullptr);
  ~Trainer();

  // One update from grad_accum micro-batches: inputs/targets hold grad_accum·micro_batch·seq_len
  // tokens, micro-batch after micro-batch, each row-major (B, T).
  Result<StepMetrics> step(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets);
  // Forward and backward only (gradients zeroed first, left in the grads region); returns the
  // mean loss. For tests and gradient checks.
  Result<double> loss_and_gradients(std::span<const std::int32_t> inputs,
                                    std::span<const std::int32_t> targets);
  // Forward only over one batch; the mean loss.
  Result<double> loss(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets);

  Result<EvalResult> evaluate(std::span<const std::int32_t> tokens, std::int64_t max_windows);

  // Overwrites parameter `index` (and its master copy) from fp32 host values.
  Status set_param(int index, std::span<const float> values);
  // The working weights as safetensors (see model.hpp's weight files).
  Status save_weights(const std::string& path, WeightFormat format = WeightFormat::kHuggingFace);
  // Loads a weights file of either format into both the working and the master copies; its
  // tensors must have this model's shapes.
  Status load_weights(const std::string& path);

  Model& model();
  const TrainerConfig& config() const;
  std::int64_t steps_done() const;
  // Which optimizer implementation runs the update.
  std::string optimizer_name() const;
  // The engine underneath (statistics, state access).
  OffloadEngine& engine();

 private:
  struct Impl;
  explicit Trainer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata
