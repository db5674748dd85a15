// crc32c implementations, exposed separately so tests can check each against known vectors;
// everything else calls strata::crc32c(), which picks the hardware one when the CPU has it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::nvme_detail {

// Table-driven (slicing-by-8); runs anywhere.
std::uint32_t crc32c_portable(const void* data, std::size_t bytes, std::uint32_t crc);
// SSE4.2 crc32 instruction, three interleaved streams combined with precomputed shift tables.
// Only call when crc32c_sse42_available().
std::uint32_t crc32c_sse42(const void* data, std::size_t bytes, std::uint32_t crc);
bool crc32c_sse42_available();
// AVX-512 VPCLMULQDQ folding (four 512-bit accumulators), finished with the crc32 instruction.
// Only call when crc32c_vpclmul_available().
std::uint32_t crc32c_vpclmul(const void* data, std::size_t bytes, std::uint32_t crc);
bool crc32c_vpclmul_available();

}  // namespace strata::nvme_detail
