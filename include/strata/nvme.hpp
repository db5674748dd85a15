// The NVMe tier: an asynchronous I/O engine and a checksummed swap store on top of it.
//
// IoEngine moves bytes between host buffers and files with O_DIRECT through one of three
// backends behind one interface: io_uring (liburing; registered buffers and files, optional SQ
// polling), libaio, and pread/pwrite. A request is cut into `block_size` pieces that are spread
// over `intra_op_parallelism` I/O threads (one ring each) and, for a striped file, over several
// files on different devices. Completion is reported on an IoHandle (wait, poll, callback).
// When a backend cannot work here (no io_uring in the kernel, O_DIRECT refused by the file
// system) the engine falls back to the next one and logs the reason once; nothing above the
// engine needs to know which backend runs.
//
// SwapStore maps stable tensor keys (name + shard) to extents of preallocated swap files spread
// over one or several directories. Every block carries a crc32c verified on read. An update
// goes to fresh extents and is published only once fully written, so the previous version
// stays readable until then, across a crash too (the store's journal is replayed on open).
// docs/nvme.md describes the states, invariants and configuration.
//
// Errors are values. An I/O failure is reported on the handle that owns it, with the file and
// the offset, and surfaces at wait(); it is never swallowed or turned into zeros.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/cpu_budget.hpp"
#include "strata/status.hpp"

namespace strata {

class PinnedPool;
class SwapStore;
struct AioConfig;  // strata/config.hpp: the `aio` section as loaded from the config file

namespace nvme_detail {
struct IoState;
struct IoFaults;
}  // namespace nvme_detail

// ---- crc32c ----------------------------------------------------------------------------------

// CRC-32C (Castagnoli, the iSCSI/ext4 polynomial), continuing from `crc` (0 to start).
// crc32c("123456789") == 0xE3069283. Uses the SSE4.2 crc32 instruction when the CPU has it
// (three interleaved streams), a table-driven implementation otherwise.
std::uint32_t crc32c(const void* data, std::size_t bytes, std::uint32_t crc = 0);
// Whether crc32c() runs on the hardware instruction on this machine.
bool crc32c_is_hardware();

// ---- Configuration ---------------------------------------------------------------------------

enum class IoBackendKind : std::uint8_t {
  kAuto,     // io_uring, else libaio, else psync
  kIoUring,  // liburing; falls back to libaio, then psync, when it cannot work here
  kLibaio,   // Linux AIO; needs O_DIRECT to be asynchronous; falls back to psync
  kPsync,    // pread/pwrite on the I/O threads; always available
};
std::string_view to_string(IoBackendKind kind);
// "auto" | "io_uring" | "libaio" | "psync" (also "uring", "aio", "pread"). The error names
// `aio.backend` and lists the accepted values.
Result<IoBackendKind> parse_io_backend(std::string_view text);

// The engine's settings: the `aio` section of the config (DeepSpeed's keys, with DeepSpeed's
// meaning, plus Strata's own), as plain data. IoEngineConfig::from() takes them from the loaded
// config (strata/config.hpp); validate() checks every field.
struct IoEngineConfig {
  // DeepSpeed keys.
  std::uint64_t block_size = 1u << 20;     // bytes per I/O piece; a multiple of 4096
  std::uint32_t queue_depth = 8;           // pieces in flight per I/O thread
  std::uint32_t intra_op_parallelism = 1;  // I/O threads (one ring each); alias thread_count
  bool single_submit = false;              // submit pieces one at a time instead of in batches
  bool overlap_events = true;              // refill the queue as pieces complete (else batch by batch)
  // Strata keys.
  std::vector<std::string> nvme_path;  // swap directories (one per NVMe device)
  IoBackendKind backend = IoBackendKind::kAuto;
  bool direct_io = true;                 // O_DIRECT where the file system allows it
  bool sq_poll = false;                  // io_uring: a kernel thread polls the SQ (costs a core)
  std::uint32_t sq_poll_idle_ms = 1000;  // io_uring: SQ thread idle time before it sleeps
  // The cpus the I/O threads pin themselves to (empty: their affinity is left alone). The
  // offload engine passes its device's CpuBudget host cpus (cpu_budget.hpp).
  CpuSet cpus;

