// Optimizer kernels for AVX2 + FMA + F16C: 8 fp32 lanes per register, 16 per block. Compiled for that target
// by the pragma below only; cpu_optimizer.cpp calls in here after __builtin_cpu_supports said yes.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "optim/kernels.hpp"

// clang ignores #pragma GCC target; it takes the same target list as an attribute on every
// function defined in the region (the sanitizer and fuzz builds use clang).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace strata::optim_detail {
namespace {

#define STRATA_AVX2_INLINE inline __attribute__((always_inline))

// 16 lanes as two ymm halves (elements i..i+7 in `lo`, i+8..i+15 in `hi`), so that one 32-byte
// store carries 16 bf16 results.
struct V16 {
  __m256 lo, hi;
};
struct I16 {
  __m256i lo, hi;
};

// The high words of (a, b) as 16 consecutive words: a0..a7, b0..b7.
STRATA_AVX2_INLINE __m256i pack_high_words(__m256i a, __m256i b) {
  const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(a, 16), _mm256_srli_epi32(b, 16));
  return _mm256_permute4x64_epi64(packed, 0xd8);  // undo packus's per-128-bit interleaving
}

STRATA_AVX2_INLINE __m256i nan_lanes(__m256 x) {
  return _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// fp32 -> bf16 nearest even, in the high word (numerics.hpp f32_to_bf16); NaN lanes get the
// quiet bit instead of a rounding increment.
STRATA_AVX2_INLINE __m256i round_bf16_high(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
  return _mm256_blendv_epi8(r, quiet, nan_lanes(x));
}

STRATA_AVX2_INLINE __m256i round_bf16_stochastic_high(__m256 x, __m256i noise) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
  return _mm256_blendv_epi8(_mm256_add_epi32(u, noise), quiet, nan_lanes(x));
}

STRATA_AVX2_INLINE __m256 widen_bf16(const std::uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

STRATA_AVX2_INLINE __m256i noise8(std::uint32_t base, std::uint32_t index, int first_lane) {
  const __m256i lanes =
      _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(first_lane));
  const __m256i offsets = _mm256_mullo_epi32(lanes, _mm256_set1_epi32(static_cast<int>(kNoiseMul1)));
  __m256i x = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(index * kNoiseMul1)), offsets);
  x = _mm256_xor_si256(x, _mm256_set1_epi32(static_cast<int>(base)));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kNoiseMul2)));
  return _mm256_srli_epi32(x, 16);
}

STRATA_AVX2_INLINE __m256 sign8(__m256 x) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 r = _mm256_blendv_ps(x, _mm256_set1_ps(1.0f), _mm256_cmp_ps(x, zero, _CMP_GT_OQ));
  return _mm256_blendv_ps(r, _mm256_set1_ps(-1.0f), _mm256_cmp_ps(x, zero, _CMP_LT_OQ));
}

struct Ops {
  using V = V16;
  using I = I16;
  static constexpr std::size_t kW = 16;

