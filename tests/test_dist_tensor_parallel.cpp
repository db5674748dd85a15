// Tensor parallelism on the offload engine, on real processes: run by tests/mpi_run.sh under
// `mpirun -np N` (tests/CMakeLists.txt), the world being the tensor-parallel group. Every rank
// trains the same batch with its shard of the model, and, in the same process, the
// single-process engine on that batch as the reference.
//
// What is compared, and how exactly:
// - Initialisation: each shard holds exactly the single-process initial values, so the weights
//   file a tensor-parallel engine saves before training is byte for byte the single process's.
// - Every rank ends with the same bits of every full parameter (gathered) and its optimizer
//   state: replicated parameters get identical gradients on every rank (their inputs come out of
//   all-reduces), so they cannot drift apart.
// - Against the single process: the row-parallel matmuls, the vocabulary-parallel softmax and
//   the input gradients of column-parallel layers sum partial products over the ranks instead of
//   one dot product, so fp32 rounding differs: the state agrees within the tolerances below,
//   set from the measured differences with a margin (each printed by rank 0).
// - Weights: a tensor-parallel save loads into one process bit for bit, and the other way round.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "comm_environment.hpp"
#include "dist_compare.hpp"
#include "nvme/faults.hpp"
#include "offload/internal.hpp"
#include "offload_fixture.hpp"
#include "strata/parallel.hpp"

