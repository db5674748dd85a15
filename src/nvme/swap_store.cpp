// The swap store: tensor keys -> extents of preallocated swap files, checksummed per block,
// updated copy-on-write and published through an append-only journal. swap_internal.hpp
// defines the space model and the version lifecycle; docs/nvme.md the on-disk layout.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>

#include "nvme/engine_internal.hpp"
#include "nvme/swap_internal.hpp"
#include "strata/log.hpp"
#include "strata/options.hpp"

namespace strata {

using nvme_detail::Extent;
using nvme_detail::ExtentAllocator;
using nvme_detail::JournalHeader;
using nvme_detail::JournalPut;
using nvme_detail::JournalRemove;

std::string TensorKey::to_string() const { return name + "[shard " + std::to_string(shard) + "]"; }

Status SwapStoreConfig::validate() const {
  if (dirs.empty()) return invalid_argument("swap store: no directory given (aio.nvme_path)");
  std::set<std::string> seen;
  for (std::size_t i = 0; i < dirs.size(); ++i) {
    if (dirs[i].empty())
      return invalid_argument("swap store: aio.nvme_path[" + std::to_string(i) + "] is empty");
    std::string norm = dirs[i];
    while (norm.size() > 1 && norm.back() == '/') norm.pop_back();
    if (!seen.insert(norm).second) {
      return invalid_argument("swap store: aio.nvme_path[" + std::to_string(i) + "] '" + dirs[i] +
                              "' is listed twice");
    }
  }
  if (capacity == 0) return invalid_argument("swap store: capacity must be positive");
  if (stripe_unit < 4096 || stripe_unit % 4096 != 0) {
    return invalid_argument("swap store: stripe unit " + std::to_string(stripe_unit) +
                            " must be a positive multiple of 4096");
  }
  if (checksum_block < 4096 || checksum_block > (16u << 20) || (checksum_block & (checksum_block - 1)) != 0) {
    return invalid_argument("swap store: checksum block " + std::to_string(checksum_block) +
                            " must be a power of two between 4 KiB and 16 MiB");
  }
  return ok_status();
}

namespace {

constexpr const char* kJournalName = "strata-swap.journal";
constexpr const char* kLockName = "strata-swap.lock";
constexpr std::size_t kMaxNameBytes = 4096;

std::string data_name(std::size_t i) { return "strata-swap." + std::to_string(i) + ".data"; }

std::string hex32(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

struct Version {
  TensorKey key;
  std::uint64_t seq = 0;
  std::uint64_t size = 0;
  std::vector<Extent> extents;
  std::vector<std::uint32_t> crcs;
  std::uint64_t record_bytes = 0;  // size of its journal record once published
  int pins = 0;                    // reads in flight
  bool retired = false;
  bool freed = false;
};

Status write_all(int fd, const std::string& bytes, const std::string& path) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return io_error("write to " + path + " failed: " + nvme_detail::errno_text(errno));
    }
    done += static_cast<std::size_t>(n);
  }
  return ok_status();
}

Status fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return io_error("cannot open directory " + dir + ": " + nvme_detail::errno_text(errno));
  int r = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (r != 0) return io_error("fsync of directory " + dir + " failed: " + nvme_detail::errno_text(err));
  return ok_status();
}

// Writes `image` to `path` atomically (temp file, fdatasync, rename, fsync of the directory)
// and returns a descriptor of the new file open for appending.
Result<int> replace_file(const std::string& dir, const std::string& path, const std::string& image) {
  std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return io_error("cannot create " + tmp + ": " + nvme_detail::errno_text(errno));
  Status s = write_all(fd, image, tmp);
  if (s.ok() && ::fdatasync(fd) != 0)
    s = io_error("fdatasync of " + tmp + " failed: " + nvme_detail::errno_text(errno));
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    s = io_error("cannot rename " + tmp + " to " + path + ": " + nvme_detail::errno_text(errno));
  }
  if (s.ok()) s = fsync_dir(dir);
  if (!s.ok()) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return s;
  }
  return fd;
}

}  // namespace

struct SwapStore::Impl {
  IoEngine* engine = nullptr;
  SwapStoreConfig config;
  JournalHeader header;
  std::vector<std::string> member_paths;
  std::uint64_t capacity = 0;  // logical: member_capacity x dirs
  std::uint64_t chunk = 0;     // bytes per engine request: whole checksum blocks, >= block_size

  // Cuts the first `bytes` of a version into engine requests: one per chunk, each within one
  // extent, in tensor order. fn(file offset, tensor offset, length).
  template <typename Fn>
  void for_each_chunk(const Version& v, std::uint64_t bytes, Fn fn) const {
    std::uint64_t t = 0;
    for (const Extent& x : v.extents) {
      for (std::uint64_t within = 0; within < x.length && t < bytes; within += chunk) {
        const std::uint64_t len = std::min({chunk, x.length - within, bytes - t});
        fn(x.offset + within, t, len);
        t += len;
      }
    }
  }
  FileId file;
  int lock_fd = -1;
  std::string journal_path;
  int journal_fd = -1;