  STRATA_AVX2_INLINE static V set1(float x) {
    const __m256 v = _mm256_set1_ps(x);
    return {v, v};
  }
  STRATA_AVX2_INLINE static V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  STRATA_AVX2_INLINE static void store(float* p, V x) {
    _mm256_storeu_ps(p, x.lo);
    _mm256_storeu_ps(p + 8, x.hi);
  }
  STRATA_AVX2_INLINE static V load_bf16(const std::uint16_t* p) { return {widen_bf16(p), widen_bf16(p + 8)}; }
  STRATA_AVX2_INLINE static void store_bf16(std::uint16_t* p, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        pack_high_words(round_bf16_high(x.lo), round_bf16_high(x.hi)));
  }
  STRATA_AVX2_INLINE static void store_bf16_stochastic(std::uint16_t* p, V x, I noise) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        pack_high_words(round_bf16_stochastic_high(x.lo, noise.lo),
                                        round_bf16_stochastic_high(x.hi, noise.hi)));
  }
  STRATA_AVX2_INLINE static void store_bf16_truncate(std::uint16_t* p, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        pack_high_words(_mm256_castps_si256(x.lo), _mm256_castps_si256(x.hi)));
  }
  STRATA_AVX2_INLINE static V load_f16(const std::uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  STRATA_AVX2_INLINE static void store_f16(std::uint16_t* p, V x) {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x.lo, kRound));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(x.hi, kRound));
  }

  STRATA_AVX2_INLINE static V add(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  STRATA_AVX2_INLINE static V mul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  STRATA_AVX2_INLINE static V div(V a, V b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
  STRATA_AVX2_INLINE static V sqrt(V a) { return {_mm256_sqrt_ps(a.lo), _mm256_sqrt_ps(a.hi)}; }
  STRATA_AVX2_INLINE static V fma(V a, V b, V c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
  }
  STRATA_AVX2_INLINE static V sign(V x) { return {sign8(x.lo), sign8(x.hi)}; }
  STRATA_AVX2_INLINE static I noise(std::uint32_t base, std::uint32_t index) {
    return {noise8(base, index, 0), noise8(base, index, 8)};
  }
};

#include "optim/kernel_body.inc"

}  // namespace

void update_range_avx2(const UpdateArgs& a, std::size_t begin, std::size_t end) {
  update_range_impl(a, begin, end);
}

void stream_range_avx2(const StreamArgs& a, std::size_t begin, std::size_t end) {
  stream_range_impl(a, begin, end);
}

void round_range_avx2(const float* in, std::uint16_t* out, DType dtype, std::size_t n) {
  round_range_impl(in, out, dtype, n);
}

double scan_range_avx2(void* grad, DType dtype, std::size_t begin, std::size_t end, float inv_scale,
                       bool write_back) {
  const __m256 s = _mm256_set1_ps(inv_scale);
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  auto* f32 = static_cast<float*>(grad);
  auto* u16 = static_cast<std::uint16_t*>(grad);
  auto unscale = [&](std::size_t at) {
    __m256 y;
    if (dtype == DType::kF32) {
      y = _mm256_mul_ps(_mm256_loadu_ps(f32 + at), s);
      if (write_back) _mm256_storeu_ps(f32 + at, y);
    } else if (dtype == DType::kBF16) {
      y = _mm256_mul_ps(widen_bf16(u16 + at), s);
      if (write_back) {
        const __m256i h = _mm256_srli_epi32(round_bf16_high(y), 16);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(u16 + at),
                         _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
        y = widen_bf16(u16 + at);  // the norm is of what the update will read
      }
    } else {
      const auto* h = reinterpret_cast<const __m128i*>(u16 + at);
      y = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(h)), s);
      if (write_back) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(u16 + at),
                         _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        y = _mm256_cvtph_ps(_mm_loadu_si128(h));
      }
    }
    return y;
  };
  std::size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m256 y0 = unscale(i);      // lanes 0..7
    const __m256 y1 = unscale(i + 8);  // lanes 8..15
    const __m256d d[4] = {
        _mm256_cvtps_pd(_mm256_castps256_ps128(y0)), _mm256_cvtps_pd(_mm256_extractf128_ps(y0, 1)),
        _mm256_cvtps_pd(_mm256_castps256_ps128(y1)), _mm256_cvtps_pd(_mm256_extractf128_ps(y1, 1))};
    for (int k = 0; k < 4; ++k) acc[k] = _mm256_add_pd(acc[k], _mm256_mul_pd(d[k], d[k]));
  }
  alignas(32) double lanes[kScanLanes];
  for (int k = 0; k < 4; ++k) _mm256_store_pd(lanes + 4 * k, acc[k]);
  scan_scalar(grad, dtype, i, end, inv_scale, write_back, lanes);
  return sum_lanes(lanes);
}

}  // namespace strata::optim_detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
