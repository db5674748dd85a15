#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>

#include "harness/harness.hpp"
#include "strata/config.hpp"
#include "strata/options.hpp"

namespace strata {
namespace {

// Every test starts with no STRATA_<NAME> variable set, so that the machine's environment cannot
// change the results.
class ConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const auto& d : option_table()) ::unsetenv(Options::env_name(d).c_str());
  }
  void TearDown() override { SetUp(); }
};

Result<Config> parse(const std::string& text, Options* options = nullptr) {
  return parse_config(text, "test.json", options);
}

// The lines of an error message.
std::vector<std::string> lines_of(const Status& s) {
  std::vector<std::string> out;
  std::string line;
  for (char c : s.message() + "\n") {
    if (c == '\n') {
      out.push_back(line);
      line.clear();
    } else {
      line += c;
    }
  }
  return out;
}

// Asserts `text` fails with exactly one error line, equal to "test.json: " + `expected`.
#define EXPECT_ONLY_ERROR(text, expected)                                                \
  do {                                                                                   \
    auto r_ = parse(text);                                                               \
    ASSERT_FALSE(r_.ok()) << "accepted: " << (text);                                     \
    EXPECT_EQ(r_.status().code(), StatusCode::kInvalidArgument);                         \
    EXPECT_EQ(r_.status().message(), std::string("test.json: ") + (expected)) << (text); \
  } while (0)

TEST_F(ConfigTest, EmptyObjectGivesDeepSpeedDefaults) {
  auto r = parse("{}");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const Config& c = *r;
  EXPECT_FALSE(c.train_batch_size.has_value());
  EXPECT_FALSE(c.train_micro_batch_size_per_gpu.has_value());
  EXPECT_FALSE(c.gradient_accumulation_steps.has_value());
  EXPECT_EQ(c.gradient_clipping, 0.0);
  EXPECT_EQ(c.steps_per_print, 10);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.loss_scale, 0.0);
  EXPECT_EQ(c.fp16.initial_scale_power, 16);
  EXPECT_EQ(c.fp16.loss_scale_window, 1000);
  EXPECT_EQ(c.fp16.hysteresis, 2);
  EXPECT_EQ(c.fp16.min_loss_scale, 1.0);
  EXPECT_FALSE(c.bf16.enabled);
  const ZeroConfig& z = c.zero_optimization;
  EXPECT_EQ(z.stage, 0);
  EXPECT_TRUE(z.contiguous_gradients);
  EXPECT_FALSE(z.overlap_comm);
  EXPECT_EQ(z.reduce_bucket_size, 500'000'000);
  EXPECT_EQ(z.allgather_bucket_size, 500'000'000);
  EXPECT_TRUE(z.reduce_scatter);
  EXPECT_EQ(z.sub_group_size, 1'000'000'000);
  EXPECT_EQ(z.stage3_prefetch_bucket_size, 50'000'000);
  EXPECT_EQ(z.stage3_param_persistence_threshold, 100'000);
  EXPECT_EQ(z.stage3_max_live_parameters, 1'000'000'000);
  EXPECT_EQ(z.stage3_max_reuse_distance, 1'000'000'000);
  EXPECT_FALSE(z.stage3_gather_16bit_weights_on_model_save);
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kNone);
  EXPECT_EQ(z.offload_param.buffer_count, 5);
  EXPECT_EQ(z.offload_param.buffer_size, 100'000'000);
  EXPECT_EQ(z.offload_param.max_in_cpu, 1'000'000'000);
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kNone);
  EXPECT_EQ(z.offload_optimizer.buffer_count, 4);
  EXPECT_EQ(z.offload_optimizer.ratio, 1.0);
  EXPECT_EQ(c.aio.block_size, 1u << 20);
  EXPECT_EQ(c.aio.queue_depth, 8);
  EXPECT_EQ(c.aio.intra_op_parallelism, 1);
  EXPECT_FALSE(c.aio.single_submit);
  EXPECT_TRUE(c.aio.overlap_events);
  EXPECT_EQ(c.aio.backend, AioBackend::kAuto);
  EXPECT_TRUE(c.aio.nvme_path.empty());
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdam);
  EXPECT_EQ(c.optimizer.lr, 1e-3);
  EXPECT_EQ(c.optimizer.betas[0], 0.9);
  EXPECT_EQ(c.optimizer.betas[1], 0.999);
  EXPECT_EQ(c.optimizer.eps, 1e-8);
  EXPECT_TRUE(c.optimizer.adam_w_mode);
  EXPECT_EQ(c.scheduler.type, SchedulerType::kNone);
  for (const auto& d : option_table()) EXPECT_EQ(c.strata.source(d.id), "default") << d.name;
  EXPECT_EQ(c.source, "test.json");
  // A default-constructed Config is the same configuration.
  EXPECT_EQ(to_json(Config{}), to_json(c));
}

TEST_F(ConfigTest, StageThreeTurnsOverlapCommOnUnlessSaidOtherwise) {
  EXPECT_TRUE(parse(R"({"zero_optimization": {"stage": 3}})")->zero_optimization.overlap_comm);
  EXPECT_FALSE(parse(R"({"zero_optimization": {"stage": 2}})")->zero_optimization.overlap_comm);
  EXPECT_FALSE(
      parse(R"({"zero_optimization": {"stage": 3, "overlap_comm": false}})")->zero_optimization.overlap_comm);
}

constexpr const char* kFullConfig = R"({
  "train_batch_size": 64,
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 2,
  "gradient_clipping": 1.0,
  "steps_per_print": 50,
  "fp16": {
    "enabled": true, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
    "hysteresis": 3, "consecutive_hysteresis": true, "min_loss_scale": 0.5
  },
  "bf16": {"enabled": false},
  "zero_optimization": {
    "stage": 3,
    "contiguous_gradients": false,
    "overlap_comm": false,
    "reduce_bucket_size": 5e7,
    "allgather_bucket_size": 200000000,
    "allgather_partitions": false,
    "reduce_scatter": false,
    "sub_group_size": 1e8,
    "stage3_prefetch_bucket_size": 1.5e7,
    "stage3_param_persistence_threshold": 1e4,
    "stage3_max_live_parameters": 3e8,
    "stage3_max_reuse_distance": 2e8,
    "stage3_gather_16bit_weights_on_model_save": true,
    "offload_param": {
      "device": "nvme", "nvme_path": "/mnt/nvme0", "pin_memory": true, "buffer_count": 6,
      "buffer_size": 2e8, "max_in_cpu": 5e8
    },
    "offload_optimizer": {
      "device": "cpu", "nvme_path": "/mnt/nvme1", "pin_memory": true, "buffer_count": 8,
      "fast_init": true, "ratio": 0.5
    }
  },
  "aio": {
    "block_size": "4MiB", "queue_depth": 32, "thread_count": 2, "single_submit": true,
    "overlap_events": false, "backend": "libaio", "nvme_path": ["/mnt/nvme0", "/mnt/nvme1"]
  },
  "optimizer": {
    "type": "adamw",
    "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}
  },
  "scheduler": {
    "type": "WarmupDecayLR",
    "params": {"warmup_min_lr": 1e-6, "warmup_max_lr": 3e-4, "warmup_num_steps": 100,
               "warmup_type": "linear", "total_num_steps": 1000}
  },
  "strata": {"device": "cpu", "device_memory": "1GiB", "pinned_memory": 67108864, "host_threads": 3,
             "log_level": "info"}
})";

