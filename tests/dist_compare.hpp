// What the multi-process engine tests (label `dist`) share: hashing a state to compare ranks, a
// directory every rank sees, reading the state a pipeline stage holds, running a data-parallel
// rank's share of a global batch, and comparing a run's losses, norms and state with a reference
// within tolerances.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "comm_environment.hpp"
#include "offload/internal.hpp"
#include "offload_fixture.hpp"

namespace strata::testing {

// FNV-1a over the bytes of `tensors`, continuing from `h`.
inline std::uint64_t fnv(const std::vector<std::vector<float>>& tensors, std::uint64_t h = 1469598103934665603ull) {
  for (const auto& t : tensors) {
    const auto* p = reinterpret_cast<const unsigned char*>(t.data());
    for (std::size_t i = 0; i < t.size() * 4; ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
  return h;
}

// Every byte of a file ("" when it cannot be read).
inline std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Five windows of seq_len + 1 tokens: with micro_batch 2, batches of 2, 2 and 1 window.
inline std::vector<std::int32_t> eval_tokens(const TrainerConfig& c) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(5 * (c.seq_len + 1)));
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = static_cast<std::int32_t>((i * 7 + 3) % c.model.vocab_size);
  return t;
}

// A fresh directory every rank sees: rank 0 names and creates it, every rank gets the name (the
// ranks share this machine's disk). The caller removes it.
inline std::string shared_temp_dir(const std::string& tag) {
  std::array<std::uint32_t, 64> word{};
  std::string path;
  if (world().rank() == 0) {
    path =
        (std::filesystem::temp_directory_path() / ("strata-dist-" + tag + "-" + std::to_string(::getpid())))
            .string();
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
    std::memcpy(word.data(), path.data(), std::min<std::size_t>(path.size(), 4 * word.size() - 1));
  }
  EXPECT_TRUE(world().broadcast(word.data(), word.size(), DType::kF32, 0).wait().ok());
  return std::string(reinterpret_cast<const char*>(word.data()));
}

// The full state (gathered over the stage's tensor-parallel group) of the parameters this stage
// holds, in layout order; `held` lists their indices. The others are refused, naming the stage.
inline bool capture_stage(OffloadEngine& engine, Snapshot& out, std::vector<int>& held) {
  const ModelLayout& L = engine.model().layout();
  for (std::size_t i = 0; i < L.params.size(); ++i) {
    if (!L.params[i].owns_storage()) continue;
    const int idx = static_cast<int>(i);
    auto p = engine.get_param(idx);
    if (!p.ok()) {
      EXPECT_NE(p.status().message().find("held by pipeline stage"), std::string::npos)
          << p.status().to_string();
      continue;
    }
    auto ma = engine.get_master(idx);
    auto mm = engine.get_exp_avg(idx);
    auto vv = engine.get_exp_avg_sq(idx);
    EXPECT_TRUE(ma.ok() && mm.ok() && vv.ok()) << L.params[i].name;
    if (!(ma.ok() && mm.ok() && vv.ok())) return false;
    held.push_back(idx);
    out.param.push_back(*p);
    out.master.push_back(*ma);
    out.m.push_back(*mm);
    out.v.push_back(*vv);
  }
  return true;
}

// The state of `held` from an engine that holds every parameter (collective over its groups).
inline bool capture_held(OffloadEngine& engine, const std::vector<int>& held, Snapshot& out) {
  for (int idx : held) {
    if (!append_state(engine, idx, "parameter " + std::to_string(idx), out)) return false;
  }
  return true;
}

// Data-parallel rank dp's (of DP) share of step s's global batch (`global` has grad_accum =
// A x DP): global micro-batches dp, dp + DP, ...
inline void share_of(const TrainerConfig& global, int s, int dp, int DP, std::vector<std::int32_t>& in,
                     std::vector<std::int32_t>& tg) {
  std::vector<std::int32_t> gin, gtg;
  testing::batch(global, s, gin, gtg);
  const std::size_t per = static_cast<std::size_t>(global.micro_batch * global.seq_len);
  in.clear();
  tg.clear();
  for (std::size_t i = static_cast<std::size_t>(dp); i < static_cast<std::size_t>(global.grad_accum);
       i += static_cast<std::size_t>(DP)) {
    in.insert(in.end(), gin.begin() + static_cast<std::ptrdiff_t>(i * per),
              gin.begin() + static_cast<std::ptrdiff_t>((i + 1) * per));
    tg.insert(tg.end(), gtg.begin() + static_cast<std::ptrdiff_t>(i * per),
              gtg.begin() + static_cast<std::ptrdiff_t>((i + 1) * per));
  }
}

// Every world rank a data-parallel rank: this rank's share, and the config each rank runs.
inline void share(const TrainerConfig& global, int s, std::vector<std::int32_t>& in, std::vector<std::int32_t>& tg) {
  share_of(global, s, world().rank(), world().size(), in, tg);
}
// The smallest unit of `c`'s model (of one tensor-parallel shard with tp > 1; every shard has the
// same shapes): a persistence threshold at its size keeps it whole while every larger unit is
// sliced at stage 3.
inline std::int64_t smallest_unit(const TrainerConfig& c, int tp = 1) {
  auto layout = describe_model(c.model, TensorParallel{tp, 0});
  EXPECT_TRUE(layout.ok());
  std::int64_t least = -1;
  for (const ModuleDesc& m : layout->modules) {
    const auto n = static_cast<std::int64_t>((m.grad_end - m.grad_begin) / 4);
    if (n > 0 && (least < 0 || n < least)) least = n;
  }
  return least;
}

// The bytes of the plan's lines in `tier` whose description starts with `prefix`.
inline std::uint64_t plan_bytes(const OffloadPlan& p, const std::string& prefix, Tier tier = Tier::kDevice) {
  std::uint64_t b = 0;
  for (const PlanLine& l : p.lines)
    if (l.what.rfind(prefix, 0) == 0 && l.tier == tier) b += l.bytes;
  return b;
}

// The optimizer in device memory at `stage`, parameters on the device, the update after backward.
inline OffloadSettings device_optimizer_settings(int stage) {
  OffloadSettings s;
  s.optimizer = Tier::kDevice;
  s.params = Tier::kDevice;
  s.zero_stage = stage;
  s.update_during_backward = false;
  return s;
}

inline TrainerConfig local_of(const TrainerConfig& global) {
  TrainerConfig c = global;
  c.grad_accum = global.grad_accum / world().size();
  return c;
}

// Every world rank holds the same `text` (its first 255 bytes): an error every rank returns alike.
inline void expect_same_text_on_every_rank(const std::string& text, const std::string& what) {
  std::array<std::uint32_t, 64> mine{};
  std::memcpy(mine.data(), text.data(), std::min<std::size_t>(text.size(), sizeof mine - 1));
  const int P = world().size();
  std::vector<std::uint32_t> all(mine.size() * static_cast<std::size_t>(P));
  ASSERT_TRUE(world().all_gather(mine.data(), all.data(), mine.size(), DType::kF32).wait().ok()) << what;
  for (int r = 0; r < P; ++r)
    EXPECT_EQ(std::memcmp(all.data() + r * mine.size(), mine.data(), sizeof mine), 0)
        << what << ": rank " << r << " vs " << world().rank();
}

// Collective: `engine`'s weights saved twice into `dir` (every rank sees it), in both formats:
// every rank writing the part it holds (the default), and the earlier path as the reference (the
// first rank gathers everything and writes alone: EngineFaults::gather_weights_on_save). The files are equal
// byte for byte, and every rank issued writes of its own in the parallel save.
inline void expect_parallel_weights_are_gathered(OffloadEngine& engine, const std::string& dir,
                                                 const std::string& what) {
  for (const WeightFormat format : {WeightFormat::kHuggingFace, WeightFormat::kNative}) {
    const std::string tag = format == WeightFormat::kNative ? "native" : "hf";
    const std::string parallel = dir + "/parallel-" + tag + ".safetensors";
    const std::string gathered = dir + "/gathered-" + tag + ".safetensors";
    const std::uint64_t before = engine.stats().weights_file_writes;
    Status s = engine.save_weights(parallel, format);
    ASSERT_TRUE(s.ok()) << what << " (" << tag << "): " << s.to_string();
    const std::uint64_t writes = engine.stats().weights_file_writes - before;
    EXPECT_GT(writes, 0u) << what << " (" << tag << "): rank " << world().rank() << " wrote nothing";
    offload_detail::EngineFaults::gather_weights_on_save(engine, true);
    s = engine.save_weights(gathered, format);
    offload_detail::EngineFaults::gather_weights_on_save(engine, false);
    ASSERT_TRUE(s.ok()) << what << " (" << tag << ", gathered): " << s.to_string();
    EXPECT_EQ(engine.stats().weights_file_writes - before, writes) << what << ": the gather path wrote in parts";
    ASSERT_TRUE(world().barrier().wait().ok());
    if (world().rank() == 0) {
      const std::string want = file_bytes(gathered);
      ASSERT_GT(want.size(), 1000u) << what << " (" << tag << ")";
      EXPECT_TRUE(file_bytes(parallel) == want) << what << " (" << tag << "): the ranks' parts differ from the gathered file";
      std::filesystem::remove(parallel);
      std::filesystem::remove(gathered);
    }
    ASSERT_TRUE(world().barrier().wait().ok());
  }
}

// Collective: with the last rank not seeing the file the first rank creates (as on another node
// without a shared file system: EngineFaults::hide_weights_file), save_weights still succeeds by
// the gather path: no rank writes in parts, no temporary file is left, and the file is the
// gather path's byte for byte.
inline void expect_unseen_file_takes_the_gather_path(OffloadEngine& engine, const std::string& dir,
                                                     const std::string& what) {
  const std::string hidden = dir + "/unseen.safetensors", gathered = dir + "/gathered.safetensors";
  const std::uint64_t before = engine.stats().weights_file_writes;
  const bool hides = world().rank() == world().size() - 1;
  if (hides) offload_detail::EngineFaults::hide_weights_file(engine, true);
  Status s = engine.save_weights(hidden);
  if (hides) offload_detail::EngineFaults::hide_weights_file(engine, false);
  ASSERT_TRUE(s.ok()) << what << ", a rank not seeing the file: " << s.to_string();
  EXPECT_EQ(engine.stats().weights_file_writes, before) << what << ": rank " << world().rank() << " wrote in parts";
  offload_detail::EngineFaults::gather_weights_on_save(engine, true);
  s = engine.save_weights(gathered);
  offload_detail::EngineFaults::gather_weights_on_save(engine, false);
  ASSERT_TRUE(s.ok()) << what << " (gathered): " << s.to_string();
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == 0) {
    EXPECT_TRUE(file_bytes(hidden) == file_bytes(gathered)) << what << ": the fallback's file differs from the gather path's";
    for (const auto& e : std::filesystem::directory_iterator(dir))
      EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << what << ": " << e.path();
    std::filesystem::remove(hidden);
    std::filesystem::remove(gathered);
  }
  ASSERT_TRUE(world().barrier().wait().ok());
}

