// DeepSpeed configs as people write them: the corpus under tests/data/ds_configs loads (or is
// refused naming the key), the key table agrees with what the reader reads, honoured keys change
// the resolved TrainerConfig / OffloadSettings, ignored keys are listed once and refused under
// strict mode, "auto" keeps the caller's value, booleans and old spellings are taken as DeepSpeed
// takes them.
#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "core/config_reader.hpp"
#include "harness/harness.hpp"
#include "strata/config.hpp"
#include "strata/engine.hpp"
#include "strata/offload.hpp"
#include "strata/options.hpp"

namespace strata {
namespace {

class ConfigKeysTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const auto& d : option_table()) ::unsetenv(Options::env_name(d).c_str());
  }
  void TearDown() override { SetUp(); }
};

std::string corpus(const std::string& name) {
  return std::string(STRATA_SOURCE_DIR) + "/tests/data/ds_configs/" + name;
}

std::vector<std::string> ignored_paths(const Config& c) {
  std::vector<std::string> out;
  for (const IgnoredKey& k : c.ignored) out.push_back(k.path);
  return out;
}

// The top-level keys, as the CLI passes them to TrainerConfig::apply.
std::vector<std::string> top_keys(const Config& c) {
  std::vector<std::string> out;
  for (const std::string& p : c.present_paths) {
    if (p.find('.') == std::string::npos) out.push_back(p);
  }
  return out;
}

TrainerConfig base_trainer() {
  TrainerConfig t;
  t.model.n_layer = 2;
  t.model.n_embd = 64;
  t.model.n_head = 2;
  t.model.n_positions = 32;
  t.seq_len = 32;
  t.micro_batch = 3;
  t.grad_accum = 1;
  t.optimizer.lr = 7e-4;
  t.schedule.lr = 7e-4;
  t.optimizer.beta2 = 0.95;
  t.optimizer.weight_decay = 0.05;
  t.grad_clip = 0.75;
  return t;
}

// ---- the corpus ------------------------------------------------------------------------------

struct CorpusCase {
  const char* file;
  const char* refused;  // "" = loads and applies; else a substring of the error (the key named)
};

constexpr CorpusCase kCorpus[] = {
    {"zero2_offload_cpu.json", ""},
    {"zero3_offload_cpu.json", ""},
    {"zero3_infinity_nvme.json", ""},
    {"hf_trainer_zero3_auto.json", ""},
    {"hf_trainer_zero2_auto.json", ""},
    {"legacy_zero2_cpu_offload.json", ""},
    {"legacy_fp16_weights_save.json", ""},
    {"monitoring_and_profiling.json", ""},
    {"megatron_style_fp16_off.json", ""},
    {"fp16_dynamic_loss_scaling.json", ""},
    {"refused_fp16_master_weights.json", "fp16.fp16_master_weights_and_grads"},
    {"refused_lamb.json", "optimizer.type: \"Lamb\" is not supported: LAMB is not implemented; use AdamW"},
    {"refused_onebitadam.json", "optimizer.type: \"OneBitAdam\" is not supported"},
    {"misspelt_keys.json",
     "gradient_acumulation_steps: unknown key; did you mean 'gradient_accumulation_steps'?"},
    {"wrong_types.json", "train_micro_batch_size_per_gpu: expected an integer, found string \"eight\""},
};

TEST_F(ConfigKeysTest, EveryCorpusFileLoadsOrIsRefusedNamingTheKey) {
  for (const CorpusCase& c : kCorpus) {
    SCOPED_TRACE(c.file);
    auto config = load_config_file(corpus(c.file));
    Status applied = config.status();
    if (config.ok()) {
      TrainerConfig t = base_trainer();
      applied = t.apply(*config, top_keys(*config));
      if (applied.ok()) {
        OffloadSettings o;
        applied = o.apply(*config);
      }
    }
    if (std::string(c.refused).empty()) {
      EXPECT_TRUE(applied.ok()) << applied.to_string();
    } else {
      ASSERT_FALSE(applied.ok());
      EXPECT_NE(applied.message().find(c.refused), std::string::npos) << applied.message();
      EXPECT_NE(applied.message().find(corpus(c.file)), std::string::npos) << applied.message();
    }
  }
}

