// CpuOptimizer: argument checks, ISA selection, the split of a buffer over OpenMP threads, the
// gradient scan's fixed segmentation, clipping, and optimizer_step() tying them to the loss
// scaler. The arithmetic lives in kernel_body.inc.
#include <cpuid.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <string>

#include "optim/kernels.hpp"
#include "strata/config.hpp"
#include "strata/cpu_budget.hpp"
#include "strata/log.hpp"
#include "strata/optim.hpp"
#include "strata/options.hpp"

namespace strata {

using optim_detail::IsaKernels;
using optim_detail::OutMode;
using optim_detail::UpdateArgs;

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string fmt(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

// Elements per thread below which another thread costs more than it brings.
constexpr std::size_t kMinElementsPerThread = 16384;
// Per-thread ranges start on multiples of this (a cache line of every element type).
constexpr std::size_t kThreadGranule = 64;
// The gradient scan: at most this many segments, each at least kMinScanSegment elements.
constexpr std::size_t kMaxScanSegments = 256;
constexpr std::size_t kMinScanSegment = 16384;

}  // namespace

// ---- Names ------------------------------------------------------------------------------------

std::string_view to_string(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdamW:
      return "adamw";
    case OptimizerKind::kAdam:
      return "adam";
    case OptimizerKind::kLion:
      return "lion";
    case OptimizerKind::kAdagrad:
      return "adagrad";
  }
  return "unknown";
}

Result<OptimizerKind> parse_optimizer_kind(std::string_view text) {
  const std::string t = lower(text);
  if (t == "adamw") return OptimizerKind::kAdamW;
  if (t == "adam") return OptimizerKind::kAdam;
  if (t == "lion") return OptimizerKind::kLion;
  if (t == "adagrad") return OptimizerKind::kAdagrad;
  return invalid_argument("'" + std::string(text) +
                          "' is not an optimizer (expected adamw, adam, lion or adagrad)");
}

// ---- ISA selection ----------------------------------------------------------------------------

namespace {

// CPUID leaf 1, ECX bit 29. clang's __builtin_cpu_supports does not know "f16c" (gcc's does),
// so the bit is read directly, the same way under both compilers.
bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
  return (ecx & (1u << 29)) != 0;
}

// The features each path's pragma targets, with their __builtin_cpu_supports names.
std::string missing_features(SimdIsa isa) {
  std::string missing;
  auto need = [&](bool have, const char* name) {
    if (!have) missing += std::string(missing.empty() ? "" : ", ") + name;
  };
  __builtin_cpu_init();
  if (isa == SimdIsa::kAvx2 || isa == SimdIsa::kAvx512) {
    need(__builtin_cpu_supports("avx2"), "avx2");
    need(__builtin_cpu_supports("fma"), "fma");
    need(cpu_has_f16c(), "f16c");
  }
  if (isa == SimdIsa::kAvx512) {
    need(__builtin_cpu_supports("avx512f"), "avx512f");
    need(__builtin_cpu_supports("avx512bw"), "avx512bw");
    need(__builtin_cpu_supports("avx512vl"), "avx512vl");
    need(__builtin_cpu_supports("avx512dq"), "avx512dq");
  }
  return missing;
}

}  // namespace

bool optimizer_supports(SimdIsa isa) { return missing_features(isa).empty(); }

SimdIsa best_optimizer_isa() {
  if (optimizer_supports(SimdIsa::kAvx512)) return SimdIsa::kAvx512;
  if (optimizer_supports(SimdIsa::kAvx2)) return SimdIsa::kAvx2;
  return SimdIsa::kScalar;
}

