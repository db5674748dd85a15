// The one-step delayed parameter update (OffloadSettings::delayed_update, docs/offload.md
// "Delayed update"). It is not equivalent to the ordinary step, so it is checked against a
// reference that is: the ordinary engine (the same placement, update not delayed; itself equal to
// the all-device run, test_offload_engine.cpp) driven by hand so that each step's gradients are
// taken at the parameters the delayed run computes with. Before step t the reference's working
// parameters are set to P[s(t)] while its fp32 masters and moments stay those after step t-1
// (offload_detail::EngineFaults::set_working_param); its step then takes the gradients (and the
// loss) at P[s(t)] and applies them to the state after step t-1, exactly what the delayed run's
// update of step t does. With P[k] the working parameters after step k's update:
//   s(t) = t-1 when step t-1's update is not delayed (t = 1, t-1 <= delayed_update_warmup, or a
//          flush after step t-1: synchronize, a checkpoint, an evaluation, a state read),
//   s(t) = t-2 otherwise (step t-1's update ran while step t computed).
// Both runs use the same kernels, the same per-unit gradient scans merged in unit order and the
// same CPU Adam on the same elements, so the comparison is bitwise on the cpu backend: losses,
// gradient norms, loss scales and skips of every step, and afterwards every parameter, master
// and moment.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "harness/harness.hpp"
#include "offload/internal.hpp"
#include "offload_fixture.hpp"
#include "strata/config.hpp"
#include "strata/offload.hpp"

