// Checkpoints of every tier: a run saved under one placement and resumed under another continues
// the very trajectory of the uninterrupted run, bit for bit; publishing is atomic (a save that
// never finished leaves the previous checkpoint as `latest`); a corrupt, truncated or foreign
// checkpoint is refused, naming the file or key, before any state changes.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "harness/harness.hpp"
#include "offload_fixture.hpp"
#include "strata/checkpoint.hpp"
#include "strata/offload.hpp"

namespace strata::testing {
namespace {

namespace fs = std::filesystem;

struct ResumeCase {
  ModelKind kind;
  DType dtype;
  std::int64_t accum;
  double clip;
  Placement before, after;
};

class CheckpointResume : public ::testing::TestWithParam<ResumeCase> {};

// 6 steps straight under `before`, against 3 steps under `before`, a checkpoint, a fresh engine
// under `after` that loads it, and 3 more steps: same losses, norms and complete state.
TEST_P(CheckpointResume, ContinuesTheUninterruptedRunBitForBit) {
  const ResumeCase rc = GetParam();
  const TrainerConfig c = tiny(rc.kind, rc.dtype, rc.accum, rc.clip);
  TempDir swap_a("strata-ckpt-swap-a"), swap_b("strata-ckpt-swap-b"), root("strata-ckpt");

  Snapshot straight;
  {
    auto device = make_device();
    auto engine = OffloadEngine::create(c, settings_for(rc.before, swap_a), *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    ASSERT_TRUE(run_steps(**engine, c, 0, 6, straight));
    ASSERT_TRUE(capture_state(**engine, straight));
  }
  fs::remove_all(swap_a.path());
  fs::create_directories(swap_a.path());

  Snapshot resumed;
  {
    auto device = make_device();
    auto engine = OffloadEngine::create(c, settings_for(rc.before, swap_a), *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    ASSERT_TRUE(run_steps(**engine, c, 0, 3, resumed));
    auto dir = (*engine)->save_checkpoint(root.path().string(), R"({"next_batch": 3})");
    ASSERT_TRUE(dir.ok()) << dir.status().to_string();
    EXPECT_EQ(fs::path(*dir).filename(), "step-00000003");
  }
  {
    auto device = make_device();
    auto engine = OffloadEngine::create(c, settings_for(rc.after, swap_b), *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    auto m = (*engine)->load_checkpoint(root.path().string());
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    EXPECT_EQ(m->step, 3);
    EXPECT_EQ((*engine)->steps_done(), 3);
    EXPECT_EQ(nlohmann::json::parse(m->client_state).at("next_batch").get<int>(), 3);
    ASSERT_TRUE(run_steps(**engine, c, 3, 6, resumed));
    ASSERT_TRUE(capture_state(**engine, resumed));
  }
  expect_same(straight, resumed, "resumed run");
}

std::string case_name(const ::testing::TestParamInfo<ResumeCase>& info) {
  const ResumeCase& r = info.param;
  auto t = [](Tier x) { return std::string(to_string(x)); };
  return std::string(to_string(r.kind)) + "_" + std::string(to_string(r.dtype)) + "_" + t(r.before.params) +
         t(r.before.optimizer) + "_to_" + t(r.after.params) + t(r.after.optimizer);
}

INSTANTIATE_TEST_SUITE_P(
    Placements, CheckpointResume,
    ::testing::Values(
        ResumeCase{ModelKind::kGpt2, DType::kBF16, 2, 1.0, {Tier::kDevice, Tier::kDevice}, {Tier::kNvme, Tier::kHost}},
        ResumeCase{ModelKind::kGpt2, DType::kF32, 1, 0.0, {Tier::kNvme, Tier::kNvme}, {Tier::kDevice, Tier::kDevice}},
        ResumeCase{ModelKind::kLlama, DType::kBF16, 1, 0.5, {Tier::kHost, Tier::kHost}, {Tier::kNvme, Tier::kNvme}},
        ResumeCase{ModelKind::kLlama, DType::kF32, 2, 0.0, {Tier::kDevice, Tier::kNvme}, {Tier::kHost, Tier::kHost}},
        // fp16: the loss scaler's state (scale, window position, skipped steps) resumes too
        ResumeCase{ModelKind::kGpt2, DType::kF16, 2, 1.0, {Tier::kDevice, Tier::kDevice}, {Tier::kHost, Tier::kNvme}},
        ResumeCase{ModelKind::kLlama, DType::kF16, 1, 0.0, {Tier::kNvme, Tier::kHost}, {Tier::kDevice, Tier::kDevice}}),
    case_name);

// A trained engine and a checkpoint root for the failure tests.
struct Saved {
  TrainerConfig config = tiny(ModelKind::kGpt2, DType::kBF16, 1, 1.0);
  TempDir swap{"strata-ckpt-swap"};
  TempDir root{"strata-ckpt"};
  std::unique_ptr<Device> device = make_device();
  std::unique_ptr<OffloadEngine> engine;
  std::string dir;

  Saved() {
    OffloadSettings s = settings_for({Tier::kNvme, Tier::kHost}, swap);
    auto e = OffloadEngine::create(config, s, *device);
    EXPECT_TRUE(e.ok()) << e.status().to_string();
    engine = std::move(*e);
    Snapshot ignored;
    EXPECT_TRUE(run_steps(*engine, config, 0, 2, ignored));
    auto d = engine->save_checkpoint(root.path().string());
    EXPECT_TRUE(d.ok()) << d.status().to_string();
    dir = *d;
  }
};

void flip_byte(const fs::path& file, std::uint64_t offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char b = 0;
  f.read(&b, 1);
  b = static_cast<char>(b ^ 0x20);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&b, 1);
}

// A corrupt block is refused naming the file, and the engine keeps its own state.
TEST(Checkpoint, CorruptFileIsRefusedAndTheEngineKeepsItsState) {
  Saved s;
  Snapshot before;
  ASSERT_TRUE(capture_state(*s.engine, before));
  Snapshot more;
  ASSERT_TRUE(run_steps(*s.engine, s.config, 2, 3, more));  // diverge from the checkpoint
  Snapshot trained;
  ASSERT_TRUE(capture_state(*s.engine, trained));
  const fs::path victim = fs::path(s.dir) / "module-0001.safetensors";
  flip_byte(victim, fs::file_size(victim) - 5);
  auto m = s.engine->load_checkpoint(s.root.path().string());
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(m.status().message().find(victim.string()), std::string::npos) << m.status().message();
  EXPECT_NE(m.status().message().find("crc32c"), std::string::npos) << m.status().message();
  Snapshot after;
  ASSERT_TRUE(capture_state(*s.engine, after));
  expect_same(trained, after, "state after a refused load");
  EXPECT_EQ(s.engine->steps_done(), 3);
  // Restored: the load succeeds and returns the engine to the checkpoint.
  flip_byte(victim, fs::file_size(victim) - 5);
  ASSERT_TRUE(s.engine->load_checkpoint(s.dir).ok());
  Snapshot restored;
  ASSERT_TRUE(capture_state(*s.engine, restored));
  expect_same(before, restored, "state after loading the checkpoint");
}

TEST(Checkpoint, TruncatedAndMissingFilesAreRefused) {
  Saved s;
  const fs::path victim = fs::path(s.dir) / "module-0000.safetensors";
  fs::resize_file(victim, fs::file_size(victim) - 100);
  auto m = s.engine->load_checkpoint(s.dir);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("bytes; the manifest says"), std::string::npos) << m.status().message();
  fs::remove(victim);
  m = s.engine->load_checkpoint(s.dir);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("is missing"), std::string::npos) << m.status().message();
  EXPECT_NE(m.status().message().find(victim.string()), std::string::npos) << m.status().message();
}

TEST(Checkpoint, AnotherModelIsRefusedNamingTheKey) {
  Saved s;
  TrainerConfig other = s.config;
  other.model.n_layer = 2;
  auto device = make_device();
  auto e = OffloadEngine::create(other, OffloadSettings{}, *device);
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  auto m = (*e)->load_checkpoint(s.dir);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(m.status().message().find("n_layer: checkpoint 3, this run 2"), std::string::npos) << m.status().message();

  TrainerConfig f32 = s.config;
  f32.model.dtype = DType::kF32;
  auto device2 = make_device();
  auto e2 = OffloadEngine::create(f32, OffloadSettings{}, *device2);
  ASSERT_TRUE(e2.ok());
  m = (*e2)->load_checkpoint(s.dir);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("torch_dtype"), std::string::npos) << m.status().message();
}

TEST(Checkpoint, BadPathsAndManifestsNameWhatIsWrong) {
  Saved s;
  TempDir empty("strata-ckpt-empty");
  auto r = resolve_checkpoint(empty.path().string());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("neither a checkpoint"), std::string::npos) << r.status().message();
  r = resolve_checkpoint((empty.path() / "nope").string());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("is not a directory"), std::string::npos);

  // `latest` naming something that is not a checkpoint.
  { std::ofstream(s.root.path() / "latest") << "step-00000099\n"; }
  r = resolve_checkpoint(s.root.path().string());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("step-00000099"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("step-00000002"), std::string::npos) << "lists what exists: "
                                                                             << r.status().message();
  { std::ofstream(s.root.path() / "latest") << "../../etc\n"; }
  r = resolve_checkpoint(s.root.path().string());
  ASSERT_FALSE(r.ok());

  // A manifest with a wrong key type.
  const fs::path manifest = fs::path(s.dir) / "manifest.json";
  auto j = nlohmann::json::parse(std::ifstream(manifest));
  j["step"] = "two";
  { std::ofstream(manifest) << j.dump(); }
  auto mm = read_checkpoint_manifest(s.dir);
  ASSERT_FALSE(mm.ok());
  EXPECT_NE(mm.status().message().find("'step'"), std::string::npos) << mm.status().message();
  { std::ofstream(manifest) << "{not json"; }
  mm = read_checkpoint_manifest(s.dir);
  ASSERT_FALSE(mm.ok());
  EXPECT_NE(mm.status().message().find(manifest.string()), std::string::npos) << mm.status().message();
}