Result<SimdIsa> select_optimizer_isa(std::string_view request) {
  const std::string t = lower(request);
  SimdIsa isa;
  if (t == "auto") return best_optimizer_isa();
  if (t == "avx512") {
    isa = SimdIsa::kAvx512;
  } else if (t == "avx2") {
    isa = SimdIsa::kAvx2;
  } else if (t == "scalar") {
    isa = SimdIsa::kScalar;
  } else {
    return invalid_argument("adam_isa: '" + std::string(request) +
                            "' is not one of auto, avx512, avx2, scalar");
  }
  const std::string missing = missing_features(isa);
  if (!missing.empty()) {
    return unavailable("adam_isa: this CPU cannot run the " + t + " path (missing " + missing +
                       "); use auto or a lesser path");
  }
  return isa;
}

namespace optim_detail {

const IsaKernels& kernels_for(SimdIsa isa) {
  static const IsaKernels kScalar{update_range_scalar, scan_range_scalar, stream_range_scalar,
                                  round_range_scalar};
  static const IsaKernels kAvx2{update_range_avx2, scan_range_avx2, stream_range_avx2, round_range_avx2};
  static const IsaKernels kAvx512{update_range_avx512, scan_range_avx512, stream_range_avx512,
                                  round_range_avx512};
  switch (isa) {
    case SimdIsa::kAvx512:
      return kAvx512;
    case SimdIsa::kAvx2:
      return kAvx2;
    case SimdIsa::kScalar:
      break;
  }
  return kScalar;
}

void parallel_ranges(std::size_t n, int threads, std::size_t granule,
                     void (*fn)(void* ctx, std::size_t begin, std::size_t end), void* ctx) {
  const std::size_t useful = std::max<std::size_t>(1, n / kMinElementsPerThread);
  const int team = static_cast<int>(std::min<std::size_t>(std::max(threads, 1), useful));
  if (team <= 1) {
    fn(ctx, 0, n);
    return;
  }
  // Chunks handed out dynamically, about 16 per thread: the host cores are shared (device
  // compute threads, I/O, other processes), and a thread that loses its core for a while must
  // not hold up the whole update. Results do not depend on the split (elements are independent).
  const std::size_t target = std::max(kMinElementsPerThread, n / (static_cast<std::size_t>(team) * 16));
  const std::size_t chunk = (target + granule - 1) / granule * granule;
  const std::size_t chunks = (n + chunk - 1) / chunk;
  // Team threads count toward the CPU account of the thread leading them (the host optimizer's
  // or, for the device optimizer of the cpu backend, the compute stream's): libgomp creates new
  // pool threads when a team grows again after a smaller one, so they join here, cheaply.
  const CpuAccount lead = CpuAccount::of_current_thread();
#pragma omp parallel num_threads(team)
  {
    lead.join(/*since_start=*/true);
#pragma omp for schedule(dynamic, 1)
    for (std::size_t c = 0; c < chunks; ++c) fn(ctx, c * chunk, std::min(n, (c + 1) * chunk));
  }
}

void stream_parallel(SimdIsa isa, int threads, const StreamArgs& a, std::size_t n) {
  struct Ctx {
    const StreamArgs* a;
    void (*stream)(const StreamArgs&, std::size_t, std::size_t);
  } ctx{&a, kernels_for(isa).stream};
  parallel_ranges(
      n, threads, kThreadGranule,
      [](void* c, std::size_t b, std::size_t e) {
        auto* x = static_cast<Ctx*>(c);
        x->stream(*x->a, b, e);
      },
      &ctx);
}

void round_with_isa(SimdIsa isa, const float* in, std::uint16_t* out, DType dtype, std::size_t n) {
  kernels_for(isa).round(in, out, dtype, n);
}

}  // namespace optim_detail

// ---- Hyperparameters --------------------------------------------------------------------------

OptimizerHyper OptimizerHyper::defaults(OptimizerKind kind) {
  OptimizerHyper h;  // Adam/AdamW/Lion: lr 1e-3, betas (0.9, 0.999), no weight decay
  h.kind = kind;
  if (kind == OptimizerKind::kLion) h.eps = 0.0;
  if (kind == OptimizerKind::kAdagrad) {
    h.lr = 1e-2;
    h.eps = 1e-10;
  }
  return h;
}

