// predict_step, the step-time model of strata plan: a pure function checked against steps worked
// out by hand from the engine's schedule (docs/offload.md "One step"): the all-device step is
// its compute and update; a deferred host update exposes only the first unit's Adam; an immediate
// update exposes only the last landed unit's; prefetching hides every fetch but the first while
// fetching on demand serialises them all; the bytes each link moves; the NVMe optimizer reads
// its first sub-groups during backward; partial optimizer offload
// keeps the first units' gradients and update on the device; the delayed update hides the update
// behind the next step until it is longer than the step; activation offload copies each evicted
// block input out and back and stalls compute only where the ring makes it wait; data parallel
// adds each stage's collectives where the engine runs them (stage 0's all-reduce and the device-
// sharded stages after backward, stages 1-3 per module beside compute, stage 3 per fetch), with
// the bytes of docs/performance.md's per-stage table; tensor parallelism scales compute to the
// shard and charges each module's collectives (all-reduces, or sequence parallel's all-gathers and
// reduce-scatters); pipelines take the schedule's span over equal stages, (m + p - 1)(f + b) for
// 1F1B and GPipe and interleaving's smaller bubble, sends worked out op by op; bad rates name the
// rate.
#include <gtest/gtest.h>

#include <numeric>

#include "harness/harness.hpp"
#include "offload/internal.hpp"
#include "strata/engine.hpp"
#include "strata/model.hpp"
#include "strata/offload.hpp"
#include "strata/pipeline_schedule.hpp"

