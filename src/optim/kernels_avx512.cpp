// Optimizer kernels for AVX-512 (F, BW, VL, DQ): 16 fp32 lanes. Compiled for that target by the
// pragma below only; cpu_optimizer.cpp calls in here after __builtin_cpu_supports said yes.
// bf16 rounding is integer arithmetic (AVX512-BF16's vcvtneps2bf16 would flush subnormals).
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "optim/kernels.hpp"

// GCC 12 reports its own _mm512_undefined_* placeholders in avx512fintrin.h as maybe-uninitialized.
#pragma GCC diagnostic push
#if !defined(__clang__)  // clang has no such warning group (and warns about the unknown name)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
// clang ignores #pragma GCC target; it takes the same target list as an attribute on every
// function defined in the region (the sanitizer and fuzz builds use clang).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif

namespace strata::optim_detail {
namespace {

// 32 lanes as two zmm halves: elements i..i+15 in `lo`, i+16..i+31 in `hi`. Working on 32 at a
// time lets one 64-byte store carry 32 bf16 results (one two-source word permute packs the high
// halves of both), which matters because the update runs close to the memory bandwidth.
struct V32 {
  __m512 lo, hi;
};
struct I32 {
  __m512i lo, hi;
};

// Word j of the result is the high word of dword j of (a, b) taken as one 32-dword vector.
inline __attribute__((always_inline)) __m512i pack_high_words(__m512i a, __m512i b) {
  // _mm512_set_epi16 lists words from the highest down: word j holds 2j + 1.
  const __m512i idx = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29,
                                       27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_permutex2var_epi16(a, idx, b);
}

// fp32 -> bf16 round to nearest even, still in the high word of each dword (numerics.hpp
// f32_to_bf16): NaN lanes get the quiet bit instead of a rounding increment.
inline __attribute__((always_inline)) __m512i round_bf16_high(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x400000));
}

// Stochastic: add 16 bits of noise below the kept half (numerics.hpp f32_to_bf16_stochastic).
inline __attribute__((always_inline)) __m512i round_bf16_stochastic_high(__m512 x, __m512i noise) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i r = _mm512_add_epi32(u, noise);
  return _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x400000));
}

inline __attribute__((always_inline)) __m512 widen_bf16(const std::uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

inline __attribute__((always_inline)) __m512i noise16(std::uint32_t base, std::uint32_t index,
                                                      int first_lane) {
  const __m512i lanes = _mm512_add_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(first_lane));
  const __m512i offsets = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(static_cast<int>(kNoiseMul1)));
  __m512i x = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(index * kNoiseMul1)), offsets);
  x = _mm512_xor_si512(x, _mm512_set1_epi32(static_cast<int>(base)));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(kNoiseMul2)));
  return _mm512_srli_epi32(x, 16);
}

struct Ops {
  using V = V32;
  using I = I32;
  static constexpr std::size_t kW = 32;