OptimizerHyper OptimizerHyper::from_config(const OptimizerConfig& config) {
  OptimizerKind kind = OptimizerKind::kAdamW;
  switch (config.type) {
    case OptimizerType::kAdam:
      kind = config.adam_w_mode ? OptimizerKind::kAdamW : OptimizerKind::kAdam;
      break;
    case OptimizerType::kAdamW:
      kind = OptimizerKind::kAdamW;
      break;
    case OptimizerType::kLion:
      kind = OptimizerKind::kLion;
      break;
    case OptimizerType::kAdagrad:
      kind = OptimizerKind::kAdagrad;
      break;
  }
  OptimizerHyper h = defaults(kind);
  h.lr = config.lr;
  h.beta1 = config.betas[0];
  h.beta2 = config.betas[1];
  if (kind != OptimizerKind::kLion) h.eps = config.eps;
  h.weight_decay = config.weight_decay;
  return h;
}

Status OptimizerHyper::validate() const {
  auto bad = [](std::string_view field, double value, std::string_view expected) {
    return invalid_argument("optimizer." + std::string(field) + " = " + fmt(value) + " is not " +
                            std::string(expected));
  };
  if (!std::isfinite(lr) || lr < 0) return bad("lr", lr, "a finite number >= 0");
  const bool uses_betas = kind != OptimizerKind::kAdagrad;
  if (uses_betas && !(beta1 >= 0 && beta1 < 1)) return bad("beta1", beta1, "in [0, 1)");
  if (uses_betas && !(beta2 >= 0 && beta2 < 1)) return bad("beta2", beta2, "in [0, 1)");
  if (!std::isfinite(eps) || eps < 0) return bad("eps", eps, "a finite number >= 0");
  if (!std::isfinite(weight_decay) || weight_decay < 0)
    return bad("weight_decay", weight_decay, "a finite number >= 0");
  if (!std::isfinite(lr_decay) || lr_decay < 0) return bad("lr_decay", lr_decay, "a finite number >= 0");
  return ok_status();
}

// ---- Gradient statistics and clipping ---------------------------------------------------------

bool GradStats::finite() const { return std::isfinite(sum_of_squares); }
double GradStats::norm() const { return std::sqrt(sum_of_squares); }

double clip_coefficient(double total_norm, double max_norm) {
  if (!(max_norm > 0) || !std::isfinite(total_norm)) return 1.0;
  return std::min(1.0, max_norm / (total_norm + 1e-6));
}

// ---- CpuOptimizer -----------------------------------------------------------------------------

Result<CpuOptimizerConfig> CpuOptimizerConfig::from_options(const Options& options) {
  CpuOptimizerConfig c;
  STRATA_ASSIGN_OR_RETURN(c.isa, select_optimizer_isa(options.get_string(Option::kAdamIsa)));
  STRATA_ASSIGN_OR_RETURN(const CpuBudget budget, CpuBudget::for_process(CpuBudgetConfig::from_options(options)));
  c.threads = budget.host_threads;
  return c;
}

Result<CpuOptimizer> CpuOptimizer::create(const CpuOptimizerConfig& config) {
  if (config.threads < 1) {
    return invalid_argument("CPU optimizer: threads = " + std::to_string(config.threads) +
                            " (need at least 1)");
  }
  const std::string missing = missing_features(config.isa);
  if (!missing.empty()) {
    return unavailable("CPU optimizer: this CPU cannot run the " + std::string(to_string(config.isa)) +
                       " path (missing " + missing + ")");
  }
  STRATA_LOG(kDebug, kOptim) << "CPU optimizer: isa " << to_string(config.isa) << ", " << config.threads
                             << " threads";
  return CpuOptimizer(config);
}

