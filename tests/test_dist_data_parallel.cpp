// Data parallelism on the offload engine, on real processes: run by tests/mpi_run.sh under
// `mpirun -np N` (tests/CMakeLists.txt). Every rank trains its share of a global batch (global
// micro-batches r, r + N, r + 2N, ...) with the data-parallel engine and, in the same process, the
// single-process engine on the whole global batch (grad_accum x N micro-batches) as the reference.
//
// What is compared, and how exactly:
// - Every rank ends with the same bits (parameters, master weights and Adam moments, hashed and
//   all-gathered): the ranks apply one all-reduced/reduce-scattered gradient and all-gather one
//   update, so they cannot drift apart.
// - Against the single process: the gradient of the global batch is summed in a different order
//   (each rank's micro-batches, then across ranks, instead of one micro-batch after another), so
//   the state agrees within fp32 rounding, not bit for bit. The tolerances below are stated per
//   quantity and were set from the measured differences with a 10x margin.
// - A checkpoint written by the data-parallel run (rank 0 writes, sharded state gathered) resumes
//   bit for bit, in the data-parallel run and in a single process.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "comm_environment.hpp"
#include "dist_compare.hpp"
#include "nvme/faults.hpp"
#include "offload/internal.hpp"
#include "offload_fixture.hpp"
#include "strata/parallel.hpp"

