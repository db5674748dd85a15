// `mpirun -np N strata train` against one process on the same global batch (label dist; one
// test process that starts the mpirun jobs itself, tests/CMakeLists.txt). The ranks' losses,
// per step, must match the single process within fp32 summation rounding (the data-parallel
// engine's own equivalence is checked more closely by test_dist_data_parallel), every rank must
// take part in checkpoints, and a rank's error must name the rank.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/harness.hpp"

namespace strata::testing {
namespace {

const std::string kTiny = "--layers 2 --width 32 --heads 2 --seq-len 32 --batch 2 --threads 1 --quiet ";

std::string mpirun(int np) {
  std::string cmd = "mpirun --oversubscribe -np " + std::to_string(np) + " ";
  if (::geteuid() == 0) cmd += "--allow-run-as-root ";
  return cmd + "-x STRATA_COMM_TIMEOUT=60 " + STRATA_CLI_PATH + " ";
}

std::vector<double> losses_of(const std::filesystem::path& metrics) {
  std::vector<double> out;
  for (const auto& j : read_jsonl(metrics)) out.push_back(j.at("loss").get<double>());
  return out;
}

void expect_same_losses(const std::vector<double>& ref, const std::vector<double>& got, const std::string& what) {
  ASSERT_EQ(ref.size(), got.size()) << what;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    EXPECT_NEAR(got[i], ref[i], 2e-4 * std::fabs(ref[i])) << what << ": loss of step " << i + 1;
  }
  EXPECT_LT(got.back(), got.front()) << what << ": the loss fell";
}

// The default placement (parameters on NVMe, optimizer on the host, sharded over the ranks).
TEST(DistCliTrain, TwoRanksTrainLikeOneProcessWithTwiceTheAccumulation) {
  TempDir dir("strata-dist-cli");
  const std::string flags = kTiny + "--steps 8 --val-every 0 --val-windows 4 ";
  auto one = run_cli("train " + flags + "--grad-accum 4 --metrics " + (dir / "one.jsonl").string());
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto two = run_command(mpirun(2) + "train " + flags + "--grad-accum 2 --out " + (dir / "run").string());
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_NE(two.output.find("2 data-parallel ranks"), std::string::npos) << two.output;
  // One rank speaks: the summary appears once.
  EXPECT_EQ(two.output.find("done:"), two.output.rfind("done:")) << two.output;
  expect_same_losses(losses_of(dir / "one.jsonl"), losses_of(dir / "run" / "metrics.jsonl"), "2 ranks, NVMe + host");
  EXPECT_TRUE(std::filesystem::exists(dir / "run" / "weights.safetensors"));
}

// Stage 0 with the optimizer on the device, and a config file, on 3 ranks.
TEST(DistCliTrain, ThreeRanksStageZeroFromAConfigFile) {
  TempDir dir("strata-dist-cli");
  const std::string config = write_file(dir / "ds.json", R"({
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 0}
  })");
  const std::string flags = kTiny + "--steps 6 --val-every 0 --val-windows 4 --config " + config + " ";
  auto one = run_cli("train " + flags + "--grad-accum 3 --metrics " + (dir / "one.jsonl").string());
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto three = run_command(mpirun(3) + "train " + flags + "--grad-accum 1 --metrics " + (dir / "three.jsonl").string());
  ASSERT_EQ(three.exit_code, 0) << three.output;
  EXPECT_NE(three.output.find("gradients all-reduced"), std::string::npos) << three.output;
  expect_same_losses(losses_of(dir / "one.jsonl"), losses_of(dir / "three.jsonl"), "3 ranks, stage 0");
}

// Stage 2 with the optimizer on the device (its state sharded in device memory) on 2 ranks.
TEST(DistCliTrain, TwoRanksStageTwoWithTheOptimizerOnTheDevice) {
  TempDir dir("strata-dist-cli");
  const std::string config = write_file(dir / "ds.json", R"({
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}}
  })");
  const std::string flags = kTiny + "--steps 6 --val-every 0 --val-windows 4 --config " + config + " ";
  auto one = run_cli("train " + flags + "--grad-accum 2 --metrics " + (dir / "one.jsonl").string());
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto two =
      run_command(mpirun(2) + "train " + flags + "--grad-accum 1 --metrics " + (dir / "two.jsonl").string());
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_NE(two.output.find("optimizer state sharded over the ranks in device memory"), std::string::npos)
      << two.output;
  EXPECT_NE(two.output.find("optim.exp_avg (this rank's 1/2)"), std::string::npos) << two.output;
  expect_same_losses(losses_of(dir / "one.jsonl"), losses_of(dir / "two.jsonl"),
                     "2 ranks, stage 2 on the device");
}

// Checkpoints are collective: a run resumed under mpirun continues the uninterrupted one bit
// for bit (the same ranks, the same order of every sum); resumed in one process with the same
// global batch it continues it within rounding.
TEST(DistCliTrain, CheckpointAndResumeUnderMpirun) {
  TempDir dir("strata-dist-cli");
  const std::string flags = kTiny + "--val-every 0 --val-windows 4 --steps 6 ";
  const std::string ck = (dir / "ck").string();
  auto straight = run_command(mpirun(2) + "train " + flags + "--grad-accum 1 --checkpoint-dir " + ck +
                              " --checkpoint-every 3 --metrics " + (dir / "straight.jsonl").string());
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  ASSERT_TRUE(std::filesystem::exists(dir / "ck" / "step-00000003" / "manifest.json"));
  auto resumed = run_command(mpirun(2) + "train " + flags + "--grad-accum 1 --resume " + ck + "/step-00000003 --metrics " +
                             (dir / "resumed.jsonl").string());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  auto single = run_cli("train " + flags + "--grad-accum 2 --resume " + ck + "/step-00000003 --metrics " +
                        (dir / "single.jsonl").string());
  ASSERT_EQ(single.exit_code, 0) << single.output;
  const std::vector<double> a = losses_of(dir / "straight.jsonl"), b = losses_of(dir / "resumed.jsonl"),
                            c = losses_of(dir / "single.jsonl");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 3u);
  ASSERT_EQ(c.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(a[3 + i], b[i]) << "step " << 4 + i << " resumed under mpirun";
    EXPECT_NEAR(a[3 + i], c[i], 2e-4 * a[3 + i]) << "step " << 4 + i << " resumed in one process";
  }
}

