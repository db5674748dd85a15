// The model on a device: parameter/gradient placement from the descriptor table, activation
// buffers, and the forward and backward passes of the GPT-2 and LLaMA blocks as kernel calls in
// stream order.
//
// Activation memory, per token (C = width, Q = fused qkv width, F = ffn width):
//   residual stream x_0 .. x_L: (L+1)·C, always kept (a block's input is its checkpoint);
//   per block set: norm1 C, qkv Q, attention out C, mid-residual C, norm2 C, ff1 (GELU input /
//     SwiGLU gate|up) 4C | 2F, ff2 (GELU output / SwiGLU output) 4C | F, plus fp32 statistics;
//     L sets, or one shared set with activation checkpointing (block l is recomputed into it just
//     before its backward);
//   head: final norm C, logits Vp (its gradient overwrites it in place), loss and lse.
// Pipeline stages (Options::first_module / end_module) carve only the residuals and block sets
// of their modules, and the head's buffers only with the head; Options::activation_slots sets of
// all of it (plus tokens, targets and losses) let several micro-batches wait for their backward.
// Activation gradients need one set shared by all blocks: the residual-stream gradient (updated
// in place: every op that feeds the residual adds its input gradient into it), and scratch for
// the norm, qkv, attention and MLP gradients.
//
// Tensor parallel (layout.tp.size > 1): H, Hkv, F, Q and the vocabulary rows are the shard's, so
// qkv, attention, MLP and logits buffers shrink by tp; the residual stream and norms stay full
// width on every rank. The conjugate all-reduces (docs/parallel.md) run in stream order through
// tp_all_reduce; the vocabulary-parallel cross-entropy adds (N) row maxima and (2, N) sums.
// With sequence parallelism (Options::sequence_parallel, docs/parallel.md "Sequence parallel")
// the residual stream, the norm outputs and statistics, res2, the final norm and the residual
// gradient hold N/t rows (this rank's), and sp_full (N, C), dln_local (N/t, C) and 4C floats of
// norm gradients are added; the column-parallel entries all-gather, the row-parallel exits and the
// embedding reduce-scatter (tp_all_gather / tp_reduce_scatter), and the norms' parameter
// gradients are summed over the group in backward (sp_add_norm_grads).
//
// Activation offload (Options::offload_activations, docs/offload.md "Activation offload"): the
// residual stream x_lo .. x_hi of a slot is a ring of R = min(kActivationRing, hi - lo + 1)
// device buffers, x_i in buffer i mod R (resid[i] aliases it, so the passes are unchanged), and
// a pinned host copy per index. Forward: before a module writes buffer k it waits for the copy
// stream's last work on k; after a block (or the head) has read x_i, x_i is copied out if a later
// write will evict it (i + R <= hi). Backward: before a module reads x_i it is fetched unless the
// ring still holds it, and x_{i-1} .. x_{i-R+1} are fetched ahead; a fetch waits for the compute
// stream's last use of its buffer (ring_read), the compute stream for the fetch (ring_copied).
// At the end of each pass the compute stream waits for every copy of the slot, so synchronizing
// the compute stream also covers the copy stream's work on the ring. Interleaved (several module
// ranges, slots carved per chunk): a slot's ranges share its ring (R for the largest range), its
// host copies and its bookkeeping, one range at a time; residual indices of different ranges
// never coincide, and a range's backward waits for its copies before the slot takes another
// range. With sequence parallelism the ring buffers, the host copies and every copy hold this
// rank's N/t rows of a residual.
//
// Pipeline stages with sequence parallelism: the boundary tensors are x_first-1 / x_end-1 and
// the residual gradient, all split, so a stage sends and receives this rank's N/t rows
// (boundary_bytes), and the neighbour stage's rank with the same tp coordinate holds the same rows.
#include "strata/model.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "device/backends.hpp"
#include "kernels/bf16.hpp"
#include "model/launcher.hpp"
#include "model/staging.hpp"
#include "strata/device.hpp"
#include "strata/log.hpp"
#include "strata/parallel.hpp"

namespace strata {

using kernels::Accumulate;
using kernels::ConstTensorArg;
using kernels::KernelContext;
using kernels::TensorArg;

namespace {

// A typed device pointer.
struct Tensor {
  void* data = nullptr;
  DType dtype = DType::kF32;

  TensorArg arg() const { return {data, dtype}; }
  ConstTensorArg carg() const { return {data, dtype}; }
  // The tensor starting `elems` elements further on.
  Tensor at(std::int64_t elems) const {
    return {static_cast<char*>(data) + elems * static_cast<std::int64_t>(dtype_size(dtype)), dtype};
  }
};

// Carves one arena block into aligned sub-buffers. First pass (base == nullptr) only measures.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  void* take(std::uint64_t bytes) {
    void* p = base_ == nullptr ? nullptr : base_ + used_;
    used_ = align_up(used_ + std::max<std::uint64_t>(bytes, 1), kParamAlignment);
    return p;
  }
  Tensor tensor(std::int64_t elems, DType dtype) {
    return {take(static_cast<std::uint64_t>(elems) * dtype_size(dtype)), dtype};
  }
  float* floats(std::int64_t n) { return static_cast<float*>(take(static_cast<std::uint64_t>(n) * 4)); }
  std::int32_t* ints(std::int64_t n) {
    return static_cast<std::int32_t*>(take(static_cast<std::uint64_t>(n) * 4));
  }
  std::uint64_t used() const { return used_; }
  // Carves the next tensors from `to` again: what follows aliases what was carved after it.
  void rewind(std::uint64_t to) { used_ = to; }

 private:
  char* base_;
  std::uint64_t used_ = 0;
};

// The activations one block keeps for its backward.
struct BlockActs {
  Tensor norm1, qkv, atty, res2, norm2, ff1, ff2;
  float *mean1 = nullptr, *rstd1 = nullptr, *mean2 = nullptr, *rstd2 = nullptr, *lse = nullptr;
};

// A block's parameters, bound by name from the descriptor table (-1 where the kind has none).
struct BlockParams {
  int norm1_w = -1, norm1_b = -1, qkv_w = -1, qkv_b = -1, proj_w = -1, proj_b = -1;
  int norm2_w = -1, norm2_b = -1, fc_w = -1, fc_b = -1, fcproj_w = -1, fcproj_b = -1;
};

struct EmbedHeadParams {
  int wte = -1, wpe = -1, norm_w = -1, norm_b = -1, lm_head = -1;
};

// One activation slot: everything a micro-batch keeps between its forward and its backward,
// and its position in the passes. Model::Impl derives from it: the inherited members are the
// selected slot's (the passes use them by name); select() parks them in `parked` and brings
// another slot's in.
struct ActState {
  ArenaBuffer act_block;        // this slot's activations (one arena block)
  std::vector<Tensor> resid;    // L+1 of (Bmax·Tmax, C); null outside the model's module range
  std::vector<BlockActs> sets;  // L, or 1 with checkpointing; empty blocks outside the range
  Tensor final_norm, logits;
  float *final_mean = nullptr, *final_rstd = nullptr, *losses = nullptr, *ce_lse = nullptr;
  float *ce_max = nullptr, *ce_sums = nullptr;  // tensor parallel: (N) and (2, N), see kernels.hpp
  std::int32_t *tokens = nullptr, *targets = nullptr;
  std::int64_t B = 0, T = 0, target_count = 0;
  bool have_batch = false;
  bool forward_saved = false;  // the last forward kept what backward needs
  int cached_block = -1;       // with checkpointing: the block whose activations the shared set holds
  int next_forward = 0;        // the module forward_module() expects next
  int next_backward = -1;      // the module backward_module() expects next (-1: none)
  // Per module range (Options::module_ranges; one entry without): its last forward kept
  // activations for backward and its backward has not consumed them yet.
  std::vector<char> range_saved;
  // Activation offload (empty without): the pinned host copies of residual indices [lo, hi]; per
  // ring buffer the index it holds (-1: none), the compute stream's last use of it, the copy
  // stream's last copy into or out of it and whether the compute stream has yet to wait for that;
  // per residual index whether the host copy is this pass's.
  ArenaBuffer host_block;
  std::vector<std::int64_t> ring_holds;
  std::vector<std::unique_ptr<Event>> ring_read, ring_copied;
  std::vector<char> ring_pending;
  std::vector<char> on_host;
};

}  // namespace

struct Model::Impl : ActState {
  // A batch of b x t tokens (`count` targets) now fills the selected slot: no forward ran on it.
  void batch_arrived(std::int64_t b, std::int64_t t, std::int64_t count) {
    B = b;
    T = t;
    target_count = count;
    have_batch = true;
    forward_saved = false;
    next_forward = first;
    next_backward = -1;
    std::fill(range_saved.begin(), range_saved.end(), 0);
  }
  ModelLayout layout;
  Device* device = nullptr;
  Stream* stream = nullptr;
  Options options;
  std::unique_ptr<detail::KernelLauncher> launch;
  DType wdt = DType::kF32;
  std::int64_t Bmax = 0, Tmax = 0;
  // Sizes this rank computes with: with tensor parallelism H, Hkv, F and Q are the shard's
  // (heads, kv heads and MLP width over tp) and Vp is the shard's vocabulary rows, starting at
  // full row vocab_begin; C and V (the real vocabulary) are always the full model's.
  std::int64_t C = 0, H = 0, Hkv = 0, D = 0, F = 0, Q = 0, V = 0, Vp = 0, vocab_begin = 0;
  bool gpt2 = true;
  Comm* tp = nullptr;  // the tensor-parallel group; null for the whole model
  // Buffer bytes of the collectives enqueued on `tp` (tensor_parallel_bytes()).
  std::atomic<std::uint64_t> tp_bytes{0};
  int tp_rank = 0;
  // Sequence parallel: t (the token rows of the residual stream, norms and residual adds are
  // split t ways), else 1. sp_full (Bmax·Tmax, C) is the one full-rows buffer the split regions'
  // collectives gather into and reduce-scatter from (used in stream order within one module's
  // work, so one serves every block and slot); dln_local (Bmax·Tmax/t, C) the reduce-scattered
  // norm input gradient; norm_grads (4C fp32) a block's (or the head's) norm parameter gradients
  // over this rank's tokens, summed over the group before they are added to the gradients.
  std::int64_t sp = 1;
  Tensor sp_full, dln_local;
  float* norm_grads = nullptr;

  char* params = nullptr;  // the model.params region when the model owns its storage, else null
  float* grads = nullptr;  // the model.grads region likewise
  // Bindings: device pointers to module m's own parameter range [param_begin, param_end) and
  // gradient range [grad_begin, grad_end), null while unbound. owner[i]: the module whose
  // storage parameter i lives in (a tied alias: its target's module). storage[m]: the modules
  // whose storage module m reads, m first.
  std::vector<char*> unit_params;
  std::vector<float*> unit_grads;
  std::vector<int> owner;
  std::vector<std::vector<int>> storage;
  int first = 0, end = 0;  // the module range [first, end) the passes run (the selected range)
  // Every range the model runs (Options::module_ranges, or the one [first, end)); activations are
  // carved for all of them. `range`: the selected one.
  std::vector<std::pair<int, int>> ranges;
  int range = 0;
  std::vector<ActState> parked;  // per slot; the selected slot's entry is empty (its state is *this)
  int current = 0;               // the selected slot
  EmbedHeadParams eh;
  std::vector<BlockParams> blocks;

  ArenaBuffer grad_block, io_block, sp_block;  // sp_block: sp_full's storage (sequence parallel)
  float* rope = nullptr;
  Tensor dres, dln, dqkv, datty, dff1, dff2;

  ArenaBuffer pinned_tokens, pinned_losses;
  std::unique_ptr<detail::HostStager> stager;
  std::unique_ptr<Event> tokens_copied;
  // set_failed_pass: the stream failed in this pass; module calls skip check_bound.
  bool failed_pass = false;
  std::vector<std::int64_t> slot_rows, slot_counts;
  // Activation offload: ring buffers per slot (0: off), the copy stream, bytes moved.
  int ring = 0;
  Stream* copy_stream = nullptr;
  std::uint64_t host_stride = 0;  // bytes of one residual index in host_block (Bmax·Tmax/sp·C)
  Model::ActivationTraffic traffic;

