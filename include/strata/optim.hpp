// Optimizers for state that lives on the host: AdamW, Adam (L2), Lion and Adagrad over flat fp32
// master weights, with gradients in fp32, bf16 or fp16, plus the pieces around the update that
// mixed-precision training needs: the gradient scan (unscale, inf/nan detection, sum of squares
// for the global norm), clipping by global norm, and DeepSpeed's dynamic loss scaler.
//
// The update is one streaming pass per buffer: it reads master, gradient and moments, writes
// master and moments back in place and, optionally, the updated parameters rounded to bf16/fp16
// (round to nearest even) into a separate buffer ready to be copied to the device. It runs on
// AVX-512, AVX2+FMA or scalar code chosen at run time from the CPU's features (tunable
// `adam_isa`, env STRATA_ADAM_ISA), on `threads` OpenMP threads. The team's threads join the
// CPU account (cpu_budget.hpp) of the thread that calls, and inherit its affinity.
//
// Numerics (docs/optim.md): all three ISA paths perform the same IEEE fp32 operations in the
// same order (explicit fused multiply-adds, correctly rounded sqrt and division), so they produce
// bitwise identical results, independent of the thread count; the gradient scan accumulates in
// double with a fixed summation order, so the norm is also bitwise reproducible. Optional bf16
// moments use deterministic stochastic rounding keyed by (element index, step, seed).
//
// Ownership: every buffer passed here belongs to the caller and must stay valid for the call;
// nothing is retained. Pointers need only their element's natural alignment (4 bytes for fp32,
// 2 for bf16/fp16); no vector alignment is required and any length is accepted.
// Thread safety: CpuOptimizer is immutable after create(); its methods may be called
// concurrently on disjoint buffers. LossScaler is not internally locked.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "strata/dtype.hpp"
#include "strata/status.hpp"

namespace strata {

class Options;
struct Fp16Config;       // config.hpp
struct OptimizerConfig;  // config.hpp

// ---- Optimizer kinds -------------------------------------------------------------------------

enum class OptimizerKind : std::uint8_t {
  kAdamW,    // Adam with decoupled weight decay (Loshchilov & Hutter)
  kAdam,     // Adam with L2 regularisation: weight decay is added to the gradient
  kLion,     // sign of an interpolated momentum, decoupled weight decay (Chen et al. 2023)
  kAdagrad,  // accumulated squared gradients, L2 weight decay, optional lr decay (as torch)
};
std::string_view to_string(OptimizerKind kind);
// Case-insensitive: "adamw", "adam", "lion", "adagrad" (DeepSpeed's "AdamW" works).
Result<OptimizerKind> parse_optimizer_kind(std::string_view text);

// Hyperparameters of one parameter group. Defaults are DeepSpeed's for each kind (see defaults());
// fields that a kind does not use are ignored.
struct OptimizerHyper {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double lr = 1e-3;
  double beta1 = 0.9;    // Adam/AdamW/Lion
  double beta2 = 0.999;  // Adam/AdamW/Lion
  double eps = 1e-8;     // Adam/AdamW/Adagrad
  double weight_decay = 0.0;
  bool bias_correction = true;  // Adam/AdamW
  double lr_decay = 0.0;        // Adagrad: lr / (1 + (step - 1) * lr_decay)

  static OptimizerHyper defaults(OptimizerKind kind);
  // From the config's `optimizer` section: "Adam" with adam_w_mode (the default) is AdamW,
  // without it Adam with L2 weight decay.
  static OptimizerHyper from_config(const OptimizerConfig& config);
  // Every field in range (lr >= 0, 0 <= beta < 1, eps >= 0, finite values); the error names the
  // field, e.g. "optimizer.beta2 = 1.5 is not in [0, 1)".
  Status validate() const;
};

// A parameter group: its hyperparameters and the number of updates applied so far. The update
// with bias correction uses step + 1; optimizer_step() advances `step` only when it applies.
struct ParamGroup {
  std::string name;
  OptimizerHyper hyper;
  std::int64_t step = 0;
};

// One flat buffer of optimizer state (a whole group, or a piece of one).
struct OptimizerBuffers {
  float* master = nullptr;     // n fp32 master weights, updated in place
  const void* grad = nullptr;  // n gradients of grad_dtype (read only)
  DType grad_dtype = DType::kF32;
  void* exp_avg = nullptr;           // m: Adam, AdamW, Lion (moment_dtype); unused by Adagrad
  void* exp_avg_sq = nullptr;        // v: Adam, AdamW; Adagrad's sum of squares; unused by Lion
  DType moment_dtype = DType::kF32;  // kF32, or kBF16 (not Adagrad): see docs/optim.md
  void* param_out = nullptr;         // optional: the updated parameters rounded to out_dtype
  DType out_dtype = DType::kBF16;    // kBF16 or kF16 (round to nearest even, NaN kept)
  std::size_t n = 0;
  // Index of element 0 within its group. Keys the stochastic rounding of bf16 moments, so the
  // result does not depend on how a group is cut into pieces (NVMe sub-groups, ZeRO shards).
  std::uint64_t element_offset = 0;
};

// ---- Instruction set selection ---------------------------------------------------------------
// The paths are dtype.hpp's SimdIsa; the optimizer needs a little more of the CPU than the dtype
// conversions do (FMA for its AVX2 path).

// True when this CPU (and OS) can run the optimizer's path: kAvx2 needs AVX2, FMA and F16C;
// kAvx512 needs AVX-512 F, BW, VL and DQ (and AVX2, FMA, F16C).
bool optimizer_supports(SimdIsa isa);
SimdIsa best_optimizer_isa();
// "auto" picks best_optimizer_isa(); "avx512", "avx2", "scalar" pick that path, or fail with
// kUnavailable naming the missing CPU features. Anything else is kInvalidArgument.
Result<SimdIsa> select_optimizer_isa(std::string_view request);

// ---- Gradient scan and clipping --------------------------------------------------------------

// Statistics of the unscaled gradients y = g * inv_loss_scale (computed in fp32, as the update
// sees them), accumulated in double. Merge the stats of several buffers (and, with an all-reduce
// of sum_of_squares, several ranks) before deciding.
struct GradStats {
  double sum_of_squares = 0.0;
  std::uint64_t count = 0;

