// Swap store tests: round-trips (one and several directories), copy-on-write updates, a
// failed update keeping the previous version, corruption detection naming key and file, a full
// store failing before any write, a file system too small for the store, a crash in the middle
// of a write (SIGKILL in a forked child), torn journal tails, persistence and compaction.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <thread>

#include "harness/harness.hpp"
#include "nvme/faults.hpp"
#include "nvme/swap_internal.hpp"
#include "strata/alloc.hpp"
#include "strata/nvme.hpp"

namespace strata {
namespace {

using nvme_detail::IoFaults;
using testing::TempDir;

using testing::random_bytes;

IoEngineConfig small_blocks() {
  IoEngineConfig c;
  c.block_size = 64 << 10;
  c.queue_depth = 8;
  return c;
}

std::unique_ptr<IoEngine> engine_or_die(const IoEngineConfig& cfg = small_blocks(),
                                        const IoFaults* faults = nullptr) {
  auto e = IoFaults::create_engine(cfg, nullptr, faults);
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  return e.ok() ? std::move(e).value() : nullptr;
}

SwapStoreConfig store_config(const std::vector<std::string>& dirs, std::uint64_t capacity) {
  SwapStoreConfig c;
  c.dirs = dirs;
  c.capacity = capacity;
  c.stripe_unit = 64 << 10;
  c.checksum_block = 16 << 10;
  return c;
}

std::unique_ptr<SwapStore> open_or_die(IoEngine& engine, const SwapStoreConfig& cfg) {
  auto s = SwapStore::open(engine, cfg);
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  return s.ok() ? std::move(s).value() : nullptr;
}

std::vector<unsigned char> read_back(SwapStore& store, const TensorKey& key, std::size_t n,
                                     Status* status = nullptr) {
  std::vector<unsigned char> out(n);
  Status s = store.read(key, out.data(), n).wait();
  if (status != nullptr) *status = s;
  EXPECT_TRUE(s.ok() || status != nullptr) << s.to_string();
  return out;
}

// Runs `body` in a forked child; returns its exit status and what it wrote to the pipe.
struct ChildResult {
  int status = 0;
  std::string report;
};
template <typename F>
ChildResult run_in_child(F&& body) {
  int fds[2];
  EXPECT_EQ(::pipe(fds), 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    std::string report;
    int code = body(report);
    [[maybe_unused]] auto n = ::write(fds[1], report.data(), report.size());
    ::_exit(code);
  }
  ::close(fds[1]);
  ChildResult r;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof buf)) > 0) r.report.append(buf, n);
  ::close(fds[0]);
  ::waitpid(pid, &r.status, 0);
  return r;
}

class SwapDirs : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    for (int i = 0; i < GetParam(); ++i) {
      auto d = root_.path() / ("nvme" + std::to_string(i));
      std::filesystem::create_directory(d);
      dirs_.push_back(d.string());
    }
  }
  TempDir root_{"strata-swap"};
  std::vector<std::string> dirs_;
};

TEST_P(SwapDirs, RoundTripsAwkwardSizes) {
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  auto store = open_or_die(*engine, store_config(dirs_, 16 << 20));
  ASSERT_NE(store, nullptr);
  std::vector<std::pair<TensorKey, std::vector<unsigned char>>> written;
  int shard = 0;
  for (std::size_t size : testing::awkward_sizes()) {
    TensorKey key{"layer.weight", static_cast<std::uint32_t>(shard++)};
    auto data = random_bytes(size, shard);
    // Unaligned source memory for odd shards.
    std::vector<unsigned char> src(size + 1);
    unsigned char* p = src.data() + (shard % 2);
    if (size > 0) std::memcpy(p, data.data(), size);  // an empty vector's data() may be null
    STRATA_ASSERT_OK(store->write(key, p, size).wait());
    STRATA_ASSERT_OK(store->is_valid());
    written.push_back({key, data});
  }
  for (const auto& [key, data] : written) {
    EXPECT_EQ(*store->size_of(key), data.size());
    EXPECT_EQ(read_back(*store, key, data.size()), data) << key.to_string();
  }
  auto st = store->stats();
  EXPECT_EQ(st.tensors, written.size());
  std::uint64_t expect_used = 0;
  for (const auto& [key, data] : written) expect_used += align_up(data.size(), 4096);
  EXPECT_EQ(st.used_bytes, expect_used);
  EXPECT_EQ(store->keys().size(), written.size());
  std::vector<unsigned char> one(1);
  STRATA_EXPECT_ERROR(store->read({"nope", 0}, one.data(), 1).wait(), kNotFound, "nope[shard 0]");
  std::vector<unsigned char> wrong(5);
  STRATA_EXPECT_ERROR(store->read(written[2].first, wrong.data(), 5).wait(), kInvalidArgument,
                      "asked for 5 bytes");
}

TEST_P(SwapDirs, UpdatesGoToFreshExtentsAndFreeTheOldOnes) {
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  auto store = open_or_die(*engine, store_config(dirs_, 8 << 20));
  ASSERT_NE(store, nullptr);
  TensorKey key{"adam.m", 3};
  auto v1 = random_bytes(1 << 20, 1);
  STRATA_ASSERT_OK(store->write(key, v1.data(), v1.size()).wait());
  auto where1 = *store->locate(key);
  auto v2 = random_bytes((1 << 20) + 5, 2);
  STRATA_ASSERT_OK(store->write(key, v2.data(), v2.size()).wait());
  auto where2 = *store->locate(key);
  EXPECT_TRUE(where1.path != where2.path || where1.offset != where2.offset)
      << "an update must not overwrite in place";
  EXPECT_EQ(read_back(*store, key, v2.size()), v2);
  EXPECT_EQ(store->stats().used_bytes, align_up(v2.size(), 4096)) << "the old version's space is freed";
  STRATA_ASSERT_OK(store->is_valid());
  STRATA_ASSERT_OK(store->remove(key));
  EXPECT_FALSE(store->contains(key));
  EXPECT_EQ(store->stats().used_bytes, 0u);
  STRATA_EXPECT_ERROR(store->remove(key), kNotFound, "adam.m[shard 3]");
  STRATA_ASSERT_OK(store->is_valid());
}

