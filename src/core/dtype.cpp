// Element types and bulk conversion.
//
// Each path (scalar, AVX2+F16C, AVX-512) provides four kernels: float <-> bf16 and float <-> fp16.
// Other pairs go through float in chunks, which adds no rounding because widening is exact.
// The SIMD kernels are compiled with per-function target attributes and are only called after a
// run-time CPU check, so the library itself runs on any x86-64 (and builds elsewhere, scalar only).
//
// Why every path gives identical bits:
//  - float -> bf16 uses the same integer rounding as float_to_bf16_bits() in every path. The
//    AVX512-BF16 instruction (vcvtneps2bf16) is not used: it flushes subnormal inputs to zero.
//  - float <-> fp16 in the SIMD paths uses the F16C / AVX-512 conversion instructions with the
//    rounding mode in the immediate (nearest-even, independent of MXCSR). Their NaN handling
//    (quiet, sign and top payload bits kept) is what the scalar functions implement; the tests
//    compare the paths over every fp16 pattern and a sweep of the float space.
//  - Tails use masked loads/stores (AVX-512) or the scalar functions (AVX2).
#include "strata/dtype.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <string>

#include "strata/log.hpp"
#include "strata/options.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define STRATA_DTYPE_X86 1
#else
#define STRATA_DTYPE_X86 0
#endif

namespace strata {
namespace {

struct DTypeDesc {
  DType id;
  std::string_view name;
  std::size_t size;
  std::array<std::string_view, 4> aliases;  // accepted by parse_dtype, besides `name`
};

constexpr std::array<DTypeDesc, kDTypeCount> kDTypes = {{
    {DType::kF32, "f32", 4, {"fp32", "float32", "", ""}},
    {DType::kBF16, "bf16", 2, {"bfloat16", "", "", ""}},
    {DType::kF16, "f16", 2, {"fp16", "float16", "half", ""}},
}};

bool valid_dtype(DType d) { return static_cast<std::size_t>(d) < kDTypes.size(); }

std::string lower_trimmed(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// ---- Kernels -----------------------------------------------------------------------------------
// Raw byte pointers: callers may pass any alignment, so element access goes through memcpy (a
// plain load on x86) or unaligned vector loads.
using KernelFn = void (*)(const void* src, void* dst, std::size_t n);

template <std::uint16_t (*Narrow)(float)>
void narrow_scalar(const void* src, void* dst, std::size_t n) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  for (std::size_t i = 0; i < n; ++i) {
    float x;
    std::memcpy(&x, s + 4 * i, 4);
    const std::uint16_t h = Narrow(x);
    std::memcpy(d + 2 * i, &h, 2);
  }
}

template <float (*Widen)(std::uint16_t)>
void widen_scalar(const void* src, void* dst, std::size_t n) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  for (std::size_t i = 0; i < n; ++i) {
    std::uint16_t h;
    std::memcpy(&h, s + 2 * i, 2);
    const float x = Widen(h);
    std::memcpy(d + 4 * i, &x, 4);
  }
}

constexpr KernelFn kScalarF32ToBf16 = narrow_scalar<float_to_bf16_bits>;
constexpr KernelFn kScalarBf16ToF32 = widen_scalar<bf16_bits_to_float>;
constexpr KernelFn kScalarF32ToF16 = narrow_scalar<float_to_f16_bits>;
constexpr KernelFn kScalarF16ToF32 = widen_scalar<f16_bits_to_float>;

#if STRATA_DTYPE_X86

// The rounding immediate: nearest-even regardless of MXCSR.RC.
constexpr int kRoundNearest = _MM_FROUND_TO_NEAREST_INT;

// ---- AVX2 + F16C ----
#define STRATA_TARGET_AVX2 __attribute__((target("avx2,f16c")))

STRATA_TARGET_AVX2 inline __m256i bf16_round_avx2(__m256i u) {
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
  const __m256i quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x0040));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}

STRATA_TARGET_AVX2 void f32_to_bf16_avx2(const void* src, void* dst, std::size_t n) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i a = bf16_round_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 4 * i)));
    const __m256i b = bf16_round_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 4 * i + 32)));
    // Every lane is <= 0xFFFF, so the unsigned-saturating pack is exact; it interleaves the
    // 128-bit halves, which the permute puts back in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 2 * i), packed);
  }
  kScalarF32ToBf16(s + 4 * i, d + 2 * i, n - i);
}

STRATA_TARGET_AVX2 void bf16_to_f32_avx2(const void* src, void* dst, std::size_t n) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * i));
    const __m256i x = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 4 * i), x);
  }
  kScalarBf16ToF32(s + 2 * i, d + 4 * i, n - i);
}

