// I/O engine tests: round-trips of awkward sizes and offsets through every backend, aligned
// and unaligned memory, striping, many concurrent requests, short transfers, errors reported
// with file and offset, a full file system (RLIMIT_FSIZE), and the backend fallbacks.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>
#include <thread>

#include "harness/harness.hpp"
#include "nvme/faults.hpp"
#include "strata/alloc.hpp"
#include "strata/config.hpp"
#include "strata/nvme.hpp"

namespace strata {
namespace {

using nvme_detail::IoFaults;
using testing::TempDir;

using testing::random_bytes;

std::unique_ptr<IoEngine> make_engine(IoEngineConfig cfg, const IoFaults* faults = nullptr,
                                      PinnedPool* pool = nullptr) {
  auto e = IoFaults::create_engine(cfg, pool, faults);
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  return e.ok() ? std::move(e).value() : nullptr;
}

AlignedBuffer abuf(std::size_t n) { return std::move(AlignedBuffer::allocate(n)).value(); }

// Why `kind` cannot run on this machine (probed with the raw system call, not through the
// engine), or "" when it can. psync always can.
std::string backend_unavailable_reason(IoBackendKind kind) {
  if (kind == IoBackendKind::kIoUring) return testing::io_uring_unavailable_reason();
  if (kind == IoBackendKind::kLibaio) return testing::libaio_unavailable_reason();
  return "";
}

// Tests of one backend skip, naming the reason, where the machine blocks it (seccomp,
// container policy, sysctl): otherwise the engine's fallback would run them on another backend
// under this one's name.
#define STRATA_SKIP_WITHOUT_BACKEND(kind)                               \
  do {                                                                  \
    const std::string why_ = backend_unavailable_reason(kind);          \
    if (!why_.empty()) GTEST_SKIP() << to_string(kind) << ": " << why_; \
  } while (0)

// Tests that need O_DIRECT where TempDir puts their files.
#define STRATA_SKIP_WITHOUT_O_DIRECT()                                                               \
  do {                                                                                               \
    const std::string why_ = testing::o_direct_unsupported_reason(testing::temp_root());             \
    if (!why_.empty()) GTEST_SKIP() << why_ << " (set TMPDIR to a directory on a disk file system)"; \
  } while (0)

std::string read_file_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A buffer whose data() is `misalign` bytes past a 4 KiB boundary.
struct OffsetBuffer {
  AlignedBuffer raw;
  std::size_t misalign;
  OffsetBuffer(std::size_t n, std::size_t mis) : raw(abuf(n + mis + 1)), misalign(mis) {}
  unsigned char* data() { return static_cast<unsigned char*>(raw.data()) + misalign; }
};

class EngineBackends : public ::testing::TestWithParam<IoBackendKind> {
 protected:
  void SetUp() override { STRATA_SKIP_WITHOUT_BACKEND(GetParam()); }
  IoEngineConfig config() const {
    IoEngineConfig c;
    c.backend = GetParam();
    c.block_size = 64 << 10;  // small blocks: multi-piece requests at test sizes
    c.queue_depth = 8;
    return c;
  }
};

TEST_P(EngineBackends, RunsTheBackendAskedFor) {
  auto engine = make_engine(config());
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(engine->backend(), GetParam()) << "the backend fell back on this machine";
}

TEST_P(EngineBackends, RoundTripsAwkwardSizesAndOffsets) {
  TempDir dir("strata-nvme");
  auto engine = make_engine(config());
  ASSERT_NE(engine, nullptr);
  auto f = engine->open((dir / "data").string(), OpenMode::kCreate);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  const std::string no_direct = testing::o_direct_unsupported_reason(testing::temp_root());
  EXPECT_EQ(engine->is_direct(*f), no_direct.empty())
      << "O_DIRECT is used exactly where the file system supports it; probe of " << testing::temp_root()
      << ": " << (no_direct.empty() ? "supported" : no_direct);
  std::mt19937_64 rng(1);
  std::uint64_t offset = 0;
  int seed = 0;
  for (std::size_t size : testing::awkward_sizes()) {
    for (std::size_t misalign : {0ul, 1ul, 512ul}) {
      // Aligned and unaligned file offsets; aligned and unaligned memory.
      std::uint64_t off = offset + (misalign == 1 ? rng() % 4096 : 0);
      auto data = random_bytes(size, ++seed);
      OffsetBuffer src(size, misalign);
      if (size > 0) std::memcpy(src.data(), data.data(), size);  // an empty vector's data() may be null
      STRATA_ASSERT_OK(engine->write(*f, off, src.data(), size).wait());
      OffsetBuffer dst(size, (misalign + 7) % 4096);
      std::memset(dst.data(), 0xEE, size);
      auto h = engine->read(*f, off, dst.data(), size);
      STRATA_ASSERT_OK(h.wait());
      EXPECT_EQ(h.bytes_transferred(), size);
      ASSERT_EQ(size == 0 ? 0 : std::memcmp(dst.data(), data.data(), size), 0)
          << "size " << size << " file offset " << off << " memory misalignment " << misalign;
      offset = align_up(off + size + 1, 4096);
    }
  }
  auto st = engine->stats();
  EXPECT_GT(st.bounced_pieces, 0u);
  EXPECT_GT(st.buffered_pieces, 0u);
  EXPECT_EQ(st.errors, 0u);
}

TEST_P(EngineBackends, ManyConcurrentRequestsFromSeveralThreads) {
  TempDir dir("strata-nvme");
  IoEngineConfig cfg = config();
  cfg.intra_op_parallelism = 3;
  auto engine = make_engine(cfg);
  ASSERT_NE(engine, nullptr);
  auto f = engine->open((dir / "data").string(), OpenMode::kCreate);
  ASSERT_TRUE(f.ok());
  constexpr int kThreads = 4, kPerThread = 40;
  struct Slot {
    std::uint64_t offset;
    std::vector<unsigned char> data;
  };
  std::vector<std::vector<Slot>> slots(kThreads);
  std::mt19937_64 rng(3);
  std::uint64_t off = 0;
  for (auto& s : slots) {
    for (int i = 0; i < kPerThread; ++i) {
      std::size_t n = 1 + rng() % (300 << 10);
      s.push_back({off, random_bytes(n, rng())});
      off = align_up(off + n, rng() % 2 ? 4096 : 8) + (rng() % 3) * 4096;
    }
  }
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<IoHandle> hs;
      for (auto& s : slots[t]) hs.push_back(engine->write(*f, s.offset, s.data.data(), s.data.size()));
      for (auto& h : hs) failures += !h.wait().ok();
      std::vector<std::vector<unsigned char>> back(slots[t].size());
      hs.clear();
      for (std::size_t i = 0; i < back.size(); ++i) {
        back[i].resize(slots[t][i].data.size());
        hs.push_back(engine->read(*f, slots[t][i].offset, back[i].data(), back[i].size()));
      }
      for (std::size_t i = 0; i < back.size(); ++i) {
        failures += !hs[i].wait().ok();
        failures += back[i] != slots[t][i].data;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST_P(EngineBackends, StripesOverSeveralFiles) {
  TempDir dir("strata-nvme");
  std::vector<std::string> paths;
  for (int i = 0; i < 3; ++i) {
    std::filesystem::create_directory(dir / ("dev" + std::to_string(i)));
    paths.push_back((dir / ("dev" + std::to_string(i)) / "swap").string());
  }
  auto engine = make_engine(config());
  ASSERT_NE(engine, nullptr);
  constexpr std::uint64_t kUnit = 16 << 10;
  auto f = engine->open_striped(paths, kUnit, OpenMode::kCreate);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  STRATA_ASSERT_OK(engine->preallocate(*f, 1 << 20));
  auto size = engine->size(*f);
  ASSERT_TRUE(size.ok());
  EXPECT_GE(*size, 1u << 20);
  auto data = random_bytes((600 << 10) + 5, 9);
  const std::uint64_t off = 3 * kUnit + 100;
  STRATA_ASSERT_OK(engine->write(*f, off, data.data(), data.size()).wait());
  std::vector<unsigned char> back(data.size());
  STRATA_ASSERT_OK(engine->read(*f, off, back.data(), back.size()).wait());
  EXPECT_EQ(back, data);
  // Byte L of the logical file is in member (L / unit) % 3 at ((L / unit) / 3) * unit + L % unit.
  std::vector<std::string> members;
  for (const auto& p : paths) members.push_back(read_file_bytes(p));
  for (std::uint64_t i = 0; i < data.size(); i += 4093) {
    std::uint64_t l = off + i, stripe = l / kUnit;
    const std::string& m = members[stripe % 3];
    std::uint64_t moff = (stripe / 3) * kUnit + l % kUnit;
    ASSERT_LT(moff, m.size());
    ASSERT_EQ(static_cast<unsigned char>(m[moff]), data[i]) << "logical byte " << l;
  }
  EXPECT_NE(engine->locate(*f, kUnit).find(paths[1]), std::string::npos);
}

TEST_P(EngineBackends, ShortTransfersAreResubmitted) {
  STRATA_SKIP_WITHOUT_O_DIRECT();  // it checks that short transfers keep the file on O_DIRECT
  TempDir dir("strata-nvme");
  for (std::uint64_t cap : {4096ul, 1000ul}) {  // remainders on and off the 4 KiB grid
    IoFaults faults;
    faults.max_transfer = cap;
    auto engine = make_engine(config(), &faults);
    ASSERT_NE(engine, nullptr);
    auto f = engine->open((dir / ("data" + std::to_string(cap))).string(), OpenMode::kCreate);
    ASSERT_TRUE(f.ok());
    auto data = random_bytes((200 << 10) + 3, cap);
    AlignedBuffer src = abuf(data.size());
    std::memcpy(src.data(), data.data(), data.size());
    STRATA_ASSERT_OK(engine->write(*f, 4096, src.data(), data.size()).wait());
    AlignedBuffer dst = abuf(data.size());
    STRATA_ASSERT_OK(engine->read(*f, 4096, dst.data(), data.size()).wait());
    EXPECT_EQ(std::memcmp(dst.data(), data.data(), data.size()), 0) << "cap " << cap;
    EXPECT_GT(engine->stats().short_transfers, 0u);
    EXPECT_TRUE(engine->is_direct(*f)) << "a short transfer must not demote the file to buffered I/O";
  }
}

TEST_P(EngineBackends, ReadPastTheEndIsAnErrorNotZeros) {
  TempDir dir("strata-nvme");
  std::string path = testing::write_file(dir / "small", std::string(5000, 'x'));
  auto engine = make_engine(config());
  ASSERT_NE(engine, nullptr);
  auto f = engine->open(path, OpenMode::kRead);
  ASSERT_TRUE(f.ok());
  AlignedBuffer buf = abuf(8192);
  STRATA_EXPECT_ERROR(engine->read(*f, 0, buf.data(), 8192).wait(), kIoError, "end of the file");
  STRATA_EXPECT_ERROR(engine->read(*f, 0, buf.data(), 8192).wait(), kIoError, path);
  STRATA_EXPECT_OK(engine->read(*f, 0, buf.data(), 5000).wait());
}

TEST_P(EngineBackends, InjectedErrorsNameFileAndOffset) {
  TempDir dir("strata-nvme");
  IoFaults faults;
  faults.add_error({IoOp::kRead, "victim", 3 * 65536 + 10, EIO});
  faults.add_error({IoOp::kWrite, "victim", 5 * 65536, ENOSPC});
  auto engine = make_engine(config(), &faults);
  ASSERT_NE(engine, nullptr);
  auto f = engine->open((dir / "victim").string(), OpenMode::kCreate);
  ASSERT_TRUE(f.ok());
  auto data = random_bytes(4 * 65536, 5);
  STRATA_ASSERT_OK(engine->write(*f, 0, data.data(), data.size()).wait());
  std::vector<unsigned char> back(data.size());
  Status s = engine->read(*f, 0, back.data(), back.size()).wait();
  STRATA_EXPECT_ERROR(s, kIoError, "EIO");
  STRATA_EXPECT_ERROR(s, kIoError, "offset 196608 of " + (dir / "victim").string());
  STRATA_EXPECT_ERROR(engine->write(*f, 4 * 65536, data.data(), data.size()).wait(), kIoError, "ENOSPC");
  // The data before the failure is intact.
  STRATA_ASSERT_OK(engine->read(*f, 0, back.data(), 3 * 65536).wait());
  EXPECT_EQ(std::memcmp(back.data(), data.data(), 3 * 65536), 0);
  EXPECT_GE(engine->stats().errors, 2u);
}

TEST_P(EngineBackends, WriteToAReadOnlyFileFailsWithEbadf) {
  TempDir dir("strata-nvme");
  std::string path = testing::write_file(dir / "ro", std::string(8192, 'r'));
  auto engine = make_engine(config());
  ASSERT_NE(engine, nullptr);
  auto f = engine->open(path, OpenMode::kRead);
  ASSERT_TRUE(f.ok());
  AlignedBuffer buf = abuf(8192);
  Status s = engine->write(*f, 0, buf.data(), 8192).wait();
  STRATA_EXPECT_ERROR(s, kIoError, "EBADF");
  STRATA_EXPECT_ERROR(s, kIoError, path);
  EXPECT_EQ(read_file_bytes(path), std::string(8192, 'r'));
}

// A full file system, simulated with RLIMIT_FSIZE in a forked child: writes past the limit
// fail with EFBIG naming the file and offset; what was written before stays readable.
TEST_P(EngineBackends, FullFileSystemSurfacesAndEarlierDataSurvives) {
  TempDir dir("strata-nvme");
  std::string path = (dir / "full").string();
  IoEngineConfig cfg = config();
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(pipefd[0]);
    std::string report;
    int code = 0;
    auto fail = [&](const std::string& why) {
      report += why + "\n";
      code = 1;
    };
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit lim{1 << 20, 1 << 20};
    ::setrlimit(RLIMIT_FSIZE, &lim);
    auto engine = IoEngine::create(cfg);
    if (!engine.ok()) {
      fail(engine.status().to_string());
    } else {
      auto f = (*engine)->open(path, OpenMode::kCreate);
      auto data = random_bytes(512 << 10, 77);
      AlignedBuffer buf = abuf(2 << 20);
      std::memcpy(buf.data(), data.data(), data.size());
      Status w1 = (*engine)->write(*f, 0, buf.data(), data.size()).wait();
      if (!w1.ok()) fail("first write: " + w1.to_string());
      Status w2 = (*engine)->write(*f, 768 << 10, buf.data(), 1 << 20).wait();
      if (w2.ok()) fail("a write past RLIMIT_FSIZE succeeded");
      if (w2.message().find("EFBIG") == std::string::npos || w2.message().find(path) == std::string::npos ||
          w2.message().find("offset") == std::string::npos) {
        fail("the error does not name EFBIG, the file and the offset: " + w2.to_string());
      }
      std::memset(buf.data(), 0, data.size());
      Status r = (*engine)->read(*f, 0, buf.data(), data.size()).wait();
      if (!r.ok()) fail("read back: " + r.to_string());
      if (std::memcmp(buf.data(), data.data(), data.size()) != 0) fail("earlier data changed");
      report += "error was: " + w2.message() + "\n";
    }
    [[maybe_unused]] auto n = ::write(pipefd[1], report.data(), report.size());
    ::_exit(code);
  }
  ::close(pipefd[1]);
  std::string report;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(pipefd[0], buf, sizeof buf)) > 0) report.append(buf, n);
  ::close(pipefd[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status)) << "child died: " << report;
  EXPECT_EQ(WEXITSTATUS(status), 0) << report;
}

INSTANTIATE_TEST_SUITE_P(Nvme, EngineBackends,
                         ::testing::Values(IoBackendKind::kIoUring, IoBackendKind::kLibaio,
                                           IoBackendKind::kPsync),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// ---- Not per backend --------------------------------------------------------------------------

TEST(Engine, SubmissionModesRoundTrip) {
  TempDir dir("strata-nvme");
  for (int mode = 0; mode < 3; ++mode) {
    IoEngineConfig cfg;
    cfg.block_size = 16 << 10;
    cfg.queue_depth = 4;
    cfg.single_submit = mode == 1;
    cfg.overlap_events = mode != 2;
    auto engine = make_engine(cfg);
    ASSERT_NE(engine, nullptr);
    auto f = engine->open((dir / ("m" + std::to_string(mode))).string(), OpenMode::kCreate);
    ASSERT_TRUE(f.ok());
    auto data = random_bytes((1 << 20) + 3, mode);
    STRATA_ASSERT_OK(engine->write(*f, 0, data.data(), data.size()).wait());
    std::vector<unsigned char> back(data.size());
    STRATA_ASSERT_OK(engine->read(*f, 0, back.data(), back.size()).wait());
    EXPECT_EQ(back, data) << "single_submit " << cfg.single_submit << " overlap_events "
                          << cfg.overlap_events;
  }
}

TEST(Engine, CallbacksAndHooks) {
  TempDir dir("strata-nvme");
  IoEngineConfig cfg;
  cfg.block_size = 16 << 10;
  auto engine = make_engine(cfg);
  ASSERT_NE(engine, nullptr);
  auto f = engine->open((dir / "cb").string(), OpenMode::kCreate);
  ASSERT_TRUE(f.ok());
  auto data = random_bytes(100000, 1);
  std::atomic<int> hooks{0};
  std::vector<IoRequest> batch;
  for (int i = 0; i < 4; ++i) {
    IoRequest r;
    r.op = IoOp::kWrite;
    r.file = *f;
    r.offset = i * 100000;
    r.length = data.size();
    r.buffer = data.data();
    r.on_done = [&hooks](const IoRequest& req) {
      hooks += req.length == 100000;
      return ok_status();
    };
    batch.push_back(std::move(r));
  }
  std::promise<Status> cb;
  auto h = engine->submit(std::move(batch));
  h.then([&cb](const Status& s) { cb.set_value(s); });
  STRATA_EXPECT_OK(cb.get_future().get());
  EXPECT_TRUE(h.poll());
  EXPECT_EQ(hooks.load(), 4);
  // then() after completion runs right away; a failing hook fails the handle.
  bool ran = false;
  h.then([&ran](const Status&) { ran = true; });
  EXPECT_TRUE(ran);
  IoRequest r;
  r.op = IoOp::kRead;
  r.file = *f;
  r.offset = 0;
  r.length = 100;
  std::vector<unsigned char> back(100);
  r.buffer = back.data();
  r.on_done = [](const IoRequest&) { return data_loss("hook says no"); };
  STRATA_EXPECT_ERROR(engine->submit(std::move(r)).wait(), kDataLoss, "hook says no");
  // Zero-length and empty batches complete.
  STRATA_EXPECT_OK(engine->read(*f, 0, nullptr, 0).wait());
  STRATA_EXPECT_OK(engine->submit(std::vector<IoRequest>{}).wait());
}

TEST(Engine, InvalidRequestsFailBeforeAnyIo) {
  TempDir dir("strata-nvme");
  auto engine = make_engine(IoEngineConfig{});
  ASSERT_NE(engine, nullptr);
  char b[16];
  STRATA_EXPECT_ERROR(engine->read(FileId{7}, 0, b, 16).wait(), kInvalidArgument, "not open");
  auto f = engine->open((dir / "x").string(), OpenMode::kCreate);
  ASSERT_TRUE(f.ok());
  STRATA_EXPECT_ERROR(engine->read(*f, 0, nullptr, 16).wait(), kInvalidArgument, "null buffer");
  STRATA_EXPECT_ERROR(engine->open((dir / "missing").string(), OpenMode::kRead), kNotFound, "missing");
  STRATA_ASSERT_OK(engine->close(*f));
  STRATA_EXPECT_ERROR(engine->read(*f, 0, b, 16).wait(), kInvalidArgument, "not open");
  STRATA_EXPECT_ERROR(engine->close(*f), kInvalidArgument, "not open");
}

TEST(Engine, PinnedPoolAndRegisteredMemoryUseFixedBuffers) {
  STRATA_SKIP_WITHOUT_BACKEND(IoBackendKind::kIoUring);
  TempDir dir("strata-nvme");
  auto pool = PinnedPool::create_host(8 << 20);
  ASSERT_TRUE(pool.ok()) << pool.status().to_string();
  IoEngineConfig cfg;
  cfg.backend = IoBackendKind::kIoUring;
  cfg.block_size = 64 << 10;
  auto engine = make_engine(cfg, nullptr, pool->get());
  ASSERT_NE(engine, nullptr);
  ASSERT_EQ(engine->backend(), IoBackendKind::kIoUring);
  auto f = engine->open((dir / "fixed").string(), OpenMode::kCreate);
  ASSERT_TRUE(f.ok());
  auto buf = (*pool)->allocate(1 << 20, "test");
  ASSERT_TRUE(buf.ok());
  auto data = random_bytes(1 << 20, 11);
  std::memcpy(buf->data(), data.data(), data.size());
  STRATA_ASSERT_OK(engine->write(*f, 0, buf->data(), data.size()).wait());
  EXPECT_EQ(engine->stats().fixed_buffer_pieces, 16u);
  // Memory registered by the caller, and a bounce through pool memory for an unaligned buffer.
  AlignedBuffer mine = abuf(1 << 20);
  STRATA_ASSERT_OK(engine->register_memory(mine.data(), mine.size()));
  STRATA_ASSERT_OK(engine->read(*f, 0, mine.data(), data.size()).wait());
  EXPECT_EQ(std::memcmp(mine.data(), data.data(), data.size()), 0);
  EXPECT_EQ(engine->stats().fixed_buffer_pieces, 32u);
  STRATA_ASSERT_OK(engine->unregister_memory(mine.data()));
  std::vector<unsigned char> odd(data.size() + 1);
  STRATA_ASSERT_OK(engine->read(*f, 0, odd.data() + 1, data.size()).wait());
  EXPECT_EQ(std::memcmp(odd.data() + 1, data.data(), data.size()), 0);
  auto st = engine->stats();
  EXPECT_EQ(st.bounced_pieces, 16u);
  EXPECT_EQ(st.fixed_buffer_pieces, 48u) << "bounce buffers come from the registered pool";
  STRATA_EXPECT_ERROR(engine->unregister_memory(mine.data()), kInvalidArgument, "not registered");
}

// ---- Fallbacks ---------------------------------------------------------------------------------

TEST(EngineFallback, NoIoUringFallsBackToLibaioThenPsync) {
  STRATA_SKIP_WITHOUT_BACKEND(IoBackendKind::kLibaio);  // the first fallback it expects
  TempDir dir("strata-nvme");
  IoFaults faults;
  faults.uring_setup_errno = ENOSYS;
  IoEngineConfig cfg;
  auto engine = make_engine(cfg, &faults);
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(engine->backend(), IoBackendKind::kLibaio);
  faults.aio_setup_errno = EAGAIN;
  cfg.backend = IoBackendKind::kIoUring;
  engine = make_engine(cfg, &faults);
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(engine->backend(), IoBackendKind::kPsync);
  auto f = engine->open((dir / "p").string(), OpenMode::kCreate);
  ASSERT_TRUE(f.ok());
  auto data = random_bytes(70000, 2);
  STRATA_ASSERT_OK(engine->write(*f, 10, data.data(), data.size()).wait());
  std::vector<unsigned char> back(data.size());
  STRATA_ASSERT_OK(engine->read(*f, 10, back.data(), back.size()).wait());
  EXPECT_EQ(back, data);
}

class EngineFallbackDirect : public ::testing::TestWithParam<IoBackendKind> {
 protected:
  void SetUp() override { STRATA_SKIP_WITHOUT_BACKEND(GetParam()); }
};

TEST_P(EngineFallbackDirect, RefusedODirectGoesBuffered) {
  TempDir dir("strata-nvme");
  IoFaults faults;
  faults.refuse_direct = true;
  {
    const IoBackendKind kind = GetParam();
    IoEngineConfig cfg;
    cfg.backend = kind;
    cfg.nvme_path = {dir.path().string()};
    cfg.block_size = 16 << 10;
    auto engine = make_engine(cfg, &faults);
    ASSERT_NE(engine, nullptr);
    // io_uring does buffered I/O asynchronously; libaio would block, so it gives way to psync.
    EXPECT_EQ(engine->backend(),
              kind == IoBackendKind::kIoUring ? IoBackendKind::kIoUring : IoBackendKind::kPsync);
    auto f = engine->open((dir / "b").string(), OpenMode::kCreate);
    ASSERT_TRUE(f.ok());
    EXPECT_FALSE(engine->is_direct(*f));
    auto data = random_bytes(100003, 4);
    STRATA_ASSERT_OK(engine->write(*f, 4096, data.data(), data.size()).wait());
    std::vector<unsigned char> back(data.size());
    STRATA_ASSERT_OK(engine->read(*f, 4096, back.data(), back.size()).wait());
    EXPECT_EQ(back, data);
    EXPECT_EQ(engine->stats().bounced_pieces, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Nvme, EngineFallbackDirect,
                         ::testing::Values(IoBackendKind::kIoUring, IoBackendKind::kLibaio),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(EngineFallback, TmpfsWorksWhateverItSaysAboutODirect) {
  if (!std::filesystem::is_directory("/dev/shm")) GTEST_SKIP() << "no /dev/shm";
  ::setenv("TMPDIR", "/dev/shm", 1);
  TempDir dir("strata-nvme");
  ::unsetenv("TMPDIR");
  IoEngineConfig cfg;
  cfg.nvme_path = {dir.path().string()};
  auto engine = make_engine(cfg);
  ASSERT_NE(engine, nullptr);
  auto f = engine->open((dir / "t").string(), OpenMode::kCreate);
  ASSERT_TRUE(f.ok());
  auto data = random_bytes(300001, 8);
  STRATA_ASSERT_OK(engine->write(*f, 1, data.data(), data.size()).wait());
  std::vector<unsigned char> back(data.size());
  STRATA_ASSERT_OK(engine->read(*f, 1, back.data(), back.size()).wait());
  EXPECT_EQ(back, data);
}

// ---- Config ------------------------------------------------------------------------------------

TEST(IoEngineConfig, ValidationNamesTheKey) {
  IoEngineConfig ok;
  STRATA_EXPECT_OK(ok.validate());
  IoEngineConfig c;
  c.block_size = 1000;
  STRATA_EXPECT_ERROR(c.validate(), kInvalidArgument, "aio.block_size");
  c = IoEngineConfig{};
  c.queue_depth = 0;
  STRATA_EXPECT_ERROR(c.validate(), kInvalidArgument, "aio.queue_depth");
  c = IoEngineConfig{};
  c.intra_op_parallelism = 0;
  STRATA_EXPECT_ERROR(c.validate(), kInvalidArgument, "aio.thread_count");
  c = IoEngineConfig{};
  c.nvme_path = {"/a", ""};
  STRATA_EXPECT_ERROR(c.validate(), kInvalidArgument, "aio.nvme_path[1]");
  c.nvme_path = {"/a", "/a/"};
  STRATA_EXPECT_ERROR(c.validate(), kInvalidArgument, "listed twice");
  c = IoEngineConfig{};
  c.sq_poll = true;
  c.backend = IoBackendKind::kPsync;
  STRATA_EXPECT_ERROR(c.validate(), kInvalidArgument, "aio.sq_poll");
  STRATA_EXPECT_ERROR(parse_io_backend("spdk"), kInvalidArgument, "auto, io_uring, libaio, psync");
  EXPECT_EQ(*parse_io_backend("io_uring"), IoBackendKind::kIoUring);
  EXPECT_EQ(*parse_io_backend("libaio"), IoBackendKind::kLibaio);
  EXPECT_EQ(*parse_io_backend("psync"), IoBackendKind::kPsync);
  EXPECT_EQ(*parse_io_backend("auto"), IoBackendKind::kAuto);
  STRATA_EXPECT_ERROR(IoEngine::create(c), kInvalidArgument, "aio.sq_poll");
}

TEST(IoEngineConfig, TakesTheLoadedAioSection) {
  AioConfig aio;
  aio.block_size = 4 << 20;
  aio.queue_depth = 32;
  aio.intra_op_parallelism = 2;
  aio.single_submit = true;
  aio.overlap_events = false;
  aio.backend = AioBackend::kLibaio;
  aio.nvme_path = {"/a", "/b"};
  IoEngineConfig c = IoEngineConfig::from(aio);
  EXPECT_EQ(c.block_size, 4u << 20);
  EXPECT_EQ(c.queue_depth, 32u);
  EXPECT_EQ(c.intra_op_parallelism, 2u);
  EXPECT_TRUE(c.single_submit);
  EXPECT_FALSE(c.overlap_events);
  EXPECT_EQ(c.backend, IoBackendKind::kLibaio);
  EXPECT_EQ(c.nvme_path, aio.nvme_path);
  STRATA_EXPECT_OK(c.validate());
  aio.queue_depth = -1;
  STRATA_EXPECT_ERROR(IoEngineConfig::from(aio).validate(), kInvalidArgument, "aio.queue_depth");
}

TEST(Engine, DeepQueuesWork) {
  TempDir dir("strata-nvme");
  IoEngineConfig cfg;
  cfg.block_size = 4096;
  cfg.queue_depth = 5000;  // deeper than the submission ring: the ring is refilled as it drains
  auto engine = make_engine(cfg);
  ASSERT_NE(engine, nullptr);
  auto f = engine->open((dir / "deep").string(), OpenMode::kCreate);
  ASSERT_TRUE(f.ok());
  auto data = random_bytes(24 << 20, 6);
  STRATA_ASSERT_OK(engine->write(*f, 0, data.data(), data.size()).wait());
  std::vector<unsigned char> back(data.size());
  STRATA_ASSERT_OK(engine->read(*f, 0, back.data(), back.size()).wait());
  EXPECT_EQ(back, data);
}

TEST(Engine, SqPollRoundTrips) {
  STRATA_SKIP_WITHOUT_BACKEND(IoBackendKind::kIoUring);
  TempDir dir("strata-nvme");
  IoEngineConfig cfg;
  cfg.backend = IoBackendKind::kIoUring;
  cfg.sq_poll = true;
  cfg.sq_poll_idle_ms = 10;
  auto engine = make_engine(cfg);
  ASSERT_NE(engine, nullptr);
  auto f = engine->open((dir / "sq").string(), OpenMode::kCreate);
  ASSERT_TRUE(f.ok());
  auto data = random_bytes(3 << 20, 5);
  STRATA_ASSERT_OK(engine->write(*f, 0, data.data(), data.size()).wait());
  std::vector<unsigned char> back(data.size());
  STRATA_ASSERT_OK(engine->read(*f, 0, back.data(), back.size()).wait());
  EXPECT_EQ(back, data);
}

}  // namespace
}  // namespace strata
