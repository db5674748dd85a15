// Token and position embedding on CUDA (the formulas are in embedding.cpp).
// Forward: one thread per output element. Out-of-range tokens give NaN rows (no device-side
// error channel; the data loader validates tokens and NaN makes a slip visible in the loss).
// Backward: like the cpu path, deterministic without atomics: keys token<<32 | position are
// radix-sorted (CUB, in the caller's workspace), then one block per run of equal tokens (and
// 32-column tile) sums that token's rows in fp32 and adds the sum to dwte once: kRunLanes threads
// per column split the run (lane y takes rows y, y + kRunLanes, ... of the run, in order) and
// lane 0 adds the lanes' sums in lane order, so a frequent token's long run is shared out while
// the order, and so the result, stays fixed. dwpe[t] sums the B rows of position t in order.
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda_common.cuh"
#include "kernels/cuda_ops.hpp"

namespace strata::kernels {
namespace {

using namespace cuda;

constexpr int kThreads = 256;
constexpr int kTile = 32;     // columns per wte-backward block (threadIdx.x)
constexpr int kRunLanes = 8;  // threads per column sharing a run of equal tokens (threadIdx.y)

// ---- kernels ----

template <class TO, class TW, class TP>
// wte holds vocabulary rows [vocab_begin, vocab_begin + V); other tokens give `outside` (NaN for a
// whole table, 0 for a vocabulary shard).
__global__ void embedding_forward_kernel(TO* out, const std::int32_t* tokens, const TW* wte, const TP* wpe,
                                         std::int64_t BT, std::int64_t T, std::int64_t C, std::int64_t V,
                                         std::int64_t vocab_begin, float outside) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < BT * C;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t bt = i / C, c = i % C;
    const std::int64_t tok = static_cast<std::int64_t>(tokens[bt]) - vocab_begin;
    float v = tokens[bt] < 0 ? NAN : ((tok >= 0 && tok < V) ? to_f32(wte[tok * C + c]) : outside);
    if (wpe != nullptr) v += to_f32(wpe[(bt % T) * C + c]);
    out[i] = from_f32<TO>(v);
  }
}

// keys[i] = (token - vocab_begin) << 32 | i; tokens outside the table sort last as V and are skipped.
__global__ void embedding_keys_kernel(std::uint64_t* keys, const std::int32_t* tokens, std::int64_t n,
                                      std::int64_t V, std::int64_t vocab_begin) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t tok = static_cast<std::int64_t>(tokens[i]) - vocab_begin;
    const std::uint64_t t =
        (tok >= 0 && tok < V) ? static_cast<std::uint64_t>(tok) : static_cast<std::uint64_t>(V);
    keys[i] = (t << 32) | static_cast<std::uint64_t>(i);
  }
}

// grid (n sorted positions, C / kTile column tiles), block (kTile, kRunLanes): the block at the
// start of a run of equal tokens sums the run's dout rows for its columns; blocks elsewhere in a
// run exit at once (the test is the same for the whole block, so no thread skips the barrier).
template <class TG, class TD>
__global__ void __launch_bounds__(kTile * kRunLanes)
    embedding_wte_backward_kernel(TG* dwte, const TD* dout, const std::uint64_t* sorted, std::int64_t n,
                                  std::int64_t C, std::int64_t V) {
  __shared__ float partial[kRunLanes][kTile + 1];
  const std::int64_t i = blockIdx.x;
  const std::uint64_t tok = sorted[i] >> 32;
  if (tok >= static_cast<std::uint64_t>(V)) return;
  if (i > 0 && (sorted[i - 1] >> 32) == tok) return;
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.y) * kTile + threadIdx.x;
  float acc = 0.0f;
  if (c < C) {
    for (std::int64_t j = i + threadIdx.y; j < n && (sorted[j] >> 32) == tok; j += kRunLanes) {
      acc += to_f32(dout[static_cast<std::int64_t>(sorted[j] & 0xffffffffu) * C + c]);
    }
  }
  partial[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float total = 0.0f;
#pragma unroll
    for (int y = 0; y < kRunLanes; ++y) total += partial[y][threadIdx.x];
    store(dwte, static_cast<std::int64_t>(tok) * C + c, total, true);
  }
}

template <class TG, class TD>
__global__ void embedding_wpe_backward_kernel(TG* dwpe, const TD* dout, std::int64_t B, std::int64_t T,
                                              std::int64_t C) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < T * C;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    for (std::int64_t b = 0; b < B; ++b) acc += to_f32(dout[b * T * C + i]);
    store(dwpe, i, acc, true);
  }
}

// Workspace layout: keys (n), sorted keys (n), then CUB's temporary storage.
struct SortWorkspace {
  std::size_t keys_bytes = 0;
  std::size_t cub_bytes = 0;
  cudaError_t status = cudaSuccess;
};

SortWorkspace sort_workspace(std::int64_t n) {
  SortWorkspace w;
  w.keys_bytes = (static_cast<std::size_t>(n) * sizeof(std::uint64_t) + 255) / 256 * 256;
  w.status = cub::DeviceRadixSort::SortKeys(nullptr, w.cub_bytes, static_cast<const std::uint64_t*>(nullptr),
                                            static_cast<std::uint64_t*>(nullptr), static_cast<int>(n));
  return w;
}

}  // namespace

// ---- launchers ----

