// Inside the I/O engine.
//
// Vocabulary:
//   request  what the caller asked for: (op, file, offset, length, buffer).
//   segment  the part of a request that falls in one member file of a striped set.
//   piece    what one backend operation moves: at most `block_size` bytes of one segment.
//            Pieces whose file offset and length are 4 KiB multiples go through the O_DIRECT
//            descriptor (memory not 4 KiB aligned is copied through a bounce buffer); the
//            unaligned head and tail of a segment go through the buffered descriptor, so an
//            unaligned request never needs a read-modify-write of a neighbour's bytes.
//   queue    one backend instance (an io_uring ring, a libaio context, or a pread loop),
//            owned by one I/O thread and only touched by it (io_uring is set up single-issuer).
//
// Invariants, per I/O thread:
//   inflight = pieces handed to the queue and not yet completed,   inflight <= queue_depth
//              (a resubmitted remainder counts as the same piece)
//   bounce buffers held  <= inflight,   bounce buffers allocated <= queue_depth
// Per request: pieces_left = its pieces not yet completed; on reaching 0 the request's on_done
// runs (unless a piece failed) and the handle's requests_left drops by one; on reaching 0 the
// handle completes: finalize, then status published, waiters woken, callbacks run.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "nvme/faults.hpp"
#include "strata/alloc.hpp"
#include "strata/log.hpp"
#include "strata/nvme.hpp"

namespace strata::nvme_detail {

inline constexpr std::uint64_t kDirectAlign = 4096;
inline constexpr int kFixedFileSlots = 2048;
inline constexpr int kFixedBufferSlots = 1024;
inline constexpr std::uint64_t kMaxFixedBuffer = 1ull << 30;  // io_uring's limit per buffer

// One OS file (a member of a FileEntry).
struct Member {
  std::string path;
  int buffered_fd = -1;
  int direct_fd = -1;               // -1 when O_DIRECT is off or refused
  std::atomic<bool> direct{false};  // cleared if O_DIRECT I/O is refused at run time
  int slot_buffered = -1;           // registered-file slots (same in every ring), -1 if none
  int slot_direct = -1;
};

struct FileEntry {
  bool open = false;
  OpenMode mode = OpenMode::kRead;
  std::uint64_t stripe_unit = 0;  // 0 for a single file
  std::vector<std::unique_ptr<Member>> members;
  std::atomic<std::int64_t> inflight{0};  // requests in flight
};

struct IoState;

struct RequestState {
  IoRequest req;
  FileEntry* file = nullptr;
  IoState* owner = nullptr;
  std::atomic<std::uint32_t> pieces_left{0};
  std::atomic<bool> failed{false};
};

struct Piece {
  RequestState* request = nullptr;
  Member* member = nullptr;
  std::uint64_t offset = 0;  // in the member file
  std::uint64_t length = 0;
  std::uint64_t done = 0;         // bytes already transferred (short completions)
  unsigned char* user = nullptr;  // the caller's memory for this piece
  unsigned char* io = nullptr;    // the memory the kernel sees: `user` or a bounce buffer
  int bounce = -1;                // index into the thread's bounce buffers
  int buf_index = -1;             // registered buffer holding `io`, or -1
  std::uint32_t thread = 0;
  IoOp op = IoOp::kRead;
  bool direct = false;                   // through the O_DIRECT descriptor
  bool needs_bounce = false;             // direct, but `user` is not 4 KiB aligned
  alignas(8) unsigned char scratch[64];  // backend-private (libaio's iocb)
};

struct Completion {
  Piece* piece = nullptr;
  std::int64_t res = 0;  // bytes, or -errno
};

// One submission: what the queue needs to issue the remaining part of a piece.
struct Sqe {
  Piece* piece;
  int fd;  // a descriptor, or a registered slot when fixed_file
  bool fixed_file;
  int buf_index;  // registered buffer, or -1
  std::uint64_t offset;
  unsigned char* ptr;
  std::uint64_t length;
};

struct QueueParams {
  std::uint32_t queue_depth = 8;
  bool sq_poll = false;
  std::uint32_t sq_poll_idle_ms = 1000;
  const IoFaults* faults = nullptr;
};

// A backend instance, driven by one thread (wake() is the only call from other threads).
class Queue {
 public:
  virtual ~Queue() = default;
  virtual IoBackendKind kind() const = 0;
  // Called on the owning thread before anything else.
  virtual Status init(const QueueParams& params) = 0;
  // Prepares one operation; it is issued by the next flush().
  virtual void enqueue(const Sqe& sqe) = 0;
  // Issues what enqueue() prepared. Operations that cannot be issued at all come back in
  // `out` as completions carrying -errno.
  virtual void flush(std::vector<Completion>& out) = 0;
  // Collects completions; with `block`, waits until there is at least one or wake() is called.
  virtual void wait(std::vector<Completion>& out, bool block) = 0;
  virtual void wake() = 0;
  // Registered files and buffers (io_uring); the defaults report "not supported".
  virtual bool fixed_files() const { return false; }
  virtual Status set_file_slot(int /*slot*/, int /*fd*/) { return ok_status(); }
  // Registers [base, base+bytes) (bytes <= kMaxFixedBuffer); returns its index or -1.
  virtual int register_buffer(void* /*base*/, std::uint64_t /*bytes*/) { return -1; }
  virtual void unregister_buffer(int /*index*/) {}
};

std::unique_ptr<Queue> make_uring_queue();
std::unique_ptr<Queue> make_aio_queue();
std::unique_ptr<Queue> make_psync_queue();

// Logs `message` unless the same text was logged before in this process: each distinct
// fallback reason is reported once, however many engines hit it.
void log_once(LogLevel level, const std::string& message);

// "ENOSPC", "EIO", ...
std::string errno_name(int err);
// "No space left on device (ENOSPC)"
std::string errno_text(int err);

class IoThread;

// The shared state behind an IoHandle.
struct IoState {
  IoEngine::Impl* engine = nullptr;
  std::shared_ptr<IoState> keep_alive;  // the engine's reference while in flight
  std::unique_ptr<RequestState[]> requests;
  std::size_t request_count = 0;
  std::unique_ptr<Piece[]> pieces;
  std::size_t piece_count = 0;
  std::atomic<std::uint64_t> requests_left{0};
  std::atomic<std::uint64_t> bytes{0};
  std::atomic<std::uint32_t> done{0};
  std::mutex mu;
  Status first_error;   // guarded by mu
  Status final_status;  // written before done is set
  std::function<Status(Status)> finalize;
  std::vector<std::function<void(const Status&)>> callbacks;  // guarded by mu

