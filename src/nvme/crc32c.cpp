// CRC-32C (Castagnoli). The swap store checksums every block it writes and verifies every block
// it reads, on the I/O threads while other pieces are in flight, so the checksum must run far
// faster than the disk: the hardware path keeps three independent crc32 streams in flight (the
// instruction's latency is three times its throughput) and stitches them together with a
// linear "append K zero bytes" operator applied by table lookup.
//
// Conventions: the register is pre- and post-inverted (crc32c("123456789") == 0xE3069283);
// inside, `raw` functions work on the un-inverted register, where appending data is linear:
//   raw(s, A || B) = shift_|B|(raw(s, A)) ^ raw(0, B).
#include "nvme/crc32c.hpp"

#include <array>
#include <cstring>

#include "strata/nvme.hpp"

#if defined(__x86_64__) || defined(__i386__)
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
#endif

}  // namespace

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
  if (nvme_detail::crc32c_sse42_available()) return nvme_detail::crc32c_sse42(data, bytes, crc);
  return nvme_detail::crc32c_portable(data, bytes, crc);
}

bool crc32c_is_hardware() { return nvme_detail::crc32c_sse42_available(); }

}  // namespace strata