STRATA_TARGET_AVX2 void f32_to_f16_avx2(const void* src, void* dst, std::size_t n) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(reinterpret_cast<const float*>(s + 4 * i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 2 * i), _mm256_cvtps_ph(x, kRoundNearest));
  }
  kScalarF32ToF16(s + 4 * i, d + 2 * i, n - i);
}

STRATA_TARGET_AVX2 void f16_to_f32_avx2(const void* src, void* dst, std::size_t n) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * i));
    _mm256_storeu_ps(reinterpret_cast<float*>(d + 4 * i), _mm256_cvtph_ps(h));
  }
  kScalarF16ToF32(s + 2 * i, d + 4 * i, n - i);
}

// ---- AVX-512 F + BW + VL ----
// GCC 12 reports its own _mm512_undefined_* placeholders as maybe-uninitialized once inlined
// (GCC bug 105593); the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define STRATA_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

STRATA_TARGET_AVX512 inline __m512i bf16_round_avx512(__m512i u) {
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_or_epi32(rounded, nan, hi, _mm512_set1_epi32(0x0040));
}

// GCC folds an unaligned load into every instruction that uses the value (three per vector in
// bf16_round_avx512), which on a streaming input repeats the load of each missing cache line and
// nearly halved throughput on 64 MiB inputs (4.3 vs 7.7 Gelem/s). The empty asm keeps the loaded
// value in a register.
STRATA_TARGET_AVX512 inline __m512i load_once(const void* p) {
  __m512i v = _mm512_loadu_si512(p);
  asm("" : "+v"(v));
  return v;
}

STRATA_TARGET_AVX512 inline __mmask16 tail_mask(std::size_t count) {
  return static_cast<__mmask16>((1u << count) - 1u);
}

STRATA_TARGET_AVX512 void f32_to_bf16_avx512(const void* src, void* dst, std::size_t n) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i a = bf16_round_avx512(load_once(s + 4 * i));
    const __m512i b = bf16_round_avx512(load_once(s + 4 * i + 64));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 2 * i), _mm512_cvtepi32_epi16(a));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 2 * i + 32), _mm512_cvtepi32_epi16(b));
  }
  for (; i < n; i += 16) {
    const __mmask16 m = tail_mask(std::min<std::size_t>(16, n - i));
    const __m512i a = bf16_round_avx512(_mm512_maskz_loadu_epi32(m, s + 4 * i));
    _mm512_mask_cvtepi32_storeu_epi16(d + 2 * i, m, a);
  }
}

STRATA_TARGET_AVX512 void bf16_to_f32_avx512(const void* src, void* dst, std::size_t n) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 2 * i));
    _mm512_storeu_si512(d + 4 * i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, s + 2 * i);
    _mm512_mask_storeu_epi32(d + 4 * i, m, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

STRATA_TARGET_AVX512 void f32_to_f16_avx512(const void* src, void* dst, std::size_t n) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(s + 4 * i);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 2 * i), _mm512_cvtps_ph(x, kRoundNearest));
  }
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 x = _mm512_maskz_loadu_ps(m, s + 4 * i);
    _mm256_mask_storeu_epi16(d + 2 * i, m, _mm512_cvtps_ph(x, kRoundNearest));
  }
}

STRATA_TARGET_AVX512 void f16_to_f32_avx512(const void* src, void* dst, std::size_t n) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 2 * i));
    _mm512_storeu_ps(d + 4 * i, _mm512_cvtph_ps(h));
  }
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, s + 2 * i);
    _mm512_mask_storeu_ps(d + 4 * i, m, _mm512_cvtph_ps(h));
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // STRATA_DTYPE_X86

// Per path: the kernel from float to each type and from each type to float (null for f32 itself,
// which is a copy).
struct PathKernels {
  std::array<KernelFn, kDTypeCount> from_f32;
  std::array<KernelFn, kDTypeCount> to_f32;
};

constexpr PathKernels kScalarPath = {{nullptr, kScalarF32ToBf16, kScalarF32ToF16},
                                     {nullptr, kScalarBf16ToF32, kScalarF16ToF32}};
#if STRATA_DTYPE_X86
constexpr PathKernels kAvx2Path = {{nullptr, f32_to_bf16_avx2, f32_to_f16_avx2},
                                   {nullptr, bf16_to_f32_avx2, f16_to_f32_avx2}};
constexpr PathKernels kAvx512Path = {{nullptr, f32_to_bf16_avx512, f32_to_f16_avx512},
                                     {nullptr, bf16_to_f32_avx512, f16_to_f32_avx512}};
#endif