namespace strata {
namespace {

using testing::expect_close;
using testing::file_bytes;
using testing::fnv;
using testing::Snapshot;
using testing::Tolerance;
using testing::world;

// The tiny test models, split over the world. With 4 ranks LLaMA gets 8 query and 4 kv heads so
// that the grouped kv heads still split (each rank: 2 query heads sharing 1 kv head).
TrainerConfig config_for(ModelKind kind, DType dtype, std::int64_t accum, double clip) {
  TrainerConfig c = testing::tiny(kind, dtype, accum, clip);
  if (kind == ModelKind::kLlama && world().size() == 4) {
    c.model.n_head = 8;
    c.model.n_kv_head = 4;
  }
  return c;
}

void expect_ranks_identical(const Snapshot& s, const std::string& what) {
  std::uint64_t h = fnv(s.param);
  h = fnv(s.master, h);
  h = fnv(s.m, h);
  h = fnv(s.v, h);
  std::vector<std::uint64_t> all(static_cast<std::size_t>(world().size()));
  ASSERT_TRUE(world().all_gather(&h, all.data(), 2, DType::kF32).wait().ok());
  for (std::size_t r = 0; r < all.size(); ++r) EXPECT_EQ(all[r], all[0]) << what << ": state of rank " << r;
  // The losses and norms too: every rank computed the full loss from the same all-reduces.
  std::vector<double> mine = s.losses;
  mine.insert(mine.end(), s.norms.begin(), s.norms.end());
  std::vector<double> every(mine.size() * all.size());
  ASSERT_TRUE(world().all_gather(mine.data(), every.data(), 2 * mine.size(), DType::kF32).wait().ok());
  for (std::size_t r = 0; r < all.size(); ++r) {
    for (std::size_t i = 0; i < mine.size(); ++i)
      EXPECT_EQ(every[r * mine.size() + i], mine[i]) << what << ": rank " << r;
  }
}

// fp32: Tolerance's defaults (dist_compare.hpp). Measured on 2 ranks (lr 1e-2, 3 steps): loss
// 6.5e-7 relative, norm 7.6e-6, parameters rms 1.6e-6 and max 4.2e-4, moments rms 1.2e-6 and max
// 9e-5 of their scale: the defaults hold at least 5x headroom. A wrong shard or a missing
// reduction moves the parameters by about the learning rate. bf16: dist_compare.hpp's
// bf16_tensor_parallel_tolerance() (measured there).
Tolerance bf16_tolerance() { return testing::bf16_tensor_parallel_tolerance(); }

Snapshot train_tp(const TrainerConfig& c, const OffloadSettings& s, int steps) {
  Snapshot out;
  auto device = testing::make_device();
  auto engine = OffloadEngine::create(c, s, *device, nullptr, nullptr, &world());
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  if (!engine.ok()) return out;
  if (!testing::run_steps(**engine, c, 0, steps, out)) return out;
  testing::capture_state(**engine, out);
  return out;
}

struct Case {
  const char* name;
  ModelKind kind;
  DType dtype;
  std::int64_t accum;
  double clip;
  Tier params, optimizer;
};

void check_case(const Case& c) {
  const TrainerConfig config = config_for(c.kind, c.dtype, c.accum, c.clip);
  OffloadSettings s;
  s.params = c.params;
  s.optimizer = c.optimizer;
  s.persistence_threshold = 0;
  testing::TempDir swap_tp("strata-tp-swap"), swap_ref("strata-tp-swap");  // each rank its own
  const bool nvme = c.params == Tier::kNvme || c.optimizer == Tier::kNvme;
  if (nvme) s.nvme_path = {swap_tp.path().string()};
  constexpr int kSteps = 3;
  const Snapshot tp = train_tp(config, s, kSteps);
  OffloadSettings single = s;
  if (nvme) single.nvme_path = {swap_ref.path().string()};
  const Snapshot ref = testing::train(config, single, kSteps);
  const std::string what = std::string(c.name) + ", tp " + std::to_string(world().size());
  expect_ranks_identical(tp, what);
  expect_close(ref, tp, c.dtype == DType::kF32 ? Tolerance{} : bf16_tolerance(), what);
}

TEST(TensorParallel, Gpt2Fp32OptimizerOnDevice) {
  check_case({"gpt2 fp32, optimizer on the device", ModelKind::kGpt2, DType::kF32, 1, 0.0, Tier::kDevice,
              Tier::kDevice});
}

TEST(TensorParallel, Gpt2Fp32ParametersAndOptimizerOnHostAccumulationClipping) {
  check_case({"gpt2 fp32, parameters and optimizer on host, accumulation 2, clip 0.5", ModelKind::kGpt2,
              DType::kF32, 2, 0.5, Tier::kHost, Tier::kHost});
}

// Clipping off: the host optimizer updates each unit as its gradients land, before the norm.
TEST(TensorParallel, Gpt2Fp32OptimizerOnHostUpdatedDuringBackward) {
  check_case({"gpt2 fp32, optimizer on host, updated during backward", ModelKind::kGpt2, DType::kF32, 1, 0.0,
              Tier::kDevice, Tier::kHost});
}

TEST(TensorParallel, LlamaGroupedKvFp32OptimizerOnHostClipping) {
  check_case({"llama (grouped kv heads) fp32, optimizer on host, clip 1", ModelKind::kLlama, DType::kF32, 1,
              1.0, Tier::kDevice, Tier::kHost});
}

TEST(TensorParallel, LlamaGroupedKvBf16ParametersOnNvme) {
  check_case({"llama (grouped kv heads) bf16, parameters on NVMe, optimizer on host", ModelKind::kLlama,
              DType::kBF16, 1, 1.0, Tier::kNvme, Tier::kHost});
}

TEST(TensorParallel, Gpt2Bf16OptimizerOnDeviceAccumulation) {
  check_case({"gpt2 bf16, optimizer on the device, accumulation 2", ModelKind::kGpt2, DType::kBF16, 2, 0.0,
              Tier::kDevice, Tier::kDevice});
}

// Weights: before training the tensor-parallel save is the single-process save byte for byte
// (initialisation and gathering); after training it loads into one process bit for bit, and a
// single-process file loads into the shards bit for bit.
// Activation offload under tensor parallelism: each rank offloads its own copy of the replicated
// residual stream, so the run is the checkpointed tensor-parallel run bit for bit (only storage
// moves; the collectives read and write the same buffers in the same order).
TEST(TensorParallel, ActivationOffloadIsTheCheckpointedRunBitForBit) {
  for (const ModelKind kind : {ModelKind::kGpt2, ModelKind::kLlama}) {
    TrainerConfig config = config_for(kind, DType::kF32, 2, 1.0);
    config.model.n_layer = 5;  // more block inputs than the device ring holds
    config.model.activation_checkpointing = true;
    OffloadSettings s;
    s.optimizer = Tier::kHost;
    const Snapshot kept = train_tp(config, s, 3);
    s.offload_activations = true;
    const Snapshot moved = train_tp(config, s, 3);
    const std::string what = std::string(to_string(kind)) + ", tp " + std::to_string(world().size());
    ASSERT_FALSE(kept.param.empty()) << what;
    EXPECT_EQ(kept.losses, moved.losses) << what;
    EXPECT_EQ(kept.norms, moved.norms) << what;
    EXPECT_EQ(kept.param, moved.param) << what;
    EXPECT_EQ(kept.master, moved.master) << what;
    EXPECT_EQ(kept.m, moved.m) << what;
    EXPECT_EQ(kept.v, moved.v) << what;
    EXPECT_NE(kept.losses.front(), kept.losses.back()) << what << ": the run trained";
    // And the block inputs did travel.
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(config, s, *device, nullptr, nullptr, &world());
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    Snapshot one;
    ASSERT_TRUE(testing::run_steps(**engine, config, 0, 1, one)) << what;
    ASSERT_TRUE((*engine)->synchronize().ok());
    EXPECT_GT((*engine)->stats().bytes_activations_to_host, 0u) << what;
    EXPECT_GT((*engine)->stats().bytes_activations_to_device, 0u) << what;
  }
}

TEST(TensorParallel, SaveAndLoadWeightsAreTheFullModel) {
  for (ModelKind kind : {ModelKind::kGpt2, ModelKind::kLlama}) {
    const TrainerConfig config = config_for(kind, DType::kF32, 1, 0.0);
    const std::string what(to_string(kind));
    OffloadSettings s;
    s.optimizer = Tier::kHost;
    testing::TempDir dir("strata-tp-weights");  // rank 0's is the one written
    std::string path = (dir.path() / "tp.safetensors").string();
    const std::string single_path = (dir.path() / "single.safetensors").string();
    // Every rank writes to (and later reads) rank 0's directory.
    std::vector<char> name(512, 0);
    std::snprintf(name.data(), name.size(), "%s", path.c_str());
    ASSERT_TRUE(world().broadcast(name.data(), 128, DType::kF32, 0).wait().ok());
    path = name.data();
    const std::string shared_single = path.substr(0, path.size() - std::string("tp.safetensors").size()) +
                                      "single-" + std::to_string(world().rank()) + ".safetensors";
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(config, s, *device, nullptr, nullptr, &world());
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    STRATA_ASSERT_OK((*engine)->save_weights(path, WeightFormat::kNative));
    ASSERT_TRUE(world().barrier().wait().ok());
    auto device1 = testing::make_device();
    auto single = OffloadEngine::create(config, s, *device1);
    ASSERT_TRUE(single.ok()) << single.status().to_string();
    STRATA_ASSERT_OK((*single)->save_weights(shared_single, WeightFormat::kNative));
    EXPECT_EQ(file_bytes(path), file_bytes(shared_single)) << what << ": the initial weights files differ";
    ASSERT_FALSE(file_bytes(path).empty());
    (void)single_path;

    // Train the shards, save (collective), load into one process.
    Snapshot tp;
    ASSERT_TRUE(testing::run_steps(**engine, config, 0, 2, tp));
    ASSERT_TRUE(world().barrier().wait().ok());
    STRATA_ASSERT_OK((*engine)->save_weights(path, WeightFormat::kNative));
    ASSERT_TRUE(world().barrier().wait().ok());
    ASSERT_TRUE(testing::capture_state(**engine, tp));
    STRATA_ASSERT_OK((*single)->load_weights(path));
    const ModelLayout& L = (*single)->model().layout();
    std::size_t k = 0;
    for (std::size_t i = 0; i < L.params.size(); ++i) {
      if (!L.params[i].owns_storage()) continue;
      auto p = (*single)->get_param(static_cast<int>(i));
      ASSERT_TRUE(p.ok());
      EXPECT_TRUE(testing::bitwise_equal(*p, tp.param[k++])) << what << ": " << L.params[i].name;
    }
    // The other way: the single process's (untrained) weights into the shards.
    auto device2 = testing::make_device();
    auto fresh = OffloadEngine::create(config, s, *device2);
    ASSERT_TRUE(fresh.ok());
    STRATA_ASSERT_OK((*fresh)->save_weights(shared_single, WeightFormat::kHuggingFace));
    STRATA_ASSERT_OK((*engine)->load_weights(shared_single));
    for (std::size_t i = 0; i < L.params.size(); ++i) {
      if (!L.params[i].owns_storage()) continue;
      auto want = (*fresh)->get_param(static_cast<int>(i));
      auto got = (*engine)->get_param(static_cast<int>(i));
      ASSERT_TRUE(want.ok() && got.ok());
      EXPECT_TRUE(testing::bitwise_equal(*got, *want)) << what << ": loaded " << L.params[i].name;
    }
    ASSERT_TRUE(world().barrier().wait().ok());
  }
}

// Every tensor-parallel rank writes its own shard into the weights file (docs/checkpoints.md
// "Who writes the weights file"): GPT-2, whose Conv1D tensors are stored transposed (a
// column-parallel shard is one write per stored column), and LLaMA, fp32 and bf16 (the file holds
// the encoded bytes), both formats. Untrained, the file is one process's byte for byte; after a
// step it is the gather path's file (the first rank gathers and writes alone) byte for byte, and
// every rank wrote its part.
TEST(TensorParallel, EveryRankWritesItsShardOfTheWeights) {
  for (const ModelKind kind : {ModelKind::kGpt2, ModelKind::kLlama}) {
    for (const DType dtype : {DType::kF32, DType::kBF16}) {
      const TrainerConfig config = config_for(kind, dtype, 1, 1.0);
      const std::string what = std::string(to_string(kind)) + " " + std::string(to_string(dtype)) + ", tp " +
                               std::to_string(world().size());
      OffloadSettings s;
      s.optimizer = Tier::kHost;
      const std::string root = testing::shared_temp_dir("tp-parwrite");
      auto device = testing::make_device();
      auto engine = OffloadEngine::create(config, s, *device, nullptr, nullptr, &world());
      ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
      auto device1 = testing::make_device();
      auto single = OffloadEngine::create(config, s, *device1);
      ASSERT_TRUE(single.ok()) << what << ": " << single.status().to_string();
      testing::expect_weights_of_one_process(**engine, **single, root, what + ", untrained");
      Snapshot out;
      ASSERT_TRUE(testing::run_steps(**engine, config, 0, 1, out)) << what;
      testing::expect_parallel_weights_are_gathered(**engine, root, what + ", after a step");
      testing::expect_unseen_file_takes_the_gather_path(**engine, root, what);
      if (world().rank() == 0) std::filesystem::remove_all(root);
    }
  }
}

// A tensor-parallel rank that cannot write its shard (an injected EIO on the last rank's rows of
// LLaMA's MLP up projection, a row-split tensor: only that rank writes those bytes, so the save
// failing at all shows it wrote them itself): every rank returns the same error naming that rank,
// the tensor and the path; no temporary file is left, a new path stays empty and the previous
// file keeps its bytes; with the fault gone the same engine saves the same bytes.
TEST(TensorParallel, WeightsFailCleanlyWhenARankCannotWriteItsShard) {
  const int P = world().size(), failing = P - 1;
  const TrainerConfig config = config_for(ModelKind::kLlama, DType::kF32, 1, 1.0);
  OffloadSettings s;
  s.optimizer = Tier::kHost;
  nvme_detail::IoFaults faults;
  auto device = testing::make_device();
  auto engine = offload_detail::EngineFaults::create(config, s, *device, &faults, nullptr, nullptr, &world());
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  Snapshot out;
  ASSERT_TRUE(testing::run_steps(**engine, config, 0, 1, out));
  const std::string root = testing::shared_temp_dir("tp-wfault");
  const std::string weights = root + "/weights.safetensors", other = root + "/other.safetensors";
  STRATA_ASSERT_OK((*engine)->save_weights(weights));
  ASSERT_TRUE(world().barrier().wait().ok());
  const std::string before = file_bytes(weights);
  auto file = SafetensorsFile::open(weights);
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  const std::string tensor = "model.layers.1.mlp.up_proj.weight";
  const SafetensorsEntry* e = file->find(tensor);
  ASSERT_NE(e, nullptr);
  if (world().rank() == failing)
    faults.add_error({IoOp::kWrite, ".safetensors.tmp", file->data_offset() + e->data_end - 4, EIO});
  const std::string named = "tensor-parallel rank " + std::to_string(failing) + " of " + std::to_string(P) +
                            " could not write its tensors";
  for (const std::string& path : {weights, other}) {
    Status failed = (*engine)->save_weights(path);
    ASSERT_FALSE(failed.ok()) << "rank " << world().rank();
    EXPECT_EQ(failed.code(), StatusCode::kIoError) << failed.to_string();
    for (const std::string& part : {named, "'" + tensor + "'", path})
      EXPECT_NE(failed.message().find(part), std::string::npos) << "rank " << world().rank() << ": " << failed.to_string();
    testing::expect_same_text_on_every_rank(failed.message(), "save_weights");
  }
  faults.clear_errors();
  ASSERT_TRUE(world().barrier().wait().ok());  // rank 0 removed the temporary file before returning
  if (world().rank() == 0) {
    EXPECT_TRUE(file_bytes(weights) == before) << "a failed save changed the previous file";
    EXPECT_FALSE(std::filesystem::exists(other)) << "a failed save left a file";
    for (const auto& f : std::filesystem::directory_iterator(root))
      EXPECT_EQ(f.path().filename().string().find(".tmp"), std::string::npos) << f.path();
  }
  ASSERT_TRUE(world().barrier().wait().ok());
  STRATA_ASSERT_OK((*engine)->save_weights(other));
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == 0) {
    EXPECT_TRUE(file_bytes(other) == before) << "the save after the fault";
    std::filesystem::remove_all(root);
  }
  ASSERT_TRUE(world().barrier().wait().ok());
}

// TP x DP on 4 ranks (make_process_groups' 2 x 2 grid): each data-parallel rank trains its share
// of the global batch (global micro-batches dp, dp + 2, ...) with its tensor-parallel group's
// shards; ZeRO shards each tensor-parallel shard's optimizer state over its data-parallel group.
// Against one process on the global batch: the fp32 tolerances (the data-parallel sum order adds
// its own rounding, measured well inside them).
TEST(TensorParallel, ComposesWithDataParallel) {
  ASSERT_EQ(world().size(), 4) << "runs on 4 ranks (2 x 2; tests/CMakeLists.txt filters it elsewhere)";
  auto groups = make_process_groups(*testing::g_comm_env->context, CommBackend::kMpi, 2, 1);
  ASSERT_TRUE(groups.ok()) << groups.status().to_string();
  const int DP = groups->dp->size(), dp_rank = groups->dp->rank();
  // Stage 1 also with sequence parallelism: each tp group splits its dp rank's tokens.
  for (const auto& [stage, seq] : {std::pair{1, false}, std::pair{3, false}, std::pair{1, true}}) {
    const TrainerConfig global = config_for(ModelKind::kLlama, DType::kF32, 2 * DP, 1.0);
    TrainerConfig local = global;
    local.grad_accum = global.grad_accum / DP;
    OffloadSettings s;
    s.optimizer = Tier::kHost;
    s.params = stage == 3 ? Tier::kHost : Tier::kDevice;
    s.zero_stage = stage;
    s.persistence_threshold = 0;
    s.sequence_parallel = seq;
    const std::string what =
        "llama fp32, tp 2 x dp 2, stage " + std::to_string(stage) + (seq ? ", sequence parallel" : "");
    Snapshot got;
    {
      auto device = testing::make_device();
      auto engine = OffloadEngine::create(local, s, *device, nullptr, groups->dp.get(), groups->tp.get());
      ASSERT_TRUE(engine.ok()) << engine.status().to_string();
      const std::size_t per = static_cast<std::size_t>(global.micro_batch * global.seq_len);
      for (int step = 0; step < 3; ++step) {
        std::vector<std::int32_t> gin, gtg, in, tg;
        testing::batch(global, step, gin, gtg);
        for (std::size_t i = static_cast<std::size_t>(dp_rank);
             i < static_cast<std::size_t>(global.grad_accum); i += static_cast<std::size_t>(DP)) {
          in.insert(in.end(), gin.begin() + static_cast<std::ptrdiff_t>(i * per),
                    gin.begin() + static_cast<std::ptrdiff_t>((i + 1) * per));
          tg.insert(tg.end(), gtg.begin() + static_cast<std::ptrdiff_t>(i * per),
                    gtg.begin() + static_cast<std::ptrdiff_t>((i + 1) * per));
        }
        auto m = (*engine)->step(in, tg);
        ASSERT_TRUE(m.ok()) << m.status().to_string();
        got.losses.push_back(m->loss);
        got.norms.push_back(m->grad_norm);
      }
      ASSERT_TRUE(testing::capture_state(**engine, got));
      // Every rank writes its part of the weights file (stage 3: each (tp, dp) rank its slices of
      // its shard; stage 1: each dp rank a contiguous half of its tp shard): the gathered file.
      const std::string root = testing::shared_temp_dir("tpdp-parwrite");
      testing::expect_parallel_weights_are_gathered(**engine, root, what);
      if (world().rank() == 0) std::filesystem::remove_all(root);
    }
    OffloadSettings single = s;
    single.zero_stage = 0;
    single.sequence_parallel = false;
    const Snapshot ref = testing::train(global, single, 3);
    expect_ranks_identical(got, what);
    expect_close(ref, got, Tolerance{}, what);
  }
  // The optimizer state sharded in device memory composes with tensor parallelism too: trained
  // against the host-sharded optimizer and one process in test_dist_compose.cpp.
}

// Checkpoints are collective and hold the full model: a tensor-parallel checkpoint resumes the
// tensor-parallel run bit for bit (the same ranks, the same order of every sum) and loads into
// one process bit for bit (every full parameter and its optimizer state).
// Parameters on NVMe; after a step the last rank's disk fails every read. It keeps its place in
// each parameter's exchange before the shard gather (agree_on_read), so save_weights and
// save_checkpoint fail on every rank with the same error naming that rank and the parameter at
// once, not after the comm timeout (the job's STRATA_COMM_TIMEOUT=60 is only a backstop: a
// regression fails with a timeout error instead of hanging). With the disk back the same engine
// saves again.
TEST(TensorParallel, ReadFailureOnOneRankFailsEveryRankAtOnce) {
  const int P = world().size(), failing = P - 1;
  const TrainerConfig config = config_for(ModelKind::kGpt2, DType::kF32, 1, 1.0);
  testing::TempDir swap("strata-tp-rfault");  // each rank its own
  OffloadSettings s;
  s.params = Tier::kNvme;
  s.optimizer = Tier::kHost;
  s.persistence_threshold = 0;
  s.nvme_path = {swap.path().string()};
  nvme_detail::IoFaults faults;
  auto device = testing::make_device();
  auto engine = offload_detail::EngineFaults::create(config, s, *device, &faults, nullptr, nullptr, &world());
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  Snapshot out;
  ASSERT_TRUE(testing::run_steps(**engine, config, 0, 1, out));
  ASSERT_TRUE((*engine)->synchronize().ok());
  std::vector<char> name(512, 0);
  std::snprintf(name.data(), name.size(), "%s", (swap.path() / "out").string().c_str());
  ASSERT_TRUE(world().broadcast(name.data(), 128, DType::kF32, 0).wait().ok());
  const std::string root = name.data();  // rank 0's directory
  if (world().rank() == 0) std::filesystem::create_directories(root);
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == failing) {
    for (std::uint64_t offset = 0; offset < (64u << 20); offset += 4096)
      faults.add_error({IoOp::kRead, swap.path().string(), offset, EIO});
  }
  const std::string named = "tensor-parallel rank " + std::to_string(failing) + " of " + std::to_string(P) +
                            " could not read its shard of '";
  const std::string weights = root + "/weights.safetensors";
  Status w = (*engine)->save_weights(weights);
  ASSERT_FALSE(w.ok()) << "rank " << world().rank();
  EXPECT_EQ(w.code(), StatusCode::kIoError) << w.to_string();
  EXPECT_NE(w.message().find(named), std::string::npos) << "rank " << world().rank() << ": " << w.to_string();
  EXPECT_EQ(w.message().find("comm timeout"), std::string::npos) << w.to_string();
  // Every rank returns the same text.
  testing::expect_same_text_on_every_rank(w.message(), "save_weights");
  auto ck = (*engine)->save_checkpoint(root + "/ckpt");
  ASSERT_FALSE(ck.ok()) << "rank " << world().rank();
  EXPECT_EQ(ck.status().code(), StatusCode::kIoError) << ck.status().to_string();
  EXPECT_NE(ck.status().message().find(named), std::string::npos)
      << "rank " << world().rank() << ": " << ck.status().to_string();
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == 0) {
    EXPECT_FALSE(std::filesystem::exists(weights)) << "a failed save left a file";
  }
  faults.clear_errors();
  STRATA_ASSERT_OK((*engine)->save_weights(weights));
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == 0) {
    EXPECT_GT(file_bytes(weights).size(), 1000u);
  }
  ASSERT_TRUE(world().barrier().wait().ok());
}

