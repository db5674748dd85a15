// Causal multi-head attention on CUDA, fused flash-style (the math is in attention.cpp): no
// (T,T) matrix is ever stored; the forward keeps an online softmax and saves only lse per row,
// the backward recomputes the probabilities.
//
// Work layout. A block of 128 threads owns a tile of 32 rows (query rows in the forward and
// dQ kernels, key rows in the dK/dV kernel); the 4 threads of a row each hold D/4 of its
// elements, interleaved (thread `sub` holds dims sub, sub+4, ...) so that shared-memory reads
// of the other operand hit consecutive banks. A dot product is 4 partial sums joined by two
// shuffles. The other operand streams through shared memory 32 rows at a time, in fp32.
//   forward:  block = (b, h, query tile); loops over key tiles up to the diagonal with an
//             online softmax (rescaling the accumulator once per key tile).
//   dvec:     Dv_i = dO_i·O_i, one warp per row, into the workspace.
//   dQ:       block = (b, h, query tile); loops over key tiles, dQ_i += s·dS_ij·K_j.
//   dK, dV:   block = (b, kv head, key tile); loops over every head of the group and every
//             query tile from the diagonal on, dV_j += P_ij·dO_i, dK_j += s·dS_ij·Q_i.
// Splitting dQ from dK/dV costs a second recomputation of P but no atomics, so the backward is
// deterministic. The kernels use CUDA cores (fp32 FMA), not tensor cores.
#include "kernels/cuda_common.cuh"
#include "kernels/cuda_ops.hpp"