const PathKernels& path_kernels(SimdIsa isa) {
#if STRATA_DTYPE_X86
  switch (isa) {
    case SimdIsa::kAvx512:
      return kAvx512Path;
    case SimdIsa::kAvx2:
      return kAvx2Path;
    case SimdIsa::kScalar:
      break;
  }
#else
  (void)isa;
#endif
  return kScalarPath;
}

// Assumes valid dtypes and pointers.
void convert_on(const PathKernels& k, const void* src, DType from, void* dst, DType to, std::size_t n) {
  if (n == 0) return;
  const auto fi = static_cast<std::size_t>(from);
  const auto ti = static_cast<std::size_t>(to);
  if (from == to) {
    std::memcpy(dst, src, n * kDTypes[fi].size);
  } else if (from == DType::kF32) {
    k.from_f32[ti](src, dst, n);
  } else if (to == DType::kF32) {
    k.to_f32[fi](src, dst, n);
  } else {
    // Through float in cache-sized chunks; widening is exact, so there is one rounding only.
    constexpr std::size_t kChunk = 2048;
    alignas(64) float buffer[kChunk];
    const auto* s = static_cast<const unsigned char*>(src);
    auto* d = static_cast<unsigned char*>(dst);
    for (std::size_t i = 0; i < n; i += kChunk) {
      const std::size_t c = std::min(kChunk, n - i);
      k.to_f32[fi](s + i * kDTypes[fi].size, buffer, c);
      k.from_f32[ti](buffer, d + i * kDTypes[ti].size, c);
    }
  }
}

Status check_convert_args(const void* src, DType from, void* dst, DType to, std::size_t n) {
  if (!valid_dtype(from) || !valid_dtype(to)) {
    return invalid_argument("convert: dtype value " +
                            std::to_string(static_cast<int>(valid_dtype(from) ? to : from)) +
                            " is not a known dtype");
  }
  if (n == 0) return ok_status();
  if (src == nullptr || dst == nullptr) {
    return invalid_argument("convert " + std::string(to_string(from)) + " -> " + std::string(to_string(to)) +
                            " of " + std::to_string(n) +
                            " elements: " + (src == nullptr ? "source" : "destination") + " pointer is null");
  }
  if (n > SIZE_MAX / 4) {
    return invalid_argument("convert: element count " + std::to_string(n) + " overflows a byte size");
  }
  return ok_status();
}

// ---- CPU features and the selected path ---------------------------------------------------------

struct CpuFeatures {
  bool avx2 = false;
  bool avx512 = false;
};

CpuFeatures detect_cpu() {
  CpuFeatures f;
#if STRATA_DTYPE_X86
  __builtin_cpu_init();
  // __builtin_cpu_supports also checks that the OS saves the YMM/ZMM state (XGETBV).
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
  f.avx2 = __builtin_cpu_supports("avx2") && f16c;
  f.avx512 = f.avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
#endif
  return f;
}

const CpuFeatures& cpu() {
  static const CpuFeatures features = detect_cpu();
  return features;
}

// The path chosen for convert() without an explicit ISA; kUnset until chosen.
constexpr int kUnset = -1;
std::atomic<int> g_isa{kUnset};

constexpr std::string_view kIsaNames = "auto, scalar, avx2, avx512";

// "auto" or an ISA name -> an ISA this CPU supports. `source` is named in errors.
Result<SimdIsa> resolve_isa(std::string_view text, std::string_view source) {
  if (lower_trimmed(text) == "auto") return best_simd_isa();
  auto isa = parse_simd_isa(text);
  if (!isa.ok()) {
    return invalid_argument(std::string(source) + ": '" + std::string(text) + "' is not one of " +
                            std::string(kIsaNames));
  }
  if (!cpu_supports(*isa)) {
    return unavailable(std::string(source) + ": this CPU cannot run the " + std::string(to_string(*isa)) +
                       " path (" +
                       (*isa == SimdIsa::kAvx512 ? "needs AVX-512 F, BW and VL" : "needs AVX2 and F16C") +
                       "); the best it has is " + std::string(to_string(best_simd_isa())));
  }
  return *isa;
}

std::string isa_env_name() { return Options::env_name(describe(Option::kDtypeIsa)); }

SimdIsa isa_from_env() {
  const std::string env = isa_env_name();
  const char* value = std::getenv(env.c_str());
  if (value == nullptr) return best_simd_isa();
  auto isa = resolve_isa(value, env);
  if (isa.ok()) return *isa;
  STRATA_LOG(kWarn, kCore) << isa.status().message() << "; using the " << to_string(best_simd_isa())
                           << " path";
  return best_simd_isa();
}

}  // namespace