TEST(TensorParallel, CheckpointResumesAndLoadsIntoOneProcess) {
  const TrainerConfig config = config_for(ModelKind::kLlama, DType::kBF16, 1, 1.0);
  OffloadSettings s;
  s.optimizer = Tier::kHost;
  s.params = Tier::kHost;
  s.persistence_threshold = 0;
  testing::TempDir dir("strata-tp-checkpoint");
  std::vector<char> name(512, 0);
  std::snprintf(name.data(), name.size(), "%s", (dir.path() / "ck").string().c_str());
  ASSERT_TRUE(world().broadcast(name.data(), 128, DType::kF32, 0).wait().ok());
  const std::string root = name.data();  // rank 0's directory: every rank reads it
  Snapshot warm, straight, resumed;      // steps 1-2; step 3 straight on, and after resuming
  {
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(config, s, *device, nullptr, nullptr, &world());
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    ASSERT_TRUE(testing::run_steps(**engine, config, 0, 2, warm));
    auto saved = (*engine)->save_checkpoint(root, "{}", 2);
    ASSERT_TRUE(saved.ok()) << saved.status().to_string();
    ASSERT_TRUE(testing::run_steps(**engine, config, 2, 3, straight));
    ASSERT_TRUE(testing::capture_state(**engine, straight));
  }
  {
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(config, s, *device, nullptr, nullptr, &world());
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    auto m = (*engine)->load_checkpoint(root);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    EXPECT_EQ(m->step, 2);
    ASSERT_TRUE(testing::run_steps(**engine, config, 2, 3, resumed));
    ASSERT_TRUE(testing::capture_state(**engine, resumed));
  }
  ASSERT_EQ(resumed.losses.size(), 1u);
  testing::expect_same(straight, resumed, "tensor-parallel resume");
  // One process loads the same checkpoint: the state after 2 steps, every tensor whole.
  Snapshot tp2, one;
  {
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(config, s, *device, nullptr, nullptr, &world());
    ASSERT_TRUE(engine.ok());
    ASSERT_TRUE((*engine)->load_checkpoint(root).ok());
    ASSERT_TRUE(testing::capture_state(**engine, tp2));
  }
  auto device = testing::make_device();
  auto single = OffloadEngine::create(config, s, *device);
  ASSERT_TRUE(single.ok());
  auto m = (*single)->load_checkpoint(root);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  ASSERT_TRUE(testing::capture_state(**single, one));
  testing::expect_same(tp2, one, "tensor-parallel checkpoint in one process");
  ASSERT_TRUE(world().barrier().wait().ok());  // rank 0's directory outlives every reader
}