namespace strata::testing {
namespace {

// GPT-2, 2 blocks: modules embedding, h.0, h.1, head (the head reads the embedding's wte).
TrainerConfig tiny() {
  TrainerConfig t;
  t.model.kind = ModelKind::kGpt2;
  t.model.n_layer = 2;
  t.model.n_embd = 64;
  t.model.n_head = 2;
  t.model.n_positions = 16;
  t.model.vocab_size = 256;
  t.micro_batch = 2;
  t.seq_len = 16;
  return t;
}

struct Units {
  std::vector<std::uint64_t> elements, param_bytes;
};

Units units_of(const TrainerConfig& config) {
  auto layout = describe_model(config.model);
  EXPECT_TRUE(layout.ok());
  Units u;
  for (const ModuleDesc& m : layout->modules) {
    u.elements.push_back((m.grad_end - m.grad_begin) / 4);
    u.param_bytes.push_back(m.param_end - m.param_begin);
  }
  return u;
}

// One second of forward and two of backward per module; everything else effectively free unless a
// test slows it down.
MachineRates rates() {
  MachineRates r;
  r.forward_seconds = {1, 1, 1, 1};
  r.backward_seconds = {2, 2, 2, 2};
  r.device_update_seconds = 0.5;
  r.h2d_bytes_per_s = r.d2h_bytes_per_s = r.host_copy_bytes_per_s = 1e18;
  r.nvme_read_bytes_per_s = r.nvme_write_bytes_per_s = 1e18;
  r.adam_elements_per_s = r.scan_elements_per_s = 1e18;
  return r;
}

constexpr double kCompute = 4 * 1 + 4 * 2;

TEST(CostModel, AllDeviceIsComputeAndTheDeviceUpdate) {
  TrainerConfig c = tiny();
  c.grad_accum = 3;
  auto p = predict_step(c, OffloadSettings{}, rates());
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_DOUBLE_EQ(p->step_seconds, 3 * kCompute + 0.5);
  EXPECT_EQ(p->h2d_bytes + p->d2h_bytes + p->nvme_read_bytes + p->nvme_write_bytes, 0u);
}

TEST(CostModel, DeferredHostUpdateExposesOnlyTheFirstUnitsAdam) {
  // Clipping on: the update runs after the norm, in forward order, overlapped with the next
  // step's forward, which waits for each unit. Adam of the largest unit takes 0.5 s < 1 s of a
  // module's forward, so only unit 0's update is exposed.
  const TrainerConfig c = tiny();
  const Units u = units_of(c);
  MachineRates r = rates();
  r.adam_elements_per_s = static_cast<double>(*std::max_element(u.elements.begin(), u.elements.end())) / 0.5;
  OffloadSettings s;
  s.optimizer = Tier::kHost;
  auto p = predict_step(c, s, r);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  const double adam0 = static_cast<double>(u.elements[0]) / r.adam_elements_per_s;
  EXPECT_NEAR(p->step_seconds, kCompute + adam0, 1e-9);
  const double all = static_cast<double>(std::accumulate(u.elements.begin(), u.elements.end(), 0ull));
  EXPECT_NEAR(p->optimizer, all / r.adam_elements_per_s, 1e-9);
  EXPECT_NEAR(p->fetch_stall, adam0, 1e-9);  // compute idle while unit 0 is updated
}

TEST(CostModel, ImmediateHostUpdateExposesOnlyTheLastLandedUnit) {
  // Clipping off: each unit is updated as it lands during backward; the embedding lands last
  // (module 0's backward), so its Adam is all the caller waits for.
  TrainerConfig c = tiny();
  c.grad_clip = 0;
  const Units u = units_of(c);
  MachineRates r = rates();
  r.adam_elements_per_s = static_cast<double>(*std::max_element(u.elements.begin(), u.elements.end())) / 0.5;
  OffloadSettings s;
  s.optimizer = Tier::kHost;
  auto p = predict_step(c, s, r);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  const double adam0 = static_cast<double>(u.elements[0]) / r.adam_elements_per_s;
  EXPECT_NEAR(p->step_seconds, kCompute + adam0, 1e-9);
  EXPECT_NEAR(p->update_stall, adam0, 1e-9);
}

TEST(CostModel, PrefetchHidesFetchesThatOnDemandSerialises) {
  TrainerConfig c = tiny();
  c.grad_clip = 0;
  const Units u = units_of(c);
  MachineRates r = rates();
  // The largest unit's copy takes 0.25 s, well under a module's compute.
  r.h2d_bytes_per_s =
      static_cast<double>(*std::max_element(u.param_bytes.begin(), u.param_bytes.end())) / 0.25;
  auto fetch = [&](int unit) {
    return static_cast<double>(u.param_bytes[static_cast<std::size_t>(unit)]) / r.h2d_bytes_per_s;
  };
  OffloadSettings s;
  s.params = Tier::kHost;
  s.optimizer = Tier::kHost;
  s.persistence_threshold = 0;  // every module is fetched
  // The accesses fetch, window 1 or 2 alike: forward u0, u1, u2, u3 + u0 (the head reads wte);
  // the head's backward finds both still in their slots; then u2, u1, u0.
  const double all_fetches = 3 * fetch(0) + 2 * fetch(1) + 2 * fetch(2) + fetch(3);
  s.prefetch_modules = 0;
  auto on_demand = predict_step(c, s, r);
  ASSERT_TRUE(on_demand.ok()) << on_demand.status().to_string();
  EXPECT_NEAR(on_demand->step_seconds, kCompute + all_fetches, 1e-9);
  EXPECT_NEAR(on_demand->h2d, all_fetches, 1e-9);
  s.prefetch_modules = 2;
  auto ahead = predict_step(c, s, r);
  ASSERT_TRUE(ahead.ok()) << ahead.status().to_string();
  EXPECT_NEAR(ahead->step_seconds, kCompute + fetch(0), 1e-9);  // only the step's first fetch shows
  EXPECT_EQ(ahead->h2d_bytes, on_demand->h2d_bytes);
  EXPECT_EQ(ahead->h2d_bytes,
            3 * u.param_bytes[0] + 2 * u.param_bytes[1] + 2 * u.param_bytes[2] + u.param_bytes[3]);
}

TEST(CostModel, NvmeOptimizerMovesItsStateOncePerStepAndSlowerDisksCostTime) {
  const TrainerConfig c = tiny();
  const Units u = units_of(c);
  const std::uint64_t n = std::accumulate(u.elements.begin(), u.elements.end(), 0ull);
  MachineRates r = rates();
  r.nvme_read_bytes_per_s = r.nvme_write_bytes_per_s = static_cast<double>(12 * n);  // 1 s each way
  OffloadSettings s;
  s.optimizer = Tier::kNvme;
  s.gradients = Tier::kNvme;
  s.nvme_path = {"nvme"};
  s.io.nvme_path = s.nvme_path;
  s.sub_group_size = 4096;
  auto p = predict_step(c, s, r);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  // [master | m | v] read and written once, gradients written once and read once, per step.
  EXPECT_EQ(p->nvme_read_bytes, 12 * n + 4 * n);
  EXPECT_EQ(p->nvme_write_bytes, 12 * n + 4 * n);
  EXPECT_GT(p->step_seconds, kCompute);
  r.nvme_read_bytes_per_s /= 4;
  r.nvme_write_bytes_per_s /= 4;
  auto slower = predict_step(c, s, r);
  ASSERT_TRUE(slower.ok());
  EXPECT_GT(slower->step_seconds, p->step_seconds + 1.0);
}

// The NVMe optimizer's reads during backward (docs/offload.md "Optimizer-state reads during
// backward"): one sub-group per unit (sub_group_size above every unit), a ring of R = 4 buffers,
// so the state of units 0, 1 and 2 is read during backward and only unit 3's (the head's
// ln_f, 128 elements) after the norm. Everything but the reads is free. Units 0-2 are the next
// forward's first (prefetch_modules + 1): each counts as updated as soon as its writes retired,
// so the next forward runs them while unit 3 is read, and waits for unit 3 only when it reaches
// it. (Before, every unit counted as updated only when the update's writes retired at its end,
// and the next forward waited for unit 3's read: the step was its compute plus that read.) A
// disk faster than backward: the step is its compute alone (without the early reads it would be
// compute plus units 0-2's reads, all after the norm). A disk slower than the whole step: the
// disk is busy from one step's first landed unit to the next's, and the step is the time of
// every read.
TEST(CostModel, NvmeOptimizerReadsItsFirstSubGroupsDuringBackward) {
  const TrainerConfig c = tiny();
  const Units u = units_of(c);
  const std::uint64_t n = std::accumulate(u.elements.begin(), u.elements.end(), 0ull);
  ASSERT_EQ(u.elements.size(), 4u);
  OffloadSettings s;
  s.optimizer = Tier::kNvme;
  s.nvme_path = {"nvme"};
  s.io.nvme_path = s.nvme_path;
  s.sub_group_size = 1'000'000;
  s.nvme_buffer_count = 4;
  for (const double all_reads : {2.0, 24.0}) {
    SCOPED_TRACE("reading the whole state takes " + std::to_string(all_reads) + " s");
    MachineRates r = rates();
    r.nvme_read_bytes_per_s = static_cast<double>(12 * n) / all_reads;
    auto p = predict_step(c, s, r);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    EXPECT_EQ(p->nvme_read_bytes, 12 * n);
    EXPECT_NEAR(p->nvme_read, all_reads, 1e-6);
    if (all_reads < 8.0) {
      EXPECT_NEAR(p->step_seconds, kCompute, 1e-6);
    } else {
      EXPECT_NEAR(p->step_seconds, all_reads, 1e-6);
    }
  }
}

TEST(CostModel, SharedCoresChargeOverlappedCpuWork) {
  const TrainerConfig c = tiny();
  const Units u = units_of(c);
  MachineRates r = rates();
  r.adam_elements_per_s = static_cast<double>(*std::max_element(u.elements.begin(), u.elements.end())) / 0.5;
  OffloadSettings s;
  s.optimizer = Tier::kHost;
  auto alone = predict_step(c, s, r);
  r.shared_cores = true;
  r.cores = 2;
  auto shared = predict_step(c, s, r);
  ASSERT_TRUE(alone.ok() && shared.ok());
  EXPECT_EQ(alone->contention, 0.0);
  EXPECT_GT(shared->contention, 0.0);
  EXPECT_NEAR(shared->step_seconds, alone->step_seconds + shared->contention, 1e-9);
  EXPECT_LE(shared->contention, shared->optimizer / 2 + 1e-9);
}

TEST(CostModel, PartialOffloadUpdatesTheFirstUnitsOnTheDeviceAndMovesOnlyTheRest) {
  // ratio just under 1 - (embedding's share): the embedding (unit 0) stays on the device. Its
  // gradients never leave, and the step no longer waits for its host Adam (0.5 s for the largest
  // unit) but for its share of the device update (0.5 s for everything), on compute after the
  // norm; the host units' updates hide behind the next forward as before.
  const TrainerConfig c = tiny();
  const Units u = units_of(c);
  const std::uint64_t total = std::accumulate(u.elements.begin(), u.elements.end(), 0ull);
  MachineRates r = rates();
  r.adam_elements_per_s = static_cast<double>(*std::max_element(u.elements.begin(), u.elements.end())) / 0.5;
  OffloadSettings s;
  s.optimizer = Tier::kHost;
  s.optimizer_ratio = 1.0 - (static_cast<double>(u.elements[0]) + 0.5) / static_cast<double>(total);
  auto p = predict_step(c, s, r);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  const double dev_share = 0.5 * static_cast<double>(u.elements[0]) / static_cast<double>(total);
  EXPECT_NEAR(p->step_seconds, kCompute + dev_share, 1e-9);
  EXPECT_NEAR(p->compute, kCompute + dev_share, 1e-9);
  EXPECT_EQ(p->d2h_bytes, 4 * (total - u.elements[0]));  // the device unit's gradients stay
  EXPECT_NEAR(p->optimizer, static_cast<double>(total - u.elements[0]) / r.adam_elements_per_s, 1e-9);
  // Against ratio 1: the whole embedding's Adam was exposed.
  s.optimizer_ratio = 1.0;
  auto all_host = predict_step(c, s, r);
  ASSERT_TRUE(all_host.ok());
  EXPECT_NEAR(all_host->step_seconds, kCompute + static_cast<double>(u.elements[0]) / r.adam_elements_per_s,
              1e-9);
  EXPECT_EQ(all_host->d2h_bytes, 4 * total);
}

TEST(CostModel, DelayedUpdateHidesTheUpdateUntilItIsLongerThanTheStep) {
  // Fast Adam (0.5 s for the largest unit): the ordinary deferred step exposes unit 0's update
  // (the next forward waits for it); the delayed one exposes nothing. Slow Adam (all units 30 s
  // > the 12 s of compute): the delayed step is bound by the update (the next step's backward
  // and its end wait for it), and both are at least the update's length, the ordinary one more.
  const TrainerConfig c = tiny();
  const Units u = units_of(c);
  const double total = static_cast<double>(std::accumulate(u.elements.begin(), u.elements.end(), 0ull));
  MachineRates r = rates();
  r.adam_elements_per_s = static_cast<double>(*std::max_element(u.elements.begin(), u.elements.end())) / 0.5;
  OffloadSettings s;
  s.optimizer = Tier::kHost;
  OffloadSettings d = s;
  d.delayed_update = true;
  auto ordinary = predict_step(c, s, r);
  auto delayed = predict_step(c, d, r);
  ASSERT_TRUE(ordinary.ok() && delayed.ok()) << delayed.status().to_string();
  EXPECT_NEAR(ordinary->step_seconds, kCompute + static_cast<double>(u.elements[0]) / r.adam_elements_per_s,
              1e-9);
  EXPECT_NEAR(delayed->step_seconds, kCompute, 1e-9);
  EXPECT_NEAR(delayed->optimizer, ordinary->optimizer, 1e-9);
  EXPECT_EQ(delayed->h2d_bytes, ordinary->h2d_bytes);  // every unit uploaded once either way
  r.adam_elements_per_s = total / 30.0;
  ordinary = predict_step(c, s, r);
  delayed = predict_step(c, d, r);
  ASSERT_TRUE(ordinary.ok() && delayed.ok());
  EXPECT_NEAR(delayed->step_seconds, 30.0, 1e-9);
  EXPECT_GT(ordinary->step_seconds, delayed->step_seconds + 1.0);
}

TEST(CostModel, DelayedUpdateWithHostHomesCopiesEachNextVersionOnTheCallerBeforeTheStepReturns) {
  // Parameters at home in host memory: publish_delayed copies each unit's next version over the
  // published one on the caller's thread, after every stream is idle and before step() returns,
  // so the copy adds to the step in full. 5 s of copies (all units' working bytes at a rate that
  // makes them 5 s) lengthen the step by 5 s; NVMe homes flip a version and copy nothing.
  const TrainerConfig c = tiny();
  const Units u = units_of(c);
  const std::uint64_t pbytes = std::accumulate(u.param_bytes.begin(), u.param_bytes.end(), 0ull);
  OffloadSettings d;
  d.params = Tier::kHost;
  d.optimizer = Tier::kHost;
  d.persistence_threshold = 0;  // every module at home in host memory
  d.delayed_update = true;
  MachineRates r = rates();
  auto fast = predict_step(c, d, r);
  r.host_copy_bytes_per_s = static_cast<double>(pbytes) / 5.0;
  auto slow = predict_step(c, d, r);
  ASSERT_TRUE(fast.ok() && slow.ok()) << slow.status().to_string();
  EXPECT_EQ(slow->host_copy_bytes, pbytes);
  EXPECT_NEAR(slow->host_copy, 5.0, 1e-9);
  EXPECT_NEAR(slow->step_seconds, fast->step_seconds + 5.0, 1e-6);
  EXPECT_NE(slow->to_string().find("host copy"), std::string::npos);
  OffloadSettings n = d;
  n.params = Tier::kNvme;
  n.nvme_path = {"/tmp/unused"};
  auto flip = predict_step(c, n, r);
  ASSERT_TRUE(flip.ok()) << flip.status().to_string();
  EXPECT_EQ(flip->host_copy_bytes, 0u);
  OffloadSettings plain = d;
  plain.delayed_update = false;
  auto ordinary = predict_step(c, plain, r);
  ASSERT_TRUE(ordinary.ok());
  EXPECT_EQ(ordinary->host_copy_bytes, 0u);
  r.host_copy_bytes_per_s = 0;
  auto bad = predict_step(c, d, r);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("host_copy_bytes_per_s"), std::string::npos) << bad.status().to_string();
}

TEST(CostModel, ActivationOffloadCopiesEachEvictedInputOutAndBack) {
  // 5 blocks: modules embedding, h.0..h.4, head; a ring of 3 buffers evicts x_0, x_1, x_2 (x_3,
  // x_4 and the head's x_5 stay), each (B*T, C) fp32 = 2*16*64*4 bytes, once out and once back
  // per micro-batch. Copies of 0.25 s hide behind the blocks; copies of 3 s (a block's forward
  // is 1 s) stall compute, worked out by hand from the ring's waits:
  //   forward  emb 0-1, h.0 1-2 (x_0 out 2-5), h.1 2-3 (x_1 out 5-8), h.2 waits x_0: 5-6 (x_2 out
  //            8-11), h.3 waits x_1: 8-9, h.4 waits x_2: 11-12, head 12-13;
  //   backward head 13-15 (x_2 in 15-18), h.4 15-17 (x_1 in 18-21), h.3 17-19 (x_0 in 21-24),
  //            h.2 waits x_2: 19-21, h.1 waits x_1: 21-23, h.0 waits x_0: 24-26, emb 26-28;
  //   then the device update (0.5 s): 28.5 s, 7 s of it stalls.
  TrainerConfig c = tiny();
  c.model.n_layer = 5;
  c.model.activation_checkpointing = true;
  const std::uint64_t act = 2 * 16 * 64 * 4;
  MachineRates r = rates();
  r.forward_seconds.assign(7, 1.0);
  r.backward_seconds.assign(7, 2.0);
  r.h2d_bytes_per_s = r.d2h_bytes_per_s = static_cast<double>(act) / 0.25;
  OffloadSettings s;
  s.offload_activations = true;
  auto hidden = predict_step(c, s, r);
  ASSERT_TRUE(hidden.ok()) << hidden.status().to_string();
  EXPECT_NEAR(hidden->step_seconds, 21.5, 1e-9);
  EXPECT_EQ(hidden->d2h_bytes, 3 * act);
  EXPECT_EQ(hidden->h2d_bytes, 3 * act);
  r.h2d_bytes_per_s = r.d2h_bytes_per_s = static_cast<double>(act) / 3.0;
  auto slow = predict_step(c, s, r);
  ASSERT_TRUE(slow.ok());
  EXPECT_NEAR(slow->step_seconds, 28.5, 1e-9);
  EXPECT_NEAR(slow->fetch_stall, 7.0, 1e-9);
  EXPECT_NEAR(slow->d2h, 9.0, 1e-9);
  // Two micro-batches move twice the bytes; without offload nothing moves.
  c.grad_accum = 2;
  auto two = predict_step(c, s, r);
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(two->d2h_bytes, 6 * act);
  s.offload_activations = false;
  auto none = predict_step(c, s, r);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->d2h_bytes + none->h2d_bytes, 0u);
  EXPECT_NEAR(none->step_seconds, 2 * 21 + 0.5, 1e-9);
}

