// strata bench nvme: writes SIZE bytes through the swap store (and so through the I/O engine
// with O_DIRECT) into a fresh store under --path, reads them back, and reports throughput and
// process CPU per GB moved. The data is streamed from a window of pinned buffers, a few
// tensors in flight, the way the offload pipeline streams optimizer state. The reference it is
// judged against (fio on the same file system, same block size and queue depth) is measured by
// bench/nvme_vs_fio.sh, interleaved with this benchmark in the same run.
//
// What the read phase measures is the device, not the host's page cache:
//  - the swap files are opened with O_DIRECT (--direct on, the default), so reads bypass the
//    cache; the run fails (exit 1) if the file system refused O_DIRECT, unless --direct off;
//  - before the read phase every file of the store is fdatasynced and dropped from the cache
//    with posix_fadvise(POSIX_FADV_DONTNEED), which also covers the few pieces the engine does
//    without O_DIRECT (unaligned edges) and the journal;
//  - `device_read_bytes` is what the kernel fetched from storage for this process during the
//    read phase (/proc/self/io read_bytes): about `size` when the device served the reads, 0 on
//    a file system without a block device (tmpfs).
// Every tensor gets distinct contents (a tag of tensor and block index in every 4 KiB block of
// the window's random bytes), and after the timed phases every tensor is read back again and
// compared in full, untimed.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cli.hpp"
#include "strata/alloc.hpp"
#include "strata/nvme.hpp"
#include "strata/options.hpp"

namespace strata::cli {
namespace {

constexpr FlagSpec kFlags[] = {
    {"json", "", "print the result as JSON (the only format; accepted for scripts)"},
    {"path", "DIR[,DIR...]", "directories for the swap files (one per NVMe device); required"},
    {"size", "BYTES", "bytes to write and then read (e.g. 4GiB); required"},
    {"block-size", "BYTES", "aio.block_size: bytes per I/O (default 1MiB)"},
    {"queue-depth", "N", "aio.queue_depth: I/Os in flight per thread (default 16)"},
    {"threads", "N", "aio.intra_op_parallelism: I/O threads (default 1)"},
    {"backend", "NAME", "aio.backend: auto, io_uring, libaio or psync (default auto)"},
    {"verify", "on|off", "crc32c per block on write, verified on read (default on)"},
    {"window", "BYTES",
     "pinned memory streamed through, split in 4 tensors in flight (default min(SIZE, 64MiB))"},
    {"hugepages", "on|off", "back the pinned window with transparent huge pages (default on)"},
    {"direct", "on|off",
     "O_DIRECT on the swap files (default on; the run fails if the file system refuses it)"},
    {"keep", "", "keep the swap files instead of removing them"},
    {"help", "", "show this help"},
};

std::string usage() {
  return "usage: strata bench nvme --path DIR --size BYTES [flags]\n\n"
         "Writes then reads SIZE bytes through the swap store with O_DIRECT; prints write_gbps,\n"
         "read_gbps, backend, verify and cpu_s_per_gb (process CPU seconds per GB moved).\n\nflags:\n" +
         format_flags(kFlags);
}

double cpu_seconds() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::vector<std::string> split_paths(const std::string& s) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos <= s.size()) {
    std::size_t comma = s.find(',', pos);
    if (comma == std::string::npos) comma = s.size();
    if (comma > pos) out.push_back(s.substr(pos, comma - pos));
    pos = comma + 1;
  }
  return out;
}

int fail(const Status& s) {
  std::fprintf(stderr, "strata bench nvme: %s\n", s.to_string().c_str());
  return kExitFailure;
}

// Bytes this process has caused to be fetched from storage (/proc/self/io read_bytes); -1 when
// the kernel does not report it.
std::int64_t storage_read_bytes() {
  FILE* f = std::fopen("/proc/self/io", "r");
  if (f == nullptr) return -1;
  char line[128];
  long long value = -1;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::sscanf(line, "read_bytes: %lld", &value) == 1) break;
  }
  std::fclose(f);
  return value;
}