TEST_P(SwapDirs, AFailedUpdateKeepsThePreviousVersion) {
  IoFaults faults;
  auto engine = engine_or_die(small_blocks(), &faults);
  ASSERT_NE(engine, nullptr);
  auto store = open_or_die(*engine, store_config(dirs_, 8 << 20));
  ASSERT_NE(store, nullptr);
  TensorKey key{"w", 0};
  auto v1 = random_bytes(256 << 10, 1);
  STRATA_ASSERT_OK(store->write(key, v1.data(), v1.size()).wait());
  // The update lands right after v1 in the logical space (best fit in an otherwise empty store):
  // logical [256K, 768K). With one dir that is the file offset; with three dirs and 64 KiB
  // stripes, file offset 128K of every member holds stripes 6-8 of it.
  std::uint64_t file_offset = GetParam() == 1 ? (256 << 10) + 8192 : (128 << 10) + 4096;
  faults.add_error({IoOp::kWrite, "strata-swap", file_offset, EIO});
  auto v2 = random_bytes(512 << 10, 2);
  Status s = store->write(key, v2.data(), v2.size()).wait();
  STRATA_EXPECT_ERROR(s, kIoError, "EIO");
  STRATA_EXPECT_ERROR(s, kIoError, "previous version is kept");
  faults.clear_errors();
  EXPECT_EQ(read_back(*store, key, v1.size()), v1);
  EXPECT_EQ(store->stats().used_bytes, v1.size()) << "the failed version's extents are freed";
  STRATA_ASSERT_OK(store->is_valid());
}

INSTANTIATE_TEST_SUITE_P(Nvme, SwapDirs, ::testing::Values(1, 3),
                         [](const auto& info) { return std::to_string(info.param) + "dirs"; });