  mutable std::mutex mu;
  std::condition_variable idle;
  ExtentAllocator alloc;
  struct Entry {
    std::shared_ptr<Version> current;
    std::uint64_t last_seq = 0;  // of the last publish or remove
  };
  std::map<TensorKey, Entry> entries;
  std::set<Version*> live;  // versions holding extents
  std::uint64_t next_seq = 1;
  std::int64_t inflight = 0;
  std::uint64_t journal_bytes = 0;
  std::uint64_t live_record_bytes = 0;
  Status journal_broken;
  std::atomic<std::uint64_t> checksum_failures{0};
  SwapRecovery recovery;
  std::map<TensorKey, std::string> lost;  // dropped at open (salvage_journal): why

  // kNotFound for a key the store does not hold, kDataLoss for one salvage dropped. Under mu.
  Status missing(const TensorKey& key) const {
    if (auto it = lost.find(key); it != lost.end()) {
      return data_loss("tensor " + key.to_string() + " was lost when the swap journal " + journal_path +
                       " was salvaged: " + it->second + "; write it again");
    }
    return not_found("tensor " + key.to_string() + " is not in the swap store (" + dirs_text() + ")");
  }
  std::uint64_t journal_syncs = 0;  // under mu (append() runs under it)

  ~Impl() {
    if (file.valid()) (void)engine->close(file);
    if (journal_fd >= 0) ::close(journal_fd);
    if (lock_fd >= 0) ::close(lock_fd);
  }

  std::string dirs_text() const {
    std::string s;
    for (const auto& d : config.dirs) s += (s.empty() ? "" : ", ") + d;
    return s;
  }

  // The swap file and offset holding logical byte `logical`.
  std::pair<std::string, std::uint64_t> where(std::uint64_t logical) const {
    std::size_t n = member_paths.size();
    if (n == 1) return {member_paths[0], logical};
    std::uint64_t su = config.stripe_unit, stripe = logical / su;
    return {member_paths[stripe % n], (stripe / n) * su + logical % su};
  }

  void retire(Version& v) {
    v.retired = true;
    release_if_unused(v);
  }
  void release_if_unused(Version& v) {
    if (!v.retired || v.pins > 0 || v.freed) return;
    for (const auto& e : v.extents) alloc.free(e);
    live.erase(&v);
    v.freed = true;
  }

  // Appends one record; on failure the journal is cut back so later records stay reachable.
  Status append(const std::string& record) {
    if (!journal_broken.ok()) return journal_broken;
    Status s = write_all(journal_fd, record, journal_path);
    if (s.ok() && config.durable) {
      if (::fdatasync(journal_fd) != 0) {
        s = io_error("fdatasync of " + journal_path + " failed: " + nvme_detail::errno_text(errno));
      } else {
        ++journal_syncs;
      }
    }
    if (!s.ok()) {
      if (::ftruncate(journal_fd, static_cast<off_t>(journal_bytes)) != 0) {
        journal_broken = s.with_context("swap journal unusable (could not cut back a partial record)");
      }
      return s;
    }
    journal_bytes += record.size();
    return ok_status();
  }

  JournalPut record_of(const Version& v) const {
    JournalPut p;
    p.key = v.key;
    p.seq = v.seq;
    p.size = v.size;
    p.extents = v.extents;
    p.crcs = v.crcs;
    return p;
  }

  // Rewrites the journal with only the published versions once dead records dominate it.
  void maybe_compact() {
    std::uint64_t live_bytes = live_record_bytes + nvme_detail::encode_header(header).size();
    if (journal_bytes < config.journal_compact_bytes || journal_bytes < 4 * live_bytes) return;
    std::string image = nvme_detail::encode_header(header);
    for (const auto& [key, e] : entries) {
      if (e.current) image += nvme_detail::encode(record_of(*e.current));
    }
    auto fd = replace_file(config.dirs[0], journal_path, image);
    if (!fd.ok()) {
      STRATA_LOG(kWarn, kNvme) << "swap journal compaction skipped: " << fd.status().message();
      return;
    }
    ::close(journal_fd);
    journal_fd = *fd;
    journal_bytes = image.size();
  }

  // "[a, b)" for an extent, even when b would not fit in 64 bits.
  static std::string extent_text(const Extent& x) {
    if (x.length > UINT64_MAX - x.offset) {
      return "[" + std::to_string(x.offset) + ", " + std::to_string(x.offset) + " + " +
             std::to_string(x.length) + ")";
    }
    return "[" + std::to_string(x.offset) + ", " + std::to_string(x.offset + x.length) + ")";
  }

