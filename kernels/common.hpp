// Host-side helpers shared by the kernel families: argument checks that name the op and the
// argument, and the cpu backend's row loads/stores and per-thread scratch. Not a public header.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "kernels/bf16.hpp"
#include "kernels/kernels.hpp"

namespace strata::kernels {

// Collects the first failed check of an op's arguments:
//   ArgCheck check("layernorm_forward");
//   check.ptr("out", out.data).positive("C", C);
//   STRATA_RETURN_IF_ERROR(check.status());
class ArgCheck {
 public:
  explicit ArgCheck(std::string_view op) : op_(op) {}

  ArgCheck& ptr(std::string_view name, const void* p);
  // A tensor that must be present, in a dtype the kernels take (f32 or bf16).
  ArgCheck& tensor(std::string_view name, ConstTensorArg t);
  // A tensor that may be absent (null); if present, in a dtype the kernels take.
  ArgCheck& optional(std::string_view name, ConstTensorArg t);
  ArgCheck& positive(std::string_view name, std::int64_t value);
  ArgCheck& non_negative(std::string_view name, std::int64_t value);
  ArgCheck& at_least(std::string_view name, std::int64_t value, std::string_view bound_name,
                     std::int64_t bound);
  ArgCheck& same_dtype(std::string_view a_name, DType a, std::string_view b_name, DType b);
  ArgCheck& fail_if(bool bad, const std::string& message);
  // The context's backend is usable: a KernelState of the same backend when `needs_state`.
  ArgCheck& context(const KernelContext& ctx, bool needs_state = false);
  // ctx.workspace holds at least `needed` bytes (cuda only; cpu ops need none).
  ArgCheck& workspace(const KernelContext& ctx, std::uint64_t needed);

  Status status() const { return status_; }

 private:
  std::string op_;
  Status status_;
};

// The cpu KernelState (oneDNN engine and primitive cache), defined in matmul.cpp.
Result<std::unique_ptr<KernelState>> make_cpu_kernel_state();

// ---- cpu backend ----------------------------------------------------------------------------

// OpenMP threads to use for this call.
int cpu_thread_count(const KernelContext& ctx);

// Loads n elements starting at element `offset` of t, widened to fp32.
void load_f32(ConstTensorArg t, std::int64_t offset, std::int64_t n, float* dst);
// Stores n fp32 values at element `offset` of t (rounding to bf16 if t is bf16); with kAdd,
// adds them to what is there (in fp32, then one rounding).
void store_f32(TensorArg t, std::int64_t offset, std::int64_t n, const float* src,
               Accumulate mode = Accumulate::kOverwrite);

// Scratch of at least `n` floats owned by the calling thread (the stream's worker), 64-byte
// aligned. A kernel takes what its OpenMP team needs from it before the parallel region (one
// stripe per thread) so that only the calling thread ever allocates. `slot` picks one of a few
// independent buffers, so a kernel can hold several at once. Buffers grow on demand and are
// kept for the thread's lifetime: the first step allocates, later steps do not. The pointer is
// valid until the next call with the same slot on this thread. kOutOfMemory names `op`.
inline constexpr int kScratchSlots = 8;
Result<float*> scratch(std::string_view op, std::size_t n, int slot);

// Rounds a per-thread stripe up to a whole number of cache lines.
inline std::size_t scratch_stripe(std::size_t n) { return (n + 15) / 16 * 16; }

}  // namespace strata::kernels
