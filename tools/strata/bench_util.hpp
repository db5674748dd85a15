// Helpers shared by the `strata bench` commands, so that every benchmark summarises its
// repetitions the same way.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace strata::cli {

// The median of `v`: the middle value, or the mean of the two middle values for an even
// count; 0 for an empty v.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Bytes of last-level cache on this machine, summed over its distinct instances (a processor
// with several L3 slices, or several sockets, has several), from /sys/devices/system/cpu; falls
// back to sysconf(_SC_LEVEL3_CACHE_SIZE), then 0 when neither knows. Benchmarks of memory
// bandwidth use it to refuse working sets that would be served from cache.
std::uint64_t last_level_cache_bytes();

}  // namespace strata::cli