  // Checks every field; the message names the key as `aio.<key>` and what was expected.
  Status validate() const;
  // The loaded `aio` section (block size, queue depth, threads, submission modes, backend,
  // directories); the Strata-only fields keep their defaults.
  static IoEngineConfig from(const AioConfig& aio);
};

// ---- The I/O engine --------------------------------------------------------------------------

enum class IoOp : std::uint8_t { kRead, kWrite };

enum class OpenMode : std::uint8_t {
  kRead,       // existing file, read only
  kReadWrite,  // existing file
  kCreate,     // read-write, created if missing (existing contents kept)
};

// An open file (or striped set of files) of one engine. Plain value; valid until close().
struct FileId {
  std::uint32_t index = UINT32_MAX;
  bool valid() const { return index != UINT32_MAX; }
  friend bool operator==(const FileId&, const FileId&) = default;
};

struct IoRequest {
  IoOp op = IoOp::kRead;
  FileId file;
  std::uint64_t offset = 0;  // byte offset in the (logical, for a striped set) file
  std::uint64_t length = 0;
  void* buffer = nullptr;  // read: destination; write: source. Any alignment.
  // Optional. Runs on an I/O thread once all of this request's bytes have transferred without
  // error (for a read: they are in `buffer`). A non-OK status fails the handle. It must be
  // quick and must not wait on I/O of the same engine. The swap store checksums here.
  std::function<Status(const IoRequest&)> on_done;
};

// Completion of a batch of requests. Copyable; all copies observe the same completion.
// Thread-safe. Dropping every copy before completion is allowed: the I/O still completes, and
// the buffers must stay valid (and, for writes, unmodified) until it has.
class IoHandle {
 public:
  IoHandle() = default;
  // A handle that is already complete with `status` (errors found before any I/O).
  static IoHandle completed(Status status);

  bool valid() const { return state_ != nullptr; }
  // True once every request has completed (successfully or not). Never blocks.
  bool poll() const;
  // Blocks until complete; returns the first error (naming the file and offset) or OK.
  // Do not call it on an I/O thread (from a callback) for I/O of the same engine.
  Status wait() const;
  // Runs `fn` once with the final status: on the I/O thread that completes the handle, or
  // right here if it is complete already. Same rules as IoRequest::on_done.
  void then(std::function<void(const Status&)> fn) const;
  // Bytes transferred by the pieces that succeeded (so far).
  std::uint64_t bytes_transferred() const;

 private:
  friend class IoEngine;
  explicit IoHandle(std::shared_ptr<nvme_detail::IoState> state) : state_(std::move(state)) {}
  std::shared_ptr<nvme_detail::IoState> state_;
};

struct IoEngineStats {
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  std::uint64_t pieces = 0;               // pieces completed
  std::uint64_t fixed_buffer_pieces = 0;  // io_uring pieces that used a registered buffer
  std::uint64_t bounced_pieces = 0;       // pieces copied through a bounce buffer (unaligned memory)
  std::uint64_t buffered_pieces = 0;      // pieces done without O_DIRECT (unaligned edges, no O_DIRECT)
  std::uint64_t short_transfers = 0;      // completions shorter than asked, resubmitted
  std::uint64_t errors = 0;
  std::uint64_t syncs = 0;  // fdatasync calls made by sync() that succeeded (one per member file)
  // CPU seconds of the I/O threads (submission, completion, pread/pwrite on psync, bounce
  // copies); the kernel's own io_uring workers and SQ poll thread are not counted.
  double cpu_seconds = 0.0;
};

// Thread safety: every method may be called from any thread. Requests to the same bytes of a
// file are not ordered against each other unless the caller waits in between.
class IoEngine {
 public:
  // Starts the I/O threads. Bounce buffers (for memory that is not 4 KiB aligned) come from
  // `pool` when given, else from AlignedBuffer; the pool's whole region is registered with
  // io_uring, so I/O on pool buffers uses fixed buffers. The pool must outlive the engine.
  static Result<std::unique_ptr<IoEngine>> create(const IoEngineConfig& config, PinnedPool* pool = nullptr);
  // Waits for all submitted I/O, stops the threads, closes the files.
  ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // The backend actually running (after any fallback).
  IoBackendKind backend() const;
  const IoEngineConfig& config() const;

