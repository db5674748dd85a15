// Causal multi-head self-attention, with grouped-query heads (query head h reads kv head
// h / (H/Hkv)). For one head, with scale s (1/√D by default):
//   S = s·Q·Kᵀ masked to keys j ≤ i,  P = softmax_rows(S),  O = P·V,  lse_i = log Σ_j exp(S_ij).
// Backward, recomputing P from the saved lse (nothing (T,T)-sized is ever stored):
//   Dv_i = dO_i·O_i,  dP = dO·Vᵀ,  dS = P∘(dP - Dv),  dQ = s·dS·K,  dK = s·dSᵀ·Q,  dV = Pᵀ·dO.
// The cpu kernels are blocked: a task owns a tile of 32 queries of one (b, h), walks the key
// blocks of 64 up to the diagonal with an online softmax (running max m and sum l, rescaling the
// accumulated output when the max grows), and writes O and lse. Keys are repacked once per call
// as transposed (D, 64) blocks, so the scores of 4 queries against 64 keys are register-blocked
// vector FMAs rather than horizontal dot products. The backward runs two passes so
// no two threads ever add into the same row: pass 1 owns query tiles and computes Dv and dQ,
// pass 2 owns key tiles of one kv head and sums dK and dV over every query that sees them (all
// heads of its group). Both recompute P.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
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

// Head dim padded to whole 16-float vectors: tile rows are `Dp` floats apart and the padding is
// zero, so every product below runs on full vectors whatever D is.
inline std::int64_t padded_dim(std::int64_t D) { return (D + 15) / 16 * 16; }
inline std::int64_t round_up4(std::int64_t n) { return (n + 3) / 4 * 4; }

// Loads `rows` token rows of one head, times `scale`, into dst (kQueryTile or kKeyTile rows,
// Dp), zeroing the padding columns and the rows from `rows` to `capacity`.
void load_rows(ConstTensorArg x, const AttnDims& d, std::int64_t stride, std::int64_t b, std::int64_t t0,
               std::int64_t rows, std::int64_t capacity, std::int64_t head, float* dst, float scale = 1.0f) {
  const std::int64_t Dp = padded_dim(d.D);
  std::fill(dst, dst + capacity * Dp, 0.0f);
  for (std::int64_t i = 0; i < rows; ++i) {
    float* row = dst + i * Dp;
    load_f32(x, (b * d.T + t0 + i) * stride + head * d.D, d.D, row);
    if (scale != 1.0f) {
      for (std::int64_t e = 0; e < d.D; ++e) row[e] *= scale;
    }
  }
}

// Loads `rows` key rows of one head transposed: dst (D, kKeyTile), column j is token t0 + j;
// columns from `rows` on are zero.
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
  const std::int64_t Dp = padded_dim(d.D);
  for (std::int64_t i = 0; i < rows; ++i) {
    store_f32(x, (b * d.T + t0 + i) * stride + head * d.D, d.D, src + i * Dp);
  }
}

