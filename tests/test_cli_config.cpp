// `strata config FILE [--json] [--data-parallel-size N]` run as a user would: exit codes and output.
#include <nlohmann/json.hpp>
#include <string>

#include "harness/harness.hpp"
#include "strata/config.hpp"
#include "strata/options.hpp"

namespace strata {
namespace {

using testing::run_cli;
using testing::run_command;
using testing::TempDir;
using testing::write_file;

constexpr const char* kGood = R"({
  "train_batch_size": 32,
  "gradient_accumulation_steps": 2,
  "bf16": {"enabled": true},
  "zero_optimization": {
    "stage": 3,
    "reduce_bucket_size": 5e7,
    "offload_param": {"device": "nvme", "nvme_path": "/mnt/nvme0"},
    "offload_optimizer": {"device": "cpu", "pin_memory": true}
  },
  "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "weight_decay": 0.1}},
  "strata": {"device_memory": "1GiB"}
})";

// The CLI with no STRATA_<NAME> variable from the machine leaking in.
testing::CommandResult run_clean(const std::string& env, const std::string& args) {
  std::string unset;
  for (const auto& d : option_table()) unset += " -u " + Options::env_name(d);
  return run_command("env" + unset + " " + env + " " + std::string(STRATA_CLI_PATH) + " " + args);
}

TEST(CliConfig, ValidFilePrintsTheResolvedSettings) {
  TempDir dir("strata-cli-config");
  const std::string file = write_file(dir / "good.json", kGood);
  auto r = run_clean("", "config " + file);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(file + ": valid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("zero_optimization.offload_param.device"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("\"nvme\""), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("zero_optimization.reduce_bucket_size"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("50000000"), std::string::npos) << r.output;
  // Defaults are filled in, and strata options show their source.
  EXPECT_NE(r.output.find("aio.queue_depth"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[config strata.device_memory]"), std::string::npos) << r.output;
}

TEST(CliConfig, JsonOutputIsAValidConfigItself) {
  TempDir dir("strata-cli-config");
  const std::string file = write_file(dir / "good.json", kGood);
  auto r = run_clean("", "config " + file + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded()) << r.output;
  EXPECT_EQ(j["zero_optimization"]["stage"], 3);
  EXPECT_EQ(j["zero_optimization"]["overlap_comm"], true);  // stage 3's default
  EXPECT_EQ(j["optimizer"]["type"], "AdamW");
  EXPECT_EQ(j["strata"]["device_memory"], 1ull << 30);
  EXPECT_TRUE(j["train_micro_batch_size_per_gpu"].is_null());
  const std::string again = write_file(dir / "again.json", r.output);
  auto r2 = run_clean("", "config " + again + " --json");
  EXPECT_EQ(r2.exit_code, 0) << r2.output;
  EXPECT_EQ(r2.output, r.output);
}

TEST(CliConfig, DataParallelSizeDerivesTheBatchSizes) {
  TempDir dir("strata-cli-config");
  const std::string file = write_file(dir / "good.json", kGood);
  auto r = run_clean("", "config " + file + " --json --data-parallel-size 4");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["train_micro_batch_size_per_gpu"], 4);
  auto bad = run_clean("", "config " + file + " --data-parallel-size 3");
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find("train_batch_size (32) is not divisible"), std::string::npos) << bad.output;
  auto zero = run_clean("", "config " + file + " --data-parallel-size 0");
  EXPECT_EQ(zero.exit_code, 2) << zero.output;
}

TEST(CliConfig, EnvironmentOverridesTheFile) {
  TempDir dir("strata-cli-config");
  const std::string file = write_file(dir / "good.json", kGood);
  auto r = run_clean("STRATA_DEVICE_MEMORY=3GiB", "config " + file + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output)["strata"]["device_memory"], 3ull << 30);
  auto bad = run_clean("STRATA_DEVICE_MEMORY=lots", "config " + file);
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find("STRATA_DEVICE_MEMORY"), std::string::npos) << bad.output;
}

TEST(CliConfig, InvalidFileListsEveryErrorAndExitsOne) {
  TempDir dir("strata-cli-config");
  const std::string file = write_file(dir / "bad.json", R"({
  "zero_optimization": {"stage": 5, "offload_param": {"device": "gpu"}},
  "optimizer": {"params": {"betas": [0.9, 1.5]}},
  "train_batch_sise": 8
})");
  auto r = run_clean("", "config " + file);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  for (const char* needle : {": zero_optimization.stage: expected an integer in [0, 3], found 5",
                             ": zero_optimization.offload_param.device: expected one of \"none\", \"cpu\", "
                             "\"nvme\", found \"gpu\"",
                             ": optimizer.params.betas[1]: expected a number in [0, 1), found 1.5",
                             ": train_batch_sise: unknown key; did you mean 'train_batch_size'?"}) {
    EXPECT_NE(r.output.find(file + needle), std::string::npos) << needle << "\n" << r.output;
  }
  EXPECT_EQ(r.output.find(": valid"), std::string::npos) << r.output;
}