Status embedding_forward_cuda(const KernelContext& ctx, TensorArg out, const std::int32_t* tokens,
                              ConstTensorArg wte, ConstTensorArg wpe, std::int64_t B, std::int64_t T,
                              std::int64_t C, std::int64_t V) {
  const std::int64_t BT = B * T;
  dispatch(out.dtype, [&](auto to) {
    dispatch(wte.dtype, [&](auto tw) {
      dispatch(wpe.dtype, [&](auto tp) {
        using TO = typename decltype(to)::type;
        using TW = typename decltype(tw)::type;
        using TP = typename decltype(tp)::type;
        embedding_forward_kernel<<<grid_for(BT * C, kThreads), kThreads, 0, stream_of(ctx)>>>(
            typed<TO>(out), tokens, typed<TW>(wte), typed<TP>(wpe), BT, T, C, V, 0, NAN);
      });
    });
  });
  return launch_status("embedding_forward");
}

Status embedding_shard_forward_cuda(const KernelContext& ctx, TensorArg out, const std::int32_t* tokens,
                                    ConstTensorArg wte_shard, ConstTensorArg wpe, std::int64_t B, std::int64_t T,
                                    std::int64_t C, std::int64_t vocab_begin, std::int64_t Vs) {
  const std::int64_t BT = B * T;
  dispatch(out.dtype, [&](auto to) {
    dispatch(wte_shard.dtype, [&](auto tw) {
      dispatch(wpe.dtype, [&](auto tp) {
        using TO = typename decltype(to)::type;
        using TW = typename decltype(tw)::type;
        using TP = typename decltype(tp)::type;
        embedding_forward_kernel<<<grid_for(BT * C, kThreads), kThreads, 0, stream_of(ctx)>>>(
            typed<TO>(out), tokens, typed<TW>(wte_shard), typed<TP>(wpe), BT, T, C, Vs, vocab_begin, 0.0f);
      });
    });
  });
  return launch_status("embedding_shard_forward");
}

std::uint64_t embedding_backward_workspace_bytes_cuda(std::int64_t B, std::int64_t T) {
  const SortWorkspace w = sort_workspace(B * T);
  return 2 * w.keys_bytes + w.cub_bytes;
}

namespace {

// dwte (V,C) += the rows of dout whose token - vocab_begin is in [0, V), deterministically (the
// file comment); shared by the whole table and a vocabulary shard.
Status wte_backward(const KernelContext& ctx, const char* op, TensorArg dwte, ConstTensorArg dout,
                    const std::int32_t* tokens, std::int64_t n, std::int64_t C, std::int64_t V,
                    std::int64_t vocab_begin) {
  cudaStream_t stream = stream_of(ctx);
  SortWorkspace w = sort_workspace(n);
  if (w.status != cudaSuccess) {
    return device_error(std::string(op) + ": sizing the token sort: " + cudaGetErrorString(w.status));
  }
  auto* base = static_cast<unsigned char*>(ctx.workspace);
  auto* keys = reinterpret_cast<std::uint64_t*>(base);
  auto* sorted = reinterpret_cast<std::uint64_t*>(base + w.keys_bytes);
  void* cub_temp = base + 2 * w.keys_bytes;
  embedding_keys_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(keys, tokens, n, V, vocab_begin);
  STRATA_RETURN_IF_ERROR(launch_status(op));
  const cudaError_t err =
      cub::DeviceRadixSort::SortKeys(cub_temp, w.cub_bytes, keys, sorted, static_cast<int>(n), 0, 64, stream);
  if (err != cudaSuccess) {
    return device_error(std::string(op) + ": token sort: " + cudaGetErrorString(err));
  }
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>((C + kTile - 1) / kTile));
  const dim3 block(kTile, kRunLanes);
  dispatch(dwte.dtype, [&](auto tg) {
    dispatch(dout.dtype, [&](auto td) {
      using TG = typename decltype(tg)::type;
      using TD = typename decltype(td)::type;
      embedding_wte_backward_kernel<<<grid, block, 0, stream>>>(typed<TG>(dwte), typed<TD>(dout), sorted, n, C, V);
    });
  });
  return launch_status(op);
}

}  // namespace

Status embedding_shard_backward_cuda(const KernelContext& ctx, TensorArg dwte_shard, ConstTensorArg dout,
                                     const std::int32_t* tokens, std::int64_t B, std::int64_t T, std::int64_t C,
                                     std::int64_t vocab_begin, std::int64_t Vs) {
  return wte_backward(ctx, "embedding_shard_backward", dwte_shard, dout, tokens, B * T, C, Vs, vocab_begin);
}

Status embedding_backward_cuda(const KernelContext& ctx, TensorArg dwte, TensorArg dwpe, ConstTensorArg dout,
                               const std::int32_t* tokens, std::int64_t B, std::int64_t T, std::int64_t C,
                               std::int64_t V) {
  const std::int64_t n = B * T;
  cudaStream_t stream = stream_of(ctx);
  if (dwte.data != nullptr) {
    STRATA_RETURN_IF_ERROR(wte_backward(ctx, "embedding_backward", dwte, dout, tokens, n, C, V, 0));
  }
  if (dwpe.data != nullptr) {
    dispatch(dwpe.dtype, [&](auto tg) {
      dispatch(dout.dtype, [&](auto td) {
        using TG = typename decltype(tg)::type;
        using TD = typename decltype(td)::type;
        embedding_wpe_backward_kernel<<<grid_for(T * C, kThreads), kThreads, 0, stream>>>(
            typed<TG>(dwpe), typed<TD>(dout), B, T, C);
      });
    });
    STRATA_RETURN_IF_ERROR(launch_status("embedding_backward"));
  }
  return ok_status();
}

}  // namespace strata::kernels
