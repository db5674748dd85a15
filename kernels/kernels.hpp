// The transformer training kernels: forward and backward of every op a GPT-2 or LLaMA-style
// model needs, on the cpu backend (OpenMP loops, oneDNN for matmul) and on cuda (cuBLASLt for
// matmul, own kernels for the rest). The model layer calls these; nothing above it does.
//
// Calling convention
//   * Every op is a plain function over raw pointers and sizes that returns a Status. Arguments
//     are validated (null pointers, sizes, dtypes, workspace size) before anything runs; a bad
//     argument is kInvalidArgument naming the op and the argument.
//   * Backend::kCpu: the function runs the op synchronously on the calling thread with
//     `cpu_threads` OpenMP threads. The caller (the cpu device's Stream::host_fn) provides stream
//     order. Pointers are host memory.
//   * Backend::kCuda: the function enqueues kernels on `cuda_stream` and returns; pointers are
//     device memory and must stay valid until the stream reaches the work. Launch errors are
//     reported (kDeviceError); faults inside a kernel surface at the stream's next synchronize.
//     Without CUDA in the build every cuda call returns kUnavailable.
//   * Tensors are row-major and dense unless a row stride is given. Shape comments name the
//     dimensions: (B, T, C) = batch, sequence, channels; `rows` is B*T for row-wise ops.
//   * Dtypes: each tensor argument carries its own dtype, fp32, bf16 or fp16 (16-bit types stored
//     as uint16_t bit patterns, rounded to nearest even as strata/dtype.hpp specifies; fp16
//     overflows to Inf, which is what the loss scaler's overflow check looks for). All arithmetic accumulates in fp32
//     whatever the storage. Auxiliary tensors (saved statistics, logsumexp, losses) are always fp32
//     (`float*`); token ids and targets are int32.
//   * Gradients: gradients of parameters always accumulate (dW += ...) so micro-batches add up;
//     the owner zeroes them at the start of a step. Gradients of inputs follow the `Accumulate`
//     argument: kOverwrite writes dX, kAdd adds into it (the residual stream's gradient).
//   * Scratch: ops that need device scratch on cuda say so with a *_workspace_bytes function;
//     the caller passes a workspace at least that large in the context (device memory, used only
//     in stream order, so one workspace can serve every op on one stream). cpu ops need none:
//     their per-thread scratch is allocated on first use and reused (no allocation in steady
//     state).
//   * Determinism: every op is deterministic run to run on both backends (no atomics in float
//     reductions); cpu results do not depend on `cpu_threads`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "strata/dtype.hpp"
#include "strata/status.hpp"