TEST(TensorParallel, UnsupportedShapesAndPlacementsAreNamed) {
  TrainerConfig c = testing::tiny(ModelKind::kLlama, DType::kF32, 1, 0.0);
  c.model.n_kv_head = 1;  // one kv head cannot be split
  auto device = testing::make_device();
  auto engine = OffloadEngine::create(c, OffloadSettings{}, *device, nullptr, nullptr, &world());
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("n_kv_head"), std::string::npos) << engine.status().to_string();
  EXPECT_NE(engine.status().message().find("tensor_parallel_size"), std::string::npos)
      << engine.status().to_string();
  // A partial optimizer offload (offload_optimizer.ratio < 1) trains with tensor parallelism:
  // test_dist_partial_compose.cpp (gradients on NVMe: test_dist_compose.cpp).
}

// ---- Sequence parallel (docs/parallel.md "Sequence parallel") -------------------------------
//
// Each tp rank keeps 1/t of the token rows of the residual stream and the norms. Against one
// process and against tensor parallelism without it, the same tolerances as tensor parallelism
// (fp32: Tolerance's defaults, bf16: bf16_tolerance()): the reduce-scatters sum the same partial
// products as the all-reduces, but the residual is added after the sum (not by rank 0 before
// it) and the norm parameters' gradients are summed from t partial sums, so only rounding
// differs. Every rank must still hold the same bits (the norm gradients are summed in the model).
// Measured (fp32, 2 and 4 ranks) against one process: loss 9.1e-7 relative, norm 1.3e-5,
// parameters rms 1.9e-6 and max 2.7e-4; against TP of the same size. Without the norm gradients'
// sum the parameters move by 3e-2 (checked by breaking it on purpose).