// Data parallel (docs/offload.md "Predicting the step", the data-parallel term). Each module's
// collective buffers: a reduce-scatter's input and an all-gather's output are N chunks of
// ceil(n / N) elements rounded up to 64 (4 bytes per gradient element, the working dtype's size
// per parameter element).
std::uint64_t dp_chunk(std::uint64_t n, int ranks) {
  const std::uint64_t c = (n + static_cast<std::uint64_t>(ranks) - 1) / static_cast<std::uint64_t>(ranks);
  return (c + 63) / 64 * 64;
}

TEST(CostModel, DataParallelStage0AllReducesTheWholeGradientAfterBackward) {
  // The cuda backend. Four ranks: a ring all-reduce sends 2 * 3/4 of the buffer; at a bus
  // bandwidth of 1.5 * G bytes/s that is 1 s, plus 0.25 s of fixed cost, between backward and the
  // update.
  TrainerConfig c = tiny();
  c.grad_accum = 2;
  const Units u = units_of(c);
  const std::uint64_t G = 4 * std::accumulate(u.elements.begin(), u.elements.end(), 0ull);
  MachineRates r = rates();
  r.cuda = true;
  r.dp_bus_bytes_per_s = 1.5 * static_cast<double>(G);
  r.dp_collective_seconds = 0.25;
  OffloadSettings s;
  s.dp_size = 4;
  s.reduce_bucket_elements = static_cast<std::int64_t>(u.elements[3]);  // buckets on cpu, not on cuda
  auto p = predict_step(c, s, r);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_NEAR(p->step_seconds, 2 * kCompute + 1.25 + 0.5, 1e-9);
  EXPECT_NEAR(p->dp, 1.25, 1e-9);
  EXPECT_EQ(p->dp_bytes, G);
  auto t = dp_traffic(c, s, /*cuda=*/true);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ(t->all_reduce_bytes, G);
  EXPECT_EQ(t->buffer_bytes(), G);
  EXPECT_EQ(t->collectives, 1u);
  EXPECT_FALSE(t->overlapped);
  EXPECT_DOUBLE_EQ(t->wire_bytes(), 1.5 * static_cast<double>(G));
  EXPECT_NEAR(t->seconds(r.dp_bus_bytes_per_s, r.dp_collective_seconds), 1.25, 1e-12);
  // One rank: no term at all, and the bandwidth is not needed.
  s.dp_size = 1;
  r.dp_bus_bytes_per_s = 0;
  p = predict_step(c, s, r);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_DOUBLE_EQ(p->step_seconds, 2 * kCompute + 0.5);
  EXPECT_EQ(p->dp_bytes, 0u);
}

