// Strata's allocators. Memory never fragments because every byte of accelerator memory the
// runtime uses comes from one contiguous Arena per device, carved by a plan made up front, and
// host staging memory comes from a PinnedPool built on the same Arena. docs/memory-model.md
// defines the regions, block states and the invariants that Arena::is_valid() checks.
//
// Thread safety: Arena and PinnedPool are internally locked; every method may be called from
// any thread. Pointers from ptr() stay valid until the block is freed or, for relocatable
// blocks, until the next compact().
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "strata/status.hpp"

namespace strata {

// Where a buffer's bytes came from; every buffer records it.
enum class MemoryOrigin : std::uint8_t {
  kDeviceArena,  // a block in a device's arena
  kPinnedPool,   // a block in a pinned host pool (page-locked, DMA-able, 4 KiB aligned)
  kIoBuffer,     // a standalone 4 KiB-aligned host buffer for direct I/O
  kSystem,       // ordinary pageable host memory owned elsewhere
};
std::string_view to_string(MemoryOrigin origin);

// Dynamic blocks are either fixed (address stable until freed) or relocatable (compact() may
// move them; find them again through their handle).
enum class Lifetime : std::uint8_t { kFixed, kRelocatable };

// A stable name for a dynamic block. Generation-checked: a handle to a freed block is rejected.
struct ArenaHandle {
  std::uint32_t index = UINT32_MAX;
  std::uint32_t generation = 0;
  bool valid() const { return index != UINT32_MAX; }
  friend bool operator==(const ArenaHandle&, const ArenaHandle&) = default;
};

// A region planned at the start of the arena, before the dynamic part.
//  - persistent: `bytes` carved by bump allocation for state that lives as long as the arena
//    (parameters, gradients, master weights); blocks are never freed one by one.
//  - slots: `slot_count` fixed-size slots of `slot_bytes` (prefetch buffers, gradient buckets),
//    acquired and released by index.
struct RegionSpec {
  std::string name;
  std::uint64_t bytes = 0;        // persistent regions
  std::uint64_t slot_bytes = 0;   // slot regions
  std::uint32_t slot_count = 0;   // > 0 makes this a slot region
  bool is_slots() const { return slot_count > 0; }
};

struct ArenaStats {
  std::uint64_t capacity = 0;            // bytes the arena manages
  std::uint64_t reserved_bytes = 0;      // planned regions + high-water mark of the dynamic part
  std::uint64_t live_bytes = 0;          // bytes in use: persistent blocks + held slots + live dynamic blocks
  std::uint64_t peak_live_bytes = 0;
  std::uint64_t largest_free_block = 0;  // largest dynamic allocation that would succeed without compaction
  std::uint64_t free_bytes = 0;          // dynamic bytes free, below capacity
  double fragmentation = 0.0;            // 1 - largest_free_block / free_bytes (0 when nothing is free)
  std::uint64_t allocations = 0;         // dynamic allocate() calls that succeeded
  std::uint64_t frees = 0;
  std::uint64_t compactions = 0;
  std::uint64_t bytes_moved = 0;         // by compaction
  // Dynamic allocations that raised the high-water mark: the footprint grew onto bytes never
  // used before (on the cpu backend's lazily mapped memory, pages the OS must now provide).
  std::uint64_t growths = 0;
};

// One contiguous range of `capacity` bytes, managed by offset. The memory itself (if any) is
// owned by whoever created the arena; `base` may be null for pure accounting (planning).
class Arena {
 public:
  // Moves `bytes` from src to dst offsets (ranges may overlap, dst < src). Used by compact();
  // device arenas pass a device-to-device copy. Null means memmove on `base`.
  using MoveFn = std::function<Status(std::uint64_t dst, std::uint64_t src, std::uint64_t bytes)>;

  struct Config {
    std::string name = "arena";   // named in every error
    std::uint64_t capacity = 0;
    std::uint64_t alignment = 256;  // power of two; every block offset and size is a multiple
    void* base = nullptr;
    MoveFn mover;
    MemoryOrigin origin = MemoryOrigin::kDeviceArena;
    // When an allocation does not fit below the high-water mark but would after compaction,
    // compact instead of raising the mark. Off for arenas whose blocks may be in use by
    // in-flight work the arena cannot see (the owner then calls compact() at a safe point).
    bool compact_on_demand = false;
  };

  static Result<std::unique_ptr<Arena>> create(Config config);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  const std::string& name() const;
  void* base() const;
  MemoryOrigin origin() const;

  // Lays out `regions` at the start of the arena. Allowed once, while no dynamic block is live.
  // Fails (naming the region and the shortfall) if they do not fit.
  Status plan(const std::vector<RegionSpec>& regions);

  // Carves `bytes` from persistent region `region`; returns its offset.
  Result<std::uint64_t> allocate_persistent(std::string_view region, std::uint64_t bytes);
  // Slot regions: acquire a free slot (its index) or release one.
  Result<std::uint32_t> acquire_slot(std::string_view region);
  Status release_slot(std::string_view region, std::uint32_t slot);
  Result<std::uint64_t> slot_offset(std::string_view region, std::uint32_t slot) const;

