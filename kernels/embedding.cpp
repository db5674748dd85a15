// Token and position embedding: out[b,t,:] = wte[tokens[b,t], :] + wpe[t, :] (wpe is absent in
// rotary models). The backward scatters dout back: dwte[v] += Σ over positions holding token v,
// dwpe[t] += Σ_b dout[b,t]. To stay deterministic without atomics and round bf16 gradients only
// once per row, positions are sorted by token (keys token<<32 | position, so ties keep position
// order) and each token's rows are summed in fp32 by one thread, then added to dwte.
#include <omp.h>

#include <algorithm>
#include <string>

#include "kernels/common.hpp"
#include "kernels/cuda_ops.hpp"

namespace strata::kernels {
namespace {

Status check_tokens(std::string_view op, const std::int32_t* tokens, std::int64_t B, std::int64_t T,
                    std::int64_t V) {
  for (std::int64_t i = 0; i < B * T; ++i) {
    if (tokens[i] < 0 || tokens[i] >= V) {
      return invalid_argument(std::string(op) + ": token " + std::to_string(tokens[i]) +
                              " at (b=" + std::to_string(i / T) + ", t=" + std::to_string(i % T) +
                              ") is outside the vocabulary [0, " + std::to_string(V) + ")");
    }
  }
  return ok_status();
}

// ---- cpu kernels ----

// `vocab_begin`/`shard`: wte holds rows [vocab_begin, vocab_begin + V) of the vocabulary and tokens
// outside them give zero rows (vocabulary-parallel); otherwise every token must be in [0, V).
Status embedding_forward_cpu(const KernelContext& ctx, TensorArg out, const std::int32_t* tokens,
                             ConstTensorArg wte, ConstTensorArg wpe, std::int64_t B, std::int64_t T,
                             std::int64_t C, std::int64_t V, std::int64_t vocab_begin = 0, bool shard = false) {
  if (shard) {
    STRATA_RETURN_IF_ERROR(check_tokens("embedding_shard_forward", tokens, B, T, std::int64_t{1} << 31));
  } else {
    STRATA_RETURN_IF_ERROR(check_tokens("embedding_forward", tokens, B, T, V));
  }
  const int threads = cpu_thread_count(ctx);
  const std::size_t stripe = scratch_stripe(2 * C);
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch("embedding_forward", threads * stripe, 0));
#pragma omp parallel for num_threads(threads) schedule(static) if (B * T * C > 8192)
  for (std::int64_t bt = 0; bt < B * T; ++bt) {
    float* row = buf + omp_get_thread_num() * stripe;  // (C)
    float* pos = row + C;                              // (C)
    const std::int64_t tok = tokens[bt] - vocab_begin;
    if (tok >= 0 && tok < V) {
      load_f32(wte, tok * C, C, row);
    } else {
      std::fill(row, row + C, 0.0f);
    }
    if (wpe.data != nullptr) {
      load_f32(wpe, (bt % T) * C, C, pos);
      for (std::int64_t c = 0; c < C; ++c) row[c] += pos[c];
    }
    store_f32(out, bt * C, C, row);
  }
  return ok_status();
}

// `vocab_begin`/`shard` as in the forward: positions whose token is outside the shard add nothing.
Status embedding_backward_cpu(const KernelContext& ctx, TensorArg dwte, TensorArg dwpe, ConstTensorArg dout,
                              const std::int32_t* tokens, std::int64_t B, std::int64_t T, std::int64_t C,
                              std::int64_t V, std::int64_t vocab_begin = 0, bool shard = false) {
  constexpr std::string_view kOp = "embedding_backward";
  const int threads = cpu_thread_count(ctx);
  const std::int64_t n = B * T;
  const std::size_t stripe = scratch_stripe(2 * C);
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch(kOp, threads * stripe, 0));

  if (dwte.data != nullptr) {
    if (!shard) STRATA_RETURN_IF_ERROR(check_tokens(kOp, tokens, B, T, V));
    // (n) sort keys, then (n + 1) offsets of each token's run in the sorted order.
    STRATA_ASSIGN_OR_RETURN(float* key_mem, scratch(kOp, 2 * n + (n + 1), 1));
    auto* keys = reinterpret_cast<std::uint64_t*>(key_mem);
    auto* run_begin = reinterpret_cast<std::uint32_t*>(keys + n);
    std::int64_t kept = 0;  // positions whose token this table holds (all of them unless a shard)
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t tok = tokens[i] - vocab_begin;
      if (tok < 0 || tok >= V) continue;
      keys[kept++] = (static_cast<std::uint64_t>(tok) << 32) | static_cast<std::uint64_t>(i);
    }
    std::sort(keys, keys + kept);
    std::int64_t runs = 0;
    for (std::int64_t i = 0; i < kept; ++i) {
      if (i == 0 || (keys[i] >> 32) != (keys[i - 1] >> 32)) run_begin[runs++] = static_cast<std::uint32_t>(i);
    }
    run_begin[runs] = static_cast<std::uint32_t>(kept);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4) if (n * C > 8192)
    for (std::int64_t r = 0; r < runs; ++r) {
      float* acc = buf + omp_get_thread_num() * stripe;  // (C)
      float* row = acc + C;                              // (C)
      std::fill(acc, acc + C, 0.0f);
      for (std::uint32_t i = run_begin[r]; i < run_begin[r + 1]; ++i) {
        load_f32(dout, static_cast<std::int64_t>(keys[i] & 0xffffffffu) * C, C, row);
        for (std::int64_t c = 0; c < C; ++c) acc[c] += row[c];
      }
      store_f32(dwte, static_cast<std::int64_t>(keys[run_begin[r]] >> 32) * C, C, acc, Accumulate::kAdd);
    }
  }

  if (dwpe.data != nullptr) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n * C > 8192)
    for (std::int64_t t = 0; t < T; ++t) {
      float* acc = buf + omp_get_thread_num() * stripe;  // (C)
      float* row = acc + C;                              // (C)
      std::fill(acc, acc + C, 0.0f);
      for (std::int64_t b = 0; b < B; ++b) {
        load_f32(dout, (b * T + t) * C, C, row);
        for (std::int64_t c = 0; c < C; ++c) acc[c] += row[c];
      }
      store_f32(dwpe, t * C, C, acc, Accumulate::kAdd);
    }
  }
  return ok_status();
}

