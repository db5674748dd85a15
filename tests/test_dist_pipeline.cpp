// Pipeline parallelism on the offload engine, on real processes: run by tests/mpi_run.sh under
// `mpirun -np P` (tests/CMakeLists.txt); the world is one pipeline of P stages. Every stage
// trains with the pipeline engine and, in the same process, the single-process engine on the
// same global batch (grad_accum micro-batches) as the reference, then compares the state of the
// parameters its stage holds.
//
// What is compared, and how exactly (docs/parallel.md "Pipeline parallel"):
// - LLaMA (untied head), and GPT-2 with one micro-batch: bit for bit (losses, gradient norms,
//   parameters, master weights, Adam moments). Each module computes what it computes in one
//   process, every stage runs the backwards in micro-batch order (the same accumulation), the
//   norm merges per-unit statistics in unit order, and the tied wte's two parts e + h are added
//   once (a sum of two is exact whatever the order).
// - GPT-2 with several micro-batches: the tied wte's gradient is (e0 + e1 + ...) + (h0 + h1 + ...)
//   instead of e0 + h0 + e1 + h1 + ...: rounding, so the state agrees within the tolerance below
//   (relative, measured with a 10x margin), and the runs' losses within 1e-5 relative.
// - The first and the last stage's copies of the embedding are identical bit for bit.
// - loss() and evaluate() run forward only through the stages: the last stage's value on every
//   stage, bit for bit the single process's where the parameters are (the forward is the same
//   module code on the same bits), within 1e-5 relative where they differ by rounding.
// - Checkpoints and weights files are the single process's files: byte for byte where the state
//   is the same bits; a checkpoint resumes bit for bit in a fresh pipeline, in one process and,
//   written by one process, in a pipeline.
#include <gtest/gtest.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>

#include "comm_environment.hpp"
#include "dist_compare.hpp"
#include "nvme/faults.hpp"
#include "offload/internal.hpp"
#include "offload_fixture.hpp"
#include "strata/checkpoint.hpp"
#include "strata/parallel.hpp"
#include "strata/safetensors.hpp"

