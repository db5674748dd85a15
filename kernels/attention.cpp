// Causal multi-head self-attention, with grouped-query heads (query head h reads kv head
// h / (H/Hkv)). For one head, with scale s (1/√D by default):
//   S = s·Q·Kᵀ masked to keys j ≤ i,  P = softmax_rows(S),  O = P·V,  lse_i = log Σ_j exp(S_ij).
// Backward, recomputing P from the saved lse (nothing (T,T)-sized is ever stored):
//   Dv_i = dO_i·O_i,  dP = dO·Vᵀ,  dS = P∘(dP - Dv),  dQ = s·dS·K,  dK = s·dSᵀ·Q,  dV = Pᵀ·dO.
// The cpu kernels are blocked: a task owns a tile of 32 queries of one (b, h), walks the key
// blocks of 64 up to the diagonal with an online softmax (running max m and sum l, rescaling the
// accumulated output when the max grows), and writes O and lse. Key blocks are held transposed
// (D, 64), so a query's 64 scores are vector FMAs across keys rather than 64 horizontal dot
// products. The backward runs two passes so
// no two threads ever add into the same row: pass 1 owns query tiles and computes Dv and dQ,
// pass 2 owns key tiles of one kv head and sums dK and dV over every query that sees them (all
// heads of its group). Both recompute P.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "kernels/common.hpp"
#include "kernels/cpu_math.hpp"
#include "kernels/cuda_ops.hpp"

namespace strata::kernels {
namespace {

constexpr std::int64_t kQueryTile = 32;
constexpr std::int64_t kKeyTile = 64;

struct AttnDims {
  std::int64_t B, T, H, Hkv, D, group;
  std::int64_t qs, ks, vs;  // row strides
  float scale;
};

AttnDims resolve(const AttentionShape& s) {
  AttnDims d{};
  d.B = s.batch;
  d.T = s.seq_len;
  d.H = s.n_head;
  d.Hkv = s.n_kv_head == 0 ? s.n_head : s.n_kv_head;
  d.D = s.head_dim;
  d.group = d.Hkv > 0 ? d.H / d.Hkv : 1;
  d.qs = s.q_row_stride == 0 ? d.H * d.D : s.q_row_stride;
  d.ks = s.k_row_stride == 0 ? d.Hkv * d.D : s.k_row_stride;
  d.vs = s.v_row_stride == 0 ? d.Hkv * d.D : s.v_row_stride;
  d.scale = s.scale == 0.0f ? 1.0f / std::sqrt(static_cast<float>(d.D)) : s.scale;
  return d;
}

// Carves a scratch stripe into named buffers; with a null base it only measures.
class Carve {
 public:
  explicit Carve(float* base) : base_(base) {}
  float* take(std::int64_t n) {
    float* p = base_ == nullptr ? nullptr : base_ + used_;
    used_ += scratch_stripe(static_cast<std::size_t>(n));
    return p;
  }
  std::size_t used() const { return used_; }

