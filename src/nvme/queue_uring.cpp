// io_uring backend (liburing). One ring per I/O thread, created on that thread and set up
// single-issuer with deferred task running where the kernel allows it, so completions are
// reaped in batches when the thread enters the kernel instead of interrupting it. Files and
// buffers are registered in sparse tables (fixed files skip the fd lookup, fixed buffers skip
// pinning pages on every I/O). Wake-ups from submitters arrive as the completion of a read on
// an eventfd that is always armed while the thread may block.
#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <vector>

#include "nvme/engine_internal.hpp"
#include "strata/log.hpp"

namespace strata::nvme_detail {
namespace {

constexpr std::uint64_t kWakeTag = 1;  // user_data of the eventfd read; pieces are 8-aligned

class UringQueue final : public Queue {
 public:
  ~UringQueue() override {
    if (ring_ok_) io_uring_queue_exit(&ring_);
    if (efd_ >= 0) ::close(efd_);
  }

  IoBackendKind kind() const override { return IoBackendKind::kIoUring; }

  Status init(const QueueParams& params) override {
    if (params.faults != nullptr && params.faults->uring_setup_errno != 0) {
      return unavailable("io_uring setup failed: " + errno_text(params.faults->uring_setup_errno));
    }
    // At most queue_depth pieces and the wake-up read are outstanding: the CQ holds them all;
    // the SQ may be smaller (get_sqe() submits when it is full).
    unsigned cq_entries = 8;
    while (cq_entries < params.queue_depth + 2) cq_entries <<= 1;
    unsigned entries = std::min(cq_entries, 4096u);
    // Most capable setup first; older kernels reject the newer flags with EINVAL.
    std::vector<unsigned> attempts;
    if (params.sq_poll) {
      attempts = {IORING_SETUP_SQPOLL | IORING_SETUP_SINGLE_ISSUER, IORING_SETUP_SQPOLL};
    } else {
      attempts = {IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN, IORING_SETUP_COOP_TASKRUN, 0u};
    }
    int r = -EINVAL;
    for (unsigned flags : attempts) {
      io_uring_params p{};
      p.flags = flags | IORING_SETUP_CQSIZE;
      p.cq_entries = cq_entries;
      if (flags & IORING_SETUP_SQPOLL) p.sq_thread_idle = params.sq_poll_idle_ms;
      r = io_uring_queue_init_params(entries, &ring_, &p);
      if (r == 0) {
        flags_ = p.flags;
        break;
      }
      if (r != -EINVAL) break;
    }
    if (r != 0) return unavailable("io_uring_queue_init failed: " + errno_text(-r));
    ring_ok_ = true;
    efd_ = ::eventfd(0, EFD_CLOEXEC);
    if (efd_ < 0) return unavailable("eventfd failed: " + errno_text(errno));
    fixed_files_ = io_uring_register_files_sparse(&ring_, kFixedFileSlots) == 0;
    if (!fixed_files_) {
      STRATA_LOG_ONCE(kInfo, kNvme) << "io_uring: registered files unavailable";
    }
    fixed_bufs_ = io_uring_register_buffers_sparse(&ring_, kFixedBufferSlots) == 0;
    if (fixed_bufs_) {
      buf_used_.assign(kFixedBufferSlots, false);
    } else {
      STRATA_LOG_ONCE(kInfo, kNvme) << "io_uring: registered buffers unavailable";
    }
    (void)io_uring_register_ring_fd(&ring_);  // saves an fd lookup per enter; optional
    return ok_status();
  }

  void enqueue(const Sqe& s) override {
    io_uring_sqe* sqe = get_sqe();
    bool read = s.piece->op == IoOp::kRead;
    auto len = static_cast<unsigned>(s.length);
    if (s.buf_index >= 0) {
      if (read) {
        io_uring_prep_read_fixed(sqe, s.fd, s.ptr, len, s.offset, s.buf_index);
      } else {
        io_uring_prep_write_fixed(sqe, s.fd, s.ptr, len, s.offset, s.buf_index);
      }
    } else if (read) {
      io_uring_prep_read(sqe, s.fd, s.ptr, len, s.offset);
    } else {
      io_uring_prep_write(sqe, s.fd, s.ptr, len, s.offset);
    }
    if (s.fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, s.piece);
  }