TEST_F(ConfigTest, FullDeepSpeedConfigIsReadAndRoundTrips) {
  auto r = parse(kFullConfig);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const Config& c = *r;
  EXPECT_EQ(c.train_batch_size, 64);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(c.gradient_accumulation_steps, 2);
  EXPECT_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.steps_per_print, 50);
  EXPECT_TRUE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.initial_scale_power, 12);
  EXPECT_EQ(c.fp16.loss_scale_window, 500);
  EXPECT_EQ(c.fp16.hysteresis, 3);
  EXPECT_TRUE(c.fp16.consecutive_hysteresis);
  EXPECT_EQ(c.fp16.min_loss_scale, 0.5);
  const ZeroConfig& z = c.zero_optimization;
  EXPECT_EQ(z.stage, 3);
  EXPECT_FALSE(z.contiguous_gradients);
  EXPECT_FALSE(z.overlap_comm);
  EXPECT_EQ(z.reduce_bucket_size, 50'000'000);  // 5e7 written as a JSON float
  EXPECT_EQ(z.allgather_bucket_size, 200'000'000);
  EXPECT_FALSE(z.allgather_partitions);
  EXPECT_FALSE(z.reduce_scatter);
  EXPECT_EQ(z.sub_group_size, 100'000'000);
  EXPECT_EQ(z.stage3_prefetch_bucket_size, 15'000'000);
  EXPECT_EQ(z.stage3_param_persistence_threshold, 10'000);
  EXPECT_EQ(z.stage3_max_live_parameters, 300'000'000);
  EXPECT_EQ(z.stage3_max_reuse_distance, 200'000'000);
  EXPECT_TRUE(z.stage3_gather_16bit_weights_on_model_save);
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(z.offload_param.nvme_path, "/mnt/nvme0");
  EXPECT_TRUE(z.offload_param.pin_memory);
  EXPECT_EQ(z.offload_param.buffer_count, 6);
  EXPECT_EQ(z.offload_param.buffer_size, 200'000'000);
  EXPECT_EQ(z.offload_param.max_in_cpu, 500'000'000);
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(z.offload_optimizer.nvme_path, "/mnt/nvme1");
  EXPECT_EQ(z.offload_optimizer.buffer_count, 8);
  EXPECT_TRUE(z.offload_optimizer.fast_init);
  EXPECT_EQ(z.offload_optimizer.ratio, 0.5);
  EXPECT_EQ(c.aio.block_size, 4u << 20);
  EXPECT_EQ(c.aio.queue_depth, 32);
  EXPECT_EQ(c.aio.intra_op_parallelism, 2);  // via the thread_count alias
  EXPECT_TRUE(c.aio.single_submit);
  EXPECT_FALSE(c.aio.overlap_events);
  EXPECT_EQ(c.aio.backend, AioBackend::kLibaio);
  EXPECT_EQ(c.aio.nvme_path, (std::vector<std::string>{"/mnt/nvme0", "/mnt/nvme1"}));
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdamW);  // type is case-insensitive
  EXPECT_EQ(c.optimizer.lr, 3e-4);
  EXPECT_EQ(c.optimizer.betas[0], 0.8);
  EXPECT_EQ(c.optimizer.betas[1], 0.95);
  EXPECT_EQ(c.optimizer.eps, 1e-6);
  EXPECT_EQ(c.optimizer.weight_decay, 0.1);
  EXPECT_EQ(c.scheduler.type, SchedulerType::kWarmupDecayLR);
  EXPECT_EQ(c.scheduler.warmup_min_lr, 1e-6);
  EXPECT_EQ(c.scheduler.warmup_max_lr, 3e-4);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 100);
  EXPECT_EQ(c.scheduler.warmup_type, WarmupType::kLinear);
  EXPECT_EQ(c.scheduler.total_num_steps, 1000);
  EXPECT_EQ(c.strata.get_bytes(Option::kDeviceMemory), 1ull << 30);
  EXPECT_EQ(c.strata.source(Option::kDeviceMemory), "config strata.device_memory");
  EXPECT_EQ(c.strata.get_bytes(Option::kPinnedMemory), 64ull << 20);
  EXPECT_EQ(c.strata.get_int(Option::kHostThreads), 3);
  EXPECT_EQ(c.strata.get_string(Option::kLogLevel), "info");

  // The printed config is itself a valid config describing the same settings.
  const std::string printed = to_json(c);
  auto again = parse(printed);
  ASSERT_TRUE(again.ok()) << again.status().to_string() << "\n" << printed;
  EXPECT_EQ(to_json(*again), printed);
  auto j = nlohmann::json::parse(printed);
  EXPECT_EQ(j["zero_optimization"]["offload_param"]["device"], "nvme");
  EXPECT_EQ(j["aio"]["intra_op_parallelism"], 2);
  EXPECT_EQ(j["aio"]["block_size"], 4 << 20);
  EXPECT_EQ(j["optimizer"]["type"], "AdamW");
  EXPECT_EQ(j["strata"]["device_memory"], 1ull << 30);
}

