// The C ABI (strata.h): every bad argument is a status with a message naming it, the settings
// struct and a JSON config reach the engine as documented (the C ABI trains to the same bits as
// the C++ OffloadEngine with the same settings), ownership rules are enforced, weights round-trip
// and the error message is per thread.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "harness/harness.hpp"
#include "strata/device.hpp"
#include "strata/offload.hpp"
#include "strata/strata.h"

namespace strata::testing {
namespace {

std::string last_error() { return strata_last_error(); }

#define EXPECT_STATUS(expr, code, needle)                                                     \
  do {                                                                                        \
    const strata_status st_ = (expr);                                                         \
    EXPECT_EQ(st_, code) << #expr << ": " << strata_status_name(st_) << ": " << last_error(); \
    EXPECT_NE(last_error().find(needle), std::string::npos) << #expr << ": " << last_error(); \
  } while (0)

struct DeviceHandle {
  strata_device* d = nullptr;
  DeviceHandle() {
    strata_device_settings s;
    strata_device_settings_init(&s);
    s.memory_bytes = 256ull << 20;
    s.pinned_bytes = 64ull << 20;
    s.compute_threads = 1;
    EXPECT_EQ(strata_device_create(&s, &d), STRATA_OK) << last_error();
  }
  ~DeviceHandle() { EXPECT_EQ(strata_device_destroy(d), STRATA_OK) << last_error(); }
};

struct EngineHandle {
  strata_engine* e = nullptr;
  ~EngineHandle() { strata_engine_destroy(e); }
};

// Two layers of width 96: a block holds ~110k parameters, above the default persistence
// threshold (100k), so with params on NVMe the blocks really move.
strata_engine_settings small_settings() {
  strata_engine_settings s;
  strata_engine_settings_init(&s);
  s.n_layer = 2;
  s.n_embd = 96;
  s.n_head = 4;
  s.vocab_size = 61;
  s.seq_len = 16;
  s.micro_batch = 2;
  s.lr = 3e-3;
  s.seed = 7;
  return s;
}

// Inputs from the first 5 tokens, targets a fixed function of the input: learnable in a few
// steps (the loss starts near ln(vocab) and falls fast).
void batch(std::int64_t vocab, std::size_t n, int step, std::vector<std::int32_t>& in,
           std::vector<std::int32_t>& tg) {
  in.resize(n);
  tg.resize(n);
  std::mt19937 rng(500u + static_cast<unsigned>(step));
  for (std::size_t i = 0; i < n; ++i) {
    in[i] = static_cast<std::int32_t>(rng() % 5u);
    tg[i] = static_cast<std::int32_t>((in[i] * 3 + 1) % vocab);
  }
}

TEST(CApi, VersionAndStatusNames) {
  int major = -1, minor = -1, patch = -1;
  const std::string v = strata_version(&major, &minor, &patch);
  EXPECT_EQ(v, std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch));
  EXPECT_EQ(strata_version(nullptr, nullptr, nullptr), v);
  EXPECT_EQ(strata_c_api_version(), STRATA_C_API_VERSION);
  EXPECT_STREQ(strata_status_name(STRATA_OK), "OK");
  EXPECT_STREQ(strata_status_name(STRATA_UNAVAILABLE), "UNAVAILABLE");
  EXPECT_STREQ(strata_status_name(-3), "UNKNOWN");
  // The C codes are the C++ codes.
  EXPECT_EQ(static_cast<int>(StatusCode::kFailedPrecondition), STRATA_FAILED_PRECONDITION);
  EXPECT_EQ(static_cast<int>(StatusCode::kDataLoss), STRATA_DATA_LOSS);
}

TEST(CApi, NullArgumentsAreNamed) {
  DeviceHandle dev;
  ASSERT_NE(dev.d, nullptr);
  strata_engine* e = nullptr;
  EXPECT_STATUS(strata_device_create(nullptr, nullptr), STRATA_INVALID_ARGUMENT, "'out'");
  EXPECT_STATUS(strata_device_name(nullptr, nullptr), STRATA_INVALID_ARGUMENT, "'device'");
  EXPECT_STATUS(strata_engine_create(nullptr, nullptr, nullptr, &e), STRATA_INVALID_ARGUMENT, "'device'");
  EXPECT_STATUS(strata_engine_create(dev.d, nullptr, nullptr, nullptr), STRATA_INVALID_ARGUMENT, "'out'");
  EXPECT_EQ(e, nullptr);

  strata_engine_settings s = small_settings();
  EngineHandle eng;
  ASSERT_EQ(strata_engine_create(dev.d, &s, nullptr, &eng.e), STRATA_OK) << last_error();
  std::vector<std::int32_t> tok(32, 1);
  strata_step_result r{};
  strata_eval_result er{};
  strata_stats st{};
  strata_engine_shape sh{};
  EXPECT_STATUS(strata_engine_step(nullptr, tok.data(), tok.data(), 32, &r), STRATA_INVALID_ARGUMENT,
                "'engine'");
  EXPECT_STATUS(strata_engine_step(eng.e, nullptr, tok.data(), 32, &r), STRATA_INVALID_ARGUMENT, "'inputs'");
  EXPECT_STATUS(strata_engine_step(eng.e, tok.data(), nullptr, 32, &r), STRATA_INVALID_ARGUMENT, "'targets'");
  EXPECT_STATUS(strata_engine_step(eng.e, tok.data(), tok.data(), 32, nullptr), STRATA_INVALID_ARGUMENT,
                "'out'");
  EXPECT_STATUS(strata_engine_evaluate(eng.e, nullptr, 32, 0, &er), STRATA_INVALID_ARGUMENT, "'tokens'");
  EXPECT_STATUS(strata_engine_evaluate(eng.e, tok.data(), 32, 0, nullptr), STRATA_INVALID_ARGUMENT, "'out'");
  EXPECT_STATUS(strata_engine_save_weights(eng.e, nullptr), STRATA_INVALID_ARGUMENT, "'path'");
  EXPECT_STATUS(strata_engine_save_weights(eng.e, ""), STRATA_INVALID_ARGUMENT, "'path' is empty");
  EXPECT_STATUS(strata_engine_load_weights(nullptr, "x"), STRATA_INVALID_ARGUMENT, "'engine'");
  EXPECT_STATUS(strata_engine_get_stats(eng.e, nullptr), STRATA_INVALID_ARGUMENT, "'out'");
  EXPECT_STATUS(strata_engine_get_stats(nullptr, &st), STRATA_INVALID_ARGUMENT, "'engine'");
  EXPECT_STATUS(strata_engine_get_shape(eng.e, nullptr), STRATA_INVALID_ARGUMENT, "'out'");
  EXPECT_STATUS(strata_engine_get_shape(nullptr, &sh), STRATA_INVALID_ARGUMENT, "'engine'");
  EXPECT_STATUS(strata_engine_synchronize(nullptr), STRATA_INVALID_ARGUMENT, "'engine'");
  // Every failing call names its function.
  EXPECT_STATUS(strata_engine_get_shape(nullptr, &sh), STRATA_INVALID_ARGUMENT, "strata_engine_get_shape: ");
}

TEST(CApi, BadSettingsNameTheField) {
  DeviceHandle dev;
  TempDir dir("strata-capi");
  struct Case {
    const char* what;
    void (*edit)(strata_engine_settings&);
    strata_status code;
    const char* needle;
  };
  const Case cases[] = {
      {"model", [](strata_engine_settings& s) { s.model = "gpt3"; }, STRATA_INVALID_ARGUMENT,
       "settings.model"},
      {"params tier", [](strata_engine_settings& s) { s.params_tier = "ssd"; }, STRATA_INVALID_ARGUMENT,
       "settings.params_tier: "},
      {"optimizer tier", [](strata_engine_settings& s) { s.optimizer_tier = "gpu"; }, STRATA_INVALID_ARGUMENT,
       "settings.optimizer_tier: "},
      {"struct size", [](strata_engine_settings& s) { s.struct_size = 8; }, STRATA_INVALID_ARGUMENT,
       "settings.struct_size = 8"},
      {"width", [](strata_engine_settings& s) { s.n_embd = 90; }, STRATA_INVALID_ARGUMENT,
       "settings.n_embd = 90 is not a multiple of settings.n_head = 4"},
      {"layers", [](strata_engine_settings& s) { s.n_layer = 0; }, STRATA_INVALID_ARGUMENT,
       "settings.n_layer = 0"},
      {"batch", [](strata_engine_settings& s) { s.micro_batch = -2; }, STRATA_INVALID_ARGUMENT,
       "settings.micro_batch = -2"},
      {"lr", [](strata_engine_settings& s) { s.lr = 0; }, STRATA_INVALID_ARGUMENT, "settings.lr"},
      {"warmup", [](strata_engine_settings& s) { s.warmup_steps = 10, s.total_steps = 5; },
       STRATA_INVALID_ARGUMENT, "settings.warmup_steps = 10 exceeds settings.total_steps = 5"},
      {"nvme without a path",
       [](strata_engine_settings& s) {
         s.params_tier = "nvme";
         s.optimizer_tier = "host";
       },
       STRATA_INVALID_ARGUMENT, "settings.nvme_path"},
      {"nvme path missing",
       [](strata_engine_settings& s) {
         s.optimizer_tier = "nvme";
         s.nvme_path = "/nonexistent/strata-swap";
       },
       STRATA_NOT_FOUND, "nvme_path '/nonexistent/strata-swap' is not an existing directory"},
      {"params off device, optimizer on it", [](strata_engine_settings& s) { s.params_tier = "host"; },
       STRATA_INVALID_ARGUMENT, "set optimizer_tier to 'host' or 'nvme'"},
  };
  for (const Case& c : cases) {
    strata_engine_settings s = small_settings();
    c.edit(s);
    strata_engine* e = nullptr;
    EXPECT_STATUS(strata_engine_create(dev.d, &s, nullptr, &e), c.code, c.needle);
    EXPECT_EQ(e, nullptr) << c.what;
  }
  // A refused create leaves the device free for the next engine.
  strata_engine_settings s = small_settings();
  EngineHandle ok;
  EXPECT_EQ(strata_engine_create(dev.d, &s, nullptr, &ok.e), STRATA_OK) << last_error();

  strata_device_settings ds;
  strata_device_settings_init(&ds);
  ds.kind = "tpu";
  strata_device* d = nullptr;
  EXPECT_STATUS(strata_device_create(&ds, &d), STRATA_INVALID_ARGUMENT, "settings.kind: device 'tpu'");
  ds.kind = "cpu";
  ds.compute_threads = -1;
  EXPECT_STATUS(strata_device_create(&ds, &d), STRATA_INVALID_ARGUMENT, "settings.compute_threads = -1");
  EXPECT_EQ(d, nullptr);
}

TEST(CApi, CudaDeviceIsAcceptedByNameAndRefusedClearlyWithoutAGpu) {
  strata_device_settings ds;
  strata_device_settings_init(&ds);
  ds.kind = "cuda";
  ds.memory_bytes = 64ull << 20;
  strata_device* d = nullptr;
  const strata_status st = strata_device_create(&ds, &d);
  if (cuda_device_count() > 0) {
    EXPECT_EQ(st, STRATA_OK) << last_error();
    EXPECT_EQ(strata_device_destroy(d), STRATA_OK);
  } else {
    EXPECT_TRUE(st == STRATA_UNAVAILABLE || st == STRATA_DEVICE_ERROR) << strata_status_name(st);
    EXPECT_NE(last_error().find("cuda"), std::string::npos) << last_error();
    EXPECT_EQ(d, nullptr);
  }
}

TEST(CApi, BadJsonConfigNamesTheKey) {
  DeviceHandle dev;
  strata_engine_settings s = small_settings();
  strata_engine* e = nullptr;
  EXPECT_STATUS(strata_engine_create(dev.d, &s, "{\"optimizer\": ", &e), STRATA_INVALID_ARGUMENT,
                "json_config:");
  EXPECT_STATUS(strata_engine_create(dev.d, &s, R"({"gradient_clip": 1.0})", &e), STRATA_INVALID_ARGUMENT,
                "gradient_clip");
  EXPECT_STATUS(
      strata_engine_create(dev.d, &s, R"({"zero_optimization": {"offload_param": {"device": "disk"}}})", &e),
      STRATA_INVALID_ARGUMENT, "zero_optimization.offload_param.device");
  EXPECT_EQ(e, nullptr);
}

TEST(CApi, JsonConfigAppliesOnTopOfTheSettings) {
  DeviceHandle dev;
  TempDir dir("strata-capi");
  strata_engine_settings s = small_settings();
  s.params_tier = "nvme";
  s.optimizer_tier = "host";
  const std::string path = dir.path().string();
  s.nvme_path = path.c_str();
  // The batch sizes come from the config; zero_optimization has no offload_* sections, so the
  // tiers and swap directory stay the struct's, and threshold 0 makes every module move.
  EngineHandle eng;
  ASSERT_EQ(strata_engine_create(dev.d, &s,
                                 R"({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
                    "zero_optimization": {"stage3_param_persistence_threshold": 0}})",
                                 &eng.e),
            STRATA_OK)
      << last_error();
  strata_engine_shape shape{};
  ASSERT_EQ(strata_engine_get_shape(eng.e, &shape), STRATA_OK);
  EXPECT_EQ(shape.micro_batch, 3);
  EXPECT_EQ(shape.grad_accum, 2);
  EXPECT_EQ(shape.seq_len, 16);
  EXPECT_EQ(shape.vocab_size, 61);
  EXPECT_EQ(shape.tokens_per_step, 2 * 3 * 16);
  strata_stats st{};
  ASSERT_EQ(strata_engine_get_stats(eng.e, &st), STRATA_OK);
  EXPECT_GT(st.plan_nvme_bytes, 0u);
  EXPECT_EQ(st.steps, 0);

  std::vector<std::int32_t> in, tg;
  batch(61, 96, 0, in, tg);
  strata_step_result r{};
  EXPECT_STATUS(strata_engine_step(eng.e, in.data(), tg.data(), 32, &r), STRATA_INVALID_ARGUMENT,
                "n_tokens = 32, expected grad_accum (2) x micro_batch (3) x seq_len (16) = 96");
  ASSERT_EQ(strata_engine_step(eng.e, in.data(), tg.data(), 96, &r), STRATA_OK) << last_error();
  ASSERT_EQ(strata_engine_get_stats(eng.e, &st), STRATA_OK);
  EXPECT_EQ(st.steps, 1);
  EXPECT_EQ(r.tokens, 96);
  // Threshold 0: the embedding modules move too, so parameters were read back from NVMe.
  EXPECT_GT(st.bytes_nvme_read, 0u);
  // A token outside the vocabulary is the engine's error, passed through.
  in[5] = 61;
  EXPECT_STATUS(strata_engine_step(eng.e, in.data(), tg.data(), 96, &r), STRATA_INVALID_ARGUMENT,
                "input token 61 at position 5 is outside the vocabulary");
}

