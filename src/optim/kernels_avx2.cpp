// Optimizer kernels for AVX2 + FMA + F16C: 8 fp32 lanes. Compiled for that target by the pragma
// below only; cpu_optimizer.cpp calls in here after __builtin_cpu_supports said yes.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "optim/kernels.hpp"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace strata::optim_detail {
namespace {

// 8 x uint32 (each <= 0xffff) -> 8 x uint16.
inline __attribute__((always_inline)) __m128i narrow_u32(__m256i x) {
  return _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
}

struct Ops {
  using V = __m256;
  using I = __m256i;
  static constexpr std::size_t kW = 8;

  __attribute__((always_inline)) static V set1(float x) { return _mm256_set1_ps(x); }
  __attribute__((always_inline)) static V load(const float* p) { return _mm256_loadu_ps(p); }
  __attribute__((always_inline)) static void store(float* p, V x) { _mm256_storeu_ps(p, x); }

  __attribute__((always_inline)) static V load_bf16(const std::uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  __attribute__((always_inline)) static __m256i nan_mask(V x) {
    return _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  __attribute__((always_inline)) static void store_bf16(std::uint16_t* p, V x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     narrow_u32(_mm256_blendv_epi8(rounded, quiet, nan_mask(x))));
  }
  __attribute__((always_inline)) static void store_bf16_stochastic(std::uint16_t* p, V x, I noise) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, noise), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     narrow_u32(_mm256_blendv_epi8(rounded, quiet, nan_mask(x))));
  }
  __attribute__((always_inline)) static void store_bf16_truncate(std::uint16_t* p, V x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     narrow_u32(_mm256_srli_epi32(_mm256_castps_si256(x), 16)));
  }
  __attribute__((always_inline)) static V load_f16(const std::uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  __attribute__((always_inline)) static void store_f16(std::uint16_t* p, V x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }

  __attribute__((always_inline)) static V add(V a, V b) { return _mm256_add_ps(a, b); }
  __attribute__((always_inline)) static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  __attribute__((always_inline)) static V div(V a, V b) { return _mm256_div_ps(a, b); }
  __attribute__((always_inline)) static V sqrt(V a) { return _mm256_sqrt_ps(a); }
  __attribute__((always_inline)) static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  __attribute__((always_inline)) static V sign(V x) {
    const V zero = _mm256_setzero_ps();
    V r = _mm256_blendv_ps(x, _mm256_set1_ps(1.0f), _mm256_cmp_ps(x, zero, _CMP_GT_OQ));
    return _mm256_blendv_ps(r, _mm256_set1_ps(-1.0f), _mm256_cmp_ps(x, zero, _CMP_LT_OQ));
  }

  __attribute__((always_inline)) static I noise(std::uint32_t base, std::uint32_t index) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_mullo_epi32(lanes, _mm256_set1_epi32(static_cast<int>(kNoiseMul1)));
    __m256i x = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(index * kNoiseMul1)), step);
    x = _mm256_xor_si256(x, _mm256_set1_epi32(static_cast<int>(base)));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kNoiseMul2)));
    return _mm256_srli_epi32(x, 16);
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

void round_range_avx2(const float* in, std::uint16_t* out, OptimDType dtype, std::size_t n) {
  round_range_impl(in, out, dtype, n);
}

double scan_range_avx2(void* grad, OptimDType dtype, std::size_t begin, std::size_t end, float inv_scale,
                       bool write_back) {
  const __m256 s = _mm256_set1_ps(inv_scale);
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  auto* f32 = static_cast<float*>(grad);
  auto* u16 = static_cast<std::uint16_t*>(grad);
  auto unscale = [&](std::size_t at) {
    __m256 y;
    if (dtype == OptimDType::kF32) {
      y = _mm256_mul_ps(Ops::load(f32 + at), s);
      if (write_back) Ops::store(f32 + at, y);
    } else if (dtype == OptimDType::kBF16) {
      y = _mm256_mul_ps(Ops::load_bf16(u16 + at), s);
      if (write_back) {
        Ops::store_bf16(u16 + at, y);
        y = Ops::load_bf16(u16 + at);  // the norm is of what the update will read
      }
    } else {
      y = _mm256_mul_ps(Ops::load_f16(u16 + at), s);
      if (write_back) {
        Ops::store_f16(u16 + at, y);
        y = Ops::load_f16(u16 + at);
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

#pragma GCC pop_options