namespace strata {
namespace {

using testing::expect_close;
using testing::smallest_unit;
using testing::shared_temp_dir;
using testing::Snapshot;
using testing::Tolerance;

using testing::world;

using testing::local_of;
using testing::share;

bool run_dp_steps(OffloadEngine& engine, const TrainerConfig& global, int from, int to, Snapshot& out) {
  std::vector<std::int32_t> in, tg;
  for (int s = from; s < to; ++s) {
    share(global, s, in, tg);
    auto m = engine.step(in, tg);
    EXPECT_TRUE(m.ok()) << m.status().to_string();
    if (!m.ok()) return false;
    EXPECT_EQ(m->tokens, static_cast<std::int64_t>(in.size()) * world().size());
    out.losses.push_back(m->loss);
    out.norms.push_back(m->grad_norm);
    out.scales.push_back(m->loss_scale);
    out.skipped.push_back(m->skipped ? 1 : 0);
  }
  return true;
}

std::uint64_t fnv(const std::vector<std::vector<float>>& tensors, std::uint64_t h = 1469598103934665603ull) {
  for (const auto& t : tensors) {
    const auto* p = reinterpret_cast<const unsigned char*>(t.data());
    for (std::size_t i = 0; i < t.size() * 4; ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
  return h;
}

// Every rank holds the same state, bit for bit.
void expect_ranks_identical(const Snapshot& s) {
  std::uint64_t h = fnv(s.param);
  h = fnv(s.master, h);
  h = fnv(s.m, h);
  h = fnv(s.v, h);
  std::vector<std::uint64_t> all(static_cast<std::size_t>(world().size()));
  ASSERT_TRUE(world().all_gather(&h, all.data(), 2, DType::kF32).wait().ok());
  for (std::size_t r = 0; r < all.size(); ++r) EXPECT_EQ(all[r], all[0]) << "state of rank " << r << " vs rank 0";
}

// A wrong shard, a missing reduction or a bad scale moves most elements by about the learning
// rate; rounding moves a few elements by up to that (Adam's first steps turn the sign of a tiny
// gradient into a full step) and the rest by far less. So each quantity is held to a bound on
// the root mean square of the differences (the bulk) and a looser one on the largest.
// fp32, measured on 2 and 3 ranks (lr 1e-2, 4 steps): parameters rms 1.1e-6 and max 1.2e-4,
// moments rms below 1e-7 of their scale; loss and norm within the bounds below.
// The defaults of dist_compare.hpp's Tolerance are these fp32 bounds.

// bf16 working weights round the master to 8 bits: a master that differs by rounding rounds to
// a neighbouring bf16 value now and then, and the run drifts further than in fp32.
// Measured on 2 and 3 ranks (lr 1e-2, 4 steps): loss 2e-5 relative, norm 7e-4 relative,
// parameters rms 3.5e-4 and max 0.035, moments rms 1e-4 of their scale; a wrong shard moves the
// parameters' rms by about the learning rate (1e-2).
Tolerance bf16_tolerance() {
  Tolerance t;
  t.loss = 2e-4;
  t.norm = 5e-3;
  t.rms = 3e-3;
  t.max = 0.1;
  return t;
}

struct Case {
  const char* name;
  DType dtype;
  std::int64_t accum;  // per rank
  double clip;
  int stage;
  Tier params, optimizer;
  bool delayed = false;  // strata.delayed_update (warm-up 0), in the reference too
  ModelKind kind = ModelKind::kGpt2;
  Tier gradients = Tier::kHost;  // kNvme: each rank's reduced slices on its NVMe (and in the reference)
  std::int64_t bucket = 0;  // > 0: reduce_bucket_size in elements (the device optimizer's buckets)
  bool overlap = false;     // overlap_comm
};

Snapshot train_dp(const TrainerConfig& global, const OffloadSettings& s, int steps) {
  Snapshot out;
  auto device = testing::make_device();
  auto engine = OffloadEngine::create(local_of(global), s, *device, nullptr, &world());
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  if (!engine.ok()) return out;
  if (!run_dp_steps(**engine, global, 0, steps, out)) return out;
  testing::capture_state(**engine, out);
  return out;
}

void check_case(const Case& c) {
  const int P = world().size();
  const TrainerConfig global = testing::tiny(c.kind, c.dtype, c.accum * P, c.clip);
  OffloadSettings s;
  s.params = c.params;
  s.optimizer = c.optimizer;
  s.zero_stage = c.stage;
  s.persistence_threshold = 0;
  s.delayed_update = c.delayed;
  s.delayed_update_warmup = 0;
  s.gradients = c.gradients;
  if (c.bucket > 0) s.reduce_bucket_elements = c.bucket;
  s.overlap_comm = c.overlap;
  testing::TempDir swap_dp("strata-dp-swap"), swap_ref("strata-dp-swap");  // each rank its own
  const bool nvme = c.params == Tier::kNvme || c.optimizer == Tier::kNvme;
  if (nvme) s.nvme_path = {swap_dp.path().string()};
  s.sub_group_size = 1000;  // several sub-groups per slice: the NVMe pipeline's ring turns over
  constexpr int kSteps = 4;
  const Snapshot dp = train_dp(global, s, kSteps);
  OffloadSettings single = s;
  single.zero_stage = 0;
  if (nvme) single.nvme_path = {swap_ref.path().string()};
  const Snapshot ref = testing::train(global, single, kSteps);
  expect_ranks_identical(dp);
  Tolerance tol;
  if (c.dtype != DType::kF32) tol = bf16_tolerance();  // fp16's 11 bits drift less than bf16's 8
  expect_close(ref, dp, tol, c.name);
}

TEST(DataParallel, Stage1HostOptimizerFp32) {
  check_case({"stage 1, optimizer on host, fp32", DType::kF32, 1, 0.0, 1, Tier::kDevice, Tier::kHost});
}

TEST(DataParallel, Stage1HostOptimizerAccumulationAndClipping) {
  check_case({"stage 1, accumulation 2, clip 0.5", DType::kF32, 2, 0.5, 1, Tier::kDevice, Tier::kHost});
}

TEST(DataParallel, Stage2HostOptimizerBf16Accumulation) {
  check_case({"stage 2, bf16, accumulation 2, clip 1", DType::kBF16, 2, 1.0, 2, Tier::kDevice, Tier::kHost});
}

TEST(DataParallel, Stage2HostOptimizerFp16) {
  check_case({"stage 2, fp16, accumulation 2, clip 1", DType::kF16, 2, 1.0, 2, Tier::kDevice, Tier::kHost});
}

// fp16 with a loss scale far too large: every rank skips the same steps (each decides from the
// merged statistics of all ranks) and the single process skips them too; they train alike.
TEST(DataParallel, Fp16OverflowIsSkippedOnEveryRank) {
  const int P = world().size();
  TrainerConfig global = testing::tiny(ModelKind::kGpt2, DType::kF16, P, 1.0);
  global.loss_scaling.initial_scale_power = 24;
  global.loss_scaling.loss_scale_window = 1000;
  // Stage 0 and stage 2 with the optimizer on the device (the second sharded in device memory),
  // stage 1 with the host optimizer.
  const std::pair<int, Tier> runs[] = {{0, Tier::kDevice}, {1, Tier::kHost}, {2, Tier::kDevice}};
  for (const auto& [stage, optimizer] : runs) {
    OffloadSettings s;
    s.optimizer = optimizer;
    s.zero_stage = stage;
    s.persistence_threshold = 0;
    constexpr int kSteps = 12;
    const Snapshot dp = train_dp(global, s, kSteps);
    OffloadSettings single = s;
    single.zero_stage = 0;
    const Snapshot ref = testing::train(global, single, kSteps);
    expect_ranks_identical(dp);
    ASSERT_EQ(dp.skipped.size(), static_cast<std::size_t>(kSteps));
    std::vector<int> all(static_cast<std::size_t>(P * kSteps));
    ASSERT_TRUE(world().all_gather(dp.skipped.data(), all.data(), kSteps, DType::kF32).wait().ok());
    for (int r = 0; r < P; ++r) {
      for (int i = 0; i < kSteps; ++i)
        EXPECT_EQ(all[static_cast<std::size_t>(r * kSteps + i)], dp.skipped[static_cast<std::size_t>(i)])
            << "stage " << stage << ": rank " << r << ", step " << i + 1;
    }
    EXPECT_EQ(dp.skipped.front(), 1) << "stage " << stage;
    // The scale comes down to where the gradients fit (a later batch may overflow again at the edge).
    EXPECT_GE(std::count(dp.skipped.begin(), dp.skipped.end(), 0), 3) << "stage " << stage;
    EXPECT_EQ(dp.skipped, ref.skipped) << "stage " << stage;
    EXPECT_EQ(dp.scales, ref.scales) << "stage " << stage;
    expect_close(ref, dp, bf16_tolerance(), "fp16 overflow, stage " + std::to_string(stage));
  }
}

TEST(DataParallel, Stage2ParametersAndOptimizerOnHost) {
  check_case({"stage 2, parameters and optimizer on host", DType::kF32, 1, 1.0, 2, Tier::kHost, Tier::kHost});
}

TEST(DataParallel, Stage3ParametersShardedOnHost) {
  check_case({"stage 3, parameters sharded on host, accumulation 2, clip 1", DType::kF32, 2, 1.0, 3, Tier::kHost,
              Tier::kHost});
}

TEST(DataParallel, Stage3ParametersShardedOnNvmeBf16) {
  check_case({"stage 3, parameters sharded on NVMe, bf16", DType::kBF16, 1, 1.0, 3, Tier::kNvme, Tier::kHost});
}

TEST(DataParallel, Stage2OptimizerOnNvme) {
  check_case({"stage 2, optimizer on NVMe, accumulation 2, clip 1", DType::kF32, 2, 1.0, 2, Tier::kDevice, Tier::kNvme});
}

// ZeRO-Infinity's placement: parameters and optimizer state partitioned and on NVMe.
TEST(DataParallel, Stage3EverythingOnNvmeBf16) {
  check_case({"stage 3, parameters and optimizer on NVMe, bf16", DType::kBF16, 1, 1.0, 3, Tier::kNvme, Tier::kNvme});
}

// The delayed update: each rank's shard update is delayed the same way, so the data-parallel run
// follows the single process's delayed run (itself checked bit for bit against its hand-driven
// reference in test_offload_delayed_update.cpp) within the same rounding tolerances.
TEST(DataParallel, DelayedUpdateStage2HostOptimizerBf16) {
  check_case({"delayed update, stage 2, bf16, accumulation 2, clip 1", DType::kBF16, 2, 1.0, 2, Tier::kDevice,
              Tier::kHost, true});
}

TEST(DataParallel, DelayedUpdateStage1OptimizerOnNvme) {
  check_case({"delayed update, stage 1, optimizer on NVMe, clip 0.5", DType::kF32, 1, 0.5, 1, Tier::kDevice,
              Tier::kNvme, true});
}

TEST(DataParallel, Stage0OptimizerOnDevice) {
  check_case({"stage 0, optimizer on the device", DType::kF32, 2, 1.0, 0, Tier::kDevice, Tier::kDevice});
}

// ZeRO stages 1-3 with the optimizer state sharded in device memory (docs/parallel.md "ZeRO
// stages 1-3 in device memory"), against one process on the same global batch: the gradient
// sum runs in another order (each rank's micro-batches, then the reduce-scatter), so within the
// rounding tolerances of the host tier's cases above.
TEST(DataParallel, Stage1DeviceOptimizerFp32) {
  check_case({"stage 1, optimizer sharded on the device, fp32", DType::kF32, 1, 0.0, 1, Tier::kDevice,
              Tier::kDevice});
}

TEST(DataParallel, Stage1DeviceOptimizerAccumulationAndClippingLlama) {
  check_case({"stage 1, optimizer sharded on the device, LLaMA, accumulation 2, clip 0.5", DType::kF32, 2,
              0.5, 1, Tier::kDevice, Tier::kDevice, false, ModelKind::kLlama});
}

TEST(DataParallel, Stage2DeviceOptimizerBf16AccumulationClipping) {
  check_case({"stage 2, optimizer sharded on the device, bf16, accumulation 2, clip 1", DType::kBF16, 2, 1.0,
              2, Tier::kDevice, Tier::kDevice});
}

TEST(DataParallel, Stage3DeviceOptimizerBf16Llama) {
  check_case({"stage 3, optimizer sharded on the device, LLaMA, bf16, clip 1", DType::kBF16, 1, 1.0, 3,
              Tier::kDevice, Tier::kDevice, false, ModelKind::kLlama});
}

// The sharded device optimizer reduces, scans, merges and updates exactly as the sharded host
// optimizer does (the same reduce-scatter of the same chunks, the same per-unit scan merged in
// unit then rank order, the same Adam kernels on the same slices): on the same ranks the two
// placements give the same bits, losses and norms included. GPT-2 (tied embedding), clipping.
TEST(DataParallel, DeviceShardedEqualsHostShardedBitwise) {
  const int P = world().size();
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const TrainerConfig global = testing::tiny(ModelKind::kGpt2, dtype, 2 * P, 1.0);
    OffloadSettings s;
    s.zero_stage = 1;
    s.persistence_threshold = 0;
    s.optimizer = Tier::kHost;
    s.update_during_backward = false;
    const Snapshot host = train_dp(global, s, 3);
    s.optimizer = Tier::kDevice;
    const Snapshot dev = train_dp(global, s, 3);
    testing::expect_same(host, dev,
                         std::string("device-sharded vs host-sharded, ") + std::string(to_string(dtype)));
  }
}

// Stage 1 keeps each rank's accumulated gradients and reduces once; stage 2 reduces every
// micro-batch: the same update within rounding, and each rank's optimizer state is 1/N.
TEST(DataParallel, ShardedPlanHoldsOneShardPerRank) {
  const int P = world().size();
  const TrainerConfig global = testing::tiny(ModelKind::kLlama, DType::kBF16, 2 * P, 0.0);
  OffloadSettings s;
  s.optimizer = Tier::kHost;
  s.zero_stage = 2;
  auto device = testing::make_device();
  auto engine = OffloadEngine::create(local_of(global), s, *device, nullptr, &world());
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  OffloadSettings one = s;
  one.dp_size = 1;
  auto single = OffloadPlan::make(local_of(global), one);
  ASSERT_TRUE(single.ok());
  auto bytes_of = [](const OffloadPlan& p, const std::string& prefix) {
    std::uint64_t b = 0;
    for (const PlanLine& l : p.lines)
      if (l.what.rfind(prefix, 0) == 0) b += l.bytes;
    return b;
  };
  const std::uint64_t full = bytes_of(*single, "Adam exp_avg_sq");
  const std::uint64_t mine = bytes_of((*engine)->plan(), "Adam exp_avg_sq");
  EXPECT_GT(full, 0u);
  EXPECT_LE(mine, full / static_cast<std::uint64_t>(P) + 64u * 4u * 32u) << "one shard plus rounding per module";
  EXPECT_GE(mine, full / static_cast<std::uint64_t>(P) / 2);
  // Stage 2 keeps no unsharded gradients.
  EXPECT_EQ(bytes_of((*engine)->plan(), "gradient accumulation"), 0u);
  // Stage 3 with the parameters on the host keeps 1/N of them there.
  OffloadSettings s3 = s;
  s3.zero_stage = 3;
  s3.params = Tier::kHost;
  s3.persistence_threshold = 0;
  s3.dp_size = P;
  OffloadSettings s3one = s3;
  s3one.dp_size = 1;
  auto p3 = OffloadPlan::make(local_of(global), s3);
  auto p3one = OffloadPlan::make(local_of(global), s3one);
  ASSERT_TRUE(p3.ok() && p3one.ok());
  const std::uint64_t whole = bytes_of(*p3one, "working parameters (host copy)");
  const std::uint64_t slice = bytes_of(*p3, "working parameters (this rank");
  EXPECT_GT(whole, 0u);
  EXPECT_LE(slice, whole / static_cast<std::uint64_t>(P) + 64u * 2u * 32u);
  EXPECT_GE(slice, whole / static_cast<std::uint64_t>(P) / 2);
  // The NVMe optimizer tier holds 1/N of the state per rank, too.
  OffloadSettings sn = s;
  sn.optimizer = Tier::kNvme;
  sn.nvme_path = {"nvme"};  // a name: the plan touches no disk
  sn.io.nvme_path = sn.nvme_path;
  OffloadSettings snone = sn;
  sn.dp_size = P;
  auto pn = OffloadPlan::make(local_of(global), sn);
  auto pnone = OffloadPlan::make(local_of(global), snone);
  ASSERT_TRUE(pn.ok() && pnone.ok()) << pn.status().to_string();
  const std::uint64_t all_state = bytes_of(*pnone, "fp32 master + exp_avg + exp_avg_sq");
  const std::uint64_t my_state = bytes_of(*pn, "fp32 master + exp_avg + exp_avg_sq");
  EXPECT_GT(all_state, 0u);
  EXPECT_LE(my_state, all_state / static_cast<std::uint64_t>(P) + 12u * 64u * 32u);
  EXPECT_GE(my_state, all_state / static_cast<std::uint64_t>(P) / 2);
  Snapshot out;
  ASSERT_TRUE(run_dp_steps(**engine, global, 0, 2, out));
  const OffloadStats st = (*engine)->stats();
  EXPECT_GT(st.bytes_dp, 0u);
  EXPECT_LT(out.losses.back(), out.losses.front() + 1.0);
}

// Stages 1-3 with the optimizer on the device: each rank's master and moments in device memory are
// its 1/N (the plan's lines, and the arena bytes the engine carved against stage 0's); the
// gradients stay whole at stage 1 and are this rank's slices plus the buckets at stages 2-3.
TEST(DataParallel, DeviceShardedPlanHoldsOneShardPerRank) {
  const int P = world().size();
  const TrainerConfig global = testing::tiny(ModelKind::kLlama, DType::kBF16, P, 0.0);
  std::uint64_t live0 = 0;
  {
    OffloadSettings s0;
    s0.optimizer = Tier::kDevice;
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(local_of(global), s0, *device, nullptr, &world());
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    live0 = device->memory().stats().live_bytes;
  }
  for (int stage : {1, 2, 3}) {
    OffloadSettings s;
    s.optimizer = Tier::kDevice;
    s.zero_stage = stage;
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(local_of(global), s, *device, nullptr, &world());
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    OffloadSettings one = s;
    one.dp_size = 1;
    auto single = OffloadPlan::make(local_of(global), one);
    ASSERT_TRUE(single.ok());
    auto bytes_of = [](const OffloadPlan& p, const std::string& prefix) {
      std::uint64_t b = 0;
      for (const PlanLine& l : p.lines)
        if (l.what.rfind(prefix, 0) == 0 && l.tier == Tier::kDevice) b += l.bytes;
      return b;
    };
    const auto Pu = static_cast<std::uint64_t>(P);
    std::uint64_t saved = 0;
    for (const char* region : {"optim.master", "optim.exp_avg", "optim.exp_avg_sq"}) {
      const std::string line = std::string("device region ") + region;
      // "optim.exp_avg" is a prefix of "optim.exp_avg_sq": match up to the space after the name.
      const std::uint64_t full = bytes_of(*single, line),
                          mine = bytes_of((*engine)->plan(), line + " (this rank's 1/");
      const std::uint64_t full_exact =
          region == std::string("optim.exp_avg") ? full - bytes_of(*single, line + "_sq") : full;
      EXPECT_GT(full_exact, 0u) << region;
      EXPECT_LE(mine, full_exact / Pu + 64u * 4u * 32u) << region << ": one shard plus rounding per module";
      EXPECT_GE(mine, full_exact / Pu / 2) << region;
      saved += full_exact - mine;
    }
    // The arena: stage 0's live bytes less the state saved, plus the collectives' staging.
    const std::uint64_t staging = bytes_of((*engine)->plan(), "device region offload.dp_staging");
    EXPECT_GT(staging, 0u);
    // (Each carved block is rounded up to the arena's 256-byte alignment: 4 blocks differ.)
    // Stage >= 2: the gradients are this rank's slices too, plus the bucket buffers and the reduce
    // staging (checked in DeviceGradientsShardedPlan below).
    std::uint64_t grad_saved = 0, grad_extra = 0;
    if (stage >= 2) {
      const std::uint64_t full = bytes_of(*single, "device region offload.grads"),
                          mine = bytes_of((*engine)->plan(), "device region offload.grads (this rank's 1/");
      EXPECT_GT(mine, 0u);
      grad_saved = full - mine;
      grad_extra = bytes_of((*engine)->plan(), "device region offload.grad_buckets");
      EXPECT_GT(grad_extra, 0u);
    }
    const auto got = static_cast<double>(device->memory().stats().live_bytes + saved + grad_saved);
    EXPECT_NEAR(got, static_cast<double>(live0 + staging + grad_extra), 4 * 256.0) << "stage " << stage;
    if (stage == 1) {
      EXPECT_EQ(bytes_of((*engine)->plan(), "device region offload.grads"),
                bytes_of(*single, "device region offload.grads"))
          << "the gradients stay whole";
    }
    EXPECT_LT((*engine)->plan().device_bytes, single->device_bytes);
    Snapshot out;
    ASSERT_TRUE(run_dp_steps(**engine, global, 0, 2, out));
    EXPECT_GT((*engine)->stats().bytes_dp, 0u);
  }
}

// ---- Gradient buckets (docs/parallel.md "Gradient buckets") --------------------------------------

// The buckets every rank derives for a config and settings (dp_size: this job's ranks).
offload_detail::GradBuckets buckets_of(const TrainerConfig& c, OffloadSettings s) {
  s.dp_size = world().size();
  auto layout = describe_model(c.model);
  EXPECT_TRUE(layout.ok());
  const offload_detail::Units units = offload_detail::describe_units(*layout, s);
  return offload_detail::grad_buckets(units, s);
}

// A reduce_bucket_size that makes the tiny model's transformer blocks buckets of their own (each
// block's unit is about 50k elements; a unit is never split).
constexpr std::int64_t kSmallBucket = 20'000;

// Stage 0 with the optimizer on the device: the all-reduce bucketed into backward is the
// after-backward all-reduce of the same local sums, element by element, so every bucketing and
// overlap_comm on or off give the same bits (2 ranks: a sum of two commutes whatever MPI's
// algorithm; 3 ranks: measured, asserted here). Against one process: the existing tolerances.
TEST(DataParallel, Stage0BucketedAllReduceIsBitwiseTheWholeAllReduce) {
  const int P = world().size();
  struct Run {
    const char* name;
    ModelKind kind;
    DType dtype;
    std::int64_t accum;
  };
  for (const Run& r : {Run{"GPT-2 fp32, accumulation 2", ModelKind::kGpt2, DType::kF32, 2},
                       Run{"LLaMA bf16", ModelKind::kLlama, DType::kBF16, 1}}) {
    const TrainerConfig global = testing::tiny(r.kind, r.dtype, r.accum * P, 1.0);
    OffloadSettings s;
    s.optimizer = Tier::kDevice;
    s.zero_stage = 0;
    ASSERT_EQ(buckets_of(global, s).units.size(), 1u) << "the default bucket holds the whole gradient";
    const Snapshot whole = train_dp(global, s, 3);
    s.reduce_bucket_elements = kSmallBucket;
    ASSERT_GE(buckets_of(global, s).units.size(), 4u) << r.name;
    s.overlap_comm = false;
    const Snapshot serial = train_dp(global, s, 3);
    s.overlap_comm = true;
    const Snapshot overlapped = train_dp(global, s, 3);
    expect_ranks_identical(overlapped);
    testing::expect_same(serial, overlapped, std::string("stage 0 buckets, overlap_comm off vs on, ") + r.name);
    testing::expect_same(whole, overlapped, std::string("stage 0, one bucket vs several, ") + r.name);
    OffloadSettings single;
    single.optimizer = Tier::kDevice;
    const Snapshot ref = testing::train(global, single, 3);
    expect_close(ref, overlapped, r.dtype == DType::kF32 ? Tolerance{} : bf16_tolerance(),
                 std::string("stage 0 buckets vs one process, ") + r.name);
  }
}

// Stage 2 (and 3) in device memory against one process on the same global batch: gradients
// reduce-scattered per bucket during backward, every micro-batch, into each rank's slices.
TEST(DataParallel, Stage2DeviceGradientsShardedFp32AccumulationClipping) {
  Case c{"stage 2 in device memory, buckets, overlap, fp32, accumulation 2, clip 1", DType::kF32, 2, 1.0, 2,
         Tier::kDevice, Tier::kDevice};
  c.bucket = kSmallBucket;
  c.overlap = true;
  check_case(c);
}

TEST(DataParallel, Stage2DeviceGradientsShardedBf16Llama) {
  Case c{"stage 2 in device memory, buckets, LLaMA, bf16, clip 1", DType::kBF16, 1, 1.0, 2, Tier::kDevice,
         Tier::kDevice, false, ModelKind::kLlama};
  c.bucket = kSmallBucket;
  check_case(c);
}

// Stage 2 reduces every element over the same ranks' same local gradients as stage 1 when each
// rank runs one micro-batch: bitwise stage 1 (GPT-2 with its tied embedding, whose bucket stays
// open through backward; LLaMA; fp32 and bf16; clipping), whatever the bucketing and overlap_comm.
// With accumulation stage 2 sums the reductions of each micro-batch, which is the host tier's
// stage-2 arithmetic: bitwise the sharded host optimizer at stage 2.
TEST(DataParallel, Stage2DeviceGradientsBitwiseStage1AndHostStage2) {
  const int P = world().size();
  for (ModelKind kind : {ModelKind::kGpt2, ModelKind::kLlama}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const std::string what = std::string(kind == ModelKind::kGpt2 ? "GPT-2 " : "LLaMA ") +
                               std::string(to_string(dtype));
      const TrainerConfig global = testing::tiny(kind, dtype, P, 1.0);
      OffloadSettings s;
      s.optimizer = Tier::kDevice;
      s.zero_stage = 1;
      const Snapshot stage1 = train_dp(global, s, 3);
      s.zero_stage = 2;
      const Snapshot one_bucket = train_dp(global, s, 3);
      s.reduce_bucket_elements = kSmallBucket;
      s.overlap_comm = true;
      const Snapshot buckets = train_dp(global, s, 3);
      expect_ranks_identical(buckets);
      testing::expect_same(stage1, one_bucket, "stage 1 vs stage 2 (one bucket), " + what);
      testing::expect_same(stage1, buckets, "stage 1 vs stage 2 (buckets, overlap), " + what);
    }
  }
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const TrainerConfig global = testing::tiny(ModelKind::kGpt2, dtype, 2 * P, 1.0);
    OffloadSettings s;
    s.zero_stage = 2;
    s.persistence_threshold = 0;
    s.optimizer = Tier::kHost;
    s.update_during_backward = false;
    const Snapshot host = train_dp(global, s, 3);
    s.optimizer = Tier::kDevice;
    s.reduce_bucket_elements = kSmallBucket;
    s.overlap_comm = false;
    const Snapshot serial = train_dp(global, s, 3);
    s.overlap_comm = true;
    const Snapshot dev = train_dp(global, s, 3);
    testing::expect_same(host, dev, "host stage 2 vs device stage 2, accumulation 2, " + std::string(to_string(dtype)));
    testing::expect_same(serial, dev, "device stage 2, overlap_comm off vs on, " + std::string(to_string(dtype)));
  }
}

// Stage 2 in device memory: each rank's device gradients are its 1/N slices (offload.grads) plus
// a bounded set of bucket buffers that does not grow with the model's depth.
TEST(DataParallel, DeviceGradientsShardedPlan) {
  const int P = world().size();
  const auto Pu = static_cast<std::uint64_t>(P);
  auto bytes_of = [](const OffloadPlan& p, const std::string& prefix) {
    std::uint64_t b = 0;
    for (const PlanLine& l : p.lines)
      if (l.what.rfind(prefix, 0) == 0 && l.tier == Tier::kDevice) b += l.bytes;
    return b;
  };
  OffloadSettings s;
  s.optimizer = Tier::kDevice;
  s.zero_stage = 2;
  s.reduce_bucket_elements = 60'000;
  s.overlap_comm = true;
  std::uint64_t bucket_bytes[2] = {0, 0};
  int k = 0;
  for (int layers : {3, 12}) {
    TrainerConfig global = testing::tiny(ModelKind::kGpt2, DType::kBF16, P, 0.0);
    global.model.n_layer = layers;
    OffloadSettings one = s;
    one.zero_stage = 0;
    one.dp_size = 1;
    auto single = OffloadPlan::make(local_of(global), one);
    ASSERT_TRUE(single.ok()) << single.status().to_string();
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(local_of(global), s, *device, nullptr, &world());
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    const OffloadPlan& plan = (*engine)->plan();
    const std::uint64_t full = bytes_of(*single, "device region offload.grads");
    const std::uint64_t mine = bytes_of(plan, "device region offload.grads (this rank's 1/" + std::to_string(P) + ")");
    const offload_detail::GradBuckets g = buckets_of(global, s);
    EXPECT_LE(mine, full / Pu + 64u * 4u * 2u * static_cast<std::uint64_t>(layers + 2)) << layers << " layers";
    EXPECT_GE(mine, full / Pu) << layers << " layers";
    const std::uint64_t buffers = bytes_of(plan, "device region offload.grad_buckets");
    EXPECT_EQ(g.live, 2u) << "the tied embedding's bucket stays open through backward, beside one other";
    // The open buckets and one in flight (overlap_comm), each the largest bucket padded to
    // P chunks per unit plus its receive part.
    EXPECT_EQ(buffers, (g.live + 1) * offload_detail::grad_bucket_slot_bytes(g));
    EXPECT_LE(g.max_bytes, 4u * 60'000u + 4u * 64u * Pu * 8u) << "the bucket is reduce_bucket_size plus padding";
    bucket_bytes[k++] = buffers;
    // 12 layers: the shard and the buckets together below one process's whole gradient.
    if (layers == 12) {
      EXPECT_LT(mine + buffers, full);
    }
    Snapshot out;
    ASSERT_TRUE(run_dp_steps(**engine, global, 0, 1, out));
    EXPECT_GT((*engine)->stats().bytes_dp, 0u);
  }
  EXPECT_EQ(bucket_bytes[0], bucket_bytes[1]) << "the buckets do not grow with the depth";
  // A bucket of no elements is refused, naming the key.
  OffloadSettings zero = s;
  zero.reduce_bucket_elements = 0;
  const Status bad = zero.validate();
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("zero_optimization.reduce_bucket_size: expected an integer >= 1"), std::string::npos)
      << bad.message();
  // The gradients stay sharded in the reported state: loss_and_gradients has no whole gradient.
  const TrainerConfig global = testing::tiny(ModelKind::kGpt2, DType::kF32, P, 0.0);
  auto device = testing::make_device();
  auto engine = OffloadEngine::create(local_of(global), s, *device, nullptr, &world());
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  std::vector<std::int32_t> in, tg;
  share(global, 0, in, tg);
  auto r = (*engine)->loss_and_gradients(in, tg);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().to_string().find("use stage 0 or 1"), std::string::npos) << r.status().to_string();
}

