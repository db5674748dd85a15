// strata train / eval / export from the command line, on tiny models: metrics and summary,
// the export → eval round trip against the training run's own validation loss, configs and
// flags, and the exit codes of bad input (2 for flags, 1 for files, each naming what was wrong).
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "harness/harness.hpp"
#include "strata/safetensors.hpp"

namespace strata::testing {
namespace {

// A model small enough that a run takes a moment; one compute thread keeps it steady on a
// loaded machine.
const std::string kTiny = "--layers 1 --width 32 --heads 2 --seq-len 32 --batch 2 --threads 1 ";

std::string corpus_text(int lines) {
  std::string text;
  for (int i = 0; i < lines; ++i) {
    text += "Line " + std::to_string(i) + ": the quick fox counts " + std::to_string(i % 7) + " + " +
            std::to_string(i % 5) + " = " + std::to_string(i % 7 + i % 5) + ".\n";
  }
  return text;
}

TEST(CliTrain, TrainsWritesMetricsAndTheEvalOfItsWeightsMatchesItsValidation) {
  TempDir dir;
  const std::string train = write_file(dir / "train.txt", corpus_text(400));
  const std::string val = write_file(dir / "val.txt", corpus_text(60).substr(1000));
  const auto metrics = dir / "metrics.jsonl";
  const auto weights = dir / "w.safetensors";
  const auto run = dir / "run";
  auto r = run_cli("train " + kTiny + "--steps 12 --val-every 5 --val-windows 0 --data " + train +
                   " --val-data " + val + " --metrics " + metrics.string() + " --save-weights " +
                   weights.string() + " --out " + run.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* needle :
       {"step 12/12", "validation loss", "unigram baseline", "done: 12 steps", "tok/s"}) {
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
  }
  const auto lines = read_jsonl(metrics);
  ASSERT_EQ(lines.size(), 12u);
  int with_val = 0;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    EXPECT_EQ(lines[i]["step"], static_cast<int>(i) + 1);
    EXPECT_GT(lines[i]["loss"].get<double>(), 0.0);
    EXPECT_GT(lines[i]["tokens_per_s"].get<double>(), 0.0);
    with_val += lines[i].contains("val_loss") ? 1 : 0;
  }
  EXPECT_EQ(with_val, 3);  // steps 5, 10 and the last
  ASSERT_TRUE(lines.back().contains("val_loss"));
  const double val_loss = lines.back()["val_loss"].get<double>();
  EXPECT_LT(lines.back()["loss"].get<double>(), lines.front()["loss"].get<double>());

  // strata eval over the same text, same windows: the same loss, to the last bit.
  auto e =
      run_cli("eval --weights " + weights.string() + " --data " + val + " --seq-len 32 --json --threads 1");
  ASSERT_EQ(e.exit_code, 0) << e.output;
  auto ej = nlohmann::json::parse(e.output);
  EXPECT_EQ(ej["loss"].get<double>(), val_loss);
  EXPECT_EQ(ej["tokens"].get<std::int64_t>(), static_cast<std::int64_t>(read_file(val).size() / 33 * 32));

  // strata export from the saved run writes the same Hugging Face file as --save-weights.
  const auto exported = dir / "exported.safetensors";
  auto x = run_cli("export --run " + run.string() + " --weights " + exported.string());
  ASSERT_EQ(x.exit_code, 0) << x.output;
  EXPECT_EQ(read_file(exported), read_file(weights));
  auto file = SafetensorsFile::open(exported.string());
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  EXPECT_NE(file->find("h.0.attn.c_attn.weight"), nullptr);
  auto config = nlohmann::json::parse(file->metadata().at("config"));
  EXPECT_EQ(config["n_layer"], 1);
  EXPECT_EQ(config["n_embd"], 32);
  auto run_json = nlohmann::json::parse(read_file(run / "run.json"));
  EXPECT_EQ(run_json["summary"]["val_loss"].get<double>(), val_loss);