 private:
  float* base_;
  std::size_t used_ = 0;
};

template <class Buffers>
std::size_t stripe_floats(std::int64_t D) {
  Carve c(nullptr);
  Buffers b(c, D);
  return c.used();
}

// Loads `rows` token rows of one head, times `scale`: row i of dst (rows, D) is token t0 + i.
void load_rows(ConstTensorArg x, const AttnDims& d, std::int64_t stride, std::int64_t b, std::int64_t t0,
               std::int64_t rows, std::int64_t head, float* dst, float scale = 1.0f) {
  for (std::int64_t i = 0; i < rows; ++i) {
    float* row = dst + i * d.D;
    load_f32(x, (b * d.T + t0 + i) * stride + head * d.D, d.D, row);
    if (scale != 1.0f) {
      for (std::int64_t e = 0; e < d.D; ++e) row[e] *= scale;
    }
  }
}

// Loads `rows` key rows of one head transposed: dst (D, kKeyTile), column j is token t0 + j;
// columns from `rows` on are zero so full-width loops over a tile stay finite.
void load_rows_transposed(ConstTensorArg x, const AttnDims& d, std::int64_t stride, std::int64_t b,
                          std::int64_t t0, std::int64_t rows, std::int64_t head, float* tmp, float* dst) {
  for (std::int64_t j = 0; j < kKeyTile; ++j) {
    if (j < rows) {
      load_f32(x, (b * d.T + t0 + j) * stride + head * d.D, d.D, tmp);
    } else {
      std::fill(tmp, tmp + d.D, 0.0f);
    }
    for (std::int64_t e = 0; e < d.D; ++e) dst[e * kKeyTile + j] = tmp[e];
  }
}

void store_rows(TensorArg x, const AttnDims& d, std::int64_t stride, std::int64_t b, std::int64_t t0,
                std::int64_t rows, std::int64_t head, const float* src) {
  for (std::int64_t i = 0; i < rows; ++i) {
    store_f32(x, (b * d.T + t0 + i) * stride + head * d.D, d.D, src + i * d.D);
  }
}

// s (kKeyTile) = x (D) · kt (D, kKeyTile): one row of scores against a whole key tile, vectorized
// across the keys (no horizontal sums).
inline void row_times_tile(float* s, const float* x, const float* kt, std::int64_t D) {
#pragma omp simd
  for (std::int64_t j = 0; j < kKeyTile; ++j) s[j] = 0.0f;
  for (std::int64_t e = 0; e < D; ++e) {
    const float xe = x[e];
    const float* row = kt + e * kKeyTile;
#pragma omp simd
    for (std::int64_t j = 0; j < kKeyTile; ++j) s[j] += xe * row[j];
  }
}

inline void axpy(float* y, float alpha, const float* x, std::int64_t n) {
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// ---- cpu kernels ----

struct ForwardBuffers {
  float *q, *o, *kt, *v, *s, *m, *l, *tmp;
  ForwardBuffers(Carve& c, std::int64_t D)
      : q(c.take(kQueryTile * D)),  // (Bq, D), scaled
        o(c.take(kQueryTile * D)),  // (Bq, D)
        kt(c.take(D * kKeyTile)),   // (D, Bk)
        v(c.take(kKeyTile * D)),    // (Bk, D)
        s(c.take(kKeyTile)),        // (Bk)
        m(c.take(kQueryTile)),      // (Bq)
        l(c.take(kQueryTile)),      // (Bq)
        tmp(c.take(D)) {}
};

// One query tile of one (b, h): queries [t0, t0 + nq).
STRATA_CPU_CLONES void attention_forward_tile(const AttnDims& d, TensorArg out, float* lse, ConstTensorArg q,
                                              ConstTensorArg k, ConstTensorArg v, std::int64_t b,
                                              std::int64_t h, std::int64_t t0, std::int64_t nq,
                                              float* stripe) {
  const std::int64_t D = d.D;
  const std::int64_t kh = h / d.group;
  Carve carve(stripe);
  ForwardBuffers w(carve, D);
  load_rows(q, d, d.qs, b, t0, nq, h, w.q, d.scale);
  std::fill(w.o, w.o + nq * D, 0.0f);
  std::fill(w.m, w.m + nq, -std::numeric_limits<float>::infinity());
  std::fill(w.l, w.l + nq, 0.0f);
  const std::int64_t key_end = t0 + nq;  // causal: the tile sees keys [0, key_end)
  for (std::int64_t k0 = 0; k0 < key_end; k0 += kKeyTile) {
    const std::int64_t nk = std::min(kKeyTile, key_end - k0);
    load_rows_transposed(k, d, d.ks, b, k0, nk, kh, w.tmp, w.kt);
    load_rows(v, d, d.vs, b, k0, nk, kh, w.v);
    for (std::int64_t i = 0; i < nq; ++i) {
      const std::int64_t visible = std::min(nk, t0 + i - k0 + 1);
      if (visible <= 0) continue;
      row_times_tile(w.s, w.q + i * D, w.kt, D);
      float block_max = -std::numeric_limits<float>::infinity();
      for (std::int64_t j = 0; j < visible; ++j) block_max = std::max(block_max, w.s[j]);
      const float m_new = std::max(w.m[i], block_max);
      const float correction = exp_f32(w.m[i] - m_new);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (std::int64_t j = 0; j < kKeyTile; ++j) {
        const float p = j < visible ? exp_f32(w.s[j] - m_new) : 0.0f;
        w.s[j] = p;
        sum += p;
      }
      w.l[i] = w.l[i] * correction + sum;
      w.m[i] = m_new;
      float* oi = w.o + i * D;
#pragma omp simd
      for (std::int64_t e = 0; e < D; ++e) oi[e] *= correction;
      for (std::int64_t j = 0; j < visible; ++j) axpy(oi, w.s[j], w.v + j * D, D);
    }
  }
  for (std::int64_t i = 0; i < nq; ++i) {
    const float inv = 1.0f / w.l[i];
    for (std::int64_t e = 0; e < D; ++e) w.o[i * D + e] *= inv;
    lse[(b * d.H + h) * d.T + t0 + i] = w.m[i] + std::log(w.l[i]);
  }
  store_rows(out, d, d.H * D, b, t0, nq, h, w.o);
}

Status attention_forward_cpu(const KernelContext& ctx, TensorArg out, float* lse, ConstTensorArg q,
                             ConstTensorArg k, ConstTensorArg v, const AttnDims& d) {
  const int threads = cpu_thread_count(ctx);
  const std::size_t stripe = stripe_floats<ForwardBuffers>(d.D);
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch("attention_forward", threads * stripe, 0));
  const std::int64_t q_tiles = (d.T + kQueryTile - 1) / kQueryTile;
  const std::int64_t tasks = d.B * d.H * q_tiles;
#pragma omp parallel for num_threads(threads) schedule(dynamic) if (tasks > 1)
  for (std::int64_t task = 0; task < tasks; ++task) {
    // Diagonal tiles last-first: the long ones start early, which balances the triangle.
    const std::int64_t qt = q_tiles - 1 - task % q_tiles;
    const std::int64_t bh = task / q_tiles;
    const std::int64_t t0 = qt * kQueryTile;
    attention_forward_tile(d, out, lse, q, k, v, bh / d.H, bh % d.H, t0, std::min(kQueryTile, d.T - t0),
                           buf + omp_get_thread_num() * stripe);
  }
  return ok_status();
}

struct QueryPassBuffers {
  float *q, *dout, *dq, *k, *kt, *vt, *s, *dp, *lse, *dv, *tmp;
  QueryPassBuffers(Carve& c, std::int64_t D)
      : q(c.take(kQueryTile * D)),     // (Bq, D), scaled
        dout(c.take(kQueryTile * D)),  // (Bq, D)
        dq(c.take(kQueryTile * D)),    // (Bq, D)
        k(c.take(kKeyTile * D)),       // (Bk, D)
        kt(c.take(D * kKeyTile)),      // (D, Bk)
        vt(c.take(D * kKeyTile)),      // (D, Bk)
        s(c.take(kKeyTile)),           // (Bk) scores, then dS
        dp(c.take(kKeyTile)),          // (Bk)
        lse(c.take(kQueryTile)),       // (Bq)
        dv(c.take(kQueryTile)),        // (Bq) Dv = dO·O
        tmp(c.take(D)) {}
};

// Pass 1 of the backward: Dv and dQ for one query tile of one (b, h).
STRATA_CPU_CLONES void attention_backward_query_tile(const AttnDims& d, TensorArg dq, float* dvec,
                                                     ConstTensorArg dout, ConstTensorArg q, ConstTensorArg k,
                                                     ConstTensorArg v, ConstTensorArg out, const float* lse,
                                                     std::int64_t b, std::int64_t h, std::int64_t t0,
                                                     std::int64_t nq, float* stripe) {
  const std::int64_t D = d.D;
  const std::int64_t kh = h / d.group;
  const std::int64_t row0 = (b * d.H + h) * d.T + t0;  // index of (b, h, t0) in (B,H,T)
  Carve carve(stripe);
  QueryPassBuffers w(carve, D);
  load_rows(q, d, d.qs, b, t0, nq, h, w.q, d.scale);
  load_rows(dout, d, d.H * D, b, t0, nq, h, w.dout);
  load_rows(out, d, d.H * D, b, t0, nq, h, w.dq);  // O, only to form Dv
  for (std::int64_t i = 0; i < nq; ++i) {
    float acc = 0.0f;
    for (std::int64_t e = 0; e < D; ++e) acc += w.dout[i * D + e] * w.dq[i * D + e];
    w.dv[i] = acc;
    w.lse[i] = lse[row0 + i];
    dvec[row0 + i] = acc;
  }
  std::fill(w.dq, w.dq + nq * D, 0.0f);
  const std::int64_t key_end = t0 + nq;
  for (std::int64_t k0 = 0; k0 < key_end; k0 += kKeyTile) {
    const std::int64_t nk = std::min(kKeyTile, key_end - k0);
    load_rows(k, d, d.ks, b, k0, nk, kh, w.k);
    load_rows_transposed(k, d, d.ks, b, k0, nk, kh, w.tmp, w.kt);
    load_rows_transposed(v, d, d.vs, b, k0, nk, kh, w.tmp, w.vt);
    for (std::int64_t i = 0; i < nq; ++i) {
      const std::int64_t visible = std::min(nk, t0 + i - k0 + 1);
      if (visible <= 0) continue;
      row_times_tile(w.s, w.q + i * D, w.kt, D);
      row_times_tile(w.dp, w.dout + i * D, w.vt, D);
      const float row_lse = w.lse[i], row_dv = w.dv[i];
#pragma omp simd
      for (std::int64_t j = 0; j < kKeyTile; ++j) {
        const float p = j < visible ? exp_f32(w.s[j] - row_lse) : 0.0f;
        w.s[j] = p * (w.dp[j] - row_dv);
      }
      float* dqi = w.dq + i * D;
      for (std::int64_t j = 0; j < visible; ++j) axpy(dqi, w.s[j], w.k + j * D, D);
    }
  }
  for (std::int64_t e = 0; e < nq * D; ++e) w.dq[e] *= d.scale;
  store_rows(dq, d, d.qs, b, t0, nq, h, w.dq);
}

struct KeyPassBuffers {
  float *kt, *vt, *dk, *dv, *q, *dout, *s, *dp, *lse, *dvec, *tmp;
  KeyPassBuffers(Carve& c, std::int64_t D)
      : kt(c.take(D * kKeyTile)),      // (D, Bk)
        vt(c.take(D * kKeyTile)),      // (D, Bk)
        dk(c.take(kKeyTile * D)),      // (Bk, D)
        dv(c.take(kKeyTile * D)),      // (Bk, D)
        q(c.take(kQueryTile * D)),     // (Bq, D), scaled
        dout(c.take(kQueryTile * D)),  // (Bq, D)
        s(c.take(kKeyTile)),           // (Bk) P
        dp(c.take(kKeyTile)),          // (Bk) dP, then dS
        lse(c.take(kQueryTile)),       // (Bq)
        dvec(c.take(kQueryTile)),      // (Bq)
        tmp(c.take(D)) {}
};

// Pass 2 of the backward: dK and dV for one key tile of one (b, kv head).
STRATA_CPU_CLONES void attention_backward_key_tile(const AttnDims& d, TensorArg dk, TensorArg dv,
                                                   const float* dvec, ConstTensorArg dout, ConstTensorArg q,
                                                   ConstTensorArg k, ConstTensorArg v, const float* lse,
                                                   std::int64_t b, std::int64_t kh, std::int64_t k0,
                                                   std::int64_t nk, float* stripe) {
  const std::int64_t D = d.D;
  Carve carve(stripe);
  KeyPassBuffers w(carve, D);
  load_rows_transposed(k, d, d.ks, b, k0, nk, kh, w.tmp, w.kt);
  load_rows_transposed(v, d, d.vs, b, k0, nk, kh, w.tmp, w.vt);
  std::fill(w.dk, w.dk + nk * D, 0.0f);
  std::fill(w.dv, w.dv + nk * D, 0.0f);
  for (std::int64_t g = 0; g < d.group; ++g) {
    const std::int64_t h = kh * d.group + g;
    for (std::int64_t q0 = k0 / kQueryTile * kQueryTile; q0 < d.T; q0 += kQueryTile) {
      const std::int64_t nq = std::min(kQueryTile, d.T - q0);
      const std::int64_t row0 = (b * d.H + h) * d.T + q0;
      load_rows(q, d, d.qs, b, q0, nq, h, w.q, d.scale);
      load_rows(dout, d, d.H * D, b, q0, nq, h, w.dout);
      for (std::int64_t i = 0; i < nq; ++i) {
        w.lse[i] = lse[row0 + i];
        w.dvec[i] = dvec[row0 + i];
      }
      for (std::int64_t i = 0; i < nq; ++i) {
        const std::int64_t visible = std::min(nk, q0 + i - k0 + 1);
        if (visible <= 0) continue;
        const float* qi = w.q + i * D;
        const float* doi = w.dout + i * D;
        row_times_tile(w.s, qi, w.kt, D);
        row_times_tile(w.dp, doi, w.vt, D);
        const float row_lse = w.lse[i], row_dv = w.dvec[i];
#pragma omp simd
        for (std::int64_t j = 0; j < kKeyTile; ++j) {
          const float p = j < visible ? exp_f32(w.s[j] - row_lse) : 0.0f;
          w.s[j] = p;
          w.dp[j] = p * (w.dp[j] - row_dv);
        }
        for (std::int64_t j = 0; j < visible; ++j) {
          axpy(w.dv + j * D, w.s[j], doi, D);
          axpy(w.dk + j * D, w.dp[j], qi, D);
        }
      }
    }
  }
  store_rows(dk, d, d.ks, b, k0, nk, kh, w.dk);
  store_rows(dv, d, d.vs, b, k0, nk, kh, w.dv);
}

Status attention_backward_cpu(const KernelContext& ctx, TensorArg dq, TensorArg dk, TensorArg dv,
                              ConstTensorArg dout, ConstTensorArg q, ConstTensorArg k, ConstTensorArg v,
                              ConstTensorArg out, const float* lse, const AttnDims& d) {
  constexpr std::string_view kOp = "attention_backward";
  const int threads = cpu_thread_count(ctx);
  const std::size_t stripe =
      std::max(stripe_floats<QueryPassBuffers>(d.D), stripe_floats<KeyPassBuffers>(d.D));
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch(kOp, threads * stripe, 0));
  STRATA_ASSIGN_OR_RETURN(float* dvec, scratch(kOp, d.B * d.H * d.T, 1));  // (B,H,T) Dv