// fp16 through the JSON: the step result carries the loss scale and the skip. A scale of 2^40
// overflows the first step's gradients, so it is skipped and the next step runs at half the scale;
// once the scale has come down, steps apply (skipped 0) and the loss falls.
TEST(CApi, StepResultReportsTheFp16LossScaleAndSkips) {
  DeviceHandle dev;
  strata_engine_settings s = small_settings();
  EngineHandle eng;
  ASSERT_EQ(strata_engine_create(dev.d, &s, R"({"fp16": {"enabled": true, "initial_scale_power": 40, "hysteresis": 1}})",
                                 &eng.e),
            STRATA_OK)
      << last_error();
  std::vector<std::int32_t> in, tg;
  batch(61, 32, 0, in, tg);
  strata_step_result r{};
  ASSERT_EQ(strata_engine_step(eng.e, in.data(), tg.data(), 32, &r), STRATA_OK) << last_error();
  EXPECT_DOUBLE_EQ(r.loss_scale, std::ldexp(1.0, 40));
  EXPECT_EQ(r.skipped, 1);
  EXPECT_FALSE(std::isfinite(r.grad_norm));
  ASSERT_EQ(strata_engine_step(eng.e, in.data(), tg.data(), 32, &r), STRATA_OK) << last_error();
  EXPECT_DOUBLE_EQ(r.loss_scale, std::ldexp(1.0, 39));
  int applied = 0;
  double first_applied_loss = 0, last_loss = 0;
  for (int i = 0; i < 40 && applied < 6; ++i) {
    ASSERT_EQ(strata_engine_step(eng.e, in.data(), tg.data(), 32, &r), STRATA_OK) << last_error();
    ASSERT_TRUE(r.skipped == 0 || r.skipped == 1) << r.skipped;
    if (r.skipped == 0) {
      EXPECT_TRUE(std::isfinite(r.grad_norm));
      EXPECT_LT(r.loss_scale, std::ldexp(1.0, 39));
      if (applied == 0) first_applied_loss = r.loss;
      last_loss = r.loss;
      ++applied;
    }
  }
  ASSERT_EQ(applied, 6) << "the scale never came down";
  EXPECT_LT(last_loss, first_applied_loss);
}

