// The I/O engine: splitting requests into pieces, the I/O threads that drive one backend queue
// each, completion accounting and backend fallback. engine_internal.hpp defines the vocabulary
// and the invariants.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <set>

#include "nvme/engine_internal.hpp"
#include "strata/alloc.hpp"
#include "strata/log.hpp"
#include "strata/options.hpp"

namespace strata {
namespace nvme_detail {

std::string errno_name(int err) {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 32))
  if (const char* n = ::strerrorname_np(err)) return n;
#endif
  return "errno " + std::to_string(err);
}

std::string errno_text(int err) {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 32))
  const char* d = ::strerrordesc_np(err);
  std::string text = d ? d : "unknown error";
#else
  char buf[128];
  std::string text = ::strerror_r(err, buf, sizeof buf);
#endif
  return text + " (" + errno_name(err) + ")";
}

void log_once(LogLevel level, const std::string& message) {
  static std::mutex mu;
  static std::set<std::string> seen;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!seen.insert(message).second) return;
  }
  if (log_enabled(level, Subsys::kNvme)) LogLine(level, Subsys::kNvme).stream() << message;
}

namespace {

std::string piece_where(const Piece& p) {
  const RequestState& r = *p.request;
  std::string s = std::to_string(p.length - p.done) + " bytes at offset " +
                  std::to_string(p.offset + p.done) + " of " + p.member->path;
  if (r.file->members.size() > 1)
    s += " (striped file; request at logical offset " + std::to_string(r.req.offset) + ")";
  return s;
}

Status piece_errno(const Piece& p, int err) {
  return io_error(std::string(p.op == IoOp::kRead ? "read" : "write") + " of " + piece_where(p) +
                  " failed: " + errno_text(err));
}

struct Bounce {
  ArenaBuffer pooled;
  AlignedBuffer aligned;
  unsigned char* data = nullptr;
  int buf_index = -1;
};

struct Registered {
  std::uintptr_t base = 0;
  std::uint64_t bytes = 0;
  int index = -1;
  void* owner = nullptr;  // the register_memory() base it came from (null: pool, bounce)
};

}  // namespace

class IoThread {
 public:
  IoThread(IoEngine::Impl* engine, std::uint32_t id, std::unique_ptr<Queue> queue)
      : engine_(engine), id_(id), queue_(std::move(queue)) {}
  ~IoThread() { stop(); }

  Status start(const QueueParams& params) {
    params_ = params;
    auto ready = std::make_shared<std::promise<Status>>();
    auto fut = ready->get_future();
    thread_ = std::thread([this, ready] { run(*ready); });
    Status s = fut.get();
    if (!s.ok()) {
      thread_.join();
      return s;
    }
    return ok_status();
  }

  void stop() {
    if (!thread_.joinable()) return;
    {
      // Woken under the lock: the thread takes it before destroying the queue.
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      queue_->wake();
    }
    thread_.join();
  }

