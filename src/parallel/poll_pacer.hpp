// PollPacer: how a comm backend's polling loop waits between polls (docs/parallel.md "Waiting
// without burning a core"). Its own header, free of MPI and CUDA, so both backends and the unit
// test (tests/test_parallel_comm.cpp) share the one rule.
#pragma once

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

  void reset() { waiting_ = false; }
  // Whether the wait, as of `now`, is still inside its first kHotSpin (poll again at once, no
  // yield). True before the wait has started (the first next_at starts it).
  bool hot_at(std::chrono::steady_clock::time_point now) const {
    return !waiting_ || now - since_ < kHotSpin;
  }
  // How long to wait before the next poll: zero (just yield) within the spin window.
  std::chrono::nanoseconds next() { return next_at(std::chrono::steady_clock::now()); }
  // next() at the given time (the rule itself, testable without a clock): the first call after
  // reset() starts the wait at `now`.
  std::chrono::nanoseconds next_at(std::chrono::steady_clock::time_point now);
  // Waits next(): returns at once inside the hot window, else yields or sleeps.
  void pause();
  // pause() with the clock already read (a poll loop that checks its deadline reads it once).
  void pause_at(std::chrono::steady_clock::time_point now);

 private:
  bool waiting_ = false;
  std::chrono::steady_clock::time_point since_;
};

}  // namespace strata::detail
