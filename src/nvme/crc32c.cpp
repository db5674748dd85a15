// CRC-32C (Castagnoli). The swap store checksums every block it writes and verifies every block
// it reads, on the I/O threads while other pieces are in flight, so the checksum must run far
// faster than the disk: the hardware path keeps three independent crc32 streams in flight (the
// instruction's latency is three times its throughput) and stitches them together with a
// linear "append K zero bytes" operator applied by table lookup.
//
// Conventions: the register is pre- and post-inverted (crc32c("123456789") == 0xE3069283);
// inside, `raw` functions work on the un-inverted register, where appending data is linear:
//   raw(s, A || B) = shift_|B|(raw(s, A)) ^ raw(0, B).
//
// Folding (the VPCLMULQDQ path). With the state s XORed into the first four bytes (M' = M with
// s in its first 32 bits), raw(s, M) = M'(x) * x^32 mod P: only M' mod P matters. A 128-bit
// block A followed by F more bits D... can be replaced by any 128-bit A' with
// A' = A * x^F + D (mod P). Stored little-endian, the reflected CRC puts the HIGH-degree half of
// A in the low qword (L, worth x^64) and the low-degree half in the high qword (H); a carry-less
// multiply of two reflected 64-bit values yields their product times x, in the same 128-bit
// reflected layout. Hence
//   A' = clmul(L, x^(F+63) mod P) ^ clmul(H, x^(F-1) mod P) ^ D,
// each product below 96 bits. Once everything is folded into one 128-bit A,
// raw(s, processed bytes) = A(x) * x^32 mod P = raw(0, A's 16 bytes): the crc32 instruction
// finishes the reduction and the tail.
#include "nvme/crc32c.hpp"

#include <array>
#include <cstring>

#include "strata/nvme.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <nmmintrin.h>
#define STRATA_CRC32C_X86 1
#else
#define STRATA_CRC32C_X86 0
#endif