// The cpu backend's stage 0 (dp_stage0_bucketed): two ranks, two micro-batches, buckets {h.1 +
// head}, {h.0}, {embedding} (the head reads wte, so the embedding's gradients are final only after
// module 0's backward). Each bucket is all-reduced in place when the last micro-batch's backward
// leaves it: at 20 s and 22 s, under the backward still to run, and the embedding's at 24 s,
// exposed before the update. Without overlap_comm compute waits for each at once, which is the
// cuda backend's one all-reduce after backward.
TEST(CostModel, DataParallelStage0OnTheCpuBackendAllReducesEachBucketBesideBackward) {
  TrainerConfig c = tiny();
  c.grad_accum = 2;
  const Units u = units_of(c);
  const std::uint64_t X = 4 * (u.elements[3] + u.elements[2]), Y = 4 * u.elements[1], Z = 4 * u.elements[0];
  MachineRates r = rates();
  r.dp_bus_bytes_per_s = static_cast<double>(X + Y + Z) / 1.5;  // two ranks: factor 2 * 1/2; 1.5 s in all
  auto sec = [&](std::uint64_t b) { return static_cast<double>(b) / r.dp_bus_bytes_per_s; };
  ASSERT_LT(sec(X), 2.0);  // each hidden under one module's backward
  ASSERT_LT(sec(Y), 2.0);
  OffloadSettings s;
  s.dp_size = 2;
  s.zero_stage = 0;
  s.overlap_comm = true;
  s.reduce_bucket_elements = static_cast<std::int64_t>(u.elements[3] + u.elements[2]);
  {
    auto layout = describe_model(c.model);
    ASSERT_TRUE(layout.ok());
    const auto g = offload_detail::grad_buckets(offload_detail::describe_units(*layout, s), s);
    ASSERT_EQ(g.units, (std::vector<std::vector<int>>{{3, 2}, {1}, {0}}));
  }
  auto p = predict_step(c, s, r);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_NEAR(p->step_seconds, 2 * kCompute + sec(Z) + 0.5, 1e-9);
  EXPECT_NEAR(p->dp_stall, sec(Z), 1e-9);
  EXPECT_NEAR(p->dp, 1.5, 1e-9);
  EXPECT_EQ(p->dp_bytes, X + Y + Z);  // once per step: earlier micro-batches only add
  auto t = dp_traffic(c, s);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ(t->all_reduce_bytes, X + Y + Z);
  EXPECT_EQ(t->collectives, 3u);
  EXPECT_TRUE(t->overlapped);
  EXPECT_NEAR(t->seconds(r.dp_bus_bytes_per_s, 0.0), 1.5, 1e-12);
  // Without overlap_comm: every bucket waited at once, as long as cuda's one all-reduce.
  s.overlap_comm = false;
  auto waited = predict_step(c, s, r);
  ASSERT_TRUE(waited.ok()) << waited.status().to_string();
  EXPECT_NEAR(waited->step_seconds, 2 * kCompute + 1.5 + 0.5, 1e-9);
  EXPECT_NEAR(waited->dp_stall, 1.5, 1e-9);
  s.overlap_comm = true;
  r.cuda = true;
  auto cuda = predict_step(c, s, r);
  ASSERT_TRUE(cuda.ok()) << cuda.status().to_string();
  EXPECT_NEAR(cuda->step_seconds, waited->step_seconds, 1e-9);
  EXPECT_EQ(cuda->dp_bytes, p->dp_bytes);
  auto one = dp_traffic(c, s, /*cuda=*/true);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->collectives, 1u);
  EXPECT_FALSE(one->overlapped);
}

TEST(CostModel, DataParallelStage1HidesTheCollectivesButTheFirstAndLastModules) {
  // Two ranks, host optimizer, clipping on. The gradient stream reduce-scatters each bucket after
  // its copy out, beside the rest of backward; the optimizer thread all-gathers each module after
  // its update, beside the next forward. With every collective at most 0.5 s (under a module's
  // compute), only the embedding's are exposed: its reduce-scatter after the last backward, its
  // gather before the next step's first forward.
  const TrainerConfig c = tiny();
  const Units u = units_of(c);
  std::uint64_t biggest = 0, all_buffers = 0;
  for (std::uint64_t n : u.elements) {
    biggest = std::max(biggest, 4 * 2 * dp_chunk(n, 2));
    all_buffers += 2 * (4 * 2 * dp_chunk(n, 2));  // reduce-scatter + all-gather (fp32)
  }
  MachineRates r = rates();
  r.dp_bus_bytes_per_s = static_cast<double>(biggest) * 0.5 / 0.5;  // the biggest: 0.5 s
  OffloadSettings s;
  s.optimizer = Tier::kHost;
  s.dp_size = 2;
  s.zero_stage = 1;
  auto p = predict_step(c, s, r);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  const double one0 = static_cast<double>(4 * 2 * dp_chunk(u.elements[0], 2)) * 0.5 / r.dp_bus_bytes_per_s;
  EXPECT_NEAR(p->step_seconds, kCompute + 2 * one0, 1e-9);
  EXPECT_NEAR(p->fetch_stall, one0, 1e-9);  // the first forward waits for the embedding's gather
  EXPECT_NEAR(p->dp, static_cast<double>(all_buffers) * 0.5 / r.dp_bus_bytes_per_s, 1e-9);
  EXPECT_EQ(p->dp_bytes, all_buffers);
  auto t = dp_traffic(c, s);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ(t->buffer_bytes(), all_buffers);
  EXPECT_EQ(t->reduce_scatter_bytes, t->all_gather_bytes);
  EXPECT_EQ(t->collectives, 8u);
  EXPECT_TRUE(t->overlapped);
  // Stage 0 with the host optimizer runs as stage 1.
  s.zero_stage = 0;
  auto as1 = predict_step(c, s, r);
  ASSERT_TRUE(as1.ok());
  EXPECT_DOUBLE_EQ(as1->step_seconds, p->step_seconds);
  EXPECT_EQ(as1->dp_bytes, p->dp_bytes);
  // A link 10x slower: the reduce-scatters queue behind backward and the gathers behind each other.
  s.zero_stage = 1;
  r.dp_bus_bytes_per_s /= 10;
  auto slow = predict_step(c, s, r);
  ASSERT_TRUE(slow.ok());
  EXPECT_GT(slow->step_seconds, kCompute + 2 * 10 * one0);
  EXPECT_EQ(slow->dp_bytes, all_buffers);
}

