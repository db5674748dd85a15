// Arena: offset-based carving of one contiguous range. See docs/memory-model.md for the
// regions, block states and invariants; is_valid() checks them one by one.
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

#include "strata/alloc.hpp"
#include "strata/log.hpp"
#include "strata/options.hpp"

namespace strata {

struct Arena::State {
  struct Region {
    RegionSpec spec;
    std::uint64_t offset = 0;
    std::uint64_t bytes = 0;      // aligned size of the region
    std::uint64_t used = 0;       // persistent: bytes carved
    std::vector<std::uint8_t> busy;  // slots: one flag per slot
    std::uint32_t held = 0;
  };
  struct Block {
    std::uint64_t size = 0;
    bool free = true;
    std::uint32_t handle = UINT32_MAX;
  };
  struct HandleEntry {
    std::uint64_t offset = 0;
    std::uint64_t size = 0;
    std::uint32_t generation = 0;
    bool live = false;
    Lifetime lifetime = Lifetime::kFixed;
    std::string tag;
  };

  Config cfg;
  mutable std::mutex mu;
  std::vector<Region> regions;
  bool planned = false;
  std::uint64_t dyn_begin = 0;
  std::map<std::uint64_t, Block> blocks;                     // offset -> block, tiles the dynamic part
  std::set<std::pair<std::uint64_t, std::uint64_t>> free_index;  // (size, offset) of free blocks
  std::vector<HandleEntry> handles;
  std::vector<std::uint32_t> free_handles;
  std::uint64_t live = 0;
  std::uint64_t peak_live = 0;
  std::uint64_t hwm = 0;
  std::uint64_t relocatable_live = 0;  // count of live relocatable blocks
  ArenaStats counters;

  void reset_dynamic(std::uint64_t begin) {
    dyn_begin = begin;
    hwm = begin;
    blocks.clear();
    free_index.clear();
    if (begin < cfg.capacity) {
      blocks[begin] = Block{cfg.capacity - begin, true, UINT32_MAX};
      free_index.insert({cfg.capacity - begin, begin});
    }
  }

  void add_live(std::uint64_t bytes) {
    live += bytes;
    peak_live = std::max(peak_live, live);
  }

  Region* find_region(std::string_view name) {
    for (auto& r : regions) {
      if (r.spec.name == name) return &r;
    }
    return nullptr;
  }

  std::string where() const { return "arena '" + cfg.name + "'"; }

  const HandleEntry* entry(ArenaHandle h) const {
    if (!h.valid() || h.index >= handles.size()) return nullptr;
    const HandleEntry& e = handles[h.index];
    if (!e.live || e.generation != h.generation) return nullptr;
    return &e;
  }

  std::uint64_t free_total() const {
    std::uint64_t total = 0;
    for (const auto& f : free_index) total += f.first;
    return total;
  }

  std::uint64_t largest_free() const { return free_index.empty() ? 0 : free_index.rbegin()->first; }

  // Marks the free block at `offset` used for the first `size` bytes; returns the handle index.
  std::uint32_t take(std::uint64_t offset, std::uint64_t size, Lifetime lifetime, std::string_view tag) {
    auto it = blocks.find(offset);
    Block b = it->second;
    free_index.erase({b.size, offset});
    if (b.size > size) {
      blocks[offset + size] = Block{b.size - size, true, UINT32_MAX};
      free_index.insert({b.size - size, offset + size});
    }
    std::uint32_t idx;
    if (!free_handles.empty()) {
      idx = free_handles.back();
      free_handles.pop_back();
    } else {
      idx = static_cast<std::uint32_t>(handles.size());
      handles.emplace_back();
    }
    HandleEntry& e = handles[idx];
    e.offset = offset;
    e.size = size;
    e.live = true;
    e.lifetime = lifetime;
    e.tag = std::string(tag);
    it->second = Block{size, false, idx};
    add_live(size);
    if (offset + size > hwm) ++counters.growths;
    hwm = std::max(hwm, offset + size);
    if (lifetime == Lifetime::kRelocatable) ++relocatable_live;
    ++counters.allocations;
    return idx;
  }

