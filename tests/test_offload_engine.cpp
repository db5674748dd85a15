// The offload engine: every placement trains to the same bits as the all-device placement (the
// resident trainer), the prefetcher recovers when the module order changes, and faults on the
// NVMe tier surface as errors naming what failed while the state stays usable.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <random>

#include "harness/harness.hpp"
#include "offload/internal.hpp"
#include "offload_fixture.hpp"
#include "strata/device.hpp"
#include "strata/engine.hpp"
#include "strata/model.hpp"
#include "strata/offload.hpp"

namespace strata::testing {
namespace {

struct MatrixCase {
  ModelKind kind;
  DType dtype;
  std::int64_t accum;
  double clip;
};

class OffloadEquivalence : public ::testing::TestWithParam<MatrixCase> {};

// Every placement after 3 steps: parameters, master weights, both moments, losses and norms
// equal the all-device run bit for bit.
TEST_P(OffloadEquivalence, EveryPlacementMatchesTheAllDeviceRunBitForBit) {
  const MatrixCase mc = GetParam();
  const TrainerConfig c = tiny(mc.kind, mc.dtype, mc.accum, mc.clip);
  TempDir dir("strata-offload");
  const Snapshot ref = train(c, OffloadSettings{}, 3);
  ASSERT_EQ(ref.losses.size(), 3u);
  EXPECT_LT(ref.losses.back(), ref.losses.front());
  for (const Placement& p : kPlacements) {
    const std::string what = std::string("params on ") + std::string(to_string(p.params)) + ", optimizer on " +
                             std::string(to_string(p.optimizer));
    const Snapshot got = train(c, settings_for(p, dir), 3);
    expect_same(ref, got, what);
    std::filesystem::remove_all(dir.path());
    std::filesystem::create_directories(dir.path());
  }
}

INSTANTIATE_TEST_SUITE_P(Matrix, OffloadEquivalence,
                         ::testing::Values(MatrixCase{ModelKind::kGpt2, DType::kF32, 1, 0.0},
                                           MatrixCase{ModelKind::kGpt2, DType::kBF16, 2, 1.0},
                                           MatrixCase{ModelKind::kLlama, DType::kBF16, 1, 0.5},
                                           MatrixCase{ModelKind::kLlama, DType::kF32, 2, 0.0},
                                           // fp16 with loss scaling; without clipping the host
                                           // tier may not update during backward (an overflow
                                           // anywhere skips the step)
                                           MatrixCase{ModelKind::kGpt2, DType::kF16, 2, 1.0},
                                           MatrixCase{ModelKind::kLlama, DType::kF16, 1, 0.0}));

// fp16 with a loss scale far too large: the first steps' gradients overflow. Each is skipped on
// every placement alike — parameters, masters and moments untouched, the scale halved — until the
// scale fits, and then training proceeds. A skipped step leaves no trace: the run equals a fresh
// run that starts at the first applied batch with the scale the skips arrived at (the Adam step
// and the warmup schedule did not advance, as DeepSpeed skips them).
TEST(OffloadEngine, Fp16OverflowIsSkippedIdenticallyOnEveryPlacement) {
  TrainerConfig c = tiny(ModelKind::kGpt2, DType::kF16, 1, 1.0);
  c.loss_scaling.initial_scale_power = 24;
  c.loss_scaling.loss_scale_window = 1000;
  c.schedule.kind = LrScheduleKind::kWarmupLR;
  c.schedule.warmup_steps = 4;
  c.schedule.warmup_min_lr = 1e-3;
  c.schedule.warmup_max_lr = 1e-2;
  TempDir dir("strata-offload");

  Snapshot ref, initial;
  int overflowed = 0, steps = 0;
  {
    auto device = make_device();
    auto engine = OffloadEngine::create(c, OffloadSettings{}, *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    ASSERT_TRUE(capture_state(**engine, initial));
    // Until three updates have applied after the skips.
    for (int applied = 0; applied < 3 && steps < 24; ++steps) {
      ASSERT_TRUE(run_steps(**engine, c, steps, steps + 1, ref));
      if (ref.skipped.back() == 0) {
        ++applied;
        continue;
      }
      ASSERT_EQ(applied, 0) << "step " << steps + 1 << " overflowed after the scale had come down";
      ++overflowed;
      EXPECT_FALSE(std::isfinite(ref.norms.back()));
      EXPECT_EQ(ref.scales.back(), std::ldexp(1.0, 24 - steps));
      Snapshot now;
      ASSERT_TRUE(capture_state(**engine, now));
      for (std::size_t i = 0; i < now.param.size(); ++i) {
        EXPECT_TRUE(bitwise_equal(now.param[i], initial.param[i])) << "parameter " << i << " after a skip";
        EXPECT_TRUE(bitwise_equal(now.master[i], initial.master[i])) << "master " << i << " after a skip";
        EXPECT_TRUE(bitwise_equal(now.m[i], initial.m[i])) << "exp_avg " << i << " after a skip";
        EXPECT_TRUE(bitwise_equal(now.v[i], initial.v[i])) << "exp_avg_sq " << i << " after a skip";
      }
    }
    ASSERT_GE(overflowed, 1);
    ASSERT_EQ(steps - overflowed, 3) << "the scale never came down far enough";
    ASSERT_TRUE(capture_state(**engine, ref));
    EXPECT_EQ((*engine)->steps_done(), steps);
  }
  for (const Placement& p : kPlacements) {
    const std::string what = std::string("params on ") + std::string(to_string(p.params)) + ", optimizer on " +
                             std::string(to_string(p.optimizer));
    const Snapshot got = train(c, settings_for(p, dir), steps);
    expect_same(ref, got, what);
    std::filesystem::remove_all(dir.path());
    std::filesystem::create_directories(dir.path());
  }
  // The same updates from a fresh engine that starts where the skips ended.
  TrainerConfig late = c;
  late.loss_scaling.initial_scale_power = 24 - overflowed;
  Snapshot fresh;
  {
    auto device = make_device();
    auto engine = OffloadEngine::create(late, OffloadSettings{}, *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    ASSERT_TRUE(run_steps(**engine, late, overflowed, steps, fresh));
    ASSERT_TRUE(capture_state(**engine, fresh));
  }
  for (std::size_t i = 0; i < fresh.losses.size(); ++i) {
    EXPECT_EQ(fresh.losses[i], ref.losses[static_cast<std::size_t>(overflowed) + i]) << "applied step " << i + 1;
    EXPECT_EQ(fresh.skipped[i], 0);
  }
  for (std::size_t i = 0; i < ref.param.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(fresh.param[i], ref.param[i])) << "working parameter " << i;
    EXPECT_TRUE(bitwise_equal(fresh.master[i], ref.master[i])) << "master " << i;
    EXPECT_TRUE(bitwise_equal(fresh.m[i], ref.m[i])) << "exp_avg " << i;
    EXPECT_TRUE(bitwise_equal(fresh.v[i], ref.v[i])) << "exp_avg_sq " << i;
  }
}

// An overflow with the scale already at fp16.min_loss_scale fails the step naming the key (as
// DeepSpeed raises), and the state stays as it was.
TEST(OffloadEngine, Fp16OverflowAtTheMinimumScaleFailsNamingTheKey) {
  TrainerConfig c = tiny(ModelKind::kGpt2, DType::kF16, 1, 1.0);
  c.loss_scaling.initial_scale_power = 24;
  c.loss_scaling.min_loss_scale = std::ldexp(1.0, 23);
  auto device = make_device();
  auto engine = OffloadEngine::create(c, OffloadSettings{}, *device);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  Snapshot before, after, log;
  ASSERT_TRUE(capture_state(**engine, before));
  std::vector<std::int32_t> in, tg;
  batch(c, 0, in, tg);
  auto m1 = (*engine)->step(in, tg);
  ASSERT_TRUE(m1.ok()) << m1.status().to_string();
  EXPECT_TRUE(m1->skipped);
  auto m2 = (*engine)->step(in, tg);
  ASSERT_FALSE(m2.ok());
  EXPECT_NE(m2.status().message().find("fp16.min_loss_scale"), std::string::npos) << m2.status().to_string();
  ASSERT_TRUE(capture_state(**engine, after));
  for (std::size_t i = 0; i < before.param.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(before.param[i], after.param[i])) << "parameter " << i;
    EXPECT_TRUE(bitwise_equal(before.master[i], after.master[i])) << "master " << i;
  }
}

// The NVMe optimizer in sub-groups smaller than a module and than its larger parameters (awkward
// sizes 40961 and 4097; a parameter is split at multiples of 64 of its elements) gives the bits of
// the unsplit update, and its pinned ring shrinks with the sub-group; gradients waiting on NVMe
// (written and restored between micro-batches, read with each sub-group) give the same bits too.
TEST(OffloadEngine, NvmeOptimizerSubGroupsGiveTheSameBits) {
  const TrainerConfig c = tiny(ModelKind::kLlama, DType::kBF16, 2, 1.0);
  TempDir dir("strata-offload");
  const Snapshot ref = train(c, OffloadSettings{}, 3);
  ASSERT_EQ(ref.losses.size(), 3u);
  std::uint64_t whole_ring = 0;
  for (std::int64_t sub_group : {std::int64_t{1'000'000'000}, std::int64_t{40961}, std::int64_t{4097}}) {
    for (Placement p : {Placement{Tier::kNvme, Tier::kNvme}, Placement{Tier::kDevice, Tier::kNvme}}) {
      OffloadSettings s = settings_for(p, dir);
      s.sub_group_size = sub_group;
      // Gradients wait on NVMe for the device-parameter case (restored between micro-batches).
      if (p.params == Tier::kDevice) s.gradients = Tier::kNvme;
      auto plan = OffloadPlan::make(c, s);
      ASSERT_TRUE(plan.ok()) << plan.status().to_string();
      std::uint64_t ring = 0;
      for (const PlanLine& l : plan->lines)
        if (l.what == "optimizer pipeline ring (pinned)") ring = l.bytes;
      if (sub_group == 1'000'000'000) whole_ring = ring;
      if (sub_group == 4097) {
        EXPECT_LT(ring * 4, whole_ring) << "the ring holds sub-groups, not modules";
      }
      const Snapshot got = train(c, s, 3);
      expect_same(ref, got, "sub_group_size " + std::to_string(sub_group) + ", params on " +
                                std::string(to_string(p.params)) + ", gradients on " +
                                std::string(to_string(s.gradients)));
      std::filesystem::remove_all(dir.path());
      std::filesystem::create_directories(dir.path());
    }
  }
  OffloadSettings bad = settings_for({Tier::kNvme, Tier::kNvme}, dir);
  bad.sub_group_size = 63;
  const Status s = bad.validate();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("zero_optimization.sub_group_size = 63"), std::string::npos) << s.message();
  OffloadSettings host_opt = settings_for({Tier::kNvme, Tier::kHost}, dir);
  host_opt.gradients = Tier::kNvme;
  const Status g = host_opt.validate();
  EXPECT_FALSE(g.ok());
  EXPECT_NE(g.message().find("gradients = nvme needs the optimizer state on NVMe"), std::string::npos) << g.message();
  // The plan moves the gradients from host memory to NVMe.
  OffloadSettings on_nvme = settings_for({Tier::kNvme, Tier::kNvme}, dir);
  auto host_plan = OffloadPlan::make(c, on_nvme);
  on_nvme.gradients = Tier::kNvme;
  auto nvme_plan = OffloadPlan::make(c, on_nvme);
  ASSERT_TRUE(host_plan.ok() && nvme_plan.ok());
  auto layout = describe_model(c.model);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(nvme_plan->nvme_bytes, host_plan->nvme_bytes + layout->grad_bytes);
  EXPECT_LT(nvme_plan->host_bytes + layout->grad_bytes / 2, host_plan->host_bytes);
}

// Scratch swap directories (OffloadSettings::nvme_scratch, strata train's default under $TMPDIR):
// while the engine runs with everything on NVMe its directory holds no swap data file (they were
// unlinked once open, so a killed run leaves none behind), and it trains bit for bit as the
// ordinary store does, whose directory keeps them.
TEST(OffloadEngine, ScratchSwapLeavesNoDataFilesAndTrainsTheSame) {
  const TrainerConfig c = tiny(ModelKind::kGpt2, DType::kBF16, 2, 1.0);
  Snapshot runs[2];
  for (bool scratch : {false, true}) {
    TempDir dir("strata-offload");
    OffloadSettings s = settings_for({Tier::kNvme, Tier::kNvme}, dir);
    s.gradients = Tier::kNvme;
    s.nvme_scratch = scratch;
    auto device = make_device();
    auto engine = OffloadEngine::create(c, s, *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    ASSERT_TRUE(run_steps(**engine, c, 0, 3, runs[scratch]));
    ASSERT_TRUE(capture_state(**engine, runs[scratch]));
    int data_files = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir.path()))
      data_files += e.path().extension() == ".data" ? 1 : 0;
    EXPECT_EQ(data_files, scratch ? 0 : 1) << (scratch ? "scratch" : "ordinary") << " swap directory";
  }
  expect_same(runs[0], runs[1], "scratch swap against the ordinary store");
}

// The resident trainer is the all-device placement of the same engine.
TEST(OffloadEngine, TheTrainerIsTheAllDevicePlacement) {
  const TrainerConfig c = tiny(ModelKind::kGpt2, DType::kBF16, 2, 1.0);
  const Snapshot ref = train(c, OffloadSettings{}, 2);
  auto device = make_device();
  auto trainer = Trainer::create(c, *device);
  ASSERT_TRUE(trainer.ok()) << trainer.status().to_string();
  std::vector<std::int32_t> in, tg;
  for (int i = 0; i < 2; ++i) {
    batch(c, i, in, tg);
    auto m = (*trainer)->step(in, tg);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    EXPECT_EQ(m->loss, ref.losses[static_cast<std::size_t>(i)]);
  }
  const ModelLayout& L = (*trainer)->model().layout();
  std::size_t k = 0;
  for (std::size_t i = 0; i < L.params.size(); ++i) {
    if (!L.params[i].owns_storage()) continue;
    auto p = (*trainer)->model().download_param(static_cast<int>(i));
    ASSERT_TRUE(p.ok());
    EXPECT_TRUE(bitwise_equal(*p, ref.param[k])) << L.params[i].name;
    ++k;
  }
}

// Prefetch: after the first pass every fetch is issued ahead; an evaluation pass (a different
// module order) is detected, stays correct, and the next steps recover the hit rate.
TEST(OffloadEngine, PrefetchRecoversWhenTheModuleOrderChanges) {
  const TrainerConfig c = tiny(ModelKind::kLlama, DType::kBF16, 1, 1.0);
  TempDir dir("strata-offload");
  OffloadSettings s = settings_for({Tier::kHost, Tier::kHost}, dir);
  auto device = make_device();
  auto engine = OffloadEngine::create(c, s, *device);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  std::vector<std::int32_t> in, tg;
  for (int i = 0; i < 3; ++i) {
    batch(c, i, in, tg);
    ASSERT_TRUE((*engine)->step(in, tg).ok());
  }
  const OffloadStats warm = (*engine)->stats();
  // The evaluation pass: forward only, so the recorded train trace mismatches at its end ...
  std::vector<std::int32_t> ev(in.begin(), in.begin() + c.micro_batch * c.seq_len);
  std::vector<std::int32_t> et(tg.begin(), tg.begin() + c.micro_batch * c.seq_len);
  ASSERT_TRUE((*engine)->loss(ev, et).ok());
  // ... and the next step differs from the recorded forward-only trace.
  batch(c, 3, in, tg);
  ASSERT_TRUE((*engine)->step(in, tg).ok());
  const OffloadStats changed = (*engine)->stats();
  EXPECT_GE(changed.trace_mismatches, warm.trace_mismatches + 1);
  for (int i = 4; i < 8; ++i) {
    batch(c, i, in, tg);
    ASSERT_TRUE((*engine)->step(in, tg).ok());
  }
  const OffloadStats after = (*engine)->stats();
  const double recent = static_cast<double>(after.prefetch_hits - changed.prefetch_hits) /
                        static_cast<double>(after.param_accesses - changed.param_accesses);
  // Every access is fetched ahead: the first module's as soon as its update of the previous
  // step is published (the early fetch follows the trace the re-traced step recorded).
  EXPECT_EQ(recent, 1.0) << "hits " << after.prefetch_hits << " of " << after.param_accesses;
  EXPECT_EQ(after.trace_mismatches, changed.trace_mismatches);
  EXPECT_EQ(after.allocations_after_warmup, 0u);
}

// Parameters at home on NVMe: from the second step on every fetched access is a hit. A pass
// would begin with nothing in flight and its first access (the embedding, the unit updated
// first) fetched on demand; instead the first accesses are fetched as soon as their update is
// published (docs/offload.md "Early fetch across steps"). The runs equal the all-device run bit
// for bit, also across a set_param between steps, which must drop the early copy of the unit it
// rewrites (that step's first access is then the one miss). With the optimizer on NVMe (in
// sub-groups of 4097 elements, gradients on NVMe too) the update also takes over optimizer-state
// reads issued during backward.
TEST(OffloadEngine, NvmeParametersHitEveryAccessAfterTheFirstStep) {
  struct Case {
    Tier optimizer, gradients;
    std::int64_t sub_group;
  };
  for (const Case& k : {Case{Tier::kHost, Tier::kHost, 0}, Case{Tier::kNvme, Tier::kHost, 0},
                        Case{Tier::kNvme, Tier::kNvme, 4097}}) {
    const std::string what = std::string("optimizer on ") + std::string(to_string(k.optimizer)) + ", gradients on " +
                             std::string(to_string(k.gradients));
    SCOPED_TRACE(what);
    const TrainerConfig c = tiny(ModelKind::kGpt2, DType::kBF16, 2, 1.0);
    TempDir dir("strata-offload");
    OffloadSettings nvme = settings_for({Tier::kNvme, k.optimizer}, dir);
    nvme.gradients = k.gradients;
    if (k.sub_group > 0) nvme.sub_group_size = k.sub_group;
    // Steps 0..5 with set_param of the embedding between steps 2 and 3; stats after each step.
    auto run = [&](const OffloadSettings& s, Snapshot& out, std::vector<OffloadStats>& stats) {
      auto device = make_device();
      auto engine = OffloadEngine::create(c, s, *device);
      ASSERT_TRUE(engine.ok()) << engine.status().to_string();
      for (int i = 0; i < 6; ++i) {
        if (i == 3) {
          auto wte = (*engine)->get_param(0);
          ASSERT_TRUE(wte.ok()) << wte.status().to_string();
          for (std::size_t j = 0; j < wte->size(); j += 3) (*wte)[j] += 0.25f;
          ASSERT_TRUE((*engine)->set_param(0, *wte).ok());
        }
        ASSERT_TRUE(run_steps(**engine, c, i, i + 1, out));
        stats.push_back((*engine)->stats());
      }
      ASSERT_TRUE(capture_state(**engine, out));
    };
    Snapshot ref, got;
    std::vector<OffloadStats> ref_stats, st;
    run(OffloadSettings{}, ref, ref_stats);
    run(nvme, got, st);
    ASSERT_EQ(st.size(), 6u);
    expect_same(ref, got, what);
    const auto at = [&](int i) -> const OffloadStats& { return st[static_cast<std::size_t>(i)]; };
    const auto accesses = [&](int a, int b) { return at(b).param_accesses - at(a).param_accesses; };
    const auto hits = [&](int a, int b) { return at(b).prefetch_hits - at(a).prefetch_hits; };
    // Every unit moves (persistence threshold 0): each step fetches several units per pass.
    const std::uint64_t per_step = accesses(0, 1);
    ASSERT_GT(per_step, 4u);
    for (int i = 1; i < 6; ++i) EXPECT_EQ(accesses(i - 1, i), per_step) << "step " << i;
    // Steps 1 and 2, 4 and 5: every access a hit.
    EXPECT_EQ(hits(0, 2), accesses(0, 2));
    EXPECT_EQ(hits(3, 5), accesses(3, 5));
    // Step 3: set_param rewrote the embedding at its home, so its early copy was dropped and the
    // step's first access fetched it on demand.
    EXPECT_EQ(hits(2, 3) + 1, accesses(2, 3));
    EXPECT_EQ(st.back().trace_mismatches, st.front().trace_mismatches);
    EXPECT_EQ(st.back().allocations_after_warmup, 0u);
  }
}

// Steps 0..3 with the optimizer thread's update of module `held`'s unit held, from step 1 on,
// until a forward of module `forward` runs (EngineFaults::hold_update_until_forward): every step
// must succeed (a pass that waited for the held unit before running `forward` would wait for
// itself and fail the step after 30 s), with the bits of the all-device run, and every access
// after the first step a hit.
void expect_pass_runs_past_a_held_update(Placement p, int held, int forward) {
  const std::string what = std::string("parameters on ") + std::string(to_string(p.params)) + ", optimizer on " +
                           std::string(to_string(p.optimizer));
  SCOPED_TRACE(what);
  const TrainerConfig c = tiny(ModelKind::kGpt2, DType::kF32, 1, 1.0);
  ASSERT_EQ(c.model.n_layer, 3);  // modules: 0 embedding, 1-3 blocks h.0-h.2, 4 head
  TempDir dir("strata-offload");
  const OffloadSettings s = settings_for(p, dir);
  Snapshot ref = train(c, OffloadSettings{}, 4);
  Snapshot got;
  auto device = make_device();
  auto engine = OffloadEngine::create(c, s, *device);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  ASSERT_TRUE(run_steps(**engine, c, 0, 1, got));
  const OffloadStats first = (*engine)->stats();
  offload_detail::EngineFaults::hold_update_until_forward(**engine, held, forward);
  ASSERT_TRUE(run_steps(**engine, c, 1, 4, got));
  ASSERT_TRUE((*engine)->synchronize().ok());
  ASSERT_TRUE(capture_state(**engine, got));
  expect_same(ref, got, what);
  const OffloadStats last = (*engine)->stats();
  EXPECT_GT(last.param_accesses, first.param_accesses);
  EXPECT_EQ(last.prefetch_hits - first.prefetch_hits, last.param_accesses - first.param_accesses);
}

// A pass's prefetch of a unit whose update is still running is gated on the h2d stream instead
// of waited for by the caller (docs/offload.md "One step"): the module the pass reached (h.0) runs
// while the update of the next one (h.1) is held until it did. Parameters on NVMe and on the
// host, the optimizer on the host and on NVMe. (With the caller waiting, mutation-checked, every
// case fails its second step after 30 s.)
TEST(OffloadEngine, APassRunsTheModuleItReachedWhileALaterUnitIsStillUpdating) {
  for (const Placement& p : {Placement{Tier::kNvme, Tier::kHost}, Placement{Tier::kNvme, Tier::kNvme},
                             Placement{Tier::kHost, Tier::kHost}}) {
    expect_pass_runs_past_a_held_update(p, /*held=*/2, /*forward=*/1);
  }
}

// The NVMe optimizer marks the first units of the next forward updated as soon as their writes
// retire, not when a later unit reuses their staging buffer (docs/offload.md "One step"): h.0
// runs while the update of h.2, whose start would have retired h.0's parameter write, is held
// until it did. (With the lazy retiring, mutation-checked, both cases fail after 30 s.)
TEST(OffloadEngine, TheNvmeOptimizerMarksTheFirstUnitsOnceTheirWritesRetire) {
  for (const Tier params : {Tier::kNvme, Tier::kHost}) {
    expect_pass_runs_past_a_held_update({params, Tier::kNvme}, /*held=*/3, /*forward=*/1);
  }
}

// The optimizer-state reads issued during backward (docs/offload.md "Optimizer-state reads
// during backward") are counted: with everything on NVMe (sub-groups of 4097 elements, so the
// ring's R - 1 = 3 reads ahead are of several pieces) every step issues exactly R - 1 of them at
// its first landed unit, a step that returned has counted its own, and after synchronize() the
// update took every one of them over (none dropped). With the optimizer in host memory there is
// no such read.
TEST(OffloadEngine, EarlyOptimizerReadsAreCountedForTheNvmeOptimizerOnly) {
  const TrainerConfig c = tiny(ModelKind::kGpt2, DType::kBF16, 2, 1.0);
  for (const Tier optimizer : {Tier::kNvme, Tier::kHost}) {
    SCOPED_TRACE(std::string("optimizer on ") + std::string(to_string(optimizer)));
    TempDir dir("strata-offload");
    OffloadSettings s = settings_for({Tier::kNvme, optimizer}, dir);
    s.sub_group_size = 4097;
    auto device = make_device();
    auto engine = OffloadEngine::create(c, s, *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    const std::uint64_t ahead = static_cast<std::uint64_t>(s.nvme_buffer_count) - 1;
    ASSERT_GE(ahead, 1u);
    Snapshot out;
    std::vector<OffloadStats> st;
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(run_steps(**engine, c, i, i + 1, out));
      st.push_back((*engine)->stats());  // right after step() returned: the update may still run
    }
    ASSERT_TRUE((*engine)->synchronize().ok());
    const OffloadStats done = (*engine)->stats();
    if (optimizer == Tier::kNvme) {
      for (int i = 0; i < 3; ++i) {
        EXPECT_EQ(st[static_cast<std::size_t>(i)].early_optimizer_reads,
                  ahead * static_cast<std::uint64_t>(i + 1))
            << "after step " << i + 1;
      }
      EXPECT_GT(st[1].early_optimizer_reads, 0u) << "after step 2";
      EXPECT_EQ(done.early_optimizer_reads, 3 * ahead);
      EXPECT_EQ(done.early_optimizer_reads_dropped, 0u) << "every update took its reads over";
    } else {
      EXPECT_EQ(done.early_optimizer_reads, 0u);
      EXPECT_EQ(done.early_optimizer_reads_dropped, 0u);
    }
  }
}

// A corrupt block of NVMe optimizer state fails the step with an error naming the module and
// the swap file; the parameters stay as they were and fixing nothing else, the next read fails
// the same way (nothing is silently turned into wrong numbers).
TEST(OffloadEngine, CorruptNvmeBlockFailsTheStepAndNamesIt) {
  const TrainerConfig c = tiny(ModelKind::kGpt2, DType::kBF16, 1, 1.0);
  TempDir dir("strata-offload");
  OffloadSettings s = settings_for({Tier::kDevice, Tier::kNvme}, dir);
  s.io.direct_io = false;  // the test rewrites the file behind the engine's back
  auto device = make_device();
  auto engine = OffloadEngine::create(c, s, *device);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  std::vector<std::int32_t> in, tg;
  batch(c, 0, in, tg);
  ASSERT_TRUE((*engine)->step(in, tg).ok());
  ASSERT_TRUE((*engine)->synchronize().ok());
  const auto before = (*engine)->get_param(1);
  ASSERT_TRUE(before.ok());
  // Flip bytes everywhere in the swap files: every published block's checksum breaks.
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    if (!e.is_regular_file() || e.file_size() < 8192) continue;
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    std::vector<char> buf(static_cast<std::size_t>(e.file_size()));
    f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    for (std::size_t i = 0; i < buf.size(); i += 512) buf[i] = static_cast<char>(buf[i] ^ 0x5a);
    f.seekp(0);
    f.write(buf.data(), static_cast<std::streamsize>(buf.size()));
  }
  batch(c, 1, in, tg);
  auto m = (*engine)->step(in, tg);
  Status failed = m.ok() ? (*engine)->synchronize() : m.status();
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.code(), StatusCode::kDataLoss) << failed.to_string();
  EXPECT_NE(failed.message().find("NVMe optimizer state of module"), std::string::npos) << failed.to_string();
  EXPECT_NE(failed.message().find(dir.path().string()), std::string::npos) << failed.to_string();
}

TEST(OffloadPlan, RefusesWhatDoesNotFitAndNamesTheSetting) {
  TrainerConfig c = tiny(ModelKind::kGpt2, DType::kF32, 1, 0.0);
  c.model.n_embd = 512;
  c.model.n_layer = 8;
  DeviceConfig dc;
  dc.memory_bytes = 64ull << 20;
  dc.pinned_bytes = 16ull << 20;
  dc.compute_threads = 1;
  auto device = Device::create(dc);
  ASSERT_TRUE(device.ok());
  auto all_device = OffloadEngine::create(c, OffloadSettings{}, **device);
  ASSERT_FALSE(all_device.ok());
  EXPECT_EQ(all_device.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(all_device.status().message().find("device_memory"), std::string::npos) << all_device.status().to_string();

  OffloadSettings nvme_without_dir;
  nvme_without_dir.params = Tier::kNvme;
  nvme_without_dir.optimizer = Tier::kNvme;
  auto r = OffloadEngine::create(c, nvme_without_dir, **device);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("nvme_path"), std::string::npos) << r.status().to_string();

  OffloadSettings params_without_optimizer;
  params_without_optimizer.params = Tier::kHost;
  r = OffloadEngine::create(c, params_without_optimizer, **device);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("offload_optimizer.device"), std::string::npos) << r.status().to_string();
}

