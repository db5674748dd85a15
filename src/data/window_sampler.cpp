// WindowSampler (data.hpp): training windows by seed, in O(1) per window and no table.
#include "strata/data.hpp"

namespace strata {
namespace {

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The key of epoch e's order, and the seed of its offset.
std::uint64_t epoch_key(std::uint64_t seed, std::uint64_t epoch) {
  return splitmix64(seed ^ splitmix64(epoch + 1));
}

}  // namespace

// A balanced Feistel network on [0, 2^bits) is a bijection whatever its round function; walking
// the cycle of x until it falls below n ("cycle walking") restricts it to a bijection on [0, n).
// 2^bits < 4n, so the walk takes under 4 rounds on average.
std::uint64_t permute_index(std::uint64_t x, std::uint64_t n, std::uint64_t key) {
  if (n <= 1) return 0;
  int bits = 2;
  while (bits < 62 && (1ull << bits) < n) ++bits;
  bits += bits & 1;
  const int half = bits / 2;
  const std::uint64_t mask = (1ull << half) - 1;
  std::uint64_t y = x;
  do {
    std::uint64_t l = y >> half, r = y & mask;
    for (std::uint64_t round = 0; round < 4; ++round) {
      const std::uint64_t f = splitmix64(r ^ key ^ (round * 0xD1B54A32D192ED03ull)) & mask;
      const std::uint64_t next_r = l ^ f;
      l = r;
      r = next_r;
    }
    y = (l << half) | r;
  } while (y >= n);
  return y;
}

Result<WindowSampler> WindowSampler::create(const TokenDataset& data, std::int64_t T, std::uint64_t seed) {
  if (T < 1)
    return invalid_argument("window sampler: sequence length " + std::to_string(T) + " must be at least 1");
  const std::uint64_t n = data.size();
  if (n < static_cast<std::uint64_t>(T) + 1) {
    return invalid_argument("token dataset " + data.describe() + " holds " + std::to_string(n) +
                            " tokens; a sequence length of " + std::to_string(T) + " needs at least " +
                            std::to_string(T + 1));
  }
  WindowSampler s;
  s.data_ = &data;
  s.T_ = T;
  s.seed_ = seed;
  s.windows_ = (n - 1) / static_cast<std::uint64_t>(T);
  s.slack_ = (n - 1) - s.windows_ * static_cast<std::uint64_t>(T);
  return s;
}

std::uint64_t WindowSampler::window_start(std::uint64_t index) const {
  const std::uint64_t epoch = index / windows_;
  const std::uint64_t key = epoch_key(seed_, epoch);
  const std::uint64_t offset = splitmix64(key ^ 0x5851F42D4C957F2Dull) % (slack_ + 1);
  return offset + permute_index(index % windows_, windows_, key) * static_cast<std::uint64_t>(T_);
}

Status WindowSampler::batch(std::uint64_t first, std::int64_t B, std::vector<std::int32_t>& inputs,
                            std::vector<std::int32_t>& targets) const {
  const auto T = static_cast<std::size_t>(T_);
  inputs.resize(static_cast<std::size_t>(B) * T);
  targets.resize(inputs.size());
  for (std::int64_t b = 0; b < B; ++b) {
    const std::uint64_t start = window_start(first + static_cast<std::uint64_t>(b));
    const std::size_t row = static_cast<std::size_t>(b) * T;
    STRATA_RETURN_IF_ERROR(data_->read(start, std::span<std::int32_t>(inputs.data() + row, T)));
    STRATA_RETURN_IF_ERROR(data_->read(start + 1, std::span<std::int32_t>(targets.data() + row, T)));
  }
  return ok_status();
}

}  // namespace strata