// Collective: `engine` saves `path` (every rank its part) and `one` (a one-process engine at the
// same parameters, on every rank) saves `single` (this rank's own name): the two files are equal
// byte for byte. Each rank removes its `single`; `path` stays.
inline void expect_saved_as_one_process(OffloadEngine& engine, OffloadEngine& one, const std::string& path,
                                        const std::string& single, WeightFormat format, const std::string& what) {
  Status s = engine.save_weights(path, format);
  ASSERT_TRUE(s.ok()) << what << ": " << s.to_string();
  s = one.save_weights(single, format);
  ASSERT_TRUE(s.ok()) << what << " (one process): " << s.to_string();
  ASSERT_TRUE(world().barrier().wait().ok());
  const std::string want = file_bytes(single);
  ASSERT_GT(want.size(), 1000u) << what;
  EXPECT_TRUE(file_bytes(path) == want) << what << ": not one process's file";
  ASSERT_TRUE(world().barrier().wait().ok());
  std::filesystem::remove(single);
}

// Collective: the weights file `engine` saves (every rank its part) is the file `one` (a
// one-process engine at the same parameters, on every rank) saves, byte for byte, in both formats.
inline void expect_weights_of_one_process(OffloadEngine& engine, OffloadEngine& one, const std::string& dir,
                                          const std::string& what) {
  for (const WeightFormat format : {WeightFormat::kHuggingFace, WeightFormat::kNative}) {
    const std::string tag = format == WeightFormat::kNative ? "native" : "hf";
    const std::string path = dir + "/ranks-" + tag + ".safetensors";
    expect_saved_as_one_process(engine, one, path,
                                dir + "/one-" + tag + "-" + std::to_string(world().rank()) + ".safetensors", format,
                                what + " (" + tag + ")");
    if (world().rank() == 0) std::filesystem::remove(path);
  }
}