// fp16.enabled trains in fp16 with the file's loss-scaler settings; fp16.enabled false leaves
// the dtype alone but still carries the scaler keys (for a --dtype fp16 run).
TEST_F(ConfigKeysTest, Fp16SectionSetsTheDtypeAndTheLossScaler) {
  auto config = load_config_file(corpus("fp16_dynamic_loss_scaling.json"));
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  TrainerConfig t = base_trainer();
  STRATA_ASSERT_OK(t.apply(*config, top_keys(*config)));
  EXPECT_EQ(t.model.dtype, DType::kF16);
  EXPECT_EQ(t.loss_scaling.loss_scale, 0.0);
  EXPECT_EQ(t.loss_scaling.initial_scale_power, 16);
  EXPECT_EQ(t.loss_scaling.loss_scale_window, 1000);
  EXPECT_EQ(t.loss_scaling.hysteresis, 2);
  EXPECT_EQ(t.loss_scaling.min_loss_scale, 1.0);
  STRATA_EXPECT_OK(t.validate());

  auto off = load_config_file(corpus("megatron_style_fp16_off.json"));
  ASSERT_TRUE(off.ok()) << off.status().to_string();
  TrainerConfig u = base_trainer();
  STRATA_ASSERT_OK(u.apply(*off, top_keys(*off)));
  EXPECT_NE(u.model.dtype, DType::kF16);
  EXPECT_EQ(u.loss_scaling.initial_scale_power, 12);
  EXPECT_EQ(u.loss_scaling.loss_scale_window, 500);
}

