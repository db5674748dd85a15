// strata bench adam: the CPU AdamW update against the memory-bandwidth roofline, measured in the
// same run. The roofline is a plain streaming loop over exactly the bytes the update moves
// (read master, grad, m, v; write master, m, v and the copy-out), on the same threads with the
// same ISA; the figure of merit is ratio_to_roofline = roofline time / update time, the median
// over repetitions of the ratio within each repetition.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "cli.hpp"
#include "optim/kernels.hpp"
#include "optim/numerics.hpp"
#include "strata/alloc.hpp"
#include "strata/optim.hpp"
#include "strata/options.hpp"

namespace strata::cli {
namespace {

constexpr FlagSpec kFlags[] = {
    {"json", "", "print one JSON object (default: a table)"},
    {"params", "N",
     "parameters per buffer, e.g. 67108864 or 64M (default 64M: far beyond the L3 cache); at least "
     "enough that the smallest layout's state is 4x the last-level cache and 64 MiB"},
    {"reps", "R", "timed repetitions per variant; the median is reported (default 7)"},
    {"threads", "T", "OpenMP threads (default: host_threads if set, else every core)"},
    {"isa", "ISA", "auto, avx512, avx2 or scalar (default: the adam_isa tunable)"},
    {"clock", "wall|cpu",
     "time by the wall clock (default) or by the process's CPU time; with --threads 1, cpu "
     "is the time the thread actually ran, for machines shared with other work"},
    {"help", "", "show this help"},
};

std::string usage() {
  return "usage: strata bench adam [flags]\n\n"
         "Times one AdamW update over N parameters in three layouts (fp32 grads; bf16 grads with bf16\n"
         "copy-out; bf16 grads, bf16 moments and bf16 copy-out) against a streaming loop over the same\n"
         "bytes, and reports the ratio.\n\nflags:\n" +
         format_flags(kFlags);
}

struct Variant {
  const char* name;
  DType grad;
  DType moments;
  bool copy_out;
};

// The refusal of cache-sized runs: the state of the leanest variant (20 B per parameter) must
// be at least 4x the last-level cache and at least kMinStateBytes.
constexpr std::uint64_t kMinBytesPerParam = 20;
constexpr std::uint64_t kMinStateBytes = 64ull << 20;

constexpr Variant kVariants[] = {
    {"fp32_grads", DType::kF32, DType::kF32, false},
    {"bf16_grads_bf16_out", DType::kBF16, DType::kF32, true},
    {"bf16_grads_bf16_moments_bf16_out", DType::kBF16, DType::kBF16, true},
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Figures {
  std::uint64_t bytes_per_param = 0;
  double update_s = 0;    // median
  double roofline_s = 0;  // median
  double ratio = 0;       // median over reps of (roofline time / update time) of the same rep
  double ratio_min = 0;   // the spread of the per-rep ratios
  double ratio_max = 0;
  // The least CPU time the process got per thread and second of a timed run: well below 1 means
  // other tenants took the cores and the figures are not to be trusted.
  double cpu_share = 0;
  // The fastest rep of each: on a shared machine, the closest to what the hardware can do.
  double best_update_s = 0;
  double best_roofline_s = 0;
};

// Deterministic, cheap values in realistic ranges (no denormals, v > 0).
float pseudo(std::uint64_t i, std::uint32_t salt) {
  return static_cast<float>(optim_detail::mix32(static_cast<std::uint32_t>(i) ^ salt)) *
             (2.0f / 4294967296.0f) -
         1.0f;
}

Result<Figures> run_variant(const Variant& var, const CpuOptimizer& opt, std::size_t n, int reps,
                            bool cpu_clock) {
  const std::size_t gsize = dtype_size(var.grad);
  const std::size_t msize = dtype_size(var.moments);
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer master, AlignedBuffer::allocate(n * 4));
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer grad, AlignedBuffer::allocate(n * gsize));
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer m, AlignedBuffer::allocate(n * msize));
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer v, AlignedBuffer::allocate(n * msize));
  AlignedBuffer out;
  if (var.copy_out) {
    STRATA_ASSIGN_OR_RETURN(out, AlignedBuffer::allocate(n * 2));
  }
  auto* p = static_cast<float*>(master.data());