// ---- Stage 3 in device memory (docs/parallel.md "Stage 3 in device memory") ----------------------

// Stage 3 gathers each sliced unit's working parameters before use; the gathered bits are the
// ones stage 2's all-gather after the update laid into its whole copy, the gradients go through
// the same buckets and reduce-scatters, and the update runs the same arithmetic on the same
// slices. So stage 3 equals stage 2 on the same ranks bit for bit: losses, norms, parameters,
// masters and moments. GPT-2 (tied embedding: the head reads a sliced unit it does not own) fp32
// and bf16 with accumulation 2, clipping, small buckets with overlap, one persistent module;
// LLaMA bf16.
TEST(DataParallel, Stage3DeviceParamsShardedBitwiseStage2) {
  const int P = world().size();
  struct C {
    ModelKind kind;
    DType dtype;
    std::int64_t accum;
    bool small_buckets;
  };
  for (const C& c : {C{ModelKind::kGpt2, DType::kF32, 2, true}, C{ModelKind::kGpt2, DType::kBF16, 2, false},
                     C{ModelKind::kLlama, DType::kBF16, 1, true}}) {
    const std::string what = std::string(c.kind == ModelKind::kGpt2 ? "GPT-2 " : "LLaMA ") +
                             std::string(to_string(c.dtype)) + ", accumulation " + std::to_string(c.accum);
    const TrainerConfig global = testing::tiny(c.kind, c.dtype, c.accum * P, 1.0);
    OffloadSettings s;
    s.optimizer = Tier::kDevice;
    s.persistence_threshold = smallest_unit(global);
    if (c.small_buckets) {
      s.reduce_bucket_elements = kSmallBucket;
      s.overlap_comm = true;
    }
    s.zero_stage = 2;
    const Snapshot stage2 = train_dp(global, s, 3);
    s.zero_stage = 3;
    // The settings slice every unit but the smallest.
    OffloadSettings sd = s;
    sd.dp_size = P;
    auto layout = describe_model(local_of(global).model);
    ASSERT_TRUE(layout.ok());
    const offload_detail::Units u = offload_detail::describe_units(*layout, sd);
    const auto sliced = std::count(u.sliced.begin(), u.sliced.end(), 1);
    EXPECT_GE(sliced, 4) << what;
    EXPECT_LT(sliced, std::count_if(u.gbytes.begin(), u.gbytes.end(), [](std::uint64_t b) { return b > 0; }))
        << what << ": the smallest module stays whole";
    const Snapshot stage3 = train_dp(global, s, 3);
    expect_ranks_identical(stage3);
    testing::expect_same(stage2, stage3, "stage 2 vs stage 3 in device memory, " + what);
  }
}

