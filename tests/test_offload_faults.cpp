// Faults during training lose nothing: an I/O error while fetching parameters fails the step and
// changes no state (retrying continues the exact trajectory); a dead disk under the NVMe
// optimizer surfaces as an error naming the swap file, and loading the last checkpoint into the
// same engine continues the exact trajectory; a full disk while checkpointing fails that save
// only, naming the file, and `latest` keeps naming the previous checkpoint.
#include <gtest/gtest.h>
#include <sys/mount.h>

#include <cerrno>
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
    faults.errors.push_back({op, dir.path().string(), offset, err});
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
  faults.errors.clear();
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
  // Nothing more runs while the error stands.
  batch(c, 3, in, tg);
  EXPECT_FALSE((*engine)->step(in, tg).ok());
  // The disk is replaced; the last checkpoint goes back into the same engine.
  faults.errors.clear();
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