#pragma omp parallel for schedule(static) num_threads(opt.threads())
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = pseudo(i, 1);
    const float g = 1e-2f * pseudo(i, 2);
    const float mm = 1e-3f * pseudo(i, 3);
    const float vv = 1e-4f * (1.5f + pseudo(i, 4));
    if (var.grad == DType::kF32) {
      static_cast<float*>(grad.data())[i] = g;
    } else {
      static_cast<std::uint16_t*>(grad.data())[i] = optim_detail::f32_to_bf16(g);
    }
    if (var.moments == DType::kF32) {
      static_cast<float*>(m.data())[i] = mm;
      static_cast<float*>(v.data())[i] = vv;
    } else {
      static_cast<std::uint16_t*>(m.data())[i] = optim_detail::f32_to_bf16(mm);
      static_cast<std::uint16_t*>(v.data())[i] = optim_detail::f32_to_bf16(vv);
    }
  }

  OptimizerBuffers b;
  b.master = p;
  b.grad = grad.data();
  b.grad_dtype = var.grad;
  b.exp_avg = m.data();
  b.exp_avg_sq = v.data();
  b.moment_dtype = var.moments;
  b.param_out = var.copy_out ? out.data() : nullptr;
  b.out_dtype = DType::kBF16;
  b.n = n;
  OptimizerHyper hyper = OptimizerHyper::defaults(OptimizerKind::kAdamW);

  optim_detail::StreamArgs s;
  s.master = p;
  s.grad = grad.data();
  s.grad_dtype = var.grad;
  s.exp_avg = m.data();
  s.exp_avg_sq = v.data();
  s.moment_dtype = var.moments;
  s.out = var.copy_out ? static_cast<std::uint16_t*>(out.data()) : nullptr;

  Figures f;
  f.bytes_per_param = 4 + gsize + 2 * msize + 4 + 2 * msize + (var.copy_out ? 2 : 0);
  std::vector<double> t_update;
  std::vector<double> t_roof;
  std::vector<double> shares;
  std::int64_t step = 0;
  // Rep 0 is a warm-up. Alternate which of the two goes first so that drift (frequency, other
  // tenants) hits both alike.
  for (int r = 0; r <= reps; ++r) {
    double tu = 0;
    double tr = 0;
    for (int k = 0; k < 2; ++k) {
      const double cpu0 = process_cpu_seconds();
      const auto t0 = std::chrono::steady_clock::now();
      const bool update_turn = (k == 0) == (r % 2 == 0);
      if (update_turn) {
        STRATA_RETURN_IF_ERROR(opt.update(hyper, ++step, 1.0f, b));
      } else {
        optim_detail::stream_parallel(opt.isa(), opt.threads(), s, n);
      }
      const double wall = seconds_since(t0);
      const double cpu = process_cpu_seconds() - cpu0;
      if (r > 0) shares.push_back(cpu / (wall * opt.threads()));
      (update_turn ? tu : tr) = cpu_clock ? cpu / opt.threads() : wall;
    }
    if (r > 0) {
      t_update.push_back(tu);
      t_roof.push_back(tr);
    }
  }
  f.update_s = median(t_update);
  f.roofline_s = median(t_roof);
  // Each rep times the update and the roofline back to back, so their ratio is robust to load
  // that comes and goes on a shared machine; the median of those ratios is the headline figure.
  std::vector<double> ratios;
  for (std::size_t k = 0; k < t_update.size(); ++k) ratios.push_back(t_roof[k] / t_update[k]);
  f.ratio = median(ratios);
  f.ratio_min = *std::min_element(ratios.begin(), ratios.end());
  f.ratio_max = *std::max_element(ratios.begin(), ratios.end());
  f.cpu_share = *std::min_element(shares.begin(), shares.end());
  f.best_update_s = *std::min_element(t_update.begin(), t_update.end());
  f.best_roofline_s = *std::min_element(t_roof.begin(), t_roof.end());
  return f;
}