// Stage 3 in device memory against one process on the same global batch (the existing
// Stage3DeviceOptimizerBf16Llama case covers LLaMA bf16): GPT-2 fp32 with accumulation 2 and
// clipping, within the fp32 tolerances.
TEST(DataParallel, Stage3DeviceParamsShardedFp32AgainstOneProcess) {
  Case c{"stage 3 in device memory, fp32, accumulation 2, clip 1", DType::kF32, 2, 1.0, 3, Tier::kDevice,
         Tier::kDevice};
  c.bucket = kSmallBucket;
  c.overlap = true;
  check_case(c);
}

// Each rank's device memory holds 1/N of the sliced modules' working parameters: the plan's
// offload.params is stage 2's less (N - 1)/N of the sliced units' bytes (within each unit's
// rounding to 64 elements and the 256-byte alignment), the param slots hold the gathered units,
// and the arena's live bytes are stage 2's less that saving plus the slots. loss() and
// evaluate() gather the units too: the same values as stage 2 on the same ranks.
TEST(DataParallel, Stage3DevicePlanShardsParameters) {
  const int P = world().size();
  const auto Pu = static_cast<std::uint64_t>(P);
  const TrainerConfig global = testing::tiny(ModelKind::kGpt2, DType::kBF16, P, 0.0);
  auto bytes_of = [](const OffloadPlan& p, const std::string& prefix, Tier tier = Tier::kDevice) {
    std::uint64_t b = 0;
    for (const PlanLine& l : p.lines)
      if (l.what.rfind(prefix, 0) == 0 && l.tier == tier) b += l.bytes;
    return b;
  };
  OffloadSettings s;
  s.optimizer = Tier::kDevice;
  s.persistence_threshold = smallest_unit(global);
  std::uint64_t params[2] = {0, 0}, live[2] = {0, 0}, slots = 0;
  std::uint64_t accesses[2] = {0, 0}, hits[2] = {0, 0}, dp_bytes[2] = {0, 0};
  double losses[2] = {0, 0};
  EvalResult evals[2];
  for (int stage : {2, 3}) {
    s.zero_stage = stage;
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(local_of(global), s, *device, nullptr, &world());
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    const OffloadPlan& plan = (*engine)->plan();
    const int k = stage - 2;
    params[k] = bytes_of(plan, "device region offload.params");
    live[k] = device->memory().stats().live_bytes;
    if (stage == 3) {
      EXPECT_GT(bytes_of(plan, "device region offload.params (this rank's 1/" + std::to_string(P) +
                                   " of the modules above stage3_param_persistence_threshold)"),
                0u);
      slots = bytes_of(plan, "device region offload.param_slots");
      EXPECT_EQ(slots, static_cast<std::uint64_t>(plan.param_slots) * plan.param_slot_bytes);
      EXPECT_GT(plan.param_slots, 0u);
      EXPECT_GT(bytes_of(plan, "data-parallel parameter fetch staging (pinned)", Tier::kHost), 0u);
    } else {
      EXPECT_EQ(bytes_of(plan, "device region offload.param_slots"), 0u);
    }
    Snapshot out;
    ASSERT_TRUE(run_dp_steps(**engine, global, 0, 2, out));
    const OffloadStats st = (*engine)->stats();
    accesses[k] = st.param_accesses;
    hits[k] = st.prefetch_hits;
    dp_bytes[k] = st.bytes_dp;
    std::vector<std::int32_t> in, tg;
    share(global, 2, in, tg);
    auto l = (*engine)->loss(in, tg);
    ASSERT_TRUE(l.ok()) << l.status().to_string();
    losses[k] = *l;
    std::vector<std::int32_t> tokens(static_cast<std::size_t>(3 * (global.seq_len + 1)));
    for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((i * 7 + 3) % 97);
    auto e = (*engine)->evaluate(tokens, 3);
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    evals[k] = *e;
  }
  // The sliced units' working bytes (bf16) and what rank 0 keeps of them.
  OffloadSettings sd = s;
  sd.dp_size = P;
  auto layout = describe_model(local_of(global).model);
  ASSERT_TRUE(layout.ok());
  const offload_detail::Units u = offload_detail::describe_units(*layout, sd);
  std::uint64_t whole = 0, units_sliced = 0;
  for (std::size_t m = 0; m < u.sliced.size(); ++m) {
    if (!u.sliced[m]) continue;
    whole += u.pbytes[m];
    ++units_sliced;
  }
  ASSERT_GT(units_sliced, 0u);
  const std::uint64_t saving = whole - whole / Pu;  // (N - 1)/N of the sliced units
  const std::uint64_t slack = units_sliced * (2u * 64u + 2u * 256u);
  EXPECT_LE(params[1], params[0] - saving + slack) << "stage 3 keeps 1/" << P << " of the sliced modules";
  EXPECT_GE(params[1] + slack, params[0] - saving);
  EXPECT_LT(params[1], params[0]);
  EXPECT_NEAR(static_cast<double>(live[1]), static_cast<double>(live[0] - (params[0] - params[1]) + slots),
              4 * 256.0);
  // Stage 3 fetches the sliced units (forward and backward), the second step ahead of use from
  // the first step's trace; each fetch is an all-gather (stage 2 gathers once, after the update).
  EXPECT_EQ(accesses[0], 0u);
  EXPECT_GE(accesses[1], 2u * 2u * units_sliced) << "every sliced unit fetched in forward and backward";
  EXPECT_GT(hits[1], 0u) << "the trace-driven prefetch gathers ahead of use";
  EXPECT_GT(dp_bytes[1], dp_bytes[0]);
  EXPECT_EQ(losses[0], losses[1]) << "loss() at stage 3 reads the gathered units";
  EXPECT_EQ(evals[0].loss, evals[1].loss) << "evaluate() at stage 3 reads the gathered units";
  EXPECT_EQ(evals[0].tokens, evals[1].tokens);
  EXPECT_GT(evals[1].tokens, 0);
  // With tensor parallelism stage 3 slices each tp rank's shard (tests/test_dist_device_tp.cpp),
  // with a pipeline each stage's units, and stages 2-3 bucket the stage's gradients
  // (tests/test_dist_device_pp.cpp).
  OffloadSettings tp = sd;
  tp.zero_stage = 3;
  tp.tp_size = 2;
  EXPECT_TRUE(offload_detail::dp_device_param_sharded(tp));
  EXPECT_TRUE(offload_detail::dp_device_grad_sharded(tp));
  OffloadSettings pp = sd;
  pp.zero_stage = 3;
  pp.pipeline_bounds = {0, 2, static_cast<int>(layout->modules.size())};
  EXPECT_TRUE(offload_detail::dp_device_param_sharded(pp));
  EXPECT_TRUE(offload_detail::dp_device_grad_sharded(pp));
  sd.zero_stage = 3;
  EXPECT_TRUE(offload_detail::dp_device_param_sharded(sd));
}