  void record_error(Status s) {
    std::lock_guard<std::mutex> lock(mu);
    if (first_error.ok()) first_error = std::move(s);
  }
};

}  // namespace strata::nvme_detail

namespace strata {

struct IoEngine::Impl {
  IoEngineConfig config;
  IoBackendKind backend = IoBackendKind::kPsync;
  PinnedPool* pool = nullptr;
  const nvme_detail::IoFaults* faults = nullptr;
  std::vector<std::unique_ptr<nvme_detail::IoThread>> threads;
  std::atomic<std::uint64_t> next_thread{0};

  mutable std::shared_mutex files_mu;
  std::vector<std::unique_ptr<nvme_detail::FileEntry>> files;  // index = FileId.index
  std::vector<std::uint32_t> free_files;
  std::vector<int> free_slots;  // registered-file slots

  std::mutex regions_mu;
  struct Region {
    void* base;
    std::uint64_t bytes;
  };
  std::vector<Region> regions;  // user-registered memory

  std::atomic<std::int64_t> inflight_handles{0};

  // Statistics (relaxed counters).
  std::atomic<std::uint64_t> bytes_read{0}, bytes_written{0}, pieces{0}, fixed_pieces{0}, bounced_pieces{0},
      buffered_pieces{0}, short_transfers{0}, errors{0}, syncs{0};
  std::atomic<std::uint64_t> written_for_kill{0};
  CpuAccount cpu;  // the I/O threads' CPU time

  IoHandle submit(std::vector<IoRequest> requests, std::function<Status(Status)> finalize);
  // Runs `fn` on every I/O thread and waits; returns the first error.
  Status on_every_thread(const std::function<Status(nvme_detail::IoThread&)>& fn);
  void complete_piece(nvme_detail::Piece* piece, const Status& error);
  void complete_request(nvme_detail::RequestState* request);
  void complete_handle(nvme_detail::IoState* state);
  Status start_threads(IoBackendKind kind);
  void stop_threads();
  nvme_detail::FileEntry* entry(FileId file) const;  // null unless open; caller holds files_mu
};

}  // namespace strata
