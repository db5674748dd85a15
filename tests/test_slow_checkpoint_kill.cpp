// Killed at random moments, resumed, killed again: `strata train` with a checkpoint after every
// step is SIGKILLed at seeded random times — during steps, while writing checkpoint files, while
// publishing — and restarted with --resume until a run completes. Nothing may be lost: the final
// weights equal the uninterrupted run's byte for byte. (Label `slow`: a minute or two.)
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "harness/harness.hpp"

namespace strata::testing {
namespace {

namespace fs = std::filesystem;

// The output of the last run_and_kill (stdout and stderr), to show when a run fails.
const fs::path& run_log() {
  static const fs::path p = temp_root() / ("strata-kill-" + std::to_string(::getpid()) + ".log");
  return p;
}

// Starts the CLI with `args`, output to run_log(). Once the checkpoint root's `latest` changes
// (the run made progress) it waits `delay` more and kills the process with SIGKILL, unless the
// run exits first. Returns its exit code, or -1 when it was killed.
int run_and_kill(const std::vector<std::string>& args, const fs::path& latest, std::chrono::milliseconds delay) {
  const std::string before = read_file(latest);
  const std::string log_path = run_log().string();  // named here: the child's pid differs
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(log, 1);
    ::dup2(log, 2);
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(STRATA_CLI_PATH));
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(STRATA_CLI_PATH, argv.data());
    ::_exit(127);
  }
  int status = 0;
  std::optional<std::chrono::steady_clock::time_point> deadline;
  for (;;) {
    if (::waitpid(pid, &status, WNOHANG) == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
    if (!deadline && !latest.empty() && read_file(latest) != before) deadline = std::chrono::steady_clock::now() + delay;
    if (deadline && std::chrono::steady_clock::now() >= *deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(SlowCheckpoint, KilledAtRandomMomentsAndResumedLosesNothing) {
  TempDir dir("strata-kill");
  const std::vector<std::string> common = {"train", "--layers", "2", "--width", "32", "--heads", "2",
                                           "--seq-len", "32", "--batch", "2", "--threads", "1",
                                           "--steps", "120", "--val-every", "0", "--quiet"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = common;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  ASSERT_EQ(run_and_kill(with({"--save-weights", (dir / "ref.safetensors").string()}), "", {}), 0);

  const std::string ck = (dir / "ck").string();
  const std::string out = (dir / "out.safetensors").string();
  std::mt19937 rng(20261123);
  // Each attempt is killed at a random moment after its first new checkpoint: inside a step,
  // inside the next checkpoint's file writes, or while it publishes.
  std::uniform_int_distribution<long> delay(0, 150);
  int kills = 0, attempts = 0;
  bool finished = false;
  for (; attempts < 40 && !finished; ++attempts) {
    std::vector<std::string> extra = {"--checkpoint-dir", ck, "--checkpoint-every", "1", "--save-weights", out};
    if (fs::exists(fs::path(ck) / "latest")) {
      extra.push_back("--resume");
      extra.push_back(ck);
    }
    const int rc = run_and_kill(with(extra), fs::path(ck) / "latest", std::chrono::milliseconds(delay(rng)));
    if (rc == -1) {
      ++kills;
      continue;
    }
    ASSERT_EQ(rc, 0) << "attempt " << attempts << " failed after " << kills << " kills:\n" << read_file(run_log());
    finished = true;
  }
  if (!finished) {  // the remaining steps, uninterrupted
    ASSERT_EQ(run_and_kill(with({"--checkpoint-dir", ck, "--resume", ck, "--save-weights", out}), "", {}), 0);
  }
  std::printf("%d runs killed, %d attempts\n", kills, attempts);
  EXPECT_GE(kills, 5) << "too few kills to mean anything";
  const std::string ref = read_file(dir / "ref.safetensors");
  ASSERT_GT(ref.size(), 1000u);
  EXPECT_TRUE(ref == read_file(out)) << "weights after " << kills << " kills differ from the uninterrupted run";
  // No half-written checkpoint is ever named; leftovers of killed saves are gone or unnamed.
  EXPECT_EQ(read_file(fs::path(ck) / "latest"), "step-00000120\n");
}

}  // namespace
}  // namespace strata::testing