// Saved by a data-parallel run, a checkpoint resumes bit for bit in the data-parallel run and
// loads into a single process with the very state the ranks held.
void check_checkpoint(int stage, Tier params, Tier optimizer = Tier::kHost) {
  const int P = world().size();
  const TrainerConfig global = testing::tiny(ModelKind::kGpt2, DType::kBF16, 2 * P, 1.0);
  const TrainerConfig local = local_of(global);
  OffloadSettings s;
  s.optimizer = optimizer;
  s.params = params;
  s.persistence_threshold = 0;
  s.zero_stage = stage;
  const std::string root = shared_temp_dir("ckpt");
  Snapshot straight, at_save;
  std::string dir;
  {
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(local, s, *device, nullptr, &world());
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    ASSERT_TRUE(run_dp_steps(**engine, global, 0, 2, straight));
    auto saved = (*engine)->save_checkpoint(root, R"({"run":"dp"})", 2);
    ASSERT_TRUE(saved.ok()) << saved.status().to_string();
    dir = *saved;
    ASSERT_TRUE(testing::capture_state(**engine, at_save));
    ASSERT_TRUE(run_dp_steps(**engine, global, 2, 4, straight));
    ASSERT_TRUE(testing::capture_state(**engine, straight));
  }
  EXPECT_TRUE(std::filesystem::exists(dir + "/manifest.json")) << dir;
  Snapshot resumed;
  {
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(local, s, *device, nullptr, &world());
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    auto m = (*engine)->load_checkpoint(root);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    EXPECT_EQ(m->step, 2);
    EXPECT_EQ(m->client_state, R"({"run":"dp"})");
    resumed.losses = {straight.losses[0], straight.losses[1]};
    resumed.norms = {straight.norms[0], straight.norms[1]};
    resumed.scales = {straight.scales[0], straight.scales[1]};
    resumed.skipped = {straight.skipped[0], straight.skipped[1]};
    ASSERT_TRUE(run_dp_steps(**engine, global, 2, 4, resumed));
    ASSERT_TRUE(testing::capture_state(**engine, resumed));
  }
  testing::expect_same(straight, resumed, "data-parallel resume");
  {
    // One process, the optimizer on the device: the same state as the ranks held at the save.
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(global, OffloadSettings{}, *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    ASSERT_TRUE((*engine)->load_checkpoint(dir).ok());
    Snapshot single;
    single.losses = {straight.losses[0], straight.losses[1]};
    single.norms = {straight.norms[0], straight.norms[1]};
    single.scales = {straight.scales[0], straight.scales[1]};
    single.skipped = {straight.skipped[0], straight.skipped[1]};
    ASSERT_TRUE(testing::capture_state(**engine, single));
    Snapshot expected = at_save;
    expected.losses = single.losses;
    expected.norms = single.norms;
    expected.scales = single.scales;
    expected.skipped = single.skipped;
    testing::expect_same(expected, single, "single process from a data-parallel checkpoint");
  }
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == 0) std::filesystem::remove_all(root);
}

TEST(DataParallel, CheckpointResumesBitwiseStage2) { check_checkpoint(2, Tier::kDevice); }
TEST(DataParallel, CheckpointResumesBitwiseStage3) { check_checkpoint(3, Tier::kHost); }
TEST(DataParallel, CheckpointResumesBitwiseStage2DeviceOptimizer) {
  check_checkpoint(2, Tier::kDevice, Tier::kDevice);
}
// Stage 3 in device memory: every module's working parameters sliced (threshold 0); the save
// gathers the slices, the load keeps this rank's slice, one process loads the whole model.
TEST(DataParallel, CheckpointResumesBitwiseStage3DeviceParams) {
  check_checkpoint(3, Tier::kDevice, Tier::kDevice);
}

// Saved weights are the same file whichever stage trained them (stage 3 gathers the slices).
TEST(DataParallel, SaveWeightsIsCollective) {
  const int P = world().size();
  const TrainerConfig global = testing::tiny(ModelKind::kLlama, DType::kF32, P, 0.0);
  const std::string root = shared_temp_dir("weights");
  std::string files[2];
  std::uint64_t dp_bytes[2] = {0, 0};
  int k = 0;
  for (int stage : {2, 3}) {
    OffloadSettings s;
    s.optimizer = Tier::kHost;
    s.params = Tier::kHost;
    s.persistence_threshold = 0;
    s.zero_stage = stage;
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(local_of(global), s, *device, nullptr, &world());
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    Snapshot out;
    ASSERT_TRUE(run_dp_steps(**engine, global, 0, 1, out));
    files[k] = root + "/stage" + std::to_string(stage) + ".safetensors";
    dp_bytes[k] = (*engine)->stats().bytes_dp;
    ASSERT_TRUE((*engine)->save_weights(files[k]).ok());
    ++k;
  }
  // Stage 3 gathers every module's parameters for the forward and again for the backward
  // (both passes fetch them), stage 2 once after the update: more bytes.
  EXPECT_GT(dp_bytes[1], dp_bytes[0]);
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == 0) {
    const std::string a = testing::read_file(files[0]);
    ASSERT_GT(a.size(), 1000u);
    EXPECT_TRUE(a == testing::read_file(files[1])) << "stage 2 and stage 3 saved different weights";
  }
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == 0) std::filesystem::remove_all(root);
}

