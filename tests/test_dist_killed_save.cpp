// A rank killed in the middle of a parallel weights save (docs/checkpoints.md "Who writes the
// weights file"), on real MPI processes (tests/mpi_run.sh, label `dist`), 2 ranks, GPT-2 tiny:
// tensor parallel (tp 2), ZeRO stage 3 data parallel (dp 2, every module sliced), or a pipeline
// (pp 2, each stage its modules). Each rank
// saves a first weights file, trains a step, then one rank SIGKILLs itself inside the second save of the same path, right after its third range write
// into `<path>.tmp` (EngineFaults::kill_during_save: the header is written, some of that rank's
// ranges are, not all). mpirun is told not to end the job when a rank dies, so the survivor waits
// in the save's agreement for a peer that never comes and gets the comm timeout, then the
// watchdog ends the job. Every test here is DISABLED_ and run by its own job
// (tests/CMakeLists.txt, --gtest_also_run_disabled_tests):
//
//   dist.offload_killed_save.np2          tensor-parallel rank 1 (not the writer) is killed: the
//                                         writer removes `<path>.tmp`, the previous file keeps
//                                         its bytes;
//   dist.offload_killed_save_stage3.np2   the same with ZeRO stage 3, data-parallel rank 1 killed
//                                         part-way through its slices;
//   dist.offload_killed_save_pipeline.np2 the same with a pipeline, stage 1 killed part-way
//                                         through its modules;
//   dist.offload_killed_save_writer.np2   the writer (rank 0) is killed: `<path>.tmp` is left,
//                                         full length, the previous file keeps its bytes;
//   dist.offload_save_after_kill.np2      (needs the job above: ctest fixture) fresh ranks resume
//                                         from the previous file and save to the same path over
//                                         the leftover `<path>.tmp`: one process's file byte for
//                                         byte, no `.tmp` left.
//
// The last two share a directory that outlives a job (STRATA_TEST_SAVE_DIR, under the build
// directory); the others use one of their own.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>

#include "comm_environment.hpp"
#include "dist_compare.hpp"
#include "offload/internal.hpp"
#include "offload_fixture.hpp"

