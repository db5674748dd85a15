// Matrix multiply with bias, the bulk of a transformer's FLOPs.
// gemm: c (M,N) (=|+=) op(a) (M,K) · op(b) (K,N) + bias (N), row-major, fp32 accumulation;
// a and b are fp32, bf16 or fp16 (both the same), c and bias any of the three.
// A linear layer y = x·Wᵀ + b with x (M,K) and W (N,K) is gemm(a = x, b = W, trans_b); its
// backward is dx = dy·W (gemm, no transposes), dW += dyᵀ·x (gemm, trans_a, accumulate) and
// db += Σ_rows dy.
// On cpu the GEMM is a oneDNN matmul primitive, built once per (shape, transposes, dtypes) and
// cached in the stream's KernelState; transposes are expressed as strides, so nothing is copied.
// If this CPU's oneDNN has no bf16 or fp16 matmul (bf16 needs AVX-512; fp16 support depends on
// the CPU and the oneDNN version), the 16-bit inputs are widened to fp32 first, and where oneDNN
// cannot write or read a 16-bit c or bias from an fp32 matmul either, those go through fp32
// scratch too (c is then rounded once, as a native 16-bit output would be).
#include <omp.h>

#include <algorithm>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <unordered_map>

#include "kernels/common.hpp"
#include "kernels/cuda_ops.hpp"

namespace strata::kernels {
namespace {

struct GemmKey {
  std::int64_t M, N, K;
  Transpose trans_a, trans_b;
  DType ab_dtype, c_dtype, bias_dtype;
  bool has_bias;
  Accumulate mode;
  bool operator==(const GemmKey&) const = default;
};

struct GemmKeyHash {
  std::size_t operator()(const GemmKey& k) const {
    std::size_t h = std::hash<std::int64_t>()(k.M);
    auto mix = [&h](std::uint64_t v) { h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    mix(static_cast<std::uint64_t>(k.N));
    mix(static_cast<std::uint64_t>(k.K));
    mix(static_cast<std::uint64_t>(k.trans_a) | static_cast<std::uint64_t>(k.trans_b) << 8 |
        static_cast<std::uint64_t>(k.ab_dtype) << 16 | static_cast<std::uint64_t>(k.c_dtype) << 24 |
        static_cast<std::uint64_t>(k.bias_dtype) << 32 | static_cast<std::uint64_t>(k.has_bias) << 40 |
        static_cast<std::uint64_t>(k.mode) << 48);
    return h;
  }
};

struct GemmPlan {
  dnnl::matmul primitive;
  dnnl::memory::desc a_md, b_md, c_md, bias_md;
  bool widen_inputs = false;  // 16-bit inputs run as fp32: this oneDNN has no such matmul here
  bool widen_output = false;  // c and bias run as fp32 scratch as well
};

dnnl::memory::data_type to_dnnl(DType d) {
  switch (d) {
    case DType::kBF16:
      return dnnl::memory::data_type::bf16;
    case DType::kF16:
      return dnnl::memory::data_type::f16;
    default:
      return dnnl::memory::data_type::f32;
  }
}

class CpuKernelState final : public KernelState {
 public:
  CpuKernelState() : engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {}
  Backend backend() const override { return Backend::kCpu; }
  std::size_t cached_plans() const override { return plans_.size(); }

  // The cached plan for `key`, built on first use. Throws dnnl::error (caught by the caller).
  const GemmPlan& plan(const GemmKey& key) {
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
    GemmPlan p;
    try {
      p = build(key, to_dnnl(key.ab_dtype), false);
    } catch (const dnnl::error&) {
      if (key.ab_dtype == DType::kF32 && key.c_dtype == DType::kF32 && key.bias_dtype == DType::kF32) throw;
      try {
        p = build(key, dnnl::memory::data_type::f32, false);
        p.widen_inputs = key.ab_dtype != DType::kF32;
      } catch (const dnnl::error&) {
        p = build(key, dnnl::memory::data_type::f32, true);
        p.widen_inputs = key.ab_dtype != DType::kF32;
        p.widen_output = true;
      }
    }
    return plans_.emplace(key, std::move(p)).first->second;
  }

