// Whole-model gradient checks on tiny configs (cpu backend, fp32): the analytic gradient of the
// mean loss with respect to sampled elements of every parameter against a central finite
// difference, for GPT-2 (tied embeddings, padded vocabulary) and LLaMA (grouped-query heads,
// rotary, SwiGLU); and activation checkpointing gives bitwise the same gradients.
#include <algorithm>
#include <cmath>
#include <random>

#include "harness/harness.hpp"
#include "strata/device.hpp"
#include "strata/engine.hpp"

namespace strata::testing {
namespace {

std::unique_ptr<Device> make_device() {
  DeviceConfig dc;
  dc.kind = DeviceKind::kCpu;
  dc.memory_bytes = 64ull << 20;
  dc.pinned_bytes = 16ull << 20;
  dc.compute_threads = 2;
  auto d = Device::create(dc);
  EXPECT_TRUE(d.ok()) << d.status().to_string();
  return std::move(d).value();
}

TrainerConfig tiny(ModelKind kind) {
  TrainerConfig t;
  t.model.kind = kind;
  t.model.n_layer = 2;
  t.model.n_embd = 16;
  t.model.n_head = kind == ModelKind::kGpt2 ? 2 : 4;
  t.model.n_kv_head = kind == ModelKind::kGpt2 ? 0 : 2;
  t.model.n_positions = 12;
  t.model.vocab_size = 40;
  t.model.vocab_multiple = 16;  // pads the head to 48 rows
  t.model.init_std = 0.3;       // large enough that every gradient is well above fp32 noise
  t.micro_batch = 2;
  t.seq_len = 8;
  return t;
}

void make_batch(std::int64_t n, std::int32_t vocab, std::uint32_t seed, std::vector<std::int32_t>& inputs,
                std::vector<std::int32_t>& targets) {
  std::mt19937 rng(seed);
  inputs.resize(static_cast<std::size_t>(n));
  targets.resize(static_cast<std::size_t>(n));
  for (auto& t : inputs) t = static_cast<std::int32_t>(rng() % static_cast<std::uint32_t>(vocab));
  for (auto& t : targets) t = static_cast<std::int32_t>(rng() % static_cast<std::uint32_t>(vocab));
}

void check_gradients(ModelKind kind) {
  auto device = make_device();
  const TrainerConfig cfg = tiny(kind);
  auto trainer = Trainer::create(cfg, *device);
  ASSERT_TRUE(trainer.ok()) << trainer.status().to_string();
  Trainer& tr = **trainer;
  std::vector<std::int32_t> inputs, targets;
  make_batch(cfg.micro_batch * cfg.seq_len, 40, 11, inputs, targets);
  targets[3] = -1;  // an ignored row must not contribute

  auto loss0 = tr.loss_and_gradients(inputs, targets);
  ASSERT_TRUE(loss0.ok()) << loss0.status().to_string();
  const ModelLayout& layout = tr.model().layout();
  std::mt19937 rng(5);
  const float h = 1e-2f;
  int checked = 0;
  for (std::size_t i = 0; i < layout.params.size(); ++i) {
    const ParamDesc& p = layout.params[i];
    if (!p.owns_storage()) continue;
    auto grad = tr.model().download_grad(static_cast<int>(i));
    auto value = tr.model().download_param(static_cast<int>(i));
    ASSERT_TRUE(grad.ok() && value.ok());
    // The largest gradient element and three random ones (within the real vocabulary rows).
    const std::int64_t cols = p.numel() / p.shape[0];
    const std::int64_t real =
        (p.name.find("wte") != std::string::npos || p.name.find("embed") != std::string::npos ||
         p.name.find("lm_head") != std::string::npos)
            ? 40 * cols
            : p.numel();
    std::vector<std::int64_t> picks = {
        std::max_element(grad->begin(), grad->begin() + real,
                         [](float a, float b) { return std::fabs(a) < std::fabs(b); }) -
        grad->begin()};
    for (int k = 0; k < 3; ++k)
      picks.push_back(static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(real)));
    for (std::int64_t e : picks) {
      std::vector<float> w = *value;
      w[static_cast<std::size_t>(e)] = (*value)[static_cast<std::size_t>(e)] + h;
      STRATA_ASSERT_OK(tr.set_param(static_cast<int>(i), w));
      auto up = tr.loss(inputs, targets);
      w[static_cast<std::size_t>(e)] = (*value)[static_cast<std::size_t>(e)] - h;
      STRATA_ASSERT_OK(tr.set_param(static_cast<int>(i), w));
      auto down = tr.loss(inputs, targets);
      ASSERT_TRUE(up.ok() && down.ok());
      const double fd = (*up - *down) / (2.0 * h);
      const double an = (*grad)[static_cast<std::size_t>(e)];
      EXPECT_NEAR(fd, an, 2e-4 + 2e-2 * std::fabs(an)) << p.name << "[" << e << "]";
      ++checked;
    }
    STRATA_ASSERT_OK(tr.set_param(static_cast<int>(i), *value));
  }
  EXPECT_GT(checked, 40);
  // Padded vocabulary rows never receive gradient.
  const int head = layout.find(kind == ModelKind::kGpt2 ? "wte.weight" : "lm_head.weight");
  auto g = tr.model().download_grad(head);
  ASSERT_TRUE(g.ok());
  EXPECT_TRUE(std::all_of(g->begin() + 40 * 16, g->end(), [](float v) { return v == 0.0f; }));
}

TEST(ModelGradcheck, Gpt2MatchesFiniteDifferences) { check_gradients(ModelKind::kGpt2); }

TEST(ModelGradcheck, LlamaMatchesFiniteDifferences) { check_gradients(ModelKind::kLlama); }

std::vector<std::vector<float>> all_grads(ModelKind kind, bool checkpointing, DType dtype) {
  auto device = make_device();
  TrainerConfig cfg = tiny(kind);
  cfg.model.n_layer = 3;
  cfg.model.activation_checkpointing = checkpointing;
  cfg.model.dtype = dtype;
  cfg.grad_accum = 2;
  auto trainer = Trainer::create(cfg, *device);
  EXPECT_TRUE(trainer.ok()) << trainer.status().to_string();
  std::vector<std::int32_t> inputs, targets;
  make_batch(2 * cfg.micro_batch * cfg.seq_len, 40, 3, inputs, targets);
  auto loss = (*trainer)->loss_and_gradients(inputs, targets);
  EXPECT_TRUE(loss.ok()) << loss.status().to_string();
  std::vector<std::vector<float>> out;
  const auto& layout = (*trainer)->model().layout();
  for (std::size_t i = 0; i < layout.params.size(); ++i) {
    if (!layout.params[i].owns_storage()) continue;
    out.push_back(*(*trainer)->model().download_grad(static_cast<int>(i)));
  }
  return out;
}

TEST(ModelCheckpointing, RecomputeGivesBitwiseIdenticalGradients) {
  for (ModelKind kind : {ModelKind::kGpt2, ModelKind::kLlama}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const auto plain = all_grads(kind, false, dtype);
      const auto ckpt = all_grads(kind, true, dtype);
      ASSERT_EQ(plain.size(), ckpt.size());
      for (std::size_t i = 0; i < plain.size(); ++i) {
        EXPECT_EQ(plain[i], ckpt[i]) << to_string(kind) << " " << to_string(dtype) << " parameter #" << i;
      }
    }
  }
}

TEST(ModelCheckpointing, SavesActivationMemory) {
  TrainerConfig cfg = tiny(ModelKind::kGpt2);
  cfg.model.n_layer = 6;
  std::uint64_t bytes[2] = {0, 0};
  for (int ckpt = 0; ckpt < 2; ++ckpt) {
    auto device = make_device();
    cfg.model.activation_checkpointing = ckpt == 1;
    auto trainer = Trainer::create(cfg, *device);
    ASSERT_TRUE(trainer.ok()) << trainer.status().to_string();
    bytes[ckpt] = (*trainer)->model().activation_bytes();
  }
  EXPECT_LT(bytes[1] * 2, bytes[0]);
}

}  // namespace
}  // namespace strata::testing