struct SpCase {
  const char* name;
  ModelKind kind;
  DType dtype;
  std::int64_t accum;
  double clip;
  Tier params, optimizer;
  bool checkpointing;
};

void check_sp_case(const SpCase& c) {
  TrainerConfig config = config_for(c.kind, c.dtype, c.accum, c.clip);
  config.model.activation_checkpointing = c.checkpointing;
  OffloadSettings s;
  s.params = c.params;
  s.optimizer = c.optimizer;
  s.persistence_threshold = 0;
  constexpr int kSteps = 3;
  const Snapshot tp = train_tp(config, s, kSteps);
  s.sequence_parallel = true;
  const Snapshot sp = train_tp(config, s, kSteps);
  s.sequence_parallel = false;
  const Snapshot ref = testing::train(config, s, kSteps);
  const std::string what = std::string(c.name) + ", sequence parallel, tp " + std::to_string(world().size());
  expect_ranks_identical(sp, what);
  const Tolerance tol = c.dtype == DType::kF32 ? Tolerance{} : bf16_tolerance();
  expect_close(ref, sp, tol, what + " vs one process");
  expect_close(tp, sp, tol, what + " vs tensor parallel");
}

TEST(SequenceParallel, Gpt2Fp32OptimizerOnDeviceAccumulationClipping) {
  check_sp_case({"gpt2 fp32, optimizer on the device, accumulation 2, clip 0.5", ModelKind::kGpt2,
                 DType::kF32, 2, 0.5, Tier::kDevice, Tier::kDevice, false});
}