  void push(std::vector<Piece*>& pieces) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      incoming_.insert(incoming_.end(), pieces.begin(), pieces.end());
    }
    // Pairs with the thread's store before it re-checks incoming_ and blocks.
    if (waiting_.load(std::memory_order_seq_cst)) queue_->wake();
  }

  // Runs fn on this I/O thread and waits for it. Never call from an I/O thread.
  Status control(const std::function<Status(IoThread&)>& fn) {
    // The promise is shared: set_value may still be returning when the caller wakes up.
    auto done = std::make_shared<std::promise<Status>>();
    auto fut = done->get_future();
    {
      std::lock_guard<std::mutex> lock(mu_);
      controls_.push_back([this, done, &fn] { done->set_value(fn(*this)); });
      queue_->wake();
    }
    return fut.get();
  }

  Queue& queue() { return *queue_; }

  // Thread side: registers [base, base+bytes) in ≤1 GiB buffers.
  Status register_region(void* base, std::uint64_t bytes, void* owner) {
    auto* p = static_cast<unsigned char*>(base);
    for (std::uint64_t off = 0; off < bytes; off += kMaxFixedBuffer) {
      std::uint64_t n = std::min(kMaxFixedBuffer, bytes - off);
      int idx = queue_->register_buffer(p + off, n);
      if (idx < 0) continue;  // the memory still works, without fixed buffers
      Registered r{reinterpret_cast<std::uintptr_t>(p + off), n, idx, owner};
      registered_.insert(
          std::upper_bound(registered_.begin(), registered_.end(), r,
                           [](const Registered& a, const Registered& b) { return a.base < b.base; }),
          r);
    }
    return ok_status();
  }

  void unregister_region(void* owner) {
    for (auto it = registered_.begin(); it != registered_.end();) {
      if (it->owner == owner) {
        queue_->unregister_buffer(it->index);
        it = registered_.erase(it);
      } else {
        ++it;
      }
    }
  }

 private:
  void run(std::promise<Status>& ready) {
    name_current_thread("io." + std::to_string(id_));
    engine_->cpu.join(/*since_start=*/true);
    Status s = engine_->config.cpus.empty() ? ok_status() : pin_current_thread(engine_->config.cpus);
    if (s.ok()) s = queue_->init(params_);
    if (s.ok() && engine_->pool != nullptr) {
      void* base = engine_->pool->arena().base();
      std::uint64_t bytes = engine_->pool->stats().capacity;
      if (base != nullptr && bytes > 0) s = register_region(base, bytes, nullptr);
    }
    ready.set_value(s);
    if (!s.ok()) return;
    loop();
    // Tear the ring down on its own thread before the memory registered with it goes away;
    // under the lock, so that no wake() from stop() or control() is still using it.
    std::lock_guard<std::mutex> lock(mu_);
    queue_.reset();
    bounces_.clear();
  }

  void loop() {
    std::vector<Piece*> batch;
    std::vector<std::function<void()>> controls;
    std::vector<Completion> comps;
    const IoEngineConfig& cfg = engine_->config;
    for (;;) {
      bool stopping;
      {
        std::lock_guard<std::mutex> lock(mu_);
        batch.swap(incoming_);
        controls.swap(controls_);
        stopping = stop_;
      }
      for (Piece* p : batch) pending_.push_back(p);
      batch.clear();
      for (auto& c : controls) c();
      controls.clear();

      fill(comps);
      // No separate submit here when the thread is about to wait: the wait submits too
      // (io_uring_submit_and_wait, one system call per round).
      if (!comps.empty()) {
        process(comps);
        continue;
      }
      if (stopping && inflight_ == 0 && pending_.empty()) return;

      bool can_take_more = (cfg.overlap_events || inflight_ == 0) && inflight_ < cfg.queue_depth;
      if (can_take_more) {
        waiting_.store(true, std::memory_order_seq_cst);
        bool more;
        {
          std::lock_guard<std::mutex> lock(mu_);
          more = !incoming_.empty() || !controls_.empty() || stop_ != stopping;
        }
        if (more) {
          waiting_.store(false, std::memory_order_relaxed);
          continue;
        }
      }
      queue_->wait(comps, /*block=*/true);
      waiting_.store(false, std::memory_order_relaxed);
      process(comps);
    }
  }

  // Hands pending pieces to the queue up to queue_depth; returns how many it started. With
  // overlap_events off, a new batch starts only when the previous one has drained.
  int fill(std::vector<Completion>& out) {
    const IoEngineConfig& cfg = engine_->config;
    int started = 0;
    if (!cfg.overlap_events && inflight_ > 0) return 0;
    while (!pending_.empty() && inflight_ < cfg.queue_depth) {
      if (!start_piece(pending_.front(), out)) break;
      pending_.pop_front();
      ++started;
      if (cfg.single_submit) queue_->flush(out);
    }
    return started;
  }

  // The injected errno of a piece (0: none).
  int injected(const Piece& p) const {
    const IoFaults* f = engine_->faults;
    return f == nullptr ? 0 : f->error_for(p.op, p.member->path, p.offset, p.length);
  }

  int lookup_fixed(const unsigned char* p, std::uint64_t n) const {
    auto addr = reinterpret_cast<std::uintptr_t>(p);
    auto it = std::upper_bound(registered_.begin(), registered_.end(), addr,
                               [](std::uintptr_t a, const Registered& r) { return a < r.base; });
    if (it == registered_.begin()) return -1;
    --it;
    return addr + n <= it->base + it->bytes ? it->index : -1;
  }

  // A free bounce buffer's index; -2 when all queue_depth of them are in use; -1 when one
  // cannot be allocated.
  int acquire_bounce() {
    if (!free_bounces_.empty()) {
      int b = free_bounces_.back();
      free_bounces_.pop_back();
      return b;
    }
    if (bounces_.size() >= engine_->config.queue_depth) return -2;
    Bounce b;
    std::uint64_t bytes = engine_->config.block_size;
    if (engine_->pool != nullptr) {
      auto buf = engine_->pool->allocate(bytes, "nvme bounce buffer");
      if (buf.ok()) {
        b.pooled = std::move(buf).value();
        b.data = static_cast<unsigned char*>(b.pooled.data());
        b.buf_index = lookup_fixed(b.data, bytes);
      } else {
        STRATA_LOG_ONCE(kWarn, kNvme)
            << "bounce buffers come from aligned host memory: " << buf.status().message();
      }
    }
    if (b.data == nullptr) {
      auto buf = AlignedBuffer::allocate(bytes);
      if (!buf.ok()) return -1;
      b.aligned = std::move(buf).value();
      b.data = static_cast<unsigned char*>(b.aligned.data());
      b.buf_index = queue_->register_buffer(b.data, bytes);
      if (b.buf_index >= 0) {
        Registered r{reinterpret_cast<std::uintptr_t>(b.data), bytes, b.buf_index, nullptr};
        registered_.insert(
            std::upper_bound(registered_.begin(), registered_.end(), r,
                             [](const Registered& x, const Registered& y) { return x.base < y.base; }),
            r);
      }
    }
    bounces_.push_back(std::move(b));
    return static_cast<int>(bounces_.size()) - 1;
  }

  // Hands a piece to the queue. False when it must wait for a bounce buffer.
  bool start_piece(Piece* p, std::vector<Completion>& out) {
    if (const int err = injected(*p); err != 0) {
      ++inflight_;
      out.push_back({p, -static_cast<std::int64_t>(err)});
      return true;
    }
    if (const IoFaults* f = engine_->faults; f != nullptr && p->op == IoOp::kWrite) {
      const std::uint64_t mark = f->fail_writes_after_bytes.load();
      const std::uint64_t before = f->write_bytes_started.fetch_add(p->length);
      if (mark > 0 && before + p->length > mark) {
        ++inflight_;
        out.push_back({p, -static_cast<std::int64_t>(EIO)});
        return true;
      }
    }
    if (p->direct && !p->member->direct.load(std::memory_order_relaxed)) p->direct = false;
    if (p->direct && p->needs_bounce) {
      int b = acquire_bounce();
      if (b == -2) return false;
      if (b == -1) {
        finish_piece(p, out_of_memory("cannot allocate a " + format_bytes(engine_->config.block_size) +
                                      " bounce buffer for unaligned memory (" + piece_where(*p) + ")"));
        return true;
      }
      p->bounce = b;
      p->io = bounces_[b].data;
      p->buf_index = bounces_[b].buf_index;
      if (p->op == IoOp::kWrite) std::memcpy(p->io, p->user, p->length);
      engine_->bounced_pieces.fetch_add(1, std::memory_order_relaxed);
    } else {
      p->io = p->user;
      p->buf_index = lookup_fixed(p->io, p->length);
    }
    if (p->buf_index >= 0) engine_->fixed_pieces.fetch_add(1, std::memory_order_relaxed);
    if (!p->direct) engine_->buffered_pieces.fetch_add(1, std::memory_order_relaxed);
    ++inflight_;
    issue(p);
    return true;
  }

  void issue(Piece* p) {
    Member& m = *p->member;
    Sqe s;
    s.piece = p;
    int slot = p->direct ? m.slot_direct : m.slot_buffered;
    s.fixed_file = queue_->fixed_files() && slot >= 0;
    s.fd = s.fixed_file ? slot : (p->direct ? m.direct_fd : m.buffered_fd);
    s.buf_index = p->buf_index;
    s.offset = p->offset + p->done;
    s.ptr = p->io + p->done;
    s.length = p->length - p->done;
    queue_->enqueue(s);
  }

  // Settles completions: resubmits short and retryable ones, copies bounced reads out. The
  // completion work of finished pieces (checksum hooks, handle callbacks) runs last, after the
  // slots they freed have been refilled and submitted, so the device stays busy meanwhile.
  void process(std::vector<Completion>& comps) {
    const IoFaults* f = engine_->faults;
    bool hooks = false;
    for (const Completion& c : comps) {
      Piece* p = c.piece;
      --inflight_;
      std::int64_t res = c.res;
      if (f != nullptr && f->max_transfer > 0 && res > static_cast<std::int64_t>(f->max_transfer)) {
        res = static_cast<std::int64_t>(f->max_transfer);
      }
      if (res == -EAGAIN || res == -EINTR) {
        ++inflight_;
        issue(p);
        continue;
      }
      if (res == -EINVAL && p->direct) {
        // The file system accepted O_DIRECT at open but refuses the I/O: go buffered for good.
        if (p->member->direct.exchange(false)) {
          STRATA_LOG(kWarn, kNvme) << "O_DIRECT I/O refused (EINVAL) on " << p->member->path
                                   << "; using buffered I/O for this file";
        }
        p->direct = false;
        ++inflight_;
        issue(p);
        continue;
      }
      if (res < 0) {
        settle(p, piece_errno(*p, static_cast<int>(-res)));
        continue;
      }
      if (res == 0) {
        settle(p, io_error(p->op == IoOp::kRead
                               ? "read of " + piece_where(*p) + " hit the end of the file after " +
                                     std::to_string(p->done) + " of " + std::to_string(p->length) + " bytes"
                               : "write of " + piece_where(*p) + " made no progress"));
        continue;
      }
      p->done += static_cast<std::uint64_t>(res);
      if (p->done < p->length) {
        engine_->short_transfers.fetch_add(1, std::memory_order_relaxed);
        // The remainder starts off the 4 KiB grid: O_DIRECT would refuse it.
        if (p->direct && p->done % kDirectAlign != 0) p->direct = false;
        ++inflight_;
        issue(p);
        continue;
      }
      if (p->bounce >= 0 && p->op == IoOp::kRead) std::memcpy(p->user, p->io, p->length);
      hooks = hooks || static_cast<bool>(p->request->req.on_done);
      settle(p, ok_status());
    }
    comps.clear();
    if (finished_.empty()) return;
    // Only worth a separate submit when completion work is heavy (hooks); otherwise the next
    // wait submits the refill together.
    if (hooks && fill(comps) > 0) queue_->flush(comps);
    for (auto& [p, status] : finished_) finish_piece(p, status);
    finished_.clear();
  }

  // A piece is done with the queue: its bounce buffer is free again; completion work follows.
  void settle(Piece* p, Status status) {
    if (p->bounce >= 0) {
      free_bounces_.push_back(p->bounce);
      p->bounce = -1;
    }
    finished_.emplace_back(p, std::move(status));
  }

  void finish_piece(Piece* p, const Status& error) {
    if (p->bounce >= 0) {
      free_bounces_.push_back(p->bounce);
      p->bounce = -1;
    }
    if (error.ok()) {
      (p->op == IoOp::kRead ? engine_->bytes_read : engine_->bytes_written)
          .fetch_add(p->length, std::memory_order_relaxed);
      const IoFaults* f = engine_->faults;
      if (p->op == IoOp::kWrite && f != nullptr && f->kill_after_write_bytes > 0 &&
          engine_->written_for_kill.fetch_add(p->length) + p->length >= f->kill_after_write_bytes) {
        ::raise(SIGKILL);  // a simulated crash in the middle of a write
      }
    } else {
      engine_->errors.fetch_add(1, std::memory_order_relaxed);
    }
    engine_->pieces.fetch_add(1, std::memory_order_relaxed);
    engine_->complete_piece(p, error);  // may free p
  }

  IoEngine::Impl* engine_;
  std::uint32_t id_;
  std::unique_ptr<Queue> queue_;
  QueueParams params_;
  std::thread thread_;

  // Shared with submitters, under mu_.
  std::mutex mu_;
  std::vector<Piece*> incoming_;
  std::vector<std::function<void()>> controls_;
  bool stop_ = false;
  std::atomic<bool> waiting_{false};

  // Owned by the I/O thread.
  std::deque<Piece*> pending_;
  std::uint32_t inflight_ = 0;
  std::vector<Bounce> bounces_;
  std::vector<int> free_bounces_;
  std::vector<Registered> registered_;  // sorted by base
  std::vector<std::pair<Piece*, Status>> finished_;
};