TEST_F(ConfigTest, DefaultsAndEachSchedulerAndOptimizerRoundTrip) {
  for (
      const char* text : {
          "{}",
          R"({"scheduler": {"type": "WarmupLR"}})",
          R"({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2,
               "cos_min_ratio": 0.1, "warmup_min_ratio": 0.01}}})",
          R"({"optimizer": {"type": "Lion"}})",
          R"({"optimizer": {"type": "ADAGRAD", "params": {"lr": 0.05}}})",
          R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}})",
          R"({"train_batch_size": null, "scheduler": null, "fp16": null})",
      }) {
    auto r = parse(text);
    ASSERT_TRUE(r.ok()) << text << ": " << r.status().to_string();
    const std::string printed = to_json(*r);
    auto again = parse(printed);
    ASSERT_TRUE(again.ok()) << again.status().to_string() << "\n" << printed;
    EXPECT_EQ(to_json(*again), printed) << text;
  }
}

TEST_F(ConfigTest, OptimizerDefaultsFollowTheType) {
  auto lion = parse(R"({"optimizer": {"type": "lion"}})");
  ASSERT_TRUE(lion.ok());
  EXPECT_EQ(lion->optimizer.type, OptimizerType::kLion);
  EXPECT_EQ(lion->optimizer.lr, 1e-3);
  EXPECT_EQ(lion->optimizer.betas[1], 0.999);
  auto adagrad = parse(R"({"optimizer": {"type": "Adagrad"}})");
  ASSERT_TRUE(adagrad.ok());
  EXPECT_EQ(adagrad->optimizer.lr, 1e-2);
  EXPECT_EQ(adagrad->optimizer.eps, 1e-10);
  auto cosine = parse(R"({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5000}}})");
  ASSERT_TRUE(cosine.ok());
  EXPECT_EQ(cosine->scheduler.cos_min_ratio, 1e-4);
  EXPECT_EQ(cosine->scheduler.warmup_min_ratio, 0.0);
  EXPECT_EQ(cosine->scheduler.warmup_num_steps, 1000);
  EXPECT_EQ(cosine->scheduler.warmup_type, WarmupType::kLog);
  // The default warmup (1000 steps) must fit in a short run, and the message says it is the default.
  EXPECT_ONLY_ERROR(
      R"({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100}}})",
      "scheduler.params.total_num_steps: expected at least warmup_num_steps (1000, its default), "
      "found 100");
}

TEST_F(ConfigTest, ByteSizesAcceptIntegersAndUnitStrings) {
  EXPECT_EQ(parse(R"({"aio": {"block_size": 8192}})")->aio.block_size, 8192u);
  EXPECT_EQ(parse(R"({"aio": {"block_size": "64KiB"}})")->aio.block_size, 64u << 10);
  EXPECT_EQ(parse(R"({"aio": {"block_size": "2M"}})")->aio.block_size, 2u << 20);
  EXPECT_EQ(parse(R"({"strata": {"pinned_memory": "1.5GiB"}})")->strata.get_bytes(Option::kPinnedMemory),
            3ull << 29);
  EXPECT_EQ(parse(R"({"strata": {"device_memory": 4194304}})")->strata.get_bytes(Option::kDeviceMemory),
            4ull << 20);
}

