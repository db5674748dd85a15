// libaio backend (Linux native AIO). Asynchronous only with O_DIRECT: on a buffered descriptor
// io_submit does the I/O before returning, which is still correct, just serial. Wake-ups arrive
// as the completion of an IOCB_CMD_POLL on an eventfd, so the thread blocks in io_getevents
// alone.
#include <libaio.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <ctime>
#include <vector>

#include "nvme/engine_internal.hpp"
#include "strata/log.hpp"

namespace strata::nvme_detail {
namespace {

static_assert(sizeof(iocb) <= sizeof(Piece::scratch), "a piece carries its iocb");

class AioQueue final : public Queue {
 public:
  ~AioQueue() override {
    if (ctx_ != nullptr) io_destroy(ctx_);
    if (efd_ >= 0) ::close(efd_);
  }

  IoBackendKind kind() const override { return IoBackendKind::kLibaio; }

  Status init(const QueueParams& params) override {
    if (params.faults != nullptr && params.faults->aio_setup_errno != 0) {
      return unavailable("io_setup failed: " + errno_text(params.faults->aio_setup_errno));
    }
    unsigned depth = params.queue_depth + 1;  // + the wake-up poll
    int r = io_setup(static_cast<int>(depth), &ctx_);
    if (r < 0) {
      ctx_ = nullptr;
      return unavailable("io_setup(" + std::to_string(depth) + ") failed: " + errno_text(-r) +
                         " (see /proc/sys/fs/aio-max-nr)");
    }
    events_.resize(depth);
    efd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (efd_ < 0) return unavailable("eventfd failed: " + errno_text(errno));
    io_prep_poll(&wake_, efd_, POLLIN);
    iocb* list[1] = {&wake_};
    r = io_submit(ctx_, 1, list);
    if (r != 1)
      return unavailable("this kernel's AIO cannot poll (IOCB_CMD_POLL): " + errno_text(r < 0 ? -r : EINVAL));
    armed_ = true;
    return ok_status();
  }

  void enqueue(const Sqe& s) override {
    auto* cb = reinterpret_cast<iocb*>(s.piece->scratch);
    if (s.piece->op == IoOp::kRead) {
      io_prep_pread(cb, s.fd, s.ptr, s.length, static_cast<long long>(s.offset));
    } else {
      io_prep_pwrite(cb, s.fd, s.ptr, s.length, static_cast<long long>(s.offset));
    }
    cb->data = s.piece;
    to_submit_.push_back(cb);
  }

  void flush(std::vector<Completion>& out) override {
    std::size_t i = 0;
    while (i < to_submit_.size()) {
      int r = io_submit(ctx_, static_cast<long>(to_submit_.size() - i), to_submit_.data() + i);
      if (r > 0) {
        i += static_cast<std::size_t>(r);
      } else if (r == -EAGAIN || r == -EINTR) {
        break;  // retried by the next flush or wait
      } else {
        // The first remaining iocb was rejected (EINVAL for misaligned O_DIRECT, EBADF...).
        out.push_back({static_cast<Piece*>(to_submit_[i]->data), r < 0 ? r : -EIO});
        ++i;
      }
    }
    to_submit_.erase(to_submit_.begin(), to_submit_.begin() + static_cast<std::ptrdiff_t>(i));
  }

  void wait(std::vector<Completion>& out, bool block) override {
    if (!armed_) {
      iocb* list[1] = {&wake_};
      if (io_submit(ctx_, 1, list) == 1) armed_ = true;
    }
    flush(out);
    if (!out.empty()) return;
    timespec zero{0, 0};
    timespec retry{0, 1000000};  // 1 ms: something is still waiting to be submitted
    timespec* timeout = !block ? &zero : (!to_submit_.empty() || !armed_) ? &retry : nullptr;
    int r = io_getevents(ctx_, block ? 1 : 0, static_cast<long>(events_.size()), events_.data(), timeout);
    if (r < 0) {
      if (r != -EINTR) {
        STRATA_LOG_ONCE(kError, kNvme) << "io_getevents failed: " << errno_text(-r);
      }
      return;
    }
    for (int k = 0; k < r; ++k) {
      const io_event& ev = events_[k];
      if (ev.obj == &wake_) {
        std::uint64_t v;
        [[maybe_unused]] auto n = ::read(efd_, &v, sizeof v);
        armed_ = false;
        continue;
      }
      out.push_back({static_cast<Piece*>(ev.data), static_cast<std::int64_t>(static_cast<long>(ev.res))});
    }
  }

  void wake() override {
    std::uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(efd_, &one, sizeof one);
  }

 private:
  io_context_t ctx_ = nullptr;
  int efd_ = -1;
  iocb wake_{};
  bool armed_ = false;
  std::vector<iocb*> to_submit_;
  std::vector<io_event> events_;
};

}  // namespace

std::unique_ptr<Queue> make_aio_queue() { return std::make_unique<AioQueue>(); }

}  // namespace strata::nvme_detail