TEST_F(ConfigKeysTest, RefusedOptimizerIsOneErrorNotOnePerParameter) {
  auto r = load_config_file(corpus("refused_lamb.json"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(std::count(r.status().message().begin(), r.status().message().end(), '\n'), 0)
      << r.status().message();
}

TEST_F(ConfigKeysTest, MisspelltKeysAreAllReportedWithSuggestions) {
  auto r = load_config_file(corpus("misspelt_keys.json"));
  ASSERT_FALSE(r.ok());
  const std::string& m = r.status().message();
  EXPECT_NE(m.find("zero_optimization.offload_param.pin_memroy: unknown key; did you mean 'pin_memory'?"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("zero_optimization.stage3_prefetch_bucket_sise: unknown key; did you mean "
                   "'stage3_prefetch_bucket_size'?"),
            std::string::npos)
      << m;
  // Keys that live only in the table (the reader never reads them) are suggested too.
  auto t = parse_config(R"({"tensorbord": {"enabled": true}})", "t.json");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(), "t.json: tensorbord: unknown key; did you mean 'tensorboard'?");
  auto p = parse_config(R"({"prescale_gradient": false})", "p.json");
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().message(),
            "p.json: prescale_gradient: unknown key; did you mean 'prescale_gradients'?");
}

TEST_F(ConfigKeysTest, WrongTypesNameTheKeyAndTheExpectedType) {
  auto r = load_config_file(corpus("wrong_types.json"));
  ASSERT_FALSE(r.ok());
  const std::string& m = r.status().message();
  for (const char* line :
       {"gradient_clipping: expected a number >= 0, found array [1.0]",
        "zero_optimization.overlap_comm: expected true or false, found string \"sometimes\"",
        "zero_optimization.offload_optimizer.buffer_count: expected an integer, found 4.5",
        "optimizer.params.betas: expected a list of two numbers [beta1, beta2], found number 0.9"}) {
    EXPECT_NE(m.find(line), std::string::npos) << line << "\nin:\n" << m;
  }
}

// ---- honoured keys take effect --------------------------------------------------------------

TEST_F(ConfigKeysTest, ZeroThreeCpuOffloadResolvesEveryHonouredKey) {
  auto c = load_config_file(corpus("zero3_offload_cpu.json"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  TrainerConfig t = base_trainer();
  STRATA_ASSERT_OK(t.apply(*c, top_keys(*c)));
  EXPECT_EQ(t.micro_batch, 4);
  EXPECT_EQ(t.grad_accum, 8);
  EXPECT_EQ(t.grad_clip, 1.0);
  EXPECT_EQ(t.model.dtype, DType::kBF16);
  EXPECT_EQ(t.optimizer.lr, 1e-4);
  EXPECT_EQ(t.optimizer.beta2, 0.999);
  EXPECT_EQ(t.optimizer.weight_decay, 0.0);
  EXPECT_TRUE(t.optimizer.decoupled);
  EXPECT_EQ(t.schedule.kind, LrScheduleKind::kWarmupCosine);
  EXPECT_EQ(t.schedule.warmup_steps, 100);
  EXPECT_EQ(t.schedule.total_steps, 2000);
  EXPECT_FALSE(t.schedule.log_warmup);
  EXPECT_EQ(t.schedule.min_ratio, 0.1);
  OffloadSettings o;
  STRATA_ASSERT_OK(o.apply(*c));
  EXPECT_EQ(o.params, Tier::kHost);
  EXPECT_EQ(o.optimizer, Tier::kHost);
  EXPECT_TRUE(o.pin_memory);
  EXPECT_EQ(o.prefetch_elements, 2'000'000);
  EXPECT_EQ(o.persistence_threshold, 10'000);
}

TEST_F(ConfigKeysTest, NvmeInfinityConfigPlacesBothOnNvmeWithItsAioSettings) {
  auto c = load_config_file(corpus("zero3_infinity_nvme.json"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  OffloadSettings o;
  STRATA_ASSERT_OK(o.apply(*c));
  EXPECT_EQ(o.params, Tier::kNvme);
  EXPECT_EQ(o.optimizer, Tier::kNvme);
  EXPECT_EQ(o.nvme_path, std::vector<std::string>{"/local_nvme"});
  EXPECT_EQ(o.nvme_buffer_count, 4);
  EXPECT_EQ(o.io.block_size, 1u << 20);
  EXPECT_EQ(o.io.queue_depth, 8);
  EXPECT_EQ(c->aio.intra_op_parallelism, 1);  // from the older name thread_count
}

TEST_F(ConfigKeysTest, OlderSpellingsAndDeepSpeedBooleans) {
  auto legacy = load_config_file(corpus("legacy_zero2_cpu_offload.json"));
  ASSERT_TRUE(legacy.ok()) << legacy.status().to_string();
  EXPECT_EQ(legacy->zero_optimization.offload_optimizer.device, OffloadDevice::kCpu);  // cpu_offload: true
  EXPECT_TRUE(legacy->bf16.enabled);                                                   // the bfloat16 section
  TrainerConfig t = base_trainer();
  STRATA_ASSERT_OK(t.apply(*legacy, top_keys(*legacy)));
  EXPECT_EQ(t.model.dtype, DType::kBF16);
  EXPECT_EQ(t.micro_batch, 8);  // 32 / 4 accumulation steps / 1 rank
  EXPECT_EQ(t.schedule.kind, LrScheduleKind::kWarmupDecay);
  EXPECT_EQ(t.schedule.warmup_max_lr, 0.00015);
  EXPECT_EQ(t.schedule.total_steps, 1000);
  OffloadSettings o;
  STRATA_ASSERT_OK(o.apply(*legacy));
  EXPECT_EQ(o.optimizer, Tier::kHost);
  EXPECT_EQ(o.params, Tier::kDevice);

  auto old = load_config_file(corpus("legacy_fp16_weights_save.json"));
  ASSERT_TRUE(old.ok()) << old.status().to_string();
  EXPECT_TRUE(old->bf16.enabled);                                    // "true"
  EXPECT_TRUE(old->zero_optimization.offload_param.pin_memory);      // 1
  EXPECT_TRUE(old->zero_optimization.offload_optimizer.pin_memory);  // "yes"
  EXPECT_TRUE(old->zero_optimization.stage3_gather_16bit_weights_on_model_save);
  EXPECT_EQ(old->zero_optimization.stage3_prefetch_bucket_size, 500'000'000);  // 5e8
  EXPECT_EQ(old->optimizer.type, OptimizerType::kAdamW);                       // "adamw"

  for (const char* yes : {"true", "True", "YES", "on", "1", "y", "t"}) {
    auto r = parse_config(std::string(R"({"bf16": {"enabled": ")") + yes + "\"}}", "b.json");
    ASSERT_TRUE(r.ok()) << yes << ": " << r.status().to_string();
    EXPECT_TRUE(r->bf16.enabled) << yes;
  }
  for (const char* no : {"false", "No", "OFF", "0", "n", "f"}) {
    auto r = parse_config(std::string(R"({"bf16": {"enabled": ")") + no + "\"}}", "b.json");
    ASSERT_TRUE(r.ok()) << no << ": " << r.status().to_string();
    EXPECT_FALSE(r->bf16.enabled) << no;
  }
  EXPECT_TRUE(parse_config(R"({"bf16": {"enabled": 1}})", "b.json")->bf16.enabled);
  EXPECT_FALSE(parse_config(R"({"bf16": {"enabled": 0}})", "b.json")->bf16.enabled);

  // Old and new spelling together: refused, naming the pair.
  auto both = parse_config(R"({"bf16": {"enabled": true}, "bfloat16": {"enabled": true}})", "b.json");
  ASSERT_FALSE(both.ok());
  EXPECT_EQ(both.status().message(),
            "b.json: bfloat16: is DeepSpeed's older name of the bf16 section; give only one of them");
  auto offload_twice = parse_config(
      R"({"zero_optimization": {"stage": 2, "cpu_offload": true, "offload_optimizer": {"device": "cpu"}}})",
      "z.json");
  ASSERT_FALSE(offload_twice.ok());
  EXPECT_EQ(offload_twice.status().message(),
            "z.json: zero_optimization.cpu_offload: is the older spelling of offload_optimizer; give only "
            "one of them");
  auto params = parse_config(
      R"({"zero_optimization": {"stage": 3, "cpu_offload": true, "cpu_offload_params": true,
                               "cpu_offload_use_pin_memory": true}})",
      "z.json");
  ASSERT_TRUE(params.ok()) << params.status().to_string();
  EXPECT_EQ(params->zero_optimization.offload_param.device, OffloadDevice::kCpu);
  EXPECT_TRUE(params->zero_optimization.offload_param.pin_memory);
  EXPECT_TRUE(params->zero_optimization.offload_optimizer.pin_memory);
}

TEST_F(ConfigKeysTest, InertValuesOfRefusedKeysAreAccepted) {
  EXPECT_TRUE(parse_config(
                  R"({"optimizer": {"type": "Adam", "params": {"bias_correction": true, "amsgrad": false}}})",
                  "a.json")
                  .ok());
  auto r = parse_config(R"({"optimizer": {"type": "Adam", "params": {"bias_correction": false}}})", "a.json");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(
      r.status().message(),
      "a.json: optimizer.params.bias_correction: not supported: Strata's Adam always corrects the moments' "
      "bias; remove the key or set true");
  auto amp = parse_config(R"({"amp": {"enabled": true, "opt_level": "O1"}})", "a.json");
  ASSERT_FALSE(amp.ok());
  EXPECT_EQ(amp.status().message(),
            "a.json: amp: not supported: NVIDIA Apex AMP is not available; use bf16.enabled");
}

// ---- ignored keys and --strict --------------------------------------------------------------

TEST_F(ConfigKeysTest, IgnoredKeysAreListedOnceWithTheirReason) {
  auto c = load_config_file(corpus("monitoring_and_profiling.json"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  const std::vector<std::string> expected = {"steps_per_print",
                                             "wall_clock_breakdown",
                                             "memory_breakdown",
                                             "flops_profiler",
                                             "tensorboard",
                                             "wandb",
                                             "csv_monitor",
                                             "comms_logger",
                                             "prescale_gradients",
                                             "gradient_predivide_factor",
                                             "communication_data_type"};
  EXPECT_EQ(ignored_paths(*c), expected);
  for (const IgnoredKey& k : c->ignored) EXPECT_EQ(k.reason, find_config_key(k.path)->note) << k.path;
  // A section's inner keys are not listed one by one.
  for (const IgnoredKey& k : c->ignored) EXPECT_EQ(k.path.find("tensorboard."), std::string::npos);
  // The honoured part still applies.
  TrainerConfig t = base_trainer();
  STRATA_ASSERT_OK(t.apply(*c, top_keys(*c)));
  EXPECT_EQ(t.micro_batch, 8);
  EXPECT_EQ(t.grad_accum, 2);
}

TEST_F(ConfigKeysTest, StrictRefusesEveryIgnoredKeyAndNothingElse) {
  auto loose = load_config_file(corpus("monitoring_and_profiling.json"));
  ASSERT_TRUE(loose.ok());
  auto strict = load_config_file(corpus("monitoring_and_profiling.json"), nullptr, ParseOptions{true});
  ASSERT_FALSE(strict.ok());
  const std::string& m = strict.status().message();
  EXPECT_EQ(static_cast<std::size_t>(std::count(m.begin(), m.end(), '\n')) + 1, loose->ignored.size()) << m;
  EXPECT_NE(
      m.find(": wall_clock_breakdown: ignored by Strata (strata train reports tokens/s; --metrics records "
             "it per step); --strict refuses ignored keys"),
      std::string::npos)
      << m;
  // A config without ignored keys passes strict mode.
  EXPECT_TRUE(parse_config(R"({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true}})", "s.json",
                           nullptr, ParseOptions{true})
                  .ok());
}

// ---- "auto" -------------------------------------------------------------------------------

TEST_F(ConfigKeysTest, AutoKeepsTheCallersValuesAndIsRecorded) {
  auto c = load_config_file(corpus("hf_trainer_zero3_auto.json"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE(c->is_auto("train_micro_batch_size_per_gpu"));
  EXPECT_TRUE(c->is_auto("optimizer.params.betas"));
  EXPECT_TRUE(c->is_auto("zero_optimization.stage3_prefetch_bucket_size"));
  EXPECT_FALSE(c->is_auto("zero_optimization.stage"));
  EXPECT_EQ(c->auto_keys.size(), 17u);
  TrainerConfig t = base_trainer();
  t.model.dtype = DType::kBF16;
  t.schedule.warmup_steps = 11;
  t.schedule.total_steps = 222;
  STRATA_ASSERT_OK(t.apply(*c, top_keys(*c)));
  // Every "auto" kept base_trainer()'s value.
  EXPECT_EQ(t.micro_batch, 3);
  EXPECT_EQ(t.grad_accum, 1);
  EXPECT_EQ(t.grad_clip, 0.75);
  EXPECT_EQ(t.optimizer.lr, 7e-4);
  EXPECT_EQ(t.optimizer.beta2, 0.95);
  EXPECT_EQ(t.optimizer.weight_decay, 0.05);
  EXPECT_EQ(t.model.dtype, DType::kBF16);
  EXPECT_EQ(t.schedule.kind, LrScheduleKind::kWarmupDecay);  // the type is not "auto"
  EXPECT_EQ(t.schedule.warmup_steps, 11);
  EXPECT_EQ(t.schedule.total_steps, 222);
  EXPECT_EQ(t.schedule.warmup_max_lr, 7e-4);  // the lr
  OffloadSettings o;
  o.prefetch_elements = 1234;
  STRATA_ASSERT_OK(o.apply(*c));
  EXPECT_EQ(o.prefetch_elements, 1234);
  EXPECT_EQ(o.params, Tier::kHost);
  // "auto" where the Hugging Face integration never puts it is a type error naming the key.
  auto bad = parse_config(R"({"zero_optimization": {"offload_param": {"buffer_count": "auto"}}})", "a.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(
      bad.status().message().find("zero_optimization.offload_param.buffer_count: expected an integer, found "
                                  "string \"auto\""),
      std::string::npos)
      << bad.status().message();
}

// ---- the table itself -----------------------------------------------------------------------

TEST_F(ConfigKeysTest, TheTableAndTheReaderAgree) {
  std::set<std::string> table;
  std::vector<std::string> sections;
  for (const ConfigKey& k : config_keys()) {
    EXPECT_TRUE(table.insert(std::string(k.path)).second) << "listed twice: " << k.path;
    EXPECT_FALSE(k.note.empty()) << k.path;
    if (k.section) sections.emplace_back(k.path);
    if (k.auto_ok) {
      EXPECT_FALSE(k.auto_from.empty()) << k.path;
    }
    if (!k.inert.empty()) {
      EXPECT_EQ(k.use, KeyUse::kRefused) << k.path;
    }
  }
  auto covered = [&](const std::string& path) {
    if (table.count(path) != 0) return true;
    return std::any_of(sections.begin(), sections.end(),
                       [&](const std::string& s) { return path.rfind(s + ".", 0) == 0; });
  };
  const std::vector<std::string> declared = config_detail::declared_key_paths();
  ASSERT_GT(declared.size(), 60u);
  for (const std::string& path : declared)
    EXPECT_TRUE(covered(path)) << "read but not in the table: " << path;
  // Every honoured key (not a whole section, not a value) is read by the reader.
  for (const ConfigKey& k : config_keys()) {
    if (k.use != KeyUse::kHonoured || k.section || k.path.find('=') != std::string_view::npos) continue;
    EXPECT_NE(std::find(declared.begin(), declared.end(), k.path), declared.end())
        << "honoured but never read: " << k.path;
  }
}

TEST_F(ConfigKeysTest, DocsCarryTheGeneratedTable) {
  std::ifstream in(std::string(STRATA_SOURCE_DIR) + "/docs/config.md");
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_NE(ss.str().find(config_keys_markdown()), std::string::npos)
      << "docs/config.md's key table is out of date: regenerate it with `strata config --keys`";
}

}  // namespace
}  // namespace strata