  // Rebuilds the published versions from the journal, the last record of a key winning. A
  // version is kept only when the journal proves it current: no damage after its record, and
  // extents that are aligned, inside the swap files and nobody else's. The others go to `lost`
  // and recovery.status describes it all (OK when there is nothing to say). Used by open()
  // before anything is written, so a refused journal stays as it was.
  void replay(nvme_detail::JournalContents& c) {
    using nvme_detail::JournalDamage;
    recovery.torn_tail_bytes = c.file_bytes - c.valid_bytes;
    std::map<TensorKey, std::uint64_t> last_offset;  // of each key's last intact record
    for (std::size_t i = 0; i < c.records.size(); ++i) {
      const std::uint64_t at = c.record_offsets[i];
      if (auto* put = std::get_if<JournalPut>(&c.records[i])) {
        auto v = std::make_shared<Version>();
        v->key = put->key;
        v->seq = put->seq;
        v->size = put->size;
        v->extents = std::move(put->extents);
        v->crcs = std::move(put->crcs);
        next_seq = std::max(next_seq, v->seq + 1);
        last_offset[v->key] = at;
        auto& e = entries[v->key];
        e.last_seq = put->seq;
        e.current = std::move(v);
      } else {
        const auto& rm = std::get<JournalRemove>(c.records[i]);
        next_seq = std::max(next_seq, rm.seq + 1);
        last_offset[rm.key] = at;
        auto& e = entries[rm.key];
        e.current = nullptr;
        e.last_seq = rm.seq;
      }
    }
    for (const auto& d : c.damage) recovery.damage.push_back({d.offset, d.bytes, d.reason});
    auto location = [&](const Version& v) {
      std::string where_text = std::to_string(v.size) + " bytes";
      if (!v.extents.empty() && v.extents[0].offset < capacity) {
        auto [path, off] = where(v.extents[0].offset);
        where_text += " at " + path + " offset " + std::to_string(off);
      }
      return where_text;
    };

    // Damage may hide a newer version or a removal of any key recorded before it.
    for (auto& [key, e] : entries) {
      if (!e.current) continue;
      const std::uint64_t at = last_offset[key];
      for (const JournalDamage& d : c.damage) {
        if (d.offset > at) {
          lost[key] = location(*e.current) + "; its last record, at offset " + std::to_string(at) +
                      ", precedes the damaged record at offset " + std::to_string(d.offset) +
                      ", which may have replaced or removed it";
          break;
        }
      }
    }
    // The damaged record's own key, unless an intact later record settles it.
    for (const JournalDamage& d : c.damage) {
      if (!d.suspect_key) continue;
      auto it = last_offset.find(*d.suspect_key);
      if (it != last_offset.end() && it->second > d.offset) continue;
      lost[*d.suspect_key] = "the damaged record at offset " + std::to_string(d.offset) + " looks like " +
                             d.suspect + " (unverified)";
    }

    // Extents, later records first: of two overlapping versions the earlier one is stale.
    std::vector<std::pair<std::uint64_t, TensorKey>> order;
    for (const auto& [key, e] : entries) {
      if (e.current && lost.count(key) == 0) order.push_back({last_offset[key], key});
    }
    std::sort(order.rbegin(), order.rend());
    struct Owner {
      Extent extent;
      TensorKey key;
      std::uint64_t at = 0;  // its record's offset
    };
    std::map<std::uint64_t, Owner> owner;  // by extent offset
    const std::uint64_t cb = config.checksum_block;
    for (const auto& [at, key] : order) {
      Version& v = *entries[key].current;
      const std::string rec = "the record at offset " + std::to_string(at) + " puts " + key.to_string();
      std::string why;
      std::uint64_t held = 0;
      for (const auto& x : v.extents) {
        if (x.offset % nvme_detail::kExtentAlign != 0 || x.length % nvme_detail::kExtentAlign != 0) {
          why = rec + " at " + extent_text(x) + ", which is not " +
                std::to_string(nvme_detail::kExtentAlign) + "-byte aligned";
        } else if (x.offset > capacity || x.length > capacity - x.offset) {
          why = rec + " at " + extent_text(x) + ", beyond the end of the swap files (" +
                std::to_string(capacity) + " bytes)";
        }
        if (!why.empty()) break;
        held += x.length;
      }
      const std::uint64_t blocks = config.checksums ? (v.size + cb - 1) / cb : 0;
      if (why.empty() && held < v.size) {
        why = rec + " of " + std::to_string(v.size) + " bytes, but its extents hold " + std::to_string(held);
      }
      if (why.empty() && v.crcs.size() != blocks) {
        why = rec + " with " + std::to_string(v.crcs.size()) + " block checksums, expected " +
              std::to_string(blocks) + " (" + std::to_string(v.size) + " bytes in blocks of " +
              std::to_string(cb) + ")";
      }
      std::vector<Extent> taken;
      for (std::size_t i = 0; why.empty() && i < v.extents.size(); ++i) {
        const Extent& x = v.extents[i];
        if (alloc.take(x)) {
          taken.push_back(x);
          continue;
        }
        std::string other = "another extent of its own";
        auto it = owner.upper_bound(x.offset + x.length - 1);
        if (it != owner.begin()) {
          --it;
          const Owner& o = it->second;
          if (o.extent.offset + o.extent.length > x.offset) {
            other = o.key.to_string() + "'s extent " + extent_text(o.extent) +
                    ", recorded later (at offset " + std::to_string(o.at) + ")";
          }
        }
        why = rec + " at " + extent_text(x) + ", which overlaps " + other;
      }
      if (!why.empty()) {
        for (const auto& x : taken) alloc.free(x);
        lost[key] = why;
        continue;
      }
      for (const auto& x : v.extents) owner[x.offset] = {x, key, at};
    }

    std::size_t kept = 0;
    for (auto& [key, e] : entries) {
      if (!e.current) continue;
      if (lost.count(key) != 0) {
        e.current = nullptr;
        continue;
      }
      Version& v = *e.current;
      v.record_bytes = nvme_detail::encode(record_of(v)).size();
      live_record_bytes += v.record_bytes;
      live.insert(&v);
      ++kept;
    }
    for (const auto& [key, why] : lost) recovery.lost.push_back(key);
    if (c.damage.empty() && lost.empty()) return;

    std::string m = "swap journal " + journal_path + ": ";
    constexpr std::size_t kListed = 8;
    for (std::size_t i = 0; i < c.damage.size() && i < kListed; ++i) {
      const JournalDamage& d = c.damage[i];
      m += "the record at offset " + std::to_string(d.offset) + " is damaged (" + d.reason + "; " +
           std::to_string(d.bytes) + " bytes skipped to the next intact record)";
      if (!d.suspect.empty()) m += "; it looks like " + d.suspect + " (unverified)";
      m += "; ";
    }
    if (c.damage.size() > kListed)
      m += "and " + std::to_string(c.damage.size() - kListed) + " more damaged records; ";
    if (!c.damage.empty()) {
      std::size_t later = 0;
      for (std::uint64_t at : c.record_offsets) later += at > c.damage[0].offset;
      m += std::to_string(later) + " later records are intact. ";
    }
    if (!lost.empty()) {
      m += "No current version can be proven for " + std::to_string(lost.size()) + " tensor(s): ";
      std::size_t i = 0;
      for (const auto& [key, why] : lost) {
        if (i == kListed) {
          m += "; and " + std::to_string(lost.size() - kListed) + " more";
          break;
        }
        m += (i++ == 0 ? "" : "; ") + key.to_string() + " (" + why + ")";
      }
      m += ". ";
    }
    m += std::to_string(kept) + " tensor(s) are proven. ";
    if (config.salvage_journal) {
      m += "Salvaged: those are kept, the others dropped; the damaged journal is kept as " + journal_path +
           ".damaged";
    } else {
      m += "Nothing was changed on disk. Open with SwapStoreConfig::salvage_journal to keep the proven "
           "tensors "
           "and drop the others, or remove the store's strata-swap.* files to start over";
    }
    recovery.status = data_loss(m);
  }