  // Frees the used block at `offset` and merges it with free neighbours.
  void release(std::uint64_t offset) {
    auto it = blocks.find(offset);
    std::uint64_t begin = offset;
    std::uint64_t size = it->second.size;
    if (it != blocks.begin()) {
      auto prev = std::prev(it);
      if (prev->second.free) {
        free_index.erase({prev->second.size, prev->first});
        begin = prev->first;
        size += prev->second.size;
        blocks.erase(prev);
      }
    }
    auto next = blocks.find(offset + it->second.size);
    if (next != blocks.end() && next->second.free) {
      free_index.erase({next->second.size, next->first});
      size += next->second.size;
      blocks.erase(next);
    }
    blocks.erase(offset);
    blocks[begin] = Block{size, true, UINT32_MAX};
    free_index.insert({size, begin});
  }

  Status move(std::uint64_t dst, std::uint64_t src, std::uint64_t bytes) {
    if (cfg.mover) return cfg.mover(dst, src, bytes);
    if (cfg.base == nullptr) return ok_status();  // accounting-only arena
    auto* base = static_cast<std::byte*>(cfg.base);
    std::memmove(base + dst, base + src, bytes);
    return ok_status();
  }

  // Slides relocatable blocks down; see docs/memory-model.md#compaction.
  Status compact() {
    ++counters.compactions;
    std::vector<std::pair<std::uint64_t, Block>> used;
    for (const auto& [off, b] : blocks) {
      if (!b.free) used.emplace_back(off, b);
    }
    Status result;
    std::uint64_t cursor = dyn_begin;
    for (auto& [off, b] : used) {
      HandleEntry& e = handles[b.handle];
      if (result.ok() && e.lifetime == Lifetime::kRelocatable && off > cursor) {
        Status s = move(cursor, off, b.size);
        if (s.ok()) {
          counters.bytes_moved += b.size;
          off = cursor;
          e.offset = cursor;
        } else {
          result = s.with_context(where() + ": compaction moving block '" + e.tag + "'");
        }
      }
      cursor = off + b.size;
    }
    // Rebuild the tiling from the used blocks' (possibly new) offsets.
    blocks.clear();
    free_index.clear();
    std::uint64_t at = dyn_begin;
    for (const auto& [off, b] : used) {
      if (off > at) {
        blocks[at] = Block{off - at, true, UINT32_MAX};
        free_index.insert({off - at, at});
      }
      blocks[off] = b;
      at = off + b.size;
    }
    if (at < cfg.capacity) {
      blocks[at] = Block{cfg.capacity - at, true, UINT32_MAX};
      free_index.insert({cfg.capacity - at, at});
    }
    return result;
  }

  // Where the top free block would begin after compact(): relocatable blocks slide down to the
  // end of the highest fixed block, so it is that end plus the relocatable bytes above it.
  std::uint64_t compacted_top() const {
    std::uint64_t barrier = dyn_begin;
    std::uint64_t relocatable_above = 0;
    for (const auto& [off, b] : blocks) {
      if (b.free) continue;
      if (handles[b.handle].lifetime == Lifetime::kFixed) {
        barrier = off + b.size;
        relocatable_above = 0;
      } else {
        relocatable_above += b.size;
      }
    }
    return barrier + relocatable_above;
  }