namespace strata {
namespace nvme_detail {
namespace {

constexpr std::uint32_t kPoly = 0x82F63B78u;  // reflected 0x1EDC6F41

struct SliceTables {
  std::uint32_t t[8][256];
};

constexpr SliceTables make_slice_tables() {
  SliceTables s{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    s.t[0][i] = c;
  }
  for (std::uint32_t i = 0; i < 256; ++i) {
    for (int j = 1; j < 8; ++j) s.t[j][i] = (s.t[j - 1][i] >> 8) ^ s.t[0][s.t[j - 1][i] & 0xff];
  }
  return s;
}

constexpr SliceTables kSlice = make_slice_tables();

std::uint32_t raw_portable(std::uint32_t c, const unsigned char* p, std::size_t n) {
  while (n > 0 && (reinterpret_cast<std::uintptr_t>(p) & 7) != 0) {
    c = (c >> 8) ^ kSlice.t[0][(c ^ *p++) & 0xff];
    --n;
  }
  while (n >= 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);  // little-endian hosts only (x86-64, aarch64)
    std::uint32_t lo = static_cast<std::uint32_t>(w) ^ c;
    std::uint32_t hi = static_cast<std::uint32_t>(w >> 32);
    c = kSlice.t[7][lo & 0xff] ^ kSlice.t[6][(lo >> 8) & 0xff] ^ kSlice.t[5][(lo >> 16) & 0xff] ^
        kSlice.t[4][lo >> 24] ^ kSlice.t[3][hi & 0xff] ^ kSlice.t[2][(hi >> 8) & 0xff] ^
        kSlice.t[1][(hi >> 16) & 0xff] ^ kSlice.t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = (c >> 8) ^ kSlice.t[0][(c ^ *p++) & 0xff];
  return c;
}

// shift(s) = raw(s, K zero bytes), linear in s: four byte-indexed tables.
struct ShiftTables {
  std::array<std::array<std::uint32_t, 256>, 4> t{};
  std::uint32_t apply(std::uint32_t s) const {
    return t[0][s & 0xff] ^ t[1][(s >> 8) & 0xff] ^ t[2][(s >> 16) & 0xff] ^ t[3][s >> 24];
  }
};

ShiftTables make_shift_tables(std::size_t zero_bytes) {
  std::array<std::uint32_t, 32> basis{};
  for (int bit = 0; bit < 32; ++bit) {
    std::uint32_t c = 1u << bit;
    for (std::size_t i = 0; i < zero_bytes; ++i) c = (c >> 8) ^ kSlice.t[0][c & 0xff];
    basis[bit] = c;
  }
  ShiftTables s;
  for (int j = 0; j < 4; ++j) {
    for (std::uint32_t b = 0; b < 256; ++b) {
      std::uint32_t v = 0;
      for (int bit = 0; bit < 8; ++bit) {
        if ((b >> bit) & 1) v ^= basis[8 * j + bit];
      }
      s.t[j][b] = v;
    }
  }
  return s;
}

// Stream lengths of the two interleaving levels: rounds of 3 x 4 KiB, then 3 x 256 B.
constexpr std::size_t kLongStream = 4096;
constexpr std::size_t kShortStream = 256;

const ShiftTables& long_shift() {
  static const ShiftTables t = make_shift_tables(kLongStream);
  return t;
}
const ShiftTables& short_shift() {
  static const ShiftTables t = make_shift_tables(kShortStream);
  return t;
}

#if STRATA_CRC32C_X86
// Rounds of three `stream`-byte streams while at least 3 x stream bytes remain.
__attribute__((target("sse4.2"))) std::uint64_t three_way(std::uint64_t c, const unsigned char*& p,
                                                          std::size_t& n, std::size_t stream,
                                                          const ShiftTables& shift) {
  while (n >= 3 * stream) {
    std::uint64_t c0 = c, c1 = 0, c2 = 0;
    const unsigned char* end = p + stream;
    for (; p < end; p += 8) {
      std::uint64_t w0, w1, w2;
      std::memcpy(&w0, p, 8);
      std::memcpy(&w1, p + stream, 8);
      std::memcpy(&w2, p + 2 * stream, 8);
      c0 = _mm_crc32_u64(c0, w0);
      c1 = _mm_crc32_u64(c1, w1);
      c2 = _mm_crc32_u64(c2, w2);
    }
    std::uint32_t r = shift.apply(static_cast<std::uint32_t>(c0)) ^ static_cast<std::uint32_t>(c1);
    c = shift.apply(r) ^ static_cast<std::uint32_t>(c2);
    p += 2 * stream;
    n -= 3 * stream;
  }
  return c;
}

__attribute__((target("sse4.2"))) std::uint32_t raw_sse42(std::uint32_t c32, const unsigned char* p,
                                                          std::size_t n) {
  std::uint64_t c = c32;
  while (n > 0 && (reinterpret_cast<std::uintptr_t>(p) & 7) != 0) {
    c = _mm_crc32_u8(static_cast<std::uint32_t>(c), *p++);
    --n;
  }
  c = three_way(c, p, n, kLongStream, long_shift());
  c = three_way(c, p, n, kShortStream, short_shift());
  while (n >= 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = _mm_crc32_u8(static_cast<std::uint32_t>(c), *p++);
  return static_cast<std::uint32_t>(c);
}

// x^t mod P as a reflected 64-bit clmul operand (coefficient of x^d at bit 63 - d).
std::uint64_t fold_constant(unsigned t) {
  std::uint64_t r = 1;  // normal order: bit d is x^d
  for (unsigned i = 0; i < t; ++i) {
    r <<= 1;
    if (r & (1ull << 32)) r ^= 0x11EDC6F41ull;  // P = x^32 + 0x1EDC6F41
  }
  std::uint64_t out = 0;
  for (int d = 0; d < 32; ++d) {
    if ((r >> d) & 1) out |= 1ull << (63 - d);
  }
  return out;
}

struct FoldConstants {
  // (x^(F+63), x^(F-1)) mod P for fold distances F (bits).
  std::uint64_t by2048[2], by512[2], by384[2], by256[2], by128[2];
  FoldConstants() {
    auto set = [](std::uint64_t* k, unsigned f) {
      k[0] = fold_constant(f + 63);
      k[1] = fold_constant(f - 1);
    };
    set(by2048, 2048);
    set(by512, 512);
    set(by384, 384);
    set(by256, 256);
    set(by128, 128);
  }
};

const FoldConstants& fold_constants() {
  static const FoldConstants k;
  return k;
}

// GCC 12 flags the deliberately undefined lanes inside avx512fintrin.h (_mm512_undefined_*).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#define STRATA_VPCLMUL_TARGET __attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2")))

STRATA_VPCLMUL_TARGET inline __m512i fold512(__m512i acc, __m512i k, __m512i data) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(acc, k, 0x00),
                                   _mm512_clmulepi64_epi128(acc, k, 0x11), data, 0x96);  // three-way xor
}

STRATA_VPCLMUL_TARGET inline __m512i broadcast(const std::uint64_t* k) {
  return _mm512_broadcast_i32x4(_mm_set_epi64x(static_cast<long long>(k[1]), static_cast<long long>(k[0])));
}

STRATA_VPCLMUL_TARGET inline __m128i fold128(__m128i acc, const std::uint64_t* k, __m128i data) {
  __m128i kk = _mm_set_epi64x(static_cast<long long>(k[1]), static_cast<long long>(k[0]));
  return _mm_xor_si128(
      _mm_xor_si128(_mm_clmulepi64_si128(acc, kk, 0x00), _mm_clmulepi64_si128(acc, kk, 0x11)), data);
}

// Needs bytes >= 256.
STRATA_VPCLMUL_TARGET std::uint32_t raw_vpclmul(std::uint32_t c, const unsigned char* p, std::size_t n) {
  const FoldConstants& fc = fold_constants();
  const __m512i k2048 = broadcast(fc.by2048);
  const __m512i k512 = broadcast(fc.by512);
  __m512i x0 =
      _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(c))));
  __m512i x1 = _mm512_loadu_si512(p + 64);
  __m512i x2 = _mm512_loadu_si512(p + 128);
  __m512i x3 = _mm512_loadu_si512(p + 192);
  p += 256;
  n -= 256;
  while (n >= 256) {
    x0 = fold512(x0, k2048, _mm512_loadu_si512(p));
    x1 = fold512(x1, k2048, _mm512_loadu_si512(p + 64));
    x2 = fold512(x2, k2048, _mm512_loadu_si512(p + 128));
    x3 = fold512(x3, k2048, _mm512_loadu_si512(p + 192));
    p += 256;
    n -= 256;
  }
  __m512i x = fold512(x0, k512, x1);
  x = fold512(x, k512, x2);
  x = fold512(x, k512, x3);
  while (n >= 64) {
    x = fold512(x, k512, _mm512_loadu_si512(p));
    p += 64;
    n -= 64;
  }
  // Four 128-bit lanes, earliest first: l0 * x^384 + l1 * x^256 + l2 * x^128 + l3.
  __m128i l0 = _mm512_extracti32x4_epi32(x, 0), l1 = _mm512_extracti32x4_epi32(x, 1);
  __m128i l2 = _mm512_extracti32x4_epi32(x, 2), l3 = _mm512_extracti32x4_epi32(x, 3);
  __m128i a = fold128(l0, fc.by384, fold128(l1, fc.by256, fold128(l2, fc.by128, l3)));
  std::uint64_t crc = _mm_crc32_u64(0, static_cast<std::uint64_t>(_mm_cvtsi128_si64(a)));
  crc = _mm_crc32_u64(crc, static_cast<std::uint64_t>(_mm_extract_epi64(a, 1)));
  return raw_sse42(static_cast<std::uint32_t>(crc), p, n);
}
#pragma GCC diagnostic pop
#endif

}  // namespace