  // Publishes `v` for its key unless a later write or remove already won. Under mu.
  Status publish(const std::shared_ptr<Version>& v) {
    Entry& e = entries[v->key];
    if (v->seq <= e.last_seq) {
      retire(*v);
      return ok_status();
    }
    std::string record = nvme_detail::encode(record_of(*v));
    STRATA_RETURN_IF_ERROR(append(record));
    v->record_bytes = record.size();
    if (e.current) {
      live_record_bytes -= e.current->record_bytes;
      retire(*e.current);
    }
    e.current = v;
    e.last_seq = v->seq;
    lost.erase(v->key);
    live_record_bytes += v->record_bytes;
    maybe_compact();
    return ok_status();
  }

  void finish_one() {
    --inflight;
    if (inflight == 0) idle.notify_all();
  }
};

SwapStore::SwapStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

SwapStore::~SwapStore() {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->idle.wait(lock, [&] { return impl_->inflight == 0; });
}

const SwapStoreConfig& SwapStore::config() const { return impl_->config; }

const SwapRecovery& SwapStore::recovery() const { return impl_->recovery; }

bool SwapStore::direct_io() const { return impl_->engine->is_direct(impl_->file); }

Result<std::unique_ptr<SwapStore>> SwapStore::open(IoEngine& engine, const SwapStoreConfig& config) {
  STRATA_RETURN_IF_ERROR(config.validate());
  auto impl = std::make_unique<Impl>();
  Impl& s = *impl;
  s.engine = &engine;
  s.config = config;
  const std::size_t n = config.dirs.size();
  for (const auto& dir : config.dirs) {
    struct stat st;
    if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return not_found("swap directory " + dir + " does not exist (aio.nvme_path)");
    }
  }
  for (std::size_t i = 0; i < n; ++i) s.member_paths.push_back(config.dirs[i] + "/" + data_name(i));
  std::string lock_path = config.dirs[0] + "/" + kLockName;
  s.lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (s.lock_fd < 0) return io_error("cannot create " + lock_path + ": " + nvme_detail::errno_text(errno));
  if (::flock(s.lock_fd, LOCK_EX | LOCK_NB) != 0) {
    return failed_precondition("the swap store in " + config.dirs[0] + " is in use by another process (" +
                               lock_path + " is locked)");
  }

  s.header.dirs = static_cast<std::uint32_t>(n);
  s.header.stripe_unit = n > 1 ? config.stripe_unit : 0;
  s.header.member_capacity = n > 1 ? align_up((config.capacity + n - 1) / n, config.stripe_unit)
                                   : align_up(config.capacity, nvme_detail::kExtentAlign);
  s.header.checksum_block = config.checksum_block;
  s.header.checksums = config.checksums;
  s.capacity = s.header.member_capacity * n;
  s.chunk = align_up(engine.config().block_size, config.checksum_block);
  s.journal_path = config.dirs[0] + "/" + kJournalName;

  nvme_detail::JournalContents contents;
  bool existing = std::filesystem::exists(s.journal_path);
  if (existing && config.scratch) {
    return failed_precondition("a scratch swap store needs a directory without a store, but " + s.journal_path +
                               " exists: remove the store's strata-swap.* files or give another directory");
  }
  if (existing) {
    std::FILE* f = std::fopen(s.journal_path.c_str(), "rb");
    if (f == nullptr)
      return io_error("cannot read " + s.journal_path + ": " + nvme_detail::errno_text(errno));
    std::string image;
    char buf[1 << 16];
    std::size_t got;
    while ((got = std::fread(buf, 1, sizeof buf, f)) > 0) image.append(buf, got);
    bool bad = std::ferror(f) != 0;
    std::fclose(f);
    if (bad) return io_error("cannot read " + s.journal_path);
    STRATA_ASSIGN_OR_RETURN(contents, nvme_detail::decode_journal(image, s.journal_path));
    const JournalHeader& h = contents.header;
    auto describe = [](const JournalHeader& x) {
      return std::to_string(x.dirs) + " directories of " + format_bytes(x.member_capacity) +
             ", stripe unit " + format_bytes(x.stripe_unit) + ", checksum block " +
             format_bytes(x.checksum_block) + ", checksums " + (x.checksums ? "on" : "off");
    };
    if (h.dirs != s.header.dirs || h.member_capacity != s.header.member_capacity ||
        h.stripe_unit != s.header.stripe_unit || h.checksum_block != s.header.checksum_block ||
        h.checksums != s.header.checksums) {
      return failed_precondition("the swap store in " + s.dirs_text() + " was created with " + describe(h) +
                                 "; the config asks for " + describe(s.header) +
                                 ". Use the same settings, or remove its strata-swap.* files to start over");
    }
    for (const auto& p : s.member_paths) {
      const std::string expects = "its journal " + s.journal_path + " expects " +
                                  std::to_string(h.member_capacity) + " bytes (" +
                                  format_bytes(h.member_capacity) + ") there";
      struct stat st;
      if (::stat(p.c_str(), &st) != 0) {
        return data_loss("swap file " + p + " is missing (" + nvme_detail::errno_text(errno) + "); " +
                         expects + ". Restore it, or remove the store's strata-swap.* files to start over");
      }
      if (static_cast<std::uint64_t>(st.st_size) < h.member_capacity) {
        return data_loss("swap file " + p + " has " + std::to_string(st.st_size) + " bytes; " + expects +
                         ". It was truncated; remove the store's strata-swap.* files to start over");
      }
    }
  } else {
    // A new store: check the space first so nothing is written when it cannot fit.
    for (std::size_t i = 0; i < n; ++i) {
      struct stat st;
      std::uint64_t have =
          ::stat(s.member_paths[i].c_str(), &st) == 0 ? static_cast<std::uint64_t>(st.st_blocks) * 512 : 0;
      std::uint64_t need = s.header.member_capacity > have ? s.header.member_capacity - have : 0;
      struct statvfs vfs;
      if (need > 0 && ::statvfs(config.dirs[i].c_str(), &vfs) == 0) {
        std::uint64_t avail = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
        if (avail < need) {
          return out_of_memory(
              "not enough space in " + config.dirs[i] + " for a " + format_bytes(s.header.member_capacity) +
              " swap file: " + format_bytes(avail) + " free (swap capacity " + format_bytes(config.capacity) +
              " over " + std::to_string(n) + " directories); free space there or lower the swap capacity");
        }
      }
    }
  }

  // Replay, before anything on disk changes: a journal that cannot be trusted is refused
  // (or salvaged) with the files as they were.
  s.alloc = ExtentAllocator(s.capacity);
  s.recovery.journal = s.journal_path;
  if (existing) {
    s.replay(contents);
    if (!s.recovery.status.ok() && !config.salvage_journal) return s.recovery.status;
  }

  std::vector<bool> created(n);
  for (std::size_t i = 0; i < n; ++i) created[i] = !std::filesystem::exists(s.member_paths[i]);
  auto file = engine.open_striped(s.member_paths, n > 1 ? config.stripe_unit : 0, OpenMode::kCreate);
  if (!file.ok()) return file.status().with_context("swap store");
  s.file = *file;
  if (!existing) {
    Status pre = engine.preallocate(s.file, s.capacity);
    if (pre.ok()) {
      auto fd = replace_file(config.dirs[0], s.journal_path, nvme_detail::encode_header(s.header));
      if (fd.ok()) {
        s.journal_fd = *fd;
      } else {
        pre = fd.status();
      }
    }
    if (!pre.ok()) {
      (void)engine.close(s.file);
      s.file = FileId{};
      for (std::size_t i = 0; i < n; ++i) {
        if (created[i]) ::unlink(s.member_paths[i].c_str());
      }
      return pre.with_context("creating the swap store (" + format_bytes(s.capacity) + " in " +
                              s.dirs_text() + ")");
    }
    s.journal_bytes = nvme_detail::encode_header(s.header).size();
  } else if (!s.recovery.status.ok()) {
    // Salvage: keep the damaged journal for inspection, then write one with the kept versions.
    s.recovery.damaged_copy = s.journal_path + ".damaged";
    std::error_code ec;
    std::filesystem::copy_file(s.journal_path, s.recovery.damaged_copy,
                               std::filesystem::copy_options::overwrite_existing, ec);
    if (ec) {
      return io_error("cannot keep the damaged swap journal as " + s.recovery.damaged_copy + ": " +
                      ec.message())
          .with_context(s.recovery.status.message());
    }
    std::string image = nvme_detail::encode_header(s.header);
    for (const auto& [key, e] : s.entries) {
      if (e.current) image += nvme_detail::encode(s.record_of(*e.current));
    }
    STRATA_ASSIGN_OR_RETURN(s.journal_fd, replace_file(config.dirs[0], s.journal_path, image));
    s.journal_bytes = image.size();
    STRATA_LOG(kWarn, kNvme) << s.recovery.status.message();
  } else {
    if (contents.valid_bytes < contents.file_bytes) {
      s.recovery.torn_tail_bytes = contents.file_bytes - contents.valid_bytes;
      STRATA_LOG(kWarn, kNvme) << "swap journal " << s.journal_path << ": ignoring "
                               << contents.file_bytes - contents.valid_bytes
                               << " bytes of a torn record at offset " << contents.valid_bytes
                               << " (a crash during a write; earlier versions are kept)";
      if (::truncate(s.journal_path.c_str(), static_cast<off_t>(contents.valid_bytes)) != 0) {
        return io_error("cannot truncate " + s.journal_path + ": " + nvme_detail::errno_text(errno));
      }
    }
    s.journal_bytes = contents.valid_bytes;
  }
  if (s.journal_fd < 0) s.journal_fd = ::open(s.journal_path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (s.journal_fd < 0)
    return io_error("cannot open " + s.journal_path + ": " + nvme_detail::errno_text(errno));
  if (config.scratch) {
    // The engine holds every descriptor of the data files (buffered and O_DIRECT, opened by
    // open_striped above), so the names can go now: the inodes live while the engine has them open.
    for (const auto& path : s.member_paths) {
      if (::unlink(path.c_str()) != 0) {
        return io_error("cannot unlink the scratch swap file " + path + ": " + nvme_detail::errno_text(errno));
      }
    }
  }
  return std::unique_ptr<SwapStore>(new SwapStore(std::move(impl)));
}

