// Strata's run configuration, read from a JSON file.
//
// The keys are DeepSpeed's, with DeepSpeed's meaning and defaults, so an existing DeepSpeed config
// works unchanged (train_batch_size, fp16/bf16, zero_optimization with offload_param /
// offload_optimizer and the stage3_* knobs, aio, optimizer, scheduler). Strata adds `aio.backend`,
// `aio.nvme_path` and a `strata` section holding the tunables table of options.hpp. docs/config.md
// lists every key. Where Strata deviates from DeepSpeed it says so there.
//
// Sizes that DeepSpeed counts in *elements* (reduce_bucket_size, stage3_prefetch_bucket_size,
// sub_group_size, offload_param.buffer_size, ...) stay element counts here; only true byte sizes
// (aio.block_size and the byte-valued `strata` options) accept unit strings such as "64MiB".
//
// Validation is complete: every problem in a file is reported at once, one per line, each naming the
// full key path ("zero_optimization.offload_param.device"), what was expected and what was found.
// Every DeepSpeed key Strata knows of is in one table (config_keys()): honoured keys take effect;
// ignored keys (logging, profiling, monitoring, communication tuning that does nothing at world size
// 1) are accepted and listed in Config::ignored with the reason, or refused in strict mode; refused
// keys (features Strata does not have) are errors saying what to use instead. Keys in no table and
// read by no section are errors with a did-you-mean suggestion. `"auto"` (the Hugging Face
// integration's placeholder) is accepted where the table allows it and recorded in
// Config::auto_keys; the key keeps its default here and the caller resolves it (TrainerConfig::apply
// keeps the caller's value). A config either loads entirely or leaves the caller's Options untouched.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/options.hpp"
#include "strata/status.hpp"

namespace strata {

enum class OffloadDevice : std::uint8_t { kNone, kCpu, kNvme };
enum class AioBackend : std::uint8_t { kAuto, kIoUring, kLibaio, kPsync };
enum class OptimizerType : std::uint8_t { kAdam, kAdamW, kLion, kAdagrad };
enum class SchedulerType : std::uint8_t { kNone, kWarmupLR, kWarmupCosineLR, kWarmupDecayLR };
enum class WarmupType : std::uint8_t { kLog, kLinear };

// The spelling used in the config file ("nvme", "io_uring", "AdamW", "WarmupCosineLR", "log").
std::string_view to_string(OffloadDevice value);
std::string_view to_string(AioBackend value);
std::string_view to_string(OptimizerType value);
std::string_view to_string(SchedulerType value);
std::string_view to_string(WarmupType value);

struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0.0;              // 0 = dynamic loss scaling; > 0 = this static scale
  int initial_scale_power = 16;         // dynamic scaling starts at 2^initial_scale_power
  int loss_scale_window = 1000;         // overflow-free steps before the scale is raised
  int hysteresis = 2;                   // overflows tolerated before the scale is lowered
  bool consecutive_hysteresis = false;  // refill hysteresis after an overflow-free step
  double min_loss_scale = 1.0;
};

struct Bf16Config {
  bool enabled = false;
};

struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;  // empty: the directories of aio.nvme_path
  bool pin_memory = false;
  std::int64_t buffer_count = 5;            // NVMe staging buffers
  std::int64_t buffer_size = 100'000'000;   // elements per staging buffer
  std::int64_t max_in_cpu = 1'000'000'000;  // elements kept in host memory when device is nvme
};

struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;  // empty: the directories of aio.nvme_path
  bool pin_memory = false;
  std::int64_t buffer_count = 4;  // NVMe staging buffers for the optimizer-state pipeline
  bool fast_init = false;
  double ratio = 1.0;  // fraction of the optimizer state offloaded, in (0, 1]
};