namespace strata::kernels {

enum class Backend : std::uint8_t { kCpu, kCuda };
std::string_view to_string(Backend backend);

// Storage types (strata/dtype.hpp): the kernels take DType::kF32, DType::kBF16 and DType::kF16
// (IEEE half). Compute is fp32 in every case.

// A read-only tensor: pointer plus storage type. A null `data` means "absent" where an argument
// is optional (bias, position embedding).
struct ConstTensorArg {
  const void* data = nullptr;
  DType dtype = DType::kF32;
};

// A tensor the op writes.
struct TensorArg {
  void* data = nullptr;
  DType dtype = DType::kF32;
  operator ConstTensorArg() const { return {data, dtype}; }  // NOLINT: an output can be read
};

inline TensorArg f32(float* p) { return {p, DType::kF32}; }
inline ConstTensorArg f32(const float* p) { return {p, DType::kF32}; }
inline TensorArg bf16(std::uint16_t* p) { return {p, DType::kBF16}; }
inline ConstTensorArg bf16(const std::uint16_t* p) { return {p, DType::kBF16}; }
inline TensorArg f16(std::uint16_t* p) { return {p, DType::kF16}; }
inline ConstTensorArg f16(const std::uint16_t* p) { return {p, DType::kF16}; }
inline constexpr ConstTensorArg kNone{};
inline constexpr TensorArg kNoOutput{};

enum class Accumulate : std::uint8_t {
  kOverwrite,  // dX = gradient
  kAdd,        // dX += gradient
};

// Per-stream state kept between calls: the oneDNN engine and primitive cache (cpu), the
// cuBLASLt handle and its plan cache (cuda). Plans are cached by shape and dtype, so a training
// step builds them once. Not thread-safe: one KernelState per stream.
class KernelState {
 public:
  static Result<std::unique_ptr<KernelState>> create(Backend backend);
  virtual ~KernelState() = default;
  virtual Backend backend() const = 0;
  // Number of matmul plans built so far (a steady-state step adds none).
  virtual std::size_t cached_plans() const = 0;
};

struct KernelContext {
  Backend backend = Backend::kCpu;
  void* cuda_stream = nullptr;  // cudaStream_t (cuda); nullptr is the legacy default stream
  int cpu_threads = 0;          // OpenMP threads (cpu); 0 = omp_get_max_threads()
  void* workspace = nullptr;    // device scratch (cuda), 256-byte aligned; see *_workspace_bytes
  std::uint64_t workspace_bytes = 0;
  KernelState* state = nullptr;  // required by matmul/gemm; must match `backend`
};

// ---- embedding -------------------------------------------------------------------------------
// out (B,T,C) = wte[tokens[b,t]] (V,C) + wpe[t] (T,C); wpe may be absent (rotary models).
// Tokens outside [0, V) are kInvalidArgument on cpu; on cuda they give NaN rows (the data loader
// validates tokens; NaN makes a slip visible in the loss).
Status embedding_forward(const KernelContext& ctx, TensorArg out, const std::int32_t* tokens,
                         ConstTensorArg wte, ConstTensorArg wpe, std::int64_t B, std::int64_t T,
                         std::int64_t C, std::int64_t V);
// dwte (V,C) += Σ over positions with that token of dout (B,T,C); dwpe (T,C) += Σ_b dout.
// Each row is summed in fp32 and added once (one rounding for bf16 gradients).
Status embedding_backward(const KernelContext& ctx, TensorArg dwte, TensorArg dwpe, ConstTensorArg dout,
                          const std::int32_t* tokens, std::int64_t B, std::int64_t T, std::int64_t C,
                          std::int64_t V);
std::uint64_t embedding_backward_workspace_bytes(Backend backend, std::int64_t B, std::int64_t T);

// ---- layernorm / rmsnorm ---------------------------------------------------------------------
// LayerNorm: out (rows,C) = (inp - mean) * rstd * weight (C) + bias (C); bias may be absent.
// Saves mean (rows) and rstd (rows) in fp32 when non-null (the backward needs them).
Status layernorm_forward(const KernelContext& ctx, TensorArg out, float* mean, float* rstd,
                         ConstTensorArg inp, ConstTensorArg weight, ConstTensorArg bias, std::int64_t rows,
                         std::int64_t C, float eps);
// dinp (rows,C) (=|+=) ∂/∂inp; dweight (C) += ..., dbias (C) += Σ dout (dbias may be absent).
Status layernorm_backward(const KernelContext& ctx, TensorArg dinp, TensorArg dweight, TensorArg dbias,
                          ConstTensorArg dout, ConstTensorArg inp, ConstTensorArg weight, const float* mean,
                          const float* rstd, std::int64_t rows, std::int64_t C, Accumulate dinp_mode);
// RMSNorm: out (rows,C) = inp * rstd * weight (C), rstd = 1/sqrt(mean(inp²) + eps).
Status rmsnorm_forward(const KernelContext& ctx, TensorArg out, float* rstd, ConstTensorArg inp,
                       ConstTensorArg weight, std::int64_t rows, std::int64_t C, float eps);
Status rmsnorm_backward(const KernelContext& ctx, TensorArg dinp, TensorArg dweight, ConstTensorArg dout,
                        ConstTensorArg inp, ConstTensorArg weight, const float* rstd, std::int64_t rows,
                        std::int64_t C, Accumulate dinp_mode);

// ---- matmul ----------------------------------------------------------------------------------
enum class Transpose : std::uint8_t { kNo, kYes };

// General GEMM, row-major: c (M,N) (=|+=) op(a) (M,K) · op(b) (K,N) + bias (N).
// op(a) = a stored (M,K), or aᵀ with a stored (K,M); likewise b stored (K,N) or (N,K).
// a and b share one dtype; c and bias may be either dtype, except that cuda (cuBLASLt) needs an
// fp32 c for fp32 inputs. Accumulation is fp32.
Status gemm(const KernelContext& ctx, TensorArg c, ConstTensorArg a, ConstTensorArg b, ConstTensorArg bias,
            std::int64_t M, std::int64_t N, std::int64_t K, Transpose trans_a, Transpose trans_b,
            Accumulate mode);
// Linear layer: out (M,N) = inp (M,K) · weight (N,K)ᵀ + bias (N); bias may be absent.
Status matmul_forward(const KernelContext& ctx, TensorArg out, ConstTensorArg inp, ConstTensorArg weight,
                      ConstTensorArg bias, std::int64_t M, std::int64_t K, std::int64_t N);
// dinp (M,K) (=|+=) dout (M,N) · weight (N,K); dweight (N,K) += doutᵀ · inp; dbias (N) += Σ_M dout.
// dinp, dweight and dbias may each be absent (e.g. no dinp for the first layer's input).
Status matmul_backward(const KernelContext& ctx, TensorArg dinp, TensorArg dweight, TensorArg dbias,
                       ConstTensorArg dout, ConstTensorArg inp, ConstTensorArg weight, std::int64_t M,
                       std::int64_t K, std::int64_t N, Accumulate dinp_mode);
// Scratch for gemm/matmul on `backend` (the cuBLASLt workspace on cuda; 0 on cpu).
std::uint64_t matmul_workspace_bytes(Backend backend);

// ---- causal self-attention -------------------------------------------------------------------
// q (B,T,H,D), k and v (B,T,Hkv,D) with H a multiple of Hkv (grouped-query attention when
// Hkv < H; query head h reads kv head h / (H/Hkv)). Each tensor's tokens are `*_row_stride`
// elements apart, so q, k and v can be slices of one packed (B,T,(H+2Hkv)·D) projection; 0 means
// tight. out (B,T,H·D) is tight. lse (B,H,T) fp32 is the logsumexp of each row of scaled scores,
// the only thing the backward keeps (it recomputes the probabilities). All attention tensors
// (q, k, v, out and in the backward dout, dq, dk, dv) share one dtype.
struct AttentionShape {
  std::int64_t batch = 0;
  std::int64_t seq_len = 0;
  std::int64_t n_head = 0;
  std::int64_t n_kv_head = 0;  // 0 = n_head
  std::int64_t head_dim = 0;   // cuda supports 16, 32, 64 and 128
  std::int64_t q_row_stride = 0;
  std::int64_t k_row_stride = 0;
  std::int64_t v_row_stride = 0;
  float scale = 0.0f;  // 0 = 1/sqrt(head_dim)
};
Status attention_forward(const KernelContext& ctx, TensorArg out, float* lse, ConstTensorArg q,
                         ConstTensorArg k, ConstTensorArg v, const AttentionShape& shape);
// dq, dk, dv are written (not accumulated) with the row strides of q, k, v.
Status attention_backward(const KernelContext& ctx, TensorArg dq, TensorArg dk, TensorArg dv,
                          ConstTensorArg dout, ConstTensorArg q, ConstTensorArg k, ConstTensorArg v,
                          ConstTensorArg out, const float* lse, const AttentionShape& shape);
std::uint64_t attention_backward_workspace_bytes(Backend backend, const AttentionShape& shape);

// ---- activations -----------------------------------------------------------------------------
// GELU, tanh form: out (n) = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))). out may alias inp.
Status gelu_forward(const KernelContext& ctx, TensorArg out, ConstTensorArg inp, std::int64_t n);
// dinp (=|+=) dout · gelu'(inp); dinp may alias dout.
Status gelu_backward(const KernelContext& ctx, TensorArg dinp, ConstTensorArg dout, ConstTensorArg inp,
                     std::int64_t n, Accumulate dinp_mode);
// SwiGLU: gate_up (rows, 2F) holds [gate | up] per row (one fused projection);
// out (rows,F) = silu(gate) · up with silu(g) = g·sigmoid(g).
Status swiglu_forward(const KernelContext& ctx, TensorArg out, ConstTensorArg gate_up, std::int64_t rows,
                      std::int64_t F);
// dgate_up (rows, 2F) (=|+=) [∂/∂gate | ∂/∂up].
Status swiglu_backward(const KernelContext& ctx, TensorArg dgate_up, ConstTensorArg dout,
                       ConstTensorArg gate_up, std::int64_t rows, std::int64_t F, Accumulate dinp_mode);

// ---- rotary position embedding ---------------------------------------------------------------
// Fills `table` (host memory, max_T·D/2·2 floats) with (cos, sin) of t·θ^(-2i/D) for position
// t < max_T and frequency i < D/2, computed in double. Copy it to the device once.
Status rope_table(float* table, std::int64_t max_T, std::int64_t head_dim, double theta);
// x (B,T,H,D) with tokens `row_stride` elements apart (0 = H·D): rotates each pair
// (x[i], x[i+D/2]) by the angle of position t (the "rotate half" convention of GPT-NeoX and the
// Hugging Face LLaMA). out may alias inp; both use row_stride. table from rope_table with max_T ≥ T.
Status rope_forward(const KernelContext& ctx, TensorArg out, ConstTensorArg inp, const float* table,
                    std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t D, std::int64_t row_stride);
// The transpose: rotates dout back by the same angles. dinp may alias dout.
Status rope_backward(const KernelContext& ctx, TensorArg dinp, ConstTensorArg dout, const float* table,
                     std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t D, std::int64_t row_stride);

// ---- residual --------------------------------------------------------------------------------
// out (n) = a + b; out may alias a or b.
Status residual_forward(const KernelContext& ctx, TensorArg out, ConstTensorArg a, ConstTensorArg b,
                        std::int64_t n);
// da (=|+=) dout and db (=|+=) dout; either may be absent.
Status residual_backward(const KernelContext& ctx, TensorArg da, TensorArg db, ConstTensorArg dout,
                         std::int64_t n, Accumulate mode);

// ---- softmax + cross-entropy -----------------------------------------------------------------
// logits (N, Vp) with the real vocabulary in the first V columns (Vp ≥ V lets the vocabulary be
// padded to a friendly size; padded columns are ignored). targets (N) int32; a negative target
// marks an ignored row (loss 0, gradient 0).
// losses (N) = logsumexp(logits[n, :V]) - logits[n, target[n]]; lse (N) saved for the backward.
// A target ≥ V is kInvalidArgument on cpu and a NaN loss on cuda.
Status cross_entropy_forward(const KernelContext& ctx, float* losses, float* lse, ConstTensorArg logits,
                             const std::int32_t* targets, std::int64_t N, std::int64_t V, std::int64_t Vp);
// dlogits (N, Vp) = (softmax(logits) - onehot(target)) · dloss, padded columns zero.
// dloss is the gradient of the total loss with respect to each row's loss (1/count for a mean).
// dlogits may alias logits (in place, to save the (N,Vp) buffer).
Status cross_entropy_backward(const KernelContext& ctx, TensorArg dlogits, ConstTensorArg logits,
                              const float* lse, const std::int32_t* targets, float dloss, std::int64_t N,
                              std::int64_t V, std::int64_t Vp);

// ---- vocabulary-parallel embedding and cross-entropy (tensor parallel) -------------------------
// A rank holds rows [vocab_begin, vocab_begin + Vs) of the (padded) vocabulary: its shard of the
// token embedding (Vs, C) and the logits of its columns (N, Vs). The model sums the ranks'
// results with all-reduces between these calls (docs/parallel.md "Tensor parallel").
//
// out (B,T,C) = (wte_shard[tok - vocab_begin] if the token is in the shard, else 0) + wpe[t];
// wpe may be absent (pass it on one rank only, so the sum over ranks adds it once). A negative
// token is kInvalidArgument on cpu (a NaN row on cuda); a token past the shard is another rank's.
Status embedding_shard_forward(const KernelContext& ctx, TensorArg out, const std::int32_t* tokens,
                               ConstTensorArg wte_shard, ConstTensorArg wpe, std::int64_t B, std::int64_t T,
                               std::int64_t C, std::int64_t vocab_begin, std::int64_t Vs);
// dwte_shard (Vs,C) += Σ over positions whose token is in the shard of dout (B,T,C), per row summed
// in fp32 and added once, like embedding_backward. Uses embedding_backward_workspace_bytes.
Status embedding_shard_backward(const KernelContext& ctx, TensorArg dwte_shard, ConstTensorArg dout,
                                const std::int32_t* tokens, std::int64_t B, std::int64_t T, std::int64_t C,
                                std::int64_t vocab_begin, std::int64_t Vs);
// Cross-entropy over vocabulary shards, in three steps with all-reduces between them. Column v of
// logits (N, Vs) is full column vocab_begin + v; full columns ≥ V (padding) are ignored; targets
// hold full indices (negative: ignored row), each < V.
//  1. row_max (N) = max of the shard's real columns (-inf when it has none); all-reduce max.
//  2. sums (2, N): sums[n] = Σ exp(z - row_max[n]) over the shard's real columns, sums[N + n] =
//     z[target - vocab_begin] when the target is in the shard, else 0; all-reduce sum.
//  3. lse (N) = row_max + log(sums[n]); losses (N) = lse - sums[N + n] (0 for ignored rows).
Status cross_entropy_shard_max(const KernelContext& ctx, float* row_max, ConstTensorArg logits, std::int64_t N,
                               std::int64_t Vs, std::int64_t vocab_begin, std::int64_t V);
Status cross_entropy_shard_sums(const KernelContext& ctx, float* sums, ConstTensorArg logits, const float* row_max,
                                const std::int32_t* targets, std::int64_t N, std::int64_t Vs,
                                std::int64_t vocab_begin, std::int64_t V);
Status cross_entropy_shard_finish(const KernelContext& ctx, float* losses, float* lse, const float* row_max,
                                  const float* sums, const std::int32_t* targets, std::int64_t N);
// dlogits (N, Vs) = (exp(z - lse) - [column is the target])·dloss on real columns, 0 on padding
// and on ignored rows. dlogits may alias logits.
Status cross_entropy_shard_backward(const KernelContext& ctx, TensorArg dlogits, ConstTensorArg logits,
                                    const float* lse, const std::int32_t* targets, float dloss, std::int64_t N,
                                    std::int64_t Vs, std::int64_t vocab_begin, std::int64_t V);

}  // namespace strata::kernels
