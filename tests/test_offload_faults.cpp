// Faults during training lose nothing: an I/O error while fetching parameters fails the step and
// changes no state (retrying continues the exact trajectory); a write error in the middle of a
// step's host update (the NVMe optimizer's sub-groups, NVMe-homed parameters) is reported once and
// then finished in place by the next call, updating only what did not hold the step yet, and the
// trajectory continues bit for bit; a dead disk under the NVMe optimizer surfaces as an error
// naming the swap file, and loading the last checkpoint into the same engine continues the exact
// trajectory; a full disk while checkpointing fails that save only, naming the file, and `latest`
// keeps naming the previous checkpoint.
#include <gtest/gtest.h>
#include <sys/mount.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "harness/harness.hpp"
#include "nvme/faults.hpp"
#include "offload/internal.hpp"
#include "offload_fixture.hpp"
#include "strata/checkpoint.hpp"

namespace strata::testing {
namespace {

namespace fs = std::filesystem;

// Every piece of `op` on the swap files under `dir` fails with `err` (a dead disk).
void fail_everything(nvme_detail::IoFaults& faults, IoOp op, const TempDir& dir, int err) {
  for (std::uint64_t offset = 0; offset < (64u << 20); offset += 4096) {
    faults.add_error({op, dir.path().string(), offset, err});
  }
}

TEST(OffloadFaults, ReadErrorWhileFetchingFailsTheStepAndChangesNothing) {
  const TrainerConfig c = tiny(ModelKind::kGpt2, DType::kBF16, 1, 1.0);
  TempDir ref_dir("strata-fault-ref"), dir("strata-fault");
  const OffloadSettings ref_settings = settings_for({Tier::kNvme, Tier::kHost}, ref_dir);
  const Snapshot ref = train(c, ref_settings, 3);
  ASSERT_EQ(ref.losses.size(), 3u);

  nvme_detail::IoFaults faults;
  auto device = make_device();
  auto engine = offload_detail::EngineFaults::create(c, settings_for({Tier::kNvme, Tier::kHost}, dir), *device, &faults);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  Snapshot got;
  ASSERT_TRUE(run_steps(**engine, c, 0, 1, got));
  fail_everything(faults, IoOp::kRead, dir, EIO);
  std::vector<std::int32_t> in, tg;
  batch(c, 1, in, tg);
  auto failed = (*engine)->step(in, tg);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError) << failed.status().to_string();
  EXPECT_NE(failed.status().message().find(dir.path().string()), std::string::npos) << failed.status().to_string();
  EXPECT_NE(failed.status().message().find("NVMe read of param."), std::string::npos) << failed.status().to_string();
  EXPECT_EQ((*engine)->steps_done(), 1);
  // The disk recovers: the same step again, then the rest, exactly as if nothing had failed.
  faults.clear_errors();
  ASSERT_TRUE(run_steps(**engine, c, 1, 3, got));
  ASSERT_TRUE(capture_state(**engine, got));
  expect_same(ref, got, "after a failed fetch and a retry");
}

TEST(OffloadFaults, DeadDiskUnderTheNvmeOptimizerSurfacesAndACheckpointRecovers) {
  const TrainerConfig c = tiny(ModelKind::kLlama, DType::kBF16, 1, 1.0);
  TempDir ref_dir("strata-fault-ref"), dir("strata-fault"), root("strata-fault-ckpt");
  const Snapshot ref = train(c, settings_for({Tier::kDevice, Tier::kNvme}, ref_dir), 4);
  ASSERT_EQ(ref.losses.size(), 4u);

  nvme_detail::IoFaults faults;
  auto device = make_device();
  auto engine = offload_detail::EngineFaults::create(c, settings_for({Tier::kDevice, Tier::kNvme}, dir), *device, &faults);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  Snapshot got;
  ASSERT_TRUE(run_steps(**engine, c, 0, 2, got));
  ASSERT_TRUE((*engine)->save_checkpoint(root.path().string()).ok());
  fail_everything(faults, IoOp::kWrite, dir, EIO);
  // The update of step 3 runs after its gradient norm is known, overlapped with what follows:
  // its write error surfaces at the next synchronisation point.
  std::vector<std::int32_t> in, tg;
  batch(c, 2, in, tg);
  auto m = (*engine)->step(in, tg);
  Status failed = m.ok() ? (*engine)->synchronize() : m.status();
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.code(), StatusCode::kIoError) << failed.to_string();
  EXPECT_NE(failed.message().find(dir.path().string()), std::string::npos) << failed.to_string();
  // While the disk stays dead every retry of the update fails again, and nothing more runs.
  batch(c, 3, in, tg);
  auto retried = (*engine)->step(in, tg);
  ASSERT_FALSE(retried.ok());
  EXPECT_NE(retried.status().message().find("retrying the update of step 3"), std::string::npos)
      << retried.status().to_string();
  EXPECT_EQ((*engine)->steps_done(), 3);
  // The disk is replaced; the last checkpoint goes back into the same engine.
  faults.clear_errors();
  auto loaded = (*engine)->load_checkpoint(root.path().string());
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->step, 2);
  got.losses.resize(2);
  got.norms.resize(2);
  got.scales.resize(2);
  got.skipped.resize(2);
  ASSERT_TRUE(run_steps(**engine, c, 2, 4, got));
  ASSERT_TRUE(capture_state(**engine, got));
  expect_same(ref, got, "after a dead disk and a checkpoint reload");
}