namespace strata {
namespace {

using testing::capture_stage;
using testing::eval_tokens;
using testing::file_bytes;
using testing::fnv;
using testing::Snapshot;
using testing::world;

// One micro-batch (of step 7's deterministic batch) for loss().
void loss_batch(const TrainerConfig& c, std::vector<std::int32_t>& in, std::vector<std::int32_t>& tg) {
  testing::batch(c, 7, in, tg);
  in.resize(static_cast<std::size_t>(c.micro_batch * c.seq_len));
  tg.resize(in.size());
}

// The tied wte's sum order moves GPT-2's state by rounding (largest difference relative to the
// quantity's largest value; check_case prints the measured figures). Measured on 2 and 3 stages,
// fp32, lr 1e-2, 3 steps: parameters 3.0e-5, exp_avg 1e-6, exp_avg_sq 7e-7 of their scale; a
// missing or doubled tied gradient moves the parameters by about the learning rate.
constexpr double kRelTolerance = 3e-4;

// Each held quantity (parameters, masters, moments) within kRelTolerance of its largest value,
// losses within 1e-5 and norms within 1e-4 relative (defined below).
void expect_within_rounding(const Snapshot& ref, const Snapshot& got, const std::string& what);

struct Case {
  ModelKind kind;
  PipelineSchedule schedule;
  std::int64_t micro;
  Tier params, optimizer;
  DType dtype = DType::kF32;
  int virtual_stages = 1;  // > 1: interleaved 1F1B (strata.pipeline_virtual_stages)
  int n_layer = 0;         // > 0: the tiny model with this many blocks (more chunks than 5 modules)
  Tier gradients = Tier::kHost;  // strata.offload_gradients (kNvme: with the NVMe optimizer)
};

std::string name_of(const Case& c) {
  return std::string(to_string(c.kind)) + " " + std::string(to_string(c.schedule)) +
         " m=" + std::to_string(c.micro) + " params=" + std::string(to_string(c.params)) +
         " optimizer=" + std::string(to_string(c.optimizer)) + " " + std::string(to_string(c.dtype)) +
         (c.virtual_stages > 1 ? " interleaved v=" + std::to_string(c.virtual_stages) : std::string()) +
         (c.n_layer > 0 ? " n_layer=" + std::to_string(c.n_layer) : std::string()) +
         (c.gradients == Tier::kNvme ? " gradients=nvme" : std::string());
}

void check_case(const Case& c) {
  const std::string what = name_of(c) + " on " + std::to_string(world().size()) + " stages";
  TrainerConfig config = testing::tiny(c.kind, c.dtype, c.micro, 1.0);
  if (c.n_layer > 0) config.model.n_layer = c.n_layer;
  OffloadSettings s;
  s.params = c.params;
  s.optimizer = c.optimizer;
  s.persistence_threshold = 0;
  s.pipeline_schedule = c.schedule;
  s.gradients = c.gradients;
  testing::TempDir swap_pp("strata-pp-swap"), swap_ref("strata-pp-swap");  // each rank its own
  OffloadSettings ref_settings = s;
  s.pipeline_virtual_stages = c.virtual_stages;  // the single-process reference has no chunks
  if (c.params == Tier::kNvme || c.optimizer == Tier::kNvme) {
    s.nvme_path = {swap_pp.path().string()};
    ref_settings.nvme_path = {swap_ref.path().string()};
  }
  constexpr int kSteps = 3;
  Snapshot got, ref;
  std::vector<int> held;
  std::vector<std::int32_t> in, tg;
  loss_batch(config, in, tg);
  double got_loss = 0, ref_loss = 0;
  EvalResult got_eval, ref_eval;
  {
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(config, s, *device, nullptr, nullptr, nullptr, &world());
    ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
    ASSERT_TRUE(testing::run_steps(**engine, config, 0, kSteps, got)) << what;
    ASSERT_TRUE(capture_stage(**engine, got, held)) << what;
    // Only this stage's parameters are placed: the plan is smaller than one process's.
    EXPECT_FALSE(held.empty()) << what;
    if (c.virtual_stages > 1) {
      // The stage holds exactly its chunks' modules (s, s + p, ... of the v·p chunks; GPT-2's
      // last stage also the tied embedding), which are not contiguous: interleaving happened.
      const int p = world().size(), st = world().rank();
      auto bounds = pipeline_stages(config.model, p * c.virtual_stages, config.seq_len);
      ASSERT_TRUE(bounds.ok()) << bounds.status().to_string();
      std::set<int> want, got_modules;
      for (const auto& [b, e] : offload_detail::stage_ranges(*bounds, c.virtual_stages, st)) {
        for (int m = b; m < e; ++m) want.insert(m);
      }
      if (c.kind == ModelKind::kGpt2 && st == p - 1) want.insert(0);
      const ModelLayout& L = (*engine)->model().layout();
      for (int idx : held) got_modules.insert(L.params[static_cast<std::size_t>(idx)].module);
      EXPECT_EQ(got_modules, want) << what << ": the modules stage " << st << " holds";
      EXPECT_GT(*want.rbegin() - *want.begin() + 1, static_cast<int>(want.size()))
          << what << ": stage " << st << "'s chunks are contiguous";
    }
    // Forward only through the stages (collective): the loss of one micro-batch, and an
    // evaluation whose last batch is smaller than micro_batch.
    auto loss = (*engine)->loss(in, tg);
    ASSERT_TRUE(loss.ok()) << what << ": " << loss.status().to_string();
    got_loss = *loss;
    auto ev = (*engine)->evaluate(eval_tokens(config), 0);
    ASSERT_TRUE(ev.ok()) << what << ": " << ev.status().to_string();
    got_eval = *ev;
  }
  {
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(config, ref_settings, *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    ASSERT_TRUE(testing::run_steps(**engine, config, 0, kSteps, ref)) << what;
    ASSERT_TRUE(testing::capture_held(**engine, held, ref)) << what;
    auto loss = (*engine)->loss(in, tg);
    ASSERT_TRUE(loss.ok()) << loss.status().to_string();
    ref_loss = *loss;
    auto ev = (*engine)->evaluate(eval_tokens(config), 0);
    ASSERT_TRUE(ev.ok()) << ev.status().to_string();
    ref_eval = *ev;
  }
  EXPECT_EQ(got_eval.tokens, ref_eval.tokens) << what << ": evaluated tokens";
  EXPECT_EQ(ref_eval.tokens, 5 * config.seq_len) << what;
  const bool exact = c.kind == ModelKind::kLlama || c.micro == 1;
  if (exact) {
    testing::expect_same(ref, got, what);
    EXPECT_EQ(got_loss, ref_loss) << what << ": loss()";
    EXPECT_EQ(got_eval.loss, ref_eval.loss) << what << ": evaluate()";
  } else {
    EXPECT_NEAR(got_loss, ref_loss, 1e-5 * std::fabs(ref_loss)) << what << ": loss()";
    EXPECT_NEAR(got_eval.loss, ref_eval.loss, 1e-5 * std::fabs(ref_eval.loss)) << what << ": evaluate()";
    // Relative to each quantity's largest value; measured (see the file comment).
    expect_within_rounding(ref, got, what);
  }
  // Every stage reports the same loss (the last stage's), norm, loss() and evaluation.
  double mine[4] = {got.losses.back(), got.norms.back(), got_loss, got_eval.loss};
  std::vector<double> all(static_cast<std::size_t>(4 * world().size()));
  ASSERT_TRUE(world().all_gather(mine, all.data(), 8, DType::kF32).wait().ok());
  for (int r = 0; r < world().size(); ++r) {
    EXPECT_EQ(all[static_cast<std::size_t>(4 * r)], mine[0]) << what << ": loss on stage " << r;
    EXPECT_EQ(all[static_cast<std::size_t>(4 * r + 1)], mine[1]) << what << ": norm on stage " << r;
    EXPECT_EQ(all[static_cast<std::size_t>(4 * r + 2)], mine[2]) << what << ": loss() on stage " << r;
    EXPECT_EQ(all[static_cast<std::size_t>(4 * r + 3)], mine[3]) << what << ": evaluate() on stage " << r;
  }
  // GPT-2: the first and the last stage hold the same embedding, bit for bit.
  if (c.kind == ModelKind::kGpt2) {
    std::uint64_t h = 0;
    if (!held.empty() && held.front() == 0) {  // wte (parameter 0) held here
      h = fnv({got.param[0], got.master[0], got.m[0], got.v[0]});
    }
    std::vector<std::uint64_t> hs(static_cast<std::size_t>(world().size()));
    ASSERT_TRUE(world().all_gather(&h, hs.data(), 2, DType::kF32).wait().ok());
    EXPECT_NE(hs.front(), 0u);
    EXPECT_EQ(hs.front(), hs.back()) << what << ": the first and the last stage's wte differ";
  }
}

// Checkpoints and weights of a pipeline (docs/parallel.md "Saving and loading a pipeline"),
// against one process (rank 0's, in the same job):
// - saved after 2 steps and loaded into a fresh pipeline, 2 more steps give the uninterrupted
//   run's losses, norms and state bit for bit (the same stages, the same order of every sum);
// - a fresh pipeline loading the weights file saves it again byte for byte;
// - one process loading the pipeline's checkpoint writes the pipeline's weights file byte for byte
//   (its state is the pipeline's at the save), and trains on with the pipeline's losses (bit for
//   bit where the two runs' sums agree, see `exact`; within 1e-5 relative otherwise);
// - where the two runs hold the same bits (`exact`), one process trained for 2 steps writes the
//   very checkpoint files (modules, manifest) and weights file the pipeline wrote, and a pipeline
//   resumed from that checkpoint continues the pipeline's run bit for bit.
// Every stage writes its own part of a checkpoint (docs/parallel.md "Saving and loading a
// pipeline"): each module's file is written by the lowest stage holding the module (GPT-2's tied
// embedding: the first stage), so this rank (every rank is a stage's first one here: the world
// is the pipeline) wrote exactly the bytes of those files, as the manifest lists them; together
// the stages wrote every file once.
void check_written_by_stage(OffloadEngine& engine, const std::string& dir, std::uint64_t written,
                            const std::string& what) {
  const ModelLayout& L = engine.model().layout();
  const std::size_t M = L.modules.size();
  std::vector<float> mine(M, 0.0f), all(M * static_cast<std::size_t>(world().size()));
  for (std::size_t i = 0; i < L.params.size(); ++i) {
    if (L.params[i].owns_storage() && engine.get_param(static_cast<int>(i)).ok())
      mine[static_cast<std::size_t>(L.params[i].module)] = 1.0f;
  }
  ASSERT_TRUE(world().all_gather(mine.data(), all.data(), M, DType::kF32).wait().ok());
  auto manifest = read_checkpoint_manifest(dir, true);
  ASSERT_TRUE(manifest.ok()) << what << ": " << manifest.status().to_string();
  std::uint64_t expected = 0, total = 0;
  for (const CheckpointFile& f : manifest->files) {
    total += f.bytes;
    int u = -1;
    ASSERT_EQ(std::sscanf(f.name.c_str(), "module-%d.safetensors", &u), 1) << what << ": " << f.name;
    ASSERT_TRUE(u >= 0 && static_cast<std::size_t>(u) < M) << what << ": " << f.name;
    int lowest = -1;
    for (int r = 0; r < world().size() && lowest < 0; ++r)
      if (all[static_cast<std::size_t>(r) * M + static_cast<std::size_t>(u)] == 1.0f) lowest = r;
    EXPECT_GE(lowest, 0) << what << ": no stage holds " << f.name;
    if (lowest == world().rank()) expected += f.bytes;
  }
  EXPECT_EQ(written, expected) << what << ": stage " << world().rank() << " wrote other files than its own";
  // The counts travel as raw bits (an all-gather moves bits).
  std::vector<std::uint64_t> each(static_cast<std::size_t>(world().size()));
  ASSERT_TRUE(world().all_gather(&written, each.data(), 2, DType::kF32).wait().ok());
  std::uint64_t sum = 0, beyond_first = 0;
  for (std::size_t r = 0; r < each.size(); ++r) {
    sum += each[r];
    if (r > 0) beyond_first += each[r];
  }
  EXPECT_EQ(sum, total) << what << ": the stages together wrote every file once";
  EXPECT_GT(beyond_first, 0u) << what << ": only the first stage wrote";
}

void check_state_files(const Case& c) {
  const std::string what =
      name_of(c) + " on " + std::to_string(world().size()) + " stages (checkpoint, weights)";
  const TrainerConfig config = testing::tiny(c.kind, c.dtype, c.micro, 1.0);
  OffloadSettings s;
  s.params = c.params;
  s.optimizer = c.optimizer;
  s.persistence_threshold = 0;
  s.pipeline_schedule = c.schedule;
  testing::TempDir swap_pp("strata-pp-swap"), swap_ref("strata-pp-swap");  // each rank its own
  OffloadSettings ref_settings = s;
  s.pipeline_virtual_stages = c.virtual_stages;  // the single-process reference has no chunks
  if (c.params == Tier::kNvme || c.optimizer == Tier::kNvme) {
    s.nvme_path = {swap_pp.path().string()};
    ref_settings.nvme_path = {swap_ref.path().string()};
  }
  const bool exact = c.kind == ModelKind::kLlama || c.micro == 1;
  const std::string root = testing::shared_temp_dir("pp-state");
  const std::string pp_root = root + "/pp", one_root = root + "/one";
  const std::string pp_weights = root + "/pp.safetensors", one_weights = root + "/one.safetensors",
                    reload_weights = root + "/reload.safetensors";
  const std::string pp_native = root + "/pp-native.safetensors",
                    reload_native = root + "/reload-native.safetensors";
  const std::string client = R"({"run":"pp"})";
  auto create_pp = [&](std::unique_ptr<Device>& device) {
    device = testing::make_device();
    return OffloadEngine::create(config, s, *device, nullptr, nullptr, nullptr, &world());
  };
  Snapshot straight;
  std::vector<int> held;
  std::string dir;
  {
    std::unique_ptr<Device> device;
    auto engine = create_pp(device);
    ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
    ASSERT_TRUE(testing::run_steps(**engine, config, 0, 2, straight)) << what;
    const std::uint64_t written_before = (*engine)->stats().bytes_checkpoint_written;
    auto saved = (*engine)->save_checkpoint(pp_root, client, 2);
    ASSERT_TRUE(saved.ok()) << what << ": " << saved.status().to_string();
    dir = *saved;
    check_written_by_stage(**engine, dir, (*engine)->stats().bytes_checkpoint_written - written_before, what);
    Status w = (*engine)->save_weights(pp_weights);
    ASSERT_TRUE(w.ok()) << what << ": " << w.to_string();
    w = (*engine)->save_weights(pp_native, WeightFormat::kNative);
    ASSERT_TRUE(w.ok()) << what << ": " << w.to_string();
    ASSERT_TRUE(testing::run_steps(**engine, config, 2, 4, straight)) << what;
    ASSERT_TRUE(capture_stage(**engine, straight, held)) << what;
  }
  EXPECT_EQ(dir, pp_root + "/step-00000002") << what << ": every stage gets the published directory";
  auto first_two = [&](Snapshot& out) {
    for (int i = 0; i < 2; ++i) {
      out.losses.push_back(straight.losses[static_cast<std::size_t>(i)]);
      out.norms.push_back(straight.norms[static_cast<std::size_t>(i)]);
      out.scales.push_back(straight.scales[static_cast<std::size_t>(i)]);
      out.skipped.push_back(straight.skipped[static_cast<std::size_t>(i)]);
    }
  };
  // Resumed by a fresh pipeline of the same shape.
  {
    std::unique_ptr<Device> device;
    auto engine = create_pp(device);
    ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
    auto m = (*engine)->load_checkpoint(pp_root);
    ASSERT_TRUE(m.ok()) << what << ": " << m.status().to_string();
    EXPECT_EQ(m->step, 2) << what;
    EXPECT_EQ(m->client_state, client) << what;
    Snapshot resumed;
    first_two(resumed);
    std::vector<int> held_again;
    ASSERT_TRUE(testing::run_steps(**engine, config, 2, 4, resumed)) << what;
    ASSERT_TRUE(capture_stage(**engine, resumed, held_again)) << what;
    EXPECT_EQ(held, held_again) << what;
    testing::expect_same(straight, resumed, what + ": a fresh pipeline resumed from its checkpoint");
  }
  {
    // The weights file into a fresh pipeline (each stage keeps its parameters), saved again: the
    // same file.
    std::unique_ptr<Device> device;
    auto engine = create_pp(device);
    ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
    Status l = (*engine)->load_weights(pp_weights);
    ASSERT_TRUE(l.ok()) << what << ": " << l.to_string();
    ASSERT_TRUE((*engine)->save_weights(root + "/again.safetensors").ok()) << what;
    if (world().rank() == 0) {
      EXPECT_TRUE(file_bytes(pp_weights) == file_bytes(root + "/again.safetensors"))
          << what << ": weights loaded into a pipeline and saved again";
    }
  }
  if (world().rank() == 0) {
    // One process loads the pipeline's checkpoint: the pipeline's weights file, and its losses.
    {
      auto device = testing::make_device();
      auto engine = OffloadEngine::create(config, ref_settings, *device);
      ASSERT_TRUE(engine.ok()) << engine.status().to_string();
      auto m = (*engine)->load_checkpoint(dir);
      ASSERT_TRUE(m.ok()) << what << ": " << m.status().to_string();
      ASSERT_TRUE((*engine)->save_weights(reload_weights).ok()) << what;
      const std::string a = file_bytes(pp_weights);
      EXPECT_FALSE(a.empty()) << what << ": " << pp_weights;
      EXPECT_TRUE(a == file_bytes(reload_weights))
          << what << ": the pipeline's weights file differs from one process's at the checkpoint's state";
      ASSERT_TRUE((*engine)->save_weights(reload_native, WeightFormat::kNative).ok()) << what;
      EXPECT_FALSE(file_bytes(pp_native).empty()) << what << ": " << pp_native;
      EXPECT_TRUE(file_bytes(pp_native) == file_bytes(reload_native))
          << what << ": the pipeline's native weights file differs from one process's";
      Snapshot single;
      ASSERT_TRUE(testing::run_steps(**engine, config, 2, 4, single)) << what;
      for (std::size_t i = 0; i < 2; ++i) {
        if (exact) {
          EXPECT_EQ(single.losses[i], straight.losses[i + 2])
              << what << ": one process resumed, step " << i + 3;
        } else {
          EXPECT_NEAR(single.losses[i], straight.losses[i + 2], 1e-5 * std::fabs(straight.losses[i + 2]))
              << what << ": one process resumed, step " << i + 3;
        }
      }
    }
    // One process trained alike: the same files, where the state is the same bits.
    if (exact) {
      auto device = testing::make_device();
      auto engine = OffloadEngine::create(config, ref_settings, *device);
      ASSERT_TRUE(engine.ok()) << engine.status().to_string();
      Snapshot one;
      ASSERT_TRUE(testing::run_steps(**engine, config, 0, 2, one)) << what;
      auto saved = (*engine)->save_checkpoint(one_root, client, 2);
      ASSERT_TRUE(saved.ok()) << saved.status().to_string();
      ASSERT_TRUE((*engine)->save_weights(one_weights).ok()) << what;
      EXPECT_TRUE(file_bytes(pp_weights) == file_bytes(one_weights)) << what << ": weights file";
      auto files = read_checkpoint_manifest(dir, true);
      ASSERT_TRUE(files.ok()) << files.status().to_string();
      EXPECT_GE(files->files.size(), 2u) << what;
      for (const CheckpointFile& f : files->files) {
        EXPECT_TRUE(file_bytes(dir + "/" + f.name) == file_bytes(*saved + "/" + f.name))
            << what << ": checkpoint file " << f.name;
      }
      EXPECT_TRUE(file_bytes(dir + "/manifest.json") == file_bytes(*saved + "/manifest.json")) << what;
    }
  }
  ASSERT_TRUE(world().barrier().wait().ok());
  if (exact) {
    // A pipeline resumes one process's checkpoint and continues the pipeline's run.
    std::unique_ptr<Device> device;
    auto engine = create_pp(device);
    ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
    auto m = (*engine)->load_checkpoint(one_root);
    ASSERT_TRUE(m.ok()) << what << ": " << m.status().to_string();
    Snapshot resumed;
    first_two(resumed);
    std::vector<int> held_again;
    ASSERT_TRUE(testing::run_steps(**engine, config, 2, 4, resumed)) << what;
    ASSERT_TRUE(capture_stage(**engine, resumed, held_again)) << what;
    testing::expect_same(straight, resumed, what + ": a pipeline resumed from one process's checkpoint");
  }
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == 0) std::filesystem::remove_all(root);
}

TEST(PipelineEngine, CheckpointsAndWeights) {
  check_state_files({ModelKind::kGpt2, PipelineSchedule::kOneFOneB, 1, Tier::kDevice, Tier::kDevice});
  check_state_files({ModelKind::kLlama, PipelineSchedule::kGpipe, 2, Tier::kHost, Tier::kHost, DType::kBF16});
  check_state_files({ModelKind::kGpt2, PipelineSchedule::kOneFOneB, 2, Tier::kDevice, Tier::kNvme});
}

// A stage that cannot read its state while checkpointing (the disk under its NVMe optimizer
// fails): the save fails on every rank (the writer's error names the stage), `latest` keeps
// naming the previous checkpoint and no partial directory is left; no rank waits for another,
// so once the disk recovers the same engines save again.
TEST(PipelineEngine, CheckpointFailsCleanlyWhenAStageCannotReadItsState) {
  const TrainerConfig config = testing::tiny(ModelKind::kLlama, DType::kF32, 2, 1.0);
  testing::TempDir swap("strata-pp-fault");  // each rank its own
  OffloadSettings s;
  s.optimizer = Tier::kNvme;
  s.nvme_path = {swap.path().string()};
  s.persistence_threshold = 0;
  const std::string root = testing::shared_temp_dir("pp-fault");
  nvme_detail::IoFaults faults;
  auto device = testing::make_device();
  auto engine = offload_detail::EngineFaults::create(config, s, *device, &faults, &world());
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  Snapshot got;
  ASSERT_TRUE(testing::run_steps(**engine, config, 0, 1, got));
  auto first = (*engine)->save_checkpoint(root, "{}", 2);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  ASSERT_TRUE(testing::run_steps(**engine, config, 1, 2, got));
  ASSERT_TRUE((*engine)->synchronize().ok());  // the step's update is on disk before the disk fails
  const int failing = world().size() - 1;
  if (world().rank() == failing) {
    for (std::uint64_t offset = 0; offset < (64u << 20); offset += 4096)
      faults.add_error({IoOp::kRead, swap.path().string(), offset, EIO});
  }
  auto failed = (*engine)->save_checkpoint(root, "{}", 2);
  ASSERT_FALSE(failed.ok()) << "rank " << world().rank();
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError) << failed.status().to_string();
  if (world().rank() == 0) {
    EXPECT_NE(failed.status().message().find("pipeline stage " + std::to_string(failing) + " could not read"),
              std::string::npos)
        << failed.status().to_string();
  }
  // Rank 0 removes the failed save's temporary directory before its call returns; the other
  // ranks' calls may return first, so they look once rank 0 is done.
  ASSERT_TRUE(world().barrier().wait().ok());
  auto latest = resolve_checkpoint(root);
  ASSERT_TRUE(latest.ok()) << latest.status().to_string();
  EXPECT_EQ(*latest, *first) << "latest moved after a failed save";
  for (const auto& e : std::filesystem::directory_iterator(root)) {
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
    EXPECT_NE(e.path().filename().string(), "step-00000002") << "a failed save was published";
  }
  // Every rank has looked before rank 0's next save creates its temporary directory again.
  ASSERT_TRUE(world().barrier().wait().ok());
  faults.clear_errors();
  auto again = (*engine)->save_checkpoint(root, "{}", 2);
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ(*again, root + "/step-00000002");
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == 0) std::filesystem::remove_all(root);
}