namespace {

// Calls emit(member, member_offset, request_delta, length) for each segment of [off, off+len).
template <typename F>
void for_each_segment(const FileEntry& e, std::uint64_t off, std::uint64_t len, F&& emit) {
  std::size_t n = e.members.size();
  if (n == 1) {
    emit(std::size_t{0}, off, std::uint64_t{0}, len);
    return;
  }
  std::uint64_t su = e.stripe_unit;
  for (std::uint64_t pos = 0; pos < len;) {
    std::uint64_t logical = off + pos;
    std::uint64_t stripe = logical / su;
    std::uint64_t within = logical % su;
    std::uint64_t take = std::min(su - within, len - pos);
    emit(static_cast<std::size_t>(stripe % n), (stripe / n) * su + within, pos, take);
    pos += take;
  }
}

// Calls emit(member_offset, segment_delta, length, direct) for each piece of a segment.
template <typename F>
void for_each_piece(bool direct, std::uint64_t moff, std::uint64_t len, std::uint64_t block, F&& emit) {
  auto cut = [&](std::uint64_t start, std::uint64_t delta, std::uint64_t n, bool d) {
    for (std::uint64_t x = 0; x < n; x += block) emit(start + x, delta + x, std::min(block, n - x), d);
  };
  std::uint64_t a = align_up(moff, kDirectAlign);
  std::uint64_t b = (moff + len) & ~(kDirectAlign - 1);
  if (!direct || a >= b) {
    cut(moff, 0, len, false);
    return;
  }
  if (a > moff) emit(moff, std::uint64_t{0}, a - moff, false);
  cut(a, a - moff, b - a, true);
  if (b < moff + len) emit(b, b - moff, moff + len - b, false);
}

}  // namespace
}  // namespace nvme_detail