  dnnl::engine& engine() { return engine_; }
  dnnl::stream& stream() { return stream_; }

 private:
  // all_f32: c and bias as fp32 too (the caller stages them through scratch).
  GemmPlan build(const GemmKey& k, dnnl::memory::data_type ab, bool all_f32) {
    using dims = dnnl::memory::dims;
    const auto f32 = dnnl::memory::data_type::f32;
    GemmPlan p;
    p.a_md = dnnl::memory::desc({k.M, k.K}, ab, k.trans_a == Transpose::kNo ? dims{k.K, 1} : dims{1, k.M});
    p.b_md = dnnl::memory::desc({k.K, k.N}, ab, k.trans_b == Transpose::kNo ? dims{k.N, 1} : dims{1, k.K});
    p.c_md = dnnl::memory::desc({k.M, k.N}, all_f32 ? f32 : to_dnnl(k.c_dtype), dims{k.N, 1});
    dnnl::primitive_attr attr;
    if (k.mode == Accumulate::kAdd) {
      dnnl::post_ops ops;
      ops.append_sum(1.0f);
      attr.set_post_ops(ops);
    }
    if (k.has_bias) {
      p.bias_md = dnnl::memory::desc({1, k.N}, all_f32 ? f32 : to_dnnl(k.bias_dtype), dims{k.N, 1});
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(p.a_md, p.b_md, p.bias_md, p.c_md), attr, engine_);
      p.primitive = dnnl::matmul(pd);
    } else {
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(p.a_md, p.b_md, p.c_md), attr, engine_);
      p.primitive = dnnl::matmul(pd);
    }
    return p;
  }

  dnnl::engine engine_;
  dnnl::stream stream_;
  std::unordered_map<GemmKey, GemmPlan, GemmKeyHash> plans_;
};

// ---- cpu kernels ----

// K = 0: the product is empty, c (=|+=) bias.
Status gemm_empty_cpu(const KernelContext& ctx, TensorArg c, ConstTensorArg bias, std::int64_t M,
                      std::int64_t N, Accumulate mode) {
  STRATA_ASSIGN_OR_RETURN(float* row, scratch("gemm", N, 0));
  if (bias.data != nullptr) {
    load_f32(bias, 0, N, row);
  } else {
    std::fill(row, row + N, 0.0f);
  }
  (void)ctx;
  for (std::int64_t m = 0; m < M; ++m) store_f32(c, m * N, N, row, mode);
  return ok_status();
}

Status gemm_cpu(const KernelContext& ctx, TensorArg c, ConstTensorArg a, ConstTensorArg b,
                ConstTensorArg bias, std::int64_t M, std::int64_t N, std::int64_t K, Transpose trans_a,
                Transpose trans_b, Accumulate mode) {
  if (K == 0) return gemm_empty_cpu(ctx, c, bias, M, N, mode);
  auto& state = static_cast<CpuKernelState&>(*ctx.state);
  const GemmKey key{M, N, K, trans_a, trans_b, a.dtype, c.dtype, bias.dtype, bias.data != nullptr, mode};
  const int threads = cpu_thread_count(ctx);
  const int saved_threads = omp_get_max_threads();
  try {
    const GemmPlan& plan = state.plan(key);
    const void* a_data = a.data;
    const void* b_data = b.data;
    if (plan.widen_inputs) {
      STRATA_ASSIGN_OR_RETURN(float* wa, scratch("gemm", M * K, 0));
      STRATA_ASSIGN_OR_RETURN(float* wb, scratch("gemm", K * N, 1));
      load_f32(a, 0, M * K, wa);
      load_f32(b, 0, K * N, wb);
      a_data = wa;
      b_data = wb;
    }
    void* c_data = c.data;
    const void* bias_data = bias.data;
    if (plan.widen_output) {
      STRATA_ASSIGN_OR_RETURN(float* wc, scratch("gemm", M * N, 3));
      if (mode == Accumulate::kAdd) load_f32(c, 0, M * N, wc);
      c_data = wc;
      if (bias.data != nullptr) {
        STRATA_ASSIGN_OR_RETURN(float* wbias, scratch("gemm", N, 4));
        load_f32(bias, 0, N, wbias);
        bias_data = wbias;
      }
    }
    dnnl::engine& engine = state.engine();
    dnnl::memory a_mem(plan.a_md, engine, const_cast<void*>(a_data));
    dnnl::memory b_mem(plan.b_md, engine, const_cast<void*>(b_data));
    dnnl::memory c_mem(plan.c_md, engine, c_data);
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}};
    if (bias.data != nullptr)
      args.emplace(DNNL_ARG_BIAS, dnnl::memory(plan.bias_md, engine, const_cast<void*>(bias_data)));
    // oneDNN's OpenMP runtime sizes its team from the calling thread's setting.
    omp_set_num_threads(threads);
    plan.primitive.execute(state.stream(), args);
    state.stream().wait();
    omp_set_num_threads(saved_threads);
    if (plan.widen_output) store_f32(c, 0, M * N, static_cast<const float*>(c_data));
  } catch (const dnnl::error& e) {
    omp_set_num_threads(saved_threads);
    return internal_error("gemm (M=" + std::to_string(M) + ", N=" + std::to_string(N) +
                          ", K=" + std::to_string(K) + ", " + std::string(to_string(a.dtype)) +
                          "): oneDNN: " + e.what());
  }
  return ok_status();
}

