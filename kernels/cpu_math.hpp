// Vectorizable fp32 math for the cpu kernels.
//
// The C library's expf/tanhf are scalar calls that GCC does not vectorize without -ffast-math,
// and on a 50k-word vocabulary or a 4C-wide MLP they cost more than the matmul next to them.
// exp_f32 is a branch-free range reduction plus a degree-6 polynomial (the classic Cephes
// coefficients): within 2 ulp of expf over its range, and loops calling it vectorize.
//
// Hot loops are compiled several times for different x86-64 levels (AVX-512, AVX2+FMA, baseline)
// with the choice made once at load time (GCC function multiversioning), so the library stays
// portable while using the vector width of the machine it runs on.
#pragma once

#include <cstdint>
#include <cstring>

// Helpers called from inside a clone must be inlined into it: an out-of-line helper is compiled
// for the baseline ISA only, and would run there whatever the caller's level.
#if defined(__GNUC__)
#define STRATA_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define STRATA_ALWAYS_INLINE inline
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define STRATA_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define STRATA_CPU_CLONES
#endif

namespace strata::kernels {

// e^x for x ≤ 88 (e^88 ≈ 1.7e38); exactly 0 below -87 (the smallest normal's range), NaN kept.
STRATA_ALWAYS_INLINE float exp_f32(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5·2^23: adding it rounds to an integer
  const float xc = x > 88.0f ? 88.0f : (x < -87.0f ? -87.0f : x);
  const float t = xc * kLog2e + kRound;
  const float n = t - kRound;
  std::int32_t ti;
  std::memcpy(&ti, &t, sizeof ti);
  const std::int32_t ni = ti - 0x4B400000;  // n as an integer
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const std::int32_t bits = (ni + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const float result = p * scale;
  return x < -87.0f ? 0.0f : (x != x ? x : result);
}

// tanh through e^{2|u|}: tanh|u| = 1 - 2/(e^{2|u|} + 1), exactly ±1 from |u| = 9 on (as fp32
// tanh is), so 1 - tanh² vanishes there as it should. Absolute error about 1e-7, which is what
// GELU needs (it adds tanh to 1).
STRATA_ALWAYS_INLINE float tanh_f32(float u) {
  const float a = u < 0.0f ? -u : u;
  const float e = exp_f32(2.0f * (a > 9.0f ? 9.0f : a));
  const float t = a >= 9.0f ? 1.0f : 1.0f - 2.0f / (e + 1.0f);
  return u < 0.0f ? -t : t;
}

STRATA_ALWAYS_INLINE float sigmoid_f32(float x) { return 1.0f / (1.0f + exp_f32(-x)); }

}  // namespace strata::kernels