// A stage that cannot read its parameters while the weights are saved (the disk under its NVMe
// parameters fails): the save fails on every rank with an error naming the stage, promptly (the
// stage's first rank sends an "unread" flag instead of nothing: a writer waiting for the
// parameters would end only with the comm timeout, whose message names no stage), and the
// weights file at the path keeps its previous bytes (another path stays absent). Once the disk
// recovers the same engines save again. Run with the last stage failing (a sender) and the first
// (the writer's own stage).
TEST(PipelineEngine, WeightsFailCleanlyWhenAStageCannotReadItsParameters) {
  const TrainerConfig config = testing::tiny(ModelKind::kLlama, DType::kF32, 2, 1.0);
  for (const int failing : {world().size() - 1, 0}) {
    const std::string what = "stage " + std::to_string(failing) + " failing";
    testing::TempDir swap("strata-pp-wfault");  // each rank its own
    OffloadSettings s;
    s.params = Tier::kNvme;
    s.optimizer = Tier::kHost;
    s.nvme_path = {swap.path().string()};
    s.persistence_threshold = 0;  // every module's working parameters on NVMe
    const std::string root = testing::shared_temp_dir("pp-wfault");
    const std::string weights = root + "/weights.safetensors", other = root + "/other.safetensors";
    nvme_detail::IoFaults faults;
    auto device = testing::make_device();
    auto engine = offload_detail::EngineFaults::create(config, s, *device, &faults, &world());
    ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
    Snapshot got;
    ASSERT_TRUE(testing::run_steps(**engine, config, 0, 1, got)) << what;
    Status first = (*engine)->save_weights(weights);
    ASSERT_TRUE(first.ok()) << what << ": " << first.to_string();
    const std::string before = world().rank() == 0 ? file_bytes(weights) : std::string();
    if (world().rank() == 0) {
      ASSERT_FALSE(before.empty()) << what;
    }
    ASSERT_TRUE(testing::run_steps(**engine, config, 1, 2, got)) << what;
    ASSERT_TRUE((*engine)->synchronize().ok()) << what;  // the update is on disk before the disk fails
    if (world().rank() == failing) {
      for (std::uint64_t offset = 0; offset < (64u << 20); offset += 4096)
        faults.add_error({IoOp::kRead, swap.path().string(), offset, EIO});
    }
    const std::string named = "pipeline stage " + std::to_string(failing) + " could not read";
    for (const std::string& path : {weights, other}) {
      Status failed = (*engine)->save_weights(path);
      ASSERT_FALSE(failed.ok()) << what << ", rank " << world().rank();
      EXPECT_EQ(failed.code(), StatusCode::kIoError) << what << ": " << failed.to_string();
      EXPECT_NE(failed.message().find(named), std::string::npos)
          << what << ", rank " << world().rank() << ": " << failed.to_string();
      EXPECT_NE(failed.message().find(path), std::string::npos) << what << ": " << failed.to_string();
    }
    if (world().rank() == 0) {
      EXPECT_TRUE(file_bytes(weights) == before) << what << ": a failed save changed the previous file";
      EXPECT_FALSE(std::filesystem::exists(other)) << what << ": a failed save left a file";
      for (const auto& e : std::filesystem::directory_iterator(root))
        EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << what << ": " << e.path();
    }
    faults.clear_errors();
    Status again = (*engine)->save_weights(other);
    ASSERT_TRUE(again.ok()) << what << ": " << again.to_string();
    if (world().rank() == 0) {
      const std::string after = file_bytes(other);
      EXPECT_FALSE(after.empty()) << what;
      EXPECT_FALSE(after == before) << what << ": the weights after a second step are the first step's";
    }
    ASSERT_TRUE(world().barrier().wait().ok());
    if (world().rank() == 0) std::filesystem::remove_all(root);
  }
}