// Steps [from, steps) of the global batch: this data-parallel rank's share (global micro-batches
// d, d + DP, ...).
inline bool run_share(OffloadEngine& engine, const TrainerConfig& global, int dp, int DP, int steps,
                      Snapshot& out, int from = 0) {
  std::vector<std::int32_t> in, tg;
  for (int step = from; step < steps; ++step) {
    share_of(global, step, dp, DP, in, tg);
    auto m = engine.step(in, tg);
    EXPECT_TRUE(m.ok()) << m.status().to_string();
    if (!m.ok()) return false;
    out.losses.push_back(m->loss);
    out.norms.push_back(m->grad_norm);
  }
  return true;
}

// Bounds of a comparison with a reference run. The defaults are the fp32 tensor-parallel bounds
// (test_dist_tensor_parallel.cpp states the measured differences they hold with headroom).
struct Tolerance {
  double loss = 1e-5;  // relative
  double norm = 1e-4;  // relative
  double rms = 1e-5;   // parameters and master weights: absolute; moments: of their largest value
  double max = 2e-3;
  // The Adam moments' rms bound (of their scale) where it differs from `rms` (0: `rms`): bf16
  // runs with gradient accumulation, bounded by the bf16 drift of one process (bf16_moment_drift).
  double moment_rms = 0.0;
};