// Token files under mpirun: each data-parallel rank takes its own windows of the step's batch
// (micro-batch a x ranks + rank, as the text path), so 2 ranks train like one process with twice
// the accumulation; the checkpoint's window counter counts both ranks' windows, and the run
// resumed from it in one process continues within rounding.
TEST(DistCliTrain, TokenFilesOnTwoRanksTrainLikeOneProcess) {
  TempDir dir("strata-dist-cli");
  std::string text;
  for (int i = 0; i < 600; ++i) text += "a stone " + std::to_string(i % 11) + " falls in the river.\n";
  const std::string bin = (dir / "t.bin").string();
  ASSERT_EQ(run_cli("tokenize --tokenizer bytes --quiet --input " + write_file(dir / "t.txt", text) +
                    " --out " + bin)
                .exit_code,
            0);
  const std::string flags = kTiny + "--tokens " + bin + " --val-every 0 --steps 6 ";
  auto one = run_cli("train " + flags + "--grad-accum 2 --metrics " + (dir / "one.jsonl").string());
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const std::string ck = (dir / "ck").string();
  auto two = run_command(mpirun(2) + "train " + flags + "--grad-accum 1 --checkpoint-dir " + ck +
                         " --checkpoint-every 3 --metrics " + (dir / "two.jsonl").string());
  ASSERT_EQ(two.exit_code, 0) << two.output;
  expect_same_losses(losses_of(dir / "one.jsonl"), losses_of(dir / "two.jsonl"), "2 ranks on token files");
  const auto m = nlohmann::json::parse(read_file(dir / "ck" / "step-00000003" / "manifest.json"));
  const auto client = m["client_state"].is_string()
                          ? nlohmann::json::parse(m["client_state"].get<std::string>())
                          : m["client_state"];
  EXPECT_EQ(client["data_position"]["windows"].get<std::uint64_t>(), 12u) << "3 steps x 2 ranks x 2 windows";
  auto single = run_cli("train " + flags + "--grad-accum 2 --resume " + ck + "/step-00000003 --metrics " +
                        (dir / "single.jsonl").string());
  ASSERT_EQ(single.exit_code, 0) << single.output;
  const auto a = losses_of(dir / "two.jsonl"), c = losses_of(dir / "single.jsonl");
  ASSERT_EQ(c.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_NEAR(a[3 + i], c[i], 2e-4 * a[3 + i]) << "step " << 4 + i;
}
// DeepSpeed's train_batch_size is global: micro batch x accumulation x ranks. A config written
// for two ranks (all three keys) is refused by one process, naming the keys, and trains under
// mpirun; with the accumulation left out, each launch derives its own.
TEST(DistCliTrain, TrainBatchSizeCountsTheRanks) {
  TempDir dir("strata-dist-cli");
  const std::string both = write_file(dir / "both.json", R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2})");
  const std::string flags = kTiny + "--steps 4 --val-every 0 --val-windows 4 ";
  auto one = run_cli("train " + flags + "--config " + both);
  EXPECT_EQ(one.exit_code, 1) << one.output;
  EXPECT_NE(one.output.find("train_batch_size (8) != train_micro_batch_size_per_gpu (2) * gradient_accumulation_steps (2) "
                            "* data-parallel size (1)"),
            std::string::npos)
      << one.output;
  auto two = run_command(mpirun(2) + "train " + flags + "--config " + both + " --metrics " + (dir / "two.jsonl").string());
  ASSERT_EQ(two.exit_code, 0) << two.output;
  const std::string derive = write_file(dir / "derive.json", R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2})");
  auto single = run_cli("train " + flags + "--config " + derive + " --metrics " + (dir / "one.jsonl").string());
  ASSERT_EQ(single.exit_code, 0) << single.output;
  EXPECT_NE(single.output.find("batch 2 x accum 4"), std::string::npos) << single.output;
  auto pair = run_command(mpirun(2) + "train " + flags + "--config " + derive);
  ASSERT_EQ(pair.exit_code, 0) << pair.output;
  EXPECT_NE(pair.output.find("batch 2 x accum 2"), std::string::npos) << pair.output;
  expect_same_losses(losses_of(dir / "one.jsonl"), losses_of(dir / "two.jsonl"), "train_batch_size 8 on 1 and 2 ranks");
}

// Pipeline parallel from the config's Strata keys: 2 stages (1F1B) and 3 stages (GPipe) train
// like one process on the same batch (the tied embedding's gradient sums in another order, so
// within rounding); rank 0 prints the last stage's loss. Bad values name the key.
TEST(DistCliTrain, PipelineStagesTrainLikeOneProcess) {
  TempDir dir("strata-dist-cli");
  const std::string flags = kTiny + "--steps 5 --val-every 0 --val-windows 4 --grad-accum 3 ";
  auto one = run_cli("train " + flags + "--metrics " + (dir / "one.jsonl").string());
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const std::string two_cfg = write_file(dir / "pp2.json", R"({"strata": {"pipeline_parallel_size": 2}})");
  auto two = run_command(mpirun(2) + "train " + flags + "--config " + two_cfg + " --metrics " +
                         (dir / "two.jsonl").string());
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_NE(two.output.find("2 pipeline stages (1f1b schedule)"), std::string::npos) << two.output;
  EXPECT_EQ(two.output.find("done:"), two.output.rfind("done:")) << two.output;
  expect_same_losses(losses_of(dir / "one.jsonl"), losses_of(dir / "two.jsonl"), "2 pipeline stages");
  const std::string three_cfg = write_file(
      dir / "pp3.json", R"({"strata": {"pipeline_parallel_size": 3, "pipeline_schedule": "gpipe"}})");
  auto three = run_command(mpirun(3) + "train " + flags + "--config " + three_cfg + " --metrics " +
                           (dir / "three.jsonl").string());
  ASSERT_EQ(three.exit_code, 0) << three.output;
  EXPECT_NE(three.output.find("3 pipeline stages (gpipe schedule)"), std::string::npos) << three.output;
  expect_same_losses(losses_of(dir / "one.jsonl"), losses_of(dir / "three.jsonl"), "3 pipeline stages");

  // 2 stages x 2 data-parallel pipelines on 4 ranks, each pipeline half of the global batch.
  auto single4 = run_cli("train " + kTiny + "--steps 5 --val-every 0 --val-windows 4 --grad-accum 4 --metrics " +
                         (dir / "one4.jsonl").string());
  ASSERT_EQ(single4.exit_code, 0) << single4.output;
  auto four = run_command(mpirun(4) + "train " + kTiny + "--steps 5 --val-every 0 --val-windows 4 --grad-accum 2 " +
                          "--config " + two_cfg + " --metrics " + (dir / "four.jsonl").string());
  ASSERT_EQ(four.exit_code, 0) << four.output;
  EXPECT_NE(four.output.find("2 pipeline(s) of data parallel"), std::string::npos) << four.output;
  expect_same_losses(losses_of(dir / "one4.jsonl"), losses_of(dir / "four.jsonl"), "2 stages x 2 pipelines");

  const std::string bad_schedule =
      write_file(dir / "bad.json", R"({"strata": {"pipeline_parallel_size": 2, "pipeline_schedule": "zigzag"}})");
  auto bad = run_command(mpirun(2) + "train " + flags + "--config " + bad_schedule);
  EXPECT_NE(bad.exit_code, 0) << bad.output;
  EXPECT_NE(bad.output.find("strata.pipeline_schedule"), std::string::npos) << bad.output;
  EXPECT_NE(bad.output.find("'zigzag'"), std::string::npos) << bad.output;
  auto mismatch = run_command(mpirun(2) + "train " + flags + "--config " + three_cfg);
  EXPECT_NE(mismatch.exit_code, 0) << mismatch.output;
  EXPECT_NE(mismatch.output.find("pipeline_parallel_size = 3 with 2 process(es)"), std::string::npos)
      << mismatch.output;
}

