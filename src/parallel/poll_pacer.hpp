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
// So: poll back to back (yielding) for kSpin after the last progress, which covers a message
// already on its way and most operations below ~1 MiB (a sleep, with the kernel's ~50 us timer
// slack and the wake-up on a loaded machine, costs more than such an operation); then sleep
// between polls, each sleep an eighth of the time waited so far and at most kMaxSleep, so a wait
// finishes at most ~12% (and at most kMaxSleep plus the timer slack) after the request did, and
// a long wait costs one short wake-up per kMaxSleep instead of a busy core. reset() after
// progress. Owned by one polling thread. Both backends use it: the mpi backend around MPI_Test,
// the nccl backend around cudaEventQuery (a CUDA event has a blocking wait, but it cannot be
// interrupted at the deadline either, and with the default flags it spins too).
class PollPacer {
 public:
  static constexpr std::chrono::microseconds kSpin{500};
  static constexpr std::chrono::microseconds kMaxSleep{100};

  void reset() { waiting_ = false; }
  // How long to wait before the next poll: zero (just yield) within the spin window.
  std::chrono::nanoseconds next() { return next_at(std::chrono::steady_clock::now()); }
  // next() at the given time (the rule itself, testable without a clock): the first call after
  // reset() starts the wait at `now`.
  std::chrono::nanoseconds next_at(std::chrono::steady_clock::time_point now);
  // Waits next(): yields or sleeps.
  void pause();

 private:
  bool waiting_ = false;
  std::chrono::steady_clock::time_point since_;
};

}  // namespace strata::detail