  void select(int slot) {
    if (slot == current) return;
    std::swap(static_cast<ActState&>(*this), parked[static_cast<std::size_t>(current)]);
    std::swap(static_cast<ActState&>(*this), parked[static_cast<std::size_t>(slot)]);
    current = slot;
  }
  // The residual-stream index range [lo, hi] the module range reads and writes.
  std::int64_t resid_lo() const { return std::max(first - 1, 0); }
  std::int64_t resid_hi() const { return std::min<std::int64_t>(end - 1, layout.config.n_layer); }

  Tensor P(int i) const {
    const auto& p = layout.params[static_cast<std::size_t>(i)];
    const int m = owner[static_cast<std::size_t>(i)];
    char* base = unit_params[static_cast<std::size_t>(m)];
    if (base == nullptr) return {nullptr, wdt};
    return {base + (p.param_offset - layout.modules[static_cast<std::size_t>(m)].param_begin), wdt};
  }
  ConstTensorArg Pc(int i) const { return i < 0 ? kernels::kNone : P(i).carg(); }
  Tensor G(int i) const {
    if (i < 0) return {};
    const auto& p = layout.params[static_cast<std::size_t>(i)];
    const int m = owner[static_cast<std::size_t>(i)];
    float* base = unit_grads[static_cast<std::size_t>(m)];
    if (base == nullptr) return {};
    return {reinterpret_cast<char*>(base) + (p.grad_offset - layout.modules[static_cast<std::size_t>(m)].grad_begin),
            DType::kF32};
  }
  void describe_storage();
  Status check_bound(int m, bool grads_needed) const;
  Status forward_module(int m, bool for_backward);
  Status backward_module(int m, float dloss);
  BlockActs& acts(int layer) { return sets.size() == 1 ? sets[0] : sets[static_cast<std::size_t>(layer)]; }

  Status bind_params();
  // Carves one slot: the batch and losses, then the activations of `slot_ranges` (indices into
  // `ranges`), aliased when the slots are carved per chunk (Options::slot_ranges).
  void carve_activations(Carver& c, bool with_grads, const std::vector<int>& slot_ranges);
  Status block_forward(int l, const BlockActs& A, bool recompute);
  Status block_backward(int l, const BlockActs& A);
  // Activation offload around one module (no-ops without it); see the file comment.
  Status offload_before_forward(int m);
  Status offload_after_forward(int m, bool for_backward);
  Status offload_before_backward(int m);
  Status offload_after_backward(int m);
  int ring_of(std::int64_t i) const { return static_cast<int>(i % ring); }
  // The residual index module m reads (block l: l, head: L) and writes (embedding 0, block l:
  // l + 1); -1 where it has none.
  std::int64_t reads_resid(int m) const;
  std::int64_t writes_resid(int m) const;
  Status fetch_resid(std::int64_t i);
  Status await_ring(int k);
  Status await_all_copies();
  // Tensor parallel: `buf` (n elements) summed (or max-reduced) over the group in place, in
  // stream order. No-op without a group.
  Status tp_all_reduce(const char* label, Tensor buf, std::int64_t n, ReduceOp op = ReduceOp::kSum);
  // Sequence parallel, in stream order: `full` (t·n elements, block r being rank r's rows)
  // summed over the group into this rank's `local` (n elements); and the conjugate, every rank's
  // `local` (n) gathered into `full` in rank order.
  Status tp_reduce_scatter(const char* label, Tensor full, Tensor local, std::int64_t n);
  Status tp_all_gather(const char* label, Tensor local, Tensor full, std::int64_t n);
  // Adds a collective's buffer (`elements` of `dtype`: an all-reduce its buffer, a
  // reduce-scatter its input, an all-gather its output) to tp_bytes.
  void count_tp(std::size_t elements, DType dtype) {
    tp_bytes.fetch_add(elements * dtype_size(dtype), std::memory_order_relaxed);
  }
  // Runs `op` (a collective on the group) in the stream's order and waits for it.
  template <class Op>
  Status tp_collective(const char* label, Op op);
  // Sequence parallel: the norm parameter gradients in norm_grads (slots of C floats, `grads[i]`
  // receiving slot i; a null gradient skips its slot) summed over the group, then added to the
  // gradients. One all-reduce of slots·C floats.
  Status sp_add_norm_grads(const char* label, std::vector<Tensor> grads);
  bool tp_rank0() const { return tp_rank == 0; }
  // Rows of the residual stream this rank computes on for the current batch.
  std::int64_t local_rows() const { return B * T / sp; }
};

template <class Op>
Status Model::Impl::tp_collective(const char* label, Op op) {
  if (launch->is_cpu()) {
    // The stream's worker runs the collective and waits for it: later kernels of the stream see
    // the result, and the ranks' streams meet here in the same order (they enqueue the same
    // modules). It runs even after an earlier operation of the stream failed (its data is then
    // garbage, and the stream's error fails the pass): a failing rank keeps its place in the
    // pass, so its peers are never left inside a collective it skipped, and every rank reaches
    // the pass-end agreement on the failure (docs/offload.md "Faults").
    return detail::host_fn_after_failure(*stream, label,
                                         [=]() -> Status { return op().wait().with_context(label); });
  }
  // cuda: the Comm's own stream is not ordered with this one, so the host waits for the compute
  // stream, runs the collective and waits for it before enqueueing more work (no overlap yet).
  STRATA_RETURN_IF_ERROR(stream->synchronize());
  return op().wait().with_context(label);
}

Status Model::Impl::tp_all_reduce(const char* label, Tensor buf, std::int64_t n, ReduceOp op) {
  if (tp == nullptr) return ok_status();
  Comm* comm = tp;
  const auto count = static_cast<std::size_t>(n);
  count_tp(count, buf.dtype);
  return tp_collective(label, [=] { return comm->all_reduce(buf.data, buf.data, count, buf.dtype, op); });
}

Status Model::Impl::tp_reduce_scatter(const char* label, Tensor full, Tensor local, std::int64_t n) {
  Comm* comm = tp;
  const auto count = static_cast<std::size_t>(n);
  count_tp(count * static_cast<std::size_t>(comm->size()), full.dtype);
  return tp_collective(
      label, [=] { return comm->reduce_scatter(full.data, local.data, count, full.dtype, ReduceOp::kSum); });
}

Status Model::Impl::tp_all_gather(const char* label, Tensor local, Tensor full, std::int64_t n) {
  Comm* comm = tp;
  const auto count = static_cast<std::size_t>(n);
  count_tp(count * static_cast<std::size_t>(comm->size()), local.dtype);
  return tp_collective(label, [=] { return comm->all_gather(local.data, full.data, count, local.dtype); });
}

Status Model::Impl::sp_add_norm_grads(const char* label, std::vector<Tensor> grads) {
  const std::int64_t C_ = C;
  const auto slots = static_cast<std::int64_t>(grads.size());
  float* scratch = norm_grads;
  STRATA_RETURN_IF_ERROR(tp_all_reduce(label, Tensor{scratch, DType::kF32}, slots * C_));
  return launch->run("sequence parallel: add norm gradients", [=](const KernelContext& ctx) -> Status {
    for (std::int64_t i = 0; i < slots; ++i) {
      const Tensor g = grads[static_cast<std::size_t>(i)];
      if (g.data == nullptr) continue;
      STRATA_RETURN_IF_ERROR(kernels::residual_backward(ctx, g.arg(), kernels::kNoOutput,
                                                        ConstTensorArg{scratch + i * C_, DType::kF32}, C_,
                                                        Accumulate::kAdd));
    }
    return ok_status();
  });
}

// ---- construction ----------------------------------------------------------------------------

Status Model::Impl::bind_params() {
  auto need = [&](const std::string& name, int* slot) -> Status {
    *slot = layout.find(name);
    if (*slot < 0) return internal_error("model: the layout has no parameter '" + name + "'");
    return ok_status();
  };
  blocks.resize(static_cast<std::size_t>(layout.config.n_layer));
  if (gpt2) {
    STRATA_RETURN_IF_ERROR(need("wte.weight", &eh.wte));
    STRATA_RETURN_IF_ERROR(need("wpe.weight", &eh.wpe));
    STRATA_RETURN_IF_ERROR(need("ln_f.weight", &eh.norm_w));
    STRATA_RETURN_IF_ERROR(need("ln_f.bias", &eh.norm_b));
    STRATA_RETURN_IF_ERROR(need("lm_head.weight", &eh.lm_head));
    for (std::size_t l = 0; l < blocks.size(); ++l) {
      const std::string h = "h." + std::to_string(l) + ".";
      BlockParams& b = blocks[l];
      STRATA_RETURN_IF_ERROR(need(h + "ln_1.weight", &b.norm1_w));
      STRATA_RETURN_IF_ERROR(need(h + "ln_1.bias", &b.norm1_b));
      STRATA_RETURN_IF_ERROR(need(h + "attn.c_attn.weight", &b.qkv_w));
      STRATA_RETURN_IF_ERROR(need(h + "attn.c_attn.bias", &b.qkv_b));
      STRATA_RETURN_IF_ERROR(need(h + "attn.c_proj.weight", &b.proj_w));
      STRATA_RETURN_IF_ERROR(need(h + "attn.c_proj.bias", &b.proj_b));
      STRATA_RETURN_IF_ERROR(need(h + "ln_2.weight", &b.norm2_w));
      STRATA_RETURN_IF_ERROR(need(h + "ln_2.bias", &b.norm2_b));
      STRATA_RETURN_IF_ERROR(need(h + "mlp.c_fc.weight", &b.fc_w));
      STRATA_RETURN_IF_ERROR(need(h + "mlp.c_fc.bias", &b.fc_b));
      STRATA_RETURN_IF_ERROR(need(h + "mlp.c_proj.weight", &b.fcproj_w));
      STRATA_RETURN_IF_ERROR(need(h + "mlp.c_proj.bias", &b.fcproj_b));
    }
  } else {
    STRATA_RETURN_IF_ERROR(need("model.embed_tokens.weight", &eh.wte));
    STRATA_RETURN_IF_ERROR(need("model.norm.weight", &eh.norm_w));
    STRATA_RETURN_IF_ERROR(need("lm_head.weight", &eh.lm_head));
    for (std::size_t l = 0; l < blocks.size(); ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      BlockParams& b = blocks[l];
      STRATA_RETURN_IF_ERROR(need(p + "input_layernorm.weight", &b.norm1_w));
      STRATA_RETURN_IF_ERROR(need(p + "self_attn.qkv_proj.weight", &b.qkv_w));
      STRATA_RETURN_IF_ERROR(need(p + "self_attn.o_proj.weight", &b.proj_w));
      STRATA_RETURN_IF_ERROR(need(p + "post_attention_layernorm.weight", &b.norm2_w));
      STRATA_RETURN_IF_ERROR(need(p + "mlp.gate_up_proj.weight", &b.fc_w));
      STRATA_RETURN_IF_ERROR(need(p + "mlp.down_proj.weight", &b.fcproj_w));
    }
  }
  return ok_status();
}