// dbias (N) += Σ over M rows of dout (M,N): columns in chunks, each chunk summed by one thread
// in row order (deterministic, any thread count).
Status bias_backward_cpu(const KernelContext& ctx, TensorArg dbias, ConstTensorArg dout, std::int64_t M,
                         std::int64_t N) {
  constexpr std::int64_t kCols = 256;
  const int threads = cpu_thread_count(ctx);
  const std::int64_t chunks = (N + kCols - 1) / kCols;
  STRATA_ASSIGN_OR_RETURN(float* buf, scratch("matmul_backward", threads * 2 * kCols, 2));
#pragma omp parallel for num_threads(threads) schedule(static) if (M * N > 8192)
  for (std::int64_t cc = 0; cc < chunks; ++cc) {
    float* acc = buf + omp_get_thread_num() * 2 * kCols;  // (kCols)
    float* row = acc + kCols;                             // (kCols)
    const std::int64_t c0 = cc * kCols;
    const std::int64_t len = std::min(kCols, N - c0);
    std::fill(acc, acc + len, 0.0f);
    for (std::int64_t m = 0; m < M; ++m) {
      load_f32(dout, m * N + c0, len, row);
      for (std::int64_t i = 0; i < len; ++i) acc[i] += row[i];
    }
    store_f32(dbias, c0, len, acc, Accumulate::kAdd);
  }
  return ok_status();
}

}  // namespace

Result<std::unique_ptr<KernelState>> make_cpu_kernel_state() {
  try {
    return std::unique_ptr<KernelState>(new CpuKernelState());
  } catch (const dnnl::error& e) {
    return unavailable(std::string("cpu kernel state: cannot create a oneDNN cpu engine: ") + e.what());
  }
}

// ---- launchers ----