// Writes back and drops from the page cache every regular file under `dirs`, so that the read
// phase cannot be served from memory.
Status drop_page_cache(const std::vector<std::string>& dirs) {
  for (const auto& d : dirs) {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(d, ec)) {
      if (!entry.is_regular_file()) continue;
      const std::string path = entry.path().string();
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0)
        return io_error("cannot open " + path + " to drop it from the page cache: " + std::strerror(errno));
      int err = ::fdatasync(fd) == 0 ? 0 : errno;
      if (err == 0) err = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      ::close(fd);
      if (err != 0) return io_error("cannot drop " + path + " from the page cache: " + std::strerror(err));
    }
    if (ec) return io_error("cannot list " + d + ": " + ec.message());
  }
  return ok_status();
}

// Tensor i's contents: its window slot's random bytes with the first 8 bytes of every 4 KiB
// block replaced by a tag of (tensor, block), so that no two tensors (or blocks) are alike.
constexpr std::uint64_t kTagEvery = 4096;
std::uint64_t tag_of(std::uint64_t tensor, std::uint64_t block) {
  return (tensor << 32 | block) ^ 0x5a17c0de5a17c0deull;
}
void stamp(unsigned char* data, std::uint64_t length, std::uint64_t tensor) {
  for (std::uint64_t off = 0; off < length; off += kTagEvery) {
    const std::uint64_t tag = tag_of(tensor, off / kTagEvery);
    std::memcpy(data + off, &tag, std::min<std::uint64_t>(8, length - off));
  }
}
// Whether `data` holds tensor i's contents, given its slot's bytes before stamping.
bool holds_tensor(const unsigned char* data, const unsigned char* slot_bytes, std::uint64_t length,
                  std::uint64_t tensor) {
  for (std::uint64_t off = 0; off < length; off += kTagEvery) {
    const std::uint64_t tag = tag_of(tensor, off / kTagEvery);
    const std::uint64_t tag_len = std::min<std::uint64_t>(8, length - off);
    const std::uint64_t end = std::min(length, off + kTagEvery);
    if (std::memcmp(data + off, &tag, tag_len) != 0) return false;
    if (std::memcmp(data + off + tag_len, slot_bytes + off + tag_len, end - off - tag_len) != 0) return false;
  }
  return true;
}