TEST_F(ConfigTest, AliasesAndPathForms) {
  auto r = parse(R"({"aio": {"nvme_path": "/mnt/a"},
                     "zero_optimization": {"stage3_gather_fp16_weights_on_model_save": true}})");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->aio.nvme_path, std::vector<std::string>{"/mnt/a"});
  EXPECT_TRUE(r->zero_optimization.stage3_gather_16bit_weights_on_model_save);
  EXPECT_EQ(parse(R"({"aio": {"intra_op_parallelism": 4}})")->aio.intra_op_parallelism, 4);
  EXPECT_ONLY_ERROR(
      R"({"aio": {"intra_op_parallelism": 4, "thread_count": 4}})",
      "aio.thread_count: is DeepSpeed's older name for aio.intra_op_parallelism; give only one of them");
}

// ---- One test per error class: each message names the full key path --------------------------

TEST_F(ConfigTest, WrongTypesNameTheKeyTheExpectedAndTheFoundType) {
  EXPECT_ONLY_ERROR(
      R"({"zero_optimization": {"offload_param": {"pin_memory": "maybe"}}})",
      "zero_optimization.offload_param.pin_memory: expected true or false, found string \"maybe\"");
  EXPECT_ONLY_ERROR(R"({"zero_optimization": {"offload_param": {"pin_memory": 2}}})",
                    "zero_optimization.offload_param.pin_memory: expected true or false, found number 2");
  EXPECT_ONLY_ERROR(R"({"zero_optimization": {"stage": "3"}})",
                    "zero_optimization.stage: expected an integer, found string \"3\"");
  EXPECT_ONLY_ERROR(R"({"zero_optimization": {"stage": 2.5}})",
                    "zero_optimization.stage: expected an integer, found 2.5");
  EXPECT_ONLY_ERROR(R"({"fp16": true})", "fp16: expected an object, found boolean true");
  EXPECT_ONLY_ERROR(R"({"gradient_clipping": null})",
                    "gradient_clipping: expected a number >= 0, found null");
  EXPECT_ONLY_ERROR(R"({"zero_optimization": {"reduce_bucket_size": "64MiB"}})",
                    "zero_optimization.reduce_bucket_size: expected an integer count of elements (this size "
                    "counts elements, not bytes), found string \"64MiB\"");
  EXPECT_ONLY_ERROR(
      R"({"zero_optimization": {"stage": "auto"}})",
      "zero_optimization.stage: expected an integer, found string \"auto\" (\"auto\" is accepted only where "
      "the Hugging Face integration fills a value in; see docs/config.md)");
  EXPECT_ONLY_ERROR(R"({"aio": {"nvme_path": 7}})",
                    "aio.nvme_path: expected a string or a list of strings, found number 7");
  EXPECT_ONLY_ERROR(R"({"aio": {"nvme_path": ["/a", false]}})",
                    "aio.nvme_path[1]: expected a string, found boolean false");
  EXPECT_ONLY_ERROR(R"({"aio": {"block_size": true}})",
                    "aio.block_size: expected a byte size (an integer, or a string such as \"1MiB\"), found "
                    "boolean true");
}

TEST_F(ConfigTest, EnumValuesListTheChoices) {
  EXPECT_ONLY_ERROR(
      R"({"zero_optimization": {"offload_param": {"device": "gpu"}}})",
      "zero_optimization.offload_param.device: expected one of \"none\", \"cpu\", \"nvme\", found "
      "\"gpu\"");
  EXPECT_ONLY_ERROR(
      R"({"aio": {"backend": "uring"}})",
      "aio.backend: expected one of \"auto\", \"io_uring\", \"libaio\", \"psync\", found \"uring\"");
  EXPECT_ONLY_ERROR(R"({"optimizer": {"type": "Sophia"}})",
                    "optimizer.type: expected one of \"Adam\", \"AdamW\", \"Lion\", \"Adagrad\" (any case), "
                    "found \"Sophia\"");
  // Optimizers and schedules DeepSpeed has and Strata does not: the key table says what instead.
  EXPECT_ONLY_ERROR(R"({"optimizer": {"type": "SGD"}})",
                    "optimizer.type: \"SGD\" is not supported: SGD is not implemented; use AdamW");
  EXPECT_ONLY_ERROR(
      R"({"scheduler": {"type": "OneCycle"}})",
      "scheduler.type: \"OneCycle\" is not supported: OneCycle is not implemented; use WarmupDecayLR "
      "or WarmupCosineLR");
  EXPECT_ONLY_ERROR(
      R"({"scheduler": {"type": "Cyclic"}})",
      "scheduler.type: expected one of \"WarmupLR\", \"WarmupCosineLR\", \"WarmupDecayLR\", found "
      "\"Cyclic\"");
  // Scheduler names are case-sensitive, as in DeepSpeed.
  EXPECT_FALSE(parse(R"({"scheduler": {"type": "warmuplr"}})").ok());
}