  std::uint64_t planned_live() const {
    std::uint64_t total = 0;
    for (const auto& r : regions) total += r.spec.is_slots() ? r.held * r.spec.slot_bytes : r.used;
    return total;
  }
};

Arena::Arena(std::unique_ptr<State> state) : s_(std::move(state)) {}
Arena::~Arena() = default;

Result<std::unique_ptr<Arena>> Arena::create(Config config) {
  if (config.alignment < 16 || (config.alignment & (config.alignment - 1)) != 0) {
    return invalid_argument("arena '" + config.name + "': alignment " + std::to_string(config.alignment) +
                            " is not a power of two >= 16");
  }
  if (config.capacity == 0 || config.capacity % config.alignment != 0) {
    return invalid_argument("arena '" + config.name + "': capacity " + std::to_string(config.capacity) +
                            " must be a positive multiple of the alignment " + std::to_string(config.alignment));
  }
  auto state = std::make_unique<State>();
  state->cfg = std::move(config);
  state->reset_dynamic(0);
  return std::unique_ptr<Arena>(new Arena(std::move(state)));
}

const std::string& Arena::name() const { return s_->cfg.name; }
void* Arena::base() const { return s_->cfg.base; }
MemoryOrigin Arena::origin() const { return s_->cfg.origin; }

Status Arena::plan(const std::vector<RegionSpec>& regions) {
  std::lock_guard lock(s_->mu);
  if (s_->planned) return failed_precondition(s_->where() + ": regions are already planned");
  if (s_->live != 0) {
    return failed_precondition(s_->where() + ": cannot plan regions while " + format_bytes(s_->live) +
                               " of dynamic blocks are live");
  }
  const std::uint64_t a = s_->cfg.alignment;
  std::vector<State::Region> laid;
  std::uint64_t at = 0;
  for (const auto& spec : regions) {
    for (const auto& other : laid) {
      if (other.spec.name == spec.name) return invalid_argument(s_->where() + ": region '" + spec.name + "' is planned twice");
    }
    State::Region r;
    r.spec = spec;
    if (spec.is_slots()) {
      if (spec.slot_bytes == 0) return invalid_argument(s_->where() + ": slot region '" + spec.name + "' has slot_bytes 0");
      r.spec.slot_bytes = align_up(spec.slot_bytes, a);
      r.bytes = r.spec.slot_bytes * spec.slot_count;
      r.busy.assign(spec.slot_count, 0);
    } else {
      r.bytes = align_up(spec.bytes, a);
    }
    r.offset = at;
    at += r.bytes;
    if (at > s_->cfg.capacity) {
      return out_of_memory(s_->where() + ": planned regions need " + format_bytes(at) + " up to region '" +
                           spec.name + "' but the arena holds " + format_bytes(s_->cfg.capacity) +
                           " (raise device_memory / STRATA_DEVICE_MEMORY or offload more state)");
    }
    laid.push_back(std::move(r));
  }
  s_->regions = std::move(laid);
  s_->planned = true;
  s_->reset_dynamic(at);
  STRATA_LOG(kDebug, kAlloc) << s_->where() << ": planned " << regions.size() << " regions, "
                             << format_bytes(at) << "; dynamic part " << format_bytes(s_->cfg.capacity - at);
  return ok_status();
}

Result<std::uint64_t> Arena::allocate_persistent(std::string_view region, std::uint64_t bytes) {
  std::lock_guard lock(s_->mu);
  State::Region* r = s_->find_region(region);
  if (r == nullptr || r->spec.is_slots()) {
    return not_found(s_->where() + ": no persistent region named '" + std::string(region) + "'");
  }
  std::uint64_t size = align_up(std::max<std::uint64_t>(bytes, 1), s_->cfg.alignment);
  if (r->used + size > r->bytes) {
    return out_of_memory(s_->where() + ": persistent region '" + std::string(region) + "' has " +
                         format_bytes(r->bytes - r->used) + " left, " + format_bytes(size) + " requested");
  }
  std::uint64_t off = r->offset + r->used;
  r->used += size;
  s_->add_live(size);
  return off;
}

Result<std::uint32_t> Arena::acquire_slot(std::string_view region) {
  std::lock_guard lock(s_->mu);
  State::Region* r = s_->find_region(region);
  if (r == nullptr || !r->spec.is_slots()) {
    return not_found(s_->where() + ": no slot region named '" + std::string(region) + "'");
  }
  for (std::uint32_t i = 0; i < r->busy.size(); ++i) {
    if (!r->busy[i]) {
      r->busy[i] = 1;
      ++r->held;
      s_->add_live(r->spec.slot_bytes);
      return i;
    }
  }
  return out_of_memory(s_->where() + ": all " + std::to_string(r->busy.size()) + " slots of region '" +
                       std::string(region) + "' are held");
}

Status Arena::release_slot(std::string_view region, std::uint32_t slot) {
  std::lock_guard lock(s_->mu);
  State::Region* r = s_->find_region(region);
  if (r == nullptr || !r->spec.is_slots()) {
    return not_found(s_->where() + ": no slot region named '" + std::string(region) + "'");
  }
  if (slot >= r->busy.size() || !r->busy[slot]) {
    return invalid_argument(s_->where() + ": slot " + std::to_string(slot) + " of region '" + std::string(region) +
                            "' is not held");
  }
  r->busy[slot] = 0;
  --r->held;
  s_->live -= r->spec.slot_bytes;
  return ok_status();
}

Result<std::uint64_t> Arena::slot_offset(std::string_view region, std::uint32_t slot) const {
  std::lock_guard lock(s_->mu);
  State::Region* r = s_->find_region(region);
  if (r == nullptr || !r->spec.is_slots() || slot >= r->busy.size()) {
    return not_found(s_->where() + ": no slot " + std::to_string(slot) + " in region '" + std::string(region) + "'");
  }
  return r->offset + static_cast<std::uint64_t>(slot) * r->spec.slot_bytes;
}

Result<ArenaHandle> Arena::allocate(std::uint64_t bytes, Lifetime lifetime, std::string_view tag) {
  std::lock_guard lock(s_->mu);
  State& s = *s_;
  const std::uint64_t size = align_up(std::max<std::uint64_t>(bytes, 1), s.cfg.alignment);
  if (bytes > s.cfg.capacity) {
    return out_of_memory(s.where() + ": '" + std::string(tag) + "' needs " + format_bytes(bytes) +
                         ", more than the whole arena (" + format_bytes(s.cfg.capacity) + ")");
  }
  auto pick = [&]() { return s.free_index.lower_bound({size, 0}); };
  auto it = pick();
  const bool can_compact = s.relocatable_live > 0;
  if (it != s.free_index.end() && s.cfg.compact_on_demand && can_compact && it->second + size > s.hwm &&
      s.compacted_top() + size <= s.hwm) {
    // Only the top block fits, so the high-water mark would rise; compaction would make room
    // below it instead.
    STRATA_RETURN_IF_ERROR(s.compact());
    it = pick();
  }
  if (it == s.free_index.end() && can_compact && s.free_total() >= size) {
    STRATA_RETURN_IF_ERROR(s.compact());
    it = pick();
  }
  if (it == s.free_index.end()) {
    return out_of_memory(s.where() + ": cannot allocate " + format_bytes(size) + " for '" + std::string(tag) +
                         "': largest free block " + format_bytes(s.largest_free()) + ", free " +
                         format_bytes(s.free_total()) + " of " + format_bytes(s.cfg.capacity) +
                         " (raise device_memory / STRATA_DEVICE_MEMORY or offload more state)");
  }
  std::uint32_t idx = s.take(it->second, size, lifetime, tag);
  return ArenaHandle{idx, s.handles[idx].generation};
}

Status Arena::free(ArenaHandle handle) {
  std::lock_guard lock(s_->mu);
  State& s = *s_;
  const State::HandleEntry* e = s.entry(handle);
  if (e == nullptr) {
    return invalid_argument(s.where() + ": free of a handle that is not live (index " +
                            std::to_string(handle.index) + ", generation " + std::to_string(handle.generation) + ")");
  }
  State::HandleEntry& entry = s.handles[handle.index];
  s.release(entry.offset);
  s.live -= entry.size;
  if (entry.lifetime == Lifetime::kRelocatable) --s.relocatable_live;
  entry.live = false;
  ++entry.generation;
  entry.tag.clear();
  s.free_handles.push_back(handle.index);
  ++s.counters.frees;
  return ok_status();
}

Result<std::uint64_t> Arena::offset(ArenaHandle handle) const {
  std::lock_guard lock(s_->mu);
  const State::HandleEntry* e = s_->entry(handle);
  if (e == nullptr) return invalid_argument(s_->where() + ": handle is not live");
  return e->offset;
}

Result<std::uint64_t> Arena::size(ArenaHandle handle) const {
  std::lock_guard lock(s_->mu);
  const State::HandleEntry* e = s_->entry(handle);
  if (e == nullptr) return invalid_argument(s_->where() + ": handle is not live");
  return e->size;
}

void* Arena::ptr(ArenaHandle handle) const {
  std::lock_guard lock(s_->mu);
  const State::HandleEntry* e = s_->entry(handle);
  if (e == nullptr || s_->cfg.base == nullptr) return nullptr;
  return static_cast<std::byte*>(s_->cfg.base) + e->offset;
}

Status Arena::compact() {
  std::lock_guard lock(s_->mu);
  return s_->compact();
}

ArenaStats Arena::stats() const {
  std::lock_guard lock(s_->mu);
  const State& s = *s_;
  ArenaStats st = s.counters;
  st.capacity = s.cfg.capacity;
  st.reserved_bytes = std::max(s.dyn_begin, s.hwm);
  st.live_bytes = s.live;
  st.peak_live_bytes = s.peak_live;
  st.largest_free_block = s.largest_free();
  st.free_bytes = s.free_total();
  st.fragmentation = st.free_bytes == 0 ? 0.0
                                        : 1.0 - static_cast<double>(st.largest_free_block) /
                                                    static_cast<double>(st.free_bytes);
  return st;
}

void Arena::set_compact_on_demand(bool on) {
  std::lock_guard lock(s_->mu);
  s_->cfg.compact_on_demand = on;
}

void Arena::reset_peak() {
  std::lock_guard lock(s_->mu);
  s_->peak_live = s_->live;
}

Status Arena::is_valid() const {
  std::lock_guard lock(s_->mu);
  const State& s = *s_;
  const std::uint64_t a = s.cfg.alignment;
  auto broken = [&](const std::string& what) { return internal_error(s.where() + ": invariant broken: " + what); };

  // 1. Planned regions tile [0, dyn_begin).
  std::uint64_t at = 0;
  std::uint64_t planned_live = 0;
  for (const auto& r : s.regions) {
    if (r.offset != at) return broken("region '" + r.spec.name + "' does not start where the previous ended");
    if (r.offset % a != 0 || r.bytes % a != 0) return broken("region '" + r.spec.name + "' is misaligned");
    if (r.spec.is_slots()) {
      std::uint32_t held = 0;
      for (auto b : r.busy) held += b;
      if (held != r.held) return broken("slot region '" + r.spec.name + "' held count disagrees with its flags");
      planned_live += r.held * r.spec.slot_bytes;
    } else {
      if (r.used > r.bytes) return broken("persistent region '" + r.spec.name + "' carved past its end");
      planned_live += r.used;
    }
    at += r.bytes;
  }
  if (at != s.dyn_begin) return broken("planned regions do not end at dyn_begin");

  // 2-4. Dynamic blocks tile [dyn_begin, capacity); free blocks coalesced and indexed; handles.
  at = s.dyn_begin;
  bool prev_free = false;
  std::uint64_t used_bytes = 0;
  std::size_t used_blocks = 0;
  std::size_t free_blocks = 0;
  std::uint64_t max_used_end = s.dyn_begin;
  std::uint64_t relocatable = 0;
  for (const auto& [off, b] : s.blocks) {
    if (off != at) return broken("block at " + std::to_string(off) + " leaves a gap or overlaps (expected " + std::to_string(at) + ")");
    if (b.size == 0) return broken("zero-sized block at " + std::to_string(off));
    if (off % a != 0 || b.size % a != 0) return broken("block at " + std::to_string(off) + " is misaligned");
    if (b.free) {
      if (prev_free) return broken("adjacent free blocks at " + std::to_string(off));
      if (!s.free_index.count({b.size, off})) return broken("free block at " + std::to_string(off) + " missing from the free index");
      ++free_blocks;
    } else {
      if (b.handle >= s.handles.size()) return broken("used block at " + std::to_string(off) + " has no handle");
      const auto& e = s.handles[b.handle];
      if (!e.live || e.offset != off || e.size != b.size) {
        return broken("handle of block at " + std::to_string(off) + " disagrees with the block");
      }
      if (e.lifetime == Lifetime::kRelocatable) ++relocatable;
      used_bytes += b.size;
      ++used_blocks;
      max_used_end = off + b.size;
    }
    prev_free = b.free;
    at = off + b.size;
  }
  if (s.dyn_begin < s.cfg.capacity && at != s.cfg.capacity) return broken("blocks do not reach the end of the arena");
  if (free_blocks != s.free_index.size()) return broken("free index holds blocks that do not exist");
  std::size_t live_handles = 0;
  for (const auto& e : s.handles) live_handles += e.live ? 1 : 0;
  if (live_handles != used_blocks) return broken("live handles and used blocks differ in number");
  if (relocatable != s.relocatable_live) return broken("relocatable block count is off");

  // 5. Accounting.
  if (s.live != used_bytes + planned_live) {
    return broken("live bytes " + std::to_string(s.live) + " != used " + std::to_string(used_bytes + planned_live));
  }
  if (s.peak_live < s.live) return broken("peak_live below live");
  if (max_used_end > s.hwm || s.hwm > s.cfg.capacity) return broken("high-water mark below a used block or past capacity");
  return ok_status();
}

std::string Arena::dump() const {
  std::lock_guard lock(s_->mu);
  std::ostringstream out;
  out << "arena '" << s_->cfg.name << "' capacity " << format_bytes(s_->cfg.capacity) << "\n";
  for (const auto& r : s_->regions) {
    out << "  region " << r.spec.name << " @" << r.offset << " " << format_bytes(r.bytes)
        << (r.spec.is_slots() ? " slots held " + std::to_string(r.held) : " used " + format_bytes(r.used)) << "\n";
  }
  for (const auto& [off, b] : s_->blocks) {
    out << "  @" << off << " " << format_bytes(b.size) << " ";
    if (b.free) {
      out << "free";
    } else {
      const auto& e = s_->handles[b.handle];
      out << (e.lifetime == Lifetime::kRelocatable ? "relocatable " : "fixed ") << e.tag;
    }
    out << "\n";
  }
  return out.str();
}

ArenaBuffer& ArenaBuffer::operator=(ArenaBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    arena_ = other.arena_;
    handle_ = other.handle_;
    other.arena_ = nullptr;
    other.handle_ = {};
  }
  return *this;
}

std::uint64_t ArenaBuffer::size() const {
  if (arena_ == nullptr) return 0;
  auto s = arena_->size(handle_);
  return s.ok() ? *s : 0;
}

void ArenaBuffer::reset() {
  if (arena_ != nullptr) {
    Status s = arena_->free(handle_);
    if (!s.ok()) {
      STRATA_LOG(kError, kAlloc) << "freeing an arena buffer: " << s.to_string();
    }
    arena_ = nullptr;
    handle_ = {};
  }
}

}  // namespace strata