TEST(CostModel, DataParallelStages2And3CommunicatePerMicroBatchAndPerFetch) {
  TrainerConfig c = tiny();
  c.grad_accum = 2;
  const Units u = units_of(c);
  std::vector<std::uint64_t> buf;  // per module: one reduce-scatter's input = one fp32 gather's output
  for (std::uint64_t n : u.elements) buf.push_back(4 * 3 * dp_chunk(n, 3));
  const std::uint64_t sum = std::accumulate(buf.begin(), buf.end(), 0ull);
  MachineRates r = rates();
  r.dp_bus_bytes_per_s = 1e12;
  OffloadSettings s;
  s.optimizer = Tier::kHost;
  s.dp_size = 3;
  s.zero_stage = 2;
  auto two = dp_traffic(c, s);
  ASSERT_TRUE(two.ok()) << two.status().to_string();
  EXPECT_EQ(two->reduce_scatter_bytes, 2 * sum);  // every micro-batch
  EXPECT_EQ(two->all_gather_bytes, sum);          // once, after the update
  s.zero_stage = 1;
  auto one = dp_traffic(c, s);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->reduce_scatter_bytes, sum);  // once, after the last micro-batch
  // Stage 3, every module offloaded, prefetch 1: in the first micro-batch the embedding is
  // fetched for its forward, the head's forward (its tied weights) and its backward, the blocks
  // forward and backward, the head once (kept from its forward to its backward); the second
  // micro-batch finds the embedding still held from the first's last access (the cyclic trace),
  // so it fetches it twice. No gather after the update.
  s.zero_stage = 3;
  s.params = Tier::kHost;
  s.prefetch_modules = 1;
  s.persistence_threshold = 0;
  auto three = dp_traffic(c, s);
  ASSERT_TRUE(three.ok()) << three.status().to_string();
  EXPECT_EQ(three->reduce_scatter_bytes, 2 * sum);
  EXPECT_EQ(three->all_gather_bytes, 5 * buf[0] + 4 * buf[1] + 4 * buf[2] + 2 * buf[3]);
  EXPECT_EQ(three->collectives, 2 * 4u + 15u);
  auto p = predict_step(c, s, r);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->dp_bytes, three->buffer_bytes());  // the replay issues exactly these
  // bf16 working weights: the gathers move 2 bytes per element, the reductions still 4.
  c.model.dtype = DType::kBF16;
  auto half = dp_traffic(c, s);
  ASSERT_TRUE(half.ok());
  EXPECT_EQ(half->all_gather_bytes * 2, three->all_gather_bytes);
  EXPECT_EQ(half->reduce_scatter_bytes, three->reduce_scatter_bytes);
}

// The optimizer on the device over 3 ranks (data parallelism alone): stage 2 reduce-scatters
// every bucket every micro-batch and all-gathers once after the update; stage 3 in device memory
// (docs/parallel.md "Stage 3 in device memory") moves exactly the host tier's stage-3 bytes: the
// same reduce-scatters and an all-gather per fetch of the same trace and slots, none after the
// update (measured equal on 2 ranks, docs/performance.md). Persistent modules are gathered after
// their update as at stage 2.
TEST(CostModel, DataParallelDeviceStage3GathersPerFetchAsTheHostTier) {
  TrainerConfig c = tiny();
  c.grad_accum = 2;
  const Units u = units_of(c);
  std::vector<std::uint64_t> buf;
  for (std::uint64_t n : u.elements) buf.push_back(4 * 3 * dp_chunk(n, 3));
  const std::uint64_t sum = std::accumulate(buf.begin(), buf.end(), 0ull);
  OffloadSettings s;
  s.optimizer = Tier::kDevice;
  s.dp_size = 3;
  s.zero_stage = 2;
  s.prefetch_modules = 1;
  s.persistence_threshold = 0;
  auto two = dp_traffic(c, s);
  ASSERT_TRUE(two.ok()) << two.status().to_string();
  EXPECT_EQ(two->reduce_scatter_bytes, 2 * sum);  // every micro-batch (the buckets)
  EXPECT_EQ(two->all_gather_bytes, sum);          // once, after the update
  s.zero_stage = 3;
  auto dev3 = dp_traffic(c, s);
  ASSERT_TRUE(dev3.ok()) << dev3.status().to_string();
  OffloadSettings host = s;
  host.optimizer = Tier::kHost;
  host.params = Tier::kHost;
  auto host3 = dp_traffic(c, host);
  ASSERT_TRUE(host3.ok()) << host3.status().to_string();
  EXPECT_EQ(dev3->reduce_scatter_bytes, host3->reduce_scatter_bytes);
  EXPECT_EQ(dev3->all_gather_bytes, host3->all_gather_bytes);
  EXPECT_EQ(dev3->all_gather_bytes, 5 * buf[0] + 4 * buf[1] + 4 * buf[2] + 2 * buf[3]);
  EXPECT_EQ(dev3->collectives, host3->collectives);
  // Every module persistent: stage 3 keeps the parameters whole and moves stage 2's bytes.
  s.persistence_threshold = 1'000'000'000;
  auto whole = dp_traffic(c, s);
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(whole->all_gather_bytes, two->all_gather_bytes);
  EXPECT_EQ(whole->reduce_scatter_bytes, two->reduce_scatter_bytes);
}

TEST(CostModel, DataParallelDeviceShardedStagesRunSeriallyAfterBackward) {
  // Optimizer on the device at stage 1 over 2 ranks: after backward, per module a reduce-scatter
  // and an all-gather, nothing overlapped; the device update covers this rank's slices.
  const TrainerConfig c = tiny();
  const Units u = units_of(c);
  std::uint64_t buffers = 0, n_all = 0, n_mine = 0;
  for (std::uint64_t n : u.elements) {
    buffers += 2 * (4 * 2 * dp_chunk(n, 2));
    n_all += n;
    n_mine += std::min(n, dp_chunk(n, 2));  // rank 0's slice
  }
  MachineRates r = rates();
  r.dp_bus_bytes_per_s = static_cast<double>(buffers) * 0.5;  // 1 s in all at (N-1)/N = 1/2
  OffloadSettings s;
  s.dp_size = 2;
  s.zero_stage = 1;
  auto p = predict_step(c, s, r);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  const double update = 0.5 * static_cast<double>(n_mine) / static_cast<double>(n_all);
  EXPECT_NEAR(p->step_seconds, kCompute + 1.0 + update, 1e-9);
  EXPECT_EQ(p->dp_bytes, buffers);
  auto t = dp_traffic(c, s);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->buffer_bytes(), buffers);
  EXPECT_FALSE(t->overlapped);
}