void Model::Impl::carve_activations(Carver& c, bool with_grads, const std::vector<int>& slot_ranges) {
  const std::int64_t N = Bmax * Tmax;
  const std::int64_t Nl = N / sp;  // rows of the residual stream and norms (all of them without SP)
  const std::int64_t L = layout.config.n_layer;
  const std::int64_t ff1 = gpt2 ? F : 2 * F;
  const int M = static_cast<int>(layout.modules.size());
  const bool shared = layout.config.activation_checkpointing || !with_grads;
  auto carve_set = [&](BlockActs& a) {
    a.norm1 = c.tensor(Nl * C, wdt);
    a.qkv = c.tensor(N * Q, wdt);
    a.atty = c.tensor(N * H * D, wdt);
    a.res2 = c.tensor(Nl * C, wdt);
    a.norm2 = c.tensor(Nl * C, wdt);
    a.ff1 = c.tensor(N * ff1, wdt);
    a.ff2 = c.tensor(N * F, wdt);
    a.mean1 = gpt2 ? c.floats(Nl) : nullptr;
    a.rstd1 = c.floats(Nl);
    a.mean2 = gpt2 ? c.floats(Nl) : nullptr;
    a.rstd2 = c.floats(Nl);
    a.lse = c.floats(N * H);
  };
  // What every range of the slot uses: the batch, the losses (zero rows of a stage without the
  // head: its losses sum to 0) and, with checkpointing, the one block set.
  tokens = c.ints(N);
  targets = c.ints(N);
  losses = c.floats(N);
  sets.assign(shared ? 1 : static_cast<std::size_t>(L), BlockActs{});
  if (shared) carve_set(sets[0]);
  range_saved.assign(ranges.size(), 0);
  resid.assign(static_cast<std::size_t>(L + 1), Tensor{nullptr, wdt});
  final_norm = logits = Tensor{};
  final_mean = final_rstd = ce_lse = ce_max = ce_sums = nullptr;
  // Per range: its residuals, block sets and (with the head) head buffers. A slot carved per
  // chunk (Options::slot_ranges) holds one of its ranges at a time, so they start at the same
  // offset; a slot holding every range at once carves them one after another.
  const bool alias = !options.slot_ranges.empty();
  const std::uint64_t base = c.used();
  std::uint64_t most = base;
  for (int r : slot_ranges) {
    const auto [b, e] = ranges[static_cast<std::size_t>(r)];
    if (alias) c.rewind(base);
    const std::int64_t lo = std::max(b - 1, 0), hi = std::min<std::int64_t>(e - 1, L);
    if (ring > 0) {  // one range, or per-chunk slots whose ranges alias (one live at a time)
      std::vector<Tensor> bufs;
      for (int k = 0; k < ring; ++k) bufs.push_back(c.tensor(Nl * C, wdt));
      for (std::int64_t l = lo; l <= hi; ++l)
        resid[static_cast<std::size_t>(l)] = bufs[static_cast<std::size_t>(l % ring)];
    } else {
      for (std::int64_t l = lo; l <= hi; ++l) resid[static_cast<std::size_t>(l)] = c.tensor(Nl * C, wdt);
    }
    for (int module = std::max(b, 1); !shared && module < e && module <= L; ++module) {
      carve_set(sets[static_cast<std::size_t>(module - 1)]);  // block l is module l + 1
    }
    if (e == M) {
      final_norm = c.tensor(Nl * C, wdt);
      final_mean = gpt2 ? c.floats(Nl) : nullptr;
      final_rstd = c.floats(Nl);
      logits = c.tensor(N * Vp, wdt);
      ce_lse = c.floats(N);
      if (tp != nullptr) {
        ce_max = c.floats(N);
        ce_sums = c.floats(2 * N);
      }
    }
    most = std::max(most, c.used());
  }
  c.rewind(most);
}

std::vector<RegionSpec> Model::regions(const ModelLayout& layout, const Options& options) {
  std::vector<RegionSpec> r;
  if (!options.own_storage) return r;
  r.push_back(RegionSpec{"model.params", std::max<std::uint64_t>(layout.param_bytes, kParamAlignment), 0, 0});
  if (options.with_grads) {
    r.push_back(RegionSpec{"model.grads", std::max<std::uint64_t>(layout.grad_bytes, kParamAlignment), 0, 0});
  }
  return r;
}

Model::Model(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Model::~Model() {
  if (impl_ && impl_->copy_stream != nullptr) {
    Status s = impl_->copy_stream->synchronize();
    if (!s.ok()) {
      STRATA_LOG(kWarn, kModel) << "model: unreported activation copy error at destruction: "
                                << s.to_string();
    }
  }
  if (impl_ && impl_->stream != nullptr) {
    Status s = impl_->stream->synchronize();
    if (!s.ok()) {
      STRATA_LOG(kWarn, kModel) << "model: unreported stream error at destruction: " << s.to_string();
    }
  }
}

Result<std::unique_ptr<Model>> Model::create(ModelLayout layout, Device& device, Stream& stream,
                                             const Options& options) {
  STRATA_RETURN_IF_ERROR(layout.is_valid());
  const ModelConfig& cfg = layout.config;
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.device = &device;
  m.stream = &stream;
  m.options = options;
  m.gpt2 = cfg.kind == ModelKind::kGpt2;
  m.wdt = cfg.dtype;
  m.Bmax = options.max_batch;
  m.Tmax = options.max_seq_len > 0 ? options.max_seq_len : cfg.n_positions;
  if (m.Bmax < 1)
    return invalid_argument("model: max_batch = " + std::to_string(m.Bmax) + " must be at least 1");
  if (m.Tmax > cfg.n_positions) {
    return invalid_argument("model: max_seq_len = " + std::to_string(m.Tmax) +
                            " exceeds the context length n_positions = " + std::to_string(cfg.n_positions));
  }
  if (options.loss_slots < 1) return invalid_argument("model: loss_slots must be at least 1");
  if (options.activation_slots < 1) {
    return invalid_argument("model: activation_slots = " + std::to_string(options.activation_slots) +
                            " must be at least 1");
  }
  {
    const int M = static_cast<int>(layout.modules.size());
    const int e = options.end_module < 0 ? M : options.end_module;
    if (options.first_module < 0 || e > M || options.first_module >= e) {
      return invalid_argument("model: module range [first_module = " + std::to_string(options.first_module) +
                              ", end_module = " + std::to_string(options.end_module) + ") is not a non-empty range of the " +
                              std::to_string(M) + " modules");
    }
    m.first = options.first_module;
    m.end = e;
    m.ranges = {{m.first, m.end}};
    if (!options.module_ranges.empty()) {
      if (options.first_module != 0 || options.end_module != -1) {
        return invalid_argument(
            "model: Options::module_ranges with first_module / end_module set: give one or the other");
      }
      // Activation offload keeps one ring and one set of host copies per slot, used by one range
      // at a time: the slots must be carved per chunk.
      if (options.offload_activations && options.slot_ranges.empty()) {
        return invalid_argument(
            "model: several module ranges with activation offload need activation slots carved per chunk "
            "(Options::slot_ranges): a slot's device ring holds one range's block inputs at a time");
      }
      int prev_end = -1;
      for (const auto& [b, e2] : options.module_ranges) {
        if (b < 0 || e2 > M || b >= e2 || b <= prev_end) {
          return invalid_argument("model: module range [" + std::to_string(b) + ", " + std::to_string(e2) +
                                  ") of Options::module_ranges is empty, outside the " + std::to_string(M) +
                                  " modules or not after the previous range with a gap");
        }
        prev_end = e2;
      }
      m.ranges = options.module_ranges;
      m.first = m.ranges.front().first;
      m.end = m.ranges.front().second;
    }
    if (!options.slot_ranges.empty()) {
      if (options.module_ranges.empty() ||
          static_cast<int>(options.slot_ranges.size()) != options.activation_slots) {
        return invalid_argument(
            "model: Options::slot_ranges lists " + std::to_string(options.slot_ranges.size()) +
            " slots; it needs Options::module_ranges and one entry per activation slot (" +
            std::to_string(options.activation_slots) + ")");
      }
      for (std::size_t k = 0; k < options.slot_ranges.size(); ++k) {
        const auto& list = options.slot_ranges[k];
        for (std::size_t i = 0; i < list.size(); ++i) {
          if (list[i] < 0 || list[i] >= static_cast<int>(m.ranges.size()) ||
              (i > 0 && list[i] <= list[i - 1])) {
            return invalid_argument("model: Options::slot_ranges[" + std::to_string(k) +
                                    "] is not an increasing list of module range indices below " +
                                    std::to_string(m.ranges.size()));
          }
        }
        if (list.empty()) {
          return invalid_argument("model: Options::slot_ranges[" + std::to_string(k) + "] holds no range");
        }
      }
    }
  }
  if (options.offload_activations && !cfg.activation_checkpointing) {
    return invalid_argument(
        "model: activation offload (activation_checkpointing.cpu_checkpointing / --offload-activations) "
        "keeps "
        "the checkpointed block inputs on the host and needs activation checkpointing: set "
        "ModelConfig::activation_checkpointing (--checkpointing on)");
  }
  const TensorParallel tpl = layout.tp;
  if (tpl.size > 1) {
    if (options.tensor_parallel == nullptr || options.tensor_parallel->size() != tpl.size ||
        options.tensor_parallel->rank() != tpl.rank) {
      return invalid_argument("model: the layout is tensor-parallel shard " + std::to_string(tpl.rank) + " of " +
                              std::to_string(tpl.size) +
                              "; Options::tensor_parallel must be a group of that size with this rank at that rank");
    }
    if (cfg.dtype != DType::kF32 && cfg.dtype != DType::kBF16) {
      return invalid_argument("model: tensor parallel runs f32 or bf16 models (the collectives' dtypes), not " +
                              std::string(to_string(cfg.dtype)));
    }
    m.tp = options.tensor_parallel;
    m.tp_rank = tpl.rank;
  }
  if (options.sequence_parallel) {
    const std::string sp_key = "model: sequence parallel (strata.sequence_parallel)";
    if (tpl.size < 2) {
      return invalid_argument(
          sp_key +
          " splits the tokens over the tensor-parallel group and needs a "
          "tensor-parallel layout (strata.tensor_parallel_size > 1); this layout is the whole model");
    }
    if (m.Tmax % tpl.size != 0) {
      return invalid_argument(sp_key + ": max_seq_len (seq_len) = " + std::to_string(m.Tmax) +
                              " is not a multiple of tensor_parallel_size = " + std::to_string(tpl.size));
    }
    // A pipeline stage (first_module / end_module) and activation offload need nothing more:
    // the residual stream is this rank's rows everywhere, so the stage boundary tensors
    // (boundary_activation, activation_grad) and the offloaded block inputs are too.
    m.sp = tpl.size;
  }
  const std::int64_t t = tpl.size;
  m.C = cfg.n_embd;
  m.H = cfg.n_head / t;
  m.Hkv = cfg.kv_heads() / t;
  m.D = cfg.head_dim();
  m.F = cfg.ffn() / t;
  m.Q = (m.H + 2 * m.Hkv) * m.D;
  m.V = cfg.vocab_size;
  m.Vp = cfg.padded_vocab() / t;
  m.vocab_begin = m.Vp * tpl.rank;
  m.layout = std::move(layout);
  STRATA_RETURN_IF_ERROR(m.bind_params());

  m.describe_storage();

  Arena& arena = device.memory();
  if (options.plan_arena) {
    std::vector<RegionSpec> plan = regions(m.layout, options);
    plan.insert(plan.end(), options.extra_regions.begin(), options.extra_regions.end());
    STRATA_RETURN_IF_ERROR(arena.plan(plan).with_context("model: planning device memory"));
  }
  if (options.own_storage) {
    STRATA_ASSIGN_OR_RETURN(
        std::uint64_t poff,
        arena.allocate_persistent("model.params", std::max<std::uint64_t>(m.layout.param_bytes, 1)));
    m.params = static_cast<char*>(arena.base()) + poff;
    if (options.with_grads) {
      STRATA_ASSIGN_OR_RETURN(
          std::uint64_t goff,
          arena.allocate_persistent("model.grads", std::max<std::uint64_t>(m.layout.grad_bytes, 1)));
      m.grads = reinterpret_cast<float*>(static_cast<char*>(arena.base()) + goff);
    }
    for (std::size_t u = 0; u < m.layout.modules.size(); ++u) {
      const ModuleDesc& md = m.layout.modules[u];
      m.unit_params[u] = m.params + md.param_begin;
      m.unit_grads[u] =
          m.grads == nullptr ? nullptr : reinterpret_cast<float*>(reinterpret_cast<char*>(m.grads) + md.grad_begin);
    }
  }

  // Activations: measure, allocate once per slot, carve; slot 0 is selected.
  // The residual indices [lo, hi] range r reads and writes (resid_lo/hi of the range selected).
  auto resid_count = [&](int r) -> std::int64_t {
    const auto [b, e] = m.ranges[static_cast<std::size_t>(r)];
    return std::min<std::int64_t>(e - 1, cfg.n_layer) - std::max(b - 1, 0) + 1;
  };
  if (options.offload_activations) {
    // One ring size for every range (interleaved: a slot's ranges share its ring, one at a time);
    // a range with fewer inputs than R keeps them all in the ring.
    std::int64_t most = 0;
    for (std::size_t r = 0; r < m.ranges.size(); ++r) most = std::max(most, resid_count(static_cast<int>(r)));
    m.ring = static_cast<int>(std::min<std::int64_t>(kActivationRing, most));
    // This rank's rows of a residual (all of them without sequence parallelism).
    m.host_stride = static_cast<std::uint64_t>(m.Bmax * m.Tmax / m.sp * m.C) * dtype_size(m.wdt);
    STRATA_ASSIGN_OR_RETURN(m.copy_stream, device.create_stream("model.activation_offload"));
  }
  m.parked.resize(static_cast<std::size_t>(options.activation_slots));
  std::vector<int> every_range(m.ranges.size());
  for (std::size_t r = 0; r < every_range.size(); ++r) every_range[r] = static_cast<int>(r);
  for (int k = options.activation_slots - 1; k >= 0; --k) {
    const std::vector<int>& held =
        options.slot_ranges.empty() ? every_range : options.slot_ranges[static_cast<std::size_t>(k)];
    Carver measure(nullptr);
    m.carve_activations(measure, options.with_grads, held);
    STRATA_ASSIGN_OR_RETURN(m.act_block, device.allocate(measure.used(), "model.activations"));
    Carver carve(static_cast<char*>(m.act_block.data()));
    m.carve_activations(carve, options.with_grads, held);
    if (m.ring > 0) {
      if (options.with_grads) {
        // Host copies for the slot's largest range (its ranges alias them, as their device buffers).
        std::int64_t count = 0;
        for (int r : held) count = std::max(count, resid_count(r));
        STRATA_ASSIGN_OR_RETURN(m.host_block,
                                device.pinned().allocate(static_cast<std::uint64_t>(count) * m.host_stride,
                                                         "model.activations.host"));
      }
      m.ring_holds.assign(static_cast<std::size_t>(m.ring), -1);
      m.ring_pending.assign(static_cast<std::size_t>(m.ring), 0);
      m.on_host.assign(static_cast<std::size_t>(cfg.n_layer + 1), 0);
      m.ring_read.clear();
      m.ring_copied.clear();
      for (int r = 0; r < m.ring; ++r) {
        STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Event> read, device.create_event());
        STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Event> copied, device.create_event());
        m.ring_read.push_back(std::move(read));
        m.ring_copied.push_back(std::move(copied));
      }
    }
    m.next_forward = m.first;
    // A stage without the head copies out losses it never computes: zeros (they add nothing).
    STRATA_RETURN_IF_ERROR(stream.memset_async(m.losses, 0, static_cast<std::uint64_t>(m.Bmax * m.Tmax) * 4));
    if (k > 0) std::swap(static_cast<ActState&>(m), m.parked[static_cast<std::size_t>(k)]);
  }
  m.current = 0;
  const std::int64_t N = m.Bmax * m.Tmax;
  if (options.with_grads) {
    auto carve_grads = [&](Carver& c) {
      // With sequence parallelism the residual gradient holds this rank's rows; dln stays full
      // (a column-parallel layer's input gradient is a partial sum over all rows before the
      // reduce-scatter into dln_local).
      m.dres = c.tensor(N / m.sp * m.C, m.wdt);
      m.dln = c.tensor(N * m.C, m.wdt);
      if (m.sp > 1) {
        m.dln_local = c.tensor(N / m.sp * m.C, m.wdt);
        m.norm_grads = c.floats(4 * m.C);
      }
      m.dqkv = c.tensor(N * m.Q, m.wdt);
      m.datty = c.tensor(N * m.H * m.D, m.wdt);
      m.dff1 = c.tensor(N * (m.gpt2 ? m.F : 2 * m.F), m.wdt);
      m.dff2 = c.tensor(N * m.F, m.wdt);
    };
    Carver measure(nullptr);
    carve_grads(measure);
    STRATA_ASSIGN_OR_RETURN(m.grad_block, device.allocate(measure.used(), "model.activation_grads"));
    Carver carve(static_cast<char*>(m.grad_block.data()));
    carve_grads(carve);
  }
  const std::int64_t rope_floats = m.gpt2 ? 0 : m.Tmax * m.D;
  {
    auto carve_io = [&](Carver& c) {
      m.rope = rope_floats > 0 ? c.floats(rope_floats) : nullptr;
    };
    Carver measure(nullptr);
    carve_io(measure);
    STRATA_ASSIGN_OR_RETURN(m.io_block, device.allocate(measure.used(), "model.io"));
    Carver carve(static_cast<char*>(m.io_block.data()));
    carve_io(carve);
  }
  if (m.sp > 1) {
    // Also needed without gradients (the forward's gathers), shared by the slots.
    const std::uint64_t bytes = static_cast<std::uint64_t>(N * m.C) * dtype_size(m.wdt);
    STRATA_ASSIGN_OR_RETURN(m.sp_block, device.allocate(bytes, "model.sequence_parallel"));
    m.sp_full = Tensor{m.sp_block.data(), m.wdt};
  }

  // Pinned staging: token batches, per-slot losses, and a parameter staging buffer.
  PinnedPool& pinned = device.pinned();
  STRATA_ASSIGN_OR_RETURN(m.pinned_tokens,
                          pinned.allocate(static_cast<std::uint64_t>(2 * N) * 4, "model.tokens"));
  STRATA_ASSIGN_OR_RETURN(
      m.pinned_losses,
      pinned.allocate(static_cast<std::uint64_t>(N * options.loss_slots) * 4, "model.losses"));
  std::uint64_t largest = static_cast<std::uint64_t>(rope_floats) * 4;
  for (const auto& p : m.layout.params)
    largest = std::max(largest, static_cast<std::uint64_t>(p.numel()) * 4);
  STRATA_ASSIGN_OR_RETURN(
      m.stager, detail::HostStager::create(device, stream, std::min<std::uint64_t>(largest, 16u << 20),
                                           "model.staging"));
  STRATA_ASSIGN_OR_RETURN(m.tokens_copied, device.create_event());
  m.slot_rows.assign(static_cast<std::size_t>(options.loss_slots), 0);
  m.slot_counts.assign(static_cast<std::size_t>(options.loss_slots), 0);

  std::uint64_t workspace = 0;
  if (device.kind() == DeviceKind::kCuda) {
    kernels::AttentionShape shape{m.Bmax, m.Tmax, m.H, m.Hkv, m.D, m.Q, m.Q, m.Q, 0.0f};
    workspace =
        std::max({kernels::matmul_workspace_bytes(kernels::Backend::kCuda),
                  kernels::attention_backward_workspace_bytes(kernels::Backend::kCuda, shape),
                  kernels::embedding_backward_workspace_bytes(kernels::Backend::kCuda, m.Bmax, m.Tmax)});
  }
  STRATA_ASSIGN_OR_RETURN(m.launch, detail::KernelLauncher::create(device, stream, workspace));

  // Parameters and gradients start at zero (the arena's pages are not guaranteed to be).
  if (m.params != nullptr) STRATA_RETURN_IF_ERROR(stream.memset_async(m.params, 0, m.layout.param_bytes));
  if (m.grads != nullptr) STRATA_RETURN_IF_ERROR(stream.memset_async(m.grads, 0, m.layout.grad_bytes));
  if (rope_floats > 0) {
    std::vector<float> table(static_cast<std::size_t>(rope_floats));
    STRATA_RETURN_IF_ERROR(kernels::rope_table(table.data(), m.Tmax, m.D, cfg.rope_theta));
    STRATA_RETURN_IF_ERROR(m.stager->upload(m.rope, table.data(), table.size() * 4));
  }
  STRATA_RETURN_IF_ERROR(stream.synchronize());
  return std::unique_ptr<Model>(new Model(std::move(impl)));
}

