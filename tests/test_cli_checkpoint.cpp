// strata train --checkpoint-dir / --resume: a run resumed from its step-3 checkpoint under another
// placement writes the same weights, byte for byte, and logs the same losses as the uninterrupted
// run; resuming with other data, batch shape or seed, or past --steps, is refused naming why.
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "harness/harness.hpp"

namespace strata::testing {
namespace {

std::string tiny_flags(int layers = 2, int batch = 2) {
  return "--layers " + std::to_string(layers) + " --batch " + std::to_string(batch) +
         " --width 32 --heads 2 --seq-len 32 --threads 1 --quiet ";
}
const std::string kTiny = tiny_flags();

TEST(CliCheckpoint, ResumedRunWritesTheSameWeightsAsTheUninterruptedOne) {
  TempDir dir("strata-cli-ckpt");
  const std::string ck = (dir / "ck").string();
  // The uninterrupted run: params on NVMe, optimizer on the host (the default), checkpoints at
  // steps 3 and 6.
  auto a = run_cli("train " + kTiny + "--steps 6 --val-every 0 --checkpoint-dir " + ck +
                   " --checkpoint-every 3 --metrics " + (dir / "a.jsonl").string() + " --save-weights " +
                   (dir / "a.safetensors").string());
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_TRUE(std::filesystem::exists(dir / "ck" / "step-00000003"));
  ASSERT_TRUE(std::filesystem::exists(dir / "ck" / "step-00000006"));
  EXPECT_EQ(read_file(dir / "ck" / "latest"), "step-00000006\n");

  // Resumed from step 3 with everything on the device.
  auto b = run_cli("train " + kTiny + "--steps 6 --val-every 0 --resume " + ck + "/step-00000003" +
                   " --offload-param none --offload-optimizer none --metrics " + (dir / "b.jsonl").string() +
                   " --save-weights " + (dir / "b.safetensors").string());
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_NE(b.output.find("resume   from " + ck + "/step-00000003 (step 3"), std::string::npos) << b.output;
  const std::string wa = read_file(dir / "a.safetensors");
  ASSERT_GT(wa.size(), 1000u);
  EXPECT_TRUE(wa == read_file(dir / "b.safetensors")) << "the resumed run's weights differ";
  const auto ma = read_jsonl(dir / "a.jsonl");
  const auto mb = read_jsonl(dir / "b.jsonl");
  ASSERT_EQ(ma.size(), 6u);
  ASSERT_EQ(mb.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(mb[i]["step"], ma[i + 3]["step"]);
    EXPECT_EQ(mb[i]["loss"].get<double>(), ma[i + 3]["loss"].get<double>()) << "step " << i + 4;
    EXPECT_EQ(mb[i]["grad_norm"].get<double>(), ma[i + 3]["grad_norm"].get<double>()) << "step " << i + 4;
    EXPECT_EQ(mb[i]["lr"].get<double>(), ma[i + 3]["lr"].get<double>()) << "step " << i + 4;
  }
}

TEST(CliCheckpoint, ResumeRefusesWhatWouldChangeTheRun) {
  TempDir dir("strata-cli-ckpt");
  const std::string ck = (dir / "ck").string();
  auto a = run_cli("train " + kTiny + "--steps 2 --val-every 0 --checkpoint-dir " + ck);
  ASSERT_EQ(a.exit_code, 0) << a.output;

  auto r = run_cli("train " + kTiny + "--steps 4 --resume " + ck + " --seed 7");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("was trained with seed = 1234, this run has 7"), std::string::npos) << r.output;

  r = run_cli("train " + tiny_flags(2, 3) + "--steps 4 --resume " + ck);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("micro_batch = 2, this run has 3"), std::string::npos) << r.output;

  r = run_cli("train " + kTiny + "--steps 1 --resume " + ck);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("is at step 2; --steps 1 leaves nothing to train"), std::string::npos) << r.output;

  // At the last step: a run killed after its final checkpoint but before its outputs were
  // written resumes to write them.
  r = run_cli("train " + kTiny + "--steps 2 --resume " + ck + " --save-weights " + (dir / "w.safetensors").string());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("nothing left to train: writing the run's outputs"), std::string::npos) << r.output;
  EXPECT_TRUE(std::filesystem::exists(dir / "w.safetensors"));

  r = run_cli("train " + kTiny + "--steps 4 --resume " + (dir / "nothing").string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find((dir / "nothing").string() + "' is not a directory"), std::string::npos) << r.output;

  r = run_cli("train " + tiny_flags(3, 2) + "--steps 4 --resume " + ck);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("n_layer: checkpoint 2, this run 3"), std::string::npos) << r.output;

  r = run_cli("train " + kTiny + "--steps 4 --checkpoint-every 2");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("need '--checkpoint-dir'"), std::string::npos) << r.output;
}

