// strata bench step: the throughput of a training step of a built-in model on one device without
// offload, against the matmul roofline measured in the same run.
//
//   model_gflops_per_s            model FLOPs of a step (model_flops(): every matmul, causal
//                                 attention, ×3 for forward + backward) / median step time
//   matmul_roofline_gflops_per_s  the same kernels' GEMM (oneDNN on cpu) run alone at exactly the
//                                 shapes, transposes and dtypes of the step's matmuls (forward,
//                                 input gradient, weight gradient), on the same stream with the same
//                                 compute threads: Σ flops / Σ median time
//   ratio                         model_gflops_per_s / matmul_roofline_gflops_per_s (target ≥ 0.6)
//
// The step includes everything a step does (norms, attention, GELU/SwiGLU, cross-entropy, the
// optimizer, gradient norm and clipping); the roofline is what the step would reach if all of
// its FLOPs ran at GEMM speed.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <vector>

#include "bench_util.hpp"
#include "cli.hpp"
#include "kernels/kernels.hpp"
#include "model_flags.hpp"
#include "strata/data.hpp"
#include "strata/device.hpp"
#include "strata/engine.hpp"

namespace strata::cli {
namespace {

using Clock = std::chrono::steady_clock;

constexpr FlagSpec kStepFlags[] = {
    {"json", "", "print one JSON object (the default output)"},
    {"steps", "N", "timed steps (default 10)"},
    {"warmup", "N", "untimed steps first (default 2)"},
    {"batch", "N", "sequences per step (default 8)"},
    {"seq-len", "T", "tokens per sequence (default 128)"},
    {"reps", "N", "timed repetitions of each GEMM for the roofline (default 5)"},
    {"help", "", "show this help"},
};

std::vector<FlagSpec> all_flags() {
  std::vector<FlagSpec> f(std::begin(kStepFlags), std::end(kStepFlags));
  f.insert(f.end(), std::begin(kModelFlags), std::end(kModelFlags));
  return f;
}

std::string usage() {
  return "usage: strata bench step [--json] [flags]\n\n"
         "Times training steps of a built-in model (default: 4 GPT-2-small blocks, width 768, 12\n"
         "heads, 8 x 128 tokens, f32) and the matmul roofline at the same shapes.\n\nflags:\n" +
         format_flags(all_flags());
}

int fail(const Status& s) {
  std::fprintf(stderr, "strata bench step: %s\n", s.message().c_str());
  return kExitFailure;
}

struct GemmTiming {
  GemmShape shape;
  double seconds = 0;  // median of one call
};

// Times every GEMM of the step on `stream` (so it runs with the stream's compute threads).
Status time_gemms(Device& device, Stream& stream, const ModelConfig& model, std::int64_t batch,
                  std::int64_t seq_len, int reps, std::vector<GemmTiming>* out) {
  const DType wdt = model.dtype;
  const std::uint64_t w = dtype_size(wdt);
  std::uint64_t a_max = 0, b_max = 0, c_max = 0;
  for (const auto& g : model_gemms(model, batch, seq_len)) {
    a_max = std::max<std::uint64_t>(a_max, static_cast<std::uint64_t>(g.M * g.K) * w);
    b_max = std::max<std::uint64_t>(b_max, static_cast<std::uint64_t>(g.K * g.N) * w);
    c_max = std::max<std::uint64_t>(c_max, static_cast<std::uint64_t>(g.M * g.N) * 4);
  }
  STRATA_ASSIGN_OR_RETURN(ArenaBuffer a, device.allocate(a_max, "bench.a"));
  STRATA_ASSIGN_OR_RETURN(ArenaBuffer b, device.allocate(b_max, "bench.b"));
  STRATA_ASSIGN_OR_RETURN(ArenaBuffer c, device.allocate(c_max, "bench.c"));
  // Small finite values (bf16 0x3c00 = 2^-7; fp32 bytes 0x3c3c3c3c ≈ 0.0115).
  STRATA_RETURN_IF_ERROR(stream.memset_async(a.data(), 0x3c, a_max));
  STRATA_RETURN_IF_ERROR(stream.memset_async(b.data(), 0x3c, b_max));
  STRATA_RETURN_IF_ERROR(stream.memset_async(c.data(), 0, c_max));
  STRATA_ASSIGN_OR_RETURN(auto state, kernels::KernelState::create(kernels::Backend::kCpu));
  kernels::KernelContext ctx;
  ctx.backend = kernels::Backend::kCpu;
  ctx.cpu_threads = device.info().compute_threads;
  ctx.state = state.get();
  out->clear();
  for (const auto& g : model_gemms(model, batch, seq_len)) out->push_back(GemmTiming{g, 0.0});
  void *pa = a.data(), *pb = b.data(), *pc = c.data();
  STRATA_RETURN_IF_ERROR(stream.host_fn("bench gemms", [=]() -> Status {
    for (GemmTiming& t : *out) {
      const GemmShape& g = t.shape;
      // The weight gradient accumulates into fp32; the forward and input gradient write the working dtype.
      const kernels::TensorArg cc{pc, g.accumulate ? DType::kF32 : wdt};
      auto call = [&]() {
        return kernels::gemm(ctx, cc, {pa, wdt}, {pb, wdt}, kernels::kNone, g.M, g.N, g.K,
                             g.trans_a ? kernels::Transpose::kYes : kernels::Transpose::kNo,
                             g.trans_b ? kernels::Transpose::kYes : kernels::Transpose::kNo,
                             g.accumulate ? kernels::Accumulate::kAdd : kernels::Accumulate::kOverwrite);
      };
      STRATA_RETURN_IF_ERROR(call());  // builds and caches the plan
      std::vector<double> times;
      for (int r = 0; r < reps; ++r) {
        const auto t0 = Clock::now();
        STRATA_RETURN_IF_ERROR(call());
        times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      t.seconds = median(times);
    }
    return ok_status();
  }));
  STRATA_RETURN_IF_ERROR(stream.synchronize());
  (void)c;
  return ok_status();
}

int bench_step(std::span<const std::string> argv) {
  std::vector<std::string> self = {"step"};
  self.insert(self.end(), argv.begin(), argv.end());
  use_passive_openmp_wait("bench", self);
  const auto flags = all_flags();
  auto parsed = Args::parse(argv, flags);
  if (!parsed.ok()) return usage_error("bench step", parsed.status().message(), usage());
  const Args& args = *parsed;
  if (args.has("help")) {
    std::fputs(usage().c_str(), stdout);
    return kExitOk;
  }
  if (!args.positionals().empty()) {
    return usage_error("bench step", "unexpected argument '" + args.positionals()[0] + "'", usage());
  }
  std::int64_t steps = 10, warmup = 2, reps = 5;
  TrainerConfig tc;
  // GPT-2 small's blocks (width 768, 12 heads), 4 of them: the shapes of a real model, small
  // enough to time in seconds on two cores. --width 256 --heads 4 is the default training model.
  tc.model.n_layer = 4;
  tc.model.n_head = 12;
  tc.model.n_embd = 768;
  tc.model.vocab_size = 256;
  tc.micro_batch = 8;
  tc.seq_len = 128;
  tc.schedule.kind = LrScheduleKind::kConstant;
  tc.schedule.lr = 1e-3;
  Status s = int_flag(args, "steps", 1, 100000, &steps);
  if (s.ok()) s = int_flag(args, "warmup", 0, 100000, &warmup);
  if (s.ok()) s = int_flag(args, "reps", 1, 1000, &reps);
  if (s.ok()) s = int_flag(args, "batch", 1, 1 << 20, &tc.micro_batch);
  if (s.ok()) s = int_flag(args, "seq-len", 1, 1 << 20, &tc.seq_len);
  if (s.ok()) s = apply_model_flags(args, tc.seq_len, &tc.model);
  if (!s.ok()) return usage_error("bench step", s.message(), usage());
  auto needed = Trainer::device_bytes(tc);
  if (!needed.ok()) return usage_error("bench step", needed.status().message(), usage());
  Options options;
  DeviceConfig dc;
  // Room for the roofline's GEMM operands beside the trainer's plan.
  s = device_options(args, *needed + (256u << 20), &options, &dc);
  if (!s.ok())
    return s.code() == StatusCode::kInvalidArgument ? usage_error("bench step", s.message(), usage())
                                                    : fail(s);
  if (dc.kind != DeviceKind::kCpu) {
    return usage_error("bench step",
                       "bench step measures the cpu backend (--device cpu); device '" +
                           std::string(to_string(dc.kind)) + "' is not available to it",
                       usage());
  }
  tc.optimizer_isa = options.get_string(Option::kAdamIsa);
  auto device = Device::create(dc);
  if (!device.ok()) return fail(device.status());
  auto trainer = Trainer::create(tc, **device);
  if (!trainer.ok()) return fail(trainer.status());

  // Training steps on the built-in corpus.
  const Corpus corpus = builtin_corpus(1234, 1u << 20);
  auto batcher = Batcher::create(make_byte_tokenizer()->encode(corpus.train), tc.micro_batch, tc.seq_len, 1);
  if (!batcher.ok()) return fail(batcher.status());
  std::vector<std::int32_t> inputs, targets;
  std::vector<double> step_times;
  double last_loss = 0;
  for (std::int64_t i = 0; i < warmup + steps; ++i) {
    batcher->batch(static_cast<std::uint64_t>(i), inputs, targets);
    auto m = (*trainer)->step(inputs, targets);
    if (!m.ok()) return fail(m.status());
    if (i >= warmup) step_times.push_back(m->seconds);
    last_loss = m->loss;
  }
  const double step_s = median(step_times);
  const std::int64_t tokens = tc.micro_batch * tc.seq_len;
  const double flops = model_flops(tc.model, tc.micro_batch, tc.seq_len);

  // The roofline: the step's GEMMs alone, on a stream of the same device.
  auto stream = (*device)->create_stream("bench.gemm");
  if (!stream.ok()) return fail(stream.status());
  std::vector<GemmTiming> gemms;
  s = time_gemms(**device, **stream, tc.model, tc.micro_batch, tc.seq_len, static_cast<int>(reps), &gemms);
  if (!s.ok()) return fail(s);
  double gemm_flops = 0, gemm_seconds = 0;
  nlohmann::ordered_json per_gemm = nlohmann::ordered_json::array();
  for (const auto& g : gemms) {
    const double f = 2.0 * static_cast<double>(g.shape.M) * static_cast<double>(g.shape.N) *
                     static_cast<double>(g.shape.K) * g.shape.count;
    gemm_flops += f;
    gemm_seconds += g.seconds * g.shape.count;
    per_gemm.push_back({{"what", g.shape.what},
                        {"m", g.shape.M},
                        {"n", g.shape.N},
                        {"k", g.shape.K},
                        {"count", g.shape.count},
                        {"gflops_per_s", 2.0 * g.shape.M * g.shape.N * g.shape.K / g.seconds / 1e9}});
  }
  const double model_gflops = flops / step_s / 1e9;
  const double roofline = gemm_flops / gemm_seconds / 1e9;
  nlohmann::ordered_json out;
  out["benchmark"] = "step";
  out["device"] = (*device)->info().name;
  out["compute_threads"] = (*device)->info().compute_threads;
  out["omp_wait_policy"] = std::getenv("OMP_WAIT_POLICY") ? std::getenv("OMP_WAIT_POLICY") : "default";
  out["model"] = std::string(to_string(tc.model.kind));
  out["dtype"] = std::string(to_string(tc.model.dtype));
  out["layers"] = tc.model.n_layer;
  out["width"] = tc.model.n_embd;
  out["heads"] = tc.model.n_head;
  out["activation_checkpointing"] = tc.model.activation_checkpointing;
  out["parameters"] = (*trainer)->model().layout().num_parameters();
  out["batch"] = tc.micro_batch;
  out["seq_len"] = tc.seq_len;
  out["steps"] = steps;
  out["step_ms"] = step_s * 1e3;
  out["tokens_per_s"] = static_cast<double>(tokens) / step_s;
  out["model_gflops_per_step"] = flops / 1e9;
  out["model_gflops_per_s"] = model_gflops;
  out["matmul_share_of_model_flops"] = gemm_flops / flops;
  out["matmul_roofline_gflops_per_s"] = roofline;
  out["ratio"] = model_gflops / roofline;
  out["target_ratio"] = 0.6;
  out["last_loss"] = last_loss;
  out["gemms"] = per_gemm;
  std::printf("%s\n", out.dump(2).c_str());
  return kExitOk;
}

}  // namespace

STRATA_CLI_BENCH(step, "time a training step against the matmul roofline at the model's shapes", bench_step);

}  // namespace strata::cli