  const std::int64_t q_tiles = (d.T + kQueryTile - 1) / kQueryTile;
  const std::int64_t q_tasks = d.B * d.H * q_tiles;
#pragma omp parallel for num_threads(threads) schedule(dynamic) if (q_tasks > 1)
  for (std::int64_t task = 0; task < q_tasks; ++task) {
    const std::int64_t qt = q_tiles - 1 - task % q_tiles;
    const std::int64_t bh = task / q_tiles;
    const std::int64_t t0 = qt * kQueryTile;
    attention_backward_query_tile(d, dq, dvec, dout, q, k, v, out, lse, bh / d.H, bh % d.H, t0,
                                  std::min(kQueryTile, d.T - t0), buf + omp_get_thread_num() * stripe);
  }

  const std::int64_t k_tiles = (d.T + kKeyTile - 1) / kKeyTile;
  const std::int64_t k_tasks = d.B * d.Hkv * k_tiles;
#pragma omp parallel for num_threads(threads) schedule(dynamic) if (k_tasks > 1)
  for (std::int64_t task = 0; task < k_tasks; ++task) {
    const std::int64_t kt = task % k_tiles;  // early key tiles see the most queries: they go first
    const std::int64_t bkh = task / k_tiles;
    const std::int64_t k0 = kt * kKeyTile;
    attention_backward_key_tile(d, dk, dv, dvec, dout, q, k, v, lse, bkh / d.Hkv, bkh % d.Hkv, k0,
                                std::min(kKeyTile, d.T - k0), buf + omp_get_thread_num() * stripe);
  }
  return ok_status();
}

Status check_attention(ArgCheck& check, const KernelContext& ctx, const AttentionShape& s) {
  const AttnDims d = resolve(s);
  check.context(ctx)
      .non_negative("batch", s.batch)
      .non_negative("seq_len", s.seq_len)
      .positive("n_head", s.n_head)
      .non_negative("n_kv_head", s.n_kv_head)
      .positive("head_dim", s.head_dim)
      .fail_if(
          d.Hkv > 0 && d.H % d.Hkv != 0,
          "n_head = " + std::to_string(d.H) + " is not a multiple of n_kv_head = " + std::to_string(d.Hkv))
      .at_least("q_row_stride", d.qs, "n_head*head_dim", d.H * d.D)
      .at_least("k_row_stride", d.ks, "n_kv_head*head_dim", d.Hkv * d.D)
      .at_least("v_row_stride", d.vs, "n_kv_head*head_dim", d.Hkv * d.D)
      .fail_if(!(d.scale > 0.0f) || !std::isfinite(d.scale), "scale must be positive and finite")
      .fail_if(ctx.backend == Backend::kCuda && d.D != 16 && d.D != 32 && d.D != 64 && d.D != 128,
               "head_dim = " + std::to_string(d.D) + " is not supported on cuda (16, 32, 64 or 128)");
  return check.status();
}

}  // namespace