// A stage that cannot write its tensors into the weights file (every stage writes its own part
// of the one file: an injected EIO on the write of a tensor only that stage holds), and a path
// whose directory is missing (the writer cannot create the temporary file): the save fails on
// every rank with an error naming the stage and the tensor (or the temporary file), no
// temporary file is left, the file already at the path keeps its bytes and another path stays
// absent. Once the fault is gone the same engines save again: the file saved before, byte for
// byte (no step in between). Run with the last stage failing and the first (the writer's own).
// That the save fails at all shows the stage wrote that tensor itself: its fault is on its rank
// only.
// A pipeline's stages must share a file system at the weights path (each writes its modules into
// the one file): a stage that does not see the file the first stage created (as on another node
// without a shared file system: EngineFaults::hide_weights_file) fails the save on every rank with
// an error naming the stage and the file; nothing is written, the previous file keeps its bytes,
// and with the file seen again the same engines save it again.
TEST(PipelineEngine, WeightsFailWhenAStageDoesNotSeeTheFile) {
  const TrainerConfig config = testing::tiny(ModelKind::kLlama, DType::kF32, 2, 1.0);
  OffloadSettings s;
  s.persistence_threshold = 0;
  const std::string root = testing::shared_temp_dir("pp-unseen");
  const std::string weights = root + "/weights.safetensors";
  auto device = testing::make_device();
  auto engine = OffloadEngine::create(config, s, *device, nullptr, nullptr, nullptr, &world());
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  Snapshot got;
  ASSERT_TRUE(testing::run_steps(**engine, config, 0, 1, got));
  STRATA_ASSERT_OK((*engine)->save_weights(weights));
  ASSERT_TRUE(world().barrier().wait().ok());
  const std::string before = file_bytes(weights);
  const int last = world().size() - 1;
  if (world().rank() == last) offload_detail::EngineFaults::hide_weights_file(**engine, true);
  Status failed = (*engine)->save_weights(weights);
  if (world().rank() == last) offload_detail::EngineFaults::hide_weights_file(**engine, false);
  ASSERT_FALSE(failed.ok()) << "rank " << world().rank();
  EXPECT_EQ(failed.code(), StatusCode::kFailedPrecondition) << failed.to_string();
  for (const std::string& part : {"pipeline stage " + std::to_string(last) + " does not see", weights + ".tmp",
                                  std::string("share a file system")})
    EXPECT_NE(failed.message().find(part), std::string::npos) << "rank " << world().rank() << ": " << failed.to_string();
  testing::expect_same_text_on_every_rank(failed.message(), "save_weights");
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == 0) {
    EXPECT_TRUE(file_bytes(weights) == before) << "a failed save changed the previous file";
    EXPECT_FALSE(std::filesystem::exists(weights + ".tmp")) << "the temporary file was left";
  }
  ASSERT_TRUE(world().barrier().wait().ok());
  STRATA_ASSERT_OK((*engine)->save_weights(weights));
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == 0) {
    EXPECT_TRUE(file_bytes(weights) == before) << "the save with the file seen again";
    std::filesystem::remove_all(root);
  }
  ASSERT_TRUE(world().barrier().wait().ok());
}

TEST(PipelineEngine, WeightsFailCleanlyWhenAStageCannotWrite) {
  const TrainerConfig config = testing::tiny(ModelKind::kLlama, DType::kF32, 2, 1.0);
  OffloadSettings s;
  s.persistence_threshold = 0;
  const std::string root = testing::shared_temp_dir("pp-wwrite");
  const std::string weights = root + "/weights.safetensors", other = root + "/other.safetensors";
  nvme_detail::IoFaults faults;
  auto device = testing::make_device();
  auto engine = offload_detail::EngineFaults::create(config, s, *device, &faults, &world());
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  Snapshot got;
  ASSERT_TRUE(testing::run_steps(**engine, config, 0, 1, got));
  Status first = (*engine)->save_weights(weights);
  ASSERT_TRUE(first.ok()) << first.to_string();
  ASSERT_TRUE(world().barrier().wait().ok());
  const std::string before = file_bytes(weights);
  ASSERT_FALSE(before.empty());
  auto file = SafetensorsFile::open(weights);
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  auto no_temporary_files = [&](const std::string& what) {
    for (const auto& e : std::filesystem::directory_iterator(root))
      EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << what << ": " << e.path();
  };
  const int last = world().size() - 1;
  for (const int failing : {last, 0}) {
    // The last stage holds the output projection, the first the token embedding (not tied in LLaMA).
    const std::string tensor = failing == last ? "lm_head.weight" : "model.embed_tokens.weight";
    const std::string what = "stage " + std::to_string(failing) + " failing to write '" + tensor + "'";
    const SafetensorsEntry* e = file->find(tensor);
    ASSERT_NE(e, nullptr) << what;
    if (world().rank() == failing)
      faults.add_error({IoOp::kWrite, ".safetensors.tmp", file->data_offset() + e->data_begin + 4, EIO});
    const std::string named = "pipeline stage " + std::to_string(failing) + " could not write its tensors";
    for (const std::string& path : {weights, other}) {
      Status failed = (*engine)->save_weights(path);
      ASSERT_FALSE(failed.ok()) << what << ", rank " << world().rank();
      EXPECT_EQ(failed.code(), StatusCode::kIoError) << what << ": " << failed.to_string();
      for (const std::string& part : {named, "'" + tensor + "'", path})
        EXPECT_NE(failed.message().find(part), std::string::npos)
            << what << ", rank " << world().rank() << ": " << failed.to_string();
    }
    faults.clear_errors();
    ASSERT_TRUE(world().barrier().wait().ok());  // rank 0 removed the temporary file before returning
    if (world().rank() == 0) {
      EXPECT_TRUE(file_bytes(weights) == before) << what << ": a failed save changed the previous file";
      EXPECT_FALSE(std::filesystem::exists(other)) << what << ": a failed save left a file";
      no_temporary_files(what);
    }
    ASSERT_TRUE(world().barrier().wait().ok());
    Status again = (*engine)->save_weights(other);
    ASSERT_TRUE(again.ok()) << what << ": " << again.to_string();
    ASSERT_TRUE(world().barrier().wait().ok());
    if (world().rank() == 0) {
      EXPECT_TRUE(file_bytes(other) == before) << what << ": the save after the fault";
      std::filesystem::remove(other);
    }
    ASSERT_TRUE(world().barrier().wait().ok());
  }
  // The writer cannot create the temporary file: every rank reports it.
  const std::string missing = root + "/missing/weights.safetensors";
  Status failed = (*engine)->save_weights(missing);
  ASSERT_FALSE(failed.ok()) << "rank " << world().rank();
  EXPECT_EQ(failed.code(), StatusCode::kIoError) << failed.to_string();
  EXPECT_NE(failed.message().find("cannot create '" + missing + ".tmp'"), std::string::npos)
      << "rank " << world().rank() << ": " << failed.to_string();
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == 0) {
    EXPECT_FALSE(std::filesystem::exists(root + "/missing"));
    no_temporary_files("a missing directory");
    std::filesystem::remove_all(root);
  }
}