// The two small products the tiles are made of, register-blocked on GCC vectors of 16 floats
// (lowered to whatever width the clone targets): 4 rows at a time, so each loaded vector feeds 4
// FMAs and the accumulators stay in registers.
// The helpers are internal and always inlined, so GCC's note that passing a 64-byte vector by
// value has a different ABI without AVX-512 does not apply.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
using V16 = float __attribute__((vector_size(64)));
STRATA_ALWAYS_INLINE V16 load16(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
STRATA_ALWAYS_INLINE void store16(float* p, V16 v) { std::memcpy(p, &v, sizeof v); }

// s (rows, kKeyTile) = x (rows, Dp) · kt (D, kKeyTile); rows a multiple of 4.
STRATA_ALWAYS_INLINE void tile_scores(float* s, const float* x, std::int64_t rows, const float* kt,
                                      std::int64_t D) {
  const std::int64_t Dp = padded_dim(D);
  for (std::int64_t r0 = 0; r0 < rows; r0 += 4) {
    V16 acc[4][4] = {};
    for (std::int64_t e = 0; e < D; ++e) {
      const float* k = kt + e * kKeyTile;
      const V16 k0 = load16(k), k1 = load16(k + 16), k2 = load16(k + 32), k3 = load16(k + 48);
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const float xv = x[(r0 + r) * Dp + e];
        acc[r][0] += xv * k0;
        acc[r][1] += xv * k1;
        acc[r][2] += xv * k2;
        acc[r][3] += xv * k3;
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      for (int c = 0; c < 4; ++c) store16(s + (r0 + r) * kKeyTile + 16 * c, acc[r][c]);
    }
  }
}

// y (rows, Dp) += P · x (n, Dp) with P(r, k) = p[r·rs + k·cs]; rows a multiple of 4.
// (rs, cs) = (kKeyTile, 1) reads P as stored; (1, kKeyTile) reads it transposed (dV = Pᵀ·dO).
STRATA_ALWAYS_INLINE void tile_accumulate(float* y, const float* p, std::int64_t rs, std::int64_t cs,
                                          const float* x, std::int64_t n, std::int64_t rows,
                                          std::int64_t Dp) {
  for (std::int64_t r0 = 0; r0 < rows; r0 += 4) {
    std::int64_t c0 = 0;
    for (; c0 + 32 <= Dp; c0 += 32) {
      V16 acc[4][2];
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        acc[r][0] = load16(y + (r0 + r) * Dp + c0);
        acc[r][1] = load16(y + (r0 + r) * Dp + c0 + 16);
      }
      for (std::int64_t k = 0; k < n; ++k) {
        const V16 x0 = load16(x + k * Dp + c0), x1 = load16(x + k * Dp + c0 + 16);
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          const float pv = p[(r0 + r) * rs + k * cs];
          acc[r][0] += pv * x0;
          acc[r][1] += pv * x1;
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        store16(y + (r0 + r) * Dp + c0, acc[r][0]);
        store16(y + (r0 + r) * Dp + c0 + 16, acc[r][1]);
      }
    }
    if (c0 < Dp) {  // one 16-wide column block left
      V16 acc[4];
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) acc[r] = load16(y + (r0 + r) * Dp + c0);
      for (std::int64_t k = 0; k < n; ++k) {
        const V16 x0 = load16(x + k * Dp + c0);
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) acc[r] += p[(r0 + r) * rs + k * cs] * x0;
      }
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) store16(y + (r0 + r) * Dp + c0, acc[r]);
    }
  }
}

#pragma GCC diagnostic pop

// ---- cpu kernels ----

// Per call, the operands are first repacked once into fp32 layouts the tiles can use directly
// (a tile then touches no conversion code):
//   transposed blocks: keys (or values) of every (b, kv head) as blocks of (D, kKeyTile); block
//     (b, kh, kb) starts at ((b·Hkv + kh)·key_blocks + kb)·D·kKeyTile;
//   row blocks: (b, head, t) rows of Dp floats, sequence padded to whole key tiles (Tp), padding
//     zero; row (b, head, t) starts at ((b·heads + head)·Tp + t)·Dp.
std::int64_t key_blocks(const AttnDims& d) { return (d.T + kKeyTile - 1) / kKeyTile; }
std::int64_t padded_len(const AttnDims& d) { return key_blocks(d) * kKeyTile; }

const float* key_block(const float* all, const AttnDims& d, std::int64_t b, std::int64_t kh,
                       std::int64_t k0) {
  return all + ((b * d.Hkv + kh) * key_blocks(d) + k0 / kKeyTile) * d.D * kKeyTile;
}
const float* row_block(const float* all, const AttnDims& d, std::int64_t heads, std::int64_t b,
                       std::int64_t head, std::int64_t t0) {
  return all + ((b * heads + head) * padded_len(d) + t0) * padded_dim(d.D);
}
std::size_t transposed_floats(const AttnDims& d) {
  return static_cast<std::size_t>(d.B * d.Hkv * key_blocks(d) * d.D * kKeyTile);
}
std::size_t rows_floats(const AttnDims& d, std::int64_t heads) {
  return static_cast<std::size_t>(d.B * heads * padded_len(d) * padded_dim(d.D));
}