TEST(SwapStore, CorruptionIsDetectedAndNamesKeyFileAndOffset) {
  TempDir dir("strata-swap");
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  SwapStoreConfig cfg = store_config({dir.path().string()}, 4 << 20);
  TensorKey key{"blocks.7.attn.qkv", 1};
  auto data = random_bytes((300 << 10) + 7, 3);
  SwapLocation loc;
  {
    auto store = open_or_die(*engine, cfg);
    ASSERT_NE(store, nullptr);
    STRATA_ASSERT_OK(store->write(key, data.data(), data.size()).wait());
    loc = *store->locate(key);
  }
  // Flip one byte of the tensor's 5th checksum block in the swap file.
  const std::uint64_t victim = loc.offset + 4 * (16 << 10) + 123;
  {
    int fd = ::open(loc.path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    unsigned char b;
    ASSERT_EQ(::pread(fd, &b, 1, victim), 1);
    b ^= 0x40;
    ASSERT_EQ(::pwrite(fd, &b, 1, victim), 1);
    ::close(fd);
  }
  auto store = open_or_die(*engine, cfg);
  ASSERT_NE(store, nullptr);
  std::vector<unsigned char> back(data.size());
  Status s = store->read(key, back.data(), back.size()).wait();
  STRATA_EXPECT_ERROR(s, kDataLoss, "checksum mismatch");
  STRATA_EXPECT_ERROR(s, kDataLoss, key.to_string());
  STRATA_EXPECT_ERROR(s, kDataLoss, loc.path + " offset " + std::to_string(loc.offset + 4 * (16 << 10)));
  EXPECT_EQ(store->stats().checksum_failures, 1u);
  // Rewriting the tensor heals it.
  STRATA_ASSERT_OK(store->write(key, data.data(), data.size()).wait());
  EXPECT_EQ(read_back(*store, key, data.size()), data);
}

TEST(SwapStore, CorruptionOnALiveStoreIsDetectedToo) {
  TempDir dir("strata-swap");
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  auto store = open_or_die(*engine, store_config({dir.path().string()}, 4 << 20));
  ASSERT_NE(store, nullptr);
  TensorKey key{"emb", 0};
  auto data = random_bytes(70000, 4);
  STRATA_ASSERT_OK(store->write(key, data.data(), data.size()).wait());
  auto loc = *store->locate(key);
  int fd = ::open(loc.path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  unsigned char b = static_cast<unsigned char>(data[69999] ^ 1);  // the last byte, in the unaligned tail
  ASSERT_EQ(::pwrite(fd, &b, 1, loc.offset + 69999), 1);
  ::close(fd);
  std::vector<unsigned char> back(data.size());
  STRATA_EXPECT_ERROR(store->read(key, back.data(), back.size()).wait(), kDataLoss, "emb[shard 0]");
}

TEST(SwapStore, AFullStoreFailsBeforeWritingAnything) {
  TempDir dir("strata-swap");
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  auto store = open_or_die(*engine, store_config({dir.path().string()}, 1 << 20));
  ASSERT_NE(store, nullptr);
  auto a = random_bytes(600 << 10, 1), b = random_bytes(600 << 10, 2);
  STRATA_ASSERT_OK(store->write({"a", 0}, a.data(), a.size()).wait());
  std::uint64_t written = engine->stats().bytes_written;
  Status s = store->write({"b", 0}, b.data(), b.size()).wait();
  STRATA_EXPECT_ERROR(s, kOutOfMemory, "swap store full");
  STRATA_EXPECT_ERROR(s, kOutOfMemory, "b[shard 0]");
  EXPECT_EQ(engine->stats().bytes_written, written) << "nothing was written";
  // An update of `a` needs room for both versions at once: refused, and `a` stays.
  STRATA_EXPECT_ERROR(store->write({"a", 0}, b.data(), b.size()).wait(), kOutOfMemory, "stays readable");
  EXPECT_EQ(read_back(*store, {"a", 0}, a.size()), a);
  STRATA_ASSERT_OK(store->remove({"a", 0}));
  STRATA_ASSERT_OK(store->write({"b", 0}, b.data(), b.size()).wait());
  EXPECT_EQ(read_back(*store, {"b", 0}, b.size()), b);
  STRATA_ASSERT_OK(store->is_valid());
}

TEST(SwapStore, FragmentedSpaceIsUsedInSeveralExtents) {
  TempDir dir("strata-swap");
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  auto store = open_or_die(*engine, store_config({dir.path().string()}, 1 << 20));
  ASSERT_NE(store, nullptr);
  std::vector<std::vector<unsigned char>> parts;
  for (int i = 0; i < 4; ++i) {
    parts.push_back(random_bytes(256 << 10, i));
    STRATA_ASSERT_OK(
        store->write({"p", static_cast<std::uint32_t>(i)}, parts[i].data(), parts[i].size()).wait());
  }
  STRATA_ASSERT_OK(store->remove({"p", 0}));
  STRATA_ASSERT_OK(store->remove({"p", 2}));
  EXPECT_EQ(store->stats().largest_free_extent, 256u << 10);
  auto big = random_bytes((400 << 10) + 1, 9);
  STRATA_ASSERT_OK(store->write({"big", 0}, big.data(), big.size()).wait());
  STRATA_ASSERT_OK(store->is_valid());
  EXPECT_EQ(read_back(*store, {"big", 0}, big.size()), big);
  EXPECT_EQ(read_back(*store, {"p", 1}, parts[1].size()), parts[1]);
  EXPECT_EQ(read_back(*store, {"p", 3}, parts[3].size()), parts[3]);
}

TEST(SwapStore, PersistsAcrossReopenAndRefusesDifferentSettings) {
  TempDir dir("strata-swap");
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  SwapStoreConfig cfg = store_config({dir.path().string()}, 4 << 20);
  std::map<std::uint32_t, std::vector<unsigned char>> data;
  {
    auto store = open_or_die(*engine, cfg);
    ASSERT_NE(store, nullptr);
    for (std::uint32_t i = 0; i < 10; ++i) {
      data[i] = random_bytes(10000 * (i + 1), i);
      STRATA_ASSERT_OK(store->write({"t", i}, data[i].data(), data[i].size()).wait());
    }
    data[3] = random_bytes(5, 33);  // an update
    STRATA_ASSERT_OK(store->write({"t", 3}, data[3].data(), 5).wait());
    STRATA_ASSERT_OK(store->remove({"t", 7}));
    data.erase(7);
    // A second open of the same store is refused while this one is open.
    STRATA_EXPECT_ERROR(SwapStore::open(*engine, cfg), kFailedPrecondition, "in use");
  }
  auto store = open_or_die(*engine, cfg);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->keys().size(), data.size());
  EXPECT_FALSE(store->contains({"t", 7}));
  for (const auto& [i, d] : data) EXPECT_EQ(read_back(*store, {"t", i}, d.size()), d) << i;
  STRATA_ASSERT_OK(store->is_valid());
  store.reset();
  SwapStoreConfig other = cfg;
  other.capacity = 8 << 20;
  STRATA_EXPECT_ERROR(SwapStore::open(*engine, other), kFailedPrecondition, "was created with");
  other = cfg;
  other.checksum_block = 64 << 10;
  STRATA_EXPECT_ERROR(SwapStore::open(*engine, other), kFailedPrecondition, "checksum block");
}

TEST(SwapStore, TornJournalTailIsIgnored) {
  TempDir dir("strata-swap");
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  SwapStoreConfig cfg = store_config({dir.path().string()}, 4 << 20);
  auto data = random_bytes(100000, 5);
  {
    auto store = open_or_die(*engine, cfg);
    ASSERT_NE(store, nullptr);
    STRATA_ASSERT_OK(store->write({"k", 0}, data.data(), data.size()).wait());
  }
  std::string journal = (dir / "strata-swap.journal").string();
  auto full = std::filesystem::file_size(journal);
  {
    // Half of a record, as a crash in the middle of append would leave.
    std::ofstream out(journal, std::ios::binary | std::ios::app);
    out << std::string("SWJR\x02\0\0\0\xff\x00\x00\x00", 12) << std::string(40, 'z');
  }
  {
    auto store = open_or_die(*engine, cfg);
    ASSERT_NE(store, nullptr);
    EXPECT_EQ(std::filesystem::file_size(journal), full) << "the torn tail is cut off";
    EXPECT_EQ(store->recovery().torn_tail_bytes, 52u);
    STRATA_EXPECT_OK(store->recovery().status);
    EXPECT_EQ(read_back(*store, {"k", 0}, data.size()), data);
    STRATA_ASSERT_OK(store->write({"k", 1}, data.data(), data.size()).wait());
  }
  auto store = open_or_die(*engine, cfg);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(read_back(*store, {"k", 1}, data.size()), data);
}

// A process killed in the middle of writing a new version: after restart the previous version
// is there, intact.
TEST(SwapStore, CrashDuringAWriteKeepsThePreviousVersion) {
  TempDir dir("strata-swap");
  SwapStoreConfig cfg = store_config({dir.path().string()}, 16 << 20);
  auto v1 = random_bytes(1 << 20, 1), other = random_bytes(300000, 2), v2 = random_bytes(3 << 20, 3);
  ChildResult child = run_in_child([&](std::string& report) {
    IoFaults faults;
    auto engine = IoFaults::create_engine(small_blocks(), nullptr, &faults);
    if (!engine.ok()) {
      report = engine.status().to_string();
      return 1;
    }
    auto store = SwapStore::open(**engine, cfg);
    if (!store.ok()) {
      report = store.status().to_string();
      return 1;
    }
    Status s = (*store)->write({"w", 0}, v1.data(), v1.size()).wait();
    if (s.ok()) s = (*store)->write({"other", 0}, other.data(), other.size()).wait();
    if (!s.ok()) {
      report = s.to_string();
      return 1;
    }
    // Die once half of v2 has reached the disk.
    faults.kill_after_write_bytes = (*engine)->stats().bytes_written + v2.size() / 2;
    s = (*store)->write({"w", 0}, v2.data(), v2.size()).wait();
    report = "the write finished instead of crashing: " + s.to_string();
    return 2;
  });
  ASSERT_TRUE(WIFSIGNALED(child.status) && WTERMSIG(child.status) == SIGKILL)
      << "child status " << child.status << ": " << child.report;
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  auto store = open_or_die(*engine, cfg);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(*store->size_of({"w", 0}), v1.size());
  EXPECT_EQ(read_back(*store, {"w", 0}, v1.size()), v1);
  EXPECT_EQ(read_back(*store, {"other", 0}, other.size()), other);
  STRATA_ASSERT_OK(store->is_valid());
  EXPECT_EQ(store->stats().used_bytes, align_up(v1.size(), 4096) + align_up(other.size(), 4096))
      << "the half-written version's space is free again";
  STRATA_ASSERT_OK(store->write({"w", 0}, v2.data(), v2.size()).wait());
  EXPECT_EQ(read_back(*store, {"w", 0}, v2.size()), v2);
}

// A scratch store (strata train's default swap directory): the data files leave the directory as
// soon as open() has them open, reads and writes still round-trip through the open descriptors,
// and a process killed with the store open leaves no swap data behind; the journal and lock stay,
// and a second scratch store in the same directory is refused naming the journal. Without
// `scratch` the same store keeps its data files (the control).
TEST(SwapStore, AScratchStoreLeavesNoSwapDataBehindWhenItsProcessIsKilled) {
  TempDir root("strata-swap");
  std::vector<std::string> dirs;
  for (int i = 0; i < 2; ++i) {
    dirs.push_back((root.path() / ("nvme" + std::to_string(i))).string());
    std::filesystem::create_directory(dirs.back());
  }
  auto fresh_dirs = [&] {
    for (const std::string& d : dirs) {
      std::filesystem::remove_all(d);
      std::filesystem::create_directory(d);
    }
  };
  auto data_files = [&] {
    int n = 0;
    for (const std::string& d : dirs)
      for (const auto& e : std::filesystem::directory_iterator(d))
        n += e.path().extension() == ".data" ? 1 : 0;
    return n;
  };
  SwapStoreConfig cfg = store_config(dirs, 16 << 20);
  {
    auto engine = engine_or_die();
    ASSERT_NE(engine, nullptr);
    auto store = open_or_die(*engine, cfg);
    ASSERT_NE(store, nullptr);
    EXPECT_EQ(data_files(), 2) << "an ordinary store keeps its files";
  }
  fresh_dirs();
  cfg.scratch = true;
  const auto v = random_bytes(3 << 20, 7);
  {
    auto engine = engine_or_die();
    ASSERT_NE(engine, nullptr);
    auto store = open_or_die(*engine, cfg);
    ASSERT_NE(store, nullptr);
    EXPECT_EQ(data_files(), 0) << "the scratch store's files are unlinked once open";
    STRATA_ASSERT_OK(store->write({"w", 0}, v.data(), v.size()).wait());
    EXPECT_EQ(read_back(*store, {"w", 0}, v.size()), v);
    STRATA_ASSERT_OK(store->is_valid());
  }
  auto again = [&] {
    auto engine = engine_or_die();
    auto store = SwapStore::open(*engine, cfg);
    EXPECT_FALSE(store.ok());
    EXPECT_NE(store.status().message().find("strata-swap.journal"), std::string::npos) << store.status().to_string();
  };
  again();
  fresh_dirs();
  ChildResult child = run_in_child([&](std::string& report) {
    auto engine = IoEngine::create(small_blocks());
    if (!engine.ok()) {
      report = engine.status().to_string();
      return 1;
    }
    auto store = SwapStore::open(**engine, cfg);
    if (!store.ok()) {
      report = store.status().to_string();
      return 1;
    }
    Status s = (*store)->write({"w", 0}, v.data(), v.size()).wait();
    if (!s.ok()) {
      report = s.to_string();
      return 1;
    }
    ::raise(SIGKILL);
    return 2;
  });
  ASSERT_TRUE(WIFSIGNALED(child.status) && WTERMSIG(child.status) == SIGKILL)
      << "child status " << child.status << ": " << child.report;
  EXPECT_EQ(data_files(), 0) << "the killed process's swap data went with it";
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(dirs[0]) / "strata-swap.journal"));
}

