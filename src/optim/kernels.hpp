// The per-ISA optimizer kernels behind CpuOptimizer. Each ISA file (kernels_scalar.cpp,
// kernels_avx2.cpp, kernels_avx512.cpp) defines the same four entry points over a half-open
// element range; cpu_optimizer.cpp splits a buffer into per-thread ranges and picks the ISA.
//
// Every path performs the same fp32 operations in the same order (kernel_body.inc), so the
// results are bitwise identical; the files differ only in vector width and in how they convert
// between fp32 and bf16/fp16.
#pragma once

#include <cstddef>
#include <cstdint>

#include "optim/numerics.hpp"
#include "strata/optim.hpp"

namespace strata::optim_detail {

enum class OutMode : std::uint8_t { kNone, kBF16, kF16 };

struct UpdateArgs {
  OptimizerKind kind = OptimizerKind::kAdamW;
  UpdateConstants c;
  float* master = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::kF32;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  DType moment_dtype = DType::kF32;
  void* out = nullptr;
  OutMode out_mode = OutMode::kNone;
  std::uint64_t element_offset = 0;
};

// The gradient scan's summation order: element i of a segment goes to double lane i % 16 (in
// element order), the lanes are added 0..15 in sequence, and segments are added in order.
// Segment boundaries depend only on n (see scan_segment_length), so the sum is the same for any
// thread count and ISA.
inline constexpr std::size_t kScanLanes = 16;

// The scalar form of the scan over [begin, end): element begin + k goes to lanes[k % 16]. The
// vector scans finish their partial last block with it, the scalar path does everything with it.
inline void scan_scalar(void* grad, DType dtype, std::size_t begin, std::size_t end, float inv_scale,
                        bool write_back, double* lanes) {
  auto* f32 = static_cast<float*>(grad);
  auto* u16 = static_cast<std::uint16_t*>(grad);
  for (std::size_t i = begin, k = 0; i < end; ++i, k = (k + 1) % kScanLanes) {
    float y;
    if (dtype == DType::kF32) {
      y = f32[i] * inv_scale;
      if (write_back) f32[i] = y;
    } else if (dtype == DType::kBF16) {
      y = bf16_to_f32(u16[i]) * inv_scale;
      if (write_back) {
        u16[i] = f32_to_bf16(y);
        y = bf16_to_f32(u16[i]);  // the norm is of what the update will read
      }
    } else {
      y = f16_to_f32(u16[i]) * inv_scale;
      if (write_back) {
        u16[i] = f32_to_f16(y);
        y = f16_to_f32(u16[i]);
      }
    }
    const double d = y;
    lanes[k] += d * d;  // exact product (24-bit mantissas), so fused or not gives the same sum
  }
}

inline double sum_lanes(const double* lanes) {
  double sum = 0.0;
  for (std::size_t k = 0; k < kScanLanes; ++k) sum += lanes[k];
  return sum;
}

// A plain streaming loop over the same bytes the update moves (the benchmark's roofline): reads
// master, grad, moments; writes master, moments and the copy-out with no arithmetic beyond
// adding a zero, so the values are unchanged.
struct StreamArgs {
  float* master = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::kF32;
  void* exp_avg = nullptr;     // null: not streamed
  void* exp_avg_sq = nullptr;  // null: not streamed
  DType moment_dtype = DType::kF32;
  std::uint16_t* out = nullptr;  // null: no copy-out
};

#define STRATA_OPTIM_DECLARE_ISA(isa)                                                                   \
  void update_range_##isa(const UpdateArgs& a, std::size_t begin, std::size_t end);                     \
  /* Sum of squares of y = g * inv_scale over [begin, end) in the fixed lane order; optionally          \
     writes y back. `begin` must be a segment start. */                                                 \
  double scan_range_##isa(void* grad, DType dtype, std::size_t begin, std::size_t end, float inv_scale, \
                          bool write_back);                                                             \
  void stream_range_##isa(const StreamArgs& a, std::size_t begin, std::size_t end);                     \
  /* Rounds n floats to bf16/fp16 (nearest even) with this ISA's conversion (tests use it). */          \
  void round_range_##isa(const float* in, std::uint16_t* out, DType dtype, std::size_t n);

STRATA_OPTIM_DECLARE_ISA(scalar)
STRATA_OPTIM_DECLARE_ISA(avx2)
STRATA_OPTIM_DECLARE_ISA(avx512)
#undef STRATA_OPTIM_DECLARE_ISA

struct IsaKernels {
  void (*update)(const UpdateArgs&, std::size_t, std::size_t);
  double (*scan)(void*, DType, std::size_t, std::size_t, float, bool);
  void (*stream)(const StreamArgs&, std::size_t, std::size_t);
  void (*round)(const float*, std::uint16_t*, DType, std::size_t);
};
const IsaKernels& kernels_for(SimdIsa isa);

// Splits [0, n) into per-thread ranges whose boundaries are multiples of `granule` elements and
// runs fn(begin, end) on each, on at most `threads` OpenMP threads (fewer when n is small).
// Exposed for the benchmark, which must split its roofline loop the same way.
void parallel_ranges(std::size_t n, int threads, std::size_t granule,
                     void (*fn)(void* ctx, std::size_t begin, std::size_t end), void* ctx);

// Runs the streaming loop of `a` over n elements with `isa` on `threads` threads.
void stream_parallel(SimdIsa isa, int threads, const StreamArgs& a, std::size_t n);

// Rounds with a given ISA's conversion (tests).
void round_with_isa(SimdIsa isa, const float* in, std::uint16_t* out, DType dtype, std::size_t n);

}  // namespace strata::optim_detail
