// Built-in GPT models: GPT-2 style (learned positions, LayerNorm, GELU, tied embeddings) and
// LLaMA style (RMSNorm, rotary positions, SwiGLU, untied head), at any size a ModelConfig names.
//
// A model is a sequence of modules (the embedding, one per transformer block, the head). Every
// module declares its parameters in a descriptor table (ParamDesc: name, shape, dtype, weight
// decay, tied-with, initialisation, the Hugging Face tensors it exports as). Everything that
// places, initialises, optimises, saves or loads parameters walks that table; no code picks a
// parameter out by its position. A module's own parameters are contiguous in the parameter
// region, in declaration order, so a later offload engine can fetch a module as one range.
//
// Memory: a Model lives on a strata::Device. Its parameters and gradients are carved from two
// persistent arena regions planned up front from the table ("model.params", "model.grads");
// activations, activation gradients and token/loss buffers are dynamic arena blocks allocated
// once at create() for the largest batch and sequence length it will see, then reused, so a
// steady-state step allocates nothing. Host token batches and loss read-back go through pinned
// buffers from the device's pool.
//
// Ordering: every method that computes enqueues its work on the model's stream and returns
// without waiting (kernels run in stream order: on the cpu backend as host functions on the
// stream's worker, on cuda as launches on the stream). Errors inside enqueued work surface at the
// stream's next synchronize(). A Model is used from one host thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "strata/alloc.hpp"
#include "strata/dtype.hpp"
#include "strata/safetensors.hpp"
#include "strata/status.hpp"

namespace strata {

class Comm;
class Device;
class Stream;

enum class ModelKind : std::uint8_t { kGpt2, kLlama };
std::string_view to_string(ModelKind kind);  // "gpt2", "llama"
Result<ModelKind> parse_model_kind(std::string_view text);

struct ModelConfig {
  ModelKind kind = ModelKind::kGpt2;
  std::int64_t n_layer = 4;
  std::int64_t n_head = 4;
  std::int64_t n_kv_head = 0;      // LLaMA grouped-query heads; 0 = n_head (GPT-2 requires 0 or n_head)
  std::int64_t n_embd = 128;       // width C; head_dim = n_embd / n_head
  std::int64_t n_positions = 256;  // context length: the longest sequence the model accepts
  std::int64_t vocab_size = 256;
  std::int64_t ffn_hidden = 0;  // 0 = 4·C (GPT-2) or 8/3·C rounded up to a multiple of 64 (LLaMA)
  std::int64_t vocab_multiple =
      64;  // the head's rows are padded to a multiple of this (no padding if vocab ≤ it)
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  // Storage of working parameters and activations: kF32, kBF16 or kF16 (statistics, losses and
  // parameter gradients are always fp32; arithmetic always accumulates in fp32). kF16 trains
  // with dynamic loss scaling (TrainerConfig::loss_scaling).
  DType dtype = DType::kF32;
  bool activation_checkpointing = false;  // keep only each block's input; recompute the block in backward
  double init_std = 0.02;