TEST_F(ConfigTest, ArrayElementsAreNamedWithTheirIndex) {
  EXPECT_ONLY_ERROR(R"({"optimizer": {"params": {"betas": [0.9, 1.0]}}})",
                    "optimizer.params.betas[1]: expected a number in [0, 1), found 1.0");
  EXPECT_ONLY_ERROR(R"({"optimizer": {"params": {"betas": ["a", 0.5]}}})",
                    "optimizer.params.betas[0]: expected a number in [0, 1), found string \"a\"");
  EXPECT_ONLY_ERROR(R"({"optimizer": {"params": {"betas": [0.9]}}})",
                    "optimizer.params.betas: expected a list of two numbers [beta1, beta2], found [0.9]");
}

TEST_F(ConfigTest, OutOfRangeValuesNameTheRange) {
  EXPECT_ONLY_ERROR(R"({"zero_optimization": {"stage": 4}})",
                    "zero_optimization.stage: expected an integer in [0, 3], found 4");
  EXPECT_ONLY_ERROR(R"({"zero_optimization": {"stage": -1}})",
                    "zero_optimization.stage: expected an integer in [0, 3], found -1");
  EXPECT_ONLY_ERROR(R"({"aio": {"queue_depth": 0}})",
                    "aio.queue_depth: expected an integer in [1, 32768], found 0");
  EXPECT_ONLY_ERROR(R"({"aio": {"block_size": 5000}})",
                    "aio.block_size: expected a multiple of 4096 bytes, found 5000");
  EXPECT_ONLY_ERROR(R"({"aio": {"block_size": "1KiB"}})",
                    "aio.block_size: expected at least 4096 bytes, found \"1KiB\"");
  EXPECT_ONLY_ERROR(R"({"aio": {"block_size": "4 parsecs"}})",
                    "aio.block_size: expected a byte size (an integer, or a string such as \"1MiB\"), found "
                    "\"4 parsecs\"");
  EXPECT_ONLY_ERROR(R"({"train_micro_batch_size_per_gpu": 0})",
                    "train_micro_batch_size_per_gpu: expected an integer >= 1, found 0");
  EXPECT_ONLY_ERROR(R"({"zero_optimization": {"reduce_bucket_size": 0}})",
                    "zero_optimization.reduce_bucket_size: expected an integer >= 1, found 0");
  EXPECT_ONLY_ERROR(R"({"zero_optimization": {"offload_optimizer": {"ratio": 0}}})",
                    "zero_optimization.offload_optimizer.ratio: expected a number in (0, 1], found 0");
  EXPECT_ONLY_ERROR(R"({"optimizer": {"params": {"eps": 0}}})",
                    "optimizer.params.eps: expected a number > 0, found 0");
  EXPECT_ONLY_ERROR(R"({"gradient_clipping": -1.5})",
                    "gradient_clipping: expected a number >= 0, found -1.5");
  EXPECT_ONLY_ERROR(R"({"fp16": {"initial_scale_power": 64}})",
                    "fp16.initial_scale_power: expected an integer in [0, 63], found 64");
  EXPECT_ONLY_ERROR(R"({"fp16": {"loss_scale_window": 0}})",
                    "fp16.loss_scale_window: expected an integer >= 1, found 0");
  EXPECT_ONLY_ERROR(R"({"fp16": {"loss_scale_window": 1e10}})",
                    "fp16.loss_scale_window: expected an integer in [1, 2147483647], found 10000000000.0");
  EXPECT_ONLY_ERROR(R"({"fp16": {"min_loss_scale": 0}})",
                    "fp16.min_loss_scale: expected a number > 0, found 0");
  EXPECT_ONLY_ERROR(R"({"steps_per_print": 1e30})", "steps_per_print: expected an integer, found 1e+30");
}

TEST_F(ConfigTest, UnknownKeysSuggestTheClosestKeyAtThatLevel) {
  EXPECT_ONLY_ERROR(R"({"zero_optimization": {"stage3_prefetch_bucket": 5e7}})",
                    "zero_optimization.stage3_prefetch_bucket: unknown key; did you mean "
                    "'stage3_prefetch_bucket_size'?");
  EXPECT_ONLY_ERROR(R"({"train_batch_sise": 8})",
                    "train_batch_sise: unknown key; did you mean 'train_batch_size'?");
  EXPECT_ONLY_ERROR(R"({"zero_optimization": {"offload_param": {"pinned_memory": true}}})",
                    "zero_optimization.offload_param.pinned_memory: unknown key; did you mean 'pin_memory'?");
  EXPECT_ONLY_ERROR(R"({"fp16": {"Enabled": true}})", "fp16.Enabled: unknown key; did you mean 'enabled'?");
  EXPECT_ONLY_ERROR(R"({"strata": {"device_memroy": "1GiB"}})",
                    "strata.device_memroy: unknown key; did you mean 'device_memory'?");
  // A key that exists, but in another section.
  EXPECT_ONLY_ERROR(R"({"stage": 3})", "stage: unknown key here; did you mean 'zero_optimization.stage'?");
  // DeepSpeed keys Strata ignores are accepted (and refused under --strict, tested in
  // test_core_config_keys.cpp); misspellings of them are suggested too.
  EXPECT_TRUE(parse(R"({"wall_clock_breakdown": false})").ok());
  EXPECT_ONLY_ERROR(R"({"wall_clock_breakdwn": false})",
                    "wall_clock_breakdwn: unknown key; did you mean 'wall_clock_breakdown'?");
  // Nothing close: the keys of that level are listed.
  EXPECT_ONLY_ERROR(R"({"bf16": {"xyzzy": 1}})", "bf16.xyzzy: unknown key (expected one of: enabled)");
}

