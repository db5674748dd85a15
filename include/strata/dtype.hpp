// Element types and conversions between them.
//
// Strata keeps fp32 master weights and optimizer state and moves bf16/fp16 working copies between
// tiers, so conversion sits on the hot path of every step and must be exact about rounding: a
// conversion that differed between the vectorised and the scalar path, or between machines, would
// break the bitwise equivalence guarantees of DESIGN.md.
//
// Rounding contract (every path, scalar and SIMD, gives identical bits for every input):
//  - float -> bf16 / fp16 rounds to nearest, ties to even. Values beyond the largest finite
//    result after rounding become +-Inf (fp16: |x| >= 65520). Results below the smallest normal
//    become subnormals or +-0 (gradual underflow); float subnormal inputs are never flushed.
//  - A NaN stays a NaN with its sign, is made quiet, and keeps the top bits of its payload.
//  - bf16 -> float and fp16 -> float are exact. bf16 -> float is a pure bit shift (a signalling
//    NaN stays signalling); fp16 -> float quiets NaNs, as the F16C instruction does.
//  - None of this depends on the MXCSR rounding mode or its FTZ/DAZ flags.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "strata/status.hpp"

namespace strata {

// Element types. Values are stable (they are written into checkpoints and swap files); append
// new types at the end.
enum class DType : std::uint8_t { kF32 = 0, kBF16, kF16 };
inline constexpr int kDTypeCount = 3;

// Bytes per element (0 for a value outside the enum).
std::size_t dtype_size(DType dtype);
// "f32", "bf16", "f16" ("unknown" for a value outside the enum).
std::string_view to_string(DType dtype);
// Accepts f32/fp32/float32, bf16/bfloat16, f16/fp16/float16/half (any case). The error names the
// text and lists the accepted names.
Result<DType> parse_dtype(std::string_view text);

// ---- Scalar conversions on raw bits ------------------------------------------------------------
// Inline and constexpr so kernels can use them in their loops; pure integer arithmetic, so the
// result is the same under any floating-point environment.

constexpr std::uint16_t float_to_bf16_bits(float value) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(value);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  // Adding 0x7FFF plus the kept lowest bit carries into the kept part exactly when the dropped
  // half is above one half, or equal to it with an odd kept part. A carry out of the largest
  // finite value lands on the Inf encoding, which is the correct overflow.
  return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

constexpr float bf16_bits_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

constexpr std::uint16_t float_to_f16_bits(float value) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x03FFu));
  // 65520 is halfway between 65504 (odd significand) and 2^16, so it and everything above is Inf.
  if (a >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);
  if (a >= 0x38800000u) {
    // Normal result: rebias the exponent (127 -> 15) and round away the 13 low bits, ties to even;
    // a carry out of the significand correctly bumps the exponent.
    return static_cast<std::uint16_t>(sign | ((a - 0x38000000u + 0x0FFFu + ((a >> 13) & 1u)) >> 13));
  }
  // Subnormal or zero result, in units of 2^-24: the value is m * 2^(e - 150).
  const std::uint32_t e = a >> 23;
  if (e < 102) return static_cast<std::uint16_t>(sign);  // below 2^-25: rounds to zero
  const std::uint32_t m = (a & 0x007FFFFFu) | 0x00800000u;
  const std::uint32_t shift = 126 - e;  // 14..24
  std::uint32_t r = m >> shift;
  const std::uint32_t rest = m & ((1u << shift) - 1);
  const std::uint32_t half = 1u << (shift - 1);
  if (rest > half || (rest == half && (r & 1u))) ++r;  // may become 0x400, the smallest normal
  return static_cast<std::uint16_t>(sign | r);
}