// bf16 tensor parallelism (and sequence parallelism) against one process or another layout: each rank's
// partial sum is rounded to 8 bits before the all-reduce rounds the sum again, and working weights
// round the master, so rounding differences become bf16 steps of the weights and of the
// activations, and grow over the steps. Measured on 2 ranks (test_dist_tensor_parallel, 3 steps):
// loss 1.3e-3 relative, norm 1.6e-2, parameters rms 2.0e-3 and max 0.054, moments rms 3.2e-3 and
// max 0.18 of their scale. The bounds hold 1.7x (moments) to 3x (parameters, loss, norm)
// headroom; the fp32 cases are the precise check.
inline Tolerance bf16_tensor_parallel_tolerance() {
  Tolerance t;
  t.loss = 5e-3;
  t.norm = 5e-2;
  t.rms = 6e-3;
  t.max = 0.3;
  return t;
}

struct Diff {
  double max = 0.0, rms = 0.0;
};

inline Diff diff_of(const std::vector<std::vector<float>>& ref, const std::vector<std::vector<float>>& got) {
  Diff d;
  double sum = 0.0;
  std::size_t n = 0;
  for (std::size_t i = 0; i < ref.size() && i < got.size(); ++i) {
    EXPECT_EQ(ref[i].size(), got[i].size()) << "tensor " << i;
    for (std::size_t k = 0; k < ref[i].size() && k < got[i].size(); ++k) {
      const double e = std::fabs(static_cast<double>(ref[i][k]) - got[i][k]);
      d.max = std::max(d.max, e);
      sum += e * e;
      ++n;
    }
  }
  d.rms = n == 0 ? 0.0 : std::sqrt(sum / static_cast<double>(n));
  return d;
}

// How far bf16 rounding alone moves the Adam first moment: one process trained in bf16 against
// the same process in fp32 (`config` in bf16, `settings` one process's), the rms of the
// differences over the exp_avg elements of the parameters `held` (indices of the parameter
// table; empty: all) as a fraction of the fp32 run's largest |exp_avg| among them. Two bf16 runs
// that compute the same fp32 math with a different reduction order (tensor or sequence
// parallelism, another dp split) each lie about this far from their own fp32 runs, so they
// differ by a small multiple of it (docs/parallel.md "bf16 moments").
inline double bf16_moment_drift(const TrainerConfig& config, const OffloadSettings& settings, int steps,
                                const std::vector<int>& held) {
  TrainerConfig f32 = config;
  f32.model.dtype = DType::kF32;
  const Snapshot exact = train(f32, settings, steps);
  const Snapshot half = train(config, settings, steps);
  auto layout = describe_model(config.model);
  EXPECT_TRUE(layout.ok()) << layout.status().to_string();
  if (!layout.ok()) return 0.0;
  // capture_state's order: the owning parameters in table order.
  std::vector<std::vector<float>> a, b, zero;
  std::size_t k = 0;
  for (std::size_t i = 0; i < layout->params.size(); ++i) {
    if (!layout->params[i].owns_storage()) continue;
    if (held.empty() || std::find(held.begin(), held.end(), static_cast<int>(i)) != held.end()) {
      a.push_back(exact.m[k]);
      b.push_back(half.m[k]);
      zero.emplace_back(exact.m[k].size(), 0.0f);
    }
    ++k;
  }
  const double scale = diff_of(a, zero).max;
  return scale > 0.0 ? diff_of(a, b).rms / scale : 0.0;
}