  std::int64_t head_dim() const { return n_head > 0 ? n_embd / n_head : 0; }
  std::int64_t kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  std::int64_t ffn() const;
  std::int64_t padded_vocab() const;
  // Every field in range and consistent; the error names the field ("n_embd = 100 is not a
  // multiple of n_head = 3").
  Status validate() const;
};

// The model config as the Hugging Face config.json of the matching architecture (GPT2LMHeadModel:
// n_layer, n_head, n_embd, n_positions, vocab_size, ...; LlamaForCausalLM: num_hidden_layers,
// hidden_size, intermediate_size, ...), plus "torch_dtype".
std::string hf_config_json(const ModelConfig& config);
// The inverse; accepts either architecture's keys. `source` prefixes errors.
Result<ModelConfig> model_config_from_hf_json(std::string_view json, std::string_view source);

// ---- The descriptor table ----------------------------------------------------------------------

enum class ModuleKind : std::uint8_t { kEmbedding, kBlock, kHead };
std::string_view to_string(ModuleKind kind);

enum class InitKind : std::uint8_t { kNormal, kZeros, kOnes };
struct ParamInit {
  InitKind kind = InitKind::kZeros;
  double std = 0.0;  // kNormal: N(0, std²)
};

// One Hugging Face tensor a parameter is saved as: rows [row_begin, row_begin + rows) of the
// parameter (its first dimension), transposed when HF stores it the other way round (GPT-2's
// Conv1D weights are (in, out); ours are (out, in) like nn.Linear).
struct ExportSlice {
  std::string name;
  std::int64_t row_begin = 0;
  std::int64_t rows = 0;
  bool transpose = false;
};

// Tensor parallel (docs/parallel.md "Tensor parallel"). A layout may describe one rank's shard of
// the model: every parameter keeps its index and name, and `shard` maps the shard's elements to
// the full parameter's, so initialisation, saving and loading work on full coordinates.
struct TensorParallel {
  int size = 1;  // ranks the model is split over
  int rank = 0;  // this shard, in [0, size)
};

enum class ShardKind : std::uint8_t {
  kReplicated,  // every rank holds the whole parameter (norms, row-parallel biases, wpe)
  kRows,        // column-parallel layers and the vocabulary: a set of the full parameter's rows
  kColumns,     // row-parallel layers: a range of the full parameter's columns (its input dim)
};
std::string_view to_string(ShardKind kind);

// Row r of a kRows shard is full row `full_begin + (r - shard_begin)` of the block holding it.
struct ShardRows {
  std::int64_t full_begin = 0;
  std::int64_t rows = 0;
};

struct ShardMap {
  ShardKind kind = ShardKind::kReplicated;
  std::vector<std::int64_t> full_shape;  // the full parameter's shape (== shape when replicated)
  std::vector<ShardRows> rows;           // kRows: the shard's rows, block after block
  std::int64_t col_begin = 0;            // kColumns: shard column c is full column col_begin + c
  // Rows of the full parameter that are real (vocabulary padding excluded): init_values keeps
  // the others zero, as in the full layout.
  std::int64_t full_real_rows = 0;

  std::int64_t full_numel() const;
};

struct ParamDesc {
  std::string name;                 // unique in the model, e.g. "h.3.attn.c_attn.weight"
  std::vector<std::int64_t> shape;  // storage shape, row-major; linear weights are (out, in)
  DType dtype = DType::kF32;        // working dtype (gradients are fp32)
  bool weight_decay = false;        // matrices decay; biases, norms and position tables do not
  int tied_with = -1;               // index of the parameter whose storage and gradient this one shares
  int module = -1;                  // index of the owning module
  ParamInit init;
  std::vector<ExportSlice> exports;  // empty for a tied alias (its target exports)
  std::uint64_t param_offset = 0;    // bytes into the params region (a tied alias: its target's)
  std::uint64_t grad_offset = 0;     // bytes into the grads region
  // Where this parameter's elements sit in the full parameter (kReplicated, full_shape = shape,
  // in an unsharded layout). A shard parameter has no exports (the full parameter has them).
  ShardMap shard;

  std::int64_t numel() const;
  bool owns_storage() const { return tied_with < 0; }
};

struct ModuleDesc {
  std::string name;  // "embedding", "h.3" / "layers.3", "head"
  ModuleKind kind = ModuleKind::kBlock;
  int layer = -1;           // block index for kBlock
  std::vector<int> params;  // indices into ModelLayout::params, declaration order
  // The bytes of the module's own parameters / gradients in their regions (tied aliases excluded).
  std::uint64_t param_begin = 0, param_end = 0;
  std::uint64_t grad_begin = 0, grad_end = 0;
};

struct ModelLayout {
  ModelConfig config;
  TensorParallel tp;  // the shard this layout describes ({1, 0}: the whole model)
  std::vector<ParamDesc> params;
  std::vector<ModuleDesc> modules;
  std::uint64_t param_bytes = 0;  // size of the params region
  std::uint64_t grad_bytes = 0;   // size of the grads region