// Publishing: `latest` names the newest; `keep` prunes the oldest; an unfinished save (a crash
// before the rename, or between the rename and the pointer update) leaves the previous one as
// `latest`, and the next save clears the leftovers.
TEST(Checkpoint, PublishingIsAtomicAndPrunes) {
  Saved s;  // step-00000002
  Snapshot ignored;
  const std::string root = s.root.path().string();
  ASSERT_TRUE(run_steps(*s.engine, s.config, 2, 3, ignored));
  auto d3 = s.engine->save_checkpoint(root, "{}", 2);
  ASSERT_TRUE(d3.ok()) << d3.status().to_string();
  ASSERT_TRUE(run_steps(*s.engine, s.config, 3, 4, ignored));
  auto d4 = s.engine->save_checkpoint(root, "{}", 2);
  ASSERT_TRUE(d4.ok());
  EXPECT_FALSE(fs::exists(s.root.path() / "step-00000002")) << "pruned beyond keep=2";
  EXPECT_TRUE(fs::exists(s.root.path() / "step-00000003"));
  EXPECT_EQ(*resolve_checkpoint(root), *d4);

  // A crash after the files were written but before the rename: a .tmp- directory, complete.
  fs::copy(*d4, s.root.path() / "step-00000005.tmp-4242", fs::copy_options::recursive);
  EXPECT_EQ(*resolve_checkpoint(root), *d4);
  // A crash after the rename but before `latest` moved: the new directory exists, unnamed.
  fs::copy(*d4, s.root.path() / "step-00000006", fs::copy_options::recursive);
  EXPECT_EQ(*resolve_checkpoint(root), *d4);
  // A half-written `latest` replacement is a temporary file, never `latest` itself.
  { std::ofstream(s.root.path() / "latest.tmp") << "step-000"; }
  EXPECT_EQ(*resolve_checkpoint(root), *d4);

  // Saving the same step again publishes beside it; the .tmp- leftover is removed.
  auto again = s.engine->save_checkpoint(root, "{}", 3);
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ(fs::path(*again).filename(), "step-00000004.r1");
  EXPECT_EQ(*resolve_checkpoint(root), *again);
  EXPECT_FALSE(fs::exists(s.root.path() / "step-00000005.tmp-4242"));
  auto m = read_checkpoint_manifest(*again);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->step, 4);
  EXPECT_EQ(m->placement, "parameters on nvme, optimizer state on host");
  EXPECT_EQ(m->files.size(), static_cast<std::size_t>(s.engine->model().layout().modules.size()));

  // Bad arguments.
  auto bad = s.engine->save_checkpoint(root, "[1, 2]");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("JSON object"), std::string::npos);
  bad = s.engine->save_checkpoint(root, "{}", 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("keep"), std::string::npos);
}

}  // namespace
}  // namespace strata::testing