IoHandle SwapStore::write(const TensorKey& key, const void* data, std::uint64_t bytes) {
  Impl& s = *impl_;
  if (key.name.empty() || key.name.size() > kMaxNameBytes) {
    return IoHandle::completed(invalid_argument("swap store: tensor name must have 1 to 4096 bytes"));
  }
  if (bytes > 0 && data == nullptr) {
    return IoHandle::completed(invalid_argument("swap store: null buffer writing " + key.to_string()));
  }
  auto v = std::make_shared<Version>();
  v->key = key;
  v->size = bytes;
  const std::uint64_t cb = s.config.checksum_block;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    std::uint64_t need = align_up(bytes, nvme_detail::kExtentAlign);
    auto extents = s.alloc.allocate(need, s.chunk);
    if (!extents) {
      std::string prev;
      auto it = s.entries.find(key);
      if (it != s.entries.end() && it->second.current) {
        prev = "; its current version (" + format_bytes(it->second.current->size) +
               ") stays readable and is only freed once a new one is written";
      }
      return IoHandle::completed(
          out_of_memory("swap store full: writing " + key.to_string() + " needs " + format_bytes(need) +
                        " but " + format_bytes(s.alloc.free_bytes()) + " of " + format_bytes(s.capacity) +
                        " is free (largest free extent " + format_bytes(s.alloc.largest_free()) + ") in " +
                        s.dirs_text() + prev + ". Raise the swap capacity or add aio.nvme_path directories"));
    }
    v->extents = std::move(*extents);
    v->seq = s.next_seq++;
    if (s.config.checksums) v->crcs.assign((bytes + cb - 1) / cb, 0);
    s.live.insert(v.get());
    if (bytes == 0) {
      Status st = s.publish(v);
      if (!st.ok()) s.retire(*v);
      return IoHandle::completed(st);
    }
    ++s.inflight;
  }

  // One request per chunk; a chunk lies within one extent (extents but the last are whole
  // chunks) and covers whole checksum blocks, so each request checksums its own blocks.
  std::vector<IoRequest> requests;
  auto* base = static_cast<unsigned char*>(const_cast<void*>(data));
  s.for_each_chunk(*v, bytes, [&](std::uint64_t offset, std::uint64_t t, std::uint64_t len) {
    IoRequest r;
    r.op = IoOp::kWrite;
    r.file = s.file;
    r.offset = offset;
    r.length = len;
    r.buffer = base + t;
    if (s.config.checksums) {
      Version* vp = v.get();
      r.on_done = [vp, base, t, len, cb](const IoRequest&) {
        for (std::uint64_t b = t; b < t + len; b += cb) {
          vp->crcs[b / cb] = crc32c(base + b, std::min(cb, t + len - b));
        }
        return ok_status();
      };
    }
    requests.push_back(std::move(r));
  });
  Impl* sp = impl_.get();
  return s.engine->impl_->submit(std::move(requests), [sp, v](Status st) -> Status {
    if (st.ok() && sp->config.durable) st = sp->engine->sync(sp->file);
    std::lock_guard<std::mutex> lock(sp->mu);
    if (st.ok()) st = sp->publish(v);
    if (!st.ok()) {
      sp->retire(*v);  // the previous version, if any, stays current
      st = st.with_context("swap write of " + v->key.to_string() + " (the previous version is kept)");
    }
    sp->finish_one();
    return st;
  });
}