// ---- launchers ----

Status attention_forward(const KernelContext& ctx, TensorArg out, float* lse, ConstTensorArg q,
                         ConstTensorArg k, ConstTensorArg v, const AttentionShape& shape) {
  ArgCheck check("attention_forward");
  check.tensor("out", out).ptr("lse", lse).tensor("q", q).tensor("k", k).tensor("v", v);
  check.same_dtype("q", q.dtype, "k", k.dtype)
      .same_dtype("q", q.dtype, "v", v.dtype)
      .same_dtype("q", q.dtype, "out", out.dtype);
  STRATA_RETURN_IF_ERROR(check_attention(check, ctx, shape));
  if (shape.batch == 0 || shape.seq_len == 0) return ok_status();
  if (ctx.backend == Backend::kCuda) return attention_forward_cuda(ctx, out, lse, q, k, v, shape);
  return attention_forward_cpu(ctx, out, lse, q, k, v, resolve(shape));
}

Status attention_backward(const KernelContext& ctx, TensorArg dq, TensorArg dk, TensorArg dv,
                          ConstTensorArg dout, ConstTensorArg q, ConstTensorArg k, ConstTensorArg v,
                          ConstTensorArg out, const float* lse, const AttentionShape& shape) {
  ArgCheck check("attention_backward");
  check.tensor("dq", dq)
      .tensor("dk", dk)
      .tensor("dv", dv)
      .tensor("dout", dout)
      .tensor("q", q)
      .tensor("k", k)
      .tensor("v", v)
      .tensor("out", out)
      .ptr("lse", lse)
      .workspace(ctx, attention_backward_workspace_bytes(ctx.backend, shape));
  for (auto [name, dtype] : {std::pair{"k", k.dtype}, std::pair{"v", v.dtype}, std::pair{"out", out.dtype},
                             std::pair{"dout", dout.dtype}, std::pair{"dq", dq.dtype},
                             std::pair{"dk", dk.dtype}, std::pair{"dv", dv.dtype}}) {
    check.same_dtype("q", q.dtype, name, dtype);
  }
  STRATA_RETURN_IF_ERROR(check_attention(check, ctx, shape));
  if (shape.batch == 0 || shape.seq_len == 0) return ok_status();
  if (ctx.backend == Backend::kCuda)
    return attention_backward_cuda(ctx, dq, dk, dv, dout, q, k, v, out, lse, shape);
  return attention_backward_cpu(ctx, dq, dk, dv, dout, q, k, v, out, lse, resolve(shape));
}

std::uint64_t attention_backward_workspace_bytes(Backend backend, const AttentionShape& shape) {
  return backend == Backend::kCuda ? attention_backward_workspace_bytes_cuda(shape) : 0;
}

}  // namespace strata::kernels
