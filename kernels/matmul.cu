// Matmul with bias on CUDA through cuBLASLt (the op is described in matmul.cpp).
// cuBLASLt is column-major; a row-major c (M,N) = op(a)·op(b) is the column-major
// cᵀ (N,M) = op(b)ᵀ·op(a)ᵀ, so b is passed as cuBLASLt's A and a as its B, with no copies.
// Inputs fp32, bf16 or fp16, accumulation and scaling in fp32 (CUBLAS_COMPUTE_32F: fp32 inputs are
// not rounded to TF32, so fp32 mode stays a reference). The bias rides in the epilogue when it
// has the output's dtype (cuBLASLt's rule); otherwise a small kernel adds it afterwards.
// Descriptors, layouts and the heuristic's algorithm are cached per (shape, transposes, dtypes,
// pointer alignment) in the stream's KernelState. dbias is a deterministic column sum.
#include <cublasLt.h>

#include <memory>
#include <string>
#include <unordered_map>

#include "kernels/cuda_common.cuh"
#include "kernels/cuda_ops.hpp"

namespace strata::kernels {
namespace {

using namespace cuda;

// cuBLASLt's recommended workspace on Hopper; enough for every algorithm it offers.
constexpr std::uint64_t kLtWorkspaceBytes = 32ull << 20;

Status lt_status(cublasStatus_t s, const std::string& what) {
  if (s == CUBLAS_STATUS_SUCCESS) return ok_status();
  return device_error(what + ": cuBLASLt: " + cublasLtGetStatusString(s));
}

cudaDataType_t to_cuda(DType d) {
  if (d == DType::kF16) return CUDA_R_16F;
  return d == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
}

// Largest power of two (≤ 256) dividing the address: cuBLASLt picks kernels for an alignment.
std::uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t align = 256;
  while (align > 1 && (a % align) != 0) align >>= 1;
  return align;
}

struct LtKey {
  std::int64_t M, N, K;
  Transpose trans_a, trans_b;
  DType ab_dtype, c_dtype;
  bool bias_epilogue;
  Accumulate mode;
  std::uint32_t align_a, align_b, align_c;
  bool operator==(const LtKey&) const = default;
};

struct LtKeyHash {
  std::size_t operator()(const LtKey& k) const {
    std::size_t h = std::hash<std::int64_t>()(k.M);
    auto mix = [&h](std::uint64_t v) { h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    mix(static_cast<std::uint64_t>(k.N));
    mix(static_cast<std::uint64_t>(k.K));
    mix(static_cast<std::uint64_t>(k.trans_a) | static_cast<std::uint64_t>(k.trans_b) << 4 |
        static_cast<std::uint64_t>(k.ab_dtype) << 8 | static_cast<std::uint64_t>(k.c_dtype) << 12 |
        static_cast<std::uint64_t>(k.bias_epilogue) << 16 | static_cast<std::uint64_t>(k.mode) << 20 |
        static_cast<std::uint64_t>(k.align_a) << 24 | static_cast<std::uint64_t>(k.align_b) << 36 |
        static_cast<std::uint64_t>(k.align_c) << 48);
    return h;
  }
};

struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t lt_a = nullptr, lt_b = nullptr, lt_c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  LtPlan() = default;
  LtPlan(const LtPlan&) = delete;
  LtPlan& operator=(const LtPlan&) = delete;
  ~LtPlan() {
    if (lt_c) cublasLtMatrixLayoutDestroy(lt_c);
    if (lt_b) cublasLtMatrixLayoutDestroy(lt_b);
    if (lt_a) cublasLtMatrixLayoutDestroy(lt_a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

class CudaKernelState final : public KernelState {
 public:
  explicit CudaKernelState(cublasLtHandle_t handle) : handle_(handle) {}
  ~CudaKernelState() override {
    plans_.clear();
    cublasLtDestroy(handle_);
  }
  Backend backend() const override { return Backend::kCuda; }
  std::size_t cached_plans() const override { return plans_.size(); }
  cublasLtHandle_t handle() const { return handle_; }

  Result<LtPlan*> plan(const LtKey& k) {
    auto it = plans_.find(k);
    if (it != plans_.end()) return it->second.get();
    auto p = std::make_unique<LtPlan>();
    STRATA_RETURN_IF_ERROR(build(k, *p));
    LtPlan* raw = p.get();
    plans_.emplace(k, std::move(p));
    return raw;
  }

 private:
  Status build(const LtKey& k, LtPlan& p) {
    const std::string what = "gemm (M=" + std::to_string(k.M) + ", N=" + std::to_string(k.N) +
                             ", K=" + std::to_string(k.K) + ", " + std::string(to_string(k.ab_dtype)) + ")";
    STRATA_RETURN_IF_ERROR(
        lt_status(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), what));
    // cuBLASLt's A is our b, its B is our a (see the top of the file).
    const cublasOperation_t op_a = k.trans_b == Transpose::kYes ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = k.trans_a == Transpose::kYes ? CUBLAS_OP_T : CUBLAS_OP_N;
    STRATA_RETURN_IF_ERROR(lt_status(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a), what));
    STRATA_RETURN_IF_ERROR(lt_status(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b), what));
    if (k.bias_epilogue) {
      const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
      STRATA_RETURN_IF_ERROR(lt_status(
          cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi), what));
    }
    const cudaDataType_t ab = to_cuda(k.ab_dtype), c = to_cuda(k.c_dtype);
    // Column-major views: our b is (N x K) if stored (K,N), else (K x N); our a is (K x M) if
    // stored (M,K), else (M x K); c is (N x M).
    const bool tb = k.trans_b == Transpose::kYes, ta = k.trans_a == Transpose::kYes;
    STRATA_RETURN_IF_ERROR(lt_status(
        cublasLtMatrixLayoutCreate(&p.lt_a, ab, tb ? k.K : k.N, tb ? k.N : k.K, tb ? k.K : k.N), what));
    STRATA_RETURN_IF_ERROR(lt_status(
        cublasLtMatrixLayoutCreate(&p.lt_b, ab, ta ? k.M : k.K, ta ? k.K : k.M, ta ? k.M : k.K), what));
    STRATA_RETURN_IF_ERROR(lt_status(cublasLtMatrixLayoutCreate(&p.lt_c, c, k.N, k.M, k.N), what));