// The device optimizer's stage 2 over 2 ranks (docs/parallel.md "Gradient buckets"): with
// reduce_bucket_size = the head's and h.1's elements the buckets (grad_buckets, the engine's) are
// X = {head, h.1} (open from the head's backward through h.1's), Y = {h.0} and Z = {embedding}
// (the head reads the tied wte, so Z is open from the head's backward through the embedding's).
// With overlap_comm a bucket's reduce-scatters start on the bucket comm when backward leaves its
// last module: X's after h.1, beside h.0's backward (hidden: h.0 opens its bucket in the buffer
// released longest ago, one not used yet this step, not X's, just released); Y's beside the
// embedding's backward (hidden: under its 2 s); Z's after the last module (exposed, the drain
// before the update). The update all-gathers
// every module (exposed). Stage 1 exposes every collective after backward; stage 2 without
// overlap_comm waits for each bucket at once, so it exposes as much as stage 1.
TEST(CostModel, DataParallelDeviceStage2ReducesBucketsBesideBackward) {
  TrainerConfig c = tiny();
  const Units u = units_of(c);
  auto rs = [&](int m) { return 4 * 2 * dp_chunk(u.elements[static_cast<std::size_t>(m)], 2); };
  const std::uint64_t X = rs(3) + rs(2), Y = rs(1), Z = rs(0), AG = X + Y + Z;  // fp32: gathers as big
  MachineRates r = rates();
  r.dp_bus_bytes_per_s = static_cast<double>(X + Y + Z + AG) * 0.5;  // every collective: 1 s in all
  auto sec = [&](std::uint64_t b) { return static_cast<double>(b) * 0.5 / r.dp_bus_bytes_per_s; };
  std::uint64_t n_all = 0, n_mine = 0;
  for (std::uint64_t n : u.elements) {
    n_all += n;
    n_mine += std::min(n, dp_chunk(n, 2));
  }
  const double update = 0.5 * static_cast<double>(n_mine) / static_cast<double>(n_all);
  OffloadSettings s;
  s.dp_size = 2;
  s.zero_stage = 2;
  s.reduce_bucket_elements = static_cast<std::int64_t>(u.elements[3] + u.elements[2]);
  s.overlap_comm = true;
  {
    auto layout = describe_model(c.model);
    ASSERT_TRUE(layout.ok());
    const auto g = offload_detail::grad_buckets(offload_detail::describe_units(*layout, s), s);
    ASSERT_EQ(g.units, (std::vector<std::vector<int>>{{3, 2}, {1}, {0}}));
    ASSERT_EQ(offload_detail::grad_bucket_slots(g, s), 3u);  // 2 open at once + 1 in flight
  }
  auto two = predict_step(c, s, r);
  ASSERT_TRUE(two.ok()) << two.status().to_string();
  EXPECT_NEAR(two->step_seconds, kCompute + sec(Z) + sec(AG) + update, 1e-9);
  EXPECT_NEAR(two->dp_stall, sec(Z) + sec(AG), 1e-9);
  EXPECT_NEAR(two->dp, 1.0, 1e-9);
  EXPECT_EQ(two->dp_bytes, X + Y + Z + AG);
  auto t = dp_traffic(c, s);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ(two->dp_bytes, t->buffer_bytes());
  s.zero_stage = 1;
  auto one = predict_step(c, s, r);
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  EXPECT_NEAR(one->step_seconds, kCompute + 1.0 + update, 1e-9);
  EXPECT_NEAR(one->dp_stall, 1.0, 1e-9);
  EXPECT_EQ(one->dp_bytes, two->dp_bytes);  // one micro-batch: the same collectives
  EXPECT_NEAR(one->dp_stall - two->dp_stall, sec(X) + sec(Y), 1e-9) << "stage 2 hides X's and Y's reduce-scatters";
  EXPECT_LT(two->step_seconds, one->step_seconds);
  s.zero_stage = 2;
  s.overlap_comm = false;
  auto waited = predict_step(c, s, r);
  ASSERT_TRUE(waited.ok()) << waited.status().to_string();
  EXPECT_NEAR(waited->step_seconds, one->step_seconds, 1e-9);
  EXPECT_NEAR(waited->dp_stall, one->dp_stall, 1e-9);
  // Accumulation 2: stage 2 reduce-scatters every micro-batch (X, Y of both hidden under backward,
  // the first Z under the second's forward), stage 1 the local sum once.
  c.grad_accum = 2;
  s.overlap_comm = true;
  auto acc2 = predict_step(c, s, r);
  ASSERT_TRUE(acc2.ok()) << acc2.status().to_string();
  EXPECT_EQ(acc2->dp_bytes, 2 * (X + Y + Z) + AG);
  EXPECT_NEAR(acc2->step_seconds, 2 * kCompute + sec(Z) + sec(AG) + update, 1e-9);
  s.zero_stage = 1;
  auto acc1 = predict_step(c, s, r);
  ASSERT_TRUE(acc1.ok());
  EXPECT_EQ(acc1->dp_bytes, X + Y + Z + AG);
  EXPECT_NEAR(acc1->step_seconds, 2 * kCompute + 1.0 + update, 1e-9);
}