// Token files (--tokens): the checkpoint stores the window counter (data_position), a resumed
// run under another placement writes the same weights byte for byte, and a resume with another
// batch shape is allowed and goes on from the next unseen window (the counter, not the step,
// says where). Other token files or another seed are refused.
TEST(CliCheckpoint, TokenRunResumesBitwiseAndAReshapedResumeGoesOnFromItsPosition) {
  TempDir dir("strata-cli-ckpt-tokens");
  std::string text;
  for (int i = 0; i < 500; ++i) text += "the river " + std::to_string(i % 17) + " runs past the stone.\n";
  const std::string txt = write_file(dir / "t.txt", text);
  const std::string bin = (dir / "t.bin").string();
  ASSERT_EQ(run_cli("tokenize --tokenizer bytes --input " + txt + " --out " + bin + " --quiet").exit_code, 0);
  const std::string ck = (dir / "ck").string();
  const std::string data = "--tokens " + bin + " --val-every 0 ";
  auto a = run_cli("train " + kTiny + data + "--steps 6 --checkpoint-dir " + ck +
                   " --checkpoint-every 3 --metrics " + (dir / "a.jsonl").string() + " --save-weights " +
                   (dir / "a.safetensors").string());
  ASSERT_EQ(a.exit_code, 0) << a.output;
  auto position = [](const std::filesystem::path& checkpoint) {
    const auto m = nlohmann::json::parse(read_file(checkpoint / "manifest.json"));
    const auto client = m["client_state"].is_string()
                            ? nlohmann::json::parse(m["client_state"].get<std::string>())
                            : m["client_state"];
    return client["data_position"]["windows"].get<std::uint64_t>();
  };
  EXPECT_EQ(position(dir / "ck" / "step-00000003"), 6u) << "3 steps x 1 micro-batch x 2 windows";
  EXPECT_EQ(position(dir / "ck" / "step-00000006"), 12u);

  auto b = run_cli("train " + kTiny + data + "--steps 6 --resume " + ck + "/step-00000003" +
                   " --offload-param none --offload-optimizer none --metrics " + (dir / "b.jsonl").string() +
                   " --save-weights " + (dir / "b.safetensors").string());
  ASSERT_EQ(b.exit_code, 0) << b.output;
  const std::string wa = read_file(dir / "a.safetensors");
  ASSERT_GT(wa.size(), 1000u);
  EXPECT_TRUE(wa == read_file(dir / "b.safetensors")) << "the resumed run's weights differ";
  const auto ma = read_jsonl(dir / "a.jsonl"), mb = read_jsonl(dir / "b.jsonl");
  ASSERT_EQ(mb.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_EQ(mb[i]["loss"].get<double>(), ma[i + 3]["loss"].get<double>());

  // Three windows per micro-batch from step 4 on: step 4 ends at window 6 + 3.
  const std::string ck2 = (dir / "ck2").string();
  auto c = run_cli("train " + tiny_flags(2, 3) + data + "--steps 4 --resume " + ck + "/step-00000003" +
                   " --checkpoint-dir " + ck2);
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_EQ(position(dir / "ck2" / "step-00000004"), 9u);

  auto r = run_cli("train " + kTiny + data + "--steps 6 --seed 9 --resume " + ck);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("was trained with seed = 1234, this run has 9"), std::string::npos) << r.output;
  const std::string other = (dir / "o.bin").string();
  ASSERT_EQ(run_cli("tokenize --tokenizer bytes --input " + txt + " --out " + other + " --quiet").exit_code,
            0);
  r = run_cli("train " + kTiny + "--tokens " + other + " --val-every 0 --steps 6 --resume " + ck);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("was trained with data = "), std::string::npos) << r.output;
}
// SIGTERM (a scheduler preempting the job): the step in progress finishes, a checkpoint is saved,
// the process exits with 128 + 15, and a resumed run continues the loss of an uninterrupted one
// bit for bit (a constant learning rate, so the run length does not shape the schedule).
TEST(CliCheckpoint, SigtermSavesACheckpointThatResumesBitwise) {
  TempDir dir("strata-cli-sigterm");
  const std::string ck = (dir / "ck").string(), m = (dir / "m.jsonl").string();
  const std::string flags = kTiny + "--val-every 0 --warmup 0 --min-lr-ratio 1 ";
  const std::string script = std::string("'") + STRATA_CLI_PATH + "' train " + flags + "--steps 100000 --checkpoint-dir " +
                             ck + " --metrics " + m + " & pid=$!; " +
                             "for i in $(seq 1200); do [ -f " + m + " ] && [ $(wc -l < " + m +
                             ") -ge 3 ] && break; sleep 0.05; done; kill -TERM $pid; wait $pid; echo \"exit=$?\"";
  auto r = run_command(script);
  EXPECT_NE(r.output.find("exit=143"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("stopping after step"), std::string::npos) << r.output;
  const auto stopped = read_jsonl(m);
  ASSERT_GE(stopped.size(), 3u);
  const std::int64_t last = stopped.back()["step"].get<std::int64_t>();
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld\n", static_cast<long long>(last));
  EXPECT_EQ(read_file(dir / "ck" / "latest"), name) << "the checkpoint is of the last step finished";

  const std::string m2 = (dir / "m2.jsonl").string(), m3 = (dir / "m3.jsonl").string();
  const std::string to = std::to_string(last + 2);
  auto resumed = run_cli("train " + flags + "--steps " + to + " --resume " + ck + " --metrics " + m2);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  auto straight = run_cli("train " + flags + "--steps " + to + " --metrics " + m3);
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const auto a = read_jsonl(m3), b = read_jsonl(m2);
  ASSERT_EQ(b.size(), 2u);
  ASSERT_EQ(a.size(), static_cast<std::size_t>(last + 2));
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(b[i]["loss"].get<double>(), a[static_cast<std::size_t>(last) + i]["loss"].get<double>())
        << "step " << last + 1 + static_cast<std::int64_t>(i);
  }
}

