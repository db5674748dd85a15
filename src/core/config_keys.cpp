// The key table: every DeepSpeed key Strata knows of and what it does with it. This is the one
// place that says whether a key is honoured, ignored (and why) or refused (and what to use instead):
// the config reader consults it, TrainerConfig::apply takes its refusals from it, and
// docs/config.md's key table is generated from it (a test keeps the two equal).
//
// World size: under mpirun the engine is data parallel (docs/parallel.md): stage 0 all-reduces,
// stages 1 and 2 shard the host optimizer over the ranks, stage 3 also the offloaded parameters.
// With the host optimizer its reductions run one module at a time as the module's gradients land;
// with the optimizer on the device they run per gradient bucket (reduce_bucket_size, overlap_comm);
// the other bucket keys are "ignored" with that reason.
#include <algorithm>
#include <array>
#include <string>

#include "strata/config.hpp"

namespace strata {
namespace {

constexpr KeyUse H = KeyUse::kHonoured;
constexpr KeyUse I = KeyUse::kIgnored;
constexpr KeyUse R = KeyUse::kRefused;

constexpr std::string_view kNoComm =
    "data parallel reduces and gathers one module at a time, overlapped with backward and the update: "
    "the module is the bucket";
constexpr std::string_view kLogging = "logging/monitoring: strata train prints progress and writes --metrics";

// Fields: path, use, note, section, auto_ok, auto_from, inert.
constexpr ConfigKey kKeys[] = {
    // ---- batch sizes and clipping ----
    {"train_batch_size", H,
     "micro batch x accumulation x data-parallel size (mpirun ranks, else 1); derives the missing one",
     false, true, "train_micro_batch_size_per_gpu x gradient_accumulation_steps x ranks"},
    {"train_micro_batch_size_per_gpu", H, "sequences per micro-batch (TrainerConfig::micro_batch)", false,
     true, "--batch"},
    {"gradient_accumulation_steps", H, "micro-batches per optimizer step (TrainerConfig::grad_accum)", false,
     true, "--grad-accum"},
    {"gradient_clipping", H, "max global gradient norm, 0 = off (TrainerConfig::grad_clip)", false, true,
     "--grad-clip"},
    {"steps_per_print", I, "strata train prints progress every steps/20 steps; --metrics logs every step"},
    // ---- precision ----
    {"bf16", H, "section: bf16 training"},
    {"bf16.enabled", H, "bf16 working weights and activations with fp32 master weights (ModelConfig::dtype)",
     false, true, "--dtype"},
    {"bf16.immediate_grad_update", I, "gradients are always accumulated in fp32 and applied at the step"},
    {"bf16.check_grad_overflow", I,
     "bf16 training in Strata uses no loss scaling, so there is no overflow check to configure"},
    {"bfloat16", H, "DeepSpeed's older name of the bf16 section (give only one of them)"},
    {"bfloat16.enabled", H, "as bf16.enabled", false, true, "--dtype"},
    {"fp16", H, "section: fp16 mixed precision"},
    {"fp16.enabled", H,
     "fp16 working weights and activations with fp32 master weights and loss scaling (ModelConfig::dtype)",
     false, true, "--dtype"},
    {"fp16.loss_scale", H, "0 = dynamic loss scaling; > 0 = this static scale (TrainerConfig::loss_scaling)"},
    {"fp16.initial_scale_power", H, "dynamic scaling starts at 2^power (default 16)"},
    {"fp16.loss_scale_window", H, "overflow-free steps before the scale doubles (default 1000)"},
    {"fp16.hysteresis", H, "overflows tolerated before the scale halves (default 2)"},
    {"fp16.consecutive_hysteresis", H, "refill the hysteresis after every overflow-free step (default false)"},
    {"fp16.min_loss_scale", H,
     "the scale never halves below this; an overflow there with no hysteresis left fails the step"},
    {"fp16.auto_cast",
     R,
     "autocasting model inputs to fp16 is not supported; fp16.enabled runs the whole model in fp16",
     false,
     false,
     {},
     "false"},
    {"fp16.fp16_master_weights_and_grads",
     R,
     "fp16 master weights are not supported; Strata keeps fp32 masters",
     false,
     false,
     {},
     "false"},
    {"amp", R, "NVIDIA Apex AMP is not available; use bf16.enabled", true},
    {"data_types", I, "gradients are always accumulated in fp32", true},
    {"communication_data_type", I, kNoComm},
    {"fp32_allreduce", I, kNoComm},
    // ---- optimizer ----
    {"optimizer", H, "section: the optimizer"},
    {"optimizer.type", H, "Adam or AdamW (case-insensitive); the refused types below say what to use"},
    {"optimizer.type=Lion", R,
     "the engine's optimizer is Adam/AdamW (Lion exists only as a CPU kernel); use AdamW"},
    {"optimizer.type=Adagrad", R, "the engine's optimizer is Adam/AdamW; use AdamW"},
    {"optimizer.type=Lamb", R, "LAMB is not implemented; use AdamW"},
    {"optimizer.type=OneBitAdam", R,
     "1-bit Adam compresses communication, and there is none at world size 1; use Adam"},
    {"optimizer.type=ZeroOneAdam", R,
     "0/1 Adam compresses communication, and there is none at world size 1; use Adam"},
    {"optimizer.type=OneBitLamb", R, "1-bit LAMB is not implemented; use AdamW"},
    {"optimizer.type=MuAdam", R, "muP optimizers are not implemented; use Adam"},
    {"optimizer.type=MuAdamW", R, "muP optimizers are not implemented; use AdamW"},
    {"optimizer.type=MuSGD", R, "muP optimizers are not implemented; use AdamW"},
    {"optimizer.type=SGD", R, "SGD is not implemented; use AdamW"},
    {"optimizer.params", H, "section: the optimizer's parameters"},
    {"optimizer.params.lr", H, "peak learning rate (OptimizerSettings::lr, LrSchedule::lr)", false, true,
     "--lr"},
    {"optimizer.params.betas", H, "[beta1, beta2] as a list of two numbers", false, true,
     "Strata's default [0.9, 0.95]"},
    {"optimizer.params.eps", H, "Adam epsilon", false, true, "Strata's default 1e-8"},
    {"optimizer.params.weight_decay", H, "decay of the weight matrices (decoupled for AdamW)", false, true,
     "--weight-decay"},
    {"optimizer.params.adam_w_mode", H,
     "Adam: true = decoupled decay (AdamW), false = L2 added to the gradient"},
    {"optimizer.params.bias_correction",
     R,
     "Strata's Adam always corrects the moments' bias; remove the key or set true",
     false,
     false,
     {},
     "true"},
    {"optimizer.params.amsgrad",
     R,
     "AMSGrad is not implemented; remove the key or set false",
     false,
     false,
     {},
     "false"},
    {"optimizer.params.torch_adam", I,
     "selects DeepSpeed's PyTorch Adam kernel; Strata picks its own (adam_isa)"},
    {"optimizer.params.fused", I, "selects a fused kernel in PyTorch; Strata picks its own (adam_isa)"},
    {"optimizer.params.foreach", I, "selects a PyTorch kernel variant; Strata picks its own (adam_isa)"},
    {"zero_allow_untested_optimizer", I,
     "only Strata's own optimizers run, so there is nothing untested to allow"},
    {"zero_force_ds_cpu_optimizer", I, "the host optimizer is always Strata's CPU Adam"},
    // ---- scheduler ----
    {"scheduler", H, "section: the learning-rate schedule"},
    {"scheduler.type", H, "WarmupLR, WarmupDecayLR or WarmupCosineLR (LrSchedule::kind)"},
    {"scheduler.type=OneCycle", R, "OneCycle is not implemented; use WarmupDecayLR or WarmupCosineLR"},
    {"scheduler.type=LRRangeTest", R, "LRRangeTest is not implemented; sweep --lr instead"},
    {"scheduler.params", H, "section: the schedule's parameters"},
    {"scheduler.params.warmup_min_lr", H, "learning rate at step 0 (WarmupLR, WarmupDecayLR)", false, true,
     "Strata's default 0"},
    {"scheduler.params.warmup_max_lr", H, "learning rate after warmup (WarmupLR, WarmupDecayLR)", false, true,
     "--lr"},
    {"scheduler.params.warmup_num_steps", H, "warmup steps (LrSchedule::warmup_steps)", false, true,
     "--warmup (default 5% of the steps)"},
    {"scheduler.params.warmup_type", H, "log or linear warmup"},
    {"scheduler.params.total_num_steps", H, "training steps; strata train runs this many unless --steps",
     false, true, "--steps"},
    {"scheduler.params.warmup_min_ratio", H, "WarmupCosineLR: start of warmup as a fraction of lr"},
    {"scheduler.params.cos_min_ratio", H, "WarmupCosineLR: end of the decay as a fraction of lr"},
    {"scheduler.params.last_batch_iteration",
     R,
     "resuming a schedule mid-way is not supported yet; remove the key",
     false,
     false,
     {},
     "-1"},
    // ---- ZeRO ----
    {"zero_optimization", H, "section: ZeRO partitioning and offload"},
    {"zero_optimization.stage", H,
     "0-3; offload_optimizer needs 1-3 and offload_param needs 3, as in DeepSpeed; one process: every "
     "stage trains identically; under mpirun: 0 all-reduces, 1-2 shard the host optimizer, 3 also the "
     "offloaded parameters"},
    {"zero_optimization.offload_param", H, "section: where working parameters live"},
    {"zero_optimization.offload_param.device", H,
     "none | cpu | nvme -> OffloadSettings::params (device/host/nvme)"},
    {"zero_optimization.offload_param.nvme_path", H, "swap directory of the NVMe tier"},
    {"zero_optimization.offload_param.pin_memory", H, "host-tier state in the pinned pool"},
    {"zero_optimization.offload_param.buffer_count", I,
     "the plan sizes parameter fetch slots from the modules"},
    {"zero_optimization.offload_param.buffer_size", I,
     "the plan sizes parameter fetch slots from the modules"},
    {"zero_optimization.offload_param.max_in_cpu", I,
     "parameters on nvme are staged through the fetch slots only"},
    {"zero_optimization.offload_optimizer", H, "section: where optimizer state lives and the optimizer runs"},
    {"zero_optimization.offload_optimizer.device", H,
     "none | cpu | nvme -> OffloadSettings::optimizer (device fused Adam / host CPU Adam / NVMe pipeline)"},
    {"zero_optimization.offload_optimizer.nvme_path", H, "swap directory of the NVMe tier"},
    {"zero_optimization.offload_optimizer.pin_memory", H, "host-tier state in the pinned pool"},
    {"zero_optimization.offload_optimizer.buffer_count", H,
     "buffers of the NVMe optimizer pipeline (clamped to [2, 64])"},
    {"zero_optimization.offload_optimizer.fast_init", I,
     "optimizer state is created zeroed in place; no slow path to skip"},
    {"zero_optimization.offload_optimizer.ratio", H, "the fraction of the optimizer state on the host (partial offload): below 1 the first modules keep theirs on the device with the device's update (docs/offload.md); needs offload_optimizer.device cpu or nvme (with several data-parallel ranks: both sides sharded over the ranks at stages 0-3, the device modules' parameters resident and whole; with a pipeline too at stages 0-3, interleaved or not); with offload_param.device cpu or nvme the device's modules keep their parameters resident"},
    {"zero_optimization.cpu_offload", H,
     "DeepSpeed's older ZeRO-2 spelling: true = offload_optimizer.device cpu (give only one of them)"},
    {"zero_optimization.cpu_offload_params", H, "older spelling: true = offload_param.device cpu"},
    {"zero_optimization.cpu_offload_use_pin_memory", H, "older spelling of offload_*.pin_memory"},
    {"zero_optimization.stage3_prefetch_bucket_size", H,
     "elements fetched ahead of the running module, 0 = no prefetch (OffloadSettings::prefetch_elements)",
     false, true, "Strata's default 5e7"},
    {"zero_optimization.stage3_param_persistence_threshold", H,
     "modules with at most this many elements stay on the device (OffloadSettings::persistence_threshold)",
     false, true, "Strata's default 1e5"},
    {"zero_optimization.stage3_max_live_parameters", I,
     "parameters are released after each module; prefetch is bounded by stage3_prefetch_bucket_size"},
    {"zero_optimization.stage3_max_reuse_distance", I,
     "parameters are released after each module; prefetch is bounded by stage3_prefetch_bucket_size"},
    {"zero_optimization.stage3_gather_16bit_weights_on_model_save", I,
     "saved weights are always whole (under stage 3 every rank gathers the slices and rank 0 writes)"},
    {"zero_optimization.stage3_gather_fp16_weights_on_model_save", I,
     "older name of stage3_gather_16bit_weights_on_model_save; saved weights are always whole"},
    {"zero_optimization.contiguous_gradients", I,
     "gradients are always written into contiguous buffers (the whole gradient region, or one bucket "
     "buffer per open bucket)"},
    {"zero_optimization.overlap_comm", H,
     "data parallel with the optimizer on the device: each gradient bucket's collective runs while "
     "backward goes on (off: backward waits for it; the same bits); the host optimizer always overlaps "
     "its per-module reductions"},
    {"zero_optimization.reduce_bucket_size", H,
     "data parallel with the optimizer on the device: the most elements per gradient bucket (stage 0 "
     "all-reduce, stages 2-3 reduce-scatter during backward); the host optimizer reduces per module",
     false, true, "Strata's default 5e8"},
    {"zero_optimization.allgather_bucket_size", I, kNoComm},
    {"zero_optimization.allgather_partitions", I, kNoComm},
    {"zero_optimization.reduce_scatter", I, kNoComm},
    {"zero_optimization.round_robin_gradients", I, kNoComm},
    {"zero_optimization.use_multi_rank_bucket_allreduce", I, kNoComm},
    {"zero_optimization.sub_group_size", H,
     "elements of NVMe optimizer state moved and updated as one piece (OffloadSettings::sub_group_size)"},
    {"zero_optimization.elastic_checkpoint", I, "checkpoints hold whole tensors (the ranks gather their partitions), loadable at any number of ranks"},
    {"zero_optimization.load_from_fp32_weights", I,
     "weights are loaded into both the working and fp32 master copies"},
    {"zero_optimization.ignore_unused_parameters", I,
     "unused parameters get zero gradients; nothing to ignore"},
    {"zero_optimization.legacy_stage1", I, "there is one ZeRO implementation"},
    {"zero_optimization.log_trace_cache_warnings", I,
     "prefetch trace mismatches are counted in the run's statistics"},
    {"zero_optimization.memory_efficient_linear", I, "tunes DeepSpeed's own ZeRO-3 linear layer; Strata's models have their own"},
    {"zero_optimization.stage3_module_granularity_threshold", I,
     "modules are the model's own (blocks, embeddings)"},
    {"zero_optimization.zero_hpz_partition_size",
     R,
     "ZeRO++ hierarchical partitioning needs several nodes; remove it",
     false,
     false,
     {},
     "1"},
    {"zero_optimization.zero_quantized_weights",
     R,
     "ZeRO++ quantized weights are not implemented; remove it",
     false,
     false,
     {},
     "false"},
    {"zero_optimization.zero_quantized_gradients",
     R,
     "ZeRO++ quantized gradients are not implemented; remove it",
     false,
     false,
     {},
     "false"},
    {"zero_optimization.zeropp_loco_param", R, "ZeRO++ LoCo is not implemented; remove it", true},
    {"zero_optimization.mics_shard_size",
     R,
     "MiCS sharding needs several processes; remove it",
     false,
     false,
     {},
     "-1"},
    {"zero_optimization.mics_hierarchical_params_gather", I, kNoComm},
    // ---- aio (NVMe) ----
    {"aio", H, "section: the NVMe I/O engine"},
    {"aio.block_size", H, "bytes per I/O request (a multiple of 4096; \"1MiB\" accepted)"},
    {"aio.queue_depth", H, "requests in flight per queue"},
    {"aio.intra_op_parallelism", H, "I/O threads per operation"},
    {"aio.thread_count", H, "older name of aio.intra_op_parallelism"},
    {"aio.single_submit", H, "submit requests one at a time"},
    {"aio.overlap_events", H, "overlap submission and completion"},
    {"aio.backend", H, "Strata's own: auto | io_uring | libaio | psync"},
    {"aio.nvme_path", H, "Strata's own: swap directories, striped over"},
    {"strata", H, "Strata's tunables (the options table in this page)", true},
    // ---- logging, profiling, monitoring ----
    {"wall_clock_breakdown", I, "strata train reports tokens/s; --metrics records it per step"},
    {"memory_breakdown", I, "strata config / strata train print the memory plan per tier"},
    {"dump_state", I, kLogging},
    {"flops_profiler", I, "no FLOPs profiler; strata bench step measures the step", true},
    {"tensorboard", I, kLogging, true},
    {"wandb", I, kLogging, true},
    {"csv_monitor", I, kLogging, true},
    {"comet", I, kLogging, true},
    {"comms_logger", I, kNoComm, true},
    {"prescale_gradients", I, kNoComm},
    {"gradient_predivide_factor", I, kNoComm},
    {"sparse_gradients", I, "embedding gradients are dense; the result is the same"},
    {"activation_checkpointing", H,
     "the built-in models checkpoint with --checkpointing on; cpu_checkpointing is honoured, the other keys "
     "configure deepspeed.checkpointing for models that call it"},
    {"activation_checkpointing.cpu_checkpointing", H,
     "activation offload: the checkpointed block inputs in pinned host memory, fetched back ahead of "
     "backward (OffloadSettings::offload_activations, --offload-activations; needs --checkpointing on)"},
    {"activation_checkpointing.partition_activations", I,
     "configures deepspeed.checkpointing for models that call it"},
    {"activation_checkpointing.contiguous_memory_optimization", I,
     "configures deepspeed.checkpointing for models that call it"},
    {"activation_checkpointing.number_checkpoints", I,
     "configures deepspeed.checkpointing for models that call it"},
    {"activation_checkpointing.synchronize_checkpoint_boundary", I,
     "configures deepspeed.checkpointing for models that call it"},
    {"activation_checkpointing.profile", I, "configures deepspeed.checkpointing for models that call it"},
    {"checkpoint", I, "checkpoint layout options of DeepSpeed's engine; Strata's own format is used", true},
    {"autotuning", I, "DeepSpeed's autotuner; use strata estimate to compare placements", true},
    // ---- features Strata does not have ----
    {"elasticity", R, "elastic training is not supported; set the batch sizes directly", true},
    {"pipeline", R,
     "DeepSpeed's pipeline section (PipelineModule) does not apply; set strata.pipeline_parallel_size, "
     "strata.pipeline_schedule and strata.pipeline_virtual_stages (interleaved 1F1B)",
     true},
    {"sparse_attention", R, "sparse attention is not implemented; remove the section", true},
    {"curriculum_learning", R, "curriculum learning is not implemented; remove the section", true},
    {"data_efficiency", R, "data efficiency (curriculum, random-LTD) is not implemented; remove the section",
     true},
    {"compression_training", R, "compression training is not implemented; remove the section", true},
    {"quantize_training", R, "quantization-aware training is not implemented; remove the section", true},
    {"eigenvalue", R, "eigenvalue computation is not implemented; remove the section", true},
    {"progressive_layer_drop", R, "progressive layer drop is not implemented; remove the section", true},
    {"hybrid_engine", R, "the RLHF hybrid engine is not implemented; remove the section", true},
    {"tensor_parallel", R,
     "DeepSpeed's tensor_parallel (AutoTP) section is not read; set strata.tensor_parallel_size and launch with mpirun",
     true},
    {"sequence_parallel_size",
     R,
     "DeepSpeed's sequence parallelism (attention all-to-all over sequence shards) is not implemented; remove the "
     "key (Megatron-style sequence parallelism inside tensor parallel is strata.sequence_parallel)",
     false,
     false,
     {},
     "1"},
};

}  // namespace

std::string_view to_string(KeyUse value) {
  switch (value) {
    case KeyUse::kHonoured:
      return "honoured";
    case KeyUse::kIgnored:
      return "ignored";
    case KeyUse::kRefused:
      return "refused";
  }
  return "unknown";
}

std::span<const ConfigKey> config_keys() { return kKeys; }

const ConfigKey* find_config_key(std::string_view path) {
  for (const ConfigKey& k : kKeys) {
    if (k.path == path) return &k;
  }
  return nullptr;
}

std::string config_keys_markdown() {
  auto cell = [](std::string_view text) {
    std::string out;
    for (char c : text) out += c == '|' ? std::string("\\|") : std::string(1, c);
    return out;
  };
  std::string md =
      "| key | use | meaning in Strata, or why | \"auto\" resolves from |\n| --- | --- | --- | --- |\n";
  for (const ConfigKey& k : kKeys) {
    std::string path = "`" + std::string(k.path) + "`";
    if (k.section && k.use != KeyUse::kHonoured) path += " (whole section)";
    std::string use(to_string(k.use));
    if (!k.inert.empty()) use += " unless `" + std::string(k.inert) + "`";
    md += "| " + path + " | " + use + " | " + cell(k.note) + " | " + (k.auto_ok ? cell(k.auto_from) : "") +
          " |\n";
  }
  return md;
}

}  // namespace strata