bool crc32c_vpclmul_available() {
#if STRATA_CRC32C_X86
  static const bool available = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                                __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul") &&
                                __builtin_cpu_supports("sse4.2");
  return available;
#else
  return false;
#endif
}

std::uint32_t crc32c_vpclmul(const void* data, std::size_t bytes, std::uint32_t crc) {
#if STRATA_CRC32C_X86
  if (bytes < 256) return ~raw_sse42(~crc, static_cast<const unsigned char*>(data), bytes);
  return ~raw_vpclmul(~crc, static_cast<const unsigned char*>(data), bytes);
#else
  return crc32c_portable(data, bytes, crc);
#endif
}

std::uint32_t crc32c_portable(const void* data, std::size_t bytes, std::uint32_t crc) {
  return ~raw_portable(~crc, static_cast<const unsigned char*>(data), bytes);
}

bool crc32c_sse42_available() {
#if STRATA_CRC32C_X86
  static const bool available = __builtin_cpu_supports("sse4.2");
  return available;
#else
  return false;
#endif
}

std::uint32_t crc32c_sse42(const void* data, std::size_t bytes, std::uint32_t crc) {
#if STRATA_CRC32C_X86
  return ~raw_sse42(~crc, static_cast<const unsigned char*>(data), bytes);
#else
  return crc32c_portable(data, bytes, crc);
#endif
}

}  // namespace nvme_detail

std::uint32_t crc32c(const void* data, std::size_t bytes, std::uint32_t crc) {
  if (bytes >= 1024 && nvme_detail::crc32c_vpclmul_available())
    return nvme_detail::crc32c_vpclmul(data, bytes, crc);
  if (nvme_detail::crc32c_sse42_available()) return nvme_detail::crc32c_sse42(data, bytes, crc);
  return nvme_detail::crc32c_portable(data, bytes, crc);
}

bool crc32c_is_hardware() { return nvme_detail::crc32c_sse42_available(); }

}  // namespace strata