TEST(PipelineEngine, AllDeviceEverySchedule) {
  for (ModelKind kind : {ModelKind::kLlama, ModelKind::kGpt2}) {
    for (PipelineSchedule sched : {PipelineSchedule::kGpipe, PipelineSchedule::kOneFOneB}) {
      for (std::int64_t m : {1, 2, 4}) check_case({kind, sched, m, Tier::kDevice, Tier::kDevice});
    }
  }
}

TEST(PipelineEngine, HostOptimizer) {
  for (ModelKind kind : {ModelKind::kLlama, ModelKind::kGpt2}) {
    check_case({kind, PipelineSchedule::kOneFOneB, 2, Tier::kDevice, Tier::kHost});
    check_case({kind, PipelineSchedule::kGpipe, 1, Tier::kHost, Tier::kHost});
  }
}

TEST(PipelineEngine, NvmeParamsAndOptimizer) {
  check_case({ModelKind::kLlama, PipelineSchedule::kOneFOneB, 4, Tier::kNvme, Tier::kHost});
  check_case({ModelKind::kGpt2, PipelineSchedule::kOneFOneB, 1, Tier::kHost, Tier::kNvme});
}

// 16-bit working weights; fp16 with dynamic loss scaling (the tiny config overflows now and then:
// the overflow decision comes from the global norm, so every stage skips the same steps).
TEST(PipelineEngine, HalfPrecision) {
  check_case({ModelKind::kLlama, PipelineSchedule::kOneFOneB, 2, Tier::kDevice, Tier::kHost, DType::kBF16});
  check_case({ModelKind::kLlama, PipelineSchedule::kGpipe, 2, Tier::kDevice, Tier::kDevice, DType::kF16});
  check_case({ModelKind::kLlama, PipelineSchedule::kOneFOneB, 4, Tier::kDevice, Tier::kHost, DType::kF16});
}

// Interleaved 1F1B (strata.pipeline_virtual_stages = 2): on 2 stages the tiny model's 5 modules
// are split into 4 FLOP-balanced chunks, stage 0 runs chunks 0 and 2 (the embedding's and a
// middle one), stage 1 chunks 1 and 3 (the head's), so activations go 0 -> 1 -> 0 -> 1 and
// gradients back. Against one process on the same global batch, with the tolerances of
// check_case: LLaMA bit for bit (each chunk's backwards run in micro-batch order, so every unit
// accumulates its gradient in the single process's order, and the norm merges per unit in unit
// order), GPT-2 within kRelTolerance (the tied wte's sum order, as for 1F1B with m > 1). m = 2
// is one group of p micro-batches (every forward first), m = 4 two groups (warm-up, one forward
// one backward, cool-down). Runs on 2 ranks; 3 and 4 stages would need more modules than the
// tiny model has (the refusals below check that).
TEST(PipelineEngine, Interleaved) {
  ASSERT_EQ(world().size(), 2) << "interleaved equivalence runs on 2 stages (tests/CMakeLists.txt filters it elsewhere)";
  for (ModelKind kind : {ModelKind::kLlama, ModelKind::kGpt2}) {
    for (std::int64_t m : {2, 4}) {
      Case c{kind, PipelineSchedule::kOneFOneB, m, Tier::kDevice, Tier::kHost};
      c.virtual_stages = 2;
      check_case(c);
    }
  }
  Case all_device{ModelKind::kGpt2, PipelineSchedule::kOneFOneB, 4, Tier::kDevice, Tier::kDevice};
  all_device.virtual_stages = 2;
  check_case(all_device);
}

// Interleaved 1F1B with the gradients on NVMe (the NVMe optimizer): every landing and restore
// of a unit's gradients goes through the one staging buffer in gradient-stream order whichever
// chunk's backward issues it, and GPT-2's tied unit is read back, summed between the ends and
// written again after the schedule. Against one process with the gradients on NVMe too, with
// check_case's tolerances (LLaMA bit for bit, GPT-2 within the tied wte's rounding); m = 4: two
// groups, so units are restored between micro-batches while other chunks land theirs.
TEST(PipelineEngine, InterleavedNvmeGradients) {
  ASSERT_EQ(world().size(), 2)
      << "interleaved equivalence runs on 2 stages (tests/CMakeLists.txt filters it elsewhere)";
  for (ModelKind kind : {ModelKind::kLlama, ModelKind::kGpt2}) {
    Case c{kind, PipelineSchedule::kOneFOneB, 4, Tier::kDevice, Tier::kNvme};
    c.virtual_stages = 2;
    c.gradients = Tier::kNvme;
    check_case(c);
  }
}

// Interleaved 1F1B on 3 and 4 stages (the 3- and 4-rank jobs): v = 2 needs 2p chunks, so the
// model has 2p - 1 blocks (2p + 1 modules: one chunk holds two). Messages go round the ring
// twice (stage p - 1's first chunk sends to stage 0's second), and warm-up, steady state and
// cool-down differ per stage. m = p (one group) and 2p (two); tolerances as in check_case (LLaMA
// bit for bit, GPT-2 within kRelTolerance: the tied wte's sum order).
TEST(PipelineEngine, InterleavedMoreStages) {
  const int p = world().size();
  ASSERT_GE(p, 3) << "runs on 3 or 4 stages (tests/CMakeLists.txt filters it from the 2-rank job)";
  for (ModelKind kind : {ModelKind::kLlama, ModelKind::kGpt2}) {
    for (std::int64_t m : {p, 2 * p}) {
      Case c{kind, PipelineSchedule::kOneFOneB, m, Tier::kDevice, Tier::kHost};
      c.virtual_stages = 2;
      c.n_layer = 2 * p - 1;
      check_case(c);
    }
  }
}

// Checkpoints and weights with interleaved chunks: each unit comes from the stage holding it
// (chunk-aware), so the files are one process's byte for byte and resume bit for bit (LLaMA,
// exact), as check_state_files checks for the plain schedules.
TEST(PipelineEngine, InterleavedCheckpointsAndWeights) {
  ASSERT_EQ(world().size(), 2) << "interleaved runs on 2 stages (tests/CMakeLists.txt filters it elsewhere)";
  Case c{ModelKind::kLlama, PipelineSchedule::kOneFOneB, 2, Tier::kHost, Tier::kHost};
  c.virtual_stages = 2;
  check_state_files(c);
}