// Losses and norms within their relative bounds; working parameters and master weights within
// absolute rms / max bounds; moments relative to their largest value. Prints the measured figures
// on rank 0; the reference must have trained (its loss changed).
inline void expect_close(const Snapshot& ref, const Snapshot& got, const Tolerance& tol, const std::string& what) {
  ASSERT_EQ(ref.losses.size(), got.losses.size()) << what;
  ASSERT_EQ(ref.param.size(), got.param.size()) << what;
  ASSERT_FALSE(ref.param.empty()) << what;
  double worst_loss = 0.0, worst_norm = 0.0;
  for (std::size_t i = 0; i < ref.losses.size(); ++i) {
    worst_loss = std::max(worst_loss, std::fabs(got.losses[i] - ref.losses[i]) / std::fabs(ref.losses[i]));
    EXPECT_NEAR(got.losses[i], ref.losses[i], tol.loss * std::fabs(ref.losses[i]))
        << what << ": loss of step " << i + 1;
    if (!std::isfinite(ref.norms[i]) && !std::isfinite(got.norms[i])) continue;  // both overflowed (fp16)
    worst_norm = std::max(worst_norm, std::fabs(got.norms[i] - ref.norms[i]) / std::fabs(ref.norms[i]));
    EXPECT_NEAR(got.norms[i], ref.norms[i], tol.norm * std::fabs(ref.norms[i]))
        << what << ": norm of step " << i + 1;
  }
  if (world().rank() == 0)
    std::printf("%s: loss rel %.3g, norm rel %.3g\n", what.c_str(), worst_loss, worst_norm);
  const char* names[] = {"working parameters", "master weights", "exp_avg", "exp_avg_sq"};
  const std::vector<std::vector<float>>* r[] = {&ref.param, &ref.master, &ref.m, &ref.v};
  const std::vector<std::vector<float>>* g[] = {&got.param, &got.master, &got.m, &got.v};
  for (int k = 0; k < 4; ++k) {
    const Diff d = diff_of(*r[k], *g[k]);
    double scale = 1.0;
    if (k >= 2) {
      std::vector<std::vector<float>> zero;
      for (const auto& t : *r[k]) zero.emplace_back(t.size(), 0.0f);
      scale = diff_of(*r[k], zero).max;
    }
    if (world().rank() == 0) {
      std::printf("%s: %s |difference| max %.3g rms %.3g (scale %.3g)\n", what.c_str(), names[k], d.max,
                  d.rms, scale);
    }
    const double rms = k >= 2 && tol.moment_rms > 0.0 ? tol.moment_rms : tol.rms;
    EXPECT_LE(d.rms, rms * scale) << what << ": " << names[k] << " (rms of the differences)";
    EXPECT_LE(d.max, tol.max * scale) << what << ": " << names[k] << " (largest difference)";
  }
  EXPECT_NE(ref.losses.front(), ref.losses.back()) << what << ": the run trained";
}

// Creates a fresh engine at ZeRO `stage` on the caller's grid (the same groups and settings
// otherwise); `device` receives the device it runs on, which must outlive the engine.
using StageEngineFactory =
    std::function<Result<std::unique_ptr<OffloadEngine>>(std::unique_ptr<Device>& device, int stage)>;

