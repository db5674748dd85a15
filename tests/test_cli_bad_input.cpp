// Bad command lines, one per case: every numeric flag has a range, and a value outside it (or
// one that does not fit 64 bits) is a usage error (exit 2) naming the flag, the value and the
// range; a repeated flag is an error naming it. None of these may run the command. Then files
// that exist but are wrong (data, config, tokenizer, weights): exit 1 naming the file and the fault.
#include <string>
#include <vector>

#include "harness/harness.hpp"

namespace strata::testing {
namespace {

struct Case {
  std::string args;
  std::vector<std::string> needles;  // each must appear in the output
};

void expect_usage_errors(const std::vector<Case>& cases) {
  for (const auto& c : cases) {
    auto r = run_cli(c.args);
    EXPECT_EQ(r.exit_code, 2) << "strata " << c.args << "\n" << r.output;
    for (const auto& n : c.needles) {
      EXPECT_NE(r.output.find(n), std::string::npos) << "strata " << c.args << "\n" << r.output;
    }
    EXPECT_NE(r.output.find("usage: strata"), std::string::npos) << "strata " << c.args << "\n" << r.output;
    EXPECT_EQ(r.output.find("\"benchmark\""), std::string::npos) << "strata " << c.args << " ran\n"
                                                                 << r.output;
  }
}

// Small shapes, so that a case which wrongly runs anyway finishes quickly.
const std::string kTinyStep =
    " --layers 1 --width 64 --heads 2 --seq-len 32 --batch 2 --steps 1 --warmup 0 --reps 1";
const std::string kTinyTrain =
    " --layers 1 --width 32 --heads 2 --seq-len 16 --batch 2 --steps 1 --val-windows 1";

TEST(CliBadInput, IntegersThatDoNotFitAreRangeErrors) {
  expect_usage_errors({
      // 2^32 used to wrap to 0 steps and print a benchmark of nothing.
      {"bench alloc --steps 4294967296", {"'--steps'", "4294967296", "[3, 10000]"}},
      {"bench alloc --layers 4294967297", {"'--layers'", "4294967297", "[1, 1024]"}},
      {"bench alloc --batch 4294967296", {"'--batch'", "[1, 1024]"}},
      {"bench alloc --seed 4294967296", {"'--seed'", "[0, 4294967295]"}},
      // Beyond 64 bits: strtoll used to saturate silently.
      {"bench alloc --steps 99999999999999999999", {"'--steps'", "99999999999999999999", "[3, 10000]"}},
      {"bench step --steps 4294967296" + std::string(" --layers 1 --width 64 --heads 2"),
       {"'--steps'", "4294967296", "[1, 100000]"}},
      {"train --seed 99999999999999999999" + kTinyTrain, {"'--seed'", "99999999999999999999"}},
      {"train --steps 1099511627777", {"'--steps'", "[1, 1099511627776]"}},
      {"eval --weights w --data d --max-windows -1", {"'--max-windows'", "-1"}},
      {"config a.json --data-parallel-size 4294967297",
       {"'--data-parallel-size'", "4294967297", "[1, 1048576]"}},
  });
}

// bench comm checks its flags before it starts MPI (in a build without MPI too), so these run
// without mpirun.
TEST(CliBadInput, BenchCommNamesAnUnknownOperation) {
  expect_usage_errors({
      {"bench comm --ops all_reduce,allreduce", {"--ops", "'allreduce'", "all_reduce, reduce_scatter"}},
      {"bench comm --ops all_gather,,sendrecv", {"--ops", "''"}},
      {"bench comm --min-bytes 2MiB --max-bytes 1MiB", {"--min-bytes exceeds --max-bytes"}},
  });
}

TEST(CliBadInput, QueueDepthsAndThreadCountsDoNotWrapTo32Bits) {
  TempDir dir("strata-cli-bad");
  const std::string nvme = "bench nvme --path " + dir.path().string() + " --size 1MiB";
  expect_usage_errors({
      {nvme + " --queue-depth 4294967297", {"'--queue-depth'", "4294967297", "[1, 32768]"}},
      {nvme + " --queue-depth 0", {"'--queue-depth'", "[1, 32768]"}},
      {nvme + " --threads 4294967296", {"'--threads'", "4294967296", "[1, 1024]"}},
      {"bench adam --params 4096 --reps 1 --threads 4294967297", {"'--threads'", "4294967297", "[0, 1024]"}},
      {"bench adam --reps 0", {"'--reps'", "[1, 1000]"}},
      {"bench step --threads 4294967297" + kTinyStep, {"'--threads'", "4294967297", "[0, 4096]"}},
      {"train --threads 4294967297" + kTinyTrain, {"'--threads'", "4294967297"}},
  });
}

TEST(CliBadInput, ByteSizesHaveRangesToo) {
  TempDir dir("strata-cli-bad");
  const std::string nvme = "bench nvme --path " + dir.path().string();
  expect_usage_errors({
      {nvme + " --size 0", {"'--size'", "at least"}},
      {nvme + " --size 1MiB --window 0", {"'--window'", "at least"}},
      {"bench adam --params 0", {"'--params'", "at least"}},
      {"bench adam --params 1TiB", {"'--params'", "1TiB", "at most"}},
      {"device --memory 10000000TiB", {"--memory", "10000000TiB"}},
  });
}

TEST(CliBadInput, MalformedNumbersNameTheFlagAndTheValue) {
  expect_usage_errors({
      {"bench alloc --steps 5x", {"'--steps'", "'5x'", "integer"}},
      {"bench alloc --steps=", {"'--steps'", "integer"}},
      {"bench alloc --steps 0x10", {"'--steps'", "'0x10'"}},
      {"bench alloc --steps 1e3", {"'--steps'", "'1e3'"}},
      {"train --lr nan", {"'--lr'", "nan"}},
      {"train --grad-clip inf", {"'--grad-clip'", "inf"}},
  });
}

TEST(CliBadInput, ARepeatedFlagIsAnError) {
  expect_usage_errors({
      {"bench alloc --steps 5 --steps 6", {"'--steps'", "twice"}},
      {"bench alloc --steps=5 --steps 5", {"'--steps'", "twice"}},
      {"bench alloc --json --json", {"'--json'", "twice"}},
      {"train --lr 0.1 --lr 0.2" + kTinyTrain, {"'--lr'", "twice"}},
      {"config a.json --json --json", {"'--json'", "twice"}},
  });
}

// bench step measures the cpu backend: asking it for cuda is a usage error (exit 2), on a
// machine with no GPU or CUDA backend too, not a run that failed.
TEST(CliBadInput, BenchStepOnCudaExitsTwo) {
  expect_usage_errors({
      {"bench step --device cuda" + kTinyStep, {"cuda", "--device"}},
  });
}

// train and eval on cuda where there is no GPU (or no CUDA in the build): exit 2 with the
// reason, like bench step, not a run that failed. On a machine with a GPU they would train.
TEST(CliBadInput, TrainAndEvalOnCudaWithoutAGpuExitTwo) {
  const GpuProbe gpu = probe_gpu();
  if (gpu.state == GpuState::kPresent) GTEST_SKIP() << "this machine has a GPU: --device cuda would run";
  TempDir dir("strata-cli-cuda");
  std::string text;
  for (int i = 0; i < 200; ++i) text += "line " + std::to_string(i) + " of the tiny corpus.\n";
  const std::string data = write_file(dir / "data.txt", text);
  const std::string weights = (dir / "w.safetensors").string();
  auto saved = run_cli("train" + kTinyTrain + " --data " + data + " --save-weights " + weights + " --out " +
                       (dir / "run").string());
  ASSERT_EQ(saved.exit_code, 0) << saved.output;
  const std::vector<std::string> gpu_words = {"--device cuda", "device 'cuda'"};
  expect_usage_errors({
      {"train --device cuda" + kTinyTrain + " --data " + data + " --out " + (dir / "run2").string(), gpu_words},
      {"eval --device cuda --weights " + weights + " --data " + data + " --seq-len 16", gpu_words},
  });
}

// Files that are there but wrong: exit 1, naming the file and what is wrong with it.
TEST(CliBadInput, BadFilesExitOneNamingWhatIsWrong) {
  TempDir dir("strata-cli-bad");
  const std::string empty = write_file(dir / "empty.txt", "");
  const std::string tiny = write_file(dir / "tiny.txt", "ab");
  const std::string json = write_file(dir / "trunc.json", "{\"a\":");
  const std::string vocab = write_file(dir / "vocab.json", "not json");
  const std::string merges = write_file(dir / "merges.txt", "#version: 0.2\na b\n");
  const std::string header = "{\"t\":{\"dtype\":\"F32\"";
  const std::string truncated =
      write_file(dir / "trunc.safetensors", std::string("\x10\0\0\0\0\0\0\0", 8) + header);
  const std::string huge = write_file(dir / "huge.safetensors", std::string(8, '\xff') + "{}");
  struct FileCase {
    std::string args;
    std::vector<std::string> needles;
  };
  const std::vector<FileCase> cases = {
      {"train --data " + empty + kTinyTrain, {empty, "has 0 bytes", "at least 64"}},
      {"train --data " + tiny + kTinyTrain, {tiny, "has 2 bytes"}},
      {"train --config " + json + kTinyTrain, {json + ":1:6: invalid JSON"}},
      {"train --vocab " + vocab + " --merges " + merges + kTinyTrain, {vocab, "not valid JSON"}},
      {"eval --weights " + truncated + " --data " + tiny, {truncated, "header is not valid JSON"}},
      {"eval --weights " + huge + " --data " + tiny, {huge, "exceeds the file"}},
      {"train --val-data " + (dir / "none.txt").string() + kTinyTrain, {"none.txt", "cannot be opened"}},
  };
  for (const auto& c : cases) {
    auto r = run_cli(c.args);
    EXPECT_EQ(r.exit_code, 1) << "strata " << c.args << "\n" << r.output;
    for (const auto& n : c.needles) {
      EXPECT_NE(r.output.find(n), std::string::npos) << "strata " << c.args << "\n" << r.output;
    }
  }
}

}  // namespace
}  // namespace strata::testing