TEST_F(ConfigTest, CrossFieldChecks) {
  EXPECT_ONLY_ERROR(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})",
                    "fp16.enabled: true together with bf16.enabled; enable at most one of fp16 and bf16");
  EXPECT_ONLY_ERROR(
      R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})",
      "zero_optimization.offload_param.nvme_path: missing; device \"nvme\" needs a directory here or "
      "in aio.nvme_path");
  EXPECT_ONLY_ERROR(
      R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})",
      "zero_optimization.offload_optimizer.nvme_path: missing; device \"nvme\" needs a directory "
      "here or in aio.nvme_path");
  // aio.nvme_path is enough for both.
  EXPECT_TRUE(parse(R"({"aio": {"nvme_path": ["/mnt/a"]}, "zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}}})")
                  .ok());
  EXPECT_ONLY_ERROR(
      R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})",
      "zero_optimization.offload_param.device: \"cpu\" needs zero_optimization.stage 3 (parameters "
      "are only partitioned in stage 3), found stage 2");
  EXPECT_ONLY_ERROR(
      R"({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})",
      "zero_optimization.offload_optimizer.device: \"cpu\" needs zero_optimization.stage 1, 2 or 3, "
      "found stage 0");
  EXPECT_ONLY_ERROR(
      R"({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
                        "gradient_accumulation_steps": 2})",
      "train_batch_size: expected a multiple of train_micro_batch_size_per_gpu (4) * "
      "gradient_accumulation_steps (2) = 8 (train_batch_size = micro batch * accumulation steps * "
      "data-parallel size), found 30");
  EXPECT_ONLY_ERROR(
      R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})",
      "optimizer.params.adam_w_mode: false contradicts optimizer.type \"AdamW\"; use type \"Adam\" "
      "for L2-coupled decay");
  EXPECT_ONLY_ERROR(R"({"optimizer": {"type": "Lion", "params": {"adam_w_mode": true}}})",
                    "optimizer.params.adam_w_mode: only applies to Adam (optimizer.type is \"Lion\")");
  EXPECT_ONLY_ERROR(R"({"optimizer": {"type": "Adagrad", "params": {"betas": [0.9, 0.99]}}})",
                    "optimizer.params.betas: is not used by Adagrad");
  EXPECT_ONLY_ERROR(R"({"optimizer": {"type": "Lion", "params": {"eps": 1e-8}}})",
                    "optimizer.params.eps: is not used by Lion");
  EXPECT_ONLY_ERROR(
      R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}})",
      "scheduler.params.total_num_steps: missing; WarmupDecayLR needs the total number of training "
      "steps");
  EXPECT_ONLY_ERROR(R"({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10,
                        "total_num_steps": 5}}})",
                    "scheduler.params.total_num_steps: expected at least warmup_num_steps (10), found 5");
  EXPECT_ONLY_ERROR(R"({"scheduler": {"type": "WarmupLR", "params": {"cos_min_ratio": 0.1}}})",
                    "scheduler.params.cos_min_ratio: is a parameter of WarmupCosineLR, not of WarmupLR");
  EXPECT_ONLY_ERROR(
      R"({"scheduler": {"params": {}}})",
      "scheduler.type: missing; expected one of \"WarmupLR\", \"WarmupCosineLR\", \"WarmupDecayLR\"");
  EXPECT_ONLY_ERROR(R"({"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": true,
                        "stage3_gather_fp16_weights_on_model_save": true}})",
                    "zero_optimization.stage3_gather_fp16_weights_on_model_save: is the old name of "
                    "stage3_gather_16bit_weights_on_model_save; give only one of them");
}

TEST_F(ConfigTest, AllErrorsOfAFileAreReportedTogetherOnePerLine) {
  auto r = parse(R"({
    "zero_optimization": {"stage": 7, "offload_param": {"device": "gpu"}, "stage3_prefetch_bucket": 1},
    "aio": {"queue_depth": 0},
    "optimizer": {"params": {"betas": [0.9, 2]}},
    "strata": {"device": "tpu"},
    "fp16": {"enabled": true},
    "bf16": {"enabled": true}
  })");
  ASSERT_FALSE(r.ok());
  const auto lines = lines_of(r.status());
  ASSERT_EQ(lines.size(), 7u) << r.status().message();
  const char* expected_paths[] = {"zero_optimization.stage:",
                                  "zero_optimization.offload_param.device:",
                                  "zero_optimization.stage3_prefetch_bucket:",
                                  "aio.queue_depth:",
                                  "optimizer.params.betas[1]:",
                                  "strata.device:",
                                  "fp16.enabled:"};
  for (size_t i = 0; i < lines.size(); ++i) {
    EXPECT_EQ(lines[i].rfind("test.json: ", 0), 0u) << lines[i];
    EXPECT_NE(lines[i].find(expected_paths[i]), std::string::npos) << lines[i];
  }
}