int bench_nvme(std::span<const std::string> argv) {
  auto parsed = Args::parse(argv, kFlags);
  if (!parsed.ok()) return usage_error("bench nvme", parsed.status().message(), usage());
  const Args& args = *parsed;
  if (args.has("help")) {
    std::fputs(usage().c_str(), stdout);
    return kExitOk;
  }
  if (!args.has("path") || !args.has("size"))
    return usage_error("bench nvme", "--path and --size are required", usage());
  auto size = args.get_bytes("size", 0, 1, 1ull << 50);
  auto block = args.get_bytes("block-size", 1u << 20, 1, 1ull << 40);  // aio.validate() says more
  auto depth = args.get_int("queue-depth", 16, 1, 32768);
  auto threads = args.get_int("threads", 1, 1, 1024);
  for (const Status& s : {size.status(), block.status(), depth.status(), threads.status()}) {
    if (!s.ok()) return usage_error("bench nvme", s.message(), usage());
  }
  std::string verify_text = args.get("verify").value_or("on");
  if (verify_text != "on" && verify_text != "off") {
    return usage_error("bench nvme", "--verify expects on or off, got '" + verify_text + "'", usage());
  }
  const bool verify = verify_text == "on";
  const std::string direct_text = args.get("direct").value_or("on");
  if (direct_text != "on" && direct_text != "off") {
    return usage_error("bench nvme", "--direct expects on or off, got '" + direct_text + "'", usage());
  }
  const bool want_direct = direct_text == "on";

  IoEngineConfig aio;
  aio.block_size = *block;
  aio.queue_depth = static_cast<std::uint32_t>(*depth);
  aio.intra_op_parallelism = static_cast<std::uint32_t>(*threads);
  aio.direct_io = want_direct;
  if (auto b = args.get("backend")) {
    auto kind = parse_io_backend(*b);
    if (!kind.ok()) return usage_error("bench nvme", kind.status().message(), usage());
    aio.backend = *kind;
  }
  std::vector<std::string> roots = split_paths(*args.get("path"));
  if (roots.empty()) return usage_error("bench nvme", "--path names no directory", usage());
  // A fresh store in a subdirectory of each path, removed afterwards.
  std::vector<std::string> dirs;
  for (const auto& r : roots) {
    std::error_code ec;
    std::filesystem::path d = std::filesystem::path(r) / ("strata-bench-nvme-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d, ec);
    if (ec) return fail(io_error("cannot create " + d.string() + ": " + ec.message()));
    dirs.push_back(d.string());
  }
  aio.nvme_path = dirs;
  struct Cleanup {
    std::vector<std::string> dirs;
    bool keep;
    ~Cleanup() {
      if (keep) return;
      for (const auto& d : dirs) {
        std::error_code ec;
        std::filesystem::remove_all(d, ec);
      }
    }
  } cleanup{dirs, args.has("keep")};
  if (Status s = aio.validate(); !s.ok()) return usage_error("bench nvme", s.message(), usage());

  constexpr std::uint64_t kSlots = 4;
  auto window = args.get_bytes("window", std::min<std::uint64_t>(*size, 64u << 20), 4096, 1ull << 40);
  if (!window.ok()) return usage_error("bench nvme", window.status().message(), usage());
  const std::uint64_t tensor = align_up(std::max<std::uint64_t>(*window / kSlots, 4096), 4096);
  std::string huge_text = args.get("hugepages").value_or("on");
  if (huge_text != "on" && huge_text != "off") {
    return usage_error("bench nvme", "--hugepages expects on or off, got '" + huge_text + "'", usage());
  }
  // The slots, plus room for the engine's bounce buffers (only used for unaligned memory).
  auto pool = PinnedPool::create_host(tensor * kSlots + aio.block_size * aio.queue_depth * aio.intra_op_parallelism,
                                        huge_text == "on");
  if (!pool.ok()) return fail(pool.status());
  auto engine = IoEngine::create(aio, pool->get());
  if (!engine.ok()) return fail(engine.status());
  const std::uint64_t count = (*size + tensor - 1) / tensor;
  SwapStoreConfig scfg;
  scfg.dirs = dirs;
  scfg.capacity = count * tensor;
  scfg.stripe_unit = std::max<std::uint64_t>(aio.block_size, 1u << 20);
  scfg.checksums = verify;
  auto store = SwapStore::open(**engine, scfg);
  if (!store.ok()) return fail(store.status());
  if (want_direct && !(*store)->direct_io()) {
    std::string where;
    for (const auto& r : roots) where += (where.empty() ? "" : ", ") + r;
    return fail(unavailable("O_DIRECT was requested but the file system under " + where +
                            " refused it, so reads would come from the page cache; use a directory on a "
                            "disk file system, or --direct off to measure buffered I/O"));
  }

  std::vector<ArenaBuffer> slots;
  std::mt19937_64 rng(12345);
  for (std::uint64_t i = 0; i < kSlots; ++i) {
    auto b = (*pool)->allocate(tensor, "bench slot");
    if (!b.ok()) return fail(b.status());
    auto* words = static_cast<std::uint64_t*>(b->data());
    for (std::uint64_t w = 0; w < tensor / 8; ++w) words[w] = rng();
    slots.push_back(std::move(b).value());
  }
  // Each slot's bytes before any tag, to check every tensor against after the run.
  std::vector<std::vector<unsigned char>> slot_bytes;
  for (const auto& b : slots) {
    const auto* p = static_cast<const unsigned char*>(b.data());
    slot_bytes.emplace_back(p, p + tensor);
  }
  auto length_of = [&](std::uint64_t i) { return i + 1 < count ? tensor : *size - i * tensor; };

  // One phase: every tensor in turn, kSlots of them in flight.
  auto run_phase = [&](bool write, double& seconds, double& cpu) -> Status {
    std::vector<IoHandle> inflight(kSlots);
    Status first;
    double c0 = cpu_seconds(), t0 = now_seconds();
    for (std::uint64_t i = 0; i < count; ++i) {
      std::uint64_t s = i % kSlots;
      if (inflight[s].valid()) {
        Status st = inflight[s].wait();
        if (!st.ok() && first.ok()) first = st;
      }
      TensorKey key{"bench", static_cast<std::uint32_t>(i)};
      if (write) stamp(static_cast<unsigned char*>(slots[s].data()), length_of(i), i);  // ~1/512 of the bytes
      inflight[s] = write ? (*store)->write(key, slots[s].data(), length_of(i))
                          : (*store)->read(key, slots[s].data(), length_of(i));
    }
    for (auto& h : inflight) {
      if (!h.valid()) continue;
      Status st = h.wait();
      if (!st.ok() && first.ok()) first = st;
    }
    seconds = now_seconds() - t0;
    cpu = cpu_seconds() - c0;
    return first;
  };
  double write_s = 0, write_cpu = 0, read_s = 0, read_cpu = 0;
  if (Status s = run_phase(true, write_s, write_cpu); !s.ok()) return fail(s);
  const IoEngineStats after_write = (*engine)->stats();
  if (Status s = drop_page_cache(dirs); !s.ok()) return fail(s);
  const std::int64_t io_before = storage_read_bytes();
  if (Status s = run_phase(false, read_s, read_cpu); !s.ok()) return fail(s);
  const std::int64_t io_after = storage_read_bytes();
  const IoEngineStats after_read = (*engine)->stats();
  // Not timed: every tensor, read back into fresh memory, must hold its own contents.
  auto back = AlignedBuffer::allocate(tensor);
  if (!back.ok()) return fail(back.status());
  std::uint64_t verified = 0, bad = 0;
  std::int64_t first_bad = -1;
  for (std::uint64_t i = 0; i < count; ++i) {
    if (Status s =
            (*store)->read({"bench", static_cast<std::uint32_t>(i)}, back->data(), length_of(i)).wait();
        !s.ok())
      return fail(s);
    if (holds_tensor(static_cast<const unsigned char*>(back->data()), slot_bytes[i % kSlots].data(),
                     length_of(i), i)) {
      ++verified;
    } else if (bad++ == 0) {
      first_bad = static_cast<std::int64_t>(i);
    }
  }
  const bool data_ok = bad == 0 && verified == count;
  if (!data_ok)
    std::fprintf(stderr, "strata bench nvme: %llu tensors differ from what was written (first: %lld)\n",
                 static_cast<unsigned long long>(bad), static_cast<long long>(first_bad));

  const double gb = static_cast<double>(*size) / 1e9;
  IoEngineStats st = after_read;
  nlohmann::json out;
  out["benchmark"] = "nvme";
  out["backend"] = std::string(to_string((*engine)->backend()));
  out["direct"] = (*store)->direct_io();
  out["direct_requested"] = want_direct;
  out["verify"] = verify;
  out["hugepages"] = huge_text == "on";
  out["size"] = *size;
  out["tensors"] = count;
  out["tensor_bytes"] = tensor;
  out["bytes_written"] = after_write.bytes_written;                    // by the write phase
  out["bytes_read"] = after_read.bytes_read - after_write.bytes_read;  // by the read phase
  out["page_cache_dropped"] = true;
  out["device_read_bytes"] = io_before >= 0 && io_after >= 0 ? io_after - io_before : -1;
  out["block_size"] = aio.block_size;
  out["queue_depth"] = aio.queue_depth;
  out["threads"] = aio.intra_op_parallelism;
  out["paths"] = roots;
  out["write_gbps"] = gb / write_s;
  out["read_gbps"] = gb / read_s;
  out["cpu_s_per_gb"] = (write_cpu + read_cpu) / (2 * gb);
  out["write_cpu_s_per_gb"] = write_cpu / gb;
  out["read_cpu_s_per_gb"] = read_cpu / gb;
  out["fixed_buffer_pieces"] = st.fixed_buffer_pieces;
  out["buffered_pieces"] = st.buffered_pieces;
  out["pieces"] = st.pieces;
  out["crc32c_hardware"] = crc32c_is_hardware();
  out["tensors_verified"] = verified;
  out["data_ok"] = data_ok;
  std::printf("%s\n", out.dump(2).c_str());
  return data_ok ? kExitOk : kExitFailure;
}

}  // namespace

STRATA_CLI_BENCH(nvme, "NVMe tier: write then read through the swap store with O_DIRECT", bench_nvme);

}  // namespace strata::cli