// Every data-parallel rank writes its part of the weights file, with the working parameters on
// the host and on NVMe, GPT-2 and LLaMA, fp32 and bf16, both formats. Stage 3: the part its slices
// hold (a slice cuts a unit's flat buffer, so it holds the end of one tensor and the start of the
// next; bf16 splits on element boundaries). Stages 1 and 2 (replicas): a contiguous 1/dp of every
// parameter (on 3 ranks the thirds end inside a tensor's row). Untrained, the file is one
// process's byte for byte; after a step it is the gather path's file (rank 0 writes everything)
// byte for byte, and every rank wrote its part.
void expect_every_rank_writes_its_part_of_the_weights(int stage) {
  const int P = world().size();
  struct Case {
    ModelKind kind;
    DType dtype;
    Tier params;
  };
  for (const Case c : {Case{ModelKind::kGpt2, DType::kF32, Tier::kHost}, Case{ModelKind::kGpt2, DType::kBF16, Tier::kNvme},
                       Case{ModelKind::kLlama, DType::kBF16, Tier::kHost}}) {
    const TrainerConfig global = testing::tiny(c.kind, c.dtype, P, 1.0);
    const std::string what = std::string(to_string(c.kind)) + " " + std::string(to_string(c.dtype)) + ", params on " +
                             std::string(to_string(c.params)) + ", dp " + std::to_string(P) + ", stage " +
                             std::to_string(stage);
    testing::TempDir swap("strata-dp-parwrite");  // each rank its own
    OffloadSettings s;
    s.zero_stage = stage;
    s.params = c.params;
    s.optimizer = Tier::kHost;
    s.persistence_threshold = 0;  // stage 3: every module's working parameters sliced
    if (c.params == Tier::kNvme) s.nvme_path = {swap.path().string()};
    const std::string root = shared_temp_dir("dp-parwrite");
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(local_of(global), s, *device, nullptr, &world());
    ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
    auto device1 = testing::make_device();
    auto single = OffloadEngine::create(global, OffloadSettings{}, *device1);
    ASSERT_TRUE(single.ok()) << what << ": " << single.status().to_string();
    testing::expect_weights_of_one_process(**engine, **single, root, what + ", untrained");
    Snapshot out;
    ASSERT_TRUE(run_dp_steps(**engine, global, 0, 1, out)) << what;
    testing::expect_parallel_weights_are_gathered(**engine, root, what + ", after a step");
    testing::expect_unseen_file_takes_the_gather_path(**engine, root, what);
    if (world().rank() == 0) std::filesystem::remove_all(root);
  }
}

TEST(DataParallel, Stage3EveryRankWritesItsSlicesOfTheWeights) { expect_every_rank_writes_its_part_of_the_weights(3); }

TEST(DataParallel, ReplicasSplitTheWeightsFileAmongTheirRanks) {
  expect_every_rank_writes_its_part_of_the_weights(1);
  expect_every_rank_writes_its_part_of_the_weights(2);
}

// Rank `failing` unable to write its part of the last tensor of the file (an injected EIO on its
// last element, which only that rank writes): every rank returns the same error naming that rank,
// the tensor and the path; no temporary file is left, a new path stays empty and the previous file
// keeps its bytes; with the fault gone the same engine saves the same bytes.
void expect_weights_fail_cleanly_when_a_rank_cannot_write(int stage, int failing) {
  const int P = world().size();
  const TrainerConfig global = testing::tiny(ModelKind::kGpt2, DType::kBF16, P, 1.0);
  OffloadSettings s;
  s.zero_stage = stage;
  s.params = Tier::kHost;
  s.optimizer = Tier::kHost;
  s.persistence_threshold = 0;
  nvme_detail::IoFaults faults;
  auto device = testing::make_device();
  auto engine = offload_detail::EngineFaults::create(local_of(global), s, *device, &faults, nullptr, &world());
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  Snapshot out;
  ASSERT_TRUE(run_dp_steps(**engine, global, 0, 1, out));
  const std::string root = shared_temp_dir("s3-wfault");
  const std::string weights = root + "/weights.safetensors", other = root + "/other.safetensors";
  ASSERT_TRUE((*engine)->save_weights(weights).ok());
  ASSERT_TRUE(world().barrier().wait().ok());
  const std::string before = testing::file_bytes(weights);
  auto file = SafetensorsFile::open(weights);
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  const SafetensorsEntry* last = &file->entries().front();
  for (const SafetensorsEntry& e : file->entries())
    if (e.data_end > last->data_end) last = &e;
  if (world().rank() == failing)
    faults.add_error({IoOp::kWrite, ".safetensors.tmp", file->data_offset() + last->data_end - 2, EIO});
  const std::string named = "data-parallel rank " + std::to_string(failing) + " of " + std::to_string(P) +
                            " could not write its tensors";
  for (const std::string& path : {weights, other}) {
    Status failed = (*engine)->save_weights(path);
    ASSERT_FALSE(failed.ok()) << "rank " << world().rank();
    EXPECT_EQ(failed.code(), StatusCode::kIoError) << failed.to_string();
    for (const std::string& part : {named, "'" + last->name + "'", path})
      EXPECT_NE(failed.message().find(part), std::string::npos) << "rank " << world().rank() << ": " << failed.to_string();
    testing::expect_same_text_on_every_rank(failed.message(), "save_weights");
  }
  faults.clear_errors();
  ASSERT_TRUE(world().barrier().wait().ok());  // rank 0 removed the temporary file before returning
  if (world().rank() == 0) {
    EXPECT_TRUE(testing::file_bytes(weights) == before) << "a failed save changed the previous file";
    EXPECT_FALSE(std::filesystem::exists(other)) << "a failed save left a file";
    for (const auto& f : std::filesystem::directory_iterator(root))
      EXPECT_EQ(f.path().filename().string().find(".tmp"), std::string::npos) << f.path();
  }
  ASSERT_TRUE(world().barrier().wait().ok());
  ASSERT_TRUE((*engine)->save_weights(other).ok());
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == 0) {
    EXPECT_TRUE(testing::file_bytes(other) == before) << "the save after the fault";
    std::filesystem::remove_all(root);
  }
  ASSERT_TRUE(world().barrier().wait().ok());
}

// Stage 3: the last unit, GPT-2's ln_f, has 128 elements and slices are 64-element chunks, so on 2
// and 3 ranks rank 1 holds its second half, the file's last bytes.
TEST(DataParallel, Stage3WeightsFailCleanlyWhenARankCannotWriteItsSlice) {
  expect_weights_fail_cleanly_when_a_rank_cannot_write(3, 1);
}

// Stages 1 and 2: the last data-parallel rank writes the last 1/dp of every parameter.
TEST(DataParallel, ReplicaWeightsFailCleanlyWhenARankCannotWriteItsPart) {
  expect_weights_fail_cleanly_when_a_rank_cannot_write(1, world().size() - 1);
  expect_weights_fail_cleanly_when_a_rank_cannot_write(2, world().size() - 1);
}

// Stage 3 with everything on NVMe; after a step the last rank's disk fails every read. Its
// save_weights and save_checkpoint cannot read its slices, but it keeps its place in each unit's
// exchange (agree_on_read), so every rank returns the same error naming that rank and the module
// at once, not after the comm timeout (the job's STRATA_COMM_TIMEOUT=60 is only a backstop: a
// regression fails with a timeout error instead of hanging). Nothing is written; with the faults
// cleared the same engine saves again.
TEST(DataParallel, ReadFailureOnOneRankFailsEveryRankAtOnce) {
  const int P = world().size(), failing = P - 1;
  const TrainerConfig global = testing::tiny(ModelKind::kGpt2, DType::kF32, P, 1.0);
  testing::TempDir swap("strata-dp-rfault");  // each rank its own
  OffloadSettings s;
  s.params = Tier::kNvme;
  s.optimizer = Tier::kNvme;
  s.zero_stage = 3;
  s.persistence_threshold = 0;  // every module's working parameters sharded on NVMe
  s.nvme_path = {swap.path().string()};
  nvme_detail::IoFaults faults;
  auto device = testing::make_device();
  auto engine =
      offload_detail::EngineFaults::create(local_of(global), s, *device, &faults, nullptr, &world());
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  Snapshot out;
  ASSERT_TRUE(run_dp_steps(**engine, global, 0, 1, out));
  ASSERT_TRUE((*engine)->synchronize().ok());  // the update is on disk before the disk fails
  const std::string root = shared_temp_dir("rfault");
  if (world().rank() == failing) {
    for (std::uint64_t offset = 0; offset < (64u << 20); offset += 4096)
      faults.add_error({IoOp::kRead, swap.path().string(), offset, EIO});
  }
  const std::string named = "data-parallel rank " + std::to_string(failing) + " of " + std::to_string(P) +
                            " could not read its slice of module '";
  const std::string weights = root + "/weights.safetensors";
  Status w = (*engine)->save_weights(weights);
  ASSERT_FALSE(w.ok()) << "rank " << world().rank();
  EXPECT_EQ(w.code(), StatusCode::kIoError) << w.to_string();
  EXPECT_NE(w.message().find(named), std::string::npos) << "rank " << world().rank() << ": " << w.to_string();
  EXPECT_NE(w.message().find(weights), std::string::npos) << w.to_string();
  EXPECT_EQ(w.message().find("comm timeout"), std::string::npos) << w.to_string();
  // Every rank returns the same text (the failing rank's cause included).
  testing::expect_same_text_on_every_rank(w.message(), "save_weights");

  auto ck = (*engine)->save_checkpoint(root + "/ckpt");
  ASSERT_FALSE(ck.ok()) << "rank " << world().rank();
  EXPECT_EQ(ck.status().code(), StatusCode::kIoError) << ck.status().to_string();
  EXPECT_NE(ck.status().message().find(named), std::string::npos)
      << "rank " << world().rank() << ": " << ck.status().to_string();
  EXPECT_EQ(ck.status().message().find("comm timeout"), std::string::npos) << ck.status().to_string();
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == 0) {
    EXPECT_FALSE(std::filesystem::exists(weights)) << "a failed save left a file";
    EXPECT_FALSE(std::filesystem::exists(root + "/ckpt/latest")) << "a failed checkpoint was published";
  }
  // The ranks are still in step: with the disk back, the same engine saves.
  faults.clear_errors();
  Status again = (*engine)->save_weights(weights);
  ASSERT_TRUE(again.ok()) << again.to_string();
  ASSERT_TRUE(world().barrier().wait().ok());
  if (world().rank() == 0) {
    EXPECT_GT(testing::read_file(weights).size(), 1000u);
    std::filesystem::remove_all(root);
  }
}