namespace strata::testing {
namespace {

using offload_detail::EngineFaults;

// Working parameters of every owning parameter (in capture_state's order).
using Params = std::vector<std::vector<float>>;

bool capture_params(OffloadEngine& engine, Params& out) {
  const ModelLayout& L = engine.model().layout();
  out.clear();
  for (std::size_t i = 0; i < L.params.size(); ++i) {
    if (!L.params[i].owns_storage()) continue;
    auto p = engine.get_param(static_cast<int>(i));
    EXPECT_TRUE(p.ok()) << p.status().to_string();
    if (!p.ok()) return false;
    out.push_back(*p);
  }
  return true;
}

bool set_working(OffloadEngine& engine, const Params& values) {
  const ModelLayout& L = engine.model().layout();
  std::size_t k = 0;
  for (std::size_t i = 0; i < L.params.size(); ++i) {
    if (!L.params[i].owns_storage()) continue;
    Status s = EngineFaults::set_working_param(engine, static_cast<int>(i), values[k++]);
    EXPECT_TRUE(s.ok()) << s.to_string();
    if (!s.ok()) return false;
  }
  return true;
}

// The hand-driven reference of `steps` delayed steps (batches 0..steps-1) with `warmup` and
// flushes after the steps in `flushes`; `at_step` > 0 also captures the state after that step.
Snapshot reference(const TrainerConfig& c, OffloadSettings s, int steps, int warmup,
                   const std::set<int>& flushes, int at_step = 0, Snapshot* at = nullptr) {
  s.delayed_update = false;
  Snapshot out;
  auto device = make_device();
  auto engine = OffloadEngine::create(c, s, *device);
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  if (!engine.ok()) return out;
  OffloadEngine& e = **engine;
  std::vector<Params> P(1);
  if (!capture_params(e, P[0])) return out;
  for (int t = 1; t <= steps; ++t) {
    const bool sees_last = t == 1 || t - 1 <= warmup || flushes.count(t - 1) > 0;
    const int src = sees_last ? t - 1 : t - 2;
    if (!set_working(e, P[static_cast<std::size_t>(src)])) return out;
    if (!run_steps(e, c, t - 1, t, out)) return out;
    Params now;
    if (out.skipped.back() != 0) {
      now = P.back();  // a skipped update leaves the parameters of the step before
    } else if (!capture_params(e, now)) {
      return out;
    }
    P.push_back(std::move(now));
    if (t == at_step && at != nullptr) {
      if (!set_working(e, P.back()) || !capture_state(e, *at)) return out;
    }
  }
  if (!set_working(e, P.back())) return out;
  capture_state(e, out);
  return out;
}

OffloadSettings delayed(Tier optimizer, const TempDir& dir, int warmup) {
  OffloadSettings s = settings_for(Placement{Tier::kDevice, optimizer}, dir);
  s.delayed_update = true;
  s.delayed_update_warmup = warmup;
  return s;
}

struct DpuCase {
  ModelKind kind;
  DType dtype;
  std::int64_t accum;
  double clip;
  Tier optimizer;
  bool grads_on_nvme;
  int warmup;
};

// gtest prints the case with its name (not the struct's bytes, padding included).
void PrintTo(const DpuCase& k, std::ostream* os) {
  *os << (k.kind == ModelKind::kGpt2 ? "gpt2" : "llama") << " " << to_string(k.dtype) << " accum " << k.accum
      << " clip " << k.clip << " optimizer " << to_string(k.optimizer)
      << (k.grads_on_nvme ? " grads nvme" : "") << " warmup " << k.warmup;
}

class DelayedUpdate : public ::testing::TestWithParam<DpuCase> {};

TEST_P(DelayedUpdate, EachStepComputesAtTheParametersBeforeThePreviousUpdate) {
  const DpuCase k = GetParam();
  const TrainerConfig c = tiny(k.kind, k.dtype, k.accum, k.clip);
  TempDir dir("strata-dpu");
  OffloadSettings s = delayed(k.optimizer, dir, k.warmup);
  if (k.grads_on_nvme) {
    s.gradients = Tier::kNvme;
    s.sub_group_size = 4097;
  }
  constexpr int kSteps = 6;
  const Snapshot ref = reference(c, s, kSteps, k.warmup, {});
  const Snapshot got = train(c, s, kSteps);
  expect_same(ref, got, "delayed update");
  // The delay is real: the ordinary run of the same batches differs (from the first delayed step
  // on), so the comparison above could not pass by the delay being ignored.
  OffloadSettings plain = s;
  plain.delayed_update = false;
  const Snapshot ordinary = train(c, plain, kSteps);
  ASSERT_EQ(ordinary.losses.size(), got.losses.size());
  const std::size_t first_delayed = static_cast<std::size_t>(k.warmup) + 1;  // 0-based index of step warmup+2
  for (std::size_t i = 0; i < first_delayed; ++i) {
    EXPECT_EQ(ordinary.losses[i], got.losses[i]) << "step " << i + 1 << " sees every update before it";
  }
  EXPECT_NE(ordinary.losses[first_delayed], got.losses[first_delayed])
      << "step " << first_delayed + 1 << " should compute at the parameters before step " << first_delayed
      << "'s update";
}

INSTANTIATE_TEST_SUITE_P(
    Cases, DelayedUpdate,
    ::testing::Values(DpuCase{ModelKind::kGpt2, DType::kF32, 1, 0.0, Tier::kHost, false, 0},
                      DpuCase{ModelKind::kGpt2, DType::kBF16, 2, 1.0, Tier::kHost, false, 1},
                      DpuCase{ModelKind::kLlama, DType::kF32, 2, 0.5, Tier::kNvme, false, 1},
                      DpuCase{ModelKind::kLlama, DType::kBF16, 1, 0.0, Tier::kNvme, true, 2},
                      // fp16: loss scaling with skipped steps (the scale rises every two good
                      // steps, so it overflows again); a skipped update leaves P[t] = P[t-1]
                      DpuCase{ModelKind::kGpt2, DType::kF16, 1, 1.0, Tier::kHost, false, 0},
                      DpuCase{ModelKind::kLlama, DType::kF16, 2, 0.0, Tier::kNvme, false, 1}),
    [](const ::testing::TestParamInfo<DpuCase>& info) {
      const DpuCase& k = info.param;
      std::string name = std::string(k.kind == ModelKind::kGpt2 ? "Gpt2" : "Llama") + "_" +
                         std::string(to_string(k.dtype)) + "_accum" + std::to_string(k.accum) +
                         (k.clip > 0 ? "_clip" : "") + "_optimizer_" + std::string(to_string(k.optimizer)) +
                         (k.grads_on_nvme ? "_grads_nvme" : "") + "_warmup" + std::to_string(k.warmup);
      return name;
    });

// The delayed update with the working parameters off the device (host or NVMe home): the update
// in flight writes a second version of each unit (a host copy, or the other of two NVMe swap
// shards) while the next step fetches the published one, and publish_delayed makes the new one
// current after that step's passes. The math of the delay does not depend on where parameters
// live, so every step equals the delayed run with resident parameters bit for bit: losses,
// norms, scales and skips, and every parameter, master and moment afterwards. That run is itself
// equal to the hand-driven reference above.
struct OffDeviceCase {
  ModelKind kind;
  DType dtype;
  std::int64_t accum;
  double clip;
  Tier params, optimizer;
  bool grads_on_nvme;
  int warmup;
};

void PrintTo(const OffDeviceCase& k, std::ostream* os) {
  *os << (k.kind == ModelKind::kGpt2 ? "gpt2" : "llama") << " " << to_string(k.dtype) << " accum " << k.accum
      << " clip " << k.clip << " params " << to_string(k.params) << " optimizer " << to_string(k.optimizer)
      << (k.grads_on_nvme ? " grads nvme" : "") << " warmup " << k.warmup;
}

class DelayedUpdateOffDevice : public ::testing::TestWithParam<OffDeviceCase> {};

TEST_P(DelayedUpdateOffDevice, EqualsTheDelayedRunWithResidentParametersBitForBit) {
  const OffDeviceCase k = GetParam();
  const TrainerConfig c = tiny(k.kind, k.dtype, k.accum, k.clip);
  // One swap directory per engine: the placements' swap files differ in size.
  TempDir dir("strata-dpu-off"), off_dir("strata-dpu-off"), plain_dir("strata-dpu-off");
  OffloadSettings resident = delayed(k.optimizer, dir, k.warmup);
  if (k.grads_on_nvme) {
    resident.gradients = Tier::kNvme;
    resident.sub_group_size = 4097;
  }
  OffloadSettings off = resident;
  off.params = k.params;
  off.nvme_path = {off_dir.path().string()};
  constexpr int kSteps = 6;
  const Snapshot want = train(c, resident, kSteps);
  Snapshot got;
  {
    auto device = make_device();
    auto engine = OffloadEngine::create(c, off, *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    ASSERT_TRUE(run_steps(**engine, c, 0, kSteps, got));
    // The parameters really travel: every module is fetched from its home each pass.
    const OffloadStats st = (*engine)->stats();
    EXPECT_GT(st.param_accesses, 0u);
    ASSERT_TRUE(capture_state(**engine, got));
  }
  expect_same(want, got, std::string("delayed update, parameters on ") + std::string(to_string(k.params)));
  // And the delay is kept: the ordinary run with the same homes differs from the first delayed step.
  OffloadSettings plain = off;
  plain.delayed_update = false;
  plain.nvme_path = {plain_dir.path().string()};
  const Snapshot ordinary = train(c, plain, kSteps);
  ASSERT_EQ(ordinary.losses.size(), got.losses.size());
  const std::size_t first_delayed = static_cast<std::size_t>(k.warmup) + 1;
  EXPECT_NE(ordinary.losses[first_delayed], got.losses[first_delayed]) << "step " << first_delayed + 1;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, DelayedUpdateOffDevice,
    ::testing::Values(
        OffDeviceCase{ModelKind::kGpt2, DType::kF32, 1, 0.0, Tier::kHost, Tier::kHost, false, 0},
        OffDeviceCase{ModelKind::kLlama, DType::kBF16, 2, 1.0, Tier::kHost, Tier::kNvme, false, 1},
        OffDeviceCase{ModelKind::kGpt2, DType::kBF16, 2, 1.0, Tier::kNvme, Tier::kHost, false, 0},
        OffDeviceCase{ModelKind::kLlama, DType::kF32, 1, 0.5, Tier::kNvme, Tier::kNvme, true, 1},
        // fp16: skipped steps write no new version, and publishing must keep the current one
        OffDeviceCase{ModelKind::kGpt2, DType::kF16, 1, 1.0, Tier::kNvme, Tier::kNvme, false, 0},
        OffDeviceCase{ModelKind::kLlama, DType::kF16, 2, 0.0, Tier::kHost, Tier::kHost, false, 1}),
    [](const ::testing::TestParamInfo<OffDeviceCase>& info) {
      const OffDeviceCase& k = info.param;
      return std::string(k.kind == ModelKind::kGpt2 ? "Gpt2" : "Llama") + "_" + std::string(to_string(k.dtype)) +
             "_accum" + std::to_string(k.accum) + (k.clip > 0 ? "_clip" : "") + "_params_" +
             std::string(to_string(k.params)) + "_optimizer_" + std::string(to_string(k.optimizer)) +
             (k.grads_on_nvme ? "_grads_nvme" : "") + "_warmup" + std::to_string(k.warmup);
    });

// The plan holds the second version: a host line of the host-homed units' working bytes, or an
// NVMe line as large as the published NVMe parameters (and swap room for it); nothing without
// the delayed update.
TEST(DelayedUpdateOffDevice, PlanHoldsTheSecondVersion) {
  const TrainerConfig c = tiny(ModelKind::kGpt2, DType::kBF16, 1, 0.0);
  TempDir dir("strata-dpu-plan");
  const std::string next = "working parameters (the delayed update's next version)";
  for (Tier params : {Tier::kHost, Tier::kNvme}) {
    OffloadSettings s = delayed(Tier::kHost, dir, 1);
    s.params = params;
    OffloadSettings plain = s;
    plain.delayed_update = false;
    auto with = OffloadPlan::make(c, s);
    auto without = OffloadPlan::make(c, plain);
    ASSERT_TRUE(with.ok() && without.ok());
    std::uint64_t published = 0, second = 0;
    for (const PlanLine& l : without->lines) {
      EXPECT_NE(l.what, next);
      if (l.tier == params && l.what.rfind("working parameters", 0) == 0) published += l.bytes;
    }
    for (const PlanLine& l : with->lines) {
      if (l.what == next) {
        EXPECT_EQ(l.tier, params);
        second += l.bytes;
      }
    }
    EXPECT_GT(second, 0u) << to_string(params);
    if (params == Tier::kNvme) {
      EXPECT_EQ(second, published);
      EXPECT_GE(with->swap_bytes, without->swap_bytes + second);
    } else {
      // The host copy also holds the resident modules (none here: every module moves).
      EXPECT_EQ(second, published);
    }
  }
}

// Flushes and checkpoints with the parameters on NVMe: a state read publishes the version in
// flight (the shard flip), a checkpoint saved with an update in flight holds the latest state,
// and the run resumed from it continues bit for bit; all against the resident delayed run.
TEST(DelayedUpdateOffDevice, FlushesAndCheckpointsWithParametersOnNvme) {
  const TrainerConfig c = tiny(ModelKind::kLlama, DType::kBF16, 1, 1.0);
  TempDir dir("strata-dpu-off"), off_dir("strata-dpu-off"), resume_dir("strata-dpu-off");
  TempDir ckpt("strata-dpu-off-ckpt");
  const OffloadSettings resident = delayed(Tier::kNvme, dir, 0);
  OffloadSettings off = resident;
  off.params = Tier::kNvme;
  off.nvme_path = {off_dir.path().string()};
  auto drive = [&](const OffloadSettings& s, bool save, Snapshot& out) {
    auto device = make_device();
    auto engine = OffloadEngine::create(c, s, *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    ASSERT_TRUE(run_steps(**engine, c, 0, 2, out));
    ASSERT_TRUE((*engine)->synchronize().ok());
    ASSERT_TRUE(run_steps(**engine, c, 2, 4, out));
    if (save) {
      auto saved = (*engine)->save_checkpoint(ckpt.path().string());
      ASSERT_TRUE(saved.ok()) << saved.status().to_string();
    } else {
      ASSERT_TRUE((*engine)->synchronize().ok());
    }
    ASSERT_TRUE(run_steps(**engine, c, 4, 6, out));
    ASSERT_TRUE(capture_state(**engine, out));
  };
  Snapshot want, got;
  drive(resident, false, want);
  drive(off, true, got);
  expect_same(want, got, "parameters on NVMe, flushed after steps 2 and 4");
  Snapshot resumed;
  {
    OffloadSettings fresh = off;  // a new swap directory: only the checkpoint carries the state
    fresh.nvme_path = {resume_dir.path().string()};
    auto device = make_device();
    auto engine = OffloadEngine::create(c, fresh, *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    auto m = (*engine)->load_checkpoint(ckpt.path().string());
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    EXPECT_EQ(m->step, 4);
    ASSERT_TRUE(run_steps(**engine, c, 4, 6, resumed));
    ASSERT_TRUE(capture_state(**engine, resumed));
  }
  Snapshot tail = want;
  for (auto* v : {&tail.losses, &tail.norms, &tail.scales}) v->erase(v->begin(), v->begin() + 4);
  tail.skipped.erase(tail.skipped.begin(), tail.skipped.begin() + 4);
  expect_same(tail, resumed, "resumed from the checkpoint of step 4 (parameters on NVMe)");
}

// Anything that reads the state waits for the update in flight and uploads it: the next step
// then computes at the latest parameters (here an evaluation after step 2 and a synchronize after
// step 4), and what was read is the state after every update so far.
TEST(DelayedUpdateFlush, StateReadsAndEvaluationSeeEveryUpdate) {
  const TrainerConfig c = tiny(ModelKind::kGpt2, DType::kBF16, 1, 1.0);
  TempDir dir("strata-dpu");
  const OffloadSettings s = delayed(Tier::kHost, dir, 0);
  Snapshot at2;
  const Snapshot ref = reference(c, s, 6, 0, {2, 4}, 2, &at2);
  auto device = make_device();
  auto engine = OffloadEngine::create(c, s, *device);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  Snapshot got;
  ASSERT_TRUE(run_steps(**engine, c, 0, 2, got));
  std::vector<std::int32_t> in, tg;
  batch(c, 100, in, tg);
  in.resize(static_cast<std::size_t>(c.micro_batch * c.seq_len));
  tg.resize(in.size());
  ASSERT_TRUE((*engine)->loss(in, tg).ok());
  Snapshot now;
  ASSERT_TRUE(capture_state(**engine, now));
  for (std::size_t i = 0; i < now.param.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(at2.param[i], now.param[i])) << "parameter " << i << " after step 2";
    EXPECT_TRUE(bitwise_equal(at2.master[i], now.master[i])) << "master " << i << " after step 2";
  }
  ASSERT_TRUE(run_steps(**engine, c, 2, 4, got));
  ASSERT_TRUE((*engine)->synchronize().ok());
  ASSERT_TRUE(run_steps(**engine, c, 4, 6, got));
  ASSERT_TRUE(capture_state(**engine, got));
  expect_same(ref, got, "delayed update with flushes after steps 2 and 4");
}

// A checkpoint saved while an update is in flight waits for it: the files hold the state after
// every update so far (equal to the reference's), and an engine resumed from them continues the
// same trajectory as the engine that saved, bit for bit.
TEST(DelayedUpdateCheckpoint, SaveWaitsForTheUpdateInFlightAndResumeContinuesBitForBit) {
  const TrainerConfig c = tiny(ModelKind::kLlama, DType::kBF16, 2, 1.0);
  TempDir dir("strata-dpu");
  TempDir ckpt("strata-dpu-ckpt");
  const OffloadSettings s = delayed(Tier::kNvme, dir, 0);
  Snapshot at3;
  const Snapshot ref = reference(c, s, 6, 0, {3}, 3, &at3);
  Snapshot first, resumed;
  {
    auto device = make_device();
    auto engine = OffloadEngine::create(c, s, *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    ASSERT_TRUE(run_steps(**engine, c, 0, 3, first));
    auto saved = (*engine)->save_checkpoint(ckpt.path().string());
    ASSERT_TRUE(saved.ok()) << saved.status().to_string();
    ASSERT_TRUE(run_steps(**engine, c, 3, 6, first));
    ASSERT_TRUE(capture_state(**engine, first));
  }
  expect_same(ref, first, "delayed update, checkpoint after step 3");
  std::filesystem::remove_all(dir.path());
  std::filesystem::create_directories(dir.path());
  {
    auto device = make_device();
    auto engine = OffloadEngine::create(c, s, *device);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    auto m = (*engine)->load_checkpoint(ckpt.path().string());
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    EXPECT_EQ(m->step, 3);
    Snapshot loaded;
    ASSERT_TRUE(capture_state(**engine, loaded));
    ASSERT_EQ(loaded.param.size(), at3.param.size());
    for (std::size_t i = 0; i < loaded.param.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(at3.param[i], loaded.param[i])) << "checkpointed parameter " << i;
      EXPECT_TRUE(bitwise_equal(at3.master[i], loaded.master[i])) << "checkpointed master " << i;
      EXPECT_TRUE(bitwise_equal(at3.m[i], loaded.m[i])) << "checkpointed exp_avg " << i;
      EXPECT_TRUE(bitwise_equal(at3.v[i], loaded.v[i])) << "checkpointed exp_avg_sq " << i;
    }
    ASSERT_TRUE(run_steps(**engine, c, 3, 6, resumed));
    ASSERT_TRUE(capture_state(**engine, resumed));
  }
  Snapshot tail = first;
  tail.losses.erase(tail.losses.begin(), tail.losses.begin() + 3);
  tail.norms.erase(tail.norms.begin(), tail.norms.begin() + 3);
  tail.scales.erase(tail.scales.begin(), tail.scales.begin() + 3);
  tail.skipped.erase(tail.skipped.begin(), tail.skipped.begin() + 3);
  expect_same(tail, resumed, "resumed from the checkpoint of step 3");
}

// The setting is refused where it has no meaning, naming the key; a pipeline takes it.
TEST(DelayedUpdateSettings, RefusedWithTheOptimizerOnTheDeviceTakenWithAPipeline) {
  TempDir dir("strata-dpu");
  OffloadSettings s = delayed(Tier::kHost, dir, 1);
  EXPECT_TRUE(s.validate().ok());
  OffloadSettings on_device = s;
  on_device.optimizer = Tier::kDevice;
  Status e = on_device.validate();
  EXPECT_FALSE(e.ok());
  EXPECT_NE(e.message().find("strata.delayed_update"), std::string::npos) << e.message();
  EXPECT_NE(e.message().find("offload_optimizer.device"), std::string::npos) << e.message();
  for (Tier params : {Tier::kHost, Tier::kNvme}) {
    OffloadSettings off = s;
    off.params = params;
    EXPECT_TRUE(off.validate().ok()) << "one process takes parameters off the device";
    // Data parallel with parameters off the device is built (stage 3: two versions of each
    // rank's slice; tests/test_dist_offload_dpu.cpp trains it).
    for (int stage : {1, 2, 3}) {
      off.dp_size = 2;
      off.zero_stage = stage;
      Status p = off.validate();
      EXPECT_TRUE(p.ok()) << "stage " << stage << ": " << p.message();
    }
  }
  // A pipeline is built (each stage delays its own units' update; tests/test_dist_offload_dpu.cpp
  // trains it against one process), with the parameters anywhere.
  for (Tier params : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
    OffloadSettings piped = s;
    piped.params = params;
    piped.pipeline_bounds = {0, 2, 5};
    Status pe = piped.validate();
    EXPECT_TRUE(pe.ok()) << "params on " << to_string(params) << ": " << pe.message();
  }
  OffloadSettings neg = s;
  neg.delayed_update_warmup = -1;
  EXPECT_NE(neg.validate().message().find("strata.delayed_update_warmup"), std::string::npos);
  // The engine refuses it too (create validates the plan's settings).
  auto device = make_device();
  auto engine = OffloadEngine::create(tiny(ModelKind::kGpt2, DType::kF32, 1, 0.0), on_device, *device);
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("strata.delayed_update"), std::string::npos);
}

// The keys under "strata" reach the settings; a bad value names the key.
TEST(DelayedUpdateSettings, ConfigKeysApply) {
  auto config = parse_config(
      R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
          "strata": {"delayed_update": true, "delayed_update_warmup": 3}})",
      "dpu.json");
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  OffloadSettings s;
  ASSERT_TRUE(s.apply(*config).ok());
  EXPECT_TRUE(s.delayed_update);
  EXPECT_EQ(s.delayed_update_warmup, 3);
  auto refused = parse_config(
      R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}, "strata": {"delayed_update": true}})",
      "dpu.json");
  ASSERT_TRUE(refused.ok()) << refused.status().to_string();
  OffloadSettings r;
  Status e = r.apply(*refused);
  EXPECT_FALSE(e.ok());
  EXPECT_NE(e.message().find("strata.delayed_update"), std::string::npos) << e.message();
  auto bad = parse_config(R"({"strata": {"delayed_update": "sometimes"}})", "dpu.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("delayed_update"), std::string::npos) << bad.status().message();
}

}  // namespace
}  // namespace strata::testing