  Result<FileId> open(const std::string& path, OpenMode mode);
  // One logical file striped over `paths` (ideally on different devices): logical stripe s of
  // `stripe_unit` bytes lives in paths[s % n] at offset (s / n) * stripe_unit.
  Result<FileId> open_striped(std::span<const std::string> paths, std::uint64_t stripe_unit, OpenMode mode);
  // Fails if I/O on the file is in flight.
  Status close(FileId file);
  // Allocates disk space (fallocate) so the logical file holds at least `bytes`; errors such as
  // ENOSPC or EFBIG name the file.
  Status preallocate(FileId file, std::uint64_t bytes);
  // fdatasync of every member file.
  Status sync(FileId file);
  // Logical size (for a striped set: what its members hold, as stripes).
  Result<std::uint64_t> size(FileId file) const;
  // Whether the file's I/O bypasses the page cache (O_DIRECT accepted on every member).
  bool is_direct(FileId file) const;
  // "PATH offset N": where logical `offset` of `file` lives, for error messages.
  std::string locate(FileId file, std::uint64_t offset) const;

  // Registers host memory with every ring so I/O on it uses fixed buffers (io_uring; no-op for
  // the others). The memory must stay valid until unregister_memory() or the engine's end,
  // and no I/O on it may be in flight when it is unregistered.
  Status register_memory(void* base, std::uint64_t bytes);
  Status unregister_memory(void* base);

  // Submits a batch; the handle completes when every request has. Invalid requests (unknown
  // file, null buffer) yield a handle that is already failed; nothing of the batch is started.
  IoHandle submit(std::vector<IoRequest> requests);
  IoHandle submit(IoRequest request);
  IoHandle read(FileId file, std::uint64_t offset, void* buffer, std::uint64_t length);
  IoHandle write(FileId file, std::uint64_t offset, const void* buffer, std::uint64_t length);

  IoEngineStats stats() const;

  struct Impl;

 private:
  explicit IoEngine(std::unique_ptr<Impl> impl);
  friend struct nvme_detail::IoFaults;
  friend class SwapStore;
  static Result<std::unique_ptr<IoEngine>> create_with_faults(const IoEngineConfig& config, PinnedPool* pool,
                                                              const nvme_detail::IoFaults* faults);
  std::unique_ptr<Impl> impl_;
};

// ---- The swap store --------------------------------------------------------------------------

// A stable tensor name: the same across processes and runs (never a pointer or process id).
struct TensorKey {
  std::string name;
  std::uint32_t shard = 0;
  std::string to_string() const;  // "name[shard 3]"
  friend auto operator<=>(const TensorKey&, const TensorKey&) = default;
  friend bool operator==(const TensorKey&, const TensorKey&) = default;
};

struct SwapStoreConfig {
  std::vector<std::string> dirs;             // one swap file per directory; data is striped over them
  std::uint64_t capacity = 0;                // bytes of tensor data the store can hold (all dirs)
  std::uint64_t stripe_unit = 1u << 20;      // bytes per directory before moving to the next
  std::uint64_t checksum_block = 64u << 10;  // bytes covered by one crc32c (power of two, >= 4 KiB)
  // Checksums computed on write and verified on read. Off only to measure their cost
  // (strata bench nvme --verify off); the runtime always keeps them on.
  bool checksums = true;
  // fdatasync data and journal before a write completes: survives power loss, not only a
  // process crash. Costs a flush per write.
  bool durable = false;
  // The journal is rewritten with only the live records once it exceeds this size and four
  // times what those records need.
  std::uint64_t journal_compact_bytes = 4u << 20;
  // What open() does with a journal that is corrupt in the middle (not a torn last record,
  // which a crash during an append leaves and open() always cuts off), or whose records are
  // intact but impossible (extents out of range or overlapping). false: open() fails with
  // kDataLoss naming the journal, the offsets and the tensors at stake, and changes nothing on
  // disk. true: open() keeps every tensor whose current version the journal proves, drops the
  // rest, reports them in recovery(), keeps the damaged journal as `<journal>.damaged` and
  // writes a clean one.
  bool salvage_journal = false;
  // The store is this process's scratch space and nothing will reopen it (strata train's default
  // swap directory under $TMPDIR): once open() has the data files open, it unlinks them, so their
  // space returns to the file system when the process ends however it ends — killed by a signal,
  // an abort or the job's watchdog included — instead of staying behind under the directory. Only
  // the journal and lock files (a few KiB) stay. open() refuses a directory that already holds a
  // store (there is nothing to recover from scratch).
  bool scratch = false;

