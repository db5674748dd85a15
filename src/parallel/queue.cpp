// CommWork handles and the in-order queue of a Comm (see internal.hpp for the life of an
// operation).
#include <sys/prctl.h>

#include <algorithm>
#include <climits>

#include "parallel/internal.hpp"

namespace strata {
namespace detail {

void WorkState::complete(Status s) {
  status = std::move(s);
  done.store(true, std::memory_order_seq_cst);
  if (sleepers.load(std::memory_order_seq_cst) == 0) return;
  { std::lock_guard lock(mu); }  // a sleeper between its check of done and cv's wait holds mu
  cv.notify_all();
}

void WorkState::sleep_until_done() {
  sleepers.fetch_add(1, std::memory_order_seq_cst);
  {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return done.load(std::memory_order_seq_cst); });
  }
  sleepers.fetch_sub(1, std::memory_order_relaxed);
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

CommWork CommQueue::submit(Op op) { return enqueue(Entry{nullptr, std::move(op), nullptr, {}}); }

CommWork CommQueue::submit_async(Start start) { return enqueue(Entry{nullptr, nullptr, std::move(start), {}}); }

CommWork CommQueue::enqueue(Entry e) {
  auto state = std::make_shared<WorkState>();
  state->queue = this;
  e.state = state;
  bool wake = false;
  // A direct post that did not start: its error, or its cancellation after an earlier failure.
  Status refused;
  bool start_failed = false;
  {
    std::lock_guard lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    submits_.fetch_add(1, std::memory_order_relaxed);
    doze_until_ = now + kDozeSpan;
    if (e.start && !worker_active_ && !inline_active_ && pending_.empty() && !stopping_) {
      // Posted at once by the submitter: nothing is queued and nobody runs the queue, so every
      // earlier operation has started (an earlier blocking one has completed) and this is where
      // the queue would start it; the peer can match it while this caller goes on. Under mu_,
      // so no later operation starts first. Nobody polls it until its submitter waits
      // (run_inline takes it) or the queue thread does, tick_ later (run()).
      if (!failure_.ok()) {
        refused = cancelled_by(failure_);
      } else if (Result<Poll> poll = e.start(); !poll.ok()) {
        refused = poll.status();
        start_failed = true;
      } else {
        if (in_flight_.empty()) unclaimed_since_ = now;
        in_flight_.push_back(InFlight{state, std::move(*poll)});
        // A thread asleep until woken would never poll it: wake it (the first submit after a
        // quiet spell, as below). A dozing one looks within its tick.
        wake = !dozing_;
      }
    } else {
      e.submitted = now;
      pending_.push_back(std::move(e));
      // No wake-up while a caller runs the queue (run_inline): the thread may not take anything
      // then, and that caller wakes it when it is done if anything is pending. None while the
      // thread dozes either: it looks within kDoze, by which time the caller has usually run the
      // operation itself (the common "submit, then wait"). A wake-up is a scheduler round trip
      // that preempts the caller on a busy machine and costs more than a small message.
      wake = !inline_active_ && !dozing_;
    }
  }
  if (wake) cv_.notify_all();
  if (!refused.ok()) {
    if (start_failed && breaks_comm(refused)) fail(refused);
    state->complete(std::move(refused));
  }
  return CommWork(std::move(state));
}

void CommQueue::begin_wait() {
  bool wake = false;
  {
    std::lock_guard lock(mu_);
    ++waiters_;
    // The thread may be leaving a fresh operation to its submitter: that is over now.
    wake = !worker_active_;
  }
  if (wake) cv_.notify_all();
}

void CommQueue::end_wait() {
  std::lock_guard lock(mu_);
  --waiters_;
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
  // Checked before every operation starts: the flag spares the lock while nothing failed. An
  // operation that starts as another fails is one the failure did not precede.
  if (!broken_.load(std::memory_order_acquire)) return ok_status();
  std::lock_guard lock(mu_);
  return failure_;
}

Status CommQueue::cancelled_by(const Status& earlier) const {
  return cancelled("not run: an earlier operation on " + label_ + " failed: " + earlier.to_string());
}

// A caller's mistake (kInvalidArgument: a recv of the wrong count) leaves the library and the
// peers in a known state; anything else (a timeout, an MPI error) may not.
bool CommQueue::breaks_comm(const Status& s) { return !s.ok() && s.code() != StatusCode::kInvalidArgument; }

void CommQueue::fail(const Status& s) {
  {
    std::lock_guard lock(mu_);
    if (!failure_.ok()) return;
    failure_ = s;
    broken_.store(true, std::memory_order_release);
  }
  if (on_failure_) on_failure_(s);
}

std::chrono::nanoseconds PollPacer::next_at(std::chrono::steady_clock::time_point now) {
  if (!waiting_) {
    waiting_ = true;
    hot_ = true;
    since_ = now;
    return std::chrono::nanoseconds(0);
  }
  const auto waited = now - since_;
  hot_ = waited < hot_span_;
  // The yielding window follows the hot one (kSpin - kHotSpin long); sleeps after it, each an
  // eighth of the time waited.
  if (waited < hot_span_ + (kSpin - kHotSpin)) return std::chrono::nanoseconds(0);
  return std::min<std::chrono::nanoseconds>(waited / 8, kMaxSleep);
}

void PollPacer::pause() { pause_at(std::chrono::steady_clock::now()); }

void PollPacer::pause_at(std::chrono::steady_clock::time_point now) {
  const std::chrono::nanoseconds d = next_at(now);
  if (hot_at(now)) return;
  if (d.count() == 0) {
    std::this_thread::yield();
  } else {
    sleep(d);
  }
}

void PollPacer::sleep(std::chrono::nanoseconds d) {
  if (slack_saved_ < 0) {
    const int was = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
    if (was >= 0 && prctl(PR_SET_TIMERSLACK, kSleepSlackNs, 0, 0, 0) == 0) slack_saved_ = was;
  }
  std::this_thread::sleep_for(d);
}

void PollPacer::restore_timer_slack() {
  prctl(PR_SET_TIMERSLACK, slack_saved_, 0, 0, 0);
  slack_saved_ = -1;
}

bool CommQueue::poll_once(std::vector<InFlight>& list) {
  bool progressed = false;
  for (std::size_t i = 0; i < list.size();) {
    Result<bool> done = list[i].poll();
    if (done.ok() && !*done) {
      ++i;
      continue;
    }
    Status s = done.status();
    if (breaks_comm(s)) fail(s);
    list[i].state->complete(std::move(s));
    list.erase(list.begin() + static_cast<std::ptrdiff_t>(i));
    progressed = true;
  }
  return progressed;
}

bool CommQueue::poll_in_flight(bool until_empty) {
  bool progressed = false;
  while (!in_flight_.empty()) {
    if (poll_once(in_flight_)) {
      progressed = true;
      pacer_.reset();
    }
    if (!until_empty) return progressed;
    if (!in_flight_.empty() && !pacer_.skip_clock()) pacer_.pause();
  }
  return progressed;
}

void CommQueue::start_async(Entry& e, std::vector<InFlight>& list) {
  if (Status earlier = earlier_failure(); !earlier.ok()) {
    e.state->complete(cancelled_by(earlier));
    return;
  }
  Result<Poll> poll = e.start();
  if (!poll.ok()) {
    if (breaks_comm(poll.status())) fail(poll.status());
    e.state->complete(poll.status());
    return;
  }
  list.push_back(InFlight{std::move(e.state), std::move(*poll)});
}

void CommQueue::execute(Entry& e) {
  if (Status earlier = earlier_failure(); !earlier.ok()) {
    e.state->complete(cancelled_by(earlier));
    return;
  }
  Status s = e.op();
  if (breaks_comm(s)) fail(s);
  e.state->complete(std::move(s));
}

bool CommQueue::run_inline(WorkState* state) {
  bool left_behind = false;
  std::uint64_t submits_seen = 0;
  {
    std::lock_guard lock(mu_);
    // Nobody runs the queue, so it is in_flight_ (started: posted directly by their submitters,
    // or handed over and not yet taken by the thread) followed by pending_, and taking all of
    // in_flight_ and a prefix of pending_ in order is what the thread would do next: a blocking
    // operation of the prefix starts once what was in flight before it has completed (settle).
    if (worker_active_ || inline_active_) return false;
    const bool started = std::any_of(in_flight_.begin(), in_flight_.end(),
                                     [&](const InFlight& f) { return f.state.get() == state; });
    std::size_t take = 0;  // entries of pending_ to run
    if (started) {
      // A queued operation behind it must start as soon as it may, which this wait would delay:
      // it is the thread's (begin_wait wakes it).
      if (!pending_.empty()) return false;
    } else {
      while (take < pending_.size() && take < kMaxInlineEntries && pending_[take].state.get() != state) ++take;
      if (take == pending_.size() || take == kMaxInlineEntries) return false;
      ++take;
    }
    for (InFlight& f : in_flight_) inline_flight_.push_back(std::move(f));
    in_flight_.clear();
    handed_over_ = false;
    inline_batch_.clear();
    for (std::size_t i = 0; i < take; ++i) {
      inline_batch_.push_back(std::move(pending_.front()));
      pending_.pop_front();
    }
    inline_active_ = true;
    // Operations left behind must start as soon as `state`'s own have (see below); so must one
    // submitted while this runs, which the poll loop notices by the count, without mu_.
    left_behind = !pending_.empty();
    submits_seen = submits_.load(std::memory_order_relaxed);
  }
  // As run() would: asynchronous operations start at once, a blocking one after everything
  // before it (here: what this batch started) has completed.
  PollPacer pacer;
  const auto settle = [&] {
    while (!inline_flight_.empty()) {
      if (poll_once(inline_flight_)) {
        pacer.reset();
      } else if (!pacer.skip_clock()) {
        pacer.pause();
      }
    }
  };
  for (Entry& e : inline_batch_) {
    if (e.op) {
      settle();
      execute(e);
    } else {
      start_async(e, inline_flight_);
    }
  }
  inline_batch_.clear();
  // Poll what this batch started until `state` completes. Operations submitted meanwhile (by
  // another thread) must start now, as with the queue thread, not after this wait (a peer may
  // need them to send what `state` receives): hand everything to the queue thread then.
  pacer.reset();
  while (!left_behind && !inline_flight_.empty() && !state->finished()) {
    if (poll_once(inline_flight_)) {
      pacer.reset();
      continue;
    }
    if (submits_.load(std::memory_order_relaxed) != submits_seen) break;
    if (!pacer.skip_clock()) pacer.pause();
  }
  // What is left is usually a send the library marks done at its next progress call: poll it
  // through the hot window before handing it over (the queue thread's wake-up, and the caller's
  // later wait for it, would cost the two hand-offs this function exists to avoid).
  pacer.reset();
  while (!inline_flight_.empty()) {
    poll_once(inline_flight_);
    if (inline_flight_.empty() || pacer.skip_clock()) continue;
    const auto now = std::chrono::steady_clock::now();
    pacer.next_at(now);  // the first read starts the hot window
    if (!pacer.hot_at(now)) break;
  }
  bool wake = false;
  {
    std::lock_guard lock(mu_);
    // Still in flight (a recv not waited for yet, a slow send): the queue thread polls it. It
    // sleeps (inline_active_ kept it so) with in_flight_ empty.
    for (InFlight& f : inline_flight_) in_flight_.push_back(std::move(f));
    inline_flight_.clear();
    handed_over_ = !in_flight_.empty();
    inline_active_ = false;
    // Wake the thread only for work (or to stop): with nothing handed over or pending its wake-up
    // condition is false, and the wake-up would cost the scheduler round trip this function
    // exists to avoid (measured: half of a 1 KiB operation's time, docs/parallel.md).
    wake = !in_flight_.empty() || !pending_.empty() || stopping_;
  }
  if (wake) cv_.notify_all();
  return true;
}

void CommQueue::run() {
  // Its dozes and paced polls are short timed waits: keep them short (PollPacer::kSleepSlackNs).
  prctl(PR_SET_TIMERSLACK, PollPacer::kSleepSlackNs, 0, 0, 0);
  for (;;) {
    Entry e;
    {
      std::unique_lock lock(mu_);
      if (in_flight_.empty()) {
        worker_active_ = false;
        const auto ready = [&] {
          return (stopping_ || !pending_.empty() || !in_flight_.empty()) && !inline_active_;
        };
        // Dozing (see kDoze, tick_): timed waits while operations keep coming, so that a submit
        // need not wake the thread, kPark while a caller runs them itself; then one wait until
        // woken. Fresh work (a queued operation, or one its submitter posted directly, less than
        // tick_ ago) is left to its submitter while nobody sleeps on a handle; work handed over
        // by a caller's inline run is taken at once.
        for (;;) {
          const auto now = std::chrono::steady_clock::now();
          if (ready()) {
            if (stopping_ || handed_over_ || waiters_ > 0) break;
            auto since = std::chrono::steady_clock::time_point::max();
            if (!pending_.empty()) since = pending_.front().submitted;
            if (!in_flight_.empty()) since = std::min(since, unclaimed_since_);
            if (now >= since + tick_) {
              tick_ = kDoze;  // nobody took it: the submitters do not wait, be prompt again
              break;
            }
            dozing_ = true;
            const bool timed_out = cv_.wait_until(lock, since + tick_) == std::cv_status::timeout;
            dozing_ = false;
            if (timed_out && pending_.empty() && in_flight_.empty()) tick_ = std::min(2 * tick_, kPark);
            continue;
          }
          if (now >= doze_until_) {
            // Until woken; then doze again if that was a submit the caller ran itself. A quiet
            // spell ends what the ticks learned.
            tick_ = kDoze;
            cv_.wait(lock);
            continue;
          }
          dozing_ = true;
          const bool timed_out = cv_.wait_until(lock, std::min(now + (inline_active_ ? kPark : tick_),
                                                               doze_until_)) == std::cv_status::timeout;
          dozing_ = false;
          // Woken by its timer with nothing to do: the callers ran everything themselves.
          if (timed_out && pending_.empty() && in_flight_.empty()) tick_ = std::min(2 * tick_, kPark);
        }
        handed_over_ = false;  // the thread owns in_flight_ now
        worker_active_ = true;
      }
      if (pending_.empty()) {
        if (in_flight_.empty()) return;  // stopping, and everything queued has completed
        lock.unlock();
        poll_in_flight(false);
        if (in_flight_.empty() || pacer_.skip_clock()) continue;
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
    start_async(e, in_flight_);
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
  // Once done is set nothing writes the status again: no lock needed to read it.
  if (state_->finished()) return state_->status;
  // Not null: only a queued operation's handle can be unfinished (finished_work completes first).
  detail::CommQueue* queue = state_->queue;
  queue->run_inline(state_.get());
  if (state_->finished()) return state_->status;
  queue->begin_wait();
  state_->sleep_until_done();
  queue->end_wait();
  return state_->status;
}

bool CommWork::test() const { return !state_ || state_->finished(); }

}  // namespace strata