// Retrying a failed host update in place. `fraction` of one step's write bytes go through, then
// the disk fails every write: the update of one applied step (k) stops part-way (1: at its first
// write; the size of a step less one: at its last). The error is reported once (by
// synchronize(), or by the next step() when `report_in_step`), a retry while the disk is still
// dead fails again, and once the disk is back the next call finishes step k's update — writing
// less than a whole step unless nothing had gone through — and training continues bit for bit as
// in the run without the fault (losses, norms, loss scales and skips, and every parameter,
// master and moment at the end).
enum class FailAt { kFirst, kMiddle, kLast };

void retry_in_place(const TrainerConfig& c, OffloadSettings s, FailAt at, bool report_in_step,
                    const char* what) {
  SCOPED_TRACE(what);
  constexpr int kSteps = 7;
  TempDir ref_dir("strata-retry-ref"), dir("strata-retry");
  OffloadSettings ref_settings = s;
  ref_settings.nvme_path = {ref_dir.path().string()};
  s.nvme_path = {dir.path().string()};
  // Step k (0-based batch index) fails; steps k-1 and k must both be applied (fp16 skips some):
  // k-1 measures one step's writes, k is the one whose update fails.
  const Snapshot plain = train(c, ref_settings, kSteps);
  ASSERT_EQ(plain.losses.size(), static_cast<std::size_t>(kSteps));
  int k = -1;
  for (int i = 2; i + 2 <= kSteps && k < 0; ++i)
    if (plain.skipped[static_cast<std::size_t>(i - 1)] == 0 &&
        plain.skipped[static_cast<std::size_t>(i)] == 0)
      k = i;
  ASSERT_GE(k, 2) << "no two applied steps in a row";
  // The reference synchronises where the faulty run does (after steps k-1, k and k+1's update):
  // with the delayed update a synchronize is a flush, which the trajectory depends on.
  Snapshot ref;
  {
    auto device = make_device();
    auto engine = OffloadEngine::create(c, ref_settings, *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    for (int i = 0; i < kSteps; ++i) {
      ASSERT_TRUE(run_steps(**engine, c, i, i + 1, ref));
      if (i >= k - 2 && i <= k) {
        ASSERT_TRUE((*engine)->synchronize().ok());
      }
    }
    ASSERT_TRUE(capture_state(**engine, ref));
  }

  nvme_detail::IoFaults faults;
  auto device = make_device();
  auto engine = offload_detail::EngineFaults::create(c, s, *device, &faults);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  OffloadEngine& e = **engine;
  Snapshot got;
  ASSERT_TRUE(run_steps(e, c, 0, k - 1, got));
  ASSERT_TRUE(e.synchronize().ok());  // after step k-1 (1-based)
  const std::uint64_t b1 = faults.write_bytes_started.load();
  ASSERT_TRUE(run_steps(e, c, k - 1, k, got));
  ASSERT_TRUE(e.synchronize().ok());
  const std::uint64_t b2 = faults.write_bytes_started.load();
  const std::uint64_t per_step = b2 - b1;
  ASSERT_GT(per_step, 0u);
  const std::uint64_t through = at == FailAt::kFirst    ? 1
                                : at == FailAt::kMiddle ? per_step / 2
                                                        : per_step - 1;
  faults.fail_writes_after_bytes = b2 + through;
  // Step k returns once its norm is known; its update fails behind it.
  ASSERT_TRUE(run_steps(e, c, k, k + 1, got));
  const std::string step_name = "step " + std::to_string(k + 1);
  std::vector<std::int32_t> in, tg;
  batch(c, k + 1, in, tg);
  Status first = report_in_step ? e.step(in, tg).status() : e.synchronize();
  ASSERT_FALSE(first.ok()) << "the update of " << step_name << " did not fail";
  EXPECT_EQ(first.code(), StatusCode::kIoError) << first.to_string();
  EXPECT_NE(first.message().find(dir.path().string()), std::string::npos) << first.to_string();
  EXPECT_EQ(e.steps_done(), k + 1);
  Status again = e.synchronize();
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.message().find("retrying the update of " + step_name), std::string::npos)
      << again.to_string();
  // The disk is back: the next call finishes the update in place.
  faults.fail_writes_after_bytes = 0;
  const std::uint64_t before_retry = faults.write_bytes_started.load();
  Status retried = e.synchronize();
  ASSERT_TRUE(retried.ok()) << retried.to_string();
  const std::uint64_t retry_bytes = faults.write_bytes_started.load() - before_retry;
  EXPECT_GT(retry_bytes, 0u);
  if (at == FailAt::kFirst) {
    EXPECT_EQ(retry_bytes, per_step);
  } else {
    EXPECT_LT(retry_bytes, per_step) << "the retry rewrote what had already gone through";
  }
  EXPECT_EQ(e.steps_done(), k + 1);
  ASSERT_TRUE(run_steps(e, c, k + 1, kSteps, got));
  ASSERT_TRUE(capture_state(e, got));
  expect_same(ref, got, what);
}

