// Scalar numerics shared by every optimizer path (scalar, AVX2, AVX-512 and CUDA): the float ->
// bf16/fp16 roundings, the stochastic-rounding hash and the per-step constants. The SIMD paths
// reimplement the roundings with the same integer arithmetic and must match these bit for bit
// (tests/test_optim_kernels.cpp checks it). Self-contained on purpose: no dependency on a dtype
// module, so it also compiles as CUDA device code.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "strata/optim.hpp"

#if defined(__CUDACC__)
#define STRATA_HD __host__ __device__ __forceinline__
#else
#define STRATA_HD inline
#endif

namespace strata::optim_detail {

STRATA_HD std::uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

STRATA_HD float bits_f32(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// bf16 is the top half of an fp32. Round to nearest even on the dropped 16 bits; a NaN keeps its
// sign and top payload bits and is made quiet (so it cannot round into an infinity).
STRATA_HD std::uint16_t f32_to_bf16(float f) {
  const std::uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Stochastic rounding: add 16 random bits (noise16 < 2^16) below the kept part, then truncate. Unbiased in
// expectation, which is what keeps slowly moving bf16 moments from stalling.
STRATA_HD std::uint16_t f32_to_bf16_stochastic(float f, std::uint32_t noise16) {
  const std::uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  return static_cast<std::uint16_t>((u + noise16) >> 16);
}

STRATA_HD float bf16_to_f32(std::uint16_t h) { return bits_f32(static_cast<std::uint32_t>(h) << 16); }

// IEEE binary16 with round to nearest even, overflow to infinity, gradual underflow, NaN quieted
// with its top payload bits kept: the same result as F16C's vcvtps2ph with imm8 = 0.
STRATA_HD std::uint16_t f32_to_f16(float f) {
  const std::uint32_t u = f32_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520 (or inf)
  if (a >= 0x38800000u) {  // a normal half: rebias the exponent by 127 - 15, round off 13 bits
    std::uint32_t t = a - 0x38000000u;
    t += 0x0fffu + ((t >> 13) & 1u);
    return static_cast<std::uint16_t>(sign | (t >> 13));
  }
  // Subnormal half (or zero): count in units of 2^-24.
  const std::uint32_t exponent = a >> 23;
  const std::uint32_t shift = 126u - exponent;  // >= 14 here
  if (shift > 24u) return static_cast<std::uint16_t>(sign);
  const std::uint32_t mant = (a & 0x7fffffu) | 0x800000u;
  std::uint32_t r = mant >> shift;
  const std::uint32_t rem = mant & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return static_cast<std::uint16_t>(sign | r);
}

// Exact binary16 -> fp32 (every half is representable); NaN payloads carried over and quieted,
// as vcvtph2ps does.
STRATA_HD float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_f32(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u));
  if (exponent != 0) return bits_f32(sign | ((exponent + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_f32(sign);
  // Subnormal: normalise.
  std::uint32_t e = 113u;
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  return bits_f32(sign | (e << 23) | ((mant & 0x3ffu) << 13));
}

// The stochastic-rounding noise of an element: 16 bits from a hash of (element index, step,
// seed). The per-call part (step, seed) is mixed once into `base`; per element it is
// ((index * K1) ^ base) * K2, of which the top 16 bits are used (the top bits of a product depend
// on every bit of its input). Two multiplies and a shift per vector: the bf16-moment update runs
// close to the memory bandwidth, so the hash has to be cheap. Elements 2^32 apart share a stream,
// which is harmless for rounding noise. m and v of an element use the same noise; each is still
// rounded without bias.
inline constexpr std::uint32_t kNoiseMul1 = 0x9e3779b1u;
inline constexpr std::uint32_t kNoiseMul2 = 0x85ebca6bu;

STRATA_HD std::uint32_t mix32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  x ^= x >> 16;
  return x;
}
STRATA_HD std::uint32_t rounding_base(std::int64_t step, std::uint32_t seed) {
  return mix32(static_cast<std::uint32_t>(step) * 0x9e3779b9u ^ mix32(seed + 0x632be5abu));
}
STRATA_HD std::uint32_t rounding_noise(std::uint32_t base, std::uint64_t index) {
  return (((static_cast<std::uint32_t>(index) * kNoiseMul1) ^ base) * kNoiseMul2) >> 16;
}

// Everything the update needs per step, computed once in double and rounded to fp32, so every
// path (and the device) starts from the same fp32 constants.
struct UpdateConstants {
  float grad_scale = 1.0f;
  float beta1 = 0.0f, one_minus_beta1 = 1.0f;
  float beta2 = 0.0f, one_minus_beta2 = 1.0f;
  float eps = 0.0f;
  float l2 = 0.0f;             // Adam/Adagrad: g += l2 * p (0 = off)
  float decay = 1.0f;          // AdamW/Lion: p *= 1 - lr * weight_decay
  float neg_step_size = 0.0f;  // Adam/AdamW: -lr / (1 - beta1^t); Lion: -lr; Adagrad: -clr
  float inv_sqrt_bc2 = 1.0f;   // Adam/AdamW: 1 / sqrt(1 - beta2^t)
  std::uint32_t rounding_base = 0;
};

inline UpdateConstants make_update_constants(const OptimizerHyper& h, std::int64_t step, float grad_scale,
                                             std::uint32_t seed) {
  UpdateConstants c;
  c.grad_scale = grad_scale;
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.eps = static_cast<float>(h.eps);
  c.rounding_base = rounding_base(step, seed);
  const double t = static_cast<double>(step);
  switch (h.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam: {
      const double bc1 = h.bias_correction ? 1.0 - std::pow(h.beta1, t) : 1.0;
      const double bc2 = h.bias_correction ? 1.0 - std::pow(h.beta2, t) : 1.0;
      c.neg_step_size = static_cast<float>(-h.lr / bc1);
      c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
      if (h.kind == OptimizerKind::kAdamW) {
        c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
      } else {
        c.l2 = static_cast<float>(h.weight_decay);
      }
      break;
    }
    case OptimizerKind::kLion:
      c.neg_step_size = static_cast<float>(-h.lr);
      c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
      break;
    case OptimizerKind::kAdagrad:
      c.neg_step_size = static_cast<float>(-h.lr / (1.0 + (t - 1.0) * h.lr_decay));
      c.l2 = static_cast<float>(h.weight_decay);
      break;
  }
  return c;
}

}  // namespace strata::optim_detail