TEST_F(ConfigTest, InvalidJsonReportsLineAndColumn) {
  // The stray '}' after a trailing comma is on line 4, column 3.
  STRATA_EXPECT_ERROR(parse("{\n  \"zero_optimization\": {\n    \"stage\": 3,\n  }\n}\n"), kInvalidArgument,
                      "test.json:4:3: invalid JSON: syntax error");
  STRATA_EXPECT_ERROR(parse("{\"a\": tru}"), kInvalidArgument, "test.json:1:10: invalid JSON");
  STRATA_EXPECT_ERROR(parse(""), kInvalidArgument, "test.json:1:1: invalid JSON");
  STRATA_EXPECT_ERROR(parse("{\n\n  \"stage\" 3}"), kInvalidArgument, "test.json:3:11: invalid JSON");
  STRATA_EXPECT_ERROR(parse("{\"gradient_clipping\": 1e400}"), kInvalidArgument,
                      "test.json:1:23: invalid JSON: number overflow parsing '1e400'");
  STRATA_EXPECT_ERROR(parse("[1, 2]"), kInvalidArgument,
                      "test.json: expected a JSON object at the top level, found array [1,2]");
}

TEST_F(ConfigTest, DuplicateKeysAreErrors) {
  EXPECT_ONLY_ERROR(
      R"({"zero_optimization": {"stage": 1, "stage": 3}})",
      "zero_optimization.stage: duplicate key (JSON keeps only one of them; remove the others)");
}

TEST_F(ConfigTest, BatchSizesFollowDeepSpeedsRule) {
  auto sizes = [](const std::string& text, std::int64_t dp) {
    auto c = parse(text);
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    return resolve_batch_sizes(*c, dp);
  };
  auto all = sizes(R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
                       "gradient_accumulation_steps": 2})",
                   8);
  ASSERT_TRUE(all.ok()) << all.status().to_string();
  EXPECT_EQ(all->train_batch_size, 64);
  STRATA_EXPECT_ERROR(
      sizes(R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
                                "gradient_accumulation_steps": 2})",
            4),
      kInvalidArgument,
      "train_batch_size (64) != train_micro_batch_size_per_gpu (4) * gradient_accumulation_steps (2) "
      "* data-parallel size (4) = 32");
  auto derive_accum = sizes(R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4})", 4);
  ASSERT_TRUE(derive_accum.ok());
  EXPECT_EQ(derive_accum->gradient_accumulation_steps, 4);
  STRATA_EXPECT_ERROR(sizes(R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4})", 3),
                      kInvalidArgument, "gradient_accumulation_steps cannot be derived");
  auto derive_micro = sizes(R"({"train_batch_size": 64, "gradient_accumulation_steps": 2})", 4);
  ASSERT_TRUE(derive_micro.ok());
  EXPECT_EQ(derive_micro->train_micro_batch_size_per_gpu, 8);
  auto only_batch = sizes(R"({"train_batch_size": 12})", 3);
  ASSERT_TRUE(only_batch.ok());
  EXPECT_EQ(only_batch->train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(only_batch->gradient_accumulation_steps, 1);
  STRATA_EXPECT_ERROR(sizes(R"({"train_batch_size": 12})", 5), kInvalidArgument,
                      "train_batch_size (12) is not divisible by data-parallel size (5)");
  auto derive_batch = sizes(R"({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5})", 2);
  ASSERT_TRUE(derive_batch.ok());
  EXPECT_EQ(derive_batch->train_batch_size, 30);
  auto none = sizes("{}", 4);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->train_batch_size, 4);
  EXPECT_EQ(none->train_micro_batch_size_per_gpu, 1);
  STRATA_EXPECT_ERROR(sizes("{}", 0), kInvalidArgument, "data-parallel size must be at least 1");
}

// ---- The strata section and the precedence default < config < env < CLI ----------------------

TEST_F(ConfigTest, StrataSectionIsAppliedIntoTheCallersOptions) {
  Options options;
  auto r = parse(R"({"strata": {"device_memory": "1GiB", "log_level": "debug"}})", &options);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(options.get_bytes(Option::kDeviceMemory), 1ull << 30);
  EXPECT_EQ(options.source(Option::kDeviceMemory), "config strata.device_memory");
  EXPECT_EQ(options.get_string(Option::kLogLevel), "debug");
  EXPECT_EQ(options.source(Option::kPinnedMemory), "default");
  EXPECT_EQ(r->strata.get_bytes(Option::kDeviceMemory), 1ull << 30);
}