// SIGKILL (an out-of-memory killer, a node failure): nothing runs at exit, so the default swap
// directory under $TMPDIR stays, but its swap data files were unlinked once open and went with
// the process; only the store's journal and lock remain (a few KiB, not the run's NVMe state). The
// optimizer state is on NVMe (the tiny model's parameters stay resident under the persistence
// threshold).
TEST(CliCheckpoint, AKilledRunLeavesNoSwapDataInItsTemporaryDirectory) {
  TempDir dir("strata-cli-sigkill");
  const std::filesystem::path tmp = dir / "tmp";
  std::filesystem::create_directories(tmp);
  const std::string m = (dir / "m.jsonl").string();
  const std::string script = "TMPDIR='" + tmp.string() + "' '" + STRATA_CLI_PATH + "' train " + kTiny +
                             "--offload-optimizer nvme --val-every 0 --steps 100000 --metrics " + m + " & pid=$!; " +
                             "for i in $(seq 1200); do [ -f " + m + " ] && [ $(wc -l < " + m +
                             ") -ge 2 ] && break; sleep 0.05; done; kill -KILL $pid; wait $pid; echo \"exit=$?\"";
  auto r = run_command(script);
  EXPECT_NE(r.output.find("exit=137"), std::string::npos) << r.output;
  ASSERT_GE(read_jsonl(m).size(), 2u) << "the run trained before it was killed";
  int swap_dirs = 0, data_files = 0;
  for (const auto& d : std::filesystem::directory_iterator(tmp)) {
    if (d.path().filename().string().rfind("strata-swap-", 0) != 0) continue;
    ++swap_dirs;
    EXPECT_TRUE(std::filesystem::exists(d.path() / "strata-swap.journal")) << d.path();
    for (const auto& e : std::filesystem::directory_iterator(d.path()))
      data_files += e.path().extension() == ".data" ? 1 : 0;
  }
  EXPECT_EQ(swap_dirs, 1) << "the optimizer state swaps to NVMe under $TMPDIR";
  EXPECT_EQ(data_files, 0) << "the killed run's swap data went with it";
}

}  // namespace
}  // namespace strata::testing