  // Exported as bf16, the file evaluates close to (not exactly at) the fp32 loss.
  const auto bf16 = dir / "bf16.safetensors";
  ASSERT_EQ(
      run_cli("export --run " + run.string() + " --weights " + bf16.string() + " --dtype bf16").exit_code, 0);
  auto eb =
      run_cli("eval --weights " + bf16.string() + " --data " + val + " --seq-len 32 --json --threads 1");
  ASSERT_EQ(eb.exit_code, 0) << eb.output;
  EXPECT_NEAR(nlohmann::json::parse(eb.output)["loss"].get<double>(), val_loss, 0.05);
}

TEST(CliTrain, LlamaWithBf16CheckpointingAndAConfigFile) {
  TempDir dir;
  const std::string config = write_file(dir / "ds.json", R"({
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
    "bf16": {"enabled": true},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.004, "betas": [0.9, 0.95], "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2, "total_num_steps": 6,
                                                         "warmup_type": "linear"}}})");
  const auto metrics = dir / "m.jsonl";
  // kTiny with --batch 3 in place of its --batch 2 (a flag may be given once).
  const std::string tiny = "--layers 1 --width 32 --heads 2 --seq-len 32 --batch 3 --threads 1 ";
  auto r = run_cli("train --model llama --kv-heads 1 --checkpointing on " + tiny + "--config " + config +
                   " --val-windows 4 --metrics " + metrics.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // The config's scheduler gives the step count; --batch overrides its micro batch; accumulation stays.
  EXPECT_NE(r.output.find("6 steps x 192 tokens (batch 3 x accum 2 x seq 32)"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("bf16, activation checkpointing"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("lr 0.004"), std::string::npos) << r.output;
  const auto lines = read_jsonl(metrics);
  ASSERT_EQ(lines.size(), 6u);
  EXPECT_DOUBLE_EQ(lines[0]["lr"].get<double>(), 0.0);    // DeepSpeed: warmup starts at warmup_min_ratio = 0
  EXPECT_DOUBLE_EQ(lines[1]["lr"].get<double>(), 0.002);  // linear warmup: step 1 of 2
  EXPECT_EQ(lines[0]["tokens"], 192);
}

// fp16 from a DeepSpeed config with a scale far too large: the first steps overflow and are
// skipped (the warmup does not advance: lr stays at its start), the progress line and the
// metrics show the scale and the skips, and the run trains once the scale has come down.
TEST(CliTrain, Fp16SkipsOverflowingStepsAndReportsTheScale) {
  TempDir dir;
  const std::string config = write_file(dir / "ds.json", R"({
    "fp16": {"enabled": true, "initial_scale_power": 40, "hysteresis": 1},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.004,
                                                   "warmup_num_steps": 4, "warmup_type": "linear"}}})");
  const std::string tiny = "--layers 1 --width 32 --heads 2 --seq-len 32 --batch 2 --threads 1 ";
  const auto run = dir / "run";
  const auto metrics = run / "metrics.jsonl";
  auto r = run_cli("train " + tiny + "--steps 30 --config " + config + " --out " + run.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("| scale 1.09951e+12 | skipped 1 (this step)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("steps skipped (gradients overflowed); last loss scale"), std::string::npos)
      << r.output;
  const auto lines = read_jsonl(metrics);
  ASSERT_EQ(lines.size(), 30u);
  EXPECT_DOUBLE_EQ(lines[0]["loss_scale"].get<double>(), std::ldexp(1.0, 40));
  EXPECT_DOUBLE_EQ(lines[1]["loss_scale"].get<double>(), std::ldexp(1.0, 39));
  // The leading skipped steps all run at the warmup's first lr: a skip does not advance it.
  std::size_t first_applied = 0;
  while (first_applied < lines.size() && lines[first_applied]["skipped"].get<bool>()) {
    EXPECT_DOUBLE_EQ(lines[first_applied]["lr"].get<double>(), 0.0) << "step " << first_applied + 1;
    ++first_applied;
  }
  ASSERT_GE(first_applied, 1u);
  ASSERT_LT(first_applied + 1, lines.size()) << "the scale never came down";
  // The first applied update is the schedule's update 0, the next its update 1.
  EXPECT_DOUBLE_EQ(lines[first_applied]["lr"].get<double>(), 0.0);
  if (!lines[first_applied + 1]["skipped"].get<bool>()) {
    EXPECT_DOUBLE_EQ(lines[first_applied + 1]["lr"].get<double>(), 0.001);
  }
  // An overflowed step has no gradient norm in its record, and the report still draws the run.
  EXPECT_FALSE(lines[0].contains("grad_norm"));
  EXPECT_TRUE(lines[first_applied].contains("grad_norm"));
  auto rep = run_cli("report " + run.string() + " --out " + (dir / "page.html").string());
  EXPECT_EQ(rep.exit_code, 0) << rep.output;
}

TEST(CliTrain, BadFlagsExitTwoNamingTheFlag) {
  struct Case {
    std::string args;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"train --layers 0", "--layers"},
      {"train --width 100 --heads 3", "--width"},
      {"train --dtype fp8", "--dtype"},
      {"train --model gpt3", "--model"},
      {"train --steps many", "--steps"},
      {"train --lr -1", "--lr"},
      {"train --checkpointing sometimes", "--checkpointing"},
      {"train --seq-len 64 --context 32", "--context"},
      {"train --vocab v.json", "--merges"},
      {"train --threads -2", "--threads"},
      {"train --bogus", "--bogus"},
      {"train extra", "extra"},
      // the delayed update needs the optimizer off the device
      {"train --delayed-update --offload-param none --offload-optimizer none", "strata.delayed_update"},
      {"eval --data x.txt", "--weights"},
      {"eval --weights w --data d --batch 0", "--batch"},
      {"export --weights out.safetensors", "--run"},
  };
  for (const auto& c : cases) {
    auto r = run_cli(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.needle), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find("usage: strata"), std::string::npos) << c.args << "\n" << r.output;
  }
}