using nvme_detail::FileEntry;
using nvme_detail::IoState;
using nvme_detail::IoThread;
using nvme_detail::Member;
using nvme_detail::Piece;
using nvme_detail::RequestState;

// ---- IoHandle ----------------------------------------------------------------------------------

IoHandle IoHandle::completed(Status status) {
  auto s = std::make_shared<IoState>();
  s->final_status = std::move(status);
  s->done.store(1, std::memory_order_release);
  return IoHandle(std::move(s));
}

bool IoHandle::poll() const { return state_ == nullptr || state_->done.load(std::memory_order_acquire) != 0; }

Status IoHandle::wait() const {
  if (state_ == nullptr) return failed_precondition("wait() on an empty IoHandle");
  while (state_->done.load(std::memory_order_acquire) == 0) state_->done.wait(0, std::memory_order_acquire);
  return state_->final_status;
}

void IoHandle::then(std::function<void(const Status&)> fn) const {
  if (state_ == nullptr) {
    fn(failed_precondition("then() on an empty IoHandle"));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->done.load(std::memory_order_acquire) == 0) {
      state_->callbacks.push_back(std::move(fn));
      return;
    }
  }
  fn(state_->final_status);
}

std::uint64_t IoHandle::bytes_transferred() const {
  return state_ ? state_->bytes.load(std::memory_order_relaxed) : 0;
}

// ---- Completion accounting -------------------------------------------------------------------

void IoEngine::Impl::complete_piece(Piece* p, const Status& error) {
  RequestState* r = p->request;
  if (!error.ok()) {
    r->failed.store(true, std::memory_order_relaxed);
    r->owner->record_error(error);
  } else {
    r->owner->bytes.fetch_add(p->length, std::memory_order_relaxed);
  }
  if (r->pieces_left.fetch_sub(1, std::memory_order_acq_rel) == 1) complete_request(r);
}

void IoEngine::Impl::complete_request(RequestState* r) {
  if (!r->failed.load(std::memory_order_relaxed) && r->req.on_done) {
    Status s = r->req.on_done(r->req);
    if (!s.ok()) r->owner->record_error(std::move(s));
  }
  r->file->inflight.fetch_sub(1, std::memory_order_acq_rel);
  IoState* owner = r->owner;
  if (owner->requests_left.fetch_sub(1, std::memory_order_acq_rel) == 1) complete_handle(owner);
}

void IoEngine::Impl::complete_handle(IoState* s) {
  Status st;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    st = s->first_error;
  }
  if (s->finalize) st = s->finalize(std::move(st));
  std::vector<std::function<void(const Status&)>> callbacks;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->final_status = st;
    callbacks.swap(s->callbacks);
    s->done.store(1, std::memory_order_release);
  }
  s->done.notify_all();
  for (auto& cb : callbacks) cb(st);
  std::shared_ptr<IoState> keep = std::move(s->keep_alive);
  keep.reset();  // s may be gone now
  if (inflight_handles.fetch_sub(1, std::memory_order_acq_rel) == 1) inflight_handles.notify_all();
  // Nothing of the engine is touched past this point: its destructor may be running.
}

// ---- Submission ------------------------------------------------------------------------------

FileEntry* IoEngine::Impl::entry(FileId file) const {
  if (!file.valid() || file.index >= files.size()) return nullptr;
  FileEntry* e = files[file.index].get();
  return e != nullptr && e->open ? e : nullptr;
}