  // Squares of finite floats cannot overflow a double sum, so the sum is finite exactly when
  // every y is finite: this is the overflow test (an inf or nan anywhere makes it non-finite).
  bool finite() const;
  double norm() const;  // sqrt(sum_of_squares); inf/nan when !finite()
  GradStats& merge(const GradStats& other) {
    sum_of_squares += other.sum_of_squares;
    count += other.count;
    return *this;
  }
};

// The factor that clips gradients to `max_norm`: min(1, max_norm / (total_norm + 1e-6)), as
// torch.nn.utils.clip_grad_norm_ and DeepSpeed's `gradient_clipping`. max_norm <= 0 disables
// clipping (returns 1). A non-finite norm returns 1: such a step is skipped, not clipped.
double clip_coefficient(double total_norm, double max_norm);

// ---- The CPU optimizer -----------------------------------------------------------------------

struct CpuOptimizerConfig {
  SimdIsa isa = SimdIsa::kScalar;
  int threads = 1;         // OpenMP threads per call (>= 1); small buffers use fewer
  std::uint32_t seed = 0;  // keys the stochastic rounding of bf16 moments

  // isa from `adam_isa` (auto -> best for this CPU), threads from the process's CpuBudget
  // (cpu_budget.hpp): `host_threads`, or 0 -> one per host cpu (the allowed cpus compute does
  // not get), as the device and the offload engine count them. Errors name the key.
  static Result<CpuOptimizerConfig> from_options(const Options& options);
};

class CpuOptimizer {
 public:
  // Fails with kUnavailable when the CPU cannot run config.isa, kInvalidArgument for threads < 1.
  static Result<CpuOptimizer> create(const CpuOptimizerConfig& config);

  SimdIsa isa() const { return config_.isa; }
  int threads() const { return config_.threads; }
  const CpuOptimizerConfig& config() const { return config_; }

  // Applies update number `step` (1-based; bias correction uses it) of `hyper` to `buffers`.
  // Gradients are multiplied by `grad_scale` (1/loss_scale times the clip coefficient) first.
  // Elements are independent: a nan/inf gradient poisons its own element only (callers skip
  // steps with overflow; optimizer_step() does). Errors (kInvalidArgument) name the missing
  // buffer or the unsupported combination; nothing is written on error.
  Status update(const OptimizerHyper& hyper, std::int64_t step, float grad_scale,
                const OptimizerBuffers& buffers) const;

  // One read pass over `n` gradients of `dtype`: GradStats of y = g * inv_loss_scale. With
  // write_unscaled, y is also written back in place (rounded to nearest even for bf16/fp16).
  // The sum's order is fixed by n alone, so the result is bitwise independent of threads and ISA.
  Result<GradStats> scan_gradients(void* grad, DType dtype, std::size_t n, float inv_loss_scale,
                                   bool write_unscaled) const;