std::size_t dtype_size(DType dtype) {
  return valid_dtype(dtype) ? kDTypes[static_cast<std::size_t>(dtype)].size : 0;
}

std::string_view to_string(DType dtype) {
  return valid_dtype(dtype) ? kDTypes[static_cast<std::size_t>(dtype)].name : "unknown";
}

Result<DType> parse_dtype(std::string_view text) {
  const std::string t = lower_trimmed(text);
  std::string accepted;
  for (const auto& d : kDTypes) {
    if (t == d.name) return d.id;
    accepted += (accepted.empty() ? "" : ", ") + std::string(d.name);
    for (std::string_view alias : d.aliases) {
      if (alias.empty()) continue;
      if (t == alias) return d.id;
      accepted += ", " + std::string(alias);
    }
  }
  return invalid_argument("unknown dtype '" + std::string(text) + "' (accepted: " + accepted + ")");
}

std::string_view to_string(SimdIsa isa) {
  switch (isa) {
    case SimdIsa::kScalar:
      return "scalar";
    case SimdIsa::kAvx2:
      return "avx2";
    case SimdIsa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

Result<SimdIsa> parse_simd_isa(std::string_view text) {
  const std::string t = lower_trimmed(text);
  for (SimdIsa isa : {SimdIsa::kScalar, SimdIsa::kAvx2, SimdIsa::kAvx512}) {
    if (t == to_string(isa)) return isa;
  }
  return invalid_argument("SIMD ISA '" + std::string(text) + "' is not one of scalar, avx2, avx512");
}

bool cpu_supports(SimdIsa isa) {
  switch (isa) {
    case SimdIsa::kScalar:
      return true;
    case SimdIsa::kAvx2:
      return cpu().avx2;
    case SimdIsa::kAvx512:
      return cpu().avx512;
  }
  return false;
}

SimdIsa best_simd_isa() {
  if (cpu().avx512) return SimdIsa::kAvx512;
  if (cpu().avx2) return SimdIsa::kAvx2;
  return SimdIsa::kScalar;
}

SimdIsa dtype_isa() {
  int current = g_isa.load(std::memory_order_relaxed);
  if (current != kUnset) return static_cast<SimdIsa>(current);
  const int chosen = static_cast<int>(isa_from_env());
  // A concurrent set_dtype_isa() (or another first caller) wins; `current` then holds its value.
  if (g_isa.compare_exchange_strong(current, chosen, std::memory_order_relaxed))
    return static_cast<SimdIsa>(chosen);
  return static_cast<SimdIsa>(current);
}

Result<SimdIsa> set_dtype_isa(std::string_view name) {
  STRATA_ASSIGN_OR_RETURN(SimdIsa isa, resolve_isa(name, "dtype_isa"));
  g_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
  return isa;
}

Status load_dtype_isa_from_env() {
  const std::string env = isa_env_name();
  const char* value = std::getenv(env.c_str());
  if (value == nullptr) return ok_status();
  STRATA_ASSIGN_OR_RETURN(SimdIsa isa, resolve_isa(value, env));
  g_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
  return ok_status();
}

Status convert(const void* src, DType from, void* dst, DType to, std::size_t n) {
  STRATA_RETURN_IF_ERROR(check_convert_args(src, from, dst, to, n));
  convert_on(path_kernels(dtype_isa()), src, from, dst, to, n);
  return ok_status();
}

Status convert(const void* src, DType from, void* dst, DType to, std::size_t n, SimdIsa isa) {
  STRATA_RETURN_IF_ERROR(check_convert_args(src, from, dst, to, n));
  if (!cpu_supports(isa)) {
    return unavailable("convert: this CPU cannot run the " + std::string(to_string(isa)) + " path");
  }
  convert_on(path_kernels(isa), src, from, dst, to, n);
  return ok_status();
}

void convert(const float* src, bf16* dst, std::size_t n) {
  path_kernels(dtype_isa()).from_f32[static_cast<std::size_t>(DType::kBF16)](src, dst, n);
}
void convert(const bf16* src, float* dst, std::size_t n) {
  path_kernels(dtype_isa()).to_f32[static_cast<std::size_t>(DType::kBF16)](src, dst, n);
}
void convert(const float* src, f16* dst, std::size_t n) {
  path_kernels(dtype_isa()).from_f32[static_cast<std::size_t>(DType::kF16)](src, dst, n);
}
void convert(const f16* src, float* dst, std::size_t n) {
  path_kernels(dtype_isa()).to_f32[static_cast<std::size_t>(DType::kF16)](src, dst, n);
}

}  // namespace strata