    cublasLtMatmulPreference_t pref = nullptr;
    STRATA_RETURN_IF_ERROR(lt_status(cublasLtMatmulPreferenceCreate(&pref), what));
    const std::uint64_t ws = kLtWorkspaceBytes;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &k.align_b,
                                         sizeof k.align_b);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &k.align_a,
                                         sizeof k.align_a);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &k.align_c,
                                         sizeof k.align_c);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &k.align_c,
                                         sizeof k.align_c);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.lt_a, p.lt_b, p.lt_c, p.lt_c,
                                                            pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    STRATA_RETURN_IF_ERROR(lt_status(s, what));
    if (found == 0) return unavailable(what + ": cuBLASLt has no algorithm for this problem");
    p.algo = result.algo;
    return ok_status();
  }

  cublasLtHandle_t handle_;
  std::unordered_map<LtKey, std::unique_ptr<LtPlan>, LtKeyHash> plans_;
};

// ---- kernels ----

// c (M,N) += bias (N) broadcast over rows (when the epilogue cannot take the bias).
template <class TC, class TB>
__global__ void add_bias_kernel(TC* c, const TB* bias, std::int64_t M, std::int64_t N) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < M * N;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    store(c, i, to_f32(bias[i % N]), true);
  }
}

// c (M,N) (=|+=) bias, for K = 0.
template <class TC, class TB>
__global__ void fill_bias_kernel(TC* c, const TB* bias, std::int64_t M, std::int64_t N, bool add) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < M * N;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    store(c, i, bias != nullptr ? to_f32(bias[i % N]) : 0.0f, add);
  }
}

// dbias (N) += Σ_m dout (M,N)
template <class TG, class TD>
struct BiasGrad {
  static constexpr int kSums = 1;
  TG* dbias;
  const TD* dout;
  std::int64_t N;
  __device__ void values(std::int64_t r, std::int64_t c, float (&acc)[1]) const {
    acc[0] += to_f32(dout[r * N + c]);
  }
  __device__ void finish(std::int64_t c, const float (&sums)[1]) const { store(dbias, c, sums[0], true); }
};

}  // namespace

