// Activation offload (docs/offload.md "Activation offload"): with activation checkpointing the
// block inputs live in pinned host memory and a ring of device buffers. Only storage moves, so
// every result is compared bit for bit against checkpointing without offload: the model's losses
// and gradients (whole model, a pipeline stage's range, several activation slots in 1F1B order),
// and the offload engine's losses, norms, parameters and optimizer state after several steps on
// two placements. The device activation bytes shrink and no longer depend on the layer count.
#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "harness/harness.hpp"
#include "offload_fixture.hpp"
#include "strata/config.hpp"
#include "strata/device.hpp"
#include "strata/engine.hpp"
#include "strata/model.hpp"
#include "strata/offload.hpp"

namespace strata::testing {
namespace {

constexpr std::int64_t kB = 2, kT = 16;
constexpr float kDloss = 1.0f / 64.0f;

ModelConfig small(ModelKind kind, DType dtype, int layers) {
  ModelConfig c;
  c.kind = kind;
  c.n_layer = layers;
  c.n_embd = 64;
  c.n_head = 4;
  c.n_kv_head = kind == ModelKind::kLlama ? 2 : 0;
  c.n_positions = 32;
  c.vocab_size = 97;
  c.dtype = dtype;
  c.activation_checkpointing = true;
  return c;
}

struct Batches {
  std::vector<std::vector<std::int32_t>> in, tg;
};
Batches make_batches(const ModelConfig& c, int micro) {
  Batches b;
  std::mt19937 rng(11);
  for (int a = 0; a < micro; ++a) {
    std::vector<std::int32_t> in(kB * kT), tg(kB * kT);
    for (std::size_t i = 0; i < in.size(); ++i) {
      in[i] = static_cast<std::int32_t>(rng() % static_cast<unsigned>(c.vocab_size));
      tg[i] = i % 5 == 2 ? -1 : static_cast<std::int32_t>(rng() % static_cast<unsigned>(c.vocab_size));
    }
    b.in.push_back(in);
    b.tg.push_back(tg);
  }
  return b;
}

struct Made {
  std::unique_ptr<Device> device;
  Stream* stream = nullptr;
  std::unique_ptr<Model> model;
};

Made make(const ModelConfig& c, bool offload, int slots = 1, int first = 0) {
  Made m;
  m.device = make_device();
  auto s = m.device->create_stream("compute");
  EXPECT_TRUE(s.ok());
  m.stream = *s;
  auto layout = describe_model(c);
  EXPECT_TRUE(layout.ok());
  Model::Options o;
  o.max_batch = kB;
  o.max_seq_len = kT;
  o.activation_slots = slots;
  o.first_module = first;
  o.loss_slots = 4;
  o.offload_activations = offload;
  auto model = Model::create(*layout, *m.device, *m.stream, o);
  EXPECT_TRUE(model.ok()) << model.status().to_string();
  if (!model.ok()) return m;
  EXPECT_TRUE((*model)->initialize(42).ok());
  m.model = std::move(*model);
  return m;
}

std::vector<std::vector<float>> grads_of(Model& m) {
  std::vector<std::vector<float>> g;
  const ModelLayout& L = m.layout();
  for (std::size_t i = 0; i < L.params.size(); ++i) {
    const ParamDesc& p = L.params[i];
    if (!p.owns_storage() || p.module < m.first_module() || p.module >= m.end_module()) continue;
    auto r = m.download_grad(static_cast<int>(i));
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    g.push_back(r.ok() ? *r : std::vector<float>{});
  }
  return g;
}

TEST(ActivationOffload, NeedsActivationCheckpointingAndNamesTheKeys) {
  ModelConfig c = small(ModelKind::kGpt2, DType::kF32, 2);
  c.activation_checkpointing = false;
  auto device = make_device();
  auto stream = device->create_stream("compute");
  auto layout = describe_model(c);
  ASSERT_TRUE(layout.ok());
  Model::Options o;
  o.max_batch = kB;
  o.max_seq_len = kT;
  o.offload_activations = true;
  auto m = Model::create(*layout, *device, **stream, o);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("activation_checkpointing.cpu_checkpointing"), std::string::npos)
      << m.status().to_string();
  EXPECT_NE(m.status().message().find("--checkpointing on"), std::string::npos) << m.status().to_string();

  // The plan refuses it too, naming the same keys.
  TrainerConfig t = tiny(ModelKind::kGpt2, DType::kF32, 1, 0.0);
  OffloadSettings s;
  s.offload_activations = true;
  auto plan = OffloadPlan::make(t, s);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("--offload-activations"), std::string::npos);
}