// The device-sharded optimizer (stage 1, the optimizer state in device memory): the last rank's
// device-to-host copies fail (injected at the engine's stager, as a failing copy returns). Reading
// a parameter's state and saving a checkpoint gather every rank's slice (collective), so the
// failing rank keeps its place in the unit's exchange and every rank returns the same error
// naming it and the module at once; the job's STRATA_COMM_TIMEOUT=60 is only a backstop (a
// regression fails with a timeout error instead of hanging). Nothing is published; with the fault
// cleared the same engines read and save again.
TEST(DataParallel, DeviceDownloadFailureOnOneRankFailsEveryRankAtOnce) {
  const int P = world().size(), failing = P - 1;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const std::string what = std::string("device-sharded, ") + std::string(to_string(dtype));
    const TrainerConfig global = testing::tiny(ModelKind::kGpt2, dtype, P, 1.0);
    OffloadSettings s;
    s.zero_stage = 1;
    s.persistence_threshold = 0;
    s.optimizer = Tier::kDevice;
    s.update_during_backward = false;
    auto device = testing::make_device();
    auto engine =
        offload_detail::EngineFaults::create(local_of(global), s, *device, nullptr, nullptr, &world());
    ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
    Snapshot out;
    ASSERT_TRUE(run_dp_steps(**engine, global, 0, 1, out)) << what;
    ASSERT_TRUE((*engine)->synchronize().ok()) << what;
    const std::string root = shared_temp_dir("dfault");
    if (world().rank() == failing) {
      offload_detail::EngineFaults::fail_state_downloads(**engine,
                                                         io_error("device-to-host copy failed (injected)"));
    }
    const std::string named = "data-parallel rank " + std::to_string(failing) + " of " + std::to_string(P) +
                              " could not read its slice of module '";
    auto same_text_everywhere = [&](const std::string& text) { testing::expect_same_text_on_every_rank(text, what); };
    // A state getter (the exp_avg of the first parameter: its unit's slices gathered).
    auto m = (*engine)->get_exp_avg(0);
    ASSERT_FALSE(m.ok()) << what << ": rank " << world().rank();
    EXPECT_EQ(m.status().code(), StatusCode::kIoError) << m.status().to_string();
    EXPECT_NE(m.status().message().find(named), std::string::npos)
        << what << ": rank " << world().rank() << ": " << m.status().to_string();
    EXPECT_NE(m.status().message().find("(injected)"), std::string::npos) << m.status().to_string();
    EXPECT_EQ(m.status().message().find("comm timeout"), std::string::npos) << m.status().to_string();
    same_text_everywhere(m.status().message());

    auto ck = (*engine)->save_checkpoint(root + "/ckpt");
    ASSERT_FALSE(ck.ok()) << what << ": rank " << world().rank();
    EXPECT_EQ(ck.status().code(), StatusCode::kIoError) << ck.status().to_string();
    EXPECT_NE(ck.status().message().find(named), std::string::npos)
        << what << ": rank " << world().rank() << ": " << ck.status().to_string();
    EXPECT_EQ(ck.status().message().find("comm timeout"), std::string::npos) << ck.status().to_string();
    same_text_everywhere(ck.status().message());
    ASSERT_TRUE(world().barrier().wait().ok());
    if (world().rank() == 0) {
      EXPECT_FALSE(std::filesystem::exists(root + "/ckpt/latest"))
          << what << ": a failed checkpoint was published";
    }
    // The ranks are still in step: with the copies working again the same engines read and save.
    offload_detail::EngineFaults::fail_state_downloads(**engine, ok_status());
    auto again = (*engine)->get_exp_avg(0);
    ASSERT_TRUE(again.ok()) << what << ": " << again.status().to_string();
    auto saved = (*engine)->save_checkpoint(root + "/ckpt");
    ASSERT_TRUE(saved.ok()) << what << ": " << saved.status().to_string();
    EXPECT_EQ(*saved, root + "/ckpt/step-00000001") << what;
    ASSERT_TRUE(world().barrier().wait().ok());
    if (world().rank() == 0) std::filesystem::remove_all(root);
  }
}

// The cost model's NVMe bytes per step (predict_step, what `strata plan` and `estimate` charge)
// against the engine's measured counters (OffloadStats::bytes_nvme_read / written over one step
// after warm-up): with P data-parallel ranks each rank moves its slices only — stage 3's working
// parameters of the gathered units (read at each fetch, written at the publish), the reduced
// gradients (stage 2 reads its slice back on later micro-batches to add; stage 1's earlier
// micro-batches write and restore the unsharded local sum whole) and the optimizer state's
// sub-groups. Exact on rank 0 (the model charges rank 0's slice, the largest); the other ranks'
// slices are no larger.
TEST(DataParallel, CostModelNvmeBytesAreTheEnginesPerRank) {
  const int P = world().size();
  struct Want {
    const char* what;
    int stage;
    Tier params, gradients;
    int accum;
  };
  for (const Want& w :
       {Want{"stage 3, parameters and optimizer on NVMe", 3, Tier::kNvme, Tier::kHost, 1},
        Want{"stage 3, parameters and optimizer on NVMe, accumulation 2", 3, Tier::kNvme, Tier::kHost, 2},
        Want{"stage 2, gradients and optimizer on NVMe, accumulation 2", 2, Tier::kDevice, Tier::kNvme, 2},
        Want{"stage 1, gradients and optimizer on NVMe, accumulation 2", 1, Tier::kDevice, Tier::kNvme, 2}}) {
    const TrainerConfig global = testing::tiny(ModelKind::kGpt2, DType::kF32, w.accum * P, 1.0);
    const TrainerConfig local = local_of(global);
    testing::TempDir swap("strata-dp-cost");  // each rank its own
    OffloadSettings s;
    s.zero_stage = w.stage;
    s.params = w.params;
    s.optimizer = Tier::kNvme;
    s.gradients = w.gradients;
    s.persistence_threshold = 0;
    s.update_during_backward = false;
    s.nvme_path = {swap.path().string()};
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(local, s, *device, nullptr, &world());
    ASSERT_TRUE(engine.ok()) << w.what << ": " << engine.status().to_string();
    Snapshot out;
    ASSERT_TRUE(run_dp_steps(**engine, global, 0, 2, out)) << w.what;
    ASSERT_TRUE((*engine)->synchronize().ok()) << w.what;
    const OffloadStats before = (*engine)->stats();
    ASSERT_TRUE(run_dp_steps(**engine, global, 2, 3, out)) << w.what;
    ASSERT_TRUE((*engine)->synchronize().ok()) << w.what;
    const OffloadStats after = (*engine)->stats();
    const std::uint64_t read = after.bytes_nvme_read - before.bytes_nvme_read;
    const std::uint64_t written = after.bytes_nvme_written - before.bytes_nvme_written;

    OffloadSettings planned = s;
    planned.dp_size = P;
    MachineRates r;
    const std::size_t M = (*engine)->model().layout().modules.size();
    r.forward_seconds.assign(M, 1e-3);
    r.backward_seconds.assign(M, 2e-3);
    r.h2d_bytes_per_s = r.d2h_bytes_per_s = r.host_copy_bytes_per_s = r.nvme_read_bytes_per_s = r.nvme_write_bytes_per_s = 1e9;
    r.adam_elements_per_s = r.scan_elements_per_s = 1e9;
    r.dp_bus_bytes_per_s = 1e9;
    auto p = predict_step(local, planned, r);
    ASSERT_TRUE(p.ok()) << w.what << ": " << p.status().to_string();
    EXPECT_GT(p->nvme_read_bytes, 0u) << w.what;
    if (world().rank() == 0) {
      EXPECT_EQ(read, p->nvme_read_bytes) << w.what << ": NVMe bytes read per step";
      EXPECT_EQ(written, p->nvme_write_bytes) << w.what << ": NVMe bytes written per step";
    } else {
      EXPECT_LE(read, p->nvme_read_bytes) << w.what << ": NVMe bytes read per step, rank " << world().rank();
      EXPECT_LE(written, p->nvme_write_bytes)
          << w.what << ": NVMe bytes written per step, rank " << world().rank();
    }
  }
}