  // Elements with their own storage (a tied alias counts once).
  std::int64_t num_parameters() const;
  // Index of the parameter named `name`, or -1.
  int find(std::string_view name) const;
  // Checks the table: unique names, offsets inside the regions and non-overlapping, tied aliases
  // pointing at an owning parameter of the same shape, module ranges covering their parameters.
  Status is_valid() const;
};

// Every parameter offset is a multiple of this (the arena's default alignment).
inline constexpr std::uint64_t kParamAlignment = 256;

// The descriptor table of the whole model, or with tp.size > 1 of rank tp.rank's shard: qkv
// split by heads (query heads and kv heads both divisible by tp.size), attention output, MLP down
// projections split by columns, MLP up projections (GPT-2 c_fc, LLaMA gate and up rows alike)
// by rows, the vocabulary (embedding, LLaMA lm_head; GPT-2's tied head follows wte) by rows of
// the padded vocabulary; everything else replicated. Parameter indices and names are those of
// the full layout. Errors name the config field and the tensor-parallel size.
Result<ModelLayout> describe_model(const ModelConfig& config, TensorParallel tp = {});
// Whether `config` splits over `tp_size` ranks; the error names n_head / n_kv_head / ffn_hidden /
// the padded vocabulary and the tensor-parallel size.
Status check_tensor_parallel(const ModelConfig& config, int tp_size);

// Copies the shard's elements out of the full parameter (`full`: full_numel() values) into
// `shard` (p.numel() values), and back. Replicated parameters copy everything.
void shard_from_full(const ParamDesc& p, const float* full, float* shard);
void full_from_shard(const ParamDesc& p, const float* shard, float* full);

// Floating-point operations of one training step (forward + backward = 3 × forward) over
// `batch` sequences of `seq_len` tokens: every matmul 2·M·N·K, plus causal attention
// 2·2·B·H·D·T(T+1)/2 (scores and weighted sum over the keys each query sees). Elementwise ops are
// not counted. forward_only gives the forward pass alone.
double model_flops(const ModelConfig& config, std::int64_t batch, std::int64_t seq_len,
                   bool forward_only = false);

// Forward FLOPs of each module (layout order: embedding, blocks, head) over `batch` sequences of
// `seq_len` tokens, as model_flops counts them: a block its matmuls and causal attention, the
// head its vocabulary matmul, the embedding 0 (a gather). They sum to model_flops(forward_only).
std::vector<double> module_flops(const ModelConfig& config, std::int64_t batch, std::int64_t seq_len);

// Pipeline stages (docs/parallel.md "Pipeline parallel"): the module ranges of `stages`
// contiguous, non-empty stages, as stages + 1 bounds 0 = b_0 < b_1 < ... < b_stages = modules;
// stage s runs modules [b_s, b_{s+1}). The rule: balanced by forward FLOPs (module_flops), the
// split that minimises the largest stage's FLOPs; among those, each stage ends as early as the
// optimum allows (deterministic). Errors name the counts (more stages than modules).
Result<std::vector<int>> pipeline_stages(const ModelConfig& config, int stages, std::int64_t seq_len);

// One GEMM of a model step, as the kernels' gemm() is called: c (M,N) = op(a) (M,K)·op(b) (K,N).
struct GemmShape {
  std::string what;  // "h.*.attn.c_attn forward", ...
  std::int64_t M = 0, N = 0, K = 0;
  bool trans_a = false, trans_b = false;
  bool accumulate = false;
  int count = 1;  // how many times per step (layers)
};
// The GEMMs of one training step (forward and backward), for roofline measurements.
std::vector<GemmShape> model_gemms(const ModelConfig& config, std::int64_t batch, std::int64_t seq_len);

// Deterministic initial values of parameter `index` (N(0, std²) from a per-parameter stream keyed
// by (seed, index), zeros or ones), elements [begin, begin + n) of its row-major storage. In a
// shard layout every element gets the value of the full parameter's element it maps to, so the
// shards of a tensor-parallel run start from exactly the single-process initialisation.
void init_values(const ModelLayout& layout, int index, std::uint64_t seed, std::int64_t begin, std::int64_t n,
                 float* out);

// ---- The model on a device -------------------------------------------------------------------

struct LossSum {
  double sum = 0.0;        // Σ of per-token cross-entropy (nats) over rows with a target ≥ 0
  std::int64_t count = 0;  // those rows
};

class Model {
 public:
  struct Options {
    std::int64_t max_batch = 1;    // buffers are sized for this many sequences ...
    std::int64_t max_seq_len = 0;  // ... of this many tokens (0 = n_positions)
    bool with_grads = true;        // false: forward only (evaluation)
    // true: create() plans the device arena with the model's regions plus `extra_regions`.
    // false: the caller already planned it, including regions(); see Trainer.
    bool plan_arena = true;
    std::vector<RegionSpec> extra_regions;
    // true: the model carves "model.params" / "model.grads" and binds every module to them.
    // false: it carves neither; the caller binds each module's storage (bind_module) before the
    // module runs: the offload engine, which places parameters and gradients on its tiers.
    bool own_storage = true;
    int loss_slots = 1;  // pinned read-back slots for per-token losses (one per micro-batch)
    // Tensor parallel: the group of the layout's shards (size layout.tp.size, this rank
    // layout.tp.rank), required when the layout is a shard. The model issues its collectives on it
    // in stream order (cpu: a host function on the stream that runs the collective and waits;
    // cuda: the host synchronizes the stream, then runs the collective and waits), so it must be
    // used by nothing else; every rank enqueues the same modules in the same order. Not owned:
    // it must outlive the model.
    Comm* tensor_parallel = nullptr;
    // Sequence parallel (docs/parallel.md "Sequence parallel"), with tensor_parallel only: the
    // residual stream, the norms and the residual adds hold this rank's B·T/t token rows (rows
    // [r·B·T/t, (r+1)·B·T/t) of the row-major (B, T) batch); the column-parallel entries
    // all-gather the normed rows, the row-parallel exits and the vocabulary-parallel embedding
    // reduce-scatter them. max_seq_len (and every batch's T) must be a multiple of t. The norms'
    // gradients are summed over the group inside backward (each rank sees only its tokens), so
    // they stay identical on every rank. With a module range (a pipeline stage) the boundary
    // tensors are this rank's rows too (boundary_bytes); with activation offload the ring and the
    // host copies hold this rank's rows; with several module_ranges every range's residuals too.
    bool sequence_parallel = false;
    // Pipeline parallel (docs/parallel.md "Pipeline parallel"). activation_slots sets of
    // tokens, targets, residual stream, block activations, head buffers and per-token losses, so
    // several micro-batches can be in flight between their forward and their backward;
    // select_slot() picks the set the batch and module calls use. One activation-gradient set is
    // shared (one backward runs at a time).
    int activation_slots = 1;
    // The modules this model runs: [first_module, end_module) (end_module -1: to the last). Only
    // their activations are allocated; forward and backward passes start and end at the range.
    int first_module = 0;
    int end_module = -1;
    // Interleaved 1F1B (docs/parallel.md "Schedules"): several module ranges instead of
    // [first_module, end_module) (which must then be left at their defaults): non-empty,
    // increasing, not touching. Every slot carves the activations of every range (a slot holds
    // every chunk of one micro-batch); select_range() picks the range the passes run. With
    // activation offload only with slot_ranges.
    std::vector<std::pair<int, int>> module_ranges;
    // With module_ranges, activation slots carved per chunk (docs/parallel.md "Schedules"): one
    // entry per slot (activation_slots must equal its size), listing the ranges (indices into
    // module_ranges) that slot may hold, one at a time. The slot carves the tokens, targets and
    // losses once and, over them, each listed range's residuals, block sets and head buffers
    // from the same offset (they alias: the largest range sets the slot's size). select_range()
    // refuses a range the selected slot was not carved for. Empty: every slot holds every range
    // at once (as above).
    std::vector<std::vector<int>> slot_ranges;
    // Activation offload (docs/offload.md "Activation offload"; DeepSpeed's
    // activation_checkpointing.cpu_checkpointing). Requires ModelConfig::activation_checkpointing.
    // The residual stream lives in a ring of kActivationRing device buffers per activation slot
    // instead of L+1; each block input a later block would overwrite is copied to pinned host
    // memory (from the device's pool, allocated at create()) on the model's own copy stream once
    // the block that reads it has run, and comes back ahead of its backward, the compute stream
    // waiting on an event. The arithmetic is that of checkpointing without offload, bit for bit.
    // With module_ranges and slot_ranges, a slot's ranges share its ring and host copies (sized
    // for its largest range), one range at a time.
    bool offload_activations = false;
  };