namespace {

Status check_pointer(const void* p, std::size_t elem_size, std::string_view what) {
  if (p == nullptr) return invalid_argument("CPU optimizer: " + std::string(what) + " is null");
  if (reinterpret_cast<std::uintptr_t>(p) % elem_size != 0) {
    return invalid_argument("CPU optimizer: " + std::string(what) + " is not aligned to its " +
                            std::to_string(elem_size) + "-byte elements");
  }
  return ok_status();
}

Status check_buffers(const OptimizerHyper& hyper, const OptimizerBuffers& b) {
  const bool has_m = hyper.kind != OptimizerKind::kAdagrad;
  const bool has_v = hyper.kind != OptimizerKind::kLion;
  if (b.moment_dtype == DType::kF16) {
    return invalid_argument("CPU optimizer: moment dtype fp16 is not supported (use fp32 or bf16)");
  }
  if (hyper.kind == OptimizerKind::kAdagrad && b.moment_dtype != DType::kF32) {
    return invalid_argument("CPU optimizer: adagrad keeps its sum of squares in fp32 (moment dtype " +
                            std::string(to_string(b.moment_dtype)) + " requested)");
  }
  STRATA_RETURN_IF_ERROR(check_pointer(b.master, 4, "master"));
  STRATA_RETURN_IF_ERROR(check_pointer(b.grad, dtype_size(b.grad_dtype), "grad"));
  if (has_m) STRATA_RETURN_IF_ERROR(check_pointer(b.exp_avg, dtype_size(b.moment_dtype), "exp_avg"));
  if (has_v) STRATA_RETURN_IF_ERROR(check_pointer(b.exp_avg_sq, dtype_size(b.moment_dtype), "exp_avg_sq"));
  if (b.param_out != nullptr) {
    if (b.out_dtype == DType::kF32) {
      return invalid_argument(
          "CPU optimizer: param_out must be bf16 or fp16 (the fp32 master is already there)");
    }
    STRATA_RETURN_IF_ERROR(check_pointer(b.param_out, 2, "param_out"));
  }
  return ok_status();
}

}  // namespace

Status CpuOptimizer::update(const OptimizerHyper& hyper, std::int64_t step, float grad_scale,
                            const OptimizerBuffers& buffers) const {
  STRATA_RETURN_IF_ERROR(hyper.validate());
  if (step < 1)
    return invalid_argument("CPU optimizer: step " + std::to_string(step) + " (steps count from 1)");
  if (!std::isfinite(grad_scale))
    return invalid_argument("CPU optimizer: grad_scale " + fmt(grad_scale) + " is not finite");
  if (buffers.n == 0) return ok_status();
  STRATA_RETURN_IF_ERROR(check_buffers(hyper, buffers));

  UpdateArgs a;
  a.kind = hyper.kind;
  a.c = optim_detail::make_update_constants(hyper, step, grad_scale, config_.seed);
  a.master = buffers.master;
  a.grad = buffers.grad;
  a.grad_dtype = buffers.grad_dtype;
  a.exp_avg = buffers.exp_avg;
  a.exp_avg_sq = buffers.exp_avg_sq;
  a.moment_dtype = buffers.moment_dtype;
  a.out = buffers.param_out;
  a.out_mode = buffers.param_out == nullptr       ? OutMode::kNone
               : buffers.out_dtype == DType::kF16 ? OutMode::kF16
                                                  : OutMode::kBF16;
  a.element_offset = buffers.element_offset;

  struct Ctx {
    const UpdateArgs* a;
    void (*update)(const UpdateArgs&, std::size_t, std::size_t);
  } ctx{&a, optim_detail::kernels_for(config_.isa).update};
  optim_detail::parallel_ranges(
      buffers.n, config_.threads, kThreadGranule,
      [](void* c, std::size_t b, std::size_t e) {
        auto* x = static_cast<Ctx*>(c);
        x->update(*x->a, b, e);
      },
      &ctx);
  return ok_status();
}