IoHandle SwapStore::read(const TensorKey& key, void* data, std::uint64_t bytes) {
  Impl& s = *impl_;
  std::shared_ptr<Version> v;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.entries.find(key);
    if (it == s.entries.end() || !it->second.current) return IoHandle::completed(s.missing(key));
    v = it->second.current;
    if (bytes != v->size) {
      return IoHandle::completed(invalid_argument(
          "reading " + key.to_string() + " from the swap store: asked for " + std::to_string(bytes) +
          " bytes, the stored version has " + std::to_string(v->size)));
    }
    if (bytes > 0 && data == nullptr) {
      return IoHandle::completed(invalid_argument("swap store: null buffer reading " + key.to_string()));
    }
    if (bytes == 0) return IoHandle::completed(ok_status());
    ++v->pins;
    ++s.inflight;
  }
  const std::uint64_t cb = s.config.checksum_block;
  std::vector<IoRequest> requests;
  auto* base = static_cast<unsigned char*>(data);
  Impl* sp = impl_.get();
  s.for_each_chunk(*v, bytes, [&](std::uint64_t offset, std::uint64_t t, std::uint64_t len) {
    IoRequest r;
    r.op = IoOp::kRead;
    r.file = s.file;
    r.offset = offset;
    r.length = len;
    r.buffer = base + t;
    if (s.config.checksums) {
      Version* vp = v.get();
      std::uint64_t logical = offset;
      r.on_done = [sp, vp, base, t, len, cb, logical](const IoRequest&) -> Status {
        for (std::uint64_t b = t; b < t + len; b += cb) {
          std::uint64_t n = std::min(cb, t + len - b);
          std::uint32_t got = crc32c(base + b, n);
          std::uint32_t want = vp->crcs[b / cb];
          if (got != want) {
            sp->checksum_failures.fetch_add(1, std::memory_order_relaxed);
            auto [path, off] = sp->where(logical + (b - t));
            return data_loss("checksum mismatch in tensor " + vp->key.to_string() + " at " + path +
                             " offset " + std::to_string(off) + " (block " + std::to_string(b / cb) +
                             ", tensor bytes " + std::to_string(b) + ".." + std::to_string(b + n) +
                             "): stored crc32c " + hex32(want) + ", read " + hex32(got));
          }
        }
        return ok_status();
      };
    }
    requests.push_back(std::move(r));
  });
  return s.engine->impl_->submit(std::move(requests), [sp, v](Status st) -> Status {
    std::lock_guard<std::mutex> lock(sp->mu);
    --v->pins;
    sp->release_if_unused(*v);
    sp->finish_one();
    if (!st.ok() && st.code() != StatusCode::kDataLoss) {
      st = st.with_context("swap read of " + v->key.to_string());
    }
    return st;
  });
}