void transpose_blocks(int threads, ConstTensorArg x, const AttnDims& d, std::int64_t stride,
                      float* tmp_stripes, std::size_t stripe, float* all) {
  const std::int64_t tasks = d.B * d.Hkv * key_blocks(d);
#pragma omp parallel for num_threads(threads) schedule(static) if (tasks > 1)
  for (std::int64_t task = 0; task < tasks; ++task) {
    const std::int64_t k0 = task % key_blocks(d) * kKeyTile, bkh = task / key_blocks(d);
    load_rows_transposed(x, d, stride, bkh / d.Hkv, k0, std::min(kKeyTile, d.T - k0), bkh % d.Hkv,
                         tmp_stripes + omp_get_thread_num() * stripe, all + task * d.D * kKeyTile);
  }
}

// Rows of `heads` heads, times `scale`.
void pack_rows(int threads, ConstTensorArg x, const AttnDims& d, std::int64_t stride, std::int64_t heads,
               float scale, float* all) {
  const std::int64_t tasks = d.B * heads * key_blocks(d);
#pragma omp parallel for num_threads(threads) schedule(static) if (tasks > 1)
  for (std::int64_t task = 0; task < tasks; ++task) {
    const std::int64_t t0 = task % key_blocks(d) * kKeyTile, bh = task / key_blocks(d);
    load_rows(x, d, stride, bh / heads, t0, std::min(kKeyTile, d.T - t0), kKeyTile, bh % heads,
              all + task * kKeyTile * padded_dim(d.D), scale);
  }
}

struct ForwardBuffers {
  float *q, *o, *s, *m, *l;
  ForwardBuffers(Carve& c, std::int64_t D)
      : q(c.take(kQueryTile * padded_dim(D))),  // (Bq, Dp), scaled
        o(c.take(kQueryTile * padded_dim(D))),  // (Bq, Dp)
        s(c.take(kQueryTile * kKeyTile)),       // (Bq, Bk) scores, then P
        m(c.take(kQueryTile)),                  // (Bq)
        l(c.take(kQueryTile)) {}                // (Bq)
};

// One query tile of one (b, h): queries [t0, t0 + nq). kt_all: transposed keys; v_all: value rows.
STRATA_CPU_CLONES void attention_forward_tile(const AttnDims& d, TensorArg out, float* lse, ConstTensorArg q,
                                              const float* kt_all, const float* v_all, std::int64_t b,
                                              std::int64_t h, std::int64_t t0, std::int64_t nq,
                                              float* stripe) {
  const std::int64_t D = d.D, Dp = padded_dim(D), rows = round_up4(nq);
  const std::int64_t kh = h / d.group;
  Carve carve(stripe);
  ForwardBuffers w(carve, D);
  load_rows(q, d, d.qs, b, t0, nq, kQueryTile, h, w.q, d.scale);
  std::fill(w.o, w.o + kQueryTile * Dp, 0.0f);
  std::fill(w.m, w.m + kQueryTile, -std::numeric_limits<float>::infinity());
  std::fill(w.l, w.l + kQueryTile, 0.0f);
  const std::int64_t key_end = t0 + nq;  // causal: the tile sees keys [0, key_end)
  for (std::int64_t k0 = 0; k0 < key_end; k0 += kKeyTile) {
    const std::int64_t nk = std::min(kKeyTile, key_end - k0);
    tile_scores(w.s, w.q, rows, key_block(kt_all, d, b, kh, k0), D);
    for (std::int64_t i = 0; i < rows; ++i) {
      float* si = w.s + i * kKeyTile;
      const std::int64_t visible = i < nq ? std::min(nk, t0 + i - k0 + 1) : 0;
      if (visible <= 0) {
        std::fill(si, si + kKeyTile, 0.0f);
        continue;
      }
      float block_max = -std::numeric_limits<float>::infinity();
      for (std::int64_t j = 0; j < visible; ++j) block_max = std::max(block_max, si[j]);
      const float m_new = std::max(w.m[i], block_max);
      const float correction = exp_f32(w.m[i] - m_new);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (std::int64_t j = 0; j < kKeyTile; ++j) {
        const float p = j < visible ? exp_f32(si[j] - m_new) : 0.0f;
        si[j] = p;
        sum += p;
      }
      w.l[i] = w.l[i] * correction + sum;
      w.m[i] = m_new;
      float* oi = w.o + i * Dp;
#pragma omp simd
      for (std::int64_t e = 0; e < Dp; ++e) oi[e] *= correction;
    }
    tile_accumulate(w.o, w.s, kKeyTile, 1, row_block(v_all, d, d.Hkv, b, kh, k0), nk, rows, Dp);
  }
  for (std::int64_t i = 0; i < nq; ++i) {
    const float inv = 1.0f / w.l[i];
    for (std::int64_t e = 0; e < D; ++e) w.o[i * Dp + e] *= inv;
    lse[(b * d.H + h) * d.T + t0 + i] = w.m[i] + std::log(w.l[i]);
  }
  store_rows(out, d, d.H * D, b, t0, nq, h, w.o);
}

