// The training engine for a model that fits on one device: the all-device placement of the
// offload engine (offload.hpp), which runs the one step algorithm for every placement. A step is
// forward and backward over each micro-batch (gradients accumulate), then the global gradient
// norm, clipping, and an AdamW update of every parameter, with the learning rate from a
// warmup + decay schedule. In bf16 and fp16 mode the optimizer keeps fp32 master weights and
// writes the 16-bit working weights the model computes with; in fp32 mode the working weights are
// the master. fp16 adds dynamic loss scaling (DeepSpeed's): the loss gradient is multiplied by
// the loss scale, a step whose gradients overflow is skipped, and the update unscales.
//
// Memory: everything is planned before the first step (OffloadPlan). The device arena gets the
// engine's regions: the parameters (offload.params), the gradients (offload.grads) and the
// optimizer's (optim.master in 16-bit modes, optim.exp_avg, optim.exp_avg_sq: one fp32 value per
// parameter, laid out like the gradients); activations are allocated once by the model. A
// steady-state step allocates no device memory and no pinned memory.
//
// Ordering and threads: the Trainer enqueues everything on its stream and waits for the step to
// finish before returning (it needs the loss). A Trainer is used from one host thread at a time.
// Destroy it before its Device.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "strata/model.hpp"
#include "strata/status.hpp"
#include "strata/training.hpp"

namespace strata {

class Device;
class Stream;
class OffloadEngine;

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