// Two micro-batches accumulated through the whole model: losses and gradients are the bits of
// checkpointing without offload; every evicted block input went out once and came back once.
TEST(ActivationOffload, WholeModelGivesTheSameBits) {
  for (ModelKind kind : {ModelKind::kGpt2, ModelKind::kLlama}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const std::string what = std::string(to_string(kind)) + " " + std::string(to_string(dtype));
      const int layers = 6;
      const ModelConfig c = small(kind, dtype, layers);
      const Batches b = make_batches(c, 2);
      Made ref = make(c, false), got = make(c, true);
      ASSERT_TRUE(ref.model && got.model) << what;
      for (Made* m : {&ref, &got}) {
        for (int a = 0; a < 2; ++a) {
          ASSERT_TRUE(m->model->set_batch(b.in[a], b.tg[a], kB, kT).ok());
          ASSERT_TRUE(m->model->forward(true).ok());
          ASSERT_TRUE(m->model->copy_losses(a).ok());
          ASSERT_TRUE(m->model->backward(kDloss).ok());
        }
        ASSERT_TRUE(m->stream->synchronize().ok());
      }
      for (int a = 0; a < 2; ++a) EXPECT_EQ(ref.model->loss_sum(a).sum, got.model->loss_sum(a).sum) << what;
      const auto g0 = grads_of(*ref.model), g1 = grads_of(*got.model);
      ASSERT_EQ(g0.size(), g1.size());
      for (std::size_t i = 0; i < g0.size(); ++i)
        EXPECT_TRUE(bitwise_equal(g0[i], g1[i])) << what << ": param " << i;
      // Residuals 0..L; the last R = 3 stay in the ring: L + 1 - 3 inputs each way per micro-batch.
      const std::uint64_t one = static_cast<std::uint64_t>(kB * kT * c.n_embd) * dtype_size(dtype);
      const Model::ActivationTraffic tr = got.model->activation_traffic();
      EXPECT_EQ(tr.to_host, 2 * (layers + 1 - Model::kActivationRing) * one) << what;
      EXPECT_EQ(tr.to_device, tr.to_host) << what;
      EXPECT_EQ(ref.model->activation_traffic().to_host, 0u);
      EXPECT_EQ(ref.model->activation_host_bytes(), 0u);
    }
  }
}

// Activation slots in 1F1B order (pipeline parallel) over a stage's range [2, M): the stage's
// input is written into boundary_activation(2) before each forward; losses, parameter gradients
// and the gradient at the stage's input are the bits of the run without offload.
TEST(ActivationOffload, StageRangeWithSlotsInOneFOneBOrder) {
  for (ModelKind kind : {ModelKind::kLlama, ModelKind::kGpt2}) {
    const ModelConfig c = small(kind, DType::kF32, 7);
    constexpr int kMicro = 4, kFirst = 2;
    const Batches b = make_batches(c, kMicro);
    const int slots = pipeline_slots(PipelineSchedule::kOneFOneB, 3, 0, kMicro);
    ASSERT_EQ(slots, 3);
    // Deterministic stage inputs, one per micro-batch.
    const std::size_t in_floats = static_cast<std::size_t>(kB * kT * c.n_embd);
    std::vector<std::vector<float>> inputs(kMicro, std::vector<float>(in_floats));
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& v : inputs)
      for (float& x : v) x = nd(rng);

    std::vector<std::vector<std::vector<float>>> dinputs(2);
    std::vector<std::vector<double>> losses(2);
    std::vector<std::vector<std::vector<float>>> grads(2);
    for (int offload = 0; offload < 2; ++offload) {
      Made m = make(c, offload == 1, slots, kFirst);
      ASSERT_TRUE(m.model);
      dinputs[offload].assign(kMicro, std::vector<float>(in_floats));
      for (const PipelineOp& op : pipeline_ops(PipelineSchedule::kOneFOneB, 3, 0, kMicro)) {
        ASSERT_TRUE(m.model->select_slot(op.micro % slots).ok());
        if (op.forward) {
          ASSERT_TRUE(m.model->set_batch(b.in[op.micro], b.tg[op.micro], kB, kT).ok());
          ASSERT_EQ(m.model->boundary_bytes(), in_floats * 4);
          ASSERT_TRUE(m.stream
                          ->copy_async(m.model->boundary_activation(kFirst), inputs[op.micro].data(),
                                       in_floats * 4, CopyKind::kHostToDevice)
                          .ok());
          ASSERT_TRUE(m.model->forward(true).ok());
          ASSERT_TRUE(m.model->copy_losses(op.micro).ok());
          ASSERT_TRUE(m.stream->synchronize().ok());  // the pinned-less host input is reused
        } else {
          ASSERT_TRUE(m.model->backward(kDloss).ok());
          ASSERT_TRUE(m.stream
                          ->copy_async(dinputs[offload][op.micro].data(), m.model->activation_grad(),
                                       in_floats * 4, CopyKind::kDeviceToHost)
                          .ok());
          ASSERT_TRUE(m.stream->synchronize().ok());
        }
      }
      ASSERT_TRUE(m.stream->synchronize().ok());
      for (int a = 0; a < kMicro; ++a) losses[offload].push_back(m.model->loss_sum(a).sum);
      grads[offload] = grads_of(*m.model);
      if (offload == 1) {
        // Residuals 1..7 of the stage; 5..7 stay in the ring: 4 inputs each way per micro-batch.
        const Model::ActivationTraffic tr = m.model->activation_traffic();
        EXPECT_EQ(tr.to_host, static_cast<std::uint64_t>(kMicro * 4) * in_floats * 4);
        EXPECT_EQ(tr.to_device, tr.to_host);
      }
    }
    EXPECT_EQ(losses[0], losses[1]);
    for (int a = 0; a < kMicro; ++a)
      EXPECT_TRUE(bitwise_equal(dinputs[0][a], dinputs[1][a])) << "micro " << a;
    ASSERT_EQ(grads[0].size(), grads[1].size());
    ASSERT_FALSE(grads[0].empty());
    for (std::size_t i = 0; i < grads[0].size(); ++i)
      EXPECT_TRUE(bitwise_equal(grads[0][i], grads[1][i])) << i;
  }
}