// An optimizer section in the JSON sets the learning rate with or without the struct's warmup.
TEST(CApi, JsonOptimizerSectionSetsTheLearningRate) {
  for (const std::int64_t warmup : {0, 4}) {
    DeviceHandle dev;
    strata_engine_settings s = small_settings();
    s.warmup_steps = warmup;
    EngineHandle eng;
    ASSERT_EQ(strata_engine_create(dev.d, &s, R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.002}}})",
                                   &eng.e),
              STRATA_OK)
        << last_error();
    std::vector<std::int32_t> in, tg;
    strata_step_result r{};
    for (int i = 0; i <= warmup; ++i) {
      batch(61, 32, i, in, tg);
      ASSERT_EQ(strata_engine_step(eng.e, in.data(), tg.data(), 32, &r), STRATA_OK) << last_error();
    }
    // After the warmup (linear from 0 over `warmup` steps) the rate is the config's, not the struct's.
    EXPECT_DOUBLE_EQ(r.lr, 0.002) << "warmup " << warmup;
  }
}

// The C ABI is a thin layer: with the same settings it trains to the same bits as the C++ engine.
TEST(CApi, TrainsLikeTheCppEngineWithParamsOnNvme) {
  TempDir dir("strata-capi");
  const std::string path = dir.path().string();
  constexpr int kSteps = 8;
  std::vector<std::int32_t> in, tg;
  const std::size_t n = 2 * 16;

  std::vector<double> c_losses, c_norms;
  strata_stats st{};
  {
    DeviceHandle dev;
    strata_engine_settings s = small_settings();
    s.params_tier = "nvme";
    s.optimizer_tier = "host";
    s.nvme_path = path.c_str();
    EngineHandle eng;
    ASSERT_EQ(strata_engine_create(dev.d, &s, nullptr, &eng.e), STRATA_OK) << last_error();
    for (int i = 0; i < kSteps; ++i) {
      batch(61, n, i, in, tg);
      strata_step_result r{};
      ASSERT_EQ(strata_engine_step(eng.e, in.data(), tg.data(), n, &r), STRATA_OK) << last_error();
      EXPECT_EQ(r.step, i + 1);
      EXPECT_EQ(r.lr, 3e-3);  // warmup 0, total_steps 0: constant
      c_losses.push_back(r.loss);
      c_norms.push_back(r.grad_norm);
    }
    // Updates (and their traffic) may still be in flight after a step: wait, then read.
    ASSERT_EQ(strata_engine_synchronize(eng.e), STRATA_OK) << last_error();
    ASSERT_EQ(strata_engine_get_stats(eng.e, &st), STRATA_OK);
  }

  DeviceConfig dc;
  dc.memory_bytes = 256ull << 20;
  dc.pinned_bytes = 64ull << 20;
  dc.compute_threads = 1;
  auto device = Device::create(dc);
  ASSERT_TRUE(device.ok()) << device.status().to_string();
  TrainerConfig tc;
  tc.model.kind = ModelKind::kGpt2;
  tc.model.n_layer = 2;
  tc.model.n_embd = 96;
  tc.model.n_head = 4;
  tc.model.vocab_size = 61;
  tc.model.n_positions = 16;
  tc.seq_len = 16;
  tc.micro_batch = 2;
  tc.grad_accum = 1;
  tc.optimizer.lr = 3e-3;
  tc.optimizer.weight_decay = 0.0;
  tc.grad_clip = 1.0;
  tc.seed = 7;
  tc.schedule.kind = LrScheduleKind::kConstant;
  tc.schedule.lr = 3e-3;
  OffloadSettings os;
  os.params = Tier::kNvme;
  os.optimizer = Tier::kHost;
  os.nvme_path = {path};
  os.io.nvme_path = os.nvme_path;
  auto engine = OffloadEngine::create(tc, os, **device);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  for (int i = 0; i < kSteps; ++i) {
    batch(61, n, i, in, tg);
    auto m = (*engine)->step(in, tg);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    EXPECT_EQ(m->loss, c_losses[static_cast<std::size_t>(i)]) << "step " << i + 1;
    EXPECT_EQ(m->grad_norm, c_norms[static_cast<std::size_t>(i)]) << "step " << i + 1;
  }
  // The task is learnable: eight steps bring the loss from about ln(61) = 4.11 to about 1.3.
  EXPECT_LT(c_losses.back(), c_losses.front() - 1.5);

  STRATA_ASSERT_OK((*engine)->synchronize());
  const OffloadStats cs = (*engine)->stats();
  EXPECT_EQ(st.steps, kSteps);
  EXPECT_EQ(st.bytes_nvme_read, cs.bytes_nvme_read);
  EXPECT_EQ(st.bytes_nvme_written, cs.bytes_nvme_written);
  EXPECT_EQ(st.bytes_h2d, cs.bytes_h2d);
  EXPECT_EQ(st.param_accesses, cs.param_accesses);
  EXPECT_EQ(st.prefetch_hits, cs.prefetch_hits);
  EXPECT_EQ(st.prefetch_hit_rate, cs.hit_rate());
  // C API version 4: the early fetch's hits (every step after the first, which records the
  // trace, starts on early copies) and the tensor-parallel bytes (none: one process).
  EXPECT_EQ(st.early_fetch_hits, cs.early_fetch_hits);
  EXPECT_GT(st.early_fetch_hits, 0u);
  EXPECT_LE(st.early_fetch_hits, st.prefetch_hits);
  EXPECT_EQ(st.bytes_tp, cs.bytes_tp);
  EXPECT_EQ(st.bytes_tp, 0u);
  EXPECT_EQ(st.plan_nvme_bytes, (*engine)->plan().nvme_bytes);
  // The two blocks live on NVMe and are fetched in every forward and backward.
  EXPECT_GE(st.param_accesses, 4u * kSteps);
  EXPECT_GT(st.bytes_nvme_read, 0u);
}