Result<GradStats> CpuOptimizer::scan_gradients(void* grad, DType dtype, std::size_t n, float inv_loss_scale,
                                               bool write_unscaled) const {
  if (!std::isfinite(inv_loss_scale) || inv_loss_scale <= 0) {
    return invalid_argument("gradient scan: inverse loss scale " + fmt(inv_loss_scale) +
                            " is not a positive number");
  }
  GradStats stats;
  stats.count = n;
  if (n == 0) return stats;
  STRATA_RETURN_IF_ERROR(check_pointer(grad, dtype_size(dtype), "gradient buffer"));

  // Segments depend on n only, so the order of the sum is fixed whatever the threads.
  std::size_t seg = (n + kMaxScanSegments - 1) / kMaxScanSegments;
  seg = std::max(kMinScanSegment,
                 (seg + optim_detail::kScanLanes - 1) / optim_detail::kScanLanes * optim_detail::kScanLanes);
  const std::size_t segments = (n + seg - 1) / seg;
  std::array<double, kMaxScanSegments> sums{};
  const auto scan = optim_detail::kernels_for(config_.isa).scan;
  const int team = static_cast<int>(std::min<std::size_t>(std::max(config_.threads, 1), segments));
  const CpuAccount lead = CpuAccount::of_current_thread();  // as in parallel_ranges
#pragma omp parallel num_threads(team) if (team > 1)
  {
    lead.join(/*since_start=*/true);
#pragma omp for schedule(static)
    for (std::size_t s = 0; s < segments; ++s) {
      sums[s] = scan(grad, dtype, s * seg, std::min(n, (s + 1) * seg), inv_loss_scale, write_unscaled);
    }
  }
  for (std::size_t s = 0; s < segments; ++s) stats.sum_of_squares += sums[s];
  return stats;
}

// ---- optimizer_step ---------------------------------------------------------------------------

Result<StepReport> optimizer_step(const CpuOptimizer& optimizer, LossScaler& scaler,
                                  std::span<const GroupBuffers> buffers, double max_grad_norm) {
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    if (buffers[i].group == nullptr) {
      return invalid_argument("optimizer step: buffer " + std::to_string(i) + " has no parameter group");
    }
    STRATA_RETURN_IF_ERROR(
        buffers[i].group->hyper.validate().with_context("group '" + buffers[i].group->name + "'"));
  }
  StepReport report;
  report.loss_scale = scaler.scale();
  const float inv_scale = scaler.inv_scale();

  GradStats total;
  for (const GroupBuffers& gb : buffers) {
    const OptimizerBuffers& b = gb.buffers;
    STRATA_ASSIGN_OR_RETURN(GradStats s, optimizer.scan_gradients(const_cast<void*>(b.grad), b.grad_dtype,
                                                                  b.n, inv_scale, /*write_unscaled=*/false));
    total.merge(s);
  }
  report.grad_norm = total.norm();
  const bool overflow = !total.finite();
  STRATA_ASSIGN_OR_RETURN(const bool apply, scaler.update(overflow));
  report.next_loss_scale = scaler.scale();
  if (!apply) {
    STRATA_LOG(kInfo, kOptim) << "overflow in gradients: step skipped, loss scale " << report.loss_scale
                              << " -> " << report.next_loss_scale;
    return report;
  }
  report.clip_coefficient = clip_coefficient(report.grad_norm, max_grad_norm);
  const float grad_scale = static_cast<float>(static_cast<double>(inv_scale) * report.clip_coefficient);

  // Check every buffer before writing any, so an error leaves no half-applied step.
  for (const GroupBuffers& gb : buffers) {
    if (gb.buffers.n > 0) STRATA_RETURN_IF_ERROR(check_buffers(gb.group->hyper, gb.buffers));
  }
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    ParamGroup* g = buffers[i].group;
    bool first = true;  // several buffers may share a group: advance its step once
    for (std::size_t j = 0; j < i; ++j) first = first && buffers[j].group != g;
    if (first) ++g->step;
  }
  for (const GroupBuffers& gb : buffers) {
    STRATA_RETURN_IF_ERROR(optimizer.update(gb.group->hyper, gb.group->step, grad_scale, gb.buffers));
  }
  report.applied = true;
  return report;
}

}  // namespace strata