IoHandle IoEngine::Impl::submit(std::vector<IoRequest> requests, std::function<Status(Status)> finalize) {
  auto state = std::make_shared<IoState>();
  state->engine = this;
  state->finalize = std::move(finalize);
  const std::size_t n = requests.size();
  state->requests = std::make_unique<RequestState[]>(n);
  state->request_count = n;
  const std::uint64_t block = config.block_size;
  const std::size_t nthreads = threads.size();

  std::vector<std::vector<Piece*>> per_thread(nthreads);
  std::vector<RequestState*> empty;  // zero-length requests: no piece will complete them
  {
    std::shared_lock<std::shared_mutex> lock(files_mu);
    std::size_t total = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const IoRequest& r = requests[i];
      FileEntry* e = entry(r.file);
      std::string which = n > 1 ? "request " + std::to_string(i) + ": " : "";
      if (e == nullptr) {
        return IoHandle::completed(invalid_argument(which + "file id " + std::to_string(r.file.index) +
                                                    " is not open in this I/O engine"));
      }
      if (r.length > 0 && r.buffer == nullptr) {
        return IoHandle::completed(invalid_argument(which + "null buffer for " + std::to_string(r.length) +
                                                    " bytes at offset " + std::to_string(r.offset) + " of " +
                                                    e->members[0]->path));
      }
      if (r.offset + r.length < r.offset) {
        return IoHandle::completed(invalid_argument(which + "offset " + std::to_string(r.offset) +
                                                    " + length " + std::to_string(r.length) + " overflows"));
      }
      nvme_detail::for_each_segment(
          *e, r.offset, r.length, [&](std::size_t m, std::uint64_t moff, std::uint64_t, std::uint64_t len) {
            bool direct = e->members[m]->direct.load(std::memory_order_relaxed);
            nvme_detail::for_each_piece(direct, moff, len, block, [&](auto, auto, auto, bool) { ++total; });
          });
    }
    state->pieces = std::make_unique<Piece[]>(total);
    state->piece_count = total;
    std::size_t k = 0;
    std::uint64_t rr = next_thread.fetch_add(1, std::memory_order_relaxed);
    for (std::size_t i = 0; i < n; ++i) {
      RequestState& rs = state->requests[i];
      rs.req = std::move(requests[i]);
      rs.owner = state.get();
      rs.file = entry(rs.req.file);
      std::uint32_t count = 0;
      auto* base = static_cast<unsigned char*>(rs.req.buffer);
      nvme_detail::for_each_segment(
          *rs.file, rs.req.offset, rs.req.length,
          [&](std::size_t m, std::uint64_t moff, std::uint64_t seg_delta, std::uint64_t len) {
            Member* member = rs.file->members[m].get();
            bool direct = member->direct.load(std::memory_order_relaxed);
            nvme_detail::for_each_piece(
                direct, moff, len, block,
                [&](std::uint64_t off, std::uint64_t delta, std::uint64_t plen, bool d) {
                  Piece& p = state->pieces[k++];
                  p.request = &rs;
                  p.member = member;
                  p.offset = off;
                  p.length = plen;
                  p.user = base + seg_delta + delta;
                  p.op = rs.req.op;
                  p.direct = d;
                  p.needs_bounce =
                      d && reinterpret_cast<std::uintptr_t>(p.user) % nvme_detail::kDirectAlign != 0;
                  p.thread = static_cast<std::uint32_t>(rr++ % nthreads);
                  per_thread[p.thread].push_back(&p);
                  ++count;
                });
          });
      rs.pieces_left.store(count, std::memory_order_relaxed);
      rs.file->inflight.fetch_add(1, std::memory_order_relaxed);
      if (count == 0) empty.push_back(&rs);
    }
  }
  state->requests_left.store(n, std::memory_order_relaxed);
  state->keep_alive = state;
  inflight_handles.fetch_add(1, std::memory_order_acq_rel);
  IoHandle handle(state);
  // Requests without pieces (zero length) complete here; hold one extra count so the handle
  // cannot complete (and run callbacks) before every request is accounted for.
  state->requests_left.fetch_add(1, std::memory_order_relaxed);
  for (std::size_t t = 0; t < nthreads; ++t) {
    if (!per_thread[t].empty()) threads[t]->push(per_thread[t]);
  }
  for (RequestState* r : empty) complete_request(r);
  if (state->requests_left.fetch_sub(1, std::memory_order_acq_rel) == 1) complete_handle(state.get());
  return handle;
}