// The file system cannot hold the store (RLIMIT_FSIZE below the swap file size): open fails
// naming the directory and the errno, and leaves no swap file behind.
TEST(SwapStore, AFileSystemTooSmallFailsAtOpen) {
  TempDir dir("strata-swap");
  SwapStoreConfig cfg = store_config({dir.path().string()}, 8 << 20);
  ChildResult child = run_in_child([&](std::string& report) {
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit lim{1 << 20, 1 << 20};
    ::setrlimit(RLIMIT_FSIZE, &lim);
    auto engine = IoEngine::create(small_blocks());
    if (!engine.ok()) {
      report = engine.status().to_string();
      return 1;
    }
    auto store = SwapStore::open(**engine, cfg);
    if (store.ok()) {
      report = "the store opened although it cannot fit";
      return 1;
    }
    report = store.status().to_string();
    const std::string& m = store.status().message();
    return m.find("EFBIG") != std::string::npos && m.find(dir.path().string()) != std::string::npos ? 0 : 1;
  });
  ASSERT_TRUE(WIFEXITED(child.status)) << child.report;
  EXPECT_EQ(WEXITSTATUS(child.status), 0) << child.report;
  EXPECT_FALSE(std::filesystem::exists(dir / "strata-swap.0.data")) << "no half-made swap file is left";
  EXPECT_FALSE(std::filesystem::exists(dir / "strata-swap.journal"));
  // And a capacity beyond the free space is refused before anything is allocated.
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  cfg.capacity = 1ull << 50;
  STRATA_EXPECT_ERROR(SwapStore::open(*engine, cfg), kOutOfMemory,
                      "not enough space in " + dir.path().string());
  EXPECT_FALSE(std::filesystem::exists(dir / "strata-swap.0.data"));
}