// Stage 3 in device memory over 2 ranks, every module sliced (persistence threshold 0), 2
// micro-batches, prefetch 1, one gradient bucket: each fetch of a sliced module all-gathers its
// slices and copies the whole module into a slot on the h2d stream (the fetches of the slot rule:
// the embedding 5 times, each block 4, the head 2), issued one access ahead, so only the step's
// first fetch is exposed; the update gathers nothing. Against stage 2 on the same rates: the same
// reduce-scatters at the same times, no update all-gathers, the first gather exposed instead.
// Fetching on demand (prefetch 0) exposes every gather.
TEST(CostModel, DataParallelDeviceStage3GathersSlicedModulesAheadOfUse) {
  TrainerConfig c = tiny();
  c.grad_accum = 2;
  const Units u = units_of(c);
  auto buf = [&](int m) { return 4 * 2 * dp_chunk(u.elements[static_cast<std::size_t>(m)], 2); };
  const std::uint64_t RS = buf(0) + buf(1) + buf(2) + buf(3);
  const std::uint64_t gathers = 5 * buf(0) + 4 * buf(1) + 4 * buf(2) + 2 * buf(3);
  const std::uint64_t copies =
      5 * u.param_bytes[0] + 4 * u.param_bytes[1] + 4 * u.param_bytes[2] + 2 * u.param_bytes[3];
  MachineRates r = rates();
  r.dp_bus_bytes_per_s = static_cast<double>(buf(1)) * 0.5 / 0.25;  // a block's gather: 0.25 s
  auto sec = [&](std::uint64_t b) { return static_cast<double>(b) * 0.5 / r.dp_bus_bytes_per_s; };
  OffloadSettings s;
  s.dp_size = 2;
  s.zero_stage = 2;
  s.persistence_threshold = 0;
  s.prefetch_modules = 1;
  s.overlap_comm = true;
  auto two = predict_step(c, s, r);
  ASSERT_TRUE(two.ok()) << two.status().to_string();
  EXPECT_EQ(two->dp_bytes, 2 * RS + RS);  // every micro-batch; one all-gather per module after the update
  EXPECT_EQ(two->h2d_bytes, 0u);
  s.zero_stage = 3;
  auto three = predict_step(c, s, r);
  ASSERT_TRUE(three.ok()) << three.status().to_string();
  EXPECT_EQ(three->dp_bytes, 2 * RS + gathers);
  EXPECT_EQ(three->h2d_bytes, copies);
  auto t = dp_traffic(c, s);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ(three->dp_bytes, t->buffer_bytes());
  EXPECT_EQ(t->all_gather_bytes, gathers);
  EXPECT_NEAR(three->fetch_stall, sec(buf(0)), 1e-9) << "only the first fetch is exposed";
  EXPECT_NEAR(three->step_seconds, two->step_seconds - sec(RS) + sec(buf(0)), 1e-9);
  EXPECT_NEAR(three->dp, two->dp - sec(RS) + sec(gathers), 1e-9);
  // On demand: every fetch waited for by compute.
  s.prefetch_modules = 0;
  auto demand = predict_step(c, s, r);
  ASSERT_TRUE(demand.ok()) << demand.status().to_string();
  EXPECT_EQ(demand->dp_bytes, dp_traffic(c, s)->buffer_bytes());
  const std::uint64_t demand_gathers = demand->dp_bytes - 2 * RS;
  EXPECT_GE(demand_gathers, gathers);
  EXPECT_NEAR(demand->fetch_stall, sec(demand_gathers), 1e-9);
  EXPECT_GT(demand->step_seconds, three->step_seconds);
}

TEST(CostModel, BadRatesNameTheRate) {
  const TrainerConfig c = tiny();
  MachineRates r = rates();
  r.h2d_bytes_per_s = 0;
  auto p = predict_step(c, OffloadSettings{}, r);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("h2d_bytes_per_s"), std::string::npos) << p.status().message();
  r = rates();
  r.forward_seconds.pop_back();
  p = predict_step(c, OffloadSettings{}, r);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("one entry per module (4)"), std::string::npos) << p.status().message();
  r = rates();
  OffloadSettings s;
  s.dp_size = 2;
  p = predict_step(c, s, r);  // no link given
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("dp_bus_bytes_per_s = 0 must be > 0 with 2 data-parallel ranks"),
            std::string::npos)
      << p.status().message();
  r.dp_collective_seconds = -1;
  p = predict_step(c, OffloadSettings{}, r);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("dp_collective_seconds"), std::string::npos) << p.status().message();
  r = rates();
  s = OffloadSettings{};
  s.tp_size = 2;
  p = predict_step(c, s, r);  // no tensor-parallel link given
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("tp_bus_bytes_per_s = 0 must be > 0 with tensor_parallel_size = 2"),
            std::string::npos)
      << p.status().message();
  s = OffloadSettings{};
  s.pipeline_bounds = {0, 2, 4};
  p = predict_step(c, s, r);  // no pipeline link given
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("pp_link_bytes_per_s = 0 must be > 0 with a pipeline"),
            std::string::npos)
      << p.status().message();
  r.pp_message_seconds = -1;
  p = predict_step(c, OffloadSettings{}, r);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("pp_message_seconds"), std::string::npos) << p.status().message();
}

// ---- tensor parallel ----------------------------------------------------------------------------
// tiny() on tp 2, everything on the device, one micro-batch: N = 2 * 16 = 32 tokens, C = 64, fp32,
// so one residual-stream tensor is 32 * 64 * 4 = 8192 bytes. Compute: a block's matrices and heads
// are split in two (exactly half its FLOPs), the head's vocabulary rows too (256 -> 128: half), the
// embedding's gather is every token's on every rank (unchanged): forward 1 + 3 * 0.5, backward 2 +
// 3 * 1. The device update: this rank's share of the elements.
double tp_update_share(const TrainerConfig& c) {
  auto whole = describe_model(c.model);
  auto shard = describe_model(c.model, TensorParallel{2, 0});
  EXPECT_TRUE(whole.ok() && shard.ok());
  auto elements = [](const ModelLayout& l) {
    double n = 0;
    for (const ModuleDesc& m : l.modules) n += static_cast<double>((m.grad_end - m.grad_begin) / 4);
    return n;
  };
  return elements(*shard) / elements(*whole);
}

MachineRates tp_rates() {
  MachineRates r = rates();
  r.tp_bus_bytes_per_s = 1e6;
  r.tp_collective_seconds = 0.01;
  return r;
}

TEST(CostModel, TensorParallelScalesComputeToTheShardAndChargesEachModulesAllReduces) {
  TrainerConfig c = tiny();
  OffloadSettings s;
  s.tp_size = 2;
  auto p = predict_step(c, s, tp_rates());
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  constexpr std::uint64_t kRows = 8192;
  // Embedding forward 1 all-reduce; each block 2 forward (attention and MLP projections) and 2
  // backward (c_fc and qkv input gradients); the head's forward the row maxima (N fp32) and exp
  // sums (2N fp32), its backward the final norm's input gradient.
  const std::uint64_t bytes = kRows * (1 + 2 * 4 + 1) + 32 * 4 + 2 * 32 * 4;
  EXPECT_EQ(p->tp_bytes, bytes);
  EXPECT_EQ(p->tp_collectives, 12u);
  // An all-reduce moves 2(t-1)/t = 1 times its buffer over the bus.
  const double tp = 12 * 0.01 + static_cast<double>(bytes) / 1e6;
  EXPECT_NEAR(p->tp, tp, 1e-12);
  EXPECT_NEAR(p->compute, 2.5 + 5.0 + 0.5 * tp_update_share(c), 1e-12);
  EXPECT_NEAR(p->step_seconds, 2.5 + 5.0 + tp + 0.5 * tp_update_share(c), 1e-12);

  // Activation checkpointing: h.0 is recomputed before its backward (its attention all-reduce
  // again); h.1, the last block, is still in the shared set from the forward.
  c.model.activation_checkpointing = true;
  auto ck = predict_step(c, s, tp_rates());
  ASSERT_TRUE(ck.ok()) << ck.status().to_string();
  EXPECT_EQ(ck->tp_bytes, bytes + kRows);
  EXPECT_EQ(ck->tp_collectives, 13u);
  EXPECT_NEAR(ck->step_seconds - p->step_seconds, 0.01 + kRows / 1e6, 1e-12);

  // Two micro-batches: twice the collectives.
  c.model.activation_checkpointing = false;
  c.grad_accum = 2;
  auto two = predict_step(c, s, tp_rates());
  ASSERT_TRUE(two.ok()) << two.status().to_string();
  EXPECT_EQ(two->tp_bytes, 2 * bytes);
  EXPECT_NEAR(two->step_seconds, 2 * (7.5 + tp) + 0.5 * tp_update_share(c), 1e-12);
}