Status IoEngine::Impl::on_every_thread(const std::function<Status(IoThread&)>& fn) {
  Status first;
  for (auto& t : threads) {
    Status s = t->control(fn);
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

// ---- Backends and fallback -------------------------------------------------------------------

namespace {

std::unique_ptr<nvme_detail::Queue> make_queue(IoBackendKind kind) {
  switch (kind) {
    case IoBackendKind::kIoUring:
      return nvme_detail::make_uring_queue();
    case IoBackendKind::kLibaio:
      return nvme_detail::make_aio_queue();
    default:
      return nvme_detail::make_psync_queue();
  }
}

// Whether O_DIRECT works in `dir`: an empty Status if it does, else why not.
Status probe_direct(const std::string& dir, const nvme_detail::IoFaults* faults) {
  if (faults != nullptr && faults->refuse_direct)
    return invalid_argument("O_DIRECT refused on " + dir + " (EINVAL)");
  std::string templ = dir + "/.strata-direct-probe-XXXXXX";
  std::vector<char> name(templ.begin(), templ.end());
  name.push_back('\0');
  int fd = ::mkstemp(name.data());
  if (fd < 0) return ok_status();  // cannot tell (missing directory): the store reports that
  ::close(fd);
  int dfd = ::open(name.data(), O_RDWR | O_DIRECT | O_CLOEXEC);
  int err = errno;
  ::unlink(name.data());
  if (dfd < 0) return invalid_argument("O_DIRECT refused on " + dir + ": " + nvme_detail::errno_text(err));
  ::close(dfd);
  return ok_status();
}

}  // namespace

Status IoEngine::Impl::start_threads(IoBackendKind kind) {
  nvme_detail::QueueParams params;
  params.queue_depth = config.queue_depth;
  params.sq_poll = config.sq_poll;
  params.sq_poll_idle_ms = config.sq_poll_idle_ms;
  params.faults = faults;
  for (std::uint32_t i = 0; i < config.intra_op_parallelism; ++i) {
    auto t = std::make_unique<IoThread>(this, i, make_queue(kind));
    Status s = t->start(params);
    if (!s.ok()) {
      stop_threads();
      return s;
    }
    threads.push_back(std::move(t));
  }
  return ok_status();
}

void IoEngine::Impl::stop_threads() {
  for (auto& t : threads) t->stop();
  threads.clear();
}

IoEngine::IoEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<IoEngine>> IoEngine::create(const IoEngineConfig& config, PinnedPool* pool) {
  return create_with_faults(config, pool, nullptr);
}

Result<std::unique_ptr<IoEngine>> IoEngine::create_with_faults(const IoEngineConfig& config, PinnedPool* pool,
                                                               const nvme_detail::IoFaults* faults) {
  STRATA_RETURN_IF_ERROR(config.validate());
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->pool = pool;
  impl->faults = faults;
  for (int s = nvme_detail::kFixedFileSlots - 1; s >= 0; --s) impl->free_slots.push_back(s);

  std::vector<IoBackendKind> order;
  switch (config.backend) {
    case IoBackendKind::kAuto:
    case IoBackendKind::kIoUring:
      order = {IoBackendKind::kIoUring, IoBackendKind::kLibaio, IoBackendKind::kPsync};
      break;
    case IoBackendKind::kLibaio:
      order = {IoBackendKind::kLibaio, IoBackendKind::kPsync};
      break;
    case IoBackendKind::kPsync:
      order = {IoBackendKind::kPsync};
      break;
  }
  // Where O_DIRECT is refused, files fall back to buffered I/O (io_uring and psync handle that
  // fine); libaio would then block in io_submit, so it is skipped.
  Status direct = ok_status();
  if (!config.direct_io) {
    direct = invalid_argument("aio.direct_io is off");
  } else {
    for (const auto& dir : config.nvme_path) {
      direct = probe_direct(dir, faults);
      if (!direct.ok()) break;
    }
  }
  if (!direct.ok()) nvme_detail::log_once(LogLevel::kWarn, direct.message() + ": using buffered I/O there");
  Status last;
  for (std::size_t i = 0; i < order.size(); ++i) {
    IoBackendKind kind = order[i];
    Status s = ok_status();
    if (kind == IoBackendKind::kLibaio && !direct.ok()) {
      s = unavailable("libaio needs O_DIRECT to be asynchronous (" + direct.message() + ")");
    } else {
      s = impl->start_threads(kind);
    }
    if (s.ok()) {
      impl->backend = kind;
      if (i > 0) {
        nvme_detail::log_once(LogLevel::kInfo, "I/O backend: " + std::string(to_string(kind)) +
                                                   " (asked for " + std::string(to_string(config.backend)) +
                                                   ")");
      }
      return std::unique_ptr<IoEngine>(new IoEngine(std::move(impl)));
    }
    last = s;
    if (i + 1 < order.size()) {
      nvme_detail::log_once(LogLevel::kWarn, std::string(to_string(kind)) +
                                                 " cannot be used: " + s.message() + "; falling back to " +
                                                 std::string(to_string(order[i + 1])));
    }
  }
  return last;
}

IoEngine::~IoEngine() {
  for (std::int64_t n; (n = impl_->inflight_handles.load(std::memory_order_acquire)) != 0;) {
    impl_->inflight_handles.wait(n, std::memory_order_acquire);
  }
  impl_->stop_threads();
  for (auto& e : impl_->files) {
    if (e == nullptr) continue;
    for (auto& m : e->members) {
      if (m->direct_fd >= 0) ::close(m->direct_fd);
      if (m->buffered_fd >= 0) ::close(m->buffered_fd);
    }
  }
}

IoBackendKind IoEngine::backend() const { return impl_->backend; }
const IoEngineConfig& IoEngine::config() const { return impl_->config; }

IoEngineStats IoEngine::stats() const {
  IoEngineStats s;
  s.bytes_read = impl_->bytes_read.load();
  s.bytes_written = impl_->bytes_written.load();
  s.pieces = impl_->pieces.load();
  s.fixed_buffer_pieces = impl_->fixed_pieces.load();
  s.bounced_pieces = impl_->bounced_pieces.load();
  s.buffered_pieces = impl_->buffered_pieces.load();
  s.short_transfers = impl_->short_transfers.load();
  s.errors = impl_->errors.load();
  s.syncs = impl_->syncs.load();
  s.cpu_seconds = impl_->cpu.seconds();
  return s;
}

// ---- Files -----------------------------------------------------------------------------------

Result<FileId> IoEngine::open(const std::string& path, OpenMode mode) {
  return open_striped(std::span<const std::string>(&path, 1), 0, mode);
}

Result<FileId> IoEngine::open_striped(std::span<const std::string> paths, std::uint64_t stripe_unit,
                                      OpenMode mode) {
  if (paths.empty()) return invalid_argument("open: no path given");
  if (paths.size() > 1 && (stripe_unit == 0 || stripe_unit % nvme_detail::kDirectAlign != 0)) {
    return invalid_argument("open: stripe unit " + std::to_string(stripe_unit) +
                            " must be a positive multiple of 4096 to stripe over " +
                            std::to_string(paths.size()) + " files");
  }
  int flags = O_CLOEXEC;
  switch (mode) {
    case OpenMode::kRead:
      flags |= O_RDONLY;
      break;
    case OpenMode::kReadWrite:
      flags |= O_RDWR;
      break;
    case OpenMode::kCreate:
      flags |= O_RDWR | O_CREAT;
      break;
  }
  auto entry = std::make_unique<FileEntry>();
  entry->mode = mode;
  entry->stripe_unit = paths.size() > 1 ? stripe_unit : 0;
  auto close_all = [&] {
    for (auto& m : entry->members) {
      if (m->direct_fd >= 0) ::close(m->direct_fd);
      if (m->buffered_fd >= 0) ::close(m->buffered_fd);
    }
  };
  for (const auto& path : paths) {
    auto m = std::make_unique<Member>();
    m->path = path;
    m->buffered_fd = ::open(path.c_str(), flags, 0644);
    if (m->buffered_fd < 0) {
      int err = errno;
      close_all();
      std::string msg = "cannot open " + path + ": " + nvme_detail::errno_text(err);
      return err == ENOENT ? not_found(msg) : io_error(msg);
    }
    if (impl_->config.direct_io) {
      if (impl_->faults != nullptr && impl_->faults->refuse_direct) {
        errno = EINVAL;
      } else {
        m->direct_fd = ::open(path.c_str(), (flags & ~O_CREAT) | O_DIRECT);
      }
      if (m->direct_fd < 0) {
        int err = errno;
        if (err != EINVAL) {
          ::close(m->buffered_fd);
          close_all();
          return io_error("cannot open " + path + " with O_DIRECT: " + nvme_detail::errno_text(err));
        }
        nvme_detail::log_once(LogLevel::kWarn,
                              "O_DIRECT refused on " + path +
                                  " (EINVAL: the file system does not support it); using buffered I/O");
      }
    }
    m->direct.store(m->direct_fd >= 0);
    entry->members.push_back(std::move(m));
  }

  // Registered-file slots: two per member (buffered, direct), the same in every ring.
  bool fixed = !impl_->threads.empty() && impl_->threads[0]->queue().fixed_files();
  std::vector<int> slots;
  if (fixed) {
    std::unique_lock<std::shared_mutex> lock(impl_->files_mu);
    if (impl_->free_slots.size() >= 2 * entry->members.size()) {
      for (std::size_t i = 0; i < 2 * entry->members.size(); ++i) {
        slots.push_back(impl_->free_slots.back());
        impl_->free_slots.pop_back();
      }
    }
  }
  std::vector<int> unused;
  if (!slots.empty()) {
    for (std::size_t i = 0; i < entry->members.size(); ++i) {
      Member& m = *entry->members[i];
      m.slot_buffered = slots[2 * i];
      if (m.direct_fd >= 0) {
        m.slot_direct = slots[2 * i + 1];
      } else {
        unused.push_back(slots[2 * i + 1]);
      }
    }
    FileEntry* e = entry.get();
    Status s = impl_->on_every_thread([e](IoThread& t) {
      for (auto& m : e->members) {
        STRATA_RETURN_IF_ERROR(t.queue().set_file_slot(m->slot_buffered, m->buffered_fd));
        if (m->slot_direct >= 0)
          STRATA_RETURN_IF_ERROR(t.queue().set_file_slot(m->slot_direct, m->direct_fd));
      }
      return ok_status();
    });
    if (!s.ok()) {
      STRATA_LOG_ONCE(kInfo, kNvme) << "registered files unavailable (" << s.message() << ")";
      (void)impl_->on_every_thread([e](IoThread& t) {
        for (auto& m : e->members) {
          (void)t.queue().set_file_slot(m->slot_buffered, -1);
          if (m->slot_direct >= 0) (void)t.queue().set_file_slot(m->slot_direct, -1);
        }
        return ok_status();
      });
      unused = slots;
      for (auto& m : entry->members) m->slot_buffered = m->slot_direct = -1;
    }
  }
  std::unique_lock<std::shared_mutex> lock(impl_->files_mu);
  for (int u : unused) impl_->free_slots.push_back(u);
  entry->open = true;
  std::uint32_t index;
  if (!impl_->free_files.empty()) {
    index = impl_->free_files.back();
    impl_->free_files.pop_back();
    impl_->files[index] = std::move(entry);
  } else {
    index = static_cast<std::uint32_t>(impl_->files.size());
    impl_->files.push_back(std::move(entry));
  }
  return FileId{index};
}

Status IoEngine::close(FileId file) {
  std::unique_ptr<FileEntry> e;
  {
    std::unique_lock<std::shared_mutex> lock(impl_->files_mu);
    FileEntry* entry = impl_->entry(file);
    if (entry == nullptr)
      return invalid_argument("close: file id " + std::to_string(file.index) + " is not open");
    std::int64_t n = entry->inflight.load();
    if (n != 0) {
      return failed_precondition("close of " + entry->members[0]->path + " while " + std::to_string(n) +
                                 " requests on it are in flight");
    }
    e = std::move(impl_->files[file.index]);
    impl_->free_files.push_back(file.index);
  }
  bool registered = e->members[0]->slot_buffered >= 0;
  if (registered) {
    FileEntry* raw = e.get();
    Status s = impl_->on_every_thread([raw](IoThread& t) {
      for (auto& m : raw->members) {
        (void)t.queue().set_file_slot(m->slot_buffered, -1);
        if (m->slot_direct >= 0) (void)t.queue().set_file_slot(m->slot_direct, -1);
      }
      return ok_status();
    });
    (void)s;
  }
  std::unique_lock<std::shared_mutex> lock(impl_->files_mu);
  for (auto& m : e->members) {
    if (m->slot_buffered >= 0) impl_->free_slots.push_back(m->slot_buffered);
    if (m->slot_direct >= 0) impl_->free_slots.push_back(m->slot_direct);
    if (m->direct_fd >= 0) ::close(m->direct_fd);
    if (m->buffered_fd >= 0) ::close(m->buffered_fd);
    m->direct_fd = m->buffered_fd = -1;
  }
  return ok_status();
}

namespace {

// Bytes member `m` of `n` must hold for the logical file to hold `bytes`.
std::uint64_t member_share(std::uint64_t bytes, std::uint64_t su, std::size_t n, std::size_t m) {
  if (n == 1) return bytes;
  std::uint64_t stripes = (bytes + su - 1) / su;
  std::uint64_t mine = stripes / n + (m < stripes % n ? 1 : 0);
  return mine * su;
}

}  // namespace

Status IoEngine::preallocate(FileId file, std::uint64_t bytes) {
  std::shared_lock<std::shared_mutex> lock(impl_->files_mu);
  FileEntry* e = impl_->entry(file);
  if (e == nullptr)
    return invalid_argument("preallocate: file id " + std::to_string(file.index) + " is not open");
  for (std::size_t m = 0; m < e->members.size(); ++m) {
    const Member& mem = *e->members[m];
    std::uint64_t share = member_share(bytes, e->stripe_unit, e->members.size(), m);
    if (share == 0) continue;
    int r;
    do {
      r = ::fallocate(mem.buffered_fd, 0, 0, static_cast<off_t>(share));
    } while (r != 0 && errno == EINTR);
    if (r != 0 && errno == EOPNOTSUPP) {
      STRATA_LOG_ONCE(kWarn, kNvme) << "fallocate is not supported on " << mem.path
                                    << "; the swap file stays sparse and may hit ENOSPC later";
      struct stat st;
      r = ::fstat(mem.buffered_fd, &st);
      if (r == 0 && static_cast<std::uint64_t>(st.st_size) < share)
        r = ::ftruncate(mem.buffered_fd, static_cast<off_t>(share));
    }
    if (r != 0) {
      int err = errno;
      return io_error("cannot preallocate " + format_bytes(share) + " for " + mem.path + ": " +
                      nvme_detail::errno_text(err));
    }
  }
  return ok_status();
}

Status IoEngine::sync(FileId file) {
  std::shared_lock<std::shared_mutex> lock(impl_->files_mu);
  FileEntry* e = impl_->entry(file);
  if (e == nullptr) return invalid_argument("sync: file id " + std::to_string(file.index) + " is not open");
  for (const auto& m : e->members) {
    if (::fdatasync(m->buffered_fd) != 0) {
      int err = errno;
      return io_error("fdatasync of " + m->path + " failed: " + nvme_detail::errno_text(err));
    }
    impl_->syncs.fetch_add(1, std::memory_order_relaxed);
  }
  return ok_status();
}

Result<std::uint64_t> IoEngine::size(FileId file) const {
  std::shared_lock<std::shared_mutex> lock(impl_->files_mu);
  FileEntry* e = impl_->entry(file);
  if (e == nullptr) return invalid_argument("size: file id " + std::to_string(file.index) + " is not open");
  std::uint64_t total = 0;
  for (const auto& m : e->members) {
    struct stat st;
    if (::fstat(m->buffered_fd, &st) != 0) {
      int err = errno;
      return io_error("fstat of " + m->path + " failed: " + nvme_detail::errno_text(err));
    }
    total += static_cast<std::uint64_t>(st.st_size);
  }
  return total;
}

bool IoEngine::is_direct(FileId file) const {
  std::shared_lock<std::shared_mutex> lock(impl_->files_mu);
  FileEntry* e = impl_->entry(file);
  if (e == nullptr) return false;
  for (const auto& m : e->members) {
    if (!m->direct.load()) return false;
  }
  return true;
}

std::string IoEngine::locate(FileId file, std::uint64_t offset) const {
  std::shared_lock<std::shared_mutex> lock(impl_->files_mu);
  FileEntry* e = impl_->entry(file);
  if (e == nullptr) return "<file id " + std::to_string(file.index) + " not open>";
  std::string out;
  nvme_detail::for_each_segment(*e, offset, 1,
                                [&](std::size_t m, std::uint64_t moff, std::uint64_t, std::uint64_t) {
                                  out = e->members[m]->path + " offset " + std::to_string(moff);
                                });
  return out;
}

// ---- Memory ----------------------------------------------------------------------------------

Status IoEngine::register_memory(void* base, std::uint64_t bytes) {
  if (base == nullptr || bytes == 0) return invalid_argument("register_memory: empty region");
  {
    std::lock_guard<std::mutex> lock(impl_->regions_mu);
    for (const auto& r : impl_->regions) {
      if (r.base == base) return invalid_argument("register_memory: region already registered");
    }
    impl_->regions.push_back({base, bytes});
  }
  return impl_->on_every_thread([base, bytes](IoThread& t) { return t.register_region(base, bytes, base); });
}

Status IoEngine::unregister_memory(void* base) {
  {
    std::lock_guard<std::mutex> lock(impl_->regions_mu);
    auto it = std::find_if(impl_->regions.begin(), impl_->regions.end(),
                           [base](const Impl::Region& r) { return r.base == base; });
    if (it == impl_->regions.end()) return invalid_argument("unregister_memory: region was not registered");
    impl_->regions.erase(it);
  }
  return impl_->on_every_thread([base](IoThread& t) {
    t.unregister_region(base);
    return ok_status();
  });
}

// ---- Requests --------------------------------------------------------------------------------

IoHandle IoEngine::submit(std::vector<IoRequest> requests) {
  return impl_->submit(std::move(requests), nullptr);
}

IoHandle IoEngine::submit(IoRequest request) {
  std::vector<IoRequest> v;
  v.push_back(std::move(request));
  return impl_->submit(std::move(v), nullptr);
}

IoHandle IoEngine::read(FileId file, std::uint64_t offset, void* buffer, std::uint64_t length) {
  IoRequest r;
  r.op = IoOp::kRead;
  r.file = file;
  r.offset = offset;
  r.length = length;
  r.buffer = buffer;
  return submit(std::move(r));
}

IoHandle IoEngine::write(FileId file, std::uint64_t offset, const void* buffer, std::uint64_t length) {
  IoRequest r;
  r.op = IoOp::kWrite;
  r.file = file;
  r.offset = offset;
  r.length = length;
  r.buffer = const_cast<void*>(buffer);  // only read from for a write
  return submit(std::move(r));
}

}  // namespace strata
