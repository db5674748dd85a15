// PollPacer: how a comm backend's polling loop waits between polls (docs/parallel.md "Waiting
// without burning a core"). Its own header, free of MPI and CUDA, so both backends and the unit
// test (tests/test_parallel_comm.cpp) share the one rule.
#pragma once

#include <algorithm>
#include <chrono>

namespace strata::detail {

// Paces a thread that polls requests (MPI requests, CUDA events) until one completes. Waiting
// has to be polling: a blocking MPI call cannot be interrupted at the deadline, and MPI offers no
// wake-up on completion. Spinning for the whole wait, though, takes a core from compute, copies and the host
// optimizer on a machine where they share a few cores with every rank's comm threads (a
// pipeline stage waiting for its neighbour, a rank waiting in a collective for a slower peer).
// So: poll back to back for kSpin after the last progress, which covers a message already on
// its way and most operations below ~1 MiB (a sleep, with the kernel's ~50 us timer slack and the
// wake-up on a loaded machine, costs more than such an operation). The first kHotSpin of it
// polls without giving up the core, as the MPI library's own blocking calls do: on a loaded
// machine a yield hands the core to another process for the rest of its time slice
// (milliseconds), far longer than the message it waits for takes (measured in docs/parallel.md
// "Small messages and all_gather"); the rest of the window yields between polls, so that an
// oversubscribed machine (more ranks than cores) keeps moving. Then sleep
// between polls, each sleep an eighth of the time waited so far and at most kMaxSleep, so a wait
// finishes at most ~12% (and at most kMaxSleep plus the timer slack) after the request did, and
// a long wait costs one short wake-up per kMaxSleep instead of a busy core. reset() after
// progress. Owned by one polling thread. Both backends use it: the mpi backend around MPI_Test,
// the nccl backend around cudaEventQuery (a CUDA event has a blocking wait, but it cannot be
// interrupted at the deadline either, and with the default flags it spins too).
class PollPacer {
 public:
  static constexpr std::chrono::microseconds kHotSpin{50};
  static constexpr std::chrono::microseconds kSpin{500};
  static constexpr std::chrono::microseconds kMaxSleep{100};

  // The clock is not read for every poll: a read (~25 ns here) costs about what a poll of the
  // shared-memory transport does, and a loop that read it per poll spent a sixth of a 1 KiB
  // send/recv's time in it (docs/parallel.md "Small messages without hand-offs"). After reset()
  // the first kHotPolls polls read none; then, while the last read found the wait inside
  // kHotSpin, one poll in kPollsPerRead does.
  static constexpr int kHotPolls = 32;
  static constexpr int kPollsPerRead = 8;
  // The timer slack of a thread while it sleeps between polls (the comm queue threads keep it
  // always). Linux lets a sleep overrun by the thread's slack, 50 us by default: here a 12 us
  // sleep took ~80 us and a 100 us one ~170 us (1 us of slack: ~32 and ~125 us), so a wait for a
  // 2.5 ms broadcast saw its completion up to ~170 us late instead of about kMaxSleep
  // (docs/parallel.md "Waiting without burning a core").
  static constexpr long kSleepSlackNs = 1000;

  // The longest transfer time expect() lets a wait poll through without pacing.
  static constexpr std::chrono::milliseconds kMaxExpected{20};

  PollPacer() = default;
  PollPacer(const PollPacer&) = delete;
  PollPacer& operator=(const PollPacer&) = delete;
  ~PollPacer() {
    if (slack_saved_ >= 0) restore_timer_slack();
  }

  // The operation being waited for moves about `d` worth of bytes through this rank (its own
  // transfer time, not a late peer): the hot window lasts max(kHotSpin, d) (at most
  // kMaxExpected) and the yielding window as long after it as usual. Without it a 64 MiB
  // all_gather on 2 ranks, whose ranks wait for each other's copies for milliseconds, yielded
  // and slept through them and took ~10% longer than MPI's blocking call, which polls
  // throughout (docs/parallel.md "Waiting without burning a core"). Kept across reset().
  void expect(std::chrono::nanoseconds d) {
    hot_span_ = std::max<std::chrono::nanoseconds>(kHotSpin, std::min<std::chrono::nanoseconds>(d, kMaxExpected));
  }

  void reset() {
    waiting_ = false;
    hot_ = true;
    polls_ = 0;
    if (slack_saved_ >= 0) restore_timer_slack();
  }
  // Called after each unsuccessful poll: true when the next poll may follow at once, without
  // reading the clock (nor checking a deadline, which so few polls overrun by microseconds at
  // most); false when the caller should read it and pace (pause_at, next_at).
  bool skip_clock() {
    ++polls_;
    return polls_ <= kHotPolls || (hot_ && polls_ % kPollsPerRead != 0);
  }
  // Whether the wait, as of `now`, is still inside its first kHotSpin (poll again at once, no
  // yield). True before the wait has started (the first next_at starts it).
  bool hot_at(std::chrono::steady_clock::time_point now) const {
    return !waiting_ || now - since_ < hot_span_;
  }
  // How long to wait before the next poll: zero (just yield) within the spin window.
  std::chrono::nanoseconds next() { return next_at(std::chrono::steady_clock::now()); }
  // next() at the given time (the rule itself, testable without a clock): the first call after
  // reset() starts the wait at `now`. Records whether `now` is inside kHotSpin (skip_clock).
  std::chrono::nanoseconds next_at(std::chrono::steady_clock::time_point now);
  // Waits next(): returns at once inside the hot window, else yields or sleeps.
  void pause();
  // pause() with the clock already read (a poll loop that checks its deadline reads it once).
  void pause_at(std::chrono::steady_clock::time_point now);

 private:
  // The thread's timer slack is kSleepSlackNs from the wait's first sleep until reset() or the
  // destructor puts back the value it had (slack_saved_, -1: not changed).
  void sleep(std::chrono::nanoseconds d);
  void restore_timer_slack();
  long slack_saved_ = -1;

  bool waiting_ = false;
  bool hot_ = true;  // as of the last next_at: inside the hot window
  // The hot window: kHotSpin, or the transfer time expect() was given.
  std::chrono::nanoseconds hot_span_ = kHotSpin;
  int polls_ = 0;
  std::chrono::steady_clock::time_point since_;
};

}  // namespace strata::detail
