#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "strata/alloc.hpp"
#include "strata/log.hpp"
#include "strata/options.hpp"

namespace strata {

Result<std::unique_ptr<PinnedPool>> PinnedPool::adopt(void* base, std::uint64_t bytes, ReleaseFn release) {
  if (base == nullptr || bytes < kIoAlignment || reinterpret_cast<std::uintptr_t>(base) % kIoAlignment != 0) {
    return invalid_argument("pinned pool: region must be non-null, 4 KiB aligned and at least 4 KiB");
  }
  Arena::Config cfg;
  cfg.name = "pinned";
  cfg.capacity = bytes & ~(kIoAlignment - 1);
  cfg.alignment = kIoAlignment;
  cfg.base = base;
  cfg.origin = MemoryOrigin::kPinnedPool;
  STRATA_ASSIGN_OR_RETURN(auto arena, Arena::create(std::move(cfg)));
  std::unique_ptr<PinnedPool> pool(new PinnedPool());
  pool->arena_ = std::move(arena);
  pool->base_ = base;
  pool->bytes_ = bytes;
  pool->locked_ = true;
  pool->release_ = std::move(release);
  return pool;
}

Result<std::unique_ptr<PinnedPool>> PinnedPool::create_host(std::uint64_t bytes, bool huge_pages) {
  // The region is 2 MiB aligned and asks for transparent huge pages before it is locked: a
  // 1 MiB direct-I/O transfer from huge-page memory stays one request to the block layer,
  // where 4 KiB pages split it into many (measured in docs/performance.md, NVMe section).
  constexpr std::uint64_t kHuge = 2ull << 20;
  bytes = align_up(std::max<std::uint64_t>(bytes, kIoAlignment), kIoAlignment);
  const std::uint64_t mapped = bytes + kHuge;
  void* raw = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    return out_of_memory("pinned pool: mmap of " + format_bytes(bytes) + " failed: " + std::strerror(errno) +
                         " (lower pinned_memory / STRATA_PINNED_MEMORY)");
  }
  auto* p = reinterpret_cast<std::byte*>(align_up(reinterpret_cast<std::uintptr_t>(raw), kHuge));
  // Return the unaligned head and the unused tail to the OS.
  auto head = static_cast<std::uint64_t>(p - static_cast<std::byte*>(raw));
  if (head > 0) ::munmap(raw, head);
  std::uint64_t tail = mapped - head - bytes;
  if (tail > 0) ::munmap(p + bytes, tail);
  if (huge_pages && ::madvise(p, bytes, MADV_HUGEPAGE) != 0) {
    STRATA_LOG_ONCE(kDebug, kAlloc) << "pinned pool: no transparent huge pages (" << std::strerror(errno) << ")";
  }
  bool locked = ::mlock(p, bytes) == 0;
  if (!locked) {
    std::memset(p, 0, bytes);  // at least fault it in now rather than mid-transfer
    STRATA_LOG_ONCE(kInfo, kAlloc) << "pinned pool: mlock of " << format_bytes(bytes) << " refused ("
                                   << std::strerror(errno) << "); the pool stays pageable";
  }
  auto pool = adopt(p, bytes, [](void* base, std::uint64_t n) { ::munmap(base, n); });
  if (!pool.ok()) {
    ::munmap(p, bytes);
    return pool.status();
  }
  (*pool)->locked_ = locked;
  return pool;
}

PinnedPool::~PinnedPool() {
  arena_.reset();
  if (release_ && base_ != nullptr) release_(base_, bytes_);
}

Result<ArenaBuffer> PinnedPool::allocate(std::uint64_t bytes, std::string_view tag) {
  auto h = arena_->allocate(bytes, Lifetime::kFixed, tag);
  if (!h.ok()) return h.status().with_context("pinned_memory (STRATA_PINNED_MEMORY) pool");
  return ArenaBuffer(arena_.get(), *h);
}

bool PinnedPool::contains(const void* p, std::uint64_t bytes) const {
  auto* b = static_cast<const std::byte*>(base_);
  auto* q = static_cast<const std::byte*>(p);
  return q >= b && q + bytes <= b + bytes_;
}

}  // namespace strata