// What interleaving refuses, each with an error naming strata.pipeline_virtual_stages, its value
// and what is expected; create() fails before any collective, the same way on every rank.
TEST(PipelineEngine, InterleavedRefusals) {
  const int p = world().size();
  auto refused = [&](const TrainerConfig& config, const OffloadSettings& s, bool pipeline,
                     const std::vector<std::string>& needles, const std::string& what) {
    auto device = testing::make_device();
    auto engine = pipeline ? OffloadEngine::create(config, s, *device, nullptr, nullptr, nullptr, &world())
                           : OffloadEngine::create(config, s, *device);
    ASSERT_FALSE(engine.ok()) << what << ": created";
    const std::string msg = engine.status().to_string();
    for (const std::string& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << what << ": " << msg;
  };
  const TrainerConfig even = testing::tiny(ModelKind::kLlama, DType::kF32, 2 * p, 1.0);
  OffloadSettings s;
  s.pipeline_virtual_stages = 2;
  {
    OffloadSettings g = s;
    g.pipeline_schedule = PipelineSchedule::kGpipe;
    refused(even, g, true, {"strata.pipeline_virtual_stages = 2", "pipeline_schedule = gpipe", "1f1b"},
            "gpipe");
  }
  {
    const TrainerConfig odd = testing::tiny(ModelKind::kLlama, DType::kF32, p + 1, 1.0);
    refused(odd, s, true,
            {"strata.pipeline_virtual_stages = 2", "gradient_accumulation_steps = " + std::to_string(p + 1),
             "multiple of the " + std::to_string(p) + " stages"},
            "micro-batches not a multiple of the stages");
  }
  {
    // The tiny model has 5 modules (embedding, 3 blocks, head): 3 chunks per stage never fit.
    OffloadSettings many = s;
    many.pipeline_virtual_stages = 3;
    const TrainerConfig c = testing::tiny(ModelKind::kLlama, DType::kF32, 3 * p, 1.0);
    refused(c, many, true,
            {"strata.pipeline_virtual_stages = 3", std::to_string(3 * p) + " chunks", "5 modules"},
            "more chunks than modules");
  }
  refused(even, s, false, {"strata.pipeline_virtual_stages = 2", "pipeline_parallel_size > 1"},
          "no pipeline");
  {
    OffloadSettings zero = s;
    zero.pipeline_virtual_stages = 0;
    refused(even, zero, true, {"strata.pipeline_virtual_stages = 0", "at least 1"}, "zero chunks");
  }
  // Activation offload trains with interleaving (InterleavedActivationOffload), and so does
  // sequence parallelism (test_dist_grid's GridSequenceParallel.InterleavedLlama).
}

// Pipeline x data parallel against one process on the whole batch: the data-parallel sums run in
// another order (each rank's micro-batches, then across ranks), so within rounding, as in
// test_dist_data_parallel: each held quantity within 3e-4 of its largest value (measured max
// 2.4e-5, 3 steps, lr 1e-2; a missing reduction moves the parameters by about the learning
// rate), losses within 1e-5 and norms within 1e-4 relative.
void expect_within_rounding(const Snapshot& ref, const Snapshot& got, const std::string& what) {
  const std::vector<std::vector<float>>* r[] = {&ref.param, &ref.master, &ref.m, &ref.v};
  const std::vector<std::vector<float>>* g[] = {&got.param, &got.master, &got.m, &got.v};
  const char* names[] = {"parameters", "master weights", "exp_avg", "exp_avg_sq"};
  ASSERT_EQ(ref.param.size(), got.param.size()) << what;
  for (int k = 0; k < 4; ++k) {
    double worst = 0, scale = 0;
    for (std::size_t i = 0; i < r[k]->size(); ++i) {
      for (std::size_t e = 0; e < (*r[k])[i].size(); ++e) {
        worst = std::max(worst, std::fabs(static_cast<double>((*r[k])[i][e]) - (*g[k])[i][e]));
        scale = std::max(scale, std::fabs(static_cast<double>((*r[k])[i][e])));
      }
    }
    if (world().rank() == 0)
      std::printf("%s: %s max |difference| %.3g of %.3g\n", what.c_str(), names[k], worst, scale);
    EXPECT_LE(worst, kRelTolerance * scale) << what << ": " << names[k];
  }
  ASSERT_EQ(ref.losses.size(), got.losses.size()) << what;
  for (std::size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * std::fabs(ref.losses[i])) << what << ": loss " << i + 1;
    EXPECT_NEAR(got.norms[i], ref.norms[i], 1e-4 * std::fabs(ref.norms[i])) << what << ": norm " << i + 1;
  }
}

// Pipeline x data parallel on 4 ranks (make_process_groups: 2 stages x 2 data-parallel ranks,
// ranks {0,1} and {2,3} the pipelines, {0,2} and {1,3} the data-parallel groups): each pipeline
// trains its share of the global batch (global micro-batches d, d + 2, ...), against one process
// on the whole batch. The data-parallel sums run in another order (each rank's micro-batches,
// then across ranks), so within rounding, as in test_dist_data_parallel: measured max 2.4e-5 of
// each quantity's scale (3 steps, lr 1e-2); held to 3e-4. A missing reduction moves the
// parameters by about the learning rate.
TEST(PipelineEngine, ComposedWithDataParallel) {
  ASSERT_EQ(world().size(), 4) << "runs on 4 ranks (2 stages x 2 data-parallel ranks; tests/CMakeLists.txt filters it elsewhere)";
  auto groups = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, 1, 2);
  ASSERT_TRUE(groups.ok()) << groups.status().to_string();
  const int DP = groups->grid.dp(), d = groups->coord.dp;
  ASSERT_EQ(DP, 2);
  struct Composed {
    ModelKind kind;
    Tier optimizer;
    int zero_stage;
    Tier params = Tier::kDevice;
  };
  // Stage 3 with the parameters on the host: each stage's modules are partitioned over its
  // data-parallel group and every fetch all-gathers them (the tied embedding's copy on the last
  // stage too).
  for (const Composed& c :
       {Composed{ModelKind::kGpt2, Tier::kDevice, 0}, Composed{ModelKind::kGpt2, Tier::kHost, 1},
        Composed{ModelKind::kLlama, Tier::kHost, 2}, Composed{ModelKind::kGpt2, Tier::kHost, 3, Tier::kHost}}) {
    const std::string what = std::string(to_string(c.kind)) + " params=" + std::string(to_string(c.params)) +
                             " optimizer=" + std::string(to_string(c.optimizer)) + " stage " +
                             std::to_string(c.zero_stage) + ", 2 stages x 2 data-parallel ranks";
    const TrainerConfig global = testing::tiny(c.kind, DType::kF32, 2 * DP, 1.0);
    TrainerConfig local = global;
    local.grad_accum = 2;
    OffloadSettings s;
    s.optimizer = c.optimizer;
    s.params = c.params;
    s.zero_stage = c.zero_stage;
    s.persistence_threshold = 0;
    constexpr int kSteps = 3;
    Snapshot got, ref;
    std::vector<int> held;
    {
      auto device = testing::make_device();
      auto engine = OffloadEngine::create(local, s, *device, nullptr, groups->dp.get(), nullptr, groups->pp.get());
      ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
      std::vector<std::int32_t> gin, gtg, in, tg;
      const std::size_t per = static_cast<std::size_t>(global.micro_batch * global.seq_len);
      for (int step = 0; step < kSteps; ++step) {
        testing::batch(global, step, gin, gtg);
        in.clear();
        tg.clear();
        for (std::size_t i = static_cast<std::size_t>(d); i < static_cast<std::size_t>(global.grad_accum);
             i += DP) {
          in.insert(in.end(), gin.begin() + static_cast<std::ptrdiff_t>(i * per),
                    gin.begin() + static_cast<std::ptrdiff_t>((i + 1) * per));
          tg.insert(tg.end(), gtg.begin() + static_cast<std::ptrdiff_t>(i * per),
                    gtg.begin() + static_cast<std::ptrdiff_t>((i + 1) * per));
        }
        auto m = (*engine)->step(in, tg);
        ASSERT_TRUE(m.ok()) << what << ": " << m.status().to_string();
        got.losses.push_back(m->loss);
        got.norms.push_back(m->grad_norm);
      }
      ASSERT_TRUE(capture_stage(**engine, got, held)) << what;
    }
    {
      auto device = testing::make_device();
      OffloadSettings rs = s;
      rs.zero_stage = 0;
      auto engine = OffloadEngine::create(global, rs, *device);
      ASSERT_TRUE(engine.ok()) << engine.status().to_string();
      ASSERT_TRUE(testing::run_steps(**engine, global, 0, kSteps, ref)) << what;
      ASSERT_TRUE(testing::capture_held(**engine, held, ref)) << what;
    }
    expect_within_rounding(ref, got, what);
  }
}

