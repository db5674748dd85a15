// strata bench pipeline: the bubble of each pipeline schedule against theory. Run it under
// mpirun, one process per stage: `mpirun -np 4 strata bench pipeline`.
//
// For each schedule (gpipe, 1f1b) and number of micro-batches m, the pipeline engine trains a
// model whose stages are as even as pipeline_stages makes them; after a warm-up step each stage
// measures, over --steps steps, the fraction of its schedule's wall time it spent waiting for a
// neighbour (OffloadStats::pipeline_wait_seconds / pipeline_seconds). The reported bubble is the
// mean of that fraction over the stages, next to the ideal pipeline's (p - 1) / (m + p - 1)
// (equal stages, no communication cost). Both schedules have the same ideal bubble; 1F1B needs
// min(p - s, m) activation slots on stage s instead of m, which the output lists too.
// Interleaved 1F1B (schedule "interleaved", --virtual-stages v > 1: each stage runs v chunks of
// the v·p FLOP-balanced chunks) is measured the same way for every m that is a multiple of p,
// against interleaved_bubble_theory's (p - 1) / (v·m + p - 1).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bench_util.hpp"
#include "cli.hpp"
#include "strata/device.hpp"
#include "strata/engine.hpp"
#include "strata/model.hpp"
#include "strata/offload.hpp"
#include "strata/options.hpp"
#include "strata/parallel.hpp"
#include "strata/pipeline_schedule.hpp"