// The NVMe optimizer's reads during backward reach the C struct (added in C API version 3):
// with 3 pinned buffers the first 2 sub-group reads of each update are issued during backward and
// every update takes them over.
TEST(CApi, EarlyOptimizerReadsAreReported) {
  DeviceHandle dev;
  TempDir dir("strata-capi");
  const std::string path = dir.path().string();
  strata_engine_settings s = small_settings();
  s.optimizer_tier = "nvme";
  s.nvme_path = path.c_str();
  const std::string config = R"({"zero_optimization": {"stage": 2, "sub_group_size": 4097, "offload_optimizer":
      {"device": "nvme", "nvme_path": ")" + path + R"(", "buffer_count": 3}}})";
  EngineHandle eng;
  ASSERT_EQ(strata_engine_create(dev.d, &s, config.c_str(), &eng.e), STRATA_OK) << last_error();
  std::vector<std::int32_t> in, tg;
  constexpr int kSteps = 3;
  for (int i = 0; i < kSteps; ++i) {
    batch(61, 2 * 16, i, in, tg);
    strata_step_result r{};
    ASSERT_EQ(strata_engine_step(eng.e, in.data(), tg.data(), 2 * 16, &r), STRATA_OK) << last_error();
  }
  ASSERT_EQ(strata_engine_synchronize(eng.e), STRATA_OK) << last_error();
  strata_stats st{};
  ASSERT_EQ(strata_engine_get_stats(eng.e, &st), STRATA_OK);
  EXPECT_EQ(st.early_optimizer_reads, 2u * kSteps);
  EXPECT_EQ(st.early_optimizer_reads_dropped, 0u);
}