constexpr float f16_bits_to_float(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t e = (bits >> 10) & 0x1Fu;
  const std::uint32_t m = bits & 0x03FFu;
  if (e == 0x1F) {
    const std::uint32_t quiet = m != 0 ? 0x00400000u : 0u;
    return std::bit_cast<float>(sign | 0x7F800000u | quiet | (m << 13));
  }
  if (e != 0) return std::bit_cast<float>(sign | ((e + 112) << 23) | (m << 13));
  if (m == 0) return std::bit_cast<float>(sign);
  // Subnormal: m * 2^-24 with the leading one of m at bit p becomes a normal float.
  const std::uint32_t p = static_cast<std::uint32_t>(std::bit_width(m)) - 1;  // 0..9
  return std::bit_cast<float>(sign | ((p + 103) << 23) | ((m << (23 - p)) & 0x007FFFFFu));
}

// ---- 16-bit value types --------------------------------------------------------------------------
// Storage types: trivially copyable, exactly 16 bits, no arithmetic. Convert to float to compute.
// Equality is deliberately absent: comparing bits is wrong for NaN and for +0 / -0.

struct bf16 {
  std::uint16_t bits;

  bf16() = default;
  explicit constexpr bf16(float value) : bits(float_to_bf16_bits(value)) {}
  static constexpr bf16 from_bits(std::uint16_t b) {
    bf16 v;
    v.bits = b;
    return v;
  }
  explicit constexpr operator float() const { return bf16_bits_to_float(bits); }
};

struct f16 {
  std::uint16_t bits;

  f16() = default;
  explicit constexpr f16(float value) : bits(float_to_f16_bits(value)) {}
  static constexpr f16 from_bits(std::uint16_t b) {
    f16 v;
    v.bits = b;
    return v;
  }
  explicit constexpr operator float() const { return f16_bits_to_float(bits); }
};

static_assert(sizeof(bf16) == 2 && sizeof(f16) == 2);

// ---- Bulk conversion -----------------------------------------------------------------------------
// The vectorised paths. kAvx2 needs AVX2 and F16C; kAvx512 needs AVX-512 F, BW and VL.
enum class SimdIsa : std::uint8_t { kScalar = 0, kAvx2, kAvx512 };
std::string_view to_string(SimdIsa isa);
// "scalar", "avx2" or "avx512" (any case). "auto" is not an ISA; set_dtype_isa() takes it.
Result<SimdIsa> parse_simd_isa(std::string_view text);
// Whether this CPU (and the OS, for the register state) can run `isa`.
bool cpu_supports(SimdIsa isa);
// The widest ISA this CPU supports.
SimdIsa best_simd_isa();

// The path that convert() without an explicit ISA uses. This is process-wide, like the log
// filter: it picks code, not data, and every path gives identical bits, so it never changes a
// result. Until set_dtype_isa() is called, the first conversion reads STRATA_DTYPE_ISA
// (auto|scalar|avx2|avx512, the tunable `dtype_isa`); a bad or unsupported value is logged and
// the best supported path is used instead. Thread-safe.
SimdIsa dtype_isa();
// Selects the path by name ("auto" = the best supported) and returns the ISA now in use. Fails
// with kInvalidArgument for an unknown name, kUnavailable when this CPU lacks the ISA; either way
// the current choice is kept.
Result<SimdIsa> set_dtype_isa(std::string_view name);
// Re-reads STRATA_DTYPE_ISA (as if set_dtype_isa(value) were called); OK when it is unset.
Status load_dtype_isa_from_env();

// Converts n elements from src (of type `from`) to dst (of type `to`). Every pair of types is
// supported; same-type conversion copies. Any n, any alignment (even one that is not a multiple
// of the element size). src and dst must not overlap. Runs on the calling thread; callers that
// want parallelism split the range. Fails (without touching dst) for a DType outside the enum or
// a null pointer with n > 0.
Status convert(const void* src, DType from, void* dst, DType to, std::size_t n);
// The same on an explicit path; kUnavailable when this CPU lacks `isa`. For tests and benchmarks.
Status convert(const void* src, DType from, void* dst, DType to, std::size_t n, SimdIsa isa);

// Typed helpers on the current path; n may be 0 (then the pointers may be null).
void convert(const float* src, bf16* dst, std::size_t n);
void convert(const bf16* src, float* dst, std::size_t n);
void convert(const float* src, f16* dst, std::size_t n);
void convert(const f16* src, float* dst, std::size_t n);

}  // namespace strata