// The device activation bytes with offload: smaller than without for 8 layers, the same for 4
// and 8 layers (the ring replaces L + 1 residual tensors); the pinned copies hold L + 1 per slot.
TEST(ActivationOffload, DeviceActivationBytesDoNotGrowWithLayers) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    Made off8 = make(small(ModelKind::kGpt2, dtype, 8), true);
    Made off4 = make(small(ModelKind::kGpt2, dtype, 4), true);
    Made on8 = make(small(ModelKind::kGpt2, dtype, 8), false);
    ASSERT_TRUE(off8.model && off4.model && on8.model);
    EXPECT_LT(off8.model->activation_bytes(), on8.model->activation_bytes());
    EXPECT_EQ(off8.model->activation_bytes(), off4.model->activation_bytes());
    const std::uint64_t one = static_cast<std::uint64_t>(kB * kT * 64) * dtype_size(dtype);
    EXPECT_EQ(
        on8.model->activation_bytes() - off8.model->activation_bytes(),
        (9 - Model::kActivationRing) * ((one + kParamAlignment - 1) / kParamAlignment * kParamAlignment));
    EXPECT_GE(off8.model->activation_host_bytes(), 9 * one);
    EXPECT_LT(off8.model->activation_host_bytes(), 9 * one + 4096);
    Made slots = make(small(ModelKind::kGpt2, dtype, 8), true, 3);
    ASSERT_TRUE(slots.model);
    EXPECT_EQ(slots.model->activation_host_bytes(), 3 * off8.model->activation_host_bytes());
  }
}