// Interleaved 1F1B from the config (strata.pipeline_virtual_stages 2 on 2 stages: the tiny
// model's 4 modules are 4 chunks, stage 0 runs the embedding and the second block, stage 1 the
// first block and the head) trains like one process on the same batch (within the tied
// embedding's rounding, as 1F1B), also as 2 data-parallel pipelines on 4 ranks; --plan names
// each stage's chunks and its per-chunk activation slots; bad values name the key.
TEST(DistCliTrain, InterleavedPipelineTrainsLikeOneProcess) {
  TempDir dir("strata-dist-cli");
  const std::string flags = kTiny + "--steps 4 --val-every 0 --val-windows 4 --grad-accum 4 ";
  auto one = run_cli("train " + flags + "--metrics " + (dir / "one.jsonl").string());
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const std::string cfg = write_file(
      dir / "v2.json", R"({"strata": {"pipeline_parallel_size": 2, "pipeline_virtual_stages": 2}})");
  auto two = run_command(mpirun(2) + "train " + flags + "--config " + cfg + " --metrics " +
                         (dir / "two.jsonl").string());
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_NE(two.output.find(
                "2 pipeline stages (interleaved 1f1b schedule, 2 chunks per stage), chunks 0-0 1-1 2-2 3-3"),
            std::string::npos)
      << two.output;
  expect_same_losses(losses_of(dir / "one.jsonl"), losses_of(dir / "two.jsonl"), "2 stages x 2 chunks");
  // With data parallelism: 2 stages x 2 chunks x 2 pipelines on 4 ranks, each pipeline half of the
  // global batch (2 micro-batches: one group per step).
  auto four =
      run_command(mpirun(4) + "train " + kTiny + "--steps 4 --val-every 0 --val-windows 4 --grad-accum 2 " +
                  "--config " + cfg + " --metrics " + (dir / "four.jsonl").string());
  ASSERT_EQ(four.exit_code, 0) << four.output;
  EXPECT_NE(four.output.find("2 pipeline(s) of data parallel"), std::string::npos) << four.output;
  expect_same_losses(losses_of(dir / "one.jsonl"), losses_of(dir / "four.jsonl"),
                     "2 stages x 2 chunks x 2 pipelines");
  auto plan = run_command(mpirun(2) + "train " + flags + "--config " + cfg + " --plan");
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  EXPECT_NE(plan.output.find(
                "pipeline stage 0 of 2 (modules 0-0, 2-2, interleaved 1f1b schedule, 2 chunks per stage"),
            std::string::npos)
      << plan.output;
  EXPECT_NE(plan.output.find("pipeline stage 1 of 2 (modules 1-1, 3-3"), std::string::npos) << plan.output;
  EXPECT_NE(plan.output.find("carved per (micro-batch, chunk)"), std::string::npos) << plan.output;
  // m = 3 is not a multiple of the 2 stages.
  auto odd =
      run_command(mpirun(2) + "train " + kTiny + "--steps 1 --val-every 0 --grad-accum 3 --config " + cfg);
  EXPECT_NE(odd.exit_code, 0) << odd.output;
  EXPECT_NE(odd.output.find("strata.pipeline_virtual_stages = 2"), std::string::npos) << odd.output;
  EXPECT_NE(odd.output.find("gradient_accumulation_steps = 3"), std::string::npos) << odd.output;
  // Without a pipeline, and below 1.
  const std::string alone = write_file(dir / "alone.json", R"({"strata": {"pipeline_virtual_stages": 2}})");
  auto no_pp = run_cli("train " + flags + "--config " + alone);
  EXPECT_NE(no_pp.exit_code, 0) << no_pp.output;
  EXPECT_NE(no_pp.output.find("pipeline_virtual_stages = 2"), std::string::npos) << no_pp.output;
  EXPECT_NE(no_pp.output.find("pipeline_parallel_size > 1"), std::string::npos) << no_pp.output;
  const std::string zero = write_file(
      dir / "zero.json", R"({"strata": {"pipeline_parallel_size": 2, "pipeline_virtual_stages": 0}})");
  auto bad = run_command(mpirun(2) + "train " + flags + "--config " + zero);
  EXPECT_NE(bad.exit_code, 0) << bad.output;
  EXPECT_NE(bad.output.find("pipeline_virtual_stages = 0"), std::string::npos) << bad.output;
}

