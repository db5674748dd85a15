// The training settings as strata train, strata config and strata estimate resolve them, so that
// the three agree: Strata's defaults < a DeepSpeed-style --config file < flags. A config key set to
// "auto" keeps the default or the flag's value, and auto_resolution() says which. Private to
// tools/strata.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cli.hpp"
#include "strata/config.hpp"
#include "strata/engine.hpp"
#include "strata/offload.hpp"
#include "strata/options.hpp"

namespace strata::cli {

// The default run: sized by measurement to finish in about two minutes on two cores (see
// docs/training.md) with the validation loss far below the corpus's unigram entropy.
struct Defaults {
  static constexpr std::int64_t kLayers = 4;
  static constexpr std::int64_t kHeads = 4;
  static constexpr std::int64_t kWidth = 256;
  static constexpr std::int64_t kSeqLen = 128;
  static constexpr std::int64_t kBatch = 8;
  static constexpr std::int64_t kSteps = 600;
  static constexpr double kLr = 3e-3;
  static constexpr double kBeta2 = 0.95;
  static constexpr double kMinLrRatio = 0.1;
  static constexpr double kWeightDecay = 0.1;
  static constexpr double kGradClip = 1.0;
  static constexpr std::uint64_t kSeed = 1234;
};

// Flags that shape the settings (train takes them all; config and estimate too).
inline constexpr FlagSpec kSettingsFlags[] = {
    {"config", "FILE", "DeepSpeed-style JSON (docs/config.md lists every key and what Strata does with it)"},
    {"strict", "", "refuse config keys that Strata accepts but ignores"},
    {"steps", "N", "optimizer steps (default 600, or the config's scheduler total_num_steps)"},
    {"batch", "N", "sequences per micro-batch (default 8)"},
    {"grad-accum", "N", "micro-batches per step (default 1)"},
    {"seq-len", "T", "tokens per sequence (default 128)"},
    {"lr", "X", "peak learning rate (default 3e-3)"},
    {"warmup", "N", "learning-rate warmup steps (default 5% of --steps)"},
    {"min-lr-ratio", "X",
     "learning rate at the end of the cosine decay, as a fraction of --lr (default 0.1)"},
    {"weight-decay", "X", "AdamW weight decay of the weight matrices (default 0.1)"},
    {"grad-clip", "X", "clip the global gradient norm to X; 0 = off (default 1.0)"},
    {"seed", "N", "parameter initialisation and batch order (default 1234)"},
    {"offload-param", "TIER",
     "where working parameters live: none (device), cpu (host) or nvme (default nvme; a config's "
     "zero_optimization.offload_param wins over the default, this flag over both)"},
    {"offload-optimizer", "TIER",
     "where fp32 master weights and Adam moments live and the optimizer runs: none (device), cpu or "
     "nvme (default cpu)"},
    {"offload-gradients", "TIER",
     "where fp32 gradients wait for an off-device optimizer: cpu (host memory, default) or nvme (needs "
     "--offload-optimizer nvme; for models whose gradients do not fit in host memory)"},
    {"nvme-path", "DIR", "swap directory of the NVMe tier (train default: a fresh directory under $TMPDIR)"},
    {"delayed-update", "",
     "one-step delayed parameter update (strata.delayed_update): each step computes with the parameters "
     "from before the previous step's update, which overlaps it; not equivalent to the ordinary step; needs "
     "the optimizer on cpu or nvme; composes with data, tensor and pipeline parallelism"},
    {"offload-activations", "",
     "activation offload (activation_checkpointing.cpu_checkpointing): keep the checkpointed block inputs in "
     "pinned host memory, fetched back ahead of backward; needs --checkpointing on; the same training, bit "
     "for "
     "bit"},
};

struct RunSettings {
  TrainerConfig trainer;
  OffloadSettings offload;
  Options options;
  std::int64_t steps = Defaults::kSteps;
  std::optional<Config> config;  // the --config file, when given
  // The ranks of this launch: mpirun's world size (OMPI_COMM_WORLD_SIZE), else 1.
  std::int64_t world_size = 1;
  // The data-parallel ranks: the world over strata.tensor_parallel_size x
  // strata.pipeline_parallel_size (the ranks of one model replica share its batch; the whole
  // world when that does not divide it: strata train refuses such a launch, naming the key).
  std::int64_t data_parallel_size() const {
    const std::int64_t tp = std::max<std::int64_t>(1, options.get_int(Option::kTensorParallelSize));
    const std::int64_t pp = std::max<std::int64_t>(1, options.get_int(Option::kPipelineParallelSize));
    return world_size % (tp * pp) == 0 ? world_size / (tp * pp) : world_size;
  }
};

// Strata's defaults, then the config file `config_path` (none when empty; --strict applies). A
// config that does not load or apply is a failure (exit 1).
Status load_settings(const Args& args, const std::string& config_path, RunSettings* settings);
// The flags on top (model-shape flags included). A bad flag is a usage error (exit 2).
Status apply_settings_flags(const Args& args, RunSettings* settings);

// The model-parallel layout the config asks for (strata.tensor_parallel_size,
// pipeline_parallel_size, pipeline_virtual_stages, pipeline_schedule, sequence_parallel; the
// environment's STRATA_* over the file's, as strata train reads them), applied to
// settings->offload as one rank's: tp_size, sequence_parallel, the schedule, the virtual stages
// and, with a pipeline, pipeline_bounds (pipeline_parallel_size x virtual FLOP-balanced chunks);
// pp_stage is left at 0. Sets *pipeline_stages. Errors name the key and what was expected.
Status apply_model_parallel(RunSettings* settings, int* pipeline_stages);

// A pipeline's row of strata estimate / strata plan, one more stage folded in: the row shows the
// stage that needs the most device memory, and fits a tier only where every stage does. Returns
// true when `stage` became the row shown.
bool fold_stage_estimate(PlacementEstimate& row, PlacementEstimate stage);

// How each "auto" key of the config was resolved.
struct AutoValue {
  std::string path;
  std::string value;   // as JSON text ("8", "true", "[0.9, 0.95]")
  std::string source;  // "from --batch", "Strata's default; --batch not given", ...
  // "train_micro_batch_size_per_gpu: auto -> 8 (from --batch)"
  std::string line() const { return path + ": auto -> " + value + " (" + source + ")"; }
};
std::vector<AutoValue> auto_resolution(const RunSettings& settings, const Args& args);

}  // namespace strata::cli