TEST(CApi, OwnershipRulesAreEnforced) {
  strata_device_settings ds;
  strata_device_settings_init(&ds);
  ds.memory_bytes = 256ull << 20;
  ds.pinned_bytes = 64ull << 20;
  ds.compute_threads = 1;
  strata_device* d = nullptr;
  ASSERT_EQ(strata_device_create(&ds, &d), STRATA_OK) << last_error();
  const char* name = nullptr;
  ASSERT_EQ(strata_device_name(d, &name), STRATA_OK);
  EXPECT_NE(std::string(name).find("cpu"), std::string::npos) << name;
  strata_engine_settings s = small_settings();
  strata_engine* e = nullptr;
  ASSERT_EQ(strata_engine_create(d, &s, nullptr, &e), STRATA_OK) << last_error();
  strata_engine* second = nullptr;
  EXPECT_STATUS(strata_engine_create(d, &s, nullptr, &second), STRATA_FAILED_PRECONDITION,
                "already carries an engine");
  EXPECT_EQ(second, nullptr);
  EXPECT_STATUS(strata_device_destroy(d), STRATA_FAILED_PRECONDITION, "still has 1 engine");
  strata_engine_destroy(e);
  strata_engine_destroy(nullptr);
  EXPECT_EQ(strata_device_destroy(d), STRATA_OK) << last_error();
}