namespace strata {
namespace {

using testing::file_bytes;
using testing::Snapshot;
using testing::world;

// Range writes the killed rank issues into the temporary file before it dies.
constexpr std::uint64_t kWritesBeforeKill = 3;

// How the two ranks split the model: tensor parallel (each its shard of every parameter, the
// replicated ones tp rank 0), ZeRO stage 3 data parallel (each its slice of every module's
// parameters, every module sliced), or a pipeline (each stage its modules; 2 micro-batches).
enum class Split { kTensor, kStage3, kPipeline };

TrainerConfig config(Split split = Split::kTensor) {
  return testing::tiny(ModelKind::kGpt2, DType::kF32, split == Split::kPipeline ? 2 : 1, 1.0);
}

// The group the save's agreement runs over, as its errors name it.
const char* group_of(Split split) {
  return split == Split::kStage3 ? "data-parallel" : split == Split::kPipeline ? "pipeline" : "tensor-parallel";
}

OffloadSettings settings(Split split) {
  OffloadSettings s;
  s.params = split == Split::kStage3 ? Tier::kHost : Tier::kDevice;
  s.zero_stage = split == Split::kStage3 ? 3 : 0;
  s.optimizer = Tier::kHost;
  s.persistence_threshold = 0;
  return s;
}

// This rank's engine, its one group the world.
std::unique_ptr<OffloadEngine> engine_of(Split split, Device& device) {
  Comm* dp = split == Split::kStage3 ? &world() : nullptr;
  Comm* tp = split == Split::kTensor ? &world() : nullptr;
  Comm* pp = split == Split::kPipeline ? &world() : nullptr;
  auto engine = OffloadEngine::create(config(split), settings(split), device, nullptr, dp, tp, pp);
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  return engine.ok() ? std::move(*engine) : nullptr;
}

// The directory the job's files go in: STRATA_TEST_SAVE_DIR where the job names one (shared with
// the next job), else a fresh one under the job's own temporary directory. `fresh`: rank 0 empties it.
std::string save_dir(bool fresh) {
  const char* named = std::getenv("STRATA_TEST_SAVE_DIR");
  if (named == nullptr || *named == '\0') return testing::shared_temp_dir("killed-save");
  if (fresh && world().rank() == 0) {
    std::filesystem::remove_all(named);
    std::filesystem::create_directories(named);
  }
  EXPECT_TRUE(world().barrier().wait().ok());
  return named;
}

// The names of the files in `dir`.
std::set<std::string> files_in(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& f : std::filesystem::directory_iterator(dir)) names.insert(f.path().filename().string());
  return names;
}

// World rank `killed` dies in the middle of the second save of `path`; the survivor's save fails
// with the comm timeout of the agreement, naming the path, within the comm timeout (the job's
// --limit and the watchdog bound it), and the file at the path keeps the first save's bytes.
// Where `<path>.tmp` is then: the writer (world rank 0, tp rank 0) removes it when the agreement
// fails, so with the writer alive nothing but the previous file is left; a killed writer leaves
// it, at its full length (sized before any rank wrote), starting with the header, holding some
// of the second save's bytes: a name no load reads, replaced by the next save (the job after).
void kill_mid_save(Split split, int killed) {
  ASSERT_EQ(world().size(), 2) << "run under mpirun -np 2";
  const int R = world().rank(), survivor = 1 - killed;
  auto device = testing::make_device();
  auto engine = engine_of(split, *device);
  ASSERT_NE(engine, nullptr);
  OffloadEngine& e = *engine;
  const std::string dir = save_dir(/*fresh=*/true);
  const std::string path = dir + "/weights.safetensors", tmp = path + ".tmp";
  Snapshot got;
  ASSERT_TRUE(testing::run_steps(e, config(split), 0, 1, got));
  const std::uint64_t before = e.stats().weights_file_writes;
  STRATA_ASSERT_OK(e.save_weights(path));
  const std::uint64_t writes = e.stats().weights_file_writes - before;
  // The kill lands inside this rank's part: some of its ranges written, not all.
  ASSERT_GT(writes, kWritesBeforeKill) << "rank " << R;
  ASSERT_TRUE(world().barrier().wait().ok());
  const std::string first = file_bytes(path);
  ASSERT_GT(first.size(), 1000u);
  ASSERT_TRUE(testing::run_steps(e, config(split), 1, 2, got));
  ASSERT_TRUE(e.synchronize().ok());
  ASSERT_TRUE(world().barrier().wait().ok());
  if (R == killed) offload_detail::EngineFaults::kill_during_save(e, kWritesBeforeKill);
  const Status st = e.save_weights(path);
  ASSERT_EQ(R, survivor) << "the killed rank returned from save_weights: " << st.to_string();
  EXPECT_FALSE(st.ok()) << "rank " << R << ": the save without its peer succeeded";
  for (const std::string& part : {"weights '" + path + "' not written",
                                 std::string(group_of(split)) +
                                     " ranks: exchanging whether each could write its part of the weights",
                                 std::string("comm timeout")})
    EXPECT_NE(st.message().find(part), std::string::npos) << "rank " << R << ": " << st.to_string();
  std::printf("rank %d: save 2 failed: %s\n", R, st.to_string().c_str());
  std::fflush(stdout);
  // The state on disk: the previous file intact, no final file half-written, and `.tmp` as above.
  EXPECT_TRUE(file_bytes(path) == first) << "the killed save changed the previous file";
  if (killed == 0) {
    EXPECT_EQ(files_in(dir), (std::set<std::string>{"weights.safetensors", "weights.safetensors.tmp"}));
    const std::string left = file_bytes(tmp);
    EXPECT_EQ(left.size(), first.size()) << "the temporary file is not at its full length";
    std::uint64_t header = 0;  // the header's length (little-endian), then the header
    std::memcpy(&header, first.data(), 8);
    header += 8;
    EXPECT_TRUE(left.compare(0, header, first, 0, header) == 0) << "the temporary file lacks the header";
    EXPECT_FALSE(left == first) << "the temporary file holds none of the second save's bytes";
  } else {
    EXPECT_EQ(files_in(dir), (std::set<std::string>{"weights.safetensors"}))
        << "the writer did not remove the temporary file";
    if (!std::getenv("STRATA_TEST_SAVE_DIR")) std::filesystem::remove_all(dir);
  }
}

TEST(DistOffloadKilledSave, DISABLED_KilledTensorRankLeavesThePreviousFile) { kill_mid_save(Split::kTensor, 1); }

TEST(DistOffloadKilledSave, DISABLED_KilledWriterLeavesOnlyTheTemporaryFile) { kill_mid_save(Split::kTensor, 0); }

// ZeRO stage 3, dp 2: data-parallel rank 1 dies part-way through writing its slices.
TEST(DistOffloadKilledSave, DISABLED_KilledStage3RankLeavesThePreviousFile) { kill_mid_save(Split::kStage3, 1); }

// A pipeline, pp 2: stage 1 dies part-way through writing its modules.
TEST(DistOffloadKilledSave, DISABLED_KilledPipelineStageLeavesThePreviousFile) { kill_mid_save(Split::kPipeline, 1); }

// After dist.offload_killed_save_writer.np2 (its directory, with the previous file and the
// leftover `<path>.tmp`): fresh tp 2 ranks and a one-process engine load the previous file
// (training resumes from it), the ranks save to the same path over the leftover — the writer's
// create truncates it — and the file is one process's save of the same state byte for byte, and
// so the previous file's bytes again; no `.tmp` is left; a step then runs on the resumed ranks.
TEST(DistOffloadKilledSave, DISABLED_NextSaveReplacesTheLeftoverTemporaryFile) {
  ASSERT_EQ(world().size(), 2) << "run under mpirun -np 2";
  ASSERT_NE(std::getenv("STRATA_TEST_SAVE_DIR"), nullptr)
      << "STRATA_TEST_SAVE_DIR: expected the directory dist.offload_killed_save_writer.np2 left";
  const int R = world().rank();
  const std::string dir = save_dir(/*fresh=*/false);
  const std::string path = dir + "/weights.safetensors", tmp = path + ".tmp";
  ASSERT_TRUE(std::filesystem::exists(tmp)) << "no leftover '" << tmp << "' (run dist.offload_killed_save_writer.np2 first)";
  const std::string previous = file_bytes(path), leftover = file_bytes(tmp);
  ASSERT_GT(previous.size(), 1000u) << path;
  ASSERT_FALSE(leftover == previous) << "the leftover holds the previous file's bytes: the check below could not fail";
  auto device = testing::make_device();
  auto engine = engine_of(Split::kTensor, *device);
  ASSERT_NE(engine, nullptr);
  auto device1 = testing::make_device();
  auto one = OffloadEngine::create(config(), settings(Split::kTensor), *device1);
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  STRATA_ASSERT_OK(engine->load_weights(path));
  STRATA_ASSERT_OK((*one)->load_weights(path));
  ASSERT_TRUE(world().barrier().wait().ok());  // every rank read the path before it is replaced
  testing::expect_saved_as_one_process(*engine, **one, path, dir + "/one-" + std::to_string(R) + ".safetensors",
                                       WeightFormat::kHuggingFace, "tp 2 over the leftover");
  if (R == 0) {
    EXPECT_TRUE(file_bytes(path) == previous) << "the resumed state's file differs from the file it loaded";
    EXPECT_FALSE(std::filesystem::exists(tmp)) << "the save left '" << tmp << "'";
  }
  Snapshot got;
  EXPECT_TRUE(testing::run_steps(*engine, config(), 1, 2, got));
  ASSERT_TRUE(world().barrier().wait().ok());
  if (R == 0) std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace strata
