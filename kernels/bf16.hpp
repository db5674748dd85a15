// bf16 <-> fp32 conversion on bit patterns, usable from host code and CUDA device code.
// bf16 is the upper half of an fp32; narrowing rounds to nearest, ties to even, and keeps NaNs
// quiet NaNs (a plain truncation would bias every rounding toward zero).
// Same rounding contract as strata/dtype.hpp (a test checks they agree bit for bit); these exist
// because CUDA device code needs __host__ __device__ versions.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define STRATA_HOST_DEVICE __host__ __device__
#else
#define STRATA_HOST_DEVICE
#endif

namespace strata::kernels {

STRATA_HOST_DEVICE inline float bf16_bits_to_f32(std::uint16_t bits) {
  const std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

STRATA_HOST_DEVICE inline std::uint16_t f32_to_bf16_bits_rne(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

// fp32 -> nearest bf16 -> fp32: what storing a value as bf16 does to it.
STRATA_HOST_DEVICE inline float round_to_bf16(float f) { return bf16_bits_to_f32(f32_to_bf16_bits_rne(f)); }

}  // namespace strata::kernels