// A pipeline's run is as usable as one process's: with one micro-batch per step (the tied
// embedding's two gradients add once, so the stages' sums are the single process's) 2 stages
// train, validate and write their --out weights bit for bit as one process does; a checkpoint
// of the pipeline resumes under mpirun bit for bit and writes the same weights; --plan prints
// every stage's plan.
TEST(DistCliTrain, PipelineCheckpointsWeightsValidationAndPlan) {
  TempDir dir("strata-dist-cli");
  const std::string flags = kTiny + "--steps 4 --val-every 0 --val-windows 4 --grad-accum 1 ";
  const std::string cfg = write_file(dir / "pp2.json", R"({"strata": {"pipeline_parallel_size": 2}})");
  auto one = run_cli("train " + flags + "--out " + (dir / "one").string());
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const std::string ck = (dir / "ck").string();
  auto straight = run_command(mpirun(2) + "train " + flags + "--config " + cfg + " --checkpoint-dir " + ck +
                              " --checkpoint-every 2 --out " + (dir / "pp").string());
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  ASSERT_TRUE(std::filesystem::exists(dir / "ck" / "step-00000002" / "manifest.json")) << straight.output;
  auto resumed = run_command(mpirun(2) + "train " + flags + "--config " + cfg + " --resume " + ck +
                             "/step-00000002 --out " + (dir / "resumed").string());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const std::vector<double> a = losses_of(dir / "one" / "metrics.jsonl"),
                            b = losses_of(dir / "pp" / "metrics.jsonl"),
                            c = losses_of(dir / "resumed" / "metrics.jsonl");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  ASSERT_EQ(c.size(), 2u);
  for (std::size_t i = 0; i < 4; ++i)
    EXPECT_EQ(a[i], b[i]) << "step " << i + 1 << ": 2 stages against one process";
  for (std::size_t i = 0; i < 2; ++i)
    EXPECT_EQ(b[2 + i], c[i]) << "step " << i + 3 << " resumed under mpirun";
  const std::string weights = read_file(dir / "one" / "weights.safetensors");
  EXPECT_FALSE(weights.empty());
  EXPECT_TRUE(weights == read_file(dir / "pp" / "weights.safetensors")) << "the pipeline's --out weights";
  EXPECT_TRUE(weights == read_file(dir / "resumed" / "weights.safetensors"))
      << "the resumed pipeline's weights";
  // Validation at the end: the last stage's loss, the single process's.
  const auto one_run = nlohmann::json::parse(read_file(dir / "one" / "run.json"));
  const auto pp_run = nlohmann::json::parse(read_file(dir / "pp" / "run.json"));
  ASSERT_TRUE(one_run.at("summary").contains("val_loss")) << one.output;
  ASSERT_TRUE(pp_run.at("summary").contains("val_loss")) << straight.output;
  EXPECT_EQ(one_run["summary"]["val_loss"].get<double>(), pp_run["summary"]["val_loss"].get<double>());
  EXPECT_NE(straight.output.find("validation loss"), std::string::npos) << straight.output;

  auto plan = run_command(mpirun(2) + "train " + flags + "--config " + cfg + " --plan");
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  EXPECT_NE(plan.output.find("pipeline stage 0 of 2 (modules 0-"), std::string::npos) << plan.output;
  EXPECT_NE(plan.output.find("pipeline stage 1 of 2 (modules "), std::string::npos) << plan.output;
  // One plan per stage, printed once (by rank 0).
  std::size_t plans = 0;
  for (auto at = plan.output.find("memory plan:"); at != std::string::npos;
       at = plan.output.find("memory plan:", at + 1))
    ++plans;
  EXPECT_EQ(plans, 2u) << plan.output;
}

// ZeRO-Infinity's placement: parameters partitioned over the ranks and kept on NVMe, each rank
// in its own directory under --nvme-path, the optimizer sharded on the host.
TEST(DistCliTrain, StageThreeWithParametersOnNvme) {
  TempDir dir("strata-dist-cli");
  std::filesystem::create_directories(dir / "swap");
  const std::string config = write_file(dir / "ds.json", R"({
    "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": ")" + (dir / "swap").string() +
                                                             R"("}, "offload_optimizer": {"device": "cpu"},
                          "stage3_param_persistence_threshold": 0}
  })");
  const std::string flags = kTiny + "--steps 5 --val-every 0 --val-windows 4 --config " + config + " ";
  auto one = run_cli("train " + flags + "--grad-accum 2 --metrics " + (dir / "one.jsonl").string());
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto two = run_command(mpirun(2) + "train " + flags + "--grad-accum 1 --metrics " + (dir / "two.jsonl").string());
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_NE(two.output.find("ZeRO stage 3"), std::string::npos) << two.output;
  EXPECT_TRUE(std::filesystem::exists(dir / "swap" / "rank-0")) << "each rank swaps in its own directory";
  EXPECT_TRUE(std::filesystem::exists(dir / "swap" / "rank-1"));
  expect_same_losses(losses_of(dir / "one.jsonl"), losses_of(dir / "two.jsonl"), "2 ranks, stage 3 on NVMe");
}

// A total of the plan's "total:" line in bytes ("device", "host", "pinned"), from the printed
// figure (2 decimals of its unit: within 0.5% of the exact bytes); -1 when it is missing.
double plan_total(const std::string& output, const std::string& tier) {
  const auto line = output.find("total: device ");
  if (line == std::string::npos) return -1;
  const auto at = output.find(tier + " ", line);
  if (at == std::string::npos || at > output.find('\n', line)) return -1;
  double value = 0;
  char unit[8] = {0};
  if (std::sscanf(output.c_str() + at + tier.size() + 1, "%lf %7[A-Za-z]", &value, unit) != 2) return -1;
  const std::string u = unit;
  const double scale = u == "B"     ? 1
                       : u == "KiB" ? 1024.0
                       : u == "MiB" ? 1048576.0
                       : u == "GiB" ? 1073741824.0
                                    : -1;
  return scale < 0 ? -1 : value * scale;
}

// The plan block of an output: from "memory plan:" to the end of its modules line.
std::string plan_block(const std::string& output) {
  const auto begin = output.find("memory plan:");
  if (begin == std::string::npos) return "";
  const auto modules = output.find("modules' working parameters:", begin);
  if (modules == std::string::npos) return "";
  return output.substr(begin, output.find('\n', modules) - begin);
}

// strata train's plan under mpirun is the rank's (the engine's own, made with the data-parallel
// size): with ZeRO 1 and the optimizer on the host, --plan on 2 ranks prints the sharded lines
// and fewer host bytes per rank than one process's plan, and the plan a 2-rank run prints (the
// engine's) is the same text. With the optimizer on the device (stage 1 shards its state in
// device memory), a device budget between the rank's need and one process's is refused by one
// process and trains on 2 ranks: the CLI sizes and checks the device by the rank's plan.
TEST(DistCliTrain, PlanUnderMpirunIsTheRanksShardedPlan) {
  TempDir dir("strata-dist-cli");
  const std::string host = write_file(dir / "host.json", R"({
    "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "none"}}
  })");
  const std::string flags = kTiny + "--steps 1 --val-every 0 --val-windows 4 --grad-accum 1 ";
  auto one = run_cli("train " + flags + "--config " + host + " --plan");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_EQ(one.output.find("this rank's 1/"), std::string::npos) << one.output;
  auto two = run_command(mpirun(2) + "train " + flags + "--config " + host + " --plan");
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_NE(two.output.find("data parallel: 2 ranks; the plan of each rank:"), std::string::npos)
      << two.output;
  EXPECT_NE(two.output.find("fp32 master weights (this rank's 1/2)"), std::string::npos) << two.output;
  EXPECT_NE(two.output.find("Adam exp_avg_sq (this rank's 1/2)"), std::string::npos) << two.output;
  const double one_host = plan_total(one.output, "host") + plan_total(one.output, "pinned");
  const double two_host = plan_total(two.output, "host") + plan_total(two.output, "pinned");
  ASSERT_GT(plan_total(one.output, "host"), 0) << one.output;
  ASSERT_GE(plan_total(two.output, "pinned"), 0) << two.output;
  EXPECT_LT(two_host, 0.9 * one_host) << "per-rank host bytes against one process's\n"
                                      << one.output << two.output;
  // The run prints the engine's plan: the same as --plan's.
  auto run = run_command(mpirun(2) + "train " + flags + "--config " + host);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_FALSE(plan_block(run.output).empty()) << run.output;
  EXPECT_EQ(plan_block(run.output), plan_block(two.output));

  // Twelve layers: the sharded state saves more than the data-parallel staging costs (with two
  // layers the staging outweighs it).
  const std::string deep =
      "--layers 12 --width 64 --heads 2 --seq-len 16 --batch 1 --threads 1 --quiet --steps 1 --val-every 0 "
      "--val-windows 4 --grad-accum 1 ";
  const std::string dev = write_file(dir / "device.json", R"({
    "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}}
  })");
  auto dev_one = run_cli("train " + deep + "--config " + dev + " --plan");
  ASSERT_EQ(dev_one.exit_code, 0) << dev_one.output;
  auto dev_two = run_command(mpirun(2) + "train " + deep + "--config " + dev + " --plan");
  ASSERT_EQ(dev_two.exit_code, 0) << dev_two.output;
  EXPECT_NE(dev_two.output.find("optim.exp_avg (this rank's 1/2)"), std::string::npos) << dev_two.output;
  const double need_one = plan_total(dev_one.output, "device"),
               need_two = plan_total(dev_two.output, "device");
  ASSERT_GT(need_two, 0) << dev_two.output;
  // A gap well above the figures' rounding, so that the budget lies between the exact needs.
  ASSERT_LT(need_two, 0.9 * need_one) << dev_one.output << dev_two.output;
  const auto budget = static_cast<long long>((need_one + need_two) / 2);
  const std::string between = write_file(dir / "between.json", R"({
    "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}},
    "strata": {"device_memory": ")" + std::to_string(budget) + R"("}
  })");
  auto refused = run_cli("train " + deep + "--config " + between);
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_NE(refused.output.find("offload plan: the device needs"), std::string::npos) << refused.output;
  auto fits = run_command(mpirun(2) + "train " + deep + "--config " + between);
  EXPECT_EQ(fits.exit_code, 0) << "budget " << budget << " bytes\n" << fits.output;
}