TEST(OffloadFaults, NvmeOptimizerWriteErrorIsRetriedInPlaceFp32) {
  const TrainerConfig c = tiny(ModelKind::kGpt2, DType::kF32, 1, 1.0);
  TempDir unused("strata-retry-unused");
  const OffloadSettings s = settings_for({Tier::kDevice, Tier::kNvme}, unused);
  retry_in_place(c, s, FailAt::kFirst, false, "fp32, first write");
  retry_in_place(c, s, FailAt::kMiddle, false, "fp32, middle");
  retry_in_place(c, s, FailAt::kLast, true, "fp32, last write, reported by step()");
}

TEST(OffloadFaults, NvmeOptimizerWriteErrorIsRetriedInPlaceFp16SubGroups) {
  // fp16: the loss scaler moved once, when the failed step returned; the retry must not move it.
  const TrainerConfig c = tiny(ModelKind::kLlama, DType::kF16, 2, 0.0);
  TempDir unused("strata-retry-unused");
  OffloadSettings s = settings_for({Tier::kNvme, Tier::kNvme}, unused);
  s.sub_group_size = 4097;  // modules split into several sub-groups: a unit fails part-way
  retry_in_place(c, s, FailAt::kMiddle, true, "fp16, parameters on NVMe, sub-groups of 4097, middle");
  s.gradients = Tier::kNvme;
  retry_in_place(c, s, FailAt::kLast, false, "fp16, NVMe gradients, last write");
}

TEST(OffloadFaults, HostOptimizerParameterWriteErrorIsRetriedInPlace) {
  // Host optimizer, parameters at home on NVMe: Adam has run in host memory when the write of
  // the new parameters fails; the retry publishes them again without a second update.
  const TrainerConfig c = tiny(ModelKind::kGpt2, DType::kBF16, 1, 1.0);
  TempDir unused("strata-retry-unused");
  const OffloadSettings s = settings_for({Tier::kNvme, Tier::kHost}, unused);
  retry_in_place(c, s, FailAt::kMiddle, false, "bf16, host optimizer, middle");
  retry_in_place(c, s, FailAt::kLast, true, "bf16, host optimizer, last write");
}