// ---- accessors and host transfers --------------------------------------------------------------

const ModelLayout& Model::layout() const { return impl_->layout; }
Device& Model::device() { return *impl_->device; }
Stream& Model::stream() { return *impl_->stream; }
void* Model::param_data(int index) const { return impl_->P(index).data; }
float* Model::grad_data(int index) const { return static_cast<float*>(impl_->G(index).data); }
void* Model::params_base() const { return impl_->params; }
float* Model::grads_base() const { return impl_->grads; }

std::uint64_t Model::activation_bytes() const {
  std::uint64_t acts = impl_->act_block.size();
  for (const ActState& a : impl_->parked) acts += a.act_block.size();  // the selected slot's entry is empty
  return acts + (impl_->grad_block ? impl_->grad_block.size() : 0) + impl_->io_block.size() +
         (impl_->sp_block ? impl_->sp_block.size() : 0);
}

std::int64_t Model::local_rows() const { return impl_->local_rows(); }

std::uint64_t Model::activation_host_bytes() const {
  std::uint64_t bytes = impl_->host_block ? impl_->host_block.size() : 0;
  for (const ActState& a : impl_->parked) bytes += a.host_block ? a.host_block.size() : 0;
  return bytes;
}

Model::ActivationTraffic Model::activation_traffic() const { return impl_->traffic; }

std::uint64_t Model::tensor_parallel_bytes() const { return impl_->tp_bytes.load(std::memory_order_relaxed); }

Status Model::select_slot(int slot) {
  if (slot < 0 || slot >= static_cast<int>(impl_->parked.size())) {
    return invalid_argument("select_slot: no activation slot " + std::to_string(slot) + " (the model has " +
                            std::to_string(impl_->parked.size()) + ", Options::activation_slots)");
  }
  impl_->select(slot);
  return ok_status();
}
int Model::slot() const { return impl_->current; }
int Model::activation_slots() const { return static_cast<int>(impl_->parked.size()); }
int Model::first_module() const { return impl_->first; }
int Model::end_module() const { return impl_->end; }

Status Model::select_range(int range) {
  Impl& m = *impl_;
  if (range < 0 || range >= static_cast<int>(m.ranges.size())) {
    return invalid_argument("select_range: no module range " + std::to_string(range) + " (the model has " +
                            std::to_string(m.ranges.size()) + ", Options::module_ranges)");
  }
  if (!m.options.slot_ranges.empty()) {
    const auto& held = m.options.slot_ranges[static_cast<std::size_t>(m.current)];
    if (std::find(held.begin(), held.end(), range) == held.end()) {
      return failed_precondition("select_range: activation slot " + std::to_string(m.current) +
                                 " is not carved for module range " + std::to_string(range) +
                                 " (Options::slot_ranges)");
    }
  }
  m.range = range;
  m.first = m.ranges[static_cast<std::size_t>(range)].first;
  m.end = m.ranges[static_cast<std::size_t>(range)].second;
  const bool saved = m.range_saved[static_cast<std::size_t>(range)] != 0;
  m.next_forward = m.first;
  m.forward_saved = saved;
  m.next_backward = saved ? m.end - 1 : -1;
  return ok_status();
}

Status Model::share_batch(int from) {
  Impl& m = *impl_;
  if (from < 0 || from >= static_cast<int>(m.parked.size())) {
    return invalid_argument("share_batch: no activation slot " + std::to_string(from) + " (the model has " +
                            std::to_string(m.parked.size()) + ")");
  }
  if (from == m.current) return ok_status();
  const ActState& src = m.parked[static_cast<std::size_t>(from)];
  if (!src.have_batch)
    return failed_precondition("share_batch: slot " + std::to_string(from) + " holds no batch");
  const std::uint64_t bytes = static_cast<std::uint64_t>(src.B * src.T) * 4;
  STRATA_RETURN_IF_ERROR(m.stream->copy_async(m.tokens, src.tokens, bytes, CopyKind::kDeviceToDevice));
  STRATA_RETURN_IF_ERROR(m.stream->copy_async(m.targets, src.targets, bytes, CopyKind::kDeviceToDevice));
  m.batch_arrived(src.B, src.T, src.target_count);
  return ok_status();
}

void* Model::boundary_activation(int module) const {
  const Impl& m = *impl_;
  if (module < 1 || module >= num_modules()) return nullptr;
  return m.resid[static_cast<std::size_t>(module - 1)].data;
}
void* Model::activation_grad() const { return impl_->dres.data; }
std::uint64_t Model::boundary_bytes() const {
  const Impl& m = *impl_;
  return static_cast<std::uint64_t>(m.local_rows() * m.C) * dtype_size(m.wdt);
}

Status Model::upload_param(int index, std::span<const float> values) {
  Impl& m = *impl_;
  if (index < 0 || index >= static_cast<int>(m.layout.params.size())) {
    return invalid_argument("upload_param: no parameter with index " + std::to_string(index));
  }
  const ParamDesc& p = m.layout.params[static_cast<std::size_t>(index)];
  if (static_cast<std::int64_t>(values.size()) != p.numel()) {
    return invalid_argument("upload_param '" + p.name + "': got " + std::to_string(values.size()) +
                            " values for " + std::to_string(p.numel()) + " elements");
  }
  char* dst = static_cast<char*>(m.P(index).data);
  if (p.dtype == DType::kF32) return m.stager->upload(dst, values.data(), values.size() * 4);
  return m.stager->upload(dst, values.size() * 2, [&](void* chunk, std::uint64_t offset, std::uint64_t n) {
    auto* out = static_cast<std::uint16_t*>(chunk);
    const float* in = values.data() + offset / 2;
    if (p.dtype == DType::kF16) {
      for (std::uint64_t i = 0; i < n / 2; ++i) out[i] = kernels::f32_to_f16_bits_rne(in[i]);
    } else {
      for (std::uint64_t i = 0; i < n / 2; ++i) out[i] = kernels::f32_to_bf16_bits_rne(in[i]);
    }
  });
}

