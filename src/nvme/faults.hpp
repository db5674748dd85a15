// Fault injection for the I/O engine's tests: make a backend unavailable, refuse O_DIRECT,
// shorten completions, fail chosen pieces with an errno, or kill the process mid-write. The
// test owns the IoFaults object; it must outlive the engine. Never used outside tests.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "strata/nvme.hpp"

namespace strata::nvme_detail {

struct IoFaults {
  int uring_setup_errno = 0;   // io_uring setup fails with this errno (e.g. ENOSYS: no io_uring)
  int aio_setup_errno = 0;     // io_setup fails with this errno
  bool refuse_direct = false;  // open(O_DIRECT) fails with EINVAL, as on a file system without it
  // Every completion of more than this many bytes reports only this many (a short read or
  // write); the engine must resubmit the remainder. 0 = off.
  std::uint64_t max_transfer = 0;
  // A piece of `op` on a file whose path contains `path_contains` and whose range covers
  // file offset `offset` completes with -err instead of being submitted.
  struct Injected {
    IoOp op = IoOp::kRead;
    std::string path_contains;
    std::uint64_t offset = 0;
    int err = 0;
  };
  // The test adds and clears them while I/O may be in flight (the offload engine fetches the next
  // step's first units between calls), so the list is behind a mutex.
  void add_error(Injected e) {
    std::lock_guard<std::mutex> lock(mu_);
    errors_.push_back(std::move(e));
  }
  void clear_errors() {
    std::lock_guard<std::mutex> lock(mu_);
    errors_.clear();
  }
  // The errno a piece of `op` on `path` covering [offset, offset + length) completes with; 0: none.
  int error_for(IoOp op, const std::string& path, std::uint64_t offset, std::uint64_t length) const {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Injected& e : errors_) {
      if (e.op == op && path.find(e.path_contains) != std::string::npos && e.offset >= offset &&
          e.offset < offset + length)
        return e.err;
    }
    return 0;
  }
  // A disk that dies part-way through a burst of writes: once the write pieces started since the
  // engine was created add up to more than this many bytes, every further write piece fails with
  // EIO (0 = off). Atomics: the test moves the mark while the I/O threads read it.
  mutable std::atomic<std::uint64_t> fail_writes_after_bytes{0};
  mutable std::atomic<std::uint64_t> write_bytes_started{0};
  // SIGKILL the whole process once this many bytes of writes have completed (crash tests run
  // this in a forked child). 0 = off.
  std::uint64_t kill_after_write_bytes = 0;

  static Result<std::unique_ptr<IoEngine>> create_engine(const IoEngineConfig& config, PinnedPool* pool,
                                                         const IoFaults* faults) {
    return IoEngine::create_with_faults(config, pool, faults);
  }

 private:
  mutable std::mutex mu_;
  std::vector<Injected> errors_;
};

}  // namespace strata::nvme_detail