// A checkpoint of 2 stages x 2 data-parallel pipelines on 4 ranks (the sharded optimizer state
// and, ZeRO 3, the partitioned parameters gathered per stage, then sent to the writer): resumed
// in the same shape bit for bit; loaded into one process, the very state each stage held at the
// save (bit for bit), and the same weights file.
TEST(PipelineEngine, CheckpointWithDataParallel) {
  ASSERT_EQ(world().size(), 4)
      << "runs on 4 ranks (2 stages x 2 data-parallel ranks; tests/CMakeLists.txt filters it elsewhere)";
  auto groups = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, 1, 2);
  ASSERT_TRUE(groups.ok()) << groups.status().to_string();
  const int DP = groups->grid.dp(), d = groups->coord.dp;
  struct Composed {
    ModelKind kind;
    Tier optimizer;
    int zero_stage;
    Tier params;
  };
  for (const Composed& c : {Composed{ModelKind::kGpt2, Tier::kHost, 3, Tier::kHost},
                            Composed{ModelKind::kLlama, Tier::kDevice, 0, Tier::kDevice}}) {
    const std::string what = std::string(to_string(c.kind)) + " ZeRO " + std::to_string(c.zero_stage) +
                             ", 2 stages x 2 data-parallel ranks (checkpoint, weights)";
    const TrainerConfig global = testing::tiny(c.kind, DType::kF32, 2 * DP, 1.0);
    TrainerConfig local = global;
    local.grad_accum = 2;
    OffloadSettings s;
    s.optimizer = c.optimizer;
    s.params = c.params;
    s.zero_stage = c.zero_stage;
    s.persistence_threshold = 0;
    const std::string root = testing::shared_temp_dir("ppdp-state");
    const std::string pp_weights = root + "/pp.safetensors";
    auto create = [&](std::unique_ptr<Device>& device) {
      device = testing::make_device();
      return OffloadEngine::create(local, s, *device, nullptr, groups->dp.get(), nullptr, groups->pp.get());
    };
    Snapshot straight, at_save;
    std::vector<int> held;
    std::string dir;
    {
      std::unique_ptr<Device> device;
      auto engine = create(device);
      ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
      ASSERT_TRUE(testing::run_share(**engine, global, d, DP, 2, straight)) << what;
      auto saved = (*engine)->save_checkpoint(root + "/ck", "{}", 2);
      ASSERT_TRUE(saved.ok()) << what << ": " << saved.status().to_string();
      dir = *saved;
      ASSERT_TRUE((*engine)->save_weights(pp_weights).ok()) << what;
      ASSERT_TRUE(capture_stage(**engine, at_save, held)) << what;
      ASSERT_TRUE(testing::run_share(**engine, global, d, DP, 4, straight, 2)) << what;
      std::vector<int> again;
      ASSERT_TRUE(capture_stage(**engine, straight, again)) << what;
    }
    {
      std::unique_ptr<Device> device;
      auto engine = create(device);
      ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
      auto m = (*engine)->load_checkpoint(dir);
      ASSERT_TRUE(m.ok()) << what << ": " << m.status().to_string();
      Snapshot resumed;
      resumed.losses = {straight.losses[0], straight.losses[1]};
      resumed.norms = {straight.norms[0], straight.norms[1]};
      ASSERT_TRUE(testing::run_share(**engine, global, d, DP, 4, resumed, 2)) << what;
      std::vector<int> again;
      ASSERT_TRUE(capture_stage(**engine, resumed, again)) << what;
      // run_share records no loss scales: compare losses, norms and state.
      resumed.scales = straight.scales = std::vector<double>(4, 1.0);
      resumed.skipped = straight.skipped = std::vector<int>(4, 0);
      testing::expect_same(straight, resumed, what + ": resumed in the same shape");
    }
    {
      // One process (on every rank): the state this rank's stage held at the save.
      auto device = testing::make_device();
      auto engine = OffloadEngine::create(global, OffloadSettings{}, *device);
      ASSERT_TRUE(engine.ok()) << engine.status().to_string();
      ASSERT_TRUE((*engine)->load_checkpoint(dir).ok()) << what;
      Snapshot single;
      ASSERT_TRUE(testing::capture_held(**engine, held, single)) << what;
      single.losses = at_save.losses = {0.0};
      single.norms = at_save.norms = {0.0};
      single.scales = at_save.scales = {1.0};
      single.skipped = at_save.skipped = {0};
      testing::expect_same(at_save, single, what + ": one process from the pipelines' checkpoint");
      if (world().rank() == 0) {
        ASSERT_TRUE((*engine)->save_weights(root + "/one.safetensors").ok()) << what;
        EXPECT_FALSE(file_bytes(pp_weights).empty()) << what;
        EXPECT_TRUE(file_bytes(pp_weights) == file_bytes(root + "/one.safetensors"))
            << what << ": weights file";
      }
    }
    ASSERT_TRUE(world().barrier().wait().ok());
    if (world().rank() == 0) std::filesystem::remove_all(root);
  }
}

// Per parameter (index into the layout), a hash of the state the ranks holding it report (0 where
// none does); fails the test where two holders differ (the data-parallel ranks of a stage hold the
// same bits, and so do GPT-2's two wte copies). Collective over the world.
std::vector<std::uint64_t> held_state_hashes(const ModelLayout& L, const Snapshot& sn,
                                             const std::vector<int>& held, const std::string& what) {
  const std::size_t n = L.params.size();
  std::vector<std::uint64_t> mine(n, 0);
  for (std::size_t i = 0; i < held.size(); ++i) {
    mine[static_cast<std::size_t>(held[i])] = fnv({sn.param[i], sn.master[i], sn.m[i], sn.v[i]}) | 1u;
  }
  std::vector<std::uint64_t> all(n * static_cast<std::size_t>(world().size()));
  EXPECT_TRUE(world().all_gather(mine.data(), all.data(), 2 * n, DType::kF32).wait().ok()) << what;
  std::vector<std::uint64_t> out(n, 0);
  for (int r = 0; r < world().size(); ++r) {
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t h = all[static_cast<std::size_t>(r) * n + i];
      if (h == 0) continue;
      if (out[i] != 0) {
        EXPECT_EQ(out[i], h) << what << ": " << L.params[i].name << " differs on rank " << r;
      }
      out[i] = h;
    }
  }
  return out;
}

// Interleaved 1F1B x data parallel on 4 ranks (2 stages x 2 pipelines, v = 2: the tiny model's 5
// modules in 4 chunks, stage 0 running chunks 0 and 2, stage 1 chunks 1 and 3). Nothing is new
// in the arithmetic: every unit is read by one chunk of one stage, whose backwards run in
// micro-batch order, and the data-parallel reduction of a unit is issued when its last
// micro-batch's backward releases it, on every rank of the stage in the same op order. So:
// - against plain 1F1B on the same grid (the same groups, batches and settings; only the
//   schedule and which stage holds a unit differ): losses, norms, and every parameter's working
//   copy, master and moments bit for bit (compared per parameter through a hash from the rank
//   holding it, as the stages hold different units in the two runs);
// - against one process on the whole batch, within the data-parallel rounding
//   (expect_within_rounding).
// m = 2 per pipeline is one group of p micro-batches (every forward first), m = 4 two (warm-up,
// steady state, cool-down). ZeRO 0 with the optimizer on the device, 1 and 2 with the host
// optimizer, 3 with the parameters partitioned on the host (every fetch all-gathers over dp).
// One case of interleaved 1F1B x data parallel (2 stages x 2 pipelines): the ZeRO stage, where
// the parameters, optimizer state and gradients live, and the micro-batches per pipeline.
struct InterleavedDp {
  ModelKind kind;
  Tier optimizer;
  int zero_stage;
  Tier params;
  std::int64_t micro;  // per pipeline
  Tier gradients = Tier::kHost;  // kNvme: with the NVMe optimizer
};

void check_interleaved_dp(const ProcessGroups& groups, const InterleavedDp& c) {
  const int DP = groups.grid.dp(), d = groups.coord.dp;
  const std::string what = std::string(to_string(c.kind)) + " params=" + std::string(to_string(c.params)) +
                           " optimizer=" + std::string(to_string(c.optimizer)) + " ZeRO " +
                           std::to_string(c.zero_stage) + " m=" + std::to_string(c.micro) +
                           (c.gradients == Tier::kNvme ? " gradients=nvme" : "") +
                           ", interleaved v=2 on 2 stages x 2 data-parallel ranks";
  const TrainerConfig global = testing::tiny(c.kind, DType::kF32, c.micro * DP, 1.0);
  TrainerConfig local = global;
  local.grad_accum = c.micro;
  constexpr int kSteps = 3;
  const ModelLayout layout = *describe_model(global.model);
  const bool nvme = c.params == Tier::kNvme || c.optimizer == Tier::kNvme;
  auto settings = [&](const testing::TempDir& swap) {
    OffloadSettings s;
    s.optimizer = c.optimizer;
    s.params = c.params;
    s.gradients = c.gradients;
    s.persistence_threshold = 0;
    if (nvme) s.nvme_path = {swap.path().string()};
    return s;
  };
  testing::TempDir swap_inter("strata-pp-swap"), swap_plain("strata-pp-swap"), swap_one("strata-pp-swap");
  auto train = [&](int v, const testing::TempDir& swap, Snapshot& out, std::vector<int>& held) {
    OffloadSettings s = settings(swap);
    s.zero_stage = c.zero_stage;
    s.pipeline_virtual_stages = v;
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(local, s, *device, nullptr, groups.dp.get(), nullptr, groups.pp.get());
    ASSERT_TRUE(engine.ok()) << what << " v=" << v << ": " << engine.status().to_string();
    ASSERT_TRUE(testing::run_share(**engine, global, d, DP, kSteps, out)) << what << " v=" << v;
    ASSERT_TRUE(capture_stage(**engine, out, held)) << what << " v=" << v;
  };
  Snapshot inter, plain, ref;
  std::vector<int> held_inter, held_plain;
  train(2, swap_inter, inter, held_inter);
  train(1, swap_plain, plain, held_plain);
  ASSERT_FALSE(::testing::Test::HasFatalFailure()) << what;
  EXPECT_NE(held_inter, held_plain) << what << ": the two schedules' stages hold the same units";
  EXPECT_EQ(inter.losses, plain.losses) << what << ": losses, interleaved against 1F1B";
  EXPECT_EQ(inter.norms, plain.norms) << what << ": norms, interleaved against 1F1B";
  const auto hi = held_state_hashes(layout, inter, held_inter, what + " (interleaved)");
  const auto hp = held_state_hashes(layout, plain, held_plain, what + " (1F1B)");
  for (std::size_t i = 0; i < layout.params.size(); ++i) {
    if (!layout.params[i].owns_storage()) continue;
    EXPECT_NE(hi[i], 0u) << what << ": no rank holds " << layout.params[i].name;
    EXPECT_EQ(hi[i], hp[i]) << what << ": " << layout.params[i].name << ", interleaved against 1F1B";
  }
  {
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(global, settings(swap_one), *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    ASSERT_TRUE(testing::run_steps(**engine, global, 0, kSteps, ref)) << what;
    ASSERT_TRUE(testing::capture_held(**engine, held_inter, ref)) << what;
  }
  expect_within_rounding(ref, inter, what + ": against one process");
}

TEST(PipelineEngine, InterleavedWithDataParallel) {
  ASSERT_EQ(world().size(), 4)
      << "runs on 4 ranks (2 stages x 2 data-parallel ranks; tests/CMakeLists.txt filters it elsewhere)";
  auto groups = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, 1, 2);
  ASSERT_TRUE(groups.ok()) << groups.status().to_string();
  ASSERT_EQ(groups->grid.dp(), 2);
  for (const InterleavedDp& c : {InterleavedDp{ModelKind::kGpt2, Tier::kDevice, 0, Tier::kDevice, 4},
                                 InterleavedDp{ModelKind::kGpt2, Tier::kHost, 1, Tier::kDevice, 2},
                                 InterleavedDp{ModelKind::kLlama, Tier::kHost, 2, Tier::kDevice, 4},
                                 InterleavedDp{ModelKind::kGpt2, Tier::kHost, 3, Tier::kHost, 2}}) {
    check_interleaved_dp(*groups, c);
  }
}