TEST(OffloadFaults, DelayedUpdateWriteErrorIsRetriedInPlace) {
  const TrainerConfig c = tiny(ModelKind::kGpt2, DType::kBF16, 1, 1.0);
  TempDir unused("strata-retry-unused");
  OffloadSettings s = settings_for({Tier::kDevice, Tier::kNvme}, unused);
  s.delayed_update = true;
  retry_in_place(c, s, FailAt::kMiddle, true, "bf16, delayed update, middle");
}

TEST(OffloadFaults, DelayedUpdateWithParametersOnNvmeWriteErrorIsRetriedInPlace) {
  // The delayed update writes each unit's next version (the other NVMe shard); a failed write
  // leaves that version unpublished and the retry writes it again before the flip.
  const TrainerConfig c = tiny(ModelKind::kLlama, DType::kBF16, 1, 1.0);
  TempDir unused("strata-retry-unused");
  OffloadSettings s = settings_for({Tier::kNvme, Tier::kNvme}, unused);
  s.delayed_update = true;
  s.sub_group_size = 4097;
  retry_in_place(c, s, FailAt::kMiddle, true, "bf16, delayed update, parameters on NVMe, middle");
  s.optimizer = Tier::kHost;
  retry_in_place(c, s, FailAt::kLast, false, "bf16, delayed update, host optimizer, parameters on NVMe, last");
}

// A non-finite gradient norm (fp32 and bf16, where the update waits for the norm) fails the
// step's own call with nothing changed — no parameter, master or moment, nor the step count —
// and the engine is not stuck: once the cause is gone (here a NaN planted in the embedding,
// which GPT-2's tied head spreads to every gradient) the same step runs again and the run
// continues bit for bit as the run that never saw the NaN.
TEST(OffloadFaults, NonFiniteNormFailsItsStepWithNothingChangedAndTheStepRunsAgain) {
  for (const Placement p : {Placement{Tier::kDevice, Tier::kHost}, Placement{Tier::kNvme, Tier::kNvme}}) {
    for (double clip : {1.0, 0.0}) {
      const TrainerConfig c = tiny(ModelKind::kGpt2, DType::kF32, 1, clip);
      const std::string what = std::string("params ") + std::string(to_string(p.params)) + ", optimizer " +
                               std::string(to_string(p.optimizer)) + ", clip " + std::to_string(clip);
      SCOPED_TRACE(what);
      TempDir ref_dir("strata-nonfinite-ref"), dir("strata-nonfinite");
      OffloadSettings s = settings_for(p, dir);
      // Clipping off with the host optimizer updates units as they land (update_during_backward):
      // a non-finite unit found before any update is the same failure; turn it off here so the
      // norm decides (the landed-unit case is in the docs' "Faults").
      s.update_during_backward = false;
      OffloadSettings ref_settings = s;
      ref_settings.nvme_path = {ref_dir.path().string()};
      const Snapshot ref = train(c, ref_settings, 4);
      auto device = make_device();
      auto engine = OffloadEngine::create(c, s, *device);
      ASSERT_TRUE(engine.ok()) << engine.status().to_string();
      OffloadEngine& e = **engine;
      Snapshot got;
      ASSERT_TRUE(run_steps(e, c, 0, 2, got));
      Snapshot before;
      ASSERT_TRUE(capture_state(e, before));
      const ModelLayout& L = e.model().layout();
      int first = -1;
      for (std::size_t i = 0; i < L.params.size() && first < 0; ++i)
        if (L.params[i].owns_storage()) first = static_cast<int>(i);
      ASSERT_GE(first, 0);
      std::vector<float> bad = before.param[0];
      bad[0] = std::nanf("");
      ASSERT_TRUE(e.set_param(first, bad).ok());
      std::vector<std::int32_t> in, tg;
      batch(c, 2, in, tg);
      auto failed = e.step(in, tg);
      ASSERT_FALSE(failed.ok());
      EXPECT_EQ(failed.status().code(), StatusCode::kInvalidArgument) << failed.status().to_string();
      EXPECT_NE(failed.status().message().find("not finite"), std::string::npos) << failed.status().to_string();
      EXPECT_NE(failed.status().message().find("nothing was updated"), std::string::npos)
          << failed.status().to_string();
      EXPECT_EQ(e.steps_done(), 2);
      // The next call is not refused: it restores the parameter and finds every other state as before.
      ASSERT_TRUE(e.set_param(first, before.param[0]).ok());
      Snapshot after;
      ASSERT_TRUE(capture_state(e, after));
      for (std::size_t i = 0; i < before.param.size(); ++i) {
        EXPECT_TRUE(bitwise_equal(before.param[i], after.param[i])) << "parameter " << i;
        EXPECT_TRUE(bitwise_equal(before.master[i], after.master[i])) << "master " << i;
        EXPECT_TRUE(bitwise_equal(before.m[i], after.m[i])) << "exp_avg " << i;
        EXPECT_TRUE(bitwise_equal(before.v[i], after.v[i])) << "exp_avg_sq " << i;
      }
      ASSERT_TRUE(run_steps(e, c, 2, 4, got));
      ASSERT_TRUE(capture_state(e, got));
      expect_same(ref, got, what);
    }
  }
}