// The cost model's data-parallel bytes per step with the optimizer on the device (predict_step's
// dp_bytes, dp_traffic's buffer bytes) against the engine's counter (OffloadStats::bytes_dp over
// one step after warm-up): stage 1 reduce-scatters and all-gathers every module in the update;
// stage 2 reduce-scatters each gradient bucket every micro-batch (several buckets here) and
// all-gathers after the update; stage 3 in device memory gathers a sliced module at each fetch of
// the slot rule (the trace-driven prefetch) instead. The model leaves out the per-step
// collectives of a few bytes, which the engine counts: the token count and the loss sums (one
// all-gather of 1 and one of 2 doubles per rank) and the update's per-module gradient
// statistics (one GradStats per module per rank). Exact on every rank (the chunks, and so the
// buffers, are the same on every rank).
TEST(DataParallel, CostModelDeviceStagesBytesAreTheEngines) {
  const int P = world().size();
  const auto Pu = static_cast<std::uint64_t>(P);
  for (int accum : {1, 2}) {
    const TrainerConfig global = testing::tiny(ModelKind::kGpt2, DType::kBF16, accum * P, 1.0);
    const TrainerConfig local = local_of(global);
    std::uint64_t h2d[3] = {0, 0, 0}, h2d_predicted[3] = {0, 0, 0};
    for (int stage : {1, 2, 3}) {
      const std::string what = "stage " + std::to_string(stage) + ", accumulation " + std::to_string(accum);
      OffloadSettings s;
      s.optimizer = Tier::kDevice;
      s.zero_stage = stage;
      s.persistence_threshold = smallest_unit(global);  // one module stays whole at stage 3
      s.reduce_bucket_elements = 20000;                 // several buckets
      s.overlap_comm = true;
      s.prefetch_modules = 1;
      s.prefetch_elements = 1'000'000'000;  // the look-ahead is the depth, as strata plan writes it
      auto device = testing::make_device();
      auto engine = OffloadEngine::create(local, s, *device, nullptr, &world());
      ASSERT_TRUE(engine.ok()) << what << ": " << engine.status().to_string();
      Snapshot out;
      ASSERT_TRUE(run_dp_steps(**engine, global, 0, 2, out)) << what;
      const OffloadStats before = (*engine)->stats();
      ASSERT_TRUE(run_dp_steps(**engine, global, 2, 3, out)) << what;
      const OffloadStats after = (*engine)->stats();
      const std::uint64_t measured = after.bytes_dp - before.bytes_dp;

      OffloadSettings planned = s;
      planned.dp_size = P;
      MachineRates r;
      const std::size_t M = (*engine)->model().layout().modules.size();
      r.forward_seconds.assign(M, 1e-3);
      r.backward_seconds.assign(M, 2e-3);
      r.h2d_bytes_per_s = r.d2h_bytes_per_s = r.host_copy_bytes_per_s = r.nvme_read_bytes_per_s =
          r.nvme_write_bytes_per_s = 1e9;
      r.adam_elements_per_s = r.scan_elements_per_s = 1e9;
      r.dp_bus_bytes_per_s = 1e9;
      auto p = predict_step(local, planned, r);
      ASSERT_TRUE(p.ok()) << what << ": " << p.status().to_string();
      auto t = dp_traffic(local, planned);
      ASSERT_TRUE(t.ok()) << what << ": " << t.status().to_string();
      EXPECT_EQ(p->dp_bytes, t->buffer_bytes()) << what;
      const std::uint64_t small = Pu * (8 + 16) + Pu * M * sizeof(GradStats);
      EXPECT_EQ(measured, p->dp_bytes + small)
          << what << ": data-parallel bytes per step, rank " << world().rank();
      h2d[stage - 1] = after.bytes_h2d - before.bytes_h2d;
      h2d_predicted[stage - 1] = p->h2d_bytes;
    }
    // Stage 3's copies of the gathered modules into their slots are the model's h2d bytes: the
    // device's other uploads (the batches) are stage 2's.
    EXPECT_EQ(h2d_predicted[1], 0u);
    EXPECT_GT(h2d_predicted[2], 0u);
    EXPECT_EQ(h2d[2] - h2d[1], h2d_predicted[2]) << "stage 3, accumulation " << accum;
  }
}

// Gradients on NVMe: each rank keeps only its reduced slices, as the optimizer's sub-groups, on
// its own NVMe; one process reference with its gradients on NVMe too. Stage 1 with accumulation
// carries the unsharded local sum on NVMe between micro-batches.
TEST(DataParallel, Stage1GradientsOnNvmeAccumulationClipping) {
  Case c{"stage 1, gradients and optimizer on NVMe, accumulation 2, clip 1", DType::kF32, 2, 1.0, 1,
         Tier::kDevice, Tier::kNvme};
  c.gradients = Tier::kNvme;
  check_case(c);
}

TEST(DataParallel, Stage2GradientsOnNvmeBf16Accumulation) {
  Case c{"stage 2, gradients and optimizer on NVMe, bf16, accumulation 2", DType::kBF16, 2, 0.0, 2,
         Tier::kDevice, Tier::kNvme};
  c.gradients = Tier::kNvme;
  check_case(c);
}

TEST(DataParallel, Stage3EverythingOnNvmeGradientsToo) {
  Case c{"stage 3, parameters, gradients and optimizer on NVMe, bf16, clip 1", DType::kBF16, 1, 1.0, 3,
         Tier::kNvme, Tier::kNvme};
  c.gradients = Tier::kNvme;
  check_case(c);
}

// The NVMe gradient slices go through the same reduce-scatter, additions (read back from NVMe),
// scan and Adam kernels as the host shard: on the same ranks the gradients on NVMe give the bits
// of the gradients on the host (losses, norms, parameters, masters, moments), and the plan holds
// the gradients on NVMe, 1/N per rank, with only the pinned staging on the host.
TEST(DataParallel, GradientsOnNvmeEqualHostGradientsBitwise) {
  const int P = world().size();
  struct Run {
    int stage;
    std::int64_t accum;
    DType dtype;
    double clip;
    Tier params;
  } runs[] = {{1, 2, DType::kF32, 1.0, Tier::kDevice},
              {2, 2, DType::kBF16, 1.0, Tier::kDevice},
              {3, 1, DType::kBF16, 0.0, Tier::kHost}};
  for (const Run& r : runs) {
    const TrainerConfig global = testing::tiny(ModelKind::kGpt2, r.dtype, r.accum * P, r.clip);
    OffloadSettings s;
    s.zero_stage = r.stage;
    s.params = r.params;
    s.optimizer = Tier::kNvme;
    s.persistence_threshold = 0;
    s.sub_group_size = 1000;
    testing::TempDir a("strata-dp-swap"), b("strata-dp-swap");
    s.nvme_path = {a.path().string()};
    const Snapshot host = train_dp(global, s, 3);
    s.gradients = Tier::kNvme;
    s.nvme_path = {b.path().string()};
    const Snapshot nvme = train_dp(global, s, 3);
    const std::string name = "stage " + std::to_string(r.stage) + " gradients on NVMe vs host, " +
                             std::string(to_string(r.dtype));
    ASSERT_EQ(host.losses.size(), 3u) << name;
    testing::expect_same(host, nvme, name);

    OffloadSettings plan_settings = s;
    plan_settings.nvme_path = {"nvme"};  // a name: the plan touches no disk
    plan_settings.io.nvme_path = plan_settings.nvme_path;
    plan_settings.dp_size = P;
    OffloadSettings one = plan_settings;
    one.dp_size = 1;
    auto plan = OffloadPlan::make(local_of(global), plan_settings);
    auto single = OffloadPlan::make(local_of(global), one);
    ASSERT_TRUE(plan.ok() && single.ok()) << plan.status().to_string() << single.status().to_string();
    std::uint64_t nvme_grads = 0, host_grads = 0, whole = 0;
    for (const PlanLine& l : plan->lines) {
      if (l.kind != StateKind::kGradients || l.what.find("accumulation") != std::string::npos) continue;
      if (l.tier == Tier::kNvme) nvme_grads += l.bytes;
      if (l.tier == Tier::kHost && l.what.find("staging") == std::string::npos) host_grads += l.bytes;
    }
    for (const PlanLine& l : single->lines)
      if (l.kind == StateKind::kGradients && l.tier == Tier::kNvme) whole += l.bytes;
    EXPECT_EQ(host_grads, 0u) << name << ": host memory for gradients is staging only";
    EXPECT_GT(whole, 0u);
    EXPECT_LE(nvme_grads, whole / static_cast<std::uint64_t>(P) + 4u * 64u * 32u) << name;
    EXPECT_GE(nvme_grads, whole / static_cast<std::uint64_t>(P) / 2) << name;
  }
}

TEST(DataParallel, RefusesWhatIsNotBuilt) {
  const TrainerConfig c = local_of(testing::tiny(ModelKind::kGpt2, DType::kF32, world().size(), 0.0));
  struct Bad {
    int stage;
    Tier optimizer, gradients;
    const char* says;
  } bad[] = {
      // Gradients on NVMe with several ranks are built; they still need the NVMe optimizer.
      {1, Tier::kHost, Tier::kNvme, "offload gradients = nvme needs the optimizer state on NVMe"},
  };
  testing::TempDir nvme;
  for (const Bad& b : bad) {
    OffloadSettings s;
    s.optimizer = b.optimizer;
    s.gradients = b.gradients;
    s.zero_stage = b.stage;
    if (b.optimizer == Tier::kNvme || b.gradients == Tier::kNvme) s.nvme_path = {nvme.path().string()};
    auto device = testing::make_device();
    auto engine = OffloadEngine::create(c, s, *device, nullptr, &world());
    ASSERT_FALSE(engine.ok()) << b.says;
    EXPECT_NE(engine.status().message().find(b.says), std::string::npos) << engine.status().to_string();
  }
}

}  // namespace
}  // namespace strata
