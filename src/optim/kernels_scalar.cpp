// Optimizer kernels for any x86-64 (or other) CPU: one lane, the same operations as the vector
// paths. std::fma gives the single rounding the vector FMAs give (glibc uses the FMA instruction
// when the CPU has one and an exact software fallback otherwise).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "optim/kernels.hpp"

namespace strata::optim_detail {
namespace {

struct Ops {
  using V = float;
  using I = std::uint32_t;
  static constexpr std::size_t kW = 1;

  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V x) { *p = x; }
  static V load_bf16(const std::uint16_t* p) { return bf16_to_f32(*p); }
  static void store_bf16(std::uint16_t* p, V x) { *p = f32_to_bf16(x); }
  static void store_bf16_stochastic(std::uint16_t* p, V x, I noise) { *p = f32_to_bf16_stochastic(x, noise); }
  static void store_bf16_truncate(std::uint16_t* p, V x) {
    *p = static_cast<std::uint16_t>(f32_bits(x) >> 16);
  }
  static V load_f16(const std::uint16_t* p) { return f16_to_f32(*p); }
  static void store_f16(std::uint16_t* p, V x) { *p = f32_to_f16(x); }

  static V add(V a, V b) { return a + b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V sqrt(V a) { return std::sqrt(a); }
  static V fma(V a, V b, V c) { return std::fma(a, b, c); }
  static V sign(V x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x); }

  static I noise(std::uint32_t base, std::uint32_t index) { return rounding_noise(base, index); }
};

#include "optim/kernel_body.inc"

}  // namespace

void update_range_scalar(const UpdateArgs& a, std::size_t begin, std::size_t end) {
  update_range_impl(a, begin, end);
}

void stream_range_scalar(const StreamArgs& a, std::size_t begin, std::size_t end) {
  stream_range_impl(a, begin, end);
}

void round_range_scalar(const float* in, std::uint16_t* out, DType dtype, std::size_t n) {
  round_range_impl(in, out, dtype, n);
}

double scan_range_scalar(void* grad, DType dtype, std::size_t begin, std::size_t end, float inv_scale,
                         bool write_back) {
  double lanes[kScanLanes] = {};
  scan_scalar(grad, dtype, begin, end, inv_scale, write_back, lanes);
  return sum_lanes(lanes);
}

}  // namespace strata::optim_detail