  // Device buffers of the residual-stream ring with Options::offload_activations (per slot).
  static constexpr int kActivationRing = 3;

  // The persistent regions the model carves: "model.params" and, with grads, "model.grads".
  static std::vector<RegionSpec> regions(const ModelLayout& layout, const Options& options);

  // Allocates everything (parameters zeroed; call initialize() or upload_param()). The model
  // keeps references to `device` and `stream` and returns its memory to them: destroy it first.
  static Result<std::unique_ptr<Model>> create(ModelLayout layout, Device& device, Stream& stream,
                                               const Options& options);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelLayout& layout() const;
  const ModelConfig& config() const { return layout().config; }
  Device& device();
  Stream& stream();

  // Device pointers under the current bindings (with own_storage: valid for the model's life).
  // A tied alias returns its target's storage; nullptr where the owning module is unbound.
  void* param_data(int index) const;
  float* grad_data(int index) const;  // nullptr without grads
  void* params_base() const;          // the whole params region (nullptr without own_storage)
  float* grads_base() const;

  // Writes parameter `index` from host fp32 values (numel of them), rounded to the working dtype,
  // through pinned staging. Enqueued; `values` may be reused when the call returns.
  Status upload_param(int index, std::span<const float> values);
  // Fills every owning parameter from init_values(seed).
  Status initialize(std::uint64_t seed);
  // Synchronizes the stream, then copies parameter `index` (working dtype, widened) or its
  // gradient to the host.
  Result<std::vector<float>> download_param(int index);
  Result<std::vector<float>> download_grad(int index);
  // Raw working-dtype bytes of parameter `index` (synchronizes).
  Status download_param_bytes(int index, void* dst, std::uint64_t bytes);