 private:
  explicit CpuOptimizer(const CpuOptimizerConfig& config) : config_(config) {}
  CpuOptimizerConfig config_;
};

// ---- Loss scaling ----------------------------------------------------------------------------

// DeepSpeed's `fp16` section, with the same keys and meanings.
struct LossScalerConfig {
  bool enabled = false;                 // fp16.enabled (informational here; the engine reads it)
  double loss_scale = 0.0;              // fp16.loss_scale: 0 = dynamic, > 0 = this static scale
  int initial_scale_power = 16;         // fp16.initial_scale_power: dynamic scale starts at 2^power
  int loss_scale_window = 1000;         // fp16.loss_scale_window: good steps before doubling
  int hysteresis = 2;                   // fp16.hysteresis: overflows tolerated before halving
  bool consecutive_hysteresis = false;  // fp16.consecutive_hysteresis: refill on every good step
  double min_loss_scale = 1.0;          // fp16.min_loss_scale
  // An overflow at min_loss_scale with no hysteresis left fails the step (as DeepSpeed raises)
  // instead of continuing at the floor.
  bool raise_error_at_min_scale = true;

  // From the config's parsed `fp16` section (config.hpp), which carries the same keys.
  static LossScalerConfig from_config(const Fp16Config& fp16);
  Status validate() const;
};

// Checkpointable state of a LossScaler.
struct LossScalerState {
  double scale = 1.0;
  std::int64_t iteration = 0;  // update() calls so far
  std::int64_t last_overflow_iteration = -1;
  int hysteresis_left = 1;
  std::int64_t overflows = 0;  // steps skipped so far
};

// The DeepSpeed dynamic loss scaler state machine. Per step: scan gradients with inv_scale(),
// then update(overflow). On overflow the step is skipped and, once hysteresis is exhausted, the
// scale halves (not below min_loss_scale). After loss_scale_window consecutive good steps since
// the last overflow the scale doubles (and hysteresis refills). A static scaler never changes
// its scale but still reports overflow so the step is skipped.
class LossScaler {
 public:
  static Result<LossScaler> create(const LossScalerConfig& config);

  bool dynamic() const { return config_.loss_scale == 0.0; }
  double scale() const { return state_.scale; }
  float inv_scale() const { return static_cast<float>(1.0 / state_.scale); }
  const LossScalerConfig& config() const { return config_; }
  const LossScalerState& state() const { return state_; }
  Status restore(const LossScalerState& state);

  // Records this step's overflow flag and moves the state machine. Returns true when the step
  // must be applied, false when it must be skipped. Fails (kFailedPrecondition) on an overflow
  // that would need a scale below min_loss_scale when raise_error_at_min_scale is set.
  Result<bool> update(bool overflow);

 private:
  LossScaler(const LossScalerConfig& config, const LossScalerState& state) : config_(config), state_(state) {}
  LossScalerConfig config_;
  LossScalerState state_;
};

// ---- One optimizer step over several buffers --------------------------------------------------

// A buffer and the group it belongs to; several buffers may share a group.
struct GroupBuffers {
  ParamGroup* group = nullptr;
  OptimizerBuffers buffers;
};

struct StepReport {
  bool applied = false;    // false: overflow, nothing was written and no step advanced
  double grad_norm = 0.0;  // global norm of the unscaled gradients, before clipping
  double clip_coefficient = 1.0;
  double loss_scale = 1.0;       // the scale this step's gradients carried
  double next_loss_scale = 1.0;  // the scale for the next step
};

// The whole single-process step: scan every buffer's gradients (one global norm over all of
// them), decide overflow, move the loss scaler, and, when the step applies, advance each group's
// step once and update every buffer with grad_scale = inv_scale * clip. On overflow no weight,
// moment or step count changes. max_grad_norm <= 0 disables clipping (`gradient_clipping`).
// Multi-rank callers use the pieces (scan_gradients, an all-reduce of sum_of_squares, update).
Result<StepReport> optimizer_step(const CpuOptimizer& optimizer, LossScaler& scaler,
                                  std::span<const GroupBuffers> buffers, double max_grad_norm);

// ---- Fused AdamW on the device ------------------------------------------------------------------

// One tensor for the fused CUDA AdamW. All pointers are device memory. `param` (param_dtype:
// kBF16, kF16 or kF32) receives the updated master rounded to nearest even; `master`, `exp_avg`
// and `exp_avg_sq` are fp32 and updated in place; `grad` has grad_dtype.
struct DeviceAdamTensor {
  void* param = nullptr;
  float* master = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  const void* grad = nullptr;
  std::size_t n = 0;
};

// AdamW (or Adam, per hyper.kind) over many tensors in few kernel launches, enqueued on
// `cuda_stream` (a cudaStream_t; null = the default stream). The arithmetic is the CPU update's,
// operation for operation, so results match CpuOptimizer::update bit for bit. Returns
// kUnavailable in a build without CUDA, kInvalidArgument for Lion/Adagrad or bad tensors, and
// kDeviceError when the launch fails. Asynchronous: errors inside the kernel surface at the
// stream's next synchronisation.
Status fused_adam_cuda(std::span<const DeviceAdamTensor> tensors, DType param_dtype, DType grad_dtype,
                       const OptimizerHyper& hyper, std::int64_t step, float grad_scale, void* cuda_stream);

}  // namespace strata