Status Model::initialize(std::uint64_t seed) {
  std::vector<float> values;
  for (std::size_t i = 0; i < impl_->layout.params.size(); ++i) {
    const ParamDesc& p = impl_->layout.params[i];
    if (!p.owns_storage()) continue;
    values.resize(static_cast<std::size_t>(p.numel()));
    init_values(impl_->layout, static_cast<int>(i), seed, 0, p.numel(), values.data());
    STRATA_RETURN_IF_ERROR(upload_param(static_cast<int>(i), values));
  }
  return impl_->stream->synchronize();
}

Status Model::download_param_bytes(int index, void* dst, std::uint64_t bytes) {
  Impl& m = *impl_;
  if (index < 0 || index >= static_cast<int>(m.layout.params.size())) {
    return invalid_argument("download_param: no parameter with index " + std::to_string(index));
  }
  const ParamDesc& p = m.layout.params[static_cast<std::size_t>(index)];
  if (bytes != static_cast<std::uint64_t>(p.numel()) * dtype_size(p.dtype)) {
    return invalid_argument("download_param '" + p.name + "': buffer of " + std::to_string(bytes) + " bytes");
  }
  return m.stager->download(dst, m.P(index).data, bytes);
}

Result<std::vector<float>> Model::download_param(int index) {
  Impl& m = *impl_;
  if (index < 0 || index >= static_cast<int>(m.layout.params.size())) {
    return invalid_argument("download_param: no parameter with index " + std::to_string(index));
  }
  const ParamDesc& p = m.layout.params[static_cast<std::size_t>(index)];
  std::vector<float> out(static_cast<std::size_t>(p.numel()));
  if (p.dtype == DType::kF32) {
    STRATA_RETURN_IF_ERROR(download_param_bytes(index, out.data(), out.size() * 4));
  } else {
    std::vector<std::uint16_t> raw(out.size());
    STRATA_RETURN_IF_ERROR(download_param_bytes(index, raw.data(), raw.size() * 2));
    for (std::size_t i = 0; i < raw.size(); ++i)
      out[i] = p.dtype == DType::kF16 ? kernels::f16_bits_to_f32(raw[i]) : kernels::bf16_bits_to_f32(raw[i]);
  }
  return out;
}

Result<std::vector<float>> Model::download_grad(int index) {
  Impl& m = *impl_;
  if (index < 0 || index >= static_cast<int>(m.layout.params.size())) {
    return invalid_argument("download_grad: no parameter with index " + std::to_string(index));
  }
  if (m.G(index).data == nullptr) {
    return failed_precondition("download_grad: parameter '" + m.layout.params[static_cast<std::size_t>(index)].name +
                               "' has no gradient storage bound on the device");
  }
  std::vector<float> out(static_cast<std::size_t>(m.layout.params[static_cast<std::size_t>(index)].numel()));
  STRATA_RETURN_IF_ERROR(m.stager->download(out.data(), m.G(index).data, out.size() * 4));
  return out;
}

Status Model::set_batch(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets,
                        std::int64_t B, std::int64_t T) {
  Impl& m = *impl_;
  if (B < 1 || B > m.Bmax || T < 1 || T > m.Tmax) {
    return invalid_argument("set_batch: batch (" + std::to_string(B) + ", " + std::to_string(T) +
                            ") is outside the model's buffers (" + std::to_string(m.Bmax) + ", " +
                            std::to_string(m.Tmax) + ")");
  }
  if (T % m.sp != 0) {
    return invalid_argument(
        "set_batch: sequence parallel splits the tokens over the tensor-parallel group: seq_len = " +
        std::to_string(T) + " is not a multiple of tensor_parallel_size = " + std::to_string(m.sp));
  }
  const auto n = static_cast<std::size_t>(B * T);
  if (inputs.size() != n || targets.size() != n) {
    return invalid_argument("set_batch: expected " + std::to_string(n) + " inputs and targets, got " +
                            std::to_string(inputs.size()) + " and " + std::to_string(targets.size()));
  }
  std::int64_t count = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (inputs[i] < 0 || inputs[i] >= m.V) {
      return invalid_argument("set_batch: input token " + std::to_string(inputs[i]) + " at position " +
                              std::to_string(i) + " is outside the vocabulary [0, " + std::to_string(m.V) +
                              ")");
    }
    if (targets[i] >= m.V) {
      return invalid_argument("set_batch: target " + std::to_string(targets[i]) + " at position " +
                              std::to_string(i) + " is outside the vocabulary [0, " + std::to_string(m.V) +
                              ")");
    }
    count += targets[i] >= 0 ? 1 : 0;
  }
  // The previous batch's copies out of the pinned buffer must be done before it is overwritten.
  // Only their completion matters here: the event carries the error of its stream when an earlier
  // operation of the stream had failed, and that error is the failed pass's, reported by the
  // stream's synchronize() (a record runs, and completes, even after a failure). Taking it here
  // would fail the next batch (a step run again after a compute-stream fault) with a stale error.
  (void)m.tokens_copied->synchronize();
  auto* pin = static_cast<std::int32_t*>(m.pinned_tokens.data());
  std::memcpy(pin, inputs.data(), n * 4);
  std::memcpy(pin + n, targets.data(), n * 4);
  STRATA_RETURN_IF_ERROR(m.stream->copy_async(m.tokens, pin, n * 4, CopyKind::kHostToDevice));
  STRATA_RETURN_IF_ERROR(m.stream->copy_async(m.targets, pin + n, n * 4, CopyKind::kHostToDevice));
  STRATA_RETURN_IF_ERROR(m.stream->record(*m.tokens_copied));
  m.batch_arrived(B, T, count);
  return ok_status();
}

Status Model::copy_losses(int slot) {
  Impl& m = *impl_;
  if (slot < 0 || slot >= m.options.loss_slots)
    return invalid_argument("copy_losses: no slot " + std::to_string(slot));
  if (!m.have_batch) return failed_precondition("copy_losses: no batch has been set");
  const std::int64_t N = m.Bmax * m.Tmax;
  float* dst = static_cast<float*>(m.pinned_losses.data()) + slot * N;
  m.slot_rows[static_cast<std::size_t>(slot)] = m.B * m.T;
  m.slot_counts[static_cast<std::size_t>(slot)] = m.target_count;
  return m.stream->copy_async(dst, m.losses, static_cast<std::uint64_t>(m.B * m.T) * 4,
                              CopyKind::kDeviceToHost);
}

LossSum Model::loss_sum(int slot) const {
  const Impl& m = *impl_;
  LossSum s;
  if (slot < 0 || slot >= m.options.loss_slots) return s;
  const float* src = static_cast<const float*>(m.pinned_losses.data()) + slot * m.Bmax * m.Tmax;
  const std::int64_t rows = m.slot_rows[static_cast<std::size_t>(slot)];
  for (std::int64_t i = 0; i < rows; ++i) s.sum += static_cast<double>(src[i]);  // ignored rows are 0
  s.count = m.slot_counts[static_cast<std::size_t>(slot)];
  return s;
}

Status Model::zero_grads() {
  if (impl_->grads == nullptr) {
    return failed_precondition(
        "zero_grads: the model has no gradients region (created without gradients, or its storage is "
        "bound module by module)");
  }
  return impl_->stream->memset_async(impl_->grads, 0, impl_->layout.grad_bytes);
}

Status Model::forward(bool for_backward) {
  for (int m = impl_->first; m < impl_->end; ++m) STRATA_RETURN_IF_ERROR(forward_module(m, for_backward));
  return ok_status();
}

Status Model::backward(float dloss) {
  for (int m = impl_->end - 1; m >= impl_->first; --m) STRATA_RETURN_IF_ERROR(backward_module(m, dloss));
  return ok_status();
}

int Model::num_modules() const { return static_cast<int>(impl_->layout.modules.size()); }

const std::vector<int>& Model::module_storage(int module) const {
  return impl_->storage.at(static_cast<std::size_t>(module));
}

Status Model::bind_module(int module, void* params, float* grads) {
  Impl& m = *impl_;
  if (module < 0 || module >= num_modules()) {
    return invalid_argument("bind_module: no module with index " + std::to_string(module));
  }
  m.unit_params[static_cast<std::size_t>(module)] = static_cast<char*>(params);
  m.unit_grads[static_cast<std::size_t>(module)] = grads;
  return ok_status();
}

Status Model::set_failed_pass(bool failed) {
  if (failed && !impl_->launch->is_cpu()) {
    return failed_precondition("set_failed_pass: only the cpu backend skips a failed stream's later kernels");
  }
  impl_->failed_pass = failed;
  return ok_status();
}

Status Model::forward_module(int module, bool for_backward) {
  Impl& m = *impl_;
  if (module != m.next_forward) {
    return failed_precondition("forward_module: module " + std::to_string(module) + " ('" +
                               (module >= 0 && module < num_modules()
                                    ? m.layout.modules[static_cast<std::size_t>(module)].name
                                    : std::string("?")) +
                               "') out of order; the forward pass expects module " +
                               std::to_string(m.next_forward) + " next");
  }
  if (module == m.first && !m.have_batch) return failed_precondition("forward: no batch has been set (call set_batch)");
  if (for_backward && !m.options.with_grads) {
    return failed_precondition("forward(for_backward): the model was created without gradients");
  }
  if (!m.failed_pass) STRATA_RETURN_IF_ERROR(m.check_bound(module, false));
  STRATA_RETURN_IF_ERROR(m.offload_before_forward(module));
  STRATA_RETURN_IF_ERROR(m.forward_module(module, for_backward));
  STRATA_RETURN_IF_ERROR(m.offload_after_forward(module, for_backward));
  m.next_forward = module + 1 == m.end ? m.first : module + 1;
  if (module + 1 == m.end) {
    m.forward_saved = for_backward;
    m.next_backward = for_backward ? module : -1;
    m.range_saved[static_cast<std::size_t>(m.range)] = for_backward ? 1 : 0;
  } else {
    m.forward_saved = false;
    m.next_backward = -1;
  }
  return ok_status();
}

Status Model::backward_module(int module, float dloss) {
  Impl& m = *impl_;
  if (m.next_backward < 0) {
    return failed_precondition(
        "backward: the last forward() did not keep activations (call forward(true) first)");
  }
  if (module != m.next_backward) {
    return failed_precondition("backward_module: module " + std::to_string(module) +
                               " out of order; the backward pass expects module " +
                               std::to_string(m.next_backward) + " next");
  }
  if (!m.failed_pass) STRATA_RETURN_IF_ERROR(m.check_bound(module, true));
  STRATA_RETURN_IF_ERROR(m.offload_before_backward(module));
  STRATA_RETURN_IF_ERROR(m.backward_module(module, dloss));
  STRATA_RETURN_IF_ERROR(m.offload_after_backward(module));
  m.next_backward = module == m.first ? -1 : module - 1;
  if (module == m.first) {  // backward consumed the saved activations
    m.forward_saved = false;
    m.range_saved[static_cast<std::size_t>(m.range)] = 0;
  }
  return ok_status();
}

// ---- activation offload --------------------------------------------------------------------------

std::int64_t Model::Impl::reads_resid(int m) const {
  const ModuleDesc& md = layout.modules[static_cast<std::size_t>(m)];
  if (md.kind == ModuleKind::kBlock) return md.layer;
  if (md.kind == ModuleKind::kHead) return layout.config.n_layer;
  return -1;
}

std::int64_t Model::Impl::writes_resid(int m) const {
  const ModuleDesc& md = layout.modules[static_cast<std::size_t>(m)];
  if (md.kind == ModuleKind::kBlock) return md.layer + 1;
  if (md.kind == ModuleKind::kEmbedding) return 0;
  return -1;
}

Status Model::Impl::await_ring(int k) {
  auto& pending = ring_pending[static_cast<std::size_t>(k)];
  if (pending == 0) return ok_status();
  pending = 0;
  return stream->wait(*ring_copied[static_cast<std::size_t>(k)]);
}