TEST(CApi, WeightsRoundTrip) {
  TempDir dir("strata-capi");
  const std::string weights = (dir / "w.safetensors").string();
  std::vector<std::int32_t> in, tg, eval;
  batch(61, 32, 0, in, tg);
  batch(61, 17 * 4, 99, eval, tg);
  batch(61, 32, 0, in, tg);

  strata_eval_result trained{}, fresh{}, loaded{};
  {
    DeviceHandle dev;
    strata_engine_settings s = small_settings();
    EngineHandle eng;
    ASSERT_EQ(strata_engine_create(dev.d, &s, nullptr, &eng.e), STRATA_OK) << last_error();
    strata_step_result r{};
    for (int i = 0; i < 3; ++i) ASSERT_EQ(strata_engine_step(eng.e, in.data(), tg.data(), 32, &r), STRATA_OK);
    ASSERT_EQ(strata_engine_evaluate(eng.e, eval.data(), eval.size(), 0, &trained), STRATA_OK)
        << last_error();
    EXPECT_EQ(trained.tokens, 4 * 16);
    EXPECT_STATUS(strata_engine_evaluate(eng.e, eval.data(), eval.size(), -1, &fresh),
                  STRATA_INVALID_ARGUMENT, "max_windows = -1");
    ASSERT_EQ(strata_engine_save_weights(eng.e, weights.c_str()), STRATA_OK) << last_error();
    EXPECT_STATUS(strata_engine_save_weights(eng.e, "/nonexistent/dir/w.safetensors"), STRATA_IO_ERROR,
                  "/nonexistent/dir/w.safetensors");
  }
  DeviceHandle dev;
  strata_engine_settings s = small_settings();
  s.seed = 8;  // different initial weights: the load must replace them
  s.params_tier = "host";
  s.optimizer_tier = "host";
  EngineHandle eng;
  ASSERT_EQ(strata_engine_create(dev.d, &s, nullptr, &eng.e), STRATA_OK) << last_error();
  ASSERT_EQ(strata_engine_evaluate(eng.e, eval.data(), eval.size(), 0, &fresh), STRATA_OK) << last_error();
  EXPECT_NE(fresh.loss, trained.loss);
  EXPECT_STATUS(strata_engine_load_weights(eng.e, (dir / "missing.safetensors").c_str()), STRATA_NOT_FOUND,
                "missing.safetensors");
  ASSERT_EQ(strata_engine_load_weights(eng.e, weights.c_str()), STRATA_OK) << last_error();
  ASSERT_EQ(strata_engine_evaluate(eng.e, eval.data(), eval.size(), 0, &loaded), STRATA_OK) << last_error();
  EXPECT_EQ(loaded.loss, trained.loss);
}