  // Dynamic part: best-fit with coalescing. `tag` names the block in errors and dumps.
  Result<ArenaHandle> allocate(std::uint64_t bytes, Lifetime lifetime, std::string_view tag);
  Status free(ArenaHandle handle);
  Result<std::uint64_t> offset(ArenaHandle handle) const;
  Result<std::uint64_t> size(ArenaHandle handle) const;
  // base + offset; nullptr for an invalid handle or an arena without memory.
  void* ptr(ArenaHandle handle) const;

  // Slides relocatable blocks down over holes so free space merges into one block at the top.
  // Fixed blocks stay put. The caller guarantees no in-flight work touches relocatable blocks.
  Status compact();

  ArenaStats stats() const;
  // Turns compaction on demand (see Config::compact_on_demand) on or off. The owner turns it on
  // only while no in-flight work can touch relocatable blocks (e.g. a synchronous replay).
  void set_compact_on_demand(bool on);

  // Resets peak_live_bytes to the current live bytes (e.g. after warm-up).
  void reset_peak();

  // Checks every invariant of docs/memory-model.md; the message names the first one broken.
  Status is_valid() const;

  // Human-readable block map (for errors and debugging).
  std::string dump() const;

 private:
  struct State;
  explicit Arena(std::unique_ptr<State> state);
  std::unique_ptr<State> s_;
};

// A dynamic arena block that frees itself. Move-only.
class ArenaBuffer {
 public:
  ArenaBuffer() = default;
  ArenaBuffer(Arena* arena, ArenaHandle handle) : arena_(arena), handle_(handle) {}
  ArenaBuffer(ArenaBuffer&& other) noexcept { *this = std::move(other); }
  ArenaBuffer& operator=(ArenaBuffer&& other) noexcept;
  ~ArenaBuffer() { reset(); }

  void* data() const { return arena_ ? arena_->ptr(handle_) : nullptr; }
  std::uint64_t size() const;
  ArenaHandle handle() const { return handle_; }
  Arena* arena() const { return arena_; }
  MemoryOrigin origin() const { return arena_ ? arena_->origin() : MemoryOrigin::kSystem; }
  explicit operator bool() const { return arena_ != nullptr; }
  void reset();

 private:
  Arena* arena_ = nullptr;
  ArenaHandle handle_;
};

// Page-locked host memory for staging copies and direct I/O: one region locked up front,
// carved by an Arena with 4 KiB alignment, so every buffer is valid for O_DIRECT.
class PinnedPool {
 public:
  static constexpr std::uint64_t kIoAlignment = 4096;

  // Releases the region when the pool is destroyed.
  using ReleaseFn = std::function<void(void* base, std::uint64_t bytes)>;

  // Takes ownership of [base, base+bytes) (already page-locked by the caller, e.g. cudaHostAlloc).
  static Result<std::unique_ptr<PinnedPool>> adopt(void* base, std::uint64_t bytes, ReleaseFn release);
  // Maps and mlock()s `bytes` of host memory itself (used by the cpu backend and by tools that
  // run without a device), 2 MiB aligned and, with `huge_pages`, advised onto transparent huge
  // pages. If the lock limit refuses, the memory is faulted in but pageable and locked() is false.
  static Result<std::unique_ptr<PinnedPool>> create_host(std::uint64_t bytes, bool huge_pages = true);

  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // A 4 KiB-aligned buffer of at least `bytes` (rounded up to 4 KiB). Fails with kOutOfMemory
  // naming the pool size and the setting to raise (pinned_memory / STRATA_PINNED_MEMORY).
  Result<ArenaBuffer> allocate(std::uint64_t bytes, std::string_view tag);

  bool locked() const { return locked_; }
  bool contains(const void* p, std::uint64_t bytes) const;
  ArenaStats stats() const { return arena_->stats(); }
  Status is_valid() const { return arena_->is_valid(); }
  Arena& arena() { return *arena_; }

 private:
  PinnedPool() = default;
  std::unique_ptr<Arena> arena_;
  void* base_ = nullptr;
  std::uint64_t bytes_ = 0;
  bool locked_ = false;
  ReleaseFn release_;
};

// A standalone 4 KiB-aligned host buffer (origin kIoBuffer) for I/O outside any pool.
class AlignedBuffer {
 public:
  static constexpr std::uint64_t kAlignment = 4096;
  static Result<AlignedBuffer> allocate(std::uint64_t bytes);  // rounded up to 4 KiB
  AlignedBuffer() = default;
  AlignedBuffer(AlignedBuffer&& o) noexcept { *this = std::move(o); }
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
  ~AlignedBuffer();
  void* data() const { return data_; }
  std::uint64_t size() const { return size_; }
  MemoryOrigin origin() const { return MemoryOrigin::kIoBuffer; }

 private:
  void* data_ = nullptr;
  std::uint64_t size_ = 0;
};

inline constexpr std::uint64_t align_up(std::uint64_t x, std::uint64_t a) { return (x + a - 1) & ~(a - 1); }

}  // namespace strata