// The device optimizer at ZeRO stage 3 against stage 2 under `mpirun -np np` with `strata` (a
// config's "strata" section, or empty): --plan at stage 3 prints each of `plan_lines` at least
// `copies` times (once per pipeline stage), and the two runs' losses are equal bit for bit (the
// same collectives' sums), fall, and the weights files are byte for byte the same (the slices
// gathered).
void expect_device_stage3_trains_as_stage2(const TempDir& dir, const std::string& tag, const std::string& strata,
                                           int np, int steps, const std::vector<std::string>& plan_lines,
                                           std::size_t copies, const std::string& what) {
  auto config = [&](int stage) {
    return write_file(dir / (tag + "stage" + std::to_string(stage) + ".json"),
                      "{" + strata + R"("zero_optimization": {"stage": )" + std::to_string(stage) +
                          R"(, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"},
                          "stage3_param_persistence_threshold": 0}})");
  };
  const std::string flags =
      kTiny + "--steps " + std::to_string(steps) + " --val-every 0 --val-windows 4 --grad-accum 2 ";
  auto plan = run_command(mpirun(np) + "train " + flags + "--config " + config(3) + " --plan");
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  for (const std::string& line : plan_lines) {
    std::size_t count = 0;
    for (std::size_t at = plan.output.find(line); at != std::string::npos; at = plan.output.find(line, at + 1))
      ++count;
    EXPECT_GE(count, copies) << what << ": " << line << "\n" << plan.output;
  }
  std::vector<double> losses[2];
  std::string weights[2];
  for (int stage : {2, 3}) {
    const std::filesystem::path out = dir / (tag + "run" + std::to_string(stage));
    auto run =
        run_command(mpirun(np) + "train " + flags + "--config " + config(stage) + " --out " + out.string());
    ASSERT_EQ(run.exit_code, 0) << run.output;
    losses[stage - 2] = losses_of(out / "metrics.jsonl");
    weights[stage - 2] = read_file(out / "weights.safetensors");
  }
  ASSERT_EQ(losses[0].size(), static_cast<std::size_t>(steps)) << what;
  EXPECT_EQ(losses[0], losses[1]) << what << ": stage 3 in device memory trains as stage 2, bit for bit";
  EXPECT_LT(losses[1].back(), losses[1].front()) << what;
  ASSERT_GT(weights[0].size(), 1000u) << what;
  EXPECT_TRUE(weights[0] == weights[1]) << what << ": stage 2 and stage 3 wrote different weights";
}

const std::string kStage3ParamsLine =
    "device region offload.params (this rank's 1/2 of the modules above stage3_param_persistence_threshold)";

// Stage 3 in device memory under mpirun (docs/parallel.md "Stage 3 in device memory"): --plan
// prints each rank's slices of the working parameters, the param slots and the fetch staging;
// the run trains with stage 2's losses bit for bit and writes the same weights file.
TEST(DistCliTrain, Stage3DeviceParamsPlanAndTrainingUnderMpirun) {
  TempDir dir("strata-dist-cli");
  expect_device_stage3_trains_as_stage2(
      dir, "", "", 2, 4,
      {kStage3ParamsLine, "device region offload.param_slots", "data-parallel parameter fetch staging (pinned)"}, 1,
      "dp 2");
}

// The same with tensor parallelism (docs/parallel.md "With tensor parallelism"): 4 ranks, tp 2 x
// dp 2. --plan prints each rank's slices of its tp shard (gradients at stage 2, and working
// parameters at stage 3) and the gradient buckets; stage 3 trains with stage 2's losses bit for
// bit and writes the same weights file (the shards gathered, then the slices).
TEST(DistCliTrain, DeviceStagesWithTensorParallelPlanAndTrainingUnderMpirun) {
  TempDir dir("strata-dist-cli");
  expect_device_stage3_trains_as_stage2(dir, "tp-", R"("strata": {"tensor_parallel_size": 2}, )", 4, 3,
                                        {kStage3ParamsLine, "device region offload.grads (this rank's 1/2)",
                                         "device region offload.grad_buckets", "device region offload.param_slots"},
                                        1, "tp 2 x dp 2");
}

// The device optimizer's stages 2-3 with a pipeline (pp 2 x dp 2 on 4 ranks): every stage's
// --plan prints its sliced gradient, bucket, parameter-slice and slot lines, and stage 3 trains
// as stage 2, bit for bit (losses and the weights file).
TEST(DistCliTrain, DeviceStagesWithPipelinePlanAndTrainingUnderMpirun) {
  TempDir dir("strata-dist-cli");
  expect_device_stage3_trains_as_stage2(dir, "pp-", R"("strata": {"pipeline_parallel_size": 2}, )", 4, 3,
                                        {kStage3ParamsLine, "device region offload.grads (this rank's 1/2)",
                                         "device region offload.grad_buckets", "device region offload.param_slots"},
                                        2, "pp 2 x dp 2");
}