Status Model::Impl::await_all_copies() {
  for (int k = 0; k < ring; ++k) STRATA_RETURN_IF_ERROR(await_ring(k));
  return ok_status();
}

Status Model::Impl::offload_before_forward(int m) {
  if (ring == 0) return ok_status();
  if (m == first && first > 0) {
    // The stage's input: the caller has written it into boundary_activation(first).
    const std::int64_t in = first - 1;
    ring_holds[static_cast<std::size_t>(ring_of(in))] = in;
    on_host[static_cast<std::size_t>(in)] = 0;
  }
  if (const std::int64_t r = reads_resid(m); r >= 0) STRATA_RETURN_IF_ERROR(await_ring(ring_of(r)));
  const std::int64_t w = writes_resid(m);
  if (w < 0) return ok_status();
  // No overwrite before the copy out of the buffer's previous index has finished.
  const int k = ring_of(w);
  STRATA_RETURN_IF_ERROR(await_ring(k));
  ring_holds[static_cast<std::size_t>(k)] = w;
  on_host[static_cast<std::size_t>(w)] = 0;
  return ok_status();
}

Status Model::Impl::offload_after_forward(int m, bool for_backward) {
  if (ring == 0 || !for_backward) return ok_status();
  const std::int64_t r = reads_resid(m);
  // Only an index that a later write of this pass evicts leaves; the last R stay in the ring.
  if (r >= 0 && r + ring <= resid_hi()) {
    const int k = ring_of(r);
    const auto ks = static_cast<std::size_t>(k);
    const std::uint64_t bytes = static_cast<std::uint64_t>(local_rows() * C) * dtype_size(wdt);
    STRATA_RETURN_IF_ERROR(stream->record(*ring_read[ks]));
    STRATA_RETURN_IF_ERROR(copy_stream->wait(*ring_read[ks]));
    char* host =
        static_cast<char*>(host_block.data()) + static_cast<std::uint64_t>(r - resid_lo()) * host_stride;
    STRATA_RETURN_IF_ERROR(copy_stream->copy_async(host, resid[static_cast<std::size_t>(r)].data, bytes,
                                                   CopyKind::kDeviceToHost));
    STRATA_RETURN_IF_ERROR(copy_stream->record(*ring_copied[ks]));
    ring_pending[ks] = 1;
    on_host[static_cast<std::size_t>(r)] = 1;
    traffic.to_host += bytes;
  }
  // The pass's last module: from here on, synchronizing the compute stream covers the copies.
  if (m + 1 == end) return await_all_copies();
  return ok_status();
}

Status Model::Impl::fetch_resid(std::int64_t i) {
  const int k = ring_of(i);
  const auto ks = static_cast<std::size_t>(k);
  if (ring_holds[ks] == i) return ok_status();
  if (on_host[static_cast<std::size_t>(i)] == 0) {
    return internal_error("model: activation offload: residual " + std::to_string(i) +
                          " is neither in the device ring nor on the host");
  }
  const std::uint64_t bytes = static_cast<std::uint64_t>(local_rows() * C) * dtype_size(wdt);
  // The buffer's previous index: every compute use of it has run (ring_read), and the copy out
  // of it is earlier on this same stream.
  STRATA_RETURN_IF_ERROR(copy_stream->wait(*ring_read[ks]));
  const char* host =
      static_cast<const char*>(host_block.data()) + static_cast<std::uint64_t>(i - resid_lo()) * host_stride;
  STRATA_RETURN_IF_ERROR(
      copy_stream->copy_async(resid[static_cast<std::size_t>(i)].data, host, bytes, CopyKind::kHostToDevice));
  STRATA_RETURN_IF_ERROR(copy_stream->record(*ring_copied[ks]));
  ring_pending[ks] = 1;
  ring_holds[ks] = i;
  traffic.to_device += bytes;
  return ok_status();
}

Status Model::Impl::offload_before_backward(int m) {
  if (ring == 0) return ok_status();
  if (m + 1 == end) {
    // The pass's first module: whatever used the ring since the forward (the caller's send of the
    // stage output, on this stream) is ordered before any fetch.
    for (const auto& e : ring_read) STRATA_RETURN_IF_ERROR(stream->record(*e));
  }
  const std::int64_t r = reads_resid(m);
  if (r < 0) return ok_status();
  STRATA_RETURN_IF_ERROR(fetch_resid(r));  // normally fetched ahead already
  return await_ring(ring_of(r));
}

Status Model::Impl::offload_after_backward(int m) {
  if (ring == 0) return ok_status();
  const std::int64_t r = reads_resid(m);
  if (r >= 0) {
    STRATA_RETURN_IF_ERROR(stream->record(*ring_read[static_cast<std::size_t>(ring_of(r))]));
    // Fetch ahead: the next R - 1 indices the backward reads (their buffers' indices are done).
    for (std::int64_t i = r - 1; i >= r - ring + 1 && i >= resid_lo(); --i)
      STRATA_RETURN_IF_ERROR(fetch_resid(i));
  }
  if (m == first) return await_all_copies();
  return ok_status();
}

// ---- the passes --------------------------------------------------------------------------------

Status Model::Impl::block_forward(int l, const BlockActs& A, bool recompute) {
  const BlockParams& p = blocks[static_cast<std::size_t>(l)];
  detail::KernelLauncher& k = *launch;
  // Sequence parallel: the norms and residual adds run on this rank's Nl rows, everything
  // between a column-parallel entry and a row-parallel exit on all N rows (gathered into sp_full).
  const std::int64_t N = B * T, Nl = N / sp;
  const bool seq = sp > 1;
  const Tensor full = sp_full;
  const Tensor x = resid[static_cast<std::size_t>(l)];
  const Tensor out = resid[static_cast<std::size_t>(l) + 1];
  const float eps = static_cast<float>(layout.config.norm_eps);
  const std::int64_t C_ = C, Q_ = Q, F_ = F, H_ = H, Hkv_ = Hkv, D_ = D, B_ = B, T_ = T;
  const auto norm_w1 = P(p.norm1_w).carg(), norm_b1 = Pc(p.norm1_b), norm_w2 = P(p.norm2_w).carg(),
             norm_b2 = Pc(p.norm2_b);
  const auto qkv_w = P(p.qkv_w).carg(), qkv_b = Pc(p.qkv_b), proj_w = P(p.proj_w).carg(),
             proj_b = Pc(p.proj_b);
  const auto fc_w = P(p.fc_w).carg(), fc_b = Pc(p.fc_b), fcproj_w = P(p.fcproj_w).carg(),
             fcproj_b = Pc(p.fcproj_b);
  const float* rope_table = rope;

  // Attention sublayer: norm, fused qkv projection, (rotary), causal attention.
  if (gpt2) {
    STRATA_RETURN_IF_ERROR(k.run("ln_1", [=](const KernelContext& ctx) {
      return kernels::layernorm_forward(ctx, A.norm1.arg(), A.mean1, A.rstd1, x.carg(), norm_w1, norm_b1, Nl,
                                        C_, eps);
    }));
  } else {
    STRATA_RETURN_IF_ERROR(k.run("input_layernorm", [=](const KernelContext& ctx) {
      return kernels::rmsnorm_forward(ctx, A.norm1.arg(), A.rstd1, x.carg(), norm_w1, Nl, C_, eps);
    }));
  }
  const Tensor n1 = seq ? full : A.norm1;
  if (seq) STRATA_RETURN_IF_ERROR(tp_all_gather("tp all-gather ln_1 out", A.norm1, n1, Nl * C_));
  STRATA_RETURN_IF_ERROR(k.run("qkv", [=](const KernelContext& ctx) {
    return kernels::matmul_forward(ctx, A.qkv.arg(), n1.carg(), qkv_w, qkv_b, N, C_, Q_);
  }));
  if (!gpt2) {
    STRATA_RETURN_IF_ERROR(k.run("rope q,k", [=](const KernelContext& ctx) -> Status {
      STRATA_RETURN_IF_ERROR(
          kernels::rope_forward(ctx, A.qkv.arg(), A.qkv.carg(), rope_table, B_, T_, H_, D_, Q_));
      const Tensor kpart = A.qkv.at(H_ * D_);
      return kernels::rope_forward(ctx, kpart.arg(), kpart.carg(), rope_table, B_, T_, Hkv_, D_, Q_);
    }));
  }
  const kernels::AttentionShape shape{B_, T_, H_, Hkv_, D_, Q_, Q_, Q_, 0.0f};
  STRATA_RETURN_IF_ERROR(k.run("attention", [=](const KernelContext& ctx) {
    return kernels::attention_forward(ctx, A.atty.arg(), A.lse, A.qkv.carg(), A.qkv.at(H_ * D_).carg(),
                                      A.qkv.at((H_ + Hkv_) * D_).carg(), shape);
  }));
  // res2 = x + atty·Wprojᵀ (+ b). Tensor parallel (row-parallel projection): each rank's partial
  // product over its heads, rank 0's with the bias and the residual, summed by the all-reduce, so
  // the bias and x enter the sum once.
  // Sequence parallel: the partial products (rank 0's with the bias) over all rows go to sp_full,
  // are reduce-scattered into this rank's rows of res2, and every rank adds its rows of x.
  const bool add_once = tp_rank0();
  const Tensor proj_out = seq ? full : A.res2;
  STRATA_RETURN_IF_ERROR(k.run("attn proj + residual", [=](const KernelContext& ctx) -> Status {
    STRATA_RETURN_IF_ERROR(kernels::matmul_forward(ctx, proj_out.arg(), A.atty.carg(), proj_w,
                                                   add_once ? proj_b : kernels::kNone, N, H_ * D_, C_));
    if (!add_once || seq) return ok_status();
    return kernels::residual_forward(ctx, A.res2.arg(), A.res2.carg(), x.carg(), N * C_);
  }));
  if (seq) {
    STRATA_RETURN_IF_ERROR(tp_reduce_scatter("tp reduce-scatter attn proj", proj_out, A.res2, Nl * C_));
    STRATA_RETURN_IF_ERROR(k.run("attn residual", [=](const KernelContext& ctx) {
      return kernels::residual_forward(ctx, A.res2.arg(), A.res2.carg(), x.carg(), Nl * C_);
    }));
  } else {
    STRATA_RETURN_IF_ERROR(tp_all_reduce("tp all-reduce attn proj", A.res2, N * C_));
  }
  // MLP sublayer.
  if (gpt2) {
    STRATA_RETURN_IF_ERROR(k.run("ln_2", [=](const KernelContext& ctx) {
      return kernels::layernorm_forward(ctx, A.norm2.arg(), A.mean2, A.rstd2, A.res2.carg(), norm_w2, norm_b2,
                                        Nl, C_, eps);
    }));
  } else {
    STRATA_RETURN_IF_ERROR(k.run("post_attention_layernorm", [=](const KernelContext& ctx) {
      return kernels::rmsnorm_forward(ctx, A.norm2.arg(), A.rstd2, A.res2.carg(), norm_w2, Nl, C_, eps);
    }));
  }
  const Tensor n2 = seq ? full : A.norm2;
  if (seq) STRATA_RETURN_IF_ERROR(tp_all_gather("tp all-gather ln_2 out", A.norm2, n2, Nl * C_));
  if (gpt2) {
    STRATA_RETURN_IF_ERROR(k.run("c_fc + gelu", [=](const KernelContext& ctx) -> Status {
      STRATA_RETURN_IF_ERROR(kernels::matmul_forward(ctx, A.ff1.arg(), n2.carg(), fc_w, fc_b, N, C_, F_));
      return kernels::gelu_forward(ctx, A.ff2.arg(), A.ff1.carg(), N * F_);
    }));
  } else {
    STRATA_RETURN_IF_ERROR(k.run("gate_up + swiglu", [=](const KernelContext& ctx) -> Status {
      STRATA_RETURN_IF_ERROR(
          kernels::matmul_forward(ctx, A.ff1.arg(), n2.carg(), fc_w, kernels::kNone, N, C_, 2 * F_));
      return kernels::swiglu_forward(ctx, A.ff2.arg(), A.ff1.carg(), N, F_);
    }));
  }
  if (recompute) return ok_status();  // the block's output (the next residual) is kept already
  // out = res2 + ff2·Wᵀ (+ b); tensor (and sequence) parallel as the attention projection.
  const Tensor mlp_out = seq ? full : out;
  STRATA_RETURN_IF_ERROR(k.run("mlp proj + residual", [=](const KernelContext& ctx) -> Status {
    STRATA_RETURN_IF_ERROR(kernels::matmul_forward(ctx, mlp_out.arg(), A.ff2.carg(), fcproj_w,
                                                   add_once ? fcproj_b : kernels::kNone, N, F_, C_));
    if (!add_once || seq) return ok_status();
    return kernels::residual_forward(ctx, out.arg(), out.carg(), A.res2.carg(), N * C_);
  }));
  if (!seq) return tp_all_reduce("tp all-reduce mlp proj", out, N * C_);
  STRATA_RETURN_IF_ERROR(tp_reduce_scatter("tp reduce-scatter mlp proj", mlp_out, out, Nl * C_));
  return k.run("mlp residual", [=](const KernelContext& ctx) {
    return kernels::residual_forward(ctx, out.arg(), out.carg(), A.res2.carg(), Nl * C_);
  });
}