// The host optimizer updates each unit as its gradients land (clipping off): the norms' summed
// gradients must be complete by the time the unit's bucket is copied out.
TEST(SequenceParallel, Gpt2Fp32ParametersAndOptimizerOnHost) {
  check_sp_case({"gpt2 fp32, parameters and optimizer on host", ModelKind::kGpt2, DType::kF32, 1, 0.0,
                 Tier::kHost, Tier::kHost, false});
}

// Checkpointing: the recomputed block forward runs the all-gathers and reduce-scatters again.
TEST(SequenceParallel, LlamaGroupedKvFp32OptimizerOnHostCheckpointing) {
  check_sp_case({"llama (grouped kv heads) fp32, optimizer on host, clip 1, checkpointing", ModelKind::kLlama,
                 DType::kF32, 2, 1.0, Tier::kDevice, Tier::kHost, true});
}

TEST(SequenceParallel, Gpt2Bf16OptimizerOnDevice) {
  check_sp_case({"gpt2 bf16, optimizer on the device", ModelKind::kGpt2, DType::kBF16, 1, 0.0, Tier::kDevice,
                 Tier::kDevice, false});
}

// Activation offload with sequence parallelism: each rank offloads its rows of the checkpointed
// block inputs. Only where those inputs wait changes (the device ring and pinned host copies, both
// of N/t rows; the copies move the bytes unchanged and the compute stream waits for them), so the
// run is the checkpointed sequence-parallel run bit for bit; and every copy is 1/t of the tensor-
// parallel run's (the same copies, of this rank's rows), as are the pinned host bytes.
TEST(SequenceParallel, ActivationOffloadIsTheCheckpointedRunBitForBit) {
  const auto t = static_cast<std::uint64_t>(world().size());
  for (const ModelKind kind : {ModelKind::kGpt2, ModelKind::kLlama}) {
    TrainerConfig config = config_for(kind, DType::kF32, 2, 1.0);
    config.model.n_layer = 5;  // more block inputs than the device ring holds
    config.model.activation_checkpointing = true;
    OffloadSettings s;
    s.optimizer = Tier::kHost;
    s.sequence_parallel = true;
    const Snapshot kept = train_tp(config, s, 3);
    s.offload_activations = true;
    const Snapshot moved = train_tp(config, s, 3);
    const std::string what =
        std::string(to_string(kind)) + ", sequence parallel, tp " + std::to_string(world().size());
    ASSERT_FALSE(kept.param.empty()) << what;
    expect_ranks_identical(moved, what);
    EXPECT_EQ(kept.losses, moved.losses) << what;
    EXPECT_EQ(kept.norms, moved.norms) << what;
    EXPECT_EQ(kept.param, moved.param) << what;
    EXPECT_EQ(kept.master, moved.master) << what;
    EXPECT_EQ(kept.m, moved.m) << what;
    EXPECT_EQ(kept.v, moved.v) << what;
    EXPECT_NE(kept.losses.front(), kept.losses.back()) << what << ": the run trained";
    // The traffic and the pinned copies: 1/t of tensor parallelism's offload.
    auto traffic = [&](bool sp, OffloadStats* st, std::uint64_t* host_bytes) {
      OffloadSettings o = s;
      o.sequence_parallel = sp;
      auto device = testing::make_device();
      auto engine = OffloadEngine::create(config, o, *device, nullptr, nullptr, &world());
      ASSERT_TRUE(engine.ok()) << engine.status().to_string();
      Snapshot one;
      ASSERT_TRUE(testing::run_steps(**engine, config, 0, 1, one)) << what;
      ASSERT_TRUE((*engine)->synchronize().ok());
      *st = (*engine)->stats();
      *host_bytes = (*engine)->model().activation_host_bytes();
    };
    OffloadStats full, split;
    std::uint64_t full_host = 0, split_host = 0;
    traffic(false, &full, &full_host);
    traffic(true, &split, &split_host);
    EXPECT_GT(split.bytes_activations_to_host, 0u) << what;
    EXPECT_GT(split.bytes_activations_to_device, 0u) << what;
    EXPECT_EQ(t * split.bytes_activations_to_host, full.bytes_activations_to_host) << what;
    EXPECT_EQ(t * split.bytes_activations_to_device, full.bytes_activations_to_device) << what;
    EXPECT_EQ(t * split_host, full_host) << what << ": pinned host copies";
  }
}