// Gradients on NVMe train with data parallelism (each rank's reduced slice in its own swap
// directory); what the engine cannot do (fp16 with tensor parallelism: the collectives carry f32
// and bf16) is refused on every rank, naming the rank and the dtype.
TEST(DistCliTrain, UnsupportedPlacementIsRefusedNamingTheRank) {
  TempDir dir("strata-dist-cli");
  std::filesystem::create_directories(dir / "swap");
  auto ok = run_command(mpirun(2) + "train " + kTiny + "--steps 2 --offload-optimizer nvme --offload-gradients nvme " +
                        "--nvme-path " + (dir / "swap").string());
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  const std::string tp = write_file(dir / "tp.json",
                                    R"({"fp16": {"enabled": true}, "strata": {"tensor_parallel_size": 2}})");
  auto r = run_command(mpirun(2) + "train " + kTiny + "--steps 2 --offload-param none --config " + tp);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("rank 1: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("tensor parallel runs f32 or bf16 models"), std::string::npos) << r.output;
}

// Gradients on NVMe with tensor parallelism (refused before): 2 ranks of one tensor-parallel
// group train the batch of one process, each rank's shard's gradients under its own
// nvme_path/rank-r, with the losses of one process.
TEST(DistCliTrain, NvmeGradientsWithTensorParallelTrainLikeOneProcess) {
  TempDir dir("strata-dist-cli");
  std::filesystem::create_directories(dir / "swap-one");
  std::filesystem::create_directories(dir / "swap-tp");
  const std::string flags = kTiny + "--steps 3 --val-every 0 --grad-accum 2 --offload-optimizer nvme --offload-gradients nvme ";
  auto one = run_cli("train " + flags + "--nvme-path " + (dir / "swap-one").string() + " --metrics " +
                     (dir / "one.jsonl").string());
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const std::string tp = write_file(dir / "tp.json", R"({"strata": {"tensor_parallel_size": 2}})");
  auto two = run_command(mpirun(2) + "train " + flags + "--config " + tp + " --nvme-path " +
                         (dir / "swap-tp").string() + " --metrics " + (dir / "tp.jsonl").string());
  ASSERT_EQ(two.exit_code, 0) << two.output;
  expect_same_losses(losses_of(dir / "one.jsonl"), losses_of(dir / "tp.jsonl"), "tp 2, gradients on NVMe");
  EXPECT_TRUE(std::filesystem::exists(dir / "swap-tp" / "rank-1")) << "each rank its own swap directory";
}

// Starts `command` in the background, waits until `metrics` has `lines` lines (the run is
// training), runs `then` (a shell command that may use $pid, the background job), waits for the
// job and prints "exit=<status> seconds=<time from `then` to the end>".
std::string while_training(const std::string& command, const std::string& metrics, int lines, const std::string& then) {
  return command + " 2>&1 & pid=$!; for i in $(seq 1200); do [ -f " + metrics + " ] && [ $(wc -l < " + metrics + ") -ge " +
         std::to_string(lines) + " ] && break; sleep 0.05; done; t0=$(date +%s); " + then +
         "; wait $pid; rc=$?; echo \"exit=$rc seconds=$(( $(date +%s) - t0 ))\"";
}

int field(const std::string& output, const std::string& key) {
  const auto at = output.rfind(key + "=");
  return at == std::string::npos ? -1 : std::stoi(output.substr(at + key.size() + 1));
}

// A rank killed in the middle of training ends the job on every rank, with an error, quickly:
// through mpirun, which notices a rank that dies on a signal, and, with mpirun told not to, through
// the survivors' comm timeout and watchdog.
TEST(DistCliTrain, AKilledRankEndsTheJob) {
  for (int watchdog = 0; watchdog < 2; ++watchdog) {
    TempDir dir("strata-dist-cli");
    const std::string m = (dir / "m.jsonl").string();
    std::string launch = mpirun(2);
    if (watchdog) launch.replace(launch.find("-x STRATA_COMM_TIMEOUT=60"), 25, "-x STRATA_COMM_TIMEOUT=3 --mca orte_abort_on_non_zero_status 0");
    // The newest of mpirun's children is killed: one rank, either one.
    auto r = run_command(while_training(launch + "train " + kTiny + "--steps 100000 --val-every 0 --metrics " + m, m, 3,
                                        "kill -9 $(pgrep -n -P $pid)"));
    const int rc = field(r.output, "exit"), seconds = field(r.output, "seconds");
    EXPECT_NE(rc, 0) << r.output;
    EXPECT_GE(seconds, 0) << r.output;
    EXPECT_LE(seconds, 45) << (watchdog ? "watchdog" : "launcher") << " path took too long:\n" << r.output;
    if (watchdog) {
      EXPECT_NE(r.output.find("comm timeout"), std::string::npos) << "the survivor says why:\n" << r.output;
    }
  }
}

// SIGTERM to mpirun reaches every rank; they agree on the step to stop after, save one
// checkpoint together and exit; the run resumes from it under mpirun.
TEST(DistCliTrain, SigtermStopsEveryRankWithOneCheckpoint) {
  TempDir dir("strata-dist-cli");
  const std::string m = (dir / "m.jsonl").string(), ck = (dir / "ck").string();
  const std::string flags = kTiny + "--val-every 0 --warmup 0 --min-lr-ratio 1 ";
  auto r = run_command(while_training(mpirun(2) + "train " + flags + "--steps 100000 --checkpoint-dir " + ck +
                                          " --metrics " + m,
                                      m, 3, "kill -TERM $pid"));
  EXPECT_NE(field(r.output, "exit"), 0) << r.output;
  EXPECT_NE(r.output.find("stopping after step"), std::string::npos) << r.output;
  const auto lines = read_jsonl(m);
  ASSERT_GE(lines.size(), 3u);
  const std::int64_t last = lines.back()["step"].get<std::int64_t>();
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld\n", static_cast<long long>(last));
  EXPECT_EQ(read_file(dir / "ck" / "latest"), name) << r.output;
  auto resumed = run_command(mpirun(2) + "train " + flags + "--steps " + std::to_string(last + 2) + " --resume " + ck);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
}

// Tensor parallel from the config (strata.tensor_parallel_size): 2 ranks split one model and
// train one process's batch; 4 ranks are 2 x 2 (tensor x data parallel) and train the batch of
// one process with twice the accumulation. The losses match within the same bound (fp32: the
// split matmuls and softmax change rounding only, ~1e-6 relative measured).
TEST(DistCliTrain, TensorParallelFromTheConfigTrainsLikeOneProcess) {
  TempDir dir("strata-dist-cli");
  const std::string tp_config = write_file(dir / "tp.json", R"({"strata": {"tensor_parallel_size": 2}})");
  const std::string flags = kTiny + "--steps 6 --val-every 3 --val-windows 4 ";
  auto one = run_cli("train " + flags + "--grad-accum 2 --metrics " + (dir / "one.jsonl").string());
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto tp = run_command(mpirun(2) + "train " + flags + "--grad-accum 2 --config " + tp_config + " --out " +
                        (dir / "tp").string());
  ASSERT_EQ(tp.exit_code, 0) << tp.output;
  EXPECT_NE(tp.output.find("2 tensor-parallel ranks"), std::string::npos) << tp.output;
  expect_same_losses(losses_of(dir / "one.jsonl"), losses_of(dir / "tp" / "metrics.jsonl"), "tp 2");
  EXPECT_TRUE(std::filesystem::exists(dir / "tp" / "weights.safetensors"));
  // traffic.tensor_parallel: the model's collectives, the same every step (validation is outside
  // the step's counters but in the run's total); none in one process.
  const auto tp_lines = read_jsonl(dir / "tp" / "metrics.jsonl");
  ASSERT_EQ(tp_lines.size(), 6u);
  std::uint64_t tp_sum = 0;
  for (const auto& m : tp_lines) {
    EXPECT_GT(m["traffic"]["tensor_parallel"].get<std::uint64_t>(), 0u) << m.dump();
    EXPECT_EQ(m["traffic"]["tensor_parallel"], tp_lines[0]["traffic"]["tensor_parallel"]) << m.dump();
    tp_sum += m["traffic"]["tensor_parallel"].get<std::uint64_t>();
  }
  for (const auto& m : read_jsonl(dir / "one.jsonl"))
    EXPECT_EQ(m["traffic"]["tensor_parallel"], 0u) << m.dump();
  const nlohmann::json run = nlohmann::json::parse(read_file(dir / "tp" / "run.json"));
  EXPECT_GT(run["summary"]["bytes_tensor_parallel"].get<std::uint64_t>(), tp_sum)
      << "validation's forwards too";

  auto one4 = run_cli("train " + flags + "--grad-accum 4 --metrics " + (dir / "one4.jsonl").string());
  ASSERT_EQ(one4.exit_code, 0) << one4.output;
  auto grid = run_command(mpirun(4) + "train " + flags + "--grad-accum 2 --config " + tp_config + " --metrics " +
                          (dir / "grid.jsonl").string());
  ASSERT_EQ(grid.exit_code, 0) << grid.output;
  EXPECT_NE(grid.output.find("2 data-parallel ranks"), std::string::npos) << grid.output;
  expect_same_losses(losses_of(dir / "one4.jsonl"), losses_of(dir / "grid.jsonl"), "tp 2 x dp 2");
}

// Tensor x pipeline parallel from the config: 4 ranks are 2 stages, each a tensor-parallel group
// of 2 (rank = stage * 2 + tp), and train one process's batch; 8 ranks are 2 such pipelines. The
// losses match within the same bound (fp32: the split matmuls and softmax, and the tied
// embedding's sum order, change rounding only); rank 0 prints the last stage's loss.
TEST(DistCliTrain, TensorTimesPipelineTrainsLikeOneProcess) {
  TempDir dir("strata-dist-cli");
  const std::string grid_config = write_file(
      dir / "grid.json", R"({"strata": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}})");
  const std::string flags = kTiny + "--steps 5 --val-every 0 --val-windows 4 --grad-accum 2 ";
  auto one = run_cli("train " + flags + "--metrics " + (dir / "one.jsonl").string());
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto grid = run_command(mpirun(4) + "train " + flags + "--config " + grid_config + " --metrics " +
                          (dir / "grid.jsonl").string());
  ASSERT_EQ(grid.exit_code, 0) << grid.output;
  EXPECT_NE(grid.output.find("2 tensor-parallel ranks per pipeline stage"), std::string::npos) << grid.output;
  EXPECT_NE(grid.output.find("2 pipeline stages (1f1b schedule)"), std::string::npos) << grid.output;
  EXPECT_NE(grid.output.find("1 pipeline(s) of data parallel"), std::string::npos) << grid.output;
  EXPECT_EQ(grid.output.find("done:"), grid.output.rfind("done:")) << grid.output;
  expect_same_losses(losses_of(dir / "one.jsonl"), losses_of(dir / "grid.jsonl"), "tp 2 x pp 2");
  // 8 ranks: tp 2 x pp 2 x dp 2, each pipeline half of a global batch of 4 micro-batches.
  auto one4 = run_cli("train " + kTiny + "--steps 5 --val-every 0 --val-windows 4 --grad-accum 4 --metrics " +
                      (dir / "one4.jsonl").string());
  ASSERT_EQ(one4.exit_code, 0) << one4.output;
  auto grid8 = run_command(mpirun(8) + "train " + flags + "--config " + grid_config + " --metrics " +
                           (dir / "grid8.jsonl").string());
  ASSERT_EQ(grid8.exit_code, 0) << grid8.output;
  EXPECT_NE(grid8.output.find("2 pipeline(s) of data parallel"), std::string::npos) << grid8.output;
  expect_same_losses(losses_of(dir / "one4.jsonl"), losses_of(dir / "grid8.jsonl"), "tp 2 x pp 2 x dp 2");
  // A launch the grid does not divide names both sizes.
  auto odd = run_command(mpirun(2) + "train " + flags + "--config " + grid_config);
  EXPECT_NE(odd.exit_code, 0) << odd.output;
  EXPECT_NE(odd.output.find("strata.tensor_parallel_size = 2"), std::string::npos) << odd.output;
  EXPECT_NE(odd.output.find("strata.pipeline_parallel_size = 2 must divide the number of ranks (2"),
            std::string::npos)
      << odd.output;
}

// Sequence parallel from the config (strata.sequence_parallel) on 2 tensor-parallel ranks: the
// same losses as one process within the same bound (rounding only: docs/parallel.md "Sequence
// parallel"); without tensor parallelism it is refused naming both keys.
TEST(DistCliTrain, SequenceParallelFromTheConfigTrainsLikeOneProcess) {
  TempDir dir("strata-dist-cli");
  const std::string sp_config =
      write_file(dir / "sp.json", R"({"strata": {"tensor_parallel_size": 2, "sequence_parallel": true}})");
  const std::string flags = kTiny + "--steps 5 --val-every 0 --val-windows 4 --grad-accum 2 ";
  auto one = run_cli("train " + flags + "--metrics " + (dir / "one.jsonl").string());
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto sp = run_command(mpirun(2) + "train " + flags + "--config " + sp_config + " --metrics " +
                        (dir / "sp.jsonl").string());
  ASSERT_EQ(sp.exit_code, 0) << sp.output;
  EXPECT_NE(sp.output.find("sequence parallel: each tensor-parallel rank keeps 1/2"), std::string::npos)
      << sp.output;
  expect_same_losses(losses_of(dir / "one.jsonl"), losses_of(dir / "sp.jsonl"), "tp 2, sequence parallel");
  const std::string alone_config =
      write_file(dir / "alone.json", R"({"strata": {"sequence_parallel": true}})");
  auto alone = run_cli("train " + kTiny + "--steps 1 --config " + alone_config);
  EXPECT_EQ(alone.exit_code, 2) << alone.output;
  EXPECT_NE(alone.output.find("sequence_parallel"), std::string::npos) << alone.output;
  EXPECT_NE(alone.output.find("strata.tensor_parallel_size = 1"), std::string::npos) << alone.output;
}

// This rank's boundary bytes sent per step (the metrics' traffic.pipeline).
std::vector<std::uint64_t> pipeline_bytes_of(const std::filesystem::path& metrics) {
  std::vector<std::uint64_t> out;
  for (const auto& j : read_jsonl(metrics)) out.push_back(j.at("traffic").at("pipeline").get<std::uint64_t>());
  return out;
}

// Sequence parallel with a pipeline from the config (tp 2 x pp 2 on 4 ranks): trains like one
// process and like the grid without sequence parallelism on the same batch (losses within the
// same bound: rounding only, docs/parallel.md "Sequence parallel across pipeline stages"), and the
// metrics show the boundary traffic: rank 0 (stage 0, tp rank 0) sends each micro-batch's
// activations, all B·T rows of C fp32 values per step and micro-batch without sequence
// parallelism, its B·T/2 rows with it. With interleaved 1F1B (v = 2) and activation offload
// (checkpointing, cpu_checkpointing) as well, all keys at once, it still trains like one process;
// stage 0 then sends 2 activations and 1 activation gradient per micro-batch.
TEST(DistCliTrain, SequenceParallelWithAPipelineTrainsLikeOneProcess) {
  TempDir dir("strata-dist-cli");
  const std::string grid_config = write_file(
      dir / "grid.json", R"({"strata": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}})");
  const std::string sp_config =
      write_file(dir / "sp.json",
                 R"({"strata": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "sequence_parallel": true}})");
  const std::string all_config = write_file(dir / "all.json", R"({"strata": {"tensor_parallel_size": 2,
    "pipeline_parallel_size": 2, "sequence_parallel": true, "pipeline_virtual_stages": 2},
    "activation_checkpointing": {"cpu_checkpointing": true}})");
  const std::string flags = kTiny + "--dtype f32 --steps 5 --val-every 0 --val-windows 4 --grad-accum 2 ";
  auto one = run_cli("train " + flags + "--metrics " + (dir / "one.jsonl").string());
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto grid = run_command(mpirun(4) + "train " + flags + "--config " + grid_config + " --metrics " +
                          (dir / "grid.jsonl").string());
  ASSERT_EQ(grid.exit_code, 0) << grid.output;
  auto sp = run_command(mpirun(4) + "train " + flags + "--config " + sp_config + " --metrics " +
                        (dir / "sp.jsonl").string());
  ASSERT_EQ(sp.exit_code, 0) << sp.output;
  EXPECT_NE(sp.output.find("sequence parallel: each tensor-parallel rank keeps 1/2"), std::string::npos)
      << sp.output;
  EXPECT_NE(sp.output.find("2 pipeline stages (1f1b schedule)"), std::string::npos) << sp.output;
  EXPECT_EQ(sp.output.find("done:"), sp.output.rfind("done:")) << sp.output;
  expect_same_losses(losses_of(dir / "one.jsonl"), losses_of(dir / "sp.jsonl"), "tp 2 x pp 2, sequence parallel");
  expect_same_losses(losses_of(dir / "grid.jsonl"), losses_of(dir / "sp.jsonl"),
                     "tp 2 x pp 2, sequence parallel against the grid without it");
  // 2 micro-batches x (batch 2 x seq 32) rows x width 32 x 4 bytes per step.
  const std::uint64_t rows_bytes = 2 * (2 * 32) * 32 * 4;
  const std::vector<std::uint64_t> full = pipeline_bytes_of(dir / "grid.jsonl"),
                                   split = pipeline_bytes_of(dir / "sp.jsonl");
  ASSERT_EQ(full.size(), 5u);
  ASSERT_EQ(split.size(), 5u);
  for (std::size_t i = 0; i < split.size(); ++i) {
    EXPECT_EQ(full[i], rows_bytes) << "step " << i + 1 << " without sequence parallel";
    EXPECT_EQ(split[i], rows_bytes / 2) << "step " << i + 1 << " with sequence parallel";
  }
  auto all = run_command(mpirun(4) + "train " + flags + "--checkpointing on --config " + all_config +
                         " --metrics " + (dir / "all.jsonl").string());
  ASSERT_EQ(all.exit_code, 0) << all.output;
  EXPECT_NE(all.output.find("sequence parallel: each tensor-parallel rank keeps 1/2"), std::string::npos)
      << all.output;
  EXPECT_NE(all.output.find("interleaved 1f1b schedule, 2 chunks per stage"), std::string::npos) << all.output;
  EXPECT_NE(all.output.find("activations      to host"), std::string::npos) << all.output;
  expect_same_losses(losses_of(dir / "one.jsonl"), losses_of(dir / "all.jsonl"),
                     "tp 2 x pp 2, sequence parallel, interleaved, activation offload");
  for (std::uint64_t b : pipeline_bytes_of(dir / "all.jsonl")) EXPECT_EQ(b, 3 * rows_bytes / 2);
}

// A tensor-parallel size the launch or the model cannot split is refused before training,
// naming the key and the numbers.
TEST(DistCliTrain, TensorParallelSizeThatDoesNotSplitIsRefused) {
  TempDir dir("strata-dist-cli");
  const std::string tp_config = write_file(dir / "tp.json", R"({"strata": {"tensor_parallel_size": 2}})");
  auto alone = run_cli("train " + kTiny + "--steps 1 --config " + tp_config);
  EXPECT_EQ(alone.exit_code, 2) << alone.output;
  EXPECT_NE(alone.output.find("strata.tensor_parallel_size = 2"), std::string::npos) << alone.output;
  // One kv head (LLaMA, grouped-query) cannot be split over 2 ranks.
  auto heads = run_command(mpirun(2) + "train " + kTiny + "--model llama --kv-heads 1 --steps 1 --config " + tp_config);
  EXPECT_NE(heads.exit_code, 0) << heads.output;
  EXPECT_NE(heads.output.find("n_kv_head"), std::string::npos) << heads.output;
  EXPECT_NE(heads.output.find("tensor_parallel_size = 2"), std::string::npos) << heads.output;
}

}  // namespace
}  // namespace strata::testing
