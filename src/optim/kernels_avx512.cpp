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
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

namespace strata::optim_detail {
namespace {

struct Ops {
  using V = __m512;
  using I = __m512i;
  static constexpr std::size_t kW = 16;

  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }

  static V load_bf16(const std::uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  // Nearest even, NaN quieted (numerics.hpp f32_to_bf16).
  static __m256i to_bf16(V x) {
    const __m512i u = _mm512_castps_si512(x);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
  }
  static void store_bf16(std::uint16_t* p, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x));
  }
  static void store_bf16_stochastic(std::uint16_t* p, V x, I noise) {
    const __m512i u = _mm512_castps_si512(x);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_and_si512(noise, _mm512_set1_epi32(0xffff))), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet)));
  }
  static void store_bf16_truncate(std::uint16_t* p, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
  }
  static V load_f16(const std::uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_f16(std::uint16_t* p, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }

  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V sqrt(V a) { return _mm512_sqrt_ps(a); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V sign(V x) {
    const V zero = _mm512_setzero_ps();
    V r = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ), _mm512_set1_ps(1.0f));
    return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ), _mm512_set1_ps(-1.0f));
  }

  static I noise(std::uint32_t base, std::uint32_t index) {
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i x = _mm512_xor_si512(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(index)), iota),
                                 _mm512_set1_epi32(static_cast<int>(base)));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x85ebca6bu)));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0xc2b2ae35u)));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  }
  static I shr16(I x) { return _mm512_srli_epi32(x, 16); }
};

#include "optim/kernel_body.inc"

}  // namespace

void update_range_avx512(const UpdateArgs& a, std::size_t begin, std::size_t end) {
  update_range_impl(a, begin, end);
}

void stream_range_avx512(const StreamArgs& a, std::size_t begin, std::size_t end) {
  stream_range_impl(a, begin, end);
}

void round_range_avx512(const float* in, std::uint16_t* out, OptimDType dtype, std::size_t n) {
  round_range_impl(in, out, dtype, n);
}

double scan_range_avx512(void* grad, OptimDType dtype, std::size_t begin, std::size_t end, float inv_scale,
                         bool write_back) {
  const __m512 s = _mm512_set1_ps(inv_scale);
  __m512d acc_lo = _mm512_setzero_pd();  // lanes 0..7
  __m512d acc_hi = _mm512_setzero_pd();  // lanes 8..15
  auto* f32 = static_cast<float*>(grad);
  auto* u16 = static_cast<std::uint16_t*>(grad);
  std::size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    __m512 y;
    if (dtype == OptimDType::kF32) {
      y = _mm512_mul_ps(Ops::load(f32 + i), s);
      if (write_back) Ops::store(f32 + i, y);
    } else if (dtype == OptimDType::kBF16) {
      y = _mm512_mul_ps(Ops::load_bf16(u16 + i), s);
      if (write_back) {
        Ops::store_bf16(u16 + i, y);
        y = Ops::load_bf16(u16 + i);  // the norm is of what the update will read
      }
    } else {
      y = _mm512_mul_ps(Ops::load_f16(u16 + i), s);
      if (write_back) {
        Ops::store_f16(u16 + i, y);
        y = Ops::load_f16(u16 + i);
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

#pragma GCC pop_options
#pragma GCC diagnostic pop