Status SwapStore::remove(const TensorKey& key) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.lost.erase(key) != 0) return ok_status();  // dropped by salvage: nothing left to remove
  auto it = s.entries.find(key);
  if (it == s.entries.end() || !it->second.current) return s.missing(key);
  JournalRemove rm;
  rm.key = key;
  rm.seq = s.next_seq++;
  STRATA_RETURN_IF_ERROR(s.append(nvme_detail::encode(rm)));
  Impl::Entry& e = it->second;
  s.live_record_bytes -= e.current->record_bytes;
  s.retire(*e.current);
  e.current = nullptr;
  e.last_seq = rm.seq;
  s.maybe_compact();
  return ok_status();
}

bool SwapStore::contains(const TensorKey& key) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->entries.find(key);
  return it != impl_->entries.end() && it->second.current != nullptr;
}

Result<std::uint64_t> SwapStore::size_of(const TensorKey& key) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->entries.find(key);
  if (it == impl_->entries.end() || !it->second.current) return impl_->missing(key);
  return it->second.current->size;
}

Result<SwapLocation> SwapStore::locate(const TensorKey& key) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->entries.find(key);
  if (it == impl_->entries.end() || !it->second.current) return impl_->missing(key);
  const Version& v = *it->second.current;
  SwapLocation loc;
  loc.bytes = v.size;
  if (!v.extents.empty()) std::tie(loc.path, loc.offset) = impl_->where(v.extents[0].offset);
  return loc;
}