  // Copies B·T inputs and targets (row-major (B,T); a negative target ignores its row) to the
  // device through pinned staging. B ≤ max_batch, T ≤ max_seq_len.
  Status set_batch(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets,
                   std::int64_t B, std::int64_t T);
  // Forward over the current batch up to the per-token losses. With for_backward, keeps what
  // backward() needs (all block activations, or only block inputs with activation checkpointing).
  // Equivalent to forward_module(m) for every module in order.
  Status forward(bool for_backward);
  // Backward of the last forward(for_backward = true): parameter gradients accumulate (+=) into
  // the grads region. `dloss` is ∂(total loss)/∂(each token's loss), e.g. 1/(tokens per step).
  // Equivalent to backward_module(m) for every module in reverse order.
  Status backward(float dloss);

  // ---- Module by module (the offload engine's interface) ----------------------------------
  // The modules of layout().modules run in order 0..M-1 forward and M-1..0 backward; each call
  // enqueues one module's kernels with the storage bound at the time of the call (kernels capture
  // pointers when enqueued, so a binding may change as soon as the call returns; the storage
  // itself must stay valid and in place until the stream has run the module's work).
  int num_modules() const;
  // The modules whose parameter (and gradient) storage module `module` reads, itself first: a
  // tied weight adds its target's module (GPT-2's head reads the embedding's wte).
  const std::vector<int>& module_storage(int module) const;
  // Binds module `module`'s own parameter range (param_end - param_begin bytes of the working
  // dtype, laid out as in the params region) and gradient range (grad_end - grad_begin bytes of
  // fp32) to device memory. Null unbinds.
  Status bind_module(int module, void* params, float* grads);
  // One module of the forward pass (out of order is an error naming the module expected).
  Status forward_module(int module, bool for_backward);
  // One module of the backward pass (out of order is an error naming the module expected);
  // its gradients accumulate (+=) into the bound gradient storage of module_storage(module).
  Status backward_module(int module, float dloss);
  // After an error of the caller inside a pass that it also put on the stream (so the stream's
  // later work is skipped): forward_module and backward_module no longer require bound storage,
  // and what they enqueue is the module's work as usual, of which only the tensor-parallel
  // collectives run (on whatever the buffers hold), so this rank keeps its place in its group's
  // collectives (docs/offload.md "Faults"). The cpu backend only (its streams run those
  // collectives after a failure); false again once the pass ended.
  Status set_failed_pass(bool failed);
  // Zeroes the grads region (enqueued).
  Status zero_grads();
  // Copies the last forward's per-token losses into pinned slot `slot` (enqueued) ...
  Status copy_losses(int slot);
  // ... and sums them once the stream has passed that copy (synchronize first).
  LossSum loss_sum(int slot) const;