// --delayed-update trains (the delayed update itself is checked bit for bit in
// test_offload_delayed_update.cpp) and says that it is on, in the output and in run.json.
TEST(CliTrain, DelayedUpdateFlagTrainsAndIsReported) {
  TempDir dir("strata-cli-dpu");
  auto r = run_cli("train " + kTiny + "--steps 4 --val-windows 1 --offload-param none --offload-optimizer cpu " +
                   "--delayed-update --out " + dir.path().string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("delayed update: each step computes with the parameters from before"), std::string::npos)
      << r.output;
  const auto run = nlohmann::json::parse(read_file((dir / "run.json").string()));
  EXPECT_TRUE(run["offload"]["delayed_update"].get<bool>());
}

// The strata section's offload tunables count in a config that has no zero_optimization section
// (they used to be read only beside one), and the flags still win over them.
TEST(CliTrain, StrataOffloadKeysCountWithoutAZeroSection) {
  TempDir dir("strata-cli-strata-keys");
  const std::string config = write_file(
      dir / "strata.json", R"({"strata": {"offload_gradients": "nvme", "offload_prefetch_modules": 3}})");
  auto r = run_cli("train " + kTiny + "--steps 1 --val-windows 1 --offload-optimizer nvme --config " + config +
                   " --nvme-path " + (dir / "a").string() + " --out " + (dir / "a").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto run = nlohmann::json::parse(read_file((dir / "a" / "run.json").string()));
  EXPECT_EQ(run["offload"]["gradients"], "nvme") << run.dump();
  EXPECT_EQ(run["offload"]["prefetch_modules"], 3) << run.dump();
  auto f = run_cli("train " + kTiny + "--steps 1 --val-windows 1 --offload-optimizer nvme --config " + config +
                   " --offload-gradients cpu --nvme-path " + (dir / "b").string() + " --out " + (dir / "b").string());
  ASSERT_EQ(f.exit_code, 0) << f.output;
  const auto flagged = nlohmann::json::parse(read_file((dir / "b" / "run.json").string()));
  EXPECT_EQ(flagged["offload"]["gradients"], "host") << flagged.dump();
}

TEST(CliTrain, BadFilesExitOneNamingThePath) {
  TempDir dir;
  const std::string bad_config = write_file(dir / "bad.json", "{\"gradient_clipping\": \"lots\"}");
  const std::string fp16_config =
      write_file(dir / "fp16.json", "{\"fp16\": {\"enabled\": true, \"initial_scale_power\": 2, \"min_loss_scale\": 8}}");
  const std::string not_weights = write_file(dir / "not.safetensors", "definitely not safetensors");
  const std::string text = write_file(dir / "t.txt", corpus_text(20));
  struct Case {
    std::string args;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"train --data /nonexistent/corpus.txt", "/nonexistent/corpus.txt"},
      {"train --config /nonexistent/ds.json", "/nonexistent/ds.json"},
      {"train --config " + bad_config, "gradient_clipping"},
      {"train --config " + fp16_config, "fp16.initial_scale_power"},
      {"train --metrics /nonexistent/dir/m.jsonl", "/nonexistent/dir/m.jsonl"},
      {"train --save-weights /nonexistent/dir/w.safetensors", "/nonexistent/dir"},
      {"eval --weights /nonexistent/w.safetensors --data " + text, "/nonexistent/w.safetensors"},
      {"eval --weights " + not_weights + " --data " + text, not_weights},
      {"export --run /nonexistent/run --weights " + (dir / "o.safetensors").string(), "/nonexistent/run"},
  };
  for (const auto& c : cases) {
    auto r = run_cli(c.args);
    EXPECT_EQ(r.exit_code, 1) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.needle), std::string::npos) << c.args << "\n" << r.output;
  }
}