// Backward of block l. On entry dres holds ∂L/∂(block output); on exit ∂L/∂(block input).
// Sequence parallel: dres holds this rank's rows. Before each row-parallel layer's backward its
// rows are all-gathered (the conjugate of the forward reduce-scatter) into sp_full, and each
// column-parallel layer's partial input gradient (all rows) is reduce-scattered into dln_local
// (the conjugate of the forward all-gather), which the norm's backward reads.
Status Model::Impl::block_backward(int l, const BlockActs& A) {
  const BlockParams& p = blocks[static_cast<std::size_t>(l)];
  detail::KernelLauncher& k = *launch;
  const std::int64_t N = B * T, Nl = N / sp;
  const bool seq = sp > 1;
  const Tensor full = sp_full;
  const Tensor x = resid[static_cast<std::size_t>(l)];
  const std::int64_t C_ = C, Q_ = Q, F_ = F, H_ = H, Hkv_ = Hkv, D_ = D, B_ = B, T_ = T;
  const Tensor dres_ = dres, dln_ = dln, dqkv_ = dqkv, datty_ = datty, dff1_ = dff1, dff2_ = dff2;
  const auto norm_w1 = P(p.norm1_w).carg(), norm_w2 = P(p.norm2_w).carg();
  const auto qkv_w = P(p.qkv_w).carg(), proj_w = P(p.proj_w).carg(), fc_w = P(p.fc_w).carg(),
             fcproj_w = P(p.fcproj_w).carg();
  Tensor g_norm_w1 = G(p.norm1_w), g_norm_b1 = G(p.norm1_b), g_norm_w2 = G(p.norm2_w),
         g_norm_b2 = G(p.norm2_b);
  const Tensor g_qkv_w = G(p.qkv_w), g_qkv_b = G(p.qkv_b), g_proj_w = G(p.proj_w), g_proj_b = G(p.proj_b);
  const Tensor g_fc_w = G(p.fc_w), g_fc_b = G(p.fc_b), g_fcproj_w = G(p.fcproj_w), g_fcproj_b = G(p.fcproj_b);
  const float* rope_table = rope;
  // Sequence parallel: the norms' parameter gradients over this rank's rows collect in
  // norm_grads [w1 | b1 | w2 | b2] and are summed over the group at the end.
  const std::vector<Tensor> norm_targets = {g_norm_w1, g_norm_b1, g_norm_w2, g_norm_b2};
  if (seq) {
    STRATA_RETURN_IF_ERROR(stream->memset_async(norm_grads, 0, static_cast<std::uint64_t>(4 * C_) * 4));
    g_norm_w1 = Tensor{norm_grads, DType::kF32};
    g_norm_b1 = gpt2 ? Tensor{norm_grads + C_, DType::kF32} : Tensor{};
    g_norm_w2 = Tensor{norm_grads + 2 * C_, DType::kF32};
    g_norm_b2 = gpt2 ? Tensor{norm_grads + 3 * C_, DType::kF32} : Tensor{};
  }
  const Tensor dnorm = seq ? dln_local : dln_;  // the norms' output gradient (this rank's rows)
  // The gradient at a row-parallel layer's output (all rows) and the norm outputs (all rows).
  const Tensor dout = seq ? full : dres_;
  const Tensor n1 = seq ? full : A.norm1, n2 = seq ? full : A.norm2;
  // A column-parallel layer's input gradient: the sum of the ranks' partial products.
  auto reduce_dinp = [&](const char* all_reduce, const char* reduce_scatter) -> Status {
    if (seq) return tp_reduce_scatter(reduce_scatter, dln_, dnorm, Nl * C_);
    return tp_all_reduce(all_reduce, dln_, N * C_);
  };

  // MLP sublayer. out = res2 + ff2·Wᵀ: ∂res2 is dres itself (kept in place), ∂ff2 = dres·W.
  if (seq) STRATA_RETURN_IF_ERROR(tp_all_gather("tp all-gather mlp proj dout", dres_, dout, Nl * C_));
  if (gpt2) {
    STRATA_RETURN_IF_ERROR(k.run("c_proj backward + gelu backward", [=](const KernelContext& ctx) -> Status {
      STRATA_RETURN_IF_ERROR(kernels::matmul_backward(ctx, dff1_.arg(), g_fcproj_w.arg(), g_fcproj_b.arg(),
                                                      dout.carg(), A.ff2.carg(), fcproj_w, N, F_, C_,
                                                      Accumulate::kOverwrite));
      return kernels::gelu_backward(ctx, dff1_.arg(), dff1_.carg(), A.ff1.carg(), N * F_,
                                    Accumulate::kOverwrite);
    }));
  } else {
    STRATA_RETURN_IF_ERROR(
        k.run("down_proj backward + swiglu backward", [=](const KernelContext& ctx) -> Status {
          STRATA_RETURN_IF_ERROR(kernels::matmul_backward(ctx, dff2_.arg(), g_fcproj_w.arg(),
                                                          kernels::kNoOutput, dout.carg(), A.ff2.carg(),
                                                          fcproj_w, N, F_, C_, Accumulate::kOverwrite));
          return kernels::swiglu_backward(ctx, dff1_.arg(), dff2_.carg(), A.ff1.carg(), N, F_,
                                          Accumulate::kOverwrite);
        }));
  }
  // sp_full now goes from the gathered gradient (consumed above, in stream order) to ln_2's output.
  if (seq) STRATA_RETURN_IF_ERROR(tp_all_gather("tp all-gather ln_2 out (backward)", A.norm2, n2, Nl * C_));
  if (gpt2) {
    STRATA_RETURN_IF_ERROR(k.run("c_fc backward", [=](const KernelContext& ctx) {
      return kernels::matmul_backward(ctx, dln_.arg(), g_fc_w.arg(), g_fc_b.arg(), dff1_.carg(), n2.carg(),
                                      fc_w, N, C_, F_, Accumulate::kOverwrite);
    }));
    STRATA_RETURN_IF_ERROR(reduce_dinp("tp all-reduce c_fc dinp", "tp reduce-scatter c_fc dinp"));
    STRATA_RETURN_IF_ERROR(k.run("ln_2 backward", [=](const KernelContext& ctx) {
      return kernels::layernorm_backward(ctx, dres_.arg(), g_norm_w2.arg(), g_norm_b2.arg(), dnorm.carg(),
                                         A.res2.carg(), norm_w2, A.mean2, A.rstd2, Nl, C_, Accumulate::kAdd);
    }));
  } else {
    STRATA_RETURN_IF_ERROR(k.run("gate_up backward", [=](const KernelContext& ctx) {
      return kernels::matmul_backward(ctx, dln_.arg(), g_fc_w.arg(), kernels::kNoOutput, dff1_.carg(),
                                      n2.carg(), fc_w, N, C_, 2 * F_, Accumulate::kOverwrite);
    }));
    STRATA_RETURN_IF_ERROR(reduce_dinp("tp all-reduce gate_up dinp", "tp reduce-scatter gate_up dinp"));
    STRATA_RETURN_IF_ERROR(k.run("post_attention_layernorm backward", [=](const KernelContext& ctx) {
      return kernels::rmsnorm_backward(ctx, dres_.arg(), g_norm_w2.arg(), dnorm.carg(), A.res2.carg(),
                                       norm_w2, A.rstd2, Nl, C_, Accumulate::kAdd);
    }));
  }
  // Attention sublayer. res2 = x + atty·Wᵀ.
  if (seq) STRATA_RETURN_IF_ERROR(tp_all_gather("tp all-gather attn proj dout", dres_, dout, Nl * C_));
  STRATA_RETURN_IF_ERROR(k.run("attn proj backward", [=](const KernelContext& ctx) {
    return kernels::matmul_backward(ctx, datty_.arg(), g_proj_w.arg(), g_proj_b.arg(), dout.carg(),
                                    A.atty.carg(), proj_w, N, H_ * D_, C_, Accumulate::kOverwrite);
  }));
  const kernels::AttentionShape shape{B_, T_, H_, Hkv_, D_, Q_, Q_, Q_, 0.0f};
  STRATA_RETURN_IF_ERROR(k.run("attention backward", [=](const KernelContext& ctx) {
    return kernels::attention_backward(ctx, dqkv_.arg(), dqkv_.at(H_ * D_).arg(),
                                       dqkv_.at((H_ + Hkv_) * D_).arg(), datty_.carg(), A.qkv.carg(),
                                       A.qkv.at(H_ * D_).carg(), A.qkv.at((H_ + Hkv_) * D_).carg(),
                                       A.atty.carg(), A.lse, shape);
  }));
  if (!gpt2) {
    STRATA_RETURN_IF_ERROR(k.run("rope backward", [=](const KernelContext& ctx) -> Status {
      STRATA_RETURN_IF_ERROR(
          kernels::rope_backward(ctx, dqkv_.arg(), dqkv_.carg(), rope_table, B_, T_, H_, D_, Q_));
      const Tensor kpart = dqkv_.at(H_ * D_);
      return kernels::rope_backward(ctx, kpart.arg(), kpart.carg(), rope_table, B_, T_, Hkv_, D_, Q_);
    }));
  }
  if (seq) STRATA_RETURN_IF_ERROR(tp_all_gather("tp all-gather ln_1 out (backward)", A.norm1, n1, Nl * C_));
  STRATA_RETURN_IF_ERROR(k.run("qkv backward", [=](const KernelContext& ctx) {
    return kernels::matmul_backward(ctx, dln_.arg(), g_qkv_w.arg(), g_qkv_b.arg(), dqkv_.carg(), n1.carg(),
                                    qkv_w, N, C_, Q_, Accumulate::kOverwrite);
  }));
  STRATA_RETURN_IF_ERROR(reduce_dinp("tp all-reduce qkv dinp", "tp reduce-scatter qkv dinp"));
  if (gpt2) {
    STRATA_RETURN_IF_ERROR(k.run("ln_1 backward", [=](const KernelContext& ctx) {
      return kernels::layernorm_backward(ctx, dres_.arg(), g_norm_w1.arg(), g_norm_b1.arg(), dnorm.carg(),
                                         x.carg(), norm_w1, A.mean1, A.rstd1, Nl, C_, Accumulate::kAdd);
    }));
  } else {
    STRATA_RETURN_IF_ERROR(k.run("input_layernorm backward", [=](const KernelContext& ctx) {
      return kernels::rmsnorm_backward(ctx, dres_.arg(), g_norm_w1.arg(), dnorm.carg(), x.carg(), norm_w1,
                                       A.rstd1, Nl, C_, Accumulate::kAdd);
    }));
  }
  if (!seq) return ok_status();
  return sp_add_norm_grads("tp all-reduce norm grads", norm_targets);
}

void Model::Impl::describe_storage() {
  const std::size_t M = layout.modules.size();
  unit_params.assign(M, nullptr);
  unit_grads.assign(M, nullptr);
  owner.assign(layout.params.size(), -1);
  storage.assign(M, {});
  for (std::size_t i = 0; i < layout.params.size(); ++i) {
    const ParamDesc& p = layout.params[i];
    owner[i] = p.owns_storage() ? p.module : layout.params[static_cast<std::size_t>(p.tied_with)].module;
  }
  for (std::size_t u = 0; u < M; ++u) {
    storage[u].push_back(static_cast<int>(u));
    for (int i : layout.modules[u].params) {
      const int o = owner[static_cast<std::size_t>(i)];
      if (std::find(storage[u].begin(), storage[u].end(), o) == storage[u].end()) storage[u].push_back(o);
    }
  }
}