// Through the offload engine: several steps with offload equal checkpointing without offload,
// bit for bit, on the all-device placement and with the optimizer on the host and the
// parameters on NVMe; the engine counts the activation traffic; the plan shows the ring and the
// pinned copies as activation lines.
TEST(ActivationOffload, EngineStepsGiveTheSameBitsOnTwoPlacements) {
  struct Case {
    ModelKind kind;
    DType dtype;
    std::int64_t accum;
  };
  for (const Case& k : {Case{ModelKind::kGpt2, DType::kF32, 1}, Case{ModelKind::kGpt2, DType::kBF16, 2},
                        Case{ModelKind::kLlama, DType::kF32, 2}, Case{ModelKind::kLlama, DType::kBF16, 1}}) {
    TrainerConfig c = tiny(k.kind, k.dtype, k.accum, 1.0);
    c.model.n_layer = 5;
    c.model.activation_checkpointing = true;
    const std::string what = std::string(to_string(k.kind)) + " " + std::string(to_string(k.dtype)) +
                             " accum " + std::to_string(k.accum);
    const Snapshot ref = train(c, OffloadSettings{}, 3);
    ASSERT_EQ(ref.losses.size(), 3u) << what;
    TempDir dir("strata-act-offload");
    OffloadSettings nvme = settings_for(Placement{Tier::kNvme, Tier::kHost}, dir);
    OffloadSettings dev;
    for (OffloadSettings s : {dev, nvme}) {
      s.offload_activations = true;
      auto plan = OffloadPlan::make(c, s);
      ASSERT_TRUE(plan.ok()) << plan.status().to_string();
      std::uint64_t ring = 0, pinned = 0;
      for (const PlanLine& l : plan->lines) {
        if (l.kind != StateKind::kActivations || l.what.find("activation offload") == std::string::npos)
          continue;
        (l.tier == Tier::kDevice ? ring : pinned) += l.bytes;
        if (l.tier == Tier::kHost) {
          EXPECT_TRUE(l.pinned);
        }
      }
      const std::uint64_t one =
          static_cast<std::uint64_t>(c.micro_batch * c.seq_len * c.model.n_embd) * dtype_size(c.model.dtype);
      EXPECT_GE(ring, 3 * one) << what;
      EXPECT_GE(pinned, 6 * one) << what;

      Snapshot got;
      auto device = make_device();
      auto engine = OffloadEngine::create(c, s, *device);
      ASSERT_TRUE(engine.ok()) << engine.status().to_string();
      ASSERT_TRUE(run_steps(**engine, c, 0, 3, got));
      ASSERT_TRUE(capture_state(**engine, got));
      expect_same(ref, got, what + (s.params == Tier::kNvme ? ", params on nvme" : ", all on device"));
      // Residuals 0..5, the last 3 in the ring: 3 inputs each way per micro-batch.
      const OffloadStats st = (*engine)->stats();
      EXPECT_EQ(st.bytes_activations_to_host, static_cast<std::uint64_t>(3 * k.accum * 3) * one) << what;
      EXPECT_EQ(st.bytes_activations_to_device, st.bytes_activations_to_host) << what;
      EXPECT_LE(st.bytes_activations_to_host, st.bytes_d2h);
    }
  }
}

// The DeepSpeed key and the CLI flag: activation_checkpointing.cpu_checkpointing turns it on (a
// value of the wrong type is refused naming the key); strata train --plan shows the ring and the
// pinned copies, refuses it without checkpointing naming the flags, and a short run trains the
// same losses as checkpointing alone while its metrics count the activation traffic.
TEST(ActivationOffload, ConfigKeyAndCli) {
  {
    auto c = parse_config(
        R"({"activation_checkpointing": {"cpu_checkpointing": true, "partition_activations": true}})",
        "ds.json");
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    OffloadSettings s;
    ASSERT_TRUE(s.apply(*c).ok());
    EXPECT_TRUE(s.offload_activations);
    auto bad = parse_config(R"({"activation_checkpointing": {"cpu_checkpointing": "sometimes"}})", "ds.json");
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("activation_checkpointing.cpu_checkpointing"), std::string::npos)
        << bad.status().to_string();
  }
  const std::string shape = " --layers 5 --width 32 --heads 2 --seq-len 32 --batch 2 --threads 1";
  auto plan = run_cli("train --plan --checkpointing on --offload-activations" + shape);
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  EXPECT_NE(plan.output.find("activation offload: device ring"), std::string::npos) << plan.output;
  EXPECT_NE(plan.output.find("activation offload: checkpointed block inputs (pinned)"), std::string::npos)
      << plan.output;
  auto refused = run_cli("train --plan --offload-activations" + shape);
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_NE(refused.output.find("--checkpointing on"), std::string::npos) << refused.output;

  TempDir dir;
  std::vector<std::vector<double>> losses(2);
  for (int offload = 0; offload < 2; ++offload) {
    const std::string metrics = (dir / ("m" + std::to_string(offload) + ".jsonl")).string();
    auto r = run_cli("train --checkpointing on --steps 3 --metrics " + metrics +
                     (offload == 1 ? " --offload-activations" : "") + shape);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    for (const auto& j : read_jsonl(metrics)) {
      losses[static_cast<std::size_t>(offload)].push_back(j["loss"].get<double>());
      // Residuals 0..5, the last 3 in the ring: 3 block inputs out and back per micro-batch.
      const std::uint64_t one = 2 * 32 * 32 * 4;
      EXPECT_EQ(j["traffic"]["activations"].get<std::uint64_t>(), offload == 1 ? 2 * 3 * one : 0u)
          << j.dump();
    }
  }
  ASSERT_EQ(losses[0].size(), 3u);
  EXPECT_EQ(losses[0], losses[1]);
}

}  // namespace
}  // namespace strata::testing