Status attention_forward_cpu(const KernelContext& ctx, TensorArg out, float* lse, ConstTensorArg q,
                             ConstTensorArg k, ConstTensorArg v, const AttnDims& d) {
  constexpr std::string_view kOp = "attention_forward";
  const int threads = cpu_thread_count(ctx);
  const std::size_t stripe = std::max(stripe_floats<ForwardBuffers>(d.D), scratch_stripe(d.D));
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch(kOp, threads * stripe, 0));
  STRATA_ASSIGN_OR_RETURN(float* kt_all, scratch(kOp, transposed_floats(d), 1));
  STRATA_ASSIGN_OR_RETURN(float* v_all, scratch(kOp, rows_floats(d, d.Hkv), 2));
  transpose_blocks(threads, k, d, d.ks, buf, stripe, kt_all);
  pack_rows(threads, v, d, d.vs, d.Hkv, 1.0f, v_all);

  const std::int64_t q_tiles = (d.T + kQueryTile - 1) / kQueryTile;
  const std::int64_t tasks = d.B * d.H * q_tiles;
#pragma omp parallel for num_threads(threads) schedule(dynamic) if (tasks > 1)
  for (std::int64_t task = 0; task < tasks; ++task) {
    // Diagonal tiles last-first: the long ones start early, which balances the triangle.
    const std::int64_t qt = q_tiles - 1 - task % q_tiles;
    const std::int64_t bh = task / q_tiles;
    const std::int64_t t0 = qt * kQueryTile;
    attention_forward_tile(d, out, lse, q, kt_all, v_all, bh / d.H, bh % d.H, t0,
                           std::min(kQueryTile, d.T - t0), buf + omp_get_thread_num() * stripe);
  }
  return ok_status();
}

struct QueryPassBuffers {
  float *q, *dout, *dq, *s, *dp, *lse, *dv;
  QueryPassBuffers(Carve& c, std::int64_t D)
      : q(c.take(kQueryTile * padded_dim(D))),     // (Bq, Dp), scaled
        dout(c.take(kQueryTile * padded_dim(D))),  // (Bq, Dp)
        dq(c.take(kQueryTile * padded_dim(D))),    // (Bq, Dp)
        s(c.take(kQueryTile * kKeyTile)),          // (Bq, Bk) scores, then dS
        dp(c.take(kQueryTile * kKeyTile)),         // (Bq, Bk)
        lse(c.take(kQueryTile)),                   // (Bq)
        dv(c.take(kQueryTile)) {}                  // (Bq) Dv = dO·O
};

// The operands of the backward, repacked once per call.
struct BackwardPacks {
  float* dvec;    // (B,H,T) Dv = dO·O, written by pass 1
  float* kt_all;  // transposed key blocks
  float* vt_all;  // transposed value blocks
  float* k_all;   // key rows
  float* q_all;   // query rows, scaled
  float* do_all;  // dout rows
};

