// Inside the swap store: the extent allocator over the striped swap file's logical space, and
// the journal that makes published versions survive a crash.
//
// Space model. The swap files of all directories form one logical file (IoEngine striping);
// its capacity C is carved into extents, 4 KiB aligned. At any time
//   C = free + Σ over live versions of their extent lengths,
// where a version is live from allocation until it is retired (superseded, removed or failed)
// and no read pins it. Extents of live versions never overlap each other or the free list.
//
// Version lifecycle:  allocated --(all pieces written, journal record appended)--> published
//   published --(newer version published / remove)--> retired --(pins == 0)--> freed
//   allocated --(write failed, or a newer write already won)--> retired --> freed
// Only published versions are in the journal; replay rebuilds exactly the published ones, so a
// crash at any point leaves each key at its last published version.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "strata/nvme.hpp"

namespace strata::nvme_detail {

inline constexpr std::uint64_t kExtentAlign = 4096;

struct Extent {
  std::uint64_t offset = 0;  // logical offset in the striped swap file
  std::uint64_t length = 0;  // multiple of kExtentAlign
  friend bool operator==(const Extent&, const Extent&) = default;
};

class ExtentAllocator {
 public:
  explicit ExtentAllocator(std::uint64_t capacity = 0);

  // `bytes` (a multiple of 4 KiB) as one extent (best fit) or, when no free extent is large
  // enough, as several, each but the last a multiple of `granule`. All or nothing.
  std::optional<std::vector<Extent>> allocate(std::uint64_t bytes, std::uint64_t granule);
  void free(const Extent& e);
  // Carves a specific extent (journal replay). Fails if any of it is not free.
  bool take(const Extent& e);

  std::uint64_t capacity() const { return capacity_; }
  std::uint64_t free_bytes() const { return free_bytes_; }
  std::uint64_t largest_free() const;
  const std::map<std::uint64_t, std::uint64_t>& free_map() const { return free_; }
  Status is_valid() const;

 private:
  void insert_free(std::uint64_t off, std::uint64_t len);
  void erase_free(std::map<std::uint64_t, std::uint64_t>::iterator it);

  std::uint64_t capacity_ = 0;
  std::uint64_t free_bytes_ = 0;
  std::map<std::uint64_t, std::uint64_t> free_;                // offset -> length, coalesced
  std::set<std::pair<std::uint64_t, std::uint64_t>> by_size_;  // (length, offset)
};

// ---- Journal ---------------------------------------------------------------------------------

struct JournalHeader {
  std::uint32_t dirs = 0;
  std::uint64_t member_capacity = 0;
  std::uint64_t stripe_unit = 0;
  std::uint64_t checksum_block = 0;
  bool checksums = true;
};

struct JournalPut {
  TensorKey key;
  std::uint64_t seq = 0;
  std::uint64_t size = 0;
  std::vector<Extent> extents;
  std::vector<std::uint32_t> crcs;
};

struct JournalRemove {
  TensorKey key;
  std::uint64_t seq = 0;
};

using JournalRecord = std::variant<JournalPut, JournalRemove>;

// A stretch of the journal that failed to parse and is followed by intact records: not a torn
// tail (a crash during an append leaves only the last record torn) but corruption.
struct JournalDamage {
  std::uint64_t offset = 0;  // of the first bad byte (where a record should start)
  std::uint64_t bytes = 0;   // up to the next intact record
  std::string reason;        // why the record there does not parse
  // What the bad record seems to hold, parsed without its checksum: "a put of NAME[shard S]".
  // Empty when not even that parses. Unverified.
  std::string suspect;
  std::optional<TensorKey> suspect_key;
};

struct JournalContents {
  JournalHeader header;
  std::vector<JournalRecord> records;
  std::vector<std::uint64_t> record_offsets;  // journal offset of each record, in file order
  std::vector<JournalDamage> damage;          // in file order
  std::uint64_t valid_bytes = 0;              // end of the last intact record; after it only a torn tail
  std::uint64_t file_bytes = 0;
};

// Record framing: magic u32, type u32, payload length u32, crc32c(type, length, payload) u32,
// payload. Little-endian. The first record is the header.
std::string encode_header(const JournalHeader& h);
std::string encode(const JournalRecord& r);
// Parses a journal image. A missing or corrupt header is an error naming `path`, offset 0 and
// what was expected. A bad record followed by intact ones is reported in `damage` and parsing
// resumes at the next intact record; a bad record with nothing intact after it is a torn tail
// and ends `valid_bytes`.
Result<JournalContents> decode_journal(const std::string& image, const std::string& path);

}  // namespace strata::nvme_detail