// The same with the gradients on NVMe (the NVMe optimizer; InterleavedNvmeGradients on 2 stages
// without data parallelism): each stage's units land their gradients on NVMe through the staging
// buffer whichever chunk's backward issues them, ZeRO 1 reduces each unit once its last
// micro-batch's backward released it, ZeRO 2 reduce-scatters after each micro-batch; GPT-2's tied
// unit is read back and summed between the ends. m = 4 per pipeline (two groups: units restored
// between micro-batches while other chunks land theirs). Bit for bit against 1F1B on the same
// grid, within the data-parallel rounding against one process with its gradients on NVMe too.
TEST(PipelineEngine, InterleavedNvmeGradientsWithDataParallel) {
  ASSERT_EQ(world().size(), 4)
      << "runs on 4 ranks (2 stages x 2 data-parallel ranks; tests/CMakeLists.txt filters it elsewhere)";
  auto groups = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, 1, 2);
  ASSERT_TRUE(groups.ok()) << groups.status().to_string();
  ASSERT_EQ(groups->grid.dp(), 2);
  for (const InterleavedDp& c :
       {InterleavedDp{ModelKind::kGpt2, Tier::kNvme, 1, Tier::kDevice, 4, Tier::kNvme},
        InterleavedDp{ModelKind::kLlama, Tier::kNvme, 2, Tier::kDevice, 4, Tier::kNvme}}) {
    check_interleaved_dp(*groups, c);
  }
}

// Interleaved 1F1B with activation offload (checkpointing, cpu_checkpointing) on 2 stages, v = 2,
// 12 blocks (14 modules in 4 chunks of 3 or 4: chunks with more block inputs than the device ring
// holds). Each per-chunk activation slot keeps one ring, one set of pinned copies (sized for its
// largest chunk) and one bookkeeping, used by one chunk at a time. Only where the checkpointed
// inputs wait changes, so:
// - against plain 1F1B with activation offload on the same 2 ranks: losses, norms and every
//   parameter's working copy, master and moments bit for bit (per parameter through a hash from
//   the rank holding it: the stages hold different units), as interleaved against 1F1B without
//   offload (InterleavedWithDataParallel's argument: each unit accumulates in micro-batch order);
// - against interleaved without offload (checkpointing only): the same bits on every rank;
// - the traffic is exactly the ring's rule per chunk: each forward of a chunk with k > R block
//   inputs sends its first k - R inputs out and its backward brings them back.
TEST(PipelineEngine, InterleavedActivationOffload) {
  ASSERT_EQ(world().size(), 2) << "runs on 2 stages (tests/CMakeLists.txt filters it elsewhere)";
  for (ModelKind kind : {ModelKind::kLlama, ModelKind::kGpt2}) {
    constexpr std::int64_t kMicro = 4;
    constexpr int kSteps = 3;
    const std::string what = std::string(to_string(kind)) + " m=4, 12 blocks, checkpointing, interleaved v=2";
    TrainerConfig config = testing::tiny(kind, DType::kF32, kMicro, 1.0);
    config.model.n_layer = 12;
    config.model.activation_checkpointing = true;
    const ModelLayout layout = *describe_model(config.model);
    struct Run {
      Snapshot state;
      std::vector<int> held;
      std::uint64_t to_host = 0, to_device = 0;
    };
    auto train = [&](int v, bool offload, Run& r) {
      OffloadSettings s;
      s.optimizer = Tier::kHost;
      s.persistence_threshold = 0;
      s.pipeline_virtual_stages = v;
      s.offload_activations = offload;
      auto device = testing::make_device();
      auto engine = OffloadEngine::create(config, s, *device, nullptr, nullptr, nullptr, &world());
      ASSERT_TRUE(engine.ok()) << what << " v=" << v << ": " << engine.status().to_string();
      ASSERT_TRUE(testing::run_steps(**engine, config, 0, kSteps, r.state)) << what << " v=" << v;
      ASSERT_TRUE((*engine)->synchronize().ok()) << what;
      r.to_host = (*engine)->stats().bytes_activations_to_host;
      r.to_device = (*engine)->stats().bytes_activations_to_device;
      ASSERT_TRUE(capture_stage(**engine, r.state, r.held)) << what << " v=" << v;
    };
    Run inter, plain, kept;
    train(2, true, inter);
    train(1, true, plain);
    train(2, false, kept);
    ASSERT_FALSE(HasFatalFailure()) << what;
    // Against plain 1F1B with offload.
    EXPECT_NE(inter.held, plain.held) << what << ": the two schedules' stages hold the same units";
    EXPECT_EQ(inter.state.losses, plain.state.losses) << what << ": losses, interleaved against 1F1B";
    EXPECT_EQ(inter.state.norms, plain.state.norms) << what << ": norms, interleaved against 1F1B";
    const auto hi = held_state_hashes(layout, inter.state, inter.held, what + " (interleaved)");
    const auto hp = held_state_hashes(layout, plain.state, plain.held, what + " (1F1B)");
    for (std::size_t i = 0; i < layout.params.size(); ++i) {
      if (!layout.params[i].owns_storage()) continue;
      EXPECT_NE(hi[i], 0u) << what << ": no rank holds " << layout.params[i].name;
      EXPECT_EQ(hi[i], hp[i]) << what << ": " << layout.params[i].name << ", interleaved against 1F1B";
    }
    // Against interleaved without offload.
    EXPECT_EQ(inter.held, kept.held) << what;
    EXPECT_EQ(inter.state.losses, kept.state.losses) << what << ": losses, offload against none";
    EXPECT_EQ(inter.state.norms, kept.state.norms) << what << ": norms, offload against none";
    EXPECT_EQ(inter.state.param, kept.state.param) << what << ": parameters, offload against none";
    EXPECT_EQ(inter.state.master, kept.state.master) << what << ": masters, offload against none";
    EXPECT_EQ(inter.state.m, kept.state.m) << what << ": exp_avg, offload against none";
    EXPECT_EQ(inter.state.v, kept.state.v) << what << ": exp_avg_sq, offload against none";
    EXPECT_EQ(kept.to_host, 0u) << what;
    // The traffic: per chunk of this stage with k block inputs, k - R of them out and back per
    // micro-batch (R = the ring, min(3, the largest chunk's inputs)).
    auto bounds = pipeline_stages(config.model, 4, config.seq_len);
    ASSERT_TRUE(bounds.ok()) << bounds.status().to_string();
    const auto ranges = offload_detail::stage_ranges(*bounds, 2, world().rank());
    const std::int64_t L = config.model.n_layer;
    std::int64_t most = 0, evicted = 0;
    for (const auto& [b, e] : ranges)
      most = std::max(most, std::min<std::int64_t>(e - 1, L) - std::max(b - 1, 0) + 1);
    const std::int64_t R = std::min<std::int64_t>(Model::kActivationRing, most);
    for (const auto& [b, e] : ranges)
      evicted += std::max<std::int64_t>(0, std::min<std::int64_t>(e - 1, L) - std::max(b - 1, 0) + 1 - R);
    const std::uint64_t residual =
        static_cast<std::uint64_t>(config.micro_batch * config.seq_len * config.model.n_embd) * 4;
    const std::uint64_t want = static_cast<std::uint64_t>(evicted * kMicro * kSteps) * residual;
    EXPECT_EQ(inter.to_host, want) << what << ": bytes to the host on stage " << world().rank();
    EXPECT_EQ(inter.to_device, want) << what << ": bytes back on stage " << world().rank();
    std::vector<std::uint64_t> every(2);
    ASSERT_TRUE(world().all_gather(&want, every.data(), 2, DType::kF32).wait().ok());
    EXPECT_GT(every[0] + every[1], 0u) << what << ": no chunk has more block inputs than the ring";
  }
}

}  // namespace
}  // namespace strata