// Stage 3 in device memory read back through its slices, against stage 2 on the same grid
// (`create` makes either; `global` is the whole global batch, this rank data-parallel rank `dp` of
// DP; `single` the settings of one process holding every parameter): after 2 steps
// - loss() on one micro-batch and evaluate() (the fetches, collective over dp) give stage 2's
//   values, bit for bit;
// - a checkpoint of stage 3 resumes in a fresh engine and its third step is the uninterrupted
//   run's bit for bit (losses, norms, every held parameter's working copy, master and moments);
// - one process loading that checkpoint holds every parameter's state as a fresh grid engine
//   loading it gathers it, bit for bit.
// Collective over the world (a shared directory under `tag`, removed at the end).
inline void expect_stage3_reads_back_as_stage2(const TrainerConfig& global, int dp, int DP,
                                               const StageEngineFactory& create, const OffloadSettings& single,
                                               const std::string& tag, const std::string& what) {
  const std::string root = shared_temp_dir(tag);
  std::vector<std::int32_t> in, tg;
  share_of(global, 3, dp, DP, in, tg);
  in.resize(static_cast<std::size_t>(global.micro_batch * global.seq_len));  // loss(): one micro-batch
  tg.resize(in.size());
  const std::vector<std::int32_t> tokens = eval_tokens(global);
  double losses[2] = {0, 0};
  EvalResult evals[2];
  Snapshot straight, resumed;
  std::string dir;
  for (int stage : {2, 3}) {
    std::unique_ptr<Device> device;
    auto engine = create(device, stage);
    ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
    Snapshot warm;
    ASSERT_TRUE(run_share(**engine, global, dp, DP, 2, warm)) << what;
    if (stage == 3) {
      auto saved = (*engine)->save_checkpoint(root + "/ck", "{}", 1);
      ASSERT_TRUE(saved.ok()) << what << ": " << saved.status().to_string();
      dir = *saved;
    }
    auto l = (*engine)->loss(in, tg);
    ASSERT_TRUE(l.ok()) << what << ": " << l.status().to_string();
    losses[stage - 2] = *l;
    auto e = (*engine)->evaluate(tokens, 3);
    ASSERT_TRUE(e.ok()) << what << ": " << e.status().to_string();
    evals[stage - 2] = *e;
    if (stage == 3) {
      ASSERT_TRUE(run_share(**engine, global, dp, DP, 3, straight, 2)) << what;
      std::vector<int> held;
      ASSERT_TRUE(capture_stage(**engine, straight, held)) << what;
    }
  }
  EXPECT_EQ(losses[0], losses[1]) << what << ": loss() at stage 2 vs 3";
  EXPECT_EQ(evals[0].loss, evals[1].loss) << what << ": evaluate() at stage 2 vs 3";
  EXPECT_EQ(evals[0].tokens, evals[1].tokens) << what;
  {
    std::unique_ptr<Device> device;
    auto engine = create(device, 3);
    ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
    auto m = (*engine)->load_checkpoint(dir);
    ASSERT_TRUE(m.ok()) << what << ": " << m.status().to_string();
    EXPECT_EQ(m->step, 2) << what;
    ASSERT_TRUE(run_share(**engine, global, dp, DP, 3, resumed, 2)) << what;
    std::vector<int> held;
    ASSERT_TRUE(capture_stage(**engine, resumed, held)) << what;
  }
  for (Snapshot* snap : {&straight, &resumed}) {
    snap->scales.assign(snap->losses.size(), 1.0);
    snap->skipped.assign(snap->losses.size(), 0);
  }
  expect_same(straight, resumed, what + ": resumed against uninterrupted");
  {
    // One process loads the grid's checkpoint: the state of the parameters this rank's grid
    // engine holds as it held them after step 2 (a fresh grid engine loading it gathers that state
    // again).
    Snapshot grid_state, single_state;
    std::vector<int> held;
    {
      std::unique_ptr<Device> device;
      auto engine = create(device, 3);
      ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
      ASSERT_TRUE((*engine)->load_checkpoint(dir).ok()) << what;
      ASSERT_TRUE(capture_stage(**engine, grid_state, held)) << what;
    }
    auto device = make_device();
    auto engine = OffloadEngine::create(global, single, *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    auto m = (*engine)->load_checkpoint(dir);
    ASSERT_TRUE(m.ok()) << what << ": " << m.status().to_string();
    ASSERT_TRUE(capture_held(**engine, held, single_state)) << what;
    ASSERT_FALSE(held.empty()) << what;
    ASSERT_EQ(grid_state.param.size(), single_state.param.size()) << what;
    for (std::size_t i = 0; i < grid_state.param.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(grid_state.param[i], single_state.param[i])) << what << ": param " << held[i];
      EXPECT_TRUE(bitwise_equal(grid_state.master[i], single_state.master[i])) << what << ": master " << held[i];
      EXPECT_TRUE(bitwise_equal(grid_state.m[i], single_state.m[i])) << what << ": exp_avg " << held[i];
      EXPECT_TRUE(bitwise_equal(grid_state.v[i], single_state.v[i])) << what << ": exp_avg_sq " << held[i];
    }
  }
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == 0) std::filesystem::remove_all(root);
}

}  // namespace strata::testing