  Status validate() const;
};

// What open() found wrong with the journal and what it dropped (salvage_journal).
struct SwapRecovery {
  struct Damage {
    std::uint64_t offset = 0;  // journal offset where a record should start but does not parse
    std::uint64_t bytes = 0;   // skipped up to the next intact record
    std::string reason;        // "checksum mismatch (stored crc32c 0x…, computed 0x…)", …
  };
  std::string journal;                // the journal's path
  std::vector<Damage> damage;         // in file order
  std::uint64_t torn_tail_bytes = 0;  // a torn last record cut off (a crash during an append)
  // Tensors dropped because no version of them can be proven current: their last record
  // precedes damage that may have replaced or removed them, the damaged record itself seems to
  // hold them, or their extents are impossible. Reading one fails with kDataLoss saying why,
  // until it is written again.
  std::vector<TensorKey> lost;
  std::string damaged_copy;  // where the damaged journal was kept; empty when none was
  Status status;             // OK, or kDataLoss describing all of the above
};

struct SwapStoreStats {
  std::uint64_t capacity = 0;    // bytes of the preallocated swap files
  std::uint64_t used_bytes = 0;  // extents held by published versions and writes in flight
  std::uint64_t free_bytes = 0;
  std::uint64_t largest_free_extent = 0;
  std::uint64_t tensors = 0;  // published keys
  std::uint64_t journal_bytes = 0;
  std::uint64_t checksum_failures = 0;
  // fdatasync calls on the journal after appending a record: durable mode only (0 otherwise).
  // The swap files' own syncs before a write is published are the engine's IoEngineStats::syncs.
  std::uint64_t journal_syncs = 0;
};

// Where one tensor's bytes are (for tools and tests).
struct SwapLocation {
  std::string path;          // swap file holding the tensor's first byte
  std::uint64_t offset = 0;  // offset of the first byte in that file
  std::uint64_t bytes = 0;
};

// Thread safety: every method may be called from any thread. Reads and writes of different
// keys proceed concurrently; for one key, the write that started last wins when both finish.
class SwapStore {
 public:
  // Opens the store: creates and preallocates the swap files (one per dir) or reopens existing
  // ones, replaying the journal. Fails before writing anything when the file system cannot
  // hold `capacity`. The engine must outlive the store. One process at a time (file lock).
  static Result<std::unique_ptr<SwapStore>> open(IoEngine& engine, const SwapStoreConfig& config);
  // Waits for this store's I/O in flight.
  ~SwapStore();
  SwapStore(const SwapStore&) = delete;
  SwapStore& operator=(const SwapStore&) = delete;

  // Writes a new version of `key` to fresh extents and publishes it when fully written; until
  // then reads return the previous version. Fails before writing anything (handle already
  // failed, kOutOfMemory) when free space cannot hold it. `data` must stay valid and unchanged
  // until the handle completes.
  IoHandle write(const TensorKey& key, const void* data, std::uint64_t bytes);
  // Reads the published version into `data` (`bytes` must equal its size) and verifies every
  // block's crc32c: a mismatch fails the handle with kDataLoss naming key, file and offset.
  IoHandle read(const TensorKey& key, void* data, std::uint64_t bytes);
  // Drops the published version (its space is reused once no read holds it).
  Status remove(const TensorKey& key);

  bool contains(const TensorKey& key) const;
  Result<std::uint64_t> size_of(const TensorKey& key) const;
  Result<SwapLocation> locate(const TensorKey& key) const;
  std::vector<TensorKey> keys() const;
  SwapStoreStats stats() const;
  const SwapStoreConfig& config() const;
  // Whether every swap file is accessed with O_DIRECT (false where the file system refused it).
  bool direct_io() const;
  // What open() had to drop from a damaged journal (SwapStoreConfig::salvage_journal); its
  // status is OK when the journal was intact.
  const SwapRecovery& recovery() const;
  // Checks the extent map against the free list: every byte of the files is either free or
  // held by exactly one version; the message names the first broken invariant.
  Status is_valid() const;

  struct Impl;

 private:
  explicit SwapStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata
