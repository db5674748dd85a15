// crc32c: both implementations against the published CRC-32C check values (RFC 3720 B.4 and
// the "123456789" check), and against each other over every length and misalignment that
// exercises the three-way interleave, its tails and the seed chaining.
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "harness/harness.hpp"
#include "nvme/crc32c.hpp"
#include "strata/nvme.hpp"

namespace strata {
namespace {

using nvme_detail::crc32c_portable;
using nvme_detail::crc32c_sse42;
using nvme_detail::crc32c_sse42_available;
using nvme_detail::crc32c_vpclmul;
using nvme_detail::crc32c_vpclmul_available;

struct Vector {
  std::vector<unsigned char> data;
  std::uint32_t crc;
};

std::vector<Vector> known_vectors() {
  std::vector<Vector> v;
  const char* check = "123456789";
  v.push_back({std::vector<unsigned char>(check, check + 9), 0xE3069283u});
  v.push_back({std::vector<unsigned char>(32, 0x00), 0x8A9136AAu});
  v.push_back({std::vector<unsigned char>(32, 0xFF), 0x62A8AB43u});
  std::vector<unsigned char> inc(32), dec(32);
  for (int i = 0; i < 32; ++i) {
    inc[i] = static_cast<unsigned char>(i);
    dec[i] = static_cast<unsigned char>(31 - i);
  }
  v.push_back({inc, 0x46DD794Eu});
  v.push_back({dec, 0x113FDB5Cu});
  v.push_back({{}, 0u});
  return v;
}

TEST(Crc32c, PortableMatchesKnownVectors) {
  for (const auto& v : known_vectors()) {
    EXPECT_EQ(crc32c_portable(v.data.data(), v.data.size(), 0), v.crc) << "length " << v.data.size();
  }
}

TEST(Crc32c, HardwareMatchesKnownVectors) {
  if (!crc32c_sse42_available()) GTEST_SKIP() << "this CPU has no SSE4.2 crc32 instruction";
  for (const auto& v : known_vectors()) {
    EXPECT_EQ(crc32c_sse42(v.data.data(), v.data.size(), 0), v.crc) << "length " << v.data.size();
  }
  EXPECT_TRUE(crc32c_is_hardware());
}

TEST(Crc32c, FoldingMatchesKnownVectors) {
  if (!crc32c_vpclmul_available()) GTEST_SKIP() << "this CPU has no AVX-512 VPCLMULQDQ";
  for (const auto& v : known_vectors()) {
    EXPECT_EQ(crc32c_vpclmul(v.data.data(), v.data.size(), 0), v.crc) << "length " << v.data.size();
  }
  // Long inputs (the folding path proper) against the table-driven reference.
  std::vector<unsigned char> zeros(4096, 0), ones(4096, 0xFF);
  EXPECT_EQ(crc32c_vpclmul(zeros.data(), zeros.size(), 0), crc32c_portable(zeros.data(), zeros.size(), 0));
  EXPECT_EQ(crc32c_vpclmul(ones.data(), ones.size(), 0), crc32c_portable(ones.data(), ones.size(), 0));
}

TEST(Crc32c, FoldingEqualsPortableForAllLengthsAndAlignments) {
  if (!crc32c_vpclmul_available()) GTEST_SKIP() << "this CPU has no AVX-512 VPCLMULQDQ";
  std::mt19937_64 rng(43);
  std::vector<unsigned char> buf((1 << 16) + 128);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  std::vector<std::size_t> lengths;
  for (std::size_t n = 0; n <= 1200; ++n) lengths.push_back(n);  // every fold/tail combination
  for (std::size_t base : {4096ul, 65536ul}) {
    for (int d = -70; d <= 70; d += 7) lengths.push_back(base + d);
  }
  for (std::size_t misalign : {0ul, 1ul, 7ul, 13ul, 63ul}) {
    for (std::size_t n : lengths) {
      if (n + misalign > buf.size()) continue;
      std::uint32_t seed = static_cast<std::uint32_t>(rng());
      ASSERT_EQ(crc32c_vpclmul(buf.data() + misalign, n, seed),
                crc32c_portable(buf.data() + misalign, n, seed))
          << "length " << n << " misalignment " << misalign;
    }
  }
}

TEST(Crc32c, PublicEntryPointMatchesKnownVectors) {
  for (const auto& v : known_vectors()) EXPECT_EQ(crc32c(v.data.data(), v.data.size()), v.crc);
}

TEST(Crc32c, HardwareEqualsPortableForAllLengthsAndAlignments) {
  if (!crc32c_sse42_available()) GTEST_SKIP() << "this CPU has no SSE4.2 crc32 instruction";
  std::mt19937_64 rng(42);
  std::vector<unsigned char> buf(3 * 4096 * 3 + 64);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  // Every length across the short-stream rounds, then lengths around the long-stream rounds.
  std::vector<std::size_t> lengths;
  for (std::size_t n = 0; n <= 2 * 768 + 17; ++n) lengths.push_back(n);
  for (std::size_t base : {3 * 4096ul, 2 * 3 * 4096ul, 3 * 4096ul + 768ul}) {
    for (int d = -9; d <= 9; ++d) lengths.push_back(base + d);
  }
  lengths.push_back(buf.size() - 8);
  for (std::size_t misalign = 0; misalign < 8; ++misalign) {
    for (std::size_t n : lengths) {
      if (n + misalign > buf.size()) continue;
      std::uint32_t seed = static_cast<std::uint32_t>(rng());
      ASSERT_EQ(crc32c_sse42(buf.data() + misalign, n, seed), crc32c_portable(buf.data() + misalign, n, seed))
          << "length " << n << " misalignment " << misalign;
    }
  }
}

TEST(Crc32c, ChainingEqualsOneShot) {
  std::mt19937_64 rng(7);
  std::vector<unsigned char> buf(200000);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  std::uint32_t whole = crc32c(buf.data(), buf.size());
  for (std::size_t cut : {1ul, 4095ul, 4097ul, 65536ul, 123457ul}) {
    std::uint32_t c = crc32c(buf.data(), cut);
    c = crc32c(buf.data() + cut, buf.size() - cut, c);
    EXPECT_EQ(c, whole) << "cut at " << cut;
    std::uint32_t p = crc32c_portable(buf.data(), cut, 0);
    EXPECT_EQ(crc32c_portable(buf.data() + cut, buf.size() - cut, p), whole);
  }
}

TEST(Crc32c, DetectsEverySingleBitFlip) {
  std::vector<unsigned char> buf(4096 * 3 + 100, 0x5A);
  std::uint32_t good = crc32c(buf.data(), buf.size());
  for (std::size_t i = 0; i < buf.size(); i += 97) {
    for (int bit = 0; bit < 8; bit += 3) {
      buf[i] ^= static_cast<unsigned char>(1u << bit);
      EXPECT_NE(crc32c(buf.data(), buf.size()), good) << "byte " << i << " bit " << bit;
      buf[i] ^= static_cast<unsigned char>(1u << bit);
    }
  }
}

}  // namespace
}  // namespace strata