std::uint64_t align256(std::uint64_t n) { return (n + 255) / 256 * 256; }

// The activation account (docs/parallel.md "Sequence parallel", "Activation memory"): with
// Bmax·Tmax = N rows, the split buffers fall from N to N/t rows and three buffers are added.
// Sizes are chosen so that every buffer is a multiple of the carving alignment, so the account
// is exact.
TEST(SequenceParallel, SplitRegionsActivationBytesFallByT) {
  const int t = world().size();
  for (const ModelKind kind : {ModelKind::kGpt2, ModelKind::kLlama}) {
    const ModelConfig mc = config_for(kind, DType::kF32, 1, 0.0).model;
    auto layout = describe_model(mc, TensorParallel{t, world().rank()});
    ASSERT_TRUE(layout.ok()) << layout.status().to_string();
    Model::Options o;
    o.max_batch = 8;
    o.max_seq_len = 32;
    o.tensor_parallel = &world();
    auto bytes_of = [&](bool sp, std::uint64_t* out) {
      auto device = testing::make_device();
      auto stream = device->create_stream("sp-test");
      ASSERT_TRUE(stream.ok()) << stream.status().to_string();
      o.sequence_parallel = sp;
      auto model = Model::create(*layout, *device, **stream, o);
      ASSERT_TRUE(model.ok()) << model.status().to_string();
      *out = (*model)->activation_bytes();
    };
    std::uint64_t full = 0, split = 0;
    bytes_of(false, &full);
    bytes_of(true, &split);
    const std::uint64_t N = 8 * 32, C = static_cast<std::uint64_t>(mc.n_embd),
                        L = static_cast<std::uint64_t>(mc.n_layer);
    const std::uint64_t gpt2 = kind == ModelKind::kGpt2 ? 1 : 0;
    // The buffers of n rows that sequence parallelism splits: residuals x_0..x_L; per block norm1,
    // res2, norm2 and the norm statistics; the final norm and its statistics; the residual gradient.
    auto split_bytes = [&](std::uint64_t n) {
      const std::uint64_t rows = align256(n * C * 4), stat = align256(n * 4);
      return (L + 1) * rows + L * (3 * rows + (gpt2 ? 4 : 2) * stat) + rows + (gpt2 ? 2 : 1) * stat + rows;
    };
    const std::uint64_t Nl = N / static_cast<std::uint64_t>(t);
    const std::uint64_t added = align256(N * C * 4) + align256(Nl * C * 4) + align256(4 * C * 4);
    EXPECT_EQ(split, full - split_bytes(N) + split_bytes(Nl) + added) << to_string(kind) << ", tp " << t;
    EXPECT_LT(split, full) << to_string(kind);
    if (world().rank() == 0) {
      std::printf(
          "%s, tp %d: activation bytes %llu without sequence parallel, %llu with (split regions %llu -> "
          "%llu)\n",
          std::string(to_string(kind)).c_str(), t, static_cast<unsigned long long>(full),
          static_cast<unsigned long long>(split), static_cast<unsigned long long>(split_bytes(N)),
          static_cast<unsigned long long>(split_bytes(Nl)));
    }
  }
  // The engine's model runs on its rank's rows.
  TrainerConfig c = config_for(ModelKind::kGpt2, DType::kF32, 1, 0.0);
  OffloadSettings s;
  s.sequence_parallel = true;
  auto device = testing::make_device();
  auto engine = OffloadEngine::create(c, s, *device, nullptr, nullptr, &world());
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  Snapshot one;
  ASSERT_TRUE(testing::run_steps(**engine, c, 0, 1, one));
  EXPECT_EQ((*engine)->model().local_rows(), c.micro_batch * c.seq_len / t);
}

