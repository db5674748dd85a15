// CommWork handles and the in-order queue of a Comm (see internal.hpp for the life of an
// operation).
#include <algorithm>
#include <climits>

#include "parallel/internal.hpp"

namespace strata {
namespace detail {

void WorkState::complete(Status s) {
  {
    std::lock_guard lock(mu);
    status = std::move(s);
    done = true;
  }
  cv.notify_all();
}

CommWork finished_work(Status status) {
  auto state = std::make_shared<WorkState>();
  state->complete(std::move(status));
  return CommWork(std::move(state));
}

CommQueue::CommQueue(std::string label, FailureSink on_failure)
    : label_(std::move(label)), on_failure_(std::move(on_failure)), thread_([this] { run(); }) {}

CommQueue::~CommQueue() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

CommWork CommQueue::submit(Op op) {
  auto state = std::make_shared<WorkState>();
  state->queue = this;
  {
    std::lock_guard lock(mu_);
    pending_.push_back(Entry{state, std::move(op), nullptr});
  }
  cv_.notify_all();
  return CommWork(std::move(state));
}

CommWork CommQueue::submit_async(Start start) {
  auto state = std::make_shared<WorkState>();
  state->queue = this;
  {
    std::lock_guard lock(mu_);
    pending_.push_back(Entry{state, nullptr, std::move(start)});
  }
  cv_.notify_all();
  return CommWork(std::move(state));
}

Status CommQueue::drain() {
  // An empty blocking operation behind everything queued: when it has run, so has the rest.
  Status s = submit([] { return ok_status(); }).wait();
  return s.code() == StatusCode::kCancelled ? s : ok_status();
}

bool CommQueue::broken() const {
  std::lock_guard lock(mu_);
  return !failure_.ok();
}

Status CommQueue::earlier_failure() const {
  std::lock_guard lock(mu_);
  return failure_;
}

// A caller's mistake (kInvalidArgument: a recv of the wrong count) leaves the library and the
// peers in a known state; anything else (a timeout, an MPI error) may not.
bool CommQueue::breaks_comm(const Status& s) { return !s.ok() && s.code() != StatusCode::kInvalidArgument; }

void CommQueue::fail(const Status& s) {
  {
    std::lock_guard lock(mu_);
    if (!failure_.ok()) return;
    failure_ = s;
  }
  if (on_failure_) on_failure_(s);
}

std::chrono::nanoseconds PollPacer::next_at(std::chrono::steady_clock::time_point now) {
  if (!waiting_) {
    waiting_ = true;
    since_ = now;
    return std::chrono::nanoseconds(0);
  }
  const auto waited = now - since_;
  if (waited < kSpin) return std::chrono::nanoseconds(0);
  return std::min<std::chrono::nanoseconds>(waited / 8, kMaxSleep);
}

void PollPacer::pause() {
  const auto now = std::chrono::steady_clock::now();
  const std::chrono::nanoseconds d = next_at(now);
  if (hot_at(now)) return;
  if (d.count() == 0) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(d);
  }
}

bool CommQueue::poll_in_flight(bool until_empty) {
  bool progressed = false;
  while (!in_flight_.empty()) {
    for (std::size_t i = 0; i < in_flight_.size();) {
      Result<bool> done = in_flight_[i].poll();
      if (done.ok() && !*done) {
        ++i;
        continue;
      }
      Status s = done.status();
      if (breaks_comm(s)) fail(s);
      in_flight_[i].state->complete(std::move(s));
      in_flight_.erase(in_flight_.begin() + static_cast<std::ptrdiff_t>(i));
      progressed = true;
      pacer_.reset();
    }
    if (!until_empty) return progressed;
    if (!in_flight_.empty()) pacer_.pause();
  }
  return progressed;
}

void CommQueue::execute(Entry& e) {
  if (Status earlier = earlier_failure(); !earlier.ok()) {
    e.state->complete(
        cancelled("not run: an earlier operation on " + label_ + " failed: " + earlier.to_string()));
    return;
  }
  Status s = e.op();
  if (breaks_comm(s)) fail(s);
  e.state->complete(std::move(s));
}

bool CommQueue::run_inline(const WorkState* state) {
  Entry e;
  {
    std::lock_guard lock(mu_);
    if (worker_active_ || inline_active_ || pending_.empty() || pending_.front().state.get() != state ||
        !pending_.front().op) {
      return false;
    }
    e = std::move(pending_.front());
    pending_.pop_front();
    inline_active_ = true;
  }
  execute(e);
  {
    std::lock_guard lock(mu_);
    inline_active_ = false;
  }
  cv_.notify_all();
  return true;
}

void CommQueue::run() {
  for (;;) {
    Entry e;
    {
      std::unique_lock lock(mu_);
      if (in_flight_.empty()) {
        worker_active_ = false;
        cv_.wait(lock, [&] { return (stopping_ || !pending_.empty()) && !inline_active_; });
        worker_active_ = true;
      }
      if (pending_.empty()) {
        if (in_flight_.empty()) return;  // stopping, and everything queued has completed
        lock.unlock();
        poll_in_flight(false);
        if (in_flight_.empty()) continue;
        // Paced like any poll, but a newly submitted operation ends the sleep at once: it may be
        // the send a peer is waiting for.
        const auto now = std::chrono::steady_clock::now();
        const std::chrono::nanoseconds d = pacer_.next_at(now);
        if (pacer_.hot_at(now)) continue;
        if (d.count() == 0) {
          std::this_thread::yield();
        } else {
          lock.lock();
          cv_.wait_for(lock, d, [&] { return stopping_ || !pending_.empty(); });
        }
        continue;
      }
      e = std::move(pending_.front());
      pending_.pop_front();
      pacer_.reset();  // new work: poll eagerly again
    }
    if (e.op) {
      poll_in_flight(true);  // a blocking operation starts after everything before it
      execute(e);
      continue;
    }
    if (Status earlier = earlier_failure(); !earlier.ok()) {
      e.state->complete(
          cancelled("not run: an earlier operation on " + label_ + " failed: " + earlier.to_string()));
      continue;
    }
    Result<Poll> poll = e.start();
    if (!poll.ok()) {
      if (breaks_comm(poll.status())) fail(poll.status());
      e.state->complete(poll.status());
      continue;
    }
    in_flight_.push_back(InFlight{std::move(e.state), std::move(*poll)});
  }
}

std::string describe_group(const std::string& name, const std::vector<int>& world_ranks) {
  std::string out = "group '" + name + "' (world ranks ";
  for (std::size_t i = 0; i < world_ranks.size(); ++i) {
    if (i > 0) out += ",";
    if (i == 8 && world_ranks.size() > 9) {
      out += "... " + std::to_string(world_ranks.size()) + " in all";
      break;
    }
    out += std::to_string(world_ranks[i]);
  }
  return out + ")";
}

std::string describe_count(std::size_t count, DType dtype) {
  return std::to_string(count) + " x " + std::string(to_string(dtype));
}

Status check_count(std::size_t count, DType dtype, const char* what) {
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return invalid_argument(std::string(what) + ": dtype " + std::string(to_string(dtype)) +
                            " is not supported (expected f32 or bf16)");
  }
  if (count > static_cast<std::size_t>(INT_MAX)) {
    return invalid_argument(std::string(what) + ": count " + std::to_string(count) +
                            " exceeds the per-call limit of " + std::to_string(INT_MAX) +
                            " elements (split the buffer)");
  }
  return ok_status();
}

}  // namespace detail

Status CommWork::wait() const {
  if (!state_) return ok_status();
  {
    std::lock_guard lock(state_->mu);
    if (state_->done) return state_->status;
  }
  if (state_->queue != nullptr) state_->queue->run_inline(state_.get());
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
  return state_->status;
}

bool CommWork::test() const {
  if (!state_) return true;
  std::lock_guard lock(state_->mu);
  return state_->done;
}

}  // namespace strata