Status check_embedding(std::string_view op, const KernelContext& ctx, const std::int32_t* tokens,
                       std::int64_t B, std::int64_t T, std::int64_t C, std::int64_t V) {
  ArgCheck check(op);
  check.context(ctx)
      .ptr("tokens", tokens)
      .non_negative("B", B)
      .non_negative("T", T)
      .positive("C", C)
      .positive("V", V)
      .fail_if(B * T >= (std::int64_t{1} << 31), "B*T = " + std::to_string(B * T) + " positions exceed 2^31");
  return check.status();
}

}  // namespace

// ---- launchers ----

Status embedding_forward(const KernelContext& ctx, TensorArg out, const std::int32_t* tokens,
                         ConstTensorArg wte, ConstTensorArg wpe, std::int64_t B, std::int64_t T,
                         std::int64_t C, std::int64_t V) {
  STRATA_RETURN_IF_ERROR(check_embedding("embedding_forward", ctx, tokens, B, T, C, V));
  ArgCheck check("embedding_forward");
  check.tensor("out", out).tensor("wte", wte).optional("wpe", wpe);
  STRATA_RETURN_IF_ERROR(check.status());
  if (B * T == 0) return ok_status();
  if (ctx.backend == Backend::kCuda) return embedding_forward_cuda(ctx, out, tokens, wte, wpe, B, T, C, V);
  return embedding_forward_cpu(ctx, out, tokens, wte, wpe, B, T, C, V);
}

Status embedding_backward(const KernelContext& ctx, TensorArg dwte, TensorArg dwpe, ConstTensorArg dout,
                          const std::int32_t* tokens, std::int64_t B, std::int64_t T, std::int64_t C,
                          std::int64_t V) {
  STRATA_RETURN_IF_ERROR(check_embedding("embedding_backward", ctx, tokens, B, T, C, V));
  ArgCheck check("embedding_backward");
  check.tensor("dout", dout)
      .optional("dwte", dwte)
      .optional("dwpe", dwpe)
      .workspace(ctx, embedding_backward_workspace_bytes(ctx.backend, B, T));
  STRATA_RETURN_IF_ERROR(check.status());
  if (B * T == 0 || (dwte.data == nullptr && dwpe.data == nullptr)) return ok_status();
  if (ctx.backend == Backend::kCuda)
    return embedding_backward_cuda(ctx, dwte, dwpe, dout, tokens, B, T, C, V);
  return embedding_backward_cpu(ctx, dwte, dwpe, dout, tokens, B, T, C, V);
}

Status embedding_shard_forward(const KernelContext& ctx, TensorArg out, const std::int32_t* tokens,
                               ConstTensorArg wte_shard, ConstTensorArg wpe, std::int64_t B, std::int64_t T,
                               std::int64_t C, std::int64_t vocab_begin, std::int64_t Vs) {
  STRATA_RETURN_IF_ERROR(check_embedding("embedding_shard_forward", ctx, tokens, B, T, C, Vs));
  ArgCheck check("embedding_shard_forward");
  check.tensor("out", out).tensor("wte_shard", wte_shard).optional("wpe", wpe).non_negative("vocab_begin", vocab_begin);
  STRATA_RETURN_IF_ERROR(check.status());
  if (B * T == 0) return ok_status();
  if (ctx.backend == Backend::kCuda)
    return embedding_shard_forward_cuda(ctx, out, tokens, wte_shard, wpe, B, T, C, vocab_begin, Vs);
  return embedding_forward_cpu(ctx, out, tokens, wte_shard, wpe, B, T, C, Vs, vocab_begin, true);
}

Status embedding_shard_backward(const KernelContext& ctx, TensorArg dwte_shard, ConstTensorArg dout,
                                const std::int32_t* tokens, std::int64_t B, std::int64_t T, std::int64_t C,
                                std::int64_t vocab_begin, std::int64_t Vs) {
  STRATA_RETURN_IF_ERROR(check_embedding("embedding_shard_backward", ctx, tokens, B, T, C, Vs));
  ArgCheck check("embedding_shard_backward");
  check.tensor("dout", dout)
      .tensor("dwte_shard", dwte_shard)
      .non_negative("vocab_begin", vocab_begin)
      .workspace(ctx, embedding_backward_workspace_bytes(ctx.backend, B, T));
  STRATA_RETURN_IF_ERROR(check.status());
  if (B * T == 0) return ok_status();
  if (ctx.backend == Backend::kCuda)
    return embedding_shard_backward_cuda(ctx, dwte_shard, dout, tokens, B, T, C, vocab_begin, Vs);
  return embedding_backward_cpu(ctx, dwte_shard, kNoOutput, dout, tokens, B, T, C, Vs, vocab_begin, true);
}

std::uint64_t embedding_backward_workspace_bytes(Backend backend, std::int64_t B, std::int64_t T) {
  return backend == Backend::kCuda ? embedding_backward_workspace_bytes_cuda(B, T) : 0;
}

}  // namespace strata::kernels