// A small tmpfs mounted for the test (needs CAP_SYS_ADMIN; skipped with the reason otherwise).
class SmallDisk {
 public:
  SmallDisk(const fs::path& where, std::uint64_t bytes) : where_(where) {
    fs::create_directories(where);
    const std::string opts = "size=" + std::to_string(bytes);
    if (::mount("tmpfs", where.c_str(), "tmpfs", 0, opts.c_str()) != 0) {
      error_ = std::string("cannot mount a small tmpfs: ") + std::strerror(errno);
    }
  }
  ~SmallDisk() {
    if (error_.empty()) ::umount2(where_.c_str(), MNT_DETACH);
  }
  const std::string& error() const { return error_; }

 private:
  fs::path where_;
  std::string error_;
};

std::uint64_t tree_bytes(const fs::path& dir) {
  std::uint64_t total = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) total += e.file_size();
  return total;
}

TEST(OffloadFaults, FullDiskWhileCheckpointingKeepsThePreviousCheckpoint) {
  const TrainerConfig c = tiny(ModelKind::kGpt2, DType::kF32, 1, 1.0);
  TempDir dir("strata-fault"), scratch("strata-fault-size");
  auto device = make_device();
  auto engine = OffloadEngine::create(c, settings_for({Tier::kNvme, Tier::kHost}, dir), *device);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  Snapshot got;
  ASSERT_TRUE(run_steps(**engine, c, 0, 1, got));
  ASSERT_TRUE((*engine)->save_checkpoint(scratch.path().string()).ok());
  const std::uint64_t one = tree_bytes(scratch.path());
  // Room for one checkpoint and a half: the second save runs out of space part-way.
  SmallDisk disk(scratch.path() / "disk", one + one / 2 + 64 * 1024);
  if (!disk.error().empty()) GTEST_SKIP() << disk.error();
  const std::string root = (scratch.path() / "disk").string();
  auto first = (*engine)->save_checkpoint(root);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  Snapshot at_first;
  ASSERT_TRUE(capture_state(**engine, at_first));
  ASSERT_TRUE(run_steps(**engine, c, 1, 2, got));
  auto second = (*engine)->save_checkpoint(root);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kIoError) << second.status().to_string();
  EXPECT_NE(second.status().message().find(std::strerror(ENOSPC)), std::string::npos) << second.status().to_string();
  EXPECT_NE(second.status().message().find(root), std::string::npos) << second.status().to_string();
  // `latest` still names the first, which loads; the unfinished save left nothing behind.
  auto latest = resolve_checkpoint(root);
  ASSERT_TRUE(latest.ok()) << latest.status().to_string();
  EXPECT_EQ(*latest, *first);
  for (const auto& e : fs::directory_iterator(root)) {
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
  }
  ASSERT_TRUE((*engine)->load_checkpoint(root).ok());
  Snapshot restored;
  ASSERT_TRUE(capture_state(**engine, restored));
  expect_same(at_first, restored, "the first checkpoint after a failed second save");
}

}  // namespace
}  // namespace strata::testing