TEST(SequenceParallel, UnsupportedCombinationsAreNamed) {
  const TrainerConfig base = config_for(ModelKind::kGpt2, DType::kF32, 1, 0.0);
  OffloadSettings s;
  s.sequence_parallel = true;
  auto expect_refused = [&](const TrainerConfig& c, const OffloadSettings& st, Comm* tp, Comm* pp,
                            std::initializer_list<const char*> words, const char* what) {
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(c, st, *device, nullptr, nullptr, tp, pp);
    ASSERT_FALSE(engine.ok()) << what;
    for (const char* w : words)
      EXPECT_NE(engine.status().message().find(w), std::string::npos)
          << what << ": " << engine.status().to_string();
  };
  expect_refused(base, s, nullptr, nullptr, {"sequence_parallel", "tensor_parallel_size = 1"}, "one process");
  TrainerConfig odd = base;
  odd.seq_len = 17;
  expect_refused(odd, s, &world(), nullptr, {"sequence_parallel", "seq_len = 17", "tensor_parallel_size"},
                 "seq_len 17");
  // With a pipeline (interleaved too) and with activation offload it trains (test_dist_grid's
  // GridSequenceParallel, SequenceParallel.ActivationOffloadIsTheCheckpointedRunBitForBit).
  // The model on its own: a layout that is the whole model has nothing to split over.
  auto full = describe_model(base.model);
  ASSERT_TRUE(full.ok());
  auto device = testing::make_device();
  auto stream = device->create_stream("sp-test");
  ASSERT_TRUE(stream.ok());
  Model::Options o;
  o.max_seq_len = 16;
  o.sequence_parallel = true;
  auto model = Model::create(*full, *device, **stream, o);
  ASSERT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find("tensor_parallel_size"), std::string::npos)
      << model.status().to_string();
}

}  // namespace
}  // namespace strata