TEST(CliConfig, InvalidJsonNamesLineAndColumn) {
  TempDir dir("strata-cli-config");
  const std::string file =
      write_file(dir / "broken.json", "{\n  \"fp16\": {\n    \"enabled\": true,\n  }\n}\n");
  auto r = run_clean("", "config " + file);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(file + ":4:3: invalid JSON"), std::string::npos) << r.output;
}

TEST(CliConfig, MissingFileExitsOne) {
  TempDir dir("strata-cli-config");
  auto r = run_clean("", "config " + (dir / "nope.json").string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("nope.json': No such file or directory"), std::string::npos) << r.output;
}

TEST(CliConfig, UsageErrorsExitTwo) {
  auto none = run_cli("config");
  EXPECT_EQ(none.exit_code, 2) << none.output;
  EXPECT_NE(none.output.find("no config FILE given"), std::string::npos) << none.output;
  EXPECT_NE(none.output.find("usage: strata config FILE"), std::string::npos) << none.output;
  auto flag = run_cli("config x.json --jsn");
  EXPECT_EQ(flag.exit_code, 2) << flag.output;
  EXPECT_NE(flag.output.find("unknown flag '--jsn'"), std::string::npos) << flag.output;
  auto two = run_cli("config a.json b.json");
  EXPECT_EQ(two.exit_code, 2) << two.output;
  auto dp = run_cli("config a.json --data-parallel-size many");
  EXPECT_EQ(dp.exit_code, 2) << dp.output;
  auto help = run_cli("config --help");
  EXPECT_EQ(help.exit_code, 0) << help.output;
  EXPECT_NE(help.output.find("--json"), std::string::npos) << help.output;
}

// ---- DeepSpeed configs as people write them ----------------------------------------------------

std::string corpus(const std::string& name) {
  return std::string(STRATA_SOURCE_DIR) + "/tests/data/ds_configs/" + name;
}

std::size_t count(const std::string& haystack, const std::string& needle) {
  std::size_t n = 0;
  for (std::size_t pos = haystack.find(needle); pos != std::string::npos;
       pos = haystack.find(needle, pos + 1))
    ++n;
  return n;
}

