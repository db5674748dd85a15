// Arena and pinned-pool tests: deterministic property runs of random alloc/free/compact
// sequences, each step checked by is_valid(), plus the planned regions and error messages.
#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "harness/harness.hpp"
#include "strata/alloc.hpp"

namespace strata {
namespace {

std::unique_ptr<Arena> make_arena(std::uint64_t capacity, std::uint64_t alignment, void* base = nullptr,
                                  bool compact_on_demand = false) {
  Arena::Config cfg;
  cfg.name = "test";
  cfg.capacity = capacity;
  cfg.alignment = alignment;
  cfg.base = base;
  cfg.compact_on_demand = compact_on_demand;
  auto a = Arena::create(std::move(cfg));
  EXPECT_TRUE(a.ok()) << a.status().to_string();
  return std::move(a).value();
}

TEST(Arena, RejectsBadConfig) {
  Arena::Config cfg;
  cfg.capacity = 1 << 20;
  cfg.alignment = 100;
  STRATA_EXPECT_ERROR(Arena::create(cfg), kInvalidArgument, "power of two");
  cfg.alignment = 256;
  cfg.capacity = 1000;
  STRATA_EXPECT_ERROR(Arena::create(cfg), kInvalidArgument, "multiple of the alignment");
}

TEST(Arena, BestFitPicksTheSmallestHoleAndCoalesces) {
  auto arena = make_arena(1 << 20, 256);
  auto a = *arena->allocate(1000, Lifetime::kFixed, "a");  // 1024
  auto b = *arena->allocate(4096, Lifetime::kFixed, "b");
  auto c = *arena->allocate(256, Lifetime::kFixed, "c");
  auto d = *arena->allocate(2048, Lifetime::kFixed, "d");
  auto e = *arena->allocate(256, Lifetime::kFixed, "e");
  STRATA_ASSERT_OK(arena->free(b));  // hole of 4096 at 1024
  STRATA_ASSERT_OK(arena->free(d));  // hole of 2048 at 5376
  auto f = *arena->allocate(2000, Lifetime::kFixed, "f");
  EXPECT_EQ(*arena->offset(f), *arena->offset(c) + 256) << "best fit takes the 2048 hole, not the 4096 one";
  STRATA_ASSERT_OK(arena->free(f));
  STRATA_ASSERT_OK(arena->free(c));  // 4096 + 256 + 2048 merge into one hole
  STRATA_ASSERT_OK(arena->is_valid());
  auto g = *arena->allocate(6400, Lifetime::kFixed, "g");
  EXPECT_EQ(*arena->offset(g), 1024u);
  STRATA_ASSERT_OK(arena->free(a));
  STRATA_ASSERT_OK(arena->free(g));
  STRATA_ASSERT_OK(arena->free(e));
  STRATA_ASSERT_OK(arena->is_valid());
  auto st = arena->stats();
  EXPECT_EQ(st.live_bytes, 0u);
  EXPECT_EQ(st.largest_free_block, 1u << 20);
  EXPECT_EQ(st.fragmentation, 0.0);
}

TEST(Arena, StaleHandlesAreRejected) {
  auto arena = make_arena(1 << 16, 256);
  auto a = *arena->allocate(100, Lifetime::kFixed, "a");
  STRATA_ASSERT_OK(arena->free(a));
  STRATA_EXPECT_ERROR(arena->free(a), kInvalidArgument, "not live");
  auto b = *arena->allocate(100, Lifetime::kFixed, "b");
  EXPECT_EQ(a.index, b.index);
  EXPECT_NE(a.generation, b.generation);
  EXPECT_FALSE(arena->offset(a).ok());
  EXPECT_EQ(arena->ptr(a), nullptr);
}

TEST(Arena, OutOfMemoryNamesTheBlockAndTheSetting) {
  auto arena = make_arena(1 << 16, 256);
  auto a = arena->allocate(1 << 15, Lifetime::kFixed, "activations.block3");
  ASSERT_TRUE(a.ok());
  STRATA_EXPECT_ERROR(arena->allocate(1 << 16, Lifetime::kFixed, "activations.block4"), kOutOfMemory,
                      "activations.block4");
  STRATA_EXPECT_ERROR(arena->allocate(1 << 16, Lifetime::kFixed, "x"), kOutOfMemory, "device_memory");
}

TEST(Arena, PlannedRegionsPersistentAndSlots) {
  auto arena = make_arena(1 << 20, 256);
  STRATA_ASSERT_OK(arena->plan({{.name = "params", .bytes = 10000},
                                {.name = "prefetch", .slot_bytes = 5000, .slot_count = 3}}));
  STRATA_EXPECT_ERROR(arena->plan({}), kFailedPrecondition, "already planned");
  auto p0 = *arena->allocate_persistent("params", 4000);
  auto p1 = *arena->allocate_persistent("params", 4000);
  EXPECT_EQ(p0, 0u);
  EXPECT_EQ(p1, 4096u);
  STRATA_EXPECT_ERROR(arena->allocate_persistent("params", 4000), kOutOfMemory, "'params'");
  STRATA_EXPECT_ERROR(arena->allocate_persistent("nope", 1), kNotFound, "'nope'");
  auto s0 = *arena->acquire_slot("prefetch");
  auto s1 = *arena->acquire_slot("prefetch");
  auto s2 = *arena->acquire_slot("prefetch");
  STRATA_EXPECT_ERROR(arena->acquire_slot("prefetch"), kOutOfMemory, "all 3 slots");
  EXPECT_EQ(*arena->slot_offset("prefetch", s1) - *arena->slot_offset("prefetch", s0), 5120u);
  STRATA_ASSERT_OK(arena->release_slot("prefetch", s1));
  STRATA_EXPECT_ERROR(arena->release_slot("prefetch", s1), kInvalidArgument, "not held");
  EXPECT_EQ(*arena->acquire_slot("prefetch"), s1);
  (void)s2;
  auto st = arena->stats();
  EXPECT_EQ(st.live_bytes, 8192u + 3 * 5120u);
  auto d = *arena->allocate(1, Lifetime::kFixed, "dyn");
  EXPECT_GE(*arena->offset(d), 10240u + 3 * 5120u) << "dynamic blocks start after the planned regions";
  STRATA_ASSERT_OK(arena->is_valid());
}

TEST(Arena, PlanThatDoesNotFitNamesTheRegion) {
  auto arena = make_arena(1 << 20, 256);
  STRATA_EXPECT_ERROR(arena->plan({{.name = "params", .bytes = 1 << 19}, {.name = "grads", .bytes = 1 << 20}}),
                      kOutOfMemory, "'grads'");
  STRATA_ASSERT_OK(arena->is_valid());
}

TEST(Arena, CompactionMovesBytesAndKeepsFixedBlocksInPlace) {
  std::vector<std::uint8_t> memory(1 << 16);
  auto arena = make_arena(memory.size(), 256, memory.data());
  std::vector<ArenaHandle> hs;
  for (int i = 0; i < 8; ++i) {
    auto lifetime = (i == 3) ? Lifetime::kFixed : Lifetime::kRelocatable;
    hs.push_back(*arena->allocate(1000 + 300 * i, lifetime, "t" + std::to_string(i)));
    auto* p = static_cast<std::uint8_t*>(arena->ptr(hs.back()));
    std::memset(p, 0x10 + i, 1000 + 300 * i);
  }
  auto fixed_before = *arena->offset(hs[3]);
  for (int i : {0, 2, 5}) STRATA_ASSERT_OK(arena->free(hs[i]));
  auto before = arena->stats();
  STRATA_ASSERT_OK(arena->compact());
  STRATA_ASSERT_OK(arena->is_valid());
  auto after = arena->stats();
  EXPECT_EQ(*arena->offset(hs[3]), fixed_before);
  EXPECT_GT(after.bytes_moved, 0u);
  EXPECT_GT(after.largest_free_block, before.largest_free_block);
  for (int i : {1, 3, 4, 6, 7}) {
    auto* p = static_cast<std::uint8_t*>(arena->ptr(hs[i]));
    for (int k = 0; k < 1000 + 300 * i; ++k) ASSERT_EQ(p[k], 0x10 + i) << "block " << i << " byte " << k;
  }
  EXPECT_EQ(*arena->offset(hs[1]), 0u) << "a relocatable block slides to the bottom";
}

TEST(Arena, CompactOnDemandKeepsTheHighWaterMarkDown) {
  auto arena = make_arena(1 << 20, 256, nullptr, /*compact_on_demand=*/true);
  std::vector<ArenaHandle> hs;
  for (int i = 0; i < 16; ++i) hs.push_back(*arena->allocate(4096, Lifetime::kRelocatable, "x"));
  for (int i = 0; i < 16; i += 2) STRATA_ASSERT_OK(arena->free(hs[i]));  // 8 holes of 4 KiB
  auto hwm = arena->stats().reserved_bytes;
  auto big = arena->allocate(4 * 4096, Lifetime::kRelocatable, "big");
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(arena->stats().reserved_bytes, hwm) << "the holes were merged instead of growing";
  EXPECT_EQ(arena->stats().compactions, 1u);
  STRATA_ASSERT_OK(arena->is_valid());
}

TEST(Arena, FailedMoveLeavesAConsistentArena) {
  Arena::Config cfg;
  cfg.name = "failing";
  cfg.capacity = 1 << 16;
  cfg.alignment = 256;
  int calls = 0;
  cfg.mover = [&](std::uint64_t, std::uint64_t, std::uint64_t) -> Status {
    return ++calls == 2 ? device_error("copy engine fault") : ok_status();
  };
  auto arena = std::move(Arena::create(cfg)).value();
  std::vector<ArenaHandle> hs;
  for (int i = 0; i < 6; ++i) hs.push_back(*arena->allocate(1024, Lifetime::kRelocatable, "r"));
  STRATA_ASSERT_OK(arena->free(hs[0]));
  STRATA_ASSERT_OK(arena->free(hs[2]));
  STRATA_EXPECT_ERROR(arena->compact(), kDeviceError, "copy engine fault");
  STRATA_ASSERT_OK(arena->is_valid());
  EXPECT_EQ(*arena->offset(hs[1]), 0u) << "the first move completed";
  EXPECT_EQ(*arena->offset(hs[3]), 3 * 1024u) << "the failed block stayed where it was";
}

// Random sequences: allocate (fixed or relocatable, awkward sizes), free, compact, with memory
// contents tracked so that moves are checked byte for byte.
class ArenaProperty : public ::testing::TestWithParam<std::uint32_t> {};

struct PlacedBlock {
  std::uint64_t offset;
  std::uint64_t size;  // aligned
  bool relocatable;
};

// The largest block an arena of `capacity` bytes (no planned regions) holding `blocks` can
// still provide, computed from the blocks' own offsets rather than the arena's bookkeeping:
// the largest gap as things stand, or, where relocatable blocks exist, the largest gap once
// compaction has slid every relocatable block down to the end of the block below it (fixed
// blocks stay put: docs/memory-model.md). An allocation of up to this many bytes must succeed.
std::uint64_t largest_possible_block(std::vector<PlacedBlock> blocks, std::uint64_t capacity) {
  std::sort(blocks.begin(), blocks.end(), [](const auto& a, const auto& b) { return a.offset < b.offset; });
  std::uint64_t now = 0, compacted = 0, at = 0, cursor = 0;
  for (const auto& b : blocks) {
    now = std::max(now, b.offset - at);
    at = b.offset + b.size;
    if (b.relocatable) {
      cursor += b.size;
    } else {
      compacted = std::max(compacted, b.offset - cursor);
      cursor = b.offset + b.size;
    }
  }
  now = std::max(now, capacity - at);
  compacted = std::max(compacted, capacity - cursor);
  return std::max(now, compacted);
}

TEST_P(ArenaProperty, RandomSequencesKeepEveryInvariant) {
  const std::uint64_t capacity = 4 << 20;
  std::vector<std::uint8_t> memory(capacity);
  const std::uint64_t alignment = GetParam() % 2 ? 256 : 4096;
  auto arena = make_arena(capacity, alignment, memory.data(), GetParam() % 3 == 0);
  std::mt19937 rng(GetParam());
  struct Live {
    ArenaHandle h;
    std::uint64_t bytes;
    std::uint8_t fill;
    Lifetime lifetime;
  };
  std::vector<Live> live;
  std::uint64_t expect_live = 0;
  int ooms = 0;
  const auto& awkward = testing::awkward_sizes();
  for (int step = 0; step < 3000; ++step) {
    int op = static_cast<int>(rng() % 10);
    if (op < 5 || live.empty()) {
      std::uint64_t bytes = (rng() % 4 == 0) ? awkward[rng() % awkward.size()] : 1 + rng() % 40000;
      auto lifetime = rng() % 3 == 0 ? Lifetime::kFixed : Lifetime::kRelocatable;
      std::vector<PlacedBlock> placed;
      for (const auto& l : live) {
        placed.push_back({*arena->offset(l.h), align_up(std::max<std::uint64_t>(l.bytes, 1), alignment),
                          l.lifetime == Lifetime::kRelocatable});
      }
      const std::uint64_t need = align_up(std::max<std::uint64_t>(bytes, 1), alignment);
      const std::uint64_t room = largest_possible_block(placed, capacity);
      auto h = arena->allocate(bytes, lifetime, "blk");
      if (!h.ok()) {
        ASSERT_EQ(h.status().code(), StatusCode::kOutOfMemory) << h.status().to_string();
        // Out of memory is right only when the request truly cannot fit.
        ASSERT_GT(need, room) << "step " << step << ": " << need << " bytes fit (room for " << room
                              << " after compaction) but the arena said: " << h.status().to_string() << "\n"
                              << arena->dump();
        ++ooms;
        continue;
      }
      auto fill = static_cast<std::uint8_t>(rng());
      std::memset(arena->ptr(*h), fill, bytes);
      ASSERT_EQ(*arena->offset(*h) % alignment, 0u);
      live.push_back({*h, bytes, fill, lifetime});
      expect_live += align_up(std::max<std::uint64_t>(bytes, 1), alignment);
    } else if (op < 9) {
      std::size_t i = rng() % live.size();
      STRATA_ASSERT_OK(arena->free(live[i].h));
      expect_live -= align_up(std::max<std::uint64_t>(live[i].bytes, 1), alignment);
      live[i] = live.back();
      live.pop_back();
    } else {
      STRATA_ASSERT_OK(arena->compact());
    }
    ASSERT_TRUE(arena->is_valid().ok()) << arena->is_valid().to_string() << "\n" << arena->dump();
    ASSERT_EQ(arena->stats().live_bytes, expect_live);
    if (step % 97 == 0) {
      for (const auto& l : live) {
        auto* p = static_cast<std::uint8_t*>(arena->ptr(l.h));
        for (std::uint64_t k = 0; k < l.bytes; k += 61) ASSERT_EQ(p[k], l.fill);
      }
    }
  }
  RecordProperty("out_of_memory_answers", ooms);
  EXPECT_GT(ooms, 0) << "the sequence never filled the arena, so the out-of-memory rule went unchecked";
  // No overlap: every live block's bytes are intact at the end.
  for (const auto& l : live) {
    auto* p = static_cast<std::uint8_t*>(arena->ptr(l.h));
    for (std::uint64_t k = 0; k < l.bytes; ++k) ASSERT_EQ(p[k], l.fill);
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, ArenaProperty, ::testing::Values(1u, 2u, 3u, 4u, 5u, 6u));

TEST(PinnedPool, BuffersAreIoAlignedAndAccounted) {
  auto pool = PinnedPool::create_host(1 << 20);
  ASSERT_TRUE(pool.ok()) << pool.status().to_string();
  auto a = (*pool)->allocate(1, "a");
  auto b = (*pool)->allocate(4097, "b");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a->data()) % 4096, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b->data()) % 4096, 0u);
  EXPECT_EQ(b->size(), 8192u);
  EXPECT_EQ(a->origin(), MemoryOrigin::kPinnedPool);
  EXPECT_TRUE((*pool)->contains(b->data(), 8192));
  EXPECT_EQ((*pool)->stats().live_bytes, 4096u + 8192u);
  STRATA_EXPECT_ERROR((*pool)->allocate(2 << 20, "huge"), kOutOfMemory, "pinned_memory");
  a->reset();
  EXPECT_EQ((*pool)->stats().live_bytes, 8192u);
  STRATA_ASSERT_OK((*pool)->is_valid());
}

TEST(AlignedBuffer, RoundsUpAndAligns) {
  for (std::uint64_t n : {std::uint64_t{1}, std::uint64_t{4095}, std::uint64_t{4097}, (std::uint64_t{1} << 20) + 3}) {
    auto b = AlignedBuffer::allocate(n);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b->data()) % 4096, 0u);
    EXPECT_EQ(b->size() % 4096, 0u);
    EXPECT_GE(b->size(), n);
  }
}

}  // namespace
}  // namespace strata