  // ---- Activation slots and stage boundaries (pipeline parallel) --------------------------
  // Selects the activation set that set_batch, forward_module, backward_module and copy_losses
  // use from now on. Each slot keeps its own batch and pass position, so micro-batches may
  // interleave (forward of one between forward and backward of another) in any order in which
  // each slot's own calls are in order.
  Status select_slot(int slot);
  int slot() const;
  int activation_slots() const;
  // The range of modules this model runs (Options::first_module / end_module, or with
  // Options::module_ranges the selected range).
  int first_module() const;
  int end_module() const;
  // With Options::module_ranges: the range the passes of the selected slot run from now on
  // (index into module_ranges). Each slot remembers, per range, whether that range's last
  // forward kept activations (set_batch forgets them all: a new micro-batch), so a chunk's
  // backward may follow other chunks' passes in the same slot. The forward of a range starts at
  // its first module; a backward at its last. Error: no such range.
  Status select_range(int range);
  // Copies slot `from`'s batch (tokens, targets, batch shape and target count) into the selected
  // slot, in stream order, and forgets the selected slot's saved passes, as set_batch does: the
  // batch's next chunk in a slot carved for that chunk (Options::slot_ranges). No-op when `from`
  // is the selected slot. Error: no such slot, or it holds no batch.
  Status share_batch(int from);
  // The residual stream between module `module` - 1 and `module` (1 <= module < num_modules())
  // in the selected slot: (B, T, C) in the working dtype (sequence parallel: this rank's
  // local_rows() token rows of it, (B·T/t, C)), boundary_bytes() long. For a stage
  // [b, e): receive the forward input into boundary_activation(b) before forward_module(b),
  // send boundary_activation(e) after forward_module(e - 1) has run. Null where not allocated.
  void* boundary_activation(int module) const;
  // ∂loss/∂(residual stream) (shared by the slots, working dtype, boundary_bytes() long). Before
  // backward_module(e - 1) of a stage that does not end with the head, it must hold the gradient
  // at the stage's output (receive it here); after backward_module(b) it holds the gradient at
  // boundary_activation(b) (send it).
  void* activation_grad() const;
  // Bytes of one boundary tensor for the selected slot's batch (local_rows()·C working-dtype
  // elements: B·T·C, or B·T/t·C with sequence parallelism).
  std::uint64_t boundary_bytes() const;

  // Device bytes of activations + activation gradients + io buffers allocated at create().
  std::uint64_t activation_bytes() const;
  // Token rows of the residual stream this rank holds for the selected slot's batch: B·T, or
  // B·T/t with sequence parallelism.
  std::int64_t local_rows() const;

  // Activation offload: pinned host bytes of the residual copies (all slots; 0 without offload),
  // and the bytes copied so far each way (cumulative since create(); read on the caller's thread).
  struct ActivationTraffic {
    std::uint64_t to_host = 0;
    std::uint64_t to_device = 0;
  };
  std::uint64_t activation_host_bytes() const;
  ActivationTraffic activation_traffic() const;
  // Tensor parallel: buffer bytes of the collectives the model enqueued on its group since
  // create() (an all-reduce its buffer, a reduce-scatter its input, an all-gather its output, in
  // the dtype they move; forward, backward and recompute alike); 0 without a group. The cost
  // model's StepPrediction::tp_bytes predicts a step's worth.
  std::uint64_t tensor_parallel_bytes() const;