Status gemm(const KernelContext& ctx, TensorArg c, ConstTensorArg a, ConstTensorArg b, ConstTensorArg bias,
            std::int64_t M, std::int64_t N, std::int64_t K, Transpose trans_a, Transpose trans_b,
            Accumulate mode) {
  ArgCheck check("gemm");
  check.context(ctx, true)
      .non_negative("M", M)
      .non_negative("N", N)
      .non_negative("K", K)
      .tensor("c", c)
      .optional("a", a)
      .optional("b", b)
      .optional("bias", bias)
      .fail_if(K > 0 && a.data == nullptr, "'a' is null")
      .fail_if(K > 0 && b.data == nullptr, "'b' is null")
      .same_dtype("a", a.dtype, "b", b.dtype)
      .fail_if(ctx.backend == Backend::kCuda && a.dtype == DType::kF32 && c.dtype != DType::kF32,
               "fp32 inputs need an fp32 output on cuda (cuBLASLt has no f32 x f32 -> bf16 GEMM)")
      .workspace(ctx, matmul_workspace_bytes(ctx.backend));
  STRATA_RETURN_IF_ERROR(check.status());
  if (M == 0 || N == 0) return ok_status();
  if (ctx.backend == Backend::kCuda) return gemm_cuda(ctx, c, a, b, bias, M, N, K, trans_a, trans_b, mode);
  return gemm_cpu(ctx, c, a, b, bias, M, N, K, trans_a, trans_b, mode);
}

Status matmul_forward(const KernelContext& ctx, TensorArg out, ConstTensorArg inp, ConstTensorArg weight,
                      ConstTensorArg bias, std::int64_t M, std::int64_t K, std::int64_t N) {
  ArgCheck check("matmul_forward");
  check.tensor("out", out)
      .tensor("inp", inp)
      .tensor("weight", weight)
      .same_dtype("inp", inp.dtype, "weight", weight.dtype);
  STRATA_RETURN_IF_ERROR(check.status());
  return gemm(ctx, out, inp, weight, bias, M, N, K, Transpose::kNo, Transpose::kYes, Accumulate::kOverwrite)
      .with_context("matmul_forward");
}

Status matmul_backward(const KernelContext& ctx, TensorArg dinp, TensorArg dweight, TensorArg dbias,
                       ConstTensorArg dout, ConstTensorArg inp, ConstTensorArg weight, std::int64_t M,
                       std::int64_t K, std::int64_t N, Accumulate dinp_mode) {
  ArgCheck check("matmul_backward");
  check.tensor("dout", dout)
      .optional("dinp", dinp)
      .optional("dweight", dweight)
      .optional("dbias", dbias)
      .fail_if(dinp.data != nullptr && weight.data == nullptr, "'weight' is null (needed for dinp)")
      .fail_if(dweight.data != nullptr && inp.data == nullptr, "'inp' is null (needed for dweight)")
      .fail_if(dinp.data != nullptr && dout.dtype != weight.dtype,
               "'dout' and 'weight' must share a dtype (they are the operands of dinp)")
      .fail_if(dweight.data != nullptr && dout.dtype != inp.dtype,
               "'dout' and 'inp' must share a dtype (they are the operands of dweight)")
      .non_negative("M", M)
      .non_negative("N", N)
      .non_negative("K", K)
      .context(ctx, true);
  STRATA_RETURN_IF_ERROR(check.status());
  if (dinp.data != nullptr) {
    // dinp (M,K) = dout (M,N) · weight (N,K)
    STRATA_RETURN_IF_ERROR(
        gemm(ctx, dinp, dout, weight, kNone, M, K, N, Transpose::kNo, Transpose::kNo, dinp_mode)
            .with_context("matmul_backward dinp"));
  }
  if (dweight.data != nullptr) {
    // dweight (N,K) += doutᵀ (N,M) · inp (M,K)
    STRATA_RETURN_IF_ERROR(
        gemm(ctx, dweight, dout, inp, kNone, N, K, M, Transpose::kYes, Transpose::kNo, Accumulate::kAdd)
            .with_context("matmul_backward dweight"));
  }
  if (dbias.data != nullptr && M > 0 && N > 0) {
    if (ctx.backend == Backend::kCuda) return bias_backward_cuda(ctx, dbias, dout, M, N);
    return bias_backward_cpu(ctx, dbias, dout, M, N);
  }
  return ok_status();
}

std::uint64_t matmul_workspace_bytes(Backend backend) {
  return backend == Backend::kCuda ? matmul_workspace_bytes_cuda() : 0;
}

}  // namespace strata::kernels