TEST(CostModel, SequenceParallelGathersAndScattersInsteadOfAllReducing) {
  TrainerConfig c = tiny();
  OffloadSettings s;
  s.tp_size = 2;
  s.sequence_parallel = true;
  auto p = predict_step(c, s, tp_rates());
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  constexpr std::uint64_t kRows = 8192;  // an all-gather's output, a reduce-scatter's input
  // Residual-stream tensors: embedding 2 (reduce-scatter forward, all-gather backward), each block
  // 4 forward and 6 backward, the head 1 forward and 2 backward: 25. All-reduces: each block's norm
  // gradients (4C fp32), the head's row maxima and exp sums (N, 2N fp32) and its final norm's
  // gradients (2C fp32, GPT-2).
  const std::uint64_t gathered = 25 * kRows;
  const std::uint64_t reduced = 2 * 4 * 64 * 4 + 32 * 4 + 2 * 32 * 4 + 2 * 64 * 4;
  EXPECT_EQ(p->tp_bytes, gathered + reduced);
  EXPECT_EQ(p->tp_collectives, 2u + 2 * 11 + 3 + 3);
  // A reduce-scatter's input and an all-gather's output cross the bus (t-1)/t = 1/2 times.
  const double tp = 30 * 0.01 + (0.5 * static_cast<double>(gathered) + static_cast<double>(reduced)) / 1e6;
  EXPECT_NEAR(p->tp, tp, 1e-12);
  EXPECT_NEAR(p->step_seconds, 7.5 + tp + 0.5 * tp_update_share(c), 1e-12);
}

// ---- pipelines ----------------------------------------------------------------------------------
// tiny() cut into two equal stages (embedding + h.0, h.1 + head): each stage's forward of a
// micro-batch takes f = 1 and its backward b = 2, everything on the device, no update.
MachineRates pp_rates(double message) {
  MachineRates r = rates();
  r.forward_seconds = {0.5, 0.5, 0.5, 0.5};
  r.backward_seconds = {1, 1, 1, 1};
  r.device_update_seconds = 0;
  r.pp_link_bytes_per_s = 1e18;
  r.pp_message_seconds = message;
  return r;
}

OffloadSettings two_stages(PipelineSchedule schedule, int stage) {
  OffloadSettings s;
  s.pipeline_bounds = {0, 2, 4};
  s.pipeline_schedule = schedule;
  s.pp_stage = stage;
  return s;
}

TEST(CostModel, PipelineOfEqualStagesTakesTheScheduleWithItsBubble) {
  TrainerConfig c = tiny();
  c.grad_accum = 4;  // m = 4 micro-batches over p = 2 stages
  for (PipelineSchedule schedule : {PipelineSchedule::kOneFOneB, PipelineSchedule::kGpipe}) {
    const std::string what(to_string(schedule));
    for (int stage : {0, 1}) {
      auto p = predict_step(c, two_stages(schedule, stage), pp_rates(0));
      ASSERT_TRUE(p.ok()) << what << ": " << p.status().to_string();
      // Free sends: (m + p - 1) (f + b) = 5 * 3, each stage idle (p - 1)(f + b) of it, the bubble
      // fraction (p - 1) / (m + p - 1) = 1/5.
      EXPECT_NEAR(p->step_seconds, 15, 1e-12) << what;
      EXPECT_NEAR(p->pp_schedule, 15, 1e-12) << what;
      EXPECT_NEAR(p->pp_bubble / p->pp_schedule, 1.0 / 5, 1e-12) << what;
      EXPECT_NEAR(p->compute, 4 * 3, 1e-12) << what << ": the stage's own compute";
      // Stage 0 sends each micro-batch's activations, stage 1 its activation gradients: 2 * 16 *
      // 64 fp32 each.
      EXPECT_EQ(p->pp_bytes, 4u * 8192) << what;
      EXPECT_EQ(p->pp_stage, stage);
    }
  }
  // Sends of 0.5 s each, 1F1B, worked out by hand (stage: [start, end] of each op; a send arrives
  // 0.5 after its op ends, or after the stage's previous send in that direction):
  //   stage 0  F0 [0,1] F1 [1,2] B0 [5,7] F2 [7,8] B1 [8,10] F3 [10,11] B2 [12,14] B3 [15,17]
  //   stage 1  F0 [1.5,2.5] B0 [2.5,4.5] F1 [4.5,5.5] B1 [5.5,7.5] F2 [8.5,9.5] B2 [9.5,11.5]
  //            F3 [11.5,12.5] B3 [12.5,14.5]
  for (int stage : {0, 1}) {
    auto p = predict_step(c, two_stages(PipelineSchedule::kOneFOneB, stage), pp_rates(0.5));
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    EXPECT_NEAR(p->step_seconds, 17, 1e-12);
    EXPECT_NEAR(p->pp_bubble, 17 - 12, 1e-12);
    EXPECT_NEAR(p->pp, 4 * 0.5, 1e-12);
  }
  // The device update after the schedule: the stage's share of it (its units' elements), the
  // larger stage's counting.
  MachineRates r = pp_rates(0);
  r.device_update_seconds = 1;
  auto p = predict_step(c, two_stages(PipelineSchedule::kOneFOneB, 0), r);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  auto layout = describe_model(c.model);
  ASSERT_TRUE(layout.ok());
  double largest = 0;
  for (int stage : {0, 1}) {
    const offload_detail::Units u =
        offload_detail::describe_units(*layout, two_stages(PipelineSchedule::kOneFOneB, stage));
    double n = 0, all = 0;
    for (std::uint64_t g : u.gbytes) n += static_cast<double>(g / 4);
    for (const ModuleDesc& m : layout->modules) all += static_cast<double>((m.grad_end - m.grad_begin) / 4);
    largest = std::max(largest, n / all);
  }
  EXPECT_NEAR(p->step_seconds, 15 + largest, 1e-12);
}

TEST(CostModel, InterleavedPipelineShrinksTheBubbleByTheChunks) {
  TrainerConfig c = tiny();
  c.grad_accum = 4;
  OffloadSettings s;
  s.pipeline_bounds = {0, 1, 2, 3, 4};  // v = 2 chunks of one module on each of p = 2 stages
  s.pipeline_virtual_stages = 2;
  MachineRates r = pp_rates(0);
  for (int stage : {0, 1}) {
    s.pp_stage = stage;
    auto p = predict_step(c, s, r);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    // Each stage computes m * v * (0.5 + 1) = 12; interleaved_bubble_theory's (p - 1) / (v m + p - 1)
    // = 1/9 of the step is idle with equal chunks and free sends.
    EXPECT_NEAR(p->pp_schedule, 12 / (1 - interleaved_bubble_theory(2, 2, 4)), 1e-12);
    EXPECT_NEAR(p->pp_bubble / p->pp_schedule, interleaved_bubble_theory(2, 2, 4), 1e-12);
    // Every chunk boundary but the model's ends is a send: stage 0 sends its two chunks' forwards
    // and its second chunk's backwards, stage 1 the mirror.
    EXPECT_EQ(p->pp_bytes, 3u * 4 * 8192);
  }
}

}  // namespace
}  // namespace strata::testing