TEST(SwapStore, ConcurrentWritersAndReaders) {
  TempDir dir("strata-swap");
  IoEngineConfig acfg = small_blocks();
  acfg.intra_op_parallelism = 2;
  auto engine = engine_or_die(acfg);
  ASSERT_NE(engine, nullptr);
  auto store = open_or_die(*engine, store_config({dir.path().string()}, 64 << 20));
  ASSERT_NE(store, nullptr);
  constexpr int kThreads = 4, kRounds = 12;
  // Each thread owns keys 0..3 of its own name and also hammers a shared key.
  std::vector<std::vector<unsigned char>> shared_versions;
  for (int t = 0; t < kThreads; ++t) shared_versions.push_back(random_bytes(200000, 1000 + t));
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      std::map<std::uint32_t, std::vector<unsigned char>> mine;
      for (int r = 0; r < kRounds; ++r) {
        std::uint32_t shard = rng() % 4;
        auto d = random_bytes(1 + rng() % (400 << 10), rng());
        TensorKey key{"t" + std::to_string(t), shard};
        failures += !store->write(key, d.data(), d.size()).wait().ok();
        mine[shard] = std::move(d);
        auto h = store->write({"shared", 0}, shared_versions[t].data(), shared_versions[t].size());
        for (const auto& [s, want] : mine) {
          std::vector<unsigned char> got(want.size());
          failures += !store->read({"t" + std::to_string(t), s}, got.data(), got.size()).wait().ok();
          failures += got != want;
        }
        failures += !h.wait().ok();
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  auto shared = read_back(*store, {"shared", 0}, 200000);
  EXPECT_TRUE(std::find(shared_versions.begin(), shared_versions.end(), shared) != shared_versions.end())
      << "the shared key holds one complete version";
  STRATA_ASSERT_OK(store->is_valid());
}

TEST(SwapStore, JournalCompactionKeepsTheLiveState) {
  TempDir dir("strata-swap");
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  SwapStoreConfig cfg = store_config({dir.path().string()}, 4 << 20);
  cfg.journal_compact_bytes = 8 << 10;
  auto a = random_bytes(5000, 1);
  std::vector<unsigned char> last;
  {
    auto store = open_or_die(*engine, cfg);
    ASSERT_NE(store, nullptr);
    STRATA_ASSERT_OK(store->write({"a", 0}, a.data(), a.size()).wait());
    int compactions = 0;
    std::uint64_t prev = store->stats().journal_bytes;
    for (int i = 0; i < 400; ++i) {
      last = random_bytes(100 + i, i);
      STRATA_ASSERT_OK(store->write({"b", 0}, last.data(), last.size()).wait());
      std::uint64_t now = store->stats().journal_bytes;
      compactions += now < prev;
      prev = now;
    }
    EXPECT_LT(store->stats().journal_bytes, 8u << 10) << "400 updates, yet the journal stays small";
    EXPECT_GE(compactions, 2);
  }
  auto store = open_or_die(*engine, cfg);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(read_back(*store, {"a", 0}, a.size()), a);
  EXPECT_EQ(read_back(*store, {"b", 0}, last.size()), last);
  STRATA_ASSERT_OK(store->is_valid());
}

// Durable mode must actually flush: each published write syncs the swap file (engine syncs)
// and the journal record (journal syncs). Without it, neither happens.
TEST(SwapStore, DurableModeAndChecksumsOff) {
  TempDir dir("strata-swap");
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  SwapStoreConfig cfg = store_config({dir.path().string()}, 4 << 20);
  cfg.durable = true;
  auto d = random_bytes(333333, 1);
  {
    auto store = open_or_die(*engine, cfg);
    ASSERT_NE(store, nullptr);
    const std::uint64_t syncs_before = engine->stats().syncs;
    for (int version = 0; version < 2; ++version) {
      STRATA_ASSERT_OK(store->write({"d", 0}, d.data(), d.size()).wait());
    }
    EXPECT_GE(engine->stats().syncs - syncs_before, 2u) << "every durable write syncs the swap file";
    EXPECT_GE(store->stats().journal_syncs, 2u) << "every durable journal record is synced";
    STRATA_ASSERT_OK(store->remove({"d", 0}));
    EXPECT_GE(store->stats().journal_syncs, 3u) << "a durable remove syncs its journal record";
    STRATA_ASSERT_OK(store->write({"d", 0}, d.data(), d.size()).wait());
    EXPECT_EQ(read_back(*store, {"d", 0}, d.size()), d);
  }
  TempDir dir2("strata-swap");
  SwapStoreConfig off = store_config({dir2.path().string()}, 4 << 20);
  off.checksums = false;
  ASSERT_FALSE(off.durable);
  auto store = open_or_die(*engine, off);
  ASSERT_NE(store, nullptr);
  const std::uint64_t syncs_before = engine->stats().syncs;
  STRATA_ASSERT_OK(store->write({"d", 0}, d.data(), d.size()).wait());
  EXPECT_EQ(read_back(*store, {"d", 0}, d.size()), d);
  EXPECT_EQ(engine->stats().syncs, syncs_before) << "a non-durable write does not sync";
  EXPECT_EQ(store->stats().journal_syncs, 0u) << "a non-durable journal is not synced per record";
}

// ---- Damaged stores: every error names the file, the offset and what was expected -----------

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void overwrite_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// Offsets of the journal's records (the header first), walking the frames' length fields.
std::vector<std::uint64_t> frame_offsets(const std::string& image) {
  std::vector<std::uint64_t> out;
  std::uint64_t pos = 0;
  while (pos + 16 <= image.size()) {
    std::uint32_t len;
    std::memcpy(&len, image.data() + pos + 8, 4);
    out.push_back(pos);
    pos += 16 + len;
  }
  return out;
}

// A store in `dir` holding, in journal order: d, a (first version), b, c, a (second version).
struct DamagedJournal {
  std::vector<unsigned char> a2, c, d;
  std::string journal;
  std::uint64_t b_offset = 0;  // of b's record, whose last byte is flipped
  std::uint64_t size = 0;      // of the damaged journal
};
DamagedJournal damage_the_middle_record(IoEngine& engine, const SwapStoreConfig& cfg) {
  DamagedJournal out;
  out.d = random_bytes(20000, 1);
  auto a1 = random_bytes(30000, 2), b = random_bytes(40000, 3);
  out.c = random_bytes(50000, 4);
  out.a2 = random_bytes(60001, 5);
  {
    auto store = open_or_die(engine, cfg);
    EXPECT_NE(store, nullptr);
    if (store == nullptr) return out;
    EXPECT_TRUE(store->write({"d", 0}, out.d.data(), out.d.size()).wait().ok());
    EXPECT_TRUE(store->write({"a", 0}, a1.data(), a1.size()).wait().ok());
    EXPECT_TRUE(store->write({"b", 0}, b.data(), b.size()).wait().ok());
    EXPECT_TRUE(store->write({"c", 0}, out.c.data(), out.c.size()).wait().ok());
    EXPECT_TRUE(store->write({"a", 0}, out.a2.data(), out.a2.size()).wait().ok());
  }
  out.journal = cfg.dirs[0] + "/strata-swap.journal";
  std::string image = read_file(out.journal);
  auto offsets = frame_offsets(image);
  EXPECT_EQ(offsets.size(), 6u);
  if (offsets.size() != 6) return out;
  out.b_offset = offsets[3];
  image[offsets[4] - 1] ^= 0x10;  // the last byte of b's record: one of its block checksums
  overwrite_file(out.journal, image);
  out.size = image.size();
  return out;
}

// Corruption in the middle of the journal (not a torn tail) fails open: the message names the
// journal, the offset of the bad record, what it seems to hold and the tensors whose state can
// no longer be proven; the journal is left as it is, later records included.
TEST(SwapStore, ACorruptRecordInTheMiddleFailsOpenAndTruncatesNothing) {
  TempDir dir("strata-swap");
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  SwapStoreConfig cfg = store_config({dir.path().string()}, 4 << 20);
  DamagedJournal dj = damage_the_middle_record(*engine, cfg);
  ASSERT_GT(dj.b_offset, 0u);
  auto r = SwapStore::open(*engine, cfg);
  STRATA_EXPECT_ERROR(r, kDataLoss, dj.journal);
  STRATA_EXPECT_ERROR(r, kDataLoss, "offset " + std::to_string(dj.b_offset));
  STRATA_EXPECT_ERROR(r, kDataLoss, "checksum");
  STRATA_EXPECT_ERROR(r, kDataLoss, "b[shard 0]");  // the damaged record's own key, unverified
  STRATA_EXPECT_ERROR(r, kDataLoss, "d[shard 0]");  // its last record precedes the damage
  STRATA_EXPECT_ERROR(r, kDataLoss, "salvage_journal");
  EXPECT_EQ(std::filesystem::file_size(dj.journal), dj.size) << "the records after the damage are kept";
  // A second attempt says the same: nothing was changed.
  STRATA_EXPECT_ERROR(SwapStore::open(*engine, cfg), kDataLoss, "offset " + std::to_string(dj.b_offset));
}

TEST(SwapStore, SalvageKeepsTheProvenTensorsAndReportsTheLostOnes) {
  TempDir dir("strata-swap");
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  SwapStoreConfig cfg = store_config({dir.path().string()}, 4 << 20);
  DamagedJournal dj = damage_the_middle_record(*engine, cfg);
  ASSERT_GT(dj.b_offset, 0u);
  const std::string damaged = read_file(dj.journal);
  cfg.salvage_journal = true;
  {
    auto store = open_or_die(*engine, cfg);
    ASSERT_NE(store, nullptr);
    const SwapRecovery& rec = store->recovery();
    STRATA_EXPECT_ERROR(rec.status, kDataLoss, "offset " + std::to_string(dj.b_offset));
    STRATA_EXPECT_ERROR(rec.status, kDataLoss, "Salvaged");
    ASSERT_EQ(rec.damage.size(), 1u);
    EXPECT_EQ(rec.damage[0].offset, dj.b_offset);
    EXPECT_NE(rec.damage[0].reason.find("checksum mismatch"), std::string::npos) << rec.damage[0].reason;
    EXPECT_EQ(rec.lost, (std::vector<TensorKey>{{"b", 0}, {"d", 0}}));
    EXPECT_EQ(rec.damaged_copy, dj.journal + ".damaged");
    EXPECT_EQ(read_file(rec.damaged_copy), damaged) << "the damaged journal is kept as it was";
    // The proven tensors read back; the lost ones fail naming the journal and the offset.
    EXPECT_EQ(read_back(*store, {"a", 0}, dj.a2.size()), dj.a2);
    EXPECT_EQ(read_back(*store, {"c", 0}, dj.c.size()), dj.c);
    std::vector<unsigned char> buf(dj.d.size());
    Status s = store->read({"d", 0}, buf.data(), buf.size()).wait();
    STRATA_EXPECT_ERROR(s, kDataLoss, "d[shard 0] was lost");
    STRATA_EXPECT_ERROR(s, kDataLoss, dj.journal);
    STRATA_EXPECT_ERROR(s, kDataLoss, "offset " + std::to_string(dj.b_offset));
    STRATA_EXPECT_ERROR(store->size_of({"b", 0}), kDataLoss, "looks like a put of b[shard 0]");
    EXPECT_FALSE(store->contains({"d", 0}));
    EXPECT_EQ(store->keys().size(), 2u);
    STRATA_ASSERT_OK(store->is_valid());
    EXPECT_EQ(store->stats().used_bytes, align_up(dj.a2.size(), 4096) + align_up(dj.c.size(), 4096))
        << "the lost tensors' space is free";
    // Writing a lost key again heals it; removing one forgets it.
    STRATA_ASSERT_OK(store->write({"d", 0}, dj.d.data(), dj.d.size()).wait());
    EXPECT_EQ(read_back(*store, {"d", 0}, dj.d.size()), dj.d);
    STRATA_ASSERT_OK(store->remove({"b", 0}));
    STRATA_EXPECT_ERROR(store->size_of({"b", 0}), kNotFound, "b[shard 0]");
  }
  // The clean journal opens without salvage and holds what was kept and written since.
  cfg.salvage_journal = false;
  auto store = open_or_die(*engine, cfg);
  ASSERT_NE(store, nullptr);
  STRATA_EXPECT_OK(store->recovery().status);
  EXPECT_EQ(read_back(*store, {"a", 0}, dj.a2.size()), dj.a2);
  EXPECT_EQ(read_back(*store, {"c", 0}, dj.c.size()), dj.c);
  EXPECT_EQ(read_back(*store, {"d", 0}, dj.d.size()), dj.d);
  EXPECT_EQ(store->keys().size(), 3u);
  STRATA_ASSERT_OK(store->is_valid());
}

// A damaged length field: the record's end is unknown, yet the records after it are found.
TEST(SwapStore, ADamagedRecordLengthStillFindsTheLaterRecords) {
  TempDir dir("strata-swap");
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  SwapStoreConfig cfg = store_config({dir.path().string()}, 4 << 20);
  DamagedJournal dj = damage_the_middle_record(*engine, cfg);
  ASSERT_GT(dj.b_offset, 0u);
  std::string image = read_file(dj.journal);
  image[dj.b_offset + 11] = '\x7f';  // the top byte of b's payload length
  overwrite_file(dj.journal, image);
  auto r = SwapStore::open(*engine, cfg);
  STRATA_EXPECT_ERROR(r, kDataLoss, "offset " + std::to_string(dj.b_offset));
  STRATA_EXPECT_ERROR(r, kDataLoss, "runs past the end");
  STRATA_EXPECT_ERROR(r, kDataLoss, "2 later records are intact");
  cfg.salvage_journal = true;
  auto store = open_or_die(*engine, cfg);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(read_back(*store, {"a", 0}, dj.a2.size()), dj.a2);
  EXPECT_EQ(read_back(*store, {"c", 0}, dj.c.size()), dj.c);
  EXPECT_EQ(store->recovery().lost, (std::vector<TensorKey>{{"d", 0}}));
}

// Salvage drops a record whose extents cannot be right and keeps the rest.
TEST(SwapStore, SalvageDropsARecordWithImpossibleExtents) {
  TempDir dir("strata-swap");
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  SwapStoreConfig cfg = store_config({dir.path().string()}, 1 << 20);
  auto x = random_bytes(8192, 1);
  {
    auto store = open_or_die(*engine, cfg);
    ASSERT_NE(store, nullptr);
    STRATA_ASSERT_OK(store->write({"x", 0}, x.data(), x.size()).wait());
  }
  nvme_detail::JournalPut far;
  far.key = {"far", 0};
  far.seq = 100;
  far.size = 4096;
  far.extents = {{1 << 20, 4096}};
  far.crcs = {0};
  const std::string journal = (dir / "strata-swap.journal").string();
  overwrite_file(journal, read_file(journal) + nvme_detail::encode(far));
  cfg.salvage_journal = true;
  auto store = open_or_die(*engine, cfg);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(read_back(*store, {"x", 0}, x.size()), x);
  EXPECT_EQ(store->recovery().lost, (std::vector<TensorKey>{{"far", 0}}));
  std::vector<unsigned char> buf(4096);
  STRATA_EXPECT_ERROR(store->read({"far", 0}, buf.data(), buf.size()).wait(), kDataLoss, "beyond the end");
  STRATA_ASSERT_OK(store->is_valid());
}

TEST(SwapStore, BadJournalHeadersNameTheJournalAndWhatWasExpected) {
  TempDir dir("strata-swap");
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  SwapStoreConfig cfg = store_config({dir.path().string()}, 1 << 20);
  { ASSERT_NE(open_or_die(*engine, cfg), nullptr); }
  const std::string journal = (dir / "strata-swap.journal").string();
  const std::string good = read_file(journal);
  ASSERT_GE(good.size(), 16u + 33u);
  // The header frame with `format` in place of the current format 1, with a valid checksum.
  auto with_format = [&](std::uint32_t format) {
    std::string h = good.substr(0, 16 + 33);
    std::memcpy(h.data() + 16, &format, 4);
    std::uint32_t crc = crc32c(h.data() + 4, 8);
    crc = crc32c(h.data() + 16, 33, crc);
    std::memcpy(h.data() + 12, &crc, 4);
    return h;
  };
  std::string flipped = good;
  flipped[16 + 20] ^= 1;  // inside the header's payload (the stripe unit)
  struct Case {
    std::string what, image;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {"empty", "", {"0 bytes", "16-byte"}},
      {"short", good.substr(0, 5), {"5 bytes", "16-byte"}},
      {"magic", "JUNK" + good.substr(4), {"offset 0", "magic", "SWJR"}},
      {"checksum", flipped, {"offset 0", "header", "checksum"}},
      {"format", with_format(7), {"offset 0", "format 7", "format 1"}},
  };
  for (const auto& c : cases) {
    overwrite_file(journal, c.image);
    auto r = SwapStore::open(*engine, cfg);
    STRATA_EXPECT_ERROR(r, kDataLoss, journal);
    for (const auto& n : c.needles) STRATA_EXPECT_ERROR(r, kDataLoss, n);
    EXPECT_EQ(read_file(journal), c.image) << c.what << ": the journal is left as it was";
  }
}

TEST(SwapStore, AMissingSwapFileNamesItAndTheJournal) {
  TempDir dir("strata-swap");
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  SwapStoreConfig cfg = store_config({dir.path().string()}, 1 << 20);
  { ASSERT_NE(open_or_die(*engine, cfg), nullptr); }
  const std::string data = (dir / "strata-swap.0.data").string();
  std::filesystem::remove(data);
  auto r = SwapStore::open(*engine, cfg);
  STRATA_EXPECT_ERROR(r, kDataLoss, "swap file " + data + " is missing");
  STRATA_EXPECT_ERROR(r, kDataLoss, (dir / "strata-swap.journal").string());
  STRATA_EXPECT_ERROR(r, kDataLoss, "1048576 bytes");
  EXPECT_FALSE(std::filesystem::exists(data)) << "open does not create an empty one in its place";
}

TEST(SwapStore, AShortSwapFileNamesItsSizeAndTheExpectedOne) {
  TempDir dir("strata-swap");
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  SwapStoreConfig cfg = store_config({dir.path().string(), (dir / "second").string()}, 1 << 20);
  std::filesystem::create_directory(dir / "second");
  { ASSERT_NE(open_or_die(*engine, cfg), nullptr); }
  const std::string data = (dir / "second" / "strata-swap.1.data").string();
  std::filesystem::resize_file(data, 1000);
  auto r = SwapStore::open(*engine, cfg);
  STRATA_EXPECT_ERROR(r, kDataLoss, "swap file " + data + " has 1000 bytes");
  STRATA_EXPECT_ERROR(r, kDataLoss, "expects 524288 bytes");
  STRATA_EXPECT_ERROR(r, kDataLoss, (dir / "strata-swap.journal").string());
}

// Records whose checksums are fine but whose extents cannot be right: each error names the
// journal, the record's offset, the key and the extent.
TEST(SwapStore, ExtentsOutsideTheSwapFilesAreReported) {
  TempDir dir("strata-swap");
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  SwapStoreConfig cfg = store_config({dir.path().string()}, 1 << 20);
  auto x = random_bytes(8192, 1);
  {
    auto store = open_or_die(*engine, cfg);
    ASSERT_NE(store, nullptr);
    STRATA_ASSERT_OK(store->write({"x", 0}, x.data(), x.size()).wait());
  }
  const std::string journal = (dir / "strata-swap.journal").string();
  const std::string good = read_file(journal);
  auto put = [](std::string name, std::uint64_t size, std::vector<nvme_detail::Extent> extents,
                std::size_t crcs) {
    nvme_detail::JournalPut p;
    p.key = {std::move(name), 2};
    p.seq = 100;
    p.size = size;
    p.extents = std::move(extents);
    p.crcs.assign(crcs, 0);
    return nvme_detail::encode(p);
  };
  struct Case {
    std::string record;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      // Past the end of the 1 MiB file.
      {put("far", 8192, {{(1 << 20) - 4096, 8192}}, 1),
       {"far[shard 2]", "[1044480, 1052672)", "beyond the end", "1048576"}},
      {put("huge", 4096, {{1ull << 62, 4096}}, 1), {"huge[shard 2]", "beyond the end"}},
      {put("wrap", 4096, {{~0ull - 4095, 8192}}, 1), {"wrap[shard 2]", "beyond the end"}},
      {put("odd", 4096, {{100, 4096}}, 1), {"odd[shard 2]", "[100, 4196)", "4096-byte aligned"}},
      // The bytes x already holds.
      {put("twin", 4096, {{0, 4096}}, 1), {"twin[shard 2]", "[0, 4096)", "x[shard 0]"}},
      {put("small", 9000, {{65536, 4096}}, 1), {"small[shard 2]", "9000 bytes", "4096"}},
      {put("crcs", 4096, {{65536, 4096}}, 3), {"crcs[shard 2]", "3 block checksums", "expected 1"}},
  };
  for (const auto& c : cases) {
    overwrite_file(journal, good + c.record);
    auto r = SwapStore::open(*engine, cfg);
    STRATA_EXPECT_ERROR(r, kDataLoss, journal);
    STRATA_EXPECT_ERROR(r, kDataLoss, "offset " + std::to_string(good.size()));
    for (const auto& n : c.needles) STRATA_EXPECT_ERROR(r, kDataLoss, n);
  }
}

TEST(SwapStore, ConfigErrorsAreClear) {
  TempDir dir("strata-swap");
  auto engine = engine_or_die();
  ASSERT_NE(engine, nullptr);
  SwapStoreConfig c = store_config({}, 1 << 20);
  STRATA_EXPECT_ERROR(SwapStore::open(*engine, c), kInvalidArgument, "aio.nvme_path");
  c = store_config({(dir / "missing").string()}, 1 << 20);
  STRATA_EXPECT_ERROR(SwapStore::open(*engine, c), kNotFound, "missing");
  c = store_config({dir.path().string()}, 1 << 20);
  c.checksum_block = 5000;
  STRATA_EXPECT_ERROR(SwapStore::open(*engine, c), kInvalidArgument, "checksum block");
  c = store_config({dir.path().string()}, 0);
  STRATA_EXPECT_ERROR(SwapStore::open(*engine, c), kInvalidArgument, "capacity");
  c = store_config({dir.path().string(), dir.path().string() + "/"}, 1 << 20);
  STRATA_EXPECT_ERROR(SwapStore::open(*engine, c), kInvalidArgument, "listed twice");
  auto store = open_or_die(*engine, store_config({dir.path().string()}, 1 << 20));
  ASSERT_NE(store, nullptr);
  STRATA_EXPECT_ERROR(store->write({"", 0}, "x", 1).wait(), kInvalidArgument, "tensor name");
}

}  // namespace
}  // namespace strata