Status Model::Impl::check_bound(int m, bool grads_needed) const {
  for (int u : storage[static_cast<std::size_t>(m)]) {
    const ModuleDesc& md = layout.modules[static_cast<std::size_t>(u)];
    const bool has_params = md.param_end > md.param_begin;
    if (has_params && unit_params[static_cast<std::size_t>(u)] == nullptr) {
      return failed_precondition("model: module '" + layout.modules[static_cast<std::size_t>(m)].name +
                                 "' needs the parameters of module '" + md.name + "', which are not bound");
    }
    if (grads_needed && has_params && unit_grads[static_cast<std::size_t>(u)] == nullptr) {
      return failed_precondition("model: module '" + layout.modules[static_cast<std::size_t>(m)].name +
                                 "' needs the gradients of module '" + md.name + "', which are not bound");
    }
  }
  return ok_status();
}

Status Model::Impl::forward_module(int m, bool for_backward) {
  (void)for_backward;
  detail::KernelLauncher& k = *launch;
  const ModuleDesc& md = layout.modules[static_cast<std::size_t>(m)];
  const std::int64_t N = B * T, B_ = B, T_ = T, C_ = C, V_ = V, Vp_ = Vp;
  const int L = static_cast<int>(layout.config.n_layer);
  if (md.kind == ModuleKind::kEmbedding) {
    const std::int32_t* tok = tokens;
    const Tensor x0 = resid[0];
    const auto wte = P(eh.wte).carg(), wpe = Pc(eh.wpe);
    if (tp != nullptr) {
      // Vocabulary-parallel: rows of tokens outside the shard are zero, the sum over the ranks
      // is the embedding; rank 0 adds the position table so that it enters once.
      // Sequence parallel: the same partial sums over every row, reduce-scattered so that each
      // rank keeps its rows (the position table is added before the split: see backward).
      const std::int64_t vb = vocab_begin;
      const auto wpe0 = tp_rank0() ? wpe : kernels::kNone;
      const Tensor emb = sp > 1 ? sp_full : x0;
      STRATA_RETURN_IF_ERROR(k.run("embedding shard", [=](const KernelContext& ctx) {
        return kernels::embedding_shard_forward(ctx, emb.arg(), tok, wte, wpe0, B_, T_, C_, vb, Vp_);
      }));
      if (sp > 1) return tp_reduce_scatter("tp reduce-scatter embedding", emb, x0, N / sp * C_);
      return tp_all_reduce("tp all-reduce embedding", x0, N * C_);
    }
    return k.run("embedding", [=](const KernelContext& ctx) {
      return kernels::embedding_forward(ctx, x0.arg(), tok, wte, wpe, B_, T_, C_, Vp_);
    });
  }
  if (md.kind == ModuleKind::kBlock) {
    STRATA_RETURN_IF_ERROR(block_forward(md.layer, acts(md.layer), false));
    cached_block = md.layer;
    return ok_status();
  }
  const float eps = static_cast<float>(layout.config.norm_eps);
  const std::int32_t* tgt = targets;
  const Tensor xL = resid[static_cast<std::size_t>(L)];
  const auto lm_head = P(eh.lm_head).carg();
  const auto norm_w = P(eh.norm_w).carg(), norm_b = Pc(eh.norm_b);
  const Tensor fn = final_norm, lg = logits;
  float *fmean = final_mean, *frstd = final_rstd, *loss = losses, *lse = ce_lse;
  const std::int64_t Nl = N / sp;  // the final norm runs on this rank's rows
  if (gpt2) {
    STRATA_RETURN_IF_ERROR(k.run("ln_f", [=](const KernelContext& ctx) {
      return kernels::layernorm_forward(ctx, fn.arg(), fmean, frstd, xL.carg(), norm_w, norm_b, Nl, C_, eps);
    }));
  } else {
    STRATA_RETURN_IF_ERROR(k.run("norm", [=](const KernelContext& ctx) {
      return kernels::rmsnorm_forward(ctx, fn.arg(), frstd, xL.carg(), norm_w, Nl, C_, eps);
    }));
  }
  if (tp != nullptr) {
    // Sequence parallel: the vocabulary-parallel head reads every row; gather the normed rows.
    Tensor head_in = fn;
    if (sp > 1) {
      head_in = sp_full;
      STRATA_RETURN_IF_ERROR(tp_all_gather("tp all-gather ln_f out", fn, head_in, Nl * C_));
    }
    // Vocabulary-parallel cross-entropy: this rank's logits columns, the row max and then the
    // exp-sums and target logits summed over the ranks (kernels.hpp, cross_entropy_shard_*).
    float *row_max = ce_max, *sums = ce_sums;
    const std::int64_t vb = vocab_begin;
    STRATA_RETURN_IF_ERROR(k.run("lm_head shard + row max", [=](const KernelContext& ctx) -> Status {
      STRATA_RETURN_IF_ERROR(
          kernels::matmul_forward(ctx, lg.arg(), head_in.carg(), lm_head, kernels::kNone, N, C_, Vp_));
      return kernels::cross_entropy_shard_max(ctx, row_max, lg.carg(), N, Vp_, vb, V_);
    }));
    STRATA_RETURN_IF_ERROR(tp_all_reduce("tp all-reduce logits max", Tensor{row_max, DType::kF32}, N, ReduceOp::kMax));
    STRATA_RETURN_IF_ERROR(k.run("cross-entropy shard sums", [=](const KernelContext& ctx) {
      return kernels::cross_entropy_shard_sums(ctx, sums, lg.carg(), row_max, tgt, N, Vp_, vb, V_);
    }));
    STRATA_RETURN_IF_ERROR(tp_all_reduce("tp all-reduce exp sums", Tensor{sums, DType::kF32}, 2 * N));
    return k.run("cross-entropy shard finish", [=](const KernelContext& ctx) {
      return kernels::cross_entropy_shard_finish(ctx, loss, lse, row_max, sums, tgt, N);
    });
  }
  return k.run("lm_head + cross-entropy", [=](const KernelContext& ctx) -> Status {
    STRATA_RETURN_IF_ERROR(
        kernels::matmul_forward(ctx, lg.arg(), fn.carg(), lm_head, kernels::kNone, N, C_, Vp_));
    return kernels::cross_entropy_forward(ctx, loss, lse, lg.carg(), tgt, N, V_, Vp_);
  });
}

Status Model::Impl::backward_module(int m, float dloss) {
  detail::KernelLauncher& k = *launch;
  const ModuleDesc& md = layout.modules[static_cast<std::size_t>(m)];
  const std::int64_t N = B * T, B_ = B, T_ = T, C_ = C, V_ = V, Vp_ = Vp;
  const int L = static_cast<int>(layout.config.n_layer);
  const std::int32_t* tok = tokens;
  const Tensor dres_ = dres, dln_ = dln;
  if (md.kind == ModuleKind::kEmbedding) {
    const Tensor g_wte = G(eh.wte), g_wpe = G(eh.wpe);
    if (tp != nullptr) {
      // dres is the whole (replicated) gradient: each rank scatters the rows of its tokens, and
      // every rank computes the replicated position table's gradient alike. Sequence parallel:
      // the reduce-scatter's conjugate first gathers every rank's rows of dres, so the position
      // table's gradient is again over all rows and the same on every rank (no sum needed).
      const std::int64_t vb = vocab_begin;
      Tensor dx0 = dres_;
      if (sp > 1) {
        dx0 = sp_full;
        STRATA_RETURN_IF_ERROR(tp_all_gather("tp all-gather embedding dout", dres_, dx0, N / sp * C_));
      }
      return k.run("embedding shard backward", [=](const KernelContext& ctx) -> Status {
        STRATA_RETURN_IF_ERROR(
            kernels::embedding_shard_backward(ctx, g_wte.arg(), dx0.carg(), tok, B_, T_, C_, vb, Vp_));
        if (g_wpe.data == nullptr) return ok_status();
        return kernels::embedding_backward(ctx, kernels::kNoOutput, g_wpe.arg(), dx0.carg(), tok, B_, T_, C_,
                                           V_);
      });
    }
    return k.run("embedding backward", [=](const KernelContext& ctx) {
      return kernels::embedding_backward(ctx, g_wte.arg(), g_wpe.arg(), dres_.carg(), tok, B_, T_, C_, Vp_);
    });
  }
  if (md.kind == ModuleKind::kBlock) {
    const int l = md.layer;
    BlockActs& A = acts(l);
    const bool checkpointing = sets.size() == 1 && L > 1;
    if (checkpointing && cached_block != l) {
      STRATA_RETURN_IF_ERROR(block_forward(l, A, true));
      cached_block = l;
    }
    return block_backward(l, A);
  }
  const std::int32_t* tgt = targets;
  const Tensor xL = resid[static_cast<std::size_t>(L)];
  const auto lm_head = P(eh.lm_head).carg(), norm_w = P(eh.norm_w).carg();
  const Tensor g_lm_head = G(eh.lm_head), g_norm_w = G(eh.norm_w), g_norm_b = G(eh.norm_b);
  const Tensor fn = final_norm, lg = logits;
  const float *fmean = final_mean, *frstd = final_rstd, *lse = ce_lse;

  // Head: the logits' gradient overwrites the logits.
  const bool shard = tp != nullptr;
  const std::int64_t vb = vocab_begin;
  const std::int64_t Nl = N / sp;
  // Sequence parallel: the head's input is every rank's normed rows, gathered again (sp_full is
  // shared scratch, so what the forward gathered may be gone).
  Tensor head_in = fn;
  if (sp > 1) {
    head_in = sp_full;
    STRATA_RETURN_IF_ERROR(tp_all_gather("tp all-gather ln_f out (backward)", fn, head_in, Nl * C_));
  }
  STRATA_RETURN_IF_ERROR(
      k.run("cross-entropy backward + lm_head backward", [=](const KernelContext& ctx) -> Status {
        if (shard) {
          STRATA_RETURN_IF_ERROR(
              kernels::cross_entropy_shard_backward(ctx, lg.arg(), lg.carg(), lse, tgt, dloss, N, Vp_, vb, V_));
        } else {
          STRATA_RETURN_IF_ERROR(
              kernels::cross_entropy_backward(ctx, lg.arg(), lg.carg(), lse, tgt, dloss, N, V_, Vp_));
        }
        return kernels::matmul_backward(ctx, dln_.arg(), g_lm_head.arg(), kernels::kNoOutput, lg.carg(),
                                        head_in.carg(), lm_head, N, C_, Vp_, Accumulate::kOverwrite);
      }));
  // The head is column-parallel over the vocabulary: the final norm's output gradient is the sum
  // (sequence parallel: each rank's rows of it, reduce-scattered).
  Tensor dnorm = dln_;
  Tensor gw = g_norm_w, gb = g_norm_b;
  if (sp > 1) {
    dnorm = dln_local;
    STRATA_RETURN_IF_ERROR(tp_reduce_scatter("tp reduce-scatter lm_head dinp", dln_, dnorm, Nl * C_));
    // The norm's parameter gradients over this rank's rows go to scratch first (the kernels add).
    STRATA_RETURN_IF_ERROR(stream->memset_async(norm_grads, 0, static_cast<std::uint64_t>(2 * C_) * 4));
    gw = Tensor{norm_grads, DType::kF32};
    gb = gpt2 ? Tensor{norm_grads + C_, DType::kF32} : Tensor{};
  } else {
    STRATA_RETURN_IF_ERROR(tp_all_reduce("tp all-reduce lm_head dinp", dln_, N * C_));
  }
  if (gpt2) {
    STRATA_RETURN_IF_ERROR(k.run("ln_f backward", [=](const KernelContext& ctx) {
      return kernels::layernorm_backward(ctx, dres_.arg(), gw.arg(), gb.arg(), dnorm.carg(), xL.carg(),
                                         norm_w, fmean, frstd, Nl, C_, Accumulate::kOverwrite);
    }));
  } else {
    STRATA_RETURN_IF_ERROR(k.run("norm backward", [=](const KernelContext& ctx) {
      return kernels::rmsnorm_backward(ctx, dres_.arg(), gw.arg(), dnorm.carg(), xL.carg(), norm_w, frstd, Nl,
                                       C_, Accumulate::kOverwrite);
    }));
  }
  if (sp == 1) return ok_status();
  if (gpt2) return sp_add_norm_grads("tp all-reduce ln_f grads", {g_norm_w, g_norm_b});
  return sp_add_norm_grads("tp all-reduce norm grads", {g_norm_w});
}

}  // namespace strata
