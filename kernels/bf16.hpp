// bf16 <-> fp32 and fp16 <-> fp32 conversion on bit patterns, usable from host code and CUDA
// device code. bf16 is the upper half of an fp32; fp16 is IEEE binary16. Narrowing rounds to
// nearest, ties to even (fp16: gradual underflow to subnormals, overflow to Inf from 65520 on),
// and keeps NaNs quiet NaNs (a plain truncation would bias every rounding toward zero).
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

STRATA_HOST_DEVICE inline float f16_bits_to_f32(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t e = (bits >> 10) & 0x1fu;
  std::uint32_t m = bits & 0x03ffu;
  std::uint32_t u;
  if (e == 0x1f) {
    u = sign | 0x7f800000u | (m != 0 ? 0x00400000u : 0u) | (m << 13);
  } else if (e != 0) {
    u = sign | ((e + 112) << 23) | (m << 13);
  } else if (m == 0) {
    u = sign;
  } else {
    // Subnormal m * 2^-24: shift the leading one up to the implicit bit.
    std::uint32_t exp = 113;
    while ((m & 0x400u) == 0) {
      m <<= 1;
      --exp;
    }
    u = sign | (exp << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

STRATA_HOST_DEVICE inline std::uint16_t f32_to_f16_bits_rne(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x03ffu));
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520: Inf
  if (a >= 0x38800000u) {
    // Normal: rebias (127 -> 15) and round away 13 bits, ties to even.
    return static_cast<std::uint16_t>(sign | ((a - 0x38000000u + 0x0fffu + ((a >> 13) & 1u)) >> 13));
  }
  const std::uint32_t e = a >> 23;
  if (e < 102) return static_cast<std::uint16_t>(sign);  // below 2^-25: zero
  const std::uint32_t m = (a & 0x007fffffu) | 0x00800000u;
  const std::uint32_t shift = 126 - e;  // 14..24
  std::uint32_t r = m >> shift;
  const std::uint32_t rest = m & ((1u << shift) - 1);
  const std::uint32_t half = 1u << (shift - 1);
  if (rest > half || (rest == half && (r & 1u))) ++r;
  return static_cast<std::uint16_t>(sign | r);
}

// fp32 -> nearest fp16 -> fp32.
STRATA_HOST_DEVICE inline float round_to_f16(float f) { return f16_bits_to_f32(f32_to_f16_bits_rne(f)); }

}  // namespace strata::kernels