 private:
  struct Impl;
  explicit Model(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ---- Weight files (safetensors) ----------------------------------------------------------------
//
// Two layouts of the same parameters:
//  * kHuggingFace: the export slices of the descriptor table under Hugging Face names and layouts
//    (GPT-2: wte.weight, h.{i}.attn.c_attn.weight as Conv1D (in, out), ...; LLaMA:
//    model.embed_tokens.weight, model.layers.{i}.self_attn.q_proj.weight, ...), vocabulary padding
//    dropped, the Hugging Face config.json (hf_config_json) in the metadata under "config" and
//    "format": "pt". Loads in transformers as it is.
//  * kNative: one tensor per owning parameter under its descriptor name, in storage layout
//    (linear weights (out, in), fused qkv / gate_up, padded vocabulary), metadata "format":
//    "strata" and the full ModelConfig under "strata_model". What a training run saves.
// Tensors are written in the working dtype (F32, BF16 or F16). Writes are atomic (safetensors.hpp).
enum class WeightFormat : std::uint8_t { kHuggingFace, kNative };

// The full config as JSON (every ModelConfig field) and back; errors name `source` and the key.
std::string model_config_to_json(const ModelConfig& config);
Result<ModelConfig> model_config_from_json(std::string_view json, std::string_view source);

// Supplies parameter `index`'s values (fp32, storage layout) for writing.
using ParamSource = std::function<Status(int index, std::vector<float>& values)>;
// Receives parameter `index`'s values (fp32, storage layout) when reading.
using ParamSink = std::function<Status(int index, std::span<const float> values)>;

// Writes every owning parameter of `layout` to `path` in `format`, stored as `dtype`, one
// parameter at a time (the source's values are not held beyond their parameter).
Status write_weights(const ModelLayout& layout, const std::string& path, WeightFormat format, DType dtype,
                     const ParamSource& source);
// write_weights in pieces, for writers that each hold part of the parameters (a pipeline's
// stages fill one file, safetensors.hpp SafetensorsPartWriter). The header is a function of the
// layout, the format and the dtype alone, so every writer computes the same one; a parameter's
// tensors are encoded as write_weights encodes them. Together: write_weights' file, byte for byte.
Result<SafetensorsHeader> weights_header(const ModelLayout& layout, WeightFormat format, DType dtype);
struct EncodedTensor {
  std::string name;
  std::vector<char> bytes;  // the file's bytes of the tensor (dtype, layout, transposition)
};
// Owning parameter `index`'s values (fp32, storage layout) as the file's tensors, in file order.
Status encode_weights(const ModelLayout& layout, int index, WeightFormat format, DType dtype,
                      std::span<const float> values, std::vector<EncodedTensor>& out);
// A rank's part of a parameter, for writers that each hold part of it (tensor-parallel shards,
// stage-3 slices): `count` consecutive elements of the full parameter (storage layout, row-major)
// from element `full_begin`.
struct ElementRun {
  std::int64_t full_begin = 0;
  std::int64_t count = 0;
};
// A shard's elements [begin, end) (its own storage order) as runs of the full parameter: one run
// per stored row piece, adjacent rows merged (a kRows block's rows, a replicated parameter).
std::vector<ElementRun> shard_runs(const ParamDesc& p, std::int64_t begin, std::int64_t end);
// Bytes of a weights file's data section: `bytes` at `offset` (from the data section's start),
// all inside tensor `tensor`.
struct EncodedRange {
  std::string tensor;
  std::uint64_t offset = 0;
  std::vector<char> bytes;
};
// The elements `runs` of owning parameter `index` (their values concatenated in `values`, fp32)
// encoded as encode_weights encodes them (dtype per element, export slices, transposition) and
// placed at their file ranges under `header` (weights_header's for the same layout, format and
// dtype): one range per run of adjacent file bytes within one tensor, in file order. A shard split
// on the stored rows is one range per tensor; a transposed tensor (GPT-2's Conv1D) cut by rows is
// one range per stored column. Elements no tensor stores (vocabulary padding) are skipped. Writers
// whose runs together cover the parameter write encode_weights' bytes.
Status encode_weights_part(const ModelLayout& layout, const SafetensorsHeader& header, int index,
                           WeightFormat format, DType dtype, std::span<const ElementRun> runs,
                           std::span<const float> values, std::vector<EncodedRange>& out);
// The model's working weights (synchronizes its stream), in the model's dtype.
Status save_weights(Model& model, const std::string& path, WeightFormat format);
// The model config a weights file of either format carries. Errors name the path.
Result<ModelConfig> read_weights_config(const std::string& path);
// Reads every owning parameter of `layout` from a file of either format (F32, BF16 or F16
// tensors; GPT-2 names may carry a "transformer." prefix) and hands its values to `sink`, one
// parameter at a time; padded vocabulary rows are zero. Missing tensors and shape mismatches
// are errors naming the tensor and the file.
Status read_weights(const ModelLayout& layout, const std::string& path, const ParamSink& sink);
// Loads a weights file into the model's working weights (the file must describe the same shapes).
Status load_weights(Model& model, const std::string& path);

}  // namespace strata
