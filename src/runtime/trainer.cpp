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

#include "model/launcher.hpp"
#include "model/staging.hpp"
#include "runtime/evaluate.hpp"
#include "runtime/optimizer_cuda.hpp"
#include "strata/config.hpp"
#include "strata/data.hpp"
#include "strata/device.hpp"
#include "strata/engine.hpp"
#include "strata/log.hpp"
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
  return schedule.validate();
}

Status TrainerConfig::apply(const Config& config, const std::vector<std::string>& present_keys) {
  auto present = [&](std::string_view key) {
    return std::find(present_keys.begin(), present_keys.end(), key) != present_keys.end();
  };
  const std::string& src = config.source;
  if (config.fp16.enabled) {
    return invalid_argument(
        src + ": fp16.enabled: fp16 training is not supported by this trainer (use bf16.enabled)");
  }
  const auto& zero = config.zero_optimization;
  if (zero.offload_param.device != OffloadDevice::kNone ||
      zero.offload_optimizer.device != OffloadDevice::kNone) {
    return invalid_argument(
        src +
        ": zero_optimization.offload_*: offload is not available in `strata train` yet (it runs "
        "the single-device, no-offload engine); remove the offload sections");
  }
  if (zero.stage > 0) {
    STRATA_LOG(kWarn, kRuntime) << src << ": zero_optimization.stage " << zero.stage
                                << " has no effect on a single device; training without partitioning";
  }
  if (present("optimizer")) {
    const OptimizerConfig& o = config.optimizer;
    if (o.type != OptimizerType::kAdam && o.type != OptimizerType::kAdamW) {
      return invalid_argument(src + ": optimizer.type: " + std::string(to_string(o.type)) +
                              " is not supported by this trainer (Adam, AdamW)");
    }
    optimizer.lr = o.lr;
    optimizer.beta1 = o.betas[0];
    optimizer.beta2 = o.betas[1];
    optimizer.eps = o.eps;
    optimizer.weight_decay = o.weight_decay;
    optimizer.decoupled = o.type == OptimizerType::kAdamW || o.adam_w_mode;
    schedule.lr = o.lr;
  }
  if (present("scheduler")) {
    const SchedulerConfig& s = config.scheduler;
    schedule.log_warmup = s.warmup_type == WarmupType::kLog;
    schedule.warmup_steps = s.warmup_num_steps;
    switch (s.type) {
      case SchedulerType::kNone:
        schedule.kind = LrScheduleKind::kConstant;
        break;
      case SchedulerType::kWarmupLR:
        schedule.kind = LrScheduleKind::kWarmupLR;
        schedule.warmup_min_lr = s.warmup_min_lr;
        schedule.warmup_max_lr = s.warmup_max_lr;
        break;
      case SchedulerType::kWarmupDecayLR:
        schedule.kind = LrScheduleKind::kWarmupDecay;
        schedule.warmup_min_lr = s.warmup_min_lr;
        schedule.warmup_max_lr = s.warmup_max_lr;
        schedule.total_steps = s.total_num_steps;
        break;
      case SchedulerType::kWarmupCosineLR:
        schedule.kind = LrScheduleKind::kWarmupCosine;
        schedule.total_steps = s.total_num_steps;
        schedule.warmup_min_ratio = s.warmup_min_ratio;
        schedule.min_ratio = s.cos_min_ratio;
        break;
    }
  }
  if (present("gradient_clipping")) grad_clip = config.gradient_clipping;
  if (present("bf16")) model.dtype = config.bf16.enabled ? DType::kBF16 : DType::kF32;
  if (config.train_batch_size || config.train_micro_batch_size_per_gpu ||
      config.gradient_accumulation_steps) {
    auto sizes = resolve_batch_sizes(config, 1);
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

// ---- the trainer -------------------------------------------------------------------------------

namespace {

// The optimizer's view of one owning parameter.
struct ParamState {
  detail::AdamBuffers buffers;
  bool decay = false;
};

std::vector<RegionSpec> optimizer_regions(const ModelLayout& layout) {
  std::vector<RegionSpec> r;
  const std::uint64_t bytes = std::max<std::uint64_t>(layout.grad_bytes, kParamAlignment);
  if (layout.config.dtype == DType::kBF16) r.push_back(RegionSpec{"optim.master", bytes, 0, 0});
  r.push_back(RegionSpec{"optim.exp_avg", bytes, 0, 0});
  r.push_back(RegionSpec{"optim.exp_avg_sq", bytes, 0, 0});
  return r;
}

Model::Options model_options(const TrainerConfig& c) {
  Model::Options o;
  o.max_batch = c.micro_batch;
  o.max_seq_len = c.seq_len;
  o.with_grads = true;
  o.plan_arena = false;
  o.loss_slots = static_cast<int>(c.grad_accum);
  return o;
}

}  // namespace

struct Trainer::Impl {
  TrainerConfig config;
  Device* device = nullptr;
  Stream* stream = nullptr;
  std::unique_ptr<Model> model;
  std::unique_ptr<detail::KernelLauncher> launch;  // the optimizer's kernels
  std::unique_ptr<detail::HostStager> stager;
  float* master = nullptr;  // bf16 mode: optim.master; fp32 mode: the params region itself
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  std::vector<ParamState> states;
  std::size_t grad_floats = 0;
  std::optional<CpuOptimizer> cpu_optimizer;  // cpu backend: the vectorized optimizer of optim.hpp
  ArenaBuffer cuda_partials;          // cuda: the same on the device, plus the result
  ArenaBuffer pinned_norm;
  double grad_norm = 0.0;  // written by the optimizer step in stream order
  std::int64_t steps = 0;

  float* master_of(int index) const {
    const ParamDesc& p = model->layout().params[static_cast<std::size_t>(index)];
    if (config.model.dtype != DType::kBF16) return static_cast<float*>(model->param_data(index));
    return reinterpret_cast<float*>(reinterpret_cast<char*>(master) + p.grad_offset);
  }
  Status write_master(int index, std::span<const float> values) {
    if (config.model.dtype != DType::kBF16) return ok_status();  // the params are the master
    return stager->upload(master_of(index), values.data(), values.size() * 4);
  }
  Status optimizer_step(double lr, std::int64_t step);
  Status run_micro_batches(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets,
                           std::int64_t micro_batches);
};

namespace {

OptimizerHyper to_hyper(const detail::AdamHyper& h) {
  OptimizerHyper o;
  o.kind = h.decoupled ? OptimizerKind::kAdamW : OptimizerKind::kAdam;
  o.lr = h.lr;
  o.beta1 = h.beta1;
  o.beta2 = h.beta2;
  o.eps = h.eps;
  o.weight_decay = h.weight_decay;
  return o;
}

}  // namespace

Status Trainer::Impl::optimizer_step(double lr, std::int64_t step) {
  detail::AdamHyper decay{lr,
                          config.optimizer.beta1,
                          config.optimizer.beta2,
                          config.optimizer.eps,
                          config.optimizer.weight_decay,
                          config.optimizer.decoupled};
  detail::AdamHyper no_decay = decay;
  no_decay.weight_decay = 0.0;
  const double max_norm = config.grad_clip;
  const float* grads = model->grads_base();
  const std::size_t n = grad_floats;
  if (launch->is_cpu()) {
    // One host function on the stream: the gradient scan (norm and overflow), then every update
    // with the clip applied, on the stream's compute threads.
    const std::vector<ParamState>* params = &states;
    const CpuOptimizer* opt = &*cpu_optimizer;
    double* norm_out = &grad_norm;
    const OptimizerHyper hyper_decay = to_hyper(decay);
    const OptimizerHyper hyper_no_decay = to_hyper(no_decay);
    return launch->run("optimizer step", [=](const kernels::KernelContext&) -> Status {
      STRATA_ASSIGN_OR_RETURN(GradStats stats,
                              opt->scan_gradients(const_cast<float*>(grads), DType::kF32, n, 1.0f, false));
      const double norm = stats.norm();
      *norm_out = norm;
      if (!stats.finite()) {
        return invalid_argument("step " + std::to_string(step) + ": the gradient norm is not finite (" +
                                std::to_string(norm) + "); lower the learning rate or enable clipping");
      }
      const auto scale = static_cast<float>(clip_coefficient(norm, max_norm));
      for (const ParamState& p : *params) {
        OptimizerBuffers b;
        b.master = p.buffers.master;
        b.grad = p.buffers.grad;
        b.grad_dtype = DType::kF32;
        b.exp_avg = p.buffers.exp_avg;
        b.exp_avg_sq = p.buffers.exp_avg_sq;
        b.moment_dtype = DType::kF32;
        b.param_out = p.buffers.param_out;
        b.out_dtype = DType::kBF16;
        b.n = p.buffers.n;
        STRATA_RETURN_IF_ERROR(opt->update(p.decay ? hyper_decay : hyper_no_decay, step, scale, b));
      }
      return ok_status();
    });
  }
  // cuda: the norm is needed on the host to pick the clip scale.
  auto* partials = static_cast<double*>(cuda_partials.data());
  double* result = partials + detail::sum_of_squares_cuda_partials(n);
  void* cs = stream->native_handle();
  STRATA_RETURN_IF_ERROR(detail::sum_of_squares_cuda(cs, grads, n, partials, result));
  STRATA_RETURN_IF_ERROR(
      stream->copy_async(pinned_norm.data(), result, sizeof(double), CopyKind::kDeviceToHost));
  STRATA_RETURN_IF_ERROR(stream->synchronize());
  grad_norm = std::sqrt(*static_cast<double*>(pinned_norm.data()));
  if (!std::isfinite(grad_norm)) {
    return invalid_argument("step " + std::to_string(step) +
                            ": the gradient norm is not finite; lower the learning "
                            "rate or enable clipping");
  }
  const auto scale = static_cast<float>(clip_coefficient(grad_norm, max_norm));
  for (const ParamState& p : states) {
    STRATA_RETURN_IF_ERROR(detail::adamw_update_cuda(cs, p.decay ? decay : no_decay, step, scale, p.buffers));
  }
  return ok_status();
}

Status Trainer::Impl::run_micro_batches(std::span<const std::int32_t> inputs,
                                        std::span<const std::int32_t> targets, std::int64_t micro_batches) {
  const std::int64_t B = config.micro_batch, T = config.seq_len;
  const auto per = static_cast<std::size_t>(B * T);
  if (inputs.size() != per * static_cast<std::size_t>(micro_batches) || targets.size() != inputs.size()) {
    return invalid_argument("train step: expected " +
                            std::to_string(per * static_cast<std::size_t>(micro_batches)) +
                            " inputs and targets (" + std::to_string(micro_batches) + " micro-batches of " +
                            std::to_string(B) + " x " + std::to_string(T) + "), got " +
                            std::to_string(inputs.size()) + " and " + std::to_string(targets.size()));
  }
  std::int64_t count = 0;
  for (auto t : targets) count += t >= 0 ? 1 : 0;
  if (count == 0) return invalid_argument("train step: every target is ignored (negative)");
  STRATA_RETURN_IF_ERROR(model->zero_grads());
  const float dloss = 1.0f / static_cast<float>(count);
  for (std::int64_t a = 0; a < micro_batches; ++a) {
    STRATA_RETURN_IF_ERROR(
        model->set_batch(inputs.subspan(a * per, per), targets.subspan(a * per, per), B, T));
    STRATA_RETURN_IF_ERROR(model->forward(true));
    STRATA_RETURN_IF_ERROR(model->copy_losses(static_cast<int>(a)));
    STRATA_RETURN_IF_ERROR(model->backward(dloss));
  }
  return ok_status();
}

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Trainer::~Trainer() {
  if (impl_ && impl_->stream != nullptr) {
    Status s = impl_->stream->synchronize();
    if (!s.ok()) {
      STRATA_LOG(kWarn, kRuntime) << "trainer: unreported stream error at destruction: " << s.to_string();
    }
  }
}

Result<std::uint64_t> Trainer::device_bytes(const TrainerConfig& config) {
  STRATA_RETURN_IF_ERROR(config.validate());
  STRATA_ASSIGN_OR_RETURN(ModelLayout layout, describe_model(config.model));
  std::uint64_t total = 0;
  for (const auto& r : Model::regions(layout, model_options(config))) total += r.bytes;
  for (const auto& r : optimizer_regions(layout)) total += r.bytes;
  // Activations: what the model carves (measured by the model itself would need a device);
  // this bound follows model.cpp's carving, per token, with generous alignment slack.
  const ModelConfig& c = config.model;
  const std::int64_t N = config.micro_batch * config.seq_len;
  const std::int64_t C = c.n_embd, F = c.ffn(), Q = (c.n_head + 2 * c.kv_heads()) * c.head_dim();
  const std::int64_t per_set = 4 * C + Q + (c.kind == ModelKind::kGpt2 ? 2 * F : 3 * F);
  const std::int64_t sets = c.activation_checkpointing ? 1 : c.n_layer;
  const std::uint64_t w = dtype_size(c.dtype);
  std::uint64_t acts =
      static_cast<std::uint64_t>(N) *
      (w * static_cast<std::uint64_t>((c.n_layer + 1) * C + sets * per_set + C + c.padded_vocab()) +
       4 * static_cast<std::uint64_t>(sets * (4 + c.n_head) + 4));
  acts +=
      static_cast<std::uint64_t>(N) * w * static_cast<std::uint64_t>(3 * C + Q + 3 * F);  // activation grads
  acts += static_cast<std::uint64_t>(N) * 8 + static_cast<std::uint64_t>(c.n_positions * c.head_dim()) * 4;
  total += acts + (64u << 20);  // kernel workspace and alignment
  return total;
}

Result<std::unique_ptr<Trainer>> Trainer::create(const TrainerConfig& config, Device& device,
                                                 Stream* stream) {
  STRATA_RETURN_IF_ERROR(config.validate());
  auto impl = std::make_unique<Impl>();
  Impl& t = *impl;
  t.config = config;
  t.device = &device;
  STRATA_ASSIGN_OR_RETURN(ModelLayout layout, describe_model(config.model));
  const Model::Options mo = model_options(config);
  std::vector<RegionSpec> plan = Model::regions(layout, mo);
  const std::vector<RegionSpec> opt = optimizer_regions(layout);
  plan.insert(plan.end(), opt.begin(), opt.end());
  STRATA_RETURN_IF_ERROR(device.memory().plan(plan).with_context("trainer: planning device memory"));
  if (stream == nullptr) {
    STRATA_ASSIGN_OR_RETURN(stream, device.create_stream("train"));
  }
  t.stream = stream;
  const std::uint64_t grad_bytes = layout.grad_bytes;
  STRATA_ASSIGN_OR_RETURN(t.model, Model::create(std::move(layout), device, *stream, mo));

  Arena& arena = device.memory();
  char* base = static_cast<char*>(arena.base());
  for (const auto& r : opt) {
    STRATA_ASSIGN_OR_RETURN(std::uint64_t off, arena.allocate_persistent(r.name, r.bytes));
    float* p = reinterpret_cast<float*>(base + off);
    if (r.name == "optim.master") t.master = p;
    if (r.name == "optim.exp_avg") t.exp_avg = p;
    if (r.name == "optim.exp_avg_sq") t.exp_avg_sq = p;
    STRATA_RETURN_IF_ERROR(stream->memset_async(p, 0, r.bytes));
  }
  const bool bf16 = config.model.dtype == DType::kBF16;
  if (!bf16) t.master = static_cast<float*>(t.model->params_base());
  t.grad_floats = grad_bytes / 4;
  STRATA_ASSIGN_OR_RETURN(t.launch, detail::KernelLauncher::create(device, *stream, 0));
  std::uint64_t largest = 4096;
  const ModelLayout& lay = t.model->layout();
  for (const auto& p : lay.params)
    largest = std::max<std::uint64_t>(largest, static_cast<std::uint64_t>(p.numel()) * 4);
  STRATA_ASSIGN_OR_RETURN(
      t.stager, detail::HostStager::create(device, *stream, std::min<std::uint64_t>(largest, 16u << 20),
                                           "trainer.staging"));
  if (t.launch->is_cpu()) {
    // The update runs on the compute stream's worker, so it gets the stream's thread budget.
    CpuOptimizerConfig oc;
    STRATA_ASSIGN_OR_RETURN(oc.isa, select_optimizer_isa(config.optimizer_isa));
    oc.threads = std::max(1, device.info().compute_threads);
    STRATA_ASSIGN_OR_RETURN(CpuOptimizer opt, CpuOptimizer::create(oc));
    t.cpu_optimizer = opt;
  } else {
    STRATA_ASSIGN_OR_RETURN(
        t.cuda_partials,
        device.allocate((detail::sum_of_squares_cuda_partials(t.grad_floats) + 1) * sizeof(double),
                        "trainer.norm"));
    STRATA_ASSIGN_OR_RETURN(t.pinned_norm, device.pinned().allocate(sizeof(double), "trainer.norm"));
  }
  for (std::size_t i = 0; i < lay.params.size(); ++i) {
    const ParamDesc& p = lay.params[i];
    if (!p.owns_storage()) continue;
    ParamState s;
    s.decay = p.weight_decay;
    s.buffers.master = t.master_of(static_cast<int>(i));
    s.buffers.grad = t.model->grad_data(static_cast<int>(i));
    s.buffers.exp_avg = reinterpret_cast<float*>(reinterpret_cast<char*>(t.exp_avg) + p.grad_offset);
    s.buffers.exp_avg_sq = reinterpret_cast<float*>(reinterpret_cast<char*>(t.exp_avg_sq) + p.grad_offset);
    s.buffers.param_out =
        bf16 ? static_cast<std::uint16_t*>(t.model->param_data(static_cast<int>(i))) : nullptr;
    s.buffers.n = static_cast<std::size_t>(p.numel());
    t.states.push_back(s);
  }
  // Initial weights: working copy and (bf16) the exact fp32 master.
  std::vector<float> values;
  for (std::size_t i = 0; i < lay.params.size(); ++i) {
    const ParamDesc& p = lay.params[i];
    if (!p.owns_storage()) continue;
    values.resize(static_cast<std::size_t>(p.numel()));
    init_values(lay, static_cast<int>(i), config.seed, 0, p.numel(), values.data());
    STRATA_RETURN_IF_ERROR(t.model->upload_param(static_cast<int>(i), values));
    STRATA_RETURN_IF_ERROR(t.write_master(static_cast<int>(i), values));
  }
  STRATA_RETURN_IF_ERROR(stream->synchronize());
  return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
}

Result<StepMetrics> Trainer::step(std::span<const std::int32_t> inputs,
                                  std::span<const std::int32_t> targets) {
  Impl& t = *impl_;
  const auto start = std::chrono::steady_clock::now();
  STRATA_RETURN_IF_ERROR(t.run_micro_batches(inputs, targets, t.config.grad_accum));
  StepMetrics m;
  m.step = t.steps + 1;
  m.lr = t.config.schedule.at(t.steps);
  STRATA_RETURN_IF_ERROR(t.optimizer_step(m.lr, m.step));
  STRATA_RETURN_IF_ERROR(t.stream->synchronize());
  LossSum total;
  for (int a = 0; a < static_cast<int>(t.config.grad_accum); ++a) {
    const LossSum s = t.model->loss_sum(a);
    total.sum += s.sum;
    total.count += s.count;
  }
  t.steps += 1;
  m.loss = total.sum / static_cast<double>(total.count);
  m.grad_norm = t.grad_norm;
  m.tokens = static_cast<std::int64_t>(inputs.size());
  m.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return m;
}

Result<double> Trainer::loss_and_gradients(std::span<const std::int32_t> inputs,
                                           std::span<const std::int32_t> targets) {
  Impl& t = *impl_;
  const auto micro = static_cast<std::int64_t>(inputs.size()) / (t.config.micro_batch * t.config.seq_len);
  if (micro < 1 || micro > t.config.grad_accum) {
    return invalid_argument("loss_and_gradients: expected 1 to " + std::to_string(t.config.grad_accum) +
                            " micro-batches of tokens");
  }
  STRATA_RETURN_IF_ERROR(t.run_micro_batches(inputs, targets, micro));
  STRATA_RETURN_IF_ERROR(t.stream->synchronize());
  LossSum total;
  for (int a = 0; a < static_cast<int>(micro); ++a) {
    total.sum += t.model->loss_sum(a).sum;
    total.count += t.model->loss_sum(a).count;
  }
  return total.sum / static_cast<double>(total.count);
}

Result<double> Trainer::loss(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets) {
  Impl& t = *impl_;
  STRATA_RETURN_IF_ERROR(t.model->set_batch(inputs, targets, t.config.micro_batch, t.config.seq_len));
  STRATA_RETURN_IF_ERROR(t.model->forward(false));
  STRATA_RETURN_IF_ERROR(t.model->copy_losses(0));
  STRATA_RETURN_IF_ERROR(t.stream->synchronize());
  const LossSum s = t.model->loss_sum(0);
  return s.sum / static_cast<double>(s.count);
}

Result<EvalResult> Trainer::evaluate(std::span<const std::int32_t> tokens, std::int64_t max_windows) {
  return evaluate_windows(*impl_->model, tokens, impl_->config.seq_len, impl_->config.micro_batch,
                          max_windows);
}

Status Trainer::set_param(int index, std::span<const float> values) {
  STRATA_RETURN_IF_ERROR(impl_->model->upload_param(index, values));
  STRATA_RETURN_IF_ERROR(impl_->write_master(index, values));
  return impl_->stream->synchronize();
}

Status Trainer::save_weights(const std::string& path, WeightFormat format) {
  return strata::save_weights(*impl_->model, path, format);
}

Status Trainer::load_weights(const std::string& path) {
  // Tensor shapes are checked against this trainer's layout as they are read.
  STRATA_RETURN_IF_ERROR(
      read_weights(impl_->model->layout(), path, [&](int index, std::span<const float> values) {
        STRATA_RETURN_IF_ERROR(impl_->model->upload_param(index, values));
        return impl_->write_master(index, values);
      }));
  return impl_->stream->synchronize();
}

Model& Trainer::model() { return *impl_->model; }
const TrainerConfig& Trainer::config() const { return impl_->config; }
std::int64_t Trainer::steps_done() const { return impl_->steps; }

std::string Trainer::optimizer_name() const {
  return impl_->launch->is_cpu() ? "scalar AdamW (src/runtime/adamw.cpp)"
                                 : "AdamW (src/runtime/optimizer_cuda.cu)";
}

}  // namespace strata