Result<std::unique_ptr<KernelState>> make_cuda_kernel_state() {
  cublasLtHandle_t handle = nullptr;
  const cublasStatus_t s = cublasLtCreate(&handle);
  if (s != CUBLAS_STATUS_SUCCESS) {
    return unavailable(std::string("cuda kernel state: cublasLtCreate failed: ") +
                       cublasLtGetStatusString(s));
  }
  return std::unique_ptr<KernelState>(new CudaKernelState(handle));
}

// ---- launchers ----

std::uint64_t matmul_workspace_bytes_cuda() { return kLtWorkspaceBytes; }

Status gemm_cuda(const KernelContext& ctx, TensorArg c, ConstTensorArg a, ConstTensorArg b,
                 ConstTensorArg bias, std::int64_t M, std::int64_t N, std::int64_t K, Transpose trans_a,
                 Transpose trans_b, Accumulate mode) {
  cudaStream_t stream = stream_of(ctx);
  const bool add = mode == Accumulate::kAdd;
  if (K == 0) {
    dispatch(c.dtype, [&](auto tc) {
      dispatch(bias.dtype, [&](auto tb) {
        using TC = typename decltype(tc)::type;
        using TB = typename decltype(tb)::type;
        fill_bias_kernel<<<grid_for(M * N, 256), 256, 0, stream>>>(typed<TC>(c), typed<TB>(bias), M, N, add);
      });
    });
    return launch_status("gemm");
  }
  auto& state = static_cast<CudaKernelState&>(*ctx.state);
  const bool has_bias = bias.data != nullptr;
  const bool bias_epilogue = has_bias && bias.dtype == c.dtype;
  const LtKey key{M,
                  N,
                  K,
                  trans_a,
                  trans_b,
                  a.dtype,
                  c.dtype,
                  bias_epilogue,
                  mode,
                  alignment_of(a.data),
                  alignment_of(b.data),
                  alignment_of(c.data)};
  STRATA_ASSIGN_OR_RETURN(LtPlan * plan, state.plan(key));
  const std::string what =
      "gemm (M=" + std::to_string(M) + ", N=" + std::to_string(N) + ", K=" + std::to_string(K) + ")";
  if (bias_epilogue) {
    const void* bias_ptr = bias.data;
    STRATA_RETURN_IF_ERROR(
        lt_status(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr,
                                                 sizeof bias_ptr),
                  what));
  }
  const float alpha = 1.0f;
  const float beta = add ? 1.0f : 0.0f;
  STRATA_RETURN_IF_ERROR(
      lt_status(cublasLtMatmul(state.handle(), plan->desc, &alpha, b.data, plan->lt_a, a.data, plan->lt_b,
                               &beta, c.data, plan->lt_c, c.data, plan->lt_c, &plan->algo, ctx.workspace,
                               kLtWorkspaceBytes, stream),
                what));
  if (has_bias && !bias_epilogue) {
    dispatch(c.dtype, [&](auto tc) {
      dispatch(bias.dtype, [&](auto tb) {
        using TC = typename decltype(tc)::type;
        using TB = typename decltype(tb)::type;
        add_bias_kernel<<<grid_for(M * N, 256), 256, 0, stream>>>(typed<TC>(c), typed<TB>(bias), M, N);
      });
    });
  }
  return launch_status("gemm");
}

Status bias_backward_cuda(const KernelContext& ctx, TensorArg dbias, ConstTensorArg dout, std::int64_t M,
                          std::int64_t N) {
  dispatch(dbias.dtype, [&](auto tg) {
    dispatch(dout.dtype, [&](auto td) {
      using TG = typename decltype(tg)::type;
      using TD = typename decltype(td)::type;
      launch_column_sums(BiasGrad<TG, TD>{typed<TG>(dbias), typed<TD>(dout), N}, M, N, stream_of(ctx));
    });
  });
  return launch_status("matmul_backward dbias");
}

}  // namespace strata::kernels
