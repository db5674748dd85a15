// The same training run on the cuda backend as on the cpu backend: the model code, the trainer
// and the CUDA optimizer (src/runtime/optimizer_cuda.cu) against the cpu reference. Skips without
// a GPU.
#include <cmath>

#include "harness/harness.hpp"
#include "strata/data.hpp"
#include "strata/device.hpp"
#include "strata/engine.hpp"

namespace strata::testing {
namespace {

std::vector<double> run(DeviceKind kind, ModelKind model, DType dtype, std::vector<float>* weights) {
  DeviceConfig dc;
  dc.kind = kind;
  dc.memory_bytes = 256ull << 20;
  dc.pinned_bytes = 32ull << 20;
  dc.compute_threads = 1;
  auto device = Device::create(dc);
  EXPECT_TRUE(device.ok()) << device.status().to_string();
  if (!device.ok()) return {};
  TrainerConfig cfg;
  cfg.model.kind = model;
  cfg.model.n_layer = 2;
  cfg.model.n_embd = 64;
  cfg.model.n_head = 4;  // head_dim 16: supported by the cuda attention kernel
  cfg.model.n_kv_head = model == ModelKind::kLlama ? 2 : 0;
  cfg.model.n_positions = 64;
  cfg.model.dtype = dtype;
  cfg.model.activation_checkpointing = true;
  cfg.micro_batch = 4;
  cfg.seq_len = 64;
  cfg.grad_accum = 2;
  cfg.schedule.kind = LrScheduleKind::kConstant;
  cfg.schedule.lr = 2e-3;
  auto trainer = Trainer::create(cfg, **device);
  EXPECT_TRUE(trainer.ok()) << trainer.status().to_string();
  if (!trainer.ok()) return {};
  const Corpus corpus = builtin_corpus(3, 200000);
  auto batcher =
      Batcher::create(make_byte_tokenizer()->encode(corpus.train), cfg.micro_batch, cfg.seq_len, 7);
  std::vector<std::int32_t> inputs, targets, in2, tg2;
  std::vector<double> losses;
  for (int s = 0; s < 10; ++s) {
    batcher->batch(static_cast<std::uint64_t>(2 * s), inputs, targets);
    batcher->batch(static_cast<std::uint64_t>(2 * s + 1), in2, tg2);
    inputs.insert(inputs.end(), in2.begin(), in2.end());
    targets.insert(targets.end(), tg2.begin(), tg2.end());
    auto m = (*trainer)->step(inputs, targets);
    EXPECT_TRUE(m.ok()) << m.status().to_string();
    if (!m.ok()) return {};
    losses.push_back(m->loss);
  }
  auto eval = (*trainer)->evaluate(make_byte_tokenizer()->encode(corpus.validation), 8);
  EXPECT_TRUE(eval.ok()) << eval.status().to_string();
  if (eval.ok()) losses.push_back(eval->loss);
  const int index = (*trainer)->model().layout().find(
      model == ModelKind::kGpt2 ? "h.1.mlp.c_fc.weight" : "model.layers.1.mlp.down_proj.weight");
  *weights = *(*trainer)->model().download_param(index);
  return losses;
}

TEST(GpuModel, TrainingOnCudaFollowsTheCpuRun) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  for (ModelKind model : {ModelKind::kGpt2, ModelKind::kLlama}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      std::vector<float> wc, wg;
      const auto cpu = run(DeviceKind::kCpu, model, dtype, &wc);
      const auto gpu = run(DeviceKind::kCuda, model, dtype, &wg);
      ASSERT_EQ(cpu.size(), gpu.size());
      // Summation orders differ (cuBLASLt, fused attention); the runs stay close, not equal.
      const double tol = dtype == DType::kF32 ? 2e-3 : 2e-2;
      for (std::size_t i = 0; i < cpu.size(); ++i) {
        EXPECT_NEAR(gpu[i], cpu[i], tol * cpu[i]) << to_string(model) << " " << to_string(dtype) << " #" << i;
      }
      ASSERT_EQ(wc.size(), wg.size());
      double diff = 0, norm = 0;
      for (std::size_t i = 0; i < wc.size(); ++i) {
        diff += (wc[i] - wg[i]) * static_cast<double>(wc[i] - wg[i]);
        norm += wc[i] * static_cast<double>(wc[i]);
      }
      EXPECT_LT(std::sqrt(diff / norm), 5 * tol) << to_string(model) << " " << to_string(dtype);
    }
  }
}

}  // namespace
}  // namespace strata::testing