TEST(CApi, LastErrorIsPerThread) {
  strata_device* d = nullptr;
  ASSERT_EQ(strata_device_create(nullptr, nullptr), STRATA_INVALID_ARGUMENT);
  const std::string mine = last_error();
  std::string theirs_after_failure, theirs_after_success;
  std::thread other([&] {
    EXPECT_EQ(strata_engine_get_stats(nullptr, nullptr), STRATA_INVALID_ARGUMENT);
    theirs_after_failure = strata_last_error();
    strata_device_settings ds;
    strata_device_settings_init(&ds);
    ds.memory_bytes = 8ull << 20;
    ds.pinned_bytes = 8ull << 20;
    ds.compute_threads = 1;
    EXPECT_EQ(strata_device_create(&ds, &d), STRATA_OK);
    theirs_after_success = strata_last_error();
  });
  other.join();
  EXPECT_EQ(last_error(), mine);  // untouched by the other thread's calls
  EXPECT_NE(mine.find("strata_device_create: argument 'out'"), std::string::npos) << mine;
  EXPECT_NE(theirs_after_failure.find("strata_engine_get_stats: argument 'engine'"), std::string::npos);
  EXPECT_EQ(theirs_after_success, "");
  EXPECT_EQ(strata_device_destroy(d), STRATA_OK);  // handles are not tied to the creating thread
  EXPECT_EQ(last_error(), "");
}

}  // namespace
}  // namespace strata::testing
