// Argument checks, cpu row access and per-thread scratch shared by the kernel families, and the
// KernelState factory.
#include "kernels/common.hpp"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <memory>

#include "kernels/cpu_math.hpp"
#include "kernels/cuda_ops.hpp"

namespace strata::kernels {

std::string_view to_string(Backend backend) { return backend == Backend::kCpu ? "cpu" : "cuda"; }

ArgCheck& ArgCheck::fail_if(bool bad, const std::string& message) {
  if (bad && status_.ok()) status_ = invalid_argument(op_ + ": " + message);
  return *this;
}

ArgCheck& ArgCheck::ptr(std::string_view name, const void* p) {
  return fail_if(p == nullptr, "'" + std::string(name) + "' is null");
}

ArgCheck& ArgCheck::tensor(std::string_view name, ConstTensorArg t) {
  ptr(name, t.data);
  return optional(name, t);
}

ArgCheck& ArgCheck::optional(std::string_view name, ConstTensorArg t) {
  return fail_if(
      t.data != nullptr && t.dtype != DType::kF32 && t.dtype != DType::kBF16 && t.dtype != DType::kF16,
      "'" + std::string(name) + "' is " + std::string(to_string(t.dtype)) + "; the kernels take f32, bf16 or f16");
}

ArgCheck& ArgCheck::positive(std::string_view name, std::int64_t value) {
  return fail_if(value <= 0, std::string(name) + " = " + std::to_string(value) + " must be positive");
}

ArgCheck& ArgCheck::non_negative(std::string_view name, std::int64_t value) {
  return fail_if(value < 0, std::string(name) + " = " + std::to_string(value) + " must not be negative");
}

ArgCheck& ArgCheck::at_least(std::string_view name, std::int64_t value, std::string_view bound_name,
                             std::int64_t bound) {
  return fail_if(value < bound, std::string(name) + " = " + std::to_string(value) + " is less than " +
                                    std::string(bound_name) + " = " + std::to_string(bound));
}

ArgCheck& ArgCheck::same_dtype(std::string_view a_name, DType a, std::string_view b_name, DType b) {
  return fail_if(a != b, "'" + std::string(a_name) + "' is " + std::string(to_string(a)) + " but '" +
                             std::string(b_name) + "' is " + std::string(to_string(b)) +
                             " (they must match)");
}

ArgCheck& ArgCheck::context(const KernelContext& ctx, bool needs_state) {
  fail_if(ctx.backend != Backend::kCpu && ctx.backend != Backend::kCuda, "unknown backend in KernelContext");
  fail_if(ctx.cpu_threads < 0, "cpu_threads = " + std::to_string(ctx.cpu_threads) + " must not be negative");
  if (needs_state) {
    fail_if(ctx.state == nullptr, "KernelContext::state is null (create one with KernelState::create)");
    fail_if(ctx.state != nullptr && ctx.state->backend() != ctx.backend,
            "KernelContext::state was created for backend " +
                std::string(to_string(ctx.state ? ctx.state->backend() : ctx.backend)) +
                " but the context is " + std::string(to_string(ctx.backend)));
  }
  return *this;
}

ArgCheck& ArgCheck::workspace(const KernelContext& ctx, std::uint64_t needed) {
  if (ctx.backend != Backend::kCuda || needed == 0) return *this;
  fail_if(ctx.workspace == nullptr || ctx.workspace_bytes < needed,
          "needs a workspace of " + std::to_string(needed) + " bytes but the context has " +
              std::to_string(ctx.workspace == nullptr ? 0 : ctx.workspace_bytes));
  fail_if(reinterpret_cast<std::uintptr_t>(ctx.workspace) % 256 != 0,
          "the workspace is not 256-byte aligned");
  return *this;
}

int cpu_thread_count(const KernelContext& ctx) {
  return ctx.cpu_threads > 0 ? ctx.cpu_threads : omp_get_max_threads();
}

STRATA_CPU_CLONES void load_f32(ConstTensorArg t, std::int64_t offset, std::int64_t n, float* dst) {
  if (t.dtype == DType::kF32) {
    const float* src = static_cast<const float*>(t.data) + offset;
    for (std::int64_t i = 0; i < n; ++i) dst[i] = src[i];
  } else if (t.dtype == DType::kBF16) {
    const std::uint16_t* src = static_cast<const std::uint16_t*>(t.data) + offset;
    for (std::int64_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_f32(src[i]);
  } else {
    const std::uint16_t* src = static_cast<const std::uint16_t*>(t.data) + offset;
    for (std::int64_t i = 0; i < n; ++i) dst[i] = f16_bits_to_f32(src[i]);
  }
}

STRATA_CPU_CLONES void store_f32(TensorArg t, std::int64_t offset, std::int64_t n, const float* src,
                                 Accumulate mode) {
  const bool add = mode == Accumulate::kAdd;
  if (t.dtype == DType::kF32) {
    float* dst = static_cast<float*>(t.data) + offset;
    if (add) {
      for (std::int64_t i = 0; i < n; ++i) dst[i] += src[i];
    } else {
      for (std::int64_t i = 0; i < n; ++i) dst[i] = src[i];
    }
  } else if (t.dtype == DType::kBF16) {
    std::uint16_t* dst = static_cast<std::uint16_t*>(t.data) + offset;
    if (add) {
      for (std::int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16_bits_rne(bf16_bits_to_f32(dst[i]) + src[i]);
    } else {
      for (std::int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16_bits_rne(src[i]);
    }
  } else {
    std::uint16_t* dst = static_cast<std::uint16_t*>(t.data) + offset;
    if (add) {
      for (std::int64_t i = 0; i < n; ++i) dst[i] = f32_to_f16_bits_rne(f16_bits_to_f32(dst[i]) + src[i]);
    } else {
      for (std::int64_t i = 0; i < n; ++i) dst[i] = f32_to_f16_bits_rne(src[i]);
    }
  }
}

namespace {

struct ScratchBuffer {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data;
  std::size_t capacity = 0;
};

}  // namespace

Result<float*> scratch(std::string_view op, std::size_t n, int slot) {
  thread_local ScratchBuffer buffers[kScratchSlots];
  ScratchBuffer& b = buffers[slot];
  if (b.capacity < n) {
    // Grow geometrically so a sequence of slightly larger shapes does not reallocate each time.
    std::size_t cap = std::max<std::size_t>(n, b.capacity + b.capacity / 2);
    cap = scratch_stripe(cap);
    b.data.reset(static_cast<float*>(std::aligned_alloc(64, cap * sizeof(float))));
    b.capacity = b.data ? cap : 0;
    if (!b.data) {
      return out_of_memory(std::string(op) + ": cannot allocate " + std::to_string(cap * sizeof(float)) +
                           " bytes of cpu kernel scratch");
    }
  }
  return b.data.get();
}

Result<std::unique_ptr<KernelState>> KernelState::create(Backend backend) {
  if (backend == Backend::kCuda) return make_cuda_kernel_state();
  return make_cpu_kernel_state();
}

}  // namespace strata::kernels
