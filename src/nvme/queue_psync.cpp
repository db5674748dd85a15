// pread/pwrite backend: always available. Each I/O thread performs its pieces one after the
// other, so parallelism comes from intra_op_parallelism alone.
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <vector>

#include "nvme/engine_internal.hpp"

namespace strata::nvme_detail {
namespace {

class PsyncQueue final : public Queue {
 public:
  ~PsyncQueue() override {
    if (efd_ >= 0) ::close(efd_);
  }

  IoBackendKind kind() const override { return IoBackendKind::kPsync; }

  Status init(const QueueParams& /*params*/) override {
    efd_ = ::eventfd(0, EFD_CLOEXEC);
    if (efd_ < 0) return unavailable("eventfd failed: " + errno_text(errno));
    return ok_status();
  }

  void enqueue(const Sqe& s) override { pending_.push_back(s); }

  void flush(std::vector<Completion>& /*out*/) override {}

  void wait(std::vector<Completion>& out, bool block) override {
    if (!pending_.empty()) {
      for (const Sqe& s : pending_) {
        ssize_t r;
        do {
          r = s.piece->op == IoOp::kRead ? ::pread(s.fd, s.ptr, s.length, static_cast<off_t>(s.offset))
                                         : ::pwrite(s.fd, s.ptr, s.length, static_cast<off_t>(s.offset));
        } while (r < 0 && errno == EINTR);
        out.push_back({s.piece, r < 0 ? -static_cast<std::int64_t>(errno) : static_cast<std::int64_t>(r)});
      }
      pending_.clear();
      return;
    }
    if (!block) return;
    std::uint64_t v;
    while (::read(efd_, &v, sizeof v) < 0 && errno == EINTR) {
    }
  }

  void wake() override {
    std::uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(efd_, &one, sizeof one);
  }

 private:
  int efd_ = -1;
  std::vector<Sqe> pending_;
};

}  // namespace

std::unique_ptr<Queue> make_psync_queue() { return std::make_unique<PsyncQueue>(); }

}  // namespace strata::nvme_detail