struct ZeroConfig {
  int stage = 0;  // 0 (off), 1 optimizer state, 2 + gradients, 3 + parameters partitioned
  bool contiguous_gradients = true;
  bool overlap_comm = false;  // resolved: when the key is absent, true for stage 3 (as DeepSpeed)
  std::int64_t reduce_bucket_size = 500'000'000;     // elements
  std::int64_t allgather_bucket_size = 500'000'000;  // elements
  bool allgather_partitions = true;
  bool reduce_scatter = true;
  std::int64_t sub_group_size = 1'000'000'000;                // elements per optimizer sub-group
  std::int64_t stage3_prefetch_bucket_size = 50'000'000;      // elements; 0 disables prefetch
  std::int64_t stage3_param_persistence_threshold = 100'000;  // elements
  std::int64_t stage3_max_live_parameters = 1'000'000'000;    // elements
  std::int64_t stage3_max_reuse_distance = 1'000'000'000;     // elements
  bool stage3_gather_16bit_weights_on_model_save = false;
  OffloadParamConfig offload_param;
  OffloadOptimizerConfig offload_optimizer;
};

struct AioConfig {
  std::uint64_t block_size = 1u << 20;  // bytes per I/O request; a multiple of 4096
  int queue_depth = 8;
  int intra_op_parallelism = 1;  // I/O threads per operation (DeepSpeed alias: thread_count)
  bool single_submit = false;
  bool overlap_events = true;
  AioBackend backend = AioBackend::kAuto;  // auto: io_uring, else libaio, else psync
  std::vector<std::string> nvme_path;      // directories striped over; empty = none configured
};

// Defaults depend on the type and follow DeepSpeed's optimizers: Adam/AdamW lr 1e-3, betas
// (0.9, 0.999), eps 1e-8; Lion lr 1e-3, betas (0.9, 0.999); Adagrad lr 1e-2, eps 1e-10.
// DeepSpeed's activation_checkpointing section: only cpu_checkpointing acts here (the built-in
// models checkpoint with ModelConfig::activation_checkpointing / --checkpointing on).
struct ActivationCheckpointingConfig {
  bool cpu_checkpointing = false;  // keep the checkpointed block inputs in pinned host memory
};

struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdam;
  double lr = 1e-3;
  std::array<double, 2> betas = {0.9, 0.999};  // unused by Adagrad
  double eps = 1e-8;                           // unused by Lion
  double weight_decay = 0.0;
  bool adam_w_mode = true;  // Adam only: decoupled weight decay (AdamW); always true for AdamW
};

struct SchedulerConfig {
  SchedulerType type = SchedulerType::kNone;
  double warmup_min_lr = 0.0;   // WarmupLR, WarmupDecayLR
  double warmup_max_lr = 1e-3;  // WarmupLR, WarmupDecayLR
  std::int64_t warmup_num_steps = 1000;
  WarmupType warmup_type = WarmupType::kLog;
  std::int64_t total_num_steps = 0;  // required by WarmupDecayLR and WarmupCosineLR
  double warmup_min_ratio = 0.0;     // WarmupCosineLR: start of warmup, as a fraction of lr
  double cos_min_ratio = 1e-4;       // WarmupCosineLR: end of decay, as a fraction of lr
};

// What Strata does with a DeepSpeed key.
enum class KeyUse : std::uint8_t {
  kHonoured,  // takes effect with DeepSpeed's meaning (the note says what it sets)
  kIgnored,   // accepted, changes nothing here (the note says why); an error in strict mode
  kRefused,   // an error (the note says why and what to use instead)
};
std::string_view to_string(KeyUse value);

// One row of the key table.
struct ConfigKey {
  // The dotted key path ("zero_optimization.offload_param.device"); a refused *value* of a key is
  // written "optimizer.type=Lamb".
  std::string_view path;
  KeyUse use;
  std::string_view note;
  // The row covers every key below `path` (e.g. "tensorboard"); the reader does not look inside.
  bool section = false;
  // Accepts "auto"; `auto_from` says what resolves it (a CLI flag such as "--batch", or a rule).
  bool auto_ok = false;
  std::string_view auto_from = {};
  // For a refused key: the value (as compact JSON text, e.g. "false") that is what Strata does
  // anyway, so that a config spelling it out is accepted.
  std::string_view inert = {};
};