// Pass 1 of the backward: Dv and dQ for one query tile of one (b, h).
STRATA_CPU_CLONES void attention_backward_query_tile(const AttnDims& d, TensorArg dq,
                                                     const BackwardPacks& packs, ConstTensorArg dout,
                                                     ConstTensorArg q, ConstTensorArg out, const float* lse,
                                                     std::int64_t b, std::int64_t h, std::int64_t t0,
                                                     std::int64_t nq, float* stripe) {
  const std::int64_t D = d.D, Dp = padded_dim(D), rows = round_up4(nq);
  const std::int64_t kh = h / d.group;
  const std::int64_t row0 = (b * d.H + h) * d.T + t0;  // index of (b, h, t0) in (B,H,T)
  Carve carve(stripe);
  QueryPassBuffers w(carve, D);
  load_rows(q, d, d.qs, b, t0, nq, kQueryTile, h, w.q, d.scale);
  load_rows(dout, d, d.H * D, b, t0, nq, kQueryTile, h, w.dout);
  load_rows(out, d, d.H * D, b, t0, nq, kQueryTile, h, w.dq);  // O, only to form Dv
  for (std::int64_t i = 0; i < nq; ++i) {
    float acc = 0.0f;
    for (std::int64_t e = 0; e < D; ++e) acc += w.dout[i * Dp + e] * w.dq[i * Dp + e];
    w.dv[i] = acc;
    w.lse[i] = lse[row0 + i];
    packs.dvec[row0 + i] = acc;
  }
  std::fill(w.dq, w.dq + kQueryTile * Dp, 0.0f);
  const std::int64_t key_end = t0 + nq;
  for (std::int64_t k0 = 0; k0 < key_end; k0 += kKeyTile) {
    const std::int64_t nk = std::min(kKeyTile, key_end - k0);
    tile_scores(w.s, w.q, rows, key_block(packs.kt_all, d, b, kh, k0), D);
    tile_scores(w.dp, w.dout, rows, key_block(packs.vt_all, d, b, kh, k0), D);
    for (std::int64_t i = 0; i < rows; ++i) {
      float* si = w.s + i * kKeyTile;
      const float* dpi = w.dp + i * kKeyTile;
      const std::int64_t visible = i < nq ? std::min(nk, t0 + i - k0 + 1) : 0;
      const float row_lse = i < nq ? w.lse[i] : 0.0f, row_dv = i < nq ? w.dv[i] : 0.0f;
#pragma omp simd
      for (std::int64_t j = 0; j < kKeyTile; ++j) {
        const float p = j < visible ? exp_f32(si[j] - row_lse) : 0.0f;
        si[j] = p * (dpi[j] - row_dv);
      }
    }
    tile_accumulate(w.dq, w.s, kKeyTile, 1, row_block(packs.k_all, d, d.Hkv, b, kh, k0), nk, rows, Dp);
  }
  for (std::int64_t e = 0; e < nq * Dp; ++e) w.dq[e] *= d.scale;
  store_rows(dq, d, d.qs, b, t0, nq, h, w.dq);
}

struct KeyPassBuffers {
  float *dk, *dv, *s, *dp;
  KeyPassBuffers(Carve& c, std::int64_t D)
      : dk(c.take(kKeyTile * padded_dim(D))),  // (Bk, Dp)
        dv(c.take(kKeyTile * padded_dim(D))),  // (Bk, Dp)
        s(c.take(kQueryTile * kKeyTile)),      // (Bq, Bk) P
        dp(c.take(kQueryTile * kKeyTile)) {}   // (Bq, Bk) dP, then dS
};