  __attribute__((always_inline)) static V set1(float x) {
    const __m512 v = _mm512_set1_ps(x);
    return {v, v};
  }
  __attribute__((always_inline)) static V load(const float* p) {
    return {_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)};
  }
  __attribute__((always_inline)) static void store(float* p, V x) {
    _mm512_storeu_ps(p, x.lo);
    _mm512_storeu_ps(p + 16, x.hi);
  }
  __attribute__((always_inline)) static V load_bf16(const std::uint16_t* p) {
    return {widen_bf16(p), widen_bf16(p + 16)};
  }
  __attribute__((always_inline)) static void store_bf16(std::uint16_t* p, V x) {
    _mm512_storeu_si512(p, pack_high_words(round_bf16_high(x.lo), round_bf16_high(x.hi)));
  }
  __attribute__((always_inline)) static void store_bf16_stochastic(std::uint16_t* p, V x, I noise) {
    _mm512_storeu_si512(p, pack_high_words(round_bf16_stochastic_high(x.lo, noise.lo),
                                           round_bf16_stochastic_high(x.hi, noise.hi)));
  }
  __attribute__((always_inline)) static void store_bf16_truncate(std::uint16_t* p, V x) {
    _mm512_storeu_si512(p, pack_high_words(_mm512_castps_si512(x.lo), _mm512_castps_si512(x.hi)));
  }
  __attribute__((always_inline)) static V load_f16(const std::uint16_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)))};
  }
  __attribute__((always_inline)) static void store_f16(std::uint16_t* p, V x) {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x.lo, kRound));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16), _mm512_cvtps_ph(x.hi, kRound));
  }

  __attribute__((always_inline)) static V add(V a, V b) {
    return {_mm512_add_ps(a.lo, b.lo), _mm512_add_ps(a.hi, b.hi)};
  }
  __attribute__((always_inline)) static V mul(V a, V b) {
    return {_mm512_mul_ps(a.lo, b.lo), _mm512_mul_ps(a.hi, b.hi)};
  }
  __attribute__((always_inline)) static V div(V a, V b) {
    return {_mm512_div_ps(a.lo, b.lo), _mm512_div_ps(a.hi, b.hi)};
  }
  __attribute__((always_inline)) static V sqrt(V a) { return {_mm512_sqrt_ps(a.lo), _mm512_sqrt_ps(a.hi)}; }
  __attribute__((always_inline)) static V fma(V a, V b, V c) {
    return {_mm512_fmadd_ps(a.lo, b.lo, c.lo), _mm512_fmadd_ps(a.hi, b.hi, c.hi)};
  }
  __attribute__((always_inline)) static __m512 sign1(__m512 x) {
    const __m512 zero = _mm512_setzero_ps();
    const __m512 r = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ), _mm512_set1_ps(1.0f));
    return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ), _mm512_set1_ps(-1.0f));
  }
  __attribute__((always_inline)) static V sign(V x) { return {sign1(x.lo), sign1(x.hi)}; }

  __attribute__((always_inline)) static I noise(std::uint32_t base, std::uint32_t index) {
    return {noise16(base, index, 0), noise16(base, index, 16)};
  }
};

#include "optim/kernel_body.inc"

}  // namespace

void update_range_avx512(const UpdateArgs& a, std::size_t begin, std::size_t end) {
  update_range_impl(a, begin, end);
}

void stream_range_avx512(const StreamArgs& a, std::size_t begin, std::size_t end) {
  stream_range_impl(a, begin, end);
}

void round_range_avx512(const float* in, std::uint16_t* out, DType dtype, std::size_t n) {
  round_range_impl(in, out, dtype, n);
}

double scan_range_avx512(void* grad, DType dtype, std::size_t begin, std::size_t end, float inv_scale,
                         bool write_back) {
  const __m512 s = _mm512_set1_ps(inv_scale);
  __m512d acc_lo = _mm512_setzero_pd();  // lanes 0..7
  __m512d acc_hi = _mm512_setzero_pd();  // lanes 8..15
  auto* f32 = static_cast<float*>(grad);
  auto* u16 = static_cast<std::uint16_t*>(grad);
  std::size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    __m512 y;
    if (dtype == DType::kF32) {
      y = _mm512_mul_ps(_mm512_loadu_ps(f32 + i), s);
      if (write_back) _mm512_storeu_ps(f32 + i, y);
    } else if (dtype == DType::kBF16) {
      y = _mm512_mul_ps(widen_bf16(u16 + i), s);
      if (write_back) {
        const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16_high(y), 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(u16 + i), h);
        y = widen_bf16(u16 + i);  // the norm is of what the update will read
      }
    } else {
      const auto* h = reinterpret_cast<__m256i*>(u16 + i);
      y = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(h)), s);
      if (write_back) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(u16 + i),
                            _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        y = _mm512_cvtph_ps(_mm256_loadu_si256(h));
      }
    }
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(y));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1)));
    acc_lo = _mm512_add_pd(acc_lo, _mm512_mul_pd(lo, lo));  // exact products: fma or not, same sum
    acc_hi = _mm512_add_pd(acc_hi, _mm512_mul_pd(hi, hi));
  }
  alignas(64) double lanes[kScanLanes];
  _mm512_store_pd(lanes, acc_lo);
  _mm512_store_pd(lanes + 8, acc_hi);
  scan_scalar(grad, dtype, i, end, inv_scale, write_back, lanes);
  return sum_lanes(lanes);
}

}  // namespace strata::optim_detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#pragma GCC diagnostic pop