TEST_F(ConfigTest, StrataValuesAreValidatedUnderTheirKeyPath) {
  EXPECT_ONLY_ERROR(R"({"strata": {"device": "tpu"}})",
                    "strata.device: value 'tpu' for option 'device' is not one of: cpu, cuda");
  EXPECT_ONLY_ERROR(
      R"({"strata": {"device_memory": "lots"}})",
      "strata.device_memory: value 'lots' for option 'device_memory' is not a byte size such as "
      "4096, 64KiB or 2GiB");
  EXPECT_ONLY_ERROR(R"({"strata": {"host_threads": "4"}})",
                    "strata.host_threads: expected an integer, found string \"4\"");
  EXPECT_ONLY_ERROR(R"({"strata": {"log_level": 3}})", "strata.log_level: expected a string, found number 3");
  EXPECT_ONLY_ERROR(R"({"strata": []})", "strata: expected an object, found array []");
}

TEST_F(ConfigTest, EnvironmentOverridesTheConfigFile) {
  ::setenv("STRATA_DEVICE_MEMORY", "3GiB", 1);
  Options options;
  auto r = parse(R"({"strata": {"device_memory": "1GiB", "pinned_memory": "64MiB"}})", &options);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(options.get_bytes(Option::kDeviceMemory), 3ull << 30);
  EXPECT_EQ(options.source(Option::kDeviceMemory), "STRATA_DEVICE_MEMORY");
  EXPECT_EQ(options.get_bytes(Option::kPinnedMemory), 64ull << 20);  // not in the environment
  // Without a caller's Options the environment applies too.
  EXPECT_EQ(parse("{}")->strata.get_bytes(Option::kDeviceMemory), 3ull << 30);
}

TEST_F(ConfigTest, ExplicitSettingsOutrankConfigAndEnvironmentWhateverTheCallOrder) {
  ::setenv("STRATA_DEVICE_MEMORY", "3GiB", 1);
  ::setenv("STRATA_PINNED_MEMORY", "32MiB", 1);
  Options options;
  STRATA_ASSERT_OK(options.set(Option::kDeviceMemory, "5GiB", "--device-memory"));
  auto r = parse(R"({"strata": {"device_memory": "1GiB", "pinned_memory": "64MiB", "host_threads": 2}})",
                 &options);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(options.get_bytes(Option::kDeviceMemory), 5ull << 30);  // CLI > env > config
  EXPECT_EQ(options.source(Option::kDeviceMemory), "--device-memory");
  EXPECT_EQ(options.get_bytes(Option::kPinnedMemory), 32ull << 20);  // env > config
  EXPECT_EQ(options.get_int(Option::kHostThreads), 2);               // config > default
  // A second file replaces the first file's values but still not the environment's or the CLI's.
  ASSERT_TRUE(parse(R"({"strata": {"host_threads": 6, "device_memory": "1GiB"}})", &options).ok());
  EXPECT_EQ(options.get_int(Option::kHostThreads), 6);
  EXPECT_EQ(options.get_bytes(Option::kDeviceMemory), 5ull << 30);
}

TEST_F(ConfigTest, BadEnvironmentValuesAreReportedWithTheFileErrors) {
  ::setenv("STRATA_DEVICE_MEMORY", "lots", 1);
  auto r = parse(R"({"zero_optimization": {"stage": 9}})");
  ASSERT_FALSE(r.ok());
  const auto lines = lines_of(r.status());
  ASSERT_EQ(lines.size(), 2u) << r.status().message();
  EXPECT_NE(lines[0].find("zero_optimization.stage"), std::string::npos);
  EXPECT_EQ(lines[1].rfind("environment: STRATA_DEVICE_MEMORY: value 'lots'", 0), 0u) << lines[1];
}

TEST_F(ConfigTest, FailedParseLeavesTheCallersOptionsUntouched) {
  Options options;
  auto r = parse(R"({"strata": {"device_memory": "1GiB"}, "zero_optimization": {"stage": 9}})", &options);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(options.get_bytes(Option::kDeviceMemory), 2ull << 30);
  EXPECT_EQ(options.source(Option::kDeviceMemory), "default");
}

TEST_F(ConfigTest, LoadConfigFileReadsAndNamesTheFile) {
  testing::TempDir dir("strata-config");
  const std::string good = testing::write_file(dir / "good.json", kFullConfig);
  auto r = load_config_file(good);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->source, good);
  // (1 is a boolean to DeepSpeed's loader; 3 is not.)
  const std::string bad = testing::write_file(dir / "bad.json", "{\n  \"fp16\": {\"enabled\": 3}\n}\n");
  STRATA_EXPECT_ERROR(load_config_file(bad), kInvalidArgument,
                      bad + ": fp16.enabled: expected true or false, found number 3");
  const std::string broken = testing::write_file(dir / "broken.json", "{\n  \"fp16\": {\"enabled\": true\n");
  STRATA_EXPECT_ERROR(load_config_file(broken), kInvalidArgument, broken + ":3:1: invalid JSON");
  STRATA_EXPECT_ERROR(load_config_file((dir / "missing.json").string()), kNotFound,
                      "missing.json': No such file or directory");
  STRATA_EXPECT_ERROR(load_config_file(dir.path().string()), kIoError, dir.path().string());
}

}  // namespace
}  // namespace strata