// Pass 2 of the backward: dK and dV for one key tile of one (b, kv head).
STRATA_CPU_CLONES void attention_backward_key_tile(const AttnDims& d, TensorArg dk, TensorArg dv,
                                                   const BackwardPacks& packs, const float* lse,
                                                   std::int64_t b, std::int64_t kh, std::int64_t k0,
                                                   std::int64_t nk, float* stripe) {
  const std::int64_t D = d.D, Dp = padded_dim(D);
  Carve carve(stripe);
  KeyPassBuffers w(carve, D);
  const float* kt = key_block(packs.kt_all, d, b, kh, k0);
  const float* vt = key_block(packs.vt_all, d, b, kh, k0);
  std::fill(w.dk, w.dk + kKeyTile * Dp, 0.0f);
  std::fill(w.dv, w.dv + kKeyTile * Dp, 0.0f);
  for (std::int64_t g = 0; g < d.group; ++g) {
    const std::int64_t h = kh * d.group + g;
    for (std::int64_t q0 = k0 / kQueryTile * kQueryTile; q0 < d.T; q0 += kQueryTile) {
      const std::int64_t nq = std::min(kQueryTile, d.T - q0), rows = round_up4(nq);
      const std::int64_t row0 = (b * d.H + h) * d.T + q0;
      const float* qs = row_block(packs.q_all, d, d.H, b, h, q0);    // (rows, Dp), scaled
      const float* dos = row_block(packs.do_all, d, d.H, b, h, q0);  // (rows, Dp)
      tile_scores(w.s, qs, rows, kt, D);
      tile_scores(w.dp, dos, rows, vt, D);
      for (std::int64_t i = 0; i < rows; ++i) {
        float* si = w.s + i * kKeyTile;
        float* dpi = w.dp + i * kKeyTile;
        const std::int64_t visible = i < nq ? std::min(nk, q0 + i - k0 + 1) : 0;
        const float row_lse = i < nq ? lse[row0 + i] : 0.0f, row_dv = i < nq ? packs.dvec[row0 + i] : 0.0f;
#pragma omp simd
        for (std::int64_t j = 0; j < kKeyTile; ++j) {
          const float p = j < visible ? exp_f32(si[j] - row_lse) : 0.0f;
          si[j] = p;
          dpi[j] = p * (dpi[j] - row_dv);
        }
      }
      // dV_j += Σ_i P_ij·dO_i and dK_j += Σ_i dS_ij·(s·Q_i): P read transposed.
      tile_accumulate(w.dv, w.s, 1, kKeyTile, dos, nq, kKeyTile, Dp);
      tile_accumulate(w.dk, w.dp, 1, kKeyTile, qs, nq, kKeyTile, Dp);
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
  const std::size_t stripe = std::max(
      {stripe_floats<QueryPassBuffers>(d.D), stripe_floats<KeyPassBuffers>(d.D), scratch_stripe(d.D)});
  BackwardPacks packs{};
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch(kOp, threads * stripe, 0));
  STRATA_ASSIGN_OR_RETURN(packs.dvec, scratch(kOp, d.B * d.H * d.T, 1));
  STRATA_ASSIGN_OR_RETURN(packs.kt_all, scratch(kOp, transposed_floats(d), 2));
  STRATA_ASSIGN_OR_RETURN(packs.vt_all, scratch(kOp, transposed_floats(d), 3));
  STRATA_ASSIGN_OR_RETURN(packs.k_all, scratch(kOp, rows_floats(d, d.Hkv), 4));
  STRATA_ASSIGN_OR_RETURN(packs.q_all, scratch(kOp, rows_floats(d, d.H), 5));
  STRATA_ASSIGN_OR_RETURN(packs.do_all, scratch(kOp, rows_floats(d, d.H), 6));
  transpose_blocks(threads, k, d, d.ks, buf, stripe, packs.kt_all);
  transpose_blocks(threads, v, d, d.vs, buf, stripe, packs.vt_all);
  pack_rows(threads, k, d, d.ks, d.Hkv, 1.0f, packs.k_all);
  pack_rows(threads, q, d, d.qs, d.H, d.scale, packs.q_all);
  pack_rows(threads, dout, d, d.H * d.D, d.H, 1.0f, packs.do_all);

  const std::int64_t q_tiles = (d.T + kQueryTile - 1) / kQueryTile;
  const std::int64_t q_tasks = d.B * d.H * q_tiles;
#pragma omp parallel for num_threads(threads) schedule(dynamic) if (q_tasks > 1)
  for (std::int64_t task = 0; task < q_tasks; ++task) {
    const std::int64_t qt = q_tiles - 1 - task % q_tiles;
    const std::int64_t bh = task / q_tiles;
    const std::int64_t t0 = qt * kQueryTile;
    attention_backward_query_tile(d, dq, packs, dout, q, out, lse, bh / d.H, bh % d.H, t0,
                                  std::min(kQueryTile, d.T - t0), buf + omp_get_thread_num() * stripe);
  }

  const std::int64_t k_tiles = key_blocks(d);
  const std::int64_t k_tasks = d.B * d.Hkv * k_tiles;
#pragma omp parallel for num_threads(threads) schedule(dynamic) if (k_tasks > 1)
  for (std::int64_t task = 0; task < k_tasks; ++task) {
    const std::int64_t kt = task % k_tiles;  // early key tiles see the most queries: they go first
    const std::int64_t bkh = task / k_tiles;
    const std::int64_t k0 = kt * kKeyTile;
    attention_backward_key_tile(d, dk, dv, packs, lse, bkh / d.Hkv, bkh % d.Hkv, k0,
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