TEST(CliConfig, HuggingFaceAutoConfigShowsResolutionPlanAndIgnoredKeys) {
  auto r =
      run_clean("", "config " + corpus("hf_trainer_zero3_auto.json") + " --batch 6 --lr 2e-4 --layers 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // "auto" resolved from the flags or Strata's defaults, and said so.
  EXPECT_NE(r.output.find("train_micro_batch_size_per_gpu: auto -> 6 (from --batch)"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("optimizer.params.lr: auto -> 0.0002 (from --lr)"), std::string::npos) << r.output;
  EXPECT_NE(
      r.output.find("gradient_accumulation_steps: auto -> 1 (Strata's default; --grad-accum not given)"),
      std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("train_batch_size: auto -> 6 ("), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("scheduler.params.total_num_steps: auto -> 600 ("), std::string::npos) << r.output;
  // The plan of the config's placement (parameters and optimizer on the host).
  EXPECT_NE(r.output.find("placement: parameters on host, optimizer state on host"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("memory plan:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("Adam exp_avg_sq"), std::string::npos) << r.output;
  // Ignored keys, each once, with the reason.
  EXPECT_EQ(count(r.output, "  wall_clock_breakdown: strata train reports tokens/s"), 1u) << r.output;
  EXPECT_EQ(count(r.output, "  zero_optimization.stage3_max_live_parameters: parameters are released after each module"), 1u)
      << r.output;
  // overlap_comm is honoured (the device optimizer's gradient buckets): not among the ignored ones.
  EXPECT_EQ(count(r.output, "  zero_optimization.overlap_comm: "), 0u) << r.output;
  // The fp16 loss-scaler keys are honoured, so they are not among the ignored ones.
  EXPECT_EQ(count(r.output, "  fp16.loss_scale: "), 0u) << r.output;
}

TEST(CliConfig, JsonOutputCarriesTheResolvedAutoValues) {
  auto r =
      run_clean("", "config " + corpus("hf_trainer_zero2_auto.json") + " --json --batch 5 --grad-accum 3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["train_micro_batch_size_per_gpu"], 5);
  EXPECT_EQ(j["gradient_accumulation_steps"], 3);
  EXPECT_EQ(j["train_batch_size"], 15);
  EXPECT_EQ(j["optimizer"]["params"]["betas"][1], 0.95);
  EXPECT_EQ(j["zero_optimization"]["offload_optimizer"]["device"], "cpu");
}

TEST(CliConfig, StrictRefusesIgnoredKeys) {
  const std::string file = corpus("monitoring_and_profiling.json");
  auto loose = run_clean("", "config " + file);
  EXPECT_EQ(loose.exit_code, 0) << loose.output;
  auto strict = run_clean("", "config " + file + " --strict");
  EXPECT_EQ(strict.exit_code, 1) << strict.output;
  EXPECT_NE(strict.output.find(file + ": tensorboard: ignored by Strata ("), std::string::npos)
      << strict.output;
  EXPECT_NE(strict.output.find("--strict refuses ignored keys"), std::string::npos) << strict.output;
  auto clean = run_clean("", "config " + corpus("zero3_offload_cpu.json") + " --strict");
  EXPECT_EQ(clean.exit_code, 1) << clean.output;  // contiguous_gradients etc. are ignored
  EXPECT_NE(clean.output.find("zero_optimization.contiguous_gradients: ignored by Strata"), std::string::npos)
      << clean.output;
}

TEST(CliConfig, RefusedAndMisspeltKeysExitOneNamingTheKey) {
  auto lamb = run_clean("", "config " + corpus("refused_lamb.json"));
  EXPECT_EQ(lamb.exit_code, 1) << lamb.output;
  EXPECT_NE(lamb.output.find("optimizer.type: \"Lamb\" is not supported: LAMB is not implemented; use AdamW"),
            std::string::npos)
      << lamb.output;
  auto fp16 = run_clean("", "config " + corpus("refused_fp16_master_weights.json"));
  EXPECT_EQ(fp16.exit_code, 1) << fp16.output;
  EXPECT_NE(fp16.output.find("fp16.fp16_master_weights_and_grads"), std::string::npos) << fp16.output;
  EXPECT_NE(fp16.output.find("Strata keeps fp32 masters"), std::string::npos) << fp16.output;
  auto typo = run_clean("", "config " + corpus("misspelt_keys.json"));
  EXPECT_EQ(typo.exit_code, 1) << typo.output;
  EXPECT_NE(typo.output.find("did you mean 'gradient_accumulation_steps'?"), std::string::npos)
      << typo.output;
}

TEST(CliConfig, TrainResolvesAutoAndListsIgnoredKeysTheSameWay) {
  const std::string file = corpus("hf_trainer_zero2_auto.json");
  const std::string tiny =
      " --layers 1 --width 32 --heads 2 --seq-len 32 --threads 1 --val-windows 1 --quiet";
  auto r = run_clean("", "train --config " + file + " --batch 2 --steps 2" + tiny);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("config   train_micro_batch_size_per_gpu: auto -> 2 (from --batch)"),
            std::string::npos)
      << r.output;
  EXPECT_NE(
      r.output.find("config   scheduler.params.warmup_num_steps: auto -> 1 (Strata's default; --warmup not "
                    "given)"),
      std::string::npos)
      << r.output;
  EXPECT_EQ(count(r.output, "config   ignored wall_clock_breakdown: "), 1u) << r.output;
  EXPECT_NE(r.output.find("2 steps x 64 tokens (batch 2 x accum 1 x seq 32)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("optimizer state on host"), std::string::npos)
      << r.output;  // offload_optimizer cpu
  auto strict = run_clean("", "train --config " + file + " --strict --steps 2" + tiny);
  EXPECT_EQ(strict.exit_code, 1) << strict.output;
  EXPECT_NE(strict.output.find("wall_clock_breakdown: ignored by Strata"), std::string::npos)
      << strict.output;
}

TEST(CliConfig, KeysPrintsTheTable) {
  auto r = run_clean("", "config --keys");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, config_keys_markdown());
  EXPECT_NE(r.output.find("| `wall_clock_breakdown` | ignored |"), std::string::npos) << r.output;
  EXPECT_EQ(run_clean("", "config --keys x.json").exit_code, 2);
}

}  // namespace
}  // namespace strata
