// Best-fit extent allocation with coalescing over the swap store's logical space.
#include <algorithm>

#include "nvme/swap_internal.hpp"

namespace strata::nvme_detail {

ExtentAllocator::ExtentAllocator(std::uint64_t capacity) : capacity_(capacity) {
  if (capacity > 0) insert_free(0, capacity);
}

void ExtentAllocator::insert_free(std::uint64_t off, std::uint64_t len) {
  free_.emplace(off, len);
  by_size_.emplace(len, off);
  free_bytes_ += len;
}

void ExtentAllocator::erase_free(std::map<std::uint64_t, std::uint64_t>::iterator it) {
  by_size_.erase({it->second, it->first});
  free_bytes_ -= it->second;
  free_.erase(it);
}

std::uint64_t ExtentAllocator::largest_free() const {
  return by_size_.empty() ? 0 : by_size_.rbegin()->first;
}

bool ExtentAllocator::take(const Extent& e) {
  if (e.length == 0) return true;
  auto it = free_.upper_bound(e.offset);
  if (it == free_.begin()) return false;
  --it;
  std::uint64_t off = it->first, len = it->second;
  if (e.offset < off || e.offset + e.length > off + len) return false;
  erase_free(it);
  if (e.offset > off) insert_free(off, e.offset - off);
  if (e.offset + e.length < off + len) insert_free(e.offset + e.length, off + len - e.offset - e.length);
  return true;
}

std::optional<std::vector<Extent>> ExtentAllocator::allocate(std::uint64_t bytes, std::uint64_t granule) {
  std::vector<Extent> out;
  if (bytes == 0) return out;
  if (bytes > free_bytes_) return std::nullopt;
  auto fit = by_size_.lower_bound({bytes, 0});
  if (fit != by_size_.end()) {
    Extent e{fit->second, bytes};
    take(e);
    out.push_back(e);
    return out;
  }
  // No single free extent is large enough: largest first, each but the last cut to granules.
  std::uint64_t left = bytes;
  for (auto it = by_size_.rbegin(); it != by_size_.rend() && left > 0; ++it) {
    std::uint64_t len = it->first;
    std::uint64_t use = len >= left ? left : (len / granule) * granule;
    if (use == 0) continue;
    out.push_back({it->second, use});
    left -= use;
  }
  if (left > 0) return std::nullopt;
  for (const auto& e : out) take(e);
  return out;
}

void ExtentAllocator::free(const Extent& e) {
  if (e.length == 0) return;
  std::uint64_t off = e.offset, len = e.length;
  auto next = free_.lower_bound(off);
  if (next != free_.end() && next->first == off + len) {
    len += next->second;
    erase_free(next);
  }
  auto prev = free_.lower_bound(off);
  if (prev != free_.begin()) {
    --prev;
    if (prev->first + prev->second == off) {
      off = prev->first;
      len += prev->second;
      erase_free(prev);
    }
  }
  insert_free(off, len);
}

Status ExtentAllocator::is_valid() const {
  std::uint64_t sum = 0, end = 0;
  bool first = true;
  for (const auto& [off, len] : free_) {
    if (len == 0 || off % kExtentAlign != 0 || len % kExtentAlign != 0) {
      return internal_error("swap free list: extent at " + std::to_string(off) + " of " +
                            std::to_string(len) + " bytes is empty or not 4 KiB aligned");
    }
    if (!first && off <= end) {
      return internal_error("swap free list: extent at " + std::to_string(off) +
                            (off < end ? " overlaps" : " touches") + " the previous one (not coalesced)");
    }
    if (off + len > capacity_)
      return internal_error("swap free list: extent at " + std::to_string(off) + " ends past capacity");
    if (by_size_.count({len, off}) == 0)
      return internal_error("swap free list: size index misses extent at " + std::to_string(off));
    first = false;
    end = off + len;
    sum += len;
  }
  if (by_size_.size() != free_.size()) return internal_error("swap free list: size index has extra entries");
  if (sum != free_bytes_) return internal_error("swap free list: free byte count is off");
  return ok_status();
}

}  // namespace strata::nvme_detail