std::vector<TensorKey> SwapStore::keys() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<TensorKey> out;
  for (const auto& [key, e] : impl_->entries) {
    if (e.current) out.push_back(key);
  }
  return out;
}

SwapStoreStats SwapStore::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  SwapStoreStats st;
  st.capacity = impl_->capacity;
  st.free_bytes = impl_->alloc.free_bytes();
  st.used_bytes = st.capacity - st.free_bytes;
  st.largest_free_extent = impl_->alloc.largest_free();
  for (const auto& [key, e] : impl_->entries) st.tensors += e.current != nullptr;
  st.journal_bytes = impl_->journal_bytes;
  st.checksum_failures = impl_->checksum_failures.load();
  st.journal_syncs = impl_->journal_syncs;
  return st;
}

Status SwapStore::is_valid() const {
  const Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu);
  STRATA_RETURN_IF_ERROR(s.alloc.is_valid());
  std::vector<std::pair<Extent, std::string>> all;
  for (const auto& [off, len] : s.alloc.free_map()) all.push_back({{off, len}, "free space"});
  for (const Version* v : s.live) {
    if (v->freed)
      return internal_error("swap store: freed version of " + v->key.to_string() + " is still live");
    for (const auto& x : v->extents) all.push_back({x, v->key.to_string()});
  }
  std::sort(all.begin(), all.end(),
            [](const auto& a, const auto& b) { return a.first.offset < b.first.offset; });
  std::uint64_t expect = 0;
  for (const auto& [x, who] : all) {
    if (x.offset != expect) {
      return internal_error("swap store: " + std::string(x.offset < expect ? "overlap" : "leak") +
                            " at logical offset " + std::to_string(std::min(x.offset, expect)) + " (" + who +
                            ")");
    }
    expect += x.length;
  }
  if (expect != s.capacity) {
    return internal_error("swap store: extents and free space cover " + std::to_string(expect) + " of " +
                          std::to_string(s.capacity) + " bytes");
  }
  for (const auto& [key, e] : s.entries) {
    if (!e.current) continue;
    if (e.current->retired || s.live.count(e.current.get()) == 0) {
      return internal_error("swap store: current version of " + key.to_string() + " is not live");
    }
  }
  return ok_status();
}

}  // namespace strata