namespace strata::cli {
namespace {

constexpr FlagSpec kFlags[] = {
    {"micro", "LIST", "micro-batch counts per step, comma separated (default 1,2,4,8)"},
    {"layers", "L", "transformer blocks (default 8)"},
    {"width", "C", "model width (default 128)"},
    {"seq-len", "T", "tokens per sequence (default 64)"},
    {"steps", "S", "measured steps per point, after one warm-up step (default 3)"},
    {"threads", "N", "compute threads per stage (default 1)"},
    {"virtual-stages", "LIST",
     "interleaved 1F1B rows: chunks per stage, comma separated (default 2; 1: none)"},
    {"help", "", "show this help"},
};

std::string usage() {
  return "usage: mpirun -np P strata bench pipeline [flags]\n\n"
         "The measured bubble (the stages' mean fraction of a step spent waiting for a neighbour) of the\n"
         "gpipe and 1f1b schedules on P stages, against the ideal (P-1)/(m+P-1), and of interleaved 1F1B\n"
         "with v chunks per stage (m a multiple of P) against (P-1)/(v*m+P-1).\n\nflags:\n" +
         format_flags(kFlags);
}

int fail(const Status& s) {
  std::fprintf(stderr, "strata bench pipeline: %s\n", s.to_string().c_str());
  return kExitFailure;
}

int run(const Args& args) {
  auto layers = args.get_int("layers", 8, 1, 256);
  auto width = args.get_int("width", 128, 16, 8192);
  auto seq = args.get_int("seq-len", 64, 8, 8192);
  auto steps = args.get_int("steps", 3, 1, 1000);
  auto threads = args.get_int("threads", 1, 1, 256);
  for (const Status* s :
       {&layers.status(), &width.status(), &seq.status(), &steps.status(), &threads.status()}) {
    if (!s->ok()) return usage_error("bench pipeline", s->message(), usage());
  }
  std::vector<int> micros, virtuals;
  for (auto [flag, fallback, list] :
       {std::tuple{"micro", "1,2,4,8", &micros}, std::tuple{"virtual-stages", "2", &virtuals}}) {
    std::stringstream ss(args.get(flag).value_or(fallback));
    std::string item;
    while (std::getline(ss, item, ',')) {
      char* end = nullptr;
      const long v = std::strtol(item.c_str(), &end, 10);
      if (item.empty() || *end != '\0' || v < 1 || v > 256) {
        return usage_error("bench pipeline",
                           std::string("--") + flag + ": '" + item + "' is not a count in [1, 256]", usage());
      }
      list->push_back(static_cast<int>(v));
    }
  }
  Options options;
  if (Status s = options.load_env(); !s.ok()) return fail(s);
  auto cc = CommConfig::from_options(options);
  if (!cc.ok()) return fail(cc.status());
  auto ctx = CommContext::create(*cc);
  if (!ctx.ok()) return fail(ctx.status());
  const int p = (*ctx)->world_size();
  const int me = (*ctx)->world_rank();
  if (p < 2) {
    std::fprintf(stderr,
                 "strata bench pipeline: needs at least 2 stages (mpirun -np 2 strata bench pipeline)\n");
    return kExitUsage;
  }
  auto world = (*ctx)->world(CommBackend::kMpi);
  if (!world.ok()) return fail(world.status());
  Comm& pp = **world;

  TrainerConfig tc;
  tc.model.kind = ModelKind::kLlama;  // untied: the stages exchange only boundary tensors
  tc.model.n_layer = *layers;
  tc.model.n_embd = *width;
  tc.model.n_head = std::max<std::int64_t>(1, *width / 64);
  tc.model.n_positions = *seq;
  tc.model.vocab_size = 256;
  tc.micro_batch = 1;
  tc.seq_len = *seq;
  tc.schedule.kind = LrScheduleKind::kConstant;
  tc.schedule.lr = 1e-3;
  auto bounds = pipeline_stages(tc.model, p, tc.seq_len);
  if (!bounds.ok()) return usage_error("bench pipeline", bounds.status().message(), usage());

  nlohmann::json out;
  out["benchmark"] = "pipeline";
  out["stages"] = p;
  out["model"] = nlohmann::json::parse(model_config_to_json(tc.model));
  out["stage_modules"] = *bounds;
  out["steps"] = *steps;
  out["results"] = nlohmann::json::array();
  // (schedule, chunks per stage): gpipe, 1f1b, then interleaved 1F1B for each --virtual-stages v > 1.
  std::vector<std::pair<PipelineSchedule, int>> runs = {{PipelineSchedule::kGpipe, 1},
                                                        {PipelineSchedule::kOneFOneB, 1}};
  const int modules = static_cast<int>(*layers) + 2;  // embedding, blocks, head
  for (int v : virtuals) {
    if (v < 2) continue;
    if (v * p > modules) {
      return usage_error("bench pipeline",
                         "--virtual-stages " + std::to_string(v) + " on " + std::to_string(p) +
                             " stages needs " + std::to_string(v * p) + " modules; the model has " +
                             std::to_string(modules) + " (raise --layers)",
                         usage());
    }
    runs.emplace_back(PipelineSchedule::kOneFOneB, v);
  }
  for (const auto& [sched, v] : runs) {
    for (int m : micros) {
      if (v > 1 && m % p != 0) continue;  // interleaving needs whole groups of p micro-batches
      tc.grad_accum = m;
      DeviceConfig dc;
      dc.kind = DeviceKind::kCpu;
      dc.memory_bytes = 1ull << 30;
      dc.pinned_bytes = 64ull << 20;
      dc.compute_threads = static_cast<int>(*threads);
      auto device = Device::create(dc);
      if (!device.ok()) return fail(device.status());
      OffloadSettings os;
      os.pipeline_schedule = sched;
      os.pipeline_virtual_stages = v;
      auto engine = OffloadEngine::create(tc, os, **device, nullptr, nullptr, nullptr, &pp);
      if (!engine.ok()) return fail(engine.status());
      const std::size_t n = static_cast<std::size_t>(m * tc.seq_len);
      std::vector<std::int32_t> in(n), tg(n);
      std::mt19937 rng(5);
      for (std::size_t i = 0; i < n; ++i) {
        in[i] = static_cast<std::int32_t>(rng() % 256);
        tg[i] = static_cast<std::int32_t>(rng() % 256);
      }
      if (auto w = (*engine)->step(in, tg); !w.ok()) return fail(w.status());  // warm-up
      const OffloadStats before = (*engine)->stats();
      const auto t0 = std::chrono::steady_clock::now();
      for (std::int64_t s = 0; s < *steps; ++s) {
        if (auto r = (*engine)->step(in, tg); !r.ok()) return fail(r.status());
      }
      const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const OffloadStats after = (*engine)->stats();
      float idle[3] = {static_cast<float>(after.pipeline_wait_seconds - before.pipeline_wait_seconds),
                       static_cast<float>(after.pipeline_seconds - before.pipeline_seconds),
                       static_cast<float>(wall)};
      std::vector<float> all(static_cast<std::size_t>(3 * p));
      if (Status s = pp.all_gather(idle, all.data(), 3, DType::kF32).wait(); !s.ok()) return fail(s);
      // step_seconds: the schedule's time per step (pipeline_seconds), the slowest stage's;
      // step_wall_seconds: whole steps (schedule, norm, update, loss) timed around step().
      double mean = 0, step_seconds = 0, step_wall = 0;
      nlohmann::json per_stage = nlohmann::json::array();
      for (int r = 0; r < p; ++r) {
        const double f = all[static_cast<std::size_t>(3 * r + 1)] > 0
                             ? all[static_cast<std::size_t>(3 * r)] / all[static_cast<std::size_t>(3 * r + 1)]
                             : 0.0;
        per_stage.push_back(f);
        mean += f / p;
        step_seconds =
            std::max(step_seconds, static_cast<double>(all[static_cast<std::size_t>(3 * r + 1)]) / *steps);
        step_wall = std::max(step_wall, static_cast<double>(all[static_cast<std::size_t>(3 * r + 2)]) / *steps);
      }
      // Activation slots per stage: with v > 1 each holds one chunk of one micro-batch at a time
      // (carved per (micro-batch, chunk): the schedule's most live chunk forwards).
      nlohmann::json slots = nlohmann::json::array();
      for (int r = 0; r < p; ++r) {
        if (v == 1) {
          slots.push_back(pipeline_slots(sched, p, r, m));
        } else {
          auto k = interleaved_pipeline_slots(p, r, v, m);
          if (!k.ok()) return fail(k.status());
          slots.push_back(*k);
        }
      }
      const double theory = interleaved_bubble_theory(p, v, m);  // v = 1: (p - 1) / (m + p - 1)
      // The chunk bounds (v·p + 1 module bounds; stage s runs chunks s, s + p, ...).
      auto chunk_bounds = pipeline_stages(tc.model, p * v, tc.seq_len);
      if (!chunk_bounds.ok()) return fail(chunk_bounds.status());
      out["results"].push_back(
          {{"schedule", v == 1 ? std::string(to_string(sched)) : std::string("interleaved")},
           {"virtual_stages", v},
           {"chunk_modules", *chunk_bounds},
           {"micro_batches", m},
           {"bubble", mean},
           {"bubble_theory", theory},
           {"bubble_per_stage", per_stage},
           {"activation_slots", slots},
           {"step_seconds", step_seconds},
           {"step_wall_seconds", step_wall}});
    }
  }
  if (me == 0) std::printf("%s\n", out.dump(2).c_str());
  return kExitOk;
}

int bench_pipeline(std::span<const std::string> argv) {
  auto parsed = Args::parse(argv, kFlags);
  if (!parsed.ok()) return usage_error("bench pipeline", parsed.status().message(), usage());
  const Args& args = *parsed;
  if (args.has("help")) {
    std::fputs(usage().c_str(), stdout);
    return kExitOk;
  }
  if (!args.positionals().empty()) {
    return usage_error("bench pipeline", "unexpected argument '" + args.positionals()[0] + "'", usage());
  }
  return run(args);
}

}  // namespace

STRATA_CLI_BENCH(
    pipeline,
    "bubble fraction of the gpipe, 1f1b and interleaved pipeline schedules vs theory (under mpirun)",
    bench_pipeline);

}  // namespace strata::cli