  void flush(std::vector<Completion>& /*out*/) override {
    if (io_uring_sq_ready(&ring_) == 0) return;
    int r = io_uring_submit(&ring_);
    // Resource shortages (EAGAIN, EBUSY) leave the entries queued for the next enter.
    if (r < 0 && r != -EAGAIN && r != -EBUSY && r != -EINTR) {
      STRATA_LOG_ONCE(kError, kNvme) << "io_uring_submit failed: " << errno_text(-r);
    }
  }

  void wait(std::vector<Completion>& out, bool block) override {
    if (!wake_armed_) arm_wake();
    if (block) {
      int r = io_uring_submit_and_wait(&ring_, 1);
      if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY && r != -ETIME) {
        STRATA_LOG_ONCE(kError, kNvme) << "io_uring_enter failed: " << errno_text(-r);
      }
    } else if (flags_ & IORING_SETUP_DEFER_TASKRUN) {
      (void)io_uring_get_events(&ring_);
    }
    unsigned head;
    unsigned seen = 0;
    io_uring_cqe* cqe;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++seen;
      if (cqe->user_data == kWakeTag) {
        wake_armed_ = false;
        continue;
      }
      out.push_back({static_cast<Piece*>(io_uring_cqe_get_data(cqe)), cqe->res});
    }
    io_uring_cq_advance(&ring_, seen);
  }

  void wake() override {
    std::uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(efd_, &one, sizeof one);
  }

  bool fixed_files() const override { return fixed_files_; }

  Status set_file_slot(int slot, int fd) override {
    if (!fixed_files_) return unavailable("io_uring: no registered file table");
    int r = io_uring_register_files_update(&ring_, static_cast<unsigned>(slot), &fd, 1);
    if (r < 0) return io_error("io_uring: registering a file failed: " + errno_text(-r));
    return ok_status();
  }

  int register_buffer(void* base, std::uint64_t bytes) override {
    if (!fixed_bufs_) return -1;
    int idx = -1;
    for (int i = 0; i < kFixedBufferSlots; ++i) {
      if (!buf_used_[i]) {
        idx = i;
        break;
      }
    }
    if (idx < 0) {
      STRATA_LOG_ONCE(kInfo, kNvme)
          << "io_uring: registered buffer table full; further memory uses plain I/O";
      return -1;
    }
    iovec iov{base, bytes};
    __u64 tag = 0;
    int r = io_uring_register_buffers_update_tag(&ring_, static_cast<unsigned>(idx), &iov, &tag, 1);
    if (r < 0) {
      STRATA_LOG_ONCE(kInfo, kNvme) << "io_uring: registering " << bytes
                                    << " bytes of memory failed: " << errno_text(-r)
                                    << "; using plain I/O on it";
      return -1;
    }
    buf_used_[idx] = true;
    return idx;
  }

  void unregister_buffer(int index) override {
    if (!fixed_bufs_ || index < 0 || index >= kFixedBufferSlots || !buf_used_[index]) return;
    iovec iov{nullptr, 0};
    __u64 tag = 0;
    (void)io_uring_register_buffers_update_tag(&ring_, static_cast<unsigned>(index), &iov, &tag, 1);
    buf_used_[index] = false;
  }

 private:
  io_uring_sqe* get_sqe() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    while (sqe == nullptr) {  // the ring holds queue_depth + 2 entries, so this is rare
      (void)io_uring_submit(&ring_);
      sqe = io_uring_get_sqe(&ring_);
    }
    return sqe;
  }

  void arm_wake() {
    io_uring_sqe* sqe = get_sqe();
    io_uring_prep_read(sqe, efd_, &wake_buf_, sizeof wake_buf_, 0);
    sqe->user_data = kWakeTag;
    wake_armed_ = true;
  }

  io_uring ring_{};
  bool ring_ok_ = false;
  unsigned flags_ = 0;
  int efd_ = -1;
  std::uint64_t wake_buf_ = 0;
  bool wake_armed_ = false;
  bool fixed_files_ = false;
  bool fixed_bufs_ = false;
  std::vector<bool> buf_used_;
};

}  // namespace

std::unique_ptr<Queue> make_uring_queue() { return std::make_unique<UringQueue>(); }

}  // namespace strata::nvme_detail