TEST(CliTrain, EvalChecksTheSequenceLengthAgainstTheModel) {
  TempDir dir;
  const auto weights = dir / "w.safetensors";
  auto r = run_cli("train " + kTiny + "--steps 2 --val-windows 2 --save-weights " + weights.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string text = write_file(dir / "t.txt", corpus_text(20));
  auto e = run_cli("eval --weights " + weights.string() + " --data " + text + " --seq-len 64");
  EXPECT_EQ(e.exit_code, 2) << e.output;
  EXPECT_NE(e.output.find("--seq-len"), std::string::npos) << e.output;
  auto ok = run_cli("eval --weights " + weights.string() + " --data " + text + " --threads 1");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("nats/token"), std::string::npos) << ok.output;
}

}  // namespace
}  // namespace strata::testing

namespace strata::testing {
namespace {

TEST(CliBenchStep, PrintsThroughputAgainstTheRoofline) {
  auto r = run_cli(
      "bench step --json --layers 1 --width 64 --heads 2 --seq-len 32 --batch 2 --steps 2 --warmup 1 "
      "--reps 1 --threads 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  for (const char* key :
       {"tokens_per_s", "model_gflops_per_s", "matmul_roofline_gflops_per_s", "ratio", "step_ms"}) {
    ASSERT_TRUE(j.contains(key)) << key;
    EXPECT_GT(j[key].get<double>(), 0.0) << key;
  }
  // 1 block: c_attn, c_proj, c_fc, mlp c_proj and the head, each forward / dinp / dweight.
  EXPECT_EQ(j["gemms"].size(), 15u);
  // Forward FLOPs ×3: 24·C² per token in the block, 2·C·V in the head, causal attention.
  const double T = 32, B = 2, C = 64;
  const double forward = 2 * B * T * 12 * C * C + 2 * B * T * C * 256 + B * 2 * 2 * 2 * 32 * T * (T + 1) / 2;
  EXPECT_NEAR(j["model_gflops_per_step"].get<double>(), 3 * forward / 1e9, 1e-12);
  EXPECT_NEAR(j["ratio"].get<double>(),
              j["model_gflops_per_s"].get<double>() / j["matmul_roofline_gflops_per_s"].get<double>(), 1e-9);
  auto bad = run_cli("bench step --width 0");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--width"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace strata::testing

namespace strata::testing {
namespace {

// A GPT-2 BPE tokenizer from its two files: the byte alphabet plus a few merges (261 tokens).
std::pair<std::string, std::string> tiny_bpe(const TempDir& dir) {
  nlohmann::json vocab = nlohmann::json::object();
  auto cp_utf8 = [](std::uint32_t cp) {
    std::string s;
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    return s;
  };
  int id = 0;
  std::uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool direct = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    vocab[cp_utf8(direct ? static_cast<std::uint32_t>(b) : next++)] = id++;
  }
  for (const char* merged : {"th", "the", "\xc4\xa0t", "\xc4\xa0th", "\xc4\xa0the"}) vocab[merged] = id++;
  return {
      write_file(dir / "vocab.json", vocab.dump()),
      write_file(dir / "merges.txt", "#version: 0.2\nt h\nth e\n\xc4\xa0 t\n\xc4\xa0t h\n\xc4\xa0th e\n")};
}

TEST(CliTrain, TrainsOnGpt2BpeTokens) {
  TempDir dir;
  const auto [vocab, merges] = tiny_bpe(dir);
  std::string text;
  for (int i = 0; i < 300; ++i) text += "the fox and the bird see the river " + std::to_string(i % 9) + ".\n";
  const std::string data = write_file(dir / "t.txt", text);
  auto r = run_cli("train " + kTiny + "--steps 3 --val-windows 2 --data " + data + " --vocab " + vocab +
                   " --merges " + merges);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("vocab 261"), std::string::npos) << r.output;
  auto missing = run_cli("train --vocab /nonexistent/vocab.json --merges " + merges);
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  EXPECT_NE(missing.output.find("/nonexistent/vocab.json"), std::string::npos) << missing.output;
}

}  // namespace
}  // namespace strata::testing