TEST(OffloadPlan, CountsEveryTierAndPrintsIt) {
  const TrainerConfig c = tiny(ModelKind::kLlama, DType::kBF16, 1, 1.0);
  OffloadSettings s;
  s.params = Tier::kNvme;
  s.optimizer = Tier::kNvme;
  s.persistence_threshold = 0;
  s.nvme_path = {"/tmp"};
  auto plan = OffloadPlan::make(c, s);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  auto layout = describe_model(c.model);
  ASSERT_TRUE(layout.ok());
  // NVMe holds the bf16 working parameters and fp32 master + two moments.
  EXPECT_EQ(plan->nvme_bytes, 3 * layout->grad_bytes + [&] {
    std::uint64_t b = 0;
    for (const auto& m : layout->modules) b += m.param_end - m.param_begin;
    return b;
  }());
  EXPECT_GT(plan->device_bytes, 0u);
  EXPECT_GT(plan->pinned_bytes, 0u);
  // LLaMA's modules read one unit each: the running one, two ahead, one trailing release.
  EXPECT_EQ(plan->param_slots, 1u * (1u + 2u) + 1u);
  // GPT-2's head also reads the embedding's unit (tied weights): two per module.
  auto gpt2 = OffloadPlan::make(tiny(ModelKind::kGpt2, DType::kBF16, 1, 1.0), s);
  ASSERT_TRUE(gpt2.ok()) << gpt2.status().to_string();
  EXPECT_EQ(gpt2->param_slots, 2u * (1u + 2u) + 1u);
  const std::string text = plan->to_string();
  EXPECT_NE(text.find("nvme"), std::string::npos) << text;
  EXPECT_NE(text.find("0 resident on the device"), std::string::npos) << text;
}

}  // namespace
}  // namespace strata::testing