// The table, in documentation order. docs/config.md's key table is generated from it
// (strata config --keys) and a test checks that the two agree.
std::span<const ConfigKey> config_keys();
// The row for `path` (exact), or null.
const ConfigKey* find_config_key(std::string_view path);

struct IgnoredKey {
  std::string path;
  std::string reason;
};

struct ParseOptions {
  bool strict = false;  // ignored keys are errors
};

struct Config {
  // Batch sizes as written; absent ones are derived once the data-parallel size is known
  // (resolve_batch_sizes).
  std::optional<std::int64_t> train_batch_size;
  std::optional<std::int64_t> train_micro_batch_size_per_gpu;
  std::optional<std::int64_t> gradient_accumulation_steps;
  double gradient_clipping = 0.0;  // max global gradient norm; 0 = no clipping
  std::int64_t steps_per_print = 10;
  Fp16Config fp16;
  Bf16Config bf16;
  ZeroConfig zero_optimization;
  AioConfig aio;
  ActivationCheckpointingConfig activation_checkpointing;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  // The tunables after applying the file's `strata` section and the environment (see
  // parse_config for the precedence rules).
  Options strata;
  std::string source = "<defaults>";  // the file (or name) the config came from
  // Keys the file sets that Strata accepts but does not act on, each once, in document order.
  std::vector<IgnoredKey> ignored;
  // Keys the file sets to "auto", in document order (they hold their defaults here).
  std::vector<std::string> auto_keys;
  bool is_auto(std::string_view path) const;
  // Whether the file sets `path` (a dotted key path, "auto" included).
  bool has(std::string_view path) const;
  std::vector<std::string> present_paths;  // every key path the file sets, in document order
};

struct BatchSizes {
  std::int64_t train_batch_size = 0;
  std::int64_t train_micro_batch_size_per_gpu = 0;
  std::int64_t gradient_accumulation_steps = 0;
};

// DeepSpeed's rule train_batch_size = micro * accumulation * data_parallel_size, deriving whichever
// of the three the config leaves out (accumulation defaults to 1 when it cannot be derived; with
// neither train_batch_size nor the micro batch given, the micro batch is 1 — DeepSpeed would refuse).
// Errors name the keys and the numbers that disagree.
Result<BatchSizes> resolve_batch_sizes(const Config& config, std::int64_t data_parallel_size);

// Parses and validates a config. `source_name` (usually the file path) prefixes every error line.
//
// The `strata` section is applied on top of `*options` (or on top of the defaults when `options` is
// null) with the precedence of options.hpp: default < config file < environment (STRATA_<NAME>) <
// explicit set (CLI). The order of calls does not matter: a value whose current source is an explicit
// set is never overwritten, and the environment is applied after the file. On success `*options`
// receives the result (also in Config::strata); on failure `*options` is unchanged.
//
// Errors: kInvalidArgument with every problem found, one per line, each "<source>: <key path>: ...";
// invalid JSON is reported as "<source>:<line>:<column>: invalid JSON: ...".
Result<Config> parse_config(std::string_view json_text, std::string_view source_name,
                            Options* options = nullptr, ParseOptions parse = {});

// Reads `path` and parses it as above. A missing file is kNotFound, an unreadable one kIoError.
Result<Config> load_config_file(const std::string& path, Options* options = nullptr, ParseOptions parse = {});

// The key table as a Markdown table (docs/config.md).
std::string config_keys_markdown();

// The resolved config with every default filled in, as indented JSON that parse_config accepts
// again (absent batch sizes and an absent scheduler print as null).
std::string to_json(const Config& config);

}  // namespace strata