namespace strata::kernels {
namespace {

using namespace cuda;

constexpr int kRowThreads = 4;  // threads per row
constexpr int kTileRows = 32;   // rows per tile, for queries and keys alike
constexpr int kThreads = kTileRows * kRowThreads;

struct AttnParams {
  std::int64_t B, T, H, Hkv, group;
  std::int64_t qs, ks, vs;  // row strides (elements)
  float scale;
  std::int64_t tiles;  // ceil(T / kTileRows)
};

// The full dot product of a row held as P interleaved values per thread with a row in shared
// memory; all 4 threads of the row get it. Every lane of the warp must call it.
template <int P>
__device__ __forceinline__ float row_dot(const float (&a)[P], const float* b, int sub) {
  float s = 0.0f;
#pragma unroll
  for (int e = 0; e < P; ++e) s += a[e] * b[sub + kRowThreads * e];
  s += __shfl_xor_sync(0xffffffffu, s, 1);
  s += __shfl_xor_sync(0xffffffffu, s, 2);
  return s;
}

// Loads rows [t0, t0 + kTileRows) of one head into dst (kTileRows, D) as fp32, scaled; rows past
// T are zero.
template <int D, class T>
__device__ __forceinline__ void load_tile(float (*dst)[D], const T* src, std::int64_t b, std::int64_t t0,
                                          std::int64_t head, std::int64_t stride, std::int64_t seq_len,
                                          float scale) {
  for (int idx = threadIdx.x; idx < kTileRows * D; idx += kThreads) {
    const int r = idx / D, c = idx % D;
    const std::int64_t t = t0 + r;
    dst[r][c] = t < seq_len ? scale * to_f32(src[(b * seq_len + t) * stride + head * D + c]) : 0.0f;
  }
}

// ---- kernels ----

template <int D, class T>
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(T* out, float* lse, const T* q, const T* k, const T* v, AttnParams p) {
  constexpr int P = D / kRowThreads;
  __shared__ float k_tile[kTileRows][D];
  __shared__ float v_tile[kTileRows][D];
  const int row = threadIdx.x / kRowThreads, sub = threadIdx.x % kRowThreads;
  const std::int64_t bh = blockIdx.x / p.tiles;
  const std::int64_t b = bh / p.H, h = bh % p.H, kh = h / p.group;
  const std::int64_t q0 = (blockIdx.x % p.tiles) * kTileRows;
  const std::int64_t t = q0 + row;
  const bool live = t < p.T;

  float qr[P], o[P];
#pragma unroll
  for (int e = 0; e < P; ++e) {
    qr[e] = live ? p.scale * to_f32(q[(b * p.T + t) * p.qs + h * D + sub + kRowThreads * e]) : 0.0f;
    o[e] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  const std::int64_t key_end = min(p.T, q0 + kTileRows);
  for (std::int64_t k0 = 0; k0 < key_end; k0 += kTileRows) {
    __syncthreads();
    load_tile<D>(k_tile, k, b, k0, kh, p.ks, p.T, 1.0f);
    load_tile<D>(v_tile, v, b, k0, kh, p.vs, p.T, 1.0f);
    __syncthreads();
    float s[kTileRows];
    float tile_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < kTileRows; ++j) {
      const float d = row_dot(qr, k_tile[j], sub);
      const bool visible = k0 + j <= t && k0 + j < p.T;
      s[j] = visible ? d : -INFINITY;
      tile_max = fmaxf(tile_max, s[j]);
    }
    const float m_new = fmaxf(m, tile_max);
    if (m_new == -INFINITY) continue;  // nothing visible yet (cannot happen with aligned tiles)
    const float correction = expf(m - m_new);
    float sum = 0.0f;
#pragma unroll
    for (int e = 0; e < P; ++e) o[e] *= correction;
#pragma unroll
    for (int j = 0; j < kTileRows; ++j) {
      const float pj = expf(s[j] - m_new);
      sum += pj;
#pragma unroll
      for (int e = 0; e < P; ++e) o[e] += pj * v_tile[j][sub + kRowThreads * e];
    }
    l = l * correction + sum;
    m = m_new;
  }
  if (live) {
    const float inv = 1.0f / l;
#pragma unroll
    for (int e = 0; e < P; ++e)
      out[((b * p.T + t) * p.H + h) * D + sub + kRowThreads * e] = from_f32<T>(o[e] * inv);
    if (sub == 0) lse[(b * p.H + h) * p.T + t] = m + logf(l);
  }
}

// dvec (B,H,T) = Σ_d dO·O, one warp per (b, t, h) row.
template <class T>
__global__ void attention_dvec_kernel(float* dvec, const T* dout, const T* out, std::int64_t rows,
                                      std::int64_t T_, std::int64_t H, std::int64_t D) {
  const std::int64_t r = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  float s = 0.0f;
  for (std::int64_t d = lane; d < D; d += 32) s += to_f32(dout[r * D + d]) * to_f32(out[r * D + d]);
  s = warp_sum(s);
  if (lane == 0) {
    const std::int64_t h = r % H, bt = r / H;
    dvec[((bt / T_) * H + h) * T_ + bt % T_] = s;
  }
}

template <int D, class T>
__global__ void __launch_bounds__(kThreads)
    attention_backward_dq_kernel(T* dq, const T* dout, const T* q, const T* k, const T* v, const float* lse,
                                 const float* dvec, AttnParams p) {
  constexpr int P = D / kRowThreads;
  __shared__ float k_tile[kTileRows][D];
  __shared__ float v_tile[kTileRows][D];
  const int row = threadIdx.x / kRowThreads, sub = threadIdx.x % kRowThreads;
  const std::int64_t bh = blockIdx.x / p.tiles;
  const std::int64_t b = bh / p.H, h = bh % p.H, kh = h / p.group;
  const std::int64_t q0 = (blockIdx.x % p.tiles) * kTileRows;
  const std::int64_t t = q0 + row;
  const bool live = t < p.T;

  float qr[P], dor[P], acc[P];
#pragma unroll
  for (int e = 0; e < P; ++e) {
    const int d = sub + kRowThreads * e;
    qr[e] = live ? p.scale * to_f32(q[(b * p.T + t) * p.qs + h * D + d]) : 0.0f;
    dor[e] = live ? to_f32(dout[((b * p.T + t) * p.H + h) * D + d]) : 0.0f;
    acc[e] = 0.0f;
  }
  const float row_lse = live ? lse[(b * p.H + h) * p.T + t] : 0.0f;
  const float row_dvec = live ? dvec[(b * p.H + h) * p.T + t] : 0.0f;
  const std::int64_t key_end = min(p.T, q0 + kTileRows);
  for (std::int64_t k0 = 0; k0 < key_end; k0 += kTileRows) {
    __syncthreads();
    load_tile<D>(k_tile, k, b, k0, kh, p.ks, p.T, 1.0f);
    load_tile<D>(v_tile, v, b, k0, kh, p.vs, p.T, 1.0f);
    __syncthreads();
#pragma unroll 4
    for (int j = 0; j < kTileRows; ++j) {
      const float s = row_dot(qr, k_tile[j], sub);
      const float dp = row_dot(dor, v_tile[j], sub);
      const bool visible = live && k0 + j <= t && k0 + j < p.T;
      const float pj = visible ? expf(s - row_lse) : 0.0f;
      const float ds = pj * (dp - row_dvec);
#pragma unroll
      for (int e = 0; e < P; ++e) acc[e] += ds * k_tile[j][sub + kRowThreads * e];
    }
  }
  if (live) {
#pragma unroll
    for (int e = 0; e < P; ++e) {
      dq[(b * p.T + t) * p.qs + h * D + sub + kRowThreads * e] = from_f32<T>(p.scale * acc[e]);
    }
  }
}

template <int D, class T>
__global__ void __launch_bounds__(kThreads)
    attention_backward_dkv_kernel(T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                                  const float* lse, const float* dvec, AttnParams p) {
  constexpr int P = D / kRowThreads;
  __shared__ float q_tile[kTileRows][D];  // scaled by p.scale
  __shared__ float do_tile[kTileRows][D];
  __shared__ float lse_tile[kTileRows];
  __shared__ float dvec_tile[kTileRows];
  const int row = threadIdx.x / kRowThreads, sub = threadIdx.x % kRowThreads;
  const std::int64_t bkh = blockIdx.x / p.tiles;
  const std::int64_t b = bkh / p.Hkv, kh = bkh % p.Hkv;
  const std::int64_t k0 = (blockIdx.x % p.tiles) * kTileRows;
  const std::int64_t j = k0 + row;
  const bool live = j < p.T;

  float kr[P], vr[P], dk_acc[P], dv_acc[P];
#pragma unroll
  for (int e = 0; e < P; ++e) {
    const int d = sub + kRowThreads * e;
    kr[e] = live ? to_f32(k[(b * p.T + j) * p.ks + kh * D + d]) : 0.0f;
    vr[e] = live ? to_f32(v[(b * p.T + j) * p.vs + kh * D + d]) : 0.0f;
    dk_acc[e] = 0.0f;
    dv_acc[e] = 0.0f;
  }
  for (std::int64_t g = 0; g < p.group; ++g) {
    const std::int64_t h = kh * p.group + g;
    // Tiles are aligned, so queries before k0 see none of these keys.
    for (std::int64_t q0 = k0; q0 < p.T; q0 += kTileRows) {
      __syncthreads();
      load_tile<D>(q_tile, q, b, q0, h, p.qs, p.T, p.scale);
      for (int idx = threadIdx.x; idx < kTileRows * D; idx += kThreads) {
        const int r = idx / D, c = idx % D;
        const std::int64_t t = q0 + r;
        do_tile[r][c] = t < p.T ? to_f32(dout[((b * p.T + t) * p.H + h) * D + c]) : 0.0f;
      }
      if (threadIdx.x < kTileRows) {
        const std::int64_t t = q0 + threadIdx.x;
        lse_tile[threadIdx.x] = t < p.T ? lse[(b * p.H + h) * p.T + t] : 0.0f;
        dvec_tile[threadIdx.x] = t < p.T ? dvec[(b * p.H + h) * p.T + t] : 0.0f;
      }
      __syncthreads();
#pragma unroll 4
      for (int i = 0; i < kTileRows; ++i) {
        const float s = row_dot(kr, q_tile[i], sub);
        const float dp = row_dot(vr, do_tile[i], sub);
        const bool visible = live && j <= q0 + i && q0 + i < p.T;
        const float pij = visible ? expf(s - lse_tile[i]) : 0.0f;
        const float ds = pij * (dp - dvec_tile[i]);
#pragma unroll
        for (int e = 0; e < P; ++e) {
          dv_acc[e] += pij * do_tile[i][sub + kRowThreads * e];
          dk_acc[e] += ds * q_tile[i][sub + kRowThreads * e];
        }
      }
    }
  }
  if (live) {
#pragma unroll
    for (int e = 0; e < P; ++e) {
      const int d = sub + kRowThreads * e;
      dk[(b * p.T + j) * p.ks + kh * D + d] = from_f32<T>(dk_acc[e]);
      dv[(b * p.T + j) * p.vs + kh * D + d] = from_f32<T>(dv_acc[e]);
    }
  }
}

AttnParams params_of(const AttentionShape& s) {
  AttnParams p{};
  p.B = s.batch;
  p.T = s.seq_len;
  p.H = s.n_head;
  p.Hkv = s.n_kv_head == 0 ? s.n_head : s.n_kv_head;
  p.group = p.H / p.Hkv;
  p.qs = s.q_row_stride == 0 ? p.H * s.head_dim : s.q_row_stride;
  p.ks = s.k_row_stride == 0 ? p.Hkv * s.head_dim : s.k_row_stride;
  p.vs = s.v_row_stride == 0 ? p.Hkv * s.head_dim : s.v_row_stride;
  p.scale = s.scale == 0.0f ? 1.0f / sqrtf(static_cast<float>(s.head_dim)) : s.scale;
  p.tiles = (p.T + kTileRows - 1) / kTileRows;
  return p;
}

// Calls fn(std::integral_constant<int, D>) for the supported head dims (checked by the caller).
template <class Fn>
void dispatch_head_dim(std::int64_t D, Fn&& fn) {
  switch (D) {
    case 16:
      fn(std::integral_constant<int, 16>{});
      break;
    case 32:
      fn(std::integral_constant<int, 32>{});
      break;
    case 64:
      fn(std::integral_constant<int, 64>{});
      break;
    default:
      fn(std::integral_constant<int, 128>{});
      break;
  }
}

}  // namespace

// ---- launchers ----

Status attention_forward_cuda(const KernelContext& ctx, TensorArg out, float* lse, ConstTensorArg q,
                              ConstTensorArg k, ConstTensorArg v, const AttentionShape& shape) {
  const AttnParams p = params_of(shape);
  const unsigned blocks = static_cast<unsigned>(p.B * p.H * p.tiles);
  dispatch(q.dtype, [&](auto tt) {
    dispatch_head_dim(shape.head_dim, [&](auto dim) {
      using T = typename decltype(tt)::type;
      constexpr int D = decltype(dim)::value;
      attention_forward_kernel<D, T><<<blocks, kThreads, 0, stream_of(ctx)>>>(typed<T>(out), lse, typed<T>(q),
                                                                              typed<T>(k), typed<T>(v), p);
    });
  });
  return launch_status("attention_forward");
}

std::uint64_t attention_backward_workspace_bytes_cuda(const AttentionShape& shape) {
  const std::uint64_t n = static_cast<std::uint64_t>(shape.batch) * shape.n_head * shape.seq_len;
  return (n * sizeof(float) + 255) / 256 * 256;
}

Status attention_backward_cuda(const KernelContext& ctx, TensorArg dq, TensorArg dk, TensorArg dv,
                               ConstTensorArg dout, ConstTensorArg q, ConstTensorArg k, ConstTensorArg v,
                               ConstTensorArg out, const float* lse, const AttentionShape& shape) {
  const AttnParams p = params_of(shape);
  cudaStream_t stream = stream_of(ctx);
  auto* dvec = static_cast<float*>(ctx.workspace);  // (B,H,T)
  const std::int64_t rows = p.B * p.T * p.H;
  const unsigned dq_blocks = static_cast<unsigned>(p.B * p.H * p.tiles);
  const unsigned dkv_blocks = static_cast<unsigned>(p.B * p.Hkv * p.tiles);
  dispatch(q.dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    attention_dvec_kernel<<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(
        dvec, typed<T>(dout), typed<T>(out), rows, p.T, p.H, shape.head_dim);
    dispatch_head_dim(shape.head_dim, [&](auto dim) {
      constexpr int D = decltype(dim)::value;
      attention_backward_dq_kernel<D, T><<<dq_blocks, kThreads, 0, stream>>>(
          typed<T>(dq), typed<T>(dout), typed<T>(q), typed<T>(k), typed<T>(v), lse, dvec, p);
      attention_backward_dkv_kernel<D, T><<<dkv_blocks, kThreads, 0, stream>>>(
          typed<T>(dk), typed<T>(dv), typed<T>(dout), typed<T>(q), typed<T>(k), typed<T>(v), lse, dvec, p);
    });
  });
  return launch_status("attention_backward");
}

}  // namespace strata::kernels