int bench_adam(std::span<const std::string> argv) {
  auto parsed = Args::parse(argv, kFlags);
  if (!parsed.ok()) return usage_error("bench adam", parsed.status().message(), usage());
  const Args& args = *parsed;
  if (args.has("help")) {
    std::fputs(usage().c_str(), stdout);
    return kExitOk;
  }
  if (!args.positionals().empty())
    return usage_error("bench adam", "unexpected argument '" + args.positionals()[0] + "'", usage());
  auto params = args.get_bytes("params", 64ull << 20, 1, 1ull << 34);
  auto reps = args.get_int("reps", 7, 1, 1000);
  auto threads_flag = args.get_int("threads", 0, 0, 1024);
  if (!params.ok()) return usage_error("bench adam", params.status().message(), usage());
  if (!reps.ok()) return usage_error("bench adam", reps.status().message(), usage());
  if (!threads_flag.ok()) return usage_error("bench adam", threads_flag.status().message(), usage());
  // A working set that fits in cache measures the cache, not the memory bandwidth the roofline
  // stands for, and a tiny one mostly measures thread start-up: refuse both.
  const std::uint64_t llc = last_level_cache_bytes();
  const std::uint64_t min_bytes = std::max<std::uint64_t>(4 * llc, kMinStateBytes);
  const std::uint64_t min_params = (min_bytes + kMinBytesPerParam - 1) / kMinBytesPerParam;
  if (*params < min_params) {
    return usage_error(
        "bench adam",
        "--params " + std::to_string(*params) + " is too small: the smallest layout moves " +
            std::to_string(kMinBytesPerParam) + " B per parameter, so the state must be at least " +
            format_bytes(min_bytes) + " (4x the " +
            (llc ? format_bytes(llc) + " last-level cache" : std::string("unknown last-level cache")) +
            ", and at least " + format_bytes(kMinStateBytes) + "); the minimum is --params " +
            std::to_string(min_params),
        usage());
  }
  const std::string clock = args.get("clock").value_or("wall");
  if (clock != "wall" && clock != "cpu")
    return usage_error("bench adam", "--clock must be wall or cpu", usage());
  const bool cpu_clock = clock == "cpu";

  Options options;
  if (Status s = options.load_env(); !s.ok()) {
    std::fprintf(stderr, "strata bench adam: %s\n", s.message().c_str());
    return kExitFailure;
  }
  if (auto isa = args.get("isa")) {
    if (Status s = options.set(Option::kAdamIsa, *isa, "--isa"); !s.ok()) {
      return usage_error("bench adam", s.message(), usage());
    }
  }
  auto config = CpuOptimizerConfig::from_options(options);
  if (!config.ok()) {
    std::fprintf(stderr, "strata bench adam: %s\n", config.status().to_string().c_str());
    return kExitFailure;
  }
  // The benchmark measures the optimizer alone, so by default it gets every core.
  if (*threads_flag > 0) {
    config->threads = static_cast<int>(*threads_flag);
  } else if (options.get_int(Option::kHostThreads) == 0) {
    config->threads = std::max(1, omp_get_num_procs());
  }
  auto opt = CpuOptimizer::create(*config);
  if (!opt.ok()) {
    std::fprintf(stderr, "strata bench adam: %s\n", opt.status().to_string().c_str());
    return kExitFailure;
  }

  const std::size_t n = *params;
  nlohmann::json out;
  out["benchmark"] = "adam";
  out["optimizer"] = "adamw";
  out["params"] = n;
  out["min_params"] = min_params;
  out["last_level_cache_bytes"] = llc;
  out["isa"] = std::string(to_string(opt->isa()));
  out["threads"] = opt->threads();
  out["reps"] = *reps;
  out["clock"] = clock;
  out["variants"] = nlohmann::json::array();
  double base_mparams = 0;
  for (const Variant& var : kVariants) {
    auto f = run_variant(var, *opt, n, static_cast<int>(*reps), cpu_clock);
    if (!f.ok()) {
      std::fprintf(stderr, "strata bench adam: %s: %s\n", var.name, f.status().to_string().c_str());
      return kExitFailure;
    }
    const double mparams = static_cast<double>(n) / f->update_s / 1e6;
    const double roof = static_cast<double>(n) / f->roofline_s / 1e6;
    nlohmann::json j;
    j["name"] = var.name;
    j["grad_dtype"] = std::string(to_string(var.grad));
    j["moment_dtype"] = std::string(to_string(var.moments));
    j["copy_out"] = var.copy_out ? "bf16" : "none";
    j["isa"] = std::string(to_string(opt->isa()));
    j["threads"] = opt->threads();
    j["bytes_per_param"] = f->bytes_per_param;
    j["mparams_per_s"] = mparams;
    j["roofline_mparams_per_s"] = roof;
    j["ratio_to_roofline"] = f->ratio;
    j["ratio_min"] = f->ratio_min;
    j["ratio_max"] = f->ratio_max;
    j["min_cpu_share"] = f->cpu_share;
    j["best_mparams_per_s"] = static_cast<double>(n) / f->best_update_s / 1e6;
    j["best_roofline_mparams_per_s"] = static_cast<double>(n) / f->best_roofline_s / 1e6;
    j["best_ratio"] = f->best_roofline_s / f->best_update_s;
    j["roofline_gb_per_s"] = roof * 1e6 * static_cast<double>(f->bytes_per_param) / 1e9;
    if (var.moments == DType::kBF16 && base_mparams > 0) {
      j["speedup_vs_fp32_moments"] = mparams / base_mparams;
    }
    if (var.grad == DType::kBF16 && var.moments == DType::kF32) base_mparams = mparams;
    out["variants"].push_back(j);
  }
  if (args.has("json")) {
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    std::printf("adamw over %zu params, isa %s, %d threads, median of %lld reps\n", n,
                out["isa"].get<std::string>().c_str(), opt->threads(), static_cast<long long>(*reps));
    std::printf("%-34s %8s %10s %10s %7s %15s %9s %10s %10s %7s\n", "variant", "B/param", "Mparam/s",
                "roofline", "ratio", "ratio range", "cpu share", "best", "best roof", "ratio");
    for (const auto& j : out["variants"]) {
      std::printf("%-34s %8llu %10.1f %10.1f %7.3f %7.3f..%-6.3f %9.2f %10.1f %10.1f %7.3f\n",
                  j["name"].get<std::string>().c_str(),
                  static_cast<unsigned long long>(j["bytes_per_param"].get<std::uint64_t>()),
                  j["mparams_per_s"].get<double>(), j["roofline_mparams_per_s"].get<double>(),
                  j["ratio_to_roofline"].get<double>(), j["ratio_min"].get<double>(),
                  j["ratio_max"].get<double>(), j["min_cpu_share"].get<double>(),
                  j["best_mparams_per_s"].get<double>(), j["best_roofline_mparams_per_s"].get<double>(),
                  j["best_ratio"].get<double>());
    }
  }
  return kExitOk;
}

}  // namespace

STRATA_CLI_BENCH(adam, "CPU AdamW update vs the memory-bandwidth roofline (three state layouts)", bench_adam);

}  // namespace strata::cli
